"""Forward passes of the PPO models over a `TrainBatch`, restricted to response positions.

Owns: the policy forward (per-token log-probs and entropy of the response tokens) and
the critic forward (values of the states that emit each response token), each in two
forms with the same [b, T] results: right-padded rows (`policy_forward`,
`value_forward`) and one padding-free packed row (`packed_policy_forward`,
`packed_value_forward`, see `trainer/packed.py`, optionally with shared prompts); no-grad evaluation over a micro-batch
plan (`evaluate_plan`); and the loss-aggregation denominators that make micro-batched and
multi-rank losses equal the loss of the whole minibatch.

Leaves out: the PPO losses themselves (`trainer/ppo_math.py`), which rows form a
micro-batch (`trainer/packing.py`), ranks and optimizers (`trainer/ppo_trainer.py`).
Padded inputs are trimmed of all-padding columns before a forward: with right padding
and a causal model that changes no result.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from .batch import TrainBatch, logits_kept, response_logits, response_values
from .packed import idle_batch, pack, unpack
from .packing import Plan
from .ppo_math import entropy_from_logits, token_logprobs_from_logits

ROWS_PER_CHUNK = 1024  # packed log-softmax over at most this many positions at a time (bounds memory)


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


def attention_of(model: nn.Module) -> str | None:
    """The transformers attention implementation `model` runs (its config's), or None."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the HF causal LM's forward takes `logits_to_keep` (transformers >= 4.45 models)."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def value_forward(critic: nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Values [B, T] of the states that emit each response token (0 on padding)."""
    batch = batch.trimmed()
    values = critic(batch.input_ids, batch.attention_mask)  # [B, L]
    return response_values(values, batch)  # [B, T]


def packed_policy_forward(
    model: nn.Module, batch: TrainBatch, temperature: float = 1.0, with_entropy: bool = False,
    shared_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`policy_forward` over one packed row: the same (logp [b, T], entropy [b, T] or None).
    `shared_prefix`: rows sharing a prompt carry it once (`pack`).

    The LM head runs only at the positions that predict response tokens.
    """
    attention = attention_of(model)
    packed = pack(batch, share=shared_prefix).for_attention(attention)
    inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                  **packed.attention_kwargs(attention))
    if _takes_logits_to_keep(model):
        logits = model(**inputs, logits_to_keep=packed.keep).logits[0]  # [n, V]
    else:
        logits = model(**inputs).logits[0, packed.keep]  # [n, V]
    parts = zip(logits.split(ROWS_PER_CHUNK), packed.targets.split(ROWS_PER_CHUNK))
    flat = torch.cat([token_logprobs_from_logits(x[None], y[None], temperature)[0] for x, y in parts])  # [n]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            scaled = logits.detach() / temperature  # [n, V]
            flat_entropy = torch.cat([entropy_from_logits(x[None])[0] for x in scaled.split(ROWS_PER_CHUNK)])
            entropy = unpack(flat_entropy, packed)  # [b, T]
    return unpack(flat, packed), entropy


def packed_value_forward(critic: nn.Module, batch: TrainBatch, shared_prefix: bool = False) -> torch.Tensor:
    """`value_forward` over one packed row: values [b, T] (0 on padding). `shared_prefix`:
    rows sharing a prompt carry it once (`pack`)."""
    attention = attention_of(critic)
    packed = pack(batch, share=shared_prefix).for_attention(attention)
    values = critic(packed.input_ids, position_ids=packed.position_ids,
                    **packed.attention_kwargs(attention))  # [1, N]
    return unpack(values[0, packed.keep], packed)  # [b, T]


@torch.no_grad()
def evaluate_plan(
    fn: Callable[[TrainBatch], torch.Tensor], batch: TrainBatch, plan: Plan, device: torch.device
) -> torch.Tensor:
    """fn over this rank's micro-batches of `batch` without grad -> [B, T] float32 on `device`:
    each planned row's results, 0 on rows of other ranks (so a sum over ranks is exact).
    An idle (empty) micro-batch still runs `fn` on a one-token row: FSDP's collectives
    need every rank to run the same forwards."""
    out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=device)  # [B, T]
    for rows in plan:
        if not rows:
            fn(idle_batch(batch).to(device))
            continue
        idx = torch.tensor(rows, dtype=torch.long)
        out[idx.to(device)] = fn(batch.select(idx).to(device)).float()
    return out


def agg_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `aggregate_loss(…, mask, mode)` divides by: valid tokens (token-mean) or non-empty rows.

    mask: [B, T] -> 0-dim long tensor.
    """
    valid = mask.bool()
    if mode == "token-mean":
        return valid.sum()
    return (valid.sum(-1) > 0).sum()
