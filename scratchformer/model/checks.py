"""The models' checks of what comes in at their boundary (`Transformer.forward/encode/decode/init_state`,
`Classifier.forward`, `Extractor.forward`): a batch of token ids with its lengths (`check_batch`), and an
encoder output handed back to the decoder (`check_memory`).

Shapes, dtypes and devices always (no tensor data read); token ids and lengths in range only where
`op_checks.value_checks` allows (CPU tensors, or anywhere with SCRATCHFORMER_DEBUG=1), so a GPU step never
waits on a host sync. Each raises ValueError naming the argument and the problem.
"""

from __future__ import annotations

import torch

from .. import op_checks
from ..ops import autocast_on


def check_batch(name: str, tokens: torch.Tensor, lengths: torch.Tensor | None, *, vocab: int, max_len: int) -> None:
    """The model's one check of a batch: tokens (B, L) int ids in [0, vocab), lengths (B,) in [0, L]."""
    for what, t in ((name, tokens), (f"{name}_lengths", lengths)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{what} must be a tensor, got {type(t).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must be (B, L) token ids, got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32/int64 token ids, got {tokens.dtype}")
    B, L = tokens.shape
    if L > max_len:
        raise ValueError(f"{name} length {L} exceeds max_len {max_len}")
    if tokens.numel() and op_checks.value_checks(tokens):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), got min {lo} max {hi} in {name}")
    if lengths is not None:
        _check_lengths(f"{name}_lengths", lengths, B, L, of=name)


def check_memory(memory, src_lengths, src: torch.Tensor | None = None, *, d_model: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    """An encoder output handed to the decoder: memory (B, Ls, d_model) in the model's `dtype` (under
    autocast on its device, any of float16, bfloat16 and float32: the matmuls cast it) on the model's
    `device`; src_lengths (B,) in [0, Ls] on the same device; the source ids src, where given (already
    checked as a batch), (B, Ls)."""
    for what, t in (("memory", memory), ("src_lengths", src_lengths)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what} must be a tensor, got {type(t).__name__}")
    if memory.dim() != 3 or memory.shape[2] != d_model:
        raise ValueError(f"memory must be the encoder output (B, Ls, d_model) = (B, Ls, {d_model}), got shape "
                         f"{tuple(memory.shape)}")
    if memory.device != device:
        raise ValueError(f"memory is on {memory.device} but the model is on {device}")
    autocast = autocast_on(memory.device)
    if memory.dtype != dtype and not (autocast and memory.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        raise ValueError(f"memory must be {dtype}, the model's dtype (or float16/bfloat16/float32 under autocast), "
                         f"got {memory.dtype}")
    B, Ls = memory.shape[:2]
    if src_lengths.device != memory.device:
        raise ValueError(f"src_lengths is on {src_lengths.device} but memory is on {memory.device}")
    _check_lengths("src_lengths", src_lengths, B, Ls, of="memory")
    if src is not None and src.shape != memory.shape[:2]:
        raise ValueError(f"src {tuple(src.shape)} must be the source memory encodes, (B, Ls) = {(B, Ls)}")


def _check_lengths(name: str, lengths: torch.Tensor, B: int, L: int, *, of: str) -> None:
    """lengths (B,) int32/int64 in [0, L], one per row of the tensor `of` names."""
    if lengths.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},), one per row of {of}, got {tuple(lengths.shape)}")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32/int64, got {lengths.dtype}")
    if B and op_checks.value_checks(lengths):
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > L:
            shown = lengths.tolist() if B <= 8 else (lo, hi)
            raise ValueError(f"{name} must lie in [0, {L}] (the padded length), got {shown}")
