"""A refactor's behaviour check: a greedy 4-step run of each mode on tiny models (seeds
5/6, batch 4, lognormal budgets with ignore_eos, Δ 2, chunk 8, lr 1e-3), writing each
step's reward/length/KL and a digest of the trained actor to OUT.json. Run it at two
commits and compare: sequential, intra and auto agree to ~1e-5 in KL; inter and oppo vary
from run to run even at one commit (where the cut lands among concurrent streams decides
which tokens a straggler got under the old weights).

    python scripts/greedy_modes.py OUT.json
    python scripts/greedy_modes.py --compare BEFORE.json AFTER.json   # per mode: equal counts, max |Δ|
"""
import hashlib, json, sys, tempfile
from pathlib import Path

def main(out):
    from colocate import api
    from colocate.config import load_config
    try:
        from colocate.run import checkpoint
    except ImportError:  # before colocate/ had rooms (117bcc3)
        from colocate import checkpoint
    try:
        from colocate.assets.random_models import build_tiny_causal_lm, build_tiny_reward_model
    except ImportError:  # before the random models had their own module (a8d8345)
        try:
            from colocate.assets.models import build_tiny_causal_lm, build_tiny_reward_model
        except ImportError:  # before colocate/ had rooms (117bcc3)
            from colocate.models import build_tiny_causal_lm, build_tiny_reward_model
    d = Path(tempfile.mkdtemp())
    a = str(build_tiny_causal_lm(d / "actor", seed=5)); r = str(build_tiny_reward_model(d / "rm", seed=6))
    res = {}
    for mode in ("sequential", "intra", "inter", "oppo", "auto"):
        cfg = load_config(overrides=[f"models.actor={a}", f"models.reward={r}", f"run.out_dir={d / mode}",
            "rollout.batch_size=4", "ppo.minibatches=2", "data.max_prompt_tokens=512", "engines.actor_max_total_tokens=8192",
            "engines.reward_max_total_tokens=8192", "engines.device=cpu", "rollout.temperature=0", "run.steps=4",
            "run.eval_every=0", "run.save_every=4", f"overlap.mode={mode}", "overlap.delta_init=2", "overlap.delta_adaptive=false",
            "overlap.chunk_size=8", "overlap.auto_trials=1", "rollout.max_new_tokens=48", "rollout.length_dist=lognormal",
            "rollout.length_median=8", "rollout.ignore_eos=true", "ppo.actor_lr=1e-3"])
        s = api.train(cfg, quiet=True)
        keys = ("reward_mean", "reward_std", "response_len", "prompt_len", "kl", "trained_samples", "overlap/deferred", "overlap/resumed")
        steps = [{k: h.get(k) for k in keys} for h in s.history]
        _, parts = checkpoint.load(checkpoint.latest(s.checkpoint_dir))
        model = parts["trainer"]["actor"]["model"]
        digest = hashlib.sha256(b"".join(model[k].numpy().tobytes() for k in sorted(model))).hexdigest()[:16]
        res[mode] = {"steps": steps, "actor_sha": digest, "actor_sum": float(sum(model[k].double().sum() for k in model))}
        print(mode, json.dumps(res[mode]), flush=True)
    Path(out).write_text(json.dumps(res, indent=1))

def compare(before, after):
    """Per mode: whether every step's lengths and counts are equal, whether the first step is,
    and the largest reward and KL differences."""
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    counts = ("response_len", "prompt_len", "trained_samples", "overlap/deferred", "overlap/resumed")
    for mode in a:
        sa, sb = a[mode]["steps"], b[mode]["steps"]
        same = all(x[k] == y[k] for x, y in zip(sa, sb) for k in counts)
        dr = max(abs(x["reward_mean"] - y["reward_mean"]) for x, y in zip(sa, sb))
        dk = max(abs((x["kl"] or 0) - (y["kl"] or 0)) for x, y in zip(sa, sb))
        first = all(sa[0][k] == sb[0][k] for k in counts) and abs(sa[0]["reward_mean"] - sb[0]["reward_mean"]) < 1e-6
        print(f"{mode:10s} counts equal={same} first step equal={first} max|d reward|={dr:.2e} max|d KL|={dk:.2e} "
              f"actor {a[mode]['actor_sha']} {b[mode]['actor_sha']}")

if __name__ == "__main__":
    compare(*sys.argv[2:4]) if sys.argv[1] == "--compare" else main(sys.argv[1])
