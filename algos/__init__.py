"""The algorithms (``--algo NAME``): one file per algorithm, each registered in
grpo.foundation.plugins.ALGORITHMS when this package is imported.

Every module here is imported and every :class:`Algorithm` subclass with a ``name`` is registered,
so adding an algorithm is adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil

from algos.base import Algorithm
from grpo.foundation.plugins import ALGORITHMS


def _discover() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")

    def walk(cls: type) -> None:
        for sub in cls.__subclasses__():
            if sub.__dict__.get("name"):
                ALGORITHMS.register(sub.name, sub)
            walk(sub)

    walk(Algorithm)


_discover()

