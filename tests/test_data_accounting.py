"""common/data_accounting.py: the check that a run trained every prompt once, on hand-made step rows."""
from common.data_accounting import data_accounting


def _rows(*steps: list[str]) -> list[dict]:
    return [{"step": i + 1, "prompts": p} for i, p in enumerate(steps)]


def test_a_clean_run_loses_and_repeats_nothing():
    out = data_accounting(_rows(["0:letters-0", "0:letters-1"], ["1:letters-1", "1:letters-0"]), 2, 2, 4, 2)
    lost = (out["samples_lost"], out["samples_doubled"], out["prompts_replayed"], out["prompts_skipped"])
    assert lost == (0, 0, 0, 0)
    assert out["epochs_seen"] == [0, 1]


def test_a_replayed_prompt_a_skipped_one_and_a_missing_step_are_counted():
    rows = _rows(["0:letters-0", "0:letters-0"], ["1:letters-0", "1:letters-1"])  # letters-1 skipped in epoch 0
    rows.append({"step": 2, "prompts": []})  # the same step logged twice; step 3 never
    out = data_accounting(rows, 2, 2, 4, 3)
    assert out["prompts_replayed"] == 1 and out["prompts_skipped"] == 1
    assert out["step_rows_duplicated"] == 1 and out["step_rows_missing"] == 1
    assert out["samples_lost"] == (6 - 4) * 4


def test_a_prompt_still_pending_at_the_end_is_not_skipped():
    out = data_accounting(_rows(["0:letters-0"], ["1:letters-0"]), 2, 1, 4, 2, pending=["0:letters-1"])
    assert out["prompts_skipped"] == 0 and out["prompts_pending_at_end_in_earlier_epochs"] == 1
