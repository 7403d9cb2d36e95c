"""EnginePool on a real CPU engine: an engine given back is handed over again for an equal
config (and only for it), a dead or paused one is shut down instead of kept, and the pool
keeps at most ``max_idle``. That a run on a kept engine trains exactly as on a fresh one
(its own weights pushed first) is checked by ``test_soak.py``'s same-seed runs, which
share one pool."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from colocate.engine.pool import EnginePool
from colocate.engine.engine_config import EngineConfig
from colocate.engine.runtime import run_guarded

pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)


def test_kept_engines_are_handed_over_for_an_equal_config_only(tiny_actor_path):
    cfg = EngineConfig(tiny_actor_path, role="actor", device="cpu", max_total_tokens=4096, threads=1)
    with EnginePool(max_idle=1) as pool:
        eng, reused = pool.take(cfg)
        assert not reused and pool.started == 1
        pool.give_back(eng)
        assert pool.idle() == 1
        again, reused = pool.take(dataclasses.replace(cfg))  # equal, not the same object
        assert again is eng and reused and pool.reused == 1 and pool.idle() == 0
        assert eng.read_weight("model.norm.weight", truncate=4)  # still serving

        run_guarded([eng], eng.pause("in_place"))  # a paused engine holds requests: never kept
        pool.give_back(eng)
        assert eng.closed and pool.idle() == 0
        assert not any(_running(p) for p in eng.child_pids)

        fresh, reused = pool.take(cfg)
        assert not reused and fresh is not eng and pool.started == 2
        pool.give_back(fresh)
        os.kill(fresh.child_pids[0], signal.SIGKILL)  # dies while kept
        time.sleep(0.5)
        kept, reused = pool.take(cfg)  # shut down on the way out, a new one started
        assert kept is not fresh and not reused and fresh.closed and pool.started == 3
        pool.give_back(kept)
        assert pool.idle() == 1
        pool.give_back(kept)  # twice: kept once
        assert pool.idle() == 1
        again, reused = pool.take(cfg)
        second, _ = pool.take(cfg)  # none idle: a second engine of the same config
        assert again is kept and reused and second is not kept and pool.started == 4
        pool.give_back(kept)
        pool.give_back(second)  # max_idle 1: the oldest kept one is shut down
        assert pool.idle() == 1 and kept.closed and not second.closed
    assert second.closed  # the pool's end shuts down what it kept


def _running(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_a_lora_run_on_a_kept_engine_serves_the_base_beside_its_adapters(tmp_path, tiny_pair, run_overrides,
                                                                           engine_pool):
    """Issue 39.3: a LoRA run's pushes carry only the adapted linears; its first push into an
    engine kept from a full fine-tuning run left that run's trained norms (and embeddings,
    LM head) in the engine. The first push of a run is now the whole model."""
    import torch
    from safetensors.torch import load_file

    from colocate import api
    from colocate.config import load_config
    from colocate.run.builder import engine_configs

    models = tiny_pair("ppo", 0, 2)
    base = load_file(f"{models[0]}/model.safetensors")["model.norm.weight"]
    common = ["run.eval_every=0", "run.save_every=0", "ppo.actor_lr=0.05"]
    full = load_config(overrides=run_overrides(models, tmp_path / "full", "run.steps=2", *common))
    api.train(full, engines=engine_pool, quiet=True)
    want, _ = engine_configs(full, models[0], models[1])
    (actor,) = [e for e in engine_pool.kept() if e.cfg == want]
    trained = torch.tensor(actor.read_weight("model.norm.weight", truncate=base.numel()))
    assert (trained - base).abs().max() > 1e-3  # the full run moved the norm the LoRA run does not train
    api.train(load_config(overrides=run_overrides(models, tmp_path / "lora", "run.steps=0", "lora.rank=4", *common)),
              engines=engine_pool, quiet=True)
    assert actor in engine_pool.kept()  # the same engine served the LoRA run
    served = torch.tensor(actor.read_weight("model.norm.weight", truncate=base.numel()))
    assert torch.allclose(served, base, atol=1e-6)
