"""The command-line options of decoding and batching (evaluate, generate) and their checks: the
flags (`add_decode_options`), and `OptionError`, naming the flag, for a value no model can take
(`check_options`) or one the model at hand cannot (`check_decode_flags`, `check_task_options`),
raised before any work. The commands report an OptionError as a user's error (`cli`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import data as D
from ..data.extractive import MAX_ORACLE_SENTENCES
from ..model import Sampling
from ..model.decoding import MAX_LENGTH_PENALTY


class OptionError(ValueError):
    """A prediction option the model or task cannot take (the command line reports it as a user error)."""


def check_options(*, beam_size: int = 1, length_penalty: float = 1.0, max_len: int | None = None,
                  len_ratio: float | None = None, max_tokens: int | None = None, batch_size: int | None = None,
                  max_src_len: int | None = None, no_repeat_ngram: int = 0, min_len: int = 0,
                  summary_sentences: int | None = None, summary_words: int | None = None,
                  sampling: Sampling | None = None, mbr: int | None = None, **_other) -> None:
    """Refuse decoding and batching options no model can take, before any work: OptionError naming
    the flag. None is the default (see `predict_records`); other keywords are not checked here."""
    if sampling is not None:
        _check_sampling(sampling, beam_size, length_penalty)
    if mbr is not None and not 2 <= mbr <= (mbr if sampling is not None else beam_size):
        among = "N samples (--sample)" if sampling is not None else f"the beam's N best (--beam-size {beam_size})"
        raise OptionError(f"--mbr N chooses among N candidates, {among}: N must be >= 2"
                          f"{'' if sampling is not None else ' and <= --beam-size'}, got {mbr}")
    for flag, value in (("--beam-size", beam_size), ("--max-len", max_len), ("--max-tokens", max_tokens),
                        ("--batch-size", batch_size), ("--summary-sentences", summary_sentences),
                        ("--summary-words", summary_words)):
        if value is not None and value < 1:
            raise OptionError(f"{flag} must be >= 1, got {value}")
    if max_src_len is not None and max_src_len < 2:
        raise OptionError(f"--max-src-len must be >= 2 (an input's tokens, its EOS included), got {max_src_len}")
    if not abs(length_penalty) <= MAX_LENGTH_PENALTY:  # NaN fails too
        raise OptionError(f"--length-penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}] "
                          f"(len ** it divides a hypothesis's score), got {length_penalty}")
    if beam_size == 1 and length_penalty != 1.0:
        raise OptionError(f"--length-penalty {length_penalty:g} ranks beam search's hypotheses; greedy decoding "
                          "(--beam-size 1) has one: give --beam-size K > 1, or drop it")
    if no_repeat_ngram < 0:
        raise OptionError(f"--no-repeat-ngram must be >= 0 (0: off), got {no_repeat_ngram}")
    if min_len < 0:
        raise OptionError(f"--min-len must be >= 0 (0: off), got {min_len}")
    if len_ratio is not None and not (math.isfinite(len_ratio) and len_ratio >= 0):
        raise OptionError(f"--len-ratio must be >= 0 (0: no ratio, only --max-len), got {len_ratio}")


def _check_sampling(s: Sampling, beam_size: int, length_penalty: float) -> None:
    """--sample's options (`add_sampling_options`), and the beam search's it leaves no part to."""
    if not (math.isfinite(s.temperature) and s.temperature > 0):
        raise OptionError(f"--temperature must be a number > 0 (log p is divided by it), got {s.temperature}")
    if s.top_k < 0:
        raise OptionError(f"--top-k must be >= 0 (0: every token), got {s.top_k}")
    if not 0 < s.top_p <= 1:
        raise OptionError(f"--top-p must be in (0, 1] (1: every token), got {s.top_p}")
    if not 0 <= s.seed < 2 ** 63:
        raise OptionError(f"--seed must be in [0, 2**63), got {s.seed}")
    for flag, value, default in (("--beam-size", beam_size, 1), ("--length-penalty", length_penalty, 1.0)):
        if value != default:
            raise OptionError(f"{flag} {value:g} is beam search's; --sample draws each token: drop {flag}")


DECODE_FLAGS = ("--beam-size", "--length-penalty", "--no-repeat-ngram", "--min-len")  # sequence decoding's


def check_min_len(min_len: int, longest: int) -> None:
    """--min-len within the longest output a decoding gives (`longest` tokens: --max-len, or the
    training max_tgt_len): past it no output could end. Called by each entry before its work."""
    if min_len > longest:
        raise OptionError(f"--min-len {min_len} exceeds the longest output, {longest} tokens (--max-len, or the "
                          "training max_tgt_len)")


def add_decode_options(parser, beam_size: int) -> None:
    """The command-line options of decoding (evaluate, generate): `DECODE_FLAGS` (beam_size: the
    --beam-size default), then those of an extractive model's summary."""
    parser.add_argument("--beam-size", type=int, default=beam_size,
                        help=f"beam search width (default: {beam_size}; 1: greedy decoding)")
    parser.add_argument("--length-penalty", type=float, default=1.0,
                        help="beam search length penalty exponent (default: 1.0)")
    parser.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                        help="no N-gram twice in an output (3: the trigram blocking of summarizers; 0: off)")
    parser.add_argument("--min-len", type=int, default=0, metavar="N",
                        help="at least N tokens before the end of an output (summarizers use one; 0: off)")
    parser.add_argument("--summary-sentences", type=int, metavar="K",
                        help=f"an extractive model's summary: at most K of its best-scored sentences "
                        f"(default {MAX_ORACLE_SENTENCES})")
    parser.add_argument("--summary-words", type=int, metavar="W",
                        help="an extractive model's summary: its best-scored sentences until they hold W words, "
                        "at most --summary-sentences of them (default: no word budget)")


SAMPLING_FLAGS = ("--sample", "--temperature", "--top-k", "--top-p", "--seed")


def add_sampling_options(parser) -> None:
    """generate's `SAMPLING_FLAGS`: outputs drawn from the model's distribution (`model.sample_decode`)."""
    g = parser.add_argument_group("sampling (--sample)")
    g.add_argument("--sample", action="store_true",
                   help="draw each token from the model's distribution instead of searching for the best output "
                   "(diverse outputs, back-translation, candidates to rerank; --json --nbest N: N samples an input)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="divide the log-probabilities by T before drawing: < 1 sharper, > 1 flatter (default: 1)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="draw from the K most probable tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="draw from the fewest most probable tokens whose probabilities reach P, the nucleus "
                   "(default: 1, all)")
    g.add_argument("--seed", type=int, default=0,
                   help="the draws' seed: an input's samples depend on it and on the input's id alone, not on its "
                   "batch (default: 0)")


def sampling_of(args) -> Sampling | None:
    """The `Sampling` of parsed `add_sampling_options` flags (None without --sample)."""
    return Sampling(args.temperature, args.top_k, args.top_p, args.seed) if args.sample else None


MBR_FLAGS = ("--mbr", "--mbr-utility")


def add_mbr_options(parser) -> None:
    """`MBR_FLAGS`: the output chosen among candidates by minimum Bayes risk (`evaluation.mbr`)."""
    parser.add_argument("--mbr", type=int, metavar="N",
                        help="minimum Bayes risk: output the one of N candidates (the beam's N best, or with --sample "
                        "N samples) of highest mean --mbr-utility against them all (default: off)")
    parser.add_argument("--mbr-utility", choices=("chrf", "bleu"),
                        help="--mbr's utility, sentence-level (default: chrf; MBR raises the metric it uses)")


def check_search_flags(args, given: Sequence[str]) -> None:
    """How a command's outputs are found, from its parsed `add_sampling_options` and `add_mbr_options`
    flags (`given`: those of them, and --beam-size, set on its command line): --sample's shaping flags
    only with --sample, which draws each token and so takes no --beam-size (it sets `args.beam_size`
    to 1, a command's default being beam search's); --mbr-utility only with --mbr. Their values:
    `check_options`."""
    shaping = [f for f in SAMPLING_FLAGS[1:] if f in given]
    if shaping and not args.sample:
        one = len(shaping) == 1
        raise OptionError(f"{', '.join(shaping)} shape{'s' if one else ''} --sample's draws: give --sample, or drop "
                          f"{'it' if one else 'them'}")
    if args.sample:
        if "--beam-size" in given:
            raise OptionError(f"--beam-size {args.beam_size} is beam search's; --sample draws each token: drop "
                              "--beam-size")
        args.beam_size = 1
    if args.mbr_utility and not args.mbr:
        raise OptionError(f"--mbr-utility {args.mbr_utility} is --mbr's: give --mbr N, or drop it")


def check_decode_flags(task: str, given: list[str]) -> None:
    """OptionError naming `given` (flags of sequence decoding set on a command line: `DECODE_FLAGS`, and
    generate's --max-len and --len-ratio) for a model that decodes none. A --beam-size beside --sample is the
    one it set (`check_search_flags`: given, it was refused), not named."""
    given = [f for f in given if not (f == "--beam-size" and "--sample" in given)]
    if task in D.ENCODER_ONLY and given:
        raise OptionError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for decoding a sequence; this "
                          f"model is {task} and decodes none: drop {'it' if len(given) == 1 else 'them'}")


def check_task_options(task: str, summary_sentences: int | None = None, summary_words: int | None = None,
                       sampling: Sampling | None = None, **_other) -> None:
    """Options a model of `task` would ignore, refused naming the flag: --summary-sentences and
    --summary-words (None: not given) pick an extractive model's sentences; --sample draws a decoded
    sequence, which a classifier or an extractive summarizer has none of."""
    if sampling is not None and task in D.ENCODER_ONLY:
        raise OptionError(f"--sample draws a decoded sequence; this model is {task} and decodes none")
    if task != "extractive":
        for flag, value in (("--summary-sentences", summary_sentences), ("--summary-words", summary_words)):
            if value is not None:
                raise OptionError(f"{flag} picks an extractive model's sentences; this model is {task}")
