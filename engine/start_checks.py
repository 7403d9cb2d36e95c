"""Checks that turn bad engine input into one line before SGLang sees it.

Owns: the model folder checks (missing folder, wrong model family, non-causal reward
model, shipped model code), the allocator setting SGLang's memory saver cannot work with,
and reading SGLang's start-up failures into a one-line :class:`EngineStartError` with a
hint. Leaves out: starting the engine (``engine.runtime``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from .errors import EngineStartError

# Causal (decoder-only) sequence-classification models: a score at a position depends
# only on the tokens before it, the only kind the incremental reward path is exact for.
# Only architectures whose SGLang scores were checked equal to HF are accepted: SGLang
# 0.5.23's Qwen2ForSequenceClassification adds a score bias no checkpoint fills (every
# score shifted by a random constant), so it is refused until that is handled.
CAUSAL_REWARD_ARCHS = frozenset({"LlamaForSequenceClassification"})



def read_architecture(model_path: str, field: str) -> str:
    """The ``architectures[0]`` of a model folder, or a one-line error naming ``field``."""
    folder = Path(model_path).expanduser()
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise EngineStartError(
            f"{field}: no model at '{model_path}' (no config.json there); "
            "run `colocate prepare` or pass a Hugging Face model folder"
        )
    archs = json.loads(cfg.read_text()).get("architectures") or [""]
    return archs[0]


def check_remote_code(model_path: str, field: str, trusted: bool) -> None:
    """A model folder whose config maps its classes to code it ships (``auto_map``) runs
    that code when loaded: refuse it unless ``models.trust_remote_code`` says so."""
    cfg_file = Path(model_path).expanduser() / "config.json"
    if trusted or not cfg_file.is_file():
        return
    if json.loads(cfg_file.read_text()).get("auto_map"):
        raise EngineStartError(
            f"{field}: '{model_path}' ships its own model code (auto_map in config.json), which "
            "colocate does not run by default; set models.trust_remote_code=true if you trust it")


def check_model(cfg, field: str) -> str:
    """Validate the model folder for ``cfg.role`` (an ``EngineConfig``) before starting SGLang."""
    arch = read_architecture(cfg.model_path, field)
    check_remote_code(cfg.model_path, field, cfg.trust_remote_code)
    if cfg.role == "actor" and not arch.endswith("ForCausalLM"):
        raise EngineStartError(
            f"{field}: '{cfg.model_path}' is a {arch or 'model without architectures'}; "
            "the actor must be a causal LM (…ForCausalLM)"
        )
    if cfg.role == "reward" and arch not in CAUSAL_REWARD_ARCHS:
        raise EngineStartError(
            f"{field}: '{cfg.model_path}' is a {arch or 'model without architectures'}; "
            "the reward model must be a causal (decoder-only) sequence-classification "
            f"model, one of {sorted(CAUSAL_REWARD_ARCHS)}, so chunks can be scored incrementally"
        )
    return arch


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def check_allocator_conf(environ: Mapping[str, str]) -> None:
    """SGLang's memory saver (torch_memory_saver) cannot work with torch's expandable
    segments; an engine started under ``expandable_segments:True`` (often inherited from a
    training script) refuses to start deep inside SGLang. Say so in one line instead."""
    for var in ALLOC_CONF_VARS:
        for item in environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                raise EngineStartError(
                    f"{var} sets expandable_segments:True, which SGLang's memory saver (the engines' "
                    f"sleep/wake between rollout and training) cannot work with; unset it or set "
                    f"{var}=expandable_segments:False")


MEMORY_MARKERS = ("out of memory", "not enough memory", "cannot allocate memory", "memoryerror")


def start_error(cfg, exc: BaseException) -> EngineStartError:
    """A one-line `EngineStartError` with a hint read from SGLang's start-up failure."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    low = text.lower()
    if "duplicated timeseries" in low:
        hint = "another engine in this process already has SGLang metrics on; set enable_metrics=False"
    elif "exit code: -9" in low or any(m in low for m in MEMORY_MARKERS):
        # SGLang's generic "scheduler died" text names "the OS OOM killer" as a common cause
        # whatever the exit code, so only a SIGKILL or an explicit memory error counts here
        hint = "not enough memory: lower max_total_tokens / mem_fraction_static or use a smaller model"
    elif "not supported" in low or "architecture" in low:
        hint = "SGLang does not support this architecture"
    elif "died during initialization" in low:
        hint = "its scheduler process failed while starting; set engines.log_level=info for SGLang's own error"
    else:
        hint = "set engines.log_level=info for SGLang's own log"
    return EngineStartError(f"could not start the {cfg.label}: {hint} ({text[:200]})")
