"""The checks of a whole config: values valid on their own and together.

Owns: :func:`validate` (run by ``colocate.config.load_config``, so also by
``--print-config``; call it again after ``dataclasses.replace``): each failure one
:class:`~colocate.errors.ConfigError` line naming the fields and the fix; :data:`RULES`,
the names ``reward.rule`` takes. Leaves out: the fields and their defaults
(``colocate.config``), the ``ppo`` and ``lora`` sections' rules on their own values (each
section checks itself as it is built: ``colocate.trainer.sections``), what needs a model
or an engine to check (the run's start: ``colocate.run.builder``, ``engine.start_checks``).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from colocate.engine.start_checks import check_server_arg_values
from colocate.engine.errors import EngineConfigError
from colocate.errors import ConfigError, in_config_terms
from colocate.faults import parse
from colocate.modes import MODES
from colocate.overrides import names

RULES = ("vader", "reasoning-gym", "math")  # reward.rule's names (colocate.rollout.named_rewards)


def validate(cfg: Any) -> None:  # a colocate.config.Config
    """Cross-field checks with one-line messages."""
    checks = [
        (cfg.rollout.batch_size >= 1, "rollout.batch_size must be >= 1"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.rollout.batch_size % cfg.ppo.minibatches == 0,
         f"rollout.batch_size {cfg.rollout.batch_size} must be divisible by ppo.minibatches {cfg.ppo.minibatches}"),
        (cfg.run.steps >= 0, "run.steps must be >= 0"),
        (cfg.run.save_every >= 0 and cfg.run.keep_checkpoints >= 0,
         "run.save_every and run.keep_checkpoints must be >= 0 (0: no periodic checkpoint; keep them all)"),
        (cfg.run.train_threads >= 0, "run.train_threads must be >= 0 (0: torch's default)"),
        (cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens must be >= 1"),
        (cfg.rollout.length_median >= 0 and cfg.rollout.length_sigma > 0 and cfg.rollout.pareto_alpha > 0,
         "rollout.length_median must be >= 0 (0: max_new_tokens // 4), rollout.length_sigma and "
         "rollout.pareto_alpha > 0"),
        (cfg.engines.actor_max_total_tokens >= 1 and cfg.engines.reward_max_total_tokens >= 1,
         "engines.actor_max_total_tokens and engines.reward_max_total_tokens must be >= 1 (tokens in each KV pool)"),
        (cfg.engines.sync_bucket_mb >= 1, "engines.sync_bucket_mb must be >= 1"),
        (cfg.engines.actor_threads >= 0 and cfg.engines.reward_threads >= 0,
         "engines.actor_threads and engines.reward_threads must be >= 0 (0: auto)"),
        (cfg.overlap.feeder_timeout_s > 0, "overlap.feeder_timeout_s must be > 0"),
        (cfg.overlap.is_cap > 0 and cfg.overlap.max_staleness >= 0,
         "overlap.is_cap must be > 0 and overlap.max_staleness >= 0"),
        (0 <= cfg.run.seed < 2**32 and 0 <= cfg.data.seed < 2**32,
         "run.seed and data.seed must be in [0, 2**32) (the range SGLang's and numpy's seeds take)"),
        (cfg.run.dist_timeout_minutes > 0, "run.dist_timeout_minutes must be > 0"),
        (cfg.run.log_samples >= -1, "run.log_samples must be >= -1 (-1: every sample, 0: none)"),
        (cfg.run.eval_every >= 0 and cfg.data.eval_prompts >= 0,
         "run.eval_every and data.eval_prompts must be >= 0 (0: no evaluation)"),
        (cfg.rollout.temperature >= 0, "rollout.temperature must be >= 0 (0: greedy rollouts)"),
        (0 < cfg.rollout.top_p <= 1, f"rollout.top_p: {cfg.rollout.top_p} must be in (0, 1] (1: no nucleus cut)"),
        (cfg.engines.stall_timeout_s >= 0,
         f"engines.stall_timeout_s: {cfg.engines.stall_timeout_s} must be >= 0 (seconds an engine may send nothing "
         "back with requests in flight; 0: wait forever)"),
        (0 < cfg.engines.mem_fraction_static < 1,
         f"engines.mem_fraction_static: {cfg.engines.mem_fraction_static} must be in (0, 1) (the share of GPU "
         "memory the engines take for weights and KV pool)"),
        (cfg.rollout.max_turns >= 1, "rollout.max_turns must be >= 1"),
        (cfg.rollout.turn_tokens >= 0, "rollout.turn_tokens must be >= 0 (0: no per-turn cap)"),
        (cfg.rollout.env_timeout_s > 0, "rollout.env_timeout_s must be > 0"),
        (0 <= cfg.reward.fn_timeout_s < math.inf, "reward.fn_timeout_s must be >= 0 and finite (0: no deadline)"),
        (cfg.reward.kind != "rule" or cfg.reward.rules or cfg.reward.fn_names,
         f"reward.kind=rule (no reward model) needs reward.rule (a comma list of {', '.join(RULES)}) "
         "or reward.fns (package.module:fn)"),
        (cfg.overlap.mode != "auto" or (cfg.overlap.modes and set(cfg.overlap.modes) <= set(MODES)),
         f"overlap.auto_modes: {cfg.overlap.auto_modes!r} must be a comma list of {', '.join(MODES)}"),
        (cfg.overlap.auto_trials >= 1 and cfg.overlap.auto_explore_every >= 1 and 0 <= cfg.overlap.auto_margin < 1,
         "overlap: need auto_trials >= 1, auto_explore_every >= 1 and 0 <= auto_margin < 1"),
        (not cfg.overlap.streamed or cfg.reward.kind == "model",
         f"overlap.mode={cfg.overlap.mode} streams tokens to the reward model as they are generated; "
         + ("with reward.kind=rule set overlap.auto_modes=sequential,inter" if cfg.overlap.mode == "auto"
            else "with reward.kind=rule use overlap.mode=inter (or sequential)")),
        (cfg.overlap.chunk_size >= 0 and all(c > 0 for c in _safe_candidates(cfg.overlap.chunk_candidates)),
         "overlap.chunk_size must be >= 0 and overlap.chunk_candidates positive integers like 16,32,64"),
        (cfg.overlap.retune_every >= len(_safe_candidates(cfg.overlap.chunk_candidates)),
         f"overlap.retune_every: {cfg.overlap.retune_every} is less than the "
         f"{len(_safe_candidates(cfg.overlap.chunk_candidates))} candidates a tuning round tries"),
        (cfg.overlap.delta_min >= 0, f"overlap.delta_min: {cfg.overlap.delta_min} must be >= 0"),
        (cfg.overlap.delta_max >= cfg.overlap.delta_min,
         f"overlap.delta_max: {cfg.overlap.delta_max} must be >= delta_min {cfg.overlap.delta_min}"),
        (cfg.overlap.delta_min <= cfg.overlap.delta_init <= cfg.overlap.delta_max,
         f"overlap.delta_init: {cfg.overlap.delta_init} must lie in [delta_min, delta_max] = "
         f"[{cfg.overlap.delta_min}, {cfg.overlap.delta_max}]"),
        (cfg.overlap.window >= 2, f"overlap.window: {cfg.overlap.window} must be >= 2 (a slope needs two points)"),
        (cfg.overlap.drop_staleness >= 0, f"overlap.drop_staleness: {cfg.overlap.drop_staleness} must be >= 0"),
        (cfg.rollout.group_size >= 1, "rollout.group_size must be >= 1"),
        (cfg.rollout.group_size >= 1 and cfg.rollout.batch_size % cfg.rollout.group_size == 0,
         f"rollout.batch_size {cfg.rollout.batch_size} must be a multiple of rollout.group_size "
         f"{cfg.rollout.group_size} (it counts trained samples: batch_size / group_size groups)"),
        (cfg.ppo.advantage not in ("grpo", "rloo") or cfg.rollout.group_size > 1,
         f"ppo.advantage={cfg.ppo.advantage} needs rollout.group_size >= 2 (its baseline is the other "
         "samples of the same prompt)"),
        (not _identical_members(cfg),
         f"rollout.temperature=0 (greedy) makes the rollout.group_size={cfg.rollout.group_size} samples of a prompt "
         f"one and the same response, and ppo.advantage={cfg.ppo.advantage} compares them: every advantage would be 0 "
         "and nothing learned; set rollout.temperature > 0 (1.0 samples the policy as it is)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_data(cfg.data)
    _check_rules(cfg.reward)
    # engines.sglang without SGLang: none colocate sets itself, no mapping values (names and
    # types are checked against SGLang's ServerArgs when an engine starts)
    check_own_server_args(cfg.engines.sglang)
    if cfg.run.fault_at:
        parse(cfg.run.fault_at)  # one line naming run.fault_at


def _identical_members(cfg) -> bool:
    """Whether a critic-free estimator (its baseline: the group's other members) gets groups of
    identical samples: greedy decoding of one prompt, every member with the same token budget."""
    return (cfg.ppo.advantage in ("grpo", "rloo", "reinforce_baseline") and cfg.rollout.group_size > 1
            and cfg.rollout.temperature == 0 and cfg.rollout.length_dist == "fixed")


def _check_data(data: Any) -> None:  # a colocate.config.DataConfig
    """The dataset fields: set, and only for a dataset source (the built-in ones have no columns)."""
    for name in ("source", "split", "prompt_key"):
        if not getattr(data, name).strip():
            raise ConfigError(f"data.{name} must not be empty (default: {getattr(type(data), name)!r})")
    if data.source == "sentiment-prompts" or data.source.startswith("reasoning-gym:"):
        for name in ("split", "prompt_key", "answer_key"):
            if getattr(data, name) != getattr(type(data), name):
                raise ConfigError(f"data.{name} applies to a dataset (hf:<name>, a folder or a .jsonl/.json/.parquet/"
                                  f".csv file), not to data.source={data.source}; leave it unset")


def _check_rules(reward: Any) -> None:  # a colocate.config.RewardConfig
    """``reward.rule``: known names, each once."""
    for i, name in enumerate(reward.rules):
        close = difflib.get_close_matches(name, RULES, n=1)
        if name not in RULES:
            raise ConfigError(f"reward.rule: unknown rule {name!r}; {f'did you mean {close[0]!r}? ' if close else ''}"
                              f"the rules: {', '.join(RULES)} (a comma list; their scores are summed)")
        if name in reward.rules[:i]:
            raise ConfigError(f"reward.rule: {name!r} is named twice")


def _safe_candidates(text: str) -> list[int]:
    try:
        return [int(x) for x in names(text)] or [0]
    except ValueError:
        return [0]


_ITSELF = "colocate sets it itself"
_SLEEP = f"{_ITSELF} (the engines sleep while the trainer trains)"
# SGLang arguments colocate decides (engine.start_checks.ENGINE_SET_ARGS) -> what to set instead
OWN_SERVER_ARGS = {
    "model_path": "colocate sets it from models.actor / models.reward",
    "device": "set engines.device instead",
    "dtype": "colocate sets it from engines.dtype",
    "random_seed": "colocate sets it from run.seed",
    "log_level": "set engines.log_level instead",
    "trust_remote_code": "set models.trust_remote_code instead",
    "tp_size": "set engines.tp_size instead",
    "mem_fraction_static": "set engines.mem_fraction_static instead",
    "max_total_tokens": "set engines.actor_max_total_tokens / engines.reward_max_total_tokens instead",
    "attention_backend": "set engines.attention_backend instead",
    "disable_cuda_graph": "set engines.cuda_graph instead",
    "disable_overlap_schedule": "colocate sets it from overlap.pause_mode (in_place: off)",
    "context_length": f"{_ITSELF} (the model's own, which the start-up checks count on)",
    "base_gpu_id": f"{_ITSELF} (each rank's own GPU)",
    "nccl_port": f"{_ITSELF} (a port of its own per engine of a node)",
    "enable_memory_saver": _SLEEP,
    "enable_weights_cpu_backup": _SLEEP,
    "enable_metrics": f"{_ITSELF} (SGLang's metrics are process-wide: one engine per process)",
    "custom_sigquit_handler": f"{_ITSELF} (a failed child is one line, not the end of this process)",
    **dict.fromkeys(("skip_tokenizer_init", "is_embedding", "weight_version", "sleep_on_idle", "enable_lora",
                     "max_lora_rank", "lora_target_modules", "lora_backend"), _ITSELF),
}


def check_own_server_args(args: Any) -> None:
    """``engines.sglang`` (name -> value) without SGLang: the arguments colocate sets itself,
    refused in one line naming what to set instead, and mapping values."""
    for name in args:
        if name in OWN_SERVER_ARGS:
            raise ConfigError(f"engines.sglang.{name}: {OWN_SERVER_ARGS[name]}")
    try:
        check_server_arg_values(args)
    except EngineConfigError as exc:
        raise in_config_terms(exc) from None
