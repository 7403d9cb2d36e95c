"""A refactor's checkpoint check: checkpoints written by an older commit resume under this one.

`write DIR` at the old commit (a checkout of it, e.g. a git worktree on PYTHONPATH) trains
greedy 4-step sequential and inter runs on tiny models, checkpointing at steps 2 and 4;
`resume DIR` here resumes each from its step-2 checkpoint and prints the old and resumed
steps 3-4 (equal up to the reward engine's float noise), and loads the inter checkpoint to
compare its deferred samples, next index, position, Δ controller and chunk tuner with what
was saved (the saved side read through `checkpoint_layouts.current`, any layout).

    PYTHONPATH=OLD_CHECKOUT python scripts/resume_old_checkpoint.py write DIR
    python scripts/resume_old_checkpoint.py resume DIR
"""
import json, shutil, sys
from pathlib import Path

def cfg_for(d, mode, steps, out):
    from colocate.config import load_config
    a, r = d / "actor", d / "rm"
    return load_config(overrides=[f"models.actor={a}", f"models.reward={r}", "rollout.batch_size=4", "ppo.minibatches=2",
        "data.max_prompt_tokens=512", "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192",
        "engines.device=cpu", "rollout.temperature=0", f"run.steps={steps}", "run.eval_every=0", "run.save_every=2",
        f"overlap.mode={mode}", "overlap.delta_init=2", "overlap.delta_adaptive=false", "overlap.chunk_size=8",
        "rollout.max_new_tokens=48", "rollout.length_dist=lognormal", "rollout.length_median=8", "rollout.ignore_eos=true",
        "ppo.actor_lr=1e-3", "rollout.group_size=2", f"run.out_dir={out}"])

KEYS = ("reward_mean", "response_len", "kl", "trained_samples", "overlap/deferred", "overlap/resumed")

def main(action, d):
    from colocate import api
    from colocate.run import checkpoint
    d = Path(d)
    if action == "write":
        from colocate.assets.models import build_tiny_causal_lm, build_tiny_reward_model
        d.mkdir(exist_ok=True)
        build_tiny_causal_lm(d / "actor", seed=5); build_tiny_reward_model(d / "rm", seed=6)
        out = {}
        for mode in ("sequential", "inter"):
            s = api.train(cfg_for(d, mode, 4, d / f"old_{mode}"), quiet=True)
            out[mode] = [{k: h.get(k) for k in KEYS} for h in s.history]
        (d / "old.json").write_text(json.dumps(out))
        return
    old = json.loads((d / "old.json").read_text())
    res = {}
    for mode in ("sequential", "inter"):
        run = d / f"new_{mode}"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(d / f"old_{mode}", run)
        shutil.rmtree(run / "checkpoints" / "step_00000004")
        _, old_parts = checkpoint.load(checkpoint.latest(run))
        s = api.train(cfg_for(d, mode, 4, run), resume=str(run), quiet=True)
        got = [{k: h.get(k) for k in KEYS} for h in s.history]
        res[mode] = {"old_steps_3_4": old[mode][2:], "resumed_steps_3_4": got[2:], "equal": got[2:] == old[mode][2:]}
        print(mode, json.dumps(res[mode]), flush=True)
        if mode == "inter":  # the deferred buffer of the old checkpoint, as the new code loads it
            from colocate.run import builder
            from colocate.run.checkpoint_layouts import current
            saved = current(old_parts, 1.0)  # any layout as today's: data {ranks}, rollout {ranks}
            data0, roll0 = saved["data"]["ranks"][0], saved["rollout"]["ranks"][0]
            run2 = d / "new_inter_load"
            shutil.rmtree(run2, ignore_errors=True); shutil.copytree(d / "old_inter", run2)
            shutil.rmtree(run2 / "checkpoints" / "step_00000004")
            sess = builder.build(cfg_for(d, mode, 4, run2), resume=run2, log=lambda m: None)
            try:
                st = sess.data.state_dict()
                # samples saved before they carried a status (layouts <= 2) get the one their finish reason meant
                status = [x.pop("status", None) for x in st["deferred"]]
                meant = ["finished" if x.get("finish_reason") in ("stop", "length") else "deferred" for x in data0["deferred"]]
                res["inter_load"] = {"deferred_equal": st["deferred"] == [{k: v for k, v in x.items() if k != "status"}
                                                                        for x in data0["deferred"]],
                                     "n": len(data0["deferred"]), "status": status,
                                     "status_as_meant": status == [x.get("status", m) for x, m in zip(data0["deferred"], meant)],
                                     "next_index": [st["next_index"], data0["next_index"]],
                                     "data_pos": [st["data_pos"], data0["data_pos"]],
                                     "delta": [sess.rollouts.scheduler.delta_ctl.state_dict(), roll0["delta"]],
                                     "tuner": [sess.rollouts.tuner.state_dict(), roll0["tuner"]]}
                print("inter_load", json.dumps(res["inter_load"]), flush=True)
            finally:
                sess.close()
    (d / "new.json").write_text(json.dumps(res))

if __name__ == "__main__":
    main(*sys.argv[1:])
