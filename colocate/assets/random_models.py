"""Random-weight models built in seconds, for tests and benchmarks.

Owns: the tiny byte-level tokenizer (ChatML template, SmolLM2's special-token ids), tiny
random causal LMs of every family docs/config.md lists (`Arch`), one-label reward models
(sequence classifiers) and a bidirectional encoder (a model the reward engine must refuse),
and random-weight stand-ins of real models' shapes (`MODEL_SHAPES`: a step's time and memory
depend on the shape, not on the values). Each is seeded without touching the caller's RNG
and saved with the tiny tokenizer; every folder loads with plain `from_pretrained(path)` in
HF transformers and in SGLang.

Left out: real models and the cache (``colocate.assets.models``).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The tiny tokenizer: three special tokens at ids 0..2 (as in SmolLM2), then the 256 bytes.
TINY_PAD, TINY_BOS, TINY_EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
TINY_SPECIALS = (TINY_PAD, TINY_BOS, TINY_EOS)
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID = 0, 1, 2
TINY_VOCAB_SIZE = len(TINY_SPECIALS) + 256
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# transformers' model types a tiny random model is built for: Llama and Qwen2 for the suite;
# every family of docs/config.md's table (models.actor: which ones SGLang runs here)
Arch = Literal["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "olmo2",
               "granite", "smollm3", "glm4", "starcoder2", "stablelm"]

# Real models' shapes (architecture, hidden, intermediate, layers, heads, kv heads, vocab;
# embeddings tied as in the originals), for random-weight stand-ins: a step's time and
# memory depend on the shape, not on the values.
MODEL_SHAPES: dict[str, tuple[Arch, int, int, int, int, int, int]] = {
    "tiny": ("llama", 64, 128, 2, 4, 2, TINY_VOCAB_SIZE),
    "smollm2-135m": ("llama", 576, 1536, 30, 9, 3, 49152),
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 151936),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936),
}


def build_tiny_tokenizer(path: str | os.PathLike[str], *, max_length: int = 1024) -> Path:
    """Byte-level tokenizer (no merges): ids 0..2 are pad/bos(<|im_start|>)/eos(<|im_end|>), byte b is id 3 + b.

    Every string round-trips; no token is added automatically (as in SmolLM2); the chat
    template is ChatML. Vocabulary size is `TINY_VOCAB_SIZE` (259).
    """
    # transformers on demand: MODEL_SHAPES stays light (the CLI reads it)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIALS)}
    vocab |= {char: len(TINY_SPECIALS) + byte for byte, char in enumerate(_byte_chars())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=TINY_PAD,
        bos_token=TINY_BOS,
        eos_token=TINY_EOS,
        model_max_length=max_length,
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return Path(path)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (the alphabet of `ByteLevel`), in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def build_tiny_causal_lm(
    path: str | os.PathLike[str],
    *,
    arch: Arch = "llama",
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = TINY_VOCAB_SIZE,
    max_positions: int = 1024,
    intermediate: int | None = None,
    tied: bool | None = None,
) -> Path:
    """Random float32 causal LM of the family ``arch`` (`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...)
    plus the tiny tokenizer, in `path`. ``intermediate``: the MLP's width (2 × ``hidden``
    unless given); ``tied``: the LM head is the input embeddings (unless given: Gemma's only)."""
    from transformers import AutoModelForCausalLM  # on demand: MODEL_SHAPES stays light

    config = _tiny_config(arch, hidden, layers, heads, kv_heads, vocab, max_positions, intermediate)
    if tied is not None:
        config.tie_word_embeddings = tied
    return _save_seeded(path, seed, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def build_shaped_causal_lm(path: str | os.PathLike[str], shape: str, *, seed: int = 0) -> Path:
    """Random float32 causal LM of the named `MODEL_SHAPES` entry (with the tiny tokenizer; its
    embeddings tied as in the original), in `path`."""
    arch, hidden, intermediate, layers, heads, kv_heads, vocab = _shape(shape)
    return build_tiny_causal_lm(path, arch=arch, seed=seed, hidden=hidden, layers=layers, heads=heads,
                                kv_heads=kv_heads, vocab=vocab, max_positions=4096, intermediate=intermediate,
                                tied=shape != "tiny")


def build_shaped_reward_model(path: str | os.PathLike[str], shape: str, *, seed: int = 0,
                              score_std: float = 0.5) -> Path:
    """Random float32 one-label sequence classifier of the named `MODEL_SHAPES` entry (with the
    tiny tokenizer), in `path`: a reward model of the actor's size, as in OPPO's runs. Always a
    `LlamaForSequenceClassification` (the one family the reward engine scores chunk by chunk)
    of the shape's sizes: a Qwen2 shape differs only by its q/k/v biases."""
    _, hidden, intermediate, layers, heads, kv_heads, vocab = _shape(shape)
    return build_tiny_reward_model(path, seed=seed, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                   vocab=vocab, max_positions=4096, score_std=score_std, intermediate=intermediate)


def _shape(shape: str) -> tuple[Arch, int, int, int, int, int, int]:
    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}, got {shape!r}")
    return MODEL_SHAPES[shape]


def build_tiny_reward_model(
    path: str | os.PathLike[str],
    *,
    arch: Arch = "llama",
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = TINY_VOCAB_SIZE,
    max_positions: int = 1024,
    score_std: float = 0.5,
    intermediate: int | None = None,
) -> Path:
    """Random `{Llama,Qwen2}ForSequenceClassification` with one label; its `score` head has std `score_std`.

    `pad_token_id` is set in the config: HF pools the last non-pad token with it.
    """
    from transformers import AutoModelForSequenceClassification  # on demand: MODEL_SHAPES stays light

    config = _tiny_config(arch, hidden, layers, heads, kv_heads, vocab, max_positions, intermediate, num_labels=1)

    def make() -> torch.nn.Module:
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, score_std)
        return model

    return _save_seeded(path, seed, make)


def build_tiny_bidirectional_model(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Random one-label `BertForSequenceClassification`: a non-causal model the reward engine must refuse."""
    # transformers on demand: MODEL_SHAPES stays light (the CLI reads it)
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=1024, num_labels=1, pad_token_id=TINY_PAD_ID,
    )
    return _save_seeded(path, seed, lambda: BertForSequenceClassification(config).to(torch.float32))


def _tiny_config(
    arch: Arch, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, max_positions: int,
    intermediate: int | None = None, **extra: object
) -> PretrainedConfig:
    from transformers import AutoConfig  # on demand: MODEL_SHAPES stays light

    if arch not in typing.get_args(Arch):
        raise ValueError(f"arch must be one of {sorted(typing.get_args(Arch))}, got {arch!r}")
    if vocab < TINY_VOCAB_SIZE:
        raise ValueError(f"vocab must cover the tiny tokenizer ({TINY_VOCAB_SIZE} tokens), got {vocab}")
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **({"head_dim": hidden // heads} if arch.startswith("gemma") else {}),  # Gemma's default: 256
        max_position_embeddings=max_positions,
        tie_word_embeddings=arch.startswith("gemma"),  # Gemma's head is its input embeddings (as SGLang assumes)
        bos_token_id=TINY_BOS_ID,
        eos_token_id=TINY_EOS_ID,
        pad_token_id=TINY_PAD_ID,
        **extra,
    )


def _save_seeded(path: str | os.PathLike[str], seed: int, make: Callable[[], torch.nn.Module]) -> Path:
    """Build a model under `seed` without touching the caller's RNG; save it with the tiny tokenizer."""
    from transformers import GenerationConfig  # on demand: MODEL_SHAPES stays light

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    if model.can_generate():
        model.generation_config = GenerationConfig(
            bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID
        )
    model.save_pretrained(path)
    build_tiny_tokenizer(path, max_length=model.config.max_position_embeddings)
    return Path(path)
