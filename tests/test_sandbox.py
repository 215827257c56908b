"""The sandbox for untrusted code (grpo/workers/sandbox.py) against hostile programs, and the worker pools' limits.

Each hostile program must end within its limits, with the reason it ended, and leave this (the trainer's)
process and its files alone. Where this machine cannot give a guarantee (no network namespace, no
unprivileged user), the test checks the sandbox says so in ``capabilities()`` and what then happens.
"""

import dataclasses
import os
import socket
import stat
import time

import pytest

from grpo.foundation.config import RewardPoolConfig, RewardSpec, WorkerLimits
from grpo.scoring.combined import CombinedReward
from grpo.workers import sandbox

# a wall clock far above the CPU seconds: on a loaded machine a busy loop still ends by its CPU limit
LIMITS = {"timeout": 30.0, "cpu_seconds": 1, "memory_mb": 256, "processes": 32, "max_output_bytes": 10_000}
CAPS = sandbox.capabilities(LIMITS)


def run(code, **kw):
    limits = dict(LIMITS, **kw.pop("limits", {}))
    t0 = time.monotonic()
    r = sandbox.run_python(code, limits, **kw)
    assert time.monotonic() - t0 < limits["timeout"] + 30  # contained: never far past the timeout
    return r


def test_a_plain_program_runs_with_an_empty_environment_in_a_fresh_directory():
    r = run("import os, sys\nprint(sorted(os.environ), os.getcwd(), sorted(os.listdir('.')))")
    assert r.reason == "ok" and r.returncode == 0
    env, cwd, files = r.stdout.rsplit(" ", 1)[0], r.stdout.split(" ")[1], r.stdout.strip().rsplit(" ", 1)[1]
    assert "HOME" not in env and "PATH" not in env and "PYTHONPATH" not in env
    assert "sandbox-" in cwd and files == "['main.py']"
    r2 = run("import os; print(os.getcwd())")
    assert r2.stdout.strip() != cwd and not os.path.exists(r2.stdout.strip())  # fresh, and removed after


def test_infinite_loop_is_stopped_by_the_cpu_limit_or_the_wall_clock():
    assert run("while True: pass").reason == "cpu"
    assert run("import time; time.sleep(60)", limits={"timeout": 1.5}).reason == "timeout"


def test_memory_bomb_fails_its_allocation():
    r = run("x = bytearray(4 << 30)")
    assert r.reason == "memory" and "MemoryError" in r.stderr


def test_fork_bomb_is_contained_and_the_next_program_runs():
    r = run("import os\nwhile True:\n    os.fork()")
    assert r.reason in ("exit", "timeout", "cpu", "signal")
    if CAPS["unprivileged"]:  # RLIMIT_NPROC holds: the fork fails fast
        assert "Resource temporarily unavailable" in r.stderr
    assert run("print(6 * 7)").stdout == "42\n"


def test_huge_stdout_is_cut_and_the_program_killed():
    r = run("while True: print('x' * 1000)")
    assert r.reason == "output_limit" and r.truncated and len(r.stdout) == LIMITS["max_output_bytes"]


def test_killing_its_parent_kills_nothing_of_the_trainers():
    me = os.getpid()
    r = run("import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept PermissionError:\n    pass\n"
            "print('parent', os.getppid())\nos.kill(%d, 9)" % me)
    if CAPS["namespaces"]:  # its parent is its namespace's init, which it cannot kill; the trainer is not there
        assert r.stdout == "parent 1\n" and r.reason == "exit" and "ProcessLookupError" in r.stderr
    else:  # its parent is the launcher: the run ends there
        assert r.reason == "signal" and r.returncode == -9
    assert os.getpid() == me  # still here


def test_exits_and_a_segfault_are_reasons_not_crashes():
    assert run("import sys; sys.exit(3)").returncode == 3
    assert run("import sys; sys.exit(0)").reason == "ok"
    r = run("import os; os._exit(7)")
    assert (r.reason, r.returncode) == ("exit", 7)
    r = run("import ctypes; ctypes.string_at(0)")
    assert (r.reason, r.returncode) == ("signal", -11)


def test_stdin_is_closed_or_given():
    assert run("import sys; print(repr(sys.stdin.read()))").stdout == "''\n"
    assert run("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


def test_deleting_files_in_its_directory_touches_only_its_directory(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    r = run("import os\nfor f in os.listdir('.'): os.remove(f)\nprint(os.listdir('.'))")
    assert r.stdout == "[]\n" and keep.read_text() == "mine"


@pytest.fixture
def open_dir():
    """A directory of the trainer's that anyone may enter (0755, like a run folder in the project): what stops
    the program must be the files' own permissions, not a private directory above them."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="i24-trainer-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_writing_outside_its_directory(open_dir):
    run_dir = os.path.join(open_dir, "run")
    os.mkdir(run_dir)
    ckpt = os.path.join(run_dir, "step-1.pt")
    with open(ckpt, "w") as f:
        f.write("weights")
    src = os.path.abspath("rewards/__init__.py")
    before = open(src).read()
    targets = [ckpt, os.path.join(run_dir, "new.txt"), src]
    code = (f"import os\nfor p in {targets!r}:\n    try:\n        open(p, 'a').write('x')\n"
            f"        print('wrote', p)\n    except OSError as e:\n        print('refused', type(e).__name__)")
    r = run(code)
    if CAPS["namespaces"] or CAPS["drops_user"]:  # not in its root, or not its user's to write
        assert r.stdout.count("refused") == 3, r.stdout
        assert open(ckpt).read() == "weights" and not os.path.exists(targets[1]) and open(src).read() == before
    else:  # same user as the trainer, no private root: nothing stops it (describe() says so)
        assert "wrote" in r.stdout
        open(src, "w").write(before)


def test_reading_the_trainers_files(open_dir):
    private, public = os.path.join(open_dir, "secret.txt"), os.path.join(open_dir, "data.txt")
    for path, mode in ((private, stat.S_IRUSR | stat.S_IWUSR), (public, 0o644)):
        with open(path, "w") as f:
            f.write("s3cret" if path == private else "public")
        os.chmod(path, mode)
    r = run(f"print(open({private!r}).read())")
    if CAPS["namespaces"]:  # its own root: neither file is there
        assert r.reason == "exit" and "FileNotFoundError" in r.stderr and "s3cret" not in r.stdout
        assert "FileNotFoundError" in run(f"print(open({public!r}).read())").stderr
        return
    if CAPS["drops_user"]:  # a 0600 file of the trainer's user is out of reach
        assert r.reason == "exit" and "PermissionError" in r.stderr and "s3cret" not in r.stdout
    else:
        assert "s3cret" in r.stdout
    # world-readable files are readable without a mount namespace (docs/sandbox.md, what it does not do)
    assert run(f"print(open({public!r}).read())").stdout == "public\n"


def test_a_socket_to_a_loopback_listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    finally:
        srv.close()
    if CAPS["network"]:  # its own network namespace: even loopback is unreachable
        assert r.reason == "exit" and "connected" not in r.stdout and "OSError" in r.stderr
    else:
        assert "connected" in r.stdout


def test_network_required_fails_where_no_namespace():
    if CAPS["network"]:
        assert run("print(1)", limits={"network": "required"}).reason == "ok"
    else:
        assert run("print(1)", limits={"network": "required"}).reason == "error"


def combined(fn, limits):
    return CombinedReward([RewardSpec(fn=fn)], RewardPoolConfig(1, 300.0, 0, limits=WorkerLimits(**limits)))


def test_a_reward_worker_past_its_memory_limit_is_counted_replaced_and_the_next_step_runs():
    r = combined("tests.reward_fixtures:hog_memory", {"memory_mb": 1024, "cpu_seconds": 0})
    try:
        total, _ = r(["p"], ["hog"], {})
        m = r.pop_metrics()
        assert total == [0.0] and m["reward/hog_memory/errors"] == 1.0 and m["reward_pool/killed_memory"] == 1.0
        total, _ = r(["p", "p"], ["fine", "ok"], {})  # the next step, on a fresh worker
        assert total == [0.0, 0.0] and r.pop_metrics()["reward/hog_memory/errors"] == 0.0
        assert r.pool.restarts == 1
    finally:
        r.close()


def test_a_reward_call_past_its_cpu_seconds_is_killed_counted_and_replaced():
    r = combined("tests.reward_fixtures:spin", {"cpu_seconds": 1})
    try:
        t0 = time.monotonic()
        total, _ = r(["p"], ["spin"], {})
        assert time.monotonic() - t0 < 120  # the kernel's SIGXCPU after 1 CPU second, long before the 300 s timeout
        m = r.pop_metrics()
        assert total == [0.0] and m["reward/spin/errors"] == 1.0 and m["reward_pool/killed_cpu"] == 1.0
        total, _ = r(["p"], ["fine"], {})
        assert total == [1.0]
    finally:
        r.close()


def test_a_tool_worker_past_env_tool_limits_is_counted_replaced_and_the_next_call_runs():
    from grpo.rollout.environment import EnvSetup
    from grpo.training.configure import load_config

    cfg = load_config(overrides=["env.name=calculator", "data.source=env", "env.tool_workers=1",
                                 "env.tools=[{fn: 'tests.agent_tools:hog', name: hog}]",
                                 "env.tool_limits.memory_mb=1024"])
    es = EnvSetup(cfg.env, cfg.sandbox)
    try:
        res = es.toolbox.call("hog", "hog")
        assert not res.ok and res.status == "error" and "MemoryError" in res.error
        counts = es.toolbox.pop_counts()
        assert counts["tool_errors"] == 1 and counts["tool_killed"] == 1
        assert es.toolbox.call("hog", "small").output == "fine"  # on a fresh worker
        assert es.toolbox.pool.restarts == 1
    finally:
        es.close()


def test_without_a_network_namespace_auto_logs_once_and_keeps_the_network(monkeypatch, caplog):
    """Where the kernel refuses a network namespace: ``auto`` runs with the trainer's network
    and says so once (``required`` then fails in the launcher: test_network_required_fails_where_no_namespace)."""
    real = sandbox.plan_of
    monkeypatch.setattr(sandbox, "plan_of", lambda lim: dataclasses.replace(real(lim), network="allowed"))
    monkeypatch.setattr(sandbox, "_logged", set())
    with caplog.at_level("WARNING", logger="sandbox"):
        assert run("print(1)").reason == "ok" and run("print(2)").reason == "ok"
    assert [r.message for r in caplog.records].count(
        "sandbox: this kernel/container refuses a new network namespace (unshare CLONE_NEWNET): untrusted code has "
        "the trainer's network (docs/sandbox.md)") == 1
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=2)\n"
                f"print('connected')")
    finally:
        srv.close()
    assert "connected" in r.stdout
