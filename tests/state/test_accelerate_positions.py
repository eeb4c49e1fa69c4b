"""Accelerate's prepared loaders resumed at an epoch's end and mid-epoch, in one process
(``tests/helpers/accelerate_positions.py``). Found by the Accelerate example: under one process
``use_stateful_dataloader`` drew the epoch's shuffle again from the resume-time global RNG (the
saved ``epoch_rng`` was left out for a loader with its own state); at an epoch's end the prepared
loader's lazy iterator never ran, so the sampler's generator stayed at the epoch's start (the next
epoch repeated its order) and torchdata's loader handed the next epoch its construction-time
iterator (one global RNG draw short: other dropout). The 2-rank runs are
``tests/integrations/test_accelerate_example.py``'s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "accelerate_positions.py"


@pytest.mark.timeout(120)
def test_accelerate_prepared_loaders_resume_exactly_at_an_epoch_end_and_mid_epoch_in_both_modes():
    out = subprocess.run([sys.executable, str(HELPER)], capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, "resumed differently: " + out.stderr[-3000:]
