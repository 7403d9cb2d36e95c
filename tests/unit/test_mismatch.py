"""trainer/mismatch.py against naive loops: token and sequence masked IS, IcePop, their
bands and weights, composed with the TIS cap.

Each reference loops over rows and tokens in plain Python floats (math.exp of the
log-ratio, compared with the band as a ratio) and never calls the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from colocate.trainer import mismatch as mm
from colocate.trainer import sections
from colocate.trainer.mismatch import Correction
from tests.unit.test_ppo_math import close, random_batches, unpack


def ratios(g, b, t):
    """Behaviour and old log-probs whose log-ratio spreads over [-1.5, 1.5], away from the
    bands' edges by more than float rounding (float64 throughout)."""
    behaviour = -3.0 + torch.randn(b, t, generator=g, dtype=torch.float64)
    gap = (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 3.0
    return behaviour, behaviour + gap


def naive_terms(kind, lower, upper, cap, behaviour, old, lengths, t):
    """(keep, weights) as nested lists, a row and a token at a time."""
    keep, weights = [], []
    for i, n in enumerate(lengths):
        tokens = [old[i][j] - behaviour[i][j] for j in range(n)]
        if kind == "seq_mis":
            geo = sum(tokens) / n if n else 0.0
            tokens = [geo] * n
        row_keep = [j < n and lower <= math.exp(tokens[j]) <= upper for j in range(t)]
        row_w = [math.exp(tokens[j]) if row_keep[j] else 0.0 for j in range(t)]
        keep.append(row_keep)
        weights.append([min(w, cap) if cap is not None else w for w in row_w])
    return keep, weights


@pytest.mark.parametrize("kind,lower,upper,cap", [
    ("token_mis", 0.0, 0.0, None), ("token_mis", 0.0, 1.5, None), ("seq_mis", 0.0, 1.2, None),
    ("seq_mis", 0.8, 1.3, 1.1), ("icepop", 0.0, 0.0, None), ("icepop", 0.7, 3.0, 2.0)])
@random_batches
def test_terms_match_the_naive_loop(kind, lower, upper, cap, case):
    b, t, lengths, mask, g = unpack(case)
    behaviour, old = ratios(g, b, t)
    lo, hi = sections.band(kind, lower, upper)
    keep, weights = Correction(kind, lower, upper, cap).terms(behaviour, old.requires_grad_(True), mask)
    want_keep, want_weights = naive_terms(kind, lo, hi, cap, behaviour.tolist(), old.tolist(), lengths, t)
    assert keep.dtype == torch.bool and keep.tolist() == want_keep
    assert not weights.requires_grad
    close(weights, want_weights)


def test_defaults_are_the_peers():
    assert sections.band("token_mis") == (0.5, 2.0)  # verl rollout_is_threshold 2, lower its reciprocal
    assert sections.band("seq_mis") == pytest.approx((1 / 1.001, 1.001))  # verl's Geo-RS preset 0.999_1.001
    assert sections.band("icepop") == (0.5, 5.0)  # IcePop's alpha, beta
    assert sections.band("token_mis", upper=4.0) == (0.25, 4.0)
    assert sections.band("icepop", upper=3.0) == (0.5, 3.0)  # icepop's lower stays alpha
    assert sections.band("seq_mis", lower=0.9, upper=1.1) == (0.9, 1.1)


@pytest.mark.parametrize("kind,lower,upper,match", [
    ("token_mis", 0.0, 0.8, "must hold 1"), ("icepop", 1.5, 0.0, "must hold 1"),
    ("seq_mis", -1.0, 0.0, ">= 0"), ("none", 0.0, 0.0, "one of"), ("tis", 0.0, 2.0, "one of")])
def test_a_band_without_one_is_refused(kind, lower, upper, match):
    with pytest.raises(ValueError, match=match):
        sections.band(kind, lower, upper)


def test_a_sequence_is_masked_whole_on_its_geometric_mean_not_its_product():
    """Four tokens of ratio 1.1 (product 1.46) and one long row of 1.01 (product 2.7): the
    geometric mean keeps both in [1/1.2, 1.2]; one token of 3 in a row masks it whole."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]).bool()
    gaps = torch.tensor([[math.log(1.1)] * 4 + [9.0, 9.0], [math.log(1.01)] * 6, [0.0, math.log(3.0), 0.0, 0, 0, 0]])
    keep, weights = Correction("seq_mis", upper=1.2).terms(torch.zeros(3, 6), gaps, mask)
    assert keep.tolist() == [[True] * 4 + [False] * 2, [True] * 6, [False] * 6]
    close(weights[0, :4], [1.1] * 4, tol=1e-6)
    token = Correction("token_mis", upper=1.2).terms(torch.zeros(3, 6), gaps, mask)[0]
    assert token[2].tolist() == [True, False, True, False, False, False]  # token level: only the 3


def test_without_a_method_it_is_the_truncated_is_weights_exactly():
    g = torch.Generator().manual_seed(0)
    behaviour, old = ratios(g, 3, 5)
    mask = torch.rand(3, 5, generator=g) > 0.3
    keep, weights = Correction(is_cap=1.5).terms(behaviour, old, mask)
    from colocate.trainer.ppo_math import truncated_is_weights

    assert torch.equal(keep, mask) and torch.equal(weights, truncated_is_weights(behaviour, old, mask, 1.5))
    assert not Correction().weighs and Correction(is_cap=2.0).weighs and not Correction(is_cap=2.0).masks
    with pytest.raises(ValueError, match="neither"):
        Correction().terms(behaviour, old, mask)


def test_huge_gaps_are_masked_not_overflowed_and_padding_is_zero():
    mask = torch.tensor([[True, True, True, False]])
    old = torch.tensor([[0.0, 200.0, -200.0, 50.0]])  # float32: exp(200) is inf
    for kind in ("token_mis", "icepop"):
        keep, weights = Correction(kind).terms(torch.zeros(1, 4), old, mask)
        assert keep.tolist() == [[True, False, False, False]] and weights.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_bfloat16_log_probs_are_compared_in_float32():
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    keep, weights = Correction("token_mis").terms(old.float(), old, torch.ones(1, 2, dtype=torch.bool))
    assert weights.dtype == torch.float32 and keep.all() and weights.tolist() == [[1.0, 1.0]]


def test_masked_fraction_counts_the_trained_tokens_left_out():
    trained = torch.tensor([[True, True, False], [True, False, False]])
    kept = torch.tensor([[True, False, True], [False, False, False]])
    assert mm.masked_fraction(trained, kept) == pytest.approx(2 / 3)
    assert mm.masked_fraction(torch.zeros(2, 3, dtype=torch.bool), kept) == 0.0
