"""Ablation grids given what a grid cannot use: a folder that holds runs of other flags or another
grid's summary, variants of different tasks, a variant that fails, flags that are the grid's own or
do not parse (docs/failures.md, "Ablation grids")."""

import dataclasses
import json
import re
import time

import pytest
from conftest import TINY, translation_folder

from scratchformer import ablate
from scratchformer.checkpoint import load_checkpoint, save_checkpoint
from scratchformer.training import ablation
from scratchformer.training import variants as V
from scratchformer.training.ablation import _final_metric, _variant_config, best_variant, variant_folders
from scratchformer.training.config import ConfigError
from scratchformer.training.variants import VariantError

MODEL = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--vocab-size", "300"]


def _stamps(root):
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_a_rerun_with_other_flags_is_refused_by_name_and_more_steps_train_on(tmp_path):
    """A grid run again into its folder with other shared or variant flags read its finished runs back
    and recorded today's flags beside them (--max-steps 4 over 2-step runs): now each difference is
    refused by name before anything runs, also a flag dropped since; the options of one command
    (--time-limit, logging) read back; more --max-steps trains the finished run on, as --resume."""
    grid = ["--out", str(tmp_path), "--variants", "a=", "b=--label-smoothing 0.2", "--", *TINY, "--max-steps", "2",
            "--eval-every", "2", "--no-plots"]
    first = ablate.main(grid)
    stamps = _stamps(tmp_path)
    for changed, message in [([*grid, "--lr", "0.1"], r"ablation a: .*a holds a finished run built otherwise: "
                              r"--lr 0\.1 \(the run has 0\.002\); give the grid another --out, or remove"),
                             ([*grid, "--max-steps", "1"], r"ablation a: .*--max-steps 1 \(the run has 2\)"),
                             ([*grid[:4], "b=", *grid[5:]],  # a flag dropped: its default is not the run's
                              r"ablation b: .*--label-smoothing 0\.1 \(the run has 0\.2\)"),
                             ([*grid[:4], "b=--eval-decode-examples 4 --label-smoothing 0.2", *grid[5:]],
                              r"ablation b: .*--eval-decode-examples 4 \(the run has 6\)")]:
        with pytest.raises(ConfigError, match=message):
            ablate.main(changed)
        assert _stamps(tmp_path) == stamps  # refused before the first run: nothing trained or rewritten
    again = ablate.main([*grid, "--time-limit", "600", "--log-every", "1"])
    assert [r["final"] for r in again] == [r["final"] for r in first]
    assert {p: t for p, t in _stamps(tmp_path).items() if p.suffix == ".pt"} == {
        p: t for p, t in stamps.items() if p.suffix == ".pt"}
    more = ablate.main([*grid, "--max-steps", "3"])
    assert load_checkpoint(tmp_path / "a" / "last.pt")["progress"]["step"] == 3
    assert json.loads((tmp_path / "a" / "metrics.final.json").read_text())["steps"] == 3
    assert "resumed from" in (tmp_path / "a" / "log.txt").read_text()
    assert json.loads((tmp_path / "ablation.json").read_text())["shared"][-2:] == ["--max-steps", "3"]
    assert more[0]["final"]["loss"] != first[0]["final"]["loss"]


def test_a_stopped_variant_resumes_only_with_its_flags(tmp_path):
    """A variant stopped by --time-limit resumes in the next command (any --time-limit, more steps),
    but not with a flag that would make the rest of its run another one."""
    grid = ["--out", str(tmp_path), "--variants", "a=", "--", *TINY, "--max-steps", "3", "--eval-every", "3",
            "--no-plots", "--best-metric", "chrf"]
    assert ablate.main([*grid, "--time-limit", "0.001"]) == []
    with pytest.raises(ConfigError, match=r"ablation a: .*a holds a stopped run built otherwise: --warmup-steps 1 "
                                          r"\(the run has"):
        ablate.main([*grid, "--warmup-steps", "1", "--time-limit", "600"])
    assert [r["name"] for r in ablate.main([*grid, "--max-steps", "4", "--time-limit", "600"])] == ["a"]
    assert load_checkpoint(tmp_path / "a" / "last.pt")["progress"]["step"] == 4
    assert json.loads((tmp_path / "ablation.json").read_text())["metric"] == "chrf"  # the runs' --best-metric


def test_another_grids_summary_is_not_replaced(tmp_path):
    """A second grid into the same folder replaced the first one's ablation.json without a word."""
    (tmp_path / "ablation.json").write_text(json.dumps({"runs": [{"name": "a b", "folder": "a-b"}]}))
    with pytest.raises(ConfigError, match=r"ablation\.json is the summary of another grid, with 'a b', which this "
                                          r"one lacks and would replace: give this grid another --out"):
        variant_folders(tmp_path, ["c="], TINY)
    assert [v.name for v in variant_folders(tmp_path, ["a b=", "c="], TINY)] == ["a b", "c"]  # a grid grown
    (tmp_path / "ablation.json").write_text("{")
    with pytest.raises(ConfigError, match=r"ablation\.json is not a grid's summary"):
        variant_folders(tmp_path, ["c="], TINY)


def test_variants_of_different_tasks_need_a_metric_they_all_report(tmp_path):
    """A translation and a classification variant compared by the default metric: the classifier's
    exact_match was NaN and the translation variant "best". Refused before the first run, unless
    --metric names one both report."""
    mt = translation_folder(tmp_path)
    clf = tmp_path / "clf"
    clf.mkdir()
    rows = [{"text": f"text {i}", "label": i % 2} for i in range(8)]
    for split in ("train", "validation"):
        (clf / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (clf / "meta.json").write_text(json.dumps({"task": "classification"}))
    out = tmp_path / "ab"
    variants = ["--variants", f"mt=--data {mt}", f"clf=--data {clf}"]
    with pytest.raises(ConfigError, match=r"the variants train different tasks \('mt': translation, 'clf': "
                                          r"classification\): give --metric, one that every task reports "
                                          r"\(loss, ppl\)"):
        ablate.main(["--out", str(out), *variants, "--", *MODEL])
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"--metric accuracy: variant 'mt' trains translation"):
        ablate.main(["--out", str(out), *variants, "--metric", "accuracy", "--", *MODEL])
    assert [v.name for v in variant_folders(out, variants[1:], MODEL, "loss")] == ["mt", "clf"]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_failed_variant_is_a_user_error_naming_it_after_the_others_ran(tmp_path, capsys, jobs):
    """A variant that fails (here: a last.pt that cannot be read, so its resume stops): under --jobs 2 a
    RuntimeError traceback and exit 1, under --jobs 1 the bare error (no variant named) and the grid
    stopped. Now under either: the others train to their end, then one error naming it, exit 2."""
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "last.pt").write_bytes(b"not a checkpoint")
    grid = ["--out", str(tmp_path), "--jobs", jobs, "--variants", "broken=--heads 1", "base=", "--", *TINY,
            "--max-steps", "2", "--eval-every", "2", "--no-plots"]
    assert ablate.run(grid) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ablation variants failed, the others ran: broken ("), err
    assert "last.pt is not a scratchformer checkpoint" in err and "Traceback" not in err
    if jobs == "2":
        assert f"(exit 2; {tmp_path / 'logs' / 'broken.txt'})" in err
    assert (tmp_path / "base" / "metrics.final.json").exists() and not (tmp_path / "ablation.json").exists()


def test_flags_the_grid_sets_or_cannot_parse_are_refused_naming_the_variant(tmp_path, capsys):
    """A variant's --out was silently replaced by OUT/NAME; an unknown flag printed train's whole usage
    and an unclosed quote a bare "No closing quotation", neither naming the variant."""
    for variants, shared, message in [(["a=--out /elsewhere"], [], r"variant 'a': drop --out: the grid trains each "
                                       r"variant into OUT/NAME"),
                                      (["a="], ["--resume"], r"the shared flags \(after --\): drop --resume"),
                                      (["a=", "b=--overwrite"], [], r"variant 'b': drop --overwrite"),
                                      (["a=", "b=--nosuch 3"], [], r"variant 'b': unrecognized arguments: --nosuch 3"),
                                      (["a=--norm 'pre"], [], r"variant 'a': No closing quotation"),
                                      (["a=--heads 3"], ["--d-model", "32"], r"variant 'a': --d-model 32 is not "
                                       r"divisible by --heads 3"),
                                      (["a="], ["--nosuch"], r"the shared flags \(after --\): unrecognized")]:
        with pytest.raises(ConfigError, match=message):
            variant_folders(tmp_path / "ab", variants, shared)
    assert capsys.readouterr().err == ""  # no usage printed
    assert list(tmp_path.iterdir()) == []


def test_a_variant_whose_data_its_task_cannot_read_is_refused_before_the_first_run(tmp_path):
    """A variant that reads a translation folder as a classifier's (or a folder whose records lack its
    task's fields) failed only when the grid reached it, after the variants before it had trained.
    Its first training record is read when the grid is planned: refused by name, nothing trained."""
    mt = translation_folder(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text(json.dumps({"source": "a b", "summary": "a"}) + "\n")
    out = tmp_path / "ab"
    for variant, message in [(f"clf=--data {mt} --task classification", r"variant 'clf': .*train\.jsonl\.gz:1: missing "
                              r"field 'text' \(classification records need 'text' and 'label'"),
                             (f"bad=--data {bad} --task translation", r"variant 'bad': .*train\.jsonl:1: missing "
                              r"field 'src'")]:
        with pytest.raises(ConfigError, match=message):
            ablate.main(["--out", str(out), "--metric", "loss", "--variants", f"base=--data {mt}", variant, "--",
                         *MODEL])
        assert not out.exists()


def test_a_variant_named_as_a_file_of_the_grid_is_refused_before_the_first_run(tmp_path):
    """A variant "ablation.json" (or "ablation.png") trained every variant, then the summary could not
    be written over its folder ("Is a directory"); under --jobs, variant "logs"'s run folder was the
    console-log folder and its log.txt replaced variant "log"'s console log. Refused by name first."""
    out = tmp_path / "ab"
    for spec, what in [("ablation.json=", "summary"), ("ablation.png=--heads 1", "plot"),
                       ("logs/=", r"console logs \(--jobs\)")]:
        name = spec.split("=")[0]
        with pytest.raises(ConfigError, match=rf"variant name '{name}' makes the folder {re.escape(str(out))}/"
                                              rf"{name.strip('/')}, where the grid writes its {what}: name it "
                                              rf"otherwise"):
            ablate.main(["--out", str(out), "--jobs", "2", "--variants", "log=--heads 1", spec, "--", *TINY,
                         "--max-steps", "1"])
    assert list(tmp_path.iterdir()) == []
    assert [v.folder.name for v in variant_folders(out, ["ablation=", "log=", "logs.2="], TINY)] == [
        "ablation", "log", "logs.2"]


def test_a_variant_name_too_long_for_a_folder_is_refused_before_the_first_run(tmp_path):
    """A variant of 300 characters trained the grid's variants before it, then failed with a traceback
    (OSError: File name too long) making its folder. Refused first; 251 (its console log's name, with
    ".txt", is 255 bytes) makes a folder."""
    with pytest.raises(ConfigError, match=r"variant name 'vvvvvvvvvvvvvvvvvvvv'... makes a folder name of 300 "
                                          r"characters: at most 251"):
        ablate.main(["--out", str(tmp_path / "ab"), "--variants", "ok=", "v" * 300 + "=--heads 1", "--", *TINY])
    assert list(tmp_path.iterdir()) == []
    assert variant_folders(tmp_path / "ab", ["w" * 251 + "="], TINY)[0].folder.name == "w" * 251


def test_a_variant_stopped_under_jobs_is_named_with_the_step_it_resumes_from(tmp_path, capsys):
    """A variant stopped (Ctrl-C, --time-limit) under --jobs was said to stop at its last metrics.jsonl
    row's step (logged every --log-every steps: 600), while its last.pt, which it resumes from, held
    682. Now the step of that checkpoint."""
    grid = ["--out", str(tmp_path), "--jobs", "2", "--variants", "a=", "--", *TINY, "--max-steps", "100000",
            "--epochs", "100000", "--log-every", "100000", "--time-limit", "8", "--no-plots"]
    assert ablate.main(grid) == []
    step = load_checkpoint(tmp_path / "a" / "last.pt")["progress"]["step"]
    rows = [json.loads(line)["step"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert step > max(rows)  # rows: the first step's only
    assert f"=== ablation stopped in a at step {step} (a signal or --time-limit)" in capsys.readouterr().out


def test_a_finished_variant_trained_on_and_stopped_under_jobs_is_stopped_not_finished(tmp_path, capsys):
    """A finished grid given more steps trains its variants on; one stopped by --time-limit under --jobs
    was reported finished with the final report of its earlier end (its metrics.final.json, still there),
    and the grid wrote its summary from it. It is stopped at the step it resumes from, no summary written."""
    grid = ["--out", str(tmp_path), "--jobs", "2", "--variants", "a=", "--", *TINY, "--no-plots", "--epochs", "100000"]
    assert len(ablate.main([*grid, "--max-steps", "2"])) == 1 and (tmp_path / "ablation.json").exists()
    (tmp_path / "ablation.json").unlink()
    capsys.readouterr()
    assert ablate.main([*grid, "--max-steps", "100000", "--time-limit", "8"]) == []  # the command's 8 s
    step = load_checkpoint(tmp_path / "a" / "last.pt")["progress"]["step"]
    assert step > 2 and f"=== ablation stopped in a at step {step}" in capsys.readouterr().out
    assert not (tmp_path / "ablation.json").exists()


def test_a_finished_variant_trained_on_stopped_and_run_again_trains_on(tmp_path, capsys):
    """The same command again after a finished variant, given more steps, was stopped on the way: it
    trains on to its end (its earlier end's metrics.final.json was read back as the run's report, the
    run never trained on, and the summary said 2 steps of a run at 3 with args.json asking 6)."""
    grid = ["--out", str(tmp_path), "--variants", "a=", "--", *TINY, "--no-plots", "--epochs", "100000"]
    ablate.main([*grid, "--max-steps", "2"])
    assert ablate.main([*grid, "--max-steps", "6", "--time-limit", "1e-9"]) == []  # stopped at step 3
    assert load_checkpoint(tmp_path / "a" / "last.pt")["progress"]["step"] == 3
    capsys.readouterr()
    results = ablate.main([*grid, "--max-steps", "6"])
    assert "resumed from" in capsys.readouterr().out
    assert [r["final"]["steps"] for r in results] == [6]
    assert json.loads((tmp_path / "ablation.json").read_text())["runs"][0]["final"]["steps"] == 6


def test_a_finished_variant_whose_step_checkpoints_are_gone_is_read_back(tmp_path, capsys):
    """A finished variant cleaned up to its best.pt (or with no checkpoint at all): its report is read
    back, the run is not trained again from best.pt's earlier step (its report replaced)."""
    grid = ["--out", str(tmp_path), "--variants", "a=", "--", *TINY, "--no-plots", "--max-steps", "4",
            "--eval-every", "1", "--epochs", "100000"]
    ablate.main(grid)
    report = (tmp_path / "a" / "metrics.final.json").read_bytes()
    best = load_checkpoint(tmp_path / "a" / "best.pt")
    best["progress"]["step"] = 1  # as a run whose best was its first validation
    save_checkpoint(tmp_path / "a" / "best.pt", best)
    for kept in ("best.pt", None):
        for p in (tmp_path / "a").glob("*.pt"):
            if p.name != kept:
                p.unlink()
        capsys.readouterr()
        assert [r["final"]["steps"] for r in ablate.main(grid)] == [4]
        assert "read back from" in capsys.readouterr().out
        assert (tmp_path / "a" / "metrics.final.json").read_bytes() == report


def test_the_grids_time_limit_bounds_the_command_not_each_variant(tmp_path, monkeypatch):
    """ablate --time-limit 30: each variant's train command gets what is left of the grid's 30 s when it
    starts (each had the whole 30 s from its own start: a grid of n variants ran n times it)."""
    limits = []

    def train(config, given):
        limits.append(config.time_limit)
        time.sleep(1.0)
        return {"stopped": "--time-limit", "step": 1} if len(limits) == 3 else {"loss": 1.0, "steps": 1}

    monkeypatch.setattr(V, "train", train)
    ablate.main(["--out", str(tmp_path), "--variants", "a=", "b=", "c=", "--", *TINY, "--time-limit", "30"])
    assert len(limits) == 3 and 29 < limits[0] <= 30 and limits[1] <= limits[0] - 1 and limits[2] <= limits[1] - 1


def test_the_best_variant_has_the_lowest_loss_or_perplexity_else_the_highest_score():
    """The summary's best variant (the one a search recipe predicts with): by loss or ppl the lowest, by
    any other metric (bleu, accuracy) the highest; a variant without a number for it is never best."""
    runs = [{"folder": "a", "final": {"loss": 2.0, "ppl": 7.4, "bleu": 20.0}},
            {"folder": "b", "final": {"loss": 1.5, "ppl": 4.5, "bleu": 18.0}},
            {"folder": "c", "final": {"loss": float("nan"), "ppl": float("nan"), "bleu": float("nan")}}]
    assert [best_variant(runs, m) for m in ("loss", "ppl", "bleu")] == ["b", "b", "a"]
    assert best_variant(runs[::-1], "ppl") == "b" and best_variant(runs[2:], "bleu") is None


def test_a_variant_failing_on_a_bug_stops_the_grid_with_its_traceback(tmp_path, monkeypatch):
    """A variant's user error (a ConfigError, say) is collected and the others train (VariantError at the
    end); a bug (any other exception) is no variant's failure to report in a line: it propagates as it is."""
    def fails(error):
        def train(config, given):
            raise error
        return train

    grid = ["--out", str(tmp_path), "--variants", "a=", "--", *TINY, "--max-steps", "1"]
    monkeypatch.setattr(V, "train", fails(ConfigError("--lr too large")))
    with pytest.raises(VariantError, match=r"variants failed, the others ran: a \(no log: .*\): --lr too large"):
        ablate.main(grid)
    monkeypatch.setattr(V, "train", fails(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        ablate.main(grid)


def test_the_grid_compares_greedy_decodings_scores_and_a_tasks_own_metric():
    """A variant's final report flattened for the summary: the teacher-forced numbers with greedy
    decoding's scores (not the beam's), or an extractive run's one decoding's; compared by the task's own
    metric unless --metric (or the shared --best-metric) names one: a classifier's accuracy, a summary's
    ROUGE-Lsum (exact match: 0 for every variant, and the first "best"), a translation's exact_match, else loss."""
    final = {"loss": 2.0, "ppl": 7.4, "steps": 4, "greedy": {"bleu": 20.0, "exact_match": 5.0},
             "beam4": {"bleu": 22.0, "exact_match": 6.0}}
    assert _final_metric(final, None) == ("exact_match", {"loss": 2.0, "ppl": 7.4, "steps": 4, "bleu": 20.0,
                                                          "exact_match": 5.0})
    assert _final_metric(final, "bleu")[0] == "bleu"
    assert _final_metric({"loss": 0.7, "picks": {"rouge1": 40.0}}, None) == ("loss", {"loss": 0.7, "rouge1": 40.0})
    summary = {"loss": 0.7, "greedy": {"bleu": 9.0, "exact_match": 0.0, "rouge1": 30.0, "rougeLsum": 27.0}}
    assert _final_metric(summary, None)[0] == "rougeLsum"
    assert _final_metric({"loss": 0.7, "picks": {"exact_match": 0.0, "rougeLsum": 26.0}}, None)[0] == "rougeLsum"
    assert _final_metric({"loss": 0.5, "ppl": 1.6, "accuracy": 80.0}, None)[0] == "accuracy"


def test_ablate_under_torchrun_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """Under torchrun each variant's train ended the process group and the next one's rejoin hung (rank 0
    in a broadcast, rank 1 in init_process_group), and --jobs would start every variant on every rank."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^ablate runs its variants in this process .* not in torchrun's processes"):
        ablate.main(["--out", str(tmp_path / "ab"), "--variants", "a=", "--", *TINY])
    assert not (tmp_path / "ab").exists()


def test_a_variants_data_option_that_would_do_nothing_is_refused_before_the_first_run(tmp_path):
    """--valid-fraction for data with a validation split (train refuses it) stopped a grid when it reached
    that variant, after the ones before it had trained: refused by name before anything runs."""
    with pytest.raises(ConfigError, match=r"^variant 'b': --valid-fraction carves validation examples from train"):
        ablate.main(["--out", str(tmp_path / "ab"), "--variants", "a=", "b=--valid-fraction 0.2", "--", *TINY])
    assert not (tmp_path / "ab").exists()


def test_the_shared_best_metric_is_the_grids_when_its_variants_are_checked(tmp_path, monkeypatch):
    """The default metric is the shared --best-metric, from the grid's planning on: variants of two tasks
    with a shared --best-metric loss were refused ("give --metric"), though every task reports loss."""
    seen = []

    def planned(out, variants, shared, metric=None):
        seen.append(metric)
        raise ConfigError("planned")
    monkeypatch.setattr(ablation, "variant_folders", planned)
    for flags in (["--best-metric", "loss"], []):
        with pytest.raises(ConfigError, match="^planned$"):
            ablate.main(["--out", str(tmp_path / "ab"), "--variants", "a=", "--", *TINY, *flags])
    assert seen == ["loss", None]


def test_jobs_below_one_is_refused_before_anything_runs(tmp_path):
    """--jobs 0 would start no variant (and share the CPU threads among none): refused by name first."""
    with pytest.raises(ConfigError, match=r"--jobs 0: must be at least 1"):
        ablate.main(["--out", str(tmp_path / "ab"), "--jobs", "0", "--variants", "a=", "--", *TINY])
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_variant_takes_any_budget_and_init_from_a_folder_is_the_checkpoint_its_run_recorded(tmp_path):
    """A variant's earlier run against today's flags: a stopped one (no metrics.final.json) resumes under
    a smaller --max-steps too, as --resume does; a finished one is refused less than it had. --init-from
    naming a run folder is the checkpoint file the run recorded (its best.pt), no change."""
    start, out = tmp_path / "start", tmp_path / "ab"
    start.mkdir()
    (start / "best.pt").write_bytes(b"a checkpoint")
    shared = ["--init-from", str(start), "--max-steps", "4"]
    config, _ = _variant_config("a", "", shared, out / "a")
    (out / "a").mkdir(parents=True)
    recorded = dataclasses.replace(config, init_from=str(start / "best.pt")).to_dict()
    (out / "a" / "args.json").write_text(json.dumps(recorded))
    fewer = ["--init-from", str(start), "--max-steps", "3"]
    assert variant_folders(out, ["a="], fewer)[0].final is None  # stopped: resumed
    (out / "a" / "metrics.final.json").write_text('{"loss": 1.0}')
    assert variant_folders(out, ["a="], shared)[0].final == {"loss": 1.0}  # finished: read back
    with pytest.raises(ConfigError, match=r"ablation a: .*--max-steps 3 \(the run has 4\)"):
        variant_folders(out, ["a="], fewer)
