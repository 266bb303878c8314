"""The checks in front of every backend's ops (`scratchformer.ops`): one per op, so that all
backends accept and refuse the same calls with the same message (docs/numerics.md lists the rules).

A check that reads tensor values (lengths within [0, L], token ids within [0, V)) runs on CPU
tensors, where reading is free, and on a GPU only with SCRATCHFORMER_DEBUG=1 (`value_checks`): a
host sync per call stalls every step and breaks CUDA graphs and torch.compile.
"""

from __future__ import annotations

import math
import numbers
import operator
import os

import torch

# Read once (torch.compile guards on a global, not on the environment); tests may patch it.
DEBUG: bool = os.environ.get("SCRATCHFORMER_DEBUG", "0") == "1"

# Positions of the sinusoidal encoding: 0 .. MAX_POSITIONS - 1, the C++ op's float sinusoid accurate
# to 1e-7 there (csrc/sinusoid.h kMaxPositions, which the op checks itself); every backend refuses
# the rest, where the op's values drift and then leave [-1, 1]. (The torch backend caches its table
# only up to `ops.PE_TABLE_ROWS` and computes the rows of a later pos_offset for the call.)
MAX_POSITIONS = 2**29


def value_checks(t: torch.Tensor) -> bool:
    """Whether checks that read t's values may run: on CPU always (no device sync), on other
    devices only with SCRATCHFORMER_DEBUG=1; never inside a torch.compile trace (a graph break)."""
    return (DEBUG or t.device.type == "cpu") and not torch.compiler.is_compiling()


def _is_real(op: str, name: str, value) -> bool:
    """A Python real number (a bool and a tensor refused: `_check_number`), else a ValueError naming it;
    False inside a torch.compile trace, where a float may be symbolic and is not checked further."""
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a Python number, not a tensor (got {value!r})")
    if torch.compiler.is_compiling():
        return False
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{op}: {name} must be a number, got {value!r}")
    return True


def _check_number(op: str, name: str, value, *, positive: bool = False, nonnegative: bool = False) -> None:
    """A float argument: a real number (a bool refused, and a tensor: a backend that reads it as a float
    drops its gradient, where another differentiates through it; on a GPU the read is a host sync),
    finite (NaN and inf refused), and > 0 where `positive`, >= 0 where `nonnegative`. Not inside a
    torch.compile trace, where a float may be symbolic (math.isfinite would break the graph)."""
    if not _is_real(op, name, value):
        return
    if not math.isfinite(value) or (positive and not value > 0) or (nonnegative and not value >= 0):
        bound = " > 0" if positive else " >= 0" if nonnegative else ""
        raise ValueError(f"{op}: {name} must be a finite number{bound}, got {value}")


def _check_dropout(op: str, p) -> None:
    _is_real(op, "dropout_p", p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {p}")


def _check_tensors(op: str, optional: tuple[str, ...] = (), **tensors) -> None:
    """Each argument a tensor (those named in `optional` may be None), else a ValueError naming it:
    each op's check runs it first, before reading a shape, dtype or device."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in optional):
            raise ValueError(f"{op}: {name} must be a tensor, got {type(t).__name__}")


# the floating types every backend runs (is_floating_point() also admits the float8 types, which
# eager and torch failed on deep inside an op, and triton in its own check)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_floating(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in FLOATS:
            raise ValueError(f"{op}: {name} must be a floating-point tensor (float16, bfloat16, float32, float64), "
                             f"got {t.dtype}")


def _check_int(op: str, name: str, value) -> int:
    """An integer argument (a Python or numpy int, a bool refused): a float such as 1.5 was read as 1 by
    one backend and as 1.5 by another. A tensor is refused too, even a 0-dim one: reading it is a host
    sync on a GPU, and the torch backend failed on it (the model's CUDA-graph decoding keeps its device
    position out of the ops: `Embedding.forward` adds those positions itself). Inside a torch.compile
    trace an int may be symbolic: taken as it is."""
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a Python int, not a tensor (got {value!r}); pass int(...) of it")
    if torch.compiler.is_compiling():
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{op}: {name} must be an integer, got {value!r}") from None


def _check_bool(op: str, name: str, value) -> None:
    """A flag: True or False (a numpy or tensor bool refused too). A truthy string such as "yes" was
    taken as True by one backend and refused by torch's SDPA in another."""
    if not isinstance(value, bool):
        raise ValueError(f"{op}: {name} must be a bool, got {value!r}")


def _check_same(op: str, what: str, **tensors) -> None:
    """One `what` ("dtype": one floating-point dtype after autocast's casts; "device") for every given
    tensor (None, and what is not a tensor, skipped: named by its own check), else a ValueError naming each
    tensor's."""
    given = {name: getattr(t, what) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(given.values())) > 1:
        raise ValueError(f"{op}: {what} mismatch: " + ", ".join(f"{n} {str(d).removeprefix('torch.')}"
                                                               for n, d in given.items()))


def _check_lengths(name: str, lengths: torch.Tensor | None, B: int, L: int, device: torch.device) -> None:
    if lengths is None:
        return
    if not isinstance(lengths, torch.Tensor):
        raise ValueError(f"{name} must be an int32/int64 tensor of shape ({B},), got {type(lengths).__name__}")
    if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} must be an int32/int64 tensor of shape ({B},), got {lengths.dtype} {tuple(lengths.shape)}"
        )
    if lengths.device != device:
        raise ValueError(f"{name} is on {lengths.device} but q is on {device}")
    if B and value_checks(lengths):
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > L:
            raise ValueError(f"{name} must lie in [0, {L}] (the sequence length), got min {lo} max {hi}")


def check_attention(q, k, v, *, key_lengths=None, query_lengths=None, causal=False, dropout_p=0.0, scale=None, **_):
    _check_tensors("attention", q=q, k=k, v=v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q, k, v of shape (B, H, L, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    B, H, Lq, D = q.shape
    if D == 0:
        raise ValueError(f"attention: the head dim (q.shape[-1]) must be >= 1, got q {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(
            f"attention shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(need matching B, H, D and k.shape == v.shape)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _check_floating("attention", q=q)
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention device mismatch: q {q.device}, k {k.device}, v {v.device}")
    _check_lengths("key_lengths", key_lengths, B, k.shape[2], q.device)
    _check_lengths("query_lengths", query_lengths, B, Lq, q.device)
    _check_bool("attention", "causal", causal)
    _check_dropout("attention", dropout_p)
    if scale is not None:
        _check_number("attention", "scale", scale, nonnegative=True)  # as the kernel's (kernels/attention.py)


def check_add_layer_norm(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, return_residual=False, y_dtype=None,
                         copy_dtype=None, **_):
    _check_tensors("add_layer_norm", ("residual", "bias"), x=x, residual=residual, weight=weight, bias=bias)
    _check_floating("add_layer_norm", x=x, weight=weight, bias=bias)
    _check_same("add_layer_norm", "device", x=x, residual=residual, weight=weight, bias=bias)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"add_layer_norm: x must be (..., N) with N >= 1, got {tuple(x.shape)}")
    N = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_layer_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if weight.shape != (N,) or (bias is not None and bias.shape != (N,)):
        raise ValueError(
            f"add_layer_norm: weight/bias must be ({N},) for hidden size {N}, got "
            f"{tuple(weight.shape)} / {None if bias is None else tuple(bias.shape)}"
        )
    # one dtype, or a 16-bit x (a sublayer's autocast output) under an fp32 residual (the stream)
    if residual is not None and residual.dtype != x.dtype and not (
            residual.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(f"add_layer_norm dtype mismatch: x {x.dtype}, residual {residual.dtype} (x may be "
                         f"float16/bfloat16 under a float32 residual, else the residual's dtype)")
    stream = residual.dtype if residual is not None else x.dtype  # y's and s's
    # the parameters: the stream's dtype or fp32 (a bf16 activation normalised with fp32 gains), one for both
    if weight.dtype not in (stream, torch.float32) or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"add_layer_norm: weight and bias must share one dtype, the stream's ({stream}: residual's, "
                         f"else x's) or float32, got {weight.dtype} / {None if bias is None else bias.dtype}")
    for name, dtype in (("y_dtype", y_dtype), ("copy_dtype", copy_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"add_layer_norm: {name} must be None or a floating-point torch.dtype, got {dtype!r}")
    _check_bool("add_layer_norm", "return_residual", return_residual)
    _check_number("add_layer_norm", "eps", eps, positive=True)
    _check_dropout("add_layer_norm", dropout_p)


def check_ffn(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, **_):
    if activation not in ("relu", "gelu"):
        raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
    _check_tensors("ffn", ("b1", "b2"), x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_floating("ffn", x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_same("ffn", "dtype", x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_same("ffn", "device", x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    d_model = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != d_model or w2.shape != (d_model, w1.shape[0]):
        raise ValueError(
            f"ffn shape mismatch: x (..., {d_model}), w1 {tuple(w1.shape)} (want (d_ff, {d_model})), "
            f"w2 {tuple(w2.shape)} (want ({d_model}, d_ff))"
        )
    for name, b, n, dim in (("b1", b1, w1.shape[0], "d_ff"), ("b2", b2, d_model, "d_model")):
        if b is not None and b.shape != (n,):
            raise ValueError(f"ffn: {name} must have shape ({n},) ({dim}), got {tuple(b.shape)}")
    _check_dropout("ffn", dropout_p)


def check_embed(tokens, weight, *, scale=1.0, pos_offset=0, pos_encoding=True, **_):
    _check_tensors("embed", tokens=tokens, weight=weight)
    if tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embed: tokens must be int32 or int64, got {tokens.dtype}")
    if tokens.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"embed: tokens must be (B, L) and weight (V, d_model), got {tuple(tokens.shape)} and "
                         f"{tuple(weight.shape)}")
    _check_floating("embed", weight=weight)
    if tokens.device != weight.device:
        raise ValueError(f"embed: tokens on {tokens.device} but weight on {weight.device}")
    _check_bool("embed", "pos_encoding", pos_encoding)
    if _check_int("embed", "pos_offset", pos_offset) < 0:
        raise ValueError(f"embed: pos_offset must be >= 0, got {pos_offset}")
    if pos_encoding and not torch.compiler.is_compiling() and pos_offset + tokens.shape[1] > MAX_POSITIONS:
        raise ValueError(f"embed: positions must be below {MAX_POSITIONS} (2^29, where the C++ op's float "
                         f"sinusoid stops being accurate), got pos_offset {pos_offset} and L {tokens.shape[1]}")
    _check_number("embed", "scale", scale)
    if pos_encoding and weight.shape[1] % 2:
        raise ValueError(f"embed: d_model must be even for the sinusoidal positions, got {weight.shape[1]}")
    V = weight.shape[0]
    if value_checks(tokens) and tokens.numel():  # no read (and no guard) under torch.compile
        bad = (tokens < 0) | (tokens >= V)
        if bool(bad.any()):
            where = tuple(bad.nonzero()[0].tolist())
            raise ValueError(f"embed: token id {int(tokens[where])} at {where} is out of range [0, {V}) "
                             f"(vocabulary size {V})")


def check_linear_cross_entropy(x, weight, bias, target, *, label_smoothing=0.0, ignore_index=0, **_):
    _check_tensors("linear_cross_entropy", ("bias",), x=x, weight=weight, bias=bias)
    _check_floating("linear_cross_entropy", x=x, weight=weight, bias=bias)
    _check_same("linear_cross_entropy", "dtype", x=x, weight=weight, bias=bias)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x must be (N, d) and weight (V, d), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    V = weight.shape[0]
    if bias is not None and bias.shape != (V,):
        raise ValueError(f"linear_cross_entropy: bias must be ({V},) (V), got {tuple(bias.shape)}")
    _check_same("linear_cross_entropy", "device", x=x, weight=weight, bias=bias, target=target)
    check_targets("linear_cross_entropy", target, x.shape[0], V, label_smoothing, ignore_index)


def check_targets(op: str, target, rows: int, V: int, label_smoothing, ignore_index) -> None:
    """A loss's targets over V classes: int64 (rows,) ids in [0, V), a label smoothing in [0, 1) and an
    ignore_index that is a class; `linear_cross_entropy`'s, and the copy layer's loss (`Transformer.forward`)."""
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or target.shape != (rows,):
        got = f"{target.dtype} {tuple(target.shape)}" if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{op}: target must be int64 of shape ({rows},), got {got}")
    _is_real(op, "label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing < 1.0 or (label_smoothing > 0.0 and V < 3):
        raise ValueError(f"{op}: label_smoothing must be in [0, 1) (and needs V >= 3 when > 0), "
                         f"got {label_smoothing} with V = {V}")
    if not 0 <= _check_int(op, "ignore_index", ignore_index) < V:
        raise ValueError(f"{op}: ignore_index {ignore_index} is not a class of [0, {V})")
    if value_checks(target) and target.numel():
        lo, hi = int(target.min()), int(target.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"{op}: target ids must lie in [0, {V}), got min {lo} max {hi}")
