"""A changed batch size at resume: the epoch continues exactly (every sample once, the same
per-step samples as an uninterrupted run at the new size) or the resume is refused with exit 2
before any step; ``global_step`` and the LR scheduler's step keep counting optimizer steps.

Real processes (``helpers/sample_train.py``: 48 samples, the global batch derived from the
loader's batch size x world size since ``step_scheduler.global_batch_size`` is null).
"""

from __future__ import annotations

import pytest
from sample_runs import run, steps

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.manifest import validate
from resilience.checkpoint.pointers import read_pointer

pytestmark = pytest.mark.multiproc
EPOCH = list(range(48))


def check_counters(seen: dict[int, dict]) -> None:
    assert list(seen) == list(range(1, len(seen) + 1)), "global_step counts every optimizer step, never going back"
    assert all(row["lr_step"] == step for step, row in seen.items()), "the LR scheduler's step equals global_step"


@pytest.mark.timeout(300)
def test_a_plain_dataloader_resumed_with_a_larger_batch_sees_every_sample_of_the_epoch_once(tmp_path):
    ckpt = tmp_path / "ck"
    assert run(tmp_path / "ref", tmp_path / "ref.rec", batch=6) == [ExitCode.DONE]
    reference = steps(tmp_path / "ref.rec")  # uninterrupted at batch 6: 8 steps

    assert run(ckpt, tmp_path / "a.rec", batch=4, overrides=["step_scheduler.max_steps=3"]) == [ExitCode.DONE]

    # 12 samples consumed: not a whole number of batches of 8 -> refused before any step, nothing touched
    assert run(ckpt, tmp_path / "refused.rec", batch=8) == [ExitCode.CONFIG_ERROR]
    assert steps(tmp_path / "refused.rec") == {}
    assert read_pointer(ckpt, LATEST).name == "epoch_0_step_3"

    assert run(ckpt, tmp_path / "b.rec", batch=6) == [ExitCode.DONE]
    first, resumed = steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec")
    seen = {**first, **resumed}
    check_counters(seen)
    assert sorted(i for row in seen.values() for i in row["ids"]) == EPOCH, "every sample of the epoch exactly once"
    assert sorted(i for row in first.values() for i in row["ids"]) == sorted(i for row in list(reference.values())[:2] for i in row["ids"])
    assert [row["ids"] for row in resumed.values()] == [row["ids"] for row in reference.values()][2:]
    assert read_pointer(ckpt, LATEST).name == "epoch_0_step_9"  # above the checkpoint it resumed from
    assert validate(ckpt / "epoch_0_step_3")["meta"]["global_batch_size"] == 4  # derived: batch 4 x 1 rank
    assert validate(ckpt / "epoch_0_step_9")["meta"]["global_batch_size"] == 6


@pytest.mark.timeout(300)
def test_a_two_rank_stateful_loader_resumed_elastic_on_one_rank_with_a_larger_batch_sees_every_sample_once(tmp_path):
    ckpt, elastic = tmp_path / "ck", "checkpoint.world_size_change=elastic"
    assert run(tmp_path / "ref", tmp_path / "ref.rec", loader="stateful", batch=6) == [ExitCode.DONE]
    reference = steps(tmp_path / "ref.rec")

    assert run(ckpt, tmp_path / "a.rec", 2, loader="stateful", batch=2, overrides=["step_scheduler.max_steps=3"]) == [ExitCode.DONE] * 2

    assert run(ckpt, tmp_path / "refused.rec", loader="stateful", batch=8, overrides=[elastic]) == [ExitCode.CONFIG_ERROR]
    assert steps(tmp_path / "refused.rec") == {}

    assert run(ckpt, tmp_path / "b.rec", loader="stateful", batch=6, overrides=[elastic]) == [ExitCode.DONE]
    first, resumed = steps(tmp_path / "a.rec", 2), steps(tmp_path / "b.rec")
    seen = {**first, **resumed}
    check_counters(seen)
    assert sorted(i for row in seen.values() for i in row["ids"]) == EPOCH, "every sample of the epoch exactly once"
    assert sorted(i for row in first.values() for i in row["ids"]) == sorted(i for row in list(reference.values())[:2] for i in row["ids"])
    assert [row["ids"] for row in resumed.values()] == [row["ids"] for row in reference.values()][2:]
    assert validate(ckpt / "epoch_0_step_3")["meta"]["global_batch_size"] == 4  # derived: batch 2 x 2 ranks
