"""Building the critic from a HF folder (no engine): the causal LM's backbone, quietly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from colocate.assets.random_models import build_tiny_causal_lm
from colocate.trainer.critic import VALUE_HEAD_FILE, ValueModel


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_critic_from_a_causal_lm_is_its_backbone_without_a_load_warning(tmp_path, arch):
    path = build_tiny_causal_lm(tmp_path / arch, arch=arch, seed=4)
    with CaptureLogger(logging.get_logger("transformers")) as log:  # load reports propagate here
        critic = ValueModel.from_pretrained(path)
    assert "LOAD REPORT" not in log.out, log.out
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = {f"model.{k}": v for k, v in lm.model.state_dict().items()}
    got = {k: v for k, v in critic.state_dict().items() if k.startswith("model.")}
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert not any("lm_head" in k for k in critic.state_dict())


def test_saved_critic_reloads_backbone_and_head(tmp_path):
    critic = ValueModel.from_pretrained(build_tiny_causal_lm(tmp_path / "lm", seed=5), seed=7)
    critic.save_pretrained(tmp_path / "critic")
    assert (tmp_path / "critic" / VALUE_HEAD_FILE).is_file()
    loaded = ValueModel.from_pretrained(tmp_path / "critic", seed=8)  # the saved head, not a new one
    for k, v in critic.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)

