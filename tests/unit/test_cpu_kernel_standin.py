"""The two sgl_kernel CPU ops of our stand-in, against naive loops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "engine" / "cpu_kernel" / "sgl_kernel" / "__init__.py"


@pytest.fixture(scope="module")
def standin():
    spec = importlib.util.spec_from_file_location("colocate_sgl_kernel_standin", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", range(5))
def test_assign_req_to_token_pool_matches_loop(standin, seed):
    g = torch.Generator().manual_seed(seed)
    rows, pool_len, bs = 6, 32, 4
    req_to_token = torch.zeros(rows, pool_len, dtype=torch.int32)
    idx = torch.randperm(rows, generator=g)[:bs]
    start = torch.randint(0, 16, (bs,), generator=g)
    end = start + torch.randint(0, 16, (bs,), generator=g)
    total = int((end - start).sum())
    out_loc = torch.randint(1, 1000, (total,), generator=g)
    want = req_to_token.clone()
    pos = 0
    for i in range(bs):
        for j in range(int(start[i]), int(end[i])):
            want[idx[i], j] = out_loc[pos]
            pos += 1
    standin.assign_req_to_token_pool_cpu(idx, req_to_token, start, end, out_loc, pool_len)
    assert torch.equal(req_to_token, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_matches_loop(standin, dtype):
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(10, 3, 4, generator=g).to(dtype) for _ in range(3)]
    want = [t.clone() for t in layers]
    tgt, src = torch.tensor([0, 7, 9]), torch.tensor([5, 2, 9])
    for t in want:
        for a, b in zip(tgt.tolist(), src.tolist()):
            t[a] = t[b].clone()
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers])
    standin.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, exp in zip(layers, want):
        assert torch.equal(got, exp)


def test_other_ops_fail_loudly_when_called(standin):
    op = standin.verify_tree_greedy_cpu  # importable: SGLang imports it at module load
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu.*stand-in"):
        op()
