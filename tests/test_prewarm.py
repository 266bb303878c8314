"""tools/prewarm.py: kernels compiled here for sm_90 through Triton's own JIT launch path (a
stand-in driver, no GPU) land in Triton's cache as entries that path finds again: a second
process, and one whose cache was packed and restored elsewhere (scripts/gpu/triton_cache.py, as a
GPU machine receives it), compiles nothing new. Whether a GPU machine's Triton finds them too
depends on its build being the same (tools/prewarm.py's docstring); that needs a GPU window."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("triton")
_PTXAS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not _PTXAS.exists(), reason="Triton's bundled ptxas is missing")


def _prewarm(cache, out):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tools.prewarm", "--workloads", "norm", "--tiles", "pinned", "--no-tests",
           "--cache-dir", str(cache), "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return sorted(d.name for d in cache.iterdir() if d.is_dir()), res.stdout


def test_prewarmed_entries_are_what_the_jit_path_finds(tmp_path):
    cache, archive = tmp_path / "cache", tmp_path / "c.tar.xz"
    first, out = _prewarm(cache, archive)
    assert first and "SCRATCHFORMER_AUTOTUNE=0: " in out and "entries packed" in out, out
    assert any(n.endswith(".cubin") for n in tarfile.open(archive).getnames())  # sm_90 binaries, packed
    with tarfile.open(archive) as tar:  # each kernel's metadata names the H100's target: sm_90, 32-thread warps
        targets = {json.dumps(json.load(tar.extractfile(m))["target"]) for m in tar.getmembers()
                   if m.name.endswith(".json") and not m.name.split("/")[-1].startswith("__grp__")
                   and not m.name.endswith(".autotune.json")}
    assert targets == {json.dumps({"backend": "cuda", "arch": 90, "warp_size": 32})}, targets
    again, _ = _prewarm(cache, tmp_path / "again.tar.gz")
    assert again == first  # the same keys: every launch a cache hit
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    import triton_cache

    assert dict(triton_cache.check(tmp_path, ROOT))[archive] == "current"  # stamped with the sources compiled
    moved = tmp_path / "elsewhere"
    triton_cache.restore(archive, moved)
    there, _ = _prewarm(moved, tmp_path / "there.tar.gz")
    assert there == first  # restored at another path (IR files left behind): still hits


def test_the_kernel_tests_compile_without_running(tmp_path):
    """`-p tools.prewarm` (prewarm's tests pass): a kernel test module's launches, run with asserts
    off and nothing launched, land in Triton's cache as sm_90 binaries."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_INTERPRET="0", SCRATCHFORMER_AUTOTUNE="0", TRITON_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-O", "-m", "pytest", "--assert=plain", "-p", "tools.prewarm", "-p", "no:cacheprovider",
           "-q", "-o", "addopts=", "tests/test_add_layer_norm.py", "-k", "matches_ref and 16"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert " passed" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    cubins = list(cache.glob("*/*.cubin"))
    assert cubins and all(c.stat().st_size > 0 for c in cubins), res.stdout[-3000:]


def _checkout_with_a_kernel(tmp_path: Path) -> Path:
    """A checkout whose kernels/ holds one Triton kernel: what the prewarm's stamp hashes."""
    repo = tmp_path / "repo"
    (repo / "kernels").mkdir(parents=True)
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")
    return repo


def _run_compiled(script: str) -> subprocess.CompletedProcess:
    """`script` run by a fresh python outside the interpreter mode (as the prewarm runs), which must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_the_stamp_is_of_the_sources_compiled_not_those_at_the_end(tmp_path):
    """A prewarm takes up to an hour; kernels/ changed meanwhile (a commit, a merge) must leave its
    archive stale for `triton_cache.py check`, as its entries are the old sources': stamped with the
    sources at its end, it read "current" and the window compiled what it was told was carried."""
    repo = _checkout_with_a_kernel(tmp_path)
    script = f"""
import subprocess, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT / "scripts" / "gpu")!r})
import tools.prewarm as prewarm
import triton_cache
repo = Path({str(repo)!r})
prewarm.REPO = repo

def compile_pass(cmd, **kwargs):  # one pass: an entry compiled, and meanwhile a kernel edited
    cache = Path(cmd[cmd.index("--cache-dir") + 1])
    (cache / "entry").mkdir(parents=True, exist_ok=True)
    (cache / "entry" / "k.json").write_text("{{}}")
    (repo / "kernels" / "op.py").write_text("TABLE = {{}}\\n@triton.jit\\ndef k(x):\\n    pass\\n")
    return subprocess.CompletedProcess(cmd, 0)

prewarm.subprocess.run = compile_pass
out = repo / ".gpu_cache" / "prewarm.tar.xz"
assert prewarm.main(["--tiles", "pinned", "--no-tests", "--cache-dir", str(repo / "cache"), "--out", str(out)]) == 0
print("STATE", dict(triton_cache.check(out.parent, repo))[out])
"""
    res = _run_compiled(script)
    assert "STATE stale" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_an_archive_too_small_for_all_keeps_the_first_compiled(tmp_path):
    """The archive is packed in the order of need, the order compiled: the pinned tiles (the tests,
    smoke runs and recipes) before the tuned ones (the benchmarks). Capped by --max-mb, it keeps the
    pinned pass's entries and leaves out the tuned pass's, not the other way round (newest first, as
    a call's own cache is packed). The kernel tests' pass compiles the pinned tiles, as step 10 runs them."""
    repo = _checkout_with_a_kernel(tmp_path)
    script = f"""
import os, subprocess, sys, tarfile
from pathlib import Path
sys.path.insert(0, {str(ROOT / "scripts" / "gpu")!r})
import tools.prewarm as prewarm
repo = Path({str(repo)!r})
prewarm.REPO = repo
passes = []

def compile_pass(cmd, env, **kwargs):  # one pass: one entry of 300 kB (random: xz keeps it whole)
    if "pytest" in cmd:  # the kernel tests' pass: which tiles it compiles
        passes.append("tests-" + env["SCRATCHFORMER_AUTOTUNE"])
        return subprocess.CompletedProcess(cmd, 0, "1 passed\\n", "")
    cache = Path(cmd[cmd.index("--cache-dir") + 1])
    entry = cache / ("pass-" + env["SCRATCHFORMER_AUTOTUNE"])
    entry.mkdir(parents=True)
    (entry / "k.cubin").write_bytes(os.urandom(300_000))
    os.utime(entry / "k.cubin", (1000.0 + len(passes), 1000.0 + len(passes)))
    passes.append(entry.name)
    return subprocess.CompletedProcess(cmd, 0)

prewarm.subprocess.run = compile_pass
out = repo / "prewarm.tar.xz"
assert prewarm.main(["--cache-dir", str(repo / "cache"), "--out", str(out), "--max-mb", "0.4"]) == 0
print("PASSES", passes, "PACKED", sorted(n.split("/")[0] for n in tarfile.open(out).getnames()))
"""
    res = _run_compiled(script)
    assert "PASSES ['pass-0', 'pass-1', 'tests-0'] PACKED ['pass-0']" in res.stdout, res.stdout[-3000:] + res.stderr
