"""On-policy distillation over the teacher's top-k tokens (issue 44, ``teacher.top_k``): GKD's generalized JSD on the
teacher's support (TRL's server distillation: ``_jsd_divergence`` after ``_add_tail_bucket``, written out here from
that definition), against float64 sums written plainly; its gradient over the whole vocabulary; the loss it joins;
the config's errors; a run whose teacher sends its top-k."""

from __future__ import annotations

import math

import pytest
import torch

from algos import ALGORITHMS
from grpo.foundation import rl_math
from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import StepContext
from tests.helpers import config, make_batch

LENGTHS = [3, 5, 1, 4, 2, 2, 5, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5]
G, W, V, K = 4, 5, 9, 3


def distributions(shape, seed):
    """Teacher and student log-softmaxes over V tokens at each position, and the teacher's top-K: (student's
    log-probs of those K tokens, teacher's, ids), float64."""
    g = torch.Generator().manual_seed(seed)
    t_full = torch.log_softmax(torch.randn(*shape, V, generator=g, dtype=torch.float64) * 2, -1)
    s_full = torch.log_softmax(torch.randn(*shape, V, generator=g, dtype=torch.float64) * 2, -1)
    top = t_full.topk(K, dim=-1)
    return s_full.gather(-1, top.indices), top.values, top.indices, s_full, t_full


def by_hand(s_lp: list[float], t_lp: list[float], beta: float, tail: bool) -> float:
    """One position's divergence from its definition, in Python floats."""
    s, t = [math.exp(x) for x in s_lp], [math.exp(x) for x in t_lp]
    if tail:  # the rest of each distribution as one more outcome (its log-sum kept <= -1e-7)
        s.append(1 - math.exp(min(math.log(sum(s)), -1e-7)))
        t.append(1 - math.exp(min(math.log(sum(t)), -1e-7)))
    else:  # both renormalised over the k tokens
        s, t = [x / sum(s) for x in s], [x / sum(t) for x in t]

    def kl(p, q):
        return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q))

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = [beta * a + (1 - beta) * b for a, b in zip(t, s)]
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_topk_divergence_by_hand(beta, tail):
    s, t, *_ = distributions((4, 6), seed=1)
    got = rl_math.topk_divergence(s, t, beta, tail)
    assert got.shape == (4, 6) and got.dtype == torch.float64
    for i in range(4):
        for j in range(6):
            assert got[i, j].item() == pytest.approx(by_hand(s[i, j].tolist(), t[i, j].tolist(), beta, tail),
                                                     rel=1e-12, abs=1e-14)
    assert bool((got >= -1e-15).all())  # a divergence
    assert rl_math.topk_divergence(t, t, beta, tail).abs().max() < 1e-14  # 0 where the student is the teacher


def test_over_the_whole_vocabulary_it_is_the_kl_with_its_gradient():
    """k = V, renormalised: the exact KL(teacher || student) (beta 0) and KL(student || teacher) (beta 1), and the
    gradient of the forward one with respect to the student's logits is softmax(z) - t."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, V, generator=g, dtype=torch.float64, requires_grad=True)
    t_full = torch.log_softmax(torch.randn(5, V, generator=g, dtype=torch.float64), -1)
    ids = t_full.argsort(-1, descending=True)
    s = torch.log_softmax(z, -1).gather(-1, ids)
    t = t_full.gather(-1, ids)
    fwd = rl_math.topk_divergence(s, t, 0.0, tail=False)
    p_s = torch.softmax(z, -1)
    want = (t_full.exp() * (t_full - torch.log_softmax(z, -1))).sum(-1)
    torch.testing.assert_close(fwd, want, rtol=1e-12, atol=1e-14)
    rev = rl_math.topk_divergence(s, t, 1.0, tail=False)
    torch.testing.assert_close(rev, (p_s * (torch.log_softmax(z, -1) - t_full)).sum(-1), rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(fwd.sum(), z)
    torch.testing.assert_close(grad, (p_s - t_full.exp()).detach(), rtol=1e-10, atol=1e-12)


def test_the_divergence_joins_the_loss_and_leaves_the_advantages():
    """grpo with teacher.top_k: the advantages are the group's alone (no sampled-token term), and the loss is grpo's
    plus coef times the token-mean divergence (token-mean aggregation), its gradient reaching the student's top-k
    log-probs; distill/share is |term| / (|term| + |the rest|)."""
    cfg = config("grpo", **{"teacher.model": "builtin:tiny-char", "teacher.top_k": K, "teacher.coef": 0.7,
                            "teacher.beta": 0.5, "algo.beta": 0, "algo.aggregation": "token-mean"})
    algo = ALGORITHMS.get("grpo")(cfg)
    batch = make_batch(LENGTHS, REWARDS, G, W)
    s, t, ids, *_ = distributions((len(LENGTHS), W), seed=3)
    batch.teacher_logp = (batch.old_logp - 0.3) * batch.mask
    batch.extra = {"teacher_topk_logp": t.float(), "teacher_topk_ids": ids}
    ctx = StepContext(cfg, 0)
    batch.advantages = algo.advantages(batch, ctx)
    group = batch.advantages.clone()
    batch = algo.prepare_loss(batch, ctx)
    assert torch.equal(batch.advantages, group) and "distill/share" not in ctx.metrics
    assert ctx.metrics["distill/reverse_kl"] == pytest.approx(0.3, abs=1e-6)
    norms = rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)
    logp = batch.old_logp.clone().requires_grad_(True)
    student = s.clone().requires_grad_(True)
    out = algo.loss_with_bonus(logp, None, batch, norms, student)
    plain = algo.loss(logp.detach(), batch, norms).loss
    mask = batch.mask.tolist()
    total = sum(by_hand(s[i, j].tolist(), t.float().double()[i, j].tolist(), 0.5, True)
                for i in range(len(mask)) for j in range(W) if mask[i][j])
    term = 0.7 * total / sum(map(sum, mask))
    assert out.loss.item() == pytest.approx(plain.item() + term, rel=1e-6)
    # TRL 1.16's server distillation reduces with `batchmean` and the completion mask (_reduce_divergence_loss:
    # jsd[mask].sum() / mask.sum()): the token mean, so with token-mean aggregation the same term (issue 58 item 18)
    jsd = rl_math.topk_divergence(s, t.float().double(), 0.5, True)
    keep = batch.mask.bool()
    trl = jsd[keep].sum() / keep.sum().clamp_min(1)
    assert 0.7 * trl.item() == pytest.approx(term, rel=1e-12)
    share = out.stats["distill/share"]
    assert (share[0] / share[1]).item() == pytest.approx(abs(term) / (abs(term) + abs(plain.item())), rel=1e-6)
    out.loss.backward()
    assert student.grad[batch.mask.bool()].abs().sum() > 0 and not student.grad[~batch.mask.bool()].any()


@pytest.mark.parametrize("overrides, match", [
    ({"teacher.beta": 0.5}, r"teacher.beta=0.5 shapes the divergence over the teacher's top-k tokens, and "
                            r"teacher.top_k=0"),
    ({"teacher.tail": False}, r"teacher.tail=False shapes the divergence"),
    ({"teacher.top_k": 1, "teacher.tail": False}, r"teacher.top_k=1 with teacher.tail=false"),
    ({"teacher.top_k": 65}, r"teacher.top_k=65"),
    ({"teacher.beta": 1.5, "teacher.top_k": 4}, r"teacher.beta=1.5"),
])
def test_topk_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config("grpo", **{"teacher.model": "builtin:tiny-char", **overrides})


@pytest.mark.parametrize("served", [False, True])
def test_a_run_distils_over_the_teachers_top_k(single_rank_env, tmp_path, served):
    """Two opd steps whose teacher sends its top-4 (in the trainer's process, or from ref_client.py on loopback):
    the batch holds the teacher's support, the divergence is logged and is the whole loss."""
    from grpo.foundation.tiny import write_tiny
    from grpo.reference.launch import ServerProcess, free_port
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer
    from tests.patience import SERVER_S

    teacher = write_tiny(tmp_path / "teacher", seed=5)
    srv = None
    if served:
        srv = ServerProcess(["--model", str(teacher)], port=free_port(), log_path=tmp_path / "srv.log",
                            env={"OMP_NUM_THREADS": "1"})
        srv.start(timeout=SERVER_S)
    where = [f"teacher.url={srv.url}", "teacher.model=null"] if served else [f"teacher.model={teacher}"]
    try:
        cfg = load_config("configs/opd.yaml", None, [
            *where, "teacher.top_k=4", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
            "rollout.prompts_per_step=4", "rollout.num_generations=2", "reward_pool.num_workers=0",
            "logging.progress_bar=false", "logging.plot=false"])
        tr = Trainer(cfg)
        history = tr.train()
    finally:
        if srv is not None:
            assert srv.stop() == 0
    assert len(history) == 2
    for h in history:
        assert h["distill/divergence"] > 0 and h["distill/share"] == pytest.approx(1.0)
        assert h["loss"] == pytest.approx(cfg.teacher.coef * h["distill/divergence"], rel=1e-4)
        if served:  # the teacher server's client metrics, apart from a reference server's ref/*
            assert h["teacher/requests"] == 1 and h["teacher/latency"] > 0 and "ref/requests" not in h
    batch = tr._last_batch
    ids = batch.extra["teacher_topk_ids"]
    assert ids.shape == (*batch.mask.shape, 4) and not ids[~batch.mask.bool()].any()
