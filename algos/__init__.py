"""The algorithm registry: ``--algo NAME`` -> a class in this package (one file per algorithm).

Every module here is imported and every :class:`Algorithm` subclass with a ``name`` is
registered, so adding an algorithm is adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil

from algos.base import Algorithm

ALGORITHMS: dict[str, type[Algorithm]] = {}


def _discover() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")

    def walk(cls: type) -> None:
        for sub in cls.__subclasses__():
            if sub.__dict__.get("name"):
                if sub.name in ALGORITHMS and ALGORITHMS[sub.name] is not sub:
                    raise RuntimeError(f"two algorithms are named {sub.name!r}")
                ALGORITHMS[sub.name] = sub
            walk(sub)

    walk(Algorithm)


_discover()


def get_algorithm(name: str) -> type[Algorithm]:
    from grpo.foundation.config import ConfigError

    if name not in ALGORITHMS:
        import difflib

        same = [n for n in ALGORITHMS if n.lower() == name.lower().replace("_", "-")]
        close = same or difflib.get_close_matches(name.lower(), list(ALGORITHMS), n=1)
        hint = f" Did you mean {close[0]!r}? (names are lower case)" if same else (
            f" Did you mean {close[0]!r}?" if close else "")
        raise ConfigError(f"unknown algorithm {name!r}.{hint} Choose from {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]
