"""Starting, driving and stopping one in-process SGLang engine.

Owns: :class:`SglangEngine`, an adapter with one method per runtime operation colocate
needs (streamed generate, abort, embedding/score request, bucketed weight update, cache
flush, memory release/resume (waiting for an idle scheduler first, every call guarded),
shutdown of this engine's own processes only), and :func:`run_guarded`.

Leaves out: the engine configuration and the SGLang arguments it becomes
(``engine.engine_config``); what a rollout or a reward score means (colocate's rollout room,
``engine.reward``); SGLang imports (``engine.sglang_api``); the checks before start-up
(``engine.start_checks``); a bucket's wire form and its payload per tensor-parallel rank
(``engine.weight_payloads``).
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Sequence

import psutil

from .child_output import ChildOutput, last_line
from .engine_config import EngineConfig, _server_kwargs, child_quit, releasable_graphs
from .errors import EngineError, EngineStalledError
from .in_process import end_contexts_since, end_tokenizer_side, give_back_sigterm, zmq_contexts
from .start_checks import check_allocator_conf, check_startable, start_error
from .weight_payloads import Exchange, bucket_data, rank_payloads, with_last
from . import sglang_api


class EngineDiedError(EngineError):
    """An engine's scheduler process is gone."""


# SGLang's memory tags (sglang.srt.constants), in the order they wake: the weights first
# (then the new weights are pushed), the KV cache and the CUDA graphs' buffers last, so
# the memory the trainer just freed is not taken by KV before the push has room.
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
STORE_PREFIX = "colocate-store-"  # a temporary folder per engine: its schedulers' process-group store
OUTPUT_PREFIX = "colocate-engine-"  # a temporary file per engine: what its processes write (engine.child_output)
MEMORY_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class SglangEngine:
    """One running SGLang engine; one method per runtime operation."""

    def __init__(self, cfg: EngineConfig, *, field: str = "model_path"):
        self.cfg = cfg
        # one line before any of SGLang's processes starts: the folder, SGLang's arguments, its model class
        self.architecture = check_startable(cfg, field)
        platform = sglang_api.prepare(cfg.device)
        self.device = platform.device
        if platform.device == "cuda" and cfg.enable_memory_saver:
            check_allocator_conf(os.environ)
        api = sglang_api.load()
        self._api = api
        started = time.perf_counter()
        free_before = _device_free_bytes(cfg.base_gpu_id) if platform.device == "cuda" else 0
        # the schedulers' process-group store: a file of this engine's own (no socket), gone at shutdown
        self._store_dir = Path(tempfile.mkdtemp(prefix=STORE_PREFIX))
        before = _children()
        self._output = ChildOutput(OUTPUT_PREFIX)  # what the engine's processes write, held while it starts
        contexts = zmq_contexts()  # a failed start's own are ended (engine.in_process)
        sigterm = signal.getsignal(signal.SIGTERM)  # SGLang replaces it: put back once started
        try:
            with sglang_api.child_threads(cfg.threads if platform.device == "cpu" else 0), \
                    sglang_api.child_progress_bars(sglang_api.shows_progress(cfg.log_level)), \
                    sglang_api.child_graph_memory(releasable_graphs(cfg, platform.device)), \
                    sglang_api.child_rendezvous(self._store_dir / "store", platform.device, _shm_port(cfg)), \
                    sglang_api.start_lines_dropped():
                self._engine = api.Engine(**_server_kwargs(cfg, platform.device))  # a failed child raises here
        except (RuntimeError, ValueError, OSError, EOFError, KeyError) as exc:
            said = last_line(self._output.failed())
            self._output.close(keep=bool(said))
            _stop(_children() - before)  # this start's processes: a detokenizer outlives its scheduler
            shutil.rmtree(self._store_dir, ignore_errors=True)
            end_contexts_since(contexts)  # else a later garbage collection hangs in its context's end
            raise start_error(cfg, exc, architecture=self.architecture, said=said,
                              log=self._output.path if said else None) from None
        except BaseException:  # anything else (an interrupt): stderr back, SGLang's output kept
            self._output.failed()
            self._output.close(keep=True)
            _stop(_children() - before)  # this start's processes: one still importing SGLang has no parent-death signal
            shutil.rmtree(self._store_dir, ignore_errors=True)
            end_contexts_since(contexts)
            raise
        self._output.started()
        self.start_seconds = time.perf_counter() - started
        # CUDA: the memory the engine took on its (first) GPU as it started: weights, KV pool,
        # graphs (what a release should give back; 0 on CPU)
        self.start_gpu_bytes = free_before - _device_free_bytes(cfg.base_gpu_id) if free_before else 0
        self._model_name = _server_kwargs(cfg, platform.device)["model_path"]
        self._child_pids = list(self._engine.get_all_child_pids())
        # SGLang's exit hook (Engine.shutdown) kills every child of this process, those of
        # other engines and libraries included (e.g. the W&B service, whose own exit hook
        # then fails); ours stops this engine's processes only.
        atexit.unregister(self._engine.shutdown)
        atexit.register(self.shutdown)
        # SGLang's own watchdog SIGQUITs this whole process when a child dies; colocate
        # watches its engines itself (run_guarded) to stop with a clear error instead.
        watchdog = getattr(self._engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        # SGLang adds its SIGTERM/SIGQUIT handlers to the event loop on the first request;
        # do it now, so a handler the application installs afterwards is not replaced. It
        # must run inside the engine's loop: outside one, SGLang makes a new loop of its own
        # and the tokenizer manager's receive task would never run.
        self.loop.run_until_complete(self._start_handle_loop())
        if threading.current_thread() is threading.main_thread():  # where SGLang added its handler
            self.loop.add_signal_handler(signal.SIGQUIT, child_quit)  # its running-phase one kills the process
        give_back_sigterm(self.loop, sigterm)  # its handler drains, then kills this whole process tree
        self.weight_version = 0
        self.requests = 0  # generate and score requests sent so far
        self.closed = False
        self.paused: str | None = None  # the pause mode while generation is paused (see pause)
        self._suspended = False  # CPU: the engine's processes are stopped (SIGSTOP) while paused
        # check_progress: requests in flight and nothing received for this long (0: never); the
        # engine's own setting, which a caller holding a started engine (a pool's) may change
        self.stall_timeout_s = cfg.stall_timeout_s
        self._last_sent = time.time()  # this process's last request or control call to the engine

    async def _start_handle_loop(self) -> None:
        self._engine.tokenizer_manager.auto_create_handle_loop()

    # ---- properties -------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._engine.loop

    @property
    def context_length(self) -> int:
        return int(self._engine.tokenizer_manager.context_len)

    @property
    def child_pids(self) -> list[int]:
        return list(self._child_pids)

    def in_flight(self) -> int:
        """Requests sent and not yet ended: SGLang forgets a request as its last output (or
        its abort) reaches this process, before its stream ends. The scheduler may hold it a
        moment longer (``wait_idle``)."""
        return len(self._engine.tokenizer_manager.rid_to_state)

    def cache_stats(self) -> dict[str, float]:
        """Totals of prompt tokens and of those served from the radix cache so far."""
        if not self.cfg.enable_metrics:
            raise RuntimeError(f"the {self.cfg.label} was started without enable_metrics")
        return sglang_api.token_counters(self._model_name)

    def alive(self) -> bool:
        return all(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in self._child_pids) and not self.closed

    def check_progress(self) -> None:
        """Raise :class:`EngineStalledError` when requests are in flight, generation is not
        paused, and nothing came back from the scheduler (outputs or replies) nor was sent to
        it for longer than ``stall_timeout_s``: a scheduler alive but stuck (or a request no
        one will ever continue) ends the step in one line instead of a wait forever."""
        if self.stall_timeout_s <= 0 or self.paused is not None or self.closed:
            return
        waiting = self.in_flight()
        if not waiting:
            return
        quiet = time.time() - max(
            sglang_api.last_received(self._engine.tokenizer_manager), self._last_sent)
        if quiet > self.stall_timeout_s:
            raise EngineStalledError(
                f"the {self.cfg.label} sent nothing back for {quiet:.0f} s with {waiting} request(s) in flight "
                f"(its processes alive, generation not paused); resume from the last checkpoint with --resume",
                fix="stall_timeout")

    def check_alive(self) -> None:
        if not self.alive():
            self._output.pass_on()  # what its processes wrote last
            said = f"; SGLang's last line: {self._output.last}" if self._output.last else ""
            raise EngineDiedError(f"the {self.cfg.label} died (its scheduler process is gone){said}; "
                                  "resume from the last checkpoint with --resume")

    # ---- requests (async, on self.loop) ---------------------------------------------
    async def generate_stream(
        self, rid: str, input_ids: list[int], sampling: dict[str, Any], lora: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream cumulative ``output_ids`` and sampling logprobs of one request. A paused
        engine is continued first (its paused requests go on beside this one): a new
        request never waits on a pause nobody would end. ``lora``: the name of a loaded
        adapter to serve it with (an engine with ``lora_rank`` > 0; ``engine.lora_serving``)."""
        if self.paused is not None:
            await self.continue_generation()
        self._last_sent = time.time()
        # the radix cache is namespaced by weight version: a request never reuses KV that
        # older weights computed, even when requests paused across an update kept the
        # cache from being flushed (their own KV stays theirs: PipelineRL's in-flight update)
        obj = self._api.GenerateReqInput(
            input_ids=input_ids, sampling_params=sampling, return_logprob=True,
            stream=True, rid=rid, extra_key=f"w{self.weight_version}", lora_path=lora,
        )
        self.requests += 1
        async for chunk in self._engine.tokenizer_manager.generate_request(obj, None):
            yield chunk

    async def score(self, rid: str, input_ids: list[int]) -> dict[str, Any]:
        """One embedding/score request (reward engine)."""
        obj = self._api.EmbeddingReqInput(input_ids=input_ids, rid=rid)
        self.requests += 1
        self._last_sent = time.time()
        gen = self._engine.tokenizer_manager.generate_request(obj, None)
        return await gen.__anext__()

    def abort(self, rid: str) -> None:
        """Abort one request; its stream ends with finish_reason 'abort'."""
        self._thaw()
        self._engine.tokenizer_manager.abort_request(rid=rid)

    async def pause(self, mode: str) -> None:
        """Stop generating and keep the running requests in the scheduler (their streams
        stay open): ``in_place`` keeps their KV (tokens after a weight update continue on
        it), ``retract`` puts them back in the scheduler's queue (their KV is recomputed on
        continue, under the weights then loaded) until :meth:`continue_generation`, which
        a new request (:meth:`generate_stream`) calls first. On CPU the engine's processes are also stopped until
        the next call that needs them: SGLang 0.5.23's paused scheduler polls its socket
        without sleeping (measured: 102 % of a core, 0 % stopped), which on a 2-core
        machine would take a core from the trainer."""
        self._thaw()
        await self._engine.tokenizer_manager.pause_generation(self._api.PauseGenerationReqInput(mode=mode))
        self.paused = mode
        if self.device == "cpu":
            self._signal_processes(suspend=True)

    async def continue_generation(self) -> None:
        """Let paused requests go on (under the weights loaded meanwhile); no-op unpaused."""
        self._thaw()
        if self.paused is None:
            return
        obj = self._api.ContinueGenerationReqInput(torch_empty_cache=self.device == "cuda")
        await self._engine.tokenizer_manager.continue_generation(obj)
        self.paused = None
        self._last_sent = time.time()  # the paused requests' silence so far is not a stall

    def continue_paused(self) -> None:
        """:meth:`continue_generation` from outside the engines' loop (guarded); no-op unpaused."""
        if self.paused is not None:
            run_guarded([self], self.continue_generation())

    def _thaw(self) -> None:
        if self._suspended:
            self._signal_processes(suspend=False)

    def _signal_processes(self, *, suspend: bool) -> None:
        for pid in self._child_pids:
            try:
                proc = psutil.Process(pid)
                proc.suspend() if suspend else proc.resume()
            except psutil.NoSuchProcess:
                continue  # a dead scheduler is reported by check_alive
        self._suspended = suspend

    # ---- control (sync; call while no request is in flight) --------------------------
    def update_weights(self, buckets: Iterable[list[tuple[str, Any]]], version: int,
                       flattened: bool | None = None, exchange: Exchange | None = None) -> float:
        """Load named tensors bucket by bucket; flush the radix cache on the last bucket.
        Buckets are consumed one at a time (one look-ahead to know the last), so a lazy
        ``buckets`` keeps at most two bucket copies alive. ``flattened`` (default: on CUDA)
        sends each bucket as one byte tensor plus metadata (SGLang's ``flattened_bucket``):
        a CUDA tensor then crosses as one CUDA-IPC handle, the scheduler copying device to
        device; host tensors go faster as plain lists (measured: 0.28 vs 0.93 s per push of
        SmolLM2 on CPU). ``exchange`` (a tensor-parallel engine whose TP ranks' GPUs belong to
        other training ranks): maps this process's serialized bucket to every TP rank's
        payload, TP rank i's own copy from its own GPU (``engine.weight_payloads``); without
        it every TP rank is sent a handle of this process's copy. Every request to the
        scheduler is guarded: a scheduler that dies meanwhile raises
        :class:`EngineDiedError` instead of leaving the call waiting forever."""
        flattened = self.device == "cuda" if flattened is None else flattened
        self._thaw()
        # requests paused in place hold KV, so SGLang refuses the flush; the version
        # namespace of the radix cache (generate_stream) keeps new requests off stale KV
        flush = self.paused != "in_place"
        started = time.perf_counter()
        tm = self._engine.tokenizer_manager
        _raise_failed(self.cfg.label, "begin_weight_update",
                      run_guarded([self], tm.begin_weight_update(self._api.BeginWeightUpdateReqInput(selector="all"), None)))
        try:
            for bucket, last in with_last(buckets):
                ok, message = self._update_bucket(bucket, flush=last and flush, version=version if last else None,
                                                  flattened=flattened, exchange=exchange)
                if not ok:
                    raise RuntimeError(f"weight update into the {self.cfg.label} failed: {message}")
        except BaseException:
            if self.alive():  # the session is closed; the first error (or a dead scheduler's) is the one to report
                run_guarded([self], tm.end_weight_update(self._api.EndWeightUpdateReqInput(), None))
            raise
        _raise_failed(self.cfg.label, "end_weight_update",
                      run_guarded([self], tm.end_weight_update(self._api.EndWeightUpdateReqInput(), None)))
        self.weight_version = version
        return time.perf_counter() - started

    def _update_bucket(self, bucket, *, flush: bool, version: int | None, flattened: bool,
                       exchange: Exchange | None = None):
        data = bucket_data(bucket, flattened)  # alive until the scheduler has loaded it (the call returns)
        # one payload per tensor-parallel rank, entry i for TP rank i: each deserializes its own
        payloads = rank_payloads(data, self.cfg.tp_size, exchange)
        obj = self._api.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, flush_cache=flush,
            load_format="flattened_bucket" if flattened else None,
            weight_version=None if version is None else str(version),
        )
        out = run_guarded([self], self._engine.tokenizer_manager.update_weights_from_tensor(obj, None))
        return out if isinstance(out, tuple) else (out.success, out.message)

    def read_weight(self, name: str, truncate: int = 100) -> list:
        """The first ``truncate`` values of parameter ``name`` as the engine holds it
        (HF name; for checking a sync)."""
        self._thaw()
        return self._engine.get_weights_by_name(name, truncate)

    def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """Drop the radix cache. ``timeout_s`` 0: at once, False when SGLang refuses because
        requests still run or wait; > 0: the scheduler defers the flush until it is idle,
        False when that took longer than ``timeout_s``."""
        self._thaw()
        out = run_guarded([self], self._engine.tokenizer_manager.flush_cache(timeout_s=timeout_s or None))
        return bool(getattr(out, "success", True))

    def wait_idle(self, timeout_s: float = 60.0) -> float:
        """Wait until the scheduler is idle (with a flush SGLang defers until then); returns
        the seconds waited. Right after the last streamed token, or after aborts, the
        scheduler may still hold requests for a moment; SGLang asserts idleness before it
        releases memory, and a scheduler that fails an assertion takes the whole run down.
        Raises a one-line :class:`EngineError` after ``timeout_s``."""
        started = time.perf_counter()
        if not self.flush_cache(timeout_s=timeout_s):
            raise EngineError(f"the {self.cfg.label} still had requests running after {timeout_s:g} s, "
                              "so its memory could not be released for training")
        return time.perf_counter() - started

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> bool:
        """Free ``tags`` (weights, KV cache, CUDA graphs) for training (GPU), once the
        scheduler is idle. Returns False where it is a no-op (CPU: the memory saver needs CUDA)."""
        if self.device != "cuda":
            return False
        self.wait_idle()
        obj = self._api.ReleaseMemoryOccupationReqInput(tags=list(tags))
        run_guarded([self], self._engine.tokenizer_manager.release_memory_occupation(obj, None))
        return True

    def resume_memory(self, tags: Sequence[str]) -> bool:
        """Re-allocate ``tags`` on GPU (see :data:`MEMORY_TAGS` for the order). CPU: False, no-op."""
        if self.device != "cuda":
            return False
        self._thaw()
        obj = self._api.ResumeMemoryOccupationReqInput(tags=list(tags))
        run_guarded([self], self._engine.tokenizer_manager.resume_memory_occupation(obj, None))
        return True

    def shutdown(self) -> None:
        """Stop this engine's processes only (``Engine.shutdown`` would kill every child
        of the process, including another engine's scheduler)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        watchdog = getattr(self._engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        pids = set()
        for pid in self._child_pids:
            try:
                pids |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
            except psutil.NoSuchProcess:
                continue
        _stop(pids)
        end_tokenizer_side(self._engine)  # else its tasks, sockets and context outlive the engine
        self._output.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop(pids: set[int]) -> None:
    """Kill ``pids`` (processes of this one) and wait for them. Those multiprocessing
    started are joined through their handles and the handles closed: reaped by psutil
    instead, a handle never learns its exit and keeps its pipe open
    (``multiprocessing.active_children()`` listed them as alive forever)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].kill()
        except psutil.NoSuchProcess:
            continue
    for child in multiprocessing.active_children():
        if child.pid in pids:
            child.join(timeout=30)
            if child.exitcode is not None:
                child.close()
    psutil.wait_procs(procs, timeout=30)


def _shm_port(cfg: EngineConfig) -> int:
    """The port SGLang's CPU shared-memory all-reduce names its segments after: the
    engine's ``nccl_port``, or a free one (what SGLang would have picked)."""
    if cfg.nccl_port is not None:
        return cfg.nccl_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _device_free_bytes(gpu: int) -> int:
    import torch  # CUDA engines only; the device is read as every process on it sees it

    return int(torch.cuda.mem_get_info(gpu)[0])


def _raise_failed(label: str, call: str, reply: Any) -> None:
    """Raise a one-line :class:`EngineError` when SGLang's reply to ``call`` (``(success,
    message)``, or an object with both) says it failed."""
    ok, message = reply if isinstance(reply, tuple) else (getattr(reply, "success", True), getattr(reply, "message", ""))
    if not ok:
        raise EngineError(f"weight update of the {label}: SGLang's {call} failed: "
                          f"{' '.join(str(message).split())}")


async def _watch(engines: Sequence[SglangEngine], interval_s: float) -> None:
    while True:
        for eng in engines:
            eng.check_alive()
            eng.check_progress()
        await asyncio.sleep(interval_s)


def run_guarded(engines: Sequence[SglangEngine | None], coro, interval_s: float = 0.5):
    """Run ``coro`` on the engines' loop; raise :class:`EngineDiedError` as soon as one of
    ``engines`` loses its scheduler process, and :class:`EngineStalledError` once one sent
    nothing back for its ``stall_timeout_s`` with requests in flight, instead of waiting
    forever on its stream."""
    live = [e for e in engines if e is not None]
    loop = live[0].loop

    async def guarded():
        main = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(_watch(live, interval_s))
        done, _ = await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if main in done:
            return main.result()
        main.cancel()
        return watch.result()  # raises EngineDiedError

    return loop.run_until_complete(guarded())
