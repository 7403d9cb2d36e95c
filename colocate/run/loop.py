"""The PPO step loop, sequential form: it reads like the algorithm.

generate → score → ref logp, old logp, values → advantages → critic and actor epochs →
weight sync (with the sleep/wake order of ``colocate.run.timesharing``) → KL control →
metrics → checkpoint. A critic-free estimator (``ppo.advantage``) has no values pass and
no critic epochs. Every mode hands the step a ``StepRollout`` of scored samples (whole
groups): each engine rank generates and scores its share on its own engines, the shares
are joined into one batch on every rank (``colocate.rollout.rollouts.join``), and every rank
trains its FSDP shard of it.

The step names its phases and does nothing else about them (:class:`StepPhases`):
``phases.enter("train")`` changes the run's phase (rollout | train | sync | idle: what a
failure checkpoints, what a rank-failure line names, what the progress bar and the timeline
show) and ``with phases("ref"):`` runs one part of it, timed (``time/ref``; ``timed=False``:
a boundary only). Whatever watches a step attaches to those boundaries as a hook, called
with ``(event, phase)``: ``"enter"`` (the run's phase), ``"begin"``, ``"end"`` (a part;
``end`` only when the part completed). The session's hook (``Session.begin_step``) keeps its
phase record and watchers, and fires ``run.fault_at``'s test faults
(``colocate.faults.AT_BOUNDARY``); what a hook does is its owner's.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

from colocate.rollout import evaluation
from colocate.run import rank_failure
from colocate.monitor import completions
from colocate.monitor import metrics as mlog
from colocate.config import to_dict
from colocate.errors import USER_ERRORS, config_terms
from colocate.rollout.rollouts import StepRollout, join
from colocate.run.session import Session
from colocate.trainer.advantages import token_kl
from colocate.trainer.batch import batch_of
from colocate.trainer.distributed import all_gather_object, lost_peer
from colocate.monitor.wandb_log import WandbRun

StepCallback = Callable[[dict[str, Any]], None]
Hook = Callable[[str, str], None]  # (event: enter | begin | end, phase)


class StepPhases:
    """One step's phases: the seconds of each timed part, and the hooks told of every boundary."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = tuple(hooks)
        self.seconds: dict[str, float] = {}

    def enter(self, phase: str) -> None:
        """The run's phase becomes ``phase``."""
        self._tell("enter", phase)

    @contextlib.contextmanager
    def __call__(self, phase: str, timed: bool = True) -> Iterator[None]:
        """Run one part of the step: hooks at its begin and (completed) end, its seconds added up."""
        self._tell("begin", phase)
        started = time.perf_counter()
        try:
            yield
        finally:
            if timed:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
        self._tell("end", phase)

    def _tell(self, event: str, phase: str) -> None:
        for hook in self.hooks:
            hook(event, phase)


def rollout(s: Session, phases: StepPhases) -> StepRollout:
    """The step's rollout on every rank: each engine rank generates and scores its share of
    the batch on its engines, in the step's mode (``colocate.rollout.rollouts``); the shares,
    or the first failure, are exchanged (``rank_failure.agree``: a rank whose rollout fails
    does not leave the others waiting in a collective, every rank raises, and a user error
    lets every rank checkpoint the last completed step together) and joined into one batch
    checked against the trainer's weight version (``colocate.rollout.rollouts.join``)."""
    def share() -> StepRollout | None:  # None on a rank without engines
        if s.rollouts is None:
            return None
        with phases("rollout", timed=False):
            return s.rollouts.rollout(s.data, s.state.step, s.state.weight_version)

    shares = rank_failure.agree(share, s.dist, "rollout", share=True)
    return join(shares, s.state.weight_version, carries_partials=s.cfg.overlap.deferral)


def step(s: Session, trained: list | None = None) -> dict[str, Any]:
    """One PPO step; returns its metrics (``trained``, when given, gets the step's samples)."""
    t_step = time.perf_counter()
    phases = StepPhases([s.begin_step()])  # the run's hook: faults, progress and the timeline at each boundary
    phases.enter("rollout")
    data = rollout(s, phases)
    phases.seconds.update(data.seconds)
    samples = data.samples
    if trained is not None:
        trained.extend(samples)
    scores = [x.score for x in samples]  # rewards (colocate.rollout.generate_and_score: reward.scale applied)
    phases.enter("train")
    if not all(math.isfinite(v) for v in scores):  # nothing trained: the weights stay as they were
        reason = "non-finite reward from the reward model/functions"
        s.log(f"step {s.state.step + 1}: update skipped: {reason}")
        s.state.step += 1
        phases.enter("idle")
        return {"step": s.state.step, "skipped": reason, "trained_samples": 0,
                "step_s": time.perf_counter() - t_step, "weight_version": s.state.weight_version}
    pad = s.run.tokenizer.pad_token_id if s.run.tokenizer.pad_token_id is not None else 0
    batch = batch_of(samples, pad)  # multi-turn: environment tokens out of the loss
    critic = not s.trainer.settings.critic_free  # grpo / rloo / reinforce_baseline: no values, no critic
    computed, sample_tokens = s.trainer.pass_tokens(batch)  # a group's prompt once (ppo.shared_prefix)
    with phases("sleep_wake"):
        s.engines.sharing.sleep_engines()
    ref_logp = None
    if s.trainer.settings.reference:  # none when the KL is off (ppo.kl_coef=0, fixed)
        with phases("ref"):
            ref_logp = s.trainer.ref_logprobs(batch)
    # where nothing reads them before the update, the actor's first minibatch takes its old
    # log-probs from its own forward (the same weights): this pass skips its rows
    first_forward = s.trainer.settings.old_logp_from_first_forward
    with phases("old_logp"):  # ppo.old_logp=rollout: the engine's log-probs of current-version tokens
        old_logp = s.trainer.old_logprobs(batch, current_version=s.state.weight_version, leave_first=first_forward)
    values = None
    if critic:
        with phases("values"):
            values = s.trainer.values(batch)
    with phases("advantages"):
        adv, returns, _, _ = s.trainer.advantages(batch, old_logp, ref_logp, values, s.state.kl_ctl.value)
    critic_stats = {}
    if critic:
        with phases("critic"):
            critic_stats = s.trainer.train_critic(batch, values, returns)
    with phases("actor"):
        actor_stats = s.trainer.train_actor(batch, old_logp, adv, s.state.weight_version,
                                            ref_logp=ref_logp, kl_coef=s.state.kl_ctl.value, fill_first=first_forward)
    mean_kl = None
    if ref_logp is not None:  # of the old policy to the reference (every row's old log-probs are in now)
        kl = token_kl(s.trainer.settings, batch, old_logp, ref_logp)  # [B, T], 0 off model tokens
        mean_kl = float((kl * batch.loss_mask.float()).sum(-1).mean())
        s.state.kl_ctl.update(mean_kl, len(scores))
    if s.rollouts is not None:
        s.rollouts.observe_reward(statistics.fmean(scores))
    s.state.step += 1
    s.state.weight_version += 1  # what the sync pushes

    def push(full) -> float:  # into this rank's engine, agreed: a failed push ends every rank together
        with phases("push", timed=False):
            return s.push_weights(full)

    phases.enter("sync")
    phases.seconds["sync"] = s.engines.sharing.wake_and_sync(
        s.gather_weights, lambda full: rank_failure.agree(lambda: push(full), s.dist, "sync"))
    phases.enter("idle")
    rec = _record(s, data, scores, phases, time.perf_counter() - t_step, mean_kl, critic_stats, actor_stats)
    return rec | {"train/tokens_computed": computed, "train/tokens_samples": sample_tokens}


def _record(s, data, scores, phases, step_s, mean_kl, critic_stats, actor_stats) -> dict[str, Any]:
    samples = data.samples
    n_tokens = sum(len(x.output_ids) for x in samples)
    rec = {
        "step": s.state.step,
        "reward_mean": statistics.fmean(scores),
        "reward_std": statistics.pstdev(scores),
        "trained_samples": len(scores),
        "response_len": n_tokens / len(samples),
        "prompt_len": sum(len(x.prompt_ids) for x in samples) / len(samples),
        **({"kl": mean_kl} if mean_kl is not None else {}),  # no reference: no KL to report
        "kl_coef": s.state.kl_ctl.value,
        "weight_version": s.state.weight_version,
        "step_s": step_s,
        "response_tokens_per_s": n_tokens / step_s,
        "trained_samples_per_s": len(scores) / step_s,
        "mem/rss_mb": mlog.rss_mb(),
        "mem/train_state_mb": s.trainer.state_mb(),  # parameters, gradients, optimizer moments (this rank)
        "sync/pushed_mb": s.sync_mb(),  # weights pushed into the engine per sync (LoRA: the adapted linears)
        "reward/fn_errors": s.run.reward_errors.take(),  # reward functions scored 0.0 (reward.on_error=zero)
        **s.engines.sharing.take_stats(),  # sync/push_s; CUDA: gpu/* memory at each sleep and wake
        **{f"time/{k}": v for k, v in phases.seconds.items()},
        **data.stats,  # rollout/* and overlap/* (zeros where the mode has no overlap)
        **{f"actor/{k}": v for k, v in actor_stats.items()},
        **{f"critic/{k}": v for k, v in critic_stats.items()},
    }
    return rec


def train(s: Session, callbacks: Sequence[StepCallback] = (), progress=None,
          stop=None) -> list[dict[str, Any]]:
    """Run steps until ``run.steps`` (or ``stop.requested``, checked at each step boundary);
    log every step, checkpoint every ``run.save_every``, at the end, on a stop request,
    and after a failure that left the trainer intact."""
    log = mlog.MetricsLog(s.run.out_dir, enabled=s.is_main, wandb=_wandb_run(s))
    history = []
    saved_at = None
    try:
        if s.state.step == 0:
            _failing_like_a_step(s, lambda: _maybe_evaluate(s, log), saved_at)
        while s.state.step < s.cfg.run.steps:
            if _stopping(s, stop):
                s.log(f"stop requested ({stop.reason or 'on another rank'}): checkpointing step {s.state.step}")
                if saved_at != s.state.step:
                    s.save_checkpoint()
                break
            version, samples = s.state.weight_version, []
            rec = _failing_like_a_step(s, lambda: step(s, samples), saved_at)
            history.append(rec)
            log.write(rec)  # a records file that cannot be written: the step is trained again after --resume
            if s.is_main:  # what the model wrote: decoded on the rank that writes it only
                log.write_samples(rec["step"], completions.rows(rec["step"], samples, s.decode, version,
                                                                s.cfg.run.log_samples))
            if s.run.timeline is not None:
                log.write_timeline(s.run.timeline.take())
            _tell(s, rec, callbacks, progress, saved_at)
            last = s.state.step == s.cfg.run.steps
            if s.cfg.run.save_every > 0 and (s.state.step % s.cfg.run.save_every == 0 or last):
                s.save_checkpoint()
                saved_at = s.state.step
            _failing_like_a_step(s, lambda: _maybe_evaluate(s, log), saved_at)
    finally:
        # a resumed run: all its steps
        log.close(mlog.run_summary(mlog.read(log.path) or history, mlog.read(log.path.parent / "eval.jsonl")))
    return history


def _tell(s: Session, rec: dict[str, Any], callbacks: Sequence[StepCallback], progress, saved_at: int | None) -> None:
    """The caller's callbacks and progress after a completed step and its records, agreed by
    every rank (``rank_failure.agree``). A failure there (a callback's own error) leaves the
    trainer and the records as the step left them, so every rank first checkpoints that step
    (unless it is written already) and then re-raises: the run resumes after it."""
    def tell() -> None:
        for cb in callbacks:
            cb(rec)
        if progress is not None:
            progress(rec)

    try:
        rank_failure.agree(tell, s.dist, "callbacks")
    except BaseException:
        if saved_at != s.state.step:
            path = s.save_checkpoint()
            if path is not None:
                s.log(f"checkpoint of the last completed step written to {path}")
        raise


def _failing_like_a_step(s: Session, run: Callable[[], Any], saved_at: int | None) -> Any:
    """``run()`` (a step or a held-out evaluation); a colocate error writes the checkpoint
    of the last completed step when that is safe (``Session.save_after_failure``; not
    again when this step's periodic one is written) and re-raises. With several ranks a
    failure is first left for the others (``rank_failure.post``), and a collective broken
    by another rank going away becomes one line naming that rank and phase."""
    try:
        with config_terms():  # an engine's error names the config field that fixes it
            return run()
    except USER_ERRORS as exc:
        rank_failure.post(s.dist, s.state.phase, exc)
        path = s.save_after_failure() if s.state.phase != "eval" or saved_at != s.state.step else None
        if path is not None:
            s.log(f"checkpoint of the last completed step written to {path}")
        raise
    except BaseException as exc:
        if s.dist.world_size > 1 and isinstance(exc, RuntimeError) and lost_peer(exc):
            raise rank_failure.RankFailedError(rank_failure.lost_line(s.dist, s.state.phase, exc)) from None
        rank_failure.post(s.dist, s.state.phase, exc)
        raise


def _stopping(s: Session, stop) -> bool:
    """Whether any rank was asked to stop: the ranks agree at each step boundary, so none
    goes on alone into a step the others left."""
    asked = stop is not None and stop.requested
    return any(all_gather_object(asked, s.dist)) if s.dist.world_size > 1 else asked


def _maybe_evaluate(s: Session, log: mlog.MetricsLog) -> None:
    """The held-out evaluation when it is due (rank 0: it only uses the engines; every
    rank learns whether it failed, ``rank_failure.agree``)."""
    if not (s.data.eval_prompts and evaluation.due(s.state.step, s.cfg.run.eval_every, s.cfg.run.steps)):
        return
    s.set_phase("eval")
    samples = []
    rec = rank_failure.agree(lambda: evaluation.evaluate(s, samples) if s.is_main else None, s.dist, "eval")
    s.set_phase("idle")
    if not s.is_main:
        return
    log.write_eval(rec)
    log.write_samples(rec["step"], completions.rows(rec["step"], samples, s.decode, rec["weight_version"],
                                                    s.cfg.run.log_samples), evaluation=True)
    s.log(f"eval after step {rec['step']}: reward {rec['reward_mean']:+.3f} ± {rec['reward_std']:.3f} "
          f"on {rec['prompts']} held-out prompts (greedy, {rec['seconds']:.1f} s)")


def _wandb_run(s: Session):
    if not (s.is_main and s.cfg.run.wandb_project):
        return None
    return WandbRun(s.cfg.run, s.run.out_dir, to_dict(s.cfg), resumed=s.state.step > 0)
