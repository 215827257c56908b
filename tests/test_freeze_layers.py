"""model.freeze_bottom_layers: the embeddings and the first N layers get no gradient, the rest do."""

import pytest
import torch

from grpo.foundation.config import ConfigError, ModelConfig
from grpo.foundation.modeling import load_model


def test_bottom_layers_and_embeddings_are_frozen():
    model = load_model(ModelConfig(name_or_path="builtin:tiny-char", freeze_bottom_layers=1))
    ids = torch.randint(4, 30, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    layers = model.model.layers
    assert model.get_input_embeddings().weight.grad is None  # tied to the head: both frozen
    assert all(p.grad is None for p in layers[0].parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers[1].parameters())


def test_freezing_more_layers_than_the_model_has_is_an_error():
    with pytest.raises(ConfigError, match="freeze_bottom_layers=3 is more than the model's 2 layers"):
        load_model(ModelConfig(name_or_path="builtin:tiny-char", freeze_bottom_layers=3))
