"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel is defined (`triton.jit` reads it at
decoration time), so it is set here, at collection, when no CUDA device is present: CI runs
every kernel through Triton's CPU interpreter.
"""

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

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

# Under pytest-xdist (`make test`: TEST_WORKERS) each worker takes its share of the cores; torch's
# default, all of them in every worker, oversubscribes the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# The longest files first. `make test` spreads whole files over its workers (--dist loadfile) in
# collection order (--no-loadscope-reorder; xdist's default orders them by test count, which put
# test_gpu_plan.py, 31 tests and a quarter of the suite's time, among the last: on 2026-12-02 one
# worker ran it alone for the suite's last 5 minutes).
LONGEST_FIRST = ("test_gpu_plan.py", "test_triton_compile.py", "test_torch_ops.py", "test_compile_budget.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


DEVICE = "cuda" if _HAS_CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

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
