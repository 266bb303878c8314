"""PNG plots: training curves (loss, perplexity, learning rate), attention heatmaps, ablations.

matplotlib with the non-interactive Agg backend, so plotting works on headless machines.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..checkpoint import write_bytes_atomic  # noqa: E402


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_curves(rows: list[dict], path: str | Path, title: str = "", unit: str = "token") -> Path:
    """Train/valid loss, perplexity and learning rate against the optimizer step; the loss is per
    `unit` (token; a classifier's per example, an extractive model's per sentence). Lines of a few
    points carry markers: a short run (under --log-every steps) has one train row, which a line alone
    did not draw."""
    train = [r for r in rows if r.get("split") == "train"]
    valid = [r for r in rows if r.get("split") == "valid"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss, ax_ppl, ax_lr = axes
    if train:
        steps = [r["step"] for r in train]
        kw = dict(marker="o" if len(steps) < 20 else None, markersize=3)
        ax_loss.plot(steps, [r["loss"] for r in train], label="train (label-smoothed)", alpha=0.8, **kw)
        if "nll" in train[0]:
            ax_loss.plot(steps, [r["nll"] for r in train], label="train NLL", alpha=0.8, **kw)
            ax_ppl.plot(steps, [math.exp(min(r["nll"], 50)) for r in train], label="train", **kw)
        ax_lr.plot(steps, [r["lr"] for r in train], **kw)
    if valid:
        steps = [r["step"] for r in valid]
        ax_loss.plot(steps, [r["loss"] for r in valid], "o-", label="valid NLL")
        ax_ppl.plot(steps, [r["ppl"] for r in valid], "o-", label="valid")
    ax_loss.set(xlabel="step", ylabel=f"loss (nats/{unit})", title="loss")
    ax_ppl.set(xlabel="step", ylabel="perplexity", title="perplexity", yscale="log")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    for ax in (ax_loss, ax_ppl):
        if ax.lines:
            ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_attention(weights, row_labels: list[str], col_labels: list[str], path: str | Path, title: str = "") -> Path:
    """Heatmap of an attention matrix (rows attend to columns)."""
    h, w = weights.shape
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * w + 2), max(3.5, 0.32 * h + 1.5)))
    im = ax.imshow(weights, cmap="viridis", aspect="auto", vmin=0.0)
    ax.set_xticks(range(w))
    ax.set_xticklabels([_label(s) for s in col_labels[:w]], rotation=90, fontsize=8)
    ax.set_yticks(range(h))
    ax.set_yticklabels([_label(s) for s in row_labels[:h]], fontsize=8)
    ax.set(xlabel="attended (keys)", ylabel="attending (queries)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    return _save(fig, path)


def plot_ablation(results: list[dict], metric: str, path: str | Path, title: str = "") -> Path:
    """Left: the final metric per variant (bars). Right: each variant's validation loss curve.

    results: [{"name": str, "final": {metric: value, ...}, "curve": [(step, valid loss), ...]}].
    """
    fig, (ax_bar, ax_curve) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["name"] for r in results]
    vals = [r["final"].get(metric, float("nan")) for r in results]
    bars = ax_bar.bar(range(len(names)), vals, color="tab:blue")
    ax_bar.bar_label(bars, fmt="%.2f", fontsize=8)
    ax_bar.set_xticks(range(len(names)))
    ax_bar.set_xticklabels(names, rotation=30, ha="right")
    ax_bar.set(ylabel=metric, title=f"final {metric} (validation)")
    for r in results:
        if r.get("curve"):
            xs, ys = zip(*r["curve"])
            ax_curve.plot(xs, ys, "o-", label=r["name"], markersize=3)
    ax_curve.set(xlabel="step", ylabel="validation loss", title="validation loss")
    if ax_curve.lines:
        ax_curve.legend(fontsize=8)
    for ax in (ax_bar, ax_curve):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _label(s: str) -> str:
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s).strip() or "␣"
    return s if len(s) <= 14 else s[:13] + "…"


def _save(fig, path) -> Path:
    """The figure rendered, then written atomically: a failure (a full disk) leaves an earlier plot whole."""
    path, buf = Path(path), io.BytesIO()
    try:
        fig.savefig(buf, format=path.suffix.lstrip(".") or "png", dpi=110)
    finally:
        plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue())
