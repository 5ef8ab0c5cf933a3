"""A package's public names imported on first use (PEP 562), so importing the package stays light.

`zerotrain --help` must not import torch (about 3.5 s of CPU), yet `import zerotrain` has to offer
`zerotrain.initialize`, and every command line module imports some `zerotrain.config.*` or
`zerotrain.checkpoint.*` submodule, which runs its package's `__init__` first.  Such a package
names where each public name lives; the module is imported when the name is first asked for.
Lives in the bottom layer so that every package may use it; imports nothing of zerotrain.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any


def export_lazily(package: str, names: Mapping[str, str], submodules: Iterable[str] = ()) -> None:
    """Makes ``package``'s public names load on first use.

    ``names`` maps each public name to the module that defines it; ``submodules`` are public
    names that are the package's own submodules (``zerotrain.zero``).  Call it from the
    package's ``__init__`` with ``__name__``; a name is looked up once, then it is an ordinary
    attribute.
    """
    module = sys.modules[package]
    module.__class__ = _lazy_package_class(package, dict(names), frozenset(submodules))


def _lazy_package_class(package: str, names: dict[str, str], submodules: frozenset[str]) -> type:
    class LazyPackage(types.ModuleType):
        def __getattr__(self, name: str) -> Any:  # only for names not set yet
            if name in submodules:
                return importlib.import_module(f"{package}.{name}")
            if name not in names:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(names[name]), name)
            setattr(self, name, value)
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            # Importing a submodule binds it on its package: `zerotrain.checkpoint.consolidate` (the
            # module) would hide `consolidate` (its function, the public name), as an eager
            # `from .consolidate import consolidate` in __init__ never lets it.
            if isinstance(value, types.ModuleType) and names.get(name) == value.__name__:
                value = getattr(value, name)
            super().__setattr__(name, value)

        def __dir__(self) -> list[str]:
            return sorted(set(super().__dir__()) | set(names) | submodules)

    return LazyPackage
