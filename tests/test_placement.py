"""What the GPU recipes ask Ray for, and the refusals of runs that cannot be placed (pure arithmetic:
CI has no GPU, so this is how the one-GPU and two-GPU placements are checked there)."""
import pytest

from common import config as C
from common.placement import fit_problems, gpus_needed, replica_resources, total_request, trainer_resources


def test_one_gpu_recipe_shares_one_device():
    cfg = C.load("recipes/gpu-1x.yaml")
    assert trainer_resources(cfg) == {"CPU": 2, "GPU": 0.5}
    assert replica_resources(cfg) == {"CPU": 2, "GPU": 0.5}
    assert gpus_needed(cfg) == 1 and total_request(cfg)["GPU"] == 1.0
    assert cfg.torch_dtype == "bfloat16" and cfg.rollout.gpu_memory_utilization <= 0.5
    assert fit_problems(cfg, {"CPU": 16, "GPU": 1}) == []


def test_two_gpu_recipe_splits_sides():
    cfg = C.load("recipes/gpu-2x.yaml")
    assert trainer_resources(cfg)["GPU"] == 1 and replica_resources(cfg)["GPU"] == 1
    assert gpus_needed(cfg) == 2
    assert fit_problems(cfg, {"CPU": 32, "GPU": 2}) == []
    (msg,) = fit_problems(cfg, {"CPU": 32, "GPU": 1})
    assert "needs 2 GPU(s)" in msg and "has 1" in msg and "gpu-1x" in msg
    four = C.load("recipes/gpu-2x.yaml", ["train.num_workers=2", "rollout.replicas=2"])
    assert gpus_needed(four) == 4


@pytest.mark.parametrize("per_worker, per_replica, replicas, want", [
    (0.5, 0.5, 1, 1),   # the one-GPU recipe
    (0.6, 0.5, 1, 2),   # 1.1 GPUs do not fit on one device
    (0.4, 0.3, 2, 1),   # 0.4 + 0.3 + 0.3
    (1.0, 0.5, 2, 2),   # a whole GPU for training, two replicas share the other
    (0.5, 0.25, 4, 2),  # 0.5 + 0.25 + 0.25 | 0.25 + 0.25
])
def test_fractional_requests_pack_onto_devices(per_worker, per_replica, replicas, want):
    cfg = C.load("recipes/gpu-1x.yaml", [f"train.gpus_per_worker={per_worker}",
                                         f"rollout.gpus_per_replica={per_replica}", f"rollout.replicas={replicas}"])
    assert gpus_needed(cfg) == want


def test_cpu_recipe_needs_no_gpu_and_fits_two_cores():
    cfg = C.load("recipes/tiny-cpu.yaml")
    assert gpus_needed(cfg) == 0 and "GPU" not in trainer_resources(cfg)
    assert fit_problems(cfg, {"CPU": 2}) == []
    assert "reserves" in fit_problems(cfg, {"CPU": 1})[0]
