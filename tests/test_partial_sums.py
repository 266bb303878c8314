"""The second stage of the two-stage column reductions (kernels/partial_sums.py) against float64
sums, at the interpreter's tile and, forced, at the GPU's (tall, 32 columns wide, several row
blocks a program), and its determinism; on a GPU the same cases run compiled.

Its callers' gradients (add+LayerNorm's dweight and dbias, the FFN's db1) are checked against the
eager reference in test_add_layer_norm.py and test_ffn.py.
"""

import pytest
import torch
from conftest import DEVICE, INTERPRET

from scratchformer.kernels import partial_sums as PS

SHAPES = [(1, 1), (4, 48), (5, 33), (528, 512), (1000, 70), (7, 2049)]
# fp32 sums of P values of |x| ~ 1 against float64: the order differs, so ~P ulps at worst; the
# half-precision outputs are one rounding of the fp32 sum
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


def _partials(P, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(P, N, generator=g).to(DEVICE), torch.randn(P, N, generator=g).to(DEVICE))


@pytest.mark.parametrize("tile", ["own", "gpu"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{p}x{n}" for p, n in SHAPES])
def test_sums_match_float64(shape, tile, monkeypatch):
    """Both buffers summed over their rows in one launch, fp32 out: the float64 sums."""
    if tile == "gpu" and not INTERPRET:
        pytest.skip("on a GPU the own tile is the GPU's")
    monkeypatch.setattr(PS, "INTERPRET", tile == "own" and INTERPRET)
    a, b = _partials(*shape)
    sa, sb = PS.sum_partials(a, b, torch.float32)
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(sa.double(), a.double().sum(0), atol=atol * shape[0] ** 0.5, rtol=rtol)
    torch.testing.assert_close(sb.double(), b.double().sum(0), atol=atol * shape[0] ** 0.5, rtol=rtol)


def test_gpu_tile_loops_over_row_blocks(monkeypatch):
    """The GPU tile of 528 partial rows (4 programs an SM on an H100) takes more than one row block
    a program, and a 2,049-wide row more than one program: the forced-tile cases above run both
    the loop and the column grid."""
    monkeypatch.setattr(PS, "INTERPRET", False)
    block_p, block_n, _ = PS._tile(528, 2049)
    assert block_n == PS.GPU_BLOCK_N and block_p < 528 and -(-2049 // block_n) > 1
    assert PS._tile(5, 512) == PS._tile(528, 512)  # one tile whatever the batch's rows (a compile each)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_outputs_are_the_rounded_fp32_sum(dtype):
    """Half-precision outputs: the fp32 sum rounded once (as `partial.sum(0).to(dtype)`), one buffer."""
    a, _ = _partials(300, 96)
    sa, sb = PS.sum_partials(a, None, dtype)
    assert sb is None and sa.dtype == dtype and sa.shape == (96,)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(sa.float(), a.double().sum(0).to(dtype).float(), atol=atol, rtol=rtol)


def test_deterministic_and_zero_width():
    """The same partials give the same bits on every call (a fixed order, no atomics); N = 0
    gives empty sums without a launch."""
    a, b = _partials(528, 512, seed=3)
    first = PS.sum_partials(a, b, torch.float32)
    for _ in range(2):
        again = PS.sum_partials(a, b, torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(first, again))
    empty = torch.empty(4, 0, device=DEVICE)
    sa, sb = PS.sum_partials(empty, empty, torch.bfloat16)
    assert sa.shape == (0,) and sb.shape == (0,) and sa.dtype == torch.bfloat16
