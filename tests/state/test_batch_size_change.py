"""A changed batch size at resume: the epoch continues exactly (every sample once, the same
per-step samples as an uninterrupted run at the new size) or the resume is refused with exit 2
before any step; ``global_step`` and the LR scheduler's step keep counting optimizer steps.

Real processes (``helpers/sample_train.py``: 48 samples, the global batch derived from the
loader's batch size x world size since ``step_scheduler.global_batch_size`` is null).
"""

from __future__ import annotations

import pytest

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.storage.pointers import read_pointer
from sample_runs import run, steps

EPOCH = list(range(48))


def check_counters(seen: dict[int, dict]) -> None:
    assert list(seen) == list(range(1, len(seen) + 1)), "global_step counts every optimizer step, never going back"
    assert all(row["lr_step"] == step for step, row in seen.items()), "the LR scheduler's step equals global_step"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader", ["plain", "stateful_shuffle"])
def test_a_one_rank_loader_resumed_with_a_larger_batch_sees_every_sample_of_the_epoch_once(tmp_path, loader):
    """``plain``: ``DataLoader(shuffle=True)``; ``stateful_shuffle``: ``StatefulDataLoader(shuffle=True)``
    (its own state counts old batches: the epoch's order is replayed from the saved RNG instead).
    The change happens in the second epoch, whose order a fresh process would not draw again."""
    ckpt, epochs = tmp_path / "ck", "step_scheduler.num_epochs=2"
    assert run(tmp_path / "ref", tmp_path / "ref.rec", loader=loader, batch=6, overrides=[epochs]) == [ExitCode.DONE]
    reference = list(steps(tmp_path / "ref.rec").values())  # uninterrupted at batch 6: 8 steps an epoch

    # 12 steps of epoch 0, then 3 of epoch 1
    assert run(ckpt, tmp_path / "a.rec", loader=loader, batch=4, overrides=[epochs, "step_scheduler.max_steps=15"]) == [ExitCode.DONE]

    # 12 samples of epoch 1 consumed: not a whole number of batches of 8 -> refused before any step, nothing touched
    assert run(ckpt, tmp_path / "refused.rec", loader=loader, batch=8, overrides=[epochs]) == [ExitCode.CONFIG_ERROR]
    assert steps(tmp_path / "refused.rec") == {}
    assert read_pointer(ckpt, LATEST).name == "epoch_1_step_15"

    assert run(ckpt, tmp_path / "b.rec", loader=loader, batch=6, overrides=[epochs]) == [ExitCode.DONE]
    first, resumed = steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec")
    check_counters({**first, **resumed})
    epoch_1 = [*list(first.values())[12:], *resumed.values()]
    assert sorted(i for row in epoch_1 for i in row["ids"]) == EPOCH, "every sample of the epoch exactly once"
    assert sorted(i for row in list(first.values())[12:] for i in row["ids"]) == sorted(i for row in reference[8:10] for i in row["ids"])
    assert [row["ids"] for row in resumed.values()] == [row["ids"] for row in reference[10:]], "the uninterrupted run's steps"
    assert read_pointer(ckpt, LATEST).name == "epoch_1_step_21"  # above the checkpoint it resumed from
    assert validate(ckpt / "epoch_1_step_15")["meta"]["global_batch_size"] == 4  # derived: batch 4 x 1 rank
    assert validate(ckpt / "epoch_1_step_21")["meta"]["global_batch_size"] == 6


@pytest.mark.multiproc
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


class BatchCountingLoader:
    """A stateful loader of its own: its state counts batches, and it has no set_epoch."""

    batch_size = 6

    def __init__(self):
        self.batches = 0

    def __iter__(self):
        return iter(range(8))

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def test_a_stateful_loader_whose_order_cannot_be_replayed_refuses_a_batch_change():
    from resilience.state.batch_size import BatchSizeChangeRefused, continue_with_batch_size

    step_state = {"epoch": 1, "batches_in_epoch": 3, "global_step": 15}
    position = {"batches_in_epoch": 3, "loader": {"batches": 3}}
    with pytest.raises(BatchSizeChangeRefused, match="step_scheduler.global_batch_size changed from 4 .* to 6.*set_epoch"):
        continue_with_batch_size(
            step_state, position, {"global_batch_size": 4}, 6, loader=BatchCountingLoader(), checkpoint="epoch_1_step_15", configured=False
        )
    # the same global batch: resumed by its own state, as saved
    assert continue_with_batch_size(
        step_state, position, {"global_batch_size": 6}, 6, loader=BatchCountingLoader(), checkpoint="epoch_1_step_15", configured=False
    ) == (step_state, position)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_change_of_micro_batch_at_the_same_global_batch_continues_at_the_next_sample(tmp_path):
    """Saved with batch 2 x 2 accumulated micro-batches, resumed with batch 4 and no accumulation: the
    global batch (4) is unchanged but the position, counted in loader batches, must be re-expressed
    (10 micro-batches of 2 are 5 batches of 4), or 20 samples would be skipped."""
    ckpt = tmp_path / "ck"
    first = run(ckpt, tmp_path / "a.rec", batch=2, overrides=["step_scheduler.gradient_accumulation_steps=2", "step_scheduler.max_steps=5"])
    assert first == [ExitCode.DONE]
    assert validate(ckpt / "epoch_0_step_5")["meta"]["gradient_accumulation_steps"] == 2
    assert run(ckpt, tmp_path / "b.rec", batch=4) == [ExitCode.DONE]
    before, after = steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec")
    check_counters({**before, **after})
    assert all(len(row["ids"]) == 4 for row in [*before.values(), *after.values()])
    assert sorted(i for row in [*before.values(), *after.values()] for i in row["ids"]) == EPOCH, "every sample once"


def test_a_configured_global_batch_that_the_loaders_do_not_give_is_a_config_error(tmp_path):
    """global_batch_size must be the loaders' batch sizes summed over the ranks x accumulation: any
    other value would make the sample arithmetic of a later resume wrong."""
    assert run(tmp_path / "ck", tmp_path / "a.rec", batch=4, overrides=["step_scheduler.global_batch_size=6"]) == [ExitCode.CONFIG_ERROR]
    assert run(
        tmp_path / "ck2",
        tmp_path / "b.rec",
        batch=4,
        overrides=["step_scheduler.global_batch_size=8", "step_scheduler.gradient_accumulation_steps=2", "step_scheduler.max_steps=1"],
    ) == [ExitCode.DONE]
