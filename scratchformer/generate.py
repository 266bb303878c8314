"""Run a trained checkpoint on new text: a translation, a summary, or a label with its confidence.

    python -m scratchformer.generate --checkpoint runs/latest --text "three one four"
    python -m scratchformer.generate --checkpoint runs/m30k --input sentences.txt --beam-size 4
    echo "A great film." | python -m scratchformer.generate --checkpoint runs/imdb
    python -m scratchformer.generate --checkpoint runs/m30k --input test_inputs.jsonl.gz --output preds.jsonl
    python -m scratchformer.generate --checkpoint runs/seed0 runs/seed1 --input test_inputs.jsonl.gz --output p.jsonl
    python -m scratchformer.generate --checkpoint runs/m30k --text "A dog runs." --sample --top-p 0.9 --json --nbest 5

One input per line of text, or ``.jsonl`` (``.gz``, ``.xz``) records (a file or stdin), or one --text.
Several checkpoints predict as an ensemble (`model.Ensemble`: the mean of their probabilities at
every step). --sample draws outputs instead of searching (`model.sample_decode`), each input's draws
keyed by the seed and its id. Output: one line per input, line N of a file answering its line N (a
blank line, not predicted, gets an empty one; --json: one record per input, blank lines skipped);
classification prints ``label<TAB>confidence`` (label names from the data's meta.json when known).

With --output: batch inference (`evaluation.predict.predict_file`): ``.jsonl`` (``.gz``, ``.xz``) records
(ids kept) or plain text, written as ``{"id", "prediction"}`` lines, atomically; --resume continues.
--nbest N adds each line's "score" and its "nbest" list, [{"prediction", "score"}], the prediction first.

A user error (a bad flag, input file or checkpoint, an existing --output) is one line on stderr and
exit status 2; --debug (or SCRATCHFORMER_DEBUG=1) shows the traceback (`scratchformer.cli`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from . import cli
from . import data as D
from .data.files import display_name
from .device import resolve_device
from .evaluation import options as O
from .evaluation import predict as P
from .evaluation.evaluate import predict_extracts, predict_labels, predict_seq2seq
from .evaluation.loading import load_models
from .model import Sampling, row_key

# The flags of batch inference alone (the parser's group "batch inference"): refused without --output.
BATCH_FLAGS = ("--len-ratio", "--max-tokens", "--batch-size", "--max-src-len", "--precision", "--resume", "--overwrite",
               "--save-every", "--threads", "--no-progress")
# The flags that only decoding a sequence reads: refused for a model that decodes none (`O.check_decode_flags`).
SEQUENCE_FLAGS = (*O.DECODE_FLAGS, "--max-len", "--len-ratio", "--nbest", *O.MBR_FLAGS, *O.SAMPLING_FLAGS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scratchformer.generate",
                                description="Translate, summarize or classify text with a trained checkpoint.")
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="CKPT",
                   help="checkpoint file, or a run folder (uses its best.pt); several: an ensemble, its "
                   "predictions the mean of their probabilities (one task and tokenizer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", action="append", help="input text (repeatable)")
    src.add_argument("--input", metavar="FILE",
                     help="one input per line, or .jsonl(.gz/.xz) records ('-' = stdin, the default)")
    p.add_argument("--field", help="input field of JSON records (default: src, document or text by task)")
    p.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto",
                   help="input format (default: by the file name; stdin is sniffed)")
    O.add_decode_options(p, beam_size=4)
    p.add_argument("--max-len", type=int, help="longest output in tokens (default: the training max_tgt_len)")
    p.add_argument("--strict", action="store_true",
                   help="refuse inputs longer than the model's maximum instead of truncating them (with a warning)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--kernel", choices=("auto", "eager", "torch", "triton"), help="override the backend")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile the model (backend: inductor when given alone; aot_eager traces without "
                   "code generation)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per input (a translation's or abstractive summary's with its score: the "
                   "search's sum of log-probabilities / length ** --length-penalty)")
    p.add_argument("--nbest", type=int, default=1, metavar="N",
                   help="with --json or --output: the search's N best outputs, best first, each with its score "
                   "(default: 1; at most --beam-size); with --sample, N samples in the order drawn")
    O.add_mbr_options(p)
    O.add_sampling_options(p)
    b = p.add_argument_group("batch inference (with --output)")
    b.add_argument("--output", metavar="PREDS.jsonl", help="write {\"id\", \"prediction\"} lines here (atomically)")
    b.add_argument("--len-ratio", type=float,
                   help="decode up to ceil(R * source length) + 10 tokens, at most --max-len "
                        "(default: 2 for translation, none for summaries; 0 = none)")
    b.add_argument("--max-tokens", type=int, default=4096,
                   help="token budget per batch (padded source tokens; default: 4096)")
    b.add_argument("--batch-size", type=int, help="at most this many inputs per batch")
    b.add_argument("--max-src-len", type=int,
                   help="longest input in tokens, its EOS included (default: the training max_src_len)")
    b.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="autocast dtype (default: fp32)")
    b.add_argument("--resume", action="store_true", help="keep the predictions already in --output, add the rest")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    b.add_argument("--save-every", type=float, default=60.0,
                   help="seconds between snapshots to OUTPUT.partial (what --resume picks up after a kill; "
                   "default: 60)")
    b.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli.add_debug_flag(p)
    return p


def check_args(args) -> None:
    """Refuse flags no model can take, before any work (UsageError / OptionError naming the flag);
    resolves --device."""
    if args.output and args.text:
        raise cli.UsageError("--output takes its inputs from --input FILE (or stdin), not --text")
    for n, t in enumerate(args.text or (), 1):  # a byte that is not UTF-8 arrives as a lone surrogate
        if (bad := re.search(r"[\ud800-\udfff]", t)) is not None:
            raise cli.UsageError(f"--text {n} is not UTF-8 text: byte 0x{ord(bad[0]) & 0xFF:02x} at character "
                                 f"{bad.start()}; convert it to UTF-8")
    blank = [n for n, t in enumerate(args.text or (), 1) if not t.strip()]
    if blank:  # skipped, the output lines would no longer be the --text's, one for one
        raise cli.UsageError(f"--text {blank[0]} (of {len(args.text)}) is blank: each --text is an input, with its "
                             "output line; give it a text or leave it out")
    parser = build_parser()  # the defaults given flags are told from
    _check_search(args, parser)
    if args.json and args.output:  # the text mode's flag: batch inference would ignore it
        raise cli.UsageError("--json prints the text mode's records; --output writes JSON lines of its own (with "
                             "--nbest N, each line's n-best list): drop --json")
    if args.nbest > 1 and not (args.output or args.json):
        raise cli.UsageError(f"--nbest {args.nbest} lists each input's outputs in its --json record or --output "
                             "line: give --json, or --output")
    if args.save_every < 0:
        raise cli.UsageError(f"--save-every must be >= 0 seconds (0: after every batch), got {args.save_every}")
    if args.threads is not None and args.threads < 1:
        raise cli.UsageError(f"--threads must be >= 1, got {args.threads}")
    reading = cli.given_flags(args, parser, ("--field", "--format"))
    if reading and args.text:  # they read --input's records: --text's were ignored, silently
        raise cli.UsageError(f"{', '.join(reading)} read{'s' if len(reading) == 1 else ''} the records of --input; "
                             f"--text gives the text itself: drop {'it' if len(reading) == 1 else 'them'}")
    batch_only = cli.given_flags(args, parser, BATCH_FLAGS)
    if batch_only and not args.output:  # the text mode would decode without them, silently
        one = len(batch_only) == 1
        raise cli.UsageError(f"{', '.join(batch_only)} {'is' if one else 'are'} for batch inference: give --output "
                             f"PREDS.jsonl (with --input), or drop {'it' if one else 'them'}")
    args.device = resolve_device(args.device)  # a torch.device from here on


def _check_search(args, parser) -> None:
    """The decoding options (`O.check_options`) and how outputs are found: beam search or --sample, --mbr's
    choice among candidates, --nbest's list of them (`check_args`); --sample sets --beam-size to 1."""
    O.check_search_flags(args, cli.given_flags(args, parser, ("--beam-size", *O.SAMPLING_FLAGS, *O.MBR_FLAGS)))
    O.check_options(beam_size=args.beam_size, length_penalty=args.length_penalty, no_repeat_ngram=args.no_repeat_ngram,
                    min_len=args.min_len, max_len=args.max_len,
                    len_ratio=args.len_ratio, max_tokens=args.max_tokens, batch_size=args.batch_size,
                    max_src_len=args.max_src_len, summary_sentences=args.summary_sentences,
                    summary_words=args.summary_words, sampling=O.sampling_of(args), mbr=args.mbr)
    if args.mbr and args.nbest > 1:
        raise O.OptionError(f"--mbr {args.mbr} outputs one choice among its candidates; --nbest {args.nbest} lists "
                            "the search's: give one of them")
    if args.sample and args.nbest < 1:
        raise O.OptionError(f"--nbest must be >= 1 (samples an input), got {args.nbest}")
    if not args.sample and not 1 <= args.nbest <= args.beam_size:
        raise O.OptionError(f"--nbest must be in [1, --beam-size {args.beam_size}] (a search keeps --beam-size "
                            f"hypotheses), got {args.nbest}")


def run_batch(args) -> dict:
    """--output: predict a whole file (see `evaluation.predict.predict_file`). Ctrl-C keeps what
    was done in OUTPUT.partial; errors go to the command line (`cli.run`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = P.predict_file(
        args.checkpoint, args.input or "-", args.output, field=args.field, fmt=args.format, resume=args.resume,
        overwrite=args.overwrite, save_every=args.save_every, device=args.device, kernel=args.kernel,
        compile=args.compile,
        progress=not args.no_progress and sys.stderr.isatty(), beam_size=args.beam_size,
        length_penalty=args.length_penalty, no_repeat_ngram=args.no_repeat_ngram, min_len=args.min_len,
        max_len=args.max_len, len_ratio=args.len_ratio,
        max_tokens=args.max_tokens, batch_size=args.batch_size, precision=args.precision,
        max_src_len=args.max_src_len, strict=args.strict, summary_sentences=args.summary_sentences,
        summary_words=args.summary_words, sampling=O.sampling_of(args), nbest=args.nbest if args.nbest > 1 else None,
        mbr=args.mbr, mbr_utility=args.mbr_utility,
        decode_flags=cli.given_flags(args, build_parser(), SEQUENCE_FLAGS))
    kept = f", {summary['kept']} kept from the earlier output" if summary["kept"] else ""
    rate = f" in {summary['seconds']:.1f} s ({summary['examples_per_s']} examples/s)" if summary["predicted"] else ""
    print(f"{summary['output']}: {summary['inputs']} inputs, {summary['predicted']} predicted{kept}{rate}",
          file=sys.stderr)
    return summary


def generate(model, toks, ckpt, texts: list[str], *, device, beam_size: int = 4, length_penalty: float = 1.0,
             no_repeat_ngram: int = 0, min_len: int = 0, max_len: int | None = None, strict: bool = False,
             source: str = "input", lines: list[int] | None = None, summary_sentences: int | None = None,
             summary_words: int | None = None, nbest: int = 0, sampling: Sampling | None = None,
             ids: list | None = None, mbr: int | None = None, mbr_utility: str | None = None) -> list[dict]:
    """texts -> [{"input", "output"}] (seq2seq, extractive) or [{"input", "label", "label_name",
    "confidence"}]. An input longer than the model's maximum is truncated with a warning naming its
    line (`lines`: each text's line in `source`, default 1, 2, ...), or refused with `strict`, as
    batch inference does. nbest n > 0 (seq2seq): each record also holds its output's "score" (the
    search's: sum(log p) / len ** length_penalty, `model.beam_search_nbest`), and for n > 1 "nbest", the
    n best outputs [{"output", "score"}], best first. `sampling`: outputs drawn (beam_size 1; nbest n: n
    samples in the order drawn), each input's draws keyed by its id (`ids`, default its line), as batch
    inference keys them: the same input and id draw the same there. mbr n: the MBR choice among n
    candidates (`evaluation.mbr`)."""
    O.check_options(beam_size=beam_size, length_penalty=length_penalty, max_len=max_len,
                    no_repeat_ngram=no_repeat_ngram, min_len=min_len, summary_sentences=summary_sentences,
                    summary_words=summary_words, sampling=sampling, mbr=mbr)
    task = ckpt["task"]
    O.check_task_options(task, summary_sentences, summary_words, sampling)
    a = ckpt["args"]
    max_tgt = max_len or a["max_tgt_len"]
    if task not in D.ENCODER_ONLY and max_tgt >= model.cfg.max_len:
        raise O.OptionError(f"--max-len must be < the model's max_len {model.cfg.max_len}, got {max_tgt}")
    lines = lines or list(range(1, len(texts) + 1))
    ids = ids or lines
    records = [P.InputRecord(i, t, n) for i, t, n in zip(ids, texts, lines, strict=True)]
    dataset = P.encode_records(records, task, toks, a["max_src_len"], strict=strict, source=source)
    if task == "classification":
        names = ckpt["data"].get("labels")
        preds, probs = predict_labels(model, dataset, device=device)
        return [{"input": t, "label": y, "label_name": (names or {}).get(y, str(y)), "confidence": c}
                for t, y, c in zip(texts, preds, probs, strict=True)]
    if task == "extractive":  # the picked sentences one per line, as --output writes them (text mode: side by side)
        outs = predict_extracts(model, dataset, device=device, sentences=summary_sentences, words=summary_words)
    else:
        outs = predict_seq2seq(model, dataset, toks.tgt, device=device, max_tgt_len=max_tgt, beam_size=beam_size,
                               length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len,
                               nbest=nbest, sampling=sampling, mbr=mbr or 0, mbr_utility=mbr_utility,
                               keys=[row_key(i) for i in ids] if sampling is not None else None)
        if nbest:
            return [{"input": t, **hyps[0], **({"nbest": hyps} if nbest > 1 else {})}
                    for t, hyps in zip(texts, outs, strict=True)]
    return [{"input": t, "output": o} for t, o in zip(texts, outs, strict=True)]


def _one_line(text: str) -> str:
    """text on one line of the output, its lines (a summary's sentences) side by side: split at every
    line end str.splitlines knows, not at \\n alone (a byte-level model can emit \\r, \\f, \\x1c,
    \\u2028, ...: a reader splitting lines as Python does would find more lines than inputs)."""
    return " ".join(text.splitlines())


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.output:
        return run_batch(args)
    device = args.device
    model, toks, ckpt = load_models(args.checkpoint, device, args.kernel, args.compile)
    O.check_decode_flags(ckpt["task"], cli.given_flags(args, build_parser(), SEQUENCE_FLAGS))
    if args.text:
        source, numbered = "--text", list(enumerate(args.text, 1))  # none blank (`check_args`)
        ids = None  # their numbers
    else:  # text lines or JSON records, read as batch inference reads them (DataError: file and line)
        source = display_name(args.input or "-")
        records = P.read_inputs(args.input or "-", ckpt["task"], args.field, args.format)
        numbered, ids = [(r.line, r.text) for r in records], [r.id for r in records]
    texts = [t for _, t in numbered]
    results = generate(model, toks, ckpt, texts, device=device, beam_size=args.beam_size,
                       length_penalty=args.length_penalty, no_repeat_ngram=args.no_repeat_ngram, min_len=args.min_len,
                       max_len=args.max_len, strict=args.strict, source=source, lines=[n for n, _ in numbered],
                       summary_sentences=args.summary_sentences, summary_words=args.summary_words,
                       nbest=args.nbest if args.json else 0, sampling=O.sampling_of(args), ids=ids, mbr=args.mbr,
                       mbr_utility=args.mbr_utility)
    printed = 0  # the input lines answered so far: a blank one (skipped, not predicted) gets an empty line
    for (line, _), r in zip(numbered, results, strict=True):
        if args.json:
            print(json.dumps(r, ensure_ascii=False))
            continue
        print("\n" * (line - printed - 1), end="")  # --text: numbered 1, 2, ..., none blank
        printed = line
        if "output" in r:  # one line per input: a summary's sentences side by side
            print(_one_line(r["output"]))
        else:
            print(f"{r['label_name']}\t{r['confidence']:.3f}")
    return results


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
