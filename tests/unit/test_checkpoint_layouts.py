"""colocate.run.checkpoint_layouts.current: checkpoints of earlier layouts read as today's
(layout 2: ``data`` = every engine rank's ``DataSource.state_dict``, ``rollout`` = every
engine rank's ``Rollouts.state_dict``): layout 1 (engines on every rank: the deferred
buffer inside ``rollout.ranks[r].overlap.scheduler``), layout 0 (one engine rank:
``run.data_pos`` and a top-level ``overlap``), deferred samples saved before they carried
their score and record, scores saved before they included ``reward.scale`` (scaled once);
today's layout passes unchanged. And a resume of such a checkpoint on another number of
engine ranks (``data_source.redistribute``, ``Session.restore``)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from colocate.config import RolloutConfig, load_config
from colocate.engine.rollout import Sample, Status
from colocate.rollout import data_source
from colocate.rollout.data_source import DataSource
from colocate.rollout.rollout_phase import Prompt
from colocate.run import checkpoint
from colocate.run.checkpoint_layouts import LAYOUT, current
from colocate.run.engines import RankEngines
from colocate.run.placement import Placement
from colocate.run.session import RunContext, RunState, Session
from colocate.trainer.kl_control import make_kl_controller

KL = {"kind": "fixed", "value": 0.05}
TUNER = {"best": 32, "round": 0, "trials": [[16, 1.0], [32, 0.5]]}
AUTO = {"costs": {"sequential": [1.0]}}
EMPTY = {"next_index": 0, "dropped_total": 0, "deferred": []}  # a data state with nothing deferred


def _sample(index: int, n: int = 1) -> Sample:
    return Sample(index, [1, 2], 4, output_ids=[7, 7], logprobs=[-0.5, -0.5], versions=[0, 0],
                  finish_reason="stop", status=Status.FINISHED, group=index // n if n > 1 else None, score=float(index),
                  record={"id": index})


def _overlap_state(deferred, next_index, dropped=0, delta=2, **extra):
    """A layout 0/1 rank's saved rollout phase (scheduler with the deferred buffer, chunk tuner)."""
    return {"scheduler": {"next_index": next_index, "dropped_total": dropped,
                          "deferred": [s.state() for s in deferred],
                          "delta": {"delta": delta, "rewards": [0.1, 0.2]}},
            "tuner": TUNER, **extra}


def test_a_checkpoint_from_before_engines_on_every_rank_is_one_ranks_state():
    overlap = _overlap_state([], next_index=18)
    old = {"run": {"step": 3, "weight_version": 3, "kl": KL, "data_pos": 9}, "overlap": overlap}
    got = current(old, 1.0)
    assert got["data"] == {"base": 0, "ranks": [{"data_pos": 9, **EMPTY, "next_index": 18}]}
    assert got["rollout"] == {"ranks": [{"delta": overlap["scheduler"]["delta"], "tuner": TUNER}]}
    assert got["run"] == {"step": 3, "weight_version": 3, "kl": KL} and "overlap" not in got
    assert got["layout"] == LAYOUT == 2
    new = {"rollout": {"base": 4, "ranks": [{"data_pos": 1, "overlap": None}]}}
    assert current(new, 1.0)["data"] == {"base": 4, "ranks": [{"data_pos": 1, **EMPTY}]}
    assert current(new, 1.0)["rollout"] == {"ranks": [None]}


def test_sequential_checkpoints_only_move_the_prompt_streams():
    parts = current({"rollout": {"base": 0, "ranks": [{"data_pos": 4, "overlap": None}] * 2}}, 1.0)
    assert parts["rollout"] == {"ranks": [None, None]}
    base, states, note = data_source.redistribute(parts["data"]["base"], parts["data"]["ranks"], 1, 1)
    assert (base, states) == (8, [{"data_pos": 0, **EMPTY}]) and "prompts continue from position 8" in note
    # the two-rank streams covered positions 0..7: the one-rank stream goes on from 8
    assert DataSource([], RolloutConfig(), 0, base=base).position(0) == 8


def test_layout_1_carries_each_ranks_deferred_samples_counts_delta_tuner_and_picker():
    n = 2
    zero = _overlap_state([_sample(8, n), _sample(9, n)], next_index=12, dropped=1, delta=2,
                          scores_scaled=True, auto=AUTO)
    one = _overlap_state([_sample(6, n), _sample(7, n)], next_index=12, dropped=2, delta=3,
                         scores_scaled=True, auto={"costs": {"oppo": [2.0]}})
    rng = {"python": [1, 2], "torch": [3]}
    parts = {"trainer": {"w": 1}, "rng": rng,
             "run": {"step": 4, "weight_version": 5, "kl": KL, "data_base": 100, "data_pos": 6},
             "rollout": {"base": 100, "ranks": [{"data_pos": 6, "overlap": zero}, {"data_pos": 5, "overlap": one}]}}
    kept = copy.deepcopy(parts)
    got = current(parts, 2.0)
    assert parts == kept  # the loaded parts are not changed in place
    assert got == {
        "layout": 2, "trainer": {"w": 1}, "rng": rng, "run": {"step": 4, "weight_version": 5, "kl": KL},
        "data": {"base": 100, "ranks": [
            {"data_pos": 6, "next_index": 12, "dropped_total": 1, "deferred": zero["scheduler"]["deferred"]},
            {"data_pos": 5, "next_index": 12, "dropped_total": 2, "deferred": one["scheduler"]["deferred"]}]},
        "rollout": {"ranks": [
            {"delta": {"delta": 2, "rewards": [0.1, 0.2]}, "tuner": TUNER, "auto": AUTO},
            {"delta": {"delta": 3, "rewards": [0.1, 0.2]}, "tuner": TUNER, "auto": {"costs": {"oppo": [2.0]}}}]}}
    # each rank's data state is what a data source loads: the samples as they were saved
    data = DataSource([Prompt((1,), {})], RolloutConfig(group_size=n), seed=0, rank=1, ranks=2)
    data.load_state_dict(got["data"]["base"], got["data"]["ranks"][1])
    assert data.deferred == [_sample(6, n), _sample(7, n)]
    assert (data.base, data.drawn, data.next_index, data.dropped_total) == (100, 5, 12, 2)


def test_a_layout_1_rank_state_loads_into_the_rollout_phase():
    from colocate.rollout.rollouts import Rollouts

    overlap = _overlap_state([_sample(3)], next_index=4, delta=1, scores_scaled=True)
    got = current({"rollout": {"base": 0, "ranks": [{"data_pos": 4, "overlap": overlap}]}}, 1.0)
    rollouts = Rollouts(load_config(), None, None, None)  # sequential: no engine needed to hold state
    try:
        rollouts.load_state_dict(got["rollout"]["ranks"][0])
        assert rollouts.state_dict() == {"delta": {"delta": 0, "rewards": [0.1, 0.2]}, "tuner": TUNER}
    finally:
        rollouts.close()


def test_deferred_samples_saved_without_score_and_record_take_them_from_the_old_maps():
    plain = [{k: v for k, v in _sample(i).state().items() if k not in ("score", "record")}
             for i in (3, 4)]
    overlap = {**_overlap_state([], next_index=5), "ready_scores": {"3": 0.5}, "records": {"3": {"answer": "4"}}}
    overlap["scheduler"]["deferred"] = plain
    got = current({"run": {"data_pos": 5}, "overlap": overlap}, 2.0)
    [state] = got["data"]["ranks"]
    assert [(d["index"], d["score"], d["record"]) for d in state["deferred"]] == [
        (3, 1.0, {"answer": "4"}), (4, None, {})]  # 0.5 saved before reward.scale: × 2 once
    assert "ready_scores" not in got["rollout"]["ranks"][0] and "records" not in got["rollout"]["ranks"][0]
    data = DataSource([Prompt((1,), {})], RolloutConfig(), seed=0)
    data.load_state_dict(got["data"]["base"], state)
    assert [(s.score, s.record) for s in data.deferred] == [(1.0, {"answer": "4"}), (None, {})]


def test_scores_saved_before_they_included_reward_scale_are_scaled_once():
    older = {"rollout": {"base": 0, "ranks": [{"data_pos": 3, "overlap": _overlap_state([_sample(4), _sample(5)], 6)}]}}
    newer = copy.deepcopy(older)
    newer["rollout"]["ranks"][0]["overlap"]["scores_scaled"] = True
    for parts, want in ((older, [8.0, 10.0]), (newer, [4.0, 5.0])):
        got = current(parts, 2.0)
        assert [d["score"] for d in got["data"]["ranks"][0]["deferred"]] == want
        again = current(got, 2.0)  # today's layout: as it is, not scaled again
        assert again == got and [d["score"] for d in again["data"]["ranks"][0]["deferred"]] == want


def test_redistribution_keeps_the_scaled_scores_and_the_pickers_state():
    """A deferred score is a reward (reward.scale applied) once read: a resume on another
    world size moves the samples without scaling them again, and auto's picker stays
    beside the rollout phase (the session hands the first rank's to every rank:
    ``test_a_resume_on_more_engine_ranks_gives_every_rank_the_first_ranks_rollout_state``)."""
    one = _overlap_state([_sample(i) for i in (4, 5)], next_index=6, scores_scaled=True, auto=AUTO)
    parts = current({"rollout": {"base": 0, "ranks": [{"data_pos": 6, "overlap": one}]}}, 2.0)
    _, states, _ = data_source.redistribute(parts["data"]["base"], parts["data"]["ranks"], 2, 1)
    assert [[d["score"] for d in s["deferred"]] for s in states] == [[4.0], [5.0]]
    assert parts["rollout"]["ranks"] == [{"delta": one["scheduler"]["delta"], "tuner": TUNER, "auto": AUTO}]


def test_todays_layout_passes_unchanged():
    parts = {"layout": 2, "trainer": {}, "run": {"step": 1, "weight_version": 1, "kl": KL},
             "data": {"base": 3, "ranks": [{"data_pos": 1, "next_index": 2, "dropped_total": 0,
                                             "deferred": [_sample(1).state()]}]},
             "rollout": {"ranks": [{"delta": {"delta": 1, "rewards": []}, "tuner": TUNER}]}}
    kept = copy.deepcopy(parts)
    assert current(parts, 3.0) == kept and parts == kept  # scores not scaled: they are rewards already


# ---- a resume on another number of engine ranks (Session.restore) -----------------------------
def _restored(run_dir: Path, rank: int, world: int):
    """A session of engine rank ``rank`` of ``world`` with stand-ins for the trainer and the
    rollout phase (which records the state it is given), restored from ``run_dir``."""
    cfg = load_config(overrides=["overlap.mode=oppo", "rollout.group_size=2", "rollout.batch_size=4"])
    loaded, logs = [], []
    trainer = SimpleNamespace(saved_shapes=lambda: {}, load_state_dict=lambda state: None)
    rollouts = SimpleNamespace(load_state_dict=loaded.append)
    data = DataSource([Prompt((i,), {"id": i}) for i in range(200)], cfg.rollout, seed=0, rank=rank, ranks=world)
    engines = RankEngines(placement=Placement(rank, world, rank, world))
    session = Session(cfg, SimpleNamespace(rank=rank, world_size=world), trainer, engines, data, rollouts,
                      RunState(kl_ctl=make_kl_controller("fixed", 0.1, 1.0, 1.0)),
                      RunContext(tokenizer=None, out_dir=run_dir, log=logs.append))
    session.restore(run_dir)
    return session, loaded, logs


def test_a_resume_on_more_engine_ranks_gives_every_rank_the_first_ranks_rollout_state(tmp_path):
    n = 2
    one = _overlap_state([_sample(i, n) for i in (4, 5, 6, 7)], next_index=8, dropped=1,
                         scores_scaled=True, auto=AUTO)
    parts = {"trainer": {}, "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
             "run": {"step": 4, "weight_version": 4, "kl": KL, "data_base": 0, "data_pos": 4},
             "rollout": {"base": 0, "ranks": [{"data_pos": 4, "overlap": one}]}}
    checkpoint.save(tmp_path / "checkpoints", 4, parts)
    for rank in (0, 1):
        session, loaded, logs = _restored(tmp_path, rank, 2)
        assert loaded == [{"delta": one["scheduler"]["delta"], "tuner": TUNER, "auto": AUTO}]  # the first rank's
        assert (session.state.step, session.state.weight_version, session.state.kl_ctl.value) == (4, 4, 0.05)
        # the old stream covered positions 0..3: both go on from 4; one deferred group each, scores as saved
        assert (session.data.base, session.data.drawn) == (4, 0)
        assert [(s.index, s.group, s.score) for s in session.data.deferred] == \
            [(0, 0, 4.0 + 2 * rank), (1, 0, 5.0 + 2 * rank)]
        assert session.data.next_index == 2 and session.data.dropped_total == (1 if rank == 0 else 0)
        assert any("1 engine ranks -> 2" in line for line in logs) and logs[-1] == "resumed from step 4"
