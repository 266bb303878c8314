"""The run folder: where a run goes (never into an earlier run unless told), and its logs."""

from __future__ import annotations

import csv
import datetime
import json
import os
import shutil
from pathlib import Path

from tqdm import tqdm

from .distributed import Dist

RUNS_DIR = Path("runs")
# What a training run writes into its folder: `train` itself, and `evaluate --checkpoint RUN`
# (metrics.<split>.json, predictions.<split>.jsonl, attention.<split>.<i>.png).
RUN_FILE_PATTERNS = ("last.pt", "best.pt", "step_*.pt", "log.txt", "metrics.*", "train.csv", "valid.csv",
                     "predictions.*.jsonl", "attention.*.png", "config.json", "args.json", "tokenizer*.json")
RUN_SUBDIRS = ("plots", "tb")


def run_files(out: Path) -> list[str]:
    """The files of an earlier run in `out`, checkpoints first (empty when there is none)."""
    if not out.is_dir():
        return []
    found = (p.name for pattern in RUN_FILE_PATTERNS for p in sorted(out.glob(pattern)) if p.is_file())
    return list(dict.fromkeys(found))


def resume_folder(out: str | None, resume: str | None = None) -> Path:
    """The folder --resume continues: --out; else the run the named checkpoint (or run folder)
    belongs to, so a resume never writes into another run; else the newest run (runs/latest)."""
    if out is not None:
        return Path(out)
    if resume not in (None, "last"):
        named = Path(resume)
        return named if named.is_dir() else named.parent
    return Path(os.path.realpath(RUNS_DIR / "latest"))


def fresh_run_folder(out: str | None, overwrite: bool, dist_: Dist) -> Path:
    """The folder of a new (not resumed) run. Never writes into an earlier run unless told to:
    an explicit --out holding a run is refused (or, with --overwrite, emptied of that run's
    files first); without --out every run gets its own runs/<date>-<time>, and runs/latest is
    pointed at it. Rank 0 decides; the barrier / broadcast keep the other ranks from seeing a
    folder rank 0 has already started writing."""
    if out is not None:
        folder = Path(out)
        held = run_files(folder)
        if held and not overwrite:
            shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
            raise SystemExit(f"--out {folder} already holds a training run ({shown}); pass --resume to continue "
                             f"it, --overwrite to replace it, or another --out")
        if held and dist_.main:
            for name in held:
                (folder / name).unlink()
            for sub in RUN_SUBDIRS:
                shutil.rmtree(folder / sub, ignore_errors=True)
        dist_.barrier()
        return folder
    name = _new_dated_folder() if dist_.main else None
    return RUNS_DIR / dist_.broadcast(name)


def _new_dated_folder() -> str:
    """Create runs/<date>-<time> (or -2, -3 ... when taken) and point runs/latest at it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = next(n for n in [stamp] + [f"{stamp}-{i}" for i in range(2, 1000)] if not run_files(RUNS_DIR / n))
    out = RUNS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    latest, tmp = RUNS_DIR / "latest", RUNS_DIR / f".latest.{os.getpid()}"
    try:  # atomic: a new link renamed over the old one
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name, target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:  # no symlinks here, or runs/latest is a real folder: leave it alone
        tmp.unlink(missing_ok=True)
    return name


class Logger:
    """Rank-0 logging: console (through tqdm), log.txt, metrics.jsonl, train.csv / valid.csv,
    optionally TensorBoard."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool = False, resume_step: int | None = None):
        self.out, self.enabled = out, enabled
        self.tb = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        self.log_file = open(out / "log.txt", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise SystemExit(f"--tensorboard needs the tensorboard package ({e})") from None
            self.tb = SummaryWriter(str(out / "tb"))

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows the interrupted run logged after its last checkpoint."""
        p = self.out / "metrics.jsonl"
        if p.exists():
            rows = [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
            keep = [r for r in rows if r.get("step", 0) <= step or r.get("split") not in ("train", "valid")]
            p.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
        for name in ("train.csv", "valid.csv"):
            p = self.out / name
            if p.exists():
                lines = p.read_text(encoding="utf-8").splitlines()
                if lines:
                    head = lines[0].split(",")
                    i = head.index("step") if "step" in head else None
                    keep = [lines[0]] + [x for x in lines[1:] if i is None or int(x.split(",")[i]) <= step]
                    p.write_text("\n".join(keep) + "\n", encoding="utf-8")

    def info(self, msg: str) -> None:
        if self.enabled:
            tqdm.write(msg)
            self.log_file.write(msg + "\n")
            self.log_file.flush()

    def row(self, row: dict) -> None:
        """One metrics row: metrics.jsonl always, train.csv / valid.csv by its "split"."""
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        split = row.get("split")
        if split in ("train", "valid"):
            self._csv_row(self.out / f"{split}.csv", row)
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{split}/{k}", v, row.get("step", 0))

    @staticmethod
    def _csv_row(p: Path, row: dict) -> None:
        new = not p.exists() or p.stat().st_size == 0
        flat = {k: v for k, v in row.items() if isinstance(v, (int, float, str))}
        fields = list(flat) if new else p.open(encoding="utf-8").readline().strip().split(",")
        with open(p, "a", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(flat)

    def close(self) -> None:
        if self.enabled:
            self.log_file.close()
            if self.tb is not None:
                self.tb.close()
