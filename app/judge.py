"""A generative judge's reward: each completion of a group is put into `reward.judge.template`, the judge
model replies, and `reward.judge.parse` reads the reply as a score in [0, 1]. The rollout worker adds
`reward.judge.weight` x that score to the rule reward (app/rollout_worker.py).

- The judge is a served model: the run's own base model through the run's own service (reward.judge.model
  null: version 0, adapter off, no extra engine; on a fleet the fleet's base model) or another model served
  by its own Serve app (app/judge_service.py). Either way a judgment is one `generate_group(ids, 1, 0, ...)`.
- A group's completions are judged together: their calls go out at once, at most
  `reward.judge.max_concurrency` in flight per worker, each bounded by `reward.judge.timeout_s`.
- A judgment that fails, times out or cannot be parsed scores 0 and is counted (`JudgeStats`): the judge
  never stalls or fails a run.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from common.config.judge import JudgeConfig, JudgeParseConfig

logger = logging.getLogger("app.judge")

# The base weights' version on every service: the judge samples with the adapter off.
BASE_VERSION = 0
# call(prompt_ids, sampling) -> the service's results for one sample (generate_group with n=1)
JudgeCall = Callable[[list[int], dict], Awaitable[list[dict]]]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_WORD = re.compile(r"\w+")


def render(template: str, row: dict, completion: str) -> str:
    """The judge's prompt for one completion (the template's placeholders are checked by the config)."""
    return template.format(prompt=row.get("prompt", ""), completion=completion, answer=row.get("answer", ""))


def parse_reply(text: str, spec: JudgeParseConfig) -> float | None:
    """The judge's reply as a score in [0, 1]; None when it does not parse. `score`: the first number, which
    must lie in [min, max] ("7/10" -> 7); `words`: the first word, else the first letter (a tiny model's
    "Yx..."), looked up case-insensitively in the yes and no lists."""
    text = text.strip()
    if spec.kind == "score":
        found = _NUMBER.search(text)
        if found is None:
            return None
        value = float(found.group())
        if not spec.min <= value <= spec.max:
            return None
        return (value - spec.min) / (spec.max - spec.min)
    yes = {w.strip().lower() for w in spec.yes}
    no = {w.strip().lower() for w in spec.no}
    word = _WORD.search(text)
    for token in ([word.group().lower(), word.group()[0].lower()] if word else []):
        if token in yes:
            return 1.0
        if token in no:
            return 0.0
    return None


@dataclass
class JudgeStats:
    """One group's judging: the worker reports it to the run's metrics (RunMetrics.log_judge)."""

    calls: int = 0
    parse_failures: int = 0
    timeouts: int = 0
    errors: int = 0
    seconds: float = 0.0  # wall time the group's judging took
    score_sum: float = 0.0  # of the judge scores given (failures count as 0)

    def to_dict(self) -> dict:
        return asdict(self)


class Judge:
    """Scores completions with a served judge model; `call` is the service (see `judge_for`)."""

    def __init__(self, cfg: JudgeConfig, tokenizer, call: JudgeCall, chat: bool = True):
        if cfg.template is None:
            raise ValueError("reward.judge.template: not set; the judge is off")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.call = call
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.sampling = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
        self._limit = asyncio.Semaphore(cfg.max_concurrency)
        self._warned: set[str] = set()

    def prompt_ids(self, row: dict, completion: str) -> list[int]:
        text = render(self.cfg.template, row, completion)
        if self.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def score_group(self, row: dict, completions: list[str]) -> tuple[list[float], JudgeStats]:
        """One judge score in [0, 1] per completion, and what judging them cost."""
        stats = JudgeStats()
        t0 = time.perf_counter()
        scores = await asyncio.gather(*(self._judge_one(row, text, stats) for text in completions))
        stats.seconds = time.perf_counter() - t0
        stats.score_sum = float(sum(scores))
        return list(scores), stats

    async def _judge_one(self, row: dict, completion: str, stats: JudgeStats) -> float:
        async with self._limit:
            stats.calls += 1
            try:
                out = await asyncio.wait_for(self.call(self.prompt_ids(row, completion), dict(self.sampling)),
                                             self.cfg.timeout_s)
                reply = out[0]["text"]
            except asyncio.TimeoutError:
                stats.timeouts += 1
                self._warn("timeout", f"a judgment took over reward.judge.timeout_s={self.cfg.timeout_s}s; scored 0")
                return 0.0
            except Exception as error:  # the judge's failure costs the score, never the group
                stats.errors += 1
                self._warn("error", f"a judgment failed ({type(error).__name__}: {str(error)[:200]}); scored 0")
                return 0.0
        score = parse_reply(reply, self.cfg.parse)
        if score is None:
            stats.parse_failures += 1
            self._warn("parse", f"a judge reply did not parse as reward.judge.parse {self.cfg.parse.kind}: "
                                f"{reply[:80]!r}; scored 0")
            return 0.0
        return score

    def _warn(self, kind: str, message: str) -> None:
        """Once per kind per worker: the counts on the metrics rows say how often."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (further ones are counted in judge_* metrics, not logged)", message)


def judge_for(cfg, tokenizer, own_ingress: Callable[[], object]) -> Judge | None:
    """The run's judge (None when reward.judge.template is unset). `own_ingress()`: the run's ingress handle
    (the rollout worker's, so a fleet run's calls name it); used when reward.judge.model is null. Otherwise the
    judge model's own Serve app is called, with that model's tokenizer."""
    judge = cfg.reward.judge
    if judge.template is None:
        return None
    if judge.model is None:
        service = own_ingress
    else:
        from transformers import AutoTokenizer

        from app.judge_service import judge_app_handle

        tokenizer = AutoTokenizer.from_pretrained(judge.model)
        service = judge_app_handle(cfg)

    async def call(ids: list[int], sampling: dict) -> list[dict]:
        return await service().generate_group.remote(ids, 1, BASE_VERSION, sampling)

    return Judge(judge, tokenizer, call, chat=cfg.data.use_chat_template)
