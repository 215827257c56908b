"""On-policy distillation (issue 44): the teacher's term on every token's advantage and ``--algo opd``, against
float64 computations written out here; the teacher in-process and as a ref_client.py server give the same log-probs;
a teacher with another tokenizer is refused naming both models; the config's errors."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from algos import ALGORITHMS
from grpo.foundation import rl_math
from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import StepContext
from tests.helpers import config, make_batch, policy_logp

LENGTHS = [3, 5, 1, 4, 2, 2, 5, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5]
G, W = 4, 5


def teacher_logp(batch, seed=7):
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(batch.mask.shape, generator=g, dtype=torch.float64) * 3 - 0.05) * batch.mask


def test_distilled_advantages_by_hand():
    """A_t - coef * (l_student - l_teacher)_t on completion tokens, 0 on padding; [rows] or [rows, T] advantages."""
    batch = make_batch(LENGTHS, REWARDS, G, W)
    t = teacher_logp(batch)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, -2.0], dtype=torch.float64)
    got = rl_math.distilled_advantages(adv, batch.old_logp, t, batch.mask, 0.7)
    old, tea, mask = batch.old_logp.tolist(), t.tolist(), batch.mask.tolist()
    for i in range(len(LENGTHS)):
        for j in range(W):
            want = (adv[i].item() - 0.7 * (old[i][j] - tea[i][j])) if mask[i][j] else 0.0
            assert got[i, j].item() == pytest.approx(want, abs=1e-15)
    per_token = adv.unsqueeze(-1).expand(-1, W).clone()
    assert torch.equal(rl_math.distilled_advantages(per_token, batch.old_logp, t, batch.mask, 0.7), got)


def hand_opd_loss(logp, old, tea, mask, coef, eps=0.2):
    """token-mean over the batch of -min(rho A, clip(rho) A), A_t = -coef (l_old - l_teacher)_t."""
    total, n = 0.0, 0
    for i in range(len(mask)):
        for j in range(len(mask[i])):
            if not mask[i][j]:
                continue
            a = -coef * (old[i][j] - tea[i][j])
            rho = math.exp(logp[i][j] - old[i][j])
            total += min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            n += 1
    return -total / n


def test_opd_loss_and_gradient_by_hand():
    cfg = config("opd", **{"teacher.model": "builtin:tiny-char", "teacher.coef": 0.5})
    algo = ALGORITHMS.get("opd")(cfg)
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.teacher_logp = teacher_logp(batch)
    ctx = StepContext(cfg, 0)
    batch.advantages = algo.advantages(batch, ctx)
    assert not batch.advantages.any()  # no task reward
    batch = algo.prepare_loss(batch, ctx)
    logp = policy_logp(batch)
    norms = rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)
    out = algo.loss(logp, batch, norms)
    args = (batch.old_logp.tolist(), batch.teacher_logp.tolist(), batch.mask.tolist(), 0.5)
    assert out.loss.item() == pytest.approx(hand_opd_loss(logp.detach().tolist(), *args), rel=1e-12, abs=1e-14)
    out.loss.backward()
    for i, j in [(0, 0), (1, 4), (3, 2), (6, 3)]:
        h = 1e-6
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i, j] += h
        minus[i, j] -= h
        fd = (hand_opd_loss(plus.tolist(), *args) - hand_opd_loss(minus.tolist(), *args)) / (2 * h)
        assert logp.grad[i, j].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)
    # the step's metrics, by hand: the mean gap, the teacher's mean probability, the term's share (all of it here)
    gaps = [o - t for ro, rt, rm in zip(*args[:3]) for o, t, m in zip(ro, rt, rm) if m]
    probs = [math.exp(t) for rt, rm in zip(args[1], args[2]) for t, m in zip(rt, rm) if m]
    assert ctx.metrics["distill/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-12)
    assert ctx.metrics["distill/teacher_prob"] == pytest.approx(sum(probs) / len(probs), rel=1e-12)
    assert ctx.metrics["distill/share"] == 1.0


def test_grpo_with_a_teacher_adds_the_term_to_its_group_advantages():
    """Any token-level algorithm: its own advantage A_i on every token, minus coef * gap_t (slime's form); the
    share of the term in the magnitude, by hand."""
    cfg = config("grpo", **{"teacher.url": "http://127.0.0.1:1", "teacher.coef": 0.3})
    algo = ALGORITHMS.get("grpo")(cfg)
    assert algo.needs_old_logprobs  # l_old is the student's side of the term
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.teacher_logp = teacher_logp(batch, seed=3)
    ctx = StepContext(cfg, 0)
    batch.advantages = algo.advantages(batch, ctx)
    group = batch.advantages.clone()
    batch = algo.prepare_loss(batch, ctx)
    old, tea, mask = batch.old_logp.tolist(), batch.teacher_logp.tolist(), batch.mask.tolist()
    term = task = 0.0
    for i in range(len(mask)):
        for j in range(W):
            want = (group[i].item() - 0.3 * (old[i][j] - tea[i][j])) * mask[i][j]
            assert batch.advantages[i, j].item() == pytest.approx(want, abs=1e-12)
            term += abs(0.3 * (old[i][j] - tea[i][j])) * mask[i][j]
            task += abs(group[i].item()) * mask[i][j]
    assert ctx.metrics["distill/share"] == pytest.approx(term / (term + task), rel=1e-12)
    # without a teacher: untouched, no metrics
    plain = ALGORITHMS.get("grpo")(config("grpo"))
    b2 = make_batch(LENGTHS, REWARDS, G, W)
    b2.advantages = plain.advantages(b2, StepContext(plain.cfg, 0))
    c2 = StepContext(plain.cfg, 0)
    assert plain.prepare_loss(b2, c2).advantages.dim() == 1 and not any(k.startswith("distill/") for k in c2.metrics)


@pytest.mark.parametrize("overrides, match", [
    ({"teacher.model": "a", "teacher.url": "http://x:1"}, r"teacher.model='a' and teacher.url='http://x:1': name one"),
    ({"teacher.url": "x:1"}, r"teacher.url='x:1' is invalid: give an http:// or https:// URL with a host"),
    ({"teacher.model": "a", "teacher.coef": -1}, r"teacher.coef=-1.0 is invalid: it must be >= 0"),
])
def test_teacher_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config("grpo", **overrides)


def test_opd_needs_a_teacher_and_sequence_level_losses_refuse_one():
    with pytest.raises(ConfigError, match=r"opd learns from a teacher, and none is named: set teacher.model"):
        config("opd")
    with pytest.raises(ConfigError, match=r"teacher.coef > 0 \(now 0.0\)"):
        config("opd", **{"teacher.model": "builtin:tiny-char", "teacher.coef": 0})
    with pytest.raises(ConfigError, match=r"teacher: on-policy distillation adds a term to each token's advantage, "
                                          r"and gspo has a sequence-level loss"):
        config("gspo", **{"teacher.model": "builtin:tiny-char"})
    assert config("opd", **{"teacher.model": "builtin:tiny-char", "rollout.num_generations": 1}).algo.name == "opd"


def test_the_teacher_server_gives_the_in_process_teachers_logprobs(tmp_path):
    """The same teacher in the trainer's process and behind ref_client.py (a real process on loopback): the same
    per-token log-probs, which are not the student's own, and the same top-k next tokens."""
    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.foundation.modeling import load_model, load_tokenizer
    from grpo.foundation.tiny import BUILTIN_NAME, write_tiny
    from grpo.reference.launch import ServerProcess, free_port
    from grpo.reference.teacher import make_teacher
    from tests.patience import SERVER_S

    folder = write_tiny(tmp_path / "teacher", seed=5)
    tok = load_tokenizer(BUILTIN_NAME)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (4, 7, 2)]
    completions = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (5, 1, 6)]
    packed = pack(prompts, completions, tok.pad_token_id, 6)
    local = make_teacher(config("grpo", **{"teacher.model": str(folder)}), torch.device("cpu"), tok, len(tok))
    srv = ServerProcess(["--model", str(folder)], port=free_port(), log_path=tmp_path / "srv.log",
                        env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    try:
        remote = make_teacher(config("grpo", **{"teacher.url": srv.url}), torch.device("cpu"), tok, len(tok))
        assert (local.kind, remote.kind) == ("in-process", "server")
        a, b = local.logprobs(packed, 0.8), remote.logprobs(packed, 0.8)
        ta, tb = local.submit_topk(packed, 0.8, 16).result(), remote.submit_topk(packed, 0.8, 16).result()
    finally:
        assert srv.stop() == 0
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the top-k (the teacher's support for the exact divergence): the same from both, and the model's own
    torch.testing.assert_close(ta.logprobs, a, rtol=0, atol=0)
    torch.testing.assert_close(ta.topk_logprobs, tb.topk_logprobs, rtol=0, atol=1e-6)
    assert torch.equal(ta.topk_ids, tb.topk_ids) and ta.topk_ids.shape == (3, 6, 16)
    with torch.no_grad():
        full = completion_scores(load_model(config("grpo").model, str(folder)), packed, 0.8, top_k=16)
    torch.testing.assert_close(ta.topk_logprobs, full.topk_logprobs.float(), rtol=0, atol=1e-6)
    with torch.no_grad():
        own = completion_scores(load_model(config("grpo").model, BUILTIN_NAME), packed, 0.8).logprobs
        want = completion_scores(load_model(config("grpo").model, str(folder)), packed, 0.8).logprobs
    torch.testing.assert_close(a, want.float(), rtol=0, atol=1e-6)
    assert (a - own.float()).abs().max() > 1e-3


def test_one_server_holds_the_reference_and_the_teacher(tmp_path):
    """ref_client.py --model REF --teacher-model TEACHER (a real process on loopback): ref.url gets REF's log-probs,
    teacher.url (the same server) TEACHER's, each equal to its in-process computation; a server without a teacher
    answers a teacher request with 404 naming --teacher-model; a teacher of another tokenizer is refused at start."""
    import requests

    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.foundation.modeling import load_model, load_tokenizer
    from grpo.foundation.tiny import BUILTIN_NAME, write_tiny
    from grpo.reference.handle import make_reference
    from grpo.reference.launch import ServerProcess, free_port
    from grpo.reference.teacher import make_teacher
    from grpo.reference.wire import CONTENT_TYPE, encode_request
    from tests.patience import SERVER_S

    ref, teacher = write_tiny(tmp_path / "ref", seed=3), write_tiny(tmp_path / "teacher", seed=5)
    tok = load_tokenizer(BUILTIN_NAME)
    g = torch.Generator().manual_seed(1)
    packed = pack([torch.randint(4, 60, (n,), generator=g).tolist() for n in (4, 6)],
                  [torch.randint(4, 60, (n,), generator=g).tolist() for n in (5, 3)], tok.pad_token_id, 5)
    srv = ServerProcess(["--model", str(ref), "--teacher-model", str(teacher)], port=free_port(),
                        log_path=tmp_path / "srv.log", env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    try:
        cfg = config("grpo", **{"ref.url": srv.url, "teacher.url": srv.url})
        served_ref = make_reference(cfg, True, torch.device("cpu"), tok, len(tok))
        served_teacher = make_teacher(cfg, torch.device("cpu"), tok, len(tok))
        a, b = served_ref.logprobs(packed, 0.9), served_teacher.logprobs(packed, 0.9)
        assert requests.get(srv.url + "/v1/info").json()["teacher"]["model"] == str(teacher)
    finally:
        assert srv.stop() == 0
    with torch.no_grad():
        want_ref = completion_scores(load_model(cfg.model, str(ref)), packed, 0.9).logprobs
        want_teacher = completion_scores(load_model(cfg.model, str(teacher)), packed, 0.9).logprobs
    torch.testing.assert_close(a, want_ref.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(b, want_teacher.float(), rtol=0, atol=1e-6)
    plain = ServerProcess(["--model", str(ref)], port=free_port(), log_path=tmp_path / "plain.log",
                          env={"OMP_NUM_THREADS": "1"})
    plain.start(timeout=SERVER_S)
    try:
        resp = requests.post(plain.url + "/v1/logprobs", data=encode_request(packed, 1.0, model="teacher"),
                             headers={"Content-Type": CONTENT_TYPE})
    finally:
        assert plain.stop() == 0
    assert resp.status_code == 404 and "--teacher-model" in resp.json()["error"] and resp.json()["field"] == "model"
    other = write_tiny(tmp_path / "other", seed=1, charset="0123456789+-=")
    bad = ServerProcess(["--model", str(ref), "--teacher-model", str(other)], port=free_port(),
                        log_path=tmp_path / "bad.log", env={"OMP_NUM_THREADS": "1"})
    with pytest.raises(RuntimeError, match=r"the reference server exited with code 2"):
        bad.start(timeout=SERVER_S)
    bad.stop()
    assert re.search(r"--teacher-model '.*other': its tokenizer \(\d+ tokens\) is not the reference",
                     (tmp_path / "bad.log").read_text())


def test_a_teacher_that_is_the_reference_or_the_policy_is_refused(tmp_path):
    """Issue 58 item 3: teacher.url at the run's reference server started without --teacher-model quietly answered
    with the reference (advantage, loss and grad_norm 0 every step, rc 0). Refused at start naming the flag; so is
    a teacher that is the policy's starting model or the reference (by folder, or by a server's weights hash)."""
    import shutil

    from grpo.foundation.modeling import load_tokenizer
    from grpo.foundation.tiny import BUILTIN_NAME, write_tiny
    from grpo.reference.handle import make_reference
    from grpo.reference.launch import ServerProcess, free_port
    from grpo.reference.teacher import make_teacher
    from tests.patience import SERVER_S

    ref = write_tiny(tmp_path / "ref", seed=3)
    copy = Path(shutil.copytree(ref, tmp_path / "ref-copy"))
    tok, cpu = load_tokenizer(BUILTIN_NAME), torch.device("cpu")
    # in the trainer's process: the policy's own model, or the reference's folder
    with pytest.raises(ConfigError, match=r"teacher.model='builtin:tiny-char' serves the teacher 'builtin:tiny-char', "
                                          r"and it is the policy's starting model \(model.name_or_path="):
        make_teacher(config("grpo", **{"teacher.model": BUILTIN_NAME}), cpu, tok, len(tok))
    cfg = config("grpo", **{"teacher.model": str(ref), "ref.model": str(ref)})
    with pytest.raises(ConfigError, match=r"and it is the run's reference .* the distillation term would be 0"):
        make_teacher(cfg, cpu, tok, len(tok), reference=make_reference(cfg, True, cpu, tok, len(tok)))
    servers = [ServerProcess(["--model", str(folder)], port=free_port(), log_path=tmp_path / f"{folder.name}.log",
                             env={"OMP_NUM_THREADS": "1"}) for folder in (ref, copy)]
    for srv in servers:
        srv.start(timeout=SERVER_S)
    try:
        plain, twin = (srv.url for srv in servers)
        cfg = config("grpo", **{"ref.url": plain, "teacher.url": plain})
        reference = make_reference(cfg, True, cpu, tok, len(tok))
        with pytest.raises(ConfigError, match=rf"teacher.url='{plain}' is the reference server \(ref.url\), and it "
                                              r"holds no teacher: it was started without --teacher-model"):
            make_teacher(cfg, cpu, tok, len(tok), reference=reference)
        # another server on the same weights (another folder): the same hash
        cfg = config("grpo", **{"ref.url": plain, "teacher.url": twin})
        with pytest.raises(ConfigError, match=r"its weights are the reference's \(ref.url=.* serves the same weights"):
            make_teacher(cfg, cpu, tok, len(tok), reference=reference)
        # the teacher's server holds the policy's starting model
        cfg = config("grpo", **{"model.name_or_path": str(ref), "teacher.url": plain})
        with pytest.raises(ConfigError, match=r"and it is the policy's starting model"):
            make_teacher(cfg, cpu, tok, len(tok))
        # a server on the teacher alone, without a reference or with the in-process one: taken
        cfg = config("grpo", **{"teacher.url": twin})
        assert make_teacher(cfg, cpu, tok, len(tok), reference=make_reference(cfg, True, cpu, tok, len(tok))).remote
    finally:
        for srv in servers:
            assert srv.stop() == 0


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from grpo.foundation.modeling import load_tokenizer
    from grpo.foundation.tiny import BUILTIN_NAME
    from grpo.reference.teacher import make_teacher

    tok = load_tokenizer(BUILTIN_NAME)
    cfg = config("grpo", **{"teacher.model": "builtin:tiny-arith"})
    with pytest.raises(ConfigError, match=r"teacher.model='builtin:tiny-arith' cannot teach model.name_or_path="
                                          r"'builtin:tiny-char': its tokenizer \(\d+ tokens\) is not the policy's"):
        make_teacher(cfg, torch.device("cpu"), tok, len(tok))


@pytest.mark.parametrize("algo", ["opd", "grpo"])
def test_a_run_distils_from_an_in_process_teacher(single_rank_env, tmp_path, algo):
    """Two steps through the Trainer: the teacher's log-probs reach the batch, the metrics are logged, and opd's
    loss is the teacher's term alone (grpo's: its group advantages plus the term)."""
    from grpo.foundation.tiny import write_tiny
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    teacher = write_tiny(tmp_path / "teacher", seed=5)
    cfg = load_config("configs/opd.yaml", algo, [
        f"teacher.model={teacher}", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
        "rollout.prompts_per_step=4", "rollout.num_generations=2", "reward_pool.num_workers=0",
        "logging.progress_bar=false", "logging.plot=false", "algo.beta=0"])
    tr = Trainer(cfg)
    assert tr.teacher is not None and tr.teacher.kind == "in-process"
    history = tr.train()
    assert len(history) == 2
    for h in history:
        assert h["distill/reverse_kl"] != 0 and 0 < h["distill/teacher_prob"] < 1 and math.isfinite(h["loss"])
        assert h["distill/share"] == 1.0 if algo == "opd" else 0 < h["distill/share"] <= 1
        assert h["time/teacher"] > 0  # the in-process teacher's forward, apart from the old-policy pass
    batch = tr._last_batch
    assert batch.teacher_logp is not None and batch.advantages.shape == batch.mask.shape


def test_opd_needs_no_reward_function(single_rank_env, tmp_path):
    """rewards: [] with opd: no reward workers, no reward metrics, the teacher's term alone; any algorithm that
    learns from rewards still refuses an empty list, and evaluation then needs its own correctness reward."""
    from grpo.foundation.tiny import write_tiny
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    teacher = write_tiny(tmp_path / "teacher", seed=5)
    cfg = load_config("configs/opd.yaml", None, [
        f"teacher.model={teacher}", "rewards=[]", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
        "rollout.prompts_per_step=4", "rollout.num_generations=1", "logging.progress_bar=false",
        "logging.plot=false"])
    tr = Trainer(cfg)
    assert tr.rewards is None
    history = tr.train()
    assert len(history) == 2 and all(h["distill/share"] == 1.0 and math.isfinite(h["loss"]) for h in history)
    assert not any(k.startswith("reward/") for h in history for k in h)
    with pytest.raises(ConfigError, match="rewards is empty: name at least one reward function"):
        config("grpo", rewards="[]")
    with pytest.raises(ConfigError, match=r"eval.every=5 scores with the first reward function, and rewards is "
                                          r"empty: set eval.correctness"):
        config("opd", **{"teacher.model": str(teacher), "rewards": "[]", "eval.every": 5, "data.eval_holdout": 10})


def opd_batch():
    """opd (coef 1) and a batch with the teacher's log-probs, its advantages and prepare_loss done."""
    cfg = config("opd", **{"teacher.model": "builtin:tiny-char"})
    algo = ALGORITHMS.get("opd")(cfg)
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.teacher_logp = teacher_logp(batch)
    ctx = StepContext(cfg, 0)
    batch.advantages = algo.advantages(batch, ctx)
    return algo, algo.prepare_loss(batch, ctx)


def test_opd_gradient_equals_trls_iw_opd_with_gamma_0():
    """TRL 1.16's IW-OPD trainer (trl/experimental/iw_opd, ``_compute_iw_opd_loss``) with iw_opd_gamma = 0: advantage
    l_teacher - l_rollout per token (detached), loss sum(-l * A) over the valid tokens / their number. Written out here
    from that definition: on the sampling policy (mu = 1, l = l_old) its gradient with respect to the policy's
    log-probs is opd's (coef 1; the values differ, -mean(l A) against -mean(rho A), the gradients do not)."""
    algo, batch = opd_batch()
    ours = batch.old_logp.clone().requires_grad_(True)  # on-policy: the current log-probs are the old ones
    algo.loss(ours, batch, rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)).loss.backward()
    theirs = batch.old_logp.clone().requires_grad_(True)
    a_opd = ((batch.teacher_logp - batch.old_logp) * batch.mask).detach()
    trl = (-theirs * a_opd * batch.mask).sum() / batch.mask.sum()
    trl.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-15)


def test_opd_advantages_equal_verl_opds_estimator():
    """verl's OPD advantage estimator as the verl-opd fork registers it (masoudhashemi/verl-opd,
    ``algorithm.adv_estimator=opd``, core_algos.compute_opd_advantage, token level, norm_adv_by_std_in_grpo False):
    advantages = -(l_student - l_teacher) * response_mask, the student's being the rollout's. Written out here; opd's
    (coef 1, the student's log-probs l_old: with mu = 1 and the hf engine the rollout's numbers) are the same."""
    algo, batch = opd_batch()
    verl = -(batch.old_logp - batch.teacher_logp) * batch.mask
    torch.testing.assert_close(batch.advantages, verl, rtol=0, atol=1e-15)


def test_a_teacher_server_that_is_gone_is_named_as_the_teacher(tmp_path):
    """Not there at start, and gone mid-run: ReferenceServerError naming teacher.url (the client's own message
    speaks of the reference)."""
    from grpo.foundation.logprobs import pack
    from grpo.foundation.modeling import load_tokenizer
    from grpo.foundation.tiny import BUILTIN_NAME
    from grpo.reference.launch import ServerProcess, free_port
    from grpo.reference.protocol import ReferenceServerError
    from grpo.reference.teacher import make_teacher
    from tests.patience import SERVER_S

    from grpo.foundation.tiny import write_tiny

    tok = load_tokenizer(BUILTIN_NAME)
    quick = {"ref.startup_wait": 0, "ref.retry_window": 0, "ref.connect_timeout": 1}
    port = free_port()
    with pytest.raises(ReferenceServerError, match=rf"the teacher's server \(teacher.url='http://127.0.0.1:{port}'"):
        make_teacher(config("grpo", **{"teacher.url": f"http://127.0.0.1:{port}", **quick}), torch.device("cpu"), tok,
                     len(tok))
    srv = ServerProcess(["--model", str(write_tiny(tmp_path / "teacher", seed=5))], port=port,
                        log_path=tmp_path / "srv.log", env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    try:
        teacher = make_teacher(config("grpo", **{"teacher.url": srv.url, **quick}), torch.device("cpu"), tok, len(tok))
        packed = pack([[5, 6, 7]], [[8, 9]], tok.pad_token_id, 2)
        assert teacher.logprobs(packed, 1.0).shape == (1, 2)
    finally:
        srv.stop()
    with pytest.raises(ReferenceServerError, match=r"the teacher's server \(teacher.url="):
        teacher.logprobs(packed, 1.0)
