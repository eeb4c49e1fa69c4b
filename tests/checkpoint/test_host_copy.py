"""The async save's snapshot copy (resilience.checkpoint.host_copy, through StagingBuffers): plain
CPU tensors copied as bytes in chunks shared by threads, everything else by ``copy_``; every
buffer equal to its tensor's values at the call, in memory of its own."""

from __future__ import annotations

import threading

import pytest
import torch

from resilience.checkpoint import host_copy
from resilience.checkpoint.host_copy import CHUNK_BYTES, chunks, copies_as_bytes, copy_bytes
from resilience.checkpoint.staging import StagingBuffers


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(3 * CHUNK_BYTES // 4 + 123, generator=gen)  # 3 chunks and a bit
    base = torch.randn(64, 48, generator=gen)
    return {
        "big": big,
        "bf16": torch.randn(1000, generator=gen).to(torch.bfloat16),
        "int64": torch.arange(777, dtype=torch.int64),
        "bool": torch.rand(33, generator=gen) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "offset_view": base[10:20],  # contiguous, a storage offset: its own bytes, not the base's first
        "transposed": base.t(),  # not contiguous: copy_
        "conj": torch.randn(16, dtype=torch.complex64, generator=gen).conj(),  # lazy conjugate: copy_ resolves it
        "neg": torch._neg_view(torch.randn(8, generator=gen)),  # contiguous, a lazy negation: its bytes are not its values
        "param": torch.nn.Parameter(torch.randn(5, 5, generator=gen)),
        "zeros": torch._efficientzerotensor((1000,)),  # no storage at all (data_ptr 0): copy_ gives its zeros
    }


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_staging_copies_equal_the_values_in_their_own_memory_whatever_the_layout(threads, monkeypatch):
    monkeypatch.setattr(host_copy, "MIN_PARALLEL_BYTES", 0)  # the threads run even for this small state
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    state = _state()
    out = StagingBuffers().copy_in(state)
    assert list(out) == list(state)
    for name, tensor in state.items():
        got = out[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert not got.is_conj() and not got.is_neg() and got.is_contiguous(), name
        assert torch.equal(got, tensor.detach().resolve_conj().resolve_neg()), name
        if tensor.numel() and tensor.data_ptr():
            assert got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(), name
        assert got.numel() == 0 or got.data_ptr(), name  # a real buffer, also for the ZeroTensor


def test_a_second_snapshot_reuses_the_buffers_and_holds_the_new_values():
    state = _state()
    buffers = StagingBuffers()
    first = buffers.copy_in(state)
    address = first["big"].data_ptr()
    state["big"].add_(1.0)  # training changed the parameter after the first snapshot
    second = buffers.copy_in(state)
    assert second["big"].data_ptr() == address and torch.equal(second["big"], state["big"])


def test_which_tensors_are_copied_as_bytes():
    state = _state()
    plain = {"big", "bf16", "int64", "bool", "scalar", "empty", "offset_view", "param"}  # a Parameter, detached
    for name, tensor in state.items():
        tensor = tensor.detach()
        assert copies_as_bytes(tensor, torch.empty(tensor.shape, dtype=tensor.dtype)) == (name in plain), name
    assert not copies_as_bytes(torch.ones(4), torch.empty(4, dtype=torch.float64))  # another dtype
    assert not copies_as_bytes(torch.ones(4), torch.empty(2, 2))  # another shape


def test_chunks_cover_every_byte_once_in_pieces_of_at_most_a_chunk():
    src = torch.arange(10_000, dtype=torch.int32)  # 40,000 bytes
    dst = torch.empty_like(src)
    pieces = list(chunks([(dst, src)], chunk=4096))
    assert [n for _, _, n in pieces] == [4096] * 9 + [40_000 - 9 * 4096]
    assert [s - src.data_ptr() for _, s, _ in pieces] == list(range(0, 40_000, 4096))
    assert all(d - dst.data_ptr() == s - src.data_ptr() for d, s, _ in pieces)


def test_several_threads_take_the_chunks(monkeypatch):
    seen: set[str] = set()
    real = host_copy.ctypes.memmove
    barrier = threading.Barrier(3, timeout=10)  # every thread holds one chunk at once: all three took work

    def memmove(dst, src, n):
        name = threading.current_thread().name
        if name not in seen:
            seen.add(name)
            barrier.wait()
        return real(dst, src, n)

    monkeypatch.setattr(host_copy.ctypes, "memmove", memmove)
    src = torch.randn(8 * CHUNK_BYTES // 4)
    dst = torch.empty_like(src)
    copy_bytes([(dst, src)], threads=3)
    assert torch.equal(dst, src) and len(seen) == 3


def test_a_helper_threads_error_reaches_the_caller(monkeypatch):
    real = host_copy.ctypes.memmove
    helper_tried = threading.Event()

    def memmove(dst, src, n):
        if threading.current_thread() is not threading.main_thread():
            helper_tried.set()
            raise OSError("helper failed")
        helper_tried.wait(10)  # the helper takes a chunk before the calling thread copies them all
        return real(dst, src, n)

    monkeypatch.setattr(host_copy.ctypes, "memmove", memmove)
    src = torch.randn(8 * CHUNK_BYTES // 4)
    with pytest.raises(OSError, match="helper failed"):
        copy_bytes([(torch.empty_like(src), src)], threads=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("resilience-host-copy")]


def test_no_more_threads_start_than_there_are_chunks(monkeypatch):
    started: list[str] = []

    class Counted(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(host_copy, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(host_copy.threading, "Thread", Counted)
    src = torch.randn(2 * CHUNK_BYTES // 4 + 1)  # 3 chunks
    dst = torch.empty_like(src)
    copy_bytes([(dst, src)], threads=64)
    assert torch.equal(dst, src) and len(started) == 2  # the calling thread and 2 helpers
