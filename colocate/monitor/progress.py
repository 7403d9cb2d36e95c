"""Progress of a training run as a person watches it: step, phase, reward, KL, ETA.

Owns: :class:`Progress`, fed the current phase (``Session.watch_phases``) and each step's
metrics. On a terminal it is a tqdm bar (phase as its label; reward, KL and step time as
its postfix; tqdm's own rate and ETA). Piped or in CI it prints one plain line per step
with the ETA, so logs stay readable. Leaves out: what the numbers mean.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

from colocate.monitor.visible import visible


def _eta(seconds: float) -> str:
    if seconds != seconds:  # NaN: no step timed yet
        return "?"
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """Steps ``start``..``total`` of one run."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None,
                 bar: bool | None = None) -> None:
        self.total, self.done = total, start
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.timed_steps = 0
        use_bar = self.stream.isatty() if bar is None else bar
        self.bar = None
        if use_bar:
            self.bar = tqdm(total=total, initial=start, unit="step", desc="start", file=self.stream,
                            dynamic_ncols=True)

    def phase(self, name: str) -> None:
        if self.bar is not None and name != "idle":
            self.bar.set_description_str(visible(name))

    def eta_s(self) -> float:
        if not self.timed_steps:
            return float("nan")
        per_step = (time.perf_counter() - self.started) / self.timed_steps
        return per_step * (self.total - self.done)

    def __call__(self, rec: dict[str, Any]) -> None:
        self.done, self.timed_steps = rec["step"], self.timed_steps + 1
        if "skipped" in rec:
            self._line(f"step {rec['step']:>4}/{self.total}  skipped: {rec['skipped']}")
        elif self.bar is not None:
            self.bar.set_postfix(reward=f"{rec['reward_mean']:+.3f}", kl=_kl(rec),
                                 step=f"{rec['step_s']:.1f}s", refresh=False)
        else:
            self._line(f"step {rec['step']:>4}/{self.total}  reward {rec['reward_mean']:+.3f}  "
                       f"kl {_kl(rec)}  gen {rec.get('time/generate', 0):.1f}s  "
                       f"train {rec.get('time/actor', 0) + rec.get('time/critic', 0):.1f}s  "
                       f"step {rec['step_s']:.1f}s  eta {_eta(self.eta_s())}")
        if self.bar is not None:
            self.bar.update(1)

    def _line(self, text: str) -> None:
        text = visible(text)  # a skipped step's reason may quote a reward function's message
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _kl(rec: dict[str, Any]) -> str:
    """The step's KL to the reference, "off" without one (ppo.kl_coef=0, fixed)."""
    return f"{rec['kl']:.3f}" if "kl" in rec else "off"
