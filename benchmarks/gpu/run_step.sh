#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One GPU-kit step on the lent machine (docs/gpu.md): install the carried wheels (.whl/, made by
# `make gpu-wheels` here), then run the step; its JSON and log land in $OUT (the device tool's
# return folder; benchmarks/results/gpu when unset).
#   bash benchmarks/gpu/run_step.sh a|b|c|d|all
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
STEP="${1:?usage: run_step.sh a|b|c|d|all}"
PY="${GPU_PYTHON:-python3}"
SITE=/tmp/vd-gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "run_step.sh: installing .whl/ failed" >&2; exit 2; }
else
  echo "run_step.sh: no .whl/ carried (name .whl in the call's carry); steps b and d need it" >&2
fi
export PYTHONPATH="$PWD:$PWD/benchmarks/gpu:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# EAGER: the seqno wait (step a) deadlocks a lazily loaded kernel launched behind it (docs/gpu.md).
export CUDA_MODULE_LOADING=EAGER
export PYTHONUNBUFFERED=1 VLLM_DISAGG_AUTH_TOKEN="${VLLM_DISAGG_AUTH_TOKEN:-gpu-kit-token}"
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
"$PY" benchmarks/gpu_check.py --step "$STEP" --out "$OUT" 2>&1 | tee "$OUT/gpu_check_${STEP//,/-}.log"
exit "${PIPESTATUS[0]}"
