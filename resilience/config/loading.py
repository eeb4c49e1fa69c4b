"""Plain data or a YAML file, with dotted overrides, into a validated :class:`ResilienceConfig`."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from resilience.config.checks import ConfigError
from resilience.config.mindspore_names import ALIASES, normalize_aliases
from resilience.config.resilience_config import SECTIONS, ResilienceConfig


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; accepted keys: {', '.join(sorted(known))}"


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}: expected a mapping of keys, got {type(raw).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    spellings = known + [key for section, key in ALIASES if section == name]  # MindSpore's, moved out before this
    for key in raw:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key{_suggest(str(key), spellings)}")
    return cls(**raw)


def config_from_dict(data: Mapping[str, Any] | None) -> ResilienceConfig:
    """Validate plain data (parsed YAML) into a :class:`ResilienceConfig`.

    Raises:
        ConfigError: an unknown key inside one of our sections (with the closest known key), a
            top-level name close to one of ours, or a value of the wrong type or range;
            MindSpore Transformers and NeMo spellings of one setting that disagree.
    """

    given = dict(data or {})
    data = normalize_aliases(given)
    sections = {}
    extra = {}
    for key, value in data.items():
        if key in SECTIONS:
            try:
                sections[key] = _build_section(key, SECTIONS[key], value)
            except ConfigError as exc:
                raise _as_spelt(exc, given) from None
        elif difflib.get_close_matches(str(key), list(SECTIONS), n=1, cutoff=0.75):
            raise ConfigError(f"{key}: unknown section{_suggest(str(key), list(SECTIONS))}")
        else:
            extra[key] = value
    return ResilienceConfig(**sections, extra=extra)


def _as_spelt(exc: ConfigError, given: Mapping[str, Any]) -> ConfigError:
    """``exc`` naming the key as the user spelt it where a MindSpore alias was moved to ours
    (``checkpoint.async_save``, not ``checkpoint.is_async``)."""
    for (src_section, src_key), (dst_section, dst_key) in ALIASES.items():
        section = given.get(src_section)
        ours = f"{dst_section}.{dst_key}:"
        if isinstance(section, Mapping) and src_key in section and str(exc).startswith(ours):
            return ConfigError(f"{src_section}.{src_key} (read as {dst_section}.{dst_key}):{str(exc)[len(ours) :]}")
    return exc


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply dotted ``section.key=value`` overrides (values parsed as YAML) to ``data`` in place.

    An empty value (``key=``) is refused rather than read as null: for ``preemption_signal``, null
    turns signal handling off, which a forgotten value must not do silently. Write ``key=null``.

    Raises:
        ConfigError: an override without ``=``, with an empty key, or with an empty value.
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. checkpoint.checkpoint_dir=/tmp/ck")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        if not text.strip():
            raise ConfigError(f"override {item!r}: empty value; write {key}=null for null, or {key}=VALUE")
        node[parts[-1]] = _parse_value(text)
    return data


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> ResilienceConfig:
    """Read a YAML file (or nothing), apply dotted overrides, and validate.

    Raises:
        ConfigError: unreadable file, a file that is not UTF-8, invalid YAML, a top level that is not a mapping, or any
            invalid key/value (see :func:`config_from_dict`).
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot read it ({exc.strerror or exc})") from exc
        except UnicodeDecodeError as exc:  # a ValueError, not an OSError: binary or another encoding
            raise ConfigError(f"config file {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); accepted: a UTF-8 YAML file") from exc
        try:
            loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: invalid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
        data = loaded or {}
    apply_overrides(data, overrides)
    return config_from_dict(data)


class _Yaml12NumbersLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without YAML 1.1's base-60 numbers: PyYAML reads an unquoted
    ``12:00:00`` as the integer 43200 and ``30:00`` as 1800, so ``slurm.time=12:00:00`` (Slurm's
    own form) arrived as a number. Integers and floats resolve as ``safe_load``'s patterns
    without their base-60 forms; everything else as ``safe_load``."""


_Yaml12NumbersLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12NumbersLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Yaml12NumbersLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _parse_value(text: str) -> Any:
    """One override's value as YAML (``[USR1, 15]``, ``null``, ``3``, ``1e-4``), base-60 aside:
    ``12:00:00`` stays the text typed (:class:`_Yaml12NumbersLoader`)."""
    return yaml.load(text, Loader=_Yaml12NumbersLoader)  # noqa: S506 - a SafeLoader subclass


class _UniqueKeyLoader(_Yaml12NumbersLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping: PyYAML would keep the
    last value silently, so a setting edited in one place and left in another is lost."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping of ``node``; raises ``yaml.constructor.ConstructorError`` naming both
        lines when a key appears twice."""
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = seen.get(key)
            except TypeError:  # an unhashable key: let PyYAML report it
                continue
            if earlier is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (line {earlier + 1} and line {key_node.start_mark.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)
