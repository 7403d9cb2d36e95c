"""The completions themselves: what the model wrote, at every step and every held-out evaluation.

Owns: one row per sample (:func:`row`: step, prompt, response, reward and its parts — the
reward model's score, the environment's rewards, each reward function, all × ``reward.scale``,
so they sum to the reward — length, finish reason, whether it was carried over from an
earlier step (deferred) or relaunched (resumed), the weight versions of its tokens),
``samples.jsonl`` / ``eval_samples.jsonl`` in the run folder (:func:`append`, :func:`read`),
and printing them (:func:`show`: a rich table in a terminal, plain text otherwise; ``colocate
show RUN``). ``run.log_samples`` says how many samples of a step are written (the first N by
index, whole groups first; -1: all; 0: none). Leaves out: when rows are written (the loop),
TensorBoard/W&B (``colocate.monitor.metrics``).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from colocate.errors import ConfigError
from colocate.monitor.records import append_jsonl, read_jsonl
from colocate.monitor.visible import LAYOUT, visible

TRAIN_FILE, EVAL_FILE = "samples.jsonl", "eval_samples.jsonl"


def version_spans(versions: Sequence[int]) -> list[list[int]]:
    """[[version, tokens], …] in token order: the weight version each run of tokens was
    sampled under (one span for a sample generated under one version)."""
    return [[v, len(list(run))] for v, run in itertools.groupby(versions)]


def row(step: int, sample: Any, decode: Callable[[list[int]], str], weight_version: int) -> dict[str, Any]:
    """One sample (``colocate.rollout.sample.Sample``) as a JSON-safe row; ``weight_version``: the
    version the step's rollout started under."""
    mask = sample.mask()
    return {
        "step": step,
        "index": sample.index,
        "group": sample.group_id,
        "prompt": decode(sample.prompt_ids),
        "response": decode(sample.output_ids),
        "reward": sample.score,
        "reward_parts": dict(sample.reward_parts),
        "length": len(sample.output_ids),
        "model_tokens": sum(mask),
        "turns": sample.turns,
        "finish_reason": sample.finish_reason,
        "deferred": bool(sample.versions) and min(sample.versions) < weight_version,
        "resumed": sample.attempts > 1,
        "versions": version_spans(sample.versions),
    }


def rows(step: int, samples: Sequence[Any], decode: Callable[[list[int]], str], weight_version: int,
         limit: int) -> list[dict[str, Any]]:
    """The rows of a step's samples, the first ``limit`` by index (-1: all, 0: none)."""
    if limit == 0:
        return []
    chosen = sorted(samples, key=lambda x: (x.group_id, x.index))
    return [row(step, x, decode, weight_version) for x in (chosen if limit < 0 else chosen[:limit])]


def append(path: Path, new: Iterable[dict[str, Any]]) -> None:
    append_jsonl(path, new)


def read(run_dir: str | Path, step: int | None = None, evaluation: bool = False) -> list[dict[str, Any]]:
    """Rows of ``samples.jsonl`` (or ``eval_samples.jsonl``) of a run folder, of one step or
    all; a missing file is a one-line error naming it and ``run.log_samples``."""
    path = Path(run_dir) / (EVAL_FILE if evaluation else TRAIN_FILE)
    if not path.is_file() and not (Path(run_dir) / "config.json").is_file():
        raise ConfigError(f"{run_dir}: not a run folder (no config.json, which a run writes as it starts); give a "
                          "run's run.out_dir, e.g. runs/default")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; runs write it with run.log_samples != 0"
                          + (" and run.eval_every > 0" if evaluation else ""))
    return [r for r in read_jsonl(path) if step is None or r["step"] == step]


def written_steps(rows: Sequence[dict[str, Any]]) -> str:
    """The steps ``rows`` hold, short: "steps 1-20", "step 4", "no step (the file is empty)"."""
    steps = sorted({r["step"] for r in rows})
    if not steps:
        return "no step (the file is empty)"
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else \
        "steps " + ", ".join(map(str, steps))


COLUMNS = ("step", "index", "prompt", "response", "reward", "parts", "length", "end")


def cells(r: dict[str, Any]) -> list[Any]:
    """A row's cells under :data:`COLUMNS` (W&B table)."""
    return [r["step"], r["index"], r["prompt"], r["response"], r["reward"], _parts(r["reward_parts"]),
            r["length"], _fate(r)]


def markdown(found: Sequence[dict[str, Any]], width: int = 200) -> str:
    """Rows as a markdown table (TensorBoard text)."""
    def cell(x: Any) -> str:
        return _clip(str(x), width).replace("|", "\\|")

    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)
    return "\n".join([head] + ["| " + " | ".join(cell(c) for c in cells(r)) + " |" for r in found])


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _parts(parts: dict[str, float]) -> str:
    """The reward's nonzero parts ("0" when none is)."""
    return " ".join(f"{k} {v:+.3g}" for k, v in parts.items() if v) or "0"


def show(found: Sequence[dict[str, Any]], width: int = 80, echo: Callable[[str], None] = print,
         rich: bool | None = None) -> None:
    """Print rows readably: a rich table in a terminal (``rich``), else one block per row.
    What the model and the dataset wrote is shown as data (``colocate.monitor.visible``):
    its control characters escaped, a rich table's cells plain text (no markup)."""
    if rich is None:
        rich = sys.stdout.isatty()
    if rich:
        _table(found, width)
        return
    for r in found:
        echo(visible(f"step {r['step']} sample {r['index']} (group {r['group']}): reward {r['reward']:+.3f} "
                     f"[{_parts(r['reward_parts'])}], {r['length']} tokens, {_fate(r)}"))
        echo(f"  prompt:   {_clip(visible(r['prompt'], keep=LAYOUT), width)}")
        echo("  response: " + visible(r["response"], keep=LAYOUT).replace("\n", "\n            "))


def _table(found: Sequence[dict[str, Any]], width: int) -> None:
    """The rows as a rich table, each cell a plain ``Text`` (``[link=…]`` in a response is text)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_lines=True)
    for name in ("step", "#", "prompt", "response", "reward", "parts", "len", "end"):
        table.add_column(name, overflow="fold")
    for r in found:
        cells = (r["step"], r["index"], _clip(visible(r["prompt"], keep=LAYOUT), width // 2),
                 visible(r["response"], keep=LAYOUT), f"{r['reward']:+.3f}", _parts(r["reward_parts"]), r["length"],
                 _fate(r))
        table.add_row(*(Text(visible(str(c), keep=LAYOUT)) for c in cells))
    Console().print(table)


def _fate(r: dict[str, Any]) -> str:
    flags = [f for f in ("deferred", "resumed") if r.get(f)]
    return ", ".join([str(r["finish_reason"])] + flags)
