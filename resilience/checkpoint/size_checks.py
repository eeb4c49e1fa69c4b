r"""The resume's size checks, spread over the ranks: rank 0 walks the candidates
(:func:`~resilience.checkpoint.resume_choice.choose`) and, for each, broadcasts its manifest;
every rank then ``stat``\ s its contiguous 1/N of the files and one verdict decides for all, so no
rank makes a metadata call per file of the checkpoint (a ``stat`` costs 1-5 ms on Lustre/GPFS:
rank 0 alone checking 24,885 files at 8,192 ranks took 25-125 s). Called from
:mod:`~resilience.checkpoint.reader` (rank 0's ``check`` of each candidate, the other ranks'
:func:`follow`), below it and below ``resume_choice``: nothing here calls back up.
"""

from __future__ import annotations

import re
from typing import Any

from resilience.checkpoint.layout import needed_to_resume
from resilience.checkpoint.storage.manifest import (
    OWNED,
    CheckpointInvalid,
    all_files,
    check_contents,
    data_dir,
    first_size_problem,
    read_owned,
    resume_files,
    validate,
)
from resilience.checkpoint.storage.object_path import Location, Wire, from_wire, is_object, to_wire
from resilience.checkpoint.storage.object_store import StoreError
from resilience.distributed import DistContext

# What rank 0 broadcasts while choosing (reader.find_resume_point): a candidate to size-check, or the result.
CHECK, DONE = "check", "done"


def check_candidate(ctx: DistContext, directory: Location, *, checksums: bool) -> dict[str, Any]:
    """Rank 0's check of one candidate (:func:`choose`'s ``check``): the manifest here, then every
    rank's share of the size checks (:func:`check_sizes`), then, with ``checksums``, every digest
    here. Returns the manifest; raises :class:`CheckpointInvalid` (on rank 0) saying why not."""
    doc = validate(directory, checksums=False, resume=True, sizes=False)
    ctx.broadcast_object((CHECK, (to_wire(directory), doc)))
    check_sizes(ctx, directory, doc)
    if checksums:  # every file here, every rank's own included (the rank manifests read: O(files), as the digests are)
        files_at = data_dir(directory, doc)
        check_contents(files_at, {rel: want for rel, want in all_files(files_at, doc).items() if needed_to_resume(rel)})
    return doc


def follow(ctx: DistContext) -> tuple[tuple[Wire | None, list[str], str | None, str | None], dict[str, Any] | None]:
    """A rank other than 0 during :func:`_choose`: its share of each candidate's size checks, until
    rank 0's result (chosen, warnings, not-found error, other error); returns it with the last
    candidate's manifest (the chosen one's: :func:`choose` stops at the first that passes)."""
    manifest = None
    while True:
        kind, body = ctx.broadcast_object(None)
        if kind == DONE:
            return body, manifest
        path, manifest = body
        try:
            check_sizes(ctx, from_wire(path), manifest)
        except (CheckpointInvalid, StoreError):
            pass  # rank 0 has it too, and goes on to the next candidate (or fails, and says so)


def check_sizes(ctx: DistContext, directory: Location, doc: dict[str, Any]) -> None:
    """Every rank checks the sizes of its share of the files a resume reads: its 1/N of the
    manifest's list (:func:`size_share`), then the own files of the saved ranks it checks, from
    their rank manifests (:func:`~resilience.checkpoint.storage.manifest.read_owned`; kept in its
    copy of ``doc`` under ``OWNED`` for the load's digest share); one verdict for all (a
    collective). Raises :class:`CheckpointInvalid` on every rank, with the message a serial check
    gives (the first bad file, by rank), when a file or rank manifest is missing, short or corrupt."""
    files_at = data_dir(directory, doc)  # on object storage, the save's own prefix
    problem = unanswered = None
    try:
        problem = first_size_problem(files_at, size_share(resume_files(doc), ctx.rank, ctx.world_size))
        if problem is None:
            try:
                doc[OWNED] = read_owned(files_at, doc, ctx.rank, ctx.world_size)
            except CheckpointInvalid as exc:
                problem = str(exc)
            else:
                problem = first_size_problem(files_at, doc[OWNED])
    except StoreError as exc:  # the store did not answer: nothing is known of the checkpoint (never marked bad)
        unanswered = str(exc)
    if is_object(files_at):
        ctx.gather_or_raise(unanswered, fail=StoreError)
    ctx.gather_or_raise(problem, fail=lambda detail: CheckpointInvalid(_first_problem(detail)))


def size_share(files: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's files to ``stat``: the ``rank``-th of ``world_size`` contiguous runs of ``files``
    (in manifest order, a ``stat`` each whatever the size), so the lowest failing rank holds the
    first bad file."""
    items = list(files.items())
    lo, hi = len(items) * rank // world_size, len(items) * (rank + 1) // world_size
    return dict(items[lo:hi])


def _first_problem(detail: str) -> str:
    """The lowest failing rank's finding in a verdict's ``"rank R: <finding>; rank S: ..."``."""
    match = re.match(r"rank \d+: (.*?)(?:; rank \d+: |$)", detail, re.S)
    return match.group(1) if match else detail
