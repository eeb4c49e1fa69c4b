"""The stop agreement on node groups under resilient_loop(): 4 real ranks as 2 "nodes" of 2 (one
launcher per node, so ``GROUP_RANK`` 0 and 1); a signal to one rank stops all four at one step,
and the resumed run equals an uninterrupted one on the same 2 nodes whose agreement is the flat
ring (``agreement_nodes=flat``: the fallback still works): every loss and learning rate bitwise.

The final weights match to within float32 rounding only, with either agreement: at 4 ranks the
first step of a resumed process sums the 4 ranks' gradients (DDP over gloo) in another order than
the uninterrupted process does, 1 ulp apart (2 ranks sum a + b, the same either way). Seen here
with ``agreement_nodes=flat`` on both runs too, so it is not the agreement's; likely DDP's bucket
rebuild after a process's first iteration.

``helpers/phase_train.py`` (as the 2-rank stop tests use it): 160 samples over 4 ranks, 5 steps an
epoch, 2 epochs, a save every 4 steps, agreement every step; it pauses every rank in a named step
until the test, having signalled, releases it.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST, MODEL_DIR
from resilience.launch import launch, resolve_master_port
from runs import compare

pytestmark = pytest.mark.multiproc
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "phase_train.py"
WORLD = 4


def all_weights(ckpt: Path) -> dict:
    """Every tensor of ``LATEST``'s model shards: 4 ranks share the replicated weights out between them."""
    weights: dict = {}
    for path in sorted((ckpt / LATEST / MODEL_DIR).glob("shard-*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def _run_two_nodes(ckpt: Path, *, pause_at: str = "", overrides=(), signal_rank3=False) -> list[int]:
    """phase_train on 2 launchers of 2 ranks; with ``signal_rank3``, once every rank paused at
    ``pause_at``, SIGUSR1 to rank 3 alone (node 1's local rank 1), then release them."""
    events = ckpt.parent / f"events-{ckpt.name}-{time.monotonic_ns()}"
    cmd = [sys.executable, str(HELPER), str(ckpt), str(events), *overrides]
    env = {"OMP_NUM_THREADS": "1", "PAUSE_AT": pause_at}
    port = resolve_master_port(None, {})
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(launch(cmd, 2, nnodes=2, node_rank=n, master_port=port, env=env, failure_grace_s=60.0)) for n in (0, 1)]
        deadline = time.monotonic() + 240
        if signal_rank3:
            while not all((events / f"rank_{r}.events").exists() and f"pause {pause_at}" in (events / f"rank_{r}.events").read_text() for r in range(WORLD)):
                assert time.monotonic() < deadline, f"the ranks never paused at {pause_at}"
                time.sleep(0.02)
            nodes[1].procs[1].send_signal(signal.SIGUSR1)
            (events / f"release_{pause_at}").touch()
        while any(code is None for node in nodes for code in node.returncodes):
            assert time.monotonic() < deadline, "the 2-node run did not end"
            time.sleep(0.02)
        return [proc.returncode for node in nodes for proc in node.procs]


@pytest.mark.timeout(600)
def test_a_signal_to_one_rank_of_two_nodes_stops_all_four_at_one_step_and_the_resume_is_exact(tmp_path, capfd):
    reference = tmp_path / "reference"
    assert _run_two_nodes(reference, overrides=["step_scheduler.agreement_nodes=flat"]) == [ExitCode.DONE] * WORLD

    ckpt = tmp_path / "ck"
    codes = _run_two_nodes(ckpt, pause_at="step:6", signal_rank3=True)
    err = capfd.readouterr().err
    assert codes == [ExitCode.PREEMPTED] * WORLD, (codes, err[-3000:])
    stops = dict(re.findall(r"rank (\d): stop agreed at step (\d+)", err))
    assert stops == {str(r): "7" for r in range(WORLD)}, stops  # a signal in step t: every rank stops after t + 1 (k = 1)

    assert _run_two_nodes(ckpt) == [ExitCode.DONE] * WORLD  # resumed, on node groups again
    result = compare(ckpt, reference, weights=all_weights)
    assert result.losses_equal and result.lrs_equal and result.steps == 10, result.detail
    ours, theirs = all_weights(ckpt), all_weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-7) for k in ours)
