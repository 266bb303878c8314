"""`train --ema D` (`training/ema.py`): the average follows its recurrence, written here with Python floats;
training is the run's without --ema, bit for bit; validation, best.pt, last.pt and the final report hold
the average; a resumed run goes on like one run."""

import json

import pytest
import torch
from test_train import TINY

from scratchformer import evaluate
from scratchformer import train as T
from scratchformer.checkpoint import load_checkpoint
from scratchformer.training.config import ConfigError
from scratchformer.training.ema import WeightEMA


class _Tied(torch.nn.Module):
    """Two parameters, one of them under two names (as tied embeddings are), and a buffer."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Linear(3, 3, bias=False)
        self.c = torch.nn.Linear(3, 3, bias=False)
        self.c.weight = self.b.weight
        self.register_buffer("steps", torch.tensor([7]))


def test_the_average_follows_its_recurrence_and_warmup():
    """a_1 = d_1 a_0 + (1 - d_1) w_1, ..., d_t = min(D, (1 + t) / (10 + t)), from the initial weights a_0 = w_0,
    in exact arithmetic (Python floats) against the fp32 average; each tied parameter once, both its names
    holding the average; the model holds the average only inside `swapped`."""
    torch.manual_seed(0)
    model, decay = _Tied(), 0.95
    ema = WeightEMA(model, decay)
    expected = [model.a.detach().double().clone(), model.b.weight.detach().double().clone()]
    for step in range(1, 41):
        with torch.no_grad():
            model.a.copy_(torch.randn(3))
            model.b.weight.copy_(torch.randn(3, 3))
        ema.update(step)
        d = min(decay, (1 + step) / (10 + step))
        expected = [d * e + (1 - d) * w.detach().double() for e, w in zip(expected, (model.a, model.b.weight))]
    ckpt = ema.checkpoint()
    assert set(ckpt) == {"model", "training_model"} and set(ckpt["model"]) == {"a", "b.weight", "c.weight", "steps"}
    torch.testing.assert_close(ckpt["model"]["a"].double(), expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ckpt["model"]["b.weight"].double(), expected[1], rtol=0, atol=1e-6)
    assert ckpt["model"]["c.weight"] is ckpt["model"]["b.weight"] and torch.equal(ckpt["model"]["steps"], model.steps)
    assert all(torch.equal(ckpt["training_model"][k], v) for k, v in model.state_dict().items())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped():
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ckpt["model"].items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    # a checkpoint's weights come back: the model's and the average
    other = _Tied()
    again = WeightEMA(other, decay)
    again.load(ckpt)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in weights.items())
    assert all(torch.equal(x, y) for x, y in zip(again.average, ema.average))


def test_without_an_average_a_checkpoint_holds_the_weights_alone():
    model = _Tied()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ema = WeightEMA(model, 0.0)
    ema.update(1)
    ckpt = ema.checkpoint()
    assert set(ckpt) == {"model"} and all(torch.equal(ckpt["model"][k], v) for k, v in weights.items())
    with ema.swapped():
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\) \(0: none\), got 1.0"):
        WeightEMA(model, 1.0)


def _rows(out, split):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == split]


def test_a_run_with_ema_trains_as_without_and_validates_saves_and_reports_the_average(tmp_path):
    """--ema 0.9 against the same run without: the training weights (each checkpoint's "training_model")
    and train rows are the other run's, bit for bit; each checkpoint's "model" is the average, and the
    validation rows, the final report and `evaluate` of those checkpoints score it alike."""
    common = TINY + ["--dropout", "0.1", "--seed", "3", "--eval-every", "4", "--max-steps", "8"]
    T.main(common + ["--out", str(tmp_path / "plain")])
    final = T.main(common + ["--ema", "0.9", "--out", str(tmp_path / "ema")])
    plain, ema = load_checkpoint(tmp_path / "plain" / "last.pt"), load_checkpoint(tmp_path / "ema" / "last.pt")
    assert all(torch.equal(ema["training_model"][k], v) for k, v in plain["model"].items())
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "ema", "train")] == \
        [(r["step"], r["loss"]) for r in _rows(tmp_path / "plain", "train")]
    gap = max(float((ema["model"][k] - v).abs().max()) for k, v in plain["model"].items() if v.is_floating_point())
    assert gap > 1e-5, "the average is not the weights"
    assert ema["args"]["ema"] == 0.9 and "training_model" not in plain
    valid = _rows(tmp_path / "ema", "valid")[-1]
    scored = evaluate.main(["--checkpoint", str(tmp_path / "ema" / "last.pt"), "--limit", "16",  # --max-valid-examples
                            "--out", str(tmp_path / "scored")])
    assert valid["step"] == 8 and scored["loss"] == pytest.approx(valid["loss"], rel=1e-6)
    assert final["loss"] == pytest.approx(valid["loss"], rel=1e-6)  # best.pt (step 8's): the average
    assert valid["loss"] != pytest.approx(_rows(tmp_path / "plain", "valid")[-1]["loss"], rel=1e-6)


def test_a_resumed_run_with_ema_goes_on_like_one_run(tmp_path):
    common = TINY + ["--dropout", "0.1", "--seed", "3", "--eval-every", "3", "--ema", "0.9"]
    T.main(common + ["--max-steps", "10", "--out", str(tmp_path / "straight")])
    T.main(common + ["--max-steps", "5", "--out", str(tmp_path / "split")])
    T.main(["--resume", "--max-steps", "10", "--out", str(tmp_path / "split"), "--no-progress", "--no-plots"])
    a, b = load_checkpoint(tmp_path / "straight" / "last.pt"), load_checkpoint(tmp_path / "split" / "last.pt")
    for key in ("model", "training_model"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key


def test_ema_outside_its_range_is_refused():
    for value in ("1", "-0.1", "nan"):
        with pytest.raises(ConfigError, match=r"--ema"):
            T.main(TINY + ["--ema", value, "--max-steps", "1"])
