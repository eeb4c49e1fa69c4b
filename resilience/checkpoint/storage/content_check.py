"""Checking a checkpoint's bytes against its manifest while it loads, reading each byte once.

One :class:`ContentCheck` per rank and load digests this rank's share of the files (every file
is checked by one rank). A loader that reads a file whole and in order (our safetensors files:
a replicated model's shards, the optimizer's files) digests it itself as its bytes pass
(:meth:`ContentCheck.claim`, then :meth:`ContentCheck.report`): one read, no second pass
through the page cache, no thread competing for a core. The thread beside the load digests the
rest of the share (files another library reads: DCP's, JSON, RNG), and once the load is over
(:meth:`ContentCheck.finish`) whatever the loader was expected to digest but did not (a file
it read by slices, or one whose reading failed), so every file of the share is checked either way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from resilience.checkpoint.storage.durable import Digest, entry_digest, new_digest
from resilience.checkpoint.storage.manifest import digest_problem
from resilience.checkpoint.storage.object_path import Location

MISMATCH = "checksum mismatch (corrupted bytes)"


class ContentCheck(threading.Thread):
    """Digests ``rels`` (paths relative to ``directory``) against the manifest ``files``;
    ``problem`` is the first mismatch or read error, else None.

    ``inline``: the files the loader is expected to digest itself (:meth:`claim`); the thread
    leaves those of its share until :meth:`finish`, and digests there the ones nobody reported.
    The digests release the GIL, so the thread runs beside the loader on another core.
    """

    def __init__(self, directory: Location, files: dict[str, Any], rels: list[str], inline: Iterable[str] = ()):
        super().__init__(name="resilience-content-check", daemon=True)
        self.directory, self.files, self.rels = directory, files, rels
        self.inline = frozenset(inline)
        self.problem: str | None = None
        self._share = frozenset(rels)
        self._taken: set[str] = set()  # claimed by the loader or started by the thread
        self._checked: set[str] = set()  # digested to the end (by either)
        self._lock = threading.Lock()
        self._load_over = threading.Event()
        self._abandoned = False

    def claim(self, rel: str) -> Digest | None:
        """A fresh hash object for the loader to feed every byte of ``rel`` with, in order, or
        ``None`` when this rank need not digest it (another rank's share, or already taken)."""
        digest = entry_digest(self.files.get(rel, {}))
        with self._lock:
            if rel not in self._share or rel in self._taken or digest is None:
                return None
            self._taken.add(rel)
        return new_digest(digest[0])

    def report(self, rel: str, hasher: Digest) -> None:
        """The loader fed ``hasher`` (from :meth:`claim`) all of ``rel``: compare it with the manifest.

        Raises:
            ValueError: ``rel``'s entry has no digest, so :meth:`claim` gave no hasher for it.
        """
        want = entry_digest(self.files[rel])
        if want is None:
            raise ValueError(f"{self.directory / rel}: report() of a file whose entry has no digest (claim() returned None for it)")
        if hasher.hexdigest() != want[1]:
            self._fail(rel, MISMATCH)
        with self._lock:
            self._checked.add(rel)

    def finish(self) -> None:
        """The load is over (or failed): digest what the loader left, then return."""
        self._load_over.set()
        self.join()

    def abandon(self) -> None:
        """Stop after the file being digested (the load was interrupted: its result is not used)."""
        self._abandoned = True
        self._load_over.set()

    def run(self) -> None:
        """The share less ``inline`` now, the rest after :meth:`finish`; stops at the first problem."""
        for rel in self.rels:
            if rel not in self.inline and not self._check(rel):
                return
        self._load_over.wait()
        for rel in self.rels:
            with self._lock:
                left = rel not in self._checked
            if left and not self._check(rel, force=True):
                return

    def _check(self, rel: str, *, force: bool = False) -> bool:
        """Digest ``rel`` unless the loader took it (``force``: even then, as it did not report
        it); False once a problem is recorded."""
        with self._lock:
            if self._abandoned:
                return False
            if rel in self._taken and not force:
                return self.problem is None
            self._taken.add(rel)
        problem = digest_problem(self.directory / rel, self.files[rel])
        if problem is not None:
            self._fail(rel, problem)
        with self._lock:
            self._checked.add(rel)
        return self.problem is None

    def _fail(self, rel: str, problem: str) -> None:
        with self._lock:
            if self.problem is None:
                self.problem = f"{self.directory / rel}: {problem}"
