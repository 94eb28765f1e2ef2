"""Reward side of the loss registry: DAPO's overlong shaping (by hand), the reward-signature dispatch
(row, finish_reason), and a rollout worker's dynamic sampling (no Ray: the real buffer class in this
process, a fake ingress and fake metrics)."""
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
    return float(sorted(kw) == ["finish_reason", "row", "trajectory"])


ROW = {"id": "7", "prompt": "Say K.", "answer": "K", "level": 3}


def test_reward_signature_dispatch():
    assert extra_reward_kwargs(classic) == ()
    assert extra_reward_kwargs(letter_reward) == ()
    assert extra_reward_kwargs(with_row) == ("row",)
    assert extra_reward_kwargs(with_both) == ("row", "finish_reason")
    assert extra_reward_kwargs(with_reason) == ("finish_reason",)
    assert extra_reward_kwargs(with_kwargs) == ("row", "finish_reason", "trajectory")
    assert scorer_for(classic)("K", ROW, "stop") == 1.0
    assert scorer_for(with_row)("x", ROW, "stop") == 3.0
    assert scorer_for(with_both)("x", ROW, "stop") == 4.0 and scorer_for(with_both)("x", ROW, "length") == 3.0
    assert scorer_for(with_reason)("x", ROW, "length") == 1.0
    assert scorer_for(with_kwargs)("x", ROW, None) == 1.0
    s = load_scorer("app.rewards:letter_reward")
    assert s == Scorer(letter_reward, ()) and s(" K\n", ROW) == 1.0


# ---------------------------------------------------------------- the rollout worker, no Ray


class _Remote:
    """`handle.method.remote(...)` for an object in this process: the real RolloutBuffer class, and the
    fakes below, called the way the worker calls actors."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        method = getattr(self._target, name)
        return type("Method", (), {"remote": staticmethod(method)})()


class FakeIngress:
    """Stands in for the Serve app (no Serve here: what is under test is the worker's reward side).
    Completions per prompt: (text, token count, finish_reason)."""

    def __init__(self, plan_by_ids: dict):
        self.plan_by_ids = plan_by_ids

    async def generate_group(self, prompt_ids, n, version, sampling, drop_if_expired=False):
        return [{"text": text, "token_ids": list(range(k)), "logprobs": [-1.0] * k, "finish_reason": reason,
                 "version": 3} for text, k, reason in self.plan_by_ids[tuple(prompt_ids)]][:n]


class FakeMetrics:
    """Records what the worker reports (the RunMetrics actor's methods it calls)."""

    def __init__(self):
        self.filtered, self.rollouts, self.counts = [], [], []

    def log_filtered_group(self, *args):
        self.filtered.append(args)

    def log_rollout(self, *args):
        self.rollouts.append(args)

    def add_count(self, key, n):
        self.counts.append((key, n))


def reason_reward(completion, answer, prompt, *, row, finish_reason):
    return float(completion == answer) + row["bonus"]


def make_worker(tmp_path, monkeypatch, dynamic_sampling, buffer_len, plan, rows):
    """A RolloutWorker built by its constructor, with the real buffer (in this process) as its prompt
    source, a fake ingress and fake metrics, handed out under the names the worker looks them up by
    (no Ray here). The served-version proof has no registry to ask. Of the model the worker reads only
    the tokenizer: the tiny model's, saved alone."""
    from ray import serve

    from app import rollout_worker
    from app.buffer import RolloutBuffer
    from app.data import render_prompt
    from app.tiny_model import build_tokenizer
    from common.names import BUFFER_NAME, METRICS_NAME

    model_dir = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(model_dir)

    cfg = from_dict({"model": {"path": str(model_dir)},
                     "grpo": {"group_size": 3, "max_new_tokens": 16, "dynamic_sampling": dynamic_sampling,
                              "dapo_overlong_buffer": buffer_len, "dapo_overlong_penalty": 1.0},
                     "data": {"use_chat_template": False},
                     "reward": {"fn": f"{__name__}:reason_reward"}})
    buffer = RolloutBuffer.__ray_actor_class__(5, 1, rows)
    metrics = FakeMetrics()
    actors = {BUFFER_NAME: _Remote(buffer), METRICS_NAME: _Remote(metrics)}
    monkeypatch.setattr(rollout_worker, "named_actor", lambda name, namespace: actors.get(name))
    w = rollout_worker.RolloutWorker.__ray_actor_class__(cfg.to_dict(), 0)
    ingress = FakeIngress({tuple(render_prompt(row, w.tokenizer, cfg.data)): plan[row["prompt"]] for row in rows})
    monkeypatch.setattr(serve, "get_app_handle", lambda name: _Remote(ingress))
    return w, buffer, metrics


PLAN = {"same": [("K", 3, "stop")] * 3,  # all rewards equal -> no signal
        "long": [("K", 14, "length"), ("K", 12, "stop"), ("Q", 5, "stop")]}
ROWS = [{"id": "a", "prompt": "same", "answer": "K", "bonus": 0.5},
        {"id": "b", "prompt": "long", "answer": "K", "bonus": 0.0}]


def _run(w, buffer):
    """The worker until the buffer's data runs out, then the groups it queued (in order) and the stats."""
    async def go():
        done = await w.run()
        stats = await buffer.stats()
        batch = await buffer.get_batch(0, stats["queued"], timeout=1) if stats["queued"] else {"groups": []}
        return done, batch["groups"], stats

    return asyncio.run(go())


def test_dynamic_sampling_drops_all_equal_groups_and_frees_their_slot(tmp_path, monkeypatch):
    w, buffer, metrics = make_worker(tmp_path, monkeypatch, True, 4, PLAN, ROWS)
    done, groups, stats = _run(w, buffer)
    assert done == 1 and [g.prompt_id for g in groups] == ["b"]
    # the filtered group's slot is given back, and its prompt goes to the trainer's record, not out again
    assert stats["granted"] == 1 and stats["prompts"]["filtered"] == 1 and stats["prompts"]["handed"] == 2
    assert w.filtered_groups == 1 and [f[0] for f in metrics.filtered] == [9]  # its 9 generated tokens
    # overlong shaping: 14 of 16 tokens with buffer 4 -> -0.5; 12 -> 0; the row and finish_reason reach the fn
    assert groups[0].rewards == [1.0 - 0.5, 1.0, 0.0]


def test_without_dynamic_sampling_every_group_is_kept(tmp_path, monkeypatch):
    w, buffer, metrics = make_worker(tmp_path, monkeypatch, False, 0, PLAN, ROWS)
    done, groups, stats = _run(w, buffer)
    assert done == 2
    assert sorted(g.rewards for g in groups) == [[1.0, 1.0, 0.0], [1.5, 1.5, 1.5]]
    same = next(g for g in groups if g.prompt_id == "a")
    assert [s.advantage for s in same.samples] == [0.0, 0.0, 0.0]
    assert w.filtered_groups == 0 and metrics.filtered == [] and stats["prompts"]["filtered"] == 0
