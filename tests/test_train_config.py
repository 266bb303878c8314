"""TrainConfig: the one source of the train flags, their defaults, args.json and resume."""

import dataclasses
import json
import math
import re

import pytest
import torch

from scratchformer import train
from scratchformer.device import DeviceError, resolve_device
from scratchformer.model import ModelConfig, get_config
from scratchformer.training.build import model_config_for
from scratchformer.training.config import (
    ConfigError,
    TrainConfig,
    build_parser,
    parse_args,
)
from scratchformer.training.launch import check_for_device, check_for_task, precision_for
from scratchformer.training.resume import check_init_from, resumed

# The train command's options before TrainConfig existed (argparse written by hand), plus the ones
# added since (NEW_FLAGS, at their place): the generated parser must offer exactly these, in order.
OLD_FLAGS = [
    "-h", "--help", "--task", "--dataset", "--data", "--max-train-examples", "--max-valid-examples",
    "--valid-fraction", "--max-src-len", "--max-tgt-len", "--synthetic-seed", "--num-workers", "--threads",
    "--vocab-size", "--separate-vocab", "--tokenizer", "--tokenizer-examples", "--preset", "--kernel", "--d-model",
    "--heads", "--layers", "--encoder-layers", "--decoder-layers", "--d-ff", "--dropout", "--attn-dropout",
    "--activation", "--norm", "--final-norm", "--no-final-norm", "--tie-embeddings", "--no-pos-encoding", "--epochs",
    "--max-steps", "--batch-size", "--max-tokens", "--grad-accum", "--lr", "--schedule", "--warmup-steps", "--min-lr",
    "--plateau-patience", "--weight-decay", "--adam-betas", "--adam-eps", "--label-smoothing", "--clip-norm",
    "--precision", "--seed", "--eval-every", "--eval-decode-examples", "--best-metric", "--patience", "--beam-size",
    "--save-every", "--keep-checkpoints", "--resume", "--out", "--overwrite", "--device", "--log-every",
    "--no-progress", "--tensorboard", "--attention-example", "--no-plots",
]
# flag: the flag it comes before
NEW_FLAGS = {"--copy": "--epochs", "--time-budget": "--batch-size", "--compile": "--precision",
             "--compile-mode": "--precision", "--cuda-graphs": "--precision", "--no-cuda-graphs": "--precision",
             "--pad-multiple": "--grad-accum", "--ffn-dropout": "--activation", "--word-dropout": "--activation",
             "--time-limit": "--resume", "--init-from": "--resume", "--bpe-dropout": "--preset",
             "--summary-sentences": "--save-every", "--summary-words": "--save-every", "--rdrop": "--clip-norm",
             "--recompute-activations": "--precision", "--no-recompute-activations": "--precision",
             "--ema": "--compile"}

# args.json as the code before TrainConfig wrote it (results/imdb-cpu-classifier-512, resumed):
# no "overwrite" yet, "resume_path" added by --resume.
OLD_ARGS_JSON = """{"task": null, "dataset": "imdb", "data": null, "max_train_examples": null,
 "max_valid_examples": null, "valid_fraction": 0.05, "max_src_len": 512, "max_tgt_len": 2, "synthetic_seed": 1234,
 "num_workers": 0, "threads": 2, "vocab_size": 8000, "separate_vocab": false, "tokenizer": null,
 "tokenizer_examples": null, "preset": "classifier", "kernel": "auto", "d_model": 64, "heads": 2, "layers": null,
 "encoder_layers": null, "decoder_layers": null, "d_ff": 256, "dropout": null, "attn_dropout": null,
 "activation": null, "norm": null, "final_norm": null, "tie_embeddings": null, "no_pos_encoding": false,
 "epochs": 4, "max_steps": null, "batch_size": null, "max_tokens": 16384, "grad_accum": 1, "lr": 0.001,
 "schedule": "cosine", "warmup_steps": 300, "min_lr": 0.0, "plateau_patience": 2, "weight_decay": 0.01,
 "adam_betas": [0.9, 0.98], "adam_eps": 1e-09, "label_smoothing": 0.1, "clip_norm": 1.0, "precision": "fp32",
 "seed": 0, "eval_every": 0, "eval_decode_examples": 0, "best_metric": "accuracy", "patience": 0, "beam_size": 4,
 "save_every": 0, "keep_checkpoints": 3, "resume": "last", "out": "runs/imdb-cpu2", "device": null,
 "log_every": 50, "no_progress": true, "tensorboard": false, "attention_example": 0, "no_plots": false,
 "resume_path": "runs/imdb-cpu2/last.pt"}"""


def test_parser_is_generated_from_every_field(capsys):
    parser = build_parser()
    flags = [s for a in parser._actions for s in a.option_strings]
    want = list(OLD_FLAGS)
    for flag, before in NEW_FLAGS.items():
        want.insert(want.index(before), flag)
    assert flags == want + ["--debug"]  # --debug: the commands' traceback switch (cli.run), not a field
    dests = {a.dest for a in parser._actions} - {"help", "debug"}
    fields = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata["cli"]}
    assert dests == fields  # one flag per field, nothing else
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    for f in fields:
        assert "--" + f.replace("_", "-") in text, f
    flat = " ".join(text.split())  # the defaults shown are generated from the fields, data-dependent ones too
    assert "BPE vocabulary size (default: 400 synthetic, 8000 real data)" in flat
    assert "--grad-accum GRAD_ACCUM batches accumulated per optimizer step (default: 1)" in flat


def test_defaults_come_from_the_class_and_given_flags_are_known():
    cfg, given = parse_args([])
    assert cfg == TrainConfig() and given == frozenset()
    cfg, given = parse_args(["--lr", "3e-3", "--adam-betas", "0.8", "0.9", "--final-norm", "--resume",
                             "--tokenizer", "a.json", "b.json", "--no-plots"])
    assert given == {"lr", "adam_betas", "final_norm", "resume", "tokenizer", "no_plots"}
    assert (cfg.lr, cfg.adam_betas, cfg.final_norm, cfg.resume, cfg.tokenizer, cfg.no_plots) == (
        3e-3, (0.8, 0.9), True, "last", ["a.json", "b.json"], True)
    assert parse_args(["--no-final-norm"])[0].final_norm is False
    assert cfg.valid_fraction == 0.05 and cfg.grad_accum == 1  # untouched fields keep the class defaults


def test_json_round_trip():
    cfg, _ = parse_args(["--adam-betas", "0.8", "0.9", "--tokenizer", "t.json", "--out", "runs/x"])
    cfg = cfg.resolved("translation", synthetic=False)
    text = json.dumps(cfg.to_dict(), indent=2)
    back = TrainConfig(**json.loads(text))
    assert back == cfg and isinstance(back.adam_betas, tuple)
    assert json.loads(text)["adam_betas"] == [0.8, 0.9]


def test_data_dependent_defaults_resolved_once():
    # No data-dependent option has a class default: None until the data is known.
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["by_data"]:
            assert f.default is None, f.name
    syn = TrainConfig().resolved("translation", synthetic=True)
    assert (syn.preset, syn.d_model, syn.heads, syn.layers, syn.d_ff, syn.dropout, syn.vocab_size) == (
        "tiny", 64, 4, 2, 256, 0.1, 400)
    assert (syn.max_src_len, syn.max_tgt_len, syn.batch_size, syn.max_tokens, syn.epochs, syn.max_steps) == (
        32, 32, 64, None, None, 1500)
    assert (syn.lr, syn.warmup_steps, syn.eval_every, syn.eval_decode_examples, syn.threads, syn.best_metric) == (
        2e-3, 100, 500, 300, 1, "loss")
    mt = TrainConfig().resolved("translation", synthetic=False)
    assert (mt.preset, mt.d_model, mt.vocab_size, mt.max_src_len, mt.max_tgt_len, mt.max_tokens, mt.batch_size) == (
        "small", None, 8000, 128, 128, 4096, None)
    assert (mt.epochs, mt.max_steps, mt.lr, mt.warmup_steps, mt.eval_every, mt.eval_decode_examples) == (
        10, None, 5e-4, 1000, 0, 500)
    assert (mt.threads, mt.best_metric) == (None, "loss")
    summ = TrainConfig().resolved("summarization", synthetic=False)
    assert (summ.max_src_len, summ.max_tgt_len, summ.lr) == (512, 128, 5e-4)
    clf = TrainConfig().resolved("classification", synthetic=False)
    assert (clf.preset, clf.max_src_len, clf.max_tgt_len, clf.lr, clf.warmup_steps, clf.max_tokens) == (
        "classifier", 256, 2, 1e-3, 200, 16384)
    assert (clf.eval_decode_examples, clf.best_metric, clf.epochs) == (0, "accuracy", 10)
    # given values win, and resolving again changes nothing
    given, _ = parse_args(["--lr", "7e-4", "--max-src-len", "64", "--preset", "base"])
    r = given.resolved("classification", synthetic=False)
    assert (r.lr, r.max_src_len, r.preset, r.warmup_steps) == (7e-4, 64, "base", 200)
    assert r.resolved("classification", synthetic=False) == r
    # --max-steps given alone bounds a real-data run: no default epochs beside it; given both, both stay
    steps, _ = parse_args(["--max-steps", "3000"])
    assert steps.resolved("translation", synthetic=False).epochs is None
    both, _ = parse_args(["--max-steps", "3000", "--epochs", "2"])
    assert both.resolved("translation", synthetic=False).epochs == 2


def test_old_args_json_loads():
    old = json.loads(OLD_ARGS_JSON)
    cfg = TrainConfig(**old)
    assert cfg.overwrite is False  # a field the old file lacks takes its default
    assert cfg.adam_betas == (0.9, 0.98) and cfg.max_src_len == 512 and cfg.resume_path == "runs/imdb-cpu2/last.pt"
    assert TrainConfig.from_dict({**old, "a_flag_since_removed": 1}) == cfg
    assert TrainConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_resume_keeps_the_run_config_except_given_flags():
    saved = json.loads(OLD_ARGS_JSON)
    now, given = parse_args(["--resume", "--max-steps", "99", "--out", "runs/y", "--no-plots"])
    cfg = resumed(now, given, saved, "runs/y/last.pt")
    assert (cfg.max_steps, cfg.out, cfg.no_plots, cfg.resume, cfg.resume_path) == (
        99, "runs/y", True, "last", "runs/y/last.pt")
    assert (cfg.lr, cfg.schedule, cfg.dataset, cfg.epochs) == (1e-3, "cosine", "imdb", 4)
    assert not cfg.no_progress  # a command's own (`test_a_commands_own_options_are_not_taken_from_the_run`)


# --- options refused by name, before any work -------------------------------------------------

BAD_OPTIONS = [
    (["--max-steps", "0"], r"--max-steps must be an integer >= 1, got 0 \(leave it out"),
    (["--max-steps", "-3"], r"--max-steps must be an integer >= 1, got -3"),
    (["--epochs", "0"], r"--epochs must be an integer >= 1, got 0"),
    (["--beam-size", "0"], r"--beam-size must be an integer >= 1, got 0"),
    (["--beam-size", "-2"], r"--beam-size must be an integer >= 1, got -2"),
    (["--max-train-examples", "0"], r"--max-train-examples must be an integer >= 1, got 0"),
    (["--max-valid-examples", "-1"], r"--max-valid-examples must be an integer >= 1, got -1"),
    (["--heads", "0"], r"--heads must be an integer >= 1, got 0"),
    (["--d-model", "0"], r"--d-model must be an integer >= 2, got 0"),
    (["--d-model", "64", "--heads", "5"], r"--d-model 64 is not divisible by --heads 5"),
    (["--d-model", "33"], r"--d-model must be even"),
    (["--layers", "0"], r"--layers must be an integer >= 1, got 0"),
    (["--d-ff", "0"], r"--d-ff must be an integer >= 1, got 0"),
    (["--vocab-size", "0"], r"--vocab-size must be an integer >= 260, got 0"),
    (["--grad-accum", "0"], r"--grad-accum must be an integer >= 1, got 0"),
    (["--log-every", "0"], r"--log-every must be an integer >= 1, got 0"),
    (["--lr", "0"], r"--lr must be a finite number in \(0, inf\), got 0"),
    (["--lr", "-1"], r"--lr must be a finite number in \(0, inf\), got -1"),
    (["--lr", "nan"], r"--lr must be a finite number .*got nan"),
    (["--lr", "inf"], r"--lr must be a finite number .*got inf"),
    (["--dropout", "-0.1"], r"--dropout must be a finite number in \[0, 1\), got -0.1"),
    (["--dropout", "1"], r"--dropout must be a finite number in \[0, 1\), got 1"),
    (["--attn-dropout", "1.5"], r"--attn-dropout must be a finite number in \[0, 1\)"),
    (["--label-smoothing", "1"], r"--label-smoothing must be a finite number in \[0, 1\)"),
    (["--valid-fraction", "0"], r"--valid-fraction must be a finite number in \(0, 1\)"),
    (["--clip-norm", "-1"], r"--clip-norm must be a finite number in \[0, inf\)"),
    (["--adam-betas", "0.9", "1.0"], r"--adam-betas must be two numbers in \[0, 1\)"),
    (["--data", "d", "--dataset", "multi30k"], r"--data d and --dataset multi30k both name the data"),
    (["--resume", "--overwrite"], r"--resume continues a run and --overwrite replaces it"),
    (["--seed", "-1"], r"--seed must be an integer >= 0, got -1"),  # numpy's generators refuse it, deep in the data
    (["--synthetic-seed", "-2"], r"--synthetic-seed must be an integer >= 0, got -2"),
    (["--lr", "1e-3", "--min-lr", "2e-3"], r"--min-lr 0.002 is the floor .* from --lr 0.001: it cannot be above"),
    (["--tokenizer", "a", "b", "c"], r"--tokenizer takes one file \(shared\) or two"),
    (["--tie-embeddings", "all", "--separate-vocab"],  # equal sizes of the two made a model that mixed them up
     r"--tie-embeddings all gives a source token and the target token of the same id one embedding: it needs one "
     r"shared vocabulary \(drop --separate-vocab\)"),
    (["--tie-embeddings", "all", "--tokenizer", "a", "b"], r"it needs one shared vocabulary \(drop the second "
                                                          r"--tokenizer\)"),
    (["--compile-mode", "reduce-overhead"], r"--compile-mode reduce-overhead is an inductor mode: it needs --compile "
                                            r"\(inductor\), which is not given \(--compile-mode none: none\)"),
    (["--max-tokens", "512", "--pad-multiple", "1000"], r"--pad-multiple 1000 pads every batch past --max-tokens 512"),
    (["--threads", "100000"], r"--threads must be an integer >= 1 and <= 1024, got 100000"),  # the tokenizers crashed
    (["--compile", "aot_eager", "--compile-mode", "max-autotune"], r"needs --compile \(inductor\), got --compile aot"),
    (["--compile", "nosuch"], r"--compile nosuch: torch.compile has no such backend; it has .*inductor"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_options_are_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_config_from_a_file_is_checked_too():
    with pytest.raises(ConfigError, match=r"--schedule 'bogus' is not one of inverse_sqrt"):
        TrainConfig.from_dict({**json.loads(OLD_ARGS_JSON), "schedule": "bogus"})
    with pytest.raises(ConfigError, match=r"--max-steps must be an integer >= 1, got '3'"):
        TrainConfig.from_dict({**json.loads(OLD_ARGS_JSON), "max_steps": "3"})
    assert TrainConfig(max_steps=None).max_steps is None  # None is "unset", 0 is refused


def test_checks_that_need_the_task():
    cfg = TrainConfig(best_metric="bogus").resolved("translation", synthetic=True)
    with pytest.raises(ConfigError, match=r"--best-metric bogus: translation validation computes loss, ppl, bleu"):
        check_for_task(cfg, "translation")
    with pytest.raises(ConfigError, match=r"--best-metric rougeL: translation validation computes"):
        check_for_task(TrainConfig(best_metric="rougeL"), "translation")
    check_for_task(TrainConfig(best_metric="rougeL", eval_decode_examples=5), "summarization")
    with pytest.raises(ConfigError, match=r"--best-metric bleu is a decoding metric: it needs --eval-decode-examples"):
        check_for_task(TrainConfig(best_metric="bleu", eval_decode_examples=0), "translation")
    with pytest.raises(ConfigError, match=r"--best-metric bleu: classification validation computes loss, ppl, acc"):
        check_for_task(TrainConfig(best_metric="bleu").resolved("classification", synthetic=False), "classification")
    with pytest.raises(ConfigError, match=r"--decoder-layers 0 makes no decoder; translation needs at least 1"):
        check_for_task(TrainConfig(decoder_layers=0), "translation")
    with pytest.raises(ConfigError, match=r"--preset classifier is a classifier; pick a seq2seq preset"):
        check_for_task(TrainConfig(preset="classifier"), "summarization")


def test_device_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"--device cuda: no CUDA device here .*; use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match=r"--device gpu0: not a device"):
        resolve_device("gpu0")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")


def test_on_a_machine_with_two_gpus_the_device_is_the_first_by_default_and_cuda_2_is_refused(monkeypatch):
    """No --device: cuda where there is one; cuda:N for N < the machine's count, the indices 0 and 1 of
    two GPUs, and a clear error for cuda:2 (torch's own came later, an AssertionError). Two GPUs
    stood in for here: `torch.cuda` asked only how many there are, before any tensor is made."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert resolve_device(None) == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(DeviceError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\)$"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["meta", "mps", "xpu:0", "cpu:0"])
def test_device_the_project_cannot_run_on_is_refused(name):
    """--device meta failed after step 1 (Tensor.item on meta) and left a half-built run folder; mps failed in
    model.to: every command refuses them here, before any work, naming what it runs on."""
    if name == "cpu:0":  # a cpu with an index is still the cpu
        assert resolve_device(name).type == "cpu"
        return
    with pytest.raises(DeviceError, match=rf"--device {name}: scratchformer runs on cpu or cuda\[:N\] only, not "
                                          rf"{name.split(':')[0]}"):
        resolve_device(name)


def test_train_on_a_meta_device_is_refused_before_its_run_folder(tmp_path):
    """train --device meta used to leave args.json, config.json and tokenizer.json behind (then needing
    --overwrite): resolve_device refuses it before the run folder is made."""
    with pytest.raises(DeviceError, match=r"--device meta: scratchformer runs on cpu or cuda"):
        train.main(["--device", "meta", "--max-steps", "1", "--out", str(tmp_path / "run")])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "plateau", "--min-lr", "1e-5"], "--min-lr is for --schedule cosine; this run's is plateau: "
                                                     "drop --min-lr"),
    (["--min-lr", "1e-5"], "--min-lr is for --schedule cosine; this run's is inverse_sqrt"),
    (["--schedule", "cosine", "--plateau-patience", "4"], "--plateau-patience is for --schedule plateau; this run's "
                                                          "is cosine"),
])
def test_an_option_of_another_schedule_is_refused_before_any_work(tmp_path, flags, message):
    """--min-lr floors only the cosine, --plateau-patience counts only for plateau: given for another
    schedule, each is refused naming both, before the run folder is made. Every schedule warms up
    for --warmup-steps; a plateau run's default is none (recorded 0, not the by-data default)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        train.main([*flags, "--max-steps", "1", "--out", str(tmp_path / "run")])
    assert list(tmp_path.iterdir()) == []
    config, _ = parse_args(["--schedule", "plateau"])
    assert config.resolved("translation", False).warmup_steps == 0
    warmed, _ = parse_args(["--schedule", "plateau", "--warmup-steps", "50"])
    assert warmed.resolved("translation", False).warmup_steps == 50
    assert config.resolved("translation", False).lr == parse_args([])[0].resolved("translation", False).lr


def test_resume_refuses_flags_that_cannot_change():
    saved = json.loads(OLD_ARGS_JSON)
    now, given = parse_args(["--resume", "--d-model", "128", "--heads", "8", "--lr", "3e-4", "--out", "runs/y"])
    with pytest.raises(ConfigError, match=r"--resume continues the run of runs/y/last.pt as it was built: --d-model "
                       r"128 \(the run has 64\); --heads 8 \(the run has 2\) cannot change; drop them"):
        resumed(now, given, saved, "runs/y/last.pt")
    # the same value as the run's is no change; lr, max-steps, evaluation flags may change
    now, given = parse_args(["--resume", "--d-model", "64", "--lr", "3e-4", "--max-steps", "9", "--beam-size", "2"])
    cfg = resumed(now, given, saved, "runs/y/last.pt")
    assert (cfg.d_model, cfg.lr, cfg.max_steps, cfg.beam_size, cfg.overwrite) == (64, 3e-4, 9, 2, False)
    now, given = parse_args(["--resume", "--lr", "3e-4"])
    with pytest.raises(ConfigError, match=r"--lr cannot change when resuming a --schedule plateau run"):
        resumed(now, given, {**saved, "schedule": "plateau"}, "runs/y/last.pt")
    # a run started with --overwrite resumes (its saved overwrite is not a second wish to replace it)
    assert resumed(*parse_args(["--resume"]), {**saved, "overwrite": True}, "r/last.pt").overwrite is False


def test_a_model_option_the_run_left_unset_is_compared_with_the_model_it_built():
    """A run whose --dropout was unset (its preset's 0.1) resumed with --dropout 0.1: no change (it was
    refused, "the run has unset"); another value is refused naming the built one."""
    saved = {**json.loads(OLD_ARGS_JSON), "dropout": None, "norm": None, "tie_embeddings": None}
    built = {"dropout": 0.1, "norm": "post", "tie_embeddings": "none", "d_model": 64}
    now, given = parse_args(["--resume", "--dropout", "0.1", "--norm", "post", "--tie-embeddings", "none"])
    assert resumed(now, given, saved, "r/last.pt", built).dropout == 0.1
    now, given = parse_args(["--resume", "--dropout", "0.2", "--norm", "pre"])
    with pytest.raises(ConfigError, match=r"--dropout 0\.2 \(the run has 0\.1\); --norm pre \(the run has post\) "
                                          r"cannot change"):
        resumed(now, given, saved, "r/last.pt", built)
    with pytest.raises(ConfigError, match=r"--dropout 0\.1 \(the run has unset\)"):  # no model config: as before
        resumed(*parse_args(["--resume", "--dropout", "0.1"]), saved, "r/last.pt")
    # the layer counts too: --layers N where encoder and decoder have N each (an encoder-only model: its encoder's)
    saved = {**saved, "layers": None, "encoder_layers": None, "decoder_layers": None}
    for built, argv in (({"n_encoder_layers": 6, "n_decoder_layers": 6}, ["--layers", "6", "--decoder-layers", "6"]),
                        ({"n_encoder_layers": 4, "n_decoder_layers": 0}, ["--layers", "4", "--encoder-layers", "4"])):
        assert resumed(*parse_args(["--resume", *argv]), saved, "r/last.pt", built).layers == int(argv[1])
    with pytest.raises(ConfigError, match=r"--layers 6 \(the run has unset\)"):  # 3 + 6: no one count
        resumed(*parse_args(["--resume", "--layers", "6"]), saved, "r/last.pt", {"n_encoder_layers": 3,
                                                                                "n_decoder_layers": 6})
    with pytest.raises(ConfigError, match=r"--encoder-layers 2 \(the run has 3\)"):
        resumed(*parse_args(["--resume", "--encoder-layers", "2"]), saved, "r/last.pt", {"n_encoder_layers": 3,
                                                                                        "n_decoder_layers": 6})


def test_a_commands_own_options_are_not_taken_from_the_run():
    """--time-limit, --tensorboard, --no-progress and --no-plots are a command's: a resume takes them as
    given, else their defaults (the run's --time-limit paused every resume, and nothing turned it off; a
    --tensorboard run needed the package wherever it was resumed; no resume of a --no-plots run drew any)."""
    saved = {**json.loads(OLD_ARGS_JSON), "time_limit": 0.5, "tensorboard": True, "no_progress": True,
             "no_plots": True}
    cfg = resumed(*parse_args(["--resume"]), saved, "r/last.pt")
    assert (cfg.time_limit, cfg.tensorboard, cfg.no_progress, cfg.no_plots) == (None, False, False, False)
    cfg = resumed(*parse_args(["--resume", "--time-limit", "7", "--no-progress", "--no-plots"]), saved, "r/last.pt")
    assert (cfg.time_limit, cfg.tensorboard, cfg.no_progress, cfg.no_plots) == (7, False, True, True)


def test_a_resumed_runs_compile_options_are_checked_with_the_runs_and_may_be_turned_off():
    """A run trained with --compile --compile-mode reduce-overhead resumes with its compile options
    (`resumed`). The checks of options together ran on the command line alone: --resume --compile-mode
    default was refused as "needs --compile, which is not given" of a run that compiles with inductor.
    They run on the merged options, and `none` turns an inherited --compile or --compile-mode off (there
    was no way to resume such a run uncompiled or under --cuda-graphs)."""
    saved = {**json.loads(OLD_ARGS_JSON), "compile": "inductor", "compile_mode": "reduce-overhead"}
    assert resumed(*parse_args(["--resume", "--compile-mode", "default"]), saved, "r/last.pt").compile_mode == "default"
    with pytest.raises(ConfigError, match=re.escape("--cuda-graphs captures the uncompiled step; --compile inductor "
                                                    "compiles it: give one (--compile none: not compiled)")):
        resumed(*parse_args(["--resume", "--cuda-graphs"]), saved, "r/last.pt")
    with pytest.raises(ConfigError, match=re.escape("--compile-mode reduce-overhead is an inductor mode: it needs "
                                                    "--compile (inductor), which is not given (--compile-mode none")):
        resumed(*parse_args(["--resume", "--compile", "none"]), saved, "r/last.pt")
    cfg = resumed(*parse_args(["--resume", "--cuda-graphs", "--compile", "none", "--compile-mode", "none"]), saved,
                  "r/last.pt")
    assert (cfg.compile, cfg.compile_mode, cfg.cuda_graphs) == (None, None, True)
    assert TrainConfig.from_dict(cfg.to_dict()).compile is None  # as args.json records it


def test_reduce_overhead_is_refused_off_a_gpu():
    """--compile-mode reduce-overhead replays inductor's CUDA graphs: on the CPU inductor skips them
    without a word, the flag accepted and doing nothing. Refused by name, as --cuda-graphs is."""
    cfg, _ = parse_args(["--compile", "--compile-mode", "reduce-overhead"])
    with pytest.raises(ConfigError, match=r"--compile-mode reduce-overhead replays CUDA graphs: it needs a GPU, and "
                                          r"the device is cpu; drop it"):
        check_for_device(cfg, "cpu", 1)
    check_for_device(cfg, "cuda", 1)
    check_for_device(parse_args(["--compile", "--compile-mode", "max-autotune"])[0], "cpu", 1)
    # a resumed GPU run's options are not the command line's: each refusal names the flag that turns its option off
    for argv, off in ((["--compile", "--compile-mode", "reduce-overhead"], "--compile-mode default"),
                      (["--cuda-graphs"], "--no-cuda-graphs")):
        with pytest.raises(ConfigError, match=f"give {off} \\(a resumed run's"):
            check_for_device(parse_args(argv)[0], "cpu", 1)
    with pytest.raises(ConfigError, match=r"^--precision bf16 needs a GPU; give --precision fp32 on cpu"):
        precision_for("bf16", torch.device("cpu"))


@pytest.mark.parametrize("flag, value, was", [("--max-src-len", "256", "512"), ("--max-tgt-len", "8", "2"),
                                              ("--vocab-size", "4000", "8000"), ("--seed", "3", "0"),
                                              ("--max-tokens", "4096", "16384"), ("--dataset", "samsum", "imdb")])
def test_resume_refuses_a_change_of_the_data_its_encoding_the_batching_or_the_seed(flag, value, was):
    """What the checkpoint's model was trained on and how (its data and their encoding, the tokenizer, the
    batching the epoch position counts in, the seed of the batch order) cannot change on --resume."""
    now, given = parse_args(["--resume", flag, value])
    with pytest.raises(ConfigError, match=rf"--resume continues the run of r/last.pt as it was built: {flag} {value} "
                       rf"\(the run has {was}\) cannot change; drop it"):
        resumed(now, given, json.loads(OLD_ARGS_JSON), "r/last.pt")


def test_init_from_refuses_every_model_and_tokenizer_option_but_the_kernel():
    """--init-from builds its checkpoint's model and tokenizers: a model option or a tokenizer one given with
    it is refused by name; the backend (--kernel) and the data, optimizer and run options are taken."""

    for argv, named in ((["--d-model", "64"], "--d-model"), (["--vocab-size", "500"], "--vocab-size"),
                        (["--separate-vocab"], "--separate-vocab"), (["--heads", "4"], "--heads")):
        _, given = parse_args(["--init-from", "x.pt", *argv])
        with pytest.raises(ConfigError, match=rf"--init-from x.pt builds the model and tokenizers of that run: drop "
                           rf"{named} \(only --kernel may change\)"):
            check_init_from(given, "x.pt")
    _, given = parse_args(["--init-from", "x.pt", "--kernel", "eager", "--lr", "1e-4", "--max-src-len", "64"])
    check_init_from(given, "x.pt")


def test_model_config_refuses_impossible_sizes():
    for kw, message in [(dict(d_model=0), r"d_model must be an integer >= 1, got 0"),
                        (dict(n_heads=0), r"n_heads must be an integer >= 1, got 0"),
                        (dict(n_encoder_layers=-1), r"n_encoder_layers must be an integer >= 0, got -1"),
                        (dict(n_decoder_layers=-1), r"n_decoder_layers must be an integer >= 0, got -1"),
                        (dict(n_decoder_layers=0), r"n_decoder_layers is 0: only the encoder-only models"),
                        (dict(num_classes=2), r"the classifier has no decoder, but n_decoder_layers is 6"),
                        (dict(extractive=True), r"the extractive summarizer has no decoder, but n_decoder_layers is 6"),
                        (dict(n_decoder_layers=0, num_classes=2, extractive=True),
                         r"a model is a classifier or an extractive summarizer, not both"),
                        (dict(src_vocab_size=0), r"src_vocab_size must be an integer >= 1, got 0"),
                        (dict(tgt_vocab_size=0), r"tgt_vocab_size must be an integer >= 1, got 0"),
                        (dict(d_ff=0), r"d_ff must be an integer >= 1, got 0"),
                        (dict(layer_norm_eps=-1e-5), r"layer_norm_eps must be a positive finite number"),
                        (dict(layer_norm_eps=0.0), r"layer_norm_eps must be a positive finite number, got 0.0"),
                        (dict(layer_norm_eps=math.inf), r"layer_norm_eps must be a positive finite number, got inf"),
                        (dict(layer_norm_eps="1e-5"), r"layer_norm_eps must be a positive finite number, got '1e-5'"),
                        (dict(max_len=0), r"max_len must be an integer >= 1, got 0"),
                        (dict(n_heads=True), r"n_heads must be an integer >= 1, got True"),  # True == 1: one head
                        # sin and cos fill the model's dimensions in pairs (the paper's PE(pos, 2i), PE(pos, 2i + 1))
                        (dict(d_model=33, n_heads=3), r"d_model must be even for sinusoidal positions, got 33"),
                        # p = 1 drops every value and scales by 1 / (1 - p); a bool is no probability (False == 0)
                        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
                        (dict(attn_dropout=False), r"attn_dropout must be in \[0, 1\), got False"),
                        (dict(pad_id=7), r"pad_id is the tokenizer's <pad> id, 0; got 7")]:  # was ignored
        with pytest.raises(ValueError, match=message):
            ModelConfig(**kw)
    with pytest.raises(ValueError, match=r"num_classes must be an integer >= 2, got 1"):
        get_config("classifier", num_classes=1)
    assert get_config("classifier").n_decoder_layers == 0  # the classifier has no decoder


def test_the_model_options_reach_its_config_with_a_position_for_every_token():
    """`model_config_for`: the preset with the options given (--layers for both stacks, --encoder-layers
    and --decoder-layers over it, --no-pos-encoding) and the vocabulary sizes; max_len the preset's
    (4096) or, when longer, the longest source padded to --pad-multiple plus BOS (5000 padded to 64s:
    5056, + 1). A classifier preset for a seq2seq task is refused by name."""
    def planned(*flags):
        cfg, _ = parse_args(["--preset", "tiny", *flags])
        return model_config_for(cfg.resolved("translation", True), "translation", (300, 310), None)

    m = planned("--layers", "2", "--no-pos-encoding")
    assert (m.n_encoder_layers, m.n_decoder_layers, m.pos_encoding, m.src_vocab_size, m.tgt_vocab_size) == (
        2, 2, False, 300, 310)
    m = planned("--layers", "2", "--encoder-layers", "4", "--decoder-layers", "1")
    assert (m.n_encoder_layers, m.n_decoder_layers, m.pos_encoding) == (4, 1, True)
    assert planned().max_len == 4096
    assert planned("--max-src-len", "5000", "--pad-multiple", "64").max_len == 5057
    with pytest.raises(ConfigError, match=r"preset 'classifier' is a classifier; pick a seq2seq preset for transl"):
        planned("--preset", "classifier")
