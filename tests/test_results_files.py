"""The measured results shipped under benchmarks/results/ are what BENCHMARKS.md and the issues cite:
each file must parse (a hand edit once left an unescaped quote in gpu_runs.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_result_json_parses(path):
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and data, f"{path.name}: expected a non-empty JSON object"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.jsonl")), ids=lambda p: p.name)
def test_result_jsonl_rows_parse(path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert rows and all(isinstance(r, dict) for r in rows), f"{path.name}: expected JSON object rows"
