"""Critic-free advantage estimators over groups of samples of one prompt (pure functions).

Owns: `ADVANTAGES` (the names peers use: verl's `algorithm.adv_estimator`, OpenRLHF's
`--advantage_estimator`), `CRITIC_FREE`, and the outcome advantages of each critic-free
estimator from per-sample returns and group ids, broadcast over each sample's response
tokens:

- ``grpo`` (Shao et al. 2024): (R - mean of the group) / (std of the group + eps), the std
  division switchable (``norm_by_std=False``: Dr. GRPO, Liu et al. 2025);
- ``rloo`` (Ahmadian et al. 2024): R - the mean of the *other* members;
- ``reinforce_baseline`` (REINFORCE++ with a group baseline, Hu 2025): R - mean of the
  group, then whitened over every response token of the batch.

A group of one has baseline 0 (and std 1), as in verl: its advantage is its return
(whitened, for ``reinforce_baseline``). A group whose returns are all equal gets 0, never
NaN. ``gae`` (with a critic) lives in `trainer/ppo_math.py`.

Leaves out: where returns come from (`trainer/advantages.py`: the score minus the KL
penalty summed over the response when KL is in the reward), the losses.
"""

from __future__ import annotations

import typing

import torch

from .ppo_math import masked_whiten
from .sections import Advantage

ADVANTAGES: tuple[str, ...] = typing.get_args(Advantage)
CRITIC_FREE: tuple[str, ...] = ("grpo", "rloo", "reinforce_baseline")
EPS = 1e-6  # added to a group's std (verl's epsilon)


def _group_stats(returns: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sample: (members of its group, sum of its group's returns, unbiased std of its group)."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=returns.dtype).index_add_(0, inverse, returns)  # [G]
    n = counts.to(returns.dtype)  # [G]
    mean = sums / n
    sq = torch.zeros_like(sums).index_add_(0, inverse, (returns - mean[inverse]).square())  # [G]
    std = torch.where(n > 1, (sq / (n - 1).clamp_min(1)).sqrt(), torch.ones_like(n))
    return n[inverse], sums[inverse], std[inverse]


@torch.no_grad()
def outcome_advantages(
    returns: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, kind: str, norm_by_std: bool = True
) -> torch.Tensor:
    """returns [B] float, groups [B] long (equal ids: samples of one prompt), mask [B, T]
    (the trained tokens: the loss mask) -> advantages [B, T]: each sample's advantage on
    its masked tokens, 0 elsewhere (padding, a trajectory's environment tokens)."""
    if kind not in CRITIC_FREE:
        raise ValueError(f"kind must be one of {CRITIC_FREE}, got {kind!r}")
    r = returns.to(torch.float64)
    n, total, std = _group_stats(r, groups.to(returns.device))
    single = n == 1
    if kind == "rloo":
        adv = torch.where(single, r, r - (total - r) / (n - 1).clamp_min(1))
    else:
        adv = r - torch.where(single, torch.zeros_like(r), total / n)
        if kind == "grpo" and norm_by_std:
            adv = adv / (std + EPS)
    valid = mask.bool()
    out = torch.where(valid, adv[:, None].expand(valid.shape), torch.zeros_like(adv)[:, None])  # [B, T]
    if kind == "reinforce_baseline":
        out = masked_whiten(out, valid)
    return out.to(returns.dtype)
