"""Configuration: small frozen dataclasses per component, YAML files and ``key=value`` overrides.

Owns: every knob of a run with its default, loading a YAML file and ``--set
section.field=value`` overrides into the dataclass tree (``colocate.overrides`` coerces them
to the fields' types), and the checks of the whole tree (``validate``), each failure one
:class:`~colocate.errors.ConfigError` line. The ``ppo`` and ``lora`` sections are the
trainer's own (``colocate.trainer.sections``: `PPOConfig`, `LoraConfig`, re-exported here),
which check their values as they are built; loading turns such a failure into the same
one-line ``ConfigError``.

Leaves out: what the values do (each component reads its own section).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml

from colocate.modes import DEFERRED, STREAMED
from colocate.errors import ConfigError, TrainerConfigError
from colocate.config_checks import validate
from colocate.overrides import apply_updates, names, parse_overrides
# the trainer's sections, defined once where the trainer takes them (no torch); each checks its own values
from colocate.trainer.sections import LoraConfig, PPOConfig


@dataclasses.dataclass(frozen=True)
class ModelsConfig:
    actor: str = "smollm2"  # a HF folder, or "smollm2" (packaged SmolLM2-135M-Instruct)
    reward: str = "sentiment-rm"  # a causal seq-cls folder, or "sentiment-rm" (built by prepare)
    critic: str | None = None  # backbone of the critic; None: the actor's
    # the trainer's compute dtype (master weights and optimizer state stay float32); auto:
    # bfloat16 mixed precision when it trains on CUDA (FSDP2 MixedPrecisionPolicy, fp32
    # gradient reduction; the engines serve bf16 there), float32 on CPU (the exact path)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False  # run code a model folder ships (auto_map); off unless asked


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # sentiment-prompts | reasoning-gym:<task> | a dataset: hf:<name>[:<config>] (the Hub, through
    # the datasets library), a save_to_disk folder, or a .jsonl/.json/.parquet/.csv file
    source: str = "sentiment-prompts"
    max_prompt_tokens: int = 96
    # leave out the prompts longer than max_prompt_tokens (counted in one log line) instead of
    # refusing the run (verl's data.filter_overlong_prompts); eval prompts too
    filter_overlong_prompts: bool = False
    seed: int = 0
    eval_prompts: int = 16  # the last N of the shuffled source, never trained on (0: none)
    split: str = "train"  # a dataset's split (hf:, a save_to_disk DatasetDict)
    prompt_key: str = "prompt"  # a dataset's column holding the prompt: text, or chat messages [{role, content}, ...]
    answer_key: str = ""  # a dataset's column also handed to reward functions as record["answer"] ("": none)
    # prompts in the actor's chat template; false: the prompt text as it is, tokenized as the
    # tokenizer does plain text (a base model without a template; OpenRLHF's and slime's flag)
    apply_chat_template: bool = True


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = 8  # B: samples trained on per step (B / group_size groups)
    group_size: int = 1  # n: samples per prompt (GRPO's group; trained together, deferred together)
    max_new_tokens: int = 32
    # per-request token budgets: fixed (all max_new_tokens) or a long tail capped at it
    length_dist: Literal["fixed", "lognormal", "pareto"] = "fixed"
    length_median: int = 0  # lognormal/pareto: typical budget (0: max_new_tokens // 4)
    length_sigma: float = 1.0  # lognormal spread
    pareto_alpha: float = 1.5  # pareto tail index (smaller: heavier tail)
    ignore_eos: bool = False  # generate to the budget (benchmarks with controlled lengths)
    temperature: float = 1.0  # 0: greedy (reproducible across engine restarts; for tests)
    top_p: float = 1.0
    # multi-turn: an environment answers each model turn ("" single responses): calculator |
    # scripted | package.module:attr (docs/environments.md); max_new_tokens then counts the
    # whole trajectory (the environment's tokens too)
    env: str = ""
    max_turns: int = 4  # model turns per trajectory (verl's multi_turn.max_assistant_turns)
    turn_tokens: int = 0  # tokens per model turn (0: only max_new_tokens)
    env_timeout_s: float = 30.0  # one environment call


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward: the reward model's score (``kind=model``; ``rule``: none) plus every named
    rule and function, times ``scale``. ``rule`` and ``fns`` are comma lists (a YAML list
    is joined into one)."""

    kind: Literal["model", "rule"] = "model"
    # rules summed into the reward: vader (sentiment), reasoning-gym (the task's scorer), math
    rule: str | list[str] | None = None
    # reward functions by name: package.module:fn or path/file.py:fn, as api.train's reward_fns
    fns: str | list[str] = ""
    scale: float = 1.0
    # a Python/rule reward function that raises: fail the step (raise) or score 0.0 and count it (zero)
    on_error: Literal["raise", "zero"] = "raise"
    # one call of a reward function; async def: cancelled past it (an error under on_error);
    # def: it cannot be cut off, one line says it is late; 0: no deadline
    fn_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("rule", "fns"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                object.__setattr__(self, name, ",".join(v.strip() for v in value))
            elif value is not None and not isinstance(value, str):
                raise ConfigError(f"reward.{name}: expected a comma list or a list of names, got {value!r}")

    @property
    def rules(self) -> tuple[str, ...]:
        """``rule``'s names, in order."""
        return names(self.rule or "")

    @property
    def fn_names(self) -> tuple[str, ...]:
        """``fns``'s entries, in order."""
        return names(self.fns)


@dataclasses.dataclass(frozen=True)
class EnginesConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    actor_max_total_tokens: int = 65536
    reward_max_total_tokens: int = 65536
    mem_fraction_static: float = 0.3
    sync_bucket_mb: int = 64
    host_offload: Literal["pinned", "pageable"] = "pinned"  # CUDA: where the trainer sleeps between steps
    # dtype of the SGLang engines; auto: bfloat16 on CUDA (as peers serve), models.dtype on
    # CPU (float32: the CPU engine's exact path). Weights are cast to it as they are pushed.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # CPU: torch threads of each engine's scheduler process. 0 (auto): all cores, except in
    # the modes where the actor decodes while the reward engine scores (intra and oppo:
    # streamed chunks, inline or in the feeder process; inter: finished samples), which get
    # half the cores each (measured: python -m colocate.bench.cores, docs/bench.md).
    actor_threads: int = 0
    reward_threads: int = 0
    log_level: str = "error"
    # CUDA: GPUs per engine. Each training rank runs its own actor and reward engine on its
    # GPU (1, the default); n > 1: the first rank of every n ranks of a node runs an n-way
    # tensor-parallel engine over those GPUs and the others only train.
    tp_size: int = 1
    # SGLang's attention kernels ("": colocate_cpu on CPU, engine/cpu_attention.py, else torch_native
    # where SGLang would not run our plugin; on CUDA SGLang's pick where its
    # compiled kernels (sgl_kernel) are installed, else triton: engine_config.default_attention_backend)
    attention_backend: str = ""
    cuda_graph: bool = True  # CUDA: decode with CUDA graphs (false: SGLang's disable_cuda_graph; CPU: always off)
    # an engine with requests in flight that sends nothing back for this long while generation
    # is not paused (its processes alive) ends the step in one line instead of waiting forever
    # (0: wait forever); a prefill longer than this would need a larger value
    stall_timeout_s: float = 600.0
    # SGLang's own arguments (its ServerArgs, verl's engine_kwargs.sglang) for both engines, e.g.
    # {sampling_backend: pytorch}; checked against the installed SGLang when an engine starts
    sglang: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """OPPO's two overlaps; ``mode`` switches them, everything else stays identical."""

    mode: Literal["sequential", "intra", "inter", "oppo", "auto"] = "sequential"
    # intra-step: stream chunks of k tokens to the reward feeder over ZeroMQ
    chunk_size: int = 0  # 0: tune online among chunk_candidates (OPPO's rule)
    chunk_candidates: str = "16,32,64,128"
    retune_every: int = 50
    feeder: Literal["inline", "process"] = "inline"  # process: its own reward engine
    feeder_timeout_s: float = 60.0
    # inter-step: launch B + delta, train on the first B finished, defer the rest
    delta_init: int = 2
    delta_min: int = 0
    delta_max: int = 8
    delta_adaptive: bool = True
    window: int = 5
    # what a straggler does at the cut (SGLang's pause modes): abort (its partial is resumed
    # next step as prompt + partial, re-prefilled), in_place (stays in the engine with its KV
    # and continues after the weight update: in-flight update; CPU only), retract (stays
    # in the engine's queue, its KV recomputed under the new weights)
    pause_mode: Literal["abort", "in_place", "retract"] = "abort"
    # staleness of deferred tokens (sampled under older weights)
    staleness: Literal["is", "mask"] = "is"  # truncated importance sampling | mask old tokens
    is_cap: float = 2.0
    max_staleness: int = 1  # mask: train on tokens at most this many versions old
    drop_staleness: int = 4  # a deferred sample (partial or complete) whose oldest token is older is dropped
    # mode=auto: each step runs one of auto_modes, picked by measuring them online
    # (colocate/rollout/auto_mode.py): after a warm-up step each runs auto_trials steps, then the
    # one with the fewest rollout seconds per trained sample (an overlap only when it beats
    # sequential by auto_margin), and every auto_explore_every steps each runs once more
    auto_modes: str = "sequential,intra,inter,oppo"
    auto_trials: int = 2
    auto_explore_every: int = 20
    auto_margin: float = 0.03

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes a step may run: ``mode`` itself, or auto's candidates."""
        if self.mode != "auto":
            return (self.mode,)
        return names(self.auto_modes)

    @property
    def streamed(self) -> bool:
        """Whether a step may stream (the reward feeder is started)."""
        return any(m in STREAMED for m in self.modes)

    @property
    def deferral(self) -> bool:
        """Whether a step may defer (Δ, the data source's deferred samples and the staleness correction)."""
        return any(m in DEFERRED for m in self.modes)

    @property
    def candidates(self) -> tuple[int, ...]:
        return tuple(int(x) for x in names(self.chunk_candidates))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = 20
    seed: int = 0
    out_dir: str = "runs/default"
    # a folder that holds an earlier run's records is refused unless --resume continues it;
    # true: remove those records first (HF's overwrite_output_dir; colocate/run/run_folder.py)
    overwrite_out_dir: bool = False
    save_every: int = 5
    keep_checkpoints: int = 2
    train_threads: int = 0  # torch intra-op threads for training; 0: all cores
    # how long a rank waits at a collective (e.g. ranks > 0 while rank 0 generates) before
    # the process group gives up (slime: --distributed-timeout-minutes)
    dist_timeout_minutes: float = 60.0
    eval_every: int = 5  # greedy reward on the held-out prompts at step 0, every N steps, at the end (0: off)
    # what the model wrote: this many samples of each step in <out_dir>/samples.jsonl and of
    # each evaluation in eval_samples.jsonl (-1: all, 0: none; `colocate show RUN`)
    log_samples: int = 64
    # <out_dir>/timeline.jsonl: every request's launch, first token, end, score, cut and
    # fate, and each step's phases (rank 0's engines); `colocate bench` always keeps one
    timeline: bool = False
    # Weights & Biases (optional, pip install 'colocate[wandb]'): set a project to log there
    wandb_project: str = ""  # empty: no W&B
    wandb_entity: str = ""  # empty: your default entity
    wandb_name: str = ""  # empty: the run folder's name
    wandb_mode: Literal["online", "offline"] = "online"  # offline: <out_dir>/wandb, `wandb sync` later
    # a test hook (colocate/faults.py): end the run at POINT:STEP[:RANK], each once per run folder
    fault_at: str = ""  # empty: off
    fault_action: Literal["kill", "raise"] = "kill"


@dataclasses.dataclass(frozen=True)
class Config:
    models: ModelsConfig = ModelsConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    ppo: PPOConfig = PPOConfig()
    lora: LoraConfig = LoraConfig()
    engines: EnginesConfig = EnginesConfig()
    overlap: OverlapConfig = OverlapConfig()
    run: RunConfig = RunConfig()


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: Config | None = None) -> Config:
    """Defaults (or ``base``: e.g. a resumed run's config), then the YAML file, then ``overrides``; validated."""
    cfg = base if base is not None else Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        text = p.read_text()
        try:
            repeated = _repeated_key(yaml.compose(text, Loader=yaml.SafeLoader))
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file '{path}' is not valid YAML{where}") from None
        if repeated is not None:  # YAML keeps the last silently: a second section would reset the first's keys
            key, first, again = repeated
            raise ConfigError(f"config file '{path}': {key} is given twice (lines {first} and {again}); keep one")
    else:
        data = {}
    # the file and the overrides in one pass: a section is checked once, as both leave it
    cfg = _updated(cfg, data, parse_overrides(list(overrides)))
    validate(cfg)
    return cfg


def _repeated_key(node: yaml.Node | None, path: tuple[str, ...] = ()) -> tuple[str, int, int] | None:
    """The first key a mapping of the YAML ``node`` tree gives twice: (its dotted path, the
    lines of both), or None."""
    if isinstance(node, yaml.SequenceNode):
        return next((found for item in node.value if (found := _repeated_key(item, path))), None)
    if not isinstance(node, yaml.MappingNode):
        return None
    seen: dict[str, int] = {}
    for key, value in node.value:
        name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
        if name in seen:
            return ".".join((*path, name)), seen[name] + 1, key.start_mark.line + 1
        seen[name] = key.start_mark.line
        found = _repeated_key(value, (*path, name))
        if found is not None:
            return found
    return None


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> Config:
    """The inverse of :func:`to_dict` (a run's ``config.json``); missing keys keep their defaults."""
    return _updated(Config(), data)


def _updated(cfg: Config, *updates: dict[str, Any]) -> Config:
    """``cfg`` with ``updates`` applied in order (``colocate.overrides.apply_updates``); a
    section's own check (the trainer's ``ppo``/``lora``: `TrainerConfigError`) as its
    one-line ``ConfigError``."""
    try:
        return apply_updates(cfg, *updates)
    except TrainerConfigError as exc:
        raise ConfigError(str(exc)) from None


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
