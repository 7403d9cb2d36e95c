"""Which of colocate's files one sample (or the batch made of it) passes through during
one step of a tiny PPO run (step 2, from its start until the weight sync begins, so
prompt -> gradient): every call into colocate/, engine/ or trainer/
whose arguments hold a Sample, a list of them, the step's StepRollout, the TrainBatch,
or a sample's token ids (its prompt, or a sequence starting with it) counts its file.
What it cannot see: bytes (the reward feeder's ZeroMQ frames), SGLang's own files.
Issue 52's "following a sample prompt -> gradient opens at most 15 files", measured.

    python scripts/sample_path.py . sequential      # or oppo, intra, inter
"""
import json, sys, tempfile, threading
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve()
MODE = sys.argv[2] if len(sys.argv) > 2 else "sequential"
DIRS = tuple(str(ROOT / d) + "/" for d in ("colocate", "engine", "trainer"))

def main():
    from colocate import api
    from colocate.config import load_config
    try:
        from colocate.assets.random_models import build_tiny_causal_lm, build_tiny_reward_model
    except ImportError:  # before the random models had their own module (a8d8345)
        from colocate.assets.models import build_tiny_causal_lm, build_tiny_reward_model
    try:
        from colocate.rollout.sample import Sample
        from colocate.rollout.rollouts import StepRollout
    except ImportError:  # 17469b8: the sample in engine/, the step's rollout in rollout_phase
        from colocate.engine.rollout import Sample
        from colocate.rollout.rollout_phase import StepRollout
    from colocate.trainer.batch import TrainBatch
    d = Path(tempfile.mkdtemp())
    a = str(build_tiny_causal_lm(d / "actor", seed=5)); r = str(build_tiny_reward_model(d / "rm", seed=6))
    ids: set[int] = set()
    files: dict[str, int] = {}
    order: list[str] = []
    state = {"on": False}

    prompts: dict[int, set] = {}  # length -> the tracked samples' prompts (token tuples)

    def tokens(v):  # a sample's prompt, or a sequence starting with one (prompt + response)
        if not isinstance(v, (list, tuple)) or not v or not isinstance(v[0], int):
            return False
        return any(tuple(v[:n]) in ps for n, ps in prompts.items() if len(v) >= n)

    def held(v, depth=0):
        if isinstance(v, (Sample, StepRollout, TrainBatch)):
            if isinstance(v, Sample):
                ids.update((id(v.prompt_ids), id(v.output_ids)))
                prompts.setdefault(len(v.prompt_ids), set()).add(tuple(v.prompt_ids))
            return True
        if id(v) in ids or tokens(v):
            return True
        if depth == 0 and isinstance(v, (list, tuple)) and v and isinstance(v[0], (list, tuple)):
            return any(tokens(x) for x in v[:8])
        if depth == 0 and isinstance(v, (list, tuple)) and v and isinstance(v[0], Sample):
            for x in v:
                held(x, 1)
            return True
        return False

    def prof(frame, event, arg):
        if event not in ("call", "return") or not state["on"]:
            return
        f = frame.f_code.co_filename
        if not f.startswith(DIRS):
            return
        co = frame.f_code
        if co.co_name == "wake_and_sync":  # the gradient is taken: the weight sync, records and logs follow
            state["on"] = False
            return
        names = co.co_varnames[:co.co_argcount + co.co_kwonlyargcount]
        loc = frame.f_locals
        if (held(arg) if event == "return" else any(held(loc.get(n)) for n in names)):
            rel = str(Path(f).relative_to(ROOT))
            files[rel] = files.get(rel, 0) + 1
            if not order or order[-1] != rel:
                order.append(rel)

    def after_step(rec):  # on from the end of step 1 to the end of step 2 (nothing runs between but the step)
        on = rec["step"] == 1
        state["on"] = on
        sys.setprofile(prof if on else None)
        threading.setprofile(prof if on else None)

    cfg = load_config(overrides=[f"models.actor={a}", f"models.reward={r}", f"run.out_dir={d / 'run'}",
        "rollout.batch_size=4", "ppo.minibatches=2", "data.max_prompt_tokens=512",
        "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192", "engines.device=cpu", "run.steps=2", "run.eval_every=0",
        "run.save_every=0", f"overlap.mode={MODE}", "rollout.max_new_tokens=16", "engines.actor_threads=1",
        "engines.reward_threads=1"])
    api.train(cfg, quiet=True, callbacks=[after_step])
    print(json.dumps({"mode": MODE, "files": len(files), "calls_by_file": dict(sorted(files.items())),
                      "first_entered": list(dict.fromkeys(order))}, indent=1))

if __name__ == "__main__":
    main()
