"""SGLang's own LoRA serving (`engine/lora_serving.py`, measured by `bench/lora_sync.py`)
cannot start on a CPU machine without a CUDA driver: SGLang 0.5.23's LoRA layers pin host
memory. The start is refused in one line before any engine process is spawned (SGLang's
failing scheduler would otherwise SIGKILL the calling process)."""

from __future__ import annotations

import pytest
import torch

from colocate.engine.errors import EngineStartError
from colocate.engine.lora_serving import start


def _can_pin() -> bool:
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(_can_pin(), reason="this host can pin memory (a CUDA driver): SGLang's LoRA layers may start")
def test_lora_serving_on_cpu_is_refused_in_one_line_before_any_start(tiny_actor_path):
    import psutil

    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(EngineStartError) as err:
        start(tiny_actor_path, rank=4, device="cpu")
    message = str(err.value)
    assert "\n" not in message and "pin host memory" in message and "merged-weight sync" in message
    assert len(psutil.Process().children(recursive=True)) == before  # nothing was spawned
