"""``colocate train``'s loop in every mode on one device, in one process: the GPU check of
the engine path (scripts/gpu_engine_check.sh), and its dry run on CPU.

    python -m colocate.bench.loop_check --device cuda --out $OUT/loop --deadline-s 400 \\
        --set engines.attention_backend=triton --set engines.cuda_graph=false
    python -m colocate.bench.loop_check --device cpu --shape tiny --out /tmp/lc   # dry run

Builds a random-weight actor of a real model's shape (``--shape``; the critic is its
backbone) and a small random causal reward model of the same vocabulary, then runs parts
of ``--steps`` steps each through ``colocate.api.train`` (what the CLI's ``colocate train``
calls), every part with its own run folder and the engines kept across parts in one
:class:`~colocate.engine.pool.EnginePool` (an engine start is paid once per engine
configuration): sequential PPO, oppo, inter, GRPO (group 4), LoRA r16, the scripted
multi-turn environment. After each part ``<out>/summary.json`` is rewritten (ok or the
error's last lines, wall seconds, the engines' start-up memory, per step: phase seconds,
``gpu/*`` memory at the sleep and wake, ``sync/*``), so a run cut off by its deadline still
reports what ran. A part that would start with fewer than ``--need-s`` seconds left is
skipped and says so.

Leaves out: timing claims (one repeat, random weights: the check finds what breaks and
reads memory; speed belongs to ``colocate bench``), the SGLang-only probe
(scripts/gpu_probe.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

# (name, overrides) in order of worth; every part adds the common overrides first
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sequential", ("overlap.mode=sequential", "run.save_every=3")),  # a checkpoint on the device too
    ("oppo", ("overlap.mode=oppo",)),
    ("inter", ("overlap.mode=inter",)),
    ("grpo", ("ppo.advantage=grpo", "rollout.group_size=4", "ppo.kl_in=loss")),
    ("lora", ("lora.rank=16", "lora.alpha=32")),
    ("multiturn", ("rollout.env=scripted", "rollout.max_turns=3", "rollout.turn_tokens=32")),
    # stragglers parked in the engine at the cut and put back in its queue (in_place is refused on CUDA)
    ("retract", ("overlap.mode=inter", "overlap.pause_mode=retract")),
)

KEPT = ("step", "step_s", "reward_mean", "trained_samples", "response_len", "kl", "weight_version",
        "mem/train_state_mb", "sync/pushed_mb")
KEPT_PREFIXES = ("time/", "gpu/", "sync/", "overlap/deferred", "overlap/launched", "rollout/turns")


def build_models(work: Path, shape: str) -> tuple[Path, Path]:
    """The actor (``shape``, random) and a 4-layer random reward model of its vocabulary."""
    from colocate.assets.random_models import MODEL_SHAPES, build_shaped_causal_lm, build_tiny_reward_model

    actor, reward = work / f"actor-{shape}", work / f"reward-{shape}"
    vocab = MODEL_SHAPES[shape][-1]
    if not (actor / "config.json").exists():
        build_shaped_causal_lm(actor, shape)
    if not (reward / "config.json").exists():
        build_tiny_reward_model(reward, hidden=256, layers=4, heads=4, kv_heads=2, vocab=vocab, max_positions=4096)
    return actor, reward


def common_overrides(actor: Path, reward: Path, device: str, steps: int, small: bool) -> list[str]:
    tokens = 32 if small else 128
    return [f"models.actor={actor}", f"models.reward={reward}", f"engines.device={device}",
            f"run.steps={steps}", "run.eval_every=0", "run.save_every=0",
            "rollout.batch_size=8", f"rollout.max_new_tokens={tokens}", "rollout.length_dist=lognormal",
            "overlap.chunk_size=16"]


def step_view(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
            if k in KEPT or k.startswith(KEPT_PREFIXES)}


def engine_memory(pool) -> dict[str, float]:
    """The start-up memory of each engine the pool holds (GiB; CUDA)."""
    return {f"{e.cfg.role}{'-lora' if e.cfg.lora_rank else ''}_start_gib": round(e.start_gpu_bytes / 2**30, 3)
            for e in pool.kept() if e.start_gpu_bytes}


def run_part(overrides: list[str], pool) -> dict[str, Any]:
    """One part: ``api.train`` on ``overrides`` with the engines of ``pool``; what it did."""
    from colocate import api
    from colocate.config import load_config

    started = time.perf_counter()
    part: dict[str, Any] = {"overrides": overrides}
    try:
        summary = api.train(load_config(overrides=overrides), engines=pool)
        part.update(ok=True, steps=[step_view(h) for h in summary.history])
        times = [h["step_s"] for h in summary.history]
        part["median_step_s"] = round(statistics.median(times), 3) if times else None
    except Exception as exc:  # noqa: BLE001 - the next part may still run; the error is reported
        part.update(ok=False, error=" ".join(str(exc).split())[:600] or type(exc).__name__,
                    traceback=traceback.format_exc()[-4000:])
    part["wall_s"] = round(time.perf_counter() - started, 1)
    part["engines"] = engine_memory(pool)
    return part


def run_parts(names: list[str], common: list[str], out: Path, pool, report: dict[str, Any],
              deadline: float, need_s: float, part_steps: dict[str, int] | None = None) -> dict[str, Any]:
    """The parts ``names`` in order, each on ``common`` + its own overrides (``part_steps``:
    steps of some parts) with its run folder under ``out``; ``report["parts"]`` and
    ``out/summary.json`` rewritten after each (an interrupted part: the steps it finished)."""
    part_steps = part_steps or {}
    parts = dict(PARTS)
    unknown = [n for n in names if n not in parts]
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(parts)}")
    path = out / "summary.json"
    for name in names:
        left = deadline - time.monotonic()
        if left < need_s:
            report["parts"][name] = {"ok": None, "skipped": f"{left:.0f} s left"}
            path.write_text(json.dumps(report, indent=1))
            continue
        print(f"== part {name} ({left:.0f} s left)", flush=True)
        steps = [f"run.steps={part_steps[name]}"] if name in part_steps else []
        try:
            # a part's folder is the loop check's own: a rerun into the same --out replaces that part's run
            report["parts"][name] = part = run_part([*common, f"run.out_dir={out / name}", "run.overwrite_out_dir=true",
                                                     *parts[name], *steps], pool)
        except KeyboardInterrupt:  # stopped from outside (a deadline's SIGTERM): the steps it finished
            done = out / name / "metrics.jsonl"
            lines = done.read_text().splitlines() if done.exists() else []
            report["parts"][name] = {"ok": False, "error": "interrupted", "steps": [step_view(json.loads(x)) for x in lines]}
            path.write_text(json.dumps(report, indent=1))
            raise
        gc.collect()  # the part's trainer goes before the next one builds its own
        if any(o == "engines.device=cuda" for o in common):
            import torch

            torch.cuda.empty_cache()
        path.write_text(json.dumps(report, indent=1))
        print(f"== part {name}: {'ok' if part['ok'] else 'FAILED: ' + part['error']} in {part['wall_s']} s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="colocate train's loop in every mode on one device")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--out", default="runs/loop-check")
    ap.add_argument("--work", default="/tmp/colocate-loop-check")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parts", default=",".join(n for n, _ in PARTS))
    ap.add_argument("--deadline-s", type=float, default=420.0)
    ap.add_argument("--need-s", type=float, default=45.0, help="skip a part with less time left than this")
    ap.add_argument("--part-steps", default="", help="steps of some parts, e.g. lora=2,grpo=2")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every part")
    args = ap.parse_args(argv)
    from colocate.engine.pool import EnginePool

    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": args.device, "shape": args.shape, "steps_per_part": args.steps,
                              "common": args.overrides, "parts": {}}
    t = time.perf_counter()
    actor, reward = build_models(Path(args.work), args.shape)
    report["models_s"] = round(time.perf_counter() - t, 1)
    common = [*common_overrides(actor, reward, args.device, args.steps, args.shape == "tiny"), *args.overrides]
    names = [n for n in args.parts.split(",") if n]
    with EnginePool() as pool:
        part_steps = {k: int(v) for k, v in (x.split("=") for x in args.part_steps.split(",") if x)}
        run_parts(names, common, out, pool, report, deadline, args.need_s, part_steps)
    failed = [n for n, p in report["parts"].items() if p.get("ok") is False]
    ran = [n for n, p in report["parts"].items() if p.get("ok") is not None]
    print(f"loop check: {len(ran) - len(failed)} of {len(names)} parts ran without error"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped: {len(names) - len(ran)}" if len(ran) < len(names) else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
