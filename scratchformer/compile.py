"""`--compile`: torch.compile of a whole model, with dynamic shapes so length-bucketed batches do
not recompile every step.

Every backend compiles as one graph (no graph breaks; tests/test_torch_ops.py checks it): `eager`
and `torch` are plain tensor code; `triton`'s hot paths are the `scratchformer::*` custom ops
(kernels/attention.py, add_layer_norm.py, ffn.py; csrc/embed.cpp), each one opaque node with a
fake impl, so the compiler traces around them and calls our kernels at run time.

What `compile_model` does beyond `torch.compile`:
- nothing to resolve: the model chose its ops when it was built (`build_model(cfg, device)`), so
  the Triton entry points are imported before any trace;
- `dynamic=True`: batch and length dims are symbolic from the first compile (parameters stay
  static), instead of the default one static compile per new shape followed by a dynamic
  recompile. Lengths 0 and 1 are still specialised by dynamo (a batch of one, a one-token
  decoder step), so a run sees a handful of graphs, not one per bucket (the measured count is
  in docs/training.md). Only the inputs' dims: each call marks every dim of the tensors it is
  given (`torch._dynamo.maybe_mark_dynamic`, in a pre-hook that runs before dynamo), and the rest
  compiles as torch's default does. `torch.compile(dynamic=True)` makes every Python float of
  the model symbolic too (its dropout rates, eps, the embedding's scale: 21 inputs at one layer
  each side, torch 2.13); dynamo then specialised them all and traced the model a second time
  ("Restarting analysis due to ... _tensorify_python_scalars"), so the first compile took 44 s,
  not 25 s, for the tests' tiny model with aot_eager on 2 cores.

No dynamo flag is needed for the Triton backend's dropout: each op call draws its Philox
(seed, offset) as a (2,) int64 tensor on the model's device (`torch.randint`,
kernels/_common.py's `dropout_rng`), an ordinary random op in the graph whose output the op node
reads; no `.item()`, so no unbacked SymInts (`capture_scalar_outputs`), and fresh masks on every
call of the compiled graph. The draw runs on the device, so `mode="reduce-overhead"` (CUDA graphs)
can capture training graphs with dropout too: torch's CUDA generator is graph-safe, and each
replay draws afresh.

Generation (greedy, beam search) calls `model.encode` and `model.decode` with a KV cache, not
`forward`: `compile_decoding` compiles those two methods in place and makes the model decode with
static caches (`Transformer.static_caches`: fixed-size caches, the step's position a device
tensor, gpt-fast's design; what the GPU's CUDA-graph decoding uses). Every step of a decoding
then has the same shapes and no Python int that changes, so one graph serves them all: the
encoder compiles once, the step for the first batch size (the static caches' size) and once more
(the batch dim dynamic) for the second, and never again, on every backend. Outputs equal the
uncompiled model's up to the rounding of the position term, which the step adds on the device
rather than in the embedding op. Before
(2026-11-28), the cache's fill level was a Python int that `torch`'s and `triton`'s embeddings
took as an int argument: dynamo specialised on it and compiled every step anew (11 frames for 12
greedy steps) until its recompile limit, then ran eager. The price of static caches: each step
attends over all `max_len` slots, masked past the position, instead of the steps so far.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["check_backend", "compile_model", "compile_decoding", "compile_for_inference"]


def check_backend(backend: str | object, error: type[ValueError] = ValueError) -> None:
    """An `error` naming a torch.compile backend that torch does not have (torch's own error comes
    from deep inside dynamo, after a run folder may have been written). Non-str backends (callables)
    are torch's to judge."""
    if not isinstance(backend, str):
        return
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        shown = sorted({*torch._dynamo.list_backends(), "aot_eager", "eager"} & set(known))
        raise error(f"--compile {backend}: torch.compile has no such backend; it has {', '.join(shown)} "
                    "(torch._dynamo.list_backends())")


def compile_model(
    model: nn.Module,
    *,
    dynamic: bool | None = True,
    backend: str | object = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
) -> nn.Module:
    """`torch.compile(model)` for training, evaluation and generation.

    The returned module shares parameters and buffers with `model` (save `model.state_dict()`,
    not the compiled wrapper's, whose keys gain an `_orig_mod.` prefix). dynamic=True marks
    batch and length dims dynamic from the first call; None is torch's automatic dynamic (a
    static first compile, then a recompile that makes the changed dims dynamic). backend "inductor"
    on a GPU; "aot_eager" traces and runs on the CPU (the tests). fullgraph=True turns a graph
    break into an error.
    """
    return _compile(model, dynamic, backend=backend, mode=mode, fullgraph=fullgraph)


def _compile(fn, dynamic: bool | None, **options):
    """torch.compile(fn, dynamic=dynamic), except that dynamic=True makes the dims of the tensors
    each call is given dynamic, not every float (module docstring)."""
    check_backend(options["backend"])
    if dynamic is not True:
        return torch.compile(fn, dynamic=dynamic, **options)
    compiled = torch.compile(fn, dynamic=None, **options)
    if isinstance(compiled, nn.Module):  # the wrapper's own hook: it runs before dynamo
        compiled.register_forward_pre_hook(lambda _, args, kwargs: _mark_dynamic(args, kwargs), with_kwargs=True)
        return compiled

    @functools.wraps(fn)
    def call(*args, **kwargs):
        _mark_dynamic(args, kwargs)
        return compiled(*args, **kwargs)

    return call


def _mark_dynamic(args, kwargs) -> None:
    """Every dim of the call's tensor arguments dynamic (batch, lengths); dynamo may still
    specialise one (a dim of 1) without an error."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            for dim in range(a.dim()):
                torch._dynamo.maybe_mark_dynamic(a, dim)


def compile_decoding(
    model: nn.Module,
    *,
    dynamic: bool | None = True,
    backend: str | object = "inductor",
    mode: str | None = None,
) -> nn.Module:
    """Compile `model.encode` and `model.decode` in place (instance attributes shadowing the
    methods), for `scratchformer.model.decoding`'s greedy and beam search; returns `model`. A model
    without them (the classifier) gets nothing compiled: use `compile_model` for its forward.
    Decoding then runs on static caches (`Transformer.static_caches`, module docstring)."""
    if hasattr(model, "static_caches"):
        model.static_caches = True
    for name in ("encode", "decode"):
        method = getattr(model, name, None)
        if method is not None:
            setattr(model, name, _compile(method, dynamic, backend=backend, mode=mode))
    return model


def compile_for_inference(model: nn.Module, backend: str | object = "inductor") -> nn.Module:
    """What `evaluate --compile` and `generate --compile` use: an encoder-decoder gets its
    `encode`/`decode` compiled in place (the decoding loops call those), a classifier its forward."""
    if hasattr(model, "decode"):
        return compile_decoding(model, backend=backend)
    return compile_model(model, backend=backend)
