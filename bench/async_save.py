"""Asynchronous save: how long the training loop is blocked, against one memory copy and DCP.

* memcpy: one copy of every state tensor into buffers allocated and faulted in beforehand (the
  floor for any snapshot that lets training continue while the bytes go to disk);
* ours: ``Checkpointer.save`` with ``CheckpointConfig(is_async=True)`` returns after the
  snapshot, ``Checkpointer.wait()`` blocks until the save is published (issue 5; measured only
  once that API exists);
* DCP ``async_save`` (thread) with its defaults, and with a ``DefaultStager`` that copies into
  reused staging buffers in a background thread (blocked until that copy is done: the
  parameters must not change before it is).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from bench.common import drop_cache, median, remove, rotate, state_tensors, timed, touch_memory
from bench.storage import dcp_state, ours_checkpointer
from resilience.checkpoint import Checkpointer, TrainingState
from resilience.config import CheckpointConfig

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")

NOT_AVAILABLE = "not available yet"
OURS_ROUNDS_PER_REPEAT = 3
"""Ours runs ``3 * repeat`` rounds (the DCP peers ``repeat``): its figure is a ratio of ~0.15 s
times that moves 10-25 % from round to round with the VM's CPU speed, and 5 rounds put its
median anywhere from 0.8x to 1.2x between runs (bench/README.md); 15 rounds cost ~40 s more."""


def ours_async_available() -> tuple[bool, str]:
    """Whether our async save exists: ``CheckpointConfig.is_async`` plus ``Checkpointer.wait``
    (the config key alone was accepted before the feature existed)."""
    if "is_async" not in getattr(CheckpointConfig, "__dataclass_fields__", {}) and not hasattr(CheckpointConfig, "is_async"):
        return False, "CheckpointConfig has no is_async"
    if not callable(getattr(Checkpointer, "wait", None)):
        return False, "Checkpointer has no wait() (the async save of issue 5 is not in yet)"
    return True, ""


def _prune(root: Path) -> None:
    """Keep only the newest checkpoint under ``root`` (the one ``LATEST`` names)."""
    dirs = sorted((p for p in root.glob("epoch_*_step_*") if p.is_dir()), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    for path in dirs[:-1]:
        remove(path)


def fault_in(buffers: Iterable[torch.Tensor]) -> None:
    """Write one byte of every 4 KiB page of ``buffers`` (untimed, before a copy into them).

    On the bench VM memory left untouched for a few seconds is taken back by the host, in use or
    not, and the next copy into it runs at about half speed: a 3 GiB copy took 0.089 s into
    buffers copied into just before and 0.187 s after 3 s idle, ours' snapshot 0.100 s after its
    buffers were touched and 0.154 s after 3 s idle (bench/README.md). The rotation left the
    anchor's buffers fresher than ours' in most rounds; touched alike, both copy into resident
    memory, as the anchor's definition says."""
    for buf in buffers:
        if buf.numel():
            buf.detach().reshape(-1).view(torch.uint8)[::4096].zero_()


def bench_async(work: Path, model, optimizer, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Per peer (ours, DCP async, DCP async staged): ``repeat`` rounds of (memcpy, peer), rotating
    (ours: ``OURS_ROUNDS_PER_REPEAT * repeat`` rounds, the figure with a target).

    ``blocked``: how long the training loop waits (the call, plus a background staging copy the
    parameters must not change during); ``total``: until the save is durable (``wait()`` /
    ``future.result()`` returned). ``memcpy_anchor_s[peer]``: the memcpy times of that peer's
    rounds (its paired anchor); ``blocked_s["memcpy"]``: all of them."""
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    available, why = ours_async_available()

    staging = [torch.empty_like(t) for t in tensors]
    for s, t in zip(staging, tensors):  # fault the staging in: a fresh allocation costs several copies
        s.copy_(t)

    ours_root = work / "async_ours"
    ours = ours_checkpointer(ours_root, TrainingState(model=model, optimizer=optimizer), is_async=True) if available else None

    def memcpy(r: int) -> tuple[float, float]:
        fault_in(staging)
        seconds, _ = timed(lambda: [s.copy_(t) for s, t in zip(staging, tensors)])
        return seconds, seconds

    def run_ours(r: int) -> tuple[float, float]:
        ours.scheduler.global_step = r + 2
        fault_in(ours._buffers._buffers.values())  # its reused staging buffers (private: the bench only)
        blocked, _ = timed(ours.save)
        waited, _ = timed(ours.wait)
        _prune(ours_root)
        drop_cache([ours_root])
        return blocked, blocked + waited

    # DCP's stagers: the default (a fresh CPU copy per save), and DefaultStager with reused
    # staging buffers copied in a background thread. Pinned and shared memory need CUDA here.
    stagers: dict[str, Any] = {}
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stagers["dcp_async_staged"] = DefaultStager(
            StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False)
        )
    except Exception:  # noqa: BLE001 - an older torch: that peer is simply not measured
        pass

    def run_dcp(r: int, stager: str | None = None) -> tuple[float, float]:
        """Blocked: until the training loop may change the parameters again (the call, plus the
        staging copy when a stager finishes it in the background)."""
        path = work / (stager or "async_dcp")
        remove(path)
        writer = dcp.FileSystemWriter(str(path), sync_files=True)
        kwargs = {"async_stager": stagers[stager]} if stager else {}
        start = time.perf_counter()
        response = dcp.async_save(dcp_state(model, optimizer), storage_writer=writer, **kwargs)
        if hasattr(response, "staging_completion"):
            response.staging_completion.result()
            blocked = time.perf_counter() - start
            response.upload_completion.result()
        else:
            blocked = time.perf_counter() - start
            response.result()
        total = time.perf_counter() - start
        drop_cache([path])
        return blocked, total

    peers: dict[str, Callable[[int], tuple[float, float]]] = {"dcp_async": run_dcp}
    for name in stagers:
        peers[name] = lambda r, name=name: run_dcp(r, name)
    if available:
        peers = {"ours": run_ours, **peers}
    blocked: dict[str, list[float]] = {"memcpy": []}
    total: dict[str, list[float]] = {"memcpy": []}
    anchors: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    # One peer at a time, each paired round by round with its own memcpy anchor, so at most one
    # peer's staging memory is alive beside the state and the memcpy buffers.
    for name, run in peers.items():
        try:
            run(-1)  # untimed: reused staging buffers are allocated on first use
        except Exception as exc:  # noqa: BLE001 - a peer that does not work here is reported, not fatal
            if name == "ours":
                raise
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        blocked[name], total[name], anchors[name] = [], [], []
        pair = {"memcpy": memcpy, name: run}
        rounds = repeat * OURS_ROUNDS_PER_REPEAT if name == "ours" else repeat
        for r in range(rounds):
            for which in rotate(list(pair), r):
                touch_memory(state_bytes)
                b, t = pair[which](r)
                blocked[which].append(b)
                total[which].append(t)
                if which == "memcpy":
                    anchors[name].append(b)
                log(f"async round {r + 1}/{rounds}: {which:<16} blocked {b:7.3f} s, until durable {t:7.3f} s")
        if name in stagers:
            stagers[name].close()  # frees its staging buffers
        elif name == "ours" and callable(getattr(ours, "close", None)):
            ours.close()  # waits for nothing left, frees the staging buffers
    staging = None  # free the buffers (memcpy above has run)
    for path in (ours_root, work / "async_dcp", *(work / name for name in stagers)):
        remove(path)
    return {
        "available": available,
        "why_not": why,
        "blocked_s": blocked,
        "total_s": total,
        "median_blocked_s": {k: median(v) for k, v in blocked.items()},
        "memcpy_anchor_s": anchors,
        "state_bytes": state_bytes,
        "peer_errors": errors,
    }
