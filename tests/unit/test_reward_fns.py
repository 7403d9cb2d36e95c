"""reward.on_error: a raising reward function fails the step in one line, or scores 0.0 and is counted."""

from __future__ import annotations

import asyncio
import time

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


class _Tensorish:
    """A one-element array-like (numpy / torch scalars): has ``__float__``."""

    def __init__(self, x):
        self.x = x

    def __float__(self):
        return float(self.x)


@pytest.mark.parametrize("value,why", [
    (float("nan"), "returned nan (not finite)"),
    (float("inf"), "returned inf (not finite)"),
    (-float("inf"), "returned -inf (not finite)"),
    ("1.0", "returned str '1.0', not a number"),
    (None, "returned NoneType 'None', not a number"),
    ([1.0], "returned list '[1.0]', not a number"),
    (_Tensorish(float("nan")), "returned nan (not finite)"),
])
def test_a_value_that_is_no_finite_number_fails_in_one_line_naming_function_and_sample(value, why):
    def returns(record, text):
        return value

    errors = RewardFnErrors()
    with pytest.raises(RewardFnError) as e:
        asyncio.run(guarded(returns, "raise", errors)({}, "x", sample=17))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"reward function {returns.__qualname__} {why} (sample 17); ")
    assert "reward.on_error=zero" in msg
    zero = guarded(returns, "zero", errors)
    assert asyncio.run(zero({}, "x", sample=3)) == 0.0
    assert errors.take() == 1 and errors.last.endswith("(sample 3)")


def test_numbers_of_other_types_are_taken():
    errors = RewardFnErrors()
    for value, want in ((3, 3.0), (True, 1.0), (_Tensorish(0.25), 0.25), (-1e300, -1e300)):
        assert asyncio.run(guarded(lambda r, t, v=value: v, "raise", errors)({}, "")) == want
    assert errors.count == 0


def test_messages_reach_only_a_function_that_asks_and_are_built_only_then():
    built = []

    def messages():
        built.append(1)
        return [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]

    def asks(record, text, messages):
        return len(messages)

    def asks_by_kwargs(record, text, **kw):
        return 10 * len(kw["messages"])

    errors = RewardFnErrors()
    assert asyncio.run(guarded(good, "raise", errors)({}, "abc", messages)) == 3.0
    assert built == []  # nobody asked: never built
    assert asyncio.run(guarded(asks, "raise", errors)({}, "abc", messages)) == 2.0
    assert asyncio.run(guarded(asks_by_kwargs, "raise", errors)({}, "abc", messages)) == 20.0
    assert built == [1, 1]


# ---- reward.fn_timeout_s ---------------------------------------------------------------
async def hangs(record, text):
    await asyncio.Event().wait()  # a request to a server that never answers


def test_an_async_call_past_the_deadline_is_cancelled_and_fails_in_one_line():
    errors = RewardFnErrors()
    with pytest.raises(RewardFnError) as e:
        asyncio.run(asyncio.wait_for(guarded(hangs, "raise", errors, 0.2)({}, "x", sample=4), timeout=10))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward function hangs did not return within 0.2 s "
                                              "(reward.fn_timeout_s) (sample 4); ")
    assert asyncio.run(asyncio.wait_for(guarded(hangs, "zero", errors, 0.2)({}, "x", sample=5), timeout=10)) == 0.0
    assert errors.take() == 1 and "did not return within" in errors.last


def _sleeps(ended: list):
    """An async function that sleeps 30 s and notes in ``ended`` that its ``finally`` ran."""
    async def slow(record, text):
        try:
            await asyncio.sleep(30)
        finally:
            ended.append("its finally ran")

    return slow


def test_the_deadline_ends_the_call_itself():
    ended = []
    slow = _sleeps(ended)

    async def main():
        with pytest.raises(RewardFnError):
            await guarded(slow, "raise", RewardFnErrors(), 0.1)({}, "x")
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == [] and ended == ["its finally ran"]  # cancelled: nothing of it left


def test_a_call_within_the_deadline_or_without_one_is_unchanged():
    async def quick(record, text):
        await asyncio.sleep(0.05)
        return 2

    errors = RewardFnErrors()
    assert asyncio.run(guarded(quick, "raise", errors, 5.0)({}, "x")) == 2.0
    assert asyncio.run(guarded(quick, "raise", errors, 0.0)({}, "x")) == 2.0  # 0: no deadline
    assert errors.count == 0


def test_a_sync_call_past_the_deadline_is_said_once_and_its_value_kept():
    """A plain def function runs on the loop's thread (math_verify's signal timeouts need
    it): it cannot be cut off, so one line names it and the sample, and the step waits."""
    said = []

    def slow(record, text):
        time.sleep(1.6)
        return 1.5

    fn = guarded(slow, "raise", RewardFnErrors(), 0.3, said.append)
    assert asyncio.run(fn({}, "x", sample=9)) == 1.5
    assert len(said) == 1 and said[0].startswith("reward function ") and "slow on sample 9 has run" in said[0]
    assert "reward.fn_timeout_s 0.3" in said[0] and "async def" in said[0]
    assert asyncio.run(guarded(lambda r, t: 1, "raise", RewardFnErrors(), 0.3, said.append)({}, "x")) == 1.0
    time.sleep(1.2)
    assert len(said) == 1  # a quick call is never reported, nor the slow one twice


def test_a_cancelled_step_ends_the_call_it_waits_for():
    """The step's own cancellation (an engine died: run_guarded cancels it) reaches the call."""
    ended = []
    slow = _sleeps(ended)

    async def main():
        step = asyncio.ensure_future(guarded(slow, "raise", RewardFnErrors(), 20.0)({}, "x"))
        await asyncio.sleep(0.05)
        step.cancel()
        await asyncio.wait({step}, timeout=5)
        await asyncio.sleep(0)
        return step.cancelled(), [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == (True, []) and ended == ["its finally ran"]
