"""Sentences of a text: the splitter the Lead-3 baseline, ROUGE-Lsum's sentence boundaries and
the extractive summarizer's sentence units all share."""

from __future__ import annotations

import re

# a sentence end: whitespace after . ! or ? (or after a quote or bracket right behind one: untokenized
# 'he said "no." then'), or newlines
_SENT_END = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["'’”)]))\s+|\n+""")
# a word whose period ends no sentence: initials and letter-dot abbreviations (j. u.s. p.m.) and titles
_ABBREVIATION = re.compile(r"(?:^|\s)(?:(?:[a-z]\.)+|(?:mr|mrs|ms|dr|prof|st|jr|sr|gen|gov|sen|rep|lt|col|sgt|"
                           r"capt|rev|vs)\.)$", re.IGNORECASE)
# a quotation mark standing as a token of its own (tokenized text: CNN/DM's ' " ', Daily Mail's ' ‘ ' and ' ’ ')
_QUOTE_TOKEN = re.compile(r"""(?<!\S)["'‘’“”](?!\S)""")
_OPENING = {'"': '"', "'": "'", "’": "‘", "”": "“"}  # a closing quote token -> the token that opens it


def split_sentences(text: str) -> list[str]:
    """A simple sentence splitter: newlines, and whitespace after . ! or ?, except after a word
    whose period is an abbreviation's (`_ABBREVIATION`). In CNN/DM's tokenized text sentences end
    in ' . ' and 'the u.s. treasury' is one sentence; in SAMSum's, 'at 5 p.m. tomorrow' is.

    A quotation mark token right after a sentence end closes that sentence's quote when one is open
    before it (an odd number of ' " ' so far, more ' ‘ ' than ' ’ ', ...): it stays with that
    sentence (' " we will win . " | he left . '), as a quote that opens the next one goes with it."""
    quotes = {m.start(): m.group() for m in _QUOTE_TOKEN.finditer(text)}
    pieces, start = [], 0
    for m in _SENT_END.finditer(text):
        stop = m.start() - (text[m.start() - 1] not in ".!?")  # the . ! ? itself ('u.s.)' ends in '.')
        if "\n" not in m.group() and _ABBREVIATION.search(text, max(0, stop - 16), stop):
            continue
        end, after = m.start(), m.end()
        if "\n" not in m.group() and after in quotes and _closes(quotes, after):
            end = after + 1
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return [s.strip() for s in pieces if s.strip()]


def _closes(quotes: dict[int, str], at: int) -> bool:
    """Whether the quote token at `at` closes a quote opened before it (`quotes`: every quote token's
    mark by position)."""
    mark = quotes[at]
    before = [q for pos, q in quotes.items() if pos < at]
    opening = _OPENING.get(mark)
    if opening is None:  # ‘ and “ only open
        return False
    if opening == mark:  # " and ' open and close: an odd count so far leaves one open
        return before.count(mark) % 2 == 1
    return before.count(opening) > before.count(mark)
