"""colocate.run.checkpoint_layout: the one layout colocate reads is the one it writes
(``data`` = every engine rank's ``DataSource.state_dict``, ``rollout`` = every engine
rank's ``Rollouts.state_dict``); a checkpoint of an older colocate is refused in one line
naming who wrote it, at ``Session.restore``, before anything is loaded. And a resume on
another number of engine ranks (``data_source.redistribute``, ``Session.restore``)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colocate.config import load_config
from colocate.rollout.sample import Sample, Status
from colocate.rollout.data_source import DataSource, TokenizedPrompt
from colocate.run import checkpoint
from colocate.run.checkpoint import CheckpointError
from colocate.run.checkpoint_layout import LAYOUT, check
from colocate.run.engines import RankEngines
from colocate.run.placement import Placement
from colocate.run.session import RunContext, RunState, Session
from colocate.trainer.kl_control import make_kl_controller

KL = {"kind": "fixed", "value": 0.05}
TUNER = {"best": 32, "round": 0, "trials": [[16, 1.0], [32, 0.5]]}
AUTO = {"costs": {"sequential": [1.0]}}
DELTA = {"delta": 2, "rewards": [0.1, 0.2]}


def _sample(index: int, n: int = 1) -> Sample:
    return Sample(index, [1, 2], 4, output_ids=[7, 7], logprobs=[-0.5, -0.5], versions=[0, 0],
                  finish_reason="stop", status=Status.FINISHED, group=index // n if n > 1 else None, score=float(index),
                  record={"id": index})


def _todays(deferred, named, dropped=0) -> dict:
    """A checkpoint's plain parts in today's layout: one engine rank at stream position 4."""
    return {"layout": LAYOUT, "trainer": {}, "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "run": {"step": 4, "weight_version": 4, "kl": KL},
            "data": {"base": 0, "ranks": [{"data_pos": 4, "named": named, "dropped_total": dropped,
                                           "deferred": [s.state() for s in deferred]}]},
            "rollout": {"ranks": [{"delta": DELTA, "tuner": TUNER, "auto": AUTO}]}}


def test_todays_layout_passes():
    assert check(_todays([_sample(1)], 2), "runs/x/checkpoints/step_00000004") is None


@pytest.mark.parametrize("parts, layout, writer", [
    ({"run": {"step": 4, "data_pos": 4}, "overlap": None}, 0, "colocate before 2026-11-26 (one engine rank)"),
    ({"run": {"step": 4}, "rollout": {"base": 0, "ranks": []}}, 1,
     "colocate of 2026-11-26 (the deferred samples inside the scheduler's state)"),
    ({"layout": 2, "run": {"step": 4}}, 2,
     "colocate of 2026-11-27, commits 690168a-17469b8 (deferred samples with or without a status)"),
    ({"layout": 3, "run": {"step": 4}}, 3,
     "colocate of 2026-11-27 to 2026-12-02, commits e3b6196-9117faf (deferred samples named per engine rank)"),
    ({"layout": 9, "run": {"step": 4}}, 9, "a colocate newer than this one (layout 9)"),
])
def test_another_layout_is_one_line_naming_who_wrote_it(parts, layout, writer):
    with pytest.raises(CheckpointError) as e:
        check(parts, "runs/x/checkpoints/step_00000004")
    assert str(e.value) == (
        f"--resume: checkpoint 'runs/x/checkpoints/step_00000004' is in layout {layout}, written by {writer}; "
        f"this colocate reads layout {LAYOUT} only: start a new run (another run.out_dir) or resume it with the "
        "colocate that wrote it")


# ---- Session.restore: today's layout on another number of engine ranks, an older one refused ----
def _restored(run_dir: Path, rank: int, world: int):
    """A session of engine rank ``rank`` of ``world`` with stand-ins for the trainer and the
    rollout phase (which records the state it is given), restored from ``run_dir``."""
    cfg = load_config(overrides=["overlap.mode=oppo", "rollout.group_size=2", "rollout.batch_size=4"])
    loaded, logs = [], []
    trainer = SimpleNamespace(saved_shapes=lambda: {}, load_state_dict=lambda state: None)
    rollouts = SimpleNamespace(load_state_dict=loaded.append)
    data = DataSource([TokenizedPrompt((i,), {"id": i}) for i in range(200)], cfg.rollout, seed=0, rank=rank,
                      ranks=world)
    engines = RankEngines(placement=Placement(rank, world, rank, world))
    session = Session(cfg, SimpleNamespace(rank=rank, world_size=world), trainer, engines, data, rollouts,
                      RunState(kl_ctl=make_kl_controller("fixed", 0.1, 1.0, 1.0)),
                      RunContext(tokenizer=None, out_dir=run_dir, log=logs.append))
    session.restore(run_dir)
    return session, loaded, logs


def test_a_resume_on_more_engine_ranks_gives_every_rank_the_first_ranks_rollout_state(tmp_path):
    checkpoint.save(tmp_path / "checkpoints", 4, _todays([_sample(i, 2) for i in (4, 5, 6, 7)], 8, dropped=1))
    for rank in (0, 1):
        session, loaded, logs = _restored(tmp_path, rank, 2)
        assert loaded == [{"delta": DELTA, "tuner": TUNER, "auto": AUTO}]  # the first rank's
        assert (session.state.step, session.state.weight_version, session.state.kl_ctl.value) == (4, 4, 0.05)
        # the old stream covered positions 0..3: both go on from 4; one deferred group each, scores as saved,
        # named in the new union (rank r's first group is the union's group r)
        assert (session.data.base, session.data.drawn) == (4, 0)
        assert [(s.index, s.group, s.score) for s in session.data.deferred] == \
            [(2 * rank, rank, 4.0 + 2 * rank), (2 * rank + 1, rank, 5.0 + 2 * rank)]
        assert session.data.named == 2 and session.data.dropped_total == (1 if rank == 0 else 0)
        assert any("1 engine ranks -> 2" in line for line in logs) and logs[-1] == "resumed from step 4"


def test_restore_refuses_an_older_layout_before_loading_anything(tmp_path):
    parts = _todays([_sample(1)], 2)
    old = {**{k: v for k, v in parts.items() if k not in ("layout", "data")},
           "rollout": {"base": 0, "ranks": [{"data_pos": 4, "overlap": None}]}}  # layout 1
    checkpoint.save(tmp_path / "checkpoints", 4, old)
    with pytest.raises(CheckpointError, match=r"is in layout 1, written by colocate of 2026-11-26"):
        _restored(tmp_path, 0, 1)
