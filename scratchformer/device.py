"""``--device``, checked once for every command: a name torch knows, a type the project runs on (cpu,
cuda) and a device this machine has."""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """A --device this machine cannot use; the message names the flag and what to use instead."""


def resolve_device(name: str | None) -> torch.device:
    """``--device``: None = cuda when there is one, else cpu. DeviceError for a name torch does not
    know, a device type the project does not run on (anything but cpu and cuda[:N]: meta, mps, xpu, ...)
    or a CUDA device this machine lacks (instead of torch's AssertionError much later)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {name}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if device.type not in ("cpu", "cuda"):  # meta failed after step 1 (a half-built run), mps in model.to
        raise DeviceError(f"--device {name}: scratchformer runs on cpu or cuda[:N] only, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda} but no GPU visible" if torch.version.cuda else "a CPU-only build"
            raise DeviceError(f"--device {name}: no CUDA device here (torch {torch.__version__}, {build}); "
                              "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
