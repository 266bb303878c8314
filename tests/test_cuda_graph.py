"""CUDA graphs. `scratchformer.training.cuda_graph.capture_step`: a training step captured as a
CUDA graph and replayed trains as the launched step does, on every backend, and its dropout draws
afresh each replay (torch's and our Triton ops'). Decoding with cuda_graph=True (each step a
replay) decodes what launched steps decode, and under autocast with its weights lent as without;
a failed capture leaves the CUDA generator usable.
CUDA graphs need a GPU: everything here but the argument check, the failed capture's clean-up and
`graphs`' plumbing (streams, pool, autocast; CUDA stood in for) is skipped on the CPU machine (GPU
plan, step 10; tests/test_decoding.py checks the static caches the decoding graph reads, on the CPU)."""

import contextlib
import types

import pytest
import torch
from conftest import requires_cuda

from scratchformer import graphs, op_checks
from scratchformer.model import (
    EOS_ID,
    Ensemble,
    ModelConfig,
    Transformer,
    beam_search,
    decoding,
    greedy_decode,
    sample_decode,
    weight_cast,
)
from scratchformer.training.cuda_graph import capture_step

V = 64


def _model(kernel, dropout):
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=V, d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=128,
                      dropout=dropout, attn_dropout=dropout, ffn_dropout=dropout, kernel=kernel)
    return Transformer(cfg, device="cuda").train()


def _batch():
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, V, (4, 12), generator=g), torch.randint(4, V, (4, 9), generator=g)
    sl, tl = torch.tensor([12, 7, 3, 9]), torch.tensor([8, 8, 2, 5])
    tgt_out = tgt[:, 1:].masked_fill(torch.arange(8)[None] >= tl[:, None], 0)
    return [t.cuda() for t in (src, sl, tgt[:, :-1], tgt_out, tl)]


def _update(model, opt, batch, loss_out):
    """One update (forward, backward, clipping, step) writing its loss into loss_out."""
    src, sl, tgt_in, tgt_out, tl = batch

    def update():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss, _ = model(src, sl, tgt_in, tl, target=tgt_out, label_smoothing=0.1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_out.copy_(loss.detach())
    return update


def test_capture_refuses_an_optimizer_that_is_not_capturable():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], capturable=False)
    with pytest.raises(ValueError, match="capturable=True"):
        capture_step(lambda: None, opt)


def test_capture_step_sets_the_gradients_to_none_before_each_update(monkeypatch):
    """What capture_step hands the capture (stood in for here: on a GPU the last call is recorded,
    not run): `warmup` updates, then the captured one, each starting from no gradients, so the
    captured backward creates them in the graph's pool and no replay accumulates."""
    calls = []
    monkeypatch.setattr(graphs, "capture", lambda fn, warmup: ([fn() for _ in range(warmup + 1)], lambda: None))
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)  # capturable AdamW needs CUDA tensors

    def update():
        calls.append(w.grad is None)
        (w * 2).sum().backward()
        opt.step()

    capture_step(update, opt, warmup=3)
    assert calls == [True] * 4


class _Generator:
    def __init__(self, calls):
        self.calls = calls

    def clone_state(self):
        self.calls.append("clone")
        return "state"

    def graphsafe_set_state(self, state):
        self.calls.append(("set", state))

    def get_offset(self):
        return 12

    def set_offset(self, offset):
        self.calls.append(("offset", offset))


def _capture_ending(error, streams):
    class Capture:  # torch.cuda.graph's stand-in: its exit is capture_end, which raises if the capture failed,
        # and only then leaves the capture's stream (torch 2.11's order): a failed end leaves it current
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            self.before, streams["current"] = streams["current"], "capture stream"
            return self

        def __exit__(self, *exc):
            if error:
                raise RuntimeError(error)
            streams["current"] = self.before
    return Capture


def test_a_failed_capture_puts_the_generator_and_the_stream_right(monkeypatch):
    """graphs.record: a capture that fails (here its end, as CUDA reports an invalidated capture)
    puts a clone of the CUDA generator's state in its place (torch 2.11 leaves the generator marked
    as capturing, and every later draw on the device raises), its offset moved past what graphs
    captured before will draw, makes the caller's stream current again (torch's exit left the
    capture's), and lets the error through; a capture that ends well leaves the generator alone; one
    interrupted inside the captured call (Ctrl-C: a KeyboardInterrupt, not an Exception) is put right
    as a failed one."""
    calls, streams = [], {"current": "caller's stream"}
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "default_generators", (_Generator(calls),))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: streams["current"])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: streams.update(current=stream))
    failed = "operation failed due to a previous error during capture"
    monkeypatch.setattr(torch.cuda, "graph", _capture_ending(failed, streams))
    with pytest.raises(RuntimeError, match="during capture"):
        graphs.record(lambda: None)
    assert calls == ["clone", ("set", "state"), ("offset", 12 + 2**50)]  # past what older graphs draw
    assert streams["current"] == "caller's stream"
    calls.clear()
    monkeypatch.setattr(torch.cuda, "graph", _capture_ending(None, streams))
    graphs.record(lambda: None)
    assert calls == [] and streams["current"] == "caller's stream"

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        graphs.record(interrupted)
    assert calls == ["clone", ("set", "state"), ("offset", 12 + 2**50)] and streams["current"] == "caller's stream"


def test_decoding_chooses_graphs_on_a_gpu_unless_told_not_to(monkeypatch):
    """Decoding's default (cuda_graph=None) on a CUDA device: graphs, unless
    SCRATCHFORMER_CUDA_GRAPHS=0 or SCRATCHFORMER_DEBUG=1 (`op_checks.DEBUG`: its value checks read
    the device) or the step is compiled; launched steps on the CPU; an explicit cuda_graph wins.
    (Before, the choice read `ops.DEBUG`, which op_checks.py had taken over: every default decoding
    on a GPU, validation's included, raised AttributeError.)"""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("SCRATCHFORMER_CUDA_GRAPHS", raising=False)
    monkeypatch.setattr(op_checks, "DEBUG", False)
    assert decoding._use_graphs(None, cuda) is True
    assert decoding._use_graphs(None, cpu) is False
    assert decoding._use_graphs(False, cuda) is False and decoding._use_graphs(True, cpu) is True
    # a compiled step (`static_caches`) is torch.compile's to run, as decoding.py says (it was captured
    # around the compiled code too; under reduce-overhead, a capture around inductor's own graphs)
    assert decoding._use_graphs(None, cuda, compiled=True) is False
    assert decoding._use_graphs(True, cuda, compiled=True) is True
    monkeypatch.setattr(op_checks, "DEBUG", True)
    assert decoding._use_graphs(None, cuda) is False
    monkeypatch.setattr(op_checks, "DEBUG", False)
    monkeypatch.setenv("SCRATCHFORMER_CUDA_GRAPHS", "0")
    assert decoding._use_graphs(None, cuda) is False


class _Stream:
    """A stand-in CUDA stream: it logs each stream it is made to wait on."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits on", other.name))


def _stand_in_streams(monkeypatch, log):
    """torch.cuda's current stream and `torch.cuda.stream(s)` stood in for: -> (the caller's stream,
    a dict whose "current" is the current stream). graphs._autocast (CUDA autocast) is a no-op."""
    current = {"current": _Stream("caller", log)}

    @contextlib.contextmanager
    def stream(s):
        before, current["current"] = current["current"], s
        try:
            yield
        finally:
            current["current"] = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current["current"])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(graphs, "_autocast", contextlib.nullcontext)
    return current["current"], current


def test_warm_runs_on_the_side_stream_ordered_between_the_callers_work(monkeypatch):
    """graphs.warm(fn, side): the side stream first waits for the work the caller queued (fn reads
    what it wrote), fn runs with the side stream current, then the caller's stream waits for the
    side stream (the caller's next work reads what fn wrote: ShapeGraphs' first step of a shape
    is a real training step), and the caller's stream is current again; warm returns what fn did."""
    log = []
    caller, streams = _stand_in_streams(monkeypatch, log)

    def fn():
        log.append(("fn runs on", streams["current"].name))
        return "what fn returned"

    assert graphs.warm(fn, _Stream("side", log)) == "what fn returned"
    assert log == [("side", "waits on", "caller"), ("fn runs on", "side"), ("caller", "waits on", "side")]
    assert streams["current"] is caller


@pytest.mark.parametrize("enabled, dtype", [(True, torch.float16), (False, torch.bfloat16)])
def test_warm_ups_and_captures_keep_the_callers_autocast_without_its_cast_cache(monkeypatch, enabled, dtype):
    """graphs._autocast, around every warm-up and capture: CUDA autocast as the caller has it (on or
    off, and its dtype: fp16 here, not only the bf16 torch defaults to), with the cache of cast
    weights off: a capture holds no cache (a cast cached in it would live in the graph's pool, and a
    replay would read a cast the next replay rewrites, or one made before a weight changed)."""
    made = []

    def autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        made.append(dict(device_type=device_type, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: enabled and device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: dtype if device_type == "cuda" else None)
    monkeypatch.setattr(torch, "autocast", autocast)
    graphs._autocast()
    assert made == [dict(device_type="cuda", enabled=enabled, dtype=dtype, cache_enabled=False)]


def test_record_captures_on_the_given_stream_into_the_given_pool(monkeypatch):
    """graphs.record hands torch.cuda.graph the stream the warm-ups ran on and the pool given
    (`ShapeGraphs`' graphs share one), and capture_error_mode="thread_local" (a DataLoader's
    pin-memory thread allocating meanwhile would otherwise invalidate the capture); it returns
    what the captured call returned and the graph's replay."""
    seen = []

    class Capture:  # torch.cuda.graph's stand-in: it records its arguments
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            seen.append(dict(cuda_graph=cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    graph = types.SimpleNamespace(replay=lambda: "replayed")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "caller's stream")
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(graphs, "_autocast", contextlib.nullcontext)
    out, replay = graphs.record(lambda: "captured output", "side stream", "pool")
    assert out == "captured output" and replay() == "replayed"
    assert seen == [dict(cuda_graph=graph, pool="pool", stream="side stream", capture_error_mode="thread_local")]


def test_capture_warms_up_and_records_on_one_side_stream(monkeypatch):
    """graphs.capture(fn, warmup): `warmup` calls of fn on a new side stream, then fn recorded on
    that same stream (a capture on a stream that has not run fn would meet its first cuBLAS
    workspace and Triton compile inside the capture); it returns what `record` returns."""
    log = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "side stream")
    monkeypatch.setattr(graphs, "warm", lambda fn, stream: log.append(("warm", fn, stream)))
    monkeypatch.setattr(graphs, "record", lambda fn, stream=None, pool=None: (
        log.append(("record", fn, stream, pool)) or ("out", "replay")))

    def fn():
        pass

    for warmup in (1, 3):
        log.clear()
        assert graphs.capture(fn, warmup) == ("out", "replay")
        assert log == [("warm", fn, "side stream")] * warmup + [("record", fn, "side stream", None)]


def test_a_failed_capture_releases_the_current_devices_generator(monkeypatch):
    """release_generator puts right the generator of the device the capture ran on (the current
    one, here the second of two), not the first device's."""
    first, second = [], []
    monkeypatch.setattr(torch.cuda, "default_generators", (_Generator(first), _Generator(second)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    graphs.release_generator()
    assert first == [] and second == ["clone", ("set", "state"), ("offset", 12 + 2**50)]


@requires_cuda
def test_the_generator_draws_after_a_failed_capture():
    """A capture that fails (a host read inside) leaves the caller's stream current and torch's CUDA
    generator usable: a draw and a dropout after it run (on torch 2.11 they raised "Offset
    increment outside graph capture encountered unexpectedly"), and a later capture with a draw
    replays."""
    x = torch.ones(64, device="cuda")
    caller = torch.cuda.current_stream()
    with pytest.raises(Exception):  # noqa: B017 - whatever CUDA and torch raise for it
        graphs.record(lambda: float(x.sum()))
    assert torch.cuda.current_stream() == caller  # not the failed capture's side stream
    torch.cuda.synchronize()
    torch.randn(8, device="cuda")
    torch.nn.functional.dropout(x, 0.5)
    out, replay = graphs.capture(lambda: torch.nn.functional.dropout(x, 0.5))
    replay()
    torch.cuda.synchronize()
    assert out.shape == x.shape


@requires_cuda
@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_replays_train_as_launched_steps(kernel):
    """No dropout: 3 warm-up updates + 4 replays end where 7 launched updates end (same init,
    same batch; to within a few percent of how far the parameters moved, as atomics in a backward
    may sum in another order), and the replayed loss falls."""
    batch = _batch()
    graphed, launched = _model(kernel, 0.0), _model(kernel, 0.0)
    init = [p.detach().clone() for p in graphed.parameters()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True) for m in (graphed, launched)]
    loss = torch.zeros((), device="cuda")
    replay = capture_step(_update(graphed, opts[0], batch, loss), opts[0], warmup=3)
    losses = []
    for _ in range(4):
        replay()
        losses.append(float(loss))
    step = _update(launched, opts[1], batch, torch.zeros((), device="cuda"))
    for _ in range(7):
        opts[1].zero_grad(set_to_none=True)
        step()
    assert losses[-1] < losses[0], losses
    for (name, a), b, a0 in zip(graphed.named_parameters(), launched.parameters(), init):
        moved = (b - a0).abs().max().item()
        assert (a - b).abs().max().item() <= 0.05 * moved + 1e-7, f"{name}: replays {a - a0} vs launched {b - a0}"


@requires_cuda
@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_replays_draw_fresh_dropout(kernel):
    """With dropout (on embeddings and sublayers, attention probabilities, the FFN's hidden layer)
    and a learning rate of 0, each replay sees the same parameters and batch: its loss differs
    from the last replay's only through the dropout masks, so it must differ (a host-drawn seed
    would be frozen into the graph and repeat it); without dropout it repeats exactly."""
    batch = _batch()
    for dropout in (0.3, 0.0):
        model = _model(kernel, dropout)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loss = torch.zeros((), device="cuda")
        update = _update(model, opt, batch, loss)

        replay = capture_step(update, opt, warmup=1)
        seen = []
        for _ in range(3):
            replay()
            seen.append(float(loss))
        if dropout:
            assert len(set(seen)) == 3, f"{kernel}: dropout repeated across replays: {seen}"
        else:
            assert len(set(seen)) == 1, f"{kernel}: without dropout replays differ: {seen}"


@requires_cuda
@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "autocast"])
def test_graph_decoding_equals_launched_steps(kernel, dtype):
    """Greedy, beam-3 search and sampling (with n-gram blocking and a minimum length) replaying one CUDA
    graph per step decode the tokens that launched steps do; rows finish at different steps.
    fp32 and bf16 weights, and fp32 weights under bf16 autocast (how evaluate and generate run)."""
    torch.manual_seed(0)
    model = _model(kernel, 0.0).to(torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    with torch.no_grad():
        model.generator.bias[EOS_ID] = 2.0  # some rows end early
    g = torch.Generator().manual_seed(2)
    src, sl = torch.randint(4, V, (6, 11), generator=g).cuda(), torch.tensor([11, 4, 9, 1, 7, 11]).cuda()
    for search in ("greedy", "beam3", "sample"):
        kw = dict(max_len=16, no_repeat_ngram=2, min_len=2)
        if search == "beam3":
            kw["beam_size"] = 3
        decode = {"greedy": greedy_decode, "beam3": beam_search,
                  "sample": lambda *a, **k: sample_decode(*a, n=2, temperature=1.2, **k)[0].flatten(0, 1)}[search]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "autocast"):
            launched, graphed = (decode(model, src, sl, cuda_graph=c, **kw) for c in (False, True))
        assert (launched == EOS_ID).any(), "test needs rows that finish"
        # bf16: the position term's rounding may flip a near-tie; each row must agree up to that
        agree = (launched == graphed).all(1).float().mean().item()
        assert agree >= (1.0 if dtype == "fp32" else 0.8), f"{kernel} {search}: {launched} vs {graphed}"


@requires_cuda
@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_graph_decoding_of_an_ensemble_equals_launched_steps(kernel):
    """An ensemble's step (every member's step and the log of their mean, `model.Ensemble`)
    captured as one CUDA graph decodes what its launched steps decode, greedy and beam 3, fp32;
    the members differ in width and layer norm placement."""
    members = [_model(kernel, 0.0).eval()]
    torch.manual_seed(1)
    cfg = ModelConfig(src_vocab_size=V, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=64,
                      dropout=0.0, norm="pre", final_norm=True, kernel=kernel)
    members.append(Transformer(cfg, device="cuda").eval())
    with torch.no_grad():
        members[0].generator.bias[EOS_ID] = 3.0  # some rows end early
    ensemble = Ensemble(members)
    g = torch.Generator().manual_seed(2)
    src, sl = torch.randint(4, V, (6, 11), generator=g).cuda(), torch.tensor([11, 4, 9, 1, 7, 11]).cuda()
    for beam in (1, 3):
        launched, graphed = (beam_search(ensemble, src, sl, beam_size=beam, max_len=16, no_repeat_ngram=2,
                                         cuda_graph=c) for c in (False, True))
        assert (launched == EOS_ID).any(), "test needs rows that finish"
        assert torch.equal(launched, graphed), f"{kernel} beam {beam}: {launched} vs {graphed}"


@requires_cuda
@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_graph_decoding_under_autocast_with_lent_weights_decodes_as_without(kernel, monkeypatch):
    """Under bf16 autocast the step's graph reads the weights lent in bf16 for the call
    (`WeightCast.for_decoding`), where it held a cast of each one, replayed every step: greedy and
    beam 3 decode the same tokens as the graph with autocast's own casts, bit for bit."""
    model = _model(kernel, 0.0).eval()
    with torch.no_grad():
        model.generator.bias[EOS_ID] = 2.0  # some rows end early
    g = torch.Generator().manual_seed(2)
    src, sl = torch.randint(4, V, (6, 11), generator=g).cuda(), torch.tensor([11, 4, 9, 1, 7, 11]).cuda()

    def decode(lend: bool):
        with monkeypatch.context() as mp, torch.autocast("cuda", dtype=torch.bfloat16):
            if not lend:
                mp.setattr(weight_cast.WeightCast, "for_decoding", lambda m, d: weight_cast.WeightCast(m, None))
            return [beam_search(model, src, sl, beam_size=beam, max_len=16, cuda_graph=True) for beam in (1, 3)]

    lent, own = decode(True), decode(False)
    assert (own[0] == EOS_ID).any(), "test needs rows that finish"
    assert all(torch.equal(a, b) for a, b in zip(lent, own)), f"{kernel}: {lent} vs {own}"
