"""Beam search over the KV-cached decoder of `decoding` (its step, checks and rules): the best
hypothesis per row (`beam_search`), or the n best with their scores (`beam_search_nbest`).

Hypotheses are ranked by sum(log p) / len ** length_penalty (len counting the EOS), in the log domain
(`_length_normalized`); finished ones are kept per sentence best first, as fairseq keeps them.
"""

from __future__ import annotations

import math

import torch

from .config import BOS_ID, EOS_ID, PAD_ID
from .decoding import _caps, _check, _check_int, _next_logits, _rule_out, _start, _trim, _weights_lent


def _keep_best(fin_seq, fin_score, cand_seq, cand_score, pad_id):
    """The best K of the finished hypotheses (B, K, T) and candidates (B, C, t <= T) by score."""
    B, K, T = fin_seq.shape
    padded = cand_seq.new_full((B, cand_seq.shape[1], T), pad_id)
    padded[:, :, : cand_seq.shape[2]] = cand_seq
    fin_score, pick = torch.cat([fin_score, cand_score], dim=1).topk(K, dim=1)
    fin_seq = torch.cat([fin_seq, padded], dim=1).gather(1, pick[..., None].expand(-1, -1, T))
    return fin_seq, fin_score


def _length_normalized(score: torch.Tensor, length: int, length_penalty: float) -> torch.Tensor:
    """The rank of hypotheses of `length` tokens whose summed log-probabilities are `score` (<= 0),
    by score / length ** length_penalty, as lp · ln(length) - ln(-score) in float64: the same order
    (0 ranks first, -inf last), which no length or penalty takes out of the float range. (The quotient
    in float32 did: length ** lp past 3.4e38 or below 1e-45, at 100 tokens lp > 19 or < -22, made
    every score -0.0 or -inf, and the search returned an arbitrary hypothesis.)"""
    return length_penalty * math.log(length) - torch.log(-score.double())


def _add_unfinished(fin_seq, fin_score, n_fin, alive_seq, alive_score, length_penalty, pad_id):
    """Sentences that ran out of steps (fewer than K finished): their unfinished beams compete too."""
    open_ = n_fin < fin_seq.shape[1]
    if not bool(open_.any()):
        return fin_seq, fin_score
    norm = _length_normalized(alive_score, alive_seq.shape[2], length_penalty)
    norm = norm.masked_fill(~open_[:, None], float("-inf"))
    return _keep_best(fin_seq, fin_score, alive_seq, norm, pad_id)


def _close(rows, fin_seq, fin_score, n_fin, alive_seq, alive_score, length_penalty, pad_id):
    """The sentences of `rows` (B,) bool closed: their unfinished beams compete (`_add_unfinished`),
    then they take no more hypotheses."""
    K = fin_seq.shape[1]
    fin_seq, fin_score = _add_unfinished(fin_seq, fin_score, n_fin.masked_fill(~rows, K), alive_seq, alive_score,
                                         length_penalty, pad_id)
    return fin_seq, fin_score, n_fin.masked_fill(rows, K)


@torch.no_grad()
@_weights_lent
def beam_search(model, src, src_lengths, *, beam_size: int = 4, max_len: int | torch.Tensor,
                length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_len: int = 0, bos_id: int = BOS_ID,
                eos_id: int = EOS_ID, pad_id: int = PAD_ID, check_every: int | None = None,
                cuda_graph: bool | None = None) -> torch.Tensor:
    """Beam search; returns the best hypothesis per row, (B, T).

    Hypotheses are ranked by sum(log p) / len**length_penalty (len counts the EOS; 0 = raw sum,
    1 = mean log-probability). As in fairseq, an EOS candidate is finished only when it ranks
    among the top beam_size candidates of its sentence, and a sentence stops once it holds
    beam_size finished hypotheses; with beam_size 1 this is exactly greedy decoding. At max_len
    (one int, or each sentence's own in a (B,) tensor), unfinished beams compete as they stand. Blocked
    repeats, and EOS before min_len, get -inf log-probability, unnormalised (as fairseq).
    """
    fin_seq, _ = _beam(model, src, src_lengths, beam_size=beam_size, max_len=max_len, length_penalty=length_penalty,
                       no_repeat_ngram=no_repeat_ngram, min_len=min_len, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                       check_every=check_every, cuda_graph=cuda_graph)
    return _trim(fin_seq[:, 0], pad_id)


@torch.no_grad()
@_weights_lent
def beam_search_nbest(model, src, src_lengths, *, nbest: int, beam_size: int = 4, max_len: int | torch.Tensor,
                      length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_len: int = 0, bos_id: int = BOS_ID,
                      eos_id: int = EOS_ID, pad_id: int = PAD_ID, check_every: int | None = None,
                      cuda_graph: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `nbest` (<= beam_size) best hypotheses of `beam_search`'s search, best first, and their scores:
    (B, nbest, T) tokens, (B, nbest) float64 sum(log p) / len**length_penalty, the search's rank (len
    counting the EOS; an ensemble's log p is that of its members' mean probability). Hypotheses [:, 0]
    are `beam_search`'s outputs; a row with fewer hypotheses than nbest (a vocabulary smaller than the
    beam) ends its list with entries of score -inf, whose tokens mean nothing."""
    _check_int("nbest", nbest, 1)
    _check_int("beam_size", beam_size, 1)  # before the comparison (`_check` checks it again with the rest)
    if nbest > beam_size:
        raise ValueError(f"nbest {nbest} exceeds beam_size {beam_size}: a search keeps beam_size hypotheses")
    fin_seq, rank = _beam(model, src, src_lengths, beam_size=beam_size, max_len=max_len,
                          length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len,
                          bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, check_every=check_every, cuda_graph=cuda_graph)
    B, _, T = fin_seq.shape
    tokens = _trim(fin_seq[:, :nbest].reshape(B * nbest, T), pad_id)
    # rank = lp * ln(len) - ln(-score) (`_length_normalized`), so score / len ** lp = -exp(-rank)
    return tokens.view(B, nbest, tokens.shape[1]), -torch.exp(-rank[:, :nbest])


def _beam(model, src, src_lengths, *, beam_size: int, max_len: int | torch.Tensor, length_penalty: float,
          no_repeat_ngram: int, min_len: int, bos_id: int, eos_id: int, pad_id: int, check_every: int | None,
          cuda_graph: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The search of `beam_search`: (B, K, T) hypotheses best first, (B, K) their ranks (`_length_normalized`)."""
    every = _check(model, src, src_lengths, max_len, no_repeat_ngram, beam_size, length_penalty, min_len, check_every,
                   cuda_graph, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    B, K, dev = src.shape[0], beam_size, src.device
    steps, caps, closing = _caps(max_len, dev)
    state, step = _start(model, src, src_lengths, steps, cuda_graph, beams=K)

    neg_inf = float("-inf")
    alive_seq = torch.empty(B, K, 0, dtype=torch.long, device=dev)
    alive_score = torch.full((B, K), neg_inf, device=dev)
    alive_score[:, 0] = 0.0  # all beams start identical: keep one so topk does not pick duplicates
    fin_seq = torch.full((B, K, steps), pad_id, dtype=torch.long, device=dev)
    fin_score = torch.full((B, K), neg_inf, dtype=torch.float64, device=dev)  # ranks (`_length_normalized`)
    n_fin = torch.zeros(B, dtype=torch.long, device=dev)
    last = torch.full((B * K, 1), bos_id, dtype=torch.long, device=dev)
    batch_base = torch.arange(B, device=dev)[:, None] * K

    for t in range(steps):
        logp = torch.log_softmax(_next_logits(step, last, bos_id, pad_id).float(), dim=-1)  # (B*K, V)
        _rule_out(logp, t, alive_seq.reshape(B * K, t), min_len, no_repeat_ngram, eos_id, pad_id)
        V = logp.shape[-1]
        cand = (alive_score[:, :, None] + logp.view(B, K, V)).view(B, K * V)
        top_score, top_idx = cand.topk(min(2 * K, K * V), dim=1)  # (B, 2K)
        beam, tok = top_idx // V, top_idx % V
        seq = torch.cat([alive_seq.gather(1, beam[..., None].expand(-1, -1, t)), tok[..., None]], dim=2)

        # Finish EOS candidates that rank in the top K, for sentences still searching.
        rank = torch.arange(top_idx.shape[1], device=dev)[None, :]
        is_eos = tok == eos_id
        finish = is_eos & (rank < K) & (n_fin < K)[:, None] & torch.isfinite(top_score)
        norm = _length_normalized(top_score, t + 1, length_penalty)
        fin_seq, fin_score = _keep_best(fin_seq, fin_score, seq, norm.masked_fill(~finish, neg_inf), pad_id)
        n_fin = n_fin + finish.sum(1)

        # Continue with the best K candidates that did not end in EOS.
        alive_score, pick = top_score.masked_fill(is_eos, neg_inf).topk(K, dim=1)
        alive_seq = seq.gather(1, pick[..., None].expand(-1, -1, t + 1))
        state.reorder((batch_base + beam.gather(1, pick)).view(-1), same_sources=True, filled=t + 1)
        last = tok.gather(1, pick).view(B * K, 1)  # alive_seq's last column, as a tensor of its own: a view's
        # strides change every step, which a compiled step would take as a new input (a recompile)
        if t + 1 in closing:  # sentences at their cap: closed with their unfinished beams, as at the end
            fin_seq, fin_score, n_fin = _close(caps == t + 1, fin_seq, fin_score, n_fin, alive_seq, alive_score,
                                               length_penalty, pad_id)
        if (t + 1) % every == 0 and bool((n_fin >= K).all()):
            break

    return _add_unfinished(fin_seq, fin_score, n_fin, alive_seq, alive_score, length_penalty, pad_id)
