"""Byte-level BPE: special ids, round trip, save/load, shared and separate vocabularies."""

import codecs
import pickle

import pytest

from scratchformer.data import Example, synthetic_examples, texts_for_tokenizer
from scratchformer.data.tokenizer import MIN_VOCAB, BPETokenizer, TokenizerPair
from scratchformer.model import BOS_ID, EOS_ID, PAD_ID, UNK_ID

TEXTS = ["Two young, White males are outside near many bushes.", "Zwei junge weiße Männer sind im Freien.",
         "Amanda: I baked  cookies.\nJerry: Sure!"] * 20


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer.train(TEXTS, vocab_size=400)


def test_special_ids(tok):
    for t, i in [("<pad>", PAD_ID), ("<s>", BOS_ID), ("</s>", EOS_ID), ("<unk>", UNK_ID)]:
        assert tok.tok.token_to_id(t) == i
    assert tok.vocab_size <= 400
    ids = tok.encode("Zwei junge")
    assert ids and min(ids) > UNK_ID  # no special token added by encode


@pytest.mark.parametrize("text", [
    "Two young, White males are outside near many bushes.",
    "Grüße aus Köln – 3,5 °C!",  # unseen characters: byte fallback, never <unk>
    "line one\nline  two",  # newlines and double spaces survive
    "日本語",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert UNK_ID not in ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ["ein Satz </s> mit Ende", "x<s>y", "a <unk> b", "<pad>", "<s>strike</s> me"])
def test_special_tokens_strings_are_text(tmp_path, tok, text):
    """A special token's string in the data is encoded as its bytes: a target's literal "</s>" must not
    end it (nor a "<pad>" drop out of the loss, an "<s>" mark a sentence); the same after a reload
    from the saved file and in a pickled copy (a data worker's), where the setting is not saved."""
    tok.save(tmp_path / "t.json")
    for t in (tok, BPETokenizer.load(tmp_path / "t.json"), pickle.loads(pickle.dumps(tok))):
        ids = t.encode(text)
        assert min(ids) > UNK_ID and t.encode_batch([text]) == [ids]
        assert t.decode(ids) == text


def test_decode_stops_at_eos_and_skips_specials(tok):
    ids = tok.encode("near many")
    assert tok.decode([BOS_ID] + ids + [EOS_ID] + tok.encode("bushes") + [PAD_ID]) == "near many"
    assert tok.decode_batch([ids, ids + [EOS_ID, PAD_ID]]) == ["near many", "near many"]


def test_save_load_pair(tmp_path, tok):
    pair = TokenizerPair(tok)
    assert pair.shared and [p.name for p in pair.save(tmp_path)] == ["tokenizer.json"]
    again = TokenizerPair.load([tmp_path / "tokenizer.json"])
    assert again.src.encode("Männer sind") == tok.encode("Männer sind")
    ex = synthetic_examples("train", 100)
    sep = TokenizerPair(BPETokenizer.train(texts_for_tokenizer(ex, "src"), 300),
                        BPETokenizer.train(texts_for_tokenizer(ex, "tgt"), 300))
    files = sep.save(tmp_path)
    assert [p.name for p in files] == ["tokenizer.src.json", "tokenizer.tgt.json"]
    back = TokenizerPair.from_dict(sep.to_dict())
    assert not back.shared and back.tgt.decode(back.tgt.encode("fünf drei")) == "fünf drei"


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=f"at least {MIN_VOCAB}"):
        BPETokenizer.train(TEXTS, vocab_size=100)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer file"):
        BPETokenizer.load(bad)
    with pytest.raises(FileNotFoundError):
        BPETokenizer.load(tmp_path / "missing.json")


def test_a_tokenizer_file_not_laid_out_as_ours_is_refused_by_name(tmp_path):
    """A --tokenizer file with the four specials at ids 0-3 but another layout (a WordLevel model, no
    ByteLevel pre-tokenizer or decoder, specials not registered as special) was taken: most text became
    <unk> and decoding kept "<pad>" in its output. It is refused naming what differs; ours loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4}, unk_token="<unk>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "word.json"))
    with pytest.raises(ValueError, match=r"word.json: not a byte-level BPE tokenizer as train makes them \(its model "
                                         r"is WordLevel, not BPE; it has no ByteLevel pre-tokenizer; its decoder is "
                                         r"None, not ByteLevel; <pad>, <s>, </s>, <unk> not registered as special "
                                         r"tokens\)"):
        BPETokenizer.load(tmp_path / "word.json")
    ours = BPETokenizer.train(TEXTS, 300)
    ours.save(tmp_path / "ours.json")
    assert BPETokenizer.load(tmp_path / "ours.json").encode("hello there") == ours.encode("hello there")
    # ours with a normaliser that lower-cases and strips accents: every output "ein madchen", never the
    # reference's "Ein Mädchen" (a perfect model scored BLEU 9); refused by name, as is NFKC
    from tokenizers import normalizers

    for name, norm in (("Sequence", normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(),
                                                           normalizers.StripAccents()])),
                       ("NFKC", normalizers.NFKC())):
        other = Tokenizer.from_str(ours.to_str())
        other.normalizer = norm
        other.save(str(tmp_path / "norm.json"))
        with pytest.raises(ValueError, match=rf"norm.json: not a byte-level BPE tokenizer as train makes them \(its "
                                             rf"normalizer is {name}, not NFC"):
            BPETokenizer.load(tmp_path / "norm.json")
    plain = Tokenizer.from_str(ours.to_str())  # none at all: outputs keep the text's own form
    plain.normalizer = None
    plain.save(str(tmp_path / "plain.json"))
    assert BPETokenizer.load(tmp_path / "plain.json").decode(ours.encode("hello there")) == "hello there"


def test_text_is_nfc_normalised_and_compatibility_characters_kept(tok):
    """NFC composes a letter and its combining accent ("e" + U+0301 is "é") and keeps compatibility
    characters as they are (the ligature "ﬁ" and "²" are not "fi" and "2", as NFKC would make them)."""
    assert tok.decode(tok.encode("Cafe\u0301")) == "Café"
    assert tok.decode(tok.encode("ﬁle x²")) == "ﬁle x²"


def test_a_merge_needs_two_occurrences_and_the_smallest_vocabulary_is_the_bytes_and_specials():
    """BPE merges a pair seen at least twice (min_frequency 2): in " ab", " ab", " cd" (byte-level, a
    prefix space "Ġ") the pairs "Ġa" and "ab" make " ab" one token, "Ġc" and "cd" (once) stay apart.
    A vocabulary of just MIN_VOCAB (the 256 bytes and 4 specials) is allowed: it merges nothing."""
    tok = BPETokenizer.train(["ab ab cd"], vocab_size=MIN_VOCAB + 10)
    assert len(tok.encode("ab")) == 1 and len(tok.encode("cd")) == 3
    tiny = BPETokenizer.train(["ab ab cd"], vocab_size=MIN_VOCAB)
    assert tiny.vocab_size == MIN_VOCAB and len(tiny.encode("ab")) == 3


def test_a_shared_pair_stays_shared_through_its_checkpoint_form(tok):
    pair = TokenizerPair(tok)
    assert pair.to_dict()["tgt"] is None and TokenizerPair.from_dict(pair.to_dict()).shared


def test_a_tokenizer_is_trained_on_the_texts_of_the_side_asked_for():
    """texts_for_tokenizer: 'src' the sources, 'tgt' the targets, 'both' each example's source then its target;
    a classification label is no text (an int), so it is never among them."""
    pairs = [Example("one two", "eins zwei"), Example("three", "drei")]
    assert list(texts_for_tokenizer(pairs, "src")) == ["one two", "three"]
    assert list(texts_for_tokenizer(pairs, "tgt")) == ["eins zwei", "drei"]
    assert list(texts_for_tokenizer(pairs, "both")) == ["one two", "eins zwei", "three", "drei"]
    labelled = [Example("a good film", 1), Example("a bad one", 0)]
    for side, want in (("src", ["a good film", "a bad one"]), ("tgt", []), ("both", ["a good film", "a bad one"])):
        assert list(texts_for_tokenizer(labelled, side)) == want


def test_token_labels_are_each_tokens_text_and_the_bytes_of_a_split_character():
    """token_strings (the attention maps' labels): a token's text as the library's decoder gives it alone;
    for a token holding part of a character (byte-level merges cross characters: "日本語" and "€" seen
    rarely) that part as \\x escapes, not one "�" per token: the labels, read back as bytes, give the
    text's UTF-8 bytes. Specials by name; an id beyond the vocabulary is refused by name."""
    tok = BPETokenizer.train(["日本語 the € naïve"] * 3 + ["日本 語本"] * 2, vocab_size=MIN_VOCAB + 20)
    for i in range(tok.vocab_size):
        alone = tok.tok.decode([i], skip_special_tokens=False)
        if "\ufffd" not in alone:
            assert tok.token_strings([i]) == [alone]
    text = "日本語 € naïve 日本"
    ids = tok.encode(text)
    labels = tok.token_strings(ids)
    assert any("\\x" in label for label in labels) and not any("\ufffd" in label for label in labels)
    assert b"".join(codecs.escape_decode(label.encode())[0] for label in labels) == f" {text}".encode()
    assert tok.token_strings([BOS_ID, EOS_ID, PAD_ID, UNK_ID]) == ["<s>", "</s>", "<pad>", "<unk>"]
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is not in the tokenizer's vocabulary"):
        tok.token_strings([tok.vocab_size])
