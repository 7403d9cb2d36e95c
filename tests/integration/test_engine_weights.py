"""Weight updates through SGLang's tensor API, and the radix cache after them."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample
from tests.integration.test_engine_actor import hf_greedy

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [1] + list(range(30, 90))  # long enough that a stale prefix would matter


def buckets(model, max_numel):
    """Named tensors grouped in buckets of at most ``max_numel`` elements."""
    out, cur, size = [], [], 0
    for name, t in model.state_dict().items():
        if cur and size + t.numel() > max_numel:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t.detach().clone()))
        size += t.numel()
    return out + [cur] if cur else out


@pytest.mark.parametrize("flattened", [False, True], ids=["tensor-lists", "flattened-buckets"])
def test_weight_update_changes_generation_and_never_serves_stale_kv(actor_engine, tiny_actor_path, flattened):
    """Both forms of a bucket load the same weights: tensor lists (host tensors, the CPU
    push) and SGLang's flattened buckets (one byte tensor + metadata, the CUDA push's form,
    where the byte tensor crosses as one CUDA-IPC handle)."""
    run = actor_engine.loop.run_until_complete
    base = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    before = Sample(0, PROMPT, 12)
    run(generate_and_score.generate(actor_engine, [before], GREEDY, "wold"))  # PROMPT now in the radix cache
    assert before.output_ids == hf_greedy(base, PROMPT, 12)[0]

    new = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp_min(1e-3))
    want_tokens, want_logps = hf_greedy(new, PROMPT, 12)
    assert want_tokens != before.output_ids  # the update really changes the greedy output

    old_version = actor_engine.weight_version
    seconds = actor_engine.update_weights(buckets(new, 20_000), version=old_version + 1, flattened=flattened)
    try:
        assert seconds > 0 and actor_engine.weight_version == old_version + 1
        after = Sample(0, PROMPT, 12)
        run(generate_and_score.generate(actor_engine, [after], GREEDY, "wnew"))
        assert after.output_ids == want_tokens
        assert max(abs(a - b) for a, b in zip(after.logprobs, want_logps)) < 1e-4
        assert set(after.versions) == {old_version + 1}
    finally:  # restore the session engine's weights for other tests
        actor_engine.update_weights(buckets(base, 10**9), version=old_version + 2)
    again = Sample(0, PROMPT, 12)
    run(generate_and_score.generate(actor_engine, [again], GREEDY, "wbak"))
    assert again.output_ids == before.output_ids


def test_wait_idle_waits_for_a_running_request_and_gives_up_in_one_line(actor_engine):
    """SGLang releases memory only from an idle scheduler (it asserts it, and a failed
    assertion takes the run down), so a release first waits for a flush the scheduler
    defers until it is idle. A flush is refused while a request runs, on CPU as on CUDA."""
    from colocate.engine.errors import EngineError

    loop = actor_engine.loop
    sample = Sample(0, PROMPT, 900)
    task = loop.create_task(generate_and_score.generate(actor_engine, [sample], GREEDY, "wbusy"))
    loop.run_until_complete(asyncio.sleep(0.3))  # the request is running now
    assert actor_engine.flush_cache() is False  # refused at once while it runs
    with pytest.raises(EngineError) as err:
        actor_engine.wait_idle(timeout_s=0.05)
    assert "\n" not in str(err.value) and "still had requests running after 0.05 s" in str(err.value)
    actor_engine.wait_idle(timeout_s=120)
    assert actor_engine.flush_cache() is True  # it returned once the scheduler was idle
    loop.run_until_complete(task)
    assert len(sample.output_ids) == 900  # the request ran to its end: waiting aborts nothing
    assert actor_engine.wait_idle(timeout_s=1) < 1  # idle now: flushed at once
    assert actor_engine.device == "cpu"  # pinned (tests/conftest.py): releasing a shared CUDA engine would unmap it
    assert actor_engine.release_memory() is False and actor_engine.resume_memory(["weights"]) is False


def test_a_refused_weight_update_session_is_one_line_and_changes_nothing(actor_engine, tiny_actor_path):
    """SGLang answers begin/end_weight_update with (success, message); a refusal (here: a
    session someone else left open) stops the push in one line instead of passing unseen."""
    from colocate.engine.errors import EngineError
    from colocate.engine.runtime import run_guarded

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    tm, api = actor_engine._engine.tokenizer_manager, actor_engine._api
    version = actor_engine.weight_version
    assert run_guarded([actor_engine], tm.begin_weight_update(api.BeginWeightUpdateReqInput(selector="all"), None))[0]
    try:
        with pytest.raises(EngineError) as err:
            actor_engine.update_weights(buckets(model, 1 << 20), version=version + 1)
    finally:
        run_guarded([actor_engine], tm.end_weight_update(api.EndWeightUpdateReqInput(), None))
    text = str(err.value)
    assert "\n" not in text and "SGLang's begin_weight_update failed: a weight-update session is already open" in text
    assert actor_engine.weight_version == version
    actor_engine.update_weights(buckets(model, 1 << 20), version=version + 1)  # the engine is fine afterwards
    assert actor_engine.weight_version == version + 1


def test_the_payloads_of_an_exchange_reach_sglang_in_tp_rank_order(actor_engine, tiny_actor_path):
    """A tensor-parallel engine's TP rank i loads entry i of each bucket's payload list
    (SGLang's ``serialized_named_tensors``); with an ``exchange`` the engine sends exactly the
    list it returns. On CPU the engine has one TP rank, so it loads entry 0: the host's own
    copy when that comes first, the other one when the order is swapped."""
    from colocate.engine.weight_payloads import serialize_bucket

    run = actor_engine.loop.run_until_complete
    base = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp_min(1e-3))
    base_tokens, new_tokens = hf_greedy(base, PROMPT, 12)[0], hf_greedy(new, PROMPT, 12)[0]
    assert base_tokens != new_tokens
    others = buckets(base, 20_000)  # the same cut of the other copy's weights

    def exchange(own_first: bool, sent: list):
        def payloads(own: bytes) -> list[bytes]:
            data, other = serialize_bucket(others[len(sent)], flattened=True)
            sent.append(data)  # alive until the engine has loaded it
            return [own, other] if own_first else [other, own]
        return payloads

    version = actor_engine.weight_version
    try:
        for step, (own_first, want) in enumerate(((True, new_tokens), (False, base_tokens)), start=1):
            sent: list = []
            actor_engine.update_weights(buckets(new, 20_000), version=version + step, flattened=True,
                                        exchange=exchange(own_first, sent))
            assert len(sent) == len(others)  # one exchange per bucket
            out = Sample(0, PROMPT, 12)
            run(generate_and_score.generate(actor_engine, [out], GREEDY, f"wtp{step}"))
            assert out.output_ids == want
    finally:  # restore the session engine's weights for other tests
        actor_engine.update_weights(buckets(base, 10**9), version=version + 3)


def test_a_lora_sync_pushes_only_the_adapted_linears_and_serves_the_merged_model(actor_engine, tiny_actor_path):
    """LoRA (lora.rank > 0): the trainer pushes the merged weights of the adapted linears
    only (q_proj, v_proj here), the engine keeps the rest of the base it started from, and
    its greedy tokens then equal HF greedy on the model PEFT merges from the same adapters."""
    import torch.distributed as dist
    from peft import get_peft_model

    from colocate.run import weight_sync
    from colocate.trainer.distributed import init_distributed
    from colocate.trainer.lora import peft_config
    from colocate.trainer.ppo_trainer import PPOTrainer, TrainerSettings
    from colocate.trainer.sections import LoraConfig, PPOConfig

    created = not dist.is_initialized()
    lora = LoraConfig(rank=4, alpha=8.0, target_modules="q_proj,v_proj", critic=False)
    ppo = PPOConfig(advantage="grpo", actor_lr=2e-6, critic_lr=1e-5, epochs=1, lam=0.95,
                    packing=False)  # the padded one-epoch trainer it was written for
    settings = TrainerSettings(actor_path=tiny_actor_path, ppo=ppo, lora=lora)
    trainer = PPOTrainer(settings, init_distributed("cpu"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters as training would leave them: B no longer zero
        for name, p in trainer.actor.named_parameters():
            if "lora_B" in name:
                p.to_local().copy_(torch.randn(p.shape, generator=gen) * 0.3)  # one rank: the whole tensor
    pushed = trainer.actor_state_for_sync()
    adapter = trainer.state_dict()["actor"]["model"]
    if created:
        dist.destroy_process_group()
    assert pushed and {n.split(".")[-2] for n in pushed} == {"q_proj", "v_proj"}

    merged = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32),
                            peft_config(lora))
    missing, unexpected = merged.load_state_dict(adapter, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    merged = merged.merge_and_unload()
    want_tokens, want_logps = hf_greedy(merged, PROMPT, 12)
    base = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    assert want_tokens != hf_greedy(base, PROMPT, 12)[0]  # the adapters change the greedy output

    old_version = actor_engine.weight_version
    weight_sync.sync(actor_engine, pushed, old_version + 1, bucket_mb=1)
    try:
        after = Sample(0, PROMPT, 12)
        actor_engine.loop.run_until_complete(generate_and_score.generate(actor_engine, [after], GREEDY, "wlora"))
        assert after.output_ids == want_tokens
        assert max(abs(a - b) for a, b in zip(after.logprobs, want_logps)) < 1e-4
    finally:  # restore the session engine's weights for other tests
        actor_engine.update_weights(buckets(base, 10**9), version=old_version + 2)
