"""Large checkpoint files written with ``O_DIRECT``: past the page cache, at the disk's rate.

A buffered ``os.write`` copies every byte into the page cache and the fsync then writes it
out: two passes, and the copy needs a page-cache folio per 4 KiB to 2 MiB of the file, which
on a virtual machine whose free memory the host reclaims (virtio-balloon free page reporting,
as on the benchmark machine) can cost a host fault per folio. In the FSDP2 bench's setting (2
writer processes on 2 cores, 1.6 GB each, fsync'd) buffered writes took 1.6-4.5 s a round
(median 2.9 s) and ``O_DIRECT`` through two 16 MiB aligned buffers 1.5-1.8 s (median 1.6 s);
with this class's three buffers, in two more runs beside buffered writes: 1.5 and 1.7 s against
3.9 and 4.8 s.
DeepSpeed's FastPersist writes checkpoints the same way.

:class:`DirectFile` is a :class:`~resilience.checkpoint.storage.durable.DurableFile` (digested
as written, fsync'd on close or in a batch) whose bytes go through :data:`BUFFERS` page-aligned
buffers of 16-64 MiB (:func:`buffer_bytes_for`, by the file's size): the caller's thread copies
into one (``memmove``, the GIL released) and digests it while it is hot in cache, writer threads
``pwrite`` the others at aligned file offsets. The last buffer is written padded to :data:`ALIGN` and the file truncated
to its length. Where the filesystem refuses ``O_DIRECT`` (at ``open``, or ``EINVAL`` at a write)
the same file goes on buffered, so a save never fails for the lack of it. The data is then not
in the page cache: a later read of the file comes from the disk.

Reads stay buffered: a reader of the same design (two 16 MiB buffers read ahead on threads,
copied into the tensors) loaded the FSDP2 bench's checkpoint in 3.8 s against 2.3 s buffered
(interleaved rounds, quiet machine): the kernel's readahead keeps more of the disk busy.

``RESILIENCE_DIRECT_IO=0`` turns it off (:func:`direct_io_enabled`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from resilience.checkpoint.storage.durable import DurableFile
from resilience.env_names import DIRECT_IO_ENV

ALIGN = 4096
"""Bytes: the alignment of every ``O_DIRECT`` write's offset, length and buffer (the largest
logical block size Linux block devices use; a multiple of 512)."""
BUFFER_BYTES = 16 << 20
"""Bytes per aligned buffer, at least: 16 MiB ran at 0.92 of 8 MiB's time in the A/B above."""
MAX_BUFFER_BYTES = 64 << 20
"""Bytes per aligned buffer, at most: a file gets 1/16 of its size per buffer between the two
(:func:`buffer_bytes_for`). In the FSDP2 bench's shape (2 processes, each writing a 0.54 GB and a
1.07 GB file at once, fsync'd; 6 rounds rotating, two A/Bs) 3 buffers of 64 MiB took 1.67 and
1.74 s against 1.87 and 1.93 s with 16 MiB; 8 MiB x 9 (as many bytes in flight as 64 MiB x 2)
1.94 s: the size of each request counts, not the bytes in flight. Capped so a file's buffers stay
at most 192 MiB (3/16 of its size from 256 MiB up; the 16 MiB floor's 48 MiB below that)."""
BUFFERS = 3
"""Aligned buffers per file: one being filled, the others being written (one writer thread each,
so the disk sees BUFFERS - 1 requests of a rank at once)."""
MIN_BYTES = 64 << 20
"""Files smaller than this (bytes) are written buffered: their page-cache copy costs little,
and the 48 MiB of buffers would cost more."""

# Whether this thread's writes may use O_DIRECT (writer.py enables it for a local save's parts:
# a save staged for object storage reads its files back to upload them, from the page cache).
_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("resilience_direct_io", default=False)


def direct_io_enabled() -> bool:
    """Whether ``RESILIENCE_DIRECT_IO`` allows ``O_DIRECT`` writes (unset or ``1``: yes; ``0``: no).

    Raises:
        ValueError: any other value, naming the variable and the accepted forms.
    """
    raw = os.environ.get(DIRECT_IO_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{DIRECT_IO_ENV}: expected 0 (buffered writes) or 1 (O_DIRECT for large checkpoint files), got {raw!r}")
    return raw == "1" and hasattr(os, "O_DIRECT")


@contextlib.contextmanager
def direct_writes(allowed: bool = True) -> Iterator[None]:
    """Within the block, on this thread, :func:`open_for_tensors` may return a :class:`DirectFile`
    (when ``allowed`` and :func:`direct_io_enabled`)."""
    token = _ALLOWED.set(allowed and direct_io_enabled())
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def buffer_bytes_for(nbytes: int) -> int:
    """Bytes per aligned buffer for a file of about ``nbytes``: 1/16 of it, a multiple of
    :data:`BUFFER_BYTES` between it and :data:`MAX_BUFFER_BYTES`."""
    return min(MAX_BUFFER_BYTES, max(BUFFER_BYTES, nbytes // 16 // BUFFER_BYTES * BUFFER_BYTES))


def open_for_tensors(path: Path, nbytes: int) -> DurableFile:
    """A new durable file at ``path`` for about ``nbytes`` bytes of tensor data: a
    :class:`DirectFile` with :func:`buffer_bytes_for` buffers inside :func:`direct_writes` for
    ``nbytes >= MIN_BYTES``, else a buffered :class:`DurableFile`. Raises ``OSError`` from the open."""
    if nbytes >= MIN_BYTES and _ALLOWED.get():
        return DirectFile(path, buffer_bytes=buffer_bytes_for(nbytes))
    return DurableFile(path)


class DirectFile(DurableFile):
    """A :class:`DurableFile` written with ``O_DIRECT`` through aligned buffers (see the module's
    docstring); the same stream interface (``write``, ``tell``, ``close``, ``record``).

    ``direct`` says whether the file is (still) written with ``O_DIRECT``. Raises ``OSError``
    from the open, the writes (at the next ``write`` or at ``close``: they run on a writer
    thread), the truncation or the fsync (e.g. ENOSPC).
    """

    def __init__(self, path: Path | str, buffer_bytes: int | None = None):
        """``buffer_bytes``: bytes per aligned buffer, a positive multiple of :data:`ALIGN`
        (default :data:`BUFFER_BYTES`); :data:`BUFFERS` of them are mapped while the file is open.

        Raises:
            ValueError: ``buffer_bytes`` is not a positive multiple of :data:`ALIGN` (checked
                before the file is created).
        """
        if buffer_bytes is not None and (buffer_bytes <= 0 or buffer_bytes % ALIGN):
            raise ValueError(f"DirectFile buffer_bytes={buffer_bytes}: must be a positive multiple of {ALIGN} (O_DIRECT alignment)")
        path = Path(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            self.direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # tmpfs before Linux 6.6, some FUSE filesystems
                raise
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self.direct = False
        super().__init__(path, fd=fd)
        self._chunk = buffer_bytes or BUFFER_BYTES
        self._current = 0
        self._fill = 0  # bytes in the current buffer
        self._offset = 0  # file offset of the current buffer
        self._jobs: queue.SimpleQueue[tuple[int, int, int, concurrent.futures.Future[None]] | None] = queue.SimpleQueue()
        try:
            # private: a child forked meanwhile (a data loader's worker) does not keep them mapped
            self._buffers = [mmap.mmap(-1, self._chunk, flags=mmap.MAP_PRIVATE) for _ in range(BUFFERS)]
            self._views = [memoryview(b) for b in self._buffers]
            self._addresses = [np.frombuffer(b, dtype=np.uint8).ctypes.data for b in self._buffers]
            self._pending: list[concurrent.futures.Future[None] | None] = [None] * len(self._buffers)
            # daemon threads, not an executor's: Python joins those at exit, so a write stuck on a
            # hung mount would keep a preempted process from exiting (async_writer.py's promise)
            self._writers = [threading.Thread(target=self._serve, name="resilience-direct-write", daemon=True) for _ in range(BUFFERS - 1)]
            for thread in self._writers:
                thread.start()
        except BaseException:
            self._writers = getattr(self, "_writers", [])
            self._stop_writers()
            os.close(self._fd)
            super(DurableFile, self).close()
            raise

    def write(self, data: Any) -> int:
        """Write all of ``data`` (any C-contiguous bytes-like object); returns its length in bytes.
        Raises ``ValueError`` once the file is closed (its buffers are unmapped)."""
        if self.closed:
            raise ValueError(f"{self.path}: write to a closed DirectFile")
        view = memoryview(data).cast("B")
        source = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
        done = 0
        while done < len(view):
            n = min(self._chunk - self._fill, len(view) - done)
            ctypes.memmove(self._addresses[self._current] + self._fill, source + done, n)  # releases the GIL
            self._fill += n
            done += n
            if self._fill == self._chunk:
                self._submit()
        self._size += len(view)
        return len(view)

    def _submit(self) -> None:
        """Digest the current buffer and hand it to a writer thread; wait for the next one to be free."""
        index, fill, offset = self._current, self._fill, self._offset
        self._digest.update(self._views[index][:fill])
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._pending[index] = future
        self._jobs.put((index, fill, offset, future))
        self._current, self._fill, self._offset = (index + 1) % len(self._buffers), 0, offset + fill
        self._wait(self._current)

    def _wait(self, index: int) -> None:
        pending = self._pending[index]
        if pending is None:
            return
        try:
            pending.result()  # raises the writer thread's OSError here
        finally:
            if pending.done():  # not after an interrupt: close() must still wait for that write
                self._pending[index] = None

    def _serve(self) -> None:
        """Writer thread: run the queued buffer writes until a ``None``."""
        while (job := self._jobs.get()) is not None:
            index, fill, offset, future = job
            try:
                self._write_at(index, fill, offset)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                future.set_exception(exc)
            else:
                future.set_result(None)

    def _stop_writers(self) -> None:
        for _ in self._writers:
            self._jobs.put(None)
        for thread in self._writers:
            thread.join()

    def _write_at(self, index: int, fill: int, offset: int) -> None:
        """Writer thread: buffer ``index``'s first ``fill`` bytes at ``offset`` (padded to ALIGN while direct)."""
        length = -(-fill // ALIGN) * ALIGN if self.direct else fill
        view = self._views[index]
        if length > fill:
            view[fill:length] = bytes(length - fill)  # past the end: truncated at close
        done = 0
        refused = False
        while done < length:
            try:
                done += os.pwrite(self._fd, view[done:length], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or refused:
                    raise
                refused = True  # the filesystem took the open, not the aligned write (or a short write left it unaligned)
                self._go_buffered()  # for every writer thread: one may see EINVAL after another switched

    def _go_buffered(self) -> None:
        import fcntl  # POSIX only, as O_DIRECT: not imported where the package merely loads

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        """Write the last buffer, truncate to the bytes written, then fsync (or defer it) and close,
        as :meth:`DurableFile.close`. On an error the descriptor is closed without its fsync."""
        if self.closed:
            return
        try:
            if self._fill:
                self._submit()
            for index in range(len(self._buffers)):
                self._wait(index)
            os.ftruncate(self._fd, self._size)  # drop the last write's padding
        except BaseException:
            self._release()
            os.close(self._fd)
            self._fd = -1
            super(DurableFile, self).close()
            raise
        self._release()
        super().close()

    def _release(self) -> None:
        """Stop the writer threads (after their writes) and unmap the buffers now, not at garbage collection."""
        self._stop_writers()
        self._pending = [None] * len(self._buffers)
        for view, buffer in zip(self._views, self._buffers, strict=True):
            view.release()
            buffer.close()
