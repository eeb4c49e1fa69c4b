"""What ``resilience status``, ``verify`` and ``advise`` share: argument errors, printing, the JSON version.

The text output is for people; ``--json`` prints a document with ``"version": 1`` whose keys
only ever get added to. Only the standard library (and :mod:`resilience.local_paths`, which needs no
more) is imported here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from resilience.checkpoint.layout import CONFIG
from resilience.exit_codes import ExitCode
from resilience.local_paths import URL, NotALocalPath, local_path

if TYPE_CHECKING:  # imported where it is used: a CLI that reads local files only never loads storage code
    from resilience.checkpoint.storage.object_path import Location

JSON_VERSION = 1


class UsageError(ValueError):
    """Bad command-line input (exit code 2); the message names the argument."""


def within(message: str, directory: Path) -> str:
    """``message`` about a file of ``directory``, with the directory's own path taken out."""
    if message.startswith(f"{directory}: "):
        message = message[len(str(directory)) + 2 :]
    return message.replace(str(directory) + os.sep, "")


def first_line(path: Path) -> str:
    """The first line of a small text file (a ``.bad`` marker's reason), or why it cannot be read."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return text.splitlines()[0] if text else "(empty)"


def _emit(text: str) -> None:
    """Print ``text``; a reader that went away (``| head``) is not an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so the flush at exit stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def add_json_flag(parser: argparse.ArgumentParser, *, instead_of: str) -> None:
    """Declare ``--json``: print the command's document as JSON (:func:`print_doc`) ``instead_of`` its terminal form."""
    parser.add_argument("--json", action="store_true", help=f"print a JSON document instead of {instead_of}")


def usage_failed(command: str, error: UsageError) -> int:
    """Report bad arguments of ``resilience COMMAND`` on stderr; the exit code (2, ``CONFIG_ERROR``)."""
    print(f"resilience {command}: {error}", file=sys.stderr)
    return int(ExitCode.CONFIG_ERROR)


def print_doc(doc: dict[str, Any], as_json: bool, format_doc: Callable[[dict[str, Any]], str]) -> None:
    """Print ``doc`` as the ``--json`` output (indented, keys sorted), or its terminal form
    ``format_doc(doc)``."""
    _emit(json.dumps(doc, indent=2, sort_keys=True) if as_json else format_doc(doc))


def saved_section(directory: Path, section: str) -> dict[str, Any]:
    """Section ``section`` of the ``config.yaml`` (``CONFIG``) a checkpoint saved (the run's own settings);
    ``{}`` when the file is missing, unreadable or has no such mapping."""
    import yaml

    try:
        value = (yaml.safe_load((directory / CONFIG).read_text()) or {}).get(section)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def local_arg(text: str, what: str) -> str:
    """``text`` as a local path (``file:///abs`` -> ``/abs``); :class:`UsageError` naming ``what``
    for another URL (``s3://...``), which would otherwise be read as a local folder ``s3:``."""
    try:
        return local_path(text, what)
    except NotALocalPath as exc:
        raise UsageError(str(exc)) from None


def read_side(location: Location) -> Path:
    """``location`` as the :class:`~pathlib.Path` that ``status``, ``verify`` and ``advise`` read
    through: an :class:`~resilience.checkpoint.storage.object_path.ObjectPath` implements the read
    side of Path's API they use (``/``, ``name``, ``parent``, ``iterdir``, ``is_dir``, ``is_file``,
    ``exists``, ``resolve``), and their local-only steps (symlinks, ``os.walk``) check for an object first."""
    return cast(Path, location)  # for the type checker only: the object is returned as it is


def existing_dir(text: str, what: str) -> Location:
    """``text`` as the path of an existing directory; :class:`UsageError` naming ``what`` otherwise
    (also for a URL other than ``file://``, see :func:`local_arg`). An ``s3://``/``msc://`` URL is
    a place in a bucket (:func:`~resilience.checkpoint.storage.object_path.url_location`): a
    checkpoint root, or one checkpoint when a manifest lies directly under it."""
    if URL.match(text or "") and text.split(":", 1)[0].lower() in ("s3", "msc"):
        from resilience.checkpoint.storage.object_path import url_location  # boto3/msc: only for a URL
        from resilience.checkpoint.storage.object_store import StoreError, StoreUnavailable

        try:
            location = url_location(text)
            found = location.is_dir()
        except (ValueError, StoreUnavailable, StoreError) as exc:
            raise UsageError(f"{what} {text!r}: {exc}") from None
        if not found:
            raise UsageError(f"{what} {text!r}: nothing under this prefix")
        return location
    text = local_arg(text, what)
    if not text.strip():  # Path("") is ".": an empty $VAR would inspect the current directory
        raise UsageError(f"{what}: empty; give a directory")
    path = Path(text)
    if not path.exists():
        raise UsageError(f"{what} {text!r}: no such directory")
    if not path.is_dir():
        raise UsageError(f"{what} {text!r}: not a directory")
    return path
