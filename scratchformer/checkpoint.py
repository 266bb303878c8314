"""Checkpoints: atomic, verified, and loadable without unpickling arbitrary objects.

File layout: ``MAGIC`` (8 bytes) | payload length (8 bytes, little endian) | SHA-256 of the
payload (32 bytes) | payload, where the payload is `torch.save` of a dict of tensors, numbers,
strings, lists and dicts. Loading checks magic, length and hash *before* reading the payload,
then reads it with ``torch.load(weights_only=True)``, which refuses anything but plain data.
Writing goes to ``NAME.tmp``, is fsynced, then renamed over ``NAME`` (and the folder fsynced),
so a crash leaves either the old file or the new one, never a torn one; a failed write (a full
disk, a read-only folder) removes the temp file and names the path. `write_lines_atomic` does the
same for the text files of a run (predictions, metrics).

A training checkpoint holds: model, optimizer, scheduler and GradScaler states, RNG states
(Python, NumPy, torch CPU and CUDA), progress (step, epoch, batch within the epoch, early
stopping state), the model config, the training arguments, the data source and the tokenizers.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import lzma
import os
import random
import re
import struct
import sys
from pathlib import Path

import numpy as np
import torch

MAGIC = b"SFCKPT01"
_COMPRESS = {".gz": gzip.compress, ".xz": lzma.compress}  # write_lines_atomic by suffix
_HEADER = len(MAGIC) + 8 + 32


class CheckpointError(RuntimeError):
    """A checkpoint file that is missing, truncated, corrupt or not ours."""


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_in_the_way(folder: str | Path) -> Path | None:
    """The file that stands where `folder` or one of its parents must be a folder (nothing could be
    written there: found before the work, not after it), or None."""
    above = next((p for p in (Path(folder), *Path(folder).parents) if p.exists()), None)
    return above if above is not None and not above.is_dir() else None


def output_file_refusal(output: Path, holds: str, example: str, flag: str = "--output") -> str | None:
    """Why a command's --output FILE (its `flag`) cannot be written, found before its work (the final
    rename would fail after it), or None: a folder, or a path under a file. `holds`: what the file would
    hold, as the message names it ("the checkpoint"); `example`: a file name to suggest in the folder."""
    if output.is_dir():
        return f"{flag} {output} is a folder: name {holds} file (e.g. {output / example})"
    if (above := file_in_the_way(output.parent)) is not None:
        return f"{flag} {output}: {above} is a file, not a folder: {holds} cannot go under it"
    return None


def write_error(e: OSError, path: Path, what: str = "") -> OSError:
    """The error of a failed atomic write, naming the file, what to do, and that a previous file is
    intact (same errno, so the same OSError subclass: PermissionError stays one)."""
    remedy = {errno.ENOSPC: "the disk is full: free some space and retry",
              errno.EDQUOT: "the disk quota is exhausted: free some space and retry",
              errno.EROFS: f"the folder {path.parent} is on a read-only file system: write elsewhere",
              errno.EACCES: f"the folder {path.parent} is not writable: write elsewhere",
              errno.EPERM: f"the folder {path.parent} is not writable: write elsewhere"}.get(e.errno)
    parts = [f"cannot write {what}{path}: {e.strerror or e}", remedy, f"any previous {path.name} is left as it was"]
    return OSError(e.errno, "; ".join(filter(None, parts)))


def _atomic(path: Path, tmp: Path, write, what: str = "") -> Path:
    """Call write(tmp), fsync'd there, then rename tmp over path; on any failure remove tmp and
    raise (an OSError with an errno as `write_error`)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:  # a SIGKILL skips this: the temp file stays (a run's: --overwrite deletes it)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only folder: there is no temp file to remove
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise write_error(e, path, what) from e
        raise
    fsync_dir(path.parent)
    return path


def write_lines_atomic(path: str | Path, lines) -> Path:
    """Write lines (each without its newline) to `path` atomically: a temp file in the same
    folder, flushed and fsynced, then renamed over `path`. A crash leaves the old file or none;
    a failure (a full disk, a read-only folder) removes the temp file and names `path`. A name
    ending in .gz or .xz is written compressed so, as `data.files.read_lines` reads it back."""
    path = Path(path)
    compress = _COMPRESS.get(path.suffix, lambda data: data)  # plain: as it is, not copied
    return write_bytes_atomic(path, compress("".join(line + "\n" for line in lines).encode("utf-8")))


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically, as `write_lines_atomic` (a plot's PNG, a log's lines)."""
    path = Path(path)

    def write(tmp):
        with open(tmp, "wb") as f:  # open(), not mkstemp: the umask's mode, not 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return _atomic(path, path.with_name(f".{path.name}.{os.getpid()}.tmp"), write)


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write `state` to `path` atomically (temp file, fsync, rename). On failure (a full disk, a
    read-only folder) the temp file is removed, a previous `path` is left as it was, and the
    OSError names the file."""
    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", len(payload)))
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    return _atomic(path, path.with_name(path.name + ".tmp"), write, "checkpoint ")


# What a checkpoint must hold to be run (`evaluation.loading.load_run`) or resumed (the trainer).
RUN_KEYS = ("model", "config", "tokenizers", "task", "args")
RESUME_KEYS = (*RUN_KEYS, "optimizer", "scheduler", "progress", "rng", "data")


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a file that begins as a checkpoint does (`MAGIC`), whatever its name."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def load_checkpoint(path: str | Path, map_location="cpu", require: tuple[str, ...] = ()) -> dict:
    """Read and verify a checkpoint; raises CheckpointError naming the file and the fault, also
    when the checkpoint lacks a key of `require` (e.g. `RUN_KEYS`, `RESUME_KEYS`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    if len(data) < _HEADER or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path} is not a scratchformer checkpoint (bad header; truncated or another format)")
    (length,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    digest = data[len(MAGIC) + 8 : _HEADER]
    payload = data[_HEADER:]
    if len(payload) != length:
        raise CheckpointError(f"{path} is truncated: payload has {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: SHA-256 of the payload does not match the header")
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as e:  # the hash matched, so this is a version or content problem
        # torch's refusal of an object a checkpoint never holds is a page advising weights_only=False: its reason
        reason = re.search(r"WeightsUnpickler error: (.*?\.)(?:\s|$)", str(e))
        raise CheckpointError(f"{path}: cannot load payload ({reason[1] if reason else ' '.join(str(e).split())})"
                              f"{'; a checkpoint holds tensors and plain values only' * bool(reason)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the payload is a {type(state).__name__}, not a checkpoint dict")
    missing = [k for k in require if k not in state]
    if missing and "averaged_from" in state:
        raise CheckpointError(f"{path} is the average of {len(state['averaged_from'])} checkpoints' weights "
                              f"(scratchformer.average): it evaluates, generates and starts a run (--init-from), "
                              f"but has no {', '.join(map(repr, missing))} to resume one from")
    if missing:
        have = ", ".join(map(repr, sorted(map(str, state)))) or "none"
        raise CheckpointError(f"{path} is incomplete: no {', '.join(map(repr, missing))} (it holds {have}); "
                              "not a checkpoint written by scratchformer's trainer?")
    return state


def rng_state(device: torch.device | None = None) -> dict:
    """This process's random states, for an exact resume, and on a CUDA `device` that device's (every
    visible GPU's were saved: a run resumed where fewer are visible failed restoring them); "seed" (the
    seed torch's stream started from: per rank under DDP) is a record, not restored."""
    np_state = np.random.get_state()
    state = {
        "seed": torch.initial_seed(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = [torch.cuda.get_rng_state(device)]
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore `rng_state`'s states; its CUDA one on a CUDA `device` (of a checkpoint that saved every
    visible GPU's, before 2026-12-07, the one of the device's index where it has one, else the first)."""
    version, keys, gauss_next = state["python"]  # lists come back as lists from torch.load
    random.setstate((version, tuple(keys), gauss_next))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and device is not None and device.type == "cuda":
        states, index = state["cuda"], device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_rng_state(states[index] if index < len(states) else states[0], device)


_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def step_checkpoints(folder: str | Path, after: int | None = None) -> list[Path]:
    """``step_NNNNNNN.pt`` files in a folder, oldest first; with `after`, those of later steps only."""
    folder = Path(folder)
    found = [(int(m.group(1)), p) for p in folder.glob("step_*.pt") if (m := _STEP_FILE.match(p.name))]
    return [p for n, p in sorted(found) if after is None or n > after]


def prune_checkpoints(folder: str | Path, keep: int, upto: int | None = None) -> None:
    """Delete all but the newest `keep` step checkpoints (best.pt and last.pt are separate). With
    `upto` (the step just saved) only those up to it are counted and pruned: a later one belongs to
    another history (a run resumed from an older checkpoint), and is never deleted for this one."""
    if keep <= 0:
        return
    later = set(step_checkpoints(folder, after=upto)) if upto is not None else set()
    for p in [p for p in step_checkpoints(folder) if p not in later][:-keep]:
        p.unlink(missing_ok=True)


def average_checkpoints(paths: list[str | Path], dtype: torch.dtype | None = None) -> dict:
    """The mean of the weights of checkpoints of one run, as Vaswani et al. (2017) average a run's last
    5 or 20: a checkpoint that runs (`RUN_KEYS` and the progress of the newest of `paths`, the highest
    step, a tie the later given; no optimizer: it cannot resume); the mean does not depend on their order.
    Floating-point tensors are summed in float64 and cast back (to `dtype` if given: bf16 halves the
    file, and a model loads the values into its own dtype); any other tensor must be equal in all.
    Tied weights (`--tie-embeddings`: names that share one tensor) stay one tensor, so the average is no
    larger than the model. A checkpoint of another model (config,
    tokenizers, task, tensor names or shapes) is a CheckpointError naming it, and so is one of a run
    trained from another seed's random weights: independent runs' weights average into a model that
    does not work (an ensemble of them does: evaluate/generate --checkpoint A B). Runs started from a
    checkpoint (train --init-from: fine-tunes of one model average, as model soups do; a run's second
    phase continues its first) are taken as they are."""
    if not paths:
        raise ValueError("no checkpoints to average")
    first = _an_average_input(paths[0], len(paths))
    weights = first["model"]
    total = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
    newest, steps, max_lens = first, [first["progress"]["step"]], [first["config"].get("max_len", 0)]
    digests = {weights_digest(weights): 0}  # -> the index of the first checkpoint holding those weights
    for i, path in enumerate(paths[1:], 1):
        last = _an_average_input(path, len(paths))
        steps.append(last["progress"]["step"])
        newest = last if steps[-1] >= newest["progress"]["step"] else newest
        max_lens.append(last["config"].get("max_len", 0))
        differ = [k for k in ("config", "tokenizers", "task") if _same_model(last, k) != _same_model(first, k)]
        shapes = {k: tuple(v.shape) for k, v in last["model"].items()}
        if differ or shapes != {k: tuple(v.shape) for k, v in weights.items()}:
            what = ", ".join(differ) or "tensor names or shapes"
            raise CheckpointError(f"{path} is not a checkpoint of {paths[0]}'s model: its {what} differ")
        seeds = [_scratch_seed(last), _scratch_seed(first)]
        if None not in seeds and seeds[0] != seeds[1]:
            raise CheckpointError(f"{path} is of a run trained from --seed {seeds[0]}'s random weights, {paths[0]} "
                                  f"from --seed {seeds[1]}'s: independent runs' weights do not average into a working "
                                  f"model; predict with them as an ensemble (evaluate/generate --checkpoint A B)")
        if (same := digests.setdefault(weights_digest(last["model"]), i)) != i:
            raise CheckpointError(f"{paths[same]} (step {steps[same]}) and {path} (step {steps[i]}) hold the same "
                                  f"weights (a run's best.pt is the step file of its best step): they would count "
                                  f"twice in the average; give one of them")
        for k, v in last["model"].items():
            if v.is_floating_point():
                total[k] += v.double()
            elif not torch.equal(v, total[k]):
                raise CheckpointError(f"{path}: its {k} differs from {paths[0]}'s, and cannot be averaged")
    model = {k: (v / len(paths)).to(dtype or weights[k].dtype) if v.is_floating_point() else v
             for k, v in total.items()}
    for names in _tied(weights):
        model.update(dict.fromkeys(names[1:], model[names[0]]))
    kept = {k: newest[k] for k in ("version", "data", "num_classes", "args", "progress") if k in newest}
    config = {**newest["config"], **({"max_len": max(max_lens)} if "max_len" in newest["config"] else {})}
    return {**kept, **{k: newest[k] for k in RUN_KEYS}, "model": model, "config": config,
            "averaged_from": [{"path": str(p), "step": s} for p, s in zip(paths, steps, strict=True)]}


def _an_average_input(path: str | Path, n: int) -> dict:
    """A checkpoint to average with n - 1 others: not itself an average (its steps would be weighted
    unevenly, and the record would name it as one step)."""
    ckpt = load_checkpoint(path, require=(*RUN_KEYS, "progress"))
    if n > 1 and ckpt.get("averaged_from"):
        steps = ", ".join(str(a["step"]) for a in ckpt["averaged_from"])
        raise CheckpointError(f"{path} is itself the average of steps {steps}: averaged with others, those steps "
                              f"would weigh unevenly; give its step checkpoints instead")
    return ckpt


# ModelConfig fields that do not change what the weights mean: the backend that runs them (a run may
# resume with another --kernel) and the longest input admitted (a guard; --init-from raises it).
_RUNTIME_FIELDS = ("kernel", "max_len")


def weights_digest(weights: dict) -> str:
    """SHA-256 of a state dict's tensors (names, dtypes, shapes, values): equal for the same weights in
    whatever file (a copy, best.pt and the step file of its step, the average of one checkpoint)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _same_model(ckpt: dict, key: str):
    """What must be equal in checkpoints averaged together: `key` of `ckpt`, a config without
    `_RUNTIME_FIELDS`."""
    if key != "config":
        return ckpt[key]
    return {k: v for k, v in ckpt["config"].items() if k not in _RUNTIME_FIELDS}


def _scratch_seed(ckpt: dict) -> int | None:
    """The seed of the random weights a checkpoint's run started from; None for a run started from a
    checkpoint (train --init-from), or one whose arguments are not saved."""
    args = ckpt.get("args") or {}
    return None if args.get("init_from") else args.get("seed")


def _tied(weights: dict) -> list[list[str]]:
    """The groups of names in a state dict that are one tensor (same storage, offset, shape, strides)."""
    groups: dict[tuple, list[str]] = {}
    for k, v in weights.items():
        groups.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride()), []).append(k)
    return [names for names in groups.values() if len(names) > 1]


def find_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint file, or a run folder: its best.pt (or last.pt when `prefer` is "last"),
    falling back to the other, then to the newest step file; a fallback is said on stderr."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    order = ["best.pt", "last.pt"] if prefer == "best" else ["last.pt", "best.pt"]
    found = next((path / name for name in order if (path / name).is_file()), None)
    found = found or next(iter(step_checkpoints(path)[-1:]), None)
    if found is None:
        raise CheckpointError(f"{path} holds no checkpoint (best.pt, last.pt or step_*.pt)")
    if found.name != order[0]:  # best.pt: none when no validation scored a best step
        print(f"{path} has no {order[0]}: using {found}", file=sys.stderr)
    return found
