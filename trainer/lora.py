"""LoRA adapters on the trainer's models, built on PEFT.

Owns: wrapping a model in PEFT's LoRA as the ``lora`` section (`LoraConfig`,
`trainer/sections.py`: rank, alpha, dropout, target modules, which models) says
(`peft_config`, `add_lora`: the base weights frozen, only the adapters train; `check_targets`:
the target names against a model's skeleton, before anything is loaded), and
turning the (name, full tensor) stream of a LoRA actor into the Hugging Face-named merged
weights of its adapted linears (`merged_weights`: W + alpha/r · B·A, what the engine
serves; every other tensor is the frozen base the engine already holds).

Leaves out: sharding (`trainer/distributed.py`: it finds the decoder layers under the
PEFT wrapper), the reference pass with the adapters disabled and the checkpoint of the
trainable tensors (`trainer/ppo_trainer.py`, `trainer/optim.py`), writing an adapter
folder (`colocate/tools/export.py`).

Names: PEFT wraps a causal LM as ``base_model.model.<HF name>``; an adapted linear
``<m>`` holds ``<m>.base_layer.weight`` (frozen), ``<m>.lora_A.default.weight`` [r, in]
and ``<m>.lora_B.default.weight`` [out, r] (B starts at zero: the adapted model starts as
the base model).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from .sections import LoraConfig

PEFT_PREFIX = "base_model.model."  # PEFT's wrapper of a model: its HF names follow
ADAPTER = "default"  # PEFT's name of the one adapter
BASE_WEIGHT = ".base_layer.weight"  # an adapted linear's frozen weight: the merged weight's shape
_BASE, _A, _B = BASE_WEIGHT, f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def peft_config(lora: LoraConfig):  # noqa: ANN201 - peft.LoraConfig
    """PEFT's LoRA config of the ``lora`` section (``target_modules``: all-linear, or its comma list)."""
    import peft

    targets = lora.target_modules.strip()
    modules: str | list[str] = targets if targets == "all-linear" else [m.strip() for m in targets.split(",")]
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules,
                           bias="none")


def add_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """``model`` (a transformers model, unsharded) wrapped in PEFT's LoRA -> the PEFT model.

    Its base weights stop requiring gradients; only the adapters do. A target that
    matches no module is refused in one line naming ``lora.target_modules``."""
    from peft import get_peft_model

    from .errors import TrainerConfigError

    try:
        return get_peft_model(model, peft_config(lora))
    except ValueError as exc:
        unsupported = re.match(r"Target module (\w+)\(.*\) is not supported", str(exc), re.DOTALL)
        cause = (f"a target names a {unsupported[1]}, which PEFT cannot adapt (it adapts linear, embedding and "
                 "convolution layers)" if unsupported else str(exc).splitlines()[0])
        raise TrainerConfigError(f"lora.target_modules={lora.target_modules!r}: {cause} "
                                 "(use all-linear or the model's linear names, e.g. q_proj,v_proj)") from None


def check_targets(model_path: str, lora: LoraConfig, *, backbone: bool = False,
                  trust_remote_code: bool = False) -> None:
    """``lora.target_modules`` against the model in ``model_path`` before anything is
    loaded: on the model's skeleton (meta device: no weights read, no memory taken; the
    causal LM, or its ``backbone`` for the critic), each name of a comma list must name a
    module (PEFT's own matching rule, one name at a time) and PEFT must be able
    to adapt what they name. Refused in one line naming the field and the model's linears,
    at start-up instead of when the trainer is built after the engines started.
    ``all-linear`` always fits."""
    import transformers
    from peft.tuners.tuners_utils import check_target_module_exists

    from .errors import TrainerConfigError

    targets = lora.target_modules.strip()
    if targets == "all-linear":
        return
    config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    auto = transformers.AutoModel if backbone else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
        names = [name for name, _ in model.named_modules()]
        missing = [m for m in (x.strip() for x in targets.split(",")) if not any(
            check_target_module_exists(peft_config(dataclasses.replace(lora, target_modules=m)), n) for n in names)]
        if missing:
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            whose = (f"the critic's {config.model_type} backbone (or lora.critic=false)" if backbone
                     else config.model_type)
            raise TrainerConfigError(
                f"lora.target_modules={lora.target_modules!r}: {', '.join(missing)} names no module of "
                f"{whose}; its linears: {','.join(linears)}, or all-linear")
        add_lora(model, lora)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is (or holds) a PEFT model."""
    return any(name.endswith(_A) for name, _ in model.named_parameters())


def adapted_weight(name: str) -> bool:
    """Whether a state-dict name of a LoRA actor is one the merge reads (an adapted
    linear's base weight or adapter); the others are the frozen base the engine holds."""
    return name.endswith((_BASE, _A, _B))


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], scaling: float,
                   others: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named merged weight ``W + scaling · B @ A`` of each adapted linear of a LoRA
    actor, from its (PEFT name, full tensor) pairs (``adapted_weight`` ones suffice);
    other names are skipped, or with ``others`` passed on under their HF names (the
    frozen base: embeddings, norms, LM head, linears without adapters): the whole model.
    Lazy: one linear's three tensors are held at a time."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        suffix = next((s for s in (_BASE, _A, _B) if name.endswith(s)), None)
        if suffix is None:
            if others:
                yield name.removeprefix(PEFT_PREFIX), tensor
            continue
        module = name[: -len(suffix)]
        held = parts.setdefault(module, {})
        held[suffix] = tensor
        if len(held) == 3:
            del parts[module]
            base, a, b = held[_BASE], held[_A], held[_B]
            merged = base + (b.to(base.dtype) @ a.to(base.dtype)) * scaling  # [out, in]
            yield module.removeprefix(PEFT_PREFIX) + ".weight", merged
    if parts:
        raise ValueError(f"LoRA tensors without their pair: {sorted(parts)[:3]}")
