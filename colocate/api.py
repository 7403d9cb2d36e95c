"""The Python API: prepare models, train, read results.

    from colocate import api
    from colocate.config import load_config
    cfg = load_config(overrides=["run.steps=5"])
    summary = api.train(cfg, reward_fns=[lambda record, text: len(text) / 100])

Owns: the public entry points and the :class:`Summary` a run returns. Leaves out: the
step (``colocate.run.loop``) and construction (``colocate.run.builder``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from colocate.config import Config, to_dict
from colocate.errors import ColocateError, ConfigError
from colocate.assets.model_aliases import model_aliases
from colocate.engine.pool import EnginePool  # engines kept across runs: api.train(..., engines=pool)
from colocate.monitor.metrics import read, run_summary
from colocate.rollout.env import Environment, Observation  # multi-turn: api.train(cfg, env=...)
from colocate.monitor.progress import Progress
from colocate.run.guards import check_main_guard


def prepare(with_reward_model: bool = True) -> dict[str, Path]:
    """Build (once) and return the packaged models' folders."""
    names = ["smollm2"] + (["sentiment-rm"] if with_reward_model else [])
    aliases = model_aliases()
    return {name: aliases[name]() for name in names}


@dataclasses.dataclass(frozen=True)
class Summary:
    out_dir: Path
    steps: int
    history: list[dict[str, Any]]
    wall_s: float
    stopped_by: str = ""  # a signal name when SIGINT/SIGTERM ended the run early
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # held-out evaluations
    is_main: bool = True  # rank 0 of the run (the one that speaks for it)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def export_actor(self, out: str | Path | None = None, adapter: str | Path | None = None) -> Path:
        """The trained actor of the newest checkpoint as an HF folder (see `export_actor`)."""
        return export_actor(self.out_dir, out, adapter=adapter)

    def describe(self) -> str:
        if not self.history:
            return f"no steps run; output in {self.out_dir}"
        s = run_summary(self.history, self.evals)
        k = max(1, min(5, sum("reward_mean" in h for h in self.history) // 4))
        stopped = (f"stopped by {self.stopped_by} at step {self.steps} (checkpointed; continue it with --resume "
                   f"{self.out_dir}); ") if self.stopped_by else ""
        reward = (f"reward {s['reward_first']:+.3f} (first {k}) → {s['reward_last']:+.3f} (last {k}); "
                  if "reward_first" in s else "")
        if "eval_reward_first" in s:
            reward += (f"held-out reward {s['eval_reward_first']:+.3f} (step {s['eval_step_first']:.0f}) → "
                       f"{s['eval_reward_last']:+.3f} (step {s['eval_step_last']:.0f}); ")
        step_s = statistics.median(h["step_s"] for h in self.history)
        n = len(self.history)
        return (f"{stopped}{n} step{'s' if n != 1 else ''} in {self.wall_s:.0f} s (median {step_s:.1f} s/step); "
                f"{reward}metrics {self.out_dir / 'metrics.jsonl'}, checkpoints {self.checkpoint_dir}")


class StopRequest:
    """Set by SIGINT/SIGTERM; the loop stops at the next step boundary with a checkpoint."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def __call__(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested, self.reason = True, signal.Signals(signum).name


class StartInterrupted(ColocateError):
    """SIGINT or SIGTERM while a run started: nothing trained, its engines shut down."""


@contextlib.contextmanager
def _signals_to(handler: Callable[[int, Any], None]):
    """``handler`` takes SIGINT and SIGTERM (main thread only; the old handlers back after).

    While a run starts it interrupts the start (:func:`_interrupting`); while it trains it is
    the run's :class:`StopRequest`. SGLang's own SIGTERM handler (drain, then exit the process
    without a checkpoint) is already off the engines' event loop (``engine.in_process``). The
    handler is a plain Python one, not a loop one: the engines' loop is uvloop, which only
    dispatches loop signal handlers while it runs, and training happens between its runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig in sigs:
            signal.signal(sig, old[sig])


def _interrupting(caught: list[str]) -> Callable[[int, Any], None]:
    """A handler that interrupts a run's start (a ``KeyboardInterrupt``; the signal's name
    appended to ``caught``), so it unwinds as from any failure and the engines started so far
    shut down with their processes. Before, a SIGTERM (a job scheduler's, or torchrun's once
    another rank failed) killed the process at once, and SGLang's processes still importing
    outlived it."""
    def interrupt(signum: int, frame: Any) -> None:
        caught.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    return interrupt


def export_actor(run: str | Path, out: str | Path | None = None, adapter: str | Path | None = None,
                 log: Callable[[str], None] = lambda message: None) -> Path:
    """The trained actor of a run's newest checkpoint (or of one ``step_*`` checkpoint) as
    an HF folder that transformers and SGLang load (a LoRA run's merged); default
    ``<run>/export/actor_step_*``. ``adapter``: a LoRA run's adapters also as a PEFT
    adapter folder there. ``log``: a line for what was loaded and written, with its time."""
    from colocate.tools.export import export_actor as export  # here, not at the top: it brings torch

    return export(run, out, adapter=adapter, log=log)


def generate(model: str | Path, prompts: Sequence[str], log: Callable[[str], None] = lambda message: None,
             **options: Any) -> list:
    """Responses of ``model`` (a run folder, checkpoint, model folder or alias) to ``prompts``
    -> ``colocate.tools.sample.Generation`` items; ``options``: `colocate.tools.sample.SampleOptions` fields
    (max_new_tokens, temperature, top_p, seed, device, dtype, chat). ``log``: a line for what
    was loaded (a run's export, the engine) and how long it took."""
    from colocate.tools.sample import generate as sample, options as sample_options  # here: it brings torch

    opts = sample_options(options)
    check_main_guard(sys.modules["__main__"], "colocate.api.generate")
    return sample(str(model), list(prompts), opts, log)


def _check_config(cfg: Any) -> None:
    """A config that is not a :class:`Config` (a dict, a path) is one line, not an
    AttributeError from deep inside the run."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"cfg: a {type(cfg).__name__}, not a colocate Config; build one with "
                          "colocate.config.load_config(path, overrides) or Config()")


def _callbacks(callbacks: Any) -> list[Callable[[dict[str, Any]], None]]:
    """``train``'s callbacks as a list, each callable, or one line before anything starts
    (a wrong one was a TypeError after the first step)."""
    if callable(callbacks):
        name = getattr(callbacks, "__name__", type(callbacks).__name__)
        raise ConfigError(f"callbacks: one function ({name}), not a list of them; pass callbacks=[{name}]")
    if isinstance(callbacks, (str, bytes, dict)) or not isinstance(callbacks, Iterable):
        raise ConfigError(f"callbacks: {callbacks!r:.40} is not a list of functions; pass callbacks=[fn, ...]")
    callbacks = list(callbacks)
    for i, cb in enumerate(callbacks):
        if not callable(cb):
            raise ConfigError(f"callbacks[{i}]: {cb!r:.40} is not callable; pass functions that take a step's "
                              "metrics (a dict)")
    return callbacks


def check(cfg: Config, *, resume: str | Path | None = None, nproc: int = 1, env: Environment | None = None):
    """What ``train`` (on ``nproc`` processes of this node) checks before its first engine
    starts, run alone, no engine started (``colocate train --check``): the config against
    ``resume``'s run, the run folder (no earlier run's records, no other run in it), the
    models, the reward functions, the prompts loaded and tokenized
    (``data.max_prompt_tokens``), prompt + budget against each engine's context. Raises the
    run's one-line error; returns a ``colocate.run.dry_run.CheckReport`` (``describe()``)."""
    from colocate.run import dry_run  # here, not at the top: it brings torch and transformers

    _check_config(cfg)
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc: {nproc!r}; give the number of training processes, 1 or more")
    if resume is not None:
        from colocate.run.resume import check_resume

        check_resume(cfg, resume, lambda m: None)
    return dry_run.check(cfg, nproc=nproc, env=env, resume=resume)


def train(cfg: Config, *, resume: str | Path | None = None, reward_fns: Sequence[Callable] = (),
          callbacks: Sequence[Callable[[dict[str, Any]], None]] = (), quiet: bool = False,
          engines: EnginePool | None = None, env: Environment | None = None) -> Summary:
    """Run PPO as configured. ``reward_fns(record, text)`` (sync or async; ``text``: the
    model's own turns; a ``messages`` parameter gets the trajectory as chat messages;
    ``colocate.rollout.reward_fns``) add to the reward model's score (or replace it with
    ``reward.kind=rule``); ``callbacks`` get each step's metrics (one that raises ends the run
    after that step's checkpoint, with its own error). ``run.out_dir`` must not hold an
    earlier run's records (``colocate.run.run_folder``: refused in one line) unless ``resume`` continues it or ``run.overwrite_out_dir`` replaces
    them, and is held for the run (a second run on it meanwhile is refused).
    ``resume``: a run folder or one of its checkpoints to continue from; ``cfg`` must
    keep that run's models and data (``colocate.run.resume.FIXED``;
    ``colocate.run.resume.load_run_config`` gives the run's own config). ``engines``: an
    :class:`EnginePool` kept across several runs of this process; a run on the same models
    and engine settings takes the engines an earlier run gave back instead of starting its
    own (its weights are pushed first; see ``colocate.engine.pool``). ``env``: an
    :class:`Environment` that answers each model turn (multi-turn trajectories; else the
    one ``rollout.env`` names, if any; docs/environments.md)."""
    from colocate.run import builder, loop  # here, not at the top: they bring torch and transformers

    _check_config(cfg)
    callbacks = _callbacks(callbacks)
    check_main_guard(sys.modules["__main__"])
    started = time.perf_counter()
    log = (lambda m: None) if quiet else (lambda m: print(f"[colocate] {m}", flush=True))
    if resume is not None:
        from colocate.run.resume import check_resume  # here, not at the top: it brings torch

        check_resume(cfg, resume, log)  # before any engine starts
    # rank 0 holds run.out_dir for the run: one line if it holds an earlier run or another run holds it
    caught: list[str] = []
    try:
        with _signals_to(_interrupting(caught)):
            session = builder.build(cfg, resume=resume, reward_fns=reward_fns, log=log, engines=engines, env=env,
                                    claim=True)
    except KeyboardInterrupt:
        raise StartInterrupted(f"stopped by {caught[-1] if caught else 'SIGINT'} while the run started, before its "
                               "first step: nothing trained, nothing to checkpoint (its engines shut down)") from None
    stop = StopRequest()
    progress = None
    # over the run's end too: a SIGTERM then (torchrun's, once another rank has failed) waits
    # until the engines are shut down and this rank's own error is raised for its line
    with _signals_to(stop):
        try:
            if session.is_main:
                _write_run_files(session)
            progress = None if quiet or not session.is_main else Progress(cfg.run.steps, session.state.step)
            if progress is not None:
                session.watch_phases(progress.phase)
            history = loop.train(session, callbacks, progress, stop)
        finally:
            if progress is not None:
                progress.close()
            session.close()
    all_steps = read(session.run.out_dir / "metrics.jsonl") if session.is_main else history
    return Summary(session.run.out_dir, session.state.step, all_steps or history, time.perf_counter() - started,
                   stop.reason, read(session.run.out_dir / "eval.jsonl") if session.is_main else [], session.is_main)


def _write_run_files(session) -> None:
    out = session.run.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(session.cfg), indent=1))
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = out / name
        if path.exists():  # a resumed run: drop records after the checkpoint it resumed from (and a torn last one)
            keep = [r for r in read(path) if r["step"] <= session.state.step]
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))  # as append_jsonl wrote them
