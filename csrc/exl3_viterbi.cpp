// The EXL3 no-Hessian encoder's trellis search on the CPU: the compiled twin of _tail_biting_viterbi in
// vllm_expert_offload/exl3/encode.py, one 16x16 tile per OpenMP task.
//
// Its output must equal the torch encoder's bit for bit, so every float operation repeats the torch one:
// a state's cost is fma(value, -2x, value^2) + edge_cost (torch.addcmul is one fused multiply-add on the
// AVX2/AVX-512 CPUs torch vectorises for, then add_), all in fp32; an edge keeps the cheapest of its
// predecessors with ties to the largest top bits and NaN propagating as amin does; the final state is the
// first minimum, a NaN counting as the minimum, as torch.argmin. Costs omit x^2, as the reference does.

#include <torch/extension.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int kStateBits = 16;
constexpr int kStates = 1 << kStateBits;
constexpr int kPositions = 256;
constexpr int kPass1Rotation = kPositions / 2;  // encode.py PASS1_ROTATION
constexpr int kLanes = 16;                      // edges one block keeps in registers (GCC vector extension)

using Floats = float __attribute__((vector_size(kLanes * sizeof(float))));
using Ints = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

struct Workspace {
  // Per-edge minima of the previous and current position (kLanes of padding: a block loads a whole vector
  // from its last edge), and one backpointer row per position >= 1 sized for the largest edge count (D = 1),
  // so fractional K's mixed D needs no offsets table.
  std::vector<float> edge = std::vector<float>(kStates / 2 + kLanes);
  std::vector<float> next_edge = std::vector<float>(kStates / 2 + kLanes);
  std::vector<uint8_t> back = std::vector<uint8_t>(static_cast<size_t>(kPositions - 1) * (kStates / 2));
  int64_t states[kPositions];
};

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The reference's cost of state s at a position: addcmul(values^2, values, -2x) + edge cost of s's edge.
// value^2 is exact for fp16 values, so squaring here equals the reference's precomputed squares.
inline float state_cost(float value, float x2, float edge) { return std::fma(value, x2, value * value) + edge; }

inline Floats state_costs(Floats values, float x2, Floats edges) {
  Floats fused;
  for (int l = 0; l < kLanes; ++l) fused[l] = std::fma(values[l], x2, values[l] * values[l]);  // vfmadd
  return fused + edges;
}

struct Values {
  // The codebook values by state, and for each D in use blocked so that a block of kLanes edges finds its
  // states t * 2^(16-D) + e0 + l, all t, in one contiguous run: blocked[D][e0 * 2^D + t * kLanes + l]. Rows
  // 2^(18-D) bytes apart would share L1 sets and evict each other (D = 4 ran at half speed).
  const float* by_state;
  std::array<std::vector<float>, 9> blocked;
};

Values blocked_values(const float* by_state, const int32_t* bits) {
  Values values{by_state, {}};
  for (int i = 0; i < kPositions; ++i) {
    const int d = bits[i], tops = 1 << d, edges = kStates >> d;
    std::vector<float>& block = values.blocked[d];
    if (!block.empty()) continue;
    block.resize(kStates);
    for (int t = 0; t < tops; ++t) {
      for (int e = 0; e < edges; ++e) {
        block[e / kLanes * kLanes * tops + t * kLanes + e % kLanes] = by_state[t * edges + e];
      }
    }
  }
  return values;
}

// Targets at most this large keep every cost finite or +inf (256 positions of |v^2 - 2xv| with |v| < 4 stay far
// below FLT_MAX), so no inf - inf and no NaN: such tiles skip the NaN bookkeeping, about 15 % of a step.
constexpr float kNoNaNTarget = 1e30f;

// The running minimum of kLanes edges over candidates in increasing t: ties go to the later t, and a NaN
// anywhere makes the edge NaN with t = 0 (encode.py's _edge_min: amin, then the largest t equal to it).
template <bool kMayNaN>
struct LaneMin {
  Floats best = Floats{} + INFINITY;
  Ints arg = {}, nan = {};  // NaN is tracked beside the compare-select chain, which sets the loop's latency

  void add(Floats cost, int t) {
    const Ints take = cost <= best;
    best = take ? cost : best;
    arg = take ? Ints{} + t : arg;
    if constexpr (kMayNaN) nan |= cost != cost;
  }

  // Folds in a minimum over later t than all of this one's.
  void merge_later(const LaneMin<kMayNaN>& later) {
    const Ints take = later.best <= best;
    best = take ? later.best : best;
    arg = take ? later.arg : arg;
    nan |= later.nan;
  }

  void store(float* edge, uint8_t* back) const {
    const Floats out = nan ? Floats{} + NAN : best;
    const Ints out_arg = nan ? Ints{} : arg;
    std::memcpy(edge, &out, sizeof out);
    for (int l = 0; l < kLanes; ++l) back[l] = static_cast<uint8_t>(out_arg[l]);
  }
};

// One trellis position, never materialising its 65536 costs: state s = t * 2^(16-D) + e of the previous
// position (whose own edge is s >> Dp) costs state_cost(values[s], x2, prev_edge[s >> Dp]), and edge[e] keeps
// the minimum over t with back[e] = its t. A block of kLanes edges walks all t with its minima in registers,
// the lower and upper half of t in two chains so their compare latencies overlap; its states' previous edges
// are one vector load permuted by lane >> Dp (a broadcast for Dp >= 4).
template <int Dp, int D, bool kMayNaN>
void step(const float* prev_edge, float x2, const float* blocked_values, float* edge, uint8_t* back) {
  constexpr int tops = 1 << D, half = tops / 2, edges = kStates >> D;
  Ints lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  const Ints spread = lane >> Dp;
  const auto cost = [&](int e0, int t) {
    const Floats edges_in = __builtin_shuffle(load(prev_edge + ((t * edges + e0) >> Dp)), spread);
    return state_costs(load(blocked_values + e0 * tops + t * kLanes), x2, edges_in);
  };
  for (int e0 = 0; e0 < edges; e0 += kLanes) {
    LaneMin<kMayNaN> low, high;
    for (int t = 0; t < half; ++t) {
      low.add(cost(e0, t), t);
      high.add(cost(e0, t + half), t + half);
    }
    low.merge_later(high);
    low.store(edge + e0, back + e0);
  }
}

using StepFn = void (*)(const float*, float, const float*, float*, uint8_t*);

template <int... I>
constexpr std::array<StepFn, sizeof...(I)> step_table(std::integer_sequence<int, I...>) {
  return {{&step<I / 8 % 8 + 1, I % 8 + 1, (I >= 64)>...}};
}
constexpr auto kSteps = step_table(std::make_integer_sequence<int, 128>{});  // [64 * may_nan + 8 * (Dp-1) + D-1]

// First index of the minimum of the last position's costs over states first + i * stride, i < n, a NaN
// counting as smaller than everything (torch.argmin).
int64_t last_argmin(const float* edge, int d, float x2, const float* values, int64_t first, int n, int stride) {
  int64_t best = 0;
  float best_cost = 0.0f;
  for (int i = 0; i < n; ++i) {
    const int64_t s = first + static_cast<int64_t>(i) * stride;
    const float c = state_cost(values[s], x2, edge[s >> d]);
    if (c != c) return i;
    if (i == 0 || c < best_cost) best = i, best_cost = c;
  }
  return best;
}

// encode.py's _viterbi over one tile: x and bits in the pass's position order; start_edge < 0 leaves both
// ends free, else forces position 0's edge and closes the ring on it. Writes ws.states.
void viterbi_pass(const float* x, const int32_t* bits, int start_edge, bool may_nan, const Values& values,
                  Workspace& ws) {
  float* edge = ws.edge.data();
  float* next = ws.next_edge.data();
  const int start_edges = kStates >> bits[0];
  for (int e = 0; e < start_edges; ++e) edge[e] = start_edge < 0 || e == start_edge ? 0.0f : INFINITY;
  for (int i = 1; i < kPositions; ++i) {
    uint8_t* back = ws.back.data() + static_cast<size_t>(i - 1) * (kStates / 2);
    const StepFn step_fn = kSteps[64 * may_nan + 8 * (bits[i - 1] - 1) + bits[i] - 1];
    step_fn(edge, -2.0f * x[i - 1], values.blocked[bits[i]].data(), next, back);
    std::swap(edge, next);
  }
  const int d_last = bits[kPositions - 1];
  const float x2_last = -2.0f * x[kPositions - 1];
  int64_t state = start_edge < 0
                      ? last_argmin(edge, d_last, x2_last, values.by_state, 0, kStates, 1)
                      : last_argmin(edge, d_last, x2_last, values.by_state, start_edge, 1 << bits[0], start_edges) *
                                start_edges + start_edge;
  ws.states[kPositions - 1] = state;
  for (int i = kPositions - 1; i > 0; --i) {
    const int64_t e = state >> bits[i];
    const int64_t top = ws.back[static_cast<size_t>(i - 1) * (kStates / 2) + e];
    state = (top << (kStateBits - bits[i])) | e;
    ws.states[i - 1] = state;
  }
}

// encode.py's _tail_biting_viterbi: a free pass over the ring rotated by half finds position 0's in-edge, the
// second pass starts on it and closes the ring.
void encode_tile(const float* x, const int32_t* bits, const Values& values, Workspace& ws, int64_t* out) {
  float rotated_x[kPositions];
  int32_t rotated_bits[kPositions];
  for (int i = 0; i < kPositions; ++i) {
    rotated_x[i] = x[(i + kPass1Rotation) % kPositions];
    rotated_bits[i] = bits[(i + kPass1Rotation) % kPositions];
  }
  bool may_nan = false;
  for (int i = 0; i < kPositions; ++i) may_nan |= !(std::fabs(x[i]) <= kNoNaNTarget);
  viterbi_pass(rotated_x, rotated_bits, -1, may_nan, values, ws);
  const int start_edge = static_cast<int>(ws.states[kPositions - kPass1Rotation] >> bits[0]);
  viterbi_pass(x, bits, start_edge, may_nan, values, ws);
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
  const Values blocked = blocked_values(values.data_ptr<float>(), bits_data);
  int64_t* out_data = out.data_ptr<int64_t>();

#pragma omp parallel
  {
    Workspace ws;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; ++t) {
      encode_tile(x + t * kPositions, bits_data, blocked, ws, out_data + t * kPositions);
    }
  }
  return out;
}
