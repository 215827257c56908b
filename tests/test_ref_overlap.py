"""The trainer's reference request to a server goes out right after generation, before the rewards, and its
answer is used when the algorithm left the rows alone; changed rows are asked again."""

from __future__ import annotations

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
                seen.append(tr._early is not None)
                return score(batch)

            tr.rollout.score = score_and_look
            history = tr._train()  # (train() would close the client the rest of this test still uses)
            assert seen == [True, True]
            # one request a step for the log-probs (the first step's also the pre-flight check's top-k)
            assert all(h["ref/early_request"] == 1.0 and h["ref/requests"] == 1 + (i == 0)
                       for i, h in enumerate(history))

            # rows changed after the early request (as a filtering or refilling algorithm does): asked again
            batch = tr._last_batch
            tr._early_reference(batch)
            first = batch.completion_ids[0]
            batch.completion_ids[0] = [5 if first[0] != 5 else 6, *first[1:]]  # one token rewritten
            ctx = tr.context()
            fresh = tr._reference_request(batch, ctx)
            assert ctx.metrics["ref/early_request"] == 0.0 and tr._early is None
            assert fresh.result().shape == (len(batch), batch.width)
        finally:
            tr.close()
        client = tr.reference.impl  # closed with the trainer: its request pool and its connections
        assert client._pool._shutdown and client.connections._all == []
