"""The lower bound of a PPO step, and how close each mode gets to it.

Per step: max(actor decode of the B trained responses at the engine's measured
full-batch decode throughput, their reward-model prefill at its measured prefill
throughput) + training phases + weight sync. Generation and scoring can overlap each
other perfectly at best, and no overlap hides training or sync in this design.

Owns: measuring the two throughputs once per workload on the session's own engines, and
the per-step bound and efficiency. Leaves out: the runs themselves.
"""

from __future__ import annotations

import time
from typing import Any

TRAIN_PHASES = ("ref", "old_logp", "values", "advantages", "critic", "actor", "sleep_wake")


def probe(session, tokens: int = 32) -> dict[str, float]:
    """Decode tokens/s of a full batch on the actor engine; prefill tokens/s of the
    reward engine on the same sequences from scratch."""
    from colocate.engine import reward as rm
    from colocate.rollout import generation
    from colocate.rollout.sample import Sample

    B = session.cfg.rollout.batch_size + session.cfg.overlap.delta_max
    prompts = [list(p.ids) for p in session.data.prompts[:B]] or [[1, 2, 3]] * B
    samples = [Sample(i, p, tokens) for i, p in enumerate(prompts)]
    loop = session.actor.loop
    warm = [Sample(i, p, 4) for i, p in enumerate(prompts)]
    loop.run_until_complete(generation.generate(session.actor, warm, {"temperature": 1.0, "ignore_eos": True}, "probw"))
    session.actor.flush_cache()
    t = time.perf_counter()
    loop.run_until_complete(generation.generate(session.actor, samples, {"temperature": 1.0, "ignore_eos": True}, "probe"))
    decode_s = time.perf_counter() - t
    out = {"decode_tokens_per_s": sum(len(s.output_ids) for s in samples) / decode_s, "probe_batch": B}
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


def step_bound(rec: dict[str, Any], probe_result: dict[str, float]) -> float:
    """Lower bound (seconds) for the step ``rec`` given the probed throughputs."""
    resp = rec["response_len"] * rec["trained_samples"]
    total = resp + rec.get("prompt_len", 0.0) * rec["trained_samples"]
    decode = resp / probe_result["decode_tokens_per_s"]
    prefill = total / probe_result.get("prefill_tokens_per_s", float("inf"))
    train = sum(rec.get(f"time/{p}", 0.0) for p in TRAIN_PHASES)
    return max(decode, prefill) + train + rec.get("time/sync", 0.0)
