"""Host staging buffers for asynchronous saves: a real copy of the state, in memory reused
from save to save.

A snapshot must be a copy (training mutates parameters in place right after ``save`` returns),
and a *fresh* allocation of GiBs costs several times the copy itself on a VM (page faults:
~0.08 s per GiB into reused memory vs 0.2-0.4 s fresh; ``python -m bench`` measures the async save).
So each tensor gets a buffer of the same shape and dtype that is allocated once and refilled
by every later save; pinned when CUDA is present so device-to-host copies run asynchronously.
Plain CPU tensors are copied as bytes in chunks shared by threads (:mod:`~resilience.checkpoint.host_copy`),
so a core taken by another process slows the snapshot less.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, cast

import torch

from resilience.checkpoint.host_copy import copies_as_bytes, copy_bytes
from resilience.sharded_types import dtensor_class

if TYPE_CHECKING:  # imported only for the annotation: importing DTensor at run time is what dtensor_class avoids
    from torch.distributed.tensor import DTensor


class StagingBuffers:
    """Reusable CPU buffers keyed by name; :meth:`copy_in` returns the filled buffers.

    Not thread-safe: one save at a time may use them (the async writer waits for the save in
    flight before the next snapshot).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.pin = torch.cuda.is_available()

    def _buffer_for(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)
            self._buffers[key] = buf
        return buf

    def copy_in(self, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
        """Copy every tensor into its staging buffer; returns ``{name: buffer}`` (same keys). A
        ``DTensor``'s local shard is copied, and its buffer returned as a ``DTensor`` of the same
        global shape and placements.

        Device tensors are copied with ``non_blocking`` into pinned memory; call
        :meth:`synchronize` before the buffers are read.
        """
        out: dict[str, torch.Tensor] = {}
        as_bytes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, tensor): copied together below
        dtensor = dtensor_class()  # None: no DTensor exists in this process
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            if dtensor is None or not isinstance(tensor, dtensor):
                out[name] = self._fill(prefix + name, tensor, as_bytes)
                continue
            sharded = cast("DTensor", tensor)
            # A DTensor's snapshot is its local shard, kept a DTensor (same mesh, placements and
            # global shape) so the writers still know where it lies; built directly, as
            # DTensor.from_local would move a CPU shard back to the mesh's device.
            out[name] = dtensor(self._fill(prefix + name, sharded.to_local(), as_bytes), sharded._spec, requires_grad=False)
        copy_bytes(as_bytes)
        return out

    def _fill(self, key: str, tensor: torch.Tensor, as_bytes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``tensor``'s buffer; filled now by ``copy_``, or later with ``as_bytes`` (plain CPU tensors)."""
        buf = self._buffer_for(key, tensor)
        if copies_as_bytes(tensor, buf):
            as_bytes.append((buf, tensor))
        else:
            buf.copy_(tensor, non_blocking=tensor.device.type != "cpu")
        return buf

    def synchronize(self) -> None:
        """Wait for pending device-to-host copies (no-op on CPU-only machines)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def forget(self, keys: Iterable[str] | None = None) -> None:
        """Drop buffers (all of them by default) so their memory is freed."""
        if keys is None:
            self._buffers.clear()
        else:
            for key in keys:
                self._buffers.pop(key, None)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(buf.numel() * buf.element_size() for buf in self._buffers.values())
