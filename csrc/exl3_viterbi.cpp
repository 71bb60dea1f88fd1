// The EXL3 no-Hessian encoder's trellis search on the CPU: the compiled twin of _tail_biting_viterbi in
// vllm_expert_offload/exl3/encode.py, one 16x16 tile per OpenMP task.
//
// Its output must equal the torch encoder's bit for bit, so every float operation repeats the torch one:
// a state's cost is fma(value, -2x, value^2) + edge_cost (torch.addcmul is one fused multiply-add on the
// AVX2/AVX-512 CPUs torch vectorises for, then add_), all in fp32; an edge keeps the cheapest of its
// predecessors with ties to the largest top bits and NaN propagating as amin does; the final state is the
// first minimum, a NaN counting as the minimum, as torch.argmin. Costs omit x^2, as the reference does.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int kStateBits = 16;
constexpr int kStates = 1 << kStateBits;
constexpr int kPositions = 256;
constexpr int kPass1Rotation = kPositions / 2;  // encode.py PASS1_ROTATION
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Workspace {
  // Two cost rows swapped per position, the per-edge minima, and one backpointer row per position >= 1 sized
  // for the largest edge count (D = 1), so fractional K's mixed D needs no offsets table.
  std::vector<float> cost = std::vector<float>(kStates), spare = std::vector<float>(kStates);
  std::vector<float> edge = std::vector<float>(kStates / 2);
  std::vector<uint8_t> back = std::vector<uint8_t>(static_cast<size_t>(kPositions - 1) * (kStates / 2));
  int64_t states[kPositions];
};

// out[s] = fma(values[s], x2, squares[s]) + edge[s >> D]: states (e << D) | code share the edge e.
template <int D>
void add_position_cost(float* out, const float* edge, const float* values, const float* squares, float x2) {
  constexpr int codes = 1 << D, edges = kStates >> D;
  for (int e = 0; e < edges; ++e) {
    const float base = edge[e];
#pragma omp simd
    for (int c = 0; c < codes; ++c) {
      const int s = e * codes + c;
      out[s] = std::fma(values[s], x2, squares[s]) + base;
    }
  }
}

// edge[e] = min over t of cost[t * 2^(16-D) + e] and back[e] = its t (largest on ties; NaN and t = 0 when any
// is NaN), as encode.py's _edge_min. Rows of the cost are walked in order so the e loop vectorises.
template <int D>
void edge_min(const float* cost, float* edge, uint8_t* back) {
  constexpr int tops = 1 << D, edges = kStates >> D;
  for (int e = 0; e < edges; ++e) {
    edge[e] = cost[e];
    back[e] = 0;
  }
  for (int t = 1; t < tops; ++t) {
    const float* row = cost + t * edges;
#pragma omp simd
    for (int e = 0; e < edges; ++e) {
      const float c = row[e];
      const bool take = c <= edge[e] || c != c;  // once NaN, edge[e] stays NaN: nothing compares <= it
      edge[e] = take ? c : edge[e];
      back[e] = take ? static_cast<uint8_t>(t) : back[e];
    }
  }
  for (int e = 0; e < edges; ++e) back[e] = edge[e] != edge[e] ? 0 : back[e];
}

template <int D>
void step(const float* cost, float* next, float* edge, uint8_t* back, const float* values, const float* squares,
          float x2) {
  edge_min<D>(cost, edge, back);
  add_position_cost<D>(next, edge, values, squares, x2);
}

using StepFn = void (*)(const float*, float*, float*, uint8_t*, const float*, const float*, float);
using AddFn = void (*)(float*, const float*, const float*, const float*, float);
constexpr StepFn kSteps[9] = {nullptr, step<1>, step<2>, step<3>, step<4>, step<5>, step<6>, step<7>, step<8>};
constexpr AddFn kAdds[9] = {nullptr, add_position_cost<1>, add_position_cost<2>, add_position_cost<3>,
                            add_position_cost<4>, add_position_cost<5>, add_position_cost<6>,
                            add_position_cost<7>, add_position_cost<8>};

// First index of the minimum of v[i * stride], i < n, a NaN counting as smaller than everything (torch.argmin).
int first_argmin(const float* v, int n, int stride) {
  int best = 0;
  for (int i = 0; i < n; ++i) {
    const float c = v[i * stride];
    if (c != c) return i;
    if (c < v[best * stride]) best = i;
  }
  return best;
}

// encode.py's _viterbi over one tile: x and bits in the pass's position order; start_edge < 0 leaves both
// ends free, else forces position 0's edge and closes the ring on it. Writes ws.states.
void viterbi_pass(const float* x, const int32_t* bits, int start_edge, const float* values, const float* squares,
                  Workspace& ws) {
  float* cost = ws.cost.data();
  float* spare = ws.spare.data();
  const int start_edges = kStates >> bits[0];
  for (int e = 0; e < start_edges; ++e) ws.edge[e] = start_edge < 0 || e == start_edge ? 0.0f : INFINITY;
  kAdds[bits[0]](cost, ws.edge.data(), values, squares, -2.0f * x[0]);
  for (int i = 1; i < kPositions; ++i) {
    uint8_t* back = ws.back.data() + static_cast<size_t>(i - 1) * (kStates / 2);
    kSteps[bits[i]](cost, spare, ws.edge.data(), back, values, squares, -2.0f * x[i]);
    std::swap(cost, spare);
  }
  int64_t state = start_edge < 0 ? first_argmin(cost, kStates, 1)
                                 : static_cast<int64_t>(first_argmin(cost + start_edge, 1 << bits[0], start_edges)) *
                                           start_edges + start_edge;
  ws.states[kPositions - 1] = state;
  for (int i = kPositions - 1; i > 0; --i) {
    const int64_t edge = state >> bits[i];
    const int64_t top = ws.back[static_cast<size_t>(i - 1) * (kStates / 2) + edge];
    state = (top << (kStateBits - bits[i])) | edge;
    ws.states[i - 1] = state;
  }
}

// encode.py's _tail_biting_viterbi: a free pass over the ring rotated by half finds position 0's in-edge, the
// second pass starts on it and closes the ring.
void encode_tile(const float* x, const int32_t* bits, const float* values, const float* squares, Workspace& ws,
                 int64_t* out) {
  float rotated_x[kPositions];
  int32_t rotated_bits[kPositions];
  for (int i = 0; i < kPositions; ++i) {
    rotated_x[i] = x[(i + kPass1Rotation) % kPositions];
    rotated_bits[i] = bits[(i + kPass1Rotation) % kPositions];
  }
  viterbi_pass(rotated_x, rotated_bits, -1, values, squares, ws);
  const int start_edge = static_cast<int>(ws.states[kPositions - kPass1Rotation] >> bits[0]);
  viterbi_pass(x, bits, start_edge, values, squares, ws);
  std::copy(ws.states, ws.states + kPositions, out);
}

}  // namespace

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
  const float* x = targets.data_ptr<float>();
  const float* values_data = values.data_ptr<float>();
  int64_t* out_data = out.data_ptr<int64_t>();
  std::vector<float> squares(kStates);
  for (int s = 0; s < kStates; ++s) squares[s] = values_data[s] * values_data[s];  // exact: fp16 values

#pragma omp parallel
  {
    Workspace ws;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; ++t) {
      encode_tile(x + t * kPositions, bits_data, values_data, squares.data(), ws, out_data + t * kPositions);
    }
  }
  return out;
}
