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
  (6 + 6, 8 heads) at d_model 64, in milliseconds: the number of calls a base step makes;
- greedy decoding with the KV cache on that model, in milliseconds per new token (no gradient:
  the ops without their autograd);
- and once, backend aside: the training loader's collate of one 8,192-token batch of short
  sentences (Multi30k's lengths), in milliseconds: host work on the training loop's thread each
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


def model_step(kernel: str, device: str):
    """A closure running forward + backward of a base-layered, narrow model on one tiny batch."""
    from scratchformer.model import build_model, get_config
    from scratchformer.training.optim import label_smoothed_loss

    torch.manual_seed(0)
    cfg = get_config("base", src_vocab_size=512, kernel=kernel, d_model=64, n_heads=4, d_ff=128)
    model = build_model(cfg, device).train()
    src, tgt_in, tgt_out = (torch.randint(4, 512, (2, 8), device=device) for _ in range(3))
    lengths = torch.tensor([8, 5], device=device)

    def step():
        logits = model(src, lengths, tgt_in, lengths)
        loss, _ = label_smoothed_loss(logits.flatten(0, 1), tgt_out.flatten(), 0.1)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def greedy_tokens(kernel: str, device: str, new_tokens: int = 16):
    """A closure decoding `new_tokens` greedily (no EOS) for a batch of 2 on the base-layered model."""
    from scratchformer.model import build_model, get_config, greedy_decode

    torch.manual_seed(0)
    cfg = get_config("base", src_vocab_size=512, kernel=kernel, d_model=64, n_heads=4, d_ff=128)
    model = build_model(cfg, device).eval()
    src, lengths = torch.randint(4, 512, (2, 8), device=device), torch.tensor([8, 5], device=device)

    @torch.no_grad()
    def decode():
        greedy_decode(model, src, lengths, max_len=new_tokens, eos_id=-1, check_every=new_tokens)  # no EOS: no sync

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
    row["greedy (ms/token)"] = per_call(greedy_tokens(kernel, device), max(calls // 40, 3), device) * 1e3 / 16
    return row


def collate_ms(calls: int) -> tuple[float, int]:
    """(milliseconds per collate, sentences) of one 8,192-token batch of 8-24-token sentence pairs."""
    import numpy as np

    from scratchformer.data import collate

    rng = np.random.default_rng(0)
    n = 8192 // 24
    items = [(i, rng.integers(4, 8000, rng.integers(8, 24)).astype(np.int32),
              rng.integers(4, 8000, rng.integers(8, 24)).astype(np.int32)) for i in range(n)]
    return per_call(lambda: collate(items), calls, "cpu") * 1e3, n


def table(rows: dict) -> str:
    cols = list(next(iter(rows.values())))
    lines = ["| backend | " + " | ".join(f"{c} (us)" if "ms" not in c else c for c in cols) + " |",
             "| --- " * (len(cols) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{v:.2f}" if v < 10 else f"{v:.1f}" for v in row.values()) + " |"
              for k, row in rows.items()]
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
    ms, n = collate_ms(args.calls)
    report += f"\n\nthe training loader's collate, one 8,192-token batch ({n} sentence pairs): {ms:.2f} ms"
    print(report)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    return report


if __name__ == "__main__":
    main()
