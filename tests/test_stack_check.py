"""benchmarks/probes/stack_check.py's check of the collectives and CUDA libraries, on CPU: the one-rank all-reduce
runs over gloo (NCCL on a GPU; the GPU side runs on the device machines only) and the result names the backend and
no CUDA library, since torch for CPU maps none."""
from benchmarks.probes.stack_check import collectives_and_libraries


def test_the_all_reduce_runs_over_gloo_and_no_cuda_library_is_mapped():
    out = collectives_and_libraries(gpu=False)
    assert out == {"backend": "gloo", "cuda_libraries": []}
    # the process group is gone again: a second check in the same process starts its own
    assert collectives_and_libraries(gpu=False)["backend"] == "gloo"
