"""Large checkpoint files written with O_DIRECT (resilience/checkpoint/storage/direct_file.py):
the same bytes and digest as a buffered write, a buffered fallback where the filesystem refuses
an aligned write, ENOSPC raised with the descriptor closed, the switch, and a save through it
that validates and resumes bitwise. Buffers are shrunk so the tests write kilobytes, not GiB."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import resilience.checkpoint.storage.direct_file as direct_file
from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.layout import OPTIM_DIR
from resilience.checkpoint.storage.direct_file import DirectFile, direct_writes, open_for_tensors
from resilience.checkpoint.storage.durable import DurableFile, file_digest, fsyncs_deferred
from resilience.checkpoint.storage.manifest import validate
from resilience.config import CheckpointConfig, ConfigError
from resilience.distributed import DistContext
from resilience.env_names import DIRECT_IO_ENV
from resilience.state.step_scheduler import StepScheduler


@pytest.fixture
def small_buffers(monkeypatch):
    """3 buffers of 16 KiB: a file of a few hundred KiB crosses every buffer many times."""
    monkeypatch.setattr(direct_file, "BUFFER_BYTES", 16 << 10)
    monkeypatch.setattr(direct_file, "MAX_BUFFER_BYTES", 16 << 10)
    monkeypatch.setattr(direct_file, "BUFFERS", 3)


def test_a_file_gets_a_sixteenth_of_its_size_per_buffer_between_16_and_64_mib(tmp_path):
    mib = 1 << 20
    sizes = {64 * mib: 16 * mib, 537_000_000: 32 * mib, 1_074_000_000: 64 * mib, 40 << 30: 64 * mib}
    for nbytes, want in sizes.items():
        got = direct_file.buffer_bytes_for(nbytes)
        assert got == want and got % direct_file.ALIGN == 0, (nbytes, got)
    with direct_writes():
        out = open_for_tensors(tmp_path / "big", 1_074_000_000)  # maps its buffers, writes nothing
    try:
        assert isinstance(out, DirectFile) and all(len(b) == 64 * mib for b in out._buffers)
    finally:
        out.close()
    for bad in (0, 1000, -4096):
        with pytest.raises(ValueError, match="multiple of 4096"):
            DirectFile(tmp_path / "bad", buffer_bytes=bad)
    assert not (tmp_path / "bad").exists()  # refused before the file was created


def _filesystem(path: Path) -> str:
    """The filesystem type holding ``path`` (the longest mount point of /proc/mounts above it)."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(path.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


ENFORCES_ALIGNMENT = ("ext4", "xfs")  # O_DIRECT opens work, unaligned writes fail with EINVAL


@pytest.mark.parametrize("sizes", [[], [1], [4095], [16 << 10], [3 * (16 << 10) + 5], [7, 70_000, 1, 4096, 200_003]])
def test_a_direct_file_holds_the_bytes_and_digest_of_a_buffered_write(tmp_path, small_buffers, sizes):
    pieces = [os.urandom(n) for n in sizes]
    with DurableFile(tmp_path / "buffered") as plain:
        for piece in pieces:
            plain.write(piece)
    direct = DirectFile(tmp_path / "direct")
    for piece in pieces:
        assert direct.write(memoryview(piece)) == len(piece)
    assert direct.tell() == sum(sizes)
    direct.close()
    assert (tmp_path / "direct").read_bytes() == b"".join(pieces)  # no padding left past the end
    assert direct.record("x") == plain.record("x")
    assert direct.record("x").digest == file_digest(tmp_path / "direct")
    if _filesystem(tmp_path) in ENFORCES_ALIGNMENT:
        assert direct.direct, "a block filesystem takes O_DIRECT; the fast path must be the one tested"


def test_a_write_the_filesystem_refuses_under_o_direct_goes_on_buffered(tmp_path, monkeypatch):
    if _filesystem(tmp_path) not in ENFORCES_ALIGNMENT:
        pytest.skip(f"{_filesystem(tmp_path)} at {tmp_path} does not refuse unaligned O_DIRECT writes")
    # 1,000-byte "alignment": the first pwrite (3,000 bytes) is not a multiple of 512: EINVAL
    monkeypatch.setattr(direct_file, "ALIGN", 1000)
    monkeypatch.setattr(direct_file, "BUFFER_BYTES", 3000)
    data = os.urandom(10_500)
    with fsyncs_deferred():
        out = DirectFile(tmp_path / "f")
        assert out.direct
        out.write(data)
        out.close()
    assert not out.direct, "the EINVAL must have switched the file to buffered writes"
    assert (tmp_path / "f").read_bytes() == data
    assert out.record("f").digest == file_digest(tmp_path / "f")


def test_a_full_filesystem_raises_enospc_and_closes_the_descriptor(tmpfs, small_buffers):
    full = tmpfs("full", "size=256k")
    before = _open_fds()
    out = DirectFile(full / "f")
    with pytest.raises(OSError, match="No space left on device"):
        try:
            for _ in range(64):  # 1 MiB into 256 KiB
                out.write(b"x" * (16 << 10))
        finally:
            out.close()
    assert out.closed
    assert _open_fds() == before, "the descriptor is closed"
    assert not _writer_threads(), "the writer threads stopped"


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "resilience-direct-write"]


def test_writer_threads_are_daemons_gone_at_close_and_a_closed_file_refuses_writes(tmp_path, small_buffers):
    out = DirectFile(tmp_path / "f")
    threads = _writer_threads()
    # daemons: a write stuck on a hung mount must not keep a preempted process from exiting
    assert len(threads) == direct_file.BUFFERS - 1 and all(t.daemon for t in threads)
    out.write(os.urandom(50_000))
    out.close()
    assert not _writer_threads()
    with pytest.raises(ValueError, match="closed"):
        out.write(b"x")  # its buffers are unmapped: a write must not reach them
    assert (tmp_path / "f").stat().st_size == 50_000


def test_resilience_direct_io_chooses_the_writer_and_a_bad_value_is_refused_at_construction(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_file, "MIN_BYTES", 1)
    for value, kind in (("1", DirectFile), ("0", DurableFile)):
        monkeypatch.setenv(DIRECT_IO_ENV, value)
        with direct_writes():
            out = open_for_tensors(tmp_path / f"f{value}", 10)
        out.close()
        assert type(out) is kind, value
    with direct_writes(False):  # a save staged for object storage
        monkeypatch.setenv(DIRECT_IO_ENV, "1")
        out = open_for_tensors(tmp_path / "g", 10)
        out.close()
        assert type(out) is DurableFile

    monkeypatch.setenv(DIRECT_IO_ENV, "yes")
    with pytest.raises(ConfigError, match=f"{DIRECT_IO_ENV}.*0.*1.*'yes'"):
        Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), DistContext(), state=None, scheduler=StepScheduler(num_epochs=1))


def test_a_local_save_writes_its_tensor_files_with_o_direct_and_resumes_bitwise(tmp_path, monkeypatch, small_buffers):
    monkeypatch.setattr(direct_file, "MIN_BYTES", 1)
    opened: list[Path] = []
    real_init = DirectFile.__init__

    def spy(self, path, buffer_bytes=None):
        opened.append(Path(path))
        real_init(self, path, buffer_bytes)

    monkeypatch.setattr(DirectFile, "__init__", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    scheduler = StepScheduler(num_epochs=1, global_step=1)
    state = TrainingState(model=model, optimizer=optimizer)
    ck = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), DistContext(), state=state, scheduler=scheduler)
    directory = ck.save("periodic")
    assert directory is not None
    validate(directory)  # every digest taken as written matches the file
    folders = sorted(p.parent.name for p in opened)  # the model's file and the optimizer's
    assert len(opened) == 2 and OPTIM_DIR in folders, opened

    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    ck.load(directory, TrainingState(model=fresh, optimizer=fresh_optimizer))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, value in optimizer.state[p].items():
            assert torch.equal(fresh_optimizer.state[q][key], value), key
