"""Names a package exports from its submodules, imported when first asked (PEP 562):
``import ckptd.client`` and the command line stay clear of torch until a name
that needs it is used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: ``exports`` maps each name to the submodule of
    ``package`` that defines it; a name once imported is kept in the package."""

    def attribute(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return attribute
