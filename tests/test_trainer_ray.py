"""The loop under a real Ray Train TorchTrainer (2 workers, gloo): checkpoints through ray.train.report,
publishes into a real AdapterRegistry, logs to RunMetrics; then a resumed run pulls from a real
RolloutBuffer (rank 0 pulls, broadcasts) and continues the version numbering."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import small_config, tiny_model  # noqa: E402


@pytest.fixture
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_torchtrainer_checkpoints_publishes_and_resumes_from_buffer(ray_session, tmp_path):
    ray = ray_session
    from safetensors.torch import load_file

    from app.buffer import BUFFER_NAME, RolloutBuffer
    from app.metrics import METRICS_NAME, RunMetrics
    from app.registry import NAMESPACE, REGISTRY_NAME, AdapterRegistry
    from common.adapter_io import tensors_digest
    from train_loops.batches import synthetic_batch
    from train_loops.trainer import build_trainer

    registry = AdapterRegistry.options(name=REGISTRY_NAME, namespace=NAMESPACE).remote(keep=3)
    metrics = RunMetrics.options(name=METRICS_NAME, namespace=NAMESPACE).remote(str(tmp_path / "run"))
    model = tiny_model(tmp_path / "tiny")
    cfg = small_config(model, train={"total_steps": 2}, checkpoint={"every": 1, "keep": 2}, run={"name": "a"})

    result = build_trainer(cfg, tmp_path / "run", batch_source="synthetic").fit()
    assert result.error is None
    ck = Path(result.checkpoint.path)
    state = json.loads((ck / "train_state.json").read_text())
    assert (state["step"], state["version"]) == (2, 2)
    assert {p.name for p in (ck / "ds").iterdir()} >= {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert ray.get(registry.latest_version.remote()) == 2
    got = ray.get(registry.get.remote(2))
    exported = load_file(str(ck / "adapter" / "adapter_model.safetensors"))
    assert got["meta"]["kind"] == "adapter" and got["meta"]["sha256"] == tensors_digest(exported)
    assert got["meta"]["peft_config"]["r"] == 4
    rows = ray.get(metrics.get_rows.remote())
    assert [r["step"] for r in rows] == [1, 2] and all(r["published"] == 1 for r in rows)

    # Resume into buffer mode: rank 0 pulls one step's groups, broadcasts; version continues at 3.
    g = cfg.grpo
    buf = RolloutBuffer.options(name=BUFFER_NAME, namespace=NAMESPACE).remote(max_staleness=2,
                                                                             groups_per_step=g.prompts_per_step)
    groups = synthetic_batch(7, 0, g.prompts_per_step, g.group_size, 99, g.max_new_tokens).groups
    for grp in groups:
        grp.version = 1
        ray.get(buf.put.remote(grp))
    cfg_b = small_config(model, train={"total_steps": 3}, checkpoint={"every": 0, "keep": 2}, run={"name": "b"})
    result_b = build_trainer(cfg_b, tmp_path / "run", resume_from=str(ck)).fit()
    assert result_b.error is None
    assert json.loads((Path(result_b.checkpoint.path) / "train_state.json").read_text())["consumed_groups"] == 2 * 4 + 4
    assert ray.get(registry.latest_version.remote()) == 3
    last = ray.get(metrics.get_rows.remote())[-1]
    assert last["step"] == 3 and last["version"] == 3
    assert last["staleness_mean"] == 1.0  # groups of version 1 taken at trainer version 2
    assert ray.get(buf.stats.remote())["taken_groups"] == g.prompts_per_step
    assert torch.is_tensor(next(iter(ray.get(got["ref"][0]).values())))
