"""Per-step metrics: JSONL always, TensorBoard when installed, W&B when asked.

Owns: :class:`MetricsLog` (append-only JSONL, TensorBoard scalars if the package is present,
a :class:`colocate.monitor.wandb_log.WandbRun` when ``run.wandb_project`` is set).
Leaves out: what is measured (the loop decides; its phases' seconds: ``colocate.run.loop.StepPhases``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

import psutil

from colocate.monitor import completions
from colocate.monitor.records import append_jsonl, read_jsonl


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl``; mirrors to TensorBoard and W&B."""

    def __init__(self, out_dir: Path, enabled: bool = True, wandb: Any = None) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        self._wandb = wandb  # a WandbRun (log, finish) or None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:  # optional and heavy (torch, tensorboard): mirrored only when installed
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except ImportError:
                self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        """One step's record: a line in ``metrics.jsonl``, its scalars to TensorBoard/W&B."""
        if not self.enabled:
            return
        append_jsonl(self.path, [record])
        self._mirror(record)

    def write_eval(self, record: dict[str, Any]) -> None:
        """One held-out evaluation: a line in ``eval.jsonl``, ``eval/*`` scalars elsewhere."""
        if not self.enabled:
            return
        append_jsonl(self.path.parent / "eval.jsonl", [record])
        self._mirror({f"eval/{k}": v for k, v in record.items() if k != "step"} | {"step": record["step"]})

    def write_samples(self, step: int, rows: Sequence[dict[str, Any]], evaluation: bool = False) -> None:
        """A step's completions (``colocate.monitor.completions``): ``samples.jsonl`` (or
        ``eval_samples.jsonl``), a text table in TensorBoard and a table in W&B."""
        if not self.enabled or not rows:
            return
        completions.append(self.path.parent / (completions.EVAL_FILE if evaluation else completions.TRAIN_FILE), rows)
        name = "eval_samples" if evaluation else "samples"
        if self._tb is not None:
            self._tb.add_text(name, completions.markdown(rows), step)
        if self._wandb is not None:
            self._wandb.log_table(name, completions.COLUMNS, [completions.cells(r) for r in rows], step)

    def write_timeline(self, events: Sequence[dict[str, Any]]) -> None:
        """A step's rollout timeline (``run.timeline``): one line per event in ``timeline.jsonl``."""
        if not self.enabled or not events:
            return
        append_jsonl(self.path.parent / "timeline.jsonl", events)

    def _mirror(self, record: dict[str, Any]) -> None:
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(record)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(summary or {})
            self._wandb = None


def run_summary(history: list[dict[str, Any]], evals: list[dict[str, Any]] = ()) -> dict[str, float]:
    """What a run ends with: steps, reward at the start and end (mean of up to 5 steps
    each), median step time, the last KL; the first and last held-out evaluation."""
    rewards = [h["reward_mean"] for h in history if "reward_mean" in h]
    held_out = {}
    if evals:
        held_out = {"eval_step_first": float(evals[0]["step"]), "eval_reward_first": evals[0]["reward_mean"],
                    "eval_step_last": float(evals[-1]["step"]), "eval_reward_last": evals[-1]["reward_mean"]}
    if not rewards:
        return {"steps": float(len(history))} | held_out
    k = max(1, min(5, len(rewards) // 4))
    return held_out | {
        "steps": float(len(history)),
        "reward_first": statistics.fmean(rewards[:k]),
        "reward_last": statistics.fmean(rewards[-k:]),
        "median_step_s": statistics.median(h["step_s"] for h in history),
        "kl_last": float(history[-1].get("kl", float("nan"))),
    }


def rss_mb() -> float:
    """Resident memory of this process and all its children (the engines' schedulers and
    detokenizers, a feeder process), in MiB: the soak signal for leaks."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def read(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` or ``eval.jsonl`` (``records.read_jsonl``)."""
    return read_jsonl(path)
