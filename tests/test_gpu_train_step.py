"""Step 50 of the GPU plan (scripts/gpu/50_train.sh, issue 18) rehearsed on the CPU (GPU_DRY_RUN=1:
tiny data, a tiny model, the recipes' commands): a call cut by its deadline while training, scoring
or predicting brings back what the next call, or scripts/gpu/finish_on_cpu.sh, goes on from; a
finished run picks its checkpoint and predicts every blind test input; a failed scoring or capture
costs only what it must; no archive holds a checkpoint but the model a call has to bring back."""

import gzip
import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile

import pytest
import torch
from gpu_steps import GPU, REPO, dry_run, step_archive, step_env

from scratchformer.checkpoint import load_checkpoint, save_checkpoint


def _translation_data(folder, broken_test_input: bool = False) -> list[str]:
    """Tiny iwslt2017_en_de and multi30k folders for step 50's rehearsal -> the test inputs' ids
    (`broken_test_input`: a last test line that is not JSON, on which `generate` fails)."""
    ids = [f"t{i}" for i in range(5)]
    pairs = [{"src": f"a man number {i} rides a bike", "tgt": f"ein mann nummer {i} faehrt rad"} for i in range(40)]
    for name in ("iwslt2017_en_de", "multi30k"):
        data = folder / name
        data.mkdir(parents=True)
        for split, rows in (("train", pairs[:32]), ("validation", pairs[32:])):
            (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        opener, suffix = (lzma.open, "xz") if name == "iwslt2017_en_de" else (gzip.open, "gz")  # packed either way
        with opener(data / f"test_inputs.jsonl.{suffix}", "wt") as f:
            f.writelines(json.dumps({"id": i, "src": f"a woman number {i}"}) + "\n" for i in ids)
            f.write("{not json\n" if broken_test_input else "")
    return ids


def _cut_python(folder):
    """A python whose evaluate is cut at once (timeout's 124), or hangs (EVAL_SLEEP set); the rest runs."""
    fake = folder / "python"
    fake.write_text('#!/bin/bash\nfor a in "$@"; do if [ "$a" = scratchformer.evaluate ]; then\n'
                    '  if [ -n "${EVAL_SLEEP:-}" ]; then exec sleep "$EVAL_SLEEP"; fi; exit 124; fi; done\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


@pytest.fixture(scope="module")
def scoring_cut(tmp_path_factory):
    """50_train's first call on iwslt whose scoring the call's deadline cuts at once (evaluate exits 124):
    the run trains to its end and nothing is scored -> (folder, the call). The tests that start from a
    run finished training (its step checkpoints, best.pt and average, nothing scored) copy its run
    folder (`_finished_run`) rather than train the same tiny model again each."""
    folder = tmp_path_factory.mktemp("scoring_cut")
    _translation_data(folder / "data")
    call = dry_run("50_train.sh", str(folder / "o1"), GPU_DATA=str(folder / "data"), GPU_RUNS=str(folder / "runs"),
                    RECIPE="iwslt", PY=str(_cut_python(folder)))
    return folder, call


def _finish_on_cpu(recipe: str, weights, finish, data) -> subprocess.CompletedProcess:
    """scripts/gpu/finish_on_cpu.sh RECIPE WEIGHTS FINISH on DATA (SCRATCHFORMER_DATA), asserted to succeed."""
    done = subprocess.run(["bash", os.path.join(GPU, "finish_on_cpu.sh"), recipe, str(weights), str(finish)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SCRATCHFORMER_DATA": str(data), "PY": sys.executable})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _finished_run(rehearsal, runs, scored=False):
    """A fixture's run folder copied to RUNS/iwslt -> that folder: `scoring_cut`'s (finished training,
    nothing scored), or `predictions_cut`'s (`scored`: every candidate scored, no test predictions)."""
    run = runs / "iwslt"
    shutil.copytree(rehearsal[0] / "runs" / "iwslt", run)
    assert (run / "metrics.final.json").exists() and not (run / "test_predictions.jsonl").exists(), os.listdir(run)
    assert bool(list(run.glob("*/metrics.validation.json"))) == scored, os.listdir(run)
    return run


@pytest.fixture(scope="module")
def predictions_cut(tmp_path_factory, scoring_cut):
    """50_train's call on `scoring_cut`'s run (finished training, nothing scored) with a test input that
    `generate` cannot read: every candidate is scored, the test predictions fail -> (folder, the call).
    The tests of what such a call brings back share it (scoring the run once, not each)."""
    folder = tmp_path_factory.mktemp("predictions_cut")
    _translation_data(folder / "data", broken_test_input=True)
    _finished_run(scoring_cut, folder / "runs")
    call = dry_run("50_train.sh", str(folder / "o1"), GPU_DATA=str(folder / "data"), GPU_RUNS=str(folder / "runs"),
                    RECIPE="iwslt")
    return folder, call


def test_train_step_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """50_train (issue 18) in pieces: a call stopped by its time limit leaves a checkpoint on the
    machine, says to call again and brings back the average of its step checkpoints (which
    finish_on_cpu.sh scores and predicts with); the next call resumes, finishes, predicts every blind test
    input; archives never hold checkpoints. A grid recipe (Multi30k on our kernels and on eager)
    runs its variants and writes their summary."""
    ids = _translation_data(tmp_path / "data")
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt")
    first = dry_run("50_train.sh", str(tmp_path / "o1"), TRAIN_SECONDS="0.001", **env)
    assert first.returncode == 0, first.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert "iwslt: not finished, call again" in log and "run/test_predictions.jsonl" not in files
    assert os.path.exists(tmp_path / "runs" / "iwslt" / "last.pt")
    # the unfinished call brings back the average of its step checkpoints: a model that runs
    from scratchformer.checkpoint import load_checkpoint, step_checkpoints
    from scratchformer.evaluation.loading import load_run

    monkeypatch.syspath_prepend(GPU)
    import collect

    (averaged,) = collect.join_parts([tmp_path / "o1"], tmp_path / "collected")
    assert averaged.name == "50_iwslt-averaged.pt"
    steps = [int(p.stem.split("_")[1]) for p in step_checkpoints(tmp_path / "runs" / "iwslt")]
    assert steps and [a["step"] for a in load_checkpoint(averaged)["averaged_from"]] == steps[-5:]
    load_run(averaged)
    # ... which finish_on_cpu.sh scores at the recipe's decoding and penalties and predicts with
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt", averaged, finish, env["GPU_DATA"])
    scored = {f.parent.name: json.loads(f.read_text()) for f in finish.glob("*/metrics.validation.json")}
    assert set(scored) == {"averaged", "averaged-lp1.3", "averaged-lp1.6"}
    assert {m["decoding"] for m in scored.values()} == {"beam4"}
    assert [json.loads(line)["id"] for line in open(finish / "test_predictions.jsonl")] == ids
    assert "test predictions from averaged.pt" in done.stdout
    (tmp_path / "runs" / "iwslt" / "step_0000099.pt.tmp").write_bytes(b"a save killed midway")
    second = dry_run("50_train.sh", str(tmp_path / "o2"), **env)
    assert second.returncode == 0, second.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o2"), "50_train.sh")
    assert "resumed from" in log and "iwslt: finished" in log, log[-3000:]
    assert {"run/metrics.final.json", "run/test_predictions.jsonl", "run/log.txt"} <= set(files)
    # no checkpoint in the archive (nor a killed save's temporary); the model that wrote the predictions
    # comes back beside it, weights only
    assert not [n for n in files if re.search(r"\.pt(\.tmp)?$", n)], files
    assert not list((tmp_path / "o2").glob("*averaged.pt.part*"))
    assert list((tmp_path / "o2").glob("50_iwslt-picked.pt.part*"))
    preds = [json.loads(line) for line in open(tmp_path / "runs" / "iwslt" / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids
    # the predictions come from best.pt or the average of the last step checkpoints, each scored on
    # validation at the decoding's length penalty and at the recipe's others (the rehearsal: one), and
    # are decoded at the picked score's penalty
    assert {f"run/{name}/metrics.validation.json" for name in ("best", "averaged", "best-lp1.3", "averaged-lp1.3")
            } <= set(files)
    picked = re.search(r"(averaged|best)\.pt: validation bleu \(beam4\): best [\d.]+, averaged [\d.]+, "
                       r"best-lp1\.3 [\d.]+, averaged-lp1\.3 [\d.]+; length penalty ([\d.]+)", log)
    assert picked, log
    generate = rf"generate .*--checkpoint \S*/{picked[1]}\.pt .*--length-penalty {re.escape(picked[2])} "
    assert re.search(generate, log), log
    with tarfile.open(tmp_path / "o2" / "50_train.tar.gz") as tar:
        assert tar.extractfile("./picked.txt").read().decode().split() == [
            f"{picked[1]}.pt", "--beam-size", "4", "--length-penalty", picked[2]]
    grid = dry_run("50_train.sh", str(tmp_path / "o3"), **{**env, "RECIPE": "multi30k-eager"})
    assert grid.returncode == 0, grid.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o3"), "50_train.sh")
    assert {"run/ablation.json", "run/eager/metrics.final.json", "run/triton/metrics.final.json"} <= set(files)
    assert "multi30k-eager: finished" in log
    grid_runs = tmp_path / "runs" / "multi30k-eager"
    kernels = {r["name"]: json.load(open(grid_runs / r["name"] / "config.json"))["kernel"]
               for r in json.load(open(grid_runs / "ablation.json"))["runs"]}
    assert kernels == {"triton": "eager", "eager": "eager"}  # the CPU rehearsal runs both on eager


def test_search_recipe_predicts_with_its_best_variant_or_their_ensemble(tmp_path):
    """A search (a grid with DECODE; iwslt-ensemble: seeds) trains its variants at once (JOBS), then
    finishes its best by METRIC on validation as a single run: scored, the test predictions written,
    its model brought back; the archive holds the whole grid (ablation.json, every variant's folder and
    log). With ENSEMBLE=1 every variant's average, as one model, is scored beside the best variant's
    checkpoints; when it scores highest it writes the predictions (its members stay on the machine)."""
    ids = _translation_data(tmp_path / "data")
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt-ensemble")
    call = dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    grid = tmp_path / "runs" / "iwslt-ensemble"
    summary = json.load(open(grid / "ablation.json"))
    names = [r["folder"] for r in summary["runs"]]
    assert names == ["seed-0", "seed-1"] and summary["metric"] == "bleu"  # the rehearsal: the first two
    assert "--jobs 2" not in log and "--jobs 4" in log  # the recipe's JOBS, two variants to run
    best = max(summary["runs"], key=lambda r: r["final"]["bleu"])["folder"]
    assert summary["best"] == best and f"the best variant by bleu on validation: {best}" in log, log[-3000:]
    assert {"run/ablation.json", *(f"run/logs/{n}.txt" for n in names), *(f"run/{n}/metrics.final.json" for n in names),
            f"run/{best}/test_predictions.jsonl", f"run/{best}/best/metrics.validation.json",
            f"run/{best}/ensemble/metrics.validation.json", f"run/{best}/ensemble-lp1.6/metrics.validation.json"
            } <= set(files)
    ensemble = json.load(open(grid / best / "ensemble" / "metrics.validation.json"))
    assert [m["path"] for m in ensemble["checkpoint"]] == [str(grid / n / "averaged.pt") for n in names]
    assert not [n for n in files if n.endswith(".pt")] and "iwslt-ensemble: finished" in log
    assert [json.loads(line)["id"] for line in open(grid / best / "test_predictions.jsonl")] == ids
    assert list((tmp_path / "o1").glob("50_iwslt-ensemble-picked.pt.part*"))  # a tie of untrained models: best.pt
    # had the ensemble scored highest, it would have written them
    ensemble["bleu"] = 100.0
    (grid / best / "ensemble" / "metrics.validation.json").write_text(json.dumps(ensemble))
    (grid / best / "test_predictions.jsonl").unlink()
    call = dry_run("50_train.sh", str(tmp_path / "o2"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o2"), "50_train.sh")
    members = " ".join(str(grid / n / "averaged.pt") for n in names)
    assert re.search(rf"generate .*--checkpoint {re.escape(members)} --input", log), log[-3000:]
    assert "the test predictions' model is an ensemble of 2: its members stay on the machine" in log
    assert not list((tmp_path / "o2").glob("*.pt.part*"))
    with tarfile.open(tmp_path / "o2" / "50_train.tar.gz") as tar:
        assert tar.extractfile("./picked.txt").read().decode().split()[:3] == [
            "ensemble", *(f"{n}/averaged.pt" for n in names)]
    assert [json.loads(line)["id"] for line in open(grid / best / "test_predictions.jsonl")] == ids


def test_summarizer_checks_its_encoder_after_its_test_predictions(tmp_path):
    """A summarization recipe's encoder check (scripts/source_use.py, a diagnostic) runs once the test
    predictions are written, never before them: in the eleventh window it ran first, on one CPU
    thread, timed out in both calls and left CNN/DM's base model no time for its predictions."""
    data = tmp_path / "data" / "samsum"
    data.mkdir(parents=True)
    rows = [{"id": str(i), "document": f"Ann: I bring {i} apples\nBob: ok", "summary": f"Ann brings {i} apples."}
            for i in range(40)]
    for split, part in (("train", rows[:32]), ("validation", rows[32:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    with gzip.open(data / "test_inputs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"id": f"t{i}", "document": f"Eve: {i} pears?"}) + "\n" for i in range(3))
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="samsum")
    call = dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert {"run/test_predictions.jsonl", "run/source_use.txt"} <= set(files) and "samsum: finished" in log, log[-3000:]
    assert log.index(" generate (limit") < log.index(" source_use (limit"), log[-3000:]
    assert "NLL/token: own source" in open(tmp_path / "runs" / "samsum" / "source_use.txt").read()


def test_extractive_recipe_runs_to_its_test_predictions(tmp_path):
    """cnndm-ext (issue 18's CNN/DM target, an encoder that picks sentences) through the same call:
    trained with validation under the recipe's rule (at most 4 sentences, until 60 words), best.pt
    and the average scored by it, the better one picks every test input's summary from its sentences by that
    rule, and no encoder check (a summarizer's decoder diagnostic) runs."""
    data = tmp_path / "data" / "cnn_dailymail"
    data.mkdir(parents=True)
    words = "the a man dog city rain police report said on".split()

    def doc(i):
        return " ".join(f"{words[(i + j) % 10]} {words[(i * j) % 10]} number {j} ." for j in range(5))

    rows = [{"id": str(i), "document": doc(i), "summary": doc(i).split(" . ")[0] + " ."} for i in range(40)]
    for split, part in (("train", rows[:32]), ("validation", rows[32:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    tests = [{"id": f"t{i}", "document": doc(i + 50)} for i in range(3)]
    with gzip.open(data / "test_inputs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(t) + "\n" for t in tests)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="cnndm-ext")
    call = dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert "cnndm-ext: finished" in log and " source_use (limit" not in log, log[-3000:]
    assert re.search(r"(best|averaged)\.pt: validation rougeLsum \(top4-60w\): best [\d.]+, averaged [\d.]+", log), log
    final = json.loads((tmp_path / "runs" / "cnndm-ext" / "metrics.final.json").read_text())
    assert "top4-60w" in final and "top3" not in final, final
    assert {"run/test_predictions.jsonl", "run/best/metrics.validation.json", "run/averaged/metrics.validation.json"
            } <= set(files)
    preds = [json.loads(line) for line in open(tmp_path / "runs" / "cnndm-ext" / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == [t["id"] for t in tests]
    for p, t in zip(preds, tests, strict=True):  # whole sentences of its own document, at most 4
        picked = p["prediction"].split("\n")
        assert 1 <= len(picked) <= 4 and all(s in t["document"] for s in picked), (p, t)


def test_train_step_killed_outright_still_brings_back_its_archive(tmp_path, scoring_cut):
    """The device kills a call past its timeout_s with SIGKILL: no exit trap runs, so the step's one
    archive, written by that trap, was never made and the call brought back nothing, not even its
    log. Step 50 now packs an interim archive after training (and after the predictions): killed
    while scoring, the call still brings back its log and the run folder, and no half-written archive."""
    _translation_data(tmp_path / "data")
    _finished_run(scoring_cut, tmp_path / "runs")
    fake = tmp_path / "python"  # kills the step's whole session at its first evaluate, as the device would
    fake.write_text('#!/bin/bash\nfor a in "$@"; do if [ "$a" = scratchformer.evaluate ]; then\n'
                    '  pkill -KILL -s "$(ps -o sid= -p $$ | tr -d " ")"; sleep 30; fi; done\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = step_env(OUT=str(tmp_path / "o1"), GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"),
                    RECIPE="iwslt", PY=str(fake))
    call = subprocess.run(["bash", os.path.join(GPU, "50_train.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, start_new_session=True)  # its own session: pytest's is spared
    assert call.returncode == -signal.SIGKILL, call.stdout[-3000:]
    assert os.listdir(tmp_path / "o1") == ["50_train.tar.gz"]
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert {"run/metrics.final.json", "run/log.txt", "env.txt"} <= set(files), sorted(files)
    assert not any(name.endswith(".pt") for name in files) and "== 50_train: exit" not in log, log[-2000:]


def test_train_step_brings_back_the_model_of_unfinished_predictions(tmp_path, monkeypatch, predictions_cut):
    """A call whose run finished training but not its test predictions (the seventh window's SAMSum
    run: the call's deadline cut `generate`; here a test input it cannot read) brings back the
    checkpoint that writes them, weights only, in pieces, and names it and its decoding in
    picked.txt; finish_on_cpu.sh finishes the predictions with it from the GPU's snapshot. (The run
    finished training in `scoring_cut`, on the same training and validation data; the call of
    `predictions_cut` scores it.)"""
    folder, call = predictions_cut
    files, log = step_archive(str(folder / "o1"), "50_train.sh")
    assert "run/metrics.final.json" in files and "run/test_predictions.jsonl" not in files, call.stdout[-3000:]
    assert "iwslt: not finished, call again" in log
    assert not list((folder / "o1").glob("*averaged.pt.part*"))
    with tarfile.open(folder / "o1" / "50_train.tar.gz") as tar:
        picked = tar.extractfile("./picked.txt").read().decode().split()
    assert picked[0] in ("best.pt", "averaged.pt") and picked[1:3] == ["--beam-size", "4"], picked
    monkeypatch.syspath_prepend(GPU)
    import collect
    import torch

    from scratchformer.checkpoint import load_checkpoint
    from scratchformer.evaluation.loading import load_run

    collected = tmp_path / "collected"
    collect.unpack([folder / "o1"], collected)
    (weights,) = collect.join_parts([folder / "o1"], collected)
    assert weights.name == "50_iwslt-picked.pt"
    ckpt = load_checkpoint(weights)
    source = load_checkpoint(folder / "runs" / "iwslt" / picked[0])
    steps = [a["step"] for a in source["averaged_from"]] if picked[0] == "averaged.pt" else [source["progress"]["step"]]
    assert "optimizer" not in ckpt and [a["step"] for a in ckpt["averaged_from"]] == steps
    for name, tensor in source["model"].items():
        assert torch.equal(ckpt["model"][name].float(), tensor.float()), name
    load_run(weights)
    assert call.returncode != 0 and "bad JSON" in call.stdout  # generate's failure is the step's, said
    # finish_on_cpu.sh goes on from the GPU's snapshot (here one prediction) with the GPU's decoding
    # flags, and scores nothing again
    ids = _translation_data(tmp_path / "data")
    # a second call's archive (collect.py: 50_train.2) names the model and holds the snapshot that count:
    # the first call's picked.txt (here another decoding) and its missing snapshot are passed over
    shutil.copytree(collected / "50_train", collected / "50_train.2")
    (collected / "50_train" / "picked.txt").write_text(f"{picked[0]} --beam-size 2\n")
    (collected / "50_train" / "run" / "test_predictions.jsonl.partial").unlink(missing_ok=True)
    snapshot = collected / "50_train.2" / "run" / "test_predictions.jsonl.partial"
    snapshot.write_text(json.dumps({"id": ids[2], "prediction": "vom GPU"}) + "\n")
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt", weights, finish, str(tmp_path / "data"))
    preds = [json.loads(line) for line in open(finish / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and preds[2]["prediction"] == "vom GPU"
    assert f"test predictions from {picked[0]} (picked.pt), 1 of them decoded on the GPU" in done.stdout
    assert not list(finish.glob("*/metrics.validation.json"))


def test_a_model_over_the_fp32_limit_comes_back_in_bf16_and_is_predicted_anew(tmp_path, monkeypatch, predictions_cut):
    """cnndm-ext's base encoder is 103 MiB in fp32, over the 45 MiB a call brings back: it stayed on the
    machine, so a cut call left the CPU nothing to finish with. Over that limit (here set to 0 MiB)
    the weights come back in bf16, the mean rounded once (`average --dtype bf16`); not the GPU's
    weights, so finish_on_cpu.sh decodes every test input itself, none from the GPU's snapshot. (The
    run: `predictions_cut`'s, scored, its predictions cut; this call picks and ships its model.)"""
    _translation_data(tmp_path / "data", broken_test_input=True)
    _finished_run(predictions_cut, tmp_path / "runs", scored=True)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt")
    dry_run("50_train.sh", str(tmp_path / "o1"), SHIP_FP32_MIB="0", **env)
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert "picked_bf16" in log or "picked.txt" in files, log[-3000:]
    monkeypatch.syspath_prepend(GPU)
    import collect
    import torch

    from scratchformer.checkpoint import load_checkpoint

    collected = tmp_path / "collected"
    collect.unpack([tmp_path / "o1"], collected)
    (weights,) = collect.join_parts([tmp_path / "o1"], collected)
    floating = [v for v in load_checkpoint(weights)["model"].values() if v.is_floating_point()]
    assert floating and all(v.dtype == torch.bfloat16 for v in floating)
    shutil.rmtree(tmp_path / "data")
    ids = _translation_data(tmp_path / "data")
    snapshot = collected / "50_train" / "run" / "test_predictions.jsonl.partial"
    snapshot.write_text(json.dumps({"id": ids[2], "prediction": "vom GPU"}) + "\n")
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt", weights, finish, str(tmp_path / "data"))
    preds = [json.loads(line) for line in open(finish / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and "vom GPU" not in [p["prediction"] for p in preds]
    assert "picked.pt came back in bf16: the test inputs are all decoded here" in done.stdout


def test_a_follow_up_call_on_a_fresh_machine_trains_nothing(tmp_path):
    """RESUME_ONLY=1 (a second call of a window): the machine was given back between the calls, so
    the run is gone; the call used to start a new run and burn the window's rest on it. It stops at
    once, saying so, and fails."""
    _translation_data(tmp_path / "data")
    call = dry_run("50_train.sh", str(tmp_path / "o1"), GPU_DATA=str(tmp_path / "data"),
                    GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt", RESUME_ONLY="1")
    _, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert call.returncode != 0 and "RESUME_ONLY=1: no run in" in log
    assert not (tmp_path / "runs" / "iwslt").exists() or not list((tmp_path / "runs" / "iwslt").glob("*.pt"))
    # a grid's (multi30k-eager: a variant a folder) held on the machine: its checkpoints are a level down, and
    # the call goes on to resume them (here to a checkpoint that is no checkpoint, refused at once)
    variant = tmp_path / "runs" / "multi30k-eager" / "triton"
    variant.mkdir(parents=True)
    (variant / "last.pt").write_bytes(b"not a checkpoint")
    call = dry_run("50_train.sh", str(tmp_path / "o2"), GPU_DATA=str(tmp_path / "data"),
                    GPU_RUNS=str(tmp_path / "runs"), RECIPE="multi30k-eager", RESUME_ONLY="1", CUDA_GRAPHS="0")
    _, log = step_archive(str(tmp_path / "o2"), "50_train.sh")
    assert "RESUME_ONLY=1: no run in" not in log and "multi30k-eager" in log, log[-3000:]


def test_train_step_leaves_the_scores_to_the_next_call_at_its_deadline(tmp_path, scoring_cut):
    """A finished run's scoring cut by the call's deadline leaves the other evaluations to the next
    call: each one started after it got the prelude's last 10 s (and timeout's 20 s grace), all
    but certain to be cut too, and so pushed the step past its deadline toward the device's own
    kill, which loses the step's archive (best and averaged at 1.0 and three penalties: 5 more)."""
    folder, first = scoring_cut  # evaluate is cut at once (the first call: timeout's 124), or hangs (the second)
    _, log = step_archive(str(folder / "o1"), "50_train.sh")
    assert os.path.exists(folder / "runs" / "iwslt" / "metrics.final.json"), first.stdout[-3000:]
    assert "iwslt: not finished" in log and first.returncode != 0
    assert re.findall(r"== (eval_\S+): TIMED OUT", log) == ["eval_best"], log[-3000:]  # the first cut: no other tried
    _finished_run(scoring_cut, tmp_path / "runs")
    env = dict(GPU_DATA=str(folder / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt",
               PY=str(_cut_python(tmp_path)))
    # the second call starts past its deadline: every command gets the prelude's 10 s
    second = dry_run("50_train.sh", str(tmp_path / "o2"), EVAL_SLEEP="100",
                      GPU_DEADLINE=str(int(__import__("time").time()) - 100), **env)
    _, log = step_archive(str(tmp_path / "o2"), "50_train.sh")
    assert re.findall(r"== (eval_\S+): TIMED OUT", log) == ["eval_best"], log[-3000:]
    assert "iwslt: not finished, call again" in log and second.returncode == 124


def test_train_step_leaves_out_a_candidate_whose_scoring_fails(tmp_path, scoring_cut):
    """A candidate whose evaluation fails other than by the deadline (out of memory, say) is left out,
    and the run writes its test predictions with the others' pick: it set the call's scoring
    unfinished, so each call tried it again, failed again, and the predictions never came. (The run
    finished training in `scoring_cut`; this call scores it.)"""
    ids = _translation_data(tmp_path / "data")
    _finished_run(scoring_cut, tmp_path / "runs")
    fake = tmp_path / "python"  # the averaged checkpoint's evaluations fail at once; the rest run
    fake.write_text('#!/bin/bash\ncase "$*" in *scratchformer.evaluate*averaged.pt*) exit 1;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt", PY=str(fake))
    p = dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    _, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    run = tmp_path / "runs" / "iwslt"
    assert "== eval_averaged failed: not a candidate" in log, log[-3000:]
    assert (run / "averaged.failed").exists() and (run / "best" / "metrics.validation.json").exists()
    preds = [json.loads(line) for line in open(run / "test_predictions.jsonl")]
    assert [r["id"] for r in preds] == ids, p.stdout[-2000:]


def test_finish_on_cpu_goes_on_from_a_searchs_snapshot(tmp_path, scoring_cut):
    """finish_on_cpu.sh on a search recipe's picked model goes on from the GPU's predictions snapshot,
    which the archive holds in the grid's best variant's folder (run/<best>/), not in run/ (it
    looked there only, and decoded every test input again on the CPU). The model: `scoring_cut`'s
    tiny iwslt run's best.pt (any model of the dataset will do)."""
    ids = _translation_data(tmp_path / "data")
    collected = tmp_path / "collected"
    (collected / "50_train" / "run" / "seed-1").mkdir(parents=True)
    weights = collected / "50_iwslt-ensemble-picked.pt"
    shutil.copy(scoring_cut[0] / "runs" / "iwslt" / "best.pt", weights)
    (collected / "50_train" / "picked.txt").write_text("best.pt --beam-size 1\n")
    (collected / "50_train" / "run" / "ablation.json").write_text(json.dumps({"best": "seed-1", "runs": []}))
    (collected / "50_train" / "run" / "seed-1" / "test_predictions.jsonl.partial").write_text(
        json.dumps({"id": ids[2], "prediction": "vom GPU"}) + "\n")
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt-ensemble", weights, finish, tmp_path / "data")
    preds = [json.loads(line) for line in open(finish / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and preds[2]["prediction"] == "vom GPU", preds
    assert "1 of them decoded on the GPU" in done.stdout
    # weights shipped in bf16: the snapshot is not the model's, every input is decoded here, and said so
    ck = load_checkpoint(weights)
    ck["model"] = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ck["model"].items()}
    save_checkpoint(weights, ck)
    done = _finish_on_cpu("iwslt-ensemble", weights, tmp_path / "finish-bf16", tmp_path / "data")
    preds = [json.loads(line) for line in open(tmp_path / "finish-bf16" / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and preds[2]["prediction"] != "vom GPU", preds
    assert "0 of them decoded on the GPU" in done.stdout and "came back in bf16" in done.stdout


def test_train_step_falls_back_to_launched_steps(tmp_path):
    """CUDA_GRAPHS=1 and a run whose --cuda-graphs fails (here: refused, as the CPU has no GPU;
    on a GPU: a capture CUDA refused) goes on launched in the same call, and its checkpoints say
    so (a later call's resume stays launched)."""
    from scratchformer.checkpoint import load_checkpoint

    data = tmp_path / "data" / "multi30k"
    data.mkdir(parents=True)
    pairs = [{"src": f"a man number {i} rides a bike", "tgt": f"ein mann nummer {i} faehrt rad"} for i in range(40)]
    for split, rows in (("train", pairs[:32]), ("validation", pairs[32:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="multi30k-tiny",
               CUDA_GRAPHS="1", TRAIN_SECONDS="0.001")
    res = dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    files, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    assert "--cuda-graphs records CUDA graphs: it needs a GPU" in log and "--cuda-graphs failed (exit 2)" in log, log
    run = tmp_path / "runs" / "multi30k-tiny"
    args = json.load(open(run / "args.json"))
    assert args["cuda_graphs"] is False and args["eval_every"] == 3  # the rehearsal's flags, launched
    assert load_checkpoint(run / "last.pt")["args"]["cuda_graphs"] is False
    assert "multi30k-tiny: not finished, call again" in log and res.returncode != 0  # the failure is reported


def _recording_python(folder, train_exit):
    """A python whose `scratchformer.train` is recorded in FOLDER/train.calls and exits `train_exit`
    at once (the rest runs): step 50's decisions around its training, without training."""
    fake = folder / "python"
    fake.write_text('#!/bin/bash\nfor a in "$@"; do if [ "$a" = scratchformer.train ]; then\n'
                    f'  echo "$*" >> "{folder}/train.calls"; exit {train_exit}; fi; done\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def test_train_step_stops_at_its_deadline_without_retrying_launched_or_starting_late(tmp_path):
    """A --cuda-graphs run that ends in the call's SIGINT (exit 130: the deadline, not a capture CUDA
    refused) is not trained again launched in the same call (it would start past the deadline); and a
    call with under 30 s of training left (a deadline 110 s away: the prelude's 25 s and the dry run's
    60 s leave 25, less what the prelude took) starts no training at all, and says to call again."""
    (tmp_path / "data" / "iwslt2017_en_de").mkdir(parents=True)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt", CUDA_GRAPHS="1",
               PY=str(_recording_python(tmp_path, 130)))
    p = dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    _, log = step_archive(str(tmp_path / "o1"), "50_train.sh")
    calls = (tmp_path / "train.calls").read_text().splitlines()
    assert len(calls) == 1 and "--cuda-graphs" in calls[0] and "training on launched steps" not in log, log[-3000:]
    assert p.returncode == 130 and "iwslt: not finished, call again" in log, log[-3000:]
    (tmp_path / "train.calls").unlink()
    deadline = str(int(__import__("time").time()) + 110)
    p = dry_run("50_train.sh", str(tmp_path / "o2"), GPU_DEADLINE=deadline, **env)
    _, log = step_archive(str(tmp_path / "o2"), "50_train.sh")
    left = re.search(r"too little time left to train \((-?\d+)s\): call again", log)
    assert left and 0 < int(left[1]) < 30, log[-3000:]
    assert not (tmp_path / "train.calls").exists() and p.returncode == 0, log[-3000:]
