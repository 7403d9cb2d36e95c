"""The varlen sdpa attention (``colocate.trainer.varlen_attention``) against a naive loop over
queries, per packed sequence and per shared-prefix part; on CPU a half-precision input is
attended in float32 (the output cast back), not in bf16's own kernels."""

from __future__ import annotations

import math

import torch

from colocate.trainer.varlen_attention import varlen_sdpa_forward

H, HKV, D = 6, 2, 8


class _Module(torch.nn.Module):
    pass


def _naive(q, k, v, blocks, scale):
    """[1, H, N, D] inputs -> [1, N, H, D]: query i of part (q0, q1, p0, p1) sees keys p0..p1-1
    (its prompt) and q0..i (itself, causally), one softmax per query and head."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[2], q.shape[1], q.shape[3], dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for q0, q1, p0, p1 in blocks:
        for i in range(q0, q1):
            seen = list(range(p0, p1)) + list(range(q0, i + 1))
            for h in range(q.shape[1]):
                kv = h // groups
                logits = torch.stack([q[0, h, i] @ k[0, kv, j] * scale for j in seen])
                weights = torch.softmax(logits, dim=0)
                out[i, h] = sum(w * v[0, kv, j] for w, j in zip(weights, seen))
    return out.unsqueeze(0)


def _inputs(n: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, D, generator=g).to(dtype) for heads in (H, HKV, HKV)]


SHARED = [(0, 5, 0, 0), (5, 9, 0, 5), (9, 12, 0, 5), (12, 15, 12, 12), (15, 19, 12, 15)]  # 2 groups


def test_packed_sequences_and_shared_prefix_parts_equal_the_naive_loop():
    q, k, v = _inputs(19)
    scale = 1 / math.sqrt(D)
    mod = _Module().eval()
    bounds = torch.tensor([0, 7, 12, 19])
    out, _ = varlen_sdpa_forward(mod, q, k, v, None, cu_seq_lens_q=bounds)
    causal = [(a, b, a, a) for a, b in zip(bounds.tolist(), bounds.tolist()[1:])]
    assert torch.allclose(out.double(), _naive(q, k, v, causal, scale), atol=1e-5)
    out, _ = varlen_sdpa_forward(mod, q, k, v, None, shared_prefix_blocks=torch.tensor(SHARED))
    assert torch.allclose(out.double(), _naive(q, k, v, SHARED, scale), atol=1e-5)


def test_on_cpu_bf16_is_attended_in_float32_and_handed_back_in_bf16():
    q, k, v = _inputs(19, torch.bfloat16, seed=1)
    mod = _Module().eval()
    blocks = torch.tensor(SHARED)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, _ = varlen_sdpa_forward(mod, *leaves, None, shared_prefix_blocks=blocks)
    assert out.dtype == torch.bfloat16
    # the same values attended in float32, then rounded once: bit for bit
    ref, _ = varlen_sdpa_forward(mod, q.float(), k.float(), v.float(), None, shared_prefix_blocks=blocks)
    assert torch.equal(out, ref.to(torch.bfloat16))
    assert torch.allclose(out.double(), _naive(q, k, v, SHARED, 1 / math.sqrt(D)), atol=2e-2)
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() for x in leaves)
