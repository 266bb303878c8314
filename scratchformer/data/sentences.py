"""Sentences of a text: the splitter the Lead-3 baseline, ROUGE-Lsum's sentence boundaries and
the extractive summarizer's sentence units all share."""

from __future__ import annotations

import re

# a sentence end: whitespace after . ! or ? (or after a quote or bracket right behind one: untokenized
# 'he said "no." then'), or newlines
_SENT_END = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["'’”)]))\s+|\n+""")
# a word whose period ends no sentence: initials and letter-dot abbreviations (j. u.s. p.m.), titles and
# ranks (before a name), a mountain's and a fort's
_ABBREVIATION = re.compile(r"(?:^|\s)(?:(?:[a-z]\.)+|(?:mr|mrs|ms|dr|prof|st|jr|sr|gen|gov|sen|rep|lt|col|sgt|"
                           r"capt|rev|vs|maj|cpl|pvt|spc|det|adm|cmdr|supt|insp|mt|ft)\.)$", re.IGNORECASE)
# ... and a company's, a month's, a street's (inc. co. sept. ave.), which end one before a capital where case is
# kept (SAMSum's 'on 5 Dec. Bye!'; CNN/DM is lowercased, and its sentences end in ' . ')
_ABBREVIATION_BEFORE_LOWER = re.compile(r"(?:^|\s)(?:inc|co|corp|ltd|bros|jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|"
                                        r"nov|dec|ave|blvd)\.$", re.IGNORECASE)
# ... and 'no.' before a number (CNN/DM's 'the world no. 1'; SAMSum's 'No. I can't' ends one)
_NUMBER_SIGN = re.compile(r"(?:^|\s)no\.$", re.IGNORECASE)
# where case is kept (SAMSum), 'I.' and 'a.m.' / 'p.m.' before a capital do end one: 'Neither do I. So ...',
# 'at 7 p.m. She will ...' (an initial's 'W. Bush' does not)
_ENDS_BEFORE_A_CAPITAL = re.compile(r"(?:^|\s)(?:I|[ap]\.m)\.$")
# a quotation mark standing as a token of its own (tokenized text: CNN/DM's ' " ', Daily Mail's ' ‘ ' and ' ’ ')
_QUOTE_TOKEN = re.compile(r"""(?<!\S)["'‘’“”](?!\S)""")
_OPENING = {'"': '"', "'": "'", "’": "‘", "”": "“"}  # a closing quote token -> the token that opens it
# ... but not a plural's possessive apostrophe, between a word ending in s and the next word (CNN/DM's
# "the players ' union", Daily Mail's "the players ’ union"): counted as a quote, it left every later quotation
# open the other way round (its closing quote began the next sentence, or ended a document as a sentence alone)
_POSSESSIVE = re.compile(r"(?<=[sS] )['’](?= \w)")
# a piece with a letter or digit: a sentence; the rest (' . ' after 'corp. ', a closing quote left over, '...')
# joins the sentence before it
_WORD = re.compile(r"\w")


def split_sentences(text: str) -> list[str]:
    """A simple sentence splitter: newlines, and whitespace after . ! or ?, except after a word
    whose period is an abbreviation's (`_abbreviation`). In CNN/DM's tokenized text sentences end
    in ' . ' and 'the u.s. treasury' is one sentence; in SAMSum's, 'at 5 p.m. tomorrow' is.

    A quotation mark token right after a sentence end closes that sentence's quote when one is open
    before it (an odd number of ' " ' so far, more ' ‘ ' than ' ’ ', ...): it stays with that
    sentence (' " we will win . " | he left . '), as a quote that opens the next one goes with it
    (a plural's possessive apostrophe is no quote: `_POSSESSIVE`). A piece with no letter or digit
    is no sentence: it joins the one before it (the one after it, at the start)."""
    quotes = {m.start(): m.group() for m in _QUOTE_TOKEN.finditer(text) if not _POSSESSIVE.match(text, m.start())}
    pieces, start = [], 0
    for m in _SENT_END.finditer(text):
        stop = m.start() - (text[m.start() - 1] not in ".!?")  # the . ! ? itself ('u.s.)' ends in '.')
        if "\n" not in m.group() and _abbreviation(text, stop, m.end()):
            continue
        end, after = m.start(), m.end()
        if "\n" not in m.group() and after in quotes and _closes(quotes, after):
            end = after + 1
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    sentences: list[str] = []
    for piece in filter(None, (s.strip() for s in pieces)):
        if sentences and not (_WORD.search(piece) and _WORD.search(sentences[-1])):
            sentences[-1] += " " + piece
        else:
            sentences.append(piece)
    return sentences


def _abbreviation(text: str, stop: int, after: int) -> bool:
    """Whether the period at text[stop - 1] is an abbreviation's, not a sentence end; `after`: where the
    next sentence would begin."""
    start, following = max(0, stop - 16), text[after:after + 1]
    if _NUMBER_SIGN.search(text, start, stop):
        return following.isdigit()
    if following.isupper() and _ENDS_BEFORE_A_CAPITAL.search(text, start, stop):
        return False
    if not following.isupper() and _ABBREVIATION_BEFORE_LOWER.search(text, start, stop):
        return True
    return _ABBREVIATION.search(text, start, stop) is not None


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
