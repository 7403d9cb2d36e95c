"""This rank's stream of training prompts: which prompt and token budget each new sample gets.

Owns: :class:`PromptStream`: the tokenized training prompts, this rank's position in its
stream (groups drawn) and where the engine ranks' streams start (``Placement.position``
interleaves them, so their union is one rank's stream), the seeded cycle over the prompt
set, each member's token budget, and that position's save/restore. Leaves out: which
samples run when (the scheduler, ``engine.scheduler``), the held-out prompts
(``colocate.rollout.evaluation``), a resume on another number of engine ranks
(``colocate.run.rank_rollouts.redistribute``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from colocate.config import RolloutConfig
from colocate.engine.rollout import Sample, group_member, sample_index
from colocate.rollout.rollout_phase import Prompt, response_budget
from colocate.run.placement import Placement


@dataclasses.dataclass
class PromptStream:
    prompts: list[Prompt]
    rollout: RolloutConfig  # group size n, the length distribution of token budgets
    seed: int  # run.seed: the budgets' draw
    placement: Placement = Placement()
    base: int = 0  # where the engine ranks' streams start (a resume on another world size moves it)
    drawn: int = 0  # groups this rank has drawn

    def sample(self, index: int) -> Sample:
        """Sample ``index`` (local to this rank): member ``index % n`` of group ``index // n``.
        The group's first member draws the next prompt of this rank's stream through a
        fixed, seeded cycle over the prompt set; the others share it. Each member gets its
        own token budget (``response_budget`` at draw ``position * n + member``). Call in
        ascending index order."""
        n = self.rollout.group_size
        group, member = group_member(index, n)
        if member == 0:
            self.drawn += 1
        pos = self.placement.position(self.base, self.drawn - 1)
        prompt = self.prompts[pos % len(self.prompts)]
        budget = response_budget(self.rollout, self.seed, sample_index(pos, member, n))
        return Sample(index, list(prompt.ids), budget, group=group, record=dict(prompt.record))

    def state_dict(self) -> dict[str, Any]:
        return {"data_base": self.base, "data_pos": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base, self.drawn = int(state["data_base"]), int(state["data_pos"])
