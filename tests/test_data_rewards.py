"""Prompts (parquet/JSONL/builtin), cursor, rewards: pure, fast."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data import DataError, letters_task, load_prompts, render_prompt
from app.rewards import boxed_math_reward, last_boxed, letter_reward, load_reward
from common.config import DataConfig


def test_letters_task_is_seeded_and_answerable():
    rows = letters_task(50, seed=3)
    assert rows == letters_task(50, seed=3) and rows != letters_task(50, seed=4)
    for r in rows:
        assert f"letter {r['answer']}," in r["prompt"]


def test_parquet_and_jsonl_with_column_map(tmp_path):
    pq.write_table(pa.table({"q": ["1+1?", "2+2?"], "a": ["2", "4"]}), tmp_path / "d.parquet")
    rows = load_prompts(DataConfig(path=str(tmp_path / "d.parquet"), prompt_column="q", answer_column="a"))
    assert rows == [{"id": "0", "prompt": "1+1?", "answer": "2"}, {"id": "1", "prompt": "2+2?", "answer": "4"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"problem": p, "solution": s, "uid": u})
                                                for p, s, u in [("x?", "1", "a"), ("y?", "2", "b")]))
    rows = load_prompts(DataConfig(path=str(tmp_path / "d.jsonl"), prompt_column="problem",
                                   answer_column="solution", id_column="uid"))
    assert [r["id"] for r in rows] == ["a", "b"]


def test_missing_column_names_key_and_columns(tmp_path):
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), tmp_path / "d.parquet")
    with pytest.raises(
        DataError, match=r"data.prompt_column: column 'prompt' is not in .* \(columns: question, answer\)"
    ):
        load_prompts(DataConfig(path=str(tmp_path / "d.parquet")))


def test_bad_rows_and_files(tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", None], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match="row 1: column 'prompt'"):
        load_prompts(DataConfig(path=str(tmp_path / "d.parquet")))
    with pytest.raises(DataError, match="not found"):
        load_prompts(DataConfig(path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="cannot read"):
        load_prompts(DataConfig(path=str(tmp_path / "bad.jsonl")))
    with pytest.raises(DataError, match="unknown builtin"):
        load_prompts(DataConfig(path="builtin:chess"))


def test_render_uses_chat_template_and_system_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = render_prompt({"prompt": "Say the letter K."}, tok, DataConfig(system_prompt="Be brief."))
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_rewards():
    assert letter_reward(" K\n", "K") == 1.0 and letter_reward("KK", "K") == 0.0
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert boxed_math_reward(r"The answer is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert boxed_math_reward(r"The answer is \boxed{\frac{2}{4}}", r"\frac{1}{2}") == 1.0
    assert boxed_math_reward(r"The answer is \boxed{3}", "4") == 0.0
    assert boxed_math_reward("no box", "4") == 0.0
    assert load_reward("app.rewards:letter_reward") is letter_reward
    with pytest.raises(ValueError, match="reward.fn: cannot import"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="has no function"):
        load_reward("app.rewards:nope")


def test_arith_splits_are_disjoint_and_small_numbers_stay_small():
    import re

    from app.data import ARITH_SMALL_TOP, arith_heldout, arith_task

    small_train, small_held = arith_task(2000, steps=1, top=ARITH_SMALL_TOP), arith_heldout(128, steps=1,
                                                                                             top=ARITH_SMALL_TOP)
    for rows in (small_train, small_held):
        for r in rows:
            numbers = [int(x) for x in re.findall(r"\d+", r["prompt"])] + [int(r["answer"])]
            assert all(1 <= x <= ARITH_SMALL_TOP for x in numbers), r
    # a held-out problem is held out in every variant: neither the small nor the full training split asks it
    held = {(r["prompt"].split(".")[0], r["answer"]) for r in small_held}
    for train in (small_train, arith_task(4000, steps=1)):
        assert not held & {(r["prompt"].split(".")[0], r["answer"]) for r in train}
    assert len(small_held) == 128
