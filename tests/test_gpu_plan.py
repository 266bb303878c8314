"""The staged GPU plan (scripts/gpu/) tried on the CPU, so a broken step is found here, not in a
15-minute GPU window: every step runs with GPU_DRY_RUN=1 (the same commands; pytest only collects,
so paths, -k selections and markers are checked and GPU cases are skipped; the smoke run trains a
tiny model for 2 steps) and must exit 0 leaving exactly one archive with its log and environment.
The plan's shape is checked too: numbered steps that start with the shared prelude, state an
estimate of at most 9 minutes, wrap pytest in the prelude's helper (timeout -s INT, --maxfail, never
-x), and the README's windows: every call's steps fit its CALL_SECONDS, and every window's calls,
with the machine's start and a turnaround a call, fit the 15 minutes of device time a task has.
Here too: the prelude's rules, run.sh (a call's deadline, the Triton cache it carries and sends
back), ready.sh (`make gpu-check`) and the recipes. Step 50's rehearsals: test_gpu_train_step.py;
collect.py and the Triton cache's packing: test_gpu_collect.py."""

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpu_steps import GPU, REPO, STEPS, bench_json, dry_run, prelude_step, step_archive, step_env

FIRST_WINDOW = [s for s in STEPS if s < "50"]  # tests and benchmarks; 50_train (issue 18) is for later windows
DEVICE_SECONDS = 15 * 60  # a task's device time, every call, start and idle together
START_SECONDS, TURNAROUND_SECONDS = 90, 30  # a cold machine's start; a call's transfers and the gap before the next
SPARE_SECONDS = 60  # left over: a window must not end on its last second


def _estimate(text):
    m = re.search(r"estimate (\d+) min", text)
    return int(m.group(1)) if m else None


def _windows(readme):
    """The README's window table -> {window: [(CALL_SECONDS, [step numbers])]}."""
    windows = {}
    for window, command in re.findall(r"^\| ([^|]+?) \| [A-Z] \| `([^`]*run\.sh[^`]*)` \|", readme, re.M):
        seconds = int(re.search(r"CALL_SECONDS=(\d+)", command)[1])
        steps = command.split("run.sh", 1)[1].split()
        windows.setdefault(window.split(" (")[0], []).append((seconds, steps))
    return windows


def test_plan_shape():
    assert [s[:2] for s in STEPS] == ["00", "10", "20", "21", "30", "31", "32", "40", "50"], STEPS
    estimates = {}
    for step in STEPS:
        text = open(os.path.join(GPU, step)).read()
        code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert any(line.startswith("source ") and "prelude.sh" in line for line in code[:3]), step
        estimates[step[:2]] = _estimate(text)
        assert estimates[step[:2]] is not None and estimates[step[:2]] <= 9, (step, estimates[step[:2]])
        assert " -x" not in text and "--exitfirst" not in text, step
        for line in code:  # pytest only through run_pytest (timeout -s INT, --maxfail, junit, archive)
            assert "-m pytest" not in line, (step, line)
    readme = open(os.path.join(GPU, "README.md")).read()
    for step in STEPS:
        assert step in readme, step
    windows = _windows(readme)
    assert len(windows) >= 3 and {s[:2] for s in STEPS} == {n for calls in windows.values() for _, steps in calls
                                                           for n in steps}, windows
    for window, calls in windows.items():
        used = START_SECONDS + sum(seconds + TURNAROUND_SECONDS for seconds, _ in calls)
        assert used <= DEVICE_SECONDS - SPARE_SECONDS, (window, used)
        for seconds, steps in calls:  # a call's steps fit its deadline (50 stops itself at any deadline)
            assert sum(estimates[n] for n in steps if n != "50") * 60 <= seconds, (window, steps, seconds)


def test_every_step_dry_run(tmp_path):
    outs = {step: str(tmp_path / step[:2]) for step in FIRST_WINDOW}
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(FIRST_WINDOW, pool.map(lambda s: dry_run(s, outs[s]), FIRST_WINDOW), strict=True))
    failed = {s: (p.stdout[-2500:] + p.stderr[-1500:]) for s, p in results.items() if p.returncode != 0}
    assert not failed, "\n\n".join(f"== {s}\n{log}" for s, log in failed.items())
    for step in FIRST_WINDOW:
        files = os.listdir(outs[step])
        assert files == [step.replace(".sh", ".tar.gz")], (step, files)
        with tarfile.open(os.path.join(outs[step], files[0])) as tar:
            names = {os.path.normpath(n) for n in tar.getnames()}
        assert {"log.txt", "env.txt"} <= names, (step, names)
        log = results[step].stdout
        assert "| extension" in log and "nvidia-smi" in log, step  # the prelude's versions ran
        if "run_pytest" in open(os.path.join(GPU, step)).read():
            assert re.search(r"\d+(/\d+)? tests? collected", log), (step, log[-2000:])
    assert "smoke_eager" in results["40_smoke_train.sh"].stdout
    for step in FIRST_WINDOW:  # no checkpoint travels back (the smoke runs save theirs): the 64 MiB are the results'
        with tarfile.open(os.path.join(outs[step], step.replace(".sh", ".tar.gz"))) as tar:
            assert not [n for n in tar.getnames() if n.endswith(".pt")], step
    # steps 30 and 32 split the training-step cases: launched (less the recomputed layers') and graphed
    cases = {}
    for step in ("30_bench_train_step.sh", "32_bench_train_step_graph.sh"):
        with tarfile.open(os.path.join(outs[step], step.replace(".sh", ".tar.gz"))) as tar:
            listing = tar.extractfile("./bench_train_step.txt").read().decode()
        cases[step[:2]] = set(re.findall(r"::(test_\w+)\[", listing))
    assert cases == {"30": {"test_train_step"}, "32": {"test_train_step_graph"}}, cases
    # step 31's profile: the report in profile-<shape>.txt, the command's log beside it under its own
    # name (a cut run's traceback must not sit in a file named like a profile: collect.py files those)
    with tarfile.open(os.path.join(outs["31_bench_generate_profile.sh"], "31_bench_generate_profile.tar.gz")) as tar:
        profile = tar.extractfile("./profile-small-multi30k.txt").read().decode()
        assert "./profile_log-small-multi30k.txt" in tar.getnames()
        host = tar.extractfile("./host_overhead.txt").read().decode()  # bench/host_overhead.py, stubbed
    assert profile.startswith("training step profile:"), profile[:500]
    assert host.startswith("host time per call,") and "| triton |" in host, host[:500]


def test_targets_get_only_the_json_that_hold_something(tmp_path):
    """pytest-benchmark (the GPU machine's version) creates its --benchmark-json at startup and leaves
    it empty when it saves nothing (step 30's bench_generate.json on 2026-11-26): the prelude's
    run_targets names such a file and runs bench/targets.py on the others; with none, it skips."""
    case = bench_json([("test_train_step[triton-base-cnndm]", "triton", 0.1)]).replace("attention", "train_step")
    body = (f"printf '%s' '{case}' > \"$WORK/bench_train_step.json\"\n"
            ': > "$WORK/bench_generate.json"\nrun_targets\n')
    step = tmp_path / "98_targets.sh"
    p = prelude_step(step, body, tmp_path / "out")
    assert p.returncode == 0, p.stdout[-3000:]
    assert "bench_generate.json: empty (nothing saved), left out" in p.stdout
    targets = re.search(r"== \S+ targets \(limit \d+s\): (.*)", p.stdout)[1]
    assert "bench_train_step.json" in targets and "bench_generate.json" not in targets, targets
    files, _ = step_archive(str(tmp_path / "out"), "98_targets.sh")
    assert "targets.md" in files
    p = prelude_step(step, ': > "$WORK/bench_generate.json"\nrun_targets\n', tmp_path / "out2")
    assert p.returncode == 0 and "== targets: skipped" in p.stdout, p.stdout[-3000:]


def test_tests_step_runs_the_named_part(tmp_path):
    """TEST_PATHS runs a part of the suite in step 10 (the files of the kernels changed since a
    full run), and a path that does not exist fails the step rather than collecting nothing."""
    part = "tests/test_attention_tma.py tests/test_metrics.py"
    p = dry_run("10_tests.sh", str(tmp_path / "part"), TEST_PATHS=part)
    assert p.returncode == 0, p.stdout[-2000:]
    with tarfile.open(tmp_path / "part" / "10_tests.tar.gz") as tar:  # pytest's whole output (the log has its tail)
        listing = tar.extractfile("./tests.txt").read().decode()
    collected = set(re.findall(r"^(tests/\w+\.py)::", listing, re.M))
    assert collected == set(part.split()), collected
    p = dry_run("10_tests.sh", str(tmp_path / "bad"), TEST_PATHS="tests/test_no_such_file.py")
    assert p.returncode != 0, p.stdout[-2000:]


def test_bench_step_runs_the_named_groups(tmp_path):
    """BENCH_GROUPS picks step 21's benchmark groups (one kernel measured again after a change);
    a group it does not have fails the step by name."""
    p = dry_run("21_bench_norm_ffn_embed.sh", str(tmp_path / "one"), BENCH_GROUPS="add_layer_norm")
    assert p.returncode == 0, p.stdout[-2000:]
    assert "pytest bench_add_layer_norm" in p.stdout
    assert "bench_ffn" not in p.stdout and "bench_embed" not in p.stdout
    p = dry_run("21_bench_norm_ffn_embed.sh", str(tmp_path / "bad"), BENCH_GROUPS="add_layer_norm layernorm")
    assert p.returncode != 0 and "no group 'layernorm'" in p.stderr + p.stdout


def test_dry_run_catches_a_broken_selection(tmp_path):
    """A step whose pytest selection matches nothing (a renamed file, a stale -k) fails the dry run."""
    body = "run_pytest 60 1 broken tests/test_metrics.py -k no_test_has_this_name\n"
    p = prelude_step(tmp_path / "99_broken.sh", body, tmp_path / "out")
    assert p.returncode != 0, p.stdout[-2000:]
    assert os.listdir(tmp_path / "out") == ["99_broken.tar.gz"]  # packed even when failing


def test_a_step_terminated_still_packs_its_archive(tmp_path):
    """SIGTERM to a step's process group (a kill at a limit, timeout(1)'s way) still packs its archive,
    whose log says the step was stopped: the group's tee of the log died with it, the exit trap's
    first line then raised SIGPIPE, and the step ended with no archive at all (its log and results
    lost; the trap had also read exit 0)."""
    import time

    step = tmp_path / "97_term.sh"
    step.write_text(f'source "{GPU}/prelude.sh"\nrun_cmd 100 nap sleep 3\necho "== after the nap"\n')
    out, printed = tmp_path / "out", tmp_path / "stdout.txt"
    with open(printed, "w") as stdout:
        proc = subprocess.Popen(["bash", str(step)], cwd=REPO, env=step_env(OUT=str(out)), stdout=stdout,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 240
            while " nap (limit" not in printed.read_text() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143 and os.listdir(out) == ["97_term.tar.gz"], (rc, printed.read_text()[-2000:])
    _, log = step_archive(str(out), "97_term.sh")
    assert "== 97_term: exit 143 after" in log and "== after the nap" not in log, log[-2000:]


def test_prelude_replaces_an_extension_built_from_other_sources(tmp_path):
    """An extension the prelude put in scratchformer/ (an earlier call on a warm machine), stamped
    with other sources' hash (csrc/ fixed since), is neither reused nor sent back by step 00 under
    the new hash: the one carried in .gpu_build/, built from these sources, takes its place. One
    without a stamp (a developer's build) is used as it is, and one stamped with these sources is kept; one
    carried in .gpu_build/ from other sources is not used. A build that failed on these sources is not
    tried again by the call's later steps, unless it was cut by its time limit."""
    import importlib.machinery

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True)
    shutil.copytree(GPU, clone / "scripts" / "gpu", dirs_exist_ok=True)  # this checkout's scripts
    name = "_C" + importlib.machinery.EXTENSION_SUFFIXES[0]
    real = (Path(REPO) / "scratchformer" / name).read_bytes()
    current = subprocess.run(["bash", str(clone / "scripts" / "gpu" / "ext_sources.sh")], capture_output=True,
                             text=True, check=True).stdout.strip()
    (clone / ".gpu_build").mkdir()
    (clone / ".gpu_build" / name).write_bytes(real)
    (clone / ".gpu_build" / "sources.sha256").write_text(current + "\n")
    in_place, stamp = clone / "scratchformer" / name, clone / "scratchformer" / ".ext_sources.sha256"
    step = tmp_path / "99_ext.sh"
    step.write_text(f'PACK_EXT=1\nsource "{clone}/scripts/gpu/prelude.sh"\n')

    def call(out):
        p = subprocess.run(["bash", str(step)], cwd=clone, env=step_env(OUT=str(tmp_path / out)), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        with tarfile.open(tmp_path / out / "99_ext.tar.gz") as tar:
            sent = tar.extractfile(f"./build/{name}").read(), tar.extractfile("./build/sources.sha256").read()
        return p.stdout, sent

    in_place.write_bytes(real + b"built from other sources")  # loads as well: an ELF's trailing bytes are unread
    stamp.write_text("0" * 64 + "\n")
    log, sent = call("o1")
    assert "built from other sources" in log and "reusing the extension carried in .gpu_build/" in log, log[-2000:]
    assert in_place.read_bytes() == real and sent == (real, current.encode() + b"\n")
    assert stamp.read_text().strip() == current
    log, sent = call("o1b")  # the next call on the warm machine: stamped with these sources, kept as it is
    assert "built from other sources" not in log and "reusing" not in log and "building" not in log, log[-2000:]
    assert in_place.read_bytes() == real and sent == (real, current.encode() + b"\n")
    stamp.unlink()
    in_place.write_bytes(real + b"a developer's build")
    log, sent = call("o2")
    assert in_place.read_bytes() == sent[0] == real + b"a developer's build", log[-2000:]
    # a build that fails (here a python on which the extension never loads and setup.py fails) is not
    # tried again by a later step of the call (run.sh's GPU_DEADLINE, the same): its sources are
    # remembered; the next call (another deadline, on the machine still warm) tries again: it may
    # bring a fix outside those sources (the prelude's own environment)
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$1" in -) exit 1;; setup.py) echo "error: no compiler"; exit ${SETUP_EXIT:-1};;'
                    f' esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    (clone / ".gpu_build" / "sources.sha256").write_text("0" * 64 + "\n")  # carried, but of other sources: not used
    deadline = int(__import__("time").time()) + 3600
    logs = [subprocess.run(["bash", str(step)], cwd=clone, capture_output=True, text=True, timeout=300,
                           env={**step_env(OUT=str(tmp_path / out)), "PY": str(fake), "GPU_DEADLINE": str(d),
                                "SETUP_EXIT": str(code)})
            for out, d, code in (("o3", deadline, 1), ("o4", deadline, 1), ("o5", deadline + 1, 1),
                                 ("o6", deadline + 2, 124), ("o7", deadline + 2, 1))]
    assert all(p.returncode != 0 for p in logs)
    assert "error: no compiler" in logs[0].stdout
    assert ".gpu_build/ holds an extension built from other sources (sources.sha256): building" in logs[0].stdout
    # a build cut by its time limit (timeout's 124) says nothing of the sources: the next step tries again
    assert "error: no compiler" in logs[4].stdout and "in an earlier step" not in logs[4].stdout, logs[4].stdout[-2000:]
    assert "failed to build from these sources in an earlier step" in logs[1].stdout, logs[1].stdout[-2000:]
    assert "building the extension" in logs[1].stdout and "no compiler" not in logs[1].stdout
    assert "error: no compiler" in logs[2].stdout and "in an earlier step" not in logs[2].stdout, logs[2].stdout[-2000:]


def test_every_recipe_parses():
    """Each recipe of 50_train.sh (and each ablation variant) is a valid train command line, and its
    decoding (DECODE, RUNTIME, each of LENGTH_PENALTIES) valid flags of both evaluate and generate that
    fit the run's longest output (SCORE: of evaluate), so a typo costs no GPU call. A recipe ends in
    its window: its runs' time budgets together (JOBS of a grid's at once) leave its first call (the
    README's window table) three minutes for the start and the final reports; a grid that predicts (a
    search: DECODE set) names the METRIC that picks its best variant."""
    from scratchformer import evaluate, generate
    from scratchformer.data import resolve_source
    from scratchformer.training.config import parse_args

    names = subprocess.run(["bash", "-c", f'source "{GPU}/recipes.sh"; echo $RECIPES'], capture_output=True,
                           text=True, check=True).stdout.split()
    assert {"multi30k", "multi30k-eager", "iwslt", "samsum", "cnndm", "ablate-multi30k"} <= set(names)
    first_call = _windows(open(os.path.join(GPU, "README.md")).read())["4 and on"][0][0]
    for name in names:
        show = (f'source "{GPU}/recipes.sh"; recipe {name} && printf "%s\\n" "${{FLAGS[@]}}" -- "${{VARIANTS[@]}}" '
                f'-- "${{DECODE[@]}}" "${{RUNTIME[@]}}" -- "${{SCORE[@]}}" -- "${{LENGTH_PENALTIES[@]}}"')
        lines = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.splitlines()
        cut = [i for i, line in enumerate(lines) if line == "--"]
        assert len(cut) == 4, (name, lines)
        flags, variants = lines[:cut[0]], [v for v in lines[cut[0] + 1:cut[1]] if v]
        decode, score = lines[cut[1] + 1:cut[2]], lines[cut[2] + 1:cut[3]]
        penalties = [["--length-penalty", lp] for lp in lines[cut[3] + 1:] if lp]
        assert "--kernel" in flags and flags[flags.index("--precision") + 1] == "bf16", name
        jobs, metric, decodes = subprocess.run(["bash", "-c", f'source "{GPU}/recipes.sh"; recipe {name}; echo '
                                                '"$JOBS ${METRIC:--} ${#DECODE[@]}"'], capture_output=True,
                                               text=True).stdout.split()
        assert not (variants and decodes != "0") or metric != "-", name  # a search picks its best by METRIC
        budgets = []
        for variant in variants or ["="]:
            extra = variant.split("=", 1)[1].split()
            config, _ = parse_args([*flags, *extra, "--out", "runs/x"])
            assert config.kernel == ("eager" if "eager" in extra else "triton"), (name, variant)
            budgets.append(config.time_budget or 0.0)
        budget = sum(max(budgets[i:i + int(jobs)]) for i in range(0, len(budgets), int(jobs)))  # waves of JOBS
        assert budget <= first_call - 180, (name, budget, first_call)
        batch = ["--checkpoint", "x.pt", "--input", "in.jsonl", "--output", "p.jsonl"]  # as 50_train.sh predicts
        for (command, inputs), penalty in itertools.product(((evaluate, ["--checkpoint", "x.pt", *score]),
                                                             (generate, batch)), [[], *penalties]):
            args = command.build_parser().parse_args([*inputs, *decode, *penalty])
            command.check_args(args)
            assert not penalty or args.length_penalty == float(penalty[1]), (name, penalty)
            longest = config.resolved(resolve_source(config.dataset, None, None).task, synthetic=False).max_tgt_len
            assert args.min_len < longest, (name, decode)


def test_recipes_with_cuda_graphs():
    """CUDA_GRAPHS=1 (the default): every recipe (and variant) trains with --cuda-graphs, its validations and
    checkpoints GRAPH_SPACING times further apart in steps, and a run sized in time has its step
    cap raised as much; a fixed-step grid keeps its steps."""
    from scratchformer.training.config import parse_args

    names = subprocess.run(["bash", "-c", f'source "{GPU}/recipes.sh"; echo $RECIPES'], capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        configs = {}
        for graphs in ("0", "1"):
            show = f'source "{GPU}/recipes.sh"; CUDA_GRAPHS={graphs} recipe {name} && printf "%s\\n" "${{FLAGS[@]}}"'
            flags = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.split()
            configs[graphs], _ = parse_args([*flags, "--out", "runs/x"])
        plain, graphed = configs["0"], configs["1"]
        assert not plain.cuda_graphs and graphed.cuda_graphs, name
        default = f'source "{GPU}/recipes.sh"; unset CUDA_GRAPHS; recipe {name} && printf "%s\\n" "${{FLAGS[@]}}"'
        flags = subprocess.run(["bash", "-c", default], capture_output=True, text=True, check=True).stdout.split()
        assert "--cuda-graphs" in flags, f"{name}: the recipes replay CUDA graphs unless CUDA_GRAPHS=0"
        assert graphed.eval_every == 4 * plain.eval_every and graphed.save_every == 4 * plain.save_every, name
        assert graphed.max_steps == plain.max_steps * (4 if plain.time_budget else 1), name


def test_train_extra_with_compile_drops_the_recipes_cuda_graphs():
    """TRAIN_EXTRA="--compile --compile-mode reduce-overhead" (step 50's extra flags, as the README
    suggests) on a recipe with --cuda-graphs (the default), which train refuses beside --compile: the
    recipe's --cuda-graphs goes and train takes the flags; other extra flags leave it."""
    from scratchformer.training.config import parse_args

    def flags(extra):
        show = (f'source "{GPU}/recipes.sh"; unset CUDA_GRAPHS; recipe iwslt && train_extra "{extra}" >/dev/null '
                '&& printf "%s\\n" "${FLAGS[@]}"')
        return subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.split()

    compiled = flags("--compile --compile-mode reduce-overhead")
    assert "--cuda-graphs" not in compiled and compiled[-3:] == ["--compile", "--compile-mode", "reduce-overhead"]
    config, _ = parse_args([*compiled, "--out", "runs/x"])
    assert config.compile == "inductor" and config.compile_mode == "reduce-overhead" and not config.cuda_graphs
    assert "--cuda-graphs" in flags("--label-smoothing 0.2")


def test_run_sh_restores_the_carried_cache_and_sends_it_back(tmp_path):
    """run.sh restores the carried archives (prewarm's .tar.xz, a call's .tar.gz) into
    TRITON_CACHE_DIR once per machine, and packs that folder into $OUT/triton-cache.tar.gz at the
    end of the call, whatever its steps did."""
    src = tmp_path / "src"
    (src / "e").mkdir(parents=True)
    (src / "e" / "k.json").write_text("{}")
    (src / "f").mkdir()
    (src / "f" / "k.cubin").write_bytes(b"\x7fELF")
    carried = tmp_path / "carried"
    carried.mkdir()
    with tarfile.open(carried / "triton-cache.tar.gz", "w:gz") as tar:
        tar.add(src / "e" / "k.json", arcname="e/k.json")
    with tarfile.open(carried / "prewarm.tar.xz", "w:xz") as tar:
        tar.add(src / "f" / "k.cubin", arcname="f/k.cubin")
    out, cache = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache), "TRITON_CACHE_CARRIED": str(carried)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "no step 99" in res.stdout, res.stdout + res.stderr
    assert (cache / "e" / "k.json").exists() and (cache / "f" / "k.cubin").exists() and (cache / ".restored").exists()
    assert sorted(tarfile.open(out / "triton-cache.tar.gz").getnames()) == ["e/k.json", "f/k.cubin"]


def test_run_sh_sends_back_the_cache_in_what_the_steps_leave_of_64_mib(tmp_path):
    """The device brings back 64 MiB in all: run.sh packs the Triton cache into what the steps' files
    leave (step 50's weights may take 45 MiB), not a fixed 15 MiB beside them, which could take a
    call past 64 and lose a file there (a weights piece: collect.py then joined the others)."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    for i, name in enumerate(("a" * 32, "b" * 32)):
        (cache / name).mkdir(parents=True)
        (cache / name / "k.cubin").write_bytes(os.urandom(6 << 20))  # random: gzip keeps 6 MiB each
        os.utime(cache / name / "k.cubin", (1000.0 + i, 1000.0 + i))
    (cache / ".restored").touch()
    out.mkdir()
    with open(out / "50_x-averaged.pt.part0", "wb") as f:  # what the steps wrote: 53 MiB
        f.truncate(53 << 20)
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    total = sum(f.stat().st_size for f in out.iterdir())
    assert total <= 64 << 20 and [n.split("/")[0] for n in tarfile.open(out / "triton-cache.tar.gz").getnames()] == [
        "b" * 32], (total, res.stdout)


def _ready_repo(tmp_path: Path) -> Path:
    """A checkout holding what scripts/gpu/ready.sh reads: its scripts, setup.py, csrc/ and an empty kernels/."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    for name in ("ready.sh", "ext_sources.sh", "triton_cache.py"):
        shutil.copy(os.path.join(GPU, name), repo / "scripts" / "gpu")
    shutil.copy(os.path.join(REPO, "setup.py"), repo)
    shutil.copytree(os.path.join(REPO, "csrc"), repo / "csrc")
    (repo / "kernels").mkdir()
    return repo


def _ready(repo: Path) -> subprocess.CompletedProcess:
    """scripts/gpu/ready.sh run in `repo`: its exit status and the parts it names."""
    return subprocess.run(["bash", str(repo / "scripts" / "gpu" / "ready.sh")], capture_output=True, text=True,
                          timeout=60)


def test_ready_names_what_a_call_would_carry_stale_or_missing(tmp_path, monkeypatch):
    """scripts/gpu/ready.sh (make gpu-check), run before a window's first device call: exit 0 only
    when the extension in .gpu_build/ and each carried Triton archive were made from the checkout's
    sources and the wheels and data are there; otherwise exit 1, naming each part. A csrc/ edit
    makes the extension stale, a kernels/ edit the prewarm (a session once found it so by hand)."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo = _ready_repo(tmp_path)
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")

    def ready():
        p = _ready(repo)
        return p.returncode, p.stdout

    rc, out = ready()
    assert rc == 1 and "missing: .gpu_build" in out and "missing: .whl" in out and "missing: .gpu_data" in out, out
    assert "missing: .gpu_cache and .gpu_cache-pinned" in out and "== not ready" in out, out

    def build_ext():  # what make gpu-ext stamps
        (repo / ".gpu_build").mkdir(exist_ok=True)
        (repo / ".gpu_build" / "sources.sha256").write_text(subprocess.run(
            ["bash", str(repo / "scripts" / "gpu" / "ext_sources.sh")], capture_output=True, text=True,
            check=True).stdout)

    build_ext()
    (repo / ".whl").mkdir()
    (repo / ".whl" / "rouge_score-0.1.2-py3-none-any.whl").write_bytes(b"")
    (repo / ".gpu_cache-pinned").mkdir()
    (repo / ".gpu_cache-pinned" / "prewarm.tar.xz").write_bytes(b"")
    triton_cache.stamp(repo / ".gpu_cache-pinned" / "prewarm.tar.xz", repo)
    (repo / ".gpu_data" / "multi30k").mkdir(parents=True)
    rc, out = ready()
    assert rc == 0 and "current: .gpu_build" in out and "prewarm.tar.xz: current" in out, out
    assert "packed: .gpu_data/ multi30k" in out and "== ready" in out, out
    cu = next((repo / "csrc" / "cuda").glob("*.cu"))
    cu.write_text(cu.read_text() + "// fixed since\n")
    rc, out = ready()
    assert rc == 1 and "stale: .gpu_build" in out and "prewarm.tar.xz: current" in out, out
    build_ext()
    (repo / "kernels" / "op.py").write_text("TABLE = {}\n@triton.jit\ndef k(x):\n    pass\n")
    rc, out = ready()
    assert rc == 1 and "current: .gpu_build" in out and "prewarm.tar.xz: stale" in out, out


def test_run_sh_gives_each_step_the_calls_deadline_and_reports_a_failed_or_skipped_step(tmp_path):
    """run.sh exports the call's deadline (now + CALL_SECONDS) to its steps, whose limits it caps;
    a step that fails makes the call fail; a step that would start with under a minute left is
    skipped, named, and fails the call too (its archive will be missing). By default the call's
    deadline is 570 s away: the device allows a command 600, and run.sh packs the cache after the steps."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    shutil.copy(os.path.join(GPU, "run.sh"), gpu)
    (gpu / "10_a.sh").write_text('echo "deadline ${GPU_DEADLINE:-unset}"; exit 3\n')
    (gpu / "20_b.sh").write_text('echo "b ran"\n')
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".restored").touch()  # restored already: nothing carried to restore
    env = {k: v for k, v in os.environ.items() if k != "OUT"}

    def call(seconds):
        env.update(TRITON_CACHE_DIR=str(cache), CALL_SECONDS=str(seconds))
        if seconds is None:
            del env["CALL_SECONDS"]
        start = int(__import__("time").time())
        p = subprocess.run(["bash", str(gpu / "run.sh"), "10", "20"], env=env, capture_output=True, text=True,
                           timeout=60)
        return start, p

    start, p = call(300)
    deadline = int(re.search(r"deadline (\d+)", p.stdout)[1])
    assert p.returncode == 3 and "b ran" in p.stdout and start + 300 <= deadline <= start + 302, p.stdout
    start, p = call(None)  # the default: 570 of the 600 s the device allows a command, 30 for the cache's packing
    deadline = int(re.search(r"deadline (\d+)", p.stdout)[1])
    assert start + 570 <= deadline <= start + 572, p.stdout
    _, p = call(59)
    assert p.returncode == 1 and "deadline" not in p.stdout and "b ran" not in p.stdout, p.stdout
    assert "SKIPPED 10_a.sh" in p.stdout and "SKIPPED 20_b.sh" in p.stdout, p.stdout


def test_run_sh_sends_back_no_cache_archive_over_15_mib(tmp_path, monkeypatch):
    """A file comes back from the device only under 16 MiB: with nothing else in $OUT, run.sh still
    packs the Triton cache into at most 15 MiB (the newest entries), not all 63 the call leaves."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    for i, name in enumerate(("a" * 32, "b" * 32, "c" * 32)):
        (cache / name).mkdir(parents=True)
        (cache / name / "k.cubin").write_bytes(os.urandom(6 << 20))  # random: gzip keeps 6 MiB each
        os.utime(cache / name / "k.cubin", (1000.0 + i, 1000.0 + i))
    (cache / ".restored").touch()
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    archive = out / "triton-cache.tar.gz"
    assert archive.stat().st_size <= 15 << 20, res.stdout
    assert sorted(n.split("/")[0] for n in tarfile.open(archive).getnames()) == ["b" * 32, "c" * 32], res.stdout
    # triton_cache.py's own default, packing by hand without --max-mb: the same 15 MiB
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    assert triton_cache.main(["pack", str(cache), str(tmp_path / "by_hand.tar.gz")]) == 0
    assert (tmp_path / "by_hand.tar.gz").stat().st_size <= 15 << 20


def test_prelude_caps_each_commands_limit_by_the_dry_run_and_the_calls_deadline(tmp_path):
    """`limit SECONDS` (every run_pytest and run_cmd): SECONDS, at most 240 in a dry run, and never
    past the call's deadline less 25 s for packing, nor under 10 s: hand-worked for a deadline 100 s
    away (75) and one 20 s away (-5: 10)."""
    body = ('echo "dry $(limit 300) $(limit 30) gpu $(DRY=0 limit 300)"\n'
            'echo "near $(DRY=0 GPU_DEADLINE=$(( $(date +%s) + 100 )) limit 300)"\n'
            'echo "past $(DRY=0 GPU_DEADLINE=$(( $(date +%s) + 20 )) limit 300)"\n'
            'echo "far $(DRY=0 GPU_DEADLINE=$(( $(date +%s) + 1000 )) limit 300)"\n')
    p = prelude_step(tmp_path / "96_limit.sh", body, tmp_path / "out")
    assert p.returncode == 0, p.stdout[-3000:]
    assert "dry 240 30 gpu 300" in p.stdout, p.stdout[-2000:]
    assert int(re.search(r"near (\d+)", p.stdout)[1]) in (74, 75), p.stdout[-2000:]
    assert "past 10" in p.stdout and "far 300" in p.stdout, p.stdout[-2000:]


def test_train_extra_with_compile_in_one_word_drops_the_recipes_cuda_graphs():
    """TRAIN_EXTRA="--compile=inductor" (the flag and its backend in one word, as argparse takes it) is
    --compile too: the recipe's --cuda-graphs, which train refuses beside it, goes."""
    from scratchformer.training.config import parse_args

    show = (f'source "{GPU}/recipes.sh"; unset CUDA_GRAPHS; recipe iwslt && train_extra "--compile=inductor" '
            '>/dev/null && printf "%s\\n" "${FLAGS[@]}"')
    flags = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.split()
    assert "--cuda-graphs" not in flags and flags[-1] == "--compile=inductor", flags
    config, _ = parse_args([*flags, "--out", "runs/x"])
    assert config.compile == "inductor" and not config.cuda_graphs


def test_run_sh_restores_the_carried_cache_once_per_machine(tmp_path):
    """A warm machine's second call finds TRITON_CACHE_DIR/.restored and restores nothing again: the
    carried (older) archive must not overwrite what the first call compiled or tuned since."""
    carried, cache = tmp_path / "carried", tmp_path / "cache"
    carried.mkdir()
    (cache / "e").mkdir(parents=True)
    (cache / "e" / "k.autotune.json").write_text('{"tuned": "on this machine, after the restore"}')
    (cache / ".restored").touch()
    src = tmp_path / "k.autotune.json"
    src.write_text('{"tuned": "carried"}')
    with tarfile.open(carried / "triton-cache.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="e/k.autotune.json")
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "TRITON_CACHE_DIR": str(cache),
           "TRITON_CACHE_CARRIED": str(carried)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "restored" not in res.stdout, res.stdout + res.stderr
    assert (cache / "e" / "k.autotune.json").read_text() == '{"tuned": "on this machine, after the restore"}'


def test_run_sh_sends_back_no_cache_archive_where_the_steps_leave_no_room(tmp_path):
    """Steps that leave under 1 MiB of the 64 the device returns (step 50's weights, say): no
    triton-cache.tar.gz at all, said so. Not an empty one, which collect.py would keep in .gpu_cache
    over the last good one, and the next call would carry nothing."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / ("a" * 32)).mkdir(parents=True)
    (cache / ("a" * 32) / "k.cubin").write_bytes(b"\x7fELF")
    (cache / ".restored").touch()
    out.mkdir()
    with open(out / "50_x-averaged.pt.part0", "wb") as f:  # what the steps wrote: 62.5 MiB, counted as 63
        f.truncate((125 << 20) // 2)
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["50_x-averaged.pt.part0"], res.stdout
    assert "Triton cache not sent back: the steps' files take 63 MiB" in res.stdout, res.stdout


def test_ready_wants_the_rouge_score_wheel_not_any_wheel(tmp_path, monkeypatch):
    """.whl holding other wheels but not rouge-score's (the one the ROUGE tests and the summarization
    scores import on the GPU machine, which has no network) is missing it: not ready, named."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo = _ready_repo(tmp_path)
    (repo / ".gpu_build").mkdir()
    (repo / ".gpu_build" / "sources.sha256").write_text(subprocess.run(
        ["bash", str(repo / "scripts" / "gpu" / "ext_sources.sh")], capture_output=True, text=True, check=True).stdout)
    (repo / ".gpu_cache").mkdir()
    (repo / ".gpu_cache" / "prewarm.tar.xz").write_bytes(b"")
    triton_cache.stamp(repo / ".gpu_cache" / "prewarm.tar.xz", repo)
    (repo / ".gpu_data" / "multi30k").mkdir(parents=True)
    (repo / ".whl").mkdir()
    (repo / ".whl" / "nltk-3.9.1-py3-none-any.whl").write_bytes(b"")
    p = _ready(repo)
    assert p.returncode == 1 and "missing: .whl/rouge_score-*.whl" in p.stdout and "== not ready" in p.stdout, p.stdout
    (repo / ".whl" / "rouge_score-0.1.2-py3-none-any.whl").write_bytes(b"")
    p = _ready(repo)
    assert p.returncode == 0 and "current: .whl" in p.stdout, p.stdout


def test_a_step_exits_with_its_first_failing_commands_status_not_its_last(tmp_path):
    """A step's exit status is that of its first command that failed (run_pytest's or run_cmd's),
    whatever runs after it: pytest's 5 (nothing collected) before a command's 3, the 3 before a
    pytest's 5, and either before a last command that succeeds (a step then ending 0 would hide it)."""
    body = ('run_pytest 60 1 empty tests/test_metrics.py -k no_test_has_this_name\n'
            'run_cmd 30 three sh -c "exit 3"\n'
            'echo "first pytest: $STATUS"; STATUS=0\n'
            'run_cmd 30 three sh -c "exit 3"\n'
            'run_pytest 60 1 empty tests/test_metrics.py -k no_test_has_this_name\n'
            'echo "first a command: $STATUS"\n'
            'run_cmd 30 fine true\n')
    p = prelude_step(tmp_path / "95_status.sh", body, tmp_path / "out")
    assert "first pytest: 5" in p.stdout and "first a command: 3" in p.stdout, p.stdout[-3000:]
    assert p.returncode == 3 and "== 95_status: exit 3 after" in p.stdout, p.stdout[-3000:]
