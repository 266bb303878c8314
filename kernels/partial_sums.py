"""The second stage of our two-stage column reductions, in Triton: partial sums -> totals, cast.

Two backward kernels reduce over rows in two stages, without atomics (so the result is the same
bit for bit from run to run): each program of the first stage writes the column sums of its own
rows to one row of a (P, N) fp32 buffer, and this kernel sums those P rows per column,

    out[n] = Σ_p partial[p, n]        in fp32, cast once to out's dtype on store,

for one or two buffers of the same shape at once:
- add+LayerNorm's backward (`add_layer_norm.py`): dweight = Σ dy · x̂ and dbias = Σ dy, P = a few
  programs per SM;
- the FFN's bias gradient from the GEMM of dH (`matmul.py`, `launch_matmul_dact`): db1 = Σ dH, P =
  one row per row block of the GEMM.

Why a kernel of our own rather than `partial.sum(0).to(dtype)`: torch's reduction of a short, wide
fp32 buffer took ~10 us of an H100 a call (`bench/results/2026-11-26-h100-profile-base-cnndm.txt`,
the triton step: 84 fp32 `reduce_kernel` calls, 0.86 ms a step, beside 30 LayerNorm backwards,
each summing dweight and dbias), and with bf16 weights each sum was followed by a cast: a LayerNorm
backward ended in up to four small launches where one does it all.

The sum runs in a fixed order for a given (P, N) (`_tile`): rows in blocks of BLOCK_P, each
column's running sums kept per row of the tile, then summed across the tile once. One program per
BLOCK_N columns; on a GPU the tile is narrow (32 columns: one 128-byte line a row) and tall, so
that a few hundred partial rows take two or three loads a program and wide rows spread over many
programs; in the interpreter, which pays per program and per op, one tile of up to 16k values.

Limits: partials contiguous fp32 (P, N), P >= 1, N >= 0, on one device; outputs (N,) float32,
float16 or bfloat16. Internal: the launchers above call it with buffers they allocated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, cdiv, next_pow2

# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["P"])
def _sum_partials_kernel(
    a_ptr,  # (P, N) fp32 partial sums, contiguous
    b_ptr,  # (P, N) fp32 partial sums, contiguous; read if HAS_B
    a_out_ptr,  # (N,) Σ_p a[p, :], in its own dtype
    b_out_ptr,  # (N,) Σ_p b[p, :], written if HAS_B
    P,  # partial rows
    N,  # columns
    HAS_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    b_acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        ok = (rows < P)[:, None] & col_ok[None, :]
        at = rows.to(tl.int64)[:, None] * N + cols[None, :]
        a_acc += tl.load(a_ptr + at, mask=ok, other=0.0)
        if HAS_B:
            b_acc += tl.load(b_ptr + at, mask=ok, other=0.0)
    tl.store(a_out_ptr + cols, tl.sum(a_acc, axis=0).to(a_out_ptr.dtype.element_ty), mask=col_ok)
    if HAS_B:
        tl.store(b_out_ptr + cols, tl.sum(b_acc, axis=0).to(b_out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------

GPU_BLOCK_N = 32  # columns a program: one 128-byte line of fp32 a partial row
GPU_TILE = 1 << 13  # fp32 values a tile (per buffer): 32 a thread at 8 warps
INTERPRET_TILE = 1 << 14


def _tile(P: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps) for partials of P rows and N columns (module docstring). On a
    GPU the tile does not follow P, which the batch's rows set (the FFN's partials have a row per
    row block): one compile serves every batch; fewer rows than a tile are masked."""
    if INTERPRET:
        block_n = min(next_pow2(N), INTERPRET_TILE)
        return max(1, min(next_pow2(P), INTERPRET_TILE // block_n)), block_n, 1
    block_n = min(next_pow2(N), GPU_BLOCK_N)
    return GPU_TILE // block_n, block_n, 8


def sum_partials(a: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype):
    """(Σ_p a[p, :], Σ_p b[p, :] or None), each (N,) in `dtype`, from (P, N) contiguous fp32
    partials (b: a's shape, or None), in one launch and a fixed order. Trusts its callers (the
    launchers of this package) for shapes, dtypes and device."""
    P, N = a.shape
    a_out = a.new_empty(N, dtype=dtype)
    b_out = a.new_empty(N, dtype=dtype) if b is not None else None
    if N == 0:
        return a_out, b_out
    block_p, block_n, warps = _tile(P, N)
    _sum_partials_kernel[(cdiv(N, block_n),)](
        a, b if b is not None else a, a_out, b_out if b_out is not None else a_out, P, N,
        HAS_B=b is not None, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps,
    )
    return a_out, b_out
