"""Benchmark helpers: CUDA-synchronised timing, throughput in extra_info, run metadata.

Run: pytest bench/ --benchmark-only [--benchmark-json bench/results/<name>.json]
Each bench file is one pytest-benchmark group per op, parametrized over kernel, shape, mode.
"""

import datetime
import os
import platform
import sys

import pytest
import torch
import triton

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="GPU benchmark: needs a CUDA device")


def device_name() -> str:
    return torch.cuda.get_device_name() if HAS_CUDA else platform.processor() or "cpu"


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def run_bench(benchmark, fn, *, flops=None, nbytes=None, warmup=3, rounds=20, **info):
    """Time fn (no args) with pytest-benchmark; warm-up (autotune, compile) is not timed.

    flops / nbytes are the work of one call; TFLOP/s and GB/s from the median go into
    extra_info together with the device, the torch and Triton versions, whether our kernels were
    autotuned, the date, the command and anything in **info (shapes, dtype).
    Under --benchmark-disable the case only warms up (its compiles fill the on-disk caches that
    the timed run then reads) and is skipped.
    """
    for _ in range(warmup):
        fn()
    sync()
    if benchmark.disabled:  # --benchmark-disable: a compile pass (scripts/gpu/prelude.sh warm_bench)
        pytest.skip("benchmarks disabled: compiled and tuned, nothing timed")

    def timed():
        fn()
        sync()

    benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        device=device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        autotune=os.environ.get("SCRATCHFORMER_AUTOTUNE", "1") != "0",  # False: pinned tiles (scripts/gpu/)
        date=datetime.date.today().isoformat(),
        command=" ".join(sys.argv),
        **{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in info.items()},
    )
    if flops is not None:
        benchmark.extra_info["tflops"] = flops / median / 1e12
    if nbytes is not None:
        benchmark.extra_info["gbps"] = nbytes / median / 1e9
    return median


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written / time): the memory roof."""
    if not HAS_CUDA:
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3) / 1e9
