#!/usr/bin/env bash
# The GPU checks in one go, each step under its own time limit, logs into one folder:
#
#     benchmarks/cuda_checks.sh LOG_DIR [WHEEL_DIR]
#
# 1. the Triton kernel tests compiled on the device (tests/kernels: the Triton ops, their serving
#    shapes, the quantized product, CUDA graphs, the engine on the Triton backend);
# 2. benchmarks/kernels_bench.py: attention, RMSNorm, rotary, KV store against the copy bandwidth,
#    and the dense SDPA (and FlashAttention, if installed) baselines;
# 3. benchmarks/cuda_engine.py: parity with transformers on the GPU, backend/graph/invariance/
#    preemption/prefix-cache checks, one-stream latency and offline throughput.
#
# 4. with HOST_CPU_TESTS_LIMIT > 0: the CPU tests that depend on the CPU's kind (its products,
#    attention, deterministic mode, step graphs) on the machine's host CPU, the GPU hidden: a
#    second kind of CPU besides the development machine's. Under a torch whose extensions crash
#    when a TORCH_CHECK throws (torch 2.11.0+cu130 with Ubuntu's g++ 13.3 did), the tests of
#    refused inputs crash their worker: read the log's failures with that in mind.
#
# Variables: KERNEL_TESTS (test paths, default the list below), CUDA_ENGINE_ARGS, and each step's
# limit in seconds (KERNEL_TESTS_LIMIT, KERNELS_BENCH_LIMIT: 0 skips it, CUDA_ENGINE_LIMIT,
# HOST_CPU_TESTS_LIMIT: 0, the default, skips it).
# WHEEL_DIR: wheels of packages the machine's Python lacks, installed into a scratch folder first.
set -u
out=${1:?usage: benchmarks/cuda_checks.sh LOG_DIR [WHEEL_DIR]}
wheels=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/splitfuse-site "$wheels"/*.whl > "$out/wheels.log" 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/splitfuse-site"
fi
step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a limit, output into NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$out/summary.log"
}
{ nvidia-smi; python3 -c 'import sys, torch, triton, transformers
print(sys.version); print("torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, torch.cuda.get_device_name())'; } > "$out/env.log" 2>&1
# the C++ CPU operators (the torch backend's checks use them), built beside the kernel tests
(python3 -m kernels.cpu_ops > "$out/cpu_ops.log" 2>&1 &)
default_tests="tests/kernels/test_triton_ops.py tests/kernels/test_triton_serving_shapes.py
    tests/kernels/test_triton_quant_linear.py tests/kernels/test_cuda_graphs.py
    tests/kernels/test_engine_triton_backend.py tests/kernels/test_moe_ops.py
    tests/kernels/test_deterministic_kernels.py"
options=()
python3 -c 'import xdist' 2> /dev/null && options+=(-n 8)
python3 -c 'import pytest_timeout' 2> /dev/null && options+=(--timeout 170)
step kernel_tests "${KERNEL_TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider \
    "${options[@]}" -r fEs ${KERNEL_TESTS:-$default_tests}
[ "${KERNELS_BENCH_LIMIT:-80}" -gt 0 ] &&
    step kernels_bench "${KERNELS_BENCH_LIMIT:-80}" python3 benchmarks/kernels_bench.py
step cuda_engine "${CUDA_ENGINE_LIMIT:-220}" python3 benchmarks/cuda_engine.py ${CUDA_ENGINE_ARGS:-}
host_tests="tests/kernels/test_blocked_linear.py tests/kernels/test_quant_linear.py
    tests/kernels/test_fixed_order_attention.py tests/kernels/test_deterministic_kernels.py
    tests/kernels/test_torch_ops.py tests/kernels/test_torch_plan.py tests/model/test_tiny_parity.py
    tests/model/test_batch_invariance.py tests/model/test_deterministic_model.py
    tests/model/test_quantized_model.py tests/model/test_step_graphs.py tests/model/test_moe_parity.py
    tests/unit/test_engine_layers.py tests/unit/test_engine_step.py"
host_options=()
python3 -c 'import xdist' 2> /dev/null && host_options+=(-n 14)
python3 -c 'import pytest_timeout' 2> /dev/null && host_options+=(--timeout 170)
# (the default model's tests need its GGUF file, which the machine does not have)
[ "${HOST_CPU_TESTS_LIMIT:-0}" -gt 0 ] &&
    CUDA_VISIBLE_DEVICES= step host_cpu_tests "$HOST_CPU_TESTS_LIMIT" python3 -m pytest -q \
        -p no:cacheprovider "${host_options[@]}" -r fEs $host_tests -k "not default_model"
