"""reasoning-gym tasks in the config: the path prefix, `data.mix` entries' shape, and reward.fn's default for
such data (the task's own checker, on the part of the completion `reward.extract` picks). The tasks themselves
are app/reasoning_gym_tasks.py's."""
from __future__ import annotations

from typing import Literal

REASONING_GYM = "reasoning-gym:"  # data.path / eval.path prefix of a reasoning-gym task
AnswerExtract = Literal["answer_tag", "boxed", "first_boxed", "none"]
# reward.extract -> the reasoning-gym reward that scores that part of the completion
REASONING_GYM_REWARDS = {"answer_tag": "app.reasoning_gym_tasks:score_answer_tag",
                         "boxed": "app.reasoning_gym_tasks:score_boxed",
                         "first_boxed": "app.reasoning_gym_tasks:score_first_boxed",
                         "none": "app.reasoning_gym_tasks:score_whole"}
MIX_KEYS = {"path", "weight", "args"}


def mix_entry_ok(entry) -> bool:
    """A data.mix entry: `{path: reasoning-gym:TASK, weight: number > 0 (default 1), args: {...}}`."""
    if not isinstance(entry, dict) or not set(entry) <= MIX_KEYS:
        return False
    weight = entry.get("weight", 1.0)
    return (isinstance(entry.get("path"), str) and entry["path"].startswith(REASONING_GYM)
            and isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0
            and isinstance(entry.get("args", {}), dict))


def default_reward(sections: dict) -> dict:
    """Config sections (nested dicts) with reward.fn filled in when reasoning-gym data (or reward.extract) leaves
    it unset: the task's own checker on the answer reward.extract picks (default answer_tag). A config built
    again from its to_dict keeps what was chosen."""
    data, reward = sections.get("data"), sections.get("reward")
    if not isinstance(data, dict) or (reward is not None and not isinstance(reward, dict)):
        return sections
    reward = dict(reward or {})
    gym = str(data.get("path", "")).startswith(REASONING_GYM) or bool(data.get("mix"))
    if "fn" in reward or not (gym or reward.get("extract")):
        return sections
    reward.setdefault("extract", "answer_tag")
    if reward["extract"] in REASONING_GYM_REWARDS:
        reward["fn"] = REASONING_GYM_REWARDS[reward["extract"]]
    return {**sections, "reward": reward}
