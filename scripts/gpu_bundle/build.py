"""Build an offline bundle of the project's GPU stack (`.[gpu]` and the base dependencies) for a target
machine that has a given Python and torch build but no package access. Run it where PyPI is reachable.

    python scripts/gpu_bundle/build.py --python 3.12 --torch 2.13.0+cu130 --out .gpu/bundle \\
        --target-has numpy [--target-freeze FREEZE] [--format site|wheels] [--compression gz|xz|none]

--torch is the torch the stack runs on. When the target's freeze names another torch, torch itself is
  bundled, with the CUDA libraries and triton it pins that the target lacks at those versions.
--format site (default): the packages installed into one site-packages folder, as a split tar.gz; the
  target needs no pip (`. unpack.sh` puts the folder on PYTHONPATH).
--format wheels: a wheelhouse (split tar) that `. unpack.sh` pip-installs with --no-index --no-deps.
Output: OUT/p0/part.0 ... OUT/pN/part.N, and beside the last part unpack.sh, parts.py (the verify/unpack
mechanics), manifest.json (sha256 of every part) and requirements.txt (what the bundle holds).
What is left out and why: deps.py. `--requirements LOCK` builds exactly a lock written by an earlier
build (its requirements.txt) instead of resolving again.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deps
import parts
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# Optional pieces of vLLM 0.25's CUDA stack that it imports only when asked for (FlashInfer attention and
# sampling, CUTLASS/TileLang/DeepGEMM-style kernels, video decoding): together several GiB, and vLLM runs
# without them (unpack.sh switches the sampler off FlashInfer).
DEFAULT_EXCLUDE = ("flashinfer-python,flashinfer-cubin,nvidia-cutlass-dsl,nvidia-cudnn-frontend,tilelang,"
                   "tokenspeed-mla,tokenspeed-triton,quack-kernels,humming-kernels,fastsafetensors,torchcodec,"
                   "pynvvideocodec")
# sdist-only packages, built into a wheel here; DS_BUILD_OPS=0: DeepSpeed compiles its ops on the target.
DEFAULT_FROM_SOURCE = "deepspeed"
# Packages built against one torch release: with a bundled torch, the target's copies do not count.
TORCH_BUILT = frozenset({"torch", "torchvision", "torchaudio", "triton", "liger-kernel"})
# Set on the target unless already set: the bundle is for machines without network access.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "RAY_USAGE_STATS_ENABLED": "0"}
# Java workers and dashboard source maps: never used by this project, 100+ MiB.
PRUNE = ("ray/jars",)
PRUNE_SUFFIXES = (".map",)


def names(text: str) -> set[str]:
    return {deps.normalize(n) for n in text.split(",") if n.strip()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (p0/part.0 ...)")
    parser.add_argument("--python", default="3.12", help="the target's Python, X.Y (default 3.12)")
    parser.add_argument("--torch", default="2.13.0+cu130",
                        help="the torch build the stack runs on (default 2.13.0+cu130); bundled when the "
                             "--target-freeze names another torch, else taken as the target's")
    parser.add_argument("--format", choices=("site", "wheels"), default="site")
    parser.add_argument("--part-size", default=parts.DEFAULT_PART_SIZE,
                        help=f"size of each part (default {parts.DEFAULT_PART_SIZE})")
    parser.add_argument("--compression", choices=parts.COMPRESSIONS, default="gz",
                        help="gz (default: ~1 min per GiB on 2 cores), xz (a little smaller, ~20x slower), none")
    parser.add_argument("--target-has", default="numpy",
                        help="comma-separated packages the target has at a version that does (torch too "
                             "unless the freeze says otherwise); left out with what only they need")
    parser.add_argument("--target-freeze", type=Path,
                        help="`pip list --format=freeze` of the target: what it has at a version that does "
                             "for the bundle is left out too")
    parser.add_argument("--exclude", default=DEFAULT_EXCLUDE,
                        help="comma-separated optional packages to leave out (default: vLLM's optional CUDA "
                             "kernels, see DEFAULT_EXCLUDE); '' bundles them")
    parser.add_argument("--extras", default="gpu", help="pyproject optional-dependency groups (default gpu)")
    parser.add_argument("--requirements", type=Path, help="build this lock (name==version lines) as is")
    parser.add_argument("--from-source", default=DEFAULT_FROM_SOURCE,
                        help="packages PyPI has only as sdists, built into wheels here (default deepspeed)")
    parser.add_argument("--glibc", default="2.34", help="the target's glibc (ldd --version; default 2.34)")
    parser.add_argument("--arch", default="x86_64", choices=("x86_64", "aarch64"))
    parser.add_argument("--build-python",
                        help="a Python X.Y with pip here, so markers are evaluated for the target "
                             "(default: pythonX.Y on PATH, else this interpreter)")
    parser.add_argument("--extra-index-url", action="append", default=[],
                        help="another package index (e.g. vLLM's for other CUDA builds); repeatable")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one, removed)")
    return parser.parse_args(argv)


def platform_args(python: str, glibc: str, arch: str) -> list[str]:
    """pip options that pick wheels for a Linux CPython target instead of for this machine."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2:
        raise SystemExit(f"--glibc {glibc}: expected 2.N")
    oldest = 17 if arch == "aarch64" else 5
    platforms = [f"manylinux_2_{m}_{arch}" for m in range(minor, oldest - 1, -1)]
    platforms += [f"{alias}_{arch}" for alias, m in (("manylinux2014", 17), ("manylinux2010", 12),
                                                     ("manylinux1", 5)) if oldest <= m <= minor]
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in [*platforms, "any"]:
        args += ["--platform", platform]
    return args


def find_build_python(python: str, explicit: str | None) -> str:
    candidates = [explicit] if explicit else [shutil.which(f"python{python}"), sys.executable]
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == python:
            return exe
        if explicit:
            raise SystemExit(f"--build-python {exe}: not a Python {python} with pip ({probe.stderr.strip()})")
    print(f"note: no Python {python} with pip found (--build-python); pip runs on {sys.executable}, whose "
          f"version decides `python_version` markers", file=sys.stderr)
    return sys.executable


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+ " + shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def build_from_source(reqs: list[Requirement], wheels: Path) -> None:
    for req in reqs:
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", req.name, "-w", str(wheels),
             str(req)], env={"DS_BUILD_OPS": "0"})


def resolve(roots: list[str], *, pip_python: str, platform: list[str], wheels: Path, work: Path,
            index_args: list[str]) -> dict:
    """pip's resolver on the target's platform, nothing installed: the JSON report of what it would install."""
    req_file, report = work / "roots.txt", work / "report.json"
    req_file.write_text("\n".join(roots) + "\n")
    # --target: older pips take platform options only with it; with --dry-run nothing is written there.
    run([pip_python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
         "--target", str(work / "resolve-target"), *platform, *index_args, "--find-links", str(wheels),
         "-r", str(req_file)])
    return json.loads(report.read_text())


def write_lock(path: Path, bundle: dict[str, str], header: list[str]) -> None:
    lines = [f"# {h}" for h in header] + [f"{name}=={version}" for name, version in sorted(bundle.items())]
    path.write_text("\n".join(lines) + "\n")


def stage_site(pip_python: str, platform: list[str], wheel_files: list[Path], site: Path) -> None:
    run([pip_python, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", *platform, "--target", str(site),
         *map(str, wheel_files)])
    for rel in PRUNE:
        shutil.rmtree(site / rel, ignore_errors=True)
    for path in list(site.rglob("*")):
        if path.is_dir() and path.name == "__pycache__":
            shutil.rmtree(path)
        elif path.is_file() and path.suffix in PRUNE_SUFFIXES:
            path.unlink()
    # Console scripts carry this machine's interpreter path; on the target `python3` is the one with torch.
    for script in (site / "bin").glob("*") if (site / "bin").is_dir() else []:
        text = script.read_bytes()
        if text.startswith(b"#!") and b"python" in text.split(b"\n", 1)[0]:
            script.write_bytes(b"#!/usr/bin/env python3\n" + text.split(b"\n", 1)[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    part_size = parts.parse_size(args.part_size)
    freeze = deps.read_pins(args.target_freeze) if args.target_freeze else {}
    torch_version = deps.public_version(args.torch)
    bundle_torch = "torch" in freeze and deps.public_version(freeze["torch"]) != torch_version
    target_has, exclude = names(args.target_has), names(args.exclude)
    if bundle_torch:
        # The target's torch, and the target's builds of packages compiled against it, cannot serve.
        target_has -= TORCH_BUILT
        freeze = {n: v for n, v in freeze.items() if n not in TORCH_BUILT}
    else:
        target_has |= {"torch"}
    roots = [*deps.project_requirements(REPO / "pyproject.toml", [e for e in args.extras.split(",") if e]),
             Requirement(f"torch=={torch_version}")]
    env = deps.target_environment(args.python, args.arch)
    pip_python = find_build_python(args.python, args.build_python)
    platform = platform_args(args.python, args.glibc, args.arch)
    index_args = [a for url in args.extra_index_url for a in ("--extra-index-url", url)]
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-bundle-"))
    wheels = work / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    try:
        from_source = names(args.from_source)
        warnings: list[str] = []
        if args.requirements:
            pins = {n: v for n, v in deps.read_pins(args.requirements).items() if n not in target_has}
            stale = deps.uncovered(pins, roots, target_has | set(freeze), env)
            if stale:
                raise SystemExit(f"{args.requirements} does not cover pyproject.toml:\n  " + "\n  ".join(stale))
            build_from_source([Requirement(f"{n}=={pins[n]}") for n in sorted(from_source & set(pins))], wheels)
            left_out: dict[str, str] = {}
        else:
            build_from_source([r for r in roots if deps.normalize(r.name) in from_source], wheels)
            report = resolve([str(r) for r in roots], pip_python=pip_python, platform=platform, wheels=wheels,
                             work=work, index_args=index_args)
            selection = deps.select(deps.packages_from_report(report), roots, target_has=target_has,
                                    exclude=exclude, freeze=freeze, env=env)
            pins, left_out, warnings = selection.bundle, selection.left_out, selection.warnings
        lock = work / "requirements.txt"
        write_lock(lock, pins, [f"GPU bundle for Python {args.python}, torch {args.torch}, {args.arch}, "
                                f"glibc >= {args.glibc}; built {time.strftime('%Y-%m-%d')} by",
                                "python scripts/gpu_bundle/build.py " + shlex.join(_content_args(argv)),
                                f"target has: {', '.join(sorted(target_has))}"
                                + (f" and {args.target_freeze.name}" if args.target_freeze else "")])
        run([pip_python, "-m", "pip", "download", "-q", "--no-deps", *platform, *index_args,
             "--find-links", str(wheels), "-d", str(wheels), "-r", str(lock)])
        wanted = {f"{n}=={Version(v)}" for n, v in pins.items()}
        wheel_files = [w for w in sorted(wheels.glob("*.whl")) if _wheel_pin(w) in wanted]
        missing = wanted - {_wheel_pin(w) for w in wheel_files}
        if missing:
            raise SystemExit(f"no wheel downloaded for: {', '.join(sorted(missing))}")
        stage = work / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        if args.format == "site":
            stage_site(pip_python, platform, wheel_files, stage)
        else:
            (stage / "wheels").mkdir(parents=True)
            for wheel in wheel_files:
                shutil.copy2(wheel, stage / "wheels" / wheel.name)
            shutil.copy2(lock, stage / "requirements.txt")
        print(f"packing {_du(stage) / 2**20:.0f} MiB from {stage}", file=sys.stderr)
        meta = {"format": args.format, "python": args.python, "torch": args.torch, "arch": args.arch,
                "glibc": args.glibc, "packages": sorted(wanted), "left_out": left_out, "warnings": warnings,
                "env": OFFLINE_ENV, "bundles_torch": bundle_torch, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        compression = args.compression if args.format == "site" else "none"
        manifest = parts.pack(stage, args.out, part_size, compression=compression, meta=meta)
        last = args.out / manifest["parts"][-1]["dir"]
        for name in ("unpack.sh", "parts.py"):
            shutil.copy2(HERE / name, last / name)
        shutil.copy2(lock, last / "requirements.txt")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    _report(args, manifest, warnings, time.time() - started)
    return 0


def _content_args(argv: list[str] | None) -> list[str]:
    """The command line less the options that change where the build runs, not what it builds."""
    args, kept = list(sys.argv[1:] if argv is None else argv), []
    while args:
        arg = args.pop(0)
        option = arg.split("=", 1)[0]
        if option in ("--out", "--work", "--build-python"):
            if "=" not in arg and args:
                args.pop(0)
            continue
        kept.append(arg)
    return kept


def _wheel_pin(wheel: Path) -> str:
    name, version, _, _ = parse_wheel_filename(wheel.name)
    return f"{canonicalize_name(name)}=={version}"


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _report(args: argparse.Namespace, manifest: dict, warnings: list[str], seconds: float) -> None:
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    left_out = f", {len(manifest['left_out'])} left out (manifest.json says why)" if manifest["left_out"] else ""
    print(f"{len(manifest['packages'])} packages{left_out}, {seconds / 60:.1f} min")
    for part in manifest["parts"]:
        folder = args.out / part["dir"]
        print(f"  {folder}: {part['name']} {part['bytes'] / 2**20:.1f} MiB, folder {_du(folder) / 2**20:.1f} MiB")
    print(f"total {manifest['archive_bytes'] / 2**20:.1f} MiB. On the target, with the p* folders under PARTS_DIR:")
    print(f"  . PARTS_DIR/{manifest['parts'][-1]['dir']}/unpack.sh PARTS_DIR [DEST=/tmp/site]")


if __name__ == "__main__":
    sys.exit(main())
