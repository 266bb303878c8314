"""Loading a trained model to run: a checkpoint file or run folder -> (model, tokenizers, checkpoint
dict) (`load_run`), several as one ensemble (`load_models`), each checked where it is read (a
`CheckpointError` naming the file)."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import data as D
from ..checkpoint import RUN_KEYS, CheckpointError, find_checkpoint, load_checkpoint
from ..compile import compile_for_inference
from ..data.tokenizer import TokenizerPair
from ..model import Ensemble, ModelConfig, build_model


def load_run(checkpoint: str | Path, device: str | torch.device = "cpu", kernel: str | None = None,
             compile: str | None = None):
    """A checkpoint file or run folder -> (model in eval mode, tokenizers, checkpoint dict). kernel:
    override the backend; compile: a torch.compile backend (`compile_for_inference`), None = eager.
    Raises CheckpointError naming the file when it lacks a part (`RUN_KEYS`) or its parts disagree."""
    path = find_checkpoint(checkpoint)
    ckpt = load_checkpoint(path, require=RUN_KEYS)
    check_run_fields(path, ckpt)
    try:  # data from a file: any fault is the file's
        cfg = ModelConfig.from_dict({**ckpt["config"], **({"kernel": kernel} if kernel is not None else {})})
        tokenizers = TokenizerPair.from_dict(ckpt["tokenizers"])
    except Exception as e:
        detail = f"no {e}" if isinstance(e, KeyError) else e
        raise CheckpointError(f"{path}: bad model config or tokenizer in the checkpoint ({detail})") from None
    model = build_model(cfg, device)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[:2]
        raise CheckpointError(f"{path}: the weights do not fit the checkpoint's config ({' '.join(first)})") from None
    model.eval()
    if compile:
        model = compile_for_inference(model, backend=compile)
    ckpt["path"] = str(path)
    return model, tokenizers, ckpt


def check_run_fields(path: Path, ckpt: dict) -> None:
    """CheckpointError naming the file for a task that is not one of `data.TASKS`, training arguments
    that are not a dict, or lengths a run is read and decoded at (max_src_len, max_tgt_len) that are
    not integers >= 2."""
    if ckpt["task"] not in D.TASKS:
        raise CheckpointError(f"{path}: unknown task {ckpt['task']!r} in the checkpoint (one of {', '.join(D.TASKS)})")
    if not isinstance(ckpt["args"], dict):
        raise CheckpointError(f"{path}: bad training arguments in the checkpoint: a {type(ckpt['args']).__name__}, "
                              "not a dict")
    for key in ("max_src_len", "max_tgt_len"):
        value = ckpt["args"].get(key, 2)  # an older version's, without them: not read here
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise CheckpointError(f"{path}: bad training arguments in the checkpoint: {key} must be an integer >= 2, "
                                  f"got {value!r}")


def load_models(checkpoints, device: str | torch.device = "cpu", kernel: str | None = None,
                compile: str | None = None):
    """One checkpoint (a file or run folder) or a list of them -> (model, tokenizers, checkpoint
    dict), as `load_run`. Several load as an `Ensemble` (their predictions averaged), which needs
    one task, one tokenizer pair and, where they name them, one set of class names: a
    CheckpointError names the first checkpoint that differs.
    The dict is then the first checkpoint's, with "ensemble": every checkpoint's path and step, the
    longest max_src_len / max_tgt_len of its members in "args", "member_args": the others' args."""
    paths = [checkpoints] if isinstance(checkpoints, (str, Path)) else list(checkpoints)
    loaded = [load_run(p, device, kernel, compile) for p in paths]
    model, tokenizers, ckpt = loaded[0]
    if len(loaded) == 1:
        return model, tokenizers, ckpt
    for _, _, other in loaded[1:]:
        if other["task"] != ckpt["task"]:
            raise CheckpointError(f"{other['path']} was trained for {other['task']}, {ckpt['path']} for "
                                  f"{ckpt['task']}: an ensemble's models share one task")
        if other["tokenizers"] != ckpt["tokenizers"]:
            raise CheckpointError(f"{other['path']} and {ckpt['path']} have different tokenizers: an ensemble "
                                  "averages its models' predictions over one vocabulary")
        names = [class_names(c) for c in (other, ckpt)]
        if None not in names and names[0] != names[1]:
            raise CheckpointError(f"{other['path']} names its classes {names[0]}, {ckpt['path']} {names[1]}: an "
                                  "ensemble averages its models' probabilities of each class id, one class each")
    ensemble = Ensemble(m for m, _, _ in loaded).eval()
    # the longest source and output of any member (within the positions all of them admit): the same
    # ensemble in any order reads and decodes the same (the first member's once decided)
    longest = {k: min(max(c["args"][k] for _, _, c in loaded), ensemble.cfg.max_len - 1)
               for k in ("max_src_len", "max_tgt_len")}
    ckpt = {**ckpt, "args": {**ckpt["args"], **longest},
            "ensemble": [{"path": c["path"], "step": c.get("progress", {}).get("step")} for _, _, c in loaded],
            "member_args": [c["args"] for _, _, c in loaded[1:]]}
    return ensemble, tokenizers, ckpt


def class_names(ckpt: dict) -> dict[int, str] | None:
    """A classifier checkpoint's class names (its data's meta.json "labels"); None: it has none."""
    return (ckpt.get("data") or {}).get("labels") or None
