"""The trainer's AdamW: on CPU torch's fused kernel, the same updates as torch's default loop."""

from __future__ import annotations

import torch
from torch import nn

from colocate.trainer.optim import build_adamw


def test_cpu_adamw_is_fused_and_steps_as_the_default_loop():
    """torch takes its per-parameter loop on CPU by default (~10 dispatches per parameter,
    each through DTensor under FSDP): 0.36 s a SmolLM2-135M step against 0.048 s fused.
    The fused kernel computes the same AdamW: weights after three steps agree with the
    loop's to float32 rounding; a frozen parameter is not the optimizer's."""
    torch.manual_seed(0)
    ours, ref = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)), nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    ref.load_state_dict(ours.state_dict())
    before = ours[1].weight.detach().clone()
    ours[0].bias.requires_grad_(False)
    ref[0].bias.requires_grad_(False)
    opt = build_adamw(ours, lr=1e-2, weight_decay=0.1)
    loop = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                             foreach=False)
    assert opt.defaults["fused"] is True and len(opt.param_groups[0]["params"]) == 3
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((ours, opt), (ref, loop)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours[1].weight, before)  # it stepped
