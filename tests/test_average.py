"""Checkpoint averaging (`scratchformer.average`): the mean of a run's weights, checked against the
mean taken tensor by tensor here, on a real training run's step checkpoints."""

import contextlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, translation_folder

from scratchformer import average, cli, evaluate, train
from scratchformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    load_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from scratchformer.evaluation.loading import load_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny translation run that kept its last 3 step checkpoints, 2 steps apart."""
    root = tmp_path_factory.mktemp("avg")
    folder = root / "run"
    train.main(TINY + ["--data", str(translation_folder(root)), "--max-steps", "6", "--eval-every", "6",
                       "--save-every", "2", "--keep-checkpoints", "3", "--lr", "3e-3", "--warmup-steps", "1",
                       "--no-plots", "--out", str(folder)])
    return folder


def test_the_average_is_the_mean_of_the_weights(run, capsys):
    steps = step_checkpoints(run)
    assert [int(p.stem.split("_")[1]) for p in steps] == [2, 4, 6]
    out = average.main([str(run), "--last", "3"])
    assert out == run / "averaged.pt" and "steps 2, 4, 6" in capsys.readouterr().err
    averaged = load_checkpoint(out)
    weights = [load_checkpoint(p)["model"] for p in steps]
    moved = 0
    for name, mean in averaged["model"].items():
        expected = torch.stack([w[name] for w in weights]).mean(0)
        assert mean.dtype == weights[0][name].dtype and torch.allclose(mean, expected, rtol=1e-6, atol=1e-7), name
        moved += not torch.equal(weights[0][name], weights[2][name])
    assert moved > 0  # the run trained between its checkpoints: an average that took one of them would fail
    assert averaged["progress"]["step"] == 6 and [a["step"] for a in averaged["averaged_from"]] == [2, 4, 6]
    assert "optimizer" not in averaged


def test_an_average_stored_in_bf16_is_the_mean_rounded_once_and_evaluates(run, tmp_path):
    """--dtype bf16 (the GPU plan ships a model over its 45 MiB so: half the bytes): each floating
    tensor is the float64 mean rounded once to bf16, not a mean of bf16 values; the file is about half
    the fp32 one's size; a model built in fp32 loads it and evaluates."""
    full = average.main([str(run), "--last", "3", "--output", str(tmp_path / "fp32.pt")])
    half = average.main([str(run), "--last", "3", "--output", str(tmp_path / "bf16.pt"), "--dtype", "bf16"])
    weights = [load_checkpoint(p)["model"] for p in step_checkpoints(run)]
    for name, v in load_checkpoint(half)["model"].items():
        if v.is_floating_point():
            mean = torch.stack([w[name].double() for w in weights]).mean(0)
            assert v.dtype == torch.bfloat16 and torch.equal(v, mean.to(torch.bfloat16)), name
    assert half.stat().st_size < 0.6 * full.stat().st_size
    model, _, _ = load_run(half)
    assert next(model.parameters()).dtype == torch.float32
    assert evaluate.main(["--checkpoint", str(half), "--split", "validation", "--beam-size", "1",
                          "--out", str(tmp_path / "eval")])


def test_last_n_averages_the_newest_n_step_checkpoints(run, tmp_path):
    """--last 2 of a folder holding steps 2, 4 and 6 averages steps 4 and 6 (the newest two), and the
    result is their mean."""
    out = average.main([str(run), "--last", "2", "--output", str(tmp_path / "two.pt")])
    averaged = load_checkpoint(out)
    assert [a["step"] for a in averaged["averaged_from"]] == [4, 6]
    four, six = (load_checkpoint(run / f"step_{s:07d}.pt")["model"] for s in (4, 6))
    assert all(torch.allclose(v, (four[k] + six[k]) / 2, rtol=1e-6, atol=1e-7) for k, v in averaged["model"].items()
               if v.is_floating_point())


def test_tied_weights_stay_one_tensor(tmp_path):
    """A run with --tie-embeddings all: its three embedding matrices (encoder, decoder, output) are
    one tensor in each checkpoint and in their average, which is then no larger on disk than a step
    checkpoint's weights (an untied average holds the matrix three times over)."""
    folder = tmp_path / "tied"
    train.main(TINY + ["--data", str(translation_folder(tmp_path)), "--max-steps", "2", "--eval-every", "2",
                       "--save-every", "1", "--keep-checkpoints", "2", "--tie-embeddings", "all", "--no-plots",
                       "--out", str(folder)])
    steps = step_checkpoints(folder)
    out = average.main([str(folder), "--last", "2"])
    model = load_checkpoint(out)["model"]
    shared = {}
    for name, t in model.items():
        shared.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    tied = [names for names in shared.values() if len(names) > 1]
    assert len(tied) == 1 and len(tied[0]) == 3, tied
    first, second = (load_checkpoint(p)["model"][tied[0][0]] for p in steps)
    assert not torch.equal(first, second) and torch.allclose(model[tied[0][1]], (first + second) / 2)
    weights_only = tmp_path / "weights.pt"
    torch.save(load_checkpoint(steps[-1])["model"], weights_only)
    assert out.stat().st_size < weights_only.stat().st_size + 64 * 1024


def test_the_average_runs_and_starts_a_run_but_does_not_resume(run, tmp_path):
    out = average.main([str(p) for p in step_checkpoints(run)[-2:]] + ["--output", str(tmp_path / "avg.pt")])
    model, _, _ = load_run(out)
    saved = load_checkpoint(out)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    m = evaluate.main(["--checkpoint", str(out), "--out", str(tmp_path / "eval")])
    assert m["n"] == 12 and "bleu" in m
    res = train.main(["--init-from", str(out), "--data", str(run.parent / "toy_mt"), "--max-steps", "1",
                      "--batch-size", "16", "--eval-decode-examples", "0", "--beam-size", "1", "--no-plots",
                      "--no-progress", "--out", str(tmp_path / "b")])
    started = load_checkpoint(tmp_path / "b" / "last.pt")
    assert started["progress"]["step"] == 1 and started["args"]["init_from"] == str(out) and "bleu" in res["greedy"]
    with pytest.raises(CheckpointError, match="average of 2 checkpoints.*no 'optimizer'"):
        train.main(["--resume", str(out), "--out", str(tmp_path / "c"), "--max-steps", "8"])


def test_refusals_name_the_problem(run, tmp_path):
    steps = [str(p) for p in step_checkpoints(run)]
    with pytest.raises(cli.UsageError, match="is a folder: give --last N"):
        average.main([str(run)])
    # one more than it holds (it said to keep more, though a run that kept 5 has 3 after 3 saves)
    with pytest.raises(cli.UsageError, match=r"--last 4: .* holds 3 step checkpoints \(a run keeps its newest "
                                             r"--keep-checkpoints, one each --save-every steps"):
        average.main([str(run), "--last", "4"])
    with pytest.raises(cli.UsageError, match=r"--last must be >= 1, got 0"):
        average.main([str(run), "--last", "0"])
    with pytest.raises(cli.UsageError, match="--last takes one run folder"):
        average.main([steps[0], "--last", "1"])
    with pytest.raises(cli.UsageError, match="given twice"):
        average.main([steps[0], steps[0], "--output", str(tmp_path / "x.pt")])
    for spelled in (steps[-1], str(run / ".." / run.name / Path(steps[-1]).name)):  # a path to it spelled otherwise
        with pytest.raises(cli.UsageError, match="is one of the checkpoints"):
            average.main([*steps, "--output", spelled, "--overwrite"])
    (tmp_path / "taken.pt").write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="--overwrite"):
        average.main([*steps, "--output", str(tmp_path / "taken.pt")])
    assert (tmp_path / "taken.pt").read_bytes() == b"keep me"
    # another model's checkpoint
    other = load_checkpoint(steps[0])
    other["config"] = {**other["config"], "d_ff": 128}
    save_checkpoint(tmp_path / "other.pt", other)
    with pytest.raises(CheckpointError, match="other.pt is not a checkpoint of .*its config differ"):
        average.main([steps[0], str(tmp_path / "other.pt"), "--output", str(tmp_path / "y.pt")])
    assert not (tmp_path / "y.pt").exists()
    # the same model trained from another seed's random weights: an independent run (its average scored BLEU 0)
    other = load_checkpoint(steps[0])
    other["args"] = {**other["args"], "seed": 1}
    save_checkpoint(tmp_path / "seed1.pt", other)
    with pytest.raises(CheckpointError, match=r"seed1.pt is of a run trained from --seed 1's .* 0's: .*ensemble"):
        average.main([steps[0], str(tmp_path / "seed1.pt"), "--output", str(tmp_path / "y.pt")])
    assert not (tmp_path / "y.pt").exists()
    other["args"]["init_from"] = steps[0]  # a fine-tune of this run's weights (another seed): it averages
    other["model"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in other["model"].items()}  # tuned
    save_checkpoint(tmp_path / "tuned.pt", other)
    average.main([steps[0], str(tmp_path / "tuned.pt"), "--output", str(tmp_path / "soup.pt")])
    assert cli.run(average.main, [str(run), "--last", "0"]) == cli.EXIT_USER_ERROR


def test_a_tensor_that_is_not_floating_point_must_be_equal_in_every_checkpoint(run, tmp_path):
    """Integer tensors (counts, ids) have no mean: equal in all they are kept as they are, else the
    checkpoint that differs is refused, naming the tensor."""
    steps = step_checkpoints(run)
    paths = []
    for i, (step, count) in enumerate(((steps[0], 3), (steps[1], 3), (steps[1], 4))):
        ckpt = load_checkpoint(step)
        ckpt["model"]["counter"] = torch.tensor([count, 7])
        paths.append(save_checkpoint(tmp_path / f"c{i}.pt", ckpt))
    assert torch.equal(average_checkpoints(paths[:2])["model"]["counter"], torch.tensor([3, 7]))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(paths[2]))}: its counter differs from "
                       rf"{re.escape(str(paths[0]))}'s, and cannot be averaged"):
        average_checkpoints([paths[0], paths[2]])


def test_checkpoints_of_a_run_resumed_with_another_kernel_average(run, tmp_path):
    """The backend (a run may resume with another --kernel) and the longest input admitted (a guard
    --init-from raises) are not the model: checkpoints differing only there average (they were
    refused, "its config differ"); the average admits the longest input of them all."""
    steps = step_checkpoints(run)
    other = load_checkpoint(steps[1])
    other["config"] = {**other["config"], "kernel": "torch", "max_len": other["config"]["max_len"] + 64}
    save_checkpoint(tmp_path / "torch.pt", other)
    out = average.main([str(steps[0]), str(tmp_path / "torch.pt"), "--output", str(tmp_path / "avg.pt")])
    config = load_checkpoint(out)["config"]
    assert config["kernel"] == "torch" and config["max_len"] == other["config"]["max_len"]
    assert {k: v for k, v in config.items() if k not in ("kernel", "max_len")} == {
        k: v for k, v in load_checkpoint(steps[0])["config"].items() if k not in ("kernel", "max_len")}


def test_of_checkpoints_of_one_step_the_later_given_is_the_newest(run, tmp_path):
    """The average keeps the progress and arguments of the newest checkpoint: the highest step, and of
    two at one step (a run resumed from an earlier checkpoint saves that step again) the later given."""
    step = load_checkpoint(step_checkpoints(run)[1])
    for name, lr, bump in (("a.pt", 1e-3, 0.0), ("b.pt", 2e-3, 0.01)):
        model = {k: v + bump if v.is_floating_point() else v for k, v in step["model"].items()}
        save_checkpoint(tmp_path / name, {**step, "model": model, "args": {**step["args"], "lr": lr}})
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    assert average_checkpoints([a, b])["args"]["lr"] == 2e-3 and average_checkpoints([b, a])["args"]["lr"] == 1e-3


def test_pick_checkpoint_with_the_average_alone(tmp_path):
    """An unfinished GPU run brings back its average and no best.pt (scripts/gpu/finish_on_cpu.sh):
    the pick is among the average's scores, its best length penalty; with none scored, refused: the
    best.pt a run without scores keeps is not there (it was printed, exit 0)."""
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "bleu"}))
    (tmp_path / "averaged.pt").write_bytes(b"")
    _pick_refused(_pick(tmp_path), f"{tmp_path}: no best.pt, and validation scores for none of best, averaged")
    for name, bleu, lp in (("averaged", 40.0, 1.0), ("averaged-lp1.3", 41.0, 1.3), ("averaged-lp1.6", 40.5, 1.6)):
        (tmp_path / name).mkdir()
        scores = {"n": 9, "decoding": "beam4", "bleu": bleu, "length_penalty": lp}
        (tmp_path / name / "metrics.validation.json").write_text(json.dumps(scores))
    done = _pick(tmp_path)
    assert done.stdout.strip() == f"{tmp_path / 'averaged.pt'}\t1.3", done.stderr
    assert "validation bleu (beam4): averaged 40.00, averaged-lp1.3 41.00, averaged-lp1.6 40.50" in done.stderr


@pytest.mark.parametrize("failed", ["averaged", "best"])
def test_pick_checkpoint_leaves_out_a_checkpoint_whose_scoring_failed(tmp_path, failed):
    """50_train.sh marks a checkpoint whose evaluation failed (out of memory, say) RUN/NAME.failed: the
    pick is among the other's scores, its tuned penalty included. It counted as a candidate unscored:
    the pick fell back to best.pt at penalty 1 (averaged failed), or to the best.pt that had failed."""
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "bleu"}))
    other = "best" if failed == "averaged" else "averaged"
    for name in (failed, other):
        (tmp_path / f"{name}.pt").write_bytes(b"")
    for name, bleu, lp in ((other, 30.0, 1.0), (f"{other}-lp1.6", 32.0, 1.6), (f"{failed}-lp1.6", 35.0, 1.6)):
        (tmp_path / name).mkdir()
        scores = {"n": 9, "decoding": "beam4", "bleu": bleu, "length_penalty": lp}
        (tmp_path / name / "metrics.validation.json").write_text(json.dumps(scores))
    (tmp_path / f"{failed}.failed").write_bytes(b"")
    done = _pick(tmp_path)
    assert done.stdout.strip() == f"{tmp_path / f'{other}.pt'}\t1.6", done.stderr


PICK_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pick_checkpoint.py"
_spec = importlib.util.spec_from_file_location("pick_checkpoint", PICK_SCRIPT)
pick_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_checkpoint)


def _pick(run, *args):
    """scripts/pick_checkpoint.py RUN as its command line runs it (`cli.run`), in this process: a
    subprocess would import torch each time (test_pick_checkpoint_is_a_command runs the file)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.run(pick_checkpoint.main, [str(run), *args])
    return subprocess.CompletedProcess([str(PICK_SCRIPT), str(run), *args], code, out.getvalue(), err.getvalue())


def test_pick_checkpoint_is_a_command(tmp_path):
    done = subprocess.run([sys.executable, str(PICK_SCRIPT), str(tmp_path / "nosuchrun")], capture_output=True,
                          text=True)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"error: {tmp_path / 'nosuchrun'}: no such run "
                                                                  "folder\n")


def _pick_refused(done, *phrases):
    """pick_checkpoint.py refused: one `error:` line holding every phrase, exit status 2, no path printed."""
    assert done.returncode == 2 and not done.stdout and done.stderr.startswith("error: "), (done.returncode, done)
    assert len(done.stderr.strip().splitlines()) == 1 and all(p in done.stderr for p in phrases), done.stderr


def test_pick_checkpoint_refuses_what_it_cannot_pick_from(tmp_path):
    """A missing run or a file printed RUN/best.pt with exit 0 (a path that is not there, which
    scripts/gpu/50_train.sh would decode with); a cut scores file, a missing args.json or scores
    without the run's metric were tracebacks. Each is one error line naming the file, exit 2."""
    _pick_refused(_pick(tmp_path / "nosuchrun"), f"{tmp_path / 'nosuchrun'}: no such run folder")
    (tmp_path / "best.pt").write_bytes(b"")
    _pick_refused(_pick(tmp_path / "best.pt"), f"{tmp_path / 'best.pt'}: a file, not a run folder")
    scored = {"n": 9, "decoding": "beam4", "bleu": 30.0}
    for name in ("best", "averaged"):
        (tmp_path / f"{name}.pt").write_bytes(b"")
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.validation.json").write_text(json.dumps(scored))
    _pick_refused(_pick(tmp_path), f"{tmp_path / 'args.json'}: no such file")
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "chrf"}))
    _pick_refused(_pick(tmp_path), f"{tmp_path / 'best' / 'metrics.validation.json'}: no chrf score")
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "bleu"}))
    assert _pick(tmp_path).stdout.strip() == f"{tmp_path / 'best.pt'}\t1"
    (tmp_path / "averaged" / "metrics.validation.json").write_text(json.dumps(scored)[:20])  # cut short
    _pick_refused(_pick(tmp_path), f"{tmp_path / 'averaged' / 'metrics.validation.json'}:1: bad JSON")


@pytest.mark.parametrize("best_metric, averaged, picked", [
    ("bleu", {"bleu": 31.0, "loss": 2.0}, "averaged.pt"), ("bleu", {"bleu": 29.0, "loss": 1.0}, "best.pt"),
    ("bleu", {"bleu": 30.0, "loss": 1.0}, "best.pt"),  # a tie keeps best.pt
    ("loss", {"bleu": 31.0, "loss": 9.0}, "averaged.pt"),  # a loss-picked run's predictions are judged decoded
    ("loss", {"bleu": 29.0, "loss": 1.0}, "best.pt"), ("chrf", {"chrf": 56.0, "bleu": 1.0}, "averaged.pt")])
def test_pick_checkpoint_takes_the_average_only_when_it_scores_higher(tmp_path, best_metric, averaged, picked):
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": best_metric}))
    scored = {"n": 1014, "decoding": "beam4"}
    # best.pt's scores predate --min-len and --no-repeat-ngram (no such keys: results/multi30k-cpu-small-2100's):
    # the same decoding as 0
    for name, scores in (("best", {"bleu": 30.0, "chrf": 55.0, "loss": 1.5}),
                         ("averaged", {"min_len": 0, "no_repeat_ngram": 0, **averaged})):
        (tmp_path / f"{name}.pt").write_bytes(b"")
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.validation.json").write_text(json.dumps({**scored, **scores}))
    done = _pick(tmp_path)
    assert done.stdout.strip() == f"{tmp_path / picked}\t1", done.stderr
    assert re.search(r"best [\d.]+, averaged [\d.]+; length penalty 1$", done.stderr.strip()), done.stderr
    # a length penalty scored beside: it wins only with a higher score, and names its checkpoint
    metric = "chrf" if best_metric == "chrf" else "bleu"
    for lp, gain, won in (("1.6", 0.0, picked), ("1.3", 0.5, "best.pt")):
        (tmp_path / f"best-lp{lp}").mkdir()
        lp_scores = {**scored, "bleu": 30.0, "chrf": 55.0, "loss": 1.5, "length_penalty": float(lp)}
        lp_scores[metric] = max(30.0 if metric == "bleu" else 55.0, averaged.get(metric, 0.0)) + gain
        (tmp_path / f"best-lp{lp}" / "metrics.validation.json").write_text(json.dumps(lp_scores))
        done = _pick(tmp_path)
        assert done.stdout.strip() == f"{tmp_path / won}\t{lp if gain else 1}", done.stderr
    (tmp_path / "best.pt").rename(tmp_path / "best.pt.away")  # a candidate's scores without its checkpoint:
    _pick_refused(_pick(tmp_path), "no best.pt")  # not a candidate, and best.pt (kept without both) is not there
    (tmp_path / "best.pt.away").rename(tmp_path / "best.pt")
    for lp in ("1.6", "1.3"):
        shutil.rmtree(tmp_path / f"best-lp{lp}")
    # scored apart (another decoding): refused; no scores for the average: best.pt
    greedy = {**scored, **averaged, "decoding": "greedy"}
    (tmp_path / "averaged" / "metrics.validation.json").write_text(json.dumps(greedy))
    wrong = _pick(tmp_path)
    assert wrong.returncode != 0 and "scored differently (decoding)" in wrong.stderr
    (tmp_path / "averaged" / "metrics.validation.json").write_text(json.dumps({**scored, **averaged, "min_len": 40}))
    wrong = _pick(tmp_path)
    assert wrong.returncode != 0 and "scored differently (min_len)" in wrong.stderr
    (tmp_path / "averaged" / "metrics.validation.json").unlink()
    assert _pick(tmp_path).stdout.strip() == str(tmp_path / "best.pt")


def test_pick_checkpoint_takes_an_ensemble_only_when_it_scores_higher(tmp_path):
    """RUN/ensemble (several runs' checkpoints scored as one model) is a candidate after best.pt and
    the average: picked only on a higher score, and then its members are printed; an ensemble whose
    member is gone is no candidate, with a warning naming it (it was left out unsaid)."""
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "bleu"}))
    members = [tmp_path / "seed-0" / "averaged.pt", tmp_path / "seed-1" / "averaged.pt"]
    for path in members:
        path.parent.mkdir()
        path.write_bytes(b"")
    scored = {"n": 500, "decoding": "beam4", "no_repeat_ngram": 0}
    for name, bleu, lp in (("best", 30.0, 1.0), ("averaged", 30.5, 1.0), ("ensemble", 30.5, 1.0),
                           ("ensemble-lp1.6", 30.4, 1.6)):
        (tmp_path / name).mkdir()
        ckpt = [{"path": str(p), "step": 9} for p in members] if name.startswith("ensemble") else str(tmp_path / name)
        (tmp_path / name / "metrics.validation.json").write_text(
            json.dumps({**scored, "bleu": bleu, "length_penalty": lp, "checkpoint": ckpt}))
        if not name.startswith("ensemble"):
            (tmp_path / f"{name}.pt").write_bytes(b"")
    assert _pick(tmp_path).stdout.strip() == f"{tmp_path / 'averaged.pt'}\t1"  # a tie keeps the single model
    scores = json.loads((tmp_path / "ensemble-lp1.6" / "metrics.validation.json").read_text())
    (tmp_path / "ensemble-lp1.6" / "metrics.validation.json").write_text(json.dumps({**scores, "bleu": 31.0}))
    done = _pick(tmp_path)
    assert done.stdout.strip() == f"{members[0]} {members[1]}\t1.6", done.stderr
    assert "an ensemble of 2: validation bleu (beam4): best 30.00, averaged 30.50, ensemble 30.50, " \
           "ensemble-lp1.6 31.00" in done.stderr
    members[1].unlink()
    gone = _pick(tmp_path)  # named: its paths, as evaluate was given them, may be relative to another folder
    assert gone.stdout.strip() == f"{tmp_path / 'averaged.pt'}\t1"
    assert f"warning: {tmp_path / 'ensemble' / 'metrics.validation.json'} scores an ensemble whose checkpoints " \
           f"are not there (from " in gone.stderr and f"): {members[1]}; it is no candidate" in gone.stderr


def _scores(run, **by_name):
    """RUN/NAME/metrics.validation.json for each NAME=scores, and an empty RUN/NAME.pt beside it."""
    for name, scores in by_name.items():
        (run / name).mkdir()
        (run / name / "metrics.validation.json").write_text(json.dumps(scores))
        (run / f"{name}.pt").write_bytes(b"")


def test_pick_checkpoint_judges_a_perplexity_run_by_its_decoding_and_a_loss_alone_lowest_first(tmp_path):
    """--best-metric ppl is, like loss, teacher-forced: the predictions are judged decoded, so the
    higher BLEU wins though its perplexity is worse. Scores that decoded nothing (no decoding metric)
    are judged by the loss, where lower is better."""
    scored = {"n": 9, "decoding": "beam4"}
    ppl = tmp_path / "ppl"
    ppl.mkdir()
    (ppl / "args.json").write_text(json.dumps({"best_metric": "ppl"}))
    _scores(ppl, best={**scored, "bleu": 30.0, "ppl": 5.0, "loss": 1.6}, averaged={**scored, "bleu": 31.0, "ppl": 6.0,
                                                                                   "loss": 1.8})
    assert _pick(ppl).stdout.strip() == f"{ppl / 'averaged.pt'}\t1"
    loss = tmp_path / "loss"
    loss.mkdir()
    (loss / "args.json").write_text(json.dumps({"best_metric": "loss"}))
    _scores(loss, best={**scored, "loss": 2.0}, averaged={**scored, "loss": 1.5})
    done = _pick(loss)
    assert done.stdout.strip() == f"{loss / 'averaged.pt'}\t1" and "validation loss" in done.stderr, done.stderr


@pytest.mark.parametrize("key, best, averaged", [("n", 500, 1000), ("decoding", "beam4", "greedy"),
                                                 ("no_repeat_ngram", 0, 3), ("min_len", 0, 55)])
def test_pick_checkpoint_refuses_candidates_scored_on_other_examples_or_decodings(tmp_path, key, best, averaged):
    """Candidates are compared only when scored alike: on the same validation examples (`n`: an
    evaluate --limit 500 against a whole split is no comparison) and the same decoding; each
    difference is refused, naming what differs."""
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "bleu"}))
    scored = {"n": 500, "decoding": "beam4", "no_repeat_ngram": 0, "min_len": 0, "bleu": 30.0}
    _scores(tmp_path, best={**scored, key: best}, averaged={**scored, key: averaged, "bleu": 31.0})
    _pick_refused(_pick(tmp_path), f"the candidates of {tmp_path} were scored differently ({key})")


def test_pick_checkpoint_refuses_a_score_that_is_not_a_number(tmp_path):
    """A score of true (JSON's bool, which Python counts as the int 1) is no score: refused, naming the file."""
    (tmp_path / "args.json").write_text(json.dumps({"best_metric": "bleu"}))
    scored = {"n": 9, "decoding": "beam4"}
    _scores(tmp_path, best={**scored, "bleu": 30.0}, averaged={**scored, "bleu": True})
    _pick_refused(_pick(tmp_path), f"{tmp_path / 'averaged' / 'metrics.validation.json'}: no bleu score")


def test_the_same_weights_twice_are_refused(run, tmp_path):
    """A run's best.pt is the step file of its best step: the two were averaged with step 4 as
    "steps 6, 6, 4", step 6 weighing twice; a copy under another name the same."""
    steps = step_checkpoints(run)
    assert load_checkpoint(run / "best.pt")["progress"]["step"] == 6
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(run / 'best.pt'))} \(step 6\) and "
                                              rf"{re.escape(str(steps[-1]))} \(step 6\) hold the same weights"):
        average.main([str(run / "best.pt"), str(steps[-1]), str(steps[-2]), "--output", str(tmp_path / "b.pt")])
    shutil.copy(steps[0], tmp_path / "copy.pt")
    with pytest.raises(CheckpointError, match=r"copy.pt \(step 2\) hold the same weights.*count twice"):
        average.main([str(steps[0]), str(steps[1]), str(tmp_path / "copy.pt"), "--output", str(tmp_path / "b.pt")])
    assert not (tmp_path / "b.pt").exists()


def test_an_average_is_refused_among_the_checkpoints_to_average(run, tmp_path):
    """An average averaged again with step files weighed its steps unevenly, unsaid: avg(2, 4, 6)
    with 4 and 6 gave step 2 1/9 and step 6 4/9, recorded as "steps 6, 4, 6". Refused naming its
    steps; alone, it averages into itself."""
    steps = step_checkpoints(run)
    average.main([str(run), "--last", "3", "--output", str(tmp_path / "avg.pt")])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path / 'avg.pt'))} is itself the average of "
                                              r"steps 2, 4, 6: .* give its step checkpoints instead"):
        average.main([str(tmp_path / "avg.pt"), str(steps[1]), str(steps[2]), "--output", str(tmp_path / "b.pt")])
    assert not (tmp_path / "b.pt").exists()
    alone = average_checkpoints([tmp_path / "avg.pt"])["model"]
    assert all(torch.equal(v, load_checkpoint(tmp_path / "avg.pt")["model"][k]) for k, v in alone.items())


def test_an_output_folder_is_refused_before_the_averaging(run, tmp_path, monkeypatch):
    """--output DIR said "pass --overwrite", which then failed after every checkpoint was averaged."""
    monkeypatch.setattr(average, "average_checkpoints", lambda paths: pytest.fail("averaged before the refusal"))
    (tmp_path / "somedir").mkdir()
    steps = [str(p) for p in step_checkpoints(run)[-2:]]
    for flags in ([], ["--overwrite"]):
        with pytest.raises(cli.UsageError, match=r"--output .*somedir is a folder: name the checkpoint file"):
            average.main([*steps, "--output", str(tmp_path / "somedir"), *flags])
    (tmp_path / "file").write_text("x")
    with pytest.raises(cli.UsageError, match=r"file is a file, not a folder"):
        average.main([*steps, "--output", str(tmp_path / "file" / "avg.pt")])


def test_the_average_takes_the_newest_checkpoints_progress_and_folder(run, tmp_path):
    """`average A/step_6 B/step_2` took its progress (and args) from the last given, step 2, and wrote
    averaged.pt beside it, though --help says "the folder of the newest". Now the newest's, the highest
    step (a tie: the later given); the mean itself does not depend on the order."""
    steps = step_checkpoints(run)
    late, early = tmp_path / "late" / steps[2].name, tmp_path / "early" / steps[0].name
    for src, dst in ((steps[2], late), (steps[0], early)):
        dst.parent.mkdir()
        shutil.copy(src, dst)
    given = load_checkpoint(average.main([str(late), str(early), "--output", str(tmp_path / "given.pt")]))
    assert given["progress"]["step"] == 6 and given["args"] == load_checkpoint(late)["args"]
    out = average.main([str(late), str(early)])
    assert out == late.parent / "averaged.pt" and not (early.parent / "averaged.pt").exists()
    averaged = load_checkpoint(out)
    assert averaged["progress"] == load_checkpoint(late)["progress"] and averaged["progress"]["step"] == 6
    again = load_checkpoint(average.main([str(early), str(late), "--output", str(tmp_path / "again.pt")]))
    assert again["progress"] == averaged["progress"] and again["args"] == averaged["args"]
    assert all(torch.equal(v, again["model"][k]) for k, v in averaged["model"].items())
    tuned = load_checkpoint(late)  # the same step in a third folder: the later given is the newest
    tuned["model"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in tuned["model"].items()}
    save_checkpoint(tmp_path / "tie" / "tuned.pt", tuned)
    assert average.main([str(late), str(tmp_path / "tie" / "tuned.pt")]) == tmp_path / "tie" / "averaged.pt"
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(out))} exists; pass --overwrite"):
        average.main([str(early), str(late)])
    assert load_checkpoint(out)["averaged_from"] == averaged["averaged_from"]  # not replaced
