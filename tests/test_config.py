"""Configuration: precedence and every error path."""

from __future__ import annotations

import pytest
import yaml

from grpo.foundation.config import ConfigError
from grpo.foundation.config_rules import validate
from grpo.foundation.config_assembly import to_dict
from grpo.foundation.loader import dump_yaml, load_yaml, parse_overrides
from grpo.training.configure import load_config


def write(tmp_path, tree) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(tree))
    return str(p)


def test_libyaml_reads_and_writes_every_preset_as_pyyaml_does():
    """The config is read and written with libyaml (C) where PyYAML has it: the same trees, the same text."""
    from pathlib import Path

    presets = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
    assert len(presets) > 40
    for path in presets:
        text = path.read_text()
        assert load_yaml(text) == yaml.safe_load(text), path.name
        tree = to_dict(load_config(path))
        assert dump_yaml(tree) == yaml.safe_dump(tree, sort_keys=False), path.name
    for raw in ("[1, 2]", "{fn: digits_match, weight: 0.5}", "1e-5", "'='", "true", "null", "~", "0x10"):
        assert load_yaml(raw) == yaml.safe_load(raw), raw


def test_defaults_then_algorithm_defaults():
    cfg = load_config()
    assert cfg.algo.name == "grpo"
    assert cfg.algo.beta == 0.04 and cfg.algo.clip_eps_low == 0.2
    assert cfg.algo.aggregation == "seq-mean-token-mean"


def test_precedence_yaml_then_algo_then_cli(tmp_path):
    path = write(tmp_path, {"algo": {"name": "nonexistent-but-overridden", "beta": 0.1},
                            "train": {"lr": 0.5, "max_steps": 7}})
    # --algo beats the YAML's algo.name; YAML values beat defaults; CLI beats YAML.
    cfg = load_config(path, algo="grpo", overrides=["train.lr=1e-5", "rollout.num_generations=4"])
    assert cfg.algo.name == "grpo"
    assert cfg.algo.beta == 0.1
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert cfg.train.max_steps == 7
    assert cfg.rollout.num_generations == 4


def test_cli_algo_name_override_beats_flag(tmp_path):
    cfg = load_config(None, algo="grpo", overrides=["algo.name=grpo", "algo.beta=0"])
    assert cfg.algo.name == "grpo" and cfg.algo.beta == 0.0


def test_yaml_float_written_without_dot(tmp_path):
    # PyYAML reads "1e-5" as a string; a float field still accepts it.
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-5\n")
    assert load_config(str(path)).train.lr == 1e-5


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr'.*Did you mean 'lr'"):
        load_config(overrides=["train.lrr=1"])


def test_unknown_section_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'rolout'.*Did you mean 'rollout'"):
        load_config(overrides=["rolout.temperature=1"])


def test_unknown_algo_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.betta'.*Did you mean 'beta'"):
        load_config(overrides=["algo.betta=0.1"])


def test_unknown_algorithm_lists_choices():
    with pytest.raises(ConfigError, match=r"unknown algorithm 'grp'.*Choose from"):
        load_config(algo="grp")


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=ten", r"train.max_steps='ten' has the wrong type: expected an integer"),
    ("train.lr=fast", r"train.lr='fast' has the wrong type: expected a number"),
    ("model.gradient_checkpointing=maybe", r"expected true or false"),
    ("rollout.num_generations=2.5", r"expected an integer"),
])
def test_wrong_type(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize("override, message", [
    ("model.dtype=fp8", r"model.dtype='fp8' is invalid: choose from \['auto', 'fp32', 'bf16', 'fp16'\]"),
    ("algo.aggregation=mean", r"algo.aggregation='mean' is invalid: choose from"),
    ("algo.kl_estimator=k4", r"choose from \['k1', 'k2', 'k3'\]"),
    ("train.zero_stage=4", r"train.zero_stage=4 is invalid: choose from \[0, 1, 2, 3\]"),
    ("logging.report_to=[mlflow]", r"logging.report_to\[0\]='mlflow' is invalid"),
])
def test_bad_choice(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize("override, message", [
    ("rollout.num_generations=0", r"rollout.num_generations=0 is invalid: it must be > 0"),
    ("rollout.top_p=1.5", r"rollout.top_p=1.5 is invalid"),
    ("algo.beta=-1", r"algo.beta=-1.0 is invalid: it must be >= 0"),
    ("algo.dual_clip=0.5", r"algo.dual_clip=0.5 is invalid: it must be > 1"),
    ("ref.url=localhost:1", r"ref.url='localhost:1' is invalid"),
    ("data.source=jsonl", r"data.path is required"),
])
def test_bad_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_malformed_override():
    with pytest.raises(ConfigError, match="not of the form key=value"):
        parse_overrides(["train.lr"])


def test_keys_that_are_not_text_and_an_empty_output_dir_are_named():
    """A YAML key that is a number or null was a TypeError from difflib; an empty train.output_dir wrote the run into
    the current directory."""
    for tree, key in (({1: 2}, "'1'"), ({"train": {None: 1}}, "'train.None'")):
        with pytest.raises(ConfigError, match=rf"unknown config key {key}"):
            load_config(tree=tree)
    with pytest.raises(ConfigError, match=r"train.output_dir is empty: name the run's folder"):
        load_config(overrides=["train.output_dir=''"])


def test_a_mapping_without_the_space_after_its_colon_and_generators_past_memory_are_named():
    """`{fn:countdown}` is YAML for one key "fn:countdown" with no value: the error says to add the space. A
    generator's num_examples of 10^9 ran out of memory at start (every task is made and tokenized), digits 10^5
    raised Python's int-to-text limit."""
    with pytest.raises(ConfigError, match=r"unknown config key 'rewards\[0\].fn:countdown'. YAML needs a space after the "
                                          r"colon: write 'fn: countdown'"):
        load_config(overrides=["data.source=countdown", "rewards=[{fn:countdown}]"])
    for key in ("data.builtin", "data.countdown", "data.arithmetic", "data.code", "env"):
        with pytest.raises(ConfigError, match=rf"{key}.num_examples=1000000000 is invalid: it must be in \[1, 10000000\] "
                                              r"\(generated tasks are made and tokenized whole at start\)"):
            load_config(overrides=[f"{key}.num_examples=1000000000"])
    for key in ("data.builtin.digits", "data.countdown.max_numbers", "data.code.num_tests"):  # max_numbers: no end
        with pytest.raises(ConfigError, match=rf"{key}=100000 is invalid: it must be in \[1, 64\]"):
            load_config(overrides=[f"{key}=100000"])


def test_a_key_given_twice_is_refused_not_dropped(tmp_path):
    """YAML keeps the last of two equal keys without a word: a second ``train:`` section dropped the first's keys."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 3.0e-6\n  max_steps: 5\nrollout:\n  temperature: 0.9\ntrain:\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match=r"(?s)is not valid YAML: while reading a mapping.*found the key 'train' twice "
                                          r"\(YAML would keep the last and drop the first without a word\).*twice.yaml\", line 6"):
        load_config(str(twice))
    with pytest.raises(ConfigError, match=r"override 'train=\{lr: 1, lr: 2\}': found the key 'lr' twice"):
        load_config(overrides=["train={lr: 1, lr: 2}"])
    from grpo.foundation.loader import load_yaml  # a merge key (<<: *anchor) may be overridden: that is what it is for

    assert load_yaml("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  y: 3\n") == {"a": {"x": 1, "y": 2}, "b": {"x": 1, "y": 3}}


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    (tmp_path / "a.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"config file '.*' is a folder: name a YAML file in it \(a.yaml\)"):
        load_config(str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at top level"):
        load_config(str(top))


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["train.lr=0.25", "rewards=[{fn: digits_match, weight: 2}]"])
    tree = to_dict(cfg)
    again = load_config(write(tmp_path, tree))
    assert to_dict(again) == tree
    assert again.rewards[0].weight == 2.0


def test_demo_config_loads():
    cfg = load_config("configs/demo.yaml")
    assert cfg.data.source == "builtin"


@pytest.mark.parametrize("algo, override, key", [
    (None, "train.lr=nan", "train.lr"),
    (None, "algo.beta=.nan", "algo.beta"),
    (None, "rollout.temperature=inf", "rollout.temperature"),
    (None, "reward_pool.timeout=nan", "reward_pool.timeout"),
    (None, "ref.read_timeout=-inf", "ref.read_timeout"),
    (None, "eval.threshold=nan", "eval.threshold"),
    (None, "algo.clip_eps_high=inf", "algo.clip_eps_high"),
    (None, "algo.dual_clip=inf", "algo.dual_clip"),  # Optional[float]: the type fits, the value does not
    (None, "rewards=[{fn: digits_match, weight: .inf}]", r"rewards\[0\].weight"),
    ("dapo", "algo.overlong_factor=nan", "algo.overlong_factor"),  # an algorithm's Options
    ("gpg", "algo.threshold=nan", "algo.threshold"),
    ("diver", "algo.bleu_weights=[0.5, .nan]", r"algo.bleu_weights\[1\]"),
])
def test_nan_and_inf_are_refused_naming_the_key(algo, override, key):
    with pytest.raises(ConfigError, match=rf"^{key}=-?(nan|inf) is invalid: it must be a finite number.*"
                                          rf"leave {key} out to use its default"):
        load_config(algo=algo, overrides=[override])


def test_nan_in_a_yaml_file_and_in_a_config_built_in_code(tmp_path):
    with pytest.raises(ConfigError, match=r"^train.adam_eps=nan is invalid: it must be a finite number"):
        load_config(write(tmp_path, {"train": {"adam_eps": float("nan")}}))
    cfg = load_config()
    cfg.reward_pool.timeout = float("nan")  # built in code: validate() still refuses it
    with pytest.raises(ConfigError, match=r"^reward_pool.timeout=nan is invalid: it must be a finite number"):
        validate(cfg)


OUTSIDE = {"> 0": 0, ">= 0": -1, "> 1": 1, "<= 0": 0.5, "in (0, 1]": 0, "in [0, 1]": 1.5, "in [0, 1)": 1}


def test_each_declared_range_of_the_config_refuses_a_value_just_outside_it():
    """Every range declared on a field of the config's sections (rewards' and the algorithms' options aside) refuses
    a value just outside it, naming the key and the range (issue 59 item 4: the rules' inline ranges moved onto the
    fields, e.g. algo.top_entropy_quantile and rollout.vllm.gpu_memory_utilization)."""
    import dataclasses
    import re

    from grpo.foundation.config import Config

    def ranged_fields(cls, prefix):
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name) if f.default is dataclasses.MISSING else f.default
            if "range" in f.metadata:
                yield f"{prefix}{f.name}", (f.metadata["range"], "list" in str(f.type))
            elif dataclasses.is_dataclass(default):
                yield from ranged_fields(type(default), f"{prefix}{f.name}.")

    found = dict(ranged_fields(Config, ""))
    assert {"algo.top_entropy_quantile", "rollout.vllm.gpu_memory_utilization", "rollout.top_p", "ref.port"} <= set(found)
    for key, (within, listed) in found.items():
        bad = OUTSIDE.get(within, {"in [0, 64]": 65, "in [1, 64]": 0, "in [0, 65535]": 65536,
                                   "in [1, 10000000]": 10_000_001}.get(within))
        bad = f"[{bad}]" if listed else bad  # a list is checked item by item
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}=.* is invalid: it must be .*{re.escape(within)}"):
            load_config(None, "grpo", [f"{key}={bad}"])


def declared_option_ranges():
    """(algorithm, key, range, hint) for every algorithm option whose range is declared on its field."""
    import dataclasses

    from algos import ALGORITHMS

    out = []
    for name, cls in ALGORITHMS.items():
        if dataclasses.is_dataclass(cls.Options):
            for f in dataclasses.fields(cls.Options):
                if "range" in f.metadata:
                    out.append((name, f.name, f.metadata["range"], f.metadata.get("hint", "")))
    return out


def test_algorithm_option_ranges_live_on_their_fields_and_are_checked():
    """Each declared range of an algorithm's own keys refuses a value just outside it, naming the key, the range and
    the field's hint (the paper's value); the value just inside it loads."""
    import re

    ranges = declared_option_ranges()
    assert {(a, k) for a, k, _, _ in ranges} >= {("cppo", "pruning"), ("dcpo", "max_ratio"), ("vespo", "k_pos"),
                                                 ("sapo", "tau_neg"), ("gpg", "threshold"), ("kl-cov", "cov_ratio")}
    for algo, key, within, hint in ranges:
        bad = "[-1.0]" if key == "bleu_weights" else OUTSIDE[within]
        want = f"algo.{key}=" + r".* is invalid: it must be .*" + re.escape(within) + (re.escape(f" ({hint})") if hint else "")
        with pytest.raises(ConfigError, match=want):
            load_config(None, algo, [f"algo.{key}={bad}"])
    assert load_config(None, "cppo", ["algo.pruning=0"]).algo.options.pruning == 0
    assert load_config(None, "grpo-lambda", ["algo.neg_adv_clamp=null"]).algo.options.neg_adv_clamp is None
    with pytest.raises(ConfigError, match=r"algo.bleu_weights=\[\] is invalid: it must be a non-empty list"):
        load_config(None, "diver", ["algo.bleu_weights=[]"])
