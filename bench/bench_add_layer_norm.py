"""add + LayerNorm throughput: GB/s of the bytes that must move, per kernel (triton,
triton-pinned, torch, compile, eager).

kernel: triton = our fused kernel (kernels/add_layer_norm.py), autotuned; triton-pinned = the same
with the tiles a GPU pins without tuning (SCRATCHFORMER_AUTOTUNE=0: the recipes' training), at N
512 and 1024; torch = `F.layer_norm` after an add (ops' "torch" backend); compile =
`torch.compile` of that same function (static shapes, compiled afresh per case); eager = the
reference in plain tensor ops. bf16, rows 16k-64k, hidden 512-8192 (issue 16), with a residual
and a bias, no dropout.

Bytes that must move (e = 2 bytes, params ignored):
  fwd      read x, residual; write y                                  3 · M · N · e
  fwd+bwd  + read dy and the saved sum s; write dx (= dresidual)      6 · M · N · e
  bwd      the backward alone, after one forward: read dy, s; write dx  3 · M · N · e
Ours also writes s in the forward when a gradient is needed (7 · M · N · e in fwd+bwd), so the
fwd+bwd GB/s understates its traffic by 1/7; it is what the op costs relative to the minimum.
bwd times the backward by itself (`torch.autograd.grad(..., retain_graph=True)` of one saved
forward), which fwd+bwd's figure mixes with the forward's.
`test_copy_bandwidth` records the device's measured copy bandwidth, the roof for these numbers.
GPU only: everything here is skipped without CUDA.
"""

import functools

import pytest
import torch
from conftest import copy_bandwidth_gbps, requires_cuda, run_bench
from torch._functorch import config as functorch_config

from scratchformer import ops

pytestmark = [pytest.mark.benchmark(group="add_layer_norm"), requires_cuda]

DTYPE = torch.bfloat16
_roof_gbps = functools.lru_cache(maxsize=None)(copy_bandwidth_gbps)  # measure once per run


def test_copy_bandwidth(benchmark):
    """The roof: device-to-device copy GB/s (read + write), in extra_info."""
    gbps = _roof_gbps()
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    run_bench(benchmark, lambda: dst.copy_(src), nbytes=2 * src.numel(), copy_bandwidth_gbps=gbps, what="roof")


def _add_layer_norm(kernel):
    if kernel != "compile":
        return ops.select(kernel.removesuffix("-pinned"), "cuda").add_layer_norm
    torch._dynamo.reset()  # a fresh compile per case: no recompile limit across the sweep's shapes
    return torch.compile(ops.select("torch", "cuda").add_layer_norm, dynamic=False)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd", "bwd"])
@pytest.mark.parametrize("kernel", ["triton", "triton-pinned", "torch", "compile", "eager"])
@pytest.mark.parametrize("N", [512, 1024, 4096, 8192])
@pytest.mark.parametrize("rows", [16384, 65536])
def test_add_layer_norm(benchmark, rows, N, kernel, mode, monkeypatch):
    autotune = None  # run_bench's default: the process's setting
    if kernel == "triton-pinned":
        if N not in (512, 1024):
            pytest.skip("the pinned tiles are raced against the tuned ones at N 512 and 1024")
        from scratchformer.kernels import add_layer_norm as LN  # after requires_cuda: GPU only

        monkeypatch.setattr(LN, "AUTOTUNE", False)
        autotune = LN.AUTOTUNE  # what its launchers read (the environment still says tuned)
    add_layer_norm = _add_layer_norm(kernel)
    grad = mode != "fwd"
    x = torch.randn(rows, N, device="cuda", dtype=DTYPE, requires_grad=grad)
    r = torch.randn(rows, N, device="cuda", dtype=DTYPE, requires_grad=grad)
    w = torch.randn(N, device="cuda", dtype=DTYPE, requires_grad=grad)
    b = torch.randn(N, device="cuda", dtype=DTYPE, requires_grad=grad)
    dy = torch.randn(rows, N, device="cuda", dtype=DTYPE)

    def fwd():
        with torch.no_grad():
            return add_layer_norm(x, r, w, b, 1e-5)

    def fwd_bwd():
        y = add_layer_norm(x, r, w, b, 1e-5)
        return torch.autograd.grad(y, (x, r, w, b), dy)

    if mode == "bwd":
        timed = _backward_alone(lambda: add_layer_norm(x, r, w, b, 1e-5), (x, r, w, b), dy)
    else:
        timed = fwd if mode == "fwd" else fwd_bwd

    e = x.element_size()
    nbytes = (6 if mode == "fwd_bwd" else 3) * rows * N * e
    run_bench(
        benchmark, timed, nbytes=nbytes, autotune=autotune,
        rows=rows, N=N, kernel=kernel, mode=mode, dtype=DTYPE, copy_bandwidth_gbps=_roof_gbps(),
    )


def _backward_alone(forward, inputs, dy):
    """-> a call that runs the backward of one saved forward() again (`retain_graph`), its output's
    gradient dy. The forward runs once per stream the call is first made on: autograd runs a
    backward op on its forward's stream, and a CUDA graph captured on a side stream cannot take in
    work of the default (legacy) stream ("operation would make the legacy stream depend on a
    capturing blocking stream": the 16384 x 512 `bwd` case's capture, three windows running), so
    graph_time's warm-up on the capture's stream redoes the forward there, outside the capture.
    A compiled forward must not donate its saved buffers to a backward run more than once (the
    seventh window's compile-bwd case failed so: "compiled with non-empty donated buffers which
    requires ... retain_graph=False")."""
    saved = {}

    def timed():
        stream = torch.cuda.current_stream()
        if saved.get("stream") != stream:
            with functorch_config.patch(donated_buffer=False):
                saved.update(stream=stream, out=forward())
        return torch.autograd.grad(saved["out"], inputs, dy, retain_graph=True)

    return timed
