"""The device side of one decode step: per-slot state, the step's pieces, one CUDA graph per variant.

A step for slots [0, B) over cache positions [0, n_kv): embed each slot's last token, run the layers (the pure
pieces `pre` and `post` around the cache write; `post` leaves its two residual sums to the next `pre`), then
head + sampling + stop/length bookkeeping (`finish`), and store the results in the preallocated per-slot
tensors. Nothing is allocated outside the step and nothing is read back to the host, so the whole step is
captured as a CUDA graph: for each variant (B, n_kv, truncation, greedy rows) the first step runs for real
(compiling on first use), then is captured and replayed from then on. Graphs share one memory pool: they never
run concurrently and keep no outputs in it. With `compile`, `pre` and `post` go through torch.compile with
dynamic shapes (one compilation serves every bucket), each falling back to its plain function if compiling
fails; `finish` stays eager (on the H200's torch 2.11, inductor failed on it in every try: a scheduler error
in split reductions over a 152k vocabulary, a Triton compile error in the fused hash kernel) but for its
stop/length bookkeeping, compiled on its own. Its sampling, where no request truncates, is two hand-written
Triton kernels on CUDA (sample_kernel.py), falling back to the torch sampler if they fail. Where the cache-write
and decode attention kernels run (CUDA, bf16/fp16), the rotary embedding happens inside them (`fused_rope`):
`pre` returns q and k unrotated, the write rotates the key and attention the query.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from turnrl.engines.fast import attention_kernel, sample_kernel
from turnrl.engines.fast.cache_kernel import write_kv
from turnrl.engines.fast.decoder import (SlotDecoder, decode_attention, exact_decode_attention, head, model_logits,
                                         post_attention_parts, pre_attention, project_qkv, rope)
from turnrl.engines.fast.sample_kernel import fused_sample
from turnrl.engines.fast.sampling import sample, sample_exact, uniform
from turnrl.exact import model as exact_model
from turnrl.exact import ops as exact_ops

log = logging.getLogger(__name__)

KV_BUCKET = 128          # attention reads the cache in multiples of this many positions


class SlotState:
    """Per-slot decode state on the device; index = slot."""

    def __init__(self, slots: int, max_len: int, max_stop: int, device: torch.device):
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        self.last = zeros(slots)                               # [S] token fed next
        self.pos = zeros(slots)                                # [S] its position
        self.count = zeros(slots)                              # [S] tokens generated
        self.active = zeros(slots, dtype=torch.bool)           # [S] still generating
        self.status = zeros(slots)                             # [S] count if active else -1 - count
        self.max_tokens = zeros(slots)                         # [S]
        self.temperature = zeros(slots, dtype=torch.float32)   # [S]
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)  # [S]
        self.top_k = zeros(slots)                              # [S]
        self.key = zeros(slots)                                # [S] seed key
        self.stop = torch.full((slots, max_stop), -1, dtype=torch.int64, device=device)  # [S, K]
        self.out_tokens = zeros(slots, max_len)                # [S, L]
        self.out_logprobs = zeros(slots, max_len, dtype=torch.float32)  # [S, L]
        self.rows = torch.arange(slots, device=device)         # [S]


def bookkeeping(tokens: torch.Tensor, count: torch.Tensor, active: torch.Tensor, stop: torch.Tensor,
                max_tokens: torch.Tensor, last: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step's stop/length bookkeeping (integers only): count, still running, last token, position, status.
    Eager it is a dozen small kernels a step; compiled, one or two."""
    count_after = count + active.long()
    done = active & ((tokens[:, None] == stop).any(dim=1) | (count_after >= max_tokens))
    still = active & ~done
    return (count_after, still, torch.where(active, tokens, last), pos + still.long(),
            torch.where(still, count_after, -1 - count_after))


def finish_step(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, lm_bias: torch.Tensor | None,
                eps: float, temperature: torch.Tensor, key: torch.Tensor, count: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, active: torch.Tensor, stop: torch.Tensor, max_tokens: torch.Tensor,
                last: torch.Tensor, pos: torch.Tensor, truncate: bool, greedy: bool, exact: bool = False,
                fused: bool = False, bookkeep: Callable[..., tuple[torch.Tensor, ...]] = bookkeeping,
                ) -> tuple[torch.Tensor, ...]:
    """Head, sampling and the stop/length bookkeeping of one decode step (pure; the caller stores it). `fused`:
    sampling without truncation through the Triton kernels (sample_kernel.py) on the model-dtype logits;
    `bookkeep`: `bookkeeping` or a compiled copy of it."""
    if exact:
        tokens, logprobs = sample_exact(exact_ops.head_logits(x, norm, lm_head, lm_bias, eps), temperature, key, count)
    elif fused and not truncate:
        tokens, logprobs = fused_sample(model_logits(x, norm, lm_head, lm_bias, eps), temperature, uniform(key, count))
    else:
        tokens, logprobs = sample(head(x, norm, lm_head, lm_bias, eps), temperature, key, count, top_k, top_p,
                                  truncate, greedy)
    return (tokens, logprobs, *bookkeep(tokens, count, active, stop, max_tokens, last, pos))


class DecodeStep:
    """One decode step over the slot cache, eager or replayed from CUDA graphs."""

    def __init__(self, decoder: SlotDecoder, state: SlotState, compile: bool, graphs: bool,
                 stream: torch.cuda.Stream | None, notes: list[str], fused_sampling: bool | None = None,
                 fused_rope: bool | None = None):
        self.decoder, self.state, self.notes, self.stream = decoder, state, notes, stream
        # None: the Triton sampling kernels wherever they can run (not in exact mode: its sampler is the trainer's)
        kernels = sample_kernel.available(decoder.embed.device)
        can_fuse = kernels and not decoder.exact
        if fused_sampling and not can_fuse:
            raise ValueError("fused sampling needs a CUDA device, Triton and engine.exact off")
        self.fused = can_fuse if fused_sampling is None else fused_sampling
        decoder.fused_write = kernels and self._write_kernel_works()
        # bf16/fp16 only: float32 keeps the torch path (a Triton dot would round float32 inputs to tf32)
        self.attention_kernel = (kernels and not decoder.exact and decoder.embed.dtype != torch.float32
                                 and self._attention_kernel_works())
        # the rotary embedding inside those two kernels (None: wherever both run), so no rotary kernel a layer
        can_rope = (decoder.fused_write and self.attention_kernel and self._write_kernel_works(rope=True)
                    and self._attention_kernel_works(rope=True)) if fused_rope is not False else False
        if fused_rope and not can_rope:
            raise ValueError("fused rotary needs the cache-write and decode attention kernels (CUDA, Triton, "
                             "bf16/fp16, engine.exact off)")
        self.fused_rope = can_rope
        self.max_len = decoder.max_len
        self.use_graphs = graphs
        self.graphs: dict[tuple[int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.units = self._make_units(compile)

    def _tables(self, rope: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The kernels' cos/sin arguments: the decoder's rotary tables, or None for no rotary."""
        return (self.decoder.cos, self.decoder.sin) if rope else (None, None)

    def _rotated(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, heads, D] rotated at positions pos [B] in float32, rounded once (what the kernels compute)."""
        d = self.decoder
        return rope(x.float(), d.cos[pos][:, None].float(), d.sin[pos][:, None].float()).to(x.dtype)

    def _write_kernel_works(self, rope: bool = False) -> bool:
        """The cache write's Triton kernel, built and checked once on scratch tensors against `index_put_`
        (a failure leaves the cache writes on `index_put_`, or the rotary in its own kernel, with a note)."""
        d = self.decoder
        try:
            device, dtype = d.embed.device, d.embed.dtype
            kv, dim = d.shape.kv_heads, d.shape.head_dim
            length = min(8, d.max_len)              # positions inside the rotary tables too
            keys = torch.zeros(3, kv, length, dim, device=device, dtype=dtype)
            values, expected = torch.zeros_like(keys), torch.zeros_like(keys)
            fresh = torch.randn(2, kv, 2 * dim, device=device).to(dtype)    # strided views, as the qkv slices are
            rows, pos = torch.tensor([2, 0], device=device), torch.tensor([length - 1, 1], device=device)
            write_kv(fresh[..., :dim], fresh[..., dim:], keys, values, rows, pos,
                     *self._tables(rope))
            want = self._rotated(fresh[..., :dim], pos) if rope else fresh[..., :dim]
            expected[rows[:, None], torch.arange(kv, device=device)[None], pos[:, None]] = want
            # rotated: float32 arithmetic in another order may round one bf16 ulp apart
            if torch.allclose(keys.float(), expected.float(), rtol=2 ** -7 if rope else 0, atol=0):
                return True
            problem = "it wrote other values than index_put_"
        except Exception as exc:  # noqa: BLE001
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        self._kernel_off("the cache-write kernel" + (" with rotary" if rope else ""), problem)
        return False

    def _attention_kernel_works(self, rope: bool = False) -> bool:
        """The split-key decode attention kernels, built and checked once on scratch tensors against the torch
        path (a failure leaves attention in torch, or the rotary in its own kernel, with a note)."""
        d = self.decoder
        try:
            device, dtype = d.embed.device, d.embed.dtype
            heads, kv, dim = d.shape.heads, d.shape.kv_heads, d.shape.head_dim
            g = torch.Generator(device=device).manual_seed(0)
            length = min(384, d.max_len)            # positions inside the rotary tables too
            keys = torch.randn(3, kv, length, dim, device=device, generator=g).to(dtype)
            values = torch.randn(3, kv, length, dim, device=device, generator=g).to(dtype)
            q = torch.randn(3, heads, dim, device=device, generator=g).to(dtype)
            pos = torch.tensor([0, length // 2, length - 1], device=device)
            got = attention_kernel.decode_attention(q, keys, values, pos, length, d.shape.scaling,
                                                    *self._tables(rope))
            want = decode_attention(self._rotated(q, pos) if rope else q, keys, values, pos, length,
                                    d.shape.scaling)
            error = (got.float() - want.float()).abs().max().item()
            if error < 0.05:
                return True
            problem = f"its output differs from the torch path's by up to {error:.3g}"
        except Exception as exc:  # noqa: BLE001
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        self._kernel_off("the decode attention kernel" + (" with rotary" if rope else ""), problem)
        return False

    def _kernel_off(self, what: str, problem: str) -> None:
        self.notes.append(f"{what} is off, torch runs that part: {problem}")
        log.warning(self.notes[-1])

    def __call__(self, batch: int, n_kv: int, truncate: bool, greedy: bool) -> str:
        """Run one step; says how: 'eager', 'replayed' or 'captured' (ran, and captured for next time)."""
        variant = (batch, n_kv, truncate, greedy)
        if not self.use_graphs:
            self.run(*variant)
            return "eager"
        graph = self.graphs.get(variant)
        if graph is not None:
            graph.replay()
            return "replayed"
        self.run(*variant)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                self.run(*variant)
        except Exception as exc:  # noqa: BLE001 - eager steps still work
            self.use_graphs = False
            self.notes.append(f"CUDA graph capture failed, decoding eagerly: {type(exc).__name__}: {exc}")
            log.warning(self.notes[-1])
            return "eager"
        self.graphs[variant] = graph
        return "captured"

    def _make_units(self, compiled: bool) -> dict[str, Callable]:
        shape, d = self.decoder.shape, self.decoder

        exact = d.exact

        fused_rope = self.fused_rope    # q and k leave unrotated: the cache write and attention kernels rotate

        def pre(x, w, cos, sin, pending):
            for part in pending:        # the last layer's residual sums (`post`), fused into this norm's kernel
                x = x + part
            if fused_rope:
                return (*project_qkv(x, w, shape), x)
            return (*(exact_model.pre_attention if exact else pre_attention)(x, w, cos, sin, shape), x)

        def attend(q, keys, values, pos, n_kv):
            if exact:
                return exact_decode_attention(q, keys, values, pos, n_kv, shape)
            return decode_attention(q, keys, values, pos, n_kv, shape.scaling)

        def post(x, attn, w):
            if exact:
                return exact_model.post_attention(x, attn, w, shape), ()
            return x, post_attention_parts(x, attn, w, shape)

        # the bookkeeping compiled on its own (inductor failed on the whole `finish`, see the module docstring)
        bookkeep = Compiled("bookkeeping", bookkeeping, self.notes) if compiled and not exact else bookkeeping

        def finish(x, temperature, key, count, top_k, top_p, active, stop, max_tokens, last, pos, truncate, greedy):
            args = (x, d.norm, d.lm_head, d.lm_head_bias, shape.eps, temperature, key, count, top_k, top_p, active,
                    stop, max_tokens, last, pos, truncate, greedy, exact)
            if self.fused and not truncate:
                try:
                    return finish_step(*args, fused=True, bookkeep=bookkeep)
                except Exception as exc:  # noqa: BLE001 - a Triton build or launch failure: the torch sampler
                    self.fused = False
                    self.notes.append(f"the fused sampling kernels failed, sampling runs in torch: "
                                      f"{type(exc).__name__}: {str(exc)[:300]}")
                    log.warning(self.notes[-1])
            return finish_step(*args, bookkeep=bookkeep)
        rotary = self._tables(fused_rope)

        def kernel_attend(q, keys, values, pos, n_kv):   # split-key Triton kernels over the live positions
            return attention_kernel.decode_attention(q, keys, values, pos, n_kv, shape.scaling, *rotary)
        if not compiled or exact:   # exact: eager kernels, the trainer's (a compiler may fuse and round otherwise)
            return {"pre": pre, "attend": kernel_attend if self.attention_kernel else attend, "post": post,
                    "finish": finish}
        for table in d.keys + d.values + [d.cos, d.sin]:
            torch._dynamo.mark_static(table)      # fixed shapes: only batch and n_kv vary between steps
        # `finish` stays eager: inductor failed on it (see the module docstring)
        return {"pre": Compiled("pre", pre, self.notes),
                "attend": kernel_attend if self.attention_kernel else Compiled("attend", attend, self.notes),
                "post": Compiled("post", post, self.notes), "finish": finish}

    def run(self, batch: int, n_kv: int, truncate: bool, greedy: bool) -> None:
        """One decode step for slots [0, batch): every tensor it touches is preallocated (graph-capturable)."""
        s = self.state
        rows, pos, count = s.rows[:batch], s.pos[:batch], s.count[:batch]
        tokens, logprobs, count_after, still, last, pos_after, status = self.units["finish"](
            self.forward(batch, n_kv), s.temperature[:batch], s.key[:batch], count, s.top_k[:batch],
            s.top_p[:batch], s.active[:batch], s.stop[:batch], s.max_tokens[:batch], s.last[:batch], pos, truncate,
            greedy)
        at = count.clamp(max=self.max_len - 1)
        s.out_tokens.index_put_((rows, at), tokens)
        s.out_logprobs.index_put_((rows, at), logprobs)
        for target, value in ((s.last, last), (s.pos, pos_after), (s.count, count_after), (s.active, still),
                              (s.status, status)):
            target[:batch].copy_(value)

    def forward(self, batch: int, n_kv: int) -> torch.Tensor:
        """The layers for slots [0, batch) (their last tokens, cache writes included) -> hidden [batch, hidden]."""
        s, d, u = self.state, self.decoder, self.units
        rows, pos = s.rows[:batch], s.pos[:batch]
        x = F.embedding(s.last[:batch], d.embed)
        cos, sin = (None, None) if self.fused_rope else (d.cos[pos][:, None], d.sin[pos][:, None])
        pending: tuple[torch.Tensor, ...] = ()    # what `post` left to add to x: (o, mlp), or () in exact mode
        for i, w in enumerate(d.layers):
            q, k, v, x = u["pre"](x, w, cos, sin, pending)
            d.write(i, k, v, rows, pos, rotate=self.fused_rope)
            x, pending = u["post"](x, u["attend"](q, d.keys[i], d.values[i], pos, n_kv), w)
        for part in pending:
            x = x + part
        return x


class Compiled:
    """A step piece under torch.compile that falls back to the plain function, for good, if compiling or running
    the compiled code fails. The pieces are pure (the cache writes and state stores happen outside), so running
    the plain function after a failure is safe; the other pieces stay compiled."""

    def __init__(self, name: str, fn: Callable, notes: list[str]):
        self.name, self.fn, self.notes = name, fn, notes
        self.compiled: Callable | None = torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001
                self.compiled = None
                self.notes.append(f"torch.compile failed on '{self.name}', it runs uncompiled: "
                                  f"{type(exc).__name__}: {str(exc)[:300]}")
                log.warning(self.notes[-1])
        return self.fn(*args)


def batch_bucket(n: int, limit: int) -> int:
    """Batch sizes with a captured graph: powers of two up to 64, then multiples of 64 (capped at `limit`)."""
    size = 1
    while size < n and size < 64:
        size *= 2
    if size < n:
        size = -(-n // 64) * 64
    return min(size, limit)
