"""dapo, gpg, 2-grpo, cppo, prorl, dcpo, edge-grpo on small hand-made batches.

Every expected value is computed independently here, in float64, from the formulas of
docs/algorithms.md (TRL's documented "dapo" loss for dapo); losses are also checked to add up
over micro-batch splits with the same gradient.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch

from algos import ALGORITHMS
from algos.base import StepContext
from algos.cppo import kept_count
from algos.dapo import DynamicSamplingError
from algos.edge_grpo import CONTINUE, HINT, REPLACE, correction_case
from grpo.foundation import rl_math
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import ConfigError
from grpo.foundation.dist import shutdown
from grpo.reference.handle import ReferenceHandle
from grpo.training.configure import load_config
from grpo.rollout.engine import completion_mask
from rewards.length import overlong_penalty
from tests.ref_support import RecordingServer

F64 = torch.float64


# --------------------------------------------------------------------------- helpers


def make_cfg(algo: str, *overrides: str, width: int = 5):
    return load_config(None, algo, [f"rollout.max_completion_length={width}", *overrides])


def make_batch(rewards, lengths, G, width=5, truncated=None, prompt_index=None, items=None) -> RolloutBatch:
    n = len(rewards)
    truncated = [l >= width for l in lengths] if truncated is None else truncated
    prompt_index = [i // G for i in range(n)] if prompt_index is None else prompt_index
    return RolloutBatch(
        prompt_ids=[[7, 8, 9][: 1 + i % 3] for i in range(n)],
        completion_ids=[[4 + (i + t) % 10 for t in range(l)] for i, l in enumerate(lengths)],
        mask=completion_mask(list(lengths), width),
        truncated=torch.tensor(truncated),
        group_size=G,
        prompt_index=list(prompt_index),
        items=items or [{"prompt": "p", "answer": "1"} for _ in range(n)],
        prompt_text=["p"] * n,
        completion_text=["c"] * n,
        rewards=torch.tensor(rewards, dtype=F64),
        reward_terms={"r": torch.tensor(rewards, dtype=F64)},
    )


def ref_group_adv(rewards, G, std="unbiased", eps=1e-4):
    out = []
    for g in range(len(rewards) // G):
        r = [float(x) for x in rewards[g * G : (g + 1) * G]]
        m = sum(r) / G
        if max(r) == min(r):
            out += [0.0] * G
            continue
        if std == "none":
            out += [x - m for x in r]
            continue
        var = sum((x - m) ** 2 for x in r) / (G - 1 if std == "unbiased" else G)
        out += [(x - m) / (math.sqrt(var) + eps) for x in r]
    return torch.tensor(out, dtype=F64)


def norms_of(batch: RolloutBatch) -> rl_math.StepNorms:
    return rl_math.StepNorms(num_seqs=float(len(batch)), num_tokens=float(batch.mask.sum()), max_len=batch.width)


def run_loss(algo, batch, logp0, splits):
    """Sum of the micro-batch shares and the gradient w.r.t. the log-probs."""
    logp = logp0.clone().requires_grad_(True)
    norms = norms_of(batch)
    total = torch.zeros((), dtype=F64)
    stats = {}
    for rows in splits:
        out = algo.loss(logp[rows], batch.select(rows), norms)
        total = total + out.loss
        for k, (s, c) in out.stats.items():
            acc = stats.setdefault(k, [0.0, 0.0])
            acc[0] += float(s)
            acc[1] += float(c)
    total.backward()
    return total.detach(), logp.grad.clone(), {k: s / c for k, (s, c) in stats.items()}


def ref_grad(fn, logp0):
    logp = logp0.clone().requires_grad_(True)
    val = fn(logp)
    val.backward()
    return val.detach(), logp.grad.clone()


SPLITS = lambda n: [[list(range(n))], [list(range(0, n, 2)), list(range(1, n, 2))], [[i] for i in range(n)]]  # noqa: E731


def loss_on_every_split(algo, batch, logp, want, want_grad, rel=None):
    """The loss and its gradient equal ``want`` / ``want_grad`` (to 1e-12) however the rows are split into
    micro-batches; returns each split's (gradient, stats), the whole batch first, one row per micro-batch last."""
    results = []
    for splits in SPLITS(len(batch)):
        got, grad, stats = run_loss(algo, batch, logp, splits)
        assert got == (pytest.approx(float(want), rel=rel) if rel else pytest.approx(float(want), abs=1e-12))
        assert torch.allclose(grad, want_grad, atol=1e-12)
        results.append((grad, stats))
    return results

# 3 groups of G = 4: mixed, mixed, all-equal; ragged lengths; width 5
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.1, 0.3, 0.3, 0.3, 0.3]
LENGTHS = [3, 5, 1, 4, 2, 5, 5, 3, 4, 1, 2, 5]


def policy_tensors(n=12, width=5, seed=0):
    """Log-probs and old log-probs whose ratios exp(l - l_old) lie on both sides of every clip bound."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, width, generator=g, dtype=F64) * 2 - 0.05
    deltas = torch.tensor([-0.7, -0.3, -0.05, 0.0, 0.1, 0.3, 0.6], dtype=F64)
    delta = deltas[torch.randint(len(deltas), (n, width), generator=g)]
    return logp, logp.detach() - delta


def ref_token_loss(logp, old, adv, mask, lo, hi, beta=0.0, ref=None):
    rho = torch.exp(logp - old)
    a = adv.unsqueeze(1)
    per = -torch.minimum(rho * a, torch.clamp(rho, 1 - lo, 1 + hi) * a)
    if beta:
        d = ref - logp
        per = per + beta * (torch.exp(d) - d - 1)
    return per * mask


# --------------------------------------------------------------------------- rewards/length.py


def test_overlong_penalty_piecewise():
    L, C = 20, 5  # expected length 15
    cases = {10: 0.0, 15: 0.0, 16: -0.2, 18: -0.6, 20: -1.0, 21: -1.0}
    for length, want in cases.items():
        assert overlong_penalty(length, L, C) == pytest.approx(want, abs=1e-12)
        assert overlong_penalty(length, L, C, factor=0.5) == pytest.approx(0.5 * want, abs=1e-12)
    t = overlong_penalty(torch.tensor(list(cases)), L, C)
    assert t.tolist() == pytest.approx(list(cases.values()), abs=1e-12)
    assert overlong_penalty(20, 20, 0) == 0.0 and overlong_penalty(21, 20, 0) == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(3, 20, 21)


# --------------------------------------------------------------------------- dapo


def dapo_setup(*overrides):
    cfg = make_cfg("dapo", "algo.num_iterations=2", "algo.dynamic_sampling=false", "algo.overlong_buffer=0", *overrides)
    algo = ALGORITHMS.get("dapo")(cfg)
    batch = make_batch(REWARDS, LENGTHS, 4)
    logp, old = policy_tensors()
    batch.old_logp = old
    batch.advantages = algo.advantages(batch, StepContext(cfg, 0))
    return cfg, algo, batch, logp, old


def test_dapo_defaults():
    a = make_cfg("dapo").algo
    assert (a.clip_eps_low, a.clip_eps_high, a.beta, a.aggregation) == (0.2, 0.28, 0.0, "token-mean")
    assert a.options.dynamic_sampling and a.options.max_gen_batches == 10 and not a.options.overlong_filter
    assert ALGORITHMS.get("dapo")(make_cfg("dapo", width=20)).overlong_buffer == 4  # L_max // 5
    with pytest.raises(ConfigError, match="algo.overlong_buffer"):
        make_cfg("dapo", "algo.overlong_buffer=6")
    with pytest.raises(ConfigError, match="algo.max_gen_batches"):
        make_cfg("dapo", "algo.max_gen_batches=-1")


def test_dapo_matches_trl_dapo_loss():
    cfg, algo, batch, logp, old = dapo_setup()
    adv = ref_group_adv(REWARDS, 4)
    assert torch.allclose(batch.advantages.double(), adv, atol=1e-12)
    assert (adv[8:] == 0).all() and (adv > 0).any() and (adv < 0).any()

    # TRL loss_type="dapo": sum of masked per-token losses / active tokens of the whole accumulated batch
    def trl(lp):
        per = ref_token_loss(lp, old, adv, batch.mask.double(), 0.2, 0.28)
        return per.sum() / batch.mask.double().sum()

    want, want_grad = ref_grad(trl, logp)
    rho = torch.exp(logp - old)
    m = batch.mask.bool()
    a = adv.unsqueeze(1).expand_as(rho)
    lo_frac = float(((rho < 0.8) & (a < 0))[m].double().mean())
    hi_frac = float(((rho > 1.28) & (a > 0))[m].double().mean())
    assert lo_frac > 0 and hi_frac > 0  # the batch has tokens clipped on both sides, and unclipped ones
    for grad, stats in loss_on_every_split(algo, batch, logp, want, want_grad):
        assert stats["clip_frac_low"] == pytest.approx(lo_frac) and stats["clip_frac_high"] == pytest.approx(hi_frac)
    assert grad[m & ((rho > 1.28) & (a > 0))].abs().max() == 0  # clipped tokens carry no gradient
    assert (grad[m & (rho < 1.2) & (rho > 0.85) & (a != 0)] != 0).all()


def test_dapo_overlong_shaping_and_filtering():
    cfg = make_cfg("dapo", "algo.dynamic_sampling=false", "algo.overlong_buffer=2", "algo.overlong_filter=true",
                   "algo.overlong_factor=0.5")
    algo = ALGORITHMS.get("dapo")(cfg)
    batch = make_batch(REWARDS, LENGTHS, 4)
    out = algo.process_batch(batch, StepContext(cfg, 0))
    # L_max = 5, L_cache = 2: lengths <= 3 free, 4 -> -0.5, 5 -> -1; times 0.5
    pen = {1: 0.0, 2: 0.0, 3: 0.0, 4: -0.25, 5: -0.5}
    want = [r + pen[l] for r, l in zip(REWARDS, LENGTHS)]
    assert out.rewards.tolist() == pytest.approx(want, abs=1e-12)
    assert out.reward_terms["overlong"].tolist() == pytest.approx([pen[l] for l in LENGTHS], abs=1e-12)
    for i, l in enumerate(LENGTHS):  # truncated rows (no EOS within L_max = 5) are masked out entirely
        assert out.mask[i].sum() == (0 if l == 5 else l)


def scripted_more(reward_lists, G, start=100):
    """generate_more() handing out batches with the given rewards (each call: the next list)."""
    calls = []

    def more(n=None):
        k = len(calls)
        calls.append(n)
        r = reward_lists[k]
        return make_batch(r, [2] * len(r), G, prompt_index=[start + 10 * k + i // G for i in range(len(r))])

    return more, calls


def test_dapo_dynamic_sampling_refills_to_the_batch_size():
    G = 2
    cfg = make_cfg("dapo", "algo.overlong_buffer=0", "rollout.num_generations=2", "rollout.prompts_per_step=4")
    algo = ALGORITHMS.get("dapo")(cfg)
    first = make_batch([1, 1, 0, 1, 0, 0, 1, 1], [2] * 8, G)  # only group 1 has differing rewards
    more, calls = scripted_more([
        [0, 0, 1, 1, 1, 1, 0, 0],  # none
        [1, 0, 0, 0, 0, 1, 1, 1],  # groups 0 and 2
        [0, 1, 1, 0, 0.5, 0.2, 0, 0],  # groups 0, 1, 2 (one more than needed)
    ], G)
    ctx = StepContext(cfg, 0, generate_more=more)
    out = algo.process_batch(first, ctx)
    assert len(calls) == 3
    assert len(out) == 4 * G and out.num_groups == 4
    assert not rl_math.uniform_groups(out.rewards, G).any()
    assert [out.prompt_index[g * G] for g in range(4)] == [1, 110, 112, 120]  # generation order, then truncated
    assert ctx.metrics["dapo/kept_frac"] == pytest.approx(6 / 16)
    assert ctx.metrics["dapo/gen_batches"] == 4
    all_rewards = [1, 1, 0, 1, 0, 0, 1, 1] + [0, 0, 1, 1, 1, 1, 0, 0] + [1, 0, 0, 0, 0, 1, 1, 1] + [0, 1, 1, 0, 0.5, 0.2, 0, 0]
    assert ctx.metrics["dapo/reward_generated_mean"] == pytest.approx(sum(all_rewards) / 32)


def test_dapo_dynamic_sampling_filters_on_the_task_reward_when_asked():
    G = 2
    rewards = [0, 0, 1, 1, 0, 1]  # groups: equal, equal, mixed
    lengths = [2, 5, 3, 5, 5, 5]  # with L_max = 5, L_cache = 2 the first two groups differ in shaped reward
    for filter_on, kept in [("reward", [0, 1, 2]), ("task_reward", [2])]:
        cfg = make_cfg("dapo", "algo.overlong_buffer=2", "rollout.num_generations=2", f"rollout.prompts_per_step={len(kept)}",
                       f"algo.filter_on={filter_on}")
        out = ALGORITHMS.get("dapo")(cfg).process_batch(make_batch(rewards, lengths, G), StepContext(cfg, 0))
        assert [out.prompt_index[g * G] for g in range(out.num_groups)] == kept
        assert out.rewards.tolist() == pytest.approx([r + {2: 0, 3: 0, 5: -1}[l] for r, l in zip(rewards, lengths)][kept[0] * G:])


def test_dapo_dynamic_sampling_clear_error_when_exhausted():
    G = 2
    cfg = make_cfg("dapo", "algo.overlong_buffer=0", "rollout.num_generations=2", "rollout.prompts_per_step=4",
                   "algo.max_gen_batches=3")
    algo = ALGORITHMS.get("dapo")(cfg)
    first = make_batch([1, 1, 0, 1, 0, 0, 1, 1], [2] * 8, G)
    more, calls = scripted_more([[0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [1, 0] * 4], G)
    with pytest.raises(DynamicSamplingError, match=r"after 3 generation batches only 2 of the 4 prompts.*max_gen_batches"):
        algo.process_batch(first, StepContext(cfg, 0, generate_more=more))
    assert len(calls) == 2


def _balance_on(rank: int, out_dir: Path) -> None:
    """dapo's dynamic sampling on 2 ranks (``_two_rank_worker``): rank 0 has a surplus of valid groups."""
    G = 2
    cfg = make_cfg("dapo", "algo.overlong_buffer=0", "rollout.num_generations=2", "rollout.prompts_per_step=4")
    algo = ALGORITHMS.get("dapo")(cfg)
    # rank 0 finds 2 valid groups in each batch, rank 1 none: rank 1 takes rank 0's surplus
    rewards = [[1, 0, 0, 1], [0.5, 0, 1, 0]] if rank == 0 else [[0, 0, 1, 1], [1, 1, 1, 1]]
    mk = lambda k: make_batch(rewards[k], [2] * 4, G, prompt_index=[100 * rank + 10 * k + i // G for i in range(4)])  # noqa: E731
    calls = []

    def more(n=None):
        calls.append(n)
        return mk(len(calls))

    ctx = StepContext(cfg, 0, generate_more=more)
    out = algo.process_batch(mk(0), ctx)
    Path(out_dir, f"rank{rank}.txt").write_text(
        f"{[out.prompt_index[g * G] for g in range(out.num_groups)]};{len(out)};{ctx.metrics['dapo/kept_frac']}"
    )


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    """The cross-rank checks on 2 gloo ranks, in one spawn (each spawned process imports this module again:
    seconds of start-up per check otherwise): dapo's balance into OUT/balance, gpg's counts into OUT/gpg."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for name, check in (("balance", _balance_on), ("gpg", _gpg_on)):
        Path(out_dir, name).mkdir(exist_ok=True)
        check(rank, Path(out_dir, name))
    shutdown()  # a barrier first: a rank torn down mid-collective aborted its peer (SIGABRT)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Runs ``_two_rank_worker`` on 2 gloo ranks; its output folder."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("two_ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, str(out)), nprocs=2, join=True)
    return out


def test_dapo_dynamic_sampling_balances_groups_across_ranks(two_ranks):
    r0 = (two_ranks / "balance" / "rank0.txt").read_text().split(";")
    r1 = (two_ranks / "balance" / "rank1.txt").read_text().split(";")
    assert r0[0] == "[0, 1]" and r1[0] == "[10, 11]"  # rank 0 keeps its first two, rank 1 gets the next two
    assert r0[1] == r1[1] == "4"
    assert float(r0[2]) == float(r1[2]) == pytest.approx(4 / 8)


# --------------------------------------------------------------------------- gpg


def test_gpg_loss_alpha_and_gradient():
    cfg = make_cfg("gpg")
    algo = ALGORITHMS.get("gpg")(cfg)
    batch = make_batch(REWARDS, LENGTHS, 4)
    ctx = StepContext(cfg, 0)
    batch = algo.process_batch(batch, ctx)
    batch.advantages = algo.advantages(batch, ctx)
    adv = ref_group_adv(REWARDS, 4, std="none")
    assert torch.allclose(batch.advantages.double(), adv, atol=1e-12)
    assert algo.alpha == pytest.approx(3 / 2) and ctx.metrics["gpg/alpha"] == pytest.approx(1.5)  # B = 3, M = 1
    assert not ctx.skip_update
    logp, _ = policy_tensors()
    mask = batch.mask.double()

    def ref(lp):  # -alpha sum_i sum_t l A_i / sum_i |o_i|
        return -1.5 * (lp * adv.unsqueeze(1) * mask).sum() / mask.sum()

    want, want_grad = ref_grad(ref, logp)
    for _, stats in loss_on_every_split(algo, batch, logp, want, want_grad):
        assert stats["clip_frac_low"] == stats["clip_frac_high"] == 0 and stats["ratio_mean"] == pytest.approx(1.0)
    assert not algo.needs_old_logprobs and not algo.needs_reference


def test_gpg_std_option_and_beta_rejected():
    cfg = make_cfg("gpg", "algo.adv_std=unbiased")
    adv = ALGORITHMS.get("gpg")(cfg).advantages(make_batch(REWARDS, LENGTHS, 4), StepContext(cfg, 0))
    assert torch.allclose(adv.double(), ref_group_adv(REWARDS, 4, "unbiased"), atol=1e-12)
    with pytest.raises(ConfigError, match="algo.beta"):
        make_cfg("gpg", "algo.beta=0.04")


def test_gpg_skips_when_every_group_is_uniform():
    cfg = make_cfg("gpg")
    algo = ALGORITHMS.get("gpg")(cfg)
    ctx = StepContext(cfg, 0)
    algo.process_batch(make_batch([1, 1, 0, 0, 0.5, 0.5], [2] * 6, 2), ctx)
    assert ctx.skip_update and "gpg/alpha" not in ctx.metrics and ctx.metrics["gpg/valid_group_frac"] == 0


def test_gpg_threshold_resampling_replaces_uniform_groups():
    G = 2
    cfg = make_cfg("gpg", "algo.threshold=0.6", "rollout.num_generations=2")
    algo = ALGORITHMS.get("gpg")(cfg)
    first = make_batch([1, 0, 1, 1, 0, 0, 1, 1, 0, 0], [2] * 10, G)  # 1 of 5 valid
    more, calls = scripted_more([[0, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 0.2, 0.4, 1, 0, 0, 1, 0, 0]], G)
    ctx = StepContext(cfg, 0, generate_more=more)
    out = algo.process_batch(first, ctx)
    # round 2 gives 1 valid group (-> group 1), round 3 three more (-> groups 2, 3, 4): 5/5 valid
    assert [out.prompt_index[g * G] for g in range(5)] == [0, 100, 111, 112, 113]
    assert len(calls) == 2 and len(out) == 10
    assert ctx.metrics["gpg/valid_group_frac"] == 1.0 and algo.alpha == 1.0


def _gpg_on(rank: int, out_dir: Path) -> None:
    """gpg's alpha and skip on 2 ranks (``_two_rank_worker``)."""
    cfg = make_cfg("gpg", "rollout.num_generations=2")
    results = []
    cases = {  # rank -> rewards of its 3 groups of 2
        "mixed": ([1, 0, 0.5, 0.5, 0, 1], [1, 1, 0, 0, 0, 0]),  # B = 6, M = 4 -> alpha = 3
        "one rank uniform": ([1, 1, 0, 0, 1, 1], [0, 1, 0, 0, 0, 0]),  # rank 0 alone has no signal: no skip
        "all uniform": ([1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]),  # skipped on both ranks
    }
    for name, rewards in cases.items():
        algo = ALGORITHMS.get("gpg")(cfg)
        ctx = StepContext(cfg, 0)
        algo.process_batch(make_batch(rewards[rank], [2] * 6, 2), ctx)
        results.append(f"{name}:{ctx.skip_update}:{algo.alpha}")
    Path(out_dir, f"rank{rank}.txt").write_text("|".join(results))


def test_gpg_alpha_and_skip_count_groups_over_all_ranks(two_ranks):
    r0, r1 = ((two_ranks / "gpg" / f"rank{k}.txt").read_text().split("|") for k in range(2))
    assert r0 == r1
    assert r0[0] == "mixed:False:3.0" and r0[1] == "one rank uniform:False:6.0"
    assert r0[2].startswith("all uniform:True:")


# --------------------------------------------------------------------------- 2-grpo


def test_two_grpo_advantages_are_plus_minus_one_and_pairs_are_kept():
    with pytest.raises(ConfigError, match="rollout.num_generations"):
        make_cfg("2-grpo")
    cfg = make_cfg("2-grpo", "rollout.num_generations=2", "algo.num_iterations=2")
    algo = ALGORITHMS.get("2-grpo")(cfg)
    rewards = [1.0, 0.0, 0.3, 0.7, 0.4, 0.4, 0.0, 0.0, 0.9, 0.2, 1.0, 1.0]
    lengths = [3, 5, 1, 4, 2, 5, 5, 3, 4, 1, 2, 5]
    batch = make_batch(rewards, lengths, 2)
    adv = algo.advantages(batch, StepContext(cfg, 0))
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0], abs=1e-12)
    assert torch.allclose(adv.double(), ref_group_adv(rewards, 2, "population", eps=0.0))
    batch.advantages = adv
    logp, old = policy_tensors()
    batch.old_logp = old
    batch.ref_logp = old - 0.1
    mask = batch.mask.double()

    def ref(lp):  # grpo: (1/N) sum_i (1/|o_i|) sum_t L_i,t, N counting the zero-advantage pairs
        per = ref_token_loss(lp, old, adv.double(), mask, 0.2, 0.2, beta=0.04, ref=batch.ref_logp)
        return (per.sum(1) / mask.sum(1)).sum() / 12

    want, want_grad = ref_grad(ref, logp)
    loss_on_every_split(algo, batch, logp, want, want_grad)


# --------------------------------------------------------------------------- cppo


def test_cppo_prunes_largest_abs_advantage_per_group_lowest_index_on_ties():
    cfg = make_cfg("cppo")
    algo = ALGORITHMS.get("cppo")(cfg)
    assert cfg.algo.num_iterations == 2 and cfg.algo.beta == 0.04 and cfg.algo.options.pruning == 0.5
    batch = make_batch(REWARDS, LENGTHS, 4)
    batch.advantages = torch.tensor([0.5, -0.5, 0.9, -0.2, 0.1, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=F64)
    ctx = StepContext(cfg, 0)
    kept = algo.prune_batch(batch, ctx)
    # group 0: |A| 0.5, 0.5, 0.9, 0.2 -> rows 2 and 0 (tie 0/1: lowest index); group 1: rows 5, 6; group 2: 8, 9
    assert kept.prompt_index == [0, 0, 1, 1, 2, 2]
    assert kept.advantages.tolist() == [0.5, 0.9, -1.0, 1.0, 0.0, 0.0]
    assert kept.completion_ids == [batch.completion_ids[i] for i in [0, 2, 5, 6, 8, 9]]
    assert kept.group_size == 2 and ctx.metrics["cppo/kept_frac"] == 0.5

    cfg_b = make_cfg("cppo", "algo.scope=batch", "algo.pruning=0.75")
    kept_b = ALGORITHMS.get("cppo")(cfg_b).prune_batch(batch, StepContext(cfg_b, 0))
    assert kept_b.advantages.tolist() == pytest.approx([0.9, -1.0, 1.0])  # top floor(12 * 0.25) = 3, in row order
    assert kept_count(10, 0.9) == 1 and kept_count(16, 0.875) == 2
    with pytest.raises(ConfigError, match="algo.pruning"):
        make_cfg("cppo", "algo.pruning=0.95", "rollout.num_generations=16")


def test_cppo_loss_on_kept_rows():
    cfg = make_cfg("cppo")
    algo = ALGORITHMS.get("cppo")(cfg)
    batch = make_batch(REWARDS, LENGTHS, 4)
    batch.advantages = algo.advantages(batch, StepContext(cfg, 0))
    kept = algo.prune_batch(batch, StepContext(cfg, 0))
    adv = ref_group_adv(REWARDS, 4)
    rows = []
    for g in range(3):  # independent top-2 by |A| per group, ties to the lower index
        order = sorted(range(4), key=lambda j: (-abs(float(adv[g * 4 + j])), j))[:2]
        rows += sorted(g * 4 + j for j in order)
    assert kept.completion_ids == [batch.completion_ids[i] for i in rows]
    logp, old = policy_tensors(n=len(kept))
    kept.old_logp, kept.ref_logp = old, old + 0.2
    mask = kept.mask.double()

    def ref(lp):  # token-mean over the kept tokens, with k3 KL beta 0.04
        return ref_token_loss(lp, old, adv[rows], mask, 0.2, 0.2, beta=0.04, ref=kept.ref_logp).sum() / mask.sum()

    want, want_grad = ref_grad(ref, logp)
    for _, stats in loss_on_every_split(algo, kept, logp, want, want_grad):
        assert "kl" in stats


def test_cppo_dynamic_allocation_samples_more_prompts():
    cfg = make_cfg("cppo", "algo.allocation=true", "algo.pruning=0.6", "rollout.num_generations=4",
                   "rollout.prompts_per_step=4")
    algo = ALGORITHMS.get("cppo")(cfg)
    more, calls = scripted_more([[0.0] * 24], 4)
    ctx = StepContext(cfg, 0, generate_more=more)
    out = algo.process_batch(make_batch([0.0] * 16, [2] * 16, 4), ctx)
    assert calls == [6]  # ceil(4 / 0.4) = 10 prompts: 6 more
    assert out.num_groups == 10 and ctx.metrics["cppo/prompts"] == 10


# --------------------------------------------------------------------------- dcpo


def test_dcpo_dynamic_bounds():
    q = torch.tensor([0.001, 0.05, 0.3, 0.64, 0.9, 1.0], dtype=F64)
    low, high = rl_math.dynamic_clip_bounds(q.log(), 0.16, 0.2, 10.0)
    for k, qk in enumerate(q.tolist()):
        want_low = 0.5 + 0.5 * math.sqrt(max(1 - 4 * 0.16 / qk, 0.0))
        want_high = min(0.5 + 0.5 * math.sqrt(1 + 4 * 0.2 / qk), 10.0)
        assert float(low[k]) == pytest.approx(want_low, abs=1e-12)
        assert float(high[k]) == pytest.approx(want_high, abs=1e-12)
    assert float(high[0]) == 10.0 and float(low[1]) == 0.5  # the cap and the sqrt floor are both reached


def test_dcpo_loss_dynamic_clip_and_dual_clip():
    cfg = make_cfg("dcpo", "algo.num_iterations=2")
    a = cfg.algo
    assert (a.clip_eps_low, a.clip_eps_high, a.dual_clip, a.aggregation, a.beta) == (0.16, 0.2, 10.0, "seq-sum-token-mean", 0.0)
    algo = ALGORITHMS.get("dcpo")(cfg)
    batch = make_batch(REWARDS, LENGTHS, 4)
    batch.advantages = ref_group_adv(REWARDS, 4)
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(12, 5, generator=g, dtype=F64) * 4  # q from ~0.02 to 1
    logp = old + torch.randn(12, 5, generator=g, dtype=F64) * 0.8
    logp[1, 0] = old[1, 0] + math.log(30.0)  # A < 0, ratio 30: the dual clip (10 A) binds
    batch.old_logp = old
    mask = batch.mask.double()
    adv = batch.advantages.unsqueeze(1)
    assert float(adv[1]) < 0

    def ref(lp):
        q = torch.exp(old)
        lo = 0.5 + 0.5 * torch.sqrt(torch.clamp(1 - 4 * 0.16 / q, min=0))
        hi = torch.clamp(0.5 + 0.5 * torch.sqrt(1 + 4 * 0.2 / q), max=10)
        rho = torch.exp(lp - old)
        l = torch.minimum(rho * adv, torch.minimum(torch.maximum(rho, lo), hi) * adv)
        l = torch.where(adv < 0, torch.maximum(l, 10 * adv), l)
        return ((-l * mask).sum(1) / mask.sum(1)).sum()  # seq-sum-token-mean

    want, want_grad = ref_grad(ref, logp)
    grad, stats = loss_on_every_split(algo, batch, logp, want, want_grad, rel=1e-12)[-1]
    assert grad[1, 0] == 0  # dual-clipped token
    assert stats["clip_frac_low"] > 0 and stats["clip_frac_high"] > 0


def test_dcpo_smooth_advantages_pool_a_prompts_history(tmp_path):
    cfg = make_cfg("dcpo")
    algo = ALGORITHMS.get("dcpo")(cfg)
    G = 4
    r1 = [1.0, 0.0, 0.0, 0.0, 0.3, 0.6, 0.6, 0.9]
    r2 = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]  # prompt 7 again, and prompt 8 again with equal rewards
    algo.advantages(make_batch(r1, [2] * 8, G, prompt_index=[7] * 4 + [8] * 4), StepContext(cfg, 0))
    saved = algo.state_dict()
    adv = algo.advantages(make_batch(r2, [2] * 8, G, prompt_index=[7] * 4 + [8] * 4), StepContext(cfg, 1))

    def pop(x):
        m = sum(x) / len(x)
        return m, math.sqrt(sum((v - m) ** 2 for v in x) / len(x))

    want = []
    for g in range(2):
        old, new = r1[g * G : (g + 1) * G], r2[g * G : (g + 1) * G]
        i = 2
        m_new, s_new = pop(new)
        m_tot, s_tot = pop(old + new)  # the pooled statistics are those of all 2G rewards
        for r in new:
            a_new = (r - m_new) / s_new if s_new > 0 else 0.0
            a_tot = (r - m_tot) / s_tot if s_tot > 0 else 0.0
            sa_new = (i - 1) / i * a_new + a_tot / i
            sa_tot = a_new / i + (i - 1) / i * a_tot
            want.append(sa_new if abs(sa_new) <= abs(sa_tot) else sa_tot)
    assert adv.double().tolist() == pytest.approx(want, abs=1e-6)
    assert any(abs(w) > 0.1 for w in want[4:])  # the all-equal group still gets a signal from its history

    # the statistics survive a checkpoint: a fresh instance with the saved state gives the same advantages
    torch.save(saved, tmp_path / "state.pt")
    again = ALGORITHMS.get("dcpo")(cfg)
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    adv2 = again.advantages(make_batch(r2, [2] * 8, G, prompt_index=[7] * 4 + [8] * 4), StepContext(cfg, 1))
    assert torch.equal(adv, adv2)
    assert again.prompt_stats[7][0] == 2


def test_dcpo_requires_population_std():
    with pytest.raises(ConfigError, match="algo.adv_std"):
        make_cfg("dcpo", "algo.adv_std=unbiased")


# --------------------------------------------------------------------------- edge-grpo


def test_edge_grpo_entropy_normalised_advantage_and_loss():
    cfg = make_cfg("edge-grpo", "algo.num_iterations=2")
    algo = ALGORITHMS.get("edge-grpo")(cfg)
    assert algo.needs_entropy and cfg.algo.beta == 0 and not algo.needs_reference
    batch = make_batch(REWARDS, LENGTHS, 4)
    g = torch.Generator().manual_seed(2)
    batch.entropy = torch.rand(12, 5, generator=g, dtype=F64) * 3
    adv = algo.advantages(batch, StepContext(cfg, 0)).double()
    A = ref_group_adv(REWARDS, 4)
    want = []
    for grp in range(3):
        P = []
        for i in range(grp * 4, grp * 4 + 4):
            P.append(sum(float(batch.entropy[i, t]) for t in range(LENGTHS[i])) / LENGTHS[i])
        mean_p = sum(P) / 4
        want += [float(A[grp * 4 + j]) / (P[j] / mean_p) for j in range(4)]
    assert adv.tolist() == pytest.approx(want, abs=1e-6)
    batch.advantages = adv
    logp, old = policy_tensors()
    batch.old_logp = old
    mask = batch.mask.double()

    def ref(lp):
        per = ref_token_loss(lp, old, adv, mask, 0.2, 0.2)
        return (per.sum(1) / mask.sum(1)).sum() / 12

    want_loss, want_grad = ref_grad(ref, logp)
    loss_on_every_split(algo, batch, logp, want_loss, want_grad)


def test_edge_grpo_correction_probabilities():
    assert [correction_case(u) for u in (0.0, 0.4999, 0.5, 0.7499, 0.75, 0.9999)] == [
        CONTINUE, CONTINUE, HINT, HINT, REPLACE, REPLACE]
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(3)).tolist()
    counts = [0, 0, 0]
    for x in u:
        counts[correction_case(x)] += 1
    assert [c / len(u) for c in counts] == pytest.approx([0.5, 0.25, 0.25], abs=0.005)


# --------------------------------------------------------------------------- with a real (single-rank) trainer


def make_trainer(algo: str, tmp_path, *overrides: str):
    from grpo.training.trainer import Trainer

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml", algo, [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false",
        "rollout.prompts_per_step=2", "rollout.num_generations=4", *overrides])
    return Trainer(cfg)


def test_cppo_forward_passes_run_on_kept_rows_only(single_rank_env, tmp_path):
    tr = make_trainer("cppo", tmp_path, "algo.beta=0.04", "algo.allocation=true")  # P = 0.5, mu = 2
    seen = {}
    submit, policy_lp = tr.reference.submit, tr.policy_logprobs
    tr.reference.submit = lambda packed, temp: (seen.setdefault("ref", packed.input_ids.shape[0]), submit(packed, temp))[1]
    tr.policy_logprobs = lambda b, e: (seen.setdefault("old", len(b)), policy_lp(b, e))[1]
    m = tr.train_step()
    assert seen == {"ref": 8, "old": 8}  # 4 prompts (2 + 2 allocated) x G = 4, half kept
    assert m["cppo/kept_frac"] == 0.5 and m["cppo/prompts"] == 4 and "kl" in m
    assert len(tr._last_batch) == 16  # rewards and advantages are logged over every generated completion


def test_prorl_reference_resets(single_rank_env, tmp_path):
    from grpo.foundation.modeling import load_model

    with pytest.raises(ConfigError, match="algo.beta"):
        make_cfg("prorl", "algo.beta=0")
    a = make_cfg("prorl").algo
    assert (a.beta, a.kl_estimator, a.clip_eps_low, a.clip_eps_high, a.aggregation) == (1e-3, "k3", 0.2, 0.4, "token-mean")
    tr = make_trainer("prorl", tmp_path, "algo.beta=0.001", "algo.dynamic_sampling=false", "algo.reset_every=4",
                      "algo.reset_patience=2")
    algo = tr.algo
    tr.train_step()
    with torch.no_grad():  # make sure the policy differs from the reference, whatever the step's rewards were
        for p in tr.model.parameters():
            p.add_(0.01)
    policy = {k: v.detach().cpu().clone() for k, v in tr.model.state_dict().items()}  # on CPU: GPU runs too
    ref_w = tr.reference.impl.model.state_dict()
    assert any(not torch.equal(policy[k], ref_w[k].cpu()) for k in policy)  # one update moved the policy
    assert len(tr.engine.optimizer.state) > 0

    events = []
    for step, value in [(1, 0.1), (2, 0.2), (3, 0.15), (4, 0.1), (5, 0.3), (6, 0.2), (7, 0.25)]:
        tr.step = step
        m = {"reward/mean": value}
        algo.on_step_end(tr.context(), m)
        events.append((m["prorl/reset"], m["prorl/ref_version"]))
    # step 4: every 4 steps; step 7: two values without improvement on the best since that reset
    assert events == [(0, 0), (0, 0), (0, 0), (1, 0), (0, 1), (0, 1), (1, 1)]
    ref_w = tr.reference.impl.model.state_dict()
    assert all(torch.equal(policy[k], ref_w[k].cpu()) for k in policy)  # pi_ref <- pi_theta
    assert tr.reference.version == 2 and algo.resets == 2
    assert len(tr.engine.optimizer.state) == 0  # optimizer state reset
    folder = tmp_path / "reference" / "step-7"
    saved = load_model(tr.cfg.model, str(folder)).state_dict()
    assert all(torch.equal(policy[k], saved[k].cpu()) for k in policy)

    # resume: a fresh reference (the initial model) is brought back to the reset one
    state = algo.state_dict()
    tr2 = make_trainer("prorl", tmp_path / "resumed", "algo.beta=0.001")
    tr2.algo.load_state_dict(state)
    tr2.algo.attach(tr2.context())
    ref2 = tr2.reference.impl.model.state_dict()
    assert all(torch.equal(policy[k], ref2[k].cpu()) for k in policy) and tr2.reference.version == 2

    # with a reference server: the policy is saved and the server's reload is called once
    server = RecordingServer()
    tr2.reference = ReferenceHandle(server)
    tr2.step = 7
    tr2.algo.reset(tr2.context())
    assert server.loaded == [str(tmp_path / "resumed" / "reference" / "step-7")]
    assert (Path(server.loaded[0]) / "config.json").is_file() and tr2.algo.ref_version == 1
    m = {}
    tr2.algo.on_step_end(tr2.context(), m)
    assert m["prorl/ref_version"] == 1


def test_edge_grpo_guided_error_correction(single_rank_env, tmp_path):
    from rewards.digits import digits_match

    tr = make_trainer("edge-grpo", tmp_path, "algo.guided_correction=true", "algo.solution_column=answer",
                      "rollout.max_completion_length=12", "algo.reflection_cue=' ?'", "rollout.prompts_per_step=8")
    batch = tr.generate(tr._rank_indices())
    before = [list(c) for c in batch.completion_ids]
    wrong = [i for i in range(len(batch)) if float(batch.rewards[i]) < 1.0]
    assert len(wrong) > 8  # the untrained policy gets most answers wrong
    ctx = tr.context()
    out = tr.algo.process_batch(batch, ctx)
    tok, eos = tr.tokenizer, tr.eos_ids[0]
    cue = tok(" ?", add_special_tokens=False).input_ids
    kinds = {CONTINUE: 0, HINT: 0, REPLACE: 0}
    for i in wrong:
        own = before[i][:-1] if before[i] and before[i][-1] == eos else before[i]
        ans = tok(out.items[i]["answer"], add_special_tokens=False).input_ids
        new = out.completion_ids[i]
        hint = own[: 12 - len(cue) - len(ans) - 1] + cue + ans + [eos]
        cont = own[: 12 - len(cue) - 1] + cue  # the policy writes at least one token after the cue
        if new == ans + [eos]:
            kinds[REPLACE] += 1
        elif new == hint:
            kinds[HINT] += 1
        else:
            assert new[: len(cont)] == cont and len(cont) < len(new) <= 12
            kinds[CONTINUE] += 1
        text = tr.rollout.decode([new])[0]
        assert out.completion_text[i] == text
        assert float(out.rewards[i]) == pytest.approx(digits_match([""], [text], [out.items[i]["answer"]])[0])
        assert out.mask[i].sum() == len(new)
    assert all(v > 0 for v in kinds.values())
    for i in set(range(len(batch))) - set(wrong):
        assert out.completion_ids[i] == before[i]
    assert ctx.metrics["edge/corrected_frac"] == pytest.approx(len(wrong) / len(batch))


class HashingServer(RecordingServer):
    """A reference server's admin side that also reports a hash of what it serves (here: of its source)."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def info(self) -> dict:
        return {"version": self.version, "model": self.source, "weights_hash": f"hash:{self.source}"}

    def reload(self, checkpoint_dir: str) -> dict:
        self.source = checkpoint_dir
        return super().reload(checkpoint_dir)


def test_prorl_resume_brings_a_moved_server_back_and_checks_its_weights(single_rank_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tr = make_trainer("prorl", "relative-run", "algo.beta=0.001")  # a relative train.output_dir
    initial = tr.cfg.model.name_or_path
    server = HashingServer(initial)
    tr.reference = ReferenceHandle(server)
    algo = ALGORITHMS.get("prorl")(tr.cfg)
    algo.attach(tr.context())
    assert (algo.ref_version, algo.ref_hash) == (0, f"hash:{initial}")
    before_reset = algo.state_dict()

    tr.step = 4
    algo.reset(tr.context())
    folder = tmp_path / "relative-run" / "reference" / "step-4"
    assert server.loaded == [str(folder)]  # absolute: the server resolves it on its side
    after_reset = algo.state_dict()

    # resumed from the checkpoint before the reset, while the server still serves the reset weights
    resumed = ALGORITHMS.get("prorl")(tr.cfg)
    resumed.load_state_dict(before_reset)
    resumed.attach(tr.context())
    assert server.loaded[-1] == initial and resumed.ref_version == server.version == 2
    # resumed after the reset: the server loads the exported policy again
    resumed = ALGORITHMS.get("prorl")(tr.cfg)
    resumed.load_state_dict(after_reset)
    resumed.attach(tr.context())
    assert server.loaded[-1] == str(folder) and resumed.ref_hash == f"hash:{folder}"
    # the folder no longer holds the weights the checkpoint trained against
    tampered = ALGORITHMS.get("prorl")(tr.cfg)
    tampered.load_state_dict({**after_reset, "ref_hash": "hash:something-else"})
    with pytest.raises(ConfigError, match="this checkpoint trained against hash:something-else"):
        tampered.attach(tr.context())
    tr.close()


def test_adaptive_entropy_bonus_in_a_real_trainer(single_rank_env, tmp_path):
    """Skywork-OR1's adaptive entropy bonus through the trainer: the training forward's entropy (with its
    gradient) equals the old-policy pass's on the step's first pass, the coefficient moves by delta per step
    up to its cap, and a resumed run continues from the checkpointed coefficient."""
    from grpo.training.trainer import Trainer

    opts = ["algo.entropy_coef=0.01", "algo.entropy_target=100", "algo.entropy_coef_delta=0.01",
            "algo.entropy_coef_max=0.015", "train.max_steps=2", "train.save_every=0"]
    tr = make_trainer("grpo", tmp_path, "algo.beta=0", *opts)
    assert tr.algo.entropy_bonus and tr.algo.needs_entropy
    rows = tr.train()
    assert [r["entropy_bonus/coef"] for r in rows] == pytest.approx([0.01, 0.015])  # e_k < 100: c rises to the cap
    for r in rows:  # mu = 1: the loss's entropy (current policy, with gradient) is the old-policy pass's
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["entropy_bonus/entropy"] == pytest.approx(r["entropy"], rel=1e-4)
    assert tr.algo.entropy_c == pytest.approx(0.015)
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml", "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false",
        "rollout.prompts_per_step=2", "rollout.num_generations=4", "algo.beta=0", *opts[:-2],
        "algo.entropy_coef_max=0.5", "train.max_steps=3"])
    resumed = Trainer(cfg, resume=True)
    try:
        assert resumed.algo.entropy_c == pytest.approx(0.015)  # not algo.entropy_coef = 0.01
        m = resumed.train_step()
        assert m["entropy_bonus/coef"] == pytest.approx(0.015)
    finally:
        resumed.close()
