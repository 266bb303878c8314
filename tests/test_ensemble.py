"""`model.Ensemble`: several models as one, each prediction the mean of their probabilities.

The references here are written from the definition, not from the class: each member's full
forward (no caches), its softmax (or sigmoid) in float64, the mean over members."""

import copy
import itertools

import pytest
import torch

from scratchformer import graphs
from scratchformer.compile import compile_for_inference
from scratchformer.model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Classifier,
    Ensemble,
    Extractor,
    ModelConfig,
    Transformer,
    beam_search,
    decoding,
    greedy_decode,
    sample_decode,
)

V = 30


def _seq2seq(seed, kernel="eager", d_model=32, eos_bias=2.5, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab_size=V, d_model=d_model, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                      d_ff=2 * d_model, dropout=0.0, kernel=kernel, **kw)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # EOS reachable, so that finishing rows are exercised
        m.generator.bias[EOS_ID] = eos_bias
    return m


def _members(kernels=("eager", "eager", "eager")):
    """Three unlike models of one vocabulary: another width, the pointer-generator (whose logits
    are log-probabilities already), pre-LN; one more likely to end early than the others."""
    return [_seq2seq(0, kernels[0], eos_bias=1.5), _seq2seq(1, kernels[1], d_model=48, copy=True, eos_bias=0.0),
            _seq2seq(2, kernels[2], norm="pre", final_norm=True, eos_bias=0.0)]


def _src():
    return torch.randint(4, V, (4, 8)), torch.tensor([8, 3, 1, 6])


def _mean_probs(members, *args):
    """The mean of the members' next-token distributions from full forwards, float64."""
    return torch.stack([torch.softmax(m(*args).double(), -1) for m in members]).mean(0)


@torch.no_grad()
def test_forward_is_the_log_of_the_members_mean_probability():
    members = _members()
    src, sl = _src()
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, V, (4, 6))], 1)
    out = Ensemble(members)(src, sl, tgt)
    assert out.dtype == torch.float32 and out.shape == (4, 7, V)
    torch.testing.assert_close(out.double().exp(), _mean_probs(members, src, sl, tgt), atol=1e-6, rtol=1e-5)
    # one member: its own distribution
    torch.testing.assert_close(Ensemble(members[:1])(src, sl, tgt), torch.log_softmax(members[0](src, sl, tgt), -1))


@torch.no_grad()
def test_classifier_and_extractive_members_average_their_probabilities():
    torch.manual_seed(0)
    base = dict(src_vocab_size=V, d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=0, d_ff=64,
                dropout=0.0, kernel="eager")
    classifiers = [Classifier(ModelConfig(**base, num_classes=3)).eval() for _ in range(2)]
    extractors = [Extractor(ModelConfig(**base, extractive=True)).eval() for _ in range(3)]
    tokens, lengths = torch.randint(4, V, (2, 10)), torch.tensor([10, 7])
    got = Ensemble(classifiers)(tokens, lengths).double().exp()
    torch.testing.assert_close(got, _mean_probs(classifiers, tokens, lengths), atol=1e-6, rtol=1e-5)
    sentences = torch.tensor([[0, 4, 6], [0, 3, 3]])
    want = torch.stack([torch.sigmoid(m(tokens, lengths, sentences).double()) for m in extractors]).mean(0)
    torch.testing.assert_close(torch.sigmoid(Ensemble(extractors)(tokens, lengths, sentences).double()), want,
                               atol=1e-6, rtol=1e-5)
    # a mean probability within float32's rounding of 0 or 1 keeps a finite, ordered logit
    for m, bias in zip(extractors, (40.0, 60.0, 80.0)):
        m.head.bias.data.fill_(bias)
    sure = Ensemble(extractors)(tokens, lengths, sentences)
    assert torch.isfinite(sure).all() and (sure > 39).all()


@torch.no_grad()
def test_compiled_classifier_and_extractive_members_average_as_uncompiled():
    """A member compiled as `evaluate --compile` compiles a classifier's or an extractor's forward
    (torch.compile's wrapper, `compile_for_inference`) is taken as its kind: the ensemble averages
    as it does uncompiled members (an extractor's mean probability as a logit, a classifier's as
    a log). The wrapper runs its module uncompiled here (`set_stance("force_eager")`: tracing
    would cost seconds and is not what is tested)."""
    torch.manual_seed(0)
    base = dict(src_vocab_size=V, d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=0, d_ff=64,
                dropout=0.0, kernel="eager")
    tokens, lengths = torch.randint(4, V, (2, 10)), torch.tensor([10, 7])
    sentences = torch.tensor([[0, 4, 6], [0, 3, 3]])
    for kind, cfg, args in ((Classifier, dict(num_classes=3), (tokens, lengths)),
                            (Extractor, dict(extractive=True), (tokens, lengths, sentences))):
        members = [kind(ModelConfig(**base, **cfg)).eval() for _ in range(2)]
        compiled = Ensemble([compile_for_inference(members[0], backend="eager"), members[1]])
        with torch.compiler.set_stance("force_eager"):
            torch.testing.assert_close(compiled(*args), Ensemble(members)(*args))


def _stepwise_greedy(members, src, sl, max_len):
    """Greedy decoding by definition: each row alone, each step the argmax (PAD and BOS excluded)
    of the members' mean probability from full forwards over the prefix."""
    rows = []
    for b in range(src.shape[0]):
        seq = [BOS_ID]
        for _ in range(max_len):
            p = _mean_probs(members, src[b : b + 1, : sl[b]], sl[b : b + 1], torch.tensor([seq]))[0, -1]
            p[[PAD_ID, BOS_ID]] = -1.0
            seq.append(int(p.argmax()))
            if seq[-1] == EOS_ID:
                break
        rows.append(seq[1:])
    return rows


@pytest.mark.parametrize("kernels", [("eager", "eager", "eager"), ("torch", "eager", "torch")])
def test_greedy_is_the_stepwise_argmax_of_the_mean(kernels):
    members = _members(kernels)
    torch.manual_seed(0)
    src, sl = _src()
    out = greedy_decode(Ensemble(members), src, sl, max_len=10)
    want = _stepwise_greedy(members, src, sl, 10)
    assert any(EOS_ID in row for row in want) and any(EOS_ID not in row for row in want)  # both kinds of row
    for b, row in enumerate(want):
        assert out[b, : len(row)].tolist() == row and (out[b, len(row):] == PAD_ID).all(), b


def _mixture_score(members, src, sl, seq):
    """Mean log-probability of seq (length penalty 1) under the members' mean distribution."""
    tgt_in = torch.tensor([[BOS_ID] + seq[:-1]])
    p = _mean_probs(members, src, sl, tgt_in)[0]
    p[:, [PAD_ID, BOS_ID]] = 0.0
    p = p / p.sum(-1, keepdim=True)  # decoding renormalises without PAD and BOS
    return p[torch.arange(len(seq)), torch.tensor(seq)].log().sum().item() / len(seq)


@torch.no_grad()
def test_exhaustive_beam_finds_the_best_sequence_under_the_mixture():
    """On a tiny vocabulary, beam with K >= V^T is exhaustive: it must find the sequence the mean
    distribution scores best."""
    torch.manual_seed(1)
    cfg = dict(src_vocab_size=6, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
               dropout=0.0, kernel="eager")
    members = [Transformer(ModelConfig(**cfg)).eval() for _ in range(3)]
    src, sl = torch.randint(4, 6, (1, 5)), torch.tensor([5])
    words = [3, 4, 5]
    candidates = [list(body) + [EOS_ID] for T in range(1, 4) for body in itertools.product(words, repeat=T - 1)]
    candidates += [list(body) for body in itertools.product(words, repeat=3)]  # unfinished at max_len 3
    best = max(candidates, key=lambda seq: _mixture_score(members, src, sl, seq))
    out = beam_search(Ensemble(members), src, sl, beam_size=27, max_len=3)[0].tolist()
    assert (out[: out.index(EOS_ID) + 1] if EOS_ID in out else out) == best


@torch.no_grad()
@pytest.mark.parametrize("copy_", [False, True])
def test_a_model_twice_decodes_as_the_model(copy_):
    """The mean of two equal distributions is that distribution: beam search (beams reordered in
    every member's caches), n-gram blocking and min_len included, decodes what the model alone does."""
    m = _seq2seq(3, copy=copy_)
    src, sl = _src()
    kw = dict(max_len=12, no_repeat_ngram=2, min_len=2)
    twice = Ensemble([m, copy.deepcopy(m)])
    assert torch.equal(beam_search(twice, src, sl, beam_size=3, length_penalty=1.3, **kw),
                       beam_search(m, src, sl, beam_size=3, length_penalty=1.3, **kw))
    assert torch.equal(beam_search(twice, src, sl, beam_size=1, **kw), greedy_decode(m, src, sl, **kw))


@torch.no_grad()
def test_static_caches_and_a_replayed_step_decode_as_launched_steps(monkeypatch):
    """A member compiled for decoding (`static_caches`) puts every member on static caches; the
    ensemble's step captured as one CUDA graph (stood in for here as in test_decoding.py: the capture's
    warm-up runs, then each replay rewrites the one output buffer) decodes what launched steps do."""
    members = _members()
    src, sl = _src()
    ens = Ensemble(members)
    ref = {beam: beam_search(ens, src, sl, beam_size=beam, max_len=12) for beam in (1, 3)}
    members[1].static_caches = True
    assert ens.static_caches
    for beam in (1, 3):
        assert torch.equal(beam_search(ens, src, sl, beam_size=beam, max_len=12), ref[beam])

    def fake_capture(fn, warmup=1):
        for _ in range(warmup):
            fn()
        out = fn()
        return out, lambda: out.copy_(fn())

    monkeypatch.setattr(decoding, "_use_graphs", lambda cuda_graph, device, compiled: True)
    monkeypatch.setattr(graphs, "capture", fake_capture)
    for beam in (1, 3):
        assert torch.equal(beam_search(ens, src, sl, beam_size=beam, max_len=12), ref[beam])


def test_members_must_be_of_one_kind_and_vocabulary():
    base = dict(d_model=16, n_heads=2, n_encoder_layers=1, d_ff=32, dropout=0.0, kernel="eager")
    seq2seq = Transformer(ModelConfig(src_vocab_size=V, n_decoder_layers=1, **base))
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])
    other_vocab = Transformer(ModelConfig(src_vocab_size=V + 1, n_decoder_layers=1, **base))
    with pytest.raises(ValueError, match="member 1 has src_vocab_size 31, member 0 30"):
        Ensemble([seq2seq, other_vocab])
    classifier = Classifier(ModelConfig(src_vocab_size=V, n_decoder_layers=0, num_classes=2, **base))
    with pytest.raises(ValueError, match=r"of one kind, got \['Classifier', 'Transformer'\]"):
        Ensemble([seq2seq, classifier])
    three = Classifier(ModelConfig(src_vocab_size=V, n_decoder_layers=0, num_classes=3, **base))
    with pytest.raises(ValueError, match=r"^ensemble member 1 has 3 classes, member 0 2: the members must predict "
                       r"the same classes$"):  # it said "num_classes 3 ...: must share one vocabulary"
        Ensemble([classifier, three])
    with pytest.raises(TypeError, match="Transformer, Classifier or Extractor models, got Linear"):
        Ensemble([torch.nn.Linear(2, 2)])
    short = Transformer(ModelConfig(src_vocab_size=V, n_decoder_layers=1, max_len=40, **base))
    assert Ensemble([seq2seq, short]).cfg.max_len == 40
    src, sl = _src()
    with pytest.raises(ValueError, match="no attention weights of its own"):
        Ensemble([seq2seq, short])(src, sl, src, need_weights=True)
    with pytest.raises(ValueError, match="no attention weights of its own: ask one of its members"):
        Ensemble([classifier, classifier])(src, sl, return_attention=True)  # an encoder's (a classifier's) too


@torch.no_grad()
def test_a_model_twice_scores_a_target_as_the_model_label_smoothing_included():
    """forward(target=): the mixture's (loss sum, NLL sum) with the smoothing asked for; the mean of two
    equal distributions is that distribution, so the model's own fused loss is the reference."""
    m = _seq2seq(4)
    src, sl = _src()
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, V, (4, 5))], 1)
    target = torch.cat([tgt[:, 1:], torch.full((4, 1), EOS_ID)], 1)
    target[1, 3:] = PAD_ID  # padded positions count in neither sum
    tl = torch.tensor([6, 4, 6, 6])
    for eps in (0.0, 0.1):
        want = m(src, sl, tgt, tl, target=target, label_smoothing=eps)
        got = Ensemble([m, copy.deepcopy(m)])(src, sl, tgt, tl, target=target, label_smoothing=eps)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want[0], want[1])  # the smoothing changes the loss: its loss is not the NLL


@torch.no_grad()
def test_samples_score_the_log_of_the_members_mean_probability():
    """An ensemble's samples: each one's score is its mean log-probability under the mean of the members'
    full-forward distributions (PAD and BOS ruled out, as decoding does), and top-k 1 draws its greedy output."""
    members = _members()
    ensemble = Ensemble(members).eval()
    src, sl = _src()
    tokens, scores = sample_decode(ensemble, src, sl, max_len=8, n=3, seed=1, temperature=1.3)
    for b in range(src.shape[0]):
        for j in range(3):
            row = tokens[b, j].tolist()
            seq = row[: row.index(EOS_ID) + 1] if EOS_ID in row else [t for t in row if t != PAD_ID]
            p = _mean_probs(members, src[b : b + 1, : sl[b]], sl[b : b + 1], torch.tensor([[BOS_ID] + seq[:-1]]))[0]
            p[:, [PAD_ID, BOS_ID]] = 0.0
            logp = torch.log(p / p.sum(-1, keepdim=True))[torch.arange(len(seq)), torch.tensor(seq)]
            assert scores[b, j].item() == pytest.approx(logp.mean().item(), rel=1e-4, abs=1e-5), (b, j, seq)
    greedy = greedy_decode(ensemble, src, sl, max_len=8)
    assert torch.equal(sample_decode(ensemble, src, sl, max_len=8, top_k=1)[0][:, 0, : greedy.shape[1]], greedy)
