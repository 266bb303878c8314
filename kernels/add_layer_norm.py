"""Fused (dropout +) residual add + LayerNorm, forward and backward, in Triton.

Forward, per row of N features (statistics in fp32 whatever the storage dtype):

    x' = dropout(x) = x · keep / (1 - p)        keep ~ Bernoulli(1 - p), in-kernel Philox
    s  = round(x' + residual)                   summed in fp32, rounded once to the stream's
                                                dtype (residual's, else x's): the Pre-LN
                                                residual stream, returned on request
    mean = s₀ + Σ (s - s₀) / N                  shifted by the row's first value s₀: exact for
                                                a constant row, however large
    var = Σ (s - mean)² / N,   rstd = 1 / sqrt(var + eps)
    x̂ = (s - mean) · rstd,   y = x̂ · w + b

Dtype contract (docs/numerics.md): x and residual share a dtype, or x is float16/bfloat16 under
a float32 residual (a sublayer's autocast output added to the fp32 stream: read as it is, where a
cast to fp32 first cost a kernel and its bytes each way). The norm normalises s exactly as it is
stored and returned (the stream's dtype; y has it too unless asked otherwise; dx has x's), as
`F.layer_norm(x + residual)` does in PyTorch and as the Mamba/flash-attention unfused paths do;
the backward rebuilds x̂ from that saved s with the saved fp32 mean and rstd, so forward and
backward see the same x̂ bit for bit. (Normalising the unrounded fp32 sum while
saving the rounded one made the backward's x̂ differ by an ulp of s times rstd, up to
1/sqrt(eps): fp16 x = 1, residual = 4e-4, N = 1 gave dx = -5.06 instead of 0.)

The next sublayer's input in its matmuls' dtype (an autocast model's fp32 stream feeding bf16
matmuls, which would cast y in a kernel of its own, and its gradient back in another): y_dtype
stores y in that dtype (Pre-LN, where y feeds only the sublayer); copy_dtype stores a second copy
of y in it beside y (Post-LN, where y is also the stream), whose gradient the backward adds to
y's in fp32 as it loads them (autograd added the cast's gradient to y's in a kernel of its own).
Both are the fp32 y rounded once: the values of the casts they replace, bit for bit on a GPU.

Backward (tutorial 05's derivation), with g = dy · w the gradient reaching x̂:

    c1 = Σ x̂ · g / N,   c2 = Σ g / N
    ds_total = rstd · (g - (x̂ · c1 + c2)) + ds_out    (ds_out: the gradient of the returned s)
    dresidual = ds_total,   dx = ds_total · keep / (1 - p)
    dw = Σ_rows dy · x̂,    db = Σ_rows dy

dx (and dresidual) come from one pass over the rows; dw and db are a deterministic two-stage
reduction: each backward program owns a block of rows and writes its partial sums to one row of
an (n_programs, N) fp32 buffer, then one more launch sums both buffers over programs in a fixed
order and casts them (`partial_sums.py`; no atomics).

Both kernels work on (BLOCK_M, BLOCK_N) tiles of BLOCK_M whole rows (`_block_m`): one row on a
GPU from 512 columns up, several for narrower rows, and in Triton's interpreter, which pays per
program and per op rather than per element, up to 16k elements at once (a tiny model's training
step went from 86 s to 5 s of add+LayerNorm there). A row's arithmetic is the same at any BLOCK_M.
On a GPU with autotuning on (`SCRATCHFORMER_AUTOTUNE`, the default) both kernels' rows per
iteration and warps are tuned per N among `_block_m`'s choice and tiles of 2-16 rows
(`TILE_CONFIGS`). The forward's tuning took it to 0.97-1.05 of the copy bandwidth at every N on an
H100 (device time, 2026-11-26 fourth window; torch.compile's fused add+LayerNorm, whose persistent
reductions give a program several rows at small N, had beaten the untuned one at every N); the
backward, untuned then, reached 0.54-0.79, at N 512 on 4 programs of 1 row and 2 warps per SM:
too few warps in flight to hide its loads, which its tuning targets. Tuned (sixth window) it
measured the same within 2%: the tuner found no tile better than the heuristic's. Multi-row tiles
had paid a cross-warp reduction of dw and db every iteration; they now accumulate per tile
element and reduce once per program. And as a program's row loop is a serial chain (load, two row
sums, store), the tuner also races it software-pipelined (`LOOP_STAGES` 2 and 3: the next row
blocks' loads issued before this block's arithmetic, their data in shared memory, at most
`MAX_PIPELINE_BYTES`). The eighth window (2026-11-27) measured it: the tuner chose 3 deep at N
512-4096 (1 at 8192), the backward alone at 0.48-0.90 of the copy bandwidth, fwd+bwd 4-26% faster
than the sixth window's at N 512-1024; the pinned launch now pipelines as the tuner chose, and up to
512 columns takes the tuner's tile at N 512 too (`_bwd_tile`: 8 warps over 1,024 values).

The forward saves s (in x's dtype: the very values it normalised), mean and rstd (fp32). The
dropout mask is not stored: the backward replays it from the same Philox counters, offset + row ·
N + col, with the (seed, offset) both kernels load from one int64[2] tensor in device memory
(`rng_ptr`, drawn on the device per call by `_common.dropout_rng`: a CUDA graph replay or a
compiled call draws afresh).

Limits: 1 <= N <= 16384 (a whole row lives in one tile, BLOCK_N = next_power_of_2(N)); any
number of rows and leading dims; float32/float16/bfloat16 inputs; weight and bias in x's dtype
or float32. Rows may be strided (a row-stride argument); a last dim that is not contiguous is
copied once by the launcher (`.contiguous()`), not rejected.

Torch ops (registration section): `scratchformer::add_layer_norm(x, residual?, weight, bias?, eps,
dropout_p, rng?, store_s, y_dtype?, copy_dtype?) -> (y, s, mean, rstd, copy)` (s = dropout(x) +
residual is a fresh output, empty unless store_s; mean/rstd are saved for the backward, not
differentiable; copy is empty without copy_dtype) and `scratchformer::add_layer_norm_backward(dy,
dy_copy?, ds?, ...)` -> (dx, dresidual, dweight, dbias).
Linked by one autograd (`_setup_context` + `_backward`, registered on the op and as
`AddLayerNormFunction`), which saves rng (the (2,) int64 [seed, offset] tensor; None without
dropout) for the backward (how they are registered, and why: `kernels/_common.py`).

References: Triton tutorial 05 (layer norm), flash-attention `ops/triton/layer_norm.py`,
Liger-Kernel `ops/layer_norm.py`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._common import (
    AUTOTUNE,
    INTERPRET,
    NONE_SHAPE,
    SUPPORTED_DTYPES,
    apply_dropout,
    call_op,
    cdiv,
    check_device,
    check_dropout,
    check_dtype,
    check_flag,
    check_number,
    check_tensors,
    define_op,
    dropout_keep,
    dropout_rng,
    launch_pinned,
    launch_tuned,
    load_dropout_rng,
    next_pow2,
    op_autograd,
    or_empty,
)
from .partial_sums import sum_partials

MAX_N = 16384


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # N (fixed) keeps its alignment
def _add_layer_norm_fwd_kernel(
    x_ptr,  # (M, N) input, row stride stride_x_row; its dtype, or a 16-bit one under an fp32 residual
    residual_ptr,  # (M, N) residual, or a dummy when HAS_RESIDUAL is False
    weight_ptr,  # (N,)
    bias_ptr,  # (N,) or dummy
    y_ptr,  # (M, N) output, contiguous, its own dtype (the stream's unless asked otherwise)
    copy_ptr,  # (M, N) y again in another dtype (the next sublayer's autocast one), written if STORE_COPY
    s_ptr,  # (M, N) pre-norm sum dropout(x) + residual, contiguous, the stream's dtype; written if STORE_S
    mean_ptr,  # (M,) fp32
    rstd_ptr,  # (M,) fp32
    mask_ptr,  # (M, N) int8 keep mask, written if STORE_MASK (debug path)
    stride_x_row,
    stride_res_row,
    M,  # rows
    N,  # hidden size
    eps,
    dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, offset] (read if HAS_DROPOUT): (row, col) uses offset + row * N + col
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_S: tl.constexpr,
    STORE_MASK: tl.constexpr,
    STORE_COPY: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program (_block_m)
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    in_row = col_ok[None, :]
    row_ok = rows < M
    ok = row_ok[:, None] & in_row  # (BLOCK_M, BLOCK_N)
    at = rows[:, None] * N + cols[None, :]  # contiguous outputs
    s = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        s, keep = apply_dropout(s, rng_ptr, rows[:, None], cols[None, :], N, dropout_p)
        if STORE_MASK:
            tl.store(mask_ptr + at, keep.to(tl.int8), mask=ok)
    if HAS_RESIDUAL:
        s += tl.load(residual_ptr + rows[:, None] * stride_res_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    # The norm's input is s as stored and returned, in the stream's dtype (residual's, else x's):
    # one rounding (a no-op for fp32), so the backward rebuilds from the saved s exactly the x̂
    # that made y.
    if HAS_RESIDUAL:
        s = s.to(residual_ptr.dtype.element_ty).to(tl.float32)
    else:
        s = s.to(x_ptr.dtype.element_ty).to(tl.float32)
    if STORE_S:
        tl.store(s_ptr + at, s.to(s_ptr.dtype.element_ty), mask=ok)
    # Mean shifted by each row's first value (exact for a constant row at any magnitude), then the
    # variance of the centred values (two passes, never E[s²] - mean²).
    shift = tl.sum(tl.where(cols[None, :] == 0, s, 0.0), axis=1)
    mean = shift + tl.sum(tl.where(in_row, s - shift[:, None], 0.0), axis=1) / N
    d = tl.where(in_row, s - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=ok)
    if STORE_COPY:  # rounded from the fp32 y, as a cast of an fp32 y would round it
        tl.store(copy_ptr + at, y.to(copy_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _add_layer_norm_bwd_kernel(
    dy_ptr,  # (M, N) gradient of y, row stride stride_dy_row
    dy_copy_ptr,  # (M, N) gradient of y's copy, row stride stride_dyc_row, or dummy when HAS_DY_COPY is False
    ds_out_ptr,  # (M, N) gradient of the returned s, or dummy when HAS_DS is False
    s_ptr,  # (M, N) saved pre-norm sum, contiguous
    weight_ptr,  # (N,)
    mean_ptr,  # (M,) fp32
    rstd_ptr,  # (M,) fp32
    dx_ptr,  # (M, N) gradient of x, contiguous, x's dtype
    dres_ptr,  # (M, N) gradient of residual (= ds_total), s's dtype, written if STORE_DRES
    dw_partial_ptr,  # (n_programs, N) fp32 partial Σ dy · x̂ of this program's rows
    db_partial_ptr,  # (n_programs, N) fp32 partial Σ dy, written if HAS_BIAS
    stride_dy_row,
    stride_dyc_row,
    stride_ds_row,
    M,  # rows
    N,  # hidden size
    rows_per_program,
    dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, offset], the forward's (read if HAS_DROPOUT)
    HAS_DY_COPY: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_DRES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per loop iteration (_block_m, or tuned)
    BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr,  # row blocks in flight: > 1 software-pipelines the loop's loads (tuned)
):
    pid = tl.program_id(0)
    rows_per_program = tl.cdiv(rows_per_program, BLOCK_M) * BLOCK_M  # whole row blocks (a program may get none)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    in_row = col_ok[None, :]
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # dw, db accumulate per element of the tile and are summed over its rows once, after the loop:
    # a sum over rows every iteration would be a cross-warp reduction (shared memory and a
    # barrier) per BLOCK_M rows whenever the tile's rows span warps
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    seed, rng_offset = load_dropout_rng(rng_ptr, HAS_DROPOUT)  # once, outside the row loop
    # BLOCK_M rows at a time. A program's rows are a chain of load -> two row sums -> store; with
    # LOOP_STAGES > 1 the compiler issues the loads of the next LOOP_STAGES - 1 row blocks before
    # this one's arithmetic (`tl.range`'s num_stages pipelines every load of the loop, not only
    # those feeding a tl.dot), so more bytes are in flight per program than one block's
    for start in tl.range(row_start, row_end, BLOCK_M, num_stages=LOOP_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        ok = row_ok[:, None] & in_row
        at = rows[:, None] * N + cols[None, :]  # contiguous s, dx, dres
        s = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(ok, (s - mean) * rstd, 0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_DY_COPY:  # y and its copy are one value: their gradients add up (in fp32, as autograd's would)
            dy += tl.load(dy_copy_ptr + rows[:, None] * stride_dyc_row + cols[None, :], mask=ok, other=0.0).to(
                tl.float32
            )
        g = dy * w  # dL/dx̂, zero outside the rows
        c1 = tl.sum(xhat * g, axis=1)[:, None] / N
        c2 = tl.sum(g, axis=1)[:, None] / N
        ds = (g - (xhat * c1 + c2)) * rstd
        if HAS_DS:
            ds += tl.load(ds_out_ptr + rows[:, None] * stride_ds_row + cols[None, :], mask=ok, other=0.0).to(
                tl.float32
            )
        if STORE_DRES:
            tl.store(dres_ptr + at, ds.to(dres_ptr.dtype.element_ty), mask=ok)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_offset, rows[:, None], cols[None, :], N, dropout_p)  # the forward's mask
            ds = tl.where(keep, ds / (1.0 - dropout_p), 0.0)
        tl.store(dx_ptr + at, ds.to(dx_ptr.dtype.element_ty), mask=ok)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(dw_partial_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


# The (BLOCK_M rows, warps) candidates of both kernels on a GPU when autotuning (module docstring):
# per launch, `_block_m`'s own choice, then those of the list whose tile holds at most
# `max_values` fp32 values (the forward 8k, 32 a thread at 8 warps: 16 rows of 1024 took all 255
# registers in the sm_90 compile check; the backward, with about twice the live tiles, 4k) and
# at least 4 a thread.
TILE_CONFIGS = [triton.Config({"BLOCK_M": bm}, num_warps=w)
                for bm, w in ((1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (16, 8))]
# The backward's: each tile with its row loop unpipelined (1) and pipelined 2 and 3 deep (the sixth
# window's tuned backward, tiles only, measured the same as the heuristic's one row a program: its
# loop's serial load -> reduce -> store chain, not the tile, looked the limit). The eighth window's
# tuner (H100, bf16, 16k and 64k rows) chose 3 at N 512-4096 and 1 at 8192, and its fwd+bwd ran 4-26%
# faster at N 512-1024 than the sixth's unpipelined one: the pinned launch's depth follows that
# (`_loop_stages`), and the tuner tries it first.
LOOP_STAGE_CHOICES = (1, 2, 3)
PIPELINED_UP_TO_N = 4096
# The backward's wide tile, one row at 16 warps (Liger-Kernel's LayerNorm takes 16 warps from 8,192
# columns), offered where the tiles' bound scaled by warps / 8 holds it: 2,048 to 8,192 columns. At N
# 8192 the backward's only other tile, one row at 8 warps, takes all 255 registers (sm_90, Triton
# 3.6: dw and db accumulate per tile element, about 8 live arrays of 32 values a thread), so one
# 8-warp program is resident an SM, where the eighth window measured 0.76-0.82 of the copy bandwidth;
# at 16 warps it takes 97 registers, 16 warps an SM (`tools/compile_check.py` reports each tile's).
BWD_WIDE_TILES = [triton.Config({"BLOCK_M": 1}, num_warps=16)]
BWD_TILE_CONFIGS = [triton.Config({**c.kwargs, "LOOP_STAGES": st}, num_warps=c.num_warps)
                    for c in TILE_CONFIGS + BWD_WIDE_TILES for st in LOOP_STAGE_CHOICES]


def _pruner(rows_arg: str, max_values: int, pipelined: bool = False):
    """The Autotuner's early_config_prune for a kernel whose row count is its argument rows_arg:
    the pinned launch's own tile first (`_fwd_tile`, or `_bwd_tile` for the pipelined backward, at
    `_loop_stages`' depth, then at the others), then the other tiles that fit: at least 4 values a
    thread, at most max_values a tile (more for tiles of over 8 warps, as many a thread as at 8)
    (and, pipelined, whose loads in flight fit `MAX_PIPELINE_BYTES`)."""
    def prune(configs, nargs, **kwargs):
        block_n = kwargs["BLOCK_N"]
        bm, warps = (_bwd_tile if pipelined else _fwd_tile)(nargs[rows_arg], block_n)
        kept = [c for c in configs
                if 128 * c.num_warps <= c.kwargs["BLOCK_M"] * block_n <= max_values * max(1, c.num_warps // 8)
                and (c.kwargs["BLOCK_M"], c.num_warps) != (bm, warps)]
        if not pipelined:
            return [triton.Config({"BLOCK_M": bm}, num_warps=warps)] + kept
        row_bytes = _loaded_bytes(nargs["dy_ptr"], nargs["s_ptr"], nargs["ds_out_ptr"] if kwargs["HAS_DS"] else None,
                                  nargs["dy_copy_ptr"] if kwargs["HAS_DY_COPY"] else None)
        pinned = _loop_stages(bm, block_n, row_bytes)
        depths = sorted(LOOP_STAGE_CHOICES, key=lambda st: st != pinned)
        own = [triton.Config({"BLOCK_M": bm, "LOOP_STAGES": st}, num_warps=warps) for st in depths]
        in_flight = lambda c: _pipeline_bytes(c.kwargs["LOOP_STAGES"], c.kwargs["BLOCK_M"], block_n, row_bytes)  # noqa: E731
        return [c for c in own + kept if in_flight(c) <= MAX_PIPELINE_BYTES]
    return prune


# Shared memory a pipelined backward may take for its loads in flight: with its reduction scratch
# (up to 8 KiB), 4 programs still fit an H100 SM's 227 KiB, the 4 an SM gets (`_bwd_programs`).
MAX_PIPELINE_BYTES = 48 << 10


def _loaded_bytes(*loaded) -> int:
    """Bytes a backward's row loop loads per element: of dy, s, and ds_out and dy's copy's gradient
    where given (None where not)."""
    return sum(t.element_size() for t in loaded if t is not None)


def _pipeline_bytes(stages: int, block_m: int, block_n: int, loaded_bytes: int) -> int:
    """Shared memory of the backward's pipelined loads: stages - 1 row blocks ahead, each of the
    loaded tensors (`_loaded_bytes`; as sm_90 compiles it: 24,612 B at N 4096, bf16, 2 stages)."""
    return (stages - 1) * block_m * block_n * loaded_bytes


def _loop_stages(block_m: int, block_n: int, loaded_bytes: int) -> int:
    """The pinned backward's loop depth (SCRATCHFORMER_AUTOTUNE=0, and the tuner's first candidate):
    the deepest whose loads in flight fit MAX_PIPELINE_BYTES up to PIPELINED_UP_TO_N columns (3 at
    every N up to 4096 with one row a program), unpipelined beyond, as the eighth window's tuner chose."""
    if block_n > PIPELINED_UP_TO_N:
        return 1
    return max(st for st in LOOP_STAGE_CHOICES
               if _pipeline_bytes(st, block_m, block_n, loaded_bytes) <= MAX_PIPELINE_BYTES)


_prune_fwd = _pruner("M", 1 << 13)
_prune_bwd = _pruner("rows_per_program", 1 << 12, pipelined=True)
_add_layer_norm_fwd_tuned = triton.autotune(
    TILE_CONFIGS, key=["N"], prune_configs_by={"early_config_prune": _prune_fwd},
)(_add_layer_norm_fwd_kernel)
_add_layer_norm_bwd_tuned = triton.autotune(
    BWD_TILE_CONFIGS, key=["N"], prune_configs_by={"early_config_prune": _prune_bwd},
)(_add_layer_norm_bwd_kernel)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    """(..., N) -> (M, N) with a free row stride; a non-unit last-dim stride is copied."""
    t2 = t.reshape(-1, N)
    return t2 if t2.stride(-1) == 1 or N == 1 else t2.contiguous()


def _num_warps(block_m: int, block_n: int) -> int:
    return min(max(block_m * block_n // 256, 1), 8)


def _fwd_tile(rows: int, block_n: int) -> tuple[int, int]:
    """The pinned forward's (BLOCK_M, warps): `_block_m`'s rows at a warp per 256 values."""
    bm = _block_m(rows, block_n)
    return bm, _num_warps(bm, block_n)


# The pinned backward's tile up to 512 columns (SCRATCHFORMER_AUTOTUNE=0: the recipes' training, the
# tests): 8 warps over 1,024 values, the eighth window's tuned pick at N 512 (2 rows, 8 warps; H100,
# 16k and 64k rows). The forward's rule gave one row and 2 warps there: with the 4 programs an SM gets
# (`_bwd_programs`), 8 warps an SM in flight, too few to hide the row loop's loads (the sixth window's
# 0.54 of the copy bandwidth); 2 rows at 8 warps take 55 registers a thread (sm_90 compile, 3 deep),
# so all 4 programs stay resident: 32 warps. From 1,024 columns the forward's rule, as tuned there.
BWD_NARROW_VALUES = 1024
BWD_NARROW_WARPS = 8


def _bwd_tile(rows: int, block_n: int) -> tuple[int, int]:
    """The pinned backward's (BLOCK_M, warps) for programs of `rows` rows (see above)."""
    if INTERPRET or block_n > BWD_NARROW_VALUES // 2:
        return _fwd_tile(rows, block_n)
    return max(1, min(BWD_NARROW_VALUES // block_n, next_pow2(max(rows, 1)))), BWD_NARROW_WARPS


def _block_m(rows: int, block_n: int) -> int:
    """Rows a program handles at once (a (BLOCK_M, BLOCK_N) tile). On a GPU one row, as tuned for
    hidden sizes of 512 and up, and for narrower rows as many as fill 512 columns (a 32-wide row
    alone would leave most of a warp idle). In the interpreter, whose cost is per program and per
    op, not per element, up to 16k elements: the whole (rows, N) block of a test at once."""
    budget = 1 << 14 if INTERPRET else 512
    return max(1, min(budget // block_n, next_pow2(max(rows, 1))))


def _check_inputs(x, residual, weight, bias, eps, dropout_p, y_dtype=None, copy_dtype=None, seed=None):
    check_tensors("add_layer_norm", ("residual", "bias"), x=x, residual=residual, weight=weight, bias=bias)
    _check_device_dtype(x, residual, weight, bias)
    _check_out_dtypes(y_dtype, copy_dtype)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"add_layer_norm: x must be (..., N) with N >= 1, got {tuple(x.shape)}")
    N = x.shape[-1]
    _check_width(N)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (N,):
            raise ValueError(f"add_layer_norm: {name} must have shape ({N},) for hidden size {N}, got {tuple(p.shape)}")
        if p.dtype not in (stream_dtype(x, residual), torch.float32):
            raise ValueError(f"add_layer_norm: {name} dtype must be {stream_dtype(x, residual)} (the stream's: "
                             f"residual's, else x's) or float32, got {p.dtype}")
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"add_layer_norm: weight {weight.dtype} and bias {bias.dtype} dtypes differ")
    _check_eps(eps)
    check_dropout("add_layer_norm", dropout_p, seed)


def check_limits(x, residual, weight, bias, eps=1e-5, *, y_dtype=None, copy_dtype=None, **_):
    """What only this kernel refuses of the calls the backend-wide check
    (`op_checks.check_add_layer_norm`, which `scratchformer.ops` runs first) passes: devices,
    dtypes, widths and (inside a torch.compile trace, where that check leaves it) eps, in
    `add_layer_norm`'s order and with its messages. `add_layer_norm_trusted` after both is
    `add_layer_norm`, its inputs checked once."""
    _check_device_dtype(x, residual, weight, bias)
    _check_out_dtypes(y_dtype, copy_dtype)
    _check_width(x.shape[-1])
    _check_eps(eps)


def _check_device_dtype(x, residual, weight, bias):
    check_device("add_layer_norm", x, residual, weight, bias)
    check_dtype("add_layer_norm", x)
    if residual is not None and residual.dtype != x.dtype:  # an fp32 stream may take a 16-bit x; nothing else
        check_dtype("add_layer_norm", residual)
        if not (residual.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
            raise ValueError(f"add_layer_norm: dtype mismatch: x {x.dtype}, residual {residual.dtype} (x may be "
                             f"float16/bfloat16 under a float32 residual, else the residual's dtype)")


def _check_out_dtypes(y_dtype, copy_dtype):
    for name, dtype in (("y_dtype", y_dtype), ("copy_dtype", copy_dtype)):
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"add_layer_norm: {name} must be None, torch.float32, torch.float16 or torch.bfloat16, "
                             f"got {dtype!r}")


def stream_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype of y and s: the residual stream's (residual's), else x's."""
    return residual.dtype if residual is not None else x.dtype


def _check_width(N):
    if N > MAX_N:
        raise ValueError(f"add_layer_norm: hidden size N must be <= {MAX_N} (a whole row per tile), got {N}")


def _check_eps(eps):
    check_number("add_layer_norm", "eps", eps)
    if not 0.0 < eps < math.inf:  # NaN fails too; inf made every row 0 (as op_checks refuses it)
        raise ValueError(f"add_layer_norm: eps must be > 0 and finite, got {eps}")


def add_layer_norm_fwd(
    x, residual, weight, bias, eps=1e-5, dropout_p=0.0, rng=None, *, store_s=True, store_mask=False, y_dtype=None,
    copy_dtype=None,
):
    """Launch the forward. x, residual (..., N); rng the (2,) int64 [seed, offset] tensor on x's
    device (`dropout_rng`), needed when dropout_p > 0. Returns y (x's shape, in y_dtype, None for
    the stream's: `stream_dtype`), s (x's shape, the stream's dtype; None unless store_s), mean,
    rstd ((M,) fp32), the bool keep mask (None unless store_mask) and y's copy in copy_dtype (None
    unless asked). Trusts its inputs as `add_layer_norm` checked them."""
    N = x.shape[-1]
    shape = (*x.shape,)  # a tuple: torch (2.13) parses a torch.Size argument 0.5-1 us slower
    x2 = _rows(x, N)
    res2 = _rows(residual, N) if residual is not None else x2
    M = x2.shape[0]
    weight, bias = weight.contiguous(), bias.contiguous() if bias is not None else None
    stream = stream_dtype(x, residual)
    y = x.new_empty(shape, dtype=y_dtype or stream)  # x's shape, contiguous: the (M, N) rows the kernel writes
    copy = x.new_empty(shape, dtype=copy_dtype) if copy_dtype is not None else None
    s = x.new_empty(shape, dtype=stream) if store_s else None
    mean = x.new_empty(M, dtype=torch.float32)
    rstd = x.new_empty(M, dtype=torch.float32)
    has_dropout = dropout_p > 0.0
    mask = x.new_empty(shape, dtype=torch.int8) if (store_mask and has_dropout) else None
    BLOCK_N = next_pow2(N)
    if M > 0:
        args = (x2, res2, weight, bias if bias is not None else weight, y, copy if copy is not None else y,
                s if s is not None else y, mean, rstd, mask if mask is not None else y,
                x2.stride(0), res2.stride(0), M, N, eps, dropout_p, rng if has_dropout else mean)
        flags = dict(HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=has_dropout,
                     STORE_S=store_s, STORE_MASK=mask is not None, STORE_COPY=copy is not None, BLOCK_N=BLOCK_N)
        if AUTOTUNE and not INTERPRET:  # the Autotuner's key: N and the dtypes (rng's, mask's and the copy's too)
            launch_tuned(_add_layer_norm_fwd_tuned, lambda meta: (cdiv(M, meta["BLOCK_M"]),),
                         (N, x.dtype, stream, y.dtype, weight.dtype, has_dropout, mask is not None, copy_dtype),
                         *args, **flags)
        else:
            BLOCK_M, warps = _fwd_tile(M, BLOCK_N)
            launch_pinned(_add_layer_norm_fwd_kernel, (cdiv(M, BLOCK_M),), dict(BLOCK_M=BLOCK_M, num_warps=warps),
                          *args, **flags)
    if store_mask and mask is None:  # dropout_p == 0: everything is kept
        mask = torch.ones(shape, dtype=torch.int8, device=x.device)
    return y, s, mean, rstd, mask.bool() if mask is not None else None, copy


def _bwd_programs(M: int, device: torch.device) -> int:
    """How many programs split the rows: a few per SM on a GPU, a handful in the interpreter."""
    return max(1, min(M, 4 * _sm_count(device) if device.type == "cuda" else 4))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The GPU's SM count, read once per device (a properties lookup each backward call otherwise)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def add_layer_norm_bwd(
    dy, ds_out, s, weight, mean, rstd, *, has_bias, dropout_p=0.0, rng=None, store_dres=False, dx_dtype=None,
    dy_copy=None,
):
    """Launch the backward. dy, ds_out (None allowed), s (..., N); dy_copy (None allowed) the
    gradient of y's copy, added to dy's; rng the forward's (its mask is replayed). Returns dx (in
    dx_dtype, x's: None for s's), dres (s's dtype; None unless store_dres, or when it equals dx:
    dropout_p == 0 and one dtype), dweight (weight's dtype), dbias (or None)."""
    N = s.shape[-1]
    shape = (*s.shape,)  # a tuple, as the forward's
    s2 = s.reshape(-1, N)
    weight = weight.contiguous()
    M = s2.shape[0]
    dy2 = _rows(dy, N)
    dyc2 = _rows(dy_copy, N) if dy_copy is not None else dy2
    ds2 = _rows(ds_out, N) if ds_out is not None else dy2
    has_dropout = dropout_p > 0.0
    dx = s.new_empty(shape, dtype=dx_dtype or s.dtype)  # s's shape, contiguous (as the forward's y)
    store_dres = store_dres and (has_dropout or dx.dtype != s.dtype)  # else dres == dx: the caller reuses dx
    dres = s.new_empty(shape) if store_dres else None
    BLOCK_N = next_pow2(N)
    n_programs = _bwd_programs(M, s.device) if M > 0 else 1
    rows_per_program = cdiv(M, n_programs)  # the kernel rounds it up to whole BLOCK_M blocks
    partial = s.new_empty if M > 0 else s.new_zeros  # every program writes its whole row (none run if M == 0)
    dw_partial = partial((n_programs, N), dtype=torch.float32)
    db_partial = partial((n_programs, N), dtype=torch.float32) if has_bias else None
    if M > 0:
        args = (dy2, dyc2, ds2, s2, weight, mean, rstd, dx, dres if dres is not None else dx,
                dw_partial, db_partial if db_partial is not None else dw_partial,
                dy2.stride(0), dyc2.stride(0), ds2.stride(0), M, N, rows_per_program, dropout_p,
                rng if has_dropout else mean)
        flags = dict(HAS_DY_COPY=dy_copy is not None, HAS_DS=ds_out is not None, HAS_DROPOUT=has_dropout,
                     STORE_DRES=store_dres, HAS_BIAS=has_bias, BLOCK_N=BLOCK_N)
        if AUTOTUNE and not INTERPRET:  # as the forward's; the key: N, the dtypes and the flags
            launch_tuned(_add_layer_norm_bwd_tuned, (n_programs,),
                         (N, s.dtype, dy2.dtype, dyc2.dtype, dx.dtype, weight.dtype, *flags.values()), *args,
                         **flags)
        else:
            BLOCK_M, warps = _bwd_tile(rows_per_program, BLOCK_N)
            stages = _loop_stages(BLOCK_M, BLOCK_N, _loaded_bytes(dy2, s2, ds_out, dy_copy))
            launch_pinned(_add_layer_norm_bwd_kernel, (n_programs,),
                          dict(BLOCK_M=BLOCK_M, LOOP_STAGES=stages, num_warps=warps), *args, **flags)
    dw, db = sum_partials(dw_partial, db_partial, weight.dtype)  # second stage: one launch, a fixed order
    return dx, dres, dw, db


# ---------------------------------------------------------------------------------------------
# torch ops: scratchformer::add_layer_norm and scratchformer::add_layer_norm_backward, and the
# autograd.Function linking them (why ops, and why autograd outside them: kernels/_common.py).
# The launchers do host-side work (row views, the two-stage dw/db reduction, a per-device program
# count) that an opaque op keeps out of the traced graph. The op is opaque to torch.compile and to
# autocast (the caller casts). Outputs never alias inputs: s is a fresh buffer even when residual
# is None and dropout_p is 0.
# ---------------------------------------------------------------------------------------------

@define_op(
    "add_layer_norm",
    "(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, float dropout_p, Tensor? rng, "
    "bool store_s, ScalarType? y_dtype, ScalarType? copy_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _add_layer_norm_op(x, residual, weight, bias, eps, dropout_p, rng, store_s, y_dtype, copy_dtype):
    """(y, s, mean, rstd, copy): y in x's shape and y_dtype (None: the stream's, `stream_dtype`),
    s = dropout(x) + residual in x's shape and the stream's dtype (empty (0,) unless store_s),
    mean and rstd (M,) fp32 over the M = x.numel() / N rows, copy y again in copy_dtype (empty (0,)
    without one). Dropout is a pure function of rng's (seed, offset) (a (2,) int64 tensor on x's
    device; None without dropout)."""
    y, s, mean, rstd, _, copy = add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, rng, store_s=store_s,
                                                   y_dtype=y_dtype, copy_dtype=copy_dtype)
    if s is None:
        s = x.new_empty(NONE_SHAPE, dtype=stream_dtype(x, residual))
    return y, s, mean, rstd, or_empty(copy, y)


@torch.library.register_fake(_add_layer_norm_op)
def _(x, residual, weight, bias, eps, dropout_p, rng, store_s, y_dtype, copy_dtype):
    _check_inputs(x, residual, weight, bias, eps, dropout_p, y_dtype, copy_dtype)  # no data read
    M = x.numel() // x.shape[-1]
    rows, stream = x.new_empty(M, dtype=torch.float32), stream_dtype(x, residual)
    return (x.new_empty(x.shape, dtype=y_dtype or stream),
            x.new_empty(x.shape if store_s else NONE_SHAPE, dtype=stream), rows, torch.empty_like(rows),
            x.new_empty(x.shape if copy_dtype is not None else NONE_SHAPE, dtype=copy_dtype or y_dtype or stream))


@define_op(
    "add_layer_norm_backward",
    "(Tensor dy, Tensor? dy_copy, Tensor? ds, Tensor s, Tensor weight, Tensor mean, Tensor rstd, bool has_bias, "
    "float dropout_p, Tensor? rng, bool store_dres, ScalarType dx_dtype) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _add_layer_norm_backward_op(dy, dy_copy, ds, s, weight, mean, rstd, has_bias, dropout_p, rng, store_dres,
                                dx_dtype):
    """(dx, dres, dweight, dbias) from the gradients of y, of its copy (added to dy's) and of s: dx
    in s's shape and dx_dtype (x's); dres in s's shape and dtype when store_dres and it differs
    from dx (dropout_p > 0, or dx_dtype not s's), else empty (0,); dweight and dbias (N,) in
    weight's dtype, dbias empty (0,) without a bias. The mask is replayed from the forward's rng."""
    dx, dres, dw, db = add_layer_norm_bwd(
        dy, ds, s, weight, mean, rstd, has_bias=has_bias, dropout_p=dropout_p, rng=rng, store_dres=store_dres,
        dx_dtype=dx_dtype, dy_copy=dy_copy,
    )
    return dx, or_empty(dres, s), dw, or_empty(db, weight)


@torch.library.register_fake(_add_layer_norm_backward_op)
def _(dy, dy_copy, ds, s, weight, mean, rstd, has_bias, dropout_p, rng, store_dres, dx_dtype):
    dres = s.new_empty(s.shape if store_dres and (dropout_p > 0.0 or dx_dtype != s.dtype) else NONE_SHAPE)
    db = weight.new_empty(weight.shape if has_bias else NONE_SHAPE)
    return s.new_empty(s.shape, dtype=dx_dtype), dres, weight.new_empty(weight.shape), db


def _setup_context(ctx, inputs, output):
    """scratchformer::add_layer_norm's autograd (`op_autograd`): its backward op, with the
    forward's inputs; the rng tensor is saved, so the backward replays the forward's dropout mask."""
    x, residual, weight, bias, _eps, dropout_p, rng, _store_s, _y_dtype, copy_dtype = inputs
    _y, s, mean, rstd, _copy = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # an unused s or copy gets no gradient: skip its read
    if any(ctx.needs_input_grad[:4]):
        ctx.save_for_backward(s, weight, mean, rstd, rng)  # s = dropout(x) + residual, the norm's input
    ctx.has_bias = bias is not None
    ctx.dropout_p = dropout_p
    ctx.x_dtype = x.dtype
    ctx.has_copy = copy_dtype is not None


def _backward(ctx, dy, ds, dmean, drstd, dcopy):
    s, weight, mean, rstd, rng = ctx.saved_tensors
    if s.numel() != mean.numel() * weight.numel():
        raise RuntimeError("add_layer_norm: the backward needs s = dropout(x) + residual, which the forward did not "
                           "store (store_s=False)")
    if not ctx.has_copy:  # the empty placeholder: a traced backward may hand it a (0,) gradient
        dcopy = None
    if dy is None:  # y unused downstream: its copy's gradient (if any) is the whole of it
        dy, dcopy = (dcopy, None) if dcopy is not None else (torch.zeros_like(s), None)
    need_dres = ctx.needs_input_grad[1]
    dx, dres, dw, db = call_op(
        _add_layer_norm_backward_op, dy, dcopy, ds, s, weight, mean, rstd, ctx.has_bias, ctx.dropout_p, rng,
        need_dres, ctx.x_dtype,
    )
    if need_dres and not ctx.dropout_p > 0.0 and ctx.x_dtype == s.dtype:  # not stored: dresidual == dx
        dres = dx
    return dx, dres if need_dres else None, dw, db if ctx.has_bias else None, None, None, None, None, None, None


AddLayerNormFunction = op_autograd("AddLayerNormFunction", _add_layer_norm_op, _add_layer_norm_backward_op,
                                   _setup_context, _backward)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    dropout_p: float = 0.0,
    return_residual: bool = False,
    seed: int | None = None,
    return_dropout_mask: bool = False,
    y_dtype: torch.dtype | None = None,
    copy_dtype: torch.dtype | None = None,
):
    """y = LayerNorm(dropout(x) + residual) over the last dim, statistics in fp32.

    x (..., N) float32/float16/bfloat16, any leading dims and row strides (last dim contiguous,
    else copied); residual x's shape and dtype, or float32 under a float16/bfloat16 x (a sublayer's
    autocast output added to an fp32 residual stream: x is read as it is, no fp32 copy of it made),
    or None; weight (N,), bias (N,) or None, in the stream's dtype (residual's, else x's) or
    float32; 1 <= N <= 16384. dropout_p drops x (not the residual) with in-kernel
    Philox; seed (int) fixes the stream, else its (seed, offset) is drawn on x's device from
    torch's generator for that device (`_common.dropout_rng`), so `torch.manual_seed` makes runs
    reproducible and each call, CUDA graph replay or compiled call draws afresh.

    The next sublayer's input in its own dtype, written by this kernel rather than cast by another
    (a bf16 matmul under autocast reading the fp32 stream): y_dtype stores y in that dtype (Pre-LN,
    where y feeds only the sublayer; s stays in the stream's); copy_dtype also returns y in that
    dtype beside y itself (Post-LN, where y is both the stream and the sublayer's input), and the
    gradients of the two add up in the backward. Either is the fp32 y rounded once to its dtype: the
    values of a cast of the stream's y.

    Returns y (x's shape, y_dtype, else the stream's dtype), followed by what was asked, in this
    order: s = dropout(x) + residual (return_residual; the stream's dtype, exactly the values y
    normalises; it takes a gradient too), y's copy (copy_dtype), the bool keep mask (x's shape;
    return_dropout_mask, debug): y alone, or a tuple such as (y, s) or (y, copy). Raises ValueError
    naming a bad input.
    """
    _check_inputs(x, residual, weight, bias, eps, dropout_p, y_dtype, copy_dtype, seed)
    for arg, flag in (("return_residual", return_residual), ("return_dropout_mask", return_dropout_mask)):
        check_flag("add_layer_norm", arg, flag)
    return add_layer_norm_trusted(x, residual, weight, bias, eps, dropout_p=dropout_p, return_residual=return_residual,
                                  seed=seed, return_dropout_mask=return_dropout_mask, y_dtype=y_dtype,
                                  copy_dtype=copy_dtype)


def add_layer_norm_trusted(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, return_residual=False, seed=None,
                           return_dropout_mask=False, y_dtype=None, copy_dtype=None):
    """`add_layer_norm` without its checks, for a caller that ran them: `scratchformer.ops`, whose
    check (`op_checks.check_add_layer_norm`) and `check_limits` refuse every call its checks would."""
    rng = dropout_rng(dropout_p, seed, x.device)
    params = (x, residual, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)
    args = (x, residual, weight, bias, float(eps), float(dropout_p), rng, bool(return_residual or needs_grad), y_dtype,
            copy_dtype)
    # no gradient wanted: no autograd node to build, the op alone
    y, s, _, _, copy = AddLayerNormFunction.apply(*args) if needs_grad else call_op(_add_layer_norm_op, *args)
    out = (y, s) if return_residual else (y,)
    if copy_dtype is not None:
        out = out + (copy,)
    if return_dropout_mask:  # debug: replay the forward's Philox stream into a stored mask
        with torch.no_grad():
            out = out + (add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, rng, store_s=False,
                                            store_mask=True)[4],)
    return out if len(out) > 1 else out[0]
