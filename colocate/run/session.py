"""What a PPO run holds between steps, and the operations that span its owners.

Owns: :class:`Session`, one run on a rank as typed owners, each keeping its own state:
this rank's engines (``RankEngines``), the trainer, the rollout phase (``Rollouts``:
scheduler, deferred buffer, chunk tuner), the prompt stream (``PromptStream``), the KL
controller and :class:`RunState` (step, weight version); and what spans them: phase
changes and their watchers, the plain-Python snapshot that lets a failed rollout
checkpoint the last completed step, saving and restoring checkpoints (trainer, KL
controller, weight version, RNG, and every engine rank's prompt stream position and
deferred buffer), and pushing the actor weights into this rank's engine (also the first
push, when an engine was kept from an earlier run). Leaves out: construction and start-up
order (``colocate.run.builder``), where engines run (``colocate.run.placement``) and the
step itself (``colocate.run.loop``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from colocate.run import checkpoint, rank_rollouts, weight_sync
from colocate import faults
from colocate.config import Config
from colocate.engine.rollout import Sample
from colocate.engine.runtime import SglangEngine
from colocate.engine.timeline import Timeline, mark
from colocate.errors import ConfigError, cause_line
from colocate.run.engines import RankEngines
from colocate.run.placement import Placement
from colocate.run.prompt_stream import PromptStream
from colocate.run.tp_exchange import TPExchange
from colocate.rollout.rollouts import Rollouts
from colocate.run.resume import check_checkpoint
from colocate.rollout.reward_fns import RewardFn, RewardFnErrors
from colocate.rollout.rollout_phase import Prompt
from colocate.assets.tasks import chat_prompt_ids
from colocate.run.timesharing import TimeSharing
from colocate.trainer.distributed import DistInfo, all_gather_object
from colocate.trainer.kl_control import KLController
from colocate.trainer.ppo_trainer import PPOTrainer


@dataclasses.dataclass
class RunState:
    """Plain-Python progress of a run; saved in every checkpoint (with the prompt stream's
    position, ``PromptStream.state_dict``, beside it)."""

    step: int = 0
    weight_version: int = 0
    kl: dict[str, Any] = dataclasses.field(default_factory=dict)


def tokenize_prompts(tokenizer, prompts: Sequence[Any], max_tokens: int) -> list[Prompt]:
    """Chat-format and tokenize ``colocate.assets.tasks.Prompt`` items (their text, or their chat
    messages); prompts longer than ``max_tokens``, or messages the chat template refuses, are
    refused in one line."""
    out = []
    for i, prompt in enumerate(prompts):
        try:
            ids = chat_prompt_ids(tokenizer, prompt.chat)
        except TemplateError as exc:  # e.g. a template without a system turn, or strict user/assistant turns
            roles = ", ".join(m["role"] for m in prompt.messages) or "user"
            why = cause_line(exc, 300) or type(exc).__name__
            raise ConfigError(f"data: prompt {i} (roles {roles}): the actor's chat template refuses it ({why}); "
                              "fix data.prompt_key's messages or use a model whose template takes them") from None
        if len(ids) > max_tokens:
            raise ConfigError(
                f"data: prompt {i} has {len(ids)} tokens > data.max_prompt_tokens {max_tokens}; "
                "raise data.max_prompt_tokens or shorten the prompt")
        out.append(Prompt(tuple(ids), dict(prompt.meta)))
    return out


def decode_text(tokenizer, ids: Sequence[int]) -> str:
    """Text of token ids, special tokens left out (what reward functions read)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS and pad."""
    return [t for t in {tokenizer.eos_token_id, tokenizer.pad_token_id} if t is not None]


def _drain(full: weight_sync.Weights) -> None:
    """Take every all-gather of a lazy device gather (collective) without keeping a tensor."""
    if not isinstance(full, dict):
        for _ in full:
            pass


@dataclasses.dataclass
class Session:
    """One run on this rank: the owners below, each holding its own state, and the
    operations that span them (a checkpoint, a weight push, a phase change)."""

    cfg: Config
    dist: DistInfo
    trainer: PPOTrainer
    engines: RankEngines  # this rank's actor and reward engine (none on a rank without engines)
    reward_fns: list[RewardFn]
    tokenizer: PreTrainedTokenizerBase
    stream: PromptStream  # this rank's training prompts and its position in them
    kl_ctl: KLController
    state: RunState
    timesharing: TimeSharing
    out_dir: Path
    log: Callable[[str], None]
    rollouts: Rollouts | None = None  # the rollout phase on each engine rank (every mode), else None
    phase: str = "idle"  # rollout | train | sync | idle: where a failure happened
    _snapshot: dict[str, Any] | None = None
    _phase_watchers: list[Callable[[str], None]] = dataclasses.field(default_factory=list)
    eval_prompts: list[Prompt] = dataclasses.field(default_factory=list)  # held out (data.eval_prompts)
    reward_errors: RewardFnErrors = dataclasses.field(default_factory=RewardFnErrors)  # reward.on_error=zero
    placement: Placement = Placement()  # who generates where (one rank: everything here)
    timeline: Timeline | None = None  # rank 0's per-request timeline when run.timeline, else None
    _drawn: bool = False  # whether this step drew its first sample (run.fault_at's "generate" point)
    tp_exchange: TPExchange | None = None  # with engines.tp_size > 1 (every rank), else None
    # builds the rollout phase of a config on this rank's engines (builder.make_rollouts); None without engines
    rollouts_for: Callable[[Config], Rollouts] | None = None

    @property
    def actor(self) -> SglangEngine | None:
        """This rank's actor engine; None on a rank without engines (``Placement.hosts_engines``)."""
        return self.engines.actor

    @property
    def reward_engine(self) -> SglangEngine | None:
        """This rank's inline reward engine; None with rule rewards only or the feeder's process."""
        return self.engines.reward

    def watch_phases(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(phase)`` at every phase change (e.g. a progress bar)."""
        self._phase_watchers.append(callback)

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end a response: the tokenizer's EOS and pad."""
        return stop_ids(self.tokenizer)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens left out (`decode_text`)."""
        return decode_text(self.tokenizer, ids)

    def begin_step(self) -> None:
        """Remember the plain-Python state of the last completed step (cheap), so a failure
        during the rollout can still checkpoint exactly that step."""
        self._snapshot = {
            "run": copy.deepcopy(self._run_state()) | {"kl": self.kl_ctl.state_dict()},
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "overlap": self.rollouts.state_dict() if self.rollouts is not None else None,
        }
        self._drawn = False
        if self.timeline is not None:
            self.timeline.step = self.state.step + 1
        self.set_phase("rollout")

    def fault(self, point: str, step: int) -> None:
        """``run.fault_at``'s test hook (``colocate.faults``): nothing unless it names this
        point of ``step``."""
        if self.cfg.run.fault_at:
            pids = self.actor.child_pids if point == "engine" and self.actor is not None else ()
            faults.fire(self.cfg.run.fault_at, self.cfg.run.fault_action, point, step, self.dist.rank,
                        self.out_dir, pids)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        mark(self.timeline, phase)
        for watch in self._phase_watchers:
            watch(phase)

    def save_after_failure(self) -> Path | None:
        """Checkpoint the last completed step after a failure. During the rollout the
        trainer has not moved yet: save it with the step's starting snapshot (the deferred
        buffer as it was). Later (training done: the weight sync, or the held-out evaluation
        after a step), save the current state as one more step. During training: nothing
        (the trainer is half-updated; the last checkpoint stays)."""
        if self.phase == "rollout" and self._snapshot is not None:
            return self._save(self._snapshot)
        if self.phase in ("sync", "eval"):
            return self.save_checkpoint()
        return None

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    def new_sample(self, index: int) -> Sample:
        """Sample ``index`` of this rank's prompt stream (``PromptStream.sample``); the
        step's first draw is ``run.fault_at``'s "engine" and "generate" points. Call in
        ascending index order."""
        if not self._drawn:
            self._drawn = True
            self.fault("engine", self.state.step + 1)
            self.fault("generate", self.state.step + 1)
        return self.stream.sample(index)

    def sync_weights(self) -> float:
        """Push the trainer's actor weights to the engines as a new version (gather + push),
        the whole model (the first push of a run)."""
        return self.push_weights(self.gather_weights(first=True))

    def gather_weights(self, first: bool = False) -> weight_sync.Weights:
        """The actor's full weights for the engines. CUDA engines: (name, tensor) pairs made
        one at a time on the device (pushed device to device as they come); otherwise a host
        state dict on every engine rank (on rank 0 alone when only it has engines; {}
        elsewhere). Collective. A LoRA actor's step pushes carry the adapted linears only
        (:meth:`adapted_only`)."""
        adapted_only = self.adapted_only(first)
        if self.timesharing.device_push:
            return self.trainer.actor_tensors(adapted_only)
        return self.trainer.actor_state_for_sync(everywhere=self.placement.engine_ranks > 1, adapted_only=adapted_only)

    def adapted_only(self, first: bool = False) -> bool:
        """Whether a push may leave out a LoRA actor's frozen base (embeddings, norms, LM
        head, linears without adapters): only where the engine still holds it. Not at a
        run's ``first`` push (an engine kept from an earlier run serves that run's weights,
        a resumed one the base's), nor with CUDA engines, whose weights are released without
        a host copy at every sleep and so are undefined after each wake (the whole model is
        pushed then: measured on an H100 for full fine-tuning, 0.09-0.14 s per step for
        SmolLM2's 311 MB; a host copy would cost the same bytes over PCIe twice a step)."""
        return not first and not self.timesharing.device_push

    def sync_mb(self) -> float:
        """MiB each weight sync pushes into an engine, in the engines' dtype (0 on a rank
        without engines)."""
        if self.actor is None:
            return 0.0
        bits = torch.finfo(getattr(torch, self.actor.cfg.dtype)).bits
        return self.trainer.sync_numel(self.adapted_only()) * bits / 8 / 2**20

    def push_weights(self, full: weight_sync.Weights) -> float:
        """Load ``full`` (``gather_weights``) into this rank's engine as the next weight
        version; returns the engine's seconds (0 on a rank without engines, which still
        takes its part in a lazy gather and, in a tensor-parallel group, serves its own
        copy of every bucket to the TP rank on its GPU)."""
        self.state.weight_version += 1
        self.fault("sync", self.state.step)
        tp = self.tp_exchange if self.timesharing.device_push else None  # a device push: every rank holds the tensors
        mb = self.cfg.engines.sync_bucket_mb
        if self.actor is None and tp is None:
            _drain(full)
            return 0.0
        try:
            if self.actor is None:
                weight_sync.serve(tp, full, mb)
                return 0.0
            return weight_sync.sync(self.actor, full, self.state.weight_version, mb, tp)
        except BaseException:
            with contextlib.suppress(Exception):  # a push that failed midway still takes the rest of the
                _drain(full)  # gather's collectives, so the ranks can agree on the failure after it
            raise

    def engine_requests(self) -> dict[str, int]:
        """Requests sent so far to this rank's actor and (inline) reward engine."""
        return self.engines.requests()

    def requests_since(self, before: dict[str, int]) -> dict[str, int]:
        """``engine/<role>_requests``: requests sent to each engine since ``before``."""
        return {f"engine/{role}_requests": n - before[role] for role, n in self.engine_requests().items()}

    def save_checkpoint(self) -> Path | None:
        self.state.kl = self.kl_ctl.state_dict()
        return self._save({
            "run": self._run_state(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            # the deferred buffer: no partial rollout is lost or duplicated
            "overlap": self.rollouts.state_dict() if self.rollouts is not None else None,
        })

    def _run_state(self) -> dict[str, Any]:
        """The checkpoint's "run" part: the run's progress and this rank's stream position."""
        return dataclasses.asdict(self.state) | self.stream.state_dict()

    def _save(self, plain: dict[str, Any]) -> Path | None:
        trainer_state = self.trainer.state_dict()  # collective: every rank takes part
        own = rank_rollouts.rank_state(plain["run"]["data_pos"], plain["overlap"]) if self.actor is not None else None
        ranks = [r for r in all_gather_object(own, self.dist) if r is not None]  # every engine rank's stream and buffer
        if not self.is_main:
            return None
        parts = {"trainer": trainer_state, "run": plain["run"], "rng": plain["rng"],
                 "rollout": {"base": plain["run"]["data_base"], "ranks": ranks}}
        meta = {"models": dataclasses.asdict(self.cfg.models)}  # a resume names the checkpoint's models
        step = plain["run"]["step"]
        return checkpoint.save(self.out_dir / "checkpoints", step, parts, keep=self.cfg.run.keep_checkpoints,
                               meta=meta, before_commit=lambda: self.fault("checkpoint", step))

    def restore(self, path: Path) -> None:
        where = checkpoint.latest(path)
        step, parts = checkpoint.load(where)
        live = self.trainer.saved_shapes()  # no critic: critic-free; LoRA: the trainable tensors
        check_checkpoint(where, parts, live, self.cfg)  # one line, not torch's traceback, on other models
        self.trainer.load_state_dict(parts["trainer"])
        fields = {f.name for f in dataclasses.fields(RunState)}
        self.state = RunState(**{k: v for k, v in parts["run"].items() if k in fields})
        self.kl_ctl.load_state_dict(self.state.kl)
        base, states = rank_rollouts.saved_states(parts)
        base, states, note = rank_rollouts.redistribute(base, states, self.placement.engine_ranks,
                                                        self.cfg.rollout.group_size)
        if note is not None:
            self.log(f"resume: {note}")
        own = states[self.placement.engine_rank]
        self.stream.load_state_dict({"data_base": base, "data_pos": own["data_pos"]})
        if self.rollouts is not None and own["overlap"] is not None:  # None: a sequential run before 2026-11-25
            self.rollouts.load_state_dict(own["overlap"])
        random.setstate(parts["rng"]["python"])
        torch.set_rng_state(parts["rng"]["torch"])
        self.log(f"resumed from step {step}")

    def wake_engines(self, resumed: bool) -> None:
        """Make the engines serve the trainer's weights at the current version, once, after
        start-up (and a resume). CUDA: the engines released their memory right after they
        started (``timesharing.release``) and the actor's weights without a host copy, so
        offload the trainer, wake the engines and push the weights. CPU: push only after a
        resume (the engine started at the base weights) or when an engine was kept from an
        earlier run (``engine.pool``: it serves that run's weights). Collective: same on
        every rank."""
        kept = self.engines.reused
        if self.dist.world_size > 1:
            kept = any(all_gather_object(kept, self.dist))
        if not resumed and not kept and self.dist.device.type != "cuda":
            return
        self.state.weight_version -= 1  # push_weights counts it up again
        self.timesharing.wake_and_sync(lambda: self.gather_weights(first=True), self.push_weights)

    def restart(self, cfg: Config, trainer_state: dict[str, Any], kl_state: dict[str, Any]) -> None:
        """Back to step 0 under ``cfg`` on the same models and engines (the bench runs its
        modes side by side this way): ``trainer_state`` and ``kl_state`` loaded, the weights
        pushed as the next version, the reward engine's radix cache flushed, the rollout
        phase built afresh for ``cfg``'s mode exactly as ``colocate train`` builds it."""
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
        self.cfg = cfg
        self.trainer.load_state_dict(trainer_state)
        self.kl_ctl.load_state_dict(kl_state)
        self.state = RunState(weight_version=self.state.weight_version)
        self.stream.load_state_dict({"data_base": 0, "data_pos": 0})
        self.sync_weights()
        if self.reward_engine is not None:
            self.reward_engine.flush_cache()
        if self.rollouts_for is not None:
            self.rollouts = self.rollouts_for(cfg)

    def close(self) -> None:
        """End the run's rollout phase and hand the engines back (shut down, or kept by
        the pool they came from)."""
        if self.rollouts is not None:
            self.rollouts.close()
        self.engines.close()
