"""Where a sharded save and load spend their time, phase by phase (``bench/sharded_worker.py``).

The library has no timing hooks of its own (``writer.phase`` is a fault-test hook), so the
functions of each phase are wrapped for one extra save and one extra load, and the seconds spent
in each (inclusive, summed over calls, on whichever thread ran them) are printed per rank. The
digests are timed by wrapping the hash objects :class:`~resilience.checkpoint.storage.durable.DurableFile`
creates; the writes are ``DurableFile.write`` less those digests; the parts' fsyncs come together
once the last part is written (``durable.fsyncs_deferred``), timed in ``durable._fsync_and_close``.
A phase nested in another is indented under it; the save's model and optimizer parts run one
after the other on the parts' writer thread, the collectives on the training thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench.storage import _wrap

SAVE = "save"
LOAD = "load"


class _TimedHash:
    """A hash object whose ``update`` adds its seconds to ``totals[label]``."""

    def __init__(self, inner: Any, totals: dict[str, float], label: str):
        self._inner, self._totals, self._label = inner, totals, label

    def update(self, data: Any) -> None:
        start = time.perf_counter()
        self._inner.update(data)
        self._totals[self._label] = self._totals.get(self._label, 0.0) + time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _timed_digests(totals: dict[str, float], label: str) -> Iterator[None]:
    """Every hash object made through ``durable._ALGORITHMS`` times its ``update`` under ``label``."""
    from resilience.checkpoint.storage import durable

    saved = dict(durable._ALGORITHMS)
    durable._ALGORITHMS.update({name: (lambda make=make: _TimedHash(make(), totals, label)) for name, make in saved.items()})
    try:
        yield
    finally:
        durable._ALGORITHMS.clear()
        durable._ALGORITHMS.update(saved)


def _targets(which: str) -> list[tuple[Any, str, str]]:
    """``(owner, attribute, label)`` of the functions timed for a ``which`` (save or load)."""
    from resilience.checkpoint import checkpointer, parts, resume, writer
    from resilience.checkpoint.formats import model_io, optim_io, optim_shards, plan_cache, shard_files
    from resilience.checkpoint.storage import content_check, durable
    from resilience.distributed import DistContext

    names = ("all_gather_object", "gather_to_root", "gather_to_leaders", "gather_or_raise", "gather_to_root_or_raise", "verdict_from_root")
    collectives = [(DistContext, name, f"collective: DistContext.{name}") for name in (*names, "broadcast_object", "same_everywhere", "barrier")]
    if which == SAVE:
        return [
            (checkpointer.Checkpointer, "_parts", "capture: Checkpointer._parts (state dicts, plans, index)"),
            (parts, "get_state_dict", "  get_state_dict (torch's names for model + optimizer)"),
            (optim_io, "capture_optimizer", "  optimizer: capture_optimizer (split, plan, index)"),
            (plan_cache.LayoutCache, "plan", "  planning: LayoutCache.plan (model + optimizer)"),
            (shard_files, "index_doc", "  planning: shard_files.index_doc"),
            (checkpointer, "write_checkpoint", "write_checkpoint (parts + rank manifests + gathers)"),
            (writer, "_write_parts", "  _write_parts (model and optimizer parts, rank state)"),
            (model_io, "save_model", "    model: save_model"),
            (optim_io, "save_optimizer", "    optimizer: save_optimizer"),
            (shard_files, "_cpu_contiguous", "      copies: to the CPU / contiguous"),
            (shard_files, "write_safetensors", "      write_safetensors (header, writes, digests)"),
            (durable.DurableFile, "write", "        DurableFile.write (digest + os.write)"),
            (durable.DurableFile, "close", "        DurableFile.close (fsync unless deferred)"),
            (durable, "_fsync_and_close", "    fsync (the parts' files, together after the last part)"),
            (writer, "write_rank_manifest", "  rank manifest"),
            (writer, "fsync_dir", "  fsync_dir (directories)"),
            (checkpointer, "publish", "publish (rank 0: manifest, rename, LATEST)"),
            (checkpointer.Checkpointer, "_after_publish", "after publish (LOWEST_VAL, retention)"),
            *collectives,
        ]
    return [
        (checkpointer.Checkpointer, "find_resume_point", "find_resume_point (validation)"),
        (resume, "load_state", "load_state"),
        (model_io, "load_model", "  model: load_model"),
        (optim_io, "load_optimizer", "  optimizer: load_optimizer"),
        (optim_shards, "load", "    optim_shards.load"),
        (model_io, "get_model_state_dict", "  get_model_state_dict"),
        (optim_io, "get_model_state_dict", "  get_model_state_dict"),
        (shard_files, "load_by_slices", "  shard_files.load_by_slices (model + optimizer)"),
        (model_io, "read_safetensors", "  read_safetensors (whole files in place)"),
        (optim_io, "set_optimizer_state_dict", "  set_optimizer_state_dict"),
        (content_check.ContentCheck, "finish", "content check: finish (digests the loader did not report)"),
        (content_check.ContentCheck, "_check", "content check: file digests (thread + finish)"),
        *collectives,
    ]


def timed_phases(which: str, run: Callable[[], object]) -> dict[str, Any]:
    """Run ``run`` (one save or one load) with its phases timed: ``{"total_s", "phases_s"}`` (s)."""
    totals: dict[str, float] = {}
    undo = [_wrap(owner, attr, label, totals) for owner, attr, label in _targets(which)]
    digest_label = "        digests (xxh3 as written)" if which == SAVE else "  digests (xxh3, loader and thread)"
    try:
        with _timed_digests(totals, digest_label):
            start = time.perf_counter()
            run()
            total = time.perf_counter() - start
    finally:
        for u in reversed(undo):
            u()
    write_label = "        DurableFile.write (digest + os.write)"
    if write_label in totals and digest_label in totals:
        totals["        os.write (DurableFile.write less its digest)"] = totals[write_label] - totals[digest_label]
    return {"total_s": total, "phases_s": totals}


def format_phases(title: str, per_rank: list[dict[str, Any]], order: list[str]) -> str:
    """A text table: one row per phase (in ``order``, the wrapping order), one column per rank."""
    lines = [f"{title}: " + "  ".join(f"rank {r} total {p['total_s']:.3f} s" for r, p in enumerate(per_rank))]
    for label in order:
        if any(label in p["phases_s"] for p in per_rank):
            cells = "  ".join(f"{p['phases_s'].get(label, 0.0):8.3f}" for p in per_rank)
            lines.append(f"  {cells}  {label}")
    return "\n".join(lines)


def labels(which: str) -> list[str]:
    """The phase labels of ``which`` in display order (the derived rows beside their sources)."""
    out = list(dict.fromkeys(label for _, _, label in _targets(which)))
    if which == SAVE:
        i = out.index("        DurableFile.write (digest + os.write)") + 1
        out[i:i] = ["        digests (xxh3 as written)", "        os.write (DurableFile.write less its digest)"]
    else:
        out.append("  digests (xxh3, loader and thread)")
    return out
