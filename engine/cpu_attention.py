"""colocate's attention backend for SGLang's CPU engines: one attention call per layer for
a decode batch, and a prefill that attends only its new tokens.

Owns: :class:`CpuAttnBackend`, registered with SGLang as ``colocate_cpu``
(``engine.sglang_api.plugin``, run by SGLang in each of its processes) and the CPU engines'
default (``engine_config.default_attention_backend``). It is SGLang's ``torch_native``
backend (its KV cache layout, its reads and writes, ``torch``'s ``scaled_dot_product_attention``)
with its two per-request loops changed:

- **decode**: ``torch_native`` runs about ten torch calls per request in every layer (index
  the request's slots, gather its keys and values, one attention call, copy the output
  back), so a decode step's cost grows with the batch even where the matmuls' does not.
  Here the batch's slots are read once per forward (``[B, L]``, padded to the longest
  sequence, the padding masked) and every layer gathers keys and values for the whole
  batch and makes one attention call; a batch whose gathered keys and values would pass
  :data:`GATHER_BYTES` (large models, long contexts) goes in row chunks under it, each
  padded to its own longest sequence.
- **extend** (prefill, chunked prefill, a prompt found in the radix cache): ``torch_native``
  attends every position of a request, the cached prefix's included, and throws the
  prefix's outputs away; a streamed scoring request, which extends a prefix chunk by
  chunk, pays its whole prefix's attention again for every chunk. Here a request's new
  tokens are the only queries (keys: prefix and new tokens, causal from the prefix's end).

What it leaves to ``torch_native`` (the parent's own code path): cross-attention, encoder
offsets, sliding windows, non-causal (encoder-only) layers, key and value widths that
differ, a sliding-window KV pool; and any forward mode other than decode and extend.
Nothing else changes: the results equal ``torch_native``'s up to float rounding
(``tests/unit/test_cpu_attention.py`` compares them on SGLang's real pools).

Leaves out: registering the name (``engine.sglang_api.plugin``), which backend an engine
uses (``engine.engine_config``). Imported only inside SGLang's processes, by the factory
the plugin registers.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

# a decode layer's gathered keys and values at most (with their cast to the query's dtype);
# a larger batch goes in row chunks (at SmolLM2's shape, b64 x 1,024 tokens is 50 MB)
GATHER_BYTES = 256 << 20


class CpuAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with a batched decode and a prefix-aware extend (module doc)."""

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        # this forward's decode slots: (its seq_lens, slots [B, L], keep [B, 1, 1, L]), read by its first layer
        self._decode_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._extend_rows: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (seq_lens, each request's slots)
        self.gather_bytes = GATHER_BYTES

    def init_forward_metadata(self, forward_batch) -> None:
        """The parent's metadata; a decode batch's KV slots are read again (by its first layer)."""
        super().init_forward_metadata(forward_batch)
        self._decode_slots = self._extend_rows = None

    def _slots(self, forward_batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode batch's (slots, keep), read once per forward for every layer (again
        whenever the batch's ``seq_lens`` is another tensor: never a past batch's slots)."""
        if self._decode_slots is None or self._decode_slots[0] is not forward_batch.seq_lens:
            self._decode_slots = (forward_batch.seq_lens, *decode_slots(
                self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens))
        return self._decode_slots[1], self._decode_slots[2]

    def _extend_slots(self, forward_batch) -> list[torch.Tensor]:
        """Each extended request's KV slots (prefix and new tokens), read once per forward
        for every layer (again whenever the batch's ``seq_lens`` is another tensor)."""
        if self._extend_rows is None or self._extend_rows[0] is not forward_batch.seq_lens:
            table = self.req_to_token_pool.req_to_token
            rows = forward_batch.req_pool_indices.tolist()
            ends = [p + n for p, n in zip(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu)]
            self._extend_rows = (forward_batch.seq_lens, [table[r, :e] for r, e in zip(rows, ends)])
        return self._extend_rows[1]

    def _own_path(self, layer, forward_batch) -> bool:
        """Whether this layer's attention is the plain causal self-attention this backend computes."""
        return (not layer.is_cross_attention and forward_batch.encoder_lens is None
                and layer.attn_type == AttentionType.DECODER
                and (layer.sliding_window_size is None or layer.sliding_window_size < 0)
                and layer.qk_head_dim == layer.v_head_dim and not self.use_sliding_window_kv_pool)

    def _save(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not self._own_path(layer, forward_batch):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        self._save(layer, forward_batch, k, v, save_kv_cache)
        slots, keep = self._slots(forward_batch)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        query = q.reshape(-1, heads, 1, dim)  # [B, H, 1, D]
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        cast = 0 if k_cache.dtype == query.dtype else 2 * query.element_size()
        row_bytes = slots.shape[1] * k_cache[0].numel() * (k_cache.element_size() + v_cache.element_size() + cast)
        chunks = row_chunks(slots.shape[0], row_bytes, self.gather_bytes)
        parts = []
        for a, b in chunks:
            rows, mask = slots[a:b], keep[a:b]
            if len(chunks) > 1:  # a chunk padded to its own longest sequence
                longest = int(forward_batch.seq_lens[a:b].max())
                rows, mask = rows[:, :longest], mask[..., :longest]
            keys = k_cache[rows].transpose(1, 2).to(query.dtype)  # [b, Hkv, L, D]
            values = v_cache[rows].transpose(1, 2).to(query.dtype)
            parts.append(scaled_dot_product_attention(query[a:b], keys, values, attn_mask=mask, scale=layer.scaling,
                                                      enable_gqa=heads != layer.tp_k_head_num))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(-1, heads * dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        prefixes, news = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        if prefixes is None or news is None or not self._own_path(layer, forward_batch):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        self._save(layer, forward_batch, k, v, save_kv_cache)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        query = q.reshape(-1, heads, dim)
        out = torch.empty_like(query)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        start = 0
        for slots, prefix, new in zip(self._extend_slots(forward_batch), prefixes, news):
            out[start:start + new] = extend_attention(
                query[start:start + new], k_cache[slots], v_cache[slots], prefix, layer.scaling,
                heads != layer.tp_k_head_num)
            start += new
        return out.reshape(-1, heads * dim)


def row_chunks(rows: int, row_bytes: int, budget: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of at most ``budget`` bytes each at ``row_bytes`` a row
    (at least one row a chunk; no rows: one empty range)."""
    per = max(1, budget // max(1, row_bytes))
    return [(a, min(rows, a + per)) for a in range(0, rows, per)] or [(0, 0)]


def decode_slots(req_to_token: torch.Tensor, rows: torch.Tensor,
                 seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode batch's KV slots ``[B, L]`` (L: its longest sequence; a shorter one's tail
    points at slot 0) and which of them are its own, ``[B, 1, 1, L]`` (an attention mask)."""
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    keep = torch.arange(longest, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [B, L]
    slots = torch.where(keep, req_to_token[rows, :longest], 0).long()
    return slots, keep[:, None, None, :]


def extend_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int,
                     scale: float | None, gqa: bool) -> torch.Tensor:
    """One request's new tokens attending causally to its prefix and themselves.

    query [n, H, D] (the n new tokens), keys and values [prefix + n, Hkv, D] -> [n, H, D]."""
    n = query.shape[0]
    q, key, value = query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    key, value = key.to(q.dtype), value.to(q.dtype)
    if prefix == 0:
        out = scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # query i sits at position prefix + i: it sees keys 0 .. prefix + i
        seen = torch.arange(prefix + n, device=q.device)[None, :] <= prefix + torch.arange(n, device=q.device)[:, None]
        out = scaled_dot_product_attention(q, key, value, attn_mask=seen, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
