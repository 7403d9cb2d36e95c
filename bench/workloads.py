"""Benchmark workloads and presets: what is generated, by which models, how long.

Owns: the named workloads a user recognises — ``short`` (uniform short responses),
``longtail`` (lognormal per-request budgets: a few responses much longer than the rest),
``pareto`` (heavier tail), ``longtail-grpo`` (``longtail`` trained with GRPO, groups of 4, KL in the
loss: the critic-free path and TRL's GRPOTrainer as its peer), ``task`` (the default task's
real prompts, EOS decides),
``reasoning`` (reasoning-gym questions, EOS decides, a long cap: the real long tail),
``tools`` (the same questions as multi-turn trajectories with the calculator environment;
on the bench's random-weight models, which never write a tool call, the scripted
environment instead, so the turns' mechanics are what is timed) — as
config overrides, the rule reward a workload adds to the reward model's score, and the
``quick`` / ``full`` / ``gpu`` presets (models, batch, steps, repeats, extra overrides; ``gpu``:
Qwen2.5-0.5B-shaped random actor and reward model, batch 64, budgets up to 1,024 tokens,
sized for one lent GPU, scripts/gpu_bench.sh).
Leaves out: running them (``bench.runner``), the bench's own models (``bench.models``).
"""

from __future__ import annotations

import dataclasses

from colocate.bench.models import eos_prone_actor, small_models

WORKLOADS: dict[str, list[str]] = {
    "short": ["rollout.length_dist=fixed", "rollout.ignore_eos=true"],
    "longtail": ["rollout.length_dist=lognormal", "rollout.length_sigma=1.0", "rollout.ignore_eos=true"],
    "longtail-grpo": ["rollout.length_dist=lognormal", "rollout.length_sigma=1.0", "rollout.ignore_eos=true",
                      "ppo.advantage=grpo", "rollout.group_size=4", "ppo.kl_in=loss"],
    "pareto": ["rollout.length_dist=pareto", "rollout.pareto_alpha=1.2", "rollout.ignore_eos=true"],
    "task": ["rollout.length_dist=fixed", "rollout.ignore_eos=false"],
    # + data.source=reasoning-gym:<preset's task>; reward = reward model + the task's scorer
    "reasoning": ["rollout.length_dist=fixed", "rollout.ignore_eos=false", "data.max_prompt_tokens=1024"],
    # reasoning's questions as multi-turn trajectories: the model may call the calculator
    "tools": ["rollout.length_dist=fixed", "rollout.ignore_eos=false", "data.max_prompt_tokens=1024",
              "rollout.env=calculator", "rollout.max_turns=4"],
}
MULTI_TURN = ("tools",)
MODES = ("sequential", "intra", "inter", "oppo")
PAUSE_MODES = ("abort", "in_place", "retract")  # a bench mode may name one: inter/in_place, oppo/retract


def mode_spec(mode: str) -> tuple[str, str | None]:
    """``MODE`` or ``MODE/PAUSE`` (overlap.mode, overlap.pause_mode or None: the config's)."""
    base, _, pause = mode.partition("/")
    return base, pause or None


def valid_mode(mode: str) -> bool:
    base, pause = mode_spec(mode)
    return base in (*MODES, "auto") and (pause is None or (pause in PAUSE_MODES and base in ("inter", "oppo", "auto")))
REASONING_TASK = "gsm_symbolic"


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    workloads: tuple[str, ...]
    repeats: int
    steps: int  # measured steps per (mode, repeat), after one warm-up step
    batch_size: int
    max_new_tokens: int
    # "small": built by the bench (random weights); "default": SmolLM2 + sentiment RM; a
    # MODEL_SHAPES name (e.g. "qwen2.5-0.5b"): random actor and reward model of that shape
    models: str
    peer_updates: int  # measured TRL updates (0: no peer); the bench times repeats x steps of them, >= 4
    reasoning_tokens: int = 256  # the reasoning workload's cap (EOS decides below it)
    reasoning_task: str = REASONING_TASK  # a reasoning-gym dataset name
    overrides: tuple[str, ...] = ()  # config overrides of every workload (trainer switches, e.g. ppo.*)
    peer_min_updates: int = 4  # the TRL peer's measured updates are at least this many (bench.suite.peer_rounds)
    note: str = ""  # a line of the report's header (what the preset's comparison is, and is not)

    def short_tokens(self) -> int:
        return max(4, self.max_new_tokens // 4)

    def tokens(self, workload: str) -> int:
        """``rollout.max_new_tokens`` of ``workload`` (also the TRL peer's response length)."""
        if workload == "short":
            return self.short_tokens()
        return self.reasoning_tokens if workload in ("reasoning", "tools") else self.max_new_tokens

    def source(self, workload: str) -> str:
        """``data.source`` of ``workload`` (also the TRL peer's prompts)."""
        return f"reasoning-gym:{self.reasoning_task}" if workload in ("reasoning", "tools") else "sentiment-prompts"


# Repeats: a ratio's min–max is over repeats, and the range of n draws covers on average
# (n-1)/(n+1) of their distribution: 50 % at 3, 67 % at 5. quick is cheap, so 5 repeats x
# 2 steps; full keeps 3 x 4 (a SmolLM2 step is minutes on 2 cores) and relies on the
# contention guard to keep a busy neighbour out of the medians.
PRESETS = {
    "quick": Preset("quick", ("short", "longtail", "reasoning"), repeats=5, steps=2, batch_size=8,
                    max_new_tokens=64, models="small", peer_updates=2, reasoning_tokens=128),
    "full": Preset("full", ("short", "longtail", "task", "reasoning"), repeats=3, steps=4, batch_size=16,
                   max_new_tokens=128, models="default", peer_updates=3, reasoning_tokens=256),
    # one lent GPU, one device call of ~8 minutes (scripts/gpu_bench.sh, issue 53): GRPO first,
    # then PPO; 1 repeat x 2 steps (the script's deadline drops modes, not the report, when
    # short), 2 TRL updates (HF generate of 64 x 1,024 tokens is ~25 s each). The engines'
    # threads are fixed so every mode shares one session (on CUDA threads do not matter; two
    # sessions would hold four engines), their static memory at 0.2 of the card each.
    "gpu": Preset("gpu", ("longtail-grpo", "longtail"), repeats=1, steps=2, batch_size=64, max_new_tokens=1024,
                  models="qwen2.5-0.5b", peer_updates=2, peer_min_updates=2,
                  # chunks of 256 tokens (the bench's 16 elsewhere): on an H100 (2026-11-28) chunks of 16 sent
                  # ~1,500 scoring requests a step for 64 samples, each an eager prefill of ~6-7 ms on the
                  # reward engine, whose scoring then ended 5-7.5 s after generation (one-shot: 0.4 s)
                  overrides=("engines.actor_threads=1", "engines.reward_threads=1",
                             "engines.mem_fraction_static=0.2", "overlap.chunk_size=256"),
                  note=("Random weights never choose EOS: colocate's budgets are lognormal (median cap/4, capped at "
                        "the cap, `ignore_eos`), while the TRL peer generates every response to the cap; compare "
                        "the peer in response tokens/s (samples/s favours colocate). The TRL peers generate with "
                        "HF `generate`, no vLLM (`use_vllm=False`; vLLM cannot be carried to the GPU machine).")),
}


def workload_overrides(preset: Preset, workload: str) -> list[str]:
    """Config overrides of one workload under ``preset`` (the preset's own overrides last)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload '{workload}'; choose from {sorted(WORKLOADS)}")
    scripted = ["rollout.env=scripted"] if workload in MULTI_TURN and preset.models == "small" else []
    return [*WORKLOADS[workload], *scripted, f"data.source={preset.source(workload)}",
            f"rollout.batch_size={preset.batch_size}", f"rollout.max_new_tokens={preset.tokens(workload)}",
            "ppo.minibatches=2", *preset.overrides]


def workload_reward_fns(cfg) -> list:  # noqa: ANN001 - colocate.config.Config
    """Rule rewards added to the reward model's score: a reasoning-gym source's own scorer
    (1 for a correct answer), so every mode, streamed ones included, scores RM + rule."""
    from colocate.assets.tasks import REASONING_GYM_PREFIX, reasoning_gym_reward

    if cfg.reward.kind == "model" and cfg.data.source.startswith(REASONING_GYM_PREFIX):
        return [reasoning_gym_reward(cfg.data.source.removeprefix(REASONING_GYM_PREFIX))]
    return []


def workload_models(preset: Preset, workload: str, actor: str, rm: str) -> tuple[str, str]:
    """The (actor, reward) folders of ``workload``: the preset's, except that ``reasoning``
    on the small random models gets an actor that ends at EOS after ~cap/4 tokens (a random
    model almost never picks EOS, so every response would run to the cap)."""
    if workload in ("reasoning", *MULTI_TURN) and preset.models == "small":
        from pathlib import Path

        return eos_prone_actor(actor, Path(actor).parent, mean_tokens=preset.reasoning_tokens // 4), rm
    return actor, rm


__all__ = ["MODES", "MULTI_TURN", "PAUSE_MODES", "PRESETS", "mode_spec", "valid_mode", "Preset", "WORKLOADS", "small_models", "workload_models", "workload_overrides",
           "workload_reward_fns"]
