"""colocate's CPU attention backend (engine/cpu_attention.py) against SGLang's own
``torch_native`` backend, on SGLang's real KV pools: decode batches of unequal lengths and
extends with and without a cached prefix give the same outputs and write the same cache."""

from types import SimpleNamespace

import pytest
import torch

from colocate.engine import sglang_api

sglang_api.prepare("cpu")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from colocate.engine.cpu_attention import CpuAttnBackend, decode_slots, extend_attention, row_chunks  # noqa: E402

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 256


def pools(dtype):
    """A real request-to-slot table and KV pool, the pool's slots filled at random."""
    g = torch.Generator().manual_seed(0)
    req = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(SLOTS, page_size=1, dtype=dtype, head_num=KV_HEADS, head_dim=DIM, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    kv.get_key_buffer(0).copy_(torch.randn(kv.get_key_buffer(0).shape, generator=g))
    kv.get_value_buffer(0).copy_(torch.randn(kv.get_value_buffer(0).shape, generator=g))
    return req, kv


def place(req, rows, lengths, g):
    """Each request's positions in scattered pool slots (none shared)."""
    free = torch.randperm(SLOTS - 1, generator=g)[: sum(lengths)] + 1
    start = 0
    for row, n in zip(rows, lengths):
        req.req_to_token[row, :n] = free[start:start + n].to(req.req_to_token.dtype)
        start += n


def backends(dtype):
    req, kv = pools(dtype)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req, token_to_kv_pool=kv)
    return req, kv, TorchNativeAttnBackend(runner), CpuAttnBackend(runner)


def layer(**kw):
    return RadixAttention(HEADS, DIM, DIM ** -0.5, KV_HEADS, layer_id=0, **kw)


def batch(mode, rows, seq_lens, out_loc, prefixes=None, news=None):
    return SimpleNamespace(
        forward_mode=mode, req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens), out_cache_loc=out_loc, encoder_lens=None,
        extend_prefix_lens=None if prefixes is None else torch.tensor(prefixes),
        extend_seq_lens=None if news is None else torch.tensor(news),
        extend_prefix_lens_cpu=prefixes, extend_seq_lens_cpu=news)


def decode_case(dtype, seed, rows, lens):
    """Both backends on one pool, a decode batch of ``rows`` at ``lens`` placed in it, and
    the step's random q, k, v: (kv, native, ours, forward batch, q, k, v, the new tokens' slots)."""
    g = torch.Generator().manual_seed(seed)
    req, kv, native, ours = backends(dtype)
    place(req, rows, lens, g)
    last = torch.stack([req.req_to_token[r, n - 1] for r, n in zip(rows, lens)]).long()
    fb = batch(ForwardMode.DECODE, rows, lens, last)
    q = torch.randn(len(rows), HEADS * DIM, generator=g).to(dtype)
    k = torch.randn(len(rows), KV_HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(len(rows), KV_HEADS, DIM, generator=g).to(dtype)
    return kv, native, ours, fb, q, k, v, last


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_batch_equals_torch_native(dtype, tol):
    kv, native, ours, fb, q, k, v, last = decode_case(dtype, 1, [1, 4, 2, 6], [5, 17, 1, 33])
    native.init_forward_metadata(fb)
    want = native.forward_decode(q, k, v, layer(), fb)
    written = kv.get_key_buffer(0)[last].clone()
    kv.get_key_buffer(0)[last] = 0  # ours must write the new token's key again
    ours.init_forward_metadata(fb)
    got = ours.forward_decode(q, k, v, layer(), fb)
    assert ours._decode_slots is not None and ours._decode_slots[0] is fb.seq_lens  # the batched path ran
    assert torch.equal(kv.get_key_buffer(0)[last], written)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_extend_with_and_without_prefix_equals_torch_native(dtype, tol):
    g = torch.Generator().manual_seed(2)
    req, kv, native, ours = backends(dtype)
    rows, prefixes, news = [3, 0, 5], [0, 6, 11], [5, 4, 1]
    lens = [p + n for p, n in zip(prefixes, news)]
    place(req, rows, lens, g)
    out_loc = torch.cat([req.req_to_token[r, p:p + n] for r, p, n in zip(rows, prefixes, news)]).long()
    fb = batch(ForwardMode.EXTEND, rows, lens, out_loc, prefixes, news)
    q = torch.randn(sum(news), HEADS * DIM, generator=g).to(dtype)
    k = torch.randn(sum(news), KV_HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(sum(news), KV_HEADS, DIM, generator=g).to(dtype)
    native.init_forward_metadata(fb)
    want = native.forward_extend(q, k, v, layer(), fb)
    ours.init_forward_metadata(fb)
    got = ours.forward_extend(q, k, v, layer(), fb)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_other_layers_take_torch_natives_path():
    """A non-causal (encoder-only) layer is left to the parent's code, which the results equal."""
    g = torch.Generator().manual_seed(3)
    req, kv, native, ours = backends(torch.float32)
    rows, prefixes, news = [1], [0], [6]
    place(req, rows, news, g)
    out_loc = req.req_to_token[1, :6].long()
    fb = batch(ForwardMode.EXTEND, rows, news, out_loc, prefixes, news)
    q = torch.randn(6, HEADS * DIM, generator=g)
    encoder = layer(attn_type=AttentionType.ENCODER_ONLY)
    assert not ours._own_path(encoder, fb) and ours._own_path(layer(), fb)
    torch.testing.assert_close(ours.forward_extend(q, None, None, encoder, fb),
                               native.forward_extend(q, None, None, encoder, fb))


def test_decode_slots_mask_the_padding():
    table = torch.arange(40).reshape(4, 10) + 100
    slots, keep = decode_slots(table, torch.tensor([2, 0]), torch.tensor([3, 5]))
    assert slots.tolist() == [[120, 121, 122, 0, 0], [100, 101, 102, 103, 104]]
    assert keep.shape == (2, 1, 1, 5) and keep[:, 0, 0].tolist() == [[True] * 3 + [False] * 2, [True] * 5]


def test_extend_attention_against_a_naive_loop():
    g = torch.Generator().manual_seed(4)
    prefix, n = 5, 3
    q = torch.randn(n, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(prefix + n, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(prefix + n, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    got = extend_attention(q, k, v, prefix, DIM ** -0.5, gqa=True)
    for i in range(n):
        for h in range(HEADS):
            kv_head = h // (HEADS // KV_HEADS)
            seen = prefix + i + 1
            w = torch.softmax(k[:seen, kv_head] @ q[i, h] * DIM ** -0.5, dim=0)
            torch.testing.assert_close(got[i, h], w @ v[:seen, kv_head])


def test_a_later_decode_batch_reads_its_own_slots():
    """The slots read for one decode batch are not used for the next, even without a new
    ``init_forward_metadata`` call between them."""
    g = torch.Generator().manual_seed(5)
    req, kv, native, ours = backends(torch.float32)
    rows, lens = [1, 2, 3], [4, 9, 6]
    place(req, rows, lens, g)
    q = torch.randn(3, HEADS * DIM, generator=g)
    first = batch(ForwardMode.DECODE, rows, lens, None)
    ours.init_forward_metadata(first)
    ours.forward_decode(q, None, None, layer(), first, save_kv_cache=False)
    second = batch(ForwardMode.DECODE, rows[::-1], lens[::-1], None)
    torch.testing.assert_close(ours.forward_decode(q, None, None, layer(), second, save_kv_cache=False),
                               native.forward_decode(q, None, None, layer(), second, save_kv_cache=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_batch_over_the_gather_budget_goes_in_row_chunks_with_the_same_outputs(dtype):
    kv, native, ours, fb, q, k, v, _ = decode_case(dtype, 5, [1, 4, 2, 6, 0], [5, 17, 1, 33, 9])
    ours.init_forward_metadata(fb)
    whole = ours.forward_decode(q, k, v, layer(), fb)
    row_bytes = 33 * KV_HEADS * DIM * 2 * torch.tensor([], dtype=dtype).element_size()  # the longest row, K and V
    ours.gather_bytes = 2 * row_bytes  # two rows a chunk: chunks of 2, 2, 1
    ours.init_forward_metadata(fb)
    chunked = ours.forward_decode(q, k, v, layer(), fb)
    native.init_forward_metadata(fb)
    want = native.forward_decode(q, k, v, layer(), fb)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chunked.float(), whole.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(chunked.float(), want.float(), atol=tol, rtol=tol)


def test_row_chunks_cover_every_row_once_under_the_budget():
    assert row_chunks(5, 100, 250) == [(0, 2), (2, 4), (4, 5)]
    assert row_chunks(5, 100, 10_000) == [(0, 5)]
    assert row_chunks(3, 100, 50) == [(0, 1), (1, 2), (2, 3)]  # a row over the budget still goes, alone
    assert row_chunks(0, 100, 250) == [(0, 0)]
    for rows, row_bytes, budget in [(7, 3, 10), (64, 1 << 20, 256 << 20), (1, 5, 1)]:
        chunks = row_chunks(rows, row_bytes, budget)
        assert [i for a, b in chunks for i in range(a, b)] == list(range(rows))
        assert all((b - a) * row_bytes <= budget or b - a == 1 for a, b in chunks)
