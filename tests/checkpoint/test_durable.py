"""Files digested while written: the same bytes as the libraries' own writers, the same digest as
reading them back, and manifests from before xxh3 (sha256 entries) still validate."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from resilience.checkpoint.storage.durable import DIGEST, DurableFile, file_digest
from resilience.checkpoint.storage.manifest import CheckpointInvalid, validate
from resilience.checkpoint.storage.safetensors_file import read_safetensors, write_safetensors


def test_durable_file_digest_equals_reading_the_file_back(tmp_path):
    path = tmp_path / "f.bin"
    with DurableFile(path) as fh:
        fh.write(b"abc")
        fh.write(memoryview(torch.arange(1000, dtype=torch.int32).numpy()))
        assert fh.tell() == 3 + 4000
    rec = fh.record("f.bin")
    assert rec.size == path.stat().st_size == 4003
    assert rec.digest == file_digest(path) and rec.algorithm == DIGEST
    assert file_digest(path, "sha256") == hashlib.sha256(path.read_bytes()).hexdigest()


def test_safetensors_writer_matches_save_file_byte_for_byte(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(7, 3),
        "b": torch.arange(3.0),
        "i": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(4, dtype=torch.bfloat16),
        "m": torch.tensor([True, False]),
        "s": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    meta = {"format": "pt"}  # one key: save_file orders __metadata__ keys at random (a Rust HashMap)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=meta)
    rec = write_safetensors(tmp_path / "ours.safetensors", tensors, "ours.safetensors", meta)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert rec.digest == file_digest(tmp_path / "ours.safetensors")
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    more = {"format": "pt", "original_dtypes": '{"w": "bfloat16"}'}
    write_safetensors(tmp_path / "more.safetensors", tensors, "more.safetensors", more)
    with safe_open(str(tmp_path / "more.safetensors"), "pt") as fh:
        assert fh.metadata() == more


def test_safetensors_writer_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="x: not contiguous"):
        write_safetensors(tmp_path / "a", {"x": torch.randn(4, 4).t()}, "a")
    with pytest.raises(TypeError, match="has no safetensors code"):
        write_safetensors(tmp_path / "b", {"x": torch.zeros(2, dtype=torch.complex128)}, "b")


def _manifest_dir(tmp_path, entry):
    directory = tmp_path / "epoch_0_step_1"
    directory.mkdir()
    (directory / "a.bin").write_bytes(b"payload")
    doc = {"format_version": 1, "meta": {}, "files": {"a.bin": entry}}
    (directory / "manifest.json").write_text(json.dumps(doc))
    return directory


def test_a_sha256_manifest_from_before_xxh3_still_validates_and_catches_flips(tmp_path):
    directory = _manifest_dir(tmp_path, {"size": 7, "sha256": hashlib.sha256(b"payload").hexdigest()})
    validate(directory)
    (directory / "a.bin").write_bytes(b"paylOad")
    with pytest.raises(CheckpointInvalid, match="checksum mismatch"):
        validate(directory)


def test_an_entry_without_a_digest_is_invalid(tmp_path):
    directory = _manifest_dir(tmp_path, {"size": 7})
    with pytest.raises(CheckpointInvalid, match="has no digest"):
        validate(directory, checksums=False)


def test_safetensors_reader_fills_matching_targets_in_place_and_allocates_the_rest(tmp_path):
    torch.manual_seed(0)
    tensors = {"w": torch.randn(5, 3), "i": torch.arange(4, dtype=torch.int64), "h": torch.randn(2, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "f.safetensors"), metadata={"format": "pt"})
    in_place = torch.zeros(5, 3)
    wrong_dtype = torch.zeros(4, dtype=torch.int32)
    got = read_safetensors(tmp_path / "f.safetensors", {"w": in_place, "i": wrong_dtype})
    assert got["w"] is in_place and torch.equal(in_place, tensors["w"])
    assert got["i"] is not wrong_dtype and got["i"].dtype == torch.int64 and torch.equal(got["i"], tensors["i"])
    assert torch.equal(got["h"], tensors["h"]) and set(got) == set(tensors)


def test_safetensors_reader_refuses_malformed_files(tmp_path):
    save_file({"w": torch.randn(8)}, str(tmp_path / "f.safetensors"))
    data = (tmp_path / "f.safetensors").read_bytes()
    (tmp_path / "short").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="inconsistent data_offsets"):
        read_safetensors(tmp_path / "short")
    (tmp_path / "junk").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors(tmp_path / "junk")


def test_fsyncs_deferred_to_the_block_end_on_this_thread_only(tmp_path, monkeypatch):
    import os
    import threading

    from resilience.checkpoint.storage import durable

    synced: list[int] = []
    real_fsync = os.fsync

    def counting(fd):
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", counting)
    with durable.fsyncs_deferred():
        for name in ("a.bin", "b.bin"):
            with DurableFile(tmp_path / name) as fh:
                fh.write(name.encode() * 100)
        assert synced == []  # closed, not yet fsync'd
        other = threading.Thread(target=lambda: durable.write_bytes(tmp_path / "c.bin", b"c"))
        other.start()
        other.join()
        assert len(synced) == 1  # another thread's file is fsync'd at its close, as before
    assert len(synced) == 3  # both of the block's files, at its end
    assert (tmp_path / "a.bin").read_bytes() == b"a.bin" * 100 and (tmp_path / "b.bin").read_bytes() == b"b.bin" * 100
    assert fh.record("b.bin").digest == file_digest(tmp_path / "b.bin")
    durable.write_bytes(tmp_path / "d.bin", b"d")
    assert len(synced) == 4  # outside a block: at the close again


def test_a_failed_deferred_fsync_raises_after_closing_every_descriptor(tmp_path, monkeypatch):
    import os

    from resilience.checkpoint.storage import durable

    fds: list[int] = []

    def failing(fd):
        fds.append(fd)
        raise OSError(5, "EIO from the disk")

    monkeypatch.setattr(durable.os, "fsync", failing)
    held: list[int] = []
    with pytest.raises(OSError, match="EIO"):
        with durable.fsyncs_deferred():
            for name in ("a.bin", "b.bin"):
                with DurableFile(tmp_path / name) as fh:
                    fh.write(b"x")
            held = list(durable._DEFERRED.get() or [])
    assert len(held) == 2 and fds == held[:1]  # the first failure ends the fsyncs; the rest are only closed
    for fd in held:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed


def test_a_deferred_batch_holds_at_most_max_deferred_descriptors(tmp_path, monkeypatch):
    from resilience.checkpoint.storage import durable

    monkeypatch.setattr(durable, "MAX_DEFERRED", 2)
    with durable.fsyncs_deferred():
        for i in range(5):
            durable.write_bytes(tmp_path / f"{i}.bin", b"x")
        assert len(durable._DEFERRED.get() or []) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{i}.bin" for i in range(5)]
