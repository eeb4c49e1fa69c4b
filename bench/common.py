"""Shared helpers: sizes, medians, page-cache control, the memory trap, the model-like state.

Facts these helpers work around (measured on this machine kind, see the project notes):

* Memory left free for ~2 s is handed back to the host; touching it again runs 5-8x slower.
  :func:`touch_memory` faults in and frees a working-size buffer right before a timed step so
  every method starts from the same warm state.
* Disk speed drifts by ~25 % between runs minutes apart, so every figure is a ratio to an
  anchor measured in the same round, and rounds rotate the order of the methods.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKDIR = REPO / "bench" / "tmp"

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def example_module(name: str):
    """``examples/<name>/train.py`` as a module (its builders: data, model), loaded once from its
    file as ``examples_<name>_train``; loading it imports ``resilience`` (the example's own imports)."""
    module_name = f"examples_{name}_train"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = REPO / "examples" / name
    spec = importlib.util.spec_from_file_location(module_name, path / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path))  # the example's own sibling imports, if any
    try:
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        sys.path.remove(str(path))
    return module


def parse_size(text: str) -> int:
    """``"1G"`` -> 1073741824; accepts bytes (``"4096"``) or a number with K/M/G/T (powers of
    1024, optional ``B``/``iB``: ``"64M"``, ``"1.5GiB"``).

    Raises:
        ValueError: anything else, or a size below 64 KiB.
    """
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"--size: {text!r} is not a size; accepted: bytes (4096) or a number with K, M, G or T (64M, 1G, 1.5GiB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 64 << 10:
        raise ValueError(f"--size: {text!r} is {value} bytes; use at least 64K")
    return value


def human_bytes(n: float) -> str:
    """``3221225472`` -> ``"3.00 GiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def median(values: Sequence[float]) -> float | None:
    """Median, or ``None`` for no values."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rotate(items: Sequence, by: int) -> list:
    """``items`` rotated left by ``by``: round ``r`` runs the methods in a different order, so no
    method always runs first (on a cold disk) or last (after the others filled the page cache)."""
    by %= max(1, len(items))
    return list(items[by:]) + list(items[:by])


def touch_memory(nbytes: int) -> None:
    """Fault in ``nbytes`` of fresh memory and free it (the VM's 2-second memory trap).

    Also collects garbage first, so a previous round's buffers are really gone."""
    gc.collect()
    if nbytes <= 0:
        return
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)  # writes every page
    del buf


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """``(seconds, fn())`` with ``time.perf_counter``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process, all its threads together."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of ``fn()``: a method that needs more CPU per
    byte than the disk needs time loses more speed when a neighbour takes a core."""
    cpu0, start = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - start, cpu_seconds() - cpu0


def files_under(path: Path) -> list[Path]:
    """``path`` itself when it is a file, else every regular file below it."""
    path = Path(path)
    if path.is_file():
        return [path]
    return [Path(d) / f for d, _, names in os.walk(path) for f in names if (Path(d) / f).is_file()]


def read_once(paths: Iterable[Path], rank: int = 0, world_size: int = 1) -> int:
    """Read every file under ``paths`` once, untimed, the ranks taking every ``world_size``-th
    file from ``rank`` on; returns the bytes this rank read.

    Before a cold read (:func:`drop_cache` after it), so every method's timed read comes from
    the same layer below this machine's page cache. On the bench VM the virtual disk sits on the
    host's own cache, which ``posix_fadvise`` cannot drop: the same 1.6 GB file read cold ran at
    0.6 GB/s after minutes unread and at 3.3 GB/s when read just before, so an order of methods
    that always puts one after the other's files (a rotation keeps who-follows-whom) decided the
    sharded load's figure (bench/README.md). Read once just before, every method's files come
    from the host's cache alike."""
    buf = memoryview(bytearray(64 << 20))
    done = 0
    files = sorted(p for root in paths for p in files_under(Path(root)))
    for path in files[rank::world_size]:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                done += n
    return done


def size_on_disk(path: Path) -> int:
    """Total bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in files_under(path))


def drop_cache(paths: Iterable[Path]) -> None:
    """Evict the files under each path from the page cache: fsync (dirty pages cannot be
    dropped), then ``posix_fadvise(POSIX_FADV_DONTNEED)``, so the next read comes from disk."""
    for root in paths:
        for path in files_under(Path(root)):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def filesystem_of(path: Path) -> tuple[str, str]:
    """``(mount point, filesystem type)`` holding ``path`` (from ``/proc/mounts``)."""
    path = Path(path).resolve()
    best = ("/", "unknown")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best[0]):
            best = (mount, fields[2])
    return best


# -- a model-like state ------------------------------------------------------------------------
class Block(torch.nn.Module):
    """An MLP block shaped like a transformer's: up-projection, down-projection, LayerNorm."""

    def __init__(self, dim: int, device: str | torch.device = "cpu"):
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim, device=device)
        self.down = torch.nn.Linear(2 * dim, dim, device=device)
        self.norm = torch.nn.LayerNorm(dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


def build_state(
    model_bytes: int, *, tensors: int = 200, seed: int = 0, wrap: Callable[[torch.nn.Module], None] | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of about ``model_bytes`` of fp32 parameters in about ``tensors`` tensors, and an
    Adam optimizer after one step (its ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter:
    the whole state is ~3x ``model_bytes``).

    Parameters are filled with random values (every page written, nothing compressible).
    ``wrap(model)``, when given, runs before the optimizer is built (e.g. FSDP2 sharding it)."""
    blocks = max(1, tensors // 6)
    params = model_bytes // 4
    dim = max(8, int((params / (4 * blocks)) ** 0.5))
    model = torch.nn.Sequential(*(Block(dim, device="meta") for _ in range(blocks)))
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    if wrap is not None:
        wrap(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)  # foreach: +1 state of temporaries
    for p in model.parameters():
        p.grad = p.detach() * 1e-3
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return model, optimizer


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state in a fixed order: parameters, then each parameter's optimizer state."""
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        for value in optimizer.state[p].values():
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The state as one flat ``name -> tensor`` dict (no copies), for safetensors."""
    out = {f"model.{name}": p.detach() for name, p in model.named_parameters()}
    names = {p: name for name, p in model.named_parameters()}
    for p, entries in optimizer.state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{names[p]}.{key}"] = value
    return out


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable: reads can land in it)."""
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy()).cast("B")
