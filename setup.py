"""Build scratchformer: the Python package, the Triton kernels (kernels/ -> scratchformer.kernels)
and the C++/CUDA extension scratchformer._C (csrc/). Package metadata is in pyproject.toml.

The extension is C++ always; its CUDA sources (csrc/cuda/) are added when the installed torch
has CUDA and nvcc is found. Build without isolation so the installed torch is used:
    pip install --no-build-isolation -e .
DEBUG=1 builds with -O0 -g.
"""

import glob
import os
import shutil

from setuptools import setup

try:
    import torch
except ImportError as err:  # an isolated build (pyproject.toml leaves torch out of build requires)
    raise SystemExit(
        "scratchformer builds its extension against the installed torch: install torch first, then build "
        "without isolation: pip install --no-build-isolation -e ."
    ) from err
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
debug = os.environ.get("DEBUG", "0") == "1"
use_cuda = (
    torch.version.cuda is not None
    and (CUDA_HOME is not None or shutil.which("nvcc") is not None)
    and os.environ.get("SCRATCHFORMER_NO_CUDA", "0") != "1"
)

cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
cxx_flags += ["-std=c++17", "-fopenmp"] if os.name != "nt" else []
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
extra = {"cxx": cxx_flags}
if use_cuda:
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    # No --use_fast_math: the CUDA ops are memory-bound (fast math buys nothing) and it would swap
    # precise libm calls for approximate intrinsics and flush denormals, so CUDA results would
    # drift from CPU ones. csrc/cuda/embed_kernels.cu does not depend on it either way.
    extra["nvcc"] = (["-O0", "-g", "-G"] if debug else ["-O3"]) + ["-std=c++17"]
Extension = CUDAExtension if use_cuda else CppExtension

setup(
    packages=["scratchformer", "scratchformer.data", "scratchformer.evaluation", "scratchformer.kernels",
              "scratchformer.model", "scratchformer.training"],
    package_dir={"scratchformer": "scratchformer", "scratchformer.kernels": "kernels"},
    ext_modules=[
        Extension(
            "scratchformer._C",
            sources,
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"] if os.name != "nt" else [],
            define_macros=[("WITH_CUDA", None)] if use_cuda else [],
            # the headers (csrc/sinusoid.h, csrc/cuda/embed_limits.h): rebuild when one changes
            depends=sorted(glob.glob(os.path.join("csrc", "*.h")) + glob.glob(os.path.join("csrc", "cuda", "*.h"))),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
