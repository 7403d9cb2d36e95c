"""Multi-turn trajectories on the trainer side: environment tokens (tool outputs between model
turns) are context, but out of the policy loss, the KL, the advantages and the value loss.

`make_batch`'s loss masks; GAE passing through environment tokens against a naive loop
that drops them, runs plain GAE on the model tokens and scatters back; and, on a tiny
Llama under `PPOTrainer` (FSDP2 over a one-process gloo group): the gradient at the
logits that predict environment tokens is exactly 0, and one actor / critic update is
bitwise the same whatever the inputs hold on environment tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from colocate.trainer import ppo_math as pm
from colocate.trainer.batch import TrainBatch, make_batch, response_positions
from colocate.trainer.packed import idle_batch, pack
from colocate.trainer.ppo_trainer import PPOTrainer, TrainerSettings
from tests.trainer_settings import settings_of

VERSION = 3  # the current weight version of the trainer tests

# ---------------------------------------------------------------- make_batch


def test_make_batch_loss_masks():
    prompts = [[5, 6], [7], [8, 9, 10], [11]]
    responses = [[1, 2, 3, 4], [1, 2], [], [3, 4, 5]]
    behaviour = [[-0.5] * len(r) for r in responses]
    versions = [[0] * len(r) for r in responses]
    masks = [[1, 0, 0, 1], [], [], [True, True, False]]  # [] = every token the model's
    batch = make_batch(prompts, responses, 0, [0.0] * 4, behaviour, versions, loss_masks=masks)
    want = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert batch.loss_mask.dtype == torch.bool and torch.equal(batch.loss_mask, want)
    assert not bool((batch.loss_mask & ~batch.response_mask).any())  # a subset of the response
    plain = make_batch(prompts, responses, 0, [0.0] * 4, behaviour, versions)
    assert torch.equal(plain.loss_mask, plain.response_mask)  # None: every response token trained
    everything = make_batch(prompts, responses, 0, [0.0] * 4, behaviour, versions, loss_masks=[[]] * 4)
    assert torch.equal(everything.loss_mask, plain.response_mask)
    for field in dataclasses.fields(TrainBatch):  # nothing else changes
        if field.name != "loss_mask":
            assert torch.equal(getattr(batch, field.name), getattr(plain, field.name)), field.name
    # the row tools keep the field: select, to, trimmed, the idle micro-batch
    assert torch.equal(batch.select(torch.tensor([3, 0])).loss_mask, want[[3, 0]])
    assert torch.equal(batch.to("cpu").trimmed().loss_mask, want)
    assert not bool(idle_batch(batch).loss_mask.any())


@pytest.mark.parametrize("masks,message", [
    ([[1, 0, 1], [1]], "row 0: 4 response tokens but a loss mask of 3"),
    ([[1, 0, 1, 1], [1, 1]], "row 1: 1 response tokens but a loss mask of 2"),
    ([[1, 0, 1, 1]], "1 loss masks for 2 rows"),
    ([[1, 0, 2, 1], []], "row 0: loss mask entries must be 0 or 1"),
])
def test_make_batch_rejects_bad_loss_masks(masks, message):
    responses = [[1, 2, 3, 4], [5]]
    with pytest.raises(ValueError, match=message) as err:
        make_batch([[9], [9]], responses, 0, [0.0, 0.0], [[0.0] * 4, [0.0]], [[0] * 4, [0]], loss_masks=masks)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- GAE through environment tokens


def gae_before(rewards, values, mask, gamma, lam):
    """`gae_advantages` as it was before `acting` (the reference for acting=None)."""
    valid = mask.bool()
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = lambda x, m: torch.where(m, x, torch.zeros((), dtype=x.dtype))  # noqa: E731
    r, v = zero(rewards.to(dtype), valid), zero(values.to(dtype), valid)
    advantages = torch.zeros_like(v)
    next_value, next_adv = torch.zeros_like(v[:, 0]), torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_adv = zero(delta + gamma * lam * next_adv, valid[:, t])
        advantages[:, t] = next_adv
        next_value = v[:, t]
    return advantages, zero(advantages + v, valid)


def naive_multi_turn_gae(r, v, lengths, acting, gamma, lam):
    """Per row: keep the acting tokens of the first `lengths[i]`, plain GAE over them, scatter back."""
    adv = [[0.0] * len(row) for row in r]
    ret = [[0.0] * len(row) for row in r]
    for i, n in enumerate(lengths):
        idx = [t for t in range(n) if acting[i][t]]
        next_value = next_adv = 0.0
        for t in reversed(idx):
            next_adv = r[i][t] + gamma * next_value - v[i][t] + gamma * lam * next_adv
            next_value = v[i][t]
            adv[i][t], ret[i][t] = next_adv, next_adv + v[i][t]
    return adv, ret


@st.composite
def trajectories(draw):
    t = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, t), min_size=1, max_size=4))
    return t, tuple(lengths), draw(st.integers(0, 2**31 - 1))


def random_rows(case):
    t, lengths, seed = case
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[i < n for i in range(t)] for n in lengths])
    acting = torch.rand(len(lengths), t, generator=g) < 0.6  # also True on padding: must be ignored there
    r = torch.randn(len(lengths), t, generator=g, dtype=torch.float64)
    v = torch.randn(len(lengths), t, generator=g, dtype=torch.float64)
    return mask, acting, r, v, lengths


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.0, 0.0), (1.0, 0.95)])
@settings(max_examples=40, deadline=None, database=None)
@given(case=trajectories())
@example(case=(5, (5,), 0))
@example(case=(1, (0, 1), 1))
def test_gae_passes_through_environment_tokens_like_naive_loop(case, gamma, lam):
    mask, acting, r, v, lengths = random_rows(case)
    adv, ret = pm.gae_advantages(r, v, mask, gamma, lam, acting=acting)
    want_adv, want_ret = naive_multi_turn_gae(r.tolist(), v.tolist(), lengths, acting.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    env = mask & ~acting
    assert not bool(adv[env].any()) and not bool(ret[env].any())  # no decision, no advantage
    # rewards and values on environment tokens are never read
    junk = torch.full_like(r, float("nan"))
    again = pm.gae_advantages(torch.where(env, junk, r), torch.where(env, junk, v), mask, gamma, lam, acting=acting)
    assert torch.equal(again[0], adv) and torch.equal(again[1], ret)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.0, 0.0)])
@settings(max_examples=25, deadline=None, database=None)
@given(case=trajectories())
def test_gae_without_acting_is_exactly_the_old_gae(case, gamma, lam):
    mask, _, r, v, _ = random_rows(case)
    holes = mask & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(case[2])) < 0.8)
    for m in (mask, holes):  # right-padded rows, and rows whose holes end the episode
        for dtype in (torch.float32, torch.float64):
            got = pm.gae_advantages(r.to(dtype), v.to(dtype), m, gamma, lam)
            want = gae_before(r.to(dtype), v.to(dtype), m, gamma, lam)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            same = pm.gae_advantages(r.to(dtype), v.to(dtype), m, gamma, lam, acting=m)
            assert torch.equal(same[0], want[0]) and torch.equal(same[1], want[1])


def test_gae_through_a_tool_output_closed_form():
    r = torch.tensor([[0.0, 7.0, 7.0, 1.0, 9.0]])
    v = torch.tensor([[0.5, 100.0, 100.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    acting = torch.tensor([[1, 0, 0, 1, 1]])  # model, tool output (2 tokens), model, padding
    adv, ret = pm.gae_advantages(r, v, mask, gamma=0.5, lam=1.0, acting=acting)
    # the last model token: 1 - 2; the first bootstraps from V = 2 across the tool output, undiscounted by it
    torch.testing.assert_close(adv, torch.tensor([[0.0 + 0.5 * 2.0 - 0.5 + 0.5 * (1.0 - 2.0), 0, 0, -1.0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5 + 0.0, 0, 0, 1.0, 0]]))
    hole = torch.tensor([[1, 0, 0, 1, 0]])  # a 0 in mask (not in acting) still ends the episode
    adv, _ = pm.gae_advantages(r, v, hole, gamma=0.5, lam=1.0, acting=acting)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0, 0, -1.0, 0]]))


def test_token_rewards_score_the_last_model_token():
    kl = torch.ones(2, 6)
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool)  # row 0 ends with a tool output
    got = pm.token_rewards(torch.tensor([10.0, 20.0]), kl, loss_mask, kl_coef=0.5)
    want = torch.tensor([[-0.5, -0.5, 0, 0, 9.5, 0], [-0.5, 0, 19.5, 0, 0, 0]])
    assert torch.equal(got, want)


# ---------------------------------------------------------------- the trainer

# per row: (model tokens, environment tokens, model tokens, ...); prompts are distinct
TRAJECTORIES = [(3, 2, 2), (4,), (2, 3), (1, 1, 2, 2, 1), (2, 2, 3), (5,), (1, 4, 1), (3, 1)]


def trajectory_batch(seed: int = 0) -> TrainBatch:
    """Rows of model turns and environment spans, as the rollout builds them: environment
    tokens have behaviour logprob 0.0 and the version of the model token before them; model
    tokens are of VERSION or one version older."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, behaviour, versions, masks = [], [], [], [], []
    for b, spans in enumerate(TRAJECTORIES):
        prompts.append([3 + b, *torch.randint(3, 250, (int(torch.randint(1, 5, (1,), generator=gen)),),
                                              generator=gen).tolist()])
        ids, logp, ver, mask = [], [], [], []
        for k, n in enumerate(spans):
            model = k % 2 == 0
            ids += torch.randint(3, 250, (n,), generator=gen).tolist()
            mask += [int(model)] * n
            if model:
                logp += (-5.5 + 0.3 * torch.randn(n, generator=gen)).tolist()
                ver += [VERSION - int(torch.randint(0, 2, (1,), generator=gen))] * n
            else:
                logp += [0.0] * n
                ver += [ver[-1]] * n
        responses.append(ids), behaviour.append(logp), versions.append(ver), masks.append(mask)
    scores = torch.randn(len(prompts), generator=gen).tolist()
    return make_batch(prompts, responses, 0, scores, behaviour, versions, loss_masks=masks)


def on_env(batch: TrainBatch, x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with arbitrary values (large, inf, nan) on the environment tokens of `batch`."""
    env = batch.response_mask & ~batch.loss_mask
    gen = torch.Generator().manual_seed(seed)
    junk = (1e4 * torch.randn(x.shape, generator=gen)).to(x.dtype)
    if x.dtype.is_floating_point:
        junk.view(-1)[0::3] = float("inf")
        junk.view(-1)[1::7] = float("nan")
        junk.view(-1)[2::5] = -float("inf")
    return torch.where(env, junk, x)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny models are overhead-bound on a shared 2-core machine


def settings_for(actor_path: str, **overrides) -> TrainerSettings:
    base = dict(actor_path=actor_path, actor_lr=1e-3, critic_lr=1e-3, minibatches=2, micro_batch=2, epochs=2,
                seed=0, is_cap=2.0, max_staleness=1, lam=0.95, packing=False)
    return settings_of(**(base | overrides))


class SpyTrainer(PPOTrainer):
    """A PPOTrainer that records each micro-batch its training forwards see, and the
    gradient of the loss with respect to the actor's logits / the critic's values of each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[TrainBatch] = []
        self.logit_grads: list[torch.Tensor] = []
        self.seen_by_critic: list[TrainBatch] = []
        self.value_grads: list[torch.Tensor] = []

        def keep_grad(_module, _inputs, logits):
            if logits.requires_grad:
                logits.register_hook(lambda g: self.logit_grads.append(g.detach().clone()))

        self.actor.lm_head.register_forward_hook(keep_grad)

    @property
    def _policy(self):
        forward = super()._policy

        def spy(model, mb, *args, **kwargs):
            if torch.is_grad_enabled():
                self.seen.append(mb)
            return forward(model, mb, *args, **kwargs)

        return spy

    @property
    def _value(self):
        forward = super()._value

        def spy(model, mb):
            values = forward(model, mb)  # [b, T]
            if values.requires_grad:
                self.seen_by_critic.append(mb)
                values.register_hook(lambda g: self.value_grads.append(g.detach().clone()))
            return values

        return spy


@pytest.mark.parametrize("packing", [False, True])
def test_no_gradient_at_logits_predicting_environment_tokens(world1, tiny_actor_path, packing):
    trainer = SpyTrainer(settings_for(tiny_actor_path, packing=packing, kl_in="loss"), world1)
    batch = trajectory_batch()
    old, ref = trainer.old_logprobs(batch), trainer.ref_logprobs(batch)
    adv = torch.where(batch.response_mask, torch.randn(batch.responses.shape), torch.zeros(()))  # env tokens too
    trainer.train_actor(batch, old, adv, VERSION, ref_logp=ref, kl_coef=0.1)
    assert trainer.seen and len(trainer.seen) == len(trainer.logit_grads)
    env_checked = model_checked = 0
    for mb, grad in zip(trainer.seen, trainer.logit_grads):
        env = mb.response_mask & ~mb.loss_mask  # [b, T]
        trained = pm.staleness_mask(mb.versions, VERSION, 1, mb.loss_mask)
        if packing:  # [1, n, V]: one row per response token, row-major
            assert grad.shape[1] == pack(mb).keep.numel()
            per_token = torch.zeros(mb.responses.shape + grad.shape[-1:]).masked_scatter(
                mb.response_mask[..., None].expand(*mb.responses.shape, grad.shape[-1]), grad[0])
        else:  # [b, K, V]: the last K input positions of the trimmed rows
            trimmed = mb.trimmed()
            positions = response_positions(trimmed) - (trimmed.input_ids.shape[1] - grad.shape[1])
            per_token = grad[torch.arange(mb.size)[:, None], positions]  # [b, T, V]
        assert torch.equal(per_token[env], torch.zeros_like(per_token[env]))  # exactly 0
        assert bool((per_token[trained].abs().sum(-1) > 0).all())  # trained tokens do get a gradient
        env_checked += int(env.sum())
        model_checked += int(trained.sum())
    epochs = settings_for("").ppo.epochs
    assert env_checked == epochs * int((batch.response_mask & ~batch.loss_mask).sum()) and model_checked > 0


def actor_update(trainer: PPOTrainer, batch, old, adv, ref) -> tuple[dict, dict]:
    stats = trainer.train_actor(batch, old, adv, VERSION, ref_logp=ref, kl_coef=0.1)
    return stats, trainer.actor_state_for_sync()


@pytest.mark.parametrize("packing", [False, True])
def test_actor_update_ignores_environment_token_inputs(world1, tiny_actor_path, packing):
    settings = settings_for(tiny_actor_path, packing=packing, kl_in="loss")
    batch = trajectory_batch(1)
    first = PPOTrainer(settings, world1)
    old, ref = first.old_logprobs(batch), first.ref_logprobs(batch)
    adv = torch.where(batch.loss_mask, torch.randn(batch.responses.shape), torch.zeros(()))
    stats, weights = actor_update(first, batch, old, adv, ref)

    junk = dataclasses.replace(batch, behaviour_logp=on_env(batch, batch.behaviour_logp, 1),
                               versions=on_env(batch, batch.versions, 2))
    got_stats, got_weights = actor_update(PPOTrainer(settings, world1), junk, on_env(batch, old, 3),
                                          on_env(batch, adv, 4), on_env(batch, ref, 5))
    assert got_stats == stats  # bitwise: every stat, the loss and the grad norm
    assert weights.keys() == got_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], got_weights[name]), name

    # not vacuous: an advantage on one model token does change the update
    moved = adv.clone()
    moved[tuple(batch.loss_mask.nonzero()[0].tolist())] += 1.0
    _, other = actor_update(PPOTrainer(settings, world1), batch, old, moved, ref)
    assert any(not torch.equal(weights[n], other[n]) for n in weights)


def test_critic_update_and_advantages_ignore_environment_token_inputs(world1, tiny_actor_path):
    settings = settings_for(tiny_actor_path)
    batch = trajectory_batch(2)
    first = PPOTrainer(settings, world1)
    old, ref, values = first.old_logprobs(batch), first.ref_logprobs(batch), first.values(batch)
    adv, returns, rewards, kl = first.advantages(batch, old, ref, values, kl_coef=0.1)
    env = batch.response_mask & ~batch.loss_mask
    for x in (adv, returns, rewards, kl):
        assert not bool(x[env].any()) and not bool(x[~batch.response_mask].any())
    # the score sits on each row's last model token (with KL in the reward)
    last = [max(t for t in range(batch.responses.shape[1]) if batch.loss_mask[b, t]) for b in range(batch.size)]
    torch.testing.assert_close(rewards.sum(-1), batch.scores - 0.1 * kl.sum(-1))
    for b, t in enumerate(last):
        torch.testing.assert_close(rewards[b, t], batch.scores[b] - 0.1 * kl[b, t])
    again = first.advantages(batch, on_env(batch, old, 1), on_env(batch, ref, 2), on_env(batch, values, 3), 0.1)
    for x, y in zip((adv, returns, rewards, kl), again):
        assert torch.equal(x, y)

    spy = SpyTrainer(settings, world1)
    stats = spy.train_critic(batch, values, returns)
    assert spy.seen_by_critic and len(spy.seen_by_critic) == len(spy.value_grads)
    model_tokens_moved = False
    for mb, grad in zip(spy.seen_by_critic, spy.value_grads):  # the value loss never reaches env tokens
        assert not bool(grad[mb.response_mask & ~mb.loss_mask].any())
        model_tokens_moved |= bool(grad[mb.loss_mask].any())  # (0 where the value clip is active)
    assert model_tokens_moved
    weights = spy.critic.state_dict()
    weights = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in weights.items()}
    second = PPOTrainer(settings, world1)
    got_stats = second.train_critic(batch, on_env(batch, values, 4), on_env(batch, returns, 5))
    got = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in second.critic.state_dict().items()}
    assert got_stats == stats
    for name in weights:
        assert torch.equal(weights[name], got[name]), name


def test_critic_free_advantages_on_model_tokens(world1, tiny_actor_path):
    trainer = PPOTrainer(settings_for(tiny_actor_path, advantage="grpo"), world1)
    batch = dataclasses.replace(trajectory_batch(3), groups=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    old, ref = trainer.old_logprobs(batch), trainer.ref_logprobs(batch)
    adv, returns, rewards, _ = trainer.advantages(batch, old, ref, None, kl_coef=0.1)
    env = batch.response_mask & ~batch.loss_mask
    assert not bool(adv[env].any()) and not bool(returns[env].any())
    for b in range(batch.size):  # one advantage on every model token of a row
        row = adv[b][batch.loss_mask[b]]
        assert torch.equal(row, row[:1].expand_as(row))
        torch.testing.assert_close(returns[b][batch.loss_mask[b]], rewards[b].sum().expand(len(row)))


def test_rollout_old_logp_leaves_environment_tokens_out(world1, tiny_actor_path):
    trainer = PPOTrainer(settings_for(tiny_actor_path, old_logp="rollout"), world1)
    batch = trajectory_batch(4)
    fresh = dataclasses.replace(batch, versions=torch.where(batch.loss_mask, VERSION, batch.versions - 7))
    old = trainer.old_logprobs(fresh, current_version=VERSION)  # env versions make no row stale: no forward
    assert torch.equal(old, torch.where(batch.loss_mask, batch.behaviour_logp, torch.zeros(())))
    stale = dataclasses.replace(fresh, versions=torch.where(batch.loss_mask, batch.versions, 99))
    old = trainer.old_logprobs(stale, current_version=VERSION)  # rows with a version-2 model token: recomputed
    recomputed = trainer.old_logprobs(stale)
    rows = (batch.loss_mask & (batch.versions != VERSION)).any(-1)
    assert bool(rows.any()) and not bool(rows.all())
    want = torch.where(batch.loss_mask & rows[:, None], recomputed, 0.0)  # a forward over other micro-batches
    torch.testing.assert_close(torch.where(rows[:, None], old, 0.0), want, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.where(rows[:, None], 0.0, old),
                       torch.where(batch.loss_mask & ~rows[:, None], batch.behaviour_logp, 0.0))
    assert not bool(old[~batch.loss_mask].any())


def test_without_environment_tokens_nothing_changes(world1, tiny_actor_path):
    """loss_masks=None: loss_mask is response_mask, and a PPO step is bitwise the one of a
    batch whose rows say "every token the model's" explicitly."""
    batch = trajectory_batch(5)
    args = dict(prompts=[], responses=[], behaviour=[], versions=[])
    for b in range(batch.size):
        n = int(batch.response_mask[b].sum())
        args["prompts"].append(batch.input_ids[b, : int(batch.response_start[b])].tolist())
        args["responses"].append(batch.responses[b, :n].tolist())
        args["behaviour"].append(batch.behaviour_logp[b, :n].tolist())
        args["versions"].append([VERSION] * n)
    plain = make_batch(args["prompts"], args["responses"], 0, batch.scores.tolist(), args["behaviour"],
                       args["versions"])
    explicit = make_batch(args["prompts"], args["responses"], 0, batch.scores.tolist(), args["behaviour"],
                          args["versions"], loss_masks=[[1] * len(r) for r in args["responses"]])
    assert torch.equal(plain.loss_mask, plain.response_mask) and torch.equal(explicit.loss_mask, plain.loss_mask)
    results = []
    for b in (plain, explicit):
        trainer = PPOTrainer(settings_for(tiny_actor_path, epochs=1), world1)
        old, ref, values = trainer.old_logprobs(b), trainer.ref_logprobs(b), trainer.values(b)
        adv, returns, _, _ = trainer.advantages(b, old, ref, values, kl_coef=0.1)
        # the advantages of the GAE before `acting`, whitened as before
        want_adv, want_ret = gae_before(trainer_rewards(trainer, b, old, ref), values, b.response_mask, 1.0, 0.95)
        assert torch.equal(returns, want_ret) and torch.equal(adv, pm.masked_whiten(want_adv, b.response_mask))
        results.append((trainer.train_critic(b, values, returns), trainer.train_actor(b, old, adv, VERSION)))
    assert results[0] == results[1]


def trainer_rewards(trainer: PPOTrainer, batch: TrainBatch, old, ref) -> torch.Tensor:
    kl = pm.kl_estimate(old, ref, trainer.settings.ppo.kl_estimator)
    kl = torch.where(batch.response_mask, kl, torch.zeros_like(kl))
    return pm.token_rewards(batch.scores, kl, batch.response_mask, 0.1)
