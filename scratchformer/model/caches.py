"""A decoder's state while it decodes, one token a step: its keys and values cached.

A `DecoderState` holds per decoder layer a self-attention `KVCache` (or the fixed-size
`StaticKVCache` a CUDA graph of the step needs), views of one buffer for all layers (a beam
search's reorder moves them together), and the cross-attention keys and values of the encoder
output, projected once a source (`Transformer.init_state`). `MultiHeadAttention` reads and
appends to them (`layers.py`).

Shapes: B rows, L positions, H heads, D head dim.
"""

from __future__ import annotations

import torch


def _heads_first(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, 2, H, D) keys and values side by side -> k, v as (B, H, L, D) views."""
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


class KVCache:
    """Keys and values of one attention layer side by side, a (B, Lmax, 2, H, D) buffer filled up
    to `length` (k at [:, :, 0], v at [:, :, 1]: one copy appends both, as they come out of their
    fused projection). Decoder self-attention appends one step at a time; cross-attention is
    filled once from the encoder output. Attention gets (B, H, L, D) views, no copies."""

    def __init__(self, kv: torch.Tensor, length: int = 0):
        self.kv, self.length = kv, length

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, :, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, 1]

    def append(self, kv: torch.Tensor):
        """kv (B, L, 2, H, D) -> all cached keys and values as (B, H, length, D) views."""
        L = kv.shape[1]
        if self.length + L > self.kv.shape[1]:
            raise ValueError(f"KV cache full: {self.length} + {L} > capacity {self.kv.shape[1]}")
        self.kv[:, self.length : self.length + L] = kv
        self.length += L
        return self.view()

    def view(self):
        return _heads_first(self.kv[:, : self.length])

    def key_lengths(self, batch: int) -> torch.Tensor | None:
        """The keys a new query may see, when the views hold more than that (StaticKVCache);
        None: every key of the views (a causal mask covers the rest)."""
        return None

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows: index (B',) into the batch dimension."""
        self.kv = self.kv.index_select(0, index)


class StaticKVCache(KVCache):
    """A self-attention cache whose shapes and addresses never change, so a CUDA graph can replay
    the decoding step that fills it (`decoding.py`, cuda_graph=True): the step index `pos` is a
    (1,) int64 tensor on the device, shared by the decoder's layers and advanced by the decoder;
    each step writes its key and value at `pos` and attention gets the whole (B, H, Lmax, D)
    buffers, masked by key_lengths pos + 1 (gpt-fast's static cache)."""

    def __init__(self, kv: torch.Tensor, pos: torch.Tensor):
        super().__init__(kv)
        self.pos = pos

    def append(self, kv: torch.Tensor):
        if kv.shape[1] != 1:
            raise ValueError(f"StaticKVCache takes one step at a time, got {kv.shape[1]}")
        # past the capacity index_copy_ raises (CPU) or asserts (CUDA); stored in the cache's dtype,
        # as the growing cache's slice assignment does
        self.kv.index_copy_(1, self.pos, kv.to(self.kv.dtype))
        return _heads_first(self.kv)

    def view(self):
        raise TypeError("StaticKVCache has no host-side length: attention gets the whole buffers (append)")

    def key_lengths(self, batch: int) -> torch.Tensor:
        return (self.pos + 1).repeat(batch)

    def reorder(self, index: torch.Tensor) -> None:
        """In place: a captured step keeps reading this buffer (`DecoderState.reorder` moves every
        layer's at once)."""
        self.kv.copy_(self.kv.index_select(0, index))


class DecoderState:
    """Incremental-decoding state: per decoder layer a self-attention KV cache that grows by one
    step at a time, each a view of `self_kv` (layers, B, Lmax, 2, H, D), and a cross-attention KV
    cache filled once from the encoder output; with the copy layer, what it reads of the source
    (`CopySource`: its ids, attention keys and id tables). `pos`, the next step's position: a host
    int, or a (1,) int64 tensor on the device, what makes the self-attention caches static
    (`StaticKVCache`).

    The encoder side (memory, src_lengths, the cross-attention caches, the copy source) holds one
    row per source, the decoder side B = sources · `beams` rows, a source's hypotheses consecutive
    (beam search's): they read their source's keys and values together, as one row of `beams`
    queries (`MultiHeadAttention`, the copy layer), where each kept a copy of its own."""

    def __init__(self, self_kv, cross, memory, src_lengths, copy_source=None, pos: int | torch.Tensor = 0):
        static = isinstance(pos, torch.Tensor)
        self.self_kv, self.memory, self.src_lengths, self.pos = self_kv, memory, src_lengths, pos
        self.beams = self_kv.shape[1] // max(src_lengths.shape[0], 1)
        self.caches = [(StaticKVCache(self_kv[i], pos) if static else KVCache(self_kv[i]), c)  # one view each
                       for i, c in enumerate(cross)]
        self.copy_source = copy_source

    def reorder(self, index: torch.Tensor, *, same_sources: bool = False, filled: int | None = None) -> None:
        """Select batch rows. same_sources: every row keeps its source sentence (beam search
        reorders beams within one sentence), so the encoder-side caches stay as they are. The
        self-attention caches move in place, all layers in one gather and one copy, their filled
        positions only: `pos`, or for static caches (whose step the host does not track) `filled`
        (None: every position)."""
        if not same_sources and self.beams > 1:
            raise ValueError(f"this state's {self.beams} rows of a source share its encoder-side caches: a reorder "
                             "keeps each row's source (same_sources=True)")
        kv = self.self_kv[:, :, : self.pos if isinstance(self.pos, int) else filled]
        kv.copy_(kv.index_select(1, index))
        if same_sources:
            return
        for _, cross_cache in self.caches:
            cross_cache.reorder(index)
        for name in ("memory", "src_lengths", "copy_source"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, index))

    def rewind(self) -> None:
        """Back to the first step (a CUDA graph's warm-up step ran one; the first real step rewrites
        what it cached)."""
        self.pos = self.pos.zero_() if isinstance(self.pos, torch.Tensor) else 0
        for self_cache, _ in self.caches:
            self_cache.length = 0
