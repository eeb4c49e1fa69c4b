"""Synchronous save, load for resume, and peak memory during a save (one process, local files).

Every method writes or reads the same state (a model-like fp32 model plus its Adam state) on
the same filesystem, and each round measures the disk's own rate beside them:

* disk write: every tensor's bytes written with ``os.write`` into one file, then ``fsync``;
* disk read: that file read cold (after ``posix_fadvise(DONTNEED)``) into the live tensors.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from bench.common import byte_view, drop_cache, flat_state, median, remove, rotate, size_on_disk, state_tensors, timed, timed_cpu, touch_memory
from resilience.checkpoint import Checkpointer, TrainingState
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

_CHUNK = 64 << 20  # 64 MiB per os.write / readinto: the sequential rate without huge syscalls

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")


# -- the disk's own rates ------------------------------------------------------------------------
def write_raw(path: Path, tensors: list[torch.Tensor]) -> None:
    """Every tensor's bytes, back to back, into ``path``, then fsync: the disk's write rate."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = byte_view(t)
            while view:
                view = view[os.write(fd, view[:_CHUNK]) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_raw(path: Path, tensors: list[torch.Tensor]) -> None:
    """Read :func:`write_raw`'s file back into the same tensors (in place): the disk's read rate."""
    with open(path, "rb", buffering=0) as fh:
        for t in tensors:
            view = byte_view(t)
            while view:
                n = fh.readinto(view[:_CHUNK])
                if not n:
                    raise EOFError(f"{path}: shorter than the state")
                view = view[n:]


# -- the methods -------------------------------------------------------------------------------
def ours_checkpointer(root: Path, state: TrainingState | None = None, step: int = 0, **config: Any) -> Checkpointer:
    """Our Checkpointer of ``state`` at global step ``step`` on one local rank, writing under ``root``."""
    return Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root), **config),
        DistContext(),
        state=state or TrainingState(model=torch.nn.Identity()),
        scheduler=StepScheduler(num_epochs=1, global_step=step),
    )


def save_ours(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """``Checkpointer.save`` of model + optimizer (safetensors weights, DCP optimizer, manifest)."""
    path = ours_checkpointer(root, TrainingState(model=model, optimizer=optimizer), step).save()
    assert path is not None
    return path


def save_torch(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``torch.save`` of both state dicts, then fsync (durable, like the others)."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict DCP users save and load (``get_state_dict``; no copies)."""
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP ``save`` with its defaults (``FileSystemWriter``: one file per rank, 1 thread, fsync)."""
    dcp.save(dcp_state(model, optimizer), storage_writer=dcp.FileSystemWriter(str(path), sync_files=True))


def load_ours(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``Checkpointer.load`` into the existing model and optimizer."""
    ours_checkpointer(directory.parent).load(directory, TrainingState(model=model, optimizer=optimizer))


def find_ours(root: Path) -> Path:
    """``Checkpointer.find_resume_point``: follows ``LATEST`` and checks manifests and sizes (the
    bytes are checked while ``Checkpointer.load`` reads them)."""
    found = ours_checkpointer(root).find_resume_point()
    assert found is not None, f"no checkpoint found under {root}"
    return found


def load_safetensors(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``safetensors.torch.load_file`` of the flat state, copied into the live tensors."""
    targets = flat_state(model, optimizer)
    loaded = load_file(str(path))
    with torch.no_grad():
        for key, t in targets.items():
            t.copy_(loaded[key])


def load_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP's resume recipe: ``get_state_dict``, ``dcp.load`` in place, ``set_state_dict``."""
    state = dcp_state(model, optimizer)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


# -- the benchmarks ----------------------------------------------------------------------------
def bench_save(work: Path, model, optimizer, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Sync save, ``repeat`` rounds of (disk, ours, torch.save, DCP) in rotating order.

    Leaves the last round's outputs in ``work`` for :func:`bench_load`. Returns times (s) per
    method per round and the bytes each wrote."""
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    paths = {"disk": work / "raw.bin", "ours": work / "ours", "torch_save": work / "torch_save.pt", "dcp": work / "dcp"}
    runs: dict[str, Callable[[int], None]] = {
        "disk": lambda r: write_raw(paths["disk"], tensors),
        "ours": lambda r: save_ours(paths["ours"], model, optimizer, r + 1),
        "torch_save": lambda r: save_torch(paths["torch_save"], model, optimizer),
        "dcp": lambda r: save_dcp(paths["dcp"], model, optimizer),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_s: dict[str, list[float]] = {name: [] for name in runs}  # this process's CPU time, all threads
    written: dict[str, int] = {}
    # Untimed: the first big write of a process runs much slower here (the page cache takes
    # memory the host has reclaimed), whichever method comes first.
    touch_memory(state_bytes)
    write_raw(paths["disk"], tensors)
    drop_cache([paths["disk"]])
    for r in range(repeat):
        for name in rotate(list(runs), r):
            remove(paths[name])
            os.sync()
            touch_memory(state_bytes)
            seconds, cpu = timed_cpu(functools.partial(runs[name], r))
            times[name].append(seconds)
            cpu_s[name].append(cpu)
            written[name] = size_on_disk(paths[name])
            drop_cache([paths[name]])  # keep the page cache from filling up with our own output
            log(f"save round {r + 1}/{repeat}: {name:<10} {seconds:7.3f} s  {written[name] / seconds / 1e9:5.2f} GB/s")
    return {"times": times, "cpu_s": cpu_s, "bytes_written": written, "state_bytes": state_bytes, "paths": {k: str(v) for k, v in paths.items()}}


def bench_load(work: Path, model, optimizer, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Load for resume, cold: ``repeat`` rounds of (disk, ours, safetensors, DCP) in rotating
    order, plus ours' validation (``find_resume_point``) on its own. Needs :func:`bench_save`'s
    outputs in ``work``; writes the safetensors file itself (untimed)."""
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    st_path = work / "state.safetensors"
    if not st_path.exists():
        save_file(flat_state(model, optimizer), str(st_path))
        drop_cache([st_path])
    ours_dir = find_ours(work / "ours")
    paths = {"disk": work / "raw.bin", "ours": ours_dir, "safetensors": st_path, "dcp": work / "dcp", "ours_validate": ours_dir}
    runs: dict[str, Callable[[], None]] = {
        "disk": lambda: read_raw(paths["disk"], tensors),
        "ours": lambda: load_ours(ours_dir, model, optimizer),
        "safetensors": lambda: load_safetensors(st_path, model, optimizer),
        "dcp": lambda: load_dcp(paths["dcp"], model, optimizer),
        "ours_validate": lambda: find_ours(work / "ours"),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_s: dict[str, list[float]] = {name: [] for name in runs}
    read: dict[str, int] = {name: size_on_disk(paths[name]) for name in runs}
    drop_cache([paths["disk"]])  # untimed: the first cold read of a process is slower too
    read_raw(paths["disk"], tensors)
    for r in range(repeat):
        for name in rotate(list(runs), r):
            # Every method's files, not only this one's: on the VMs measured here, reading a state's
            # worth of new pages while another method's state is still cached cost 1-1.7 s of kernel
            # time (the disk anchor too), so the method read right after another paid for it.
            drop_cache(list(paths.values()))
            touch_memory(state_bytes)
            seconds, cpu = timed_cpu(runs[name])
            times[name].append(seconds)
            cpu_s[name].append(cpu)
            log(f"load round {r + 1}/{repeat}: {name:<13} {seconds:7.3f} s  {read[name] / seconds / 1e9:5.2f} GB/s")
    return {"times": times, "cpu_s": cpu_s, "bytes_read": read, "state_bytes": state_bytes}


# -- peak memory ---------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_hwm() -> bool:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs`` = 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


class _RssSampler:
    """Peak RSS seen by a thread sampling ``/proc/self/statm`` every ~1 ms (fallback when the
    kernel refuses ``clear_refs``; may miss a peak shorter than a millisecond)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open("/proc/self/statm") as fh:
            while not self._stop.is_set():
                fh.seek(0)
                self.peak = max(self.peak, int(fh.read().split()[1]) * self._page)
                time.sleep(0.001)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def peak_extra_rss(fn: Callable[[], object]) -> tuple[int, str]:
    """Bytes of resident memory ``fn`` added at its peak, over the RSS just before it; and the
    method used (``VmHWM`` after ``clear_refs``, else a 1 ms sampling thread)."""
    gc.collect()
    if _reset_hwm():
        before = _status_kib("VmRSS") * 1024
        fn()
        return max(0, _status_kib("VmHWM") * 1024 - before), "VmHWM"
    before = _status_kib("VmRSS") * 1024
    with _RssSampler() as sampler:
        fn()
    return max(0, sampler.peak - before), "sampled"


def bench_peak_rss(work: Path, model, optimizer, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Peak extra RSS of one synchronous save, ours vs torch.save vs DCP (each ``repeat`` times)."""
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    target = work / "rss"
    runs: dict[str, Callable[[int], object]] = {
        "ours": lambda r: save_ours(target, model, optimizer, r + 1),
        "torch_save": lambda r: save_torch(target, model, optimizer),
        "dcp": lambda r: save_dcp(target, model, optimizer),
    }
    extra: dict[str, list[int]] = {name: [] for name in runs}
    how = "VmHWM"
    for r in range(repeat):
        for name in rotate(list(runs), r):
            remove(target)
            touch_memory(state_bytes)  # before the reset: its peak does not count
            peak, how = peak_extra_rss(functools.partial(runs[name], r))
            extra[name].append(peak)
            drop_cache([target])
            log(f"peak rss round {r + 1}/{repeat}: {name:<10} +{peak / 2**20:8.1f} MiB ({peak / state_bytes:.1%} of the state)")
    remove(target)
    return {"extra_bytes": extra, "state_bytes": state_bytes, "method": how, "median_extra_bytes": {k: median(v) for k, v in extra.items()}}


# -- where ours spends its time ------------------------------------------------------------------
def _wrap(module: Any, attr: str, label: str, totals: dict[str, float]) -> Callable[[], None]:
    """Accumulate the time spent in ``module.attr`` under ``label``; returns the undo. Silently
    does nothing when the attribute is gone (the code under test is being changed)."""
    original = getattr(module, attr, None)
    if getattr(original, "_bench_wrapped", False):
        return lambda: None  # already counted under another label (one function, two modules)
    if not callable(original):
        return lambda: None

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

    wrapper._bench_wrapped = True  # type: ignore[attr-defined]
    setattr(module, attr, wrapper)
    return lambda: setattr(module, attr, original)


def breakdown(work: Path, model, optimizer) -> dict[str, Any]:
    """One save, one validation and one load of ours, each cold, with its phases timed (s), to
    say where the time goes: model weights (safetensors), optimizer (DCP), fsync, digests,
    fresh allocations and copies into the live objects, ..."""
    from resilience.checkpoint import parts, reader, writer
    from resilience.checkpoint.formats import model_io, optim_io
    from resilience.checkpoint.storage import content_check, durable

    optim_files = getattr(optim_io, "optim_files", None)

    dcp_io = getattr(optim_io, "dcp_io", None)
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    root = work / "breakdown"
    found: list[Path] = []
    steps: dict[str, Callable[[], object]] = {
        "save": lambda: save_ours(root, model, optimizer, 1),
        "validate (find_resume_point)": lambda: found.append(find_ours(root)),
        "load (Checkpointer.load)": lambda: load_ours(found[-1], model, optimizer),
    }
    out: dict[str, Any] = {}
    for phase, run in steps.items():
        totals: dict[str, float] = {}
        undo = [
            _wrap(parts, "get_model_state_dict", "capture: get_model_state_dict", totals),
            _wrap(optim_io, "capture_optimizer", "capture: capture_optimizer", totals),
            _wrap(model_io, "save_model", "model weights: save_model (worker thread, beside the optimizer)", totals),
            _wrap(model_io, "write_safetensors", "  shards written and digested in one pass", totals),
            _wrap(optim_io, "save_optimizer", "optimizer: save_optimizer (own files, or DCP for sharded state; digested)", totals),
            _wrap(optim_files, "save", "  optimizer's own file written and digested in one pass", totals) if optim_files else (lambda: None),
            _wrap(durable, "_fsync_and_close", "the parts' files fsync'd together after the last part (durable.fsyncs_deferred)", totals),
            _wrap(writer, "fsync_file", "fsync_file of files written by libraries", totals),
            _wrap(writer, "record", "record: read back + digest of files written by libraries", totals),
            _wrap(writer, "write_manifest", "manifest write", totals),
            _wrap(model_io, "load_model", "model weights: load_model", totals),
            _wrap(model_io, "read_safetensors", "  shards read in place into the model (digested as read)", totals),
            _wrap(model_io, "set_model_state_dict", "  set_model_state_dict (only what did not fit in place)", totals),
            _wrap(optim_io, "load_optimizer", "optimizer: load_optimizer", totals),
            _wrap(dcp_io, "load_tensors", "  DCP load into the optimizer's tensors", totals) if dcp_io is not None else (lambda: None),
            _wrap(optim_files, "load", "  optimizer's own files read into its tensors (digested as read)", totals) if optim_files else (lambda: None),
            _wrap(optim_io, "set_optimizer_state_dict", "  set_optimizer_state_dict", totals),
            _wrap(content_check, "digest_problem", "content check thread: digests of the files not read whole (overlaps the load)", totals),
            _wrap(reader, "validate", "validate: manifests and sizes", totals),
        ]
        try:
            if phase == "save":
                remove(root)
            else:
                drop_cache([root])
            touch_memory(state_bytes)
            total, _ = timed(run)
        finally:
            for u in undo:
                u()
        out[phase] = {"total_s": total, "phases_s": dict(sorted(totals.items(), key=lambda kv: -kv[1]))}
    out["bytes"] = size_on_disk(root)
    remove(root)
    from bench.async_save import ours_async_available

    if ours_async_available()[0]:
        out["async_blocked_profile"] = _profile_async_blocked(work / "breakdown_async", model, optimizer, state_bytes)
    return out


def _profile_async_blocked(root: Path, model, optimizer, state_bytes: int, top: int = 12) -> dict[str, Any]:
    """cProfile of the part of an async ``save`` the training loop waits for (after one warm-up
    save, so the staging buffers exist): the functions with the largest cumulative time."""
    import cProfile
    import pstats

    ck = ours_checkpointer(root, TrainingState(model=model, optimizer=optimizer), 1, is_async=True)
    ck.save()
    ck.wait()
    touch_memory(state_bytes)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    ck.scheduler.global_step = 2
    ck.save()
    profiler.disable()
    blocked = time.perf_counter() - start
    ck.wait()
    if callable(getattr(ck, "close", None)):
        ck.close()
    remove(root)
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (_cc, calls, _tt, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "bench/" in filename or func in ("<lambda>", "<listcomp>", "<dictcomp>", "<genexpr>"):
            continue
        rows.append({"function": f"{Path(filename).name}:{line}({func})", "calls": calls, "cumulative_s": cumtime})
    rows.sort(key=lambda row: -row["cumulative_s"])
    return {"blocked_s_under_profiler": blocked, "top": rows[:top]}
