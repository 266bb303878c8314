"""Plain-PyTorch reference implementations of the hot paths: the spec, and the `eager` backend.

Every other backend (`torch`: PyTorch's fused ops; `triton`: our kernels in `kernels/`; the C++
op in `csrc/`) is tested against these functions. They are written for clarity, not speed, and
use only elementary tensor ops (no `F.scaled_dot_product_attention`, no `F.layer_norm`), so a
test that compares a fused op with them compares two independent formulations.

Conventions shared by every backend (see `scratchformer/ops.py`):
- attention tensors are (B, H, L, D) with arbitrary strides; padding is right padding given as
  per-sequence lengths; causal masks align bottom-right: query i sits at position Lk - Lq + i,
  which makes incremental decoding with a KV cache (Lq < Lk) exact.
- a query row that may attend to no key (a sequence of length 0, no key at all (Lk = 0), or a
  row masked out entirely by causality) produces zeros, as does a query row at or beyond
  `query_lengths[b]`.

These functions do not check their inputs: the eager backend reaches them through the adapters of
`ops.select("eager")`, which do, once.
"""

from __future__ import annotations

import math

import torch


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half types, float64 stays float64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


__all__ = [
    "attention_ref",
    "attention_mask",
    "add_layer_norm_ref",
    "add_layer_norm_outputs",
    "ffn_ref",
    "embed_ref",
    "sinusoidal_positions",
    "cross_entropy_ref",
    "linear_cross_entropy_ref",
    "nll_loss_ref",
]


def attention_mask(
    B: int,
    Lq: int,
    Lk: int,
    *,
    key_lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
    causal: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Boolean mask (B, 1, Lq, Lk), True = attend; None when nothing is masked."""
    if key_lengths is None and query_lengths is None and not causal:
        return None
    mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device=device)
    if key_lengths is not None:
        cols = torch.arange(Lk, device=device)
        mask = mask & (cols[None, :] < key_lengths.to(device)[:, None])[:, None, None, :]
    if query_lengths is not None:
        rows = torch.arange(Lq, device=device)
        mask = mask & (rows[None, :] < query_lengths.to(device)[:, None])[:, None, :, None]
    if causal:
        rows = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)  # absolute query positions
        cols = torch.arange(Lk, device=device)[None, :]
        mask = mask & (cols <= rows)[None, None]
    return mask


def attention_ref(q, k, v, *, key_lengths=None, query_lengths=None, causal=False, dropout_p=0.0, scale=None,
                  dropout_mask=None, return_lse=False):
    """softmax(q kᵀ · scale) v with padding/causal masks, computed in fp32.

    q (B, H, Lq, D), k and v (B, H, Lk, D); key_lengths / query_lengths (B,) integer tensors;
    dropout_mask (B, H, Lq, Lk) bool (True = keep) replaces the random mask when given, so a
    kernel's own dropout mask can be replayed here. Returns out (B, H, Lq, D) in q's dtype and,
    with return_lse, the row log-sum-exp (B, H, Lq) in fp32 (-inf for rows with no key).
    """
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        # The reference computes in explicit precision; the eager adapter (ops) already cast the inputs.
        with torch.autocast(q.device.type, enabled=False):
            return attention_ref(q, k, v, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal,
                                 dropout_p=dropout_p, scale=scale, dropout_mask=dropout_mask, return_lse=return_lse)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = _acc(q.dtype)
    # Padding is never read, as in the kernels: rows past the lengths taken as zeros (where a masked
    # score's zero gradient times a NaN there, or a zero probability times one, would still be NaN)
    if key_lengths is not None:
        kept = (torch.arange(Lk, device=q.device) < key_lengths.to(q.device)[:, None])[:, None, :, None]
        k, v = torch.where(kept, k, 0), torch.where(kept, v, 0)
    if query_lengths is not None:
        q = torch.where((torch.arange(Lq, device=q.device) < query_lengths.to(q.device)[:, None])[:, None, :, None],
                        q, 0)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    mask = attention_mask(
        B, Lq, Lk, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal,
        device=q.device,
    )
    if mask is not None:
        # A finite fill keeps fully masked rows NaN-free: they become uniform, then zeroed below.
        s = s.masked_fill(~mask, torch.finfo(acc).min)
    # Lk = 0: no key at all, every row is empty (zeros out, lse -inf), as in the other backends.
    m = s.amax(dim=-1, keepdim=True) if Lk else s.new_zeros(B, H, Lq, 1)
    e = torch.exp(s - m)
    if mask is not None:
        e = e * mask
    denom = e.sum(dim=-1, keepdim=True)
    p = e / denom.clamp_min(torch.finfo(acc).tiny)
    lse = (m + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    if dropout_mask is not None:
        p = p * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        p = torch.nn.functional.dropout(p, dropout_p)
    out = torch.matmul(p, v.to(acc)).to(q.dtype)
    return (out, lse) if return_lse else out


def add_layer_norm_ref(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, dropout_mask=None,
                       return_residual=False, y_dtype=None, copy_dtype=None):
    """y = LayerNorm(dropout(x) + residual) over the last dim, statistics in fp32.

    x and residual (..., N) (a 16-bit x under an fp32 residual: the stream's dtype is the
    residual's); weight, bias (N,). With return_residual also returns the pre-norm sum
    s = dropout(x) + residual (the stream's dtype), the residual stream a Pre-LN model carries on.
    dropout_mask (same shape as x, bool, True = keep) replays a kernel's mask. y is in y_dtype
    (None: the stream's); copy_dtype appends y again in that dtype (after s), each rounded once
    from the unrounded y.

    The sum is taken in fp32 and rounded once to the stream's dtype; the norm normalises that
    rounded s, the values returned, and y has that dtype (docs/numerics.md). The mean is shifted by
    each row's first value, so a constant row gives x̂ = 0 exactly at any magnitude; the variance is
    that of the centred values.
    """
    stream = residual.dtype if residual is not None else x.dtype
    acc = _acc(stream)
    xf = x.to(acc)
    if dropout_mask is not None:
        xf = xf * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        xf = torch.nn.functional.dropout(xf, dropout_p)
    s = xf if residual is None else xf + residual.to(acc)
    # Round s to the stream's dtype as a value change only: gradients flow on in acc precision, as in the kernel.
    s = s + (s.to(stream).to(acc) - s).detach()
    shift = s[..., :1].detach()  # the mean does not depend on the shift: no gradient through it
    mean = shift + (s - shift).mean(dim=-1, keepdim=True)
    d = s - mean
    var = (d * d).mean(dim=-1, keepdim=True)
    y = d * torch.rsqrt(var + eps) * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return add_layer_norm_outputs(y, s.to(stream), return_residual=return_residual, y_dtype=y_dtype,
                                  copy_dtype=copy_dtype)


def add_layer_norm_outputs(y, s, *, return_residual=False, y_dtype=None, copy_dtype=None):
    """What `add_layer_norm` returns, from y (any precision: each output dtype is one rounding of
    it) and s (the stream's dtype): y in y_dtype (None: s's), then s if return_residual, then y
    again in copy_dtype if given; y alone when nothing else is asked."""
    out = (y.to(y_dtype or s.dtype),) + ((s,) if return_residual else ())
    out += (y.to(copy_dtype),) if copy_dtype is not None else ()
    return out if len(out) > 1 else out[0]


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(h)  # gradient 0 at h == 0, as F.relu's and the kernels' (clamp_min's is 1 there)
    if activation == "gelu":  # exact (erf) GELU
        return 0.5 * h * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
    raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")


def ffn_ref(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, dropout_mask=None) -> torch.Tensor:
    """Position-wise FFN: dropout(act(x W1ᵀ + b1)) W2ᵀ + b2, nn.Linear weight layout.

    x (..., d_model); w1 (d_ff, d_model); b1 (d_ff,); w2 (d_model, d_ff); b2 (d_model,).
    Matmuls accumulate in x's dtype as PyTorch's do (this is the unfused eager path).
    """
    h = torch.matmul(x, w1.t())
    if b1 is not None:
        h = h + b1
    h = _activation(h, activation)
    if dropout_mask is not None:
        h = h * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        h = torch.nn.functional.dropout(h, dropout_p)
    y = torch.matmul(h, w2.t())
    if b2 is not None:
        y = y + b2
    return y


def sinusoidal_positions(
    positions: torch.Tensor, d_model: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The paper's encoding: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same).

    positions: integer tensor of any shape; returns (*positions.shape, d_model). Built in
    float64 so it can serve as the accuracy reference for kernels that compute it on the fly.
    """
    if d_model % 2 != 0:
        raise ValueError(f"d_model must be even for sinusoidal encoding, got {d_model}")
    i = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device)
    inv_freq = torch.exp(-math.log(10000.0) * i / d_model)  # (d_model/2,)
    angle = positions.to(torch.float64)[..., None] * inv_freq  # (..., d_model/2)
    pe = torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).flatten(-2)
    return pe.to(dtype)


def embed_ref(tokens, weight, *, scale, pos_offset=0, pos_encoding=True) -> torch.Tensor:
    """weight[tokens] * scale + PE(pos_offset + j) for the token at sequence index j.

    tokens (B, L) integer; weight (V, d_model). Returns (B, L, d_model) in weight's dtype.
    """
    x = weight[tokens] * scale
    if pos_encoding:
        L = tokens.shape[-1]
        pos = torch.arange(pos_offset, pos_offset + L, device=tokens.device)
        x = x + sinusoidal_positions(pos, weight.shape[1], weight.dtype)  # float64 table, one rounding
    return x


def cross_entropy_ref(logits, target, label_smoothing=0.0, ignore_index=0):
    """Summed label-smoothed cross-entropy and summed NLL over the rows whose target is not
    ignore_index (PAD, never a target). logits (N, V), target (N,) -> (loss sum, NLL sum).

    The smoothed target puts 1 - ε on the gold token and spreads ε evenly over the V - 2 other
    tokens that are neither gold nor ignore_index (annotated-transformer's LabelSmoothing). Rows
    whose target is ignore_index are zeroed, not indexed out: a boolean index is a host-device
    sync and a copy of the kept rows. Computed in fp32 (float64 stays float64).
    """
    return nll_loss_ref(torch.log_softmax(logits.to(_acc(logits.dtype)), dim=-1), target, label_smoothing,
                        ignore_index)


def nll_loss_ref(lprobs, target, label_smoothing=0.0, ignore_index=0):
    """`cross_entropy_ref` of log-probabilities lprobs (N, V), as F.nll_loss is F.cross_entropy's:
    for a distribution that is not one softmax of logits (a copy layer's mixture, an ensemble's
    mean) or whose log-probabilities are already at hand (R-Drop's): scored as they are, not
    normalised again (nor kept again for the backward)."""
    lprobs = lprobs.to(_acc(lprobs.dtype))
    keep = target != ignore_index
    nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
    if label_smoothing == 0.0:
        nll = torch.where(keep, nll, 0.0).sum()
        return nll, nll
    V = lprobs.shape[-1]
    # -Σ log p over non-gold, non-pad tokens; the pad column left out of the sum, not subtracted after
    # it: a -inf there (PAD barred) would make it -inf - -inf
    others = -(lprobs[:, :ignore_index].sum(-1) + lprobs[:, ignore_index + 1:].sum(-1)) - nll
    loss = (1.0 - label_smoothing) * nll + label_smoothing / (V - 2) * others
    return torch.where(keep, loss, 0.0).sum(), torch.where(keep, nll, 0.0).sum()


def linear_cross_entropy_ref(x, weight, bias, target, *, label_smoothing=0.0, ignore_index=0):
    """`cross_entropy_ref` of the logits x Wᵀ + b: x (N, d), weight (V, d), bias (V,) or None."""
    logits = torch.matmul(x, weight.t())
    if bias is not None:
        logits = logits + bias
    return cross_entropy_ref(logits, target, label_smoothing, ignore_index)
