"""The whole model on the `triton` backend (Triton kernels on the GPU, or in the interpreter on
CPU; the C++ embedding op) equals the `eager` reference: outputs, every parameter gradient, and
incremental decoding with a KV cache. Models and inputs live on the test device (cuda when
present). Shapes are small because the interpreter is slow, but ragged: lengths 1, 5, 7 with
padding, Lq != Lk in cross-attention, head dim 16."""

import sys

import pytest
import torch
from conftest import DEVICE

from scratchformer.model import BOS_ID, EOS_ID, Classifier, ModelConfig, Transformer, beam_search, greedy_decode

V = 24


def _pair(**kw):
    torch.manual_seed(0)
    base = dict(src_vocab_size=V, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=48,
                dropout=0.0)
    eager = Transformer(ModelConfig(**base, **kw, kernel="eager"))
    triton = Transformer(ModelConfig(**base, **kw, kernel="triton"), device=DEVICE)  # triton is chosen there
    triton.load_state_dict(eager.state_dict())
    return eager.to(DEVICE), triton


def _ints(low, high, shape):
    return torch.randint(low, high, shape).to(DEVICE)


def _lengths(*values):
    return torch.tensor(values, device=DEVICE)


@pytest.mark.parametrize("norm,activation", [("post", "relu"), ("pre", "gelu")])
def test_triton_model_matches_eager_outputs_and_grads(norm, activation):
    eager, triton = _pair(norm=norm, final_norm=norm == "pre", activation=activation)
    src = _ints(4, V, (3, 7))
    sl = _lengths(7, 1, 4)
    tgt = _ints(4, V, (3, 5))
    tl = _lengths(5, 2, 4)
    outs, grads = [], []
    for m in (eager, triton):
        out = m(src, sl, tgt, tl)
        mask = torch.arange(5, device=DEVICE)[None] < tl[:, None]
        (out[mask].logsumexp(-1).sum()).backward()
        outs.append(out[mask])
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)
    for mod in ("attention", "add_layer_norm", "ffn"):  # the kernels really ran
        assert f"scratchformer.kernels.{mod}" in sys.modules
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=2e-4, rtol=2e-3, msg=n)


def test_triton_incremental_decoding_equals_full_recompute():
    _, m = _pair()
    m.eval()
    with torch.no_grad():
        m.generator.bias[EOS_ID] = 2.0
    src, sl = _ints(4, V, (2, 6)), _lengths(6, 3)
    tgt = torch.cat([torch.full((2, 1), BOS_ID, device=DEVICE), _ints(4, V, (2, 4))], 1)
    full = m(src, sl, tgt)
    state = m.init_state(m.encode(src, sl), sl, max_len=5)
    steps = torch.stack([m.decode_step(tgt[:, i : i + 1], state) for i in range(5)], 1)
    torch.testing.assert_close(steps, full, atol=2e-4, rtol=2e-4)
    assert torch.equal(beam_search(m, src, sl, beam_size=1, max_len=5), greedy_decode(m, src, sl, max_len=5))
    # static caches (a CUDA-graph decoding step's): the triton kernel masks the whole buffers by key_lengths
    static = m.init_state(m.encode(src, sl), sl, max_len=5, static=True)
    steps = torch.stack([m.decode_step(tgt[:, i : i + 1], static) for i in range(5)], 1)
    torch.testing.assert_close(steps, full, atol=2e-4, rtol=2e-4)


def test_triton_classifier_matches_eager():
    torch.manual_seed(0)
    cfg = dict(src_vocab_size=V, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=0, d_ff=48,
               num_classes=2, final_norm=True, dropout=0.0)
    eager = Classifier(ModelConfig(**cfg, kernel="eager"))
    triton = Classifier(ModelConfig(**cfg, kernel="triton"), device=DEVICE)
    triton.load_state_dict(eager.state_dict())
    eager = eager.to(DEVICE)
    tok, lengths = _ints(4, V, (2, 6)), _lengths(6, 2)
    torch.testing.assert_close(triton(tok, lengths), eager(tok, lengths), atol=2e-4, rtol=2e-4)
