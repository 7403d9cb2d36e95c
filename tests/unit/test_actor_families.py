"""Which architectures an actor may be before SGLang is asked (``engine.start_checks``): a
text causal LM, by transformers' own registry, so GPT-2's ``GPT2LMHeadModel`` is one
(before: refused as "not a causal LM" by its name); encoders, seq2seq and multimodal
models are refused in one line naming the field."""

from __future__ import annotations

import json

import pytest

from colocate.engine.engine_config import EngineConfig
from colocate.engine.errors import EngineStartError
from colocate.engine.start_checks import check_model, is_causal_lm


@pytest.mark.parametrize("arch, causal", [
    ("LlamaForCausalLM", True), ("OPTForCausalLM", True), ("GPT2LMHeadModel", True),
    ("BertForMaskedLM", False), ("T5ForConditionalGeneration", False), ("Gemma3ForConditionalGeneration", False),
    ("LlamaForSequenceClassification", False), ("", False),
])
def test_a_causal_lm_is_what_transformers_registers_as_one(arch, causal):
    assert is_causal_lm(arch) is causal


def test_an_actor_that_is_not_a_causal_lm_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(EngineStartError) as e:
        check_model(EngineConfig(str(tmp_path), role="actor", device="cpu"), "models.actor")
    assert str(e.value) == (f"models.actor: '{tmp_path}' is a BertForMaskedLM; the actor must be a causal LM "
                            "(…ForCausalLM, or GPT-2's LMHeadModel)")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert check_model(EngineConfig(str(tmp_path), role="actor", device="cpu"), "models.actor") == "GPT2LMHeadModel"
