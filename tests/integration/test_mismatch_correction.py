"""The mismatch corrections (`ppo.rollout_correction`, trainer/mismatch.py) in the real trainer.

Padded, packed, shared-prefix and LoRA rows mask the same tokens, report the same share,
and a masked token leaves the update exactly as the staleness mask leaving it out does;
with the first minibatch's old log-probs from its own forward the mask comes from those
values and the update is the no-grad pass's (also where that forward masks every token,
and on 2 ranks); the loop reports `actor/mismatch_masked_frac` in a real run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from colocate import api
from colocate.config import load_config
from colocate.trainer.advantages import actor_inputs
from colocate.trainer.ppo_trainer import PPOTrainer
from colocate.trainer.sections import LoraConfig
from tests.integration.test_first_forward import actor_step, same_steps
from tests.integration.test_trainer import assert_same_tensors, grouped, rollout_batch, settings_for, world2_step

SEEDS = (3, 4)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)

PATHS = {
    "padded": dict(packing=False),
    "packed": dict(packing=True, shared_prefix=False),
    "shared_prefix": dict(packing=True, shared_prefix=True, micro_batch_tokens=24),  # groups split over micro-batches
    "lora": dict(packing=True, lora=LoraConfig(rank=4, alpha=8)),
}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def off_band(batch, kind: str) -> torch.Tensor:
    """[B, T] log-prob gaps: 0 on most tokens, out of `kind`'s default band on some (±2
    per token: ratios e^-2, e^2 outside [0.5, 2] and [0.5, 5]; seq_mis: +0.5 on every
    token of every third row, a geometric mean of e^-0.5)."""
    b, t = torch.meshgrid(torch.arange(batch.size), torch.arange(batch.responses.shape[1]), indexing="ij")
    if kind == "seq_mis":
        gaps = torch.where(b % 3 == 0, 0.5, 0.0)
    else:
        gaps = torch.where((b + t) % 3 == 0, 2.0, torch.where((b + 2 * t) % 5 == 0, -2.0, 0.0))
    return torch.where(batch.loss_mask, gaps, torch.zeros_like(gaps))


def mismatched(batch, tiny_actor_path, world1, kind):
    """`batch` whose behaviour log-probs are the padded trainer's old log-probs moved by
    `off_band`, and the tokens a correction must keep."""
    old = PPOTrainer(settings_for(tiny_actor_path), world1).old_logprobs(batch)
    gaps = off_band(batch, kind)
    batch = dataclasses.replace(batch, behaviour_logp=torch.where(batch.loss_mask, old + gaps, torch.zeros_like(old)))
    return batch, batch.loss_mask & (gaps == 0)


@pytest.mark.parametrize("kind", ["token_mis", "seq_mis", "icepop"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_row_layout_masks_the_same_tokens_and_they_leave_the_update(world1, tiny_actor_path, path, kind):
    batch, keep = mismatched(grouped(rollout_batch(31), n=2), tiny_actor_path, world1, kind)
    assert 0 < int(keep.sum()) < int(batch.loss_mask.sum())
    adv = torch.where(batch.loss_mask, batch.scores[:, None].expand_as(batch.behaviour_logp), torch.zeros(()))
    trainer = PPOTrainer(settings_for(tiny_actor_path, rollout_correction=kind, **PATHS[path]), world1)
    old = trainer.old_logprobs(batch)
    assert torch.equal(actor_inputs(trainer.settings, batch, old, adv, 0, None)["loss_mask"], keep)
    stats = trainer.train_actor(batch, old, adv, current_version=0)
    assert stats["mismatch_masked_frac"] == pytest.approx(1 - int(keep.sum()) / int(batch.loss_mask.sum()), abs=1e-12)
    # the same tokens left out by the staleness mask instead (5 versions old): the same update
    stale = dataclasses.replace(batch, versions=torch.where(keep, 0, -5))
    plain = PPOTrainer(settings_for(tiny_actor_path, max_staleness=1, **PATHS[path]), world1)
    plain.train_actor(stale, plain.old_logprobs(stale), adv, current_version=0)
    assert_same_tensors(plain.actor_state_for_sync(), trainer.actor_state_for_sync(), exact=False,
                        rtol=1e-5, atol=1e-5)


def test_without_a_correction_nothing_is_masked_or_reported(world1, tiny_actor_path):
    batch, _ = mismatched(rollout_batch(32), tiny_actor_path, world1, "token_mis")
    trainer = PPOTrainer(settings_for(tiny_actor_path), world1)
    old = trainer.old_logprobs(batch)
    assert actor_inputs(trainer.settings, batch, old, old, 0, None)["loss_mask"] is batch.loss_mask
    assert "mismatch_masked_frac" not in trainer.train_actor(batch, old, old, current_version=0)


# rollout_batch's behaviour log-probs are -5.5 ± 0.3 against the tiny model's ~-5.5: bands
# this narrow keep about half of the tokens (or rows)
FIRST = {
    "padded_token_mis": dict(packing=False, rollout_correction="token_mis", rollout_correction_upper=1.2),
    "packed_seq_mis": dict(packing=True, rollout_correction="seq_mis", rollout_correction_upper=1.1),
    "shared_icepop": dict(packing=True, shared_prefix=True, micro_batch_tokens=24, rollout_correction="icepop",
                          rollout_correction_lower=0.8, rollout_correction_upper=1.25),
    "lora_token_mis": dict(packing=True, lora=LoraConfig(rank=4, alpha=8), rollout_correction="token_mis",
                           rollout_correction_upper=1.2),
    "seq_mean_seq_mis": dict(packing=True, loss_agg="seq-mean-token-mean", rollout_correction="seq_mis",
                             rollout_correction_upper=1.1),
    "is_cap_token_mis": dict(packing=True, is_cap=1.05, rollout_correction="token_mis", rollout_correction_upper=1.2),
}


def close_steps(with_pass: dict, first: dict) -> None:
    """The same old log-probs and stats; the same actor but where Adam amplifies rounding.

    The first forward's loss is normalised over the tokens it keeps only after the
    minibatch's forwards (its gradients rescaled by the tokens before / after the
    correction), which rounds differently from the pass's (~1e-6 of the largest gradient,
    measured). Adam divides each gradient by its own magnitude, so an element whose
    gradient is near Adam's eps moves differently; a wrong mask, weight or normaliser
    moves the stats (the loss, the gradient norm, the masked share) and most elements."""
    torch.testing.assert_close(first["old"], with_pass["old"], rtol=0, atol=1e-6)
    for key, value in with_pass["stats"].items():
        assert first["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    diffs = [(with_pass["actor"][k] - first["actor"][k]).abs().flatten() for k in with_pass["actor"]]
    diff = torch.cat(diffs)
    assert float((diff > 1e-5).float().mean()) < 1e-3 and float(diff.max()) < 1e-3  # 1e-3: one step's lr


@pytest.mark.parametrize("case", sorted(FIRST))
def test_the_first_forward_masks_from_its_own_old_logprobs_as_the_pass_would(world1, tiny_actor_path, case):
    """The first minibatch's loss runs on the tokens its forward's old log-probs keep, its
    loss normalised over them: the same update, stats and masked share as the pass's."""
    batch = grouped(rollout_batch(33), n=2)
    settings = settings_for(tiny_actor_path, **(dict(advantage="grpo", kl_in="loss", epochs=2) | FIRST[case]))
    assert settings.old_logp_from_first_forward
    with_pass = actor_step(PPOTrainer(settings, world1), batch, first_forward=False)
    first = actor_step(PPOTrainer(settings, world1), batch, first_forward=True)
    assert 0.2 < with_pass["stats"]["mismatch_masked_frac"] < 0.8
    close_steps(with_pass, first)


def test_a_first_minibatch_its_forward_masks_whole_takes_no_step(world1, tiny_actor_path):
    """Every token of the first minibatch out of the band: the pass's step is empty before
    any forward, the first forward's after it; neither moves the weights."""
    settings = settings_for(tiny_actor_path, advantage="grpo", kl_in="loss", epochs=2, packing=True,
                            rollout_correction="token_mis")
    batch = grouped(rollout_batch(34), n=2)
    old = PPOTrainer(settings, world1).old_logprobs(batch)
    first = PPOTrainer(settings, world1)._first_minibatch(batch, "test")
    gaps = torch.zeros_like(old)
    gaps[first] = 3.0  # ratio e^-3
    batch = dataclasses.replace(batch, behaviour_logp=torch.where(batch.loss_mask, old + gaps, torch.zeros_like(old)))
    with_pass = actor_step(PPOTrainer(settings, world1), batch, first_forward=False)
    filled = actor_step(PPOTrainer(settings, world1), batch, first_forward=True)
    assert with_pass["stats"]["empty_steps"] >= 1 and with_pass["stats"]["steps"] >= 1
    same_steps(with_pass, filled)


def _first_forward_step(trainer: PPOTrainer, batch) -> dict:
    out = actor_step(trainer, batch, first_forward=True)
    return {"old": out["old"], "stats": out["stats"]}


@pytest.mark.slow
def test_two_ranks_mask_and_normalise_as_one(world1, tiny_actor_path, tmp_path):
    """Each rank masks its own micro-batches of the first minibatch; the minibatch's kept
    tokens are summed over ranks before the step."""
    batch = grouped(rollout_batch(35), n=2)
    overrides = dict(advantage="grpo", kl_in="loss", epochs=2, packing=True, rollout_correction="token_mis",
                     rollout_correction_upper=1.2)
    two = world2_step(tiny_actor_path, tmp_path / "world2.pt", overrides, batch, step=_first_forward_step)
    single = PPOTrainer(settings_for(tiny_actor_path, **overrides), world1)
    one = actor_step(single, batch, first_forward=False)
    assert 0 < one["stats"]["mismatch_masked_frac"] < 1
    close_steps(one | {"actor": single.state_dict()["actor"]["model"]},
                two["result"] | {"actor": two["state"]["actor"]["model"]})


@pytest.mark.slow
def test_a_real_run_reports_the_masked_share_from_the_engines_log_probs(tiny_pair, run_overrides, engine_pool,
                                                                        tmp_path):
    """On real engines, with the KL in the loss (the first minibatch's old log-probs from
    its forward, whose drift probe reads the same tokens): with IcePop's [0.5, 5] float32's
    engine/trainer gap (< 1e-4) masks nothing; with a band of ±1e-7 every first-minibatch
    token whose gap the probe saw above it is masked, so the share is > 0 when it saw one."""
    models = tiny_pair("loop", *SEEDS)  # test_ppo_loop's pair: the suite's pool has its engines
    common = ("rollout.max_new_tokens=12", "run.eval_every=0", "ppo.kl_in=loss")
    icepop = api.train(load_config(overrides=run_overrides(models, tmp_path / "icepop", "run.steps=2", *common,
                                                           "ppo.rollout_correction=icepop")),
                       quiet=True, engines=engine_pool)
    assert [h["step"] for h in icepop.history] == [1, 2]
    for h in icepop.history:
        assert h["actor/logp_drift_max"] < 1e-3 and h["actor/mismatch_masked_frac"] == 0.0
        assert math.isfinite(h["actor/policy_loss"]) and h["actor/steps"] > 0
    upper = 1.0000001
    tight = api.train(load_config(overrides=run_overrides(models, tmp_path / "tight", "run.steps=1", *common,
                                                          "ppo.rollout_correction=token_mis",
                                                          f"ppo.rollout_correction_upper={upper}")),
                      quiet=True, engines=engine_pool)
    (h,) = tight.history
    assert 0.0 <= h["actor/mismatch_masked_frac"] <= 1.0
    if h["actor/logp_drift_max"] > 1.01 * math.log(upper):
        assert h["actor/mismatch_masked_frac"] > 0.0
