# Source on the GPU machine:  . unpack.sh [PARTS_DIR] [DEST]
# Verifies every part against manifest.json (size, sha256), unpacks into DEST (default /tmp/site; skipped
# when DEST already holds this bundle), and sets the environment the stack needs there: PYTHONPATH and
# PATH for a site-packages bundle (a wheelhouse bundle is pip-installed instead), offline switches, and
# VLLM_USE_FLASHINFER_SAMPLER=0 when FlashInfer is absent. PARTS_DIR defaults to the folder above this
# script's (the build writes p0/part.0 ... pN/part.N with this script in pN). GPU_BUNDLE_PYTHON picks the
# Python (default python3: the one that has torch).
_gpu_bundle_here=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
_gpu_bundle_env=$("${GPU_BUNDLE_PYTHON:-python3}" "$_gpu_bundle_here/parts.py" unpack \
  "${1:-$(dirname "$_gpu_bundle_here")}" "${2:-/tmp/site}" --manifest "$_gpu_bundle_here/manifest.json")
_gpu_bundle_rc=$?
if [ "$_gpu_bundle_rc" -eq 0 ]; then
  eval "$_gpu_bundle_env"
  echo "gpu bundle: ready in ${2:-/tmp/site}" >&2
fi
unset _gpu_bundle_here _gpu_bundle_env
# shellcheck disable=SC2317  # `return` when sourced, `exit` when run
return "$_gpu_bundle_rc" 2>/dev/null || exit "$_gpu_bundle_rc"
