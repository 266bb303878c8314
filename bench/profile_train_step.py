"""Where a training step's time goes, per backend (issue 17): one step of bench_train_step.py's
`training_step` (forward, backward, AdamW; bf16 autocast) under torch.profiler.

    python bench/profile_train_step.py --shape base-cnndm --out bench/results/<date>-<gpu>-profile.txt

For each backend: the GPU kernels' time sorted into attention, LayerNorm, GEMM (the projections
and the eager backend's attention products, which no kernel name tells apart), embedding, loss,
optimizer and other, by kernel name (`CATEGORIES`), and the FFN (`ffn_moves`: the GEMM and other
kernels of every op with an input of the model's d_ff, which only the FFN has, forward and backward,
whatever the backend; until 2026-12-07 its GEMMs were in the GEMM's share); the top kernels; and
the host-device synchronisations per step (the CUDA runtime's synchronize calls and blocking
copies, from the CPU side of the trace); and the host's side: the step's wall time unprofiled
against the GPU kernels' time (the share the GPU idles), and the CPU-side events (ops, CUDA API
calls such as kernel launches) with the most self time. Steps run after a warm-up, so autotuning and compiling
are not in the profile. `--device cpu` profiles CPU ops instead (a rehearsal: the same report on
CPU op names, with no GPU kernels and no syncs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# bench_train_step is imported where it is used: its `conftest` is bench/'s, which tests/ (importing
# `category`) would shadow
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (category, name fragments), first match wins on the lower-cased kernel (or op) name
CATEGORIES = [
    ("optimizer", ("adam", "multi_tensor")),
    ("loss", ("nll_loss", "cross_entropy", "log_softmax", "logsoftmax")),
    ("attention", ("attention", "attn", "flash", "fmha", "sdpa", "softmax")),
    # torch's LayerNorm weight and bias gradients (GammaBetaBackward...); ours end in the second stage
    # of kernels/partial_sums.py, which also sums the FFN's bias gradients (12 of a base step's 72
    # launches: counted here all the same)
    ("layernorm", ("layer_norm", "layernorm", "gammabeta", "sum_partials")),
    # F.embedding's forward gathers rows (indexSelectLargeIndex / SmallIndex); the embedding's backward
    # sorts its ids (ours and F.embedding's: cub's radix sort, the step's only sort), then F.embedding's
    # sums its runs by segment
    ("embedding", ("embed", "index_select", "indexselect", "indexing_backward", "radixsort", "partials_per_segment",
                   "partial_segment", "compute_grad_weight", "sum_and_scatter")),
    ("gemm", ("gemm", "matmul", "xmma", "nvjet", "cutlass", "cublas", "addmm", "aten::mm", "aten::bmm", "linear")),
]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, frags in CATEGORIES if any(f in low for f in frags)), "other")


def gpu_kernels(averages) -> list:
    """The kernels among a profile's events. The GPU timeline also holds user annotations (the
    optimizer's `Optimizer.step#AdamW.step` range over its own kernels): counted as kernels they
    counted the optimizer twice (until 2026-11-28: 1.2 ms a base/CNN-DM step, 8% of the total)."""
    return [e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def step_syncs(averages, device: str) -> int:
    """The host-device syncs of the profiled steps: `SYNCS` calls on the CPU side, less the
    cudaDeviceSynchronize that closes the profile (counted until 2026-11-28: 1/3 a step of 3)."""
    syncs = sum(e.count for e in averages if e.device_type == DeviceType.CPU and e.key in SYNCS)
    return syncs - (device == "cuda")


def _has_dim(shapes, n: int) -> bool:
    """Whether a profiled op's input shapes (lists of dims, nested for a list of tensors) hold a dim n."""
    return any(_has_dim(x, n) for x in shapes) if isinstance(shapes, (list, tuple)) else shapes == n


def ffn_moves(events, d_ff: int, device: str) -> dict[str, float]:
    """The FFN's time, by the category its kernels' names put it in (gemm, other: the share it leaves):
    the kernels (on a CPU, the self time) of every op with an input of a d_ff-sized dim, which only the
    FFN has (its weights, its hidden activations, their gradients), so every backend's FFN, forward and
    backward, alike; a kernel named as another category's (the optimizer's over every weight) stays."""
    moved = defaultdict(float)
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_user_annotation or not _has_dim(e.input_shapes, d_ff):
            continue
        for name, t in ([(k.name, k.duration) for k in e.kernels] if device == "cuda"
                        else [(e.name, e.self_cpu_time_total)]):
            if (cat := category(name)) in ("gemm", "other"):
                moved[cat] += t
    return moved


def profile_backend(kernel: str, shape: str, device: str, steps: int, warmup: int = 3) -> str:
    from bench_train_step import SHAPES, training_step

    from scratchformer.model import get_config

    step, _ = training_step(shape, kernel, device)
    for _ in range(warmup):  # autotuning, compiling, allocator
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()  # the step's wall time, unprofiled (the profiler slows the host)
    for _ in range(steps):
        step()
    sync()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:  # the shapes tell the FFN's ops
        for _ in range(steps):
            step()
        sync()  # this sync is the report's, not the steps': not counted below
    averages = prof.key_averages()
    kernels = gpu_kernels(averages)
    if kernels:
        timed, unit = [(e.key, e.self_device_time_total, e.count) for e in kernels], "GPU kernels"
    else:  # CPU: top-level-free self time of the ops
        timed, unit = [(e.key, e.self_cpu_time_total, e.count) for e in averages], "CPU ops (self time)"
    total = sum(t for _, t, _ in timed) or 1
    shares = defaultdict(float)
    for name, t, _ in timed:
        shares[category(name)] += t
    for cat, t in ffn_moves(prof.events(), get_config(SHAPES[shape]["preset"]).d_ff, device).items():
        shares[cat] -= t
        shares["ffn"] += t
    syncs = step_syncs(averages, device)
    lines = [f"== {kernel}: {total / steps / 1e3:.2f} ms of {unit} per step, {syncs / steps:g} host-device syncs "
             f"per step ({', '.join(SYNCS)})",
             "share by category: " + ", ".join(f"{c} {100 * t / total:.1f}%" for c, t in
                                                 sorted(shares.items(), key=lambda kv: -kv[1]))]
    lines.append(f"{'ms/step':>9} {'share':>6} {'calls':>6}  category    name")
    for name, t, n in sorted(timed, key=lambda r: -r[1])[:15]:
        share = 100 * t / total
        lines.append(f"{t / steps / 1e3:9.3f} {share:5.1f}% {n // steps:6d}  {category(name):<10}  {name[:110]}")
    lines += host_lines(averages, wall_ms, total / steps / 1e3 if kernels else None, steps)
    return "\n".join(lines)


def host_lines(averages, wall_ms: float, gpu_ms: float | None, steps: int) -> list[str]:
    """The host's side: the unprofiled step's wall time against the GPU kernels' time (what share of
    the step the GPU idles), and the CPU-side events with the most self time (ops, CUDA API calls
    such as the launches), per step."""
    idle = ""
    if gpu_ms:
        idle = f", the GPU kernels {gpu_ms:.2f} ms: idle {100 * max(0.0, 1 - gpu_ms / wall_ms):.0f}% of it"
    host = sorted((e for e in averages if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
    lines = [f"host: the step takes {wall_ms:.2f} ms of wall time unprofiled{idle}; CPU events by self time:",
             f"{'ms/step':>9} {'calls':>6}  name"]
    lines += [f"{e.self_cpu_time_total / steps / 1e3:9.3f} {e.count // steps:6d}  {e.key[:110]}" for e in host[:12]]
    return lines


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="base-cnndm", help="a shape of bench/bench_train_step.py")
    p.add_argument("--kernels", nargs="+", default=["eager", "torch", "triton"])
    p.add_argument("--steps", type=int, default=3, help="profiled steps per backend")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps before them (autotuning, compiling)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the report here too")
    args = p.parse_args(argv)
    from bench_train_step import SHAPES

    if args.shape not in SHAPES:
        p.error(f"--shape {args.shape}: choose one of {', '.join(SHAPES)}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    head = (f"training step profile: shape {args.shape} (bench_train_step.py), {name}, torch {torch.__version__}, "
            f"{'bf16 autocast' if args.device == 'cuda' else 'fp32'}, {args.steps} steps per backend after "
            f"{args.warmup} warm-up steps\n"
            f"command: python {' '.join(sys.argv)}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    sections = [profile_backend(k, args.shape, args.device, args.steps, args.warmup) for k in args.kernels]
    report = "\n\n".join([head, *sections]) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report, encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
