"""A run's reward sources and their weighted combination (docs/rewards.md): the rewards stage of the data flow.

A run's ``rewards:`` lists sources, each one of
  - ``fn``: a function, built-in (rewards/) or ``package.module:function``, called the way TRL's GRPOTrainer calls
    it or this project's plain way (grpo/scoring/calls.py); in the worker pool (grpo/workers/worker_pool.py, a hard
    timeout per call) or, with ``isolation: inline``, in the trainer process;
  - ``model``: a learned reward model, a sequence classifier (grpo/scoring/models.py), in the trainer process or
    on the reference server (``where: server``);
  - ``url``: a remote scoring endpoint (grpo/scoring/remote.py).

The step's reward of a row is ``sum_i w_i * r_i`` over the sources that scored it: a source that returns
``None`` for a row leaves it out of the sum (TRL's nansum over the functions; a row no source scored gets 0,
and enters its group's mean and std as 0, as in TRL). A function call that raises or times out scores 0 for
its rows and is counted; one that fails on most rows for ``reward_pool.max_failing_steps`` steps in a row
stops the run (grpo/training/health.py). A model or endpoint that still fails after its retries stops the
run with :class:`RewardServiceError`: never a silent zero.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from grpo.foundation.config import ConfigError, RewardPoolConfig, RewardSpec
from grpo.foundation.plugins import REWARDS
from grpo.scoring.calls import (FunctionCall, Rows, StepInfo, binding_problem, call_style, fix_hint, run_inline,
                                send_by_value)
from grpo.workers.worker_pool import Outcome, WarmUp, WorkerPool

log = logging.getLogger("rewards")


class FunctionTerm:
    """A reward function: chunks of rows as :class:`FunctionCall` s, run in the pool or inline."""

    kind = "fn"

    def __init__(self, name: str, spec: RewardSpec, pool: RewardPoolConfig, sandbox: Any = None):
        fn = REWARDS.get(spec.fn)
        self.name, self.spec, self.weight = name, spec, spec.weight
        self.kwargs = dict(spec.kwargs)
        if getattr(fn, "uses_sandbox", False) and "sandbox" not in self.kwargs:  # runs untrusted code: the run's limits
            self.kwargs["sandbox"] = dict(vars(sandbox)) if sandbox is not None else None
            from grpo.workers.sandbox import announce

            announce(self.kwargs["sandbox"])  # what holds on this machine, and what does not, said at start
        self.metric_keys: tuple[str, ...] = tuple(getattr(fn, "metric_keys", ()))
        built_in = REWARDS.built_in(spec.fn)  # rewards/'s own: a worker knows it by name
        self.style = call_style(fn, spec.style, built_in)
        self.inline = spec.isolation == "inline" or pool.num_workers == 0
        self.timeout = spec.timeout if spec.timeout is not None else pool.timeout
        # a function that bounds its own time per row (code_tests: row_timeout) gets at least that per call
        self.seconds_per_row = (fn.seconds_per_row(self.kwargs) if spec.timeout is None
                                and hasattr(fn, "seconds_per_row") else 0.0)
        # a function's own rows_per_call attribute (math_correct, code_tests: 1) unless the entry or the pool says
        self.rows_per_call = spec.batch_size or pool.chunk_size or getattr(fn, "rows_per_call", 0)
        self.workers = max(1, pool.num_workers)
        # a function registered in this process alone (the Python API's callables) goes to the workers by value
        self.code = send_by_value(fn, spec.fn) if not self.inline and ":" not in spec.fn and not built_in else None

    def calls(self, rows: Rows, state: StepInfo) -> list[tuple[FunctionCall, int, int]]:
        n = len(rows)
        size = self.rows_per_call or (n if self.inline else -(-n // self.workers))
        size = max(1, size)
        timeout = max(self.timeout, self.seconds_per_row * size)
        return [(FunctionCall(self.spec.fn, self.style, dict(self.kwargs), rows.slice(s, min(n, s + size)),
                              state, timeout, self.code), s, min(n, s + size)) for s in range(0, n, size)]


def _term(name: str, spec: RewardSpec, pool: RewardPoolConfig, device: Optional[str], ref_cfg: Any,
          sandbox: Any = None) -> Any:
    if spec.kind == "fn":
        return FunctionTerm(name, spec, pool, sandbox)
    if spec.kind == "model":
        from grpo.scoring.models import ModelTerm

        return ModelTerm(name, spec, device, ref_cfg)
    from grpo.scoring.remote import RemoteTerm

    return RemoteTerm(name, spec, pool)


def _base_name(spec: RewardSpec) -> str:
    if spec.name:
        return spec.name
    if spec.kind == "fn":
        return spec.fn.split(":")[-1]
    if spec.kind == "model":
        return "rm_" + spec.model.rstrip("/").split("/")[-1]
    from urllib.parse import urlsplit

    return "remote_" + (urlsplit(spec.url).hostname or "endpoint")


COUNTS = ("rows", "errors", "timeouts", "skipped")


def term_names(specs: list[RewardSpec]) -> list[str]:
    """Each reward source's name in ``reward_terms`` and the metrics: its ``name``, or the function's / model's /
    host's own name, with _2, _3 ... appended when the same one is listed again."""
    names, seen = [], {}
    for spec in specs:
        base = _base_name(spec)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def check_columns(terms: list[Any], columns: list[str]) -> None:
    """At start, with the dataset's first row: a reward function that cannot be called with these columns
    (a parameter no column fills, a column that clashes with a parameter) would fail on every row and score
    0 all run. ConfigError naming the function, the problem and the columns."""
    for i, t in enumerate(terms):
        if t.kind != "fn":
            continue
        problem = binding_problem(REWARDS.get(t.spec.fn), t.style, columns, t.kwargs)
        if problem is not None:
            raise ConfigError(
                f"rewards[{i}].fn={t.spec.fn!r} cannot be called with this dataset's columns {sorted(columns)} "
                f"({t.style} style): {problem}. Map the column it needs with data.columns, rename a column "
                f"that clashes with one of its parameters, give the value in rewards[{i}].kwargs, or call it "
                f"the other way: style: {'plain' if t.style == 'trl' else 'trl'} on the entry (trl: keyword "
                f"arguments as TRL passes them; plain: fn(prompts, completions, **columns))")


def settings_of(fn: Any) -> list[str]:
    """A function's named parameters that have a default: the settings ``kwargs:`` may give it."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_settings(key: str, spec: RewardSpec) -> None:
    """A built-in reward's ``kwargs:`` (one of the home package's functions, whose parameters name all it reads)
    are its parameters: a key it has none for would be absorbed by its **kwargs and change nothing. A function of
    the user's may read any key from its **kwargs, so it is not checked."""
    if not spec.kwargs or not REWARDS.built_in(spec.fn):
        return
    fn = REWARDS.get(spec.fn)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    unread = [k for k in spec.kwargs if k not in params or params[k].kind in (inspect.Parameter.VAR_POSITIONAL,
                                                                             inspect.Parameter.VAR_KEYWORD)]
    if unread:
        raise ConfigError(f"{key}.kwargs sets {unread}, which the built-in {spec.fn!r} does not take: its **kwargs "
                          f"only absorbs the dataset's other columns, so they would change nothing. Its settings: "
                          f"{settings_of(fn)} (docs/rewards.md)")
    # a call on no rows checks the settings' values (a built-in refuses a bad one before its first row), which would
    # otherwise fail every call of the run and score every row 0
    empty = {p.name: [] for p in params.values() if p.default is inspect.Parameter.empty
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    try:
        fn(**{**empty, **spec.kwargs})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}.kwargs={spec.kwargs!r}: {e} (docs/rewards.md)") from e


class CombinedReward:
    """The weighted sum of a run's reward sources; each one's values are kept for logging.

    Call it with the step's texts (and, for TRL-shaped functions, the dataset's prompts and the completion
    ids); it returns (total per row, {source name: values}), a source's value ``nan`` where it returned None.
    ``pop_metrics`` gives per source: rows, errors, timeouts, skipped (None) rows and latency (seconds), and
    ``failing()`` the sources that failed on more than half their rows in the last call.
    """

    def __init__(self, specs: list[RewardSpec], pool: Optional[RewardPoolConfig] = None,
                 device: Optional[str] = None, ref: Any = None, sandbox: Any = None):
        self.pool_cfg = pool or RewardPoolConfig()
        self.terms: list[Any] = [_term(name, spec, self.pool_cfg, device, ref, sandbox)
                                 for name, spec in zip(term_names(specs), specs)]
        pooled = any(t.kind == "fn" and not t.inline for t in self.terms)
        # a new worker imports the pooled functions' modules (and their slow_imports) before its first call
        warm = WarmUp(sorted({t.spec.fn for t in self.terms if t.kind == "fn" and not t.inline}),
                      imports=(FunctionCall.__module__,))
        self.pool = WorkerPool(self.pool_cfg.num_workers if pooled else 0, self.pool_cfg.timeout, self.pool_cfg.limits,
                               warm_up=warm)
        self.state = StepInfo()
        self.counts = {t.name: dict.fromkeys(COUNTS, 0) for t in self.terms}
        self.seconds = {t.name: 0.0 for t in self.terms}
        # a function's own counts (code_tests: passed, wrong, timeout...), keys fixed per function (collective)
        self.extra = {t.name: dict.fromkeys(getattr(t, "metric_keys", ()), 0.0) for t in self.terms}
        self.last_failed: dict[str, float] = {}  # source -> failed fraction of its rows in the last call
        self.first_error: dict[str, str] = {}  # source -> its first traceback
        self.columns: list[str] = []
        self._reported: set[tuple[str, str]] = set()

    def check_columns(self, columns: list[str]) -> None:
        """At start, with the dataset's first row: see :func:`check_columns`."""
        check_columns(self.terms, columns)

    @staticmethod
    def check(specs: list[RewardSpec], pool: RewardPoolConfig, sandbox: Any, columns: list[str]) -> None:
        """:func:`check_columns` of a run's reward functions before anything starts (no worker pool)."""
        terms = [FunctionTerm(n, s, pool, sandbox) if s.kind == "fn" else s for n, s in zip(term_names(specs), specs)]
        check_columns(terms, columns)

    check_settings = staticmethod(check_settings)

    @staticmethod
    def check_sandbox(settings: Any) -> None:
        """The ``sandbox:`` settings ask for nothing this machine cannot give (ConfigError otherwise)."""
        from grpo.workers import sandbox

        try:
            sandbox.check(settings)
        except sandbox.SandboxError as e:
            raise ConfigError(str(e)) from e

    def set_state(self, global_step: int, max_steps: int, epoch: float = 0.0) -> None:
        """The ``trainer_state`` TRL-shaped functions see from now on."""
        self.state = StepInfo(global_step, max_steps, epoch)

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list],
                 raw_prompts: Optional[list[Any]] = None, completion_ids: Optional[list[list[int]]] = None,
                 ) -> tuple[list[float], dict[str, list[float]]]:
        """(total per completion, {source name: values})."""
        rows = Rows(list(prompts), list(completions), dict(columns),
                    list(raw_prompts) if raw_prompts is not None else list(prompts), completion_ids)
        n = len(rows)
        self.columns = sorted(columns)
        values: dict[str, list[Optional[float]]] = {t.name: [0.0] * n for t in self.terms}
        failed = {t.name: 0 for t in self.terms}
        # remote sources and server-hosted models on threads, while the functions run here and in the pool
        remote = [t for t in self.terms if t.kind != "fn" and t.concurrent]
        with ThreadPoolExecutor(max_workers=max(1, len(remote))) as threads:
            futures = {t.name: threads.submit(self._timed, t, rows) for t in remote}
            self._run_functions(rows, values, failed)
            for t in self.terms:
                if t.kind != "fn" and not t.concurrent:
                    values[t.name] = self._timed(t, rows)
            for name, fut in futures.items():
                values[name] = fut.result()
        per_fn = {name: [math.nan if v is None else v for v in vals] for name, vals in values.items()}
        total = [0.0] * n
        for t in self.terms:
            c = self.counts[t.name]
            c["rows"] += n
            c["skipped"] += sum(1 for v in values[t.name] if v is None)
            total = [acc if v is None else acc + t.weight * v for acc, v in zip(total, values[t.name])]
        self.last_failed = {name: f / n if n else 0.0 for name, f in failed.items()}
        return total, per_fn

    def _timed(self, term: Any, rows: Rows) -> list[Optional[float]]:
        t0 = time.perf_counter()
        try:
            return term.score(rows)
        finally:
            self.seconds[term.name] += time.perf_counter() - t0

    def _run_functions(self, rows: Rows, values: dict, failed: dict) -> None:
        pooled, inline = [], []
        for t in self.terms:
            if t.kind == "fn":
                for call, s, e in t.calls(rows, self.state):
                    (inline if t.inline else pooled).append((t, call, s, e))
        for group, runner in ((pooled, self.pool.run), (inline, run_inline)):
            if not group:
                continue
            t0 = time.perf_counter()
            outcomes = runner([c for _, c, _, _ in group])
            spent = time.perf_counter() - t0
            for t in {t.name: t for t, _, _, _ in group}.values():
                self.seconds[t.name] += spent  # the wall time of the phase its calls ran in
            for (t, _, s, e), out in zip(group, outcomes):
                self._record(t, s, e, out, values, failed)

    def _record(self, term: FunctionTerm, s: int, e: int, out: Outcome, values: dict, failed: dict) -> None:
        if out.status == "ok":
            values[term.name][s:e] = out.values
            for k, v in (out.value or {}).items() if isinstance(out.value, dict) else ():
                if k in self.extra[term.name]:
                    self.extra[term.name][k] += float(v)
            return
        failed[term.name] += e - s
        self.counts[term.name]["errors" if out.status == "error" else "timeouts"] += e - s
        text = out.error if out.status == "error" else (
            f"TimeoutError: a call of {e - s} rows took longer than {term.timeout}s")
        self.first_error.setdefault(term.name, text)
        if (term.name, out.status) in self._reported:
            return
        self._reported.add((term.name, out.status))
        if out.status == "error":
            log.warning("reward %r raised; its rows score 0 (later errors are only counted):\n%s", term.name, out.error)
        else:
            log.warning("reward %r took longer than its timeout (%ss, reward_pool.timeout or the entry's timeout); "
                        "its rows score 0 (later timeouts are only counted)", term.name, term.timeout)

    def failure_report(self, name: str) -> str:
        """The first error of source ``name`` and a guess at the fix."""
        term = next(t for t in self.terms if t.name == name)
        error = self.first_error.get(name, "")
        style = getattr(term, "style", "trl")
        return f"{error.rstrip()}\nfix: {fix_hint(error, style, self.columns)}"

    def pop_metrics(self) -> dict[str, float]:
        """Per source since the last call, summed over ranks (latency: the slowest rank's); collective."""
        import torch

        from grpo.foundation import dist

        keys = [(name, kind) for name in self.counts for kind in COUNTS]
        summed = dist.all_reduce_sum(torch.tensor([float(self.counts[n][k]) for n, k in keys], dtype=torch.float64))
        names = list(self.seconds)
        slowest = dist.all_reduce_max(torch.tensor([self.seconds[n] for n in names] or [0.0], dtype=torch.float64))
        out = {f"reward/{n}/{k}": float(v) for (n, k), v in zip(keys, summed) if k != "rows"}
        rows = {n: float(v) for (n, k), v in zip(keys, summed) if k == "rows"}
        for n in self.counts:
            failed = out[f"reward/{n}/errors"] + out[f"reward/{n}/timeouts"]
            out[f"reward/{n}/failed_frac"] = failed / rows[n] if rows[n] else 0.0
        for i, n in enumerate(names):
            out[f"reward/{n}/latency"] = float(slowest[i])
        extra = [(n, k) for n in self.extra for k in self.extra[n]]
        if extra:
            sums = dist.all_reduce_sum(torch.tensor([self.extra[n][k] for n, k in extra], dtype=torch.float64))
            out.update({f"reward/{n}/{k}": float(v) for (n, k), v in zip(extra, sums)})
            self.extra = {n: dict.fromkeys(ks, 0.0) for n, ks in self.extra.items()}
        kills = self.pool.pop_kills()
        killed = dist.all_reduce_sum(torch.tensor([float(kills[k]) for k in sorted(kills)], dtype=torch.float64))
        out.update({f"reward_pool/killed_{k}": float(v) for k, v in zip(sorted(kills), killed)})
        for term in self.terms:
            out.update(term.pop_metrics() if hasattr(term, "pop_metrics") else {})
        self.counts = {n: dict.fromkeys(COUNTS, 0) for n in self.counts}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out

    def model_seconds(self) -> float:
        """Seconds spent in reward models since the last ``pop_metrics`` (this rank)."""
        return sum(self.seconds[t.name] for t in self.terms if t.kind == "model")

    def close(self) -> None:
        self.pool.close()
        for t in self.terms:
            if hasattr(t, "close"):
                t.close()
