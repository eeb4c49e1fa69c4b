"""Resuming under another world size: refused by default (strict), resumed when elastic."""

import json

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import validate
from runs import latest_name, run

pytestmark = pytest.mark.multiproc
SHORT = ["step_scheduler.num_epochs=2"]  # 22 global batches of 64 per epoch at any world size


@pytest.mark.timeout(240)
def test_a_two_rank_checkpoint_resumes_on_one_rank_only_when_elastic(tmp_path, capfd):
    first = run(tmp_path, 2, overrides=SHORT, signal_rank=0, signal_at_step=10)
    assert first.codes == [ExitCode.PREEMPTED] * 2
    saved = latest_name(tmp_path)
    validate(tmp_path / saved)

    strict = run(tmp_path, 1, overrides=SHORT)
    err = capfd.readouterr().err
    assert strict.codes == [ExitCode.CONFIG_ERROR], "refused at resilient_loop(), as a configuration error (exit 2)"
    assert "checkpoint.world_size_change=strict" in err and "saved with world size 2, this run has 1" in err
    assert "checkpoint.world_size_change=elastic" in err
    assert latest_name(tmp_path) == saved, "a refused resume must not touch the checkpoint"

    elastic = run(tmp_path, 1, overrides=[*SHORT, "checkpoint.world_size_change=elastic"])
    assert elastic.codes == [ExitCode.DONE]
    rows = [json.loads(line) for line in (tmp_path / "training.jsonl").read_text().splitlines()]
    steps = [row["global_step"] for row in rows]
    assert steps == list(range(1, 45)), "the resumed run continues at the next global step and ends at 44"


@pytest.mark.timeout(240)
def test_strict_refusal_is_a_config_error_on_every_rank_before_any_step(tmp_path, capfd):
    assert run(tmp_path, 1, overrides=[*SHORT, "step_scheduler.max_steps=3"]).codes == [ExitCode.DONE]
    rows_before = (tmp_path / "training.jsonl").read_text()
    refused = run(tmp_path, 2, overrides=SHORT)
    err = capfd.readouterr().err
    assert refused.codes == [ExitCode.CONFIG_ERROR] * 2, "every rank refuses at resilient_loop(), none waits in a collective"
    assert err.count("saved with world size 1, this run has 2") == 2 and "checkpoint.world_size_change" in err
    assert (tmp_path / "training.jsonl").read_text() == rows_before, "nothing trained"
