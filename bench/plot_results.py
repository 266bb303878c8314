"""Draw the benchmark plots from saved pytest-benchmark JSON files.

    python bench/plot_results.py bench/results/<run>.json [...] --out bench/results/plots

Plots (those whose groups are present in the files): attention TFLOP/s against sequence length per
kernel; add+LayerNorm GB/s against hidden size and the embedding's against the token count, each
with the measured copy-bandwidth roof; the FFN's TFLOP/s and its GEMM's against cuBLAS per shape; end-to-end
training tokens/s and peak memory per backend, launched and replayed as a CUDA graph. Kernel
throughputs are from device time (CUDA-graph replay, `tflops_gpu` / `gbps_gpu`), the cases without
it (a failed capture) left out, or from wall time where no case has it; the axis says which.
"""

import argparse
import json
import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths):
    rows = []
    for p in paths:
        with open(p) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as err:  # pytest-benchmark leaves an empty file when nothing ran
                raise SystemExit(f"{p}: not a pytest-benchmark JSON (empty or cut short: {err})") from None
        for b in data.get("benchmarks", []):
            params = b.get("params") or {}  # the test's parameters (L, kernel, ...), under what it recorded
            row = {**params, "group": b.get("group"), "name": b["name"], "params": params,
                   "median": b["stats"]["median"], **b.get("extra_info", {})}
            if row["group"] == "embed" and "gbps" in row and "unique_ids" not in row:
                _embed_bytes_as_now(row)
            rows.append(row)
    return rows


_ELEMENT_BYTES = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}


def _embed_bytes_as_now(row):
    """An embedding case saved before 2026-12-01 counted one weight row read per token; its GB/s are
    rescaled to bench_embed.py's count now, each distinct row read once. The ids were uniform draws
    (torch.randint over `vocab`), so the distinct count is its expectation V (1 - (1 - 1/V)^N), within
    0.3% of a draw at these sizes; the case records `unique_ids_expected`."""
    n, d, vocab, e = row["tokens"], row["d_model"], row["vocab"], _ELEMENT_BYTES[row["dtype"]]
    unique = vocab * (1 - (1 - 1 / vocab) ** n)
    extra = 0 if row.get("mode") == "fwd" else n * 8 + n * d * e + vocab * d * e  # int64 ids
    old, new = n * 8 + 2 * n * d * e + extra, n * 8 + (n + unique) * d * e + extra
    for key in ("gbps", "gbps_gpu"):
        if key in row:
            row[key] *= new / old
    row["unique_ids_expected"] = unique


def basis(cases, metric):
    """(the key to plot for `metric`, its axis note, the cases to plot): device time where any case
    has it, and then only the cases that have it (a case whose capture failed is left out, not
    drawn on the wall clock beside the others), else wall time."""
    timed = [r for r in cases if f"{metric}_gpu" in r]
    if timed:
        left_out = len(cases) - len(timed)
        return f"{metric}_gpu", "device time" + (f"; {left_out} without it left out" if left_out else ""), timed
    return metric, "wall time per call", cases


def plot_attention(rows, out):
    """TFLOP/s against L per kernel: one panel per batch kind (dense, padded) and head dim."""
    cases = [r for r in rows if r["group"] == "attention" and "tflops" in r and "L" in r
             and not r["name"].startswith("test_memory")]
    metric, note, cases = basis(cases, "tflops")
    panels = defaultdict(lambda: defaultdict(list))
    for r in cases:
        kind = "padded" if r["name"].startswith("test_padded") else "dense"
        series = (r.get("kernel"), r.get("mode"), r.get("causal"))
        panels[(kind, r.get("D"))][series].append((r["L"], r[metric]))
    if not panels:
        return None
    kinds = sorted({k for k, _ in panels})
    dims = sorted({d for _, d in panels}, key=lambda d: d or 0)
    kernels = sorted({str(kernel) for series in panels.values() for kernel, _, _ in series})  # a colour each
    fig, axes = plt.subplots(len(kinds), len(dims), figsize=(6.5 * len(dims), 4.5 * len(kinds)), squeeze=False)
    for key in panels:
        ax = axes[kinds.index(key[0])][dims.index(key[1])]
        for (kernel, mode, causal), pts in sorted(panels[key].items(), key=str):
            pts.sort()
            ax.plot(*zip(*pts), label=f"{kernel} {mode}{' causal' if causal else ''}",
                    **_style(kernels, kernel, mode, causal))
        ax.set(xscale="log", xlabel="sequence length", ylabel=f"TFLOP/s (unmasked work; {note})",
               title=f"attention, {key[0]} batch, head dim {key[1]}")
        ax.legend(fontsize=6)
    return _save(fig, out, "attention_tflops.png")


def plot_layer_norm(rows, out):
    """GB/s against the hidden size (N) per kernel and mode, at the run's largest row count, under
    the copy bandwidth measured in the same run (bench_add_layer_norm.py's keys: rows, N)."""
    cases = [r for r in rows if r["group"] == "add_layer_norm" and "gbps" in r and "N" in r]
    roofs = [r["copy_bandwidth_gbps"] for r in rows if r["group"] == "add_layer_norm" and "copy_bandwidth_gbps" in r]
    if not cases:
        return None
    most = max(r["rows"] for r in cases)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    _gbps_panel(ax, [r for r in cases if r["rows"] == most], "N", roofs)
    ax.set(xlabel=f"hidden size ({most} rows)", title="add + LayerNorm")
    return _save(fig, out, "add_layer_norm_gbps.png")


def plot_embedding(rows, out):
    """The embedding's GB/s against the token count per kernel and mode, one panel per model width,
    bf16, under the measured copy bandwidth (bench_embed.py's keys: tokens, d_model, dtype)."""
    cases = [r for r in rows if r["group"] == "embed" and "gbps" in r and r.get("dtype") == "torch.bfloat16"]
    if not cases:
        return None
    widths = sorted({r["d_model"] for r in cases})
    fig, axes = plt.subplots(1, len(widths), figsize=(8.5 * len(widths), 4.5), squeeze=False)
    for ax, d in zip(axes[0], widths):
        width = [r for r in cases if r["d_model"] == d]
        _gbps_panel(ax, width, "tokens", [r["copy_bandwidth_gbps"] for r in width if "copy_bandwidth_gbps" in r])
        ax.set(xlabel="tokens", title=f"embedding, d_model {d}, bf16")
    return _save(fig, out, "embed_gbps.png")


def plot_ffn(rows, out):
    """TFLOP/s per shape (tokens x d_model x d_ff): the FFN per kernel and mode (bench_ffn.py's
    test_ffn), and its first GEMM per kernel against cuBLAS (`torch`; test_matmul)."""
    cases = [r for r in rows if r["group"] == "ffn" and "tflops" in r and "d_ff" in r]
    if not cases:
        return None
    panels = [("FFN", [r for r in cases if r["name"].startswith("test_ffn")]),
              ("the FFN's first GEMM (torch: cuBLAS)", [r for r in cases if r["name"].startswith("test_matmul")])]
    panels = [(title, part) for title, part in panels if part]
    fig, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 4.5), squeeze=False)
    for ax, (title, part) in zip(axes[0], panels):
        metric, note, part = basis(part, "tflops")
        shapes = sorted({(r["tokens"], r["d_model"], r["d_ff"]) for r in part})
        series = sorted({(r["kernel"], r.get("mode")) for r in part}, key=str)
        width = 0.8 / len(series)
        for i, (kernel, mode) in enumerate(series):
            vals = {(r["tokens"], r["d_model"], r["d_ff"]): r[metric] for r in part
                    if (r["kernel"], r.get("mode")) == (kernel, mode)}
            ax.bar([j + i * width for j in range(len(shapes))], [vals.get(sh, 0) for sh in shapes], width,
                   label=f"{kernel} {mode or ''}".strip())
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(shapes))],
                      [f"{t} x {d} x {f}" for t, d, f in shapes], fontsize=7)
        ax.set(xlabel="tokens x d_model x d_ff", ylabel=f"TFLOP/s ({note})", title=title)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, out, "ffn_tflops.png")


_MODE_STYLE = {"fwd": ("-", "o"), "fwd_bwd": ("--", "s"), "fwd+bwd": ("--", "s"), "bwd": (":", "D")}


def _style(kernels, kernel, mode, causal=False) -> dict:
    """How a series is drawn: a colour per kernel (its place in `kernels`), a line style and a marker
    per mode, triangles under a causal mask (a run at one length draws markers alone), so that no two
    series of a panel look alike (attention's drew its ~30 in the default cycle's 10 colours and one
    marker: triton's forward as SDPA's)."""
    ls, marker = _MODE_STYLE.get(mode, ("-", "o"))
    if causal:
        marker = "^" if marker == "o" else "v"
    return dict(color=f"C{kernels.index(str(kernel)) % 10}", ls=ls, marker=marker)


def _gbps_panel(ax, cases, x_key, roofs):
    """One line of GB/s against cases' x_key per (kernel, mode), on `basis`'s clock (`_style`), under
    the highest measured copy bandwidth in roofs; log x."""
    metric, note, cases = basis(cases, "gbps")
    series = defaultdict(dict)
    for r in cases:
        series[(r.get("kernel"), r.get("mode"))][r[x_key]] = r[metric]
    kernels = sorted({str(kernel) for kernel, _ in series})
    for (kernel, mode), pts in sorted(series.items(), key=str):
        ax.plot(sorted(pts), [pts[x] for x in sorted(pts)], label=f"{kernel} {mode}", **_style(kernels, kernel, mode))
    if roofs:
        ax.axhline(max(roofs), color="k", ls="--", label=f"copy bandwidth {max(roofs):.0f} GB/s")
    ax.set(xscale="log", ylabel=f"GB/s ({note})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


def plot_train_step(rows, out):
    rs = [r for r in rows if r["group"] == "train_step" and "tokens_per_s" in r]
    if not rs:
        return None
    shapes = sorted({r["shape"] for r in rs})
    kinds = ("eager", "torch", "triton", "compile", "compile-triton", "eager-recompute", "triton-recompute")
    kernels = [k + ("\n(graph)" if graph else "") for graph in (False, True) for k in kinds
               if any(r["kernel"] == k and bool(r.get("graph")) == graph for r in rs)]
    fig, axes = plt.subplots(1, 2, figsize=(10 * max(1, len(kernels) // 5), 4))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        vals = {r["kernel"] + ("\n(graph)" if r.get("graph") else ""): r for r in rs if r["shape"] == shape}
        xs = [j + i * width for j in range(len(kernels))]
        axes[0].bar(xs, [vals[k]["tokens_per_s"] if k in vals else 0 for k in kernels], width, label=shape)
        axes[1].bar(xs, [vals[k]["peak_mem_gib"] if k in vals else 0 for k in kernels], width, label=shape)
    for ax, yl in zip(axes, ["non-pad tokens/s", "peak memory (GiB)"]):
        ax.set_xticks([j + width * (len(shapes) - 1) / 2 for j in range(len(kernels))],
                      [k.replace("-recompute", "\n(recompute)") for k in kernels])
        ax.set_ylabel(yl)
        ax.legend(fontsize=7)
    fig.suptitle("training step, bf16 autocast")
    return _save(fig, out, "train_step.png")


def _save(fig, out, name):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default="bench/results/plots")
    args = ap.parse_args(argv)
    rows = load(args.json)
    for fn in (plot_attention, plot_layer_norm, plot_embedding, plot_ffn, plot_train_step):
        path = fn(rows, args.out)
        if path:
            print("wrote", path)


if __name__ == "__main__":
    main()
