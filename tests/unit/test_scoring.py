"""colocate.rollout.generate_and_score.Scorer: a response's reward = (model score + every reward function) ×
reward.scale, whichever way the model score came (streamed, one-shot, none)."""

from __future__ import annotations

import asyncio
import math

import pytest

from colocate.rollout.sample import Sample
from colocate.rollout.generate_and_score import Scorer


def _sample(index: int, out: list[int], record=None) -> Sample:
    s = Sample(index, [1, 2, 3], 8, record=record or {})
    s.output_ids = list(out)
    return s


def _length(record, text):  # sync
    return len(text)


async def _bonus(record, text):  # async
    await asyncio.sleep(0)
    return record.get("bonus", 0.0)


def _run(coro):
    return asyncio.run(coro)


def test_reward_sums_model_score_and_functions_then_scales():
    scorer = Scorer(fns=(_length, _bonus), decode=lambda ids: "x" * len(ids), scale=0.5)
    s = _sample(3, [7, 8, 9], {"bonus": 2.0})
    assert _run(scorer.reward(s, 1.25)) == pytest.approx((1.25 + 3 + 2.0) * 0.5)
    # a streamed model score is taken as is; without a reward model the model part is 0.0
    assert _run(scorer(s, 4.0, "t", 0)) == pytest.approx((4.0 + 3 + 2.0) * 0.5)
    assert _run(scorer(s, None, "t", 0)) == pytest.approx((0.0 + 3 + 2.0) * 0.5)


def test_score_all_keeps_sample_order_and_reference_sum():
    samples = [_sample(i, [0] * (i + 1), {"bonus": float(i)}) for i in range(5)]
    scorer = Scorer(fns=(_length, _bonus), decode=lambda ids: "y" * len(ids), scale=-2.0)
    got = _run(scorer.score_all(samples, "t", 1))
    want = []
    for s in samples:  # naive reference loop
        total = 0.0
        for fn in (lambda r, t: len(t), lambda r, t: r["bonus"]):
            total += fn(s.record, "y" * len(s.output_ids))
        want.append(total * -2.0)
    assert got == pytest.approx(want)


def test_model_scores_through_the_feeder_process_name_each_sample():
    seen = []

    async def whole(step, seqs, indices):
        seen.append((step, [list(p) + list(o) for p, o in seqs], list(indices)))
        return [float(sum(p) + sum(o)) for p, o in seqs]

    samples = [_sample(10, [4]), _sample(11, [5, 6])]
    scorer = Scorer(whole=whole, scale=2.0)
    assert _run(scorer.score_all(samples, "t", 7)) == [2.0 * (6 + 4), 2.0 * (6 + 11)]
    assert seen == [(7, [[1, 2, 3, 4], [1, 2, 3, 5, 6]], [10, 11])]
    assert scorer.engines == []  # nothing in this process to watch


def test_a_nan_from_a_function_stays_nan():
    scorer = Scorer(fns=(lambda r, t: float("nan"),), decode=lambda ids: "")
    assert math.isnan(_run(scorer.reward(_sample(0, []), 1.0)))


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def _decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def _trajectory(record: dict, turns: list[str], tool: str) -> Sample:
    """Model turns with the tool's answer ``tool`` after each but the last."""
    s = _sample(0, [], record)
    for k, turn in enumerate(turns):
        s.output_ids += _chars(turn)
        s.logprobs += [-0.5] * len(turn)
        s.versions += [0] * len(turn)
        if s.loss_mask:
            s.loss_mask += [1] * len(turn)
        if k < len(turns) - 1:
            s.append_observation(_chars(tool), {"role": "tool", "content": tool}, 0)
    return s


def test_functions_score_the_model_turns_only_and_get_the_trajectory_when_they_ask():
    from colocate.assets import tasks

    record = tasks.load_prompt_source("reasoning-gym:basic_arithmetic", 1, 0)[0].meta
    leak = f"<answer>{record['answer']}</answer>"
    s = _trajectory(record, ["let me use the tool", "I do not know"], leak)
    rule = tasks.reasoning_gym_reward("basic_arithmetic")
    assert rule(record, _decode(s.output_ids)) == 1.0  # the whole trajectory would credit the tool's answer
    seen = []

    def sees(record, text, messages):
        seen.append((text, messages))
        return 0.0

    scorer = Scorer(fns=(rule, sees), decode=_decode)
    assert _run(scorer.reward(s, 0.0)) == 0.0
    [(text, messages)] = seen
    assert text == "let me use the tool\nI do not know" and leak not in text
    assert messages == [{"role": "assistant", "content": "let me use the tool"},
                        {"role": "tool", "content": leak},
                        {"role": "assistant", "content": "I do not know"}]
    # the model's own final answer is what the rule scores
    right = _trajectory(record, ["let me use the tool", f"so: <answer>{record['answer']}</answer>"], "no idea")
    assert _run(Scorer(fns=(rule,), decode=_decode).reward(right, 0.0)) == 1.0
