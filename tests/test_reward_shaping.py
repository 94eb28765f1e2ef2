"""Reward side of the loss registry: DAPO's overlong shaping (by hand), the reward-signature dispatch
(row, finish_reason), and a rollout worker's dynamic sampling with fake buffer/router/metrics (no Ray)."""
import asyncio

from app.rewards import Scorer, extra_reward_kwargs, letter_reward, load_scorer, overlong_penalty, scorer_for
from common.config import from_dict


def test_overlong_penalty_by_hand():
    # max_new_tokens 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -penalty at 16
    assert [overlong_penalty(n, 16, 4, 1.0) for n in (1, 12, 13, 14, 15, 16, 17)] == \
        [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(14, 16, 4, 0.5) == -0.25
    assert overlong_penalty(16, 16, 0, 1.0) == 0.0  # buffer 0 = off
    assert overlong_penalty(100, 100, 10, 2.0) == -2.0


def classic(completion, answer, prompt):
    return float(completion == answer)


def with_row(completion, answer, prompt, *, row):
    return float(row["level"])


def with_both(completion, answer, prompt="", row=None, finish_reason=None):
    return (1.0 if finish_reason == "stop" else 0.0) + float(row["level"])


def with_reason(completion, answer, prompt, finish_reason):
    return 1.0 if finish_reason == "length" else 0.0


def with_kwargs(completion, answer, prompt, **kw):
    return float(sorted(kw) == ["finish_reason", "row"])


ROW = {"id": "7", "prompt": "Say K.", "answer": "K", "level": 3}


def test_reward_signature_dispatch():
    assert extra_reward_kwargs(classic) == ()
    assert extra_reward_kwargs(letter_reward) == ()
    assert extra_reward_kwargs(with_row) == ("row",)
    assert extra_reward_kwargs(with_both) == ("row", "finish_reason")
    assert extra_reward_kwargs(with_reason) == ("finish_reason",)
    assert extra_reward_kwargs(with_kwargs) == ("row", "finish_reason")
    assert scorer_for(classic)("K", ROW, "stop") == 1.0
    assert scorer_for(with_row)("x", ROW, "stop") == 3.0
    assert scorer_for(with_both)("x", ROW, "stop") == 4.0 and scorer_for(with_both)("x", ROW, "length") == 3.0
    assert scorer_for(with_reason)("x", ROW, "length") == 1.0
    assert scorer_for(with_kwargs)("x", ROW, None) == 1.0
    s = load_scorer("app.rewards:letter_reward")
    assert s == Scorer(letter_reward, ()) and s(" K\n", ROW) == 1.0


# ---------------------------------------------------------------- the rollout worker, with fakes


class _M:
    def __init__(self, fn):
        self.remote = fn


class FakeBuffer:
    def __init__(self):
        self.acquired = self.released = 0
        self.put_groups = []
        self.acquire, self.release, self.put = _M(self._acquire), _M(self._release), _M(self._put)

    async def _acquire(self):
        self.acquired += 1
        return True

    async def _release(self):
        self.released += 1

    async def _put(self, g):
        self.put_groups.append(g)


class FakeRouter:
    """Completions per prompt: (text, token count, finish_reason)."""

    def __init__(self, plan):
        self.plan = plan
        self.generate_group = _M(self._gen)

    async def _gen(self, prompt_ids, n, version, sampling, drop_if_expired=False):
        text = "".join(chr(i) for i in prompt_ids)
        return [{"text": c, "token_ids": list(range(k)), "logprobs": [-1.0] * k, "finish_reason": fr,
                 "version": 3} for c, k, fr in self.plan[text]][:n]


class FakeMetrics:
    def __init__(self):
        self.filtered, self.rollouts = [], []
        self.log_filtered_group = _M(lambda *a: self.filtered.append(a))
        self.log_rollout = _M(lambda *a: self.rollouts.append(a))


def fake_tokenizer(text, add_special_tokens=False):
    return {"input_ids": [ord(c) for c in text]}


def reason_reward(completion, answer, prompt, *, row, finish_reason):
    return float(completion == answer) + row["bonus"]


def make_worker(dynamic_sampling, buffer_len, plan, rows):
    from app.rollout_worker import RolloutWorker

    cls = RolloutWorker.__ray_actor_class__
    w = object.__new__(cls)
    w.cfg = from_dict({"grpo": {"group_size": 3, "max_new_tokens": 16, "dynamic_sampling": dynamic_sampling,
                                "dapo_overlong_buffer": buffer_len, "dapo_overlong_penalty": 1.0},
                       "data": {"use_chat_template": False},
                       "reward": {"fn": "test_reward_shaping:reason_reward"}})
    w.worker_id, w.buffer, w.metrics = 0, FakeBuffer(), FakeMetrics()
    w.tokenizer, w.scorer = fake_tokenizer, scorer_for(reason_reward)
    w.stream, w._stop, w.groups_done, w.filtered_groups = iter(rows), False, 0, 0
    w._router = FakeRouter(plan)

    async def served(comps):  # the served-version proof asks the adapter registry (Ray): not under test here
        return None

    if hasattr(cls, "_check_served"):
        w._check_served = served
    return w


PLAN = {"same": [("K", 3, "stop")] * 3,  # all rewards equal -> no signal
        "long": [("K", 14, "length"), ("K", 12, "stop"), ("Q", 5, "stop")]}
ROWS = [{"id": "a", "prompt": "same", "answer": "K", "bonus": 0.5},
        {"id": "b", "prompt": "long", "answer": "K", "bonus": 0.0}]


def test_dynamic_sampling_drops_all_equal_groups_and_frees_their_slot():
    w = make_worker(True, 4, PLAN, ROWS)
    assert asyncio.run(w.run()) == 1
    b = w.buffer
    assert [g.prompt_id for g in b.put_groups] == ["b"]
    assert b.acquired == 3 and b.released == 2  # the filtered group's slot, and the one at the data's end
    assert w.filtered_groups == 1 and [f[0] for f in w.metrics.filtered] == [9]  # its 9 generated tokens
    # overlong shaping: 14 of 16 tokens with buffer 4 -> -0.5; 12 -> 0; the row and finish_reason reach the fn
    assert b.put_groups[0].rewards == [1.0 - 0.5, 1.0, 0.0]


def test_without_dynamic_sampling_every_group_is_kept():
    w = make_worker(False, 0, PLAN, ROWS)
    assert asyncio.run(w.run()) == 2
    assert [g.rewards for g in w.buffer.put_groups] == [[1.5, 1.5, 1.5], [1.0, 1.0, 0.0]]
    assert [s.advantage for s in w.buffer.put_groups[0].samples] == [0.0, 0.0, 0.0]
    assert w.filtered_groups == 0 and w.metrics.filtered == [] and w.buffer.released == 1
