"""The trainer's reference request to a server goes out right after generation, before the rewards (in a streamed
step each group's as soon as it is whole, while the other rows decode), and each group's answer is used when the
algorithm left its rows alone; changed groups are asked again (grpo/training/reference_requests.py)."""

from __future__ import annotations

import pytest
import torch

from tests.test_ref_client import serving

from grpo.training.configure import load_config
from grpo.training.trainer import Trainer

SMALL = ["logging.progress_bar=false", "logging.plot=false", "rollout.prompts_per_step=2", "rollout.num_generations=2",
         "rollout.max_completion_length=4", "reward_pool.num_workers=0", "algo.beta=0.04"]


def test_reference_request_overlaps_the_rewards(single_rank_env, tmp_path):
    with serving() as srv:
        cfg = load_config(None, "grpo", [*SMALL, f"ref.url={srv.url}", "train.max_steps=2",
                                         f"train.output_dir={tmp_path}"])
        tr = Trainer(cfg)
        try:
            seen = []  # at each scoring: whether the step's reference request was already in flight
            score = tr.rollout.score

            def score_and_look(batch):
                seen.append(bool(tr.asked.asked))
                return score(batch)

            tr.rollout.score = score_and_look
            history = tr._train()  # (train() would close the client the rest of this test still uses)
            assert seen == [True, True]
            # one request a step for the log-probs (the first step's also the pre-flight check's top-k)
            assert all(h["ref/early_request"] == 1.0 and h["ref/requests"] == 1 + (i == 0)
                       for i, h in enumerate(history))

            # a group's rows changed after the early request (as a filtering or refilling algorithm does): that
            # group is asked again, the other's early answer used
            batch = tr._last_batch
            want = tr.reference.submit(batch.packed(None, tr.tokenizer.pad_token_id), 1.0).result()
            tr.asked.early(batch)
            first = batch.completion_ids[0]
            batch.completion_ids[0] = [5 if first[0] != 5 else 6, *first[1:]]  # one token rewritten
            ctx = tr.context()
            sent = []
            submit = tr.reference.submit
            tr.reference.submit = lambda packed, t: sent.append(len(packed.length)) or submit(packed, t)
            got = tr._reference_request(batch, ctx).result()
            assert ctx.metrics["ref/early_request"] == 0.5 and sent == [2]
            assert not tr.asked.asked  # a step's unused answers (the rewritten group's first) end with it at K = 0
            assert got.shape == (len(batch), batch.width)
            torch.testing.assert_close(got[2:], want[2:], rtol=0, atol=1e-6)  # the untouched group's early answer
        finally:
            tr.close()
        client = tr.reference.impl  # closed with the trainer: its request pool and its connections
        assert client._pool._shutdown and client.connections._all == []


@pytest.mark.parametrize("ask_groups", [True, False])
def test_a_streamed_step_asks_each_group_as_it_is_whole(single_rank_env, tmp_path, ask_groups):
    """rollout.max_staleness 1: a group that becomes whole while other rows decode is asked of the server at once (G
    rows a request); the groups whole at the call's end go in one request after it; every row of the step's batch
    is answered early, with the log-probs one request for the whole batch gives. ref.ask_groups=false: every group
    after the call."""
    with serving() as srv:
        cfg = load_config(None, "grpo", [
            *SMALL, f"ref.url={srv.url}", "train.max_steps=3", f"train.output_dir={tmp_path}", "train.save_every=0",
            "rollout.prompts_per_step=4", "rollout.num_generations=4", "rollout.max_completion_length=12",
            "rollout.engine=hf", "rollout.forced_eos_lengths=[3, 3, 2, 3, 12, 12, 12, 12]",
            "rollout.max_staleness=1", "algo.tis_cap=2.0", f"ref.ask_groups={str(ask_groups).lower()}"])
        tr = Trainer(cfg)
        try:
            sizes = []
            submit = tr.reference.submit
            tr.reference.submit = lambda packed, t: sizes.append(len(packed.length)) or submit(packed, t)
            whole = []
            group = tr.asked.group
            tr.asked.group = lambda prompt, rows: whole.append(len(rows)) or group(prompt, rows)
            assert (tr.rollout.on_group is not None) == ask_groups
            if ask_groups:
                tr.rollout.on_group = tr.asked.group
            history = tr._train()
            assert (whole and set(whole) == {4} and sizes.count(4) >= len(whole)) if ask_groups else not whole
            assert all(h["ref/early_request"] == 1.0 for h in history)
            batch = tr._last_batch
            want = submit(batch.packed(None, tr.tokenizer.pad_token_id), 1.0).result().float() * batch.mask
            torch.testing.assert_close(batch.ref_logp, want, rtol=0, atol=1e-6)
        finally:
            tr.close()
