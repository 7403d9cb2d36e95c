"""The one module that imports SGLang: version-dependent names and process set-up.

Owns: preparing the process so SGLang's CPU engine path works (``SGLANG_USE_CPU_ENGINE``
and, when the real ``sgl_kernel`` is absent, our two-op stand-in on the import path of
this process and of the scheduler children it spawns), the model classes those children
register at start (``SGLANG_EXTERNAL_MODEL_PACKAGE``, ``engine/sglang_models``), what an
engine's spawned processes read from the environment as they start (torch threads, whether
their progress bars show: :func:`shows_progress` of the engine's ``log_level``), and
importing the SGLang names colocate uses, and our SGLang plugin (:func:`plugin`: colocate's
CPU attention backend registered in each SGLang process). Everything else in ``engine/``
goes through :func:`load`, except what runs inside SGLang's scheduler as a part of it: the
model classes it registers (``engine/sglang_models``) and the attention backend, a subclass
of SGLang's ``torch_native`` (``engine/cpu_attention.py``).

Leaves out: engine lifetime and requests (``engine.runtime``), rollout and scoring logic.
SGLang reads its CPU switch from the environment at import time, so these two variables
are set here, once, before the first import; they are process set-up, not configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
import sys
import typing
import warnings
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SUPPORTED_SGLANG = ("0.5.",)
_STANDIN_DIR = Path(__file__).resolve().parent / "cpu_kernel"
MODEL_PACKAGE = "colocate.engine.sglang_models"  # engine/sglang_models: what a scheduler imports at start


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the process found when it prepared SGLang."""

    device: str  # "cuda" or "cpu"
    sglang_version: str
    kernel_standin: bool  # True when colocate's CPU stand-in replaces sgl_kernel


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _real_sgl_kernel_present() -> bool:
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    return not Path(spec.origin).resolve().is_relative_to(_STANDIN_DIR)


def _put_standin_on_path() -> None:
    entry = str(_STANDIN_DIR)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if entry not in paths:  # spawned scheduler children import sgl_kernel too
        os.environ["PYTHONPATH"] = os.pathsep.join([entry, *[p for p in paths if p]])


# Warnings known to be harmless, by message prefix (UserWarning only): on CPU, SGLang's
# import-time notes that its CUDA-only kernels (Triton, AWQ, GGUF) are unavailable, printed
# once per process, scheduler children included; and multiprocessing's resource tracker
# listing the semaphores SGLang's processes leave to it at exit (it removes them then;
# the tracker is a process of its own, so only PYTHONWARNINGS reaches it).
_HARMLESS_ON_CPU = ("Triton is not supported on current platform", "Only CUDA")
_HARMLESS_ALWAYS = ("resource_tracker",)  # PYTHONWARNINGS cannot hold the ':' of the full message


def _quiet_known_warnings(prefixes: tuple[str, ...]) -> None:
    """Ignore the warnings starting with ``prefixes`` in this process and, through
    ``PYTHONWARNINGS`` (read at start by every child: SGLang's schedulers, the resource
    tracker), in the processes it starts; every other warning stays visible."""
    for prefix in prefixes:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=UserWarning)
    entries = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    entries += [f"ignore:{p}:UserWarning" for p in prefixes if f"ignore:{p}:UserWarning" not in entries]
    os.environ["PYTHONWARNINGS"] = ",".join(entries)


@lru_cache(maxsize=1)
def prepare(device: str = "auto") -> Platform:
    """Set the process up for SGLang on ``device`` ("auto", "cpu" or "cuda"); idempotent.

    The first call decides for the whole process (SGLang caches its platform)."""
    use_cuda = _has_cuda() if device == "auto" else device == "cuda"
    standin = False
    _quiet_known_warnings(_HARMLESS_ALWAYS + (() if use_cuda else _HARMLESS_ON_CPU))
    # schedulers import only the model classes colocate uses (a user's own package is kept)
    os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", MODEL_PACKAGE)
    if not use_cuda:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        if not _real_sgl_kernel_present():
            _put_standin_on_path()
            standin = True
    from importlib.metadata import version

    ver = version("sglang")
    if not ver.startswith(SUPPORTED_SGLANG):
        raise RuntimeError(f"sglang {ver} is not supported; colocate needs sglang 0.5.x")
    return Platform(device="cuda" if use_cuda else "cpu", sglang_version=ver, kernel_standin=standin)


# The architectures of the classes colocate registers (:func:`model_classes`), known without
# importing SGLang: the suite runs each, so a start check need not resolve them again
REGISTERED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "LlamaForSequenceClassification")


def model_classes() -> list[type]:
    """SGLang's classes for the architectures colocate's models use (the actor's causal LMs,
    the reward model's sequence classifier), which ``engine/sglang_models`` registers
    (:data:`REGISTERED_ARCHITECTURES`, in this order)."""
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.llama_reward import LlamaForSequenceClassification
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    return [LlamaForCausalLM, Qwen2ForCausalLM, LlamaForSequenceClassification]


@contextlib.contextmanager
def _child_env(name: str, value: str | None):
    """``os.environ[name] = value`` for the processes an engine spawns inside this block
    (they read it when they start), restored right after; None: left as it is."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# the variables a scheduler reads as it joins its engine's process group, and their loopback values
STORE_OVERRIDE = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"
LOOPBACK_INTERFACES = (("GLOO_SOCKET_IFNAME", "lo"), ("NCCL_SOCKET_IFNAME", "lo"))


@contextlib.contextmanager
def child_rendezvous(store_file: Path, device: str, shm_port: int):
    """The process group of the schedulers an engine spawns inside this block: met through
    ``store_file`` (a ``file://`` store, no socket), their gloo and NCCL sockets on the
    loopback interface. SGLang's own rendezvous is a TCP store on ``nccl_port``, which
    torch binds on every interface whatever host it is given; SGLang's arguments cannot
    change that, its ``SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE`` replaces it. A variable the
    user set is theirs and stays. On CPU, SGLang's shared-memory all-reduce (its own CPU
    kernels) names its segments from ``MASTER_ADDR``/``MASTER_PORT``, which it derived
    from the TCP address: they get the loopback address and ``shm_port`` (one per engine)."""
    pairs = [(STORE_OVERRIDE, f"file://{store_file}"), *LOOPBACK_INTERFACES]
    if device == "cpu":
        pairs += [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(shm_port))]
    with contextlib.ExitStack() as stack:
        for name, value in pairs:
            stack.enter_context(_child_env(name, None if name in os.environ else value))
        yield


def child_threads(n: int):
    """Torch intra-op threads of the processes an engine spawns inside this block (``n`` >
    0; 0 leaves torch's default: every core). SGLang has no argument for it on CPU, and a
    spawned scheduler reads ``OMP_NUM_THREADS`` when its torch starts, so the variable is
    set for the spawn only and restored right after."""
    return _child_env("OMP_NUM_THREADS", str(n) if n > 0 else None)


# SGLang 0.5.23 captures CUDA graphs into the memory saver's "cuda_graph" tag (released and
# resumed with the engine's memory, their pool backed up on the host) only where this is set
GRAPH_MEMORY_ENV = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"


def child_graph_memory(released: bool):
    """The CUDA graphs of the processes an engine spawns inside this block: captured into
    memory a release gives back when ``released`` (``engine_config.releasable_graphs``).
    SGLang has no server argument for it; a value the user set is theirs and stays
    (``SGLANG_MEMORY_SAVER_CUDA_GRAPH=0`` keeps graphs out of the release)."""
    return _child_env(GRAPH_MEMORY_ENV, "1" if released and GRAPH_MEMORY_ENV not in os.environ else None)


def shows_progress(log_level: str) -> bool:
    """Whether an engine's ``log_level`` (SGLang's: debug, info, warning, error, critical)
    asks for the progress bars of loading: debug and info do; quieter levels do not."""
    level = logging.getLevelName(log_level.upper())
    return isinstance(level, int) and level <= logging.INFO


def child_progress_bars(shown: bool):
    """The progress bars of the processes an engine spawns inside this block: left alone
    when ``shown``, else never drawn. SGLang's scheduler draws its weight loading ("Multi-thread
    loading shards", "Loading safetensors checkpoint shards", ``model_loader/weight_utils.py``)
    and, on CUDA, its graph capture with tqdm, passing ``disable=`` itself (off on rank 0
    only), which wins over ``TQDM_DISABLE``; it has no server argument for them. tqdm reads
    its other defaults from ``TQDM_*`` variables when it is imported, so the spawned
    scheduler gets ``TQDM_DELAY=inf``: a bar that would wait forever before it shows is
    never drawn, not even when it closes."""
    return _child_env("TQDM_DELAY", None if shown else "inf")


@lru_cache(maxsize=1)
def load() -> SimpleNamespace:
    """Import the SGLang names colocate uses (after :func:`prepare`)."""
    prepare()
    import sglang  # its known-harmless import-time warnings are filtered by prepare()
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        ContinueGenerationReqInput,
        EmbeddingReqInput,
        EndWeightUpdateReqInput,
        GenerateReqInput,
        LoadLoRAAdapterFromTensorsReqInput,
        PauseGenerationReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
        UnloadLoRAAdapterReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return SimpleNamespace(
        Engine=sglang.Engine,
        FlattenedTensorBucket=FlattenedTensorBucket,
        BeginWeightUpdateReqInput=BeginWeightUpdateReqInput,
        ContinueGenerationReqInput=ContinueGenerationReqInput,
        PauseGenerationReqInput=PauseGenerationReqInput,
        EndWeightUpdateReqInput=EndWeightUpdateReqInput,
        EmbeddingReqInput=EmbeddingReqInput,
        GenerateReqInput=GenerateReqInput,
        LoadLoRAAdapterFromTensorsReqInput=LoadLoRAAdapterFromTensorsReqInput,
        UnloadLoRAAdapterReqInput=UnloadLoRAAdapterReqInput,
        ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
        UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
        MultiprocessingSerializer=MultiprocessingSerializer,
    )


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """What an engine's scheduler will build for a model folder, read without starting one."""

    architecture: str  # SGLang's class (TransformersForCausalLM where it falls back to transformers)
    config: Any  # the Hugging Face config that class is built from (SGLang's ModelConfig.hf_config)


def model_plan(model_path: str, *, trust_remote_code: bool, is_embedding: bool) -> ModelPlan:
    """SGLang's model config of ``model_path`` and the class its registry resolves for it,
    as a scheduler does before loading (after :func:`prepare`); raises what SGLang raises
    (e.g. an architecture it has no class for). An architecture outside the classes
    ``engine/sglang_models`` registers loads SGLang's whole registry once (seconds; its
    import-time notes quietened)."""
    prepare()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    with _quiet_logger("sglang"):
        config = ModelConfig(model_path, trust_remote_code=trust_remote_code, is_embedding=is_embedding)
        cls, _ = get_model_architecture(config)
    return ModelPlan(cls.__name__, config.hf_config)


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Only errors of logger ``name`` inside this block (its level restored after)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Dropped(logging.Filter):
    """Drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


SIGQUIT_LINE = ("sglang.srt.entrypoints.engine", "Using custom SIGQUIT handler")


@contextlib.contextmanager
def start_lines_dropped():
    """An engine's start inside this block without the line SGLang 0.5 logs, at error level,
    whenever a SIGQUIT handler is passed ("Using custom SIGQUIT handler: <function
    child_quit at 0x...>", ``entrypoints/engine.py``): colocate always passes one
    (``engine_config.child_quit``), so every start printed it, an error to read that
    nothing had failed. Every other record of that logger stays; the filter goes with the block."""
    name, prefix = SIGQUIT_LINE
    logger, dropped = logging.getLogger(name), _Dropped(prefix)
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


@lru_cache(maxsize=1)
def attention_backends() -> tuple[str, ...]:
    """The attention backends SGLang's ``ServerArgs`` accepts (after :func:`prepare`; its
    argument groups pull most of SGLang in: ~7 s here), colocate's own among them where
    SGLang runs our plugin (:func:`plugin_installed`)."""
    prepare()
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    own = (CPU_ATTENTION,) if plugin_installed() and CPU_ATTENTION not in ATTENTION_BACKEND_CHOICES else ()
    return (*ATTENTION_BACKEND_CHOICES, *own)


# colocate's attention backend for CPU engines (engine/cpu_attention.py), by the name SGLang knows it
CPU_ATTENTION = "colocate_cpu"
PLUGIN_GROUP = "sglang.srt.plugins"  # SGLang's general plugins: run at the start of each of its processes
PLUGIN = "colocate"  # our entry in it (pyproject.toml: [project.entry-points."sglang.srt.plugins"])


def plugin() -> None:
    """SGLang's general plugin (its ``sglang.srt.plugins`` entry point group; SGLang calls it
    as each of its processes starts, its schedulers' included): registers colocate's CPU
    attention backend under :data:`CPU_ATTENTION` with SGLang's attention registry and
    argument choices, SGLang's extension points for out-of-tree backends. The backend's
    module is imported only when an engine asks for it."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if CPU_ATTENTION not in ATTENTION_BACKENDS:
        register_attention_backend(CPU_ATTENTION)(_cpu_attention)
    if CPU_ATTENTION not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([CPU_ATTENTION])


def _cpu_attention(runner):
    from .cpu_attention import CpuAttnBackend

    return CpuAttnBackend(runner)


@lru_cache(maxsize=1)
def plugin_installed() -> bool:
    """Whether SGLang will run :func:`plugin` in its processes: our entry point is installed
    (``pip install -e .`` writes it) and ``SGLANG_PLUGINS``, SGLang's allow-list of plugin
    names, does not leave it out. Read without importing SGLang."""
    from importlib.metadata import entry_points

    allowed = [x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
    found = any(ep.name == PLUGIN and ep.value.startswith("colocate.") for ep in entry_points(group=PLUGIN_GROUP))
    return found and (not allowed or PLUGIN in allowed)


@lru_cache(maxsize=1)
def server_arg_types() -> dict[str, Any]:
    """SGLang's ``ServerArgs`` fields (what ``sglang.Engine(**kwargs)`` takes): name ->
    annotation, ``Annotated`` metadata stripped (after :func:`prepare`)."""
    prepare()
    import msgspec
    from sglang.srt.server_args import ServerArgs  # a msgspec Struct in 0.5.23, a dataclass before

    if dataclasses.is_dataclass(ServerArgs):
        try:
            hints = typing.get_type_hints(ServerArgs)
        except (NameError, TypeError):  # an annotation that does not resolve: names only
            hints = {}
        return {f.name: hints.get(f.name) for f in dataclasses.fields(ServerArgs)}
    hints = {f.name: f.type for f in msgspec.structs.fields(ServerArgs)}
    return {name: typing.get_args(h)[0] if typing.get_origin(h) is typing.Annotated else h for name, h in hints.items()}


def token_counters(model_name: str) -> dict[str, float]:
    """Prompt and cached-prefix token totals SGLang's metrics recorded for ``model_name``
    (engines started with ``enable_metrics``). Embedding outputs carry no
    ``cached_tokens`` in their ``meta_info``; these counters do, for every request."""
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    totals = {"prompt_tokens": 0.0, "cached_tokens": 0.0}
    names = {"sglang:prompt_tokens_total": "prompt_tokens", "sglang:cached_tokens_total": "cached_tokens"}
    for metric in registry.collect():
        for sample in metric.samples:
            key = names.get(sample.name)
            if key and sample.labels.get("model_name") == model_name:
                totals[key] += sample.value
    return totals


def last_received(tokenizer_manager: Any) -> float:
    """When (``time.time()``) an engine's tokenizer manager last received anything from its
    scheduler (outputs or replies; SGLang's ``last_receive_tstamp``); 0.0 where it keeps none."""
    return float(getattr(tokenizer_manager, "last_receive_tstamp", 0.0) or 0.0)
