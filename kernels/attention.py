"""Fused multi-head attention (FlashAttention-2 style): out = softmax(Q Kᵀ · scale) V.

Forward (per (batch, head) and block of BLOCK_M query rows), never materialising the Lq×Lk
matrix: walk the visible key blocks of BLOCK_N columns keeping a running row max m and row sum
l of exp(s - m) (the online softmax), rescale the fp32 accumulator by exp(m_old - m_new), and
finish with out = acc / l and the row log-sum-exp lse = m + log(l). Exponentials use exp2 with
the scale folded into qk_scale = scale · log2(e); lse is stored in natural-log units. In blocks that
need no mask the row max is taken on the unscaled scores and scaled once per row, so each score
costs one FMA, exp2(qk · qk_scale - m), as in Triton's fused-attention tutorial; that needs scale >= 0,
which the entry point checks (`tools/sass_loops.py` counts the loop's instructions on sm_90).

Masks (the spec is `scratchformer.reference.attention_ref`):
- key padding as per-sequence lengths (right padding): key blocks at or beyond key_lengths[b]
  are outside the loop bounds (skipped, not computed and masked);
- query rows at or beyond query_lengths[b] give zeros (and zero gradients), whatever they hold
  (a NaN there reaches no gradient); whole query blocks past it run no key loop;
- causal aligned bottom-right: query i sits at position Lk - Lq + i (so decoding with a KV cache,
  Lq < Lk, is exact); key blocks wholly above the diagonal are skipped;
- a row with no visible key (length 0, or fully causal-masked when Lq > Lk) gives zeros and
  lse = -inf, never NaN; a row with a NaN score (a NaN in q, an infinite key) is NaN in out, lse
  and the gradients, as in the reference, never a quiet 0.
Only the blocks that straddle a boundary pay for masking: each loop is split into an unmasked part
and a masked part.

Dropout on the probabilities, in-kernel: keep(b, h, i, j) = rand(seed, offset + ((b·H + h)·Lq
+ i)·Lk + j) >= p (Philox via tl.rand, 64-bit counters), kept values scaled by 1/(1 - p). The
kernels load (seed, offset) from an int64[2] tensor in device memory (`rng_ptr`, drawn on the
device per call by `_common.dropout_rng`, so a CUDA graph replay or a compiled graph draws
afresh). The backward regenerates the same mask from the same tensor and counters; nothing of
size Lq×Lk is stored.

Backward (S = scale·Q Kᵀ, P = softmax(S) row-wise, Z the keep mask, r = 1/(1 - p), O = (P∘Z·r) V):
    dV = (P∘Z·r)ᵀ dO
    dPd = dO Vᵀ                    gradient w.r.t. the dropped probabilities P∘Z·r
    dP  = dPd ∘ Z·r
    dS  = P ∘ (dP - δ),  δ_i = Σ_j P_ij dP_ij = Σ_j (P∘Z·r)_ij (dO_i·V_j) = dO_i · O_i
    dQ  = scale · dS K,   dK = scale · dSᵀ Q
P is recomputed from the saved lse: P = exp(S - lse) (exp2(s·qk_scale - lse·log2 e)); rows with
lse = -inf (no visible key, or padded query rows) use +inf instead so P = 0 there. Three kernels:
a preprocessing pass δ = rowsum(dO∘O), which also writes lse·log2 e with that +inf (`_lse2`: done
once a row, not once a row and key block in the dK/dV loop); one program per key block computing
dK, dV (loops over query blocks); one per query block computing dQ (loops over key blocks). Every
output element is written by exactly one program: deterministic, no float atomics. Extra memory:
lse, δ and lse·log2 e, O(L).

Limits: head_dim 16, 32, 64 or 128; fp32, fp16, bf16 (fp32 dots use input_precision="ieee":
exact but slower, fp32 is for tests). Under TRITON_INTERPRET=1 (Triton 3.9), tl.dot on bf16
operands returns garbage, so `_common.upcast_dot` makes the kernels upcast bf16 tiles to fp32
before every dot there (UPCAST constexpr); on a GPU bf16 dots run natively.

TMA path (`SCRATCHFORMER_ATTENTION_TMA`, `TMA` below; by default, `auto`, on Hopper and later at
head dim 128, where it won the race): the blocks each program streams (keys and values in the
forward and dQ, queries and dO in dK/dV) are loaded by Hopper's tensor memory accelerator through
tensor descriptors built on the device over each (batch, head)'s (rows, D) slab (`_slab`,
`_stream_rows`), instead of one address per element; the slab's length is the masked loads' bound,
so rows past it read as zeros just the same, and nothing else changes (masks, dropout counters,
outputs: bit-identical in the interpreter, tests/test_attention_tma.py). Why: the pointer kernels
reached 0.65-0.91 of cuDNN's forward on an H100 (2026-11-26), cuDNN's Hopper kernels are TMA-fed
(FlashAttention-3's design), and the same change took our GEMM from 0.73 to 0.97 of cuBLAS. Raced on
an H100 (2026-11-26, sixth window, L 4k, bf16, device time): at head dim 128 the forward went from
475 to 552 TFLOP/s and forward + backward from 373 to 393; at head dim 64 it lost 3% (431 -> 418,
343 -> 332, padded likewise), so `auto` takes it at head dim 128 only (`TMA_MIN_HEAD_DIM`); 1 takes
it at every head dim. Taken where every streamed tensor's rows are contiguous with 16-byte aligned
bases and strides (`_tma`), as the model's fused-projection views are.

Torch ops (registration section): `scratchformer::attention(q, k, v, key_lengths?, query_lengths?,
causal, dropout_p, scale?, rng?) -> (out, lse)` and `scratchformer::attention_backward`
-> (dq, dk, dv), linked by one autograd (`_setup_context` + `_backward`, registered on the op and
as `AttentionFunction`; it saves rng for the backward). Dropout is a
pure function of the (seed, offset) in the rng tensor (None without dropout), so the backward op
replays it; nothing is mutated, nothing aliases.
How they are registered, and why: `kernels/_common.py`.

References: Dao et al., FlashAttention-2 (2023); triton-lang/triton tutorial 06 (fused
attention); Dao-AILab/flash-attention `flash_attn_triton.py`.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._common import (
    AUTOTUNE,
    INTERPRET,
    LOG2E,
    attention_key_bounds,
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
    launch_tuned,
    load_dropout_rng,
    next_pow2,
    op_autograd,
    tma_enabled,
    tma_rows_ok,
    tma_scratch,
    tma_setting,
    upcast_dot,
)

__all__ = ["attention", "attention_fwd", "attention_bwd", "HEAD_DIMS"]

HEAD_DIMS = (16, 32, 64, 128)

# SCRATCHFORMER_ATTENTION_TMA (`_common.tma_setting`: auto, the default, 1, 0): the kernels stream
# their key/value (forward, dQ) and query/dO (dK, dV) blocks through tensor descriptors
# (`_stream_rows`), where the tensors' layout allows; `auto` only from TMA_MIN_HEAD_DIM up, the
# head dims where they beat the pointer kernels on an H100 (module docstring).
TMA: bool | None = tma_setting("SCRATCHFORMER_ATTENTION_TMA", "auto")
TMA_MIN_HEAD_DIM = 128


# ---------------------------------------------------------------------------------------------
# Autotuning: a short cartesian list pruned by keep(); one fixed small config in the interpreter
# (16×16 tiles: fast on CPU, and lengths like 7, 33, 100 exercise partial tiles).
# ---------------------------------------------------------------------------------------------


def keep(config: triton.Config) -> bool:
    """Prune configs that never win: 8 warps on small tiles; the resident block (BLOCK_M for the
    forward and dQ, BLOCK_N for dK/dV, named RESIDENT) smaller than the streamed one."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    resident, streamed = (bn, bm) if config.kwargs.get("RESIDENT") == "N" else (bm, bn)
    if resident < streamed:
        return False
    return not (config.num_warps == 8 and bm * bn < 128 * 64)


# fp32 inputs (a test dtype: IEEE fp32 dots) need twice the shared memory of 16-bit ones, and the
# config list above is sized for 16-bit: the AOT compile check (tools/compile_check.py) found
# most fp32 configs at HEAD_DIM 128 over A100's 163 KB per block (e.g. the forward's 128x128
# 3-stage tile takes 384 KB), some over H100's 227 KB. For 4-byte inputs keep only the configs
# whose modelled footprint fits A100: resident tiles (1 for the forward's Q, 2 for the backward's
# K,V or Q,dO) plus num_stages copies of the 2 streamed tiles, elem_bytes x HEAD_DIM each. The
# model is an upper bound of the compiled sizes on sm_80 and sm_90; 16-bit lists are unchanged
# (all fit both GPUs, checked by the compile check).
FP32_SMEM_BUDGET = 166912  # A100 opt-in shared memory per block, bytes

# Registers, at every dtype: the fp32 values a thread keeps live through the loop, its accumulators
# and score tiles over 32·num_warps threads (`LIVE_VALUES`: the forward's acc and S, BLOCK_M x (D +
# BLOCK_N); dK/dV's dK, dV, Pᵀ and dPᵀ, 2·BLOCK_N x (D + BLOCK_M); dQ's acc, P and dP, BLOCK_M x (D +
# 2·BLOCK_N)). Compiled for sm_90 (Triton 3.6, bf16, head dims 64 and 128; `tools/compile_check.py`
# reports each config's registers and spills), every config over 192 such values a thread spilled
# 376-1,264 bytes at 255 registers (10 of the 68), the tuner's time to compile and race them lost;
# at 192 or fewer, at most 168 bytes, most nothing. So the tuner is offered those alone.
MAX_LIVE_VALUES = 192
LIVE_VALUES = {
    "fwd": lambda bm, bn, d: bm * (d + bn),
    "dkdv": lambda bm, bn, d: 2 * bn * (d + bm),
    "dq": lambda bm, bn, d: bm * (d + 2 * bn),
}


# Each kernel's tuning: (BLOCK_M candidates, BLOCK_N candidates, its resident block and how many
# tiles of it stay resident (Q; K and V; Q and dO), the pinned (BLOCK_M, BLOCK_N, warps, stages)).
TUNING = {
    "fwd": ((64, 128), (32, 64, 128), "M", 1, (64, 64, 4, 2)),
    "dkdv": ((32, 64), (64, 128), "N", 2, (32, 64, 4, 2)),
    "dq": ((64, 128), (32, 64), "M", 2, (64, 32, 4, 2)),
}


def _pruner(kernel):
    """The Autotuner's early_config_prune for `kernel` (a TUNING and LIVE_VALUES key): the configs
    whose live values fit MAX_LIVE_VALUES a thread and, for 4-byte inputs, whose shared memory fits
    FP32_SMEM_BUDGET (the models above); never none (the smallest by both)."""
    live = LIVE_VALUES[kernel]
    _, _, resident_block, n_resident, _ = TUNING[kernel]

    def prune(configs, nargs, **kwargs):
        if INTERPRET:
            return configs
        head_dim, fp32 = kwargs["HEAD_DIM"], nargs["q_ptr"].element_size() >= 4

        def per_thread(c):
            return live(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], head_dim) / (32 * c.num_warps)

        def smem(c):
            bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
            resident, streamed = (bn, bm) if resident_block == "N" else (bm, bn)
            return 4 * head_dim * (n_resident * resident + c.num_stages * 2 * streamed) if fp32 else 0

        kept = [c for c in configs if per_thread(c) <= MAX_LIVE_VALUES and smem(c) <= FP32_SMEM_BUDGET]
        return kept or [min(configs, key=lambda c: (smem(c), per_thread(c)))]
    return prune


def _configs(kernel):
    """`kernel`'s candidate configs (TUNING) after keep(); its pinned one alone without autotuning;
    one small config in the interpreter."""
    blocks_m, blocks_n, resident, _, pinned = TUNING[kernel]
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    if not AUTOTUNE:  # pinned (BLOCK_M, BLOCK_N, warps, stages): passes keep(), fp32 at HEAD_DIM 128 fits sm_80
        bm, bn, w, s = pinned
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
    cands = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "RESIDENT": resident}, num_warps=w, num_stages=s)
        for bm in blocks_m
        for bn in blocks_n
        for w in (4, 8)
        for s in (2, 3)
    ]
    kept = [c for c in cands if keep(c)]
    for c in kept:  # RESIDENT only steers keep(); the kernels don't take it
        del c.kwargs["RESIDENT"]
    return kept


# Lengths are bucketed to powers of two for the key so variable-length batches don't re-tune.
_KEY = ["LQ_KEY", "LK_KEY", "HEAD_DIM", "IS_CAUSAL", "TMA"]
# Integer arguments Triton would otherwise specialise on (== 1, % 16): every new sequence length,
# or head count would compile anew (tests/test_compile_budget.py counts this). Lengths
# only bound masks and loops, so the specialisation buys nothing; strides keep theirs (== 1 and
# 16-alignment feed vectorised loads, and they are stable across batches).
_DNS = ["H", "Lq", "Lk", "LQ_KEY", "LK_KEY"]


@triton.jit
def _tile(base, offs_r, offs_c, stride_r, stride_c):
    """Pointers to a (len(offs_r), len(offs_c)) tile: base + r·stride_r + c·stride_c."""
    return base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c


@triton.jit
def _load_rows(
    base, offs_r, offs_d, stride_r, stride_d, n_rows,
    UPCAST: tl.constexpr, MASKED: tl.constexpr = True, TRANS: tl.constexpr = False,
):
    """Rows offs_r of the (L, D) slab at base: a (len(offs_r), D) tile, or (D, len(offs_r)) if
    TRANS. Rows >= n_rows read as 0 if MASKED (an unmasked block lies inside [0, n_rows)); fp32
    if UPCAST (the interpreter's bf16 workaround)."""
    if TRANS:
        ptrs = _tile(base, offs_d, offs_r, stride_d, stride_r)
        inside = offs_r[None, :] < n_rows
    else:
        ptrs = _tile(base, offs_r, offs_d, stride_r, stride_d)
        inside = offs_r[:, None] < n_rows
    if MASKED:
        x = tl.load(ptrs, mask=inside, other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _store_rows(base, offs_r, offs_d, stride_r, stride_d, n_rows, x):
    """Stores the fp32 tile x at rows offs_r < n_rows of base, cast once to base's dtype."""
    ptrs = _tile(base, offs_r, offs_d, stride_r, stride_d)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=offs_r[:, None] < n_rows)


@triton.jit
def _slab(base, n_rows, stride_r, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """What `_stream_rows` reads blocks of BLOCK rows from: with TMA, a tensor descriptor of the
    (n_rows, HEAD_DIM) slab at base (rows contiguous; the launcher checked the alignment), so rows
    past n_rows read as zeros as the masked pointer loads do (n_rows at least 1: a descriptor has
    no empty dimension, and a slab of none is never read); else base itself."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[tl.maximum(n_rows, 1), HEAD_DIM], strides=[stride_r, 1],
                                        block_shape=[BLOCK, HEAD_DIM])
    else:
        src = base
    return src


@triton.jit
def _stream_rows(
    src, start, offs_r, offs_d, stride_r, stride_d, n_rows,
    UPCAST: tl.constexpr, MASKED: tl.constexpr, TRANS: tl.constexpr, TMA: tl.constexpr,
):
    """Rows start + offs_r of a slab (`_slab`), as `_load_rows` returns them: through the tensor
    memory accelerator if TMA (Hopper's bulk copies, no address per element), else by pointers."""
    if TMA:
        x = src.load([start, 0])
        if TRANS:
            x = x.T
        if UPCAST:
            x = x.to(tl.float32)
    else:
        x = _load_rows(src, offs_r, offs_d, stride_r, stride_d, n_rows, UPCAST, MASKED, TRANS)
    return x


@triton.jit
def _program(H, n_rows, BLOCK: tl.constexpr):
    """This program's place in the grid, which is one axis (`_grid`): the cdiv(n_rows, BLOCK) blocks
    of BLOCK query or key rows of (batch, head) pair 0, then pair 1's, ..., so a pair's blocks run
    side by side and share its keys and values in L2. Returns (start row, b·H + h as int64 for the
    stride math, b, h)."""
    n_blocks = tl.cdiv(n_rows, BLOCK)
    pid = tl.program_id(0)
    pid_bh = (pid // n_blocks).to(tl.int64)
    return (pid % n_blocks) * BLOCK, pid_bh, pid_bh // H, pid_bh % H


@triton.jit
def _seq_lengths(klen_ptr, qlen_ptr, b, Lq, Lk, HAS_KLEN: tl.constexpr, HAS_QLEN: tl.constexpr):
    """Key and query lengths of batch row b: the given lengths (int32 or int64) clamped to [0, Lk]
    / [0, Lq], or the full Lk / Lq. Clamping here costs the host nothing: on a GPU the entry
    point does not read the lengths back (a host sync) and passes them as given."""
    klen = Lk
    if HAS_KLEN:
        klen = tl.minimum(tl.maximum(tl.load(klen_ptr + b), 0), Lk).to(tl.int32)
    qlen = Lq
    if HAS_QLEN:
        qlen = tl.minimum(tl.maximum(tl.load(qlen_ptr + b), 0), Lq).to(tl.int32)
    return klen, qlen


@triton.jit
def _lse2(lse):
    """The saved lse in log2 units, +inf where it is -inf (no visible key, or a row at or past qlen),
    so P = exp2(s - lse2) = 0 there."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _lse2_delta(lse2_base, delta_base, offs_m, Lq, MASKED: tl.constexpr):
    """The rows offs_m's lse in log2 units (`_lse2`, from the preprocessing pass) and their δ; rows
    >= Lq read as +inf and 0 (MASKED only: an unmasked block lies inside [0, Lq))."""
    if MASKED:
        lse2 = tl.load(lse2_base + offs_m, mask=offs_m < Lq, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < Lq, other=0.0)
    else:
        lse2 = tl.load(lse2_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    return lse2, delta


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attention_fwd_inner(
    acc, l_i, m_i, q,  # running state (BLOCK_M, D) fp32, (BLOCK_M,), (BLOCK_M,); q tile
    k_base, v_base,  # k, v pointers at (b, h, 0, 0)
    stride_k_l, stride_k_d, stride_v_l, stride_v_d,
    offs_m, offs_d, lo, hi, klen, shift, qk_scale,
    dropout_p, seed, rng_base, Lk,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Key blocks [lo, hi): MASKED=False only where every (row, col) of the tile is visible.
    k_base, v_base: the key and value slabs (`_slab`)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _stream_rows(k_base, start_n, offs_n, offs_d, stride_k_l, stride_k_d, klen, UPCAST, MASKED, True,
                          TMA)  # (D, BLOCK_N)
        v = _stream_rows(v_base, start_n, offs_n, offs_d, stride_v_l, stride_v_d, klen, UPCAST, MASKED, False,
                         TMA)  # (BLOCK_N, D)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) raw scores
        if MASKED:
            visible = offs_n[None, :] < klen
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
            s = tl.where(visible, qk * qk_scale, float("-inf"))  # log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible yet keeps m = -inf: subtract 0, not -inf (NaN)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_new_safe[:, None])
        else:
            # qk_scale >= 0 (the entry checks scale), so the scaled row max is the row max scaled, and
            # each element costs one FMA, not a multiply kept for the max and then a subtraction
            # (sm_90 SASS of the bf16 D128 128x64 loop: 351 -> 321 instructions an iteration)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_new_safe = m_new
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)  # rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax denominator ignores dropout
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], Lk, dropout_p)
            p = tl.where(keep, p, 0.0)  # 1/(1 - p) is applied once, in the epilogue
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_DNS)
def _attention_fwd_kernel(
    q_ptr,  # (B, H, Lq, D) queries
    k_ptr,  # (B, H, Lk, D) keys
    v_ptr,  # (B, H, Lk, D) values
    o_ptr,  # (B, H, Lq, D) output, q's dtype
    lse_ptr,  # (B, H, Lq) fp32 row log-sum-exp, contiguous
    klen_ptr,  # (B,) int32/int64 key lengths (read only if HAS_KLEN)
    qlen_ptr,  # (B,) int32/int64 query lengths (read only if HAS_QLEN)
    stride_q_b, stride_q_h, stride_q_l, stride_q_d,
    stride_k_b, stride_k_h, stride_k_l, stride_k_d,
    stride_v_b, stride_v_h, stride_v_l, stride_v_d,
    stride_o_b, stride_o_h, stride_o_l, stride_o_d,
    H, Lq, Lk,  # heads, query length, key length
    qk_scale,  # scale · log2(e)
    dropout_p,  # dropout probability
    rng_ptr,  # (2,) int64 Philox [seed, counter offset] (read only if HAS_DROPOUT)
    LQ_KEY, LK_KEY,  # autotune keys only: next_power_of_2(Lq), next_power_of_2(Lk)
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KLEN: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m, pid_bh, b, h = _program(H, Lq, BLOCK_M)
    klen, qlen = _seq_lengths(klen_ptr, qlen_ptr, b, Lq, Lk, HAS_KLEN, HAS_QLEN)
    shift = Lk - Lq  # query row i sits at key position i + shift
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(q_ptr + b * stride_q_b + h * stride_q_h, offs_m, offs_d, stride_q_l, stride_q_d, Lq, UPCAST)
    # Keys [0, n_full) are visible to every row of this block (no masking), [n_full, n_end) to some.
    n_full, n_end = attention_key_bounds(start_m, klen, qlen, shift, IS_CAUSAL, BLOCK_M, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = _slab(k_ptr + b * stride_k_b + h * stride_k_h, klen, stride_k_l, HEAD_DIM, BLOCK_N, TMA)
    v_base = _slab(v_ptr + b * stride_v_b + h * stride_v_h, klen, stride_v_l, HEAD_DIM, BLOCK_N, TMA)
    seed, rng_offset = load_dropout_rng(rng_ptr, HAS_DROPOUT)
    rng_base = rng_offset + pid_bh * Lq * Lk
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_k_l, stride_k_d, stride_v_l, stride_v_d,
        offs_m, offs_d, 0, n_full, klen, shift, qk_scale, dropout_p, seed, rng_base, Lk,
        BLOCK_N, IS_CAUSAL, False, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_k_l, stride_k_d, stride_v_l, stride_v_d,
        offs_m, offs_d, n_full, n_end, klen, shift, qk_scale, dropout_p, seed, rng_base, Lk,
        BLOCK_N, IS_CAUSAL, True, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )

    # Epilogue: rows with no visible key (l = 0) and rows at or past qlen give 0 and lse = -inf; a NaN
    # l (a NaN score: a NaN in q, or +inf - inf) stays NaN in out and lse, as in the reference's softmax.
    row_ok = (offs_m < qlen) & (l_i != 0.0)
    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    out = tl.where(row_ok[:, None], out, 0.0)
    lse = tl.where(row_ok, (m_i + tl.math.log2(l_safe)) / LOG2E, float("-inf"))
    _store_rows(o_ptr + b * stride_o_b + h * stride_o_h, offs_m, offs_d, stride_o_l, stride_o_d, Lq, out)
    tl.store(lse_ptr + pid_bh * Lq + offs_m, lse, mask=offs_m < Lq)


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _dropout_mask_kernel(
    mask_ptr,  # (B, H, Lq, Lk) int8 keep mask, contiguous (debug path)
    Lq, Lk, dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, counter offset], as the attention kernels read it
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Writes the keep mask the attention kernels use, from the same `dropout_keep` counters."""
    seed, rng_offset = load_dropout_rng(rng_ptr, True)
    start_m, pid_bh, _, _ = _program(1, Lq, BLOCK_M)  # axis 0 as `_grid`'s, key blocks on axis 1
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed, rng_offset + pid_bh * Lq * Lk, offs_m[:, None], offs_n[None, :], Lk, dropout_p)
    ptrs = mask_ptr + pid_bh * Lq * Lk + offs_m[:, None].to(tl.int64) * Lk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["H", "Lq"])
def _attention_bwd_preprocess_kernel(
    o_ptr,  # (B, H, Lq, D) forward output
    do_ptr,  # (B, H, Lq, D) gradient of the output
    lse_ptr,  # (B, H, Lq) fp32 the forward's row log-sum-exp, contiguous
    delta_ptr,  # (B, H, Lq) fp32 out: δ = rowsum(dO ∘ O), contiguous
    lse2_ptr,  # (B, H, Lq) fp32 out: lse in log2 units, +inf for -inf (`_lse2`), contiguous
    stride_o_b, stride_o_h, stride_o_l, stride_o_d,
    stride_do_b, stride_do_h, stride_do_l, stride_do_d,
    H, Lq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """δ, and lse in the form the dK/dV and dQ loops read it, once a row rather than once a row and
    key block (the dK/dV loop reads every query row once for each of its key blocks)."""
    start_m, pid_bh, b, h = _program(H, Lq, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = _load_rows(o_ptr + b * stride_o_b + h * stride_o_h, offs_m, offs_d, stride_o_l, stride_o_d, Lq, False)
    do = _load_rows(do_ptr + b * stride_do_b + h * stride_do_h, offs_m, offs_d, stride_do_l, stride_do_d, Lq, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = pid_bh * Lq + offs_m
    tl.store(delta_ptr + rows, delta, mask=offs_m < Lq)
    tl.store(lse2_ptr + rows, _lse2(tl.load(lse_ptr + rows, mask=offs_m < Lq, other=0.0)), mask=offs_m < Lq)


@triton.jit
def _attention_bwd_dkdv_inner(
    dk, dv, k, v,  # accumulators (BLOCK_N, D) fp32; resident k, v tiles (BLOCK_N, D)
    q_base, do_base, lse2_base, delta_base,  # pointers at (b, h, 0, 0) / (b, h, 0)
    stride_q_l, stride_q_d, stride_do_l, stride_do_d,
    offs_n, offs_d, lo, hi, klen, qlen, Lq, shift, qk_scale,
    dropout_p, seed, rng_base, Lk,
    BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Query blocks [lo, hi) against one key block; tiles are transposed (keys × queries).
    q_base, do_base: the query and output-gradient slabs (`_slab`)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _stream_rows(q_base, start_m, offs_m, offs_d, stride_q_l, stride_q_d, qlen, UPCAST, MASKED, True,
                          TMA)  # (D, BLOCK_M)
        do = _stream_rows(do_base, start_m, offs_m, offs_d, stride_do_l, stride_do_d, Lq, UPCAST, MASKED, False,
                          TMA)  # (BLOCK_M, D)
        lse2, delta = _lse2_delta(lse2_base, delta_base, offs_m, Lq, MASKED)
        sT = tl.dot(k, qT, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(sT - lse2[None, :])  # Pᵀ
        if MASKED:
            visible = offs_n[:, None] < klen
            if IS_CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + shift)
            pT = tl.where(visible, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dPdᵀ = V dOᵀ
        if HAS_DROPOUT:
            keepT = dropout_keep(seed, rng_base, offs_m[None, :], offs_n[:, None], Lk, dropout_p)
            rp = 1.0 / (1.0 - dropout_p)
            pdT = tl.where(keepT, pT * rp, 0.0)  # (P∘Z·r)ᵀ
            dpT = tl.where(keepT, dpT * rp, 0.0)  # dPᵀ
        else:
            pdT = pT
        dv = tl.dot(pdT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += (P∘Z·r)ᵀ dO
        dsT = pT * (dpT - delta[None, :])  # dSᵀ
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)  # dK += dSᵀ Q
    return dk, dv


@triton.jit(do_not_specialize=_DNS)
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D) forward inputs
    do_ptr,  # (B, H, Lq, D) gradient of the output
    lse2_ptr, delta_ptr,  # (B, H, Lq) fp32, contiguous: the preprocessing pass's
    dk_ptr, dv_ptr,  # (B, H, Lk, D) outputs, k's dtype
    klen_ptr, qlen_ptr,  # (B,) int32/int64 lengths (read only if HAS_KLEN / HAS_QLEN)
    stride_q_b, stride_q_h, stride_q_l, stride_q_d,
    stride_k_b, stride_k_h, stride_k_l, stride_k_d,
    stride_v_b, stride_v_h, stride_v_l, stride_v_d,
    stride_do_b, stride_do_h, stride_do_l, stride_do_d,
    stride_dk_b, stride_dk_h, stride_dk_l, stride_dk_d,
    stride_dv_b, stride_dv_h, stride_dv_l, stride_dv_d,
    H, Lq, Lk, sm_scale, qk_scale,  # sm_scale = scale; qk_scale = scale · log2(e)
    dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, counter offset], the forward's (read only if HAS_DROPOUT)
    LQ_KEY, LK_KEY,  # autotune keys only
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KLEN: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n, pid_bh, b, h = _program(H, Lk, BLOCK_N)
    klen, qlen = _seq_lengths(klen_ptr, qlen_ptr, b, Lq, Lk, HAS_KLEN, HAS_QLEN)
    shift = Lk - Lq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(k_ptr + b * stride_k_b + h * stride_k_h, offs_n, offs_d, stride_k_l, stride_k_d, klen, UPCAST)
    v = _load_rows(v_ptr + b * stride_v_b + h * stride_v_h, offs_n, offs_d, stride_v_l, stride_v_d, klen, UPCAST)

    # Query blocks [m_lo, qlen) can see this key block (none if it lies past key_lengths).
    # Masking is needed in [m_lo, m_mid) (the causal diagonal; everything if the key block is
    # partial) and in the tail [m_tail, qlen) (rows past Lq); [m_mid, m_tail) runs unmasked.
    # Rows in [qlen, Lq) lie only in the masked tail, which reads their q as zeros (the slab ends at
    # qlen: a NaN there would reach P) and their saved lse as -inf, so P = 0 there.
    m_hi = tl.where(start_n < klen, qlen, 0)
    m_lo = 0
    m_mid = 0
    if IS_CAUSAL:
        m_lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
        m_mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
    m_lo = tl.minimum(m_lo, m_hi)
    m_mid = tl.where(start_n + BLOCK_N <= klen, m_mid, m_hi)
    m_tail = tl.maximum((m_hi // BLOCK_M) * BLOCK_M, m_lo)
    m_mid = tl.minimum(tl.maximum(m_mid, m_lo), m_tail)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_base = _slab(q_ptr + b * stride_q_b + h * stride_q_h, qlen, stride_q_l, HEAD_DIM, BLOCK_M, TMA)
    do_base = _slab(do_ptr + b * stride_do_b + h * stride_do_h, Lq, stride_do_l, HEAD_DIM, BLOCK_M, TMA)
    lse2_base = lse2_ptr + pid_bh * Lq
    delta_base = delta_ptr + pid_bh * Lq
    seed, rng_offset = load_dropout_rng(rng_ptr, HAS_DROPOUT)
    rng_base = rng_offset + pid_bh * Lq * Lk
    dk, dv = _attention_bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_q_l, stride_q_d,
        stride_do_l, stride_do_d, offs_n, offs_d, m_lo, m_mid, klen, qlen, Lq, shift, qk_scale,
        dropout_p, seed, rng_base, Lk, BLOCK_M, IS_CAUSAL, True, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )
    dk, dv = _attention_bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_q_l, stride_q_d,
        stride_do_l, stride_do_d, offs_n, offs_d, m_mid, m_tail, klen, qlen, Lq, shift, qk_scale,
        dropout_p, seed, rng_base, Lk, BLOCK_M, IS_CAUSAL, False, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )
    dk, dv = _attention_bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_q_l, stride_q_d,
        stride_do_l, stride_do_d, offs_n, offs_d, m_tail, m_hi, klen, qlen, Lq, shift, qk_scale,
        dropout_p, seed, rng_base, Lk, BLOCK_M, IS_CAUSAL, True, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )
    dk = dk * sm_scale
    _store_rows(dk_ptr + b * stride_dk_b + h * stride_dk_h, offs_n, offs_d, stride_dk_l, stride_dk_d, Lk, dk)
    _store_rows(dv_ptr + b * stride_dv_b + h * stride_dv_h, offs_n, offs_d, stride_dv_l, stride_dv_d, Lk, dv)


@triton.jit
def _attention_bwd_dq_inner(
    dq, q, do, lse2, delta,  # accumulator (BLOCK_M, D) fp32; resident q, dO tiles; lse·log2 e, δ
    k_base, v_base, stride_k_l, stride_k_d, stride_v_l, stride_v_d,
    offs_m, offs_d, lo, hi, klen, shift, qk_scale,
    dropout_p, seed, rng_base, Lk,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Key blocks [lo, hi) against one query block; k_base, v_base: the key and value slabs (`_slab`)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _stream_rows(k_base, start_n, offs_n, offs_d, stride_k_l, stride_k_d, klen, UPCAST, MASKED, True,
                          TMA)  # (D, BLOCK_N)
        vT = _stream_rows(v_base, start_n, offs_n, offs_d, stride_v_l, stride_v_d, klen, UPCAST, MASKED, True,
                          TMA)  # (D, BLOCK_N)
        s = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])  # P
        if MASKED:
            visible = offs_n[None, :] < klen
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)  # dPd = dO Vᵀ
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], Lk, dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)  # dP
        ds = p * (dp - delta[:, None])  # dS
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)  # dQ += dS K
    return dq


@triton.jit(do_not_specialize=_DNS)
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D) forward inputs
    do_ptr,  # (B, H, Lq, D) gradient of the output
    lse2_ptr, delta_ptr,  # (B, H, Lq) fp32, contiguous: the preprocessing pass's
    dq_ptr,  # (B, H, Lq, D) output, q's dtype
    klen_ptr, qlen_ptr,  # (B,) int32/int64 lengths (read only if HAS_KLEN / HAS_QLEN)
    stride_q_b, stride_q_h, stride_q_l, stride_q_d,
    stride_k_b, stride_k_h, stride_k_l, stride_k_d,
    stride_v_b, stride_v_h, stride_v_l, stride_v_d,
    stride_do_b, stride_do_h, stride_do_l, stride_do_d,
    stride_dq_b, stride_dq_h, stride_dq_l, stride_dq_d,
    H, Lq, Lk, sm_scale, qk_scale,
    dropout_p,
    rng_ptr,  # (2,) int64 Philox [seed, counter offset], the forward's (read only if HAS_DROPOUT)
    LQ_KEY, LK_KEY,  # autotune keys only
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KLEN: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m, pid_bh, b, h = _program(H, Lq, BLOCK_M)
    klen, qlen = _seq_lengths(klen_ptr, qlen_ptr, b, Lq, Lk, HAS_KLEN, HAS_QLEN)
    shift = Lk - Lq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # Rows past qlen read as zeros (a NaN there would reach P, and so dQ): their P is 0, their dQ 0.
    q = _load_rows(q_ptr + b * stride_q_b + h * stride_q_h, offs_m, offs_d, stride_q_l, stride_q_d, qlen, UPCAST)
    do = _load_rows(do_ptr + b * stride_do_b + h * stride_do_h, offs_m, offs_d, stride_do_l, stride_do_d, Lq, UPCAST)
    lse2, delta = _lse2_delta(lse2_ptr + pid_bh * Lq, delta_ptr + pid_bh * Lq, offs_m, Lq, True)
    n_full, n_end = attention_key_bounds(start_m, klen, qlen, shift, IS_CAUSAL, BLOCK_M, BLOCK_N)  # as the forward

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = _slab(k_ptr + b * stride_k_b + h * stride_k_h, klen, stride_k_l, HEAD_DIM, BLOCK_N, TMA)
    v_base = _slab(v_ptr + b * stride_v_b + h * stride_v_h, klen, stride_v_l, HEAD_DIM, BLOCK_N, TMA)
    seed, rng_offset = load_dropout_rng(rng_ptr, HAS_DROPOUT)
    rng_base = rng_offset + pid_bh * Lq * Lk
    dq = _attention_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_k_l, stride_k_d, stride_v_l, stride_v_d,
        offs_m, offs_d, 0, n_full, klen, shift, qk_scale, dropout_p, seed, rng_base, Lk,
        BLOCK_N, IS_CAUSAL, False, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )
    dq = _attention_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_k_l, stride_k_d, stride_v_l, stride_v_d,
        offs_m, offs_d, n_full, n_end, klen, shift, qk_scale, dropout_p, seed, rng_base, Lk,
        BLOCK_N, IS_CAUSAL, True, HAS_DROPOUT, UPCAST, DOT_PRECISION, TMA,
    )
    dq = dq * sm_scale
    _store_rows(dq_ptr + b * stride_dq_b + h * stride_dq_h, offs_m, offs_d, stride_dq_l, stride_dq_d, Lq, dq)


def _autotuned(kernel, fn):
    return triton.autotune(_configs(kernel), key=_KEY, prune_configs_by={"early_config_prune": _pruner(kernel)})(fn)


_fwd = _autotuned("fwd", _attention_fwd_kernel)
_bwd_dkdv = _autotuned("dkdv", _attention_bwd_dkdv_kernel)
_bwd_dq = _autotuned("dq", _attention_bwd_dq_kernel)


# ---------------------------------------------------------------------------------------------
# host launchers
# ---------------------------------------------------------------------------------------------


# Reading lengths back to check their range is free on CPU but a host sync on a GPU (it stalls the
# stream and breaks CUDA graphs): there it runs only with SCRATCHFORMER_DEBUG=1, and the kernels
# clamp the lengths to [0, L] as they read them instead (`_seq_lengths`), which keeps them in
# bounds and gives eager's result at no host cost.
_DEBUG = os.environ.get("SCRATCHFORMER_DEBUG", "0") == "1"


def value_checks(t: torch.Tensor) -> bool:
    """Whether the range check may read t's values: on CPU, or with SCRATCHFORMER_DEBUG=1; never
    in a torch.compile trace. `scratchformer.op_checks.value_checks` is the model's twin of it (the
    kernels do not import the model's layer); tests emulate a GPU by patching both."""
    return (_DEBUG or t.device.type == "cpu") and not torch.compiler.is_compiling()


def _check_lengths(name, lengths, B, L, device):
    """Lengths (B,) int32/int64 on q's device, range-checked where that is free (see above)."""
    if lengths is None:
        return
    if not isinstance(lengths, torch.Tensor):
        raise ValueError(f"attention: {name} must be a tensor, got {type(lengths).__name__}")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"attention: {name} must be int32 or int64, got {lengths.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"attention: {name} must have shape ({B},), got {tuple(lengths.shape)}")
    if lengths.device != device:
        raise ValueError(f"attention: {name} is on {lengths.device} but q is on {device}")
    if B and value_checks(lengths):  # else no host sync
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > L:
            raise ValueError(f"attention: {name} must lie in [0, {L}], got min {lo} max {hi}")


def _check_inputs(q, k, v, key_lengths, query_lengths, causal, dropout_p, scale, seed=None):
    """The entry point's checks."""
    check_tensors("attention", q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be (B, H, L, D), got shape {tuple(t.shape)}")
    B, H, Lq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(
            f"attention: shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(need the same B, H, D and k.shape == v.shape)"
        )
    _check_device_dtype_head_dim(q, k, v)
    check_flag("attention", "causal", causal)
    check_dropout("attention", dropout_p, seed)
    _check_scale(scale)
    _check_lengths("key_lengths", key_lengths, B, k.shape[2], q.device)
    _check_lengths("query_lengths", query_lengths, B, Lq, q.device)


def check_limits(q, k, v, *, scale=None, **_):
    """What only this kernel refuses of the calls the backend-wide check (`op_checks.check_attention`,
    which `scratchformer.ops` runs first) passes: dtypes, devices, head dims and (inside a
    torch.compile trace, where that check leaves it) the scale, in `attention`'s order and with its
    messages. `attention_trusted` after both is `attention`, its inputs checked once."""
    _check_device_dtype_head_dim(q, k, v)
    _check_scale(scale)


def _check_device_dtype_head_dim(q, k, v):
    check_dtype("attention", q, k, v)
    check_device("attention", q, k, v)  # the lengths' type and device: _check_lengths, which names them
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 16, 32, 64 or 128, got {q.shape[3]}")


def _check_scale(scale):
    if scale is None:
        return
    check_number("attention", "scale", scale)
    if not 0.0 <= scale < math.inf:  # NaN fails too
        # the forward offsets each row by its maximum score times scale, the scaled maximum only for a
        # scale >= 0: a negative one would offset by the minimum, and exp2 overflows to NaN on wide rows
        raise ValueError(f"attention: scale must be a finite number >= 0, got {scale}")


def _flags(q, klen, qlen, causal, dropout_p, tma):
    up = upcast_dot(q.dtype)
    return dict(
        HEAD_DIM=q.shape[3], IS_CAUSAL=bool(causal), HAS_KLEN=klen is not None,
        HAS_QLEN=qlen is not None, HAS_DROPOUT=dropout_p > 0.0, UPCAST=up,
        DOT_PRECISION="ieee" if (q.dtype == torch.float32 or up) else "tf32", TMA=tma,
    )


def _tune_key(q, klen, qlen, causal, keys, tma):
    """What the Autotuner keys a choice on (`_KEY`'s values, `keys` = _keys(Lq, Lk) among them, and
    the tensors' dtypes), for `launch_tuned`; q, k, v and the output share one dtype, lse is fp32."""
    return (*keys, q.shape[3], bool(causal), tma, q.dtype, klen is not None and klen.dtype,
            qlen is not None and qlen.dtype)


def _tma(*tensors: torch.Tensor) -> bool:
    """Whether the kernels stream these (B, H, L, D) tensors' blocks through tensor descriptors
    (`TMA`): on for their device (under `auto`, from head dim TMA_MIN_HEAD_DIM up), and every
    one's rows addressable at every (batch, head) and row (`tma_rows_ok`). Sets Triton's
    allocator, which gives the descriptors their global memory."""
    if TMA is None and tensors[0].shape[-1] < TMA_MIN_HEAD_DIM:
        return False
    if not tma_enabled(TMA, tensors[0].device):
        return False
    if not all(tma_rows_ok(t, t.stride(2), t.stride(0), t.stride(1)) for t in tensors):  # rows; (batch, head)
        return False
    triton.set_allocator(tma_scratch)  # a context variable: set in the launching thread (autograd's too)
    return True


def _grid(n_rows, pairs, block):
    """The launch grid `_program` reads: cdiv(n_rows, BLOCK) row blocks for each of the B·H (batch,
    head) pairs, all on CUDA's first axis, whose limit is 2³¹ - 1 programs; the other axes stop at
    65,535, which B·H passes with a large batch or beam (1,024 sentences x beam 4 x 16 heads).
    block: BLOCK, or the name of the config's block size (an autotuned launch's grid is a function)."""
    if isinstance(block, int):
        return (cdiv(n_rows, block) * pairs,)
    return lambda meta: (cdiv(n_rows, meta[block]) * pairs,)


def _keys(Lq, Lk):
    """Autotune keys: lengths bucketed to powers of two, at least 64 (every config's tiles are 32 to
    128, so shorter lengths, decoding's single query among them, are all one or two tiles)."""
    return max(next_pow2(Lq), 64), max(next_pow2(Lk), 64)


def attention_fwd(q, k, v, key_lengths=None, query_lengths=None, causal=False, dropout_p=0.0,
                  scale=None, rng=None):
    """Forward launcher. Returns out (B, H, Lq, D) in q's dtype with BLHD memory (a transposed
    (B, Lq, H, D) tensor, so out.transpose(1, 2).reshape(B, Lq, H·D) is free) and lse (B, H, Lq)
    fp32, contiguous. rng: the (2,) int64 [seed, offset] tensor on q's device (`dropout_rng`),
    needed when dropout_p > 0. Trusts its inputs as `attention` checked them (lengths contiguous
    int32/int64)."""
    klen, qlen = key_lengths, query_lengths
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    dummy = lse  # never read when HAS_KLEN / HAS_QLEN / HAS_DROPOUT is False
    grid = _grid(Lq, B * H, "BLOCK_M")
    keys = _keys(Lq, Lk)
    tma = _tma(k, v)
    launch_tuned(
        _fwd, grid, _tune_key(q, klen, qlen, causal, keys, tma),
        q, k, v, out, lse, dummy if klen is None else klen, dummy if qlen is None else qlen,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, Lq, Lk, scale * LOG2E.value, float(dropout_p), rng if dropout_p > 0.0 else dummy, *keys,
        **_flags(q, klen, qlen, causal, dropout_p, tma),
    )
    return out, lse


def attention_bwd(do, q, k, v, out, lse, key_lengths=None, query_lengths=None, causal=False,
                  dropout_p=0.0, scale=None, rng=None):
    """Backward launcher: (dq, dk, dv) shaped like q, k, v (BLHD memory, like the output).
    Lengths as attention_fwd takes them (contiguous int32/int64; the kernels clamp them); rng the
    forward's, whose mask the kernels replay."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    dk = torch.empty(B, Lk, H, D, dtype=k.dtype, device=k.device).transpose(1, 2)
    dv = torch.empty(B, Lk, H, D, dtype=v.dtype, device=v.device).transpose(1, 2)
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    if B * H == 0:
        return dq, dk, dv
    if Lq == 0 or Lk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # two allocations, not one split: each starts 16-byte aligned, so the kernels, which Triton
    # specialises on a pointer's alignment, compile once for every length (tests/test_compile_budget.py)
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    _attention_bwd_preprocess_kernel[_grid(Lq, B * H, 64)](
        out, do, lse, delta, lse2, *out.stride(), *do.stride(), H, Lq, HEAD_DIM=D, BLOCK_M=64,
    )
    dummy = lse
    klen = key_lengths
    qlen = query_lengths
    keys = _keys(Lq, Lk)
    common = (H, Lq, Lk, scale, scale * LOG2E.value, float(dropout_p), rng if dropout_p > 0.0 else dummy, *keys)
    tma = _tma(q, k, v, do)
    flags = _flags(q, klen, qlen, causal, dropout_p, tma)
    lens = (dummy if klen is None else klen, dummy if qlen is None else qlen)
    tune_key = _tune_key(q, klen, qlen, causal, keys, tma)
    launch_tuned(
        _bwd_dkdv, _grid(Lk, B * H, "BLOCK_N"), tune_key,
        q, k, v, do, lse2, delta, dk, dv, *lens,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        *common, **flags,
    )
    launch_tuned(
        _bwd_dq, _grid(Lq, B * H, "BLOCK_M"), tune_key,
        q, k, v, do, lse2, delta, dq, *lens,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        *common, **flags,
    )
    return dq, dk, dv


def dropout_mask(B, H, Lq, Lk, dropout_p, rng, device):
    """The keep mask (B, H, Lq, Lk) bool the kernels use for the [seed, offset] in rng (a (2,)
    int64 tensor on `device`, `dropout_rng`'s): the debug path."""
    mask = torch.empty(B, H, Lq, Lk, dtype=torch.int8, device=device)
    if mask.numel():
        grid = (_grid(Lq, B * H, 64)[0], cdiv(Lk, 64))
        _dropout_mask_kernel[grid](mask, Lq, Lk, float(dropout_p), rng, BLOCK_M=64, BLOCK_N=64)
    return mask.bool()


# ---------------------------------------------------------------------------------------------
# torch ops: scratchformer::attention and scratchformer::attention_backward, and the
# autograd.Function linking them (why ops, and why autograd outside them: kernels/_common.py).
# The launchers autotune with early_config_prune hooks and grid lambdas. An op is opaque to the
# compiler: dynamo and
# AOTAutograd see one node with the fake impl's shapes, Inductor calls the launcher at run time
# (autotuning happens there, during CUDA-graph warm-up), and torch.export keeps the node.
# Nothing is lost by opacity: the kernel is already fused, and its inputs need no fusion.
# ---------------------------------------------------------------------------------------------


@define_op(
    "attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? query_lengths, bool causal, "
    "float dropout_p, float? scale, Tensor? rng) -> (Tensor, Tensor)",
)
def _attention_op(q, k, v, key_lengths, query_lengths, causal, dropout_p, scale, rng):
    """out (B, H, Lq, D) with BLHD memory, lse (B, H, Lq) fp32. Lengths are trusted (the public
    entry point range-checks them); dropout is a pure function of rng's (seed, offset) (a (2,)
    int64 tensor on q's device; None without dropout)."""
    return attention_fwd(q, k, v, key_lengths, query_lengths, causal, dropout_p, scale, rng)


@torch.library.register_fake(_attention_op)
def _(q, k, v, key_lengths, query_lengths, causal, dropout_p, scale, rng):
    B, H, Lq, D = q.shape
    out = q.new_empty(B, Lq, H, D).transpose(1, 2)  # BLHD memory viewed as BHLD, like the kernel's
    return out, q.new_empty(B, H, Lq, dtype=torch.float32)


@define_op(
    "attention_backward",
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_lengths, "
    "Tensor? query_lengths, bool causal, float dropout_p, float? scale, Tensor? rng) "
    "-> (Tensor, Tensor, Tensor)",
)
def _attention_backward_op(dout, q, k, v, out, lse, key_lengths, query_lengths, causal, dropout_p, scale, rng):
    """(dq, dk, dv) shaped like q, k, v, in BLHD memory; the dropout mask is replayed from the
    forward's rng tensor."""
    return attention_bwd(dout, q, k, v, out, lse, key_lengths, query_lengths, causal, dropout_p, scale, rng)


@torch.library.register_fake(_attention_backward_op)
def _(dout, q, k, v, out, lse, key_lengths, query_lengths, causal, dropout_p, scale, rng):
    def blhd(t):
        B, H, L, D = t.shape
        return t.new_empty(B, L, H, D).transpose(1, 2)
    return blhd(q), blhd(k), blhd(v)


def _setup_context(ctx, inputs, output):
    """scratchformer::attention's autograd (`op_autograd`): its backward op, with the forward's
    inputs; the rng tensor is saved, so the backward replays the forward's dropout mask."""
    q, k, v, key_lengths, query_lengths, causal, dropout_p, scale, rng = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # out is the only differentiable output: no zero dlse built
    if any(ctx.needs_input_grad[:3]):  # the backward needs all of them, or nothing
        ctx.save_for_backward(q, k, v, out, lse, key_lengths, query_lengths, rng)
    ctx.args = (causal, dropout_p, scale)


def _backward(ctx, dout, dlse):  # lse is not differentiable: dlse is ignored
    q, k, v, out, lse, key_lengths, query_lengths, rng = ctx.saved_tensors
    dq, dk, dv = call_op(_attention_backward_op, dout, q, k, v, out, lse, key_lengths, query_lengths, *ctx.args, rng)
    return dq, dk, dv, None, None, None, None, None, None  # one slot per forward input


AttentionFunction = op_autograd("AttentionFunction", _attention_op, _attention_backward_op, _setup_context, _backward)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    return_lse: bool = False,
    return_dropout_mask: bool = False,
    seed: int | None = None,
):
    """Fused attention softmax(q kᵀ · scale) v, differentiable w.r.t. q, k, v.

    q (B, H, Lq, D), k and v (B, H, Lk, D): any strides, one dtype among fp32/fp16/bf16, D in
    {16, 32, 64, 128}, CUDA tensors (or CPU under TRITON_INTERPRET=1). key_lengths /
    query_lengths (B,) int32/int64 in [0, L]: right padding. causal aligns bottom-right (query i
    at key position Lk - Lq + i). scale (finite, >= 0) defaults to 1/sqrt(D). dropout_p in [0, 1) drops
    attention probabilities with an in-kernel Philox mask; seed (int) fixes the stream,
    otherwise its (seed, offset) is drawn on q's device from torch's generator for that device
    (`_common.dropout_rng`: `torch.manual_seed` makes runs reproducible, and each call, CUDA graph
    replay or compiled call draws afresh). Raises ValueError naming a bad input;
    the lengths' range is checked where reading it is free (CPU) or with SCRATCHFORMER_DEBUG=1,
    and elsewhere clamped to [0, L] (no host sync).

    Returns out (B, H, Lq, D) in q's dtype, laid out as a (B, Lq, H, D) tensor transposed; rows
    with no visible key and rows at or past query_lengths are zeros. With return_lse also the
    row log-sum-exp (B, H, Lq) fp32 (-inf where out is zeroed; not differentiable); with
    return_dropout_mask (debug) also the keep mask (B, H, Lq, Lk) bool, True = kept:
    out, or (out, lse), (out, mask), (out, lse, mask).
    """
    _check_inputs(q, k, v, key_lengths, query_lengths, causal, dropout_p, scale, seed)
    for arg, flag in (("return_lse", return_lse), ("return_dropout_mask", return_dropout_mask)):
        check_flag("attention", arg, flag)
    return attention_trusted(q, k, v, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal,
                             dropout_p=dropout_p, scale=scale, return_lse=return_lse,
                             return_dropout_mask=return_dropout_mask, seed=seed)


def attention_trusted(q, k, v, *, key_lengths=None, query_lengths=None, causal=False, dropout_p=0.0, scale=None,
                      return_lse=False, return_dropout_mask=False, seed=None):
    """`attention` without its checks, for a caller that ran them: `scratchformer.ops`, whose check
    (`op_checks.check_attention`) and `check_limits` refuse every call its checks would."""
    klen = key_lengths if key_lengths is None else key_lengths.contiguous()  # as the kernels read them
    qlen = query_lengths if query_lengths is None else query_lengths.contiguous()
    rng = dropout_rng(dropout_p, seed, q.device)
    if qlen is not None and qlen is klen and torch.compiler.is_compiling():
        qlen = qlen.clone()  # dynamo (torch 2.13) cannot trace an autograd.Function given one tensor twice
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    args = (q, k, v, klen, qlen, bool(causal), float(dropout_p), None if scale is None else float(scale), rng)
    out, lse = AttentionFunction.apply(*args) if needs_grad else call_op(_attention_op, *args)  # no gradient: the op
    extra = (lse,) if return_lse else ()
    if return_dropout_mask:
        B, H, Lq, _ = q.shape
        Lk = k.shape[2]
        if dropout_p > 0.0:
            mask = dropout_mask(B, H, Lq, Lk, dropout_p, rng, q.device)
        else:
            mask = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=q.device)
        extra = extra + (mask,)
    return (out, *extra) if extra else out
