"""Load dataset rows from a local file, a local dataset directory or the Hugging Face hub, and
split off a held-out test set.

Accepted `path` forms (see `load_rows`):
    data/train.jsonl | .json | .csv | .parquet | .arrow      a local data file
    data/my_ds/                                              `save_to_disk` output or a folder of data files
    org/dataset        train@org/dataset                     a hub dataset (optionally `split@name`)
"""
import csv
import json
import logging
import os
import random
from pathlib import Path

import datasets
from datasets.data_files import DataFilesDict, get_data_patterns

logger = logging.getLogger(__name__)

# File extension -> `datasets` packaged builder name.
BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


def _builder_for(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in BUILDERS:
        raise ValueError(
            f"unsupported data file '{path}' (extension '{ext or '<none>'}'); "
            f"supported: {', '.join(sorted(BUILDERS))}"
        )
    return BUILDERS[ext]


def _pick_split(ds, split: str | None, path: str) -> datasets.Dataset:
    """A DatasetDict -> one split (default: 'train', or the only split there is)."""
    if isinstance(ds, datasets.Dataset):
        if split not in (None, "train"):
            raise ValueError(f"'{path}' holds a single split; cannot select split '{split}'")
        return ds
    names = list(ds.keys())
    if split is None:
        split = "train" if "train" in names or len(names) != 1 else names[0]
    if split not in names:
        raise ValueError(f"split '{split}' not found in '{path}'; available splits: {names}")
    return ds[split]


def _load_dir(path: str, split: str | None) -> "datasets.Dataset | list[dict]":
    # `save_to_disk` writes state.json (Dataset) or dataset_dict.json (DatasetDict).
    if os.path.exists(os.path.join(path, "state.json")) or os.path.exists(
        os.path.join(path, "dataset_dict.json")
    ):
        return _pick_split(datasets.load_from_disk(path), split, path)
    files = sorted(
        os.path.join(root, f)
        for root, _, names in os.walk(path)
        for f in names
        if os.path.splitext(f)[1].lower() in BUILDERS
    )
    if not files:
        raise FileNotFoundError(
            f"directory '{path}' holds no dataset: neither `save_to_disk` output nor data files "
            f"with extension {', '.join(sorted(BUILDERS))}"
        )
    builders = {_builder_for(f) for f in files}
    if len(builders) > 1:
        raise ValueError(f"directory '{path}' mixes data file types: {sorted(builders)}")
    builder = builders.pop()
    if builder in ("parquet", "arrow"):  # typed files: their own schema is authoritative
        # Let `datasets` infer splits from file names (train.jsonl, test-00000.parquet, ...).
        return _pick_split(datasets.load_dataset(builder, data_dir=path), split, path)
    # JSON/CSV: the same split inference as `load_dataset(data_dir=...)`, but the files are
    # read by `_read_text_rows` so that no value is retyped.
    base = Path(path).expanduser().resolve().as_posix()
    splits = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
    files = [f for f in _pick_split(splits, split, path) if _builder_for_or_none(f) == builder]
    rows = [r for f in files for r in _read_text_rows(f, f, builder, allow_empty=True)]
    if not rows:
        raise ValueError(f"directory '{path}' holds no rows for split '{split or 'train'}'")
    return rows


def _builder_for_or_none(path: str) -> str | None:
    return BUILDERS.get(os.path.splitext(path)[1].lower())


def _looks_local(path: str) -> bool:
    """A path that cannot be a hub name: relative/absolute markers or a data-file extension."""
    return (
        path.startswith((".", "/", "~"))
        or os.path.splitext(path)[1].lower() in BUILDERS
        or path.count("/") > 1
    )


def load_rows(path: str, split: str | None = None) -> "datasets.Dataset | list[dict]":
    """Rows of a dataset, indexable and each row a dict: a list of dicts for JSON/JSONL/CSV files
    (each value exactly as written: what `json.loads` gives, CSV cells as strings), else a
    `datasets.Dataset` (parquet, arrow, `save_to_disk`, hub).

    `path`: a local data file (json/jsonl/csv/parquet/arrow), a local directory (saved with
    `save_to_disk`, or containing data files), or a hub dataset name, optionally `split@name`.
    `split` selects a split when the source has several (default 'train'); a split given in the
    path wins. Local paths that do not exist raise FileNotFoundError naming the path.
    """
    path = os.fspath(path)
    expanded = os.path.expanduser(path)
    if "@" in path and not os.path.exists(expanded):
        split, path = path.split("@", 1)
        expanded = os.path.expanduser(path)
    if os.path.isfile(expanded):
        ds = _load_file(expanded, path)
        if split not in (None, "train"):
            raise ValueError(f"'{path}' is a single data file; cannot select split '{split}'")
        logger.info("loaded %d rows from %s", len(ds), path)
        return ds
    if os.path.isdir(expanded):
        ds = _load_dir(expanded, split)
        logger.info("loaded %d rows from %s", len(ds), path)
        return ds
    if _looks_local(path):
        raise FileNotFoundError(f"data file or directory '{path}' does not exist")
    return _load_hub(path, split)


def _load_file(expanded: str, path: str):
    """One data file; an empty or malformed file raises a ValueError naming the file (and, for
    JSON and CSV, the 1-based line)."""
    builder = _builder_for(expanded)
    if builder in ("json", "csv"):
        return _read_text_rows(expanded, path, builder)
    try:
        if builder == "arrow":
            # A single Arrow file (e.g. one shard of `save_to_disk`) loads without caching.
            ds = datasets.Dataset.from_file(expanded)
        else:
            ds = datasets.load_dataset(builder, data_files=expanded, split="train")
    except (Exception, StopIteration) as e:
        raise ValueError(f"cannot read data file '{path}': {type(e).__name__}: {e}") from e
    if len(ds) == 0:
        raise ValueError(f"data file '{path}' has no rows")
    return ds


# JSON and CSV are read here, not by `datasets`: its type inference unifies each column across
# rows, so a column mixing strings and lists (or strings and ints) became a `Json` feature that
# decoded every JSON-looking string ("4" -> 4, "null" -> None), and an all-digits CSV column
# became int64. Rows must reach the trainers exactly as written.
def _read_text_rows(expanded: str, path: str, builder: str, allow_empty: bool = False) -> list[dict]:
    try:
        # utf-8-sig: a leading byte-order mark (Windows editors) is not part of the data.
        with open(expanded, encoding="utf-8-sig", newline="" if builder == "csv" else None) as f:
            rows = _json_rows(f) if builder == "json" else _csv_rows(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read data file '{path}': not UTF-8 text ({e})") from e
    except _BadFile as e:
        raise ValueError(f"cannot read data file '{path}': {e}") from None
    if rows is None:
        if allow_empty:
            return []
        raise ValueError(f"data file '{path}' is empty")
    if not rows and not allow_empty:
        raise ValueError(f"data file '{path}' has no rows")
    return rows


class _BadFile(Exception):
    """A malformed JSON/CSV file; the message says where (1-based line)."""


def _json_rows(f) -> list[dict] | None:
    """A JSON array of objects, one (possibly pretty-printed) object, or JSON Lines; None if the
    file holds only whitespace."""
    first = _first_char(f)
    if first is None:
        return None
    if first == "[":  # one JSON document
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise _BadFile(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        for i, row in enumerate(doc):
            if not isinstance(row, dict):
                raise _BadFile(f"item {i} of the JSON array is a JSON {type(row).__name__}, "
                               f"not an object with keys")
        return doc
    rows = []
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if not rows:  # maybe one pretty-printed object (which `datasets` read as one row)
                f.seek(0)
                try:
                    doc = json.load(f)
                except json.JSONDecodeError:
                    doc = None
                if isinstance(doc, dict):
                    return [doc]
            raise _BadFile(f"line {lineno} is not valid JSON (column {e.colno}: {e.msg})") from None
        if not isinstance(row, dict):
            raise _BadFile(f"line {lineno} is a JSON {type(row).__name__}, not an object with keys")
        rows.append(row)
    return rows


def _first_char(f) -> str | None:
    """The first non-whitespace character of text file `f` (None: none); rewinds `f`."""
    while chunk := f.read(1 << 16):
        if stripped := chunk.lstrip():
            f.seek(0)
            return stripped[0]
    f.seek(0)
    return None


def _csv_rows(f) -> list[dict] | None:
    """Rows of a CSV file with a header line; every cell a string, as the csv module reads it."""
    # A long response can exceed the csv module's default 128 KiB per field.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    reader = csv.reader(f)
    try:
        header = next(reader, None)
        if header is None:
            return None
        if len(set(header)) != len(header):
            dup = sorted({h for h in header if header.count(h) > 1})
            raise _BadFile(f"line 1 (the header) repeats column name(s) {dup}")
        rows = []
        for cells in reader:
            if not cells:  # a blank line
                continue
            if len(cells) != len(header):
                raise _BadFile(f"line {reader.line_num} has {len(cells)} field(s), the header "
                               f"has {len(header)}")
            rows.append(dict(zip(header, cells)))
    except csv.Error as e:
        raise _BadFile(f"line {reader.line_num} is not valid CSV ({e})") from None
    return rows


def _load_hub(name: str, split: str | None) -> datasets.Dataset:
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # network, auth, unknown name: say what was tried
        raise FileNotFoundError(
            f"'{name}' is not a local file or directory, and loading it from the Hugging Face hub "
            f"(split '{split or 'train'}') failed: {type(e).__name__}: {e}"
        ) from e
    logger.info("loaded %d rows from hub dataset %s (split %s)", len(ds), name, split or "train")
    return ds


def split_train_test(rows, test_ratio: float, seed: int = 0):
    """Deterministically hold out `test_ratio` of `rows` -> (train, test).

    Works for a `datasets.Dataset` (uses `select`) and for a list. `test_ratio == 0` returns
    (rows, None). Both parts keep their original relative order; at least one row lands on each
    side when the ratio is positive.
    """
    if not 0.0 <= test_ratio < 1.0:
        raise ValueError(f"test_ratio must be in [0, 1), got {test_ratio}")
    if test_ratio == 0.0:
        return rows, None
    n = len(rows)
    if n < 2:
        raise ValueError(f"cannot split {n} row(s) into non-empty train and test sets")
    n_test = min(max(1, round(n * test_ratio)), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    test_idx, train_idx = sorted(order[:n_test]), sorted(order[n_test:])
    if isinstance(rows, datasets.Dataset):
        return rows.select(train_idx), rows.select(test_idx)
    return [rows[i] for i in train_idx], [rows[i] for i in test_idx]
