"""bench/host_overhead.py (issue 17: host time per op call and per step, per backend) runs on the
CPU with Triton's launches stubbed (on a GPU machine: on the GPU, launches real): a row per backend,
every figure a positive time, then what a step issues in fp32 and under bf16 autocast (our ops and
Triton launches in triton's row only; autocast's casts), and what a decoding step issues under bf16
autocast (no weight cast); and it refuses to stub without the
interpreter, naming what to set."""

import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from torch.autograd import DeviceType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "bench", "host_overhead.py")


def _run(env_extra, *args, device="cpu"):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_extra
    return subprocess.run([sys.executable, TOOL, "--device", device, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_row_of_positive_times_per_backend(tmp_path):
    """On the CPU through the interpreter (whose Triton may refuse this numpy on a GPU machine's
    stack: there the tool runs on the GPU, as step 31 runs it)."""
    out = tmp_path / "host.md"
    env = {"TRITON_INTERPRET": "1"} if DEVICE == "cpu" else {}
    p = _run(env, "--calls", "20", "--out", str(out), device=DEVICE)
    assert p.returncode == 0, p.stderr[-2000:]
    steps, decoding = out.read_text().split("what one greedy decoding step")
    times, fp32, bf16 = steps.split("what one such step")
    rows = [line for line in times.splitlines() if re.match(r"\| (eager|torch|triton) \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["eager", "torch", "triton"]
    for row in rows:
        cells = [float(c) for c in row.strip("|").split("|")[1:]]
        assert len(cells) == 8 and all(c > 0 for c in cells), row
    casts = {}
    for precision, counts in (("fp32", fp32), ("bf16", bf16)):
        assert counts.startswith(f" (forward + backward, {precision}"), counts[:80]
        rows = [line.strip("|").split("|") for line in counts.splitlines()
                if re.match(r"\| (eager|torch|triton) \|", line)]
        assert [r[0].strip() for r in rows] == ["eager", "torch", "triton"]
        for backend, *cells in rows:  # our ops and Triton's launches: triton's only
            aten, fills, cast, multi, ours, launches = (int(c) for c in cells)
            assert aten > 0 and fills + cast + multi <= aten
            assert (ours > 0) == (launches > 0) == (backend.strip() == "triton")
            casts[precision, backend.strip()] = cast, multi
    # autocast casts the activations on their way into a matmul and the backward their gradients back;
    # the weights, cast once a step, are two multi-tensor copies (forward, backward) in bf16, none in fp32.
    # Our kernels write most of those inputs in bf16 themselves (the norms, the FFN's bias sums): triton's
    # step keeps a few (the encoder output into the cross-attentions, the embeddings' into the first layers)
    for b in ("eager", "torch", "triton"):
        assert (casts["fp32", b][1], casts["bf16", b][1]) == (0, 2)
        assert casts["bf16", b][0] > casts["fp32", b][0] + (50 if b != "triton" else 4)
    assert casts["bf16", "triton"][0] < casts["bf16", "torch"][0] - 100
    # decoding lends its weights cast once a call: a step (with autocast's cast cache off, as in a CUDA
    # graph) casts none of them; the triton step's only cast is of an activation
    rows = {r[0].strip(): [float(c) for c in r[1:]] for r in (line.strip("|").split("|") for line in
            decoding.splitlines() if re.match(r"\| (eager|torch|triton) \|", line))}
    assert list(rows) == ["eager", "torch", "triton"], decoding
    aten, fills, cast, multi, ours, launches = rows["triton"]
    assert aten > 0 and cast <= 2 and multi == 0 and ours > 0 and launches > 0, decoding
    assert all(r[0] > r[2] > cast and r[4] == r[5] == 0 for b, r in rows.items() if b != "triton"), decoding
    collate = re.search(r"collate, one --max-tokens 8192 batch \((\d+) sentence pairs\): ([\d.]+) ms", out.read_text())
    assert collate and int(collate[1]) > 100 and float(collate[2]) > 0, out.read_text()


def test_stubbing_needs_the_interpreter():
    p = _run({}, "--kernels", "triton", "--calls", "1")
    assert p.returncode != 0 and "--stub-launches needs TRITON_INTERPRET=1" in p.stderr


def test_a_gemm_is_an_op_that_does_work(monkeypatch):
    """What a step issues counts the innermost aten ops that do work: a GEMM whose only aten children
    are views (`resolve_conj`) is one. Counting only the ops with no aten op at all under them
    left out every mm and bmm (267 of an eager step's), and the embedding's index_select, torch's
    native_layer_norm and its SDPA, whose children are views or allocations. A cast is one (and
    counted as a cast); a multi-tensor op is one, however many tensors (a few launches on a GPU)."""
    import torch
    from torch.autograd import DeviceType

    monkeypatch.syspath_prepend(os.path.dirname(TOOL))  # undone after the test: bench/ first would shadow
    import host_overhead  # tests/conftest.py for what a later test spawns

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    dst, src = [torch.empty(2), torch.empty(3)], [torch.randn(2), torch.randn(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a @ b  # mm: one GEMM
        a.t().contiguous()  # clone: its copy_ is the work
        a.view(-1)  # a view: none
        a.to(torch.float64)  # a cast: its copy_ is the work
        torch._foreach_copy_(dst, src)  # one multi-tensor op
    counts = host_overhead.issued([e for e in prof.events() if e.device_type == DeviceType.CPU])
    assert counts == {"aten ops": 4, "fills": 0, "casts": 1, "multi-tensor": 1, "our ops": 0}


@pytest.fixture
def host_overhead(monkeypatch):
    """bench/host_overhead.py imported, bench/ on the path only for the test (it would shadow tests/conftest.py
    for what a later test spawns)."""
    monkeypatch.syspath_prepend(os.path.dirname(TOOL))
    import host_overhead

    return host_overhead


def test_a_calls_time_is_measured_after_its_warm_up(host_overhead, monkeypatch):
    """per_call: `calls` calls' time over their number, after 5 untimed ones (compiling, autotuning, the
    allocator): on a stand-in clock, 5 calls of 100 s then 10 of 2 s take 2 s a call."""
    clock, made = [0.0], []

    def fn():
        clock[0] += 100.0 if len(made) < 5 else 2.0
        made.append(1)

    monkeypatch.setattr(host_overhead, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert host_overhead.per_call(fn, 10, "cpu") == 2.0 and len(made) == 15


def test_a_backends_row_is_in_microseconds_a_call_and_milliseconds_a_step_and_a_token(host_overhead, monkeypatch):
    """measure's units (its table's headers): each op's call in microseconds, the training step in
    milliseconds, greedy decoding in milliseconds a new token: every op call and step here takes 16 ms
    (a stand-in per_call), so 16,000 us an op, 16 ms a step; a decoding call of n tokens 10 + 2n ms (the
    encoder and, on a GPU, the step graph's capture once, then 2 ms a step), so 2 ms a token, where a
    16-token call over 16 gave 2.625 (the encoder and the capture spread over the tokens)."""
    monkeypatch.setattr(host_overhead, "per_call", lambda fn, calls, device: fn if isinstance(fn, float) else 0.016)
    monkeypatch.setattr(host_overhead, "model_step", lambda kernel, device: None)
    monkeypatch.setattr(host_overhead, "greedy_tokens", lambda kernel, device, n=16: (10 + 2 * n) / 1e3)
    ops = {f"{op} {mode}": 16_000.0 for op in host_overhead.OPS for mode in ("fwd", "fwd+bwd")}
    assert host_overhead.measure("eager", "cpu", 20) == pytest.approx({**ops, "step (ms)": 16.0,
                                                                       "greedy (ms/token)": 2.0})


def test_a_decoding_steps_counts_are_the_difference_of_two_lengths_per_token(host_overhead, monkeypatch):
    """decode_step_ops: what 16 new tokens issue less what 8 do (the encoder, the set-up), over the 8
    steps between: stand-in counts of 40 + 3 a token make 3 a step, a cast made once a call none."""
    monkeypatch.setattr(host_overhead, "greedy_tokens", lambda kernel, device, new_tokens, autocast: new_tokens)
    monkeypatch.setattr(host_overhead, "counted", lambda new_tokens: {"aten ops": 40 + 3 * new_tokens, "casts": 1})
    assert host_overhead.decode_step_ops("triton", "cpu") == {"aten ops": 3, "casts": 0}


def test_fills_are_counted_where_called_not_inside_another_op(host_overhead):
    """A fill (zeros, ones_like, ...) counts where Python, autograd or our ops call it, not where an aten
    op builds one inside (one_hot's zeros, before its scatter): two of the three here."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.zeros(3)
        torch.ones_like(torch.empty(2))
        F.one_hot(torch.tensor([0, 2]), 4)
    assert host_overhead.issued([e for e in prof.events() if e.device_type == DeviceType.CPU])["fills"] == 2


def test_what_a_call_issues_is_counted_after_a_first_call(host_overhead):
    """counted profiles a second call of fn, after one that compiles, tunes and allocates: work done
    only in the first call is not counted."""
    first = []

    def fn():
        if not first:
            first.append(torch.zeros(4) + 1)

    assert host_overhead.counted(fn) == {"aten ops": 0, "fills": 0, "casts": 0, "multi-tensor": 0, "our ops": 0,
                                         "Triton launches": 0}


def test_the_tables_headers_name_each_columns_unit(host_overhead):
    """The times table: an op's column in microseconds, "(us)" added to its name; a column already
    named in ms left as it is; under 10 two decimals, else one."""
    text = host_overhead.table({"eager": {"attention fwd": 12.345, "step (ms)": 1.234}})
    assert text.splitlines()[0] == "| backend | attention fwd (us) | step (ms) |"
    assert text.splitlines()[2] == "| eager | 12.3 | 1.23 |"


def test_greedy_ms_a_token_takes_the_least_of_three_timings_of_each_length(host_overhead, monkeypatch):
    """A noisy timing only adds time: the 16-token call measured 50, 42, 45 ms and the 8-token call 35, 26, 26
    give (42 - 26) / 8 = 2 ms a token, where the first of each gave 1.875 and a noisier pair went negative."""
    times = {16: iter([0.050, 0.042, 0.045]), 8: iter([0.035, 0.026, 0.026])}
    monkeypatch.setattr(host_overhead, "greedy_tokens", lambda kernel, device, n=16: n)
    monkeypatch.setattr(host_overhead, "per_call", lambda n, calls, device: next(times[n]))
    assert host_overhead.greedy_ms_per_token("triton", "cpu", 3) == pytest.approx(2.0)
