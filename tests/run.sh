#!/usr/bin/env bash
# Installs kvtier with its test tools and runs every test: the main suite on CPU torch, then the
# vLLM connector's tests in their own environment (vLLM brings its own CUDA build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."

pip install torch==2.13.0 -e '.[test]'
ruff check .
ruff format --check .
python -m pytest -q

venv=.venv-vllm
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/pip" install -q uv
overrides=$(mktemp)
# vLLM 0.33.0 asks for certifi>=2026.10.19, newer than some package indexes carry.
echo 'certifi==2026.10.18' >"$overrides"
"$venv/bin/uv" pip install -q --python "$venv/bin/python" --override "$overrides" \
    vllm==0.33.0 -e '.[test]'
rm -f "$overrides"
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m pytest -q -m vllm tests/test_vllm_connector.py tests/test_vllm_scheduler.py
