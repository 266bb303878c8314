"""The end of a run: best.pt scored on the validation split, predictions, metrics.final.json, plots."""

from __future__ import annotations

import json
import time

from ..checkpoint import load_checkpoint, write_lines_atomic
from ..evaluation import metrics as M
from ..evaluation.attention import attention_map
from ..evaluation.evaluate import evaluate, format_metrics, write_predictions


def final_report(trainer) -> dict:
    """A finished Trainer's last words (rank 0): best.pt evaluated on the validation split (greedy,
    and beam --beam-size); predictions.validation.jsonl (greedy; a classifier's label and confidence per
    example), metrics.final.json and the plots
    written; the summary logged. Returns the metrics: teacher-forced loss/ppl (+ accuracy) and one
    dict per decoding."""
    t0, cfg, data, out, prog = time.time(), trainer.config, trainer.data, trainer.out, trainer.progress
    model = trainer.model
    best = out / "best.pt"
    # best.pt, or without one (no validation saved it) the weights a checkpoint holds (--ema: the average)
    model.load_state_dict(load_checkpoint(best)["model"] if best.exists() else trainer.ema.checkpoint()["model"])
    model.eval()
    classify = data.task == "classification"
    ev = evaluate(model, data.valid_set, data.valid_examples, data.tokenizers, device=trainer.device,
                  max_tgt_len=cfg.max_tgt_len, beam_sizes=sorted({1, cfg.beam_size}),
                  limit=None if classify else (cfg.eval_decode_examples or None),
                  max_tokens=trainer.eval_max_tokens, precision=cfg.precision,
                  summary_sentences=cfg.summary_sentences, summary_words=cfg.summary_words)
    n_valid = len(data.valid_set)
    res = {"train_seconds": round(trainer.train_seconds, 1), "steps": prog.step, "best_step": prog.best_step,
           "n": n_valid, "n_decoded": ev.n, **ev.metrics, **ev.decodings}  # the loss's examples, the decodings'
    if ev.decodings:  # what the decodings' text metrics were computed with (sacrebleu's signatures, ...)
        res["scorers"] = M.scorers(next(iter(ev.decodings.values())))

    write_predictions(out / "predictions.validation.jsonl", data.valid_examples[: ev.n], ev.outputs, "validation")
    if classify:
        lines = [f"validation ({n_valid} examples): {format_metrics(res)}"]
    else:
        shown = reversed(list(zip(data.valid_examples, ev.outputs))[:3])
        lines = [f"  example: {e.src[:80]!r} -> {h[:80]!r} (ref {str(e.tgt)[:80]!r})" for e, h in shown]
        lines.append(f"validation ({n_valid} examples, teacher forcing): loss {res['loss']:.4f} | ppl {res['ppl']:.2f}")
        lines += [f"{name:>6} ({ev.n} examples): {format_metrics(scores)}" for name, scores in ev.decodings.items()]
    trainer.log.row({"split": "final", "step": prog.step, **res}, replace=True)  # resumed with no step left: once
    write_lines_atomic(out / "metrics.final.json", json.dumps(res, indent=2).splitlines())  # a full disk: old one kept
    if not cfg.no_plots:
        _plots(trainer)
    best_txt = f"best.pt = step {prog.best_step}, {cfg.best_metric} {prog.best:.4f}" if prog.best is not None else ""
    ended = " (early stop)" if prog.stopped_early else " (time budget)" if prog.out_of_time else ""
    trainer.log.info(f"done: {prog.step} steps in {trainer.train_seconds:.0f}s{ended}; {best_txt}; run folder {out}")
    for line in lines:
        trainer.log.info(line)
    trainer.log.info(f"final report in {time.time() - t0:.1f}s")  # a GPU window's calls are planned from it
    return res


def _plots(trainer) -> None:
    """plots/curves.png (loss, perplexity, lr) and plots/attention.png (one validation example)."""
    from ..evaluation.plots import plot_attention, plot_curves, read_metrics  # matplotlib: only when plotting

    out, data = trainer.out, trainer.data
    unit = {"classification": "example", "extractive": "sentence"}.get(data.task, "token")
    plot_curves(read_metrics(out / "metrics.jsonl"), out / "plots" / "curves.png", title=str(out), unit=unit)
    idx = trainer.config.attention_example  # within the split (`launch`)
    w, rows, cols, title = attention_map(trainer.model, data.valid_set, idx, data.tokenizers, device=trainer.device,
                                         max_tgt_len=trainer.config.max_tgt_len, precision=trainer.config.precision)
    plot_attention(w, rows, cols, out / "plots" / "attention.png", title=f"{title}, validation example {idx}")
