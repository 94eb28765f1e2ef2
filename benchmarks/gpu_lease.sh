#!/usr/bin/env bash
# One device-tool call of a GPU lease (the GPU machine has torch but not Ray, vLLM or DeepSpeed; the bundle
# from scripts/gpu_bundle/build.py arrives as parts of <= 50 MiB, one per call, since a call carries 64 MiB):
#   bash benchmarks/gpu_lease.sh part K            carry .gpu/bundle/pK: copy part K to /tmp/parts
#   bash benchmarks/gpu_lease.sh run CMD ...       carry the last part: unpack (once per machine), run CMD
# `run` puts the repository on PYTHONPATH, keeps vLLM's compile cache in /tmp (which outlives a call while
# the machine stays warm), stops CMD at 560 s (a call may take 600), writes its output to $OUT/run.log and
# copies what the call wrote in /tmp/gpout (the benchmarks' --out, kept across the lease's calls) to $OUT.
set -uo pipefail
mkdir -p /tmp/parts /tmp/gpout
for d in .gpu/bundle/p*; do [ -d "$d" ] && cp "$d"/* /tmp/parts/; done
case "${1:-}" in
  part) ls -la /tmp/parts | tail -n +2 ;;
  run)
    shift
    # shellcheck disable=SC1091
    . /tmp/parts/unpack.sh /tmp/parts /tmp/site >/dev/null || exit 1
    export PYTHONPATH="$PWD:${PYTHONPATH:-}" VLLM_CACHE_ROOT=/tmp/vllm-cache TOKENIZERS_PARALLELISM=false
    touch /tmp/gpstamp
    timeout 560 "$@" > "$OUT/run.log" 2>&1
    rc=$?
    # Only what this call wrote: a call brings back at most 8 files, and /tmp/gpout keeps the whole lease's.
    find /tmp/gpout -maxdepth 1 -type f -newer /tmp/gpstamp -exec cp {} "$OUT/" \;
    tail -c 2500 "$OUT/run.log"
    echo "rc=$rc"
    exit $rc ;;
  *) echo "usage: $0 part K | run CMD ..." >&2; exit 2 ;;
esac
