"""The training batch of one PPO step: rollouts turned into right-padded tensors.

Owns: `TrainBatch` (prompt+response token ids, masks, scores, and per-token behaviour
log-probs and weight versions of the sampled responses), its minibatch split and row
selection, and `response_logits`, which picks from a model's [B, L, V] logits the rows
that predict each response token. A multi-turn response (a trajectory) also holds the
environment's tokens (tool outputs between model turns): context, but never trained on.

Leaves out: where rollouts come from (colocate's rollout room), forward passes and losses
(`trainer/forward.py`, `trainer/ppo_math.py`), and how rows are split across ranks
(`trainer/ppo_trainer.py`).

Layout of row b (P = len(prompts[b]), R = len(responses[b])):
  input_ids[b]      = prompt (P) + response (R) + pad           [L]
  responses[b]      = response (R) + pad                         [T]
  response_mask[b]  = 1 on the R response tokens, 0 after        [T]
  loss_mask[b]      = response_mask[b], 0 on environment tokens  [T]
  response_start[b] = P: input position of the first response token
The logit that predicts response token t sits at input position P - 1 + t.
response_mask says which positions exist (forwards, packing, values); loss_mask says
which the policy sampled (losses, KL, advantages, staleness). Without environment tokens
the two are equal.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import torch


class Trained(Protocol):
    """What the trainer reads of one scored sample (``colocate.rollout.sample.Sample`` is one):
    its prompt and response ids, reward, sampling log-probs and weight version per response
    token, group, and which response tokens the model sampled (empty: all)."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    score: float | None
    logprobs: Sequence[float]
    versions: Sequence[int]
    loss_mask: Sequence[int]

    @property
    def group_id(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Tensors of B rollouts; every field has B rows. See the module docstring for the layout."""

    input_ids: torch.Tensor  # [B, L] long, prompt + response, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L] long, 1 on prompt + response tokens
    response_start: torch.Tensor  # [B] long, prompt lengths
    response_mask: torch.Tensor  # [B, T] bool, True on response tokens
    loss_mask: torch.Tensor  # [B, T] bool, True on tokens the policy sampled (trained on): response_mask minus env tokens
    responses: torch.Tensor  # [B, T] long, response ids, right-padded with pad_id
    scores: torch.Tensor  # [B] float32, sequence-level reward
    behaviour_logp: torch.Tensor  # [B, T] float32, logprob under the sampling weights, 0 on pad
    versions: torch.Tensor  # [B, T] long, weight version that sampled each token, 0 on pad
    groups: torch.Tensor  # [B] long, equal for samples of one prompt (critic-free baselines)

    @property
    def size(self) -> int:
        """B, the number of rows."""
        return int(self.input_ids.shape[0])

    def __len__(self) -> int:
        return self.size

    def select(self, idx: torch.Tensor) -> TrainBatch:
        """Sub-batch of the rows `idx` (a [b] long tensor), in that order."""
        idx = idx.to(device=self.input_ids.device, dtype=torch.long)
        return TrainBatch(**{f.name: getattr(self, f.name)[idx] for f in dataclasses.fields(self)})

    def trimmed(self) -> TrainBatch:
        """The same rows without trailing input columns that are padding in every row (exact for causal models)."""
        used = int(self.attention_mask.sum(-1).max()) if self.size else 0
        used = max(used, 1)
        return dataclasses.replace(
            self, input_ids=self.input_ids[:, :used], attention_mask=self.attention_mask[:, :used]
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on `device`."""
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def minibatches(self, n: int, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """A shuffled split of range(B) into `n` equal [B / n] index tensors; each row in exactly one.

        B must be divisible by n, so every minibatch (and every rank's share of it) has
        the same number of rows. Groups (samples of one prompt: contiguous, of one size g)
        stay whole when a minibatch holds a whole number of them: the groups are shuffled,
        not the rows (verl's minibatches of prompts), so a shared-prefix packed row
        (`trainer/packed.py`) carries each prompt once in training too.
        """
        if n < 1 or self.size % n:
            raise ValueError(f"batch of {self.size} rows does not split into {n} equal minibatches")
        g = group_span(self.groups)
        if g > 1 and (self.size // n) % g == 0:
            order = (torch.randperm(self.size // g, generator=generator)[:, None] * g + torch.arange(g)).flatten()
        else:
            order = torch.randperm(self.size, generator=generator)  # [B]
        return list(order.chunk(n))


def group_span(groups: torch.Tensor) -> int:
    """g when `groups` [B] is blocks of g equal ids, each block's id its own (1 otherwise)."""
    ids = groups.tolist()
    b = len(ids)
    starts = [0] + [i for i in range(1, b) if ids[i] != ids[i - 1]]
    sizes = {end - start for start, end in zip(starts, starts[1:] + [b])}
    distinct = len(set(ids)) == len(starts)
    return sizes.pop() if len(sizes) == 1 and distinct and b else 1


def batch_of(samples: Sequence[Trained], pad_id: int) -> TrainBatch:
    """The `TrainBatch` of scored samples, one row each in their order (`make_batch`'s
    rules: a multi-turn sample's environment tokens out of the loss)."""
    return make_batch([x.prompt_ids for x in samples], [x.output_ids for x in samples], pad_id,
                      [x.score for x in samples], [x.logprobs for x in samples], [x.versions for x in samples],
                      [x.group_id for x in samples], loss_masks=[x.loss_mask for x in samples])


def make_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    scores: Sequence[float],
    behaviour_logprobs: Sequence[Sequence[float]],
    token_versions: Sequence[Sequence[int]],
    groups: Sequence[int] | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> TrainBatch:
    """Right-padded `TrainBatch` from per-row token lists (all sequences have B rows).
    `groups`: each row's group id (samples of one prompt); None: every row its own group.
    `loss_masks`: per row, 1 on each response token the model sampled and 0 on each
    environment token (as long as responses[b]), or empty: every token the model's;
    None: every response token of every row is the model's (loss_mask == response_mask).

    Each prompt must be non-empty (the first response token is predicted from the last
    prompt token); responses may be empty. behaviour_logprobs[b] and token_versions[b]
    must be as long as responses[b]. T is at least 1, so an all-empty batch has a
    one-column, fully masked response.
    """
    _check_rows(prompts, responses, scores, behaviour_logprobs, token_versions)
    if groups is not None and len(groups) != len(prompts):
        raise ValueError(f"{len(groups)} group ids for {len(prompts)} rows")
    _check_loss_masks(responses, loss_masks)
    batch = len(prompts)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    width = max(1, max(len(r) for r in responses))
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((batch, length), dtype=torch.long)  # [B, L]
    response_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros((batch, width), dtype=torch.bool)  # [B, T]
    behaviour = torch.zeros((batch, width), dtype=torch.float32)  # [B, T]
    versions = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch, width), dtype=torch.bool)  # [B, T]
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        p, r = len(prompt), len(response)
        input_ids[b, : p + r] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[b, : p + r] = 1
        if r:
            response_ids[b, :r] = torch.tensor(response, dtype=torch.long)
            response_mask[b, :r] = True
            behaviour[b, :r] = torch.tensor(behaviour_logprobs[b], dtype=torch.float32)
            versions[b, :r] = torch.tensor(token_versions[b], dtype=torch.long)
            row_mask = loss_masks[b] if loss_masks is not None and len(loss_masks[b]) else [1] * r
            loss_mask[b, :r] = torch.tensor([bool(x) for x in row_mask], dtype=torch.bool)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_start=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        response_mask=response_mask,
        loss_mask=loss_mask,
        responses=response_ids,
        scores=torch.tensor(list(scores), dtype=torch.float32),
        behaviour_logp=behaviour,
        versions=versions,
        groups=torch.tensor(list(groups) if groups is not None else range(batch), dtype=torch.long),
    )


def _check_rows(prompts, responses, scores, behaviour_logprobs, token_versions) -> None:  # noqa: ANN001
    sizes = [len(x) for x in (prompts, responses, scores, behaviour_logprobs, token_versions)]
    if len(set(sizes)) != 1 or not prompts:
        raise ValueError(
            "prompts, responses, scores, behaviour_logprobs and token_versions need the same "
            f"non-zero number of rows, got {sizes}"
        )
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        if not prompt:
            raise ValueError(f"row {b}: empty prompt (the first response token needs a context)")
        if len(behaviour_logprobs[b]) != len(response) or len(token_versions[b]) != len(response):
            raise ValueError(
                f"row {b}: {len(response)} response tokens but {len(behaviour_logprobs[b])} "
                f"behaviour logprobs and {len(token_versions[b])} versions"
            )


def _check_loss_masks(responses, loss_masks) -> None:  # noqa: ANN001
    if loss_masks is None:
        return
    if len(loss_masks) != len(responses):
        raise ValueError(f"{len(loss_masks)} loss masks for {len(responses)} rows")
    for b, (response, row) in enumerate(zip(responses, loss_masks)):
        if len(row) and len(row) != len(response):
            raise ValueError(f"row {b}: {len(response)} response tokens but a loss mask of {len(row)}")
        if any(x not in (0, 1) for x in row):
            raise ValueError(f"row {b}: loss mask entries must be 0 or 1, got {sorted(set(row) - {0, 1})}")


def response_positions(batch: TrainBatch) -> torch.Tensor:
    """Input positions whose logits predict each response token -> [B, T] long.

    Row b: response_start[b] - 1 + t, clamped into [0, L - 1] (clamped positions are
    padding, masked by response_mask).
    """
    width = batch.responses.shape[1]
    offsets = torch.arange(width, device=batch.response_start.device)  # [T]
    positions = batch.response_start[:, None] - 1 + offsets[None, :]  # [B, T]
    return positions.clamp(0, batch.input_ids.shape[1] - 1)


def response_logits(model_logits: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """The logits that predict each response token: [B, K, V] -> [B, T, V] (one gather).

    ``model_logits`` holds the last K input positions (K = L for every position, smaller
    when the model was asked for fewer, see `logits_kept`)."""
    kept = model_logits.shape[1]
    first = batch.input_ids.shape[1] - kept  # input position of model_logits[:, 0]
    positions = (response_positions(batch) - first).clamp(0, kept - 1).to(model_logits.device)  # [B, T]
    rows = torch.arange(model_logits.shape[0], device=model_logits.device)[:, None]  # [B, 1]
    return model_logits[rows, positions]  # [B, T, V]


def logits_kept(batch: TrainBatch) -> int:
    """How many trailing input positions hold every logit `response_logits` needs: from
    the one before the earliest response start to the end (prompt logits are not needed)."""
    first = max(int(batch.response_start.min()) - 1, 0) if batch.size else 0
    return max(batch.input_ids.shape[1] - first, 1)


def response_values(values: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Per-position values [B, L] -> [B, T]: the value of the state before each response token.

    The state that emits response token t is the context ending at input position
    response_start - 1 + t, so the same positions as `response_logits`; 0 on padding.
    """
    positions = response_positions(batch).to(values.device)  # [B, T]
    picked = values.gather(1, positions)  # [B, T]
    return torch.where(batch.response_mask.to(values.device), picked, torch.zeros_like(picked))
