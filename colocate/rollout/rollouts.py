"""The rollout phase of one engine rank, in every mode, and its lifetime: the one path
every ``overlap.mode`` goes through.

Owns: :class:`Rollouts`, which holds the Δ controller and the chunk-size tuner
(``colocate.rollout.controllers``), the scorer (``colocate.rollout.generate_and_score``), and — when a
mode streams — the reward
feeder: an asyncio task beside the engines, or its own process with its own reward engine
(``overlap.feeder=process``; the ZeroMQ socket is the boundary). One call of
:meth:`Rollouts.rollout` takes the step's :class:`~colocate.modes.Mode` (``overlap.mode``,
or auto's pick), has the data source plan B(+Δ) samples (B/n + Δ groups of n:
``DataSource.plan``, deferred ones first), runs them through the one
schedule, ``colocate.rollout.schedule.Schedule`` — every sample scored after generation when the mode
neither streams nor defers and nothing is carried (sequential), else streamed and/or
one-shot scoring as each finishes and the cut after the first B/n complete groups — and
the held-out evaluation through it too (greedy, scored after generation), has the data
source select the first B/n complete groups and keep the rest (``DataSource.select``), and
hands back what to train on as a :class:`StepRollout`, with the step's stats
(``engine/<role>_requests``; ``overlap/*`` in every mode, incl. the ZeroMQ frames either end
of the feeder channel refused or lost during the step; the feeder's counts come with its
heartbeats, so they lag it by at most 0.5 s). The step's sampling parameters are its own
(``rollout.temperature``, ``top_p``, ``ignore_eos`` and the tokenizer's stop ids).

The step's one rollout over the engine ranks: :func:`join` makes the engine ranks'
:class:`StepRollout` parts (exchanged by the run, ``colocate.run.loop``) one batch, with
the stats of its samples (``rollout/*``, :func:`rollout_stats`; ``overlap/staleness_*``,
:func:`staleness_stats`), and
checks every token's weight version against the trainer's (:func:`check_weight_versions`:
none newer, and all current unless stragglers are carried: a lost sync stops the run in
one line).

Leaves out: the schedule itself (``colocate.rollout.schedule``), which samples a step runs
and trains (``colocate.rollout.data_source``), scoring (``colocate.rollout.generate_and_score``) and
training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from colocate.rollout.auto_mode import AutoPolicy, ModePicker
from colocate.rollout.data_source import DataSource
from colocate.config import Config, OverlapConfig
from colocate.engine import reward
from colocate.rollout import schedule
from colocate.rollout.schedule import LiveRequests, check_pause_mode
from colocate.engine.reward_feeder import RewardFeeder
from colocate.errors import ColocateError
from colocate.rollout.sample import Sample
from colocate.monitor.timeline import Timeline
from colocate.rollout.controllers import ChunkSizeTuner, DeltaController
from colocate.engine.engine_config import EngineConfig
from colocate.engine.runtime import run_guarded
from colocate.engine.reward import FeederLostError, ScoreClient
from colocate.modes import STREAMED, Mode, by_name
from colocate.rollout.reward_fns import RewardFn
from colocate.rollout.generate_and_score import Scorer, sampling_params
from colocate.rollout.turns import EnvTurns

# feeder step ids of one-shot scoring through the feeder's process (streamed training steps
# use the step itself): held-out evaluations, and training steps that do not stream
EVAL_STEP_BASE = 1 << 40
WHOLE_STEP_BASE = 1 << 41


@dataclasses.dataclass(frozen=True)
class StepRollout:
    """A step's rollout, in every mode: the samples to train on (scored, groups whole and
    contiguous), the phase seconds and the mode's stats."""

    samples: list[Sample]
    seconds: dict[str, float]
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    multi_turn: bool = False  # trajectories with environment turns: their stats too (rollout_stats)


def rollout_stats(samples: Sequence[Sample], multi_turn: bool = False) -> dict[str, float]:
    """Metrics of the trained samples in every mode: groups, and prompt tokens the actor
    engine served from its radix cache (a group's shared prompt: n - 1 of its members).
    Multi-turn: model turns and environment answers (tool calls) per trajectory, the
    share of trajectories with at least one, environment tokens per trajectory, the
    environment's rewards, and the context tokens later turns found in the radix cache."""
    stats = {"rollout/groups": len({s.group_id for s in samples}),
             "rollout/cached_prompt_tokens": sum(s.cached_tokens for s in samples)}
    if multi_turn and samples:
        n = len(samples)
        stats |= {"rollout/turns": sum(s.turns for s in samples) / n,
                  "rollout/tool_calls": sum(len(s.observations) for s in samples) / n,
                  "rollout/tool_call_rate": sum(1 for s in samples if s.observations) / n,
                  "rollout/env_tokens": sum(len(s.output_ids) - sum(s.mask()) for s in samples) / n,
                  "rollout/env_reward": sum(s.env_reward for s in samples) / n,
                  "rollout/cached_turn_tokens": sum(s.turn_cached_tokens for s in samples)}
    return stats


def staleness_stats(samples: Sequence[Sample], current_version: int) -> dict[str, float]:
    """Over every token: mean and max of (current_version − the token's version) and the
    fraction of tokens generated under older weights."""
    lags = [current_version - v for s in samples for v in s.versions]
    if not lags:
        return {"mean": 0.0, "max": 0.0, "frac_stale_tokens": 0.0}
    return {
        "mean": sum(lags) / len(lags),
        "max": float(max(lags)),
        "frac_stale_tokens": sum(1 for lag in lags if lag > 0) / len(lags),
    }


class WeightVersionMismatchError(ColocateError):
    """The actor engine served weights the trainer does not think it holds."""


def check_weight_versions(versions: Sequence[Sequence[int]], trainer_version: int, *,
                          carries_partials: bool) -> None:
    """Every token's weight version against the trainer's current version.

    A token newer than the trainer is always a mismatch. Without deferral
    (``carries_partials`` False) every token was sampled this step, so each must equal
    ``trainer_version``; with deferral, older tokens are the deferred partials, whose
    staleness the trainer corrects or masks.
    """
    for row, vs in enumerate(versions):
        for v in vs:
            if v > trainer_version or (not carries_partials and v != trainer_version):
                raise WeightVersionMismatchError(
                    f"weight-version mismatch: sample {row} has a token sampled under version {v} "
                    f"but the trainer is at version {trainer_version}; the engine does not hold the "
                    "trainer's weights (a lost sync): resume from the last checkpoint with --resume")


SAME_ON_EVERY_RANK = ("overlap/delta", "overlap/chunk_size")  # reported from the first engine rank
PER_RANK = {"engine/busy_s": "busy_s", "engine/actor_requests": "actor_requests",
            "engine/reward_requests": "reward_requests", "overlap/deferred": "deferred"}


def join(parts: Sequence[StepRollout | None], version: int, *, carries_partials: bool) -> StepRollout:
    """One step's rollout from each engine rank's part (``parts`` in rank order; None: a
    rank without engines), checked against the trainer's weight ``version``
    (:func:`check_weight_versions`; ``carries_partials``: ``overlap.deferral``). Samples
    in index order (named in the union when drawn: ``DataSource.groups``), so groups stay
    contiguous and the union is what one rank would have drawn; the phase seconds of the
    slowest rank; counts summed; the samples' own stats over the union, computed here once
    (:func:`rollout_stats`, multi-turn when a part says so; ``overlap/staleness_*``,
    :func:`staleness_stats`); per-rank engine metrics ``engines/<r>/…``."""
    own = [p for p in parts if p is not None]
    samples = sorted((x for part in own for x in part.samples), key=lambda x: x.index)
    check_weight_versions([x.versions for x in samples], version, carries_partials=carries_partials)
    slowest = max(own, key=lambda p: sum(p.seconds.values()))
    stats: dict[str, float] = {}
    for key in dict.fromkeys(k for p in own for k in p.stats):
        values = [p.stats[key] for p in own if key in p.stats]
        if key in SAME_ON_EVERY_RANK:
            stats[key] = values[0]
        elif not key.startswith("engine/"):
            stats[key] = sum(values)
    stats |= {f"overlap/staleness_{k}": v for k, v in staleness_stats(samples, version).items()}
    stats |= rollout_stats(samples, multi_turn=any(p.multi_turn for p in own))  # means over the union, not sums
    for r, part in enumerate(own):
        busy = {"engine/busy_s": sum(part.seconds.values())}
        for key, name in PER_RANK.items():
            value = busy.get(key, part.stats.get(key))
            if value is not None:
                stats[f"engines/{r}/{name}"] = value
    return StepRollout(samples, dict(slowest.seconds), stats)


def auto_policy(o: OverlapConfig, streams: bool = True) -> AutoPolicy:
    """``overlap.auto_*`` as the picker's policy; without a reward model to stream to,
    only the modes that do not stream."""
    modes = tuple(m for m in o.modes if streams or m not in STREAMED)
    return AutoPolicy(candidates=modes, trials=o.auto_trials, explore_every=o.auto_explore_every,
                      margin=o.auto_margin)


class Rollouts:
    """Δ controller + scorer + tuner (+ feeder) of one engine rank; ``batch_size``: the samples
    it trains per step (its share of ``rollout.batch_size``, a multiple of
    ``rollout.group_size``); Δ counts groups, per rank."""

    def __init__(self, cfg: Config, actor, reward_engine, feeder_engine: EngineConfig | None, log=print, *,
                 reward_fns: Sequence[RewardFn] = (), decode=None, batch_size: int | None = None,
                 timeline: Timeline | None = None, env: EnvTurns | None = None, stop_ids: Sequence[int]):
        self.cfg, self.actor, self.reward_engine = cfg, actor, reward_engine
        r = cfg.rollout  # the step's sampling, and the held-out evaluation's (greedy)
        self.sampling = sampling_params(r.temperature, r.top_p, stop_ids, r.ignore_eos)
        self.greedy = sampling_params(0.0, 1.0, stop_ids, r.ignore_eos)
        self.log = log
        self.env = env  # multi-turn: the environment that answers each model turn
        self.turns = env.multi_turn() if env is not None else None
        o = cfg.overlap
        if o.deferral:
            check_pause_mode(o.pause_mode, actor.device)
        # the reward model: the inline engine, or behind the feeder's own process
        self.scorer = Scorer(reward_engine, tuple(reward_fns), decode, cfg.reward.scale, o.feeder_timeout_s,
                             whole=self._whole(WHOLE_STEP_BASE) if feeder_engine is not None else None)
        self.live = LiveRequests()  # stragglers parked in the actor engine (pause_mode in_place/retract)
        self.schedule = schedule.Schedule(actor, pause_mode=o.pause_mode if o.deferral else "abort", live=self.live,
                                          timeline=timeline, turns=self.turns)
        self.batch_groups = (batch_size or cfg.rollout.batch_size) // cfg.rollout.group_size  # B/n, trained per step
        self.delta_ctl = DeltaController(o)
        self.picker = ModePicker(auto_policy(o, streams=reward_engine is not None or feeder_engine is not None)) \
            if o.mode == "auto" else None
        self.tuner = ChunkSizeTuner(o)
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.client: ScoreClient | None = None
        self._channel_seen: dict[str, int] = {}  # channel counts reported so far
        self._feeder_task = self._feeder_proc = None
        self._feeder: RewardFeeder | None = None  # the inline feeder (None: none, or its own process)
        if o.streamed:
            self._start_feeder(feeder_engine, log)

    # ---- feeder lifetime ---------------------------------------------------------
    def _start_feeder(self, feeder_engine: EngineConfig | None, log) -> None:
        """``feeder_engine``: the reward engine a feeder process starts for itself
        (``overlap.feeder=process``); None: the feeder scores on ``self.reward_engine``."""
        # its owner's pid in the name: what a killed run left is swept at the next start (colocate.run.leftovers)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"colocate-zmq-{os.getpid()}-")
        chunks = f"ipc://{self._tmp.name}/chunks"
        results = f"ipc://{self._tmp.name}/results"
        self.client = ScoreClient(chunks, results, timeout_s=self.cfg.overlap.feeder_timeout_s)
        loop = self.actor.loop
        loop.run_until_complete(self.client.__aenter__())
        if feeder_engine is not None:
            cmd = [sys.executable, "-m", "colocate.engine.reward_feeder", "--model", feeder_engine.model_path,
                   "--chunks", chunks, "--results", results,
                   "--engine-json", json.dumps(dataclasses.asdict(feeder_engine)),
                   "--parent-pid", str(os.getpid())]  # it ends with this process, kill -9 included
            self._feeder_proc = subprocess.Popen(cmd, cwd=str(Path(__file__).resolve().parents[2]))
            log(f"reward feeder: own process (pid {self._feeder_proc.pid})")
            self._wait_first_heartbeat()
        else:
            self._feeder = RewardFeeder(self.reward_engine, chunks, results)
            self._feeder_stop = asyncio.Event()
            self._feeder_task = loop.create_task(self._feeder.run(self._feeder_stop))

    def _wait_first_heartbeat(self, limit_s: float = 180.0) -> None:
        started = time.monotonic()
        self.client.last_heard = 0.0
        while self.client.last_heard < started:
            if self._feeder_proc.poll() is not None:
                raise FeederLostError(f"the reward feeder process exited (code {self._feeder_proc.returncode}) before it answered")
            if time.monotonic() - started > limit_s:
                raise FeederLostError("the reward feeder process did not answer within 180 s")
            self.actor.loop.run_until_complete(asyncio.sleep(0.2))

    @property
    def hosts_reward_model(self) -> bool:
        """Whether the reward model is reachable only through the feeder (its own process)."""
        return self._feeder_proc is not None

    def feeder_pid(self) -> int | None:
        return self._feeder_proc.pid if self._feeder_proc else None

    def check_feeder(self) -> None:
        if self._feeder_proc is not None and self._feeder_proc.poll() is not None:
            raise FeederLostError(f"the reward feeder process died (exit code {self._feeder_proc.returncode})")
        if self._feeder_task is not None and self._feeder_task.done():
            exc = self._feeder_task.exception() if not self._feeder_task.cancelled() else None
            raise FeederLostError(f"the reward feeder task stopped: {exc!r}")

    def drain(self) -> None:
        """Stop the inline feeder's scoring before the engines release their memory
        (``RewardFeeder.drain``: what the step's cut left is not scored, what is in flight
        comes back first). A feeder process scores on its own engine, never released."""
        if self._feeder is not None:
            run_guarded([self.actor, self.reward_engine], self._feeder.drain())

    def close(self) -> None:
        if len(self.live) and self.actor.alive():  # a dead engine's requests went with it
            run_guarded([self.actor], self.schedule.end_parked())
        if self._feeder_task is not None:
            self._feeder_stop.set()
            self.actor.loop.run_until_complete(asyncio.wait([self._feeder_task], timeout=5))
        if self._feeder_proc is not None:
            self._feeder_proc.kill()
            self._feeder_proc.wait(timeout=30)
        if self.client is not None:
            self.actor.loop.run_until_complete(self.client.__aexit__(None, None, None))
        if self._tmp is not None:
            self._tmp.cleanup()

    # ---- one step ----------------------------------------------------------------------
    def rollout(self, data: DataSource, step: int, version: int) -> StepRollout:
        """Plan, generate, score, cut; returns the B samples (B/n groups) to train on, in
        order. ``data``: this rank's data source, which plans the step (its deferred
        samples, then fresh groups), selects what it trains and keeps what it defers. The
        step's mode is ``overlap.mode``, or the picker's under ``overlap.mode=auto``."""
        served = self._requests()
        name, measured = self.picker.choose() if self.picker is not None else (self.cfg.overlap.mode, False)
        step_mode = by_name(name)
        plan = data.plan(self.batch_groups, self.delta_ctl.delta if step_mode.defers else 0, version,
                         drop_staleness=self.cfg.overlap.drop_staleness)
        carried = bool(plan.ready or plan.waiting or plan.resumed or len(self.live))
        if self.client is not None:
            self.client.last_heard = time.monotonic()  # the loop slept while training
        if self.env is not None:
            self.env.step_started()  # nor do environment calls parked across it count that time
        self.check_feeder()
        started = time.perf_counter()
        plain = step_mode.plain and not carried  # sequential: generate all, then score all
        # parked streams of samples still deferred stay parked through a step that cuts; the rest end
        keep_parked = {s.index for s in data.deferred} if step_mode.defers else set()
        try:
            seconds, ended, chunk = self._run_step(plan, step_mode, step, score_at_end=plain, keep_parked=keep_parked)
        finally:
            if self.env is not None:
                self.env.step_ended()
        elapsed = time.perf_counter() - started
        train, _ = data.select(ended, self.schedule.timeline)  # the rest stays deferred
        if self.picker is not None:  # a step that finishes what deferral left is not the mode's cost
            self._record_auto(step, name, elapsed, len(train), measured and (step_mode.defers or not carried))
        stats = {"deferred": len(data.deferred), "parked": len(self.live), "delta": plan.delta,
                 "chunk_size": chunk, "dropped": len(plan.dropped),
                 "resumed": plan.resumed, "launched": len(plan.launch), "waiting": len(plan.waiting),
                 **self._auto_stats(step_mode), **self._channel_stats()}
        env = {"env/errors": self.env.errors.take()} if self.env is not None else {}
        requests = {f"engine/{role}_requests": n - served[role] for role, n in self._requests().items()}
        stats = {**env, **{f"overlap/{k}": v for k, v in stats.items()}, **requests}
        return StepRollout(train, seconds, stats, multi_turn=self.turns is not None)  # its samples' stats: join

    def _requests(self) -> dict[str, int]:
        """Requests sent so far to the actor and the inline reward engine."""
        engines = {"actor": self.actor, "reward": self.reward_engine}
        return {role: eng.requests for role, eng in engines.items() if eng is not None}

    def _run_step(self, plan, step_mode: Mode, step: int, score_at_end: bool, keep_parked: set[int]):
        """``plan`` through the one schedule (``colocate.rollout.schedule.Schedule``): streamed scoring when
        the mode streams, the cut after the first B/n groups when it defers, every sample
        scored after generation when ``score_at_end`` (a sequential step with nothing
        carried). Returns the phase seconds, every launched sample (finished first: in
        completion order, or in launch order when scored at the end) and the chunk."""
        if score_at_end:
            res = run_guarded([self.actor, *self.scorer.engines], self.schedule.run_then_score(
                plan.launch, self.sampling, step, self.scorer.score_all, tag_prefix="st"))
            return res.seconds, res.completed + res.unfinished, 0
        streams = self.client is not None and step_mode.streams
        chunk = self.tuner.chunk_for_step(step) if streams else 0
        need = max(0, self.batch_groups - len({s.group_id for s in plan.ready}))
        started = time.perf_counter()
        res = run_guarded([self.actor, *self.scorer.engines], self.schedule.run(
            plan.launch, self.sampling, step, score=self.scorer,
            stream=schedule.Stream(self.client, chunk) if streams else None,
            cut_after=need if step_mode.defers else None, keep_parked=keep_parked))
        if streams:
            self.tuner.record(step, chunk, time.perf_counter() - started)
        return res.seconds, res.completed + res.unfinished, chunk

    def _record_auto(self, step: int, mode: str, seconds: float, trained: int, measured: bool) -> None:
        self.picker.record(mode, seconds, trained, measured)
        nxt, _ = self.picker.choose()
        if nxt != mode:
            costs = ", ".join(f"{m} {c:.3f}" for m, c in self.picker.stats().items())
            self.log(f"overlap.mode=auto: step {step + 1} ran {mode}, the next runs {nxt} "
                     f"(rollout s per trained sample: {costs or 'none measured yet'})")

    def _auto_stats(self, step_mode: Mode) -> dict[str, float]:
        """Which overlaps the step ran under ``overlap.mode=auto``, and each mode's cost."""
        if self.picker is None:
            return {}
        return {"auto_streamed": float(step_mode.streams), "auto_deferral": float(step_mode.defers),
                **self.picker.stats()}

    def _channel_stats(self) -> dict[str, int]:
        """Frames refused (malformed) or lost (dropped connections, discarded chunks) on the
        feeder channel since the last step; nothing without streamed scoring."""
        if self.client is None:
            return {}
        now = self.client.channel_counts()
        delta = {f"channel_{k}": v - self._channel_seen.get(k, 0) for k, v in now.items()}
        self._channel_seen = now
        return delta

    def _whole(self, base: int):
        """The reward model behind the feeder's process, one-shot: complete (prompt ids,
        response ids) pairs sent as final chunks under step id ``base + step`` (above every
        streamed training step's)."""
        async def scores(step: int, seqs, indices) -> list[float]:
            self.client.last_heard = time.monotonic()  # the loop slept while training
            self.check_feeder()
            return await reward.score_whole(self.client, base + step, seqs, indices)

        return scores

    def evaluate(self, samples: Sequence[Sample], step: int) -> dict[str, float]:
        """The held-out evaluation after ``step``: ``samples`` generated greedily and scored
        like training, on the sequential schedule, outside the data source's plan (request
        ids ``ev``; through a feeder process under evaluation step ids)."""
        scorer = self.scorer
        if scorer.whole is not None:
            scorer = dataclasses.replace(scorer, whole=self._whole(EVAL_STEP_BASE))
        res = run_guarded([self.actor, *scorer.engines], schedule.Schedule(self.actor, turns=self.turns).run_then_score(
            samples, self.greedy, step, scorer.score_all, tag_prefix="ev"))
        return res.seconds

    def observe_reward(self, mean_reward: float) -> None:
        self.delta_ctl.update(mean_reward)

    def state_dict(self) -> dict[str, Any]:
        """The Δ controller, chunk tuner and (``overlap.mode=auto``) the picker; the deferred
        samples are the data source's (``DataSource.state_dict``)."""
        auto = {"auto": self.picker.state_dict()} if self.picker is not None else {}
        return {"delta": self.delta_ctl.state_dict(), "tuner": self.tuner.state_dict(), **auto}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.delta_ctl.load_state_dict(state["delta"])
        self.tuner.load_state_dict(state["tuner"])
        if self.picker is not None and "auto" in state:
            self.picker.load_state_dict(state["auto"])
