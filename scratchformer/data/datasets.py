"""Data sources: the tasks, their files, the hub, and the embedded synthetic task.

Every source is read into a list of `Example(src, tgt, id)`:
- translation:    src = source sentence, tgt = target sentence;
- summarization:  src = document,        tgt = summary (written by a decoder);
- extractive:     src = document,        tgt = summary (sentences of the document picked; the same
  files as summarization, chosen with ``--task extractive``);
- classification: src = text,            tgt = integer label.

Sources, in the order `resolve_source` tries them:
1. ``synthetic`` (the default): a generated, seeded corpus that needs no download; see
   `synthetic_examples`. It is a smoke task, not a benchmark.
2. a local folder (``--data DIR``, or a folder named like ``--dataset`` under ``$SCRATCHFORMER_DATA``,
   ``./data`` or ``../shared/data``) of ``{train,validation,test}.{jsonl,jsonl.gz,jsonl.xz,tsv,parquet}``
   with the field layout of ``shared/data/README.md``: translation ``{"src","tgt"}``,
   summarization ``{"id","document","summary"}``, classification ``{"text","label"}``.
3. a Hugging Face hub name (`HUB`), loaded lazily with ``datasets.load_dataset`` (online only).

Malformed input raises `DataError` naming the file and line. What a record holds per task is in
`records.py`, the synthetic task in `synthetic.py`, encoding and batching in `batching.py`, the
tokenizers in `tokenizer.py`.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from .files import COMPRESSED, DataError, read_json, read_json_lines, read_lines, uncompressed_name
from .records import FIELDS, TASKS, Example, check_record, check_unique_ids
from .synthetic import SYNTHETIC_SIZES, synthetic_examples

SPLITS = ("train", "validation", "test")
EXTENSIONS = (".jsonl", *(f".jsonl{c}" for c in COMPRESSED), ".tsv", ".parquet")

# Hub datasets: name -> load_dataset args and the mapping of their fields onto ours.
HUB = {
    "cnn_dailymail": dict(path="cnn_dailymail", name="3.0.0", task="summarization", src="article", tgt="highlights"),
    "samsum": dict(path="knkarthick/samsum", task="summarization", src="dialogue", tgt="summary"),
    "iwslt2017": dict(path="iwslt2017", name="iwslt2017-en-de", task="translation", translation=("en", "de")),
    "multi30k": dict(path="bentrevett/multi30k", task="translation", src="en", tgt="de"),
    "imdb": dict(path="imdb", task="classification", src="text", tgt="label", labels={0: "negative", 1: "positive"}),
}
# Local folder names that differ from the hub names (shared/data uses these).
LOCAL_NAMES = {"iwslt2017": "iwslt2017_en_de", "knkarthick/samsum": "samsum", "bentrevett/multi30k": "multi30k"}
DEFAULT_TASK = {"synthetic": "translation", **{k: v["task"] for k, v in HUB.items()}}


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------


def _read_jsonl(path: Path, task: str, limit: int | None):
    out = []
    with closing(read_json_lines(path)) as records:  # closed also when `limit` stops early
        for lineno, rec in records:
            out.append(check_record(rec, task, f"{path}:{lineno}"))
            if limit is not None and len(out) >= limit:
                break
    return out


def _read_tsv(path: Path, task: str, limit: int | None):
    """Two columns (source, target) or more with a header row naming the fields: the first row
    that is not blank, when it names them. Fields are split on tabs, nothing is quoted (a quote or a
    lone carriage return is text)."""
    fields = FIELDS[task]
    out = []
    with closing(read_lines(path)) as numbered:  # closed also when `limit` stops early
        header, first = None, True
        for lineno, line in numbered:
            row = line.split("\t")
            if not any(c.strip() for c in row):
                continue
            if first and set(fields) <= set(row):
                header, first = row, False
                continue
            first = False
            if header is not None:
                if len(row) != len(header):
                    raise DataError(f"{path}:{lineno}: expected {len(header)} tab-separated columns, got {len(row)}")
                rec = dict(zip(header, row, strict=True))
            else:
                if len(row) != 2:
                    raise DataError(
                        f"{path}:{lineno}: expected 2 tab-separated columns ({fields[0]}, {fields[1]}) "
                        f"or a header row naming them, got {len(row)} columns"
                    )
                rec = dict(zip(fields, row, strict=True))
            if task == "classification":
                try:
                    rec["label"] = int(rec["label"])
                except ValueError:
                    got = rec["label"]
                    raise DataError(f"{path}:{lineno}: field 'label' must be an integer, got {got!r}") from None
            out.append(check_record(rec, task, f"{path}:{lineno}"))
            if limit is not None and len(out) >= limit:
                break
    return out


def _read_parquet(path: Path, task: str, limit: int | None):
    try:
        import pyarrow.parquet as pq  # lazy: only parquet users need pyarrow
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    rows = pq.read_table(path).to_pylist()
    if limit is not None:
        rows = rows[:limit]
    return [check_record(r, task, f"{path}: row {i}") for i, r in enumerate(rows, 1)]


def check_split(split: str, name: str = "split") -> str:
    """`split` if it is a plain name: it names the file read (<split>.jsonl in the data folder) and
    those written (predictions.<split>.jsonl), so one that is empty, holds a path separator or '..',
    or starts with '.' (a path out of those folders) is a DataError naming it, as `name` (a flag)."""
    if not isinstance(split, str):
        raise TypeError(f"{name} must be a split's name (a str: train, validation, test, ...), got {split!r}")
    if not split.strip() or any(c in split for c in "/\\\0") or ".." in split or split.startswith("."):
        raise DataError(f"{name} {split!r}: not a split name (train, validation, test, ...): a plain name, not empty, "
                        "without '/', '\\' or '..', not starting with '.'")
    return split


def find_split_file(folder: Path, split: str) -> Path | None:
    """The file of a split in a data folder (None: there is none); two of one split (train.jsonl and
    train.jsonl.gz) are refused, as either might be the one meant; a split that is not a plain name
    (`check_split`) too."""
    check_split(split)
    found = [p for p in (folder / f"{split}{ext}" for ext in EXTENSIONS) if p.exists()]
    if len(found) > 1:
        raise DataError(f"{folder}: {len(found)} files hold the {split} split ({', '.join(p.name for p in found)}): "
                        f"keep one")
    return found[0] if found else None


def check_limit(limit: int | None) -> None:
    """A limit on the records read: None (all) or an int >= 1 (0 and -1 read one record of a local file
    and none of the synthetic task's; 2.5 read three)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None (every record) or an int >= 1, got {limit!r}")


def read_split(path: str | Path, task: str, limit: int | None = None) -> list[Example]:
    """Read one split file (.jsonl, .jsonl.gz, .jsonl.xz, .tsv or .parquet), validating every record."""
    check_limit(limit)
    path = Path(path)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    name = path.name
    if uncompressed_name(name).endswith(".jsonl"):
        rows = _read_jsonl(path, task, limit)
    elif name.endswith(".tsv"):
        rows = _read_tsv(path, task, limit)
    elif name.endswith(".parquet"):
        rows = _read_parquet(path, task, limit)
    else:
        raise DataError(f"{path}: unknown format; use one of {EXTENSIONS}")
    if not rows:
        raise DataError(f"{path}: the split is empty (no records)")
    return rows


def _meta(folder: Path | None) -> tuple[Path | None, dict]:
    """A folder's meta.json and what it holds ({}: none); DataError naming it for a "task" not one of TASKS."""
    meta = None if folder is None else folder / "meta.json"
    obj = read_json(meta) if meta is not None and meta.exists() else {}
    if obj.get("task") not in (None, *TASKS):
        raise DataError(f"{meta}: unknown task {obj['task']!r} (the tasks: {', '.join(TASKS)})")
    return meta, obj


def infer_task(folder: Path) -> str:
    """The task of a local folder: meta.json's "task" (`_meta`), else the fields of the first record of its
    first split file: a JSON-lines record's keys, or a TSV's header row (a TSV without one, or a
    parquet file, names no fields)."""
    task = _meta(folder)[1].get("task")
    if task is not None:
        return task
    for split in SPLITS:
        p = find_split_file(folder, split)
        if p is not None and (".jsonl" in p.name or p.name.endswith(".tsv")):
            with closing(read_lines(p)) as lines:
                first = next((line for _, line in lines if line.strip()), "")
            try:
                keys = set(json.loads(first)) if ".jsonl" in p.name else set(first.split("\t"))
            except (json.JSONDecodeError, TypeError):
                keys = set()
            for task, fields in FIELDS.items():
                if set(fields) <= keys:
                    return task
    raise DataError(f"{folder}: cannot tell the task (no meta.json 'task' and no recognised fields); pass --task")


def label_names(folder: Path | None) -> dict[int, str] | None:
    """Class names from a folder's meta.json ("labels": {"0": "negative", ...}), if any; DataError
    naming the file for one that is not a JSON object, or labels not keyed by class id."""
    meta, obj = _meta(folder)
    labels = obj.get("labels")
    if labels is None:
        return None
    if not isinstance(labels, dict) or not all(isinstance(k, str) and k.isdigit() and k.isascii() for k in labels):
        got = list(labels)[:3] if isinstance(labels, dict) else type(labels).__name__
        raise DataError(f"{meta}: 'labels' must map class ids to names, {{\"0\": \"negative\", \"1\": \"positive\"}}; "
                        f"got {got!r}")
    return {int(k): str(v) for k, v in labels.items()}


def _local_candidates(dataset: str) -> list[Path]:
    """Where a named dataset's local copy may be, in order: $SCRATCHFORMER_DATA/NAME, ./data/NAME,
    ../shared/data/NAME (NAME the folder's name, `LOCAL_NAMES`)."""
    name = LOCAL_NAMES.get(dataset, dataset)
    roots = [os.environ.get("SCRATCHFORMER_DATA"), "data", os.path.join("..", "shared", "data")]
    return [Path(root) / name for root in roots if root]


def local_folder(dataset: str) -> Path | None:
    """A local copy of a named dataset, the first of `_local_candidates` that is a folder."""
    return next((folder for folder in _local_candidates(dataset) if folder.is_dir()), None)


def _no_local_copy(dataset: str) -> str:
    """Where a named dataset was looked for on disk, and how to point there (a hub error's hint)."""
    looked = ", ".join(os.path.abspath(folder) for folder in _local_candidates(dataset))
    return (f"no local copy of {dataset!r} (looked in {looked}: SCRATCHFORMER_DATA=DIR looks in "
            f"DIR/{LOCAL_NAMES.get(dataset, dataset)} first; --data FOLDER reads a folder)")


def load_hub(dataset: str, split: str, limit: int | None = None) -> list[Example]:
    """A Hugging Face hub dataset (needs `datasets` and a network), mapped to our fields."""
    spec = HUB.get(dataset)
    if spec is None:
        raise DataError(f"unknown dataset {dataset!r}: not 'synthetic', not a local folder, not one of {sorted(HUB)}")
    try:
        import datasets  # lazy: only hub users need it
    except ImportError as e:
        raise DataError(f"{_no_local_copy(dataset)}, and loading it from the Hugging Face hub needs the 'datasets' "
                        "package (pip install datasets) and a network") from e
    kw = {"name": spec["name"]} if "name" in spec else {}
    try:
        ds = datasets.load_dataset(spec["path"], split=split, **kw)
    except ValueError as e:
        raise DataError(f"hub dataset {spec['path']} has no split {split!r} ({e})") from None
    except OSError as e:  # no network (requests' errors are OSErrors), a dataset the hub no longer has
        raise DataError(f"{_no_local_copy(dataset)}, and the Hugging Face hub did not give {spec['path']} "
                        f"[{split}]: {type(e).__name__}: {e}") from e
    except RuntimeError as e:  # datasets >= 4.0 runs no loading script, which iwslt2017's still is
        fix = ("; datasets 4.0 and later run no loading script: pip install 'datasets<4', or put the data's files "
               "in a folder and pass --data DIR") if "scripts are no longer supported" in str(e) else ""
        raise DataError(f"{_no_local_copy(dataset)}, and datasets {getattr(datasets, '__version__', '?')} could not "
                        f"load {spec['path']} [{split}]: {e}{fix}") from e
    out = []
    for i, rec in enumerate(ds):
        if "translation" in spec:
            a, b = spec["translation"]
            rec = {"src": rec["translation"][a], "tgt": rec["translation"][b]}
        else:
            src_f, tgt_f = FIELDS[spec["task"]]
            rec = {src_f: rec[spec["src"]], tgt_f: rec[spec["tgt"]], "id": rec.get("id")}
        out.append(check_record(rec, spec["task"], f"{spec['path']}[{split}] row {i}"))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"hub dataset {spec['path']} split {split!r} is empty")
    return out


@dataclass
class DataSource:
    """Where a run's data comes from: what `resolve_source` found, stored in checkpoints (with the
    class names, so a classifier names its predictions wherever it is run later)."""

    kind: str  # "synthetic" | "local" | "hub"
    name: str
    task: str
    folder: str | None = None
    labels: dict[int, str] | None = None  # class id -> name (a folder's meta.json, a hub dataset's)

    def to_dict(self) -> dict:
        return dict(kind=self.kind, name=self.name, task=self.task, folder=self.folder, labels=self.labels)


def resolve_source(dataset: str = "synthetic", data: str | None = None, task: str | None = None) -> DataSource:
    """Where a run's data comes from: the local folder `data`, else the named `dataset` (synthetic, a
    local folder by that name, or the hub), read as `task` (None: the folder's or dataset's own)."""
    if not isinstance(dataset, str) or (data is not None and not isinstance(data, (str, Path))):
        raise TypeError(f"dataset must be a name (str) and data a folder (str, Path or None), got {dataset!r}, "
                        f"{data!r}")
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if data is not None:
        folder = Path(data)
        if not folder.is_dir():
            raise DataError(f"--data {data}: " + ("a file: give the folder that holds the splits (train.jsonl, ...)"
                                                  if folder.exists() else "no such folder"))
        return DataSource("local", folder.name, task or infer_task(folder), str(folder), label_names(folder))
    if dataset == "synthetic":
        if task not in (None, "translation"):
            raise DataError(f"the synthetic task is a translation task, not {task}")
        return DataSource("synthetic", "synthetic", "translation")
    folder = local_folder(dataset)
    if folder is not None:
        return DataSource("local", dataset, task or infer_task(folder), str(folder), label_names(folder))
    if dataset not in HUB and task is None:
        raise DataError(f"unknown dataset {dataset!r}; use --data DIR for a local folder, or one of {sorted(HUB)}")
    if dataset in HUB and task is not None and FIELDS[task] != FIELDS[HUB[dataset]["task"]]:
        raise DataError(f"hub dataset {dataset!r} is {HUB[dataset]['task']} data; it cannot be read as {task}")
    return DataSource("hub", dataset, task or HUB[dataset]["task"], labels=HUB.get(dataset, {}).get("labels"))


def load_split(source: DataSource, split: str, limit: int | None = None, synthetic_seed: int = 1234) -> list[Example]:
    """The examples of one split of `source` (`resolve_source`), the first `limit` of them (None: all).
    A split other than train, whose predictions are written by id, is a DataError when two of its
    examples share one (`check_unique_ids`)."""
    if not isinstance(source, DataSource):
        raise TypeError(f"source must be a DataSource (resolve_source(dataset, data, task)), got {source!r}")
    check_split(split)
    check_limit(limit)
    if source.kind == "synthetic":
        n = SYNTHETIC_SIZES.get(split)
        return synthetic_examples(split, n if limit is None else min(n or limit, limit), seed=synthetic_seed)
    if source.kind == "local":
        folder = Path(source.folder)
        p = find_split_file(folder, split)
        if p is None:
            tried = ", ".join(f"{split}{ext}" for ext in EXTENSIONS)
            inputs = find_split_file(folder, f"{split}_inputs")  # a blind test's: ../shared/data/*/test_inputs
            hint = f"; {inputs.name} holds its inputs without references: `generate --input` predicts them" \
                if inputs else ""
            raise DataError(f"{folder}: no {split} split (looked for {tried}){hint}")
        examples, where = read_split(p, source.task, limit), str(p)
    else:
        examples, where = load_hub(source.name, split, limit), f"{source.name}[{split}]"
    if split != "train":
        check_unique_ids(examples, split, where)
    return examples


def has_split(source: DataSource, split: str) -> bool:
    check_split(split)
    if source.kind == "synthetic":
        return split in SYNTHETIC_SIZES
    if source.kind == "local":
        return find_split_file(Path(source.folder), split) is not None
    return True  # the hub tells us when we ask


def carve_validation(train: list[Example], fraction: float, seed: int,
                     where: str = "train") -> tuple[list[Example], list[Example]]:
    """Split a seeded random `fraction` of train off as validation (for IMDb, which has none). Its
    predictions are written by id as those of any validation split: a DataError when two of the carved
    examples share one (`check_unique_ids`; `where`: the train split's file, for the message)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    idx = list(range(len(train)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(round(len(train) * fraction)))
    if n_val >= len(train):  # refused here, before a run folder is made or cleared
        raise DataError(f"{where}: {len(train)} examples; carving {fraction:g} of them as validation leaves none to "
                        f"train on")
    val_idx = set(idx[:n_val])
    valid = [train[i] for i in sorted(val_idx)]
    check_unique_ids(valid, "validation", f"{where}, the validation examples carved from it")
    return [e for i, e in enumerate(train) if i not in val_idx], valid


def texts_for_tokenizer(examples: Iterable[Example], side: str) -> Iterable[str]:
    """The texts a tokenizer is trained on: 'src', 'tgt' or 'both' (labels are skipped)."""
    for e in examples:
        if side in ("src", "both"):
            yield e.src
        if side in ("tgt", "both") and isinstance(e.tgt, str):
            yield e.tgt
