"""PPOTrainer on FSDP2 over gloo on CPU, with tiny random Llama models.

World size 1 runs in the test process (a one-process group on a loopback port, torn down
after the module); world size 2 runs in two spawned processes and must reach the same
weights as world size 1 on the same batch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate.trainer import ppo_math
from colocate.trainer.batch import TrainBatch, make_batch
from colocate.trainer.critic import ValueModel
from colocate.trainer.distributed import DistInfo, broadcast_object, free_port, init_distributed
from colocate.trainer.ppo_trainer import PPOTrainer, TrainerSettings
from colocate.trainer.sections import PPOConfig
from tests.trainer_settings import settings_of

ROWS = 8


def rollout_batch(seed: int, rows: int = ROWS, version: int = 0) -> TrainBatch:
    """Ragged random prompts (2-6 tokens) and responses (1-6 tokens) of tiny-vocabulary ids."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, 250, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()

    prompts = [ids(2, 6) for _ in range(rows)]
    responses = [ids(1, 6) for _ in range(rows)]
    scores = torch.randn(rows, generator=gen).tolist()
    behaviour = [(-5.5 + 0.3 * torch.randn(len(r), generator=gen)).tolist() for r in responses]
    return make_batch(prompts, responses, 0, scores, behaviour, [[version] * len(r) for r in responses])


def settings_for(actor_path: str, **overrides) -> TrainerSettings:
    base = dict(actor_path=actor_path, actor_lr=1e-3, critic_lr=1e-3, minibatches=2, micro_batch=4, seed=0,
                epochs=1, lam=0.95, packing=False)  # the trainer these tests were written for (padded, one epoch)
    return settings_of(**(base | overrides))


def ppo_step(trainer: PPOTrainer, batch: TrainBatch, version: int = 0) -> dict:
    """The no-grad phases, advantages, then one train_critic and one train_actor."""
    old, ref, values = trainer.old_logprobs(batch), trainer.ref_logprobs(batch), trainer.values(batch)
    adv, returns, _, _ = trainer.advantages(batch, old, ref, values, kl_coef=0.1)
    critic = trainer.train_critic(batch, values, returns)
    actor = trainer.train_actor(batch, old, adv, current_version=version)
    return {"critic": critic, "actor": actor, "old": old, "adv": adv}


def assert_same_tensors(a, b, exact: bool = True, where: str = "", **tol) -> None:
    """Nested dicts/lists/tuples of tensors and plain values are equal (tuples == lists)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], exact, f"{where}.{key}", **tol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, exact, f"{where}[{i}]", **tol)
    elif isinstance(a, torch.Tensor):
        if exact:
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{where}: {m}")
    else:
        assert a == b, where


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are overhead-bound; on a shared 2-core machine two intra-op threads wait on
    each other (measured ~20x slower per op while another process holds a core)."""
    torch.set_num_threads(1)


@pytest.fixture
def trainer(world1, tiny_actor_path):
    return PPOTrainer(settings_for(tiny_actor_path), world1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_old_logprobs_match_plain_hf_forward(world1, request, arch):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue("tiny_actor_path" if arch == "llama" else "tiny_qwen_path")
    trainer = PPOTrainer(settings_for(path), world1)
    batch = rollout_batch(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    old = trainer.old_logprobs(batch)
    assert old.shape == batch.responses.shape
    with torch.no_grad():
        for b in range(batch.size):
            start, n = int(batch.response_start[b]), int(batch.response_mask[b].sum())
            ids = batch.input_ids[b, : start + n][None]
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)  # [L, V]
            expected = logp[start - 1 : start + n - 1].gather(-1, ids[0, start:, None])[:, 0]
            torch.testing.assert_close(old[b, :n], expected, rtol=0, atol=1e-5)
            assert torch.all(old[b, n:] == 0)
    assert torch.equal(trainer.ref_logprobs(batch), old)  # before any update


def test_train_step_moves_actor_not_reference(trainer):
    batch = rollout_batch(2)
    before = trainer.actor_state_for_sync()
    ref_before = trainer.ref_logprobs(batch)
    out = ppo_step(trainer, batch)
    assert out["adv"].abs().sum() > 0
    for key in ("policy_loss", "clip_frac", "approx_kl", "entropy", "grad_norm"):
        assert math.isfinite(out["actor"][key]), key
    for key in ("value_loss", "vf_clip_frac", "grad_norm"):
        assert math.isfinite(out["critic"][key]), key
    assert out["actor"]["steps"] == out["critic"]["steps"] == 2 and out["actor"]["skipped_steps"] == 0
    after = trainer.actor_state_for_sync()
    assert after.keys() == before.keys() and "lm_head.weight" in after
    assert any(not torch.equal(before[k], after[k]) for k in before)
    ref_after = trainer.ref_logprobs(batch)
    assert torch.equal(ref_before, ref_after)
    kl = ppo_math.kl_estimate(trainer.old_logprobs(batch), ref_after, "k3")
    assert ppo_math.masked_mean(kl, batch.response_mask) > 0


def test_nan_advantage_skips_the_step(world1, tiny_actor_path):
    trainer = PPOTrainer(settings_for(tiny_actor_path, minibatches=1), world1)
    batch = rollout_batch(3)
    old = trainer.old_logprobs(batch)
    adv = torch.where(batch.response_mask, torch.ones_like(old), torch.zeros_like(old))
    adv[0, 0] = float("nan")
    before = trainer.actor_state_for_sync()
    stats = trainer.train_actor(batch, old, adv, current_version=0)
    assert stats["skipped_steps"] == 1 and stats["steps"] == 0
    assert_same_tensors(before, trainer.actor_state_for_sync())
    assert not trainer.actor_optim.state  # AdamW never stepped
    stats = trainer.train_actor(batch, old, torch.nan_to_num(adv, nan=1.0), current_version=0)
    assert stats["steps"] == 1  # the trainer is still usable


def test_all_stale_tokens_train_nothing_and_is_weights_run(world1, tiny_actor_path):
    stale = PPOTrainer(settings_for(tiny_actor_path, max_staleness=1, is_cap=2.0), world1)
    batch = rollout_batch(4, version=0)
    before = stale.actor_state_for_sync()
    old = stale.old_logprobs(batch)
    stats = stale.train_actor(batch, old, torch.ones_like(old), current_version=5)
    assert stats["empty_steps"] == 2 and stats["steps"] == 0
    assert_same_tensors(before, stale.actor_state_for_sync())
    stats = stale.train_actor(batch, old, torch.ones_like(old), current_version=1)  # all fresh enough
    assert stats["steps"] == 2 and math.isfinite(stats["policy_loss"])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_does_not_change_the_update(world1, tiny_actor_path, agg):
    batch = rollout_batch(5)
    results = []
    for micro in (4, 1):
        trainer = PPOTrainer(settings_for(tiny_actor_path, loss_agg=agg, micro_batch=micro), world1)
        old = trainer.old_logprobs(batch)
        trainer.train_actor(batch, old, batch.response_mask.float() * batch.scores[:, None], current_version=0)
        results.append(trainer.actor_state_for_sync())
    # one Adam step moves a weight by up to lr = 1e-3; float sums in other orders (each
    # micro-batch's own shapes) may move a weight whose gradient is ~Adam's eps by 1e-6
    assert_same_tensors(*results, exact=False, rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip_and_resume(world1, tiny_actor_path):
    settings = settings_for(tiny_actor_path)
    first = PPOTrainer(settings, world1)
    ppo_step(first, rollout_batch(6))
    state = first.state_dict()
    assert state["actor"]["optim"]["state"] and state["updates"] == {"actor": 1, "critic": 1}
    second = PPOTrainer(settings, world1)
    second.load_state_dict(state)
    assert_same_tensors(state, second.state_dict())
    ppo_step(first, rollout_batch(7))
    ppo_step(second, rollout_batch(7))
    assert_same_tensors(first.state_dict(), second.state_dict())


def test_checkpoint_before_first_step_changes_nothing(world1, tiny_actor_path):
    """torch initialises an empty optimizer with a zero-lr step when asked for its state;
    the trainer must not let that advance AdamW's step count."""
    settings, batch = settings_for(tiny_actor_path), rollout_batch(11)
    saved = PPOTrainer(settings, world1)
    state = saved.state_dict()
    assert state["actor"]["optim"] is None and not saved.actor_optim.state
    restored, untouched = PPOTrainer(settings, world1), PPOTrainer(settings, world1)
    restored.load_state_dict(state)
    for trainer in (saved, restored, untouched):
        ppo_step(trainer, batch)
    assert_same_tensors(untouched.state_dict(), saved.state_dict())
    assert_same_tensors(untouched.state_dict(), restored.state_dict())


def test_value_model_save_load_round_trip(trainer, tmp_path):
    batch = rollout_batch(8)
    state = trainer.state_dict()["critic"]["model"]  # gathered from the sharded critic
    fresh = ValueModel.from_pretrained(trainer.settings.actor_path)
    fresh.save_pretrained(tmp_path / "critic", state_dict=state)
    loaded = ValueModel.from_pretrained(tmp_path / "critic").eval()
    assert_same_tensors(state, {k: v for k, v in loaded.state_dict().items()})
    with torch.no_grad():
        values = loaded(batch.input_ids, batch.attention_mask)  # [B, L]
    assert values.shape == batch.input_ids.shape
    torch.testing.assert_close(trainer.values(batch), _response_only(values, batch), rtol=0, atol=1e-5)


def _response_only(values: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    from colocate.trainer.batch import response_values

    return response_values(values, batch)


def test_offload_is_a_no_op_on_cpu(trainer):
    assert trainer.offload() is False and trainer.onload() is False


def test_bfloat16_compute_keeps_float32_master_weights(world1, tiny_actor_path):
    trainer = PPOTrainer(settings_for(tiny_actor_path, dtype="bfloat16"), world1)
    out = ppo_step(trainer, rollout_batch(12))
    assert out["actor"]["steps"] == 2 and math.isfinite(out["actor"]["policy_loss"])
    assert out["old"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in trainer.actor.parameters())
    assert all(v.dtype == torch.float32 for v in trainer.actor_state_for_sync().values())


def test_settings_are_validated(tiny_actor_path):
    from colocate.trainer.errors import TrainerConfigError

    with pytest.raises(TrainerConfigError, match="loss_agg"):
        TrainerSettings(actor_path=tiny_actor_path, ppo=PPOConfig(loss_agg="sum"))
    assert TrainerSettings(actor_path="a").critic_source == "a"


def test_uneven_batch_is_refused(trainer):
    from colocate.trainer.errors import TrainerConfigError

    batch = rollout_batch(9, rows=3)
    old = trainer.old_logprobs(batch)
    with pytest.raises(TrainerConfigError, match="minibatches"):
        trainer.train_actor(batch, old, old, current_version=0)


# ---------------------------------------------------------------- world size 2


def world2_step(actor_path: str, out, settings: dict, batch: TrainBatch, make_settings=None, step=None) -> dict:
    """`step(trainer, batch)` (default `ppo_step`) on 2 spawned ranks, the trainer of
    `make_settings(actor_path, **settings)` (default `settings_for`), the same `batch` on
    both -> rank 0's {"state", "result"}."""
    args = (f"tcp://127.0.0.1:{free_port()}", actor_path, str(out), settings, batch,
            make_settings or settings_for, step or ppo_step)
    mp.spawn(_settings_worker, args=args, nprocs=2, join=True)
    return torch.load(out, weights_only=False)


def _settings_worker(rank: int, init_method: str, actor_path: str, out: str, settings: dict, batch,
                     make_settings, step) -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu", rank=rank, world_size=2, init_method=init_method)
    try:
        trainer = PPOTrainer(make_settings(actor_path, **settings), info)
        result = step(trainer, batch)
        state = trainer.state_dict()
        if info.is_main:
            torch.save({"state": state, "result": result}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_world_size_two_matches_world_size_one(world1, tiny_actor_path, tmp_path):
    """Token-mean over the whole minibatch on both: each rank divides its token sum by the
    minibatch's token count (every rank sees the full batch) and FSDP averages over ranks."""
    two = world2_step(tiny_actor_path, tmp_path / "world2.pt", {"micro_batch": 1}, rollout_batch(10))
    single = PPOTrainer(settings_for(tiny_actor_path), world1)
    one = ppo_step(single, rollout_batch(10))
    torch.testing.assert_close(two["result"]["old"], one["old"], rtol=0, atol=1e-6)
    state = single.state_dict()
    # Adam divides each gradient element by its own RMS: an element with |g| near eps turns
    # float rounding into up to ~1e-3 of its lr-sized step. atol 1e-5 = 1% of one step.
    for part in ("actor", "critic"):
        assert_same_tensors(state[part]["model"], two["state"][part]["model"], exact=False, rtol=1e-5, atol=1e-5)
    resumed = PPOTrainer(settings_for(tiny_actor_path), world1)  # a 2-rank checkpoint on 1 rank
    resumed.load_state_dict(two["state"])
    assert_same_tensors(two["state"], resumed.state_dict())
    for phase in ("actor", "critic"):
        for key, value in one[phase].items():
            assert two["result"][phase][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (phase, key)


def test_dist_info_world1(world1):
    assert isinstance(world1, DistInfo) and world1.world_size == 1 and world1.backend == "gloo"
    assert broadcast_object({"a": 1}, world1) == {"a": 1}
    assert dataclasses.is_dataclass(world1)


# ---------------------------------------------------------------- CUDA (skipped on CPU-only machines)


def _cuda_offload_worker(rank: int, init_method: str, actor_path: str, host_offload: str) -> None:
    info = init_distributed("cuda", rank=rank, world_size=1, init_method=init_method)
    try:
        moved, kept = (PPOTrainer(settings_for(actor_path, device="cuda", host_offload=host_offload), info)
                       for _ in range(2))
        for step in range(2):  # the second offload reuses the first one's host buffers
            for trainer in (moved, kept):
                ppo_step(trainer, rollout_batch(13 + step))
            on_gpu = torch.cuda.memory_allocated()
            before = moved.state_dict()
            assert moved.offload() is True
            assert torch.cuda.memory_allocated() < on_gpu
            assert all(p.device.type == "cpu" for p in moved.actor.parameters())
            state = moved.actor_optim.state[next(iter(moved.actor.parameters()))]
            assert state["exp_avg"].device.type == "cpu"
            if host_offload == "pinned":
                assert all(p.to_local().is_pinned() for p in moved.critic.parameters())
                assert state["exp_avg"].to_local().is_pinned()
                assert moved.stash.pinned_bytes > 0
            assert_same_tensors(before, moved.state_dict())  # nothing changed on the way out
            assert moved.onload() is True
            assert all(p.device.type == "cuda" for p in moved.actor.parameters())
            assert state["exp_avg"].device.type == "cuda"
        for trainer in (moved, kept):
            ppo_step(trainer, rollout_batch(15))
        # CUDA backward kernels (embedding, index) are not bitwise deterministic
        assert_same_tensors(kept.state_dict(), moved.state_dict(), exact=False, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("host_offload", ["pinned", "pageable"])
def test_offload_onload_round_trip_on_cuda(tiny_actor_path, host_offload):
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_cuda_offload_worker, args=(init_method, tiny_actor_path, host_offload), nprocs=1, join=True)


def _cuda_sync_order_worker(rank: int, init_method: str, actor_path: str) -> None:
    from colocate.run.timesharing import TimeSharing

    info = init_distributed("cuda", rank=rank, world_size=1, init_method=init_method)
    try:
        trainer = PPOTrainer(settings_for(actor_path, device="cuda"), info)
        ppo_step(trainer, rollout_batch(15))
        seen = {}

        def push(pairs):
            seen["state"] = {name: t.to("cpu", copy=True) for name, t in pairs}
            seen["pushed_on"] = next(trainer.actor.parameters()).device.type
            first = next(iter(trainer.actor.parameters()))
            seen["idle_on"] = {next(trainer.critic.parameters()).device.type, next(trainer.ref.parameters()).device.type,
                               trainer.actor_optim.state[first]["exp_avg"].device.type}
            return 0.0

        TimeSharing([], trainer, device_push=True).wake_and_sync(trainer.actor_tensors, push)
        assert seen["pushed_on"] == "cuda"  # gathered and pushed while FSDP still held its shards on the device
        assert seen["idle_on"] == {"cpu"}  # what the gather does not need was offloaded before the engines woke
        assert next(trainer.actor.parameters()).device.type == "cpu"  # offloaded after the push
        # an offloaded trainer still gathers and checkpoints (host tensors go over the gloo side of the group)
        assert_same_tensors(seen["state"], trainer.actor_state_for_sync())
        offloaded = trainer.state_dict()
        assert trainer.onload() is True
        assert_same_tensors(offloaded, trainer.state_dict())
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_push_gathers_on_the_device_then_offloads_and_offloaded_state_is_readable_on_cuda(tiny_actor_path):
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_cuda_sync_order_worker, args=(init_method, tiny_actor_path), nprocs=1, join=True)


# ---------------------------------------------------------------- critic-free estimators


def grouped(batch: TrainBatch, n: int = 2) -> TrainBatch:
    """`batch` with consecutive rows in groups of n."""
    return dataclasses.replace(batch, groups=torch.arange(batch.size) // n)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_baseline"])
def test_critic_free_trainer_has_no_critic_and_uses_group_baselines(world1, tiny_actor_path, advantage):
    from colocate.trainer.errors import TrainerConfigError
    from colocate.trainer.estimators import outcome_advantages

    trainer = PPOTrainer(settings_for(tiny_actor_path, advantage=advantage), world1)
    assert trainer.critic is None and trainer.critic_optim is None
    assert "critic" not in trainer.state_dict()
    batch = grouped(rollout_batch(3))
    with pytest.raises(TrainerConfigError, match="no critic"):
        trainer.values(batch)
    old, ref = trainer.old_logprobs(batch), trainer.ref_logprobs(batch)
    adv, returns, rewards, kl = trainer.advantages(batch, old, ref, None, kl_coef=0.1)
    total = batch.scores - 0.1 * (kl * batch.response_mask).sum(-1)  # score minus the summed KL penalty
    expected = outcome_advantages(total, batch.groups, batch.response_mask, advantage)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns[:, 0], total)
    stats = trainer.train_actor(batch, old, adv, current_version=0)
    assert math.isfinite(stats["policy_loss"]) and stats["grad_norm"] > 0
    # no critic in memory: after one update each, the PPO trainer holds the critic's
    # parameters, gradients and Adam moments on top of the same actor and reference
    ppo = PPOTrainer(settings_for(tiny_actor_path), world1)
    ppo_step(ppo, rollout_batch(3))
    critic = sum(p.numel() * p.element_size() for p in ppo.critic.parameters()) / 2**20
    extra = ppo.state_mb() - trainer.state_mb()
    assert 3 * critic <= extra <= 4.01 * critic  # params and 2 Adam moments (+ grads unless freed)


def test_kl_in_loss_adds_k3_to_the_actor_loss_not_to_the_reward(world1, tiny_actor_path):
    from colocate.trainer.errors import TrainerConfigError

    batch = grouped(rollout_batch(4))
    trainer = PPOTrainer(settings_for(tiny_actor_path, advantage="grpo", kl_in="loss", epochs=1), world1)
    old, ref = trainer.old_logprobs(batch), trainer.ref_logprobs(batch)
    adv, _, rewards, _ = trainer.advantages(batch, old, ref, None, kl_coef=0.5)
    last = batch.response_mask.sum(-1) - 1
    assert torch.equal(rewards.sum(-1), rewards[torch.arange(batch.size), last])  # the score only: no KL
    with pytest.raises(TrainerConfigError, match="ref_logp"):
        trainer.train_actor(batch, old, adv, current_version=0)
    stats = trainer.train_actor(batch, old, adv, current_version=0, ref_logp=ref, kl_coef=0.5)
    # the first minibatch starts at the reference weights: k3 there is 0; later ones moved
    assert 0 < stats["kl_loss"] < 1


@pytest.mark.parametrize("advantage,kl_in", [("gae", "reward"), ("grpo", "loss")])
def test_with_the_kl_off_no_reference_is_built_or_run_and_training_is_the_same(world1, tiny_actor_path,
                                                                              advantage, kl_in):
    """ppo.kl_coef=0 (fixed): the reference only ever multiplied 0. Without it the update is
    bit-for-bit the one a trainer holding it makes, with one model less in memory."""
    batch = grouped(rollout_batch(6)) if advantage == "grpo" else rollout_batch(6)
    steps = {}
    for reference in (True, False):
        trainer = PPOTrainer(settings_for(tiny_actor_path, advantage=advantage, kl_in=kl_in,
                                          reference=reference), world1)
        old, ref = trainer.old_logprobs(batch), trainer.ref_logprobs(batch)
        values = None if trainer.critic is None else trainer.values(batch)
        adv, returns, rewards, kl = trainer.advantages(batch, old, ref, values, kl_coef=0.0)
        if values is not None:
            trainer.train_critic(batch, values, returns)
        stats = trainer.train_actor(batch, old, adv, current_version=0, ref_logp=ref, kl_coef=0.0)
        steps[reference] = {"ref_is_none": ref is None, "models": len(trainer._models()),
                            "adv": adv, "rewards": rewards, "actor": dict(trainer.actor.state_dict()),
                            "loss": stats["policy_loss"]}
        if not reference:
            assert trainer.ref is None and torch.count_nonzero(kl) == 0
    assert not steps[True]["ref_is_none"] and steps[False]["ref_is_none"]
    assert steps[False]["models"] == steps[True]["models"] - 1
    for key in ("adv", "rewards", "actor", "loss"):
        assert_same_tensors(steps[True][key], steps[False][key], where=key)
