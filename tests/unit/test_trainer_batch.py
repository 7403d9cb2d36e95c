"""trainer/batch.py (and the pure helpers of trainer/forward.py) against naive per-row loops.

The references index one row and one token at a time in plain Python and never call the
code under test. Random cases come from hypothesis: ragged prompts (>= 1 token) and
responses (>= 0 tokens).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate.trainer.batch import logits_kept, make_batch, response_logits, response_values
from colocate.trainer.forward import agg_denominator

PAD = 0


@st.composite
def rollouts(draw):
    rows = draw(st.integers(1, 5))
    prompts = [draw(st.lists(st.integers(1, 50), min_size=1, max_size=6)) for _ in range(rows)]
    responses = [draw(st.lists(st.integers(1, 50), min_size=0, max_size=5)) for _ in range(rows)]
    return prompts, responses


def build(prompts, responses):
    scores = [float(i) - 0.5 for i in range(len(prompts))]
    behaviour = [[-0.1 * (t + 1) for t in range(len(r))] for r in responses]
    versions = [[b + t for t in range(len(r))] for b, r in enumerate(responses)]
    return make_batch(prompts, responses, PAD, scores, behaviour, versions), scores, behaviour, versions


@settings(max_examples=30, deadline=None, database=None)
@given(case=rollouts())
def test_make_batch_matches_row_loop(case):
    prompts, responses = case
    batch, scores, behaviour, versions = build(prompts, responses)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    width = max(1, max(len(r) for r in responses))
    assert batch.input_ids.shape == batch.attention_mask.shape == (len(prompts), length)
    assert batch.responses.shape == batch.response_mask.shape == batch.versions.shape == (len(prompts), width)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        full = prompt + response
        for i in range(length):
            assert batch.input_ids[b, i].item() == (full[i] if i < len(full) else PAD)
            assert batch.attention_mask[b, i].item() == int(i < len(full))
        for t in range(width):
            valid = t < len(response)
            assert batch.responses[b, t].item() == (response[t] if valid else PAD)
            assert batch.response_mask[b, t].item() == valid
            assert batch.behaviour_logp[b, t].item() == pytest.approx(behaviour[b][t] if valid else 0.0)
            assert batch.versions[b, t].item() == (versions[b][t] if valid else 0)
        assert batch.response_start[b].item() == len(prompt)
        assert batch.scores[b].item() == scores[b]


@settings(max_examples=30, deadline=None, database=None)
@given(case=rollouts(), seed=st.integers(0, 2**31 - 1))
def test_response_logits_and_values_match_row_loop(case, seed):
    prompts, responses = case
    batch, *_ = build(prompts, responses)
    rows, length = batch.input_ids.shape
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, 7, generator=gen)  # [B, L, V]
    values = torch.randn(rows, length, generator=gen)  # [B, L]
    picked, picked_values = response_logits(logits, batch), response_values(values, batch)
    assert picked.shape == (rows, batch.responses.shape[1], 7)
    # a model asked for only the trailing logits_kept positions gives the same picks
    kept = logits_kept(batch)
    assert kept <= length
    tail = response_logits(logits[:, length - kept:], batch)
    mask = batch.response_mask[:, :, None]
    assert torch.equal(torch.where(mask, tail, 0.0), torch.where(mask, picked, 0.0))
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        for t in range(batch.responses.shape[1]):
            if t < len(response):  # the logit at the token before response token t predicts it
                assert torch.equal(picked[b, t], logits[b, len(prompt) - 1 + t])
                assert picked_values[b, t].item() == values[b, len(prompt) - 1 + t].item()
            else:
                assert picked_values[b, t].item() == 0.0


def test_trimmed_drops_only_all_padding_columns():
    batch, *_ = build([[1, 2], [3]], [[4], []])
    assert batch.input_ids.shape[1] == 3
    padded = type(batch)(**{**batch.__dict__,
                            "input_ids": torch.nn.functional.pad(batch.input_ids, (0, 4), value=PAD),
                            "attention_mask": torch.nn.functional.pad(batch.attention_mask, (0, 4))})
    trimmed = padded.trimmed()
    assert torch.equal(trimmed.input_ids, batch.input_ids)
    assert torch.equal(trimmed.attention_mask, batch.attention_mask)
    assert torch.equal(trimmed.responses, batch.responses)


@pytest.mark.parametrize("rows,n", [(8, 1), (8, 2), (8, 4), (6, 3), (5, 5)])
def test_minibatches_cover_every_row_once(rows, n):
    batch, *_ = build([[1]] * rows, [[2, 3]] * rows)
    parts = batch.minibatches(n, torch.Generator().manual_seed(0))
    assert len(parts) == n and all(len(p) == rows // n for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(rows))
    again = batch.minibatches(n, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(parts, again))  # same generator state, same split


def test_minibatches_shuffle_and_refuse_uneven_split():
    batch, *_ = build([[1]] * 16, [[2]] * 16)
    gen = torch.Generator().manual_seed(0)
    orders = {tuple(torch.cat(batch.minibatches(2, gen)).tolist()) for _ in range(5)}
    assert len(orders) > 1
    with pytest.raises(ValueError, match="equal minibatches"):
        batch.minibatches(3, gen)


def test_select_takes_rows_in_order():
    prompts, responses = [[1], [2, 3], [4, 5, 6]], [[7, 8], [9], []]
    batch, *_ = build(prompts, responses)
    idx = torch.tensor([2, 0])
    sub = batch.select(idx)
    for name, value in sub.__dict__.items():
        assert torch.equal(value, getattr(batch, name)[idx]), name
    assert sub.size == 2


@pytest.mark.parametrize(
    "prompts,responses,behaviour,versions,match",
    [
        ([[]], [[1]], [[0.0]], [[0]], "empty prompt"),
        ([[1]], [[1, 2]], [[0.0]], [[0, 0]], "behaviour logprobs"),
        ([[1]], [[1]], [[0.0]], [[]], "versions"),
        ([[1], [2]], [[1]], [[0.0]], [[0]], "same"),
    ],
)
def test_make_batch_rejects_malformed_rows(prompts, responses, behaviour, versions, match):
    with pytest.raises(ValueError, match=match):
        make_batch(prompts, responses, PAD, [0.0] * len(prompts), behaviour, versions)


def test_all_empty_responses_give_one_masked_column():
    batch, *_ = build([[1, 2], [3]], [[], []])
    assert batch.responses.shape == (2, 1) and not batch.response_mask.any()


def test_agg_denominator_counts_tokens_or_nonempty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert agg_denominator(mask, "token-mean").item() == 3
    assert agg_denominator(mask, "seq-mean-token-mean").item() == 2
    assert agg_denominator(mask, "seq-mean-token-sum").item() == 2


def test_a_batch_of_samples_is_the_batch_of_their_fields():
    """``batch_of``: each Sample one row in order, its group id, reward, logprobs, versions and
    loss mask where ``make_batch`` puts them (a multi-turn sample's environment tokens out of
    the loss, a lone sample its own group)."""
    from colocate.rollout.sample import Sample
    from colocate.trainer.batch import batch_of

    solo = Sample(7, [1, 2], 4, output_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[3, 3], score=1.0)
    turn = Sample(8, [1, 2, 3], 6, output_ids=[5, 9, 9, 6], logprobs=[-0.3, 0.0, 0.0, -0.4], versions=[2, 2, 2, 3],
                  group=4, score=-0.5, loss_mask=[1, 0, 0, 1])
    got = batch_of([solo, turn], PAD)
    want = make_batch([[1, 2], [1, 2, 3]], [[5, 6], [5, 9, 9, 6]], PAD, [1.0, -0.5],
                      [[-0.1, -0.2], [-0.3, 0.0, 0.0, -0.4]], [[3, 3], [2, 2, 2, 3]], [7, 4],
                      loss_masks=[[], [1, 0, 0, 1]])
    for field in got.__dataclass_fields__:
        a, b = getattr(got, field), getattr(want, field)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field
    assert got.loss_mask[1].tolist() == [True, False, False, True]
    assert got.groups.tolist() == [7, 4]
