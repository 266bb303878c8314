"""After a GPU window: the archives its calls sent back, filed where issues 16 and 17 want them.

    python scripts/gpu/collect.py FILES_AT [FILES_AT ...] [--bench-dir bench/results] [--work gpu_out/collected]

FILES_AT: the folders the device tool put each call's files in (one `<step>.tar.gz` per step), in
the order of the calls.
1. Every archive is unpacked into WORK/<step>/ (git-ignored; what an earlier collect left there,
   WORK/<step>.2/ ... included, is replaced; an archive cut short gives the files before the cut),
   a second call's archive of the same step into WORK/<step>.2/, and so on (the tenth window ran
   step 21 twice, add+LayerNorm then the FFN: one folder each, both filed).
2. The benchmark JSON of the kernels (`bench_attention`, `bench_add_layer_norm`, `bench_ffn`,
   `bench_embed`) go into one pytest-benchmark file, `BENCH_DIR/<date>-<gpu>.json`, and those of the
   end-to-end step (`bench_train_step`, `bench_generate`) into `<date>-<gpu>-e2e.json`: date and GPU
   from the cases' own extra_info. A file already there (an earlier window of the same day and GPU)
   keeps its cases, a case measured again is replaced (by its pytest node id), so a file can hold
   two windows' runs: each case's extra_info still names its own command, commit and time, and the
   file's top names its newest run and lists every run merged (`merge`).
   A benchmark JSON that is empty (pytest-benchmark creates it at startup and leaves it so when it
   saved nothing), unreadable or without cases is skipped, and named.
3. The profiles (`profile-<shape>.txt`) and the host-overhead report (`host_overhead.txt`) are
   copied beside them, `<date>-<gpu>-profile-<shape>.txt` and `<date>-<gpu>-host-overhead.txt`
   (the date and GPU of their own step's JSON where it saved any, else of the others), each only
   if it is a finished report (its first line as `REPORTS` says): anything else (a traceback of a
   cut run) is skipped and named, never filed over a good one; then
   `bench/targets.py` writes `<date>-<gpu>-targets.md` (issue 16/17 ratios, met or missed) and
   `bench/plot_results.py` the PNGs into `BENCH_DIR/plots/<date>-<gpu>/`.
4. The Triton cache archive that `run.sh` sends back (`triton-cache.tar.gz`, the newest call's) is
   copied to `.gpu_cache/`, which the next call carries (`scripts/gpu/triton_cache.py`).
5. The pieces of the weights step 50 brings back (`50_<recipe>-averaged.pt.part0`, `part1`, ...: an
   unfinished training run's averaged weights; `50_<recipe>-picked.pt.part*`: the model of
   unfinished test predictions; split, as a file comes back only under 16 MiB) are joined into
   WORK/50_<recipe>-averaged.pt (or -picked.pt), a checkpoint `scratchformer.evaluate` and
   `generate` take.
6. Last, what the README's notes need: each step's exit line (status and seconds), each pytest
   run's summary line, and where a training recipe's run folder was unpacked (copy it to
   `results/<name>/` with its README: scripts/gpu/README.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
E2E = ("bench_train_step", "bench_generate")
TRITON_CACHE = "triton-cache.tar.gz"  # run.sh's, not a step's archive
# the reports filed beside the JSON, by file name, and the first line a finished one starts with (a
# cut run writes none, or its log would be a traceback)
REPORTS = {"profile-*.txt": "training step profile:",  # bench/profile_train_step.py
           "host_overhead.txt": "host time per call,"}  # bench/host_overhead.py


def unpack(files_at: list[Path], work: Path) -> list[Path]:
    """Every <step>.tar.gz under the FILES_AT folders, in their order, into WORK/<step>/ (the
    same step's next archive into WORK/<step>.2/, ...) -> those folders, in that order. An earlier
    collect's folders of these steps go first, WORK/<step>.2/ ... too: finish_on_cpu.sh takes the
    last numbered 50_train folder's picked.txt, which would otherwise be another window's. An
    archive cut short (a call killed while it was written) gives what it holds up to the cut, and says so."""
    archives = [a for folder in files_at for a in sorted(Path(folder).glob("*.tar.gz")) if a.name != TRITON_CACHE]
    if not archives:
        raise SystemExit(f"no <step>.tar.gz in {', '.join(map(str, files_at))}")
    for name in {a.name.removesuffix(".tar.gz") for a in archives}:
        for old in work.glob(f"{glob.escape(name)}*"):
            if old.is_dir() and re.fullmatch(rf"{re.escape(name)}(\.\d+)?", old.name):
                shutil.rmtree(old)
    steps = []
    for archive in archives:
        name = archive.name.removesuffix(".tar.gz")
        earlier = sum(step.name.partition(".")[0] == name for step in steps)  # this step's archives so far
        dest = work / (f"{name}.{earlier + 1}" if earlier else name)
        dest.mkdir(parents=True)
        _extract(archive, dest)
        steps.append(dest)
    return steps


def _extract(archive: Path, dest: Path) -> None:
    """The archive's members into dest, one by one, so that one cut short keeps the files before
    the cut (the one it cut is removed: half a file would pass for a whole one)."""
    done, member = 0, None
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                tar.extract(member, dest, filter="data")  # no absolute paths, links out, devices
                done += member.isfile()
    except (EOFError, tarfile.TarError, zlib.error) as err:
        if member is not None and member.isfile():
            (dest / member.name).unlink(missing_ok=True)
        print(f"{archive}: cut short or unreadable ({err}): {done} files unpacked, the rest lost")


def keep_triton_cache(files_at: list[Path], cache_dir: Path) -> Path | None:
    """The newest call's Triton cache archive (run.sh packs it) into cache_dir, for the next call's
    carry (`.gpu_cache`, scripts/gpu/triton_cache.py)."""
    found = [a for folder in files_at if (a := Path(folder) / TRITON_CACHE).is_file()]
    if not found:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    newest = max(found, key=lambda a: a.stat().st_mtime)
    _replace(cache_dir / TRITON_CACHE, lambda tmp: shutil.copyfile(newest, tmp))
    print(f"Triton cache of {newest.parent} kept in {cache_dir / TRITON_CACHE}: carry .gpu_cache next time")
    return cache_dir / TRITON_CACHE


def join_parts(files_at: list[Path], work: Path) -> list[Path]:
    """Step 5 of the docstring: each <name>.part0, part1, ... of a FILES_AT folder, in order, into
    WORK/<name>; with a piece missing between them, not at all (and said)."""
    joined = []
    for folder in files_at:
        names = {p.name.rsplit(".part", 1)[0] for p in Path(folder).glob("*.part[0-9]*")}
        for name in sorted(names):
            parts = sorted(Path(folder).glob(f"{name}.part[0-9]*"), key=lambda p: int(p.name.rsplit(".part", 1)[1]))
            numbers = [int(p.name.rsplit(".part", 1)[1]) for p in parts]
            if numbers != list(range(len(parts))):  # a piece the device left out: the rest is no checkpoint
                missing = sorted(set(range(max(numbers))) - set(numbers))
                print(f"{Path(folder) / name}: piece{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(map(str, missing))} missing (the call's files_left_out?): not joined")
                continue
            work.mkdir(parents=True, exist_ok=True)
            with open(work / name, "wb") as out:
                for part in parts:
                    out.write(part.read_bytes())
            print(f"{work / name}: {len(parts)} pieces joined (weights step 50 brought back)")
            joined.append(work / name)
    return joined


def gpu_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the model, else the whole name made safe for a file name."""
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device)
    return (model[1] if model else re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-")).lower()


def merge(jsons: list[Path], into: Path) -> int:
    """The cases of `jsons` (pytest-benchmark files, a run each) added to `into` (created if missing):
    a case whose node id is there already is replaced. Each case names its own run's commit and time
    in its extra_info (`commit`, `dirty`, `datetime`: run_bench records them; a case saved before it
    did is given its file's). The file's `commit_info`, `datetime` and `machine_info` are its newest
    run's, and `runs` lists every run merged into it, oldest first (until 2026-12-01 they were the
    first run's alone, whichever runs the cases came from). -> the number of cases in `into`."""
    merged = json.loads(into.read_text()) if into.exists() else None
    for path in jsons:
        data = json.loads(path.read_text())
        run = _run(data)
        for case in data["benchmarks"]:
            info = case.setdefault("extra_info", {})
            for key, value in run.items():
                if value is not None:
                    info.setdefault(key, value)
        if merged is None:
            merged = {**data, "benchmarks": []}
        runs = merged.setdefault("runs", [_run(merged)])  # a file filed before: its top names one run
        if run not in runs:
            runs.append(run)
            runs.sort(key=lambda r: r["datetime"] or "")  # pytest-benchmark's UTC isoformat sorts as text
        if (run["datetime"] or "") >= (merged.get("datetime") or ""):
            merged.update({k: data[k] for k in ("commit_info", "datetime", "machine_info") if k in data})
        new = {b["fullname"] for b in data["benchmarks"]}
        merged["benchmarks"] = [b for b in merged["benchmarks"] if b["fullname"] not in new] + data["benchmarks"]
    _replace(into, lambda tmp: tmp.write_text(json.dumps(merged, indent=2) + "\n"))
    return len(merged["benchmarks"])


def _replace(path: Path, write) -> None:
    """write(tmp) to a temp file beside `path`, then rename it over `path`: a kill or a full disk leaves
    the old file whole (bench/results/<date>-<gpu>.json holds earlier windows' cases, which a write cut
    short lost, and the next collect then failed on its JSON); fsync'd first, so a power cut after the rename
    does not leave it empty."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _run(data: dict) -> dict:
    """A pytest-benchmark file's run: {"commit": id, "dirty": bool, "datetime": when it was saved}."""
    commit = data.get("commit_info", {})
    return {"commit": commit.get("id"), "dirty": commit.get("dirty"), "datetime": data.get("datetime")}


def file_benchmarks(steps: list[Path], bench_dir: Path) -> list[Path]:
    """Step 2 and 3 of the docstring -> the files written."""
    groups: dict[str, list[Path]] = {}
    own: dict[Path, set[str]] = {}  # a step folder -> the stems its own JSON are filed under
    for path in (p for step in steps for p in sorted(step.glob("bench_*.json"))):  # a later call's case replaces
        text = path.read_text()
        if not text.strip():
            print(f"{path}: empty, skipped (pytest-benchmark creates it at startup: nothing was saved)")
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            print(f"{path}: not JSON ({err}), skipped")
            continue
        if not data.get("benchmarks"):
            print(f"{path}: no cases (a dry run, or a step cut short before its first)")
            continue
        info = data["benchmarks"][0].get("extra_info", {})
        stem = f"{info.get('date', 'undated')}-{gpu_slug(info.get('device', 'unknown'))}"
        groups.setdefault(stem + ("-e2e" if path.stem in E2E else ""), []).append(path)
        own.setdefault(path.parent, set()).add(stem)
    written = []
    for name, jsons in groups.items():
        out = bench_dir / f"{name}.json"
        print(f"{out}: {merge(jsons, out)} cases ({', '.join(p.stem for p in jsons)})")
        written.append(out)
    stems = sorted({name.removesuffix("-e2e") for name in groups})
    for pattern, head in REPORTS.items():
        for report in (p for step in steps for p in sorted(step.glob(pattern))):
            first = report.read_text(errors="replace").partition("\n")[0]
            if not first.startswith(head):
                print(f"{report}: not a finished report (its first line: {first[:80]!r}), not filed")
                continue
            if not stems:  # the JSON names the date and GPU a report is filed under
                print(f"{report}: finished, but no benchmark JSON of this call names its date and GPU: not filed, "
                      "it stays where it is")
            # under its own step's date and GPU (a window past midnight: two dates), else the call's
            for stem in sorted(own.get(report.parent, stems)):
                written.append(bench_dir / f"{stem}-{report.name.replace('_', '-')}")
                _replace(written[-1], lambda tmp, report=report: shutil.copyfile(report, tmp))
    for stem in stems:
        jsons = [str(p) for p in (bench_dir / f"{stem}.json", bench_dir / f"{stem}-e2e.json") if p.exists()]
        targets = bench_dir / f"{stem}-targets.md"
        subprocess.run([sys.executable, str(REPO / "bench/targets.py"), *jsons, "--out", str(targets)], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, str(REPO / "bench/plot_results.py"), *jsons, "--out",
                        str(bench_dir / "plots" / stem)], check=True)
        written.append(targets)
    return written


def report(steps: list[Path]) -> None:
    """Step 6 of the docstring: what each step said of itself."""
    for step in steps:
        log = (step / "log.txt").read_text(errors="replace") if (step / "log.txt").exists() else ""
        ends = re.findall(rf"== {re.escape(step.name.partition('.')[0])}: exit \d+ after \d+ s", log)
        print(f"{step.name}: {ends[-1] if ends else 'no exit line (the call was cut short?)'}")
        for txt in sorted(step.glob("*.txt")):
            summary = [line for line in txt.read_text(errors="replace").splitlines()  # with -q or without
                       if re.match(r"^[= ]*\d+(/\d+)? (passed|failed|errors?|skipped|deselected|tests? collected)\b"
                                   r".* in [\d.]+s", line)]
            if summary:
                print(f"  {txt.stem}: {summary[-1].strip('= ')}")
        if (step / "run").is_dir():
            print(f"  training run folder: {step / 'run'} ({' '.join(re.findall(r'== (.+: (?:not )?finished)', log))})")


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files_at", nargs="+", type=Path, help="the folders holding the calls' <step>.tar.gz")
    p.add_argument("--bench-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--work", type=Path, default=REPO / "gpu_out" / "collected")
    p.add_argument("--cache-dir", type=Path, default=REPO / ".gpu_cache", help="where the Triton cache archive goes")
    args = p.parse_args(argv)
    keep_triton_cache(args.files_at, args.cache_dir)
    steps = unpack(args.files_at, args.work)
    join_parts(args.files_at, args.work)
    args.bench_dir.mkdir(parents=True, exist_ok=True)
    written = file_benchmarks(steps, args.bench_dir)
    report(steps)
    return written


if __name__ == "__main__":
    main()
