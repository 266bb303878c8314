"""The fused generator + loss (kernels/cross_entropy.py, every backend's `linear_cross_entropy`)
against the float64 spec `reference.linear_cross_entropy_ref` and, independently, the smoothed
target distribution written out as a tensor: the loss, the NLL and the gradients of x, W and b.

On CPU the row kernel runs in Triton's interpreter; the GEMMs are PyTorch's. Tolerances for fp16
and bf16 follow flash-attention's rule: our error against the float64 spec at most twice the
eager path's in the same dtype, plus about one ulp of the largest value.
"""

import math

import pytest
import torch
from conftest import DEVICE, report_diff, requires_cuda
from torch.utils._python_dispatch import TorchDispatchMode

import scratchformer.kernels.cross_entropy as CE
from scratchformer import data as D
from scratchformer import ops
from scratchformer.evaluation.evaluate import eval_loader, evaluate, teacher_forced
from scratchformer.model import PAD_ID, Classifier, Ensemble, Transformer, get_config
from scratchformer.reference import linear_cross_entropy_ref, nll_loss_ref
from scratchformer.training.optim import label_smoothed_loss

pytestmark = pytest.mark.usefixtures("on_test_device")

ULP = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _inputs(N, d, V, dtype, *, bias=True, pad_every=5):
    x = torch.randn(N, d).to(dtype).requires_grad_()
    w = (torch.randn(V, d) / d**0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(V)).to(dtype).requires_grad_() if bias else None
    t = torch.randint(1, V, (N,))
    t[::pad_every] = PAD_ID  # every fifth row is padding, left out
    return x, w, b, t


def _grads(fn, x, w, b, t, eps, scale=0.37, ignore_index=PAD_ID):
    """(loss, nll, dx, dW, db) of fn's loss times `scale` (an upstream gradient that is not 1)."""
    for p in (x, w, b):
        if p is not None:
            p.grad = None
    loss, nll = fn(x, w, b, t, label_smoothing=eps, ignore_index=ignore_index)
    (loss * scale).backward()
    return loss.detach(), nll.detach(), x.grad, w.grad, None if b is None else b.grad


def _float64(x, w, b):
    return tuple(None if p is None else p.detach().double().requires_grad_() for p in (x, w, b))


def _smoothed_target_loss(x, w, b, t, *, label_smoothing, ignore_index):
    """The same loss from the smoothed target distribution q as a tensor: Σ_rows -Σ_j q_j log p_j."""
    z = x @ w.t() + (0 if b is None else b)
    V = z.shape[1]
    q = torch.full_like(z, label_smoothing / (V - 2) if label_smoothing else 0.0)
    q[:, ignore_index] = 0.0
    q.scatter_(1, t[:, None], 1.0 - label_smoothing)
    lp = torch.log_softmax(z, -1)
    keep = t != ignore_index  # rows left out, and columns of probability 0, by where: 0 * -inf is NaN
    return (torch.where(keep, -torch.where(q > 0, q * lp, 0.0).sum(-1), 0.0).sum(),
            torch.where(keep, -lp.gather(1, t[:, None])[:, 0], 0.0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunks", ["one", "several"])
def test_loss_and_gradients_match_the_float64_spec(dtype, eps, bias, chunks, monkeypatch):
    """V = 5,000 spans two of the row kernel's blocks (4,096); "several": chunks of 7 rows, the
    last one short, so dW sums partial GEMMs."""
    N, d, V = 45, 32, 5000
    if chunks == "several":
        monkeypatch.setattr(CE, "CHUNK_ELEMENTS", 7 * V)
    x, w, b, t = _inputs(N, d, V, dtype, bias=bias)
    ours = _grads(CE.linear_cross_entropy, x, w, b, t, eps)
    eager = _grads(linear_cross_entropy_ref, x, w, b, t, eps)  # the unfused path in `dtype`
    spec = _grads(linear_cross_entropy_ref, *_float64(x, w, b), t, eps)
    indep = _grads(_smoothed_target_loss, *_float64(x, w, b), t, eps)
    for name, s, i in zip(("loss", "nll", "dx", "dW", "db"), spec, indep):
        if s is not None:
            torch.testing.assert_close(s, i, rtol=1e-10, atol=1e-12, msg=f"spec vs independent {name}")
    for name, o, e, s in zip(("loss", "nll", "dx", "dW", "db"), ours, eager, spec):
        if s is None:
            assert o is None
            continue
        assert o.dtype == e.dtype, name
        err = report_diff(name, o, s)
        if dtype == torch.float32:
            assert err <= 1e-5 * max(1.0, s.abs().max().item()), name
        else:
            assert err <= 2 * report_diff(f"eager {name}", e, s) + ULP[dtype] * s.abs().max().item(), name


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_log_probabilities_of_a_mixture_are_scored_as_they_are(eps):
    """`nll_loss_ref` (a copy layer's, an ensemble's and R-Drop's loss) takes log-probabilities of a
    distribution that is no softmax of one set of logits: -Σ q log p with q the smoothed target as a
    tensor, PAD rows out, and the gradient of the same."""
    N, V = 9, 40
    a, b = torch.randn(N, V, dtype=torch.float64), torch.randn(N, V, dtype=torch.float64)
    mix = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    lp = torch.log(mix * a.softmax(-1) + (1 - mix) * b.softmax(-1))
    t = torch.randint(1, V, (N,))
    t[::4] = PAD_ID
    q = torch.full((N, V), eps / (V - 2), dtype=torch.float64)
    q[:, PAD_ID] = 0.0
    q.scatter_(1, t[:, None], 1.0 - eps)
    keep = (t != PAD_ID).double()
    want = ((-(q * lp).sum(-1) * keep).sum(), (-lp.gather(1, t[:, None])[:, 0] * keep).sum())
    (want_grad,) = torch.autograd.grad(want[0], mix, retain_graph=True)
    loss, nll = nll_loss_ref(lp, t, eps, PAD_ID)
    torch.testing.assert_close((loss, nll), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, mix)[0], want_grad, rtol=1e-12, atol=1e-12)


def test_nll_is_reported_not_differentiated_and_padding_is_left_out():
    x, w, b, t = _inputs(12, 16, 50, torch.float32, pad_every=1)  # every row padding
    loss, nll = CE.linear_cross_entropy(x, w, b, t, label_smoothing=0.1)
    assert not nll.requires_grad and loss.requires_grad
    loss.backward()
    assert loss.item() == nll.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in (x.grad, w.grad, b.grad))


def test_no_rows_and_no_gradient_wanted():
    x, w, b, t = _inputs(0, 16, 50, torch.float32)
    loss, nll = CE.linear_cross_entropy(x, w, b, t, label_smoothing=0.1)
    loss.backward()
    assert loss.item() == nll.item() == 0.0 and torch.count_nonzero(w.grad) == 0
    x, w, b, t = _inputs(20, 16, 50, torch.float32)
    with torch.no_grad():
        got = CE.linear_cross_entropy(x, w, b, t, label_smoothing=0.1)
    want = linear_cross_entropy_ref(x, w, b, t, label_smoothing=0.1, ignore_index=PAD_ID)
    torch.testing.assert_close(got, want)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):  # bytes: the interpreter moves a kernel's tensors as bytes
                self.largest = max(self.largest, o.untyped_storage().nbytes())
        return out


def test_the_logits_are_never_whole(monkeypatch):
    """The point of the op: its largest tensor is one chunk's logits, where the unfused loss makes
    (N, V) ones. The launcher is watched directly: a dispatch mode does not see inside the
    registered op, which calls it (the op's outputs are (N,), (N, d), (V, d) and (V,))."""
    N, d, V = 64, 4, 300  # V·d and N·d under a chunk's 10·V logits
    monkeypatch.setattr(CE, "CHUNK_ELEMENTS", 10 * V)
    x, w, b, t = (p.detach() if p.is_floating_point() else p for p in _inputs(N, d, V, torch.float32))
    with _LargestTensor() as seen:
        CE.linear_cross_entropy_fwd(x, w, b, t, 0.1, PAD_ID, True)
    assert seen.largest == 10 * V * 4  # fp32
    with _LargestTensor() as seen:
        linear_cross_entropy_ref(x, w.requires_grad_(), b, t, label_smoothing=0.1, ignore_index=PAD_ID)[0].backward()
    assert seen.largest == N * V * 4


def test_every_backend_computes_the_spec(ops_backend):
    x, w, b, t = _inputs(30, 16, 77, torch.float32)
    got = _grads(ops_backend.linear_cross_entropy, x, w, b, t, 0.1)
    want = _grads(linear_cross_entropy_ref, *_float64(x, w, b), t, 0.1)
    for name, g, s in zip(("loss", "nll", "dx", "dW", "db"), got, want):
        torch.testing.assert_close(g.double(), s, rtol=1e-5, atol=1e-6, msg=name)


def test_every_backend_leaves_out_an_ignore_index_that_is_not_pad(ops_backend):
    """ignore_index 5, not PAD_ID (0): the rows whose target is 5 are left out and column 5 gets no
    smoothing mass, while 0 is a class like any other (some targets are 0); against the smoothed target
    distribution written out in float64 (`_smoothed_target_loss`), loss, NLL and every gradient."""
    x, w, b, t = _inputs(30, 16, 77, torch.float32)  # every fifth target 0
    t[1::4] = 5
    got = _grads(ops_backend.linear_cross_entropy, x, w, b, t, 0.1, ignore_index=5)
    want = _grads(_smoothed_target_loss, *_float64(x, w, b), t, 0.1, ignore_index=5)
    for name, g, s in zip(("loss", "nll", "dx", "dW", "db"), got, want):
        torch.testing.assert_close(g.double(), s, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("eps,barred", [(0.0, PAD_ID), (0.1, PAD_ID), (0.0, 7)], ids=["pad", "pad-smoothed", "other"])
def test_every_backend_takes_a_class_barred_by_a_minus_inf_logit(ops_backend, eps, barred):
    """A class whose logit is -inf (a bias barring it: PAD, which no output should hold; or another, no
    target's, without smoothing) has probability 0: loss, NLL and gradients finite, those of the
    smoothed target distribution written out in float64. Triton's smoothing term was 0 * inf = NaN
    without smoothing, and a -inf PAD logit made every backend's smoothed sum -inf - -inf."""
    x, w, b, t = _inputs(30, 16, 77, torch.float32)
    t[t == 7] = 8  # no target is the barred class
    with torch.no_grad():
        b[barred] = float("-inf")
    got = _grads(ops_backend.linear_cross_entropy, x, w, b, t, eps)
    want = _grads(_smoothed_target_loss, *_float64(x, w, b), t, eps, ignore_index=PAD_ID)
    for name, g, s in zip(("loss", "nll", "dx", "dW", "db"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), s, rtol=1e-5, atol=1e-6, msg=name)


def test_every_backend_casts_the_bias_with_x_and_the_weight_under_autocast(ops_backend):
    """autocast casts a linear's input, weight and bias alike: fp32 x, W and b under bf16 autocast are one
    dtype after the backend's casts (not a dtype mismatch), and the loss is that of their bf16 values
    (the float64 spec of the rounded inputs, to the bf16 logits' rounding)."""
    x, w, b, t = (p.detach() if p.is_floating_point() else p for p in _inputs(30, 16, 77, torch.float32))
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        loss, nll = ops_backend.linear_cross_entropy(x, w, b, t, label_smoothing=0.1, ignore_index=PAD_ID)
    want = linear_cross_entropy_ref(*(p.to(torch.bfloat16).double() for p in (x, w, b)), t, label_smoothing=0.1,
                                    ignore_index=PAD_ID)
    torch.testing.assert_close((loss.double(), nll.double()), want, rtol=1e-2, atol=1e-2)


def test_a_bias_alone_takes_its_gradient():
    """Only the generator's bias trainable (x and W frozen): the loss is still differentiated, and db is
    Σ_rows (p - q), the float64 independent loss's."""
    x, w, b, t = _inputs(12, 16, 50, torch.float32)
    x, w = x.detach(), w.detach()
    loss, _ = CE.linear_cross_entropy(x, w, b, t, label_smoothing=0.1)
    (db,) = torch.autograd.grad(loss, b)
    b64 = b.detach().double().requires_grad_()
    want = _smoothed_target_loss(x.double(), w.double(), b64, t, label_smoothing=0.1, ignore_index=PAD_ID)[0]
    torch.testing.assert_close(db.double(), torch.autograd.grad(want, b64)[0], rtol=1e-5, atol=1e-6)


def _model(kernel, copy=False):
    cfg = get_config("tiny", src_vocab_size=70, tgt_vocab_size=70, tie_embeddings="all", d_model=32, n_heads=2,
                     n_encoder_layers=1, n_decoder_layers=1, d_ff=64, dropout=0.0, kernel=kernel, copy=copy)
    torch.manual_seed(0)
    return Transformer(cfg, device=DEVICE)


@pytest.mark.parametrize("kernel,copy", [("eager", False), ("torch", False), ("triton", False), ("eager", True)])
def test_a_model_asked_for_its_loss_scores_its_logits(kernel, copy):
    """forward(target=) equals the trainer's label-smoothed loss of forward's logits, and so do the
    gradients of every parameter (the generator's weight is the embeddings' too: tied)."""
    model = _model(kernel, copy)
    src, tgt = torch.randint(4, 60, (3, 7)), torch.randint(4, 70, (3, 6))
    sl, tl = torch.tensor([7, 5, 2]), torch.tensor([6, 6, 3])
    target = torch.randint(4, 70, (3, 6)).masked_fill(torch.arange(6) >= tl[:, None], PAD_ID)
    loss, nll = model(src, sl, tgt, tl, target=target, label_smoothing=0.1)
    loss.backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want, want_nll = label_smoothed_loss(model(src, sl, tgt, tl).flatten(0, 1), target.flatten(), 0.1)
    want.backward()
    torch.testing.assert_close((loss, nll), (want, want_nll), rtol=1e-5, atol=1e-5)
    for (name, p), g in zip(model.named_parameters(), ours):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="target must have tgt's shape"):
        model(src, sl, tgt, tl, target=target[:, :5])
    with pytest.raises(ValueError, match="returns the loss, not attention weights"):
        model(src, sl, tgt, tl, target=target, need_weights=True)


def test_the_triton_op_is_one_graph_node():
    """opcheck: the registered op's fake impl, schema and autograd-free call agree with the kernel
    (what torch.compile and CUDA graphs rely on)."""
    x, w, b, t = _inputs(10, 16, 40, torch.float32)
    for needs_grad in (False, True):
        torch.library.opcheck(CE._linear_cross_entropy_op, (x.detach(), w.detach(), b.detach(), t, 0.1, 0, needs_grad))
    # a transposed x: dx came back with x's strides (torch.empty_like), the fake impl's contiguous
    # ("Stride mismatch! Strides are (1, 10) and (16, 1)"), which a compiled graph asserts on
    xt = x.detach().t().contiguous().t()
    torch.library.opcheck(CE._linear_cross_entropy_op, (xt, w.detach(), b.detach(), t, 0.1, 0, True))
    assert ops.select("triton", DEVICE).linear_cross_entropy.__wrapped__ is CE.linear_cross_entropy_trusted


def test_the_kernels_entry_refuses_what_it_would_read_out_of_bounds():
    """Callers that reach kernels/cross_entropy.py directly (not through `ops`) get a named error."""
    x, w, b, t = _inputs(4, 16, 10, torch.float32)
    with pytest.raises(ValueError, match=r"int64 target \(N,\); got .* target torch.int32"):
        CE.linear_cross_entropy(x, w, b, t.int())
    with pytest.raises(ValueError, match="ignore_index in \\[0, V\\).*got 10, 0.0 with V = 10"):
        CE.linear_cross_entropy(x, w, b, t, ignore_index=10)
    # 1.5 passed the range test and was read as class 1 (int(ignore_index)), as op_checks refuses it
    with pytest.raises(ValueError, match="ignore_index in \\[0, V\\).*got 1.5, 0.0 with V = 10"):
        CE.linear_cross_entropy(x, w, b, t, ignore_index=1.5)
    # smoothing over V - 2 = 0 classes: refused (it divided by zero)
    with pytest.raises(ValueError, match=r"\(V >= 3 to smooth\); got 0, 0.1 with V = 2"):
        CE.linear_cross_entropy(x, w[:2], b[:2], t.clamp(max=1), label_smoothing=0.1)


def test_a_target_out_of_range_unread_by_the_checks_gives_nan_not_a_guess():
    """On a GPU the targets' values are not read before the kernel (a host sync: op_checks.value_checks,
    without SCRATCHFORMER_DEBUG): a target outside [0, V) then makes its row's loss and gradient NaN
    (until 2026-12-01 the row kernel read the logit past the row and returned a finite wrong loss)."""
    x, w, b, t = _inputs(6, 16, 11, torch.float32)
    t[2], t[3] = 11, -1
    loss, nll = CE.linear_cross_entropy(x, w, b, t, label_smoothing=0.1)
    loss.backward()
    assert loss.isnan() and nll.isnan()
    bad = torch.zeros(6, dtype=torch.bool)
    bad[2:4] = True
    assert x.grad[bad].isnan().all() and x.grad[~bad].isfinite().all()


@requires_cuda
@pytest.mark.parametrize("N,d,V", [(4096, 256, 8000), (2048, 512, 30522)], ids=["small-multi30k", "base-cnndm"])
def test_the_training_shapes_in_bf16_on_a_gpu(N, d, V):
    """The shapes the trainer sends (several chunks at CNN/DailyMail's), bf16 with a native bf16 GEMM
    and the row kernel compiled: the same rule against the float64 spec as above."""
    x, w, b, t = _inputs(N, d, V, torch.bfloat16)
    ours = _grads(CE.linear_cross_entropy, x, w, b, t, 0.1)
    eager = _grads(linear_cross_entropy_ref, x, w, b, t, 0.1)
    spec = _grads(linear_cross_entropy_ref, *_float64(x, w, b), t, 0.1)
    for name, o, e, s in zip(("loss", "nll", "dx", "dW", "db"), ours, eager, spec):
        err = report_diff(name, o, s)
        assert err <= 2 * report_diff(f"eager {name}", e, s) + ULP[torch.bfloat16] * s.abs().max().item(), name


def test_validation_scores_the_models_own_loss():
    """`teacher_forced` takes a seq2seq model's NLL from forward(target=) (the fused op without a
    gradient on triton) and an ensemble's from its mixture: the mean token NLL of their logits."""
    from torch.nn.functional import cross_entropy

    g = torch.Generator().manual_seed(1)
    # The data and the loaders on the host, as a run has them: the module's torch.device(DEVICE) context
    # would put these draws and the DataLoader's seed draw on the GPU beside their CPU generators.
    with torch.device("cpu"):
        ids = [torch.randint(4, 70, (int(n),), generator=g).int().numpy()
               for n in torch.randint(2, 9, (12,), generator=g)]
        ds = D.EncodedDataset(ids[:6], ids[6:], "translation")
        batch = D.collate([ds[i] for i in range(6)]).to(DEVICE)
        for model in (_model("eager").eval(), _model("triton").eval(), Ensemble([_model("eager"), _model("triton")])):
            got = teacher_forced(model, eval_loader(ds, batch_size=4), DEVICE)["loss"]
            with torch.no_grad():
                logits = model(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_lengths)
            want = cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(), ignore_index=PAD_ID)
            assert got == pytest.approx(float(want), rel=1e-5), type(model).__name__


def test_a_classifiers_validation_is_its_mean_nll_and_accuracy_per_example_by_hand():
    """A classifier's teacher-forced loss is the mean over examples of -log p(label) (each scored alone:
    batching, padding and the batch count change nothing), its accuracy the share of argmax hits; and
    `evaluate`'s accuracy on the first `limit` examples is theirs alone."""
    with torch.device("cpu"):  # a CPU model, data and loaders, whatever the module's device context
        cfg = get_config("tiny", src_vocab_size=70, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=0,
                         d_ff=64, dropout=0.0, num_classes=3, final_norm=True, kernel="eager")
        torch.manual_seed(0)
        model = Classifier(cfg).eval()
        g = torch.Generator().manual_seed(2)
        src = [torch.randint(4, 70, (int(n),), generator=g).int().numpy() for n in (3, 7, 2, 5, 4)]
        with torch.no_grad():
            logits = [model(torch.as_tensor(s, dtype=torch.int64)[None], torch.tensor([len(s)]))[0] for s in src]
        logp = [torch.log_softmax(x.double(), -1) for x in logits]
        best = [int(lp.argmax()) for lp in logp]
        labels = [best[0], (best[1] + 1) % 3, best[2], (best[3] + 2) % 3, best[4]]  # 3 of 5 hit, 2 of the first 3
        ds = D.EncodedDataset(src, labels, "classification")
        got = teacher_forced(model, eval_loader(ds, batch_size=2), "cpu")
        nll = -sum(float(lp[y]) for lp, y in zip(logp, labels)) / len(labels)
        assert got["loss"] == pytest.approx(nll, rel=1e-5) and got["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
        assert got["accuracy"] == pytest.approx(60.0)
        examples = [D.Example("x", y) for y in labels]
        result = evaluate(model, ds, examples, None, device="cpu", max_tgt_len=2, limit=3, max_tokens=8)
        assert result.n == 3 and result.metrics["accuracy"] == pytest.approx(200 / 3)
        assert [o["prediction"] for o in result.outputs] == best[:3]
