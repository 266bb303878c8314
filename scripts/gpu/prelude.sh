# Sourced first by every step of the GPU plan (scripts/gpu/README.md); idempotent, so a step can
# run on a fresh machine or after another step on a warm one.
#   - installs the carried wheels (.whl/, `make wheels`) into a target dir on PYTHONPATH
#   - makes scratchformer importable from the checkout (kernels/ as scratchformer.kernels) and
#     builds the extension, or reuses a matching one carried in .gpu_build/ or already in place
#   - checks CUDA_HOME names a real toolkit (nvcc under it), prints the versions that matter
#   - starts the step's work folder; `finish` (an EXIT trap) packs it into ONE archive in $OUT
# GPU_DRY_RUN=1: the same commands on a CPU machine (make test runs them), GPU parts skipped,
# short timeouts; the step scripts shrink their work with it.
# shellcheck shell=bash
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
STEP=$(basename "$0" .sh)
DRY=${GPU_DRY_RUN:-0}
if [ -z "${PY:-}" ]; then  # the checkout's virtualenv where there is one (make install), else the machine's python3
  if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # a warm machine's second run of a key reuses its tuning
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-0}  # tests and smoke runs: one config per kernel
OUT=${OUT:-$REPO/gpu_out}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/$STEP.XXXXXX")
mkdir -p "$OUT"
T0=$(date +%s)
# everything the step prints also travels back; the tee outlives a signal to the step's process group
# (a kill at a limit), so that the exit trap still writes and packs (its first echo raised SIGPIPE)
exec > >(trap '' INT TERM HUP; exec tee -a "$WORK/log.txt") 2>&1

STATUS=0  # the step's exit status: the first failing command's (run_pytest, run_cmd)
# pack: the step's work folder as it stands into ONE archive, $OUT/STEP.tar.gz (the device returns at most
# 8 files), written beside it and renamed over it: a kill midway leaves the last whole archive. tar's exit 1
# is a file that grew as it was read (the log, still being written): packed as it was.
pack() {
  local tmp=$OUT/$STEP.tar.gz.tmp
  tar czf "$tmp" -C "$WORK" .
  if [ $? -le 1 ]; then mv "$tmp" "$OUT/$STEP.tar.gz"; else rm -f "$tmp"; return 1; fi
}
finish() {  # the exit trap: the step's last archive
  local rc=$?
  [ "$rc" = 0 ] && rc=$STATUS
  echo "== $STEP: exit $rc after $(( $(date +%s) - T0 )) s"
  sleep 0.2  # let tee flush
  pack && echo "== packed $OUT/$STEP.tar.gz ($(du -h "$OUT/$STEP.tar.gz" | cut -f1))"
  rm -rf "$WORK"
  exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM; trap 'exit 130' INT; trap 'exit 129' HUP  # the archive says it was stopped (not exit 0)

# limit SECONDS: what a command may take: SECONDS, at most 240 in a dry run (the test suite runs
# beside it; 120 s cut step 31's CPU profile once, on a machine busy with other work too), and
# never past the call's deadline (GPU_DEADLINE, set by run.sh) less 25 s for packing.
limit() {
  local s=$1 left
  if [ "$DRY" = 1 ] && [ "$s" -gt 240 ]; then s=240; fi
  if [ -n "${GPU_DEADLINE:-}" ]; then
    left=$(( GPU_DEADLINE - $(date +%s) - 25 ))
    if [ "$left" -lt "$s" ]; then s=$(( left > 10 ? left : 10 )); fi
  fi
  echo "$s"
}

# GPU_WORKERS: how many pytest processes a test step runs side by side (pytest-xdist, one test at a
# time each: --dist load). A Triton compile is 1-3 s of CPU work and the kernel tests need about 250
# (tests/test_compile_budget.py) while their GPU work is small, so the machine's cores compile them
# together: default its cores less 2, at most 14; 0 runs one process. Without xdist: one process.
if [ -z "${GPU_WORKERS:-}" ]; then
  GPU_WORKERS=$(( $(nproc) - 2 )); [ "$GPU_WORKERS" -gt 14 ] && GPU_WORKERS=14; [ "$GPU_WORKERS" -lt 2 ] && GPU_WORKERS=2
fi
if [ "$GPU_WORKERS" != 0 ] && ! "$PY" -c "import xdist" 2>/dev/null; then
  echo "== pytest-xdist is missing: the tests run in one process"; GPU_WORKERS=0
fi
# WARM_WORKERS: the same for warm_bench's compile passes (a benchmark case holds more memory): at
# most WARM_MAX (default 6), which a step sets before sourcing this to its compiling cases' count,
# so that they go in one wave (step 30: 9, each a base or small model, a few GiB on an 80 GB GPU)
WARM_WORKERS=${WARM_WORKERS:-$(( GPU_WORKERS < ${WARM_MAX:-6} ? GPU_WORKERS : ${WARM_MAX:-6} ))}

# run_pytest SECONDS MAXFAIL NAME ARGS...: pytest under `timeout -s INT` (pytest then writes its
# report and a --benchmark-json before exiting) with --maxfail, not -x, so one failure hides
# nothing; its output is saved as NAME.txt and its junit XML as NAME.xml in the archive. A dry run
# only collects (paths, -k selections and markers are checked; an empty selection fails).
# WORKERS=N run_pytest ...: in N xdist processes (a test step: GPU_WORKERS); never for timing.
run_pytest() {
  local secs maxfail name
  secs=$(limit "$1"); maxfail=$2; name=$3; shift 3
  if [ "${WORKERS:-0}" != 0 ] && [ "$GPU_WORKERS" != 0 ]; then set -- -n "$WORKERS" --dist load "$@"; fi
  [ "$DRY" = 1 ] && set -- --collect-only "$@"
  echo "== $(date -u +%T) pytest $name (limit ${secs}s): $*"
  timeout -s INT -k 20 "$secs" "$PY" -m pytest -p no:cacheprovider --maxfail="$maxfail" -q -rfEs \
    --junitxml="$WORK/$name.xml" "$@" 2>&1 | tee "$WORK/$name.txt" | tail -40
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "== $name: TIMED OUT after ${secs}s (partial results kept)"
  [ "$rc" != 0 ] && [ "$STATUS" = 0 ] && STATUS=$rc
  return "$rc"
}

# warm_bench SECONDS NAME K FILE...: the benchmark cases of the FILEs (within pytest -k K; empty:
# all) that compile, ours ("triton") and torch.compile's ("compile"), each run once under
# --benchmark-disable in WARM_WORKERS processes side by side (bench/conftest.py's run_bench warms
# a case up, then skips it). Triton's and Inductor's on-disk caches then hold their binaries, and
# the timed run after it (one process: timings must not share the GPU) loads them instead of
# compiling one by one, which autotuning (a few dozen configs a shape) makes the larger part of a
# benchmark step. Autotuning's choices made side by side are not cached
# (TRITON_CACHE_AUTOTUNING=0): the timed run tunes again, on cached binaries. A failure here
# (memory, with several cases at once) costs the timed run only its compiles: logged in NAME.txt,
# not the step's status (but in a dry run, where it means a selection that matches nothing).
# Without workers (WARM_WORKERS=0, no xdist) it does nothing.
warm_bench() {
  local secs=$1 name=$2 sel="triton or compile" status=$STATUS
  if [ "$WARM_WORKERS" = 0 ] || [ "$GPU_WORKERS" = 0 ]; then return 0; fi
  [ -n "$3" ] && sel="($3) and ($sel)"
  shift 3
  TRITON_CACHE_AUTOTUNING=0 WORKERS=$WARM_WORKERS run_pytest "$secs" 1000 "$name" "$@" --benchmark-disable -k "$sel"
  [ "$DRY" = 1 ] || STATUS=$status
}

# run_cmd SECONDS NAME COMMAND...: any other command, under the same rules (output in NAME.txt).
run_cmd() {
  local secs name
  secs=$(limit "$1"); name=$2; shift 2
  echo "== $(date -u +%T) $name (limit ${secs}s): $*"
  timeout -s INT -k 20 "$secs" "$@" > "$WORK/$name.txt" 2>&1
  local rc=$?
  tail -12 "$WORK/$name.txt"
  [ "$rc" = 124 ] && echo "== $name: TIMED OUT after ${secs}s"
  [ "$rc" != 0 ] && [ "$STATUS" = 0 ] && STATUS=$rc
  return "$rc"
}

# saved_json: SAVED=(the step's bench_*.json that hold something). pytest-benchmark (the GPU
# machine's version) creates its --benchmark-json at startup and leaves it EMPTY when nothing was
# saved (a run cut before its first case): such a file is named and left out, as a reader's JSON
# parse would fail on it.
saved_json() {
  SAVED=()
  local f
  for f in "$WORK"/bench_*.json; do
    if [ -s "$f" ]; then SAVED+=("$f"); elif [ -e "$f" ]; then echo "== $(basename "$f"): empty (nothing saved), left out"; fi
  done
}

# run_targets: bench/targets.py (issue 16/17 ratios) over saved_json's files into targets.md;
# skipped, and said so, when there are none (a dry run: nothing timed; a step cut before its first case).
run_targets() {
  saved_json
  if [ "${#SAVED[@]}" = 0 ]; then echo "== targets: skipped, no benchmark JSON with anything saved"; return 0; fi
  run_cmd 60 targets "$PY" bench/targets.py "${SAVED[@]}" --out "$WORK/targets.md"
}

echo "== $(date -u) $STEP on $(hostname), dry run: $DRY, SCRATCHFORMER_AUTOTUNE=$SCRATCHFORMER_AUTOTUNE"

# 1. carried wheels (rouge-score, nltk, defusedxml: `make wheels`) into a target dir
SITE=${GPU_SITE:-${TMPDIR:-/tmp}/scratchformer-site}
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  stamp=$(ls "$REPO"/.whl/*.whl | xargs -n1 basename | sort | tr '\n' ' ')
  if [ "$(cat "$SITE/.stamp" 2>/dev/null)" != "$stamp" ]; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$REPO"/.whl/*.whl && echo "$stamp" > "$SITE/.stamp" && echo "== installed wheels: $stamp"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== no carried wheels in .whl/ (make wheels); ROUGE tests fail where rouge-score is missing"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# 2. CUDA_HOME: torch guesses it from `which nvcc`, which can be a wrapper outside the toolkit
cuda_ok() { [ -n "$1" ] && [ -x "$1/bin/nvcc" ] && [ -e "$1/include/cuda_runtime.h" ]; }
if ! cuda_ok "${CUDA_HOME:-}"; then
  nvcc_real=$(command -v nvcc >/dev/null && readlink -f "$(command -v nvcc)")
  for cand in "${CUDA_HOME:-}" "${nvcc_real:+$(dirname "$(dirname "$nvcc_real")")}" /usr/local/cuda /usr/local/cuda-*; do
    if cuda_ok "$cand"; then export CUDA_HOME=$cand; break; fi
  done
fi
if cuda_ok "${CUDA_HOME:-}"; then
  echo "== CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -1))"
elif [ "$DRY" = 1 ]; then
  echo "== no CUDA toolkit (dry run: the extension builds for CPU only)"; unset CUDA_HOME
else
  echo "== WARNING: no CUDA toolkit with bin/nvcc and include/cuda_runtime.h found (CUDA_HOME=${CUDA_HOME:-unset}):"
  echo "   the extension is built without its CUDA op"; export SCRATCHFORMER_NO_CUDA=1; unset CUDA_HOME
fi

# 3. the package from the checkout: kernels/ is scratchformer.kernels (setup.py's mapping)
[ -e scratchformer/kernels ] || ln -sfn ../kernels scratchformer/kernels  # -n: never a link inside an existing one (steps may race)

# 4. the extension: reuse one that loads (in place, or carried in .gpu_build/), else build it;
# 5. the versions that matter (one python start for both: each costs seconds)
versions() {
  timeout 120 "$PY" - > "$WORK/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import torch
import scratchformer._C  # noqa: F401  (fails here when the extension is missing or stale)
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", gpu, "| extension", scratchformer._C.__file__)
for dist in ("triton", "numpy", "pip", "setuptools", "rouge-score", "nltk", "sacrebleu", "tokenizers", "pytest"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "MISSING")
try:  # what Triton's cache keys hash of Triton itself: equal to tools/prewarm.py's, its entries can hit
    import hashlib
    from triton.runtime.cache import triton_key
    print("triton build key", hashlib.sha256(triton_key().encode()).hexdigest()[:16])
except Exception as e:  # noqa: BLE001  (informative only)
    print("triton build key unknown:", e)
EOF
}
SOURCES_HASH=$(bash "$REPO/scripts/gpu/ext_sources.sh")
# An extension this script put in scratchformer/ (an earlier call on this machine, still warm) is
# stamped with its sources' hash: from other sources (csrc/ fixed since), it is not reused, nor sent
# back under this hash. One without a stamp (a developer's `make install`) is left alone.
EXT_STAMP=scratchformer/.ext_sources.sha256
if [ -e "$EXT_STAMP" ] && [ "$(cat "$EXT_STAMP")" != "$SOURCES_HASH" ]; then
  echo "== the extension in scratchformer/ was built from other sources ($EXT_STAMP): replacing it"
  rm -f scratchformer/_C*.so "$EXT_STAMP"
fi
reuse_carried() {  # the extension carried in .gpu_build/, if built from these sources
  compgen -G ".gpu_build/_C*.so" >/dev/null || return 1
  if [ "$(cat .gpu_build/sources.sha256 2>/dev/null)" != "$SOURCES_HASH" ]; then
    echo "== .gpu_build/ holds an extension built from other sources (sources.sha256): building"; return 1
  fi
  cp .gpu_build/_C*.so scratchformer/ && echo "$SOURCES_HASH" > "$EXT_STAMP" &&
    echo "== reusing the extension carried in .gpu_build/"
}
if compgen -G "scratchformer/_C*.so" >/dev/null; then  # one in place that does not load: the carried one
  versions || { reuse_carried && versions; }
else
  reuse_carried; versions
fi
if ! grep -q "| extension" "$WORK/env.txt"; then
  echo "== $(date -u +%T) building the extension (setup.py build_ext --inplace)"
  b0=$(date +%s)
  # a GPU names its arch to torch's build; without one (a dry run with a CUDA torch) name them
  if [ "$DRY" = 1 ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then export TORCH_CUDA_ARCH_LIST="8.0;9.0"; fi
  # a build that failed on these sources (not on its time limit: 124, or 137 killed after it) fails
  # again: a later step of the call (run.sh goes on, its GPU_DEADLINE the call's) is not given its
  # minutes. Only of this call: the marker stays on a warm machine, and the next call may bring a fix
  # outside the hashed sources (this prelude's environment, say), which it must try
  failed_key="$SOURCES_HASH call ${GPU_DEADLINE:-}"
  if [ -n "${GPU_DEADLINE:-}" ] && [ "$(cat .gpu_build_failed 2>/dev/null)" = "$failed_key" ]; then
    echo "== the extension failed to build from these sources in an earlier step (.gpu_build_failed): not again"
    exit 1
  fi
  timeout "$(DRY=0 limit 300)" "$PY" setup.py -q build_ext --inplace > "$WORK/build.txt" 2>&1 ||
    { rc=$?; tail -30 "$WORK/build.txt"; case $rc in 124 | 137) ;; *) echo "$failed_key" > .gpu_build_failed ;; esac; exit 1; }
  echo "== built in $(( $(date +%s) - b0 )) s"
  versions || { cat "$WORK/env.txt"; exit 1; }
  echo "$SOURCES_HASH" > "$EXT_STAMP"
fi
cat "$WORK/env.txt"
if [ "${PACK_EXT:-0}" = 1 ]; then  # step 00 sends the built extension back, for .gpu_build/
  { mkdir -p "$WORK/build" && cp scratchformer/_C*.so "$WORK/build/" && echo "$SOURCES_HASH" > "$WORK/build/sources.sha256"; } ||
    { echo "== PACK_EXT: no extension in scratchformer/ to send back"; exit 1; }
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$WORK/env.txt"
else
  echo "nvidia-smi: not found" | tee -a "$WORK/env.txt"
fi
