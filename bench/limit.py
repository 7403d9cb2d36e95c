"""The lower bound of a PPO step, and how close each mode gets to it.

Per step: max(actor decode of the B trained responses at the engine's measured
full-batch decode throughput, their reward-model prefill at its measured prefill
throughput) + training phases + weight sync. Generation and scoring can overlap each
other perfectly at best, and no overlap hides training or sync in this design.

Owns: measuring the two throughputs once per workload on the session's own engines, and
the per-step bound and efficiency; on CUDA also the decode step's own bound (reading the
actor's weights once per step at the device's measured bandwidth: `decode_bound_ms`) and
how far the measured full-batch decode step is above it. Leaves out: the runs themselves.
"""

from __future__ import annotations

import time
from typing import Any

TRAIN_PHASES = ("ref", "old_logp", "values", "advantages", "critic", "actor", "sleep_wake")


def probe(session, tokens: int = 32) -> dict[str, float]:
    """Decode tokens/s of a full batch on the actor engine; prefill tokens/s of the
    reward engine on the same sequences from scratch."""
    from colocate.engine import reward as rm
    from colocate.rollout import generate_and_score
    from colocate.rollout.sample import Sample

    B = session.cfg.rollout.batch_size + session.cfg.overlap.delta_max
    prompts = [list(p.ids) for p in session.data.prompts[:B]] or [[1, 2, 3]] * B
    samples = [Sample(i, p, tokens) for i, p in enumerate(prompts)]
    loop = session.actor.loop
    warm = [Sample(i, p, 4) for i, p in enumerate(prompts)]
    loop.run_until_complete(generate_and_score.generate(session.actor, warm, {"temperature": 1.0, "ignore_eos": True}, "probw"))
    session.actor.flush_cache()
    t = time.perf_counter()
    loop.run_until_complete(generate_and_score.generate(session.actor, samples, {"temperature": 1.0, "ignore_eos": True}, "probe"))
    decode_s = time.perf_counter() - t
    out = {"decode_tokens_per_s": sum(len(s.output_ids) for s in samples) / decode_s, "probe_batch": B}
    out["decode_step_ms"] = 1000.0 * decode_s / tokens  # a token of every sample a step (their prefill spread over them)
    if session.actor.device == "cuda":
        weights = session.sync_mb() * 2**20  # the actor's weights in the engine's dtype, a tied head once
        out.update(decode_bound(weights, device_read_bytes_per_s(), out["decode_step_ms"]))
        # what no release frees: each engine scheduler's CUDA context (one process per TP rank)
        engines = [e for e in (session.actor, session.reward_engine) if e is not None]
        out["engine_processes"] = sum(e.cfg.tp_size for e in engines)
        out["cuda_context_gib"] = cuda_context_bytes() / 2**30
    if session.reward_engine is not None:
        seqs = [s.prompt_ids + s.output_ids for s in samples]
        loop.run_until_complete(rm.score_many(session.reward_engine, [q[:8] for q in seqs], "probw"))
        session.reward_engine.flush_cache()
        t = time.perf_counter()
        loop.run_until_complete(rm.score_many(session.reward_engine, seqs, "probe"))
        out["prefill_tokens_per_s"] = sum(map(len, seqs)) / (time.perf_counter() - t)
        session.reward_engine.flush_cache()
    session.actor.flush_cache()
    return out


def decode_bound(weight_bytes: float, read_bytes_per_s: float, step_ms: float) -> dict[str, float]:
    """A decode step reads every weight once: ``weight_bytes`` at ``read_bytes_per_s`` is its
    floor (launches, the KV cache's reads and sampling come on top). Returns the floor, the
    inputs, and how many times the floor the measured ``step_ms`` is."""
    bound_ms = 1000.0 * weight_bytes / read_bytes_per_s
    return {"decode_bound_ms": bound_ms, "weights_gb": weight_bytes / 1e9,
            "device_read_gb_per_s": read_bytes_per_s / 1e9, "decode_vs_bound": step_ms / bound_ms}


def device_read_bytes_per_s(size_bytes: int = 2**30, repeats: int = 10) -> float:
    """The current CUDA device's copy bandwidth in bytes read per second (a device-to-device
    copy of ``size_bytes``, the best of ``repeats``; each copy reads and writes it once)."""
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return size_bytes / best


def cuda_context_bytes(timeout_s: float = 120.0) -> int:
    """Device memory one process's CUDA context holds (torch initialised, one tiny tensor on
    the device): the part of an engine's memory that no release can free. Read as the drop
    of the device's free memory while a child process holds it; 0 if the child never gets
    there within ``timeout_s`` (it is killed then)."""
    import subprocess
    import sys
    import threading

    import torch

    code = "import sys, torch; torch.zeros(1, device='cuda'); print('ready', flush=True); sys.stdin.read()"
    before = torch.cuda.mem_get_info()[0]
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    killer = threading.Timer(timeout_s, child.kill)
    killer.start()
    try:
        held = before - torch.cuda.mem_get_info()[0] if child.stdout.readline().startswith("ready") else 0
    finally:
        killer.cancel()
        child.kill()
        child.wait()
    return max(held, 0)


def step_bound(rec: dict[str, Any], probe_result: dict[str, float]) -> float:
    """Lower bound (seconds) for the step ``rec`` given the probed throughputs."""
    resp = rec["response_len"] * rec["trained_samples"]
    total = resp + rec.get("prompt_len", 0.0) * rec["trained_samples"]
    decode = resp / probe_result["decode_tokens_per_s"]
    prefill = total / probe_result.get("prefill_tokens_per_s", float("inf"))
    train = sum(rec.get(f"time/{p}", 0.0) for p in TRAIN_PHASES)
    return max(decode, prefill) + train + rec.get("time/sync", 0.0)
