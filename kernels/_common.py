"""Shared pieces of the Triton ops: interpreter detection, dtype checks, launch helpers.

Nothing here knows about the model. Each op file (attention.py, add_layer_norm.py, matmul.py,
ffn.py) imports what it needs from this module.
"""

from __future__ import annotations

import os

import torch

# Triton's interpreter is chosen when `triton.jit` decorates a function, from this variable; it
# is read once here so every op agrees on it.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "3.6.0" or "2.3.0.dev0+g1234"."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_interpreter_versions(triton_version: str, numpy_version: str) -> None:
    """Triton < 3.7's interpreter converts a 1-element array to int with int(), which numpy >= 2.3
    rejects ("only 0-dimensional arrays can be converted to Python scalars"): every kernel with a
    loop bound computed from a tensor dies inside the interpreter. Measured here with Triton 3.6.0
    + numpy 2.4.6 (fails) and 2.2.6 (all kernel tests pass); Triton 3.7.0 fixed it."""
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 3):
        raise RuntimeError(
            f"TRITON_INTERPRET=1 with triton {triton_version} needs numpy < 2.3 (found numpy "
            f"{numpy_version}): Triton's interpreter before 3.7 fails on newer numpy. Install "
            f"'numpy<2.3' or triton >= 3.7."
        )


if INTERPRET:
    import numpy
    import triton

    check_interpreter_versions(triton.__version__, numpy.__version__)


def check_device(name: str, *tensors: torch.Tensor | None) -> None:
    """All given tensors on one device; CUDA, or CPU only under the interpreter."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise ValueError(f"{name}: inputs are on different devices: {sorted(map(str, devices))}")
    dev = present[0].device
    if dev.type == "cpu" and not INTERPRET:
        raise ValueError(
            f"{name}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"import to run on CPU), got {dev}"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: unsupported device {dev}")


def check_dtype(name: str, *tensors: torch.Tensor | None) -> torch.dtype:
    """All given tensors share one supported floating dtype; returns it."""
    present = [t for t in tensors if t is not None]
    dtypes = {t.dtype for t in present}
    if len(dtypes) > 1:
        raise ValueError(f"{name}: dtype mismatch: {sorted(map(str, dtypes))}")
    dtype = present[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast bf16 operands to fp32 before tl.dot.

    Measured 2026-11 with Triton 3.9 under TRITON_INTERPRET=1: tl.dot on bf16 operands returns
    garbage (errors ~1e10); fp16 and fp32 are fine. On a GPU bf16 dots run natively.
    """
    return INTERPRET and dtype == torch.bfloat16


def philox_seed_offset() -> tuple[int, int]:
    """A (seed, offset) pair for in-kernel Philox dropout, drawn from torch's default CPU
    generator (no device sync), so `torch.manual_seed` makes kernel dropout reproducible. Under
    torch.compile (with `torch._dynamo.config.capture_scalar_outputs`, which
    `scratchformer.compile.compile_model` sets) the draws stay in the graph: `.item()` gives
    unbacked SymInts, fresh every step, that the ops' `SymInt seed, SymInt offset` args accept."""
    seed = torch.randint(0, 2**31 - 1, (1,), device="cpu").item()  # no int(): that would guard on it
    offset = torch.randint(0, 2**31 - 1, (1,), device="cpu").item()
    return seed, offset


def int_arg(value):
    """An int op argument: int(value), except a SymInt traced by torch.compile, passed as is."""
    return value if isinstance(value, torch.SymInt) else int(value)
