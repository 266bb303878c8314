"""Model properties: padding invariance, causality, exact preset sizes, backends agree, errors."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

import scratchformer.model as pkg
from scratchformer import op_checks, ops
from scratchformer.model import (
    PRESETS,
    Classifier,
    ModelConfig,
    Transformer,
    build_model,
    check_batch,
    count_parameters,
    decoding,
    get_config,
    greedy_decode,
    layers,
    transformer,
)
from scratchformer.model.layers import MultiHeadAttention, project_memory

V = 40


def _cfg(**kw):
    base = dict(src_vocab_size=V, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                dropout=0.0, kernel="eager")
    return ModelConfig(**{**base, **kw})


def _batch(B=3, Ls=9, Lt=7):
    src = torch.randint(4, V, (B, Ls))
    tgt = torch.randint(4, V, (B, Lt))
    return src, torch.tensor([Ls, 5, 1])[:B], tgt, torch.tensor([Lt, 3, 6])[:B]


@pytest.mark.parametrize("preset,vocab,expected", [("base", 30522, 91_050_810), ("small", 8000, 13_525_824)])
def test_preset_parameter_counts(preset, vocab, expected):
    assert count_parameters(Transformer(get_config(preset, src_vocab_size=vocab))) == expected


def test_the_base_preset_is_the_papers_base_model():
    """Vaswani et al. 2017, Table 3, "base": N = 6 layers each side, d_model = 512, d_ff = 2048, h = 8
    heads of d_k = d_v = 64 (the parameter count above cannot see h: it is the same for any head count)."""
    cfg = get_config("base")
    assert (cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_model, cfg.d_ff) == (6, 6, 512, 2048)
    assert (cfg.n_heads, cfg.head_dim) == (8, 64)
    assert (cfg.activation, cfg.norm, cfg.dropout) == ("relu", "post", 0.1)
    assert cfg.tie_embeddings == "none"  # ours: tying (the paper's shared matrices) is a run's --tie-embeddings
    assert get_config("small").n_heads == 8  # the module docstring's


def test_tiny_and_classifier_presets_build():
    assert get_config("tiny").n_encoder_layers == 3 and get_config("tiny").n_heads == 4
    clf = build_model(get_config("classifier", src_vocab_size=100))
    assert isinstance(clf, Classifier) and clf.cfg.d_model == 64 and len(clf.encoder.layers) == 2
    assert set(PRESETS) == {"base", "small", "tiny", "classifier"}


def test_tying_shares_parameters():
    m = Transformer(_cfg(tie_embeddings="all"))
    assert m.generator.weight is m.encoder.embedding.weight is m.decoder.embedding.weight
    untied = count_parameters(Transformer(_cfg()))
    assert untied - count_parameters(m) == 2 * V * 32


@pytest.mark.parametrize("norm,final_norm,copy", [("post", False, False), ("pre", True, False), ("pre", False, False),
                                                  ("post", False, True)])
def test_padding_invariance(norm, final_norm, copy):
    """Extra right padding changes no output at unpadded positions, encoder or decoder (nor the copy
    layer: junk source ids past the lengths are never copied)."""
    m = Transformer(_cfg(norm=norm, final_norm=final_norm, copy=copy)).eval()
    src, sl, tgt, tl = _batch()
    pad_src = torch.cat([src, torch.randint(4, V, (3, 6))], 1)  # junk, not PAD: masks must hide it
    pad_tgt = torch.cat([tgt, torch.randint(4, V, (3, 4))], 1)
    mem, mem_pad = m.encode(src, sl), m.encode(pad_src, sl)
    out, out_pad = m(src, sl, tgt, tl), m(pad_src, sl, pad_tgt, tl)
    for b in range(3):
        torch.testing.assert_close(mem[b, : sl[b]], mem_pad[b, : sl[b]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[b, : tl[b]], out_pad[b, : tl[b]], atol=1e-5, rtol=1e-5)
    # and the junk in the padded tail of the source really is ignored by the decoder
    junk = pad_src.clone()
    junk[0, 9:] = torch.randint(4, V, (6,))
    torch.testing.assert_close(m(junk, sl, tgt, tl), out, atol=1e-5, rtol=1e-5)


def _paper_logits(m, src, tgt):
    """The logits (Lt, V) of one unpadded pair, src (Ls,) and tgt (Lt,) ids, from m's weights by the
    paper's equations in plain F.* ops (no masks but the causal one, no caches, no fused ops):
    x = emb[tokens] * sqrt(d) + PE, PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same);
    each sublayer Post-LN x = LN(x + f(x)) or Pre-LN x = x + f(LN(x)); attention per head
    softmax(q k^T / sqrt(d/H)) v; encoder [self-attention, FFN], decoder [causal self-attention,
    cross-attention over the encoder output, FFN]; a final LN after each stack where cfg.final_norm."""
    cfg = m.cfg
    d, H = cfg.d_model, cfg.n_heads

    def embed(embedding, tokens):
        pos = torch.arange(len(tokens), dtype=torch.float64)[:, None]
        angle = pos / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        return embedding.weight[tokens] * math.sqrt(d) + torch.stack((angle.sin(), angle.cos()), -1).flatten(-2)

    def ln(norm, x):
        return F.layer_norm(x, (d,), norm.weight, norm.bias, cfg.layer_norm_eps)

    def attend(a, q, k, v, causal=False):
        q, k, v = (t.view(t.shape[0], H, d // H).transpose(0, 1) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(d // H)
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return a.out_proj((s.softmax(-1) @ v).transpose(0, 1).reshape(-1, d))

    def self_attn(a, causal):
        return lambda x: attend(a, *a.qkv_proj(x).chunk(3, -1), causal=causal)

    def cross_attn(a, memory):
        return lambda x: attend(a, a.q_proj(x), *a.kv_proj(memory).chunk(2, -1))

    def ffn(f):
        return lambda x: f.w2((F.relu if cfg.activation == "relu" else F.gelu)(f.w1(x)))

    def stack(x, layers, final_norm):
        for norm, sublayer in layers:
            x = x + sublayer(ln(norm, x)) if cfg.norm == "pre" else ln(norm, x + sublayer(x))
        return ln(final_norm, x) if cfg.final_norm else x

    enc, dec = m.encoder, m.decoder
    memory = stack(embed(enc.embedding, src), [(n, f) for l in enc.layers for n, f in
                                               ((l.norm1, self_attn(l.self_attn, False)), (l.norm2, ffn(l.ffn)))],
                   enc.final_norm)
    y = stack(embed(dec.embedding, tgt), [(n, f) for l in dec.layers for n, f in
                                          ((l.norm1, self_attn(l.self_attn, True)),
                                           (l.norm2, cross_attn(l.cross_attn, memory)), (l.norm3, ffn(l.ffn)))],
              dec.final_norm)
    return m.generator(y)


@pytest.mark.parametrize("norm,final_norm,activation,tie", [("post", False, "relu", "none"),
                                                            ("pre", True, "gelu", "all"),
                                                            ("pre", False, "relu", "decoder"),
                                                            ("post", True, "gelu", "none")])
def test_the_model_computes_the_papers_equations(norm, final_norm, activation, tie):
    """The eager model's logits, from forward and from decoding steps over its caches (a first chunk
    of 3 tokens, then one a step), equal `_paper_logits` of each unpadded pair, in float64; with
    every dropout set (0.3) but the model in eval mode, where none applies. The norms' weights and
    every bias are made random, so that no two of them are interchangeable."""
    torch.manual_seed(0)
    cfg = _cfg(norm=norm, final_norm=final_norm, activation=activation, tie_embeddings=tie, dropout=0.3,
               attn_dropout=0.3, ffn_dropout=0.3, word_dropout=0.3, layer_norm_eps=0.5)  # an eps that matters
    m = Transformer(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:  # LayerNorm weights and biases, linear biases
                p.add_(0.5 * torch.randn_like(p))
    src, sl, tgt, _ = _batch()
    with torch.no_grad():
        out = m(src, sl, tgt)
        memory = m.encode(src, sl)
        state = m.init_state(memory, sl, max_len=tgt.shape[1])
        steps = [m.decode(tgt[:, :3], memory, sl, state=state)]
        steps += [m.decode_step(tgt[:, i : i + 1], state)[:, None] for i in range(3, tgt.shape[1])]
        steps = torch.cat(steps, 1)
        for b in range(3):
            want = _paper_logits(m, src[b, : sl[b]], tgt[b])
            torch.testing.assert_close(out[b], want, rtol=1e-9, atol=1e-9, msg=f"forward, row {b}")
            torch.testing.assert_close(steps[b], want, rtol=1e-9, atol=1e-9, msg=f"decoding steps, row {b}")


def test_causality():
    """Changing target token j changes no decoder output before j."""
    m = Transformer(_cfg()).eval()
    src, sl, tgt, _ = _batch()
    out = m(src, sl, tgt)
    changed = tgt.clone()
    changed[:, 4] = (changed[:, 4] + 1 - 4) % (V - 4) + 4
    out2 = m(src, sl, changed)
    torch.testing.assert_close(out[:, :4], out2[:, :4])
    assert (out[:, 4:] - out2[:, 4:]).abs().max() > 1e-4


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_torch_backend_matches_eager_outputs_and_grads(norm):
    torch.manual_seed(0)
    eager = Transformer(_cfg(norm=norm, final_norm=norm == "pre", activation="gelu"))
    fused = Transformer(_cfg(norm=norm, final_norm=norm == "pre", activation="gelu", kernel="torch"))
    fused.load_state_dict(eager.state_dict())
    src, sl, tgt, tl = _batch()
    outs, grads = [], []
    for m in (eager, fused):
        out = m(src, sl, tgt, tl)
        loss = sum(out[b, : tl[b]].logsumexp(-1).sum() for b in range(3))
        loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for b in range(3):
        torch.testing.assert_close(outs[0][b, : tl[b]], outs[1][b, : tl[b]], atol=1e-4, rtol=1e-4)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-4, rtol=1e-3, msg=n)


def test_classifier_attention_and_padding():
    torch.manual_seed(0)
    c = Classifier(get_config("classifier", src_vocab_size=V, dropout=0.0, kernel="eager")).eval()
    tok = torch.randint(4, V, (2, 6))
    logits, attn = c(tok, torch.tensor([6, 3]), return_attention=True)
    assert logits.shape == (2, 2) and len(attn) == 2 and attn[0].shape == (2, 2, 7, 7)
    torch.testing.assert_close(attn[0].sum(-1)[0], torch.ones(2, 7))
    assert (attn[0][1, :, :, 4:] == 0).all()  # CLS + 3 tokens visible in the second row
    longer = torch.cat([tok, torch.randint(4, V, (2, 3))], 1)
    torch.testing.assert_close(c(longer, torch.tensor([6, 3])), logits, atol=1e-5, rtol=1e-5)
    # lengths None: no padding, as for the Transformer and the Extractor (it was a TypeError, None + 1)
    torch.testing.assert_close(c(tok, None), c(tok, torch.tensor([6, 6])))


def test_training_step_reduces_loss():
    """A few optimizer steps on one batch lower its loss: the model is trainable end to end."""
    torch.manual_seed(0)
    m = Transformer(_cfg(dropout=0.1))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    src, sl, tgt, tl = _batch()
    losses = []
    for _ in range(15):
        logits = m(src, sl, tgt, tl)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), src[:, :7])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_bad_inputs_name_the_problem():
    m = Transformer(_cfg())
    src, sl, tgt, tl = _batch()
    with pytest.raises(ValueError, match="src_lengths must lie in"):
        m(src, torch.tensor([10, 1, 1]), tgt, tl)
    with pytest.raises(ValueError, match="src must be int32/int64"):
        m(src.float(), sl, tgt, tl)
    with pytest.raises(ValueError, match="src must be"):
        m(src[0], sl, tgt, tl)
    with pytest.raises(ValueError, match="src batch 3 != tgt batch 2"):
        m(src, sl, tgt[:2], tl[:2])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 40\)"):
        m(src + 100, sl, tgt, tl)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_config("huge")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda-magic'"):
        _cfg(kernel="cuda-magic")
    with pytest.raises(ValueError, match="divisible by n_heads"):
        _cfg(n_heads=5)
    with pytest.raises(ValueError, match="shared vocabulary"):
        _cfg(tie_embeddings="all", tgt_vocab_size=V + 1)
    with pytest.raises(ValueError, match="norm must be"):
        _cfg(norm="sandwich")
    with pytest.raises(ValueError, match="activation must be 'relu' or 'gelu', got 'swish'"):
        _cfg(activation="swish")
    with pytest.raises(ValueError, match="tie_embeddings must be 'none', 'decoder' or 'all', got 'both'"):
        _cfg(tie_embeddings="both")  # anything but "none" tied the decoder's
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields: \['n_layers'\]"):  # not cls(**d)'s TypeError
        ModelConfig.from_dict({**_cfg().to_dict(), "n_layers": 6})
    # a string where a bool goes is truthy: copy="no" built a copy layer, output_bias="False" a bias
    for name in ("final_norm", "output_bias", "pos_encoding", "copy", "extractive"):
        with pytest.raises(ValueError, match=rf"{name} must be a bool, got 'False'"):
            _cfg(**{name: "False"})
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got '0.1'"):
        _cfg(dropout="0.1")  # a TypeError from inside the comparison
    with pytest.raises(ValueError, match="exceeds max_len"):
        Transformer(_cfg(max_len=8))(src, sl, tgt, tl)


@pytest.mark.parametrize("copy", [False, True])
def test_decode_and_init_state_check_memory(copy):
    """memory came unchecked: a wrong width, dtype or rank was a matmul's or an unpack's error in torch, a
    batch that does not match src_lengths an attention's (naming key_lengths)."""
    m = Transformer(_cfg(copy=copy)).eval()
    src, sl, tgt, tl = _batch()
    memory = m.encode(src, sl)
    decode = lambda mem, lengths=sl: m.decode(tgt, mem, lengths, tl, src=src if copy else None)  # noqa: E731
    init = lambda mem, lengths=sl: m.init_state(mem, lengths, 4, src=src if copy else None)  # noqa: E731
    torch.testing.assert_close(decode(memory), m(src, sl, tgt, tl))
    for call in (decode, init):
        with pytest.raises(ValueError, match=r"memory must be the encoder output \(B, Ls, d_model\) = \(B, Ls, 32\), "
                                             r"got shape \(3, 9, 16\)"):
            call(memory[..., :16])
        with pytest.raises(ValueError, match=r"memory must be the encoder output .* got shape \(9, 32\)"):
            call(memory[0])
        for dtype in (torch.float64, torch.bfloat16, torch.int64):
            with pytest.raises(ValueError, match=f"memory must be torch.float32, the model's dtype .* got {dtype}"):
                call(memory.to(dtype))
        with pytest.raises(ValueError, match=r"src_lengths must have shape \(2,\), one per row of memory, got \(3,\)"):
            call(memory[:2])
        with pytest.raises(ValueError, match=r"memory is on meta but the model is on cpu"):
            call(memory.to("meta"))
        with pytest.raises(ValueError, match=r"src_lengths is on meta but memory is on cpu"):
            call(memory, sl.to("meta"))
        with pytest.raises(ValueError, match=r"memory must be a tensor, got list"):
            call(memory.tolist())
        with pytest.raises(ValueError, match=r"src_lengths must lie in \[0, 9\] \(the padded length\)"):
            call(memory, torch.tensor([10, 1, 1]))
    with pytest.raises(ValueError, match="tgt batch 3 != memory batch 2"):
        m.decode(tgt, memory[:2], sl[:2], tl, src=src[:2] if copy else None)
    if copy:
        with pytest.raises(ValueError, match=r"src \(3, 8\) must be the source memory encodes, \(B, Ls\) = \(3, 9\)"):
            m.decode(tgt, memory, sl.clamp(max=8), tl, src=src[:, :8])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's matmuls cast it
        assert decode(memory.bfloat16()).shape == (3, 7, V)
        assert init(memory.bfloat16()).memory.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="memory must be torch.float32, the model's dtype .* got torch.float64"):
            decode(memory.double())  # not one autocast casts (it leaves float64 as it is)


def test_config_refuses_a_max_len_past_the_sinusoid():
    """max_len 2^40 was accepted, though the embedding refuses a position from op_checks.MAX_POSITIONS on."""
    limit = op_checks.MAX_POSITIONS
    with pytest.raises(ValueError, match=f"max_len {limit + 1} is over the sinusoidal positions' limit, {limit}"):
        _cfg(max_len=limit + 1)
    with pytest.raises(ValueError, match="max_len 1099511627776 is over"):
        _cfg(max_len=2**40)
    assert _cfg(max_len=limit).max_len == limit and _cfg(max_len=2**40, pos_encoding=False).max_len == 2**40


@pytest.mark.parametrize("kernel,copy", [("eager", False), ("torch", False), ("torch", True)])
def test_autocast_forward_backward_and_decoding(kernel, copy):
    """bf16 autocast (CPU here; the same path runs on CUDA): close to fp32, and decoding works with
    the fp32 KV caches that autocast leaves behind. The copy layer returns fp32 log-probabilities."""
    torch.manual_seed(0)
    m = Transformer(_cfg(kernel=kernel, copy=copy)).eval()
    src, sl, tgt, tl = _batch()
    ref = m(src, sl, tgt, tl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(src, sl, tgt, tl)
        out.float().sum().backward()

        greedy_decode(m, src, sl, max_len=4)
    assert out.dtype == (torch.float32 if copy else torch.bfloat16)
    for b in range(3):
        torch.testing.assert_close(out[b, : tl[b]].float(), ref[b, : tl[b]], atol=0.15, rtol=0.05)


# ---------------------------------------------------------------------------------------------
# the backend, chosen once when the model is built for a device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,name", [("auto", "eager"), ("eager", "eager"), ("torch", "torch")])
@pytest.mark.parametrize("classifier", [False, True])
def test_build_model_sets_ops_for_the_device(kernel, name, classifier):
    """build_model(cfg, device) resolves cfg.kernel once: model.ops is that backend's bundle and
    every layer holds the same object."""
    cfg = get_config("classifier", src_vocab_size=V, kernel=kernel) if classifier else _cfg(kernel=kernel)
    m = build_model(cfg, "cpu")
    assert m.ops is ops.select(kernel, "cpu") and m.ops.name == name
    holders = [mod for mod in m.modules() if "ops" in vars(mod)]
    assert len(holders) > 5 and all(mod.ops is m.ops for mod in holders)
    assert next(m.parameters()).device.type == "cpu" and not hasattr(m, "kernel_for")
    assert build_model(cfg).ops is m.ops  # device None: CPU
    assert copy.deepcopy(m).encoder.layers[0].ffn.ops is m.ops  # copies and pickles keep the bundle
    assert pickle.loads(pickle.dumps(m)).ops is m.ops


def test_moving_a_model_chooses_its_ops_again(monkeypatch):
    """model.to(device) resolves cfg.kernel for the new device (auto: triton on CUDA), and hands the
    new bundle to every layer; moves within a device type choose nothing."""
    m = build_model(_cfg(kernel="auto"))
    calls = []
    select = ops.select
    monkeypatch.setattr(ops, "select", lambda k, d, *a: calls.append((k, torch.device(d).type)) or select(k, d, *a))
    m.float()  # same device: nothing to choose
    assert calls == []
    m.to("meta")
    assert calls == [("auto", "meta")] and next(m.parameters()).device.type == "meta"
    assert all(mod.ops is m.ops for mod in m.modules() if "ops" in vars(mod))


def test_no_forward_takes_a_backend_argument():
    """The backend travels in self.ops: no function or method of scratchformer.model takes `kernel`."""
    import inspect

    checked = 0
    for module in (layers, transformer, decoding):
        for _, obj in inspect.getmembers(module, lambda o: inspect.isclass(o) or inspect.isfunction(o)):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            funcs = [obj] if inspect.isfunction(obj) else [f for f in vars(obj).values() if inspect.isfunction(f)]
            for f in funcs:
                assert "kernel" not in inspect.signature(f).parameters, f"{obj.__name__}.{f.__name__} takes kernel"
                checked += 1
    assert checked > 30 and "forward" in dir(pkg.Transformer)


def test_old_checkpoints_keep_their_parameter_names():
    """State-dict names are those of the single-module model.py before the package split, so
    checkpoints written before it still load."""
    m = Transformer(ModelConfig(src_vocab_size=10, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                                d_ff=32, norm="pre", final_norm=True))
    layer = lambda p, names: [f"{p}.{n}.{w}" for n in names for w in ("weight", "bias")]  # noqa: E731
    enc = ["self_attn.qkv_proj", "self_attn.out_proj", "ffn.w1", "ffn.w2", "norm1", "norm2"]
    dec = ["self_attn.qkv_proj", "self_attn.out_proj", "cross_attn.q_proj", "cross_attn.kv_proj",
           "cross_attn.out_proj", "ffn.w1", "ffn.w2", "norm1", "norm2", "norm3"]
    expected = (layer("encoder", ["final_norm"]) + ["encoder.embedding.weight"] + layer("encoder.layers.0", enc)
                + layer("decoder", ["final_norm"]) + ["decoder.embedding.weight"] + layer("decoder.layers.0", dec)
                + ["generator.weight", "generator.bias"])
    assert list(m.state_dict()) == expected
    c = build_model(get_config("classifier", src_vocab_size=10, n_encoder_layers=1))
    assert list(c.state_dict()) == (["cls"] + layer("encoder", ["final_norm"]) + ["encoder.embedding.weight"]
                                    + layer("encoder.layers.0", enc) + ["head.weight", "head.bias"])


# ---------------------------------------------------------------------------------------------
# one check of a batch at the boundary, no host sync off the CPU unless debugging
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("classifier", [False, True])
def test_forward_reads_no_values_off_cpu_unless_debugging(monkeypatch, classifier):
    """On a device other than the CPU the model reads no tensor back (a meta tensor cannot be read,
    so any host sync would fail here); with SCRATCHFORMER_DEBUG=1 (op_checks.DEBUG) it checks values."""
    cfg = get_config("classifier", src_vocab_size=V, kernel="eager") if classifier else _cfg()
    m = build_model(cfg, "meta").eval()
    src, sl, tgt, tl = (t.to("meta") for t in _batch())
    run = (lambda: m(src, sl)) if classifier else (lambda: m(src, sl, tgt, tl))
    monkeypatch.setattr(op_checks, "DEBUG", False)
    out = run()
    assert out.device.type == "meta" and out.shape[0] == 3
    monkeypatch.setattr(op_checks, "DEBUG", True)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the value checks now try to read
        run()


def test_debug_checks_name_the_problem(monkeypatch):
    """The value checks' messages: token ids and lengths out of range (on CPU they always run)."""
    monkeypatch.setattr(op_checks, "DEBUG", True)
    tokens, lengths = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([3, 1])
    check_batch("src", tokens, lengths, vocab=7, max_len=8)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 6\), got min 1 max 6 in src"):
        check_batch("src", tokens, lengths, vocab=6, max_len=8)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 7\), got min -1 max 6 in src"):  # below 0 too
        check_batch("src", tokens.where(tokens != 2, -1), lengths, vocab=7, max_len=8)
    with pytest.raises(ValueError, match=r"src_lengths must lie in \[0, 3\] \(the padded length\), got \[3, -1\]"):
        check_batch("src", tokens, torch.tensor([3, -1]), vocab=7, max_len=8)
    with pytest.raises(ValueError, match=r"tgt_lengths must lie in \[0, 3\] \(the padded length\), got \[4, 1\]"):
        check_batch("tgt", tokens, torch.tensor([4, 1]), vocab=7, max_len=8)
    with pytest.raises(ValueError, match=r"tokens_lengths must have shape \(2,\)"):
        check_batch("tokens", tokens, torch.tensor([3]), vocab=7, max_len=8)
    with pytest.raises(ValueError, match=r"src_lengths must have shape \(2,\), one per row of src, got \(2, 1\)"):
        check_batch("src", tokens, lengths[:, None], vocab=7, max_len=8)  # a column would broadcast
    with pytest.raises(ValueError, match=r"src_lengths must be a tensor, got list"):
        check_batch("src", tokens, [3, 1], vocab=7, max_len=8)
    with pytest.raises(ValueError, match=r"src_lengths must be int32/int64, got torch.float32"):  # it named key_lengths
        check_batch("src", tokens, lengths.float(), vocab=7, max_len=8)
    clf = Classifier(get_config("classifier", src_vocab_size=V, kernel="eager"))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 40\)"):
        clf(torch.full((2, 3), V), torch.tensor([3, 3]))


def test_attention_weights_are_zero_on_padded_query_rows():
    """The weights a layer returns for visualisation (need_weights) are those it computed: rows past
    a sequence's length are zeros, as its output there (they were a softmax over the keys)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, ops=ops.select("eager", "cpu")).eval()
    x, lengths = torch.randn(2, 6, 16), torch.tensor([3, 6])
    out, w = mha(x, key_lengths=lengths, query_lengths=lengths, need_weights=True)
    assert torch.all(w[0, :, 3:] == 0) and torch.all(out[0, 3:] == mha.out_proj.bias)
    torch.testing.assert_close(w[0, :, :3].sum(-1), torch.ones(2, 3))
    torch.testing.assert_close(w[1].sum(-1), torch.ones(2, 6))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_are_the_softmax_that_weights_the_values(causal):
    """need_weights returns softmax(q k^T / sqrt(D)) of the layer's own projections (2 heads of D = 8),
    keys past a sequence's length and above the causal diagonal masked out; those weights times v,
    through out_proj, are the layer's output. In float64."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, ops=ops.select("eager", "cpu")).double().eval()
    x, lengths = torch.randn(2, 5, 16, dtype=torch.float64), torch.tensor([3, 5])
    out, w = mha(x, key_lengths=lengths, causal=causal, need_weights=True)
    q, k, v = (t.transpose(1, 2) for t in mha.qkv_proj(x).view(2, 5, 3, 2, 8).unbind(2))  # (B, H, L, D)
    hidden = torch.arange(5)[None, None, :] >= lengths[:, None, None]  # (B, 1, Lk): past the length
    if causal:
        hidden = hidden | torch.ones(5, 5, dtype=torch.bool).triu(1)
    want = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(hidden[:, None], float("-inf")), -1)
    torch.testing.assert_close(w.double(), want, rtol=1e-6, atol=1e-6)  # the weights are computed in fp32
    torch.testing.assert_close(out, mha.out_proj((want @ v).transpose(1, 2).reshape(2, 5, 16)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("autocast", [False, True])
def test_one_matmul_projects_every_layers_memory_as_each_layer_would(autocast):
    """`project_memory`: every decoder layer's cross-attention K/V of the encoder output in one
    matmul; each (k, v) as that layer's own kv_proj gives it (to fp32's rounding; under bf16 autocast
    to bf16's), and the gradient of memory the sum of the layers' (one GEMM's fp32 sum, where each
    layer's came rounded to bf16 under autocast)."""
    torch.manual_seed(0)
    model = build_model(get_config("tiny", src_vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_decoder_layers=3))
    layers = model.decoder.layers
    memory = torch.randn(2, 7, 32, requires_grad=True)
    grads = [torch.randn(2, 7, 4, 8) for _ in range(2 * len(layers))]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = [t for kv in project_memory(layers, memory) for t in kv]
        own = [t for layer in layers for t in layer.cross_attn.kv_proj(memory).view(2, 7, 2, 4, 8).unbind(2)]
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    assert len(ours) == len(own) == 6 and all(a.dtype == b.dtype for a, b in zip(ours, own))
    for a, b in zip(ours, own):
        torch.testing.assert_close(a, b, **tol)
    weights = [layer.cross_attn.kv_proj.weight for layer in layers]
    g_ours = torch.autograd.grad(ours, [memory, *weights], grads)
    g_own = torch.autograd.grad(own, [memory, *weights], grads)
    for a, b in zip(g_ours, g_own):
        torch.testing.assert_close(a, b, **tol)
