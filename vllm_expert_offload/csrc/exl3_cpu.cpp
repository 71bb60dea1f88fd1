// The compiled CPU kernels: the EXL3 matmul over pointer tables (exl3_matmul.inc), the MoE forward's row steps
// (exl3_moe_rows.inc) and the encoder's Viterbi search (exl3_viterbi.inc), each compiled three times under GCC target options (AVX-512, AVX2 + FMA, and the
// x86-64 baseline) and picked at run time with __builtin_cpu_supports, so one build runs on any x86-64 CPU and
// uses what it has, instead of -march=native tying the build to the machine that compiled it. The MoE forward's
// orchestration and worker pool (exl3_moe.inc) are compiled once, calling the chosen ISA's kernels.

#include <torch/extension.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
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
#pragma GCC target("arch=x86-64-v4,avx512vbmi,avx512vnni")  // AVX-512 F/BW/CD/DQ/VL + VBMI + VNNI, AVX2, FMA
namespace avx512 {
#define EXL3_ISA 2  // GCC's target pragma does not define __AVX512F__ & co., so the .incs are told which copy they are
#include "exl3_matmul.inc"
#include "exl3_moe_rows.inc"
#include "exl3_viterbi.inc"
#undef EXL3_ISA
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")  // AVX2, FMA, BMI2
namespace avx2 {
#define EXL3_ISA 1
#include "exl3_matmul.inc"
#include "exl3_moe_rows.inc"
#include "exl3_viterbi.inc"
#undef EXL3_ISA
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace baseline {  // x86-64 SSE2 (or another CPU's default): std::fma may be a libm call, slow but exact
#define EXL3_ISA 0
#include "exl3_matmul.inc"
#include "exl3_moe_rows.inc"
#include "exl3_viterbi.inc"
#undef EXL3_ISA
}  // namespace baseline

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };
constexpr std::array<const char*, 3> kIsaNames = {"baseline", "avx2", "avx512"};

bool supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // AVX-512 without VBMI's byte permutes or VNNI's byte sums (Skylake-SP, Cascade Lake) runs the AVX2 copy
  if (isa == Isa::kAvx512) {
    return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vbmi") &&
           __builtin_cpu_supports("avx512vnni");
  }
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
  void (*matmul_block)(const MatmulArgs&, int64_t, int64_t, int64_t);
  void (*hadamard_row)(float*, int64_t, const float*, const float*);
  void (*silu_and_mul_row)(float*, const float*, int64_t, int64_t, int64_t, bool, float);
  void (*encode_tiles)(const float*, int64_t, const int32_t*, const float*, int64_t*);
  void (*codebook_states)(int, const float*, float*);
};

#define EXL3_KERNELS(ns) \
  {ns::matmul, ns::matmul_block, ns::hadamard_row, ns::silu_and_mul_row, ns::encode_tiles, ns::codebook_states}

const IsaKernels& kernels() {
  static const IsaKernels by_isa[] = {  // in Isa order
      EXL3_KERNELS(baseline),
#if defined(__x86_64__)
      EXL3_KERNELS(avx2),
      EXL3_KERNELS(avx512),
#endif
  };
  return by_isa[static_cast<int>(active_isa().load())];
}

}  // namespace

#include "exl3_moe.inc"

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

// A MoE layer for exl3_moe.inc from per-projection (gate, up, down) tables: trellis addresses (3, experts) int64,
// 2K and codebook ids (3, experts) int32, suh/svh fp32 (experts, features) stacks, the (3, 65536) codebook tables;
// the crop (hidden columns, this rank's intermediate channels [keep_lo, keep_hi)), the optional swiglu limit,
// and the pool: `threads` workers pinned round-robin to `cpus` (empty: not pinned).
std::shared_ptr<moe::Handle> exl3_moe_layer(const at::Tensor& trellis, const at::Tensor& twice_k,
                                            const at::Tensor& codebook, const std::vector<at::Tensor>& suh,
                                            const std::vector<at::Tensor>& svh, const at::Tensor& values,
                                            int64_t hidden, int64_t keep_lo, int64_t keep_hi,
                                            std::optional<double> limit, int64_t threads, std::vector<int> cpus) {
  TORCH_CHECK(trellis.scalar_type() == at::kLong && trellis.dim() == 2 && trellis.size(0) == 3,
              "trellis must be (3, experts) int64 addresses");
  const int64_t experts = trellis.size(1);
  TORCH_CHECK(experts > 0, "a MoE layer needs at least one expert");
  TORCH_CHECK(twice_k.scalar_type() == at::kInt && codebook.scalar_type() == at::kInt &&
                  twice_k.sizes() == trellis.sizes() && codebook.sizes() == trellis.sizes(),
              "twice_k and codebook must be (3, experts) int32");
  TORCH_CHECK(suh.size() == 3 && svh.size() == 3, "suh and svh need one stack per projection (gate, up, down)");
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.numel() == 3 * kStates,
              "values must be the (3, 65536) fp32 codebook tables");
  TORCH_CHECK(threads >= 1, "the MoE pool needs at least one thread, got ", threads);
  auto layer = std::make_unique<moe::Layer>();
  layer->experts = experts;
  layer->in_gu = suh[0].size(1);
  layer->out_gu = svh[0].size(1);
  layer->out_d = svh[2].size(1);
  const int64_t widths[3][2] = {{layer->in_gu, layer->out_gu}, {layer->in_gu, layer->out_gu},
                                {layer->out_gu, layer->out_d}};
  for (int p = 0; p < 3; ++p) {
    for (const at::Tensor* t : {&suh[p], &svh[p]}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == experts,
                  "suh/svh of projection ", p, " must be contiguous fp32 (experts, features)");
    }
    TORCH_CHECK(suh[p].size(1) == widths[p][0] && svh[p].size(1) == widths[p][1],
                "projection ", p, "'s suh/svh widths do not chain gate/up -> down");
    TORCH_CHECK(widths[p][0] % 128 == 0 && widths[p][1] % 128 == 0,
                "EXL3 projections are rotated in 128-blocks: projection ", p, " is ", widths[p][0], " x ",
                widths[p][1]);
    layer->suh[p] = suh[p].data_ptr<float>();
    layer->svh[p] = svh[p].data_ptr<float>();
    layer->owned.push_back(suh[p]);
    layer->owned.push_back(svh[p]);
    const at::Tensor row_t = trellis[p].contiguous(), row_k = twice_k[p].contiguous(), row_c = codebook[p].contiguous();
    layer->trellis[p].assign(row_t.data_ptr<int64_t>(), row_t.data_ptr<int64_t>() + experts);
    layer->twice_k[p].assign(row_k.data_ptr<int32_t>(), row_k.data_ptr<int32_t>() + experts);
    layer->codebook[p].assign(row_c.data_ptr<int32_t>(), row_c.data_ptr<int32_t>() + experts);
    for (int64_t e = 0; e < experts; ++e) {
      TORCH_CHECK(layer->twice_k[p][e] >= 2 && layer->twice_k[p][e] <= 16, "expert ", e, " projection ", p,
                  ": bits per weight K=", layer->twice_k[p][e] / 2.0, " is outside 1..8");
      TORCH_CHECK(layer->codebook[p][e] >= 0 && layer->codebook[p][e] <= 2, "expert ", e, " projection ", p,
                  ": unknown codebook id ", layer->codebook[p][e]);
    }
  }
  TORCH_CHECK(hidden >= 1 && hidden <= layer->in_gu, "hidden ", hidden, " does not fit the ", layer->in_gu,
              "-wide input cover");
  TORCH_CHECK(0 <= keep_lo && keep_lo < keep_hi && keep_hi <= layer->out_gu, "intermediate channels [", keep_lo,
              ", ", keep_hi, ") do not fit the ", layer->out_gu, "-wide cover");
  layer->hidden = hidden;
  layer->keep_lo = keep_lo;
  layer->keep_hi = keep_hi;
  layer->has_limit = limit.has_value();
  layer->limit = static_cast<float>(limit.value_or(0.0));
  layer->values = values.data_ptr<float>();
  layer->owned.push_back(values);
  auto handle = std::make_shared<moe::Handle>();
  handle->layer = std::move(layer);
  handle->plan = std::make_unique<moe::Plan>();
  handle->pool = moe::pool_for(static_cast<int>(threads), cpus);
  return handle;
}

// out = the layer's forward (exl3_moe.inc), run by the calling thread with the pool, without the GIL.
void exl3_moe_forward(moe::Handle& handle, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                      bool route_on_input, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat,
              "x, weights and out must be fp32");
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.is_contiguous() && weights.is_contiguous() &&
                  ids.sizes() == weights.sizes() && ids.dim() == 2,
              "topk_ids (int32) and topk_weights must be contiguous (tokens, top_k) of one shape");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  x.size(0) == ids.size(0) && out.size(0) == ids.size(0),
              "x and out must be (tokens, features) with contiguous rows, one per token of topk_ids");
  const int64_t hidden = handle.layer->hidden;
  TORCH_CHECK(x.size(1) >= hidden && out.size(1) >= hidden, "x and out need ", hidden, " columns");
  Exl3MoeJob job{};
  job.layer = &handle;
  job.x = x.data_ptr<float>();
  job.x_stride = x.stride(0);
  job.ids = ids.data_ptr<int32_t>();
  job.weights = weights.data_ptr<float>();
  job.tokens = ids.size(0);
  job.top_k = ids.size(1);
  job.route_on_input = route_on_input ? 1 : 0;
  job.out = out.data_ptr<float>();
  job.out_stride = out.stride(0);
  if (moe::run_with_caller(&job) != 0) throw std::runtime_error(job.error);
}

// Test hook: out = a @ W_hat of one matrix through the tile routine the MoE forward uses, rows in blocks of
// `rows_per_block` (1: the one-token path), single-threaded; W_hat read back from identity rows must be
// exl3/decode.py's bit for bit.
void exl3_moe_matmul(const at::Tensor& a, int64_t trellis, int64_t twice_k, int64_t codebook, int64_t size_n,
                     int64_t rows_per_block, const at::Tensor& values, at::Tensor& out) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && a.is_contiguous() &&
                  out.is_contiguous() && a.size(0) == out.size(0) && out.size(1) == size_n,
              "a and out must be contiguous fp32 (rows, size_k) and (rows, size_n)");
  TORCH_CHECK(twice_k >= 2 && twice_k <= 16 && codebook >= 0 && codebook <= 2 && rows_per_block >= 1 &&
                  rows_per_block <= moe::kBlockM && a.size(1) % 16 == 0 && size_n % 16 == 0,
              "bad K, codebook, block size or shape");
  const int64_t rows = a.size(0), blocks = (rows + rows_per_block - 1) / rows_per_block;
  std::vector<int32_t> row_ids(blocks * moe::kBlockM, -1), block_matrix(blocks, 0);
  for (int64_t r = 0; r < rows; ++r) row_ids[r / rows_per_block * moe::kBlockM + r % rows_per_block] = r;
  const int64_t table[1] = {trellis};
  const int32_t k2[1] = {static_cast<int32_t>(twice_k)}, cb[1] = {static_cast<int32_t>(codebook)};
  const MatmulArgs args{a.data_ptr<float>(), a.size(1), row_ids.data(), block_matrix.data(), blocks, table, k2, cb,
                        values.data_ptr<float>(), a.size(1), size_n, moe::kBlockM, out.data_ptr<float>(),
                        size_n, nullptr, nullptr};
  for (int64_t b = 0; b < blocks; ++b) moe::tile_matmul(args, b, 0, size_n / 16);
}

// A CUDA stream's view of a job (the CPU tier on a GPU, kernels/stream_host_tier.py): host functions of the
// cudaHostFn_t signature, void(void*), queued with cudaLaunchHostFunc, host_submit then host_wait, on a
// Exl3MoeHostJob whose rows are fixed at capture. A host function cannot report an error to CUDA, and a CUDA
// graph replays without running any Python that could check a flag, so a failed job stops the process with the
// layer named on stderr: serving the layer without these experts' sums would be a silent wrong answer.
extern "C" {
struct Exl3MoeHostJob {
  Exl3MoeJob job;
  int64_t begun_ns;  // set by host_submit (steady clock)
  int64_t busy_ns;   // host_submit to the end of host_wait, summed over this struct's jobs (the tier's busy time)
  char name[120];    // the layer, for the message of a failed job
};
}

namespace {
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void host_job_failed(const Exl3MoeHostJob& host) {
  std::fprintf(stderr,
               "vllm-expert-offload: %s: the CPU tier's host job failed: %s. A CUDA host function cannot report "
               "an error, and the layer's sum would be wrong without it: stopping the process.\n",
               host.name, host.job.error);
  std::fflush(stderr);
  std::abort();
}
}  // namespace

extern "C" void exl3_moe_host_submit(void* data) {
  auto* host = static_cast<Exl3MoeHostJob*>(data);
  host->begun_ns = steady_ns();
  if (exl3_moe_submit(&host->job) != 0) host_job_failed(*host);
}

extern "C" void exl3_moe_host_wait(void* data) {
  auto* host = static_cast<Exl3MoeHostJob*>(data);
  if (exl3_moe_wait(&host->job) != 0) host_job_failed(*host);
  host->busy_ns += steady_ns() - host->begun_ns;
}

std::vector<int64_t> exl3_moe_host_abi() {
  return {reinterpret_cast<int64_t>(&exl3_moe_host_submit), reinterpret_cast<int64_t>(&exl3_moe_host_wait),
          static_cast<int64_t>(sizeof(Exl3MoeHostJob))};
}

// Test hook: the weight each of the 65536 states decodes to under `codebook`, as the active ISA's kernels
// compute it (the SIMD copies compute the codebook instead of reading the tables: this must be the tables).
at::Tensor exl3_codebook_states(int64_t codebook, const at::Tensor& values) {
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "unknown codebook id ", codebook);
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.numel() == 3 * kStates,
              "values must be the (3, 65536) fp32 codebook tables");
  at::Tensor out = at::empty({kStates}, values.options());
  kernels().codebook_states(static_cast<int>(codebook), values.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// Test hook: the MoE forward's row rotation (hadamard_row) of every row of x in place, as the active ISA computes it,
// with suh/svh-like scales before and after (empty tensors: none).
void exl3_hadamard_rows(at::Tensor& x, const at::Tensor& scale_in, const at::Tensor& scale_out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % 128 == 0,
              "x must be contiguous fp32 (rows, a multiple of 128)");
  for (const at::Tensor* scale : {&scale_in, &scale_out}) {
    TORCH_CHECK(scale->numel() == 0 || (scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                                        scale->numel() == x.size(1)),
                "a scale must be empty or contiguous fp32 of x's width");
  }
  const float* in = scale_in.numel() ? scale_in.data_ptr<float>() : nullptr;
  const float* out = scale_out.numel() ? scale_out.data_ptr<float>() : nullptr;
  float* rows = x.data_ptr<float>();
  for (int64_t r = 0; r < x.size(0); ++r) kernels().hadamard_row(rows + r * x.size(1), x.size(1), in, out);
}

// The C ABI's entry points, for callers without Python (a CUDA host function): their addresses, the job
// struct's size, and the handle of a layer.
std::vector<int64_t> exl3_moe_abi() {
  return {reinterpret_cast<int64_t>(&exl3_moe_submit), reinterpret_cast<int64_t>(&exl3_moe_wait),
          static_cast<int64_t>(sizeof(Exl3MoeJob))};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exl3_matmul_cpu", &exl3_matmul_cpu, "EXL3 matmul over a pointer table on the CPU");
  m.def("exl3_viterbi_cpu", &exl3_viterbi_cpu, py::call_guard<py::gil_scoped_release>(),
        "Tail-biting Viterbi trellis states for (tiles, 256) fp32 targets, as exl3/encode.py's torch encoder");
  m.def("exl3_cpu_isa", &exl3_cpu_isa, "The instruction set the kernels run with: avx512, avx2 or baseline");
  m.def("exl3_set_cpu_isa", &exl3_set_cpu_isa, "Run the kernels with another instruction set the CPU supports");
  py::class_<moe::Handle, std::shared_ptr<moe::Handle>>(m, "MoeLayer")
      .def_property_readonly("address", [](moe::Handle& h) { return reinterpret_cast<int64_t>(&h); },
                             "what Exl3MoeJob.layer takes")
      .def_property_readonly("threads", [](moe::Handle& h) { return h.pool->threads(); });
  m.def("exl3_moe_layer", &exl3_moe_layer, "A MoE layer over pointer tables, computed by a persistent pool");
  m.def("exl3_moe_forward", &exl3_moe_forward, py::call_guard<py::gil_scoped_release>(),
        "The layer's routed-expert forward for a batch (ids -1 skipped), fp32");
  m.def("exl3_moe_matmul", &exl3_moe_matmul, "Test hook: a @ W_hat through the MoE forward's tile routine");
  m.def("exl3_codebook_states", &exl3_codebook_states, "Test hook: every state's weight under one codebook");
  m.def("exl3_hadamard_rows", &exl3_hadamard_rows, "Test hook: the MoE forward's row rotation, in place");
  m.def("exl3_moe_abi", &exl3_moe_abi, "(exl3_moe_submit address, exl3_moe_wait address, sizeof(Exl3MoeJob))");
  m.def("exl3_moe_host_abi", &exl3_moe_host_abi,
        "(exl3_moe_host_submit address, exl3_moe_host_wait address, sizeof(Exl3MoeHostJob)): cudaHostFn_t's");
}
