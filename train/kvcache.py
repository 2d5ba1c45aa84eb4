"""The target's KV cache for decoding: ``transformers``' DynamicCache with its full-attention layers kept in
preallocated buffers.

A DynamicLayer appends a step's keys and values with ``torch.cat``, copying the whole cache every step: for
a batch of 64 rows x 300 positions of the default target in bf16 that copy was 31% of a decode step on the
2-core CPU (``torch.profiler``; attention 29%, the GEMMs 27%). :class:`BufferLayer` writes the step into
a buffer in place and hands attention a view of its filled part; the buffer doubles when full, so the
capacity is a hint, never a limit. Other layer kinds (sliding windows, linear attention) stay as the config
builds them. :func:`join` merges two caches of left-padded rows into one (continuous batching: new prompts
join a running batch).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class BufferLayer(DynamicLayer):
    """A DynamicLayer whose ``keys``/``values`` [B, heads, length, dim] are views of buffers of ``capacity``
    positions; ``update``, ``crop`` and the batch operations (rows leaving, beams) behave as DynamicLayer's."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = max(capacity, 1)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[3]))
        self._v = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[3]))
        self.length = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self._k.shape[2]:
            self._k, self._v = (self._copied(b, max(end, 2 * b.shape[2])) for b in (self._k, self._v))
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def _copied(self, buffer: torch.Tensor, capacity: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """A new buffer of ``capacity`` positions holding the filled part of ``buffer`` (its ``rows`` only)."""
        filled = buffer[:, :, :self.length] if rows is None else buffer[rows, :, :self.length]
        out = buffer.new_empty((filled.shape[0], buffer.shape[1], capacity, buffer.shape[3]))
        out[:, :, :self.length] = filled
        return out

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of positions to drop")
        if self.is_initialized:
            self.length = max(self.length + tokens_to_remove, 0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = (self._copied(b, b.shape[2], indices) for b in (self._k, self._v))
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self._k.shape[0], device=self.device).repeat_interleave(repeats))


def kv_cache(config, capacity: int) -> DynamicCache:
    """A DynamicCache for a model of ``config`` whose full-attention layers are :class:`BufferLayer` of
    ``capacity`` positions (the prompt plus what will be generated: a hint, the buffers grow past it)."""
    cache = DynamicCache(config=config)
    cache.layers = [BufferLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def joinable(cache: DynamicCache) -> bool:
    """Whether :func:`join` can take ``cache``: every layer keeps all its positions (no sliding window)."""
    return all(type(layer) in (DynamicLayer, BufferLayer) for layer in cache.layers)


def join(a: DynamicCache, mask_a: torch.Tensor, b: DynamicCache, mask_b: torch.Tensor,
         room: int) -> tuple[DynamicCache, torch.Tensor]:
    """One cache of the rows of ``a`` then the rows of ``b``, and its attention mask.

    Both hold left-padded rows ([B, length] masks, 1 = a position the row attends). The result right-aligns
    them at one length: the leading columns no row of ``a`` attends are dropped, the shorter side is padded
    on the left with zeros (masked; zeros, not garbage, so that a NaN cannot reach attention). ``b`` becomes
    the result, its layers :class:`BufferLayer` with ``room`` free positions. One copy of each position; the
    layers of ``a`` and ``b`` are emptied as they are copied (at 8B a batch's cache is tens of GB).
    """
    start = int(mask_a.any(0).int().argmax())
    la, lb = mask_a.shape[1] - start, mask_b.shape[1]
    length, na = max(la, lb), mask_a.shape[0]
    mask = mask_b.new_zeros((na + mask_b.shape[0], length))
    mask[:na, length - la:] = mask_a[:, start:]
    mask[na:, length - lb:] = mask_b
    layers = []
    for x, y in zip(a.layers, b.layers, strict=True):
        layer = BufferLayer(length + room)
        buffers = []
        for kx, ky in ((x.keys, y.keys), (x.values, y.values)):
            buf = ky.new_empty((na + ky.shape[0], ky.shape[1], length + room, ky.shape[3]))
            buf[:na, :, :length - la].zero_()
            buf[:na, :, length - la:length] = kx[:, :, start:]
            buf[na:, :, :length - lb].zero_()
            buf[na:, :, length - lb:length] = ky
            buffers.append(buf)
        layer._k, layer._v = buffers
        layer.device, layer.length, layer.is_initialized = buffers[0].device, length, True
        layer._views()
        layers.append(layer)
        for old in (x, y):  # emptied once copied: the peak is both caches plus one layer, not a third whole cache
            old.keys = old.values = old._k = old._v = None
    b.layers = layers  # b keeps the rest of its state (the config's layer plan)
    return b, mask
