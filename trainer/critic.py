"""The PPO critic: a decoder-only backbone (no LM head) with a linear value head.

Owns: `ValueModel` (forward -> one value per input position), building it from a HF
folder (`from_pretrained`: the backbone of a causal LM or of a saved critic, plus the
saved head when there is one), and saving it (`save_pretrained`: the backbone as a HF
folder plus `value_head.safetensors`).

Leaves out: sharding (`trainer/distributed.py`), the value loss (`trainer/ppo_math.py`)
and which positions are response positions (`trainer/batch.py`).

Parameter names: the backbone is `model` (as in `*ForCausalLM`), so FSDP finds its layers
at `model.layers` and state-dict keys read `model.layers.0...`, `value_head.weight`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """values[b, i] = head(hidden state of the backbone at position i)."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear | None = None, seed: int = 0) -> None:
        super().__init__()
        self.model = backbone
        hidden = backbone.config.hidden_size
        self.value_head = value_head if value_head is not None else _new_head(hidden, seed)

    @property
    def config(self):  # noqa: ANN201 - the backbone's transformers config
        return self.model.config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, **attention_kwargs,
    ) -> torch.Tensor:
        """input_ids, attention_mask, position_ids: [B, L] -> values [B, L] (float32).

        Packed rows (`trainer/packed.py`): no attention mask, position ids restarting at
        each sequence, the sequence boundaries in `attention_kwargs` (`cu_seq_lens_q`, ...)
        for varlen attention; shared-prefix rows: their [1, 1, N, N] bool mask as
        `attention_mask` (used as given) and `shared_prefix_blocks`. No KV cache: with one,
        transformers would not detect packed rows.
        """
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **attention_kwargs).last_hidden_state  # [B, L, H]
        values = self.value_head(hidden).squeeze(-1)  # [B, L]
        return values.to(torch.float32, copy=True)  # a copy, not a view: FSDP2 hooks the output

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, seed: int = 0,
        trust_remote_code: bool = False, attn_implementation: str | None = None,
    ) -> ValueModel:
        """Backbone of the model in `path`; the head from `value_head.safetensors` if present, else new.

        A new head has weights ~ N(0, std=1 / (H + 1)) under `seed` (without touching the
        global RNG), bias 0, so initial values are small and every rank gets the same head.
        """
        from transformers import AutoModel, AutoModelForCausalLM

        from .model_files import model_architecture

        kw = dict(dtype=dtype, trust_remote_code=trust_remote_code)
        if attn_implementation is not None:
            kw["attn_implementation"] = attn_implementation
        backbone = None
        if model_architecture(path).endswith("ForCausalLM"):
            # loaded as the causal LM it is, then its LM head dropped: AutoModel on a causal
            # LM's checkpoint logs a LOAD REPORT warning (lm_head UNEXPECTED) at every start
            lm = AutoModelForCausalLM.from_pretrained(path, **kw)
            backbone = lm.base_model if lm.base_model is not lm else None
        if backbone is None:  # a saved critic's backbone (or a model without a base_model_prefix)
            backbone = AutoModel.from_pretrained(path, **kw)
        head_file = Path(path) / VALUE_HEAD_FILE
        head = None
        if head_file.exists():
            tensors = load_file(str(head_file))
            head = nn.Linear(backbone.config.hidden_size, 1, dtype=dtype)
            head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
        return cls(backbone, head, seed=seed).to(dtype)

    def save_pretrained(
        self, path: str | os.PathLike[str], state_dict: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """Write the backbone as a HF folder and the head as `value_head.safetensors` in `path`.

        `state_dict` (keys `model.*` and `value_head.*`, e.g. a gathered full state dict of
        a sharded critic) replaces the module's own tensors.
        """
        state = state_dict if state_dict is not None else self.state_dict()
        backbone_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        head_state = {k.removeprefix("value_head."): v for k, v in state.items() if k.startswith("value_head.")}
        out = Path(path)
        self.model.save_pretrained(out, state_dict=backbone_state)
        save_file({k: v.detach().cpu().contiguous() for k, v in head_state.items()}, str(out / VALUE_HEAD_FILE))
        return out


def _new_head(hidden: int, seed: int) -> nn.Linear:
    head = nn.Linear(hidden, 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden + 1), generator=generator)
        head.bias.zero_()
    return head
