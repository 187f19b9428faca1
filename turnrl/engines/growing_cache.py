"""A KV cache layer for the embedded engine that appends in place instead of concatenating.

transformers' `DynamicLayer` appends a decode step's key and value with `torch.cat`, so every step copies the
whole cache of every layer into a freshly allocated tensor: at 16 rows of 310 tokens on SmolLM2-135M
(float32) that is 228 MB written a step, as much memory traffic as the weights' own read, and, where malloc
hands large blocks back to the kernel, page faults on every new block. Profiled on this repository's
2-core machine, `cat` was the largest item of a decode step.

`GrowingLayer` keeps each layer's keys and values in a buffer with room for more positions and hands out
views of its filled part; a step writes its token in place. When the room runs out the buffer grows by a
quarter of its length (at least `MIN_ROOM` positions), so the copies are amortised. Dropping finished rows
(`batch_select_indices`) indexes the buffers, trimming padding (`drop_front`) takes a view of them, and
merging newcomers (`set_rows`) writes every part once into new buffers with room. Where `keys`/`values`
are set directly instead, `update` sees that the tensor is no longer its view and copies it into a new
buffer with room, once.

`grow_in_place(cache)` switches a `DynamicCache`'s plain layers to this class: the same attributes, so
`batch_select_indices`, the prefix cache's reads and the attention functions see ordinary tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 64   # positions of headroom a (re)allocated buffer gets at least


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of buffers [B, H, capacity, D] filled up to their length."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]
        end = length + key_states.shape[-2]
        if not self._owned() or end > self._kbuf.shape[-2]:   # set from outside, or full: one copy with room
            self._kbuf = self._grow(self.keys, key_states, length, end)
            self._vbuf = self._grow(self.values, value_states, length, end)
        self._kbuf[:, :, length:end] = key_states
        self._vbuf[:, :, length:end] = value_states
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`: the buffers are indexed (room included), so the next step needs no adoption."""
        if not self._owned():
            return super().batch_select_indices(indices)
        length = self.keys.shape[-2]
        self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
        self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]

    def drop_front(self, first: int) -> None:
        """Drop the first `first` positions (padding in every row): a view of the same buffers."""
        if not self._owned():
            self.keys, self.values = self.keys[:, :, first:], self.values[:, :, first:]
            return
        length = self.keys.shape[-2]
        self._kbuf, self._vbuf = self._kbuf[:, :, first:], self._vbuf[:, :, first:]
        self.keys, self.values = self._kbuf[:, :, :length - first], self._vbuf[:, :, :length - first]

    def set_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> None:
        """Stack the (keys, values) of `parts` along the rows, each left-padded with zeros to `width`
        positions, straight into new buffers with room (one copy, where cat and padding would take three)."""
        rows = sum(k.shape[0] for k, _ in parts)
        first = parts[0][0]
        shape = (rows, first.shape[1], _capacity(width), first.shape[-1])
        self._kbuf, self._vbuf = first.new_empty(shape), first.new_empty(shape)
        row = 0
        for keys, values in parts:
            n, pad = keys.shape[0], width - keys.shape[-2]
            for buf, part in ((self._kbuf, keys), (self._vbuf, values)):
                buf[row:row + n, :, :pad] = 0
                buf[row:row + n, :, pad:width] = part
            row += n
        self.keys, self.values = self._kbuf[:, :, :width], self._vbuf[:, :, :width]
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = first.dtype, first.device, True

    def _owned(self) -> bool:
        return self.keys is not None and self.keys.numel() > 0 and self._owns(self.keys, self._kbuf) \
            and self._owns(self.values, self._vbuf)

    @staticmethod
    def _owns(view: torch.Tensor, buf: torch.Tensor | None) -> bool:
        """Whether `view` is still the filled part of `buf` (nobody replaced it since the last update)."""
        return (buf is not None and view.data_ptr() == buf.data_ptr() and view.shape[:2] == buf.shape[:2]
                and view.stride() == buf.stride())

    @staticmethod
    def _grow(filled: torch.Tensor | None, states: torch.Tensor, length: int, end: int) -> torch.Tensor:
        """A buffer with room for `end` positions and more, holding the first `length` of `filled`."""
        grown = states.new_empty(*states.shape[:2], _capacity(end), states.shape[-1])
        if length:
            grown[:, :, :length] = filled[:, :, :length]
        return grown


def _capacity(positions: int) -> int:
    """Positions a (re)allocated buffer holding `positions` gets: a quarter more, at least `MIN_ROOM` more."""
    return positions + max(MIN_ROOM, positions // 4)


def grow_in_place(cache: Any) -> Any:
    """Switch a `DynamicCache`'s plain `DynamicLayer`s to `GrowingLayer` (others are left alone); returns it."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache
