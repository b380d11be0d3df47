#!/usr/bin/env bash
# The checks that need a CUDA GPU: the `cuda`-marked tests, and the GPU figures the README quotes
# (`kvtier bench gpu`, `kvtier bench serve` on the trace, `kvtier bench daemon`).
#
#   bash tests/run_gpu.sh [--wheels DIR] [tests] [gpu] [serve] [daemon]
#
# Each named step runs, in that order (all four where none is named), under a time limit of its
# own, so one that runs long leaves the next its turn; the run goes on past a failed step and
# exits non-zero if any failed. It needs python3 with a CUDA build of torch. kvtier is installed
# from this checkout into a temporary directory, without the network; where its other
# dependencies are missing, DIR holds their wheels for that python (the README's set-up says
# how to fetch them). The figures are written as JSON to $OUT (a temporary directory where
# unset); the trace is $TRACE (the conversation trace beside this checkout where unset, the
# chat workload where there is none).
set -uo pipefail
cd "$(dirname "$0")/.."

out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
install=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site")
if [ "${1:-}" = --wheels ]; then
    "${install[@]}" "$2"/*.whl || exit 1
    shift 2
fi
steps=("$@")
((${#steps[@]})) || steps=(tests gpu serve daemon)
for name in "${steps[@]}"; do
    case $name in
    tests | gpu | serve | daemon) ;;
    *)
        echo "tests/run_gpu.sh: no step $name (tests, gpu, serve, daemon)" >&2
        exit 2
        ;;
    esac
done
"${install[@]}" --no-build-isolation . || exit 1
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

trace=${TRACE:-../shared/traces/mooncake_conversation_trace.jsonl}
if [ -f "$trace" ]; then
    source=(--trace "$trace")
else
    source=(--workload chat)
fi

failed=0
step() {
    local limit=$1 name=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local began=$SECONDS
    timeout "$limit" "$@"
    local code=$?
    echo "== $name: exit $code after $((SECONDS - began)) s"
    ((code == 0)) || failed=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! python3 -c 'import torch; print("torch", torch.__version__); assert torch.cuda.is_available()'
then
    echo "tests/run_gpu.sh: torch sees no CUDA GPU here" >&2
    exit 1
fi
for name in "${steps[@]}"; do
    case $name in
    tests)
        step 300 "cuda tests" python3 -m pytest -q -p no:cacheprovider -m cuda \
            tests/test_cuda_copy.py tests/test_cuda_tiers.py tests/test_cuda_kv_memory.py \
            tests/test_engine_bench_gpu.py \
            tests/test_engine.py
        ;;
    gpu)
        step 240 "bench gpu" bash -c 'python3 -m kvtier.service.cli bench gpu --json >"$0"' \
            "$out/bench_gpu.json"
        ;;
    serve)
        step 300 "bench serve" bash -c 'python3 -m kvtier.service.cli bench serve "$@" \
            --requests 40 --json >"$0"' "$out/bench_serve.json" "${source[@]}"
        ;;
    daemon)
        step 180 "bench daemon" bash -c 'python3 -m kvtier.service.cli bench daemon \
            --clients 8 --json >"$0"' "$out/bench_daemon.json"
        ;;
    esac
done
for figures in "$out"/*.json; do
    echo "== $figures"
    cat "$figures"
    echo
done
exit "$failed"
