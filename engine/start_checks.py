"""Checks that turn bad engine input into one line before SGLang sees it.

Owns: the model folder checks (missing folder, wrong model family, non-causal reward
model, shipped model code, safetensors weights cut short, saved through a training wrapper or
of another config), the allocator setting SGLang's memory saver cannot work with,
SGLang's own arguments an engine is given (the ones it sets itself, unknown names and
wrong scalar types against SGLang's ``ServerArgs``), whether
SGLang can load the model (its model config built and class resolved as a scheduler would,
and the limits of its classes found here: :data:`LOAD_LIMITS`), and reading SGLang's
start-up failures (with the last line its processes wrote) into a one-line
:class:`EngineStartError` with a hint. Leaves out: starting the engine
(``engine.runtime``), importing SGLang (``engine.sglang_api``).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from . import sglang_api
from .errors import EngineConfigError, EngineStartError

# Causal (decoder-only) sequence-classification models: a score at a position depends
# only on the tokens before it, the only kind the incremental reward path is exact for.
# Only architectures whose SGLang scores were checked equal to HF are accepted: SGLang
# 0.5.23's Qwen2ForSequenceClassification adds a score bias no checkpoint fills (every
# score shifted by a random constant), so it is refused until that is handled.
CAUSAL_REWARD_ARCHS = frozenset({"LlamaForSequenceClassification"})



def read_architecture(model_path: str, field: str) -> str:
    """The ``architectures[0]`` of a model folder, or a one-line error naming ``field``."""
    folder = Path(model_path).expanduser()
    if not (folder / "config.json").is_file():
        raise EngineStartError(
            f"{field}: no model at '{model_path}' (no config.json there); "
            "run `colocate prepare` or pass a Hugging Face model folder"
        )
    archs = model_config(model_path, field).get("architectures") or [""]
    return archs[0] if isinstance(archs, list) and isinstance(archs[0], str) else ""


def model_config(model_path: str, field: str) -> dict[str, Any]:
    """A model folder's ``config.json`` as the JSON object it must be, or a one-line error
    naming ``field`` (a hand-edited or truncated file: before, a JSON traceback)."""
    file = Path(model_path).expanduser() / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EngineStartError(f"{field}: {file} is not a readable JSON file ({exc}); a model folder's "
                               "config.json is the one save_pretrained writes") from None
    if not isinstance(data, dict):
        raise EngineStartError(f"{field}: {file} holds a JSON {type(data).__name__}, not a model config "
                               "(a JSON object, as save_pretrained writes it)")
    return data


# the input embedding and output head: their rows are the vocabulary's (config.json's vocab_size)
_VOCAB_ROWS = ("embed_tokens.weight", "wte.weight", "lm_head.weight", "embed_in.weight", "embed_out.weight")
# what a training wrapper puts into the names of a state dict saved through it: torch.compile,
# DDP, FSDP 1 and activation checkpointing
_WRAPPERS = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def check_weights(model_path: str, field: str) -> None:
    """A model folder's safetensors weights as SGLang and transformers will read them, from
    their headers only (milliseconds at any size): every shard its index names is there,
    every file's header is whole and covers the file (a truncated download or copy), no weight
    name carries a training wrapper's prefix (a state dict saved through torch.compile, DDP or
    FSDP: SGLang skips such names and serves the model at random), and the embedding and output
    head have ``vocab_size`` rows (a config.json of another model).
    Each is one line naming ``field``; before, a copy cut short passed ``--check`` and failed
    as SGLang loaded it. A folder with other weight formats (``.bin``) is not checked here."""
    from safetensors import safe_open

    folder = Path(model_path).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, OSError, KeyError, TypeError, AttributeError) as exc:
            raise EngineStartError(f"{field}: {index} is not a readable safetensors index ({type(exc).__name__}: "
                                   f"{' '.join(str(exc).split())[:200]}); fetch the model again") from None
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise EngineStartError(f"{field}: '{model_path}' lacks {len(missing)} of the {len(shards)} weight files its "
                                   f"index names ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the "
                                   "download or copy is incomplete: fetch the model again")
        files = [folder / name for name in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    vocab = model_config(model_path, field).get("vocab_size") if files else None
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                names = list(f.keys())
                rows = [(name, f.get_slice(name).get_shape()) for name in names if name.endswith(_VOCAB_ROWS)]
        except Exception as exc:  # safetensors' SafetensorError: a header cut short, or not a safetensors file
            raise EngineStartError(f"{field}: {file} is not a whole safetensors file ({' '.join(str(exc).split())[:200]}); "
                                   "the download or copy is incomplete or damaged: fetch the model again") from None
        wrapped = next((name for name in names if any(name.startswith(w) or f".{w}" in name for w in _WRAPPERS)), None)
        if wrapped is not None:
            raise EngineStartError(f"{field}: '{model_path}' holds weights saved through a training wrapper "
                                   f"('{wrapped}': torch.compile's _orig_mod., DDP's module., FSDP's or activation "
                                   "checkpointing's wrapped modules), whose names neither SGLang nor transformers "
                                   "reads, so the model would start at random; save the unwrapped model with "
                                   "save_pretrained")
        for name, shape in rows:
            if isinstance(vocab, int) and len(shape) == 2 and shape[0] != vocab:
                raise EngineStartError(f"{field}: '{model_path}': config.json's vocab_size is {vocab} but {name} has "
                                       f"{shape[0]} rows; the config and the weights are of different models")


def check_remote_code(model_path: str, field: str, trusted: bool) -> None:
    """A model folder whose config maps its classes to code it ships (``auto_map``) runs
    that code when loaded: refuse it unless ``trusted`` (the caller's setting) says so. Its
    config.json is read here first (the first of the start-up checks to open it): one that is
    not a JSON object is one line (:func:`model_config`)."""
    if not (Path(model_path).expanduser() / "config.json").is_file():
        return
    if model_config(model_path, field).get("auto_map") and not trusted:
        raise EngineStartError(
            f"{field}: '{model_path}' ships its own model code (auto_map in config.json), which "
            "colocate does not run by default", fix="remote_code")


def is_causal_lm(arch: str) -> bool:
    """Whether ``arch`` is a text causal LM: a ``…ForCausalLM``, or a class transformers
    registers as one under another name (GPT-2's ``GPT2LMHeadModel``; its multimodal
    ``…ForConditionalGeneration`` entries are not text models). Whether SGLang can serve it
    is :func:`check_loadable`'s question."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return arch.endswith("ForCausalLM") or (arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                                            and not arch.endswith("ForConditionalGeneration"))


def check_model(cfg, field: str) -> str:
    """Validate the model folder for ``cfg.role`` (an ``EngineConfig``) before starting SGLang."""
    arch = read_architecture(cfg.model_path, field)
    check_remote_code(cfg.model_path, field, cfg.trust_remote_code)
    check_weights(cfg.model_path, field)
    if cfg.role == "actor" and not is_causal_lm(arch):
        raise EngineStartError(
            f"{field}: '{cfg.model_path}' is a {arch or 'model without architectures'}; "
            "the actor must be a causal LM (…ForCausalLM, or GPT-2's LMHeadModel)"
        )
    if cfg.role == "reward" and arch not in CAUSAL_REWARD_ARCHS:
        raise EngineStartError(
            f"{field}: '{cfg.model_path}' is a {arch or 'model without architectures'}; "
            "the reward model must be a causal (decoder-only) sequence-classification "
            f"model, one of {sorted(CAUSAL_REWARD_ARCHS)}, so chunks can be scored incrementally"
        )
    if cfg.role == "reward" and (labels := score_labels(model_config(cfg.model_path, field))) != 1:
        raise EngineStartError(
            f"{field}: '{cfg.model_path}' scores {labels} labels (its config.json's id2label/num_labels; "
            "transformers' default is 2); a reward model gives one score: save it with num_labels=1")
    return arch


def score_labels(config: Mapping[str, Any]) -> int:
    """How many scores a sequence-classification config gives, as transformers reads it:
    ``id2label``'s size, else ``num_labels``, else its default of 2."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    labels = config.get("num_labels")
    return labels if isinstance(labels, int) else 2


# What SGLang cannot run although its registry has the class, found by starting each
# family's tiny random model here and training it two steps (docs/config.md, "Model
# families"): SGLang's class -> rules (whether the config SGLang builds it from can run;
# why not and what to do). Checked against the config, so a folder that has what a rule
# asks (a Gemma-2 checkpoint whose config.json still carries hidden_act) runs.
_TIED = (lambda c: bool(getattr(c, "tie_word_embeddings", True)),
         "its model has no output head of its own (it skips lm_head.weight and scores with the input "
         "embeddings), so an untied head would be lost; tie_word_embeddings must be true, as in Google's checkpoints")
LOAD_LIMITS: dict[str, tuple[tuple[Callable[[Any], bool], str], ...]] = {
    "GemmaForCausalLM": (_TIED,),
    "Gemma2ForCausalLM": (
        (lambda c: hasattr(c, "hidden_act"),
         "its model reads config.hidden_act, which this config.json lacks (transformers 5 writes only "
         "hidden_activation); add \"hidden_act\": \"gelu_pytorch_tanh\" to it"),
        _TIED),
    "Gemma3ForCausalLM": (_TIED,),
    "PhiForCausalLM": (
        (lambda c: getattr(c, "num_key_value_heads", None) in (None, c.num_attention_heads),
         "its model has no grouped-query attention (num_key_value_heads must equal num_attention_heads)"),),
}


def check_startable(cfg, field: str) -> str:
    """Every check of an engine before its processes start (``cfg`` an ``EngineConfig``;
    ``field`` the config key its model comes from): the model folder, SGLang's own
    arguments and attention backend, whether SGLang can load the model. Returns the
    folder's architecture.

    SGLang is imported only where needed (its model config pulls most of SGLang in: ~8 s
    of a ``colocate train --check`` here): for SGLang arguments, and for an architecture
    outside the classes colocate registers and runs (``sglang_api.REGISTERED_ARCHITECTURES``,
    none of which has load limits)."""
    arch = check_model(cfg, field)
    version = sglang_api.prepare(cfg.device).sglang_version
    if cfg.server_args:
        check_server_args(cfg, sglang_api.server_arg_types(), version, ENGINE_SET_ARGS)
    if cfg.attention_backend and cfg.attention_backend not in (known := sglang_api.attention_backends()):
        raise EngineConfigError(f"{cfg.attention_backend!r} is not an attention backend of SGLang {version}; "
                                f"one of {', '.join(known)}", fix="attention_backend")
    if arch not in sglang_api.REGISTERED_ARCHITECTURES:
        check_loadable(cfg, field, version)
    return arch


def check_loadable(cfg, field: str, version: str) -> str:
    """SGLang's model config of ``cfg.model_path`` built and its class resolved, as its
    scheduler will (``sglang_api.model_plan``), and the class's known limits against that
    config (:data:`LOAD_LIMITS`): a model SGLang cannot load is one line naming ``field``
    before any engine process starts. Returns SGLang's class name."""
    try:
        plan = sglang_api.model_plan(cfg.model_path, trust_remote_code=cfg.trust_remote_code,
                                     is_embedding=cfg.role == "reward")
    except (ValueError, RuntimeError, KeyError, OSError, ImportError, AttributeError, TypeError) as exc:
        raise EngineStartError(f"{field}: SGLang {version} cannot load '{cfg.model_path}': "
                               f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    for runs, why in LOAD_LIMITS.get(plan.architecture, ()):
        if not runs(plan.config):
            raise EngineStartError(f"{field}: SGLang {version} cannot load '{cfg.model_path}', a "
                                   f"{plan.architecture}: {why}")
    return plan.architecture


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


# The SGLang arguments the engine sets itself (``engine_config._server_kwargs``): refused
# among an EngineConfig's own SGLang arguments
ENGINE_SET_ARGS = frozenset({
    "model_path", "device", "dtype", "random_seed", "log_level", "trust_remote_code", "tp_size", "mem_fraction_static",
    "max_total_tokens", "attention_backend", "disable_cuda_graph", "disable_overlap_schedule", "context_length",
    "base_gpu_id", "nccl_port", "enable_memory_saver", "enable_weights_cpu_backup", "enable_metrics",
    "custom_sigquit_handler", "skip_tokenizer_init", "is_embedding", "weight_version", "sleep_on_idle", "enable_lora",
    "max_lora_rank", "lora_target_modules", "lora_backend"})
# EngineConfig fields SGLang's own argument may set when the field leaves them to SGLang (None)
_SHARED_SERVER_ARGS = ("max_running_requests", "chunked_prefill_size")
_SCALARS = (bool, int, float, str)


def check_server_arg_values(args: Mapping[str, Any]) -> None:
    """Values are scalars or lists of them: a mapping has no hashable form that survives
    JSON (an ``EngineConfig`` is compared, hashed and handed to a feeder process as JSON)."""
    for name, value in args.items():
        if _holds_mapping(value):
            raise EngineConfigError(f"{name}: a mapping value is not supported; give SGLang's JSON-string "
                                    "form of the argument where it has one", fix="server_arg")


def _holds_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) or (isinstance(value, (list, tuple)) and any(map(_holds_mapping, value)))


def check_server_args(cfg, arg_types: Mapping[str, Any], version: str, own: Iterable[str] = ()) -> None:
    """``cfg.server_args`` (an ``EngineConfig``'s) against SGLang ``version``'s
    ``ServerArgs`` (``arg_types``: name -> annotation): the ones the engine sets itself
    (``own``: :data:`ENGINE_SET_ARGS`), unknown names (the close match
    suggested) and values of the wrong type, each one line starting with the argument's name."""
    args = dict(cfg.server_args)
    check_server_arg_values(args)
    for name, value in args.items():
        key = name
        if name in own:
            raise EngineConfigError(f"{key}: the engine sets it itself", fix="server_arg")
        if name not in arg_types:
            close = difflib.get_close_matches(name, list(arg_types), n=1)
            hint = (f"; did you mean '{close[0]}'?" if close
                    else " (python -m sglang.launch_server --help lists them, dashes for underscores)")
            raise EngineConfigError(f"{key}: not an argument of SGLang {version}'s ServerArgs{hint}", fix="server_arg")
        if name in _SHARED_SERVER_ARGS and getattr(cfg, name) is not None:
            raise EngineConfigError(f"{key}: the engine's own {name} is set too ({getattr(cfg, name)}); set one",
                                    fix="server_arg")
        expected = _scalar_type(arg_types[name])
        if expected is not None and not _is_a(value, *expected):
            want = expected[0].__name__ + (" or null" if expected[1] else "")
            raise EngineConfigError(f"{key}: expected {want}, got {value!r} ({type(value).__name__})",
                                    fix="server_arg")


def _scalar_type(annotation: Any) -> tuple[type, bool] | None:
    """(bool/int/float/str, whether None is allowed) of a plain or Optional annotation; else None."""
    if annotation in _SCALARS:
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALARS and len(typing.get_args(annotation)) == 2:
            return rest[0], True
    return None


def _is_a(value: Any, kind: type, optional: bool) -> bool:
    if value is None:
        return optional
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


MEMORY_MARKERS = ("out of memory", "not enough memory", "cannot allocate memory", "memoryerror")


def start_error(cfg, exc: BaseException, *, architecture: str = "", said: str = "",
                log: Path | None = None) -> EngineStartError:
    """A one-line `EngineStartError` with a hint read from SGLang's start-up failure:
    ``exc`` what SGLang's start raised, ``said`` the last line its processes wrote (a
    scheduler's own error: it replaces ``exc``'s text), ``log`` the file holding all they wrote."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    low = f"{text} {said}".lower()
    if "duplicated timeseries" in low:
        hint = "another engine in this process already has SGLang metrics on; set enable_metrics=False"
    elif "exit code: -9" in low or any(m in low for m in MEMORY_MARKERS):
        # SGLang's generic "scheduler died" text names "the OS OOM killer" as a common cause
        # whatever the exit code, so only a SIGKILL or an explicit memory error counts here
        hint = "not enough memory: lower max_total_tokens / mem_fraction_static or use a smaller model"
    elif "not supported" in low or "architecture" in low:
        hint = "SGLang does not support this architecture"
    elif said:
        hint = f"SGLang could not load its {architecture or 'model'}"
    elif "died during initialization" in low:
        return EngineStartError(f"could not start the {cfg.label}: its scheduler process failed while starting "
                                f"({text[:200]})", fix="engine_log")
    else:
        return EngineStartError(f"could not start the {cfg.label} ({text[:200]})", fix="engine_log")
    where = f" (all SGLang wrote: {log})" if log is not None else ""
    return EngineStartError(f"could not start the {cfg.label}: {hint}: {' '.join(said.split()) or text[:200]}{where}"
                            if said else f"could not start the {cfg.label}: {hint} ({text[:200]})")
