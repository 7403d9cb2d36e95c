"""An engine's thread budget reaches its scheduler process, and the parent's env is left
alone; a shut-down engine leaves nothing of its own in this process (engine.in_process):
its tokenizer manager's tasks ended, its ZeroMQ context closed, its process handles
reaped, SIGTERM's handler the one from before it started."""

from __future__ import annotations

import multiprocessing
import os
import signal

import psutil
import pytest

from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample
from colocate.engine.engine_config import EngineConfig
from colocate.engine.runtime import SglangEngine

pytestmark = pytest.mark.slow


def _start_generate_stop(threads: int, model: str) -> dict:
    """OS threads of the scheduler after a generation (OpenMP has started its workers), and
    what the engine left in this process once shut down."""
    sigterm = signal.getsignal(signal.SIGTERM)
    eng = SglangEngine(EngineConfig(model, device="cpu", max_total_tokens=4096, threads=threads))
    try:
        samples = [Sample(i, [5, 6, 7, 8 + i], 8) for i in range(4)]
        eng.loop.run_until_complete(generate_and_score.generate(eng, samples, {"temperature": 0.0, "ignore_eos": True}, "thr"))
        procs = [psutil.Process(pid) for pid in eng.child_pids]
        (sched,) = [p for p in procs if "scheduler" in p.name()]
        sigterm_running = signal.getsignal(signal.SIGTERM)
        manager = eng._engine.tokenizer_manager
        tasks, context = list(manager.asyncio_tasks), manager.recv_from_detokenizer.context
        pids = set(eng.child_pids)
        threads_seen = sched.num_threads()
    finally:
        eng.shutdown()
    return {
        "threads": threads_seen,
        "sigterm_kept": sigterm_running == sigterm and signal.getsignal(signal.SIGTERM) == sigterm,
        "tasks": len(tasks),
        "tasks_left": [t for t in tasks if not t.done()],
        "context_closed": context.closed,
        "handles_left": [c for c in multiprocessing.active_children() if c.pid in pids],
    }


@pytest.fixture(scope="module")
def started(tiny_actor_path):
    before = os.environ.get("OMP_NUM_THREADS")
    one, two = _start_generate_stop(1, tiny_actor_path), _start_generate_stop(2, tiny_actor_path)
    return {"env_before": before, "env_after": os.environ.get("OMP_NUM_THREADS"), 1: one, 2: two}


def test_scheduler_gets_its_thread_budget_and_the_parent_env_is_restored(started):
    assert started["env_after"] == started["env_before"]
    assert started[2]["threads"] > started[1]["threads"]  # OpenMP (and pools sized by it) run more workers


@pytest.mark.parametrize("threads", [1, 2])
def test_a_shut_down_engine_leaves_nothing_of_its_own_in_this_process(started, threads):
    """Before: the receive and SIGTERM-watch tasks stayed pending and held the tokenizer
    manager, its context (two I/O threads) and sockets; psutil reaped the processes, so
    multiprocessing's handles kept their pipes and called them alive; SGLang's SIGTERM
    handler (drain, then kill the process tree) outlived the engine, and SIGTERM did nothing."""
    left = started[threads]
    assert left["sigterm_kept"], "SGLang's SIGTERM handler replaced the one from before the start"
    assert left["tasks"] >= 1 and left["tasks_left"] == []
    assert left["context_closed"]
    assert left["handles_left"] == []
