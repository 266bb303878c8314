"""Shared pieces of the Triton ops: interpreter detection, dtype checks, launch helpers, and the
`@triton.jit` helpers and constants more than one kernel uses (each formula has one home here):

- `LOG2E`: log2(e), for exp(x) = exp2(x · LOG2E);
- `dropout_keep`: the Philox dropout stream every kernel draws from (and replays), and
  `load_dropout_rng`, which loads its (seed, offset) from the op's rng tensor (`dropout_rng`:
  the RNG state lives in device memory, so CUDA graphs and torch.compile draw afresh per call);
- `attention_key_bounds`: the key-loop bounds of an attention query block, shared by the
  attention forward and its dQ backward.

Nothing here knows about the model. Each op file (attention.py, add_layer_norm.py, matmul.py,
ffn.py, cross_entropy.py) imports what it needs from this module.

The ops are registered as torch ops (`scratchformer::attention`, `add_layer_norm`, `ffn` and their
backward ops; `linear_cross_entropy`, whose gradient its forward computes) with
`torch.library.define` + `impl` + `register_fake` (`define_op` below). Each op file gives a
forward op's autograd once, as a `setup_context` and a `backward` that calls its backward op
(`op_autograd` below): registered on the op with `torch.library.register_autograd`, so the op
called through the dispatcher (`torch.ops.scratchformer.attention`, opcheck, a user's own code)
is differentiable, and wrapped in a classic `torch.autograd.Function` that the entry points apply.
The ops with no gradient to give refuse one by name (`no_autograd`): the backward ops, and
`linear_cross_entropy`, whose entry point's Function scales the gradients the op returns. And
the gradients are first-order only: a backward under `create_graph=True` is refused by name
(`first_order`), where it would otherwise hand back gradients with no history, so a gradient
penalty would silently lose its terms through our ops.
Why not `@torch.library.custom_op`, and why the entry points do not call the op through its
registered autograd: custom_op's Python wrappers cost tens of microseconds a call, and the
training step is host-bound (issue 17: our kernels took 13.9 ms of an H100's time per
base/CNN-DM step, the step 70 ms); this registration alone cut an op call's
forward + backward host time by a quarter to a third (`bench/host_overhead.py`; the figures of it and of the
other cuts, `launch_tuned` below among them: `bench/results/2026-11-26-cpu-host-overhead.md`).
The Function is the classic kind (`forward(ctx, ...)`): one with `setup_context` binds its
arguments with inspect.signature on every call (torch 2.13), which cost more than the dispatcher;
and without a gradient wanted the entry points call the op alone. Why not `triton_op` +
`wrap_triton`: on the CPU our kernels run in Triton's interpreter, and a triton_op's kernel
there cannot be traced (the interpreter runs the body on fake tensors; torch 2.13, Triton 3.9,
measured 2026-11: opcheck's fake-tensor test and torch.compile(backend="aot_eager") both fail
with "Attempted to set the storage of a tensor on device meta to a storage on different device
cpu"), and the tests must run here; the launchers also autotune with early_config_prune hooks.
An opaque op with a fake impl traces under torch.compile (fullgraph; dynamo traces the
autograd.Function around it) and torch.export, runs its launcher (and autotuning) at run time,
and keeps no host sync inside, so CUDA graphs can capture it. Autocast does not look inside:
`scratchformer.ops` casts first. The entry points and Functions call an op through `call_op`,
which in plain eager (nothing tracing, recording or intercepting) calls its impl without the
dispatcher.
"""

from __future__ import annotations

import functools
import numbers
import os

import torch
import triton
import triton.language as tl

# Triton's interpreter is chosen when `triton.jit` decorates a function, from this variable; it
# is read once here so every op agrees on it.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# SCRATCHFORMER_AUTOTUNE=0 pins one GPU-sized config per autotuned kernel (each op file names its
# own): no candidate is benchmarked and each specialisation compiles once. For GPU tests and smoke
# runs, where tuning would cost more than it saves (scripts/gpu/). Read at import, like INTERPRET;
# the interpreter always uses its one small config.
AUTOTUNE: bool = os.environ.get("SCRATCHFORMER_AUTOTUNE", "1") != "0"


def tma_setting(variable: str, default: str) -> bool | None:
    """An op's switch of its TMA kernels (tensor-descriptor loads; Hopper and later), read from the
    environment `variable`: "auto" -> None: on GPUs of Hopper and later; "1" -> True: there and
    under the interpreter too (which emulates the descriptors: the tests); "0" -> False: never.
    Any other value is refused by name."""
    value = os.environ.get(variable, default)
    settings = {"auto": None, "1": True, "0": False}
    if value not in settings:
        raise ValueError(f"{variable}={value!r}: expected one of auto, 1, 0")
    return settings[value]


def tma_enabled(setting: bool | None, device: torch.device) -> bool:
    """Whether TMA kernels run on `device` under `setting` (`tma_setting`'s): on a GPU, when not
    off and the GPU is Hopper or later; elsewhere (the interpreter) only when set to 1."""
    if setting is False:
        return False
    return _capability(device) >= 9 if device.type == "cuda" else setting is True


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def tma_rows_ok(t: torch.Tensor, row_stride: int, *offset_strides: int) -> bool:
    """Whether TMA can address t's rows: the last dim contiguous, the base, the descriptor's row
    stride and every stride that only moves its base (`offset_strides`; all in elements) multiples
    of 16 bytes, the row stride at least a row's width (t.shape[-1]) and above 0. Rows that overlap,
    a row stride of 0 (an operand expanded over its rows, such as x.expand(M, d)) or one below the
    width (an unfold's windows: it was taken), make a tensor map CUDA's rules for one
    (cuTensorMapEncodeTiled: each stride at least the extent below it) do not admit; the pointer
    kernels take any strides."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and row_stride > 0 and row_stride >= t.shape[-1]
            and all((s * es) % 16 == 0 for s in (row_stride, *offset_strides)))


def tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors TMA kernels build on the device (`triton.set_allocator`)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "3.6.0" or "2.3.0.dev0+g1234"."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_interpreter_versions(triton_version: str, numpy_version: str) -> None:
    """Triton < 3.7's interpreter converts a 1-element array to int with int(), which numpy >= 2.3
    rejects ("only 0-dimensional arrays can be converted to Python scalars"): every kernel with a
    loop bound computed from a tensor dies inside the interpreter. Measured here with Triton 3.6.0
    + numpy 2.4.6 (fails) and 2.2.6 (all kernel tests pass); Triton 3.7.0 fixed it."""
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 3):
        raise RuntimeError(
            f"TRITON_INTERPRET=1 with triton {triton_version} needs numpy < 2.3 (found numpy "
            f"{numpy_version}): Triton's interpreter before 3.7 fails on newer numpy. Install "
            f"'numpy<2.3' or triton >= 3.7."
        )


if INTERPRET:
    import numpy

    check_interpreter_versions(triton.__version__, numpy.__version__)


def check_tensors(name: str, optional: tuple[str, ...] = (), **tensors) -> None:
    """Each argument a tensor (those named in `optional` may be None), else a ValueError naming it:
    run first at an entry point, before a check reads a device, dtype or shape."""
    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (t is None and arg in optional):
            raise ValueError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")


def check_flag(name: str, arg: str, value) -> None:
    """A flag: True or False. A truthy string such as "False" would be taken as True."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {arg} must be a bool, got {value!r}")


def check_number(name: str, arg: str, value) -> None:
    """A real number (a bool, a tensor, None or a string refused by name: a comparison inside raised a
    bare TypeError, or took True as 1); not checked inside a torch.compile trace, where it may be symbolic."""
    if not torch.compiler.is_compiling() and (isinstance(value, (bool, torch.Tensor))
                                              or not isinstance(value, numbers.Real)):
        raise ValueError(f"{name}: {arg} must be a number, got {value!r}")


def check_dropout(name: str, dropout_p, seed) -> None:
    """dropout_p a number in [0, 1); seed None (drawn: `dropout_rng`) or an int (1.5 was read as 1)."""
    check_number(name, "dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:  # NaN fails too
        raise ValueError(f"{name}: dropout_p must be in [0, 1), got {dropout_p}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"{name}: seed must be an int or None (drawn), got {seed!r}")
    if seed is not None and not -(2**63) <= seed < 2**63:  # torch.tensor's int64 (an OverflowError naming no seed)
        raise ValueError(f"{name}: seed must fit in 64 bits, in [-2**63, 2**63), got {seed}")


def check_device(name: str, *tensors: torch.Tensor | None) -> None:
    """All given tensors on one device; CUDA, or CPU only under the interpreter."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}: inputs are on different devices: {sorted(map(str, devices))}")
    (dev,) = devices
    kind = dev.type  # read once: each .type builds its string (0.2 us; every op call checks)
    if kind == "cpu" and not INTERPRET:
        raise ValueError(
            f"{name}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"import to run on CPU), got {dev}"
        )
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{name}: unsupported device {dev}")


def check_dtype(name: str, *tensors: torch.Tensor | None) -> torch.dtype:
    """All given tensors share one supported floating dtype; returns it."""
    present = [t for t in tensors if t is not None]
    dtypes = {t.dtype for t in present}
    if len(dtypes) > 1:
        raise ValueError(f"{name}: dtype mismatch: {sorted(map(str, dtypes))}")
    dtype = present[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast bf16 operands to fp32 before tl.dot.

    Measured 2026-11 with Triton 3.9 under TRITON_INTERPRET=1: tl.dot on bf16 operands returns
    garbage (errors ~1e10); fp16 and fp32 are fine. On a GPU bf16 dots run natively.
    """
    return INTERPRET and dtype == torch.bfloat16


def dropout_rng(dropout_p: float, seed: int | None, device) -> torch.Tensor | None:
    """The Philox state an op's dropout uses, as a (2,) int64 tensor [seed, offset] on `device`
    that the kernels load (`load_dropout_rng`): None without dropout (p == 0: nothing is drawn);
    [seed, 0] for a given int seed (a fixed stream); otherwise a pair drawn with `torch.randint` on
    `device` from torch's generator for that device.

    Why a tensor in device memory and not two host ints (FlashAttention-2's and Inductor's design):
    - CUDA graphs: host ints passed to a launch are baked into a captured graph, so every replay
      would reuse the first step's masks (a silent wrong answer). A draw on the device is a kernel
      whose output the graph's kernels read, and torch's CUDA generator is graph-safe (a replay
      advances its Philox offset), so every replay draws afresh;
    - torch.compile traces the draw as an ordinary random op in the graph (no `.item()`, so no
      unbacked SymInts and no `capture_scalar_outputs`), fresh on every call of the compiled graph;
    - `torch.manual_seed` (and `torch.cuda.manual_seed`) keep runs reproducible, as before;
    - host cost: one randint on the device per dropout op call, no host sync (the backward reuses
      the forward's tensor); before, two CPU randints and two `.item()`s per call.
    The backward, and the debug mask paths, replay the forward's mask from the same tensor."""
    if not dropout_p > 0.0:
        return None
    if seed is None:
        return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=device)
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------
# Shared @triton.jit helpers and constants (inlined into the kernels that call them)
# ---------------------------------------------------------------------------------------------

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x · LOG2E). Host code: LOG2E.value


@triton.jit
def dropout_keep(seed, offset, rows, cols, row_len, dropout_p):
    """The keep mask of the dropout stream, for positions (rows, cols) (any broadcastable shapes)
    of a matrix row_len wide: keep = rand(seed, offset + row·row_len + col) >= dropout_p, Philox
    (tl.rand) on int64 counters. A backward pass, or a debug mask, replays the forward's bits by
    calling it with the same (seed, offset) and positions."""
    # tl.cast, not .to: a loop index (add_layer_norm's backward rows) is a Python int in the interpreter
    counter = offset + tl.cast(rows, tl.int64) * row_len + tl.cast(cols, tl.int64)
    return tl.rand(seed, counter) >= dropout_p


@triton.jit
def load_dropout_rng(rng_ptr, HAS_DROPOUT: tl.constexpr):
    """(seed, offset) of the dropout stream, loaded from the int64[2] at rng_ptr (`dropout_rng`)
    when HAS_DROPOUT; (0, 0) otherwise, and rng_ptr (then a dummy) is never read."""
    if HAS_DROPOUT:
        seed = tl.load(rng_ptr)
        offset = tl.load(rng_ptr + 1)
    else:
        seed = 0
        offset = 0
    return seed, offset


@triton.jit
def apply_dropout(x, rng_ptr, rows, cols, row_len, dropout_p):
    """(x dropped out, keep mask): the op's stream (`load_dropout_rng`) at positions (rows, cols)
    of a matrix row_len wide; dropped values zeroed, kept ones scaled by 1 / (1 - dropout_p). A
    backward applies it to the gradient with the forward's rng and positions (the same mask); one
    that walks rows in a loop loads the rng once and calls `dropout_keep` instead."""
    seed, offset = load_dropout_rng(rng_ptr, True)
    keep = dropout_keep(seed, offset, rows, cols, row_len, dropout_p)
    return tl.where(keep, x / (1.0 - dropout_p), 0.0), keep


@triton.jit
def attention_key_bounds(
    start_m, klen, qlen, shift, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Key-loop bounds of the query block [start_m, start_m + BLOCK_M): keys [0, n_end) can be
    visible to some row of the block, keys [0, n_full) (whole BLOCK_N blocks) to every row, so
    they need no mask. Query row i sits at key position i + shift (causal aligned bottom-right);
    a block at or past qlen gets n_end = 0 (no loop). Returns (n_full, n_end)."""
    n_end = klen
    n_full = klen
    if IS_CAUSAL:
        n_end = tl.minimum(n_end, start_m + BLOCK_M + shift)
        n_full = tl.minimum(n_full, start_m + 1 + shift)
    n_end = tl.where(start_m < qlen, tl.maximum(n_end, 0), 0)
    n_full = tl.minimum((tl.maximum(n_full, 0) // BLOCK_N) * BLOCK_N, n_end)
    return n_full, n_end


NONE_SHAPE = (0,)  # shape of the empty tensor an op returns in place of an output it did not compute


def or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """t, or in its place a fresh empty (0,) tensor like `like`'s: an op's outputs must not alias
    each other, so each missing one gets its own."""
    return t if t is not None else like.new_empty(NONE_SHAPE)


# Host-side integer helpers for the launchers and grids. triton.cdiv and triton.next_power_of_2 are
# `constexpr_function`s (Triton 3.6 and 3.9), about 1 us a call through their wrapper against a few
# ns here, and a launch makes several.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


# What a `triton.autotune`d kernel launches for a key once its config is chosen: see launch_tuned.
_CHOSEN: dict = {}
# kernel name -> the meta-parameters of its latest tuned or pinned launch (`tuned_launches`)
_LAUNCHED: dict[str, dict] = {}


def tuned_launches(clear: bool = False) -> dict[str, dict]:
    """{kernel name: the config (tile sizes, num_warps, num_stages) of its latest launch through
    `launch_tuned` or `launch_pinned`}: which of its candidates each autotuned kernel ran, or which
    pinned tile, for a benchmark case to record beside its time. clear=True empties the record after
    reading it."""
    launched = dict(_LAUNCHED)
    if clear:
        _LAUNCHED.clear()
    return launched


def launch_tuned(kernel, grid, key: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) for a `triton.autotune`d kernel. `key` holds what the
    Autotuner keys its choice on (its key arguments and the tensor arguments' dtypes): the first
    launch of a key goes through the Autotuner (which tunes, or finds its cached choice), later
    ones launch the JIT function directly with the chosen config's meta-parameters. The Autotuner's
    own lookup builds argument dicts and its key on every call: 12 us a launch of a 30-argument
    kernel (Triton 3.6, the CPU machine, the launch itself stubbed), a hundred launches a training
    step. A `triton.heuristics` layer under the Autotuner (matmul's EVEN_K) is evaluated once, at
    that first launch, and its values kept with the config: it too built a dict of every argument
    per launch (3 us). So a heuristic must be a function of the config and of arguments in the
    autotune key only (EVEN_K: K, a key argument, and BLOCK_K). Our configs have no pre_hook to
    run (reset_to_zero acts only while tuning)."""
    chosen = _CHOSEN.get((kernel, key))
    if chosen is not None:
        fn, meta = chosen
        # fn.run is what fn[grid](...) calls, through a lambda made per launch that repacks the
        # arguments once more: 0.7 us a launch (Triton 3.9)
        fn.run(*args, grid=grid, warmup=False, **kwargs, **meta)
        _LAUNCHED[fn.__name__] = meta
        return
    kernel[grid](*args, **kwargs)
    config = getattr(kernel, "best_config", None)
    if config is None:  # None where Autotuner.run is stubbed (tools/)
        return
    fn, meta = kernel.fn, config.all_kwargs()
    if isinstance(fn, triton.runtime.autotuner.Heuristics):
        named = {**dict(zip(fn.arg_names, args)), **kwargs, **meta}
        meta = {**meta, **{name: heuristic(named) for name, heuristic in fn.values.items()}}
        fn = fn.fn
    _CHOSEN[(kernel, key)] = (fn, meta)
    _LAUNCHED[fn.__name__] = meta


def launch_pinned(kernel, grid, config: dict, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs, **config) for a kernel launched without its tuner (a config an
    op file pins: SCRATCHFORMER_AUTOTUNE=0, the interpreter), `config` recorded as `launch_tuned`
    records its choice: a benchmark case of pinned tiles names them too."""
    kernel[grid](*args, **kwargs, **config)
    _LAUNCHED[kernel.__name__] = config


_LIBRARY = torch.library.Library("scratchformer", "FRAGMENT")  # keeps our registrations alive


def define_op(name: str, schema: str):
    """Decorator: `impl` becomes the torch op `scratchformer::<name>(schema)` on CPU (the
    interpreter) and CUDA -> the op (an OpOverload; `torch.library.register_fake(op)` gives it
    its fake impl). The dispatcher calls `impl` directly: no wrapper of ours or of
    `torch.library.custom_op` in between (module docstring). Our ops mutate nothing and return
    fresh tensors."""

    def register(impl):
        _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, impl, key)
        op = getattr(torch.ops.scratchformer, name).default
        _IMPLS[op] = impl
        return op

    return register


_IMPLS: dict = {}  # op -> the function the dispatcher calls for it on CPU and CUDA (define_op)
# What an op's argument may be for `call_op` to skip the dispatcher: not a tensor subclass (a
# Parameter is one without a dispatch of its own), not a SymInt or SymFloat (a trace)
_PLAIN_ARGS = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, torch.dtype})
# The dispatch keys included in plain eager, in and out of inference mode (which drops
# ADInplaceOrView); any other (Python: a dispatch mode such as FakeTensorMode or make_fx's;
# PreDispatch, Tracer, functorch's, Functionalize) means something intercepts the op's call.
_EAGER_KEYS = frozenset(torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect).add(key).raw_repr()
                        for key in (torch._C.DispatchKey.BackendSelect, torch._C.DispatchKey.ADInplaceOrView))


def call_op(op, *args):
    """op(*args) for one of our ops (`define_op`), by the shortest path that gives its result: in
    plain eager, its impl called directly; under torch.compile or torch.export, a dispatch mode
    (FakeTensorMode, make_fx, a recording mode in the tests), a functorch transform, jit tracing,
    the profiler (which records the op's call), or with an argument of a tensor subclass, through
    the dispatcher. In plain eager the dispatcher has nothing to do for our ops but call the impl
    (no autocast kernel: the caller casts; their autograd kernel has nothing to record, as the
    entry points call an op inside its autograd.Function's forward or when no gradient is wanted),
    and boxing 8-12 arguments into its stack and back cost 2.5-3 us a call, two calls an
    op's forward and backward (torch 2.13, bench/host_overhead.py). The test reads torch 2.13's
    private C functions, a few tens of ns each."""
    if (torch.compiler.is_compiling() or torch._C._dispatch_tls_local_include_set().raw_repr() not in _EAGER_KEYS
            or torch._C._autograd._profiler_enabled() or not _PLAIN_ARGS.issuperset(map(type, args))):
        return op(*args)
    return _IMPLS[op](*args)


def op_autograd(title: str, op, backward_op, setup_context, backward) -> type[torch.autograd.Function]:
    """The autograd of one of our ops, given as `torch.library.register_autograd`'s pair:
    setup_context(ctx, inputs, output) saves what backward(ctx, *grads) needs, which calls
    `backward_op`. Registered on the op, so the op called through the dispatcher
    (`torch.ops.scratchformer.<name>`) is differentiable, and returned as a classic
    autograd.Function named `title` whose forward calls the op by `call_op`: the one the entry
    points apply (module docstring). Either way the gradients are first-order only
    (`first_order`), and `backward_op` called through the dispatcher refuses a gradient by name
    (`no_autograd`)."""
    name = op.name()

    def backward_once(ctx, *grads):
        first_order(ctx, name)
        return backward(ctx, *grads)

    torch.library.register_autograd(op, backward_once, setup_context=setup_context)
    no_autograd(backward_op, f"no gradient: it would be a second derivative of {name}, which our kernels do not give")

    def forward(ctx, *inputs):
        output = call_op(op, *inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(title, (torch.autograd.Function,),
                {"__doc__": f"The autograd of {name}, linking it to its backward op (`op_autograd`).",
                 "__module__": backward.__module__, "forward": staticmethod(forward),
                 "backward": staticmethod(backward_once)})


def no_autograd(op, why: str) -> None:
    """Registers on `op` an autograd that refuses its backward with `why`, naming the op: for an op
    with no gradient to give, called through the dispatcher on inputs that want one (without it,
    autograd's fallback warns, then leaves every gradient None)."""
    def refuse(ctx, *grads):
        raise RuntimeError(f"{op.name()}: {why}")

    torch.library.register_autograd(op, refuse, setup_context=_no_context)


def _no_context(ctx, inputs, output):
    pass


def first_order(ctx, name: str) -> None:
    """Refuses a backward run to be differentiated again (`create_graph=True` with an input that
    wants a gradient): our backward kernels have no derivative of their own, and a gradient they
    return has no autograd history, so a second derivative through it would be silently missing.
    (PyTorch's flash attention has no second derivative either; the eager backend gives one.)"""
    if torch.is_grad_enabled() and any(ctx.needs_input_grad):
        raise RuntimeError(f"{name}: no second derivative (double backward, e.g. backward(create_graph=True) "
                           "for a gradient penalty or a Hessian-vector product): its backward is a fused kernel "
                           "with no derivative of its own; build the model with --kernel eager for that")
