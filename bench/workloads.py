"""Benchmark workloads and presets: what is generated, by which models, how long.

Owns: the named workloads a user recognises — ``short`` (uniform short responses),
``longtail`` (lognormal per-request budgets: a few responses much longer than the rest),
``pareto`` (heavier tail), ``task`` (the default task's real prompts, EOS decides) — as
config overrides, and the ``quick`` / ``full`` presets (models, batch, steps, repeats).
Leaves out: running them (``bench.runner``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

WORKLOADS: dict[str, list[str]] = {
    "short": ["rollout.length_dist=fixed", "rollout.ignore_eos=true"],
    "longtail": ["rollout.length_dist=lognormal", "rollout.length_sigma=1.0", "rollout.ignore_eos=true"],
    "pareto": ["rollout.length_dist=pareto", "rollout.pareto_alpha=1.2", "rollout.ignore_eos=true"],
    "task": ["rollout.length_dist=fixed", "rollout.ignore_eos=false"],
}
MODES = ("sequential", "intra", "inter", "oppo")


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    workloads: tuple[str, ...]
    repeats: int
    steps: int  # measured steps per (mode, repeat), after one warm-up step
    batch_size: int
    max_new_tokens: int
    models: str  # "small": built by the bench (random weights); "default": SmolLM2 + sentiment RM
    peer_updates: int  # TRL PPO updates (0: no peer)

    def short_tokens(self) -> int:
        return max(4, self.max_new_tokens // 4)


PRESETS = {
    "quick": Preset("quick", ("short", "longtail"), repeats=3, steps=2, batch_size=8,
                    max_new_tokens=64, models="small", peer_updates=2),
    "full": Preset("full", ("short", "longtail", "task"), repeats=3, steps=4, batch_size=16,
                   max_new_tokens=128, models="default", peer_updates=3),
}


def workload_overrides(preset: Preset, workload: str) -> list[str]:
    """Config overrides of one workload under ``preset``."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload '{workload}'; choose from {sorted(WORKLOADS)}")
    tokens = preset.short_tokens() if workload == "short" else preset.max_new_tokens
    return [*WORKLOADS[workload], f"rollout.batch_size={preset.batch_size}",
            f"rollout.max_new_tokens={tokens}", "ppo.minibatches=2"]


def small_models(root: Path) -> tuple[str, str]:
    """A small random Llama actor and reward model (SmolLM2-like width, few layers):
    throughput mechanics without the cost of real weights. Built once per folder."""
    from colocate.models import build_tiny_causal_lm, build_tiny_reward_model

    actor, rm = root / "small-actor", root / "small-rm"
    if not (actor / "config.json").is_file():
        build_tiny_causal_lm(actor, seed=0, hidden=256, layers=4, heads=8, kv_heads=4, max_positions=2048)
    if not (rm / "config.json").is_file():
        build_tiny_reward_model(rm, seed=1, hidden=256, layers=4, heads=8, kv_heads=4, max_positions=2048)
    return str(actor), str(rm)
