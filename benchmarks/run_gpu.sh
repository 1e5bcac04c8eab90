#!/usr/bin/env bash
# Reproduces every GPU number of the README on a CUDA machine, from the repository root:
#   bash benchmarks/run_gpu.sh [suite ...]      # suites: tests fused layers patch offload rollout train e2e context
# Installs the baseline wheels from .whl/ when present (a machine without a registry), then runs the suites;
# each writes benchmarks/results/<suite>-<card>.json; the last step renders REPORT.md and e2e.png.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
suites=${*:-tests fused layers patch offload rollout train e2e context}
status=0
for suite in $suites; do
  echo "=== $suite"
  case $suite in
    tests)   python3 -m pytest tests -q -m gpu -p no:cacheprovider ;;
    fused)   python3 -m pytest benchmarks/bench_fused_linear.py -q -s ;;
    layers)  python3 -m pytest benchmarks/bench_layers.py -q -s ;;
    patch)   python3 -m pytest benchmarks/bench_patch_model.py -q -s ;;
    offload) python3 -m pytest benchmarks/bench_offload.py -q -s ;;
    rollout) python3 -m pytest benchmarks/bench_rollout.py -q -s ;;
    train)   python3 -m pytest benchmarks/bench_train_loop.py -q -s ;;
    e2e)     python3 -m pytest benchmarks/bench_e2e.py -q -s ;;
    context) python3 -m pytest benchmarks/bench_context.py -q -s ;;
    *) echo "unknown suite $suite"; status=2 ;;
  esac || status=1
done
python3 -m benchmarks.report || status=1
exit $status
