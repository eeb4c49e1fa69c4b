"""``LATEST``-style pointers: a relative symlink swapped atomically, ``<NAME>.txt`` where symlinks fail.

The swap is temp name + ``os.replace`` (never delete-then-create), so a crash leaves either the
old or the new pointer, never none. A pointer that leads outside ``checkpoint_dir`` is refused.
On object storage a pointer is a small object holding the name, written with a conditional PUT
(:meth:`~resilience.checkpoint.storage.object_store.ObjectStore.write_pointer`).
"""

from __future__ import annotations

import os

from resilience.checkpoint.layout import pointer_text_name
from resilience.checkpoint.storage.durable import fsync_dir, write_bytes
from resilience.checkpoint.storage.object_path import Location, ObjectPath


class PointerError(ValueError):
    """A pointer names something outside the checkpoint root or is malformed."""


def write_pointer(root: Location, name: str, target: Location) -> None:
    """Point ``root/name`` at ``target`` (a directory directly under ``root``), durably.

    Raises:
        OSError: the filesystem or store refused (the previous pointer is left as it was); on object
            storage ``PreconditionFailed`` when another writer moved it since this process read it.
    """
    rel = target.name
    if isinstance(root, ObjectPath):
        root.store.write_pointer(name, rel)
        return
    tmp = root / f".{name}.tmp.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        os.symlink(rel, tmp)
    except OSError:
        # Filesystems without symlinks (some object-store mounts): a text pointer instead.
        txt_tmp = root / f".{pointer_text_name(name)}.tmp.{os.getpid()}"
        write_bytes(txt_tmp, (rel + "\n").encode())
        os.replace(txt_tmp, root / pointer_text_name(name))
        if (root / name).is_symlink():
            (root / name).unlink()  # readers prefer the symlink: a stale one would win over the new text
    else:
        os.replace(tmp, root / name)
        stale_txt = root / pointer_text_name(name)
        if stale_txt.exists():
            stale_txt.unlink()  # one pointer form at a time, so readers cannot disagree
    fsync_dir(root)


def read_pointer(root: Location, name: str) -> Location | None:
    """The directory ``root/name`` (symlink) or ``root/name.txt`` points at, or ``None`` if absent.

    The target may not exist (a deleted checkpoint): callers validate it.

    Raises:
        PointerError: the pointer leads outside ``root`` (absolute, ``..``, or nested).
    """
    if isinstance(root, ObjectPath):
        held = root.store.read_pointer(name)
        if held is None:
            return None
        _check_target(root / name, held, root)
        return root / held.strip("/")
    link = root / name
    txt = root / pointer_text_name(name)
    if link.is_symlink():
        rel = os.readlink(link)
    elif txt.is_file():
        rel = txt.read_text().strip()
    else:
        return None
    _check_target(link, rel, root)
    target = root / rel.strip("/")
    if target.is_symlink():
        # A checkpoint name that is itself a link could lead anywhere; list_checkpoints skips them too.
        raise PointerError(f"{link}: pointer target {rel!r} is a symlink; refusing to follow it")
    return target


def _check_target(link: object, rel: str, root: object) -> None:
    """Raise :class:`PointerError` unless ``rel`` names an entry directly under ``root``."""
    if not rel or os.path.isabs(rel) or "/" in rel.strip("/") or rel in (".", ".."):
        raise PointerError(f"{link}: pointer target {rel!r} is outside {root}; refusing to follow it")


def delete_pointer(root: Location, name: str) -> None:
    """Remove pointer ``root/name`` in either form (no error when absent)."""
    if isinstance(root, ObjectPath):
        root.store.delete_pointer(name)
        return
    for path in (root / name, root / pointer_text_name(name)):
        if path.is_symlink() or path.exists():
            path.unlink()
