"""Flash-attention detection: what transformers will accept as ``flash_attention_2``.

The flash-attn-4 wheel SGLang brings ships only ``flash_attn/cute/`` (a namespace
package); ``find_spec("flash_attn")`` finds it, transformers does not count it as FA2.
The layouts are built under ``tmp_path`` and put first on ``sys.path``."""

from __future__ import annotations

import importlib
import sys

import pytest

from colocate.trainer import settings as settings_mod
from colocate.trainer.sections import PPOConfig
from colocate.trainer.settings import TrainerSettings, flash_attn_2_available
from colocate.trainer.varlen_attention import VARLEN_SDPA

PACKED = PPOConfig(packing=True)


@pytest.fixture
def clean_flash_attn(monkeypatch):
    """No ``flash_attn`` module cached before or after the test."""
    def drop():
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
        importlib.invalidate_caches()

    drop()
    yield
    drop()


def _cuda_bf16() -> TrainerSettings:
    return TrainerSettings(actor_path="/m", device="cuda:0", dtype="bfloat16", ppo=PACKED)


def test_a_namespace_only_flash_attn_4_is_not_flash_attention_2(tmp_path, monkeypatch, clean_flash_attn):
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("flash_attn") is not None  # the old check passed here
    assert flash_attn_2_available() is False
    # no flash-attention 2 on CUDA in half precision: flex attention, shared prefixes kept
    assert _cuda_bf16().attn_implementation == "flex_attention"
    assert (_cuda_bf16().token_budget, _cuda_bf16().shares_prefix) == (8192, True)


def test_flash_attention_2_needs_its_interface_and_transformers_consent(tmp_path, monkeypatch, clean_flash_attn):
    import transformers.utils

    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '2.8.3'\n")
    (pkg / "flash_attn_interface.py").write_text("def flash_attn_varlen_func(*a, **k):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert flash_attn_2_available() is True
    assert _cuda_bf16().attn_implementation == "flash_attention_2" and _cuda_bf16().token_budget == 8192
    # never on CPU, in float32 or padded
    assert TrainerSettings(actor_path="/m", device="cpu", dtype="bfloat16", ppo=PACKED).attn_implementation == VARLEN_SDPA
    assert TrainerSettings(actor_path="/m", device="cuda", dtype="float32", ppo=PACKED).attn_implementation == VARLEN_SDPA
    padded = PPOConfig(packing=False)
    assert TrainerSettings(actor_path="/m", device="cuda", dtype="bfloat16", ppo=padded).attn_implementation is None
    # transformers says no (e.g. an FA2 older than 2.3.3, or no CUDA): not flash_attention_2
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert flash_attn_2_available() is False


def test_nothing_installed_and_a_broken_install_are_not_flash_attention_2(tmp_path, monkeypatch, clean_flash_attn):
    assert importlib.util.find_spec("flash_attn") is None  # this machine has none
    assert flash_attn_2_available() is False
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10 (built for another torch)')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert settings_mod.flash_attn_2_available() is False


def test_an_attention_asked_for_by_name(clean_flash_attn):
    """`ppo.attention`: sdpa is the per-sequence sdpa when packed and transformers' own when
    padded; flex attention shares prefixes with the flash-attention budget, on CUDA only;
    flash-attention 2 only where it is installed. The refusals are one line naming the field."""
    def named(attention: str, packing: bool = True, **kw) -> TrainerSettings:
        return TrainerSettings(actor_path="/m", ppo=PPOConfig(attention=attention, packing=packing),
                               **({"device": "cuda:0", "dtype": "bfloat16"} | kw))

    # sdpa's micro-batches: 8192 tokens on CUDA (3.2x faster than 1024 on an H100), 1024 on the CPU
    assert named("sdpa").attn_implementation == VARLEN_SDPA and named("sdpa").token_budget == 8192
    assert named("sdpa", device="cpu", dtype="float32").token_budget == 1024
    assert named("sdpa", packing=False).attn_implementation is None
    flex = named("flex_attention")
    assert (flex.attn_implementation, flex.token_budget, flex.shares_prefix) == ("flex_attention", 8192, True)
    assert named("flex_attention", packing=False).attn_implementation == "flex_attention"
    with pytest.raises(settings_mod.TrainerConfigError, match=r"^ppo.attention=flex_attention needs CUDA") as err:
        named("flex_attention", device="cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(settings_mod.TrainerConfigError, match=r"^ppo.attention=flex_attention needs half-precision"):
        named("flex_attention", dtype="float32")
    with pytest.raises(settings_mod.TrainerConfigError, match=r"^ppo.attention=flash_attention_2, but flash-attention 2 "
                                                             r"is not installed"):
        named("flash_attention_2")
    with pytest.raises(settings_mod.TrainerConfigError, match="attention"):
        named("eager")
