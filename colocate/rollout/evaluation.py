"""Held-out evaluation: the policy's reward on a fixed prompt set, between steps.

The training reward of one step mixes learning with which prompts the step drew (some
topics score low whatever the policy says). The held-out set is the same every time and
decoded greedily, so its reward moves only when the weights do: the learning curve.

Owns: splitting the held-out prompts off the prompt set, when an evaluation is due, and
one evaluation (greedy generation on the actor engine, the same reward as training: the
reward engine, or the feeder's when the reward model lives in the feeder's process).
Leaves out: logging (``colocate.monitor.metrics``) and the loop around it (``colocate.run.loop``).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Sequence, TypeVar


T = TypeVar("T")


def split_held_out(prompts: Sequence[T], n: int) -> tuple[list[T], list[T]]:
    """(training prompts, the last ``n`` prompts held out for evaluation): at most a quarter
    of the source, so a small prompt file still trains on most of it (none held out from
    fewer than 4 prompts)."""
    n = min(max(n, 0), len(prompts) // 4)
    if n == 0:
        return list(prompts), []
    return list(prompts[:-n]), list(prompts[-n:])


def held_out_note(asked: int, held: int, total: int) -> str | None:
    """The start-up line when ``data.eval_prompts`` holds out fewer prompts than ``asked``
    (``split_held_out``'s cap: a quarter of the source's ``total``), else None."""
    if held >= asked:
        return None
    kept = "none" if held == 0 else f"only {held}"
    return (f"data.eval_prompts={asked}: {kept} of the source's {total} prompts held out (at most a quarter; "
            f"none from fewer than 4), training on {total - held}")


def due(step: int, every: int, last_step: int) -> bool:
    """Evaluate the weights after ``step`` updates: at 0, every ``every`` steps and at the end."""
    return every > 0 and (step % every == 0 or step == last_step)


def evaluate(session, answered: list | None = None) -> dict[str, Any]:  # noqa: ANN001 - colocate.run.session.Session
    """Greedy responses of the current actor engine weights to the held-out prompts, scored
    like training (reward model and/or functions, ``reward.scale``) -> the eval record
    (``answered``, when given, gets the samples). Non-finite scores are counted
    (``non_finite``) and left out of the mean."""
    s = session
    started = time.perf_counter()
    samples = s.data.eval_samples(s.cfg.rollout.max_new_tokens)
    s.rollouts.evaluate(samples, s.state.step)
    if answered is not None:
        answered.extend(samples)
    scores = [x.score for x in samples]  # rewards: reward.scale applied (colocate.rollout.generate_and_score)
    finite = [v for v in scores if math.isfinite(v)]  # a reward model's NaN, an overflowing sum
    return {
        "step": s.state.step,
        "weight_version": s.state.weight_version,
        "prompts": len(scores),
        "non_finite": len(scores) - len(finite),
        "reward_mean": statistics.fmean(finite) if finite else float("nan"),
        "reward_std": statistics.pstdev(finite) if finite else float("nan"),
        "response_len": statistics.fmean(len(x.output_ids) for x in samples),
        "seconds": time.perf_counter() - started,
        "scores": scores,  # per held-out prompt, in a fixed order: compare evaluations prompt by prompt
    }
