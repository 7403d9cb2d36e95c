"""Reward engine on real SGLang (CPU): scores vs HF, incremental == one-shot, cache hits."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from colocate.engine import reward
from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample

pytestmark = pytest.mark.slow
SEQS = [[1, 10, 11, 12, 13, 14], [1, 99], list(range(3, 150)), [1, 7, 7, 7, 7, 7, 7, 7, 2]]


def run(engine, coro):
    return engine.loop.run_until_complete(coro)


def test_scores_match_hf_sequence_classification(reward_engine, tiny_rm_path):
    got = run(reward_engine, reward.score_many(reward_engine, SEQS, "hfrm"))
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_path, dtype=torch.float32)
    with torch.no_grad():
        want = [model(torch.tensor([s])).logits[0, 0].item() for s in SEQS]
    assert len(set(round(w, 3) for w in want)) == len(want)  # scores really differ
    for g, w in zip(got, want):
        assert abs(g - w) < 1e-4


def test_incremental_equals_one_shot_and_hits_the_cache(reward_engine):
    prompt = list(range(20, 120))  # 100-token prompt
    response = list(range(130, 226))  # 96 tokens in 3 chunks of 32
    inc = reward.IncrementalScorer(reward_engine, "grow", prompt)
    seen = [reward_engine.cache_stats()]
    run(reward_engine, inc.extend([]))  # prompt alone
    seen.append(reward_engine.cache_stats())
    for k in range(0, 96, 32):
        run(reward_engine, inc.extend(response[k : k + 32]))
        seen.append(reward_engine.cache_stats())
    cached = [b["cached_tokens"] - a["cached_tokens"] for a, b in zip(seen, seen[1:])]
    prompted = [b["prompt_tokens"] - a["prompt_tokens"] for a, b in zip(seen, seen[1:])]
    assert prompted == [100, 132, 164, 196]
    assert cached == [0, 100, 132, 164]  # each chunk prefills only its own 32 tokens
    one_shot = run(reward_engine, reward.score(reward_engine, prompt + response, "once"))
    assert abs(inc.last_score - one_shot) < 1e-5
    reward_engine.flush_cache()
    fresh = run(reward_engine, reward.score(reward_engine, prompt + response, "fresh"))
    assert abs(fresh - one_shot) < 1e-5


def test_actor_and_reward_serve_concurrently(actor_engine, reward_engine):
    greedy = {"temperature": 0.0, "ignore_eos": True}
    alone_s = [Sample(i, [1, 5 + i, 9], 24) for i in range(3)]
    run(actor_engine, generate_and_score.generate(actor_engine, alone_s, greedy, "alon"))
    alone_r = run(reward_engine, reward.score_many(reward_engine, SEQS, "alon"))

    async def together():
        samples = [Sample(i, [1, 5 + i, 9], 24) for i in range(3)]
        scorers = [reward.IncrementalScorer(reward_engine, f"cc{i:04d}", s.prompt_ids) for i, s in enumerate(samples)]

        async def feed(sample, new_ids):  # score each chunk while decoding continues
            await scorers[sample.index].extend(new_ids)

        gen = generate_and_score.generate(actor_engine, samples, greedy, "conc", on_tokens=feed)
        _, scores = await asyncio.gather(gen, reward.score_many(reward_engine, SEQS, "conc"))
        return samples, scores, scorers

    samples, scores, scorers = run(actor_engine, together())
    assert [s.output_ids for s in samples] == [s.output_ids for s in alone_s]
    assert max(abs(a - b) for a, b in zip(scores, alone_r)) < 1e-5
    finals = run(reward_engine, reward.score_many(
        reward_engine, [s.prompt_ids + s.output_ids for s in samples], "fin"))
    assert max(abs(sc.last_score - f) for sc, f in zip(scorers, finals)) < 1e-5
