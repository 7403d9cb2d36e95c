"""A reward model gives one score: a sequence-classification folder with more labels (or
none said, transformers' default of 2) is refused in one line naming the field (before,
the first label's logit was taken as the reward, silently: often a "negative" class)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from colocate.engine.engine_config import EngineConfig
from colocate.engine.errors import EngineStartError
from colocate.engine.start_checks import check_model, score_labels


@pytest.mark.parametrize("config, labels", [
    ({"id2label": {"0": "LABEL_0"}}, 1), ({"num_labels": 1}, 1), ({"id2label": {"0": "neg", "1": "pos"}}, 2),
    ({"num_labels": 3}, 3), ({}, 2),
])
def test_labels_are_counted_as_transformers_counts_them(tmp_path, config, labels):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    assert score_labels(config) == labels == AutoConfig.from_pretrained(tmp_path).num_labels


def test_a_reward_model_of_two_labels_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(EngineStartError) as e:
        check_model(EngineConfig(str(tmp_path), role="reward", device="cpu"), "models.reward")
    assert str(e.value) == (f"models.reward: '{tmp_path}' scores 2 labels (its config.json's id2label/num_labels; "
                            "transformers' default is 2); a reward model gives one score: save it with num_labels=1")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                      "num_labels": 1}))
    assert check_model(EngineConfig(str(tmp_path), role="reward", device="cpu"), "models.reward") == \
        "LlamaForSequenceClassification"
