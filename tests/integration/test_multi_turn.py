"""Multi-turn trajectories on real SGLang (CPU, tiny random model, the scripted environment):
token-exact against a naive turn-by-turn reference, deferral mid-turn and between turns,
and the environment's error paths."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from transformers import AutoTokenizer

from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample
from colocate.rollout.env import Observation
from colocate.rollout.scripted_env import ScriptedEnv
from colocate.rollout.turns import EnvError, EnvErrors, EnvTurns, ObservationTemplate

pytestmark = pytest.mark.slow
STOP = [2, 0]  # the tiny tokenizer's <|im_end|> and pad
GREEDY = {"temperature": 0.0, "stop_token_ids": STOP}
TURN = 7  # tokens per model turn: a random model rarely ends a turn itself
REPLIES = ("first answer", "2 + 2 = 4")


@pytest.fixture(scope="module")
def tokenizer(tiny_actor_path):
    return AutoTokenizer.from_pretrained(tiny_actor_path)


def turns_of(tokenizer, env, *, max_turns=3, timeout_s=30.0, on_error="raise", errors=None):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return EnvTurns(env, ObservationTemplate(tokenizer, STOP), decode, max_turns=max_turns, turn_tokens=TURN,
                    timeout_s=timeout_s, on_error=on_error, errors=errors)


def run(engine, coro):
    return engine.loop.run_until_complete(coro)


def prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]


def naive_reference(engine, tokenizer, prompt_ids, budget):
    """Turn by turn, by hand: one request per model turn on the whole context so far; the
    scripted answers spelled out in ChatML (the tiny tokenizer's template) and encoded."""
    context, out, mask, k = list(prompt_ids), [], [], 0

    async def one_turn(ids, n):
        got = []
        async for chunk in engine.generate_stream(f"naive-{k:04d}-{len(ids):06d}", ids, {**GREEDY, "max_new_tokens": n}):
            got = list(chunk["output_ids"])
        return got

    while True:
        model = run(engine, one_turn(context + out, min(TURN, budget - len(out))))
        out += model
        mask += [1] * len(model)
        if k >= len(REPLIES) or k + 1 >= 3 or len(out) >= budget:  # done / max_turns / budget
            return out, mask
        closing = "" if model[-1] in STOP else "<|im_end|>"
        env = tokenizer(f"{closing}\n<|im_start|>tool\n{REPLIES[k]}<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"]
        if len(env) >= budget - len(out):
            return out, mask
        out += env
        mask += [0] * len(env)
        k += 1


def test_trajectory_equals_a_naive_turn_by_turn_reference(actor_engine, tokenizer):
    budget = 96
    ids = prompt(tokenizer)
    s = Sample(0, list(ids), budget)
    turns = turns_of(tokenizer, ScriptedEnv(replies=REPLIES, turn_rewards=(0.25, 0.5), final_reward=1.0))
    run(actor_engine, generate_and_score.generate(actor_engine, [s], GREEDY, "mt", turns=turns.multi_turn()))
    ref_out, ref_mask = naive_reference(actor_engine, tokenizer, ids, budget)
    assert s.output_ids == ref_out
    assert s.mask() == ref_mask
    assert s.turns == 3 and [o["content"] for o in s.observations] == list(REPLIES)
    assert s.env_reward == pytest.approx(0.25 + 0.5 + 1.0)  # two replies, then done at the third turn
    assert s.finish_reason == "stop" and not s.awaiting_env
    assert len(s.logprobs) == len(s.versions) == len(s.output_ids)
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask()) if not m)  # no behaviour logprob on env tokens
    assert all(lp < 0.0 for lp, m in zip(s.logprobs, s.mask()) if m)
    assert s.turn_cached_tokens > 0  # later turns found the context so far in the radix cache


def _uninterrupted(engine, tokenizer, turns, budget=96):
    s = Sample(1, list(prompt(tokenizer)), budget)
    run(engine, generate_and_score.generate(engine, [s], GREEDY, "un", turns=turns))
    return s


def _resumed(engine, turns, part):
    """``part`` through a checkpoint (JSON-safe fields) and resumed to its end."""
    again = Sample(**dataclasses.asdict(part))
    run(engine, generate_and_score.stream_sample(engine, again, GREEDY, "re", turns=turns))
    return again


def test_deferred_mid_turn_resumes_to_the_uninterrupted_trajectory(actor_engine, tokenizer):
    turns = turns_of(tokenizer, ScriptedEnv(replies=REPLIES)).multi_turn()
    full = _uninterrupted(actor_engine, tokenizer, turns)
    part = Sample(1, list(prompt(tokenizer)), 96)
    # inside the last model turn, early enough that the abort lands before its end also on a
    # busy machine (at len - 3 the last 3 tokens once streamed out before the abort took)
    cut_at = len(full.output_ids) - (TURN - 1)

    async def interrupted():
        async def on_tokens(sample, ids):
            if len(sample.output_ids) >= cut_at and sample.mask()[-1]:
                generate_and_score.abort(actor_engine, sample, "mid")

        await generate_and_score.stream_sample(actor_engine, part, GREEDY, "mid", on_tokens, turns=turns)

    run(actor_engine, interrupted())
    assert part.finish_reason == "abort" and cut_at <= len(part.output_ids) < len(full.output_ids)
    done = _resumed(actor_engine, turns, part)
    assert (done.output_ids, done.mask(), done.observations) == (full.output_ids, full.mask(), full.observations)
    assert done.finish_reason == full.finish_reason and done.env_reward == full.env_reward


def test_deferred_between_turns_resumes_to_the_uninterrupted_trajectory(actor_engine, tokenizer):
    turns = turns_of(tokenizer, ScriptedEnv(replies=REPLIES)).multi_turn()
    full = _uninterrupted(actor_engine, tokenizer, turns)
    part = Sample(1, list(prompt(tokenizer)), 96)
    # the step's cut lands while the environment answers the first turn: no request to abort
    async def cut() -> bool:
        return False

    run(actor_engine, generate_and_score.stream_sample(actor_engine, part, GREEDY, "btw", turns=turns, go_on=cut))
    assert part.finish_reason == "abort" and len(part.observations) == 1 and not part.mask()[-1]
    done = _resumed(actor_engine, turns, part)
    assert (done.output_ids, done.mask(), done.observations) == (full.output_ids, full.mask(), full.observations)


def test_deferred_while_awaiting_the_environment_asks_it_on_resume(actor_engine, tokenizer):
    """A checkpoint taken while the environment had not answered (a parked trajectory, saved
    as an abort there gives it): the resumed trajectory asks it first, then goes on exactly."""
    turns = turns_of(tokenizer, ScriptedEnv(replies=REPLIES)).multi_turn()
    full = _uninterrupted(actor_engine, tokenizer, turns)
    first = full.mask().index(0)  # the first model turn's tokens
    part = dataclasses.replace(full, index=1, output_ids=full.output_ids[:first], logprobs=full.logprobs[:first],
                               versions=full.versions[:first], loss_mask=[], observations=[], awaiting_env=True,
                               finish_reason="abort", env_reward=0.0)
    done = _resumed(actor_engine, turns, part)
    assert (done.output_ids, done.mask(), done.observations) == (full.output_ids, full.mask(), full.observations)


class _Async:
    name, instruction = "slow-tool", ""

    async def step(self, record, history):
        await asyncio.sleep(60)
        return Observation("never")


class _Answers:
    """Answers every turn with ``obs`` (an Observation that is not one a rollout may take)."""

    instruction = ""

    def __init__(self, name: str, obs: Observation):
        self.name, self.obs = name, obs

    def step(self, record, history):
        return self.obs


@pytest.mark.parametrize("env,cause", [
    (ScriptedEnv(fail_at=1), "raised RuntimeError: scripted failure at turn 1"),
    (ScriptedEnv(garbage_at=0), "returned int '42', not an Observation"),
    (ScriptedEnv(hang_at=0), "did not answer within 0.5 s"),
    (_Async(), "did not answer within 0.5 s"),
    (_Answers("bytes-tool", Observation(b"42")), "text/role is not a string"),  # type: ignore[arg-type]
    (_Answers("nan-tool", Observation("4", reward=float("nan"))), "non-finite or non-numeric reward nan"),
    (_Answers("inf-tool", Observation("4", reward=float("-inf"))), "non-finite or non-numeric reward -inf"),
    (_Answers("str-reward-tool", Observation("4", reward="1")), "non-finite or non-numeric reward '1'"),  # type: ignore[arg-type]
])
def test_an_environment_failure_is_one_line_naming_it_and_the_turn(actor_engine, tokenizer, env, cause):
    s = Sample(2, list(prompt(tokenizer)), 96)
    turns = turns_of(tokenizer, env, timeout_s=0.5)
    with pytest.raises(EnvError) as info:
        run(actor_engine, generate_and_score.generate(actor_engine, [s], GREEDY, "err", turns=turns.multi_turn()))
    line = str(info.value)
    assert "\n" not in line and f"rollout.env {env.name}: turn " in line and "of sample 2" in line
    assert cause in line and "reward.on_error=zero" in line
    assert len(s.output_ids) >= TURN  # what was generated stays on the sample


def test_on_error_zero_ends_the_trajectory_there_and_counts_it(actor_engine, tokenizer):
    errors = EnvErrors()
    s = Sample(3, list(prompt(tokenizer)), 96)
    turns = turns_of(tokenizer, ScriptedEnv(replies=REPLIES, turn_rewards=(0.25, 0.5), fail_at=1),
                     on_error="zero", errors=errors)
    run(actor_engine, generate_and_score.generate(actor_engine, [s], GREEDY, "zero", turns=turns.multi_turn()))
    assert errors.count == 1 and "turn 2 of sample 3" in errors.last
    assert s.turns == 2 and len(s.observations) == 1 and s.env_reward == 0.25
    assert s.finish_reason == "stop" and s.mask()[-1] == 1


def test_streamed_scores_of_trajectories_cover_the_environments_tokens(actor_engine, reward_engine, tokenizer):
    """Chunks streamed to the reward model as a trajectory grows include the environment's
    answers: the streamed score equals a one-shot score of the whole trajectory."""
    from colocate.engine import reward
    from colocate.rollout import schedule
    from tests.integration.test_overlap import _with_feeder

    samples = [Sample(10 + i, list(prompt(tokenizer)) + [40 + i], 96) for i in range(3)]
    turns = turns_of(tokenizer, ScriptedEnv(replies=REPLIES)).multi_turn()

    async def body(feeder, client):
        return await schedule.Schedule(actor_engine, turns=turns).run(samples, GREEDY, 0, stream=schedule.Stream(client, 4))

    _, res = _with_feeder(actor_engine.loop, reward_engine, body)
    assert len(res.completed) == 3 and all(0 in s.mask() for s in samples)
    after = run(actor_engine, reward.score_many(reward_engine, [s.prompt_ids + s.output_ids for s in samples], "after"))
    for s, want in zip(samples, after):
        assert s.score == pytest.approx(want, abs=1e-5)


class _SlowForLong:
    """Ends a trajectory whose record says ``short`` at once; answers the others slowly."""

    name, instruction = "slow-for-long", ""

    async def step(self, record, history):
        if record.get("short"):
            return Observation(done=True)
        await asyncio.sleep(0.5)
        return await ScriptedEnv(replies=REPLIES).step(record, history)


def test_a_trajectory_parked_between_turns_waits_for_the_next_step_then_goes_on_exactly(actor_engine, tokenizer):
    """overlap.pause_mode=in_place: the cut lands while B's environment answers; B's
    answer is appended, then it sends nothing while parked; the next step adopts it and it
    ends exactly as an uninterrupted B (same weights)."""
    from colocate.rollout import schedule
    from colocate.rollout.schedule import LiveRequests

    turns = turns_of(tokenizer, _SlowForLong()).multi_turn()
    full = _uninterrupted(actor_engine, tokenizer, turns)
    a = Sample(20, list(prompt(tokenizer)), 96, record={"short": True})
    b = Sample(1, list(prompt(tokenizer)), 96)
    live = LiveRequests()
    first = run(actor_engine, schedule.Schedule(actor_engine, pause_mode="in_place", live=live, turns=turns).run(
        [a, b], GREEDY, 0, cut_after=1))
    assert [s.index for s in first.completed] == [20] and 1 in live
    (cut,) = first.unfinished
    assert cut.awaiting_env and cut.turns == 1  # cut between turns: the environment was answering

    async def parked_for(seconds):
        await asyncio.sleep(seconds)

    run(actor_engine, parked_for(1.5))  # the answer arrives meanwhile; no next turn is sent
    parked = live._live[1].sample
    assert parked is cut  # one object, never copied
    assert len(parked.observations) == 1 and parked.mask()[-1] == 0 and not parked.awaiting_env
    served = actor_engine.requests
    run(actor_engine, parked_for(0.5))
    assert actor_engine.requests == served and parked.turns == 1

    second = run(actor_engine, schedule.Schedule(actor_engine, pause_mode="in_place", live=live, turns=turns).run(
        [cut], GREEDY, 1))
    (done,) = second.completed
    assert (done.output_ids, done.mask(), done.observations) == (full.output_ids, full.mask(), full.observations)
    assert not len(live)
