"""Joining the engine ranks' rollouts (``colocate.rollout.rollouts.join``, with every token's
weight version checked against the trainer's), exchanging a rank's failure
(``colocate.run.rank_failure.agree``, as ``colocate.run.loop.rollout`` does), and the ranks
agreeing on a stop request (two gloo ranks where a collective is involved). Carrying every rank's
deferred buffer across a resume on another number of ranks: ``test_data_source.py`` and
``test_checkpoint_layout.py``."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch.distributed
import torch.multiprocessing as mp

from colocate.config import RolloutConfig
from colocate.rollout.data_source import DataSource, TokenizedPrompt
from colocate.run.rank_failure import agree
from colocate.engine.errors import EngineError
from colocate.rollout.sample import Sample, Status
from colocate.rollout.rollouts import (StepRollout, WeightVersionMismatchError, check_weight_versions, join,
                                       rollout_stats, staleness_stats)


def _sample(index: int, n: int = 1, versions=(0, 0), cached: int = 0) -> Sample:
    return Sample(index, [1, 2], 4, output_ids=[7] * len(versions), logprobs=[-0.5] * len(versions),
                  versions=list(versions), finish_reason="stop", status=Status.FINISHED, group=index // n if n > 1 else None,
                  score=float(index), cached_tokens=cached)


def _part(samples, seconds, **stats) -> StepRollout:
    return StepRollout(samples, seconds, {**rollout_stats(samples), **stats})


def _drawn(rank: int, ranks: int, groups: int, n: int, cached: int = 0) -> list[Sample]:
    """``groups`` groups engine rank ``rank`` of ``ranks`` draws (named in the union when
    drawn), each finished with its rank as its score."""
    data = DataSource([TokenizedPrompt((i,), {"id": i}) for i in range(10)],
                      RolloutConfig(group_size=n, max_new_tokens=4), seed=0, rank=rank, ranks=ranks)
    out = [s for members in itertools.islice(data.groups(), groups) for s in members]
    for s in out:
        s.output_ids, s.logprobs, s.versions, s.finish_reason = [7, 7], [-0.5, -0.5], [0, 0], "stop"
        s.settle()
        s.score, s.cached_tokens = float(rank), cached
    return out


def test_join_puts_the_ranks_samples_in_the_unions_order_without_renaming_them():
    n = 2  # groups of two: rank r's g-th group is the union's group 2g + r, named so when drawn
    mine, theirs = _drawn(0, 2, 2, n), _drawn(1, 2, 2, n, cached=3)
    zero = _part(mine[2:] + mine[:2], {"generate": 1.0, "reward_tail": 0.5},  # in completion order
                 **{"overlap/deferred": 2, "overlap/delta": 1, "overlap/launched": 6, "engine/actor_requests": 6,
                    "engine/reward_requests": 4})
    one = _part(theirs, {"generate": 2.0, "reward_tail": 0.0},
                **{"overlap/deferred": 1, "overlap/delta": 1, "overlap/launched": 5, "engine/actor_requests": 5,
                   "engine/reward_requests": 4})
    joined = join([zero, None, one], version=0, carries_partials=False)  # None: a rank without engines
    assert [s.index for s in joined.samples] == list(range(8))
    assert [s.group_id for s in joined.samples] == [0, 0, 1, 1, 2, 2, 3, 3]  # groups whole and contiguous
    # which rank drew it: union group 2g + r came from rank r
    assert [s.score for s in joined.samples] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert all(any(x is s for x in mine + theirs) for s in joined.samples)  # the ranks' own objects, not copies
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
    joined = join([zero, one], version=3, carries_partials=True)
    union = staleness_stats(zero.samples + one.samples, 3)
    assert joined.stats["overlap/staleness_mean"] == pytest.approx(union["mean"]) == pytest.approx(3 / 8)
    assert joined.stats["overlap/staleness_max"] == 2.0
    assert joined.stats["overlap/staleness_frac_stale_tokens"] == pytest.approx(2 / 8)


def test_join_takes_the_multi_turn_stats_when_a_part_is_multi_turn():
    a, b = _sample(0), _sample(1)
    a.observations, a.env_reward = [{"role": "tool", "content": "4"}], 0.5
    plain = join([StepRollout([a], {"generate": 1.0}), StepRollout([b], {"generate": 1.0})], 0, carries_partials=False)
    assert "rollout/turns" not in plain.stats and plain.stats["rollout/groups"] == 2
    turns = join([StepRollout([a], {"generate": 1.0}, multi_turn=True), None, StepRollout([b], {"generate": 1.0})],
                 0, carries_partials=False)
    assert turns.stats["rollout/tool_call_rate"] == 0.5 and turns.stats["rollout/env_reward"] == 0.25


def test_staleness_stats_over_tokens():
    a = Sample(0, [1], 8, [5, 5, 5], [0.0] * 3, [3, 3, 4])
    b = Sample(1, [1], 8, [5], [0.0], [1])
    assert staleness_stats([a, b], 4) == {"mean": 1.25, "max": 3.0, "frac_stale_tokens": 0.75}
    assert staleness_stats([], 4)["max"] == 0.0


def _gather(run, dist, version: int) -> StepRollout:
    """What ``colocate.run.loop.rollout`` does with every rank's share."""
    return join(agree(run, dist, "rollout", share=True), version, carries_partials=False)


def test_one_rank_joins_to_itself():
    part = _part([_sample(0), _sample(1)], {"generate": 1.0})
    alone = SimpleNamespace(rank=0, world_size=1)
    joined = _gather(lambda: part, alone, version=0)
    assert joined.samples == part.samples and joined.seconds == part.seconds
    with pytest.raises(EngineError, match="boom"):
        _gather(lambda: (_ for _ in ()).throw(EngineError("boom")), alone, version=0)


def test_sequential_batch_must_be_all_current():
    check_weight_versions([[3, 3], [3], []], 3, carries_partials=False)
    with pytest.raises(WeightVersionMismatchError, match=r"sample 1 .* version 2 .* trainer is at version 3"):
        check_weight_versions([[3, 3], [3, 2]], 3, carries_partials=False)


def test_deferral_allows_older_tokens_never_newer():
    check_weight_versions([[1, 1, 3], [3], [2, 2]], 3, carries_partials=True)
    with pytest.raises(WeightVersionMismatchError, match="version 4"):
        check_weight_versions([[3], [3, 4]], 3, carries_partials=True)


def test_version_messages_are_one_line_and_say_what_to_do():
    with pytest.raises(WeightVersionMismatchError) as e:
        check_weight_versions([[0]], 5, carries_partials=False)
    assert "\n" not in str(e.value) and "--resume" in str(e.value)


def test_the_join_checks_every_ranks_tokens_against_the_trainers_version():
    current = _part([_sample(0, versions=(3, 3))], {"generate": 1.0})
    older = _part([_sample(0, versions=(2, 3))], {"generate": 1.0})
    assert len(join([current, older], version=3, carries_partials=True).samples) == 2
    with pytest.raises(WeightVersionMismatchError, match="version 2 but the trainer is at version 3"):
        join([current, older], version=3, carries_partials=False)  # no deferral: all current
    with pytest.raises(WeightVersionMismatchError, match="version 3 but the trainer is at version 2"):
        join([current, None], version=2, carries_partials=True)  # newer than the trainer: never


def _failing_worker(rank: int, init_method: str, queue) -> None:
    from colocate.trainer.distributed import init_distributed

    info = init_distributed("cpu", rank=rank, world_size=2, init_method=init_method)

    def run():
        if rank == 1:
            raise EngineError("the reward engine died")
        return _part([_sample(0)], {"generate": 1.0})

    try:
        _gather(run, info, version=0)
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
