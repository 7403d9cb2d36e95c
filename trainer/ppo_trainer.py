"""The training half of a PPO step on FSDP2: one method per phase, so the loop can time each.

Owns: the actor (trainable), the reference (frozen copy of the initial actor) and the
critic (`ValueModel`), all FSDP2-sharded; their AdamW optimizers; the phases
ref_logprobs / old_logprobs / values (no grad) -> advantages -> train_critic /
train_actor; the actor's full state dict for weight sync; the world-size independent
training state for checkpoints; offload/onload of the sharded state on CUDA.

Leaves out: rollouts and scoring (`engine/`), the KL coefficient schedule
(`trainer/kl_control.py`: pass its value to `advantages`), writing checkpoints to disk
and the step loop (`colocate/`).

Ranks: every rank holds the same full `TrainBatch` (rank 0 broadcasts it). No-grad
phases give each rank a contiguous 1/world of the rows and all-gather the results.
In training, every minibatch (same shuffled indices on all ranks) is split the same way;
each rank's loss is its share of the minibatch loss: local sum / minibatch denominator
(valid tokens for token-mean, non-empty rows for seq-mean modes, counted over the whole
minibatch, which every rank can see), times world size because FSDP averages gradients
over ranks. So 1 rank and N ranks (and any micro-batching) minimise the same loss.
Models stay in eval mode: dropout would make the first-epoch ratio differ from 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from .errors import TrainerConfigError
from . import ppo_math
from .batch import TrainBatch
from .critic import ValueModel
from .distributed import (
    DistInfo, all_reduce_sum, broadcast_object, full_state_dict, gather_rows, init_distributed, rank_rows,
    shard_model,
)
from .forward import agg_denominator, evaluate_rows, policy_forward, value_forward
from .offload import HostStash
from .optim import (
    build_adamw, full_training_state, guarded_step, load_training_state, move_optimizer_state,
)

# per-micro-batch loss: (micro batch, its rows of the extra tensors) -> (loss, {stat: 0-dim token mean})
LossFn = Callable[[TrainBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    actor_path: str
    critic_path: str | None = None  # None: the critic's backbone is the actor's
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay float32
    device: str = "cpu"
    seed: int = 0
    actor_lr: float = 2e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 1
    minibatches: int = 2
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    kl_estimator: str = "k1"
    whiten_advantages: bool = True
    loss_agg: str = "token-mean"
    value_coef: float = 1.0
    is_cap: float | None = None  # truncated-IS cap for tokens sampled under other weights
    max_staleness: int | None = None  # train only on tokens at most this many versions old
    temperature: float = 1.0  # sampling temperature the behaviour logprobs were taken at
    micro_batch: int = 8  # rows per forward pass (bounds activation memory)
    host_offload: str = "pinned"  # CUDA offload target: reused page-locked buffers, or "pageable" (module.to)
    trust_remote_code: bool = False  # let transformers run code the model folders ship

    def __post_init__(self) -> None:
        checks = {
            "dtype": self.dtype in ("float32", "bfloat16", "float16"),
            "loss_agg": self.loss_agg in ppo_math.AGG_MODES,
            "kl_estimator": self.kl_estimator in ppo_math.KL_KINDS,
            "epochs": self.epochs >= 1,
            "minibatches": self.minibatches >= 1,
            "micro_batch": self.micro_batch >= 1,
            "host_offload": self.host_offload in ("pinned", "pageable"),
            "temperature": self.temperature > 0,
            "is_cap": self.is_cap is None or self.is_cap > 0,
            "max_staleness": self.max_staleness is None or self.max_staleness >= 0,
        }
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise TrainerConfigError(f"invalid trainer setting(s) {bad}: {[getattr(self, k) for k in bad]}")

    @property
    def critic_source(self) -> str:
        return self.critic_path or self.actor_path

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class PPOTrainer:
    """Actor, reference and critic on FSDP2, and the PPO phases over a `TrainBatch`."""

    def __init__(self, settings: TrainerSettings, dist: DistInfo | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.dist = dist if dist is not None else init_distributed(settings.device)
        torch.manual_seed(settings.seed)  # same on every rank
        compute = settings.torch_dtype

        def load_actor() -> nn.Module:
            model = AutoModelForCausalLM.from_pretrained(settings.actor_path, dtype=torch.float32,
                                                         trust_remote_code=settings.trust_remote_code)
            return shard_model(model.eval(), self.dist, compute)

        self.actor = load_actor()
        self.ref = load_actor().requires_grad_(False)
        critic = ValueModel.from_pretrained(settings.critic_source, dtype=torch.float32, seed=settings.seed,
                                           trust_remote_code=settings.trust_remote_code)
        self.critic = shard_model(critic.eval(), self.dist, compute)
        self.actor_optim = build_adamw(self.actor, settings.actor_lr, settings.weight_decay)
        self.critic_optim = build_adamw(self.critic, settings.critic_lr, settings.weight_decay)
        self.updates = {"actor": 0, "critic": 0}  # train_* calls so far: seeds the minibatch shuffle
        self.stash = HostStash()  # pinned host buffers of the CUDA offload, reused every step

    # ---------------------------------------------------------------- no-grad phases

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Reference log-probs of the response tokens -> [B, T] (0 on padding)."""
        return self._rows_no_grad(lambda mb: policy_forward(self.ref, mb, self.settings.temperature)[0], batch)

    def old_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Current actor log-probs of the response tokens -> [B, T] (0 on padding)."""
        return self._rows_no_grad(lambda mb: policy_forward(self.actor, mb, self.settings.temperature)[0], batch)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values of the states emitting each response token -> [B, T] (0 on padding)."""
        return self._rows_no_grad(lambda mb: value_forward(self.critic, mb), batch)

    def _rows_no_grad(self, fn: Callable[[TrainBatch], torch.Tensor], batch: TrainBatch) -> torch.Tensor:
        local = batch.select(torch.arange(batch.size)[rank_rows(batch.size, self.dist)])
        out = evaluate_rows(fn, local, self.settings.micro_batch, self.dist.device)  # [B / world, T]
        return gather_rows(out.float(), self.dist).to(batch.responses.device)  # [B, T]

    # ---------------------------------------------------------------- advantages

    @torch.no_grad()
    def advantages(
        self, batch: TrainBatch, old_logp: torch.Tensor, ref_logp: torch.Tensor, values: torch.Tensor,
        kl_coef: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, returns, token_rewards, kl), each [B, T]: KL-shaped rewards, GAE, optional whitening."""
        s, mask = self.settings, batch.response_mask
        kl = ppo_math.kl_estimate(old_logp, ref_logp, s.kl_estimator)  # [B, T]
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        rewards = ppo_math.token_rewards(batch.scores, kl, mask, kl_coef)  # [B, T]
        adv, returns = ppo_math.gae_advantages(rewards, values, mask, s.gamma, s.lam)  # [B, T]
        if s.whiten_advantages:
            adv = ppo_math.masked_whiten(adv, mask)
        return adv, returns, rewards, kl

    # ---------------------------------------------------------------- training phases

    def train_critic(self, batch: TrainBatch, values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """Clipped value loss, epochs x minibatches -> {value_loss, vf_clip_frac, grad_norm, skipped_steps, …}."""
        s = self.settings

        def loss_fn(mb: TrainBatch, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            new_values = value_forward(self.critic, mb)  # [b, T]
            loss, stats = ppo_math.value_loss(
                new_values, t["old_values"], t["returns"], t["loss_mask"], s.value_clip_eps, s.loss_agg
            )
            return loss, stats

        extra = {"old_values": values, "returns": returns, "loss_mask": batch.response_mask}
        return self._optimise("critic", self.critic, self.critic_optim, batch, extra, loss_fn)

    def train_actor(
        self, batch: TrainBatch, old_logp: torch.Tensor, advantages: torch.Tensor, current_version: int
    ) -> dict[str, float]:
        """Clipped policy loss, epochs x minibatches, with staleness correction.

        Tokens sampled more than `max_staleness` versions before `current_version` are
        left out of the loss; with `is_cap`, each token's loss is weighted by
        min(pi_old / pi_behaviour, is_cap). Returns {policy_loss, clip_frac, approx_kl,
        entropy, grad_norm, skipped_steps, …} as floats.
        """
        s, mask = self.settings, batch.response_mask
        loss_mask = mask
        if s.max_staleness is not None:
            loss_mask = ppo_math.staleness_mask(batch.versions, current_version, s.max_staleness, mask)
        extra = {"old_logp": old_logp, "advantages": advantages, "loss_mask": loss_mask}
        if s.is_cap is not None:
            extra["is_weights"] = ppo_math.truncated_is_weights(batch.behaviour_logp, old_logp, mask, s.is_cap)

        def loss_fn(mb: TrainBatch, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logp, entropy = policy_forward(self.actor, mb, s.temperature, with_entropy=True)  # [b, T]
            loss, stats = ppo_math.policy_loss(
                logp, t["old_logp"], t["advantages"], t["loss_mask"], s.clip_eps, s.loss_agg, t.get("is_weights")
            )
            stats["entropy"] = ppo_math.masked_mean(entropy, t["loss_mask"])
            return loss, stats

        return self._optimise("actor", self.actor, self.actor_optim, batch, extra, loss_fn)

    def _optimise(
        self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch,
        extra: dict[str, torch.Tensor], loss_fn: LossFn,
    ) -> dict[str, float]:
        """epochs x minibatches guarded optimizer steps; stats averaged over the steps taken."""
        s = self.settings
        if batch.size % (s.minibatches * self.dist.world_size):
            raise TrainerConfigError(
                f"batch of {batch.size} rows does not split into ppo minibatches={s.minibatches} "
                f"x {self.dist.world_size} ranks"
            )
        generator = torch.Generator().manual_seed(s.seed * 1_000_003 + 2 * self.updates[name] + (name == "critic"))
        self.updates[name] += 1
        loss_key = "policy_loss" if name == "actor" else "value_loss"
        totals: dict[str, float] = defaultdict(float)
        counts = {"steps": 0, "skipped_steps": 0, "empty_steps": 0}
        for _ in range(s.epochs):
            for idx in batch.minibatches(s.minibatches, generator):
                rows = {k: v[idx] for k, v in extra.items()}
                step = self._minibatch_step(model, optimizer, batch.select(idx), rows, loss_fn)
                outcome = step.pop("outcome")
                counts[outcome] += 1
                for key, value in step.items() if outcome == "steps" else ():
                    totals[loss_key if key == "loss" else key] += value
        taken = counts["steps"]
        stats = {key: (value / taken if taken else float("nan")) for key, value in totals.items()}
        return stats | {key: float(value) for key, value in counts.items()}

    def _minibatch_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, minibatch: TrainBatch,
        extra: dict[str, torch.Tensor], loss_fn: LossFn,
    ) -> dict[str, Any]:
        """One optimizer step on this rank's share of `minibatch`, micro-batched; stats are global.

        Backward of loss_local * (local denominator / minibatch denominator) * world: the
        gradient FSDP averages over ranks is the gradient of the whole minibatch's loss.
        Stats: the loss exactly, the others as token-weighted means over the minibatch.
        """
        s, device = self.settings, self.dist.device
        coef = s.value_coef if model is self.critic else 1.0
        denominator = agg_denominator(extra["loss_mask"], s.loss_agg)  # whole minibatch: same on all ranks
        tokens = extra["loss_mask"].bool().sum()
        if int(denominator) == 0:
            return {"outcome": "empty_steps"}
        keys, sums = ["loss"], None
        for micro in torch.arange(minibatch.size)[rank_rows(minibatch.size, self.dist)].split(s.micro_batch):
            mb, t = minibatch.select(micro).to(device), {k: v[micro].to(device) for k, v in extra.items()}
            loss, stats = loss_fn(mb, t)
            share = agg_denominator(t["loss_mask"], s.loss_agg).float() / denominator  # this micro-batch's part
            (coef * loss * share * self.dist.world_size).backward()
            token_share = t["loss_mask"].bool().sum() / tokens
            keys = ["loss", *stats]
            row = torch.stack([loss.detach().float() * share, *(v.float() * token_share for v in stats.values())])
            sums = row if sums is None else sums + row
        totals = all_reduce_sum(sums, self.dist).tolist()
        grad_norm, stepped = guarded_step(model, optimizer, s.max_grad_norm, math.isfinite(totals[0]))
        result = dict(zip(keys, totals)) | {"grad_norm": grad_norm}
        return result | {"outcome": "steps" if stepped else "skipped_steps"}

    # ---------------------------------------------------------------- weights and state

    def actor_state_for_sync(self) -> dict[str, torch.Tensor]:
        """Full HF-named actor state dict (float32, CPU) on rank 0; {} on other ranks. Collective."""
        return full_state_dict(self.actor)

    def state_dict(self) -> dict[str, Any]:
        """Actor, critic and both optimizers as full CPU state dicts on rank 0 (empty elsewhere). Collective.

        World-size independent: FQN keys, unsharded tensors. The reference model is not
        included: it is rebuilt from `actor_path`.
        """
        return {
            "actor": full_training_state(self.actor, self.actor_optim),
            "critic": full_training_state(self.critic, self.critic_optim),
            "updates": dict(self.updates),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state_dict()` output; only rank 0's copy is read, then broadcast and sharded. Collective."""
        load_training_state(self.actor, self.actor_optim, state.get("actor", {}), self.dist)
        load_training_state(self.critic, self.critic_optim, state.get("critic", {}), self.dist)
        self.updates = dict(broadcast_object(state.get("updates"), self.dist))

    def offload(self) -> bool:
        """CUDA: move actor, reference, critic and optimizer state to host memory and free the
        cache -> True (into reused pinned buffers unless ``host_offload="pageable"``).

        On CPU there is nothing to free: returns False and does nothing. Collective-free.
        """
        if self.dist.device.type != "cuda":
            return False
        if self.settings.host_offload == "pinned":
            self.stash.offload(self._models(), self._optimizers())
        else:
            self._move_plainly("cpu")
        torch.cuda.empty_cache()
        return True

    def onload(self) -> bool:
        """CUDA: move everything `offload` moved back to this rank's GPU -> True. CPU: False, no-op."""
        if self.dist.device.type != "cuda":
            return False
        if self.settings.host_offload == "pinned":
            self.stash.onload(self._models(), self._optimizers(), self.dist.device)
        else:
            self._move_plainly(self.dist.device)
        return True

    def _models(self) -> tuple[nn.Module, ...]:
        return self.actor, self.ref, self.critic

    def _optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return self.actor_optim, self.critic_optim

    def _move_plainly(self, device: torch.device | str) -> None:
        for model in self._models():
            model.to(device)
        for optimizer in self._optimizers():
            move_optimizer_state(optimizer, device)
        torch.cuda.synchronize(self.dist.device)
