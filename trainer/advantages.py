"""The per-token tensors a PPO step trains on, from its batch and its no-grad passes (pure functions).

Owns: the advantage phase (:func:`advantages`: the KL to the reference (:func:`token_kl`),
the token rewards, advantages and returns by GAE or a critic-free group estimator); the
per-token inputs of the actor's update (:func:`actor_inputs`: old log-probs, advantages,
the loss mask with stale tokens (:func:`trained_mask`) and mismatched ones left out, the
importance weights, the reference log-probs of a KL loss term) and of the critic's
(:func:`critic_inputs`: old values, returns); :func:`model_tokens`, which zeroes a [B, T]
tensor outside the trained tokens. Every tensor is [B, T] and exactly 0 outside
`TrainBatch.loss_mask` (environment tokens, padding).

Leaves out: the passes that produce log-probs and values, the losses and the optimizer
steps (`trainer/ppo_trainer.py`, `trainer/update.py`); the math itself (GAE, KL estimators,
token rewards, whitening, staleness: `trainer/ppo_math.py`; the group estimators:
`trainer/estimators.py`; the mismatch correction: `trainer/mismatch.py`); the KL
coefficient schedule (`trainer/kl_control.py`).
"""

from __future__ import annotations

import torch

from . import ppo_math
from .batch import TrainBatch
from .errors import TrainerConfigError
from .estimators import outcome_advantages
from .rollout_logp import on_policy_mask
from .settings import TrainerSettings


@torch.no_grad()
def advantages(
    s: TrainerSettings, batch: TrainBatch, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
    values: torch.Tensor | None, kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, returns, token_rewards, kl), each [B, T], all 0 outside `loss_mask`
    (kl all 0 without a reference: `ref_logp` None).

    Rewards: the score on each row's last model token, minus kl_coef x KL on every
    model token when KL is in the reward (``kl_in="reward"``). gae: GAE over `values`
    through the whole response, passing through environment tokens (`acting`), whitened
    over model tokens if asked; returns = advantages + values. Critic-free: the group
    estimator over each row's return (its rewards summed, `trainer/estimators.py`),
    `values` unused; returns = that return on every model token.
    """
    loss_mask = batch.loss_mask
    kl = token_kl(s, batch, old_logp, ref_logp)  # [B, T]
    rewards = ppo_math.token_rewards(batch.scores, kl, loss_mask,
                                     kl_coef if s.ppo.kl_in == "reward" else 0.0)  # [B, T]
    if s.critic_free:
        total = rewards.sum(-1)  # [B]
        adv = outcome_advantages(total, batch.groups, loss_mask, s.ppo.advantage, s.ppo.norm_adv_by_std)  # [B, T]
        returns = torch.where(loss_mask, total[:, None].expand_as(rewards), torch.zeros_like(rewards))  # [B, T]
        return adv, returns, rewards, kl
    adv, returns = ppo_math.gae_advantages(rewards, values, batch.response_mask, s.ppo.gamma, s.ppo.lam,
                                           acting=loss_mask)  # [B, T]
    if s.ppo.whiten_advantages:
        adv = ppo_math.masked_whiten(adv, loss_mask)
    return adv, returns, rewards, kl


@torch.no_grad()
def token_kl(
    s: TrainerSettings, batch: TrainBatch, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
) -> torch.Tensor:
    """The KL estimate (`kl_estimator`) of the old policy to the reference per model token
    -> [B, T], 0 elsewhere, all 0 without a reference (`ref_logp` None: settings.reference off)."""
    if ref_logp is None:
        return torch.zeros_like(old_logp)
    kl = ppo_math.kl_estimate(old_logp, ref_logp, s.ppo.kl_estimator)  # [B, T]
    return torch.where(batch.loss_mask, kl, torch.zeros_like(kl))


def trained_mask(s: TrainerSettings, batch: TrainBatch, current_version: int) -> torch.Tensor:
    """The tokens the actor trains before the mismatch correction -> [B, T] bool: model
    tokens, without those more than `max_staleness` versions before `current_version`."""
    if s.max_staleness is None:
        return batch.loss_mask
    return ppo_math.staleness_mask(batch.versions, current_version, s.max_staleness, batch.loss_mask)


def actor_inputs(
    s: TrainerSettings, batch: TrainBatch, old_logp: torch.Tensor, advantages: torch.Tensor,
    current_version: int, ref_logp: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The per-row tensors the actor's update slices per minibatch, on model tokens only:
    old_logp, advantages, loss_mask (`trained_mask`, without the tokens the mismatch
    correction masks), behaviour_logp, on_policy (the drift probe's tokens), with
    `is_cap` or a correction is_weights (`trainer/mismatch.py`: min(pi_old / pi_behaviour,
    is_cap), or the kept tokens' ratio), with ``kl_in="loss"`` ref_logp (a one-line
    `TrainerConfigError` when it is missing)."""
    mask = batch.loss_mask
    old_logp, advantages, behaviour = (model_tokens(x, mask) for x in (old_logp, advantages, batch.behaviour_logp))
    extra = {"old_logp": old_logp, "advantages": advantages, "loss_mask": trained_mask(s, batch, current_version),
             "behaviour_logp": behaviour,
             "on_policy": on_policy_mask(batch.versions, mask, current_version)}
    correction = s.correction
    if correction.weighs:
        keep, extra["is_weights"] = correction.terms(behaviour, old_logp, mask)
        if correction.masks:
            extra["loss_mask"] = extra["loss_mask"] & keep  # a new tensor: the first forward may refill it
    if s.ppo.kl_in == "loss" and s.reference:
        if ref_logp is None:
            raise TrainerConfigError("train_actor: ppo.kl_in=loss needs the reference log-probs (ref_logp)")
        extra["ref_logp"] = model_tokens(ref_logp, mask)
    return extra


def critic_inputs(batch: TrainBatch, values: torch.Tensor, returns: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-row tensors the critic's update slices per minibatch, on model tokens only:
    old_values, returns, loss_mask."""
    keep = batch.loss_mask
    return {"old_values": model_tokens(values, keep), "returns": model_tokens(returns, keep), "loss_mask": keep}


def model_tokens(x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """x [B, T] on the trained tokens, exactly 0 elsewhere (environment tokens, padding),
    whatever x holds there: an inf/NaN left there would reach the gradient as 0 * inf."""
    return torch.where(loss_mask.to(x.device), x, torch.zeros((), dtype=x.dtype, device=x.device))
