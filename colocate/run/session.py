"""What a PPO run holds between steps, and the operations on it.

Owns: :class:`Session` (config, process group, placement, trainer, this rank's engines,
prompts, KL controller, :class:`RunState`), the plain-Python snapshot that lets a failed
rollout checkpoint the last completed step, saving and restoring checkpoints (trainer, KL
controller, weight version, RNG, and every engine rank's prompt stream position and
deferred buffer) and pushing the actor weights into this rank's engine. Leaves out:
construction and start-up order (``colocate.run.builder``), where engines run
(``colocate.run.placement``) and the step itself (``colocate.run.loop``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from colocate.run import checkpoint, rank_rollouts, weight_sync
from colocate import faults
from colocate.config import Config
from colocate.engine.rollout import Sample, group_member, sample_index
from colocate.engine.timeline import mark
from colocate.errors import ConfigError
from colocate.run.placement import Placement
from colocate.run.resume import check_checkpoint
from colocate.rollout.reward_fns import RewardFn, RewardFnErrors
from colocate.rollout.rollout_phase import Prompt, response_budget
from colocate.assets.tasks import chat_prompt_ids
from colocate.run.timesharing import TimeSharing
from colocate.trainer.distributed import all_gather_object


@dataclasses.dataclass
class RunState:
    """Plain-Python progress of a run; saved in every checkpoint."""

    step: int = 0
    data_pos: int = 0  # groups this rank has drawn from its prompt stream
    data_base: int = 0  # where the engine ranks' prompt streams start (Placement.position)
    weight_version: int = 0
    kl: dict[str, Any] = dataclasses.field(default_factory=dict)


def tokenize_prompts(tokenizer, prompts: Sequence[Any], max_tokens: int) -> list[Prompt]:
    """Chat-format and tokenize ``colocate.assets.tasks.Prompt`` items; prompts longer than
    ``max_tokens`` are refused."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = chat_prompt_ids(tokenizer, prompt.text)
        if len(ids) > max_tokens:
            raise ConfigError(
                f"data: prompt {i} has {len(ids)} tokens > data.max_prompt_tokens {max_tokens}; "
                "raise data.max_prompt_tokens or shorten the prompt")
        out.append(Prompt(tuple(ids), dict(prompt.meta)))
    return out


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
    cfg: Config
    dist: Any
    trainer: Any
    actor: Any  # this rank's SglangEngine; None on a rank without engines (Placement.hosts_engines)
    reward_engine: Any
    reward_fns: list[RewardFn]
    tokenizer: Any
    prompts: list[Prompt]
    kl_ctl: Any
    state: RunState
    timesharing: TimeSharing
    out_dir: Path
    log: Callable[[str], None]
    rollouts: Any = None  # colocate.rollout.rollouts.Rollouts on each engine rank (every mode), else None
    phase: str = "idle"  # rollout | train | sync | idle: where a failure happened
    _snapshot: dict[str, Any] | None = None
    on_phase: Callable[[str], None] | None = None  # e.g. a progress bar showing the phase
    eval_prompts: list[Prompt] = dataclasses.field(default_factory=list)  # held out (data.eval_prompts)
    reward_errors: RewardFnErrors = dataclasses.field(default_factory=RewardFnErrors)  # reward.on_error=zero
    placement: Placement = Placement()  # who generates where (one rank: everything here)
    timeline: Any = None  # colocate.engine.timeline.Timeline when run.timeline (rank 0), else None
    _drawn: bool = False  # whether this step drew its first sample (run.fault_at's "generate" point)
    tp_exchange: Any = None  # colocate.run.tp_exchange.TPExchange with engines.tp_size > 1 (every rank), else None
    # builds the rollout phase of a config on this rank's engines (builder.make_rollouts); None without engines
    rollouts_for: Callable[[Config], Any] | None = None

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end a response: the tokenizer's EOS and pad."""
        return stop_ids(self.tokenizer)

    def begin_step(self) -> None:
        """Remember the plain-Python state of the last completed step (cheap), so a failure
        during the rollout can still checkpoint exactly that step."""
        self._snapshot = {
            "run": copy.deepcopy(dataclasses.asdict(self.state)) | {"kl": self.kl_ctl.state_dict()},
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
        if self.on_phase is not None:
            self.on_phase(phase)

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
        """Sample ``index`` (local to this rank): member ``index % n`` of group ``index // n``
        (n = ``rollout.group_size``). The group's first member draws the next prompt of this
        rank's stream (``Placement.position``) through a fixed, seeded cycle over the prompt
        set; the others share it. Each member gets its own token budget (``response_budget``
        at draw ``position * n + member``). Call in ascending index order."""
        if not self._drawn:
            self._drawn = True
            self.fault("engine", self.state.step + 1)
            self.fault("generate", self.state.step + 1)
        n = self.cfg.rollout.group_size
        group, member = group_member(index, n)
        if member == 0:
            self.state.data_pos += 1
        pos = self.placement.position(self.state.data_base, self.state.data_pos - 1)
        prompt = self.prompts[pos % len(self.prompts)]
        budget = response_budget(self.cfg.rollout, self.cfg.run.seed, sample_index(pos, member, n))
        return Sample(index, list(prompt.ids), budget, group=group, record=dict(prompt.record))

    def sync_weights(self) -> float:
        """Push the trainer's actor weights to the engines as a new version (gather + push)."""
        return self.push_weights(self.gather_weights())

    def gather_weights(self) -> weight_sync.Weights:
        """The actor's full weights for the engines. CUDA engines: (name, tensor) pairs made
        one at a time on the device (pushed device to device as they come); otherwise a host
        state dict on every engine rank (on rank 0 alone when only it has engines; {}
        elsewhere). Collective."""
        if self.timesharing.device_push:
            return self.trainer.actor_tensors()
        return self.trainer.actor_state_for_sync(everywhere=self.placement.engine_ranks > 1)

    def sync_mb(self) -> float:
        """MiB each weight sync pushes into an engine, in the engines' dtype (0 on a rank
        without engines)."""
        if self.actor is None:
            return 0.0
        return self.trainer.sync_numel() * torch.finfo(getattr(torch, self.actor.cfg.dtype)).bits / 8 / 2**20

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
        engines = {"actor": self.actor, "reward": self.reward_engine}
        return {role: eng.requests for role, eng in engines.items() if eng is not None}

    def requests_since(self, before: dict[str, int]) -> dict[str, int]:
        """``engine/<role>_requests``: requests sent to each engine since ``before``."""
        return {f"engine/{role}_requests": n - before[role] for role, n in self.engine_requests().items()}

    def save_checkpoint(self) -> Path | None:
        self.state.kl = self.kl_ctl.state_dict()
        return self._save({
            "run": dataclasses.asdict(self.state),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            # the deferred buffer: no partial rollout is lost or duplicated
            "overlap": self.rollouts.state_dict() if self.rollouts is not None else None,
        })

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
        self.state = RunState(**parts["run"])
        self.kl_ctl.load_state_dict(self.state.kl)
        base, states = rank_rollouts.saved_states(parts)
        base, states, note = rank_rollouts.redistribute(base, states, self.placement.engine_ranks,
                                                        self.cfg.rollout.group_size)
        if note is not None:
            self.log(f"resume: {note}")
        own = states[self.placement.engine_rank]
        self.state.data_base, self.state.data_pos = base, own["data_pos"]
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
        resume (the engine restarted at the base weights). Collective: same on every rank."""
        if not resumed and self.dist.device.type != "cuda":
            return
        self.state.weight_version -= 1  # push_weights counts it up again
        self.timesharing.wake_and_sync(self.gather_weights, self.push_weights)

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
        self.sync_weights()
        if self.reward_engine is not None:
            self.reward_engine.flush_cache()
        if self.rollouts_for is not None:
            self.rollouts = self.rollouts_for(cfg)

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
        for eng in (self.reward_engine, self.actor):
            if eng is not None:
                eng.shutdown()
