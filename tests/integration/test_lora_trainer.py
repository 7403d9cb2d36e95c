"""PPOTrainer with LoRA (PEFT) and gradient checkpointing, on FSDP2 over gloo on CPU, with tiny
random models and no engine.

Checked against independent references: a PEFT model stepped by hand with AdamW, PEFT's
own `merge_and_unload`, a full fine-tuning trainer's frozen reference, the trainer without
gradient checkpointing, and the same LoRA step on one rank.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from colocate.trainer import ppo_math
from colocate.trainer.batch import TrainBatch
from colocate.trainer.distributed import broadcast_object, decoder_layers, free_port, init_distributed
from colocate.trainer.lora import is_lora
from colocate.trainer.ppo_trainer import PPOTrainer
from colocate.trainer.sections import LoraConfig

from .test_trainer import assert_same_tensors, ppo_step, rollout_batch, settings_for

RANK, ALPHA = 4, 8.0
LORA = LoraConfig(rank=RANK, alpha=ALPHA)  # all-linear, actor and critic
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEP_BATCH = 20  # rollout_batch seed of the shared runs' step


def lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> full, detached copy of every parameter (unsharded)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def counted_step(trainer: PPOTrainer, batch: TrainBatch) -> tuple[dict, int]:
    """`ppo_step`, and how many times the actor's first decoder layer ran forward meanwhile
    (gradient checkpointing runs it again in backward)."""
    calls = [0]
    hook = decoder_layers(trainer.actor)[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        return ppo_step(trainer, batch), calls[0]
    finally:
        hook.remove()


@dataclasses.dataclass
class Run:
    """A trainer, its parameters before its one `ppo_step` on `batch`, and what came out."""

    trainer: PPOTrainer
    batch: TrainBatch
    initial: dict[str, dict[str, torch.Tensor]]
    out: dict
    forwards: int
    state: dict  # state_dict() right after the step
    synced: dict[str, torch.Tensor]  # actor_state_for_sync() right after the step


def stepped_run(settings, info) -> Run:
    trainer = PPOTrainer(settings, info)
    batch = rollout_batch(STEP_BATCH)
    initial = {"actor": full_params(trainer.actor), "critic": full_params(trainer.critic)}
    out, forwards = counted_step(trainer, batch)
    return Run(trainer, batch, initial, out, forwards, trainer.state_dict(), trainer.actor_state_for_sync())


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny models are overhead-bound (see test_trainer.py)


@pytest.fixture(scope="module")
def lora_run(world1, tiny_actor_path) -> Run:
    return stepped_run(settings_for(tiny_actor_path, lora=LORA), world1)


@pytest.fixture(scope="module")
def full_run(world1, tiny_actor_path) -> Run:
    return stepped_run(settings_for(tiny_actor_path), world1)


# ---------------------------------------------------------------- one update against PEFT + AdamW by hand


def reference_logp(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Log-probs [B, T] of the response tokens, one unpadded row at a time (0 on padding)."""
    rows = []
    for b in range(batch.size):
        start, n = int(batch.response_start[b]), int(batch.response_mask[b].sum())
        ids = batch.input_ids[b, : start + n]
        logits = model(input_ids=ids[None]).logits[0, start - 1 : start + n - 1].float()  # [n, V]
        picked = torch.log_softmax(logits, -1).gather(-1, ids[start:, None])[:, 0]  # [n]
        rows.append(torch.cat([picked, picked.new_zeros(batch.responses.shape[1] - n)]))
    return torch.stack(rows)  # [B, T]


def adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in state.items() if lora_param(n)}


@pytest.mark.parametrize("packing", [False, True])
def test_lora_update_equals_peft_stepped_by_hand(world1, tiny_actor_path, packing):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    settings = settings_for(tiny_actor_path, lora=LORA, packing=packing, epochs=1, minibatches=1, micro_batch=8,
                            advantage="grpo")  # no critic: the actor alone
    trainer = PPOTrainer(settings, world1)  # seeds torch with settings.seed, then loads and wraps the actor
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear",
                                             bias="none")).eval()
    mine = adapters(model.state_dict())
    assert_same_tensors(mine, adapters(trainer.state_dict()["actor"]["model"]))  # same seed, same adapters
    assert all(not t.any() for n, t in mine.items() if ".lora_B." in n)  # PEFT starts B at 0

    batch = rollout_batch(21)
    mask = batch.response_mask
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        start_logp = reference_logp(model, batch)
    old = torch.where(mask, start_logp + 0.3 * torch.randn(mask.shape, generator=gen), 0.0)  # ratios off 1: clipping
    adv = torch.where(mask, torch.randn(mask.shape, generator=gen), 0.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(mine)
    optimizer = torch.optim.AdamW(trainable, lr=settings.ppo.actor_lr, weight_decay=settings.ppo.weight_decay)
    for step in range(2):  # the first moves only B (A's gradient is 0 while B is); the second moves A too
        stats = trainer.train_actor(batch, old, adv, current_version=0)
        loss, _ = ppo_math.policy_loss(reference_logp(model, batch), old, adv, mask, settings.ppo.clip_eps,
                                       "token-mean")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, settings.ppo.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        assert stats["steps"] == 1 and stats["clip_frac"] > 0, stats
        assert stats["policy_loss"] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
        assert stats["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
        got = adapters(trainer.state_dict()["actor"]["model"])
        assert_same_tensors(adapters(model.state_dict()), got, exact=False, rtol=0, atol=1e-5, where=f"step {step}")
        moved = [n for n in got if not torch.equal(got[n], mine[n])]
        assert {".lora_B." in n for n in moved} == ({True} if step == 0 else {True, False}), moved


# ---------------------------------------------------------------- reference pass, sync


def test_reference_with_adapters_disabled_is_the_base_model(lora_run, full_run):
    batch = rollout_batch(22)
    ref = lora_run.trainer.ref_logprobs(batch)
    torch.testing.assert_close(ref, full_run.trainer.ref_logprobs(batch), rtol=0, atol=1e-6)
    old = lora_run.trainer.old_logprobs(batch)
    assert (old - ref).abs().max() > 1e-4  # the adapters are on again and they changed the policy
    assert lora_run.trainer.ref is None  # no third model


def peft_merged(actor_path: str, target_modules, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict of the actor with the trainer's adapter tensors, merged by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor_path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=target_modules))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not any(lora_param(n) for n in missing)
    return model.merge_and_unload().state_dict()


def assert_sync_is_peft_merge(synced: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> None:
    assert set(synced) <= set(merged)  # HF names
    for name, tensor in synced.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)


def test_sync_holds_the_adapted_linears_merged_all_linear(lora_run, tiny_actor_path):
    synced = lora_run.synced
    assert set(synced) == {f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight"
                           for i in range(2) for m in ALL_LINEAR}  # no embeddings, norms or LM head
    merged = peft_merged(tiny_actor_path, "all-linear", lora_run.state["actor"]["model"])
    assert_sync_is_peft_merge(synced, merged)
    base = lora_run.initial["actor"]
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(synced[name], base[f"base_model.model.{name.removesuffix('.weight')}.base_layer.weight"])
    streamed = dict(lora_run.trainer.actor_tensors())  # the device push: the same names and tensors
    assert streamed.keys() == lora_run.trainer.actor_state_for_sync().keys()


def test_a_whole_push_holds_the_merged_linears_and_every_other_base_tensor(lora_run, tiny_actor_path):
    """Issue 39.2/3: where the engine may not hold the base (CUDA engines after a wake; a
    run's first push into an engine kept from an earlier run) the push is the whole model:
    the adapted linears merged, everything else the frozen base, under the HF names."""
    from transformers import AutoModelForCausalLM

    whole = {n: t.clone() for n, t in lora_run.trainer.actor_tensors(adapted_only=False)}
    hf = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32).state_dict()
    assert whole.keys() == hf.keys()  # embeddings, norms and LM head included
    synced = lora_run.synced
    for name, tensor in whole.items():
        assert torch.equal(tensor, synced[name] if name in synced else hf[name]), name
    host = lora_run.trainer.actor_state_for_sync(adapted_only=False)
    assert host.keys() == whole.keys() and all(torch.equal(host[n], whole[n]) for n in whole)
    trainer = lora_run.trainer
    assert trainer.sync_numel(adapted_only=False) == sum(t.numel() for t in hf.values())
    assert trainer.sync_numel() == sum(t.numel() for t in synced.values())


def test_only_a_cpu_engines_step_pushes_may_leave_the_lora_base_out():
    """The decision (Session.adapted_only): CUDA engines release their weights without a host
    copy at every sleep, so every push there is whole; elsewhere only a run's first is."""
    from types import SimpleNamespace

    from colocate.run.session import Session

    def session(device_push):
        return SimpleNamespace(engines=SimpleNamespace(sharing=SimpleNamespace(device_push=device_push)))
    assert Session.adapted_only(session(False)) is True
    assert Session.adapted_only(session(False), first=True) is False
    assert Session.adapted_only(session(True)) is False and Session.adapted_only(session(True), first=True) is False


def test_sync_holds_only_the_targeted_linears_qwen(world1, tiny_qwen_path):
    lora = dataclasses.replace(LORA, target_modules="q_proj,v_proj")  # Qwen2's q/v carry a bias: not pushed
    trainer = PPOTrainer(settings_for(tiny_qwen_path, lora=lora, advantage="grpo"), world1)
    batch = rollout_batch(23)
    old = trainer.old_logprobs(batch)
    trainer.train_actor(batch, old, torch.where(batch.response_mask, 1.0, 0.0) * batch.scores[:, None], 0)
    synced = trainer.actor_state_for_sync()
    assert set(synced) == {f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")}
    assert_sync_is_peft_merge(synced, peft_merged(tiny_qwen_path, ["q_proj", "v_proj"],
                                                  trainer.state_dict()["actor"]["model"]))


# ---------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_changes_nothing(world1, tiny_actor_path, lora_run, full_run, lora):
    base = lora_run if lora else full_run
    settings = base.trainer.settings
    settings = dataclasses.replace(settings, ppo=dataclasses.replace(settings.ppo, gradient_checkpointing=True))
    run = stepped_run(settings, world1)
    assert run.forwards > base.forwards, (run.forwards, base.forwards)  # layers ran again in backward: it checkpoints
    for phase in ("actor", "critic"):
        for key, value in base.out[phase].items():
            assert run.out[phase][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (phase, key)
        assert_same_tensors(base.state[phase]["model"], run.state[phase]["model"], exact=False, rtol=0, atol=1e-6,
                            where=phase)
    assert_same_tensors(base.synced, run.synced, exact=False, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- what trains


def test_bf16_lora_actor_reduces_fp32_gradients_when_the_reference_pass_runs_first(world1, tiny_actor_path):
    """Found on an H200 (torch 2.11): FSDP2 fixes each group's gradient dtypes at the first
    forward from the parameters requiring grad then, and the step's first pass (the reference,
    PEFT's disable_adapter) turns the adapters' requires_grad off, so bf16 gradients met fp32
    shards in the first backward. The trainer fixes them at build, from the adapters."""
    trainer = PPOTrainer(settings_for(tiny_actor_path, dtype="bfloat16", lora=LORA, packing=True), world1)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in trainer.actor.modules() if isinstance(m, FSDPModule)]
    trained = [g for g in groups if g is not None and any(p.sharded_param.requires_grad for p in g.fsdp_params)]
    assert len(trained) == len(decoder_layers(trainer.actor))  # every layer holds adapters
    # fixed before any pass of a step: parameters in bf16, gradients reduced into the fp32 shards
    assert {(g._orig_dtype, g._reduce_dtype) for g in trained} == {(torch.float32, torch.float32)}
    batch = rollout_batch(STEP_BATCH)
    before = {n: p.detach().clone() for n, p in trainer.actor.named_parameters() if lora_param(n)}
    out = ppo_step(trainer, batch)  # reference (adapters disabled) first, then old log-probs, training
    assert math.isfinite(out["actor"]["policy_loss"]) and out["actor"]["grad_norm"] > 0
    after = dict(trainer.actor.named_parameters())
    assert all(after[n].dtype == torch.float32 for n in before)
    assert any(not torch.equal(after[n].detach(), before[n]) for n in before if ".lora_B." in n)


def test_lora_trains_only_adapters_and_the_value_head(lora_run):
    trainer, initial = lora_run.trainer, lora_run.initial
    now = {"actor": full_params(trainer.actor), "critic": full_params(trainer.critic)}
    assert lora_run.out["actor"]["steps"] == lora_run.out["critic"]["steps"] == 2
    for part, model, optimizer in (("actor", trainer.actor, trainer.actor_optim),
                                   ("critic", trainer.critic, trainer.critic_optim)):
        names = {n for n, _ in model.named_parameters()}
        lora_names = {n for n in names if lora_param(n)}
        head = {n for n in names if n.startswith("value_head.")}
        assert len(lora_names) == 2 * 2 * len(ALL_LINEAR)  # A and B of every linear of both layers
        for name in names - lora_names - head:
            assert torch.equal(now[part][name], initial[part][name]), (part, name)  # frozen base
        assert all(not torch.equal(now[part][n], initial[part][n]) for n in lora_names if ".lora_B." in n), part
        assert all(not torch.equal(now[part][n], initial[part][n]) for n in head), part  # the head trains in full
        trainable = {id(p) for n, p in model.named_parameters() if n in lora_names | head}
        assert {id(p) for p in optimizer_params(optimizer)} == trainable, part
        assert len(optimizer.state) == len(trainable), part
    assert {n for n in initial["critic"] if n.startswith("value_head.")} == {"value_head.weight", "value_head.bias"}


def test_lora_on_the_actor_only_trains_the_critic_in_full(world1, tiny_actor_path):
    lora = dataclasses.replace(LORA, critic=False)
    run = stepped_run(settings_for(tiny_actor_path, lora=lora), world1)
    trainer = run.trainer
    assert is_lora(trainer.actor) and not is_lora(trainer.critic) and trainer.ref is None
    critic_params = list(trainer.critic.parameters())
    assert all(p.requires_grad for p in critic_params)
    assert len(optimizer_params(trainer.critic_optim)) == len(critic_params)
    now = full_params(trainer.critic)
    changed = {n for n in now if not torch.equal(now[n], run.initial["critic"][n])}
    assert changed == set(now)  # backbone (embeddings, norms, every linear) and head all moved
    assert run.state["critic"]["model"].keys() == now.keys()
    assert all(lora_param(n) for n in run.state["actor"]["model"])


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_holds_trainable_tensors_and_resumes_exactly(world1, lora_run):
    original = lora_run.trainer
    state = original.state_dict()
    actor_keys, critic_keys = state["actor"]["model"].keys(), state["critic"]["model"].keys()
    assert actor_keys and all(lora_param(n) for n in actor_keys)
    assert {n for n in critic_keys if not lora_param(n)} == {"value_head.weight", "value_head.bias"}
    for part in ("actor", "critic"):
        assert state[part]["optim"]["state"].keys() == state[part]["model"].keys(), part  # Adam moments of each
    shapes = original.saved_shapes()
    assert {part: set(s) for part, s in shapes.items()} == {"actor": set(actor_keys), "critic": set(critic_keys)}
    assert all(shapes[p][n] == tuple(state[p]["model"][n].shape) for p in shapes for n in shapes[p])

    straight = PPOTrainer(original.settings, world1)  # loaded right after its build, as --resume does
    straight.load_state_dict(state)
    assert_same_tensors(original.actor_state_for_sync(), straight.actor_state_for_sync())
    resumed = PPOTrainer(original.settings, world1)
    trained = original.actor_state_for_sync()
    assert any(not torch.equal(v, trained[k]) for k, v in resumed.actor_state_for_sync().items())  # fresh adapters
    resumed.load_state_dict(state)
    assert_same_tensors(original.actor_state_for_sync(), resumed.actor_state_for_sync())
    assert_same_tensors(state, resumed.state_dict())
    batch = rollout_batch(24)
    first, second = ppo_step(original, batch), ppo_step(resumed, batch)
    assert_same_tensors(first, second)
    assert_same_tensors(original.state_dict(), resumed.state_dict())
    assert_same_tensors(original.actor_state_for_sync(), resumed.actor_state_for_sync())


def test_a_checkpoint_of_other_lora_settings_is_refused_in_one_line(world1, lora_run, full_run, tiny_actor_path):
    """A LoRA model loads its trainable tensors only (not strict), so a checkpoint of a full
    fine-tuning run or of other target modules would otherwise load partly, silently."""
    from colocate.trainer.errors import TrainerError

    other = PPOTrainer(settings_for(tiny_actor_path, lora=dataclasses.replace(LORA, target_modules="q_proj,v_proj")),
                       world1)
    for state in (full_run.state, lora_run.state):
        before = other.actor_state_for_sync()
        with pytest.raises(TrainerError) as err:
            other.load_state_dict(state)
        assert "\n" not in str(err.value) and "lora.* settings" in str(err.value)
        assert_same_tensors(before, other.actor_state_for_sync())  # nothing half-loaded


# ---------------------------------------------------------------- world size 2


def _world2_worker(rank: int, init_method: str, actor_path: str, out: str) -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu", rank=rank, world_size=2, init_method=init_method)
    try:
        trainer = PPOTrainer(settings_for(actor_path, micro_batch=1, lora=LORA), info)
        batch = broadcast_object(rollout_batch(STEP_BATCH) if info.is_main else None, info)
        result = ppo_step(trainer, batch)
        synced, state = trainer.actor_state_for_sync(), trainer.state_dict()  # collective
        if info.is_main:
            torch.save({"synced": synced, "state": state, "result": result}, out)
        else:
            assert synced == {}  # rank 0 only
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_lora_on_two_ranks_matches_one_rank(lora_run, tiny_actor_path, tmp_path):
    out = tmp_path / "world2.pt"
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_world2_worker, args=(init_method, tiny_actor_path, str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=False)
    torch.testing.assert_close(two["result"]["old"], lora_run.out["old"], rtol=0, atol=1e-6)
    # atol 1e-5 = 1% of one lr-sized Adam step (see test_trainer.py's two-rank test)
    assert_same_tensors(lora_run.synced, two["synced"], exact=False, rtol=1e-5, atol=1e-5)
    for part in ("actor", "critic"):
        assert_same_tensors(lora_run.state[part]["model"], two["state"][part]["model"], exact=False, rtol=1e-5,
                            atol=1e-5, where=part)
        for key, value in lora_run.out[part].items():
            assert two["result"][part][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (part, key)
    assert math.isfinite(two["result"]["actor"]["policy_loss"])
