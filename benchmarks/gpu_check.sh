#!/usr/bin/env bash
# The one script to run on a GPU machine, from a checkout of this repository:
#
#     benchmarks/gpu_check.sh [RESULTS_DIR]
#
# 1. the machine: nvidia-smi, python, torch, CUDA, transformers, torchao  -> env.txt
# 2. benchmarks/gpu_train.py on the Llama-3.2-1B shape at seq 4096, batch 4: shardline
#    bf16 compiled, HF compiled, shardline fp8, HF eager, flex and varlen on packed
#    documents, in one run                                                 -> gpu_train.json, .txt
#    (first: the issue's targets are its numbers, and a run cut short should still have them)
# 3. the GPU tests, `pytest -m gpu` (tests/gpu: CUDA bf16 run and resume, chunked
#    loss, compile, FSDP2 CPU offload over NCCL (also one GPU through the trainer),
#    attention kernels against the dense mask, fp8, allocator and profiler)
#                                                                           -> gpu-tests.txt, .xml
#
# It first checks that this python imports torch and sees a CUDA device, and otherwise says so in
# one line and exits 2 (ALLOW_CPU=1 GPU_TRAIN_ARGS=--tiny runs on without one, as the suite's CPU dry run does).
# RESULTS_DIR defaults to $OUT when set (the device tool's folder), else results/gpu-<time>.
# It needs nothing from a registry: it runs with the machine's python3 and its torch (>= 2.11),
# or with the interpreter PYTHON names (PYTHON=/path/to/venv/bin/python), puts src/ on PYTHONPATH,
# and installs torchao and pytest from benchmarks/wheels/ (see benchmarks/README.md) when the
# machine lacks them. Budgets in seconds (env):
# BENCH_BUDGET (default 300) and TEST_BUDGET (default 230), each ended by SIGINT and 10 s later
# SIGKILL; the tests also stop by DEADLINE (default 560 s after the script started), so with the
# machine probe (~10 s) and an install (at most 30 s) the whole script ends within about 9.5
# minutes, under the device tool's 10 a command (give it timeout_s 590). A step cut by its
# budget keeps what it finished. ONLY=tests or ONLY=bench skips the other of steps 2 and 3 (a
# rerun of the step a budget cut; for gpu_train, GPU_TRAIN_ARGS="--variants hf-eager" runs only
# the variants named, the last --variants winning).
# Extra arguments for gpu_train.py go in GPU_TRAIN_ARGS (e.g. "--set train.loss_chunk_tokens=8192").
# CALIBRATE=1 adds step 4: `shardline calibrate --quick --no-comm` (the planner's profile of this
# GPU: GEMM and attention efficiency curves) -> calibration.toml, within CAL_BUDGET (default 150).
# SPLIT_BACKWARD=1 adds step 5: benchmarks/split_backward.py on one block of the 1B shape in bf16
# (train.compile under zbv/dualpipev against eager and a whole compiled block) -> split_backward.json,
# within SPLIT_BUDGET (default 240). It needs torch >= 2.13 (it says so and fails on older ones).
# PLANNER_SHAPES=1 adds step 6: gpu_train.py at a second shape (seq 8192 x batch 2, op-level AC;
# shardline-compile and shardline-fp8) -> gpu_train-s8192.json, within PLAN_BUDGET (default 150):
# every gpu_train row carries the planner's prediction (plan s, plan GiB), and this shape was not
# the one its compiled pricing was checked against, so its rows test it.
# COMM_BENCH=1 adds step 7, on a machine with 2 or more GPUs: `torchrun -m shardline comm-bench` over
# all of them (all-reduce, all-gather, reduce-scatter, all-to-all at 8 KiB-256 MiB: busbw, results
# checked, the planner's intra-node link fitted) -> comm.toml, comm-bench.txt, within COMM_BUDGET
# (default 120); on one GPU it says it cannot run (NCCL refuses two ranks on one GPU).
# The optional steps are cut to what DEADLINE leaves. ONLY=extras skips steps 2 and 3 and runs just
# the optional steps asked for: a call of its own, since the two calls below leave little of the
# 15 device minutes (PLANNER_SHAPES=1 ONLY=extras DEADLINE=200, timeout_s 230; or in place of the
# tests' call in a session that does not need them).
#
# Through the device tool (15 minutes of device time in all: the machine's start, 1-2 minutes,
# and the idle time between calls count; 10 minutes a command), carry benchmarks/wheels
# (git-ignored: torchao for fp8) and spend it as two calls on the warm machine, so that the
# benchmark's figures are back before the tests start and both fit with a start:
#     ONLY=bench BENCH_BUDGET=240 benchmarks/gpu_check.sh             (timeout_s 300: probes and installs first)
#     ONLY=tests TEST_BUDGET=280 DEADLINE=320 benchmarks/gpu_check.sh  (timeout_s 340)
# A budget ends its step by SIGINT only while this script runs in the foreground of a shell that
# passes SIGINT on (the device tool's does); a timeout_s shorter than DEADLINE kills it outright.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:-results/gpu-$(date -u +%Y%m%d-%H%M%S)}}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
# Deprecations only are silenced: SDPA's "kernel not used because ..." and dynamo's recompile
# warnings are what a first run on a machine needs to read.
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    PYTHONWARNINGS=ignore::DeprecationWarning,ignore::FutureWarning NCCL_DEBUG=${NCCL_DEBUG:-WARN}
"$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))" \
    || { echo "gpu_check: $PY is Python < 3.11; shardline needs 3.11+ (tomllib): set PYTHON=" >&2; exit 2; }
# No torch or no CUDA device: one line, not the tracebacks of every step below.
if [ "${ALLOW_CPU:-0}" != 1 ]; then
    cuda=$("$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available())" 2>/dev/null | tail -n 1)
    [ -n "$cuda" ] || cuda="not importable False"
    if [ "${cuda##* }" != True ]; then
        echo "gpu_check.sh: no CUDA device visible to $PY (torch ${cuda% *}): this script is for a GPU machine;" \
            "on CPU run benchmarks/gpu_train.py --tiny" >&2
        exit 2
    fi
fi
status=0
ONLY=${ONLY:-}
case "$ONLY" in ""|tests|bench|extras) ;; *) echo "gpu_check: ONLY=$ONLY is invalid: tests, bench, extras or unset" >&2; exit 2 ;; esac
if [ "$ONLY" = extras ] && [ "${CALIBRATE:-0}${SPLIT_BACKWARD:-0}${PLANNER_SHAPES:-0}${COMM_BENCH:-0}" = 0000 ]; then
    echo "gpu_check: ONLY=extras runs only the optional steps: set CALIBRATE=1, SPLIT_BACKWARD=1, PLANNER_SHAPES=1" \
        "or COMM_BENCH=1" >&2
    exit 2
fi

# What the machine lacks comes from benchmarks/wheels/, offline and without dependencies, into
# a folder on PYTHONPATH: only the packages that fail to import (PYTHONPATH precedes
# site-packages, so nothing the machine has is shadowed): torchao for fp8, pytest and its
# own dependencies for step 3.
SITE=/tmp/shardline-site
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"  # installed by an earlier call on this machine
missing=()
for pkg in torchao pytest pluggy iniconfig pygments packaging exceptiongroup tomli; do
    case "$pkg" in exceptiongroup|tomli) "$PY" -c "import sys; sys.exit(sys.version_info >= (3, 11))" || continue ;; esac
    "$PY" -c "import $pkg" 2>/dev/null && continue
    wheel=$(ls benchmarks/wheels/"$pkg"-*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ]; then missing+=("$wheel"); else echo "gpu_check: $pkg is missing and benchmarks/wheels/ has no wheel for it" >&2; fi
done
if [ ${#missing[@]} -gt 0 ]; then
    timeout 30 "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${missing[@]}" \
        && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
"$PY" -c "import torchao" 2>/dev/null \
    || echo "gpu_check: WARNING: no torchao (carry benchmarks/wheels): shardline-fp8 and the fp8 tests will fail" >&2
# shardline's own requirements (pyproject.toml): a machine with torch alone lacks them, and every
# shardline step then failed in an ImportError (an image with transformers brings most of them).
# Said, not installed: they have dependencies of their own and platform wheels (tensorboard's
# writer needs protobuf), which a --no-deps install from carried wheels would leave half there.
for pkg in tokenizers safetensors numpy rich tensorboard pyarrow jinja2; do
    probe="import $pkg"
    [ "$pkg" = tensorboard ] && probe="from torch.utils.tensorboard import SummaryWriter"  # (protobuf's too)
    "$PY" -c "$probe" 2>/dev/null \
        || echo "gpu_check: WARNING: $pkg is missing: shardline needs it (pip install it, with its dependencies," \
                "where the machine can), and the shardline steps will fail" >&2
done

{
    date -u
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    git status --short 2>/dev/null | head -n 20  # uncommitted changes the run measured, if any
    if command -v nvidia-smi >/dev/null; then nvidia-smi || true; else echo "nvidia-smi: not on this machine"; fi
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("transformers", "torchao", "triton", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # report, don't stop: the later steps say what a missing one costs
        print(name, "missing:", type(e).__name__, e)
EOF
} 2>&1 | tee "$RESULTS/env.txt"

if [ "$ONLY" != tests ] && [ "$ONLY" != extras ]; then
echo "== gpu_train ==" >&2
# shellcheck disable=SC2086  # GPU_TRAIN_ARGS is a list of words on purpose
# The targets' variants first (hf-eager is context; the -docs ones a question: do flex and
# varlen agree on packed documents, first loss and speed?); gpu_train.json is rewritten after
# each, and at the budget SIGINT ends the run with the finished ones reported.
timeout -s INT -k 10 "${BENCH_BUDGET:-300}" "$PY" benchmarks/gpu_train.py \
    --variants shardline-compile,hf-compile,shardline-fp8,hf-eager,shardline-flex-docs,shardline-varlen-docs \
    ${GPU_TRAIN_ARGS:-} \
    --json "$RESULTS/gpu_train.json" 2>&1 | tee "$RESULTS/gpu_train.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "$ONLY" != bench ] && [ "$ONLY" != extras ]; then
echo "== gpu tests ==" >&2
# The core files first, attention's compile-heavy ones last, so a budget that runs out cuts the least.
# At the budget SIGINT (then SIGKILL 10 s later): pytest still writes its summary and the XML; -v
# prints each verdict as it comes.
files=(tests/gpu/test_ring_gpu.py tests/gpu/test_train_gpu.py tests/gpu/test_memory_gpu.py tests/gpu/test_float8_gpu.py
       tests/gpu/test_attention_gpu.py)
for f in tests/gpu/test_*.py; do [[ " ${files[*]} " == *" $f "* ]] || files+=("$f"); done  # any new file, last
budget=$(( ${DEADLINE:-560} - SECONDS - 10 ))  # what the benchmark left of the deadline
[ "$budget" -lt "${TEST_BUDGET:-230}" ] || budget=${TEST_BUDGET:-230}
if [ "$budget" -lt 30 ]; then
    echo "gpu_check: no time left for the GPU tests before DEADLINE; rerun with ONLY=tests" | tee "$RESULTS/gpu-tests.txt" >&2
    status=1
else
# A test stuck in a C call (an NCCL start) would hold the whole budget: pytest-timeout, where
# the machine has it, ends it after 200 s with every thread's stack.
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=200)
timeout -s INT -k 10 "$budget" "$PY" -m pytest -v -m gpu -p no:cacheprovider --no-header -rfE \
    ${per_test[@]+"${per_test[@]}"} --durations=0 --junitxml="$RESULTS/gpu-tests.xml" "${files[@]}" 2>&1 | tee "$RESULTS/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
fi

left() {  # an optional step's budget: its own, cut to what DEADLINE leaves
    local left=$(( ${DEADLINE:-560} - SECONDS - 10 ))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
if [ "${CALIBRATE:-0}" = 1 ] && [ "$(left "${CAL_BUDGET:-150}")" -ge 30 ]; then  # optional: the planner's GPU profile
    echo "== calibrate ==" >&2
    timeout "$(left "${CAL_BUDGET:-150}")" "$PY" -m shardline calibrate --quick --no-comm --out "$RESULTS/calibration.toml" \
        2>&1 | tee "$RESULTS/calibrate.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${SPLIT_BACKWARD:-0}" = 1 ] && [ "$(left "${SPLIT_BUDGET:-240}")" -ge 30 ]; then  # optional: split backward
    echo "== split_backward ==" >&2
    timeout "$(left "${SPLIT_BUDGET:-240}")" "$PY" benchmarks/split_backward.py --dim 2048 --heads 32 --kv-heads 8 \
        --ffn 8192 --seq 4096 --batch 2 --json "$RESULTS/split_backward.json" 2>&1 | tee "$RESULTS/split_backward.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${PLANNER_SHAPES:-0}" = 1 ] && [ "$(left "${PLAN_BUDGET:-150}")" -ge 60 ]; then  # optional: the planner, anew
    echo "== gpu_train, a second shape ==" >&2
    timeout -s INT -k 10 "$(left "${PLAN_BUDGET:-150}")" "$PY" benchmarks/gpu_train.py --seq-len 8192 --batch 2 \
        --set memory.activation_checkpoint=op --variants shardline-compile,shardline-fp8 \
        --json "$RESULTS/gpu_train-s8192.json" 2>&1 | tee "$RESULTS/gpu_train-s8192.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${COMM_BENCH:-0}" = 1 ] && [ "$(left "${COMM_BUDGET:-120}")" -ge 30 ]; then  # optional: the GPUs' links
    echo "== comm-bench ==" >&2
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if [ "$gpus" -ge 2 ]; then
        timeout -s INT -k 10 "$(left "${COMM_BUDGET:-120}")" "$PY" -m torch.distributed.run --nproc_per_node="$gpus" \
            -m shardline comm-bench --out "$RESULTS/comm.toml" 2>&1 | tee "$RESULTS/comm-bench.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
        echo "gpu_check: comm-bench needs 2 or more GPUs; this machine has $gpus" | tee "$RESULTS/comm-bench.txt" >&2
    fi
fi

# The device tool brings back at most 8 files of $OUT: past that (optional steps, --profile), the
# logs (.txt, env.txt kept) go into one logs.tar.gz; a .tmp left by a killed write goes.
rm -f "$RESULTS"/*.tmp
shopt -s nullglob
made=("$RESULTS"/*)
if [ "${#made[@]}" -gt 8 ]; then
    logs=()
    for f in "$RESULTS"/*.txt; do [ "$(basename "$f")" = env.txt ] || logs+=("$(basename "$f")"); done
    if [ ${#logs[@]} -gt 0 ] && tar -czf "$RESULTS/logs.tar.gz" -C "$RESULTS" "${logs[@]}"; then
        (cd "$RESULTS" && rm -f "${logs[@]}")
        echo "gpu_check: ${#made[@]} files: the logs are in logs.tar.gz (the device tool returns 8)" >&2
    fi
fi
echo "gpu_check: results in $RESULTS (exit $status)" >&2
exit $status
