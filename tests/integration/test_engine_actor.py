"""Actor engine on real SGLang (CPU, tiny random models) against HF transformers."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from colocate.rollout import generate_and_score
from colocate.rollout.sample import PromptTooLongError, Sample

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0}
PROMPTS = [[1, 40, 41, 42, 43], [1, 90, 7], [1, 200, 201, 202, 203, 204, 205, 206], [1, 3]]


def hf_greedy(path_or_model, prompt, n):
    """Token ids and their logprobs from HF greedy decoding, one prompt, no padding."""
    model = path_or_model
    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logps


def run(engine, coro):
    return engine.loop.run_until_complete(coro)


def test_greedy_matches_hf_tokens_and_logprobs(actor_engine, tiny_actor_path):
    samples = [Sample(i, p, 12) for i, p in enumerate(PROMPTS)]
    run(actor_engine, generate_and_score.generate(actor_engine, samples, {**GREEDY, "ignore_eos": True}, "hfeq"))
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    for s in samples:
        tokens, logps = hf_greedy(model, s.prompt_ids, 12)
        assert s.output_ids == tokens
        assert len(s.logprobs) == len(tokens) == len(s.versions)
        assert max(abs(a - b) for a, b in zip(s.logprobs, logps)) < 1e-4
        assert s.finish_reason == "length"


def test_qwen2_actor_matches_hf(tiny_qwen_path):
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    eng = SglangEngine(EngineConfig(tiny_qwen_path, role="actor", device="cpu", max_total_tokens=4096))
    try:
        s = Sample(0, PROMPTS[0], 10)
        run(eng, generate_and_score.generate(eng, [s], {**GREEDY, "ignore_eos": True}, "qwen"))
        tokens, logps = hf_greedy(tiny_qwen_path, s.prompt_ids, 10)
        assert s.output_ids == tokens
        assert max(abs(a - b) for a, b in zip(s.logprobs, logps)) < 1e-4
    finally:
        eng.shutdown()


def test_abort_then_resume_equals_uninterrupted(actor_engine):
    budget = 40
    full = Sample(0, PROMPTS[2], budget)
    run(actor_engine, generate_and_score.generate(actor_engine, [full], {**GREEDY, "ignore_eos": True}, "full"))

    part = Sample(0, PROMPTS[2], budget)

    async def interrupted():
        task = asyncio.ensure_future(
            generate_and_score.stream_sample(actor_engine, part, {**GREEDY, "ignore_eos": True}, "abrt"))
        while len(part.output_ids) < 6:
            await asyncio.sleep(0.002)
        generate_and_score.abort(actor_engine, part, "abrt")
        await task

    run(actor_engine, interrupted())
    k = len(part.output_ids)
    assert part.finish_reason == "abort" and 6 <= k < budget
    assert part.remaining == budget - k
    run(actor_engine, generate_and_score.stream_sample(actor_engine, part, {**GREEDY, "ignore_eos": True}, "abrt"))
    assert part.output_ids == full.output_ids
    assert len(part.output_ids) == budget == len(part.logprobs)
    assert max(abs(a - b) for a, b in zip(part.logprobs, full.logprobs)) < 1e-4
    # a sample whose budget is spent is never sent again
    run(actor_engine, generate_and_score.stream_sample(actor_engine, part, GREEDY, "abrt"))
    assert len(part.output_ids) == budget and part.finish_reason == "length"


def test_prompt_longer_than_context_is_refused(actor_engine):
    ctx = actor_engine.context_length
    s = Sample(3, [1] * (ctx - 5), 16)
    with pytest.raises(PromptTooLongError, match=r"prompts\[3\].*context length"):
        run(actor_engine, generate_and_score.generate(actor_engine, [s], GREEDY, "long"))


def test_sampling_is_seeded_and_logprobs_are_finite(actor_engine):
    samples = [Sample(i, PROMPTS[1], 16) for i in range(4)]
    run(actor_engine, generate_and_score.generate(actor_engine, samples, {"temperature": 1.0, "ignore_eos": True}, "samp"))
    outs = {tuple(s.output_ids) for s in samples}
    assert len(outs) > 1  # temperature 1 on a random model: different continuations
    for s in samples:
        assert all(lp <= 0.0 and lp > -50 for lp in s.logprobs)
