"""load_rows for every local format, dataset directories, hub dispatch; split_train_test."""
import json

import datasets
import pytest

from RL2.data import io
from RL2.data.io import load_rows, split_train_test

ROWS = [{"prompt": f"q{i}", "response": f"a{i}", "n": i} for i in range(5)]


def as_list(ds):
    return [dict(r) for r in ds]


def test_json_array_and_jsonl(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert as_list(load_rows(str(tmp_path / "rows.json"))) == ROWS
    assert as_list(load_rows(str(tmp_path / "rows.jsonl"))) == ROWS


def test_nested_jsonl(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
             "extra_info": {"answer": "1"}}]
    (tmp_path / "chat.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert as_list(load_rows(str(tmp_path / "chat.jsonl"))) == rows


def test_csv_parquet_arrow(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_csv(str(tmp_path / "rows.csv"), index=False)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "rows.parquet", arrow):
        assert as_list(load_rows(str(path))) == ROWS, path
    # CSV has no types: every cell stays the string the csv module reads.
    assert as_list(load_rows(str(tmp_path / "rows.csv"))) == [{k: str(v) for k, v in r.items()} for r in ROWS]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mixed_str_and_messages_column_stays_as_written(tmp_path):
    # README allows a response as text or as assistant messages, row by row.
    rows = ([{"prompt": "What is 2 plus 2?", "response": "4"}] * 6
            + [{"prompt": "Say hi", "response": [{"role": "assistant", "content": "hello"}]}] * 2)
    got = as_list(load_rows(write_jsonl(tmp_path / "mixed.jsonl", rows)))
    assert got == rows and got[0]["response"] == "4" and isinstance(got[0]["response"], str)


def test_nested_answer_keeps_each_rows_type(tmp_path):
    # PPO answers: numeric-looking strings in 63 rows, an int in one; an env comparing strings
    # must get strings.
    rows = [{"prompt": f"q{i}", "extra_info": {"answer": str(i)}} for i in range(63)]
    rows.append({"prompt": "q63", "extra_info": {"answer": 63}})
    for name in ("ppo.jsonl", "ppo.json"):
        path = tmp_path / name
        path.write_text(json.dumps(rows) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in rows))
        got = as_list(load_rows(str(path)))
        assert got == rows, name
        assert [type(r["extra_info"]["answer"]) for r in got] == [str] * 63 + [int]


def test_json_looking_strings_stay_strings(tmp_path):
    rows = [{"prompt": "p", "response": v} for v in ("null", "[1]", "{}", "true", "1.5", "4")]
    rows.append({"prompt": "p", "response": [{"role": "assistant", "content": "[1]"}]})
    assert as_list(load_rows(write_jsonl(tmp_path / "s.jsonl", rows))) == rows


def test_csv_cells_stay_strings(tmp_path):
    path = tmp_path / "nums.csv"
    path.write_text('prompt,response\nWhat is 2 plus 2?,4\n"Say ""7""",007\nHalf?,0.5\n')
    assert as_list(load_rows(str(path))) == [{"prompt": "What is 2 plus 2?", "response": "4"},
                                             {"prompt": 'Say "7"', "response": "007"},
                                             {"prompt": "Half?", "response": "0.5"}]
    d = tmp_path / "csvdir"
    d.mkdir()
    (d / "train.csv").write_text("prompt,response\nq,1\n")
    (d / "test.csv").write_text("prompt,response\nq,2\n")
    assert as_list(load_rows(str(d), split="test")) == [{"prompt": "q", "response": "2"}]


def test_malformed_and_empty_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "response": "x"}\n{"prompt": "hi", "response": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl': line 2 is not valid JSON"):
        load_rows(str(bad))
    bad.write_text('{"prompt": "hi", "response": "x"}\n["not", "an", "object"]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl': line 2 is a JSON list, not an object"):
        load_rows(str(bad))
    for name, text, message in (("empty.jsonl", "\n  \n", r"data file '.*empty\.jsonl' is empty"),
                                ("none.json", "[]", r"none\.json' has no rows"),
                                ("ragged.csv", "prompt,response\na,b\nc,d,e\n", r"ragged\.csv': line 3 has 3 field"),
                                ("head.csv", "prompt,response\n", r"head\.csv' has no rows")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            load_rows(str(tmp_path / name))


def test_pretty_printed_object_and_bom(tmp_path):
    row = {"prompt": "p", "response": "4"}
    (tmp_path / "one.json").write_text(json.dumps(row, indent=2))
    assert as_list(load_rows(str(tmp_path / "one.json"))) == [row]
    (tmp_path / "bom.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8-sig")
    assert as_list(load_rows(str(tmp_path / "bom.jsonl"))) == [row]


def test_save_to_disk_dirs(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert as_list(load_rows(str(tmp_path / "one"))) == ROWS
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                               "test": datasets.Dataset.from_list(ROWS[3:])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert as_list(load_rows(str(tmp_path / "dict"))) == ROWS[:3]
    assert as_list(load_rows(str(tmp_path / "dict"), split="test")) == ROWS[3:]
    assert as_list(load_rows(f"test@{tmp_path / 'dict'}")) == ROWS[3:]
    with pytest.raises(ValueError, match=r"split 'validation' not found .*\['train', 'test'\]"):
        load_rows(str(tmp_path / "dict"), split="validation")


def test_dir_of_data_files(tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    (d / "test.jsonl").write_text(json.dumps(ROWS[4]) + "\n")
    assert as_list(load_rows(str(d))) == ROWS[:4]
    assert as_list(load_rows(str(d), split="test")) == [ROWS[4]]


def test_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(missing)
    with pytest.raises(FileNotFoundError, match="data/sub/x"):
        load_rows("data/sub/x")
    (tmp_path / "rows.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"rows\.txt.*extension '\.txt'"):
        load_rows(str(tmp_path / "rows.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_rows(str(tmp_path / "empty"))
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match="cannot select split 'test'"):
        load_rows(str(tmp_path / "rows.jsonl"), split="test")


def test_hub_names_dispatch_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split=None, **kw):
        calls.append((name, split, kw))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(io.datasets, "load_dataset", fake_load_dataset)
    assert len(load_rows("org/ds")) == 5
    load_rows("test@org/ds")
    load_rows("org/ds", split="validation")
    load_rows("gsm8k")
    assert calls == [("org/ds", "train", {}), ("org/ds", "test", {}),
                     ("org/ds", "validation", {}), ("gsm8k", "train", {})]

    def offline(name, split=None, **kw):
        raise ConnectionError("no network")

    monkeypatch.setattr(io.datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"'org/ds' is not a local .*ConnectionError"):
        load_rows("org/ds")


@pytest.mark.parametrize("make", [lambda rows: rows, datasets.Dataset.from_list])
def test_split_train_test(make):
    rows = make([{"i": i} for i in range(20)])
    train, test = split_train_test(rows, 0.25, seed=1)
    tr, te = [r["i"] for r in train], [r["i"] for r in test]
    assert len(te) == 5 and sorted(tr + te) == list(range(20)) and tr == sorted(tr)
    again = split_train_test(rows, 0.25, seed=1)
    assert [r["i"] for r in again[1]] == te
    assert [r["i"] for r in split_train_test(rows, 0.25, seed=2)[1]] != te
    assert split_train_test(rows, 0.0, seed=1) == (rows, None)
    assert len(split_train_test(rows, 0.01, seed=0)[1]) == 1  # at least one test row
    with pytest.raises(ValueError, match="test_ratio"):
        split_train_test(rows, 1.0, seed=0)
