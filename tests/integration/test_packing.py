"""Padding-free packed rows give the padded path's results: per-token log-probs, entropies
and values of the tiny Llama and Qwen2 models, and the PPO update of the FSDP trainer
(world 1 in this process, world 2 in two spawned processes with idle micro-batches).
"""

from __future__ import annotations

import pytest
import torch

from colocate.trainer.batch import TrainBatch, make_batch
from colocate.trainer.critic import ValueModel
from colocate.trainer.forward import packed_policy_forward, packed_value_forward, policy_forward, value_forward
from colocate.trainer.ppo_trainer import PPOTrainer, TrainerSettings
from colocate.trainer.varlen_attention import register_varlen_sdpa
from tests.trainer_settings import settings_of

TOL = dict(rtol=0, atol=1e-5)


def ragged_batch(seed: int, rows: int = 8, version: int = 0) -> TrainBatch:
    """Random prompts of 1-12 tokens and responses of 0-20 tokens (one row empty)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return torch.randint(3, 250, (n,), generator=gen).tolist()

    prompts = [ids(1, 12) for _ in range(rows)]
    responses = [ids(1, 20) for _ in range(rows - 1)] + [[]]
    scores = torch.randn(rows, generator=gen).tolist()
    behaviour = [(-5.5 + 0.3 * torch.randn(len(r), generator=gen)).tolist() for r in responses]
    return make_batch(prompts, responses, 0, scores, behaviour, [[version] * len(r) for r in responses])


def settings_for(path: str, **overrides) -> TrainerSettings:
    """lr 1e-4: Adam's first steps move a weight by ~lr whatever its gradient's size, and turn
    float rounding of a gradient element near Adam's eps (other matmul shapes, other sums)
    into up to ~1% of lr, so 1e-5 is 10% of one step. Gradient scale is checked through the
    loss and grad_norm stats (rel 1e-4)."""
    base = dict(actor_path=path, actor_lr=1e-4, critic_lr=1e-4, minibatches=2, micro_batch=3, seed=0,
                micro_batch_tokens=64, packing=True, epochs=1, lam=0.95)
    return settings_of(**(base | overrides))


def ppo_step(trainer: PPOTrainer, batch: TrainBatch) -> dict:
    old, ref, values = trainer.old_logprobs(batch), trainer.ref_logprobs(batch), trainer.values(batch)
    adv, returns, _, _ = trainer.advantages(batch, old, ref, values, kl_coef=0.1)
    critic = trainer.train_critic(batch, values, returns)
    actor = trainer.train_actor(batch, old, adv, current_version=0)
    return {"old": old, "ref": ref, "values": values, "critic": critic, "actor": actor}


def assert_states_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **TOL, msg=lambda m: f"{key}: {m}")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(params=["llama", "qwen2"])
def model_path(request):
    return request.getfixturevalue("tiny_actor_path" if request.param == "llama" else "tiny_qwen_path")


@pytest.fixture(params=["sdpa", "varlen"])
def attn(request) -> str:
    """transformers' sdpa (packed: its block-diagonal mask) or the per-sequence varlen sdpa
    (with padded rows it falls back to transformers' sdpa and mask)."""
    return register_varlen_sdpa() if request.param == "varlen" else "sdpa"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_forwards_equal_padded(model_path, temperature, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attn).eval()
    critic = ValueModel.from_pretrained(model_path, attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    for seed in range(3):
        batch = ragged_batch(seed)
        with torch.no_grad():
            padded = policy_forward(model, batch, temperature, with_entropy=True)
            packed = packed_policy_forward(model, batch, temperature, with_entropy=True)
            values = value_forward(critic, batch), packed_value_forward(critic, batch)
        for x in (*padded, *packed, *values):
            assert x.shape == batch.responses.shape
        torch.testing.assert_close(packed[0], padded[0], **TOL)  # log-probs
        torch.testing.assert_close(packed[1], padded[1], **TOL)  # entropies
        torch.testing.assert_close(values[1], values[0], **TOL)
        assert torch.all(packed[0][~batch.response_mask] == 0) and torch.all(values[1][~batch.response_mask] == 0)


def test_packed_forward_does_not_attend_across_rows(tiny_actor_path, attn):
    """Row 1's log-probs packed after row 0 equal row 1 packed alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32, attn_implementation=attn).eval()
    batch = ragged_batch(7, rows=3)
    with torch.no_grad():
        together = packed_policy_forward(model, batch)[0]
        alone = packed_policy_forward(model, batch.select(torch.tensor([1])))[0]
    torch.testing.assert_close(together[1:2], alone, **TOL)


def test_packed_update_equals_padded_update(world1, model_path):
    batch = ragged_batch(11)
    results, states = [], []
    for packing in (False, True):
        trainer = PPOTrainer(settings_for(model_path, packing=packing), world1)
        results.append(ppo_step(trainer, batch))
        states.append(trainer.state_dict())
    for key in ("old", "ref", "values"):
        torch.testing.assert_close(results[1][key], results[0][key], **TOL)
    for part in ("actor", "critic"):
        assert_states_close(states[0][part]["model"], states[1][part]["model"])
        for key, value in results[0][part].items():
            assert results[1][part][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (part, key)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_token_budget_does_not_change_the_update(world1, tiny_actor_path, agg):
    """A budget below every row (each row alone), a small and a large one: the same update."""
    batch = ragged_batch(12)
    states = []
    for budget in (1, 24, 4096):
        trainer = PPOTrainer(settings_for(tiny_actor_path, loss_agg=agg, micro_batch_tokens=budget), world1)
        ppo_step(trainer, batch)
        states.append(trainer.state_dict())
    for other in states[1:]:
        for part in ("actor", "critic"):
            assert_states_close(states[0][part]["model"], other[part]["model"])


def test_old_logp_from_rollout_skips_fresh_rows_and_recomputes_stale_ones(world1, tiny_actor_path):
    batch = ragged_batch(13, version=2)
    versions = batch.versions.clone()
    versions[0, 0] = 1  # row 0 holds one token of the previous weights (a deferred partial)
    batch = TrainBatch(**{**batch.__dict__, "versions": versions})
    rollout = PPOTrainer(settings_for(tiny_actor_path, old_logp="rollout"), world1)
    recompute = PPOTrainer(settings_for(tiny_actor_path), world1)
    old = rollout.old_logprobs(batch, current_version=2)
    full = recompute.old_logprobs(batch, current_version=2)
    torch.testing.assert_close(old[0], full[0], **TOL)  # recomputed row
    assert torch.equal(old[1:], batch.behaviour_logp[1:])  # the engine's, untouched
    assert torch.equal(rollout.old_logprobs(batch), full)  # no version given: recompute everything


def test_drift_metric_is_reported(world1, tiny_actor_path):
    trainer = PPOTrainer(settings_for(tiny_actor_path), world1)
    batch = ragged_batch(14)
    old = trainer.old_logprobs(batch)
    exact = TrainBatch(**{**batch.__dict__, "behaviour_logp": old})  # an engine that matches exactly
    stats = trainer.train_actor(exact, old, batch.response_mask.float(), current_version=0)
    assert stats["logp_drift_mean"] < 1e-5 and stats["logp_drift_max"] < 1e-5
    stats = trainer.train_actor(batch, old, batch.response_mask.float(), current_version=0)
    assert stats["logp_drift_max"] > 0.1  # the batch's behaviour log-probs are random
    assert "logp_drift_mean" not in trainer.train_actor(batch, old, old, current_version=5)  # nothing on-policy


# ---------------------------------------------------------------- world size 2

WORLD2_BUDGET = 18  # rows of 8-27 tokens: rank 0 packs 3 micro-batches, rank 1 four (one idle on rank 0)


@pytest.mark.slow
def test_world_size_two_packed_matches_world_size_one(world1, tiny_actor_path, tmp_path):
    from colocate.trainer.packing import packed_micro_batches

    lengths = ragged_batch(15).attention_mask.sum(-1).tolist()
    real = [sum(1 for mb in packed_micro_batches(lengths, 2, r, WORLD2_BUDGET) if mb) for r in range(2)]
    assert real[0] != real[1]  # the case needs idle micro-batches on one rank
    from .test_trainer import world2_step

    two = world2_step(tiny_actor_path, tmp_path / "world2.pt", {"micro_batch_tokens": WORLD2_BUDGET},
                      ragged_batch(15), settings_for, ppo_step)
    single = PPOTrainer(settings_for(tiny_actor_path), world1)
    one = ppo_step(single, ragged_batch(15))
    for key in ("old", "ref", "values"):
        torch.testing.assert_close(two["result"][key], one[key], **TOL)
    state = single.state_dict()
    for part in ("actor", "critic"):
        assert_states_close(state[part]["model"], two["state"][part]["model"])
