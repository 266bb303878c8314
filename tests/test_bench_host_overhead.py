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

from conftest import DEVICE

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
    collate = re.search(r"collate, one 8,192-token batch \((\d+) sentence pairs\): ([\d.]+) ms", out.read_text())
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
