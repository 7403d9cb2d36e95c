"""SGLang's own arguments (``engines.sglang``): parsed and merged from YAML and ``--set``,
round-tripped through a run's config.json, carried into both engines' kwargs last, and
checked in one line against the installed SGLang's real ``ServerArgs``."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from colocate.config import from_dict, load_config, to_dict
from colocate.engine import sglang_api
from colocate.engine.errors import EngineConfigError
from colocate.engine.engine_config import (EngineConfig, _server_kwargs, compiled_cuda_kernels,
                                            default_attention_backend, releasable_graphs)
from colocate.config_checks import OWN_SERVER_ARGS
from colocate.engine.start_checks import ENGINE_SET_ARGS, check_server_args
from colocate.errors import CONFIG_ERRORS, ConfigError, in_config_terms
from colocate.run import builder
from colocate.run.resume import config_changes


def test_yaml_and_several_overrides_merge_left_to_right(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engines:\n  sglang:\n    sampling_backend: pytorch\n    stream_interval: 2\n")
    cfg = load_config(path, ["engines.sglang.stream_interval=4", "engines.sglang.watchdog_timeout=600",
                             "engines.cuda_graph=false", "engines.attention_backend=triton"])
    assert cfg.engines.sglang == {"sampling_backend": "pytorch", "stream_interval": 4, "watchdog_timeout": 600}
    assert (cfg.engines.cuda_graph, cfg.engines.attention_backend) == (False, "triton")
    # a whole mapping given after single names merges with them too
    cfg = load_config(overrides=["engines.sglang.stream_interval=4", "engines.sglang={watchdog_timeout: 9}"])
    assert cfg.engines.sglang == {"stream_interval": 4, "watchdog_timeout": 9}
    assert load_config().engines.sglang == {} and load_config().engines.cuda_graph is True


def test_config_json_round_trip_and_resume_names_each_changed_argument():
    cfg = load_config(overrides=["engines.sglang.sampling_backend=pytorch",
                                 "engines.sglang.cuda_graph_bs_decode=[1,2]"])
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    resumed = load_config(overrides=["engines.sglang.stream_interval=4"], base=cfg)
    assert resumed.engines.sglang == {"sampling_backend": "pytorch", "cuda_graph_bs_decode": [1, 2],
                                      "stream_interval": 4}
    assert config_changes(cfg, resumed) == [("engines.sglang.stream_interval", None, 4)]


@pytest.mark.parametrize("overrides, needle", [
    (["engines.sglang=pytorch"],
     "engines.sglang: expected a mapping (e.g. --set engines.sglang.<name>=<value>), got 'pytorch'"),
    (["engines.sglang.dtype=float16"], "engines.sglang.dtype: colocate sets it from engines.dtype"),
    (["engines.sglang.attention_backend=triton"],
     "engines.sglang.attention_backend: set engines.attention_backend instead"),
    (["engines.sglang.disable_cuda_graph=true"], "engines.sglang.disable_cuda_graph: set engines.cuda_graph instead"),
    (["engines.sglang.skip_tokenizer_init=false"], "engines.sglang.skip_tokenizer_init: colocate sets it itself"),
    (["engines.sglang.mm_process_config.x=1"], "engines.sglang.mm_process_config: a mapping value is not supported"),
    (["engines.sglang.log_level=info"], "engines.sglang.log_level: set engines.log_level instead"),
])
def test_config_errors_are_one_line_without_sglang(overrides, needle):
    with pytest.raises(CONFIG_ERRORS) as e:
        load_config(overrides=overrides)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_a_yaml_mapping_with_non_string_names_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engines:\n  sglang:\n    1: x\n")
    with pytest.raises(ConfigError, match=r"^engines.sglang: names must be strings, got 1$"):
        load_config(path)


def test_both_engines_get_the_arguments_last_and_colocate_decides_the_rest():
    cfg = load_config(overrides=["engines.device=cuda", "engines.sglang.sampling_backend=pytorch",
                                 "engines.sglang.cuda_graph_bs_decode=[1,2,4]", "engines.cuda_graph=false",
                                 "engines.attention_backend=triton"])
    actor, reward = builder.engine_configs(cfg, "/m/actor", "/m/rm")
    for engine in (actor, reward):
        assert engine.server_args == (("cuda_graph_bs_decode", (1, 2, 4)), ("sampling_backend", "pytorch"))
        kw = _server_kwargs(engine, "cuda")
        assert kw["sampling_backend"] == "pytorch" and kw["cuda_graph_bs_decode"] == [1, 2, 4]  # a list again
        assert kw["disable_cuda_graph"] is True and kw["attention_backend"] == "triton"
    default = builder.engine_configs(load_config(overrides=["engines.device=cuda"]), "/m/actor", "/m/rm")[0]
    assert "disable_cuda_graph" not in _server_kwargs(default, "cuda")
    assert "attention_backend" not in _server_kwargs(default, "cuda", compiled_kernels=True)  # SGLang's pick
    cpu = builder.engine_configs(load_config(overrides=["engines.device=cpu"]), "/m/actor", "/m/rm")[0]
    assert _server_kwargs(cpu, "cpu")["attention_backend"] == "colocate_cpu"
    assert _server_kwargs(cpu, "cpu")["disable_cuda_graph"] is True


def test_co_located_cuda_graphs_are_captured_where_a_release_gives_them_back(monkeypatch):
    """Issue 53 item 1: with the memory saver and CUDA graphs on (the CUDA defaults), the
    engine's schedulers start with SGLANG_MEMORY_SAVER_CUDA_GRAPH set (SGLang 0.5.23 tags its
    decode graphs' pool only then) and without prefill graphs (its breakable backend has no
    tagged capture); graphs off, the saver off or a CPU engine change nothing."""
    cuda = EngineConfig("/m")
    assert releasable_graphs(cuda, "cuda") is True
    assert _server_kwargs(cuda, "cuda", compiled_kernels=False)["disable_prefill_cuda_graph"] is True
    for cfg, device in [(EngineConfig("/m", cuda_graph=False), "cuda"),
                        (EngineConfig("/m", enable_memory_saver=False), "cuda"), (cuda, "cpu")]:
        assert releasable_graphs(cfg, device) is False
        assert "disable_prefill_cuda_graph" not in _server_kwargs(cfg, device, compiled_kernels=False)
    name = sglang_api.GRAPH_MEMORY_ENV
    monkeypatch.delenv(name, raising=False)
    with sglang_api.child_graph_memory(True):
        assert sglang_api.os.environ[name] == "1"  # what a scheduler spawned here reads
    assert name not in sglang_api.os.environ
    with sglang_api.child_graph_memory(False):
        assert name not in sglang_api.os.environ
    monkeypatch.setenv(name, "0")  # the user's own choice stays
    with sglang_api.child_graph_memory(True):
        assert sglang_api.os.environ[name] == "0"
    assert sglang_api.os.environ[name] == "0"


def test_unset_attention_backend_is_sglangs_pick_with_its_kernels_triton_without_ours_on_cpu():
    """Issue 53 item 2: SGLang's pick (fa3 on a Hopper card) needs its compiled kernels; the
    GPU kit has none, and its probe-free choice there is triton; on CPU colocate's own
    backend (engine/cpu_attention.py), registered by our SGLang plugin (installed here)."""
    assert default_attention_backend("cuda", compiled_kernels=True) is None
    assert default_attention_backend("cuda", compiled_kernels=False) == "triton"
    assert default_attention_backend("cpu", compiled_kernels=True) == "colocate_cpu"
    assert default_attention_backend("cpu", compiled_kernels=False) == "colocate_cpu"
    unset = builder.engine_configs(load_config(overrides=["engines.device=cuda"]), "/m/actor", "/m/rm")
    for engine in unset:
        assert _server_kwargs(engine, "cuda", compiled_kernels=False)["attention_backend"] == "triton"
        assert "attention_backend" not in _server_kwargs(engine, "cuda", compiled_kernels=True)
    named = builder.engine_configs(load_config(overrides=["engines.device=cuda", "engines.attention_backend=fa3"]),
                                   "/m/actor", "/m/rm")[0]
    assert _server_kwargs(named, "cuda", compiled_kernels=False)["attention_backend"] == "fa3"  # a named one wins
    # detected, not passed: this machine has no sgl_kernel, so the CUDA engine gets triton
    assert compiled_cuda_kernels() is False
    assert _server_kwargs(unset[0], "cuda")["attention_backend"] == "triton"


def test_compiled_kernels_are_found_by_their_extension_modules_not_by_the_package_name(tmp_path, monkeypatch):
    """The kit's stand-in sgl_kernel (pure Python) is not SGLang's kernels; a package holding
    a compiled extension module (``*.so``, also in a subfolder such as sgl_kernel/sm90) is."""
    from colocate.engine import engine_config

    fake = tmp_path / "sgl_kernel"
    fake.mkdir()
    (fake / "__init__.py").write_text("IS_COLOCATE_CUDA_PROBE_STANDIN = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # an engine started earlier in this process imported colocate's CPU stand-in as sgl_kernel,
    # and find_spec answers from sys.modules first
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    engine_config.compiled_cuda_kernels.cache_clear()
    try:
        assert engine_config.compiled_cuda_kernels() is False
        (fake / "sm90").mkdir()
        (fake / "sm90" / "common_ops.abi3.so").write_bytes(b"")
        engine_config.compiled_cuda_kernels.cache_clear()
        assert engine_config.compiled_cuda_kernels() is True
        assert "sgl_kernel" not in sys.modules  # found, never imported
    finally:
        engine_config.compiled_cuda_kernels.cache_clear()


def test_engine_config_is_hashable_equal_by_content_and_survives_json():
    """EnginePool takes engines by equal EngineConfig; a feeder process gets it as JSON."""
    a = EngineConfig("/m", server_args={"stream_interval": 2, "cuda_graph_bs_decode": [1, 2]})
    b = EngineConfig("/m", server_args=(("cuda_graph_bs_decode", (1, 2)), ("stream_interval", 2)))
    assert a == b and hash(a) == hash(b) and a != EngineConfig("/m")
    assert EngineConfig(**json.loads(json.dumps(dataclasses.asdict(a)))) == a
    with pytest.raises(EngineConfigError) as e:
        EngineConfig("/m", server_args={"x": {"y": 1}})
    assert str(in_config_terms(e.value)).startswith("engines.sglang.x: a mapping value is not supported")


@pytest.fixture(scope="module")
def arg_types():
    return sglang_api.server_arg_types()  # the installed SGLang's real ServerArgs


def test_every_argument_colocate_sets_is_refused_and_is_real(arg_types):
    """The refusal list is every name _server_kwargs can pass, and names real ServerArgs fields."""
    lora = EngineConfig("/m", role="reward", lora_rank=8, lora_backend="triton", context_length=64, nccl_port=1,
                        overlap_schedule=False, enable_metrics=True, attention_backend="triton", cuda_graph=False,
                        max_running_requests=4, chunked_prefill_size=64)
    passed = set(_server_kwargs(lora, "cuda")) | set(_server_kwargs(lora, "cpu"))
    assert passed - {"max_running_requests", "chunked_prefill_size"} == set(OWN_SERVER_ARGS) == ENGINE_SET_ARGS
    assert set(OWN_SERVER_ARGS) <= set(arg_types)


@pytest.mark.parametrize("args, needle", [
    ({"sampling_backnd": "pytorch"}, "engines.sglang.sampling_backnd: not an argument of SGLang 9.9's ServerArgs; "
                                     "did you mean 'sampling_backend'?"),
    ({"stream_interval": "2"}, "engines.sglang.stream_interval: expected int, got '2' (str)"),
    ({"stream_interval": True}, "engines.sglang.stream_interval: expected int, got True (bool)"),
    ({"sampling_backend": 3}, "engines.sglang.sampling_backend: expected str or null, got 3 (int)"),
    ({"enable_torch_compile": "yes"}, "engines.sglang.enable_torch_compile: expected bool, got 'yes' (str)"),
    ({"max_running_requests": 8}, None),  # colocate leaves it to SGLang: passed through
    ({"watchdog_timeout": 600, "sampling_backend": None, "cuda_graph_bs_decode": [1, 2]}, None),
    ({"log_level": "info"}, "engines.sglang.log_level: the engine sets it itself"),  # colocate's config: above
])
def test_arguments_checked_against_the_real_server_args(arg_types, args, needle):
    cfg = EngineConfig("/m", server_args=args)
    if needle is None:
        check_server_args(cfg, arg_types, "9.9", ENGINE_SET_ARGS)
        return
    with pytest.raises(EngineConfigError) as e:
        check_server_args(cfg, arg_types, "9.9", ENGINE_SET_ARGS)
    assert str(in_config_terms(e.value)) == needle


def test_an_argument_the_engine_config_sets_too_is_refused(arg_types):
    cfg = EngineConfig("/m", max_running_requests=4, server_args={"max_running_requests": 8})
    with pytest.raises(EngineConfigError, match=r"max_running_requests: the engine's own .* is set too \(4\)"):
        check_server_args(cfg, arg_types, "9.9")


def test_cpu_attention_falls_back_to_torch_native_where_sglang_would_not_run_our_plugin(monkeypatch):
    """SGLANG_PLUGINS, SGLang's allow-list of plugins, leaving ours out: SGLang would not
    know ``colocate_cpu``, so a CPU engine takes torch_native and the start check does not
    offer it; the list naming ours keeps it."""
    assert sglang_api.plugin_installed() and "colocate_cpu" in sglang_api.attention_backends()
    try:
        monkeypatch.setenv("SGLANG_PLUGINS", "someone_elses")
        sglang_api.plugin_installed.cache_clear()
        assert default_attention_backend("cpu", compiled_kernels=False) == "torch_native"
        monkeypatch.setenv("SGLANG_PLUGINS", "someone_elses, colocate")
        sglang_api.plugin_installed.cache_clear()
        assert default_attention_backend("cpu", compiled_kernels=False) == "colocate_cpu"
    finally:
        monkeypatch.delenv("SGLANG_PLUGINS")
        sglang_api.plugin_installed.cache_clear()
