"""benchmarks/probes/cuda_libs.py runs only where there is a GPU (it checks the CUDA libraries torch loads); here,
without one, it must say so and exit 2 without writing a record, and a wrong argument list prints its usage."""
from benchmarks.probes import cuda_libs


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "cuda_libs.json"
    assert cuda_libs.main([str(out)]) == 2
    assert "no GPU here" in capsys.readouterr().err
    assert not out.exists()


def test_a_wrong_argument_list_prints_the_usage(capsys):
    assert cuda_libs.main([]) == 2
    assert "python -m benchmarks.probes.cuda_libs OUT.json" in capsys.readouterr().err
