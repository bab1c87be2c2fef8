#!/usr/bin/env bash
# Fetch vLLM's KV-event schema for tests/events/test_vllm_schema.py: download the vLLM wheel (no
# dependencies, ~340 MB, seconds from the package index), extract only
# vllm/distributed/kv_events.py, delete the wheel. The file is never committed.
#   VLLM_VERSION        which vLLM (default 0.33.0, the first release with tagged-map events)
#   VLLM_KV_EVENTS_DIR  where to put it (default tests/.vllm, git-ignored); the test reads
#                       $VLLM_KV_EVENTS_DIR/vllm/distributed/kv_events.py
# Uses the active environment's python and pip.
set -euo pipefail
cd "$(dirname "$0")/.."

version="${VLLM_VERSION:-0.33.0}"
dest="${VLLM_KV_EVENTS_DIR:-tests/.vllm}"
member="vllm/distributed/kv_events.py"

if [ -f "$dest/$member" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
    echo "vLLM $version $member already in $dest"
    exit 0
fi

wheel_dir="$(mktemp -d)"
trap 'rm -rf "$wheel_dir"' EXIT
start=$(date +%s)
python -m pip download --quiet --no-deps --only-binary=:all: -d "$wheel_dir" "vllm==$version"
wheel="$(ls "$wheel_dir"/vllm-*.whl)"
mkdir -p "$dest"
python - "$wheel" "$dest" "$member" <<'PY'
import sys
import zipfile

wheel, dest, member = sys.argv[1:]
with zipfile.ZipFile(wheel) as archive:
    archive.extract(member, dest)
PY
echo "$version" > "$dest/VERSION"
echo "vLLM $version: extracted $member to $dest from $(basename "$wheel")" \
     "($(du -m "$wheel" | cut -f1) MB, $(( $(date +%s) - start )) s)"
