#!/usr/bin/env bash
# The GPU harness's own analysis checked without a GPU (hack/gpu/test_*.py: mix.py on made-up
# gem-schd logs, slices.py on a made-up GPU whose clock shift is known), with the first python3
# that has numpy, which slices.py needs. `make test` runs it.
set -euo pipefail
cd "$(dirname "$0")/../.."
for py in python3 /usr/bin/python3; do
  if "$py" -c 'import numpy' 2>/dev/null; then
    exec "$py" -m unittest hack/gpu/test_mix.py hack/gpu/test_slices.py
  fi
done
echo "harness-test: no python3 with numpy; install python3-numpy (make host-prereqs does)" >&2
exit 1
