"""The length-tailed benchmark's pieces (issue 42): the seeded long-tailed lengths, their record, the spec
parsing, and what `grpo.ignore_eos` scores (the reply up to the model's first end-of-sequence token)."""
import pytest

from benchmarks.length_tail import describe, draw_lengths, parse_spec, with_lengths


def test_lengths_are_long_tailed_clipped_and_seeded():
    xs = draw_lengths(4000, median=24, sigma=1.0, hi=256, lo=2, seed=3)
    assert xs == draw_lengths(4000, median=24, sigma=1.0, hi=256, lo=2, seed=3)
    assert xs != draw_lengths(4000, median=24, sigma=1.0, hi=256, lo=2, seed=4)
    assert min(xs) >= 2 and max(xs) == 256
    d = describe(xs, 256)
    assert 20 <= d["p50"] <= 28 and d["mean"] > d["p50"] and d["p99"] > 5 * d["p50"]
    assert 0 < d["at_cap_fraction"] < 0.02 and d["tokens_in_top_decile_fraction"] > 0.3
    rows = with_lengths([{"id": "a"}, {"id": "b"}, {"id": "c"}], [5, 9])
    assert [r["max_new_tokens"] for r in rows] == [5, 9, 5] and rows[0]["id"] == "a"


@pytest.mark.parametrize("spec, problem", [("400:1.0", "MEDIAN:SIGMA:MAX"), ("x:1:3000", "numbers"),
                                           ("400:0:3000", "SIGMA > 0"), ("4000:1:3000", "MEDIAN <= MAX")])
def test_bad_specs_say_what_is_wrong(spec, problem):
    with pytest.raises(ValueError, match=problem):
        parse_spec(spec)
    assert parse_spec("400:1.0:3000:8") == {"median": 400.0, "sigma": 1.0, "hi": 3000, "lo": 8}


def test_ignore_eos_scores_the_reply_up_to_the_first_eos(tiny_model_dir):
    from transformers import AutoTokenizer

    from app.rollout_worker import eos_token_ids, text_until_eos

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    eos = eos_token_ids(str(tiny_model_dir), tok)
    assert tok.eos_token_id in eos
    answer = tok.encode("K", add_special_tokens=False)
    tail = tok.encode("QZ junk", add_special_tokens=False)
    e = min(eos)
    comp = {"token_ids": answer + [e] + tail + [e], "text": "KQZ junk"}
    assert text_until_eos(comp, tok, eos) == "K"
    assert text_until_eos({"token_ids": answer + tail, "text": "KQZ junk"}, tok, eos) == "KQZ junk"
    assert text_until_eos({"token_ids": [e] + tail, "text": "QZ junk"}, tok, eos) == ""


def test_gpu_pipeline_rewrites_its_prompts_with_the_tail(tmp_path):
    """gpu_pipeline.py --length-tail: the same prompts, each with its own length; the keys that use them."""
    import json

    from benchmarks.gpu_pipeline import WORKLOAD, _length_tail, parse_args

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "x" * 10, "answer": "a"}) + "\n" for i in range(300)))
    sets = _length_tail(data, "400:1.0:3000")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(300)]
    lengths = [r["max_new_tokens"] for r in rows]
    assert max(lengths) <= 3000 and 300 <= sorted(lengths)[150] <= 500
    assert sets == ["data.max_tokens_column=max_new_tokens", "grpo.max_new_tokens=3000",
                    f"model.max_model_len={WORKLOAD['prompt_tokens'] + 3000 + 16}"]
    assert parse_args(["--modes", "sync,async,async-partial", "--length-tail", "400:1:3000"]).length_tail


def test_a_gpu_leases_runs_are_recorded_as_the_benchmarks_table(tmp_path):
    """`app bench length_tail --from-gpu DIR`: what gpu_pipeline brought back (its document and each run's rows)
    becomes this benchmark's record; the step time and the completion tokens per second are over steps 2..N."""
    import json

    from benchmarks.bench_length_tail import main

    src = tmp_path / "lease"
    src.mkdir()
    runs = {}
    for key, tokens in (("async-mps", 1000), ("async-partial-mps", 1500)):
        rows = [{"step": i, "step_seconds": 10.0 if i == 1 else 5.0, "tokens": tokens, "dropped_samples": 8 * i,
                 "reward_mean": 0.5, "staleness_max": 2} for i in range(1, 6)]
        (src / f"gpu_pipeline_tail-{key}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[key] = {"step_seconds_mean": 5.0, "reward_first_quarter": None, "reward_last_quarter": None,
                     "trainer_idle_fraction": None, "generation_idle_fraction": None, "wall_seconds": 60.0,
                     "dropped_continued_groups": 3 if "partial" in key else 0}
    doc = {"device": "1 x TEST GPU", "length_tail": "400:1.0:3000", "command": "gpu_pipeline ...",
           "workload": {"max_staleness": 2}, "runs": {"1gpu": runs}}
    (src / "gpu_pipeline_length_tail.json").write_text(json.dumps(doc))
    assert main(["--from-gpu", str(src), "--out", str(tmp_path / "out"), "--tag", "t"]) == 0
    rec = json.loads((tmp_path / "out" / "length_tail_gpu_t.json").read_text())
    assert set(rec["results"]) == {"async", "async-partial"} and rec["device"] == "1 x TEST GPU"
    assert rec["results"]["async"]["step_seconds_mean"] == 5.0 and rec["results"]["async"]["dropped_samples"] == 40
    assert rec["results"]["async-partial"]["dropped_continued_groups"] == 3
    assert rec["partial_vs_async"] == 1.0 and abs(rec["partial_vs_async_tokens"] - 1.5) < 1e-9
    assert (tmp_path / "out" / "length_tail_gpu_t.png").stat().st_size > 0
    (src / "gpu_pipeline_tail-async-mps.metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match="async-mps"):  # a run named in the document without its rows
        main(["--from-gpu", str(src), "--out", str(tmp_path / "out")])
