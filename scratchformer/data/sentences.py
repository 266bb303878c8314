"""Sentences of a text: the splitter the Lead-3 baseline, ROUGE-Lsum's sentence boundaries and
the extractive summarizer's sentence units all share."""

from __future__ import annotations

import re

_SENT_END = re.compile(r"(?<=[.!?])\s+|\n+")
# a word whose period ends no sentence: initials and letter-dot abbreviations (j. u.s. p.m.) and titles
_ABBREVIATION = re.compile(r"(?:^|\s)(?:(?:[a-z]\.)+|(?:mr|mrs|ms|dr|prof|st|jr|sr|gen|gov|sen|rep|lt|col|sgt|"
                           r"capt|rev|vs)\.)$", re.IGNORECASE)


def split_sentences(text: str) -> list[str]:
    """A simple sentence splitter: newlines, and whitespace after . ! or ?, except after a word
    whose period is an abbreviation's (`_ABBREVIATION`). In CNN/DM's tokenized text sentences end
    in ' . ' and 'the u.s. treasury' is one sentence; in SAMSum's, 'at 5 p.m. tomorrow' is."""
    pieces, start = [], 0
    for m in _SENT_END.finditer(text):
        if "\n" not in m.group() and _ABBREVIATION.search(text, max(0, m.start() - 16), m.start()):
            continue
        pieces.append(text[start:m.start()])
        start = m.end()
    pieces.append(text[start:])
    return [s.strip() for s in pieces if s.strip()]
