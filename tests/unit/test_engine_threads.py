"""CPU thread budget of the engines' scheduler processes, per mode."""

from __future__ import annotations

import pytest

from colocate.builder import engine_threads
from colocate.config import load_config


@pytest.mark.parametrize("mode,feeder,cores,expected", [
    ("sequential", "inline", 2, (2, 2)),
    ("inter", "inline", 2, (2, 2)),        # actor and reward engine never busy together
    ("intra", "inline", 2, (1, 1)),        # decode and chunk prefill at the same time
    ("oppo", "inline", 8, (4, 4)),
    ("oppo", "process", 8, (8, 8)),        # the feeder process starts its own engine
    ("oppo", "inline", 1, (1, 1)),
])
def test_auto_budget(mode, feeder, cores, expected):
    cfg = load_config(overrides=[f"overlap.mode={mode}", f"overlap.feeder={feeder}"])
    assert engine_threads(cfg, cores) == expected


def test_explicit_budget_wins():
    cfg = load_config(overrides=["overlap.mode=oppo", "engines.actor_threads=3", "engines.reward_threads=1"])
    assert engine_threads(cfg, 8) == (3, 1)
