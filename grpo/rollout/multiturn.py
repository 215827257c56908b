"""Multi-turn rollouts: the policy and an environment take turns on one token sequence.

Per trajectory (one environment per row, made from its dataset row)::

    prompt   = chat template of env.reset(row) (+ data.prefill)       generation prompt included
    repeat:  the policy writes one turn (until EOS, a stop string, its per-turn limit or the budget)
             env.step(turn text) -> observation, step reward, done
             the observation is appended with the chat template's roles, and the policy goes on
             from the end of the same sequence

Every turn is one call of the rollout service on every rank (the first ``generate`` shares each
group's prompt prefill; later ones ``continue_sequences``), so ZeRO-3's collective generation holds:
the loop runs while any rank has a trajectory going (``collective_rounds``).

The batch: the completion is every token after the prompt, policy and environment tokens
interleaved; ``mask`` is 1 on the policy's tokens only (observation tokens are out of the loss, the
KL and the entropy); ``turns`` holds each turn's columns, step reward and state (the observation
it was taken in); ``rewards`` is the sum of the step rewards and ``reward_terms`` the environment's
named terms (``env.reward_terms()`` when it has it, else ``{"env": return}``).

Limits: at most ``rollout.max_turns`` policy turns (a trajectory still going then is a step-limit
hit), each at most ``rollout.max_completion_length`` tokens, and at most
``rollout.max_trajectory_tokens`` tokens after the prompt in all, policy and environment together
(the batch's width L_max; an observation that does not fit ends the trajectory: a budget hit).
Both kinds of end set ``truncated``.

Prefix reuse: the ``hf`` engine keeps each row's KV cache from one turn to the next
(``grpo.rollout.hf.PrefixStore``) and prefills only the previous turn's last token and the
observation (``rollout/prefill_tokens`` and ``rollout/reused_tokens`` count them); decoding never
re-runs the prefix. Training log-probs are computed on the whole sequence at once (exactly the naive
recomputation; tests/test_multiturn.py).

Environments and their tools are the caller's (the trainer builds them from ``env``; envs/):
anything with ``reset(row) -> observation`` and ``step(action_text) -> StepResult``. An exception in
``reset`` or ``step`` ends that trajectory (counted as ``env/errors``), never the run.
"""

from __future__ import annotations

import math
import os
import threading
import time
import traceback
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

import torch

from grpo.foundation import dist
from grpo.foundation.batch import RolloutBatch, Turn
from grpo.foundation.config import ConfigError
from grpo.foundation.modeling import max_token_chars
from grpo.rollout.engine import completion_mask

log = logging.getLogger("multiturn")

Observation = Union[str, dict, list]  # text (a user message), one message, or several messages


@dataclass
class StepResult:
    """What ``env.step`` returns. ``observation`` is ignored when ``done``.

    ``info`` may hold ``invalid: True`` (the action could not be parsed: counted as an invalid action)."""

    observation: Optional[Observation] = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def _number(x: Any) -> Optional[float]:
    """``x`` as a finite float, or None (a string like "1.0", None, nan and inf are not rewards)."""
    if isinstance(x, str) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def observation_problem(obs: Any) -> Optional[str]:
    """Why ``obs`` is not an observation (text, or chat messages with a role and content), or None."""
    if isinstance(obs, str):
        return None
    if isinstance(obs, list) and obs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and "content" in m for m in obs):
        return None
    return f"{repr(obs)[:80]}, not text or chat messages"


def observation_chars(obs: Any) -> int:
    """The characters of an observation's text (its messages' contents)."""
    if isinstance(obs, str):
        return len(obs)
    if isinstance(obs, dict):  # one message
        obs = [obs]
    if isinstance(obs, list):
        return sum(len(str(m.get("content", ""))) for m in obs if isinstance(m, dict))
    return 0


def step_problem(res: Any) -> Optional[str]:
    """Why what ``env.step`` returned cannot be used (None: it can)."""
    if not isinstance(res, StepResult):
        return f"a {type(res).__name__}, not a StepResult"
    if _number(res.reward) is None:
        return f"reward={repr(res.reward)[:80]}, not a finite number"
    if not isinstance(res.info, dict):
        return f"info={repr(res.info)[:80]}, not a dict"
    return None


def terms_problem(terms: Any) -> Optional[str]:
    """Why what ``reward_terms()`` returned cannot be used (None: it can)."""
    if not isinstance(terms, dict):
        return f"a {type(terms).__name__}, not a dict of names to numbers"
    for k, v in terms.items():
        if not isinstance(k, str) or _number(v) is None:
            return f"{k!r}: {repr(v)[:80]}, not a finite number"
    return None


class Action(str):
    """The text of a policy turn (EOS removed), as ``env.step`` gets it; ``truncated`` is true when the
    turn ended at its token limit (no EOS, no stop string): an environment may treat it as malformed."""

    truncated: bool = False

    @classmethod
    def of(cls, text: str, truncated: bool) -> "Action":
        a = cls(text)
        a.truncated = truncated
        return a


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> Observation: ...

    def step(self, action: str) -> StepResult: ...


def messages_of(obs: Observation, role: str = "user") -> list[dict[str, str]]:
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    if isinstance(obs, dict):
        return [obs]
    return list(obs)


def state_key(obs: Observation) -> str:
    """The exact-match key of an observation (GiGPO's anchor states): its text, roles included."""
    return "\x1e".join(f"{m.get('role', '')}\x1f{m.get('content', '')}" for m in messages_of(obs))


class ChatRenderer:
    """Observations as tokens, with the tokenizer's chat template (the roles and separators it writes).

    The first observation renders as the prompt (system prompt, generation prompt, prefill). A later
    one renders as what the template writes after an assistant message and before the next
    assistant turn: ``template(history + [assistant X, obs], gen prompt)`` minus ``template(history +
    [assistant X])``, preceded by the template's end of the assistant message (less the EOS the policy
    wrote itself when its turn ended with it).
    """

    _X = "\u2063\u2063"  # placeholder content of the assistant message

    def __init__(self, tokenizer, eos_ids: list[int], system_prompt: Optional[str] = None, prefill: str = "",
                 template_kwargs: Optional[dict] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"multi-turn rollouts need a tokenizer with a chat template (the roles of the turns), and "
                              f"{getattr(tokenizer, 'name_or_path', '?')!r}'s has none (a base model's): give one with "
                              f"data.chat_template (a Jinja template or its file)")
        self.tok, self.system, self.prefill = tokenizer, system_prompt, prefill or ""
        self.template_kwargs = dict(template_kwargs or {})  # data.chat_template_kwargs: every rendering gets them
        self.eos_texts = [tokenizer.decode([e]) for e in eos_ids]
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._X}]
        base = tokenizer.apply_chat_template(probe, tokenize=False, **self.template_kwargs)
        self._base_len = len(base)
        self._probe = probe
        self.assistant_tail = base[base.rindex(self._X) + len(self._X):]  # e.g. "<|im_end|>\n" or "\n"
        self._check_prefix_stable(base)

    def _check_prefix_stable(self, base: str) -> None:
        """:meth:`later` cuts each observation out of the whole conversation rendered after the conversation so
        far, which is right only if a later message leaves the earlier ones' text as it was. Some templates do
        not (Qwen3's writes an empty think block into the last assistant message only, so every later turn lost
        the start of its observation): refused here, before any rollout, rather than trained on broken text."""
        for role in ("user", "tool"):
            try:
                full = self._template(self._probe + [{"role": role, "content": "o"}], True)
            except Exception:  # noqa: BLE001 - a template without this role: observations of it fail on their own
                continue
            if not full.startswith(base):
                k = next((i for i, (a, b) in enumerate(zip(base, full)) if a != b), min(len(base), len(full)))
                raise ConfigError(
                    f"the tokenizer's chat template is not prefix-stable: adding a {role} message after an assistant "
                    f"turn changes the earlier text ({base[max(0, k - 20):k + 20]!r} becomes "
                    f"{full[max(0, k - 20):k + 20]!r}), so multi-turn observations would be cut from the wrong place. "
                    f"Give data.chat_template a template that renders earlier messages the same whatever follows "
                    f"(a string or a .jinja file)")

    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                            **self.template_kwargs)

    _SLOT = "\u2064{}\u2064"  # where an observation's content goes while its template text is tokenized

    def _guarded(self, messages: list[dict]) -> tuple[list[dict], list[str]]:
        """``messages`` with each content that spells a special token (a tool answer forging ``<|im_end|>``
        and a system turn) replaced by a slot, and those contents; nothing replaced when none does."""
        specials = [t for t in self.tok.all_special_tokens + list(self.tok.get_added_vocab()) if t]
        out, contents = [], []
        for m in messages:
            c = m.get("content")
            if isinstance(c, str) and any(t in c for t in specials):
                out.append({**m, "content": self._SLOT.format(len(contents))})
                contents.append(c)
            else:
                out.append(m)
        return out, contents

    def _encode(self, text: str, contents: list[str]) -> list[int]:
        """``text`` as tokens, where its template's own markers are special tokens and the contents put back into
        its slots are plain text, whatever they spell (issue 30, item 19)."""
        if not contents:
            return self.tok(text, add_special_tokens=False).input_ids
        ids: list[int] = []
        for k, content in enumerate(contents):
            before, text = text.split(self._SLOT.format(k), 1)
            ids += self.tok(before, add_special_tokens=False).input_ids
            ids += self.tok(content, add_special_tokens=False, split_special_tokens=True).input_ids
        return ids + self.tok(text, add_special_tokens=False).input_ids

    def first(self, obs: Observation) -> list[int]:
        messages, contents = self._guarded(messages_of(obs))
        if self.system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system}] + messages
        return self._encode(self._template(messages, True) + self.prefill, contents)

    def later(self, obs: Observation, ended_with_eos: bool) -> list[int]:
        messages, contents = self._guarded(messages_of(obs))
        full = self._template(self._probe + messages, True)
        tail = self.assistant_tail
        if ended_with_eos:
            for e in self.eos_texts:
                if tail.startswith(e):
                    tail = tail[len(e):]
                    break
        return self._encode(tail + full[self._base_len:], contents)


@dataclass
class _Trajectory:
    env: Any
    prompt: list[int]
    state: str  # the observation the next action is taken in
    tokens: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)  # 1 per policy token, 0 per environment token
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    failed: bool = False  # its environment raised or returned a bad value: no score of it counts


class CallWatchdog:
    """One thread of the process that logs a warning for each watched call still running past its limit (once).

    ``watch`` and ``done`` are a dict insert and pop under a lock: an environment call costs no thread start (a
    ``threading.Timer`` per call did, three calls per trajectory turn). The thread sleeps until the earliest
    deadline, or until a call is watched while none is."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has no thread: it starts its own

    def _reset(self) -> None:
        self._calls: dict[int, tuple[float, tuple]] = {}  # key -> (deadline, log.warning's arguments)
        self._cond = threading.Condition()
        self._next = 0
        self._wake_at = math.inf  # the deadline the thread sleeps until (inf: none watched)
        self._thread: Optional[threading.Thread] = None

    def watch(self, seconds: float, message: tuple) -> int:
        deadline = time.monotonic() + seconds
        with self._cond:
            key, self._next = self._next, self._next + 1
            self._calls[key] = (deadline, message)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="env-watchdog", daemon=True)
                self._thread.start()
            elif deadline < self._wake_at:
                self._cond.notify()
        return key

    def done(self, key: int) -> None:
        with self._cond:
            self._calls.pop(key, None)

    def _run(self) -> None:
        while True:
            late = []
            with self._cond:
                now = time.monotonic()
                for key in [k for k, (d, _) in self._calls.items() if d <= now]:
                    late.append(self._calls.pop(key)[1])
                if not late:
                    self._wake_at = min((d for d, _ in self._calls.values()), default=math.inf)
                    self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    self._wake_at = -math.inf  # awake: a new call need not wake it
            for message in late:
                log.warning(*message)


WATCHDOG = CallWatchdog()


class MultiTurnRollout:
    """Drives the rollout service turn by turn; ``rollout`` returns the step's scored :class:`RolloutBatch`."""

    COUNTERS = ("trajectories", "turns", "invalid_actions", "step_limit_hits", "budget_hits", "env_errors")

    def __init__(self, service, make_env: Callable[[dict], Any], max_turns: int, max_trajectory_tokens: int,
                 stop: Optional[list[str]] = None, system_prompt: Optional[str] = None, prefill: str = "",
                 tool_counts: Optional[Callable[[], dict[str, float]]] = None, watchdog_s: float = 0.0,
                 max_prompt_length: int = 0, env_threads: int = 1, template_kwargs: Optional[dict] = None):
        self.service, self.make_env = service, make_env
        self.max_turns, self.budget = max_turns, max_trajectory_tokens
        self.stop = list(stop or [])
        self.prefill = prefill or ""
        self.render = ChatRenderer(service.tokenizer, service.eos_ids, system_prompt, prefill, template_kwargs)
        self.tool_counts = tool_counts  # () -> {"tool_calls": n, "tool_errors": n, "tool_timeouts": n, "tool_killed": n} since last call
        self.counts = {k: 0.0 for k in self.COUNTERS}
        self.env_time = 0.0
        self._reported_error = False
        self._reported_bad: set[str] = set()
        self.watchdog_s = watchdog_s  # 0: no watchdog
        self.max_prompt_length = max_prompt_length  # the rendered first observation's limit (0: none)
        self.max_token_chars = max_token_chars(service.tokenizer)
        # a turn's environments step in up to this many threads (env.tool_workers: their tool calls then run in
        # that many workers at once); everything else of a turn stays on this thread, in trajectory order
        self.env_threads = max(1, env_threads)
        self._lock = threading.Lock()  # the error counters, which environment threads update

    # ----------------------------------------------------------------- pieces
    def _cut_at_stop(self, toks: list[int]) -> tuple[list[int], bool]:
        """The turn up to and including the first token that completes a stop string (stopped?)."""
        if not self.stop:
            return toks, False
        tok = self.service.tokenizer

        def has_stop(k: int) -> bool:
            text = tok.decode(toks[:k])
            return any(s in text for s in self.stop)

        # One decode of the whole turn (most turns hold no stop string), then a binary search for the first
        # prefix that holds one: O(n log n) tokens decoded, not the O(n^2) of decoding every prefix (a
        # 2048-token turn cost ~60x a 256-token one; issue 30, item 21). A prefix holding a stop string is
        # the start of every longer prefix's text, so "holds one" only turns on once.
        if not toks or not has_stop(len(toks)):
            return toks, False
        lo, hi = 1, len(toks)  # has_stop(hi) holds; find the smallest such k
        while lo < hi:
            mid = (lo + hi) // 2
            if has_stop(mid):
                hi = mid
            else:
                lo = mid + 1
        return toks[:lo], True

    def _env_call(self, fn: Callable, *args, timed: bool = True) -> tuple[Any, bool]:
        t0 = time.perf_counter()
        # an environment runs in this process and cannot be interrupted: a blocking one hangs every rank, so a
        # watchdog names it (once per call, after watchdog_s) while it blocks
        key = None
        if self.watchdog_s:
            name = getattr(fn, "__qualname__", repr(fn))
            key = WATCHDOG.watch(self.watchdog_s, (
                "%s has been running for %g s on rank %d (env.watchdog_s): an environment runs in the trainer and "
                "cannot be interrupted, so every rank waits for it", name, self.watchdog_s, dist.rank()))
        try:
            return fn(*args), True
        except Exception:  # noqa: BLE001 - an environment's failure costs its trajectory, not the run
            with self._lock:
                self.counts["env_errors"] += 1
                first, self._reported_error = not self._reported_error, True
            if first:
                log.warning("an environment raised; its trajectory ends (later errors are only counted):\n%s",
                            traceback.format_exc())
            return None, False
        finally:
            if key is not None:
                WATCHDOG.done(key)
            if timed:
                self.env_time += time.perf_counter() - t0

    def _end(self, tr: _Trajectory, truncated: bool = False) -> None:
        tr.done, tr.truncated = True, truncated

    def _take_turns(self, turns: list[tuple[_Trajectory, list[int]]], first: bool) -> None:
        """Each trajectory's policy turn: append it, step its environment (the steps of the turn concurrently,
        see ``env_threads``), append the observation (or end)."""
        policy = [self._policy_turn(tr, new, first) for tr, new in turns]
        results = self._step_envs([(tr.env, action) for (tr, _), (_, _, action) in zip(turns, policy)])
        for (tr, _), (new, start, _), (res, ok) in zip(turns, policy, results):
            self._after_step(tr, new, start, res, ok)

    def _policy_turn(self, tr: _Trajectory, new: list[int], first: bool) -> tuple[list[int], int, Action]:
        """Append the policy's turn (cut after a stop string): the turn's tokens, where they start, the action."""
        eos = set(self.service.eos_ids)
        new, stopped = self._cut_at_stop(new)
        start = len(tr.tokens)
        tr.tokens += new
        tr.policy += [1] * len(new)
        self.counts["turns"] += 1
        body = new[:-1] if new and new[-1] in eos else new
        action = self.service.tokenizer.decode(body)
        if first:
            action = self.prefill + action
        ended = stopped or (bool(new) and new[-1] in eos)
        return new, start, Action.of(action, truncated=not ended)

    def _step_envs(self, steps: list[tuple[Any, Action]]) -> list[tuple[Any, bool]]:
        """``env.step(action)`` of each pair, in up to ``env_threads`` threads; results in the given order."""
        if self.env_threads == 1 or len(steps) < 2:
            return [self._env_call(env.step, action) for env, action in steps]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(min(self.env_threads, len(steps)), thread_name_prefix="env-step") as pool:
            out = list(pool.map(lambda s: self._env_call(s[0].step, s[1], timed=False), steps))
        self.env_time += time.perf_counter() - t0
        return out

    def _after_step(self, tr: _Trajectory, new: list[int], start: int, res: Any, ok: bool) -> None:
        """The environment's answer to the turn ``new``: the turn recorded, the observation appended (or end)."""
        eos = set(self.service.eos_ids)
        if ok and (problem := step_problem(res)) is not None:
            res, ok = self._bad_value(tr.env, "step", problem)
        reward = float(res.reward) if ok else 0.0
        if ok and res.info.get("invalid"):
            self.counts["invalid_actions"] += 1
        turn = dict(start=start, end=len(tr.tokens), reward=reward, state=tr.state)
        tr.failed = not ok
        if not ok or res.done:
            tr.turns.append(Turn(obs_end=len(tr.tokens), **turn))
            return self._end(tr)
        if len(tr.turns) + 1 >= self.max_turns:
            tr.turns.append(Turn(obs_end=len(tr.tokens), **turn))
            self.counts["step_limit_hits"] += 1
            return self._end(tr, truncated=True)
        if observation_chars(res.observation) > (self.budget - len(tr.tokens)) * self.max_token_chars:
            tr.turns.append(Turn(obs_end=len(tr.tokens), **turn))  # surely past the budget: not tokenized
            self.counts["budget_hits"] += 1  # (a 16 MiB observation cost ~15 s and 2.7 GB per trajectory)
            return self._end(tr, truncated=True)
        obs, ok = self._env_call(self.render.later, res.observation, bool(new) and new[-1] in eos)
        if not ok:
            tr.failed = True
            tr.turns.append(Turn(obs_end=len(tr.tokens), **turn))
            return self._end(tr)
        if len(tr.tokens) + len(obs) + 1 > self.budget:  # room for the observation and >= 1 policy token
            tr.turns.append(Turn(obs_end=len(tr.tokens), **turn))
            self.counts["budget_hits"] += 1
            return self._end(tr, truncated=True)
        tr.tokens += obs
        tr.policy += [0] * len(obs)
        tr.turns.append(Turn(obs_end=len(tr.tokens), **turn))
        tr.state = state_key(res.observation)

    def _bad_value(self, env: Any, method: str, problem: str) -> tuple[None, bool]:
        """A value an environment returned that cannot be used: like an exception there, it ends that
        trajectory (counted in env/errors); the environment, the method and the value are named once."""
        self.counts["env_errors"] += 1
        where = f"{type(env).__name__}.{method}"
        if where not in self._reported_bad:
            self._reported_bad.add(where)
            log.warning("%s returned %s; its trajectory ends (later ones are only counted in env/errors)",
                        where, problem)
        return None, False

    # ----------------------------------------------------------------- the loop
    def rollout(self, prompts: list[list[int]], items: list[dict[str, Any]], prompt_index: list[int],
                n: Optional[int] = None) -> RolloutBatch:
        """G trajectories for each dataset row (``prompts`` is not used: the prompt is the environment's
        first observation). Collective under ZeRO-3: call it on every rank."""
        svc = self.service
        G = svc.cfg.num_generations if n is None else n
        rows = [i for i in range(len(items)) for _ in range(G)]
        trs: list[_Trajectory] = []
        for i in rows:
            env, ok = self._env_call(self.make_env, items[i])
            obs, ok = self._env_call(env.reset, items[i]) if ok else (None, False)
            if ok and (problem := observation_problem(obs)) is not None:
                obs, ok = self._bad_value(env, "reset", problem)
            limit = self.max_prompt_length
            huge = ok and limit and observation_chars(obs) > limit * self.max_token_chars  # not worth tokenizing
            prompt = self.render.first(obs) if ok and not huge else []
            if ok and limit and (huge or len(prompt) > limit):  # held to the limit of a dataset prompt
                size = f"{observation_chars(obs)} characters" if huge else f"{len(prompt)} tokens"
                obs, ok = self._bad_value(env, "reset", f"a first prompt of {size}, over "
                                                        f"rollout.max_prompt_length={limit}")
            if not ok:  # the trajectory cannot start: an empty one (no tokens, no turns, reward 0)
                shown = items[i].get("prompt", "")  # the row's own prompt, when it is one within the limit
                fits = observation_problem(shown) is None and (
                    not limit or observation_chars(shown) <= limit * self.max_token_chars)
                shown_ids = self.render.first(shown if fits else "")
                if limit and len(shown_ids) > limit:
                    shown_ids = self.render.first("")
                trs.append(_Trajectory(env=None, prompt=shown_ids, state="",
                                       done=True))
                continue
            trs.append(_Trajectory(env=env, prompt=prompt, state=state_key(obs)))
        self.counts["trajectories"] += len(trs)
        per_turn = svc.cfg.max_completion_length

        # turn 1: one prefill per group where its G prompts are equal (they are, for deterministic resets)
        params = svc.params
        shared = all(len({tuple(trs[g * G + j].prompt) for j in range(G)}) == 1 for g in range(len(items)))
        first_room = min(per_turn, self.budget)
        import dataclasses

        if shared:
            comp = svc.generate([trs[g * G].prompt for g in range(len(items))],
                                dataclasses.replace(params, max_tokens=first_room), n=G)
            firsts = comp.tokens
        else:
            firsts = [t for t, _ in svc.continue_sequences([tr.prompt for tr in trs], [[] for _ in trs],
                                                           [first_room] * len(trs))]
        self._take_turns([(tr, toks) for tr, toks in zip(trs, firsts) if not tr.done], first=True)
        while True:
            active = [tr for tr in trs if not tr.done]
            if not svc.collective_rounds(1 if active else 0):
                break
            room = [min(per_turn, self.budget - len(tr.tokens)) for tr in active]
            outs = svc.continue_sequences([tr.prompt for tr in active], [tr.tokens for tr in active], room)
            self._take_turns([(tr, toks) for tr, (toks, _) in zip(active, outs)], first=False)
        svc.timings["env"] = svc.timings.get("env", 0.0) + self.env_time
        self.env_time = 0.0
        return self._batch(trs, items, prompt_index, rows, G)

    def _batch(self, trs: list[_Trajectory], items, prompt_index, rows, G) -> RolloutBatch:
        svc, W = self.service, self.budget
        mask = completion_mask([0] * len(trs), W)
        for r, tr in enumerate(trs):
            mask[r, : len(tr.policy)] = torch.tensor(tr.policy, dtype=mask.dtype)
        rewards = [sum(t.reward for t in tr.turns) for tr in trs]
        terms: list[dict[str, float]] = []
        for r, (tr, ret) in enumerate(zip(trs, rewards)):
            got = getattr(tr.env, "reward_terms", None) if tr.env is not None and not tr.failed else None
            value, ok = self._env_call(got) if callable(got) else ({"env": ret}, not tr.failed)
            if ok and (problem := terms_problem(value)) is not None:
                value, ok = self._bad_value(tr.env, "reward_terms", problem)
            if not ok:  # the trajectory's scores cannot be trusted: none of them counts
                rewards[r] = 0.0
            terms.append({k: float(v) for k, v in value.items()} if ok else {})
        names = sorted({k for t in terms for k in t}) or ["env"]
        tok = svc.tokenizer
        return RolloutBatch(
            prompt_ids=[tr.prompt for tr in trs],
            completion_ids=[tr.tokens for tr in trs],
            mask=mask,
            truncated=torch.tensor([tr.truncated for tr in trs], dtype=torch.bool),
            group_size=G,
            prompt_index=[prompt_index[i] for i in rows],
            items=[items[i] for i in rows],
            prompt_text=tok.batch_decode([tr.prompt for tr in trs], skip_special_tokens=False),
            completion_text=tok.batch_decode([tr.tokens for tr in trs], skip_special_tokens=False),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            reward_terms={k: torch.tensor([float(t.get(k, 0.0)) for t in terms], dtype=torch.float32)
                          for k in names},
            turns=[tr.turns for tr in trs],
        )

    # ----------------------------------------------------------------- metrics
    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call, summed over ranks (collective: every rank calls it)."""
        tools = self.tool_counts() if self.tool_counts is not None else {}
        keys = list(self.COUNTERS) + ["tool_calls", "tool_errors", "tool_timeouts", "tool_killed"]
        local = torch.tensor([float(self.counts.get(k, tools.get(k, 0.0))) for k in keys], dtype=torch.float64)
        s = dict(zip(keys, dist.all_reduce_sum(local).tolist()))
        self.counts = {k: 0.0 for k in self.COUNTERS}
        n = max(s["trajectories"], 1.0)
        return {
            "env/turns_mean": s["turns"] / n,
            "env/tool_calls": s["tool_calls"], "env/tool_errors": s["tool_errors"] + s["tool_timeouts"],
            "env/tool_timeouts": s["tool_timeouts"], "env/tool_killed": s["tool_killed"],
            "env/invalid_actions": s["invalid_actions"], "env/invalid_per_trajectory": s["invalid_actions"] / n,
            "env/step_limit_frac": s["step_limit_hits"] / n, "env/budget_frac": s["budget_hits"] / n,
            "env/errors": s["env_errors"],
        }
