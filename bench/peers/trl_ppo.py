"""TRL's classic PPO (trl 1.12.0, `trl.experimental.ppo`) as the benchmark's throughput peer.

Owns: running TRL's `PPOTrainer` on the same actor, reward model, chat-formatted prompts
and batch as colocate, and timing it. Policy, reference and value model come from the
actor folder (the value model is a one-label `AutoModelForSequenceClassification` on the
actor's weights), the reward model from its folder, all loaded in fp32. They run where accelerate
puts them: the CPU here (TRL's PPO builds its own `Accelerator` and ignores `use_cpu`, so
a CUDA machine would run it on the GPU). Each update's wall time comes from trainer
events; its phases from forward hooks on the four models: generate, ref, values, reward,
advantages (the rest of the scoring window: logprobs, GAE, whitening) and train, which
add up to the update. Warm-up updates (default 1) run first and are left out of the
numbers, as colocate's bench does. `python -m colocate.bench.peers.trl_ppo` writes
`trl_result.json`; the bench runs it in a subprocess, so the peer has its own threads
and memory. trl is imported only when a run starts. Also owns what `bench.peers.trl_grpo`
shares: the pad-token choice (`load_tokenizer`), prompt loading (`prompt_texts`), the
update clock (`Clock`, `timed`), `seed_and_threads`, the result (`summary`) and the CLI's
common options and one-line errors (`common_parser`, `run_cli`).

Settings chosen for a like-for-like run: the precision colocate's trainer computes in
(float32 by default; ``--bf16``: TRL's ``bf16=True``, autocast over float32 weights, as
colocate's ``models.dtype=bfloat16`` mixes over float32 master weights), gradient
checkpointing off (TRL turns it on by default; colocate trains without); a pad token distinct
from EOS (SmolLM2 uses <|im_end|> for both, and TRL masks every pad-valued token,
including the prompt's turn ends); one optimizer step per minibatch (per-device batch =
the whole batch, no gradient accumulation: with accumulation, accelerate would merge the
minibatches into one step); generation of the whole batch at once; responses run to
`max_new_tokens` unless `stop_at_eos` (TRL's default, and the bench's fixed-length
workloads); no sample generations, evaluation or saving.

Left out: TRL's other trainers (GRPO: `bench.peers.trl_grpo`; RLOO), multi-process or GPU
launch through accelerate, and comparisons of quality. Only throughput and the reward
trace come back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PrinterCallback, TrainerCallback

from colocate.errors import USER_ERRORS, ColocateError, ModelSourceError
from colocate.quick_exit import skip_last_collection

TRL_VERSION = "1.12.0"
INSTALL_HINT = "pip install 'colocate[bench]'"
RESULT_NAME = "trl_result.json"
PAD_CANDIDATES = ("<|endoftext|>", "<|pad|>", "<pad>", "<unk>")
FORWARDS = ("ref", "values", "reward")
PHASES = ("generate", *FORWARDS, "advantages", "train")


class PeerUnavailable(ColocateError):
    """A TRL trainer the bench compares against cannot be imported (trl missing, or a version without it)."""


# ---------------------------------------------------------------- timing


@dataclasses.dataclass
class Clock:
    """Marks of the update in progress, filled by model hooks and trainer events; finished updates.

    `phases` splits an update into PPO's phases; `bench.peers.trl_grpo` overrides it for GRPO's."""

    start: float = 0.0
    first: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> when it first began
    busy: dict[str, float] = dataclasses.field(default_factory=dict)  # model -> summed forward seconds
    entered: dict[str, float] = dataclasses.field(default_factory=dict)  # model -> start of its forward
    context_length: int | None = None  # padded prompt length of this update's batch
    response_tokens: int = 0
    reward_mean: float | None = None
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def begin(self, now: float) -> None:
        self.start, self.context_length, self.response_tokens, self.reward_mean = now, None, 0, None
        self.first, self.busy, self.entered = {}, {}, {}

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        self.first.setdefault(name, now)
        self.entered[name] = now

    def leave(self, name: str) -> None:
        self.busy[name] = self.busy.get(name, 0.0) + time.perf_counter() - self.entered.pop(name)

    def phases(self, now: float) -> dict[str, float]:
        """The update's phases, adding up to ``now - start``."""
        scored, trained = self.first.get("ref", now), self.first.get("train", now)
        forwards = {name: self.busy.get(name, 0.0) for name in FORWARDS}
        return {"generate": scored - self.start, **forwards,
                "advantages": trained - scored - sum(forwards.values()), "train": now - trained}

    def finish(self, now: float) -> None:
        self.records.append({"seconds": now - self.start, "phases": self.phases(now),
                             "response_tokens": self.response_tokens, "reward_mean": self.reward_mean})

    def cut(self, update: int, updates: int, progress: Callable[[str], object] | None) -> None:
        """End update ``update`` of ``updates`` now, begin the next; one progress line."""
        now = time.perf_counter()
        self.finish(now)
        self.begin(now)
        if progress is not None:
            last = self.records[-1]
            phases = " ".join(f"{k} {v:.1f}" for k, v in last["phases"].items())
            progress(f"update {update}/{updates}: {last['seconds']:.1f} s ({phases})")


class _UpdateTimer(TrainerCallback):
    """Cuts the clock at every update end (TRL's PPO loop emits no step-begin event)."""

    def __init__(self, clock: Clock, progress: Callable[[str], object] | None) -> None:
        self.clock, self.progress = clock, progress

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.begin(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "objective/scores" in logs:
            self.clock.reward_mean = float(logs["objective/scores"])

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.cut(state.global_step, state.max_steps, self.progress)


def _attach_hooks(trainer: Any, clock: Clock) -> list[Any]:
    """Forward hooks on TRL's four models that feed `clock`; returns their handles."""
    wrapper = trainer.accelerator.unwrap_model(trainer.model)  # PolicyAndValueWrapper
    reward_backbone = getattr(trainer.reward_model, trainer.reward_model.base_model_prefix)
    rollout = lambda: not torch.is_grad_enabled()  # noqa: E731  the critic backbone also runs in training
    handles = [*timed(trainer.ref_model, "ref", clock), *timed(reward_backbone, "reward", clock),
               *timed(wrapper.critic_backbone, "values", clock, when=rollout)]

    def prompt_length(module, args, kwargs):  # first policy forward of an update: the prompt prefill
        ids = kwargs.get("input_ids", args[0] if args else None)
        if clock.context_length is None and ids is not None:
            clock.context_length = ids.shape[1]

    def count_response(module, args, kwargs):  # non-pad tokens after the prompt, as the reward model sees them
        mask = kwargs.get("attention_mask")
        if mask is not None and clock.context_length is not None:
            clock.response_tokens += int(mask[:, clock.context_length:].sum())

    handles.append(wrapper.policy.register_forward_pre_hook(prompt_length, with_kwargs=True))
    handles.append(reward_backbone.register_forward_pre_hook(count_response, with_kwargs=True))
    handles.append(wrapper.register_forward_pre_hook(lambda module, args: clock.enter("train")))
    return handles


def timed(module: torch.nn.Module, name: str, clock: Clock, when=lambda: True) -> list[Any]:
    """Hooks that add `module`'s forward seconds to ``clock.busy[name]`` (while `when()` holds); their handles."""
    pre = module.register_forward_pre_hook(lambda m, a: clock.enter(name) if when() else None)
    post = module.register_forward_hook(lambda m, a, o: clock.leave(name) if when() else None)
    return [pre, post]


# ---------------------------------------------------------------- models and trainer


def _import_trl() -> tuple[str, Any, Any]:
    """(trl version, PPOConfig, PPOTrainer), or `PeerUnavailable` with the install hint."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRLExperimentalWarning on import
            import trl
            from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as exc:
        raise PeerUnavailable(f"TRL's classic PPO is not importable ({exc}); {INSTALL_HINT} "
                              f"(needs trl=={TRL_VERSION}: it was removed in 1.13)") from None
    return trl.__version__, PPOConfig, PPOTrainer


def load_tokenizer(actor_path: str) -> Any:
    """The actor's tokenizer, left-padded, with a pad token that is not EOS (no new embeddings)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(actor_path, padding_side="left")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        vocab = tokenizer.get_vocab()
        distinct = [t for t in PAD_CANDIDATES if t in vocab and vocab[t] != tokenizer.eos_token_id]
        if not distinct:
            raise ModelSourceError(f"{actor_path}: tokenizer pads with EOS and has none of {PAD_CANDIDATES} "
                                   "to pad with instead; TRL's PPO would mask the prompt's EOS tokens")
        tokenizer.pad_token = distinct[0]
    return tokenizer


def _load_models(actor_path: str, reward_path: str, pad_id: int) -> dict[str, Any]:
    """Policy, reference, value (actor weights + a fresh one-label head) and reward model, fp32."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    causal = lambda: AutoModelForCausalLM.from_pretrained(actor_path, dtype=torch.float32)  # noqa: E731
    models = {"model": causal(), "ref_model": causal(),
              "value_model": AutoModelForSequenceClassification.from_pretrained(
                  actor_path, num_labels=1, dtype=torch.float32),
              "reward_model": AutoModelForSequenceClassification.from_pretrained(
                  reward_path, num_labels=1, dtype=torch.float32)}
    for model in models.values():
        model.config.pad_token_id = pad_id
    models["model"].generation_config.pad_token_id = pad_id
    return models


def _prompt_dataset(tokenizer: Any, prompts: list[str]) -> Any:
    """Prompts as chat-formatted token ids, tokenized exactly as colocate does."""
    from datasets import Dataset

    from colocate.assets.tasks import chat_prompt_ids

    return Dataset.from_dict({"input_ids": [chat_prompt_ids(tokenizer, p) for p in prompts]})


def peer_micro_batch(minibatch: int, tokens_per_sample: int, token_budget: int) -> int:
    """Samples per forward pass of a TRL peer: the most that divide ``minibatch`` and fit
    ``token_budget`` tokens of ``tokens_per_sample`` each (at least 1), as colocate's trainer
    packs ``ppo.micro_batch_tokens`` per micro-batch. On an H100 TRL's GRPO ran out of memory
    on its 32-sample minibatches of 1,024-token responses (18.6 GiB of float32 logits over a
    151,936-token vocabulary in one forward); colocate's trainer took 29.5 GiB at its peak."""
    fit = max(1, token_budget // max(tokens_per_sample, 1))
    return max(d for d in range(1, minibatch + 1) if minibatch % d == 0 and d <= fit)


def _ppo_config(config_cls: Any, out_dir: Path, *, batch_size: int, max_new_tokens: int, updates: int,
                epochs: int, minibatches: int, seed: int, stop_at_eos: bool, bf16: bool = False,
                micro_batch: int = 0) -> Any:
    return config_cls(
        output_dir=str(out_dir / "trl"), report_to=[], use_cpu=not torch.cuda.is_available(), bf16=bf16, fp16=False,
        gradient_checkpointing=False, seed=seed, data_seed=seed,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=1,
        num_mini_batches=minibatches, num_ppo_epochs=epochs, total_episodes=updates * batch_size,
        local_rollout_forward_batch_size=micro_batch or batch_size, response_length=max_new_tokens, temperature=1.0,
        stop_token="eos" if stop_at_eos else None, num_sample_generations=0,
        eval_strategy="no", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )


# ---------------------------------------------------------------- the run


def run_trl_ppo(actor_path: str, reward_path: str, prompts: list[str], *, batch_size: int, max_new_tokens: int,
                updates: int, epochs: int = 1, minibatches: int = 2, seed: int = 0, threads: int | None = None,
                out_dir: Path, stop_at_eos: bool = False, warmup: int = 1, bf16: bool = False,
                micro_batch: int = 0, progress: Callable[[str], object] | None = None) -> dict[str, Any]:
    """`warmup` + `updates` PPO updates of `batch_size` prompts in TRL; times, phases, rewards of the last `updates`.

    The warm-up updates (first-call costs) are run and timed but left out of every
    statistic, as colocate's bench leaves out its own warm-up step.

    Raises `PeerUnavailable` when trl 1.12.0 is not installed, `ValueError` on a batch
    that does not split into `minibatches` or fewer prompts than one batch. ``micro_batch``
    (0: the whole batch): samples per forward pass of the rollout's scoring (policy,
    reference, value, reward); TRL's PPO ties gradient accumulation to its batch, so its
    training passes stay one per minibatch.
    """
    if batch_size % minibatches or len(prompts) < batch_size or min(updates, epochs) < 1 or warmup < 0:
        raise ValueError(f"need batch_size ({batch_size}) divisible by minibatches ({minibatches}), at least "
                         f"one batch of prompts (got {len(prompts)}), updates and epochs >= 1, warmup >= 0")
    version, config_cls, trainer_cls = _import_trl()
    seed_and_threads(seed, threads)  # the seed: the value head's initialisation
    if bf16:  # TRL's PPO builds its Accelerator without mixed_precision: accelerate reads it from here
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"  # this peer's own subprocess
    tokenizer = load_tokenizer(actor_path)
    clock = Clock()
    trainer = trainer_cls(
        args=_ppo_config(config_cls, Path(out_dir), batch_size=batch_size, max_new_tokens=max_new_tokens,
                         updates=warmup + updates, epochs=epochs, minibatches=minibatches, seed=seed,
                         stop_at_eos=stop_at_eos, bf16=bf16, micro_batch=micro_batch),
        processing_class=tokenizer, train_dataset=_prompt_dataset(tokenizer, prompts),
        callbacks=[_UpdateTimer(clock, progress)], **_load_models(actor_path, reward_path, tokenizer.pad_token_id))
    train_timed(trainer, lambda t: _attach_hooks(t, clock))
    settings = {"batch_size": batch_size, "max_new_tokens": max_new_tokens, "epochs": epochs,
                "minibatches": minibatches, "seed": seed, "threads": torch.get_num_threads(),
                "stop_at_eos": stop_at_eos, "pad_token": tokenizer.pad_token, "warmup": warmup,
                "dtype": "bfloat16" if bf16 else "float32", "mixed_precision": trainer.accelerator.mixed_precision}
    return summary(clock.records, version, settings)


def seed_and_threads(seed: int, threads: int | None) -> None:
    """Seed torch and give it `threads` threads (None or 0: torch's choice)."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def train_timed(trainer, attach_hooks: Callable[[Any], list]) -> None:
    """``trainer.train()`` with the phase hooks ``attach_hooks(trainer)`` puts on its models
    (removed afterwards) and without TRL's printer (it prints every log dict to stdout)."""
    trainer.remove_callback(PrinterCallback)
    handles = attach_hooks(trainer)
    try:
        trainer.train()
    finally:
        for handle in handles:
            handle.remove()


def summary(records: list[dict[str, Any]], version: str, settings: dict[str, Any],
            phases: tuple[str, ...] = PHASES) -> dict[str, Any]:
    """The result of a run from its updates' records, the `settings["warmup"]` first left out."""
    warm, records = records[: settings["warmup"]], records[settings["warmup"]:]
    seconds = [r["seconds"] for r in records]
    batch = settings["batch_size"]
    return {
        "warmup_update_seconds": [r["seconds"] for r in warm],
        "updates": len(records),
        "update_seconds": seconds,
        "trained_samples_per_s": statistics.median(batch / s for s in seconds),
        "response_tokens_per_s": statistics.median(r["response_tokens"] / r["seconds"] for r in records),
        "response_tokens": [r["response_tokens"] for r in records],
        "phase_seconds": {p: [r["phases"][p] for r in records] for p in phases},
        "rss_gb_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,  # Linux: KiB
        "reward_mean_per_update": [r["reward_mean"] for r in records],
        "trl_version": version,
        "settings": settings,
    }


# ---------------------------------------------------------------- CLI


def common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every TRL peer's CLI shares (models, batch, length, updates, epochs, ...)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--actor", required=True, help="actor model folder (policy and reference; PPO: the value model too)")
    p.add_argument("--reward", required=True, help="reward model folder (one-label sequence classifier)")
    p.add_argument("--batch", type=int, default=8, help="trained samples per update")
    p.add_argument("--new-tokens", type=int, default=32, help="max new tokens per response")
    p.add_argument("--updates", type=int, default=2, help="measured updates")
    p.add_argument("--warmup", type=int, default=1, help="updates run first and left out of the numbers")
    p.add_argument("--epochs", type=int, default=1, help="passes over each update's batch (colocate's ppo.epochs)")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per epoch")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="samples per forward pass (0: a whole minibatch; see peer_micro_batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--source", default="sentiment-prompts", help="prompt source, as colocate's data.source")
    p.add_argument("--stop-at-eos", action="store_true", help="end responses at EOS (default: full length)")
    p.add_argument("--bf16", action="store_true",
                   help="compute in bfloat16 (TRL's bf16=True: autocast over float32 weights), as colocate's trainer "
                        "does with models.dtype=bfloat16 (default: float32)")
    p.add_argument("--out", required=True, type=Path, help=f"folder for {RESULT_NAME}")
    return p


def prompt_texts(source: str, n: int, seed: int) -> list[str]:
    """The first `n` prompts of colocate's prompt `source`, shuffled under `seed` as colocate draws them."""
    from colocate.assets.tasks import load_prompt_source

    return [p.text for p in load_prompt_source(source, n, seed)]


def run_cli(name: str, a: argparse.Namespace, run: Callable[[Callable[[str], object]], dict[str, Any]]) -> int:
    """`run(progress)` for the peer CLI `name`: the result written to ``<a.out>/trl_result.json`` and
    printed (0), or one line on stderr (2) on a user error (trl missing included), no file."""
    try:
        result = run(lambda line: print(f"{name}: {line}", file=sys.stderr, flush=True))
    except (*USER_ERRORS, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    result["models"] = {"actor": a.actor, "reward": a.reward, "prompt_source": a.source}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / RESULT_NAME).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = common_parser("python -m colocate.bench.peers.trl_ppo", __doc__.splitlines()[0]).parse_args(argv)
    prompts = prompt_texts(a.source, (a.warmup + a.updates) * a.batch, a.seed)
    return run_cli("trl_ppo", a, lambda progress: run_trl_ppo(
        a.actor, a.reward, prompts, batch_size=a.batch, max_new_tokens=a.new_tokens, updates=a.updates,
        epochs=a.epochs, minibatches=a.minibatches, seed=a.seed, threads=a.threads, out_dir=a.out,
        stop_at_eos=a.stop_at_eos, warmup=a.warmup, bf16=a.bf16, micro_batch=a.micro_batch, progress=progress))


if __name__ == "__main__":
    skip_last_collection()
    sys.exit(main())
