"""`colocate bench`: every workload, every mode side by side, the TRL peer, one report.

Owns: resolving the preset into configs, running each workload (``bench.runner``), the
TRL peer in a subprocess (its own process, so neither run shares threads or memory), and
writing ``report.md``, ``results.json`` and the plots into the run folder.
Leaves out: what a mode does (``colocate``), the numbers' meaning (``bench.report``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from colocate.bench import limit, plots, report, runner
from colocate.bench.workloads import MODES, PRESETS, Preset, small_models, workload_overrides


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


def _preset(opts: BenchOptions) -> Preset:
    p = PRESETS[opts.preset]
    return dataclasses.replace(p, workloads=opts.workloads or p.workloads,
                               repeats=opts.repeats or p.repeats, steps=opts.steps or p.steps)


def _models(preset: Preset, out: Path) -> tuple[str, str]:
    if preset.models == "small":
        return small_models(out.parent / ".bench-models")
    from colocate.api import prepare

    paths = prepare(with_reward_model=True)
    return str(paths["smollm2"]), str(paths["sentiment-rm"])


def _config(preset: Preset, opts: BenchOptions, workload: str, actor: str, rm: str, out: Path):
    from colocate.config import load_config

    return load_config(overrides=[
        f"models.actor={actor}", f"models.reward={rm}", f"run.out_dir={out / workload}",
        "data.max_prompt_tokens=512", "run.eval_every=0", f"overlap.chunk_size={opts.chunk_size}",
        f"overlap.delta_init={opts.delta}", "overlap.delta_adaptive=false",
        f"overlap.delta_max={max(opts.delta, 1)}", *workload_overrides(preset, workload)])


def peer_shape(preset: Preset, workload: str) -> tuple[int, bool]:
    """(max new tokens, stop at EOS) of the TRL run matching ``workload``: TRL has one
    response length per batch, so ``short`` runs at its short fixed length, ``task`` stops
    at EOS like colocate, and the long-tail workloads run to the cap (TRL generates the
    batch until its longest response ends; the report compares tokens/s too)."""
    if workload == "short":
        return preset.short_tokens(), False
    return preset.max_new_tokens, workload == "task"


def run_peer(actor: str, rm: str, preset: Preset, out: Path, log, *, new_tokens: int | None = None,
             stop_at_eos: bool = False, epochs: int = 1, minibatches: int = 2) -> dict[str, Any] | None:
    """TRL's PPO on the same models, batch and PPO epochs/minibatches, in a subprocess;
    None if unavailable."""
    new_tokens = new_tokens or preset.max_new_tokens
    cmd = [sys.executable, "-m", "colocate.bench.peers.trl_ppo", "--actor", actor, "--reward", rm,
           "--batch", str(preset.batch_size), "--new-tokens", str(new_tokens),
           "--updates", str(preset.peer_updates), "--epochs", str(epochs),
           "--minibatches", str(minibatches), "--out", str(out)]
    if stop_at_eos:
        cmd.append("--stop-at-eos")
    log(f"TRL peer: {preset.peer_updates} updates of {preset.batch_size} × {new_tokens} tokens, "
        f"{epochs} epochs × {minibatches} minibatches" + (" (stop at EOS)" if stop_at_eos else ""))
    proc = subprocess.run(cmd, cwd=str(Path(__file__).resolve().parents[1]), capture_output=True, text=True)
    result = out / "trl_result.json"
    if proc.returncode != 0 or not result.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        log(f"TRL peer unavailable: {tail[0]}")
        return None
    data = json.loads(result.read_text())
    data["batch_size"] = preset.batch_size
    data["new_tokens"], data["stop_at_eos"] = new_tokens, stop_at_eos
    return data


def environment() -> dict[str, str]:
    """Where and on what the numbers were taken: date, commit, versions, device, cores."""
    from colocate.doctor import collect_facts

    root = Path(__file__).resolve().parents[1]
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True)
    facts = collect_facts()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "commit": git.stdout.strip() if git.returncode == 0 else "unknown (not a git checkout)",
            **{k: facts[k] for k in ("device", "cpu cores (torch threads)", "sglang", "torch", "transformers")}}


def run(opts: BenchOptions, log: Callable[[str], None] = print) -> Path:
    preset = _preset(opts)
    out = Path(opts.out_dir or f"runs/bench-{preset.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    actor, rm = _models(preset, out)
    env = environment()
    results: dict[str, Any] = {"preset": dataclasses.asdict(preset), "options": dataclasses.asdict(opts),
                               "environment": env, "models": {"actor": actor, "reward": rm}, "workloads": {}}
    sections = [f"# colocate bench — preset `{preset.name}`", "",
                f"{env['date']}, commit `{env['commit']}`; {env['device']}, "
                f"{env['cpu cores (torch threads)']} torch threads; sglang {env['sglang']}, "
                f"torch {env['torch']}, transformers {env['transformers']}.", "",
                f"models: actor `{actor}`, reward `{rm}`; batch {preset.batch_size}; "
                f"{preset.repeats} repeats × {preset.steps} measured steps per mode (after 1 warm-up), "
                f"modes interleaved in rotated order; chunk {opts.chunk_size}, Δ {opts.delta}.", ""]
    peers: dict[tuple[int, bool], dict[str, Any] | None] = {}
    for workload in preset.workloads:
        peer = None
        cfg = _config(preset, opts, workload, actor, rm, out)
        if opts.peer and preset.peer_updates:
            shape = peer_shape(preset, workload)
            if shape not in peers:
                peers[shape] = run_peer(actor, rm, preset, out / f"trl-{shape[0]}{'-eos' if shape[1] else ''}",
                                        log, new_tokens=shape[0], stop_at_eos=shape[1],
                                        epochs=cfg.ppo.epochs, minibatches=cfg.ppo.minibatches)
            peer = peers[shape]
        log(f"workload {workload}")
        data = runner.run_workload(cfg, opts.modes, preset.repeats, preset.steps, log, limit.probe)
        summary = report.summarize(data["records"], data["probe"], opts.modes)
        peer_info = report.peer_ratio(summary, peer)
        if peer_info:
            peer_info["trl_version"] = peer.get("trl_version", "?")
        plots.gantt(data["records"], opts.modes, out / f"{workload}_timeline.png", f"{workload}: median step per mode")
        plots.reward_curve(data["records"], opts.modes, out / f"{workload}_reward.png", f"{workload}: reward vs wall-clock")
        results["workloads"][workload] = {**data, "summary": summary, "peer": peer_info}
        sections += [report.markdown(workload, summary, peer_info, data["probe"]), "",
                     f"![timeline]({workload}_timeline.png) ![reward]({workload}_reward.png)", ""]
    results["peer_raw"] = {f"{n}{'-eos' if eos else ''}": p for (n, eos), p in peers.items()}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "report.md").write_text("\n".join(sections))
    return out
