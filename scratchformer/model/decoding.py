"""Batched incremental decoding: greedy, beam search (`beam.py`) and sampling (`sampling.py`), the
last two on this module's step, checks and rules, over a KV-cached decoder.

Greedy and beam search return (B, T) int64 tokens without the leading BOS (`beam_search_nbest`: a
search's n best hypotheses per row, (B, n, T), with their scores; `sample_decode` n samples per
row, the same way); a finished row holds its EOS and then
PAD. The encoder runs once; decoder self-attention keys/values are cached per layer and the
cross-attention keys/values are projected once (`Transformer.init_state`). `model` is a
`Transformer` or an `Ensemble` of them (`ensemble.py`: each step's distribution the mean of its
members'). Call `model.eval()` first: decoding does not switch modes for you.

`no_repeat_ngram` n > 0 forbids a token that would repeat an n-gram already in the output
(fairseq's --no-repeat-ngram-size, the trigram blocking of summarizers since Paulus et al. 2018).
`min_len` m > 0 forbids EOS for the first m tokens, so an output holds at least m tokens before
its EOS (fairseq's --min-len, Hugging Face's min_new_tokens; summarizers decode with one); with
m = max_len no row finishes (m > max_len is refused: no output could end; a row whose own cap, in
a (B,) max_len, is below m ends at its cap, as it would alone).

`eos_id=-1`: no token ends an output; every row runs to its cap (`min_len` then bars nothing). For
timing a fixed number of steps (bench/host_overhead.py) and for tests that need every step taken.
Any other id (`bos_id`, `eos_id`, `pad_id`) must lie in the model's target vocabulary.

`max_len` is one int for every row, or a (B,) tensor of each row's own cap (a translation's
ratio to its source length): a row's output is then the same alone as in any batch. Greedy ends
a row at its cap; beam search closes a sentence at its cap (its unfinished beams compete as they
stand, as every sentence's do at one shared max_len). When the rules leave a row no token at all
(n-gram blocking with EOS still barred by min_len, in a tiny vocabulary), EOS is let through.

Asking whether every row is done reads a flag back to the host: on a GPU that waits for the step
to finish, so the host cannot queue the next step's kernels meanwhile. `check_every` c asks only
every c steps (default: every step on the CPU, where the read is free, every 8 on a GPU). The
result is the same for any c: a finished row only adds PAD, a finished sentence's beams can no
longer enter its hypotheses, and trailing all-PAD columns are trimmed; the price is at most c-1
wasted steps at the end.

CUDA graphs. On a GPU each decoding step is replayed from a CUDA graph: the decoder's caches are
fixed-size (`StaticKVCache`, the step's position on the device) and the step is captured once per
call, after one warm-up step; every later step is one copy of its tokens and one graph launch
instead of a launch per kernel (a `base` decoder step is about 80 of them), the host's time that
paced decoding. The search around it (argmax or top-k, n-gram blocking, beam bookkeeping) stays
as it is. Outputs equal those of launched steps up to the rounding of the position term (added on
the device, not by the embedding kernel). `cuda_graph`: None (default) = on for CUDA tensors
unless SCRATCHFORMER_CUDA_GRAPHS=0 or SCRATCHFORMER_DEBUG=1 (whose value checks read the device),
a capture that fails then warns once and the steps are launched; True insists (and raises); False
launches every step (vLLM's --enforce-eager). A model whose `static_caches` is set
(`compile.compile_decoding` sets it) decodes on the same static caches without graphs: every step
has the same shapes, so a compiled step is one graph.

Under autocast, the model's matmul weights are cast to its dtype once a call and lent to the model
for it (`WeightCast.for_decoding`), where every step cast them again: our ops each launch, and
inside a CUDA graph, which holds no cast cache, every matmul. The same logits bit for bit (the
casts' values); the price is the lent copies, half the fp32 weights' bytes, while the call runs.
Not for a compiled model (`static_caches`), whose steps keep autocast's casts.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .. import graphs, op_checks
from .config import BOS_ID, EOS_ID, PAD_ID
from .weight_cast import WeightCast

GPU_CHECK_EVERY = 8  # steps between stop checks on a GPU (each is a host sync)
_CAPTURE_WARNED = False


def _weights_lent(decode):
    """decode(model, src, ...) with the model's matmul weights lent in autocast's dtype for the whole
    call, one cast of them all (`WeightCast.for_decoding`; module docstring)."""
    @functools.wraps(decode)
    def call(model, src, *args, **kwargs):
        device = src.device if isinstance(src, torch.Tensor) else torch.device("cpu")  # not a tensor: _check says so
        _check_decoder(model)  # before the lending reads the model
        with WeightCast.for_decoding(model, device)():
            return decode(model, src, *args, **kwargs)

    return call


def _check_decoder(model) -> None:
    """A model decoding can run: one with a decoder (a Classifier or Extractor has no decode_step)."""
    if getattr(getattr(model, "cfg", None), "n_decoder_layers", 0) == 0:
        raise ValueError(f"decoding needs an encoder-decoder model (a Transformer, or an ensemble of them); "
                         f"{type(model).__name__} has no decoder")


def _use_graphs(cuda_graph: bool | None, device: torch.device, compiled: bool = False) -> bool:
    """Whether the step is replayed from a CUDA graph: as `cuda_graph` says, or by default on CUDA
    unless the step is compiled (`static_caches`: torch.compile's to run; its mode reduce-overhead
    records graphs of its own, which a capture around them would nest)."""
    if cuda_graph is not None:
        return cuda_graph
    return (device.type == "cuda" and not compiled and os.environ.get("SCRATCHFORMER_CUDA_GRAPHS", "1") != "0"
            and not op_checks.DEBUG)


def _start(model, src, src_lengths, max_len, cuda_graph: bool | None, beams: int = 1):
    """Encodes src (B, Ls); the decoding state of B * beams rows (each source `beams` times, beam
    search's hypotheses) and its step, tokens (B * beams, 1) -> next-token logits (B * beams, V)."""
    replayed = _use_graphs(cuda_graph, src.device, model.static_caches)
    memory = model.encode(src, src_lengths)
    state = model.init_state(memory, src_lengths, max_len, src=src, static=replayed or model.static_caches,
                             beams=beams)
    launched = lambda last: model.decode_step(last, state)  # noqa: E731
    if not replayed:
        return state, launched
    try:
        return state, _graph_step(model, state, src.shape[0] * beams, src.device)
    except RuntimeError as e:
        if cuda_graph:
            raise
        global _CAPTURE_WARNED
        if not _CAPTURE_WARNED:
            warnings.warn(f"decoding: capturing the step as a CUDA graph failed ({e}); launching each step "
                          "(SCRATCHFORMER_CUDA_GRAPHS=0 skips the attempt)", RuntimeWarning, stacklevel=3)
            _CAPTURE_WARNED = True
        state.rewind()
        return state, launched


def _graph_step(model, state, rows: int, device):
    """`model.decode_step` over static caches as a CUDA graph's replay: tokens (rows, 1) are copied
    into the graph's input; the step returns the graph's logits buffer, which the next step
    rewrites. The state is rewound after the warm-up; what it wrote at position 0 is rewritten
    by the first real step before anything reads it."""
    tokens = torch.full((rows, 1), BOS_ID, dtype=torch.long, device=device)
    logits, replay = graphs.capture(lambda: model.decode_step(tokens, state))
    state.rewind()

    def step(last):
        tokens.copy_(last)
        replay()
        return logits

    return step


def _caps(max_len, device) -> tuple[int, torch.Tensor | None, set[int]]:
    """(the steps to run, each row's cap on `device` or None when every row shares max_len, the caps
    that end a row before the last step: read once, not at every step)."""
    if not isinstance(max_len, torch.Tensor):
        return max_len, None, set()
    caps = max_len.to(device=device, dtype=torch.long)
    steps = int(caps.max()) if caps.numel() else 1
    return steps, caps, set(caps.tolist()) - {steps}


def _rule_out(scores, t: int, seq, min_len: int, no_repeat_ngram: int, eos_id: int, pad_id: int):
    """In place, step t's scores (N, V): EOS barred before min_len, the tokens that would repeat an
    n-gram of seq (N, t) blocked (seq None: nothing decoded yet); a row then left no token may end
    (EOS gets 0)."""
    bar_eos = t < min_len and eos_id >= 0  # eos_id -1: no EOS to bar (index -1 is the last token)
    if bar_eos:
        scores[:, eos_id] = float("-inf")
    if no_repeat_ngram and seq is not None:
        _block_repeats(scores, seq, no_repeat_ngram, pad_id)
        if bar_eos:
            scores[:, eos_id].masked_fill_(torch.isneginf(scores).all(-1), 0.0)


def _next_logits(step, last, bos_id, pad_id):
    """Next-token logits with PAD and BOS ruled out: neither may be generated."""
    logits = step(last)
    logits[:, [pad_id, bos_id]] = float("-inf")
    return logits


def _block_repeats(scores, seq, n: int, pad_id: int):
    """Set to -inf, in place, the scores (N, V) of the tokens that would complete an n-gram already
    in seq (N, t), the tokens so far of each row: wherever the last n-1 tokens occurred before, the
    token that followed them there. Tokens that follow no match map to PAD, which is -inf already."""
    t = seq.shape[1]
    if n < 1 or t < n:
        return scores
    prefixes = seq[:, : t - 1].unfold(1, n - 1, 1) if n > 1 else seq.new_empty(seq.shape[0], t, 0)  # (N, t-n+1, n-1)
    match = (prefixes == seq[:, None, t - n + 1:]).all(-1)
    return scores.scatter_(1, torch.where(match, seq[:, n - 1:], pad_id), float("-inf"))


# A hypothesis's score is divided by len ** length_penalty (ranked in the log domain: `_length_normalized`). The
# values in use are 0 to 2: this bound refuses values so far past them that the length outweighs any difference of
# log-probabilities (a typo, such as 400 for 0.4).
MAX_LENGTH_PENALTY = 50


def _check(model, src, src_lengths, max_len, no_repeat_ngram: int = 0, beam_size: int = 1,
           length_penalty: float = 1.0, min_len: int = 0, check_every: int | None = None,
           cuda_graph: bool | None = None, *, bos_id: int, eos_id: int, pad_id: int) -> int:
    """Checks the decoding arguments; returns the stop-check interval (see the module docstring)."""
    if src_lengths is None:
        raise ValueError("src_lengths is required (B,) int")
    for name, t in (("src", src), ("src_lengths", src_lengths)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if cuda_graph and src.device.type != "cuda":
        raise ValueError(f"cuda_graph=True replays the decoding step from a CUDA graph: it needs CUDA tensors, "
                         f"src is on {src.device}")
    _check_int("min_len", min_len, 0, " (0: off)")
    _check_max_len(max_len, src.shape[0])
    if not isinstance(max_len, torch.Tensor) and min_len > max_len:  # each row's own cap may be below: it ends there
        raise ValueError(f"min_len {min_len} exceeds max_len {max_len}, the longest output: no output could end")
    _check_int("no_repeat_ngram", no_repeat_ngram, 0, " (0: off)")
    _check_int("beam_size", beam_size, 1)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not abs(length_penalty) <= MAX_LENGTH_PENALTY:  # NaN ranks nothing; inf makes every score 0 or NaN
        raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got "
                         f"{length_penalty!r}")
    V = model.cfg.tgt_vocab_size
    for name, token in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
        never_ends = name == "eos_id" and token == -1  # module docstring
        if isinstance(token, bool) or not isinstance(token, int) or not (0 <= token < V or never_ends):
            never = " or -1 (no token ends an output)" if name == "eos_id" else ""
            raise ValueError(f"{name} must be a token id of the model's target vocabulary, an int in [0, {V}){never}, "
                             f"got {token!r}")
    for name, token in (("bos_id", bos_id), ("pad_id", pad_id)):  # neither is ever generated (`_next_logits`)
        if token == eos_id:
            raise ValueError(f"eos_id {eos_id} is also the {name}, a token never generated: no output could end")
    if check_every is None:
        return 1 if src.device.type == "cpu" else GPU_CHECK_EVERY
    _check_int("check_every", check_every, 1, " (steps between stop checks)")
    return check_every


def _check_int(name: str, value, least: int, note: str = "") -> None:
    """An int argument >= least (a bool, a float such as 2.5, refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}{note}, got {value!r}")


def _check_max_len(max_len, B: int) -> None:
    """max_len, an int >= 1 or a (B,) tensor of them."""
    if not isinstance(max_len, torch.Tensor):
        return _check_int("max_len", max_len, 1, " or a (B,) tensor of them")
    if max_len.shape != (B,) or max_len.is_floating_point() or max_len.is_complex() or max_len.dtype == torch.bool:
        raise ValueError(f"max_len as a tensor holds each row's cap: (B,) = ({B},) integers, got "
                         f"{tuple(max_len.shape)} {max_len.dtype}")
    if max_len.numel() and int(max_len.min()) < 1:
        raise ValueError(f"max_len must be >= 1 in every row, got {max_len.tolist()}")


@torch.no_grad()
@_weights_lent
def greedy_decode(model, src, src_lengths, *, max_len: int | torch.Tensor, no_repeat_ngram: int = 0, min_len: int = 0,
                  bos_id: int = BOS_ID, eos_id: int = EOS_ID, pad_id: int = PAD_ID,
                  check_every: int | None = None, cuda_graph: bool | None = None) -> torch.Tensor:
    """Argmax decoding of up to max_len tokens per row (an int, or each row's own in a (B,) tensor).
    src (B, Ls), src_lengths (B,) -> (B, T)."""
    every = _check(model, src, src_lengths, max_len, no_repeat_ngram, min_len=min_len, check_every=check_every,
                   cuda_graph=cuda_graph, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    tokens, _ = _token_by_token(model, src, src_lengths, max_len, lambda scores, t: scores.argmax(-1),
                                no_repeat_ngram=no_repeat_ngram, min_len=min_len, bos_id=bos_id, eos_id=eos_id,
                                pad_id=pad_id, every=every, cuda_graph=cuda_graph)
    return _trim(tokens, pad_id)


def _token_by_token(model, src, src_lengths, max_len, pick, *, n: int = 1, log_probs: bool = False,
                    no_repeat_ngram: int, min_len: int, bos_id: int, eos_id: int, pad_id: int, every: int,
                    cuda_graph: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token a step for each of B * n rows (n side by side per source, sharing its encoder side), the
    next one `pick(scores (B * n, V), t) -> (B * n,)` of the step's scores after the rules: the logits,
    or with `log_probs` their log-softmax. Returns the (B * n, T) tokens, untrimmed, and with `log_probs`
    each row's summed log-probabilities of its tokens (float64; else None)."""
    rows = src.shape[0] * n
    steps, caps, _ = _caps(max_len, src.device)
    if caps is not None:
        caps = caps.repeat_interleave(n)
    _, step = _start(model, src, src_lengths, steps, cuda_graph, beams=n)
    last = torch.full((rows, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(rows, dtype=torch.bool, device=src.device)
    total = torch.zeros(rows, dtype=torch.float64, device=src.device) if log_probs else None
    out = []
    for t in range(steps):
        scores = _next_logits(step, last, bos_id, pad_id)
        if log_probs:
            scores = torch.log_softmax(scores.float(), dim=-1)
        _rule_out(scores, t, torch.stack(out, dim=1) if no_repeat_ngram and out else None, min_len, no_repeat_ngram,
                  eos_id, pad_id)
        nxt = pick(scores, t)
        if log_probs:
            total += scores.gather(1, nxt[:, None])[:, 0].double().masked_fill(finished, 0.0)
        nxt = nxt.masked_fill(finished, pad_id)  # (rows,)
        out.append(nxt)
        finished |= nxt == eos_id
        if caps is not None:
            finished |= caps <= t + 1
        if (t + 1) % every == 0 and bool(finished.all()):
            break
        last = nxt[:, None]
    return torch.stack(out, dim=1), total


def _trim(tokens, pad_id):
    """(B, T) -> (B, T') without the columns that are PAD in every row (at least one column)."""
    used = int((tokens != pad_id).any(0).nonzero().max()) + 1 if bool((tokens != pad_id).any()) else 1
    return tokens[:, :used]
