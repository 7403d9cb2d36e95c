"""What a PPO run holds between steps, and the operations that span its owners.

Owns: :class:`Session`, one run on a rank as eight owners, each keeping its own state:
the config, the process group, the trainer, this rank's engines (``RankEngines``: where
they run, their time-sharing with the trainer, the tensor-parallel exchange), its data
source (``DataSource``: prompts, position, deferred samples), its rollout phase
(``Rollouts``: Δ controller, chunk tuner, feeder), the run's progress (:class:`RunState`:
step, weight version, KL controller, phase) and what the run reads and writes
(:class:`RunContext`); and what spans them: the plain-Python snapshot that lets a failed
rollout checkpoint the last completed step, a checkpoint as those owners' states side by
side (every engine rank's data source and rollout phase, in the one layout of
``colocate.run.checkpoint_layout``), and pushing the actor weights into this
rank's engine (also the first push, when an engine was kept from an earlier run). Leaves
out: construction and start-up order (``colocate.run.builder``), where engines run
(``colocate.run.placement``) and the step itself (``colocate.run.loop``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from colocate.run import checkpoint, checkpoint_layout, weight_sync
from colocate import faults
from colocate.config import Config
from colocate.engine.runtime import SglangEngine
from colocate.monitor.timeline import Timeline, mark
from colocate.errors import ConfigError, cause_line
from colocate.run.engines import RankEngines
from colocate.rollout import data_source
from colocate.rollout.data_source import DataSource, TokenizedPrompt
from colocate.rollout.rollouts import Rollouts
from colocate.run.resume import check_checkpoint, fingerprints
from colocate.run.run_folder import RunFolder
from colocate.rollout.reward_fns import RewardFn, RewardFnErrors
from colocate.assets.prompt_chars import JOINED, CharLimit, char_limit
from colocate.assets.tasks import chat_prompt_ids, raw_prompt_ids
from colocate.trainer.distributed import DistInfo, all_gather_object
from colocate.trainer.kl_control import KLController
from colocate.trainer.ppo_trainer import PPOTrainer


@dataclasses.dataclass
class RunState:
    """The run's progress and where it is: steps done, the weight version the engines serve,
    the KL controller, the phase (rollout | train | sync | eval | idle: where a failure
    happened; watchers are told of each change) and the last completed step's plain-Python
    snapshot (:meth:`Session.begin_step`). Its checkpoint part: step, version, KL."""

    kl_ctl: KLController
    step: int = 0
    weight_version: int = 0
    phase: str = "idle"
    watchers: list[Callable[[str], None]] = dataclasses.field(default_factory=list)
    snapshot: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weight_version": self.weight_version, "kl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.kl_ctl.load_state_dict(state["kl"])


@dataclasses.dataclass
class RunContext:
    """What the run reads and writes: the actor's tokenizer, the reward functions (and their
    error count, ``reward.on_error=zero``), the run folder (and its hold,
    ``colocate.run.run_folder``), the log, rank 0's rollout timeline (``run.timeline``) and
    how a rollout phase is built for a config on this rank's engines
    (``builder.make_rollouts``; None without engines)."""

    tokenizer: PreTrainedTokenizerBase
    out_dir: Path
    log: Callable[[str], None] = print
    reward_fns: list[RewardFn] = dataclasses.field(default_factory=list)
    reward_errors: RewardFnErrors = dataclasses.field(default_factory=RewardFnErrors)
    timeline: Timeline | None = None
    rollouts_for: Callable[[Config], Rollouts] | None = None
    folder: RunFolder | None = None  # the run folder held for the run (rank 0 of api.train), let go at close


def tokenize_prompts(tokenizer, prompts: Sequence[Any], max_tokens: int, chat: bool = True, *,
                     drop_overlong: bool = False) -> list[TokenizedPrompt]:
    """Chat-format and tokenize ``colocate.assets.tasks.Prompt`` items (their text, or their chat
    messages; ``chat`` False, ``data.apply_chat_template=false``: the text as it is). Prompts
    longer than ``max_tokens`` are refused in one line naming the first, how many there are and
    the longest (``drop_overlong``, ``data.filter_overlong_prompts``: left out); one with more
    characters than that many tokens can hold is not tokenized (``colocate.assets.prompt_chars``:
    refused at once, or left out). Messages the chat template refuses are refused in one line
    naming the row, and so is a tokenizer without a chat template where one is needed."""
    if chat and prompts and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("models.actor: its tokenizer has no chat template (a base model?), and prompts are put in "
                          "one (data.apply_chat_template=true); set data.apply_chat_template=false to train on the "
                          "prompt text as it is, or use a model whose tokenizer_config.json has a chat_template")
    out, limit = [], char_limit(tokenizer, max_tokens)
    over: list[tuple[str, int]] = []  # (name, tokens) of those longer
    for i, prompt in enumerate(prompts):
        name = f"prompt {i}" + (f" ({prompt.where})" if prompt.where else "")
        chars = limit.over(prompt.contents) if limit is not None else 0
        if chars:
            if not drop_overlong:
                raise ConfigError(_chars_line(limit, name, chars))
            continue
        if not chat and prompt.messages:
            raise ConfigError(f"data: {name} is chat messages, which only a chat template can format; set "
                              "data.apply_chat_template=true, or give data.prompt_key a column of text prompts")
        try:
            ids = chat_prompt_ids(tokenizer, prompt.chat) if chat else raw_prompt_ids(tokenizer, prompt.text)
        except TemplateError as exc:  # e.g. a template without a system turn, or strict user/assistant turns
            roles = ", ".join(m["role"] for m in prompt.messages) or "user"
            why = cause_line(exc, 300) or type(exc).__name__
            where = f"{prompt.where}, " if prompt.where else ""
            raise ConfigError(f"data: prompt {i} ({where}roles {roles}): the actor's chat template refuses it ({why}); "
                              "fix data.prompt_key's messages or use a model whose template takes them") from None
        if len(ids) > max_tokens:
            over.append((name, len(ids)))
            continue
        out.append(TokenizedPrompt(tuple(ids), dict(prompt.meta)))
    if over and not drop_overlong:
        raise ConfigError(_overlong_line(over, len(prompts), max_tokens))
    return out


def _overlong_line(over: Sequence[tuple[str, int]], total: int, max_tokens: int) -> str:
    """The one line of prompts longer than ``max_tokens``: the first, how many, the longest."""
    name, n = over[0]
    longest = max(over, key=lambda x: x[1])
    more = f" ({len(over)} of {total} prompts are longer; the longest tokenized, {longest[0]}, has {longest[1]})" \
        if len(over) > 1 else ""
    return (f"data: {name} has {n} tokens > data.max_prompt_tokens {max_tokens}{more}; raise data.max_prompt_tokens "
            f"to {longest[1]}, shorten the prompts, or leave them out with data.filter_overlong_prompts=true")


def _chars_line(limit: CharLimit, name: str, chars: int) -> str:
    """The one line of a prompt whose characters are more than ``limit.max_tokens`` tokens can hold, untokenized."""
    return (f"data: {name} has {chars} characters besides whitespace > {limit.chars} (data.max_prompt_tokens "
            f"{limit.max_tokens} × {limit.per_token}, the longest token of the actor's tokenizer, × {JOINED}): more "
            f"than {limit.max_tokens} tokens, refused before tokenizing; raise data.max_prompt_tokens or shorten the "
            "prompt")


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
    data: DataSource  # this engine rank's prompts, position and deferred samples
    rollouts: Rollouts | None  # the rollout phase on each engine rank (every mode), else None
    state: RunState
    run: RunContext

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
        self.state.watchers.append(callback)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens left out (`decode_text`)."""
        return decode_text(self.run.tokenizer, ids)

    def log(self, message: str) -> None:
        self.run.log(message)

    def begin_step(self) -> Callable[[str, str], None]:
        """Remember the plain-Python state of the last completed step (cheap), so a failure
        during the rollout can still checkpoint exactly that step; returns this run's hook
        for the step's phase boundaries (``colocate.run.loop.StepPhases``)."""
        self.state.snapshot = copy.deepcopy(self._plain_parts())
        step = self.state.step + 1
        if self.run.timeline is not None:
            self.run.timeline.step = step
        return functools.partial(self._at_boundary, step)

    def _at_boundary(self, step: int, event: str, phase: str) -> None:
        """Step ``step``'s hook: the run's phase (its record, watchers, timeline) and
        ``run.fault_at``'s faults at the boundaries they name (``faults.AT_BOUNDARY``)."""
        if event == "enter":
            self.set_phase(phase)
        for point in faults.AT_BOUNDARY.get((event, phase), ()):
            self.fault(point, step)

    def fault(self, point: str, step: int) -> None:
        """``run.fault_at``'s test hook (``colocate.faults``): nothing unless it names this
        point of ``step``."""
        if self.cfg.run.fault_at:
            pids = self.actor.child_pids if point == "engine" and self.actor is not None else ()
            faults.fire(self.cfg.run.fault_at, self.cfg.run.fault_action, point, step, self.dist.rank,
                        self.run.out_dir, pids)

    def set_phase(self, phase: str) -> None:
        self.state.phase = phase
        mark(self.run.timeline, phase)
        for watch in self.state.watchers:
            watch(phase)

    def save_after_failure(self) -> Path | None:
        """Checkpoint the last completed step after a failure. During the rollout the
        trainer has not moved yet: save it with the step's starting snapshot (the deferred
        samples as they were). Later (training done: the weight sync, or the held-out
        evaluation after a step), save the current state as one more step. During training:
        nothing (the trainer is half-updated; the last checkpoint stays)."""
        if self.state.phase == "rollout" and self.state.snapshot is not None:
            return self._save(self.state.snapshot)
        if self.state.phase in ("sync", "eval"):
            return self.save_checkpoint()
        return None

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    def sync_weights(self) -> float:
        """Push the trainer's actor weights to the engines as a new version (gather + push),
        the whole model (the first push of a run)."""
        self.state.weight_version += 1
        return self.push_weights(self.gather_weights(first=True))

    def gather_weights(self, first: bool = False) -> weight_sync.Weights:
        """The actor's full weights for the engines. CUDA engines: (name, tensor) pairs made
        one at a time on the device (pushed device to device as they come); otherwise a host
        state dict on every engine rank (on rank 0 alone when only it has engines; {}
        elsewhere). Collective. A LoRA actor's step pushes carry the adapted linears only
        (:meth:`adapted_only`)."""
        adapted_only = self.adapted_only(first)
        if self.engines.sharing.device_push:
            return self.trainer.actor_tensors(adapted_only)
        return self.trainer.actor_state_for_sync(everywhere=self.engines.placement.engine_ranks > 1,
                                                 adapted_only=adapted_only)

    def adapted_only(self, first: bool = False) -> bool:
        """Whether a push may leave out a LoRA actor's frozen base (embeddings, norms, LM
        head, linears without adapters): only where the engine still holds it. Not at a
        run's ``first`` push (an engine kept from an earlier run serves that run's weights,
        a resumed one the base's), nor with CUDA engines, whose weights are released without
        a host copy at every sleep and so are undefined after each wake (the whole model is
        pushed then: measured on an H100 for full fine-tuning, 0.09-0.14 s per step for
        SmolLM2's 311 MB; a host copy would cost the same bytes over PCIe twice a step)."""
        return not first and not self.engines.sharing.device_push

    def sync_mb(self) -> float:
        """MiB each weight sync pushes into an engine, in the engines' dtype (0 on a rank
        without engines)."""
        if self.actor is None:
            return 0.0
        bits = torch.finfo(getattr(torch, self.actor.cfg.dtype)).bits
        return self.trainer.sync_numel(self.adapted_only()) * bits / 8 / 2**20

    def push_weights(self, full: weight_sync.Weights) -> float:
        """Load ``full`` (``gather_weights``) into this rank's engine under the run's weight
        version (a step counts it up before its sync, ``colocate.run.loop``); returns the
        engine's seconds (0 on a rank without engines, which still takes its part in a lazy
        gather and, in a tensor-parallel group, serves its own copy of every bucket to the TP
        rank on its GPU)."""
        tp = self.engines.tp if self.engines.sharing.device_push else None  # a device push: every rank holds the tensors
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

    def save_checkpoint(self) -> Path | None:
        return self._save(self._plain_parts())

    def _plain_parts(self) -> dict[str, Any]:
        """The checkpoint's parts but the trainer's: the run's progress, the RNGs, this
        rank's data source and rollout phase (its deferred samples: none lost or duplicated)."""
        return {"run": self.state.state_dict(),
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
                "data": self.data.state_dict(),
                "rollout": self.rollouts.state_dict() if self.rollouts is not None else None}

    def _save(self, plain: dict[str, Any]) -> Path | None:
        trainer_state = self.trainer.state_dict()  # collective: every rank takes part
        own = (plain["data"], plain["rollout"]) if self.actor is not None else None
        ranks = [r for r in all_gather_object(own, self.dist) if r is not None]  # every engine rank's
        if not self.is_main:
            return None
        parts = {"layout": checkpoint_layout.LAYOUT, "trainer": trainer_state, "run": plain["run"],
                 "rng": plain["rng"], "data": {"base": self.data.base, "ranks": [d for d, _ in ranks]},
                 "rollout": {"ranks": [r for _, r in ranks]}}
        # a resume names the checkpoint's models, and finds them (and the data) moved
        meta = {"models": dataclasses.asdict(self.cfg.models), "fingerprints": self._fingerprints}
        step = plain["run"]["step"]
        return checkpoint.save(self.run.out_dir / "checkpoints", step, parts, keep=self.cfg.run.keep_checkpoints,
                               meta=meta, before_commit=lambda: self.fault("checkpoint", step))

    @functools.cached_property
    def _fingerprints(self) -> dict[str, dict[str, str]]:
        """The run's model folders and data file by their bytes (``resume.fingerprints``), for every
        checkpoint's manifest: read once a run, at its first checkpoint (the run does not change them)."""
        return fingerprints(self.cfg)

    def restore(self, path: Path) -> None:
        """Load the checkpoint at ``path`` (a run folder or a checkpoint; today's layout) into the
        owners; the data sources' and rollout phases' states are dealt anew when the run had
        another number of engine ranks (``data_source.redistribute``; the Δ controller,
        chunk tuner and picker of its first engine rank go to every rank)."""
        where = checkpoint.latest(path)
        step, parts = checkpoint.load(where)
        checkpoint_layout.check(parts, where)  # one line for a checkpoint of an older colocate
        live = self.trainer.saved_shapes()  # no critic: critic-free; LoRA: the trainable tensors
        check_checkpoint(where, parts, live, self.cfg)  # one line, not torch's traceback, on other models
        self.trainer.load_state_dict(parts["trainer"])
        self.state.load_state_dict(parts["run"])
        placement = self.engines.placement
        base, data, note = data_source.redistribute(parts["data"]["base"], parts["data"]["ranks"],
                                                    placement.engine_ranks, self.cfg.rollout.group_size)
        if note is not None:
            self.log(f"resume: {note}")
        self.data.load_state_dict(base, data[placement.engine_rank])
        rollout = parts["rollout"]["ranks"]
        own = rollout[placement.engine_rank] if len(rollout) == placement.engine_ranks else \
            next((r for r in rollout if r is not None), None)
        if self.rollouts is not None and own is not None:  # None: a sequential run before 2026-11-25
            self.rollouts.load_state_dict(own)
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
        self.engines.sharing.wake_and_sync(lambda: self.gather_weights(first=True),
                                           self.push_weights)

    def close(self) -> None:
        """End the run's rollout phase and hand the engines back (shut down, or kept by
        the pool they came from)."""
        try:
            if self.rollouts is not None:
                self.rollouts.close()
            self.engines.close()
        finally:
            if self.run.folder is not None:
                self.run.folder.release()
