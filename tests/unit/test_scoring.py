"""colocate.rollout.scoring.Scorer: a response's reward = (model score + every reward function) ×
reward.scale, whichever way the model score came (streamed, one-shot, none)."""

from __future__ import annotations

import asyncio
import math

import pytest

from colocate.engine.rollout import Sample
from colocate.rollout.scoring import Scorer


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


def test_deferred_scores_of_an_older_checkpoint_get_reward_scale_once():
    """Checkpoints written before the reward included reward.scale hold unscaled deferred
    scores: scaled on load; newer ones (``scores_scaled``) load as they are."""
    import dataclasses

    from colocate.config import load_config
    from colocate.rollout.rollouts import Rollouts

    cfg = load_config(overrides=["reward.scale=2.0"])
    done = _sample(0, [5, 6])
    done.finish_reason, done.score = "stop", 1.5
    partial = _sample(1, [7])  # not finished: no score yet
    for flag, want in (({}, 3.0), ({"scores_scaled": True}, 1.5)):
        rollouts = Rollouts(cfg, None, None, None)  # sequential: no engine needed to hold state
        saved = rollouts.state_dict()
        saved["scheduler"]["deferred"] = [dataclasses.asdict(done), dataclasses.asdict(partial)]
        saved.pop("scores_scaled")
        rollouts.load_state_dict({**saved, **flag})
        assert [s.score for s in rollouts.scheduler.deferred] == [want, None]
        rollouts.close()
