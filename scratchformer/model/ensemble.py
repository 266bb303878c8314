"""Several trained models of one task and vocabulary used as one (fairseq's EnsembleModel,
Marian's and OpenNMT's ensemble decoding).

Each prediction is the mean of the members' probabilities: an encoder-decoder's next-token
distribution at every step, a classifier's class distribution, an extractive summarizer's
probability that a sentence belongs in the summary. The mean is returned where the single models
return logits, as its log (log-probabilities: `log_softmax` leaves them as they are, so teacher
forcing's cross-entropy is the mixture's NLL and beam search ranks by it), or for the extractive
scorer as the logit of the mean probability. `Ensemble` decodes through `decoding.py` like one
`Transformer`: `encode` gives each member's memory, `init_state` each member's caches, and
`decode_step` runs every member's step and returns the log of their mean; a CUDA graph of the step
captures all of them at once. Members may differ in size and backend; they must read and write the
same token ids (the caller checks that their tokenizers are one: `evaluation.loading.load_models`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..reference import nll_loss_ref
from .config import PAD_ID
from .transformer import Classifier, Extractor, Transformer


def _kind(model: nn.Module) -> type:
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd classifier wraps its module
    for kind in (Transformer, Classifier, Extractor):
        if isinstance(model, kind):
            return kind
    raise TypeError(f"an ensemble takes Transformer, Classifier or Extractor models, got {type(model).__name__}")


def log_mean_prob(logits: list[torch.Tensor]) -> torch.Tensor:
    """log of the mean of softmax(logits_i) over the last dim, in fp32, without leaving log space."""
    logp = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in logits])
    return torch.logsumexp(logp, dim=0) - math.log(len(logits))


def logit_of_mean_prob(logits: list[torch.Tensor]) -> torch.Tensor:
    """logit of the mean of sigmoid(logits_i): log p - log(1 - p), each a log-mean-exp (whose log n
    cancels), so a mean near 0 or 1 stays finite where sigmoid would round to it."""
    x = torch.stack([y.float() for y in logits])
    return torch.logsumexp(F.logsigmoid(x), 0) - torch.logsumexp(F.logsigmoid(-x), 0)


class EnsembleState:
    """The members' decoding states, reordered and rewound together."""

    def __init__(self, states):
        self.states = states

    def reorder(self, index: torch.Tensor, *, same_sources: bool = False, filled: int | None = None) -> None:
        for state in self.states:
            state.reorder(index, same_sources=same_sources, filled=filled)

    def rewind(self) -> None:
        for state in self.states:
            state.rewind()


class Ensemble(nn.Module):
    """Models of one kind (all encoder-decoders, classifiers or extractive summarizers), vocabulary
    and set of classes whose predictions are averaged (module docstring). `cfg` is the first member's with
    the smallest `max_len` of them all. Inference only: call `.eval()` as for one model."""

    def __init__(self, models):
        super().__init__()
        models = list(models)
        if not models:
            raise ValueError("an ensemble needs at least one model")
        kinds = {_kind(m) for m in models}
        if len(kinds) > 1:
            raise ValueError(f"an ensemble's models must be of one kind, got {sorted(k.__name__ for k in kinds)}")
        self.kind = kinds.pop()
        first = models[0].cfg
        for i, m in enumerate(models[1:], 1):
            if m.cfg.num_classes != first.num_classes:
                raise ValueError(f"ensemble member {i} has {m.cfg.num_classes} classes, member 0 {first.num_classes}: "
                                 "the members must predict the same classes")
            for field in ("src_vocab_size", "tgt_vocab_size"):
                if getattr(m.cfg, field) != getattr(first, field):
                    raise ValueError(f"ensemble member {i} has {field} {getattr(m.cfg, field)}, member 0 "
                                     f"{getattr(first, field)}: the members must share one vocabulary")
        self.members = nn.ModuleList(models)
        self.cfg = dataclasses.replace(first, max_len=min(m.cfg.max_len for m in models))

    @property
    def static_caches(self) -> bool:
        """Decode on static caches when any member must (`compile.compile_decoding`)."""
        return any(getattr(m, "static_caches", False) for m in self.members)

    def _mean(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return logit_of_mean_prob(logits) if self.kind is Extractor else log_mean_prob(logits)

    def forward(self, *args, target=None, label_smoothing=0.0, **kwargs):
        """The members' forward on the same batch, averaged: an encoder-decoder's and a classifier's
        as log-probabilities, an extractive scorer's as logits. An encoder-decoder's with `target`
        (as `Transformer.forward`): the mixture's (loss sum, NLL sum)."""
        if kwargs.get("need_weights") or kwargs.get("return_attention"):
            raise ValueError("an ensemble has no attention weights of its own: ask one of its members")
        out = self._mean([m(*args, **kwargs) for m in self.members])
        if target is None:
            return out
        return nll_loss_ref(out.flatten(0, 1), target.flatten(), label_smoothing, PAD_ID)

    def encode(self, src, src_lengths):
        """Every member's memory, in member order."""
        return [m.encode(src, src_lengths) for m in self.members]

    def init_state(self, memory, src_lengths, max_len: int, src=None, *, static: bool = False,
                   beams: int = 1) -> EnsembleState:
        return EnsembleState([m.init_state(mem, src_lengths, max_len, src, static=static, beams=beams)
                              for m, mem in zip(self.members, memory, strict=True)])

    def decode_step(self, tokens, state: EnsembleState):
        """tokens (N, 1) -> log of the members' mean next-token probability (N, V), fp32."""
        return log_mean_prob([m.decode_step(tokens, s) for m, s in zip(self.members, state.states, strict=True)])
