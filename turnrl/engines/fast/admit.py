"""The device side of an admission: prefill the new rows' tokens into their slots, sample each row's first token,
and write the rows' decode state (slots x sampling parameters, stop ids, position, status).

Two ways, the same arithmetic:

- plain: the rows at their exact sizes, eager: a dozen small host-to-device copies and, on the GPU, ~35 kernel
  launches a layer. Each launch is a Python call that releases and retakes the GIL, which the event loop holds
  while it handles the turns that just finished, and each new shape made SDPA set up its cuDNN plan again
  (decoder.masked_attention). On an H100 such an admission took 70-240 ms of host time during a turn change.
- packed: the rows padded to a bucket (powers of two: rows from 1, width from 16, context from KV_BUCKET) and
  packed into one int64 and one float32 host tensor, copied to static device buffers in two copies; one function
  then does everything on the device. On CUDA with graphs on, that function is captured once per (rows, width,
  context, truncation, greedy rows) bucket and replayed, so an admission is two copies and one graph launch.
  Padded rows read token 0 and write the spare slot past the decode slots (`SlotState`/`SlotDecoder` hold one
  more than the batch), which no decode step reads; a real row's padded positions land past its end, where its
  own decode writes go before anything reads them.

Plain is the default (`engine.fast_admission_graphs`, `FastEngine(packed_admissions=)`). On H100s, in same-machine A/Bs
of the multi-turn bench, packed graphs took its offline phase from 1.22-1.30 s to 1.51-1.75 s (medians; the
padding is paid on the device, where large admissions are bound) and did not speed up its multi-turn phase.

Graphs share the decode step's memory pool: they run on the worker's one stream, never at once, and keep
nothing in it (their results go to the preallocated state and cache). Past `MAX_GRAPHS` variants the packed path
runs eagerly; a bucket over `MAX_BUCKET_FACTOR` x `prefill_tokens` padded tokens is admitted plain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from turnrl.engines.fast.decoder import SlotDecoder
from turnrl.engines.fast.sampling import sample, sample_exact
from turnrl.engines.fast.step import KV_BUCKET, SlotState

log = logging.getLogger(__name__)

MAX_GRAPHS = 64           # captured admission variants at most; later new buckets run eagerly
MAX_BUCKET_FACTOR = 4     # a packed bucket's rows x width at most this many times prefill_tokens
FIELDS = 7                # int64 columns before the stop ids and the tokens (see `Row`)


@dataclass
class Row:
    """One request's admission: the tokens its slot lacks, where they start, its sampling and limits."""
    new: list[int]            # prompt tokens from `start` on (what the slot does not hold yet)
    start: int                # the slot holds the KV of positions [0, start)
    full: int                 # the whole prompt's length (start + len(new))
    slot: int
    temperature: float
    top_p: float
    top_k: int
    key: int                  # seed key (sampling.py)
    max_tokens: int
    stop: list[int]           # stop token ids, at most max_stop


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: through pinned memory, without waiting for the copy, on a GPU."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def bucket(n: int, least: int = 1) -> int:
    """Padded sizes: powers of two from `least`. Coarse on purpose: every new bucket costs a capture (~0.1 s on an
    H100), and the rows a later turn's admission finds queued vary from one turn to the next."""
    size = least
    while size < n:
        size *= 2
    return size


class Admit:
    """Runs admissions (see the module docstring); `packed` None: packed where CUDA graphs run."""

    def __init__(self, decoder: SlotDecoder, state: SlotState, max_stop: int, prefill_tokens: int,
                 graphs: bool, pool: object, stream: torch.cuda.Stream | None, notes: list[str],
                 packed: bool | None = None):
        self.decoder, self.state, self.max_stop, self.notes = decoder, state, max_stop, notes
        self.stream, self.pool = stream, pool
        if packed and decoder.exact:
            raise ValueError("packed admissions need engine.exact off (the exact prefill has no cached prefix)")
        self.packed = (graphs if packed is None else packed) and not decoder.exact
        self.use_graphs = graphs and self.packed
        self.spare = state.rows.shape[0] - 1         # the slot padded rows write
        self.max_bucket_tokens = MAX_BUCKET_FACTOR * prefill_tokens
        self.max_rows = bucket(self.spare)
        device = decoder.embed.device
        self.ints = torch.zeros(self.max_bucket_tokens + self.max_rows * (FIELDS + max_stop), dtype=torch.int64,
                                device=device) if self.packed else None
        self.floats = torch.zeros(2 * self.max_rows, dtype=torch.float32, device=device) if self.packed else None
        self.graphs: dict[tuple[int, int, int, bool, bool], torch.cuda.CUDAGraph] = {}

    def __call__(self, rows: list[Row], truncate: bool, greedy: bool) -> str:
        """Admit `rows`; says how: 'plain', 'packed' (eager), 'replayed' or 'captured' (ran, then captured)."""
        width = max(len(r.new) for r in rows)
        total = max(r.full for r in rows)
        if not self.packed:
            self.plain(rows, width, total, truncate, greedy)
            return "plain"
        n, w = bucket(len(rows)), min(bucket(width, 16), self.decoder.max_len)
        t = min(bucket(total, KV_BUCKET), self.decoder.max_len)
        if n * w > self.max_bucket_tokens or n > self.max_rows:
            self.plain(rows, width, total, truncate, greedy)
            return "plain"
        self._stage(rows, n, w)
        variant = (n, w, t, truncate, greedy)
        graph = self.graphs.get(variant) if self.use_graphs else None
        if graph is not None:
            graph.replay()
            return "replayed"
        capture = self.use_graphs and len(self.graphs) < MAX_GRAPHS
        self.run(*variant, captured=capture)     # the capture's warm-up: its attention sets up what it replays
        if not capture:
            return "packed"
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                self.run(*variant, captured=True)
        except Exception as exc:  # noqa: BLE001 - the eager packed path still works
            self.use_graphs = False
            self.notes.append(f"CUDA graph capture of an admission failed, admitting eagerly: "
                              f"{type(exc).__name__}: {str(exc)[:300]}")
            log.warning(self.notes[-1])
            return "packed"
        self.graphs[variant] = graph
        return "captured"

    # -- packed --------------------------------------------------------------------------------------------
    def _stage(self, rows: list[Row], n: int, w: int) -> None:
        """Pack the rows, padded to n x w, and copy them into the static buffers' first n x (fields + w) ints."""
        pad = [0, 0, 1, self.spare, 0, 0, 1] + [-1] * self.max_stop + [0] * w
        ints = [[len(r.new), r.start, r.full, r.slot, r.top_k, r.key, r.max_tokens]
                + r.stop + [-1] * (self.max_stop - len(r.stop)) + r.new + [0] * (w - len(r.new)) for r in rows]
        ints += [pad] * (n - len(rows))
        floats = [x for r in rows for x in (r.temperature, r.top_p)] + [1.0, 1.0] * (n - len(rows))
        self._copy(self.ints, torch.tensor(ints, dtype=torch.int64).view(-1))
        self._copy(self.floats, torch.tensor(floats, dtype=torch.float32))

    def _copy(self, target: torch.Tensor, host: torch.Tensor) -> None:
        if target.device.type != "cpu":
            host = host.pin_memory()
        target[:host.numel()].copy_(host, non_blocking=True)

    def run(self, n: int, w: int, t: int, truncate: bool, greedy: bool, captured: bool = False) -> None:
        """The packed admission of n x w staged rows over t context positions: every tensor it reads is a view of
        the static buffers, everything it writes preallocated (graph-capturable). `captured`: for a CUDA graph
        (its attention kernel, decoder.masked_attention)."""
        k = self.max_stop
        ints = self.ints[:n * (FIELDS + k + w)].view(n, FIELDS + k + w)
        floats = self.floats[:2 * n].view(n, 2)
        lengths, starts, full, slots, top_k, key, max_tokens = ints[:, :FIELDS].unbind(1)
        stop, ids = ints[:, FIELDS:FIELDS + k], ints[:, FIELDS + k:]
        temperature, top_p = floats[:, 0], floats[:, 1]
        logits = self.decoder.prefill_after(ids, lengths, slots, starts, t, captured)
        self._finish(logits, slots, full, temperature, top_p, top_k, key, max_tokens, stop, truncate, greedy)

    # -- plain ---------------------------------------------------------------------------------------------
    def plain(self, rows: list[Row], width: int, total: int, truncate: bool, greedy: bool) -> None:
        device = self.state.rows.device

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)
        ids = tensor([r.new + [0] * (width - len(r.new)) for r in rows], torch.int64)
        lengths = tensor([len(r.new) for r in rows], torch.int64)
        starts = tensor([r.start for r in rows], torch.int64) if any(r.start for r in rows) else None
        slots = tensor([r.slot for r in rows], torch.int64)
        logits = self.decoder.prefill(ids, lengths, slots, starts, total)
        stop = tensor([r.stop + [-1] * (self.max_stop - len(r.stop)) for r in rows], torch.int64)
        self._finish(logits, slots, tensor([r.full for r in rows], torch.int64),
                     tensor([r.temperature for r in rows], torch.float32),
                     tensor([r.top_p for r in rows], torch.float32), tensor([r.top_k for r in rows], torch.int64),
                     tensor([r.key for r in rows], torch.int64), tensor([r.max_tokens for r in rows], torch.int64),
                     stop, truncate, greedy)

    def _finish(self, logits: torch.Tensor, slots: torch.Tensor, full: torch.Tensor, temperature: torch.Tensor,
                top_p: torch.Tensor, top_k: torch.Tensor, key: torch.Tensor, max_tokens: torch.Tensor,
                stop: torch.Tensor, truncate: bool, greedy: bool) -> None:
        """Sample the first tokens from the prefill's logits [n, V] and write the rows' state (all [n], stop
        [n, max_stop])."""
        s = self.state
        if self.decoder.exact:
            tokens, logprobs = sample_exact(logits, temperature, key, torch.zeros_like(key))
        else:
            tokens, logprobs = sample(logits, temperature, key, torch.zeros_like(key), top_k, top_p, truncate, greedy)
        for target, values in ((s.temperature, temperature), (s.top_p, top_p), (s.top_k, top_k), (s.key, key),
                               (s.max_tokens, max_tokens), (s.stop, stop), (s.pos, full)):
            target.index_copy_(0, slots, values)
        first = torch.zeros_like(slots)
        s.out_tokens.index_put_((slots, first), tokens)
        s.out_logprobs.index_put_((slots, first), logprobs)
        still = ~((tokens[:, None] == stop).any(dim=1) | (max_tokens <= 1))
        s.count.index_fill_(0, slots, 1)
        s.active.index_copy_(0, slots, still)
        s.last.index_copy_(0, slots, tokens)
        s.status.index_copy_(0, slots, torch.where(still, 1, -2))
