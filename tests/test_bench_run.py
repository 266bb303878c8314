"""bench/conftest.py's run_bench, on the one benchmark that runs on a CPU (the embedding op): what
a saved case records (issue 16 asks for the device, dtype, shapes, torch and Triton versions and
the command in every case), and the compile pass of scripts/gpu/ (--benchmark-disable: the case
warms up, then is skipped, and nothing is timed)."""

import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import triton

from scratchformer.data import PAD_ID
from scratchformer.kernels import _common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the smallest fp32 forward case of the eager peer: its sizes differ between a CPU and a GPU
SELECT = ["bench/bench_embed.py", "-k", "fwd- and float32 and eager and not bwd"]


def _bench(tmp_path, *flags):
    """The SELECTed cases under pytest-benchmark with `flags` -> (the saved file, or None when it
    saved nothing; stdout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not as an xdist worker
    out = tmp_path / "run.json"
    p = subprocess.run([sys.executable, "-m", "pytest", *SELECT, "-p", "no:cacheprovider", "-q", "-rs",
                        f"--benchmark-json={out}", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    saved = out.read_text() if out.exists() else ""  # some pytest-benchmark versions create it empty
    return (json.loads(saved) if saved else None), p.stdout


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    return _bench(tmp_path_factory.mktemp("bench"), "--benchmark-only")[0]


@pytest.fixture(scope="module")
def saved_cases(saved_run):
    return saved_run["benchmarks"]


def test_a_saved_case_names_what_it_ran_on(saved_cases):
    cases = saved_cases
    assert cases
    for case in cases:
        info = case["extra_info"]
        assert info["device"] and info["torch"] == torch.__version__ and info["triton"] == triton.__version__
        assert info["dtype"] == "torch.float32" and info["tokens"] > 0 and info["d_model"] > 0
        assert info["autotune"] == (os.environ.get("SCRATCHFORMER_AUTOTUNE", "1") != "0")  # the GPU plan pins
        assert "bench_embed.py" in info["command"] and info["gbps"] > 0
        assert case["stats"]["rounds"] >= 10


def test_a_saved_case_names_its_own_commit_and_time(saved_run):
    """Each case names the commit it ran from (id, dirty), as pytest-benchmark's top of the file names
    the run's, and when it ran (UTC, to the second), at most a few minutes before the file was saved: a
    file collect.py merges from several runs (windows) keeps each case's own (the top names one run)."""
    top = saved_run["commit_info"]
    saved = datetime.datetime.fromisoformat(saved_run["datetime"])
    for case in saved_run["benchmarks"]:
        info = case["extra_info"]
        assert (info["commit"], info["dirty"]) == (top["id"], top["dirty"])
        ran = datetime.datetime.fromisoformat(info["datetime"])
        assert saved - datetime.timedelta(minutes=5) <= ran <= saved, (ran, saved)


def test_the_embeddings_bytes_read_each_distinct_row_once(saved_cases):
    """The embedding's GB/s counts the bytes that must move: the ids, the output and each distinct
    weight row once (a row repeated by later tokens comes from the L2), not a row per token, which
    put torch.compile's forward at 262k tokens above the measured copy bandwidth (3,487 GB/s against
    2,989, H100). The ids rebuilt here as bench_embed.py draws them: 4,096 of a 32k vocabulary."""
    assert saved_cases
    for case in saved_cases:
        info = case["extra_info"]
        n, d = info["tokens"], info["d_model"]
        torch.manual_seed(0)
        distinct = torch.randint(0, info["vocab"], (n // 512, 512)).unique().numel()
        assert distinct < n and info["unique_ids"] == distinct
        moved = n * 8 + (n + distinct) * d * 4  # int64 ids, fp32 rows: the output, the distinct rows read
        assert info["gbps"] == pytest.approx(moved / case["stats"]["median"] / 1e9, rel=1e-9)


def test_a_compile_pass_times_nothing(tmp_path):
    saved, out = _bench(tmp_path, "--benchmark-disable")
    assert not (saved and saved["benchmarks"])
    assert " skipped" in out and "passed" not in out and "compiled and tuned, nothing timed" in out


def _bench_conftest():
    spec = importlib.util.spec_from_file_location("bench_conftest", os.path.join(REPO, "bench", "conftest.py"))
    module = importlib.util.module_from_spec(spec)  # tests/ has its own module named conftest
    spec.loader.exec_module(module)
    return module


def _bench_module(monkeypatch, name):
    """bench/<name>.py imported, with bench/conftest.py as the `conftest` it imports (tests/ has its own)."""
    monkeypatch.setitem(sys.modules, "conftest", _bench_conftest())
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _benchmark(median=1e-3):
    """pytest-benchmark's fixture, stood in for: pedantic runs the call `rounds` times, the median is given."""
    return types.SimpleNamespace(disabled=False, extra_info={}, stats=types.SimpleNamespace(
        stats=types.SimpleNamespace(median=median)), pedantic=lambda fn, rounds=1, **kw: [fn() for _ in range(rounds)])


@pytest.mark.parametrize("fails", [False, True])
def test_a_failed_capture_is_recorded(monkeypatch, fails):
    """A case's device time comes from one capture; one that fails leaves no device time, its error
    and where it was raised recorded, and is not tried again (the retry hid the cause of the eighth
    to tenth windows' failures: the case's forward on the legacy stream)."""
    bench_conftest = _bench_conftest()
    tries = []

    def graph_time(fn, calls):
        tries.append(calls)
        if fails:
            raise RuntimeError("capture failed\nsecond line")
        return 2e-6

    monkeypatch.setattr(bench_conftest, "graph_time", graph_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    bench = types.SimpleNamespace(extra_info={})
    gpu = bench_conftest._graph_time_or_error(bench, lambda: None, calls=5)
    assert tries == [5]
    info = bench.extra_info
    if fails:
        assert gpu is None and "gpu_ms" not in info and info["graph_error"] == "RuntimeError: capture failed"
        at = info["graph_error_at"]  # where it was raised, innermost first
        assert at.startswith("test_bench_run.py:") and at.split(" <- ")[0].endswith(" graph_time"), at
    else:
        assert gpu == 2e-6 and info == {"gpu_ms": pytest.approx(2e-3)}


def test_a_failed_capture_records_the_error_that_broke_it():
    """A capture broken by an op (here a host sync) ends in CUDA's "a previous error during capture"
    from the capture's end, raised while handling the op's error: the record keeps that first error and
    where it was raised, which the ninth window's two failed captures lacked."""
    def op_that_syncs():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    def capture():
        try:
            op_that_syncs()
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    try:
        capture()
    except RuntimeError as err:
        info = _bench_conftest()._describe_error("graph_error", err)
    assert info["graph_error"] == "RuntimeError: CUDA error: operation failed due to a previous error during capture"
    assert info["graph_error_origin"] == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert info["graph_error_at"].startswith("test_bench_run.py:") and info["graph_error_at"].split(" <- ")[0].endswith(
        " op_that_syncs")


@pytest.mark.parametrize(("median", "calls"), [(25e-3, 1), (1e-3, 1), (0.3e-3, 4), (20e-6, 20), (1e-6, 20)])
def test_a_replay_holds_about_a_millisecond_of_calls(median, calls):
    """graph_time's replay holds ceil(1 ms / a call) calls, 1 to 20: a long call is captured alone."""
    assert _bench_conftest().graph_calls(median) == calls


def test_a_case_records_the_configs_its_tuned_kernels_ran(monkeypatch):
    """run_bench records which config each of our autotuned kernels ran in the case
    (kernels/_common.tuned_launches: the latest launch per kernel through launch_tuned), and none
    left over from an earlier case."""
    bench_conftest = _bench_conftest()

    monkeypatch.setattr(_common, "_LAUNCHED", {"_left_over_kernel": {"BLOCK": 8}})

    def launch():  # stands in for a launch_tuned call (its GPU path is tests/test_ffn.py's)
        _common._LAUNCHED["_some_kernel"] = {"BLOCK_M": 4, "num_warps": 8, "num_stages": 3, "pre_hook": None}

    bench = _benchmark()
    monkeypatch.setattr(bench_conftest, "HAS_CUDA", False)  # wall time only: no graph here
    bench_conftest.run_bench(bench, launch, nbytes=1)
    assert bench.extra_info["configs"] == {"_some_kernel": {"BLOCK_M": 4, "num_warps": 8, "num_stages": 3}}


@pytest.mark.skipif(not _common.INTERPRET, reason="the GPU's pinned tiles run here in Triton's interpreter, on the "
                    "CPU (on a GPU machine the kernels are compiled, and triton on the CPU is refused)")
def test_a_pinned_case_records_its_tiles_and_no_tuning(monkeypatch):
    """bench_add_layer_norm's triton-pinned case (the tiles a GPU takes without tuning) turns its
    module's tuner off: it records autotune False (it recorded the environment's True) and the tiles
    it launched (it recorded none), here the GPU's, the interpreter running them on the CPU: at N 512
    the forward one row at 2 warps, the backward 2 rows at 8 warps, 3 row blocks deep
    (bench/results/README.md's table of the backward's tiles). 8 rows of bf16, forward + backward."""
    from scratchformer import ops
    from scratchformer.kernels import add_layer_norm as LN

    ln = _bench_module(monkeypatch, "bench_add_layer_norm")
    monkeypatch.setattr(LN, "INTERPRET", False)  # the tiles a GPU pins (the kernels stay interpreted)
    monkeypatch.setattr(ln, "_add_layer_norm", lambda kernel: ops.select("triton", "cpu").add_layer_norm)
    monkeypatch.setattr(ln, "_roof_gbps", lambda: float("nan"))
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None, **kw: randn(*shape, **kw))  # on the CPU
    bench = _benchmark()
    bench.pedantic = lambda fn, **kw: fn()
    ln.test_add_layer_norm(bench, rows=8, N=512, kernel="triton-pinned", mode="fwd_bwd", monkeypatch=monkeypatch)
    assert bench.extra_info["autotune"] is False
    assert bench.extra_info["configs"] == {"_add_layer_norm_fwd_kernel": {"BLOCK_M": 1, "num_warps": 2},
                                           "_add_layer_norm_bwd_kernel": {"BLOCK_M": 2, "LOOP_STAGES": 3,
                                                                          "num_warps": 8}}


def test_a_case_records_the_autotune_setting_it_ran_with(monkeypatch):
    """run_bench's `autotune`: the process's setting (kernels/_common.AUTOTUNE, from
    SCRATCHFORMER_AUTOTUNE) unless the case gives its own."""
    bench_conftest = _bench_conftest()
    monkeypatch.setattr(bench_conftest, "HAS_CUDA", False)
    for setting, given, recorded in ((True, None, True), (False, None, False), (True, False, False)):
        monkeypatch.setattr(_common, "AUTOTUNE", setting)
        bench = _benchmark()
        bench_conftest.run_bench(bench, lambda: None, autotune=given)
        assert bench.extra_info["autotune"] is recorded


def test_a_graphed_steps_peak_memory_is_its_captures(monkeypatch):
    """bench_train_step's graphed step: a CUDA graph's replay allocates nothing the caching allocator
    counts (its stats stand still while it runs), so the step's peak memory is read from its capture,
    which allocates as a launched step does. It was read over the replays alone: the parameters and
    optimizer state with no activations, the same for every backend (a peak-memory target against
    eager of about 1.0x whatever the kernels save). Here on the CPU: a stand-in allocator's stats, a
    stand-in capture (warm-up, then the captured call, then replays that allocate nothing) around the
    real step of a tiny shape. Its tokens/s count the batch's non-pad tokens, source and target."""
    bts = _bench_module(monkeypatch, "bench_train_step")

    BASE, ACTIVATIONS = 3 << 30, 1 << 30  # held before the step; allocated and freed within it
    mem = types.SimpleNamespace(allocated=BASE, peak=BASE, capturing=False)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(mem, "peak", mem.allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: mem.peak)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: mem.capturing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    clip = torch.nn.utils.clip_grad_norm_

    def clip_amid_activations(*args, **kwargs):  # the middle of a step: its activations' peak
        mem.peak = max(mem.peak, mem.allocated + ACTIVATIONS)
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_amid_activations)

    def capture_step(update, optimizer):  # torch's capture on a GPU: a warm-up call, the captured one
        for capturing in (False, True):
            mem.capturing = capturing
            optimizer.zero_grad(set_to_none=True)
            update()
        mem.capturing = False
        return lambda: None  # a replay: the allocator's stats do not move

    monkeypatch.setattr(bts, "capture_step", capture_step)
    adamw = torch.optim.AdamW  # capturable is for the GPU's optimizer state
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: adamw(params, **{**kw, "capturable": False}))
    monkeypatch.setattr(bts.training_step, "__defaults__", ("cpu", False))
    bench = _benchmark()
    monkeypatch.setitem(bts.SHAPES, "tiny", dict(preset="tiny", vocab=500, max_src=16, max_tgt=16, batch=4,
                                                 sample="multi30k"))
    bts._bench_step(bench, "tiny", "eager", graph=True)
    assert bench.extra_info["graph"] and bench.extra_info["peak_mem_gib"] == (BASE + ACTIVATIONS) / 2**30
    src, sl, _, tgt_out, _ = bts.make_batch("tiny", device="cpu")
    tokens = int(sl.sum()) + int((tgt_out != PAD_ID).sum())  # the source's and the target's (EOS too) real tokens
    assert bench.extra_info["tokens_per_s"] == pytest.approx(tokens / 1e-3)


@pytest.mark.parametrize(("graph", "gpu"), [(True, 0.25e-3), (True, None), (False, 0.25e-3)])
def test_throughput_is_a_calls_work_over_its_time_on_each_clock(monkeypatch, graph, gpu):
    """TFLOP/s and GB/s are one call's work over the median wall time (3e9 FLOPs and 2e6 bytes in
    1 ms: 3 TFLOP/s and 2 GB/s) and, where the device's time was measured (0.25 ms a call), over that
    too (12 and 8); none on the device's clock for a case that asks for no capture (graph=False: the
    training step, which syncs) or that has no device time (None: a failed capture, or one not above
    zero, test_a_device_time_not_above_zero_is_no_measurement)."""
    bench_conftest = _bench_conftest()
    captures = []

    def graph_time_or_error(benchmark, fn, calls):
        captures.append(calls)
        return gpu

    monkeypatch.setattr(bench_conftest, "HAS_CUDA", True)
    monkeypatch.setattr(bench_conftest, "_graph_time_or_error", graph_time_or_error)
    monkeypatch.setattr(bench_conftest, "device_name", lambda: "a stand-in GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    bench = _benchmark(median=1e-3)
    bench_conftest.run_bench(bench, lambda: None, flops=3e9, nbytes=2e6, graph=graph)
    info = bench.extra_info
    assert captures == ([1] if graph else [])  # a 1-ms call: captured alone
    assert info["tflops"] == pytest.approx(3.0) and info["gbps"] == pytest.approx(2.0)
    on_device = {k: info[k] for k in ("tflops_gpu", "gbps_gpu") if k in info}
    assert on_device == ({"tflops_gpu": pytest.approx(12.0), "gbps_gpu": pytest.approx(8.0)} if graph and gpu else {})


def test_a_capture_error_is_traced_to_the_first_of_its_chain():
    """_describe_error follows the errors raised while handling another back to the first, however
    long the chain (three here), and names no origin for an error raised alone."""
    def chain():
        try:
            try:
                raise ValueError("first")
            except ValueError:
                raise KeyError("second")  # noqa: B904 - the chain of __context__ is the point
        except KeyError:
            raise RuntimeError("third")  # noqa: B904

    with pytest.raises(RuntimeError) as chained:
        chain()
    with pytest.raises(RuntimeError) as alone:
        raise RuntimeError("alone")
    describe = _bench_conftest()._describe_error
    info = describe("graph_error", chained.value)
    assert info["graph_error"] == "RuntimeError: third" and info["graph_error_origin"] == "ValueError: first"
    assert set(describe("graph_error", alone.value)) == {"graph_error", "graph_error_at"}


class _Event:
    """torch.cuda.Event on a stand-in device: the time of a clock (ms, `_Event.clock[0]`) that the
    stand-in's work moves."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def _stand_in_device(monkeypatch):
    """-> the clock (ms) of a stand-in device whose events `_Event` reads."""
    clock = [0.0]
    monkeypatch.setattr(_Event, "clock", clock)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return clock


def test_device_time_is_a_calls_share_of_the_median_replay_less_the_flushes(monkeypatch):
    """graph_time on a stand-in device: 2 calls a replay, each after a 1-ms flush, 5 timed replays
    after one that uploads the graph. The flushes alone replay in 2 ms. fn's calls take 3 ms in the
    upload, then 3, 4, 10, 2 and 3 ms: replays of 2 · (1 + 3) = 8, 10, 22, 6 and 8 ms, median 8, so
    (8 - 2) / 2 = 3 ms a call (not the fastest replay's 2, nor 4 with the flushes left in)."""
    bench_conftest = _bench_conftest()
    clock = _stand_in_device(monkeypatch)

    class Flush:
        def zero_(self):
            clock[0] += 1.0

    costs = iter([3.0, 3.0, 3.0, 3.0, 4.0, 4.0, 10.0, 10.0, 2.0, 2.0, 3.0, 3.0])  # ms, each call in turn

    def fn():
        clock[0] += next(costs)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: Flush())
    monkeypatch.setattr(bench_conftest, "capture", lambda body: (None, body))  # a replay: the body's calls
    assert bench_conftest.graph_time(fn, calls=2, rounds=5) == pytest.approx(3e-3)


@pytest.mark.parametrize("flush_beside_calls", [1.0, 0.9])
def test_a_device_time_not_above_zero_is_no_measurement(monkeypatch, flush_beside_calls):
    """run_bench on a stand-in device where fn's call takes no time: a 1-ms call on the wall clock, so
    one call a replay; each replay of the flushes alone takes 1 ms, and of a flush and the call 1 ms
    (0 ms a call) or, the flush running faster there (0.9 ms: noise), 0.9 ms (-0.1 ms a call). Neither
    is a device time: no `gpu_ms` (it was stored as 0.0, the negative clamped to it), no throughput on
    the device's clock, and a `graph_error` that says why."""
    bench_conftest = _bench_conftest()
    clock = _stand_in_device(monkeypatch)
    flushes = []

    class Flush:
        def zero_(self):  # the writes-alone graph: an upload and 5 timed replays, then the calls' graph
            clock[0] += 1.0 if len(flushes) < 6 else flush_beside_calls
            flushes.append(1)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: Flush())
    monkeypatch.setattr(bench_conftest, "capture", lambda body: (None, body))
    monkeypatch.setattr(bench_conftest, "HAS_CUDA", True)
    monkeypatch.setattr(bench_conftest, "device_name", lambda: "a stand-in GPU")
    bench = _benchmark(median=1e-3)
    bench_conftest.run_bench(bench, lambda: None, nbytes=2e6)
    info = bench.extra_info
    assert len(flushes) == 12 and "gpu_ms" not in info and "gbps_gpu" not in info
    assert info["gbps"] == pytest.approx(2.0)
    assert info["graph_error"] == (f"device time {(flush_beside_calls - 1.0):.6f} ms a call: the replay of 1 took no "
                                   "longer than its flushes alone")


def test_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    """The memory roof: a copy of 2^29 bytes (half of nbytes = 2^30) reads 2^29 and writes 2^29; on a
    stand-in device where each copy takes 1 ms, 2^30 bytes / 1 ms = 1,073.741824 GB/s."""
    bench_conftest = _bench_conftest()
    clock = _stand_in_device(monkeypatch)

    class Buffer:
        def numel(self):
            return 1 << 29

        def copy_(self, src):
            clock[0] += 1.0

    monkeypatch.setattr(bench_conftest, "HAS_CUDA", True)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: Buffer())
    monkeypatch.setattr(torch, "empty_like", lambda t: Buffer())
    assert bench_conftest.copy_bandwidth_gbps(1 << 30) == pytest.approx(1073.741824)


def test_peak_memory_is_the_calls_peak_above_what_was_held(monkeypatch):
    """peak_memory: 5 GiB held before the call, the call's peak 7 GiB: 2 GiB (a stand-in allocator)."""
    mem = types.SimpleNamespace(allocated=5 << 30, peak=5 << 30)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(mem, "peak", mem.allocated))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: mem.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: mem.peak)

    def run():
        mem.peak = max(mem.peak, mem.allocated + (2 << 30))

    assert _bench_conftest().peak_memory(run) == 2 << 30


def _recorded(monkeypatch, module):
    """The keyword arguments of each of `module`'s run_bench calls (the stand-in times nothing)."""
    calls = []
    monkeypatch.setattr(module, "run_bench", lambda benchmark, fn, **kw: calls.append(kw) or 1e-3)
    return calls


def _on_meta(monkeypatch):
    """torch.empty, randn, randint and full make meta tensors (shapes and dtypes, no data): a GPU
    benchmark's inputs, on the CPU."""
    empty = torch.empty

    def meta(*shape, **kw):
        return empty(*shape, **{**kw, "device": "meta"})

    monkeypatch.setattr(torch, "empty", meta)
    monkeypatch.setattr(torch, "randn", meta)
    monkeypatch.setattr(torch, "randint", lambda low, high, size, **kw: meta(size, **{"dtype": torch.int64, **kw}))
    monkeypatch.setattr(torch, "full", lambda size, value, **kw: meta(size, **{"dtype": torch.int64, **kw}))


def test_attentions_tflops_count_the_work_its_masks_keep(monkeypatch):
    """bench_attention's FLOPs (its docstring): 4·B·H·Lq·Lk·D a forward (QKᵀ and PV, a multiply-add
    2 FLOPs), halved under a causal mask, x3.5 with the backward. Dense at 16k tokens a batch, L 2048
    (B 8), 16 heads of 64: 4·8·16·2048²·64 = 2^37. A padded batch (L 1024, B 16, 8 heads of 128)
    counts each sequence's own keys: Σ_b 4·8·128·1024·len_b. The peak-memory case (B 1, L 4096,
    causal, with the backward): 3.5 · 4·16·4096²·64 / 2. On meta tensors, nothing run."""
    ba = _bench_module(monkeypatch, "bench_attention")
    calls = _recorded(monkeypatch, ba)
    empty = torch.empty
    monkeypatch.setattr(ba, "_qkv", lambda B, L, H, D: [empty(B, L, 3, H, D, device="meta")[:, :, i].transpose(1, 2)
                                                        for i in range(3)])
    monkeypatch.setattr(ba, "_attention_fn", lambda *a, **kw: None)
    monkeypatch.setattr(ba, "_timed", lambda mode, fn, q, k, v: lambda: None)
    monkeypatch.setattr(ba, "peak_memory", lambda run: 0)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    for causal, mode in ((False, "fwd"), (True, "fwd"), (False, "fwd+bwd")):
        ba.test_dense(None, pointer_kernels=None, L=2048, H=16, D=64, causal=causal, kernel="triton", mode=mode)
    ba.test_padded(None, pointer_kernels=None, L=1024, H=8, D=128, kernel="triton", mode="fwd")
    ba.test_memory_fwd_bwd(None, L=4096, kernel="triton")
    lengths = torch.randint(512, 1025, (16,), generator=torch.Generator().manual_seed(0))  # the padded batch's
    assert [c["flops"] for c in calls] == [2**37, 2**36, 3.5 * 2**37, sum(4 * 8 * 128 * 1024 * int(n) for n in lengths),
                                           3.5 * 4 * 16 * 4096**2 * 64 / 2]
    assert [(c["B"], c["Lq"], c["Lk"], c["causal"]) for c in calls[:2]] == [(8, 2048, 2048, False),
                                                                            (8, 2048, 2048, True)]


def test_a_named_sdpa_backend_is_skipped_only_where_torch_has_none_for_the_case(monkeypatch):
    """bench_attention's named SDPA backends: a case that torch's backend selection refuses is skipped
    with torch's reason (here torch's own refusal, cuDNN's attention asked for on the CPU); an out-of-memory
    error (a RuntimeError too) or any other fails the case: skipped, a failed backend was silently no
    peer, and "SDPA's fastest" the fastest of the others (bench/targets.py)."""
    ba = _bench_module(monkeypatch, "bench_attention")
    monkeypatch.setattr(ba, "run_bench", lambda *a, **kw: pytest.fail("a case that could not run was timed"))
    q = torch.randn(1, 2, 8, 16)

    def outcome(kernel):
        try:
            ba._bench(None, kernel, "fwd", q, q, q, 1.0)
        except pytest.skip.Exception as skipped:
            return f"skipped: {skipped.msg}"
        except RuntimeError as err:
            return type(err).__name__

    assert re.match(r"skipped: sdpa_cudnn: No (viable backend|available kernel)", outcome("sdpa_cudnn"))
    for err in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                RuntimeError("CUDA error: an illegal memory access was encountered")):
        def fails(*args, err=err, **kwargs):
            raise err

        monkeypatch.setattr(ba, "_attention_fn", lambda *a, fails=fails, **kw: fails)
        assert outcome("sdpa_flash") == type(err).__name__


def test_add_layer_norms_bytes_are_what_must_move(monkeypatch):
    """bench_add_layer_norm's bytes (its docstring), bf16 (2 bytes) at 16384 x 512: the forward reads x
    and the residual and writes y, 3 · 16384 · 512 · 2 = 50,331,648; forward + backward also reads dy
    and the saved sum and writes dx, twice that; the backward alone (dy, s in; dx out) 50,331,648 again.
    The copy roof's copy of 2^28 bytes moves 2^29 (read and written). On meta tensors, nothing run."""
    ln = _bench_module(monkeypatch, "bench_add_layer_norm")
    calls = _recorded(monkeypatch, ln)
    _on_meta(monkeypatch)
    monkeypatch.setattr(ln, "_add_layer_norm", lambda kernel: None)
    monkeypatch.setattr(ln, "_roof_gbps", lambda: float("nan"))  # on a GPU it would time meta tensors
    for mode in ("fwd", "fwd_bwd", "bwd"):
        ln.test_add_layer_norm(None, rows=16384, N=512, kernel="torch", mode=mode, monkeypatch=monkeypatch)
    ln.test_copy_bandwidth(None)
    assert [c["nbytes"] for c in calls] == [50_331_648, 100_663_296, 50_331_648, 2**29]


def test_ffn_flops_count_both_gemms(monkeypatch):
    """bench_ffn's FLOPs: 2·T·d·f a GEMM, two in the forward, x3 with the backward (each GEMM's input
    and weight gradients); the GEMM alone 2·T·d·f. At 4096 x 512 x 2048: 2^33 a GEMM. On meta tensors."""
    ffn = _bench_module(monkeypatch, "bench_ffn")
    calls = _recorded(monkeypatch, ffn)
    _on_meta(monkeypatch)
    for mode in ("fwd", "fwd_bwd"):
        ffn.test_ffn(None, tma=False, tokens=4096, d_model=512, d_ff=2048, kernel="eager", mode=mode)
    ffn.test_matmul(None, tma=False, tokens=4096, d_model=512, d_ff=2048, kernel="torch")
    assert [c["flops"] for c in calls] == [2 * 2**33, 6 * 2**33, 2**33]


def test_the_losss_flops_are_its_logits_gemm(monkeypatch):
    """bench_cross_entropy's FLOPs: the logits GEMM, 2·T·d·V, x3 with the backward (dx and dW): at
    2048 x 512 x 30522, 2^21 · 30522 = 64,009,273,344 forward. On meta tensors, a stand-in loss."""
    ce = _bench_module(monkeypatch, "bench_cross_entropy")
    calls = _recorded(monkeypatch, ce)
    _on_meta(monkeypatch)
    monkeypatch.setattr(ce, "_impl", lambda kernel: lambda x, w, *a, **kw: (x.float().sum() + w.float().sum(), None))
    monkeypatch.setattr(ce, "peak_memory", lambda run: 0)
    for mode in ("fwd", "fwd_bwd"):
        ce.test_linear_cross_entropy(None, tokens=2048, d_model=512, vocab=30522, kernel="torch", mode=mode)
    assert [c["flops"] for c in calls] == [64_009_273_344, 3 * 64_009_273_344]


def test_the_embeddings_backward_adds_the_bytes_it_must_move(monkeypatch):
    """bench_embed's fwd+bwd bytes: the forward's (int64 ids N·8, the output N·d and each distinct row
    U·d) and the backward's: the output's gradient read (N·d), the ids read again and grad_weight
    written whole (V·d). At N 4096, d 64, fp32 (4 bytes), V 32000, the ids drawn as the case draws them."""
    be = _bench_module(monkeypatch, "bench_embed")
    calls = _recorded(monkeypatch, be)
    monkeypatch.setattr(be, "DEVICE", "cpu")  # the ids drawn as on a CPU (a GPU's generator draws others)
    monkeypatch.setattr(be, "_roof_gbps", lambda: float("nan"))
    n, d, vocab = 4096, 64, 32000
    be.test_embed(None, case=(n, d, torch.float32, "fwd+bwd"), kernel="eager")
    torch.manual_seed(0)
    distinct = torch.randint(0, vocab, (n // 512, 512)).unique().numel()
    assert calls[0]["nbytes"] == (n * 8 + (n + distinct) * d * 4) + (n * d * 4 + n * 8 + vocab * d * 4)


def test_generation_counts_each_rows_new_tokens(monkeypatch):
    """bench_generate's new tokens/s: each of the 32 rows decodes 128 tokens (EOS off; beam search
    counts its best hypothesis only): 4,096 new tokens in a 2-s call, 2,048 a second. Stand-ins for the
    model (the call is not run) and the allocator's peak (3 GiB)."""
    bg = _bench_module(monkeypatch, "bench_generate")
    monkeypatch.setattr(bg, "run_bench", lambda benchmark, fn, **kw: 2.0)
    monkeypatch.setattr(bg, "build_model", lambda cfg, device: torch.nn.Linear(2, 2))
    _on_meta(monkeypatch)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 << 30)
    bench = types.SimpleNamespace(extra_info={})
    bg.test_generate(bench, kernel="triton", search="beam4", steps="graph", weights="bf16")
    assert bench.extra_info == {"kernel": "triton", "new_tokens_per_s": 2048.0, "peak_mem_gib": 3.0}


def test_generation_records_the_dtype_its_weights_have(monkeypatch):
    """bench_generate's weights: bf16 (the model cast) with no autocast, or fp32 under bf16 autocast,
    recorded as such (every case recorded dtype "bf16", the fp32 weights' too). A stand-in model of fp32
    parameters, as build_model makes them; the call is not run."""
    bg = _bench_module(monkeypatch, "bench_generate")
    calls = _recorded(monkeypatch, bg)
    monkeypatch.setattr(bg, "build_model", lambda cfg, device: torch.nn.Linear(2, 2))
    _on_meta(monkeypatch)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    for weights in ("bf16", "fp32-autocast"):
        bg.test_generate(types.SimpleNamespace(extra_info={}), kernel="torch", search="greedy", steps="graph",
                         weights=weights)
    assert [(c["weights"], c["dtype"], c.get("autocast")) for c in calls] == [
        ("bf16", torch.bfloat16, None), ("fp32-autocast", torch.float32, torch.bfloat16)]


def test_a_compile_pass_warms_up_before_it_skips(monkeypatch):
    """Under --benchmark-disable (scripts/gpu/'s compile pass) a case still makes its `warmup` calls,
    which compile and tune into the on-disk caches the timed run reads, and only then is skipped."""
    bench_conftest = _bench_conftest()
    monkeypatch.setattr(bench_conftest, "HAS_CUDA", False)
    calls = []
    with pytest.raises(pytest.skip.Exception, match="nothing timed"):
        bench_conftest.run_bench(types.SimpleNamespace(disabled=True), lambda: calls.append(1), warmup=4)
    assert len(calls) == 4


def test_a_capture_error_names_its_innermost_frames():
    """_describe_error keeps the 4 innermost frames of where the error was raised, innermost first,
    however deep the call (here 6 calls down, through `deeper`, to `raise_it`)."""
    def deeper(n):
        if n:
            deeper(n - 1)
        else:
            raise_it()

    def raise_it():
        raise RuntimeError("deep")

    with pytest.raises(RuntimeError) as caught:
        deeper(5)
    at = _bench_conftest()._describe_error("graph_error", caught.value)["graph_error_at"].split(" <- ")
    assert len(at) == 4 and at[0].endswith(" raise_it") and all(f.endswith(" deeper") for f in at[1:]), at


def test_a_step_benchmarks_batch_has_the_datas_lengths_with_eos_clipped_to_its_shape(monkeypatch):
    """bench_train_step's batch at SAMSum shapes: 64 pairs of bench/length_samples.json's lengths
    (drawn with seed 0), a target's counting its EOS (+1), each clipped to the shape's maxima (a
    source to 256; a target to 64, which none drawn here reaches)."""
    bts = _bench_module(monkeypatch, "bench_train_step")
    with open(os.path.join(REPO, "bench", "length_samples.json")) as fh:
        pairs = json.load(fh)["samsum"]["lengths"]
    drawn = [pairs[i] for i in torch.randint(len(pairs), (64,), generator=torch.Generator().manual_seed(0))]
    sl, tl = bts.sample_lengths("small-samsum")
    assert sl.tolist() == [min(s, 256) for s, _ in drawn] and tl.tolist() == [min(t + 1, 64) for _, t in drawn]
    assert max(s for s, _ in drawn) > 256  # the source's clip at work


def _params(fn) -> dict:
    """A benchmark function's parametrize marks: {argnames: values}."""
    return {m.args[0]: list(m.args[1]) for m in fn.pytestmark if m.name == "parametrize"}


def test_the_targets_expected_grid_is_the_benchmarks(monkeypatch):
    """bench/targets.py lists each target and case the issues ask for ("not measured" where a run lacks
    one): the same grid as the benchmarks parametrize, so that neither drifts from the other."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import targets

    want = {group: set(cases) for group, cases in targets.EXPECTED.items()}
    att = _bench_module(monkeypatch, "bench_attention")
    dense, padded = _params(att.test_dense), _params(att.test_padded)
    heads = [d for _, d in dense["H, D"]]
    assert want["attention"] == {
        (f"attention {m} vs SDPA's fastest", f"dense L={L} D={D}{' causal' * c} {m}")
        for L in dense["L"] if L >= 2048 for D in heads for c in dense["causal"] for m in dense["mode"]} | {
        ("attention, padded vs SDPA + mask", f"padded L={L} D={D} {m}") for L in padded["L"]
        for D in [d for _, d in padded["H, D"]] for m in padded["mode"]}
    ln = _params(_bench_module(monkeypatch, "bench_add_layer_norm").test_add_layer_norm)
    assert want["add_layer_norm"] == {(f"add+LayerNorm vs {peer}", f"{r} x {n} {m}") for r in ln["rows"]
                                      for n in ln["N"] for m in ln["mode"] if m != "bwd"
                                      for peer in ("copy bandwidth", "torch")}
    ffn = _bench_module(monkeypatch, "bench_ffn")
    assert want["ffn"] == {("FFN vs eager", f"{t} x {d} x {f} {m}") for t, d, f in ffn.CASES
                           for m in _params(ffn.test_ffn)["mode"]} | {
        ("FFN's GEMM vs cuBLAS", f"{t} x {d} x {f}") for t, d, f in ffn.CASES}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # its GPU cases (the CPU's are two smoke ones)
    emb = _bench_module(monkeypatch, "bench_embed")
    assert want["embed"] == {(f"embedding vs {peer}", f"{n} tokens d={d} {dtype} {m}") for n, d, dtype, m in emb.CASES
                             for peer in ("copy bandwidth", "eager")}
    step = _bench_module(monkeypatch, "bench_train_step")
    assert want["train_step"] == {(f"training step {what}", shape) for shape in step.SHAPES
                                  for what in ("vs eager", "vs torch", "vs compile", "peak memory vs eager")}
