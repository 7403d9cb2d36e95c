"""Old log-probs of the actor's first minibatch from its own first forward.

The first minibatch of `train_actor` runs the weights the no-grad old-log-prob pass runs:
that pass would compute, for its rows, the numbers the minibatch's forward computes anyway
(TRL's and verl's on-policy shortcut, here for the first of any number of minibatches). So
`PPOTrainer.old_logprobs(leave_first=True)` skips those rows and `train_actor(fill_first=True)`
takes them from the forward, detached: the ratio there is exactly 1, as the pass's would be up
to float rounding, and the later minibatches and epochs read the filled values. The
importance weights and the mismatch correction's mask of those rows (`trainer/mismatch.py`:
truncated IS's min(pi_old / pi_behaviour, cap), masked IS's band) come from the same
values, so the corrections are unchanged: until its forward a row's loss mask is the
tokens it would train without the correction, and each micro-batch's loss runs on the mask
its forward gives (`trainer/update.py` then normalises the minibatch's loss over the
tokens kept).

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

from .advantages import model_tokens
from .distributed import DistInfo, all_reduce_sum
from .mismatch import Correction


class FirstForward:
    """The first minibatch's rows (`first`) of a batch of `old_logp` [B, T] and the actor's
    `extra` inputs, filled from that minibatch's forward."""

    def __init__(self, first: torch.Tensor, old_logp: torch.Tensor, extra: dict[str, torch.Tensor],
                 loss_mask: torch.Tensor, dist: DistInfo, recompute: Callable[[torch.Tensor], torch.Tensor],
                 correction: Correction = Correction(), trained: torch.Tensor | None = None) -> None:
        """`loss_mask` [B, T]: the model tokens; `trained` [B, T] (with a masking
        `correction`): the tokens trained before the correction, the first rows' loss mask
        until their forward."""
        self.first, self.old_logp, self.extra, self.loss_mask, self.dist = first, old_logp, extra, loss_mask, dist
        self.recompute, self.correction = recompute, correction
        self.filled = torch.zeros(old_logp.shape, dtype=torch.float32, device=dist.device)  # [B, T] this rank's rows
        self.seen = torch.zeros(old_logp.shape[0], dtype=torch.float32, device=dist.device)  # [B] rows filled
        rows = old_logp.shape[0]
        extra["row"], extra["fresh"] = torch.arange(rows), torch.zeros(rows, dtype=torch.bool)
        extra["fresh"][first] = True  # a FIRST_ONLY key: real rows of the first minibatch (not idle ones)
        if correction.masks:
            if trained is None:
                raise ValueError("FirstForward: a masking correction needs the trained tokens")
            extra["loss_mask"][first] = trained[first]  # not the mask of the old log-probs left 0

    def old(self, logp: torch.Tensor, t: dict[str, torch.Tensor],
            loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A micro-batch's (old log-probs [b, T], is_weights [b, T] or None, loss mask [b, T]):
        `t`'s, or on the first minibatch's rows from this forward's `logp`, detached (and
        kept for `publish`), with the weights and the kept tokens of those values.
        `loss_mask` [b, T]: the micro-batch's model tokens."""
        if "fresh" not in t:
            return t["old_logp"], t.get("is_weights"), t["loss_mask"]
        fresh, now = t["fresh"], logp.detach().float()
        rows = t["row"][fresh].to(self.filled.device)
        self.filled[rows], self.seen[rows] = now[fresh].to(self.filled.device), 1.0
        old = torch.where(fresh[:, None], now, t["old_logp"])
        if not self.correction.weighs:
            return old, None, t["loss_mask"]
        keep, weights = self.correction.terms(t["behaviour_logp"], now, loss_mask)  # [b, T]
        weights = torch.where(fresh[:, None], weights.to(t["is_weights"].dtype), t["is_weights"])
        if not self.correction.masks:
            return old, weights, t["loss_mask"]
        return old, weights, torch.where(fresh[:, None], t["loss_mask"] & keep, t["loss_mask"])

    def publish(self) -> None:
        """After the first minibatch (every rank, collective): every rank's filled rows into
        `old_logp` (the caller's) and `extra["old_logp"]` (what later minibatches read),
        with their weights and kept tokens. Rows no forward filled (a minibatch with nothing
        to train, whose step ran no forward) are computed by `recompute` (the no-grad pass:
        no step was taken)."""
        full = all_reduce_sum(self.filled, self.dist).to(self.old_logp.device)  # [B, T]
        missing = torch.zeros(full.shape[0], dtype=torch.bool)
        missing[self.first] = all_reduce_sum(self.seen, self.dist).cpu()[self.first] == 0
        if bool(missing.any()):
            full = torch.where(missing[:, None].to(full.device), self.recompute(missing).to(full.device), full)
        full = full[self.first]  # [b, T]
        self.old_logp[self.first] = full
        mask = self.loss_mask[self.first]
        self.extra["old_logp"][self.first] = model_tokens(full, mask)
        if self.correction.weighs:
            behaviour = self.extra["behaviour_logp"][self.first]
            keep, self.extra["is_weights"][self.first] = self.correction.terms(behaviour, full, mask)
            if self.correction.masks:
                self.extra["loss_mask"][self.first] &= keep
