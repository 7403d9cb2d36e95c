"""Bench report: per-mode summaries with spread, ratios, a markdown table and JSON.

Owns: turning step records into per-mode medians and min–max, the per-repeat ratios of
each mode against sequential (and of oppo against the TRL peer), efficiency against the
lower bound, and the markdown text. Never a lone absolute time without its comparison.
Steps the contention guard flagged (others used more than the limit, ``bench.contention``)
are left out of every median, unless a mode has no other step: then they are kept and
the report says so.
Leaves out: plots (``bench.plots``), the time-to-reward study (``bench.convergence``).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from colocate.bench.limit import TRAIN_PHASES, step_bound


def spread(xs: Sequence[float]) -> dict[str, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(s: dict[str, float], digits: int = 2) -> str:
    """A spread as 'median [min–max]' ('–' when empty)."""
    if not s["n"]:
        return "–"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def _per_repeat(records, mode, key) -> dict[int, float]:
    out: dict[int, list[float]] = {}
    for r in records:
        if r["mode"] == mode:
            out.setdefault(r["repeat"], []).append(r[key])
    return {rep: statistics.median(v) for rep, v in out.items()}


def uncontended(records: list[dict[str, Any]], modes: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the records medians are taken over, per mode {"steps", "contended", "excluded",
    "others_cores"}): a mode's contended steps are dropped while at least one of its steps
    is quiet; a mode whose every step was contended keeps them (``excluded`` 0)."""
    kept: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    for mode in modes:
        rows = [r for r in records if r["mode"] == mode]
        quiet = [r for r in rows if not r.get("contended")]
        kept += quiet or rows
        info[mode] = {"steps": len(rows), "contended": len(rows) - len(quiet),
                      "excluded": len(rows) - len(quiet) if quiet else 0,
                      "others_cores": spread([r["others_cores"] for r in rows if "others_cores" in r])}
    return kept, info


TRAJECTORY = ("turns", "tool_calls", "tool_call_rate", "env_tokens")  # per trajectory, multi-turn workloads


GPU_MEMORY = ("engines_started_gib", "released_gib", "released_frac", "free_gib_for_training",
              "train_peak_allocated_gib")


def summarize(records: list[dict[str, Any]], probe: dict[str, float], modes: Sequence[str]) -> dict[str, Any]:
    """Per-mode spreads of the headline metrics and phase times; ratios vs sequential.
    Steps whose update was skipped (non-finite reward) are counted, not averaged; contended
    steps are left out (``uncontended``) and counted under ``contention``."""
    summary: dict[str, Any] = {}
    records, guard = uncontended(records, modes)
    skipped = [r for r in records if "skipped" in r]
    records = [r for r in records if "skipped" not in r]
    base = _per_repeat(records, "sequential", "trained_samples_per_s")
    for mode in modes:
        rows = [r for r in records if r["mode"] == mode]
        if not rows:
            continue
        mine = _per_repeat(records, mode, "trained_samples_per_s")
        ratios = [mine[k] / base[k] for k in mine if k in base and base[k] > 0]
        train = [sum(r.get(f"time/{p}", 0.0) for p in TRAIN_PHASES) for r in rows]
        summary[mode] = {
            "trained_samples_per_s": spread([r["trained_samples_per_s"] for r in rows]),
            "response_tokens_per_s": spread([r["response_tokens_per_s"] for r in rows]),
            "response_len": spread([r["response_len"] for r in rows]),
            "step_s": spread([r["step_s"] for r in rows]),
            "generate_s": spread([r.get("time/generate", 0.0) for r in rows]),
            "reward_tail_s": spread([r.get("time/reward_tail", 0.0) for r in rows]),
            "train_s": spread(train),
            "sync_s": spread([r.get("time/sync", 0.0) for r in rows]),
            "engine_busy": spread([r.get("time/generate", 0.0) / r["step_s"] for r in rows]),
            "deferred": spread([r.get("overlap/deferred", 0) for r in rows]),
            "reward_mean": spread([r["reward_mean"] for r in rows]),
            "vs_sequential": spread(ratios),
            "bound_efficiency": spread([step_bound(r, probe) / r["step_s"] for r in rows]) if probe else spread([]),
            "skipped_steps": sum(1 for r in skipped if r["mode"] == mode),
            "contention": guard[mode],
        }
        if any("train/tokens_computed" in r for r in rows):  # one trainer pass: computed vs the samples' tokens
            summary[mode]["train_tokens"] = {
                "computed": spread([r["train/tokens_computed"] for r in rows if "train/tokens_computed" in r]),
                "samples": spread([r["train/tokens_samples"] for r in rows if "train/tokens_samples" in r])}
        if any("gpu/released_gib" in r for r in rows):  # CUDA: the engines' memory at each sleep
            summary[mode]["gpu"] = {k: spread([r[f"gpu/{k}"] for r in rows if f"gpu/{k}" in r]) for k in GPU_MEMORY}
        if any("rollout/turns" in r for r in rows):  # multi-turn trajectories
            summary[mode]["trajectories"] = {k: spread([r.get(f"rollout/{k}", 0.0) for r in rows]) for k in TRAJECTORY}
    return summary


def peer_ratio(summary: dict[str, Any], peer: dict[str, Any] | None, mode: str = "oppo") -> dict[str, Any] | None:
    """oppo over TRL, spread over oppo's steps against TRL's median: trained samples/s, and
    response tokens/s (fair also where the two runs' response lengths differ); which TRL
    trainer it was (``trl_trainer``: "ppo" or "grpo", with ``trl_group_size``)."""
    if not peer or mode not in summary or not peer.get("update_seconds"):
        return None
    rounds = [peer["batch_size"] / s for s in peer["update_seconds"]]
    trl = statistics.median(rounds)
    s = summary[mode]["trained_samples_per_s"]
    out = {"median": s["median"] / trl, "min": s["min"] / trl, "max": s["max"] / trl, "n": s["n"],
           "trl_samples_per_s": trl, "trl_min": min(rounds), "trl_max": max(rounds), "trl_rounds": len(rounds),
           "trl_new_tokens": peer.get("new_tokens"),
           "trl_trainer": peer.get("trainer", "ppo"), "trl_group_size": peer.get("group_size", 0),
           "trl_response_len": statistics.fmean(peer["response_tokens"]) / peer["batch_size"]
           if peer.get("response_tokens") else float("nan")}
    trl_tok = peer.get("response_tokens_per_s")
    if trl_tok:
        t = summary[mode]["response_tokens_per_s"]
        out["tokens"] = {"median": t["median"] / trl_tok, "min": t["min"] / trl_tok, "max": t["max"] / trl_tok,
                         "trl_tokens_per_s": trl_tok}
    return out


def markdown(workload: str, summary: dict[str, Any], peer_info: dict[str, Any] | None,
             probe: dict[str, float], limit_cores: float | None = None) -> str:
    lines = [f"### workload `{workload}`", "",
             "| mode | trained samples/s | vs sequential | response tok/s | step s | generate s | "
             "reward tail s | train s | sync s | engine busy | deferred | reward | bound efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        lines.append(
            f"| {mode} | {fmt(s['trained_samples_per_s'])} | {fmt(s['vs_sequential'])}x | "
            f"{fmt(s['response_tokens_per_s'], 0)} | {fmt(s['step_s'])} | {fmt(s['generate_s'])} | "
            f"{fmt(s['reward_tail_s'])} | {fmt(s['train_s'])} | {fmt(s['sync_s'])} | "
            f"{fmt(s['engine_busy'])} | {fmt(s['deferred'], 1)} | {fmt(s['reward_mean'], 3)} | "
            f"{fmt(s['bound_efficiency'])} |")
    counted = {m: s["train_tokens"] for m, s in summary.items() if "train_tokens" in s}
    if counted:
        lines += ["", "Trainer tokens per pass (median; a group's prompt once with `ppo.shared_prefix`): " + ", ".join(
            f"{m} {t['computed']['median']:.0f} of {t['samples']['median']:.0f} sample tokens "
            f"({t['computed']['median'] / max(t['samples']['median'], 1):.2f}x)" for m, t in counted.items())]
    if peer_info:
        lines += ["", f"{peer_label(peer_info)} (trl {peer_info.get('trl_version', '?')}, same models/batch"
                  f"{_group_note(peer_info)}, responses of {peer_info['trl_response_len']:.0f} tokens on average "
                  f"vs oppo's {summary['oppo']['response_len']['median']:.0f}): "
                  f"{peer_info['trl_samples_per_s']:.3f} [{peer_info.get('trl_min', float('nan')):.3f}–"
                  f"{peer_info.get('trl_max', float('nan')):.3f}] trained samples/s over "
                  f"{peer_info.get('trl_rounds', '?')} updates; oppo / TRL = "
                  f"{peer_info['median']:.2f}x [{peer_info['min']:.2f}–{peer_info['max']:.2f}] in samples/s"]
        if "tokens" in peer_info:
            t = peer_info["tokens"]
            lines[-1] += f", {t['median']:.2f}x [{t['min']:.2f}–{t['max']:.2f}] in response tokens/s"
        dtype, trl_dtype = peer_info.get("colocate_dtype", "float32"), peer_info.get("trl_dtype", "float32")
        if dtype != trl_dtype:
            lines[-1] += (f" (NOT LIKE FOR LIKE: colocate's trainer computes in {dtype}, the TRL peer in {trl_dtype}; "
                          "for a like-for-like ratio leave --peer-dtype unset)")
        else:
            lines[-1] += f"; both in {dtype}"
        load = peer_info.get("contention") or {}
        if load:
            lines[-1] += (f"; others used {load['others_cores']:.2f} cores during the TRL run"
                          + (" (CONTENDED: rerun on a quiet machine)" if load["contended"] else ""))

    if any("trajectories" in s for s in summary.values()):
        lines += ["", "| mode | model turns / trajectory | tool calls / trajectory | tool-call rate | "
                  "environment tokens / trajectory |", "|---|---|---|---|---|"]
        for mode, s in summary.items():
            t = s.get("trajectories")
            if t:
                lines.append(f"| {mode} | {fmt(t['turns'], 2)} | {fmt(t['tool_calls'], 2)} | "
                             f"{fmt(t['tool_call_rate'], 2)} | {fmt(t['env_tokens'], 1)} |")
    lines += gpu_memory_lines(summary, probe)
    guard = contention_line(summary, limit_cores)
    if guard:
        lines += ["", guard]
    if probe:
        lines += ["", f"engine probe: decode {probe['decode_tokens_per_s']:.0f} tok/s at batch "
                  f"{probe['probe_batch']}, RM prefill {probe.get('prefill_tokens_per_s', float('nan')):.0f} tok/s"]
        if "decode_bound_ms" in probe:
            lines += ["", f"decode step at batch {probe['probe_batch']}: {probe['decode_step_ms']:.2f} ms, "
                      f"{probe['decode_vs_bound']:.1f}x its bound of {probe['decode_bound_ms']:.2f} ms (the actor's "
                      f"{probe['weights_gb']:.2f} GB of weights read once at the device's measured "
                      f"{probe['device_read_gb_per_s']:.0f} GB/s; launches, KV reads and sampling on top)"]
    lines += ["", "Cells: median [min–max] over measured steps (ratios: over repeats). bound efficiency = "
              "lower-bound step time / measured step time (1.0 = at the bound)."]
    return "\n".join(lines)


def beyond_contexts(released_gib: float, engines_gib: float, processes: int, context_gib: float) -> float:
    """The share of the engines' memory a release gave back, not counting their processes'
    CUDA contexts (which no release frees): issue 53's >= 90 % target."""
    held = engines_gib - processes * context_gib
    return released_gib / held if held > 0 else float("nan")


def gpu_memory_lines(summary: dict[str, Any], probe: dict[str, float]) -> list[str]:
    """The GPU memory table (CUDA runs): what the engines took, what each release gave back
    (of all of it, and beyond their CUDA contexts where the probe measured one), what was
    free for training and the trainer's peak."""
    rows = {m: s["gpu"] for m, s in summary.items() if "gpu" in s}
    if not rows:
        return []
    ctx, n = probe.get("cuda_context_gib"), probe.get("engine_processes")
    out = ["", "| mode | engines at start GiB | released GiB | released frac | beyond CUDA contexts | "
           "free for training GiB | trainer peak GiB |", "|---|---|---|---|---|---|---|"]
    for mode, g in rows.items():
        beyond = "n/a"
        if ctx and n:
            fracs = [beyond_contexts(g["released_gib"][k], g["engines_started_gib"]["median"], n, ctx)
                     for k in ("median", "min", "max")]
            beyond = f"{fracs[0]:.3f} [{fracs[1]:.3f}–{fracs[2]:.3f}]"
        out.append(f"| {mode} | {fmt(g['engines_started_gib'])} | {fmt(g['released_gib'])} | "
                   f"{fmt(g['released_frac'], 3)} | {beyond} | {fmt(g['free_gib_for_training'])} | "
                   f"{fmt(g['train_peak_allocated_gib'])} |")
    if ctx and n:
        out += ["", f"CUDA contexts: {n} engine processes × {ctx:.2f} GiB (an empty torch process's, measured)"]
    return out


def peer_label(peer_info: dict[str, Any]) -> str:
    """Which TRL trainer the peer line is about: "TRL PPO" or "TRL GRPO"."""
    return f"TRL {peer_info.get('trl_trainer', 'ppo').upper()}"


def _group_note(peer_info: dict[str, Any]) -> str:
    n = peer_info.get("trl_group_size") or 0
    return f", groups of {n}" if n else ""


def contention_line(summary: dict[str, Any], limit_cores: float | None = None) -> str:
    """One line on the contention guard: per mode the others' load (median [max] cores) and
    how many steps were contended and left out; '' when nothing was measured."""
    parts, excluded, total, kept_all = [], 0, 0, []
    for mode, s in summary.items():
        c = s.get("contention")
        if not c or not c["others_cores"]["n"]:
            continue
        o = c["others_cores"]
        parts.append(f"{mode} {o['median']:.2f} [max {o['max']:.2f}] cores, {c['contended']}/{c['steps']} contended")
        excluded, total = excluded + c["excluded"], total + c["steps"]
        if c["contended"] and not c["excluded"]:
            kept_all.append(mode)
    if not parts:
        return ""
    line = (f"contention guard: other processes used {'; '.join(parts)}; "
            f"{excluded} of {total} steps left out of the medians as contended"
            + (f" (others > {limit_cores:g} cores)" if limit_cores is not None else ""))
    if kept_all:
        line += (f". WARNING: every step of {', '.join(kept_all)} was contended and is kept: "
                 "its numbers measure a busy machine")
    return line
