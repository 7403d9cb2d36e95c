"""`TrainerSettings`: what the PPO trainer runs with, frozen and checked at construction.

Owns: the settings dataclass: the ``ppo`` and ``lora`` config sections as they are
(`trainer/sections.py`, which checks their values), the values that come from elsewhere
(model folders, device and dtype resolved, seed, the staleness correction of deferred
tokens, the sampling temperature, offload, whether a reference runs, padded rows per
pass), their validation together with the device and dtype (one `TrainerConfigError`
line) and the derived values (`critic_source`, `torch_dtype`, `attn_implementation`,
`token_budget`, ...). Bare settings train as a default configured run does
(`tests/unit/test_one_set_of_defaults.py`).

Leaves out: what the knobs do (`trainer/ppo_trainer.py`, `trainer/forward.py`,
`trainer/packing.py`) and how a run's config maps onto them (`colocate/run/builder.py`).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from .errors import TrainerConfigError
from .estimators import CRITIC_FREE
from .mismatch import Correction
from .sections import LoraConfig, PPOConfig
from .varlen_attention import VARLEN_SDPA


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    actor_path: str
    critic_path: str | None = None  # None: the critic's backbone is the actor's
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay float32
    device: str = "cpu"
    seed: int = 0
    ppo: PPOConfig = PPOConfig()  # the `ppo:` section (its kl_* controller fields are the loop's)
    lora: LoraConfig = LoraConfig()  # the `lora:` section; rank 0: full fine-tuning (`trainer/lora.py`)
    is_cap: float | None = None  # truncated-IS cap for tokens sampled under other weights
    max_staleness: int | None = None  # train only on tokens at most this many versions old
    temperature: float = 1.0  # sampling temperature the behaviour logprobs were taken at
    micro_batch: int = 8  # ppo.packing=False: rows per forward pass (bounds activation memory)
    host_offload: str = "pinned"  # CUDA offload target: reused page-locked buffers, or "pageable" (module.to)
    trust_remote_code: bool = False  # let transformers run code the model folders ship
    # build and run the reference (False: nothing reads it — the KL is off, a fixed
    # coefficient of 0 — so it is neither built, held nor run, and the loop reports no kl)
    reference: bool = True

    def __post_init__(self) -> None:
        checks = {
            "dtype": self.dtype in ("float32", "bfloat16", "float16"),
            "micro_batch": self.micro_batch >= 1,
            "host_offload": self.host_offload in ("pinned", "pageable"),
            "temperature": self.temperature > 0,
            "is_cap": self.is_cap is None or self.is_cap > 0,
            "max_staleness": self.max_staleness is None or self.max_staleness >= 0,
        }
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise TrainerConfigError(f"invalid trainer setting(s) {bad}: {[getattr(self, k) for k in bad]}")
        attention = self.ppo.attention
        if attention == "flex_attention" and not self.device.startswith("cuda"):
            raise TrainerConfigError("ppo.attention=flex_attention needs CUDA (torch's flex attention has no CPU "
                                     "backward): use auto or sdpa on this device")
        if attention == "flex_attention" and self.dtype == "float32":
            # torch 2.11's inductor found no flex kernel for float32 fwd + bwd on an H100
            # (NoValidChoicesError at head dims 16 and 64, 2026-11-26); bfloat16 compiled and ran
            raise TrainerConfigError("ppo.attention=flex_attention needs half-precision compute (torch's inductor "
                                     "has no float32 flex kernel on CUDA): set models.dtype=bfloat16 or use sdpa")
        if attention == "flash_attention_2" and not flash_attn_2_available():
            raise TrainerConfigError("ppo.attention=flash_attention_2, but flash-attention 2 is not installed "
                                     "(pip install flash-attn): use auto, sdpa or flex_attention")

    @property
    def correction(self) -> Correction:
        """The importance weights and masks of the actor's loss (`trainer/mismatch.py`):
        the mismatch correction and the TIS cap of deferred tokens."""
        p = self.ppo
        return Correction(p.rollout_correction, p.rollout_correction_lower, p.rollout_correction_upper, self.is_cap)

    @property
    def critic_free(self) -> bool:
        """No critic: the estimator's baseline comes from the group, not from values."""
        return self.ppo.advantage in CRITIC_FREE

    @property
    def critic_source(self) -> str:
        return self.critic_path or self.actor_path

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def attn_implementation(self) -> str | None:
        """transformers' attention for the trainer's models. Padded: None, transformers'
        default (sdpa), unless `ppo.attention` names one. Packed, "auto":
        on CUDA in half precision, flash-attention 2 (varlen kernels) when it is installed
        (`flash_attn_2_available`), else flex attention (one BlockMask kernel per layer,
        shared prefixes kept); otherwise `VARLEN_SDPA` (causal sdpa per packed sequence,
        `trainer/varlen_attention.py`; sdpa over the whole row with transformers'
        block-diagonal mask does ~N^2 work per row of N tokens: 4-7x more on our CPU at
        1200-4000 tokens, and flex attention has no CPU backward in torch 2.14, nor a
        float32 CUDA kernel in torch 2.11's inductor). "sdpa" is
        `VARLEN_SDPA` when packed; "flex_attention" runs each packed row as one flex kernel
        per layer over a BlockMask of its sequences (`trainer/packed.py`, CUDA)."""
        attention, packing = self.ppo.attention, self.ppo.packing
        if attention == "sdpa" or (attention == "auto" and not packing):
            return VARLEN_SDPA if packing else None
        if attention != "auto":
            return attention
        if not self.device.startswith("cuda") or self.dtype == "float32":
            return VARLEN_SDPA
        return "flash_attention_2" if flash_attn_2_available() else "flex_attention"

    @property
    def shares_prefix(self) -> bool:
        """Whether packed rows share their group's prompt: `ppo.shared_prefix` with packing, and
        not under flash-attention 2 (its varlen kernel is causal per sequence; the shared
        mask needs sdpa's mask or flex attention's BlockMask)."""
        return self.ppo.packing and self.ppo.shared_prefix and self.attn_implementation != "flash_attention_2"

    @property
    def old_logp_from_first_forward(self) -> bool:
        """Whether the actor's first minibatch may take its old log-probs from its own first
        forward instead of a no-grad pass: its weights are still the pass's, so the pass
        would compute the same numbers (TRL's and verl's on-policy shortcut, for the first
        of any number of minibatches). Only where nothing reads them before the update:
        recomputed old log-probs and no KL in the reward (truncated-IS weights of those
        rows are taken from the same forward)."""
        return self.ppo.old_logp == "recompute" and not (self.reference and self.ppo.kl_in == "reward")

    @property
    def token_budget(self) -> int:
        """Tokens per packed micro-batch: `ppo.micro_batch_tokens`, or with 0 (auto) 8192 on CUDA
        and 1024 on the CPU. On our CPU (SmolLM2 shape, 2 threads, fwd + bwd of packed
        300-token sequences) the varlen sdpa path ran 149 tokens/s at 1200 tokens per
        micro-batch and 115 at 2400; on an H100 (Qwen2.5-0.5B shape, bf16, GRPO n = 4) its
        ref + old logp + actor took 9.9 s at 8192 against 31.8 s at 1024 (docs/bench.md)."""
        if self.ppo.micro_batch_tokens:
            return self.ppo.micro_batch_tokens
        return 8192 if self.device.startswith("cuda") else 1024


def flash_attn_2_available() -> bool:
    """Whether transformers will run ``attn_implementation="flash_attention_2"`` from an
    installed package: flash-attention 2's ``flash_attn.flash_attn_interface`` must import
    and transformers must accept it (``is_flash_attn_2_available``: the ``flash-attn``
    distribution, >= 2.3.3, CUDA). ``find_spec("flash_attn")`` alone is not enough: the
    flash-attn-4 wheel SGLang brings ships only ``flash_attn/cute/`` (a namespace package),
    which transformers does not count as FA2; it then fetches a kernel from the Hub
    instead, and offline the trainer fails to build."""
    try:
        if importlib.util.find_spec("flash_attn.flash_attn_interface") is None:
            return False
    except (ImportError, ValueError):  # a broken install (e.g. a CUDA extension of another torch)
        return False
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())
