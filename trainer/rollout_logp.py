"""Old log-probs from the rollout, and the engine-vs-trainer log-prob drift that says when that is safe.

Owns: pure functions on [B, T] tensors: which tokens were sampled under the current
weights (`on_policy_mask`), which rows hold tokens of older weights (`stale_rows`), the
old log-probs of `ppo.old_logp=rollout` (`rollout_old_logp`), and the drift statistic
(`drift_terms` per micro-batch, `drift_stats` once summed over micro-batches and ranks).

Leaves out: forward passes and ranks (`trainer/ppo_trainer.py`).

Why a row with stale tokens is recomputed rather than anchored to its behaviour
log-probs: the PPO ratio's denominator must be the policy the update starts from. For a
token sampled under the current weights the engine's log-prob is that policy (up to the
drift measured here). A deferred partial's older tokens were sampled by older weights;
their behaviour log-prob is a different policy, and the staleness correction
(`ppo_math.truncated_is_weights`: min(pi_old / pi_behaviour, cap)) needs both: anchoring
pi_old to pi_behaviour would make every weight 1 and silently switch the correction off.
Recomputing keeps `rollout` exactly `recompute` on those rows; its cost follows the
deferred rows only (none in sequential and intra modes).

Drift: |engine log-prob - trainer log-prob| on on-policy tokens, from the actor's first
training forward of a step (weights still the sampling weights; no extra pass). SGLang
returns log(softmax(logits / temperature)) when sampling and log_softmax(logits) when
greedy; the trainer scores at `TrainerSettings.temperature` (the rollout's, 1 for greedy).
"""

from __future__ import annotations

import torch


def on_policy_mask(versions: torch.Tensor, mask: torch.Tensor, current_version: int) -> torch.Tensor:
    """Valid tokens sampled under weight version `current_version`: [B, T] -> [B, T] bool."""
    return mask.bool() & (versions == current_version)


def stale_rows(versions: torch.Tensor, mask: torch.Tensor, current_version: int) -> torch.Tensor:
    """Rows holding at least one valid token of another weight version: [B, T] -> [B] bool."""
    return (mask.bool() & (versions != current_version)).any(-1)


def rollout_old_logp(
    behaviour_logp: torch.Tensor, recomputed: torch.Tensor, stale: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Old log-probs [B, T]: the behaviour log-probs on fresh rows, `recomputed` on `stale` [B] rows, 0 on padding.

    behaviour_logp, recomputed, mask: [B, T] (`recomputed` is only read on stale rows).
    """
    old = torch.where(stale[:, None], recomputed.to(behaviour_logp.dtype), behaviour_logp)  # [B, T]
    return torch.where(mask.bool(), old, torch.zeros_like(old))


@torch.no_grad()
def drift_terms(logp: torch.Tensor, behaviour_logp: torch.Tensor, on_policy: torch.Tensor) -> torch.Tensor:
    """(sum |d|, count, max |d|) of d = logp - behaviour_logp over `on_policy` tokens -> [3] float32.

    logp, behaviour_logp, on_policy: [b, T]. Sums and maxima of several micro-batches and
    ranks combine element-wise (sum, sum, max); max is 0 without on-policy tokens.
    """
    valid = on_policy.bool()
    gap = (logp.detach().float() - behaviour_logp.float()).abs()  # [b, T]
    gap = torch.where(valid, gap, torch.zeros_like(gap))
    return torch.stack([gap.sum(), valid.sum().float(), gap.max() if gap.numel() else gap.new_zeros(())])


def drift_stats(sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
    """{logp_drift_mean, logp_drift_max} from summed (sum |d|, count) and the max |d|; {} without on-policy tokens."""
    total, count = float(sums[0]), float(sums[1])
    if count == 0:
        return {}
    return {"logp_drift_mean": total / count, "logp_drift_max": float(maxima)}
