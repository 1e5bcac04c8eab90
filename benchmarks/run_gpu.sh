#!/usr/bin/env bash
# Reproduces every GPU number of the README on a CUDA machine, from the repository root:
#   bash benchmarks/run_gpu.sh [suite ...]      # suites: tests fused softcap layers patch offload rollout train sft e2e context
# Installs the baseline wheels from .whl/ when present (a machine without a registry), then runs the suites with
# the settings the README quotes; each writes benchmarks/results/<suite>-<card>.json; the last step renders
# REPORT.md and the charts. On a machine without a package registry, download the baseline wheels (x86-64,
# CPython 3.12) into .whl/ on a machine with one, as the README says:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 -d .whl liger-kernel==0.8.5 bitsandbytes==0.50.2
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
suites=${*:-tests fused softcap layers patch offload rollout train sft e2e context}
status=0
for suite in $suites; do
  echo "=== $suite"
  case $suite in
    tests)   python3 -m pytest tests -q -m gpu -p no:cacheprovider ;;
    fused)   python3 -m pytest benchmarks/bench_fused_linear.py -q -s ;;
    softcap) python3 -m pytest benchmarks/bench_softcap.py -q -s ;;
    layers)  python3 -m pytest benchmarks/bench_layers.py -q -s ;;
    patch)   python3 -m pytest benchmarks/bench_patch_model.py -q -s ;;
    offload) python3 -m pytest benchmarks/bench_offload.py -q -s ;;
    rollout) python3 -m pytest benchmarks/bench_rollout.py -q -s &&
             FASTGRPO_ROLLOUT_MODEL=llama-3.1-8b FASTGRPO_ROLLOUT_REPEATS=2 \
               python3 -m pytest benchmarks/bench_rollout.py -q -s ;;
    train)   python3 -m pytest benchmarks/bench_train_loop.py -q -s ;;
    sft)     python3 -m pytest benchmarks/bench_sft.py -q -s ;;
    e2e)     python3 -m pytest benchmarks/bench_e2e.py -q -s &&
             FASTGRPO_E2E_MODELS=llama-3.1-8b FASTGRPO_E2E_MODES=lora,full FASTGRPO_E2E_LENGTHS=1024 \
               python3 -m pytest benchmarks/bench_e2e.py -q -s ;;
    context) FASTGRPO_MICRO_BATCH=8 FASTGRPO_MAX_LENGTH=32768 python3 -m pytest benchmarks/bench_context.py -q -s &&
             FASTGRPO_MICRO_BATCH=1 FASTGRPO_MAX_LENGTH=65536 FASTGRPO_CONTEXT_RESOLUTION=4096 \
               python3 -m pytest benchmarks/bench_context.py -q -s -k longest ;;
    *) echo "unknown suite $suite"; status=2 ;;
  esac || status=1
done
python3 -m benchmarks.report || status=1
exit $status
