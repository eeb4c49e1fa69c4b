"""Copies between CPU tensors in 16 MiB chunks that a few threads take in turn: the async save's
snapshot, the only time a save blocks the training loop.

``dst.copy_(src)`` splits one tensor evenly over torch's intra-op threads, so the copy lasts as
long as its slowest thread: when another process shares a core (a data-loader worker, a busy
neighbour), a 3 GiB snapshot took 0.45 s instead of 0.16 s on the 2-core bench VM. Chunks taken
from a shared list let a thread that got a free core copy more of them: 0.18 s beside the same
busy process, the same 0.16 s on a quiet machine (``python -m bench --only async --load``).
``ctypes.memmove`` releases the GIL during the call (a ``CFUNCTYPE`` function), so the threads
copy in parallel. Only plain contiguous CPU tensors are copied as bytes; anything else (device,
non-contiguous, conjugate or negative views, quantized, sparse, subclasses) goes through
``copy_``, which resolves what the bytes alone do not say.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence

import torch

CHUNK_BYTES = 16 << 20
"""Bytes per piece of work: large enough that the per-call cost (~1 us) is nothing, small enough
that a thread slowed by a shared core hands most of a large tensor to the others."""
MIN_PARALLEL_BYTES = 64 << 20
"""Below this many bytes in all, the calling thread copies alone (starting threads costs more)."""


def copies_as_bytes(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src``'s bytes are exactly its values, laid out as ``dst`` (a contiguous CPU
    buffer of the same shape and dtype) expects them."""
    return (
        type(src) is torch.Tensor
        and src.device.type == "cpu"
        and src.layout == torch.strided
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_quantized
        and not src.is_conj()
        and not src.is_neg()
        and (src.data_ptr() != 0 or src.numel() == 0)  # a ZeroTensor (torch._efficientzerotensor) has no bytes
    )


def chunks(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, int, int]]:
    """``(dst address, src address, bytes)`` for every ``chunk`` of every ``(dst, src)`` pair, in order."""
    for dst, src in pairs:
        size = src.numel() * src.element_size()
        dst_at, src_at = dst.data_ptr(), src.data_ptr()
        for offset in range(0, size, chunk):
            yield dst_at + offset, src_at + offset, min(chunk, size - offset)


def copy_bytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], threads: int | None = None) -> None:
    """Copy every ``src`` into its ``dst`` (both as :func:`copies_as_bytes` requires), the calling
    thread and ``threads - 1`` helpers taking 16 MiB chunks in turn.

    Args:
        pairs: ``(dst, src)`` tensors; the caller keeps them alive and unchanged until this returns.
        threads: how many threads copy (default: ``torch.get_num_threads()``, the intra-op threads
            ``copy_`` would use); 1 copies on the calling thread only.

    Raises:
        Whatever a helper thread raised, after every helper has stopped.
    """
    total = sum(src.numel() * src.element_size() for _, src in pairs)
    # no more threads than chunks: torch may report 64 intra-op threads for a copy of 5 chunks
    threads = max(1, min(threads if threads is not None else torch.get_num_threads(), -(-total // CHUNK_BYTES)))
    work = chunks(pairs)
    if threads == 1 or total < MIN_PARALLEL_BYTES:
        for job in work:
            ctypes.memmove(*job)
        return
    lock = threading.Lock()
    errors: list[BaseException] = []

    def take() -> None:
        try:
            while not errors:
                with lock:
                    job = next(work, None)
                if job is None:
                    return
                ctypes.memmove(*job)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(exc)

    helpers = [threading.Thread(target=take, name=f"resilience-host-copy-{i}", daemon=True) for i in range(threads - 1)]
    for helper in helpers:
        helper.start()
    take()
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]
