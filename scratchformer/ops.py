"""The backend switch: the only module that knows backends exist.

Four functional hot paths, one signature each for every backend:

    attention(q, k, v, *, key_lengths, query_lengths, causal, dropout_p, scale, kernel)
    add_layer_norm(x, residual, weight, bias, eps, *, dropout_p, return_residual, kernel)
    ffn(x, w1, b1, w2, b2, *, activation, dropout_p, kernel)
    embed(tokens, weight, *, scale, pos_offset, pos_encoding, kernel)

Backends:
- ``eager``:  `scratchformer.reference`, plain tensor ops; the spec every other backend is tested
  against.
- ``torch``:  PyTorch's fused ops (`F.scaled_dot_product_attention`, `F.layer_norm`, `F.linear`),
  the peer we race.
- ``triton``: our kernels in `kernels/` (mapped to `scratchformer.kernels`) and the C++/CUDA op
  `scratchformer._C` for the embedding. On CPU the Triton kernels run in Triton's interpreter.

`resolve_kernel("auto", device)` picks `triton` on CUDA and `eager` on CPU. Asking for a backend
whose kernel is missing raises an error naming what is missing: there is no silent fallback.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

from . import reference

KERNELS = ("eager", "torch", "triton")
_INTERPRETER_WARNED = False


def resolve_kernel(kernel: str, device: torch.device | str = "cpu") -> str:
    """Turn the --kernel flag into a concrete backend name, once, for a model on `device`."""
    if kernel not in KERNELS + ("auto",):
        raise ValueError(f"unknown kernel backend {kernel!r}; choose one of {('auto',) + KERNELS}")
    device = torch.device(device)
    if kernel == "auto":
        return "triton" if device.type == "cuda" else "eager"
    if kernel == "triton" and device.type not in _TRITON_READY:  # once per device type: a compiled
        _prepare_triton(device)  # model's trace then skips this (sys.modules scans, imports)
        if not torch.compiler.is_compiling():  # import the entry points now, not in a compiled trace
            for entry in _TRITON_ENTRY_POINTS:
                try:
                    _load(*entry)
                except NotImplementedError:
                    pass  # reported when that op is called
            _TRITON_READY.add(device.type)
    return kernel


_TRITON_READY: set = set()  # device types resolve_kernel prepared the triton backend for
_TRITON_ENTRY_POINTS = (
    ("scratchformer.kernels.attention", "attention", "attention"),
    ("scratchformer.kernels.add_layer_norm", "add_layer_norm", "add_layer_norm"),
    ("scratchformer.kernels.ffn", "ffn", "ffn"),
    ("scratchformer._ext", "embed_sinusoidal", "embed"),
)


def _prepare_triton(device: torch.device) -> None:
    """On CPU, Triton runs in its interpreter, which must be chosen before kernels are defined."""
    global _INTERPRETER_WARNED
    if device.type == "cuda":
        return
    if device.type != "cpu":
        raise ValueError(f"the triton backend runs on cuda (or cpu via the interpreter), not {device}")
    loaded = [m for m in sys.modules if m.startswith("scratchformer.kernels.")]
    if os.environ.get("TRITON_INTERPRET") != "1":
        if loaded:
            raise RuntimeError(
                "the triton backend on CPU needs TRITON_INTERPRET=1 before the kernels are "
                f"imported, but {loaded} were already imported without it"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    if not _INTERPRETER_WARNED:
        warnings.warn(
            "triton backend on CPU: kernels run in Triton's interpreter (TRITON_INTERPRET=1), "
            "which is correct but very slow; use it for testing, not training",
            stacklevel=3,
        )
        _INTERPRETER_WARNED = True


_LOADED: dict = {}  # (module, name) -> entry point


def _load(module: str, name: str, what: str):
    """Import a kernel entry point, or explain precisely what is missing. Cached in a plain dict,
    which torch.compile traces without a graph break (it cannot trace importlib or lru_cache):
    `resolve_kernel` fills it, in eager mode, before a compiled model first calls it."""
    fn = _LOADED.get((module, name))
    if fn is not None:
        return fn
    try:
        mod = sys.modules.get(module) or importlib.import_module(module)
    except ImportError as e:
        raise NotImplementedError(
            f"{what} has no 'triton' kernel available: importing {module} failed ({e})"
        ) from e
    try:
        fn = _LOADED[(module, name)] = getattr(mod, name)
    except AttributeError as e:
        raise NotImplementedError(f"{what} has no 'triton' kernel: {module}.{name} is missing") from e
    return fn


def _autocast(*tensors):
    """Cast to the autocast dtype where autocast is on, as it would for a matmul: our Triton
    kernels are opaque to autocast. None entries pass through."""
    dev = next(t for t in tensors if t is not None).device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return tensors
    dtype = torch.get_autocast_dtype(dev)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _check_kernel(kernel: str, what: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(
            f"{what}: kernel must be one of {KERNELS} (resolve 'auto' with resolve_kernel), "
            f"got {kernel!r}"
        )


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def _check_attention(q, k, v, key_lengths, query_lengths, check_range=True):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q, k, v of shape (B, H, L, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, Lq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(
            f"attention shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(need matching B, H, D and k.shape == v.shape)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"attention needs floating-point q, k, v, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention device mismatch: q {q.device}, k {k.device}, v {v.device}")
    for name, lengths, L in (("key_lengths", key_lengths, k.shape[2]), ("query_lengths", query_lengths, Lq)):
        if lengths is None:
            continue
        if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be an int32/int64 tensor of shape ({B},), got "
                f"{lengths.dtype} {tuple(lengths.shape)}"
            )
        if lengths.device != q.device:
            raise ValueError(f"{name} is on {lengths.device} but q is on {q.device}")
        # The range check syncs with the device; the Triton launcher does it itself, so skip it here.
        if check_range and lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > L):
            raise ValueError(
                f"{name} must lie in [0, {L}] (the sequence length), got min "
                f"{int(lengths.min())} max {int(lengths.max())}"
            )


def key_padding_mask_to_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Convert a boolean key-padding mask (B, Lk), True = padding, to lengths (B,).

    Only right padding can be expressed as lengths; any other pattern is a clear error.
    """
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be a bool (B, Lk) tensor, got {mask.dtype} {tuple(mask.shape)}")
    lengths = (~mask).sum(dim=1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= lengths[:, None]
    if not torch.equal(expected, mask):
        raise ValueError("key_padding_mask is not right-padded; only right padding is supported")
    return lengths


def _attention_sdpa(q, k, v, *, key_lengths, query_lengths, causal, dropout_p, scale):
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if key_lengths is None and query_lengths is None and (not causal or Lq == Lk):
        # Dense case: SDPA picks its flash/efficient kernels. is_causal aligns top-left, which
        # equals our bottom-right alignment only when Lq == Lk.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    mask = reference.attention_mask(
        B, Lq, Lk, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal, device=q.device
    )
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, Lq, 1): rows with no key -> zeros, not NaN
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(empty, 0.0)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    validate: bool = True,
    kernel: str,
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v.

    q (B, H, Lq, D), k/v (B, H, Lk, D), any strides; key_lengths / query_lengths (B,) int
    (right padding) or key_padding_mask (B, Lk) bool, True = padding; causal aligned so query i
    sits at position Lk - Lq + i; scale defaults to 1/sqrt(D). Rows with no visible key and rows
    at or beyond query_lengths are zeros. Returns (B, H, Lq, D) in q's dtype. validate=False
    skips the lengths' range check, a host sync per call, for callers that checked them once
    already (the model checks them at its entry).
    """
    _check_kernel(kernel, "attention")
    q, k, v = _autocast(q, k, v)  # attention runs in the autocast dtype for every backend
    if key_padding_mask is not None:
        if key_lengths is not None:
            raise ValueError("give key_lengths or key_padding_mask, not both")
        key_lengths = key_padding_mask_to_lengths(key_padding_mask)
    _check_attention(q, k, v, key_lengths, query_lengths, check_range=validate and kernel != "triton")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kw = dict(key_lengths=key_lengths, query_lengths=query_lengths, causal=causal, dropout_p=dropout_p, scale=scale)
    if kernel == "eager":
        return reference.attention_ref(q, k, v, **kw)
    if kernel == "torch":
        return _attention_sdpa(q, k, v, **kw)
    return _load("scratchformer.kernels.attention", "attention", "attention")(q, k, v, validate=validate, **kw)


# ---------------------------------------------------------------------------------------------
# residual add + LayerNorm
# ---------------------------------------------------------------------------------------------


def _add_layer_norm_torch(x, residual, weight, bias, eps, *, dropout_p, return_residual):
    s = F.dropout(x, dropout_p) if dropout_p > 0 else x
    if residual is not None:
        s = s + residual
    y = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return (y, s) if return_residual else y


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    dropout_p: float = 0.0,
    return_residual: bool = False,
    kernel: str,
):
    """y = LayerNorm(dropout(x) + residual); with return_residual, (y, dropout(x) + residual).

    x, residual (..., N); weight, bias (N,). Statistics in fp32.
    """
    _check_kernel(kernel, "add_layer_norm")
    N = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_layer_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if weight.shape != (N,) or (bias is not None and bias.shape != (N,)):
        raise ValueError(
            f"add_layer_norm: weight/bias must be ({N},) for hidden size {N}, got "
            f"{tuple(weight.shape)} / {None if bias is None else tuple(bias.shape)}"
        )
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"add_layer_norm dtype mismatch: x {x.dtype}, residual {residual.dtype}")
    kw = dict(dropout_p=dropout_p, return_residual=return_residual)
    if kernel == "eager":
        return reference.add_layer_norm_ref(x, residual, weight, bias, eps, **kw)
    if kernel == "torch":
        return _add_layer_norm_torch(x, residual, weight, bias, eps, **kw)
    fn = _load("scratchformer.kernels.add_layer_norm", "add_layer_norm", "add_layer_norm")
    return fn(x, residual, weight, bias, eps, **kw)


# ---------------------------------------------------------------------------------------------
# position-wise feed-forward
# ---------------------------------------------------------------------------------------------


def _ffn_torch(x, w1, b1, w2, b2, *, activation, dropout_p):
    h = F.linear(x, w1, b1)
    h = F.relu(h) if activation == "relu" else F.gelu(h)
    if dropout_p > 0:
        h = F.dropout(h, dropout_p)
    return F.linear(h, w2, b2)


def ffn(x, w1, b1, w2, b2, *, activation: str = "relu", dropout_p: float = 0.0, kernel: str):
    """dropout(act(x W1ᵀ + b1)) W2ᵀ + b2. x (..., d_model), w1 (d_ff, d_model), w2 (d_model, d_ff)."""
    _check_kernel(kernel, "ffn")
    if activation not in ("relu", "gelu"):
        raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
    d_model = x.shape[-1]
    if w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != d_model or w2.shape != (d_model, w1.shape[0]):
        raise ValueError(
            f"ffn shape mismatch: x (..., {d_model}), w1 {tuple(w1.shape)} (want (d_ff, {d_model})), "
            f"w2 {tuple(w2.shape)} (want ({d_model}, d_ff))"
        )
    kw = dict(activation=activation, dropout_p=dropout_p)
    if kernel == "eager":
        return reference.ffn_ref(x, w1, b1, w2, b2, **kw)
    if kernel == "torch":
        return _ffn_torch(x, w1, b1, w2, b2, **kw)
    x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    return _load("scratchformer.kernels.ffn", "ffn", "ffn")(x, w1, b1, w2, b2, **kw)


# ---------------------------------------------------------------------------------------------
# token embedding * scale + sinusoidal positions
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _pe_table(length: int, d_model: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return reference.sinusoidal_positions(torch.arange(length), d_model, dtype).to(device)


def _embed_torch(tokens, weight, *, scale, pos_offset, pos_encoding):
    # What PyTorch users write: a cached table, F.embedding, a multiply and an add.
    x = F.embedding(tokens, weight) * scale
    if pos_encoding:
        L = tokens.shape[-1]
        table = _pe_table(max(1024, 1 << (pos_offset + L - 1).bit_length()), weight.shape[1], str(weight.device), weight.dtype)
        x = x + table[pos_offset : pos_offset + L]
    return x


def embed(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: float,
    pos_offset: int = 0,
    pos_encoding: bool = True,
    kernel: str,
) -> torch.Tensor:
    """weight[tokens] * scale + PE(pos_offset + j). tokens (B, L) int; weight (V, d). -> (B, L, d)."""
    _check_kernel(kernel, "embed")
    if tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embed: tokens must be int32 or int64, got {tokens.dtype}")
    if tokens.device != weight.device:
        raise ValueError(f"embed: tokens on {tokens.device} but weight on {weight.device}")
    if pos_offset < 0:
        raise ValueError(f"embed: pos_offset must be >= 0, got {pos_offset}")
    kw = dict(scale=scale, pos_offset=pos_offset, pos_encoding=pos_encoding)
    if kernel == "eager":
        return reference.embed_ref(tokens, weight, **kw)
    if kernel == "torch":
        return _embed_torch(tokens, weight, **kw)
    return _load("scratchformer._ext", "embed_sinusoidal", "embed")(tokens, weight, **kw)
