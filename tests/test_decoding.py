"""Incremental decoding: KV cache equals full recomputation; beam search behaves."""

import pytest
import torch

from scratchformer.model import BOS_ID, EOS_ID, PAD_ID, ModelConfig, Transformer, beam_search, greedy_decode

V = 30


def _model(kernel="eager", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=V, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                      dropout=0.0, kernel=kernel, **kw)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # make EOS reachable so finishing rows are exercised
        m.generator.bias[EOS_ID] = 2.5
    return m


def _src():
    return torch.randint(4, V, (4, 8)), torch.tensor([8, 3, 1, 6])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_kv_cache_equals_full_recompute(norm):
    m = _model(norm=norm, final_norm=norm == "pre")
    src, sl = _src()
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, V, (4, 6))], 1)
    full = m(src, sl, tgt)  # (B, 7, V)
    state = m.init_state(m.encode(src, sl), sl, max_len=7)
    steps = torch.stack([m.decode_step(tgt[:, i : i + 1], state) for i in range(7)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_greedy_matches_step_by_step_argmax_of_full_model():
    m = _model()
    src, sl = _src()
    out = greedy_decode(m, src, sl, max_len=10)
    for b in range(4):
        seq = [BOS_ID]
        for t in range(out.shape[1]):
            logits = m(src[b : b + 1, : sl[b]], sl[b : b + 1], torch.tensor([seq]))[0, -1]
            logits[[PAD_ID, BOS_ID]] = float("-inf")
            nxt = int(logits.argmax())
            assert int(out[b, t]) == nxt
            if nxt == EOS_ID:
                assert (out[b, t + 1 :] == PAD_ID).all()
                break
            seq.append(nxt)


def test_beam_one_equals_greedy():
    m = _model()
    src, sl = _src()
    g = greedy_decode(m, src, sl, max_len=12)
    for lp in (0.0, 1.0):
        assert torch.equal(beam_search(m, src, sl, beam_size=1, max_len=12, length_penalty=lp), g)
    assert (g == EOS_ID).any(), "test needs at least one finished row"


def _score(m, src, sl, seq, alpha):
    tgt_in = torch.tensor([[BOS_ID] + seq[:-1]])
    logits = m(src, sl, tgt_in)[0]
    logits[:, [PAD_ID, BOS_ID]] = float("-inf")  # decoding never emits these
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(seq)), torch.tensor(seq)].sum().item() / len(seq) ** alpha


def test_beam_finds_score_at_least_greedy_and_matches_exhaustive_search():
    """On a tiny vocabulary, beam with K >= V^T is exhaustive: it must find the best sequence."""
    torch.manual_seed(1)
    cfg = ModelConfig(src_vocab_size=6, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                      dropout=0.0, kernel="eager")
    m = Transformer(cfg).eval()
    src, sl = torch.randint(4, 6, (1, 5)), torch.tensor([5])
    import itertools

    best, best_seq = float("-inf"), None
    words = [3, 4, 5]  # UNK and two ordinary tokens: everything but PAD, BOS, EOS
    for T in (1, 2, 3):  # sequences ending in EOS, or 3 tokens unfinished
        for body in itertools.product(words, repeat=T - 1):
            seq = list(body) + [EOS_ID]
            s = _score(m, src, sl, seq, 1.0)
            if s > best:
                best, best_seq = s, seq
    for body in itertools.product(words, repeat=3):
        s = _score(m, src, sl, list(body), 1.0)
        if s > best:
            best, best_seq = s, list(body)
    out = beam_search(m, src, sl, beam_size=27, max_len=3, length_penalty=1.0)[0].tolist()
    out = out[: out.index(EOS_ID) + 1] if EOS_ID in out else out
    assert out == best_seq
    g = greedy_decode(m, src, sl, max_len=3)[0].tolist()
    g = g[: g.index(EOS_ID) + 1] if EOS_ID in g else g
    assert _score(m, src, sl, g, 1.0) <= best + 1e-6


def test_beam_rows_are_independent_of_batching():
    m = _model()
    src, sl = _src()
    together = beam_search(m, src, sl, beam_size=3, max_len=10)
    for b in range(4):
        alone = beam_search(m, src[b : b + 1, : sl[b]], sl[b : b + 1], beam_size=3, max_len=10)[0]
        n = alone.shape[0]
        assert torch.equal(together[b, :n], alone) and (together[b, n:] == PAD_ID).all()


def test_decoding_errors():
    m = _model()
    src, sl = _src()
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        greedy_decode(m, src, sl, max_len=0)
    with pytest.raises(ValueError, match="beam_size must be >= 1"):
        beam_search(m, src, sl, beam_size=0, max_len=5)
