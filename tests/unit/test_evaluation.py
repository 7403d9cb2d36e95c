"""Held-out evaluation: which prompts are held out, and when an evaluation is due."""

from __future__ import annotations

from colocate.rollout.evaluation import due, held_out_note, split_held_out


def test_the_last_n_prompts_are_held_out_and_never_more_than_a_quarter():
    prompts = list(range(100))
    train, held = split_held_out(prompts, 16)
    assert held == list(range(84, 100)) and train == list(range(84))
    assert split_held_out(prompts, 0) == (prompts, [])
    train, held = split_held_out(list(range(12)), 16)  # a small file: at most a quarter
    assert held == [9, 10, 11] and train == list(range(9))
    assert split_held_out([1, 2, 3], 16) == ([1, 2, 3], [])


def test_a_capped_held_out_set_is_said_at_start_up():
    assert held_out_note(16, 16, 100) is None  # as asked: nothing to say
    assert held_out_note(0, 0, 100) is None
    line = held_out_note(16, 3, 12)
    assert line == ("data.eval_prompts=16: only 3 of the source's 12 prompts held out (at most a quarter; "
                    "none from fewer than 4), training on 9")
    assert held_out_note(16, 0, 3).startswith("data.eval_prompts=16: none of the source's 3 prompts held out")


def test_due_at_start_every_n_steps_and_at_the_end():
    assert [s for s in range(0, 21) if due(s, 5, 20)] == [0, 5, 10, 15, 20]
    assert [s for s in range(0, 8) if due(s, 5, 7)] == [0, 5, 7]
    assert not any(due(s, 0, 20) for s in range(21))
