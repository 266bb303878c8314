"""Activation recomputation (`model.recompute_activations()`, `train --recompute-activations`):
the backward runs each encoder and decoder layer again from its inputs instead of keeping its
activations. Checked against the same model without it, on every backend (our Triton kernels in
the interpreter on the CPU): the same loss and the same gradients with dropout on, since the
recomputed layer must draw the same masks (torch's generators, and our kernels' Philox state
drawn from them); what autograd keeps no longer includes a layer's internals (attention
probabilities, the FFN's hidden layer); evaluation and decoding are untouched."""

import json

import pytest
import torch
from conftest import DEVICE, requires_cuda
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from scratchformer import train as T
from scratchformer.model import Classifier, ModelConfig, Transformer, greedy_decode, transformer
from scratchformer.reference import cross_entropy_ref
from scratchformer.training.config import ConfigError

V, B, LS, LT, D_FF = 32, 3, 9, 7, 80


def _config(kernel, **kw):
    base = dict(src_vocab_size=V, d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=D_FF,
                dropout=0.2, attn_dropout=0.1, ffn_dropout=0.1, kernel=kernel)
    return ModelConfig(**{**base, **kw})


def _batch():
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, V, (B, LS), generator=g), torch.randint(4, V, (B, LT + 1), generator=g)
    sl, tl = torch.tensor([LS, 4, 1]), torch.tensor([LT, 3, 5])
    return [t.to(DEVICE) for t in (src, sl, tgt[:, :-1], tl, tgt[:, 1:])]


def _loss(model, seed):
    src, sl, tgt_in, tl, tgt_out = _batch()
    torch.manual_seed(seed)  # the dropout masks
    logits = model(src, sl, tgt_in, tl)
    keep = torch.arange(LT, device=DEVICE)[None] < tl[:, None]
    return cross_entropy_ref(logits[keep].float(), tgt_out[keep], 0.1)[0]


def _loss_and_grads(model, seed=5):
    loss = _loss(model, seed)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# the interpreter is slow: our kernels once, on a 1+1-layer model (a recomputed layer each side)
@pytest.mark.parametrize("kernel, norm, layers", [("eager", "post", 2), ("eager", "pre", 2), ("torch", "post", 2),
                                                  ("torch", "pre", 2), ("triton", "pre", 1)])
def test_recomputed_layers_give_the_same_loss_and_gradients(kernel, norm, layers):
    torch.manual_seed(0)
    cfg = _config(kernel, norm=norm, final_norm=norm == "pre", n_encoder_layers=layers, n_decoder_layers=layers)
    plain, again = Transformer(cfg, device=DEVICE), Transformer(cfg, device=DEVICE)
    again.load_state_dict(plain.state_dict())
    assert again.recompute_activations() is again
    loss, grads = _loss_and_grads(plain)
    loss_r, grads_r = _loss_and_grads(again)
    torch.testing.assert_close(loss_r, loss, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # and the masks matter: another seed's dropout gives another loss (the checks above can fail)
    with torch.no_grad():
        assert not torch.allclose(_loss(again, seed=6), loss)


def _saved_shapes(model, *inputs):
    """The shapes of the tensors autograd keeps for the backward of one forward (outside the
    recomputed layers, whose own saves go through checkpoint's hooks, not these)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return shapes


def test_a_recomputing_forward_keeps_no_layer_internals():
    torch.manual_seed(0)
    model = Transformer(_config("eager"), device=DEVICE).train()
    src, sl, tgt_in, tl, _ = _batch()
    probs = {(B, 2, q, k) for q, k in ((LS, LS), (LT, LT), (LT, LS))}  # self-, causal and cross-attention

    def internals(shapes):
        return [s for s in shapes if s in probs or s[-1] == D_FF]

    assert internals(_saved_shapes(model, src, sl, tgt_in, tl))  # eager attention keeps its probabilities
    model.recompute_activations()
    assert not internals(_saved_shapes(model, src, sl, tgt_in, tl))
    model.recompute_activations(False)
    assert internals(_saved_shapes(model, src, sl, tgt_in, tl))


def test_encoder_only_models_recompute_too():
    torch.manual_seed(0)
    cfg = _config("eager", n_decoder_layers=0, num_classes=3)
    plain, again = Classifier(cfg, device=DEVICE), Classifier(cfg, device=DEVICE)
    again.load_state_dict(plain.state_dict())
    again.recompute_activations()
    tokens, lengths = _batch()[:2]
    grads = []
    for m in (plain, again):
        torch.manual_seed(5)
        m(tokens, lengths).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_evaluation_and_decoding_are_unchanged(monkeypatch):
    """Only a training forward that builds a graph recomputes: evaluation, a forward without a
    gradient and KV-cached decoding never go through checkpointing, and decode as before."""
    calls = []

    def counted(fn, *args, **kwargs):
        calls.append(fn)
        return checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(transformer, "checkpoint", counted)
    torch.manual_seed(0)
    model = Transformer(_config("eager"), device=DEVICE).eval()
    src, sl, tgt_in, tl, _ = _batch()
    with torch.no_grad():
        before = greedy_decode(model, src, sl, max_len=6)
    model.recompute_activations()
    with torch.no_grad():
        after = greedy_decode(model, src, sl, max_len=6)
    model(src, sl, tgt_in, tl)  # eval mode, with a graph
    model.train()
    with torch.no_grad():
        model(src, sl, tgt_in, tl)  # training mode, no graph
    assert torch.equal(before, after) and calls == []
    model(src, sl, tgt_in, tl)
    assert len(calls) == 4  # 2 encoder and 2 decoder layers


def test_a_compiled_model_recomputes_to_the_same_gradients():
    """torch.compile traces the recomputed layers (one graph, checkpoint as a higher-order op); one
    layer a side, as Dynamo's tracing of each is most of this test's time."""
    torch.manual_seed(0)
    cfg = _config("eager", dropout=0.0, attn_dropout=0.0, ffn_dropout=0.0, n_encoder_layers=1, n_decoder_layers=1)
    plain, again = Transformer(cfg, device=DEVICE), Transformer(cfg, device=DEVICE)
    again.load_state_dict(plain.state_dict())
    again.recompute_activations()
    compiled = torch.compile(again, backend="aot_eager", fullgraph=True)
    (loss, grads), (loss_c, grads_c) = _loss_and_grads(plain), _loss_and_grads(compiled)
    torch.testing.assert_close(loss_c, loss)
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[f"_orig_mod.{name}"], g, msg=name)


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


def test_train_with_recomputed_layers_is_the_same_run(tmp_path):
    """`train --recompute-activations`: the same losses step by step (dropout on); it is said in the
    log and args.json, may be turned on or off when a run resumes, and is refused beside --cuda-graphs."""
    tiny = ["--d-model", "32", "--heads", "2", "--layers", "2", "--d-ff", "64", "--vocab-size", "300", "--batch-size",
            "16", "--max-train-examples", "64", "--max-valid-examples", "16", "--eval-decode-examples", "8",
            "--beam-size", "1", "--log-every", "1", "--no-progress", "--no-plots", "--warmup-steps", "4",
            "--dropout", "0.1", "--attn-dropout", "0.1", "--eval-every", "3", "--seed", "3"]
    T.main(tiny + ["--max-steps", "6", "--out", str(tmp_path / "plain")])
    T.main(tiny + ["--max-steps", "6", "--recompute-activations", "--out", str(tmp_path / "recomputed")])
    plain, recomputed = _train_rows(tmp_path / "plain"), _train_rows(tmp_path / "recomputed")
    assert [s for s, _ in recomputed] == [s for s, _ in plain] == list(range(1, 7))
    assert [loss for _, loss in recomputed] == pytest.approx([loss for _, loss in plain], rel=1e-5)
    assert json.loads((tmp_path / "recomputed" / "args.json").read_text())["recompute_activations"] is True
    assert "layers recomputed in the backward" in (tmp_path / "recomputed" / "log.txt").read_text()
    T.main(["--resume", "--recompute-activations", "--max-steps", "8", "--out", str(tmp_path / "plain"),
            "--no-progress", "--no-plots"])
    assert [s for s, _ in _train_rows(tmp_path / "plain")] == list(range(1, 9))
    resumed_log = (tmp_path / "plain" / "log.txt").read_text().split("done: 6 steps")[-1]
    assert "layers recomputed in the backward" in resumed_log
    T.main(["--resume", "--no-recompute-activations", "--max-steps", "7", "--out", str(tmp_path / "recomputed"),
            "--no-progress", "--no-plots"])  # and turned off
    resumed_log = (tmp_path / "recomputed" / "log.txt").read_text().split("done: 6 steps")[-1]
    assert "resumed from" in resumed_log and "layers recomputed" not in resumed_log
    with pytest.raises(ConfigError, match="--recompute-activations .* --cuda-graphs"):
        T.main(tiny + ["--recompute-activations", "--cuda-graphs", "--out", str(tmp_path / "graphs")])


@requires_cuda
@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_recompute_lowers_peak_memory_on_the_gpu(kernel):
    """At a real shape (the small preset's width, 6+6 layers, 16 x 256 tokens, bf16 autocast; a
    vocabulary of 1,000, so that the layers' activations, not the logits, are what a step holds)
    the peak memory of a training step falls, and the gradients stay those of the plain step."""
    torch.manual_seed(0)
    cfg = dict(src_vocab_size=1000, d_model=256, n_heads=4, n_encoder_layers=6, n_decoder_layers=6, d_ff=1024,
               dropout=0.1, kernel=kernel)
    src = torch.randint(4, 1000, (16, 256), device="cuda")
    lengths = torch.full((16,), 256, device="cuda")
    peaks, grads = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**cfg), device="cuda").recompute_activations(recompute)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(5)
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(src, lengths, src, lengths)
        cross_entropy_ref(logits.float().flatten(0, 1), src.flatten(), 0.1)[0].backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    assert peaks[1] < 0.75 * peaks[0], peaks
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=2e-2, atol=2e-3, msg=name)
