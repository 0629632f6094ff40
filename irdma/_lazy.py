"""Lazy re-exports for a package's ``__init__`` (PEP 562's module ``__getattr__``).

A package lists the public names of its modules; each module is imported on the first use of
one of its names, so importing a package (or one light module of it) does not load the rest.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose name ``N`` lives in its module
    ``names[N]`` (relative, such as ``".native"``).

    ``__getattr__`` raises AttributeError for a name not listed, as a module does.
    """

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package)
        value = getattr(module, name)
        vars(importlib.import_module(package))[name] = value  # once: later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(names))

    return __getattr__, __dir__
