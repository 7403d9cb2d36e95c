"""trainer/ppo_math.py against naive loop references.

Every reference below loops over rows and tokens in plain Python floats and never calls
the code under test. Random cases are right-padded [B, T] batches from hypothesis; the
fixed EDGES add an all-masked row, length-1 rows, T=1 and an all-masked batch.
"""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from colocate.trainer import ppo_math as pm

# (T, row lengths, seed)
EDGES = [(3, (0, 3), 0), (3, (1, 1, 2), 1), (1, (1,), 2), (1, (0, 1), 3), (4, (0, 0), 4),
         (5, (5,), 5)]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@st.composite
def cases(draw):
    t = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, t), min_size=1, max_size=4))
    return t, tuple(lengths), draw(st.integers(0, 2**31 - 1))


def random_batches(test):
    """Run `test(case)` on 25 random right-padded batches plus every EDGES case."""
    test = given(case=cases())(test)
    for edge in EDGES:
        test = example(case=edge)(test)
    return settings(max_examples=25, deadline=None, database=None)(test)


def unpack(case):
    t, lengths, seed = case
    mask = torch.tensor([[i < n for i in range(t)] for n in lengths])
    return len(lengths), t, lengths, mask, torch.Generator().manual_seed(seed)


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def close(actual, expected, tol=1e-9):
    actual = torch.as_tensor(actual).detach().to(torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=tol, rtol=tol), (actual, expected)


# ---------------------------------------------------------------- naive references


def naive_logprob(row, token, temperature=1.0):
    row = [v / temperature for v in row]
    m = max(row)
    return row[token] - (m + math.log(sum(math.exp(v - m) for v in row)))


def naive_entropy(row):
    m = max(row)
    z = sum(math.exp(v - m) for v in row)
    return -sum(math.exp(v - m) / z * (v - m - math.log(z)) for v in row)


def valid_values(x, lengths):
    return [x[b][t] for b, n in enumerate(lengths) for t in range(n)]


def naive_mean_var(vals, unbiased=True):
    n = len(vals)
    if n == 0:
        return 0.0, 0.0
    mean = sum(vals) / n
    ss = sum((v - mean) ** 2 for v in vals)
    if unbiased:
        return mean, ss / (n - 1) if n > 1 else 0.0
    return mean, ss / n


def naive_gae(r, v, lengths, gamma, lam):
    adv = [[0.0] * len(r[0]) for _ in r]
    ret = [[0.0] * len(r[0]) for _ in r]
    for b, n in enumerate(lengths):
        gae = 0.0
        for t in reversed(range(n)):
            next_v = v[b][t + 1] if t + 1 < n else 0.0
            gae = r[b][t] + gamma * next_v - v[b][t] + gamma * lam * gae
            adv[b][t], ret[b][t] = gae, gae + v[b][t]
    return adv, ret


def naive_aggregate(x, lengths, mode):
    if mode == "token-mean":
        vals = valid_values(x, lengths)
        return sum(vals) / len(vals) if vals else 0.0
    rows = [sum(x[b][:n]) / (n if mode == "seq-mean-token-mean" else 1)
            for b, n in enumerate(lengths) if n > 0]
    return sum(rows) / len(rows) if rows else 0.0


# ---------------------------------------------------------------- logits -> per token


@random_batches
def test_token_logprobs_and_entropy_match_naive(case):
    b, t, lengths, _, g = unpack(case)
    v = 2 + case[2] % 5
    logits = randn(g, b, t, v, scale=3.0)
    tokens = torch.randint(0, v, (b, t), generator=g)
    for temp in (1.0, 0.7):
        got = pm.token_logprobs_from_logits(logits, tokens, temperature=temp)
        want = [[naive_logprob(logits[i, j].tolist(), int(tokens[i, j]), temp)
                 for j in range(t)] for i in range(b)]
        close(got, want)
    want_ent = [[naive_entropy(logits[i, j].tolist()) for j in range(t)] for i in range(b)]
    close(pm.entropy_from_logits(logits), want_ent)


def test_token_logprobs_bf16_upcasts_and_has_exact_gradient():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 50, generator=g) * 1e3).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (2, 3), generator=g)
    got = pm.token_logprobs_from_logits(logits, tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    want = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    close(got, want, tol=1e-5)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    pm.token_logprobs_from_logits(x, tokens, temperature=0.5).sum().backward()
    onehot = torch.nn.functional.one_hot(tokens, 7).double()
    close(x.grad, (onehot - torch.softmax(x.detach() / 0.5, -1)) / 0.5)
    close(pm.entropy_from_logits(torch.zeros(1, 2, 8)), [[math.log(8)] * 2], tol=1e-6)


# ---------------------------------------------------------------- masked statistics


@random_batches
def test_masked_stats_match_naive(case):
    b, t, lengths, mask, g = unpack(case)
    x = randn(g, b, t, scale=2.0) + 1.0
    x[~mask] = float("nan")  # padding must never leak
    vals = valid_values(x.tolist(), lengths)
    mean, var = naive_mean_var(vals)
    close(pm.masked_mean(x, mask), mean)
    close(pm.masked_mean(x, mask.float(), dim=-1),
          [sum(x[i, :n].tolist()) / max(n, 1) for i, n in enumerate(lengths)])
    close(pm.masked_var(x, mask), var)
    close(pm.masked_var(x, mask, unbiased=False), naive_mean_var(vals, unbiased=False)[1])
    for shift in (True, False):
        want = [[((x[i, j].item() - mean) / math.sqrt(var + 1e-8) + (0 if shift else mean))
                 if j < n else 0.0 for j in range(t)] for i, n in enumerate(lengths)]
        close(pm.masked_whiten(x, mask, shift_mean=shift), want, tol=1e-6)


# ---------------------------------------------------------------- rewards and advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.0, 0.0), (1.0, 0.95)])
@random_batches
def test_gae_matches_naive(case, gamma, lam):
    b, t, lengths, mask, g = unpack(case)
    r, v = randn(g, b, t), randn(g, b, t)
    adv, ret = pm.gae_advantages(r, v, mask, gamma, lam)
    want_adv, want_ret = naive_gae(r.tolist(), v.tolist(), lengths, gamma, lam)
    close(adv, want_adv)
    close(ret, want_ret)


def test_gae_closed_forms():
    r = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    v = torch.tensor([[0.5, 0.25, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = pm.gae_advantages(r, v, mask, gamma=1.0, lam=1.0)
    close(adv, [[6 - 0.5, 5 - 0.25, 3 - 1.0, 0.0]], tol=1e-6)  # reward-to-go minus V
    close(ret, [[6.0, 5.0, 3.0, 0.0]], tol=1e-6)
    adv, _ = pm.gae_advantages(r, v, mask, gamma=0.0, lam=0.0)
    close(adv, [[0.5, 1.75, 2.0, 0.0]], tol=1e-6)  # one-step r - V
    hole = torch.tensor([[1, 0, 1, 1]])  # a 0 inside a row ends the episode there
    adv, _ = pm.gae_advantages(r, v, hole, gamma=1.0, lam=1.0)
    close(adv, [[1 - 0.5, 0.0, 12 - 1.0, 9 - 7.0]], tol=1e-6)


@random_batches
def test_token_rewards_match_naive(case):
    b, t, lengths, mask, g = unpack(case)
    score, kl = randn(g, b), randn(g, b, t)
    got = pm.token_rewards(score, kl, mask, kl_coef=0.05)
    want = [[(-0.05 * kl[i, j].item() + (score[i].item() if j == n - 1 else 0.0))
             if j < n else 0.0 for j in range(t)] for i, n in enumerate(lengths)]
    close(got, want)


@random_batches
def test_kl_estimators_match_naive(case):
    b, t, _, _, g = unpack(case)
    logp, ref = randn(g, b, t, scale=3.0), randn(g, b, t, scale=3.0)
    for kind, f in [("k1", lambda d: d), ("k2", lambda d: 0.5 * d * d),
                    ("k3", lambda d: math.exp(-d) + d - 1)]:
        want = [[f(logp[i, j].item() - ref[i, j].item()) for j in range(t)] for i in range(b)]
        close(pm.kl_estimate(logp, ref, kind), want, tol=1e-7)
    assert (pm.kl_estimate(logp.float(), ref.float(), "k3") >= 0).all()


def test_k3_nonnegative_on_tiny_and_huge_log_ratios():
    d = torch.tensor([0.0, 1e-12, -1e-12, 1e-7, -1e-7, 1e-4, -5.0, 30.0])
    assert (pm.kl_estimate(d, torch.zeros_like(d), "k3") >= 0).all()
    assert pm.kl_estimate(d, torch.zeros_like(d), "k3")[0] == 0
    with pytest.raises(ValueError, match="kind"):
        pm.kl_estimate(d, d, "k4")


# ---------------------------------------------------------------- losses


@random_batches
def test_aggregate_loss_matches_naive(case):
    b, t, lengths, mask, g = unpack(case)
    x = randn(g, b, t)
    x[~mask] = float("inf")
    for mode in AGGS:
        close(pm.aggregate_loss(x, mask, mode), naive_aggregate(x.tolist(), lengths, mode))
    with pytest.raises(ValueError, match="agg"):
        pm.aggregate_loss(x, mask, "sum")


@random_batches
def test_policy_loss_matches_naive(case):
    b, t, lengths, mask, g = unpack(case)
    logp, old, adv = randn(g, b, t, scale=0.3), randn(g, b, t, scale=0.3), randn(g, b, t)
    w = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    eps = 0.2
    per, clipped, kl, ratio = [], [], [], []
    for i in range(b):
        per.append([])
        for j in range(t):
            d = logp[i, j].item() - old[i, j].item()
            r, a = math.exp(d), adv[i, j].item()
            u, c = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            per[i].append(max(u, c))
            if j < lengths[i]:
                clipped.append(1.0 if c > u else 0.0)
                kl.append(0.5 * d * d)
                ratio.append(r)
    n = max(len(ratio), 1)
    for mode in AGGS:
        loss, stats = pm.policy_loss(logp, old, adv, mask, eps, agg=mode)
        close(loss, naive_aggregate(per, lengths, mode))
        close(stats["clip_frac"], sum(clipped) / n)
        close(stats["approx_kl"], sum(kl) / n)
        close(stats["ratio_mean"], sum(ratio) / n)
        loss_w, _ = pm.policy_loss(logp, old, adv, mask, eps, agg=mode, is_weights=w)
        weighted = [[per[i][j] * w[i, j].item() for j in range(t)] for i in range(b)]
        close(loss_w, naive_aggregate(weighted, lengths, mode))


def test_policy_clip_fraction_and_gradient_on_hand_made_case():
    # (ratio, advantage): clipped are (1.5, +1) and (0.5, -1); the padded (3.0, +1) is ignored
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.0, 3.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    logp = ratios.log().requires_grad_(True)
    loss, stats = pm.policy_loss(logp, torch.zeros_like(logp), adv, mask, clip_eps=0.2)
    close(stats["clip_frac"], 2 / 5)
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5 - 1.0) / 5)
    loss.backward()
    close(logp.grad, [[0.0, -0.5 / 5, 0.0, 1.5 / 5, -1.0 / 5, 0.0]])


@random_batches
def test_value_loss_matches_naive(case):
    b, t, lengths, mask, g = unpack(case)
    values, old, ret = randn(g, b, t), randn(g, b, t), randn(g, b, t)
    eps = 0.3
    per, clipped = [], []
    for i in range(b):
        per.append([])
        for j in range(t):
            v, o, r = values[i, j].item(), old[i, j].item(), ret[i, j].item()
            u, c = (v - r) ** 2, (min(max(v, o - eps), o + eps) - r) ** 2
            per[i].append(0.5 * max(u, c))
            if j < lengths[i]:
                clipped.append(1.0 if c > u else 0.0)
    for mode in AGGS:
        loss, stats = pm.value_loss(values, old, ret, mask, eps, agg=mode)
        close(loss, naive_aggregate(per, lengths, mode))
        close(stats["vf_clip_frac"], sum(clipped) / max(len(clipped), 1))


def test_value_clip_fraction_on_hand_made_case():
    values = torch.tensor([[0.5, -0.5, 0.1, 9.0]], requires_grad=True)
    zeros, ones = torch.zeros(1, 4), torch.ones(1, 4)
    loss, stats = pm.value_loss(values, zeros, ones, torch.tensor([[1, 1, 1, 0]]), clip_eps=0.2)
    close(stats["vf_clip_frac"], 1 / 3, tol=1e-6)  # only v=0.5 (clipped to 0.2) counts
    close(loss, 0.5 * (0.64 + 2.25 + 0.81) / 3, tol=1e-6)


def test_losses_on_all_masked_batch_are_zero_not_nan():
    x = torch.ones(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    for mode in AGGS:
        loss, stats = pm.policy_loss(x, x.detach(), x.detach(), mask, 0.2, agg=mode)
        assert loss.item() == 0.0 and stats["clip_frac"].item() == 0.0
        loss.backward()
        assert torch.equal(x.grad, torch.zeros(2, 3))


# ---------------------------------------------------------------- staleness correction


@random_batches
def test_truncated_is_weights_and_staleness_mask_match_naive(case):
    b, t, lengths, mask, g = unpack(case)
    behaviour, old = randn(g, b, t), randn(g, b, t)
    versions = torch.randint(0, 6, (b, t), generator=g)
    got = pm.truncated_is_weights(behaviour, old.requires_grad_(True), mask, cap=2.0)
    assert not got.requires_grad
    close(got, [[min(math.exp(old[i, j].item() - behaviour[i, j].item()), 2.0)
                 if j < n else 0.0 for j in range(t)] for i, n in enumerate(lengths)])
    keep = pm.staleness_mask(versions, current_version=5, max_staleness=2, mask=mask)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[j < n and versions[i, j].item() >= 3 for j in range(t)]
                             for i, n in enumerate(lengths)]


def test_staleness_and_is_weights_reject_bad_arguments():
    x = torch.zeros(1, 2)
    assert pm.truncated_is_weights(x, x + 1e4, torch.ones(1, 2), cap=3.0).tolist() == [[3.0, 3.0]]
    with pytest.raises(ValueError, match="cap"):
        pm.truncated_is_weights(x, x, x, cap=0.0)
    with pytest.raises(ValueError, match="max_staleness"):
        pm.staleness_mask(x.long(), 1, -1, x)
