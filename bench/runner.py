"""Run the modes of one workload side by side: same engines, models, prompts, seeds, batch.

Owns: one session per workload and engine thread budget (engines and trainer built
once, or one at a time when two do not fit in RAM; on CPU the streamed modes get their
own, see ``_Sessions``), and for every repeat all modes in a rotated order, grouped by
session (interleaved, so drift on a shared machine hits every mode alike). Before each (mode, repeat) the trainer, KL controller and data position are reset
to the start, the initial weights are synced to the engine, and the mode's scheduler and
feeder are set up fresh; one warm-up step is run and not recorded. Each measured step
runs under the contention guard (``bench.contention``): an optional bounded wait for a
quiet machine, and the CPU other processes used during the step, kept in its record.
Under a deadline (a time-boxed GPU call) a (mode, repeat) starts only where the last one's
seconds still fit before it, from the third on also keeping ``reserve_s`` free (the
workload's TRL peer); measured steps stop at the deadline after one; what was left out is
listed (``left_out``).

Leaves out: the lower bound (``bench.limit``), tables and plots (``bench.report``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from colocate.bench.contention import GuardOptions, guarded
from colocate.bench.workloads import mode_spec
from colocate.config import Config
from colocate.monitor.metrics import rss_mb


def _mode_cfg(cfg: Config, mode: str) -> Config:
    """``cfg`` under a bench mode: ``MODE`` or ``MODE/PAUSE`` (e.g. inter/in_place)."""
    base, pause = mode_spec(mode)
    return dataclasses.replace(cfg, overlap=dataclasses.replace(cfg.overlap, mode=base,
                                                                pause_mode=pause or cfg.overlap.pause_mode))


class _Sessions:
    """One session per engine thread budget (``colocate.run.builder.engine_threads``): on CPU
    the overlapped modes run their two engines on half the cores each, sequential and auto on
    all of them, exactly as ``colocate train`` would start them. Built on first use and kept so
    modes interleave without restarts, unless a second one would not fit in the free RAM
    next to the first (measured: one SmolLM2 session at batch 16 x 128 holds ~10 GB); then
    the other is closed first and rebuilt when needed. The first session's size is its
    peak (`peak_rss_mb`: the trainer's activations of the steps it ran included), not
    its size at rest: judged at rest, a reasoning run (batch 16 x 256) kept two sessions
    and was OOM-killed at 17 GB in its second repeat. Same seed: same initial weights."""

    def __init__(self, cfg: Config, reward_fns: Sequence[Callable] = ()) -> None:
        self.cfg, self.built, self.reward_fns = cfg, {}, list(reward_fns)
        self.baseline_mb = rss_mb()
        self.rebuilds = 0

    def key(self, mode: str) -> tuple[int, int, bool]:
        """What the engines of ``mode`` start with: the thread budget, and whether the actor
        runs SGLang's overlap scheduler (off under pause_mode=in_place)."""
        import os

        from colocate.run import builder

        cfg = _mode_cfg(self.cfg, mode)
        actor, reward = builder.engine_threads(cfg, len(os.sched_getaffinity(0)))
        return actor, reward, builder.actor_overlap_schedule(cfg)

    def get(self, mode: str):
        from colocate.run import builder

        key = self.key(mode)
        if key not in self.built:
            if self.built and not fits_beside(peak_rss_mb() - self.baseline_mb, free_mb()):
                self.close()
                self.built, self.rebuilds = {}, self.rebuilds + 1
            session = builder.build(_mode_cfg(self.cfg, mode), reward_fns=self.reward_fns, log=lambda m: None)
            # the states a new run starts from: the trainer's, the KL controller's, the data source's
            self.built[key] = (session, session.trainer.state_dict(), session.state.kl_ctl.state_dict(),
                               session.data.state_dict())
        return self.built[key]

    def start(self, mode: str):
        """The session of ``mode``'s engines back at step 0 under ``mode``'s config, as a new
        run on the same models and engines: the initial trainer and KL states loaded, the
        data source at the stream's start with nothing deferred, the weights pushed as the
        next version, the reward engine's radix cache flushed, and the rollout phase built
        afresh for the mode exactly as ``colocate train`` builds it."""
        session, initial, kl_state, data_state = self.get(mode)
        cfg = _mode_cfg(self.cfg, mode)
        if session.rollouts is not None:
            session.rollouts.close()
            session.rollouts = None
        session.cfg = cfg
        session.trainer.load_state_dict(initial)
        session.state.kl_ctl.load_state_dict(kl_state)
        session.state.step, session.state.phase, session.state.snapshot = 0, "idle", None
        session.data.load_state_dict(0, data_state)  # the stream's start, nothing deferred
        session.sync_weights()
        if session.reward_engine is not None:
            session.reward_engine.flush_cache()
        if session.run.rollouts_for is not None:
            session.rollouts = session.run.rollouts_for(cfg)
        return session

    def close(self) -> None:
        for session, *_ in self.built.values():
            session.close()


def _events(session) -> list[dict[str, Any]]:
    """The rollout timeline's events since the last call (``run.timeline``; none without)."""
    return session.run.timeline.take() if session.run.timeline is not None else []


def fits_beside(session_mb: float, free: float, margin: float = 1.5) -> bool:
    """Whether another session like the one holding ``session_mb`` fits in ``free`` MiB."""
    return free > margin * session_mb


def peak_rss_mb() -> float:
    """`rss_mb` (this process and its children now) plus how far this process's own
    resident memory has been above its current size at its peak (``ru_maxrss``)."""
    import resource

    import psutil

    now_self = psutil.Process().memory_info().rss / 2**20
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    return rss_mb() + max(0.0, peak_self - now_self)


def free_mb() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**20


def grouped_order(modes: Sequence[str], rep: int, key: Callable[[str], Any]) -> list[str]:
    """The modes rotated by ``rep`` (interleaving across repeats), then stably grouped by
    ``key`` in order of first appearance, so sessions switch as rarely as possible."""
    rotated = list(modes[rep % len(modes):]) + list(modes[: rep % len(modes)])
    firsts = {}
    for mode in rotated:
        firsts.setdefault(key(mode), len(firsts))
    return sorted(rotated, key=lambda m: firsts[key(m)])


def run_workload(cfg: Config, modes: Sequence[str], repeats: int, steps: int,
                 progress: Callable[[str], None] = print, limit_probe=None, *,
                 reward_fns: Sequence[Callable] = (), guard: GuardOptions | None = None,
                 journal: Path | None = None, deadline: float | None = None,
                 reserve_s: float = 0.0) -> dict[str, Any]:
    """Records of every measured step, tagged with mode and repeat (and, under ``guard``,
    the others' CPU load during the step); plus the probe (on the sequential mode's
    engines). ``reward_fns`` add to the reward model's score in every mode. ``journal``:
    each record is also appended there as one JSON line the moment it is measured, so a
    run that dies (e.g. OOM-killed) keeps the steps it finished. ``deadline``
    (``time.monotonic()``; None: none) and ``reserve_s``: see the module's doc."""
    sessions = _Sessions(cfg, reward_fns)
    records: list[dict[str, Any]] = []
    left_out: list[dict[str, Any]] = []
    last_s, started = 0.0, 0
    try:
        first, *_ = sessions.get("sequential")
        probe = limit_probe(first) if limit_probe is not None else {}
        for rep in range(repeats):
            for mode in grouped_order(modes, rep, sessions.key):
                if deadline is not None and time.monotonic() + last_s + (reserve_s if started >= 2 else 0.0) > deadline:
                    left_out.append({"mode": mode, "repeat": rep})
                    progress(f"  repeat {rep + 1}/{repeats} {mode:<10} left out: the budget is spent")
                    continue
                t0, started = time.monotonic(), started + 1
                session = sessions.start(mode)
                records += _measure(session, mode, rep, steps, guard,
                                    lambda line: progress(f"  repeat {rep + 1}/{repeats} {line}"), journal, deadline)
                last_s = time.monotonic() - t0
    finally:
        sessions.close()
    return {"records": records, "probe": probe, "session_rebuilds": sessions.rebuilds, "left_out": left_out}


def _measure(session, mode: str, rep: int, steps: int, guard: GuardOptions | None,
             progress: Callable[[str], None], journal: Path | None = None,
             deadline: float | None = None) -> list[dict[str, Any]]:
    """One warm-up step (caches, allocator, first chunk tuning), then ``steps`` measured ones
    (past ``deadline``, a ``time.monotonic()``, no more after the first)."""
    from colocate.run import loop

    loop.step(session)
    _events(session)  # the warm-up's: not measured
    started, waited, out = time.perf_counter(), 0.0, []
    for k in range(1, steps + 1):
        if k > 1 and deadline is not None and time.monotonic() > deadline:
            progress(f"{mode:<10} steps {k}-{steps} left out: the budget is spent")
            break
        rec, load = guarded(lambda: loop.step(session), guard)
        waited += load.get("quiet_wait_s", 0.0)  # wall_s: seconds of steps, not of waiting
        out.append({**rec, **load, "mode": mode, "repeat": rep, "wall_s": time.perf_counter() - started - waited})
        events = [{**e, "mode": mode, "repeat": rep} for e in _events(session)]
        if journal is not None:
            with journal.open("a") as f:
                f.write(json.dumps(out[-1], default=str) + "\n")
            with journal.with_name(journal.name.replace("_steps", "_requests")).open("a") as f:
                f.writelines(json.dumps(e) + "\n" for e in events)
        flag = f", others {load['others_cores']:.2f} cores" + (" CONTENDED" if load["contended"] else "") if load else ""
        progress(f"{mode:<10} step {k}/{steps}: {rec['step_s']:.2f} s, reward {rec['reward_mean']:+.3f}{flag}")
    return out
