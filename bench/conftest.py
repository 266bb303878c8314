"""Benchmark helpers: CUDA-synchronised timing, throughput in extra_info, run metadata.

Run: pytest bench/ --benchmark-only [--benchmark-json bench/results/<name>.json]
Each bench file is one pytest-benchmark group per op, parametrized over kernel, shape, mode.
"""

import datetime
import functools
import gc
import math
import os
import platform
import sys
import traceback

import pytest
import torch
import triton
from pytest_benchmark.utils import get_commit_info

from scratchformer.graphs import capture
from scratchformer.kernels import _common
from scratchformer.kernels._common import tuned_launches

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="GPU benchmark: needs a CUDA device")


def device_name() -> str:
    return torch.cuda.get_device_name() if HAS_CUDA else platform.processor() or "cpu"


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _release_device_memory():
    """Each case gives the caching allocator's blocks back when it ends: a sweep of shapes from 16 MB
    to 2 GB a tensor otherwise fragments it (the eighth window's 65536 x 8192 eager cases ran out of
    memory with 63 GiB reserved and unallocated, after the smaller cases' blocks)."""
    yield
    if HAS_CUDA:
        gc.collect()  # the case's tensors (and a compiled graph's saved buffers) first
        torch.cuda.empty_cache()


def peak_memory(run) -> int:
    """Bytes allocated at the peak of one call of run, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_bench(benchmark, fn, *, flops=None, nbytes=None, warmup=3, rounds=20, graph=True, autotune=None, **info):
    """Time fn (no args) with pytest-benchmark; warm-up (autotune, compile) is not timed.

    flops / nbytes are the work of one call; TFLOP/s and GB/s from the median go into
    extra_info together with the device, the torch and Triton versions, whether our kernels were
    autotuned (`autotune`: the case's own setting where it changed it, as triton-pinned turns its
    module's tuner off, else the process's, SCRATCHFORMER_AUTOTUNE), the commit (`commit`, `dirty`:
    pytest-benchmark's commit_info of the checkout), the date and time (`datetime`, UTC), the
    command and anything in **info (shapes, dtype). The commit and time are the case's own: a file
    that collects several runs (scripts/gpu/collect.py) names one run at its top, and a case may be
    another's.
    Under --benchmark-disable the case only warms up (its compiles fill the on-disk caches that
    the timed run then reads) and is skipped.

    The wall clock of a call plus a synchronize includes the host's side (Python, dispatch, the
    launches): at small sizes that, not the kernel, is what it measures. So on a GPU, unless
    graph=False (fn syncs, or cannot be captured), the device's own time per call is measured
    too (`graph_time`) and kept beside it: `gpu_ms`, `tflops_gpu`, `gbps_gpu` (`graph_error` if
    the capture failed). The kernel targets are judged on those (bench/targets.py).
    """
    tuned_launches(clear=True)
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
        autotune=_common.AUTOTUNE if autotune is None else autotune,  # False: pinned tiles
        date=datetime.date.today().isoformat(),
        **checkout(),
        datetime=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
        **{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in info.items()},
    )
    tuned = tuned_launches()  # which config each of our kernels ran in this case, tuned or pinned
    if tuned:
        benchmark.extra_info["configs"] = {name: {k: v for k, v in meta.items() if isinstance(v, (int, float, str))}
                                           for name, meta in tuned.items()}
    gpu = None
    if HAS_CUDA and graph:
        gpu = _graph_time_or_error(benchmark, fn, calls=graph_calls(median))
    for name, work, scale in (("tflops", flops, 1e12), ("gbps", nbytes, 1e9)):
        if work is not None:
            benchmark.extra_info[name] = work / median / scale
            if gpu is not None:
                benchmark.extra_info[f"{name}_gpu"] = work / gpu / scale
    return median


@functools.cache
def checkout() -> dict:
    """{"commit": id, "dirty": bool} of the checkout the benchmarks run from, as pytest-benchmark's
    commit_info names it (read once a process)."""
    info = get_commit_info()
    return {"commit": info["id"], "dirty": info["dirty"]}


def graph_calls(median: float) -> int:
    """How many calls one replay of `graph_time` holds: about a millisecond of work, 1 to 20. A call
    over a millisecond is captured alone (until 2026-11-27 at least 3 were: the 25-ms eager
    add+LayerNorm at 65536 x 8192 ran out of memory in that capture with 70 GiB cached, and the two
    cases after it in their warm-up)."""
    return min(20, math.ceil(1e-3 / median))


def _graph_time_or_error(benchmark, fn, calls: int) -> float | None:
    """graph_time(fn), its ms in extra_info["gpu_ms"]; a failed capture is recorded as
    `graph_error` (with its origin and frames, `_describe_error`), and so is a device time that is
    not positive (a replay no longer than its flushes alone: no measurement, where it was once
    stored as `gpu_ms` 0.0); the wall time stands. (From
    the eighth to the tenth window a failed capture was tried twice, on the guess that a first use
    had broken it. It was the case's own forward on the legacy stream, `bench_add_layer_norm.py`
    `_backward_alone`; later cases captured only because the failed capture had left its side
    stream current, which `graphs.record` now undoes.)"""
    try:
        gpu = graph_time(fn, calls=calls)
    except Exception as err:  # noqa: BLE001 - e.g. an op that syncs
        torch.cuda.synchronize()  # (graphs.record has put the CUDA generator and the stream right again)
        benchmark.extra_info.update(_describe_error("graph_error", err))
        return None
    if gpu <= 0:
        benchmark.extra_info["graph_error"] = (f"device time {gpu * 1e3:.6f} ms a call: the replay of {calls} took "
                                               "no longer than its flushes alone")
        return None
    benchmark.extra_info["gpu_ms"] = gpu * 1e3
    return gpu


def _describe_error(key: str, err: BaseException) -> dict[str, str]:
    """{key: "Type: first line"}, and where the error began: a capture that fails ends in CUDA's "operation
    failed due to a previous error during capture" from the capture's end, raised while handling the
    error that broke it (its __context__), so the first error of that chain as key_origin, and the
    innermost frames it was raised in as key_at ("file:line function", innermost first)."""
    def line(e):
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"

    origin = err
    while origin.__context__ is not None:  # Python keeps the chain free of cycles
        origin = origin.__context__
    frames = traceback.extract_tb(origin.__traceback__)[-4:]
    described = {key: line(err), f"{key}_at": " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                                           for f in reversed(frames))}
    if origin is not err:
        described[f"{key}_origin"] = line(origin)
    return described


FLUSH_BYTES = 128 << 20  # written between calls: over twice the L2 of an H100 (50 MB) or an H200


def graph_time(fn, calls: int = 3, rounds: int = 5) -> float:
    """Seconds of device time per call of fn, the host's side excluded, as kernel benchmarks time
    kernels (triton.testing.do_bench_cudagraph): `calls` calls of fn captured in one CUDA graph,
    each after a write of FLUSH_BYTES (so no call finds its inputs in L2, as one call inside a
    training step would not), the graph replayed `rounds` times (median); the writes' own time,
    from a graph of the writes alone, is subtracted (so the result can come out 0 or below where
    fn's work hides in the noise of the writes: `_graph_time_or_error` refuses it). run_bench asks
    for enough calls to make a replay about a millisecond of work, so a replay's jitter is a small
    share of a call's time.
    The calls run once more first, on a side stream (`scratchformer.graphs.capture`: cuBLAS
    workspaces and lazy inits). Raises if fn cannot be captured (a host sync, a CPU tensor it
    moves, ...)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def replay_seconds(body) -> float:
        _, replay = capture(lambda: [body() for _ in range(calls)])
        replay()  # the first replay uploads the graph
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    writes = replay_seconds(flush.zero_)

    def flushed_call():
        flush.zero_()
        fn()

    both = replay_seconds(flushed_call)
    return (both - writes) / calls


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
