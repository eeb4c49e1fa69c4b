"""`make demo` must report "identical" by comparing, and fail when it is not."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "digits" / "demo.py"
LLM_DEMO = DEMO.parents[1] / "llm" / "demo.py"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_demo_preempts_one_rank_resumes_and_reports_identical():
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "exit codes per rank: [75, 75]" in out
    assert "RESULT: identical" in out
    assert "DIFFERENT" not in out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_llm_demo_preempts_one_fsdp2_rank_resumes_reports_identical_and_generates_from_the_bundle():
    # the default format: each rank its safetensors shards; the final save builds the bundle from them
    proc = subprocess.run([sys.executable, str(LLM_DEMO)], capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "exit codes per rank: [75, 75]" in out
    assert "RESULT: identical" in out and "DIFFERENT" not in out
    assert "weights equal to the trained ones: yes" in out
    assert "model/consolidated (written by the final save (checkpoint.save_consolidated))" in out
    assert re.search(r"greedy continuation of 'import os\\n': 'import os\\n.+'", out), out


def test_the_digits_examples_own_reader_returns_exactly_what_sklearn_load_digits_does():
    # The example reads scikit-learn's file itself (no scipy import on every restart); the data
    # must stay bit for bit what load_digits() gives, or the demo would train on something else.
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_load_digits

    from train import load_digits

    pixels, labels = load_digits()
    reference = sklearn_load_digits()
    assert pixels.dtype == reference.data.dtype and pixels.shape == (1797, 64)
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)
    assert labels.dtype == reference.target.dtype
