"""Checkpoints: round trip, atomic writes, refusal of truncated/corrupt/unsafe files."""

import os
import random

import numpy as np
import pytest
import torch

from scratchformer import checkpoint as C


def state(v=1.0):
    return {"model": {"w": torch.full((3, 2), v), "b": torch.zeros(2)}, "progress": {"step": 7, "best": None},
            "args": {"betas": [0.9, 0.98], "name": "x", "inf": float("inf")}, "rng": C.rng_state()}


def test_round_trip_and_no_temp_left(tmp_path):
    p = C.save_checkpoint(tmp_path / "last.pt", state())
    s = C.load_checkpoint(p)
    assert torch.equal(s["model"]["w"], torch.ones(3, 2)) and s["progress"] == {"step": 7, "best": None}
    assert s["args"]["inf"] == float("inf")
    assert sorted(os.listdir(tmp_path)) == ["last.pt"]


def test_truncated_refused_and_previous_intact(tmp_path):
    p = C.save_checkpoint(tmp_path / "last.pt", state(1.0))
    good = p.read_bytes()
    C.save_checkpoint(tmp_path / "step.pt", state(2.0))
    (tmp_path / "step.pt").write_bytes((tmp_path / "step.pt").read_bytes()[:-100])
    with pytest.raises(C.CheckpointError, match="truncated"):
        C.load_checkpoint(tmp_path / "step.pt")
    (tmp_path / "tiny.pt").write_bytes(good[:20])
    with pytest.raises(C.CheckpointError, match="not a scratchformer checkpoint"):
        C.load_checkpoint(tmp_path / "tiny.pt")
    assert C.load_checkpoint(p)["model"]["w"][0, 0] == 1.0


def test_corrupt_refused(tmp_path):
    p = C.save_checkpoint(tmp_path / "c.pt", state())
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF  # one flipped byte inside the payload
    p.write_bytes(bytes(b))
    with pytest.raises(C.CheckpointError, match="corrupt: SHA-256"):
        C.load_checkpoint(p)
    with pytest.raises(C.CheckpointError, match="does not exist"):
        C.load_checkpoint(tmp_path / "missing.pt")


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    p = C.save_checkpoint(tmp_path / "last.pt", state(1.0))

    def crash(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(C.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        C.save_checkpoint(p, state(5.0))
    monkeypatch.undo()
    assert C.load_checkpoint(p)["model"]["w"][0, 0] == 1.0  # the old file is untouched
    assert (tmp_path / "last.pt.tmp").exists()  # only the temp file holds the torn write


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_unpickling_arbitrary_objects_refused(tmp_path):
    p = C.save_checkpoint(tmp_path / "evil.pt", {"model": {}, "x": Evil()})
    with pytest.raises(C.CheckpointError, match="cannot load payload"):
        C.load_checkpoint(p)


def test_rng_state_round_trip(tmp_path):
    C.save_checkpoint(tmp_path / "r.pt", {"rng": C.rng_state()})
    a = (random.random(), float(np.random.rand()), torch.rand(3))
    C.set_rng_state(C.load_checkpoint(tmp_path / "r.pt")["rng"])
    b = (random.random(), float(np.random.rand()), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_prune_and_find(tmp_path):
    for s in (5, 10, 15, 20):
        C.save_checkpoint(tmp_path / f"step_{s:07d}.pt", {"s": s})
    C.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in C.step_checkpoints(tmp_path)] == ["step_0000015.pt", "step_0000020.pt"]
    assert C.find_checkpoint(tmp_path).name == "step_0000020.pt"
    C.save_checkpoint(tmp_path / "last.pt", {})
    C.save_checkpoint(tmp_path / "best.pt", {})
    assert C.find_checkpoint(tmp_path).name == "best.pt"
    assert C.find_checkpoint(tmp_path, prefer="last").name == "last.pt"
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(C.CheckpointError, match="holds no checkpoint"):
        C.find_checkpoint(empty)
