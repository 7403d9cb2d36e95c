"""Optional Weights & Biases mirror of the per-step metrics.

Owns: :func:`check_available` (a one-line error before any engine starts when
``run.wandb_project`` is set but ``wandb`` is not installed) and :class:`WandbRun` (one
W&B run per run folder: the config at start, every step's scalars at its step number, a
final summary; a resumed run continues the same W&B run, its id kept in the run folder).
Leaves out: JSONL and TensorBoard (``colocate.monitor.metrics``), what is measured (the loop).
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any, Sequence

from colocate.config import RunConfig
from colocate.errors import ConfigError

ID_FILE = "wandb_run_id"


def check_available(run: RunConfig) -> None:
    if run.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"run.wandb_project={run.wandb_project!r} needs the wandb package: "
            "pip install 'colocate[wandb]' (or leave run.wandb_project empty)"
        )


class WandbRun:
    """Mirrors step records to W&B; ``mode=offline`` writes under ``<out_dir>/wandb`` for a
    later ``wandb sync``."""

    def __init__(self, run: RunConfig, out_dir: Path, config: dict[str, Any], resumed: bool) -> None:
        import wandb  # optional: only with run.wandb_project (check_available says when it is missing)

        check_available(run)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        id_path = out_dir / ID_FILE
        run_id = id_path.read_text().strip() if resumed and id_path.is_file() else uuid.uuid4().hex[:12]
        id_path.write_text(run_id + "\n")
        try:
            self._run = wandb.init(
                project=run.wandb_project, entity=run.wandb_entity or None, mode=run.wandb_mode,
                name=run.wandb_name or out_dir.resolve().name, id=run_id, resume="allow",
                dir=str(out_dir), config=config,
                settings=wandb.Settings(console="off"),  # our own progress lines stay as they are
            )
        except wandb.Error as exc:  # no API key, no network, a bad entity
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"run.wandb_project: W&B could not start ({first}); run `wandb login`, "
                "or set run.wandb_mode=offline and `wandb sync` later"
            ) from None

    @property
    def id(self) -> str:
        return self._run.id

    def log(self, record: dict[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        self._run.log(scalars, step=int(record.get("step", 0)))

    def log_table(self, name: str, columns: Sequence[str], data: Sequence[Sequence[Any]], step: int) -> None:
        """A table of rows at ``step`` (the completions: ``colocate.monitor.completions``)."""
        import wandb  # optional, as above

        self._run.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in data])}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        import wandb  # optional, as above

        self._run.summary.update(summary)
        self._run.finish()
        # Stop W&B's service process now, while it is surely alive: left to W&B's exit hook,
        # the teardown fails noisily when the service was already gone by then.
        wandb.teardown()
