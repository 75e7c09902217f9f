#!/usr/bin/env bash
# Downloads into .whl/ the wheels that benchmarks/gpu_check.py needs on the GPU machine and that
# its image lacks (Python 3.12, x86-64), at the versions installed in .venv, so that the GPU runs
# what the suite tested. .whl/ is git-ignored; a device call carries it (carry: [".whl"]) and
# installs it with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(gguf pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn)
rm -rf .whl
mkdir -p .whl
for name in "${PACKAGES[@]}"; do
    version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in .venv (run scripts/setup.sh)" >&2; exit 1; }
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name==$version"
done
ls -l .whl
