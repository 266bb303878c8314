"""The backend switch: the only module that knows backends exist.

`select(kernel, device)` resolves the --kernel flag (`ModelConfig.kernel`) once, for the device a
model lives on, into an `Ops` bundle of the four hot paths; layers call `self.ops.attention(...)`.
One signature per op, for every backend (backends may accept more keywords; the model uses these):

    attention(q, k, v, *, key_lengths=None, query_lengths=None, causal=False, dropout_p=0.0, scale=None)
        q (B, H, Lq, D), k and v (B, H, Lk, D), lengths (B,) int (right padding) -> (B, H, Lq, D)
    add_layer_norm(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, return_residual=False, y_dtype=None,
                   copy_dtype=None)
        x, residual (..., N); weight, bias (N,) -> y = LN(dropout(x) + residual) in y_dtype (None: the
        stream's, residual's else x's) [, dropout(x) + residual] [, y in copy_dtype]
    ffn(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0)
        x (..., d_model), w1 (d_ff, d_model), w2 (d_model, d_ff) -> (..., d_model)
    embed(tokens, weight, *, scale, pos_offset=0, pos_encoding=True)
        tokens (B, L) int, weight (V, d_model) -> weight[tokens] * scale + PE, (B, L, d_model)
    linear_cross_entropy(x, weight, bias, target, *, label_smoothing=0.0, ignore_index=0)
        x (N, d), weight (V, d), target (N,) int64 -> (loss sum, NLL sum) of the logits x Wᵀ + b:
        the generator and the training loss (label smoothing as `reference.cross_entropy_ref`)

Backends:
- ``eager``:  `scratchformer.reference`, plain tensor ops; the spec every other backend is tested
  against.
- ``torch``:  PyTorch's fused ops (`F.scaled_dot_product_attention`, `F.layer_norm`, `F.linear`),
  the peer we race.
- ``triton``: our kernels in `kernels/` (mapped to `scratchformer.kernels`) and the C++/CUDA op
  `scratchformer._C` for the embedding. On CPU the Triton kernels run in Triton's interpreter.
``auto`` is `triton` on CUDA and `eager` elsewhere. A backend whose kernels are missing raises an
error naming what is missing: there is no silent fallback.

Checks: what is valid is decided once per op (`scratchformer.op_checks`, which says when a check
reads values), and the same check runs in front of every backend (eager included), so all
backends accept and refuse the same calls with the same message (docs/numerics.md lists the
rules). The Triton entry points and the C++ op keep their own checks for what only they need
(dtypes, head dims, sizes) and for callers that reach them directly; the triton bundle runs the
check, then each kernel's `check_limits` (what only it needs), then the entry point without its
checks (`*_trusted`), so each input is checked once.
Attention with no key at all (Lk = 0) is valid: every row sees no key, so the output is zeros,
as for a row whose key length is 0.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import reference
from .op_checks import check_add_layer_norm, check_attention, check_embed, check_ffn, check_linear_cross_entropy

KERNELS = ("eager", "torch", "triton")
_INTERPRETER_WARNED = False


@dataclass(frozen=True)
class Ops:
    """The hot paths of one backend, with the signatures above. Built once by `select`."""

    name: str  # the resolved backend: eager, torch or triton
    attention: Callable
    add_layer_norm: Callable
    ffn: Callable
    embed: Callable
    linear_cross_entropy: Callable
    head_dims: tuple[int, ...] | None = None  # the attention head dims it runs (None: any)

    def __reduce__(self):  # pickled and deep-copied by name (torch.save(model), copy.deepcopy): same bundle back
        return _bundle, (self.name,)


def resolve(kernel: str, device: torch.device | str = "cpu") -> str:
    """The --kernel flag as a backend name for `device` ('auto': triton on CUDA, else eager; `select`
    takes torch instead where triton's attention does not run the model's head dim)."""
    if kernel not in KERNELS + ("auto",):
        raise ValueError(f"unknown kernel backend {kernel!r}; choose one of {('auto',) + KERNELS}")
    if kernel == "auto":
        return "triton" if torch.device(device).type == "cuda" else "eager"
    return kernel


def select(kernel: str, device: torch.device | str | None = None, head_dim: int | None = None) -> Ops:
    """The `Ops` of backend `kernel` (auto | eager | torch | triton) for tensors on `device` (default CPU),
    for a model whose attention heads are `head_dim` wide (None: not checked here).

    'auto' on CUDA is triton, or torch where triton's attention does not run that head dim. Raises
    ValueError for an unknown backend, a device the backend cannot run on, or a head dim triton's
    attention does not run (named with the ones it does), and NotImplementedError / RuntimeError
    naming what is missing when the triton backend's kernels or the C++ extension cannot be loaded.
    """
    device = torch.device("cpu" if device is None else device)
    name = resolve(kernel, device)
    if name == "eager":
        return EAGER
    if name == "torch":
        return TORCH
    _prepare_triton(device)
    ops = _triton_ops()
    if head_dim is None or head_dim in ops.head_dims:
        return ops
    if kernel == "auto":
        return TORCH
    raise ValueError(f"the triton backend's attention runs head dim {', '.join(map(str, ops.head_dims))}, not "
                     f"{head_dim} (d_model / heads): change --d-model or --heads, or use --kernel torch or eager")


def _bundle(name: str) -> Ops:
    """The bundle of a resolved backend name (unpickling): triton for CUDA when there is one."""
    return select(name, "cuda" if name == "triton" and torch.cuda.is_available() else "cpu")


@functools.lru_cache(maxsize=1)
def _triton_ops() -> Ops:
    try:  # imported here, after _prepare_triton chose the interpreter on CPU
        from .kernels import add_layer_norm, attention, cross_entropy, ffn
    except ImportError as e:
        raise NotImplementedError(f"the triton backend is not available: importing its kernels failed ({e})") from e
    from . import _ext

    _ext._require()  # the embedding is the C++/CUDA op: say now, not mid-forward, when it is not built
    # Triton kernels are opaque to autocast: cast their inputs as autocast would for a matmul. Each
    # input is checked once: the backends' check, then what only the kernel refuses (its limits),
    # then the entry point without its own checks (which would repeat both).
    return Ops("triton", _adapt(attention.attention_trusted, check_attention, attention.check_limits, cast=3),
               _adapt(add_layer_norm.add_layer_norm_trusted, check_add_layer_norm, add_layer_norm.check_limits),
               _adapt(ffn.ffn_trusted, check_ffn, ffn.check_limits, cast=5), _adapt(_ext.embed_sinusoidal, check_embed),
               _adapt(cross_entropy.linear_cross_entropy_trusted, check_linear_cross_entropy,
                      cross_entropy.check_limits, cast=3),
               head_dims=attention.HEAD_DIMS)


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
                f"imported, but {loaded} were already imported without it; on a GPU machine build "
                "the model (or put the op's inputs) on cuda"
            )
        if torch.cuda.is_available():  # turning the interpreter on here would run every kernel in it
            raise RuntimeError(
                "the triton backend was asked for on CPU on a machine with a GPU: build the model "
                "(Transformer(cfg, device='cuda')) or put the op's inputs on cuda; for Triton's "
                "interpreter on CPU, set TRITON_INTERPRET=1 before importing scratchformer"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    if not _INTERPRETER_WARNED:
        warnings.warn(
            "triton backend on CPU: kernels run in Triton's interpreter (TRITON_INTERPRET=1), "
            "which is correct but very slow; use it for testing, not training",
            stacklevel=3,
        )
        _INTERPRETER_WARNED = True


def _adapt(fn: Callable, *checks: Callable, cast: int = 0) -> Callable:
    """fn with its first `cast` arguments in the autocast dtype (where autocast is on), then
    `checks`ed in order (same arguments as fn) before the call. Those arguments may come by name too."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if cast:
            if len(args) < cast:  # some by name: positional from here on (the model's calls never are)
                bound = signature.bind(*args, **kwargs)
                args, kwargs = bound.args, bound.kwargs
            args = _autocast(*args[:cast]) + args[cast:]
        for check in checks:
            check(*args, **kwargs)
        return fn(*args, **kwargs)

    return op


def _autocast(*tensors):
    """Cast to the autocast dtype where autocast is on, as it would for a matmul: floating-point
    tensors other than float64; None, integer and float64 tensors pass as they are (the checks
    then name a dtype the op does not take)."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    dtype = autocast_on(first.device) if first is not None else None
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast t to for a matmul; None where it would leave t as it is
    (autocast off on t's device, t already in that dtype, or t not a float16/32 or bfloat16 tensor)."""
    dtype = autocast_on(t.device)
    if dtype is None or t.dtype == dtype or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    return dtype


def autocast_on(device: torch.device) -> torch.dtype | None:
    """Autocast's dtype on `device` where it is on there, else None."""
    dev = device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def key_padding_mask_to_lengths(mask: torch.Tensor) -> torch.Tensor:
    """A boolean key-padding mask (B, Lk), True = padding, as lengths (B,) int64.

    Only right padding can be expressed as lengths; any other pattern is a ValueError. Reads the
    mask's values (a host sync on a GPU): convert once, outside the hot path.
    """
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be a bool (B, Lk) tensor, got {mask.dtype} {tuple(mask.shape)}")
    lengths = (~mask).sum(dim=1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= lengths[:, None]
    if not torch.equal(expected, mask):
        raise ValueError("key_padding_mask is not right-padded; only right padding is supported")
    return lengths


# ---------------------------------------------------------------------------------------------
# the torch backend: PyTorch's fused ops behind our signatures
# ---------------------------------------------------------------------------------------------


def _attention_sdpa(q, k, v, *, key_lengths=None, query_lengths=None, causal=False, dropout_p=0.0, scale=None):
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if key_lengths is None and query_lengths is None and (not causal or Lq == Lk):
        # Dense case: SDPA picks its flash/efficient kernels. is_causal aligns top-left, which
        # equals our bottom-right alignment only when Lq == Lk. A NaN in a query row: PyTorch's CPU
        # flash kernel returns 0 there (as triton does; its math kernel and eager NaN); left as it is, as no
        # check reads values on the hot path (docs/numerics.md lists where the backends differ).
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    mask = reference.attention_mask(
        B, Lq, Lk, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal, device=q.device
    )
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, Lq, 1): rows with no key -> zeros, not NaN
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(empty, 0.0)


def _add_layer_norm_torch(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, return_residual=False, y_dtype=None,
                          copy_dtype=None):
    if residual is not None:
        x = x.to(residual.dtype)  # a 16-bit x under an fp32 stream: the stream's dtype (a no-op otherwise)
    s = F.dropout(x, dropout_p) if dropout_p > 0 else x
    if residual is not None:
        s = s + residual  # rounded to the stream's dtype: the norm normalises exactly the s it returns
    if s.device.type == "cpu" and s.dtype in (torch.float16, torch.bfloat16):
        # PyTorch's CPU LayerNorm for half types is not exact on constant rows (0.08, not 0, for a
        # row of fp16 10000s; torch 2.13) and its backward loses bits: normalise in fp32 there,
        # as its CUDA kernel does internally. One rounding of y, as in the other backends.
        f32 = [None if t is None else t.float() for t in (weight, bias)]
        y = F.layer_norm(s.float(), (s.shape[-1],), *f32, eps).to(s.dtype)
    else:
        if s.dtype == torch.float64:  # fp32 gains under a float64 stream (op_checks lets them): F.layer_norm
            weight, bias = (None if t is None else t.to(s.dtype) for t in (weight, bias))  # takes one dtype
        y = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return reference.add_layer_norm_outputs(y, s, return_residual=return_residual, y_dtype=y_dtype,
                                            copy_dtype=copy_dtype)


def _ffn_torch(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0):
    h = F.linear(x, w1, b1)
    h = F.relu(h) if activation == "relu" else F.gelu(h)
    if dropout_p > 0:
        h = F.dropout(h, dropout_p)
    return F.linear(h, w2, b2)


# The torch backend's cached position table holds at most this many rows (from position 0): decoding
# reads one row a step, training the first L. Positions past it are computed for the call alone, so
# a large pos_offset costs its L rows, not a table from 0 (2^21 took 4.7 s and 5.2 GiB, 2^29 more
# than a machine has).
PE_TABLE_ROWS = 2**16


@functools.lru_cache(maxsize=8)
def _pe_table(length: int, d_model: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return reference.sinusoidal_positions(torch.arange(length), d_model, dtype).to(device)


def _embed_torch(tokens, weight, *, scale, pos_offset=0, pos_encoding=True):
    # What PyTorch users write: a cached table, F.embedding, a multiply and an add.
    x = F.embedding(tokens, weight) * scale
    if not pos_encoding:
        return x
    L = tokens.shape[-1]
    if torch.compiler.is_compiling() or pos_offset + L > PE_TABLE_ROWS:
        # Under torch.compile: the rows in the graph (inductor fuses them into the add). Dynamo traces
        # through a cache anyway, and the table's size, from L's bit_length(), specialised each graph on
        # its length (a recompile per new length: 6 graphs for 6 batches, then the recompile limit and
        # eager). Past the table's bound: the call's own rows.
        positions = torch.arange(pos_offset, pos_offset + L, device=weight.device)
        return x + reference.sinusoidal_positions(positions, weight.shape[1], weight.dtype)
    size = max(1024, 1 << int(pos_offset + L - 1).bit_length())
    return x + _pe_table(size, weight.shape[1], str(weight.device), weight.dtype)[pos_offset : pos_offset + L]


def _linear_cross_entropy_torch(x, weight, bias, target, *, label_smoothing=0.0, ignore_index=0):
    # What PyTorch users write: the logits whole, then log_softmax (our smoothing is not F.cross_entropy's)
    return reference.cross_entropy_ref(F.linear(x, weight, bias), target, label_smoothing, ignore_index)


EAGER = Ops("eager", _adapt(reference.attention_ref, check_attention, cast=3),
            _adapt(reference.add_layer_norm_ref, check_add_layer_norm), _adapt(reference.ffn_ref, check_ffn, cast=5),
            _adapt(reference.embed_ref, check_embed),
            _adapt(reference.linear_cross_entropy_ref, check_linear_cross_entropy, cast=3))
TORCH = Ops("torch", _adapt(_attention_sdpa, check_attention, cast=3),
            _adapt(_add_layer_norm_torch, check_add_layer_norm), _adapt(_ffn_torch, check_ffn, cast=5),
            _adapt(_embed_torch, check_embed), _adapt(_linear_cross_entropy_torch, check_linear_cross_entropy, cast=3))
