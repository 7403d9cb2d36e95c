"""Checkpoints of earlier versions read as today's: the one place that knows their layouts.

Owns: :data:`LAYOUT` and :func:`current`, which hands back a checkpoint's parts in today's
layout, each owner's state side by side:

- ``run``: the run's progress (``RunState``: step, weight version, KL controller);
- ``rng``, ``trainer``: Python's and torch's RNG, the trainer (actor, critic, optimizers);
- ``data``: ``{"base", "ranks": [DataSource.state_dict() of each engine rank]}`` (stream
  position, next index, dropped count, deferred samples with their scores as rewards);
- ``rollout``: ``{"ranks": [Rollouts.state_dict() of each engine rank, or None]}`` (Δ
  controller, chunk tuner, auto's picker).

Earlier layouts, each read here and nowhere else:

- layout 1 (engines on every rank, until 2026-11-26): ``run`` also held rank 0's
  ``data_base``/``data_pos``; ``rollout`` was ``{"base", "ranks": [{"data_pos",
  "overlap"}]}`` with the deferred samples, next index and dropped count inside
  ``overlap.scheduler`` (``overlap`` None: a sequential run before every mode had one);
- layout 0 (one engine rank): ``run.data_pos`` and a top-level ``overlap``;
- within both, deferred samples saved before they carried their score and prompt record
  (then in ``ready_scores``/``records`` maps beside the scheduler), and before a score
  included ``reward.scale`` (no ``scores_scaled``: it is applied here).

Leaves out: writing and finding checkpoints (``colocate.run.checkpoint``), loading the parts
into a session's owners (``colocate.run.session``).
"""

from __future__ import annotations

from typing import Any, Mapping

LAYOUT = 2
RUN_FIELDS = ("step", "weight_version", "kl")


def current(parts: Mapping[str, Any], reward_scale: float) -> dict[str, Any]:
    """``parts`` of a loaded checkpoint in today's layout (:data:`LAYOUT`); ``reward_scale``:
    ``reward.scale``, applied to deferred scores saved before scores included it."""
    if parts.get("layout") == LAYOUT:
        return dict(parts)
    if "rollout" in parts:  # layout 1
        base, ranks = int(parts["rollout"]["base"]), list(parts["rollout"]["ranks"])
    else:  # layout 0
        base, ranks = 0, [{"data_pos": parts.get("run", {}).get("data_pos", 0), "overlap": parts.get("overlap")}]
    data = [_data_state(rank["data_pos"], rank["overlap"], reward_scale) for rank in ranks]
    rollout = [_rollout_state(rank["overlap"]) for rank in ranks]
    run = {k: v for k, v in parts.get("run", {}).items() if k in RUN_FIELDS}
    rest = {k: v for k, v in parts.items() if k not in ("overlap", "rollout", "run")}
    return {**rest, "run": run, "data": {"base": base, "ranks": data}, "rollout": {"ranks": rollout},
            "layout": LAYOUT}


def _data_state(data_pos: int, overlap: Mapping[str, Any] | None, reward_scale: float) -> dict[str, Any]:
    """A layout 0/1 rank's stream position and scheduler buffer as ``DataSource.state_dict``."""
    overlap = overlap or {}
    scheduler = overlap.get("scheduler") or {}
    scores, records = overlap.get("ready_scores", {}), overlap.get("records", {})
    deferred = []
    for d in scheduler.get("deferred", []):
        d = dict(d)
        d.setdefault("score", scores.get(str(d["index"])))
        d.setdefault("record", records.get(str(d["index"]), {}))
        if not overlap.get("scores_scaled") and d["score"] is not None:
            d["score"] = d["score"] * reward_scale
        deferred.append(d)
    # a sequential run's scheduler was not saved: it started again at index 0, the stream went on
    return {"data_pos": int(data_pos), "next_index": int(scheduler.get("next_index", 0)),
            "dropped_total": int(scheduler.get("dropped_total", 0)), "deferred": deferred}


def _rollout_state(overlap: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A layout 0/1 rank's Δ controller, chunk tuner and picker as ``Rollouts.state_dict``."""
    if overlap is None:
        return None
    auto = {"auto": overlap["auto"]} if "auto" in overlap else {}
    return {"delta": overlap["scheduler"]["delta"], "tuner": overlap["tuner"], **auto}
