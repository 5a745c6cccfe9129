"""Load dataset rows from a local file, a local dataset directory or the Hugging Face hub, and
split off a held-out test set.

Accepted `path` forms (see `load_rows`):
    data/train.jsonl | .json | .csv | .parquet | .arrow      a local data file
    data/my_ds/                                              `save_to_disk` output or a folder of data files
    org/dataset        train@org/dataset                     a hub dataset (optionally `split@name`)
"""
import json
import logging
import os
import random

import datasets

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


def _load_dir(path: str, split: str | None) -> datasets.Dataset:
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
    # Let `datasets` infer splits from file names (train.jsonl, test-00000.parquet, ...).
    ds = datasets.load_dataset(builders.pop(), data_dir=path)
    return _pick_split(ds, split, path)


def _looks_local(path: str) -> bool:
    """A path that cannot be a hub name: relative/absolute markers or a data-file extension."""
    return (
        path.startswith((".", "/", "~"))
        or os.path.splitext(path)[1].lower() in BUILDERS
        or path.count("/") > 1
    )


def load_rows(path: str, split: str | None = None) -> datasets.Dataset:
    """Rows of a dataset as a `datasets.Dataset` (indexable; each row a dict).

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


def _load_file(expanded: str, path: str) -> datasets.Dataset:
    """One data file; an empty or malformed file raises a ValueError naming the file (and, for
    JSON, the 1-based line) instead of `datasets`' StopIteration / generation errors."""
    builder = _builder_for(expanded)
    if builder == "json" and not _json_text(expanded).strip():
        raise ValueError(f"data file '{path}' is empty")
    try:
        if builder == "arrow":
            # A single Arrow file (e.g. one shard of `save_to_disk`) loads without caching.
            ds = datasets.Dataset.from_file(expanded)
        else:
            ds = datasets.load_dataset(builder, data_files=expanded, split="train")
    except (Exception, StopIteration) as e:
        detail = _json_problem(expanded) if builder == "json" else None
        raise ValueError(f"cannot read data file '{path}': "
                         f"{detail or f'{type(e).__name__}: {e}'}") from e
    if len(ds) == 0:
        raise ValueError(f"data file '{path}' has no rows")
    return ds


def _json_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(1 << 16)


def _json_problem(path: str) -> str | None:
    """The first malformed line of a JSON Lines file (1-based), or the JSON error of a .json."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if text.lstrip().startswith("["):  # one JSON document
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        return None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {lineno} is not valid JSON (column {e.colno}: {e.msg})"
        if not isinstance(row, dict):
            return f"line {lineno} is a JSON {type(row).__name__}, not an object with keys"
    return None


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
