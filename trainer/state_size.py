"""How much training state the trainer's models hold, counted from their tensors (no collective).

Owns: `state_mib` (the local shards of parameters, gradients and optimizer moments a rank
holds), `sync_numels` (the elements a weight sync pushes, whole or under LoRA the adapted
weights only), `tied_copies` (the state's names a push leaves out: a tied head) and
`saved_shapes` (the global shapes a checkpoint's state dict holds, to check a checkpoint
before loading it). Leaves out: the models and what is done with the
counts (`trainer/ppo_trainer.py`, `colocate/run/`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .distributed import local_bytes
from .lora import BASE_WEIGHT, adapted_weight


def state_mib(models: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> float:
    """MiB of the models' parameters and gradients (local shards) and the optimizers' moments."""
    total = 0
    for model in models:
        for p in model.parameters():
            total += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
    for optim in optimizers:
        for state in optim.state.values():
            total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total / 2**20


def tied_copies(model: nn.Module) -> frozenset[str]:
    """The names of ``model``'s state that are another entry's tensor (transformers'
    ``_tied_weights_keys`` where the config ties them: ``lm_head.weight`` of a model with
    ``tie_word_embeddings``). A weight push leaves them out: the engine's model ties them
    itself, and SGLang's Qwen2 logs "Parameter lm_head.weight not found" at every push of
    one (seen on an H100, Qwen2.5-0.5B shape: 272 of the 1,202 MB pushed each step)."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return frozenset()
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return frozenset(set(keys) & set(model.state_dict()))


def sync_numels(actor: nn.Module, lora: bool) -> tuple[int, int]:
    """(elements of the adapted linears' merged weights under `lora`, else of the whole
    state; elements of the whole state) that a weight sync of `actor` pushes (tied copies
    left out: `tied_copies`)."""
    tied = tied_copies(actor)
    state = {name: t for name, t in actor.state_dict().items() if name not in tied}
    adapted = sum(t.numel() for name, t in state.items() if name.endswith(BASE_WEIGHT))
    whole = sum(t.numel() for name, t in state.items() if not (lora and adapted_weight(name))) + adapted
    return (adapted if lora else whole, whole)


def saved_shapes(models: dict[str, nn.Module | None]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Name -> global shape of the tensors a training state dict saves, per named model:
    every parameter and buffer, or where some parameters are frozen (LoRA) the trainable ones."""
    out = {}
    for part, model in models.items():
        if model is None:
            continue
        if any(not p.requires_grad for p in model.parameters()):
            out[part] = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        else:
            out[part] = {n: tuple(t.shape) for n, t in model.state_dict().items() if hasattr(t, "shape")}
    return out
