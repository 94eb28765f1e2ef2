"""data.path as people have it: `datasets` save_to_disk directories (Dataset, DatasetDict + data.split),
directories of split files, and bad rows named by row number, refused or skipped (data.on_bad_row).
Fixtures are written with the `datasets` package itself; the loader reads them with pyarrow only."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data import DataError, load_prompts, load_prompts_with_report
from common import config as C
from common.config import DataConfig

datasets = pytest.importorskip("datasets")


def _ds(n, start=0):
    return datasets.Dataset.from_dict({"question": [f"q{i}?" for i in range(start, start + n)],
                                       "answer": [str(i) for i in range(start, start + n)]})


def _cfg(path, **kw):
    return DataConfig(path=str(path), prompt_column=kw.pop("prompt_column", "question"), **kw)


def test_save_to_disk_dataset_in_shard_order(tmp_path):
    ds = _ds(50)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    rows = load_prompts(_cfg(tmp_path / "ds"))
    ref = datasets.load_from_disk(str(tmp_path / "ds"))
    assert [r["prompt"] for r in rows] == ref["question"] == [f"q{i}?" for i in range(50)]
    assert rows[7] == {"id": "7", "prompt": "q7?", "answer": "7"}


def test_save_to_disk_dataset_dict_picks_split(tmp_path):
    datasets.DatasetDict({"train": _ds(6), "test": _ds(2, start=100)}).save_to_disk(str(tmp_path / "dd"))
    assert [r["answer"] for r in load_prompts(_cfg(tmp_path / "dd"))] == ["0", "1", "2", "3", "4", "5"]
    assert [r["answer"] for r in load_prompts(_cfg(tmp_path / "dd", split="test"))] == ["100", "101"]
    with pytest.raises(DataError, match=r"data.split: 'validation' is not a split of .*dd \(splits: train, test\)"):
        load_prompts(_cfg(tmp_path / "dd", split="validation"))


def test_directory_of_split_files(tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["1", "2"]}), d / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"question": ["c?"], "answer": ["3"]}), d / "train-00001-of-00002.parquet")
    (d / "test.jsonl").write_text(json.dumps({"question": "t?", "answer": "9"}) + "\n")
    assert [r["prompt"] for r in load_prompts(_cfg(d))] == ["a?", "b?", "c?"]  # shards concatenated in order
    assert load_prompts(_cfg(d, split="test")) == [{"id": "0", "prompt": "t?", "answer": "9"}]
    with pytest.raises(
        DataError, match=r"data.split: no 'validation' data in directory .* \(splits found: test, train\)"
    ):
        load_prompts(_cfg(d, split="validation"))
    with pytest.raises(DataError, match="splits found: none"):
        (tmp_path / "empty").mkdir()
        load_prompts(_cfg(tmp_path / "empty"))


def test_hub_layout_and_split_subdirectories(tmp_path):
    (tmp_path / "hub" / "data").mkdir(parents=True)
    _ds(4).to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    assert len(load_prompts(_cfg(tmp_path / "hub"))) == 4
    (tmp_path / "sub" / "validation").mkdir(parents=True)
    _ds(3).to_json(str(tmp_path / "sub" / "validation" / "part-0.jsonl"))
    assert len(load_prompts(_cfg(tmp_path / "sub", split="validation"))) == 3


def test_single_arrow_file(tmp_path):
    _ds(5).save_to_disk(str(tmp_path / "ds"))
    (arrow,) = (tmp_path / "ds").glob("data-*.arrow")
    assert len(load_prompts(_cfg(arrow))) == 5


def _bad_jsonl(path):
    lines = [{"question": "fine?", "answer": "1"},
             {"answer": "2"},                       # row 1: prompt missing
             {"question": 7, "answer": "3"},        # row 2: prompt not a string
             {"question": "   ", "answer": "4"},    # row 3: empty prompt
             {"question": "ok?", "answer": ""},     # row 4: empty answer
             {"question": "no answer?", "answer": None},  # row 5: null answer
             {"question": "also fine?", "answer": 6}]     # numbers are fine answers
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_bad_rows_refused_with_row_column_and_problem(tmp_path):
    path = _bad_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DataError) as e:
        load_prompts(_cfg(path))
    msg = str(e.value)
    for part in ("row 1: column 'question' is missing (null)", "row 2: column 'question' must be a string",
                 "row 3: column 'question' is empty", "row 4: column 'answer' is empty",
                 "row 5: column 'answer' is missing (null)", "5 bad row(s) of 7", "data.on_bad_row=skip"):
        assert part in msg, (part, msg)


def test_bad_rows_skipped_and_counted(tmp_path, caplog):
    path = _bad_jsonl(tmp_path / "bad.jsonl")
    res = load_prompts_with_report(_cfg(path, on_bad_row="skip"))
    assert [r["prompt"] for r in res.rows] == ["fine?", "also fine?"] and res.rows[1]["answer"] == "6"
    assert res.skipped == 5 and res.problems[0].startswith("row 1:")
    with caplog.at_level("WARNING", logger="app.data"):
        assert len(load_prompts(_cfg(path, on_bad_row="skip"))) == 2
    assert "skipped 5 bad row(s)" in caplog.text
    (tmp_path / "allbad.jsonl").write_text(json.dumps({"question": "", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match="no rows left after skipping 1 bad row"):
        load_prompts(_cfg(tmp_path / "allbad.jsonl", on_bad_row="skip"))


def test_bad_rows_in_a_saved_dataset(tmp_path):
    datasets.Dataset.from_dict({"question": ["a?", None, "c?"], "answer": ["1", "2", "3"]}).save_to_disk(
        str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"row 1: column 'question' is missing \(null\)"):
        load_prompts(_cfg(tmp_path / "ds"))
    assert load_prompts_with_report(_cfg(tmp_path / "ds", on_bad_row="skip")).skipped == 1


def test_config_keys_validated():
    with pytest.raises(C.ConfigError, match="data.on_bad_row: 'ignore' is not error or skip"):
        C.load(None, ["data.on_bad_row=ignore"])
    cfg = C.load(None, ["data.on_bad_row=skip", "data.split=test"])
    assert (cfg.data.on_bad_row, cfg.data.split) == ("skip", "test")


def test_a_row_budget_column_is_read_and_checked(tmp_path):
    """data.max_tokens_column: each row its own completion budget (the length-tailed benchmark's lengths)."""
    path = tmp_path / "budgets.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}?", "answer": "a", "n": n}) + "\n"
                            for i, n in enumerate([3, 40, 0, "7", True])))
    with pytest.raises(DataError) as e:
        load_prompts(_cfg(path, max_tokens_column="n"))
    for part in ("row 2: column 'n' must be a positive integer", "row 3: column 'n' must be a positive integer",
                 "row 4: column 'n'", "3 bad row(s) of 5"):
        assert part in str(e.value), (part, str(e.value))
    rows = load_prompts(_cfg(path, max_tokens_column="n", on_bad_row="skip"))
    assert [r["max_new_tokens"] for r in rows] == [3, 40]
    assert "max_new_tokens" not in load_prompts(_cfg(path))[0]
    with pytest.raises(DataError, match="data.max_tokens_column: column 'budget' is not in"):
        load_prompts(_cfg(path, max_tokens_column="budget"))
