"""The training half of a PPO step on FSDP2: one method per phase, so the loop can time each.

Owns: the actor (trainable; LoRA adapters over a frozen base with `lora.rank` > 0), the
reference (frozen copy of the initial actor, or under LoRA the actor with its adapters
disabled) and the critic (`ValueModel`; none with a critic-free estimator, `settings.critic_free`), all
FSDP2-sharded; their AdamW optimizers; the phases
ref_logprobs / old_logprobs / values (no grad) -> advantages -> train_critic /
train_actor; the actor's full state dict for weight sync; the world-size independent
training state for checkpoints; offload/onload of the sharded state on CUDA.

Leaves out: rollouts and scoring (`engine/`), the advantage math and the updates' per-token
inputs (`trainer/advantages.py`), the KL coefficient schedule (`trainer/kl_control.py`:
pass its value to `advantages`), writing checkpoints to disk and the step loop (`colocate/`).

Ranks: every rank holds the same full `TrainBatch` (rank 0 broadcasts it). Which rows a
rank runs, in which micro-batches, is a plan (`trainer/packing.py`; with `shares_prefix` a
group's rows as one unit, `trainer/packed.py`); every rank runs the same number of
micro-batches (idle ones where it has fewer), so FSDP's collectives line up. No-grad phases
sum every rank's rows (0 elsewhere) over ranks. Each rank's loss is its share of the
minibatch loss (`trainer/update.py`), so 1 rank and N ranks, packed or padded, and any
micro-batching minimise the same loss. Models stay in eval mode: dropout would make the
first-epoch ratio differ from 1.

Masks: `TrainBatch.response_mask` says which positions exist (forwards, packing, values);
`TrainBatch.loss_mask` (response_mask minus a multi-turn trajectory's environment tokens)
says which tokens are trained: the KL, the rewards, the advantages (GAE passes through
environment tokens), the losses, their token counts and the staleness correction.

Old log-probs: `old_logp="rollout"` takes the engine's sampling log-probs where they are
exact and recomputes only rows with older tokens (`trainer/rollout_logp.py`); where nothing
reads them before the update, the first minibatch's come from its own forward
(`trainer/first_forward.py`). The engine-vs-trainer drift is measured on the first minibatch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .advantages import actor_inputs, advantages as compute_advantages, critic_inputs, trained_mask
from .errors import ModelSourceError, TrainerConfigError
from . import ppo_math
from .batch import TrainBatch
from .critic import ValueModel
from .distributed import (DistInfo, all_reduce_sum, broadcast_object, first_pass, full_state_dict,
                          full_state_everywhere, full_tensors, init_distributed, shard_model)
from .lora import adapted_weight, add_lora, is_lora, merged_weights
from .mismatch import masked_fraction
from .first_forward import FirstForward
from .forward import evaluate_plan, packed_policy_forward, packed_value_forward, policy_forward, value_forward
from .offload import HostStash, move_plainly
from .optim import build_adamw, full_training_state, load_training_state
from .packed import shared_plan_units, trainer_tokens
from .packing import Plan, packed_micro_batches, row_micro_batches, unit_micro_batches
from .rollout_logp import drift_terms, rollout_old_logp, stale_rows
from .settings import TrainerSettings
from .state_size import saved_shapes, state_mib, sync_numels, tied_copies
from .varlen_attention import VARLEN_SDPA, register_varlen_sdpa
from .update import LossFn, Update, optimise

__all__ = ["PPOTrainer", "TrainerSettings"]


class PPOTrainer:
    """Actor, reference and critic on FSDP2, and the PPO phases over a `TrainBatch`."""

    def __init__(self, settings: TrainerSettings, dist: DistInfo | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.dist = dist if dist is not None else init_distributed(settings.device)
        torch.manual_seed(settings.seed)  # same on every rank
        compute = settings.torch_dtype
        if settings.attn_implementation == VARLEN_SDPA:
            register_varlen_sdpa()

        def load_actor(trained: bool) -> nn.Module:
            model, loaded = AutoModelForCausalLM.from_pretrained(settings.actor_path, dtype=torch.float32,
                                                                 trust_remote_code=settings.trust_remote_code,
                                                                 attn_implementation=settings.attn_implementation,
                                                                 output_loading_info=True)
            if missing := sorted(loaded.get("missing_keys") or ()):  # transformers would start them at random
                raise ModelSourceError(
                    f"models.actor: '{settings.actor_path}' lacks {len(missing)} weight(s) its "
                    f"{type(model).__name__} needs (e.g. {missing[0]}), which transformers would start at "
                    "random; use a complete model folder (re-save it with save_pretrained)")
            if trained:
                model = _trainable(model, settings, settings.lora.on_actor)
            model = shard_model(model.eval(), self.dist, compute)
            if trained and settings.lora.on_actor:
                first_pass(model, self.dist.device)  # FSDP's gradient dtypes from the adapters
            return model

        self.actor = load_actor(trained=True)
        # the reference: the actor with its adapters disabled under LoRA (no third copy), else a
        # frozen copy; none at all when nothing reads it (`settings.reference`: the KL is off)
        self.ref = (None if settings.lora.on_actor or not settings.reference
                    else load_actor(trained=False).requires_grad_(False))
        self.actor_optim = build_adamw(self.actor, settings.ppo.actor_lr, settings.ppo.weight_decay)
        self.critic: nn.Module | None = None  # critic-free estimators build none
        self.critic_optim: torch.optim.Optimizer | None = None
        if not settings.critic_free:
            critic = ValueModel.from_pretrained(settings.critic_source, dtype=torch.float32, seed=settings.seed,
                                               trust_remote_code=settings.trust_remote_code,
                                               attn_implementation=settings.attn_implementation)
            critic.model = _trainable(critic.model, settings, settings.lora.on_critic)  # the value head trains in full
            self.critic = shard_model(critic.eval(), self.dist, compute)
            self.critic_optim = build_adamw(self.critic, settings.ppo.critic_lr, settings.ppo.weight_decay)
        self._sync_numel: tuple[int, int] | None = None  # `sync_numel` (adapted only, whole), counted at its first call
        self._tied_names: frozenset[str] | None = None  # `tied_copies` of the actor, found at the first push
        self.updates = {"actor": 0, "critic": 0}  # train_* calls so far: seeds the minibatch shuffle
        self.stash = HostStash()  # pinned host buffers of the CUDA offload, reused every step

    @property
    def _policy(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        if self.settings.shares_prefix:
            return functools.partial(packed_policy_forward, shared_prefix=True)
        return packed_policy_forward if self.settings.ppo.packing else policy_forward

    @property
    def _value(self) -> Callable[[nn.Module, TrainBatch], torch.Tensor]:
        if self.settings.shares_prefix:
            return functools.partial(packed_value_forward, shared_prefix=True)
        return packed_value_forward if self.settings.ppo.packing else value_forward

    # ---------------------------------------------------------------- no-grad phases, advantages

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Reference log-probs of the response tokens -> [B, T] (0 on padding): the frozen
        copy of the initial actor, or under LoRA the actor with its adapters disabled; None
        (no pass) when the trainer has no reference (``settings.reference``)."""
        if not self.settings.reference:
            return None
        if self.ref is None:
            with self.actor.disable_adapter():
                return self._rows_no_grad(self._actor_logp, batch)
        return self._rows_no_grad(lambda mb: self._policy(self.ref, mb, self.settings.temperature)[0], batch)

    def old_logprobs(self, batch: TrainBatch, current_version: int | None = None,
                     leave_first: bool = False) -> torch.Tensor:
        """Log-probs of the response tokens under the current actor -> [B, T] (0 on padding).

        With ``old_logp="rollout"`` and `current_version` given: the rollout's behaviour
        log-probs, recomputed only on rows holding model tokens of another weight version
        (no forward at all when there are none), 0 on environment tokens (they have no
        behaviour log-prob nor a version of their own). Otherwise a no-grad actor pass;
        with `leave_first` (`settings.old_logp_from_first_forward`) over all rows but those
        of the next `train_actor`'s first minibatch, left 0 for its `fill_first`.
        """
        if leave_first:
            rest = torch.ones(batch.size, dtype=torch.bool)
            rest[self._first_minibatch(batch, "old_logprobs(leave_first)")] = False
            return self._rows_no_grad(self._actor_logp, batch, only=rest)
        if self.settings.ppo.old_logp != "rollout" or current_version is None:
            return self._rows_no_grad(self._actor_logp, batch)
        stale = stale_rows(batch.versions, batch.loss_mask, current_version)  # [B]
        recomputed = self._rows_no_grad(self._actor_logp, batch, only=stale)  # [B, T]
        return rollout_old_logp(batch.behaviour_logp, recomputed, stale, batch.loss_mask)

    def _actor_logp(self, mb: TrainBatch) -> torch.Tensor:
        return self._policy(self.actor, mb, self.settings.temperature)[0]

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values of the states emitting each response token -> [B, T] (0 on padding)."""
        if self.critic is None:
            raise TrainerConfigError(f"values: ppo.advantage={self.settings.ppo.advantage} trains no critic")
        return self._rows_no_grad(lambda mb: self._value(self.critic, mb), batch)

    def _rows_no_grad(self, fn: Callable[[TrainBatch], torch.Tensor], batch: TrainBatch,
                      only: torch.Tensor | None = None) -> torch.Tensor:
        """fn over every row of `batch`, or over the rows where `only` [B] is True (0 on the
        others; no forward at all when there are none) -> [B, T] float32. Collective."""
        if only is not None:
            out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=batch.responses.device)
            if bool(only.any()):
                idx = only.nonzero()[:, 0]
                out[idx] = self._rows_no_grad(fn, batch.select(idx))
            return out
        out = evaluate_plan(fn, batch, self._plan(batch), self.dist.device)  # [B, T], 0 on other ranks' rows
        return all_reduce_sum(out, self.dist).to(batch.responses.device)  # [B, T]

    def pass_tokens(self, batch: TrainBatch) -> tuple[int, int]:
        """(computed, sample_tokens) of one pass over `batch`: the tokens a forward runs
        (packed: prompts shared within a group; right-padded: B x the longest row) and the
        rows' own prompt + response tokens."""
        s = self.settings
        if s.ppo.packing:
            return trainer_tokens(batch, s.shares_prefix, s.token_budget)
        lengths = batch.attention_mask.sum(-1)
        return batch.size * int(lengths.max()), int(lengths.sum())

    def _plan(self, batch: TrainBatch) -> Plan:
        """This rank's micro-batches of `batch` (row indices; [] for an idle one)."""
        s, d = self.settings, self.dist
        if s.shares_prefix:  # a group sharing a prompt stays whole, or splits into parts with the prompt each
            units, tokens = shared_plan_units(batch, s.token_budget)
            return unit_micro_batches(units, tokens, d.world_size, d.rank, s.token_budget)
        if s.ppo.packing:
            lengths = batch.attention_mask.sum(-1).tolist()  # prompt + response tokens per row
            return packed_micro_batches(lengths, d.world_size, d.rank, s.token_budget)
        return row_micro_batches(batch.size, d.world_size, d.rank, s.micro_batch)

    def advantages(
        self, batch: TrainBatch, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, values: torch.Tensor | None,
        kl_coef: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, returns, token_rewards, kl), each [B, T], 0 outside `loss_mask` (`trainer/advantages.py`)."""
        return compute_advantages(self.settings, batch, old_logp, ref_logp, values, kl_coef)

    # ---------------------------------------------------------------- training phases

    def train_critic(self, batch: TrainBatch, values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """Clipped value loss over model tokens (`loss_mask`; `values` and `returns` are not
        read elsewhere), epochs x minibatches -> {value_loss, vf_clip_frac, grad_norm, skipped_steps, …}."""
        s = self.settings
        if self.critic is None:
            raise TrainerConfigError(f"train_critic: ppo.advantage={s.ppo.advantage} trains no critic")

        def loss_fn(mb: TrainBatch, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            new_values = self._value(self.critic, mb)  # [b, T]
            loss, stats = ppo_math.value_loss(
                new_values, t["old_values"], t["returns"], t["loss_mask"], s.ppo.value_clip_eps, s.ppo.loss_agg
            )
            return loss, stats

        extra = critic_inputs(batch, values, returns)  # on model tokens only
        return self._optimise("critic", self.critic, self.critic_optim, batch, extra, loss_fn)

    def train_actor(
        self, batch: TrainBatch, old_logp: torch.Tensor, advantages: torch.Tensor, current_version: int,
        ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, fill_first: bool = False,
    ) -> dict[str, float]:
        """Clipped policy loss, epochs x minibatches, with staleness correction; with
        ``kl_in="loss"`` plus kl_coef x k3 KL to the reference (`ref_logp`) per token,
        aggregated like the policy loss (reported as kl_loss).

        Only model tokens (`batch.loss_mask`) are in the loss, the KL term and the stats:
        what the inputs hold on environment tokens and padding does not change the update.
        Tokens sampled more than `max_staleness` versions before `current_version` are
        left out of the loss; with `is_cap`, each token's loss is weighted by
        min(pi_old / pi_behaviour, is_cap); with `rollout_correction`, tokens whose
        pi_old / pi_behaviour is outside its band are left out and the others weighted by
        it (`trainer/mismatch.py`). Returns {policy_loss, clip_frac, approx_kl, entropy,
        grad_norm, skipped_steps, …} as floats, plus logp_drift_mean/max (|engine - trainer|
        log-prob on the first minibatch's tokens of `current_version`) and with a
        correction mismatch_masked_frac (the share of the trained tokens it left out).
        `fill_first` (after ``old_logprobs(leave_first=True)``): fills `old_logp`'s first minibatch from its forward.
        """
        s, p = self.settings, self.settings.ppo
        extra = actor_inputs(s, batch, old_logp, advantages, current_version, ref_logp)  # on model tokens only
        trained = trained_mask(s, batch, current_version)  # before the mismatch correction
        fill = None
        if fill_first:  # rows no forward fills (nothing to train in the minibatch) get the no-grad pass
            recompute = functools.partial(self._rows_no_grad, self._actor_logp, batch)
            fill = FirstForward(self._first_minibatch(batch, "train_actor(fill_first)"), old_logp, extra,
                                batch.loss_mask, self.dist, recompute, s.correction, trained)

        def loss_fn(mb: TrainBatch, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logp, entropy = self._policy(self.actor, mb, s.temperature, with_entropy=True)  # [b, T]
            old, weights, mask = ((t["old_logp"], t.get("is_weights"), t["loss_mask"]) if fill is None
                                  else fill.old(logp, t, mb.loss_mask))
            loss, stats = ppo_math.policy_loss(logp, old, t["advantages"], mask, p.clip_eps, p.loss_agg, weights)
            stats["entropy"] = ppo_math.masked_mean(entropy, mask)
            if "ref_logp" in t:  # KL to the reference as a loss term (k3)
                kl = ppo_math.aggregate_loss(ppo_math.kl_estimate(logp, t["ref_logp"], "k3"), mask, p.loss_agg)
                loss = loss + kl_coef * kl
                stats["kl_loss"] = kl.detach()
            if "on_policy" in t:  # the drift probe: first minibatch only
                stats["drift"] = drift_terms(logp, t["behaviour_logp"], t["on_policy"])
            stats["loss_mask"] = mask  # the tokens the loss ran on (`trainer/update.py` normalises over them)
            return loss, stats

        stats = self._optimise("actor", self.actor, self.actor_optim, batch, extra, loss_fn,
                               None if fill is None else fill.publish)
        if s.correction.masks:  # every row's kept tokens are final once the first minibatch published
            stats["mismatch_masked_frac"] = masked_fraction(trained, extra["loss_mask"])
        return stats

    def _minibatch_order(self, name: str, batch: TrainBatch) -> torch.Generator:
        """The generator that shuffles the next `train_<name>`'s minibatches of `batch` (seeded by the calls so far)."""
        s, minibatches = self.settings, self.settings.ppo.minibatches
        if batch.size % minibatches:
            raise TrainerConfigError(f"batch of {batch.size} rows does not split into ppo minibatches={minibatches}")
        return torch.Generator().manual_seed(s.seed * 1_000_003 + 2 * self.updates[name] + (name == "critic"))

    def _first_minibatch(self, batch: TrainBatch, where: str) -> torch.Tensor:
        """Rows of the next `train_actor`'s first minibatch, for `where` (leaving their old log-probs to it)."""
        if not self.settings.old_logp_from_first_forward:
            raise TrainerConfigError(f"{where}: old log-probs are read before the update here (ppo.old_logp=rollout "
                                     "or ppo.kl_in=reward): compute every row's")
        return batch.minibatches(self.settings.ppo.minibatches, self._minibatch_order("actor", batch))[0]

    def _optimise(
        self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch,
        extra: dict[str, torch.Tensor], loss_fn: LossFn, after_first: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """epochs x minibatches guarded optimizer steps (`trainer/update.py`); stats averaged over the steps taken."""
        s, p = self.settings, self.settings.ppo
        generator = self._minibatch_order(name, batch)
        self.updates[name] += 1
        u = Update(model, optimizer, self.dist, self._plan, p.epochs, p.minibatches, p.loss_agg, p.max_grad_norm,
                   p.value_coef if model is self.critic else 1.0)
        # training mode only where it changes something: transformers checkpoints layers only in
        # training mode, and LoRA dropout acts only there (the models carry no other dropout by default)
        training = p.gradient_checkpointing or (s.lora.dropout > 0 and is_lora(model))
        model.train(training)
        try:
            return optimise(u, batch, extra, loss_fn, generator, "policy_loss" if name == "actor" else "value_loss",
                            after_first)
        finally:
            model.eval()

    # ---------------------------------------------------------------- weights and state

    def actor_state_for_sync(self, everywhere: bool = False, adapted_only: bool = True) -> dict[str, torch.Tensor]:
        """Full HF-named actor state dict (float32, CPU) on rank 0 ({} on other ranks), or on
        every rank (``everywhere``: each rank's engine gets the weights). Collective.
        LoRA: the adapted linears' merged weights, with ``adapted_only`` nothing else (the
        rest is the frozen base, which an engine holds unless it served other weights).
        Full fine-tuning leaves a tied head out (`tied_copies`: the engine ties it itself)."""
        if self.settings.lora.on_actor:
            merged = {name: t.to("cpu", copy=True) for name, t in self.actor_tensors(adapted_only)}
            return merged if everywhere or self.dist.is_main else {}
        state = full_state_everywhere(self.actor) if everywhere else full_state_dict(self.actor)
        tied = self._tied()
        return {name: t for name, t in state.items() if name not in tied}

    def actor_tensors(self, adapted_only: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full HF-named tensors one at a time on the training device (CUDA: the
        device-to-device weight push); LoRA: the adapted linears' merged weights, and with
        ``adapted_only`` off the frozen base's other tensors too. Full fine-tuning leaves a tied
        head out (`tied_copies`; a PEFT model's names never match it). Lazy and collective:
        every rank iterates it to the end."""
        if self.settings.lora.on_actor:
            keep = adapted_weight if adapted_only else None
            return merged_weights(full_tensors(self.actor, keep=keep), self.settings.lora.scaling,
                                  others=not adapted_only)
        tied = self._tied()
        return full_tensors(self.actor, keep=lambda n: n not in tied)

    def _tied(self) -> frozenset[str]:
        if self._tied_names is None:
            self._tied_names = tied_copies(self.actor)
        return self._tied_names

    def state_dict(self) -> dict[str, Any]:
        """Actor, critic (when there is one) and their optimizers as full CPU state dicts on
        rank 0 (empty elsewhere). Collective.

        World-size independent: FQN keys, unsharded tensors. The reference model is not
        included: it is rebuilt from `actor_path`.
        """
        state = {"actor": full_training_state(self.actor, self.actor_optim), "updates": dict(self.updates)}
        if self.critic is not None:
            state["critic"] = full_training_state(self.critic, self.critic_optim)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state_dict()` output; only rank 0's copy is read, then broadcast and sharded. Collective."""
        load_training_state(self.actor, self.actor_optim, state.get("actor", {}), self.dist)
        if self.critic is not None:
            load_training_state(self.critic, self.critic_optim, state.get("critic", {}), self.dist)
        self.updates = dict(broadcast_object(state.get("updates"), self.dist))

    def offload(self, keep_actor: bool = False) -> bool:
        """CUDA: move actor, reference, critic and optimizer state to host memory and free the
        cache -> True (into reused pinned buffers unless ``host_offload="pageable"``).
        ``keep_actor``: everything but the actor's parameters (what the weight gather reads),
        so the engines' weights wake into the room the optimizer states and the other models
        leave; a later `offload()` moves the actor (what is on the host already stays).

        On CPU there is nothing to free: returns False and does nothing. Collective-free.
        """
        if self.dist.device.type != "cuda":
            return False
        models = tuple(m for m in self._models() if not (keep_actor and m is self.actor))
        if self.settings.host_offload == "pinned":
            self.stash.offload(models, self._optimizers())
        else:
            move_plainly(models, self._optimizers(), "cpu", self.dist.device)
        torch.cuda.empty_cache()
        return True

    def onload(self) -> bool:
        """CUDA: move everything `offload` moved back to this rank's GPU -> True. CPU: False, no-op."""
        if self.dist.device.type != "cuda":
            return False
        if self.settings.host_offload == "pinned":
            self.stash.onload(self._models(), self._optimizers(), self.dist.device)
        else:
            move_plainly(self._models(), self._optimizers(), self.dist.device, self.dist.device)
        return True

    def state_mb(self) -> float:
        """MiB of training state this rank holds (`trainer/state_size.state_mib`); unlike the
        process RSS it does not carry memory an earlier run in the same process freed."""
        return state_mib(self._models(), self._optimizers())

    def sync_numel(self, adapted_only: bool = True) -> int:
        """Elements a weight sync pushes (`actor_tensors`): the whole actor state, or under
        LoRA with ``adapted_only`` the adapted weights only; counted once (the loop asks every step)."""
        if self._sync_numel is None:
            self._sync_numel = sync_numels(self.actor, self.settings.lora.on_actor)
        return self._sync_numel[0 if adapted_only else 1]

    def saved_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Name -> global shape of the tensors `state_dict` saves, per model (`trainer/state_size.py`)."""
        return saved_shapes({"actor": self.actor, "critic": self.critic})

    def _models(self) -> tuple[nn.Module, ...]:
        return tuple(m for m in (self.actor, self.ref, self.critic) if m is not None)

    def _optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return tuple(o for o in (self.actor_optim, self.critic_optim) if o is not None)



def _trainable(model: nn.Module, settings: TrainerSettings, lora: bool) -> nn.Module:
    """A model to train, before sharding: gradient checkpointing when asked, then LoRA
    adapters when asked (the PEFT wrapper; base weights frozen)."""
    if settings.ppo.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return add_lora(model, settings.lora) if lora else model
