"""The command lines, in process: train -> evaluate -> generate, lead-3, ablate, --help, DDP."""

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scratchformer import ablate, evaluate, generate, train
from scratchformer.checkpoint import load_checkpoint

TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--vocab-size", "300",
        "--batch-size", "16", "--max-train-examples", "48", "--max-valid-examples", "12", "--eval-decode-examples", "6",
        "--beam-size", "2", "--log-every", "2", "--no-progress", "--preset", "tiny"]
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
    for mod in (evaluate, generate, ablate):
        with pytest.raises(SystemExit):
            mod.main(["--help"])
        assert "--" in capsys.readouterr().out


def _translation_folder(root: Path) -> Path:
    d = root / "toy_mt"
    d.mkdir()
    words = {"one": "eins", "two": "zwei", "three": "drei", "red": "rot", "house": "Haus", "big": "groß"}
    keys = list(words)
    rows = []
    for i in range(60):
        src = [keys[(i * 7 + j) % len(keys)] for j in range(2 + i % 4)]
        rows.append({"src": " ".join(src), "tgt": " ".join(words[w] for w in src)})
    for split, part in (("train", rows[:48]), ("validation", rows[48:])):
        with gzip.open(d / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
    (d / "meta.json").write_text(json.dumps({"task": "translation"}))
    return d


def test_train_evaluate_generate_translation(tmp_path, capsys):
    data = _translation_folder(tmp_path)
    run = tmp_path / "run"
    res = train.main(TINY + ["--data", str(data), "--max-steps", "8", "--eval-every", "4", "--max-tokens", "256",
                             "--schedule", "cosine", "--out", str(run)])
    out = capsys.readouterr()
    assert "greedy" in res and "bleu" in res["greedy"]
    assert "beam2" in out.err + out.out  # the final lines name both decodings
    for name in ["config.json", "args.json", "tokenizer.json", "best.pt", "last.pt", "metrics.jsonl", "train.csv",
                 "valid.csv", "plots/curves.png", "plots/attention.png", "predictions.validation.jsonl"]:
        assert (run / name).exists(), name
    ck = load_checkpoint(run / "last.pt")
    assert ck["progress"]["step"] == 8 and ck["task"] == "translation"

    m = evaluate.main(["--checkpoint", str(run), "--split", "validation", "--beam-size", "2", "--attention", "0"])
    assert m["n"] == 12 and {"bleu", "chrf", "loss", "ppl", "exact_match"} <= set(m)
    assert (run / "metrics.validation.json").exists() and (run / "attention.validation.0.png").exists()
    preds = [json.loads(l) for l in (run / "predictions.validation.jsonl").read_text().splitlines()]
    assert len(preds) == 12 and {"source", "reference", "prediction"} <= set(preds[0])

    outs = generate.main(["--checkpoint", str(run / "best.pt"), "--text", "red house", "--text", "one two",
                          "--beam-size", "1"])
    assert [o["input"] for o in outs] == ["red house", "one two"] and all(isinstance(o["output"], str) for o in outs)

    # reuse the tokenizer in a new run, and separate vocabularies
    run2 = tmp_path / "run2"
    train.main(TINY + ["--data", str(data), "--max-steps", "2", "--tokenizer", str(run / "tokenizer.json"),
                       "--no-plots", "--out", str(run2)])
    assert (run2 / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    run3 = tmp_path / "run3"
    train.main(TINY + ["--data", str(data), "--max-steps", "2", "--separate-vocab", "--no-plots", "--out", str(run3)])
    assert (run3 / "tokenizer.src.json").exists() and (run3 / "tokenizer.tgt.json").exists()


def test_classification_tsv_carves_validation(tmp_path):
    d = tmp_path / "toy_clf"
    d.mkdir()
    lines = ["text\tlabel"] + [f"{'great fun' if i % 2 else 'awful bore'} movie {i}\t{i % 2}" for i in range(60)]
    (d / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (d / "meta.json").write_text(json.dumps({"task": "classification", "labels": {"0": "negative", "1": "positive"}}))
    run = tmp_path / "run"
    res = train.main(["--data", str(d), "--max-steps", "6", "--eval-every", "3", "--batch-size", "16",
                      "--vocab-size", "300", "--valid-fraction", "0.2", "--no-progress", "--out", str(run)])
    assert "accuracy" in res and (run / "plots" / "attention.png").exists()
    m = evaluate.main(["--checkpoint", str(run), "--split", "validation"])
    assert m["n"] == 12 and 0.0 <= m["accuracy"] <= 100.0
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
    assert (tmp_path / "metrics.validation.lead3.json").exists()
    assert "lead3" in capsys.readouterr().out


def test_ablate_grid(tmp_path):
    res = ablate.main(["--out", str(tmp_path), "--variants", "base=", "no-pe=--no-pos-encoding", "pre=--norm pre",
                       "--", *TINY, "--max-steps", "3", "--eval-every", "3", "--no-plots"])
    assert [r["name"] for r in res] == ["base", "no-pe", "pre"]
    assert (tmp_path / "ablation.png").exists() and (tmp_path / "ablation.json").exists()
    assert load_checkpoint(tmp_path / "no-pe" / "last.pt")["config"]["pos_encoding"] is False


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


def test_model_flags_reach_the_config(tmp_path):
    train.main(TINY + ["--layers", "2", "--decoder-layers", "1", "--heads", "4", "--norm", "pre", "--max-steps", "1",
                       "--no-plots", "--kernel", "eager", "--out", str(tmp_path)])
    cfg = json.loads((tmp_path / "config.json").read_text())
    got = (cfg["n_encoder_layers"], cfg["n_decoder_layers"], cfg["n_heads"], cfg["norm"], cfg["kernel"])
    assert got == (2, 1, 4, "pre", "eager")


def test_train_with_triton_kernels_in_the_interpreter(tmp_path):
    """`--kernel triton` drives every hot path through our kernels (Triton interpreter on CPU, the
    C++ embedding op): two steps train, the loss is finite, and the run records the backend."""
    data = _translation_folder(tmp_path)
    run = tmp_path / "run_triton"
    res = train.main(TINY + ["--data", str(data), "--max-steps", "2", "--eval-every", "2", "--max-tokens", "128",
                             "--max-valid-examples", "4", "--eval-decode-examples", "2", "--beam-size", "1",
                             "--kernel", "triton", "--out", str(run), "--no-plots"])
    assert "greedy" in res
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split", r.get("kind")) == "train" and "loss" in r]
    assert losses and all(l == l and l < 100 for l in losses)
    assert json.loads((run / "config.json").read_text())["kernel"] == "triton"
    for mod in ("attention", "add_layer_norm", "ffn"):
        assert f"scratchformer.kernels.{mod}" in sys.modules
