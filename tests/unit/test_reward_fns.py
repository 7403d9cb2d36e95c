"""reward.on_error: a raising reward function fails the step in one line, or scores 0.0 and is counted."""

from __future__ import annotations

import asyncio

import pytest

from colocate.rollout.reward_fns import RewardFnError, RewardFnErrors, guarded


def bad(record, text):
    raise KeyError("answer\nsecond line")


async def good(record, text):
    return len(text)


def test_raise_names_the_function_and_the_fix_in_one_line():
    errors = RewardFnErrors()
    with pytest.raises(RewardFnError) as e:
        asyncio.run(guarded(bad, "raise", errors)({}, "x"))
    msg = str(e.value)
    assert "\n" not in msg and "bad" in msg and "KeyError" in msg and "reward.on_error=zero" in msg
    assert errors.count == 0


def test_zero_scores_zero_and_counts_until_taken():
    errors = RewardFnErrors()
    fn = guarded(bad, "zero", errors)
    assert [asyncio.run(fn({}, "x")) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert errors.take() == 3 and errors.take() == 0 and "KeyError" in errors.last


def test_working_functions_sync_and_async_are_unchanged():
    errors = RewardFnErrors()
    assert asyncio.run(guarded(good, "raise", errors)({}, "abcd")) == 4.0
    assert asyncio.run(guarded(lambda r, t: 0.5, "zero", errors)({}, "")) == 0.5
    assert errors.count == 0
