"""The CPU cores between the actor and reward engines, measured: decode and scoring alone and at once.

    python -m colocate.bench.cores --preset quick --splits 1/1,2/1,2/2 --wait default,passive --repeats 3

For each thread split A/R (the actor scheduler's torch threads / the reward scheduler's) and
each OpenMP wait policy (``default``: libgomp's own, a thread that finished its share of a
parallel region spins a while, then sleeps; ``passive``: it sleeps at once; ``active``: it
spins until the next region, so an idle engine's threads keep their cores), both engines are
started and three things are timed, interleaved, ``--repeats`` times:

- decode: the actor generates ``--batch`` x ``--new-tokens`` tokens (greedy, EOS ignored), alone;
- score: the reward engine scores ``--scores`` sequences of ``--score-tokens`` tokens, one
  request every ``--gap`` seconds (finished samples or streamed chunks arriving), alone;
- both: the two at once, as in a rollout of ``inter`` (finished samples scored while the
  others decode) or of the streamed modes (chunks scored as they are generated).

It reports the actor's tokens/s alone and beside the scoring, the mean score latency alone
and beside the decode, and how much longer the pair took than the decode alone. The thread
split the rollout modes start their engines with (``colocate.run.builder.engine_threads``)
is chosen by it. Measure on a quiet machine: nothing else busy on the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from colocate.bench.report import fmt, spread


def models(preset: str, root: Path) -> tuple[str, str]:
    """(actor, reward) folders: the quick bench's small random models, or SmolLM2 + the sentiment RM."""
    if preset == "quick":
        from colocate.bench.models import small_models

        return small_models(root)
    from colocate import api

    paths = api.prepare(with_reward_model=True)
    return str(paths["smollm2"]), str(paths["sentiment-rm"])


class Pair:
    """The two engines of one thread split, started together, and the three timed runs."""

    def __init__(self, actor_path: str, reward_path: str, actor_threads: int, reward_threads: int,
                 reward_nice: int = 0) -> None:
        from colocate.engine.engine_config import EngineConfig
        from colocate.engine.runtime import SglangEngine

        self.actor = SglangEngine(EngineConfig(actor_path, role="actor", device="cpu", threads=actor_threads))
        self.reward = SglangEngine(EngineConfig(reward_path, role="reward", device="cpu", threads=reward_threads))
        if reward_nice:
            for pid in self.reward.child_pids:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), reward_nice)
        self.runs = 0

    def close(self) -> None:
        self.actor.shutdown()
        self.reward.shutdown()

    async def _decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
        from colocate.rollout import generate_and_score
        from colocate.rollout.sample import Sample

        self.runs += 1
        samples = [Sample(i, p, new_tokens) for i, p in enumerate(prompts)]
        t = time.perf_counter()
        await generate_and_score.generate(self.actor, samples, {"temperature": 0.0, "ignore_eos": True}, f"cores-d{self.runs}")
        return time.perf_counter() - t, sum(len(s.output_ids) for s in samples)

    async def _score(self, seqs: list[list[int]], gap: float) -> list[float]:
        from colocate.engine import reward

        self.runs += 1

        async def one(i: int, seq: list[int]) -> float:
            await asyncio.sleep(i * gap)
            t = time.perf_counter()
            await reward.score(self.reward, seq, f"cores-s{self.runs}-{i}", timeout_s=120)
            return time.perf_counter() - t

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs))))

    def run(self, kind: str, prompts: list[list[int]], new_tokens: int, seqs: list[list[int]],
            gap: float) -> dict[str, float]:
        async def go() -> dict[str, float]:
            t = time.perf_counter()
            if kind == "decode":
                took, tokens = await self._decode(prompts, new_tokens)
                out = {"tokens_per_s": tokens / took}
            elif kind == "score":
                out = {"score_latency_s": statistics.mean(await self._score(seqs, gap))}
            else:
                (took, tokens), lat = await asyncio.gather(self._decode(prompts, new_tokens), self._score(seqs, gap))
                out = {"tokens_per_s": tokens / took, "score_latency_s": statistics.mean(lat)}
            out["wall_s"] = time.perf_counter() - t
            return out

        result = self.actor.loop.run_until_complete(go())
        self.actor.flush_cache()
        self.reward.flush_cache()
        return result


def measure(args: argparse.Namespace, log=print) -> dict:
    import torch

    actor_path, reward_path = models(args.preset, Path(args.models))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.batch)]
    seqs = [torch.randint(10, 200, (args.score_tokens,), generator=g).tolist() for _ in range(args.scores)]
    results = []
    for wait in args.wait:
        for split in args.splits:
            a, r = (int(x) for x in split.split("/"))
            if wait != "default":
                os.environ["OMP_WAIT_POLICY"] = wait.upper()  # read by each scheduler's OpenMP as it starts
            log(f"split {a}/{r}, wait {wait}: starting engines")
            pair = Pair(actor_path, reward_path, a, r, args.reward_nice)
            try:
                pair.run("both", prompts, 8, seqs[:2], 0.0)  # warm-up
                runs: dict[str, list[dict[str, float]]] = {"decode": [], "score": [], "both": []}
                for i in range(args.repeats):
                    for kind in ("decode", "score", "both"):
                        runs[kind].append(pair.run(kind, prompts, args.new_tokens, seqs, args.gap))
                    log(f"  repeat {i + 1}: " + ", ".join(f"{k} {v[-1]}" for k, v in runs.items()))
            finally:
                pair.close()
                os.environ.pop("OMP_WAIT_POLICY", None)
            results.append({
                "split": split, "wait": wait, "reward_nice": args.reward_nice,
                "decode_tokens_per_s": spread([x["tokens_per_s"] for x in runs["decode"]]),
                "both_tokens_per_s": spread([x["tokens_per_s"] for x in runs["both"]]),
                "score_latency_s": spread([x["score_latency_s"] for x in runs["score"]]),
                "both_score_latency_s": spread([x["score_latency_s"] for x in runs["both"]]),
                "decode_wall_s": spread([x["wall_s"] for x in runs["decode"]]),
                "both_wall_s": spread([x["wall_s"] for x in runs["both"]]),
            })
    return {"options": vars(args), "cores": len(os.sched_getaffinity(0)), "results": results}


def markdown(out: dict) -> str:
    o = out["options"]
    lines = [f"## Engine cores ({o['preset']} models, {out['cores']} cores)", "",
             f"decode: {o['batch']} x {o['new_tokens']} tokens (prompts of {o['prompt_tokens']}); score: "
             f"{o['scores']} x {o['score_tokens']} tokens, one every {o['gap']} s; median [min–max] of "
             f"{o['repeats']} repeats; reward engine niceness {o['reward_nice']}", "",
             "| actor/reward threads | OpenMP wait | decode tok/s alone | with scoring | score latency s alone | "
             "with decode | both wall s | decode alone wall s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in out["results"]:
        lines.append(f"| {r['split']} | {r['wait']} | {fmt(r['decode_tokens_per_s'], 1)} | "
                     f"{fmt(r['both_tokens_per_s'], 1)} | {fmt(r['score_latency_s'], 3)} | "
                     f"{fmt(r['both_score_latency_s'], 3)} | {fmt(r['both_wall_s'])} | {fmt(r['decode_wall_s'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m colocate.bench.cores", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["quick", "full"], default="quick",
                    help="quick: the bench's small random models; full: SmolLM2-135M + the sentiment RM")
    ap.add_argument("--splits", default="1/1,2/1,2/2", help="actor/reward threads, comma-separated")
    ap.add_argument("--wait", default="default,passive",
                    help="OpenMP wait policies, comma-separated: default (libgomp's), passive, active")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--scores", type=int, default=8)
    ap.add_argument("--score-tokens", type=int, default=128)
    ap.add_argument("--gap", type=float, default=0.15, help="seconds between score requests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reward-nice", type=int, default=0, help="niceness of the reward engine's processes")
    ap.add_argument("--models", default="runs/.bench-models", help="folder of the quick preset's models")
    ap.add_argument("--out", default=None, help="folder for cores.json and cores.md")
    args = ap.parse_args(argv)
    args.splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    args.wait = [w.strip() for w in args.wait.split(",") if w.strip()]
    bad = [s for s in args.splits
           if len(s.split("/")) != 2 or not all(x.isdigit() and int(x) > 0 for x in s.split("/"))]
    bad += [w for w in args.wait if w not in ("default", "active", "passive")]
    if bad:
        ap.error(f"--splits takes A/R thread counts (e.g. 2/1), --wait default|passive|active; got {bad}")
    out = measure(args)
    text = markdown(out)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cores.json").write_text(json.dumps(out, indent=1))
        (Path(args.out) / "cores.md").write_text(text)


if __name__ == "__main__":
    main()
