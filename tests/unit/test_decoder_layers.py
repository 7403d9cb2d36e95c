"""Which blocks FSDP shards one by one (``trainer.distributed.decoder_layers``): the
classes transformers declares unsplittable (``_no_split_modules``), outermost first, so a
family whose layers are not ``model.layers`` (OPT's ``model.decoder.layers``, GPT-NeoX's
``gpt_neox.layers``) trains too (before: a TypeError traceback after the engines started)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (AutoModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, OPTConfig,
                          OPTForCausalLM)

from colocate.trainer.critic import ValueModel
from colocate.trainer.distributed import decoder_layers

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def test_a_llama_shards_its_model_layers_as_before_and_so_do_its_critic_and_its_lora_wrapper():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(intermediate_size=64, **SMALL))
    assert decoder_layers(model) == list(model.model.layers)
    backbone = AutoModel.from_config(model.config)
    assert decoder_layers(ValueModel(backbone)) == list(backbone.layers)  # the critic: its backbone's
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_layers(wrapped) == list(model.model.layers)


def test_families_with_other_layouts_shard_their_declared_blocks():
    opt = OPTForCausalLM(OPTConfig(ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64, **SMALL))
    assert decoder_layers(opt) == list(opt.model.decoder.layers)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(intermediate_size=64, **SMALL))
    assert decoder_layers(neox) == list(neox.gpt_neox.layers)


class _Inner(nn.Linear):
    pass


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner(2, 2)


class _Model(nn.Module):
    _no_split_modules = ["_Block", "_Inner"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = _Inner(2, 2)  # a declared class outside every block: a block of its own


def test_a_declared_block_inside_another_is_sharded_with_it_not_again():
    model = _Model()
    assert decoder_layers(model) == [model.blocks[0], model.blocks[1], model.head]


def test_a_sharded_models_blocks_are_found_again(world1):
    """FSDP swaps each sharded module's class for a subclass (FSDPLlamaDecoderLayer)."""
    from colocate.trainer.distributed import shard_model

    model = LlamaForCausalLM(LlamaConfig(intermediate_size=64, **SMALL))
    layers = decoder_layers(model)
    shard_model(model, world1)
    assert type(layers[0]).__name__ == "FSDPLlamaDecoderLayer" and decoder_layers(model) == layers


def test_a_model_that_declares_no_blocks_is_one_line():
    with pytest.raises(TypeError, match=r"^Linear declares no decoder layer classes \(_no_split_modules\) to shard$"):
        decoder_layers(nn.Linear(2, 2))
