"""Triton's on-disk cache carried from one GPU machine to the next: what was compiled (and tuned)
in one call is a cache hit in the next, even on a fresh machine.

    python scripts/gpu/triton_cache.py pack CACHE_DIR OUT.tar.gz|OUT.tar.xz [--max-mb 15]
    python scripts/gpu/triton_cache.py restore ARCHIVE CACHE_DIR
    python scripts/gpu/triton_cache.py check CARRIED_DIR [--repo .]

Compiling is most of a GPU step's time (scripts/gpu/README.md), and a machine left idle for 30 s
is given back: the next call starts bare and compiles everything again. Triton's cache is
content-addressed (a kernel's source, its specialisation and options, Triton's own files, ptxas'
version, the target, the libdevice file's hash, the TRITON_* variables): an entry made for the same
kernel, Triton and chip elsewhere is the same entry, and anything changed misses it.

pack: each entry folder's metadata (`*.json`: the kernel's, its `__grp__` group file, the
autotuner's `*.autotune.json` timings) and binary (`*.cubin`), newest folders first, as long as
the archive stays under --max-mb (the device returns files of at most 16 MiB); the IR files
(ttir, ttgir, llir, ptx, source) are left out: a cache hit loads only the metadata and the binary.
restore: the archive into CACHE_DIR, then each group file's child paths, which Triton writes as
absolute paths of the machine that compiled, pointed at CACHE_DIR and cut to the files present.
check: whether each archive in CARRIED_DIR was compiled from the checkout's kernel sources, by the
stamp `stamp()` wrote beside it (ARCHIVE.sources.sha256, tools/prewarm.py); exits 1 on a stale one.
Triton's key holds each kernel's text and its first line number, so any edit of kernels/*.py that
moves a kernel misses its entries: 2026-11-28, a table added above attention's kernels left the
pinned prewarm's attention entries stale, caught by hand before the window.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
from pathlib import Path

KEEP = (".json", ".cubin")
STAMP = ".sources.sha256"  # beside an archive: the hash of the kernel sources its entries were compiled from


def sources_hash(repo: Path) -> str:
    """The hash of the Triton kernels' sources (kernels/*.py: every @triton.jit of the package) and
    of the prewarm's workloads (tools/prewarm.py: the models and shapes it compiles for). Whole files,
    so a change to host code alone (a launcher) says stale too, although Triton's cache keys (a
    kernel's source and what it calls) still match: deliberate, as host code also picks the configs
    a prewarm compiles (the tiles, the pinned ones), which no key here could follow; and a model
    added to the workloads (a recipe's new width or norm) is missing from an archive packed before."""
    h = hashlib.sha256()
    workloads = repo / "tools" / "prewarm.py"
    for f in sorted((repo / "kernels").glob("*.py")) + ([workloads] if workloads.exists() else []):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def stamp(archive: Path, repo: Path, sources: str | None = None) -> Path:
    """Beside the archive, `sources` (the hash of the kernel sources its entries were compiled from,
    taken before compiling: tools/prewarm.py), else the repo's now."""
    out = archive.with_name(archive.name + STAMP)
    out.write_text((sources or sources_hash(repo)) + "\n")
    return out


def check(carried: Path, repo: Path) -> list[tuple[Path, str]]:
    """[(archive, "current" | "stale" | "unstamped")] for the archives in `carried` (run.sh's globs)."""
    current = sources_hash(repo)
    found = []
    for archive in sorted([*carried.glob("*.tar.xz"), *carried.glob("*.tar.gz")]):
        mark = archive.with_name(archive.name + STAMP)
        state = "unstamped" if not mark.exists() else "current" if mark.read_text().strip() == current else "stale"
        found.append((archive, state))
    return found


def _entries(cache: Path, newest_first: bool) -> list[Path]:
    """Entry folders by the time they were written."""
    dirs = [d for d in cache.iterdir() if d.is_dir()]
    return sorted(dirs, key=lambda d: max((f.stat().st_mtime for f in d.iterdir()), default=0.0), reverse=newest_first)


def _kept(entry: Path) -> list[Path]:
    return sorted(f for f in entry.iterdir() if f.is_file() and f.name.endswith(KEEP))


def pack(cache: Path, out: Path, max_mb: float = 15.0, newest_first: bool = True) -> tuple[int, int]:
    """Archive the entries that fit, newest first (or oldest: tools/prewarm.py compiles the most
    wanted first); returns (entries packed, entries left out). OUT ending in .xz: xz, which packs
    Triton's binaries twice as tightly as gzip (similar kernels, one solid stream) but cannot be
    measured as it is written, so the entries are cut by the ratio of a first try; else gzip, cut
    exactly (fast: what a GPU call sends back). Written beside OUT and renamed onto it when whole:
    a reader never finds half an archive under OUT's name (the seventh window carried a prewarm
    archive still being written, and restored nothing from it)."""
    if not cache.is_dir():
        raise FileNotFoundError(f"no Triton cache folder at {cache}")
    entries = [(e, files) for e in _entries(cache, newest_first) if (files := _kept(e))]
    partial = out.with_name(f".{out.name}.partial")
    try:
        counts = (_pack_xz if out.name.endswith(".xz") else _pack_gz)(entries, partial, int(max_mb * 2**20))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out)
    return counts


def _pack_gz(entries, out: Path, limit: int) -> tuple[int, int]:
    packed = 0
    with open(out, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for entry, files in entries:
            # the bytes written so far, plus this entry uncompressed: a bound that never overshoots
            if raw.tell() + sum(f.stat().st_size for f in files) > limit:
                continue
            for f in files:
                tar.add(f, arcname=f"{entry.name}/{f.name}")
            tar.fileobj.flush()  # gzip's buffers into raw, so raw.tell() is what is written
            packed += 1
    return packed, len(entries) - packed


def _pack_xz(entries, out: Path, limit: int) -> tuple[int, int]:
    sizes = [sum(f.stat().st_size for f in files) for _, files in entries]
    n = len(entries)
    while True:
        with tarfile.open(out, "w:xz", preset=6) as tar:
            for entry, files in entries[:n]:
                for f in files:
                    tar.add(f, arcname=f"{entry.name}/{f.name}")
        size = out.stat().st_size
        if size <= limit or n == 0:
            return n, len(entries) - n
        # the longest prefix whose raw bytes, at this try's ratio, fill 97% of the limit (fewer than now)
        budget, total, fit = 0.97 * limit * sum(sizes[:n]) / size, 0, 0
        while fit < n and total + sizes[fit] <= budget:
            total, fit = total + sizes[fit], fit + 1
        n = min(fit, n - 1)


def restore(archive: Path, cache: Path) -> int:
    """Unpack into `cache` and point the group files at it; returns the entries restored."""
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        for m in members:
            parts = Path(m.name).parts
            if len(parts) != 2 or any(p in ("", ".", "..") for p in parts) or os.path.isabs(m.name):
                raise ValueError(f"{archive}: unexpected member {m.name!r} (want ENTRY/FILE)")
        tar.extractall(cache, members=members, filter="data")
    entries = {Path(m.name).parts[0] for m in members}
    for name in entries:
        for grp in (cache / name).glob("__grp__*"):
            data = json.loads(grp.read_text())
            moved = {child: str(cache / name / Path(path).name) for child, path in data.get("child_paths", {}).items()}
            children = {c: p for c, p in moved.items() if os.path.exists(p)}
            grp.write_text(json.dumps({"child_paths": children}))
    return len(entries)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("cache", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--max-mb", type=float, default=15.0)
    b = sub.add_parser("restore")
    b.add_argument("archive", type=Path)
    b.add_argument("cache", type=Path)
    c = sub.add_parser("check")
    c.add_argument("carried", type=Path)
    c.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    args = p.parse_args(argv)
    if args.cmd == "check":
        found = check(args.carried, args.repo)
        for archive, state in found:
            note = {"stale": ": compiled from other kernel sources, its entries will miss (make gpu-prewarm)",
                    "unstamped": ": no stamp, its sources unknown"}.get(state, "")
            print(f"== Triton cache {archive}: {state}{note}")
        return 1 if any(state == "stale" for _, state in found) else 0
    try:
        if args.cmd == "pack":
            packed, skipped = pack(args.cache, args.out, args.max_mb)
            print(f"== Triton cache: {packed} entries packed into {args.out} "
                  f"({args.out.stat().st_size / 2**20:.1f} MiB){f', {skipped} left out (size)' if skipped else ''}")
        else:
            print(f"== Triton cache: {restore(args.archive, args.cache)} entries restored into {args.cache}")
    except (OSError, ValueError, tarfile.TarError, json.JSONDecodeError) as e:
        print(f"== Triton cache {args.cmd} failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
