"""A weight push leaves a tied head out (``trainer.state_size.tied_copies``): the engine's model
ties it to the embeddings itself (SGLang's Llama and Qwen2 skip ``lm_head.weight`` when tied),
and pushing it cost a Qwen2.5-0.5B-shaped run 272 of its 1,202 MB a step on an H100, with a
"Parameter lm_head.weight not found" line from SGLang at every push."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from colocate.trainer.state_size import sync_numels, tied_copies


def _small(cls, config_cls, tied: bool):
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return cls(config)


@pytest.mark.parametrize("cls,config_cls", [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)])
def test_a_tied_head_is_left_out_of_the_push_and_an_untied_one_is_pushed(cls, config_cls):
    tied = _small(cls, config_cls, tied=True)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight and "lm_head.weight" in tied.state_dict()
    assert tied_copies(tied) == {"lm_head.weight"}
    pushed = sum(t.numel() for name, t in tied.state_dict().items() if name != "lm_head.weight")
    assert sync_numels(tied, lora=False) == (pushed, pushed)
    untied = _small(cls, config_cls, tied=False)
    assert tied_copies(untied) == frozenset()
    whole = sum(t.numel() for t in untied.state_dict().values())
    assert sync_numels(untied, lora=False) == (whole, whole)
