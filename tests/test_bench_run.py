"""bench/conftest.py's run_bench, on the one benchmark that runs on a CPU (the embedding op): what
a saved case records (issue 16 asks for the device, dtype, shapes, torch and Triton versions and
the command in every case), and the compile pass of scripts/gpu/ (--benchmark-disable: the case
warms up, then is skipped, and nothing is timed)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the smallest fp32 forward case of the eager peer: its sizes differ between a CPU and a GPU
SELECT = ["bench/bench_embed.py", "-k", "fwd- and float32 and eager and not bwd"]


def _bench(tmp_path, *flags):
    """The SELECTed cases under pytest-benchmark with `flags` -> (the saved cases, or None when it
    saved nothing; stdout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not as an xdist worker
    out = tmp_path / "run.json"
    p = subprocess.run([sys.executable, "-m", "pytest", *SELECT, "-p", "no:cacheprovider", "-q", "-rs",
                        f"--benchmark-json={out}", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    saved = out.read_text() if out.exists() else ""  # some pytest-benchmark versions create it empty
    return (json.loads(saved)["benchmarks"] if saved else None), p.stdout


@pytest.fixture(scope="module")
def saved_cases(tmp_path_factory):
    return _bench(tmp_path_factory.mktemp("bench"), "--benchmark-only")[0]


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
    cases, out = _bench(tmp_path, "--benchmark-disable")
    assert not cases and " skipped" in out and "passed" not in out and "compiled and tuned, nothing timed" in out


def _bench_conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_conftest", os.path.join(REPO, "bench", "conftest.py"))
    module = importlib.util.module_from_spec(spec)  # tests/ has its own module named conftest
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fails", [False, True])
def test_a_failed_capture_is_recorded(monkeypatch, fails):
    """A case's device time comes from one capture; one that fails leaves no device time, its error
    and where it was raised recorded, and is not tried again (the retry hid the cause of the eighth
    to tenth windows' failures: the case's forward on the legacy stream)."""
    import types

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
    import types

    from scratchformer.kernels import _common

    bench_conftest = _bench_conftest()

    monkeypatch.setattr(_common, "_LAUNCHED", {"_left_over_kernel": {"BLOCK": 8}})

    def launch():  # stands in for a launch_tuned call (its GPU path is tests/test_ffn.py's)
        _common._LAUNCHED["_some_kernel"] = {"BLOCK_M": 4, "num_warps": 8, "num_stages": 3, "pre_hook": None}

    bench = types.SimpleNamespace(disabled=False, extra_info={}, stats=types.SimpleNamespace(
        stats=types.SimpleNamespace(median=1e-3)), pedantic=lambda fn, **kw: fn())
    monkeypatch.setattr(bench_conftest, "HAS_CUDA", False)  # wall time only: no graph here
    bench_conftest.run_bench(bench, launch, nbytes=1)
    assert bench.extra_info["configs"] == {"_some_kernel": {"BLOCK_M": 4, "num_warps": 8, "num_stages": 3}}


def test_a_graphed_steps_peak_memory_is_its_captures(monkeypatch):
    """bench_train_step's graphed step: a CUDA graph's replay allocates nothing the caching allocator
    counts (its stats stand still while it runs), so the step's peak memory is read from its capture,
    which allocates as a launched step does. It was read over the replays alone: the parameters and
    optimizer state with no activations, the same for every backend (a peak-memory target against
    eager of about 1.0x whatever the kernels save). Here on the CPU: a stand-in allocator's stats, a
    stand-in capture (warm-up, then the captured call, then replays that allocate nothing) around the
    real step of a tiny shape."""
    import importlib.util
    import types

    monkeypatch.setitem(sys.modules, "conftest", _bench_conftest())  # bench_train_step imports bench's
    path = os.path.join(REPO, "bench", "bench_train_step.py")
    spec = importlib.util.spec_from_file_location("bench_train_step", path)
    bts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bts)

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
    bench = types.SimpleNamespace(disabled=False, extra_info={}, stats=types.SimpleNamespace(
        stats=types.SimpleNamespace(median=1e-3)), pedantic=lambda fn, rounds, **kw: [fn() for _ in range(rounds)])
    monkeypatch.setitem(bts.SHAPES, "tiny", dict(preset="tiny", vocab=500, max_src=16, max_tgt=16, batch=4,
                                                 sample="multi30k"))
    bts._bench_step(bench, "tiny", "eager", graph=True)
    assert bench.extra_info["graph"] and bench.extra_info["peak_mem_gib"] == (BASE + ACTIVATIONS) / 2**30
