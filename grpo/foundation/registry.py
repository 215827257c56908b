"""One registry helper for every kind of plug-in: algorithms, reward functions, environments and tools,
generation engines (grpo/foundation/plugins.py declares them).

    ALGORITHMS = Registry("algorithm", key="algo.name", home="algos")

    ALGORITHMS.register("grpo", "algos.grpo:GRPO")   # in the plug-in package's __init__.py: imported at first use

    ALGORITHMS.get("grpo")                  # the class; a ConfigError naming the choices (and the closest one)
    REWARDS.get("my_pkg.scores:exact")      # with ``paths``: any ``package.module:attr`` too

One way to register: each plug-in package's ``__init__.py`` names its built-ins in one table, name ->
``module:attr`` (algos/, rewards/, envs/, and grpo/rollout/service.py's engines); what a plug-in needs known of it
beyond its name is an attribute of the entry itself (a reward function's ``rows_per_call``, an engine's
``check_installed``). A user's plug-in is named in the config as ``package.module:attr``, or registered from Python
with its object (grpo/api.py's reward functions).

``home`` names the packages whose built-ins register themselves when imported: the first lookup imports
them, so the engine (grpo/) finds its plug-ins by name, never by an import of its own, the way pytest
finds its plugins.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable, Iterator, Optional

from grpo.foundation.config import ConfigError


def load_attr(target: str, key: str) -> Any:
    """``package.module:attr`` imported; ``key`` names the setting in the error."""
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={target!r} cannot be imported: {e}") from e


class Registry:
    """name -> a plug-in (an object, or a ``module:attr`` string imported on first use).

    kind      what the entries are, in messages ("algorithm", "reward function")
    key       the config key that names one, in messages ("algo.name", "rollout.engine")
    home      the package(s) whose import registers the built-ins (imported at the first lookup)
    paths     whether ``package.module:attr`` outside the registry is accepted, and what it names ("Class")
    check     called with (entry, key, name) on every lookup result: raises ConfigError when it is no fit
    unknown   the message's opening for an unknown name, ``{key}`` and ``{name}`` filled in
    """

    def __init__(self, kind: str, key: str, home: str | tuple[str, ...] = (), paths: Optional[str] = None,
                 check: Optional[Callable[[Any, str, str], None]] = None, unknown: str = "{key}={name!r} is unknown"):
        self.kind, self.key, self.paths, self.check, self.unknown = kind, key, paths, check, unknown
        self.home = (home,) if isinstance(home, str) else tuple(home)
        self._entries: dict[str, Any] = {}  # name -> the plug-in (a ``module:attr`` string until first looked up)
        self._registered: dict[str, Any] = {}  # name -> what was registered
        self._homes_loaded = not self.home

    def register(self, name: str, target: Any) -> Any:
        """``register(name, 'module:attr')`` (imported at the first lookup), or the object itself."""
        known = self._registered.get(name)
        if known is not None and known != target:  # (the same again: nothing to do)
            raise RuntimeError(f"two {self.kind}s are registered as {name!r}: {known!r} and {target!r}")
        if known is None:
            self._entries[name] = self._registered[name] = target
        return target

    def _load_homes(self) -> None:
        if not self._homes_loaded:
            self._homes_loaded = True  # before the import: a home that looks itself up does not recurse
            try:
                for package in self.home:
                    importlib.import_module(package)
            except BaseException:
                self._homes_loaded = False
                raise

    def built_in(self, name: str) -> bool:
        """Whether ``name`` is a home package's own entry (registered as one of its ``module:attr``): any process
        knows it by name, where what a user registered from Python is known only in the process that did."""
        self._load_homes()
        target = self._registered.get(name)
        return isinstance(target, str) and target.partition(":")[0].split(".")[0] in self.home

    def names(self) -> list[str]:
        self._load_homes()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load_homes()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def items(self) -> list[tuple[str, Any]]:
        return [(name, self.get(name)) for name in self.names()]

    def get(self, name: str, key: Optional[str] = None) -> Any:
        """The entry registered as ``name`` (or, with ``paths``, the ``package.module:attr`` it names);
        ``key`` overrides the config key named in errors (``rewards[0].fn``)."""
        key = key or self.key
        self._load_homes()
        if name in self._entries:
            entry = self._entries[name]
            if isinstance(entry, str):
                entry = self._entries[name] = load_attr(entry, key)
        elif self.paths and isinstance(name, str) and ":" in name:
            entry = load_attr(name, key)
        else:
            raise ConfigError(self._unknown(name, key))
        if self.check is not None:
            self.check(entry, key, name)
        return entry

    def _unknown(self, name: Any, key: str) -> str:
        names = sorted(self._entries)
        text = str(name)
        same = [n for n in names if n.lower() == text.lower().replace("_", "-")]
        close = same or difflib.get_close_matches(text.lower(), names, n=1)
        hint = (f" Did you mean {close[0]!r}? (names are lower case)" if same else
                f" Did you mean {close[0]!r}?" if close else "")
        head = self.unknown.format(key=key, name=name)
        if self.paths:  # the choices first, as every such message has said
            return f"{head}: choose from {names} or give 'package.module:{self.paths}'.{hint}"
        return f"{head}.{hint} Choose from {names}"


def must_be_callable(entry: Any, key: str, name: str) -> None:
    """A Registry ``check``: the entry is a function (or any callable)."""
    if not callable(entry):
        raise ConfigError(f"{key}={name!r} is not callable")
