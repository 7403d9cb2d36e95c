"""trainer/estimators.py against naive per-sample loops: GRPO (with and without the std
division), RLOO and REINFORCE++-baseline, for groups of one, groups with all-equal
returns (0, no NaN) and members of mixed lengths."""

import math
import statistics

import pytest
import torch

from colocate.trainer.estimators import outcome_advantages


def naive(returns, groups, kind, norm_by_std=True):
    """Per-sample scalar advantages, one Python loop per sample (before any whitening)."""
    out = []
    for i, (r, g) in enumerate(zip(returns, groups)):
        members = [x for x, h in zip(returns, groups) if h == g]
        if len(members) == 1:
            out.append(r)
            continue
        if kind == "rloo":
            others = [x for j, (x, h) in enumerate(zip(returns, groups)) if h == g and j != i]
            out.append(r - sum(others) / len(others))
            continue
        adv = r - sum(members) / len(members)
        if kind == "grpo" and norm_by_std:
            adv /= statistics.stdev(members) + 1e-6
        out.append(adv)
    return out


def whiten(values, lengths):
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def mask_of(lengths):
    width = max(lengths)
    return torch.tensor([[t < n for t in range(width)] for n in lengths])


CASES = {
    "mixed": ([1.0, 0.0, 0.5, 2.0, -1.0, 0.3, 0.3, 4.0], [0, 0, 0, 1, 1, 2, 2, 3], [3, 1, 5, 2, 4, 1, 6, 2]),
    "singletons": ([0.7, -0.2, 1.5], [5, 9, 11], [2, 3, 1]),
    "all_equal": ([0.4, 0.4, 0.4, 1.0, 1.0], [0, 0, 0, 1, 1], [4, 2, 3, 1, 5]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind,norm", [("grpo", True), ("grpo", False), ("rloo", True), ("reinforce_baseline", True)])
def test_estimators_match_naive_loops(case, kind, norm):
    returns, groups, lengths = CASES[case]
    mask = mask_of(lengths)
    got = outcome_advantages(torch.tensor(returns), torch.tensor(groups), mask, kind, norm)
    expected = naive(returns, groups, kind, norm)
    if kind == "reinforce_baseline":
        expected = whiten(expected, lengths)
    assert got.shape == mask.shape and torch.isfinite(got).all()
    for b, n in enumerate(lengths):
        assert got[b, :n].tolist() == pytest.approx([expected[b]] * n, abs=1e-5)
        assert torch.all(got[b, n:] == 0)  # padding


def test_equal_returns_in_a_group_give_zero_advantage():
    returns, groups, lengths = CASES["all_equal"]
    for kind in ("grpo", "rloo"):
        got = outcome_advantages(torch.tensor(returns), torch.tensor(groups), mask_of(lengths), kind)
        assert torch.all(got == 0), kind


def test_group_of_one_gets_its_return():
    got = outcome_advantages(torch.tensor([0.7, -0.2]), torch.tensor([3, 4]), mask_of([2, 1]), "grpo")
    assert got[0].tolist() == pytest.approx([0.7, 0.7], abs=1e-5) and got[1].tolist() == pytest.approx([-0.2, 0.0], abs=1e-5)


def test_group_ids_need_not_be_contiguous_or_sorted():
    returns, lengths = [1.0, 2.0, 3.0, 5.0], [1, 1, 1, 1]
    a = outcome_advantages(torch.tensor(returns), torch.tensor([7, 2, 7, 2]), mask_of(lengths), "grpo")
    assert a[:, 0].tolist() == pytest.approx(naive(returns, [7, 2, 7, 2], "grpo"), abs=1e-5)


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="gae"):
        outcome_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), mask_of([1, 1]), "gae")


@pytest.mark.parametrize("kind", ["grpo", "rloo", "reinforce_baseline"])
def test_greedy_groups_of_one_budget_are_refused_for_group_baselines(kind):
    """Greedy decoding gives a prompt's members one and the same response (and return) when
    they share a budget: every group-baseline advantage is 0 (test above), so the config is
    refused in one line; sampling, a long-tailed budget (members end at different lengths)
    or a critic (gae) is taken."""
    from colocate.config import load_config
    from colocate.errors import ConfigError

    base = [f"ppo.advantage={kind}", "rollout.group_size=4", "rollout.batch_size=8"]
    with pytest.raises(ConfigError, match="every advantage would be 0") as info:
        load_config(overrides=[*base, "rollout.temperature=0"])
    assert "rollout.temperature > 0" in str(info.value) and "\n" not in str(info.value)
    for fine in (["rollout.temperature=0.7"], ["rollout.temperature=0", "rollout.length_dist=lognormal"]):
        load_config(overrides=[*base, *fine])
    load_config(overrides=["ppo.advantage=gae", "rollout.group_size=4", "rollout.batch_size=8", "rollout.temperature=0"])
