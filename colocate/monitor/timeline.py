"""A per-request timeline of the rollout: where a step's generate seconds go.

Owns: :class:`Timeline`, a plain list of events, each ``{"t", "step", "index", "event",
...}`` with ``t`` in seconds since the timeline started. Request events (``index`` is the
sample's): ``launch`` (a new request; ``prior`` tokens it resumes from), ``adopt`` (a
parked stream taken up by a later step: no new request), ``first_token``, ``end`` (its
stream ended: ``reason`` stop/length/abort, ``tokens`` in all), ``scored``, ``parked``
(paused in the engine at the cut), ``aborted`` (aborted at the cut), ``trained`` /
``deferred`` (what the scheduler did with it). Step events (``index`` -1): ``rollout``
(start), ``cut``, ``rollout_end``, and what the loop marks (``train``, ``sync``, ``idle``).
:func:`running_batch`, the number of requests decoding at each moment (the actor
engine's running batch as colocate sees it: from a request's launch or adoption to its
end or park).

Leaves out: writing and plotting (``colocate``, ``bench``).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

STEP = -1  # the index of a step-level event


class Timeline:
    """Events of one run, appended as they happen; :meth:`take` hands them out."""

    def __init__(self, step: int = 0):
        self.t0 = time.perf_counter()
        self.step = step  # the step the next events belong to (set by whoever runs it)
        self._events: list[dict[str, Any]] = []

    def mark(self, event: str, index: int = STEP, **info: Any) -> None:
        self._events.append({"t": round(time.perf_counter() - self.t0, 4), "step": self.step,
                             "index": index, "event": event, **info})

    def take(self) -> list[dict[str, Any]]:
        """The events since the last call (and forget them)."""
        events, self._events = self._events, []
        return events


def mark(timeline: Timeline | None, event: str, index: int = STEP, **info: Any) -> None:
    """``timeline.mark`` when there is a timeline (most runs keep none)."""
    if timeline is not None:
        timeline.mark(event, index, **info)


def mark_fates(timeline: Timeline | None, trained: Iterable[int], deferred: Iterable[int]) -> None:
    """Where a step's samples (by index) went: ``trained``, or ``deferred`` to a later step."""
    for fate, indices in (("trained", trained), ("deferred", deferred)):
        for index in indices:
            mark(timeline, fate, index)


def running_batch(events: Iterable[dict[str, Any]]) -> list[tuple[float, int]]:
    """(t, requests decoding from t on) at every change: a request counts from its
    ``launch`` or ``adopt`` to its ``end`` or ``parked`` (parked and later adopted, it
    counts again from the adoption; a parked stream that ends unseen does not count)."""
    active: set[int] = set()
    out: list[tuple[float, int]] = []
    for e in sorted((e for e in events if e["index"] != STEP), key=lambda e: e["t"]):
        before = len(active)
        if e["event"] in ("launch", "adopt"):
            active.add(e["index"])
        elif e["event"] in ("end", "parked"):
            active.discard(e["index"])
        if len(active) != before:
            if out and out[-1][0] == e["t"]:
                out[-1] = (e["t"], len(active))
            else:
                out.append((e["t"], len(active)))
    return out
