"""Bad input to the engines gives one-line errors before SGLang is involved (or, for
SGLang's own arguments, before any of its processes starts); good ones reach it."""

from __future__ import annotations

import asyncio
import re
import time

import psutil
import pytest

from colocate.assets.random_models import build_tiny_bidirectional_model
from colocate.engine.errors import EngineConfigError
from colocate.engine.engine_config import EngineConfig
from colocate.engine.errors import EngineStartError
from colocate.engine.runtime import SglangEngine
from colocate.errors import in_config_terms


def test_missing_model_folder(tmp_path):
    with pytest.raises(EngineStartError, match=r"models.actor: no model at .*colocate prepare") as e:
        SglangEngine(EngineConfig(str(tmp_path / "nope"), role="actor"), field="models.actor")
    assert "\n" not in str(e.value)


def test_non_causal_reward_model_is_refused(tmp_path):
    path = build_tiny_bidirectional_model(tmp_path / "bert")
    with pytest.raises(EngineStartError, match=r"models.reward: .*Bert.*causal") as e:
        SglangEngine(EngineConfig(str(path), role="reward"), field="models.reward")
    assert "\n" not in str(e.value)


def test_reward_model_as_actor_is_refused(tiny_rm_path):
    with pytest.raises(EngineStartError, match=r"models.actor: .*ForSequenceClassification.*causal LM"):
        SglangEngine(EngineConfig(tiny_rm_path, role="actor"), field="models.actor")


@pytest.mark.slow
def test_engine_that_cannot_start_gives_one_line(tiny_actor_path):
    cfg = EngineConfig(tiny_actor_path, role="actor", max_total_tokens=8, context_length=4096)
    with pytest.raises(EngineStartError) as e:
        SglangEngine(cfg, field="models.actor")
    assert "\n" not in str(e.value) and "could not start the actor engine" in str(e.value)


@pytest.mark.slow
def test_sglang_arguments_reach_the_running_engine(actor_engine):
    """The shared actor engine starts with ``server_args={"watchdog_timeout": 600.0}``
    (tests/conftest.py); SGLang's default is 300."""
    assert actor_engine.cfg.server_args == (("watchdog_timeout", 600.0),)
    assert actor_engine._engine.server_args.watchdog_timeout == 600.0


@pytest.mark.parametrize("args, needle", [
    ({"sampling_backnd": "pytorch"}, r"engines.sglang.sampling_backnd: not an argument of SGLang 0\.5\.\d+'s "
                                     r"ServerArgs; did you mean 'sampling_backend'\?"),
    ({"stream_interval": "fast"}, r"engines.sglang.stream_interval: expected int, got 'fast' \(str\)"),
    ({"attention_backend": "triton"}, r"engines.sglang.attention_backend: the engine sets it itself"),
])
def test_bad_sglang_arguments_fail_in_one_line_before_any_process_starts(tiny_actor_path, args, needle):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(EngineConfigError) as e:  # named as colocate's config names them
        SglangEngine(EngineConfig(tiny_actor_path, role="actor", device="cpu", server_args=args))
    assert re.match(needle, str(in_config_terms(e.value))), str(e.value)
    assert "\n" not in str(e.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# SGLang's own text when a scheduler child dies while starting (sglang 0.5.x engine.py)
_DIED = ("Rank 0 scheduler died during initialization (exit code: {code}). If exit code is -9 "
         "(SIGKILL), a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.")


@pytest.mark.parametrize("text,hint", [
    (_DIED.format(code=-9), "not enough memory"),
    (_DIED.format(code=1), "its scheduler process failed while starting (Rank 0 scheduler died"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", "not enough memory"),
    ("Not enough memory. Please try to increase --mem-fraction-static.", "not enough memory"),
    ("Qwen9ForCausalLM architecture not supported", "SGLang does not support this architecture"),
])
def test_start_failures_get_the_hint_that_fits(text, hint):
    """A scheduler that died with exit code 1 is a Python error in SGLang, not memory, even
    though SGLang's message mentions the OOM killer."""
    from colocate.engine.start_checks import start_error

    err = in_config_terms(start_error(EngineConfig("/models/a", role="actor"), RuntimeError(text)))
    assert str(err).startswith(f"could not start the actor engine (/models/a): {hint}")
    assert "\n" not in str(err)
    if "failed while starting" in hint:  # SGLang's own error is in its log
        assert str(err).endswith("; set engines.log_level=info for SGLang's own log")


def _stream_until_stopped(engine, rid: str, stop_after: int, timeout_s: float):
    """Stream a long greedy request; after ``stop_after`` chunks stop (SIGSTOP) the engine's
    processes, as a scheduler that is alive but stuck; wait on the stream under run_guarded."""

    from colocate.engine.runtime import run_guarded

    async def go():
        n = 0
        async for _ in engine.generate_stream(rid, [1, 2, 3, 4], {"max_new_tokens": 400, "ignore_eos": True,
                                                                  "temperature": 0}):
            n += 1
            if n == stop_after:
                for pid in engine.child_pids:
                    psutil.Process(pid).suspend()
        return n

    return run_guarded([engine], asyncio.wait_for(go(), timeout_s))


def _resume_and_drain(engine, rid: str) -> None:

    for pid in engine.child_pids:
        psutil.Process(pid).resume()
    engine.abort(rid)
    deadline = time.monotonic() + 30
    while engine.in_flight() and time.monotonic() < deadline:
        engine.loop.run_until_complete(asyncio.sleep(0.1))
    assert engine.in_flight() == 0


def test_an_engine_alive_but_silent_with_a_request_in_flight_ends_the_wait_in_one_line(actor_engine):
    """engines.stall_timeout_s: processes alive (stopped here), a request in flight, nothing
    received: EngineStalledError after the timeout, in colocate's terms naming the field."""

    from colocate.engine.errors import EngineStalledError

    before = actor_engine.stall_timeout_s
    actor_engine.stall_timeout_s = 2.0
    started = time.monotonic()
    try:
        with pytest.raises(EngineStalledError) as info:
            _stream_until_stopped(actor_engine, "stall-1", stop_after=2, timeout_s=60)
        waited = time.monotonic() - started
    finally:
        actor_engine.stall_timeout_s = before
        _resume_and_drain(actor_engine, "stall-1")
    line = str(in_config_terms(info.value))
    assert "\n" not in line and "sent nothing back for" in line and "1 request(s) in flight" in line
    assert line.endswith("(engines.stall_timeout_s; raise it if generating or scoring is this slow)"), line
    assert 2.0 < waited < 20, waited  # the timeout, then the watch's next look (every 0.5 s)


def test_a_paused_engine_or_a_zero_timeout_is_never_a_stall(actor_engine):
    """Requests parked in a paused engine wait by design; stall_timeout_s=0 waits forever."""

    from colocate.engine.runtime import run_guarded

    before = actor_engine.stall_timeout_s
    actor_engine.stall_timeout_s = 0.0
    try:  # 0: the stream outlives a silence far past any timeout (asyncio's own 4 s ends it here)
        with pytest.raises(asyncio.TimeoutError):
            _stream_until_stopped(actor_engine, "stall-2", stop_after=2, timeout_s=4)
    finally:
        _resume_and_drain(actor_engine, "stall-2")
    actor_engine.stall_timeout_s = 1.0

    async def paused_past_the_timeout():  # under run_guarded, whose watch looks every 0.5 s
        chunks = 0
        async for _ in actor_engine.generate_stream("stall-3", [1, 2, 3, 4], {"max_new_tokens": 40,
                                                                             "ignore_eos": True, "temperature": 0}):
            chunks += 1
            if chunks == 2:
                await actor_engine.pause("in_place")  # CPU: its processes stopped too
                assert actor_engine.in_flight() == 1
                await asyncio.sleep(3.0)  # 3x the timeout, paused: not a stall
                await actor_engine.continue_generation()
        return chunks

    try:
        assert run_guarded([actor_engine], paused_past_the_timeout()) > 2  # it went on to its end
    finally:
        actor_engine.stall_timeout_s = before
        if actor_engine.paused is not None:
            actor_engine.continue_paused()
