"""One training rank of ``test_rank_engines.py``, started by torchrun.

``python -m torch.distributed.run --standalone --nproc-per-node=N rank_worker.py SPEC.json``
runs, for each entry of the spec's ``runs`` (``overrides``, ``steps``, optional ``resume``,
``checkpoint``, ``save_actor``), a session of real engines on every rank (a run on the
engine settings of an earlier one takes its engines, ``colocate.engine.pool``): the PPO steps,
after each one checking that this rank's actor engine serves exactly the trainer's weights;
then, as asked, a checkpoint and the actor's state.
Each rank writes ``<out>.<rank>.json`` (per run: the step records, the weight checks and
rank 0's log lines).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from colocate.quick_exit import skip_last_collection

CHECKED = ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight")


def served_equals_trainer(session, state: dict[str, torch.Tensor]) -> bool:
    """Whether this rank's actor engine serves ``state`` (the trainer's gathered weights)."""
    for name in CHECKED:
        served = torch.tensor(session.actor.read_weight(name, truncate=50))
        mine = state[name].flatten()[: served.numel()] if served.dim() == 1 else state[name][: served.shape[0], : served.shape[1]]
        if not torch.allclose(served.reshape(mine.shape), mine, atol=1e-6):
            return False
    return True


def run(spec: dict, pool) -> dict:
    from colocate.run import builder, loop
    from colocate.config import load_config

    logs: list[str] = []
    session = builder.build(load_config(None, spec["overrides"]), resume=spec.get("resume"), log=logs.append,
                            engines=pool)
    try:
        out = {"rank": session.dist.rank, "records": [], "synced": [], "log": logs}
        everywhere = session.gather_weights()
        only_main = session.trainer.actor_state_for_sync()
        if session.is_main:  # the per-rank gather is rank 0's full state dict, name for name
            assert list(everywhere) == list(only_main), (list(everywhere)[:5], list(only_main)[:5])
            assert all(torch.equal(everywhere[k], only_main[k]) for k in only_main)
        for _ in range(spec["steps"]):
            out["records"].append(loop.step(session))
            out["synced"].append(served_equals_trainer(session, session.gather_weights()))
        if spec.get("checkpoint"):
            session.save_checkpoint()
        if spec.get("save_actor"):
            state = session.trainer.state_dict()  # collective
            if session.is_main:
                torch.save(state["actor"]["model"], spec["save_actor"])
        return out
    finally:
        session.close()


def main(path: str) -> None:
    from colocate.engine.pool import EnginePool

    spec = json.loads(Path(path).read_text())
    with EnginePool() as pool:  # a run on the engine settings of an earlier one takes its engines
        results = [run(one, pool) for one in spec["runs"]]
    rank = results[0]["rank"]
    Path(f"{spec['out']}.{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    skip_last_collection()
    main(sys.argv[1])
