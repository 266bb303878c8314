"""``--device``, checked once for every command: a name torch knows, a type the project runs on (cpu,
cuda) and a device this machine has; and `describe`, the device and software a run's log names."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

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


def describe(device: torch.device) -> str:
    """What a process runs on and with, for a run's log: the device (a GPU's model, memory and
    compute capability; a CPU's architecture and torch's threads), torch and its CUDA, Triton's
    release (read from its metadata, not imported), Python, and the commit of the checkout the
    package runs from (marked when it has uncommitted changes; left out outside a git checkout)."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        where = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
    else:
        where = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "not installed"
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    parts = [where, f"torch {torch.__version__}{cuda}", f"triton {triton}", f"python {platform.python_version()}"]
    commit = _commit(Path(__file__).resolve().parent.parent)
    return " | ".join(parts + ([f"commit {commit}"] if commit else []))


def _commit(repo: Path) -> str | None:
    """The short commit of the git checkout at `repo`, "+ changes" when it has uncommitted ones; None
    when it is not one (an installed wheel, a copy without .git) or git is missing."""
    if not (repo / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" + changes" if status.returncode == 0 and status.stdout.strip() else "")
