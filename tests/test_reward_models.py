"""Learned reward models (grpo/scoring/models.py): a tiny LlamaForSequenceClassification built here with a fixed seed.

In-process, batching by a token budget gives the scores of one row at a time, and left- and right-padding
tokenizers give the same scores (fp32 on CPU: within 1e-5; the forward differs only in padding, so the
remaining difference is float rounding of different matrix shapes). Normalisation and clamp by hand.
"""

import math

import pytest
import torch

from grpo.foundation.config import ConfigError, RewardPoolConfig, RewardSpec
from grpo.foundation.tiny import write_tiny_classifier
from grpo.scoring.combined import CombinedReward
from grpo.scoring.models import Normalizer, RewardModel, token_batches

TOL = 1e-5
PROMPTS = ["12=", "345=", "6+7=", "1=", "99<", "a long prompt with many characters="]
COMPLETIONS = ["12", "543", "13", "", "99 and some more text", "x"]


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return {"right": write_tiny_classifier(root / "right", seed=3, padding_side="right"),
            "left": write_tiny_classifier(root / "left", seed=3, padding_side="left"),
            "other": write_tiny_classifier(root / "other", seed=4),
            "labels": write_tiny_classifier(root / "labels", seed=3, num_labels=2)}


def test_token_batches_respect_the_budget():
    lengths = [5, 1, 9, 3, 3, 20]
    batches = token_batches(lengths, 10)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 10 or len(b) == 1 for b in batches)
    assert batches == [[1, 3, 4], [0], [2], [5]]  # by length: 1,3,3 (3 x 3 = 9); 5; 9; 20 alone


def test_batched_equals_one_at_a_time_and_padding_side_does_not_matter(rm_dirs):
    right = RewardModel(str(rm_dirs["right"]), "cpu", batch_tokens=10_000)
    one = RewardModel(str(rm_dirs["right"]), "cpu", batch_tokens=1)  # every row alone
    left = RewardModel(str(rm_dirs["left"]), "cpu", batch_tokens=64)
    assert left.tokenizer.padding_side == "left" and right.tokenizer.padding_side == "right"
    texts = right.texts(PROMPTS, COMPLETIONS)
    assert texts[0] == "12=12"  # plain prompts: prompt + completion
    alone = [one.score_texts([t])[0] for t in texts]
    for got in (right.score_texts(texts), one.score_texts(texts), left.score_texts(texts)):
        assert max(abs(a - b) for a, b in zip(got, alone)) < TOL
    assert len(set(round(v, 4) for v in alone)) == len(alone)  # a real model: the rows score differently
    # a straight forward pass of one unpadded row through the HF model gives the same score
    ids = right.tokenizer(texts[1], return_tensors="pt")
    with torch.no_grad():
        direct = right.model(**ids).logits[0, 0].item()
    assert abs(direct - alone[1]) < TOL


def test_conversations_use_the_models_chat_template_and_labels_are_chosen_by_name(rm_dirs):
    rm = RewardModel(str(rm_dirs["right"]), "cpu")
    chat = [[{"role": "user", "content": "12="}]]
    assert rm.texts(chat, ["12"]) == ["u:12=\na:12\n"]  # the tiny tokenizer's template: role letter:content
    with pytest.raises(ConfigError, match=r"has 2 labels .*name one with label:"):
        RewardModel(str(rm_dirs["labels"]), "cpu")
    with pytest.raises(ConfigError, match=r"has no label 'good': its labels are \['LABEL_0', 'LABEL_1'\]"):
        RewardModel(str(rm_dirs["labels"]), "cpu", label="good")
    two = RewardModel(str(rm_dirs["labels"]), "cpu", label="LABEL_1")
    ids = two.tokenizer(["12=12"], return_tensors="pt")
    with torch.no_grad():
        assert abs(two.model(**ids).logits[0, 1].item() - two.score_texts(["12=12"])[0]) < TOL
    with pytest.raises(ConfigError, match="reward model='./no/such/rm' looks like a local folder, and .* does not exist"):
        RewardModel("./no/such/rm", "cpu")


def test_normalisation_and_clamp_by_hand():
    fixed = Normalizer("fixed", shift=1.0, scale=2.0, clamp=[-1.0, 1.0])
    assert fixed([1.0, 3.0, 7.0, -5.0]) == [0.0, 1.0, 1.0, -1.0]  # (x-1)/2 = 0, 1, 3 -> 1, -3 -> -1
    run = Normalizer("running")
    a = run([1.0, 3.0])  # mean 2, std 1
    assert all(abs(x - y) < 1e-5 for x, y in zip(a, [-1.0, 1.0]))
    b = run([5.0, 7.0])  # over 1, 3, 5, 7: mean 4, population std sqrt(5)
    s = math.sqrt(5.0)
    assert all(abs(x - y) < 1e-5 for x, y in zip(b, [1 / s, 3 / s]))


def test_a_reward_model_entry_scores_in_the_weighted_sum(rm_dirs):
    rm = RewardModel(str(rm_dirs["right"]), "cpu")
    want = rm.score_texts(rm.texts(PROMPTS, COMPLETIONS))
    specs = [RewardSpec(model=str(rm_dirs["right"]), weight=2.0, normalize="fixed", shift=0.5, scale=0.25,
                        clamp=[-3.0, 3.0]), RewardSpec(fn="digits_match")]
    r = CombinedReward(specs, RewardPoolConfig(num_workers=0))
    total, per_fn = r(["templated"] * 6, COMPLETIONS, {"answer": ["12", "x", "13", "", "y", "z"]}, raw_prompts=PROMPTS)
    name = "rm_right"
    expect_rm = [min(3.0, max(-3.0, (w - 0.5) / 0.25)) for w in want]
    assert max(abs(a - b) for a, b in zip(per_fn[name], expect_rm)) < 1e-4
    digits = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # digits_match: "" == "" scores 1
    assert max(abs(t - (2 * a + d)) for t, a, d in zip(total, expect_rm, digits)) < 1e-4
    m = r.pop_metrics()
    assert m[f"reward/{name}/latency"] > 0 and m[f"reward/{name}/errors"] == 0.0
    assert r.model_seconds() == 0.0  # reset by pop_metrics
