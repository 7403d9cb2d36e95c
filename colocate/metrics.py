"""Per-step metrics: phase timers, JSONL always, TensorBoard when installed.

Owns: :class:`PhaseTimer` (wall time of each named phase of a step) and
:class:`MetricsLog` (append-only JSONL, TensorBoard scalars if the package is present).
Leaves out: what is measured (the loop decides).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator


class PhaseTimer:
    """Accumulates seconds per phase name; ``with timer("generate"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl``; mirrors to TensorBoard."""

    def __init__(self, out_dir: Path, enabled: bool = True) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except ImportError:
                self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def rss_mb() -> float:
    """Resident memory of this process and all its children (the engines' schedulers and
    detokenizers, a feeder process), in MiB: the soak signal for leaks."""
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def read(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
