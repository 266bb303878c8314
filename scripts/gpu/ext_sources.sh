#!/usr/bin/env bash
# The hash of the extension's sources (what setup.py compiles): a prebuilt extension in .gpu_build/
# is reused only when its sources.sha256 matches the checkout's (scripts/gpu/prelude.sh).
cd "$(dirname "$0")/../.." && cat setup.py csrc/*.h csrc/*.cpp csrc/cuda/*.cpp csrc/cuda/*.cu | sha256sum | cut -d' ' -f1
