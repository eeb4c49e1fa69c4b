"""The resume path, top to bottom: pick a valid checkpoint (rank 0), tell every rank, load while
checking its bytes.

Rank 0 follows ``LATEST`` (or ``restore_from``) and checks the manifest; every rank checks the
sizes of its share of the files (a ``stat`` each: 1/N of them per rank), and when the target is
missing or incomplete rank 0 falls back with a warning, in the order of
:func:`~resilience.checkpoint.resume_choice.resume_candidates` (its lineage first, then older
checkpoints); the manifest it parsed goes to every rank with the candidate. Every rank then loads
the chosen directory while checking its share of the files (:func:`checking_while_loading`): the files
the loader reads whole (our safetensors files) are digested as their bytes pass, the others by a
background thread beside the load; every byte is read once, instead of a full checksum pass
before the load, which read everything twice. A checkpoint whose bytes differ from its manifest
is marked bad on every rank's behalf, so the next choice skips it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from resilience.checkpoint import size_checks
from resilience.checkpoint.balance import balance, stream_owners
from resilience.checkpoint.formats import balanced_load
from resilience.checkpoint.layout import BAD_MARKER, needed_to_resume
from resilience.checkpoint.resume_choice import choose
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.manifest import OWNED, CheckpointInvalid
from resilience.checkpoint.storage.object_path import Location, Wire, from_wire, is_object, to_wire
from resilience.distributed import DistContext

log = logging.getLogger("resilience.checkpoint")


T = TypeVar("T")


class CheckpointNotFound(FileNotFoundError):
    """An explicitly requested checkpoint (``restore_from``) does not exist or is invalid."""


class CheckpointCorrupted(CheckpointInvalid):
    """A checkpoint's bytes differed from its manifest while it was loaded (it is now marked bad);
    what was loaded from it must not be used."""


def mark_bad(directory: Location, why: str) -> None:
    """Write ``directory/.bad`` so no later start tries this checkpoint again (best effort)."""
    try:
        (directory / BAD_MARKER).write_text(why + "\n")
    except OSError:
        pass


def _choose(ctx: DistContext, root: Location, restore_from: str | None, key: str, checksums: bool) -> tuple[Wire | None, dict[str, Any] | None, list[str]]:
    """(directory to resume from or None, its manifest, warnings). Runs on rank 0, the other ranks
    in :func:`~resilience.checkpoint.size_checks.follow` meanwhile (each candidate's size check is theirs too); marks the candidates
    found invalid as bad, so no later start checks them again."""
    check = functools.partial(size_checks.check_candidate, ctx, checksums=checksums)
    if restore_from is not None:
        given = Path(restore_from)
        path: Location = given if given.is_absolute() or (not is_object(root) and given.exists()) else root / restore_from
        try:
            return to_wire(path), check(path), []
        except CheckpointInvalid as exc:
            raise CheckpointNotFound(f"{key}={restore_from!r}: {exc}") from exc
    choice = choose(root, check)
    warnings = [choice.latest_problem] if choice.latest_problem else []
    for skipped in choice.skipped:
        if skipped.marked_bad:
            warnings.append(f"skipping {skipped.path.name}: marked bad ({skipped.why})")  # at this start's failed load, or an earlier start
        else:
            warnings.append(f"skipping invalid checkpoint: {skipped.why}")
            mark_bad(skipped.path, skipped.why)
    if choice.chosen is not None:
        if warnings:
            warnings.append(f"falling back to {choice.chosen.name}")
        return to_wire(choice.chosen), choice.manifest, warnings
    if choice.candidates:
        warnings.append(f"no valid checkpoint under {root}: starting from scratch")
    return None, None, warnings


def find_resume_checkpoint(
    ctx: DistContext, root: Location, restore_from: str | None, *, key: str = "checkpoint.restore_from", checksums: bool = True
) -> Location | None:
    """The checkpoint every rank should resume from, or ``None`` for a fresh start (collective);
    :func:`find_resume_point` without the manifest."""
    return find_resume_point(ctx, root, restore_from, key=key, checksums=checksums)[0]


def find_resume_point(
    ctx: DistContext, root: Location, restore_from: str | None, *, key: str = "checkpoint.restore_from", checksums: bool = True
) -> tuple[Location | None, dict[str, Any] | None]:
    """(the checkpoint every rank should resume from, its manifest), or ``(None, None)`` for a fresh
    start (collective). Rank 0 chooses (:func:`~resilience.checkpoint.resume_choice.choose`) and
    parses each candidate's manifest once; every rank receives it and checks the sizes of its share
    of the candidate's files (1/N of them), one verdict deciding for all whether rank 0 falls back.

    ``checksums=False`` checks sizes only (one ``stat`` per file, spread over the ranks): for a
    caller that loads the choice with :func:`checking_while_loading`, which checks the bytes while
    they are read. With ``checksums``, rank 0 also digests every file of the candidate.

    Raises:
        CheckpointNotFound: on every rank, when ``restore_from`` is given but missing or invalid
            (the message names it as ``key``, e.g. ``checkpoint.load_path``).
        RuntimeError: on the other ranks, when rank 0 failed otherwise while choosing (it raises
            its own error).
    """
    if ctx.rank == 0:
        manifest = None
        try:
            chosen, manifest, warnings = _choose(ctx, root, restore_from, key, checksums)
            result: tuple[Wire | None, list[str], str | None, str | None] = (chosen, warnings, None, None)
        except CheckpointNotFound as exc:
            result = (None, [], str(exc), None)
        except Exception as exc:  # the others wait in a broadcast: let them fail too, then raise it here
            ctx.broadcast_object((size_checks.DONE, (None, [], None, f"rank 0 failed choosing a checkpoint: {type(exc).__name__}: {exc}")))
            raise
        ctx.broadcast_object((size_checks.DONE, result))
    else:
        result, manifest = size_checks.follow(ctx)
    chosen, warnings, not_found, failed = result
    if failed:
        raise RuntimeError(failed)
    if not_found:
        raise CheckpointNotFound(not_found)
    if ctx.rank == 0:
        for line in warnings:
            log.warning(line)
    return (from_wire(chosen), manifest) if chosen else (None, None)


@contextlib.contextmanager
def checking_while_loading(
    ctx: DistContext, directory: Path, manifest: dict[str, Any], *, inline: Iterable[str] = (), balanced: bool = False, checkpoint: Location | None = None
) -> Iterator[ContentCheck]:
    """Around the load of ``directory``: this rank digests its share of the checkpoint's files,
    listed in its parsed ``manifest``, while the ``with`` body loads; a collective over ``ctx``
    (every rank enters and leaves it, failed or not).

    The shares of the manifest's list are balanced by size, and each rank also checks the own
    files of the saved ranks whose rank manifests it read (``OWNED``: its own, at the same world
    size, which its loader reads), so every file is checked once across the ranks. The
    :class:`~resilience.checkpoint.storage.content_check.ContentCheck` it yields lets the loader
    digest a file of the share itself as it reads it (``check.claim``/``check.report``): ``inline``
    names the files it is expected to; a background thread digests the rest of the share during
    the load, and after it whatever the loader did not report. ``balanced``: the loader reads the
    ``inline`` files as :mod:`~resilience.checkpoint.formats.balanced_load` streams (each rank a
    range), and each of them is digested by the rank whose range holds its first byte.
    ``checkpoint``: the checkpoint marked bad when its bytes are corrupt, where ``directory`` is
    a local copy of it (a resume from object storage); ``None``: ``directory`` itself.

    Raises, on leaving the ``with``:
        CheckpointCorrupted: on every rank, when any file's digest differs from the manifest,
            whatever else failed (``directory`` is then marked bad).
        Exception: the body's own error when the bytes were intact (a peer's, as RuntimeError).
    """
    listed = {rel: want for rel, want in manifest["files"].items() if needed_to_resume(rel)}  # not the bundle: never read
    owned = {rel: want for rel, want in manifest.get(OWNED, {}).items() if needed_to_resume(rel)}  # the saved ranks' own files this rank checks
    inline = list(inline)
    streams = list(balanced_load.streams(inline).values()) if balanced else []
    share = sorted(_share(listed, ctx.rank, ctx.world_size, streams) + list(owned))
    check = ContentCheck(directory, {**listed, **owned}, share, inline=inline)
    check.start()
    error: BaseException | None = None
    try:
        yield check
    except (KeyboardInterrupt, SystemExit):
        check.abandon()  # leave now: no digest pass of what the load did not reach
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; decided below
        error = exc
    finally:
        check.finish()
    # Two verdicts, in order: corrupt bytes anywhere (the checkpoint is bad, whatever else failed),
    # then a load that failed on intact bytes (this rank's own error raised as itself).
    ctx.gather_or_raise(check.problem, fail=lambda detail: _corrupted(ctx, checkpoint or directory, detail, error))
    own = None if error is None else f"{type(error).__name__}: {error}"
    ctx.gather_or_raise(own, fail=lambda detail: error or RuntimeError(f"loading {directory.name} failed on {detail}"))


def _corrupted(ctx: DistContext, directory: Location, detail: str, cause: BaseException | None) -> CheckpointCorrupted:
    """The error every rank raises for corrupt files (``detail``: each rank's finding); rank 0
    marks ``directory`` bad first, so no later start chooses it again."""
    if ctx.rank == 0:
        mark_bad(directory, detail)
    corrupted = CheckpointCorrupted(detail)
    corrupted.__cause__ = cause
    return corrupted


def _share(files: dict[str, Any], rank: int, world_size: int, streams: Iterable[list[str]] = ()) -> list[str]:
    """This rank's files to digest (all ranks agree): a file of ``streams`` (balanced loading) to
    the rank that reads its first byte; the others largest first, each to the least loaded rank."""
    owner = {}
    for stream in streams:
        owner.update(stream_owners([(rel, int(files[rel].get("size", 0))) for rel in stream if rel in files], world_size))
    owner.update(balance({rel: int(files[rel].get("size", 0)) for rel in sorted(files) if rel not in owner}, world_size))
    return sorted(rel for rel, r in owner.items() if r == rank)  # path order: roughly the order the loader reads them
