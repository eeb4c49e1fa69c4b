"""What a user sees: without logging set up, rank 0 prints each save and the resume on stderr;
a program that configured logging gets them through its own handlers and levels only."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    from resilience import resilient_loop
    setup = sys.argv[2]
    if setup == "info":
        logging.basicConfig(level=logging.INFO, format="PROGRAM %(name)s %(message)s")
    cfg = {"checkpoint": {"checkpoint_dir": sys.argv[1]}, "step_scheduler": {"max_steps": 4, "ckpt_every_steps": 2}}
    for run in range(2):  # the second loop resumes from the first one's last checkpoint
        model = torch.nn.Linear(2, 1)
        loop = resilient_loop(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataloader=[torch.ones(1, 2)] * 8)
        with loop:
            for step in loop:
                pass
        cfg["step_scheduler"]["max_steps"] = 6
""")


def _stderr(tmp_path, setup: str) -> str:
    env_free = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck"), setup], capture_output=True, text=True, timeout=120, env=env_free)
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.mark.timeout(300)
def test_saves_and_the_resume_reach_stderr_without_logging_and_through_the_programs_logging_otherwise(tmp_path):
    plain = [line for line in _stderr(tmp_path / "plain", "none").splitlines() if line.startswith("[resilience]")]
    assert [line.split(" (")[0] for line in plain] == [
        "[resilience] saved epoch_0_step_2",
        "[resilience] saved epoch_0_step_4",
        f"[resilience] resumed from {tmp_path / 'plain' / 'ck' / 'epoch_0_step_4'}",
        "[resilience] saved epoch_0_step_6",
    ], plain
    assert "; LATEST -> epoch_0_step_2" in plain[0] and "rank 0 wrote" in plain[0]

    info = _stderr(tmp_path / "info", "info")
    assert "[resilience]" not in info  # through the program's handler, once
    assert info.count("PROGRAM resilience.checkpoint saved epoch_0_step_") == 3 and info.count("PROGRAM resilience resumed from") == 1, info
