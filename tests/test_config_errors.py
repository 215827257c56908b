"""Mistakes that used to train silently (or fail late) stop at start, before any model loads, with a message
naming the fix (docs/troubleshooting.md). Each one goes through train.py's own entry: ``--print-config`` and the
run share one validation, and the run's Trainer is replaced by one that fails the test if it is ever built."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import train
from grpo.foundation.config import ConfigError

GSM8K = "tests/data/gsm8k/train_head40.jsonl"  # (the tests run from the checkout's root)
from grpo.training.configure import load_config


@pytest.fixture
def no_model(monkeypatch):
    """train.main's Trainer (which loads the model) must never be built: the error comes first."""
    fake = types.ModuleType("grpo.training.trainer")

    class Trainer:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the Trainer was built: the mistake was not caught before the model loads")

    fake.Trainer = Trainer
    monkeypatch.setitem(sys.modules, "grpo.training.trainer", fake)


def fails(capsys, argv: list[str], *needles: str) -> str:
    """train.py with and without --print-config: exit 2, and every needle in the message."""
    for extra in (["--print-config"], []):
        rc = train.main(argv + extra)
        err = capsys.readouterr().err
        assert rc == 2, f"rc={rc}, stderr: {err}"
        assert err.startswith("config error: ")
        for needle in needles:
            assert needle in err, f"{needle!r} not in: {err}"
    return err


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


# ---------------------------------------------------------------------- rewards


def test_own_data_without_rewards_is_an_error(tmp_path, capsys, no_model):
    path = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    err = fails(capsys, ["data.source=jsonl", f"data.path={path}"], "no rewards: section", "digits_match",
                "rewards: [{fn: my_package.my_module:my_reward}]")
    assert "data.source='jsonl'" in err


@pytest.mark.parametrize("overrides, hint", [
    (["data.source=countdown"], "rewards: [{fn: countdown}]"),
    (["data.source=arithmetic"], "{fn: math_correct, kwargs: {extract: last_number, gold: plain}}"),
    (["data.source=hub", "data.path=openai/gsm8k", "data.task=gsm8k"], "rewards: [{fn: math_correct}]"),
])
def test_missing_rewards_names_the_task_reward(overrides, hint):
    with pytest.raises(ConfigError, match="no rewards: section") as e:
        load_config(overrides=overrides)
    assert hint in str(e.value)


def test_rewards_default_only_where_it_fits(tmp_path):
    assert [r.fn for r in load_config().rewards] == ["digits_match"]  # the built-in digits task
    path = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    cfg = load_config(overrides=[f"data.path={path}", "rewards=[{fn: math_correct}]"])
    assert [r.fn for r in cfg.rewards] == ["math_correct"]
    # an environment scores its own trajectories: no rewards section needed
    cfg = load_config(overrides=["env.name=calculator", "data.source=env"])
    assert cfg.env.name == "calculator"


def test_a_built_in_rewards_setting_it_does_not_take_is_refused(tmp_path):
    """math_correct's **kwargs absorbs the dataset's columns, so `kwargs: {extrct: boxed}` changed nothing, without a
    word; a function of one's own may read any key from its **kwargs and is left alone."""
    from grpo.training.configure import check_run

    path = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"rewards\[1\].kwargs sets \['extrct'\], which the built-in 'math_correct' "
                                          r"does not take.*Its settings: \['extract', 'gold', 'tag', 'correct', "):
        check_run(load_config(overrides=[f"data.path={path}", "rewards=[{fn: format_soft}, {fn: math_correct, "
                                                               "kwargs: {extrct: boxed, gold: plain}}]"]))
    with pytest.raises(ConfigError, match=r"eval.correctness.kwargs sets \['golden'\], which the built-in"):
        check_run(load_config(overrides=[f"data.path={path}", "rewards=[{fn: math_correct}]", "eval.every=5",
                                         "data.eval_holdout=1", "eval.correctness={fn: math_correct, kwargs: "
                                                                "{golden: plain}}"]))
    # and a setting's value, which a built-in checks before its first row: a call on no rows at start
    with pytest.raises(ConfigError, match=r"rewards\[0\].kwargs=\{'gold': 'gms8k'\}: gold='gms8k' is invalid: choose "
                                          r"from \['auto', 'gsm8k', 'boxed', 'plain'\]"):
        check_run(load_config(overrides=[f"data.path={path}", "rewards=[{fn: math_correct, kwargs: {gold: gms8k}}]"]))
    with pytest.raises(ConfigError, match=r"blocks='answer' is invalid: give a list of tag names, e.g. \[answer\]"):
        check_run(load_config(overrides=[f"data.path={path}", "rewards=[{fn: format_soft, kwargs: {blocks: answer}}]"]))
    check_run(load_config(overrides=[f"data.path={path}", "rewards=[{fn: math_correct, kwargs: {extract: boxed}}, "
                                                           "{fn: 'tests.reward_fixtures:length_bonus', kwargs: "
                                                           "{scale: 2, anything: 1}}]"]))


# ---------------------------------------------------------------------- data.path without data.source


@pytest.mark.parametrize("name, source", [
    ("a.jsonl", "jsonl"), ("a.json", "jsonl"), ("a.JSONL", "jsonl"), ("a.jsonl.gz", "jsonl"),
    ("a.parquet", "parquet"), ("a.csv", "csv"),
])
def test_data_source_from_the_extension(name, source):
    cfg = load_config(overrides=[f"data.path=/data/{name}", "rewards=[{fn: math_correct}]"])
    assert cfg.data.source == source


def test_data_source_explicit_wins():
    cfg = load_config(overrides=["data.source=hub", "data.path=openai/gsm8k", "rewards=[{fn: math_correct}]"])
    assert cfg.data.source == "hub"


def test_data_path_of_unknown_format(capsys, no_model):
    fails(capsys, ["data.path=openai/gsm8k", "rewards=[{fn: math_correct}]"],
          "data.path='openai/gsm8k' is set without data.source", "data.source=hub")


def test_data_path_with_a_generated_task(capsys, no_model):
    fails(capsys, ["data.source=builtin", "data.path=mine.jsonl"], "is not read with data.source='builtin'")


def test_csv_file_is_read(tmp_path):
    from grpo.data.sources import load_source

    path = tmp_path / "mine.csv"
    path.write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    cfg = load_config(overrides=[f"data.path={path}", "rewards=[{fn: math_correct}]"])
    src = load_source(cfg.data, 0)
    assert [src[i]["prompt"] for i in range(len(src))] == ["1+1=", "2+2="]


# ---------------------------------------------------------------------- models


def _refused():
    raise ConnectionRefusedError("the test forbids network connections here")


@pytest.mark.parametrize("name", ["models/smollm2-135m-instruct", "./no/such/model", "/no/such/model",
                                  "~/no-such-model-here", "a/b/c"])
def test_missing_local_model_fails_at_once(tmp_path, monkeypatch, capsys, no_model, name):
    monkeypatch.chdir(tmp_path)  # a clean checkout: no models/ folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    connects = []  # the hub would be tried through a socket (about 50 s of retries here, where it is unreachable)
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: connects.append(addr) or _refused())
    err = fails(capsys, [f"model.name_or_path={name}"], f"model.name_or_path={name!r} looks like a local folder",
                "does not exist")
    assert connects == [], "no hub lookups"
    assert ("scripts/fetch_smollm2.py" in err) == ("smollm2" in name)


def test_hub_ids_and_existing_folders_pass(tmp_path, monkeypatch):
    from grpo.foundation.modeling import check_model_path, looks_local

    monkeypatch.chdir(tmp_path)
    assert not looks_local("Qwen/Qwen2.5-0.5B-Instruct") and not looks_local("gpt2")
    check_model_path("model.name_or_path", "Qwen/Qwen2.5-0.5B-Instruct")  # the hub's to answer
    (tmp_path / "models" / "mine").mkdir(parents=True)
    check_model_path("model.name_or_path", "models/mine")
    from grpo.training.configure import check_run

    with pytest.raises(ConfigError, match=r"ref.model='models/other' looks like a local folder"):
        check_run(load_config(overrides=["algo.beta=0.04", "ref.model=models/other"]))
    # the tools that load a tokenizer first (scripts/eval.py --model) say so too, not the hub's repo-id complaint
    from grpo.foundation.modeling import load_tokenizer

    with pytest.raises(ConfigError, match=r"model.name_or_path='/no/such/model' looks like a local folder, and "
                                          r"'/no/such/model' does not exist"):
        load_tokenizer("/no/such/model")


# ---------------------------------------------------------------------- the reference server


def test_reference_nobody_listens_on_fails_within_seconds(capsys, no_model):
    from grpo.foundation.dist import free_port

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    rc = train.main([f"ref.url={url}", "algo.beta=0.04", "ref.startup_wait=1", "ref.retry_window=600"])
    err = capsys.readouterr().err
    assert rc == 1 and time.monotonic() - t0 < 120, "waited out ref.retry_window, not ref.startup_wait: " + err
    assert f"nothing is listening at ref.url={url!r}" in err and "python ref_client.py" in err
    assert "ref.startup_wait" in err
    # --print-config refuses it too (issue 42, item 22: it printed a config the run then refused); beta = 0
    # queries no server
    assert train.main([f"ref.url={url}", "algo.beta=0.04", "ref.startup_wait=1", "--print-config"]) == 1
    assert f"nothing is listening at ref.url={url!r}" in capsys.readouterr().err
    assert train.main([f"ref.url={url}", "algo.beta=0", "--print-config"]) == 0
    from grpo.training.configure import probe_services

    probe_services(load_config(overrides=[f"ref.url={url}", "algo.beta=0"]))


def test_a_dead_teacher_server_fails_before_any_model_loads(capsys, no_model):
    """Issue 60 item 4: a dead teacher.url retried for a minute after the model loaded, its message naming ref.url
    and the reference model, and --print-config passed it. Probed at start like ref.url, named as the teacher."""
    from grpo.foundation.dist import free_port

    url = f"http://127.0.0.1:{free_port()}"
    for extra in ([], ["--print-config"]):
        t0 = time.monotonic()
        rc = train.main(["--algo", "opd", f"teacher.url={url}", "teacher.model=null", "algo.beta=0",
                         "ref.startup_wait=1", "ref.retry_window=600", *extra])
        err = capsys.readouterr().err
        assert rc == 1 and time.monotonic() - t0 < 120, err
        assert f"nothing is listening at teacher.url={url!r}" in err and "teacher's server" in err, err
        assert "ref.model=TEACHER" in err and "ref.url=" not in err, err


def test_print_config_refuses_a_reward_parameter_no_column_fills(capsys, tmp_path):
    """Issue 42, item 22: --print-config passed a reward that the run then refused for its columns."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [f"data.path={data}", "rewards=[{fn: 'tests.reward_fixtures:trl_needs_solution'}]"]
    assert train.main([*args, "--print-config"]) == 2
    assert "missing a required argument: 'solution'" in capsys.readouterr().err
    assert train.main([*args, "data.columns={solution: answer}", "--print-config"]) == 0


def test_reference_that_starts_late_is_waited_for():
    """A server that comes up within ref.startup_wait passes the probe (started beside the trainer)."""
    from grpo.foundation.dist import free_port
    from grpo.reference.http import probe

    port = free_port()
    httpd = []

    def serve_later():
        time.sleep(1.0)
        server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
        httpd.append(server)
        server.handle_request()

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    t0 = time.monotonic()
    probe(load_config(overrides=[f"ref.url=http://127.0.0.1:{port}", "ref.startup_wait=600"]))
    assert 0.9 < time.monotonic() - t0 < 300, "returned before the server was up, or waited out ref.startup_wait"
    thread.join(10)
    httpd[0].server_close()


# ---------------------------------------------------------------------- one validation for --print-config and the run


@pytest.mark.parametrize("overrides, needles", [
    (["rewards=[{fn: no_such_reward}]"], ["rewards[0].fn='no_such_reward' is unknown", "math_correct"]),
    (["rewards=[{fn: 'no_such_module:f'}]"], ["rewards[0].fn='no_such_module:f' cannot be imported"]),
    (["eval.format={fn: no_such_reward}"], ["eval.format.fn='no_such_reward' is unknown"]),
    (["rollout.engine=nope"], ["rollout.engine='nope' is unknown", "'hf'"]),
    (["rollout.engine='no_such_module:Engine'"], ["rollout.engine='no_such_module:Engine' cannot be imported"]),
    (["--algo", "grpo-ps", "algo.step_reward_fn=nope"], ["algo.step_reward_fn='nope' is unknown"]),
    (["--algo", "mt-grpo"], ["mt-grpo needs multi-turn rollouts, and env.name is not set", "env.name=calculator"]),
    (["--algo", "gigpo"], ["gigpo needs multi-turn rollouts"]),
    (["env.name=no_such_env", "data.source=env"], ["env.name='no_such_env' is unknown"]),
    (["env.name=calculator", "data.source=env", "env.tools=[{fn: nope}]"], ["env.tools fn='nope' is unknown"]),
    # issue 30, item 30: settings that would be accepted and do nothing
    (["env.kwargs={size: 4}"], ["env.kwargs set without env.name, so nothing would use it"]),
    (["env.tool_workers=4", "env.stop=[x]"], ["env.stop, env.tool_workers set without env.name"]),
    (["env.name=calculator", "data.source=env", "env.tool_workers=100000"], ["at most 256 worker processes"]),
    (["env.name=calculator", "data.source=env", "env.tools=[{fn: calculator}, {fn: calculator}]"],
     ["env.tools names ['calculator'] twice"]),
    # issue 30, items 10 and 22: an environment's options are checked at start, not inside every trajectory
    (["env.name=calculator", "data.source=env", "env.tools=[{fn: calculator, name: calc}]"],
     ["env.name='calculator' calls the tools ['calculator'], and env.tools names ['calc']"]),
    (["env.name=maze", "data.source=env", "env.kwargs={walls: -1}"], ["env.kwargs.walls=-1 is invalid"]),
    (["env.name=maze", "data.source=env", "env.kwargs={size: 1000000}"], ["env.kwargs.size=1000000 is invalid: from 2 "
                                                                          "to 64"]),
    (["env.name=maze", "data.source=env", "env.kwargs={max_distance: -3}"], ["env.kwargs.max_distance=-3 is invalid"]),
    (["env.name=maze", "data.source=env", "env.kwargs={wals: 2}"],
     ["env.kwargs ['wals'] are not options of env.name='maze'", "'walls'"]),
    (["env.name=calculator", "data.source=env", "env.kwargs={partial_credit: maybe}"],
     ["env.kwargs.partial_credit='maybe' is invalid", "'numeric'"]),
    (["env.name=calculator", "data.source=env", "env.kwargs={max_value: -5}"], ["env.kwargs.max_value=-5 is invalid"]),
    (["data.source=jsonl", "data.path=/no/such/file.jsonl", "rewards=[{fn: math_correct}]"],
     ["data.path='/no/such/file.jsonl': no such file"]),
    # issue 58 item 12: a missing teacher passed --print-config and failed after the policy loaded, naming
    # model.name_or_path
    (["teacher.model=/no/such/teacher"], ["teacher.model='/no/such/teacher' looks like a local folder",
                                          "does not exist"]),
    # issue 60 item 15: a teacher of another tokenizer passed --print-config and was refused after the policy loaded
    (["teacher.model=builtin:tiny-arith"], ["teacher.model='builtin:tiny-arith' cannot teach model.name_or_path=",
                                            "its tokenizer (31 tokens) is not the policy's (93 tokens)"]),
    (["teacher.adapter=/no/such/adapter", "model.lora={r: 4}"],
     ["teacher.adapter='/no/such/adapter': '/no/such/adapter' is not a LoRA adapter folder (it does not exist)"]),
])
def test_what_the_run_refused_late_fails_at_start(capsys, no_model, overrides, needles):
    fails(capsys, overrides, *needles)


@pytest.mark.parametrize("target", ["wandb", "tensorboard"])
def test_missing_logger_fails_at_start(capsys, monkeypatch, no_model, target):
    monkeypatch.setitem(sys.modules, "wandb" if target == "wandb" else "torch.utils.tensorboard", None)
    fails(capsys, [f"logging.report_to=[{target}]"], f"includes {target!r} but it is not installed: pip install")


def test_vllm_not_installed_or_badly_split_fails_at_start(capsys, monkeypatch, no_model):
    from grpo.rollout import vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    fails(capsys, ["rollout.engine=vllm"], "rollout.engine=vllm needs the vllm extra")
    monkeypatch.setattr(vllm_engine.VLLMEngine, "check_installed", staticmethod(lambda: None))  # as if installed
    monkeypatch.setenv("WORLD_SIZE", "3")
    fails(capsys, ["rollout.engine=vllm", "rollout.prompts_per_step=6", "rollout.vllm.tensor_parallel_size=2"],
          "rollout.vllm.tensor_parallel_size=2 must divide the number of ranks (3)")


def test_flash_attention_not_installed_fails_at_start(capsys, monkeypatch, no_model):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if not installed
    fails(capsys, ["model.attn_implementation=flash_attention_2"], "needs the flash-attn package")


def test_an_output_dir_that_cannot_be_written_fails_at_start(tmp_path):
    """It failed when the trainer made the folder, after the models had loaded, with a traceback."""
    from grpo.training.configure import check_run

    (tmp_path / "a-file").write_text("x")
    for where, words in ((tmp_path / "a-file" / "run", "a-file' is a file, not a folder"),
                         (Path("/proc/grpo-never/run"), "'/proc' is not writable here, so the run's folder cannot be made")):
        with pytest.raises(ConfigError, match=rf"train.output_dir='{where}': .*{words}"):
            check_run(load_config(overrides=[f"train.output_dir={where}"]))
    check_run(load_config(overrides=[f"train.output_dir={tmp_path / 'new' / 'run'}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "nothing made by the check"


def test_resume_without_checkpoint_fails_at_start(tmp_path, capsys, no_model):
    fails(capsys, [f"train.output_dir={tmp_path}", "--resume"], "--resume: no checkpoint in")


def test_prompts_must_split_over_the_ranks(capsys, monkeypatch, no_model):
    monkeypatch.setenv("WORLD_SIZE", "3")
    fails(capsys, ["rollout.prompts_per_step=8"], "rollout.prompts_per_step=8 must be divisible by the number of "
                                                   "ranks (3)")


# ---------------------------------------------------------------------- the command line


def test_flags_between_overrides(capsys):
    assert train.main(["train.lr=0.5", "--print-config", "--algo", "dapo", "algo.beta=0.25"]) == 0
    out = capsys.readouterr().out
    assert "name: dapo" in out and "lr: 0.5" in out and "beta: 0.25" in out


@pytest.mark.parametrize("given, hint", [("DAPO", "'dapo'"), ("GSPO_token", "'gspo-token'"), ("drgpro", "'drgrpo'")])
def test_algorithm_name_suggestion(capsys, no_model, given, hint):
    fails(capsys, [f"algo.name={given}"], f"unknown algorithm {given!r}. Did you mean {hint}?")


@pytest.mark.parametrize("given, dtype", [("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("float16", "fp16"),
                                          ("float32", "fp32"), ("BF16", "bf16"), ("fp16", "fp16")])
def test_dtype_aliases(given, dtype):
    assert load_config(overrides=[f"model.dtype={given}"]).model.dtype == dtype
    spec = load_config(overrides=[f"rewards=[{{model: m, dtype: {given}}}]"]).rewards[0]
    assert spec.dtype == dtype


def test_dtype_still_refuses_nonsense():
    with pytest.raises(ConfigError, match=r"model.dtype='int8' is invalid: choose from \['auto', 'fp32', 'bf16', 'fp16'\]"):
        load_config(overrides=["model.dtype=int8"])


def test_option_of_another_algorithm_names_its_owner(capsys, no_model):
    fails(capsys, ["algo.overlong_buffer=4"], "algo.overlong_buffer is an option of dapo and prorl, not of grpo",
          "--algo dapo")
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.no_such_option'"):
        load_config(overrides=["algo.no_such_option=1"])


def test_chat_template_a_string_or_a_file_replaces_the_tokenizers(tmp_path):
    from grpo.data.sources import prompt_text
    from grpo.foundation.config_rules import custom_chat_template
    from grpo.foundation.modeling import load_tokenizer

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    (tmp_path / "t.jinja").write_text(template)
    for value in (template, str(tmp_path / "t.jinja")):
        cfg = load_config(overrides=[f"data.chat_template={value}"])
        tok = load_tokenizer("builtin:tiny-char")
        tok.chat_template = custom_chat_template(cfg.data)
        assert prompt_text(tok, {"prompt": "12+3"}, cfg.data) == "<<12+3>>=>"
    assert custom_chat_template(load_config(overrides=["data.chat_template=true"]).data) is None
    with pytest.raises(ConfigError, match=r"data.chat_template='missing.jinja' is neither a Jinja template .* nor an "
                                          r"existing file"):
        load_config(overrides=["data.chat_template=missing.jinja"])


def test_env_options_a_class_takes_as_kwargs_are_not_second_guessed():
    """An environment whose constructor keeps **kwargs (not **_) may use any key: no unknown-key error."""
    from grpo.rollout.environment import EnvSetup, Environment

    class Open(Environment):
        def __init__(self, tools=None, **kwargs):
            super().__init__(tools)
            self.options = kwargs

        def reset(self, row):
            return "x"

        def step(self, action):
            raise NotImplementedError

    class Closed(Open):
        def __init__(self, tools=None, level: int = 1, **_):
            super().__init__(tools)

    cfg = load_config(overrides=["env.name=calculator", "data.source=env"]).env
    for cls, kwargs, ok in ((Open, {"anything": 1}, True), (Closed, {"level": 2}, True), (Closed, {"levle": 2}, False)):
        cfg.kwargs = kwargs
        sys.modules["tests._envs_probe"] = types.SimpleNamespace(Env=cls)
        cfg.name = "tests._envs_probe:Env"
        try:
            EnvSetup.check(cfg)
            assert ok, kwargs
        except ValueError as e:
            assert not ok and "env.kwargs ['levle'] are not options" in str(e) and "['level']" in str(e), e
        finally:
            sys.modules.pop("tests._envs_probe", None)


def test_maze_draws_are_bounded(monkeypatch):
    """Constraints no draw meets end in a clear error, not a loop at 100% CPU (issue 30, item 22)."""
    from envs import maze

    monkeypatch.setattr(maze, "distance", lambda *a: 0)  # start and goal never connected
    with pytest.raises(ValueError, match=r"0 mazes in 6001 draws with size=3, walls=0, max_distance=0"):
        maze.MazeEnv.tasks(5, 0)


@pytest.mark.parametrize("overrides, warning", [
    (["rollout.engine=hf", "rollout.vllm.gpu_memory_utilization=0.5"],
     "config warning: rollout.vllm.gpu_memory_utilization ignored: rollout.engine='hf', not 'vllm'"),
    (["ref.sync_every=500", "train.max_steps=100"],
     "config warning: ref.sync_every=500 > train.max_steps=100: the reference is never synced in this run"),
    (["ref.ask_groups=false"],
     "config warning: ref.ask_groups=false ignored: groups are asked one by one only of a reference server "
     "(ref.url=None) in streamed rollouts (rollout.max_staleness=0)"),
    (["data.source=jsonl", f"data.path={GSM8K}", f"data.eval_path={GSM8K}", "data.columns={prompt: question}",
      "rewards=[{fn: math_correct}]"],
     f"config warning: data.eval_path='{GSM8K}' is never evaluated: eval.every=0"),
    (["teacher.model=builtin:tiny-char-h64", "teacher.coef=0"],  # issue 60 item 3: a teacher nothing asks
     "config warning: teacher.model='builtin:tiny-char-h64' is never asked: teacher.coef=0.0, so the distillation "
     "term is off"),
    (["rollout.top_k=1"],  # greedy sampling: a run that learns nothing, without a word before
     "config warning: rollout.top_k=1 samples greedily: the 16 completions of a prompt are the same, so their rewards "
     "are equal and every group-relative advantage is 0"),
])
def test_settings_that_do_nothing_here_are_named_once(capsys, overrides, warning):
    """Issue 30, item 30: valid settings that this run ignores are printed before any model loads."""
    assert train.main([*overrides, "--print-config"]) == 0
    err = capsys.readouterr().err
    assert err.count(warning) == 1, err


@pytest.mark.parametrize("override, mapped", [
    ("train.learning_rate=1e-6", "here it is train.lr"),
    ("algo.scale_rewards=none", "here it is algo.adv_std ('group': unbiased, the default; 'none': none)"),
    ("algo.loss_type=dr_grpo", "'dr_grpo' --algo drgrpo"),
    ("train.per_device_train_batch_size=8", "here it is train.micro_batch_size"),
    ("train.gradient_accumulation_steps=4", "one optimizer step per rollout batch"),
])
def test_trl_names_get_our_key(capsys, no_model, override, mapped):
    """Issue 60 item 5: TRL's names got no suggestion or a wrong one (algo.scale_rewards -> 'kl_in_reward')."""
    err = fails(capsys, [override], "is TRL's name (GRPOConfig, GRPOTrainer)", mapped, "docs/python-api.md")
    assert "Did you mean" not in err


def test_trl_argument_names_in_the_python_api():
    from grpo import train

    with pytest.raises(ConfigError, match=r"'train_dataset' is TRL's name .*here it is dataset= \(the Python API\)"):
        train(train_dataset=ROWS)


def test_resuming_a_python_api_run_from_the_command_line_says_how(capsys, no_model, tmp_path):
    """Issue 60 item 8: a run started from Python, resumed with train.py, said "rewards[0].fn='correct#1' is unknown
    ... Did you mean 'math_correct'?". It says the reward is a Python function and how to resume from Python."""
    err = fails(capsys, ["rewards=[{fn: correct#1}]", f"train.output_dir={tmp_path}"],
                "rewards[0].fn='correct#1' is a Python function that grpo.train was given in another process",
                "train(<the same config>, rewards=[correct, ...], resume=True", str(tmp_path))
    assert "Did you mean" not in err


@pytest.mark.parametrize("algo, warned", [("dapo", True), ("grpo", False)])
def test_a_reference_server_the_algorithm_never_asks_is_named(capsys, algo, warned):
    """Issue 60 item 3: `deepspeed train.py --algo dapo ref.url=...` sent the server 0 requests (dapo's beta is 0)
    and nothing said so; it is named before any model loads (then the probe finds no server here)."""
    train.main(["--algo", algo, "ref.url=http://127.0.0.1:9", "--print-config"])
    err = capsys.readouterr().err
    warning = ("config warning: ref.url='http://127.0.0.1:9' is never asked: algorithm 'dapo' uses no reference with "
               "algo.beta=0.0 and algo.kl_in_reward=0.0, so the server gets no request")
    assert (warning in err) == warned, err


def test_every_unknown_key_is_reported_at_once(tmp_path):
    """Issue 60 item 18: a YAML with several typos was reported one typo per run. Every unknown key comes at once,
    each with its own suggestion: in sections, in the algorithm's options, inside an optional section, at the top."""
    from grpo.foundation.config import ConfigError
    from grpo.training.configure import load_config

    yaml = tmp_path / "typos.yaml"
    yaml.write_text("train: {lrr: 1.0e-5, max_steps: 3}\nrollout: {tempreature: 0.7}\n"
                    "algo: {overlong_filterr: true, rollout_correction: {mode: mask, hihg: 2.0}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(yaml, "dapo", ["eval.evry=5"])
    lines = str(e.value).splitlines()
    assert lines[0] == "5 unknown config keys:"
    for key, close in (("algo.overlong_filterr", "overlong_filter"), ("train.lrr", "lr"),
                       ("rollout.tempreature", "temperature"), ("algo.rollout_correction.hihg", "high"),
                       ("eval.evry", "every")):
        assert any(f"unknown config key {key!r}. Did you mean {close!r}?" in line for line in lines[1:]), (key, lines)
    with pytest.raises(ConfigError, match=r"^2 unknown config keys:\n  - unknown config key 'trian'. Did you mean "
                                          r"'train'\?.*\n  - unknown config key 'evl'"):
        load_config(None, "grpo", ["trian.lr=1", "evl.every=2"])


def test_a_data_file_on_the_command_line_over_a_task_preset_is_read_by_its_extension():
    """Issue 60 item 19: `--config configs/demo.yaml data.path=FILE.jsonl` was refused (the preset's data.source is its
    generated task), although the README says a file's format follows its extension: the file named on the command
    line is read as its extension says. A source the command line sets itself still decides."""
    from grpo.foundation.config import ConfigError
    from grpo.training.configure import load_config

    demo = "configs/demo.yaml"
    cfg = load_config(demo, "grpo", [f"data.path={GSM8K}", "data.columns={prompt: question}"])
    assert (cfg.data.source, cfg.data.path) == ("jsonl", str(GSM8K))
    with pytest.raises(ConfigError, match="is not read with data.source='builtin'"):
        load_config(demo, "grpo", [f"data.path={GSM8K}", "data.source=builtin"])


def test_a_missing_reference_server_says_what_the_run_asks_it_for(capsys):
    """Issue 60 item 14: `--algo opd` over a YAML that sets beta 0.04 stopped on a missing reference server without
    saying why the run needs one; the error names what the run asks it for, with the values that decide it."""
    assert train.main(["--algo", "opd", "algo.beta=0.04", "ref.url=http://127.0.0.1:9", "ref.startup_wait=0",
                       "teacher.model=builtin:tiny-char-h64", "--print-config"]) == 1
    err = capsys.readouterr().err
    assert ("nothing is listening at ref.url='http://127.0.0.1:9' (tried for ref.startup_wait=0 s; ConnectionError), "
            "and the run asks it: algorithm 'opd' takes the reference's log-probs (algo.beta=0.04, "
            "algo.kl_in_reward=0.0). The reference server must run before training starts") in err, err


def test_the_bare_command_runs_the_demo_task_and_own_settings_keep_the_defaults(capsys):
    """issue 60 item 3: `deepspeed train.py --algo dapo` with no --config, what a newcomer types first, ran 256-token
    completions at lr 1e-5 on the tiny model (reward flat after minutes); it runs the demo task now (dapo on it: reward
    0.03 -> 0.51 in 100 steps, 22 s on the 2-core CPU), and says so at start. A run that names its own model, data,
    rewards or environment starts from the plain defaults as before; --config always wins."""
    from grpo.training.configure import load_config

    def resolved(*argv):
        args = train.parse_args(list(argv))
        return load_config(train.config_path(args), args.algo, args.overrides)

    bare = resolved("--algo", "dapo")
    assert (bare.rollout.max_completion_length, bare.train.lr, bare.algo.name) == (3, 1e-3, "dapo")
    assert train.config_path(train.parse_args(["--algo", "dapo"])) == str(train.DEMO)
    for own in ("model.name_or_path=builtin:tiny-char", "data.path=x.jsonl", "env.name=calculator",
                "rewards=[{fn: math_correct}]"):
        assert train.config_path(train.parse_args([own])) is None, own
    assert resolved("train.lr=0.5").train.lr == 0.5  # other overrides apply over the demo
    assert resolved("--config", "configs/smollm2_arith.yaml").rollout.max_completion_length == 12  # --config wins
    assert train.main(["--algo", "dapo", "--print-config"]) == 0
    assert "no --config" not in capsys.readouterr().out  # said when a run starts, not for --print-config


def test_a_run_composes_its_parts_once(tmp_path, monkeypatch, single_rank_env):
    """issue 59 item 2: train.py composed the run twice (check_run's parts dropped, the Trainer composing again);
    the parts check_run returns reach the Trainer."""
    from grpo.training import compose as compose_module, configure, trainer

    calls = []
    real = compose_module.compose

    def counted(cfg):
        calls.append(cfg.algo.name)
        return real(cfg)

    monkeypatch.setattr(configure, "compose", counted)
    monkeypatch.setattr(trainer, "compose", counted)
    assert train.main(["--algo", "grpo", f"train.output_dir={tmp_path}", "train.max_steps=1", "algo.beta=0",
                       "rollout.prompts_per_step=2", "rollout.num_generations=2", "reward_pool.num_workers=0",
                       "logging.progress_bar=false", "logging.plot=false", "train.save_every=0"]) == 0
    assert calls == ["grpo"]
