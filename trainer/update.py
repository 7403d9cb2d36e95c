"""One training phase of a PPO step: epochs x minibatches of guarded optimizer steps, each
micro-batched over a plan, with losses normalised over the whole minibatch.

Owns: `optimise` (the epoch/minibatch loop, stats averaged over the steps taken, the
drift probe on the first minibatch) and `minibatch_step` (this rank's micro-batches of
one minibatch, backward of each one's share of the minibatch loss, one guarded step).

Leaves out: models, which loss (`trainer/ppo_trainer.py` passes a `LossFn`), which rows
form a micro-batch (`trainer/packing.py`, passed in as `plan`), and the PPO math.

Normalisation: each micro-batch's backward is loss_local * (local denominator /
minibatch denominator) * world (valid tokens for token-mean, non-empty rows for the
seq-mean modes, counted over the whole minibatch, which every rank can see); FSDP
averages gradients over ranks, so any plan on any number of ranks minimises the same loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from .batch import TrainBatch
from .distributed import DistInfo, all_reduce_max, all_reduce_sum
from .forward import agg_denominator
from .optim import guarded_step
from .packed import idle_batch
from .packing import Plan
from .rollout_logp import drift_stats

# per-micro-batch loss: (micro batch, its rows of the extra tensors) -> (loss, {stat: 0-dim token mean});
# a "drift" stat ([3] terms of `rollout_logp.drift_terms`) is summed/maxed instead of averaged
LossFn = Callable[[TrainBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
PlanFn = Callable[[TrainBatch], Plan]
# extra tensors for the first minibatch only (its forward still runs the weights the rollout
# sampled with and the no-grad passes ran): the drift probe's, and the rows whose old
# log-probs that forward gives (`PPOTrainer.train_actor`'s fill_first)
FIRST_ONLY = ("behaviour_logp", "on_policy", "fresh")


@dataclasses.dataclass(frozen=True)
class Update:
    """What a phase updates and how: the model, its optimizer, and the knobs of the loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dist: DistInfo
    plan: PlanFn
    epochs: int
    minibatches: int
    loss_agg: str
    max_grad_norm: float
    loss_coef: float = 1.0


def optimise(
    u: Update, batch: TrainBatch, extra: dict[str, torch.Tensor], loss_fn: LossFn, generator: torch.Generator,
    loss_key: str, after_first: Callable[[], None] | None = None,
) -> dict[str, float]:
    """epochs x minibatches guarded optimizer steps; stats averaged over the steps taken.

    The `FIRST_ONLY` tensors go to the first minibatch only: its forward is the one that
    still runs the weights the rollout sampled with. `after_first` runs once that
    minibatch's step is taken (on every rank: it may be collective), before any other
    minibatch reads `extra`.
    """
    totals: dict[str, float] = defaultdict(float)
    counts = {"steps": 0, "skipped_steps": 0, "empty_steps": 0}
    probe: dict[str, float] = {}
    for epoch in range(u.epochs):
        for i, idx in enumerate(batch.minibatches(u.minibatches, generator)):
            first = epoch == 0 and i == 0
            rows = {k: v[idx] for k, v in extra.items() if first or k not in FIRST_ONLY}
            step = minibatch_step(u, batch.select(idx), rows, loss_fn)
            if first and after_first is not None:
                after_first()
            outcome = step.pop("outcome")
            probe |= step.pop("probe", {})
            counts[outcome] += 1
            for key, value in step.items() if outcome == "steps" else ():
                totals[loss_key if key == "loss" else key] += value
    taken = counts["steps"]
    stats = {key: (value / taken if taken else float("nan")) for key, value in totals.items()}
    return stats | probe | {key: float(value) for key, value in counts.items()}


def minibatch_step(u: Update, minibatch: TrainBatch, extra: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, Any]:
    """One optimizer step on this rank's micro-batches of `minibatch`; stats are global.

    Stats: the loss exactly, the others as token-weighted means over the minibatch. A
    loss may run on fewer tokens than `extra["loss_mask"]` holds (a "loss_mask" stat: the
    first minibatch's mismatch correction, known only from its forward): the gradients,
    the loss and the stats are then rescaled to the tokens kept (`_kept`).
    """
    denominator = agg_denominator(extra["loss_mask"], u.loss_agg)  # whole minibatch: same on all ranks
    tokens = extra["loss_mask"].bool().sum()
    if int(denominator) == 0:
        return {"outcome": "empty_steps"}
    keys, sums, drift = ["loss"], None, torch.zeros(3)  # drift: (sum |d|, count, max |d|)
    for rows in u.plan(minibatch):
        mb, t = _micro_inputs(minibatch, extra, rows, u.dist.device)
        loss, stats = loss_fn(mb, t)
        if "drift" in stats:
            part = stats.pop("drift").cpu()
            drift = torch.stack([drift[0] + part[0], drift[1] + part[1], drift[2].maximum(part[2])])
        kept = stats.pop("loss_mask", t["loss_mask"]).bool()  # [b, T] the tokens this loss ran on
        local = agg_denominator(kept, u.loss_agg).float()
        share = local / denominator  # this micro-batch's part
        (u.loss_coef * loss * share * u.dist.world_size).backward()
        token_share = kept.sum() / tokens
        keys = ["loss", *stats]
        row = torch.stack([loss.detach().float() * share, *(v.float() * token_share for v in stats.values()),
                           local, kept.sum().float()])
        sums = row if sums is None else sums + row
    totals = all_reduce_sum(sums, u.dist).tolist()
    totals, outcome = _kept(u.model, totals, float(denominator), float(tokens))
    if outcome == "empty_steps":
        u.optimizer.zero_grad(set_to_none=True)
        result: dict[str, Any] = {}
    else:
        grad_norm, stepped = guarded_step(u.model, u.optimizer, u.max_grad_norm, math.isfinite(totals[0]))
        result = dict(zip(keys, totals)) | {"grad_norm": grad_norm}
        outcome = "steps" if stepped else "skipped_steps"
    if "on_policy" in extra:
        result["probe"] = drift_stats(all_reduce_sum(drift[:2], u.dist), all_reduce_max(drift[2], u.dist))
    return result | {"outcome": outcome}


def _kept(model: nn.Module, totals: list[float], denominator: float, tokens: float) -> tuple[list[float], str]:
    """(loss and stats, outcome so far) from the summed micro-batch rows, whose last two
    entries are the denominator and the tokens the losses ran on. Where those are fewer
    than the minibatch's (`denominator`, `tokens`: what each share was divided by), the
    gradients, the loss and the stats are scaled to them; none left: "empty_steps"."""
    totals, (kept_denominator, kept_tokens) = totals[:-2], totals[-2:]
    if kept_denominator == denominator:
        return totals, "steps"
    if kept_denominator == 0:
        return totals, "empty_steps"
    scale = denominator / kept_denominator
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return [totals[0] * scale, *(v * tokens / kept_tokens for v in totals[1:])], "steps"


def _micro_inputs(
    minibatch: TrainBatch, extra: dict[str, torch.Tensor], rows: list[int], device: torch.device
) -> tuple[TrainBatch, dict[str, torch.Tensor]]:
    """One micro-batch's rows of `minibatch` and of the [b, T] `extra` tensors, on `device`.

    No rows: an idle micro-batch (`trainer/packed.py`), its extra tensors all 0 / False,
    so its loss share and stats are 0 while its forward and backward still run.
    """
    if not rows:
        return idle_batch(minibatch).to(device), {k: torch.zeros_like(v[:1]).to(device) for k, v in extra.items()}
    idx = torch.tensor(rows, dtype=torch.long)
    return minibatch.select(idx).to(device), {k: v[idx].to(device) for k, v in extra.items()}
