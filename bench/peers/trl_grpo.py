"""TRL's GRPO (trl 1.12.0, `trl.GRPOTrainer`) as the benchmark's peer of colocate's critic-free path.

Owns: running TRL's `GRPOTrainer` on the same actor, reward model, chat-formatted prompts
and batch as a colocate run with ``ppo.advantage=grpo rollout.group_size=N``, and timing
it. One update = one generation round: B/N prompts × N completions = B trained samples,
then `epochs` passes over them in `minibatches` optimizer steps each. Each update's wall
time comes from trainer events; its phases from forward hooks on the policy, the
reference and the reward model: generate, old_logp (the policy's no-grad scoring pass,
which TRL runs when an update has more than one optimizer step, as colocate recomputes
old log-probs), ref (0 when beta is 0: TRL builds no reference then), reward (the reward
model's forward), other (the rest of the scoring window: decoding, re-tokenizing for the
reward model, advantages) and train, which add up to the update. Response tokens and
mean reward per update come from TRL's own logs. Warm-up updates (default 1) run first
and are left out of the numbers. `python -m colocate.bench.peers.trl_grpo` writes
`trl_result.json`; the bench runs it in a subprocess. trl is imported only when a run starts.

Settings chosen for a like-for-like run (everything else is TRL's default):

- the precision of colocate's trainer: float32 (bf16/fp16 off; TRL's GRPO turns bf16 on by
  default) unless ``--bf16`` (TRL's ``bf16=True``: autocast over float32 weights, as
  colocate's ``models.dtype=bfloat16``); gradient checkpointing off; the reference is built
  by TRL from the actor folder, loaded in fp32 (its default);
- a pad token distinct from EOS, as `bench.peers.trl_ppo` chooses it, for the policy's
  and the reward model's tokenizer;
- the reward: the reward model folder as a one-label sequence classifier passed as
  ``reward_funcs``. TRL decodes prompt and completion and re-tokenizes the conversation
  with the chat template for it (colocate scores the token ids it generated);
- batch: ``num_generations=N``, ``per_device_train_batch_size`` = the micro-batch (``--micro-batch``,
  default a whole minibatch B/minibatches; the bench passes what fits colocate's
  ``ppo.micro_batch_tokens``), ``gradient_accumulation_steps`` = the micro-batches of a
  minibatch and ``steps_per_generation`` = all of a round's (so ``generation_batch_size=B``):
  one generation round yields exactly B completions, and each minibatch is one optimizer
  step, as in colocate; ``num_iterations=epochs`` reuses the round for
  every epoch (colocate's ``ppo.epochs``); ``max_steps`` = updates × minibatches × epochs;
- ``max_completion_length`` = the cap. With ``--stop-at-eos`` EOS ends a response (TRL
  always stops there); without it, ``min_new_tokens`` = the cap keeps TRL from sampling
  EOS, so every response runs to the cap (colocate's ``rollout.ignore_eos``);
- KL: ``beta`` (``--beta``) defaults to colocate's default ``ppo.kl_coef`` (0.05; TRL's
  default is 0, no KL). TRL adds the k3 estimate to the loss, as colocate does with
  ``ppo.kl_in=loss``; the bench passes the workload's ``ppo.kl_coef``;
- advantages: TRL's default (group mean, divided by the group's std: colocate's ``grpo``
  with ``ppo.norm_adv_by_std``), loss TRL's default ``dapo`` (token mean over the batch);
- no vLLM, no evaluation, no saving, no completion logging, report_to none.

Left out: the placement (models run where accelerate puts them: the CPU here, the GPU on
a CUDA machine), RLOO and other critic-free estimators (TRL's GRPO stands for all of them),
and comparisons of quality. Only throughput and the reward trace come back.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

from colocate.bench.peers.trl_ppo import (INSTALL_HINT, TRL_VERSION, Clock, PeerUnavailable, common_parser,
                                          load_tokenizer, prompt_texts, run_cli, seed_and_threads, summary, timed,
                                          train_timed)
from colocate.config import PPOConfig
from colocate.quick_exit import skip_last_collection

FORWARDS = ("old_logp", "ref", "reward")
PHASES = ("generate", *FORWARDS, "other", "train")
DEFAULT_BETA = PPOConfig().kl_coef  # colocate's default KL coefficient


class GrpoClock(Clock):
    """`Clock` with GRPO's phases (`PHASES`)."""

    def phases(self, now: float) -> dict[str, float]:
        """generate until the first scoring forward, the forwards, other, train from the first grad forward."""
        forwards = {name: self.busy.get(name, 0.0) for name in FORWARDS}
        scored = min((self.first[n] for n in FORWARDS if n in self.first), default=self.first.get("train", now))
        trained = self.first.get("train", now)
        return {"generate": scored - self.start, **forwards,
                "other": trained - scored - sum(forwards.values()), "train": now - trained}


class _UpdateTimer(TrainerCallback):
    """Cuts the clock every `steps` optimizer steps; takes each update's reward and lengths from TRL's logs."""

    def __init__(self, clock: GrpoClock, steps: int, batch_size: int,
                 progress: Callable[[str], object] | None) -> None:
        self.clock, self.steps, self.batch_size, self.progress = clock, steps, batch_size, progress

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.begin(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps == 0:
            self.clock.cut(state.global_step // self.steps, state.max_steps // self.steps, self.progress)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The log after an update's generating step; it comes after `on_step_end`, so it may
        belong to an update already finished (one optimizer step per update)."""
        if not logs or "reward" not in logs:
            return
        update = (state.global_step - 1) // self.steps
        values = {"reward_mean": float(logs["reward"]),
                  "response_tokens": round(float(logs["completions/mean_length"]) * self.batch_size)}
        if update < len(self.clock.records):
            self.clock.records[update].update(values)
        else:
            self.clock.reward_mean, self.clock.response_tokens = values["reward_mean"], values["response_tokens"]


def _attach_hooks(trainer: Any, clock: GrpoClock) -> list[Any]:
    """Forward hooks on the policy (scoring pass and training), reference and reward model; their handles."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    scoring = lambda kwargs: not torch.is_grad_enabled() and kwargs.get("use_cache") is False  # noqa: E731

    def pre(module, args, kwargs):  # generation's forwards use the KV cache; TRL's log-prob passes do not
        if torch.is_grad_enabled():
            clock.enter("train")
        elif scoring(kwargs):
            clock.enter("old_logp")

    def post(module, args, kwargs, output):
        if scoring(kwargs):
            clock.leave("old_logp")

    handles = [policy.register_forward_pre_hook(pre, with_kwargs=True),
               policy.register_forward_hook(post, with_kwargs=True),
               *timed(trainer.reward_funcs[0], "reward", clock)]
    if trainer.ref_model is not None:
        handles += timed(trainer.ref_model, "ref", clock)
    return handles


# ---------------------------------------------------------------- settings, models and trainer


@dataclasses.dataclass(frozen=True)
class GrpoSettings:
    """One GRPO peer run: B trained samples per update in groups of N, T new tokens at most."""

    batch_size: int = 8  # B: completions trained on per update (B / group_size prompts)
    group_size: int = 2  # N: completions per prompt (TRL's num_generations)
    max_new_tokens: int = 32
    updates: int = 2  # measured updates
    warmup: int = 1  # updates run first and left out
    epochs: int = 1  # passes over each generation round (TRL's num_iterations)
    minibatches: int = 2  # optimizer steps per epoch
    beta: float = DEFAULT_BETA  # KL coefficient (k3 in the loss)
    seed: int = 0
    stop_at_eos: bool = False
    bf16: bool = False  # TRL's bf16=True (autocast over float32 weights); False: float32
    micro_batch: int = 0  # samples per forward/backward pass (0: a whole minibatch, no accumulation)

    @property
    def prompts(self) -> int:
        """Prompts drawn over the whole run."""
        return (self.warmup + self.updates) * self.batch_size // max(self.group_size, 1)

    @property
    def steps_per_update(self) -> int:
        return self.minibatches * self.epochs

    @property
    def micro(self) -> int:
        """Samples per forward/backward pass: ``micro_batch``, or a whole minibatch."""
        return self.micro_batch or self.batch_size // self.minibatches

    @property
    def accumulation(self) -> int:
        """Passes accumulated into one optimizer step (one minibatch's)."""
        return self.batch_size // self.minibatches // self.micro

    def check(self) -> None:
        """`ValueError` unless the batch splits into whole groups and whole minibatches."""
        b, n, m = self.batch_size, self.group_size, self.minibatches
        if n < 2 or b % n or b % m or min(self.updates, self.epochs, m, self.max_new_tokens) < 1 or self.warmup < 0:
            raise ValueError(f"need group_size ({n}) >= 2 (TRL's GRPO has no group of one), batch_size ({b}) "
                             f"divisible by group_size and by minibatches ({m}), updates, epochs and new tokens "
                             ">= 1, warmup >= 0")
        if self.micro_batch < 0 or (b // m) % self.micro:
            raise ValueError(f"need micro_batch ({self.micro_batch}) >= 0 dividing a minibatch ({b // m} samples)")


def _import_trl() -> tuple[str, Any, Any]:
    """(trl version, GRPOConfig, GRPOTrainer), or `PeerUnavailable` with the install hint."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import trl  # deferred: the bench runs without trl; missing, it is one line, not a traceback
            from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise PeerUnavailable(f"TRL's GRPOTrainer is not importable ({exc}); {INSTALL_HINT} "
                              f"(the bench measures trl=={TRL_VERSION})") from None
    return trl.__version__, GRPOConfig, GRPOTrainer


def _grpo_config(config_cls: Any, out_dir: Path, s: GrpoSettings) -> Any:
    return config_cls(
        output_dir=str(out_dir / "trl"), report_to=[], bf16=s.bf16, fp16=False, gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),  # transformers refuses bf16 without a GPU unless told it is the CPU
        seed=s.seed, data_seed=s.seed, use_vllm=False, num_generations=s.group_size,
        per_device_train_batch_size=s.micro, steps_per_generation=s.minibatches * s.accumulation,
        gradient_accumulation_steps=s.accumulation, num_iterations=s.epochs, max_steps=(s.warmup + s.updates) * s.steps_per_update,
        max_completion_length=s.max_new_tokens, temperature=1.0, beta=s.beta,
        generation_kwargs=None if s.stop_at_eos else {"min_new_tokens": s.max_new_tokens},
        log_completions=False, eval_strategy="no", save_strategy="no", push_to_hub=False,
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )


def _load_models(actor_path: str, reward_path: str, pad_id: int) -> dict[str, Any]:
    """Policy and reward model (one label), fp32; TRL builds the reference itself when beta > 0."""
    policy = AutoModelForCausalLM.from_pretrained(actor_path, dtype=torch.float32)
    policy.config.pad_token_id = policy.generation_config.pad_token_id = pad_id
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1, dtype=torch.float32)
    return {"model": policy, "reward_funcs": [reward]}


def _prompt_dataset(prompts: list[str]) -> Any:
    """Prompts as single user turns: TRL applies the chat template as `colocate.assets.tasks.chat_prompt_ids` does."""
    from datasets import Dataset  # deferred: installed with trl, like it


    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})


# ---------------------------------------------------------------- the run


def run_trl_grpo(actor_path: str, reward_path: str, prompts: list[str], s: GrpoSettings, *, out_dir: Path,
                 threads: int | None = None, progress: Callable[[str], object] | None = None) -> dict[str, Any]:
    """`s.warmup` + `s.updates` GRPO updates in TRL; times, phases, rewards of the last `s.updates`.

    Raises `PeerUnavailable` when trl's GRPOTrainer is not importable, `ValueError` on a
    batch that does not split into groups and minibatches or fewer prompts than the run needs.
    """
    s.check()
    if len(prompts) < s.prompts:
        raise ValueError(f"need {s.prompts} prompts ({s.warmup + s.updates} updates × "
                         f"{s.batch_size // s.group_size} groups), got {len(prompts)}")
    version, config_cls, trainer_cls = _import_trl()
    seed_and_threads(s.seed, threads)
    tokenizer, reward_tokenizer = load_tokenizer(actor_path), load_tokenizer(reward_path)
    clock = GrpoClock()
    trainer = trainer_cls(
        args=_grpo_config(config_cls, Path(out_dir), s), processing_class=tokenizer,
        reward_processing_classes=[reward_tokenizer], train_dataset=_prompt_dataset(prompts[: s.prompts]),
        callbacks=[_UpdateTimer(clock, s.steps_per_update, s.batch_size, progress)],
        **_load_models(actor_path, reward_path, tokenizer.pad_token_id))
    train_timed(trainer, lambda t: _attach_hooks(t, clock))
    settings = {**dataclasses.asdict(s), "threads": torch.get_num_threads(), "pad_token": tokenizer.pad_token,
                "dtype": "bfloat16" if s.bf16 else "float32", "mixed_precision": trainer.accelerator.mixed_precision}
    return {"trainer": "grpo", "group_size": s.group_size, **summary(clock.records, version, settings, PHASES)}


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = common_parser("python -m colocate.bench.peers.trl_grpo", __doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=GrpoSettings.group_size,
                   help="completions per prompt (TRL's num_generations); --batch counts completions")
    p.add_argument("--beta", type=float, default=DEFAULT_BETA,
                   help=f"KL coefficient (default: colocate's ppo.kl_coef, {DEFAULT_BETA})")
    a = p.parse_args(argv)
    s = GrpoSettings(batch_size=a.batch, group_size=a.group_size, max_new_tokens=a.new_tokens, updates=a.updates,
                     warmup=a.warmup, epochs=a.epochs, minibatches=a.minibatches, beta=a.beta, seed=a.seed,
                     stop_at_eos=a.stop_at_eos, bf16=a.bf16, micro_batch=a.micro_batch)
    return run_cli("trl_grpo", a, lambda progress: run_trl_grpo(
        a.actor, a.reward, prompt_texts(a.source, s.prompts, a.seed), s, out_dir=a.out, threads=a.threads,
        progress=progress))


if __name__ == "__main__":
    skip_last_collection()
    sys.exit(main())
