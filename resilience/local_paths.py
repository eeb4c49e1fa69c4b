"""Paths that must name the local (or mounted) filesystem: object-store URLs are refused.

Checkpoints are written with ``open``/``os.replace``/``fsync`` (the atomic-publish protocol needs
all three), so ``s3://bucket/ck`` used as a path would silently become the local folder
``./s3:/bucket/ck``. Every path-valued configuration key and every command-line path goes through
:func:`local_path` instead: a ``scheme://`` URL is an error naming the key, except ``file://``,
which names a local path and is accepted as that path (``file:///scratch/ck`` -> ``/scratch/ck``).
Only the standard library is imported here.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

#: ``scheme://...`` (RFC 3986 scheme): what :func:`local_path` refuses, ``file://`` aside.
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

ACCEPTED = "a local or mounted path (absolute or relative), or file:///absolute/path"


class NotALocalPath(ValueError):
    """A path is a URL of a scheme other than ``file://``; the message names what was given."""


def local_path(text: str, key: str) -> str:
    """``text`` as a local filesystem path.

    A ``file://`` URL with an empty or ``localhost`` host is its (percent-decoded) absolute path;
    a leading ``~`` or ``~user`` is expanded as a shell would (``os.path.expanduser``: a YAML value
    or an override in quotes reaches us unexpanded, and would become a folder named ``~``);
    anything else that is not a ``scheme://`` URL (nor ``file:`` without ``//``) is returned unchanged.

    Raises:
        NotALocalPath: ``text`` is a URL of another scheme (``s3://``, ``gs://``, ``hdfs://``, ...),
            a ``file://`` URL naming another host or no path, or ``file:`` without ``//``; the message
            names ``key``.
    """
    if text.startswith("~"):
        return os.path.expanduser(text)
    match = URL.match(text)
    if match is None:
        if text[:5].lower() == "file:":  # file:relative or file:/abs: a URL missing its //, not a folder "file:"
            raise NotALocalPath(f"{key}={text!r}: a file URL must name an absolute local path (file:///path); accepted: {ACCEPTED}")
        return text
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc in ("", "localhost") and parts.path.startswith("/") and not parts.query and not parts.fragment:
            return unquote(parts.path)
        raise NotALocalPath(f"{key}={text!r}: a file:// URL must name an absolute local path (file:///path); accepted: {ACCEPTED}")
    raise NotALocalPath(
        f"{key}={text!r}: {scheme}:// URLs are not supported (this path is used with local file operations, "
        f"so it would become a local folder named {text.split('/', 1)[0]!r}); accepted: {ACCEPTED}, "
        "e.g. a bucket mounted with s3fs or gcsfuse"
    )
