#!/usr/bin/env bash
# Installs the `envs` extra (reasoning-gym) on the GPU machine from the wheelhouse that gpu_lease.sh unpacked
# (PIP_FIND_LINKS; built with `pip wheel reasoning-gym==0.1.25` plus `pip download pycosat --no-binary :all:`,
# packed by scripts/gpu_bundle/parts.py pack DIR .gpu/wheels --compression none), then runs CMD:
#   bash benchmarks/gpu_lease.sh run bash benchmarks/gpu_envs.sh python3 -m benchmarks.gpu_runs gemma-rgym-1x
# reasoning-gym imports pycosat (its zebra puzzles) at import time, and PyPI has pycosat only as an sdist: it is
# built here (gcc and the Python headers of the image). If that build fails, a stand-in module that raises on use
# takes its place, so that every task but the zebra puzzles still loads; the line below says which happened.
set -uo pipefail
# `python3 -m pip`, never `pip`: on the GPU image `pip` is the system Python's while `python3` is /opt/torch/.venv's
# (2026-12-06: `pip` put reasoning-gym where python3 does not look, and judged the venv's PyYAML 6.0.3 missing)
if ! python3 -c "import reasoning_gym" 2>/dev/null; then
  if python3 -m pip install -q reasoning-gym==0.1.25 2>/tmp/envs-pip.log; then
    echo "envs: reasoning-gym installed (pycosat built from its sdist)"
  else
    tail -3 /tmp/envs-pip.log
    # reasoning-gym alone, then what it requires but pycosat, read from its own metadata
    python3 -m pip install -q --no-deps reasoning-gym==0.1.25 || exit 1
    mapfile -t needs < <(python3 -c "import importlib.metadata as m
for r in m.requires('reasoning-gym') or []:
    name, _, marker = r.partition(';')
    if 'extra' not in marker and not name.strip().startswith('pycosat'):
        print(name.replace(' ', ''))")
    python3 -m pip install -q "${needs[@]}" || exit 1
    # into the image's site-packages: every later command on this machine (and its Ray workers) finds it
    purelib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    printf 'def _missing(*a, **k):\n    raise RuntimeError("pycosat could not be built on this machine")\nsolve = itersolve = _missing\n' \
      > "$purelib/pycosat.py"
    echo "envs: reasoning-gym installed; pycosat did not build, a stand-in raises on use (zebra puzzles only)"
  fi
fi
python3 -c "import reasoning_gym" || exit 1
exec "$@"
