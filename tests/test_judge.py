"""The judge reward without Ray: config errors, reply parsing, and the judge client's batching, timeouts and
failures. The served judge is a fake here (`ScriptedService`) because these tests must time a call out, fail
one, and count how many are in flight, deterministically, which a vLLM engine cannot be made to do; the real
service path is tests/test_judge_run.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from app.judge import BASE_VERSION, Judge, JudgeStats, judge_for, parse_reply, render
from common import config as C
from common.config.judge import JudgeConfig, JudgeParseConfig

TEMPLATE = "Is the answer {answer}? Reply: {completion}. Reply Y or N."
ROW = {"id": "0", "prompt": "Say the letter K, not Q or Z.", "answer": "K"}


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, overrides)
    return refused.value.problems


# ------------------------------------------------------------------ config


def test_judge_keys_load_nested_and_are_listed_by_help():
    cfg = C.load(None, [f"reward.judge.template={TEMPLATE}", "reward.judge.parse.kind=score",
                        "reward.judge.parse.max=5", "reward.judge.weight=0.5", "reward.fn_weight=2"])
    judge = cfg.reward.judge
    assert judge.template == TEMPLATE and judge.parse.kind == "score" and judge.parse.max == 5.0
    assert (judge.weight, cfg.reward.fn_weight, judge.temperature, judge.model) == (0.5, 2.0, 0.0, None)
    assert C.from_dict(cfg.to_dict()) == cfg  # what the rollout workers rebuild from
    text = C.describe()
    for key in ("reward.judge.template (", "reward.judge.parse.kind (score | words", "reward.judge.model (",
                "reward.judge.max_concurrency (", "reward.judge.timeout_s (", "reward.fn_weight ("):
        assert f"  {key}" in text, key


def test_judge_template_errors_name_the_problem():
    assert _problems(["reward.judge.template=Is the answer {answer}?"]) == [
        "reward.judge.template: has no {completion} placeholder: the judge would never see the completion it scores"]
    assert _problems(["reward.judge.template=x {completion} {solution}"]) == [
        "reward.judge.template: unknown placeholder(s) {solution}; allowed: {prompt}, {completion}, {answer}"]
    assert _problems(["reward.judge.template=x {completion"])[0].startswith(
        "reward.judge.template: not a format string")
    # a literal brace is written doubled, as str.format reads it
    assert C.load(None, ["reward.judge.template=JSON {{ok}} then {completion}"]).reward.judge.template


def test_judge_parse_spec_errors():
    assert _problems(["reward.judge.parse.kind=score", "reward.judge.parse.min=10", "reward.judge.parse.max=10"]) == [
        "reward.judge.parse: min 10.0 must be < max 10.0"]
    assert _problems(["reward.judge.parse.kind=stars"]) == ["reward.judge.parse.kind: 'stars' is not score or words"]
    assert _problems(["reward.judge.parse.yes=[]"]) == [
        "reward.judge.parse: kind words needs non-empty `yes` and `no` lists"]
    assert _problems(["reward.judge.parse.yes=[y]", "reward.judge.parse.no=[Y]"]) == [
        "reward.judge.parse: ['y'] is in both `yes` and `no`"]
    assert _problems(["reward.judge.parse.scale=3"]) == ["reward.judge.parse.scale: unknown key"]
    assert _problems(["reward.judge.tempalte=x"]) == ["reward.judge.tempalte: unknown key (did you mean "
                                                      "reward.judge.template?)"]


def test_judge_rules_across_sections(tmp_path):
    assert _problems([f"reward.judge.template={TEMPLATE}", f"reward.judge.model={tmp_path / 'nope'}"]) == [
        f"reward.judge.model: {tmp_path / 'nope'} is not a model directory (no config.json there); null judges "
        "with the run's own base model"]
    assert any(p.startswith("reward.judge.model: null judges with the run's base weights")
               for p in _problems([f"reward.judge.template={TEMPLATE}", "sync.mode=merge"]))
    # a judge alone may score a single-turn run, but then there is no rule reward to evaluate with
    assert C.load(None, [f"reward.judge.template={TEMPLATE}", "reward.fn=null"]).reward.fn is None
    assert _problems(["reward.fn=null", "eval.path=builtin:letters-heldout", f"reward.judge.template={TEMPLATE}"])[
        0].startswith("eval.path: evaluation counts a completion correct by reward.fn")
    assert _problems(["reward.fn=null"])[0].startswith("reward.fn: null needs env.cls")


def test_the_judge_recipe_validates():
    cfg = C.load("recipes/judge-cpu.yaml")
    assert cfg.reward.judge.template and "{completion}" in cfg.reward.judge.template and cfg.reward.judge.model is None
    # `{kind: words, yes: [Y, yes], no: [N, no]}`: YAML 1.1 reads yes/no as booleans; they stay the words
    assert (cfg.reward.judge.parse.yes, cfg.reward.judge.parse.no) == (["Y", "yes"], ["N", "no"])


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize("reply, score", [
    ("Y", 1.0), ("N", 0.0), ("yes.", 1.0), ("  no", 0.0), ("Yes, it is K", 1.0), ("n", 0.0),
    ("Ybcd", 1.0),  # a tiny model's first letter
    ("garbage", None), ("", None), ("?!", None), ("maybe", None)])
def test_words_parse(reply, score):
    assert parse_reply(reply, JudgeParseConfig()) == score


@pytest.mark.parametrize("reply, score", [
    ("7/10", 0.7), ("Score: 10", 1.0), ("0", 0.0), (" 2.5 out of 10", 0.25), ("11", None), ("-1", None),
    ("garbage", None), ("seven", None)])
def test_score_parse(reply, score):
    got = parse_reply(reply, JudgeParseConfig(kind="score", min=0, max=10))
    assert got == (pytest.approx(score) if score is not None else None)


def test_render_fills_the_row():
    assert render(TEMPLATE, ROW, "K") == "Is the answer K? Reply: K. Reply Y or N."


# ------------------------------------------------------------------ the client


class ScriptedService:
    """The judge service's contract (`call(prompt_ids, sampling) -> [{"text": ...}]`) with scripted replies:
    a reply, an exception to raise, or a delay; it records the calls and the most it saw in flight."""

    def __init__(self, script, delay_s: float = 0.0):
        self.script, self.delay_s = script, delay_s
        self.calls: list[tuple[list[int], dict]] = []
        self.in_flight = self.most_in_flight = 0

    async def __call__(self, ids: list[int], sampling: dict) -> list[dict]:
        self.calls.append((ids, sampling))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            reply = self.script(len(self.calls) - 1)
            await asyncio.sleep(reply if isinstance(reply, float) else self.delay_s)
            if isinstance(reply, Exception):
                raise reply
            return [{"text": reply, "token_ids": [1], "version": BASE_VERSION}]
        finally:
            self.in_flight -= 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _judge(tokenizer, service, **cfg) -> Judge:
    return Judge(JudgeConfig(template=TEMPLATE, **cfg), tokenizer, service)


def test_a_group_is_judged_together_bounded_by_max_concurrency(tokenizer):
    service = ScriptedService(lambda i: "Y" if i % 2 == 0 else "N", delay_s=0.02)
    judge = _judge(tokenizer, service, max_concurrency=3, max_tokens=4)
    scores, stats = asyncio.run(judge.score_group(ROW, [f"{c}" for c in "KQZKQZKQ"]))
    assert len(service.calls) == 8 and stats.calls == 8
    assert service.most_in_flight == 3  # concurrent, never more than max_concurrency
    assert sorted(scores) == [0.0] * 4 + [1.0] * 4 and stats.score_sum == 4.0
    assert (stats.parse_failures, stats.timeouts, stats.errors) == (0, 0, 0) and stats.seconds > 0
    ids, sampling = service.calls[0]
    assert sampling == {"max_tokens": 4, "temperature": 0.0}  # greedy by default
    text = tokenizer.decode(ids)
    assert "Is the answer K? Reply:" in text and "<|im_start|>assistant" in text  # the chat template's turn


def test_timeouts_errors_and_garbage_score_zero_and_are_counted(tokenizer):
    script = {0: "Y", 1: 5.0, 2: RuntimeError("replica lost"), 3: "I cannot say", 4: "yes"}
    service = ScriptedService(script.__getitem__)
    judge = _judge(tokenizer, service, timeout_s=0.2)
    scores, stats = asyncio.run(asyncio.wait_for(judge.score_group(ROW, ["a", "b", "c", "d", "e"]), 3.0))
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert (stats.calls, stats.timeouts, stats.errors, stats.parse_failures) == (5, 1, 1, 1)
    assert stats.seconds < 1.0  # the slow call was cut at the timeout: the group did not wait 5 s


def test_judge_for_calls_the_runs_own_service_at_the_base_version(tokenizer, tiny_model_dir):
    """reward.judge.model null: the run's own ingress (the worker's handle, which names a fleet run), version 0."""
    sent = []

    class Method:
        def remote(self, *args, **kwargs):
            sent.append((args, kwargs))

            async def result():
                return [{"text": "N"}]
            return result()

    class Ingress:
        generate_group = Method()

    cfg = C.load(None, [f"model.path={tiny_model_dir}", f"reward.judge.template={TEMPLATE}"])
    judge = judge_for(cfg, tokenizer, lambda: Ingress())
    scores, stats = asyncio.run(judge.score_group(ROW, ["Q"]))
    assert scores == [0.0] and stats.calls == 1
    (args, kwargs), = sent
    assert args[1:3] == (1, BASE_VERSION) and kwargs == {}
    assert judge_for(C.load(None, []), tokenizer, lambda: Ingress()) is None  # no template: no judge


def test_judge_stats_reach_the_rows(tmp_path):
    """RunMetrics's own code (the undecorated class, no Ray cluster): counts are running totals, judge_seconds
    and reward_judge describe the groups since the last row."""
    from app.metrics import RunMetrics

    m = RunMetrics.__ray_actor_class__(str(tmp_path), "r")
    m._gauge = lambda key: type("G", (), {"set": lambda *a, **k: None})()  # no Ray metrics agent here
    m.log_judge({})
    m.log_judge(JudgeStats(calls=4, parse_failures=1, seconds=0.5, score_sum=2.0).to_dict())
    m.log_train(1, {})
    m.log_judge(JudgeStats(calls=2, timeouts=1, errors=1, seconds=0.25, score_sum=0.0).to_dict())
    m.log_train(2, {})
    m.log_train(3, {})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["judge_calls"], r["judge_parse_failures"], r["judge_timeouts"], r["judge_errors"]) for r in rows] == [
        (4, 1, 0, 0), (6, 1, 1, 1), (6, 1, 1, 1)]
    assert [(r["judge_seconds"], r["reward_judge"]) for r in rows] == [(0.5, 0.5), (0.25, 0.0), (0.0, None)]


def test_a_judge_model_gets_its_own_app_config(tiny_model_dir):
    """reward.judge.model set: the judge app is the policy's app over the judge model, with the judge's replicas and
    resources, no REST ports of its own, named per run (a fleet's runs each start one)."""
    from app.judge_service import judge_app_name, judge_service_config

    cfg = C.load(None, [f"reward.judge.template={TEMPLATE}", f"reward.judge.model={tiny_model_dir}",
                        "reward.judge.replicas=2", "reward.judge.cpus=0.25", "rollout.replica_http_port=0",
                        "rollout.front_port=0"])
    judge = judge_service_config(cfg)
    assert judge.model.path == str(tiny_model_dir) and not judge.model.build_tiny
    assert (judge.rollout.app_name, judge.rollout.replicas, judge.rollout.cpus_per_replica) == ("policy-judge", 2, 0.25)
    assert judge.rollout.replica_http_port is None and judge.rollout.front_port is None
    on_fleet = cfg.replace(run={"fleet": "shared", "name": "r1"}, rollout={"app_name": "fleet-shared"})
    assert judge_app_name(on_fleet) == "fleet-shared-judge-r1"


def test_the_judge_probe_knows_the_truth_of_its_items():
    """benchmarks/probes/judge_replies scores a model's verdicts against these labels: half the completions are
    right, and a wrong one never states the sum (else agreement would be misread)."""
    import re

    from app.judge import render
    from benchmarks.probes.judge_replies import TEMPLATES, items

    cases = items(40)
    assert sum(good for _, _, good in cases) == 20
    for row, completion, good in cases:
        a, b = map(int, re.findall(r"(\d) \+ (\d)", row["prompt"])[0])
        said = int(re.search(r"boxed\{(-?\d+)\}", completion).group(1))
        assert (said == a + b) == good and row["answer"] == str(a + b)
        for template in TEMPLATES.values():  # every template fills as a run fills it
            assert completion in render(template, row, completion)
