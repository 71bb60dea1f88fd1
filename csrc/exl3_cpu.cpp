// EXL3 matmul over pointer tables on the CPU: out[row] = a[row] @ W_hat[matrix of row's block].
//
// The CPU twin of kernels/triton_exl3.py, with the same contract (rows grouped into blocks that share one
// matrix of a table; K and codebook per matrix). Each task owns one (block, 16-column tile) pair and walks
// the input dimension one 16x16 tile at a time: the tile is decoded into a 1 KiB stack buffer (exl3-format.md
// §2.3-2.7: 16-bit window of the MSB-first ring spanning two 16-bit units, tail-biting, half-integer K,
// tensor-core permutation) and
// multiplied into the block's rows at once, so nothing decoded outlives one tile and each tile is decoded once
// per block of rows. Codebook values come from the (3, 65536) fp32 tables the Python reference defines
// (exl3/codebook.py), so decoded weights equal the reference bit for bit. Tasks are spread over OpenMP
// threads; the inner 16-wide loops are left to the compiler's vectoriser (built with -march=native on the
// machine that runs it, so AVX2 or AVX-512 as the CPU has them).

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <vector>

namespace {

constexpr int kPositions = 256;

struct RingLayout {
  // Indexed by tile element (16 * row + column), so a tile is written in order: the two 16-bit units of the
  // MSB-first stream that element's state window spans (already in storage order, unit u at int16 u ^ 1) and
  // the right shift of their 32-bit merge that aligns the window.
  std::array<int32_t, kPositions> first{}, second{}, shift{};
};

RingLayout make_layout(int twice_k) {
  RingLayout layout;
  const int k_int = twice_k / 2, k_half = twice_k % 2;
  const int units = 16 * k_int + 8 * k_half;  // int16 per tile = 16 K
  const int ring = 16 * units;                 // 256 K bits
  int end = 0;
  for (int p = 0; p < kPositions; ++p) {
    end += k_int + (k_half && (p & 1));  // D(p): KA, plus one on odd positions for K = KA + 1/2
    const int start = ((end - 16) % ring + ring) % ring;
    const int t = p / 8, j = p % 8;
    const int r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1);
    const int c = t / 4 + 8 * ((j >> 2) & 1);
    const int element = 16 * r + c;
    layout.first[element] = (start / 16) ^ 1;
    layout.second[element] = ((start / 16 + 1) % units) ^ 1;
    layout.shift[element] = 16 - start % 16;
  }
  return layout;
}

const RingLayout& layout_for(int twice_k) {
  static const std::array<RingLayout, 17> layouts = [] {
    std::array<RingLayout, 17> all{};
    for (int tk = 2; tk <= 16; ++tk) all[tk] = make_layout(tk);
    return all;
  }();
  TORCH_CHECK(twice_k >= 2 && twice_k <= 16, "EXL3 bits per weight K=", twice_k / 2.0, " is outside 1..8");
  return layouts[twice_k];
}

inline void decode_tile(const int16_t* packed, const RingLayout& layout, const float* values, float* tile) {
  // Written as one flat loop over elements so the compiler can vectorise it (gathers on AVX-512/AVX2).
  for (int e = 0; e < kPositions; ++e) {
    const uint32_t hi = static_cast<uint16_t>(packed[layout.first[e]]);
    const uint32_t lo = static_cast<uint16_t>(packed[layout.second[e]]);
    tile[e] = values[(((hi << 16) | lo) >> layout.shift[e]) & 0xFFFF];
  }
}

}  // namespace

void exl3_matmul_cpu(const at::Tensor& a, const at::Tensor& row_ids, const at::Tensor& block_matrix,
                     const at::Tensor& trellis_table, const at::Tensor& twice_k_table,
                     const at::Tensor& codebook_table, const at::Tensor& codebook_values, int64_t size_k,
                     int64_t size_n, int64_t block_m, at::Tensor& out) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "a and out must be float32");
  TORCH_CHECK(a.stride(1) == 1 && out.stride(1) == 1, "a and out need a contiguous last dimension");
  TORCH_CHECK(a.size(1) == size_k && out.size(1) == size_n, "a / out widths do not match the table's matrices");
  TORCH_CHECK(row_ids.scalar_type() == at::kInt && block_matrix.scalar_type() == at::kInt, "row ids must be int32");
  TORCH_CHECK(row_ids.numel() == block_matrix.numel() * block_m, "row_ids must hold block_m entries per block");
  TORCH_CHECK(codebook_values.scalar_type() == at::kFloat && codebook_values.size(1) == 65536,
              "codebook_values must be (3, 65536) float32");
  TORCH_CHECK(size_k % 16 == 0 && size_n % 16 == 0, "EXL3 matrices are made of 16x16 tiles");
  const int64_t blocks = block_matrix.numel(), tiles_n = size_n / 16, tiles_k = size_k / 16;
  const float* a_data = a.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t a_stride = a.stride(0), out_stride = out.stride(0);
  const int32_t* rows_data = row_ids.data_ptr<int32_t>();
  const int32_t* matrix_data = block_matrix.data_ptr<int32_t>();
  const int64_t* trellis_data = trellis_table.data_ptr<int64_t>();
  const int32_t* twice_k_data = twice_k_table.data_ptr<int32_t>();
  const int32_t* codebook_data = codebook_table.data_ptr<int32_t>();
  const float* values_data = codebook_values.data_ptr<float>();

#pragma omp parallel for schedule(dynamic, 1) collapse(2)
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t tj = 0; tj < tiles_n; ++tj) {
      const int32_t matrix = matrix_data[block];
      if (matrix < 0) continue;
      const int32_t* rows = rows_data + block * block_m;
      int64_t count = 0;
      while (count < block_m && rows[count] >= 0) ++count;  // a block's rows are packed at its front
      if (count == 0) continue;
      const int twice_k = twice_k_data[matrix];
      const RingLayout& layout = layout_for(twice_k);
      const int units = 8 * twice_k;  // int16 per tile
      const int16_t* trellis = reinterpret_cast<const int16_t*>(trellis_data[matrix]);
      const float* values = values_data + 65536 * static_cast<int64_t>(codebook_data[matrix]);
      std::vector<float> acc(count * 16, 0.0f);
      alignas(64) float tile[kPositions];
      for (int64_t ti = 0; ti < tiles_k; ++ti) {
        decode_tile(trellis + (ti * tiles_n + tj) * units, layout, values, tile);
        for (int64_t m = 0; m < count; ++m) {
          const float* x = a_data + rows[m] * a_stride + ti * 16;
          float* y = acc.data() + m * 16;
          for (int r = 0; r < 16; ++r) {
            const float xr = x[r];
#pragma omp simd
            for (int c = 0; c < 16; ++c) y[c] += xr * tile[16 * r + c];
          }
        }
      }
      for (int64_t m = 0; m < count; ++m) {
        float* dst = out_data + rows[m] * out_stride + tj * 16;
        for (int c = 0; c < 16; ++c) dst[c] = acc[m * 16 + c];
      }
    }
  }
}

// csrc/exl3_viterbi.cpp
at::Tensor exl3_viterbi_cpu(const at::Tensor& targets, const at::Tensor& bits, const at::Tensor& values);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exl3_matmul_cpu", &exl3_matmul_cpu, "EXL3 matmul over a pointer table on the CPU");
  m.def("exl3_viterbi_cpu", &exl3_viterbi_cpu, py::call_guard<py::gil_scoped_release>(),
        "Tail-biting Viterbi trellis states for (tiles, 256) fp32 targets, as exl3/encode.py's torch encoder");
}
