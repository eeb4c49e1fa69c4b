"""``LATEST``-style pointers: a relative symlink swapped atomically, ``<NAME>.txt`` where symlinks fail.

The swap is temp name + ``os.replace`` (never delete-then-create), so a crash leaves either the
old or the new pointer, never none. A pointer that leads outside ``checkpoint_dir`` is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from resilience.checkpoint.layout import pointer_text_name
from resilience.checkpoint.storage.durable import fsync_dir, write_bytes


class PointerError(ValueError):
    """A pointer names something outside the checkpoint root or is malformed."""


def write_pointer(root: Path, name: str, target: Path) -> None:
    """Point ``root/name`` at ``target`` (a directory directly under ``root``), durably.

    Raises:
        OSError: the filesystem refused (the previous pointer is left as it was).
    """
    rel = target.name
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


def read_pointer(root: Path, name: str) -> Path | None:
    """The directory ``root/name`` (symlink) or ``root/name.txt`` points at, or ``None`` if absent.

    The target may not exist (a deleted checkpoint): callers validate it.

    Raises:
        PointerError: the pointer leads outside ``root`` (absolute, ``..``, or nested).
    """
    link = root / name
    txt = root / pointer_text_name(name)
    if link.is_symlink():
        rel = os.readlink(link)
    elif txt.is_file():
        rel = txt.read_text().strip()
    else:
        return None
    if not rel or os.path.isabs(rel) or "/" in rel.strip("/") or rel in (".", ".."):
        raise PointerError(f"{link}: pointer target {rel!r} is outside {root}; refusing to follow it")
    target = root / rel.strip("/")
    if target.is_symlink():
        # A checkpoint name that is itself a link could lead anywhere; list_checkpoints skips them too.
        raise PointerError(f"{link}: pointer target {rel!r} is a symlink; refusing to follow it")
    return target
