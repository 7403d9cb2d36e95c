"""The CUDA time-sharing decisions that need no GPU: the kwargs each engine gets per role,
device and rank, the sleep/wake call order with every memory tag, the allocator check, the
engine dtype and the cast on the way into the engine.

The call order is read from recorders standing in for the engines and the trainer: on CPU
SGLang's memory saver is a no-op, so the order is the only thing that can be checked here
(docs/architecture.md, "Time-sharing: the sleep/wake order", says what ran where)."""

from __future__ import annotations

import pytest
import torch

from colocate.run import builder, timesharing, weight_sync
from colocate.config import load_config
from colocate.engine.engine_config import EngineConfig, _server_kwargs
from colocate.engine.runtime import MEMORY_TAGS
from colocate.engine.start_checks import EngineStartError, check_allocator_conf
from colocate.errors import ConfigError


def test_reward_engine_sleeps_with_a_host_copy_of_its_weights_on_cuda_only():
    cfg = load_config(overrides=["engines.device=cuda"])
    actor, reward = builder.engine_configs(cfg, "/m/actor", "/m/rm")
    on_cuda = {role: _server_kwargs(c, "cuda") for role, c in (("actor", actor), ("reward", reward))}
    assert on_cuda["reward"]["enable_weights_cpu_backup"] is True  # nothing pushes its weights again
    assert on_cuda["actor"]["enable_weights_cpu_backup"] is False  # pushed after every wake
    assert on_cuda["actor"]["enable_memory_saver"] and on_cuda["reward"]["enable_memory_saver"]
    assert on_cuda["reward"]["is_embedding"] and "is_embedding" not in on_cuda["actor"]
    assert on_cuda["actor"]["dtype"] == on_cuda["reward"]["dtype"] == "bfloat16"
    on_cpu = _server_kwargs(reward, "cpu")
    assert "enable_memory_saver" not in on_cpu and "enable_weights_cpu_backup" not in on_cpu
    assert on_cpu["disable_cuda_graph"] and on_cpu["attention_backend"] == "colocate_cpu"
    # no memory saver: no backup either (SGLang would keep a host copy for nothing)
    plain = EngineConfig("/m/rm", role="reward", enable_memory_saver=False, weights_cpu_backup=True)
    assert _server_kwargs(plain, "cuda")["enable_weights_cpu_backup"] is False


def test_each_ranks_engines_get_its_gpu_its_cores_and_ports_of_their_own():
    from colocate.run.placement import Placement

    cfg = load_config(overrides=["engines.device=cuda"])
    alone = builder.engine_configs(cfg, "/m/actor", "/m/rm")
    assert all(c.base_gpu_id == 0 and c.tp_size == 1 and c.nccl_port is None for c in alone)  # SGLang picks
    ranks = [builder.engine_configs(cfg, "/m/actor", "/m/rm", Placement(r, 4, r, 4)) for r in range(4)]
    kwargs = [_server_kwargs(c, "cuda") for pair in ranks for c in pair]
    assert [k["base_gpu_id"] for k in kwargs] == [0, 0, 1, 1, 2, 2, 3, 3]  # actor and reward on the rank's GPU
    ports = [k["nccl_port"] for k in kwargs]
    assert len(set(ports)) == 8  # no two engines of the node race for one port
    tp = load_config(overrides=["engines.device=cuda", "engines.tp_size=2"])
    actor, _ = builder.engine_configs(tp, "/m/actor", "/m/rm", Placement(2, 4, 2, 4, tp_size=2))
    assert (_server_kwargs(actor, "cuda")["base_gpu_id"], _server_kwargs(actor, "cuda")["tp_size"]) == (2, 2)
    cpu = load_config(overrides=["engines.device=cpu"])
    shared = builder.engine_configs(cpu, "/m/actor", "/m/rm", Placement(1, 2, 1, 2))
    assert "base_gpu_id" not in _server_kwargs(shared[0], "cpu")
    assert shared[0].threads == shared[1].threads == max(1, len(__import__("os").sched_getaffinity(0)) // 2)


NO_BF16, AMX = frozenset({"avx2", "fma"}), frozenset({"avx512f", "amx_bf16", "avx512_bf16"})  # CPU flags


@pytest.mark.parametrize("overrides, cuda_available, want", [
    ([], False, "float32"),  # CPU: the trainer's dtype, the exact path where the CPU emulates bf16
    ([], True, "bfloat16"),  # auto device on a CUDA machine
    (["engines.device=cuda"], False, "bfloat16"),
    (["engines.device=cpu"], True, "float32"),
    (["models.dtype=bfloat16"], False, "bfloat16"),
    (["engines.dtype=float16"], True, "float16"),  # explicit wins
    (["engines.dtype=float32", "engines.device=cuda"], True, "float32"),
])
def test_engine_dtype(overrides, cuda_available, want):
    assert builder.engine_dtype(load_config(overrides=overrides), cuda_available, NO_BF16) == want


def test_engine_dtype_follows_the_cpu_trainer_into_bf16_where_the_cpu_multiplies_it():
    assert builder.engine_dtype(load_config(overrides=["engines.device=cpu"]), False, AMX) == "bfloat16"
    assert builder.engine_dtype(load_config(overrides=["models.dtype=float32"]), False, AMX) == "float32"


def test_engine_dtype_and_dist_timeout_are_checked():
    with pytest.raises(ConfigError, match="engines.dtype"):
        load_config(overrides=["engines.dtype=fp8"])
    with pytest.raises(ConfigError, match="run.dist_timeout_minutes must be > 0"):
        load_config(overrides=["run.dist_timeout_minutes=0"])


@pytest.mark.parametrize("env, refused", [
    ({}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : true"}, "PYTORCH_CUDA_ALLOC_CONF"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_ALLOC_CONF"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, None),
])
def test_allocator_setting_that_breaks_the_memory_saver_is_one_line(env, refused):
    if refused is None:
        check_allocator_conf(env)
        return
    with pytest.raises(EngineStartError) as err:
        check_allocator_conf(env)
    text = str(err.value)
    assert "\n" not in text and text.startswith(refused) and "expandable_segments:False" in text


class _Engine:
    """Records the memory calls a CUDA engine would get."""

    def __init__(self, name: str, calls: list, device: str = "cuda"):
        self.name, self.calls, self.device = name, calls, device

    def release_memory(self, tags):
        self.calls.append((self.name, "release", tuple(tags)))
        return self.device == "cuda"

    def resume_memory(self, tags):
        self.calls.append((self.name, "resume", tuple(tags)))
        return self.device == "cuda"


class _Trainer:
    def __init__(self, calls: list):
        self.calls = calls

    def onload(self):
        self.calls.append(("trainer", "onload"))

    def offload(self, keep_actor=False):
        self.calls.append(("trainer", "offload all but the actor" if keep_actor else "offload"))


def test_sleep_releases_every_tag_of_every_engine_and_wake_is_staged():
    calls: list = []
    actor, reward = _Engine("actor", calls), _Engine("reward", calls)
    ts = timesharing.TimeSharing([actor, None, reward], _Trainer(calls), log=calls.append, device_push=True)
    assert ts.active and calls == []  # nothing said on CUDA

    ts.sleep_engines()
    assert set(MEMORY_TAGS) == {"weights", "kv_cache", "cuda_graph"}
    assert calls == [("actor", "release", MEMORY_TAGS), ("reward", "release", MEMORY_TAGS), ("trainer", "onload")]

    calls.clear()

    def gather():  # the trainer's tensors, made one at a time as the push takes them
        calls.append(("trainer", "gather"))
        for name in ("w", "v"):
            calls.append(("trainer", "all-gather", name))
            yield name, 1

    seconds = ts.wake_and_sync(gather, lambda pairs: calls.append(("actor", "push", tuple(n for n, _ in pairs))) or 2.5)
    assert seconds >= 0
    assert calls == [
        ("trainer", "offload all but the actor"),  # optimizer states, ref, critic: the gather reads none of them
        ("actor", "resume", ("weights",)), ("reward", "resume", ("weights",)),  # room for the new weights first
        ("trainer", "gather"),
        ("trainer", "all-gather", "w"), ("trainer", "all-gather", "v"),  # on the device, FSDP's shards still there
        ("actor", "push", ("w", "v")),
        ("trainer", "offload"),
        ("actor", "resume", ("kv_cache", "cuda_graph")), ("reward", "resume", ("kv_cache", "cuda_graph")),
    ]
    # every tag released is resumed
    resumed = {t for c in calls if c[1] == "resume" for t in c[2]}
    assert resumed == set(MEMORY_TAGS)


def test_a_cuda_rank_without_engines_still_takes_its_part_in_the_device_gather():
    calls: list = []
    ts = timesharing.TimeSharing([None, None], _Trainer(calls), log=calls.append, device_push=True)
    ts.wake_and_sync(lambda: iter([("w", 1)]), lambda pairs: calls.append(("push", [n for n, _ in pairs])) or 0.0)
    assert calls == [("trainer", "offload all but the actor"), ("push", ["w"]), ("trainer", "offload")]  # same order


def test_on_cpu_the_engines_are_never_released_and_it_is_said_once():
    calls: list = []
    said: list = []
    ts = timesharing.TimeSharing([_Engine("actor", calls, device="cpu")], _Trainer(calls), log=said.append)
    assert not ts.active and len(said) == 1 and "no-ops" in said[0]
    ts.sleep_engines()
    ts.wake_and_sync(lambda: {}, lambda state: 0.0)
    assert calls == [("trainer", "onload"), ("trainer", "offload")]


def test_release_at_start_reports_whether_anything_was_released():
    calls: list = []
    assert timesharing.release([_Engine("actor", calls), None]) is True
    assert calls == [("actor", "release", MEMORY_TAGS)]
    assert timesharing.release([_Engine("actor", [], device="cpu")]) is False
    assert timesharing.release([None]) is False


def test_weights_are_cast_to_the_engine_dtype_bucket_by_bucket():
    state = {"a": torch.ones(256, dtype=torch.float32), "b": torch.ones(256, dtype=torch.float32),
             "steps": torch.arange(4)}
    cast = list(weight_sync.buckets(state, 1024, torch.bfloat16))
    # 256 bf16 values are 512 bytes: a and b share one 1 KiB bucket (as float32 they would not)
    assert [[n for n, _ in b] for b in cast] == [["a", "b"], ["steps"]]
    assert all(t.dtype == torch.bfloat16 for b in cast[:1] for _, t in b)
    assert cast[1][0][1].dtype == torch.int64  # integer buffers keep their dtype
    plain = list(weight_sync.buckets(state, 1024))
    assert [[n for n, _ in b] for b in plain] == [["a"], ["b"], ["steps"]]
    assert plain[0][0][1].dtype == torch.float32


def test_the_feeders_scoring_stops_before_any_engine_releases():
    calls: list = []
    ts = timesharing.TimeSharing([_Engine("actor", calls), _Engine("reward", calls)], _Trainer(calls),
                                 device_push=True, quiesce=lambda: calls.append(("feeder", "drain")))
    ts.sleep_engines()
    assert calls == [("feeder", "drain"), ("actor", "release", MEMORY_TAGS), ("reward", "release", MEMORY_TAGS),
                     ("trainer", "onload")]
    calls.clear()  # on CPU nothing is released, so nothing is drained (the step's leftovers are dropped as before)
    cpu = timesharing.TimeSharing([_Engine("actor", calls, device="cpu")], _Trainer(calls), log=lambda m: None,
                                  quiesce=lambda: calls.append(("feeder", "drain")))
    cpu.sleep_engines()
    assert calls == [("trainer", "onload")]



def test_tensor_parallel_ranks_wait_for_the_release_and_the_engine_for_their_offload():
    """tp_size 2: rank 0 hosts the engine, whose second shard lives on rank 1's GPU."""
    calls: list = []
    host = timesharing.TimeSharing([_Engine("actor", calls)], _Trainer(calls), device_push=True,
                                   barrier=lambda: calls.append(("rank 0", "barrier")))
    host.sleep_engines()
    assert calls == [("actor", "release", MEMORY_TAGS), ("rank 0", "barrier"), ("trainer", "onload")]
    calls.clear()
    host.wake_and_sync(lambda: iter([("w", 1)]), lambda pairs: calls.append(("actor", "push")) or [*pairs] and 0.0)
    assert calls == [("trainer", "offload all but the actor"), ("rank 0", "barrier"),  # rank 1 made room too
                     ("actor", "resume", ("weights",)), ("actor", "push"), ("trainer", "offload"),
                     ("rank 0", "barrier"),  # rank 1 offloaded its actor too
                     ("actor", "resume", ("kv_cache", "cuda_graph"))]
    # rank 1 has no engine (and so no CUDA engine to call it active): the same barriers, in the same places
    other: list = []
    trains = timesharing.TimeSharing([None], _Trainer(other), device_push=True, log=other.append,
                                     barrier=lambda: other.append(("rank 1", "barrier")))
    trains.sleep_engines()
    trains.wake_and_sync(lambda: iter([("w", 1)]), lambda pairs: [*pairs] and 0.0)
    assert other == [("rank 1", "barrier"), ("trainer", "onload"), ("trainer", "offload all but the actor"),
                     ("rank 1", "barrier"), ("trainer", "offload"), ("rank 1", "barrier")]


def test_only_tensor_parallel_engines_get_a_barrier():
    from types import SimpleNamespace

    from colocate.run.placement import Placement

    dist = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    assert builder.tp_barrier(Placement(0, 2, 0, 2), dist) is None
    assert callable(builder.tp_barrier(Placement(0, 2, 0, 2, tp_size=2), dist))


@pytest.mark.parametrize("overrides, device, flags, want", [
    ([], "cuda", NO_BF16, "bfloat16"),  # auto: bf16 compute over fp32 master weights on CUDA
    ([], "cpu", NO_BF16, "float32"),  # auto on a CPU that emulates bf16: the exact path
    ([], "cpu", AMX, "bfloat16"),  # auto on a CPU that multiplies bf16 natively (AVX512-BF16, AMX)
    (["models.dtype=float32"], "cuda", NO_BF16, "float32"),  # explicit wins
    (["models.dtype=float32"], "cpu", AMX, "float32"),
    (["models.dtype=bfloat16"], "cpu", NO_BF16, "bfloat16"),
])
def test_trainer_dtype_and_its_fsdp_policy(overrides, device, flags, want):
    from colocate.trainer.distributed import precision_policy

    cfg = load_config(overrides=overrides)
    assert builder.trainer_dtype(cfg, device, flags) == want
    why = builder.trainer_precision(cfg, device, flags)[1]
    assert why == "models.dtype" if overrides else why.startswith("models.dtype=auto: ")
    policy = precision_policy(getattr(torch, want))
    if want == "float32":
        assert policy.param_dtype is None and policy.reduce_dtype is None  # no casting at all
    else:  # forward/backward in bf16, gradients reduced in fp32 into the fp32 shards the optimizer steps
        assert policy.param_dtype == getattr(torch, want) and policy.reduce_dtype == torch.float32
    # the CPU engines serve what the CPU trainer computes in (auto)
    assert builder.engine_dtype(load_config(overrides=[*overrides, "engines.device=cpu"]), False, flags) == \
        builder.trainer_dtype(cfg, "cpu", flags)


def test_each_sleep_and_wake_reads_the_devices_memory_at_the_right_points():
    """gpu/* metrics: free memory read before and after the release (what the engines gave
    back, and its share of what they took at start), the trainer's peak since the release,
    free memory after the push and after the KV wake; sync/push_s times the push alone."""
    from colocate.monitor.device_memory import GIB, DeviceMemory

    calls: list = []
    free = iter([10, 40, 12, 5])  # GiB: before release, after release, after push, after KV wake
    memory = DeviceMemory(lambda: calls.append("read free") or next(free) * GIB,
                          lambda: calls.append("read peak") or 25 * GIB, lambda: calls.append("reset peak"),
                          engines_bytes=int(32 * GIB))
    ts = timesharing.TimeSharing([_Engine("actor", calls), _Engine("reward", calls)], _Trainer(calls),
                                 device_push=True, memory=memory)
    ts.sleep_engines()
    assert calls == ["read free", ("actor", "release", MEMORY_TAGS), ("reward", "release", MEMORY_TAGS),
                     "read free", "reset peak", ("trainer", "onload")]
    calls.clear()
    ts.wake_and_sync(lambda: iter([("w", 1)]), lambda pairs: calls.append(("actor", "push", *dict(pairs))) or 0.0)
    assert calls == ["read peak", ("trainer", "offload all but the actor"), ("actor", "resume", ("weights",)),
                     ("reward", "resume", ("weights",)), ("actor", "push", "w"), "read free", ("trainer", "offload"),
                     ("actor", "resume", ("kv_cache", "cuda_graph")), ("reward", "resume", ("kv_cache", "cuda_graph")),
                     "read free"]
    stats = ts.take_stats()
    assert stats.pop("sync/push_s") >= 0
    assert stats == {"gpu/free_gib_before_release": 10, "gpu/free_gib_for_training": 40, "gpu/released_gib": 30,
                     "gpu/released_frac": 30 / 32, "gpu/engines_started_gib": 32,
                     "gpu/train_peak_allocated_gib": 25, "gpu/free_gib_after_push": 12, "gpu/free_gib_after_wake": 5}
    assert ts.take_stats() == {}  # taken once per step


def test_without_a_device_only_the_push_is_timed():
    calls: list = []
    ts = timesharing.TimeSharing([_Engine("actor", calls, device="cpu")], _Trainer(calls), log=lambda m: None)
    assert ts.memory is None
    ts.sleep_engines()
    ts.wake_and_sync(lambda: {}, lambda state: 0.25)
    assert ts.take_stats() == {"sync/push_s": 0.25}


def test_requests_paused_at_the_cut_go_on_only_after_the_kv_cache_is_back():
    """Issue 39.1: with overlap.pause_mode=retract on CUDA, continuing inside the push (as
    the sync did) let SGLang schedule the retracted requests into the released KV cache
    while the trainer offloaded; the continue must come after the KV's resume."""
    calls: list = []
    actor, reward = _Engine("actor", calls), _Engine("reward", calls)
    actor.paused = "retract"
    actor.continue_paused = lambda: calls.append(("actor", "continue"))
    ts = timesharing.TimeSharing([actor, reward], _Trainer(calls), device_push=True)
    ts.wake_and_sync(lambda: iter([("w", 1)]), lambda pairs: calls.append(("actor", "push", *dict(pairs))) or 0.0)
    assert calls.index(("actor", "continue")) > calls.index(("actor", "resume", ("kv_cache", "cuda_graph")))
    assert calls[-1] == ("actor", "continue") and calls.count(("actor", "continue")) == 1
    calls.clear()  # on CPU (nothing released) it goes on right after the push, as before
    actor.device = "cpu"
    cpu = timesharing.TimeSharing([actor], _Trainer(calls), log=lambda m: None)
    cpu.wake_and_sync(lambda: {"w": 1}, lambda state: calls.append(("actor", "push")) or 0.0)
    assert calls == [("trainer", "offload"), ("actor", "push"), ("actor", "continue")]
