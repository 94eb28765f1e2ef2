"""Section reward.judge: a generative judge's score of each completion, added to the rule reward (app/judge.py).
Its parse spec is the nested section reward.judge.parse."""
from __future__ import annotations

import string

from pydantic import model_validator

from common.config.base import Section, broken, option
from common.config.choices import JudgeParseKind

# The row fields a judge template may name; {completion} is required (a judge that never sees it judges nothing).
TEMPLATE_FIELDS = ("prompt", "completion", "answer")


def template_problems(template: str | None) -> list[str]:
    """What is wrong with a judge template: not a format string, an unknown placeholder, no {completion}."""
    if template is None:
        return []
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:  # a lone { or }
        return [f"reward.judge.template: not a format string ({error}); write a literal brace as {{{{ or }}}}"]
    unknown = sorted({name for name in names if name not in TEMPLATE_FIELDS})
    return broken(
        (not unknown, f"reward.judge.template: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
                      f"allowed: {', '.join('{' + n + '}' for n in TEMPLATE_FIELDS)}"),
        ("completion" in names, "reward.judge.template: has no {completion} placeholder: the judge would never see "
                                "the completion it scores"),
    )


def _yes_no_words(parse):
    """YAML 1.1 reads yes / no as booleans, the keys of `{kind: words, yes: [Y, yes], no: [N, no]}` and the
    words in its lists alike: they are the words yes and no here."""
    if not isinstance(parse, dict):
        return parse
    word = {True: "yes", False: "no"}
    out = {word.get(key, key) if isinstance(key, bool) else key: value for key, value in parse.items()}
    for key in ("yes", "no"):
        if isinstance(out.get(key), list):
            out[key] = [word[w] if isinstance(w, bool) else w for w in out[key]]
    return out


class JudgeParseConfig(Section):
    section = "reward.judge.parse"
    kind: JudgeParseKind = option(
        "words", "`words`: the reply's first word (else its first letter) is looked up, case-insensitively, in "
                 "`yes` (score 1) and `no` (score 0); `score`: the reply's first number, in [min, max], scaled to "
                 "[0, 1].")
    min: float = option(0.0, "kind score: the lowest score the judge is asked for (maps to 0).")
    max: float = option(10.0, "kind score: the highest score the judge is asked for (maps to 1).")
    yes: list[str] = option(["Y", "yes"], "kind words: replies that mean yes (score 1).")
    no: list[str] = option(["N", "no"], "kind words: replies that mean no (score 0).")

    @model_validator(mode="before")
    @classmethod
    def _yaml_booleans(cls, data):
        return _yes_no_words(data)

    def problems(self) -> list[str]:
        if self.kind == "score":
            return broken((self.min < self.max, f"reward.judge.parse: min {self.min} must be < max {self.max}"))
        both = {w.strip().lower() for w in self.yes} & {w.strip().lower() for w in self.no}
        return broken(
            (bool(self.yes) and bool(self.no), "reward.judge.parse: kind words needs non-empty `yes` and `no` lists"),
            (all(w.strip() and " " not in w.strip() for w in self.yes + self.no),
             f"reward.judge.parse: yes/no entries must be single words, got yes={self.yes} no={self.no}"),
            (not both, f"reward.judge.parse: {sorted(both)} is in both `yes` and `no`"),
        )


class JudgeConfig(Section):
    section = "reward.judge"
    template: str | None = option(
        None, "The judge's prompt, with {completion} and optionally {prompt} and {answer} (the data row's); "
              "setting it turns the judge on. The reply is read by reward.judge.parse.")
    parse: JudgeParseConfig = option(
        JudgeParseConfig(), "How the judge's reply becomes a score in [0, 1]: `{kind: words, yes: [Y, yes], no: [N, "
                            "no]}` or `{kind: score, min: 0, max: 10}`.")
    model: str | None = option(
        None, "null: the run's own base model judges, through the run's own service (version 0, adapter off: no "
              "extra engine). A model directory: that model judges, served by its own Serve app beside the "
              "policy's (reward.judge.replicas, cpus, gpus).")
    weight: float = option(1.0, "The judge score's weight in the reward: reward.fn_weight x rule + weight x judge.",
                           ge=0)
    max_tokens: int = option(8, "Tokens the judge may reply with (the parse reads the start of its reply).", ge=1)
    temperature: float = option(0.0, "The judge's sampling temperature (0: greedy).", ge=0)
    timeout_s: float = option(30.0, "Seconds a judgment may take; a late one scores 0 and counts as a timeout.",
                              gt=0)
    max_concurrency: int = option(8, "Judge calls in flight per rollout worker.", ge=1)
    replicas: int = option(1, "reward.judge.model set: replicas of the judge's own Serve app.", ge=1)
    cpus: float = option(0.5, "reward.judge.model set: CPUs reserved per judge replica.", gt=0)
    gpus: float = option(0.0, "reward.judge.model set: GPUs per judge replica (0 on a CPU machine).", ge=0)

    @model_validator(mode="before")
    @classmethod
    def _yaml_booleans(cls, data):
        """The parse mapping's yes / no keys reach JudgeParseConfig as keywords: words, not booleans."""
        if isinstance(data, dict) and "parse" in data:
            return {**data, "parse": _yes_no_words(data["parse"])}
        return data

    def problems(self) -> list[str]:
        return template_problems(self.template)
