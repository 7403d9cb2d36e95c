"""Where a step's generate seconds go: the per-request timeline of each mode, read and drawn.

Owns: :func:`breakdown` (one step's rollout from its events: seconds to the cut, the
tail spent at a running batch of at most 2, the mean running batch, first-token waits of
fresh and of resumed requests, tokens re-prefilled by resumed requests, adopted parked
streams), :func:`summary` (medians per mode) with its markdown table, and
:func:`plot` (per mode, one step's requests as bars from launch or adoption to end or
park, coloured by fate, with the running batch size beneath). The events come from
``colocate.monitor.timeline`` (``run.timeline``; the bench always keeps one) through the
``<workload>_requests.jsonl`` journal.

Leaves out: recording the events (``colocate``), the step-level numbers (``bench.report``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

from colocate.monitor.timeline import STEP, running_batch

TAIL_BATCH = 2  # a running batch this small decodes at the memory-bound rate: the long tail


def _first(events, name: str) -> float | None:
    return next((e["t"] for e in events if e["index"] == STEP and e["event"] == name), None)


def _waits(events, fresh: bool) -> list[float]:
    launched = {e["index"]: e for e in events if e["event"] == "launch" and (e["prior"] == 0) == fresh}
    firsts = {e["index"]: e["t"] for e in events if e["event"] == "first_token"}
    return [firsts[i] - e["t"] for i, e in launched.items() if i in firsts]


def breakdown(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One step's rollout (its events, in any order)."""
    start = _first(events, "rollout")
    end = _first(events, "cut") or _first(events, "rollout_end")
    if start is None or end is None:
        return {}
    curve = [(t, n) for t, n in running_batch(events) if t < end]
    tail = mean = 0.0
    for (t, n), nxt in zip(curve, [c[0] for c in curve[1:]] + [end]):
        a, b = max(t, start), max(min(nxt, end), start)
        mean += n * (b - a)
        tail += (b - a) if 0 < n <= TAIL_BATCH else 0.0
    fresh, resumed = _waits(events, True), _waits(events, False)
    return {
        "until_cut_s": end - start,
        "tail_s": tail,
        "mean_batch": mean / (end - start) if end > start else 0.0,
        "first_token_fresh_s": statistics.median(fresh) if fresh else 0.0,
        "first_token_resumed_s": statistics.median(resumed) if resumed else 0.0,
        "resumed": float(len(resumed)),
        "reprefilled_tokens": float(sum(e["prior"] for e in events if e["event"] == "launch")),
        "adopted": float(sum(1 for e in events if e["event"] == "adopt")),
    }


def _steps(events: Sequence[dict[str, Any]]) -> dict[tuple[str, int, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for e in events:
        out.setdefault((e.get("mode", ""), e.get("repeat", 0), e["step"]), []).append(e)
    return out


def summary(events: Sequence[dict[str, Any]], modes: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per mode: the median over its measured steps of every :func:`breakdown` figure."""
    per: dict[str, list[dict[str, float]]] = {}
    for (mode, _, _), evs in _steps(events).items():
        row = breakdown(evs)
        if row:
            per.setdefault(mode, []).append(row)
    return {m: {k: statistics.median(r[k] for r in per[m]) for k in per[m][0]} for m in modes if m in per}


def markdown(table: dict[str, dict[str, float]]) -> list[str]:
    cols = [("until_cut_s", "to the cut s"), ("tail_s", f"at batch ≤ {TAIL_BATCH} s"), ("mean_batch", "mean batch"),
            ("first_token_fresh_s", "first token, fresh s"), ("first_token_resumed_s", "first token, resumed s"),
            ("reprefilled_tokens", "tokens re-prefilled"), ("adopted", "parked streams adopted")]
    lines = ["| mode | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for mode, row in table.items():
        lines.append(f"| {mode} | " + " | ".join(f"{row[k]:.2f}" for k, _ in cols) + " |")
    return lines


def plot(events: Sequence[dict[str, Any]], modes: Sequence[str], path: Path, title: str) -> Path | None:
    """Per mode, its first measured step with a rollout: request bars and the running batch."""
    from colocate.bench.plots import figure

    steps = _steps(events)
    chosen = {m: min((k for k in steps if k[0] == m and breakdown(steps[k])), default=None) for m in modes}
    shown = [m for m in modes if chosen[m] is not None]
    if not shown:
        return None
    fig, axes = figure((11, 2.6 * len(shown)), rows=len(shown))
    for ax, mode in zip(axes, shown):
        _draw(ax, steps[chosen[mode]], f"{mode} (repeat {chosen[mode][1]}, step {chosen[mode][2]})")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _draw(ax, events, label: str) -> None:
    start = _first(events, "rollout") or 0.0
    fate = {e["index"]: e["event"] for e in events if e["event"] in ("trained", "deferred")}
    colors = {"trained": "tab:green", "deferred": "tab:orange"}
    rows = sorted({e["index"] for e in events if e["index"] != STEP})
    for y, i in enumerate(rows):
        mine = sorted((e for e in events if e["index"] == i), key=lambda e: e["t"])
        opened = None
        for e in mine:
            if e["event"] in ("launch", "adopt"):
                opened = e["t"]
            elif e["event"] in ("end", "parked") and opened is not None:
                ax.barh(y, e["t"] - opened, left=opened - start, color=colors.get(fate.get(i), "tab:gray"), height=0.7)
                opened = None
            elif e["event"] == "first_token":
                ax.plot([e["t"] - start] * 2, [y - 0.35, y + 0.35], color="black", linewidth=0.8)
    for name in ("cut", "train"):
        t = _first(events, name)
        if t is not None:
            ax.axvline(t - start, color="red" if name == "cut" else "black", linestyle="--", linewidth=0.8)
    twin = ax.twinx()
    curve = running_batch(events)
    twin.step([t - start for t, _ in curve], [n for _, n in curve], where="post", color="tab:blue", linewidth=1)
    twin.set_ylabel("running batch", color="tab:blue", fontsize=8)
    ax.set_ylabel("requests", fontsize=8)
    ax.set_xlabel("seconds since the rollout began (green: trained, orange: deferred; | first token; red: cut)",
                  fontsize=8)
    ax.set_title(label, fontsize=9)
