"""Evaluate a checkpoint on a split: decoding metrics, perplexity, predictions on disk.

    python -m scratchformer.evaluate --checkpoint runs/multi30k --split validation --beam-size 4
    python -m scratchformer.evaluate --checkpoint runs/seed0 runs/seed1 runs/seed2 --beam-size 4 --out runs/ens
    python -m scratchformer.evaluate --baseline lead3 --data ../shared/data/samsum --split validation
    python -m scratchformer.evaluate --checkpoint runs/multi30k --beam-size 8 --mbr 8 --out runs/multi30k/mbr8

Translation: BLEU, chrF (sacrebleu on detokenized text), exact match; summarization adds
ROUGE-1/2/L/Lsum (rouge-score, stemming on), also of an extractive model's picked sentences;
classification: accuracy; every task: loss and perplexity under teacher forcing. A sequence is decoded
greedily, by beam search, drawn (--sample, each example keyed by its prediction's id, as generate keys
an input of that id) or chosen among candidates by minimum Bayes risk (--mbr N). The scores are
printed first (stdout), then ``predictions.<split>.jsonl`` and ``metrics.<split>.json`` are written
into ``--out`` (default: the folder of the checkpoint, i.e. its run folder, never the current
directory; the Lead-3 baseline writes only with ``--out``), never over those files already there
unless ``--overwrite`` (refused before any work). A folder that cannot be written ends the command
with an error after the scores. The work is `scratchformer.evaluation.evaluate.evaluate`;
this is its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import cli
from . import data as D
from .checkpoint import file_in_the_way
from .data.extractive import selection_name
from .device import describe, resolve_device
from .evaluation import metrics as M
from .evaluation import options as O
from .evaluation.attention import attention_map
from .evaluation.evaluate import evaluate, format_metrics, write_outputs
from .evaluation.loading import class_names, load_models
from .evaluation.options import (
    DECODE_FLAGS,
    add_decode_options,
    check_decode_flags,
    check_min_len,
    check_options,
    check_task_options,
)
from .locks import Held, hold, holder, make_folders, release, remove_made
from .model import row_key
from .training.build import run_split
from .training.config import KERNELS, TrainConfig
from .training.runs import LOCK as RUN_LOCK

SEQUENCE_FLAGS = (*DECODE_FLAGS, *O.MBR_FLAGS, *O.SAMPLING_FLAGS)  # what decoding a sequence reads


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scratchformer.evaluate",
        description="Score a checkpoint on a data split (BLEU, chrF, ROUGE, accuracy, perplexity), "
        "or score the Lead-3 summarization baseline.",
    )
    p.add_argument("--checkpoint", nargs="+", metavar="CKPT",
                   help="checkpoint file, or a run folder (uses its best.pt); several: an ensemble, its "
                   "predictions the mean of their probabilities (one task and tokenizer; needs --out)")
    p.add_argument("--split", default="validation", help="split to score (default: validation)")
    p.add_argument("--dataset", help="dataset name (default: the one the checkpoint was trained on)")
    p.add_argument("--data", help="local data folder (default: the checkpoint's)")
    p.add_argument("--task", choices=D.TASKS, help="task (default: the checkpoint's, or inferred)")
    p.add_argument("--limit", type=int, help="score only the first N examples")
    add_decode_options(p, beam_size=1)
    O.add_mbr_options(p)
    O.add_sampling_options(p)
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per evaluation batch (default: 4096)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--kernel", choices=KERNELS, help="override the backend")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile the model (backend: inductor when given alone; aot_eager traces without "
                   "code generation)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="autocast dtype (default: fp32)")
    p.add_argument("--baseline", choices=("lead3",), help="score a baseline instead of a checkpoint")
    p.add_argument("--out", help="folder for predictions.<split>.jsonl and metrics.<split>.json (default: the "
                   "folder of the checkpoint, i.e. its run folder; with --baseline lead3: none, scores only; "
                   "with --out, predictions.<split>.lead3.jsonl and metrics.<split>.lead3.json)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace predictions.<split>.jsonl and metrics.<split>.json already in the output folder")
    p.add_argument("--attention", type=int, metavar="INDEX", help="also draw the attention heatmap of example INDEX")
    cli.add_debug_flag(p)
    return p


def check_args(args) -> None:
    """Refuse flags no evaluation can take, before any work (UsageError / OptionError naming the flag);
    resolves --device."""
    parser = build_parser()  # the defaults given flags are told from
    if args.baseline is None and not args.checkpoint:
        raise cli.UsageError("--checkpoint is required (or --baseline lead3)")
    if args.baseline is not None:  # a baseline of the data alone: no model, nothing to decode
        unused = (["--checkpoint"] * bool(args.checkpoint) + ["--attention"] * (args.attention is not None)
                  + ["--overwrite"] * (args.overwrite and not args.out)
                  + cli.given_flags(args, parser, (*SEQUENCE_FLAGS, "--kernel", "--compile", "--precision")))
        if unused:
            raise cli.UsageError(f"--baseline {args.baseline} scores the data's own sentences, with no model: "
                                 f"drop {', '.join(unused)}")
    D.check_split(args.split, "--split")  # it names the files written, before the data layer reads it
    if args.out and (above := file_in_the_way(args.out)) is not None:  # found after the decoding, as "File exists"
        raise cli.UsageError(f"--out {args.out}: {above} is a file, not a folder")
    if args.data and args.dataset:
        raise cli.UsageError(f"--data {args.data} and --dataset {args.dataset} both name the data: give one")
    if args.checkpoint and len(args.checkpoint) > 1 and args.baseline is None:
        if not args.out:  # the default, a run folder, holds that model's own predictions and metrics
            raise cli.UsageError("an ensemble (several --checkpoint) needs --out DIR for its predictions and metrics")
        if args.attention is not None:
            raise cli.UsageError("--attention draws one model's attention; an ensemble has none of its own")
    for flag, value, low in (("--limit", args.limit, 1), ("--attention", args.attention, 0)):
        if value is not None and value < low:
            raise cli.UsageError(f"{flag} must be >= {low}, got {value}")
    O.check_search_flags(args, cli.given_flags(args, parser, ("--beam-size", *O.SAMPLING_FLAGS, *O.MBR_FLAGS)))
    check_options(beam_size=args.beam_size, length_penalty=args.length_penalty, max_tokens=args.max_tokens,
                  no_repeat_ngram=args.no_repeat_ngram, min_len=args.min_len, summary_sentences=args.summary_sentences,
                  summary_words=args.summary_words, sampling=O.sampling_of(args), mbr=args.mbr)
    args.device = resolve_device(args.device)  # a torch.device from here on


def _source_from(args, ckpt_data: dict | None) -> D.DataSource:
    if args.data or args.dataset:  # an extractive model reads summarization data as its own task
        extractive = ckpt_data is not None and ckpt_data.get("task") == "extractive"
        task = args.task or ("extractive" if extractive else None)
        return D.resolve_source(args.dataset or "synthetic", args.data, task)
    if ckpt_data is None:
        raise cli.UsageError("give --data or --dataset (no checkpoint to take the data source from)")
    if args.task and args.task != ckpt_data["task"]:  # it reads --data / --dataset files; none were given
        raise cli.UsageError(f"--task {args.task} reads --data / --dataset as that task; without them the "
                             f"checkpoint's own data is read, as {ckpt_data['task']}")
    source = D.DataSource(**ckpt_data)
    if source.kind == "local" and not Path(source.folder).is_dir():  # saved as the training's cwd saw it
        if D.local_folder(source.name) is not None:  # a named dataset (--dataset multi30k): found from here too
            return D.resolve_source(source.name, task=source.task)
        raise cli.UsageError(f"the checkpoint's data folder {source.folder} (as its training saw it, from where it "
                             f"ran) is not here: give --data DIR or --dataset NAME")
    return source


def _other_data(source: D.DataSource, ckpt_data: dict | None) -> bool:
    """Whether --data / --dataset name other data than the checkpoint's run trained on (a local
    folder known by its name, wherever it is)."""
    def key(d: dict):
        return d["kind"], Path(d["folder"]).name if d.get("folder") else d["name"]
    return ckpt_data is not None and key(source.to_dict()) != key(ckpt_data)


def check_outputs(out: Path, stem: str, overwrite: bool, attention: int | None = None) -> None:
    """Refuse, before any work, to replace the files `save_outputs` (and the attention map) would write
    that are already in `out` (another checkpoint's or evaluation's, or the training's final
    predictions) without --overwrite: FileExistsError naming them."""
    names = [f"predictions.{stem}.jsonl", f"metrics.{stem}.json"]
    names += [f"attention.{stem}.{attention}.png"] if attention is not None else []
    there = [str(out / name) for name in names if (out / name).exists()]
    if there and not overwrite:
        one = len(there) == 1
        raise FileExistsError(f"{' and '.join(there)} exist{'s' if one else ''}; pass --overwrite to replace "
                              f"{'it' if one else 'them'}, or --out DIR to write elsewhere")


@contextlib.contextmanager
def writing_outputs(out: Path, stem: str, overwrite: bool, attention: int | None = None):
    """`check_outputs` under a hold of out/.evaluate.<stem>.lock (`locks.hold`), kept until the files
    are written: a second evaluate of the same files is refused naming the first's pid (two at once both ran, and
    one's predictions could end beside the other's metrics), and so is one of the validation split into the
    folder of a run that trains (its final report replaced the predictions, and left these metrics). A
    folder that cannot be written takes no lock: its scores still come first, and the write fails after
    them. The folders made for the lock are removed again if the command ends before writing into them."""
    lock = out / f".evaluate.{stem}.lock"
    made = []
    try:
        made = make_folders(out)
        fd = hold(lock)
    except Held as e:
        raise cli.UsageError(f"{out / f'predictions.{stem}.jsonl'} and metrics.{stem}.json are being written by "
                             f"another evaluate (pid {e.pid}); wait for it to end, or give --out DIR") from None
    except OSError:  # read-only
        fd = None
    try:
        if stem == "validation" and (pid := holder(out / RUN_LOCK)) is not None:
            raise cli.UsageError(f"{out} is the folder of a run that trains now (pid {pid}): its final report writes "
                                 f"predictions.validation.jsonl there, over this evaluate's, beside its metrics; wait "
                                 f"for it to end, or give --out DIR")
        check_outputs(out, stem, overwrite, attention)
        yield
    finally:
        if fd is not None:
            release(lock, fd)
        remove_made(made)  # an error before any file was written: nothing of ours is left


def check_class_names(source: D.DataSource, ckpt: dict) -> None:
    """DataError naming both for data whose meta.json names the classes otherwise than the checkpoint's
    did (its class ids would be scored under other names); data or a checkpoint without names: nothing
    to compare."""
    names = class_names(ckpt)
    if source.labels and names and source.labels != names:
        where = Path(source.folder) / "meta.json" if source.folder else f"{source.kind} dataset {source.name}"
        raise D.DataError(f"{where} names the classes {source.labels}, {ckpt['path']} was trained with {names}: "
                          "its predictions would be scored against other classes")


def check_labels(examples, source: D.DataSource, split: str, ckpt: dict) -> None:
    """A classifier's data: DataError naming the example and the model's classes for a label the
    model has no class for (its loss would fail inside torch)."""
    classes = ckpt["config"].get("num_classes") or 0
    names = class_names(ckpt) or {}
    for i, e in enumerate(examples):
        if isinstance(e.tgt, bool) or not 0 <= e.tgt < classes:
            where = D.find_split_file(Path(source.folder), split) if source.folder else f"{source.name}/{split}"
            known = ", ".join(f"{c} ({names[c]})" if c in names else str(c) for c in range(classes))
            shown = f" (id {e.id})" if e.id is not None else ""
            raise D.DataError(f"{where}, example {i + 1}{shown}: label {e.tgt!r} is not one of the {classes} classes "
                              f"of {ckpt['path']}: {known}")


def save_outputs(out: Path, stem: str, split: str, examples, outputs, result: dict) -> None:
    """`write_outputs` after the scores were printed: a folder that cannot be written (read-only, a
    full disk) is an OSError naming the file and saying that the scores are above."""
    try:
        write_outputs(out, stem, split, examples, outputs, result)
    except OSError as e:
        what = f"{e.filename}: {e.strerror}" if e.filename else (e.strerror or str(e))
        raise OSError(e.errno, f"{what}; the scores are printed above; pass --out DIR to save them elsewhere") from e
    print(f"wrote {out / f'predictions.{stem}.jsonl'} and {out / f'metrics.{stem}.json'}")


def run_lead3(args) -> dict:
    source = _source_from(args, None)
    if source.task not in ("summarization", "extractive"):
        raise cli.UsageError(f"lead3 is a summarization baseline; this data is {source.task}")
    k, words = args.summary_sentences or 3, args.summary_words  # Lead-3, or Lead-K cut at W words
    name = "lead3" if (k, words) == (3, None) else f"lead-{selection_name(k, words)}"
    stem = f"{args.split}.{name}"
    with writing_outputs(Path(args.out), stem, args.overwrite) if args.out else contextlib.nullcontext():
        examples = D.load_split(source, args.split, args.limit)
        hyps = [M.lead3(e.src, k, words) for e in examples]
        scores = M.rouge(hyps, [e.tgt for e in examples])
        result = {"baseline": "lead3", "data": source.to_dict(), "split": args.split, "n": len(examples),
                  "sentences": k, "words": words, **scores, "scorers": M.scorers(scores)}
        print(f"{name} on {source.name}/{args.split} ({len(examples)} examples): {format_metrics(result)}", flush=True)
        if args.out:
            save_outputs(Path(args.out), stem, args.split, examples, hyps, result)
    return result


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.baseline == "lead3":
        return run_lead3(args)
    device = args.device
    model, toks, ckpt = load_models(args.checkpoint, device, args.kernel, args.compile)
    check_decode_flags(ckpt["task"], cli.given_flags(args, build_parser(), SEQUENCE_FLAGS))
    check_task_options(ckpt["task"], args.summary_sentences, args.summary_words)
    out = Path(args.out) if args.out else Path(ckpt["path"]).parent
    if not args.out and Path(ckpt["path"]).name != "best.pt" and (out / "best.pt").exists():
        raise cli.UsageError(f"{ckpt['path']}: its predictions and scores would replace those of {out / 'best.pt'} "
                             f"in {out} (its final report's): give --out DIR")
    run = TrainConfig.from_dict(ckpt["args"])
    check_min_len(args.min_len, run.max_tgt_len)  # before the teacher-forced pass, not after it
    source = _source_from(args, ckpt.get("data"))
    if source.task != ckpt["task"]:
        raise cli.UsageError(f"{ckpt['path']} was trained for {ckpt['task']}; the data is read as {source.task} "
                             f"(pass --task {ckpt['task']} if its files fit)")
    check_class_names(source, ckpt)
    if not args.out and _other_data(source, ckpt.get("data")):
        raise cli.UsageError(f"{ckpt['path']}: its predictions and scores on {source.name} would replace those on "
                             f"its own data in {out} (predictions.{args.split}.jsonl, metrics.{args.split}.json): "
                             f"give --out DIR")
    with writing_outputs(out, args.split, args.overwrite, args.attention):
        return _evaluate(args, model, toks, ckpt, run, source, out)


def _evaluate(args, model, toks, ckpt: dict, run: TrainConfig, source: D.DataSource, out: Path) -> dict:
    """The evaluation `main` set up, its files written into `out` (held: `writing_outputs`)."""
    device = args.device
    members = tuple(TrainConfig.from_dict(a) for a in ckpt.get("member_args", ()))
    examples = run_split(source, args.split, run, args.limit, members)
    if source.task == "classification":
        check_labels(examples, source, args.split, ckpt)
    dataset, stats = D.encode_examples(examples, source.task, toks.src, toks.tgt, run.max_src_len, run.max_tgt_len)
    print(f"{source.name}/{args.split}: {stats}", file=sys.stderr)
    if args.attention is not None and args.attention >= len(dataset):  # before the work, not after it
        raise cli.UsageError(f"--attention {args.attention}: {source.name}/{args.split} has {len(dataset)} examples "
                             f"here (--attention 0 to {len(dataset) - 1})")
    t0 = time.time()
    sampling, mbr = O.sampling_of(args), args.mbr or 0
    search = dict(length_penalty=args.length_penalty, no_repeat_ngram=args.no_repeat_ngram, min_len=args.min_len,
                  sampling=sampling, mbr=mbr, mbr_utility=args.mbr_utility)
    keys = [row_key(i) for i in D.prediction_ids(examples, args.split)]  # generate's, for an input of that id
    ev = evaluate(model, dataset, examples, toks, device=device, max_tgt_len=run.max_tgt_len,
                  beam_sizes=(args.beam_size,), max_tokens=args.max_tokens, precision=args.precision,
                  progress=sys.stderr.isatty(), summary_sentences=args.summary_sentences,
                  summary_words=args.summary_words, keys=keys, **search)
    single = "ensemble" not in ckpt and "averaged_from" not in ckpt  # one step's weights
    result = {"checkpoint": ckpt.get("ensemble", ckpt["path"]), "data": source.to_dict(), "split": args.split,
              "n": len(examples), "precision": args.precision,
              "kernel": "+".join(sorted({m.ops.name for m in getattr(model, "members", [model])})),  # resolved
              "step": ckpt.get("progress", {}).get("step") if single else None,
              **({"averaged_from": ckpt["averaged_from"]} if "averaged_from" in ckpt else {}), **ev.metrics}
    if source.task != "classification":  # one decoding, or an extractive model's one selection
        (name, scores), = ev.decodings.items()
        result.update(scores, decoding=name)
        if source.task != "extractive":
            result.update(length_penalty=args.length_penalty, no_repeat_ngram=args.no_repeat_ngram,
                          min_len=args.min_len, **({"sampling": asdict(sampling)} if sampling else {}),
                          **({"mbr": mbr, "mbr_utility": args.mbr_utility or "chrf"} if mbr else {}))
        result["scorers"] = M.scorers(result)
    result["seconds"] = round(time.time() - t0, 2)
    result["environment"] = describe(device)  # what the seconds (and the scores' numerics) are of
    # The scores first: a folder we cannot write to must not cost them.
    print(f"{source.name}/{args.split} ({len(examples)} examples, {result.get('decoding', 'classify')}): "
          f"{format_metrics(result)}", flush=True)
    save_outputs(out, args.split, args.split, examples, ev.outputs, result)
    if args.attention is not None:
        from .evaluation.plots import plot_attention  # matplotlib: only when plotting

        w, rows, cols, title = attention_map(model, dataset, args.attention, toks, device=device,
                                             max_tgt_len=run.max_tgt_len, precision=args.precision,
                                             beam_size=args.beam_size, key=keys[args.attention], **search)
        plot_attention(w, rows, cols, out / f"attention.{args.split}.{args.attention}.png", title=title)
    return result


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
