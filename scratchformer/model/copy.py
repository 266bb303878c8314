"""The pointer-generator output layer (See, Liu and Manning, "Get To The Point", ACL 2017), the
`--copy` option of a sequence-to-sequence model with one vocabulary for source and target.

At each target position the decoder output h attends once more over the encoder output (one head,
keys projected once per source): a (B, Lt, Ls). A gate p_gen = sigmoid(w · [h; context] + b) mixes
the vocabulary distribution with the copy distribution, the attention scattered onto the source's
token ids:

    p(w) = p_gen · softmax(logits)(w) + (1 - p_gen) · sum_{j : src_j = w} a_j

The layer returns log p (B, Lt, V) in fp32, a normalised distribution: every consumer of logits
(log_softmax in the loss and in decoding, argmax, cross-entropy) gives the same answer on it.

Why a summarizer wants it: trained from scratch on long sources without it, the decoder learns a
language model long before cross-attention becomes selective, and the encoder output collapses to
one vector for every position (`scripts/source_use.py`; results/cnndm-cpu-small-copy). The copy
distribution rewards, from the first step, attention on the positions holding the next token,
which needs position-specific encoder outputs. The attention here is a plain masked softmax in
PyTorch in every backend (its probabilities are the output, which a flash kernel does not keep).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class CopySource(NamedTuple):
    """A batch of sources as the copy layer reads them besides their encoder output
    (`PointerGenerator.source`), each tensor B rows first: built once a decoding call
    (`Transformer.init_state`), where every step rebuilt them."""

    keys: torch.Tensor  # (B, Ls, d) its copy-attention keys
    src: torch.Tensor  # (B, Ls) token ids
    valid: torch.Tensor  # (B, Ls) bool: a position within the source's length
    same: torch.Tensor  # (B, Ls, Ls) fp32, [k, j] = 1 where k is valid and src_k == src_j
    first: torch.Tensor  # (B, Ls) bool: the first valid position of its id

    def index_select(self, dim: int, index: torch.Tensor) -> CopySource:
        """Tensor.index_select of each (dim 0: batch rows, as a decoding state moves its tensors)."""
        return CopySource(*(t.index_select(dim, index) for t in self))


class PointerGenerator(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.gate = nn.Linear(2 * d_model, 1)
        self.scale = 1.0 / math.sqrt(d_model)

    def source(self, memory: torch.Tensor, src: torch.Tensor, src_lengths: torch.Tensor | None) -> CopySource:
        """memory (B, Ls, d), src (B, Ls) ids, src_lengths (B,) (None: no padding, as the model takes
        it) -> what every target position reads of them: the copy-attention keys, which positions are
        valid, which hold the same id, and which is its first (where the copy probability of an id is
        written)."""
        Ls = src.shape[1]
        positions = torch.arange(Ls, device=src.device)[None, :].expand(src.shape[0], Ls)
        valid = positions < (Ls if src_lengths is None else src_lengths[:, None])  # (B, Ls)
        same = (src[:, :, None] == src[:, None, :]) & valid[:, None, :]  # (B, Ls, Ls): [j, k] valid k, same id
        first = valid & ~(same & torch.ones(Ls, Ls, dtype=torch.bool, device=src.device).tril(-1)).any(-1)
        return CopySource(self.k_proj(memory), src, valid, same.transpose(1, 2).float(), first)

    def forward(self, h: torch.Tensor, logits: torch.Tensor, memory: torch.Tensor, source: CopySource) -> torch.Tensor:
        """h (B, Lt, d) decoder output, logits (B, Lt, V) of the vocabulary, memory (B, Ls, d) and
        `source` of B rows -> log p (B, Lt, V) fp32.

        A row with an empty source has nothing to copy: its distribution is the vocabulary's alone.
        The copy part is summed per distinct source token on (B, Lt, Ls) and written into the
        vocabulary's log-probabilities at each token's first source position; only the vocabulary
        part is ever dense (B, Lt, V): one extra column takes the writes of the other positions.

        Under autocast the layer runs with it off, in fp32: fp16 autocast ran its matmuls in fp16
        whatever their inputs' dtype, where the floor on the copy probabilities (fp32's smallest
        normal) is 0, so log 0 at a padded source position made every gradient NaN.
        """
        if h.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(h.device.type):
            with torch.autocast(h.device.type, enabled=False):
                return self._mix(h.float(), logits, memory, source)
        return self._mix(h, logits, memory, source)

    def _mix(self, h, logits, memory, source: CopySource):
        B, Lt, V = logits.shape
        keys, src, valid, same, first = source
        scores = torch.matmul(self.q_proj(h).float(), keys.float().transpose(1, 2)) * self.scale  # (B, Lt, Ls)
        attn = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
        context = torch.matmul(attn, memory.float())  # (B, Lt, d)
        z = self.gate(torch.cat([h.float(), context], dim=-1).to(self.gate.weight.dtype)).float()  # (B, Lt, 1)
        z = z.masked_fill(~valid.any(-1)[:, None, None], float("inf"))  # an empty source, nothing to copy: p_gen = 1

        copy = torch.matmul(attn, same)  # (B, Lt, Ls): copy probability of src_j's id
        where = torch.where(first, src, V)[:, None, :].expand(B, Lt, -1)  # the rest write to column V

        extra = logits.new_full((B, Lt, 1), float("-inf"))
        log_gen = F.logsigmoid(z) + torch.log_softmax(torch.cat([logits, extra], dim=-1).float(), dim=-1)
        # copy > 0 at first positions; clamped so that an underflow gives a finite gradient
        mixed = torch.logaddexp(log_gen.gather(2, src[:, None, :].expand(B, Lt, -1)),
                                F.logsigmoid(-z) + copy.clamp_min(torch.finfo(torch.float32).tiny).log())
        return log_gen.scatter(2, where, mixed)[..., :V]
