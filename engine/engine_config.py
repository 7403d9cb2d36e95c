"""How one SGLang engine is configured, and the SGLang arguments that configuration becomes.

Owns: :class:`EngineConfig` (frozen, hashable and JSON-safe: a pool takes engines by equal
config, a feeder process gets it as JSON), SGLang's own arguments frozen into sorted
``(name, value)`` pairs (:func:`frozen_server_args`), and the keyword arguments of
SGLang's ``ServerArgs`` built from a config on a device (``_server_kwargs``: what colocate
decides, the CPU defaults, SGLang's own arguments passed last), and the attention backend
an engine gets when its config names none (:func:`default_attention_backend`, from whether
SGLang's compiled CUDA kernels are installed: :func:`compiled_cuda_kernels`), and whether its
CUDA graphs are released with it (:func:`releasable_graphs`).

Leaves out: starting and driving the engine (``engine.runtime``); the checks of a config
and of SGLang's own arguments (``engine.start_checks``); SGLang imports
(``engine.sglang_api``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

from . import sglang_api
from .start_checks import check_server_arg_values

Role = Literal["actor", "reward"]

CPU_MEM_FRACTION = 0.5
CPU_DEFAULT_POOL_TOKENS = 65536  # KV pool on CPU when max_total_tokens is None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How to start one SGLang engine. Defaults suit a 2-core CPU and small models."""

    model_path: str
    role: Role = "actor"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"
    seed: int = 0
    context_length: int | None = None  # None: the model's max_position_embeddings
    max_total_tokens: int | None = 65536  # KV pool size in tokens (None: SGLang sizes it)
    mem_fraction_static: float = 0.3  # GPU memory share for weights + KV (GPU only)
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    attention_backend: str | None = None  # None: default_attention_backend (CPU: colocate_cpu)
    log_level: str = "error"  # SGLang's; debug or info also keep its weight-loading progress bars
    enable_memory_saver: bool = True  # GPU: lets the loop release weights/KV for training
    # GPU: keep a host copy of the weights while they are released, so they come back with
    # their contents. On for the reward engine (nothing ever pushes its weights again); off
    # for the actor, whose weights are pushed after every wake.
    weights_cpu_backup: bool = False
    # Token counters incl. radix-cache hits (cache_stats). SGLang registers its metrics
    # process-wide and never unregisters them, so at most one engine per process lifetime
    # may turn them on (e.g. a diagnostic reward engine); off by default.
    enable_metrics: bool = False
    trust_remote_code: bool = False  # run code shipped in the model folder (auto_map)
    threads: int = 0  # CPU: torch threads of the scheduler process (0: torch's default, all cores)
    base_gpu_id: int = 0  # CUDA: the engine's first GPU (each training rank's engine sits on its own)
    tp_size: int = 1  # CUDA: tensor-parallel GPUs of the engine, from base_gpu_id on
    nccl_port: int | None = None  # the scheduler's process-group port (None: SGLang picks a free one)
    # SGLang's overlap scheduler runs a batch while the last one's result is processed. Off
    # for an actor whose requests pause in place across weight updates: the batch in flight
    # at the pause finishes under the old weights, but SGLang 0.5.23 counts its token as the
    # new version's (measured: one token per paused request, its log-prob the old weights')
    overlap_schedule: bool = True
    # SGLang's own LoRA serving (engine.lora_serving): adapters loaded by name next to the
    # base weights, applied per request. 0: off; > 0: the largest adapter rank it accepts
    lora_rank: int = 0
    lora_target_modules: str = ""  # comma-separated, e.g. "q_proj,v_proj" ("": SGLang's "all"); JSON-safe
    lora_backend: str | None = None  # None: torch_native on CPU, SGLang's pick (csgmv) on GPU
    cuda_graph: bool = True  # CUDA: capture CUDA graphs for decoding (always off on CPU)
    # requests in flight, generation not paused, nothing received for this long: EngineStalledError (0: never)
    stall_timeout_s: float = 600.0
    # SGLang's own arguments (its ServerArgs) passed last, as (name, value) pairs sorted by
    # name, lists as tuples (hashable; a mapping or list of pairs is accepted and frozen);
    # checked before start-up (engine.start_checks)
    server_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_args", frozen_server_args(self.server_args))

    @property
    def label(self) -> str:
        return f"{self.role} engine ({self.model_path})"


def frozen_server_args(args: Mapping[str, Any] | Iterable[Sequence[Any]]) -> tuple[tuple[str, Any], ...]:
    """``args`` (a mapping, or ``(name, value)`` pairs: JSON gives lists) as pairs sorted by
    name with every list a tuple; a mapping value is refused in one line."""
    pairs = dict(args.items() if isinstance(args, Mapping) else (tuple(p) for p in args))
    check_server_arg_values(pairs)
    return tuple((str(name), _frozen(value)) for name, value in sorted(pairs.items()))


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _thawed(value: Any) -> Any:
    return [_thawed(v) for v in value] if isinstance(value, tuple) else value


def releasable_graphs(cfg: EngineConfig, device: str) -> bool:
    """Whether the engine's CUDA graphs are captured into memory its release gives back (the
    memory saver's ``cuda_graph`` tag): on CUDA with the memory saver and graphs on. SGLang
    0.5.23 tags graph memory only when its scheduler starts with
    ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` set (``engine.sglang_api.child_graph_memory``), and
    then only the decode graphs' ("full" backend): the prefill graphs are left out
    (``_server_kwargs``). Without it a release keeps every graph's pool: measured on an H200
    (issue 53), 16 of the engines' 18 GiB stayed held."""
    return device == "cuda" and cfg.enable_memory_saver and cfg.cuda_graph


def default_attention_backend(device: str, compiled_kernels: bool) -> str | None:
    """The attention backend of an engine whose config names none (None: SGLang's own pick).

    CPU: colocate's ``colocate_cpu`` (``engine/cpu_attention.py``: ``torch_native`` with one
    attention call per layer for a decode batch) where SGLang runs our plugin
    (``sglang_api.plugin_installed``), else ``torch_native``. CUDA with SGLang's compiled kernels installed: SGLang's pick
    (0.5.23, ``get_default_attn_backend``: fa3 on Hopper, from sgl_kernel's flash-attention
    ops; trtllm_mha on Blackwell; else flashinfer where importable, else triton). CUDA
    without them (the GPU kit of scripts/gpu_kit, whose sgl_kernel is a pure-Python
    stand-in): ``triton``, SGLang's own Triton kernels, which need nothing compiled ahead
    (SGLang's pick would be fa3 on a Hopper card, which needs the missing kernels)."""
    if device == "cpu":
        return sglang_api.CPU_ATTENTION if sglang_api.plugin_installed() else "torch_native"
    return None if compiled_kernels else "triton"


@functools.lru_cache(maxsize=1)
def compiled_cuda_kernels() -> bool:
    """Whether SGLang's compiled CUDA kernels are installed: an ``sgl_kernel`` package holding
    compiled extension modules (``*.so``; the GPU kit's stand-in holds only Python). Found
    with ``importlib.util.find_spec``: nothing of SGLang is imported."""
    try:
        spec = importlib.util.find_spec("sgl_kernel")
    except (ImportError, ValueError):
        return False
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(next(Path(folder).rglob("*.so"), None) is not None for folder in folders)


def child_quit(*_: Any) -> None:
    """SIGQUIT from one of an engine's processes (SGLang's children send it to their parent
    when they fail): nothing. colocate tells a dead child itself, in one line: at start
    SGLang's start raises (``SglangEngine``), at run time ``engine.runtime.run_guarded``."""


def _server_kwargs(cfg: EngineConfig, device: str, compiled_kernels: bool | None = None) -> dict[str, Any]:
    """SGLang's ``ServerArgs`` keywords of ``cfg`` on ``device``; ``compiled_kernels`` (None:
    :func:`compiled_cuda_kernels`) picks the CUDA attention backend when ``cfg`` names none."""
    kw: dict[str, Any] = dict(
        model_path=str(Path(cfg.model_path).expanduser()),
        device=device,
        dtype=cfg.dtype,
        random_seed=cfg.seed,
        skip_tokenizer_init=True,
        log_level=cfg.log_level,
        sleep_on_idle=True,  # an idle scheduler otherwise spins a full core
        context_length=cfg.context_length,
        max_running_requests=cfg.max_running_requests,
        enable_metrics=cfg.enable_metrics,
        trust_remote_code=cfg.trust_remote_code,
        nccl_port=cfg.nccl_port,
        weight_version="0",  # numeric from the start: tokens carry exact version spans
        disable_overlap_schedule=not cfg.overlap_schedule or None,
        # a failed child SIGQUITs its parent, whose SGLang handler then kills it whole: here
        # the signal does nothing and SGLang's start raises instead (engine.runtime)
        custom_sigquit_handler=child_quit,
    )
    if cfg.max_total_tokens is not None:
        kw["max_total_tokens"] = cfg.max_total_tokens
    if cfg.chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = cfg.chunked_prefill_size
    if cfg.role == "reward":
        kw["is_embedding"] = True
    if cfg.lora_rank > 0:
        kw.update(enable_lora=True, max_lora_rank=cfg.lora_rank,
                  lora_target_modules=[m.strip() for m in cfg.lora_target_modules.split(",") if m.strip()] or ["all"])
        backend = cfg.lora_backend or ("torch_native" if device == "cpu" else None)
        if backend:
            kw["lora_backend"] = backend
    if device == "cpu":
        kw["attention_backend"] = cfg.attention_backend or default_attention_backend("cpu", False)
        # CPU: SGLang budgets the KV pool as (RAM free after loading) - (1 - f) x (RAM free
        # before), so loading may take at most f of the free RAM; 0.05 failed once other
        # processes had taken RAM (SmolLM2 needed 0.056). The pool itself is max_total_tokens.
        kw["mem_fraction_static"] = CPU_MEM_FRACTION
        kw.setdefault("max_total_tokens", CPU_DEFAULT_POOL_TOKENS)
        kw["disable_cuda_graph"] = True
    else:
        kw["mem_fraction_static"] = cfg.mem_fraction_static
        kw["enable_memory_saver"] = cfg.enable_memory_saver
        kw["enable_weights_cpu_backup"] = cfg.enable_memory_saver and cfg.weights_cpu_backup
        kw["base_gpu_id"] = cfg.base_gpu_id
        kw["tp_size"] = cfg.tp_size
        compiled = compiled_cuda_kernels() if compiled_kernels is None else compiled_kernels
        kw["attention_backend"] = cfg.attention_backend or default_attention_backend(device, compiled)
        if not cfg.cuda_graph:
            kw["disable_cuda_graph"] = True
        elif releasable_graphs(cfg, device):
            # SGLang 0.5.23 captures its prefill graphs (the "breakable" backend, its CUDA
            # default) into a pool the memory saver never tags, and refuses to start
            # them with tagged graph memory; the decode graphs carry the step's tokens
            kw["disable_prefill_cuda_graph"] = True
    kw = {k: v for k, v in kw.items() if v is not None}
    return kw | {name: _thawed(value) for name, value in cfg.server_args}
