#!/usr/bin/env python
"""Streaming rollouts against a step at a time (issue 56): decode slot occupancy and generated tokens per decode step,
counted by the static (or hf) engine, at EOS lengths like a reasoning run's (bench.py's reasoning_lengths: 10% at the cap).

    python scripts/benchmarks/bench_stream.py                                 # a narrow random Llama, cap 64, CPU
    python scripts/benchmarks/bench_stream.py --cap 256 --runs 1:64:1,2:32:1 --out runs/stream.json
    python scripts/benchmarks/bench_stream.py --engine hf --cap 256 --runs 1:0:1,1:64:1,2:64:1   # the hf engine
    python scripts/benchmarks/bench_stream.py --cap 256 --runs 1:64:1 --reward-ms 5   # rewards while others decode
    python scripts/benchmarks/bench_stream.py --engine hf --cap 256 --runs 1:64:1 --carried-kv keep   # kept caches

Each decode step reads every weight once whatever the number of live rows, so tokens per decode step is the time per
token on a GPU; a CPU decodes compute-bound, so its wall time is reported but says little. ``today``: each step's
groups x G rows generated in one call (rollout.slots 0, the trainer's K = 0 path); each ``--runs`` entry K:SLOTS:CHECK
is grpo/rollout/stream.py's Stream with max_staleness K over rollout.slots SLOTS, the host reading finished rows every
CHECK steps. The first step of each side fills its pipeline and is left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import reasoning_lengths  # noqa: E402


def engine_for(model, eos: int, *overrides: str, kind: str = "static"):
    """The static engine, or the hf engine (``kind``; it keeps the sampler's log-probs as a streamed run's does)."""
    from grpo.rollout import static
    from grpo.rollout.engine import EngineSetup
    from grpo.rollout.hf import HFEngine
    from grpo.training.configure import load_config

    cfg = load_config(None, "grpo", [f"rollout.engine={kind}", "algo.tis_cap=2.0",
                                     *(o for o in overrides if kind == "static" or not o.startswith("rollout.static."))])
    setup = EngineSetup(cfg=cfg, model=model, tokenizer=None, eos_ids=[eos], pad_id=0)
    return static.StaticEngine(setup) if kind == "static" else HFEngine(setup)


def measure(model, eos: int, prompts: list[list[int]], groups: int, G: int, cap: int, steps: int,
            runs: list[tuple[int, int, int]], today_check: int = 16, seed: int = 0,
            sync: Callable[[], None] = lambda: None, kind: str = "static", carried_kv: str = "prefill") -> dict:
    """{"today": figures, "K=..,slots=..,check=..": figures, "lengths": the recorded distribution}: per side the
    decoded tokens, decode steps, slot-steps (their ratio: occupancy), tokens per decode step, wall seconds, and for
    the streams the staleness, the groups drawn again, the carried tokens sent again and the positions served from
    kept caches. ``kind``: the engine (static or hf; both take SLOTS); ``carried_kv``: the streams' rollout.carried_kv
    (keep: hf only)."""
    from grpo.rollout.engine import SamplingParams
    from grpo.rollout.stream import Stream

    drawn = reasoning_lengths(groups * G * (steps + 1) * 4, cap, seed)
    lengths = tuple(drawn["lengths"])
    params = SamplingParams(max_tokens=cap, temperature=1.0, forced_eos_lengths=lengths)
    out = {"lengths": {k: v for k, v in drawn.items() if k != "lengths"}, "groups": groups, "G": G, "cap": cap,
           "steps": steps}

    def tally(engine, into: dict, seconds: float) -> None:
        m = engine.pop_metrics()
        if m.get("rollout/decode_steps"):
            into["decoded_tokens"] += m["rollout/decoded_tokens"]
            into["decode_steps"] += m["rollout/decode_steps"]
            into["slot_steps"] += m["rollout/decoded_tokens"] / m["rollout/occupancy"]
        into["kept_tokens"] = into.get("kept_tokens", 0.0) + m.get("rollout/kept_tokens", 0.0)
        into["prefill_s"] += engine.pop_timings().get("generation_prefill", 0.0)  # the decode time split
        into["seconds"] += seconds

    def finish(into: dict) -> dict:
        into["occupancy"] = into["decoded_tokens"] / max(1.0, into["slot_steps"])
        into["tokens_per_decode_step"] = into["decoded_tokens"] / max(1.0, into["decode_steps"])
        return into

    engine = engine_for(model, eos, f"rollout.static.check_every={today_check}", kind=kind)
    today = dict(decoded_tokens=0.0, decode_steps=0.0, slot_steps=0.0, prefill_s=0.0, seconds=0.0)
    for s in range(steps + 1):
        batch = [prompts[(s * groups + g) % len(prompts)] for g in range(groups)]
        at = lengths[s * groups * G: (s + 1) * groups * G]
        sync()
        t0 = time.perf_counter()
        engine.generate(batch, dataclasses.replace(params, forced_eos_lengths=at), G)
        sync()
        tally(engine, today if s else dict(today), time.perf_counter() - t0)
    out["today"] = finish(today)

    for K, slots, check in runs:
        counter = itertools.count()

        def feed(n):
            return [(prompts[i % len(prompts)], i) for i in (next(counter) for _ in range(n))]

        engine = engine_for(model, eos, f"rollout.static.check_every={check}", f"rollout.slots={slots}",
                            f"rollout.max_staleness={K}", f"rollout.carried_kv={carried_kv}", kind=kind)
        stream = Stream(engine, params, group_size=G, groups_per_step=groups, max_staleness=K, feed=feed)
        res = dict(decoded_tokens=0.0, decode_steps=0.0, slot_steps=0.0, prefill_s=0.0, seconds=0.0, staleness_max=0.0,
                   staleness_mean=0.0, regenerated=0.0, refed_tokens=0.0, handed_out=0)
        for version in range(steps + 1):
            sync()
            t0 = time.perf_counter()
            taken = stream.next(version)
            sync()
            secs = time.perf_counter() - t0
            m = stream.pop_metrics(taken, version)
            if not version:
                engine.pop_metrics(), engine.pop_timings()
                continue
            tally(engine, res, secs)
            res["staleness_max"] = max(res["staleness_max"], m["rollout/staleness_max"])
            res["staleness_mean"] += m["rollout/staleness_mean"] / steps
            res["regenerated"] += m["rollout/regenerated"]
            res["refed_tokens"] += m["rollout/refed_tokens"]
            res["handed_out"] += len(taken)
        out[f"K={K},slots={slots},check={check}"] = finish(res)
    return out


class _Texts:
    """batch_decode for the random model's ids (the rewards below read no text)."""

    @staticmethod
    def batch_decode(ids, **_):
        return [" ".join(map(str, x)) for x in ids]


def measure_rewards(model, eos: int, prompts: list[list[int]], groups: int, G: int, cap: int, steps: int,
                    run: tuple[int, int, int], reward_ms: float, kind: str = "static") -> dict:
    """A streamed step through the rollout service with a reward that sleeps ``reward_ms`` a row plus 10 ms a call:
    each group scored as it becomes whole, while the others decode (the service's way), against every group scored
    after the decode (stream.next, then rollout_groups). Per side: the steps' wall seconds and the wait for rewards
    after the decode (``time/reward``)."""
    from grpo.rollout.engine import SamplingParams
    from grpo.rollout.service import RolloutService
    from grpo.rollout.stream import Stream

    K, slots, check = run
    lengths = tuple(reasoning_lengths(groups * G * (steps + 1) * 4, cap, 0)["lengths"])
    params = SamplingParams(max_tokens=cap, temperature=1.0, forced_eos_lengths=lengths)

    def scorer(texts, completions, columns, raw_prompts=None, completion_ids=None):
        time.sleep(0.010 + reward_ms / 1000 * len(completions))
        return [1.0] * len(completions), {"sleep": [1.0] * len(completions)}

    out = {"reward": f"{reward_ms} ms a row + 10 ms a call", "run": f"K={K},slots={slots},check={check}"}
    for side in ("scored_as_whole", "scored_at_end"):
        engine = engine_for(model, eos, f"rollout.static.check_every={check}", f"rollout.slots={slots}", kind=kind)
        engine.setup = dataclasses.replace(engine.setup, tokenizer=_Texts())
        service = RolloutService(engine.setup, scorer, engine=engine)
        service.cfg = dataclasses.replace(service.cfg, num_generations=G)
        counter = itertools.count()

        def feed(n):
            return [(prompts[i % len(prompts)], i) for i in (next(counter) for _ in range(n))]

        stream = Stream(engine, params, group_size=G, groups_per_step=groups, max_staleness=K, feed=feed)
        res = {"seconds": 0.0, "reward_wait": 0.0}
        for version in range(steps + 1):
            t0 = time.perf_counter()
            if side == "scored_as_whole":
                service.rollout_stream(stream, version, lambda i: {"prompt": ""})
            else:
                taken = stream.next(version)
                service.rollout_groups(taken, [{"prompt": ""} for _ in taken], version)
            secs = time.perf_counter() - t0
            waited = service.pop_timings().get("reward", 0.0)
            if version:
                res["seconds"] += secs
                res["reward_wait"] += waited
        service.close()
        out[side] = res
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) a step")
    p.add_argument("--G", type=int, default=8, help="rows a group")
    p.add_argument("--cap", type=int, default=64, help="max completion tokens")
    p.add_argument("--steps", type=int, default=6, help="measured steps a side (after one that fills the pipeline)")
    p.add_argument("--runs", default="1:64:1,1:32:1,2:32:1", help="K:SLOTS:CHECK, comma-separated")
    p.add_argument("--today-check", type=int, default=16, help="rollout.static.check_every of the step-at-a-time side")
    p.add_argument("--engine", choices=["static", "hf"], default="static",
                   help="the engine (SLOTS 0: every row of a call at once)")
    p.add_argument("--reward-ms", type=float, default=None,
                   help="also time the first --runs entry through the rollout service with a reward that sleeps this "
                        "many ms a row (+10 ms a call): groups scored as they become whole against after the decode")
    p.add_argument("--carried-kv", choices=["prefill", "keep"], default="prefill",
                   help="the streams' rollout.carried_kv (keep: --engine hf)")
    p.add_argument("--out", help="a JSON file for the figures")
    args = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # SmolLM2's vocabulary, so that a random model almost never draws EOS before its recorded
    # length (a small vocabulary's would cut the recorded lengths short); 2 narrow layers: the counts do not depend
    # on the width
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, model.config.vocab_size, (40,), generator=g).tolist() for _ in range(64)]
    runs = [tuple(int(x) for x in r.split(":")) for r in args.runs.split(",")]
    if args.carried_kv == "keep" and args.engine != "hf":
        p.error("--carried-kv keep: the hf engine keeps carried rows' caches (add --engine hf)")
    res = measure(model, 2, prompts, args.groups, args.G, args.cap, args.steps, runs, args.today_check,
                  kind=args.engine, carried_kv=args.carried_kv)
    if args.reward_ms is not None:
        res["rewards"] = measure_rewards(model, 2, prompts, args.groups, args.G, args.cap, args.steps, runs[0],
                                         args.reward_ms, kind=args.engine)
    res["engine"], res["carried_kv"] = args.engine, args.carried_kv
    res["model"] = "Llama, vocabulary 49,152, hidden 64, 2 layers, random init (seed 0); prompts of 40 random tokens"
    res["command"] = "python " + " ".join(sys.argv)
    print(json.dumps(res, indent=1))
    base = res["today"]["tokens_per_decode_step"]
    for name, r in res.items():
        if isinstance(r, dict) and "occupancy" in r:
            print(f"{name:>24}: occupancy {r['occupancy']:.0%}, {r['tokens_per_decode_step']:.1f} tokens a decode step "
                  f"({r['tokens_per_decode_step'] / base:.2f}x today), {r['decode_steps']:.0f} decode steps, "
                  f"{r['seconds']:.1f} s ({r['prefill_s']:.1f} s prefill)"
                  + (f", staleness max {r['staleness_max']:.0f}, mean {r['staleness_mean']:.2f}, regenerated "
                     f"{r['regenerated']:.0f}, carried tokens sent again {r['refed_tokens']:.0f}, positions from "
                     f"kept caches {r['kept_tokens']:.0f}" if "regenerated" in r else ""))
    for side in ("scored_as_whole", "scored_at_end") if "rewards" in res else ():
        r = res["rewards"][side]
        print(f"{side:>24}: {res['rewards']['run']}, reward {res['rewards']['reward']}: {r['seconds']:.2f} s, of which "
              f"{r['reward_wait']:.2f} s waiting for rewards after the decode")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
