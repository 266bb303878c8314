"""How many times would the Triton kernels compile on a GPU? Counted on the CPU, and kept in budget.

A GPU window is 15 minutes and a Triton compile takes 1-3 s of CPU, so compiles are the dominant
cost of the GPU tests (scripts/gpu/ runs them in many processes at once) and a real cost of training
on length-bucketed batches. tests/compile_recorder.py stands in for Triton's compiler: in a
subprocess without the interpreter (the kernels' real GPU autotune lists), it keys every launch as
Triton 3.9's kernel cache does (specialisation of every argument, constexprs, launch options), lets
the autotuner benchmark every pruned config of every new key, and launches nothing. Two workloads,
each with autotuning on and with SCRATCHFORMER_AUTOTUNE=0 (one pinned config per kernel, as
scripts/gpu/ runs the tests):

- the kernel test suite (tests/test_attention.py, test_attention_tma.py, test_add_layer_norm.py,
  test_ffn.py, test_cross_entropy.py, test_model_triton.py; its GPU-only cases are skipped on a CPU and not counted);
- a 300-step bf16 training run of the `small` model's structure on SAMSum-like lengths (new
  lengths and token counts nearly every step), with greedy decoding every 100 steps.

Measured 2026-11-23 with Triton 3.9 (total compiles, all kernels; "before" is the kernels before
bucketed keys and do_not_specialize, when every config of every key compiled for each new raw
length, seed and offset class; "no do_not_specialize" keys today's launches as if every integer
argument were specialised):

| workload | before, tuned | tuned | SCRATCHFORMER_AUTOTUNE=0 | no do_not_specialize: tuned / pinned |
| --- | --- | --- | --- | --- |
| kernel tests | 3,169 | 1,323 | 246 | 2,050 / 351 |
| 300 training steps | 290 | 139 | 18 | 207 / 54 |

2026-11-26, dropout's (seed, offset) moved from two integer arguments into a (2,) int64 tensor the
kernels load (kernels/_common.py's `dropout_rng`): the declared counts did not change, kernel by
kernel (suite 1,420 tuned / 298 pinned, training 140 / 19, before and after: the seed and offset
were already unspecialised, and the pointer that replaces them is always 16-byte aligned); the
all-specialised ones fell (training 219 -> 202 tuned, 65 -> 48 pinned; suite 2,135 -> 2,131, 391 ->
387), as there is no seed or offset left to specialise.

2026-11-26, after the fourth GPU window: the suite counts tests/test_attention_tma.py too (the
attention kernels with their TMA path forced: about 35 pinned compiles) and add+LayerNorm's backward is
autotuned like its forward: suite 1,839 tuned / 334 pinned (all-specialised 2,610 / 428; 14 GPU
processes compiled the pinned suite's ~300 inside 103 s of pytest that day), training 144 / 19;
the suite's budgets went from 1,700 / 300 to 2,100 / 370.

2026-11-27, add+LayerNorm's and the FFN bias's second stage became a kernel of its own
(kernels/partial_sums.py), whose GPU tile does not follow the batch's rows: suite 2,011 tuned / 366
pinned (11 of them that kernel's), training 148 / 21 (2 of them); with a tile that followed the
partials' row count it was 22 and 5 (377 pinned: over budget), as each batch size recompiled it.

2026-11-28, attention's tuners leave out the configs that spill (`kernels/attention.py`
MAX_LIVE_VALUES) and its backward writes lse in log2 units in its preprocessing pass: suite 2,011 ->
1,983 tuned, 366 pinned and training 148 / 21 unchanged. A first version kept δ and that lse in one
(2, B, H, Lq) buffer: 2,175 / 396, over both budgets, as the second half's pointer was 16-byte
aligned only when B·H·Lq was a multiple of 4, which Triton specialises on (two buffers since).

2026-11-29, the fused generator + loss (kernels/cross_entropy.py): the training run's step takes the model's
own loss, as training does, 148 -> 149 tuned, 21 -> 22 pinned (one `_cross_entropy_kernel`); the suite
adds tests/test_cross_entropy.py, 2,000 -> 2,007 tuned, 369 -> 376 pinned (its 7 compiles: one kernel,
not autotuned), so the pinned suite's budget goes from 370 to 390.

2026-12-05, add+LayerNorm takes a 16-bit x beside an fp32 residual (the autocast model's stream):
its tests' new dtype pairs took the suite to 2,074 tuned / 394 pinned (the test's check against
the eager reference replays the dropout mask: 4 of them), training 150 / 22; the pinned suite's
budget goes from 390 to 400.

2026-12-05 (seventh session), add+LayerNorm writes the next sublayer's input in autocast's dtype
(y_dtype, copy_dtype and the copy's gradient in the backward): the new flags' tests (8 cases, each
dtype pair and flag once) took the suite to 2,172 tuned / 413 pinned (add+LayerNorm's forward 64 ->
73, backward 67 -> 77 in test_add_layer_norm.py alone), training 153 / 23 (the small model is
Post-LN: its norms write a copy, its final norms do not); the suite's budgets go from 2,100 / 400 to
2,300 / 430.

Budgets: the pinned suite must stay a few hundred compiles (at 1-3 s each, over 14 processes, it
then fits the 2-minute test step of scripts/gpu/); the pinned training run a few dozen (a minute or
two of compiling in a 300-step smoke run); tuned runs cost the configs per key more (each new key
benchmarks every pruned config), budgeted at about 1.3x what was measured, so a new
specialisation, a raw length in a key or a longer config list shows up as a failure. The last test
shows the budgets catch such a regression: the same launches keyed as if every integer argument
were specialised (no do_not_specialize) break them.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = ["tests/test_attention.py", "tests/test_attention_tma.py", "tests/test_add_layer_norm.py", "tests/test_ffn.py",
         "tests/test_cross_entropy.py", "tests/test_model_triton.py"]
STEPS = 300

BUDGET = {  # (workload, autotune) -> most compiles allowed, all kernels together
    ("suite", "1"): 2300,
    ("suite", "0"): 430,
    ("train", "1"): 180,
    ("train", "0"): 40,
}


def _run(workload: str, autotune: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"{workload}-{autotune}.json")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_AUTOTUNING")}
    env.update(TRITON_INTERPRET="0", SCRATCHFORMER_AUTOTUNE=autotune, COMPILE_RECORD_OUT=out,
               PYTHONPATH=os.path.join(REPO, "tests"), OMP_NUM_THREADS="1")
    if workload == "suite":  # outputs are never computed: asserts off (-O, plain asserts)
        cmd = [sys.executable, "-O", "-m", "pytest", "--assert=plain", "-p", "compile_recorder", "-p",
               "no:cacheprovider", "-q", "-o", "addopts=", *SUITE]
    else:
        cmd = [sys.executable, os.path.join(REPO, "tests", "compile_recorder.py"), "train", str(STEPS)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if not os.path.exists(out):
        raise AssertionError(f"the recorder wrote nothing ({workload}, autotune {autotune}):\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as fh:
        return json.load(fh)


@cache
def _counts() -> dict:
    """All four recordings, two at a time (each is one single-threaded process)."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="compile-budget-")
    with ThreadPoolExecutor(2) as pool:
        jobs = {key: pool.submit(_run, *key, tmp) for key in BUDGET}
        counts = {key: job.result() for key, job in jobs.items()}
    for (workload, autotune), c in counts.items():
        print(f"{workload} autotune={autotune}: declared {sum(c['declared'].values())} "
              f"all-specialised {sum(c['all_specialised'].values())} {c['declared']}")
    return counts


@pytest.mark.parametrize("workload,autotune", list(BUDGET))
def test_compiles_within_budget(workload, autotune):
    counts = _counts()[(workload, autotune)]["declared"]
    total = sum(counts.values())
    # Not vacuous: every kernel family the workload drives was seen compiling.
    for kernel in ("_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel",
                   "_add_layer_norm_fwd_kernel", "_add_layer_norm_bwd_kernel", "_matmul_fwd_kernel",
                   "_matmul_dact_kernel"):
        assert counts.get(kernel, 0) > 0, (kernel, counts)
    assert counts.get("_cross_entropy_kernel", 0) > 0, counts  # the fused generator + loss
    assert total <= BUDGET[(workload, autotune)], (total, counts)


def test_pinned_configs_compile_fewer_times():
    for workload in ("suite", "train"):
        tuned = sum(_counts()[(workload, "1")]["declared"].values())
        pinned = sum(_counts()[(workload, "0")]["declared"].values())
        assert pinned * 3 < tuned, (workload, pinned, tuned)


def test_budget_catches_specialisation_regression():
    """The launches keyed with no do_not_specialize (lengths and row counts split on == 1 and
    % 16 again) exceed the budgets: a regression of that kind fails this module."""
    for key, budget in BUDGET.items():
        everything = sum(_counts()[key]["all_specialised"].values())
        assert everything > budget, (key, everything, budget)
