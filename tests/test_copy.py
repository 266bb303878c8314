"""The pointer-generator output layer (`--copy`): its distribution against the formula written out
term by term, normalisation and gradients, what it refuses, and that it copies tokens the decoder
never learnt to generate."""

import math

import pytest
import torch

from scratchformer.model import BOS_ID, EOS_ID, PAD_ID, ModelConfig, Transformer, beam_search, greedy_decode
from scratchformer.model.copy import PointerGenerator
from scratchformer.training.config import ConfigError, TrainConfig, check_config
from scratchformer.training.launch import check_for_task

V, d = 12, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, Lt, Ls = 3, 4, 5
    h = torch.randn(B, Lt, d, generator=g)
    logits = torch.randn(B, Lt, V, generator=g) * 2
    memory = torch.randn(B, Ls, d, generator=g)
    src = torch.tensor([[5, 7, 5, 9, 11], [3, 3, 3, 6, 0], [8, 0, 0, 0, 0]])  # repeats; row 2: empty source
    src_lengths = torch.tensor([5, 4, 0])
    return h, logits, memory, src, src_lengths


def test_matches_the_formula_term_by_term():
    """p(w) = p_gen softmax(logits)(w) + (1 - p_gen) sum_{j < len, src_j = w} a_j, in float64 loops."""
    torch.manual_seed(0)
    pg = PointerGenerator(d)
    h, logits, memory, src, src_lengths = _inputs()
    out = pg(h, logits, memory, pg.source(memory, src, src_lengths))
    W = {n: p.detach().double() for n, p in pg.named_parameters()}
    for b in range(3):
        n = int(src_lengths[b])
        for t in range(4):
            q = W["q_proj.weight"] @ h[b, t].double() + W["q_proj.bias"]
            keys = [W["k_proj.weight"] @ memory[b, j].double() + W["k_proj.bias"] for j in range(n)]
            scores = torch.stack([q @ k / math.sqrt(d) for k in keys]) if n else torch.zeros(0, dtype=torch.float64)
            a = torch.softmax(scores, 0)
            context = sum((a[j] * memory[b, j].double() for j in range(n)), torch.zeros(d, dtype=torch.float64))
            z = W["gate.weight"][0] @ torch.cat([h[b, t].double(), context]) + W["gate.bias"][0]
            p_gen = torch.sigmoid(z) if n else torch.tensor(1.0, dtype=torch.float64)
            p = p_gen * torch.softmax(logits[b, t].double(), 0)
            for j in range(n):
                p[src[b, j]] += (1 - p_gen) * a[j]
            torch.testing.assert_close(out[b, t].double(), p.log(), rtol=1e-5, atol=1e-5)


def test_a_normalised_distribution_with_finite_gradients():
    torch.manual_seed(0)
    pg = PointerGenerator(d)
    h, logits, memory, src, src_lengths = _inputs(1)
    h.requires_grad_(True)
    logits.requires_grad_(True)
    memory.requires_grad_(True)
    out = pg(h, logits, memory, pg.source(memory, src, src_lengths))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.logsumexp(-1), torch.zeros(3, 4), atol=1e-5, rtol=0)
    # the targets include tokens absent from every source (probability 0 under the copy part)
    target = torch.tensor([[1, 2, 5, 4], [10, 3, 1, 2], [8, 1, 2, 4]])
    (-out.gather(-1, target[..., None])).sum().backward()
    for name, g in [("h", h.grad), ("logits", logits.grad), ("memory", memory.grad)] + [
            (n, p.grad) for n, p in pg.named_parameters()]:
        assert g is not None and torch.isfinite(g).all(), name
        assert g.abs().sum() > 0, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_keeps_it_in_fp32_with_finite_gradients(dtype):
    """Under fp16 autocast (--precision fp16) with a padded source row the gradients are finite and the
    output is the fp32 layer's: autocast ran the layer's matmuls in fp16, where the floor on the copy
    probabilities rounded to 0, and log 0 at the padded positions made every gradient NaN."""
    torch.manual_seed(0)
    pg = PointerGenerator(d)
    h, logits, memory, src, src_lengths = _inputs(2)
    target = torch.tensor([[1, 2, 5, 4], [10, 3, 1, 2], [8, 1, 2, 4]])
    ref = pg(h, logits, memory, pg.source(memory, src, src_lengths))
    with torch.autocast("cpu", dtype=dtype):
        out = pg(h, logits, memory, pg.source(memory, src, src_lengths))
        (-out.gather(-1, target[..., None])).sum().backward()
    assert out.dtype == torch.float32
    tol = dict(atol=2e-2, rtol=2e-2)  # the keys come from autocast's k_proj, in `dtype`
    torch.testing.assert_close(out, ref, **tol)
    for name, p in pg.named_parameters():
        assert torch.isfinite(p.grad).all(), name


def _model(copy=True, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=V, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                      dropout=0.0, kernel="eager", copy=copy, **kw)
    return Transformer(cfg).eval()


def test_what_it_refuses():
    with pytest.raises(ValueError, match="one vocabulary for source and target.*src_vocab_size 12 != tgt_vocab_size 9"):
        ModelConfig(src_vocab_size=V, tgt_vocab_size=9, copy=True)
    with pytest.raises(ValueError, match="copy needs an encoder-decoder model.*an encoder-only model"):
        ModelConfig(src_vocab_size=V, n_decoder_layers=0, num_classes=2, copy=True)
    with pytest.raises(ValueError, match="copy needs an encoder-decoder model.*an encoder-only model"):
        ModelConfig(src_vocab_size=V, n_decoder_layers=0, extractive=True, copy=True)
    m = _model()
    src, sl = torch.randint(4, V, (2, 5)), torch.tensor([5, 2])
    memory = m.encode(src, sl)
    tgt = torch.randint(4, V, (2, 3))
    with pytest.raises(ValueError, match="decode needs src=, the source ids"):
        m.decode(tgt, memory, sl)
    with pytest.raises(ValueError, match="init_state needs src="):
        m.init_state(memory, sl, 4)
    torch.testing.assert_close(m.decode(tgt, memory, sl, src=src), m(src, sl, tgt))
    # the loss's targets are checked as linear_cross_entropy checks them (the copy path skipped it: an int32
    # target or a smoothing of 1.5 or NaN gave a loss, an id of V an IndexError deep inside)
    for target, ls, message in [(tgt.int(), 0.0, r"target must be int64 of shape \(6,\), got torch.int32"),
                                (torch.full_like(tgt, V), 0.0, rf"target ids must lie in \[0, {V}\), got min {V}"),
                                (tgt, 1.5, r"label_smoothing must be in \[0, 1\)"),
                                (tgt, float("nan"), r"label_smoothing must be in \[0, 1\) .* got nan")]:
        with pytest.raises(ValueError, match=r"forward\(target=\): " + message):
            m(src, sl, tgt, target=target, label_smoothing=ls)
    with pytest.raises(ConfigError, match="--copy .* shared vocabulary \\(drop --separate-vocab\\)"):
        check_config(TrainConfig(copy=True, separate_vocab=True))
    with pytest.raises(ConfigError, match="--copy is for sequence-to-sequence tasks"):
        check_for_task(TrainConfig(copy=True), "classification")


def test_a_decoding_call_reads_its_sources_tables_built_once_and_moved_with_their_rows(monkeypatch):
    """What the copy layer reads of a source besides its encoder output (keys, which positions hold
    the same id, which is its first) is built once a decoding call, not once a step; a reorder
    that moves rows across sources moves those tables with them: the next step's log-probabilities
    are those of a state built from the reordered sources."""
    m = _model()
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, 8, (4, 7), generator=g)  # 4 ids over 7 positions: repeats in every row
    sl = torch.tensor([7, 5, 3, 1])
    built = []
    source = PointerGenerator.source
    monkeypatch.setattr(PointerGenerator, "source", lambda self, *a: built.append(a[1].shape) or source(self, *a))
    with torch.no_grad():
        beam_search(m, src, sl, beam_size=3, max_len=6, eos_id=-1)
        greedy_decode(m, src, sl, max_len=6, eos_id=-1)
        assert built == [src.shape, src.shape]  # one a call, for the sources (not the beams)

        memory, perm = m.encode(src, sl), torch.tensor([2, 0, 3, 1])
        tokens = torch.randint(4, V, (2, 4, 1), generator=g)
        state = m.init_state(memory, sl, 2, src=src)
        moved = m.init_state(memory[perm], sl[perm], 2, src=src[perm])
        m.decode_step(tokens[0], state)
        m.decode_step(tokens[0][perm], moved)
        state.reorder(perm)
        torch.testing.assert_close(m.decode_step(tokens[1], state), m.decode_step(tokens[1], moved))


def test_lengths_none_is_a_source_without_padding_as_for_the_model_without_copy():
    """Transformer.forward takes src_lengths None for unpadded sources; with the copy layer it was a
    TypeError (None[:, None]): the logits and the loss are those of full lengths."""
    torch.manual_seed(0)
    m = _model(copy=True).eval()
    src, tgt = torch.randint(4, V, (2, 5)), torch.randint(4, V, (2, 3))
    full = torch.full((2,), 5)
    torch.testing.assert_close(m(src, None, tgt), m(src, full, tgt), rtol=0, atol=0)
    target = torch.randint(4, V, (2, 3))
    torch.testing.assert_close(m(src, None, tgt, target=target), m(src, full, tgt, target=target), rtol=0, atol=0)


def test_copies_tokens_it_was_never_trained_to_emit():
    """Trained to echo the first 3 tokens of sources whose echoed part is drawn from tokens 4-7 (8-11
    only as 2 trailing distractors), a copy model starts its echo of sources made of tokens 8-11,
    which it never emitted in training; the same model without the copy layer cannot. (Only the
    first token is asserted: the decoder has never read 8-11 as its own input, so what follows is
    beyond both.)"""
    def batch(echoed, distractors, n=32):
        head = torch.randint(*echoed, (n, 3))
        src = torch.cat([head, torch.randint(*distractors, (n, 2))], 1)
        bos = torch.full((n, 1), BOS_ID)
        return src, torch.full((n,), 5), torch.cat([bos, head], 1), torch.cat([head, torch.full((n, 1), EOS_ID)], 1)

    first = {}
    for copy in (True, False):
        m = _model(copy=copy).train()
        opt = torch.optim.Adam(m.parameters(), lr=3e-3)
        torch.manual_seed(1)
        for _ in range(200):
            src, sl, tgt_in, tgt_out = batch((4, 8), (8, 12))
            logp = torch.log_softmax(m(src, sl, tgt_in), -1)
            loss = torch.nn.functional.nll_loss(logp.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID)
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.eval()
        src, sl, _, _ = batch((8, 12), (4, 8), n=64)
        first[copy] = (greedy_decode(m, src, sl, max_len=4)[:, 0] == src[:, 0]).float().mean().item()
    assert first[True] > 0.7 and first[False] == 0.0, first
