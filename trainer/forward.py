"""Forward passes of the PPO models over a `TrainBatch`, restricted to response positions.

Owns: the policy forward (per-token log-probs and entropy of the response tokens),
the critic forward (values of the states that emit each response token), micro-batched
no-grad evaluation, and the loss-aggregation denominators that make micro-batched and
multi-rank losses equal the loss of the whole minibatch.

Leaves out: the PPO losses themselves (`trainer/ppo_math.py`), ranks and optimizers
(`trainer/ppo_trainer.py`). Inputs are trimmed of all-padding columns before a forward:
with right padding and a causal model that changes no result.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from .batch import TrainBatch, logits_kept, response_logits, response_values
from .ppo_math import entropy_from_logits, token_logprobs_from_logits


def policy_forward(
    model: nn.Module, batch: TrainBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [B, T], entropy [B, T] or None) of each response token under `model`.

    logp keeps the graph when grad is enabled; entropy is always detached (a statistic).
    Both are 0 on padding. `batch` must be on the model's device.
    """
    batch = batch.trimmed()
    kwargs = {"logits_to_keep": logits_kept(batch)} if _takes_logits_to_keep(model) else {}
    # the LM head over response positions only: a fifth of the model's FLOPs per position
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs).logits
    picked = response_logits(logits, batch)  # [B, T, V]
    mask = batch.response_mask
    logp = token_logprobs_from_logits(picked, batch.responses, temperature)  # [B, T]
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(picked.detach() / temperature)  # [B, T]
            entropy = torch.where(mask, entropy, torch.zeros_like(entropy))
    return logp, entropy


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the HF causal LM's forward takes `logits_to_keep` (transformers >= 4.45 models)."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def value_forward(critic: nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Values [B, T] of the states that emit each response token (0 on padding)."""
    batch = batch.trimmed()
    values = critic(batch.input_ids, batch.attention_mask)  # [B, L]
    return response_values(values, batch)  # [B, T]


@torch.no_grad()
def evaluate_rows(
    fn: Callable[[TrainBatch], torch.Tensor], batch: TrainBatch, micro_batch: int, device: torch.device
) -> torch.Tensor:
    """fn over `batch` in micro-batches of `micro_batch` rows, without grad -> concatenated rows on `device`."""
    rows = torch.arange(batch.size)
    parts = [fn(batch.select(idx).to(device)) for idx in rows.split(max(1, micro_batch))]
    return torch.cat(parts)


def agg_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `aggregate_loss(…, mask, mode)` divides by: valid tokens (token-mean) or non-empty rows.

    mask: [B, T] -> 0-dim long tensor.
    """
    valid = mask.bool()
    if mode == "token-mean":
        return valid.sum()
    return (valid.sum(-1) > 0).sum()
