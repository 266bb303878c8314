"""Sampling decoding over the KV-cached decoder of `decoding` (its step, checks and rules): each token
drawn from the model's distribution, reshaped by a temperature and cut to its top-k tokens and its
nucleus (top-p), as Hugging Face's `generate(do_sample=True)` and fairseq's `--sampling` draw. For
diverse outputs, back-translation (Edunov et al. 2018) and candidates to rerank.

A row's draws depend only on the seed, its key (an input's id: `row_key`) and its sample number,
never on the rest of its batch: each step draws its token by inverting the row's cumulative
distribution at one uniform U (the first token whose cumulative probability passes U times the
row's mass, as FlashInfer's sampling kernels draw), and U comes from a counter-based hash of
(seed, key, sample, step), computed on the device in int64 arithmetic. So an input decodes the
same alone or in any batch, with any batch budget, after a resumed batch inference, on the CPU or
a GPU (up to the rounding of the logits): vLLM's per-request seeds give the same guarantee, with a
generator per request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .config import BOS_ID, EOS_ID, PAD_ID
from .decoding import _check, _check_int, _token_by_token, _trim, _weights_lent

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """`sample_decode`'s options, as the prediction path carries them (`evaluation.decode_batch`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def row_key(rid: str | int) -> int:
    """A row's key from an input's id (an int or a str, compared as text, as batch inference compares
    ids): 63 bits of its BLAKE2b digest, the same in every process (Python's hash() of a str is not)."""
    return int.from_bytes(hashlib.blake2b(str(rid).encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little") >> 1


def _mul32(x, c: int):
    """x * c mod 2**32 for x in [0, 2**32) (an int64 tensor, or an int): the product in two 16-bit halves of c,
    no int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix(x):
    """A bijection of [0, 2**32) whose every output bit depends on every input bit (C. Wellons's lowbias32);
    of an int64 tensor elementwise, or of an int."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _fold(h, x):
    """The hash h (in [0, 2**32)) with x (>= 0, < 2**63) folded in, its low then its high 32 bits; each an int64
    tensor or an int (a step's number, the seed: no copy to the device, which would wait for it)."""
    return _mix(h ^ _mix(_mix(x & _M32) ^ (x >> 32)))


def _uniforms(row_hash: torch.Tensor, t: int) -> torch.Tensor:
    """(R,) uniforms in (0, 1), float64, for step t: 52 bits, 32 of a hash of (row, t) and 20 of a second,
    centred in their cell, each step exact in float64 (the largest is 1 - 2**-53). The hashes are
    int64: cast to float64 first, as an int64 tensor times a float is of torch's default dtype, float32,
    which rounds the top 128 of 2**32 values up to 1."""
    h = _fold(row_hash, t)
    return (h.double() * 2.0 ** 20 + (_fold(h, 1) >> 12).double() + 0.5) * 2.0 ** -52


def _draw(x: torch.Tensor, u: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Each row's token (R,) drawn from softmax(x) (x (R, V), float64 log-probabilities, -inf for the tokens
    ruled out) cut to the top_k most probable tokens (0: all), then to the nucleus of the rest (the fewest
    most probable whose renormalized probabilities reach top_p): the first candidate whose cumulative
    probability passes u (R,) times the candidates' mass. A token of probability 0 spans no interval, and
    is never drawn: where u times the mass rounds up to the mass, the last candidate of probability > 0."""
    idx = None
    if top_k and top_k < x.shape[1]:
        x, idx = x.topk(top_k, dim=-1)  # best first
    elif top_p < 1:
        x, idx = x.sort(dim=-1, descending=True)
    p = torch.softmax(x, dim=-1)
    if top_p < 1:  # candidates best first: the nucleus is a prefix, cut where the mass before reaches top_p
        p = p.masked_fill((p.cumsum(-1) - p) >= top_p, 0.0)
    cdf = p.cumsum(-1)
    j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    last = x.shape[1] - 1 - (p > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)  # of the last p > 0
    j = torch.minimum(j, last)
    return (j if idx is None else idx.gather(1, j))[:, 0]


def _check_sampling(temperature, top_k, top_p, seed, keys, n, B: int) -> None:
    for name, v, ok in (("temperature", temperature, "a number > 0"), ("top_p", top_p, "a number in (0, 1]")):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                0 < v < float("inf") if name == "temperature" else 0 < v <= 1):
            raise ValueError(f"{name} must be {ok}, got {v!r}")
    _check_int("top_k", top_k, 0, " (0: off)")
    _check_int("seed", seed, 0)
    if seed >= 2 ** 63:
        raise ValueError(f"seed must be < 2**63, got {seed}")
    _check_int("n", n, 1, " (samples per row)")
    if keys is not None and (not isinstance(keys, torch.Tensor) or keys.shape != (B,) or keys.dtype != torch.long
                             or (keys.numel() and int(keys.min()) < 0)):
        shown = f"{tuple(keys.shape)} {keys.dtype}" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"keys must be a (B,) = ({B},) int64 tensor of keys >= 0 (`row_key`), got {shown}")


@torch.no_grad()
@_weights_lent
def sample_decode(model, src, src_lengths, *, max_len: int | torch.Tensor, n: int = 1, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0, keys: torch.Tensor | None = None,
                  no_repeat_ngram: int = 0, min_len: int = 0, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                  pad_id: int = PAD_ID, check_every: int | None = None,
                  cuda_graph: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples per row of up to max_len tokens (an int, or each row's own in a (B,) tensor), each token
    drawn from softmax(log p / temperature) cut to the top_k most probable tokens (0: all) and then to
    the nucleus of mass top_p (1: all), after the rules (`decoding`: no_repeat_ngram, min_len).
    `keys` (B,) int64 >= 0: each row's key (default 0, 1, ...; `row_key` makes one of an input's id);
    a row's samples depend on the seed, its key and the sample's number alone (module docstring).

    src (B, Ls), src_lengths (B,) -> (B, n, T) tokens and (B, n) float64 scores: the model's own
    sum(log p) over each sample's tokens / their number (its EOS counted), as `beam_search_nbest`
    scores with length_penalty 1, so that samples and beams rank on one scale. top_k 1, or a
    temperature near 0, is greedy decoding."""
    every = _check(model, src, src_lengths, max_len, no_repeat_ngram, min_len=min_len, check_every=check_every,
                   cuda_graph=cuda_graph, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    B, dev = src.shape[0], src.device
    _check_sampling(temperature, top_k, top_p, seed, keys, n, B)
    keys = torch.arange(B, device=dev) if keys is None else keys.to(dev)
    row_hash = _fold(_fold(_fold(_mix(seed & _M32), seed >> 32), keys.repeat_interleave(n)),
                     torch.arange(n, device=dev).repeat(B))

    def draw(scores: torch.Tensor, t: int) -> torch.Tensor:  # scores: log-probabilities, no overflow at any T
        return _draw(scores.double() / temperature, _uniforms(row_hash, t), top_k, top_p)

    tokens, total = _token_by_token(model, src, src_lengths, max_len, draw, n=n, log_probs=True,
                                    no_repeat_ngram=no_repeat_ngram, min_len=min_len, bos_id=bos_id, eos_id=eos_id,
                                    pad_id=pad_id, every=every, cuda_graph=cuda_graph)
    tokens = _trim(tokens, pad_id)
    lengths = (tokens != pad_id).sum(1).clamp(min=1)
    return tokens.view(B, n, tokens.shape[1]), (total / lengths).view(B, n)
