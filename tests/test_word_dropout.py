"""Word dropout (`ModelConfig.word_dropout`, `train --word-dropout P`): in a training forward each
ordinary input token, source and decoder input, is replaced by <unk> with probability P before
the embedding lookup; special tokens, evaluation and decoding are untouched. Checked against the
eager reference embedding (which rows became <unk>'s, at what rate) and against the plain model fed
<unk> by hand, on every backend (our Triton kernels in the interpreter on the CPU); the copy layer
still copies the real source ids."""

import json
import math

import pytest
import torch
from conftest import DEVICE, TINY

from scratchformer import ops as backends
from scratchformer import train as T
from scratchformer.model import ModelConfig, Transformer
from scratchformer.model.layers import Embedding
from scratchformer.reference import embed_ref
from scratchformer.special_tokens import SPECIAL_TOKENS, UNK_ID
from scratchformer.training.config import ConfigError

V, D = 40, 16


def _rng_state():
    """The state of the generator the mask is drawn from: the test device's."""
    return torch.cuda.get_rng_state() if DEVICE == "cuda" else torch.get_rng_state()


def _embedding(p):
    torch.manual_seed(0)
    return Embedding(V, D, ops=backends.select("eager", torch.device(DEVICE)), word_dropout=p).to(DEVICE)


def test_embedding_replaces_ordinary_tokens_by_unk_at_its_rate():
    p = 0.25
    emb = _embedding(p)
    tokens = torch.randint(0, V, (64, 256), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = embed_ref(tokens, emb.weight, scale=math.sqrt(D))
    unk = embed_ref(torch.full_like(tokens, UNK_ID), emb.weight, scale=math.sqrt(D))
    with torch.no_grad():
        out = emb.train()(tokens)
    kept = (out - ref).abs().amax(-1) < 1e-5
    dropped = (out - unk).abs().amax(-1) < 1e-5
    ordinary = tokens >= len(SPECIAL_TOKENS)
    assert bool((kept | dropped).all())  # each row is its token's embedding or <unk>'s, at its position
    assert not bool((dropped & ~kept & ~ordinary).any())  # special tokens are never dropped
    n = ordinary.sum().item()
    rate = (dropped & ordinary).sum().item() / n
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n), rate  # ~14,000 draws: 5 sigma = 0.018
    # a second forward draws another mask
    with torch.no_grad():
        again = emb(tokens)
    assert not torch.equal(again, out)
    # evaluation: the plain lookup, and no draw from torch's generator
    state = _rng_state()
    with torch.no_grad():
        torch.testing.assert_close(emb.eval()(tokens), ref, rtol=0, atol=1e-5)
    assert torch.equal(_rng_state(), state)


def test_the_first_ordinary_id_is_dropped_too():
    """Ordinary tokens start at len(SPECIAL_TOKENS) = 4: at p = 0.5 some of 200 copies of id 4 become
    <unk> (that none does has chance 2^-200)."""
    emb = _embedding(0.5)
    tokens = torch.full((1, 200), len(SPECIAL_TOKENS), device=DEVICE)
    with torch.no_grad():
        out = emb.train()(tokens)
    unk = embed_ref(torch.full_like(tokens, UNK_ID), emb.weight, scale=math.sqrt(D))
    assert bool(((out - unk).abs().amax(-1) < 1e-5).any())


def test_no_word_dropout_draws_nothing():
    emb = _embedding(0.0).train()
    tokens = torch.randint(0, V, (4, 9), device=DEVICE)
    state = _rng_state()
    with torch.no_grad():
        torch.testing.assert_close(emb(tokens), embed_ref(tokens, emb.weight, scale=math.sqrt(D)), rtol=0, atol=1e-5)
    assert torch.equal(_rng_state(), state)


def _config(kernel, layers, **kw):
    return ModelConfig(src_vocab_size=V, d_model=32, n_heads=2, n_encoder_layers=layers, n_decoder_layers=layers,
                       d_ff=64, dropout=0.0, kernel=kernel, **kw)


def _batch():
    g = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(0, V, (3, 9), generator=g), torch.randint(0, V, (3, 7), generator=g)
    src[:, -1], tgt[:, 0] = 2, 1  # an EOS and a BOS, which stay
    return [t.to(DEVICE) for t in (src, torch.tensor([9, 5, 1]), tgt, torch.tensor([7, 3, 6]))]


def _unk(tokens):
    return tokens.masked_fill(tokens >= len(SPECIAL_TOKENS), UNK_ID)


# the interpreter is slow: our kernels on a 1+1-layer model
@pytest.mark.parametrize("kernel, layers, copy", [("eager", 2, False), ("torch", 2, False), ("triton", 1, False),
                                                  ("eager", 2, True)])
def test_a_model_dropping_every_word_is_the_plain_model_fed_unk(kernel, layers, copy):
    """Word dropout at 1 (set on the layers: a config refuses it) gives the logits and gradients of
    the same weights without it, fed <unk> for every ordinary source and decoder input token; with
    the copy layer, copying from the real source ids all the same."""
    torch.manual_seed(0)
    dropping = Transformer(_config(kernel, layers, copy=copy, word_dropout=0.5), device=DEVICE).train()
    embeddings = [m for m in dropping.modules() if isinstance(m, Embedding)]
    assert len(embeddings) == 2 and all(m.word_dropout == 0.5 for m in embeddings)  # source and target
    for m in embeddings:
        m.word_dropout = 1.0
    plain = Transformer(_config(kernel, layers, copy=copy), device=DEVICE).train()
    plain.load_state_dict(dropping.state_dict())
    src, sl, tgt, tl = _batch()
    got = dropping(src, sl, tgt, tl)
    memory = plain.encode(_unk(src), sl)
    want = plain.decode(_unk(tgt), memory, sl, tl, src=src if copy else None)
    keep = (torch.arange(tgt.shape[1], device=DEVICE)[None] < tl[:, None])[..., None]
    torch.testing.assert_close(got * keep, want * keep)
    (got * keep).sum().backward()
    (want * keep).sum().backward()
    for (name, a), b in zip(dropping.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    # not the model fed the real tokens; in evaluation, exactly that model
    assert not torch.allclose(got * keep, plain(src, sl, tgt, tl) * keep)
    dropping.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(dropping(src, sl, tgt, tl), plain(src, sl, tgt, tl))


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


def test_train_with_word_dropout(tmp_path):
    """`train --word-dropout P`: recorded in config.json; another run's losses than without it; a
    run resumes exactly (the masks come from the checkpointed generators) and may not change P;
    P must be in [0, 1); R-Drop accepts it as the only dropout."""
    common = TINY + ["--dropout", "0", "--eval-every", "3", "--seed", "3", "--no-plots"]
    T.main(common + ["--word-dropout", "0.3", "--max-steps", "8", "--out", str(tmp_path / "straight")])
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["word_dropout"] == 0.3
    T.main(common + ["--word-dropout", "0.3", "--max-steps", "4", "--out", str(tmp_path / "split")])
    T.main(["--resume", "--max-steps", "8", "--out", str(tmp_path / "split"), "--no-progress", "--no-plots"])
    assert _train_rows(tmp_path / "straight") == _train_rows(tmp_path / "split")
    T.main(common + ["--max-steps", "2", "--out", str(tmp_path / "plain")])
    assert _train_rows(tmp_path / "plain")[1] != _train_rows(tmp_path / "straight")[1]
    with pytest.raises(ConfigError, match=r"--word-dropout 0.1 \(the run has 0.3\) cannot change"):
        T.main(["--resume", "--word-dropout", "0.1", "--max-steps", "9", "--out", str(tmp_path / "split")])
    with pytest.raises(ConfigError, match=r"--word-dropout must be a finite number in \[0, 1\), got 1.0"):
        T.main(common + ["--word-dropout", "1", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
    T.main(common + ["--word-dropout", "0.2", "--rdrop", "1", "--max-steps", "1", "--out", str(tmp_path / "rdrop")])
