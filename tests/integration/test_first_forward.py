"""The actor's first minibatch takes its old log-probs from its own forward (trainer/first_forward.py).

Against the trainer that computes every row's old log-probs in the no-grad pass: the same
filled old log-probs (1e-6), the same update (every parameter, 1e-5) and the same stats,
padded, packed, with shared prefixes, with LoRA, with gradient checkpointing, with
truncated-IS weights, with one minibatch (no pass at all) and on 2 ranks; refused where
the old log-probs are read before the update.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colocate.trainer.errors import TrainerConfigError
from colocate.trainer.ppo_trainer import PPOTrainer
from colocate.trainer.sections import LoraConfig
from tests.integration.test_trainer import assert_same_tensors, grouped, rollout_batch, settings_for, world2_step


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def actor_step(trainer: PPOTrainer, batch, first_forward: bool) -> dict:
    """ref and old log-probs (leaving the first minibatch's to its forward or not), the
    advantages, one train_actor -> the filled old log-probs, the stats and the actor's state."""
    ref = trainer.ref_logprobs(batch)
    old = trainer.old_logprobs(batch, current_version=0, leave_first=first_forward)
    left = old.clone()
    adv, _, _, _ = trainer.advantages(batch, old, ref, None, kl_coef=0.1)
    stats = trainer.train_actor(batch, old, adv, current_version=0, ref_logp=ref, kl_coef=0.1,
                                fill_first=first_forward)
    actor = {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}
    return {"old": old, "left": left, "stats": stats, "actor": actor}


def same_steps(with_pass: dict, first: dict) -> None:
    torch.testing.assert_close(first["old"], with_pass["old"], rtol=0, atol=1e-6)
    assert_same_tensors(with_pass["actor"], first["actor"], exact=False, rtol=1e-5, atol=1e-5)
    for key, value in with_pass["stats"].items():
        if key in ("approx_kl", "clip_frac"):  # exactly 0 on the first minibatch now, ~1e-14 before
            assert first["stats"][key] == pytest.approx(value, abs=1e-6), key
        else:
            assert first["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


CASES = {
    "padded": dict(packing=False),
    "packed": dict(packing=True),
    "shared_prefix": dict(packing=True, shared_prefix=True, micro_batch_tokens=24),  # groups split over micro-batches
    "lora": dict(packing=True, lora=LoraConfig(rank=4, alpha=8)),
    "checkpointing": dict(packing=True, gradient_checkpointing=True),
    "one_minibatch": dict(packing=True, minibatches=1, epochs=1),
    "is_cap": dict(packing=True, is_cap=1.05),  # deferral's staleness correction: weights from the filled values
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_minibatch_old_logprobs_from_its_forward_equal_the_pass(world1, tiny_actor_path, case):
    batch = grouped(rollout_batch(21), n=2)
    settings = settings_for(tiny_actor_path, **(dict(advantage="grpo", kl_in="loss", epochs=2) | CASES[case]))
    assert settings.old_logp_from_first_forward
    with_pass = actor_step(PPOTrainer(settings, world1), batch, first_forward=False)
    first = actor_step(PPOTrainer(settings, world1), batch, first_forward=True)
    same_steps(with_pass, first)
    # the pass left exactly the first minibatch's rows (whole groups), and computed the others
    left = (first["left"] == 0).all(-1) & batch.response_mask.any(-1)
    expected = PPOTrainer(settings, world1).old_logprobs(batch)  # a fresh trainer: same weights, same order
    assert int(left.sum()) == batch.size // settings.ppo.minibatches
    torch.testing.assert_close(first["left"][~left], expected[~left], rtol=0, atol=1e-6)
    assert torch.equal(batch.groups[left].unique(return_counts=True)[1], torch.full((int(left.sum()) // 2,), 2))


def test_ppo_with_a_critic_and_the_kl_in_the_loss_reads_no_old_logprobs_early(world1, tiny_actor_path):
    """GAE: the advantages read values and rewards; with the KL in the loss, not the old log-probs."""
    batch = rollout_batch(22)
    settings = settings_for(tiny_actor_path, kl_in="loss", epochs=2, packing=True)
    steps = {}
    for first_forward in (False, True):
        trainer = PPOTrainer(settings, world1)
        old = trainer.old_logprobs(batch, leave_first=first_forward)
        ref, values = trainer.ref_logprobs(batch), trainer.values(batch)
        adv, returns, _, _ = trainer.advantages(batch, old, ref, values, kl_coef=0.1)
        trainer.train_critic(batch, values, returns)
        stats = trainer.train_actor(batch, old, adv, 0, ref_logp=ref, kl_coef=0.1, fill_first=first_forward)
        steps[first_forward] = {"old": old, "adv": adv, "stats": stats,
                                "actor": {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}}
    assert_same_tensors(steps[False]["adv"], steps[True]["adv"], exact=False, rtol=0, atol=1e-6)
    same_steps(steps[False], steps[True])


def test_a_first_minibatch_with_nothing_to_train_gets_the_pass(world1, tiny_actor_path):
    """Every token of the first minibatch too stale to train (`max_staleness`): its step runs
    no forward, so its rows' old log-probs come from the no-grad pass after all (no step was
    taken, the weights are still the pass's) and the KL metric reads no hole."""
    settings = settings_for(tiny_actor_path, advantage="grpo", kl_in="loss", epochs=2, packing=True, max_staleness=1)
    batch = grouped(rollout_batch(25), n=2)
    first = PPOTrainer(settings, world1)._first_minibatch(batch, "test")
    versions = batch.versions.clone()
    versions[first] = -5  # 5 versions behind current_version 0
    batch = dataclasses.replace(batch, versions=versions)
    with_pass = actor_step(PPOTrainer(settings, world1), batch, first_forward=False)
    filled = actor_step(PPOTrainer(settings, world1), batch, first_forward=True)
    assert (filled["left"][first] == 0).all() and (filled["old"][first] != 0).any()
    same_steps(with_pass, filled)


@pytest.mark.parametrize("overrides", [dict(), dict(old_logp="rollout", kl_in="loss")],
                         ids=["kl_in_reward", "rollout_old_logp"])
def test_refused_where_old_logprobs_are_read_before_the_update(world1, tiny_actor_path, overrides):
    settings = settings_for(tiny_actor_path, **overrides)
    assert not settings.old_logp_from_first_forward
    trainer = PPOTrainer(settings, world1)
    batch = rollout_batch(23)
    with pytest.raises(TrainerConfigError, match="leave_first"):
        trainer.old_logprobs(batch, leave_first=True)
    old = trainer.old_logprobs(batch)
    with pytest.raises(TrainerConfigError, match="fill_first"):
        trainer.train_actor(batch, old, old, current_version=0, ref_logp=old, fill_first=True)


def test_the_kl_off_needs_no_early_old_logprobs_either(tiny_actor_path):
    assert settings_for(tiny_actor_path, reference=False).old_logp_from_first_forward  # kl_in=reward, no reference
    assert not settings_for(tiny_actor_path, kl_in="reward").old_logp_from_first_forward


def _first_forward_step(trainer: PPOTrainer, batch) -> dict:
    out = actor_step(trainer, batch, first_forward=True)
    return {"old": out["old"], "stats": out["stats"]}


@pytest.mark.slow
def test_two_ranks_fill_each_others_rows(world1, tiny_actor_path, tmp_path):
    """Each rank fills its own micro-batches' rows; the all-reduce after the first minibatch
    hands every rank all of them (the second epoch reshuffles rows across ranks)."""
    batch = grouped(rollout_batch(24), n=2)
    overrides = dict(advantage="grpo", kl_in="loss", epochs=2, packing=True)
    two = world2_step(tiny_actor_path, tmp_path / "world2.pt", overrides, batch, step=_first_forward_step)
    single = PPOTrainer(settings_for(tiny_actor_path, **overrides), world1)
    one = actor_step(single, batch, first_forward=False)
    torch.testing.assert_close(two["result"]["old"], one["old"], rtol=0, atol=1e-6)
    assert_same_tensors(single.state_dict()["actor"]["model"], two["state"]["actor"]["model"], exact=False,
                        rtol=1e-5, atol=1e-5)
    for key, value in one["stats"].items():
        if key not in ("approx_kl", "clip_frac"):
            assert two["result"]["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
