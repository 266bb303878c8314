"""Triton GEMM with fused epilogues: the building block of the FFN (kernels/ffn.py).

    matmul:       C = epilogue(A · B)          A (M, K), B (K, N), any strides, fp32 accumulation
                  epilogue: h = acc + bias; [store h]; a = act(h); a = dropout(a); store a
    matmul_dact:  dH = (A · B) ⊙ act'(aux) ⊙ keep / (1 - p),   plus per-tile column sums of dH

act is relu or the exact (erf) GELU:

    gelu(h)  = h · Φ(h) = ½ h (1 + erf(h / √2))
    gelu'(h) = Φ(h) + h · φ(h),   φ(h) = exp(-h² / 2) / √(2π)
    relu'(h) = [h > 0]

`matmul_dact` is the FFN backward's activation-gradient GEMM. For gelu, aux is the stored
pre-activation h. For relu, aux is the stored *output* a = dropout(relu(h)) itself: a > 0 exactly
where the unit was kept and h > 0, which are the only places the gradient flows, so relu needs
neither h nor the dropout mask (then dH = [a > 0] · (A · B) / (1 - p)). For gelu with dropout the
keep mask is replayed from the same Philox counters as the forward: row · N + col + offset.
Both kernels load (seed, offset) from a (2,) int64 tensor in device memory (`rng_ptr`; see
`_common.dropout_rng`), so a CUDA graph replay or a compiled graph draws afresh.

The column sums of dH (the bias gradient) are reduced deterministically: each row-tile writes
its fp32 partial to row pid_m of an (n_row_tiles, N) buffer, which one more launch sums over
tiles in a fixed order (`partial_sums.py`).

Tiles: on a GPU, `triton.autotune` over a short cartesian list pruned by `keep(config)`, keyed on
(M rounded up to a power of two, N, K) so a new batch size does not retune. Under the
interpreter: one fixed 32x32x32 tile. Ragged M, N, K are handled by masks (K) and by wrapping
out-of-range rows/columns onto valid ones for the loads (tutorial 03), masked at the store.

bf16 under TRITON_INTERPRET=1: tl.dot on bf16 operands returns garbage in Triton 3.9's
interpreter (measured 2026-11), so UPCAST (see `_common.upcast_dot`) converts the operands to fp32
before the dot there; on a GPU bf16 dots run natively. fp32 inputs use IEEE fp32 dots unless
`torch.backends.cuda.matmul.allow_tf32` is set, matching torch.matmul.

TMA kernels (on by default on Hopper and later since a GPU window checked and measured them;
`SCRATCHFORMER_TMA`, `TMA` below): when A's rows and B's rows (B row-major, or the transpose of a
row-major weight, as the FFN passes W1ᵀ and W2ᵀ) are contiguous with 16-byte aligned bases and
row strides, `_matmul_fwd_tma_kernel` and `_matmul_dact_tma_kernel` compute the same epilogues
(shared jit functions) with the operands loaded by the tensor memory accelerator through
descriptors built on the device (`tl.make_tensor_descriptor`; Triton's allocator gives them
global memory, `_common.tma_scratch`), tiles past the edges read as zeros, and one persistent program
per SM looping over the output tiles in the grouped order (`tl.range(..., flatten=True)` lets
Triton pipeline across tiles). Why: the pointer kernels reached 0.66 of cuBLAS at 8192 x 4096 x
4096 on an H100 (2026-11-26), and TMA-fed persistent kernels are how Triton's own Hopper
tutorial (09) approaches cuBLAS; they did, autotuned, on an H100 (2026-11-26, device time):
0.91 and 0.97 of cuBLAS at 16k x 512 x 2048 and 8192 x 4096 x 4096 (the pointer kernels 0.74 and
0.73), the FFN's forward + backward 5% and 11% faster (`bench/results/README.md`). The dropout
masks are the pointer kernels' (same Philox counters), so switching kernels changes no run's
randomness. Not on sm_80: the launcher asks the device's capability.

Reference: Triton tutorials 03 (matrix multiplication) and 09 (persistent matmul).
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from ._common import (
    AUTOTUNE,
    INTERPRET,
    apply_dropout,
    cdiv,
    check_device,
    check_dropout,
    check_dtype,
    check_flag,
    check_tensors,
    dropout_rng,
    launch_tuned,
    next_pow2,
    tma_enabled,
    tma_rows_ok,
    tma_scratch,
    tma_setting,
    upcast_dot,
)
from .partial_sums import sum_partials

ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}

# SCRATCHFORMER_TMA (`_common.tma_setting`: auto, 1, 0): where GEMMs whose operands TMA can address run the
# persistent TMA kernels (module docstring).
TMA: bool | None = tma_setting("SCRATCHFORMER_TMA", "auto")

# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------


def keep(config: triton.Config, elem_bytes: int = 2) -> bool:
    """Prune the cartesian list: warps follow the tile size, stages follow BLOCK_K, and the
    pipelined A/B tiles must fit in ~160 KiB of shared memory (A100 has 163 KiB per block) at
    `elem_bytes` per element: 2 for the list itself (bf16/fp16), 4 at launch for fp32 inputs
    (`_prune_by_dtype`: the AOT compile check found e.g. 128x256x64 fp32 needing 192 KiB on sm_80)."""
    bm, bn, bk = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    if (config.num_warps == 8) != (bm * bn >= 128 * 128):  # big accumulators need 8 warps
        return False
    if config.num_stages != (4 if bk == 32 else 3):
        return False
    return config.num_stages * (bm + bn) * bk * elem_bytes <= 160 * 1024


def _prune_by_dtype(configs, nargs, **kwargs):
    """Autotune early_config_prune: re-apply keep() at the inputs' element size (fp32 halves the list)."""
    if INTERPRET:
        return configs
    return [c for c in configs if keep(c, nargs["a_ptr"].element_size())] or configs[:1]


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one small tile: the interpreter runs every program in numpy
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=1)]
    if not AUTOTUNE:  # SCRATCHFORMER_AUTOTUNE=0: one tile that passes keep() at fp32 too (96 KiB of stages)
        return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=4)]
    grid = itertools.product((64, 128), (64, 128, 256), (32, 64), (3, 4), (4, 8))
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in grid
    ]
    return [c for c in configs if keep(c)]


CONFIGS = _configs()


def _tma_configs() -> list[triton.Config]:
    """The TMA kernels' tiles: BLOCK_K 64 (128-byte rows of bf16, TMA's widest swizzle), each
    passing keep() (so the dtype prune applies as to CONFIGS)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=1)]
    tiles = [(128, 128, 8), (128, 256, 8), (64, 256, 8), (128, 64, 4), (64, 128, 4)]
    if not AUTOTUNE:
        tiles = tiles[:1]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=w)
            for bm, bn, w in tiles]


TMA_CONFIGS = _tma_configs()
# M (the token count) changes with every batch: the key buckets it (M_BUCKET) and neither it nor the
# bucket is specialised on (each new value would compile anew); N and K are model dims, fixed in a
# run, and keep their 16-alignment specialisation (vectorised loads, EVEN_K).
_DNS = ["M", "M_BUCKET"]
MIN_BLOCK_M = min(c.kwargs["BLOCK_M"] for c in CONFIGS + TMA_CONFIGS)

# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile `pid`'s (row, column) tile indices in grouped order (tutorial 03): GROUP_M row-tiles
    share B column-tiles while in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tile_acc(
    a_ptr, b_ptr, M, N, K, stride_a_m, stride_a_k, stride_b_k, stride_b_n, pid_m, pid_n,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The (BLOCK_M, BLOCK_N) fp32 tile of A · B at (pid_m, pid_n)."""
    # Out-of-range rows/cols wrap onto valid ones so the loads need no M/N mask; the caller
    # masks them at the store (and out of any reduction).
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am.to(tl.int64)[:, None] * stride_a_m + offs_k[None, :] * stride_a_k
    b_ptrs = b_ptr + offs_k[:, None] * stride_b_k + offs_bn.to(tl.int64)[None, :] * stride_b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:  # interpreter-only bf16 workaround, see the module docstring
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        b_ptrs += BLOCK_K * stride_b_k
    return acc


@triton.jit
def _program_tile(
    a_ptr, b_ptr, M, N, K, stride_a_m, stride_a_k, stride_b_k, stride_b_n,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """This program's output tile: the fp32 tile of A · B, its row-tile index pid_m, its rows
    (int64, for the stride math) and columns, and the mask of the elements inside (M, N)."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tile_acc(
        a_ptr, b_ptr, M, N, K, stride_a_m, stride_a_k, stride_b_k, stride_b_n, pid_m, pid_n,
        EVEN_K, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return acc, pid_m, offs_m, offs_n, (offs_m[:, None] < M) & (offs_n[None, :] < N)


@triton.jit
def _gelu(h):
    return 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))


@triton.jit
def _gelu_grad(h):
    cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
    pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return cdf + h * pdf


@triton.jit
def _fwd_epilogue(
    acc, offs_m, offs_n, in_c, N, c_ptr, bias_ptr, pre_ptr, mask_ptr, stride_c_m, stride_c_n, dropout_p, rng_ptr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_PRE: tl.constexpr,
    STORE_MASK: tl.constexpr,
):
    """matmul's epilogue on one fp32 tile: h = acc + bias; [store h]; a = act(h); a = dropout(a); store a."""
    c_offs = offs_m[:, None] * stride_c_m + offs_n[None, :] * stride_c_n
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + c_offs, acc.to(pre_ptr.dtype.element_ty), mask=in_c)
    if ACTIVATION == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 2:
        acc = _gelu(acc)
    if HAS_DROPOUT:
        acc, keep = apply_dropout(acc, rng_ptr, offs_m[:, None], offs_n[None, :], N, dropout_p)
        if STORE_MASK:
            tl.store(mask_ptr + c_offs, keep.to(tl.int8), mask=in_c)
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=in_c)


@triton.jit
def _dact_epilogue(
    acc, pid_m, offs_m, offs_n, in_c, N, c_ptr, aux_ptr, dbias_partial_ptr, dropout_p, rng_ptr,
    ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr,
):
    """matmul_dact's epilogue on one fp32 tile of A · B (c and aux contiguous (M, N))."""
    c_offs = offs_m[:, None] * N + offs_n[None, :]
    aux = tl.load(aux_ptr + c_offs, mask=in_c, other=0.0).to(tl.float32)
    if ACTIVATION == 1:
        # a = dropout(relu(h)) > 0  <=>  kept and h > 0: mask and derivative in one test.
        acc = tl.where(aux > 0.0, acc / (1.0 - dropout_p), 0.0)
    else:
        acc = acc * _gelu_grad(aux)
        if HAS_DROPOUT:  # the forward's mask and scale, replayed
            acc, _ = apply_dropout(acc, rng_ptr, offs_m[:, None], offs_n[None, :], N, dropout_p)
    acc = tl.where(in_c, acc, 0.0)  # wrapped rows must not enter the bias sums
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=in_c)
    if BIAS_GRAD:
        tl.store(dbias_partial_ptr + pid_m * N + offs_n, tl.sum(acc, axis=0), mask=offs_n < N)


@triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune_by_dtype})
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=_DNS)
def _matmul_fwd_kernel(
    a_ptr,  # (M, K) any strides
    b_ptr,  # (K, N) any strides
    c_ptr,  # (M, N) output: dropout(act(A·B + bias)), strides stride_c_*
    bias_ptr,  # (N,) or dummy
    pre_ptr,  # (M, N) pre-activation A·B + bias, same strides as c; written if STORE_PRE
    mask_ptr,  # (M, N) int8 keep mask, same strides as c; written if STORE_MASK (debug)
    M, N, K,
    M_BUCKET,  # next_power_of_2(M): autotune key only
    stride_a_m, stride_a_k, stride_b_k, stride_b_n, stride_c_m, stride_c_n,
    dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, offset] (read if HAS_DROPOUT): element (m, n) uses offset + m * N + n
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 relu, 2 gelu
    HAS_DROPOUT: tl.constexpr,
    STORE_PRE: tl.constexpr,
    STORE_MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    acc, _, offs_m, offs_n, in_c = _program_tile(
        a_ptr, b_ptr, M, N, K, stride_a_m, stride_a_k, stride_b_k, stride_b_n,
        EVEN_K, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    )
    _fwd_epilogue(
        acc, offs_m, offs_n, in_c, N, c_ptr, bias_ptr, pre_ptr, mask_ptr, stride_c_m, stride_c_n, dropout_p, rng_ptr,
        HAS_BIAS, ACTIVATION, HAS_DROPOUT, STORE_PRE, STORE_MASK,
    )


@triton.autotune(
    configs=CONFIGS, key=["M_BUCKET", "N", "K"], reset_to_zero=["dbias_partial_ptr"],
    prune_configs_by={"early_config_prune": _prune_by_dtype},
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=_DNS)
def _matmul_dact_kernel(
    a_ptr,  # (M, K) upstream gradient, any strides
    b_ptr,  # (K, N) any strides
    c_ptr,  # (M, N) output dH, contiguous
    aux_ptr,  # (M, N) contiguous: the forward's output a (relu) or pre-activation h (gelu)
    dbias_partial_ptr,  # (>= cdiv(M, BLOCK_M), N) fp32 per-row-tile column sums of dH
    M, N, K,
    M_BUCKET,  # next_power_of_2(M): autotune key only
    stride_a_m, stride_a_k, stride_b_k, stride_b_n,
    dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, offset], the forward's (read if HAS_DROPOUT and gelu)
    ACTIVATION: tl.constexpr,  # 1 relu (aux = output), 2 gelu (aux = pre-activation)
    HAS_DROPOUT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    acc, pid_m, offs_m, offs_n, in_c = _program_tile(
        a_ptr, b_ptr, M, N, K, stride_a_m, stride_a_k, stride_b_k, stride_b_n,
        EVEN_K, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    )
    _dact_epilogue(
        acc, pid_m, offs_m, offs_n, in_c, N, c_ptr, aux_ptr, dbias_partial_ptr, dropout_p, rng_ptr,
        ACTIVATION, HAS_DROPOUT, BIAS_GRAD,
    )


# ---------------------------------------------------------------------------------------------
# TMA kernels (Hopper and later; `TMA`): the same epilogues, operands fed by the tensor
# memory accelerator, persistent programs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tma_tile_acc(
    a_desc, b_desc, K, off_m, off_n,
    B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The (BLOCK_M, BLOCK_N) fp32 tile of A · B at (off_m, off_n): blocks past the edges load as
    zeros (the descriptors' padding), so ragged M, N and K need no masks here."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        if B_KMAJOR:  # B is the transpose of a row-major (N, K) tensor (a weight)
            b = b_desc.load([off_n, k * BLOCK_K]).T
        else:
            b = b_desc.load([k * BLOCK_K, off_n])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _tma_program_tile(
    a_desc, b_desc, tile, M, N, K,
    B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Output tile `tile` of a persistent program: as `_program_tile` returns it (fp32 tile, its
    row-tile index, rows as int64, columns, the mask of the elements inside (M, N))."""
    pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tma_tile_acc(a_desc, b_desc, K, pid_m * BLOCK_M, pid_n * BLOCK_N,
                        B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return acc, pid_m, offs_m, offs_n, (offs_m[:, None] < M) & (offs_n[None, :] < N)


@triton.jit
def _tma_descriptors(
    a_ptr, b_ptr, M, N, K, stride_a_m, stride_b_k, stride_b_n,
    B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A's and B's descriptors (row-major A; B row-major, or the transpose of a row-major tensor)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a_m, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b_n, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b_k, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    return a_desc, b_desc


@triton.autotune(
    configs=TMA_CONFIGS, key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune_by_dtype},
)
@triton.jit(do_not_specialize=_DNS)
def _matmul_fwd_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, mask_ptr,  # as _matmul_fwd_kernel's; A row-major
    M, N, K, M_BUCKET,
    stride_a_m, stride_b_k, stride_b_n, stride_c_m, stride_c_n,
    dropout_p, rng_ptr,
    NUM_PROGRAMS: tl.constexpr,  # the grid: at most one program per SM, each looping over tiles
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_PRE: tl.constexpr,
    STORE_MASK: tl.constexpr, B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    a_desc, b_desc = _tma_descriptors(a_ptr, b_ptr, M, N, K, stride_a_m, stride_b_k, stride_b_n,
                                      B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        acc, pid_m, offs_m, offs_n, in_c = _tma_program_tile(
            a_desc, b_desc, tile, M, N, K, B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        )
        _fwd_epilogue(
            acc, offs_m, offs_n, in_c, N, c_ptr, bias_ptr, pre_ptr, mask_ptr, stride_c_m, stride_c_n, dropout_p,
            rng_ptr, HAS_BIAS, ACTIVATION, HAS_DROPOUT, STORE_PRE, STORE_MASK,
        )


@triton.autotune(
    configs=TMA_CONFIGS, key=["M_BUCKET", "N", "K"], reset_to_zero=["dbias_partial_ptr"],
    prune_configs_by={"early_config_prune": _prune_by_dtype},
)
@triton.jit(do_not_specialize=_DNS)
def _matmul_dact_tma_kernel(
    a_ptr, b_ptr, c_ptr, aux_ptr, dbias_partial_ptr,  # as _matmul_dact_kernel's; A row-major
    M, N, K, M_BUCKET,
    stride_a_m, stride_b_k, stride_b_n,
    dropout_p, rng_ptr,
    NUM_PROGRAMS: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr, B_KMAJOR: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    a_desc, b_desc = _tma_descriptors(a_ptr, b_ptr, M, N, K, stride_a_m, stride_b_k, stride_b_n,
                                      B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        acc, pid_m, offs_m, offs_n, in_c = _tma_program_tile(
            a_desc, b_desc, tile, M, N, K, B_KMAJOR, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        )
        _dact_epilogue(
            acc, pid_m, offs_m, offs_n, in_c, N, c_ptr, aux_ptr, dbias_partial_ptr, dropout_p, rng_ptr,
            ACTIVATION, HAS_DROPOUT, BIAS_GRAD,
        )


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _check_operands(name, a, b, *others):
    check_device(name, a, b, *others)
    dtype = check_dtype(name, a, b, *others)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{name}: expects 2-D A (M, K) and B (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{name}: inner dims differ: A {tuple(a.shape)} @ B {tuple(b.shape)}")
    return dtype


def _input_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs unless torch allows TF32 (torch.matmul's rule); for 16-bit
    inputs the flag is moot and Triton's default ("tf32") is passed. The interpreter always
    computes in numpy at the operands' precision."""
    if dtype == torch.float32 and (INTERPRET or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _m_bucket(M):
    """M_BUCKET, the autotune key of the row count: next_power_of_2(M), at least 128 (the largest BLOCK_M)."""
    return max(next_pow2(M), 128)


def _grid(M, N):
    return lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)


def _tma_grid(M, N):
    return lambda meta: (min(meta["NUM_PROGRAMS"], cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)


@functools.cache
def _programs(device: torch.device) -> int:
    """The TMA kernels' persistent programs: one per SM (4 in the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tma_layout(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """B_KMAJOR for the TMA kernels (B the transpose of a row-major (N, K) tensor: True; row-major:
    False), or None where they do not run: TMA off, a GPU before Hopper, the interpreter unless
    TMA is True, or operands TMA cannot address (rows not contiguous, base or row stride not a
    multiple of 16 bytes)."""
    if not tma_enabled(TMA, a.device) or not tma_rows_ok(a, a.stride(0)):
        return None
    if tma_rows_ok(b, b.stride(0)):
        return False
    if tma_rows_ok(b.t(), b.stride(1)):
        return True
    return None


_MAX_BLOCK_K = max(c.kwargs["BLOCK_K"] for c in CONFIGS + TMA_CONFIGS)


def _k_strides_fit(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b), each copied to unit stride along K where its K stride times the widest BLOCK_K would
    pass 2^31: the kernels step along K by BLOCK_K * stride in int32 (Triton passes a stride below
    2^31 as an int32), which would wrap silently (a column-major A of 33.5M rows or more)."""
    if a.stride(1) * _MAX_BLOCK_K >= 2**31:
        a = a.contiguous()
    if b.stride(0) * _MAX_BLOCK_K >= 2**31:
        b = b.t().contiguous().t()
    return a, b


def launch_matmul(a, b, bias=None, activation="none", dropout_p=0.0, rng=None, store_pre=False,
                  store_mask=False):
    """`matmul` without its checks, for callers that checked the same inputs at their own entry
    (the FFN): (c,) + (pre,) if store_pre + (mask,) if store_mask. rng: the (2,) int64 [seed,
    offset] tensor on a's device (`_common.dropout_rng`), needed when dropout_p > 0."""
    a, b = _k_strides_fit(a, b)
    M, K = a.shape
    N = b.shape[1]
    dtype = a.dtype
    if bias is not None:
        bias = bias.contiguous()  # the epilogue reads it at unit stride (a strided view gave wrong sums)
    c = torch.empty((M, N), dtype=dtype, device=a.device)
    pre = torch.empty_like(c) if store_pre else None
    has_dropout = dropout_p > 0.0
    mask = torch.empty((M, N), dtype=torch.int8, device=a.device) if (store_mask and has_dropout) else None
    b_kmajor = _tma_layout(a, b) if M > 0 and N > 0 else None
    if b_kmajor is not None:
        triton.set_allocator(tma_scratch)  # a context variable: set in the launching thread (autograd's too)
        bucket = _m_bucket(M)
        launch_tuned(
            _matmul_fwd_tma_kernel, _tma_grid(M, N), (bucket, N, K, dtype, mask is not None, b_kmajor),
            a, b, c, bias if bias is not None else c, pre if pre is not None else c,
            mask if mask is not None else c,
            M, N, K, bucket,
            a.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            dropout_p, rng if has_dropout else c, NUM_PROGRAMS=_programs(a.device),
            HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation], HAS_DROPOUT=has_dropout,
            STORE_PRE=store_pre, STORE_MASK=mask is not None, B_KMAJOR=b_kmajor, UPCAST=upcast_dot(dtype),
            INPUT_PRECISION=_input_precision(dtype),
        )
    elif M > 0 and N > 0:
        # the Autotuner's key: M_BUCKET, N, K and the dtypes (a, b, c, bias and pre share one)
        bucket = _m_bucket(M)
        launch_tuned(
            _matmul_fwd_kernel, _grid(M, N), (bucket, N, K, dtype, mask is not None),
            a, b, c, bias if bias is not None else c, pre if pre is not None else c,
            mask if mask is not None else c,
            M, N, K, bucket,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            dropout_p, rng if has_dropout else c,
            HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation], HAS_DROPOUT=has_dropout,
            STORE_PRE=store_pre, STORE_MASK=mask is not None, UPCAST=upcast_dot(dtype),
            INPUT_PRECISION=_input_precision(dtype),
        )
    if store_mask and mask is None:
        mask = torch.ones((M, N), dtype=torch.int8, device=a.device)
    out = (c,)
    if store_pre:
        out += (pre,)
    if store_mask:
        out += (mask.bool(),)
    return out


def launch_matmul_dact(a, b, aux, activation, dropout_p=0.0, rng=None, bias_grad=False, bias_dtype=torch.float32):
    """`matmul_dact` without its checks (see launch_matmul): (dH, column sums or None). rng: the
    forward's (2,) int64 tensor, read for gelu with dropout (relu needs no mask). The column sums
    are taken in fp32 and stored in bias_dtype (the bias's: one rounding, in the sums' kernel)."""
    a, b = _k_strides_fit(a, b)
    M, K = a.shape
    N = b.shape[1]
    aux = aux.contiguous()
    dh = torch.empty((M, N), dtype=a.dtype, device=a.device)
    # Sized for the smallest BLOCK_M any config may pick; unused rows stay zero. Only with bias_grad
    # (without, BIAS_GRAD is off and dh stands in for the pointer, never written through).
    partial = None
    if bias_grad:
        partial = torch.zeros((max(cdiv(M, MIN_BLOCK_M), 1), N), dtype=torch.float32, device=a.device)
    b_kmajor = _tma_layout(a, b) if M > 0 and N > 0 else None
    if b_kmajor is not None:
        triton.set_allocator(tma_scratch)
        bucket = _m_bucket(M)
        launch_tuned(
            _matmul_dact_tma_kernel, _tma_grid(M, N), (bucket, N, K, a.dtype, bias_grad, b_kmajor),
            a, b, dh, aux, partial if bias_grad else dh, M, N, K, bucket,
            a.stride(0), b.stride(0), b.stride(1),
            dropout_p, rng if dropout_p > 0.0 and activation == "gelu" else dh, NUM_PROGRAMS=_programs(a.device),
            ACTIVATION=ACTIVATIONS[activation], HAS_DROPOUT=dropout_p > 0.0, BIAS_GRAD=bias_grad,
            B_KMAJOR=b_kmajor, UPCAST=upcast_dot(a.dtype), INPUT_PRECISION=_input_precision(a.dtype),
        )
    elif M > 0 and N > 0:
        bucket = _m_bucket(M)
        launch_tuned(
            _matmul_dact_kernel, _grid(M, N), (bucket, N, K, a.dtype, bias_grad),
            a, b, dh, aux, partial if bias_grad else dh, M, N, K, bucket,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            dropout_p, rng if dropout_p > 0.0 and activation == "gelu" else dh,
            ACTIVATION=ACTIVATIONS[activation], HAS_DROPOUT=dropout_p > 0.0, BIAS_GRAD=bias_grad,
            UPCAST=upcast_dot(a.dtype), INPUT_PRECISION=_input_precision(a.dtype),
        )
    return dh, (sum_partials(partial, None, bias_dtype)[0] if bias_grad else None)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    dropout_p: float = 0.0,
    seed: int | None = None,
    store_pre: bool = False,
    store_mask: bool = False,
):
    """dropout(act(a @ b + bias)) in one kernel. a (M, K), b (K, N): any strides, same dtype
    (float32/float16/bfloat16); bias (N,). fp32 accumulation, one rounding on store. dropout_p
    in [0, 1): seed (int) fixes the Philox stream (matmul_dact with the same seed replays its
    mask), else it is drawn on a's device from torch's generator (`_common.dropout_rng`).

    Returns c (M, N) contiguous in a's dtype; with store_pre also the pre-activation a @ b + bias
    (needed by the gelu backward); with store_mask also the bool keep mask (debug).
    """
    check_tensors("matmul", ("bias",), a=a, b=b, bias=bias)
    _check_operands("matmul", a, b, bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    N = b.shape[1]
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"matmul: bias must have shape ({N},), got {tuple(bias.shape)}")
    check_dropout("matmul", dropout_p, seed)
    for arg, flag in (("store_pre", store_pre), ("store_mask", store_mask)):
        check_flag("matmul", arg, flag)
    rng = dropout_rng(dropout_p, seed, a.device)
    out = launch_matmul(a, b, bias, activation, dropout_p, rng, store_pre, store_mask)
    return out if len(out) > 1 else out[0]


def matmul_dact(
    a: torch.Tensor,
    b: torch.Tensor,
    aux: torch.Tensor,
    *,
    activation: str,
    dropout_p: float = 0.0,
    seed: int | None = None,
    bias_grad: bool = False,
):
    """dH = (a @ b) ⊙ act'(·) ⊙ keep / (1 - p): the FFN's gradient through its activation.

    a (M, K) (the upstream gradient), b (K, N), any strides; aux (M, N): for relu the forward's
    output dropout(relu(h)), for gelu its pre-activation h. For gelu with dropout, seed is the
    forward's `matmul(..., seed=...)`, whose mask is replayed (None draws a fresh one, as matmul
    does). Returns dH (M, N) in a's dtype and, with bias_grad, its fp32 column sums (N,) (reduced
    over row tiles in a fixed order), else None.
    """
    check_tensors("matmul_dact", a=a, b=b, aux=aux)
    _check_operands("matmul_dact", a, b, aux)
    if activation not in ("relu", "gelu"):
        raise ValueError(f"matmul_dact: activation must be 'relu' or 'gelu', got {activation!r}")
    M, N = a.shape[0], b.shape[1]
    if aux.shape != (M, N):
        raise ValueError(f"matmul_dact: aux must have shape ({M}, {N}), got {tuple(aux.shape)}")
    check_dropout("matmul_dact", dropout_p, seed)
    check_flag("matmul_dact", "bias_grad", bias_grad)
    rng = dropout_rng(dropout_p, seed, a.device) if activation == "gelu" else None  # relu reads no mask
    return launch_matmul_dact(a, b, aux, activation, dropout_p, rng, bias_grad)
