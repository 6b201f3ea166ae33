// SPDX-License-Identifier: Apache-2.0
// The seqno-polling kernel of the rdma backend (vllm_disagg/transport/rdma/gpu.py: SeqnoWaiter).
//
// Launched on the consumer's stream AHEAD of the data: the stream holds at this kernel until the
// sender's post lands (its seqno WRITE fills the word), then the consumer kernel queued behind it
// starts. Launch latency is therefore paid while the data is still in flight, not after it.
// Build: csrc/build.sh (shared library with a C ABI for ctypes); CI compiles it with nvcc -c.
#include <cuda_runtime.h>
#include <stdint.h>

#include "seqno_poll.cuh"

namespace {

// One warp, one polling thread: the word is 8 bytes; more threads would only add memory traffic.
__global__ void seqno_wait_kernel(const volatile unsigned long long* seqword, unsigned long long expect,
                                  unsigned long long max_spins, unsigned int* timed_out) {
  if (threadIdx.x != 0) return;
  if (!vllm_disagg::wait_seqno(seqword, expect, max_spins) && timed_out != nullptr) {
    atomicExch(timed_out, 1u);  // the host checks this flag: a dead peer never hangs the GPU forever
  }
}

// Wait for several words at once (e.g. one per layer or per peer): thread i polls word i.
__global__ void seqno_wait_many_kernel(const volatile unsigned long long* seqwords,
                                       const unsigned long long* expect, int n,
                                       unsigned long long max_spins, unsigned int* timed_out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (!vllm_disagg::wait_seqno(seqwords + i, expect[i], max_spins) && timed_out != nullptr) {
    atomicExch(timed_out, 1u);
  }
}

// %globaltimer: the GPU's nanosecond clock, the same for every SM (the GPU kit times a write on one
// stream against its observation on another with it; host and GPU clocks are not compared).
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Measurement twin of seqno_wait_kernel (GPU kit, step a): the same wait, then it records when it
// saw the word (observed_ns) and answers the writer through `ack` (host-mapped memory: round trip).
__global__ void seqno_probe_kernel(const volatile unsigned long long* seqword, unsigned long long expect,
                                   unsigned long long max_spins, unsigned int* timed_out,
                                   unsigned long long* observed_ns, volatile unsigned long long* ack) {
  if (threadIdx.x != 0) return;
  if (!vllm_disagg::wait_seqno(seqword, expect, max_spins)) {
    if (timed_out != nullptr) atomicExch(timed_out, 1u);
    return;
  }
  if (observed_ns != nullptr) *observed_ns = global_ns();
  if (ack != nullptr) {
    *ack = expect;
    __threadfence_system();
  }
}

// A device-side writer of the seqword (stands for a peer GPU or the NIC): stamps, then writes.
__global__ void seqno_write_kernel(volatile unsigned long long* seqword, unsigned long long value,
                                   unsigned long long* written_ns) {
  if (threadIdx.x != 0) return;
  *written_ns = global_ns();
  *seqword = value;
  __threadfence_system();
}

}  // namespace

extern "C" {

// Enqueue "wait until *seqword >= expect" on `stream` (cudaStream_t; nullptr = legacy default).
// Returns the cudaError_t of the launch (0 = success).
int vd_seqno_wait_async(const void* seqword, uint64_t expect, uint64_t max_spins, void* timed_out, void* stream) {
  seqno_wait_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const volatile unsigned long long*>(seqword), expect, max_spins,
      static_cast<unsigned int*>(timed_out));
  return static_cast<int>(cudaGetLastError());
}

int vd_seqno_wait_many_async(const void* seqwords, const void* expect, int n, uint64_t max_spins, void* timed_out,
                             void* stream) {
  if (n <= 0) return 0;
  int threads = n < 256 ? n : 256;
  seqno_wait_many_kernel<<<(n + threads - 1) / threads, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const volatile unsigned long long*>(seqwords), static_cast<const unsigned long long*>(expect), n,
      max_spins, static_cast<unsigned int*>(timed_out));
  return static_cast<int>(cudaGetLastError());
}

// GPU kit (benchmarks/gpu/seqno.py): the probe and writer kernels above; pointers may be null.
int vd_seqno_probe_async(const void* seqword, uint64_t expect, uint64_t max_spins, void* timed_out,
                         void* observed_ns, void* ack, void* stream) {
  seqno_probe_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const volatile unsigned long long*>(seqword), expect, max_spins,
      static_cast<unsigned int*>(timed_out), static_cast<unsigned long long*>(observed_ns),
      static_cast<volatile unsigned long long*>(ack));
  return static_cast<int>(cudaGetLastError());
}

// Load every kernel of this library now. Under CUDA's lazy module loading (the default since 12.2)
// the first launch of a kernel loads it, and loading waits for the kernels already running: a writer
// launched for the first time while a wait kernel spins on its word deadlocks until the spin bound.
// The GPU kit saw exactly that on an H200 (step a, stream_write). Call once before the first wait.
int vd_seqno_preload(void) {
  cudaFuncAttributes attr;
  const void* kernels[] = {reinterpret_cast<const void*>(&seqno_wait_kernel),
                           reinterpret_cast<const void*>(&seqno_wait_many_kernel),
                           reinterpret_cast<const void*>(&seqno_probe_kernel),
                           reinterpret_cast<const void*>(&seqno_write_kernel)};
  for (const void* kernel : kernels) {
    cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

int vd_seqno_write_async(void* seqword, uint64_t value, void* written_ns, void* stream) {
  seqno_write_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<volatile unsigned long long*>(seqword), value, static_cast<unsigned long long*>(written_ns));
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
