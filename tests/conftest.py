"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel is defined (`triton.jit` reads it at
decoration time), so it is set here, at collection, when no CUDA device is present: CI runs
every kernel through Triton's CPU interpreter.
"""

import contextlib
import gzip
import json
import os
import random
from pathlib import Path

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

# Under pytest-xdist (`make test`: TEST_WORKERS) each worker takes its share of the cores; torch's
# default, all of them in every worker, oversubscribes the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# The longest files first. `make test` spreads whole files over its workers (--dist loadfile) in
# collection order (--no-loadscope-reorder; xdist's default orders them by test count, which put
# test_gpu_plan.py, then 31 tests and a quarter of the suite's time, among the last: on 2026-12-02 one
# worker ran it alone for the suite's last 5 minutes). Split since: its step 50 rehearsals
# (test_gpu_train_step.py) take a quarter, the rest a sixth (2026-12-07).
LONGEST_FIRST = ("test_gpu_train_step.py", "test_gpu_plan.py", "test_triton_compile.py", "test_torch_ops.py",
                 "test_compile_budget.py")
# On a GPU (scripts/gpu/10_tests.sh, under a time limit, its tests handed out in this order) the files of
# the kernels, of the model on them and of CUDA graphs come first: a cut at the limit then loses tests
# the CPU's CI runs too, not the cases only a GPU runs.
GPU_FIRST = ("test_attention.py", "test_add_layer_norm.py", "test_ffn.py", "test_cross_entropy.py",
             "test_matmul_tma.py", "test_attention_tma.py", "test_partial_sums.py", "test_layer_norm_numerics.py",
             "test_model_triton.py", "test_cuda_graph.py", "test_torch_ops.py", "test_weight_cast.py",
             "test_sublayer_inputs.py", "test_recompute.py", "test_op_checks.py", "test_trainer.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(GPU_FIRST if _HAS_CUDA else LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


DEVICE = "cuda" if _HAS_CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _fast_device_calls():
    """Triton's interpreter patches triton.language (every builtin of tl, tl.core, tl.tensor and
    tl.math, found by inspect.getmembers) for a launch, and again at each call of a @triton.jit
    device function inside it, though nothing changes after the first time: a few hundred setattrs
    a call (1-2 ms), 40% of a decoding test's time in the interpreter. Here a device function
    called inside a launch patches only the modules of its own that the launch has not (tl.cdiv's
    module holds tl.core, a kernel's tl: patched at its first call); the launch's patching and its
    undoing at the end are Triton's own."""
    from triton.runtime import interpreter

    needs = ("GridExecutor", "InterpretedFunction", "InterpreterError", "tl")
    if not all(hasattr(interpreter, n) for n in needs) or not hasattr(interpreter.InterpretedFunction, "rewrite"):
        return  # an interpreter laid out otherwise (another Triton): its own calls, as they are
    launch, call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    lang = (interpreter.tl, interpreter.tl.core)
    patched = []  # per running launch: the ids of the language modules patched so far
    modules_of = {}

    def langs(fn):
        if fn not in modules_of:
            modules_of[fn] = {id(v) for v in fn.__globals__.values() if any(v is m for m in lang)}
        return modules_of[fn]

    def launch_once(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call_unpatched(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1]:
            if patched:
                patched[-1] |= langs(self.fn)
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = launch_once, call_unpatched


if INTERPRET:
    _fast_device_calls()

requires_cuda = pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU (none here)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return DEVICE


def report_diff(name, ours, ref):
    """Print max/mean abs diff before asserting (flash-attention's habit): failures show scale."""
    d = (ours.float() - ref.float()).abs()
    print(f"{name}: max {d.max().item():.3e} mean {d.mean().item():.3e}")
    return d.max().item()


BACKENDS = ("eager", "torch", "triton")


@pytest.fixture
def on_test_device():
    """Tensors made in the test live on the test device: CUDA on a GPU machine (where the triton
    backend runs for real), the CPU here (Triton's interpreter)."""
    with torch.device(DEVICE):
        yield


@pytest.fixture(params=BACKENDS)
def ops_backend(request):
    """Each backend's op bundle (`scratchformer.ops.select`) on the test device."""
    from scratchformer import ops

    return ops.select(request.param, DEVICE)


# A tiny model and run for end-to-end command tests (train, evaluate, generate, average).
TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--vocab-size", "300",
        "--batch-size", "16", "--max-train-examples", "48", "--max-valid-examples", "12", "--eval-decode-examples", "6",
        "--beam-size", "2", "--log-every", "2", "--no-progress", "--preset", "tiny"]
# ... for a classifier, which decodes nothing (train refuses the decoding flags)
TINY_CLASSIFIER = TINY[:16] + TINY[20:]
assert "--beam-size" not in TINY_CLASSIFIER and "--eval-decode-examples" not in TINY_CLASSIFIER


def held_by_another_process(lock: Path):
    """A process holding `lock` (`scratchformer.locks.hold`) until killed: its Popen, once it holds it."""
    import subprocess
    import sys

    hold = ("import sys, time; from pathlib import Path; from scratchformer.locks import hold; "
            "hold(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def translation_folder(root: Path) -> Path:
    """A toy En->De word-for-word data folder (48 train, 12 validation pairs) under root."""
    d = root / "toy_mt"
    d.mkdir()
    words = {"one": "eins", "two": "zwei", "three": "drei", "red": "rot", "house": "Haus", "big": "groß"}
    keys = list(words)
    rows = []
    for i in range(60):
        src = [keys[(i * 7 + j) % len(keys)] for j in range(2 + i % 4)]
        rows.append({"src": " ".join(src), "tgt": " ".join(words[w] for w in src)})
    for split, part in (("train", rows[:48]), ("validation", rows[48:])):
        with gzip.open(d / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
    (d / "meta.json").write_text(json.dumps({"task": "translation"}))
    return d


def random_sentences(rng: random.Random, n: int) -> list[str]:
    """n sentences of 3-7 words from w0..w39, each ending in ' .'."""
    return [" ".join(rng.choice([f"w{i}" for i in range(40)]) for _ in range(rng.randint(3, 7))) + " ."
            for _ in range(n)]


def extractive_folder(root: Path) -> Path:
    """A toy summarization folder under root for `--task extractive`: documents of 4-6 random
    sentences whose summary is their first (a lead a model must learn); 240 train, 40
    validation, 12 test."""
    rng = random.Random(2)
    d = root / "toy_ext"
    d.mkdir()
    for split, n in (("train", 240), ("validation", 40), ("test", 12)):
        with open(d / f"{split}.jsonl", "w") as f:
            for i in range(n):
                sents = random_sentences(rng, rng.randint(4, 6))
                f.write(json.dumps({"id": f"{split}-{i}", "document": " ".join(sents), "summary": sents[0]}) + "\n")
    return d


# A 2 + 2-layer model of the `tiny` preset at d_model 32, and one training loss of it, for tests
# that compare two ways of running the same step (tests/test_weight_cast.py, test_sublayer_inputs.py).
STEP_VOCAB = 50


def step_model(kernel: str, device: str, **overrides):
    """The model (`build_model` of `tiny` with dropout 0.1 and `overrides`), seeded, in training mode."""
    from scratchformer.model import build_model, get_config

    cfg = dict(src_vocab_size=STEP_VOCAB, kernel=kernel, d_model=32, n_heads=2, d_ff=64, dropout=0.1,
               n_encoder_layers=2, n_decoder_layers=2)
    torch.manual_seed(0)
    return build_model(get_config("tiny", **{**cfg, **overrides}), device).train()


def step_loss(model, device: str) -> torch.Tensor:
    """A loss of one fixed batch: a seq2seq model's label-smoothed training loss, a classifier's
    logsumexp of its logits, an extractor's sum of its sentence scores."""
    from scratchformer.model import Classifier, Extractor

    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, STEP_VOCAB, (3, 9), generator=g).to(device)
    lengths = torch.tensor([9, 6, 3], device=device)
    if isinstance(model, Classifier):
        return model(src, lengths).float().logsumexp(-1).sum()
    if isinstance(model, Extractor):
        return model(src, lengths, torch.tensor([[0, 4], [0, 2], [0, 1]], device=device)).float().sum()
    tgt = torch.randint(4, STEP_VOCAB, (3, 7), generator=g).to(device)
    loss, _ = model(src, lengths, tgt[:, :-1], torch.tensor([6, 4, 2], device=device), target=tgt[:, 1:],
                    label_smoothing=0.1)
    return loss


def step_grads(model, device: str, within=None):
    """The loss and every parameter's gradient of one bf16-autocast step of `step_loss`, inside the
    context manager `within` (if any), torch's RNG reseeded first (the same dropout draws each
    time); the gradients are cleared after."""
    torch.manual_seed(2)
    if device == "cuda":
        torch.cuda.manual_seed(2)
    with torch.autocast(device, dtype=torch.bfloat16), within if within is not None else contextlib.nullcontext():
        loss = step_loss(model, device)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


class Dispatched(TorchDispatchMode):
    """The aten ops dispatched inside it that are not views: (name, its first argument's data_ptr or None)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.calls.append((func.__name__, first.data_ptr() if first is not None else None))
        return func(*args, **(kwargs or {}))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def casts_of(self, tensors) -> int:
        """How many dtype casts read one of `tensors` (by storage)."""
        ptrs = {t.data_ptr() for t in tensors}
        return sum(name == "_to_copy.default" and ptr in ptrs for name, ptr in self.calls)
