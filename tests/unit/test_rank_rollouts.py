"""Joining the engine ranks' rollouts, exchanging a rank's failure, carrying every rank's
deferred buffer across a resume on another number of ranks, and the ranks agreeing on a
stop request (two gloo ranks where a collective is involved)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch.distributed
import torch.multiprocessing as mp

from colocate.run import rank_rollouts
from colocate.engine.errors import EngineError
from colocate.engine.rollout import Sample
from colocate.engine.scheduler import LengthAwareScheduler, SchedulerConfig, staleness_stats
from colocate.run.placement import Placement
from colocate.rollout.rollout_phase import StepRollout, rollout_stats


def _sample(index: int, n: int = 1, versions=(0, 0), cached: int = 0) -> Sample:
    return Sample(index, [1, 2], 4, output_ids=[7] * len(versions), logprobs=[-0.5] * len(versions),
                  versions=list(versions), finish_reason="stop", group=index // n if n > 1 else None,
                  score=float(index), cached_tokens=cached)


def _part(samples, seconds, **stats) -> StepRollout:
    return StepRollout(samples, seconds, {**rollout_stats(samples), **stats})


def test_join_renames_each_ranks_samples_into_the_unions_order():
    n = 2  # groups of two: rank r's local group g is the union's group 2g + r
    zero = _part([_sample(i, n) for i in (2, 3, 0, 1)], {"generate": 1.0, "reward_tail": 0.5},
                 **{"overlap/deferred": 2, "overlap/delta": 1, "overlap/launched": 6, "engine/actor_requests": 6,
                    "engine/reward_requests": 4})
    one = _part([_sample(i, n, cached=3) for i in (0, 1, 2, 3)], {"generate": 2.0, "reward_tail": 0.0},
                **{"overlap/deferred": 1, "overlap/delta": 1, "overlap/launched": 5, "engine/actor_requests": 5,
                   "engine/reward_requests": 4})
    joined = rank_rollouts.join([zero, None, one], version=0, group_size=n)  # None: a rank without engines
    assert [s.index for s in joined.samples] == list(range(8))
    assert [s.group_id for s in joined.samples] == [0, 0, 1, 1, 2, 2, 3, 3]  # groups whole and contiguous
    # which rank drew it: union group 2g + r came from rank r's local group g
    assert [s.score for s in joined.samples] == [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    assert joined.seconds == {"generate": 2.0, "reward_tail": 0.0}  # the slowest rank's phases
    assert joined.stats["overlap/deferred"] == 3 and joined.stats["overlap/launched"] == 11
    assert joined.stats["overlap/delta"] == 1  # the same on every rank: not summed
    assert joined.stats["rollout/groups"] == 4 and joined.stats["rollout/cached_prompt_tokens"] == 12
    assert {k: v for k, v in joined.stats.items() if k.startswith("engines/")} == {
        "engines/0/busy_s": 1.5, "engines/0/actor_requests": 6, "engines/0/reward_requests": 4, "engines/0/deferred": 2,
        "engines/1/busy_s": 2.0, "engines/1/actor_requests": 5, "engines/1/reward_requests": 4, "engines/1/deferred": 1}
    assert not any(k.startswith("engine/") for k in joined.stats)


def test_join_takes_staleness_over_the_union_not_a_sum_of_ranks():
    zero = _part([_sample(0, versions=(3, 3)), _sample(1, versions=(2, 3, 3))], {"generate": 1.0},
                 **{f"overlap/staleness_{k}": v for k, v in {"mean": 0.3, "max": 1.0, "frac_stale_tokens": 0.2}.items()})
    one = _part([_sample(0, versions=(1, 3)), _sample(1, versions=(3,))], {"generate": 1.0},
                **{f"overlap/staleness_{k}": v for k, v in {"mean": 0.5, "max": 2.0, "frac_stale_tokens": 0.3}.items()})
    joined = rank_rollouts.join([zero, one], version=3, group_size=1)
    union = staleness_stats(zero.samples + one.samples, 3)
    assert joined.stats["overlap/staleness_mean"] == pytest.approx(union["mean"]) == pytest.approx(3 / 8)
    assert joined.stats["overlap/staleness_max"] == 2.0
    assert joined.stats["overlap/staleness_frac_stale_tokens"] == pytest.approx(2 / 8)


def test_one_rank_joins_to_itself():
    part = _part([_sample(0), _sample(1)], {"generate": 1.0})
    alone = SimpleNamespace(rank=0, world_size=1)
    joined = rank_rollouts.gather(lambda: part, alone, version=0, group_size=1)
    assert joined.samples == part.samples and joined.seconds == part.seconds
    with pytest.raises(EngineError, match="boom"):
        rank_rollouts.gather(lambda: (_ for _ in ()).throw(EngineError("boom")), alone, version=0, group_size=1)


def _failing_worker(rank: int, init_method: str, queue) -> None:
    from colocate.trainer.distributed import init_distributed

    info = init_distributed("cpu", rank=rank, world_size=2, init_method=init_method)

    def run():
        if rank == 1:
            raise EngineError("the reward engine died")
        return _part([_sample(0)], {"generate": 1.0})

    try:
        rank_rollouts.gather(run, info, version=0, group_size=1)
        queue.put((rank, "no error"))
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:  # torn down here, not by the interpreter's exit: seen once in a full suite run, a
        torch.distributed.destroy_process_group()  # worker left to it aborted ("terminate called ...")


def test_a_ranks_failure_reaches_every_rank_instead_of_a_hang():
    from colocate.trainer.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_failing_worker, args=(f"tcp://127.0.0.1:{free_port()}", queue), nprocs=2, join=True)
    got = dict(queue.get() for _ in range(2))
    assert got[1] == "EngineError: the reward engine died"  # its own error
    assert got[0] == ("RankFailedError: rank 1 failed in rollout (EngineError: the reward engine died); "
                      "every rank stops")  # a user error: every rank checkpoints together


# ---- checkpoints -------------------------------------------------------------------------------
def _overlap_state(deferred, next_index, dropped=0, delta=2):
    return {"scheduler": {"next_index": next_index, "dropped_total": dropped,
                          "deferred": [dataclasses.asdict(s) for s in deferred],
                          "delta": {"delta": delta, "rewards": [0.1, 0.2]}},
            "tuner": {"best": 32, "round": 0, "trials": [[16, 1.0], [32, 0.5]]}}


def test_same_number_of_ranks_keeps_every_ranks_state():
    states = [rank_rollouts.rank_state(3, None), rank_rollouts.rank_state(3, None)]
    assert rank_rollouts.redistribute(5, states, 2, 1) == (5, states, None)


def test_fewer_ranks_get_every_deferred_group_under_fresh_indices():
    n = 2
    zero = _overlap_state([_sample(8, n), _sample(9, n)], next_index=12, dropped=1)
    one = _overlap_state([_sample(6, n), _sample(7, n), _sample(10, n), _sample(11, n)], next_index=12, dropped=2)
    base, [state], note = rank_rollouts.redistribute(
        100, [rank_rollouts.rank_state(6, zero), rank_rollouts.rank_state(5, one)], 1, n)
    assert base == 100 + 6 * 2  # the first position neither old stream reached
    assert note == ("2 engine ranks -> 1: 6 deferred samples (3 groups) dealt round-robin over the 1 ranks; "
                    "prompts continue from position 112")
    scheduler = state["overlap"]["scheduler"]
    assert state["data_pos"] == 0 and scheduler["next_index"] == 6 and scheduler["dropped_total"] == 3
    # oldest first: rank 1's group 3 (union age 3*2+1=7), rank 0's group 4 (8), rank 1's group 5 (11)
    assert [(d["index"], d["group"], d["score"]) for d in scheduler["deferred"]] == [
        (0, 0, 6.0), (1, 0, 7.0), (2, 1, 8.0), (3, 1, 9.0), (4, 2, 10.0), (5, 2, 11.0)]
    # a real scheduler takes it and plans the carried groups before new ones
    sched = LengthAwareScheduler(SchedulerConfig(batch_size=4, delta_init=1, delta_max=2, group_size=n))
    sched.load_state_dict(scheduler)
    plan = sched.plan(lambda i: Sample(i, [1], 4, group=i // n), current_version=0)
    assert [s.group_id for s in plan.ready] == [0, 0, 1, 1, 2, 2]
    # pool 2 + Δ 2 = 4 groups: the 3 carried, then one new group under the next fresh indices
    assert [(s.index, s.group) for s in plan.launch] == [(6, 3), (7, 3)]


def test_more_ranks_share_the_deferred_samples_round_robin():
    one = _overlap_state([_sample(i) for i in (4, 5, 6)], next_index=7)
    base, states, note = rank_rollouts.redistribute(0, [rank_rollouts.rank_state(7, one)], 2, 1)
    assert base == 7 and "1 engine ranks -> 2: 3 deferred samples (3 groups)" in note
    got = [[(d["index"], d["group"], d["score"]) for d in s["overlap"]["scheduler"]["deferred"]] for s in states]
    assert got == [[(0, None, 4.0), (1, None, 6.0)], [(0, None, 5.0)]]
    assert [s["overlap"]["scheduler"]["next_index"] for s in states] == [2, 1]
    assert all(s["overlap"]["tuner"]["best"] == 32 and s["overlap"]["scheduler"]["delta"]["delta"] == 2 for s in states)


def test_redistribution_keeps_the_score_scaling_and_pickers_state():
    """A deferred score is a reward (reward.scale applied) in checkpoints that say so: the
    flag travels with the samples, or a resume on another world size would scale them twice."""
    one = {**_overlap_state([_sample(i) for i in (4, 5)], next_index=6), "scores_scaled": True,
           "auto": {"costs": {"sequential": [1.0]}}}
    _, states, _ = rank_rollouts.redistribute(0, [rank_rollouts.rank_state(6, one)], 2, 1)
    assert all(s["overlap"]["scores_scaled"] is True and s["overlap"]["auto"] == one["auto"] for s in states)


def test_sequential_checkpoints_only_move_the_prompt_streams():
    base, states, note = rank_rollouts.redistribute(0, [rank_rollouts.rank_state(4, None)] * 2, 1, 1)
    assert (base, states) == (8, [rank_rollouts.rank_state(0, None)]) and "prompts continue from position 8" in note
    # the two-rank streams covered positions 0..7: the one-rank stream goes on from 8
    assert Placement().position(base, 0) == 8


def test_a_checkpoint_from_before_engines_on_every_rank_is_one_ranks_state():
    old = {"run": {"data_pos": 9}, "overlap": {"scheduler": {}}}
    assert rank_rollouts.saved_states(old) == (0, [{"data_pos": 9, "overlap": {"scheduler": {}}}])
    new = {"rollout": {"base": 4, "ranks": [{"data_pos": 1, "overlap": None}]}}
    assert rank_rollouts.saved_states(new) == (4, [{"data_pos": 1, "overlap": None}])


def _stop_worker(rank: int, init_method: str, queue) -> None:
    from colocate.run import loop
    from colocate.trainer.distributed import init_distributed

    info = init_distributed("cpu", rank=rank, world_size=2, init_method=init_method)
    session = SimpleNamespace(dist=info)
    asked = SimpleNamespace(requested=rank == 1, reason="SIGTERM" if rank == 1 else "")
    queue.put((rank, [loop._stopping(session, asked), loop._stopping(session, SimpleNamespace(requested=False))]))
    torch.distributed.destroy_process_group()


def test_a_stop_asked_of_one_rank_stops_every_rank_at_the_same_boundary():
    from colocate.trainer.distributed import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_stop_worker, args=(f"tcp://127.0.0.1:{free_port()}", queue), nprocs=2, join=True)
    assert dict(queue.get() for _ in range(2)) == {0: [True, False], 1: [True, False]}
