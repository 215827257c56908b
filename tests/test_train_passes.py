"""The training passes: micro-batches by a token budget, the optimizer-state precision, and how often a pass
makes the host wait for the device."""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from grpo.foundation.batch import micro_batches
from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config

SMALL = ["algo.beta=0", "logging.progress_bar=false", "rollout.prompts_per_step=4", "rollout.num_generations=4",
         "rollout.max_completion_length=6"]


@pytest.mark.parametrize("budget, rows", [(1, 100), (12, 100), (30, 100), (30, 3), (1000, 5)])
def test_token_budget_micro_batches_cover_every_row_within_the_budget(budget, rows):
    g = torch.Generator().manual_seed(budget)
    lengths = torch.randint(1, 20, (37,), generator=g).tolist()
    mbs = micro_batches(lengths, rows, budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(37))  # every row once
    for mb in mbs:
        assert len(mb) <= rows
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= budget  # a longer row goes alone
    flat = [lengths[i] for mb in mbs for i in mb]
    assert flat == sorted(flat)  # by length: each micro-batch pads only to its own longest
    assert micro_batches(lengths, rows, 0) == micro_batches(lengths, rows)  # 0: rows only, as before


def test_new_train_keys_are_validated():
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        load_config(overrides=["train.micro_batch_tokens=-5"])
    with pytest.raises(ConfigError, match="optimizer_states"):
        load_config(overrides=["train.optimizer_states=fp8"])
    with pytest.raises(ConfigError, match="optimizer_states='bf16'.*model.dtype='bf16'"):
        load_config(overrides=["train.optimizer_states=bf16", "model.dtype=fp32"])
    with pytest.raises(ConfigError, match="logprob_chunk_size"):
        load_config(overrides=["train.logprob_chunk_size=-1"])
    cfg = load_config(overrides=["train.micro_batch_tokens=4096", "train.optimizer_states=bf16", "model.dtype=bf16"])
    assert cfg.train.micro_batch_tokens == 4096 and cfg.train.optimizer_states == "bf16"


def test_chunk_size_zero_is_chosen_by_device():
    from grpo.foundation.logprobs import device_chunk_size

    assert device_chunk_size(0, torch.device("cpu")) == 256
    assert device_chunk_size(0, torch.device("cuda")) == 512
    assert device_chunk_size(64, torch.device("cuda")) == 64


def _gradient(trainer, batch):
    from grpo.foundation import rl_math

    loss = trainer.accumulate_gradients(batch, rl_math.StepNorms(len(batch), float(batch.mask.sum()), batch.width), {})
    grad = torch.cat([p.grad.reshape(-1).double() for p in trainer.model.parameters() if p.grad is not None])
    trainer.engine.zero_grad()
    return loss, grad


@contextlib.contextmanager
def fixed_batch_trainer(tmp_path):
    """(config, a one-rank Trainer with micro-batches of 16 rows, the fixed 16-row batch with its advantages); the
    Trainer is closed after."""
    from tests.dist_grad_worker import global_batch
    from grpo.training.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, "train.micro_batch_size=16", f"train.output_dir={tmp_path}"])
    tr = Trainer(cfg)
    try:
        batch = global_batch(tr.model.config.vocab_size)
        batch.advantages = tr.algo.advantages(batch, None)
        yield cfg, tr, batch
    finally:
        tr.close()


def assert_same_step(got, expected):
    """Two (loss, gradient) pairs of the same step: equal to float32 rounding."""
    (l2, g2), (loss, grad) = got, expected
    assert float(l2) == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(g2, grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item())


def test_token_budget_gives_the_row_split_gradient(single_rank_env, tmp_path):
    """The same step's gradient and loss with micro-batches of 16 rows, 3 rows, and a budget of 20 tokens."""
    with fixed_batch_trainer(tmp_path) as (cfg, tr, batch):
        results = {}
        for name, rows, tokens in [("rows16", 16, 0), ("rows3", 3, 0), ("tok20", 16, 20)]:
            cfg.train.micro_batch_size, cfg.train.micro_batch_tokens = rows, tokens
            results[name] = (_gradient(tr, batch), len(tr.micro_batches(batch)))
        assert results["rows16"][1] == 1 and results["tok20"][1] > 2  # the budget really split the batch
        (loss, grad), _ = results["rows16"]
        assert grad.abs().max() > 1e-3
        for name in ("rows3", "tok20"):
            assert_same_step(results[name][0], (loss, grad))


def test_share_prompt_off_gives_the_same_gradient_from_one_forward_per_row(single_rank_env, tmp_path, monkeypatch):
    """train.share_prompt=false: the policy's passes run every prompt + completion row in one forward (no group's
    prompt run once): the same loss, gradient and old log-probs as the shared path, which really shared."""
    from grpo.foundation import logprobs

    shared_calls = []
    plain = logprobs._shared_prefix_hidden
    monkeypatch.setattr(logprobs, "_shared_prefix_hidden", lambda *a: shared_calls.append(1) or plain(*a))
    with fixed_batch_trainer(tmp_path) as (cfg, tr, batch):
        results = {}
        for share in (True, False):
            cfg.train.share_prompt = share
            shared_calls.clear()
            old, _ = tr.policy_logprobs(batch, False)
            results[share] = (_gradient(tr, batch), old, len(shared_calls))
        (loss, grad), old, calls = results[True]
        step2, old2, calls2 = results[False]
        assert calls == 2 and calls2 == 0  # the old log-probs' pass and the training pass shared; then neither
        assert grad.abs().max() > 1e-3
        assert_same_step(step2, (loss, grad))
        torch.testing.assert_close(old2, old, rtol=0, atol=1e-5)


@pytest.mark.parametrize("zero", [0, 2])
def test_bf16_optimizer_states_build_and_step(single_rank_env, tmp_path, zero):
    """train.optimizer_states=bf16: Adam's moments are bf16 (no fp32 copy), and a step moves the weights;
    fp32 (the default) keeps them in fp32."""
    from tests.dist_grad_worker import global_batch
    from grpo.training.trainer import Trainer

    for states in ("bf16", "fp32"):
        cfg = load_config(overrides=[*SMALL, "model.dtype=bf16", f"train.optimizer_states={states}",
                                     f"train.zero_stage={zero}", "train.lr=1e-2",
                                     f"train.output_dir={tmp_path / states}"])
        tr = Trainer(cfg)
        try:
            batch = global_batch(tr.model.config.vocab_size)  # rewards that differ within groups: a gradient
            batch.advantages = tr.algo.advantages(batch, None)
            before = [p.detach().clone() for p in tr.model.parameters()]
            finite, grad_norm = tr.optimizer_step(tr.accumulate_gradients(batch, tr.step_norms(batch), {}))
            opt = getattr(tr.engine.optimizer, "optimizer", tr.engine.optimizer)
            dtypes = {v.dtype for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()}
            assert dtypes == {torch.bfloat16 if states == "bf16" else torch.float32}, (states, dtypes)
            assert all(p.dtype == torch.bfloat16 for p in tr.model.parameters())
            assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
            assert finite and grad_norm > 0
        finally:
            tr.close()
    assert_muon_skipped()


def assert_muon_skipped():
    """The engine was built and stepped with DeepSpeed's Muon modules as stand-ins (skip_deepspeed_muon)."""
    import sys

    from grpo.training.deepspeed_engine import MUON_MODULES

    for name in MUON_MODULES:
        assert "stand-in" in (sys.modules[name].__doc__ or ""), f"{name} was loaded: torch's compiler stack with it"


def test_deepspeeds_muon_is_a_stand_in_nothing_is_an_instance_of():
    import sys

    from grpo.training.deepspeed_engine import MUON_MODULES, make_adamw, skip_deepspeed_muon

    skip_deepspeed_muon()
    assert_muon_skipped()
    muon = sys.modules["deepspeed.runtime.zero.muon.muon_optimizer"].MuonWithAuxAdam
    adamw = make_adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    assert not isinstance(adamw, muon)
    with pytest.raises(RuntimeError, match="trains with AdamW"):
        muon([])
    with pytest.raises(RuntimeError, match="trains with AdamW"):
        sys.modules["deepspeed.runtime.zero.muon.original_muon"].muon_update(torch.ones(2), torch.ones(2))
    assert set(MUON_MODULES["deepspeed.runtime.zero.muon.original_muon"]) == {"muon_update", "adam_update"}


class _OurSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that make the host wait for the device (a value read, a data-dependent shape),
    apart from those inside transformers' mask code (its padding check reads the mask once or twice per
    forward with padding: outside this project)."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.ours = self.transformers = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            if any("transformers" in f.filename for f in traceback.extract_stack()):
                self.transformers += 1
            else:
                self.ours += 1
        return func(*args, **(kwargs or {}))


def test_training_pass_reads_the_device_once_not_per_micro_batch(single_rank_env, tmp_path):
    """accumulate_gradients with 1 and with 6 micro-batches: the same number of our host reads (the loss
    and stats are summed on the device and read together at the end)."""
    from tests.dist_grad_worker import global_batch
    from grpo.foundation import rl_math
    from grpo.training.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, f"train.output_dir={tmp_path}"])
    tr = Trainer(cfg)
    try:
        batch = global_batch(tr.model.config.vocab_size)
        batch.advantages = tr.algo.advantages(batch, None)
        counts = {}
        for rows in (16, 3):
            cfg.train.micro_batch_size = rows
            with _OurSyncs() as c:
                stats: dict = {}
                tr.accumulate_gradients(batch, rl_math.StepNorms(len(batch), float(batch.mask.sum()), batch.width), stats)
            tr.engine.zero_grad()
            counts[rows] = (c.ours, c.transformers, len(tr.micro_batches(batch)))
            assert stats and all(float(c_) > 0 for _, c_ in stats.values())  # the stats still arrive
        assert counts[16][2] == 1 and counts[3][2] == 6
        assert counts[3][0] == counts[16][0] <= 1, counts  # one read per pass over the batch, none per micro-batch
    finally:
        tr.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage0_grad_norm_is_the_global_l2_norm(dtype):
    """Without ZeRO the gradient norm comes from one multi-tensor kernel: the float64 sqrt(sum g^2) of every grad."""
    from types import SimpleNamespace

    from grpo.training.deepspeed_engine import stage0_grad_norm

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False), torch.nn.Linear(3, 2)).to(dtype)
    for p in module.parameters():
        p.grad = torch.randn_like(p) * 3
    module[2].bias.grad = None  # a parameter without a gradient is left out
    want = sum(float((p.grad.double() ** 2).sum()) for p in module.parameters() if p.grad is not None) ** 0.5
    engine = SimpleNamespace(module=module)
    assert stage0_grad_norm(engine, 0) == pytest.approx(want, rel=1e-6)
    assert stage0_grad_norm(engine, 2) is None
    assert stage0_grad_norm(SimpleNamespace(module=torch.nn.Linear(2, 2)), 0) == 0.0
