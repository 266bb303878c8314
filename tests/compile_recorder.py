"""A stand-in for Triton's GPU compiler that counts compiles on a CPU (tests/test_compile_budget.py).

Loaded with TRITON_INTERPRET unset, so the kernels are real `JITFunction`s with their GPU autotune
lists. `JITFunction.run` is replaced by a recorder that computes the key Triton 3.9's kernel cache
uses (runtime/jit.py `run`: the binder's specialization list, from the same
`create_function_from_signature` and `native_specialize_impl`, plus the launch options such as
num_warps and num_stages; constexprs, including an autotune config's, are part of the
specialization) and launches nothing. The autotuner runs unchanged except for its benchmarker,
which calls each candidate once (so every pruned config of every new key reaches the recorder, as
it would be compiled on a GPU) and reports equal times (the first candidate wins).

Each launch is keyed twice: with the kernel's own `do_not_specialize` list and with none (as if
every integer argument were specialised), so one run also measures what the lists save.

Used two ways, both in a subprocess (the environment decides which configs exist):
  python -O -m pytest --assert=plain -p compile_recorder tests/test_attention.py ...
      the kernel tests' launches (outputs are never computed, so asserts and assert_close are off)
  python tests/compile_recorder.py train STEPS
      a training run of the `small` model on varied sequence lengths (bf16 autocast)
Both write {"declared": {kernel: compiles}, "all_specialised": {...}} to $COMPILE_RECORD_OUT.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
from triton.backends.compiler import BaseBackend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, KernelParam, create_function_from_signature

_keys: dict[str, set] = {"declared": set(), "all_specialised": set()}
_binders: dict[int, dict] = {}


def _binders_of(fn: JITFunction) -> dict:
    if id(fn) not in _binders:
        every = [KernelParam(p.num, p._param, False, False) for p in fn.params]
        _binders[id(fn)] = {
            "declared": create_function_from_signature(fn.signature, fn.params, BaseBackend),
            "all_specialised": create_function_from_signature(fn.signature, every, BaseBackend),
        }
    return _binders[id(fn)]


def _record(self, *args, grid, warmup, **kwargs):
    for variant, binder in _binders_of(self).items():
        _, specialization, options = binder(*args, **kwargs)
        _keys[variant].add((self.__name__, str(specialization), str(sorted(options.items()))))
    return None


def _bench_once(kernel_call, quantiles=None):
    kernel_call()
    return [1.0, 1.0, 1.0]


def install() -> None:
    """Patch Triton and the kernels' device check (CPU tensors stand in for CUDA ones)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_recorder needs TRITON_INTERPRET unset: it counts GPU compiles")
    JITFunction.run = _record
    Autotuner.do_bench = property(lambda self: _bench_once)
    from scratchformer import ops
    from scratchformer.kernels import _common

    _common.check_device.__code__ = (lambda name, *tensors: None).__code__
    if hasattr(ops, "_prepare_triton"):  # the triton backend on CPU would ask for the interpreter
        ops._prepare_triton = lambda device: None
    torch.testing.assert_close = lambda *args, **kwargs: None


def counts() -> dict:
    out = {}
    for variant, keys in _keys.items():
        per = defaultdict(int)
        for name, *_ in keys:
            per[name] += 1
        out[variant] = dict(sorted(per.items()))
    return out


def dump() -> None:
    path = os.environ.get("COMPILE_RECORD_OUT")
    if path:
        with open(path, "w") as fh:
            json.dump(counts(), fh, indent=1)


# pytest plugin (-p compile_recorder): install before the test modules import the kernels
def pytest_configure(config):
    install()


def pytest_sessionfinish(session, exitstatus):
    dump()


class _ShapeOnlyLinear(torch.autograd.Function):
    """nn.Linear without the arithmetic (outputs and gradients of the right shape and autocast dtype,
    uninitialised): the eager parts would cost the CPU seconds per step, and no kernel's launch
    depends on their values."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.meta = (x, weight, bias)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.meta
        return torch.empty_like(x), torch.empty_like(weight), None if bias is None else torch.empty_like(bias)


def _shape_only_eager() -> None:
    from scratchformer.kernels import ffn

    torch.nn.Linear.forward = lambda self, x: _ShapeOnlyLinear.apply(x, self.weight, self.bias)
    ffn._wgrad = lambda a, b: a.new_empty((a.shape[0], b.shape[1]))  # torch.matmul: no Triton launch


def simulate_training(steps: int, seed: int = 0) -> None:
    """`steps` training steps of the `small` preset's structure (pre-norm, final norms, dropout 0.1)
    narrowed to d_model 64, 4 heads of 16, d_ff 256, 1+1 layers, vocabulary 64: each width is one
    fixed kernel argument and every layer launches alike, so the count does not depend on them.
    The step's loss is the model's own, as `optim.batch_loss` trains (the generator and the
    label-smoothed loss in one op: kernels/cross_entropy.py). bf16 autocast, batches of 8 examples
    whose source / target lengths are drawn from SAMSum's (bench/length_samples.json, clipped to
    256 / 64, as bench_train_step does), so nearly every step brings new lengths and token counts;
    greedy decoding (KV cache: one query against 1, 2, ... keys) of the batch every 100 steps, as
    validation does."""
    from scratchformer.model import Transformer, get_config, greedy_decode

    _shape_only_eager()
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "bench", "length_samples.json")) as fh:
        lengths = json.load(fh)["samsum"]["lengths"]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    vocab = 64
    cfg = get_config("small", src_vocab_size=vocab, kernel="triton", d_model=64, n_heads=4, d_ff=256,
                     n_encoder_layers=1, n_decoder_layers=1)
    model = Transformer(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(1, steps + 1):
        idx = torch.randint(len(lengths), (8,), generator=g)
        sl = torch.tensor([min(max(lengths[i][0], 1), 256) for i in idx])
        tl = torch.tensor([min(max(lengths[i][1] + 1, 2), 64) for i in idx])
        src = torch.randint(4, vocab, (8, int(sl.max())), generator=g)
        tgt = torch.randint(4, vocab, (8, int(tl.max())), generator=g)
        tgt_out = tgt.roll(-1, 1)  # the next tokens (their values reach no kernel's key); no new draws from g
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the model's own loss, as training computes it
            loss, _ = model(src, sl, tgt, tl, target=tgt_out, label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                greedy_decode(model, src, sl, max_len=64)


if __name__ == "__main__":
    if sys.argv[1:2] != ["train"]:
        raise SystemExit("usage: python tests/compile_recorder.py train STEPS")
    install()
    simulate_training(int(sys.argv[2]))
    dump()
    print(json.dumps(counts()))
