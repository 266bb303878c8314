"""The run folder: where a run goes (never into an earlier run unless told), and its logs."""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import re
from pathlib import Path

from tqdm import tqdm

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint, write_lines_atomic
from ..locks import Held, hold, holder
from .config import ConfigError
from .distributed import Dist

RUNS_DIR = Path("runs")
# What runs write into their folder, by exact name: `train` itself, `evaluate --checkpoint RUN`
# (metrics.<split>.json, predictions.<split>.jsonl, attention.<split>.<i>.png; the lock a killed one
# leaves, .evaluate.<split>.lock) and `average RUN` (averaged.pt: the run's weights averaged, which
# were called "files no run wrote"; kept by an --overwrite, an old run's average would sit beside the
# new run); the temp file of a write cut short by a kill (a checkpoint's or tokenizer's NAME.tmp, a
# text file's .NAME.PID.tmp: `checkpoint.write_lines_atomic`) is one too.
# --overwrite deletes these and nothing else.
_EARLY_TEXT = r"metrics\.jsonl|train\.csv|valid\.csv|config\.json|args\.json"
_TEXT = _EARLY_TEXT + r"|metrics\.(final|train|validation|test)\.json|predictions\.(train|validation|test)\.jsonl"
_PNG = r"attention\.(train|validation|test)\.\d+\.png"  # evaluate's (a plot's temp file: .NAME.PID.tmp)
RUN_FILE = re.compile(rf"(last|best|step_\d+|averaged)\.pt(\.tmp)?|log\.txt|{_TEXT}|{_PNG}|\.({_TEXT}|{_PNG})\.\d+\.tmp"
                      r"|tokenizer(\.src|\.tgt)?\.json(\.tmp)?|\.evaluate\.(train|validation|test)\.lock")
RUN_SUBDIRS = {"plots": re.compile(r"(curves|attention)\.png|\.(curves|attention)\.png\.\d+\.tmp"),
               "tb": re.compile(r"events\.out\.tfevents\..+")}
CHECKPOINT = re.compile(r"(last|best|step_\d+)\.pt")
# What a run writes before its first checkpoint: a folder holding only these (and no checkpoint)
# is a run that stopped early (a data error, say); the next run there deletes them and starts afresh.
EARLY_FILE = re.compile(rf"log\.txt|{_EARLY_TEXT}|\.({_EARLY_TEXT})\.\d+\.tmp|tokenizer(\.src|\.tgt)?\.json(\.tmp)?"
                        r"|(last|best|step_\d+)\.pt\.tmp")


class RunFolderError(ConfigError):
    """An --out that cannot take this run: a file, another run, or files no run wrote."""


# The lock of a folder a process trains in (`lock_run_folder`): never deleted (a lock file removed
# while held lets the next process lock a new one beside it), no run's file, nobody's either.
LOCK = ".lock"
IN_USE = "--out {} is in use: another process (pid {}) trains there now; wait for it to end, or choose another --out"
_HELD: dict[Path, int] = {}  # this process's locks: folder -> the file descriptor holding it


def lock_run_folder(folder: Path, clearing: bool = False) -> Path:
    """Hold `folder` for this process's run (an exclusive flock on FOLDER/.lock, which says its pid;
    the system drops it when the process ends, however it ends): a second run or resume into the
    folder while one trains there is refused, naming the holder (both ran: one run's checkpoints
    and logs were lost, its rows mixed into the other's), as is one while an evaluate writes its validation
    split's files there (the final report wrote over its predictions) or, `clearing` it (--overwrite), any
    files (it deleted them and the evaluate's lock). This process may lock it again (`release_run_folders`
    ends its runs' locks)."""
    key = folder.resolve()
    if key in _HELD:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = hold(folder / LOCK)
    except Held as e:
        raise RunFolderError(IN_USE.format(folder, e.pid)) from None
    for lock in sorted(folder.glob(".evaluate.*.lock") if clearing else [folder / ".evaluate.validation.lock"]):
        if (pid := holder(lock)) is not None:  # an evaluate writing there: its files would be ours
            os.close(fd)
            raise RunFolderError(f"--out {folder} is in use: an evaluate (pid {pid}) writes its "
                                 f"{lock.name[len('.evaluate.'):-len('.lock')]} predictions and metrics there now; "
                                 f"wait for it to end, or choose another --out")
    _HELD[key] = fd
    return folder


def release_run_folders() -> None:
    """End this process's locks on its run folders (`train` does, however it ends)."""
    while _HELD:
        os.close(_HELD.popitem()[1])


def folder_contents(out: Path) -> tuple[list[str], list[str]]:
    """(the run files in `out`, checkpoints first; everything else in it), as names relative to
    `out` ("plots/curves.png"). Both empty when `out` does not exist."""
    if not out.is_dir():
        return [], []
    ours, foreign = [], []
    for p in sorted(out.iterdir()):
        if p.name == LOCK:
            continue
        if p.name in RUN_SUBDIRS and p.is_dir() and not p.is_symlink():
            for q in sorted(p.iterdir()):
                ok = RUN_SUBDIRS[p.name].fullmatch(q.name) and q.is_file() and not q.is_symlink()
                (ours if ok else foreign).append(f"{p.name}/{q.name}")
        elif RUN_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink():
            ours.append(p.name)
        else:
            foreign.append(p.name)
    order = {"last.pt": 0, "best.pt": 1}
    ours.sort(key=lambda n: order.get(n, 2 if CHECKPOINT.fullmatch(n) else 3))  # checkpoints first (a stable sort)
    return ours, foreign


def run_files(out: Path) -> list[str]:
    """The files of an earlier run in `out`, checkpoints first (empty when there is none)."""
    return folder_contents(out)[0]


def resume_folder(out: str | None, resume: str | None = None) -> Path:
    """The folder --resume continues: --out; else the run the named checkpoint (or run folder)
    belongs to, so a resume never writes into another run; else the newest run (runs/latest)."""
    if out is not None:
        return Path(out)
    if resume not in (None, "last"):
        named = Path(resume)
        return named if named.is_dir() else named.parent
    return Path(os.path.realpath(RUNS_DIR / "latest"))


def resumes_elsewhere(folder: Path, checkpoint: Path) -> bool:
    """Whether a resume writes into another folder than its checkpoint's (--resume CKPT --out OTHER):
    that folder is then a new run folder, which may hold no run (`fresh_run_folder`)."""
    return os.path.realpath(folder) != os.path.realpath(checkpoint.parent)


def carry_best(old: Path, new: Path, best_step: int, dist_: Dist) -> bool:
    """A run resumed into a new folder takes its best.pt along when that file is the best of the
    checkpoint it resumes (its step is that progress's best_step): the new folder's best.pt and final
    report are then that model's. Rank 0 alone reads and writes it, and its answer is every rank's
    (what it raises, every rank raises: `Dist.on_main`). False when there is none, or it is another
    step's (a resume from an older checkpoint): the new run's best starts afresh."""
    def on_rank_0() -> bool:
        try:
            best = load_checkpoint(old / "best.pt") if best_step >= 0 and (old / "best.pt").is_file() else None
        except CheckpointError:
            best = None
        if best is None or best.get("progress", {}).get("step") != best_step:
            return False
        save_checkpoint(new / "best.pt", best)
        return True
    return dist_.on_main(on_rank_0)


def check_out(out: str | Path | None, overwrite: bool, resume: Path | None = None) -> None:
    """Refuse an --out that cannot take a new run, before any work (RunFolderError): a file; a
    folder holding a run, or the results of one or of an evaluation (predictions, metrics, plots: they
    would be replaced; unless --overwrite); with --overwrite, a folder holding files no run wrote.
    A folder whose run stopped before its first checkpoint (a data error, say) is reusable.
    `resume`: the checkpoint of a run continued into this folder (--resume CKPT --out OUT)."""
    if out is None:
        return
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"--out {folder} is a file, not a folder: name a folder for the run")
    ours, foreign = folder_contents(folder)
    if overwrite and foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise RunFolderError(f"--out {folder} holds {shown}, which no run wrote; --overwrite deletes only run "
                             f"files: move {'it' if len(foreign) == 1 else 'them'} away, or choose another --out")
    held = [n for n in ours if not EARLY_FILE.fullmatch(n)]  # a run's checkpoints, or results (evaluate --out)
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        if any(CHECKPOINT.fullmatch(n) for n in held):
            what, it = f"a training run ({shown})", "continue it"
        else:  # no checkpoint: an evaluation's outputs, or a run's results kept without its checkpoints
            what, it = f"the results of an earlier run or evaluation ({shown}), which this run would replace", None
        remedy = (f"pass {f'--resume to {it}, ' if it else ''}--overwrite to replace {'it' if it else 'them'}, or "
                  "another --out" if resume is None else
                  f"--resume {resume} continues its run into a new --out only: choose a folder that holds no run, "
                  f"or drop --out to continue in {resume.parent}")
        raise RunFolderError(f"--out {folder} already holds {what}; {remedy}")


def fresh_run_folder(out: str | None, overwrite: bool, dist_: Dist, resume: Path | None = None) -> Path:
    """The folder of a new run (or of one `resume`d into a new folder: its checkpoint). Never writes
    into an earlier run unless told to:
    an explicit --out holding a run is refused (or, with --overwrite, emptied of that run's
    files first: `check_out`); a run that stopped before its first checkpoint leaves a folder that
    is reused (its files deleted); without --out every run gets its own runs/<date>-<time>, and
    runs/latest is pointed at it. Rank 0 decides (`Dist.on_main`: a refusal there is raised on every
    rank), and the other ranks wait for it, so none sees a folder rank 0 has started writing."""
    if out is not None:
        folder = Path(out)
        dist_.on_main(lambda: _take_folder(folder, overwrite, resume))
        return folder
    return RUNS_DIR / dist_.on_main(lambda: lock_run_folder(RUNS_DIR / _new_dated_folder()).name)


def _take_folder(folder: Path, overwrite: bool, resume: Path | None) -> None:
    """Rank 0's part of `fresh_run_folder` for an explicit --out: checked, held, and cleared of an
    earlier run's files where that is allowed (`check_out`)."""
    check_out(folder, overwrite, resume)  # then again, held: a run that started in between holds it now
    check_out(lock_run_folder(folder, clearing=overwrite), overwrite, resume)
    for name in run_files(folder):  # all of them (--overwrite), or a stopped run's (see check_out)
        if overwrite or EARLY_FILE.fullmatch(name):
            (folder / name).unlink()
    for sub in RUN_SUBDIRS:
        if (folder / sub).is_dir() and not any((folder / sub).iterdir()):
            (folder / sub).rmdir()


def resumed_run_folder(out: str, dist_: Dist) -> Path:
    """The folder of a run resumed in place, held for this process (`lock_run_folder`; rank 0's, a
    refusal raised on every rank: `Dist.on_main`)."""
    folder = Path(out)
    dist_.on_main(lambda: lock_run_folder(folder))
    return folder


def _new_dated_folder() -> str:
    """Create runs/<date>-<time> (or -2, -3 ... when taken) and point runs/latest at it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    for name in [stamp] + [f"{stamp}-{i}" for i in range(2, 1000)]:
        try:
            (RUNS_DIR / name).mkdir()
            break
        except FileExistsError:
            continue
    out = RUNS_DIR / name
    latest, tmp = RUNS_DIR / "latest", RUNS_DIR / f".latest.{os.getpid()}"
    try:  # atomic: a new link renamed over the old one
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name, target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:  # no symlinks here, or runs/latest is a real folder: leave it alone
        tmp.unlink(missing_ok=True)
    return name


def _kept_rows(path: Path, step: int, validated: int) -> tuple[list[str], str | None]:
    """(the lines of a log, metrics.jsonl or train.csv / valid.csv, that a run resumed at `step`
    keeps: all but the train rows of later steps and the valid rows after `validated`, the step its
    checkpoint last validated (a kill between a validation and its save left a row the resumed run
    writes again); a warning or None). A last line cut
    short (a crash mid-append: unparsable, or a CSV row without its newline) is dropped with a
    warning naming the file; a damaged line elsewhere is refused (RunFolderError naming file and line)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    head = next(csv.reader(lines[:1]), []) if path.suffix == ".csv" else None
    kept, warning = lines[:1] if head is not None else [], None
    for i in range(len(kept), last + 1):
        if not lines[i].strip():
            continue
        try:
            row_step = _row_step(lines[i], head, valid=path.name == "valid.csv")
            if i == last and head is not None and not text.endswith("\n"):
                raise ValueError("no newline")
        except ValueError as e:
            if i < last:
                raise RunFolderError(f"{path}, line {i + 1}: a damaged row ({e}); resuming rewrites the run's "
                                     f"logs: mend or delete that line, then resume again") from None
            warning = f"warning: {path}: its last line is cut short (a crash mid-write?); dropped: {lines[i][:80]!r}"
            continue
        if (row_step[1] <= validated) if row_step[0] else row_step[1] <= step:
            kept.append(lines[i])
    return kept, warning


def _split_step(line: str) -> tuple | None:
    """A metrics.jsonl row's (split, step); None for a line that is no row."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return (row.get("split"), row.get("step")) if isinstance(row, dict) else None


def _row_step(line: str, head: list[str] | None, valid: bool) -> tuple[bool, int]:
    """(whether it is a valid row, the step of a log row: -1 for a row kept at any step); a ValueError
    says what is wrong with it. `head`: a CSV file's columns (`valid`: valid.csv's); None for a
    metrics.jsonl row: a final report's goes with the train rows of its step (a later step's is of the
    history a resume from an older checkpoint leaves)."""
    if head is None:
        row = json.loads(line)  # a JSONDecodeError is a ValueError
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
        if row.get("split") not in ("train", "valid"):
            value = row.get("step")
            return False, value if row.get("split") == "final" and type(value) is int else -1
        value = row.get("step", 0)
        if type(value) is not int:
            raise ValueError(f"its step is {value!r}")
        return row["split"] == "valid", value
    fields = next(csv.reader([line]))
    if len(fields) != len(head):
        raise ValueError(f"{len(fields)} fields, the header has {len(head)}")
    return valid, int(fields[head.index("step")]) if "step" in head else -1


def summary_writer():
    """TensorBoard's SummaryWriter class, or the ConfigError that --tensorboard gets without the package
    (asked before the run folder is made or cleared, as every refusal of an option)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(f"--tensorboard needs the tensorboard package ({e})") from None
    return SummaryWriter


class Logger:
    """Rank-0 logging: console (through tqdm), log.txt, metrics.jsonl, train.csv / valid.csv,
    optionally TensorBoard."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool = False, resume: dict | None = None,
                 history: Path | None = None):
        """`resume`: a resumed run's progress (its checkpoint's), whose logs (those of its folder
        `history`, by default `out`) continue here without the rows logged after its step, or
        validated after the step it last validated (`_kept_rows`; an older checkpoint's, which does
        not say: after its step)."""
        self.out, self.enabled = out, enabled
        self.tb = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        warnings = []
        if resume is not None:
            step, validated = resume["step"], resume.get("validated", -1)
            for name in ("metrics.jsonl", "train.csv", "valid.csv"):
                if (history or out).joinpath(name).is_file():
                    lines, warning = _kept_rows((history or out) / name, step, validated if validated >= 0 else step)
                    write_lines_atomic(out / name, lines)  # a full disk leaves the old file whole
                    warnings += [warning] if warning else []
        self.log_file = open(out / "log.txt", "a", encoding="utf-8")
        for warning in warnings:
            self.info(warning)
        if tensorboard:
            self.tb = summary_writer()(str(out / "tb"))

    def info(self, msg: str) -> None:
        if self.enabled:
            tqdm.write(msg)
            self.log_file.write(msg + "\n")
            self.log_file.flush()

    def row(self, row: dict, replace: bool = False) -> None:
        """One metrics row: metrics.jsonl always, train.csv / valid.csv by its "split". `replace`:
        rows of its split and step are dropped first (the final report of a finished run resumed
        with no step left to train, which reported that step already)."""
        if not self.enabled:
            return
        path, line = self.out / "metrics.jsonl", json.dumps(row)
        lines = path.read_text(encoding="utf-8").splitlines() if replace and path.exists() else []
        kept = [x for x in lines if _split_step(x) != (row.get("split"), row.get("step"))]
        if len(kept) < len(lines):
            write_lines_atomic(path, [*kept, line])
        else:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        split = row.get("split")
        if split in ("train", "valid"):
            self._csv_row(self.out / f"{split}.csv", row)
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{split}/{k}", v, row.get("step", 0))

    @staticmethod
    def _csv_row(p: Path, row: dict) -> None:
        """Append a row to train.csv / valid.csv. The header is the first row's columns; a row with a
        column it lacks (a run resumed with decoding at validation now on) rewrites the file, atomically,
        under the widened header (earlier rows blank there), so no value is dropped."""
        flat = {k: v for k, v in row.items() if isinstance(v, (int, float, str))}
        with open(p, "a+", encoding="utf-8", newline="") as f:
            f.seek(0)
            fields = next(csv.reader(f), None)
            if fields is not None and set(flat) <= set(fields):
                csv.DictWriter(f, fieldnames=fields, lineterminator="\n").writerow(flat)
                return
            f.seek(0)
            rows = [*csv.DictReader(f), flat]
        fields = [*(fields or []), *(k for k in flat if k not in (fields or []))]
        out = io.StringIO()
        w = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        write_lines_atomic(p, [out.getvalue().removesuffix("\n")])  # as written: no splitlines() of a value

    def close(self) -> None:
        if self.enabled:
            self.log_file.close()
            if self.tb is not None:
                self.tb.close()
