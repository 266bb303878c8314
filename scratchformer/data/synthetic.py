"""The embedded synthetic task: English number words -> German number words, reversed; it needs
no download (`synthetic_examples`). A smoke task, not a benchmark."""

from __future__ import annotations

import random

from .files import DataError
from .records import Example

EN_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DE_NUMBERS = ("null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun")
SYNTHETIC_SIZES = {"train": 12000, "validation": 300, "test": 300}


def synthetic_examples(split: str, n: int | None = None, seed: int = 1234, min_len: int = 3, max_len: int = 10):
    """The synthetic smoke task: English number words -> German number words, reversed.

    "three one four" -> "vier eins drei". Deterministic given (split, n, seed); each split uses its
    own stream, so validation and test sequences are drawn independently of train.
    """
    if split not in SYNTHETIC_SIZES:
        raise DataError(f"synthetic task has splits {list(SYNTHETIC_SIZES)}, not {split!r}")
    n = SYNTHETIC_SIZES[split] if n is None else n
    rng = random.Random(f"{seed}-{split}")
    out = []
    for i in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(min_len, max_len))]
        src = " ".join(EN_NUMBERS[d] for d in digits)
        tgt = " ".join(DE_NUMBERS[d] for d in reversed(digits))
        out.append(Example(src, tgt, f"{split}-{i}"))
    return out
