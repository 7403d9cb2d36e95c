"""Construct a :class:`~colocate.run.session.Session` from a config.

Owns the start-up order: distributed group → the run folder held (``api.train``'s:
``colocate.run.run_folder``) and what killed runs left swept (``colocate.run.leftovers``)
→ what is read and checked before any engine
(:func:`start_inputs`: model folders, reward functions, tokenized prompts, each engine's
context; ``colocate train --check`` runs it alone, ``colocate.run.dry_run``) → SGLang
engines on every engine rank (``colocate.run.placement``; before FSDP sharding, so the
engines' spawned schedulers never inherit a process group), released at once on CUDA →
the tensor-parallel groups' subgroups (``engines.tp_size`` > 1) → trainer → rollout phase
→ optional resume → engines woken with the trainer's weights (CUDA, or after a resume).
Leaves out: the step (``colocate.run.loop``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from colocate.assets import tasks
from colocate.assets.data_files import library_errors_held
from colocate.run import leftovers, run_folder, timesharing, weight_sync
from colocate.config import Config
from colocate.rollout.schedule import check_pause_mode
from colocate.engine.pool import EnginePool
from colocate.engine.engine_config import EngineConfig
from colocate.engine.start_checks import check_remote_code, check_startable, check_weights, read_architecture
from colocate.monitor.timeline import Timeline
from colocate.errors import ConfigError, config_terms
from colocate.rollout.env import Environment
from colocate.rollout.environments import check_environment, load_environment
from colocate.rollout.evaluation import held_out_note, split_held_out
from colocate.run.engines import RankEngines
from colocate.run.guards import check_world_size
from colocate.assets.model_aliases import resolve_model
from colocate.run.placement import Placement, placement_of
from colocate.run.preflight import check_contexts, check_reads_actor_ids, load_tokenizer
from colocate.rollout.named_rewards import check_reward_fn, named_reward_fns
from colocate.rollout.reward_fns import RewardFn, RewardFnErrors, fn_name, guarded
from colocate.rollout.data_source import DataSource
from colocate.rollout.rollouts import Rollouts
from colocate.rollout.turns import EnvErrors, EnvTurns, ObservationTemplate
from colocate.run.session import RunContext, RunState, Session, decode_text, stop_ids, tokenize_prompts
from colocate.trainer import distributed
from colocate.trainer.distributed import init_distributed
from colocate.trainer.estimators import CRITIC_FREE
from colocate.trainer.kl_control import make_kl_controller
from colocate.trainer.lora import check_targets
from colocate.trainer.ppo_trainer import PPOTrainer, TrainerSettings
from colocate.trainer.precision import auto_dtype, cpu_flags
from colocate.monitor.quiet import loaded, params
from colocate.monitor.wandb_log import check_available


def engine_threads(cfg: Config, cores: int) -> tuple[int, int]:
    """CPU thread budget (actor, reward) of the engines' scheduler processes.

    Explicit ``engines.*_threads`` win. Auto (0): where the two engines compute at the same
    time, half the cores each, so their OpenMP threads never outnumber the cores: intra and
    oppo (the reward engine prefills streamed chunks while the actor decodes; inline or in
    the feeder's process) and inter (each finished sample is scored while the others
    decode). Measured with ``python -m colocate.bench.cores`` on 2 cores (docs/bench.md,
    "Engine cores"): decoding beside scoring, 1/1 beat every core each (2/2) on the quick
    models (823 vs 497 tokens/s, score latency 0.024 vs 0.062 s) and on SmolLM2 + its RM
    (48 vs 43 tokens/s, 0.08 vs 1.5 s). Sequential: every core each, since generation and
    scoring take turns (and the trainer only runs while both idle). ``overlap.mode=auto``:
    every core each, as sequential's (threads are fixed at start; its overlapped steps then
    share the cores, and its picker runs them only where they still pay)."""
    e = cfg.engines
    auto = max(1, cores // 2) if cfg.overlap.mode in ("inter", "intra", "oppo") else cores
    return e.actor_threads or auto, e.reward_threads or auto


def actor_overlap_schedule(cfg: Config) -> bool:
    """Whether the actor engine runs SGLang's overlap scheduler: not when stragglers pause
    in place across weight updates (see ``EngineConfig.overlap_schedule``)."""
    return not (cfg.overlap.deferral and cfg.overlap.pause_mode == "in_place")


def engine_dtype(cfg: Config, cuda_available: bool, flags: frozenset[str] | None = None) -> str:
    """``engines.dtype``; auto: bfloat16 where the engines run on CUDA, else the trainer's
    dtype on CPU (``trainer_dtype``; ``flags``: the CPU's, None: this machine's)."""
    if cfg.engines.dtype != "auto":
        return cfg.engines.dtype
    on_cuda = cfg.engines.device == "cuda" or (cfg.engines.device == "auto" and cuda_available)
    return "bfloat16" if on_cuda else trainer_dtype(cfg, "cpu", flags)


def trainer_dtype(cfg: Config, device_type: str, flags: frozenset[str] | None = None) -> str:
    """The trainer's compute dtype (`trainer_precision`)."""
    return trainer_precision(cfg, device_type, flags)[0]


def trainer_precision(cfg: Config, device_type: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(the trainer's compute dtype, why): ``models.dtype``; auto: bfloat16 (mixed precision
    over fp32 master weights) on CUDA and on CPUs that multiply it natively (AVX512-BF16,
    AMX: ``colocate.trainer.precision``; ``flags``: the CPU's, None: this machine's), where
    the engines serve bf16 too (so ``ppo.old_logp=rollout`` compares like with like), float32
    on other CPUs (bf16 is emulated there, slower)."""
    if cfg.models.dtype != "auto":
        return cfg.models.dtype, "models.dtype"
    dtype, why = auto_dtype(device_type, cpu_flags() if flags is None else flags)
    return dtype, f"models.dtype=auto: {why}"


def engine_configs(cfg: Config, actor_path: str, reward_path: str | None, placement: Placement = Placement()):
    """(actor, reward) `EngineConfig`s of ``cfg`` for the engines of ``placement``'s rank
    (its GPU, its share of the CPU cores, ports of its own when several ranks share the
    node); reward is None without a reward model."""
    e = cfg.engines
    on_cuda = e.device == "cuda" or (e.device == "auto" and torch.cuda.is_available())
    # CPU thread budgets only matter where the engines compute on the CPU; on CUDA they would
    # make every mode's engines differ and an EnginePool start new ones per mode (found on an H100)
    actor_threads, reward_threads = (0, 0) if on_cuda else engine_threads(
        cfg, placement.engine_cores(len(os.sched_getaffinity(0))))
    shared_node = placement.local_world > placement.tp_size
    common = dict(device=e.device, dtype=engine_dtype(cfg, on_cuda), seed=cfg.run.seed,
                  mem_fraction_static=e.mem_fraction_static, log_level=e.log_level,
                  trust_remote_code=cfg.models.trust_remote_code, base_gpu_id=placement.gpu_id,
                  tp_size=e.tp_size, attention_backend=e.attention_backend or None, cuda_graph=e.cuda_graph,
                  stall_timeout_s=e.stall_timeout_s, server_args=e.sglang)
    actor = EngineConfig(actor_path, role="actor", max_total_tokens=e.actor_max_total_tokens,
                         threads=actor_threads, nccl_port=placement.nccl_port("actor") if shared_node else None,
                         overlap_schedule=actor_overlap_schedule(cfg),
                         **common)
    # the reward model's weights are never pushed again: they sleep with a host copy (CUDA)
    reward = None if reward_path is None else EngineConfig(
        reward_path, role="reward", max_total_tokens=e.reward_max_total_tokens, threads=reward_threads,
        weights_cpu_backup=True, nccl_port=placement.nccl_port("reward") if shared_node else None, **common)
    return actor, reward


def tp_barrier(placement: Placement, dist) -> Callable[[], None] | None:
    """The barrier of the sleep/wake order where a tensor-parallel engine's shards share
    GPUs with other ranks' trainers (``engines.tp_size`` > 1); None otherwise."""
    if placement.tp_size == 1:
        return None
    return lambda: distributed.barrier(dist)


def checked_device(cfg: Config) -> str:
    """The run's device (:func:`run_device`) with the settings it cannot run refused
    (:func:`check_device_choices`), then, for ``cuda``, CUDA there: each refusal one line
    before anything starts (CUDA missing was a traceback from the process group's start:
    "ProcessGroupNCCL is only supported with GPUs")."""
    device = run_device(cfg)
    check_device_choices(cfg, device)
    if device == "cuda" and (why := cuda_missing()) is not None:
        raise ConfigError(f"engines.device=cuda: {why}; use engines.device=auto (the CPU here) or cpu "
                          "(colocate doctor: the driver)")
    return device


def run_device(cfg: Config) -> str:
    """cpu | cuda: ``engines.device``; auto: cuda where torch sees one."""
    if cfg.engines.device != "auto":
        return cfg.engines.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_missing() -> str | None:
    """Why torch sees no CUDA device in this process (None: it sees one)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"
    return "torch sees no CUDA device here (no NVIDIA GPU, or its driver is missing or too old)"


def check_device_choices(cfg: Config, device: str) -> None:
    """Settings the resolved ``device`` (cpu | cuda) cannot run, refused in one line
    before anything starts."""
    if device == "cpu" and cfg.engines.tp_size > 1:
        raise ConfigError(f"engines.tp_size: {cfg.engines.tp_size} needs CUDA engines; on CPU each rank's engine "
                          "runs alone (tp_size 1)")
    if device == "cuda" and own_feeder(cfg):
        raise ConfigError("overlap.feeder=process is not supported on CUDA: its process's reward engine is never "
                          "released, so it would hold GPU memory while the trainer trains; use overlap.feeder=inline")
    if cfg.overlap.deferral:
        check_pause_mode(cfg.overlap.pause_mode, device)  # in_place: CPU only
    # the trainer's own checks (`TrainerSettings`: e.g. ppo.attention on this device), before engines start
    trainer_settings(cfg, cfg.models.actor, cfg.models.critic, torch.device(device))


def own_feeder(cfg: Config) -> bool:
    """Whether the reward model is served by the feeder's own process, not in this one."""
    return cfg.overlap.streamed and cfg.overlap.feeder == "process"


def trainer_settings(cfg: Config, actor_path: str, critic_path: str, device, **settings):
    """`TrainerSettings` of ``cfg`` for a trainer on ``device`` (a torch.device;
    ``settings``: fields the config does not hold, e.g. ``micro_batch``): the ``ppo`` and
    ``lora`` sections as they are, the rest from the sections that own it (models, run,
    rollout, overlap, engines) and the KL controller (``kl_on``)."""
    o = cfg.overlap
    return TrainerSettings(
        actor_path=actor_path, critic_path=critic_path, dtype=trainer_dtype(cfg, device.type),
        device=str(device), seed=cfg.run.seed, ppo=cfg.ppo, lora=cfg.lora,
        trust_remote_code=cfg.models.trust_remote_code,
        is_cap=o.is_cap if o.deferral and o.staleness == "is" else None,
        max_staleness=o.max_staleness if o.deferral and o.staleness == "mask" else None,
        temperature=cfg.rollout.temperature or 1.0, host_offload=cfg.engines.host_offload,
        reference=kl_on(cfg), **settings)


def kl_on(cfg: Config) -> bool:
    """Whether anything reads the reference: not with a fixed KL coefficient of 0 (DAPO,
    Dr. GRPO recipes), where the trainer builds none (``TrainerSettings.reference``)."""
    return not (cfg.ppo.kl_kind == "fixed" and cfg.ppo.kl_coef == 0)


def make_trainer(cfg: Config, actor_path: str, critic_path: str, dist, **settings):
    """The PPO trainer (actor, reference, critic unless critic-free, on FSDP2) with the
    settings of ``cfg`` (`trainer_settings`). transformers' lines while it loads the models
    (its load report) are printed after it, and dropped when the trainer refuses a model in
    its own one line."""
    with library_errors_held("transformers"):
        return PPOTrainer(trainer_settings(cfg, actor_path, critic_path, dist.device, **settings), dist)


def make_rollouts(cfg: Config, actor, reward, reward_cfg, reward_fns: Sequence[RewardFn], tokenizer,
                  batch_size: int, timeline: Timeline | None, log: Callable[[str], None],
                  env: Environment | None = None, env_errors: EnvErrors | None = None) -> Rollouts:
    """The rollout phase of an engine rank (every mode): ``batch_size`` its share of the
    batch; with ``overlap.feeder=process`` the feeder's process starts its own reward
    engine from ``reward_cfg``; with ``env`` multi-turn trajectories (``rollout.max_turns``,
    ``turn_tokens``, ``env_timeout_s``; ``reward.on_error`` for its failures).
    ``colocate train`` and the bench (``bench.runner``: a fresh phase per mode, through
    ``RunContext.rollouts_for``) build it here."""
    decode = functools.partial(decode_text, tokenizer)
    turns = None
    if env is not None:
        r = cfg.rollout
        frame = ObservationTemplate(tokenizer, stop_ids(tokenizer), cfg.data.apply_chat_template)
        turns = EnvTurns(env, frame, decode, max_turns=r.max_turns,
                         turn_tokens=r.turn_tokens, timeout_s=r.env_timeout_s, on_error=cfg.reward.on_error,
                         errors=env_errors)
    return Rollouts(cfg, actor, reward, reward_cfg if own_feeder(cfg) else None, log, reward_fns=reward_fns,
                    decode=decode, batch_size=batch_size, timeline=timeline, env=turns, stop_ids=stop_ids(tokenizer))


def environment(cfg: Config, env: Environment | None) -> Environment | None:
    """The run's environment: ``env`` (the API's), or the one ``rollout.env`` names; None:
    single responses."""
    if env is None and cfg.rollout.env:
        return load_environment(cfg.rollout.env)
    return check_environment(env, "env") if env is not None else None


def _data(cfg: Config, tokenizer, instruction: str = "", log: Callable[[str], None] = print):
    """(training prompts, held-out evaluation prompts), tokenized; an environment's
    ``instruction`` (how to use its tool) follows each prompt's text (chat messages: the last
    user turn's); ``data.filter_overlong_prompts``: those longer than ``data.max_prompt_tokens``
    left out, in one log line."""
    d = cfg.data
    prompts = tasks.load_prompt_source(d.source, None, d.seed, split=d.split, prompt_key=d.prompt_key,
                                       answer_key=d.answer_key)
    if instruction:
        prompts = [p.with_instruction(instruction) for p in prompts]
    held = cfg.data.eval_prompts if cfg.run.eval_every > 0 else 0
    train, held_out = split_held_out(prompts, held)
    chat, most, drop = cfg.data.apply_chat_template, cfg.data.max_prompt_tokens, cfg.data.filter_overlong_prompts
    kept = [tokenize_prompts(tokenizer, part, most, chat, drop_overlong=drop) for part in (train, held_out)]
    left = [len(part) - len(k) for part, k in zip((train, held_out), kept)]
    if train and not kept[0]:
        raise ConfigError(f"data: every training prompt is longer than data.max_prompt_tokens {most}, so "
                          "data.filter_overlong_prompts leaves none; raise data.max_prompt_tokens")
    if any(left):
        log(f"data: left out {left[0]} of {len(train)} training prompts" + (f" and {left[1]} of {len(held_out)} "
            "held-out ones" if held_out else "") + f" longer than data.max_prompt_tokens {most} "
            "(data.filter_overlong_prompts)")
    return kept[0], kept[1]


def _reward_fns(cfg: Config, extra: Sequence[RewardFn]) -> list[RewardFn]:
    """The API's functions (checked as ``reward.fns``' are), then the rules and functions the
    config names (loaded here, once)."""
    if callable(extra):
        raise ConfigError(f"reward_fns: one function ({fn_name(extra)}), not a list of them; pass "
                          f"reward_fns=[{fn_name(extra)}]")
    if isinstance(extra, (str, bytes)) or not isinstance(extra, Iterable):
        raise ConfigError(f"reward_fns: a {type(extra).__name__}, not a list of reward functions; pass "
                          "reward_fns=[fn, ...]")
    extra = [check_reward_fn(fn, f"reward_fns[{i}]") for i, fn in enumerate(extra)]
    return [*extra, *named_reward_fns(cfg.reward, cfg.data.source)]


@dataclasses.dataclass(frozen=True)
class StartInputs:
    """What a run reads and checks before any engine starts (:func:`start_inputs`):
    model folders (``reward_path`` None without a reward model, or with an alias not built
    when not asked to build it), the config's reward functions (unguarded), the actor's
    tokenizer, the tokenized training and held-out prompts, the engines' configs."""

    actor_path: str
    reward_path: str | None
    critic_path: str
    reward_fns: list[RewardFn]
    tokenizer: object
    prompts: list
    eval_prompts: list
    actor_cfg: EngineConfig
    reward_cfg: EngineConfig | None


def start_inputs(cfg: Config, env: Environment | None, placement: Placement, world_size: int,
                 reward_fns: Sequence[RewardFn] = (), *, build_models: bool = True,
                 log: Callable[[str], None] = print) -> StartInputs:
    """Models resolved, remote code, world size, LoRA's target names against the models,
    reward functions loaded, prompts tokenized (``data.max_prompt_tokens``; ``log``: the
    prompts left out), each engine's model against SGLang (its folder, weights, arguments,
    model class and config: ``engine.start_checks.check_startable``, on ranks that host
    engines), prompt + budget against each engine's context and KV pool: every refusal one
    line, no engine started. ``build_models=False``: a reward
    model alias that is not built yet is not built (its context is then not checked)."""
    actor_path = resolve_model(cfg.models.actor, "models.actor")
    use_rm = cfg.reward.kind == "model"
    reward_path = resolve_model(cfg.models.reward, "models.reward", build=build_models) if use_rm else None
    critic_path = resolve_model(cfg.models.critic, "models.critic") if cfg.models.critic else actor_path
    if cfg.models.critic:  # the trainer loads it (no engine checks it): a model folder, or one line now
        read_architecture(critic_path, "models.critic")
        check_weights(critic_path, "models.critic")
    trusted = cfg.models.trust_remote_code
    for path, field in ((actor_path, "models.actor"), (reward_path, "models.reward"), (critic_path, "models.critic")):
        if path is not None:
            check_remote_code(path, field, trusted)
    check_world_size(cfg.rollout.batch_size, cfg.ppo.minibatches, world_size)
    if cfg.lora.on_actor:  # the names PEFT would refuse once the trainer is built, after the engines started
        check_targets(actor_path, cfg.lora, trust_remote_code=trusted)
    if cfg.lora.on_critic and cfg.ppo.advantage not in CRITIC_FREE:
        check_targets(critic_path, cfg.lora, backbone=True, trust_remote_code=trusted)
    placement.share(cfg.rollout.batch_size, cfg.rollout.group_size)  # whole groups per engine rank
    fns = _reward_fns(cfg, reward_fns)
    tokenizer = load_tokenizer(actor_path, "models.actor", trusted)
    for path, field in ((reward_path, "models.reward"), (critic_path if cfg.models.critic else None, "models.critic")):
        if path is not None:  # they are handed the actor's token ids as they are
            check_reads_actor_ids(tokenizer, actor_path, path, field, trusted)
    if env is not None and isinstance(getattr(env, "role", None), str):  # the role it answers with, if declared:
        frame = ObservationTemplate(tokenizer, stop_ids(tokenizer), cfg.data.apply_chat_template)
        frame.check(env.role)  # refused before any engine starts
    prompts, eval_prompts = _data(cfg, tokenizer, env.instruction if env is not None else "", log)
    actor_cfg, reward_cfg = engine_configs(cfg, actor_path, reward_path, placement)
    check_contexts(cfg, actor_cfg, reward_cfg, prompts + eval_prompts)  # before SGLang is imported
    if placement.hosts_engines:  # SGLang can load each model: one line here, not a scheduler's traceback
        for engine_cfg, field in ((actor_cfg, "models.actor"), (reward_cfg, "models.reward")):
            if engine_cfg is not None:
                check_startable(engine_cfg, field)
    return StartInputs(actor_path, reward_path, critic_path, fns, tokenizer, prompts, eval_prompts, actor_cfg,
                       reward_cfg)


def _quiet(message: str) -> None:
    """The log of ranks other than 0."""


def build(cfg: Config, *, resume: str | Path | None = None, reward_fns: Sequence[RewardFn] = (),
          log: Callable[[str], None] = print, engines: EnginePool | None = None,
          env: Environment | None = None, claim: bool = False) -> Session:
    """The session of a run on this rank: checks, engines (started, or taken from
    ``engines``, a pool kept across runs), trainer, data, rollout phase; ``resume`` a run
    folder or checkpoint to continue from; ``env`` the environment of multi-turn
    trajectories (else ``rollout.env``'s, if set). ``claim``: rank 0 holds ``run.out_dir``
    for the session's life, refused in one line before any engine starts when it holds an
    earlier run or another run holds it (``colocate.run.run_folder``; ``api.train``'s)."""
    check_available(cfg.run)  # before anything starts
    env = environment(cfg, env)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.train_threads > 0:
        torch.set_num_threads(cfg.run.train_threads)
    device = checked_device(cfg)
    dist = init_distributed(device, timeout_s=cfg.run.dist_timeout_minutes * 60)
    placement = placement_of(dist, cfg.engines.tp_size,
                             visible_gpus=torch.cuda.device_count() if dist.device.type == "cuda" else 0)
    if dist.rank != 0:
        log = _quiet  # rank 0 speaks for the run
    folder = run_folder.claim(cfg, resume, log) if claim and dist.rank == 0 else None  # rank 0 writes it
    try:
        _sweep(folder, log)
        with config_terms():  # an engine's error names the config field that fixes it
            return _build(cfg, dist, placement, resume, reward_fns, log, engines, env, folder)
    except BaseException:
        if folder is not None:
            folder.release()
        raise


def _sweep(folder: run_folder.RunFolder | None, log: Callable[[str], None]) -> None:
    """What killed runs left (``colocate.run.leftovers``): their temporary folders, and the
    partial checkpoint writes in the run folder this run holds."""
    removed = leftovers.sweep(folder.path / "checkpoints" if folder is not None else None)
    if removed:
        log(f"removed what ended runs left behind: {', '.join(map(str, removed))}")


def _build(cfg: Config, dist, placement: Placement, resume: str | Path | None, reward_fns: Sequence[RewardFn],
           log: Callable[[str], None], engines: EnginePool | None, env: Environment | None,
           folder: run_folder.RunFolder | None) -> Session:
    """`build` after the process group (and the run folder) are set up."""
    device = dist.device.type
    inputs = start_inputs(cfg, env, placement, dist.world_size, reward_fns, log=log)
    if cfg.run.eval_every > 0 and (note := held_out_note(cfg.data.eval_prompts, len(inputs.eval_prompts),
                                                          len(inputs.prompts) + len(inputs.eval_prompts))):
        log(note)
    tokenizer, actor_cfg, reward_cfg = inputs.tokenizer, inputs.actor_cfg, inputs.reward_cfg
    share = placement.share(cfg.rollout.batch_size, cfg.rollout.group_size)
    reward_errors = RewardFnErrors()
    env_errors = EnvErrors()  # one count across the rollout phases a session builds (the bench's per mode)
    fns = [guarded(fn, cfg.reward.on_error, reward_errors, cfg.reward.fn_timeout_s, log) for fn in inputs.reward_fns]
    rollouts = None
    hosted = RankEngines(placement=placement)
    if placement.hosts_engines:  # the reward engine unless a feeder process hosts its own
        hosted = RankEngines.start(actor_cfg, None if own_feeder(cfg) else reward_cfg, engines, placement)
        log(hosted.describe(placement.engine_ranks))
    actor, reward = hosted.actor, hosted.reward
    # seeded only now: SGLang picks its ports with the global `random`, so seeding it before
    # the engines start gave every run of one seed the same port (EADDRINUSE side by side)
    random.seed(cfg.run.seed)
    barrier = tp_barrier(placement, dist)
    try:
        timesharing.release([actor, reward])  # CUDA: the device back before the trainer loads (woken in wake_engines)
        if barrier is not None:
            barrier()  # a TP engine's shards are off the other ranks' GPUs before their trainers load
        # every rank, same order: each TP rank of an engine loads its own training rank's copy of the weights
        hosted.tp = weight_sync.tp_exchange(placement, actor_cfg.dtype, flattened=device == "cuda")
        loading = time.perf_counter()
        trainer = make_trainer(cfg, inputs.actor_path, inputs.critic_path, dist)
        log(loaded("trainer", params({"actor": trainer.actor, "reference": trainer.ref, "critic": trainer.critic}),
                   time.perf_counter() - loading) + "; computes in {} ({})".format(*trainer_precision(cfg, device)))
        p = cfg.ppo
        kl_ctl = make_kl_controller(p.kl_kind, p.kl_coef, p.kl_target, p.kl_horizon)
        out_dir = Path(cfg.run.out_dir)
        # rank 0's engines: the one timeline a run writes (run.timeline)
        timeline = Timeline() if cfg.run.timeline and placement.hosts_engines and dist.rank == 0 else None
        def rollouts_for(run_cfg: Config) -> Rollouts:
            return make_rollouts(run_cfg, actor, reward, reward_cfg, fns, tokenizer, share, timeline, log,
                                 env, env_errors)

        rollouts = rollouts_for(cfg) if placement.hosts_engines else None
        data = DataSource(inputs.prompts, cfg.rollout, cfg.run.seed, placement.engine_rank, placement.engine_ranks,
                          eval_prompts=inputs.eval_prompts)
        context = RunContext(tokenizer, out_dir, log, fns, reward_errors, timeline,
                             rollouts_for if placement.hosts_engines else None, folder)
        session = Session(cfg, dist, trainer, hosted, data, rollouts, RunState(kl_ctl), context)
        hosted.sharing = timesharing.TimeSharing(
            [actor, reward], trainer, log, device_push=dist.device.type == "cuda", barrier=barrier,
            # the session's rollout phase of the moment (the bench builds a fresh one per mode)
            quiesce=(lambda: session.rollouts.drain()) if rollouts is not None else None)
        if resume is not None:
            session.restore(Path(resume))
        session.wake_engines(resumed=resume is not None)
    except BaseException:
        if rollouts is not None:
            rollouts.close()
        hosted.close()
        raise
    return session
