"""The fast embedded engine: slot KV cache, CUDA-graph decode steps, sampling and bookkeeping on the device.

One worker thread owns the GPU work, on its own CUDA stream. Each loop iteration:

1. admission: queued requests go into slots (slots.py), up to `prefill_tokens` padded new tokens (what their
   slot does not hold yet) at a time, and up to `PREFILL_CONTEXT_FACTOR` times that of context for the
   attention to read; those new tokens are prefilled and their first tokens sampled (admit.py: on CUDA one graph
   replay per bucket of sizes, eager at exact sizes elsewhere). The slots are the
   prefix cache: a trajectory's next turn continues the slot its last turn parked in (only the tool result or
   user reply and the template glue are prefilled), and a group's samples copy the prompt KV of the first one;
2. one decode step over the first B slots (B: the bucket above the highest occupied slot), attending to the
   first n_kv cache positions (n_kv: the 128-bucket above the longest possible live sequence). On the GPU the
   step for each (B, n_kv, truncation, greedy rows) is captured once as a CUDA graph and replayed; with
   `compile` on, the layer's pure pieces before and after the cache write go through torch.compile (dynamic
   shapes: one compilation for every bucket), while head + sampling + bookkeeping run as eager kernels (on
   CUDA, sampling without top-k/top-p is two Triton kernels, sample_kernel.py; `fused_sampling=False`: torch).
   Everything the step needs lives in preallocated per-slot tensors: last token, position, count, active flag,
   sampling parameters (temperature, top-k, top-p, seed key), stop ids, max tokens, the output tokens and
   logprobs. Stop and length checks happen on the device: a finished slot stops advancing by itself;
3. an asynchronous copy of each slot's status (count, finished) to pinned host memory, with an event. The host
   reads it when the event has passed (at most `max_inflight` steps later; it waits only when the GPU is that
   far behind), frees finished slots at once and copies their tokens back asynchronously; cancelled requests
   are dropped the same way. There is no per-step host sync.

Sampling (sampling.py) is inverse-CDF with one counter-based uniform per (request seed, token index), so a
request's tokens do not depend on the batch around it (up to float noise); top-k/top-p go through a sorting
variant of the step only when a request in the batch asks for them. On the CPU the same code runs eagerly
without graphs or compilation, which is what the CPU tests check. `update_weights` copies in place on the
worker's stream: the graphs read the same parameter tensors, so they stay valid.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from turnrl.engines.base import Capabilities, Completion, EngineError, Sampling
from turnrl.engines.fast.admit import Admit, Row, to_device
from turnrl.engines.fast.decoder import SlotDecoder
from turnrl.engines.fast.sampling import seed_key
from turnrl.engines.fast.slots import Plan, SlotTable
from turnrl.engines.fast.step import KV_BUCKET, DecodeStep, SlotState, batch_bucket
from turnrl.engines.hf import resolve_device, resolve_dtype
from turnrl.engines.worker import WorkerEngine

log = logging.getLogger(__name__)

# an admission's rows x their longest prompt stays within this many times `prefill_tokens`: with the budget
# counted in new tokens, later turns that reuse their slot's KV could otherwise gather a large context at once
PREFILL_CONTEXT_FACTOR = 8


@dataclass
class _Request:
    prompt: list[int]
    sampling: Sampling
    max_tokens: int                      # sampling.max_tokens, clamped to what fits the slot
    key: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    aborted: bool = False
    plan: Plan | None = None             # its slot and cached prefix, set when it is taken for admission
    waited: bool = False                 # it waited once for a request sharing its prompt (slots.py)
    version: int = 0                     # the weights it was prefilled with (set at admission)

    @property
    def truncates(self) -> bool:
        return self.sampling.top_k > 0 or self.sampling.top_p < 1.0

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature == 0


@dataclass
class _Slot:
    req: _Request
    since: int                           # the sequence number of its admission
    steps: int = 0                       # decode steps since admission


@dataclass
class _Pending:
    """Device work whose result the host reads once `event` has passed (immediately on the CPU)."""
    seq: int
    data: Any
    event: Any = None
    extra: Any = field(default=None)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class FastEngine(WorkerEngine):
    """The embedded engine's fast path; `generate` is safe to call from many coroutines at once."""

    join_timeout_s = 30.0   # a captured graph step may take a while to drain

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", max_batch_size: int = 64,
                 max_len: int = 4096, gather_ms: float = 5.0, seed: int = 0, model: Any = None,
                 compile: bool | None = None, cuda_graphs: bool | None = None, prefill_tokens: int = 16384,
                 max_stop_ids: int = 8, max_inflight: int = 4, exact: bool = False, prefix_cache: bool = False,
                 partial_rollout: bool = False, fused_sampling: bool | None = None, fused_rope: bool | None = None,
                 packed_admissions: bool | None = False):
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        cuda = self.device.type == "cuda"
        if max_batch_size < 1 or max_len < 2 or prefill_tokens < 1 or max_stop_ids < 1 or max_inflight < 1:
            raise ValueError("max_batch_size, prefill_tokens, max_stop_ids and max_inflight must be >= 1, max_len >= 2")
        self.max_batch_size, self.max_len = max_batch_size, max_len
        self.max_model_len = max_len
        self.exact = exact   # engine.exact: the trainer's batch-invariant forward (turnrl/exact), eager
        self.truncated_sampling = not exact
        self.partial_rollout = partial_rollout   # new weights interrupt the running requests (rollout/resume.py)
        self.capabilities = Capabilities(partial_rollout=True)
        self._threads = torch.get_num_threads()   # CPU GEMMs partition by thread count: the trainer's count
        # one slot more than the batch: padded admission rows write it, no decode step reads it (admit.py)
        self.decoder = SlotDecoder(self.model, max_batch_size + 1, max_len, exact=exact)
        self.state = SlotState(max_batch_size + 1, max_len, max_stop_ids, self.device)
        self.max_stop_ids, self.prefill_tokens, self.max_inflight = max_stop_ids, prefill_tokens, max_inflight
        self.gather_s = gather_ms / 1000
        graphs = cuda if cuda_graphs is None else cuda_graphs
        if graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.notes: list[str] = []       # fallbacks taken (compile or capture failures), for reports
        # host seconds of the worker: busy_s in all, admit_s of it admitting (prefill launches, state writes),
        # wait_s of it blocked on the GPU for a status or the tokens of finished requests
        self.stats = {"requests": 0, "generated_tokens": 0, "prefill_tokens": 0, "decode_steps": 0,
                      "graph_replays": 0, "graphs": 0, "busy_s": 0.0, "interrupted": 0, "admissions": 0,
                      "admit_s": 0.0, "wait_s": 0.0,
                      # admissions by how they ran (admit.py): eager at exact sizes, packed eagerly, from a graph
                      "admit_plain": 0, "admit_packed": 0, "admit_replayed": 0, "admit_captured": 0}
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        compile = (cuda if compile is None else compile) and not exact
        self.step = DecodeStep(self.decoder, self.state, compile, graphs, self._stream, self.notes,
                               fused_sampling, fused_rope)
        self.admit = Admit(self.decoder, self.state, max_stop_ids, prefill_tokens, self.step.use_graphs,
                           self.step.pool, self._stream, self.notes, packed_admissions)
        # the prefix cache (slots.py): later turns continue their parked slot, groups copy a running prompt
        self.slots = SlotTable(max_batch_size, enabled=prefix_cache and not exact)
        self._cache_generation = self._cache_seen = 0   # bumped by weight updates: cached KV is stale
        self._occupied: dict[int, _Slot] = {}
        self._snapshots: deque[_Pending] = deque()
        self._fetches: deque[_Pending] = deque()
        self._seq = 0
        self._start_worker("turnrl-fast-engine", seed)

    # -- public API ----------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        self._check(prompt_ids, sampling)
        if len(prompt_ids) >= self.max_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_len {self.max_len} "
                              f"(raise engine.max_model_len)")
        if len(sampling.stop_token_ids) > self.max_stop_ids:
            raise EngineError(f"{len(sampling.stop_token_ids)} stop tokens; the fast engine takes at most "
                              f"{self.max_stop_ids}")
        if self.exact and (sampling.top_k > 0 or sampling.top_p < 1.0):
            raise EngineError("engine.exact samples from the full distribution: set top_p=1 and top_k=0")
        key = seed_key(self._seed_for(sampling))
        limit = min(sampling.max_tokens, self.max_len - len(prompt_ids))
        return await self._submit(lambda loop, future: _Request(list(prompt_ids), sampling, limit, key, loop, future))

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place, between decode steps, on the worker's stream (graphs stay valid)."""
        params = self.model.state_dict(keep_vars=True)
        with self._weights_lock.exclusive(), torch.no_grad():
            stream = nullcontext() if self._stream is None else torch.cuda.stream(self._stream)
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with stream:
                for name, tensor in named_tensors:
                    if name not in params:
                        raise EngineError(f"update_weights: the engine model has no parameter '{name}'")
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            if self._stream is not None:
                self._stream.synchronize()   # the sources may be freed once we return
            self._cache_generation += 1      # the worker drops the cached KV before its next admission
            self.version = version           # with partial_rollout, the worker interrupts older requests first

    async def reset_prefix_cache(self) -> None:
        with self._weights_lock.exclusive():
            self._cache_generation += 1

    # -- worker --------------------------------------------------------------------------------------
    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        if self.exact:
            torch.set_num_threads(self._threads)
        with nullcontext() if self._stream is None else torch.cuda.stream(self._stream):
            while not self._closed:
                fresh: list[_Request] = []
                try:
                    idle = not self._occupied and not self._snapshots and not self._fetches
                    fresh = self._take(self._fits, block=idle)
                    if self._closed:
                        self.slots.cancel()
                        for req in fresh:
                            self._resolve(req, exc=EngineError("engine closed"))
                        break
                    start = time.perf_counter()
                    with self._weights_lock.step():
                        stale = self._cache_generation != self._cache_seen
                        if stale:   # planned against KV of the old weights: prefill in full, forget the cache
                            self._cache_seen = self._cache_generation
                            self.slots.drop_cached()
                        if self.partial_rollout and any(x.req.version != self.version for x in self._occupied.values()):
                            self._interrupt()
                        if fresh:
                            admitted = time.perf_counter()
                            self._admit(fresh, reuse=not stale)
                            self.stats["admissions"] += 1
                            self.stats["admit_s"] += time.perf_counter() - admitted
                        if self._occupied:
                            self._decode()
                        if fresh or self._occupied:
                            self._snapshot()
                        self._collect(wait=not self._occupied)
                    self.stats["busy_s"] += time.perf_counter() - start
                except Exception as exc:  # noqa: BLE001 - fail the requests, keep the engine alive
                    log.exception("fast engine step failed")
                    self._fail_all(EngineError(f"fast engine step failed: {type(exc).__name__}: {exc}"), fresh)
        self._fail_all(EngineError("engine closed"), list(self._pending))

    def _fits(self, taken: list[_Request], req: _Request) -> bool | None:
        """Another request joins this prefill while a slot is free and the prefill stays in budget: its padded
        new tokens (what the slots do not hold yet) within `prefill_tokens`, the context its attention reads
        within `PREFILL_CONTEXT_FACTOR` times that. None: it waits for the next admission (it shares its
        prompt with one taken now, see slots.py)."""
        if not self.slots.available():
            return False
        found = self.slots.match(req.prompt)
        stale = self._cache_generation != self._cache_seen   # new weights: the admission prefills everything
        new = len(req.prompt) - (0 if stale else found.length)
        width = max([len(r.prompt) - (0 if stale else r.plan.start) for r in taken] + [new])
        context = max([len(r.prompt) for r in taken] + [len(req.prompt)])
        rows = len(taken) + 1
        if taken and (width * rows > self.prefill_tokens
                      or context * rows > PREFILL_CONTEXT_FACTOR * self.prefill_tokens):
            return False
        req.plan = self.slots.plan(req.prompt, may_wait=not req.waited, found=found)
        if req.plan is None:
            req.waited = True
            return None
        return True

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _admit(self, reqs: list[_Request], reuse: bool = True) -> None:
        """Prefill new requests into their planned slots (only what the slot does not hold yet) and sample
        their first tokens. `reuse` False: the plans' cached prefixes are stale, prefill everything."""
        plans = self.slots.commit(reuse)
        slots = [plan.slot for plan in plans]
        for slot, req in zip(slots, reqs):
            req.version = self.version
            self._occupied[slot] = _Slot(req, self._seq)
        self._seq += 1
        copies = [(plan.source, plan.slot, plan.start) for plan in plans if plan.source is not None]
        if copies:
            self.decoder.copy_prefix(self._to_device([c[0] for c in copies], torch.int64),
                                     self._to_device([c[1] for c in copies], torch.int64), max(c[2] for c in copies))
        rows = [Row(r.prompt[plan.start:], plan.start, len(r.prompt), plan.slot, r.sampling.temperature,
                    r.sampling.top_p, r.sampling.top_k, r.key, r.max_tokens, list(r.sampling.stop_token_ids))
                for r, plan in zip(reqs, plans)]
        how = self.admit(rows, any(r.truncates for r in reqs), any(r.greedy for r in reqs))
        self.stats["admit_" + how] += 1
        self.stats["prefill_tokens"] += sum(len(row.new) for row in rows)
        self.stats["requests"] += len(reqs)
        self.stats.update(self.slots.stats)

    # -- the decode step ------------------------------------------------------------------------------
    def _decode(self) -> None:
        top = max(self._occupied) + 1
        bound = max(min(len(slot.req.prompt) + slot.steps, len(slot.req.prompt) + slot.req.max_tokens - 1)
                    for slot in self._occupied.values())
        n_kv = min(self.max_len, -(-(bound + 1) // KV_BUCKET) * KV_BUCKET)
        batch = batch_bucket(top, self.max_batch_size) if self.step.use_graphs else top
        truncate = any(slot.req.truncates for slot in self._occupied.values())
        greedy = any(slot.req.greedy for slot in self._occupied.values())
        for slot in self._occupied.values():
            slot.steps += 1
        self.stats["decode_steps"] += 1
        how = self.step(batch, n_kv, truncate, greedy)
        if how == "replayed":
            self.stats["graph_replays"] += 1
        elif how == "captured":
            self.stats["graphs"] += 1

    # -- host side: status snapshots, outputs ---------------------------------------------------------
    def _record(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _snapshot(self) -> None:
        s = self.state
        copy = s.status.clone() if self._stream is None else s.status.to("cpu", non_blocking=True)
        self._snapshots.append(_Pending(self._seq, copy, self._record()))
        self._seq += 1

    def _collect(self, wait: bool) -> None:
        while self._snapshots and (wait or len(self._snapshots) > self.max_inflight or self._snapshots[0].ready()):
            snap = self._snapshots.popleft()
            self._wait(snap)
            self._read_status(snap)
        while self._fetches and (wait or self._fetches[0].ready()):
            fetch = self._fetches.popleft()
            self._wait(fetch)
            self._deliver(fetch)

    def _wait(self, pending: _Pending) -> None:
        start = time.perf_counter()
        pending.wait()
        self.stats["wait_s"] += time.perf_counter() - start

    def _read_status(self, snap: _Pending) -> None:
        status = snap.data.tolist()
        done: list[tuple[int, _Request, int]] = []
        aborted: list[int] = []
        for index, slot in list(self._occupied.items()):
            if slot.since >= snap.seq:
                continue                            # admitted after this snapshot was taken
            if slot.req.aborted:
                aborted.append(index)
                self.slots.finished(index, None)
                self._resolve(slot.req, Completion([], [], "abort", slot.req.version))
            elif status[index] < 0:
                done.append((index, slot.req, -1 - status[index]))   # the slot is parked or freed on delivery
            else:
                continue
            del self._occupied[index]
        if aborted:
            self.state.active.index_fill_(0, self._to_device(aborted, torch.int64), False)
        if done:
            s = self.state
            idx = self._to_device([i for i, _, _ in done], torch.int64)
            width = max(n for _, _, n in done)
            tokens = s.out_tokens.index_select(0, idx)[:, :width]
            logprobs = s.out_logprobs.index_select(0, idx)[:, :width]
            if self._stream is not None:
                tokens, logprobs = tokens.to("cpu", non_blocking=True), logprobs.to("cpu", non_blocking=True)
            self._fetches.append(_Pending(self._seq, (tokens, logprobs), self._record(),
                                          [(index, req, n) for index, req, n in done]))

    def _deliver(self, fetch: _Pending) -> None:
        tokens, logprobs = (t.tolist() for t in fetch.data)
        for row, (index, req, n) in enumerate(fetch.extra):
            out, lps = tokens[row][:n], logprobs[row][:n]
            reason = "stop" if out and out[-1] in req.sampling.stop_token_ids else "length"
            self.stats["generated_tokens"] += n
            # the slot holds the KV of the prompt and all sampled tokens but the last two: the last was never
            # fed, and the one before sits where the idle slot's decode rows keep writing (its `pos`)
            self.slots.finished(index, req.prompt + out[:max(n - 2, 0)] if self.slots.enabled else None)
            self._resolve(req, Completion(out, lps, reason, req.version))

    def _interrupt(self) -> None:
        """Return the requests running on older weights with what they sampled ("interrupted"): everything
        in flight is read first, so requests that finished meanwhile finish as usual."""
        self._collect(wait=True)
        stale = [(i, x.req) for i, x in self._occupied.items() if x.req.version != self.version]
        if not stale:
            return
        s = self.state
        idx = self._to_device([i for i, _ in stale], torch.int64)
        s.active.index_fill_(0, idx, False)
        counts = s.count.index_select(0, idx).tolist()
        tokens = s.out_tokens.index_select(0, idx).tolist()
        logprobs = s.out_logprobs.index_select(0, idx).tolist()
        for row, (index, req) in enumerate(stale):
            n = counts[row]
            del self._occupied[index]
            self.slots.finished(index, None)    # its KV is the old weights': nothing to park
            self.stats["generated_tokens"] += n
            self.stats["interrupted"] += 1
            self._resolve(req, Completion(tokens[row][:n], logprobs[row][:n], "interrupted", req.version))

    def _fail_all(self, exc: Exception, extra: list[_Request]) -> None:
        for slot in self._occupied.values():
            self._resolve(slot.req, exc=exc)
        for fetch in self._fetches:
            for _, req, _ in fetch.extra:
                self._resolve(req, exc=exc)
        for req in extra:
            self._resolve(req, exc=exc)
        self._occupied.clear()
        self._snapshots.clear()
        self._fetches.clear()
        self.slots.reset()
        try:
            self.state.active.zero_()
        except Exception:  # noqa: BLE001 - a broken device: nothing more to reset
            pass
