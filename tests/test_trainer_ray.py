"""The loop under a real Ray Train TorchTrainer (2 workers, gloo): checkpoints through ray.train.report,
publishes into a real AdapterRegistry, logs to RunMetrics, survives a killed worker by restoring the
last checkpoint; then a resumed run in merge mode pulls from a real RolloutBuffer (rank 0 pulls,
broadcasts) and continues the version numbering. The worker failure comes from a test-only subclass
of the loop's worker (tests/_train_helpers.FailOnceWorker), never from the production loop."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import fail_once_loop, small_config, tiny_model  # noqa: E402


@pytest.fixture
def ray_session():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_torchtrainer_checkpoints_publishes_restores_and_resumes_from_buffer(ray_session, tmp_path):
    ray = ray_session
    from safetensors.torch import load_file

    from app.buffer import BUFFER_NAME, RolloutBuffer
    from app.metrics import METRICS_NAME, RunMetrics
    from common.adapter_io import tensors_digest, unpack_tensors
    from common.registry import NAMESPACE, REGISTRY_NAME, AdapterRegistry
    from common.types import Group
    from train_loops import trainer
    from train_loops.harness import HarnessOptions, synthetic_batch

    registry = AdapterRegistry.options(name=REGISTRY_NAME, namespace=NAMESPACE).remote(keep=3)
    metrics = RunMetrics.options(name=METRICS_NAME, namespace=NAMESPACE).remote(str(tmp_path / "run"))
    model = tiny_model()
    cfg = small_config(model, train={"total_steps": 3}, checkpoint={"every": 1, "keep": 2}, run={"name": "a"})

    # rank 1 dies at the start of step 3, once Ray Train has registered checkpoint_000002: both workers
    # restart from it and step 3 runs again (its version too: the failed attempt published nothing)
    marker = tmp_path / "failed-once"
    result = trainer.build_trainer(cfg, tmp_path / "run", options=HarnessOptions(runner="ray"),
                                   loop=fail_once_loop(3, 1, marker)).fit()
    assert result.error is None and marker.exists()
    ck = Path(result.checkpoint.path)
    state = json.loads((ck / "train_state.json").read_text())
    v = state["version"]
    assert state["step"] == 3 and v == 3
    assert state["consumed_groups"] == 3 * 4
    assert {p.name for p in (ck / "ds").iterdir()} >= {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert ray.get(registry.latest_version.remote()) == v
    got = ray.get(registry.get.remote(v))
    exported = load_file(str(ck / "adapter" / "adapter_model.safetensors"))
    assert got["meta"]["kind"] == "adapter" and got["meta"]["sha256"] == tensors_digest(exported)
    assert got["meta"]["peft_config"]["r"] == 4
    rows = ray.get(metrics.get_rows.remote())
    assert all(r["published"] == 1 for r in rows)
    # every step once (a step redone after the restore replaces its row), versions strictly increasing
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["version"] for r in rows] == [1, 2, 3]

    # Resume in buffer + merge mode: rank 0 pulls one step's groups, broadcasts; version continues at v + 1.
    grpo = cfg.grpo
    data = [{"id": f"q{i}", "prompt": f"q{i}?", "answer": "A"} for i in range(grpo.prompts_per_step)]
    buf = RolloutBuffer.options(name=BUFFER_NAME, namespace=NAMESPACE).remote(2, grpo.prompts_per_step, data)
    synthetic = synthetic_batch(7, 0, grpo.prompts_per_step, grpo.group_size, 99, grpo.max_new_tokens).groups
    for made in synthetic:  # a rollout worker's way: a slot (and its prompt) first, then the scored group
        grant = ray.get(buf.acquire.remote(0))
        group = Group(samples=made.samples, version=v - 1, prompt_id=grant["row"]["id"], epoch=grant["epoch"])
        assert ray.get(buf.put.remote(group, 0))
    cfg_b = small_config(model, train={"total_steps": 4}, checkpoint={"every": 0, "keep": 2}, run={"name": "b"},
                         sync={"mode": "merge"})
    result_b = trainer.build_trainer(cfg_b, tmp_path / "run", resume_from=str(ck)).fit()
    assert result_b.error is None
    assert json.loads((Path(result_b.checkpoint.path) / "train_state.json").read_text())["consumed_groups"] == 4 * 4
    assert ray.get(registry.latest_version.remote()) == v + 1
    last = ray.get(metrics.get_rows.remote())[-1]
    assert last["step"] == 4 and last["version"] == v + 1
    assert last["staleness_mean"] == 1.0  # groups of version v - 1 taken at trainer version v
    assert ray.get(buf.stats.remote())["taken_groups"] == grpo.prompts_per_step
    merged = ray.get(registry.get.remote(v + 1))
    assert merged["meta"]["kind"] == "merged"
    weights = unpack_tensors(ray.get(merged["ref"][0]))  # the trainer publishes one safetensors buffer
    base = load_file(str(model / "model.safetensors"))
    assert weights.keys() == base.keys()
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(weights["model.norm.weight"], base["model.norm.weight"])


def _env_loop(out_dir: str):
    def loop(config: dict) -> None:
        import os

        import ray.train

        rank = ray.train.get_context().get_world_rank()
        keys = ("CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "TOKENIZERS_PARALLELISM")
        Path(out_dir, f"{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    return loop


def test_train_workers_get_the_mps_settings_and_keep_the_jobs_env(ray_session, tmp_path, monkeypatch):
    """train.mps_priority / mps_sm_percent reach every train worker's environment (they must be set before the
    worker's CUDA context exists, so the loop itself cannot set them), merged with the job's own variables;
    at their defaults nothing is added."""
    from train_loops import trainer

    ray_session.shutdown()  # this test's Ray carries a job-level variable, as common.ray_utils' does
    ray_session.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    model = tiny_model()
    cfg = small_config(model, train={"total_steps": 1, "mps_priority": "below_normal", "mps_sm_percent": 60})
    assert trainer.worker_env(small_config(model)) == {}
    monkeypatch.setattr(trainer, "train_loop_per_worker", _env_loop(str(tmp_path)))
    result = trainer.build_trainer(cfg, tmp_path / "run").fit()
    assert result.error is None
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(cfg.train.num_workers)]
    assert seen == [{"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60",
                     "TOKENIZERS_PARALLELISM": "false"}] * cfg.train.num_workers
