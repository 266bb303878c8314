"""tools/prewarm.py: kernels compiled here for sm_90 through Triton's own JIT launch path (a
stand-in driver, no GPU) land in Triton's cache as entries that path finds again: a second
process, and one whose cache was packed and restored elsewhere (scripts/gpu/triton_cache.py, as a
GPU machine receives it), compiles nothing new. Whether a GPU machine's Triton finds them too
depends on its build being the same (tools/prewarm.py's docstring); that needs a GPU window."""

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
    cmd = [sys.executable, "-m", "tools.prewarm", "--workloads", "norm", "--tiles", "pinned", "--cache-dir", str(cache),
           "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return sorted(d.name for d in cache.iterdir() if d.is_dir()), res.stdout


def test_prewarmed_entries_are_what_the_jit_path_finds(tmp_path):
    cache, archive = tmp_path / "cache", tmp_path / "c.tar.gz"
    first, out = _prewarm(cache, archive)
    assert first and "SCRATCHFORMER_AUTOTUNE=0: " in out and "entries packed" in out, out
    assert any(n.endswith(".cubin") for n in tarfile.open(archive).getnames())  # sm_90 binaries, packed
    again, _ = _prewarm(cache, tmp_path / "again.tar.gz")
    assert again == first  # the same keys: every launch a cache hit
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    import triton_cache

    moved = tmp_path / "elsewhere"
    triton_cache.restore(archive, moved)
    there, _ = _prewarm(moved, tmp_path / "there.tar.gz")
    assert there == first  # restored at another path (IR files left behind): still hits
    merged, out = _prewarm(tmp_path / "fresh", archive)  # the archive at --out is kept first, then added to
    assert merged == first and f"kept first: {len(first)} entries" in out, out
