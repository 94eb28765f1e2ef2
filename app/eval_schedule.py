"""When evaluation runs beside training: an Evaluator actor (app/evaluate.py) scores the version just
published every `eval.every` steps, the base model before step 1 and the final version after the last
step. The driver's watch loop kicks and collects it without waiting; while one eval runs, a due one is
skipped. Results go to RunMetrics.log_eval (the next step row carries them) and into the summary."""
from __future__ import annotations

import logging

from common.config import Config

logger = logging.getLogger("app")


class EvalSchedule:
    """The run's evaluations: `on_step` kicks a due one, `poll` collects a finished one, `finish` scores
    the final version, `summary` gives the summary.json keys. `actor` is the Evaluator (the run's to end)."""

    def __init__(self, cfg: Config, rows: list[dict], metrics):
        from app.evaluate import Evaluator
        from common.placement import on_driver_node

        self.every, self.metrics = cfg.eval.every, metrics
        self.actor = Evaluator.options(**on_driver_node()).remote(cfg.to_dict(), rows)
        self.pending = None  # (ref, step)
        self.results: list[dict] = []
        self.latest: dict | None = None
        self.last_step = -1
        self._failed = 0

    def kick(self, step: int, version: int | None) -> bool:
        if self.pending is not None:
            return False
        self.pending = (self.actor.run.remote(version, step), step)
        self.last_step = step
        return True

    def on_step(self, row: dict) -> None:
        if row["step"] % self.every == 0:
            self.kick(row["step"], row.get("version"))

    def poll(self, timeout: float = 0) -> None:
        import ray

        if self.pending is None:
            return
        ref, step = self.pending
        done, _ = ray.wait([ref], timeout=timeout)
        if not done:
            return
        self.pending = None
        try:
            res = ray.get(ref)
        except Exception as e:  # evaluation is advisory: a failed one is reported, training goes on
            self._failed += 1
            logger.warning("eval at step %d failed: %s", step, (str(e).strip().splitlines() or [""])[-1][:200])
            return
        self.results.append(res)
        self.latest = res
        ray.get(self.metrics.log_eval.remote(step, res))

    def finish(self, final_step: int, version: int | None, timeout: float = 300.0) -> None:
        """After the last step: wait for a running eval, then score the final version (unless done), and
        hand the results to the last step's row."""
        import ray

        self.poll(timeout)
        if self.last_step != final_step and self.kick(final_step, version):
            self.poll(timeout)
        if self.pending is not None:
            logger.warning("eval at step %d did not finish in %.0fs; left out", self.pending[1], timeout)
        ray.get(self.metrics.flush_eval.remote())

    def summary(self) -> dict:
        out: dict = {"eval_history": [{k: v for k, v in r.items() if k != "eval/seconds"} for r in self.results]}
        if self.results:
            first, last = self.results[0], self.results[-1]
            out.update({"eval_first": first["eval/accuracy"], "eval_first_step": first["eval/step"],
                        **{k: v for k, v in last.items() if k.startswith("eval/")}})
        return out
