"""Training pieces: label-smoothed loss, schedules, exact resume, accumulation, classifier step."""

import io
import json
import math
import shutil
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from scratchformer import data as D
from scratchformer import train as T
from scratchformer.checkpoint import load_checkpoint
from scratchformer.data import batching
from scratchformer.evaluation import metrics as M
from scratchformer.evaluation.evaluate import eval_loader, teacher_forced
from scratchformer.model import Classifier, get_config
from scratchformer.training import optim as O
from scratchformer.training import runs
from scratchformer.training.config import METRICS, ConfigError

# A few seconds per run: tiny model, 64 training examples, 4 batches per epoch.
TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--vocab-size", "300",
        "--batch-size", "16", "--max-train-examples", "64", "--max-valid-examples", "16", "--eval-decode-examples", "8",
        "--beam-size", "2", "--log-every", "1", "--no-progress", "--no-plots", "--warmup-steps", "4"]


def test_label_smoothed_loss_matches_hand_computation():
    torch.manual_seed(0)
    V, eps, pad = 7, 0.2, 0
    logits = torch.randn(5, V)
    target = torch.tensor([3, 0, 6, 1, 4])  # position 1 is padding
    loss, nll = O.label_smoothed_loss(logits, target, eps, pad)
    want_loss, want_nll = 0.0, 0.0
    for i in range(5):
        y = int(target[i])
        if y == pad:
            continue
        logp = torch.log_softmax(logits[i].double(), -1)
        q = torch.full((V,), eps / (V - 2), dtype=torch.float64)  # spread over non-gold, non-pad
        q[y], q[pad] = 1 - eps, 0.0
        want_loss += float(-(q * logp).sum())
        want_nll += float(-logp[y])
    print(f"loss {float(loss):.6f} vs {want_loss:.6f}")
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert float(nll) == pytest.approx(want_nll, rel=1e-5)
    l0, n0 = O.label_smoothed_loss(logits, target, 0.0, pad)
    want_l0 = float(F.cross_entropy(logits, target, ignore_index=pad, reduction="sum"))
    assert float(l0) == pytest.approx(want_l0, rel=1e-6)


def test_label_smoothed_loss_gradient_and_all_padding():
    """Padding positions get no gradient (they are zeroed, not indexed out); the gradient matches
    the smoothed-target cross-entropy in float64; a batch of padding only sums to 0."""
    torch.manual_seed(0)
    V, eps, pad = 9, 0.1, 0
    logits = torch.randn(6, V, requires_grad=True)
    target = torch.tensor([2, 0, 8, 0, 1, 5])
    loss, _ = O.label_smoothed_loss(logits, target, eps, pad)
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_()
    q = torch.full((6, V), eps / (V - 2), dtype=torch.float64)
    q[:, pad] = 0.0
    q[torch.arange(6), target] = 1 - eps
    q[target == pad] = 0.0
    (-(q * torch.log_softmax(ref_logits, -1)).sum()).backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.all(logits.grad[target == pad] == 0)
    zero, zero_nll = O.label_smoothed_loss(torch.randn(3, V), torch.full((3,), pad), eps, pad)
    assert float(zero) == 0.0 and float(zero_nll) == 0.0


def _lrs(sched_name, steps, **kw):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    s = O.build_scheduler(opt, sched_name, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    return out


def test_schedule_shapes():
    inv = _lrs("inverse_sqrt", 400, warmup=100, total=400)
    assert inv[0] == pytest.approx(0.01) and inv[99] == pytest.approx(1.0)  # linear warmup to the peak
    assert all(a < b for a, b in zip(inv[:99], inv[1:100]))
    assert inv[399] == pytest.approx(math.sqrt(100 / 400))  # then peak * sqrt(warmup / step)
    cos = _lrs("cosine", 200, warmup=20, total=200, min_lr=0.1, peak=1.0)
    assert cos[19] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(cos[19:], cos[20:]))  # monotone decay after warmup
    const = _lrs("constant", 50, warmup=10, total=50)
    assert const[9] == const[-1] == 1.0
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    plat = O.build_scheduler(opt, "plateau", warmup=0, total=0, metric_mode="min", patience=1)
    for metric in (1.0, 1.0, 1.0):  # no improvement for 2 evaluations -> halve
        plat.step(metric)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_plateau_warms_up_then_halves_counting_no_validation_of_the_warmup():
    """--schedule plateau --warmup-steps 4 (fairseq's reduce_lr_on_plateau): step k (0-based) trains at
    peak * (k + 1) / 4 up to the peak, then at the peak until the metric stalls. A validation after
    every step, its metric never improving: the three inside the warmup neither count nor halve; after
    it, patience 1 halves at every second one. lr_taken is each step's rate before its validation."""
    peak = 2.0
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    plat = O.build_scheduler(opt, "plateau", warmup=4, total=0, metric_mode="min", patience=1)
    lrs = []
    for _ in range(10):
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        plat.step()
        assert O.lr_taken(plat) == lrs[-1]
        plat.step(1.0)
    # validations counted after steps 4 (the first: a best), 5 (bad 1), 6 (bad 2 > 1: halve), 7, 8 (halve)
    assert lrs == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0, 1.0, 1.0, 0.5, 0.5]


def test_plateau_warmup_refills_a_tensor_lr_and_resumes_where_it_stood():
    """Under --cuda-graphs each group's lr is a 0-dim tensor a captured step reads: the warmup refills
    it in place. A checkpoint's state resumes mid-warmup at the same rate; one from before plateau had
    a warmup (a ReduceLROnPlateau's state) is past it: the lr restored with the optimizer is kept."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    plat = O.build_scheduler(opt, "plateau", warmup=4, total=0, patience=1)
    lr = opt.param_groups[0]["lr"] = torch.tensor(float(opt.param_groups[0]["lr"]))
    plat.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 1.0
    state = plat.state_dict()
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    resumed = O.build_scheduler(fresh, "plateau", warmup=4, total=0, patience=1)
    O.load_scheduler(resumed, state, 2.0)
    assert resumed.updates == 1 and fresh.param_groups[0]["lr"] == 1.0
    resumed.step()
    assert fresh.param_groups[0]["lr"] == 1.5
    old = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    fresh.param_groups[0]["lr"] = 0.25  # a halved rate, as load_optimizer restores it
    O.load_scheduler(resumed, old.state_dict(), 2.0)
    assert resumed.updates == resumed.warmup == 4 and fresh.param_groups[0]["lr"] == 0.25


def test_cosine_decays_half_a_cosine_from_the_peak_to_min_lr():
    """After warmup, lr = min_lr + (peak - min_lr) * (1 + cos(pi t)) / 2, t the fraction of the decay
    steps done: halfway between peak and floor at t = 1/2, min_lr itself (not min_lr * peak) at the end."""
    peak, min_lr = 2.0, 0.4
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = O.build_scheduler(opt, "cosine", warmup=10, total=110, min_lr=min_lr, peak=peak)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # step k (0-based) trains at s = k + 1: s = 10 ends the warmup; s = 10 + 100 t
    assert lrs[9] == pytest.approx(peak)
    assert lrs[59] == pytest.approx((peak + min_lr) / 2)  # t = 1/2: cos = 0
    assert lrs[34] == pytest.approx(min_lr + (peak - min_lr) * (1 + math.cos(math.pi / 4)) / 2)  # t = 1/4
    assert lrs[109] == pytest.approx(min_lr)  # t = 1


def test_weight_decay_shrinks_matrices_but_not_biases_or_norm_gains():
    """AdamW decays the weight matrices (and embeddings) only: with zero gradients a step leaves Adam's
    update at 0 and scales each decayed weight by 1 - lr * wd, and leaves biases, LayerNorm gains and
    the [CLS] vector as they were. Every parameter is in exactly one group."""
    torch.manual_seed(0)
    model = Classifier(get_config("classifier", src_vocab_size=20, kernel="eager"))
    lr, wd = 0.1, 0.5
    opt = O.build_optimizer(model, lr, wd)
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        matrix = name.endswith("weight") and "norm" not in name
        want = before[name] * (1 - lr * wd) if matrix else before[name]
        torch.testing.assert_close(p.detach(), want, msg=name)
    assert any(n.endswith("bias") for n in before) and any("norm" in n for n in before) and "cls" in before


def test_classification_nll_is_unsmoothed_and_the_loss_smoothed_over_all_classes():
    """Two classes, logits (0, ln 3): p = (1/4, 3/4). Label 1: NLL = ln(4/3); smoothed with eps over
    both classes (eps / C each, label 0 included: it is a class, not PAD):
    (1 - eps) ln(4/3) + eps/2 (ln 4 + ln(4/3))."""
    logits = torch.tensor([[0.0, math.log(3.0)]])
    eps = 0.2
    loss, nll = O.classification_loss(logits, torch.tensor([1]), eps)
    assert float(nll) == pytest.approx(math.log(4 / 3))
    assert float(loss) == pytest.approx((1 - eps) * math.log(4 / 3) + eps / 2 * (math.log(4) + math.log(4 / 3)))


def test_every_score_a_validation_reports_is_ranked_the_right_way():
    """best.pt and early stopping follow is_better: every score of the decodings (BLEU, chrF, exact
    match, ROUGE-1/2/L/Lsum) and accuracy are better higher; loss and perplexity lower."""

    scores = [*M.seq2seq_scores(["a b"], ["a b"], "summarization"), "accuracy"]
    assert set(M.ROUGE_KEYS) <= set(scores) and set(M.DIAGNOSTICS) <= set(scores)
    # a diagnostic (the length ratio) ranks nothing: it is no --best-metric of any task
    assert not set(M.DIAGNOSTICS) & {m for names in METRICS.values() for m in names}
    for metric in set(scores) - set(M.DIAGNOSTICS):
        assert O.is_better(metric, 2.0, 1.0) and not O.is_better(metric, 1.0, 2.0), metric
    for metric in ("loss", "ppl"):
        assert O.is_better(metric, 1.0, 2.0) and not O.is_better(metric, 2.0, 1.0), metric


def test_resumed_schedule_takes_todays_warmup_length_and_peak():
    """load_scheduler keeps the checkpoint's position and nothing else of its schedule: a cosine run
    resumed with a longer --max-steps, another --warmup-steps and --lr follows the new schedule from
    where it stood (until 2026-12-01 LambdaLR's load_state_dict wrote the checkpoint's warmup and
    length back into the new schedule's function: a run extended past its cosine end trained at lr 0)."""
    def scheduler(warmup, total, lr):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        return O.build_scheduler(opt, "cosine", warmup=warmup, total=total, min_lr=0.0, peak=lr)

    old = scheduler(2, 10, 1.0)
    for _ in range(10):  # to the end of its cosine: lr 0
        old.optimizer.step()
        old.step()
    assert old.get_last_lr()[0] == pytest.approx(0.0)
    new = scheduler(4, 40, 0.5)
    O.load_scheduler(new, old.state_dict(), 0.5)
    assert vars(new.lr_lambdas[0]) == {"warmup": 4, "total": 40, "min_ratio": 0.0}
    want = O.WarmupCosine(4, 40)
    assert new.last_epoch == 10 and new.get_last_lr()[0] == pytest.approx(0.5 * want(10))
    new.optimizer.step()
    new.step()
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * want(11)) and want(11) > 0.5
    same = scheduler(2, 10, 1.0)  # unchanged settings: the checkpoint's lr, bit for bit
    O.load_scheduler(same, old.state_dict(), 1.0)
    assert same.get_last_lr() == old.get_last_lr()


def test_resumed_optimizer_runs_as_built_now():
    """load_optimizer restores the checkpoint's state but keeps how the optimizer runs as built now
    (load_state_dict took the groups' fused / foreach / capturable from the checkpoint: a CPU run's,
    fused None, resumed on a GPU turned fused AdamW off and left its step counts on the CPU, which
    --cuda-graphs' capturable step refuses). Shown with foreach, which a CPU has."""
    def adamw(foreach):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        return torch.optim.AdamW([p], lr=1e-2, foreach=foreach)

    old = adamw(foreach=False)
    old.param_groups[0]["params"][0].grad = torch.ones(4)
    old.step()
    new = adamw(foreach=True)
    O.load_optimizer(new, old.state_dict())
    assert new.param_groups[0]["foreach"] is True
    assert new.param_groups[0]["lr"] == old.param_groups[0]["lr"]
    (got,), (want,) = new.state.values(), old.state.values()
    assert all(torch.equal(got[k], want[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_train_rows_log_the_learning_rate_each_step_took(tmp_path):
    """Step k trains at peak * schedule(k - 1), and its row says so (until 2026-12-01 the row showed the
    next step's: the scheduler steps before the row is logged)."""
    T.main(TINY + ["--max-steps", "5", "--lr", "1e-3", "--out", str(tmp_path / "run")])  # warmup 4
    want = [1e-3 * O.InverseSqrt(4)(k) for k in range(5)]
    assert [lr for _, _, lr in _train_rows(tmp_path / "run")] == pytest.approx(want)
    assert want[0] == pytest.approx(2.5e-4) and want[3] == pytest.approx(1e-3)


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_bar_is_drawn_on_a_terminal_only(tmp_path, monkeypatch, terminal):
    """The bar is for a terminal: a log redirected to a file gets the log rows alone, as evaluate and generate do
    (until 2026-12-07 training drew it into any stderr: a redirected log held a line every half second)."""
    class Stream(io.StringIO):
        def isatty(self):
            return terminal

    err = Stream()
    monkeypatch.setattr(sys, "stderr", err)
    T.main([a for a in TINY if a != "--no-progress"] + ["--max-steps", "3", "--out", str(tmp_path / "run")])
    assert ("train: 100%" in err.getvalue()) == terminal, err.getvalue()[-500:]


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"]) for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("log_every", [1, 4])
def test_exact_resume(tmp_path, log_every):
    """N steps straight == k steps, stop, resume to N: same losses, bit for bit (dropout on). Step k is
    one the straight run does not validate: the split run's final validation there must leave the
    random stream of the training as it was (a validation loader drawing its workers' seed from
    torch's generator moved it until 2026-11-29). Logged every 4 steps, the row after the resume
    sums steps from before it too (they were left out until 2026-12-02: the checkpoint did not hold them)."""
    common = TINY + ["--dropout", "0.1", "--eval-every", "3", "--seed", "3", "--log-every", str(log_every)]
    T.main(common + ["--max-steps", "10", "--out", str(tmp_path / "straight")])
    T.main(common + ["--max-steps", "5", "--out", str(tmp_path / "split")])  # stops mid-epoch 2
    T.main(["--resume", "--max-steps", "10", "--out", str(tmp_path / "split"), "--no-progress", "--no-plots"])
    a, b = _train_rows(tmp_path / "straight"), _train_rows(tmp_path / "split")
    print(a, b, sep="\n")
    assert [s for s, _, _ in b] == [s for s in range(1, 11) if s == 1 or s % log_every == 0]
    assert a == b  # exact equality, not approx
    wa = load_checkpoint(tmp_path / "straight" / "last.pt")["model"]
    wb = load_checkpoint(tmp_path / "split" / "last.pt")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_run_ended_with_its_epoch_resumes_with_more_epochs_without_validating_it_again(tmp_path):
    """--eval-every 0 validates at each epoch's end: a run whose last step closed its last epoch, resumed
    with more --epochs, goes on training (until 2026-12-01 it validated that step a second time, which
    --patience 1 counted as an evaluation without gain: it stopped early at once, with no new step)."""
    common = TINY + ["--eval-every", "0", "--max-steps", "1000"]  # 4 batches an epoch
    T.main(common + ["--epochs", "1", "--out", str(tmp_path / "run")])
    T.main(["--resume", "--epochs", "3", "--patience", "1", "--out", str(tmp_path / "run"), "--no-progress",
            "--no-plots"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["step"] for r in rows if r["split"] == "valid"]
    steps = max(r["step"] for r in rows if r["split"] == "train")
    assert steps > valid[0] and len(valid) == len(set(valid)), (valid, steps)
    assert load_checkpoint(tmp_path / "run" / "last.pt")["progress"]["step"] == steps


def test_epochs_end_training_though_an_epoch_has_more_batches_than_the_first(tmp_path):
    """--epochs 2 under --bpe-dropout and --max-tokens, whose second epoch packs into one batch more
    than the first: both epochs are trained to their end (training stopped at twice the first's
    count, one batch short of the second epoch's end)."""
    run = tmp_path / "run"
    T.main(TINY + ["--bpe-dropout", "0.5", "--max-tokens", "100", "--batch-size", "1000", "--max-train-examples", "40",
                   "--epochs", "2", "--eval-every", "0", "--log-every", "1", "--out", str(run)])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    per_epoch = Counter(r["epoch"] for r in rows if r["split"] == "train")
    progress = load_checkpoint(run / "last.pt")["progress"]
    assert (progress["epoch"], progress["batch"]) == (2, 0), (progress, per_epoch)  # both epochs ended
    assert per_epoch[2] > per_epoch[1], f"the test needs a longer second epoch: {per_epoch}"
    assert progress["step"] == per_epoch[1] + per_epoch[2]


def test_rows_name_the_epoch_their_step_was_taken_in(tmp_path):
    """Each epoch's end validation is logged with that epoch (it was logged with the next: epochs 2
    and 3 for a 2-epoch run), as are the train rows of its steps; with --eval-every the last step of
    an epoch is still that epoch's."""
    for name, flags in (("ends", ["--eval-every", "0"]), ("every", ["--eval-every", "2"])):
        T.main(TINY + [*flags, "--epochs", "2", "--max-steps", "1000", "--log-every", "1",
                       "--out", str(tmp_path / name)])  # 4 batches an epoch
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for split in ("train", "valid"):
            got = {r["step"]: r["epoch"] for r in rows if r["split"] == split}
            assert got == {s: (s - 1) // 4 + 1 for s in got} and set(got.values()) == {1, 2}, (name, split, got)


def test_bpe_dropout_resumes_exactly_and_changes_the_training_batches(tmp_path):
    """--bpe-dropout: a resumed run sees the same segmentations (the same losses, bit for bit), which
    are not the usual ones (another run's training tokens differ); it may not change on resume."""
    common = TINY + ["--eval-every", "3", "--seed", "3", "--bpe-dropout", "0.3"]
    T.main(common + ["--max-steps", "10", "--out", str(tmp_path / "straight")])
    T.main(common + ["--max-steps", "6", "--out", str(tmp_path / "split")])  # stops mid-epoch 2
    T.main(["--resume", "--max-steps", "10", "--out", str(tmp_path / "split"), "--no-progress", "--no-plots"])
    assert _train_rows(tmp_path / "straight") == _train_rows(tmp_path / "split")
    T.main(TINY + ["--eval-every", "3", "--seed", "3", "--max-steps", "10", "--out", str(tmp_path / "usual")])
    tokens = [load_checkpoint(tmp_path / d / "last.pt")["progress"]["tokens"] for d in ("straight", "usual")]
    print(tokens)
    assert tokens[0] > tokens[1]  # finer segmentations: more target tokens in the same 10 steps
    with pytest.raises(ConfigError, match=r"--bpe-dropout 0.1 \(the run has 0.3\) cannot change"):
        T.main(["--resume", "--bpe-dropout", "0.1", "--max-steps", "12", "--out", str(tmp_path / "split")])


def test_grad_accum_runs_and_counts_batches(tmp_path):
    res = T.main(TINY + ["--grad-accum", "2", "--max-steps", "3", "--eval-every", "3", "--out", str(tmp_path)])
    ck = load_checkpoint(tmp_path / "last.pt")
    assert ck["progress"]["step"] == 3 and ck["progress"]["batch"] == 2  # 4 batches/epoch: step 3 = epoch 2, batch 2
    assert "greedy" in res and "beam2" in res


def test_pad_multiple_pads_every_training_batch(tmp_path, monkeypatch):
    """--pad-multiple 16 with sources of up to 20 tokens: every training batch's lengths are padded
    to multiples of 16 (up to 32, past --max-src-len: the model is built long enough), the run
    trains, and a resume may not change it (the batches would)."""
    widths, collate = set(), batching.collate

    def recording(items, pad_multiple=1, task=None):
        b = collate(items, pad_multiple, task)
        if pad_multiple != 1:  # the training batches (validation's are padded to their longest)
            widths.update((b.src.shape[1], b.tgt_in.shape[1]))
        return b

    monkeypatch.setattr(batching, "collate", recording)  # what make_loader's batches come from
    out = tmp_path / "run"
    res = T.main(TINY + ["--pad-multiple", "16", "--max-src-len", "20", "--max-steps", "3", "--eval-every", "3",
                         "--out", str(out)])
    assert widths and all(w % 16 == 0 for w in widths) and max(widths) == 32, widths
    assert res["steps"] == 3 and math.isfinite(res["loss"])
    with pytest.raises(ConfigError, match=r"--pad-multiple 8 \(the run has 16\) cannot change"):
        T.main(["--resume", "--pad-multiple", "8", "--max-steps", "4", "--out", str(out), "--no-progress"])


def test_early_stopping(tmp_path):
    # lr 0 cannot improve: stops after `patience` evaluations without gain
    res = T.main(TINY + ["--lr", "1e-12", "--schedule", "constant", "--eval-every", "1", "--patience", "2",
                         "--max-steps", "50", "--out", str(tmp_path)])
    assert res["steps"] < 50
    assert load_checkpoint(tmp_path / "last.pt")["progress"]["stopped_early"]
    # resumed as it was, it has nothing to train, and says why and what would train it on
    again = T.main(["--resume", "--out", str(tmp_path), "--no-progress"])
    assert again["steps"] == res["steps"]
    assert (f"nothing to train: the run ended at step {res['steps']}, stopped early (2 evaluations without gain): "
            "give a larger --patience, or 0\n") in (tmp_path / "log.txt").read_text()


def test_classifier_training_step_reduces_loss():
    torch.manual_seed(0)
    cfg = get_config("classifier", src_vocab_size=50, dropout=0.0, kernel="eager")
    model = Classifier(cfg)
    opt = O.build_optimizer(model, 3e-3, 0.01)
    tokens = torch.randint(4, 50, (8, 12))
    lengths = torch.tensor([12, 5, 7, 12, 1, 9, 3, 12])
    labels = (tokens[:, 0] % 2).long()  # learnable from the first token
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(tokens, lengths), labels)
        loss.backward()
        loss = loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    print(losses[0], losses[-1])
    assert losses[-1] < 0.5 * losses[0]


def test_classifier_validation_loss_counts_label_zero():
    """Label 0 equals PAD_ID: the classification loss must not ignore it."""
    torch.manual_seed(0)
    model = Classifier(get_config("classifier", src_vocab_size=20, kernel="eager")).eval()
    ds = D.EncodedDataset([torch.randint(4, 20, (5,)).numpy() for _ in range(6)], [0, 0, 0, 1, 1, 0], "classification")
    res = teacher_forced(model, eval_loader(ds, batch_size=4), "cpu")
    with torch.no_grad():
        b = D.collate([ds[i] for i in range(6)])
        want = float(F.cross_entropy(model(b.src, b.src_lengths), b.labels))
    assert res["loss"] == pytest.approx(want, rel=1e-5)


def test_a_new_run_never_writes_into_an_earlier_one(tmp_path, monkeypatch):
    """An --out that holds a run is refused (its files untouched), replaced only with --overwrite;
    without --out each run gets its own folder and runs/latest points at the newest."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "2", "--eval-every", "2", "--out", str(run)])
    (run / "metrics.validation.json").write_text("{}")  # what `evaluate --checkpoint run` adds
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert {"last.pt", "best.pt", "train.csv", "metrics.jsonl"} <= set(before)

    with pytest.raises(runs.RunFolderError,
                       match=r"already holds a training run \(last\.pt, best\.pt.*--resume.*--overwrite"):
        T.main(TINY + ["--max-steps", "3", "--out", str(run)])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before

    T.main(TINY + ["--max-steps", "3", "--eval-every", "3", "--seed", "1", "--out", str(run), "--overwrite"])
    assert [s for s, _, _ in _train_rows(run)] == [1, 2, 3]  # the new run's rows only
    assert not (run / "step_0000002.pt").exists()  # the old run's step checkpoint went with it
    assert not (run / "metrics.validation.json").exists()  # and its evaluation, which would now mislead
    assert load_checkpoint(run / "last.pt")["progress"]["step"] == 3

    monkeypatch.setattr(runs, "RUNS_DIR", tmp_path / "runs")
    for _ in range(2):
        T.main(TINY + ["--max-steps", "1", "--eval-every", "1"])
    folders = sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(folders) == 2 and all((p / "last.pt").is_file() for p in folders)
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and latest.resolve() == folders[-1].resolve()
    T.main(["--resume", "--max-steps", "2", "--no-progress", "--no-plots"])  # no --out: the newest run
    assert load_checkpoint(folders[-1] / "last.pt")["progress"]["step"] == 2
    assert load_checkpoint(folders[0] / "last.pt")["progress"]["step"] == 1
    # --resume naming an older run's checkpoint, no --out: that run continues; the newest is untouched
    newest = {p.name: p.read_bytes() for p in folders[-1].iterdir() if p.is_file()}
    T.main(["--resume", str(folders[0] / "last.pt"), "--max-steps", "3", "--no-progress", "--no-plots"])
    assert load_checkpoint(folders[0] / "last.pt")["progress"]["step"] == 3
    assert [s for s, _, _ in _train_rows(folders[0])] == [1, 2, 3]
    assert {p.name: p.read_bytes() for p in folders[-1].iterdir() if p.is_file()} == newest


def test_compile_flag_trains_like_eager_with_few_graphs(tmp_path):
    """--compile aot_eager (traces, no code generation, runs on the CPU): the same losses as the
    uncompiled run, step for step, with dropout off; over 12 steps of length-bucketed batches (new
    lengths nearly every step) dynamic shapes keep the compiled graphs to a handful, not one per shape.
    Checkpoints hold the plain model's keys (no `_orig_mod.` prefix)."""
    from torch._dynamo.utils import counters

    common = TINY + ["--dropout", "0", "--max-steps", "12", "--eval-every", "12", "--seed", "5"]
    T.main(common + ["--out", str(tmp_path / "eager")])
    torch._dynamo.reset()
    counters.clear()
    T.main(common + ["--compile", "aot_eager", "--out", str(tmp_path / "compiled")])
    graphs = counters["stats"]["unique_graphs"]
    a, b = _train_rows(tmp_path / "eager"), _train_rows(tmp_path / "compiled")
    print("graphs compiled:", graphs, a, b, sep="\n")
    assert [s for s, _, _ in a] == [s for s, _, _ in b] == list(range(1, 13))
    for (_, la, _), (_, lb, _) in zip(a, b):
        assert lb == pytest.approx(la, rel=1e-4, abs=1e-5)
    assert 1 <= graphs <= 4
    state = load_checkpoint(tmp_path / "compiled" / "last.pt")["model"]
    assert not any(k.startswith("_orig_mod.") for k in state)


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _best_is_its_own(folder):
    """A run folder's best.pt is the model its last.pt and metrics.final.json call best -> its step
    (until 2026-12-01 a run resumed into a new folder had none there: its final report scored its last
    weights as best.pt's)."""
    best_step = load_checkpoint(folder / "last.pt")["progress"]["best_step"]
    assert load_checkpoint(folder / "best.pt")["progress"]["step"] == best_step
    assert json.loads((folder / "metrics.final.json").read_text())["best_step"] == best_step
    return best_step


def test_resume_into_another_out_refuses_a_folder_holding_a_run(tmp_path):
    """--resume A/last.pt --out B: B holding another run is refused by name, before anything is
    written (B's and A's files untouched); a new B takes the continued run: its checkpoints, its
    tokenizer and A's logs up to the checkpoint, continued there; A stays as it was."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    T.main(TINY + ["--max-steps", "2", "--eval-every", "2", "--out", str(a)])
    T.main(TINY + ["--max-steps", "3", "--eval-every", "3", "--seed", "5", "--out", str(b)])
    before_a, before_b = _files(a), _files(b)
    with pytest.raises(runs.RunFolderError, match=rf"--out {b} already holds a training run \(last\.pt, best\.pt.*"
                                                  rf"--resume {a / 'last.pt'}.*new --out.*continue in {a}"):
        T.main(["--resume", str(a / "last.pt"), "--out", str(b), "--max-steps", "4", "--no-progress"])
    assert _files(b) == before_b and _files(a) == before_a
    # a learning rate that makes steps 3-4 worse: the best stays step 2's, whose best.pt comes along
    T.main(["--resume", str(a / "last.pt"), "--out", str(c), "--max-steps", "4", "--no-progress", "--no-plots",
            "--lr", "5", "--warmup-steps", "1"])
    assert _files(a) == before_a
    assert load_checkpoint(c / "last.pt")["progress"]["step"] == 4 and (c / "tokenizer.json").is_file()
    assert _best_is_its_own(c) == 2 and (c / "best.pt").read_bytes() == (a / "best.pt").read_bytes()
    rows = [json.loads(line) for line in (c / "metrics.jsonl").read_text().splitlines()]
    best_loss = next(r["loss"] for r in rows if r["split"] == "valid" and r["step"] == 2)
    final = json.loads((c / "metrics.final.json").read_text())
    assert final["loss"] == pytest.approx(best_loss)  # best.pt scored
    # on how many examples: the loss on the split, the decodings on --eval-decode-examples (it said neither)
    valid = load_checkpoint(c / "last.pt")["args"]
    assert (final["n"], final["n_decoded"]) == (valid["max_valid_examples"], valid["eval_decode_examples"])
    assert final["n_decoded"] < final["n"]
    assert [s for s, _, _ in _train_rows(c)] == [1, 2, 3, 4]
    assert _train_rows(c)[:2] == _train_rows(a)
    assert sorted(p.name for p in c.glob("step_*.pt")) == ["step_0000004.pt"]


def test_resume_from_an_older_step_refuses_the_folder_and_goes_to_a_new_one(tmp_path):
    """--resume R/step_0000003.pt where R went on to step 4: continuing in R would mix two histories
    (and --keep-checkpoints prune the new one), so it is refused, naming the later checkpoint and
    --out, with nothing deleted or written; into a new --out it continues from step 3."""
    run, branch = tmp_path / "run", tmp_path / "branch"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--save-every", "1", "--keep-checkpoints", "2",
                   "--out", str(run)])
    assert sorted(p.name for p in run.glob("step_*.pt")) == ["step_0000003.pt", "step_0000004.pt"]
    before = _files(run)
    with pytest.raises(runs.RunFolderError, match=r"step_0000003\.pt.* step 3 .*step_0000004\.pt.*--out"):
        T.main(["--resume", str(run / "step_0000003.pt"), "--max-steps", "4", "--keep-checkpoints", "1",
                "--no-progress"])
    assert _files(run) == before
    T.main(["--resume", str(run / "step_0000003.pt"), "--out", str(branch), "--max-steps", "4",
            "--keep-checkpoints", "1", "--no-progress", "--no-plots"])
    assert _files(run) == before
    assert sorted(p.name for p in branch.glob("step_*.pt")) == ["step_0000004.pt"]
    ck = load_checkpoint(branch / "last.pt")
    assert ck["progress"]["step"] == 4 and ck["args"]["resume_path"] == str(run / "step_0000003.pt")
    assert _train_rows(branch) == _train_rows(run)  # the same history, continued exactly
    _best_is_its_own(branch)  # run's best.pt, if of step 4, is not the branch's: its best started afresh


def test_a_branch_keeps_no_final_report_of_the_history_it_leaves(tmp_path):
    """--resume R/step_0000002.pt --out B after R ended at step 4: R's final report (step 4, another
    model) was copied into B's metrics.jsonl among its step-2 rows, as a row of no step; B's log holds
    its own final report alone, its rows in step order."""
    run, branch = tmp_path / "run", tmp_path / "branch"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--save-every", "1", "--keep-checkpoints", "4",
                   "--out", str(run)])
    T.main(["--resume", str(run / "step_0000002.pt"), "--out", str(branch), "--max-steps", "3", "--no-progress",
            "--no-plots"])
    rows = [json.loads(line) for line in (branch / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "final"] == [3]
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)


def test_a_branch_from_before_its_runs_best_starts_its_best_afresh(tmp_path):
    """--resume R/step_0000003.pt --out B, where R's best.pt is of step 4: that best.pt is not the
    branch's (not carried), so the branch's best starts afresh, and its first validation (step 4, here
    worse than step 2's: a diverging --lr) makes B's best.pt. Kept, the step-2 best the checkpoint
    recorded would have no best.pt in B, and the final report would score the last weights as best."""
    run, branch = tmp_path / "run", tmp_path / "branch"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--save-every", "1", "--keep-checkpoints", "4",
                   "--out", str(run)])
    assert load_checkpoint(run / "best.pt")["progress"]["step"] == 4
    assert load_checkpoint(run / "step_0000003.pt")["progress"]["best_step"] == 2
    T.main(["--resume", str(run / "step_0000003.pt"), "--out", str(branch), "--max-steps", "4", "--lr", "5",
            "--warmup-steps", "1", "--no-progress", "--no-plots"])
    assert _best_is_its_own(branch) == 4
    final = json.loads((branch / "metrics.final.json").read_text())
    last = json.loads((branch / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"split": "final", "step": 4, **final}  # the final report is logged as the last row too


def test_a_finished_run_resumed_with_no_step_left_reports_its_step_once(tmp_path):
    """--resume of a run at its --max-steps trains nothing and reports again: its final row replaces
    the one of that step (there were two), and stays the last; one resumed with more steps adds its own."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--out", str(run)])
    resume = ["--resume", "--out", str(run), "--no-progress", "--no-plots"]
    T.main(resume)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "final"] == [4] and rows[-1]["split"] == "final"
    T.main([*resume, "--max-steps", "6"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "final"] == [4, 6] and rows[-1]["split"] == "final"


def test_resume_from_a_last_pt_older_than_a_step_file_takes_the_step_file(tmp_path, capsys):
    """A save cut between step_N.pt and last.pt (written in that order: a call's deadline kill on a
    GPU window) leaves last.pt a step behind: a plain --resume goes on from step_N.pt, with a warning
    naming both, as for an unreadable last.pt; it is the same run's newest state, not a rewind."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--save-every", "1", "--keep-checkpoints", "2",
                   "--out", str(run)])
    shutil.copy(run / "step_0000003.pt", run / "last.pt")  # last.pt as the save of step 4 left it
    capsys.readouterr()
    T.main(["--resume", "--out", str(run), "--max-steps", "5", "--no-progress", "--no-plots"])
    assert "last.pt is at step 3, before step_0000004.pt (a save cut between the two); resuming from" in (
        capsys.readouterr().out)
    ck = load_checkpoint(run / "last.pt")
    assert ck["progress"]["step"] == 5 and ck["args"]["resume_path"] == str(run / "step_0000004.pt")


@pytest.mark.parametrize("metric, worse, better", [("loss", 5.0, 4.0), ("bleu", 10.0, 12.0)])
def test_a_nan_validation_never_becomes_the_best(metric, worse, better):
    """A diverged validation (NaN) is not an improvement, and any number improves on a NaN best (a NaN
    taken as best once held best.pt for the rest of the run: nothing compares better than NaN)."""
    nan = float("nan")
    assert not O.is_better(metric, nan, None) and not O.is_better(metric, nan, worse)
    assert O.is_better(metric, worse, nan) and O.is_better(metric, worse, None)
    assert O.is_better(metric, better, worse) and not O.is_better(metric, worse, better)


@pytest.mark.parametrize("epochs", [None, 2])
def test_max_steps_given_alone_bounds_a_real_data_run_and_the_log_says_what_bounds_it(tmp_path, epochs):
    """Real data defaults to 10 epochs, but --max-steps given without --epochs is the run's only bound
    (it stopped at the 10 epochs, short of the steps asked for); with --epochs too the first one reached
    ends it. The log names the bound, and warns of a warmup longer than the run."""
    from conftest import translation_folder

    data, out = translation_folder(tmp_path), tmp_path / "run"
    flags = ["--data", str(data), "--out", str(out), "--max-steps", "33", "--eval-every", "0",
             *TINY[:TINY.index("--warmup-steps")], *(["--epochs", str(epochs)] if epochs else [])]
    T.main(flags)  # 48 examples, batches of 16: 3 steps an epoch
    steps = 33 if epochs is None else 3 * epochs
    assert load_checkpoint(out / "last.pt")["progress"]["step"] == steps
    log = (out / "log.txt").read_text()
    bound = "(--max-steps)" if epochs is None else f"({epochs} epochs)"
    assert f"3 batches/epoch (max_tokens 4096 batch_size 16, grad_accum 1), {steps} steps {bound}" in log
    assert (f"warning: --warmup-steps 1000 outlasts the run's {steps} steps: the learning rate ends at "
            f"{5e-4 * steps / 1000:.3g}, never reaching --lr 0.0005") in log
    assert json.loads((out / "args.json").read_text())["epochs"] == epochs
    # resumed with a larger --max-steps alone: still bounded by its epochs, a finished run says so
    T.main(["--resume", str(out), "--max-steps", "40"])
    log = (out / "log.txt").read_text()
    assert load_checkpoint(out / "last.pt")["progress"]["step"] == (40 if epochs is None else steps)
    assert ("nothing to train" in log) == (epochs is not None)
    if epochs is not None:
        assert f"nothing to train: the run ended at step {steps}, its {epochs} epochs done: give more --epochs" in log
        T.main(["--resume", str(out), "--epochs", str(epochs + 1)])  # one more epoch: 3 more steps
        assert load_checkpoint(out / "last.pt")["progress"]["step"] == steps + 3
    log = (out / "log.txt").read_text()
    T.main(["--resume", str(out)])
    end = (out / "log.txt").read_text()[len(log):]
    assert "nothing to train: the run ended at step" in end and ("--max-steps 40 reached" in end) == (epochs is None)
