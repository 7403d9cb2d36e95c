"""An engine's thread budget reaches its scheduler process, and the parent's env is left alone."""

from __future__ import annotations

import os

import psutil
import pytest

from colocate.rollout import generation
from colocate.rollout.sample import Sample
from colocate.engine.engine_config import EngineConfig
from colocate.engine.runtime import SglangEngine

pytestmark = pytest.mark.slow


def _scheduler_threads(threads: int, model: str) -> int:
    """OS threads of the scheduler after a generation (OpenMP has started its workers)."""
    eng = SglangEngine(EngineConfig(model, device="cpu", max_total_tokens=4096, threads=threads))
    try:
        samples = [Sample(i, [5, 6, 7, 8 + i], 8) for i in range(4)]
        eng.loop.run_until_complete(generation.generate(eng, samples, {"temperature": 0.0, "ignore_eos": True}, "thr"))
        procs = [psutil.Process(pid) for pid in eng.child_pids]
        (sched,) = [p for p in procs if "scheduler" in p.name()]
        return sched.num_threads()
    finally:
        eng.shutdown()


def test_scheduler_gets_its_thread_budget_and_the_parent_env_is_restored(tiny_actor_path):
    before = os.environ.get("OMP_NUM_THREADS")
    one, two = _scheduler_threads(1, tiny_actor_path), _scheduler_threads(2, tiny_actor_path)
    assert os.environ.get("OMP_NUM_THREADS") == before
    assert two > one  # OpenMP (and the pools sized by it) run more workers with a bigger budget
