"""Host time per op call and per training step, per backend (issue 17: the step is host-bound).

    python bench/host_overhead.py                      # on a GPU: real launches, tiny shapes
    TRITON_INTERPRET=1 python bench/host_overhead.py   # on the CPU: --stub-launches is implied

What a call costs the CPU before the GPU has work: the op's checks, its autograd, the torch op
dispatch and the kernel launches. Shapes are tiny (a few rows of width 64), so the GPU finishes
each kernel long before the host issues the next one and the wall time of N calls is the host's.
Two measures per backend:
- each op (`attention` with key lengths, `add_layer_norm`, `ffn`) forward, and forward + backward,
  in microseconds per call;
- a training step (forward, backward; no optimizer) of a model with the `base` preset's layers
  (6 + 6) at d_model 64 with 4 heads (d_ff 128), in milliseconds: the number of calls a base step makes;
- greedy decoding with the KV cache on that model, in milliseconds per new token (no gradient:
  the ops without their autograd): a 16-token call's time less an 8-token call's, over the 8 steps
  between, so what a call does once (the encoder, and on a GPU the step graph's warm-up and capture)
  is not spread over its tokens (`greedy_ms_per_token`; until 2026-12-01 a 16-token call over 16);
- what one such training step issues, counted, in fp32 and again with its forward under bf16
  autocast as the trainer's GPU step runs (the lengths' range checks, which read values on the CPU
  only, skipped as on a GPU): the aten ops that do work (each a kernel or more on a GPU: the
  innermost that do work in a CPU-side profile, inside our ops too; views, `empty` and the like
  left out), the filled tensors built (zeros, full, ones: an FFN's autograd built an (M, d_ff) zero
  gradient it never read until this count showed it), the dtype casts (autocast's, weights and
  activations, and the backward's casts of their gradients), our torch ops' calls, and the Triton
  launches;
- what one greedy decoding step of that model issues under bf16 autocast with its cast cache off,
  as a CUDA graph's capture of the step holds it (decoding's default on a GPU): the same counts;
- and once, backend aside: the training loader's collate of one batch that `--max-tokens 8192`
  would make of short sentences (Multi30k's lengths: 341 pairs of 8-23 tokens, 24 slots each with
  BOS or EOS, about 5.3k tokens a side), in milliseconds: host work on the training loop's thread each
  step (`num_workers` 0), which a step replayed as a CUDA graph (`train --cuda-graphs`) waits on.

On the CPU, Triton kernels run in the interpreter, whose cost would swamp everything else:
`--stub-launches` turns every Triton launch into a no-op (outputs are garbage), which measures the
triton backend's host code without the launches; the eager and torch backends run their (tiny)
CPU kernels. Those figures compare our Python and dispatch layers with torch's on one machine;
a GPU adds each backend's launch costs (Triton's launcher for ours, the CUDA runtime's for all).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from unittest import mock

import torch

OPS = ("attention", "add_layer_norm", "ffn")


def stub_triton_launches() -> None:
    """Every Triton launch under the interpreter returns at once (nothing runs)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--stub-launches needs TRITON_INTERPRET=1 (set before the kernels are imported)")
    from triton.runtime import interpreter

    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None


def op_calls(ops, device: str) -> dict:
    """name -> a closure calling that op once on tiny inputs that need gradients."""
    def leaf(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    q, k, v = leaf(2, 4, 8, 16), leaf(2, 4, 8, 16), leaf(2, 4, 8, 16)
    lengths = torch.tensor([8, 5], device=device)
    x, res, w, b = leaf(16, 64), leaf(16, 64), leaf(64), leaf(64)
    w1, b1, w2, b2 = leaf(128, 64), leaf(128), leaf(64, 128), leaf(64)
    return {
        "attention": lambda: ops.attention(q, k, v, key_lengths=lengths),
        "add_layer_norm": lambda: ops.add_layer_norm(x, res, w, b),
        "ffn": lambda: ops.ffn(x, w1, b1, w2, b2),
    }


def model_step(kernel: str, device: str, autocast: torch.dtype | None = None):
    """A closure running forward + backward of a base-layered, narrow model on one tiny batch; with
    `autocast` (torch.bfloat16), the forward under autocast to it, its weights cast once
    (`WeightCast`), as the trainer's bf16 step."""
    from scratchformer.model import build_model, get_config
    from scratchformer.model.weight_cast import WeightCast

    torch.manual_seed(0)
    cfg = get_config("base", src_vocab_size=512, kernel=kernel, d_model=64, n_heads=4, d_ff=128)
    model = build_model(cfg, device).train()
    src, tgt_in, tgt_out = (torch.randint(4, 512, (2, 8), device=device) for _ in range(3))
    lengths = torch.tensor([8, 5], device=device)

    cast = WeightCast(model, autocast)  # as the trainer's step: the weights cast once, all together

    def step():
        with torch.autocast(torch.device(device).type, dtype=autocast) if autocast else nullcontext(), cast():
            loss, _ = model(src, lengths, tgt_in, lengths, target=tgt_out, label_smoothing=0.1)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


# aten ops that launch nothing on a GPU: metadata, allocations without a fill
NO_WORK = {"empty", "empty_strided", "empty_like", "new_empty", "detach", "detach_", "alias", "lift_fresh",
           "resize_", "set_", "result_type", "_local_scalar_dense", "item"}
FOREACH = "aten::_foreach_"  # multi-tensor ops (one launch per many tensors on a GPU)
# tensors built filled, counted where called from Python, autograd or our ops (not inside another aten op)
FILLS = {"zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full", "ones", "ones_like", "new_ones"}


def _does_work(name: str) -> bool:
    """Whether the aten op `name` (one with no working aten op under it) runs a kernel."""
    if name in NO_WORK:
        return False
    packet = getattr(torch.ops.aten, name, None)
    return packet is None or not any(getattr(packet, o).is_view for o in packet.overloads())


def step_ops(kernel: str, device: str, autocast: torch.dtype | None = None) -> dict:
    """What one training step of `model_step` issues (module docstring), counted from a CPU-side
    profile of it (`issued`): the innermost aten ops that do work, anywhere (inside our ops too), the fills
    and the dtype casts among them, our ops' calls, and the Triton launches."""
    return counted(model_step(kernel, device, autocast))


def decode_step_ops(kernel: str, device: str) -> dict:
    """What one greedy decoding step issues under bf16 autocast with its cast cache off, as a CUDA
    graph's capture of the step holds it: a call of 16 new tokens's counts less one of 8's, over 8."""
    long, short = (counted(greedy_tokens(kernel, device, n, torch.bfloat16)) for n in (16, 8))
    return {k: (long[k] - short[k]) / 8 for k in long}


def counted(fn) -> dict:
    """What fn() issues, after a call that compiles, tunes and allocates (`step_ops`)."""
    from torch.autograd import DeviceType
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    fn()
    cls = InterpretedFunction if os.environ.get("TRITON_INTERPRET") == "1" else JITFunction
    run, launches = cls.run, [0]

    def counting(self, *args, **kwargs):
        launches[0] += 1
        return run(self, *args, **kwargs)

    cls.run = counting
    try:
        with mock.patch("scratchformer.op_checks.value_checks", lambda t: False), \
                mock.patch("scratchformer.kernels.attention.value_checks", lambda t: False), \
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()  # as on a GPU: the lengths' range checks, which read values (a sync there), skipped
    finally:
        cls.run = run
    return {**issued([e for e in prof.events() if e.device_type == DeviceType.CPU]), "Triton launches": launches[0]}


def issued(events) -> dict:
    """From a CPU-side profile's events: the aten ops that do work with no working aten op under
    them (the innermost that do work: a GEMM whose only aten child is `resolve_conj`, a view, is
    one, where "no aten op under it" left out every mm and bmm, 267 of an eager step's), the fills
    called from Python, autograd or our ops, the dtype casts (`_to_copy`: autocast's casts of weights
    and activations, and their backward's casts of the gradients; each one copy_ among the ops), the
    multi-tensor ops among them (`_foreach_*`, each counted once: on a GPU a few launches for all its
    tensors, on the CPU a loop of per-tensor ops, not counted apart), and our ops' calls."""
    def working_below(e) -> bool:
        return any(c.name.startswith("aten::") and (_does_work(c.name[6:]) or working_below(c)) for c in e.cpu_children)

    def in_foreach(e) -> bool:
        return e.cpu_parent is not None and (e.cpu_parent.name.startswith(FOREACH) or in_foreach(e.cpu_parent))

    foreach = [e for e in events if e.name.startswith(FOREACH) and not in_foreach(e)]
    work = [e for e in events if e.name.startswith("aten::") and _does_work(e.name[6:]) and not working_below(e)
            and not in_foreach(e) and not e.name.startswith(FOREACH)] + foreach
    fills = [e for e in events if e.name[6:] in FILLS and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]
    casts = [e for e in events if e.name == "aten::_to_copy" and not (e.cpu_parent and e.cpu_parent.name == e.name)]
    ours = sum(e.name.startswith("scratchformer::") for e in events)
    return {"aten ops": len(work), "fills": len(fills), "casts": len(casts), "multi-tensor": len(foreach),
            "our ops": ours}


def greedy_tokens(kernel: str, device: str, new_tokens: int = 16, autocast: torch.dtype | None = None):
    """A closure decoding `new_tokens` greedily (no EOS) for a batch of 2 on the base-layered model
    (on a GPU each step a CUDA graph's replay, decoding's default); with `autocast`, under autocast
    to it with its cast cache off, as inside a graph's capture, and every step launched: what a
    captured step holds, counted (`decode_step_ops`)."""
    from scratchformer.model import build_model, get_config, greedy_decode

    torch.manual_seed(0)
    cfg = get_config("base", src_vocab_size=512, kernel=kernel, d_model=64, n_heads=4, d_ff=128)
    model = build_model(cfg, device).eval()
    src, lengths = torch.randint(4, 512, (2, 8), device=device), torch.tensor([8, 5], device=device)

    @torch.no_grad()
    def decode():
        with torch.autocast(torch.device(device).type, dtype=autocast, cache_enabled=False) if autocast \
                else nullcontext():
            greedy_decode(model, src, lengths, max_len=new_tokens, eos_id=-1, check_every=new_tokens,  # no EOS: no sync
                          cuda_graph=False if autocast else None)

    return decode


def per_call(fn, calls: int, device: str) -> float:
    """Seconds per call of fn, after a warm-up (compiling, autotuning, the allocator)."""
    for _ in range(5):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def measure(kernel: str, device: str, calls: int) -> dict:
    from scratchformer import ops as backends

    ops = backends.select(kernel, device)
    row = {}
    for name, call in op_calls(ops, device).items():
        row[f"{name} fwd"] = per_call(call, calls, device) * 1e6
        row[f"{name} fwd+bwd"] = per_call(lambda c=call: c().sum().backward(), calls, device) * 1e6
    row["step (ms)"] = per_call(model_step(kernel, device), max(calls // 20, 5), device) * 1e3
    row["greedy (ms/token)"] = greedy_ms_per_token(kernel, device, max(calls // 40, 3))
    return row


def greedy_ms_per_token(kernel: str, device: str, calls: int) -> float:
    """Milliseconds a new token of greedy decoding: a 16-token call's time less an 8-token call's, over
    the 8 steps between (as `decode_step_ops` counts), so the encoder and, on a GPU, the step graph's
    warm-up and capture (once a call) fall out, and what is left is a step replayed (launched on the CPU).
    Each call's time is the least of 3 means of `calls` calls: the difference of two noisy times is the
    step's only when neither is inflated, and a shared machine's noise only adds time (on 2026-12-07 a
    single mean each, in a CI run beside a test process, made it -0.56 ms)."""
    long, short = (min(per_call(greedy_tokens(kernel, device, n), calls, device) for _ in range(3)) for n in (16, 8))
    return (long - short) / 8 * 1e3


def collate_ms(calls: int) -> tuple[float, int]:
    """(milliseconds per collate, sentences) of one batch of 8-23-token sentence pairs, 8,192 // 24 of them: what
    --max-tokens 8192 makes of them (24 slots each, BOS or EOS added)."""
    import numpy as np

    from scratchformer.data import collate

    rng = np.random.default_rng(0)
    n = 8192 // 24
    items = [(i, rng.integers(4, 8000, rng.integers(8, 24)).astype(np.int32),
              rng.integers(4, 8000, rng.integers(8, 24)).astype(np.int32)) for i in range(n)]
    return per_call(lambda: collate(items), calls, "cpu") * 1e3, n


def table(rows: dict, header=lambda c: f"{c} (us)" if "ms" not in c else c,
          cell=lambda v: f"{v:.2f}" if v < 10 else f"{v:.1f}") -> str:
    """A markdown table of {backend: {column: value}}: the times by default, the counts with str."""
    cols = list(next(iter(rows.values())))
    lines = ["| backend | " + " | ".join(map(header, cols)) + " |", "| --- " * (len(cols) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(map(cell, row.values())) + " |" for k, row in rows.items()]
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", nargs="+", default=["eager", "torch", "triton"])
    p.add_argument("--calls", type=int, default=200, help="calls per op measure (a twentieth for the step)")
    p.add_argument("--stub-launches", action="store_true", help="Triton launches do nothing (CPU, interpreter)")
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args(argv)
    if args.stub_launches or (args.device == "cpu" and "triton" in args.kernels):
        stub_triton_launches()
    torch.set_num_threads(1)  # host cost of one thread issuing work, as a GPU step has
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton launches stubbed)"
    report = (f"host time per call, {where}, torch {torch.__version__}; tiny shapes (module docstring)\n\n"
              + table({k: measure(k, args.device, args.calls) for k in args.kernels}))
    for name, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
        counts = {k: step_ops(k, args.device, dtype) for k in args.kernels}
        report += (f"\n\nwhat one such step (forward + backward, {name}) issues: aten ops that do work (of them, "
                   "fills and dtype casts), our ops' calls, Triton launches\n\n" + table(counts, str, str))
    counts = {k: decode_step_ops(k, args.device) for k in args.kernels}
    report += ("\n\nwhat one greedy decoding step issues under bf16 autocast, its cast cache off as in a CUDA graph's "
               "capture (16 tokens' counts less 8's, over 8)\n\n" + table(counts, str, lambda v: f"{v:g}"))
    ms, n = collate_ms(args.calls)
    report += f"\n\nthe training loader's collate, one --max-tokens 8192 batch ({n} sentence pairs): {ms:.2f} ms"
    print(report)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    return report


if __name__ == "__main__":
    main()
