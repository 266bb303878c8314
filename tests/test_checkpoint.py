"""Checkpoints: round trip, atomic writes, refusal of truncated/corrupt/unsafe files."""

import errno
import io
import os
import random
import re

import numpy as np
import pytest
import torch

from scratchformer import checkpoint as C
from scratchformer.data.tokenizer import BPETokenizer, TokenizerPair
from scratchformer.evaluation.loading import load_run
from scratchformer.locks import Held, hold, release
from scratchformer.model import ModelConfig, build_model


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


def _snapshot(folder):
    """Every file of a folder with its bytes: what must not change when a save fails."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_crash_during_save_keeps_previous_and_removes_the_temp_file(tmp_path, monkeypatch):
    p = C.save_checkpoint(tmp_path / "last.pt", state(1.0))
    before = _snapshot(tmp_path)

    def crash(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(C.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        C.save_checkpoint(p, state(5.0))
    monkeypatch.undo()
    assert C.load_checkpoint(p)["model"]["w"][0, 0] == 1.0  # the old file is untouched
    assert _snapshot(tmp_path) == before  # and the torn last.pt.tmp is gone


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_disk_full_while_saving(tmp_path, monkeypatch, where):
    """ENOSPC at any point of a save: the error names the file and says the disk is full, the
    partial .tmp is removed, the previous checkpoint is intact."""
    p = C.save_checkpoint(tmp_path / "last.pt", state(1.0))
    before = _snapshot(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "write":  # the payload reaches the disk in part, then the disk is full
        real_open = open

        class Full(io.FileIO):
            def write(self, b):
                super().write(b[:10])
                full()

        monkeypatch.setattr(C, "open", lambda f, mode="r": Full(f, "w") if "w" in mode else real_open(f, mode),
                            raising=False)
    else:
        monkeypatch.setattr(C.os, where, full)
    with pytest.raises(OSError) as e:
        C.save_checkpoint(p, state(5.0))
    monkeypatch.undo()
    print(e.value)
    assert e.value.errno == errno.ENOSPC
    assert f"cannot write checkpoint {p}" in str(e.value) and "disk is full" in str(e.value)
    assert _snapshot(tmp_path) == before
    assert C.load_checkpoint(p)["model"]["w"][0, 0] == 1.0


def test_interrupted_save_removes_the_temp_file(tmp_path, monkeypatch):
    p = C.save_checkpoint(tmp_path / "last.pt", state(1.0))
    before = _snapshot(tmp_path)

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(C.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        C.save_checkpoint(p, state(5.0))
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_read_only_folder_named(tmp_path, monkeypatch, code):
    """A folder that refuses new files (read-only file system, no permission; simulated: the
    tests run as root, which may write anywhere)."""
    folder = tmp_path / "run"
    p = C.save_checkpoint(folder / "last.pt", state(1.0))
    before = _snapshot(folder)

    def refuse(f, mode="r"):
        raise OSError(code, os.strerror(code), str(f))

    monkeypatch.setattr(C, "open", refuse, raising=False)
    with pytest.raises(OSError) as e:
        C.save_checkpoint(p, state(5.0))
    monkeypatch.undo()
    print(e.value)
    assert e.value.errno == code and isinstance(e.value, PermissionError) == (code == errno.EACCES)
    assert f"cannot write checkpoint {p}" in str(e.value) and f"the folder {folder} is" in str(e.value)
    assert _snapshot(folder) == before


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_for_real(tmp_path):
    folder = tmp_path / "run"
    p = C.save_checkpoint(folder / "last.pt", state(1.0))
    before = _snapshot(folder)
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"the folder {folder} is not writable"):
            C.save_checkpoint(p, state(5.0))
    finally:
        folder.chmod(0o755)
    assert _snapshot(folder) == before


def test_incomplete_checkpoint_names_the_missing_key(tmp_path):
    """A valid container without the parts a run needs is a CheckpointError naming the file and
    the key, not a KeyError later; a payload that is not a dict is refused too."""
    p = C.save_checkpoint(tmp_path / "best.pt", {"model": {}, "tokenizers": {}, "task": "translation", "args": {}})
    with pytest.raises(C.CheckpointError, match=rf"{p} is incomplete: no 'config' \(it holds 'args', 'model'"):
        C.load_checkpoint(p, require=C.RUN_KEYS)
    assert C.load_checkpoint(p)["task"] == "translation"  # nothing required: any dict loads
    with pytest.raises(C.CheckpointError, match=rf"{p} is incomplete: no 'config'"):
        load_run(tmp_path)
    with pytest.raises(C.CheckpointError, match="'optimizer', 'scheduler', 'progress', 'rng', 'data'"):
        C.load_checkpoint(p, require=C.RESUME_KEYS)
    lst = C.save_checkpoint(tmp_path / "list.pt", [1, 2])
    with pytest.raises(C.CheckpointError, match=rf"{lst}: the payload is a list, not a checkpoint dict"):
        C.load_checkpoint(lst)


def test_checkpoint_whose_parts_disagree(tmp_path):
    """A config the model cannot be built from, a broken tokenizer, or weights of another shape:
    CheckpointError naming the file (not a TypeError, KeyError or a torch RuntimeError)."""
    tok = BPETokenizer.train(["one two three four five six seven"] * 20, vocab_size=300, min_frequency=1)
    shape = dict(src_vocab_size=tok.vocab_size, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=64)
    cfg, other = ModelConfig(d_model=32, **shape), ModelConfig(d_model=16, **shape)
    base = {"tokenizers": TokenizerPair(tok).to_dict(), "task": "translation", "args": {}}
    p = C.save_checkpoint(tmp_path / "a" / "best.pt", {**base, "model": build_model(other).state_dict(),
                                                      "config": cfg.to_dict()})
    with pytest.raises(C.CheckpointError, match=rf"{p}: the weights do not fit the checkpoint's config"):
        load_run(p)
    q = C.save_checkpoint(tmp_path / "b" / "best.pt", {**base, "model": {}, "config": {"d_model": 32, "bogus": 1}})
    with pytest.raises(C.CheckpointError, match=rf"{q}: bad model config or tokenizer .*bogus"):
        load_run(q)
    r = C.save_checkpoint(tmp_path / "c" / "best.pt", {**base, "model": {}, "config": cfg.to_dict(),
                                                      "tokenizers": {"src": "not a tokenizer"}})
    with pytest.raises(C.CheckpointError, match=rf"{r}: bad model config or tokenizer"):
        load_run(r)
    t = C.save_checkpoint(tmp_path / "d" / "best.pt", {**base, "model": {}, "config": cfg.to_dict(), "tokenizers": {}})
    with pytest.raises(C.CheckpointError, match=rf"{t}: bad model config or tokenizer in the checkpoint \(no 'src'\)"):
        load_run(t)


@pytest.mark.parametrize("change, message", [
    ({"task": "bogus"}, r"unknown task 'bogus' in the checkpoint \(one of translation, summarization, "),
    ({"args": {"max_src_len": "x"}}, r"bad training arguments in the checkpoint: max_src_len must be an integer "
                                     r">= 2, got 'x'"),
    ({"args": {"max_tgt_len": -5}}, r"bad training arguments in the checkpoint: max_tgt_len must be an integer "
                                    r">= 2, got -5"),
    ({"args": {"max_tgt_len": 1}}, r"bad training arguments in the checkpoint: max_tgt_len must be an integer "
                                   r">= 2, got 1"),
    ({"args": [1]}, r"bad training arguments in the checkpoint: a list, not a dict")])
def test_checkpoint_whose_task_or_arguments_are_bad(tmp_path, change, message):
    """A crafted task decoded as translation; bad arguments failed later, in a TypeError or as a flag
    the user did not give (`--min-len 0 exceeds the longest output, -5 tokens`)."""
    tok = BPETokenizer.train(["one two three four five six seven"] * 20, vocab_size=300, min_frequency=1)
    cfg = ModelConfig(d_model=32, src_vocab_size=tok.vocab_size, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      d_ff=64)
    good = {"tokenizers": TokenizerPair(tok).to_dict(), "task": "translation", "model": build_model(cfg).state_dict(),
            "config": cfg.to_dict(), "args": {"max_src_len": 16, "max_tgt_len": 16}}
    load_run(C.save_checkpoint(tmp_path / "good.pt", good))
    bad = C.save_checkpoint(tmp_path / "bad.pt", {**good, **change})
    with pytest.raises(C.CheckpointError, match=rf"{bad}: {message}"):
        load_run(bad)


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_unpickling_arbitrary_objects_refused(tmp_path):
    """Never unpickled; the error is one line naming what torch refused (it was torch's page of
    advice, several lines, to load with weights_only=False, which a checkpoint never needs)."""
    p = C.save_checkpoint(tmp_path / "evil.pt", {"model": {}, "x": Evil()})
    with pytest.raises(C.CheckpointError, match=r"cannot load payload \(Unsupported global: GLOBAL .*print "
                                                r"was not an allowed global by default.\); a checkpoint holds tensors "
                                                r"and plain values only$") as e:
        C.load_checkpoint(p)
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value)


def test_the_cuda_random_state_is_the_training_devices_alone(monkeypatch):
    """Every visible GPU's CUDA state was saved (`get_rng_state_all`) and all restored: a run resumed
    where fewer GPUs are visible (an 8-GPU machine's on a 1-GPU one) failed in torch's set_rng_state with
    an IndexError, after the run folder was rewritten. Now the training device's alone; a list saved
    before gives the device's index where it has one, else its first. A CPU run saves none."""
    states = {i: torch.full((4,), i, dtype=torch.uint8) for i in range(8)}
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[torch.device(device).index])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    saved = C.rng_state(torch.device("cuda", 3))
    assert [int(t[0]) for t in saved["cuda"]] == [3]
    assert "cuda" not in C.rng_state(torch.device("cpu")) and "cuda" not in C.rng_state()
    for device, cuda_states, want in ((torch.device("cuda", 0), saved["cuda"], 3),  # resumed on another index
                                      (torch.device("cuda", 1), [states[0], states[1]], 1),  # the old list: its own
                                      (torch.device("cuda", 0), list(states.values()), 0),
                                      (torch.device("cuda", 5), [states[0], states[1]], 0),
                                      (torch.device("cuda"), [states[2], states[6]], 2)):  # the current device's
        restored.clear()
        C.set_rng_state({**saved, "cuda": cuda_states}, device)
        assert restored == [(want, device)]
    restored.clear()
    C.set_rng_state(saved, torch.device("cpu"))  # a GPU run resumed on a CPU: no CUDA state to set
    assert restored == []


def test_rng_state_round_trip(tmp_path):
    C.save_checkpoint(tmp_path / "r.pt", {"rng": C.rng_state()})
    a = (random.random(), float(np.random.rand()), torch.rand(3))
    C.set_rng_state(C.load_checkpoint(tmp_path / "r.pt")["rng"])
    b = (random.random(), float(np.random.rand()), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_prune_and_find(tmp_path, capsys):
    for s in (5, 10, 15, 20):
        C.save_checkpoint(tmp_path / f"step_{s:07d}.pt", {"s": s})
    C.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in C.step_checkpoints(tmp_path)] == ["step_0000015.pt", "step_0000020.pt"]
    assert C.find_checkpoint(tmp_path).name == "step_0000020.pt"
    # a fallback is said (a diverged run has no best.pt: its NaN last.pt was used silently)
    assert capsys.readouterr().err == f"{tmp_path} has no best.pt: using {tmp_path / 'step_0000020.pt'}\n"
    C.save_checkpoint(tmp_path / "last.pt", {})
    assert C.find_checkpoint(tmp_path).name == "last.pt"
    assert capsys.readouterr().err == f"{tmp_path} has no best.pt: using {tmp_path / 'last.pt'}\n"
    C.save_checkpoint(tmp_path / "best.pt", {})
    assert C.find_checkpoint(tmp_path).name == "best.pt"
    assert C.find_checkpoint(tmp_path, prefer="last").name == "last.pt"
    assert capsys.readouterr().err == ""  # each found where it was looked for first
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(C.CheckpointError, match="holds no checkpoint"):
        C.find_checkpoint(empty)


def test_prune_up_to_the_step_just_saved_leaves_later_ones(tmp_path):
    """Pruning after saving step 9 in a folder that also holds a step 10 (a run resumed from an older
    checkpoint: another history) keeps the newest up to step 9 and never deletes step 10, nor the
    checkpoint just written."""
    for s in (6, 8, 9, 10):
        C.save_checkpoint(tmp_path / f"step_{s:07d}.pt", {"s": s})
    C.prune_checkpoints(tmp_path, keep=1, upto=9)
    assert [p.name for p in C.step_checkpoints(tmp_path)] == ["step_0000009.pt", "step_0000010.pt"]
    C.prune_checkpoints(tmp_path, keep=0, upto=9)  # 0 keeps them all
    assert len(C.step_checkpoints(tmp_path)) == 2


def test_a_hold_waits_out_another_commands_probe_and_is_refused_by_a_real_holder(tmp_path, monkeypatch):
    """`holder` probes a lock by taking it for an instant; a `hold` in that instant was refused, naming the
    pid a finished process left in the file (a probe loop against a hold loop: 1,482 of 20,000 refused).
    A hold now tries PROBE_TRIES times, 10 ms apart; one held longer is refused as before."""
    import fcntl

    from scratchformer import locks

    real, busy = fcntl.flock, []

    def flock(fd, op):
        if busy and busy.pop():
            raise BlockingIOError
        return real(fd, op)
    monkeypatch.setattr(locks.fcntl, "flock", flock)
    busy[:] = [True] * (locks.PROBE_TRIES - 1)  # a probe's instant: taken on the last try
    release(tmp_path / "a.lock", hold(tmp_path / "a.lock"))
    (tmp_path / "b.lock").write_text("4242")
    busy[:] = [True] * locks.PROBE_TRIES
    with pytest.raises(Held, match=r"held by another process \(pid 4242\)"):
        hold(tmp_path / "b.lock")
    assert busy == []


def test_a_lock_is_held_once_even_when_its_holder_removes_it_between_anothers_open_and_flock(tmp_path, monkeypatch):
    """`hold` is an flock on a file that `release` unlinks: a process that opened the name before the
    unlink and locks after it holds a file no longer on disk, while a third creates the name anew and
    holds that. `hold` sees its file is gone and opens the name again, so one name has one holder."""
    import fcntl

    lock = tmp_path / ".out.lock"
    first = hold(lock)
    with pytest.raises(Held, match=rf"{re.escape(str(lock))} is held by another process \(pid {os.getpid()}\)"):
        hold(lock)  # flock: one per open file, so this process's second open is refused too
    real_flock, opened = fcntl.flock, []

    def flock_after_the_holder_releases(fd, op):
        opened.append(os.fstat(fd).st_ino)
        if len(opened) == 1:  # the holder ends between this open and its flock
            release(lock, first)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_holder_releases)
    second = hold(lock)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert len(opened) == 2 and os.path.samestat(os.stat(lock), os.fstat(second))
    assert lock.read_text() == str(os.getpid())
    with pytest.raises(Held):
        hold(lock)  # the name's holder is `second`: a third is refused
    release(lock, second)
    assert not lock.exists()
    release(lock, hold(lock))


def test_the_weights_digest_tells_apart_the_same_bytes_under_another_name_dtype_or_shape():
    """`weights_digest` names a model in whatever file: equal for a copy, and unequal for tensors whose
    bytes are the same but which are other weights (renamed, reinterpreted, reshaped)."""
    w = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    digest = C.weights_digest({"w": w, "b": torch.ones(2)})
    assert C.weights_digest({"b": torch.ones(2), "w": w.clone()}) == digest
    for other in ({"v": w, "b": torch.ones(2)}, {"w": w.view(torch.int32), "b": torch.ones(2)},
                  {"w": w.reshape(2, 3), "b": torch.ones(2)}):
        assert C.weights_digest(other) != digest, other
