"""`make demo` must report "identical" by comparing, and fail when it is not."""

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "digits" / "demo.py"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_demo_preempts_one_rank_resumes_and_reports_identical():
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "exit codes per rank: [75, 75]" in out
    assert "RESULT: identical" in out
    assert "DIFFERENT" not in out
