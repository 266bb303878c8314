"""Byte-level BPE tokenizers (Hugging Face `tokenizers`), trained on the train split.

Pipeline: NFC normalisation, ByteLevel pre-tokenizer (GPT-2's: every byte is in the base
alphabet, so nothing is ever <unk>, and newlines survive), BPE model, ByteLevel decoder; decoding
gives back the detokenized text. Special tokens have fixed ids shared with the model config:
<pad>=0, <s>=1 (BOS), </s>=2 (EOS), <unk>=3. Encoding adds no special tokens; the data pipeline
adds BOS/EOS where they belong, by id. A special token's string in a text ("<s>", an HTML tag; a
literal "</s>") is text like any other: encoded as its bytes, never as the special id (else a target's
"</s>" would end it early, and its "<pad>" would drop out of the loss).

A run keeps its tokenizers beside the checkpoint: ``tokenizer.json`` when source and target
share a vocabulary, else ``tokenizer.src.json`` and ``tokenizer.tgt.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..special_tokens import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID  # noqa: F401

# The special tokens' fixed ids: the tokenizer owns them; the model config takes its defaults
# (pad id, BOS for decoding) from here.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens


class BPETokenizer:
    """A thin wrapper: fixed special ids, batch encode, decode that stops at EOS."""

    def __init__(self, tok: Tokenizer):
        for t, i in SPECIAL_TOKENS.items():
            got = tok.token_to_id(t)
            if got != i:
                raise ValueError(f"tokenizer must map {t} to id {i}, got {got}")
        tok.encode_special_tokens = True  # not saved in the tokenizer's JSON: set on every load
        self.tok = tok

    def __reduce__(self):  # a pickled copy (a worker's) is rebuilt through __init__, keeping the setting above
        return BPETokenizer.from_str, (self.to_str(),)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
        if vocab_size < MIN_VOCAB:
            raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (256 bytes + 4 specials), got {vocab_size}")
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),  # in id order: 0, 1, 2, 3
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_str(cls, s: str) -> BPETokenizer:
        return cls(Tokenizer.from_str(s))

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path}: not a valid tokenizer file ({e})") from None
        _check_byte_level(tok, path)
        return cls(tok)

    def to_str(self) -> str:
        return self.tok.to_str()

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file, fsync, rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_str())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text: stops at the first EOS, drops special tokens, strips the whitespace at either
        end (the prefix space the encoding adds among it: a model's output, whose edge whitespace says
        nothing; so a text that began or ended in whitespace does not come back whole)."""
        ids = [int(i) for i in ids]
        if EOS_ID in ids:
            ids = ids[: ids.index(EOS_ID)]
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """A readable label per token (for attention heatmaps): a special token's name, else the token's
        text; the bytes of a character the token holds only part of (BPE merges bytes, not characters:
        "日本" can be the tokens "\\xe6\\x97", "\\xa5\\xe6", ...) written as escapes, where decoding it
        alone gives "�" for each."""
        names = {j: t for t, j in SPECIAL_TOKENS.items()}
        out = []
        for i in map(int, ids):
            piece = self.tok.id_to_token(i)
            if piece is None:
                raise ValueError(f"token id {i} is not in the tokenizer's vocabulary of {self.vocab_size}")
            out.append(names.get(i) or bytes(_BYTE_OF[c] for c in piece).decode("utf-8", "backslashreplace"))
        return out


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the ByteLevel pre-tokenizer's), read backwards: the character a
    token spells each byte with -> that byte. The printable bytes stand for themselves, the others
    for chr(256), chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(rest)}


_BYTE_OF = _byte_level_alphabet()


def _check_byte_level(tok: Tokenizer, path: Path) -> None:
    """ValueError naming `path` for a tokenizer file not laid out as `BPETokenizer.train`'s: a BPE model
    with ByteLevel pre-tokenizer and decoder (another, a WordLevel one, maps most text to <unk>: a model
    trained on it learns nothing of it, silently) and the special tokens registered as special (else
    decoding keeps a "<pad>" in the text), normalising text by NFC alone (or not at all): another
    normaliser (lower-casing, stripping accents) made every output differ from its reference, unsaid."""
    spec = json.loads(tok.to_str())
    kind = {part: (spec.get(part) or {}).get("type") for part in ("model", "pre_tokenizer", "decoder")}
    pre = spec.get("pre_tokenizer") or {}
    pres = [(p or {}).get("type") for p in pre.get("pretokenizers", [])] if kind["pre_tokenizer"] == "Sequence" \
        else [kind["pre_tokenizer"]]
    specials = {t.get("content") for t in spec.get("added_tokens", []) if t.get("special")}
    missing = [t for t in SPECIAL_TOKENS if t not in specials]
    faults = []
    if kind["model"] != "BPE":
        faults.append(f"its model is {kind['model']}, not BPE")
    if "ByteLevel" not in pres:
        faults.append("it has no ByteLevel pre-tokenizer")
    if kind["decoder"] != "ByteLevel":
        faults.append(f"its decoder is {kind['decoder']}, not ByteLevel")
    if missing:
        faults.append(f"{', '.join(missing)} not registered as special tokens")
    if (normalizer := (spec.get("normalizer") or {}).get("type")) not in (None, "NFC"):
        faults.append(f"its normalizer is {normalizer}, not NFC (outputs would not be the references' text)")
    if faults:
        raise ValueError(f"{path}: not a byte-level BPE tokenizer as train makes them ({'; '.join(faults)}): "
                         "give a tokenizer.json of a scratchformer run, or drop --tokenizer to train one")


class TokenizerPair:
    """Source and target tokenizers; the same object twice when the vocabulary is shared."""

    def __init__(self, src: BPETokenizer, tgt: BPETokenizer | None = None):
        self.src = src
        self.tgt = tgt if tgt is not None else src

    @property
    def shared(self) -> bool:
        return self.tgt is self.src

    def save(self, folder: str | Path) -> list[Path]:
        folder = Path(folder)
        if self.shared:
            paths = [folder / "tokenizer.json"]
            self.src.save(paths[0])
        else:
            paths = [folder / "tokenizer.src.json", folder / "tokenizer.tgt.json"]
            self.src.save(paths[0])
            self.tgt.save(paths[1])
        return paths

    def to_dict(self) -> dict:
        return {"src": self.src.to_str(), "tgt": None if self.shared else self.tgt.to_str()}

    @classmethod
    def from_dict(cls, d: dict) -> TokenizerPair:
        src = BPETokenizer.from_str(d["src"])
        return cls(src, None if d.get("tgt") is None else BPETokenizer.from_str(d["tgt"]))

    @classmethod
    def load(cls, paths: Sequence[str | Path]) -> TokenizerPair:
        """One file (shared vocabulary) or two (source, target)."""
        if len(paths) not in (1, 2):
            raise ValueError(f"give one tokenizer file (shared) or two (source, target), got {len(paths)}")
        src = BPETokenizer.load(paths[0])
        return cls(src, BPETokenizer.load(paths[1]) if len(paths) == 2 else None)
