"""scripts/pack_gpu_data.sh: the datasets a GPU call carries copied into .gpu_data, and what a call
sends added up against the device's 64 MiB, in a checkout with or without a Triton cache (a new
checkout has none: the sum once failed there, silently, under `set -o pipefail`, and with it
`make gpu-ready GPU_DATA=cnn_dailymail`)."""

import gzip
import json
import lzma
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def checkout(tmp_path):
    """A git checkout holding the script, and a shared data folder with one small dataset."""
    repo, shared = tmp_path / "repo", tmp_path / "shared"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "pack_gpu_data.sh"), repo / "scripts")
    (repo / ".gitignore").write_text(".gpu_data/\n.gpu_cache/\n.gpu_cache-pinned/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (shared / "multi30k").mkdir(parents=True)
    (shared / "multi30k" / "train.jsonl.gz").write_bytes(b"x" * 4096)
    return repo, shared


def _pack(repo, shared, *names):
    return subprocess.run(["bash", "scripts/pack_gpu_data.sh", *names], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "SHARED_DATA": str(shared)})


def _sparse(path, mib):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(mib << 20)


def test_sums_a_new_checkout_without_a_cache(checkout):
    repo, shared = checkout
    run = _pack(repo, shared, "multi30k")
    assert run.returncode == 0, run.stderr
    assert (repo / ".gpu_data" / "multi30k" / "train.jsonl.gz").stat().st_size == 4096
    assert "travels: checkout" in run.stdout and "(limit 64)" in run.stdout
    assert "with .gpu_cache" not in run.stdout


def test_names_each_cache_and_warns_when_it_does_not_fit(checkout):
    repo, shared = checkout
    _sparse(repo / ".gpu_cache-pinned" / "prewarm.tar.xz", 1)
    _sparse(repo / ".gpu_cache" / "prewarm.tar.xz", 70)
    run = _pack(repo, shared, "multi30k")
    assert run.returncode == 0, run.stderr
    assert "with .gpu_cache-pinned (1.0 MiB)" in run.stdout
    assert "with .gpu_cache (70.0 MiB)" in run.stdout and "with .gpu_cache over the device's 64 MiB" in run.stdout
    assert "with .gpu_cache-pinned over" not in run.stdout


def test_fails_when_the_call_itself_does_not_fit(checkout):
    repo, shared = checkout
    _sparse(shared / "multi30k" / "big.jsonl.gz", 70)
    run = _pack(repo, shared, "multi30k")
    assert run.returncode == 1 and "over the device's 64 MiB: pack fewer datasets" in run.stderr


def test_sums_a_checkout_with_a_tracked_file_deleted(checkout):
    """A tracked file deleted in the work tree (not yet committed) does not travel and is left out of
    the sum: its failed stat ended the script under `set -e` and pipefail with exit 123, silently,
    after the data was packed and before the sum."""
    repo, shared = checkout
    (repo / "notes.txt").write_text("x" * 2048)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "checkout"], check=True)
    (repo / "notes.txt").unlink()
    run = _pack(repo, shared, "multi30k")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "travels: checkout" in run.stdout and "(limit 64)" in run.stdout


def test_cnn_dailymail_documents_cut_and_packed_in_xz(checkout):
    """CNN/DailyMail travels cut: each document to its first MAX_DOC_CHARS characters (3000 by
    default), every split re-packed from gzip to xz under the same name, the summary and id
    untouched, meta.json (the task) copied beside them."""
    repo, shared = checkout
    src = shared / "cnn_dailymail"
    src.mkdir()
    (src / "meta.json").write_text('{"task": "summarization"}')
    rows = [{"id": "a", "document": "x" * 5000, "summary": "long"}, {"id": "b", "document": "é" * 10, "summary": "s"}]
    for split in ("train", "validation"):
        with gzip.open(src / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    run = _pack(repo, shared, "cnn_dailymail")
    assert run.returncode == 0, run.stderr
    packed = repo / ".gpu_data" / "cnn_dailymail"
    assert sorted(p.name for p in packed.iterdir()) == ["meta.json", "train.jsonl.xz", "validation.jsonl.xz"]
    assert (packed / "meta.json").read_text() == '{"task": "summarization"}'
    for split in ("train", "validation"):
        with lzma.open(packed / f"{split}.jsonl.xz", "rt", encoding="utf-8") as f:
            got = [json.loads(line) for line in f]
        assert got == [{"id": "a", "document": "x" * 3000, "summary": "long"}, rows[1]], split


def test_packing_again_leaves_nothing_of_the_last_copy(checkout):
    """A dataset packed again is copied afresh: a file its shared folder no longer has (a split
    renamed, an old format) does not stay in .gpu_data to travel, and be read, with the new ones."""
    repo, shared = checkout
    (shared / "multi30k" / "test.tsv").write_text("old\tformat\n")
    assert _pack(repo, shared, "multi30k").returncode == 0
    (shared / "multi30k" / "test.tsv").unlink()
    run = _pack(repo, shared, "multi30k")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (repo / ".gpu_data" / "multi30k").iterdir()) == ["train.jsonl.gz"]


def test_counts_the_checkouts_untracked_files_that_travel(checkout):
    """The device copies untracked files that git does not ignore too: one of 70 MiB in the checkout
    takes the call past 64 MiB, and the script fails, as for a tracked one."""
    repo, shared = checkout
    _sparse(repo / "notes" / "draft.bin", 70)
    run = _pack(repo, shared, "multi30k")
    assert run.returncode == 1 and "over the device's 64 MiB: pack fewer datasets" in run.stderr, run.stdout
