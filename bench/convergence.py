"""Time to reward: ``colocate bench --convergence``, OPPO's own headline metric.

Runs ``sequential`` and ``oppo`` (by default), plus any named variants (config
overrides, e.g. a critic-free estimator: ``--variant "grpo ppo.advantage=grpo
rollout.group_size=4 ppo.kl_in=loss"``, sequential unless they set a mode), for N steps each on the default task
(sentiment prompts, the reward model; the preset's models), one after the other, each a
plain ``colocate train`` run with the same seeds and a held-out evaluation every few
steps, and compares held-out reward against training seconds: the cumulative ``step_s``
of the run's steps up to each evaluation (evaluations, checkpoints and engine start are
not training and are left out; they cost every mode the same). The target is the
sequential run's final held-out reward; each mode's time to reward is the training time
at its first evaluation at or above it ("not reached" otherwise). Between steps the
contention guard records the others' CPU load and can wait for a quiet machine. Each run's
median step time, training state (``mem/train_state_mb``) and peak resident memory
(``mem/rss_mb``) are reported beside it. With ``seeds`` > 1 every mode and variant runs once
per seed (``run.seed`` s, s+1, ...; seed after seed, each seed's runs side by side), each seed's
runs are compared against that seed's base run (its own target), and the report gives the
median and range over the seeds: final reward, time to target (and how many seeds reached
it), speed-up, and the evaluations where a run's best seed is below the base's worst (below
beyond the seeds' spread).

Owns: the runs' configs, running them, the curve and time-to-reward arithmetic (pure
functions), the markdown section. Leaves out: the plot (``bench.plots``), throughput.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from colocate.bench import contention
from colocate.bench.contention import GuardOptions


@dataclasses.dataclass(frozen=True)
class ConvergenceOptions:
    steps: int = 30  # PPO steps per mode
    eval_every: int = 3  # held-out evaluation every N steps (and at 0 and the end)
    modes: tuple[str, ...] = ("sequential", "oppo")
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()  # extra runs: (name, config overrides)
    seeds: int = 1  # runs of each mode and variant, under run.seed s, s+1, ... (median and range when > 1)


def curve(metrics: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """[{step, seconds, reward}] per finite evaluation: seconds = sum of ``step_s`` of the
    steps up to and including the evaluated one (0 at step 0)."""
    elapsed, total = {0: 0.0}, 0.0
    for rec in sorted((m for m in metrics if "step_s" in m), key=lambda m: m["step"]):
        total += rec["step_s"]
        elapsed[rec["step"]] = total
    return [{"step": e["step"], "seconds": elapsed[e["step"]], "reward": e["reward_mean"]}
            for e in evals if e["step"] in elapsed and math.isfinite(e.get("reward_mean", math.nan))]


def time_to_reward(points: Sequence[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose reward is at least ``target``; None if none is."""
    for p in sorted(points, key=lambda p: p["seconds"]):
        if p["reward"] >= target:
            return p["seconds"]
    return None


def summarize(curves: dict[str, list[dict[str, float]]], contended: dict[str, int] | None = None,
              base: str = "sequential", metrics: dict[str, Sequence[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Target (``base``'s final held-out reward) and, per mode: final reward, time to the
    target, total training seconds, speed-up in time to reward over ``base``; with
    ``metrics`` (each run's metrics.jsonl records) also the median step seconds and the
    peak RSS."""
    target = curves[base][-1]["reward"] if curves.get(base) else math.nan
    modes: dict[str, Any] = {}
    for mode, points in curves.items():
        reached = time_to_reward(points, target) if points and math.isfinite(target) else None
        modes[mode] = {"final_reward": points[-1]["reward"] if points else math.nan,
                       "train_seconds": points[-1]["seconds"] if points else math.nan,
                       "steps": points[-1]["step"] if points else 0, "evals": len(points),
                       "time_to_target_s": reached, "contended_steps": (contended or {}).get(mode, 0)}
    base_time = modes.get(base, {}).get("time_to_target_s")
    for m in modes.values():
        t = m["time_to_target_s"]
        m["speedup_vs_base"] = base_time / t if base_time and t else None
    for mode, recs in (metrics or {}).items():
        if mode in modes:
            steps = sorted(r["step_s"] for r in recs if "step_s" in r and "skipped" not in r)
            modes[mode]["step_s_median"] = statistics.median(steps) if steps else math.nan
            modes[mode]["rss_mb_peak"] = max((r.get("mem/rss_mb", math.nan) for r in recs), default=math.nan)
            modes[mode]["train_state_mb"] = max((r.get("mem/train_state_mb", math.nan) for r in recs),
                                                default=math.nan)
    return {"base": base, "target": target, "modes": modes}


def markdown(summary: dict[str, Any], plot: str | None = None) -> str:
    """The report section: target, then one row per mode."""
    lines = ["### time to reward (default task, held-out reward)", "",
             f"target: `{summary['base']}`'s final held-out reward, {summary['target']:+.3f}. "
             "Seconds are training seconds (sum of step times up to the evaluation; evaluations "
             "and engine start left out).", "",
             f"| mode | steps | final held-out reward | training s | time to target s | speed-up vs {summary['base']} "
             "| contended steps |", "|---|---|---|---|---|---|---|"]
    for mode, m in summary["modes"].items():
        reached = f"{m['time_to_target_s']:.1f}" if m["time_to_target_s"] is not None else "not reached"
        speed = f"{m['speedup_vs_base']:.2f}x" if m["speedup_vs_base"] else "–"
        lines.append(f"| {mode} | {m['steps']} | {m['final_reward']:+.3f} | {m['train_seconds']:.1f} | "
                     f"{reached} | {speed} | {m['contended_steps']} |")
    if any("step_s_median" in m for m in summary["modes"].values()):
        lines += ["", "| run | median step s | training state MB | peak RSS MB (process tree) |", "|---|---|---|---|"]
        lines += [f"| {mode} | {m['step_s_median']:.1f} | {m['train_state_mb']:.0f} | {m['rss_mb_peak']:.0f} |"
                  for mode, m in summary["modes"].items() if "step_s_median" in m]
        lines += ["", "Training state: parameters, gradients and optimizer moments the trainer holds (exact, "
                  "per run). The runs share one process, one after the other, so a later run's RSS can "
                  "still hold memory an earlier one freed: compare memory by the training state."]
    if plot:
        lines += ["", f"![convergence]({plot})"]
    return "\n".join(lines)


def run_key(name: str, seed: int, seeds: int) -> str:
    """The run of mode or variant ``name`` under the ``seed``-th seed (0-based): the name
    alone with one seed."""
    return name if seeds == 1 else f"{name}-seed{seed}"


def configs(conv: ConvergenceOptions, base_overrides: Sequence[str], out: Path) -> dict[str, Any]:
    """One config per mode and per variant (per seed: :func:`run_key`, seed after seed):
    the default task with ``base_overrides`` (models, chunk, Δ, the user's), N steps,
    evaluation every ``eval_every``, no checkpoints; a variant's overrides last
    (sequential unless they name a mode); the k-th seed is ``run.seed`` + k."""
    from colocate.config import load_config

    names = [*conv.modes]
    for name, _ in conv.variants:
        if name in names:
            raise ValueError(f"--variant {name!r}: the name of a mode or another variant")
        names.append(name)
    extra = {**{m: (f"overlap.mode={m}",) for m in conv.modes},
             **{name: ("overlap.mode=sequential", *x) for name, x in conv.variants}}
    first = load_config(overrides=list(base_overrides)).run.seed if conv.seeds > 1 else 0
    runs = {}
    for k in range(conv.seeds):
        seed = (f"run.seed={first + k}",) if conv.seeds > 1 else ()
        for name in names:
            key = run_key(name, k, conv.seeds)
            runs[key] = load_config(overrides=[
                *base_overrides, f"run.out_dir={out / f'convergence-{key}'}", f"run.steps={conv.steps}",
                f"run.eval_every={conv.eval_every}", "run.save_every=0",
                "run.overwrite_out_dir=true",  # the bench's own folder: a rerun into the same --out replaces the run
                *seed, *extra[name]])
    return runs


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max of ``values`` (None when there are none)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def below_base(runs: Sequence[Sequence[dict[str, float]]], base: Sequence[Sequence[dict[str, float]]]) -> list[int]:
    """The evaluation steps (held by every seed of both) where the best of ``runs``' seeds
    is below the worst of ``base``'s: below beyond the seeds' spread."""
    def by_step(curves):
        return [{p["step"]: p["reward"] for p in points} for points in curves]

    mine, theirs = by_step(runs), by_step(base)
    steps = set.intersection(*(set(c) for c in mine + theirs)) if mine and theirs else set()
    return [k for k in sorted(steps) if max(c[k] for c in mine) < min(c[k] for c in theirs)]


def summarize_seeds(curves: dict[str, list[dict[str, float]]], conv: ConvergenceOptions,
                    contended: dict[str, int] | None = None,
                    metrics: dict[str, Sequence[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Each seed's :func:`summarize` (its base run's final reward its target), then per mode
    and variant the median and range over the seeds (:func:`spread`) of the final reward,
    the time to target (over the seeds that reached it; ``reached`` counts them), the
    speed-up over the base and the median step seconds, the contended steps summed, and
    :func:`below_base`."""
    names = [*conv.modes, *(name for name, _ in conv.variants)]
    base = names[0]
    per_seed = []
    for k in range(conv.seeds):
        keys = {name: run_key(name, k, conv.seeds) for name in names}
        per_seed.append(summarize({n: curves[key] for n, key in keys.items()},
                                  {n: (contended or {}).get(key, 0) for n, key in keys.items()}, base=base,
                                  metrics={n: metrics[key] for n, key in keys.items()} if metrics else None))
    modes = {}
    for name in names:
        rows = [s["modes"][name] for s in per_seed]
        times = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
        modes[name] = {
            "final_reward": spread([r["final_reward"] for r in rows]), "time_to_target_s": spread(times),
            "reached": len(times), "speedup_vs_base": spread([r["speedup_vs_base"] for r in rows
                                                              if r["speedup_vs_base"] is not None]),
            "step_s_median": spread([r["step_s_median"] for r in rows if "step_s_median" in r]),
            "contended_steps": sum(r["contended_steps"] for r in rows),
            "below_base_at": below_base([curves[run_key(name, k, conv.seeds)] for k in range(conv.seeds)],
                                        [curves[run_key(base, k, conv.seeds)] for k in range(conv.seeds)])}
    return {"base": base, "seeds": conv.seeds, "targets": [s["target"] for s in per_seed], "per_seed": per_seed,
            "modes": modes}


def markdown_seeds(summary: dict[str, Any], plot: str | None = None) -> str:
    """The report section over seeds: one row per mode and variant, median [min–max]."""
    def fmt(s: dict[str, float] | None, f: str, unit: str = "") -> str:
        if s is None:
            return "–"
        return f"{s['median']:{f}}{unit} [{s['min']:{f}}{unit}–{s['max']:{f}}{unit}]"

    base, n = summary["base"], summary["seeds"]
    targets = ", ".join(f"{t:+.3f}" for t in summary["targets"])
    lines = ["### time to reward (default task, held-out reward)", "",
             f"{n} seeds; each seed's target is its `{base}` run's final held-out reward ({targets}). Seconds are "
             "training seconds (sum of step times up to the evaluation; evaluations and engine start left out). "
             "Median [min–max] over the seeds.", "",
             f"| run | final held-out reward | time to target s | reached | speed-up vs {base} | median step s "
             f"| below {base} beyond the spread at steps | contended steps |", "|---|---|---|---|---|---|---|---|"]
    for name, m in summary["modes"].items():
        below = ", ".join(str(k) for k in m["below_base_at"]) or "none"
        lines.append(f"| {name} | {fmt(m['final_reward'], '+.3f')} | {fmt(m['time_to_target_s'], '.1f')} | "
                     f"{m['reached']}/{n} | {fmt(m['speedup_vs_base'], '.2f', 'x')} | {fmt(m['step_s_median'], '.1f')} "
                     f"| {below} | {m['contended_steps']} |")
    if plot:
        lines += ["", f"![convergence]({plot})"]
    return "\n".join(lines)


def run_mode(cfg, guard: GuardOptions | None, log: Callable[[str], None], name: str = "") -> dict[str, Any]:
    """One ``colocate train`` run; its metrics, evaluations and per-step others' load."""
    from colocate.run import builder, loop
    from colocate.monitor.metrics import read

    session = builder.build(cfg, log=lambda m: None, claim=True)  # the run's folder held, as colocate train's
    tracker = _LoadTracker(guard)
    try:
        loop.train(session, callbacks=[tracker], progress=lambda r: log(
            f"  {name or cfg.overlap.mode:<10} step {r['step']}/{cfg.run.steps}: {r['step_s']:.2f} s"))
    finally:
        session.close()
    out = Path(cfg.run.out_dir)
    return {"metrics": read(out / "metrics.jsonl"), "evals": read(out / "eval.jsonl"), "loads": tracker.loads}


class _LoadTracker:
    """Step callback: the others' load since the previous step ended (the step, and the
    evaluation before it when one ran), then a bounded wait for a quiet machine."""

    def __init__(self, guard: GuardOptions | None) -> None:
        self.guard, self.loads = guard, []
        self.last = contention.snapshot() if guard else None

    def __call__(self, rec: dict[str, Any]) -> None:
        if self.guard is None:
            return
        load = contention.others_load(self.last, contention.snapshot())
        self.loads.append({"step": rec.get("step"), "others_cores": load.others_cores,
                           "contended": contention.contended(load, self.guard.limit_cores)})
        contention.wait_for_quiet(self.guard)
        self.last = contention.snapshot()
