"""trainer/lora.py without a trainer: the merge of a PEFT model's adapters into HF-named
weights against PEFT's own merge, the settings' validation, and a target matching nothing
(refused by PEFT, and at start-up on the model folder's skeleton: ``check_targets``)."""

from __future__ import annotations

import copy

import pytest
import torch

from colocate.trainer.errors import TrainerConfigError
from colocate.trainer.lora import adapted_weight, add_lora, check_targets, is_lora, merged_weights, peft_config
from colocate.trainer.sections import LoraConfig

RANK, ALPHA = 4, 8.0
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all-linear on Llama
LAYERS = 2


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def peft_model():
    """A tiny Llama in PEFT's LoRA (all-linear) with random, non-zero B (PEFT starts it at 0)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


def test_merged_weights_equal_peft_merge_and_unload(peft_model):
    merged = dict(merged_weights(peft_model.state_dict().items(), ALPHA / RANK))
    expected = {f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight"
                for i in range(LAYERS) for m in ADAPTED}
    assert set(merged) == expected  # HF names of the adapted linears only: no embeddings, norms, LM head
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
        base = peft_model.state_dict()[f"base_model.model.{name.removesuffix('.weight')}.base_layer.weight"]
        assert (tensor - base).abs().max() > 1e-3, name  # the adapters moved it: not the base passed through


def test_merged_weights_need_only_the_adapted_tensors(peft_model):
    state = peft_model.state_dict()
    kept = [(n, t) for n, t in state.items() if adapted_weight(n)]
    assert len(kept) == 3 * LAYERS * len(ADAPTED)  # base weight, A, B of each adapted linear
    assert not any(adapted_weight(n) for n in state if "embed_tokens" in n or "norm" in n or "lm_head" in n)
    full, filtered = dict(merged_weights(state.items(), 2.0)), dict(merged_weights(kept, 2.0))
    assert full.keys() == filtered.keys()
    assert all(torch.equal(full[k], filtered[k]) for k in full)
    assert is_lora(peft_model) and not is_lora(tiny_llama())


def test_merged_weights_refuse_a_missing_pair(peft_model):
    lonely = "base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight"
    pairs = [(n, t) for n, t in peft_model.state_dict().items() if n != lonely]
    with pytest.raises(ValueError, match=r"without their pair.*layers\.1\.mlp\.up_proj"):
        list(merged_weights(pairs, 2.0))


@pytest.mark.parametrize("field, value", [("rank", -1), ("alpha", 0.0), ("dropout", 1.0), ("target_modules", " ")])
def test_the_lora_section_names_the_bad_field(field, value):
    with pytest.raises(TrainerConfigError, match=rf"^lora\.{field} must"):
        LoraConfig(**{field: value})


def test_the_lora_sections_derived_values():
    off = LoraConfig()
    assert not off.on_actor and not off.on_critic  # rank 0: full fine-tuning
    only_actor = LoraConfig(rank=8, alpha=32.0, critic=False)
    assert only_actor.on_actor and not only_actor.on_critic and only_actor.scaling == 4.0
    assert peft_config(LoraConfig(rank=2, target_modules=" q_proj , v_proj ")).target_modules == {"q_proj", "v_proj"}


def test_add_lora_freezes_the_base_and_refuses_a_target_matching_nothing():
    model = add_lora(tiny_llama(), LoraConfig(rank=RANK, alpha=ALPHA, target_modules="q_proj,v_proj"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    with pytest.raises(TrainerConfigError, match=r"^lora\.target_modules='nope_proj'"):
        add_lora(tiny_llama(), LoraConfig(rank=RANK, target_modules="nope_proj"))


def test_add_lora_names_a_module_peft_cannot_adapt_in_one_line():
    with pytest.raises(TrainerConfigError) as e:
        add_lora(tiny_llama(), LoraConfig(rank=RANK, target_modules="mlp"))
    assert str(e.value).startswith("lora.target_modules='mlp': a target names a LlamaMLP, which PEFT cannot adapt")
    assert "\n" not in str(e.value)


def test_check_targets_reads_the_folders_skeleton_and_refuses_what_peft_would_or_would_skip(tmp_path):
    """PEFT adapts q_proj alone for q_proj,nope (a typo among several names, silently); the check
    refuses it, and what PEFT refuses, before any weight is read; all-linear is not looked at."""
    from colocate.assets.random_models import build_tiny_causal_lm

    folder = str(build_tiny_causal_lm(tmp_path / "actor", seed=0))
    check_targets(folder, LoraConfig(rank=RANK, target_modules="q_proj,v_proj"))
    check_targets(folder, LoraConfig(rank=RANK, target_modules="lm_head"))  # the causal LM has one
    check_targets(str(tmp_path / "no such folder"), LoraConfig(rank=RANK))  # all-linear: nothing read
    with pytest.raises(TrainerConfigError) as e:
        check_targets(folder, LoraConfig(rank=RANK, target_modules="q_proj,nope"))
    assert str(e.value) == ("lora.target_modules='q_proj,nope': nope names no module of llama; its linears: "
                            "down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj, or all-linear")
    with pytest.raises(TrainerConfigError, match="names a LlamaMLP, which PEFT cannot adapt"):
        check_targets(folder, LoraConfig(rank=RANK, target_modules="mlp"))
    with pytest.raises(TrainerConfigError, match=r"lm_head names no module of the critic's llama backbone "
                                                 r"\(or lora.critic=false\)"):
        check_targets(folder, LoraConfig(rank=RANK, target_modules="lm_head"), backbone=True)
