"""What a GPU window brings back and carries: scripts/gpu/collect.py files a window's archives
(benchmark JSON, reports, a checkpoint's pieces) under bench/results/ and the run folders, and
scripts/gpu/triton_cache.py packs, checks and restores the Triton cache a call carries to the next
machine."""

import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import pytest
from gpu_steps import GPU, bench_json


def _archive_of(folder, step, files):
    """A step's archive as the device sends it back: `<step>.tar.gz` holding `files` (name -> text)."""
    src = folder / f"src-{step}"
    src.mkdir(parents=True)
    for name, text in files.items():
        (src / name).write_text(text)
    with tarfile.open(folder / f"{step}.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=".")
    shutil.rmtree(src)


def test_collect_joins_pieces_in_order(tmp_path, capsys, monkeypatch):
    """collect.join_parts: split's pieces (part0 .. part2 here, as `split -d` names them) joined in
    their numeric order give the file back byte for byte; a folder without pieces adds nothing; pieces
    with one missing between them are not joined, and the missing one is named."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    data = os.urandom(3000)
    calls = tmp_path / "call"
    calls.mkdir()
    for i in (2, 0, 1):
        (calls / f"50_x-averaged.pt.part{i}").write_bytes(data[i * 1024:(i + 1) * 1024])
    (joined,) = collect.join_parts([calls, tmp_path], tmp_path / "work")
    assert joined == tmp_path / "work" / "50_x-averaged.pt" and joined.read_bytes() == data
    # a piece the device left out (files_left_out): the others are not joined into a corrupt checkpoint
    (calls / "50_x-averaged.pt.part1").unlink()
    (calls / "50_x-picked.pt.part0").write_bytes(b"whole")
    assert collect.join_parts([calls], tmp_path / "work2") == [tmp_path / "work2" / "50_x-picked.pt"]
    assert "50_x-averaged.pt: piece 1 missing" in capsys.readouterr().out


def test_collect_files_a_windows_archives(tmp_path, capsys, monkeypatch):
    """scripts/gpu/collect.py: the kernel benchmarks of a window's archives in one
    <date>-<gpu>.json, the end-to-end ones in <date>-<gpu>-e2e.json, profiles beside them, the
    targets table written from both; a later window's archive of the same day adds its cases and
    replaces a case measured again; every step's exit line and pytest summary is reported."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    window1, window2, bench = tmp_path / "w1", tmp_path / "w2", tmp_path / "bench"
    window1.mkdir()
    window2.mkdir()
    dense = [(f"test_dense[4096-h16d64-full-{k}-fwd]", k, m) for k, m in (("triton", 2e-3), ("sdpa_flash", 3e-3))]
    _archive_of(window1, "20_bench_attention", {
        "bench_attention.json": bench_json(dense), "log.txt": "== 20_bench_attention: exit 0 after 171 s\n",
        "bench_attention.txt": "...\n64 passed in 120.5s\n"})
    _archive_of(window1, "30_bench_train_step", {
        "bench_train_step.json": bench_json([("test_train_step[triton-base-cnndm]", "triton", 0.1)]),
        "log.txt": "== 30_bench_train_step: exit 124 after 380 s\n"})
    _archive_of(window1, "31_bench_generate_profile", {  # pytest-benchmark's empty file, a profile cut short
        "bench_generate.json": "", "profile-base-cnndm.txt": "training step profile: shape base-cnndm\ntop kernels\n",
        "profile-small-multi30k.txt": "Traceback (most recent call last):\nKeyboardInterrupt\n",
        "host_overhead.txt": "host time per call, NVIDIA H100\n| triton | 1.0 |\n"})
    bench.mkdir()
    good = "training step profile: shape small-multi30k, an earlier window's\n"
    (bench / "2026-12-01-h100-profile-small-multi30k.txt").write_text(good)
    written = collect.main([str(window1), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    stem = bench / "2026-12-01-h100"
    assert {p.name for p in written} == {"2026-12-01-h100.json", "2026-12-01-h100-e2e.json",
                                         "2026-12-01-h100-profile-base-cnndm.txt", "2026-12-01-h100-host-overhead.txt",
                                         "2026-12-01-h100-targets.md"}
    assert (bench / "2026-12-01-h100-profile-small-multi30k.txt").read_text() == good  # not filed over
    kernels = json.loads(stem.with_suffix(".json").read_text())["benchmarks"]
    assert [b["params"]["kernel"] for b in kernels] == ["triton", "sdpa_flash"]
    assert len(json.loads((bench / "2026-12-01-h100-e2e.json").read_text())["benchmarks"]) == 1
    assert "dense L=4096 D=64 fwd" in (bench / "2026-12-01-h100-targets.md").read_text()  # triton vs flash: 1.5x
    out = capsys.readouterr().out
    assert "20_bench_attention: == 20_bench_attention: exit 0 after 171 s" in out and "64 passed in 120.5s" in out
    assert "exit 124 after 380 s" in out
    assert re.search(r"bench_generate\.json: empty, skipped", out), out
    assert re.search(r"profile-small-multi30k\.txt: not a finished report \(its first line: 'Traceback", out), out

    again = [(dense[0][0], "triton", 1e-3), ("test_dense[2048-h16d64-full-triton-fwd]", "triton", 5e-4)]
    _archive_of(window2, "20_bench_attention", {"bench_attention.json": bench_json(again)})
    collect.main([str(window2), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    kernels = json.loads(stem.with_suffix(".json").read_text())["benchmarks"]
    medians = [(b["name"], b["stats"]["median"]) for b in kernels]
    assert sorted(medians) == sorted([(dense[1][0], 3e-3), (dense[0][0], 1e-3), (again[1][0], 5e-4)])  # kept,
    # replaced (once), added
    window3 = tmp_path / "w3"  # a finished profile whose generation saved no JSON: said, not dropped silently
    window3.mkdir()
    _archive_of(window3, "31_bench_generate_profile", {"profile-base-cnndm.txt": "training step profile: x\n"})
    capsys.readouterr()
    collect.main([str(window3), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    assert re.search(r"profile-base-cnndm\.txt: finished, but no benchmark JSON .* not filed", capsys.readouterr().out)


def _run_json(commit, when, cases):
    """A pytest-benchmark file of one run: its commit and time at the top, as pytest-benchmark writes
    them, and cases {node id: what its extra_info holds beside the date}."""
    return json.dumps({"commit_info": {"id": commit, "dirty": False, "branch": "main"}, "datetime": when,
                       "machine_info": {"node": commit}, "benchmarks": [
                           {"group": "add_layer_norm", "name": name, "fullname": f"bench/b.py::{name}", "params": {},
                            "stats": {"median": 1e-3}, "extra_info": {"date": when[:10], **extra}}
                           for name, extra in cases.items()]})


def test_a_merge_cut_short_leaves_the_filed_cases_whole(tmp_path, monkeypatch):
    """bench/results/<date>-<gpu>.json holds earlier windows' cases: a merge whose write is cut short
    (a full disk, a kill) leaves it as it was, no temp file beside it (it was rewritten in place: a
    truncated file lost them, and the next collect failed on its JSON)."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    filed, run = tmp_path / "filed.json", tmp_path / "run.json"
    filed.write_text(_run_json("aaa", "2026-11-27T01:21:26+00:00", {"a": {}}))
    run.write_text(_run_json("bbb", "2026-11-27T15:21:00+00:00", {"b": {}}))
    before = filed.read_bytes()
    real_write = Path.write_text

    def full_disk(self, text, *a, **k):
        real_write(self, text[: len(text) // 2], *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        collect.merge([run], filed)
    monkeypatch.undo()
    assert filed.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["filed.json", "run.json"]
    assert collect.merge([run], filed) == 2


def test_collect_names_each_cases_run_and_every_run_merged(tmp_path, monkeypatch):
    """collect.merge, as the 2026-11-27 file was filed: the eighth window's run (commit aaa at 01:21)
    measured cases a and b; the ninth's (bbb at 15:21) measured b and c, b saying its commit and time
    itself (run_bench's), c not (a case saved before run_bench did). Each case names its own run (a the
    eighth's; b and c the ninth's, b's own record kept), the file's top the newest run (bbb at 15:21, its
    machine) and `runs` both, oldest first. Filed in the other order the top is the same, and b is the
    eighth's (the later filing replaces a case). The top once named the first run filed alone: aaa at
    01:21, two of the three cases bbb's."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    a = {"commit": "aaa", "dirty": False, "datetime": "2026-11-27T01:21:26+00:00"}
    b = {"commit": "bbb", "dirty": True, "datetime": "2026-11-27T15:20:01+00:00"}
    c = {"commit": "bbb", "dirty": False, "datetime": "2026-11-27T15:21:00+00:00"}
    eighth, ninth = tmp_path / "eighth.json", tmp_path / "ninth.json"
    eighth.write_text(_run_json("aaa", a["datetime"], {"a": {}, "b": {}}))
    ninth.write_text(_run_json("bbb", c["datetime"], {"b": b, "c": {}}))
    for first, second, b_filed in ((eighth, ninth, b), (ninth, eighth, a)):
        out = tmp_path / f"{first.stem}-first.json"
        for run in (first, second):  # one collect a window, as the windows were filed
            collect.merge([run], out)
        filed = json.loads(out.read_text())
        assert {x["name"]: {k: x["extra_info"].get(k) for k in a} for x in filed["benchmarks"]} == {
            "a": a, "b": b_filed, "c": c}
        assert (filed["commit_info"]["id"], filed["datetime"], filed["machine_info"]) == ("bbb", c["datetime"],
                                                                                          {"node": "bbb"})
        assert filed["runs"] == [a, c]


def test_collect_files_two_calls_of_one_step(tmp_path, capsys, monkeypatch):
    """collect.py given two calls that ran the same step (the tenth window's step 21, once for
    add+LayerNorm, once for the FFN): each archive gets its own folder (<step>, <step>.2) and both
    calls' cases are filed, a case measured in both taking the later call's time; both exit lines
    are reported."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    call1, call2, bench, work = tmp_path / "call1", tmp_path / "call2", tmp_path / "bench", tmp_path / "work"
    for folder, cases, seconds in ((call1, [("test_dense[1024-h16d64-full-triton-fwd]", 2e-4),
                                            ("test_dense[4096-h16d64-full-triton-fwd]", 3e-3)], 79),
                                   (call2, [("test_dense[4096-h16d64-full-triton-fwd]", 2e-3)], 131)):
        folder.mkdir()
        _archive_of(folder, "21_bench_norm_ffn_embed", {
            "bench_attention.json": bench_json([(name, "triton", median) for name, median in cases]),
            "log.txt": f"== 21_bench_norm_ffn_embed: exit 0 after {seconds} s\n"})
    collect.main([str(call1), str(call2), "--bench-dir", str(bench), "--work", str(work)])
    assert sorted(p.name for p in work.iterdir()) == ["21_bench_norm_ffn_embed", "21_bench_norm_ffn_embed.2"]
    filed = json.loads((bench / "2026-12-01-h100.json").read_text())["benchmarks"]
    assert sorted((b["name"], b["stats"]["median"]) for b in filed) == [
        ("test_dense[1024-h16d64-full-triton-fwd]", 2e-4), ("test_dense[4096-h16d64-full-triton-fwd]", 2e-3)]
    out = capsys.readouterr().out
    assert "exit 0 after 79 s" in out and "exit 0 after 131 s" in out, out


def test_collect_files_a_report_under_its_own_steps_date(tmp_path, monkeypatch):
    """A window past midnight (step 30 on one date, step 31 on the next): step 31's profile goes under
    the date its own step's JSON names, not under every date of the call (it overwrote the earlier
    date's profile, filed from another window, with a measurement of the next day)."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    call, bench = tmp_path / "call", tmp_path / "bench"
    call.mkdir()
    _archive_of(call, "30_bench_train_step", {
        "bench_train_step.json": bench_json([("test_train_step[triton-base-cnndm]", "triton", 0.1)])})
    late = bench_json([("test_generate[triton-greedy]", "triton", 0.2)]).replace("2026-12-01", "2026-12-02")
    _archive_of(call, "31_bench_generate_profile", {
        "bench_generate.json": late, "profile-base-cnndm.txt": "training step profile: shape base-cnndm\n"})
    bench.mkdir()
    earlier = "training step profile: shape base-cnndm, another window's of 2026-12-01\n"
    (bench / "2026-12-01-h100-profile-base-cnndm.txt").write_text(earlier)
    written = collect.main([str(call), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    assert bench / "2026-12-02-h100-profile-base-cnndm.txt" in written
    assert (bench / "2026-12-01-h100-profile-base-cnndm.txt").read_text() == earlier


def test_collect_replaces_an_earlier_collects_numbered_folders(tmp_path, monkeypatch):
    """A window's one call of step 50 collected after an earlier window's two: WORK/50_train.2/ of the
    earlier collect goes too. Left there, finish_on_cpu.sh (which takes the last numbered 50_train
    folder's picked.txt and predictions snapshot) finished this window's run with the other one's
    model choice, decoding flags and predictions."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    work = tmp_path / "work"
    for window, calls in (("w1", ("samsum-1", "samsum-2")), ("w2", ("cnndm-1",))):
        folders = []
        for call in calls:
            folder = tmp_path / window / call
            folder.mkdir(parents=True)
            _archive_of(folder, "50_train", {"picked.txt": f"{call} best.pt --beam-size 4\n",
                                             "log.txt": "== 50_train: exit 0 after 9 s\n"})
            folders.append(folder)
        collect.unpack(folders, work)
    assert sorted(p.name for p in work.iterdir()) == ["50_train"]
    assert (work / "50_train" / "picked.txt").read_text().startswith("cnndm-1 ")


def test_collect_keeps_what_an_archive_cut_short_holds(tmp_path, capsys, monkeypatch):
    """A step archive cut short (the call killed while the step packed it) gives the files before
    the cut, the one it cut removed, and says so; the call's other archives are filed as ever (it
    raised EOFError, and nothing of the window was filed)."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    call, bench, work = tmp_path / "call", tmp_path / "bench", tmp_path / "work"
    call.mkdir()
    dense = [("test_dense[4096-h16d64-full-triton-fwd]", "triton", 2e-3)]
    _archive_of(call, "20_bench_attention", {"bench_attention.json": bench_json(dense),
                                             "log.txt": "== 20_bench_attention: exit 0 after 99 s\n"})
    src = tmp_path / "src"
    src.mkdir()
    (src / "log.txt").write_text("== 21_bench_norm_ffn_embed: exit 0 after 88 s\n")
    (src / "zz.bin").write_bytes(os.urandom(200_000))  # after log.txt in the archive (tarfile adds in name order)
    with tarfile.open(call / "21_bench_norm_ffn_embed.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=".")
    os.truncate(call / "21_bench_norm_ffn_embed.tar.gz", 100_000)
    collect.main([str(call), "--bench-dir", str(bench), "--work", str(work)])
    out = capsys.readouterr().out
    assert "21_bench_norm_ffn_embed.tar.gz: cut short or unreadable" in out and "1 files unpacked" in out, out
    assert sorted(p.name for p in (work / "21_bench_norm_ffn_embed").iterdir()) == ["log.txt"]
    assert "exit 0 after 88 s" in out and "exit 0 after 99 s" in out
    assert len(json.loads((bench / "2026-12-01-h100.json").read_text())["benchmarks"]) == 1


def _cache_entry(monkeypatch, cache_dir, key, cubin_bytes=b"\x7fELF cubin"):
    """One compiled kernel as Triton's own FileCacheManager writes it: metadata, binary, IR files,
    the group file naming them (absolute paths), and an autotuner timings file."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
    m = FileCacheManager(key)
    group = {name: m.put(data, name) for name, data in (("k.json", '{"name": "k"}'), ("k.cubin", cubin_bytes),
                                                          ("k.ptx", "// ptx"), ("k.llir", "; llir"))}
    m.put_group("k.json", group)
    m.put('{"configs_timings": []}', "k.autotune.json")


def test_triton_cache_travels_to_another_machine(tmp_path, monkeypatch):
    """scripts/gpu/triton_cache.py: packed on one machine, restored at another path on the next,
    Triton's own cache manager finds each kernel's metadata and binary there (a cache hit: no
    compile) and its autotuner's timings; the IR files stay behind."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache
    from triton.runtime.cache import FileCacheManager

    first, second, archive = tmp_path / "first" / "cache", tmp_path / "second" / "cache", tmp_path / "c.tar.gz"
    for key in ("a" * 32, "b" * 32):
        _cache_entry(monkeypatch, first, key)
    assert triton_cache.main(["pack", str(first), str(archive)]) == 0
    names = sorted(tarfile.open(archive).getnames())
    assert not any(n.endswith((".ptx", ".llir")) for n in names) and len(names) == 8, names
    assert triton_cache.main(["restore", str(archive), str(second)]) == 0
    monkeypatch.setenv("TRITON_CACHE_DIR", str(second))
    for key in ("a" * 32, "b" * 32):
        m = FileCacheManager(key)
        group = m.get_group("k.json")
        assert set(group) == {"k.json", "k.cubin"} and all(p.startswith(str(second)) for p in group.values())
        assert open(group["k.cubin"], "rb").read() == b"\x7fELF cubin"
        assert m.get_file("k.autotune.json")


def test_triton_cache_pack_keeps_to_its_size_and_refuses_odd_archives(tmp_path, monkeypatch):
    """Newest entries first while the archive stays under --max-mb (the device returns files of up
    to 16 MiB); an archive whose members are not ENTRY/FILE is refused, not unpacked; a pack that
    fails leaves the archive it was replacing as it was."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    cache = tmp_path / "cache"
    for i, key in enumerate(("old" + "0" * 29, "new" + "0" * 29)):
        _cache_entry(monkeypatch, cache, key, cubin_bytes=os.urandom(40_000))
        for f in (cache / key).iterdir():
            os.utime(f, (1000.0 + i, 1000.0 + i))
    packed, skipped = triton_cache.pack(cache, tmp_path / "c.tar.gz", max_mb=60_000 / 2**20)
    assert (packed, skipped) == (1, 1)
    # xz, cut by a first try's ratio: random binaries do not compress, so again one of the two
    assert triton_cache.pack(cache, tmp_path / "c.tar.xz", max_mb=60_000 / 2**20) == (1, 1)
    assert (tmp_path / "c.tar.xz").stat().st_size <= 60_000
    assert triton_cache.pack(cache, tmp_path / "all.tar.xz", max_mb=1) == (2, 0)
    assert {n.split("/")[0] for n in tarfile.open(tmp_path / "c.tar.gz").getnames()} == {"new" + "0" * 29}
    assert (tmp_path / "c.tar.gz").stat().st_size <= 60_000
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "c.tar.gz", arcname="../escape")
    assert triton_cache.main(["restore", str(bad), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "escape").exists()
    # an archive appears under its name only whole: a pack that fails midway leaves the last one
    before = (tmp_path / "all.tar.xz").read_bytes()
    monkeypatch.setattr(tarfile.TarFile, "add", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        triton_cache.pack(cache, tmp_path / "all.tar.xz", max_mb=1)
    assert (tmp_path / "all.tar.xz").read_bytes() == before and not list(tmp_path.glob(".*.partial"))


def test_triton_cache_check_finds_a_prewarm_of_other_kernel_sources(tmp_path, monkeypatch, capsys):
    """A prewarm archive is stamped with the hash of the kernel sources it was compiled from; `check`
    says current while they are unchanged, and stale (exit 1) once a kernel file changes, even by a
    line added above a kernel (Triton's key holds each kernel's first line: the 2026-11-28 prewarm
    missed so), or the prewarm's workloads do; an archive without a stamp (a call's own cache) is
    named, not refused."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo, carried = tmp_path / "repo", tmp_path / "carried"
    (repo / "kernels").mkdir(parents=True)
    carried.mkdir()
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")
    for name in ("prewarm.tar.xz", "triton-cache.tar.gz"):
        (carried / name).write_bytes(b"")
    triton_cache.stamp(carried / "prewarm.tar.xz", repo)
    assert triton_cache.main(["check", str(carried), "--repo", str(repo)]) == 0
    assert dict(triton_cache.check(carried, repo)) == {carried / "prewarm.tar.xz": "current",
                                                      carried / "triton-cache.tar.gz": "unstamped"}
    (repo / "kernels" / "op.py").write_text("TABLE = {}\n@triton.jit\ndef k(x):\n    pass\n")
    assert triton_cache.main(["check", str(carried), "--repo", str(repo)]) == 1
    assert "prewarm.tar.xz: stale" in capsys.readouterr().out
    # a model added to the prewarm's workloads (a recipe's new norm or width) is not in the archive
    (repo / "tools").mkdir()
    (repo / "tools" / "prewarm.py").write_text("MODELS = []\n")
    triton_cache.stamp(carried / "prewarm.tar.xz", repo)
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "current"
    (repo / "tools" / "prewarm.py").write_text("MODELS = [('base pre-LN', {})]\n")
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "stale"


def test_collect_keeps_the_newest_calls_triton_cache_and_unpacks_it_as_no_step(tmp_path, monkeypatch):
    """run.sh's triton-cache.tar.gz lies beside a call's step archives but is no step: it goes whole
    into --cache-dir (what the next call carries), never unpacked into WORK as one; of several
    calls' caches, the newest by its time (here the first folder named) is the one kept."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    calls = []
    for name, mtime in (("call1", 2000.0), ("call2", 1000.0)):  # call1's cache written last
        folder = tmp_path / name
        folder.mkdir()
        _archive_of(folder, "10_tests", {"log.txt": "== 10_tests: exit 0 after 5 s\n"})
        (folder / "triton-cache.tar.gz").write_bytes(f"the Triton cache of {name}".encode())
        os.utime(folder / "triton-cache.tar.gz", (mtime, mtime))
        calls.append(folder)
    work, cache = tmp_path / "work", tmp_path / "gpu_cache"
    collect.main([*map(str, calls), "--bench-dir", str(tmp_path / "bench"), "--work", str(work),
                  "--cache-dir", str(cache)])
    assert sorted(p.name for p in work.iterdir()) == ["10_tests", "10_tests.2"]
    assert (cache / "triton-cache.tar.gz").read_bytes() == b"the Triton cache of call1"


def test_collect_files_both_end_to_end_benchmarks_apart_from_the_kernels(tmp_path, monkeypatch):
    """The end-to-end benchmarks, the training step's (steps 30 and 32) and generation's (step 31),
    go into <date>-<gpu>-e2e.json, and the kernels' (steps 20, 21) into <date>-<gpu>.json: targets.py
    reads issue 17's ratios from the first file and issue 16's from the second."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    monkeypatch.setattr(collect.subprocess, "run", lambda *a, **k: None)  # targets.py and the plots: not here
    call, bench = tmp_path / "call", tmp_path / "bench"
    call.mkdir()
    bench.mkdir()
    for step, json_name, case in (("20_bench_attention", "bench_attention", "test_dense[4096]"),
                                  ("30_bench_train_step", "bench_train_step", "test_train_step[triton-base-cnndm]"),
                                  ("31_bench_generate_profile", "bench_generate", "test_generate[triton-greedy]")):
        _archive_of(call, step, {f"{json_name}.json": bench_json([(case, "triton", 0.1)])})
    collect.main([str(call), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    filed = {p.name: sorted(b["name"] for b in json.loads(p.read_text())["benchmarks"]) for p in bench.glob("*.json")}
    assert filed == {"2026-12-01-h100.json": ["test_dense[4096]"],
                     "2026-12-01-h100-e2e.json": ["test_generate[triton-greedy]", "test_train_step[triton-base-cnndm]"]}


def test_triton_cache_pack_passes_over_an_entry_too_large_for_the_archive(tmp_path, monkeypatch):
    """A call's gzip archive (run.sh) takes each entry that still fits, newest first: an entry too
    large for --max-mb (the newest here, 200 kB against a 100 kB cap) is left out and the older,
    smaller ones after it still go in, rather than the archive ending at the first that does not fit.
    (The prewarm's xz archive keeps the longest prefix that fits: its order is the order of need.)"""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    cache = tmp_path / "cache"
    for i, (key, size) in enumerate((("old1" + "0" * 28, 10_000), ("old2" + "0" * 28, 10_000),
                                     ("big" + "0" * 29, 200_000))):
        _cache_entry(monkeypatch, cache, key, cubin_bytes=os.urandom(size))
        for f in (cache / key).iterdir():
            os.utime(f, (1000.0 + i, 1000.0 + i))
    assert triton_cache.pack(cache, tmp_path / "c.tar.gz", max_mb=100_000 / 2**20) == (2, 1)
    assert {n.split("/")[0] for n in tarfile.open(tmp_path / "c.tar.gz").getnames()} == {
        "old1" + "0" * 28, "old2" + "0" * 28}


def test_triton_cache_restore_refuses_a_member_outside_an_entry_folder(tmp_path, monkeypatch):
    """Triton's cache holds files only inside entry folders (ENTRY/FILE): an archive with a file at
    its top level or one folder deeper is refused, and nothing of it is unpacked."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    payload = tmp_path / "k.cubin"
    payload.write_bytes(b"\x7fELF")
    for i, name in enumerate(("k.cubin", "entry/sub/k.cubin")):
        archive, cache = tmp_path / f"odd{i}.tar.gz", tmp_path / f"cache{i}"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(payload, arcname="good/k.cubin")
            tar.add(payload, arcname=name)
        assert triton_cache.main(["restore", str(archive), str(cache)]) == 1, name
        assert not list(cache.rglob("*.cubin")), name


def test_triton_cache_check_finds_a_kernel_file_renamed(tmp_path, monkeypatch):
    """A kernel module renamed (kernels/op.py -> kernels/ops.py, its text the same) moves its kernels
    to another module, which Triton's cache key names (JITFunction's `module.qualname`): a prewarm
    stamped before then holds entries that miss, so `check` says stale."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo, carried = tmp_path / "repo", tmp_path / "carried"
    (repo / "kernels").mkdir(parents=True)
    carried.mkdir()
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")
    (carried / "prewarm.tar.xz").write_bytes(b"")
    triton_cache.stamp(carried / "prewarm.tar.xz", repo)
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "current"
    (repo / "kernels" / "op.py").rename(repo / "kernels" / "ops.py")
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "stale"
