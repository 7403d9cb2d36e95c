"""``colocate train --check``: every check a run makes before its first engine starts,
and nothing else.

Owns: :func:`check` (the config's environment, the device's choices, the run folder
(``colocate.run.run_folder``: no earlier run's records, no other run holding it), then
``builder.start_inputs`` — models (and whether SGLang can load them), remote code, world
size, reward functions, prompts loaded and tokenized against ``data.max_prompt_tokens``,
prompt + budget against each engine's context and KV pool — for rank 0 of ``--nproc``
processes on one node) and its one-line :class:`CheckReport`.

Leaves out: what only a started run knows (engines' refusals, a checkpoint's tensors
against the models: ``colocate.run.session``); building a reward model alias that is not
built yet (minutes: it is named as not checked instead); starting torchrun.
"""

from __future__ import annotations

import dataclasses

import torch

from colocate.config import Config
from colocate.monitor.wandb_log import check_available
from colocate.rollout.env import Environment
from colocate.rollout.evaluation import held_out_note
from colocate.run.builder import checked_device, environment, start_inputs
from colocate.run import run_folder
from colocate.run.placement import Placement


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What :func:`check` found: prompt counts, the longest prompt, what it left unchecked or
    the run would say at start-up (``notes``)."""

    cfg: Config
    prompts: int
    held_out: int
    longest: int
    nproc: int = 1
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        c = self.cfg
        ranks = f" over {self.nproc} processes" if self.nproc > 1 else ""
        env = f", rollout.env {c.rollout.env}" if c.rollout.env else ""
        line = (f"check ok: {self.prompts} training + {self.held_out} held-out prompts from {c.data.source} "
                f"(longest {self.longest} tokens, data.max_prompt_tokens {c.data.max_prompt_tokens}) + "
                f"rollout.max_new_tokens {c.rollout.max_new_tokens} fit the engines{ranks}{env}; no engine started")
        return line + "".join(f"; {u}" for u in self.notes)


def check(cfg: Config, *, nproc: int = 1, env: Environment | None = None, resume=None) -> CheckReport:
    """The checks ``builder.build`` makes before an engine starts, for rank 0 of ``nproc``
    processes on this node, with no engine, trainer or process group started; each refusal
    is the same one line a run gives. ``env``: the API's environment (else ``rollout.env``'s);
    ``resume``: the run folder or checkpoint the run would continue."""
    check_available(cfg.run)
    env = environment(cfg, env)
    device = checked_device(cfg)
    run_folder.check(cfg, resume)  # an earlier run's records, another run holding the folder
    placement = Placement(world=nproc, local_world=nproc, tp_size=cfg.engines.tp_size,
                          visible_gpus=torch.cuda.device_count() if device == "cuda" else 0)
    left_out: list[str] = []  # data.filter_overlong_prompts: how many prompts it leaves out
    inputs = start_inputs(cfg, env, placement, nproc, build_models=False, log=left_out.append)
    notes = tuple(left_out)
    if cfg.reward.kind == "model" and inputs.reward_path is None:
        notes = (f"models.reward {cfg.models.reward} is not built yet (the first run builds it once), "
                 "so the prompts are not checked against its context",)
    every = inputs.prompts + inputs.eval_prompts
    capped = cfg.run.eval_every > 0 and held_out_note(cfg.data.eval_prompts, len(inputs.eval_prompts), len(every))
    return CheckReport(cfg, len(inputs.prompts), len(inputs.eval_prompts),
                       max((len(p.ids) for p in every), default=0), nproc, notes + ((capped,) if capped else ()))
