// int4 (group 128) times a few rows of x on tensor cores, reading the K-major words every int4 kernel reads.
//
// The weight: int32 words [K / 8, N] (questkv.ops.quant_reference.pack_int4_k_major): inside group g, word row
// j (0..15) of output n holds in bits 4 i .. 4 i + 3 the code of feature 128 g + 16 i + j. Scales [K / 128, N] in
// x's dtype; zero points [K / 128, N] in x's dtype or uint8; w[n, k] = (q - z) * s.
//
// One mma.sync.m16n8k16 takes the weight as its A operand (16 outputs by 16 features) and up to 8 rows of x as B
// (NT = 1, 2 or 4 column tiles for up to 8, 16 or 32 rows),
// so the codes need no shuffle at load: per group a lane (g = lane / 4, t = lane % 4) loads word rows 4 t + s
// (s = 0..3, one step each) of 8 outputs with two 128-bit loads, and each word's nibble pairs (e, e + 4) become one
// register of two 16-bit floats OFFSET + q with one shift and one lop3 ((q | 0x4300) is bf16 128 + q exactly,
// (q | 0x6400) fp16 1024 + q). The features inside an MMA are the lane's own: A's columns (2t, 2t + 1, 2t + 8,
// 2t + 9) are, for the step's MMA h in {0, 1}, nibbles (2h, 2h + 4, 2h + 1, 2h + 5) of word row 4 t + s, and B's
// rows are the same features of x: the lane holds features 16 i + 4 t .. + 3 (eight 64-bit loads per token and
// group) and pairs them with one byte permute per register. Per group the products of OFFSET + q are summed in
// float32 (d), and the scale and zero point come off once: acc += s * (d - (z + OFFSET) * sum(x_group)), as
// questkv.ops.triton.int4_words does; at 9-16 rows the sums of x are one more MMA per B fragment, an all-ones A
// (a fifth of the MMAs where converting and adding x took a quarter of the loop's instructions).
//
// A warp owns 64 outputs (4 MMA tiles: tile m's A rows g and g + 8 are outputs n0 + 4 g + m and n0 + 32 + 4 g + m,
// the components of the lane's two loads) and whole groups; the warps of a block split the block's groups and sum
// in shared memory in a fixed order; blocks split K further (grid.y) and the last block of an output tile to arrive
// sums the float32 partials in split order (the ticket of questkv.ops.triton._common): deterministic.

#include <cstdint>
#include <type_traits>

#include "int4_common.cuh"

namespace {

constexpr int GROUP = 128;                // features per scale and zero point
constexpr int STEPS = GROUP / 32;         // a warp's 4 word columns (32 features) per step
constexpr int WARP_N = 64;                // outputs per warp (and per block)
constexpr int TILES = WARP_N / 16;        // MMA tiles of 16 outputs

// d += a (16 x 16, row-major fragments) times b (16 x 8, column-major), float32 accumulators; TYPE: bf16 or f16.
#define QUESTKV_MMA_M16N8K16(TYPE, d, a, b0, b1)                                                           \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                      \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// The 16-bit float type T's codes: (q | MAGIC) is OFFSET + q exactly, two per 32-bit register.
template <typename T>
struct Float16Codes {
  static constexpr bool BF16 = std::is_same_v<T, __nv_bfloat16>;
  static constexpr uint32_t MAGIC = BF16 ? 0x43004300u : 0x64006400u;
  static constexpr float OFFSET = BF16 ? 128.0f : 1024.0f;
  static constexpr uint32_t ONES = BF16 ? 0x3F803F80u : 0x3C003C00u;  // (1.0, 1.0)
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    if constexpr (BF16) {
      QUESTKV_MMA_M16N8K16("bf16", d, a, b0, b1);
    } else {
      QUESTKV_MMA_M16N8K16("f16", d, a, b0, b1);
    }
  }
};

// The sum of 4 16-bit floats (one 64-bit load of x) in float32.
template <typename T>
__device__ __forceinline__ float sum4(const uint2& v) {
  const T* h = reinterpret_cast<const T*>(&v);
  return (to_float(h[0]) + to_float(h[1])) + (to_float(h[2]) + to_float(h[3]));
}

// Element s of two 64-bit loads of x (4 16-bit floats each) as one register of two: (first[s], second[s]).
__device__ __forceinline__ uint32_t pair_of(const uint2& first, const uint2& second, int s) {
  const uint32_t a = s < 2 ? first.x : first.y;
  const uint32_t b = s < 2 ? second.x : second.y;
  return __byte_perm(a, b, s % 2 == 0 ? 0x5410 : 0x7632);
}

// The lane's words of group grp: word rows 4 t + s (s = 0..STEPS-1) of outputs w_lane .. + 3 and + 32 .. + 35.
__device__ __forceinline__ void load_words(uint4 (*w)[2], const uint32_t* w_lane, int grp, int t, int N) {
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const uint32_t* p = w_lane + static_cast<size_t>(grp * (GROUP / 8) + 4 * t + s) * N;
    w[s][0] = __ldg(reinterpret_cast<const uint4*>(p));
    w[s][1] = __ldg(reinterpret_cast<const uint4*>(p + 32));
  }
}

// Four consecutive values of a [groups, N] tensor (scales or zero points) as float32, in one load (8-byte aligned
// for 16-bit values, 4-byte for uint8: the caller's index is a multiple of 4).
template <typename Z>
__device__ __forceinline__ void load4(const Z* p, float* out) {
  if constexpr (sizeof(Z) == 1) {
    const uint32_t v = __ldg(reinterpret_cast<const unsigned int*>(p));
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = static_cast<float>((v >> (8 * i)) & 0xFFu);
  } else {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    const Z* h = reinterpret_cast<const Z*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = to_float(h[i]);
  }
}

// Grid (N / 64, split); block 32 * warps threads; dynamic shared memory warps * 64 * 8 * NT floats.
// x [M, K] (M <= 8 * NT), out [M, N], part float32 [split, M, N], counters one zeroed int32 per output tile.
template <typename T, typename Z, int NT>
__global__ void __launch_bounds__(256) int4_mma_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ words, const T* __restrict__ scales,
    const Z* __restrict__ zeros, const T* __restrict__ bias, float* __restrict__ part, int* __restrict__ counters,
    T* __restrict__ out, int M, int N, int K, int groups_per_split) {
  using Codes = Float16Codes<T>;
  extern __shared__ float sums[];  // [warps][NT * 8 tokens][64 outputs]
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int n0 = blockIdx.x * WARP_N;
  const int groups = K / GROUP;
  const int g_start = blockIdx.y * groups_per_split;
  const int g_end = min(g_start + groups_per_split, groups);

  float acc[NT][TILES][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int m = 0; m < TILES; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[nt][m][c] = 0.0f;

  const uint32_t* w_lane = words + n0 + 4 * g;  // + word row * N; + 32 for the second load
  // Up to 16 rows the next group's words are loaded while this one is multiplied; 32 rows' accumulators leave no
  // registers for that, and their four MMAs per operand hide the loads' latency instead.
  constexpr bool PREFETCH = NT <= 2;
  uint4 w_cur[STEPS][2];
  uint4 w_next[STEPS][2];  // unused without PREFETCH
  int grp = g_start + warp;
  if (grp < g_end) load_words(w_cur, w_lane, grp, t, N);
  // Launched with programmatic dependent launch, this grid may start while the kernel before it runs: the weights
  // are constant, so the first group's words are requested above; x, the partials, the tickets and the output only
  // after the kernel before it has finished (a no-op for an ordinary launch).
  grid_dependency_wait();
  for (; grp < g_end; grp += warps) {
    const int grp_next = grp + warps;
    if constexpr (PREFETCH) {
      if (grp_next < g_end) load_words(w_next, w_lane, grp_next, t, N);  // in flight meanwhile
    }
    float d[NT][TILES][4];
    // The group's sums of x: at 9-16 rows an all-ones A times each B fragment (one MMA; its row g holds tokens
    // nt * 8 + 2t and + 1, the lane's own accumulator columns), else in float32 adds: up to 8 rows the MMA's four
    // accumulators took the kernel past 128 registers (one block of 256 threads per SM, not two: 25 % slower at
    // 1-8 rows on an H100), above 16 they spill.
    constexpr bool MMA_SUMS = NT == 2;
    float x_sum[NT][MMA_SUMS ? 4 : 1];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int c = 0; c < (MMA_SUMS ? 4 : 1); ++c) x_sum[nt][c] = 0.0f;
#pragma unroll
      for (int m = 0; m < TILES; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) d[nt][m][c] = 0.0f;
    }
    // Up to 16 rows the group's x is loaded at once; 32 rows' worth of it is loaded a half per MMA h (registers).
    constexpr int PASSES = NT <= 2 ? 1 : 2;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      // token nt * 8 + g's features 16 i + 4 t .. + 3 of the group at the pass's nibbles i: in one pass all eight,
      // slot i; in two, MMA h = pass's nibbles (2h, 2h + 4, 2h + 1, 2h + 5), slots 0..3
      uint2 xq[NT][8 / PASSES];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int token = nt * 8 + g;
        const T* row = x + static_cast<size_t>(token) * K + grp * GROUP + 4 * t;
#pragma unroll
        for (int j = 0; j < 8 / PASSES; ++j) {
          const int nibble = PASSES == 1 ? j : 2 * pass + (j & 1) * 4 + (j >> 1);
          xq[nt][j] = make_uint2(0u, 0u);
          if (token < M) xq[nt][j] = *reinterpret_cast<const uint2*>(row + 16 * nibble);
          if constexpr (!MMA_SUMS) x_sum[nt][0] += sum4<T>(xq[nt][j]);
        }
      }
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {  // word row 4 t + s of the group: nibble i is feature 16 i + 4 t + s
        const uint32_t* low = reinterpret_cast<const uint32_t*>(&w_cur[s][0]);
        const uint32_t* high = reinterpret_cast<const uint32_t*>(&w_cur[s][1]);
#pragma unroll
        for (int hh = 0; hh < 2 / PASSES; ++hh) {
          const int h = PASSES == 1 ? hh : pass;
          uint32_t b[NT][2];  // x at nibbles (2h, 2h + 4) and (2h + 1, 2h + 5)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            b[nt][0] = PASSES == 1 ? pair_of(xq[nt][2 * h], xq[nt][2 * h + 4], s) : pair_of(xq[nt][0], xq[nt][1], s);
            b[nt][1] = PASSES == 1 ? pair_of(xq[nt][2 * h + 1], xq[nt][2 * h + 5], s)
                                   : pair_of(xq[nt][2], xq[nt][3], s);
            if constexpr (MMA_SUMS) {
              const uint32_t ones[4] = {Codes::ONES, Codes::ONES, Codes::ONES, Codes::ONES};
              Codes::mma(x_sum[nt], ones, b[nt][0], b[nt][1]);
            }
          }
#pragma unroll
          for (int m = 0; m < TILES; ++m) {
            uint32_t a[4];
            a[0] = nibble_pair<Codes::MAGIC>(low[m], 2 * h);       // output row g: nibbles (2h, 2h + 4)
            a[1] = nibble_pair<Codes::MAGIC>(high[m], 2 * h);      // row g + 8
            a[2] = nibble_pair<Codes::MAGIC>(low[m], 2 * h + 1);   // row g: (2h + 1, 2h + 5)
            a[3] = nibble_pair<Codes::MAGIC>(high[m], 2 * h + 1);  // row g + 8
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) Codes::mma(d[nt][m], a, b[nt][0], b[nt][1]);
          }
        }
      }
    }
    if constexpr (!PREFETCH) {
      if (grp_next < g_end) load_words(w_cur, w_lane, grp_next, t, N);  // w_cur is read: reuse it
    }
    // The group's scale and zero point per output: tile m's rows are outputs n0 + 4g + m and n0 + 32 + 4g + m.
    float s_low[4], s_high[4], z_low[4], z_high[4];
    const size_t sz = static_cast<size_t>(grp) * N + n0 + 4 * g;
    load4(scales + sz, s_low);
    load4(scales + sz + 32, s_high);
    load4(zeros + sz, z_low);
    load4(zeros + sz + 32, z_high);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float xs0, xs1;  // tokens nt * 8 + 2t and + 1 over the group
      if constexpr (MMA_SUMS) {
        xs0 = x_sum[nt][0];
        xs1 = x_sum[nt][1];
      } else {  // token nt * 8 + g over this lane's features; the 4 lanes of g hold the group
        float xs = x_sum[nt][0];
        xs += __shfl_xor_sync(0xffffffffu, xs, 1);
        xs += __shfl_xor_sync(0xffffffffu, xs, 2);
        xs0 = __shfl_sync(0xffffffffu, xs, 8 * t);
        xs1 = __shfl_sync(0xffffffffu, xs, 8 * t + 4);
      }
#pragma unroll
      for (int m = 0; m < TILES; ++m) {
        const float zl = z_low[m] + Codes::OFFSET;
        const float zh = z_high[m] + Codes::OFFSET;
        acc[nt][m][0] += s_low[m] * (d[nt][m][0] - zl * xs0);
        acc[nt][m][1] += s_low[m] * (d[nt][m][1] - zl * xs1);
        acc[nt][m][2] += s_high[m] * (d[nt][m][2] - zh * xs0);
        acc[nt][m][3] += s_high[m] * (d[nt][m][3] - zh * xs1);
      }
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        w_cur[s][0] = w_next[s][0];
        w_cur[s][1] = w_next[s][1];
      }
    }
  }

  launch_dependents();  // every weight load issued: the next kernel may start its own

  // The block's warps summed in shared memory ([warp][token][output]), in warp order.
  constexpr int PER_WARP = NT * 8 * WARP_N;
  float* mine = sums + warp * PER_WARP;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int m = 0; m < TILES; ++m) {
      const int row_low = 4 * g + m;
      const int row_high = 32 + 4 * g + m;
      const int token = nt * 8 + 2 * t;
      mine[token * WARP_N + row_low] = acc[nt][m][0];
      mine[(token + 1) * WARP_N + row_low] = acc[nt][m][1];
      mine[token * WARP_N + row_high] = acc[nt][m][2];
      mine[(token + 1) * WARP_N + row_high] = acc[nt][m][3];
    }
  __syncthreads();
  const int split = gridDim.y;
  const int outputs = min(M, NT * 8) * WARP_N;
  for (int i = threadIdx.x; i < outputs; i += blockDim.x) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += sums[w * PER_WARP + i];
    const int token = i / WARP_N;
    const int n = n0 + i % WARP_N;
    if (split == 1) {
      if (bias != nullptr) total += to_float(bias[n]);
      out[static_cast<size_t>(token) * N + n] = from_float<T>(total);
    } else {
      part[(static_cast<size_t>(blockIdx.y) * M + token) * N + n] = total;
    }
  }
  if (split == 1 || !last_to_arrive(counters + blockIdx.x, split)) return;
  for (int i = threadIdx.x; i < outputs; i += blockDim.x) {
    const int token = i / WARP_N;
    const int n = n0 + i % WARP_N;
    float total = 0.0f;
    for (int sp = 0; sp < split; ++sp) total += __ldcg(part + (static_cast<size_t>(sp) * M + token) * N + n);
    if (bias != nullptr) total += to_float(bias[n]);
    out[static_cast<size_t>(token) * N + n] = from_float<T>(total);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // the ticket left zero for the next launch
}

template <typename T, typename Z, int NT>
cudaError_t launch_typed(const void* x, const void* words, const void* scales, const void* zeros, const void* bias,
                         float* part, int* counters, void* out, int M, int N, int K, int per_split, int warps,
                         bool pdl, cudaStream_t stream) {
  const int groups = K / GROUP;
  const size_t smem = static_cast<size_t>(warps) * NT * 8 * WARP_N * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // the caller keeps 32 rows to 4 warps
  return launch_kernel(int4_mma_kernel<T, Z, NT>, dim3(N / WARP_N, (groups + per_split - 1) / per_split),
                       dim3(warps * 32), smem, pdl, stream, static_cast<const T*>(x),
                       static_cast<const uint32_t*>(words), static_cast<const T*>(scales),
                       static_cast<const Z*>(zeros), static_cast<const T*>(bias), part, counters,
                       static_cast<T*>(out), M, N, K, per_split);
}

template <typename T, typename Z>
cudaError_t launch_rows(const void* x, const void* words, const void* scales, const void* zeros, const void* bias,
                        float* part, int* counters, void* out, int M, int N, int K, int per_split, int warps,
                        bool pdl, cudaStream_t stream) {
  if (M <= 8)
    return launch_typed<T, Z, 1>(x, words, scales, zeros, bias, part, counters, out, M, N, K, per_split, warps, pdl,
                                 stream);
  if (M <= 16)
    return launch_typed<T, Z, 2>(x, words, scales, zeros, bias, part, counters, out, M, N, K, per_split, warps, pdl,
                                 stream);
  return launch_typed<T, Z, 4>(x, words, scales, zeros, bias, part, counters, out, M, N, K, per_split, warps, pdl,
                               stream);
}

}  // namespace

// dtype: 0 bf16, 1 fp16; zeros_u8: zero points held as uint8 (else in x's dtype); per_split: groups per block
// (part holds one [M, N] partial per block of an output tile when that leaves more than one); pdl: launch with
// programmatic dependent launch (sm_90 and newer). Shapes are checked by the caller.
cudaError_t questkv_int4_mma(const void* x, const void* words, const void* scales, const void* zeros,
                             const void* bias, float* part, int* counters, void* out, int M, int N, int K,
                             int per_split, int warps, int dtype, bool zeros_u8, bool pdl, cudaStream_t stream) {
  return for_int4_types(dtype, zeros_u8, [&](auto t, auto z) {
    return launch_rows<decltype(t), decltype(z)>(x, words, scales, zeros, bias, part, counters, out, M, N, K,
                                                 per_split, warps, pdl, stream);
  });
}
