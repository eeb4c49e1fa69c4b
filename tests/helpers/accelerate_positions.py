"""Accelerate's prepared loaders saved and resumed at every kind of data position, in one process.

Usage: accelerate_positions.py  (exits 0, or 1 naming each case whose resumed batches or RNG draws differ)

For ``use_stateful_dataloader`` True and False, a shuffled ``DataLoader`` without and with its own
``generator``, saved at the first epoch's end and in the second epoch: the batches and a
``torch.rand()`` per batch (dropout's stand-in) of the run resumed through
``resilience.state.data_position`` (as ``resilient_loop()`` does) must equal an uninterrupted run's.
"""

import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from resilience.state.data_position import data_position_json, epoch_iterator, parse_data_position, set_epoch


def run(acc, generator, stop=None, resume=None):
    """3 epochs of a prepared shuffled loader; a torch.rand() after each batch stands in for dropout.
    stop=(epoch, batches): return the rows so far, the data position and the RNG there (as a save);
    resume=(stop, position, rng): a fresh loader continues from it (as resilient_loop does)."""
    torch.manual_seed(0)  # a fresh process: the same RNG history up to the loader
    g = torch.Generator().manual_seed(7) if generator else None
    loader = acc.prepare(DataLoader(list(range(12)), batch_size=4, shuffle=True, generator=g))
    (first, skipped), position, rng = resume or ((0, 0), None, None)
    rows = []
    for epoch in range(first, 3):
        set_epoch(loader, epoch)
        iterator = epoch_iterator(loader, parse_data_position(position) if epoch == first and position else None)
        if epoch == first and rng is not None:
            torch.set_rng_state(rng)
        for index, batch in enumerate(iterator, start=skipped if epoch == first else 0):
            rows.append((epoch, batch.tolist(), torch.rand(()).item()))
            if stop == (epoch, index + 1):
                return rows, data_position_json(loader, index + 1), torch.get_rng_state()
    return rows, None, None


failures = []
for stateful in (True, False):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    for generator in (False, True):
        reference = run(acc, generator)[0]
        for stop in ((0, 3), (1, 1)):  # the first epoch's end; the second's first batch
            head, position, rng = run(acc, generator, stop=stop)
            tail = run(acc, generator, resume=(stop, position, rng))[0]
            if head + tail != reference:
                failures.append(f"use_stateful_dataloader={stateful}, DataLoader(generator={'g' if generator else None}), saved at {stop}")
sys.exit("\n".join(failures) or None)
