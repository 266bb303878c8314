"""Incremental decoding: KV cache equals full recomputation; beam search behaves."""

import functools
import itertools
import math

import pytest
import torch
from conftest import Dispatched

from scratchformer import graphs, ops
from scratchformer.model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ModelConfig,
    StaticKVCache,
    Transformer,
    beam_search,
    beam_search_nbest,
    decoding,
    greedy_decode,
    sample_decode,
    transformer,
    weight_cast,
)

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


@pytest.mark.parametrize("norm,copy", [("post", False), ("pre", False), ("post", True)])
def test_kv_cache_equals_full_recompute(norm, copy):
    m = _model(norm=norm, final_norm=norm == "pre", copy=copy)
    src, sl = _src()
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, V, (4, 6))], 1)
    full = m(src, sl, tgt)  # (B, 7, V)
    state = m.init_state(m.encode(src, sl), sl, max_len=7, src=src)
    steps = torch.stack([m.decode_step(tgt[:, i : i + 1], state) for i in range(7)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm,copy,amp", [("post", False, False), ("pre", True, False), ("post", False, True)])
def test_static_cache_steps_equal_the_growing_cache(norm, copy, amp):
    """init_state(static=True), what a CUDA graph of the step needs (fixed-size caches read whole,
    masked by the device-side position; beams reordered in place), decodes as the growing cache
    does, step by step and after reordering rows; under bf16 autocast too (the keys and values
    come in bf16, the caches' dtype)."""
    m = _model(norm=norm, final_norm=norm == "pre", copy=copy)
    src, sl = _src()
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, V, (4, 6))], 1)
    order = torch.tensor([2, 2, 0, 1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        memory = m.encode(src, sl)
        grow = m.init_state(memory, sl, max_len=7, src=src)
        static = m.init_state(memory, sl, max_len=7, src=src, static=True)
        assert isinstance(static.caches[0][0], StaticKVCache) and static.pos.device == memory.device
        for i in range(7):
            if i == 3:  # beam search's reorder, which keeps each row's source
                grow.reorder(order, same_sources=True)
                static.reorder(order, same_sources=True)
            # the position term is added apart from the embedding kernel: a rounding's difference
            torch.testing.assert_close(m.decode_step(tgt[:, i : i + 1], static), m.decode_step(tgt[:, i : i + 1], grow),
                                       atol=1e-5, rtol=1e-5, msg=f"step {i}")
        assert int(static.pos) == grow.pos == 7
        with pytest.raises(ValueError, match="one step at a time"):
            m.decode_step(tgt[:, :2], m.init_state(memory, sl, max_len=7, src=src, static=True))


@pytest.mark.parametrize("beam,no_repeat,min_len", [(1, 0, 0), (3, 0, 0), (3, 2, 2)])
def test_searches_over_static_caches_equal_the_growing_cache(monkeypatch, beam, no_repeat, min_len):
    """Greedy and beam search over static caches (cuda_graph=True without the graph, which needs
    CUDA: tests/test_cuda_graph.py replays it) decode the same tokens."""
    m = _model(copy=beam == 3)
    src, sl = _src()
    kw = dict(max_len=12, no_repeat_ngram=no_repeat, min_len=min_len)

    def decode():
        return (greedy_decode(m, src, sl, **kw) if beam == 1 else beam_search(m, src, sl, beam_size=beam, **kw))

    ref = decode()
    init_state = m.init_state
    monkeypatch.setattr(m, "init_state", lambda *a, static=False, **k: init_state(*a, static=True, **k))
    assert torch.equal(decode(), ref)


@pytest.mark.parametrize("beam", [1, 3, "sample"])
def test_graph_replays_around_the_search_decode_as_launched_steps(monkeypatch, beam):
    """The search around a captured step (its token input copied in, its one logits buffer edited
    in place by the search and rewritten by the next replay, the position rewound after the
    warm-up and the capture) decodes what launched steps decode. The CUDA graph is stood in for
    by what a capture and a replay do to those buffers (the capture's call runs here, its effects
    are rewritten as the warm-up's are); tests/test_cuda_graph.py replays real ones on a GPU.
    The replayed steps read static caches (a graph replays on the buffers it captured: a growing
    cache would not grow), though the model is not compiled (`static_caches` off)."""

    def fake_capture(fn, warmup=1):
        for _ in range(warmup):
            fn()
        out = fn()
        return out, lambda: out.copy_(fn())

    m = _model(copy=beam == 3)
    src, sl = _src()
    kw = dict(max_len=12, no_repeat_ngram=2, min_len=2)
    search = {1: lambda: greedy_decode(m, src, sl, **kw),
              3: lambda: beam_search(m, src, sl, beam_size=beam, **kw),
              "sample": lambda: sample_decode(m, src, sl, n=3, temperature=1.5, **kw)[0]}[beam]
    ref = search()
    monkeypatch.setattr(decoding, "_use_graphs", lambda cuda_graph, device, compiled: True)
    monkeypatch.setattr(graphs, "capture", fake_capture)
    statics, init_state = [], m.init_state

    def init_static(*args, static=False, **kwargs):
        statics.append(static)
        return init_state(*args, static=static, **kwargs)

    monkeypatch.setattr(m, "init_state", init_static)
    assert torch.equal(search(), ref)
    assert statics == [True] and not m.static_caches


def test_a_failed_capture_falls_back_to_launched_steps(monkeypatch):
    """Auto mode (cuda_graph=None) on a GPU: a capture that raises warns once and the search goes
    on with launched steps over the static caches, decoding what it would have; cuda_graph=True
    raises it instead. (Here on the CPU, with the device's choice and the capture stood in for.)"""
    def capture(*a):
        raise RuntimeError("operation not permitted when stream is capturing")

    m = _model()
    src, sl = _src()
    ref = greedy_decode(m, src, sl, max_len=10)
    monkeypatch.setattr(decoding, "_use_graphs", lambda cuda_graph, device, compiled: True)
    monkeypatch.setattr(decoding, "_graph_step", capture)
    monkeypatch.setattr(decoding, "_CAPTURE_WARNED", False)
    with pytest.warns(RuntimeWarning, match="CUDA graph failed .*not permitted.*; launching each step"):
        assert torch.equal(greedy_decode(m, src, sl, max_len=10), ref)
    assert torch.equal(beam_search(m, src, sl, beam_size=1, max_len=10), ref)  # warned once only
    monkeypatch.setattr(decoding, "_check", lambda *a, **k: 1)  # past the CPU's device check
    with pytest.raises(RuntimeError, match="not permitted"):
        greedy_decode(m, src, sl, max_len=10, cuda_graph=True)


def test_a_capture_that_fails_after_its_warm_up_decodes_from_the_first_position(monkeypatch):
    """A capture that fails at its end, after its warm-up ran a step (which moved the static caches'
    position on): the launched steps the search falls back to start from position 0 again, and
    decode what they would have. (The CUDA graph stood in for on the CPU, as above.)"""

    def capture(fn, warmup=1):
        for _ in range(warmup):
            fn()
        raise RuntimeError("operation failed due to a previous error during capture")

    m = _model()
    src, sl = _src()
    ref = greedy_decode(m, src, sl, max_len=12, no_repeat_ngram=2, min_len=2)
    monkeypatch.setattr(decoding, "_use_graphs", lambda cuda_graph, device, compiled: True)
    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(decoding, "_CAPTURE_WARNED", True)  # warned before: the search goes on silently
    assert torch.equal(greedy_decode(m, src, sl, max_len=12, no_repeat_ngram=2, min_len=2), ref)


def _assert_stepwise_argmax(m, src, sl, out, min_len=0):
    """Each row of greedy output `out` is the full model's argmax, step by step, over all tokens but
    PAD and BOS (and EOS for the first min_len steps), and holds only PAD after its EOS."""
    for b in range(src.shape[0]):
        seq = [BOS_ID]
        for t in range(out.shape[1]):
            logits = m(src[b : b + 1, : sl[b]], sl[b : b + 1], torch.tensor([seq]))[0, -1]
            logits[[PAD_ID, BOS_ID] + ([EOS_ID] if t < min_len else [])] = float("-inf")
            nxt = int(logits.argmax())
            assert int(out[b, t]) == nxt, (b, t)
            if nxt == EOS_ID:
                assert (out[b, t + 1 :] == PAD_ID).all()
                break
            seq.append(nxt)


def test_greedy_matches_step_by_step_argmax_of_full_model():
    m = _model()
    src, sl = _src()
    _assert_stepwise_argmax(m, src, sl, greedy_decode(m, src, sl, max_len=10))


@pytest.mark.parametrize("copy", [False, True])
def test_beam_one_equals_greedy(copy):
    m = _model(copy=copy)
    src, sl = _src()
    g = greedy_decode(m, src, sl, max_len=12)
    for lp in (0.0, 1.0):
        assert torch.equal(beam_search(m, src, sl, beam_size=1, max_len=12, length_penalty=lp), g)
    assert (g == EOS_ID).any(), "test needs at least one finished row"


def _repeats(seq, n) -> bool:
    """Whether seq holds an n-gram twice (never, for n = 0: blocking off)."""
    grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)] if n else []
    return len(set(grams)) < len(grams)


def _score(m, src, sl, seq, alpha):
    tgt_in = torch.tensor([[BOS_ID] + seq[:-1]])
    logits = m(src, sl, tgt_in)[0]
    logits[:, [PAD_ID, BOS_ID]] = float("-inf")  # decoding never emits these
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(seq)), torch.tensor(seq)].sum().item() / len(seq) ** alpha


@pytest.mark.parametrize("no_repeat,min_len", [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (1, 2), (0, 3)])
def test_beam_finds_score_at_least_greedy_and_matches_exhaustive_search(no_repeat, min_len):
    """On a tiny vocabulary, beam with K >= V^T is exhaustive: it must find the best sequence (with
    no_repeat_ngram n: the best of those that repeat no n-gram; with min_len m: of those with at least
    m tokens before their EOS, scored by the model's own log-probabilities)."""
    torch.manual_seed(1)
    cfg = ModelConfig(src_vocab_size=6, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                      dropout=0.0, kernel="eager")
    m = Transformer(cfg).eval()
    src, sl = torch.randint(4, 6, (1, 5)), torch.tensor([5])
    best, best_seq = float("-inf"), None
    words = [3, 4, 5]  # UNK and two ordinary tokens: everything but PAD, BOS, EOS
    for T in range(min_len + 1, 4):  # sequences ending in EOS, or 3 tokens unfinished
        for body in itertools.product(words, repeat=T - 1):
            seq = list(body) + [EOS_ID]
            if _repeats(seq, no_repeat):
                continue
            s = _score(m, src, sl, seq, 1.0)
            if s > best:
                best, best_seq = s, seq
    for body in itertools.product(words, repeat=3):
        if _repeats(list(body), no_repeat):
            continue
        s = _score(m, src, sl, list(body), 1.0)
        if s > best:
            best, best_seq = s, list(body)
    kw = dict(max_len=3, no_repeat_ngram=no_repeat, min_len=min_len)
    out = beam_search(m, src, sl, beam_size=27, length_penalty=1.0, **kw)[0].tolist()
    out = out[: out.index(EOS_ID) + 1] if EOS_ID in out else out
    assert out == best_seq
    g = greedy_decode(m, src, sl, **kw)[0].tolist()
    g = g[: g.index(EOS_ID) + 1] if EOS_ID in g else g
    assert EOS_ID not in g[:min_len] and _score(m, src, sl, g, 1.0) <= best + 1e-6


@pytest.mark.parametrize("kernel,kind", [("eager", "tied"), ("eager", "copy"), ("torch", "tied"), ("torch", "static"),
                                         ("triton", "tied")])
def test_a_sources_hypotheses_read_its_encoder_side_once(kernel, kind, monkeypatch):
    """init_state(beams=K) keeps the encoder side once a source: its cross-attention K/V (and the
    copy layer's keys and id tables) computed for B rows, not B·K, and held so (memory, lengths, caches), while
    the self-attention caches hold B·K rows; each step the K hypotheses of a source attend to its
    keys and values as one row of K queries. Every step's logits are those of the sources repeated
    K times (each row with copies of its own, as before), through reorders within the sources."""
    from conftest import DEVICE, step_model

    m = step_model(kernel, DEVICE, dropout=0.0, copy=kind == "copy").eval()  # head dim 16: triton's smallest
    vocab, K, steps = m.cfg.tgt_vocab_size, 3, 4
    tol = dict(atol=1e-5, rtol=1e-5) if DEVICE == "cpu" else dict(atol=1e-4, rtol=1e-4)  # cuBLAS, SDPA: other sums
    src, sl = (t.to(DEVICE) for t in _src())
    seen = []
    project = transformer.project_memory  # every layer's K/V in one matmul
    monkeypatch.setattr(transformer, "project_memory", lambda layers, mem: seen.append(mem.shape[0]) or
                        project(layers, mem))
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(4, vocab, (4 * K, 1), generator=g).to(DEVICE) for _ in range(steps)]
    orders = [(torch.arange(4)[:, None] * K + torch.randint(0, K, (4, K), generator=g)).view(-1).to(DEVICE)
              for _ in range(steps)]
    with torch.no_grad():
        memory, static = m.encode(src, sl), kind == "static"
        shared = m.init_state(memory, sl, steps, src=src, static=static, beams=K)
        rep = [t.repeat_interleave(K, 0) for t in (memory, sl, src)]
        repeated = m.init_state(*rep[:2], steps, src=rep[2], static=static)
        assert seen == [4, 4 * K]
        assert shared.self_kv.shape[1] == 4 * K and {c.kv.shape[0] for _, c in shared.caches} == {4}
        assert shared.memory.shape[0] == shared.src_lengths.shape[0] == 4
        if kind == "copy":
            assert {t.shape[0] for t in shared.copy_source} == {4}
        for t in range(steps):
            torch.testing.assert_close(m.decode_step(tokens[t], shared), m.decode_step(tokens[t], repeated), **tol)
            for state in (shared, repeated):
                state.reorder(orders[t], same_sources=True, filled=t + 1)
    with pytest.raises(ValueError, match="same_sources=True"):
        shared.reorder(orders[0])
    with torch.no_grad():  # the cross-attention weights too, one row of them a hypothesis
        shared, repeated = m.init_state(memory, sl, 1, src=src, beams=K), m.init_state(*rep[:2], 1, src=rep[2])
        a, b = (m.decode(tokens[0], s.memory, s.src_lengths, state=s, need_weights=True) for s in (shared, repeated))
    torch.testing.assert_close(a, b, **tol)
    with pytest.raises(ValueError, match="no tgt_lengths with a state of 3 rows per source"):
        m.decode(tokens[0], shared.memory, shared.src_lengths, torch.ones(4 * K, dtype=torch.long, device=DEVICE),
                 state=shared)


@pytest.mark.parametrize("copy", [False, True])
def test_beam_rows_are_independent_of_batching(copy):
    m = _model(copy=copy)
    src, sl = _src()
    together = beam_search(m, src, sl, beam_size=3, max_len=10)
    for b in range(4):
        alone = beam_search(m, src[b : b + 1, : sl[b]], sl[b : b + 1], beam_size=3, max_len=10)[0]
        n = alone.shape[0]
        assert torch.equal(together[b, :n], alone) and (together[b, n:] == PAD_ID).all()


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("eos_bias", [2.5, -20.0])
def test_each_rows_own_cap_decodes_as_that_row_alone(beam, eos_bias):
    """max_len as a (B,) tensor: each row decodes as it does alone under its own int cap (greedy ends
    the row there; beam search closes the sentence there with its unfinished beams). eos_bias -20:
    no row ends by itself, so every row runs exactly to its cap."""
    m = _model()
    with torch.no_grad():
        m.generator.bias[EOS_ID] = eos_bias
    src, sl = _src()
    caps = torch.tensor([3, 7, 1, 5])
    search = greedy_decode if beam == 1 else functools.partial(beam_search, beam_size=beam)
    together = search(m, src, sl, max_len=caps)
    for b in range(4):
        alone = search(m, src[b : b + 1, : sl[b]], sl[b : b + 1], max_len=int(caps[b]))[0]
        n = alone.shape[0]
        assert torch.equal(together[b, :n], alone) and (together[b, n:] == PAD_ID).all(), (b, together, alone)
        if eos_bias < 0:
            assert n == caps[b] and (alone != PAD_ID).all()
    assert together.shape[1] <= int(caps.max())


@pytest.mark.parametrize("beam", [1, 2])
def test_rules_that_leave_no_token_let_eos_through(beam):
    """V = 6 leaves three tokens besides PAD, BOS and EOS: with no unigram twice and EOS barred for 5
    steps, the fourth step allows nothing. The row then ends (EOS) instead of taking PAD (the argmax
    of an all -inf row) or a -inf hypothesis."""
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=6, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                      dropout=0.0, kernel="eager")
    m = Transformer(cfg).eval()
    src, sl = torch.tensor([[4, 5, 3]]), torch.tensor([3])
    kw = dict(max_len=6, no_repeat_ngram=1, min_len=5)
    out = (greedy_decode(m, src, sl, **kw) if beam == 1 else beam_search(m, src, sl, beam_size=beam, **kw))[0]
    assert sorted(out[:3].tolist()) == [3, 4, 5] and out[3] == EOS_ID and (out[4:] == PAD_ID).all(), out


def test_decoding_errors():
    m = _model()
    src, sl = _src()
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        greedy_decode(m, src, sl, max_len=0)
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        beam_search(m, src, sl, beam_size=2, max_len=4.0)
    for bad in (torch.tensor([3, 4]), torch.tensor([3.0, 4.0, 5.0, 6.0]), torch.tensor([[3, 4, 5, 6]])):
        with pytest.raises(ValueError, match=r"max_len as a tensor holds each row's cap: \(B,\) = \(4,\) integers"):
            greedy_decode(m, src, sl, max_len=bad)
    with pytest.raises(ValueError, match=r"max_len must be >= 1 in every row, got \[3, 0, 5, 6\]"):
        beam_search(m, src, sl, beam_size=2, max_len=torch.tensor([3, 0, 5, 6]))
    for search in (greedy_decode, beam_search):  # a list, not a tensor: named, not an AttributeError inside
        with pytest.raises(ValueError, match="src_lengths must be a tensor, got list"):
            search(m, src, sl.tolist(), max_len=5)
        with pytest.raises(ValueError, match="src must be a tensor, got list"):
            search(m, src.tolist(), sl, max_len=5)
    with pytest.raises(ValueError, match="beam_size must be an int >= 1"):
        beam_search(m, src, sl, beam_size=0, max_len=5)
    with pytest.raises(ValueError, match="no_repeat_ngram must be an int >= 0"):
        beam_search(m, src, sl, beam_size=2, max_len=5, no_repeat_ngram=-1)
    with pytest.raises(ValueError, match="min_len must be an int >= 0"):
        greedy_decode(m, src, sl, max_len=5, min_len=-1)
    for search in (greedy_decode, beam_search):  # a step's position is its index: as forward's targets
        over = m.cfg.max_len + 1
        with pytest.raises(ValueError, match=rf"max_len {over} is over the model's max_len {m.cfg.max_len}"):
            search(m, src, sl, max_len=over)
    with pytest.raises(ValueError, match="cuda_graph=True .* needs CUDA tensors, src is on cpu"):
        greedy_decode(m, src, sl, max_len=5, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True .* needs CUDA tensors, src is on cpu"):
        beam_search(m, src, sl, beam_size=2, max_len=5, cuda_graph=True)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="check_every must be an int >= 1"):
            greedy_decode(m, src, sl, max_len=5, check_every=bad)
        with pytest.raises(ValueError, match="check_every must be an int >= 1"):
            beam_search(m, src, sl, beam_size=2, max_len=5, check_every=bad)


@pytest.mark.parametrize("name", ["beam_size", "no_repeat_ngram", "min_len"])
@pytest.mark.parametrize("bad", [2.5, True, "2"])
def test_decoding_refuses_counts_that_are_not_ints(name, bad):
    """A float beam_size or no_repeat_ngram was a TypeError deep in torch (torch.empty, unfold); a bool
    or a float min_len went through."""
    m = _model()
    src, sl = _src()
    with pytest.raises(ValueError, match=rf"{name} must be an int >= \d.*, got {bad!r}"):
        beam_search(m, src, sl, max_len=5, **{name: bad})


def test_decoding_refuses_a_min_len_over_max_len_and_ids_outside_the_vocabulary():
    """min_len > max_len decoded max_len tokens and no EOS (the command line refuses it); an eos_id past
    the vocabulary decoded as if nothing could end, a bos_id there failed only as a bad token in tgt."""
    m = _model()
    src, sl = _src()
    for search in (greedy_decode, beam_search):
        with pytest.raises(ValueError, match="min_len 6 exceeds max_len 5, the longest output"):
            search(m, src, sl, max_len=5, min_len=6)
        assert search(m, src, sl, max_len=5, min_len=5).shape == (4, 5)  # no row ends: allowed, as documented
        caps = torch.tensor([3, 6, 2, 5])  # each row's own: one below min_len ends at its cap, as alone
        assert ((search(m, src, sl, max_len=caps, min_len=7) != PAD_ID).sum(1) == caps).all()
        for name, bad in (("eos_id", V), ("eos_id", -2), ("bos_id", V + 5), ("pad_id", -1), ("eos_id", True),
                          ("bos_id", 1.0)):
            with pytest.raises(ValueError, match=rf"{name} must be a token id of the model's target vocabulary, an "
                                                 rf"int in \[0, {V}\).*got {bad!r}"):
                search(m, src, sl, max_len=5, **{name: bad})


def test_decoding_refuses_an_eos_id_that_is_the_bos_or_pad_id():
    """BOS and PAD are never generated: an eos_id equal to either (fairseq starts its decoder from EOS)
    decoded every row to max_len without a word."""
    m = _model()
    src, sl = _src()
    for search in (greedy_decode, beam_search, sample_decode):
        for name in ("bos_id", "pad_id"):
            with pytest.raises(ValueError, match=rf"eos_id {EOS_ID} is also the {name}, a token never generated"):
                search(m, src, sl, max_len=5, **{name: EOS_ID})


@pytest.mark.parametrize("search", [greedy_decode, functools.partial(beam_search, beam_size=2)])
def test_decoding_may_take_every_position_the_model_has(search):
    """A model of max_len 6 has positions 0..5: decoding max_len 6 runs all 6 steps (eos_id -1: no
    row ends sooner); 7 is refused (test_decoding_errors)."""
    m = _model(max_len=6)
    src, sl = _src()
    assert search(m, src[:, :6], sl.clamp(max=6), max_len=6, eos_id=-1).shape == (4, 6)


@pytest.mark.parametrize("search", [greedy_decode, functools.partial(beam_search, beam_size=2)])
def test_eos_id_minus_one_never_ends_an_output_and_min_len_bars_nothing(search):
    """eos_id=-1 (bench/host_overhead.py, test_copy.py): every row runs to max_len. min_len barred
    index -1 then, the vocabulary's last token, which the model favours here."""
    m = _model()
    with torch.no_grad():
        m.generator.bias[V - 1] = 4.0
    src, sl = _src()
    free = search(m, src, sl, max_len=6, eos_id=-1)
    assert free.shape == (4, 6) and (free == V - 1).any()
    assert torch.equal(search(m, src, sl, max_len=6, eos_id=-1, min_len=4), free)


@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
@pytest.mark.parametrize("copy", [False, True])
def test_an_empty_batch_gives_empty_results(kernel, copy):
    """B = 0 crashed forward, greedy and beam search in the cross-attention's view(B, -1, ...) (which 0
    elements leave open), while encode and the ops take it: now (0, Lt, V) logits, weights (0, H, Lt, Ls),
    a zero loss with gradients, and (0, 1) outputs (at least one column, as `_trim` keeps)."""
    from conftest import DEVICE, step_model

    m = step_model(kernel, DEVICE, dropout=0.0, copy=copy).eval()  # head dim 16: triton's smallest
    V_, H = m.cfg.tgt_vocab_size, m.cfg.n_heads
    src, tgt = (torch.zeros(0, L, dtype=torch.long, device=DEVICE) for L in (6, 5))
    sl = tl = torch.zeros(0, dtype=torch.long, device=DEVICE)
    logits, weights = m(src, sl, tgt, tl, need_weights=True)
    assert logits.shape == (0, 5, V_) and [w.shape for w in weights] == [(0, H, 5, 6)] * m.cfg.n_decoder_layers
    m.train()
    loss, nll = m(src, sl, tgt, tl, target=tgt)
    loss.backward()
    assert loss.item() == nll.item() == 0.0 and all(p.grad is not None for p in m.decoder.parameters())
    m.eval()
    caps = torch.zeros(0, dtype=torch.long, device=DEVICE)
    for search in (greedy_decode, functools.partial(beam_search, beam_size=3)):
        for max_len in (5, caps):
            assert search(m, src, sl, max_len=max_len, min_len=2, no_repeat_ngram=2).shape == (0, 1)


@pytest.mark.parametrize("beam,no_repeat,min_len", [(1, 0, 0), (3, 0, 0), (1, 2, 2), (3, 2, 2)])
def test_stop_check_interval_changes_only_the_number_of_steps(beam, no_repeat, min_len):
    """Checking for the end every c steps (fewer host syncs on a GPU) decodes the same tokens as
    checking every step; rows finished early are decoded on for up to c-1 steps and trimmed."""
    m = _model()
    src, sl = _src()
    steps = []
    decode_step = m.decode_step
    m.decode_step = lambda *a: (steps.append(1), decode_step(*a))[1]
    kw = dict(max_len=20, no_repeat_ngram=no_repeat, min_len=min_len)

    def decode(c):
        steps.clear()
        out = (greedy_decode(m, src, sl, check_every=c, **kw) if beam == 1
               else beam_search(m, src, sl, beam_size=beam, check_every=c, **kw))
        return out, len(steps)

    ref, ref_steps = decode(1)
    assert ref_steps < kw["max_len"] and (ref == EOS_ID).any(1).all(), "test needs every row to finish early"
    out, n = decode(None)  # the CPU default: every step
    assert torch.equal(out, ref) and n == ref_steps
    for c in (2, 3, 8, 64):
        out, n = decode(c)
        assert torch.equal(out, ref), c
        assert n == min(-(-ref_steps // c) * c, kw["max_len"]), (c, n, ref_steps)


def _eos_at(row) -> int:
    return row.index(EOS_ID) if EOS_ID in row else len(row)


@pytest.mark.parametrize("copy", [False, True])
def test_min_len_greedy_matches_a_step_by_step_reference(copy):
    """With min_len m, greedy is the full model's argmax with EOS ruled out for the first m tokens;
    the model used finishes most rows sooner without it."""
    m = _model(copy=copy)
    with torch.no_grad():
        m.generator.bias[EOS_ID] = 6.0
    src, sl = _src()
    free = greedy_decode(m, src, sl, max_len=12).tolist()
    assert sum(_eos_at(r) < 4 for r in free) >= 2, "test needs rows that finish early"
    out = greedy_decode(m, src, sl, max_len=12, min_len=4)
    _assert_stepwise_argmax(m, src, sl, out, min_len=4)
    assert all(_eos_at(r) >= 4 for r in out.tolist())


def test_min_len_beam():
    """Beam search with min_len: no hypothesis ends before it, beam 1 is greedy with it, min_len >=
    max_len finishes no row, and a row decodes the same alone as in a batch."""
    m = _model()
    with torch.no_grad():
        m.generator.bias[EOS_ID] = 6.0
    src, sl = _src()
    assert min(_eos_at(r) for r in beam_search(m, src, sl, beam_size=3, max_len=12).tolist()) < 4
    out = beam_search(m, src, sl, beam_size=3, max_len=12, min_len=4)
    assert all(_eos_at(r) >= 4 for r in out.tolist()) and (out == EOS_ID).any()
    assert torch.equal(beam_search(m, src, sl, beam_size=1, max_len=12, min_len=4),
                       greedy_decode(m, src, sl, max_len=12, min_len=4))
    assert not (beam_search(m, src, sl, beam_size=3, max_len=5, min_len=5) == EOS_ID).any()
    alone = beam_search(m, src[1:2, : sl[1]], sl[1:2], beam_size=3, max_len=12, min_len=4)[0]
    assert torch.equal(out[1, : alone.shape[0]], alone)


def _repetitive_model():
    """A model that, left alone, loops over a few tokens (a large bias on them, EOS out of reach)."""
    m = _model()
    with torch.no_grad():
        m.generator.bias[EOS_ID] = -10.0
        m.generator.bias[4:8] += 6.0
    return m


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_greedy_matches_a_step_by_step_reference(n):
    """Greedy with n-gram blocking = the full model's argmax over the tokens that would not repeat an
    n-gram of the row so far (Python sets); without blocking the same model repeats itself."""
    m = _repetitive_model()
    src, sl = _src()
    assert all(_repeats(row, n) for row in greedy_decode(m, src, sl, max_len=12).tolist())
    out = greedy_decode(m, src, sl, max_len=12, no_repeat_ngram=n)
    for b in range(4):
        seq = [BOS_ID]
        for t in range(out.shape[1]):
            logits = m(src[b : b + 1, : sl[b]], sl[b : b + 1], torch.tensor([seq]))[0, -1]
            logits[[PAD_ID, BOS_ID]] = float("-inf")
            body = seq[1:]
            for i in range(len(body) - n + 1):
                if tuple(body[i : i + n - 1]) == tuple(body[len(body) - n + 1 :]):
                    logits[body[i + n - 1]] = float("-inf")
            nxt = int(logits.argmax())
            assert int(out[b, t]) == nxt, (b, t)
            seq.append(nxt)
        assert not _repeats(seq[1:], n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_beam(n):
    """Beam search with blocking: no hypothesis repeats an n-gram, beam 1 is greedy with blocking, and a
    row decodes the same alone as in a batch."""
    m = _repetitive_model()
    src, sl = _src()
    out = beam_search(m, src, sl, beam_size=3, max_len=12, no_repeat_ngram=n)
    assert not any(_repeats([x for x in row if x != PAD_ID], n) for row in out.tolist())
    greedy = greedy_decode(m, src, sl, max_len=12, no_repeat_ngram=n)
    assert torch.equal(beam_search(m, src, sl, beam_size=1, max_len=12, no_repeat_ngram=n), greedy)
    alone = beam_search(m, src[1:2, : sl[1]], sl[1:2], beam_size=3, max_len=12, no_repeat_ngram=n)[0]
    assert torch.equal(out[1, : alone.shape[0]], alone)


@pytest.mark.parametrize("kernel,static", [("eager", False), ("torch", False), ("torch", True), ("triton", False)])
def test_under_autocast_the_self_attention_caches_keep_its_dtype(kernel, static, monkeypatch):
    """init_state under bf16 autocast: the self-attention K/V caches are bf16, the dtype their
    values come in (from a matmul), where fp32 caches were cast whole to bf16 for every step's
    attention; the decoding steps' logits are those of fp32 caches, bit for bit."""
    from conftest import DEVICE, step_model

    m = step_model(kernel, DEVICE, dropout=0.0).eval()  # head dim 16: triton's smallest
    src, sl = (t.to(DEVICE) for t in _src())

    def steps(caches_follow_autocast: bool):
        with monkeypatch.context() as mp, torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
            if not caches_follow_autocast:
                mp.setattr(ops, "autocast_dtype", lambda t: None)
            state = m.init_state(m.encode(src, sl), sl, 4, static=static)
            dtypes = {c.k.dtype for c, _ in state.caches}
            tokens, out = torch.full((4, 1), BOS_ID, device=DEVICE), []
            for _ in range(4):
                out.append(m.decode_step(tokens, state))
                tokens = out[-1].argmax(-1, keepdim=True)
        return dtypes, out

    (new_dtypes, new), (old_dtypes, old) = steps(True), steps(False)
    assert new_dtypes == {torch.bfloat16} and old_dtypes == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(new, old))


@pytest.mark.parametrize("kernel,kind", [("eager", "tied"), ("torch", "tied"), ("torch", "copy"), ("triton", "tied"),
                                         ("torch", "static")])
def test_under_autocast_decoding_lends_its_weights_cast_once(kernel, kind, monkeypatch):
    """greedy and beam search under bf16 autocast with the matmul weights lent in bf16 for the call
    (`WeightCast.for_decoding`; the generator's tied embedding among them): every step's logits
    and so the tokens are those of autocast's own casts, bit for bit, and no step casts a weight
    (where it did at every step, with autocast's cast cache off as in a CUDA graph's capture): the
    pointer-generator's key projection, outside the lending, casts its own once a call. A model
    with compiled decoding (`static_caches`) lends nothing."""
    from conftest import DEVICE, step_model

    overrides = {"tied": dict(tie_embeddings="all"), "copy": dict(tie_embeddings="all", copy=True),
                 "static": dict(tie_embeddings="all")}[kind]
    m = step_model(kernel, DEVICE, dropout=0.0, **overrides).eval()  # head dim 16: triton's smallest
    m.static_caches = kind == "static"  # compile_decoding's caches, without the compile: lends nothing
    src, sl = (t.to(DEVICE) for t in _src())
    keys = list(m.copy.k_proj.parameters()) if m.copy else []  # cast once a call, by autocast
    decode_step = m.decode_step

    def run(lend: bool):
        logits = []
        m.decode_step = lambda *a, **k: logits.append(decode_step(*a, **k).clone()) or logits[-1]
        with monkeypatch.context() as mp, torch.autocast(DEVICE, dtype=torch.bfloat16, cache_enabled=False), \
                Dispatched() as dispatched:
            if not lend:
                mp.setattr(weight_cast.WeightCast, "for_decoding", lambda *a: weight_cast.WeightCast(m, None))
            out = (greedy_decode(m, src, sl, max_len=5, check_every=5),
                   beam_search(m, src, sl, beam_size=2, max_len=5, check_every=5))
        del m.decode_step
        return out, logits, dispatched.casts_of(m.parameters())

    (lent, lent_logits, lent_casts), (own, own_logits, own_casts) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(lent, own))
    assert len(lent_logits) == len(own_logits) and all(torch.equal(a, b) for a, b in zip(lent_logits, own_logits))
    assert own_casts > 10 * len(own_logits)  # every step cast its weights
    if kind == "static":
        assert lent_casts == own_casts
    else:
        assert lent_casts == 2 * len(keys)  # two calls
    assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())  # given back


@pytest.mark.parametrize("static", [False, True])
def test_a_beam_reorder_moves_every_layers_filled_self_attention_caches_in_one_gather(static):
    """DecoderState.reorder: every layer's self-attention keys and values (one buffer, k and v side
    by side) gathered to the new rows in one index_select and copied back in place in one copy,
    where each layer's k and v took one (growing) or two (static) ops of their own, over the whole
    buffer: only the filled positions (the growing cache's `pos`; for static caches, which the host
    does not track, beam search's `filled`), the rest left as they were; the cross-attention caches
    stay (same sources)."""
    m = _model()  # 2 decoder layers
    src, sl = _src()
    with torch.no_grad():
        state = m.init_state(m.encode(src, sl), sl, max_len=6, src=src, static=static)
        for _ in range(3):
            m.decode_step(torch.randint(4, V, (4, 1)), state)
        state.self_kv[:, :, 3:].normal_()  # what earlier steps left there (a rewound state's): not to be moved
        before = state.self_kv.clone()
        cross = [c.kv for _, c in state.caches]
        order = torch.tensor([3, 3, 0, 1])
        with Dispatched() as dispatched:
            state.reorder(order, same_sources=True, filled=3 if static else None)
    assert [name for name, _ in dispatched.calls] == ["index_select.default", "copy_.default"]
    assert torch.equal(state.self_kv[:, :, :3], before[:, order, :3])
    assert torch.equal(state.self_kv[:, :, 3:], before[:, :, 3:])
    assert all(s.kv.data_ptr() == state.self_kv[i].data_ptr() for i, (s, _) in enumerate(state.caches))
    assert all(c.kv is kv for (_, c), kv in zip(state.caches, cross))
    if static:  # one layer's cache alone moves in place too: a captured step keeps reading it
        layer, kept = state.caches[0][0], state.self_kv[0].clone()
        layer.reorder(order)
        assert layer.kv.data_ptr() == state.self_kv[0].data_ptr() and torch.equal(layer.kv, kept[order])


def test_a_static_cache_refuses_a_view_of_its_filled_positions():
    """A static cache's step is a tensor on the device, so the host does not know how far it is
    filled: `view()`, the growing cache's (B, H, length, D) views, is refused by name, not answered
    with the whole buffers (unmasked, every position past the step would be attended)."""
    cache = StaticKVCache(torch.zeros(2, 5, 2, 1, 4), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="StaticKVCache has no host-side length"):
        cache.view()


@pytest.mark.parametrize("static", [False, True])
def test_a_rewound_state_decodes_as_a_fresh_one(static):
    """DecoderState.rewind goes back to the first step: what the steps before it cached is not read
    again (a growing cache starts empty, a static one at position 0), so the steps after it give the
    logits of a state just made."""
    m = _model()
    src, sl = _src()
    tokens = [torch.randint(4, V, (4, 1)) for _ in range(3)]
    with torch.no_grad():
        memory = m.encode(src, sl)
        state, fresh = (m.init_state(memory, sl, max_len=5, static=static) for _ in range(2))
        for _ in range(3):  # other tokens than after the rewind
            m.decode_step(torch.randint(4, V, (4, 1)), state)
        state.rewind()
        for t in tokens:
            torch.testing.assert_close(m.decode_step(t, state), m.decode_step(t, fresh), rtol=0, atol=0)


class _PrefixState:
    """A `_TableModel`'s decoding state: each row's source and the tokens it was given so far (BOS
    first); what decoding does to a state (reorder its rows, rewind) done to these lists."""

    def __init__(self, sources):
        self.rows = [(s, []) for s in sources]

    def reorder(self, index, *, same_sources=False, filled=None):
        self.rows = [(self.rows[i][0], list(self.rows[i][1])) for i in index.tolist()]

    def rewind(self):
        self.rows = [(s, []) for s, _ in self.rows]


class _TableModel(torch.nn.Module):
    """A stand-in for a Transformer whose next-token probabilities are a table: `table(source, prefix)`
    -> {token: probability} for source row `source` after the tokens `prefix` (without BOS), or None
    (a prefix the table leaves out): EOS, certain; tokens not named get probability 0. It has what
    decoding reads of a model (encode, init_state, decode_step) and nothing learned: a search's
    result can be checked against scores computed by hand."""

    static_caches = False

    def __init__(self, table, vocab=6):
        super().__init__()
        self.table, self.vocab = table, vocab
        self.cfg = ModelConfig(src_vocab_size=vocab, d_model=8, n_heads=1, n_encoder_layers=1, n_decoder_layers=1,
                               d_ff=8, kernel="eager")

    def encode(self, src, src_lengths):
        return src

    def init_state(self, memory, src_lengths, max_len, src=None, *, static=False, beams=1):
        return _PrefixState([b for b in range(memory.shape[0]) for _ in range(beams)])

    def decode_step(self, last, state):
        logp = torch.full((len(state.rows), self.vocab), float("-inf"))
        for r, ((source, seq), token) in enumerate(zip(state.rows, last[:, 0].tolist())):
            seq.append(token)
            for tok, p in (self.table(source, tuple(seq[1:])) or {EOS_ID: 1.0}).items():
                logp[r, tok] = math.log(p)
        return logp


def _table_search(table, *, beam_size, sources=1, **kw):
    src, sl = torch.full((sources, 1), 4), torch.ones(sources, dtype=torch.long)
    return beam_search(_TableModel(table), src, sl, beam_size=beam_size, **kw).tolist()


def _random_table(seed, words=(3, 4, 5), depth=3):
    """A `_TableModel` table: after each prefix of up to depth - 1 words, a random distribution over
    EOS and the words (every other token, PAD, BOS, probability 0)."""
    g = torch.Generator().manual_seed(seed)
    table = {}
    for n in range(depth):
        for prefix in itertools.product(words, repeat=n):
            p = torch.softmax(2.0 * torch.randn(len(words) + 1, generator=g, dtype=torch.float64), 0).tolist()
            table[prefix] = dict(zip((EOS_ID, *words), p))
    return table


def _best_by_exhaustive_search(table, max_len, alpha, words=(3, 4, 5)):
    """The output of best score sum(log p) / len**alpha (len counting the EOS) among all of up to
    max_len tokens: those ended by EOS, and those still unfinished at max_len."""
    outputs = [[*body, EOS_ID] for n in range(max_len) for body in itertools.product(words, repeat=n)]
    outputs += [list(body) for body in itertools.product(words, repeat=max_len)]

    def score(seq):
        return sum(math.log(table[tuple(seq[:i])][tok]) for i, tok in enumerate(seq)) / len(seq) ** alpha

    return max(outputs, key=score)


def test_beam_search_returns_the_best_output_under_every_length_penalty_by_exhaustive_search():
    """With beam_size >= the number of outputs (3 words, up to 3 tokens: 27 beams), beam search is
    exhaustive: it returns the output of best sum(log p) / len**length_penalty, len counting the EOS,
    finished or unfinished at max_len; the table is such that the penalties pick different outputs."""
    table = _random_table(289)
    best = {}
    for alpha in (0.0, 0.5, 1.0, 2.0):
        best[alpha] = _best_by_exhaustive_search(table, 3, alpha)
        out = _table_search(lambda s, prefix: table.get(prefix), beam_size=27, max_len=3, length_penalty=alpha)[0]
        assert out[: _eos_at(out) + 1] == best[alpha], (alpha, out, best[alpha])
    assert len({tuple(b) for b in best.values()}) >= 3, f"test needs the penalties to matter: {best}"


@pytest.mark.parametrize("alpha", [-40.0, -1.0, 1.0, 38.5])
def test_length_penalties_far_from_1_rank_by_the_formula_where_float32_powers_overflow(alpha):
    """Two outputs: 3 x9 then EOS (10 tokens, log p -0.09) and 4 x10 then EOS (11 tokens, log p
    -69); beam search returns the one of best sum(log p) / len**alpha, computed here in float64.
    At alpha 38.5, 11**alpha is past float32's range: the quotient in float32 made the long one's
    -0.0 and so picked it. And at -40 an output of 15 tokens, the only one with EOS, is returned:
    15**-40 below float32's range made its score -inf, and the output was empty."""
    def table(source, prefix):
        if not prefix:
            return {3: 1.0 - 1e-30, 4: 1e-30}
        if prefix[0] == 3:
            return {3: 0.99} if len(prefix) < 9 else {EOS_ID: 0.999}
        return {4: 0.99} if len(prefix) < 10 else {EOS_ID: 1.0}

    def score(seq):
        return sum(math.log(table(0, tuple(seq[:i]))[tok]) for i, tok in enumerate(seq)) / len(seq) ** alpha

    best = max(([3] * 9 + [EOS_ID], [4] * 10 + [EOS_ID]), key=score)
    out = _table_search(table, beam_size=2, max_len=12, length_penalty=alpha)[0]
    assert out[: _eos_at(out) + 1] == best
    out = _table_search(lambda s, prefix: {3: 0.9, 4: 0.1} if len(prefix) < 14 else {EOS_ID: 1.0}, beam_size=1,
                        max_len=16, length_penalty=alpha)[0]
    assert out == [3] * 14 + [EOS_ID]


def test_an_eos_candidate_ranked_past_beam_size_does_not_finish():
    """fairseq's rule: an EOS candidate is finished only when it ranks among the top beam_size
    candidates of its step. beam 2, length_penalty 0 (raw sums). Step 0 ranks 3 (.4), 4 (.3), EOS (.2):
    [EOS] (log .2) is third, dropped. Step 1, both continuations' distributions put EOS first:
    [3 EOS] .4 * .4 = .16, [4 EOS] .3 * .5 = .15, [3 3] .12, [3 4] .08: both EOS in the top 2, the
    sentence done; the best [3 EOS] (.16), not the dropped [EOS] (.2)."""
    table = {(): {3: .4, 4: .3, EOS_ID: .2, 5: .1},
             (3,): {EOS_ID: .4, 3: .3, 4: .2, 5: .1}, (4,): {EOS_ID: .5, 3: .25, 4: .15, 5: .1}}
    out = _table_search(lambda s, prefix: table.get(prefix), beam_size=2, max_len=2, length_penalty=0.0)
    assert out == [[3, EOS_ID]]


def test_an_eos_candidate_in_the_top_k_leaves_k_live_beams():
    """A finished EOS candidate does not take a live beam's place: beam search ranks 2·beam_size
    candidates so that beam_size go on beside it. beam 2, length_penalty 1. Step 0: 3 (.4), EOS
    (.35, finished: log .35 = -1.05), 4 (.2): the live beams are [3] and [4]. Step 1: [4 EOS] .2 *
    .97 = .194, the top candidate, finishes with log(.194) / 2 = -0.82, the best; [3 x] at most .16,
    log(.16) / 2 = -0.92. Had [4] been dropped for the EOS, [3 3] (-0.92) would win."""
    table = {(): {3: .4, EOS_ID: .35, 4: .2, 5: .05},
             (3,): {3: .4, 4: .3, 5: .2, EOS_ID: .1}, (4,): {EOS_ID: .97, 3: .01, 4: .01, 5: .01}}
    out = _table_search(lambda s, prefix: table.get(prefix), beam_size=2, max_len=2, length_penalty=1.0)
    assert out == [[4, EOS_ID]]


@pytest.mark.parametrize("beam_size", [2, 3])
def test_an_eos_candidate_of_probability_zero_never_finishes(beam_size):
    """Fewer finite candidates than beams: one word (probability 1), EOS barred by min_len 2, so
    at steps 0 and 1 every candidate but one is -inf, EOS candidates among them. An EOS candidate of
    -inf score is no hypothesis: had it counted as finished, beam_size of them would close the
    sentence before any real one, and it would output one of them. Which -inf candidates topk ranks
    first among its ties is unspecified, so every assignment of EOS, PAD, BOS and the word to the 4
    ids is tried (one of them puts an EOS candidate first among the ties); each returns [w w EOS]."""
    for eos, pad, bos, w in itertools.permutations(range(4)):
        model = _TableModel(lambda s, prefix, w=w, eos=eos: {w: 1.0} if len(prefix) < 2 else {eos: 1.0}, vocab=4)
        out = beam_search(model, torch.full((1, 1), 3), torch.ones(1, dtype=torch.long), beam_size=beam_size,
                          max_len=3, min_len=2, eos_id=eos, pad_id=pad, bos_id=bos).tolist()
        assert out == [[w, w, eos]], (eos, pad, bos, w, out)


@pytest.mark.parametrize("check_every", [1, 3])
def test_a_sentence_with_beam_size_finished_hypotheses_takes_no_more(check_every):
    """beam 1, length_penalty 1, max_len 3; source 2 keeps the search going to max_len (its best
    is always a word: [3 3 4]). Sources 0 and 1 finish [EOS] (log .5 = -0.69) at step 0: done,
    whatever better their live beam [3] would go on to (source 0: [3 EOS], log(.3 * .99) / 2 = -0.61,
    finished at step 1; source 1: [3 4 5] unfinished at max_len, log(.3 * .98 * .98) / 3 = -0.41)."""
    tables = [{(): {EOS_ID: .5, 3: .3, 4: .2}, (3,): {EOS_ID: .99, 4: .01}, (3, 4): {EOS_ID: .99, 5: .01}},
              {(): {EOS_ID: .5, 3: .3, 4: .2}, (3,): {4: .98, EOS_ID: .02}, (3, 4): {5: .98, EOS_ID: .02}},
              {(): {3: .9, EOS_ID: .1}, (3,): {3: .9, EOS_ID: .1}, (3, 3): {4: .9, EOS_ID: .1}}]
    out = _table_search(lambda s, prefix: tables[s].get(prefix), beam_size=1, sources=3, max_len=3, length_penalty=1.0,
                        check_every=check_every)
    assert out == [[EOS_ID, PAD_ID, PAD_ID], [EOS_ID, PAD_ID, PAD_ID], [3, 3, 4]]


def test_every_eos_candidate_finished_at_one_step_counts_toward_beam_size():
    """beam 2, length_penalty 1, max_len 3. Step 0: the live beams [3] (.5), [4] (.4). Step 1: [3 EOS]
    .5 * .55 = .275 and [4 EOS] .4 * .6 = .24 rank first and second, above [3 3] .225 and [4 3] .16:
    both finish, 2 = beam_size, the sentence is done, with [3 EOS], log(.275) / 2 = -0.65; the
    [3 3 EOS] step 2 would have finished, log(.225 * .99) / 3 = -0.50, is never reached."""
    table = {(): {3: .5, 4: .4, EOS_ID: .06, 5: .04}, (3,): {EOS_ID: .55, 3: .45}, (4,): {EOS_ID: .6, 3: .4},
             (3, 3): {EOS_ID: .99, 5: .01}}
    out = _table_search(lambda s, prefix: table.get(prefix), beam_size=2, max_len=3, length_penalty=1.0,
                        check_every=3)
    assert out == [[3, EOS_ID]]


def _table_score(table, seq, alpha):
    """sum(log p) / len**alpha of an output under a `_random_table` (len counting its EOS)."""
    return sum(math.log(table[tuple(seq[:i])][tok]) for i, tok in enumerate(seq)) / len(seq) ** alpha


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_nbest_lists_the_exhaustive_top_n_best_first_with_their_scores(alpha):
    """With 27 beams over 3 words and up to 3 tokens the search keeps the best 27 of all 40 outputs (1 + 3 + 9
    ended by EOS, 27 unfinished at max_len): its n-best list is the top n of every output ranked by hand,
    best first, each with its sum(log p) / len**length_penalty; the first is beam_search's output."""
    table = _random_table(289)
    outputs = [[*body, EOS_ID] for n in range(3) for body in itertools.product((3, 4, 5), repeat=n)]
    outputs += [list(body) for body in itertools.product((3, 4, 5), repeat=3)]
    ranked = sorted(outputs, key=lambda seq: -_table_score(table, seq, alpha))
    model, src, sl = _TableModel(lambda s, prefix: table.get(prefix)), torch.full((1, 1), 4), torch.ones(1).long()
    kw = dict(beam_size=27, max_len=3, length_penalty=alpha)
    tokens, scores = beam_search_nbest(model, src, sl, nbest=27, **kw)
    assert tokens.shape[:2] == (1, 27) and scores.shape == (1, 27) and scores.dtype == torch.float64
    got = [row[: _eos_at(row) + 1] for row in tokens[0].tolist()]
    assert got == ranked[:27]
    assert scores[0].tolist() == pytest.approx([_table_score(table, seq, alpha) for seq in ranked[:27]], rel=1e-6)
    assert torch.equal(tokens[:, 0, : beam_search(model, src, sl, **kw).shape[1]], beam_search(model, src, sl, **kw))
    top, top_scores = beam_search_nbest(model, src, sl, nbest=5, **kw)  # fewer: the same first ones
    assert [row[: _eos_at(row) + 1] for row in top[0].tolist()] == ranked[:5]
    assert torch.equal(top_scores, scores[:, :5])


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("beam,alpha", [(1, 1.0), (4, 0.6), (4, 1.0)])
def test_nbest_scores_are_the_full_models_log_probabilities_of_its_hypotheses(copy, beam, alpha):
    """A Transformer's n-best (the beam's hypotheses, best first): the first row is beam_search's output
    (beam 1: greedy's), and each hypothesis's score is the full model's teacher-forced sum(log p) over its
    tokens / len**length_penalty, len counting the EOS (PAD and BOS ruled out, as decoding does)."""
    m = _model(copy=copy)
    src, sl = _src()
    kw = dict(beam_size=beam, max_len=12, length_penalty=alpha)
    tokens, scores = beam_search_nbest(m, src, sl, nbest=beam, **kw)
    best = greedy_decode(m, src, sl, max_len=12) if beam == 1 else beam_search(m, src, sl, **kw)
    assert torch.equal(tokens[:, 0, : best.shape[1]], best) and not (tokens[:, 0, best.shape[1]:] != PAD_ID).any()
    assert (scores[:, :-1] >= scores[:, 1:]).all(), scores
    for b in range(src.shape[0]):
        for k in range(beam):
            row = tokens[b, k].tolist()
            seq = row[: _eos_at(row) + 1]
            want = _score(m, src[b : b + 1], sl[b : b + 1], seq, alpha)
            assert scores[b, k].item() == pytest.approx(want, rel=1e-4, abs=1e-5), (b, k, seq)
    assert (tokens[..., :1] != PAD_ID).all(), "every hypothesis holds a token"


def test_nbest_refuses_more_hypotheses_than_the_beam_keeps_and_takes_an_empty_batch():
    m = _model()
    src, sl = _src()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"nbest must be an int >= 1"):
            beam_search_nbest(m, src, sl, nbest=bad, beam_size=4, max_len=5)
    with pytest.raises(ValueError, match=r"nbest 5 exceeds beam_size 4: a search keeps beam_size hypotheses"):
        beam_search_nbest(m, src, sl, nbest=5, beam_size=4, max_len=5)
    empty, no_lengths = torch.zeros(0, 6, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    tokens, scores = beam_search_nbest(m, empty, no_lengths, nbest=2, beam_size=3, max_len=5)
    assert tokens.shape == (0, 2, 1) and scores.shape == (0, 2)
