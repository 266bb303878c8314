"""The command lines, in process: train -> evaluate -> generate, lead-3, ablate, --help, DDP."""

import argparse
import errno
import gzip
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, held_by_another_process, translation_folder

from scratchformer import ablate, average, cli, evaluate, generate, score, train
from scratchformer import checkpoint as checkpoint_io
from scratchformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from scratchformer.data import DataError, DataSource, Example, encode_examples
from scratchformer.data.tokenizer import BPETokenizer, TokenizerPair
from scratchformer.device import DeviceError
from scratchformer.evaluation.attention import attention_map
from scratchformer.evaluation.evaluate import decode_batch, write_predictions
from scratchformer.evaluation.loading import load_models, load_run
from scratchformer.evaluation.options import OptionError
from scratchformer.model import EOS_ID, ModelConfig, build_model, greedy_decode
from scratchformer.training.ablation import build_parser as ablate_parser
from scratchformer.training.config import ConfigError, TrainConfig
from scratchformer.training.config import build_parser as train_parser
from scratchformer.training.runs import RunFolderError, lock_run_folder, release_run_folders

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ["--kernel", "{auto,eager,torch,triton}", "--task", "--dataset", "--data", "--preset", "--max-tokens",
                 "--batch-size", "--grad-accum", "--schedule", "--label-smoothing", "--precision", "--resume",
                 "--no-pos-encoding", "--heads", "--layers", "--norm", "--device", "--out", "--tokenizer"]:
        assert flag in text, flag
    for mod in (evaluate, generate, ablate, score):
        with pytest.raises(SystemExit):
            mod.main(["--help"])
        assert "--" in capsys.readouterr().out


def test_every_flag_says_what_it_does_and_its_default():
    # --encoder-layers, --activation, --tie-embeddings, --no-plots, evaluate's and generate's --precision
    # and generate's --length-penalty were bare names in --help; generate's --beam-size (4), --max-tokens and
    # --save-every did not say their defaults

    for parser in (train_parser(), evaluate.build_parser(), generate.build_parser(), ablate_parser(),
                   average.build_parser(), score.build_parser()):
        for a in parser._actions:
            if a.option_strings:
                assert a.help, (parser.prog, a.option_strings)
            d = a.default  # train's defaults are the class's (argparse.SUPPRESS here), shown by _default_text
            if isinstance(d, (int, float)) and not isinstance(d, bool) and d != 0:
                assert f"default: {d}" in a.help or f"default: {d:g}" in a.help, (parser.prog, a.option_strings)
            if isinstance(d, str) and d != argparse.SUPPRESS and a.choices is None:
                assert f"default: {d}" in a.help, (parser.prog, a.option_strings)


def test_train_evaluate_generate_translation(tmp_path, capsys):
    data = translation_folder(tmp_path)
    run = tmp_path / "run"
    res = train.main(TINY + ["--data", str(data), "--max-steps", "8", "--eval-every", "4", "--max-tokens", "256",
                             "--schedule", "cosine", "--out", str(run)])
    out = capsys.readouterr()
    assert "greedy" in res and "bleu" in res["greedy"]
    assert "beam2" in out.err + out.out  # the final lines name both decodings
    for name in ["config.json", "args.json", "tokenizer.json", "best.pt", "last.pt", "metrics.jsonl", "train.csv",
                 "valid.csv", "plots/curves.png", "plots/attention.png", "predictions.validation.jsonl"]:
        assert (run / name).exists(), name
    # the log says which machine and software trained it (device.describe)
    env = next(line for line in (run / "log.txt").read_text().splitlines() if line.startswith("environment: "))
    assert f" CPU, {torch.get_num_threads()} threads | torch {torch.__version__} | triton " in env, env
    assert f" | python {platform.python_version()}" in env, env
    ck = load_checkpoint(run / "last.pt")
    assert ck["progress"]["step"] == 8 and ck["task"] == "translation"
    # the data has no ids: each prediction is named by its place in the split (the "id" was null)
    rows = [json.loads(line) for line in (run / "predictions.validation.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"validation-{i}" for i in range(len(rows))] and len(rows) >= 2

    # the final report's predictions are not replaced unasked (a --limit 1 evaluation did, silently)
    final = (run / "predictions.validation.jsonl").read_text()
    with pytest.raises(FileExistsError, match=rf"{run / 'predictions.validation.jsonl'} exists; pass --overwrite to "
                                              r"replace it, or --out DIR to write elsewhere"):
        evaluate.main(["--checkpoint", str(run), "--split", "validation", "--limit", "1", "--beam-size", "2"])
    assert (run / "predictions.validation.jsonl").read_text() == final
    m = evaluate.main(["--checkpoint", str(run), "--split", "validation", "--beam-size", "2", "--attention", "0",
                       "--overwrite"])
    assert m["n"] == 12 and {"bleu", "chrf", "loss", "ppl", "exact_match"} <= set(m)
    # the file names the data, precision and backend it was scored with (two --out of other --data or
    # --precision differed in their scores alone)
    saved = json.loads((run / "metrics.validation.json").read_text())
    assert (saved["data"]["kind"], saved["precision"], saved["kernel"]) == ("local", "fp32", "eager"), saved  # auto's
    # and what scored it: sacrebleu's signatures of BLEU and chrF (metrics.scorers), ROUGE not computed
    assert set(saved["scorers"]) == {"bleu", "chrf"} and "|tok:13a|smooth:exp|" in saved["scorers"]["bleu"]
    assert f"CPU, {torch.get_num_threads()} threads | torch {torch.__version__} |" in saved["environment"]  # and where
    assert (run / "metrics.validation.json").exists() and (run / "attention.validation.0.png").exists()
    preds = [json.loads(l) for l in (run / "predictions.validation.jsonl").read_text().splitlines()]
    assert len(preds) == 12 and {"source", "reference", "prediction"} <= set(preds[0])
    assert [(p["id"], p["source"]) for p in preds[: len(rows)]] == [(r["id"], r["source"]) for r in rows]
    assert [p["id"] for p in preds] == [f"validation-{i}" for i in range(12)]

    outs = generate.main(["--checkpoint", str(run / "best.pt"), "--text", "red house", "--text", "one two",
                          "--beam-size", "1"])
    assert [o["input"] for o in outs] == ["red house", "one two"] and all(isinstance(o["output"], str) for o in outs)

    # reuse the tokenizer in a new run, and separate vocabularies
    run2 = tmp_path / "run2"
    reuse = [f for f in TINY if f not in ("--vocab-size", "300")]  # the file's vocabulary
    train.main(reuse + ["--data", str(data), "--max-steps", "2", "--tokenizer", str(run / "tokenizer.json"),
                        "--no-plots", "--out", str(run2)])
    assert (run2 / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    run3 = tmp_path / "run3"
    train.main(TINY + ["--data", str(data), "--max-steps", "2", "--separate-vocab", "--no-plots", "--out", str(run3)])
    assert (run3 / "tokenizer.src.json").exists() and (run3 / "tokenizer.tgt.json").exists()


def test_a_prediction_keeps_its_examples_id_and_one_without_is_named_by_its_place(tmp_path):
    examples = [Example("a b", "c", "x7"), Example("d", "e"), Example("f", "g", "0"), Example("h", "i")]
    write_predictions(tmp_path / "p.jsonl", examples, ["c", {"prediction": "e", "confidence": 0.5}, "g", "i"], "test")
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["x7", "test-1", "0", "test-3"]
    assert rows[1] == {"id": "test-1", "source": "d", "reference": "e", "prediction": "e", "confidence": 0.5}


def test_classification_tsv_carves_validation(tmp_path, monkeypatch):
    d = tmp_path / "toy_clf"
    d.mkdir()
    lines = ["text\tlabel"] + [f"{'great fun' if i % 2 else 'awful bore'} movie {i}\t{i % 2}" for i in range(60)]
    (d / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (d / "meta.json").write_text(json.dumps({"task": "classification", "labels": {"0": "negative", "1": "positive"}}))
    run = tmp_path / "run"
    flags = ["--data", str(d), "--max-steps", "6", "--eval-every", "3", "--batch-size", "16", "--vocab-size", "300",
             "--valid-fraction", "0.2", "--no-progress", "--out", str(run)]
    # a classifier decodes nothing: the options of decoding, a target or a decoder are refused by name (ignored)
    with pytest.raises(ConfigError, match=r"^--max-tgt-len, --beam-size, --eval-decode-examples are for a target "
                                          r"sequence, its decoder or its decoding; a classifier has none: drop them$"):
        train.main([*flags, "--eval-decode-examples", "4", "--beam-size", "2", "--max-tgt-len", "9"])
    assert not run.exists()
    res = train.main(flags)
    assert "accuracy" in res and (run / "plots" / "attention.png").exists()
    # the final report writes a classifier's predictions too (label and confidence), which its accuracy counts:
    # every validation example's
    rows = [json.loads(line) for line in (run / "predictions.validation.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["prediction"] in (0, 1) and 0.5 <= r["confidence"] <= 1.0 for r in rows)
    assert 100.0 * sum(r["prediction"] == r["reference"] for r in rows) / len(rows) == pytest.approx(res["accuracy"])
    m = evaluate.main(["--checkpoint", str(run), "--split", "validation", "--overwrite"])  # the final report's
    assert m["n"] == 12 and 0.0 <= m["accuracy"] <= 100.0
    # refused before --overwrite clears the run: a carve that leaves nothing to train on (the tokenizer was trained
    # on no example and the run folder cleared before "no training batch"), and a classifier without an encoder
    # layer (it read its [CLS] alone, one answer for every input, and its attention plot failed after training)
    kept = sorted(p.name for p in run.iterdir())
    for more, message in ((["--max-train-examples", "1"], "1 examples; carving 0.2 of them as validation leaves none "
                                                          "to train on"),
                          (["--encoder-layers", "0"], "--encoder-layers 0 makes no encoder; classification reads")):
        with pytest.raises((DataError, ConfigError), match=re.escape(message)):
            train.main([*flags, *more, "--overwrite"])
        assert sorted(p.name for p in run.iterdir()) == kept
    # a label the model has no class for: named with the model's classes before any work (an IndexError in torch)
    bad = tmp_path / "bad_labels"
    bad.mkdir()
    (bad / "validation.tsv").write_text("text\tlabel\ngreat fun\t1\nawful bore\t0\ngreat movie\t7\n")
    (bad / "meta.json").write_text(json.dumps({"task": "classification"}))
    with monkeypatch.context() as mp:
        mp.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("evaluated before the refusal"))
        with pytest.raises(DataError, match=rf"{bad / 'validation.tsv'}, example 3: label 7 is not one of the 2 "
                           rf"classes of {run / 'best.pt'}: 0 \(negative\), 1 \(positive\)"):
            evaluate.main(["--checkpoint", str(run), "--data", str(bad), "--out", str(tmp_path / "bad_eval")])
    assert not (tmp_path / "bad_eval").exists()
    shutil.rmtree(d)  # the class names travel in the checkpoint, not read from the data folder at generate time
    outs = generate.main(["--checkpoint", str(run), "--text", "great fun movie"])
    assert outs[0]["label_name"] in ("negative", "positive") and 0.5 <= outs[0]["confidence"] <= 1.0


def test_lead3_baseline(tmp_path, capsys):
    d = tmp_path / "toy_sum"
    d.mkdir()
    rows = [{"id": str(i), "document": f"first {i} . second . third . fourth .", "summary": f"first {i} .\nsecond ."}
            for i in range(5)]
    (d / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = evaluate.main(["--baseline", "lead3", "--data", str(d), "--split", "validation", "--out", str(tmp_path)])
    assert res["n"] == 5 and 60 < res["rouge1"] < 100 and res["rouge2"] > 0
    saved = json.loads((tmp_path / "metrics.validation.lead3.json").read_text())
    assert saved["data"]["folder"] == str(d) and saved["data"]["task"] == "summarization"  # which data it scored
    assert set(saved["scorers"]) == {"rouge"} and "|stemmer:porter|" in saved["scorers"]["rouge"]  # and with what
    assert "lead3" in capsys.readouterr().out


def test_ablate_grid(tmp_path):
    res = ablate.main(["--out", str(tmp_path), "--variants", "base=", "no-pe=--no-pos-encoding", "pre=--norm pre",
                       "--", *TINY, "--max-steps", "3", "--eval-every", "3", "--no-plots"])
    assert [r["name"] for r in res] == ["base", "no-pe", "pre"]
    assert (tmp_path / "ablation.png").exists() and (tmp_path / "ablation.json").exists()
    assert load_checkpoint(tmp_path / "no-pe" / "last.pt")["config"]["pos_encoding"] is False


def test_ablate_grid_continues_where_it_stopped(tmp_path):
    """A grid in bounded commands: a variant stopped by --time-limit stops the grid (no summary);
    the next command resumes that variant from its checkpoint, and a finished variant is read back."""
    grid = ["--out", str(tmp_path), "--variants", "base=", "no-pe=--no-pos-encoding", "--", *TINY,
            "--max-steps", "3", "--eval-every", "3", "--no-plots"]
    assert ablate.main([*grid, "--time-limit", "0.001"]) == []  # base stops after its first step
    assert load_checkpoint(tmp_path / "base" / "last.pt")["progress"]["step"] == 1
    assert not (tmp_path / "no-pe").exists() and not (tmp_path / "ablation.json").exists()
    grid += ["--time-limit", "3600"]  # a resumed run keeps its options unless given anew
    res = ablate.main(grid)
    assert [r["name"] for r in res] == ["base", "no-pe"] and (tmp_path / "ablation.json").exists()
    assert "resumed from" in (tmp_path / "base" / "log.txt").read_text()
    assert load_checkpoint(tmp_path / "base" / "last.pt")["progress"]["step"] == 3
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*.pt")}
    again = ablate.main(grid)  # everything finished: read back, nothing trained or rewritten
    assert [r["final"] for r in again] == [r["final"] for r in res]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*.pt")} == stamps
    # a variant whose flags now build another model: its finished run is not read back as this variant's
    # (until 2026-12-01 it was, labelled with today's flags); the grid's other options may change
    changed = [*grid[:3], "base=--heads 1", *grid[4:]]
    with pytest.raises(ConfigError, match=r"ablation base: .*base holds a finished run built otherwise: --heads 1 "
                                          r"\(the run has 2\); give the grid another --out"):
        ablate.main(changed)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*.pt")} == stamps
    # one command's own options may change (--time-limit, logging); those of the run may not (tests/test_ablation.py)
    assert [r["final"] for r in ablate.main([*grid, "--log-every", "1"])] == [r["final"] for r in res]


def test_ablate_grid_with_jobs_trains_variants_at_once_as_in_turn(tmp_path):
    """--jobs 2: each variant a train process of its own (its console in OUT/logs/), the same runs as
    trained one after the other in this process (one seed, one set of flags: the same losses), and the
    summary names the best variant by the compared metric."""
    shared = ["--", *TINY, "--max-steps", "3", "--eval-every", "3", "--no-plots"]
    variants = ["--variants", "base=", "no-pe=--no-pos-encoding"]
    in_turn = ablate.main(["--out", str(tmp_path / "turn"), *variants, "--metric", "loss", *shared])
    at_once = ablate.main(["--out", str(tmp_path / "once"), "--jobs", "2", *variants, "--metric", "loss", *shared])
    assert [r["name"] for r in at_once] == ["base", "no-pe"]
    for a, b in zip(at_once, in_turn):
        assert a["final"]["loss"] == pytest.approx(b["final"]["loss"], rel=1e-4), a["name"]
    for name in ("base", "no-pe"):
        assert "train:" in (tmp_path / "once" / "logs" / f"{name}.txt").read_text()  # the child's console
    summary = json.loads((tmp_path / "once" / "ablation.json").read_text())
    assert summary["best"] == min(at_once, key=lambda r: r["final"]["loss"])["name"]
    with pytest.raises(ValueError, match="--jobs 0: must be at least 1"):
        ablate.main(["--out", str(tmp_path / "bad"), "--jobs", "0", *variants, *shared])


def test_ablate_grid_with_jobs_names_the_variant_that_failed(tmp_path):
    """A variant whose process fails (here: a last.pt that cannot be read, so its resume stops) does
    not stop the others; the grid then fails naming it, with its log's end, and writes no summary."""
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "last.pt").write_bytes(b"not a checkpoint")
    grid = ["--out", str(tmp_path), "--jobs", "2", "--variants", "base=", "broken=--heads 1", "--", *TINY,
            "--max-steps", "2", "--eval-every", "2", "--no-plots"]
    with pytest.raises(ValueError, match=r"(?s)variants failed, .*: broken \(exit 2; .*broken\.txt\):.*last\.pt"):
        ablate.main(grid)  # a user error (exit 2; it was a RuntimeError: a traceback, exit 1)
    assert (tmp_path / "base" / "metrics.final.json").exists() and not (tmp_path / "ablation.json").exists()


def test_ablate_grid_with_jobs_stops_on_ctrl_c_and_saves(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal or `timeout -s INT` sends it) reaches each
    running variant once: each saves last.pt and stops, the grid starts no other and writes no summary."""
    cmd = [sys.executable, "-m", "scratchformer.ablate", "--out", str(tmp_path), "--jobs", "2", "--variants",
           "a=", "b=--heads 1", "c=--layers 2", "--", *TINY, "--max-steps", "100000", "--eval-every", "100000",
           "--no-plots"]
    grid = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO)
    deadline = time.time() + 120
    while not all((tmp_path / v / "train.csv").exists() for v in "ab") and time.time() < deadline:
        time.sleep(0.5)  # both are training (train.csv: the first logged steps)
    os.killpg(grid.pid, signal.SIGINT)
    out, _ = grid.communicate(timeout=120)
    assert grid.returncode == 0, out
    assert "ablation stopped in a at step" in out and "ablation stopped in b at step" in out, out
    for v in "ab":
        assert load_checkpoint(tmp_path / v / "last.pt")["progress"]["step"] > 0
    assert not (tmp_path / "c").exists() and not (tmp_path / "ablation.json").exists()


def test_bad_data_is_a_clear_error(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "train.jsonl").write_text('{"src": "a", "tgt": "b"}\n{"src": "a"}\n')
    with pytest.raises(Exception, match=r"train.jsonl:2: missing field 'tgt'"):
        train.main(["--data", str(d), "--task", "translation", "--out", str(tmp_path / "r"), "--no-progress"])


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="torchrun not found")
def test_torchrun_ddp_gloo_two_processes(tmp_path):
    """DistributedDataParallel on CPU (gloo): 2 processes, 3 steps; rank 0 writes the run folder.
    `--device cpu`: on a one-GPU machine rank 1 would otherwise ask for cuda:1."""
    with socket.socket() as sock:  # a free port, so parallel test runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node=2", f"--master_port={port}",
           "-m", "scratchformer.train", *TINY, "--max-steps", "3", "--eval-every", "3", "--no-plots",
           "--out", str(tmp_path / "ddp"), "--threads", "1", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    print(p.stdout[-3000:], p.stderr[-3000:])
    assert p.returncode == 0
    assert "x2 (DDP)" in p.stdout + p.stderr
    ck = load_checkpoint(tmp_path / "ddp" / "last.pt")
    assert ck["progress"]["step"] == 3 and isinstance(ck["rng"], list) and len(ck["rng"]) == 2
    # each rank draws its dropout masks from a stream of its own, seeded apart after the model is built
    assert [r["seed"] for r in ck["rng"]] == [0, 1]
    # the same command again: rank 0 refuses the folder, and so does rank 1 (`Dist.on_main`), one line each,
    # where rank 1 waited at a barrier and died with gloo's "Connection closed by peer" traceback (torchrun's
    # own ChildFailedError report after the children's lines stays: it is the launcher's)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    err = p.stderr
    assert p.returncode != 0 and "Connection closed" not in err and "/scratchformer/" not in err, err[-3000:]
    assert err.count(f"error: --out {tmp_path / 'ddp'} already holds a training run") == 2, err[-3000:]


def test_model_flags_reach_the_config(tmp_path):
    train.main(TINY + ["--layers", "2", "--decoder-layers", "1", "--heads", "4", "--norm", "pre", "--max-steps", "1",
                       "--no-plots", "--kernel", "eager", "--out", str(tmp_path)])
    cfg = json.loads((tmp_path / "config.json").read_text())
    got = (cfg["n_encoder_layers"], cfg["n_decoder_layers"], cfg["n_heads"], cfg["norm"], cfg["kernel"])
    assert got == (2, 1, 4, "pre", "eager")


def test_train_with_triton_kernels_in_the_interpreter(tmp_path):
    """`--kernel triton` drives every hot path through our kernels (Triton interpreter on CPU, the
    C++ embedding op): two steps train, the loss is finite, and the run records the backend. Small
    batches and targets (the interpreter runs a program at a time): the run's one validation at its
    end still decodes through the kernels' KV cache."""
    data = translation_folder(tmp_path)
    run = tmp_path / "run_triton"
    res = train.main(TINY + ["--data", str(data), "--max-steps", "2", "--max-tokens", "48", "--max-tgt-len", "16",
                             "--max-valid-examples", "4", "--eval-decode-examples", "2", "--beam-size", "1",
                             "--kernel", "triton", "--out", str(run), "--no-plots"])
    assert "greedy" in res
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split", r.get("kind")) == "train" and "loss" in r]
    assert losses and all(l == l and l < 100 for l in losses)
    assert json.loads((run / "config.json").read_text())["kernel"] == "triton"
    for mod in ("attention", "add_layer_norm", "ffn"):
        assert f"scratchformer.kernels.{mod}" in sys.modules


# ---------------------------------------------------------------------------------------------
# Errors: one line and exit status 2 (scratchformer.cli), --debug keeps the traceback
# ---------------------------------------------------------------------------------------------


def _raiser(e):
    seen = []

    def main(argv):
        seen.append(argv)
        if e is not None:
            raise e

    return main, seen


@pytest.mark.parametrize("error, line", [
    (DataError("data/train.jsonl:3: bad JSON"), "data/train.jsonl:3: bad JSON"),
    (OptionError("--max-len must be >= 1, got -1"), "--max-len must be >= 1, got -1"),
    (ValueError("--lr must be > 0, got -1.0"), "--lr must be > 0, got -1.0"),
    (CheckpointError("run/last.pt is truncated"), "run/last.pt is truncated"),
    (FileExistsError("preds.jsonl exists; pass --resume"), "preds.jsonl exists; pass --resume"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "in.txt"), "in.txt: No such file or directory"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/run"), "/ro/run: Permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "run"), "run: Is a directory"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "f/x"), "f/x: Not a directory"),
    (OSError(errno.ENOSPC, "No space left on device", "run/x.pt"), "run/x.pt: No space left on device"),
    (OSError(errno.EROFS, "Read-only file system", "run"), "run: Read-only file system"),
    (OSError(errno.ENOSPC, "cannot save checkpoint run/last.pt: disk full"), "cannot save checkpoint run/last.pt"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "run/x.pt"), "run/x.pt: Disk quota exceeded"),
    # a path typed too long, or through a loop of links: was a traceback (`average --output`, `generate --checkpoint`)
    (OSError(errno.ENAMETOOLONG, "File name too long", "aaa.pt"), "aaa.pt: File name too long"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "run"), "run: Too many levels of symbolic links"),
    # two files (a rename's): both named, source first, as the OSError's own str() orders them
    (PermissionError(errno.EACCES, "Permission denied", "out/p.jsonl.tmp", None, "out/p.jsonl"),
     "out/p.jsonl.tmp -> out/p.jsonl: Permission denied"),
    (OptionError(), "OptionError"),  # no message: the line names the error, not an empty "error: "
])
def test_cli_run_user_error_is_one_line(capsys, monkeypatch, error, line):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    main, _ = _raiser(error)
    assert cli.run(main, ["--x"]) == cli.EXIT_USER_ERROR == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {line}") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("error", [RuntimeError("bug"), KeyError("k"), ZeroDivisionError(), AssertionError(),
                                   OSError(errno.EIO, "Input/output error")])
def test_cli_run_bug_keeps_its_traceback(capsys, monkeypatch, error):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    main, _ = _raiser(error)
    with pytest.raises(type(error)):
        cli.run(main, [])
    assert capsys.readouterr().err == ""


def test_cli_run_debug_flag_env_interrupt_and_success(capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    main, seen = _raiser(DataError("bad"))
    with pytest.raises(DataError):  # --debug: the error goes through with its traceback
        cli.run(main, ["--a", "--debug", "--", "--debug"])
    assert seen[-1] == ["--a", "--", "--debug"]  # taken off before "--" only: the rest is another command's
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(DataError):
        cli.run(main, [])
    monkeypatch.setenv(cli.DEBUG_ENV, "0")
    assert cli.run(main, []) == 2
    assert cli.run(_raiser(KeyboardInterrupt())[0], []) == cli.EXIT_INTERRUPTED == 130
    assert cli.run(_raiser(None)[0], []) == 0
    assert capsys.readouterr().err.splitlines() == ["error: bad", "interrupted"]
    with pytest.raises(KeyboardInterrupt):  # --debug: Ctrl-C keeps its traceback too
        cli.run(_raiser(KeyboardInterrupt())[0], ["--debug"])
    assert capsys.readouterr().err == ""


def test_a_closed_stdout_ends_a_command_quietly():
    """`generate ... | head -1`: the reader gone, the next write raised BrokenPipeError, a traceback
    and exit 1 (and another at exit, flushing stdout). Now the command ends quietly, 141 (128 +
    SIGPIPE), as `yes | head` does; stderr holds nothing."""
    code = ("from scratchformer import cli\n"
            "def main(argv):\n    while True:\n        print('x' * 100)\n"
            "raise SystemExit(cli.run(main, []))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "x" * 100 + "\n"
    p.stdout.close()
    assert p.wait(timeout=60) == cli.EXIT_BROKEN_PIPE == 141
    assert p.stderr.read() == ""


@pytest.mark.parametrize("value, debug", [("", False), ("0", False), ("false", False), ("no", False),
                                          (" False ", False), ("NO", False), ("1", True), ("yes", True), ("TRUE", True),
                                          (" 1 ", True)])
def test_the_debug_variable_is_off_only_when_unset_empty_0_false_or_no(capsys, monkeypatch, value, debug):
    """SCRATCHFORMER_DEBUG as a shell user writes it: "", 0, false and no (any case, spaces around)
    turn it off; anything else on (the traceback goes through)."""
    monkeypatch.setenv(cli.DEBUG_ENV, value)
    main, _ = _raiser(DataError("bad"))
    if debug:
        with pytest.raises(DataError):
            cli.run(main, [])
    else:
        assert cli.run(main, []) == 2 and capsys.readouterr().err == "error: bad\n"


def test_an_options_value_shows_as_its_flag_takes_it():
    """`shown`, for the messages that name an option's old and new value: a list as the flag's
    words (nargs="+": `--variants a b`), None as unset, anything else as str() does."""
    assert cli.shown(["base=", "--heads 1"]) == "base= --heads 1" and cli.shown(("a", 2)) == "a 2"
    assert cli.shown(None) == "unset" and cli.shown(0.5) == "0.5" and cli.shown("x") == "x" and cli.shown([]) == ""


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _command(args, debug_env=False):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(cli.DEBUG_ENV, None)
    if debug_env:
        env[cli.DEBUG_ENV] = "1"
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)


def test_commands_report_user_errors_in_one_line(tmp_path):
    """Each command, as a user runs it: a bad data file, a missing checkpoint, a bad flag -> exit
    status 2 and one `error:` line naming the problem, no traceback; the inputs are left as they were.
    --debug (or SCRATCHFORMER_DEBUG=1) shows the traceback instead."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").write_bytes("one\teins\ncafé\tKaffee\n".encode("latin-1"))
    (tmp_path / "plain.jsonl.gz").write_text('{"src": "a", "tgt": "b"}\n')
    (tmp_path / "in.txt").write_text("one two\n")
    before = _snapshot(tmp_path)
    cases = [
        (["scratchformer.train", "--data", str(data), "--task", "translation", "--out", str(tmp_path / "out" / "r"),
          "--no-progress"], rf"{data / 'train.tsv'}:2: not UTF-8 text \(byte 0xe9"),
        (["scratchformer.evaluate", "--checkpoint", str(tmp_path / "nope")], rf"no checkpoint at {tmp_path / 'nope'}"),
        (["scratchformer.generate", "--checkpoint", str(tmp_path / "nope"), "--input", str(tmp_path / "in.txt"),
          "--output", str(tmp_path / "p.jsonl"), "--max-len", "-1"], r"--max-len must be >= 1, got -1"),
        (["scratchformer.score", "--checkpoint", str(tmp_path / "nope"), "--input", str(tmp_path / "plain.jsonl.gz")],
         rf"no checkpoint at {tmp_path / 'nope'}"),
        (["scratchformer.ablate", "--out", str(tmp_path / "out" / "ab"), "--variants", "base=", "--", "--data",
          str(data), "--task", "translation", "--no-progress"], rf"{data / 'train.tsv'}:2: not UTF-8"),
    ]
    for args, message in cases:
        p = _command(args)
        print(args[0], p.returncode, p.stderr[-2000:])
        assert p.returncode == 2 and "Traceback" not in p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and re.search(message, last), last
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before  # inputs untouched, no p.jsonl
    p = _command(cases[2][0] + ["--debug"])
    assert p.returncode == 1 and "Traceback" in p.stderr and "OptionError: --max-len must be >= 1" in p.stderr
    p = _command(cases[1][0], debug_env=True)
    assert p.returncode == 1 and "Traceback" in p.stderr and "CheckpointError: no checkpoint at" in p.stderr


def _eval_run(root: Path, seed: int = 0, words: str = "one two three red house big eins zwei drei rot Haus groß",
              task: str = "translation", max_len: int = 4096) -> Path:
    """A run folder without training: a tiny random model, its tokenizer (trained on `words`) and a
    local data folder (evaluate needs only the checkpoint's parts)."""
    root.mkdir(parents=True, exist_ok=True)
    data = translation_folder(root)
    tok = BPETokenizer.train([words] * 20, vocab_size=300, min_frequency=1)
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab_size=tok.vocab_size, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      d_ff=64, dropout=0.0, kernel="eager", max_len=max_len)
    run = root / "run"
    save_checkpoint(run / "best.pt", {
        "model": build_model(cfg).state_dict(), "config": cfg.to_dict(), "tokenizers": TokenizerPair(tok).to_dict(),
        "task": task, "args": {**TrainConfig().to_dict(), "max_src_len": 16, "max_tgt_len": 10},
        "data": DataSource("local", "toy_mt", "translation", str(data)).to_dict(), "progress": {"step": 0}})
    return run


def test_the_attention_map_reads_the_whole_example_and_shows_its_first_tokens(tmp_path):
    """--attention N (and train's plots/attention.png): the model read the example cut to the 60 tokens
    shown, so the map's rows were the output of another input (without its EOS): they differed from
    the example's greedy output from row 10 on. The model now reads it whole, and the map shows its
    first 60 columns, the title saying so and that the rows are the greedy output."""
    model, toks, _ = load_run(_eval_run(tmp_path))
    dataset, _ = encode_examples([Example(" ".join(["one two three red house big"] * 20), "eins", None)],
                                 "translation", toks.src, toks.tgt, 512, 64)
    src = dataset[0][1]
    w, rows, cols, title = attention_map(model, dataset, 0, toks, device="cpu", max_tgt_len=16)
    assert len(src) > 60 and w.shape[1] == len(cols) == 60
    assert f"its first 60 of {len(src)} tokens" in title and "over its greedy output" in title
    hyp = greedy_decode(model, torch.as_tensor(src)[None], torch.tensor([len(src)]), max_len=16)[0].tolist()
    hyp = hyp[: hyp.index(EOS_ID) + 1] if EOS_ID in hyp else hyp
    assert rows == toks.tgt.token_strings(hyp) and w.shape[0] == len(hyp)


def test_the_attention_map_of_a_beam_evaluation_is_over_the_beam_output_it_wrote(tmp_path, monkeypatch):
    """evaluate --beam-size 4 --attention N drew the map over the model's greedy output, not over the
    beam output the evaluation wrote for example N; it now decodes N as the evaluation did."""
    import scratchformer.evaluation.plots as plots

    run = _eval_run(tmp_path)
    model, toks, _ = load_run(run)
    examples = [json.loads(line) for line in gzip.open(run.parent / "toy_mt" / "validation.jsonl.gz", "rt")]
    dataset, _ = encode_examples([Example(e["src"], e["tgt"], None) for e in examples], "translation",
                                 toks.src, toks.tgt, 16, 10)

    def output(i, **options):
        src = torch.as_tensor(dataset[i][1])[None]
        ids = decode_batch(model, src, torch.tensor([src.shape[1]]), "translation", max_tgt_len=10, **options)
        ids = ids[0].tolist()
        return toks.tgt.token_strings(ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids)

    beam = dict(beam_size=4, length_penalty=0.6, no_repeat_ngram=2)
    i = next(i for i in range(len(dataset)) if output(i, **beam) != output(i))  # one that beam search decodes otherwise
    drawn = {}
    monkeypatch.setattr(plots, "plot_attention",
                        lambda w, rows, cols, path, title: drawn.update(rows=rows, title=title))
    evaluate.main(["--checkpoint", str(run), "--split", "validation", "--out", str(tmp_path / "beam"),
                   "--beam-size", "4", "--length-penalty", "0.6", "--no-repeat-ngram", "2", "--attention", str(i)])
    assert drawn["rows"] == output(i, **beam) and "over its beam4 output" in drawn["title"]


def test_an_ensemble_reads_and_decodes_the_same_in_any_order(tmp_path):
    """Members trained at other lengths: the ensemble takes the longest source and output of any of
    them, whatever their order (the first member's decided: a 6-token cap first, a 10-token one
    second, gave other predictions and another loss than the reverse order)."""
    a, b = _eval_run(tmp_path / "a"), _eval_run(tmp_path / "b", seed=1)
    short = load_checkpoint(b / "best.pt")
    short["args"] = {**short["args"], "max_src_len": 6, "max_tgt_len": 4}
    save_checkpoint(b / "best.pt", short)
    ab, ba = (load_models(order)[2]["args"] for order in ([a, b], [b, a]))
    assert (ab["max_src_len"], ab["max_tgt_len"]) == (ba["max_src_len"], ba["max_tgt_len"]) == (16, 10)
    flags = ["--split", "validation", "--limit", "6", "--max-tokens", "64", "--beam-size", "2"]
    score = {name: evaluate.main(["--checkpoint", *order, "--out", str(tmp_path / name), *flags])
             for name, order in (("ab", [str(a), str(b)]), ("ba", [str(b), str(a)]))}
    assert _predictions(tmp_path / "ab") == _predictions(tmp_path / "ba")
    assert score["ab"]["loss"] == pytest.approx(score["ba"]["loss"], rel=1e-5)


def test_an_ensemble_reads_and_decodes_no_further_than_every_member_admits(tmp_path):
    """A member with fewer positions (max_len 9) than another's source and output lengths (16, 10):
    the ensemble's lengths are capped at its last position, 8, so evaluation runs and no prediction
    is longer (uncapped, the member was asked for positions it has not)."""
    a, b = _eval_run(tmp_path / "a"), _eval_run(tmp_path / "b", seed=1, max_len=9)
    short = load_checkpoint(b / "best.pt")
    save_checkpoint(b / "best.pt", {**short, "args": {**short["args"], "max_src_len": 6, "max_tgt_len": 4}})
    for order in ([a, b], [b, a]):
        ensemble, _, ckpt = load_models(order)
        assert ensemble.cfg.max_len == 9
        assert (ckpt["args"]["max_src_len"], ckpt["args"]["max_tgt_len"]) == (8, 8)
    evaluate.main(["--checkpoint", str(a), str(b), "--out", str(tmp_path / "ab"), "--split", "validation",
                   "--limit", "6", "--max-tokens", "64"])
    assert all(len(p.split()) <= 8 for p in _predictions(tmp_path / "ab"))


def test_an_ensemble_is_scored_on_a_carved_validation_only_when_its_members_carved_it_alike(tmp_path):
    """Data without a validation split (IMDb): each run carves one from train by its --seed. An
    ensemble whose members carved it with other seeds is refused, naming the seeds (it was scored on
    the first member's, which the other trained on: another score in the other order); members of
    one seed (and any on a split of the data's own) are scored."""
    a, b = _eval_run(tmp_path / "a"), _eval_run(tmp_path / "b", seed=1)
    (tmp_path / "a" / "toy_mt" / "validation.jsonl.gz").unlink()  # a's data, which the ensemble reads
    flags = ["--split", "validation", "--max-tokens", "64"]
    evaluate.main(["--checkpoint", str(a), str(b), "--out", str(tmp_path / "same"), *flags])
    other = load_checkpoint(b / "best.pt")
    save_checkpoint(b / "best.pt", {**other, "args": {**other["args"], "seed": 7}})
    for order in ([a, b], [b, a]):
        with pytest.raises(DataError, match=r"the ensemble's models saw different validation examples: each run carves "
                           r"its validation examples from train by its own --seed (0 and 7|7 and 0), so one's"):
            evaluate.main(["--checkpoint", *map(str, order), "--data", str(tmp_path / "a" / "toy_mt"),
                           "--out", str(tmp_path / "other"), *flags])
    assert not (tmp_path / "other").exists()


def test_evaluate_writes_into_the_run_folder_and_scores_survive_a_read_only_one(tmp_path, monkeypatch, capsys):
    """evaluate without --out writes into the checkpoint's run folder, never the current directory;
    when that folder refuses writes the scores are printed first and the error says so (exit 2)."""
    run = _eval_run(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = ["--checkpoint", str(run / "best.pt"), "--split", "validation", "--limit", "4", "--max-tokens", "64"]
    evaluate.main(args)
    assert (run / "predictions.validation.jsonl").exists() and (run / "metrics.validation.json").exists()
    assert list(cwd.iterdir()) == []
    capsys.readouterr()

    before = _snapshot(run)
    # another evaluation's files are not replaced unasked (another checkpoint's, or --limit 1's, silently were)
    with pytest.raises(FileExistsError, match=rf"{run / 'predictions.validation.jsonl'} and "
                       rf"{run / 'metrics.validation.json'} exist; pass --overwrite to replace them, or --out DIR"):
        evaluate.main([*args[:-4], "--limit", "1"])
    assert _snapshot(run) == before
    args.append("--overwrite")

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(run / ".predictions.validation.jsonl.1.tmp"))

    monkeypatch.setattr(checkpoint_io, "open", read_only, raising=False)  # where run files are written
    assert cli.run(evaluate.main, args) == 2
    out = capsys.readouterr()
    print(out.out, out.err)
    assert "toy_mt/validation (4 examples, greedy): loss" in out.out and "bleu" in out.out  # the scores
    assert out.err.strip().splitlines()[-1] == (
        f"error: cannot write {run / 'predictions.validation.jsonl'}: Read-only file system; the folder {run} is on "
        "a read-only file system: write elsewhere; any previous predictions.validation.jsonl is left as it was; "
        "the scores are printed above; pass --out DIR to save them elsewhere")
    assert _snapshot(run) == before and list(cwd.iterdir()) == []


def test_an_evaluation_another_evaluate_writes_is_refused_until_it_ends(tmp_path):
    """Two evaluates of one split into one folder at once both ran (each found no files, or both had
    --overwrite): one's predictions could end beside the other's metrics. While one runs it holds
    .evaluate.<split>.lock there: another is refused naming its pid, nothing written; once it ends
    (a kill too) the next goes on and leaves no lock file."""
    run = _eval_run(tmp_path)
    args = ["--checkpoint", str(run / "best.pt"), "--split", "validation", "--limit", "4", "--max-tokens", "64"]
    lock = run / ".evaluate.validation.lock"
    holder = held_by_another_process(lock)
    try:
        before = _snapshot(run)
        for flags in ([], ["--overwrite"]):
            with pytest.raises(cli.UsageError, match=rf"{re.escape(str(run / 'predictions.validation.jsonl'))} and "
                                                     rf"metrics.validation.json are being written by another "
                                                     rf"evaluate \(pid {holder.pid}\); wait for it to end"):
                evaluate.main([*args, *flags])
            assert _snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()
    evaluate.main(args)
    assert (run / "metrics.validation.json").exists() and not lock.exists()


def test_a_run_folder_is_not_shared_by_a_train_and_an_evaluate_of_its_validation_split(tmp_path):
    """A train's final report writes predictions.validation.jsonl into its folder: an evaluate of the
    validation split into the folder of a run that trains wrote its predictions and metrics, then the
    report replaced the predictions and left evaluate's metrics beside another model's. Refused naming
    the train's pid (another split is not the report's: it goes on). A train into a folder where an
    evaluate of the validation split writes is refused too, and its lock left alone (--overwrite deleted
    it); one of another split, only where it clears the folder (--overwrite)."""
    run = _eval_run(tmp_path)
    args = ["--checkpoint", str(run / "best.pt"), "--limit", "4", "--max-tokens", "64"]
    shutil.copyfile(run.parent / "toy_mt" / "validation.jsonl.gz", run.parent / "toy_mt" / "test.jsonl.gz")
    trainer = held_by_another_process(run / ".lock")
    try:
        before = _snapshot(run)
        with pytest.raises(cli.UsageError, match=rf"^{re.escape(str(run))} is the folder of a run that trains now "
                                                 rf"\(pid {trainer.pid}\): its final report writes "
                                                 r"predictions\.validation\.jsonl there"):
            evaluate.main([*args, "--split", "validation"])
        assert _snapshot(run) == before
        evaluate.main([*args, "--split", "test"])
        assert (run / "metrics.test.json").exists()
    finally:
        trainer.kill()
        trainer.wait()
    lock = run / ".evaluate.validation.lock"
    evaluator = held_by_another_process(lock)
    try:
        with pytest.raises(RunFolderError, match=rf"--out {re.escape(str(run))} is in use: an evaluate "
                                                 rf"\(pid {evaluator.pid}\) writes its validation predictions"):
            train.main(["--out", str(run), "--overwrite", *TINY])
        assert lock.exists() and (run / "best.pt").exists()
    finally:
        evaluator.kill()
        evaluator.wait()
    assert lock_run_folder(run) == run  # the evaluate ended (its lock file a stale one): the folder is free
    release_run_folders()
    # an evaluate of another split (Lead-3's validation files too) keeps only a clearing run out (--overwrite)
    for stem in ("test", "validation.lead3"):
        evaluator = held_by_another_process(run / f".evaluate.{stem}.lock")
        try:
            assert lock_run_folder(run) == run  # a resume writes none of its files
            release_run_folders()
            with pytest.raises(RunFolderError, match=rf"an evaluate \(pid {evaluator.pid}\) writes its {stem} "
                                                     r"predictions and metrics there now"):
                lock_run_folder(run, clearing=True)
        finally:
            evaluator.kill()
            evaluator.wait()


def test_evaluate_attention_index_past_the_split_is_refused_before_any_work(tmp_path, monkeypatch):
    """--attention 99 of a 4-example split: a UsageError naming the range, before decoding and
    writing; until 2026-12-01 an IndexError traceback (exit 1) after the outputs were written."""
    run = _eval_run(tmp_path)
    before = _snapshot(run)
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("decoded before the refusal"))
    with pytest.raises(cli.UsageError, match=r"--attention 4: toy_mt/validation has 4 examples here "
                       r"\(--attention 0 to 3\)"):
        evaluate.main(["--checkpoint", str(run), "--split", "validation", "--limit", "4", "--attention", "4"])
    assert _snapshot(run) == before


def _predictions(folder: Path) -> list[str]:
    return [json.loads(line)["prediction"] for line in (folder / "predictions.validation.jsonl").open()]


def test_evaluate_and_generate_an_ensemble(tmp_path, capsys):
    """Several --checkpoint decode as one model, the mean of their probabilities: a model twice
    scores and predicts as the model; two models' mixture has a teacher-forced loss no higher than
    the mean of theirs (-log of a mean probability <= the mean of the -logs); the metrics name
    every member. Members of another tokenizer or task are refused, naming the checkpoints."""
    a, b = _eval_run(tmp_path / "a"), _eval_run(tmp_path / "b", seed=1)
    flags = ["--split", "validation", "--limit", "6", "--max-tokens", "64", "--beam-size", "2"]
    score = {name: evaluate.main(["--checkpoint", *ckpts, "--out", str(tmp_path / name), *flags])
             for name, ckpts in (("a", [str(a)]), ("b", [str(b)]), ("aa", [str(a), str(a / "best.pt")]),
                                 ("ab", [str(a), str(b)]))}
    assert _predictions(tmp_path / "aa") == _predictions(tmp_path / "a")
    assert score["aa"]["bleu"] == score["a"]["bleu"] and score["aa"]["loss"] == pytest.approx(score["a"]["loss"])
    assert score["ab"]["loss"] <= (score["a"]["loss"] + score["b"]["loss"]) / 2 + 1e-6
    assert _predictions(tmp_path / "ab") not in (_predictions(tmp_path / "a"), _predictions(tmp_path / "b"))
    assert score["ab"]["checkpoint"] == [{"path": str(run / "best.pt"), "step": 0} for run in (a, b)]
    assert score["ab"]["step"] is None
    texts = ["--text", "red house", "--text", "one two three", "--beam-size", "2"]
    assert generate.main(["--checkpoint", str(a), str(a), *texts]) == generate.main(["--checkpoint", str(a), *texts])
    (tmp_path / "in.txt").write_text("red house\none two three\n")
    out = tmp_path / "ab.jsonl"
    summary = generate.main(["--checkpoint", str(a), str(b), "--input", str(tmp_path / "in.txt"), "--output", str(out),
                             "--beam-size", "2"])
    assert summary["checkpoint"] == score["ab"]["checkpoint"] and len(out.read_text().splitlines()) == 2
    capsys.readouterr()

    other_tokens = _eval_run(tmp_path / "c", words="quite other words here")
    with pytest.raises(CheckpointError, match=f"{other_tokens / 'best.pt'} and {a / 'best.pt'} have different "
                       "tokenizers: an ensemble averages"):
        evaluate.main(["--checkpoint", str(a), str(other_tokens), "--out", str(tmp_path / "x"), *flags])
    other_task = _eval_run(tmp_path / "d", task="summarization")
    with pytest.raises(CheckpointError, match=f"{other_task / 'best.pt'} was trained for summarization, "
                       f"{a / 'best.pt'} for translation: an ensemble's models share one task"):
        generate.main(["--checkpoint", str(a), str(other_task), *texts])
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_evaluate_read_only_run_folder_for_real(tmp_path, capsys):
    run = _eval_run(tmp_path)
    before = _snapshot(run)
    run.chmod(0o555)
    try:
        assert cli.run(evaluate.main, ["--checkpoint", str(run), "--split", "validation", "--limit", "2"]) == 2
    finally:
        run.chmod(0o755)
    out = capsys.readouterr()
    assert "bleu" in out.out and f"the folder {run} is not writable" in out.err
    assert "the scores are printed above" in out.err
    assert _snapshot(run) == before


def test_evaluate_task_without_data_is_refused_not_ignored(tmp_path):
    """--task says how --data / --dataset files are read; without them evaluate reads the
    checkpoint's own data as its own task, so another --task was silently ignored."""
    run = _eval_run(tmp_path)
    with pytest.raises(cli.UsageError, match="--task summarization reads --data / --dataset as that task; without "
                                             "them the checkpoint's own data is read, as translation"):
        evaluate.main(["--checkpoint", str(run), "--split", "validation", "--task", "summarization"])
    assert evaluate.main(["--checkpoint", str(run), "--split", "validation", "--limit", "2",
                          "--task", "translation"])["n"] == 2  # its own task: nothing to refuse


def test_lead3_without_out_writes_nothing(tmp_path, monkeypatch, capsys):
    d = tmp_path / "toy_sum"
    d.mkdir()
    rows = [{"id": str(i), "document": f"first {i} . second . third . fourth .", "summary": f"first {i} ."}
            for i in range(3)]
    (d / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    res = evaluate.main(["--baseline", "lead3", "--data", str(d), "--split", "validation"])
    assert res["n"] == 3 and "rouge1" in capsys.readouterr().out
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("flags, message", [
    (["--beam-size", "0"], "--beam-size must be >= 1, got 0"),
    (["--max-tokens", "-5"], "--max-tokens must be >= 1, got -5"),
    (["--limit", "-1"], "--limit must be >= 1, got -1"),
    (["--limit", "0"], "--limit must be >= 1, got 0"),  # it used to score one example
    (["--length-penalty", "nan"], "--length-penalty must be a number in [-50, 50] (len ** it divides a hypothesis's "
                                  "score), got nan"),
    (["--beam-size", "2", "--length-penalty", "400"], "--length-penalty must be a number in [-50, 50] (len ** it "
                                                        "divides a hypothesis's score), got 400.0"),
    (["--min-len", "-2"], "--min-len must be >= 0 (0: off), got -2"),
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram must be >= 0 (0: off), got -1"),
    ([], "--checkpoint is required"),
    (["other.pt"], "an ensemble (several --checkpoint) needs --out DIR for its predictions and metrics"),
    (["other.pt", "--out", "o", "--attention", "0"], "--attention draws one model's attention; an ensemble has none"),
    (["--length-penalty", "2"], "--length-penalty 2 ranks beam search's hypotheses; greedy decoding (--beam-size 1)"),
    (["--baseline", "lead3"], "--baseline lead3 scores the data's own sentences, with no model: drop --checkpoint"),
    (["--data", "d", "--dataset", "samsum"], "--data d and --dataset samsum both name the data: give one"),
    (["--out", "__file__/sub"], "is a file, not a folder"),
    (["--top-k", "5"], "--top-k shapes --sample's draws: give --sample, or drop it"),
    (["--sample", "--beam-size", "4"], "--beam-size 4 is beam search's; --sample draws each token: drop --beam-size"),
    (["--sample", "--top-p", "0"], "--top-p must be in (0, 1] (1: every token), got 0.0"),
    (["--mbr", "4"], "--mbr N chooses among N candidates, the beam's N best (--beam-size 1): N must be >= 2 and <= "
                     "--beam-size, got 4"),
    (["--sample", "--mbr", "1"], "--mbr N chooses among N candidates, N samples (--sample): N must be >= 2, got 1"),
    (["--mbr-utility", "bleu"], "--mbr-utility bleu is --mbr's: give --mbr N, or drop it"),
    (["--baseline", "lead3", "--sample", "--mbr", "2"], "--baseline lead3 scores the data's own sentences, with no "
                                                        "model: drop --checkpoint, --mbr, --sample"),
])
def test_evaluate_refuses_bad_flags_before_any_work(tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(evaluate, "load_models", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    ckpt = [] if not flags else ["--checkpoint", str(tmp_path)]
    flags = [f.replace("__file__", __file__) for f in flags]  # a path under a file
    with pytest.raises((cli.UsageError, OptionError), match=re.escape(message)):  # both exit 2, no traceback
        evaluate.main(ckpt + flags)
    assert list(tmp_path.iterdir()) == []


def test_evaluate_finds_a_named_datasets_folder_from_anywhere_or_says_it_is_missing(tmp_path, monkeypatch):
    """A checkpoint keeps its data folder as the training's cwd saw it (../shared/data/multi30k): run from
    elsewhere, a named dataset is looked up again, and a folder that is not here is named with what to
    give (it was "no train split", though the validation split was asked for)."""
    run = _eval_run(tmp_path)
    ck = load_checkpoint(run / "best.pt")
    toy = Path(ck["data"]["folder"])
    (tmp_path / "datasets").mkdir()
    shutil.copytree(toy, tmp_path / "datasets" / "toy_mt")
    save_checkpoint(run / "best.pt", {**ck, "data": {**ck["data"], "folder": "../elsewhere/toy_mt"}})
    monkeypatch.setenv("SCRATCHFORMER_DATA", str(tmp_path / "datasets"))
    flags = ["--checkpoint", str(run), "--split", "validation", "--limit", "2", "--max-tokens", "64", "--out"]
    assert evaluate.main([*flags, str(tmp_path / "e1")])["n"] == 2  # toy_mt found under $SCRATCHFORMER_DATA
    monkeypatch.delenv("SCRATCHFORMER_DATA")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(cli.UsageError, match=r"the checkpoint's data folder \.\./elsewhere/toy_mt \(as its training "
                       r"saw it, from where it ran\) is not here: give --data DIR or --dataset NAME"):
        evaluate.main([*flags, str(tmp_path / "e2")])


def test_lead3_refuses_the_flags_of_a_model(tmp_path):
    with pytest.raises(cli.UsageError, match=r"--baseline lead3 .* no model: drop --attention, --beam-size, --kernel"):
        evaluate.main(["--baseline", "lead3", "--dataset", "samsum", "--attention", "0", "--beam-size", "4",
                       "--kernel", "eager"])


def test_evaluate_of_a_run_folders_other_checkpoint_needs_out_and_names_an_average(tmp_path):
    """RUN/averaged.pt (or a step file) scored without --out would replace RUN's predictions and scores of
    best.pt (the final report's): refused, nothing written; with --out its scores carry no step (one step's
    label once stood for an average) but the steps it averages."""
    run = _eval_run(tmp_path)
    averaged_from = [{"path": "step_0000002.pt", "step": 2}, {"path": "step_0000004.pt", "step": 4}]
    save_checkpoint(run / "averaged.pt", {**load_checkpoint(run / "best.pt"), "averaged_from": averaged_from})
    before = _snapshot(run)
    flags = ["--split", "validation", "--limit", "2", "--max-tokens", "64"]
    with pytest.raises(cli.UsageError, match=r"averaged\.pt: its predictions and scores would replace those of "
                       r".*best\.pt .*give --out DIR"):
        evaluate.main(["--checkpoint", str(run / "averaged.pt"), *flags])
    assert _snapshot(run) == before
    res = evaluate.main(["--checkpoint", str(run / "averaged.pt"), "--out", str(tmp_path / "avg"), *flags])
    assert res["step"] is None and res["averaged_from"] == averaged_from


def test_evaluate_on_other_data_needs_out(tmp_path):
    """A run scored on other data (docs/training.md: `--data .../iwslt2017_en_de` for a Multi30k run) wrote
    its predictions.validation.jsonl and metrics.validation.json over the run's own, named by the split
    alone: refused without --out, nothing written; its own data from another path is the same data."""
    run = _eval_run(tmp_path)
    own = Path(load_checkpoint(run / "best.pt")["data"]["folder"])
    other = tmp_path / "other" / "news"
    shutil.copytree(own, other)
    flags = ["--checkpoint", str(run), "--split", "validation", "--limit", "2", "--max-tokens", "64"]
    evaluate.main(flags)
    before = _snapshot(run)
    with pytest.raises(cli.UsageError, match=r"its predictions and scores on news would replace those on its own "
                       r"data in .* \(predictions\.validation\.jsonl, metrics\.validation\.json\): give --out DIR"):
        evaluate.main([*flags, "--data", str(other)])
    assert _snapshot(run) == before
    assert evaluate.main([*flags, "--data", str(other), "--out", str(tmp_path / "news")])["n"] == 2
    shutil.copytree(own, tmp_path / "copy" / own.name)  # the run's own dataset, found elsewhere: its folder
    assert evaluate.main([*flags, "--data", str(tmp_path / "copy" / own.name), "--overwrite"])["n"] == 2


def test_evaluate_and_generate_help_list_debug(capsys):
    for mod in (evaluate, generate):
        with pytest.raises(SystemExit):
            mod.main(["--help"])
        assert "--debug" in capsys.readouterr().out and mod.run.__doc__


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has a cuda device")
@pytest.mark.parametrize("mod", [evaluate, generate])
@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: no CUDA device here"),
    ("gpu", r"--device gpu: not a device name \(cpu, cuda, cuda:1, ...\)"),
])
def test_missing_device_is_a_usage_error(tmp_path, monkeypatch, mod, device, message):
    """`--device cuda` on a CPU build used to be torch's AssertionError after the checkpoint was read."""
    monkeypatch.setattr(mod, "load_models", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    io_args = ["--checkpoint", str(tmp_path)] + (["--text", "x"] if mod is generate else [])
    with pytest.raises(DeviceError, match=message):
        mod.main(io_args + ["--device", device])


def test_a_runs_commit_is_its_checkouts_marked_when_changed_and_absent_outside_git(tmp_path):
    """device._commit: git's own short hash of HEAD; "+ changes" once a tracked file differs (an
    untracked one is no change to the code that ran); None for a folder that is not a checkout."""
    from scratchformer.device import _commit

    assert _commit(tmp_path) is None
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "new.py").write_text("")
    assert _commit(tmp_path) == head[:12]
    (tmp_path / "a.py").write_text("x = 2\n")
    assert _commit(tmp_path) == head[:12] + " + changes"


def test_a_gpu_runs_log_names_its_model_memory_and_compute_capability(monkeypatch):
    """device.describe on a CUDA device (its properties stood in for on a CPU machine): the GPU's name,
    memory in GiB and sm_XY, then torch with its CUDA."""
    from types import SimpleNamespace

    from scratchformer import device as dev

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85 * 2**30 - 2**20, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    text = dev.describe(torch.device("cuda:0"))
    assert text.startswith(f"NVIDIA H100 80GB HBM3, 85 GiB, sm_90 | torch {torch.__version__} (CUDA 13.0) | "), text


@pytest.mark.parametrize("split", ["raw/../../mt/validation", "/abs/path/test", "", ".validation"])
def test_evaluate_split_is_a_plain_name_refused_before_anything_is_read_or_written(tmp_path, capsys, split):
    """--split raw/../../mt/validation read a file outside the data folder and wrote
    predictions.raw/../../mt/validation.jsonl outside --out; /abs/path/test read any file and made folders
    predictions./abs/...; "" said "no  split": now one line naming the split, exit 2, nothing written."""
    run = _eval_run(tmp_path)
    data = Path(load_checkpoint(run / "best.pt")["data"]["folder"])
    (data / "raw").mkdir()
    shutil.copytree(data, tmp_path / "mt")
    (tmp_path / "out" / "predictions.raw").mkdir(parents=True)  # where the stem's path would lead out of --out
    before = _snapshot(tmp_path)
    flags = ["--checkpoint", str(run), "--split", split, "--limit", "2", "--max-tokens", "64"]
    assert evaluate.run([*flags, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --split {split!r}: not a split name (train, validation, "
                                               "test, ...): a plain name, not empty, without '/', '\\' or '..', "
                                               "not starting with '.'")
    assert _snapshot(tmp_path) == before


def _classifier_run(root: Path, labels: dict[int, str] | None, seed: int = 0) -> Path:
    """A run folder of an untrained classifier whose data folder (root/toy_clf) names its classes `labels`."""
    data = root / "toy_clf"
    data.mkdir(parents=True)
    (data / "validation.tsv").write_text("text\tlabel\ngreat fun\t1\nawful bore\t0\ngreat movie\t1\n")
    (data / "meta.json").write_text(json.dumps({"task": "classification", **({"labels": labels} if labels else {})}))
    tok = BPETokenizer.train(["great fun awful bore movie"] * 20, vocab_size=300, min_frequency=1)
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab_size=tok.vocab_size, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=0,
                      num_classes=2, d_ff=64, dropout=0.0, kernel="eager")
    save_checkpoint(root / "run" / "best.pt", {
        "model": build_model(cfg).state_dict(), "config": cfg.to_dict(), "tokenizers": TokenizerPair(tok).to_dict(),
        "task": "classification", "args": {**TrainConfig().to_dict(), "max_src_len": 16, "max_tgt_len": 10},
        "data": DataSource("local", "toy_clf", "classification", str(data), labels).to_dict(), "progress": {"step": 0}})
    return root / "run"


def test_classifiers_whose_class_names_differ_are_no_ensemble(tmp_path, capsys):
    """Members trained with {0: negative, 1: positive} and {0: positive, 1: negative}: their probabilities of
    class 0 were averaged and named by the first ("positive" 0.99 where the members said positive and
    negative). Refused naming both, before anything is written; one set of names, or none, still averages."""
    a = _classifier_run(tmp_path / "a", {0: "negative", 1: "positive"})
    b = _classifier_run(tmp_path / "b", {0: "positive", 1: "negative"}, seed=1)
    same, unnamed = (_classifier_run(tmp_path / n, lb, seed=2) for n, lb in (("c", {0: "negative", 1: "positive"}),
                                                                            ("d", None)))
    message = re.escape(f"{b / 'best.pt'} names its classes {{0: 'positive', 1: 'negative'}}, {a / 'best.pt'} "
                        "{0: 'negative', 1: 'positive'}: an ensemble averages its models' probabilities of each class")
    with pytest.raises(CheckpointError, match=message):
        evaluate.main(["--checkpoint", str(a), str(b), "--out", str(tmp_path / "ab")])
    with pytest.raises(CheckpointError, match=message):
        generate.main(["--checkpoint", str(a), str(b), "--text", "great fun"])
    assert not (tmp_path / "ab").exists()
    for other in (same, unnamed):
        res = evaluate.main(["--checkpoint", str(a), str(other), "--out", str(tmp_path / other.parent.name)])
        assert res["n"] == 3 and 0.0 <= res["accuracy"] <= 100.0
    assert generate.main(["--checkpoint", str(a), str(same), "--text", "great fun"])[0]["label_name"] in (
        "negative", "positive")
    capsys.readouterr()


def test_evaluate_on_data_naming_the_classes_otherwise_is_refused(tmp_path, capsys):
    """--data OTHER whose meta.json names class 0 "positive" where the checkpoint's named it "negative" was
    scored without notice: refused naming both mappings, nothing written; data without names, or with the
    same, is scored."""
    a = _classifier_run(tmp_path / "a", {0: "negative", 1: "positive"})
    flags = ["--checkpoint", str(a), "--out", str(tmp_path / "o")]
    other = _classifier_run(tmp_path / "b", {0: "positive", 1: "negative"}).parent / "toy_clf"
    with pytest.raises(DataError, match=re.escape(f"{other / 'meta.json'} names the classes {{0: 'positive', 1: "
                                                  f"'negative'}}, {a / 'best.pt'} was trained with {{0: 'negative', "
                                                  "1: 'positive'}: its predictions would be scored against other")):
        evaluate.main([*flags, "--data", str(other)])
    assert not (tmp_path / "o").exists()
    for labels in (None, {0: "negative", 1: "positive"}):
        data = _classifier_run(tmp_path / str(labels is None), labels).parent / "toy_clf"
        assert evaluate.main([*flags, "--data", str(data), "--overwrite"])["n"] == 3
    capsys.readouterr()
