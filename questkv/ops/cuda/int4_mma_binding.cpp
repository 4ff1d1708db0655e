// The Python bindings of int4_mma.cu's and int4_gemv.cu's launchers (questkv.ops.cuda.int4_mma and .int4_gemv
// check shapes, dtypes and alignment and allocate the output and the split partials, which only a launch of more than
// one block per tile reads); these launch on the current stream, so CUDA graphs capture them.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

cudaError_t questkv_int4_gemv(const void* x, const void* words, const void* scales, const void* zeros,
                              const void* bias, float* part, int* counters, void* out, int N, int K, int per_split,
                              int warps, int stages, int dtype, bool zeros_u8, bool pdl, cudaStream_t stream);

cudaError_t questkv_int4_mma(const void* x, const void* words, const void* scales, const void* zeros,
                             const void* bias, float* part, int* counters, void* out, int M, int N, int K,
                             int per_split, int warps, int dtype, bool zeros_u8, bool pdl, cudaStream_t stream);

void int4_mma(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, const at::Tensor& zeros,
              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& part,
              const c10::optional<at::Tensor>& counters, const at::Tensor& out, int64_t per_split, int64_t warps,
              bool pdl) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "int4_mma: x must be a contiguous [M, K] CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "int4_mma: x must be bf16 or fp16");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dtype = x.scalar_type() == at::kBFloat16 ? 0 : 1;
  const cudaError_t status = questkv_int4_mma(
      x.data_ptr(), words.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
      bias.has_value() ? bias->data_ptr() : nullptr, part.has_value() ? part->data_ptr<float>() : nullptr,
      counters.has_value() ? counters->data_ptr<int>() : nullptr,
      out.data_ptr(), static_cast<int>(x.size(0)), static_cast<int>(words.size(1)), static_cast<int>(x.size(1)),
      static_cast<int>(per_split), static_cast<int>(warps), dtype, zeros.scalar_type() == at::kByte, pdl,
      c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(status == cudaSuccess, "int4_mma: launch failed: ", cudaGetErrorString(status));
}

void int4_gemv(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, const at::Tensor& zeros,
               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& part,
               const c10::optional<at::Tensor>& counters, const at::Tensor& out, int64_t per_split, int64_t warps,
               int64_t stages, bool pdl) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(),
              "int4_gemv: x must be a contiguous [1, K] CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "int4_gemv: x must be bf16 or fp16");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dtype = x.scalar_type() == at::kBFloat16 ? 0 : 1;
  const cudaError_t status = questkv_int4_gemv(
      x.data_ptr(), words.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
      bias.has_value() ? bias->data_ptr() : nullptr, part.has_value() ? part->data_ptr<float>() : nullptr,
      counters.has_value() ? counters->data_ptr<int>() : nullptr, out.data_ptr(), static_cast<int>(words.size(1)),
      static_cast<int>(x.size(1)), static_cast<int>(per_split), static_cast<int>(warps), static_cast<int>(stages),
      dtype, zeros.scalar_type() == at::kByte, pdl, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(status == cudaSuccess, "int4_gemv: launch failed: ", cudaGetErrorString(status));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mma", &int4_mma, "int4 (group 128) times up to 32 rows on tensor cores");
  m.def("int4_gemv", &int4_gemv, "int4 (group 128) times one row on CUDA cores");
}
