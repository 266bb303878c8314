"""The Transformer of Vaswani et al., "Attention Is All You Need" (NeurIPS 2017), an
encoder-only classifier with a learned [CLS] token, and an encoder-only extractive summarizer,
built from the layers in `layers.py`.

The backend is chosen once, when a model is built for a device: `build_model(cfg, device)` (or
`Transformer(cfg, device)`) resolves `cfg.kernel` with `ops.select` and hands the resulting `Ops`
to every layer; `model.ops.name` says which backend runs. Moving a built model (`.to`, `.cuda`,
`.cpu`) chooses again for the new device, so `auto` stays triton on CUDA and eager on CPU.

A batch, and an encoder output handed to the decoder, are checked once, at the model's boundary
(`Transformer.forward/encode/decode/init_state`, `Classifier.forward`, `Extractor.forward`; `checks.py`): shapes,
dtypes and devices always (no tensor data read), token ids and lengths in range only where reading them is free (CPU
tensors) or with SCRATCHFORMER_DEBUG=1 (`op_checks.DEBUG`), so a GPU step never waits on a host sync.

Shapes: B batch, Ls/Lt source/target length, H heads, D head dim, d d_model, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import op_checks
from .. import ops as backends
from ..ops import Ops
from ..reference import nll_loss_ref
from .caches import DecoderState, KVCache
from .checks import check_batch, check_memory
from .config import PAD_ID, ModelConfig
from .copy import PointerGenerator
from .layers import AddNorm, DecoderLayer, Embedding, EncoderLayer, per_source, project_memory


class _Stack(nn.Module):
    """Shared by Encoder and Decoder: the embedding dropout, running each layer (recomputed in the
    backward when `recompute` is set) and closing the residual stream."""

    recompute = False  # set by `_Model.recompute_activations`

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.pre_norm, self.dropout = cfg.norm == "pre", cfg.dropout
        self.final_norm = None
        if cfg.final_norm:
            self.final_norm = AddNorm(cfg.d_model, ops=ops, eps=cfg.layer_norm_eps, dropout=cfg.dropout)

    def _layer(self, layer, *args, **kwargs):
        """`layer(*args, **kwargs)`; with `recompute` in a training forward that builds a graph, its
        activations are not kept: the backward runs the layer again from its inputs, under the
        same RNG states (torch's CPU and CUDA generators, from which our kernels draw their
        dropout's Philox seed), so the same dropout masks and the same gradients."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    def _finish(self, x, carry, *, for_matmul=False):
        """The stack's output from its last layer's (x, carry), in the stream's dtype; for_matmul
        (its only reader a matmul: the generator, the cross-attentions' K/V projection) in
        autocast's dtype where the last norm writes it so (a final norm's y, a Post-LN layer's copy)."""
        delta = carry if self.pre_norm else None  # Post-LN's carry is x or its copy
        if self.final_norm is not None:
            return self.final_norm.norm(x, delta, for_matmul=for_matmul)
        if delta is not None:
            return x + F.dropout(delta.to(x.dtype), self.dropout, self.training)
        return carry if for_matmul and carry is not None else x


class Encoder(_Stack):
    def __init__(self, cfg: ModelConfig, embedding: Embedding, ops: Ops):
        super().__init__(cfg, ops)
        self.embedding = embedding
        self.layers = nn.ModuleList(EncoderLayer(cfg, ops) for _ in range(cfg.n_encoder_layers))

    def forward(self, x, lengths, *, need_weights=False, for_matmul=False):
        """x (B, L, d) already embedded; lengths (B,). -> (B, L, d) [, list of (B, H, L, L)];
        for_matmul: the output's only reader is a matmul (`_Stack._finish`)."""
        x = F.dropout(x, self.dropout, self.training)
        carry, weights = None, []
        for layer in self.layers:
            x, carry, w = self._layer(layer, x, carry, lengths, need_weights=need_weights)
            weights.append(w)
        x = self._finish(x, carry, for_matmul=for_matmul)
        return (x, weights) if need_weights else x


class Decoder(_Stack):
    def __init__(self, cfg: ModelConfig, embedding: Embedding, ops: Ops):
        super().__init__(cfg, ops)
        self.embedding = embedding
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.n_decoder_layers))

    def forward(self, tgt, memory, src_lengths, tgt_lengths=None, *, state=None, need_weights=False,
                for_matmul=False):
        """tgt (B, Lt) ids, memory (B, Ls, d) -> (B, Lt, d) [, cross-attention weights per layer];
        for_matmul: the output's only reader is a matmul (`_Stack._finish`)."""
        pos_offset = state.pos if state is not None else 0
        x = F.dropout(self.embedding(tgt, pos_offset=pos_offset), self.dropout, self.training)
        # every layer's cross-attention keys and values at once (a state's caches hold them already)
        memory_kv = project_memory(self.layers, memory) if state is None else [None] * len(self.layers)
        carry, weights = None, []
        for i, layer in enumerate(self.layers):
            cache = state.caches[i] if state is not None else None
            x, carry, w = self._layer(layer, x, carry, memory_kv[i], src_lengths, tgt_lengths, cache=cache,
                                      need_weights=need_weights)
            weights.append(w)
        if state is not None:
            state.pos += tgt.shape[1]  # in place where pos is a device tensor (a static cache's step)
        x = self._finish(x, carry, for_matmul=for_matmul)
        return (x, weights) if need_weights else x


class _Model(nn.Module):
    """Holds `ops`, the backend chosen for the device the parameters live on, and gives it to
    every layer; moving the model (`.to`, `.cuda`, `.cpu`, ...) chooses again for the new device."""

    def _select_ops(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if getattr(self, "ops", None) is not None and device.type == self._ops_device_type:
            return
        chosen = backends.select(self.cfg.kernel, device, self.cfg.head_dim)
        for m in self.modules():
            if "ops" in vars(m):
                m.ops = chosen
        self.ops, self._ops_device_type = chosen, device.type

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._select_ops(next(self.parameters()).device)
        return out

    def recompute_activations(self, enabled: bool = True) -> _Model:
        """Activation checkpointing (`torch.utils.checkpoint`, non-reentrant): a training forward
        keeps only each encoder and decoder layer's inputs, and the backward recomputes the rest,
        layer by layer: the activations of one layer at a time, not of all of them, for one more
        forward of the layers a step. Same gradients; evaluation and decoding are unchanged."""
        for m in self.modules():
            if isinstance(m, _Stack):
                m.recompute = enabled
        return self


class Transformer(_Model):
    """Encoder-decoder Transformer. forward(src, src_lengths, tgt, tgt_lengths) -> logits (B, Lt, V).

    Built on `device` (default CPU) with the backend `cfg.kernel` resolves to there (`self.ops`).
    """

    # Decoding (`decoding.py`) gives every step fixed-size caches and its position on the device
    # (`init_state(static=True)`) when its steps are replayed as CUDA graphs, or when this is True:
    # `compile.compile_decoding` sets it, so every step of a decoding is one graph.
    static_caches = False

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        if cfg.n_decoder_layers < 1:
            raise ValueError("Transformer needs n_decoder_layers >= 1; use Classifier for encoder-only")
        self.cfg = cfg
        device = torch.device("cpu" if device is None else device)
        self._select_ops(device)
        ops = self.ops
        src_emb = Embedding.from_config(cfg, cfg.src_vocab_size, ops)
        tgt_emb = src_emb if cfg.tie_embeddings == "all" else Embedding.from_config(cfg, cfg.tgt_vocab_size, ops)
        self.encoder = Encoder(cfg, src_emb, ops)
        self.decoder = Decoder(cfg, tgt_emb, ops)
        self.generator = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias)
        self.copy = PointerGenerator(cfg.d_model) if cfg.copy else None
        _init_linears(self)
        if cfg.tie_embeddings != "none":
            self.generator.weight = tgt_emb.weight
        self.to(device)  # initialised on CPU: a seed gives the same weights on every device

    def _check(self, name, tokens, lengths):
        vocab = self.cfg.src_vocab_size if name == "src" else self.cfg.tgt_vocab_size
        check_batch(name, tokens, lengths, vocab=vocab, max_len=self.cfg.max_len)

    def _check_memory(self, memory, src_lengths, src=None):
        """decode's and init_state's encoder side: memory and src_lengths, and the source ids src where given."""
        if src is not None:
            self._check("src", src, None)  # its lengths: memory's
        weight = self.generator.weight
        check_memory(memory, src_lengths, src, d_model=self.cfg.d_model, dtype=weight.dtype, device=weight.device)

    def encode(self, src, src_lengths):
        """src (B, Ls) ids, src_lengths (B,) -> memory (B, Ls, d)."""
        self._check("src", src, src_lengths)
        return self._encode(src, src_lengths)

    def _encode(self, src, src_lengths, *, for_matmul=False):
        return self.encoder(self.encoder.embedding(src), src_lengths, for_matmul=for_matmul)

    def decode(self, tgt, memory, src_lengths, tgt_lengths=None, *, state=None, need_weights=False, src=None):
        """tgt (B, Lt) decoder input ids -> logits (B, Lt, V) [, cross-attention weights per layer].
        With the copy layer (cfg.copy) the logits are log-probabilities, and the source ids `src`
        (B, Ls) are needed: given here, or kept in `state`."""
        self._check("tgt", tgt, tgt_lengths)
        if tgt_lengths is not None and state is not None and state.beams > 1:
            raise ValueError(f"decode: no tgt_lengths with a state of {state.beams} rows per source (a beam search's "
                             "hypotheses, which attend as one row of queries)")
        if src is None and self.copy is not None and state is None:
            raise ValueError("this model copies from its source (cfg.copy): decode needs src=, the source ids")
        if state is None or src is not None or memory is not state.memory or src_lengths is not state.src_lengths:
            self._check_memory(memory, src_lengths, src)  # a state's own (decode_step's) init_state checked
        rows = memory.shape[0] * (state.beams if state is not None else 1)
        if tgt.shape[0] != rows:
            raise ValueError(f"tgt batch {tgt.shape[0]} != memory batch {memory.shape[0]}" + (
                f" x {state.beams} rows a source in the state" if state is not None and state.beams > 1 else ""))
        return self._decode(tgt, memory, src_lengths, tgt_lengths, state=state, need_weights=need_weights, src=src)

    def _decode(self, tgt, memory, src_lengths, tgt_lengths=None, *, state=None, need_weights=False, src=None):
        out = self.decoder(tgt, memory, src_lengths, tgt_lengths, state=state, need_weights=need_weights,
                           for_matmul=self.copy is None)  # the copy layer reads it too
        h, weights = out if need_weights else (out, None)
        logits = self.generator(h)
        if self.copy is not None:
            source = self.copy.source(memory, src, src_lengths) if state is None else state.copy_source
            sources = source.src.shape[0]  # a state's rows of one source (beam search's hypotheses): one row of queries
            logits = self.copy(per_source(h, sources), per_source(logits, sources), memory, source).view(logits.shape)
        return (logits, weights) if need_weights else logits

    def forward(self, src, src_lengths, tgt, tgt_lengths=None, *, need_weights=False, target=None,
                label_smoothing=0.0):
        """The logits (B, Lt, V) of the decoder inputs tgt [, cross-attention weights]; with `target`
        (B, Lt) ids, the next tokens, instead the training loss: (loss sum, NLL sum), fp32 scalars, of
        the label-smoothed cross-entropy over the targets that are not PAD. That is the backend's
        `linear_cross_entropy`, the generator and the loss in one op: the triton backend never holds
        the whole (B·Lt, V) logits (kernels/cross_entropy.py)."""
        self._check("src", src, src_lengths)
        self._check("tgt", tgt, tgt_lengths)
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src batch {src.shape[0]} != tgt batch {tgt.shape[0]}")
        if target is not None and target.shape != tgt.shape:
            raise ValueError(f"target must have tgt's shape {tuple(tgt.shape)}, got {tuple(target.shape)}")
        if target is not None and need_weights:
            raise ValueError("forward(target=) returns the loss, not attention weights: need_weights is for the logits")
        # its only reader the cross-attentions' one matmul (`project_memory`), unless the copy layer's
        memory = self._encode(src, src_lengths, for_matmul=self.copy is None)
        if target is None:
            return self._decode(tgt, memory, src_lengths, tgt_lengths, need_weights=need_weights, src=src)
        target = target.flatten()
        if self.copy is not None:  # log-probabilities mixed with the source's: no logits to fuse away
            op_checks.check_targets("forward(target=)", target, target.shape[0], self.generator.out_features,
                                    label_smoothing, PAD_ID)
            logprobs = self._decode(tgt, memory, src_lengths, tgt_lengths, src=src)
            return nll_loss_ref(logprobs.flatten(0, 1), target, label_smoothing, PAD_ID)
        h = self.decoder(tgt, memory, src_lengths, tgt_lengths, for_matmul=True).flatten(0, 1)
        return self.ops.linear_cross_entropy(h, self.generator.weight, self.generator.bias, target,
                                             label_smoothing=label_smoothing, ignore_index=PAD_ID)

    def init_state(self, memory, src_lengths, max_len: int, src=None, *, static: bool = False,
                   beams: int = 1) -> DecoderState:
        """Decoding state for up to max_len target steps; cross-attention K/V computed here, once
        (and what the copy layer reads of the source: it needs the source ids `src`). static: fixed-size caches and
        the step position on the device (`StaticKVCache`), what a CUDA graph of `decode_step`
        needs; one token a step. beams: the decoder's rows per source, consecutively (beam search's
        hypotheses); the encoder side is kept once a source, and the rows of a source read it
        together (`DecoderState`)."""
        if max_len > self.cfg.max_len:  # a step's position is its index: as forward refuses a longer target
            raise ValueError(f"max_len {max_len} is over the model's max_len {self.cfg.max_len}, the positions it has")
        if self.copy is not None and src is None:
            raise ValueError("this model copies from its source (cfg.copy): init_state needs src=, the source ids")
        self._check_memory(memory, src_lengths, src)

        B, Ls = memory.shape[0] * beams, memory.shape[1]
        H, D = self.cfg.n_heads, self.cfg.head_dim
        pos = torch.zeros(1, dtype=torch.long, device=memory.device) if static else 0
        # the self-attention K/V come from a matmul: under autocast in its dtype, which the caches
        # keep (an fp32 cache was cast whole to it again for every step's attention, every layer).
        # Static: zeros, not empty, as their masked keys and values are read too (a probability of 0
        # times a NaN bit pattern left in fresh memory is NaN)
        self_kv = (torch.zeros if static else torch.empty)(len(self.decoder.layers), B, max_len, 2, H, D,
                                                           device=memory.device,
                                                           dtype=backends.autocast_dtype(memory) or memory.dtype)
        cross = [KVCache(torch.stack(kv, 2), Ls) for kv in project_memory(self.decoder.layers, memory)]
        memory, src_lengths = memory.contiguous(), src_lengths.contiguous()
        if self.copy is None:
            return DecoderState(self_kv, cross, memory, src_lengths, pos=pos)
        source = self.copy.source(memory, src.contiguous(), src_lengths)
        return DecoderState(self_kv, cross, memory, src_lengths, source, pos=pos)

    def decode_step(self, tokens, state: DecoderState):
        """tokens (B, 1): the last emitted token of each row -> next-token logits (B, V)."""
        return self.decode(tokens, state.memory, state.src_lengths, state=state)[:, -1]


class Classifier(_Model):
    """Encoder-only classifier: a learned [CLS] vector prepended to the embedded tokens; its final
    hidden state feeds a linear head. Built on `device` like `Transformer`."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        if not cfg.num_classes or cfg.num_classes < 2:
            raise ValueError(f"Classifier needs num_classes >= 2, got {cfg.num_classes}")
        self.cfg = cfg
        device = torch.device("cpu" if device is None else device)
        self._select_ops(device)
        self.cls = nn.Parameter(torch.randn(cfg.d_model) * cfg.d_model**-0.5)
        embedding = Embedding.from_config(cfg, cfg.src_vocab_size, self.ops)
        self.encoder = Encoder(cfg, embedding, self.ops)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        _init_linears(self)
        self.to(device)

    def forward(self, tokens, lengths, *, return_attention: bool = False):
        """tokens (B, L), lengths (B,) -> logits (B, C) [, per layer weights (B, H, L+1, L+1)]."""
        check_batch("tokens", tokens, lengths, vocab=self.cfg.src_vocab_size, max_len=self.cfg.max_len - 1)
        x = self.encoder.embedding(tokens, pos_offset=1)  # [CLS] holds position 0
        x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)  # (B, L+1, d)
        out = self.encoder(x, None if lengths is None else lengths + 1, need_weights=return_attention)  # None: unpadded
        h, weights = out if return_attention else (out, None)
        logits = self.head(F.dropout(h[:, 0], self.cfg.dropout, self.training))
        return (logits, weights) if return_attention else logits


class Extractor(_Model):
    """Encoder-only extractive summarizer (BertSumExt's scorer, Liu & Lapata 2019, from scratch):
    the document comes as ``BOS s1 BOS s2 ...`` (`data.extractive`); each marker's final hidden
    state feeds a linear scorer, one logit per sentence. Built on `device` like `Transformer`."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        if not cfg.extractive:
            raise ValueError("Extractor needs a config with extractive=True")
        self.cfg = cfg
        device = torch.device("cpu" if device is None else device)
        self._select_ops(device)
        embedding = Embedding.from_config(cfg, cfg.src_vocab_size, self.ops)
        self.encoder = Encoder(cfg, embedding, self.ops)
        self.head = nn.Linear(cfg.d_model, 1)
        _init_linears(self)
        self.to(device)

    def forward(self, tokens, lengths, sentences, *, return_attention: bool = False):
        """tokens (B, L), lengths (B,), sentences (B, S) each marker's position -> logits (B, S)
        [, per layer weights (B, H, L, L)]. A padded sentence slot's logit is meaningless."""
        check_batch("tokens", tokens, lengths, vocab=self.cfg.src_vocab_size, max_len=self.cfg.max_len)
        if not isinstance(sentences, torch.Tensor):
            raise ValueError(f"sentences must be a (B, S) int64 tensor of positions, got {type(sentences).__name__}")
        if sentences.dim() != 2 or sentences.shape[0] != tokens.shape[0] or sentences.dtype != torch.int64:
            raise ValueError(f"sentences must be (B, S) int64 positions for {tokens.shape[0]} documents, got "
                             f"{sentences.dtype} of shape {tuple(sentences.shape)}")
        if sentences.numel() and op_checks.value_checks(sentences):
            lo, hi = int(sentences.min()), int(sentences.max())
            if lo < 0 or hi >= tokens.shape[1]:
                raise ValueError(f"sentence positions must lie in [0, {tokens.shape[1]}), got min {lo} max {hi}")
        out = self.encoder(self.encoder.embedding(tokens), lengths, need_weights=return_attention)
        h, weights = out if return_attention else (out, None)
        h = h.gather(1, sentences[..., None].expand(-1, -1, h.shape[-1]))  # (B, S, d)
        logits = self.head(F.dropout(h, self.cfg.dropout, self.training)).squeeze(-1)
        return (logits, weights) if return_attention else logits


def _init_linears(module: nn.Module) -> None:
    # Xavier-uniform projections and zero biases, as annotated-transformer and fairseq do.
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def build_model(cfg: ModelConfig, device: torch.device | str | None = None) -> Transformer | Classifier | Extractor:
    """The model `cfg` describes (a Classifier when cfg.num_classes is set, an Extractor when
    cfg.extractive), on `device` (default CPU), with `model.ops` the backend `cfg.kernel` resolves to there."""
    if cfg.num_classes:
        return Classifier(cfg, device)
    return Extractor(cfg, device) if cfg.extractive else Transformer(cfg, device)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, tied matrices counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
