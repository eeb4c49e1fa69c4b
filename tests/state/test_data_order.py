"""A plain shuffled ``DataLoader`` (no ``set_epoch``, not stateful) resumes in a later epoch with
the same batch order as an uninterrupted run: the replay re-creates the epoch's iterator from the
RNG state the original one started from, the states of the loader's own generator, and, with
persistent workers, as a reset of workers started earlier (as the original's later epochs are)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from resilience import ExitCode, resilient_loop

LOADERS = {
    "plain": {},
    # a seeded generator, as PyTorch's reproducibility notes advise: the shuffle draws from it, not the global RNG
    "generator": {"generator": "seeded"},
    # persistent workers: iter() creates the workers in epoch 0 only and resets them after
    "persistent-workers": {"num_workers": 2, "persistent_workers": True},
    # a custom sampler keeping its own generator under a name of its choosing
    "custom-sampler": {"sampler": "custom"},
}


class OwnGeneratorSampler(torch.utils.data.Sampler):
    """Shuffles with a generator it holds as ``self.g`` (not ``generator``); no ``set_epoch``."""

    def __init__(self, n: int):
        self.n, self.g = n, torch.Generator().manual_seed(7)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.g).tolist())

    def __len__(self) -> int:
        return self.n


def run(root, stop_at=None, kind="plain") -> tuple[int, dict[int, list[int]], dict[int, float]]:
    """A fresh 'process': seed, build, train (dropout moves the RNG); returns the exit code and
    the sample indices and loss seen at each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = dict(LOADERS[kind])
    if options.get("generator") == "seeded":
        options["generator"] = torch.Generator().manual_seed(5)
    if options.get("sampler") == "custom":
        options["sampler"] = OwnGeneratorSampler(40)
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle="sampler" not in options, **options)
    cfg = {"step_scheduler": {"num_epochs": 3, "preemption_signal": "SIGTERM"}, "checkpoint": {"checkpoint_dir": str(root)}}
    seen, losses = {}, {}
    loop = resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=loader)
    with loop:
        for step in loop:
            (idx,) = step.batch
            seen[step.global_step] = idx.tolist()
            loss = model(idx.float().unsqueeze(1) / 40).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[step.global_step] = loss.item()
            if step.global_step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded by the loop: it stops after this step
    return loop.exit_code, seen, losses


@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_plain_shuffled_dataloader_resumes_in_a_later_epoch_with_the_same_order(tmp_path, kind):
    code, reference, ref_losses = run(tmp_path / "reference", kind=kind)
    assert code == ExitCode.DONE and len(reference) == 30
    code, first, _ = run(tmp_path / "ck", stop_at=14, kind=kind)  # epoch 1, 4 batches in
    assert code == ExitCode.PREEMPTED and max(first) == 14
    code, resumed, losses = run(tmp_path / "ck", kind=kind)
    assert code == ExitCode.DONE and min(resumed) == 15
    assert {s: reference[s] for s in resumed} == resumed  # same samples in the same order
    assert {s: ref_losses[s] for s in losses} == losses  # and the same training (bitwise)
    assert sorted(i for s in range(11, 21) for i in (first | resumed)[s]) == list(range(40))  # epoch 1 whole


def test_an_empty_loader_is_refused_at_resilient_loop_and_a_used_up_generator_fails_instead_of_finishing(tmp_path):
    """Found by a newcomer: an empty DataLoader 'completed' all epochs with no step, published a
    final checkpoint, and the run with the data fixed resumed it and trained nothing."""
    model = torch.nn.Linear(1, 1)
    cfg = {"step_scheduler": {"num_epochs": 3}, "checkpoint": {"checkpoint_dir": str(tmp_path / "ck")}}
    empty = DataLoader(TensorDataset(torch.arange(0)), batch_size=4)
    with pytest.raises(ValueError, match=r"dataloader: it has no batches \(len\(\) is 0\)"):
        resilient_loop(cfg, model=model, dataloader=empty)
    one_shot = (torch.ones(1) for _ in range(3))  # a generator: epoch 1 finds it used up
    seen = []
    with pytest.raises(ValueError, match=r"the dataloader yielded no batch in epoch 1: .*one-shot iterator"):
        with resilient_loop(cfg, model=model, dataloader=one_shot) as loop:
            for step in loop:
                seen.append(step.global_step)
    assert seen == [1, 2, 3] and loop.exit_code == ExitCode.FAILED
    assert not (tmp_path / "ck" / "LATEST").exists()  # no 'final' checkpoint to stop the next run


@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_resume_from_a_checkpoint_at_an_epochs_end_draws_the_next_epochs_order_of_the_uninterrupted_run(tmp_path, kind):
    # A RandomSampler draws once more from its generator when exhausted, which the saving run's
    # iterator had not been yet at its save: the resume exhausts the replayed epoch's sampler too.
    code, reference, ref_losses = run(tmp_path / "reference", kind=kind)
    assert code == ExitCode.DONE
    code, first, _ = run(tmp_path / "ck", stop_at=10, kind=kind)  # the last batch of epoch 0
    assert code == ExitCode.PREEMPTED and max(first) == 10
    code, resumed, losses = run(tmp_path / "ck", kind=kind)
    assert code == ExitCode.DONE and min(resumed) == 11
    assert {s: reference[s] for s in resumed} == resumed
    assert {s: ref_losses[s] for s in losses} == losses
