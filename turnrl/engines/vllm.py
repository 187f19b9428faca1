"""The vLLM engine: vLLM's V1 engine core in this process, behind the token-ids-in, token-ids-out protocol.

Why not `AsyncLLM`: in vLLM 0.32, `AsyncLLM` always starts its engine core in a separate process
(`EngineCoreClient.make_async_mp_client`; `make_client` raises NotImplementedError for asyncio without
multiprocessing), and tensors do not survive that process boundary, so a weight update would need a disk or
NCCL round trip. The in-process form is `LLMEngine` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` and the `uni`
executor (an `InprocClient`). One dedicated thread builds it and steps it; coroutines talk to that thread
through a queue, and every request is added as soon as it arrives, between two engine steps, so vLLM's
scheduler batches whatever is in flight (continuous batching, no rounds). Model compute releases the GIL,
so tools and simulated users keep running on the event loop while the engine steps.

- Prompts go in as token ids (`vllm.inputs.tokens_input`, the engine-level form of a `TokensPrompt`, which
  0.32 deprecates as an engine input); the tokenizer is never loaded (`skip_tokenizer_init`), outputs are
  not detokenized. Generation stops only on `Sampling.stop_token_ids` (`ignore_eos=True` turns off vLLM's
  own EOS check, as in the hf engine); the stop token is kept in the returned ids.
- Logprobs: `logprobs_mode="processed_logprobs"` is log softmax(logits / temperature), taken after the
  temperature and before sampling; greedy rows use temperature 1. That is the protocol's quantity exactly
  when no top-p/top-k truncation is applied; with truncation vLLM returns the renormalized truncated
  distribution instead, so such requests are refused (use the hf engine or top_p=1, top_k=0).
  (`raw_logprobs`, vLLM's default, ignores the temperature.)
- `update_weights` reloads tensors in place and resets the prefix cache; a partial update of a fused layer
  (q/k/v, gate/up) is completed from the checkpoint. How, and when it is refused: `vllm_weights`.
- `update_lora` sends only the adapter, written as a peft directory to /dev/shm (`vllm_weights.write_adapter`)
  and registered under a fresh `lora_int_id` per version; later requests use it, the base weights stay as
  loaded.
- `sleep(level)` / `wake_up()` free and restore GPU memory between rollouts (vLLM's sleep mode: level 1
  offloads weights to host memory and drops the KV cache, level 2 drops the weights too, so an
  `update_weights` must follow the wake-up). vLLM's CPU build has no sleep mode; there they raise.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

import torch

from turnrl.engines.base import Capabilities, Completion, Delta, EngineBase, EngineError, Sampling
from turnrl.engines.hf import native_bf16
from turnrl.engines.omp_pool import release_idle_pool
from turnrl.engines.vllm_args import VLLMSettings, check_settings, engine_args, resolved_dtype
from turnrl.engines.vllm_weights import WeightLoader, write_adapter
from turnrl.engines.worker import stream_through

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def import_vllm() -> Any:
    """Import vllm for in-process use: the env var must be set before vllm reads it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    return vllm


@dataclass
class _Request:
    rid: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt: list[int]
    params: Any
    lora: Any = None
    version: int = 0                     # the weights it runs on (set by the engine thread when it is added)
    ids: list[int] = field(default_factory=list)         # incremental: the tokens so far (DELTA outputs)
    logprobs: list[float] = field(default_factory=list)
    listener: Any = None                 # `stream`: told each step's tokens
    incremental: bool = False            # reads DELTA outputs (partial rollouts, streaming)


@dataclass
class _Adapter:
    request: Any          # vllm LoRARequest
    directory: Path
    version: int


class VLLMEngine(EngineBase):
    """vLLM in this process; `generate` is safe to call from many coroutines of one event loop at once."""

    def __init__(self, model_path: str, dtype: str = "auto", max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 enable_prefix_caching: bool = True, cpu_kv_cache_gb: float = 2.0, seed: int = 0,
                 max_lora_rank: int = 0, enable_sleep_mode: bool = False, max_num_seqs: int = 0,
                 partial_rollout: bool = False, cpu_threads: int = 0):
        settings = VLLMSettings(
            str(model_path), dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching, cpu_kv_cache_gb=cpu_kv_cache_gb, seed=seed,
            max_lora_rank=max_lora_rank, enable_sleep_mode=enable_sleep_mode, max_num_seqs=max_num_seqs)
        check_settings(settings, cpu_threads)
        # On CPU: rollout and update take turns in one process (the local trainer; split placements give an
        # engine actor its own threads), so the engine computes with as many threads as the trainer. Measured
        # (wide calculator rollout, 32 trajectories, float32, quiet 2-core machine): 25.7 s with 2 threads
        # against 53.6 s with 1, the same 3,297 tokens. Set 1 where other work shares the cores during
        # rollout: OpenMP workers then spin-wait between the many small ops of a decode step.
        self.cpu_threads = cpu_threads or torch.get_num_threads()
        vllm = import_vllm()
        from vllm.platforms import current_platform
        self.on_cpu = current_platform.is_cpu()
        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(f"vLLM sleep mode needs a CUDA/ROCm GPU; this vLLM runs on "
                             f"{current_platform.device_type}: set engine.enable_sleep_mode=false")
        self.model_path = Path(model_path)
        self.seed = seed
        self.version = 0
        self.in_flight = 0                 # requests submitted and not yet answered (for progress)
        self.max_model_len = max_model_len  # the agent loop's context never passes it
        self.vllm_version = vllm.__version__
        args = engine_args(settings, resolved_dtype(dtype, self.on_cpu, native_bf16(torch.device("cpu"))),
                           self.on_cpu)
        # top-p/top-k logprobs would not be the full distribution's
        self.capabilities = Capabilities(truncated_sampling=False, lora_adapters=bool(max_lora_rank),
                                         sleep=enable_sleep_mode, partial_rollout=True, streaming=True)
        # partial rollouts read each step's new tokens (DELTA outputs), so an interrupted request returns them
        self.partial_rollout = partial_rollout
        self._lora: Any = None             # the adapter new requests use (set on the engine thread)
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0,
                      "aborted": 0, "weight_updates": 0, "lora_updates": 0, "interrupted": 0}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._adapters: list[_Adapter] = []
        self._lora_ids = itertools.count(1)
        self._closed = False
        self._dead: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(args,), name="turnrl-vllm-engine", daemon=True)
        # In-process, vLLM seeds the global random, numpy and torch generators with its seed; the caller's
        # (the trainer's) streams must not depend on whether an engine was built.
        caller_threads, rng = torch.get_num_threads(), _global_rng_state()
        self._thread.start()
        self._ready.wait()
        _set_global_rng_state(rng)
        if torch.get_num_threads() != caller_threads:
            torch.set_num_threads(caller_threads)
        if self._dead is not None:
            raise EngineError(f"vllm engine failed to start: {type(self._dead).__name__}: {self._dead}") \
                from self._dead

    @classmethod
    def from_config(cls, model_dir: str, cfg: Any) -> "VLLMEngine":
        return cls(model_dir, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
                   enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
                   cpu_kv_cache_gb=cfg.cpu_kv_cache_gb, seed=cfg.seed,
                   max_lora_rank=cfg.max_lora_rank, enable_sleep_mode=cfg.enable_sleep_mode,
                   max_num_seqs=cfg.max_num_seqs, partial_rollout=cfg.partial_rollout, cpu_threads=cfg.cpu_threads)

    # -- public API ----------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        return await self._generate(prompt_ids, sampling)

    async def stream(self, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Delta | Completion]:
        async for item in stream_through(lambda listener: self._generate(prompt_ids, sampling, listener)):
            yield item

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, listener: Any = None) -> Completion:
        if self._closed or self._dead is not None:
            raise EngineError("engine is closed" if self._closed else f"vllm engine died: {self._dead}")
        if not prompt_ids:
            raise EngineError("empty prompt")
        if sampling.top_p < 1.0 or sampling.top_k > 0:
            raise EngineError("the vllm engine reports logprobs of the top-p/top-k truncated distribution, not the "
                              "full one the trainer recomputes: set rollout.sampling.top_p=1 and top_k=0, or use "
                              "engine.kind=hf")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        n = next(self._ids)
        seed = sampling.seed if sampling.seed is not None else (self.seed * 1_000_003 + n) & 0x7FFFFFFF
        params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, seed=seed,
                                logprobs=0, stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True,
                                detokenize=False, skip_special_tokens=False,
                                output_kind=RequestOutputKind.DELTA if self.partial_rollout or listener
                                else RequestOutputKind.FINAL_ONLY)
        loop = asyncio.get_running_loop()
        req = _Request(f"turnrl-{n}", loop, loop.create_future(), list(prompt_ids), params, listener=listener,
                       incremental=self.partial_rollout or listener is not None)
        self._inbox.put(("add", req))
        self.in_flight += 1
        try:
            return await req.future
        except asyncio.CancelledError:
            self._inbox.put(("abort", req.rid))
            raise
        finally:
            self.in_flight -= 1

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load (name, tensor) pairs under the HF model's names in place, then drop the prefix cache."""
        def load(engine: Any) -> None:
            self._weights.load(engine, named_tensors)
            self._new_version(engine, version)
        await self._call(load)
        self.stats["weight_updates"] += 1

    async def update_lora(self, adapter_tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                          version: int) -> None:
        """Use this peft adapter (its `lora_A`/`lora_B` tensors and `LoraConfig` as a dict) from now on."""
        if not self.capabilities.lora_adapters:
            raise EngineError("this vllm engine was started without LoRA slots: set engine.max_lora_rank to at "
                              "least model.lora.rank")
        from vllm.lora.request import LoRARequest
        directory = write_adapter(adapter_tensors, peft_config)
        lora_id = next(self._lora_ids)
        request = LoRARequest(lora_name=f"turnrl-v{version}-{lora_id}", lora_int_id=lora_id, lora_path=str(directory))
        def add(engine: Any) -> bool:
            if not engine.add_lora(request):
                return False
            self._lora = request
            self._new_version(engine, version)
            return True
        try:
            loaded = await self._call(add)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if not loaded:
            shutil.rmtree(directory, ignore_errors=True)
            raise EngineError(f"vllm did not load the adapter of version {version}")
        self._adapters.append(_Adapter(request, directory, version))
        # Keep the previous adapter's directory: requests still in flight may need vLLM to reload it.
        for old in self._adapters[:-2]:
            shutil.rmtree(old.directory, ignore_errors=True)
        self._adapters = self._adapters[-2:]
        self.stats["lora_updates"] += 1

    async def sleep(self, level: int = 1) -> None:
        """Free GPU memory: level 1 offloads the weights to host memory, level 2 discards them (send new
        weights with `update_weights` after `wake_up`). Requests in flight finish with 'abort'."""
        if not self.capabilities.sleep:
            raise EngineError("sleep mode is off: start the engine with engine.enable_sleep_mode=true (needs a "
                              "CUDA/ROCm GPU; vLLM's CPU build has no sleep mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        await self._call(lambda engine: (self._abort_all(engine), engine.sleep(level)))

    async def wake_up(self) -> None:
        if not self.capabilities.sleep:
            raise EngineError("sleep mode is off: start the engine with engine.enable_sleep_mode=true")
        await self._call(lambda engine: engine.wake_up())

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks start each phase cold with it)."""
        await self._call(lambda engine: engine.reset_prefix_cache(reset_running_requests=True))

    async def unfinished(self) -> int:
        """Requests vLLM still holds (waiting or running)."""
        return await self._call(lambda engine: engine.get_num_unfinished_requests())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(("close", None))
        await asyncio.to_thread(self._thread.join, 30.0)
        for adapter in self._adapters:
            shutil.rmtree(adapter.directory, ignore_errors=True)
        self._adapters = []

    # -- the engine thread ---------------------------------------------------------------------------
    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(llm_engine) on the engine thread between two steps."""
        if self._closed or self._dead is not None:
            raise EngineError("engine is closed" if self._closed else f"vllm engine died: {self._dead}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        return await future

    def _run(self, args: dict[str, Any]) -> None:
        set_num_threads = torch.set_num_threads
        try:
            from vllm import EngineArgs
            from vllm.v1.engine.core_client import InprocClient
            from vllm.v1.engine.llm_engine import LLMEngine
            engine = LLMEngine.from_engine_args(EngineArgs(**args))
            if not isinstance(engine.engine_core, InprocClient):
                raise RuntimeError(f"expected an in-process engine core, got {type(engine.engine_core).__name__}")
            self._weights = WeightLoader.for_engine(engine, self.model_path)
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor
            self._dead = exc
            self._ready.set()
            return
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads for the whole process; the trainer in this
            # process must keep it.
            torch.set_num_threads = set_num_threads
        if self.on_cpu:
            # The engine's OpenMP threads (`cpu_threads`; vLLM's worker sets its own count through the
            # replacement above, which in-process would change the trainer's too). Thread counts are per
            # thread, so the caller's own count is unchanged.
            set_num_threads(self.cpu_threads)
        self._ready.set()
        try:
            self._loop(engine)
        finally:
            self._fail_all(EngineError("engine closed"))
            try:
                engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    def _loop(self, engine: Any) -> None:
        while True:
            if not self._live and self._inbox.empty():
                release_idle_pool()      # idle: the trainer's thread computes next (omp_pool.py)
            commands = [self._inbox.get()] if not self._live else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, payload in commands:
                if kind == "close":
                    self._abort_all(engine)
                    return
                if kind == "add":
                    self._add(engine, payload)
                elif kind == "abort" and payload in self._live:
                    del self._live[payload]
                    engine.abort_request([payload])
                    self.stats["aborted"] += 1
                elif kind == "call":
                    fn, loop, future = payload
                    try:
                        _resolve(loop, future, fn(engine))
                    except BaseException as exc:  # noqa: BLE001 - raised in the caller
                        _resolve(loop, future, exc=exc if isinstance(exc, EngineError)
                                 else EngineError(f"{type(exc).__name__}: {exc}"))
            if not self._live:
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # noqa: BLE001 - the engine state is unknown: fail everything, stop
                self._dead = exc
                self._fail_all(EngineError(f"vllm engine step failed: {type(exc).__name__}: {exc}"))
                return
            for out in outputs:
                self._extend(out)
                if out.finished:
                    self._finish(out)
            if not outputs and not engine.has_unfinished_requests():  # never spin on requests vLLM let go
                for req in self._live.values():
                    _resolve(req.loop, req.future, exc=EngineError("vllm dropped the request without an output"))
                self._live.clear()

    def _add(self, engine: Any, req: _Request) -> None:
        from vllm.inputs import tokens_input
        if req.future.cancelled():
            return
        req.lora, req.version = self._lora, self.version
        try:
            engine.add_request(req.rid, tokens_input(req.prompt), req.params, lora_request=req.lora)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            _resolve(req.loop, req.future, exc=EngineError(f"vllm rejected the request: {type(exc).__name__}: {exc}"))
            return
        self._live[req.rid] = req
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(req.prompt)

    def _finish(self, out: Any) -> None:
        req = self._live.pop(out.request_id, None)
        if req is None:  # aborted meanwhile
            return
        c = out.outputs[0]
        reason = _FINISH.get(str(c.finish_reason))
        if reason is None:
            _resolve(req.loop, req.future, exc=EngineError(f"vllm finished the request with {c.finish_reason!r}"))
            return
        ids, logprobs = (req.ids, req.logprobs) if req.incremental else _sampled(c)
        self.stats["generated_tokens"] += len(ids)
        self.stats["cached_prompt_tokens"] += out.num_cached_tokens or 0
        _resolve(req.loop, req.future, Completion(ids, logprobs, reason, req.version))

    def _extend(self, out: Any) -> None:
        req = self._live.get(out.request_id)
        if req is not None and req.incremental:
            ids, logprobs = _sampled(out.outputs[0])
            req.ids += ids
            req.logprobs += logprobs
            if req.listener is not None and ids:
                req.listener(ids, logprobs)

    def _new_version(self, engine: Any, version: int) -> None:
        """On the engine thread, after new weights: later requests run on `version`; with partial rollouts,
        the running ones are aborted in vLLM and returned with their tokens so far ("interrupted")."""
        self.version = version
        if not self.partial_rollout or not self._live:
            return
        engine.abort_request(list(self._live))
        for req in self._live.values():
            self.stats["generated_tokens"] += len(req.ids)
            _resolve(req.loop, req.future, Completion(req.ids, req.logprobs, "interrupted", req.version))
        self.stats["interrupted"] += len(self._live)
        self._live.clear()

    def _abort_all(self, engine: Any) -> None:
        if self._live:
            engine.abort_request(list(self._live))
        for req in self._live.values():
            _resolve(req.loop, req.future, Completion([], [], "abort"))
        self.stats["aborted"] += len(self._live)
        self._live.clear()

    def _fail_all(self, exc: Exception) -> None:
        for req in self._live.values():
            _resolve(req.loop, req.future, exc=exc)
        self._live.clear()
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _resolve(payload.loop, payload.future, exc=exc)
            elif kind == "call":
                _resolve(payload[1], payload[2], exc=exc)


def _sampled(c: Any) -> tuple[list[int], list[float]]:
    """The token ids and their logprobs in one vLLM CompletionOutput (all of them, or a step's with DELTA)."""
    ids = list(c.token_ids)
    logprobs = [step[tok].logprob for step, tok in zip(c.logprobs or [], ids)]
    assert len(logprobs) == len(ids), "vllm returned fewer logprobs than tokens"
    return ids, logprobs


def _global_rng_state() -> tuple[Any, Any, torch.Tensor]:
    import random

    import numpy as np
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_global_rng_state(state: tuple[Any, Any, torch.Tensor]) -> None:
    import random

    import numpy as np
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
             exc: BaseException | None = None) -> None:
    def set_result() -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(set_result)
    except RuntimeError:  # the caller's loop is gone
        pass
