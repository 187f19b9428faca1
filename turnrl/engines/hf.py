"""The embedded engine: a transformers model decoding the requests of all trajectories together.

Requests from concurrent trajectories (every turn of every trajectory) go into one queue. A worker thread
runs a decode loop over a left-padded batch with a KV cache and admits new requests between decode steps
(continuous batching): a newcomer is prefilled on its own, its cache left-padded to the running batch's
length and concatenated in; finished rows leave the batch at once and all-padding columns are trimmed.
A prefix KV cache (turnrl/engines/prefix_cache.py) lets a later turn or a sibling sample reuse the KV of the
context it shares with an earlier request, and identical prompts in one prefill are computed once.

Sampling happens on the device, row by row parameters: temperature, top-p, top-k, and a per-request seed
(inverse-CDF sampling from a per-request generator), so a request samples the same tokens whatever else is
in the batch, up to float noise. Logprobs are log softmax(logits / temperature) of the sampled token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable

import numpy as np
import torch

from turnrl.engines.base import Capabilities, Completion, Delta, EngineError, Sampling
from turnrl.engines.cpu_attention import use_decode_attention
from turnrl.engines.cpu_decode import lean_decode
from turnrl.engines.cpu_head import use_cpu_head
from turnrl.engines.growing_cache import GrowingLayer, grow_in_place
from turnrl.engines.prefix_cache import Entry, PrefixCache
from turnrl.engines.worker import Listener, WorkerEngine, stream_through

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False
    version: int = 0               # the weights it was prefilled with (set by the worker)
    listener: Listener | None = None   # `stream`: told each sampled token


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices in hardware: a GPU, or a CPU with AVX512-BF16 or AMX. Elsewhere
    (an AVX2 CPU) torch's bf16 GEMM is a scalar fallback, measured here 60x slower than float32."""
    if device.type != "cpu":
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 where the device computes it natively (`native_bf16`), float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def sample_rows(logits: torch.Tensor, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: [B, V] float32 -> (tokens [B], logprobs [B])."""
    temps = torch.tensor([r.sampling.temperature for r in reqs], device=logits.device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 for r in reqs):
        probs = _truncate(probs, reqs)
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor([float(torch.rand(1, generator=r.generator)) for r in reqs], device=logits.device)
    # right=True: the first token whose cdf passes u, so a zero-probability token is never picked (u may be 0)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    tokens = tokens.clamp(max=logits.shape[1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _truncate(probs: torch.Tensor, reqs: list[_Request]) -> torch.Tensor:
    """Zero the tail outside each row's top-k / top-p nucleus (keeps at least one token)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    top_k = torch.tensor([r.sampling.top_k or probs.shape[1] for r in reqs], device=probs.device).unsqueeze(1)
    keep &= ranks < top_k
    top_p = torch.tensor([r.sampling.top_p for r in reqs], device=probs.device).unsqueeze(1)
    keep &= (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter(1, order, sorted_p * keep)


class HFEngine(WorkerEngine):
    """An in-process transformers engine; `generate` is safe to call from many coroutines at once."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", max_batch_size: int = 64,
                 gather_ms: float = 5.0, seed: int = 0, model: Any = None, prefix_cache_tokens: int = 32768,
                 max_len: int | None = None, partial_rollout: bool = False, cpu_gemm: bool = True):
        from transformers import AutoModelForCausalLM

        if max_len is not None and max_len < 2:
            raise ValueError(f"engine.max_model_len must be at least 2, got {max_len}")
        self.max_model_len = max_len   # prompt + completion; None: the model's own limit

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        if self.device.type == "cpu":
            use_decode_attention(self.model)  # CPU SDPA is slow for one-token decode steps
            use_cpu_head(self.model)          # and linear is slow for a decode step with 7-15 rows of logits
        # on the CPU, decode steps without transformers' module machinery where that is bit-identical (cpu_decode.py)
        self.lean, why = (lean_decode(self.model, lambda: new_cache(self.model.config), cpu_gemm)
                          if self.device.type == "cpu" else (None, ""))
        if why:
            log.info("hf engine: decode steps through the model's forward: %s", why)
        elif self.lean is not None and self.lean.linear is not torch.nn.functional.linear:
            log.info("hf engine: decode steps' weight products through the skinny CPU kernel (cpu_gemm.py)")
        self.max_batch_size = max_batch_size
        self.gather_s = gather_ms / 1000
        self.partial_rollout = partial_rollout
        self.capabilities = Capabilities(partial_rollout=True, streaming=True)
        self.stats = {"requests": 0, "generated_tokens": 0, "prefill_tokens": 0, "decode_steps": 0,
                      "busy_s": 0.0, "prefill_s": 0.0, "prefill_computed_tokens": 0, "prefix_hit_tokens": 0,
                      "interrupted": 0}
        self.prefix = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 and _plain_cache(model) else None
        self._start_worker("turnrl-hf-engine", seed)

    # -- public API ----------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        return await self._generate(prompt_ids, sampling)

    async def stream(self, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Delta | Completion]:
        async for item in stream_through(lambda listener: self._generate(prompt_ids, sampling, listener)):
            yield item

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, listener: Listener | None = None
                        ) -> Completion:
        self._check(prompt_ids, sampling)
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise EngineError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_model_len "
                                  f"{self.max_model_len} (raise engine.max_model_len)")
            sampling = sampling.with_(max_tokens=min(sampling.max_tokens, room))
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self._seed_for(sampling))
        return await self._submit(lambda loop, future: _Request(list(prompt_ids), sampling, loop, future, gen,
                                                                listener=listener))

    async def reset_prefix_cache(self) -> None:
        with self._weights_lock.exclusive():
            if self.prefix is not None:
                self.prefix.clear()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place (between decode steps; the worker holds the same lock per step)."""
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        with self._weights_lock.exclusive(), torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise EngineError(f"update_weights: the engine model has no parameter '{name}'")
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            if self.prefix is not None:
                self.prefix.clear()  # KV computed under the old weights must not be reused
            self.version = version   # with partial_rollout, the worker's next step interrupts older rows

    # -- worker --------------------------------------------------------------------------------------
    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        batch: _Batch | None = None
        while not self._closed:
            try:
                active = 0 if batch is None else len(batch.reqs)
                fresh = self._take(lambda taken, _: len(taken) < self.max_batch_size - active, block=active == 0)
                if self._closed:
                    for req in fresh:  # taken from the queue but never started: fail them, don't leave them hanging
                        self._resolve(req, exc=EngineError("engine closed"))
                    break
                start = time.perf_counter()
                with self._weights_lock.step():
                    if fresh:
                        new = self._prefill(fresh)
                        batch = new if batch is None else batch.merge(new)
                        self.stats["prefill_s"] += time.perf_counter() - start
                    if batch is not None:
                        batch = self._finish_rows(batch)
                    if batch is not None:
                        batch = self._decode_step(batch)
                        batch = self._finish_rows(batch)
                self.stats["busy_s"] += time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep the engine alive
                failed = ([] if batch is None else batch.reqs) + (fresh if "fresh" in locals() else [])
                for req in failed:
                    self._resolve(req, exc=EngineError(f"hf engine step failed: {type(exc).__name__}: {exc}"))
                batch = None
        for req in ([] if batch is None else batch.reqs) + list(self._pending):
            self._resolve(req, exc=EngineError("engine closed"))

    def _prefill(self, reqs: list[_Request]) -> "_Batch":
        """Prefill new requests: identical prompts once, each reusing the longest cached prefix it has."""
        unique: dict[tuple[int, ...], int] = {}
        which = [unique.setdefault(tuple(r.prompt), len(unique)) for r in reqs]
        prompts = [list(p) for p in unique]
        hits = [self.prefix.lookup(p) if self.prefix is not None else (None, 0) for p in prompts]
        exact = [i for i, (_, m) in enumerate(hits) if m == len(prompts[i])]
        computed = [i for i in range(len(prompts)) if i not in exact]
        parts = []
        if computed:
            parts.append(self._forward([prompts[i] for i in computed], [hits[i] for i in computed]))
        if exact:
            parts.append(_stack_entries([hits[i][0] for i in exact], self.model.config))
        batch = parts[0] if len(parts) == 1 else parts[0].merge(parts[1])
        row_of = {u: j for j, u in enumerate(computed + exact)}
        batch.take([row_of[u] for u in which])
        batch.reqs = reqs
        for req in reqs:
            req.version = self.version
        self.stats["requests"] += len(reqs)
        self.stats["prefix_hit_tokens"] += sum(hits[u][1] for u in which)
        self._append_samples(batch, batch.logits)
        batch.logits = torch.empty(0)
        return batch

    def _forward(self, prompts: list[list[int]], hits: list[tuple[Entry | None, int]]) -> "_Batch":
        """One forward over the uncached suffixes, each row laid out [pad][cached prefix][pad][suffix]."""
        reuse = [m for _, m in hits]
        wp = max(reuse)
        ws = max(len(p) - m for p, m in zip(prompts, reuse))
        ids = torch.zeros((len(prompts), ws), dtype=torch.long)
        attn = torch.zeros((len(prompts), wp + ws), dtype=torch.long)
        for i, (p, m) in enumerate(zip(prompts, reuse)):
            ids[i, ws - (len(p) - m):] = torch.tensor(p[m:])
            attn[i, wp - m:wp] = 1
            attn[i, wp + ws - (len(p) - m):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        cache = new_cache(self.model.config)
        if wp > 0:
            template = next(e for e, m in hits if m > 0)
            _fill(cache, lambda li, kind: torch.cat([_prefix_rows(e, m, li, kind, wp, template) for e, m in hits]))
        pos = (attn.cumsum(1) - 1).clamp(min=0)[:, wp:]
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self.stats["prefill_tokens"] += sum(len(p) - m for p, m in zip(prompts, reuse))
        self.stats["prefill_computed_tokens"] += ids.numel()   # with the padding to the longest suffix
        batch = _Batch([], out.past_key_values, attn)
        batch.logits = out.logits[:, -1, :].float()
        if self.prefix is not None:
            for i, p in enumerate(prompts):
                self.prefix.store(batch.entry(i, p, batch.logits[i].clone()))
        return batch

    def _decode_step(self, batch: "_Batch") -> "_Batch":
        attn = torch.cat([batch.attn, torch.ones((len(batch.reqs), 1), dtype=torch.long, device=self.device)], 1)
        pos = attn.sum(1, keepdim=True) - 1
        if self.lean is not None:
            logits = self.lean(batch.last, pos[:, 0], attn, batch.cache)
        else:
            logits = self.model(input_ids=batch.last.unsqueeze(1), attention_mask=attn, position_ids=pos,
                                past_key_values=batch.cache, use_cache=True).logits[:, -1, :]
        batch.attn = attn
        self.stats["decode_steps"] += 1
        self._append_samples(batch, logits.float())
        return batch

    def _append_samples(self, batch: "_Batch", logits: torch.Tensor) -> None:
        tokens, logps = sample_rows(logits, batch.reqs)
        batch.last = tokens
        for req, tok, lp in zip(batch.reqs, tokens.tolist(), logps.tolist()):
            req.out.append(tok)
            req.logprobs.append(lp)
            if req.listener is not None:
                req.listener([tok], [lp])
        self.stats["generated_tokens"] += len(batch.reqs)

    def _finish_rows(self, batch: "_Batch") -> "_Batch | None":
        keep = []
        for i, req in enumerate(batch.reqs):
            if req.aborted:
                self._resolve(req, Completion(req.out, req.logprobs, "abort", req.version))
            elif req.out and req.out[-1] in req.sampling.stop_token_ids:
                self._remember(batch, i, req)
                self._resolve(req, Completion(req.out, req.logprobs, "stop", req.version))
            elif len(req.out) >= req.sampling.max_tokens:
                self._remember(batch, i, req)
                self._resolve(req, Completion(req.out, req.logprobs, "length", req.version))
            elif self.partial_rollout and req.version != self.version:   # new weights: resumed by the caller
                self.stats["interrupted"] += 1
                self._resolve(req, Completion(req.out, req.logprobs, "interrupted", req.version))
            else:
                keep.append(i)
        if not keep:
            return None
        if len(keep) < len(batch.reqs):
            batch.select(keep)
        return batch

    def _remember(self, batch: "_Batch", row: int, req: _Request) -> None:
        """Keep a finished request's KV (its prompt and all sampled tokens but the last, which was never fed)."""
        if self.prefix is not None:
            self.prefix.store(batch.entry(row, req.prompt + req.out[:-1]))


class _Batch:
    """The running decode batch: requests, their KV cache [B, H, L, D] per layer, and the mask [B, L]."""

    def __init__(self, reqs: list[_Request], cache: Any, attn: torch.Tensor):
        self.reqs = reqs
        self.cache = cache
        self.attn = attn
        self.last: torch.Tensor = torch.empty(0)
        self.logits: torch.Tensor = torch.empty(0)  # [B, V] after a prefill: the next-token logits

    def take(self, rows: list[int]) -> None:
        """Reorder or repeat rows (before any decoding: requests that share one prefilled prompt)."""
        index = torch.tensor(rows, device=self.attn.device)
        self.attn = self.attn[index]
        self.logits = self.logits[index]
        self.cache.batch_select_indices(index)

    def entry(self, row: int, tokens: list[int], logits: torch.Tensor | None = None) -> Entry | None:
        """Row `row`'s KV over its unmasked columns as a prefix-cache entry for `tokens` (None if they disagree)."""
        cols = self.attn[row].nonzero().squeeze(1)
        if len(cols) != len(tokens):
            return None
        return Entry(np.asarray(tokens, dtype=np.int64), [layer.keys[row][:, cols] for layer in self.cache.layers],
                     [layer.values[row][:, cols] for layer in self.cache.layers], logits)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.attn.device)
        self.reqs = [self.reqs[i] for i in keep]
        self.attn = self.attn[index]
        self.last = self.last[index]
        self.cache.batch_select_indices(index)
        live = self.attn.any(dim=0).nonzero()
        first = int(live[0]) if len(live) else 0
        if first > 0:  # drop columns that are padding in every remaining row
            self.attn = self.attn[:, first:]
            for layer in self.cache.layers:
                if isinstance(layer, GrowingLayer):
                    layer.drop_front(first)
                else:
                    layer.keys = layer.keys[:, :, first:]
                    layer.values = layer.values[:, :, first:]

    def merge(self, other: "_Batch") -> "_Batch":
        width = max(self.attn.shape[1], other.attn.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if isinstance(mine, GrowingLayer):
                mine.set_rows([(mine.keys, mine.values), (theirs.keys, theirs.values)], width)
            else:
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], 0)
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], 0)
        self.attn = torch.cat([_left_pad(self.attn, width), _left_pad(other.attn, width)], 0)
        self.last = torch.cat([self.last, other.last])
        self.logits = torch.cat([self.logits, other.logits])
        self.reqs = self.reqs + other.reqs
        return self


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence axis (dim 2 of a [B, H, L, D] cache, dim 1 of a [B, L] mask) with zeros."""
    dim = 2 if x.dim() == 4 else 1
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim)


def new_cache(config: Any) -> Any:
    """An empty KV cache for `config` whose layers append in place (growing_cache.py)."""
    from transformers import DynamicCache
    return grow_in_place(DynamicCache(config=config))


def _plain_cache(model: Any) -> bool:
    """The prefix cache needs every layer's KV as a plain growing tensor (no sliding windows)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if model is None:
        return True
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def _fill(cache: Any, rows: Any) -> None:
    """Give every layer of an empty DynamicCache its keys and values: rows(layer_index, "keys"|"values")."""
    for li, layer in enumerate(cache.layers):
        keys, values = rows(li, "keys"), rows(li, "values")
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


def _prefix_rows(entry: Entry | None, reuse: int, layer: int, kind: str, width: int, template: Entry) -> torch.Tensor:
    """[1, H, width, D]: the first `reuse` cached positions of one layer, left-padded with zeros."""
    source = getattr(entry if entry is not None else template, kind)[layer]
    return _left_pad(source[:, :reuse].unsqueeze(0), width)


def _stack_entries(entries: list[Entry], config: Any) -> _Batch:
    """A batch of exact prefix-cache hits: their KV left-padded together, their stored next-token logits."""
    width = max(len(e) for e in entries)
    cache = new_cache(config)
    device = entries[0].keys[0].device
    attn = torch.cat([_left_pad(torch.ones((1, len(e)), dtype=torch.long, device=device), width) for e in entries])
    _fill(cache, lambda li, kind: torch.cat([_left_pad(getattr(e, kind)[li].unsqueeze(0), width) for e in entries]))
    batch = _Batch([], cache, attn)
    batch.logits = torch.stack([e.logits for e in entries])
    return batch
