// NOTE: no include guard on purpose: each fragment_<isa>.cpp includes this inside its own namespace.
// The inner loops of paged decode attention, written once with GNU vector extensions and compiled
// once per ISA: each fragment_<isa>.cpp defines PM_LANES (floats per vector) and PM_ACC_BUDGET
// (vector accumulators that fit in registers) and includes this file inside its own namespace.
//
// NOTE: why vector extensions instead of raw intrinsics: the same source lowers to zmm (AVX-512),
// ymm (AVX2) or xmm/NEON/scalar code, so every path runs the one tested algorithm; the loops are
// written lane-explicitly (no reliance on the auto-vectorizer), and `objdump -d` on the built module
// shows vfmadd231ps on zmm/ymm registers in the hot loops. Exp is a Cephes polynomial (~2e-7 rel).
//
// Per block the kernel (1) scores the query group against the K tile [head_dim][block_size], a
// sequence of contiguous vector FMAs with one broadcast q element per row and no horizontal sums;
// (2) updates the running max and sum (online softmax); (3) folds the rescale into the value pass,
// which streams V rows [block_size][head_dim] into register-tiled accumulators. The next block's
// tiles are prefetched while the current one is computed: block tables scatter blocks, so the
// hardware prefetcher cannot guess the next address.

typedef float VecF __attribute__((vector_size(PM_LANES * 4)));
typedef int32_t VecI __attribute__((vector_size(PM_LANES * 4)));
typedef uint32_t VecU __attribute__((vector_size(PM_LANES * 4)));
typedef uint16_t VecH __attribute__((vector_size(PM_LANES * 2)));

namespace {

constexpr int kLanes = PM_LANES;
constexpr float kMinusInf = -__builtin_inff();

inline VecF splat(float x) { return VecF{} + x; }

inline VecF load(const float* p) {
  VecF v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the high half of a float32: widen and shift, no rounding involved.
inline VecF load(const uint16_t* p) {
  VecH h;
  __builtin_memcpy(&h, p, sizeof h);
  return (VecF)(__builtin_convertvector(h, VecU) << 16);
}

inline void store(float* p, VecF v) { __builtin_memcpy(p, &v, sizeof v); }

inline VecF vmax(VecF a, VecF b) { return a > b ? a : b; }

inline float hmax(VecF v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum(VecF v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp(x) for x <= 88; inputs below -87.3 (including -inf) give 2^-126, which is 0 for every sum
// here because each row's running maximum contributes exp(0) = 1.
inline VecF vexp(VecF x) {
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = vmax(x, splat(-87.33654f));
  x = x > 88.0f ? splat(88.0f) : x;
  const VecF t = x * 1.44269504088896341f + kRound;
  const VecF n = t - kRound;
  VecF r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VecF y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const VecI exponent = ((VecI)t - (VecI)splat(kRound) + 127) << 23;
  return y * (VecF)exponent;
}

inline float scalar_exp(float x) { return vexp(splat(x))[0]; }

template <typename KV>
inline void prefetch_tile(const KV* tile, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(tile);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(KV));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// scores[g][slot] = q[g] . K[:, slot] for GT query rows; K tile is [head_dim][block_size].
// With few rows, U independent partial sums over d keep the FMA pipes busy (no long chain).
template <int GT, typename KV>
inline void score_rows(const float* q, const KV* k_tile, int head_dim, int block_size,
                       float* scores) {
  constexpr int U = GT >= 4 ? 1 : 4 / GT;
  for (int c = 0; c < block_size; c += kLanes) {
    VecF acc[GT][U] = {};
    const KV* k_col = k_tile + c;
    for (int d = 0; d < head_dim; d += U) {
      for (int u = 0; u < U; ++u) {
        const VecF k = load(k_col + static_cast<int64_t>(d + u) * block_size);
        for (int g = 0; g < GT; ++g) acc[g][u] += k * q[g * head_dim + d + u];
      }
    }
    for (int g = 0; g < GT; ++g) {
      for (int u = 1; u < U; ++u) acc[g][0] += acc[g][u];
      store(scores + g * block_size + c, acc[g][0]);
    }
  }
}

template <typename KV>
void score_block(const float* q, const KV* k_tile, int group_size, int head_dim, int block_size,
                 float* scores) {
  int g = 0;
  for (; g + 8 <= group_size; g += 8)
    score_rows<8>(q + g * head_dim, k_tile, head_dim, block_size, scores + g * block_size);
  if (g + 4 <= group_size) {
    score_rows<4>(q + g * head_dim, k_tile, head_dim, block_size, scores + g * block_size);
    g += 4;
  }
  if (g + 2 <= group_size) {
    score_rows<2>(q + g * head_dim, k_tile, head_dim, block_size, scores + g * block_size);
    g += 2;
  }
  if (g < group_size)
    score_rows<1>(q + g * head_dim, k_tile, head_dim, block_size, scores + g * block_size);
}

// Online-softmax step for one row: scores become probabilities relative to the new max;
// returns the factor that rescales everything accumulated so far.
inline float softmax_row(float* scores, int block_size, int lo, int hi, float* row_max,
                         float* lane_sum) {
  for (int i = 0; i < lo; ++i) scores[i] = kMinusInf;  // slots outside the token range
  for (int i = hi; i < block_size; ++i) scores[i] = kMinusInf;
  VecF m = load(scores);
  for (int c = kLanes; c < block_size; c += kLanes) m = vmax(m, load(scores + c));
  const float block_max = hmax(m);
  const float new_max = block_max > *row_max ? block_max : *row_max;
  const float alpha = scalar_exp(*row_max - new_max);
  *row_max = new_max;
  VecF sum = load(lane_sum) * alpha;
  for (int c = 0; c < block_size; c += kLanes) {
    const VecF p = vexp(load(scores + c) - new_max);
    store(scores + c, p);
    sum += p;
  }
  store(lane_sum, sum);
  return alpha;
}

// acc[g][dv : dv + VT*lanes] = acc * alpha[g] + sum over slots p[g][slot] * V[slot][...].
template <int GT, int VT, typename KV>
inline void accumulate_rows(float* acc, const float* probs, const float* alpha, const KV* v_tile,
                            int head_dim, int block_size, int lo, int hi, int dv) {
  VecF a[GT][VT];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < VT; ++j) a[g][j] = load(acc + g * head_dim + dv + j * kLanes) * alpha[g];
  for (int slot = lo; slot < hi; ++slot) {
    const KV* v_row = v_tile + static_cast<int64_t>(slot) * head_dim + dv;
    VecF v[VT];
    for (int j = 0; j < VT; ++j) v[j] = load(v_row + j * kLanes);
    for (int g = 0; g < GT; ++g) {
      const float p = probs[g * block_size + slot];
      for (int j = 0; j < VT; ++j) a[g][j] += v[j] * p;
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < VT; ++j) store(acc + g * head_dim + dv + j * kLanes, a[g][j]);
}

// Register tile for GT rows: the widest VT (vectors of head_dim per row) that fits the
// accumulator budget, then narrower ones for what is left of head_dim.
template <int GT, typename KV>
inline void accumulate_group(float* acc, const float* probs, const float* alpha, const KV* v_tile,
                             int head_dim, int block_size, int lo, int hi) {
  constexpr int kFit = PM_ACC_BUDGET / GT;
  int dv = 0;
  if constexpr (kFit >= 8)
    for (; dv + 8 * kLanes <= head_dim; dv += 8 * kLanes)
      accumulate_rows<GT, 8>(acc, probs, alpha, v_tile, head_dim, block_size, lo, hi, dv);
  if constexpr (kFit >= 4)
    for (; dv + 4 * kLanes <= head_dim; dv += 4 * kLanes)
      accumulate_rows<GT, 4>(acc, probs, alpha, v_tile, head_dim, block_size, lo, hi, dv);
  if constexpr (kFit >= 2)
    for (; dv + 2 * kLanes <= head_dim; dv += 2 * kLanes)
      accumulate_rows<GT, 2>(acc, probs, alpha, v_tile, head_dim, block_size, lo, hi, dv);
  for (; dv < head_dim; dv += kLanes)
    accumulate_rows<GT, 1>(acc, probs, alpha, v_tile, head_dim, block_size, lo, hi, dv);
}

template <typename KV>
void accumulate_block(float* acc, const float* probs, const float* alpha, const KV* v_tile,
                      int group_size, int head_dim, int block_size, int lo, int hi) {
  int g = 0;
  for (; g + 4 <= group_size; g += 4)
    accumulate_group<4>(acc + g * head_dim, probs + g * block_size, alpha + g, v_tile, head_dim,
                        block_size, lo, hi);
  if (g + 2 <= group_size) {
    accumulate_group<2>(acc + g * head_dim, probs + g * block_size, alpha + g, v_tile, head_dim,
                        block_size, lo, hi);
    g += 2;
  }
  if (g < group_size)
    accumulate_group<1>(acc + g * head_dim, probs + g * block_size, alpha + g, v_tile, head_dim,
                        block_size, lo, hi);
}

template <typename KV>
void attend(const FragmentArgs& a, const FragmentState& st) {
  const int G = a.group_size, D = a.head_dim, B = a.block_size;
  float* alpha = st.scratch + G * B;    // [G]
  float* lane_sums = alpha + G;         // [G][kLanes]
  for (int i = 0; i < G * D; ++i) st.acc[i] = 0.0f;
  for (int g = 0; g < G; ++g) st.row_max[g] = kMinusInf;
  for (int i = 0; i < G * kLanes; ++i) lane_sums[i] = 0.0f;
  const KV* keys = static_cast<const KV*>(a.key_cache) + a.head_tile_offset;
  const KV* values = static_cast<const KV*>(a.value_cache) + a.head_tile_offset;
  const int64_t tile = static_cast<int64_t>(D) * B;
  for (int64_t b = a.block_begin; b < a.block_end; ++b) {
    const int64_t block_offset = a.block_table[b] * a.block_stride;
    if (b + 1 < a.block_end) {
      const int64_t next_offset = a.block_table[b + 1] * a.block_stride;
      prefetch_tile(keys + next_offset, tile);
      prefetch_tile(values + next_offset, tile);
    }
    const int64_t first_token = b * B;
    const int lo = a.token_lo > first_token ? static_cast<int>(a.token_lo - first_token) : 0;
    const int hi = a.token_hi < first_token + B ? static_cast<int>(a.token_hi - first_token) : B;
    score_block(a.q, keys + block_offset, G, D, B, st.scratch);
    for (int g = 0; g < G; ++g)
      alpha[g] = softmax_row(st.scratch + g * B, B, lo, hi, st.row_max + g, lane_sums + g * kLanes);
    accumulate_block(st.acc, st.scratch, alpha, values + block_offset, G, D, B, lo, hi);
  }
  for (int g = 0; g < G; ++g) st.row_sum[g] = hsum(load(lane_sums + g * kLanes));
}

}  // namespace

const IsaKernels kernels = {PM_ISA_NAME, kLanes, attend<float>, attend<uint16_t>};
