"""Run folders and training-loop safety: what train does with a bad --out, --overwrite, --resume,
an empty epoch, a corrupt last.pt, ablation names and out-of-range labels (docs/failures.md).
Every refusal names the problem and leaves the disk as it was."""

import csv
import datetime
import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scratchformer import ablate, average
from scratchformer import data as D
from scratchformer import train as T
from scratchformer.checkpoint import RESUME_KEYS, CheckpointError, load_checkpoint, save_checkpoint
from scratchformer.data.tokenizer import BPETokenizer, TokenizerPair
from scratchformer.device import DeviceError
from scratchformer.evaluation import plots
from scratchformer.locks import holder
from scratchformer.model import get_config
from scratchformer.training import ablation, launch
from scratchformer.training.ablation import best_variant, variant_folders
from scratchformer.training.build import (
    Examples,
    build_data,
    check_data_options,
    class_count,
    examples_id,
    load_data,
    make_tokenizers,
    model_config,
    run_split,
)
from scratchformer.training.config import ConfigError, parse_args
from scratchformer.training.distributed import Dist
from scratchformer.training.launch import _planned_model, _read_before_the_folder
from scratchformer.training.resume import load_resume_checkpoint
from scratchformer.training.runs import (
    LOCK,
    Logger,
    RunFolderError,
    carry_best,
    check_out,
    fresh_run_folder,
    lock_run_folder,
    release_run_folders,
    resume_folder,
    resumes_elsewhere,
)
from scratchformer.training.trainer import Trainer

_SILENT = SimpleNamespace(info=lambda line: None)  # a run's log, for the build steps that write to one
TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--vocab-size", "300",
        "--batch-size", "16", "--max-train-examples", "64", "--max-valid-examples", "16", "--eval-decode-examples", "8",
        "--beam-size", "2", "--log-every", "1", "--no-progress", "--no-plots", "--warmup-steps", "4"]


def _snapshot(root):
    """Every file under root: (bytes, mtime), so 'nothing changed' is checked exactly."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_bad_options_fail_before_any_folder_is_made(tmp_path):
    for flags, message in [(["--lr", "-1"], r"--lr must be"), (["--max-steps", "0"], r"--max-steps must be"),
                           (["--max-train-examples", "0"], r"--max-train-examples must be"),
                           (["--best-metric", "bogus"], r"--best-metric bogus: translation validation computes"),
                           (["--device", "cuda"] if not torch.cuda.is_available() else ["--grad-accum", "0"],
                            r"--device cuda: no CUDA device here|--grad-accum must be")]:
        with pytest.raises((ConfigError, DeviceError), match=message):
            T.main(TINY + flags + ["--out", str(tmp_path / "run")])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="--precision bf16 is refused only without a GPU")
def test_options_refused_on_the_device_leave_an_earlier_run_and_runs_latest_alone(tmp_path, monkeypatch):
    """A refusal that needs the device or the environment (--precision bf16 on a CPU, --tensorboard
    without the package) comes before --overwrite clears the earlier run and before a new dated
    folder becomes runs/latest (until 2026-12-01 both came after: the run's checkpoints were gone)."""
    monkeypatch.chdir(tmp_path)
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1"])  # runs/<date>, runs/latest
    latest = os.readlink(tmp_path / "runs" / "latest")
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)  # its import fails
    before = _snapshot(tmp_path)
    for flags, message in [(["--precision", "bf16"], r"--precision bf16 needs a GPU"),
                           (["--tensorboard"], r"--tensorboard needs the tensorboard package")]:
        for out in ([], ["--out", str(tmp_path / "runs" / latest), "--overwrite"]):
            with pytest.raises(ConfigError, match=message):
                T.main(TINY + ["--max-steps", "1"] + flags + out)
            assert _snapshot(tmp_path) == before and os.readlink(tmp_path / "runs" / "latest") == latest


def test_a_model_or_backend_refusal_leaves_an_earlier_run_as_it_was(tmp_path):
    """What building the model refuses (a head dim triton's attention does not run, from the options
    or an --init-from checkpoint; a preset's d_model that --heads does not divide) is refused before
    --overwrite clears the earlier run: until 2026-12-06 the model was built after, and the run's
    checkpoints, logs and predictions were gone when the error came."""
    from conftest import translation_folder

    data, run, other = ["--data", str(translation_folder(tmp_path))], tmp_path / "run", tmp_path / "hd20"
    T.main(TINY + data + ["--max-steps", "1", "--eval-every", "1", "--out", str(run)])
    T.main(TINY + data + ["--d-model", "40", "--max-steps", "1", "--kernel", "eager", "--out", str(other)])
    before = _snapshot(run)
    triton = r"the triton backend's attention runs head dim 16, 32, 64, 128, not 20 \(d_model / heads\)"
    for flags, message in [(TINY + ["--d-model", "40", "--kernel", "triton"], triton),
                           (["--init-from", str(other), "--kernel", "triton", "--no-progress"], triton),
                           ([f for f in TINY if f not in ("--d-model", "32")] + ["--preset", "tiny", "--heads", "3"],
                            r"d_model \(256\) must be divisible by n_heads \(3\)")]:
        with pytest.raises(ValueError, match=message):
            T.main(flags + data + ["--max-steps", "1", "--out", str(run), "--overwrite"])
        assert _snapshot(run) == before


def test_out_naming_a_file_is_refused(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    before = _snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=r"--out .*notes.txt is a file, not a folder"):
        T.main(TINY + ["--max-steps", "1", "--out", str(f)])
    assert _snapshot(tmp_path) == before


def test_overwrite_deletes_only_run_files_and_refuses_foreign_ones(tmp_path):
    """A user's metrics.py in --out survives: --overwrite refuses the folder, naming the file."""
    run = tmp_path / "d"
    run.mkdir()
    (run / "metrics.py").write_text("print('my own code')\n")
    before = _snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=r"--out .*d holds metrics.py, which no run wrote; --overwrite deletes "
                       r"only run files"):
        T.main(TINY + ["--max-steps", "1", "--out", str(run), "--overwrite"])
    assert _snapshot(tmp_path) == before
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(run)])  # a new run beside it: allowed
    (run / "plots").mkdir(exist_ok=True)
    (run / "plots" / "mine.png").write_bytes(b"png")
    before = _snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=r"holds metrics.py, plots/mine.png, which no run wrote"):
        T.main(TINY + ["--max-steps", "1", "--out", str(run), "--overwrite"])
    assert _snapshot(tmp_path) == before
    assert (run / "metrics.py").read_text() == "print('my own code')\n"


def test_a_runs_average_is_a_run_file_which_overwrite_deletes_with_the_run(tmp_path):
    """README's workflow: `average RUN --last N` writes RUN/averaged.pt; then `train --out RUN` again.
    Without --overwrite the folder is refused as holding a run (averaged.pt named); with it, the
    average goes with the run's other files (it was refused as a file "no run wrote"; kept, it would
    be an old run's weights beside the new run's)."""
    run = tmp_path / "m30k"
    T.main(TINY + ["--max-steps", "4", "--save-every", "2", "--eval-every", "4", "--no-plots", "--out", str(run)])
    average.main([str(run), "--last", "2"])
    assert (run / "averaged.pt").is_file()
    with pytest.raises(RunFolderError, match=r"already holds a training run \(last\.pt, best\.pt, .*averaged\.pt"):
        T.main(TINY + ["--max-steps", "1", "--out", str(run)])
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--no-plots", "--out", str(run), "--overwrite"])
    assert not (run / "averaged.pt").exists() and load_checkpoint(run / "last.pt")["progress"]["step"] == 1


def test_a_run_that_failed_before_training_does_not_block_its_folder(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("the model could not be built")

    run = tmp_path / "run"
    monkeypatch.setattr(launch, "build_model", boom)  # fails after the folder got its log and tokenizer
    with pytest.raises(RuntimeError, match="could not be built"):
        T.main(TINY + ["--out", str(run)])
    monkeypatch.undo()
    assert (run / "log.txt").exists() and (run / "tokenizer.json").exists() and not (run / "last.pt").exists()
    (run / "log.txt").write_text("the failed run's log\n")
    (run / "notes.txt").write_text("kept")
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(run)])  # same --out: accepted
    assert load_checkpoint(run / "last.pt")["progress"]["step"] == 1
    assert "the failed run's log" not in (run / "log.txt").read_text()  # the failed run's log went
    assert (run / "notes.txt").read_text() == "kept"


def test_overwrite_with_the_folders_own_tokenizer_reads_it_before_clearing(tmp_path):
    """--tokenizer RUN/tokenizer.json --out RUN --overwrite: the file is read before --overwrite deletes
    the run's files (until 2026-12-01 the checkpoints were deleted first, then the tokenizer was not
    found: the old run gone and no new one). A missing --tokenizer leaves the folder as it was."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(run)])
    vocab = (run / "tokenizer.json").read_text()
    before = _snapshot(tmp_path)
    tiny = [f for f in TINY if f not in ("--vocab-size", "300")]  # a reused tokenizer has its vocabulary
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*nope.json does not exist"):
        T.main(tiny + ["--max-steps", "1", "--tokenizer", str(tmp_path / "nope.json"), "--out", str(run),
                       "--overwrite"])
    assert _snapshot(tmp_path) == before
    reuse = tiny + ["--tokenizer", str(run / "tokenizer.json")]
    with pytest.raises(ConfigError, match=r"--tokenizer .*tokenizer.json reuses trained tokenizers .*: drop "
                       r"--vocab-size, --tokenizer-examples, --separate-vocab, which train a new one"):
        T.main(reuse + ["--vocab-size", "500", "--tokenizer-examples", "9", "--separate-vocab", "--out", str(run)])
    assert _snapshot(tmp_path) == before
    T.main(reuse + ["--max-steps", "2", "--eval-every", "1", "--out", str(run), "--overwrite"])
    assert load_checkpoint(run / "last.pt")["progress"]["step"] == 2
    assert (run / "tokenizer.json").read_text() == vocab
    assert "tokenizer: reused" in (run / "log.txt").read_text()
    assert json.loads((run / "args.json").read_text())["vocab_size"] is None  # the file's, not a default's 8000


def test_a_folder_holding_results_without_checkpoints_is_refused_not_overwritten(tmp_path):
    """evaluate --out E leaves predictions.validation.jsonl and metrics.validation.json (no checkpoint);
    train --out E used to start there and replace the evaluation's predictions with its own final
    report's, leaving the evaluation's metrics beside them. Refused unless --overwrite."""
    folder = tmp_path / "E"
    folder.mkdir()
    (folder / "predictions.validation.jsonl").write_text('{"id": 0, "prediction": "theirs"}\n')
    (folder / "metrics.validation.json").write_text('{"bleu": 1.0}\n')
    (folder / "log.txt").write_text("a stopped run's log\n")
    before = _snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=r"--out .*E already holds the results of an earlier run or evaluation "
                       r"\(metrics.validation.json, predictions.validation.jsonl\), which this run would replace; "
                       r"pass --overwrite to replace them, or another --out"):
        T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(folder)])
    assert _snapshot(tmp_path) == before
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(folder), "--overwrite"])
    assert not (folder / "metrics.validation.json").exists()
    assert "theirs" not in (folder / "predictions.validation.jsonl").read_text()


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_temp_files_of_a_killed_write_are_run_files(tmp_path, overwrite):
    """A kill mid-write leaves write_lines_atomic's .NAME.PID.tmp or a tokenizer's NAME.tmp: run
    files, deleted with the stopped run's (or by --overwrite), not 'files no run wrote' (which made
    --overwrite refuse the folder, the GPU recipe's fallback included)."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("log.txt", ".args.json.4242.tmp", "tokenizer.json.tmp"):
        (run / name).write_text("cut short")
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(run), *overwrite])
    assert not (run / ".args.json.4242.tmp").exists() and not (run / "tokenizer.json.tmp").exists()
    (run / ".metrics.final.json.4242.tmp").write_text("cut short")
    (run / ".evaluate.validation.lock").write_text("4242")  # the free lock of a killed evaluate
    # and a plot's (evaluate's attention map, the run's curves): "files no run wrote" until 2026-12-07
    plots = [run / ".attention.validation.0.png.4242.tmp", run / "plots" / ".curves.png.4242.tmp",
             run / "plots" / ".attention.png.4242.tmp"]
    (run / "plots").mkdir(exist_ok=True)
    for path in plots:
        path.write_bytes(b"cut short")
    with pytest.raises(RunFolderError, match="already holds a training run"):
        T.main(TINY + ["--max-steps", "1", "--out", str(run)])
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(run), "--overwrite"])
    assert not (run / ".metrics.final.json.4242.tmp").exists() and not (run / ".evaluate.validation.lock").exists()
    assert not any(path.exists() for path in plots)


def test_a_data_error_leaves_an_earlier_run_and_runs_latest_alone(tmp_path, monkeypatch):
    """The examples are read (and every label checked) before the run folder is made or cleared:
    --overwrite with a damaged data file used to delete the earlier run's checkpoints, then stop on
    the file's bad line, leaving neither run; without --out a dated folder became runs/latest."""
    monkeypatch.chdir(tmp_path)
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1"])  # runs/<date>, runs/latest
    latest = os.readlink(tmp_path / "runs" / "latest")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"src": "a", "tgt": "b"}\n{"src": "a"}\n')
    before = _snapshot(tmp_path)
    for out in ([], ["--out", str(tmp_path / "runs" / latest), "--overwrite"]):
        with pytest.raises(D.DataError, match=r"train.jsonl:2: missing field 'tgt'"):
            T.main(TINY + ["--max-steps", "1", "--data", str(bad), "--task", "translation", *out])
        assert _snapshot(tmp_path) == before and os.readlink(tmp_path / "runs" / "latest") == latest


def test_an_epoch_without_a_batch_is_an_error_not_a_hang(tmp_path):
    cfg, _ = parse_args(TINY + ["--eval-every", "2"])
    cfg = cfg.resolved("translation", synthetic=True)
    log = Logger(tmp_path, enabled=False)
    data = build_data(cfg, D.resolve_source("synthetic"), tmp_path, Dist(), log)
    mcfg = model_config(cfg, data)
    data.train_set = D.EncodedDataset([], [], "translation")  # every example filtered away
    with pytest.raises(D.DataError, match=r"no training batch: 0 training examples"):
        Trainer(cfg, torch.nn.Linear(1, 1), data, model_config=mcfg, out=tmp_path, device=torch.device("cpu"), log=log)


def test_resume_refuses_model_flags_and_args_json_stays_true(tmp_path):
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--schedule", "constant", "--out", str(run)])
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"--d-model 128 \(the run has 32\); --heads 8 \(the run has 2\) cannot "
                       r"change"):
        T.main(["--resume", "--out", str(run), "--d-model", "128", "--heads", "8", "--max-steps", "6"])
    assert _snapshot(tmp_path) == before
    # what may change does, and args.json says so: the new peak lr is the one used
    T.main(["--resume", "--out", str(run), "--lr", "1e-4", "--max-steps", "6", "--no-progress", "--no-plots"])
    args = json.loads((run / "args.json").read_text())
    assert (args["lr"], args["max_steps"], args["d_model"], args["heads"]) == (1e-4, 6, 32, 2)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r["split"] == "train"}
    assert lrs[4] == pytest.approx(2e-3) and lrs[5] == lrs[6] == pytest.approx(1e-4)


def test_a_resume_writes_the_run_folders_tokenizer_files_back_from_its_checkpoint(tmp_path):
    """The tokenizer files a run keeps beside its checkpoints (for a next run's --tokenizer) are the
    checkpoint's again after a --resume: a damaged or deleted one stayed so."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "2", "--eval-every", "2", "--out", str(run)])
    kept = (run / "tokenizer.json").read_text()
    assert kept == load_checkpoint(run / "last.pt")["tokenizers"]["src"]
    (run / "tokenizer.json").write_text(kept[: len(kept) // 2])  # cut short
    T.main(["--resume", "--out", str(run), "--max-steps", "3", "--no-progress", "--no-plots"])
    assert (run / "tokenizer.json").read_text() == kept
    (run / "tokenizer.json").unlink()
    T.main(["--resume", "--out", str(run), "--max-steps", "4", "--no-progress", "--no-plots"])
    assert (run / "tokenizer.json").read_text() == kept


def test_final_last_pt_holds_the_final_validation(tmp_path):
    """--save-every 2 saves step 4 before the final validation at step 4: last.pt is written again
    after it, so its best is current, and resuming with a larger --max-steps and a worse model
    (a diverging lr) leaves best.pt alone."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "3", "--save-every", "2", "--out", str(run)])
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in valid if r["split"] == "valid"]
    assert [r["step"] for r in valid] == [3, 4] and valid[1]["loss"] < valid[0]["loss"]
    last, best = load_checkpoint(run / "last.pt")["progress"], load_checkpoint(run / "best.pt")["progress"]
    assert last["step"] == 4 and (last["best_step"], last["best"]) == (4, valid[1]["loss"]) == (best["best_step"],
                                                                                               best["best"])
    best_bytes = (run / "best.pt").read_bytes()
    T.main(["--resume", "--out", str(run), "--max-steps", "6", "--lr", "30", "--eval-every", "1", "--no-progress",
            "--no-plots"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] > valid[1]["loss"] for r in rows if r["split"] == "valid" and r["step"] > 4] == [True, True]
    assert (run / "best.pt").read_bytes() == best_bytes
    assert load_checkpoint(run / "last.pt")["progress"]["best_step"] == 4


def test_corrupt_last_pt_falls_back_to_the_newest_intact_step_file(tmp_path, capsys):
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "4", "--eval-every", "2", "--out", str(run)])
    for name in ("last.pt", "step_0000004.pt"):
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: len(data) // 2])  # truncated
    capsys.readouterr()
    T.main(["--resume", "--out", str(run), "--max-steps", "5", "--no-progress", "--no-plots"])
    out = capsys.readouterr().out
    assert f"warning: {run / 'last.pt'} is unreadable" in out and "is truncated" in out
    assert f"resuming from {run / 'step_0000002.pt'}, the newest intact step checkpoint" in out
    ck = load_checkpoint(run / "last.pt")
    assert ck["progress"]["step"] == 5 and ck["args"]["resume_path"] == str(run / "step_0000002.pt")
    train_steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
                   if json.loads(x)["split"] == "train"]
    assert train_steps == [1, 2, 3, 4, 5]  # rows after step 2 were logged again by the resumed run, once
    for p in [run / "last.pt", *run.glob("step_*.pt")]:
        p.write_bytes(b"junk")
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"last.pt is not a scratchformer checkpoint.*no intact step_\*.pt"):
        T.main(["--resume", "--out", str(run), "--max-steps", "6", "--no-progress"])
    assert _snapshot(tmp_path) == before


def test_ablation_json_is_written_atomically(tmp_path, monkeypatch):
    """A full disk while the grid writes ablation.json leaves the previous summary whole (the GPU
    recipe reads its "best"); it was a plain write_text, which truncated it first."""
    import builtins
    import errno
    import io

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"split": "valid", "step": 1, "loss": 2.0}\n')
    monkeypatch.setattr(ablation, "run_in_turn", lambda planned, shared, deadline: [{"loss": 2.0, "exact_match": 5.0}])
    monkeypatch.setattr(plots, "plot_ablation", lambda *a, **k: None)
    ablation.run_grid(tmp_path, ["a="], TINY)
    summary = (tmp_path / "ablation.json").read_text()
    assert json.loads(summary)["best"] == "a"

    real_open = builtins.open

    def full_disk(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if "w" not in mode or "ablation.json" not in str(file):
            return f
        write = f.write

        def fail(data):
            write(data[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        f.write = fail
        return f

    monkeypatch.setattr(builtins, "open", full_disk)
    monkeypatch.setattr(io, "open", full_disk)  # Path.write_text's
    with pytest.raises(OSError, match="No space left on device"):
        ablation.run_grid(tmp_path, ["a="], TINY)
    monkeypatch.undo()
    assert (tmp_path / "ablation.json").read_text() == summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "ablation.json"]


def test_ablation_variant_names_stay_inside_out(tmp_path):
    out = tmp_path / "ab"
    for spec, message in [("..=", r"variant name '\.\.' makes no folder name"),
                          ("=", r"variant name '' makes no folder name"),
                          ("/=", r"variant name '/' makes no folder name"),
                          ("a=--heads 0", r"--heads must be an integer >= 1, got 0"),
                          ("noequals", r"must look like NAME=FLAGS")]:
        with pytest.raises(ConfigError, match=message):
            ablate.main(["--out", str(out), "--variants", "ok=", spec, "--", *TINY, "--max-steps", "1"])
    with pytest.raises(ConfigError, match=r"--metric blue: variant 'ok' trains translation, whose final report has "
                       r"loss, ppl, bleu"):  # it trained every variant, then named the first one best of NaNs
        ablate.main(["--out", str(out), "--variants", "ok=", "--metric", "blue", "--", *TINY, "--max-steps", "1"])
    assert list(tmp_path.iterdir()) == []  # refused before the first run: nothing written anywhere
    nan = float("nan")
    assert best_variant([{"folder": "a", "final": {"bleu": nan}}, {"folder": "b", "final": {}}], "bleu") is None
    assert best_variant([{"folder": "a", "final": {"loss": nan}}, {"folder": "b", "final": {"loss": 3.0}}],
                        "loss") == "b"
    with pytest.raises(ConfigError, match=r"variants 'a b' and 'a/b' would share the folder"):
        variant_folders(out, ["a b=", "a/b="], [])
    planned = variant_folders(out, ["../x=", "a/../../b=--norm pre", ".hidden="], [])
    assert [v.folder for v in planned] == [out / "x", out / "a-..-..-b", out / "hidden"]
    assert all(os.path.dirname(v.folder) == str(out) for v in planned)


def _classification_folder(root, labels, meta_labels=None):
    d = root / "clf"
    d.mkdir()
    rows = [{"text": f"text number {i} " + "good " * (i % 3), "label": lab} for i, lab in enumerate(labels)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    meta = {"task": "classification", **({"labels": meta_labels} if meta_labels else {})}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_a_huge_label_is_refused_before_a_head_is_built(tmp_path):
    d = _classification_folder(tmp_path, [0, 1] * 8 + [100_000_000] + [1, 0])
    with pytest.raises(D.DataError, match=rf"{d / 'train.jsonl'}, example 17: label 100000000 is not a known class: "
                       r"without a label list in meta.json .* \(3 distinct seen, so at most 5\)"):
        T.main(["--data", str(d), "--out", str(tmp_path / "run"), "--no-progress", "--max-steps", "1"])
    assert not (tmp_path / "run" / "tokenizer.json").exists()  # refused before the tokenizer was trained


def test_a_start_checkpoint_of_other_classes_or_processes_is_refused_before_the_folder(tmp_path):
    """--init-from a classifier of another class count, and --resume with another number of processes
    than wrote the checkpoint, are refused naming both counts, before --overwrite clears the run
    there (the class count was checked once the folder was cleared; a resume under another world
    size crashed in set_rng_state, or with fewer processes silently trained batches twice)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    two = _classification_folder(tmp_path / "a", [0, 1] * 9)
    three = _classification_folder(tmp_path / "b", [0, 1, 2] * 6)
    flags = ["--max-steps", "1", "--eval-every", "1", "--no-progress", "--no-plots", "--d-model", "32", "--heads",
             "2", "--layers", "1", "--d-ff", "64", "--vocab-size", "300"]
    T.main(["--data", str(two), "--out", str(tmp_path / "clf2"), *flags])
    T.main(["--data", str(three), "--out", str(tmp_path / "clf3"), *flags])
    before = _snapshot(tmp_path / "clf3")
    with pytest.raises(ConfigError, match=r"--init-from .*clf2.best\.pt classifies into 2 classes; the data has 3"):
        T.main(["--data", str(three), "--out", str(tmp_path / "clf3"), "--overwrite", "--init-from",
                str(tmp_path / "clf2"), "--max-steps", "1", "--no-progress"])
    assert _snapshot(tmp_path / "clf3") == before
    last = tmp_path / "clf3" / "last.pt"
    ck = load_checkpoint(last)
    ck["rng"] = [ck["rng"], ck["rng"]]  # as two DDP processes write it
    save_checkpoint(last, ck)
    before = _snapshot(tmp_path / "clf3")
    with pytest.raises(ConfigError, match=r"--resume .*last\.pt was written by 2 processes and this run has 1: .*"
                       r"resume with torchrun --nproc_per_node 2, or start a new run from its weights"):
        T.main(["--resume", "--out", str(tmp_path / "clf3"), "--max-steps", "2"])
    assert _snapshot(tmp_path / "clf3") == before


def test_a_resume_under_more_processes_is_refused_and_init_from_takes_a_ddp_checkpoint(tmp_path, monkeypatch):
    """--resume of a run one process wrote, under torchrun with 2 (the set-up stand-in: rank 0 of 2,
    given the run's --device), is refused naming both counts before anything is written: rank 1 would
    set rank 0's RNG states, or none. --init-from takes a checkpoint 2 processes wrote, in one process:
    a new run keeps its weights only."""
    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "1", "--out", str(run)])
    before, devices = _snapshot(run), []

    def two_processes(device):
        devices.append(device)
        return Dist(rank=0, world=2), torch.device("cpu")

    with monkeypatch.context() as m:
        m.setattr("scratchformer.training.launch.setup_distributed", two_processes)
        with pytest.raises(ConfigError, match=r"--resume .*last\.pt was written by 1 process and this run has 2: .*"
                           r"resume with one process \(no torchrun\), or start a new run from its weights"):
            T.main(["--resume", "--out", str(run), "--max-steps", "2", "--device", "cpu"])
    assert devices == ["cpu"] and _snapshot(run) == before
    ck = load_checkpoint(run / "last.pt")
    ck["rng"] = [ck["rng"], ck["rng"]]  # as two DDP processes write it
    save_checkpoint(run / "last.pt", ck)
    T.main(["--init-from", str(run / "last.pt"), *TINY[TINY.index("--batch-size"):], "--max-steps", "1", "--out",
            str(tmp_path / "new")])
    assert load_checkpoint(tmp_path / "new" / "last.pt")["rng"]["seed"] == 0  # one process's states


def test_init_from_records_and_checks_the_model_of_its_checkpoint(tmp_path):
    """--init-from builds the checkpoint's model: its args.json records that model's options and
    vocabulary (it recorded the data's defaults: d_model 64, vocab_size 400 for a 32-wide model of
    300 tokens), and --rdrop is checked against its dropout (a model trained with --dropout 0 took
    --rdrop 5, which then changed nothing at twice the cost)."""
    start, new = tmp_path / "start", tmp_path / "new"
    T.main(TINY + ["--dropout", "0", "--max-steps", "1", "--out", str(start)])
    rest = [*TINY[TINY.index("--batch-size"):], "--max-steps", "1"]
    with pytest.raises(ConfigError, match=r"--rdrop 5 compares two dropout masks; with --dropout 0"):
        T.main(["--init-from", str(start), "--rdrop", "5", *rest, "--out", str(new)])
    assert not new.exists()
    T.main(["--init-from", str(start), *rest, "--out", str(new)])
    args, source = (json.loads((run / "args.json").read_text()) for run in (new, start))
    model = ("preset", "d_model", "heads", "layers", "d_ff", "dropout", "vocab_size", "separate_vocab")
    assert {k: args[k] for k in model} == {k: source[k] for k in model}
    assert (args["d_model"], args["vocab_size"], args["dropout"]) == (32, 300, 0.0)


def test_a_resume_over_other_training_data_and_an_attention_example_past_validation_are_refused(tmp_path):
    """The checkpoint records its training examples (their number and a digest): a resume after they
    changed on disk is refused naming both counts, before anything is written (it went on silently,
    its place in the epoch counting batches of the old examples). The same number of other examples
    too. An --attention-example past the validation split is refused before training (it was clamped
    to the last example, unsaid)."""
    from conftest import translation_folder

    data, run = translation_folder(tmp_path), tmp_path / "run"
    flags = TINY + ["--data", str(data), "--eval-every", "1"]
    with pytest.raises(ConfigError, match=r"--attention-example 12: the validation split has 12 examples \(0 to 11\)"):
        T.main([f for f in flags if f != "--no-plots"] + ["--attention-example", "12", "--out", str(run)])
    assert not run.exists()
    T.main(flags + ["--max-steps", "2", "--out", str(run)])
    assert load_checkpoint(run / "last.pt")["train_data"]["examples"] == 48
    train = data / "train.jsonl.gz"
    rows = gzip.decompress(train.read_bytes()).decode().splitlines()
    before = _snapshot(run)
    for changed, now in [(rows[:30], "30 examples"), (rows[:-1] + [rows[0]], "other contents")]:
        train.write_bytes(gzip.compress("\n".join(changed).encode()))
        with pytest.raises(ConfigError, match=rf"--resume .*last\.pt: the training data changed since that checkpoint "
                           rf"\(48 examples then, {now} now\).* start a new run from its weights with --init-from"):
            T.main(["--resume", "--out", str(run), "--max-steps", "4"])
        assert _snapshot(run) == before
    train.write_bytes(gzip.compress("\n".join(rows).encode()))  # restored: it resumes
    T.main(["--resume", "--out", str(run), "--max-steps", "3", "--no-progress", "--no-plots"])
    assert load_checkpoint(run / "last.pt")["progress"]["step"] == 3


def test_an_attention_example_is_checked_only_for_the_plots_that_draw_it(tmp_path):
    """--attention-example picks the validation example plots/attention.png draws: past the split it is
    refused when plots are drawn (the checks a run makes before its folder: `_read_before_the_folder`);
    with --no-plots (TINY's) nothing draws it: the split's size is no reason to refuse a run, but the
    flag given with --no-plots is refused as doing nothing, before the run folder is made."""
    cfg, given = parse_args(TINY + ["--attention-example", "16"])
    source = D.resolve_source(cfg.dataset, cfg.data, cfg.task)
    assert len(_read_before_the_folder(cfg.resolved(source.task, True), source, None, frozenset(), torch.device("cpu"))
               [1].valid) == 16
    with pytest.raises(ConfigError, match=r"--attention-example picks the example plots/attention.png draws, and "
                                          r"--no-plots draws none: drop one"):
        T.main(TINY + ["--attention-example", "16", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
    cfg, given = parse_args([f for f in TINY if f != "--no-plots"] + ["--attention-example", "16"])
    with pytest.raises(ConfigError, match=r"--attention-example 16: the validation split has 16 examples"):
        _read_before_the_folder(cfg.resolved(source.task, True), source, None, given, torch.device("cpu"))


def test_a_run_started_from_a_checkpoint_keeps_its_kernel_unless_kernel_is_given():
    """A resumed run, or one started --init-from a checkpoint, builds the checkpoint's model: its --kernel
    too (torch here), not this command's default ("auto"); a --kernel given replaces it (`_planned_model`).
    --init-from's model admits this run's batches: max_len at least the longest position (here 4161)."""
    start = {"config": get_config("tiny", kernel="torch", max_len=64).to_dict()}
    for flags, kernel in (([], "torch"), (["--kernel", "eager"], "eager")):
        cfg, given = parse_args(TINY + ["--init-from", "x.pt", "--max-src-len", "4160", *flags])
        planned = _planned_model(cfg.resolved("translation", True), "translation", start, given, None, None)
        assert (planned.kernel, planned.max_len) == (kernel, 4161)
        cfg, given = parse_args(["--resume", "x.pt", *flags])
        assert _planned_model(cfg, "translation", start, given, None, None).kernel == kernel


def test_the_record_of_a_runs_examples_changes_with_any_example_its_id_or_their_order():
    """`examples_id`, what a checkpoint records of its examples for a resume to check: their number and
    a digest of each one's source, target and id, in order. Equal examples give an equal record; a
    changed target, id (a prediction file names examples by it), order or count gives another."""
    ex = [D.Example("one two", "eins zwei", id="a"), D.Example("red", 1, id="b")]
    same = examples_id([D.Example("one two", "eins zwei", id="a"), D.Example("red", 1, id="b")])
    assert examples_id(ex) == same and same["examples"] == 2
    for other in ([ex[0], D.Example("red", 2, id="b")], [ex[0], D.Example("red", 1, id="c")],
                  [ex[0], D.Example("red", 1)], ex[::-1], ex[:1]):
        assert examples_id(other) != same, other


def test_a_carved_validation_split_is_the_same_for_training_and_evaluation(tmp_path):
    """Data without a validation split: training carves --valid-fraction of its first --max-train-examples
    with --seed, keeps --max-valid-examples of them, and evaluation's `run_split` carves the very same
    examples again (another seed, or a carve of the whole file, would score other examples, some of
    them trained on). With a validation split of its own, its first --max-valid-examples."""
    d = tmp_path / "mt"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"src": f"s {i}", "tgt": f"t {i}"}) + "\n" for i in range(40)))
    cfg, _ = parse_args(["--data", str(d), "--task", "translation", "--seed", "3", "--max-train-examples", "30",
                         "--max-valid-examples", "2", "--valid-fraction", "0.2"])
    source = D.resolve_source(cfg.dataset, cfg.data, cfg.task)
    cfg = cfg.resolved(source.task, False)
    train, valid = load_data(cfg, source, _SILENT)
    first = D.load_split(source, "train")[:30]
    kept, carved = D.carve_validation(first, 0.2, 3)
    assert (train, valid) == (kept, carved[:2]) and len(carved) == 6
    assert D.carve_validation(first, 0.2, 0)[1][:2] != valid  # seed 3 carves other examples than seed 0
    assert run_split(source, "validation", cfg, limit=2) == valid
    # the folder's own validation split: the first --max-valid-examples of it; a damaged one is an error (not
    # replaced by a carve of train)
    rows = [json.dumps({"src": f"v {i}", "tgt": f"w {i}"}) for i in range(5)]
    (d / "validation.jsonl").write_text("\n".join(rows) + "\n")
    assert load_data(cfg, source, _SILENT)[1] == D.load_split(source, "validation")[:2]
    (d / "validation.jsonl").write_text('{"src": "v 0"}\n')
    with pytest.raises(D.DataError, match=r"validation\.jsonl:1: missing field 'tgt'"):
        load_data(cfg, source, _SILENT)


def test_data_options_that_would_do_nothing_are_refused_before_anything_is_written(tmp_path):
    """--valid-fraction for data with a validation split of its own (the synthetic task's included), and
    --synthetic-seed for data that is not the synthetic task: each did nothing, and args.json recorded it
    as if it had. Refused by name before the run folder is made; without the validation split, the carve
    is --valid-fraction's."""
    d = tmp_path / "mt"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"src": f"s {i}", "tgt": f"t {i}"}) + "\n" for i in range(40)))
    (d / "validation.jsonl").write_text(json.dumps({"src": "v", "tgt": "w"}) + "\n")
    out = tmp_path / "run"
    for argv, pattern in (
            (["--data", str(d), "--valid-fraction", "0.2"], rf"^--valid-fraction carves .* {d.name} has a validation "
                                                           r"split of its own: drop it$"),
            (["--valid-fraction", "0.2"], r"^--valid-fraction carves .* synthetic has a validation split of its own"),
            (["--data", str(d), "--synthetic-seed", "7"], rf"^--synthetic-seed draws the synthetic task's corpus; this "
                                                         rf"run reads {d.name}: drop it$")):
        with pytest.raises(ConfigError, match=pattern):
            T.main([*argv, "--task", "translation", "--out", str(out), "--max-steps", "1"])
        assert not out.exists()
    (d / "validation.jsonl").unlink()
    cfg, _ = parse_args(["--data", str(d), "--task", "translation", "--valid-fraction", "0.25"])
    check_data_options(D.resolve_source(cfg.dataset, cfg.data, cfg.task), frozenset({"valid_fraction"}))


def test_a_carved_validation_split_whose_examples_share_an_id_is_refused(tmp_path):
    """A validation split carved from train is written by id like any other (predictions.validation.jsonl):
    two carved examples sharing an id are a DataError naming the train file and the id, in training's
    `load_data` and evaluation's `run_split` alike. Train alone is read as given, repeated ids and all."""
    d = tmp_path / "mt"
    d.mkdir()
    rows = [{"id": f"doc{i % 5}", "src": f"s {i}", "tgt": f"t {i}"} for i in range(40)]  # 20 carved, 5 ids
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, _ = parse_args(["--data", str(d), "--task", "translation", "--seed", "3", "--valid-fraction", "0.5"])
    source = D.resolve_source(cfg.dataset, cfg.data, cfg.task)
    cfg = cfg.resolved(source.task, False)
    assert len(D.load_split(source, "train")) == 40
    pattern = rf"{d / 'train.jsonl'}, the validation examples carved from it: examples \d+ and \d+ .* share the id"
    with pytest.raises(D.DataError, match=pattern):
        load_data(cfg, source, _SILENT)
    with pytest.raises(D.DataError, match=pattern):
        run_split(source, "validation", cfg)
    # distinct ids (and none at all: validation-<i>) carve as before
    (d / "train.jsonl").write_text("".join(json.dumps({**r, "id": f"doc{i}"}) + "\n" for i, r in enumerate(rows)))
    assert len(load_data(cfg, source, _SILENT)[1]) == 20 == len(run_split(source, "validation", cfg))


def test_a_tokenizer_is_trained_on_the_first_tokenizer_examples_and_an_encoder_only_task_shares_one(tmp_path):
    """--tokenizer-examples N trains the BPE on the first N training examples only (both sides, shared),
    as `BPETokenizer.train` does given them; a classifier (no target text) trains one tokenizer on its
    sources, --separate-vocab or not."""
    train = [D.Example(f"word{i} " * 3 + "common", f"wort{i} gemein") for i in range(12)]
    cfg, _ = parse_args(["--vocab-size", "300", "--tokenizer-examples", "3"])
    toks = make_tokenizers(cfg, "translation", train, tmp_path, Dist(), _SILENT)
    want = BPETokenizer.train(D.texts_for_tokenizer(train[:3], "both"), 300)
    assert toks.shared and toks.src.to_str() == want.to_str()
    assert want.to_str() != BPETokenizer.train(D.texts_for_tokenizer(train, "both"), 300).to_str()
    labelled = [D.Example(e.src, i % 2) for i, e in enumerate(train)]
    cfg, _ = parse_args(["--vocab-size", "300", "--separate-vocab"])
    toks = make_tokenizers(cfg, "classification", labelled, tmp_path, Dist(), _SILENT)
    assert toks.shared and toks.src.to_str() == BPETokenizer.train(D.texts_for_tokenizer(labelled, "src"), 300).to_str()


def test_a_resume_is_refused_what_changes_the_validation_its_best_is_compared_in(tmp_path):
    """A resume scored later validations on other examples than best.pt's (--max-valid-examples, an
    edited validation file; with a decoding best metric, --eval-decode-examples) and compared them with
    it: best.pt, the final report and --patience acted on incomparable numbers. Those changes are now
    refused, naming the option or both counts; what does not change the best's numbers still resumes,
    and a checkpoint without the validation record (older) resumes unchecked."""
    from conftest import translation_folder

    data, run, loss_run = translation_folder(tmp_path), tmp_path / "run", tmp_path / "loss"
    flags = TINY + ["--data", str(data), "--eval-every", "1", "--max-steps", "2"]
    T.main(flags + ["--best-metric", "chrf", "--out", str(run)])
    T.main(flags + ["--out", str(loss_run)])
    assert load_checkpoint(run / "last.pt")["valid_data"]["examples"] == 12
    before = _snapshot(run)
    for option, message in [(["--max-valid-examples", "1"], r"--max-valid-examples 1 \(the run has 16\)"),
                            (["--eval-decode-examples", "4"],
                             r"--eval-decode-examples 4 \(the run has 8; its best chrf depends on it\)")]:
        with pytest.raises(ConfigError, match=rf"--resume continues the run of .*: {message} cannot change"):
            T.main(["--resume", "--out", str(run), "--max-steps", "3", *option])
    valid = data / "validation.jsonl.gz"
    rows = gzip.decompress(valid.read_bytes()).decode().splitlines()
    for changed, now in [(rows[:11], "11 examples"), (rows[1:] + rows[:1], "other contents")]:
        valid.write_bytes(gzip.compress("\n".join(changed).encode()))
        with pytest.raises(ConfigError, match=rf"--resume .*last\.pt: the validation data changed since that "
                           rf"checkpoint \(12 examples then, {now} now\); its best chrf was measured on the old"):
            T.main(["--resume", "--out", str(run), "--max-steps", "3"])
    assert _snapshot(run) == before
    ck = load_checkpoint(loss_run / "last.pt")
    del ck["valid_data"]  # as a checkpoint written before the record
    save_checkpoint(loss_run / "last.pt", ck)
    # a loss best is not of the decodings: --eval-decode-examples may change (over the edited file: unchecked)
    T.main(["--resume", "--out", str(loss_run), "--max-steps", "3", "--eval-decode-examples", "4", "--no-progress"])
    assert load_checkpoint(loss_run / "last.pt")["progress"]["step"] == 3


def test_a_run_whose_data_folder_moved_resumes_from_its_new_place(tmp_path):
    """A run whose --data folder moved could not be resumed (its old place: no such folder; --data NEW:
    cannot change). --data NEW is now taken when its examples are the run's (the checkpoint's digests)
    and recorded for later resumes; other examples there, or a checkpoint without the record, are
    refused saying why, nothing written."""
    from conftest import translation_folder

    old, run = translation_folder(tmp_path), tmp_path / "run"
    T.main(TINY + ["--data", str(old), "--eval-every", "1", "--max-steps", "2", "--out", str(run)])
    new = old.rename(tmp_path / "moved")
    (other := tmp_path / "other").mkdir()
    other = translation_folder(other)
    rows = gzip.decompress((other / "train.jsonl.gz").read_bytes()).decode().splitlines()
    (other / "train.jsonl.gz").write_bytes(gzip.compress("\n".join(rows[:40]).encode()))
    before = _snapshot(run)
    with pytest.raises(ConfigError, match=rf"on its --data {old}, which is not there: if that folder moved, give "
                       r"--data with its new place"):
        T.main(["--resume", "--out", str(run), "--max-steps", "3"])
    with pytest.raises(ConfigError, match=rf"--data {other} holds other training examples than the run's --data {old} "
                       r"\(48 examples then, 40 examples now\)"):
        T.main(["--resume", "--out", str(run), "--max-steps", "3", "--data", str(other)])
    assert _snapshot(run) == before
    ck = load_checkpoint(run / "last.pt")
    save_checkpoint(tmp_path / "old.pt", {k: v for k, v in ck.items() if k not in ("train_data", "valid_data")})
    with pytest.raises(ConfigError, match=rf"--data {new} cannot replace the run's --data {old}: that checkpoint "
                       r"records no digest"):
        T.main(["--resume", str(tmp_path / "old.pt"), "--out", str(run), "--max-steps", "3", "--data", str(new)])
    assert _snapshot(run) == before
    T.main(["--resume", "--out", str(run), "--max-steps", "3", "--data", str(new), "--no-progress"])
    T.main(["--resume", "--out", str(run), "--max-steps", "4", "--no-progress"])  # the new place is the run's now
    last = load_checkpoint(run / "last.pt")
    assert last["progress"]["step"] == 4 and last["args"]["data"] == str(new) and last["data"]["folder"] == str(new)
    assert json.loads((run / "args.json").read_text())["data"] == str(new)


def test_a_folder_another_process_trains_in_is_refused_until_it_ends(tmp_path):
    """Two runs into one --out at once both trained: one run's checkpoints and logs were lost, its rows
    mixed into the other's. The folder is held (an flock on RUN/.lock) while a process trains there: a
    new run, an --overwrite and a resume into it are refused naming the holder's pid, nothing written;
    once the holder ends (a kill too: the system drops the lock) they go on."""
    import subprocess
    import sys

    run = tmp_path / "run"
    T.main(TINY + ["--max-steps", "2", "--eval-every", "1", "--out", str(run)])
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "os.ftruncate(fd, 0); os.write(fd, b'4242'); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _snapshot(tmp_path)
        for flags in (["--out", str(run), "--overwrite"], ["--resume", "--out", str(run), "--max-steps", "3"]):
            with pytest.raises(RunFolderError, match=rf"--out {run} is in use: another process \(pid 4242\) trains "
                               r"there now; wait for it to end, or choose another --out"):
                T.main(TINY + ["--max-steps", "3"] + flags if "--overwrite" in flags else flags)
            assert _snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    T.main(["--resume", "--out", str(run), "--max-steps", "3", "--no-progress", "--no-plots"])
    assert load_checkpoint(run / "last.pt")["progress"]["step"] == 3
    T.main(TINY + ["--max-steps", "1", "--eval-every", "1", "--out", str(run), "--overwrite"])  # .lock: no one's file
    assert load_checkpoint(run / "last.pt")["progress"]["step"] == 1
    # a run there that has saved no checkpoint yet: a resume is refused naming it (it said "holds no checkpoint")
    young = tmp_path / "young"
    young.mkdir()
    (young / ".lock").write_text("")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(young / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match=rf"--out {young} is in use: another process \(pid 4242\)"):
            T.main(["--resume", "--out", str(young)])
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):  # nobody trains there: what it lacks
        T.main(["--resume", "--out", str(young)])


def test_labels_checked_against_meta_json(tmp_path):
    d = _classification_folder(tmp_path, [0, 1, 2, 1], meta_labels={"0": "neg", "1": "pos"})
    source = D.resolve_source(data=str(d))
    train, valid = D.load_split(source, "train"), D.load_split(source, "validation")
    with pytest.raises(D.DataError, match=r"train.jsonl, example 3: label 2 is not a known class: the labels of "
                       r".*meta.json are 0, 1"):
        class_count(source, train, valid)
    # meta.json's label set decides the head, also when training sees fewer classes
    (d / "meta.json").write_text(json.dumps({"task": "classification", "labels": {"0": "a", "1": "b", "2": "c",
                                                                                  "3": "d"}}))
    assert class_count(D.resolve_source(data=str(d)), train, valid) == 4
    (d / "meta.json").write_text(json.dumps({"task": "classification"}))
    assert class_count(D.resolve_source(data=str(d)), train, valid) == 3  # dense observed labels 0..2


def test_the_class_count_covers_every_label_of_both_splits_and_refuses_a_stray_one(tmp_path):
    """The classifier's head has a class for every label id: meta.json's ids 0 and 2 make 3 classes (its
    largest id + 1, not its number of names); without meta.json the largest label of train *or*
    validation + 1. A bool (JSON true) is no label, and a negative one is not counted among the labels
    seen (2 of them allow ids up to 3)."""
    def ex(*labels):
        return [D.Example(f"text {i}", label) for i, label in enumerate(labels)]

    (tmp_path / "plain").mkdir()
    gap = _classification_folder(tmp_path, [0, 2, 0, 2], meta_labels={"0": "neg", "2": "pos"})
    assert class_count(D.resolve_source(data=str(gap)), ex(0, 2), ex(2)) == 3
    plain = D.resolve_source(data=str(_classification_folder(tmp_path / "plain", [0, 1, 2, 3])))
    assert class_count(plain, ex(0, 1, 2, 0), ex(1, 3)) == 4  # a class validation alone has: 4 of them
    with pytest.raises(D.DataError, match=r"example 2: label True is not a known class"):
        class_count(plain, ex(0, True, 1), ex(0))
    with pytest.raises(D.DataError, match=r"example 3: label -1 is not a known class: .*\(2 distinct seen, so at "
                       r"most 3\)"):
        class_count(plain, ex(0, 1, -1), ex(0))
    with pytest.raises(D.DataError, match=rf"{tmp_path / 'plain' / 'clf' / 'validation.jsonl'}, example 2: label 7"):
        class_count(plain, ex(0, 1), ex(0, 7))  # named in its own split's file


def test_bpe_dropout_draws_the_segmentations_of_the_runs_seed(tmp_path):
    """--bpe-dropout's training set segments each word as a `ResegmentedDataset` of the run's --seed does:
    the same seed, the same segmentations (a resume relies on it); another seed, others."""
    train = [D.Example("the quick brown fox jumps over lazy dogs " * 2, "der schnelle braune fuchs") for _ in range(8)]
    tok = BPETokenizer.train(D.texts_for_tokenizer(train, "both"), 300)
    examples = Examples(train, train[:2], None, [])

    def lengths(seed):
        cfg, _ = parse_args(["--bpe-dropout", "0.5", "--seed", str(seed), "--max-src-len", "64", "--max-tgt-len", "64"])
        data = build_data(cfg, D.resolve_source("synthetic"), tmp_path, Dist(), _SILENT,
                          TokenizerPair(tok), examples)
        return data.train_set.lengths(0).tolist()

    want = D.ResegmentedDataset(train, "translation", tok, tok, 64, 64, p=0.5, seed=3).lengths(0).tolist()
    assert lengths(3) == want and lengths(4) != want


def test_csv_log_widens_its_header_for_a_new_column(tmp_path):
    """A valid row with a column the first row lacked (a resumed run now decoding at validation)
    rewrites valid.csv under the widened header: no value is dropped, earlier rows read blank there."""
    log = Logger(tmp_path, enabled=True)
    log.row({"split": "valid", "step": 2, "loss": 4.0})
    log.row({"split": "valid", "step": 4, "loss": 3.5, "bleu": 12.5, "note": "a, quoted"})
    log.row({"split": "valid", "step": 6, "bleu": 14.0})
    log.row({"split": "valid", "step": 8, "chrf": 30.0})  # a new column, and none of the others but the first two
    log.close()
    with open(tmp_path / "valid.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"split": "valid", "step": "2", "loss": "4.0", "bleu": "", "note": "", "chrf": ""},
                    {"split": "valid", "step": "4", "loss": "3.5", "bleu": "12.5", "note": "a, quoted", "chrf": ""},
                    {"split": "valid", "step": "6", "loss": "", "bleu": "14.0", "note": "", "chrf": ""},
                    {"split": "valid", "step": "8", "loss": "", "bleu": "", "note": "", "chrf": "30.0"}]
    assert len(list((tmp_path).glob(".*.tmp"))) == 0


def test_a_process_locks_its_run_folders_again_at_will_and_releases_every_one(tmp_path, monkeypatch):
    """The lock of a run folder is this process's until `release_run_folders` (`train` calls it however
    it ends): locking a folder it holds again is no refusal of itself, and the release ends every lock
    it holds, not one. `holder` probes with a descriptor of its own, which flock counts as another
    holder: it names this pid while a folder is held and None once it is free."""
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.chdir(tmp_path)
    try:
        for folder in (a, b, a, Path("a")):  # a folder however named
            assert lock_run_folder(folder) == folder
        assert holder(a / LOCK) == holder(b / LOCK) == str(os.getpid())
    finally:
        release_run_folders()
    assert holder(a / LOCK) is None and holder(b / LOCK) is None


def test_overwrite_refuses_links_and_folders_named_as_run_files(tmp_path):
    """--overwrite deletes the files a run wrote and nothing else: a symlink or a folder under a run
    file's name (last.pt, plots/curves.png) and plots/ as a symlink to a folder of the user's (a run makes
    a real one) are no run's, so the folder is refused naming them; no target is deleted through them."""
    run, mine = tmp_path / "run", tmp_path / "mine"
    run.mkdir(), mine.mkdir()
    (run / "best.pt").write_bytes(b"a run's checkpoint")
    (mine / "curves.png").write_bytes(b"the user's plot")
    (run / "plots").symlink_to(mine, target_is_directory=True)
    (run / "last.pt").symlink_to(mine / "curves.png")
    (run / "log.txt").mkdir()
    with pytest.raises(RunFolderError, match=r"holds last\.pt, log\.txt, plots, which no run wrote"):
        check_out(run, overwrite=True)
    (run / "plots").unlink(), (run / "last.pt").unlink(), (run / "log.txt").rmdir()
    (run / "plots").mkdir()
    (run / "plots" / "curves.png").symlink_to(mine / "curves.png")
    (run / "plots" / "attention.png").mkdir()
    with pytest.raises(RunFolderError, match=r"holds plots/attention\.png, plots/curves\.png, which no run wrote"):
        check_out(run, overwrite=True)
    assert (mine / "curves.png").read_bytes() == b"the user's plot"


def test_a_run_folder_is_named_by_its_checkpoints_first(tmp_path):
    """The refusal of an --out holding a run names its first five files past the logs, checkpoints
    first (last.pt, best.pt, then the step files): what makes the folder a run, before its results."""
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    for name in ("best.pt", "last.pt", "log.txt", "metrics.final.json", "metrics.validation.json",
                 "plots/curves.png", "predictions.validation.jsonl", "step_0000002.pt"):
        (run / name).write_text("x")
    with pytest.raises(RunFolderError, match=r"already holds a training run \(last\.pt, best\.pt, step_0000002\.pt, "
                       r"metrics\.final\.json, metrics\.validation\.json, \.\.\.\); pass --resume"):
        check_out(run, overwrite=False)


def test_a_resume_continues_the_run_its_flags_name(tmp_path, monkeypatch):
    """The folder a resume writes into: --out when given; else the run of the checkpoint --resume names,
    or the run folder it names (not that folder's parent); else the newest run, runs/latest read through
    to its dated folder (so the run's records name that folder, not a link the next run moves)."""
    monkeypatch.setattr("scratchformer.training.runs.RUNS_DIR", tmp_path / "runs")
    dated, other = tmp_path / "runs" / "20261206-101010", tmp_path / "other"
    dated.mkdir(parents=True), other.mkdir()
    (tmp_path / "runs" / "latest").symlink_to(dated.name, target_is_directory=True)
    assert resume_folder(None) == resume_folder(None, "last") == dated.resolve()
    assert resume_folder(None, str(other)) == other
    assert resume_folder(None, str(other / "step_0000002.pt")) == other
    assert resume_folder(str(tmp_path / "new"), str(other / "last.pt")) == tmp_path / "new"
    # the same folder however named (relative, absolute, through a link) is no other folder: resumed in place
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(other.name, target_is_directory=True)
    assert not resumes_elsewhere(Path("other"), other / "last.pt")
    assert not resumes_elsewhere(tmp_path / "link", Path("other/last.pt"))
    assert resumes_elsewhere(dated, other / "last.pt")


def test_a_run_resumed_into_a_new_folder_takes_best_pt_only_when_it_is_its_checkpoints_best(tmp_path):
    """best.pt goes along to the new folder when its step is the best_step of the checkpoint resumed
    (the new run's best.pt is then that model); one of another step (a resume from an older
    checkpoint, whose run went on to a better one), or none (best_step -1), is left: its best starts afresh."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    save_checkpoint(old / "best.pt", {"progress": {"step": 4}, "model": {"w": torch.ones(2)}})
    assert not carry_best(old, new, best_step=2, dist_=Dist()) and not (new / "best.pt").exists()
    assert not carry_best(old, new, best_step=-1, dist_=Dist()) and not (new / "best.pt").exists()
    assert carry_best(old, new, best_step=4, dist_=Dist())
    assert (new / "best.pt").read_bytes() == (old / "best.pt").read_bytes()
    save_checkpoint(old / "best.pt", {"progress": {"step": 0}, "model": {"w": torch.ones(2)}})
    assert carry_best(old, new, best_step=0, dist_=Dist())  # a best at step 0 is a best


@pytest.mark.parametrize("answer", [True, False])
def test_under_ddp_rank_0_alone_reads_and_carries_best_pt_and_its_answer_is_every_ranks(tmp_path, answer):
    """Rank 1 neither reads the old best.pt (a whole checkpoint, read once per rank until 2026-12-07) nor
    writes the new one; it takes rank 0's answer, broadcast (`Dist.on_main`), where the ranks could disagree."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (old / "best.pt").write_bytes(b"not a checkpoint: read, it would be refused")
    rank_1, sent = Dist(rank=1, world=2, local_rank=1), []
    rank_1.broadcast = lambda obj: sent.append(obj) or (answer, None)  # rank 0's (result, exception)
    assert carry_best(old, new, best_step=0, dist_=rank_1) is answer
    assert sent == [(None, None)] and not (new / "best.pt").exists()


def _resumable(path, step):
    """A checkpoint a resume accepts (RESUME_KEYS), at `step`; its contents otherwise empty."""
    save_checkpoint(path, {**{k: None for k in RESUME_KEYS}, "progress": {"step": step}})


def test_a_resume_takes_the_newest_intact_state_of_its_run(tmp_path):
    """--resume of a folder continues from its newest intact checkpoint: last.pt; when it is unreadable,
    the newest step file that reads (not the oldest); when it is older than a step file that does not
    read, last.pt still (no error). A checkpoint named on the command line that does not read is refused,
    not replaced by another of its folder."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 3, 4):
        _resumable(run / f"step_{step:07d}.pt", step)
    _resumable(run / "last.pt", 4)
    assert load_resume_checkpoint(run, "last")[::2] == (run / "last.pt", None)
    (run / "last.pt").write_bytes(b"junk")
    (run / "step_0000004.pt").write_bytes(b"junk")
    path, ckpt, warning = load_resume_checkpoint(run, "last")
    assert (path, ckpt["progress"]["step"]) == (run / "step_0000003.pt", 3)
    assert warning.startswith(f"warning: {run / 'last.pt'} is unreadable") and "resuming from " in warning
    _resumable(run / "last.pt", 3)  # a save of step 4 cut short: its step file written, damaged, last.pt not
    assert load_resume_checkpoint(run, "last")[::2] == (run / "last.pt", None)
    (run / "step_0000002.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"step_0000002\.pt is not a scratchformer checkpoint"):
        load_resume_checkpoint(run, str(run / "step_0000002.pt"))


def test_a_resume_of_a_folder_without_last_pt_takes_a_step_file_newer_than_best_pt(tmp_path, capsys):
    """A run killed after its step_3.pt and before its first last.pt, best.pt from a validation at
    step 2: --resume of the folder continues from step 3, its newest state (was refused as "going
    back" to best.pt, a file the user never named), and so when best.pt does not read; best.pt named
    on the command line is still refused, or resumed as it is into another folder."""
    run = tmp_path / "run"
    run.mkdir()
    _resumable(run / "best.pt", 2)
    _resumable(run / "step_0000003.pt", 3)
    path, ckpt, warning = load_resume_checkpoint(run, "last")
    assert (path, ckpt["progress"]["step"]) == (run / "step_0000003.pt", 3)
    assert warning == (f"warning: {run / 'best.pt'} is at step 2, before step_0000003.pt; resuming from "
                       f"{run / 'step_0000003.pt'}, the newest intact step checkpoint")
    assert f"{run} has no last.pt: using {run / 'best.pt'}" in capsys.readouterr().err
    assert load_resume_checkpoint(run, str(run))[0] == run / "step_0000003.pt"
    with pytest.raises(RunFolderError, match=r"best\.pt goes back to step 2 of the run in .*, which went on to "
                                             r"step_0000003\.pt"):
        load_resume_checkpoint(run, str(run / "best.pt"))
    assert load_resume_checkpoint(tmp_path / "elsewhere", str(run / "best.pt"))[0] == run / "best.pt"
    (run / "best.pt").write_bytes(b"junk")
    assert load_resume_checkpoint(run, "last")[0] == run / "step_0000003.pt"


def test_runs_started_in_one_second_get_folders_of_their_own_and_latest_the_newest(tmp_path, monkeypatch):
    """Without --out each run makes runs/<date>-<time>; a second run in the same second gets <date>-<time>-2
    (not the first one's folder, whose files it would mix with its own), and runs/latest is moved to it."""
    clock = SimpleNamespace(now=lambda: datetime.datetime(2026, 12, 6, 10, 10, 10))
    monkeypatch.setattr("scratchformer.training.runs.datetime", SimpleNamespace(datetime=clock))
    monkeypatch.setattr("scratchformer.training.runs.RUNS_DIR", tmp_path / "runs")
    try:
        first, second = (fresh_run_folder(None, False, Dist()) for _ in range(2))
    finally:
        release_run_folders()
    assert (first, second) == (tmp_path / "runs" / "20261206-101010", tmp_path / "runs" / "20261206-101010-2")
    assert os.readlink(tmp_path / "runs" / "latest") == "20261206-101010-2"


def test_a_run_that_began_in_the_folder_while_this_one_locked_it_is_refused(tmp_path, monkeypatch):
    """--out is checked, then locked, then checked again: a run that saved its first checkpoint there
    between the two (it held the folder; its lock is released by now) is refused, not taken for a
    stopped run's folder and trained into."""
    run = tmp_path / "run"
    real = lock_run_folder

    def another_run_saves_first(folder, clearing=False):
        folder.mkdir()
        (folder / "last.pt").write_bytes(b"the other run's checkpoint")
        return real(folder, clearing)

    monkeypatch.setattr("scratchformer.training.runs.lock_run_folder", another_run_saves_first)
    try:
        with pytest.raises(RunFolderError, match=r"already holds a training run \(last\.pt\)"):
            fresh_run_folder(str(run), False, Dist())
    finally:
        release_run_folders()
    assert (run / "last.pt").read_bytes() == b"the other run's checkpoint"


def test_overwrite_deletes_the_old_runs_plots_and_tensorboard_folders_with_their_files(tmp_path):
    """--overwrite deletes an earlier run's files, plots/ and tb/ included: their folders go too once
    empty (a run with --no-plots left an empty plots/ of the old run's), a user's folder stays."""
    run = tmp_path / "run"
    for name in ("last.pt", "plots/curves.png", "tb/events.out.tfevents.1.host"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(b"x")
    (run / "mine").mkdir()
    (run / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(RunFolderError, match=r"holds mine, which no run wrote"):  # the user's folder: refused
        fresh_run_folder(str(run), True, Dist())
    (run / "mine" / "notes.txt").unlink(), (run / "mine").rmdir()
    try:
        assert fresh_run_folder(str(run), True, Dist()) == run
    finally:
        release_run_folders()
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
