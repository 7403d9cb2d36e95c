"""Bench plots: a per-step phase timeline (Gantt) per mode, reward vs wall-clock, and the
held-out reward curves of the time-to-reward study.

Owns: two PNGs per workload and `convergence.png`, drawn on matplotlib ``Figure`` objects
(its Agg canvas, no pyplot: no process-wide backend or IPython hook; pyplot's import failed
on the GPU kit, whose IPython is an import-only stand-in). Leaves out: numbers.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

PHASES = ("generate", "reward_tail", "abort_wait", "sleep_wake", "ref", "old_logp", "values",
          "advantages", "critic", "actor", "sync")


def figure(figsize: tuple[float, float], rows: int | None = None):
    """A new figure, off pyplot, and its axes: one, or a column of ``rows`` (an array)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, (fig.subplots() if rows is None else fig.subplots(rows, 1, squeeze=False)[:, 0])


def palette(name: str) -> tuple:
    from matplotlib import colormaps

    return colormaps[name].colors


def _median_step(rows: list[dict[str, Any]]) -> dict[str, Any]:
    target = statistics.median(r["step_s"] for r in rows)
    return min(rows, key=lambda r: abs(r["step_s"] - target))


def gantt(records: list[dict[str, Any]], modes: Sequence[str], path: Path, title: str) -> Path:
    fig, ax = figure((11, 1.0 + 0.7 * len(modes)))
    colors = palette("tab20")
    shown = set()
    for y, mode in enumerate(modes):
        rows = [r for r in records if r["mode"] == mode and "skipped" not in r]
        if not rows:
            continue
        rec, t = _median_step(rows), 0.0
        for i, phase in enumerate(PHASES):
            dur = rec.get(f"time/{phase}", 0.0)
            if dur <= 0:
                continue
            ax.barh(y, dur, left=t, color=colors[i % len(colors)], edgecolor="black", linewidth=0.3,
                    label=phase if phase not in shown else None)
            shown.add(phase)
            t += dur
        ax.text(rec["step_s"], y, f" {rec['step_s']:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(modes)), modes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds within the median step (generation includes the overlapped scoring)")
    ax.set_title(title)
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def reward_curve(records: list[dict[str, Any]], modes: Sequence[str], path: Path, title: str) -> Path:
    fig, ax = figure((8, 4.5))
    colors = palette("tab10")
    for i, mode in enumerate(modes):
        for rep in sorted({r["repeat"] for r in records if r["mode"] == mode}):
            rows = [r for r in records if r["mode"] == mode and r["repeat"] == rep and "skipped" not in r]
            ax.plot([r["wall_s"] for r in rows], [r["reward_mean"] for r in rows], marker="o", ms=3,
                    color=colors[i % 10], alpha=0.8, label=mode if rep == 0 else None)
    return _save(fig, ax, "wall-clock seconds since the mode's first measured step",
                 "mean reward of trained samples", title, path)


def convergence(curves: dict[str, list[dict[str, float]]], target: float, path: Path, title: str) -> Path:
    """Held-out reward against training seconds, one line per mode, the target dashed."""
    fig, ax = figure((8, 4.5))
    colors = palette("tab10")
    for i, (mode, points) in enumerate(curves.items()):
        ax.plot([p["seconds"] for p in points], [p["reward"] for p in points], marker="o", ms=3,
                color=colors[i % 10], label=mode)
    if target == target:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target (sequential's final)")
    return _save(fig, ax, "training seconds (sum of step times; evaluations left out)",
                 "held-out reward (greedy)", title, path)


def _save(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    """Label, lay out and write ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
