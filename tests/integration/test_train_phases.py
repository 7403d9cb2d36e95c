"""bench.train_phases on CPU: the trainer half of a step in the loop's order, measured (the
same code measures the CUDA FSDP path and its offload where a GPU is at hand)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from colocate.bench.train_phases import PHASES, synthetic_batch


def test_synthetic_batch_shape():
    batch = synthetic_batch(4, 5, 8, 300, seed=0)
    assert batch.input_ids.shape == (4, 13)
    assert batch.response_mask.sum(-1).tolist() == [8, 7, 6, 5]
    assert batch.response_start.tolist() == [5] * 4 and int(batch.input_ids.max()) < 300


def test_train_phases_cli_on_cpu(tmp_path):
    out = tmp_path / "tp"
    cmd = [sys.executable, "-m", "colocate.bench.train_phases", "--device", "cpu", "--shape", "tiny", "--batch", "4",
           "--prompt-tokens", "6", "--response-tokens", "10", "--steps", "2", "--warmup", "0",
           "--set", "ppo.epochs=1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "train_phases.json").read_text())
    assert result["ppo"] == {"epochs": 1, "minibatches": 2} and result["world_size"] == 1
    assert set(result["phases"]) == {*PHASES, "total"}
    for step in result["steps"]:
        assert set(step["seconds"]) == set(PHASES)
        assert all(math.isfinite(v) and v >= 0 for v in step["seconds"].values())
        assert step["seconds"]["critic"] > 0 and step["seconds"]["actor"] > 0
        assert all(math.isfinite(v) for v in step["losses"].values())
        assert step["gathered_tensors"] > 0
        assert step["memory_before_offload"] == {} and step["peak_allocated_gib"] is None  # no device memory on CPU
    total = result["phases"]["total"]
    assert total["min"] <= total["median"] <= total["max"]
    table = (out / "train_phases.md").read_text()
    assert "| critic |" in table and "world 1, float32" in table and "device memory" not in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_train_phases_refuses_cuda_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "colocate.bench.train_phases", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "torch sees no CUDA device here; use --device cpu" in done.stderr
    assert "Traceback" not in done.stderr
