"""One registry helper (grpo/foundation/registry.py) for the four kinds of plug-in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from grpo.foundation.config import ConfigError
from grpo.foundation.registry import Registry, must_be_callable
from tests.patience import LAUNCH_S

ROOT = Path(__file__).resolve().parent.parent


def test_string_and_object_registration():
    reg = Registry("widget", "widget.name", paths="Class")

    class Plain:
        pass

    reg.register("plain", Plain)  # an object (grpo/api.py's reward functions)
    reg.register("lazy", "fractions:Fraction")  # imported at its first lookup (every plug-in package's built-ins)
    assert reg.get("plain") is Plain
    from fractions import Fraction

    assert reg.get("lazy") is Fraction
    reg.register("lazy", "fractions:Fraction")  # the same again (a package imported twice): nothing changes
    assert reg.get("lazy") is Fraction
    with pytest.raises(RuntimeError, match="two widgets are registered as 'lazy'"):
        reg.register("lazy", "decimal:Decimal")
    assert reg.names() == ["lazy", "plain"] and "plain" in reg and len(reg) == 2
    assert reg.get("decimal:Decimal").__name__ == "Decimal"  # any package.module:Class with ``paths``


def test_every_algorithm_file_is_in_the_table_under_its_own_name():
    """algos/__init__.py's table names every Algorithm subclass with a ``name`` that algos/ defines, under that
    name: an algorithm's file without its line (or a line naming another class) fails here."""
    import importlib
    import pkgutil

    import algos
    from algos.base import Algorithm

    for mod in pkgutil.iter_modules(algos.__path__):
        importlib.import_module(f"algos.{mod.name}")
    defined = {}

    def walk(cls):
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("algos.") and sub.__dict__.get("name"):
                defined[sub.name] = f"{sub.__module__}:{sub.__name__}"
            walk(sub)

    walk(Algorithm)
    assert defined == algos.BUILT_IN
    assert all(algos.ALGORITHMS.get(name).name == name for name in algos.BUILT_IN)


def test_errors_name_the_choices_and_the_closest():
    reg = Registry("widget", "widget.name", paths="Class")
    reg.register("alpha", int)
    reg.register("beta", float)
    with pytest.raises(ConfigError, match=r"widget.name='alpah' is unknown: choose from \['alpha', 'beta'\] or give "
                                          r"'package.module:Class'. Did you mean 'alpha'\?"):
        reg.get("alpah")
    with pytest.raises(ConfigError, match=r"rewards\[2\].fn='no_such_module_xyz:f' cannot be imported"):
        reg.get("no_such_module_xyz:f", key="rewards[2].fn")
    closed = Registry("algorithm", "algo.name", unknown="unknown algorithm {name!r}")
    closed.register("grpo", int)
    with pytest.raises(ConfigError, match=r"unknown algorithm 'GRPO'. Did you mean 'grpo'\? \(names are lower case\) "
                                          r"Choose from \['grpo'\]"):
        closed.get("GRPO")
    with pytest.raises(ConfigError, match="unknown algorithm 'os:getcwd'"):  # no paths: names only
        closed.get("os:getcwd")


def test_check_and_duplicates():
    reg = Registry("function", "fn", paths="function", check=must_be_callable)
    reg.register("f", len)
    assert reg.get("f") is len
    with pytest.raises(ConfigError, match=r"fn='math:pi' is not callable"):
        reg.get("math:pi")
    reg.register("f", len)  # the same object again: fine (a module imported twice)
    with pytest.raises(RuntimeError, match="two functions are registered as 'f'"):
        reg.register("f", abs)


def test_a_home_registers_itself_at_the_first_lookup():
    """grpo/ names its plug-in packages, never imports them: the first lookup does, in a fresh interpreter."""
    probe = ("import sys\n"
             "from grpo.foundation.plugins import ALGORITHMS, ENVS, REWARDS, STEP_REWARDS, TOOLS\n"
             "from grpo.rollout.service import ENGINES\n"
             "from grpo.foundation.registry import Registry\n"
             "assert all(isinstance(r, Registry) for r in (ALGORITHMS, ENVS, REWARDS, STEP_REWARDS, TOOLS, ENGINES))\n"
             "assert not any(m.split('.')[0] in ('algos', 'rewards', 'envs') for m in sys.modules)\n"
             "print(ALGORITHMS.get('dapo').__module__, REWARDS.get('math_correct').__module__, "
             "ENVS.get('maze').__module__, TOOLS.get('python').__module__, ENGINES.get('hf').__name__)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=LAUNCH_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["algos.dapo", "rewards.math_answer", "envs.maze", "envs.tools", "HFEngine"]


def test_built_in_is_a_home_package_s_own_entry():
    """A worker process knows by name what a home package registers (it loads the homes); what a user registers
    in the trainer's process (an object, or a path outside the homes) is sent to it by value
    (grpo/scoring/combined.py)."""
    from grpo.foundation.plugins import REWARDS

    reg = Registry("reward function", "rewards fn", home="rewards", paths="function")
    reg.register("mine", "tests.reward_fixtures:not_callable")
    reg.register("closure", lambda prompts, completions: [0.0] * len(completions))
    assert not reg.built_in("mine") and not reg.built_in("closure") and not reg.built_in("nope")
    assert REWARDS.built_in("math_correct") and REWARDS.built_in("code_tests")
    assert not REWARDS.built_in("tests.reward_fixtures:not_callable")  # a path is resolved where it runs


def test_the_plug_in_packages_fill_the_registries():
    import algos
    import envs
    import rewards
    from grpo.foundation import plugins

    assert algos.ALGORITHMS is plugins.ALGORITHMS and plugins.ALGORITHMS.get("grpo").name == "grpo"
    assert envs.ENVS is plugins.ENVS and plugins.ENVS.get("calculator").__name__ == "CalculatorEnv"
    assert rewards.REWARDS is plugins.REWARDS and "digits_match" in plugins.REWARDS and "nope" not in plugins.REWARDS
    assert "digits_step_match" in plugins.STEP_REWARDS


def test_the_start_up_checks_build_the_algorithm_once_for_the_run(monkeypatch):
    """compose looks the algorithm up and builds it once; check_run's parts carry that one to run_warnings and
    probe_services (and train.py / grpo.train hand them to the Trainer). Was: built three or four times a run."""
    from algos.dapo import DAPO
    from grpo.training.configure import check_run, load_config, probe_services, run_warnings

    built = []
    original = DAPO.__init__
    monkeypatch.setattr(DAPO, "__init__", lambda self, cfg: (built.append(cfg), original(self, cfg))[1])
    cfg = load_config(None, "dapo", ["model.name_or_path=builtin:tiny-char", "data.source=builtin",
                                      "rewards=[{fn: digits_match}]"])
    parts = check_run(cfg)
    run_warnings(cfg, parts)
    probe_services(cfg, parts)
    assert isinstance(parts.algorithm, DAPO) and built == [cfg]
