"""The trainer's two config sections, defined once: `PPOConfig` (``ppo:``) and `LoraConfig` (``lora:``).

Owns: their fields with the defaults users configure, and the rules on their values alone
(each section's ``__post_init__``: a `Literal` field one of its values, the bounds, the
mismatch correction's band), so a section is valid however it is made: loaded from YAML
and ``--set`` (``colocate.config``, which holds them as ``Config.ppo`` / ``Config.lora``
and turns the error into its one-line ``ConfigError``), replaced, or built by a test or
bench. Each failure is one `TrainerConfigError` line naming the field (``ppo.<name>``,
``lora.<name>``). The trainer takes both sections as they are (`TrainerSettings.ppo`,
`.lora`).

Also owns each mismatch correction's band (`band`: the method's default bounds, the rule
that a band holds 1), which the section checks and `trainer/mismatch.py` applies.

Leaves out: the rules that need other sections (``colocate.config_checks``) or the device
and dtype the trainer runs on (`trainer/settings.py`), what the values do. Imports no
torch: ``colocate.config`` imports this module at config load.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal

from .errors import TrainerConfigError

# the choices of the trainer's named methods, written once: the section's field types, and
# the trainer's own lists of them (`ppo_math`, `estimators`, `mismatch`: ``typing.get_args``)
KLKind = Literal["k1", "k2", "k3"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
Advantage = Literal["gae", "grpo", "rloo", "reinforce_baseline"]
CorrectionKind = Literal["none", "token_mis", "seq_mis", "icepop"]
# the correction's bands: method -> (default lower bound, None: 1 / upper; default upper bound)
_BANDS: dict[str, tuple[float | None, float]] = {"token_mis": (None, 2.0), "seq_mis": (None, 1.001),
                                                 "icepop": (0.5, 5.0)}


def band(kind: str, lower: float = 0.0, upper: float = 0.0) -> tuple[float, float]:
    """[lower, upper] of method `kind`, a 0 bound taking the method's default: upper 2
    (token_mis), 1.001 (seq_mis), 5 (icepop); lower 1 / upper (token_mis, seq_mis, as
    verl) or 0.5 (icepop's alpha). ValueError unless 0 < lower <= 1 <= upper (a band
    without 1 masks tokens on which trainer and engine agree)."""
    if kind not in _BANDS:
        methods = typing.get_args(CorrectionKind)[1:]
        raise ValueError(f"the correction must be one of {methods} to have a band, got {kind!r}")
    default_lower, default_upper = _BANDS[kind]
    if lower < 0 or upper < 0:
        raise ValueError(f"bounds must be >= 0 (0: the default), got lower {lower}, upper {upper}")
    hi = upper or default_upper
    lo = lower or (1.0 / hi if default_lower is None else default_lower)
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"{kind}'s band [{lo:g}, {hi:g}] must hold 1 (0 < lower <= 1 <= upper)")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """The PPO trainer's knobs and the loop's KL controller (``kl_kind``, ``kl_coef``,
    ``kl_target``, ``kl_horizon``: read by the loop, not the trainer)."""

    epochs: int = 2
    minibatches: int = 2
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    gamma: float = 1.0
    lam: float = 1.0  # 1: Monte-Carlo returns minus the critic's baseline (no bias from an untrained critic)
    actor_lr: float = 1e-5
    critic_lr: float = 3e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    kl_kind: Literal["fixed", "adaptive"] = "adaptive"
    kl_coef: float = 0.05
    kl_target: float = 6.0
    kl_horizon: int = 10000
    kl_estimator: KLKind = "k1"
    whiten_advantages: bool = True
    loss_agg: AggMode = "token-mean"
    value_coef: float = 1.0
    packing: bool = True  # padding-free packed rows in every trainer pass (false: right-padded rows)
    micro_batch_tokens: int = 0  # packed: tokens per micro-batch (0: auto: 8192 on CUDA, 1024 on the CPU)
    shared_prefix: bool = True  # packed: a group's rows with one prompt carry it once (not under flash-attention 2)
    old_logp: Literal["recompute", "rollout"] = "recompute"  # rollout: the engine's sampling log-probs
    # advantage estimator: gae (with a critic) or critic-free over rollout.group_size samples
    # per prompt: grpo, rloo, reinforce_baseline (no critic is built, trained or saved)
    advantage: Advantage = "gae"
    norm_adv_by_std: bool = True  # grpo: divide by the group's std (false: Dr. GRPO; verl's norm_adv_by_std_in_grpo)
    kl_in: Literal["reward", "loss"] = "reward"  # KL to the reference: per-token reward penalty | k3 loss term
    # recompute activations layer by layer in backward (verl's enable_gradient_checkpointing,
    # OpenRLHF's --gradient_checkpointing): less trainer memory for one more forward per pass
    gradient_checkpointing: bool = False
    # the trainer models' attention (transformers' attn_implementation; verl's override_config
    # attn_implementation): auto (on CUDA in half precision flash_attention_2 when installed,
    # else flex_attention; else sdpa), sdpa (per packed sequence), flex_attention (CUDA: one
    # BlockMask kernel per layer)
    attention: Literal["auto", "sdpa", "flex_attention", "flash_attention_2"] = "auto"
    # the train/inference mismatch correction (verl's algorithm.rollout_correction; docs/config.md):
    # none, or masked IS leaving tokens whose pi_old / pi_behaviour is outside a band out of the
    # loss: token_mis (per token, [1/2, 2]), seq_mis (a sequence whole on its geometric-mean
    # ratio, [1/1.001, 1.001]), icepop (per token, [0.5, 5]); a bound of 0 keeps the method's
    rollout_correction: CorrectionKind = "none"
    rollout_correction_lower: float = 0.0  # 0: 1 / upper (token_mis, seq_mis), 0.5 (icepop)
    rollout_correction_upper: float = 0.0  # 0: 2 (token_mis), 1.001 (seq_mis), 5 (icepop)

    def __post_init__(self) -> None:
        _check(self, "ppo", [
            (self.epochs >= 1, "ppo.epochs must be >= 1"),
            (self.minibatches >= 1, "ppo.minibatches must be >= 1"),
            (self.micro_batch_tokens >= 0, "ppo.micro_batch_tokens must be >= 0 (0: auto)"),
            (self.clip_eps > 0, "ppo.clip_eps must be > 0 (the policy ratio is clipped to 1 ± clip_eps; PPO's 0.2)"),
            (self.value_clip_eps > 0, "ppo.value_clip_eps must be > 0 (values are clipped to within it of the "
                                      "values before training; a large one leaves them unclipped)"),
            (0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "ppo.gamma and ppo.lam must be in [0, 1]"),
            (self.actor_lr >= 0 and self.critic_lr >= 0, "ppo.actor_lr and ppo.critic_lr must be >= 0 (0: frozen)"),
            (self.weight_decay >= 0, "ppo.weight_decay must be >= 0"),
            (self.max_grad_norm > 0, "ppo.max_grad_norm must be > 0 (the gradient-norm clip)"),
            (self.value_coef >= 0, "ppo.value_coef must be >= 0 (it multiplies the critic's loss)"),
            (self.kl_coef > 0 or (self.kl_kind == "fixed" and self.kl_coef == 0),
             "ppo.kl_coef must be > 0 (or 0 with ppo.kl_kind=fixed: no KL penalty)"),
            (self.kl_target > 0, "ppo.kl_target must be > 0"),
            (self.kl_horizon > 0, "ppo.kl_horizon must be > 0"),
        ])
        if self.rollout_correction != "none":
            try:
                band(self.rollout_correction, self.rollout_correction_lower, self.rollout_correction_upper)
            except ValueError as e:
                raise TrainerConfigError(f"ppo.rollout_correction_lower/upper (ppo.rollout_correction="
                                         f"{self.rollout_correction}): {e}; 0 keeps the method's bound") from None


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (PEFT) on the actor and/or the critic; rank 0: full fine-tuning. The
    engine serves the merged weights; only the adapted linears are pushed at each sync."""

    rank: int = 0  # OpenRLHF/verl lora_rank (e.g. 16 or 32); 0: off
    alpha: float = 16.0  # lora_alpha: updates scaled by alpha / rank
    dropout: float = 0.0  # lora_dropout (training passes only)
    target_modules: str = "all-linear"  # every linear but the LM head, or a comma list: q_proj,v_proj
    actor: bool = True  # adapters on the actor; its reference is the actor with them disabled
    critic: bool = True  # adapters on the critic's backbone; its value head trains in full

    def __post_init__(self) -> None:
        _check(self, "lora", [
            (self.rank >= 0, "lora.rank must be >= 0 (0: full fine-tuning)"),
            (self.alpha > 0, "lora.alpha must be > 0 (the update is scaled by alpha / rank)"),
            (0 <= self.dropout < 1, "lora.dropout must be in [0, 1)"),
            (bool(self.target_modules.strip()),
             "lora.target_modules must not be empty (all-linear, or a comma list like q_proj,v_proj)"),
        ])

    @property
    def on_actor(self) -> bool:
        return self.rank > 0 and self.actor

    @property
    def on_critic(self) -> bool:
        return self.rank > 0 and self.critic

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _check(section: Any, name: str, rules: list[tuple[bool, str]]) -> None:
    """The first failure of ``section`` as one `TrainerConfigError` line: a `Literal`
    field's value outside its choices (the message ``colocate.overrides`` gives a loaded
    one), then ``rules`` ((ok, message), in order)."""
    for field, choices in _choices(type(section)).items():
        value = getattr(section, field)
        if value not in choices:
            raise TrainerConfigError(f"{name}.{field}: {value!r} is not one of {list(choices)}")
    for ok, message in rules:
        if not ok:
            raise TrainerConfigError(message)


@functools.cache
def _choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """Field -> its values, for every `Literal` field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}
