"""Train/inference mismatch corrections: masked importance sampling beside truncated IS (pure functions).

The rollout engine's behaviour log-probs and the trainer's old log-probs of the same
tokens differ: bf16 kernels, another attention implementation, the older weights of a
deferred partial. Each token's ratio rho = pi_old / pi_behaviour = exp(old_logp -
behaviour_logp) measures it. Truncated IS (TIS; `overlap.staleness=is`) weights each
token's loss by min(rho, cap). Masked IS (MIS) leaves the tokens whose ratio is outside a
band [lower, upper] out of the loss and weights the others by their ratio
(`ppo.rollout_correction`, the peers' names in brackets):

- ``token_mis``: each token on its own ratio, band [1/2, 2] (verl's
  ``rollout_is_level=token`` + ``rollout_is_mode=mask``, ``rollout_is_threshold=2`` with
  the reciprocal lower bound; slime's ``tis_level=token`` + ``tis_mode=mask``);
- ``seq_mis``: each sequence whole, on the geometric mean of its tokens' ratios
  exp(mean log rho) (length-normalised: the product of 100 ratios of 1.01 is 2.7), band
  [1/1.001, 1.001] (verl's ``rollout_is_level=geometric`` / ``rollout_rs=seq_mean_k1``
  and its Geo-RS preset's bounds; slime's ``tis_level=geometric``);
- ``icepop``: each token, band [0.5, 5] (IcePop, Ring-1T, arXiv:2510.18855:
  M(k) = k if alpha <= k <= beta else 0, alpha 0.5, beta 5; slime's ``icepop_function``,
  AReaL's ``icepop_alpha``/``icepop_beta``).

Owns: the methods (`CORRECTIONS`), the per-token log-ratio, the sequence's geometric-mean
log-ratio, the band mask, the weights, `Correction` (a method, its band and the TIS cap, as
`TrainerSettings.correction` gives it) and the masked share.
Leaves out: each method's band (``band`` in `trainer/sections.py`, checked at config load),
which tokens are trained before the correction (stale ones, `trainer/advantages.py`), the
first minibatch's old log-probs (`trainer/first_forward.py`), the loss
(`ppo_math.policy_loss`: the weights multiply each token's loss; the kept tokens are its
loss mask, so a masked token leaves the loss's denominator as well, verl's way).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import torch

from . import ppo_math
from .sections import CorrectionKind, band

CORRECTIONS: tuple[str, ...] = typing.get_args(CorrectionKind)
@torch.no_grad()
def log_ratio(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_behaviour) = old_logp - behaviour_logp per token -> [B, T], 0 outside `mask`.

    old_logp, behaviour_logp, mask: [B, T]; float32 for half-precision inputs."""
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    diff = old_logp.to(dtype) - behaviour_logp.to(dtype)  # [B, T]
    return torch.where(mask.bool(), diff, torch.zeros((), dtype=dtype, device=diff.device))


@torch.no_grad()
def sequence_log_ratio(token_log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean log-ratio over its valid tokens (the log of the geometric mean of
    its ratios) -> [B]; 0 for a row without any. token_log_ratio, mask: [B, T]."""
    valid = mask.bool()
    total = torch.where(valid, token_log_ratio, torch.zeros_like(token_log_ratio)).sum(-1)  # [B]
    return total / valid.sum(-1).clamp_min(1)


@torch.no_grad()
def in_band(log_ratio_: torch.Tensor, mask: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """Valid positions whose ratio exp(log_ratio_) lies in [lower, upper] -> [B, T] bool.

    log_ratio_, mask: [B, T]; compared in log space (no overflow for huge ratios)."""
    return mask.bool() & (log_ratio_ >= math.log(lower)) & (log_ratio_ <= math.log(upper))


@dataclasses.dataclass(frozen=True)
class Correction:
    """A mismatch correction (`kind` of `CORRECTIONS`, its bounds, 0: the defaults) and
    the TIS cap of `overlap.staleness=is` (None: off)."""

    kind: str = "none"
    lower: float = 0.0
    upper: float = 0.0
    is_cap: float | None = None

    @property
    def masks(self) -> bool:
        """Whether tokens leave the loss (a masked-IS method is on)."""
        return self.kind != "none"

    @property
    def weighs(self) -> bool:
        """Whether the loss carries importance weights (a method, or the TIS cap)."""
        return self.masks or self.is_cap is not None

    @torch.no_grad()
    def terms(self, behaviour_logp: torch.Tensor, old_logp: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep [B, T] bool, weights [B, T]) over the valid tokens of `mask` [B, T].

        Without a method: every valid token kept, TIS weights min(rho, is_cap). With one:
        the tokens whose ratio (token_mis, icepop: the token's; seq_mis: its sequence's
        geometric mean) is in the band kept, weighted by that ratio (truncated at
        `is_cap` when set), the others 0. Weights are 0 outside `mask`."""
        if not self.masks:
            if self.is_cap is None:
                raise ValueError("Correction.terms: neither a correction nor a TIS cap is on")
            return mask.bool(), ppo_math.truncated_is_weights(behaviour_logp, old_logp, mask, self.is_cap)
        lo, hi = band(self.kind, self.lower, self.upper)
        ratio = log_ratio(old_logp, behaviour_logp, mask)  # [B, T]
        if self.kind == "seq_mis":  # every token carries its sequence's geometric-mean log-ratio
            ratio = sequence_log_ratio(ratio, mask)[:, None].expand_as(ratio)  # [B, T]
        keep = in_band(ratio, mask, lo, hi)  # [B, T]
        weights = torch.where(keep, ratio.exp(), torch.zeros_like(ratio))  # [B, T]
        if self.is_cap is not None:
            weights = weights.clamp(max=self.is_cap)
        return keep, weights


def masked_fraction(trained: torch.Tensor, kept: torch.Tensor) -> float:
    """Share of the `trained` [B, T] tokens that `kept` [B, T] leaves out; 0 without any."""
    total = int(trained.bool().sum())
    return (total - int((trained.bool() & kept.bool()).sum())) / total if total else 0.0
