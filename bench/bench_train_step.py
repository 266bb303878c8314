"""End-to-end training step per backend, bf16 autocast: forward with the trainer's label-smoothed
loss (the model's own, `forward(target=)`: the backend's `linear_cross_entropy`, the generator and
the loss fused on the triton backend), backward, gradient clipping and the AdamW step, as
`Trainer.train_step` takes them (no host sync; the weights cast to bf16 once a step, in one
multi-tensor op, `scratchformer.training.weight_cast`, but for the compiled and recomputed cases).

Shapes: `base` at CNN/DailyMail shapes (source <= 512, target <= 128 tokens, batch 16), `small` at
SAMSum shapes (source <= 256, target <= 64, batch 64) and `small` at Multi30k shapes (a token-budget
batch of 4,096 padded tokens, cut from length-sorted examples as the trainer's BucketBatchSampler
cuts them), with real padding: lengths drawn from `bench/length_samples.json` (whitespace-token
lengths of the training data, clipped).
Backends: eager, torch, triton, and torch.compile of the eager model (`compile`) beside
torch.compile of our triton model (`compile-triton`, its kernels as `scratchformer::*` op nodes in
the graph), both through `scratchformer.compile.compile_model` with static shapes (one batch shape
here; training uses dynamic=True). Reported in extra_info:
non-pad tokens/s (source + target), step time, peak memory (torch.cuda.max_memory_allocated; a graphed
step's over its capture, since a replay allocates nothing the allocator counts).

`test_train_step_recompute` times eager's and our kernels' step at base/CNN-DM with every encoder
and decoder layer recomputed in the backward (`--recompute-activations`): what it costs in step time
and saves in peak memory beside the same backend's `test_train_step` case. It is opt-in on the GPU
plan (step 30 leaves it out unless BENCH_K names it).

Each case runs twice: `test_train_step`, the step as the trainer runs it (every op launched from
Python: on an H100 the host's side, not the GPU, set the pace of every backend, issue 17), and
`test_train_step_graph`, the same step captured once in a CUDA graph and replayed
(`scratchformer.training.cuda_graph`: no host work per kernel, so the device's time; AdamW
`capturable`, autocast without its weight cache).
"""

import json
import os

import pytest
import torch
from conftest import requires_cuda, run_bench

from scratchformer.compile import compile_model
from scratchformer.data import PAD_ID, BucketBatchSampler
from scratchformer.model import build_model, get_config
from scratchformer.training import weight_cast
from scratchformer.training.config import TrainConfig
from scratchformer.training.cuda_graph import capture_step

pytestmark = [pytest.mark.benchmark(group="train_step"), requires_cuda]

SHAPES = {
    # batch: sentences per batch, or max_tokens: a token budget (batch size * longest length)
    "base-cnndm": dict(preset="base", vocab=30522, max_src=512, max_tgt=128, batch=16, sample="cnn_dailymail"),
    "small-samsum": dict(preset="small", vocab=8000, max_src=256, max_tgt=64, batch=64, sample="samsum"),
    "small-multi30k": dict(preset="small", vocab=8000, max_src=128, max_tgt=128, max_tokens=4096, sample="multi30k"),
}


def sample_lengths(shape, seed=0):
    """(source lengths, target lengths incl. EOS) of one batch of `shape`, clipped to its maxima."""
    spec = SHAPES[shape]
    with open(os.path.join(os.path.dirname(__file__), "length_samples.json")) as fh:
        pairs = json.load(fh)[spec["sample"]]["lengths"]
    sl = torch.tensor([min(max(s, 1), spec["max_src"]) for s, _ in pairs])
    tl = torch.tensor([min(max(t + 1, 2), spec["max_tgt"]) for _, t in pairs])  # + EOS
    if "max_tokens" in spec:  # the trainer's batching; the batch of median length stands for the epoch
        sampler = BucketBatchSampler(torch.maximum(sl, tl + 1).tolist(), max_tokens=spec["max_tokens"], seed=seed)
        batches = sorted(sampler, key=lambda b: int(torch.maximum(sl[b], tl[b]).max()))
        idx = torch.tensor(batches[len(batches) // 2])
    else:
        idx = torch.randint(len(pairs), (spec["batch"],), generator=torch.Generator().manual_seed(seed))
    return sl[idx], tl[idx]


def make_batch(shape, seed=0, device="cuda"):
    """src, src lengths, decoder input, decoder target (PAD past each length), target lengths: random
    tokens, real lengths."""
    sl, tl = sample_lengths(shape, seed)
    g = torch.Generator().manual_seed(seed)
    vocab = SHAPES[shape]["vocab"]
    src = torch.randint(4, vocab, (len(sl), int(sl.max())), generator=g)
    tgt = torch.randint(4, vocab, (len(sl), int(tl.max()) + 1), generator=g)
    tgt_out = tgt[:, 1:].masked_fill(torch.arange(tgt.shape[1] - 1)[None] >= tl[:, None], PAD_ID)
    return [t.to(device) for t in (src, sl, tgt[:, :-1], tgt_out, tl)]


COMPILED = {"compile": "eager", "compile-triton": "triton"}  # case -> the backend compiled
RECOMPUTED = {"eager-recompute": "eager", "triton-recompute": "triton"}  # case -> the backend, layers recomputed


def training_step(shape, kernel, device="cuda", graph=False):
    """(step, batch): a closure running one optimizer step of `shape` on `kernel` (a COMPILED case:
    torch.compile of that backend; a RECOMPUTED case: that backend, its layers recomputed in the
    backward), bf16 autocast on CUDA, fp32 on CPU; and the batch it trains on.
    With graph, the step is a CUDA graph's replay (`capture_step`). bench/profile_train_step.py
    profiles the same closure."""
    spec = SHAPES[shape]
    torch.manual_seed(0)
    cfg = get_config(spec["preset"], src_vocab_size=spec["vocab"],
                     kernel=COMPILED.get(kernel) or RECOMPUTED.get(kernel, kernel))
    model = build_model(cfg, device).recompute_activations(kernel in RECOMPUTED).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), fused=device == "cuda",
                            capturable=graph)
    batch = make_batch(shape, device=device)
    src, sl, tgt_in, tgt_out, tl = batch
    ntok = int(tl.sum())  # the trainer counts these on the host, with the batch
    fwd = compile_model(model, dynamic=False) if kernel in COMPILED else model
    # the weights cast once a step, where the trainer's step does it (not compiled or recomputed)
    run = TrainConfig(precision="bf16" if device == "cuda" else "fp32", recompute_activations=kernel in RECOMPUTED,
                      compile="inductor" if kernel in COMPILED else None)
    cast = weight_cast.for_step(model, run, ddp=False)

    def update():
        # a graph cannot hold autocast's cache of cast weights (torch.cuda.graph's documentation)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda", cache_enabled=not graph), cast():
            loss, _ = fwd(src, sl, tgt_in, tl, target=tgt_out, label_smoothing=0.1)
        (loss / ntok).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    if graph:
        def captured():
            # A replay allocates nothing (the caching allocator's stats stand still while it runs), so
            # the graphed step's peak memory is read from its capture, which allocates as a step does
            # (until 2026-12-01 it was read over the replays: parameters, gradients and AdamW's state,
            # no activations, the same for every backend). After the capture's zero_grad, as the
            # launched step's reset follows its own.
            if torch.cuda.is_current_stream_capturing():
                torch.cuda.reset_peak_memory_stats()
            update()

        return capture_step(captured, opt), batch

    def step():
        update()
        opt.zero_grad(set_to_none=True)

    return step, batch


SHAPE = pytest.mark.parametrize("shape", list(SHAPES))
KERNEL = pytest.mark.parametrize("kernel", ["eager", "torch", "triton", *COMPILED])


@SHAPE
@KERNEL
def test_train_step(benchmark, shape, kernel):
    """The step as the trainer runs it: every op launched from Python."""
    _bench_step(benchmark, shape, kernel, graph=False)


@SHAPE
@KERNEL
def test_train_step_graph(benchmark, shape, kernel):
    """The same step replayed as one CUDA graph: the device's time, no host work per kernel."""
    _bench_step(benchmark, shape, kernel, graph=True)


@pytest.mark.parametrize("kernel", list(RECOMPUTED))
def test_train_step_recompute(benchmark, kernel):
    """The launched step at base/CNN-DM (the largest activations) with its layers recomputed."""
    _bench_step(benchmark, "base-cnndm", kernel, graph=False)


def _bench_step(benchmark, shape, kernel, graph):
    step, (src, sl, tgt_in, _, tl) = training_step(shape, kernel, graph=graph)
    step()
    torch.cuda.synchronize()
    if not graph:  # a graphed step's peak is its capture's (training_step), which a reset here would drop
        torch.cuda.reset_peak_memory_stats()
    median = run_bench(benchmark, step, warmup=3, rounds=10, graph=False, shape=shape, preset=SHAPES[shape]["preset"],
                       dtype="bf16-autocast", batch=len(sl), src_max=src.shape[1], tgt_max=tgt_in.shape[1])
    tokens = int(sl.sum() + tl.sum())
    benchmark.extra_info.update(
        kernel=kernel, graph=graph, tokens_per_s=tokens / median, step_ms=median * 1e3, non_pad_tokens=tokens,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
    )
