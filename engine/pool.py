"""Engines kept running between runs of one process.

Owns: :class:`EnginePool`. A run takes each engine it needs from the pool by its
:class:`~colocate.engine.engine_config.EngineConfig`: an idle engine started with an equal
config is handed over instead of starting another (an engine start is ~13 s for
SmolLM2 on 2 CPU cores, most of it the scheduler process importing SGLang); otherwise one
is started. When the run ends it gives its engines back: an engine that is alive, not
paused and idle is kept (its radix cache flushed), any other one is shut down. Several
runs in one process (a sweep or notebook through the Python API, the test suite) so pay
for each engine configuration once.

What a taken engine keeps from its last run, and what the run must do about it: the
weights its last run pushed (the run pushes its own before its first step,
``Session.wake_engines``) and the state of its sampler's random stream (a sampled
rollout differs from a fresh engine's; greedy ones do not).

Leaves out: which engines a run needs (``colocate.run.engines``), starting one
(``engine.runtime``).
"""

from __future__ import annotations

from .engine_config import EngineConfig
from .errors import EngineError
from .runtime import SglangEngine


class EnginePool:
    """Idle engines by their config, at most ``max_idle`` of them (the oldest given back is
    shut down first: each keeps its processes and memory); ``with EnginePool() as pool:``
    shuts them down at the end."""

    def __init__(self, max_idle: int = 4) -> None:
        self.max_idle = max_idle
        self._idle: list[SglangEngine] = []  # oldest given back first
        self.started = 0  # engines started through the pool
        self.reused = 0  # engines handed over again

    def take(self, cfg: EngineConfig, *, field: str = "model_path") -> tuple[SglangEngine, bool]:
        """An engine serving ``cfg``: ``(engine, reused)``; reused: it served an earlier run."""
        for eng in reversed([e for e in self._idle if e.cfg == cfg]):  # the newest given back first
            self._idle.remove(eng)
            if eng.alive():
                self.reused += 1
                return eng, True
            eng.shutdown()
        eng = SglangEngine(cfg, field=field)
        self.started += 1
        return eng, False

    def give_back(self, eng: SglangEngine) -> None:
        """Keep ``eng`` for the next run when it is alive, not paused and idle (its radix
        cache flushed); shut it down otherwise."""
        if eng.closed or eng in self._idle:
            return
        try:
            keep = eng.alive() and eng.paused is None and eng.flush_cache(timeout_s=5.0)
        except EngineError:  # died or hung on the way back
            keep = False
        if not keep:
            eng.shutdown()
            return
        self._idle.append(eng)
        while len(self._idle) > self.max_idle:
            self._idle.pop(0).shutdown()

    def idle(self) -> int:
        """Engines kept and not taken."""
        return len(self._idle)

    def kept(self) -> tuple[SglangEngine, ...]:
        """The engines kept and not taken, oldest given back first."""
        return tuple(self._idle)

    def close(self) -> None:
        """Shut every kept engine down."""
        while self._idle:
            self._idle.pop().shutdown()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
