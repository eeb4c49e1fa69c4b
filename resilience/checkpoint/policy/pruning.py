"""Retention's side of each save (:class:`Pruning`), on a filesystem or on object storage.

After a save is published (and only then), rank 0 plans the victims
(:func:`~resilience.checkpoint.policy.retention.plan_prune`: never a pointer's target) and takes
them out of the set of checkpoints at once: renamed aside to ``.pruning_<name>`` on a filesystem,
their manifest deleted on object storage (:func:`~resilience.checkpoint.policy.orphans.uncommit`).
Their files are deleted after the save's last collective, in the background: on a filesystem by
each rank (its own files) and rank 0 (the rest); on object storage by rank 0 alone, one
DeleteObjects request per 1,000 objects, together with the files a re-save of the same step replaced.
"""

from __future__ import annotations

import logging
from typing import Any

from resilience.checkpoint.policy import orphans, retention
from resilience.checkpoint.storage.object_path import ObjectPath
from resilience.checkpoint.writer import phase
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext

log = logging.getLogger("resilience.checkpoint")

DELETE_WAIT_S = 10.0
"""Seconds :meth:`Pruning.finish` waits for the background deletion before it returns."""


class Pruning:
    """Retention for the checkpoints under ``root`` with ``config``'s window (``max_recent_checkpoints``
    or ``save_max``); see the module docstring. Rank 0 plans; every rank deletes its share."""

    def __init__(self, config: CheckpointConfig, root: Any):
        self.config = config
        self.root = root
        self._deleter = retention.Deleter()
        self._own_files: dict[str, list[str]] = {}
        """This rank's files (relative paths) of each checkpoint this process saved (filesystem)."""
        self._object_files: list[tuple[str, str]] = []
        """Rank 0 on object storage: ``(name, prefix)`` of files to delete after the next verdict."""

    @property
    def window(self) -> int | None:
        """``max_recent_checkpoints`` or ``save_max`` (``None``: keep every checkpoint)."""
        return self.config.max_recent_checkpoints if self.config.max_recent_checkpoints is not None else self.config.save_max

    def set_aside(self, final: Any, run_id: str | None) -> list[str]:
        """Rank 0, once ``LATEST`` names ``final``: the victims taken out of the set of checkpoints;
        returns their names."""
        keep = self.window
        if keep is None:
            return []
        victims = retention.plan_prune(self.root, keep, run_id=run_id if self.config.save_max is not None else None, current=final)
        if isinstance(self.root, ObjectPath):
            found = orphans.uncommit(self.root, victims)
            self._object_files += list(found.items())
            return list(found)
        return retention.set_aside(self.root, victims)

    def replaced(self, name: str, files_at: str | None) -> None:
        """Rank 0 on object storage: a re-save of ``name`` replaced the files under ``files_at`` (deleted with the victims)."""
        if files_at is not None:
            self._object_files.append((name, files_at))

    def remember(self, name: str, files: list[str]) -> None:
        """This rank wrote ``files`` into checkpoint ``name`` (kept only with retention, on a filesystem)."""
        if self.window is not None and not isinstance(self.root, ObjectPath):
            self._own_files[name] = files

    def delete(self, ctx: DistContext, victims: list[str]) -> None:
        """After the save's last collective, in the background: the files of ``victims`` (and on
        object storage of the replaced checkpoints); rank 0 then removes what is left of those
        set aside at earlier saves. Bounded per rank: only this process's saves are remembered."""
        if isinstance(self.root, ObjectPath):
            pending, self._object_files = self._object_files, []
            if pending:
                self._deleter.submit(lambda: self._delete_objects(pending))
            return
        mine = {victim: self._own_files.pop(victim) for victim in victims if victim in self._own_files}
        if not mine and (ctx.rank != 0 or self.window is None):
            return
        spare = frozenset(victims)

        def job() -> None:
            phase("delete")
            for victim, files in mine.items():
                retention.delete_files(self.root, victim, files)
            phase("deleted")
            if ctx.rank == 0:
                retention.remove_set_aside(self.root, spare=spare)

        self._deleter.submit(job)

    def _delete_objects(self, pending: list[tuple[str, str]]) -> None:
        phase("delete")
        for name, files_at in pending:
            orphans.delete_files(self.root, name, files_at)
        phase("deleted")

    def finish(self, ctx: DistContext) -> None:
        """At close: rank 0 removes what is left of every set-aside checkpoint; every rank waits for
        its deletion at most :data:`DELETE_WAIT_S` seconds (a warning past it)."""
        saving = self.config.enabled and self.config.enable_save
        if ctx.rank == 0 and saving and self.window is not None and not isinstance(self.root, ObjectPath):
            self._deleter.submit(lambda: retention.remove_set_aside(self.root))
        if not self._deleter.wait(DELETE_WAIT_S):
            log.warning("retention: deletion still running after %g s at close; left to a later save", DELETE_WAIT_S)
