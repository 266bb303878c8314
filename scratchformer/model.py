"""The Transformer of Vaswani et al., "Attention Is All You Need" (NeurIPS 2017), from tensor ops,
and an encoder-only classifier with a learned [CLS] token.

Every hot path goes through `scratchformer.ops` (attention, residual add + LayerNorm, FFN,
embedding), whose backend (eager / torch / triton) is picked by `ModelConfig.kernel` and resolved
per input device (`auto`: triton on CUDA, eager on CPU). No nn.Transformer, nn.MultiheadAttention
or F.scaled_dot_product_attention here.

Residual placement. Post-LN (the paper): x = LN(x + dropout(sublayer(x))). Pre-LN:
x = x + dropout(sublayer(LN(x))); here the add of one sublayer is fused with the LayerNorm of the
next (`ops.add_layer_norm(..., return_residual=True)` returns both LN(s) and s), so a layer hands
on the pair (x, delta): the residual stream and the not-yet-added output of the last sublayer.

Shapes: B batch, Ls/Lt source/target length, H heads, D head dim, d d_model, V vocabulary.
Padding is right padding, given as lengths (B,).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from .config import ModelConfig
from .reference import attention_mask


class KVCache:
    """Keys and values of one attention layer, (B, Lmax, H, D) buffers filled up to `length`.

    Decoder self-attention appends one step at a time; cross-attention fills it once from the
    encoder output. Views handed to attention are (B, H, L, D) without copies.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0):
        self.k, self.v, self.length = k, v, length

    @classmethod
    def empty(cls, B, max_len, H, D, *, device, dtype):
        return cls(torch.empty(B, max_len, H, D, device=device, dtype=dtype),
                   torch.empty(B, max_len, H, D, device=device, dtype=dtype))

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, L, H, D) -> all cached keys and values as (B, H, length, D) views."""
        L = k.shape[1]
        if self.length + L > self.k.shape[1]:
            raise ValueError(f"KV cache full: {self.length} + {L} > capacity {self.k.shape[1]}")
        self.k[:, self.length : self.length + L] = k
        self.v[:, self.length : self.length + L] = v
        self.length += L
        return self.view()

    def view(self):
        return self.k[:, : self.length].transpose(1, 2), self.v[:, : self.length].transpose(1, 2)

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search): index (B',) into the batch dimension."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)


def attention_weights(q, k, key_lengths=None, causal=False, scale=None):
    """softmax(q kᵀ · scale) with masks, (B, H, Lq, Lk): for visualisation, never the hot path."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[0], q.shape[2], k.shape[2], key_lengths=key_lengths, causal=causal, device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with fused projections: QKV for self-attention, Q and KV for cross."""

    def __init__(self, d_model: int, n_heads: int, *, cross: bool = False, attn_dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.head_dim, self.cross, self.attn_dropout = n_heads, d_model // n_heads, cross, attn_dropout
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def project_kv(self, memory: torch.Tensor):
        """Cross-attention keys and values of the encoder output: two (B, Ls, H, D) views."""
        B, L, _ = memory.shape
        return self.kv_proj(memory).view(B, L, 2, self.n_heads, self.head_dim).unbind(2)

    def forward(self, x, *, memory=None, key_lengths=None, query_lengths=None, causal=False,
                cache: KVCache | None = None, kernel: str, need_weights: bool = False):
        B, Lq, d = x.shape
        H, D = self.n_heads, self.head_dim
        if self.cross:
            q = self.q_proj(x).view(B, Lq, H, D).transpose(1, 2)  # (B, H, Lq, D)
            if cache is not None and cache.length > 0:  # encoder K/V computed once per sequence
                k, v = cache.view()
            else:
                k, v = self.project_kv(memory)  # (B, Ls, H, D) each
                k, v = (cache.append(k, v) if cache is not None else (k.transpose(1, 2), v.transpose(1, 2)))
        else:
            q, k, v = self.qkv_proj(x).view(B, Lq, 3, H, D).unbind(2)  # (B, Lq, H, D) views
            q = q.transpose(1, 2)
            k, v = cache.append(k, v) if cache is not None else (k.transpose(1, 2), v.transpose(1, 2))
        out = ops.attention(
            q, k, v, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal,
            dropout_p=self.attn_dropout if self.training else 0.0, kernel=kernel,
            validate=False,  # lengths were checked once at the model's entry (_check_tokens)
        )  # (B, H, Lq, D)
        out = self.out_proj(out.transpose(1, 2).reshape(B, Lq, d))
        if need_weights:
            return out, attention_weights(q, k, key_lengths, causal)
        return out


class FeedForward(nn.Module):
    """Position-wise FFN: W2 act(W1 x + b1) + b2."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.activation, self.dropout = activation, dropout

    def forward(self, x, *, kernel: str):
        return ops.ffn(
            x, self.w1.weight, self.w1.bias, self.w2.weight, self.w2.bias, activation=self.activation,
            dropout_p=self.dropout if self.training else 0.0, kernel=kernel,
        )


class AddNorm(nn.Module):
    """LayerNorm with the residual add (and the sublayer's dropout) fused in front of it."""

    def __init__(self, d_model: int, *, eps: float = 1e-5, dropout: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.eps, self.dropout = eps, dropout

    def _p(self):
        return self.dropout if self.training else 0.0

    def post(self, x, out, *, kernel):
        """Post-LN: LN(x + dropout(out))."""
        out = out.to(x.dtype)  # under autocast the sublayer output is low precision, the stream is not
        return ops.add_layer_norm(out, x, self.weight, self.bias, self.eps, dropout_p=self._p(), kernel=kernel)

    def pre(self, x, delta, *, kernel):
        """Pre-LN: x <- x + dropout(delta) (delta None: nothing pending); returns (LN(x), x)."""
        if delta is None:
            return ops.add_layer_norm(x, None, self.weight, self.bias, self.eps, return_residual=True, kernel=kernel)
        return ops.add_layer_norm(delta.to(x.dtype), x, self.weight, self.bias, self.eps, dropout_p=self._p(),
                                  return_residual=True, kernel=kernel)

    def norm(self, x, *, kernel):
        return ops.add_layer_norm(x, None, self.weight, self.bias, self.eps, kernel=kernel)


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model) plus sinusoidal positions computed on the fly."""

    def __init__(self, vocab_size: int, d_model: int, *, pos_encoding: bool = True):
        super().__init__()
        # N(0, d^-1/2): after the sqrt(d) scale the embeddings have unit variance, which also suits
        # a tied output projection.
        self.weight = nn.Parameter(torch.randn(vocab_size, d_model) * d_model**-0.5)
        self.scale, self.pos_encoding = math.sqrt(d_model), pos_encoding

    def forward(self, tokens, *, pos_offset: int = 0, kernel: str):
        # Data-dependent range checks are host syncs: skipped under torch.compile (no graph break);
        # out-of-range ids then fail in the embedding itself.
        if not _compiling() and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.weight.shape[0]):
            raise ValueError(
                f"token ids must lie in [0, {self.weight.shape[0]}), got min {int(tokens.min())} "
                f"max {int(tokens.max())}"
            )
        return ops.embed(tokens, self.weight, scale=self.scale, pos_offset=pos_offset,
                         pos_encoding=self.pos_encoding, kernel=kernel)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, attn_dropout=cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation, dropout=cfg.ffn_dropout)
        self.norm1 = AddNorm(cfg.d_model, eps=cfg.layer_norm_eps, dropout=cfg.dropout)
        self.norm2 = AddNorm(cfg.d_model, eps=cfg.layer_norm_eps, dropout=cfg.dropout)

    def forward(self, x, delta, lengths, *, kernel, need_weights=False):
        """(x, delta) -> (x, delta); delta is always None for Post-LN. Optionally attention weights."""
        attn_kw = dict(key_lengths=lengths, query_lengths=lengths, kernel=kernel, need_weights=need_weights)
        weights = None
        if self.pre_norm:
            h, x = self.norm1.pre(x, delta, kernel=kernel)
            delta = self.self_attn(h, **attn_kw)
            if need_weights:
                delta, weights = delta
            h, x = self.norm2.pre(x, delta, kernel=kernel)
            delta = self.ffn(h, kernel=kernel)
        else:
            out = self.self_attn(x, **attn_kw)
            if need_weights:
                out, weights = out
            x = self.norm1.post(x, out, kernel=kernel)
            x = self.norm2.post(x, self.ffn(x, kernel=kernel), kernel=kernel)
        return x, delta, weights


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, attn_dropout=cfg.attn_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cross=True, attn_dropout=cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation, dropout=cfg.ffn_dropout)
        self.norm1, self.norm2, self.norm3 = (AddNorm(cfg.d_model, eps=cfg.layer_norm_eps, dropout=cfg.dropout) for _ in range(3))

    def forward(self, x, delta, memory, src_lengths, tgt_lengths, *, kernel, cache=None, need_weights=False):
        self_cache, cross_cache = cache if cache is not None else (None, None)
        self_kw = dict(key_lengths=tgt_lengths, query_lengths=tgt_lengths, causal=True, cache=self_cache, kernel=kernel)
        cross_kw = dict(memory=memory, key_lengths=src_lengths, query_lengths=tgt_lengths, cache=cross_cache,
                        kernel=kernel, need_weights=need_weights)
        if self.pre_norm:
            h, x = self.norm1.pre(x, delta, kernel=kernel)
            delta = self.self_attn(h, **self_kw)
            h, x = self.norm2.pre(x, delta, kernel=kernel)
            delta = self.cross_attn(h, **cross_kw)
            delta, weights = delta if need_weights else (delta, None)
            h, x = self.norm3.pre(x, delta, kernel=kernel)
            delta = self.ffn(h, kernel=kernel)
        else:
            x = self.norm1.post(x, self.self_attn(x, **self_kw), kernel=kernel)
            out = self.cross_attn(x, **cross_kw)
            out, weights = out if need_weights else (out, None)
            x = self.norm2.post(x, out, kernel=kernel)
            x = self.norm3.post(x, self.ffn(x, kernel=kernel), kernel=kernel)
        return x, delta, weights


class _Stack(nn.Module):
    """Shared by Encoder and Decoder: the embedding dropout and closing the residual stream."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm, self.dropout = cfg.norm == "pre", cfg.dropout
        self.final_norm = AddNorm(cfg.d_model, eps=cfg.layer_norm_eps, dropout=cfg.dropout) if cfg.final_norm else None

    def _finish(self, x, delta, *, kernel):
        if self.pre_norm and delta is not None:
            if self.final_norm is not None:
                return self.final_norm.pre(x, delta, kernel=kernel)[0]
            return x + F.dropout(delta.to(x.dtype), self.dropout, self.training)
        return self.final_norm.norm(x, kernel=kernel) if self.final_norm is not None else x


class Encoder(_Stack):
    def __init__(self, cfg: ModelConfig, embedding: Embedding):
        super().__init__(cfg)
        self.embedding = embedding
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))

    def forward(self, x, lengths, *, kernel, need_weights=False):
        """x (B, L, d) already embedded; lengths (B,). -> (B, L, d) [, list of (B, H, L, L)]."""
        x = F.dropout(x, self.dropout, self.training)
        delta, weights = None, []
        for layer in self.layers:
            x, delta, w = layer(x, delta, lengths, kernel=kernel, need_weights=need_weights)
            weights.append(w)
        x = self._finish(x, delta, kernel=kernel)
        return (x, weights) if need_weights else x


class Decoder(_Stack):
    def __init__(self, cfg: ModelConfig, embedding: Embedding):
        super().__init__(cfg)
        self.embedding = embedding
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))

    def forward(self, tgt, memory, src_lengths, tgt_lengths=None, *, kernel, state=None, need_weights=False):
        pos_offset = state.pos if state is not None else 0
        x = F.dropout(self.embedding(tgt, pos_offset=pos_offset, kernel=kernel), self.dropout, self.training)
        delta, weights = None, []
        for i, layer in enumerate(self.layers):
            cache = state.caches[i] if state is not None else None
            x, delta, w = layer(x, delta, memory, src_lengths, tgt_lengths, kernel=kernel, cache=cache,
                                need_weights=need_weights)
            weights.append(w)
        if state is not None:
            state.pos += tgt.shape[1]
        x = self._finish(x, delta, kernel=kernel)
        return (x, weights) if need_weights else x


class DecoderState:
    """Incremental-decoding state: per decoder layer a self-attention KV cache that grows by one
    step at a time and a cross-attention KV cache filled once from the encoder output."""

    def __init__(self, caches, memory, src_lengths):
        self.caches, self.memory, self.src_lengths, self.pos = caches, memory, src_lengths, 0

    def reorder(self, index: torch.Tensor, *, same_sources: bool = False) -> None:
        """Select batch rows. same_sources: every row keeps its source sentence (beam search
        reorders beams within one sentence), so the encoder-side caches stay as they are."""
        for self_cache, cross_cache in self.caches:
            self_cache.reorder(index)
            if not same_sources:
                cross_cache.reorder(index)
        if not same_sources:
            self.memory = self.memory.index_select(0, index)
            self.src_lengths = self.src_lengths.index_select(0, index)


def _compiling() -> bool:
    """Under torch.compile: data-dependent checks (host syncs) would break the graph, so skip them."""
    return torch.compiler.is_compiling()


def _check_tokens(name, tokens, lengths, max_len):
    if tokens.dim() != 2:
        raise ValueError(f"{name} must be (B, L) token ids, got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32/int64 token ids, got {tokens.dtype}")
    if tokens.shape[1] > max_len:
        raise ValueError(f"{name} length {tokens.shape[1]} exceeds max_len {max_len}")
    if lengths is not None:
        if lengths.shape != (tokens.shape[0],):
            raise ValueError(f"{name}_lengths must have shape ({tokens.shape[0]},), got {tuple(lengths.shape)}")
        if not _compiling() and lengths.numel() and (int(lengths.max()) > tokens.shape[1] or int(lengths.min()) < 0):
            raise ValueError(
                f"{name}_lengths must lie in [0, {tokens.shape[1]}] (the padded length), got "
                f"{lengths.tolist() if lengths.numel() <= 8 else (int(lengths.min()), int(lengths.max()))}"
            )


class Transformer(nn.Module):
    """Encoder-decoder Transformer. forward(src, src_lengths, tgt, tgt_lengths) -> logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.n_decoder_layers < 1:
            raise ValueError("Transformer needs n_decoder_layers >= 1; use Classifier for encoder-only")
        self.cfg = cfg
        src_emb = Embedding(cfg.src_vocab_size, cfg.d_model, pos_encoding=cfg.pos_encoding)
        tgt_emb = src_emb if cfg.tie_embeddings == "all" else Embedding(cfg.tgt_vocab_size, cfg.d_model, pos_encoding=cfg.pos_encoding)
        self.encoder = Encoder(cfg, src_emb)
        self.decoder = Decoder(cfg, tgt_emb)
        self.generator = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias)
        _init_linears(self)
        if cfg.tie_embeddings != "none":
            self.generator.weight = tgt_emb.weight

    def kernel_for(self, device) -> str:
        return ops.resolve_kernel(self.cfg.kernel, device)

    def encode(self, src, src_lengths):
        """src (B, Ls) ids, src_lengths (B,) -> memory (B, Ls, d)."""
        _check_tokens("src", src, src_lengths, self.cfg.max_len)
        kernel = self.kernel_for(src.device)
        return self.encoder(self.encoder.embedding(src, kernel=kernel), src_lengths, kernel=kernel)

    def decode(self, tgt, memory, src_lengths, tgt_lengths=None, *, state=None, need_weights=False):
        """tgt (B, Lt) decoder input ids -> logits (B, Lt, V) [, cross-attention weights per layer]."""
        _check_tokens("tgt", tgt, tgt_lengths, self.cfg.max_len)
        kernel = self.kernel_for(tgt.device)
        out = self.decoder(tgt, memory, src_lengths, tgt_lengths, kernel=kernel, state=state, need_weights=need_weights)
        if need_weights:
            return self.generator(out[0]), out[1]
        return self.generator(out)

    def forward(self, src, src_lengths, tgt, tgt_lengths=None, *, need_weights=False):
        _check_tokens("src", src, src_lengths, self.cfg.max_len)
        _check_tokens("tgt", tgt, tgt_lengths, self.cfg.max_len)
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src batch {src.shape[0]} != tgt batch {tgt.shape[0]}")
        return self.decode(tgt, self.encode(src, src_lengths), src_lengths, tgt_lengths, need_weights=need_weights)

    def init_state(self, memory, src_lengths, max_len: int) -> DecoderState:
        """Decoding state for up to max_len target steps; cross-attention K/V computed here, once."""
        B, Ls, _ = memory.shape
        H, D = self.cfg.n_heads, self.cfg.head_dim
        caches = []
        for layer in self.decoder.layers:
            self_cache = KVCache.empty(B, max_len, H, D, device=memory.device, dtype=memory.dtype)
            k, v = layer.cross_attn.project_kv(memory)
            caches.append((self_cache, KVCache(k.contiguous(), v.contiguous(), Ls)))
        return DecoderState(caches, memory, src_lengths)

    def decode_step(self, tokens, state: DecoderState):
        """tokens (B, 1): the last emitted token of each row -> next-token logits (B, V)."""
        return self.decode(tokens, state.memory, state.src_lengths, state=state)[:, -1]


class Classifier(nn.Module):
    """Encoder-only classifier: a learned [CLS] vector prepended to the embedded tokens; its final
    hidden state feeds a linear head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.num_classes or cfg.num_classes < 2:
            raise ValueError(f"Classifier needs num_classes >= 2, got {cfg.num_classes}")
        self.cfg = cfg
        self.cls = nn.Parameter(torch.randn(cfg.d_model) * cfg.d_model**-0.5)
        self.encoder = Encoder(cfg, Embedding(cfg.src_vocab_size, cfg.d_model, pos_encoding=cfg.pos_encoding))
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        _init_linears(self)

    def kernel_for(self, device) -> str:
        return ops.resolve_kernel(self.cfg.kernel, device)

    def forward(self, tokens, lengths, *, return_attention: bool = False):
        """tokens (B, L), lengths (B,) -> logits (B, C) [, per layer weights (B, H, L+1, L+1)]."""
        _check_tokens("tokens", tokens, lengths, self.cfg.max_len - 1)
        kernel = self.kernel_for(tokens.device)
        x = self.encoder.embedding(tokens, pos_offset=1, kernel=kernel)  # [CLS] holds position 0
        x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)  # (B, L+1, d)
        out = self.encoder(x, lengths + 1, kernel=kernel, need_weights=return_attention)
        h, weights = out if return_attention else (out, None)
        logits = self.head(F.dropout(h[:, 0], self.cfg.dropout, self.training))
        return (logits, weights) if return_attention else logits


def _init_linears(module: nn.Module) -> None:
    # Xavier-uniform projections and zero biases, as annotated-transformer and fairseq do.
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def build_model(cfg: ModelConfig) -> nn.Module:
    return Classifier(cfg) if cfg.num_classes else Transformer(cfg)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, tied matrices counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
