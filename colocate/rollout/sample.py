"""A sample: one response to a prompt, from the prompt to the trained batch.

Owns: :class:`Sample` (one prompt's generation state in plain Python: tokens, sampling
logprobs and the weight version of every token, for a multi-turn trajectory which tokens
came from the environment, and where it is in its life, :class:`Status`), request ids
that SGLang's prefix-matching abort cannot confuse, the group/member index encoding and
the engine ranks' union of it (:func:`union_id`), a multi-turn trajectory's settings
(:class:`MultiTurn`, :class:`TurnReply`) and the budget check against a context.

Leaves out: generating and scoring it (``colocate.rollout.generate_and_score``), which
samples to launch or defer (``colocate.rollout.data_source``), the step's schedule
(``colocate.rollout.schedule``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Awaitable, Callable, Sequence

from colocate.errors import ColocateError

# a sample's new tokens as they arrive (streamed scoring, a parked stream's relay)
OnTokens = Callable[["Sample", list[int]], Awaitable[None] | None]


@dataclasses.dataclass(frozen=True)
class TurnReply:
    """The environment's answer to a model turn: the tokens to append (out of the loss) and
    their chat message ({role, content}), a reward, and whether the trajectory ends (then
    nothing is appended)."""

    ids: list[int]
    message: dict[str, str] = dataclasses.field(default_factory=dict)
    reward: float = 0.0
    done: bool = False


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    """How a trajectory goes on after a model turn: ``answer(sample)`` (async) gives the
    environment's reply; at most ``max_turns`` model turns, each at most ``turn_tokens``
    tokens (0: only the trajectory's budget, ``Sample.max_new_tokens``, which counts
    the environment's tokens too)."""

    answer: Callable[["Sample"], Awaitable[TurnReply]]
    max_turns: int = 4
    turn_tokens: int = 0


class PromptTooLongError(ColocateError):
    """A prompt plus its token budget does not fit the engine's context."""


def sample_index(group: int, member: int, n: int) -> int:
    """The index of member ``member`` of group ``group`` (``n`` samples per group): samples
    of one group are ``n`` consecutive indices, group g holding g·n … g·n + n - 1. The one
    place this encoding lives (the data source names by it and checks its fresh groups by it)."""
    return group * n + member


def union_id(local: int, rank: int, ranks: int) -> int:
    """Engine rank ``rank``'s ``local``-th group (or stream position) in the union of
    ``ranks`` ranks' shares: interleaved, so the union is what one rank would have drawn.
    Samples are named by it when drawn (``DataSource.groups``), never renamed after."""
    return local * ranks + rank


def group_member(index: int, n: int) -> tuple[int | None, int]:
    """(group, member) of sample ``index``; group None with ``n`` = 1 (a group of its own)."""
    return (index // n if n > 1 else None), index % n


class Status(str, enum.Enum):
    """Where a sample is in its life (``Sample.status``): made and not yet sent (waiting), its
    request in the engine or its environment answering (running), its request kept paused
    in the engine across a step boundary (parked), ended by a stop token, its budget or its
    environment (finished: to score and train, now or in a later batch), or cut at a step's
    end with its partial kept for a later step (deferred). Only the step's schedule
    (``colocate.rollout.schedule``) changes it. Checkpoints store the value (a plain string)."""

    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED = "finished"
    DEFERRED = "deferred"


ENDED = ("stop", "length")  # the engine's finish reasons of a finished request


@dataclasses.dataclass
class Sample:
    """One response to a prompt, from the prompt to the trained batch: the prompt (ids and
    source record), its group (the samples of one prompt), its budget, everything generated
    so far (tokens, sampling logprobs, the weight version of every token), its status and its
    score. Plain JSON-safe fields (`state` / `from_state`): checkpoints carry deferred
    samples as they are."""

    # its name: unique over a run, in the engine ranks' union, increasing in draw order; given
    # when drawn, changed only by a resume on another number of engine ranks (redistribute)
    index: int
    prompt_ids: list[int]
    max_new_tokens: int  # the response's token budget
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampling logprobs
    versions: list[int] = dataclasses.field(default_factory=list)  # weight version per token
    finish_reason: str | None = None  # the engine's, of its last request: stop | length | abort | None (not started)
    status: Status = Status.WAITING
    attempts: int = 0
    group: int | None = None  # samples of one prompt share it; None: a group of its own
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt's source record (rule rewards)
    score: float | None = None  # reward (model + functions) once scored
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # score's terms: model, env, each function
    cached_tokens: int = 0  # prompt tokens the engine served from its radix cache (first attempt)
    # multi-turn trajectories (empty/False/0 for a single response):
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 model token, 0 environment token; [] all model
    observations: list[dict[str, str]] = dataclasses.field(default_factory=list)  # the environment's answers: {role, content}
    awaiting_env: bool = False  # the model's last turn ended and the environment has not answered it yet
    env_reward: float = 0.0  # the environment's rewards so far, summed
    turn_cached_tokens: int = 0  # context tokens later turns' requests found in the radix cache

    def __post_init__(self) -> None:
        self.status = Status(self.status)  # a stored value back to its member

    def state(self) -> dict[str, Any]:
        """The sample as plain JSON/torch-safe values (the status as its string). A request
        does not outlive the process: a sample running or parked is saved as deferred, cut
        here (``abort``), which is what an abort at this point gives; a resumed run sends its
        rest as a new request."""
        state = {**dataclasses.asdict(self), "status": self.status.value}
        if self.status in (Status.RUNNING, Status.PARKED):
            state |= {"status": Status.DEFERRED.value, "finish_reason": "abort"}
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        """A sample from `state` (`state()`'s values, the status included)."""
        return cls(**state)

    def settle(self) -> None:
        """Its status once its stream ended, from the engine's finish reason: finished on
        stop or length, else deferred (cut by the step; its partial waits for a later one)."""
        self.status = Status.FINISHED if self.finish_reason in ENDED else Status.DEFERRED

    @property
    def done(self) -> bool:
        """Finished and scored: nothing is left but training it. A stream that ended while
        parked is finished, not done: a step adopts it to score it."""
        return self.status is Status.FINISHED and self.score is not None

    @property
    def group_id(self) -> int:
        return self.index if self.group is None else self.group

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def mask(self) -> list[int]:
        """1 on each output token the model sampled, 0 on the environment's tokens."""
        return self.loss_mask or [1] * len(self.output_ids)

    @property
    def turns(self) -> int:
        """The model's turns so far (runs of model tokens)."""
        m = self.mask()
        return sum(1 for i, x in enumerate(m) if x and (i == 0 or not m[i - 1]))

    @property
    def turn_tokens(self) -> int:
        """Tokens of the model's current turn (after the last environment token)."""
        m = self.mask()
        return len(m) - (max((i for i, x in enumerate(m) if not x), default=-1) + 1)

    def append_observation(self, ids: Sequence[int], message: dict[str, str], version: int) -> None:
        """The environment's answer: its tokens join the context, out of the loss (logprob
        0.0, the version of the model token before them)."""
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.output_ids)
        self.output_ids += list(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else version] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.observations.append(dict(message))

    def rid(self, tag: str) -> str:
        """Fixed-width id: SGLang's abort matches by prefix, so no id may prefix another."""
        return f"{tag}-{self.index:08d}-{self.attempts:04d}"


def check_budget(samples: Sequence[Sample], context_length: int, field: str = "prompts") -> None:
    """Refuse a sample whose prompt + budget cannot fit ``context_length``."""
    for s in samples:
        need = len(s.prompt_ids) + s.max_new_tokens
        if need > context_length:
            raise PromptTooLongError(
                f"{field}[{s.index}]: {len(s.prompt_ids)} prompt tokens + max_new_tokens "
                f"{s.max_new_tokens} = {need} > the actor's context length {context_length}; "
                "shorten the prompt (data.max_prompt_tokens) or lower max_new_tokens"
            )
