"""The data cursor that survives restarts (common/data_cursor.py, app/buffer.py, app/metrics.py, the
driver's resume checks), without Ray: every prompt of an epoch is trained on exactly once across any
number of kills and resumes, counted by prompt id."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from common.data_cursor import ConsumedPrompts, PromptSource, epoch_order, parse_prompt_key, prompt_key

ROWS = [{"id": f"p{i}", "prompt": f"prompt {i}", "answer": "A"} for i in range(7)]
IDS = {r["id"] for r in ROWS}


def test_epoch_order_is_a_seeded_permutation():
    assert sorted(epoch_order(7, 3, 0)) == list(range(7))
    assert epoch_order(7, 3, 0) == epoch_order(7, 3, 0) != epoch_order(7, 3, 1)
    assert parse_prompt_key(prompt_key(2, "a:b")) == (2, "a:b")


def test_source_hands_every_prompt_once_per_epoch_then_stops():
    src = PromptSource(ROWS, seed=1, epochs=2)
    got = [src.next() for _ in range(14)]
    assert src.next() is None
    for e in (0, 1):
        ids = [r["id"] for ep, r in got if ep == e]
        assert sorted(ids) == sorted(IDS)


def test_requeued_prompts_come_first_under_their_epoch():
    src = PromptSource(ROWS, seed=0, epochs=1)
    e, row = src.next()
    src.requeue(e, row["id"])
    src.requeue(e, row["id"])  # twice is once
    assert src.next() == (e, row)
    assert sorted(r["id"] for _, r in [src.next() for _ in range(6)]) == sorted(IDS - {row["id"]})
    assert src.next() is None


def test_resume_skips_exactly_the_recorded_prompts():
    src = PromptSource(ROWS, seed=0, epochs=2)
    first = [src.next() for _ in range(9)]  # all of epoch 0, two of epoch 1
    rec = ConsumedPrompts()
    for e, r in first[:3] + first[4:8]:  # the 4th of epoch 0 was granted but its step was lost
        rec.add(e, r["id"])
    resumed = PromptSource(ROWS, seed=0, epochs=2, consumed=rec.to_state())
    rest = []
    while (x := resumed.next()) is not None:
        rest.append(x)
    assert (0, first[3][1]) in rest  # the lost one comes again, in its epoch
    for e in (0, 1):
        ids = [r["id"] for ep, r in first[:3] + first[4:8] + rest if ep == e]
        assert sorted(ids) == sorted(IDS), e


def test_a_finished_epoch_is_skipped_on_resume():
    rec = ConsumedPrompts({0: set(IDS), 1: {"p3"}})
    src = PromptSource(ROWS, seed=0, epochs=2, consumed=rec)
    got = [src.next() for _ in range(6)]
    assert {e for e, _ in got} == {1} and {r["id"] for _, r in got} == IDS - {"p3"} and src.next() is None


def test_rewind_requeues_what_lost_steps_took():
    src = PromptSource(ROWS, seed=0, epochs=1)
    a, b, c = src.next(), src.next(), src.next()
    for e, r in (a, b, c):
        src.take(e, r["id"])
    ckpt = ConsumedPrompts()
    ckpt.add(a[0], a[1]["id"])  # the checkpoint holds only the first step
    assert src.rewind(ckpt.to_state()) == 2
    assert {src.next()[1]["id"], src.next()[1]["id"]} == {b[1]["id"], c[1]["id"]}


def test_consumed_counts_repeats_and_round_trips():
    rec = ConsumedPrompts()
    assert rec.add(0, "a") and rec.add(1, "a") and not rec.add(0, "a")
    back = ConsumedPrompts.from_state(json.loads(json.dumps(rec.to_state())))
    assert back.by_epoch == {0: {"a"}, 1: {"a"}} and back.repeats == 1 and back.count() == 2


def test_duplicate_ids_are_refused():
    with pytest.raises(ValueError, match="not unique"):
        PromptSource([{"id": "x"}, {"id": "x"}], 0, 1)


@pytest.mark.parametrize("seed", range(12))
def test_exactly_once_across_random_kills(seed):
    """A model of the run: grants, failed and stale groups (requeued), batches taken by the trainer,
    checkpoints, and kills at random moments (everything not checkpointed is lost: in-flight and queued
    groups, steps after the checkpoint and their metrics rows). Then a resume from the checkpoint's
    record. Until the data's epochs run out, every prompt of every epoch is trained once."""
    rng = random.Random(seed)
    epochs, per_step = 3, 2
    ckpt = ConsumedPrompts().to_state()
    log: list[list[tuple[int, str]]] = []  # trained steps (metrics rows), up to the checkpoint's
    kills = 0
    while True:
        src = PromptSource(ROWS, seed=seed, epochs=epochs, consumed=ckpt)
        rec = ConsumedPrompts.from_state(ckpt)
        steps = list(log)
        inflight: list[tuple[int, str]] = []
        queue: list[tuple[int, str]] = []
        killed = False
        while True:
            act = rng.random()
            if act < 0.35 and len(inflight) < 4 and (x := src.next()) is not None:
                inflight.append((x[0], x[1]["id"]))
            elif act < 0.6 and inflight:
                g = inflight.pop(rng.randrange(len(inflight)))
                if rng.random() < 0.15:
                    src.requeue(*g)  # generation failed after retries / worker died
                else:
                    queue.append(g)
            elif act < 0.65 and queue:
                src.requeue(*queue.pop(0))  # dropped as too stale
            elif act < 0.85 and len(queue) >= per_step:
                batch, queue = queue[:per_step], queue[per_step:]
                for g in batch:
                    src.take(*g)
                    assert rec.add(*g), f"prompt {g} trained twice"
                steps.append(batch)
                if rng.random() < 0.4:
                    ckpt, log = rec.to_state(), list(steps)
            elif act < 0.88 and kills < 6:
                kills += 1
                killed = True
                break
            if not inflight and not src.requeued and src.epoch >= epochs:
                if len(queue) < per_step:  # the data ran out: a last partial step
                    for g in queue:
                        assert rec.add(*g)
                    steps.append(queue)
                    ckpt, log = rec.to_state(), list(steps)
                    break
        if not killed:
            break
    for e in range(epochs):
        trained = [pid for step in log for ep, pid in step if ep == e]
        assert sorted(trained) == sorted(IDS), (e, trained)


# ---------------------------------------------------------------- the buffer actor's class, without Ray

def _buffer(rows=ROWS, consumed=None, max_staleness=0, per_step=2):
    from app.buffer import RolloutBuffer

    return RolloutBuffer.__ray_actor_class__(max_staleness, per_step, rows, seed=0, epochs=1, consumed=consumed)


def _group(epoch, pid, version=0):
    from common.types import Group

    return Group(samples=[], version=version, prompt_id=pid, epoch=epoch)


def test_buffer_grants_prompts_and_gives_back_every_lost_one():
    async def go():
        b = _buffer(max_staleness=1, per_step=2)  # lead 1: 4 slots at version 0
        g1, g2, g3 = [await b.acquire(worker_id=w) for w in (0, 0, 1)]
        assert all(isinstance(g, dict) and {"epoch", "row"} <= set(g) for g in (g1, g2, g3))
        assert await b.reset_worker(0) == 2  # worker 0 died holding two prompts: both come again
        again = [await b.acquire(worker_id=0), await b.acquire(worker_id=0)]
        assert {x["row"]["id"] for x in again} == {g1["row"]["id"], g2["row"]["id"]}
        # a failed generation: its prompt comes again; a filtered group goes to the next batch's record
        await b.release(1, g3["epoch"], g3["row"]["id"], requeue=True)
        g3b = await b.acquire(worker_id=1)
        assert g3b["row"]["id"] == g3["row"]["id"]
        await b.release(1, g3b["epoch"], g3b["row"]["id"], filtered=True)
        for x in again:
            assert await b.put(_group(x["epoch"], x["row"]["id"]), worker_id=0)
        out = await b.get_batch(0, 2, timeout=1)
        assert out["filtered"] == [prompt_key(g3["epoch"], g3["row"]["id"])]
        st = await b.stats()
        assert st["prompts"]["requeued_reset"] == 2 and st["prompts"]["requeued_failed"] == 1
        assert st["granted"] == 2 and st["outstanding"] == {}  # the two put groups hold their slots
        # the watch's restart budget: each reset_worker is one more incarnation of that worker
        assert await b.starts() == {"train": 0, "rollout": {"0": 1}} and st["rollout_starts"] == {"0": 1}

    asyncio.run(go())


def test_buffer_requeues_stale_groups_and_rewinds():
    async def go():
        b = _buffer(max_staleness=0, per_step=1)
        x = await b.acquire(worker_id=0)
        await b.put(_group(x["epoch"], x["row"]["id"], version=0), worker_id=0)
        await b.set_trainer_version(1)  # the queued v0 group is now too stale: dropped, prompt again
        y = await b.acquire(worker_id=0)
        assert y["row"]["id"] == x["row"]["id"] and (await b.stats())["prompts"]["requeued_stale"] == 1
        await b.put(_group(y["epoch"], y["row"]["id"], version=1), worker_id=0)
        await b.get_batch(1, 1, timeout=1)
        assert await b.rewind(ConsumedPrompts().to_state()) == 1  # the step that took it was lost
        z = await b.acquire(worker_id=0)
        assert z["row"]["id"] == x["row"]["id"]
        assert not await b.stop_requested()
        await b.request_stop()
        assert await b.stop_requested()

    asyncio.run(go())


def test_buffer_trains_the_oldest_version_first_not_the_first_finished():
    """Earliest deadline first: a long group of an early batch that finishes behind short groups of later batches
    is trained before them, so it is not pushed past the staleness floor while they wait (they have slack)."""
    async def go():
        b = _buffer(max_staleness=1, per_step=2)  # lead 1: 4 slots while version 0 is ready
        grants = [await b.acquire(worker_id=0, timeout=1) for _ in range(4)]
        # finishing order: two short groups sampled under v1, then the long v0 group, then another v1
        for g, v in zip(grants, (1, 1, 0, 1)):
            assert await b.put(_group(g["epoch"], g["row"]["id"], version=v), worker_id=0)
        first = await b.get_batch(1, 2, timeout=1)  # floor 0: taken in finishing order the v0 group would wait
        assert [g.version for g in first["groups"]] == [0, 1]
        assert first["groups"][1].prompt_id == grants[0]["row"]["id"]  # ties: the first finished goes first
        second = await b.get_batch(2, 2, timeout=1)  # floor 1: both v1 groups left are still acceptable
        assert [g.version for g in second["groups"]] == [1, 1]
        assert second["dropped_samples"] == 0 and (await b.stats())["dropped_groups"] == 0

    asyncio.run(go())


def test_buffer_says_why_a_group_was_dropped_passed_over_or_too_late():
    """A dropped group either waited in the queue, acceptable, while a batch was taken without it (more acceptable
    groups than a batch holds) or was put after the last batch that could take it: `dropped_waited_groups` counts
    the first, so a benchmark's drops say which fix they need (the queue's order, or when samples move)."""
    async def go():
        b = _buffer(max_staleness=1, per_step=1)  # lead 1: 2 slots while version 0 is ready
        grants = [await b.acquire(worker_id=0, timeout=1) for _ in range(2)]
        for g in grants:
            assert await b.put(_group(g["epoch"], g["row"]["id"], version=0), worker_id=0)
        await b.get_batch(0, 1, timeout=1)  # takes one v0 group; the other waits, acceptable
        await b.set_trainer_version(2)  # floor 1: the waiting one goes
        stats = await b.stats()
        assert stats["dropped_groups"] == 1 and stats["dropped_waited_groups"] == 1
        late = await b.acquire(worker_id=0, timeout=1)
        assert await b.put(_group(late["epoch"], late["row"]["id"], version=0), worker_id=0)  # finished too late
        await b.set_trainer_version(2)
        stats = await b.stats()
        assert stats["dropped_groups"] == 2 and stats["dropped_waited_groups"] == 1

    asyncio.run(go())


def test_with_partial_rollouts_a_batch_is_taken_once_the_published_version_is_served():
    """rollout.partial: loading a version is what moves the samples at the staleness limit, so a batch taken before
    the replicas load it misses a group of the oldest acceptable version that finishes meanwhile, and that group is
    below the floor at the next batch. The buffer takes the batch once the version is served (bounded)."""
    async def go():
        from app.buffer import RolloutBuffer

        b = RolloutBuffer.__ray_actor_class__(1, 1, ROWS, seed=0, epochs=1, take_after_served_s=5.0)
        grants = [await b.acquire(worker_id=0, timeout=1) for _ in range(2)]
        assert await b.put(_group(grants[0]["epoch"], grants[0]["row"]["id"], version=0), worker_id=0)
        await b.set_trainer_version(1, ready=False)  # published in the background: not served yet
        batch = asyncio.ensure_future(b.get_batch(1, 1, timeout=5))
        await asyncio.sleep(0.2)
        assert not batch.done()  # waits for the load, though an acceptable group is queued
        # the group of the oldest acceptable version (0) that finished before the load
        assert await b.put(_group(grants[1]["epoch"], grants[1]["row"]["id"], version=0), worker_id=0)
        await b.mark_ready(1)
        out = await asyncio.wait_for(batch, 2)
        assert out["served_wait_seconds"] >= 0.2 and [g.version for g in out["groups"]] == [0]
        stats = await b.stats()
        assert stats["served_waits"] == 1 and stats["served_wait_timeouts"] == 0
        # a publish that never reports served costs the bound, not the run
        b.take_after_served_s = 0.3
        g = await b.acquire(worker_id=0, timeout=1)
        assert await b.put(_group(g["epoch"], g["row"]["id"], version=1), worker_id=0)
        await b.set_trainer_version(2, ready=False)
        out = await b.get_batch(2, 1, timeout=2)
        assert out is not None and out["served_wait_seconds"] >= 0.3
        assert (await b.stats())["served_wait_timeouts"] == 1

    asyncio.run(go())


def test_rewind_gives_back_the_lost_steps_slots():
    """A restored trainer needs batches again that its lost steps took: their slots come back with the prompts,
    or pacing (slots counted past ready_version + lead) grants nothing and the run deadlocks."""
    async def go():
        b = _buffer(max_staleness=1, per_step=1)  # lead 1: slots of batches 0 and 1 while version 0 is ready
        for v in range(2):  # two steps took their groups; no checkpoint holds them
            g = await b.acquire(worker_id=0, timeout=1)
            await b.put(_group(g["epoch"], g["row"]["id"], version=v), worker_id=0)
            await b.get_batch(v, 1, timeout=1)
        assert (await b.stats())["granted"] == 2
        assert await b.rewind(ConsumedPrompts().to_state()) == 2
        assert (await b.stats())["granted"] == 0
        again = [await b.acquire(worker_id=0, timeout=1) for _ in range(2)]  # no TimeoutError: granted again
        assert all(a is not None for a in again)

    asyncio.run(go())


def test_buffer_resumed_from_a_record_skips_it():
    async def go():
        b = _buffer(consumed=ConsumedPrompts({0: {"p0", "p1", "p2", "p3", "p4"}}).to_state(), max_staleness=5,
                    per_step=1)
        got = [await b.acquire(0) for _ in range(2)]
        assert {g["row"]["id"] for g in got} == {"p5", "p6"}
        assert await b.acquire(0) is None  # one epoch: the data ran out

    asyncio.run(go())


# ---------------------------------------------------------------- metrics rows and the driver's checks

def test_resume_rows_drop_later_and_torn_rows(tmp_path):
    from app.metrics import resume_rows

    p = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": s} for s in (1, 2, 3, 2, 3, 4, 5)]  # a restore replayed 2-3
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "x"')
    kept = resume_rows(p, 4)
    assert [r["step"] for r in kept] == [1, 2, 3, 4]
    assert [json.loads(line)["step"] for line in p.read_text().splitlines()] == [1, 2, 3, 4]


def _fake_checkpoint(d, step, world=1):
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": step, "version": step}))
    (d / "adapter").mkdir()
    (d / "ds").mkdir()
    for f in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "ds/mp_rank_00_model_states.pt",
              *[f"rng_rank{r}.pt" for r in range(world)]):
        (d / f).write_text("x")


def test_resume_refuses_with_one_line_and_exit_2(tmp_path, capsys):
    import yaml

    from app.__main__ import main
    from app.resume import find_checkpoint, prepare_resume
    from common.config import Config

    run = tmp_path / "r"
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume") and "not a run directory" in err and "\n" not in err
    run.mkdir()
    cfg = Config(train={"num_workers": 1, "total_steps": 6})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["train", "--resume", str(run)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    _fake_checkpoint(run / "r" / "checkpoint_000002", 2)
    _fake_checkpoint(run / "r-resume-1" / "checkpoint_000004", 4)
    (run / "r-resume-1" / "checkpoint_000005").mkdir()  # cut short by the kill: ignored
    (run / "r-resume-1" / "checkpoint_000005" / "train_state.json").write_text('{"step": 5}')
    ck, state = find_checkpoint(run, 1)
    assert ck.name == "checkpoint_000004" and state["step"] == 4
    cfg2, res = prepare_resume(run)
    assert res.step == 4 and cfg2.run_dir == run.resolve()
    with pytest.raises(Exception, match="finished"):
        prepare_resume(run, ["train.total_steps=4"])
    (run / "summary.json").write_text("{}")
    assert main(["train", "--resume", str(run)]) == 2
    assert "finished" in capsys.readouterr().err


def test_grants_wait_for_the_served_version():
    """With an overlapped publish the trainer's version runs ahead of what the replicas serve: slots for
    the next batch are granted only once that version is served (mark_ready), so no group is born
    one version staler than the pacing assumes."""
    async def go():
        b = _buffer(max_staleness=1, per_step=1)  # lead 1: batches 0 and 1 at version 0
        for _ in range(2):
            await b.acquire(worker_id=0)
        with pytest.raises(asyncio.TimeoutError):
            await b.acquire(timeout=0.2, worker_id=0)
        await b.set_trainer_version(1, ready=False)  # published in the background: not served yet
        with pytest.raises(asyncio.TimeoutError):
            await b.acquire(timeout=0.2, worker_id=0)
        await b.mark_ready(1)
        assert await b.acquire(timeout=1, worker_id=0)
        await b.mark_ready(2)  # may overtake the trainer's own call
        await b.set_trainer_version(2, ready=False)
        assert await b.acquire(timeout=1, worker_id=0)
        st = await b.stats()
        assert (st["trainer_version"], st["ready_version"]) == (2, 2)

    asyncio.run(go())


def test_closed_buffer_ends_a_waiting_trainer():
    """The driver closing the buffer (a failure elsewhere) answers the trainer's wait with None, which
    ends its loop; an error here would send Ray Train into restarts of a run that is already over."""
    async def go():
        b = _buffer(max_staleness=1, per_step=2)
        waiting = asyncio.ensure_future(b.get_batch(0, 2, timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await b.close()
        assert await asyncio.wait_for(waiting, 1) is None
        assert await b.acquire(worker_id=0) is None

    asyncio.run(go())
