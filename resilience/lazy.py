"""Package attributes imported on first use, so importing a package stays cheap (no torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``package`` that imports each name on first use.

    ``names`` maps an attribute to the module defining it. The first use imports that module and
    stores the value in ``namespace`` (the package's ``globals()``), so later uses find it there
    without calling ``__getattr__``. Any other name raises ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
