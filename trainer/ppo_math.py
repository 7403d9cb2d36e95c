"""Pure PPO math: per-token log-probs and entropy from logits, masked statistics, GAE,
KL-shaped token rewards, KL estimators, the clipped policy and value losses with their
aggregation modes, and the staleness correction for tokens generated under older weights
(truncated importance weights, staleness mask).

Every function is pure (tensors in, tensors out, no module state). Tensors are
right-padded response tensors of shape [B, T]: B rows, T response positions, `mask` is
1/True on valid response tokens followed by 0/False padding. Masks may be bool or 0/1
numbers. Padded positions never leak into a result: they are excluded from every mean
and come out as 0 in every [B, T] output. A mask may also have holes (a loss mask without
a multi-turn trajectory's environment tokens, or without stale tokens): a hole is treated
like padding, except by GAE, where a hole in `mask` ends the episode and environment
tokens are passed as `acting` instead.

Left out: models and forward passes, micro-batching, optimizers, and the KL coefficient
schedule (`trainer/kl_control.py`). GAE, token rewards and importance weights are
computed without autograd; the losses detach their targets (old log-probs, advantages,
old values, returns, importance weights) and keep the graph only through `logp`/`values`.
"""

from __future__ import annotations

import typing

import torch

from .sections import AggMode, KLKind

AGG_MODES: tuple[str, ...] = typing.get_args(AggMode)
KL_KINDS: tuple[str, ...] = typing.get_args(KLKind)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16 inputs, otherwise the input's (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _zero_padded(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on valid tokens, exactly 0 on padding (also when x holds inf/NaN there)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------- logits -> per token


def token_logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) at `tokens`, without a [B, T, V] log-softmax.

    logits: [B, T, V], tokens: [B, T] (valid vocabulary ids everywhere, pad included).
    Returns [B, T] in float32 (float64 for float64 logits). Rows are processed one at a
    time, so the only extra memory is one [T, V] float32 copy:
    logp = logit[token] - logsumexp(logit). Differentiable with respect to `logits`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = _compute_dtype(logits.dtype)
    rows = []
    for row_logits, row_tokens in zip(logits, tokens):  # [T, V], [T]
        row = row_logits.to(dtype)
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_tokens.long().unsqueeze(-1)).squeeze(-1)  # [T]
        rows.append(picked - torch.logsumexp(row, dim=-1))  # [T]
    return torch.stack(rows) if rows else logits.new_zeros(tokens.shape, dtype=dtype)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: logsumexp(l) - sum(softmax(l) * l).

    logits: [B, T, V] -> [B, T] in float32 (float64 for float64 logits), one row at a time.
    """
    dtype = _compute_dtype(logits.dtype)
    rows = []
    for row_logits in logits:  # [T, V]
        row = row_logits.to(dtype)
        probs = torch.softmax(row, dim=-1)  # [T, V]
        rows.append(torch.logsumexp(row, dim=-1) - (probs * row).sum(-1))  # [T]
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1], dtype=dtype)


# ---------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over valid positions (over all of them, or along `dim`).

    x, mask: [B, T]. dim=None -> 0-dim tensor; dim=-1 -> [B]. A slice with no valid
    position has mean 0 (never NaN).
    """
    valid = mask.bool()
    if dim is None:
        return _zero_padded(x, valid).sum() / valid.sum().clamp_min(1)
    return _zero_padded(x, valid).sum(dim) / valid.sum(dim).clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all valid positions -> 0-dim tensor.

    unbiased=True applies Bessel's correction n / (n - 1). With fewer than two valid
    positions the variance is 0 (there is no spread to measure), never NaN.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        n = mask.bool().sum()
        var = var * n / (n - 1).clamp_min(1)  # n <= 1: biased var is already 0
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over valid tokens only.

    x, mask: [B, T] -> [B, T]. shift_mean=False adds the mean back (scales only).
    Padded positions come out as 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)  # [B, T]
    if not shift_mean:
        whitened = whitened + mean
    return _zero_padded(whitened, mask)


# ---------------------------------------------------------------- rewards and advantages


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
    acting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) on right-padded rows.

    rewards, values, mask, acting: [B, T] -> (advantages [B, T], returns [B, T]).
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, where
    V and A after a row's last valid token are 0 (the episode ends there).
    returns = advantages + values. Both are 0 on padding. One vectorised step per t.
    A 0 inside a row also ends the episode there: nothing flows back across it. So pass
    the full response mask here, and apply loss-only masks (staleness) to the losses.

    `acting` (None: equal to `mask`) marks the tokens that are decisions (the policy
    sampled them). A token with mask 1 and acting 0 (an environment token inside a
    multi-turn trajectory) is in the episode but is no step of it: its advantage and
    return are 0, its reward and value are not read, and the recursion passes through
    it (V_{t+1} and A_{t+1} carry over unchanged, undiscounted), so the model token
    before a tool output bootstraps from the value of the first model token after it.
    Equal to plain GAE over each row with its non-acting tokens removed (verl's
    multi-turn GAE: no values or TD errors on observation tokens).
    """
    valid = mask.bool()
    act = valid if acting is None else valid & acting.bool()  # [B, T]
    dtype = _compute_dtype(values.dtype)
    r = _zero_padded(rewards.to(dtype), act)  # [B, T]
    v = _zero_padded(values.to(dtype), act)  # [B, T]
    zero = torch.zeros((), dtype=dtype, device=v.device)
    advantages = torch.zeros_like(v)  # [B, T]
    next_value = torch.zeros_like(v[:, 0])  # [B]
    next_adv = torch.zeros_like(v[:, 0])  # [B]
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        adv = _zero_padded(delta + gamma * lam * next_adv, act[:, t])  # [B]
        advantages[:, t] = adv
        # acting: this step; padding: the episode ends (0); environment token: carry over
        next_adv = torch.where(act[:, t], adv, torch.where(valid[:, t], next_adv, zero))  # [B]
        next_value = torch.where(act[:, t], v[:, t], torch.where(valid[:, t], next_value, zero))  # [B]
    returns = _zero_padded(advantages + v, act)  # [B, T]
    return advantages, returns


@torch.no_grad()
def token_rewards(
    score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """KL-shaped per-token reward (Ziegler et al. 2019; TRL's PPO).

    score: [B], kl: [B, T], mask: [B, T] -> [B, T]: -kl_coef * kl on every valid token,
    plus score[b] on row b's last valid token; 0 on padding. A row with no valid token
    gets no score. `mask` may have holes (a loss mask with environment tokens): the
    score still goes to the last valid token of the row only.
    """
    valid = mask.bool()  # [B, T]
    dtype = _compute_dtype(kl.dtype)
    valid_from_here = valid.flip(-1).cumsum(-1).flip(-1)  # [B, T] valid tokens at t or later
    is_last = (valid & (valid_from_here == 1)).to(dtype)  # [B, T]
    penalty = _zero_padded(-kl_coef * kl.to(dtype), valid)  # [B, T]
    return penalty + is_last * score.to(dtype)[:, None]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman 2020).

    logp, ref_logp: [B, T] -> [B, T], unmasked (the caller masks).
    k1 = logp - ref; k2 = 0.5 * (logp - ref)^2; k3 = exp(ref - logp) - (ref - logp) - 1,
    computed with expm1 so it is >= 0 in floating point too.
    """
    log_ratio = logp - ref_logp  # [B, T]
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


# ---------------------------------------------------------------- losses


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: AggMode) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over valid tokens.

    token-mean: sum over valid tokens / number of valid tokens in the batch.
    seq-mean-token-mean: mean over rows of each row's token mean.
    seq-mean-token-sum: mean over rows of each row's token sum.
    Row means are over rows with at least one valid token; an empty batch gives 0.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {mode!r}")
    valid = mask.bool()
    x = _zero_padded(per_token, valid)  # [B, T]
    if mode == "token-mean":
        return x.sum() / valid.sum().clamp_min(1)
    row_n = valid.sum(-1)  # [B]
    row_loss = x.sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        row_loss = row_loss / row_n.clamp_min(1)
    return row_loss.sum() / (row_n > 0).sum().clamp_min(1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    agg: AggMode = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate: per token max(-A * r, -A * clip(r, 1 - eps, 1 + eps)).

    logp, old_logp, advantages, mask, is_weights: [B, T]; r = exp(logp - old_logp).
    `is_weights` (e.g. truncated importance weights for stale tokens) multiply the
    per-token loss. Returns (scalar loss, stats) with detached 0-dim stats:
    clip_frac (valid tokens where the clipped term is the active one),
    approx_kl (mean of 0.5 * (logp - old_logp)^2), ratio_mean.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    log_ratio = logp - old_logp  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)  # [B, T]
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, agg)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    agg: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: per token 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2).

    values, old_values, returns, mask: [B, T]. Returns (scalar loss, stats) with the
    detached 0-dim stat vf_clip_frac (valid tokens where the clipped error is larger).
    """
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = torch.clamp(values, old_values - clip_eps, old_values + clip_eps)  # [B, T]
    unclipped_err = (values - returns).square()  # [B, T]
    clipped_err = (clipped_values - returns).square()  # [B, T]
    per_token = 0.5 * torch.maximum(unclipped_err, clipped_err)  # [B, T]
    loss = aggregate_loss(per_token, mask, agg)
    with torch.no_grad():
        stats = {"vf_clip_frac": masked_mean((clipped_err > unclipped_err).to(values.dtype), mask)}
    return loss, stats


# ---------------------------------------------------------------- staleness correction


@torch.no_grad()
def truncated_is_weights(
    behaviour_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights min(pi_old / pi_behaviour, cap) per token.

    behaviour_logp (the weights that sampled the token), old_logp (the weights being
    trained from), mask: [B, T] -> [B, T] detached weights, 0 on padding.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    dtype = _compute_dtype(old_logp.dtype)
    weights = torch.exp(old_logp.to(dtype) - behaviour_logp.to(dtype)).clamp(max=cap)  # [B, T]
    return _zero_padded(weights, mask)


def staleness_mask(
    token_versions: torch.Tensor, current_version: int, max_staleness: int, mask: torch.Tensor
) -> torch.Tensor:
    """Valid tokens sampled at most `max_staleness` weight versions ago.

    token_versions (int weight version that sampled each token), mask: [B, T] ->
    [B, T] bool, True where mask and version >= current_version - max_staleness.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return mask.bool() & (token_versions >= current_version - max_staleness)
