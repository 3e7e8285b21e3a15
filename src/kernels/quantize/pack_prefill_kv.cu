#include "kernels/quantize/pack_prefill_kv.h"

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "speedmla/decode.h"
#include "speedmla/prefill.h"

namespace speedmla::kernels {
namespace {

constexpr int kNopeDim = kPrefillQkDim - kRopeDim;  // 128: k_out[..., 0:128] from k_nope

// Elements per work item on the vector path: 16 FP8 (one 16-byte store) or 16 BF16 (two).
constexpr int kVectorChunk = 16;

// Work items of pack_rows_kernel: the chunks of kChunk elements of each (token, head) row, k_out's
// (k_nope, then k_rope) then v_out's. With v_out transposed (PrefillValueLayout::kFp8Transposed)
// the rows are k_out's alone, and pack_transposed_values_kernel has one item per (head, 16-token
// group, kTransposedDims value dims): two launches, so that the row kernel keeps its occupancy
// (the transposed items hold 60 registers a thread; in one kernel the k rows ran 1.2x slower).
template <int kChunk>
__host__ __device__ constexpr int chunks_per_row(bool v_out_transposed) {
  return (kPrefillQkDim + (v_out_transposed ? 0 : kPrefillVDim)) / kChunk;
}
// Value dims per transposed item: 8 on the vector path (16 bytes of a BF16 token row: a warp's
// 16 lanes read a head's whole 256-byte row), 4 on the scalar path (element by element).
template <int kChunk>
inline constexpr int kTransposedDims = kChunk == 1 ? 4 : 8;
template <int kChunk>
__host__ __device__ inline int64_t transposed_value_items(const PackPrefillKvParams& p) {
  if (!p.v_out_transposed) return 0;
  return p.num_heads * (fp8_transposed_value_positions(p.num_tokens) / kFp8TransposedGroupTokens) *
         (kPrefillVDim / kTransposedDims<kChunk>);
}
template <int kChunk>
__host__ __device__ inline int64_t row_items(const PackPrefillKvParams& p) {
  return p.num_tokens * p.num_heads * chunks_per_row<kChunk>(p.v_out_transposed);
}

// The byte permutes below put position 4q + 2a + b of a group at token 8a + 2q + b.
constexpr bool transposed_positions_as_permuted() {
  for (int p = 0; p < kFp8TransposedGroupTokens; ++p)
    if (fp8_transposed_value_token(p) != 8 * ((p % 4) / 2) + 2 * (p / 4) + p % 2) return false;
  return true;
}
static_assert(transposed_positions_as_permuted(), "the layout's positions changed: update the byte permutes");

// One (head, 16-token group, kDims value dims) of transposed values: the group's 16 token rows
// read kDims values each and turned into FP8 (4 a word), byte-transposed in registers, then per
// dim one 16-byte store of its 16 positions. Pieces of a dim range fastest, then groups: lanes
// 16 apart write a dim's two neighbouring groups, one whole 32-byte sector. Tokens past
// num_tokens give zeros.
template <int kDims, bool kVectorLoads>
__device__ __forceinline__ void pack_transposed_values(const PackPrefillKvParams& p, int64_t item) {
  constexpr int kPieces = kPrefillVDim / kDims, kWords = kDims / 4;
  const int64_t groups = fp8_transposed_value_positions(p.num_tokens) / kFp8TransposedGroupTokens;
  const int d0 = static_cast<int>(item % kPieces) * kDims;
  const int64_t group = (item / kPieces) % groups, h = item / kPieces / groups;
  uint32_t rows[kFp8TransposedGroupTokens][kWords];  // token k's dims d0 + 4w .. + 3 in rows[k][w]
#pragma unroll
  for (int k = 0; k < kFp8TransposedGroupTokens; ++k) {
    const int64_t t = kFp8TransposedGroupTokens * group + k;
    float values[kDims] = {};
    if (t < p.num_tokens) {
      const int64_t offset = t * p.v_stride_token + h * p.v_stride_head + d0;
      if constexpr (kVectorLoads) {
        load_floats(p.v, p.v_dtype, offset, values);
      } else {
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
          float value[1];
          load_floats(p.v, p.v_dtype, offset + i, value);
          values[i] = value[0];
        }
      }
      // Scaled here, not below: padding must stay +0, which a negative scale would flip to -0.
#pragma unroll
      for (float& value : values) value *= p.v_scale_inv;
    }
    pack_words<fp8_e4m3>(values, rows[k]);
  }
  // Word q of dim 4w + b: byte b of the words w of tokens 2q, 2q + 1, 8 + 2q, 9 + 2q.
  uint32_t dims[kDims][4];
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t near_low = __byte_perm(rows[2 * q][w], rows[2 * q + 1][w], 0x5140);  // bytes 0, 1
      const uint32_t near_high = __byte_perm(rows[2 * q][w], rows[2 * q + 1][w], 0x7362);  // bytes 2, 3
      const uint32_t far_low = __byte_perm(rows[8 + 2 * q][w], rows[9 + 2 * q][w], 0x5140);
      const uint32_t far_high = __byte_perm(rows[8 + 2 * q][w], rows[9 + 2 * q][w], 0x7362);
      dims[4 * w + 0][q] = __byte_perm(near_low, far_low, 0x5410);
      dims[4 * w + 1][q] = __byte_perm(near_low, far_low, 0x7632);
      dims[4 * w + 2][q] = __byte_perm(near_high, far_high, 0x5410);
      dims[4 * w + 3][q] = __byte_perm(near_high, far_high, 0x7632);
    }
  }
  fp8_e4m3* dst = static_cast<fp8_e4m3*>(p.v_out) + h * p.v_out_stride_head + kFp8TransposedGroupTokens * group;
#pragma unroll
  for (int j = 0; j < kDims; ++j)
    store_global_16(reinterpret_cast<uint4*>(dst + (d0 + j) * p.v_out_stride_dim),
                    make_uint4(dims[j][0], dims[j][1], dims[j][2], dims[j][3]));
}

template <typename OutT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    pack_rows_kernel(const PackPrefillKvParams p) {
  constexpr int kNopeChunks = kNopeDim / kChunk;
  constexpr int kKChunks = kPrefillQkDim / kChunk;
  const int row_chunks = chunks_per_row<kChunk>(p.v_out_transposed);
  const int64_t items = row_items<kChunk>(p);
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    const int64_t row = i / row_chunks;
    const int chunk = static_cast<int>(i % row_chunks);
    const int64_t t = row / p.num_heads, h = row % p.num_heads;
    float values[kChunk];
    float scale;
    OutT* dst;
    if (chunk < kKChunks) {
      const int column = chunk * kChunk;
      if (chunk < kNopeChunks)
        load_floats(p.k_nope, p.k_nope_dtype,
                    t * p.k_nope_stride_token + h * p.k_nope_stride_head + column, values);
      else
        load_floats(p.k_rope, p.k_rope_dtype, t * p.k_rope_stride_token + column - kNopeDim,
                    values);
      scale = p.k_scale_inv;
      dst = static_cast<OutT*>(p.k_out) + t * p.k_out_stride_token + h * p.k_out_stride_head + column;
    } else {
      const int column = (chunk - kKChunks) * kChunk;
      load_floats(p.v, p.v_dtype, t * p.v_stride_token + h * p.v_stride_head + column, values);
      scale = p.v_scale_inv;
      dst = static_cast<OutT*>(p.v_out) + t * p.v_out_stride_token + h * p.v_out_stride_head + column;
    }
#pragma unroll
    for (float& v : values) v *= scale;
    store_floats(dst, values);
  }
}

template <int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    pack_transposed_values_kernel(const PackPrefillKvParams p) {
  const int64_t items = transposed_value_items<kChunk>(p);
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count())
    pack_transposed_values<kTransposedDims<kChunk>, (kChunk > 1)>(p, i);
}

// The token-major rows, then the transposed values (none unless v_out is transposed).
template <typename OutT, int kChunk>
void launch_kernels(const PackPrefillKvParams& p, Stream stream) {
  launch_elementwise(pack_rows_kernel<OutT, kChunk>, row_items<kChunk>(p), p, stream);
  launch_elementwise(pack_transposed_values_kernel<kChunk>, transposed_value_items<kChunk>(p), p, stream);
}

template <typename OutT>
void launch(const PackPrefillKvParams& p, Stream stream) {
  const bool vectors =
      aligned16(p.k_nope, p.k_nope_dtype, {p.k_nope_stride_token, p.k_nope_stride_head}) &&
      aligned16(p.k_rope, p.k_rope_dtype, {p.k_rope_stride_token}) &&
      aligned16(p.k_out, p.out_dtype, {p.k_out_stride_token, p.k_out_stride_head}) &&
      aligned16(p.v, p.v_dtype, {p.v_stride_token, p.v_stride_head}) &&
      (p.v_out_transposed || aligned16(p.v_out, p.out_dtype, {p.v_out_stride_token, p.v_out_stride_head}));
  if (vectors)
    launch_kernels<OutT, kVectorChunk>(p, stream);
  else
    launch_kernels<OutT, 1>(p, stream);
}

}  // namespace

void run_pack_prefill_kv(const PackPrefillKvParams& params, Stream stream) {
  if (params.out_dtype == DType::kFloat8E4M3)
    launch<fp8_e4m3>(params, stream);
  else
    launch<bf16>(params, stream);
}

}  // namespace speedmla::kernels
