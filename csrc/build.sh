#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build csrc/ with nvcc. `--check`: compile-only (CI, no GPU needed): nvcc -c ... -o /dev/null.
# Otherwise builds csrc/build/libvd_seqno.so, loaded by vllm_disagg/transport/rdma/gpu.py (ctypes).
# Env: NVCC (default nvcc), CUDA_ARCHS (default "80 90": A100, H100).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NVCC="${NVCC:-nvcc}"
GENCODE=()
for a in ${CUDA_ARCHS:-80 90}; do GENCODE+=(-gencode "arch=compute_${a},code=sm_${a}"); done
FLAGS=(-std=c++17 -O3 -Xcompiler -fPIC -Xcompiler -Wall "${GENCODE[@]}")
if [[ "${1:-}" == "--check" ]]; then
  "$NVCC" "${FLAGS[@]}" -c "$HERE/seqno_poll.cu" -o /dev/null
  echo "csrc: seqno_poll.cu compiles (${CUDA_ARCHS:-80 90})"
  exit 0
fi
mkdir -p "$HERE/build"
"$NVCC" "${FLAGS[@]}" -shared "$HERE/seqno_poll.cu" -o "$HERE/build/libvd_seqno.so"
echo "built $HERE/build/libvd_seqno.so"
