"""Whether a run trained every prompt once, from its metrics rows: the check behind "no sample lost or doubled,
no prompt replayed or skipped" after faults (the reliability, node-loss and chaos benchmarks, and the tests of
node loss). Each step row lists the prompts it trained (`prompts`, "epoch:id"; common/data_cursor.py)."""
from __future__ import annotations

from collections import Counter


def data_accounting(rows: list[dict], n_prompts: int, per_step: int, group_size: int, total_steps: int,
                    pending: list[str] | None = None, id_prefix: str = "letters-") -> dict:
    """From metrics.jsonl and the buffer's prompts still pending at the end (handed out, not yet trained:
    requeued, in flight or queued; summary.json's buffer stats): step rows duplicated/missing, prompts
    trained twice in an epoch (replayed) or missing from an epoch a later one followed without being
    pending (skipped), groups/samples short or extra. The data's prompt ids are `id_prefix` + row index (the
    builtin tasks' ids)."""
    steps = Counter(r["step"] for r in rows)
    by_epoch: dict[int, list[str]] = {}
    groups = 0
    for r in rows:
        groups += len(r.get("prompts", []))
        for k in r.get("prompts", []) + r.get("prompts_filtered", []):
            e, pid = k.split(":", 1)
            by_epoch.setdefault(int(e), []).append(pid)
    replayed = sum(c - 1 for ids in by_epoch.values() for c in Counter(ids).values() if c > 1)
    last = max(by_epoch, default=0)
    pend = set(pending or [])
    all_ids = {f"{id_prefix}{i}" for i in range(n_prompts)}
    missing = [f"{e}:{pid}" for e, ids in by_epoch.items() if e < last for pid in sorted(all_ids - set(ids))]
    skipped = sum(1 for k in missing if k not in pend)
    want_groups = total_steps * per_step
    return {"steps_logged": len(steps), "step_rows_duplicated": sum(c - 1 for c in steps.values() if c > 1),
            "step_rows_missing": len(set(range(1, total_steps + 1)) - set(steps)),
            "groups_trained": groups, "groups_expected": want_groups,
            "samples_lost": max(0, want_groups - groups) * group_size,
            "samples_doubled": max(0, groups - want_groups) * group_size,
            "prompts_replayed": replayed, "prompts_skipped": skipped,
            "prompts_pending_at_end_in_earlier_epochs": len(missing) - skipped,
            "epochs_seen": sorted(by_epoch), "epoch_sizes": {str(e): len(v) for e, v in sorted(by_epoch.items())},
            "prompt_repeats_counter": max((r.get("prompt_repeats", 0) for r in rows), default=0)}
