"""Old log-probs of the actor's first minibatch from its own first forward.

The first minibatch of `train_actor` runs the weights the no-grad old-log-prob pass runs:
that pass would compute, for its rows, the numbers the minibatch's forward computes anyway
(TRL's and verl's on-policy shortcut, here for the first of any number of minibatches). So
`PPOTrainer.old_logprobs(leave_first=True)` skips those rows and `train_actor(fill_first=True)`
takes them from the forward, detached: the ratio there is exactly 1, as the pass's would be up
to float rounding, and the later minibatches and epochs read the filled values. Truncated-IS
weights (``is_cap``: min(pi_old / pi_behaviour, cap)) of those rows come from the same
values, so deferred partials' staleness correction is unchanged.

Owns: `FirstForward` (the rows, the buffer each rank fills with its own micro-batches, and
the all-reduce that hands every rank the whole minibatch's; a no-grad pass over rows no
forward filled). Leaves out: when it applies
(`TrainerSettings.old_logp_from_first_forward`), which rows are first (the trainer's
minibatch order), the loss (`trainer/ppo_math.py`) and the update loop (`trainer/update.py`,
whose `FIRST_ONLY` keys reach the first minibatch only).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import ppo_math
from .advantages import model_tokens
from .distributed import DistInfo, all_reduce_sum


class FirstForward:
    """The first minibatch's rows (`first`) of a batch of `old_logp` [B, T] and the actor's
    `extra` inputs, filled from that minibatch's forward."""

    def __init__(self, first: torch.Tensor, old_logp: torch.Tensor, extra: dict[str, torch.Tensor],
                 loss_mask: torch.Tensor, dist: DistInfo, recompute: Callable[[torch.Tensor], torch.Tensor],
                 is_cap: float | None = None) -> None:
        self.first, self.old_logp, self.extra, self.loss_mask, self.dist = first, old_logp, extra, loss_mask, dist
        self.recompute, self.is_cap = recompute, is_cap
        self.filled = torch.zeros(old_logp.shape, dtype=torch.float32, device=dist.device)  # [B, T] this rank's rows
        self.seen = torch.zeros(old_logp.shape[0], dtype=torch.float32, device=dist.device)  # [B] rows filled
        rows = old_logp.shape[0]
        extra["row"], extra["fresh"] = torch.arange(rows), torch.zeros(rows, dtype=torch.bool)
        extra["fresh"][first] = True  # a FIRST_ONLY key: real rows of the first minibatch (not idle ones)

    def old(self, logp: torch.Tensor, t: dict[str, torch.Tensor],
            loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's (old log-probs [b, T], is_weights [b, T] or None): `t`'s, or on the
        first minibatch's rows from this forward's `logp`, detached (and kept for `publish`)."""
        if "fresh" not in t:
            return t["old_logp"], t.get("is_weights")
        fresh, now = t["fresh"], logp.detach().float()
        rows = t["row"][fresh].to(self.filled.device)
        self.filled[rows], self.seen[rows] = now[fresh].to(self.filled.device), 1.0
        old = torch.where(fresh[:, None], now, t["old_logp"])
        if self.is_cap is None:
            return old, None
        weights = ppo_math.truncated_is_weights(t["behaviour_logp"], now, loss_mask, self.is_cap)
        return old, torch.where(fresh[:, None], weights.to(t["is_weights"].dtype), t["is_weights"])

    def publish(self) -> None:
        """After the first minibatch (every rank, collective): every rank's filled rows into
        `old_logp` (the caller's) and `extra["old_logp"]` (what later minibatches read).
        Rows no forward filled (a minibatch with nothing to train, whose step ran no
        forward) are computed by `recompute` (the no-grad pass: no step was taken)."""
        full = all_reduce_sum(self.filled, self.dist).to(self.old_logp.device)  # [B, T]
        missing = torch.zeros(full.shape[0], dtype=torch.bool)
        missing[self.first] = all_reduce_sum(self.seen, self.dist).cpu()[self.first] == 0
        if bool(missing.any()):
            full = torch.where(missing[:, None].to(full.device), self.recompute(missing).to(full.device), full)
        full = full[self.first]  # [b, T]
        self.old_logp[self.first] = full
        mask = self.loss_mask[self.first]
        self.extra["old_logp"][self.first] = model_tokens(full, mask)
        if self.is_cap is not None:
            behaviour = self.extra["behaviour_logp"][self.first]
            self.extra["is_weights"][self.first] = ppo_math.truncated_is_weights(behaviour, full, mask, self.is_cap)
