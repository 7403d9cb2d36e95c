"""The model classes engines register at start (engine/sglang_models): colocate's own
architectures, named through SGLang's external-model switch by `sglang_api.prepare`."""

import os

from colocate.engine import sglang_api
from colocate.engine.start_checks import CAUSAL_REWARD_ARCHS


def test_prepare_names_the_package_and_it_holds_every_architecture_colocate_accepts():
    sglang_api.prepare("cpu")
    # ours (a package the user names before the first engine is kept: os.environ.setdefault)
    assert os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] == sglang_api.MODEL_PACKAGE
    from sglang.srt.models.registry import import_model_classes

    registered = import_model_classes(sglang_api.MODEL_PACKAGE)
    assert CAUSAL_REWARD_ARCHS | {"LlamaForCausalLM", "Qwen2ForCausalLM"} == set(registered)
    from sglang.srt.models.registry import ModelRegistry

    # an architecture not registered still resolves, through SGLang's full registry
    assert ModelRegistry.resolve_model_cls(["MistralForCausalLM"])[1] == "MistralForCausalLM"
