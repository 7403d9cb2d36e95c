"""This rank's engines for one run: the actor and the inline reward engine.

Owns: :class:`RankEngines`: where they run (``Placement``), how they time-share the device
with the trainer (``TimeSharing``) and the tensor-parallel weight exchange; starting them
(or taking them from an :class:`~colocate.engine.pool.EnginePool` the caller keeps across
runs), the one
start-up log line, the request counters the step reports, and handing them back at the
end (shut down, or kept by the pool). A rank without engines (``Placement.hosts_engines``
false) holds none. Leaves out: where engines run and with what (``colocate.run.placement``,
``colocate.run.builder.engine_configs``); what the run does with them (the session).
"""

from __future__ import annotations

import dataclasses

from colocate.engine.pool import EnginePool
from colocate.engine.engine_config import EngineConfig
from colocate.engine.runtime import SglangEngine
from colocate.run.placement import Placement
from colocate.run.timesharing import TimeSharing
from colocate.run.weight_sync import TPExchange


@dataclasses.dataclass
class RankEngines:
    actor: SglangEngine | None = None  # None on a rank without engines
    reward: SglangEngine | None = None  # None: rule rewards only, or the feeder's process hosts it
    pool: EnginePool | None = None  # where they go back at the end; None: shut down
    kept: tuple[str, ...] = ()  # roles whose engine served an earlier run (taken from the pool)
    placement: Placement = Placement()  # who generates where (one rank: everything here)
    # how they share the device with the trainer (colocate.run.timesharing.TimeSharing; set once
    # the trainer is built) and, with engines.tp_size > 1, the weights' exchange in the TP group
    sharing: TimeSharing | None = None
    tp: TPExchange | None = None

    @classmethod
    def start(cls, actor_cfg: EngineConfig, reward_cfg: EngineConfig | None,
              pool: EnginePool | None = None, placement: Placement = Placement()) -> RankEngines:
        """Start (or take from ``pool``) the actor engine and, with ``reward_cfg``, the reward
        engine; a failure leaves nothing running."""
        engines = cls(pool=pool, placement=placement)
        try:
            engines.actor = engines._take(actor_cfg, "models.actor")
            if reward_cfg is not None:
                engines.reward = engines._take(reward_cfg, "models.reward")
        except BaseException:
            engines.close()
            raise
        return engines

    def _take(self, cfg: EngineConfig, field: str) -> SglangEngine:
        if self.pool is None:
            return SglangEngine(cfg, field=field)
        eng, reused = self.pool.take(cfg, field=field)
        if reused:
            self.kept += (cfg.role,)
        return eng

    @property
    def reused(self) -> bool:
        """Whether an engine served an earlier run: the run pushes its own weights first."""
        return bool(self.kept)

    def describe(self, engine_ranks: int) -> str:
        """The start-up line: seconds each engine took to start, or that it was kept from an
        earlier run."""
        def took(eng: SglangEngine) -> str:
            return "kept from an earlier run" if eng.cfg.role in self.kept else f"{eng.start_seconds:.1f} s"

        parts = [f"actor {took(self.actor)}"] + ([f"reward {took(self.reward)}"] if self.reward else [])
        others = f" (and on each of the other {engine_ranks - 1} engine ranks)" if engine_ranks > 1 else ""
        return "engines up: " + ", ".join(parts) + others

    def close(self) -> None:
        """Shut the engines down, or give them back to the pool."""
        for eng in (self.reward, self.actor):
            if eng is None:
                continue
            if self.pool is not None:
                self.pool.give_back(eng)
            else:
                eng.shutdown()
