#!/usr/bin/env bash
# Prepare the wheels benchmarks/gpu_check.py needs on a GPU machine whose image has torch and
# CUDA but no Ray and no network (Python 3.12, x86-64): run here, in the repository root,
# on a machine that can reach PyPI. They land in .whl/ (ignored by git), which the GPU run
# carries and installs with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#
# Ray's wheel is larger than what such a run may carry, so it is repacked without ray/jars/
# (the Java worker's jars, which a Python-only cluster never loads) and without RLlib, the
# dashboard's built front end and their RECORD rows. The rest of its dependencies
# (click, filelock, msgpack, packaging, protobuf, pyyaml, requests, aiohttp...) are in the
# image already; jsonschema and its own dependencies are not, and the test harness the
# shared-GPU check uses needs cloudpickle.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

LIMIT_MIB=64
WHEELS=(ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
        cloudpickle==3.1.1)

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

python3 - .whl/ray-*.whl <<'EOF'
"""Rewrite Ray's wheel in place without the folders a Python-only local cluster never uses."""
import os
import sys
import zipfile

DROP = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/build/")
path = sys.argv[1]
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith(DROP):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = data.decode().splitlines(keepends=True)
            data = "".join(r for r in rows if not r.startswith(DROP)).encode()
        dst.writestr(info, data)
os.replace(tmp, path)
EOF

# What a run sends: tracked and untracked-not-ignored files, plus the carried .whl/.
tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r du -cb 2>/dev/null | awk 'END {print $1}')
whl=$(du -cb .whl/*.whl | awk 'END {print $1}')
total=$((tree + whl))
ls -l .whl
echo "working tree $((tree / 1048576)) MiB + .whl $((whl / 1048576)) MiB = $((total / 1048576)) MiB (limit ${LIMIT_MIB} MiB)"
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "over the limit: drop more of Ray's wheel (see DROP above)" >&2
    exit 1
fi
