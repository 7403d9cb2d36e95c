"""PromptStream: a group's members share one prompt, each with its own budget; two engine
ranks' streams interleave into exactly one rank's stream; the position round-trips."""

from __future__ import annotations

from colocate.config import RolloutConfig
from colocate.rollout.rollout_phase import Prompt, response_budget
from colocate.run.placement import Placement
from colocate.run.prompt_stream import PromptStream

PROMPTS = [Prompt((i, i + 1), {"id": i}) for i in range(5)]
LONG_TAIL = RolloutConfig(group_size=2, max_new_tokens=64, length_dist="lognormal", length_median=8)


def _draw(stream: PromptStream, groups: int) -> list[tuple[int, int, int]]:
    """(prompt id, group, budget) of ``groups`` groups drawn in index order."""
    n = stream.rollout.group_size
    return [(s.record["id"], s.group, s.max_new_tokens) for s in (stream.sample(i) for i in range(groups * n))]


def test_members_share_the_prompt_with_budgets_of_their_own_and_the_cycle_wraps():
    stream = PromptStream(PROMPTS, LONG_TAIL, seed=3)
    drawn = _draw(stream, 7)
    assert [p for p, _, _ in drawn] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0, 1, 1]  # wraps after 5
    assert [g for _, g, _ in drawn] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert [b for _, _, b in drawn] == [response_budget(LONG_TAIL, 3, k) for k in range(14)]
    assert stream.drawn == 7


def test_two_engine_ranks_draw_one_ranks_stream_between_them():
    one = _draw(PromptStream(PROMPTS, LONG_TAIL, seed=3), 6)
    ranks = [PromptStream(PROMPTS, LONG_TAIL, 3, Placement(rank=r, world=2, local_rank=r, local_world=2))
             for r in (0, 1)]
    shares = [_draw(s, 3) for s in ranks]
    union = [shares[k % 2][(k // 2) * 2 + m] for k in range(6) for m in range(2)]  # group k: rank k % 2
    assert [(p, b) for p, _, b in union] == [(p, b) for p, _, b in one]


def test_position_round_trips_and_continues_where_it_stopped():
    stream = PromptStream(PROMPTS, LONG_TAIL, seed=3)
    _draw(stream, 3)
    state = stream.state_dict()
    assert state == {"data_base": 0, "data_pos": 3}
    again = PromptStream(PROMPTS, LONG_TAIL, seed=3)
    again.load_state_dict(state)
    assert again.sample(6).record == stream.sample(6).record == {"id": 3}
