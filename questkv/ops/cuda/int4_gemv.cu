// int4 (group 128) times one row of x on CUDA cores: the GEMV over the K-major words every int4 kernel reads.
//
// The weight: int32 words [K / 8, N] (questkv.ops.quant_reference.pack_int4_k_major): inside group g, word row
// j (0..15) of output n holds in bits 4 i .. 4 i + 3 the code of feature 128 g + 16 i + j. Scales [K / 128, N] in
// x's dtype; zero points [K / 128, N] in x's dtype or uint8; w[n, k] = (q - z) * s.
//
// A block owns 32 outputs; a lane (c = lane % 8, r = lane / 8) loads word rows 4 s + r (s = 0..3) of outputs
// n0 + 4 c .. + 3, one 128-bit load each, so that a warp's load is four full 128-byte lines and a group's 16 word rows
// are four loads. The warps of a block take whole groups in turn and keep the words (with the group's scales and zero
// points) of STAGES - 1 groups ahead in flight, in registers. Each word gives its nibbles (e, e + 4) in pairs: one
// shift and one lop3 leave two 16-bit fields 0x4300 | q; the 32-bit word as a float is 128.26171875 + q[e + 4] +
// q[e] / 65536 (the low half only perturbs the mantissa's last bits, 1.5e-5 of a unit) and shifted left by 16 it is
// exactly 128 + q[e]; both multiply x in float32 (the Triton GEMV's maths, questkv.ops.triton.int4_gemv). x is
// staged once per block in shared memory as float32, reordered so that a word row's 8 features are two 128-bit
// loads, with each group's sums per row set r (the offsets 128 + 0.26171875 come off once per group with the zero
// point: acc += s * (d - z * sum(x) - (128 sum(x) + 0.26171875 sum(x_high)))).
//
// The four lanes of a c sum by shuffles, the warps of a block in shared memory in warp order, and blocks that split
// K (grid.y) end as int4_mma.cu's do: the last block of an output tile to arrive sums the float32 partials in split
// order (the ticket of questkv.ops.triton._common): deterministic.

#include <cstdint>

#include "int4_common.cuh"

namespace {

constexpr int GROUP = 128;                     // features per scale and zero point
constexpr int WORD_ROWS = GROUP / 8;           // word rows per group
constexpr int ROW_LANES = 8;                   // lanes per word row, 4 outputs each
constexpr int ROW_SETS = 32 / ROW_LANES;       // word rows per warp load
constexpr int LOADS = WORD_ROWS / ROW_SETS;    // 128-bit loads per lane and group
constexpr int BLOCK_N = 4 * ROW_LANES;         // outputs per block
constexpr uint32_t MAGIC = 0x43004300u;        // (q | 0x4300) is bf16 128 + q
constexpr float OFFSET = 128.0f;
constexpr float HIGH_OFFSET = 17152.0f / 65536.0f;  // the low field's 0x4300 seen in the high float's mantissa

// What a lane holds of one group: its four word rows' words of 4 outputs, their scales and zero points (raw: 4
// 16-bit values, or 4 bytes in z.x).
struct GroupWords {
  uint4 w[LOADS];
  uint2 s;
  uint2 z;
};

template <typename T, typename Z>
__device__ __forceinline__ void load_group(GroupWords& out, const uint32_t* w_lane, const T* scales, const Z* zeros,
                                           int grp, int col, int N) {
#pragma unroll
  for (int s = 0; s < LOADS; ++s)
    out.w[s] = __ldg(reinterpret_cast<const uint4*>(w_lane + static_cast<size_t>(grp * WORD_ROWS + ROW_SETS * s) * N));
  const size_t sz = static_cast<size_t>(grp) * N + col;
  out.s = __ldg(reinterpret_cast<const uint2*>(scales + sz));
  if constexpr (sizeof(Z) == 1) {
    out.z = make_uint2(__ldg(reinterpret_cast<const unsigned int*>(zeros + sz)), 0u);
  } else {
    out.z = __ldg(reinterpret_cast<const uint2*>(zeros + sz));
  }
}

template <typename T>
__device__ __forceinline__ float scale_of(const uint2& v, int i) {
  return to_float(reinterpret_cast<const T*>(&v)[i]);
}

template <typename Z>
__device__ __forceinline__ float zero_of(const uint2& v, int i) {
  if constexpr (sizeof(Z) == 1) {
    return static_cast<float>((v.x >> (8 * i)) & 0xFFu);
  } else {
    return to_float(reinterpret_cast<const Z*>(&v)[i]);
  }
}

// acc[o] += the group's product for output o of the lane's 4, from its words and the staged x of the group
// (xg: [16 word rows][8 nibbles] float32) with the row set's sums (x_sum, x_offset).
template <typename T, typename Z>
__device__ __forceinline__ void group_product(float* acc, const GroupWords& g, const float* xg, float x_sum,
                                              float x_offset, int r) {
  float d_high[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float d_low[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < LOADS; ++s) {
    const int j = ROW_SETS * s + r;
    const float4 lo = *reinterpret_cast<const float4*>(xg + 8 * j);      // nibbles 0..3 of word row j
    const float4 hi = *reinterpret_cast<const float4*>(xg + 8 * j + 4);  // nibbles 4..7
    const float xl[4] = {lo.x, lo.y, lo.z, lo.w};
    const float xh[4] = {hi.x, hi.y, hi.z, hi.w};
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&g.w[s]);
#pragma unroll
    for (int o = 0; o < 4; ++o)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t t = nibble_pair<MAGIC>(words[o], e);
        d_high[o] = fmaf(__uint_as_float(t), xh[e], d_high[o]);
        d_low[o] = fmaf(__uint_as_float(t << 16), xl[e], d_low[o]);
      }
  }
#pragma unroll
  for (int o = 0; o < 4; ++o)
    acc[o] += scale_of<T>(g.s, o) * ((d_high[o] + d_low[o]) - zero_of<Z>(g.z, o) * x_sum - x_offset);
}

// Grid (N / 32, split); block 32 * warps threads; dynamic shared memory (per_split * (128 + 8) + warps * 32) floats.
// x [K], out [N], part float32 [split, N], counters one zeroed int32 per output tile.
template <typename T, typename Z, int STAGES>
__global__ void __launch_bounds__(512) int4_gemv_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ words, const T* __restrict__ scales,
    const Z* __restrict__ zeros, const T* __restrict__ bias, float* __restrict__ part, int* __restrict__ counters,
    T* __restrict__ out, int N, int K, int groups_per_split) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const int c = lane % ROW_LANES;
  const int r = lane / ROW_LANES;
  const int n0 = blockIdx.x * BLOCK_N;
  const int g_start = blockIdx.y * groups_per_split;
  const int g_end = min(g_start + groups_per_split, K / GROUP);
  const int local = g_end - g_start;
  float* xs = smem;                            // [local][16 word rows][8 nibbles]
  float* x_sums = xs + local * GROUP;          // [local][ROW_SETS]: sum of x over a row set's features
  float* x_offsets = x_sums + local * ROW_SETS;  // [local][ROW_SETS]: 128 sum(x) + 0.26171875 sum(x_high)
  float* warp_sums = x_offsets + local * ROW_SETS;  // [warps][32 outputs]

  const uint32_t* w_lane = words + n0 + 4 * c + static_cast<size_t>(r) * N;
  const int col = n0 + 4 * c;
  // The weights are constant: the first groups' words are requested before waiting for the kernel before this
  // grid (programmatic dependent launch; a no-op for an ordinary launch); x, the partials and the output after.
  GroupWords ring[STAGES];
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    const int grp = g_start + warp + st * warps;
    if (grp < g_end) load_group<T, Z>(ring[st], w_lane, scales, zeros, grp, col, N);
  }
  grid_dependency_wait();

  // x's groups of this block in shared memory, word row by word row: feature 128 g + 16 i + j at [g][j][i]; eight
  // consecutive features (one 128-bit load) share i.
  const T* x_block = x + static_cast<size_t>(g_start) * GROUP;
  for (int v = threadIdx.x; v < local * GROUP / 8; v += blockDim.x) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x_block + 8 * v);
    const T* h = reinterpret_cast<const T*>(&raw);
    const int f = 8 * v;
    const int g = f / GROUP;
    const int i = (f % GROUP) / WORD_ROWS;
    const int j0 = f % WORD_ROWS;
#pragma unroll
    for (int u = 0; u < 8; ++u) xs[(g * WORD_ROWS + j0 + u) * 8 + i] = to_float(h[u]);
  }
  __syncthreads();
  for (int p = threadIdx.x; p < local * ROW_SETS; p += blockDim.x) {
    const float* xg = xs + (p / ROW_SETS) * GROUP;
    float low = 0.0f;
    float high = 0.0f;
#pragma unroll
    for (int s = 0; s < LOADS; ++s) {
      const float* row = xg + 8 * (ROW_SETS * s + p % ROW_SETS);
      low += (row[0] + row[1]) + (row[2] + row[3]);
      high += (row[4] + row[5]) + (row[6] + row[7]);
    }
    x_sums[p] = low + high;
    x_offsets[p] = OFFSET * (low + high) + HIGH_OFFSET * high;
  }
  __syncthreads();

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int base = g_start + warp; base < g_end; base += STAGES * warps) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      const int grp = base + st * warps;
      if (grp >= g_end) break;
      const int ahead = grp + (STAGES - 1) * warps;
      if (ahead < g_end) load_group<T, Z>(ring[(st + STAGES - 1) % STAGES], w_lane, scales, zeros, ahead, col, N);
      const int lg = grp - g_start;
      group_product<T, Z>(acc, ring[st], xs + lg * GROUP, x_sums[lg * ROW_SETS + r], x_offsets[lg * ROW_SETS + r],
                          r);
    }
  }
  launch_dependents();  // every weight load issued: the next kernel may start its own

#pragma unroll
  for (int o = 0; o < 4; ++o) {
    acc[o] += __shfl_xor_sync(0xffffffffu, acc[o], ROW_LANES);
    acc[o] += __shfl_xor_sync(0xffffffffu, acc[o], 2 * ROW_LANES);
  }
  if (r == 0) {
#pragma unroll
    for (int o = 0; o < 4; ++o) warp_sums[warp * BLOCK_N + 4 * c + o] = acc[o];
  }
  __syncthreads();
  const int split = gridDim.y;
  if (threadIdx.x < BLOCK_N) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += warp_sums[w * BLOCK_N + threadIdx.x];
    const int n = n0 + threadIdx.x;
    if (split == 1) {
      if (bias != nullptr) total += to_float(bias[n]);
      out[n] = from_float<T>(total);
    } else {
      part[static_cast<size_t>(blockIdx.y) * N + n] = total;
    }
  }
  if (split == 1 || !last_to_arrive(counters + blockIdx.x, split)) return;
  if (threadIdx.x < BLOCK_N) {
    const int n = n0 + threadIdx.x;
    float total = 0.0f;
    for (int sp = 0; sp < split; ++sp) total += __ldcg(part + static_cast<size_t>(sp) * N + n);
    if (bias != nullptr) total += to_float(bias[n]);
    out[n] = from_float<T>(total);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // the ticket left zero for the next launch
}

template <typename T, typename Z, int STAGES>
cudaError_t launch_typed(const void* x, const void* words, const void* scales, const void* zeros, const void* bias,
                         float* part, int* counters, void* out, int N, int K, int per_split, int warps, bool pdl,
                         cudaStream_t stream) {
  const int groups = K / GROUP;
  const size_t smem = (static_cast<size_t>(per_split) * (GROUP + 2 * ROW_SETS) + warps * BLOCK_N) * sizeof(float);
  static bool opted_in[64] = {};  // above 48 KiB a launch needs the kernel's opt-in, once per device
  int device = 0;
  if (smem > 48 * 1024) {
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess && (device >= 64 || !opted_in[device]))
      status = cudaFuncSetAttribute(int4_gemv_kernel<T, Z, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    160 * 1024);
    if (status != cudaSuccess) return status;
    if (device < 64) opted_in[device] = true;
  }
  if (smem > 160 * 1024) return cudaErrorInvalidValue;  // the caller splits K before that
  return launch_kernel(int4_gemv_kernel<T, Z, STAGES>, dim3(N / BLOCK_N, (groups + per_split - 1) / per_split),
                       dim3(warps * 32), smem, pdl, stream, static_cast<const T*>(x),
                       static_cast<const uint32_t*>(words), static_cast<const T*>(scales),
                       static_cast<const Z*>(zeros), static_cast<const T*>(bias), part, counters,
                       static_cast<T*>(out), N, K, per_split);
}

template <typename T, typename Z>
cudaError_t launch_stages(const void* x, const void* words, const void* scales, const void* zeros, const void* bias,
                          float* part, int* counters, void* out, int N, int K, int per_split, int warps, int stages,
                          bool pdl, cudaStream_t stream) {
  if (stages == 2)
    return launch_typed<T, Z, 2>(x, words, scales, zeros, bias, part, counters, out, N, K, per_split, warps, pdl,
                                 stream);
  if (stages == 3)
    return launch_typed<T, Z, 3>(x, words, scales, zeros, bias, part, counters, out, N, K, per_split, warps, pdl,
                                 stream);
  return cudaErrorInvalidValue;
}

}  // namespace

// dtype: 0 bf16, 1 fp16; zeros_u8: zero points held as uint8 (else in x's dtype); per_split: groups per block
// (part holds one [N] partial per block of an output tile when that leaves more than one); stages: groups a warp
// holds in registers (2 or 3: one or two ahead of the one it multiplies); pdl: programmatic dependent launch.
// Shapes are checked by the caller.
cudaError_t questkv_int4_gemv(const void* x, const void* words, const void* scales, const void* zeros,
                              const void* bias, float* part, int* counters, void* out, int N, int K, int per_split,
                              int warps, int stages, int dtype, bool zeros_u8, bool pdl, cudaStream_t stream) {
  return for_int4_types(dtype, zeros_u8, [&](auto t, auto z) {
    return launch_stages<decltype(t), decltype(z)>(x, words, scales, zeros, bias, part, counters, out, N, K,
                                                   per_split, warps, stages, pdl, stream);
  });
}
