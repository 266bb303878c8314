"""R-Drop (`--rdrop ALPHA`, Liang et al. 2021): each batch runs twice, each copy under its own
dropout, and the loss adds the two outputs' symmetric KL. Checked here: the loss against the
paper's formula written out independently, each backend's dropout drawing other masks for the
second copy (else the KL would be 0 and R-Drop a no-op), the options it refuses, and a run."""

import json

import pytest
import torch
import torch.nn.functional as F

from scratchformer import train
from scratchformer.checkpoint import load_checkpoint
from scratchformer.data.batching import Batch
from scratchformer.evaluation.evaluate import loss_terms
from scratchformer.model import PAD_ID, ModelConfig, build_model
from scratchformer.training.config import ConfigError, TrainConfig
from scratchformer.training.launch import check_for_task
from scratchformer.training.optim import label_smoothed_loss, rdrop_loss
from tests.conftest import BACKENDS, DEVICE, TINY


def _reference(logits, target, alpha, ignore):
    """The paper's eq. 3 in float64, halved: (CE1 + CE2 + alpha * (KL(P1||P2) + KL(P2||P1)) / 2) / 2,
    summed over the targets of one copy that are not `ignore` (None: all)."""
    x = logits.double()
    a, b = x.chunk(2)
    t = target.chunk(2)[0]
    keep = torch.ones_like(t, dtype=torch.bool) if ignore is None else t != ignore
    ce = [F.cross_entropy(z, t, reduction="none")[keep].sum() for z in (a, b)]
    la, lb = F.log_softmax(a, -1), F.log_softmax(b, -1)
    kl_ab = F.kl_div(lb, la, log_target=True, reduction="none").sum(-1)  # KL(P1 || P2)
    kl_ba = F.kl_div(la, lb, log_target=True, reduction="none").sum(-1)
    return (ce[0] + ce[1] + alpha * (kl_ab + kl_ba)[keep].sum() / 2) / 2, (ce[0] + ce[1]) / 2


@pytest.mark.parametrize("task", ["translation", "classification"])
def test_rdrop_loss_is_the_papers_objective_halved(task):
    n, v = 12, 9
    logits = torch.randn(2 * n, v) * 3
    target = torch.randint(1, v, (n,))
    if task == "translation":
        target[[2, 7]] = PAD_ID  # padding: left out of both terms
    else:
        target[[2, 7]] = 0  # a class label 0 (== PAD_ID) counts
    target = torch.cat([target, target])
    for alpha in (0.0, 5.0):
        loss, nll = rdrop_loss(task, logits, target, 0.0, alpha)
        ref_loss, ref_nll = _reference(logits, target, alpha, PAD_ID if task == "translation" else None)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-5, atol=1e-5)
    # two equal copies: no KL, and the loss of one copy (label smoothing included)
    same = torch.cat([logits[:n], logits[:n]])
    loss, nll = rdrop_loss("translation", same, target, 0.1, 5.0)
    one, one_nll = label_smoothed_loss(logits[:n], target[:n], 0.1)
    torch.testing.assert_close(loss, one)
    torch.testing.assert_close(nll, one_nll)


def _batch(b=3, ls=7, lt=5, vocab=40):
    src = torch.randint(4, vocab, (b, ls))
    tgt = torch.randint(4, vocab, (b, lt + 1))
    src_len, tgt_len = torch.tensor([7, 5, 3]), torch.tensor([5, 4, 2])
    src[torch.arange(ls)[None] >= src_len[:, None]] = PAD_ID
    tgt[:, 1:][torch.arange(lt)[None] >= tgt_len[:, None]] = PAD_ID
    return Batch(ids=torch.arange(b), src=src, src_lengths=src_len, tgt_in=tgt[:, :-1], tgt_out=tgt[:, 1:],
                 tgt_lengths=tgt_len)


def test_twice_stacks_the_batch_on_itself():
    b = _batch()
    d = b.twice()
    assert d.shape == (6, 7, 5) and d.num_tgt_tokens == 2 * b.num_tgt_tokens
    for k in ("ids", "src", "src_lengths", "tgt_in", "tgt_out", "tgt_lengths"):
        torch.testing.assert_close(getattr(d, k), torch.cat([getattr(b, k)] * 2))


@pytest.mark.parametrize("kernel", BACKENDS)
@pytest.mark.parametrize("which", ["dropout", "attn_dropout", "ffn_dropout"])
def test_each_copy_draws_its_own_dropout(kernel, which):
    """With one kind of dropout on (sublayer outputs: the fused add+LayerNorm's; attention
    probabilities: the attention kernel's; between the FFN's projections), the two copies' outputs
    differ in training and are equal in evaluation: every backend's masks depend on the example's
    place in the batch, not only on its position in the sequence."""
    drops = {"dropout": 0.0, "attn_dropout": 0.0, "ffn_dropout": 0.0, which: 0.3}
    cfg = ModelConfig(src_vocab_size=40, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=64,
                      kernel=kernel, **drops)
    model = build_model(cfg, DEVICE)
    batch = _batch().twice().to(DEVICE)
    with torch.no_grad():
        logits, target = loss_terms(model.train(), batch)
        a, b = logits.chunk(2)
        keep = target.chunk(2)[0] != PAD_ID
        assert (a[keep] - b[keep]).abs().amax(-1).min() > 0, f"{kernel} {which}: a copy drew the other's mask"
        a, b = loss_terms(model.eval(), batch)[0].chunk(2)
        torch.testing.assert_close(a, b)


def test_options_rdrop_refuses():
    with pytest.raises(ConfigError, match="--rdrop 5 compares two dropout masks; with --dropout 0"):
        TrainConfig(rdrop=5.0, dropout=0.0)
    TrainConfig(rdrop=5.0, dropout=0.0, attn_dropout=0.1)  # attention dropout alone is dropout enough
    with pytest.raises(ConfigError, match=r"--rdrop must be a finite number in \[0, inf\), got -1"):
        TrainConfig(rdrop=-1.0)
    with pytest.raises(ConfigError, match="--rdrop 5: R-Drop here compares token or class distributions; an "
                                          "extractive summarizer scores sentences"):
        check_for_task(TrainConfig(rdrop=5.0), "extractive")
    check_for_task(TrainConfig(rdrop=5.0), "classification")


def test_a_run_with_rdrop_learns_and_counts_each_token_once(tmp_path):
    """30 steps of the synthetic task with R-Drop: the training NLL falls, and the tokens the run
    counts are its batches' (the second copy is compute, not data), as in the same run without."""
    tokens, rows = {}, []
    for name, extra in (("rdrop", ["--rdrop", "2"]), ("plain", [])):
        out = tmp_path / name
        train.main([*TINY, "--max-steps", "30", "--eval-every", "30", "--log-every", "10", "--dropout", "0.1",
                    "--warmup-steps", "5", "--no-plots", "--out", str(out), *extra])
        tokens[name] = load_checkpoint(out / "last.pt")["progress"]["tokens"]
        rows.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    ours = [r for r in rows[0] if r.get("split") == "train"]
    assert len(ours) == 4 and ours[-1]["nll"] < ours[0]["nll"] - 0.5
    assert tokens["rdrop"] == tokens["plain"] > 0
