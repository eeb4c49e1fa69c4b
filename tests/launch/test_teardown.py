"""A DDP script without teardown lines exits with the loop's code: at interpreter exit the library
frees DDP's reducer, then destroys the default process group (torch 2.13 + gloo could otherwise
abort a rank with SIGABRT while finalising)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "ddp_no_teardown.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,code", [("done", ExitCode.DONE), ("preempt", ExitCode.PREEMPTED), ("raise", ExitCode.FAILED)])
def test_ddp_script_without_teardown_lines_exits_with_the_loops_code(tmp_path, capfd, mode, code):
    with launch([sys.executable, str(SCRIPT), str(tmp_path), mode], 2, env={"OMP_NUM_THREADS": "1"}, failure_grace_s=20.0) as group:
        group.wait(timeout=120)
        codes = [proc.returncode for proc in group.procs]
    out = capfd.readouterr().out
    assert codes == [code, code], f"exit codes {codes} (a negative code is a signal: -6 is SIGABRT)"
    for rank in (0, 1):
        assert f"rank {rank}: at exit group_alive=False reducer_alive=False" in out
