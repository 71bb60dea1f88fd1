// The compiled CPU kernels: the EXL3 matmul over pointer tables (exl3_matmul.inc) and the encoder's Viterbi
// search (exl3_viterbi.inc), each compiled three times under GCC target options (AVX-512, AVX2 + FMA, and the
// x86-64 baseline) and picked at run time with __builtin_cpu_supports, so one build runs on any x86-64 CPU and
// uses what it has, instead of -march=native tying the build to the machine that compiled it.

#include <torch/extension.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

constexpr int kPositions = 256;  // weights per 16x16 tile
constexpr int kStates = 1 << 16;  // trellis states, codebook entries

struct MatmulArgs {
  const float* a;
  int64_t a_stride;
  const int32_t* row_ids;
  const int32_t* block_matrix;
  int64_t blocks;
  const int64_t* trellis;
  const int32_t* twice_k;
  const int32_t* codebook;
  const float* values;
  int64_t size_k, size_n, block_m;
  float* out;
  int64_t out_stride;
  // Write-through fill (nullptr: none): fill[matrix] != 0 is where that matrix's trellis is also stored, word for
  // word as it is read, by the one block fill_block[matrix] (its first), so each word is written once per launch.
  const int64_t* fill;
  const int64_t* fill_block;
};

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")  // AVX-512 F/BW/CD/DQ/VL, AVX2, FMA
namespace avx512 {
#define EXL3_ISA 2  // GCC's target pragma does not define __AVX512F__ & co., so the .inc is told which copy it is
#include "exl3_matmul.inc"
#undef EXL3_ISA
#include "exl3_viterbi.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")  // AVX2, FMA, BMI2
namespace avx2 {
#define EXL3_ISA 1
#include "exl3_matmul.inc"
#undef EXL3_ISA
#include "exl3_viterbi.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace baseline {  // x86-64 SSE2 (or another CPU's default): std::fma may be a libm call, slow but exact
#define EXL3_ISA 0
#include "exl3_matmul.inc"
#undef EXL3_ISA
#include "exl3_viterbi.inc"
}  // namespace baseline

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };
constexpr std::array<const char*, 3> kIsaNames = {"baseline", "avx2", "avx512"};

bool supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == Isa::kAvx512) return __builtin_cpu_supports("x86-64-v4");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("x86-64-v3");
#endif
  return isa == Isa::kBaseline;
}

std::atomic<Isa>& active_isa() {
  static std::atomic<Isa> isa{supported(Isa::kAvx512) ? Isa::kAvx512
                              : supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kBaseline};
  return isa;
}

struct IsaKernels {
  void (*matmul)(const MatmulArgs&);
  void (*encode_tiles)(const float*, int64_t, const int32_t*, const float*, int64_t*);
};

const IsaKernels& kernels() {
  static const IsaKernels by_isa[] = {  // in Isa order
      {baseline::matmul, baseline::encode_tiles},
#if defined(__x86_64__)
      {avx2::matmul, avx2::encode_tiles},
      {avx512::matmul, avx512::encode_tiles},
#endif
  };
  return by_isa[static_cast<int>(active_isa().load())];
}

}  // namespace

std::string exl3_cpu_isa() { return kIsaNames[static_cast<int>(active_isa().load())]; }

// Tests run every path the CPU supports against the same references; a path the CPU lacks is refused.
std::string exl3_set_cpu_isa(const std::string& name) {
  const auto found = std::find(kIsaNames.begin(), kIsaNames.end(), name);
  TORCH_CHECK(found != kIsaNames.end(), "unknown ISA '", name, "': expected baseline, avx2 or avx512");
  const Isa isa = static_cast<Isa>(found - kIsaNames.begin());
  TORCH_CHECK(supported(isa), "this CPU does not support the ", name, " kernels");
  active_isa().store(isa);
  return name;
}

void exl3_matmul_cpu(const at::Tensor& a, const at::Tensor& row_ids, const at::Tensor& block_matrix,
                     const at::Tensor& trellis_table, const at::Tensor& twice_k_table,
                     const at::Tensor& codebook_table, const at::Tensor& codebook_values, int64_t size_k,
                     int64_t size_n, int64_t block_m, at::Tensor& out, const std::optional<at::Tensor>& fill) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "a and out must be float32");
  TORCH_CHECK(a.stride(1) == 1 && out.stride(1) == 1, "a and out need a contiguous last dimension");
  TORCH_CHECK(a.size(1) == size_k && out.size(1) == size_n, "a / out widths do not match the table's matrices");
  TORCH_CHECK(row_ids.scalar_type() == at::kInt && block_matrix.scalar_type() == at::kInt, "row ids must be int32");
  TORCH_CHECK(row_ids.numel() == block_matrix.numel() * block_m, "row_ids must hold block_m entries per block");
  TORCH_CHECK(codebook_values.scalar_type() == at::kFloat && codebook_values.size(1) == kStates,
              "codebook_values must be (3, 65536) float32");
  TORCH_CHECK(size_k % 16 == 0 && size_n % 16 == 0, "EXL3 matrices are made of 16x16 tiles");
  std::vector<int64_t> fill_block;
  const int64_t* fill_data = nullptr;
  if (fill.has_value()) {
    TORCH_CHECK(fill->scalar_type() == at::kLong && fill->is_contiguous() && fill->numel() == trellis_table.numel(),
                "fill must be a contiguous int64 table with one entry per matrix of the trellis table");
    fill_data = fill->data_ptr<int64_t>();
    fill_block.assign(trellis_table.numel(), -1);  // the first block that reads each matrix writes its fill
    const int32_t* matrices = block_matrix.data_ptr<int32_t>();
    const int32_t* rows = row_ids.data_ptr<int32_t>();
    for (int64_t block = 0; block < block_matrix.numel(); ++block) {
      const int32_t matrix = matrices[block];
      if (matrix >= 0 && rows[block * block_m] >= 0 && fill_block[matrix] < 0) fill_block[matrix] = block;
    }
  }
  const MatmulArgs args{a.data_ptr<float>(), a.stride(0), row_ids.data_ptr<int32_t>(),
                        block_matrix.data_ptr<int32_t>(), block_matrix.numel(), trellis_table.data_ptr<int64_t>(),
                        twice_k_table.data_ptr<int32_t>(), codebook_table.data_ptr<int32_t>(),
                        codebook_values.data_ptr<float>(), size_k, size_n, block_m, out.data_ptr<float>(),
                        out.stride(0), fill_data, fill_block.empty() ? nullptr : fill_block.data()};
  kernels().matmul(args);
}

at::Tensor exl3_viterbi_cpu(const at::Tensor& targets, const at::Tensor& bits, const at::Tensor& values) {
  TORCH_CHECK(targets.scalar_type() == at::kFloat && targets.dim() == 2 && targets.size(1) == kPositions &&
                  targets.is_contiguous(),
              "targets must be contiguous (tiles, 256) float32");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.numel() == kPositions && bits.is_contiguous(),
              "bits must be 256 contiguous int32");
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.numel() == kStates && values.is_contiguous(),
              "values must be the 65536 contiguous float32 codebook values");
  const int32_t* bits_data = bits.data_ptr<int32_t>();
  for (int i = 0; i < kPositions; ++i) {
    TORCH_CHECK(bits_data[i] >= 1 && bits_data[i] <= 8, "position bits must lie in 1..8, got ", bits_data[i]);
  }
  const int64_t tiles = targets.size(0);
  at::Tensor out = at::empty({tiles, kPositions}, targets.options().dtype(at::kLong));
  kernels().encode_tiles(targets.data_ptr<float>(), tiles, bits_data, values.data_ptr<float>(),
                         out.data_ptr<int64_t>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exl3_matmul_cpu", &exl3_matmul_cpu, "EXL3 matmul over a pointer table on the CPU");
  m.def("exl3_viterbi_cpu", &exl3_viterbi_cpu, py::call_guard<py::gil_scoped_release>(),
        "Tail-biting Viterbi trellis states for (tiles, 256) fp32 targets, as exl3/encode.py's torch encoder");
  m.def("exl3_cpu_isa", &exl3_cpu_isa, "The instruction set the kernels run with: avx512, avx2 or baseline");
  m.def("exl3_set_cpu_isa", &exl3_set_cpu_isa, "Run the kernels with another instruction set the CPU supports");
}
