"""The model's save plan and ``shard_index.json`` document, kept across saves of one layout.

MindSpore Transformers' ``save_global_layout_cache`` and Megatron's
``--ckpt-assume-constant-structure``: a plan (:func:`~resilience.checkpoint.formats.pieces.make_plan`,
a collective for a ``DTensor`` without a sharding rule) and the index built from it depend only on
the layout, so a save whose layout fingerprint (keys, global shapes, dtypes, placements, mesh
shapes, world size, tied keys) is the previous save's reuses both: no planning and no planning
collective. A changed layout (a parameter resharded or resized, another world size) is planned
again. Every rank decides alike: the fingerprint is of what every rank of an SPMD job holds alike
(checked once at ``resilient_loop()``, :func:`~resilience.checkpoint.formats.model_io.save_problem`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from resilience.checkpoint.formats import pieces
from resilience.checkpoint.formats.pieces import Plan, layout_fingerprint


class LayoutCache:
    """The last plan and index document, by layout fingerprint; ``enabled=False``
    (``checkpoint.save_global_layout_cache: false``) plans every save. ``plans_made`` counts the
    plans made (what a test observes)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.plans_made = 0
        self._key: str | None = None
        self._plan: Plan | None = None
        self._index: tuple[Plan, dict[str, Any]] | None = None
        self._lock = threading.Lock()  # an asynchronous save's part builds the index in the background

    def plan(self, state: dict[str, torch.Tensor], *, rank: int, world_size: int, gather: Callable[[Any], list[Any]], aliases: dict[str, str]) -> Plan:
        """The plan of ``state`` (its tied keys ``aliases`` left out already): the cached one when
        the layout is unchanged, else :func:`pieces.make_plan` (a collective through ``gather``
        for a ``DTensor`` without a sharding rule), kept for the next save.

        Raises:
            ValueError: from :func:`pieces.make_plan`.
        """
        key = hashlib.sha256(f"{layout_fingerprint(state, world_size)} {sorted(aliases.items())}".encode()).hexdigest()
        with self._lock:
            if self.enabled and key == self._key and self._plan is not None:
                return self._plan
        plan = pieces.make_plan(state, rank=rank, world_size=world_size, gather=gather)
        with self._lock:
            self._key, self._plan = key, plan
            self.plans_made += 1
        return plan

    def index(self, plan: Plan) -> dict[str, Any] | None:
        """The index document kept for this very ``plan`` (:meth:`keep_index`), or ``None``."""
        with self._lock:
            return self._index[1] if self.enabled and self._index is not None and self._index[0] is plan else None

    def keep_index(self, plan: Plan, doc: dict[str, Any]) -> dict[str, Any]:
        """Keep ``doc``, the index document of ``plan``, for the next save; returns it."""
        with self._lock:
            self._index = (plan, doc)
        return doc
