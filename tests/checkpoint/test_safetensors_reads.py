"""The safetensors reader's requests: several tensors per ``preadv``, a tensor larger than one
request split over several, the digest fed in file order on its thread (large files) or inline
(small ones), an early end of file refused, and a digest error raised on the reader's thread."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from resilience.checkpoint.storage import safetensors_file
from resilience.checkpoint.storage.safetensors_file import read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"small.{i}": torch.randn(3, generator=g) for i in range(40)}  # many per request
    out["big"] = torch.randn(10_000, generator=g)  # 40,000 bytes: split over several requests
    out["empty"] = torch.zeros(0)
    out["bf16"] = torch.randn(33, generator=g).to(torch.bfloat16)
    out["i64"] = torch.arange(7)
    return out


@pytest.mark.parametrize("behind", [True, False], ids=["digest-on-thread", "digest-inline"])
def test_reads_batched_and_split_give_the_bytes_and_the_files_digest(tmp_path, monkeypatch, behind):
    monkeypatch.setattr(safetensors_file, "READ_BYTES", 4096)
    monkeypatch.setattr(safetensors_file, "_MAX_BUFFERS", 5)
    monkeypatch.setattr(safetensors_file, "DIGEST_BEHIND_BYTES", 0 if behind else 1 << 40)
    requests: list[int] = []
    real = os.preadv

    def counting(fd, buffers, offset):
        requests.append(sum(len(b) for b in buffers))
        assert len(buffers) <= 5
        return real(fd, buffers, offset)

    monkeypatch.setattr(safetensors_file.os, "preadv", counting)
    tensors = _tensors()
    path = tmp_path / "f.safetensors"
    save_file(tensors, str(path))
    targets = {key: torch.full_like(t, 7) for key, t in tensors.items()}
    digest = xxhash.xxh3_128()
    got = read_safetensors(path, targets, digest=digest)
    assert digest.hexdigest() == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert set(got) == set(tensors)
    for key, t in tensors.items():
        assert got[key] is targets[key] and torch.equal(got[key], t), key
    assert max(requests) <= 4096 and len(requests) >= 40_000 // 4096  # the big tensor split
    assert sum(requests) == sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_file_that_ends_early_is_refused_and_the_digest_saw_only_its_bytes(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(10)))
    views = [memoryview(bytearray(8)), memoryview(bytearray(8))]
    digest = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="ends early"):
            safetensors_file._read_views(fd, 0, views, digest, "ends early")
    finally:
        os.close(fd)
    assert digest.hexdigest() == xxhash.xxh3_128(bytes(range(10))).hexdigest()


def test_a_digest_error_on_its_thread_is_raised_by_the_read(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_file, "DIGEST_BEHIND_BYTES", 0)

    class Broken:
        def update(self, data):
            raise RuntimeError("digest broke")

        def hexdigest(self):
            return ""

    path = tmp_path / "f.safetensors"
    save_file(_tensors(), str(path))
    with pytest.raises(RuntimeError, match="digest broke"):
        read_safetensors(path, digest=Broken())


@pytest.mark.parametrize("behind", [True, False], ids=["digest-on-thread", "digest-inline"])
def test_short_reads_trailing_bytes_and_a_tied_target_keep_bytes_and_digest(tmp_path, monkeypatch, behind):
    """``preadv`` may return fewer bytes than asked (97 at most here, mid-buffer); bytes after the
    last tensor are digested; two names tied to one target tensor are read into it once (the
    other into a new tensor), so the digest still sees every byte of the file as it is."""
    import threading

    monkeypatch.setattr(safetensors_file, "READ_BYTES", 300)
    monkeypatch.setattr(safetensors_file, "DIGEST_BEHIND_BYTES", 0 if behind else 1 << 40)
    real = os.preadv

    def short(fd, buffers, offset):
        budget, parts = 97, []
        for b in buffers:
            parts.append(b[:budget])
            budget -= len(parts[-1])
            if not budget:
                break
        return real(fd, parts, offset)

    monkeypatch.setattr(safetensors_file.os, "preadv", short)
    tensors = _tensors()
    tensors["flags"] = torch.tensor([True, False, True])
    tensors["tied.a"] = torch.randn(50)
    tensors["tied.b"] = tensors["tied.a"].clone() + 1  # different bytes under two names
    path = tmp_path / "f.safetensors"
    save_file(tensors, str(path))
    with open(path, "ab") as fh:
        fh.write(b"trailing bytes")
    shared = torch.zeros(50)
    targets = {"tied.a": shared, "tied.b": shared}
    threads: set[int] = set()

    class Recording:
        def __init__(self):
            self.inner = xxhash.xxh3_128()

        def update(self, data):
            threads.add(threading.get_ident())
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    digest = Recording()
    got = read_safetensors(path, targets, digest=digest)
    assert digest.hexdigest() == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    for key, t in tensors.items():
        assert torch.equal(got[key], t), key
    assert (got["tied.a"] is shared) != (got["tied.b"] is shared)  # one of them read in place
    assert (threading.get_ident() not in threads) == behind


def test_the_reads_error_wins_over_the_digest_threads(tmp_path, monkeypatch):
    class Broken:  # fails at its second update, the last one before the read hits the end of the file
        calls = 0

        def update(self, data):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("digest broke")

        def hexdigest(self):
            return ""

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(64))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="ends early"), safetensors_file._DigestBehind(Broken()) as behind:
            safetensors_file._read_views(fd, 0, [memoryview(bytearray(32)), memoryview(bytearray(64))], behind, "ends early")
    finally:
        os.close(fd)
