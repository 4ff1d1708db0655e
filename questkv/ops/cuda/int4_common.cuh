// What the int4 kernels over the K-major words share (int4_mma.cu, int4_gemv.cu): 16-bit float conversions, the
// nibble pair of a word in one lop3, programmatic dependent launch, the ticket of a split reduction, and the
// host's launch with programmatic dependent launch and switch over their types.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// Nibbles e and e + 4 of a word as two 16-bit fields MAGIC | q: (w >> 4e) & 0x000F000F | MAGIC in one lop3.
template <uint32_t MAGIC>
__device__ __forceinline__ uint32_t nibble_pair(uint32_t word, int e) {
  uint32_t v = word >> (4 * e);
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(out) : "r"(v), "n"(0x000F000F), "n"(MAGIC));
  return out;
}

// Programmatic dependent launch (sm_90; no-ops for an ordinary launch): wait until the kernel before this grid has
// finished and its writes are visible / let the kernel after this grid start launching.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether this block is the last of the split's blocks of its output tile to arrive at counter (one zeroed int per
// tile; the caller's partials written before): the one that then sums them. Every thread of the block calls it.
__device__ __forceinline__ bool last_to_arrive(int* counter, int split) {
  __shared__ int last_block;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(counter, 1) == split - 1;
  __syncthreads();
  if (!last_block) return false;
  __threadfence();
  return true;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch where pdl (the kernel may start
// while the one before it runs; it waits in grid_dependency_wait).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, bool pdl,
                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// launch(T{}, Z{}) for x's 16-bit type T (dtype 0: bf16, 1: fp16) and the zero points' type Z (uint8 or T): the host
// side's one switch over the types both kernels are instantiated for.
template <typename Launch>
cudaError_t for_int4_types(int dtype, bool zeros_u8, Launch&& launch) {
  if (dtype == 0) return zeros_u8 ? launch(__nv_bfloat16{}, uint8_t{}) : launch(__nv_bfloat16{}, __nv_bfloat16{});
  return zeros_u8 ? launch(__half{}, uint8_t{}) : launch(__half{}, __half{});
}

}  // namespace
