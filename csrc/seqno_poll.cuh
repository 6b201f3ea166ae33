// SPDX-License-Identifier: Apache-2.0
// Device-side wait on an RDMA seqno word (Lamina: the receiver's kernel polls the sequence number
// in device memory; no CPU between NIC and GPU). The NIC's last WRITE of a post fills the word
// with seq + 1 after the data WRITEs of the same post (RC executes WRITEs in order), so a thread
// that observes `*seqword >= expect` may read the data once it has issued a system-scope fence.
#pragma once
#include <stdint.h>

namespace vllm_disagg {

// Spin (with __nanosleep backoff) until *seqword >= expect or max_spins polls pass.
// Returns true when the seqno arrived. Call from one thread, then __syncthreads() in the block.
__device__ __forceinline__ bool wait_seqno(const volatile unsigned long long* seqword,
                                           unsigned long long expect,
                                           unsigned long long max_spins) {
  unsigned int backoff_ns = 32;
  for (unsigned long long spin = 0; spin < max_spins; ++spin) {
    // volatile load: re-read device memory every time (the NIC writes it over PCIe, not an SM)
    if (*seqword >= expect) {
      __threadfence_system();  // data reads issued after this see what landed before the seqno
      return true;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(backoff_ns);
    backoff_ns = backoff_ns < 1024 ? backoff_ns * 2 : 1024;
#endif
  }
  return false;
}

}  // namespace vllm_disagg
