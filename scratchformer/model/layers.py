"""The Transformer's layers (Vaswani et al., "Attention Is All You Need", NeurIPS 2017) from tensor ops.

Every hot path goes through the `Ops` bundle the layer holds (`self.ops`, chosen once by
`scratchformer.ops.select` when the model is built for a device): attention, residual add +
LayerNorm, FFN, embedding. No nn.Transformer, nn.MultiheadAttention or
F.scaled_dot_product_attention here. Leaf layers take plain ints, so tests can build them alone:
`FeedForward(32, 64, ops=ops.select("eager"))`.

Residual placement. Post-LN (the paper): x = LN(x + dropout(sublayer(x))). Pre-LN:
x = x + dropout(sublayer(LN(x))); here the add of one sublayer is fused with the LayerNorm of the
next (`add_layer_norm(..., return_residual=True)` returns both LN(s) and s), so a layer hands on
the pair (x, carry): the residual stream and, Pre-LN, the not-yet-added output of the last
sublayer (`delta`).

Under autocast the stream stays in fp32 and the sublayers' matmuls run in autocast's dtype: the
add + LayerNorm writes the next sublayer's input in that dtype itself (`AddNorm`), where a matmul
would cast it (a kernel each way, forward and backward). Pre-LN its LN(s) only feeds the sublayer:
it comes in that dtype. Post-LN it is also the stream: the norm writes a copy in that dtype beside
it, which a layer hands on as its carry (the next layer's first sublayer reads it); the gradients of
the two add up inside the norm's backward.

Decoding keeps a decoder's keys and values in a `DecoderState` (`caches.py`).

Shapes: B batch, Lq/Lk query/key length, H heads, D head dim, d d_model, V vocabulary.
Padding is right padding, given as lengths (B,).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import Ops, autocast_dtype
from ..reference import attention_mask, sinusoidal_positions
from ..special_tokens import SPECIAL_TOKENS, UNK_ID
from .caches import KVCache
from .config import ModelConfig


def attention_weights(q, k, key_lengths=None, causal=False, scale=None, query_lengths=None):
    """softmax(q kᵀ · scale) with masks, (B, H, Lq, Lk): for visualisation, never the hot path.
    Padded query rows (past query_lengths) are zeros, as the attention's output there."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[0], q.shape[2], k.shape[2], key_lengths=key_lengths, query_lengths=query_lengths,
                          causal=causal, device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def per_source(x: torch.Tensor, sources: int) -> torch.Tensor:
    """x (N, L, ...), the K = N / sources consecutive rows of each source (a beam search's hypotheses) ->
    (sources, K·L, ...): a source's rows as one row. Sizes spelt out: an empty batch (N = 0) leaves a -1 open."""
    return x.view(sources, x.shape[0] // max(sources, 1) * x.shape[1], *x.shape[2:])


class MultiHeadAttention(nn.Module):
    """Multi-head attention with fused projections: QKV for self-attention, Q and KV for cross."""

    def __init__(self, d_model: int, n_heads: int, *, ops: Ops, cross: bool = False, attn_dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.head_dim, self.cross, self.attn_dropout = n_heads, d_model // n_heads, cross, attn_dropout
        self.ops = ops
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, *, memory_kv=None, key_lengths=None, query_lengths=None, causal=False,
                cache: KVCache | None = None, need_weights: bool = False):
        """x (B, Lq, d) -> (B, Lq, d) [, weights (B, H, Lq, Lk)]. Cross-attention: memory_kv the
        keys and values of the encoder output, two (B, Lk, H, D) tensors (`project_memory`), or
        those a cache holds: a row a source, which its consecutive rows of x (a beam search's K
        hypotheses) attend to as one row of K·Lq queries, key_lengths a source's."""
        B, Lq, d = x.shape
        H, D = self.n_heads, self.head_dim
        if self.cross:
            # the encoder's keys and values (B, H, Lk, D); a cache holds them once a source
            # (`init_state`), and the rows of its hypotheses attend to them as one row of queries
            k, v = (t.transpose(1, 2) for t in memory_kv) if cache is None else cache.view()
            q = per_source(self.q_proj(x), k.shape[0]).unflatten(-1, (H, D)).transpose(1, 2)  # (B/K, H, K·Lq, D)
        else:
            qkv = self.qkv_proj(x).view(B, Lq, 3, H, D)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, Lq, D) views; one backward: a stack
            if cache is not None:  # decoding: k and v appended side by side, one copy
                k, v = cache.append(qkv[:, :, 1:])
                if (seen := cache.key_lengths(B)) is not None:  # a fixed-size cache: its filled part
                    key_lengths, causal = seen, False
        out = self.ops.attention(
            q, k, v, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal,
            dropout_p=self.attn_dropout if self.training else 0.0,
        )  # (B, H, Lq, D)
        out = self.out_proj(out.transpose(1, 2).reshape(B, Lq, d))
        if need_weights:
            w = attention_weights(q, k, key_lengths, causal, query_lengths=query_lengths)
            return out, w.transpose(1, 2).reshape(B, Lq, H, w.shape[-1]).transpose(1, 2)  # (B/K, K·Lq) -> (B, Lq)
        return out


class FeedForward(nn.Module):
    """Position-wise FFN: W2 act(W1 x + b1) + b2."""

    def __init__(self, d_model: int, d_ff: int, *, ops: Ops, activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.ops, self.activation, self.dropout = ops, activation, dropout

    def forward(self, x):
        """x (..., d) -> (..., d)."""
        p = self.dropout if self.training else 0.0
        return self.ops.ffn(x, self.w1.weight, self.w1.bias, self.w2.weight, self.w2.bias,
                            activation=self.activation, dropout_p=p)


class AddNorm(nn.Module):
    """LayerNorm with the residual add (and the sublayer's dropout) fused in front of it."""

    def __init__(self, d_model: int, *, ops: Ops, eps: float = 1e-5, dropout: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.ops, self.eps, self.dropout = ops, eps, dropout

    def _ln(self, x, residual, **kw):
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps, **kw)

    def post(self, x, out):
        """Post-LN: y = LN(x + dropout(out)) -> (y, h): y the stream (x's dtype), h the next
        sublayer's input: under autocast y's copy in its dtype, else y. The sublayer's output may
        come in autocast's dtype beside the fp32 stream: the op takes both as they are."""
        low = autocast_dtype(x)
        y = self._ln(out, x, dropout_p=self.dropout if self.training else 0.0, copy_dtype=low)
        return y if low is not None else (y, y)  # with a copy_dtype the op returns (y, copy)

    def pre(self, x, delta):
        """Pre-LN: x <- x + dropout(delta) (delta None: nothing pending); returns (LN(x), x), LN(x)
        the sublayer's input: under autocast in its dtype."""
        low = autocast_dtype(x)
        if delta is None:
            return self._ln(x, None, return_residual=True, y_dtype=low)
        return self._ln(delta, x, dropout_p=self.dropout if self.training else 0.0, return_residual=True,
                        y_dtype=low)

    def norm(self, x, delta=None, *, for_matmul=False):
        """A stack's last norm: LN(x [+ dropout(delta)]) in x's dtype; for_matmul (its only reader
        a matmul) under autocast in autocast's dtype."""
        low = autocast_dtype(x) if for_matmul else None
        if delta is None:
            return self._ln(x, None, y_dtype=low)
        return self._ln(delta, x, dropout_p=self.dropout if self.training else 0.0, y_dtype=low)


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model) plus sinusoidal positions computed on the fly.

    Word dropout (`word_dropout` p > 0, training only): each ordinary token, not one of the special
    ids the tokenizer reserves, is replaced by <unk> with probability p before the lookup, so the
    model sees the word gone but keeps its position (Sennrich & Zhang 2019, "Revisiting
    Low-Resource NMT", drop whole words; Gal & Ghahramani 2016). The mask is drawn on the tokens'
    device from torch's generator: no host sync, replayable in a CUDA graph, resumed exactly.

    Token ids are not checked here: the model checks a batch once at its boundary.
    """

    def __init__(self, vocab_size: int, d_model: int, *, ops: Ops, pos_encoding: bool = True,
                 word_dropout: float = 0.0):
        super().__init__()
        # N(0, d^-1/2): after the sqrt(d) scale the embeddings have unit variance, which also suits
        # a tied output projection.
        self.weight = nn.Parameter(torch.randn(vocab_size, d_model) * d_model**-0.5)
        self.ops, self.scale, self.pos_encoding = ops, math.sqrt(d_model), pos_encoding
        self.word_dropout = word_dropout

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab_size: int, ops: Ops) -> Embedding:
        return cls(vocab_size, cfg.d_model, ops=ops, pos_encoding=cfg.pos_encoding, word_dropout=cfg.word_dropout)

    def forward(self, tokens, *, pos_offset: int | torch.Tensor = 0):
        """tokens (B, L) int -> (B, L, d); positions start at pos_offset. A (1,) int64 device
        tensor pos_offset (a CUDA-graph decoding step, L = 1): the position is read on the device."""
        if self.training and self.word_dropout > 0.0:
            dropped = torch.rand(tokens.shape, device=tokens.device) < self.word_dropout
            tokens = tokens.masked_fill(dropped & (tokens >= len(SPECIAL_TOKENS)), UNK_ID)
        if not isinstance(pos_offset, torch.Tensor):
            return self.ops.embed(tokens, self.weight, scale=self.scale, pos_offset=pos_offset,
                                  pos_encoding=self.pos_encoding)
        x = self.ops.embed(tokens, self.weight, scale=self.scale, pos_encoding=False)
        return x + sinusoidal_positions(pos_offset, x.shape[-1], x.dtype) if self.pos_encoding else x


def _add_norm(cfg: ModelConfig, ops: Ops) -> AddNorm:
    return AddNorm(cfg.d_model, ops=ops, eps=cfg.layer_norm_eps, dropout=cfg.dropout)


class _Layer(nn.Module):
    """Shared by EncoderLayer and DecoderLayer: the last attention output, then the FFN step."""

    def _sublayer_input(self, x, carry, norm: AddNorm):
        """-> (h, x): the first sublayer's input and the stream. Pre-LN: x = x + carry (the last
        layer's pending output), h = norm(x). Post-LN: h = carry (x's copy in autocast's dtype)
        or x (no copy: the first layer, or no autocast)."""
        if self.pre_norm:
            return norm.pre(x, carry)
        return (x if carry is None else carry), x

    def _then_ffn(self, x, out, out_norm: AddNorm, ffn_norm: AddNorm):
        """-> (x, carry). Post-LN: x = out_norm(x + out); x = ffn_norm(x + FFN(x)); carry x's copy
        for the next layer (`AddNorm.post`). Pre-LN: x = x + out; carry = FFN(ffn_norm(x)), added
        by the next layer's first norm."""
        if self.pre_norm:
            h, x = ffn_norm.pre(x, out)
            return x, self.ffn(h)
        x, h = out_norm.post(x, out)
        return ffn_norm.post(x, self.ffn(h))


class EncoderLayer(_Layer):
    """Self-attention and FFN, each with its residual add + LayerNorm (Post- or Pre-LN)."""

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, ops=ops, attn_dropout=cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, ops=ops, activation=cfg.activation, dropout=cfg.ffn_dropout)
        self.norm1, self.norm2 = _add_norm(cfg, ops), _add_norm(cfg, ops)

    def forward(self, x, carry, lengths, *, need_weights=False):
        """(x, carry) -> (x, carry, weights); carry as `_then_ffn` hands it on (None into the
        first layer), weights None unless asked."""
        h, x = self._sublayer_input(x, carry, self.norm1)
        out = self.self_attn(h, key_lengths=lengths, query_lengths=lengths, need_weights=need_weights)
        out, weights = out if need_weights else (out, None)
        return (*self._then_ffn(x, out, self.norm1, self.norm2), weights)


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention over the encoder output, FFN; each with add + LN."""

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, ops=ops, attn_dropout=cfg.attn_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, ops=ops, cross=True,
                                             attn_dropout=cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, ops=ops, activation=cfg.activation, dropout=cfg.ffn_dropout)
        self.norm1, self.norm2, self.norm3 = (_add_norm(cfg, ops) for _ in range(3))

    def forward(self, x, carry, memory_kv, src_lengths, tgt_lengths, *, cache=None, need_weights=False):
        """(x, carry) -> (x, carry, cross-attention weights or None), carry as the encoder layer's;
        memory_kv this layer's keys and values of the encoder output (`project_memory`; None where
        the cache holds them); cache: (self, cross) KVCaches."""
        self_cache, cross_cache = cache if cache is not None else (None, None)
        self_kw = dict(key_lengths=tgt_lengths, query_lengths=tgt_lengths, causal=True, cache=self_cache)
        cross_kw = dict(memory_kv=memory_kv, key_lengths=src_lengths, query_lengths=tgt_lengths, cache=cross_cache,
                        need_weights=need_weights)
        h, x = self._sublayer_input(x, carry, self.norm1)
        out = self.self_attn(h, **self_kw)
        if self.pre_norm:
            h, x = self.norm2.pre(x, out)
        else:
            x, h = self.norm1.post(x, out)
        out = self.cross_attn(h, **cross_kw)
        out, weights = out if need_weights else (out, None)
        return (*self._then_ffn(x, out, self.norm2, self.norm3), weights)


def project_memory(layers, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every decoder layer's cross-attention keys and values of the encoder output memory (B, Ls,
    d), in one matmul with the layers' `kv_proj` weights side by side: [(k, v), ...], each (B, Ls,
    H, D), views of its (B, Ls, layers · 2d) output.

    Where each layer projected (and, under autocast, cast) memory itself: one cast of it and one
    GEMM (layers · 2d wide) forward, and backward one GEMM whose fp32 accumulation sums every
    layer's gradient of memory, where each layer's came rounded to the autocast dtype, was cast
    back and added to the others' (a kernel each). The same sums of products, in another order:
    equal to rounding, not bit for bit."""
    projs = [layer.cross_attn.kv_proj for layer in layers]
    if not projs:
        return []
    B, Ls, _ = memory.shape
    H, D = layers[0].cross_attn.n_heads, layers[0].cross_attn.head_dim
    weight = torch.cat([p.weight for p in projs]) if len(projs) > 1 else projs[0].weight
    bias = torch.cat([p.bias for p in projs]) if len(projs) > 1 else projs[0].bias
    kv = F.linear(memory, weight, bias).view(B, Ls, 2 * len(projs), H, D).unbind(2)  # one backward: a stack
    return list(zip(kv[0::2], kv[1::2]))
