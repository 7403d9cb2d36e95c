"""The Python API: prepare models, train, read results.

    from colocate import api
    from colocate.config import load_config
    cfg = load_config(overrides=["run.steps=5"])
    summary = api.train(cfg, reward_fns=[lambda record, text: len(text) / 100])

Owns: the public entry points and the :class:`Summary` a run returns. Leaves out: the
step (``colocate.loop``) and construction (``colocate.builder``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from colocate.config import Config, to_dict


def model_aliases() -> dict[str, Callable[[], Path]]:
    """Names accepted for ``models.*`` that colocate builds from packaged sources."""
    from colocate.models import prepare_smollm2

    def sentiment_rm() -> Path:
        from trainer.reward_distill import prepare_sentiment_rm

        return prepare_sentiment_rm()

    return {"smollm2": prepare_smollm2, "sentiment-rm": sentiment_rm}


def prepare(with_reward_model: bool = True) -> dict[str, Path]:
    """Build (once) and return the packaged models' folders."""
    names = ["smollm2"] + (["sentiment-rm"] if with_reward_model else [])
    aliases = model_aliases()
    return {name: aliases[name]() for name in names}


@dataclasses.dataclass(frozen=True)
class Summary:
    out_dir: Path
    steps: int
    history: list[dict[str, Any]]
    wall_s: float

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def describe(self) -> str:
        if not self.history:
            return f"no steps run; output in {self.out_dir}"
        rewards = [h["reward_mean"] for h in self.history]
        k = max(1, min(5, len(rewards) // 4))
        step_s = statistics.median(h["step_s"] for h in self.history)
        return (f"{len(self.history)} steps in {self.wall_s:.0f} s (median {step_s:.1f} s/step); "
                f"reward {statistics.fmean(rewards[:k]):+.3f} (first {k}) → "
                f"{statistics.fmean(rewards[-k:]):+.3f} (last {k}); "
                f"metrics {self.out_dir / 'metrics.jsonl'}, checkpoints {self.checkpoint_dir}")


def _progress_line(total: int) -> Callable[[dict[str, Any]], None]:
    def show(rec: dict[str, Any]) -> None:
        print(f"step {rec['step']:>4}/{total}  reward {rec['reward_mean']:+.3f}  kl {rec['kl']:.3f}  "
              f"gen {rec.get('time/generate', 0):.1f}s  train {rec.get('time/actor', 0) + rec.get('time/critic', 0):.1f}s  "
              f"step {rec['step_s']:.1f}s", flush=True)

    return show


def train(cfg: Config, *, resume: str | Path | None = None, reward_fns: Sequence[Callable] = (),
          callbacks: Sequence[Callable[[dict[str, Any]], None]] = (), quiet: bool = False) -> Summary:
    """Run PPO as configured. ``reward_fns(record, text)`` (sync or async) add to the reward
    model's score (or replace it with ``reward.kind=rule``); ``callbacks`` get each step's
    metrics."""
    from colocate import builder, loop
    from colocate.metrics import read

    started = time.perf_counter()
    log = (lambda m: None) if quiet else (lambda m: print(f"[colocate] {m}", flush=True))
    session = builder.build(cfg, resume=resume, reward_fns=reward_fns, log=log)
    try:
        if session.is_main:
            _write_run_files(session)
        progress = None if quiet or not session.is_main else _progress_line(cfg.run.steps)
        history = loop.train(session, callbacks, progress)
    finally:
        session.close()
    all_steps = read(session.out_dir / "metrics.jsonl") if session.is_main else history
    return Summary(session.out_dir, session.state.step, all_steps or history, time.perf_counter() - started)


def _write_run_files(session) -> None:
    out = session.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(session.cfg), indent=1))
    metrics = out / "metrics.jsonl"
    if metrics.exists():  # a resumed run: drop steps after the checkpoint it resumed from
        keep = [line for line in metrics.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= session.state.step]
        metrics.write_text("".join(line + "\n" for line in keep))
