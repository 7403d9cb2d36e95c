"""`colocate bench`: every workload, every mode side by side, the TRL peer, one report.

Owns: resolving the preset into configs, running each workload (``bench.runner``), the
TRL peer in a subprocess (its own process, so neither run shares threads or memory; same
models, prompt source, cap and EOS rule as the workload; TRL's GRPO when the workload's
estimator is critic-free, its classic PPO otherwise), the time-to-reward study
instead when asked (``--convergence``, ``bench.convergence``), and writing ``report.md``,
``results.json`` and the plots into the run folder (after every workload, so a run cut
off keeps what it finished). Under a time budget (``--budget-s``: one lent GPU call,
scripts/gpu_bench.sh) a workload runs its modes first in the order given, keeping room for
its TRL peer, then the peer; a mode or workload that no longer fits is left out and the
report says so.
Leaves out: what a mode does (``colocate``), the numbers' meaning (``bench.report``), the
contention accounting (``bench.contention``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from colocate.bench import contention, convergence, limit, plots, report, requests, runner
from colocate.bench.contention import GuardOptions, guarded
from colocate.bench.convergence import ConvergenceOptions
from colocate.bench.models import shaped_models
from colocate.errors import ConfigError
from colocate.bench.workloads import (MODES, MULTI_TURN, PRESETS, Preset, small_models, workload_models, workload_overrides,
                                      workload_reward_fns)
from colocate.run.builder import run_device, trainer_dtype
from colocate.trainer.estimators import CRITIC_FREE

SENTIMENT = "sentiment-prompts"


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    preset: str = "quick"
    workloads: tuple[str, ...] = ()  # () : the preset's
    modes: tuple[str, ...] = MODES
    repeats: int = 0  # 0: the preset's
    steps: int = 0
    peer: bool = True
    out_dir: str = ""
    chunk_size: int = 16
    delta: int = 2
    overrides: tuple[str, ...] = ()  # config overrides of every run, after the preset's (--set)
    batch_size: int = 0  # 0: the preset's (colocate's rollout.batch_size and the TRL peer's batch)
    max_new_tokens: int = 0  # 0: the preset's cap (colocate's and the TRL peer's)
    shape: str = ""  # a MODEL_SHAPES name: random actor and reward model of that shape ("": the preset's models)
    budget_s: float = 0.0  # seconds for the whole bench (0: no limit): what does not fit is left out
    peer_dtype: str = ""  # the TRL peers' precision; "": the one colocate's trainer computes in (like for like)
    guard: GuardOptions = GuardOptions()
    convergence: ConvergenceOptions | None = None  # set: run the time-to-reward study instead


def _preset(opts: BenchOptions) -> Preset:
    p = PRESETS[opts.preset]
    repeats, steps = opts.repeats or p.repeats, opts.steps or p.steps
    # the TRL peer is timed over as many measured rounds as each mode's measured steps (at
    # least 4, after its warm-up), so its spread is as well sampled as colocate's
    return dataclasses.replace(p, workloads=opts.workloads or p.workloads, repeats=repeats, steps=steps,
                               models=opts.shape or p.models, batch_size=opts.batch_size or p.batch_size,
                               max_new_tokens=opts.max_new_tokens or p.max_new_tokens,
                               peer_updates=p.peer_updates and peer_rounds(repeats, steps, p.peer_min_updates))


def peer_rounds(repeats: int, steps: int, least: int = 4) -> int:
    """Measured TRL updates of a bench: colocate's measured steps per mode, at least ``least``."""
    return max(least, repeats * steps)


# Seconds a TRL peer is given at least under a budget (else it is left out), and kept free
# for it while its workload's modes run (the gpu preset's: TRL's import and models, then a
# warm-up and 2 updates of HF generate, 64 x 1,024 tokens, estimated at ~30-40 s each)
PEER_MIN_S = 30.0
PEER_RESERVE_S = {"gpu": 150.0}


def _models(preset: Preset, out: Path) -> tuple[str, str]:
    if preset.models == "small":
        return small_models(out.parent / ".bench-models")
    from colocate.assets.random_models import MODEL_SHAPES

    if preset.models in MODEL_SHAPES:
        return shaped_models(out.parent / ".bench-models", preset.models)
    from colocate.api import prepare

    paths = prepare(with_reward_model=True)
    return str(paths["smollm2"]), str(paths["sentiment-rm"])


def _common(opts: BenchOptions, actor: str, rm: str) -> list[str]:
    """Overrides every bench run shares: models, fixed chunk and Δ, no evaluation."""
    return [f"models.actor={actor}", f"models.reward={rm}", "data.max_prompt_tokens=512", "run.eval_every=0",
            "run.timeline=true",
            f"overlap.chunk_size={opts.chunk_size}", f"overlap.delta_init={opts.delta}",
            "overlap.delta_adaptive=false", f"overlap.delta_max={max(opts.delta, 1)}"]


def _config(preset: Preset, opts: BenchOptions, workload: str, actor: str, rm: str, out: Path):
    from colocate.config import load_config

    return load_config(overrides=[*_common(opts, actor, rm), f"run.out_dir={out / workload}",
                                  *workload_overrides(preset, workload), *opts.overrides])


def _check_configs(preset: Preset, opts: BenchOptions, out: Path) -> None:
    """Every run's config loaded once, with stand-in model paths (the models are built, or
    prepared, after this): a config the user's overrides make invalid is refused before
    minutes of model building, and under a budget, before it is spent."""
    if opts.convergence is not None:
        convergence.configs(opts.convergence, [*_common(opts, "actor", "rm"), *PRESETS[opts.preset].overrides,
                                               *opts.overrides], out)
        return
    for workload in preset.workloads:
        _config(preset, opts, workload, "actor", "rm", out)


def peer_shape(preset: Preset, workload: str) -> tuple[int, bool]:
    """(max new tokens, stop at EOS) of the TRL run matching ``workload``: TRL has one
    response length per batch, so ``short`` runs at its short fixed length, ``task`` and
    ``reasoning`` stop at EOS like colocate (same cap), and the synthetic long-tail
    workloads run to the cap (TRL generates the batch until its longest response ends;
    the report compares tokens/s too)."""
    return preset.tokens(workload), workload in ("task", "reasoning")


def peer_group(cfg) -> int:
    """Group size of the TRL peer matching ``cfg``: ``rollout.group_size`` when its estimator
    is critic-free (``ppo.advantage`` in grpo/rloo/reinforce_baseline: TRL's GRPO runs), 0
    otherwise (TRL's classic PPO, with a critic)."""
    return cfg.rollout.group_size if cfg.ppo.advantage in CRITIC_FREE else 0


def peer_key(tokens: int, stop_at_eos: bool, source: str, group_size: int = 0) -> str:
    """Name of one TRL run in ``peer_raw`` and of its folder: ``[grpo<N>-]<tokens>[-eos][-<task>]``
    (the prefix: TRL's GRPO with groups of N)."""
    return (f"{f'grpo{group_size}-' if group_size else ''}{tokens}{'-eos' if stop_at_eos else ''}"
            f"{'' if source == SENTIMENT else '-' + source.split(':')[-1]}")


def _peer_command(actor: str, rm: str, preset: Preset, out: Path, new_tokens: int, stop_at_eos: bool,
                  epochs: int, minibatches: int, source: str, group_size: int, beta: float | None,
                  dtype: str = "float32", micro_batch: int = 0) -> list[str]:
    module = "trl_grpo" if group_size else "trl_ppo"
    cmd = [sys.executable, "-m", f"colocate.bench.peers.{module}", "--actor", actor, "--reward", rm,
           "--batch", str(preset.batch_size), "--new-tokens", str(new_tokens),
           "--updates", str(preset.peer_updates), "--epochs", str(epochs),
           "--minibatches", str(minibatches), "--source", source, "--out", str(out)]
    if group_size:
        cmd += ["--group-size", str(group_size), *(["--beta", str(beta)] if beta is not None else [])]
    cmd += ["--micro-batch", str(micro_batch)] if micro_batch else []
    return cmd + (["--stop-at-eos"] if stop_at_eos else []) + (["--bf16"] if dtype == "bfloat16" else [])


def peer_dtype(trainer_dtype: str) -> str:
    """The TRL peers' precision for a colocate trainer computing in ``trainer_dtype``: the same
    where TRL has it (bfloat16, float32); float16 (TRL's fp16 uses a loss scaler colocate's
    trainer has not) falls back to float32, which the report then flags."""
    return trainer_dtype if trainer_dtype in ("float32", "bfloat16") else "float32"


def run_peer(actor: str, rm: str, preset: Preset, out: Path, log, *, new_tokens: int | None = None,
             stop_at_eos: bool = False, epochs: int = 1, minibatches: int = 2, source: str = SENTIMENT,
             group_size: int = 0, beta: float | None = None, dtype: str = "float32", micro_batch: int = 0,
             guard: GuardOptions | None = None, timeout_s: float | None = None) -> dict[str, Any] | None:
    """TRL's PPO (``group_size`` 0) or GRPO (groups of ``group_size``, KL coefficient
    ``beta``, None: colocate's default ``ppo.kl_coef``) on the same models, prompts, batch
    and epochs/minibatches, computing in ``dtype`` (float32 or bfloat16), in a subprocess
    (under the contention guard: the others' load is in ``contention``), stopped after
    ``timeout_s`` (None: never), ``micro_batch`` samples a forward pass (0: a minibatch); None
    if unavailable or out of time."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the TRL peers compute in float32 or bfloat16, not {dtype}")
    new_tokens = new_tokens or preset.max_new_tokens
    cmd = _peer_command(actor, rm, preset, out, new_tokens, stop_at_eos, epochs, minibatches, source,
                        group_size, beta, dtype, micro_batch)
    log(f"TRL peer ({f'GRPO, groups of {group_size}' if group_size else 'PPO'}): {preset.peer_updates} updates "
        f"of {preset.batch_size} × {new_tokens} tokens from {source}, "
        f"{epochs} epochs × {minibatches} minibatches" + (f" of {micro_batch}-sample passes" if micro_batch else "")
        + f", {dtype}" + (" (stop at EOS)" if stop_at_eos else ""))
    try:
        proc, load = guarded(lambda: subprocess.run(cmd, cwd=str(Path(__file__).resolve().parents[1]),
                                                    capture_output=True, text=True, timeout=timeout_s), guard)
    except subprocess.TimeoutExpired:
        log(f"TRL peer unavailable: out of time (stopped after {timeout_s:.0f} s)")
        return None
    result = out / "trl_result.json"
    if proc.returncode != 0 or not result.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        log(f"TRL peer unavailable: {tail[0]}")
        return None
    data = json.loads(result.read_text())
    data["batch_size"] = preset.batch_size
    data["new_tokens"], data["stop_at_eos"], data["source"], data["contention"] = new_tokens, stop_at_eos, source, load
    data["dtype"] = dtype
    return data


def environment() -> dict[str, str]:
    """Where and on what the numbers were taken: date, commit, versions, device, cores."""
    from colocate.tools.doctor import collect_facts

    root = Path(__file__).resolve().parents[1]
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True)
    facts = collect_facts()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "commit": git.stdout.strip() if git.returncode == 0 else "unknown (not a git checkout)",
            **{k: facts[k] for k in ("device", "cpu cores (torch threads)", "sglang", "torch", "transformers")}}


def run(opts: BenchOptions, log: Callable[[str], None] = print) -> Path:
    deadline = time.monotonic() + opts.budget_s if opts.budget_s > 0 else None  # the models' build counts
    preset = _preset(opts)
    out = Path(opts.out_dir or f"runs/bench-{preset.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "a file is there" if out.exists() or any(f.is_file() for f in out.parents) else os.strerror(exc.errno or 0)
        raise ConfigError(f"--out '{out}': cannot make the report folder ({why.lower()}); give a folder you can "
                          "write") from None
    _check_configs(preset, opts, out)  # a bad --set, --delta or --chunk-size: one line before any model is built
    actor, rm = _models(preset, out)
    env = environment()
    guard = opts.guard if contention.available() else None
    results: dict[str, Any] = {"preset": dataclasses.asdict(preset), "options": dataclasses.asdict(opts),
                               "environment": env, "models": {"actor": actor, "reward": rm}, "workloads": {}}
    sections = _header(preset, opts, env, actor, rm, guard)
    if opts.convergence is not None:
        sections += _convergence(opts, actor, rm, out, guard, results, log)
    else:
        peers: dict[tuple[int, bool, str, int], dict[str, Any] | None] = {}
        for workload in preset.workloads:
            if deadline is not None and deadline - time.monotonic() < PEER_MIN_S:
                log(f"workload {workload}: left out, {deadline - time.monotonic():.0f} s of the budget left")
                sections += [f"### workload `{workload}`", "",
                             f"Left out: the {opts.budget_s:.0f} s budget was spent.", ""]
                continue
            sections += _workload(preset, opts, workload, (actor, rm), out, guard, peers, results, log, deadline)
            results["peer_raw"] = {peer_key(*k): p for k, p in peers.items()}
            _write(out, results, sections)  # after every workload: a run cut off keeps what it finished
    _write(out, results, sections)
    return out


def _write(out: Path, results: dict[str, Any], sections: list[str]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "report.md").write_text("\n".join(sections))


def _header(preset: Preset, opts: BenchOptions, env: dict[str, str], actor: str, rm: str,
            guard: GuardOptions | None) -> list[str]:
    what = (f"time to reward: {' vs '.join(opts.convergence.modes)}, {opts.convergence.steps} steps each, "
            f"held-out evaluation every {opts.convergence.eval_every}" if opts.convergence is not None else
            f"batch {preset.batch_size}; {preset.repeats} repeats × {preset.steps} measured steps per mode "
            "(after 1 warm-up), modes interleaved in rotated order")
    extra = [*preset.overrides, *opts.overrides]
    return [f"# colocate bench — preset `{preset.name}`", "",
            f"{env['date']}, commit `{env['commit']}`; {env['device']}, "
            f"{env['cpu cores (torch threads)']} torch threads; sglang {env['sglang']}, "
            f"torch {env['torch']}, transformers {env['transformers']}.", "",
            f"models: actor `{actor}`, reward `{rm}`; {what}; chunk {opts.chunk_size}, Δ {opts.delta}"
            + (f"; overrides `{' '.join(extra)}`" if extra else "") + ".", "",
            *([preset.note, ""] if preset.note else []),
            *([f"budget: {opts.budget_s:.0f} s for the whole bench; modes run in the order "
               f"{', '.join(opts.modes)}, each workload's TRL peer after its modes; what did not fit is left out "
               "and named below.", ""] if opts.budget_s > 0 else []),
            (f"contention guard: a step is contended when other processes use more than {guard.limit_cores:g} "
             f"cores on average during it; up to {guard.quiet_wait_s:g} s of waiting for a quiet machine "
             "before each step." if guard else "contention guard: off (no /proc/stat here)."), ""]


def _workload(preset: Preset, opts: BenchOptions, workload: str, models: tuple[str, str], out: Path,
              guard: GuardOptions | None, peers: dict, results: dict[str, Any], log,
              deadline: float | None = None) -> list[str]:
    """Run one workload and its TRL peer (when not run yet: before the modes, or under a
    ``deadline`` after them, in the time kept for it); its report section."""
    actor, rm = workload_models(preset, workload, *models)
    cfg = _config(preset, opts, workload, actor, rm, out)
    dtype = trainer_dtype(cfg, run_device(cfg))
    key = None
    if opts.peer and preset.peer_updates and workload not in MULTI_TURN:  # TRL's PPO has no environment loop
        key = (*peer_shape(preset, workload), preset.source(workload), peer_group(cfg))
    if key is not None and key not in peers and deadline is None:
        peers[key] = _key_peer(key, cfg, preset, opts, (actor, rm), out, dtype, guard, log)
    log(f"workload {workload}")
    reserve = PEER_RESERVE_S.get(preset.name, PEER_MIN_S) if key is not None and key not in peers else 0.0
    data = runner.run_workload(cfg, opts.modes, preset.repeats, preset.steps, log, limit.probe,
                               reward_fns=workload_reward_fns(cfg), guard=guard,
                               journal=out / f"{workload}_steps.jsonl", deadline=deadline, reserve_s=reserve)
    if key is not None and key not in peers:
        left = deadline - time.monotonic()
        peers[key] = None
        if left >= PEER_MIN_S:
            peers[key] = _key_peer(key, cfg, preset, opts, (actor, rm), out, dtype, guard, log, timeout_s=left)
        else:
            log(f"TRL peer left out: {left:.0f} s of the budget left")
    peer = peers.get(key) if key is not None else None
    summary = report.summarize(data["records"], data["probe"], opts.modes)
    peer_info = report.peer_ratio(summary, peer)
    if peer_info:
        peer_info["trl_version"] = peer.get("trl_version", "?")
        peer_info["contention"] = peer.get("contention") or {}
        # the report flags a run whose peer computed in another precision than colocate's trainer
        peer_info["colocate_dtype"], peer_info["trl_dtype"] = dtype, peer.get("dtype", "float32")
    kept, _ = report.uncontended(data["records"], opts.modes)
    _draw(log, plots.gantt, kept, opts.modes, out / f"{workload}_timeline.png", f"{workload}: median step per mode")
    _draw(log, plots.reward_curve, data["records"], opts.modes, out / f"{workload}_reward.png",
          f"{workload}: reward vs wall-clock")
    events = _read_jsonl(out / f"{workload}_requests.jsonl")
    where = requests.summary(events, opts.modes)
    _draw(log, requests.plot, events, opts.modes, out / f"{workload}_requests.png",
          f"{workload}: requests of one step per mode")
    results["workloads"][workload] = {**data, "models": {"actor": actor, "reward": rm}, "summary": summary,
                                      "peer": peer_info, "requests": where}
    return [report.markdown(workload, summary, peer_info, data["probe"], guard.limit_cores if guard else None), "",
            *_left_out_lines(data.get("left_out", []), key, peer),
            f"![timeline]({workload}_timeline.png) ![reward]({workload}_reward.png)", "",
            "Where the rollout's seconds go (medians over measured steps; from the request timeline):", "",
            *requests.markdown(where), "", f"![requests]({workload}_requests.png)", ""]


def _key_peer(key: tuple, cfg, preset: Preset, opts: BenchOptions, models: tuple[str, str], out: Path, dtype: str,
              guard: GuardOptions | None, log, timeout_s: float | None = None) -> dict[str, Any] | None:
    """The TRL run of peer ``key`` (see ``peer_key``) matching ``cfg``'s trainer: its
    precision, and forward passes no larger than its packed micro-batches."""
    import torch

    from colocate.bench.peers.trl_ppo import peer_micro_batch
    from colocate.run.builder import trainer_settings

    budget = trainer_settings(cfg, "", "", torch.device(run_device(cfg))).token_budget
    micro = peer_micro_batch(preset.batch_size // cfg.ppo.minibatches, key[0], budget)
    return run_peer(*models, preset, out / f"trl-{peer_key(*key)}", log, new_tokens=key[0], stop_at_eos=key[1],
                    epochs=cfg.ppo.epochs, minibatches=cfg.ppo.minibatches, source=key[2], group_size=key[3],
                    beta=cfg.ppo.kl_coef, dtype=opts.peer_dtype or peer_dtype(dtype), micro_batch=micro, guard=guard,
                    timeout_s=timeout_s)


def _left_out_lines(left_out: list[dict[str, Any]], key: tuple | None, peer: dict[str, Any] | None) -> list[str]:
    """Report lines naming what a budget left out, and a TRL peer that did not run or finish."""
    lines = []
    if left_out:
        lines += [f"Left out (the budget was spent): {', '.join(sorted({r['mode'] for r in left_out}))}.", ""]
    if key is not None and peer is None:
        lines += [f"TRL {'GRPO' if key[3] else 'PPO'} peer: no result (unavailable or out of budget; the log says "
                  "which).", ""]
    return lines


def _draw(log, plot: Callable[..., Any], *args) -> None:
    """One plot of the report; one that fails is named in one line and the report (the
    measured numbers) is still written: on the GPU kit a plot once took the whole report down."""
    try:
        plot(*args)
    except Exception as exc:  # matplotlib's own failures are of any type
        log(f"plot {Path(args[-2]).name} not drawn: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _convergence(opts: BenchOptions, actor: str, rm: str, out: Path, guard: GuardOptions | None,
                 results: dict[str, Any], log) -> list[str]:
    """The time-to-reward study (``bench.convergence``); its report section."""
    conv = opts.convergence
    base = [*_common(opts, actor, rm), *PRESETS[opts.preset].overrides, *opts.overrides]
    runs = {}
    for mode, cfg in convergence.configs(conv, base, out).items():
        log(f"convergence: {mode}, {conv.steps} steps")
        runs[mode] = convergence.run_mode(cfg, guard, log, name=mode)
    curves = {m: convergence.curve(r["metrics"], r["evals"]) for m, r in runs.items()}
    contended = {m: sum(x["contended"] for x in r["loads"]) for m, r in runs.items()}
    metrics = {m: r["metrics"] for m, r in runs.items()}
    if conv.seeds > 1:
        summary = convergence.summarize_seeds(curves, conv, contended, metrics)
        target, section = statistics.median(summary["targets"]), convergence.markdown_seeds
    else:
        summary = convergence.summarize(curves, contended, base=conv.modes[0], metrics=metrics)
        target, section = summary["target"], convergence.markdown
    _draw(log, plots.convergence, curves, target, out / "convergence.png", "held-out reward vs training seconds")
    results["convergence"] = {"runs": runs, "curves": curves, "summary": summary}
    return [section(summary, "convergence.png"), ""]
