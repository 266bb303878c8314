"""Evaluate a checkpoint on a split: decoding metrics, perplexity, predictions on disk.

    python -m scratchformer.evaluate --checkpoint runs/multi30k --split validation --beam-size 4
    python -m scratchformer.evaluate --baseline lead3 --data ../shared/data/samsum --split validation

Translation: BLEU, chrF (sacrebleu on detokenized text), exact match; summarization adds
ROUGE-1/2/L/Lsum (rouge-score, stemming on); classification: accuracy; every task: loss and
perplexity under teacher forcing. Writes ``predictions.<split>.jsonl`` and ``metrics.<split>.json``
into ``--out`` (default: the checkpoint's run folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from . import data as D
from . import metrics as M
from .checkpoint import find_checkpoint, load_checkpoint
from .config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from .decoding import beam_search, greedy_decode
from .model import build_model
from .data.tokenizer import TokenizerPair


def autocast_for(device: torch.device, precision: str):
    """The autocast context of a precision name ("fp32", "bf16", "fp16")."""
    if precision == "fp32":
        return nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def load_run(checkpoint: str | Path, device: str | torch.device = "cpu", kernel: str | None = None):
    """A checkpoint file or run folder -> (model in eval mode, tokenizers, checkpoint dict)."""
    path = find_checkpoint(checkpoint)
    ckpt = load_checkpoint(path)
    cfg_dict = dict(ckpt["config"])
    if kernel is not None:
        cfg_dict["kernel"] = kernel
    model = build_model(ModelConfig.from_dict(cfg_dict))
    model.load_state_dict(ckpt["model"])
    model.to(device).eval()
    ckpt["path"] = str(path)
    return model, TokenizerPair.from_dict(ckpt["tokenizers"]), ckpt


def eval_loader(dataset: D.EncodedDataset, max_tokens: int | None = 4096, batch_size: int | None = None,
                num_workers: int = 0, pin_memory: bool = False):
    """Length-sorted, unshuffled batches (outputs are put back in dataset order by example id)."""
    sampler = D.BucketBatchSampler(dataset.lengths(), max_tokens=max_tokens, batch_size=batch_size,
                                   shuffle=False, pool_batches=10**9)
    return D.make_loader(dataset, sampler, num_workers=num_workers, pin_memory=pin_memory)


def loss_terms(model, batch: D.Batch):
    """Logits and targets of a batch: seq2seq (B*Lt, V) vs (B*Lt,), classifier (B, C) vs (B,)."""
    if batch.labels is not None:
        return model(batch.src, batch.src_lengths), batch.labels
    logits = model(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_lengths)
    return logits.flatten(0, 1), batch.tgt_out.flatten()


@torch.no_grad()
def teacher_forced(model, loader, device, precision: str = "fp32") -> dict:
    """Mean token NLL (no label smoothing) and perplexity; accuracy for classification."""
    model.eval()
    nll, n, correct = 0.0, 0, 0
    classify = loader.dataset.task == "classification"
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        with autocast_for(device, precision):
            logits, target = loss_terms(model, batch)
        if classify:  # labels include 0 == PAD_ID: nothing to ignore
            nll += float(F.cross_entropy(logits.float(), target, reduction="sum"))
            n += len(batch)
            correct += int((logits.argmax(-1) == target).sum())
        else:
            nll += float(F.cross_entropy(logits.float(), target, ignore_index=PAD_ID, reduction="sum"))
            n += int((target != PAD_ID).sum())
    out = {"loss": nll / max(1, n), "ppl": M.perplexity(nll, max(1, n))}
    if classify:
        out["accuracy"] = 100.0 * correct / max(1, n)
    return out


def decode_max_len(task: str, src_lengths: torch.Tensor, max_tgt_len: int) -> int:
    """Translation: up to 2*Ls + 10 tokens (never more than max_tgt_len); summaries: max_tgt_len."""
    if task == "translation":
        return max(1, min(max_tgt_len, 2 * int(src_lengths.max()) + 10))
    return max_tgt_len


@torch.no_grad()
def predict_seq2seq(model, dataset: D.EncodedDataset, tokenizer, *, device, max_tgt_len: int, beam_size: int = 1,
                    length_penalty: float = 1.0, max_tokens: int = 4096, precision: str = "fp32",
                    progress: bool = False) -> list[str]:
    """Decoded, detokenized outputs in dataset order. beam_size 1 = greedy."""
    model.eval()
    out: list[str | None] = [None] * len(dataset)
    loader = eval_loader(dataset, max_tokens=max_tokens)
    if progress:
        from tqdm import tqdm

        loader = tqdm(loader, desc="decode", leave=False, dynamic_ncols=True)
    for batch in loader:
        batch = batch.to(device)
        max_len = decode_max_len(dataset.task, batch.src_lengths, max_tgt_len)
        with autocast_for(device, precision):
            if beam_size > 1:
                toks = beam_search(model, batch.src, batch.src_lengths, beam_size=beam_size, max_len=max_len,
                                   length_penalty=length_penalty)
            else:
                toks = greedy_decode(model, batch.src, batch.src_lengths, max_len=max_len)
        for i, row in zip(batch.ids.tolist(), toks.tolist()):
            out[i] = tokenizer.decode(row)
    return out


@torch.no_grad()
def predict_labels(model, dataset: D.EncodedDataset, *, device, max_tokens: int = 8192, precision: str = "fp32"):
    """(predicted labels, their probabilities) in dataset order."""
    model.eval()
    preds, probs = [0] * len(dataset), [0.0] * len(dataset)
    for batch in eval_loader(dataset, max_tokens=max_tokens):
        batch = batch.to(device)
        with autocast_for(device, precision):
            p = torch.softmax(model(batch.src, batch.src_lengths).float(), dim=-1)
        conf, lab = p.max(-1)
        for i, y, c in zip(batch.ids.tolist(), lab.tolist(), conf.tolist()):
            preds[i], probs[i] = y, c
    return preds, probs


@torch.no_grad()
def attention_map(model, dataset: D.EncodedDataset, index: int, tokenizers: TokenizerPair, *, device,
                  max_tgt_len: int = 64, max_tokens_shown: int = 60):
    """Attention of one example for a heatmap: (weights (rows, cols) numpy, row labels, col labels, title).

    Seq2seq: the last decoder layer's cross-attention, averaged over heads, with the model's own
    greedy output as the decoder input (rows: output tokens, columns: source tokens).
    Classifier: the last encoder layer's self-attention averaged over heads ([CLS] first).
    """
    model.eval()
    _, src, tgt = dataset[index]
    src = torch.as_tensor(src[:max_tokens_shown], dtype=torch.int64, device=device)[None]
    src_len = torch.tensor([src.shape[1]], device=device)
    src_labels = tokenizers.src.token_strings(src[0].tolist())
    if dataset.task == "classification":
        _, weights = model(src, src_len, return_attention=True)
        w = weights[-1][0].mean(0).float().cpu().numpy()  # (L+1, L+1)
        labels = ["[CLS]"] + src_labels
        return w, labels, labels, "classifier self-attention, last layer (mean over heads)"
    hyp = greedy_decode(model, src, src_len, max_len=min(max_tgt_len, 2 * src.shape[1] + 10))[0].tolist()
    if EOS_ID in hyp:
        hyp = hyp[: hyp.index(EOS_ID) + 1]
    tgt_in = torch.tensor([[BOS_ID] + hyp[:-1]], device=device)
    _, weights = model(src, src_len, tgt_in, torch.tensor([tgt_in.shape[1]], device=device), need_weights=True)
    w = weights[-1][0].mean(0).float().cpu().numpy()  # (Lt, Ls)
    return w, tokenizers.tgt.token_strings(hyp), src_labels, "decoder cross-attention, last layer (mean over heads)"


def format_metrics(m: dict) -> str:
    order = ["loss", "ppl", "accuracy", "exact_match", "bleu", "chrf", "rouge1", "rouge2", "rougeL", "rougeLsum"]
    parts = []
    for k in order:
        if k in m and isinstance(m[k], (int, float)):
            v = m[k]
            unit = "%" if k in ("accuracy", "exact_match") else ""
            parts.append(f"{k} {v:.4f}" if k == "loss" else f"{k} {v:.2f}{unit}")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scratchformer.evaluate",
        description="Score a checkpoint on a data split (BLEU, chrF, ROUGE, accuracy, perplexity), "
        "or score the Lead-3 summarization baseline.",
    )
    p.add_argument("--checkpoint", help="checkpoint file, or a run folder (uses its best.pt)")
    p.add_argument("--split", default="validation", help="split to score (default: validation)")
    p.add_argument("--dataset", help="dataset name (default: the one the checkpoint was trained on)")
    p.add_argument("--data", help="local data folder (default: the checkpoint's)")
    p.add_argument("--task", choices=D.TASKS, help="task (default: the checkpoint's, or inferred)")
    p.add_argument("--limit", type=int, help="score only the first N examples")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy decoding (default), >1 = beam search")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search length penalty exponent")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per evaluation batch")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--kernel", choices=("auto", "eager", "torch", "triton"), help="override the backend")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--baseline", choices=("lead3",), help="score a baseline instead of a checkpoint")
    p.add_argument("--out", help="folder for predictions.<split>.jsonl and metrics.<split>.json")
    p.add_argument("--attention", type=int, metavar="INDEX", help="also draw the attention heatmap of example INDEX")
    return p


def _source_from(args, ckpt_data: dict | None) -> D.DataSource:
    if args.data or args.dataset:
        return D.resolve_source(args.dataset or "synthetic", args.data, args.task)
    if ckpt_data is None:
        raise SystemExit("give --data or --dataset (no checkpoint to take the data source from)")
    return D.DataSource(**ckpt_data)


def run_lead3(args) -> dict:
    source = _source_from(args, None)
    if source.task != "summarization":
        raise SystemExit(f"lead3 is a summarization baseline; this data is {source.task}")
    examples = D.load_split(source, args.split, args.limit)
    hyps = [M.lead3(e.src) for e in examples]
    refs = [e.tgt for e in examples]
    result = {"baseline": "lead3", "split": args.split, "n": len(examples), **M.rouge(hyps, refs)}
    out = Path(args.out or ".")
    _write_outputs(out, f"{args.split}.lead3", examples, hyps, result)
    print(f"lead3 on {source.name}/{args.split} ({len(examples)} examples): {format_metrics(result)}")
    return result


def _write_outputs(out: Path, stem: str, examples, preds, result: dict) -> None:
    """predictions.<stem>.jsonl (one row per example) and metrics.<stem>.json."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"predictions.{stem}.jsonl", "w", encoding="utf-8") as f:
        for e, p in zip(examples, preds):
            row = {"id": e.id, "source": e.src, "reference": e.tgt}
            row.update(p if isinstance(p, dict) else {"prediction": p})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / f"metrics.{stem}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.baseline == "lead3":
        return run_lead3(args)
    if not args.checkpoint:
        raise SystemExit("--checkpoint is required (or --baseline lead3)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, toks, ckpt = load_run(args.checkpoint, device, args.kernel)
    train_args = ckpt["args"]
    source = _source_from(args, ckpt.get("data"))
    if source.kind == "synthetic":
        examples = D.load_split(source, args.split, args.limit, synthetic_seed=train_args.get("synthetic_seed", 1234))
    elif args.split == "validation" and not D.has_split(source, "validation") and train_args.get("valid_fraction"):
        # IMDb-style: the validation split was carved from train at training time; carve it the same way.
        train = D.load_split(source, "train", train_args.get("max_train_examples"))
        examples = D.carve_validation(train, train_args["valid_fraction"], train_args["seed"])[1][: args.limit]
    else:
        examples = D.load_split(source, args.split, args.limit)
    max_src, max_tgt = train_args["max_src_len"], train_args["max_tgt_len"]
    dataset, stats = D.encode_examples(examples, source.task, toks.src, toks.tgt, max_src, max_tgt)
    print(f"{source.name}/{args.split}: {stats}", file=sys.stderr)
    t0 = time.time()
    result = {"checkpoint": ckpt["path"], "split": args.split, "n": len(examples), "step": ckpt["progress"]["step"]}
    result.update(teacher_forced(model, eval_loader(dataset, args.max_tokens), device, args.precision))
    if source.task == "classification":
        preds, probs = predict_labels(model, dataset, device=device, max_tokens=args.max_tokens, precision=args.precision)
        result["accuracy"] = M.accuracy(preds, [e.tgt for e in examples])
        outputs = [{"prediction": y, "confidence": c} for y, c in zip(preds, probs)]
    else:
        hyps = predict_seq2seq(model, dataset, toks.tgt, device=device, max_tgt_len=max_tgt, beam_size=args.beam_size,
                               length_penalty=args.length_penalty, max_tokens=args.max_tokens,
                               precision=args.precision, progress=sys.stderr.isatty())
        result.update(M.seq2seq_scores(hyps, [e.tgt for e in examples], source.task))
        result["decoding"] = "greedy" if args.beam_size <= 1 else f"beam{args.beam_size}"
        outputs = hyps
    result["seconds"] = round(time.time() - t0, 2)
    out = Path(args.out) if args.out else Path(ckpt["path"]).parent
    _write_outputs(out, args.split, examples, outputs, result)
    if args.attention is not None:
        from .plots import plot_attention

        w, rows, cols, title = attention_map(model, dataset, args.attention, toks, device=device, max_tgt_len=max_tgt)
        plot_attention(w, rows, cols, out / f"attention.{args.split}.{args.attention}.png", title=title)
    print(f"{source.name}/{args.split} ({len(examples)} examples, {result.get('decoding', 'classify')}): "
          f"{format_metrics(result)}")
    print(f"wrote {out / f'predictions.{args.split}.jsonl'} and {out / f'metrics.{args.split}.json'}")
    return result


if __name__ == "__main__":
    main()
