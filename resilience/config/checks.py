""":class:`ConfigError` and the type and range checks every section's ``__post_init__`` uses."""

from __future__ import annotations

from typing import Any

from resilience.local_paths import NotALocalPath, local_path


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key and what is accepted."""


def check_int(key: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int (not a bool) ``>= minimum``, or None when allowed."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        accepted = "an integer" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}: expected {accepted}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")


def check_bool(key: str, value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r} ({type(value).__name__})")


def check_local_path(key: str, value: Any) -> Any:
    """``value`` with a ``file://`` URL turned into its local path; other values unchanged.

    Raises:
        ConfigError: ``value`` is a URL of another scheme (``s3://``, ``gs://``, ...): naming
            ``key`` and the accepted forms, instead of a local folder named after the URL.
    """
    if not isinstance(value, str):
        return value  # the key's own type check reports it
    try:
        return local_path(value, key)
    except NotALocalPath as exc:
        raise ConfigError(str(exc)) from None
