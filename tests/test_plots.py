"""PNG plots (scratchformer/evaluation/plots.py): what each figure draws, read back from the figure
before it is written (matplotlib's Agg backend, no display): the curves' values, the attention
map's orientation and labels; and the metrics file they are read from."""

import errno
import math
import os

import numpy as np
import pytest

from scratchformer.evaluation import plots


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots save, in order (each still readable after plt.close)."""
    saved = []
    real = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or real(fig, path))
    return saved


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_the_curves_draw_each_splits_loss_perplexity_and_learning_rate(tmp_path, figures):
    """Train rows: the loss, the NLL, perplexity exp(NLL) (capped at e^50: a diverged step's NLL of
    1000 would overflow a float) and the lr; validation rows: their loss and their own ppl, by step;
    the final report's row in neither."""
    rows = [{"split": "train", "step": 1, "loss": 3.0, "nll": 2.0, "lr": 1e-4},
            {"split": "train", "step": 2, "loss": 9.0, "nll": 1000.0, "lr": 2e-4},
            {"split": "valid", "step": 2, "loss": 2.5, "ppl": 11.0},  # ppl is not exp(loss): which one is drawn shows
            {"split": "final", "step": 2, "loss": 2.5, "ppl": 11.0, "bleu": 3.0}]  # the report's row: no curve
    path = plots.plot_curves(rows, tmp_path / "sub" / "curves.png")
    assert path.stat().st_size > 0
    ax_loss, ax_ppl, ax_lr = figures[0].axes
    assert _lines(ax_loss) == {"train (label-smoothed)": ([1, 2], [3.0, 9.0]), "train NLL": ([1, 2], [2.0, 1000.0]),
                               "valid NLL": ([2], [2.5])}
    assert _lines(ax_ppl) == {"train": ([1, 2], [math.exp(2.0), math.exp(50.0)]), "valid": ([2], [11.0])}
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in ax_lr.lines] == [([1, 2], [1e-4, 2e-4])]


def test_a_single_train_row_is_drawn_and_the_loss_is_labelled_per_its_unit(tmp_path, figures):
    """A run shorter than --log-every (default 100) logs one train row: its curves were lines of one
    point, which matplotlib draws as nothing (the legend listed them; the lr panel was empty). A few
    points carry markers. A classifier's loss is per example, an extractive model's per sentence: the
    axis said "nats/token" for every task."""
    rows = [{"split": "train", "step": 1, "loss": 5.6, "nll": 5.5, "lr": 5e-7},
            {"split": "valid", "step": 50, "loss": 5.4, "ppl": 221.4}]
    plots.plot_curves(rows, tmp_path / "curves.png", unit="example")
    ax_loss, ax_ppl, ax_lr = figures[0].axes
    for ax in (ax_loss, ax_ppl, ax_lr):
        assert all(line.get_marker() == "o" for line in ax.lines), [line.get_marker() for line in ax.lines]
    assert len(ax_lr.lines) == 1 and ax_loss.get_ylabel() == "loss (nats/example)"
    plots.plot_curves([{**rows[0], "step": s} for s in range(1, 101)], tmp_path / "long.png")
    assert figures[1].axes[0].lines[0].get_marker() in ("None", "", None)  # a long curve: a line alone
    assert figures[1].axes[0].get_ylabel() == "loss (nats/token)"


def test_the_attention_map_has_a_row_per_query_and_a_column_per_key(tmp_path, figures):
    """weights (queries, keys): queries down the side, keys along the bottom, each labelled with its
    token; a label over 14 characters cut to 13 and an ellipsis, an unprintable character escaped,
    a blank token shown as ␣."""
    weights = np.array([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])  # as `attention_map` gives it
    rows, cols = ["q1", "\t", " "], ["k1", "k" * 20, "a\nb"]
    plots.plot_attention(weights, rows, cols, tmp_path / "attention.png")
    ax = figures[0].axes[0]
    assert np.array_equal(ax.images[0].get_array(), weights)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["k1", "k" * 13 + "…", "a\\nb"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["q1", "\\t", "␣"]


def test_metrics_of_a_run_without_a_file_are_none_and_blank_lines_are_skipped(tmp_path):
    assert plots.read_metrics(tmp_path / "metrics.jsonl") == []  # a run that never logged: no curves, no error
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    assert plots.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}]


def test_a_plot_that_cannot_be_written_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """A PNG is rendered first, then written atomically: a full disk part-way through leaves the
    earlier plot as it was, and no partial file (it was saved onto its own name: a 6-byte PNG
    replaced a good one, and a later evaluation without --overwrite refused it as an output)."""
    rows = [{"split": "train", "step": 1, "loss": 3.0, "nll": 2.0, "lr": 1e-4}]
    path = plots.plot_curves(rows, tmp_path / "curves.png")
    good = path.read_bytes()
    assert good.startswith(b"\x89PNG")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*curves\.png: No space left on device; the disk is full"):
        plots.plot_curves(rows * 2, path)
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]
