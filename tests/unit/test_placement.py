"""Who generates where: engine ranks, shares, disjoint prompt streams, cores, GPUs, ports."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from colocate.errors import ConfigError
from colocate.config import RolloutConfig
from colocate.rollout.data_source import DataSource
from colocate.rollout.sample import union_id
from colocate.run.placement import PORT_BASE, PORT_SPAN, Placement, placement_of


def test_every_rank_hosts_engines_with_tp_1_and_the_first_of_each_group_otherwise():
    one = [Placement(r, 4, r, 4) for r in range(4)]
    assert [p.hosts_engines for p in one] == [True] * 4
    assert [p.engine_rank for p in one] == [0, 1, 2, 3] and one[0].engine_ranks == 4
    tp = [Placement(r, 8, r % 4, 4, tp_size=2) for r in range(8)]  # two nodes of 4
    assert [p.hosts_engines for p in tp] == [True, False] * 4
    assert [p.engine_rank for p in tp] == [0, 0, 1, 1, 2, 2, 3, 3] and tp[0].engine_ranks == 4
    assert [p.gpu_id for p in tp[:4]] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="engines.tp_size: 3 must be >= 1 and divide the 4"):
        Placement(0, 4, 0, 4, tp_size=3)


def test_the_batch_splits_in_whole_groups_or_one_line():
    assert Placement(0, 2, 0, 2).share(8, 2) == 4
    assert Placement(0, 1).share(6, 3) == 6
    with pytest.raises(ConfigError, match=r"rollout.batch_size: 6 does not split over 2 engine ranks in whole groups "
                                          r"of rollout.group_size 2; make it a multiple of 4"):
        Placement(0, 2, 0, 2).share(6, 2)


def test_prompt_streams_are_disjoint_and_their_union_is_one_ranks_stream():
    ranks = [Placement(r, 3, r, 3) for r in range(3)]
    def stream(p):  # this engine rank's data source, its streams starting at 10
        return DataSource([], RolloutConfig(), 0, p.engine_rank, p.engine_ranks, base=10)

    drawn = [[stream(p).position(k) for k in range(4)] for p in ranks]
    flat = sorted(x for own in drawn for x in own)
    assert flat == [stream(Placement()).position(k) for k in range(12)] == list(range(10, 22))
    assert len(set(flat)) == 12
    # local sample indices / group ids name the union's the same way
    assert sorted(union_id(i, p.engine_rank, p.engine_ranks) for p in ranks for i in range(4)) == list(range(12))


def test_cpu_cores_split_over_the_nodes_engine_ranks():
    assert Placement(0, 2, 0, 2).engine_cores(2) == 1
    assert Placement(0, 2, 0, 2).engine_cores(16) == 8
    assert Placement(0, 4, 0, 4, tp_size=2).engine_cores(16) == 8
    assert Placement(0, 4, 0, 4).engine_cores(2) == 1  # never 0
    assert Placement().engine_cores(2) == 2


def test_engine_ports_come_from_ranges_no_other_rank_draws_from():
    starts = {(r, role): Placement(r, 2, r, 2).nccl_port(role) for r in (0, 1) for role in ("actor", "reward")}
    ranges = {key: range(port - (port - PORT_BASE) % PORT_SPAN, port - (port - PORT_BASE) % PORT_SPAN + PORT_SPAN)
              for key, port in starts.items()}
    assert len({r.start for r in ranges.values()}) == 4  # four disjoint ranges
    first = Placement(1, 2, 1, 2).nccl_port("actor")
    with socket.socket() as taken:  # a port in use is skipped
        taken.bind(("127.0.0.1", first))
        assert Placement(1, 2, 1, 2).nccl_port("actor") == first + 1


def test_placement_of_reads_torchruns_local_rank():
    dist = SimpleNamespace(rank=5, world_size=8)
    p = placement_of(dist, 1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (p.rank, p.world, p.local_rank, p.local_world) == (5, 8, 1, 4) and p.gpu_id == 1
    alone = placement_of(SimpleNamespace(rank=0, world_size=1), 1, {})
    assert alone == Placement()


def test_tensor_parallel_engines_need_cuda_and_say_so_before_anything_starts():
    from colocate.run import builder
    from colocate.config import load_config

    with pytest.raises(ConfigError, match="engines.tp_size: 2 needs CUDA engines"):
        builder.build(load_config(overrides=["engines.device=cpu", "engines.tp_size=2"]))


@pytest.mark.parametrize("visible, want", [(0, [0, 1, 2, 3]), (4, [0, 1, 2, 3]), (1, [0, 0, 0, 0]), (2, [0, 1, 0, 1])])
def test_engines_and_trainer_pick_one_gpu_by_one_rule(visible, want, monkeypatch):
    """``visible``: torch.cuda.device_count() as each process sees it (1: a launcher that
    sets CUDA_VISIBLE_DEVICES to one GPU per process; 0: CPU, the local rank as before)."""
    import torch

    from colocate.trainer.distributed import local_device_index

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    for local_rank, gpu in enumerate(want):
        dist = SimpleNamespace(rank=4 + local_rank, world_size=8)
        env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "4"}
        engines = placement_of(dist, 1, env, visible_gpus=torch.cuda.device_count()).gpu_id
        trainer = local_device_index(int(env["LOCAL_RANK"]), torch.cuda.device_count())  # what init_distributed picks
        assert engines == trainer == gpu


def test_tensor_parallel_engines_need_their_gpus_visible_or_one_line():
    assert Placement(0, 4, 0, 4, tp_size=2, visible_gpus=4).gpu_id == 0
    assert Placement(2, 4, 2, 4, tp_size=2, visible_gpus=4).gpu_id == 2
    Placement(1, 4, 1, 4, tp_size=2, visible_gpus=1)  # a rank without engines only trains
    with pytest.raises(ConfigError, match=r"engines.tp_size: 2 GPUs from GPU 0 on, but this process sees 1; "
                                          r"let every process of the node see all its GPUs"):
        Placement(0, 4, 0, 4, tp_size=2, visible_gpus=1)



def test_a_feeder_process_is_refused_on_cuda_before_anything_starts():
    from colocate.run import builder
    from colocate.config import load_config

    process = load_config(overrides=["overlap.mode=intra", "overlap.feeder=process"])
    with pytest.raises(ConfigError, match=r"^overlap.feeder=process is not supported on CUDA: .*use overlap.feeder=inline$"):
        builder.check_device_choices(process, "cuda")
    builder.check_device_choices(process, "cpu")
    builder.check_device_choices(load_config(overrides=["overlap.mode=intra"]), "cuda")  # inline
    builder.check_device_choices(load_config(overrides=["overlap.mode=inter", "overlap.feeder=process"]), "cuda")  # no streaming, no feeder
    with pytest.raises(ConfigError, match="overlap.feeder=process"):  # build says it before any engine or group starts
        builder.build(load_config(overrides=["engines.device=cuda", "overlap.mode=oppo", "overlap.feeder=process"]))


def test_pausing_stragglers_in_place_is_refused_on_cuda_before_anything_starts():
    from colocate.run import builder
    from colocate.config import load_config
    from colocate.errors import USER_ERRORS

    in_place = load_config(overrides=["overlap.mode=inter", "overlap.pause_mode=in_place"])
    with pytest.raises(USER_ERRORS, match=r"^overlap.pause_mode: in_place keeps .* use retract .* or abort$"):
        builder.check_device_choices(in_place, "cuda")
    builder.check_device_choices(in_place, "cpu")
    for ok in ("retract", "abort"):
        builder.check_device_choices(load_config(overrides=["overlap.mode=oppo", f"overlap.pause_mode={ok}"]), "cuda")
    # no deferral, no cut: the setting is never used
    builder.check_device_choices(load_config(overrides=["overlap.mode=intra", "overlap.pause_mode=in_place"]), "cuda")
    assert builder.actor_overlap_schedule(in_place) is False  # see EngineConfig.overlap_schedule
    assert builder.actor_overlap_schedule(load_config(overrides=["overlap.mode=inter"])) is True


def test_the_trainers_own_settings_are_refused_before_anything_starts():
    """ppo.attention=flex_attention on CPU (no flex backward there): one line from the
    trainer's settings, before any engine starts (check_device_choices, which build runs first)."""
    from colocate.run import builder
    from colocate.config import load_config
    from colocate.errors import USER_ERRORS

    flex = load_config(overrides=["ppo.attention=flex_attention"])
    with pytest.raises(USER_ERRORS, match=r"^ppo.attention=flex_attention needs CUDA .* use auto or sdpa on this device$"):
        builder.check_device_choices(flex, "cpu")
    with pytest.raises(USER_ERRORS, match=r"^ppo.attention=flex_attention needs CUDA"):
        builder.build(load_config(overrides=["engines.device=cpu", "ppo.attention=flex_attention"]))
    builder.check_device_choices(load_config(overrides=["ppo.attention=sdpa"]), "cpu")
