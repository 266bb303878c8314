"""The command-line options of decoding and batching (evaluate, generate) and their checks: the
flags (`add_decode_options`), and `OptionError`, naming the flag, for a value no model can take
(`check_options`) or one the model at hand cannot (`check_decode_flags`, `check_extract_options`),
raised before any work. The commands report an OptionError as a user's error (`cli`)."""

from __future__ import annotations

import math

from .. import data as D
from ..data.extractive import MAX_ORACLE_SENTENCES
from ..model.decoding import MAX_LENGTH_PENALTY


class OptionError(ValueError):
    """A prediction option the model or task cannot take (the command line reports it as a user error)."""


def check_options(*, beam_size: int = 1, length_penalty: float = 1.0, max_len: int | None = None,
                  len_ratio: float | None = None, max_tokens: int | None = None, batch_size: int | None = None,
                  max_src_len: int | None = None, no_repeat_ngram: int = 0, min_len: int = 0,
                  summary_sentences: int | None = None, summary_words: int | None = None, **_other) -> None:
    """Refuse decoding and batching options no model can take, before any work: OptionError naming
    the flag. None is the default (see `predict_records`); other keywords are not checked here."""
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


def check_decode_flags(task: str, given: list[str]) -> None:
    """OptionError naming `given` (flags of sequence decoding set on a command line: `DECODE_FLAGS`, and
    generate's --max-len and --len-ratio) for a model that decodes none."""
    if task in D.ENCODER_ONLY and given:
        raise OptionError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for decoding a sequence; this "
                          f"model is {task} and decodes none: drop {'it' if len(given) == 1 else 'them'}")


def check_extract_options(task: str, summary_sentences: int | None = None, summary_words: int | None = None,
                          **_other) -> None:
    """--summary-sentences and --summary-words (None: not given) pick an extractive model's
    sentences: refused, naming the flag, for a model of another task (which would ignore them)."""
    if task != "extractive":
        for flag, value in (("--summary-sentences", summary_sentences), ("--summary-words", summary_words)):
            if value is not None:
                raise OptionError(f"{flag} picks an extractive model's sentences; this model is {task}")
