// NOTE: no include guard on purpose: each fragment_<isa>.cpp includes it inside its own namespace.
// The inner loops of paged decode attention, written once with GNU vector extensions and compiled
// once per ISA: each fragment_<isa>.cpp defines PM_LANES (floats per vector) and PM_ACC_BUDGET
// (vector accumulators that fit in registers) and includes this file inside its own namespace.
//
// NOTE: why vector extensions instead of raw intrinsics: the same source lowers to zmm (AVX-512),
// ymm (AVX2) or xmm/NEON/scalar code, so every path runs the one tested algorithm; the loops are
// written lane-explicitly (no reliance on the auto-vectorizer), and `objdump -d` on the built
// module shows vfmadd231ps on zmm/ymm registers in the hot loops. Exp is a Cephes polynomial
// (~2e-7 relative error). Where GCC lowers a generic form poorly (bf16 widening), intrinsics do it.
//
// The kernel walks a fragment in steps of about kStepSlots tokens (a few blocks). Per step it
// (1) scores the query group against the K tiles [head_dim][block_size], up to 8 tiles side by
// side (4 when the group has 4+ rows: each K vector then feeds 4 rows from registers, so a GQA
// group reads and widens its K once; see score_step_nb): contiguous vector FMAs, one broadcast
// q element per row, no horizontal sums; (2) updates the running max and sum once for the whole
// step (online softmax, all rows side by side); (3) streams the V rows [block_size][head_dim] of
// all the step's blocks, slot by slot across the blocks, into register-tiled accumulators,
// folding in the rescale (bfloat16 V widened two vectors a load: load_pair).
//
// Why several tiles side by side: one sequential stream per thread does not reach the memory's
// read bandwidth, several do. Block tables scatter blocks, so the hardware prefetcher cannot
// guess the next tile: while scoring K the kernel prefetches the step's V tiles, and while
// accumulating V the next step's K tiles (at a fragment's last step, the first K tiles of the
// next fragment its thread runs: walk_offset), one line per load, spread over the loops rather
// than in a burst that would stall on fill buffers. Those prefetches go to L1 (T0) or to L2 (T1)
// by the core (kHint: attention_prefetch_target, isa_select.cpp); halving them, or prefetching
// only each tile's head, was slower or no faster in paired A/B runs (bench/attention_ab.py) on
// every machine variant measured.
//
// NOTE: tried and left out, each slower or within noise in paired A/B runs, the figures in
// docs/benchmarks/kernels.md ("Kernel design experiments"): scoring or accumulating bfloat16 with
// vdpbf16ps (it also rounds q or the probabilities to bfloat16, so the output would depend on the
// work partition), bfloat16 steps of 256 tokens, a V widening from one load on Emerald Rapids (not
// load_pair's shift and mask, which has no shuffle and gained on Zen 5), and K scored two rows a
// load by load_pair (each half of a vector one row, against q pairs: twice the accumulators per
// tile, so half the tiles side by side; slower from memory), and bfloat16 on AMX tiles (exact with
// q and the probabilities split in three bfloat16 parts; slower, even timed as if the cache were
// laid out in the tiles' pair rows: for decode's few query rows a tile load and multiply cost more
// than the FMAs they replace). What holds GQA below the read probe differs by machine: the paged
// layout's scattered tiles on one, the core's own work per K/V value (4 FMAs and the widening) and
// its line fill buffers on the other.
//
// NOTE: step size. Steps are 128 tokens (8 blocks of 16) in either dtype, 64 on AVX2
// (fragment_avx2.cpp says why). On AVX-512, bfloat16 steps of 64 tokens, with the first lines
// of the step after next's tiles prefetched to L2 to make up the shorter distance, ran slower on
// a KV pool on huge pages (host_memory.py) and on 4 KiB pages alike (bench/attention_ab.py,
// docs/benchmarks/kernels.md); that far prefetch gained nothing with 128-token steps, as it
// never did for float32, nor on AVX2's 64-token bfloat16 steps, and is gone.

// Tokens a step: kStepSlots unless the ISA's unit sets fewer (fragment_avx2.cpp says why).
#ifndef PM_STEP_SLOTS
#define PM_STEP_SLOTS kStepSlots
#endif

typedef float VecF __attribute__((vector_size(PM_LANES * 4)));
typedef int32_t VecI __attribute__((vector_size(PM_LANES * 4)));
typedef uint32_t VecU __attribute__((vector_size(PM_LANES * 4)));
typedef uint16_t VecH __attribute__((vector_size(PM_LANES * 2)));

namespace {

constexpr int kLanes = PM_LANES;
constexpr int kSteps = PM_STEP_SLOTS;
static_assert(kSteps <= kStepSlots, "the scratch holds kStepSlots scores a row");
constexpr float kMinusInf = -__builtin_inff();

inline VecF splat(float x) { return VecF{} + x; }

inline VecF load(const float* p) {
  VecF v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the high half of a float32: widen and shift, no rounding involved. The x86 forms
// fold the load into vpmovzxwd (GCC lowers the generic form to split 128-bit steps).
inline VecF load(const uint16_t* p) {
#if PM_LANES == 16 && defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (VecF)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif PM_LANES == 8 && defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (VecF)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#elif PM_LANES == 4 && defined(__SSE2__)
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (VecF)_mm_unpacklo_epi16(_mm_setzero_si128(), h);  // each half-word to the high half
#else
  VecH h;
  __builtin_memcpy(&h, p, sizeof h);
  return (VecF)(__builtin_convertvector(h, VecU) << 16);
#endif
}

inline void store(float* p, VecF v) { __builtin_memcpy(p, &v, sizeof v); }

// 2 * kLanes bfloat16 values as two vectors: the even-indexed ones and the odd-indexed ones. A
// 32-bit lane holds one pair: its low half shifted up is the even value, its high half with the
// low bits cleared the odd one. Two plain ALU ops per 2 * kLanes values, where load() spends a
// widening shuffle and a shift on each kLanes.
inline void load_pair(const uint16_t* p, VecF* even, VecF* odd) {
  VecU u;
  __builtin_memcpy(&u, p, sizeof u);
  *even = (VecF)(u << 16);
  *odd = (VecF)(u & 0xFFFF0000u);
}

// bfloat16 V accumulates each whole chunk of 2 * kLanes elements of a row as its even elements,
// then its odd ones (load_pair); this puts the `rows` rows of `acc` back in element order.
inline void interleave_pairs(float* acc, int rows, int head_dim) {
  float chunk[2 * kLanes];
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c + 2 * kLanes <= head_dim; c += 2 * kLanes) {
      float* x = acc + r * head_dim + c;
      for (int i = 0; i < 2 * kLanes; ++i) chunk[i] = x[i];
      for (int i = 0; i < kLanes; ++i) {
        x[2 * i] = chunk[i];
        x[2 * i + 1] = chunk[kLanes + i];
      }
    }
}

inline VecF vmax(VecF a, VecF b) { return a > b ? a : b; }

// A tree of halves: log2(kLanes) dependent steps, where a lane-by-lane scan takes kLanes.
inline float hmax(VecF v) {
  float x[kLanes];
  __builtin_memcpy(x, &v, sizeof x);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) x[i] = x[i + width] > x[i] ? x[i + width] : x[i];
  return x[0];
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

// Prefetches the line holding `p` if a vector load at lane offset `lanes` starts a new line.
template <int kHint, typename KV>
inline void prefetch_line(const KV* p, int lanes) {
  if ((lanes * sizeof(KV)) % 64 == 0) __builtin_prefetch(p, 0, kHint);
}

// The blocks of one step: their tiles, the next step's K tiles (to prefetch), and the slots in
// [lo, hi) (step coordinates, slot = block index * block_size + slot in block) that hold tokens.
template <typename KV>
struct Step {
  const KV* keys[kMaxStepBlocks];
  const KV* values[kMaxStepBlocks];
  const KV* next_keys[kMaxStepBlocks];  // nullptr where there is no next block
  int num_blocks, lo, hi;
};

// scores[g][n * block_size + c..] = q[g] . K_n[:, c..] for GT query rows against NB K tiles at
// once. Reading NB tiles side by side keeps NB streams of lines in flight (the blocks are scattered,
// and one stream per thread reads well below what several do); each broadcast q element feeds
// NB FMAs, and with few rows U partial sums over d keep enough independent FMA chains. With
// kAhead, prefetches the NB tiles in `prefetch` at the same offsets. A compile-time choice: tested
// per tile and per row, the null checks and their pointers spilled to the stack cost the loop
// two branches per tile and row (objdump); without them GQA bf16 ran faster in paired A/B runs.
template <int kHint, int GT, int NB, bool kAhead, typename KV>
inline void score_rows(const float* q, const KV* const* tiles, const KV* const* prefetch,
                       int head_dim, int block_size, float* scores, int stride) {
  constexpr int U = GT * NB >= 8 ? 1 : 8 / (GT * NB);
  // Local copies: the compiler cannot keep pointers read through `tiles` in registers across
  // the score stores, and reloaded and null-tested them on every row.
  const KV* tile[NB];
  const KV* ahead[NB];
  for (int n = 0; n < NB; ++n) {
    tile[n] = tiles[n];
    ahead[n] = kAhead ? prefetch[n] : nullptr;
  }
  for (int c = 0; c < block_size; c += kLanes) {
    VecF acc[U][GT][NB] = {};
    for (int d = 0; d < head_dim; d += U) {
      for (int u = 0; u < U; ++u) {
        const int64_t row = static_cast<int64_t>(d + u) * block_size + c;
        // One prefetch per line: a bf16 row of 16 slots is half a line.
        const bool line_start = (row * static_cast<int64_t>(sizeof(KV))) % 64 == 0;
        VecF k[NB];
        for (int n = 0; n < NB; ++n) k[n] = load(tile[n] + row);
        if constexpr (kAhead)
          if (line_start)
            for (int n = 0; n < NB; ++n) __builtin_prefetch(ahead[n] + row, 0, kHint);
        for (int g = 0; g < GT; ++g) {
          const float qd = q[g * head_dim + d + u];
          for (int n = 0; n < NB; ++n) acc[u][g][n] += k[n] * qd;
        }
      }
    }
    for (int g = 0; g < GT; ++g)
      for (int n = 0; n < NB; ++n) {
        for (int u = 1; u < U; ++u) acc[0][g][n] += acc[u][g][n];
        store(scores + g * stride + n * block_size + c, acc[0][g][n]);
      }
  }
}

// Rows [g, g + GT): the first rows of a tile set prefetch `prefetch` (every entry a tile).
template <int kHint, int GT, int NB, typename KV>
inline void score_rows_at(int g, const float* q, const KV* const* tiles, const KV* const* prefetch,
                          int head_dim, int block_size, float* scores, int stride) {
  if (g == 0)
    score_rows<kHint, GT, NB, true>(q, tiles, prefetch, head_dim, block_size, scores, stride);
  else
    score_rows<kHint, GT, NB, false>(q + g * head_dim, tiles, prefetch, head_dim, block_size,
                              scores + g * stride, stride);
}

// NB K tiles for all rows: GT rows at a time, as many as the accumulator budget allows.
template <int kHint, int NB, typename KV>
void score_tiles(const float* q, const KV* const* tiles, const KV* const* prefetch,
                 int group_size, int head_dim, int block_size, float* scores, int stride) {
  constexpr int kRows = PM_ACC_BUDGET / NB >= 4 ? 4 : PM_ACC_BUDGET / NB >= 2 ? 2 : 1;
  int g = 0;
  for (; g + kRows <= group_size; g += kRows)
    score_rows_at<kHint, kRows, NB>(g, q, tiles, prefetch, head_dim, block_size, scores, stride);
  if (kRows > 2 && g + 2 <= group_size) {
    score_rows_at<kHint, 2, NB>(g, q, tiles, prefetch, head_dim, block_size, scores, stride);
    g += 2;
  }
  if (g < group_size && kRows > 1)
    score_rows_at<kHint, 1, NB>(g, q, tiles, prefetch, head_dim, block_size, scores, stride);
}

// The step's tiles NB at a time. With 4+ query rows each K vector feeds 4 rows (NB = 4: 16
// accumulators), so a tile is read and widened once per 4 rows; NB = 8 with 2 rows each read
// every tile twice, the second time from L2 (8 fp32 tiles overflow L1), and bf16 tiles were
// widened twice: GQA 4:1 ran at 0.6 of MHA's bytes per second in cache. With fewer rows the
// widest NB that fits the budget keeps 8 streams of lines going.
template <int kHint, int NB, typename KV>
void score_step_nb(const float* q, const Step<KV>& step, int group_size, int head_dim,
                   int block_size, float* scores, int stride) {
  int j = 0;
  if constexpr (NB >= 8)
    for (; j + 8 <= step.num_blocks; j += 8)
      score_tiles<kHint, 8>(q, step.keys + j, step.values + j, group_size, head_dim, block_size,
                     scores + j * block_size, stride);
  if constexpr (NB >= 4)
    for (; j + 4 <= step.num_blocks; j += 4)
      score_tiles<kHint, 4>(q, step.keys + j, step.values + j, group_size, head_dim, block_size,
                     scores + j * block_size, stride);
  if constexpr (NB >= 2)
    for (; j + 2 <= step.num_blocks; j += 2)
      score_tiles<kHint, 2>(q, step.keys + j, step.values + j, group_size, head_dim, block_size,
                     scores + j * block_size, stride);
  for (; j < step.num_blocks; ++j)
    score_tiles<kHint, 1>(q, step.keys + j, step.values + j, group_size, head_dim, block_size,
                   scores + j * block_size, stride);
}

// The widest NB (8, 4, 2, 1) whose rows x NB accumulators fit the budget.
constexpr int tiles_for(int rows) {
  const int nb = PM_ACC_BUDGET / rows;
  return nb >= 8 ? 8 : nb >= 4 ? 4 : nb >= 2 ? 2 : 1;
}

template <int kHint, typename KV>
void score_step(const float* q, const Step<KV>& step, int group_size, int head_dim,
                int block_size, float* scores, int stride) {
  if (group_size >= 4)
    score_step_nb<kHint, tiles_for(4)>(q, step, group_size, head_dim, block_size, scores, stride);
  else if (group_size >= 2)
    score_step_nb<kHint, tiles_for(2)>(q, step, group_size, head_dim, block_size, scores, stride);
  else
    score_step_nb<kHint, 8>(q, step, group_size, head_dim, block_size, scores, stride);
}

// Online-softmax step for `rows` rows of `stride` scores: they become probabilities relative to
// each row's new running max, and alpha[g] is the factor that rescales row g's sums so far.
// Phase by phase over the rows (every maximum, then every rescale factor, then the exps), not row
// after row: each row is a chain of dependent steps (max -> exp -> sum), and side by side the
// rows' chains overlap. Each row's arithmetic is the same either way.
inline void softmax_step(float* scores, int rows, int stride, int lo, int hi, float* row_max,
                         float* lane_sums, float* alpha) {
  for (int g = 0; g < rows; ++g) {
    float* row = scores + g * stride;
    for (int i = 0; i < lo; ++i) row[i] = kMinusInf;  // slots outside the token range
    for (int i = hi; i < stride; ++i) row[i] = kMinusInf;
    VecF m = load(row);
    for (int c = kLanes; c < stride; c += kLanes) m = vmax(m, load(row + c));
    alpha[g] = hmax(m);  // the step's maximum, for now
  }
  for (int g = 0; g < rows; ++g) {
    const float new_max = alpha[g] > row_max[g] ? alpha[g] : row_max[g];
    alpha[g] = scalar_exp(row_max[g] - new_max);
    row_max[g] = new_max;
  }
  for (int g = 0; g < rows; ++g) {
    float* row = scores + g * stride;
    VecF sum = load(lane_sums + g * kLanes) * alpha[g];
    for (int c = 0; c < stride; c += kLanes) {
      const VecF p = vexp(load(row + c) - row_max[g]);
      store(row + c, p);
      sum += p;
    }
    store(lane_sums + g * kLanes, sum);
  }
}

// acc[g][dv : dv + VT*lanes] = acc * alpha[g] + sum over the step's slots p[g][slot] * V[slot].
// At the slots s whose bit (s % 32) is set in `prefetch_slots`, the next step's K tiles are
// prefetched at the same offsets.
// kFull > 0: the step is kFull whole blocks of tokens ([lo, hi) covers every slot), so the
// block loop has a fixed count and no per-slot range test; 0: any step.
template <int kHint, int GT, int VT, int kFull, typename KV>
inline void accumulate_rows(float* acc, const float* probs, int stride, const float* alpha,
                            const Step<KV>& step, uint32_t prefetch_slots, int head_dim,
                            int block_size,
                            int dv) {
  // bfloat16 in pairs of vectors: a[g][j] and a[g][j + 1] (j even) hold the even and the odd
  // elements of the chunk [dv + j * kLanes, dv + (j + 2) * kLanes); attend() reorders at the end.
  constexpr bool kPairs = sizeof(KV) == 2 && VT % 2 == 0;
  VecF a[GT][VT];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < VT; ++j) a[g][j] = load(acc + g * head_dim + dv + j * kLanes) * alpha[g];
  // Slot s of every block in turn, not block after block: the step's V tiles stream side by
  // side (see score_rows). Slots outside [lo, hi) hold no token of this fragment.
  for (int s = 0; s < block_size; ++s) {
    const bool prefetch = (prefetch_slots >> (s & 31)) & 1u;
    const int num_blocks = kFull > 0 ? kFull : step.num_blocks;
    for (int blk = 0; blk < num_blocks; ++blk) {
      const int slot = blk * block_size + s;
      if constexpr (kFull == 0)
        if (slot < step.lo || slot >= step.hi) continue;
      const int64_t row = static_cast<int64_t>(s) * head_dim + dv;
      const KV* v_tile = step.values[blk];
      const KV* next = prefetch ? step.next_keys[blk] : nullptr;
      VecF v[VT];
      for (int j = 0; j < VT; ++j) {
        if constexpr (kPairs) {
          if (j % 2 == 0) load_pair(v_tile + row + j * kLanes, &v[j], &v[j + 1]);
        } else {
          v[j] = load(v_tile + row + j * kLanes);
        }
        if (next != nullptr) prefetch_line<kHint>(next + row + j * kLanes, j * kLanes);
      }
      for (int g = 0; g < GT; ++g) {
        const float p = probs[g * stride + slot];
        for (int j = 0; j < VT; ++j) a[g][j] += v[j] * p;
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < VT; ++j) store(acc + g * head_dim + dv + j * kLanes, a[g][j]);
}

// GT rows: the widest VT (vectors of head_dim per row) that fits the accumulator budget, then
// narrower ones for what is left of head_dim.
template <int kHint, int GT, int kFull, typename KV>
inline void accumulate_group(float* acc, const float* probs, int stride, const float* alpha,
                             const Step<KV>& step, uint32_t prefetch, int head_dim,
                             int block_size) {
  constexpr int kFit = PM_ACC_BUDGET / GT;
  int dv = 0;
  if constexpr (kFit >= 8)
    for (; dv + 8 * kLanes <= head_dim; dv += 8 * kLanes)
      accumulate_rows<kHint, GT, 8, kFull>(acc, probs, stride, alpha, step, prefetch, head_dim,
                                    block_size, dv);
  if constexpr (kFit >= 4)
    for (; dv + 4 * kLanes <= head_dim; dv += 4 * kLanes)
      accumulate_rows<kHint, GT, 4, kFull>(acc, probs, stride, alpha, step, prefetch, head_dim,
                                    block_size, dv);
  if constexpr (kFit >= 2)
    for (; dv + 2 * kLanes <= head_dim; dv += 2 * kLanes)
      accumulate_rows<kHint, GT, 2, kFull>(acc, probs, stride, alpha, step, prefetch, head_dim,
                                    block_size, dv);
  for (; dv < head_dim; dv += kLanes)
    accumulate_rows<kHint, GT, 1, kFull>(acc, probs, stride, alpha, step, prefetch, head_dim,
                                  block_size, dv);
}

// Bit s set for the slots s in [0, 32) with s % passes == pass.
inline uint32_t slots_of_pass(int pass, int passes) {
  uint32_t mask = 0;
  for (int s = pass; s < 32; s += passes) mask |= 1u << s;
  return mask;
}

template <int kHint, int kFull, typename KV>
void accumulate_step_as(float* acc, const float* probs, int stride, const float* alpha,
                        const Step<KV>& step, int group_size, int head_dim, int block_size) {
  // V goes to 4 rows at a time (VT = 4 vectors of head_dim per pass, two passes over each row's
  // halves for head_dim 128): every V value is read from cache once per 4 rows, where rows in
  // pairs (VT = 8, whole rows in order) read the step's V twice, the second pass from L2 for a
  // float32 step (64 KiB of V), and bf16 widens each V vector once per 4 rows instead of twice.
  // Fours ran faster than pairs in paired A/B runs on both machine variants
  // (bench/attention_ab.py, GQA 4:1 float32, same bits out; docs/benchmarks/kernels.md), and bf16
  // was fours already. The next step's K is prefetched over all passes (pass i: the slots s with
  // s % passes == i): with it in the first pass only, the later passes ran with no request going
  // to memory. MHA (one row) takes none of this.
  const int fours = group_size / 4;
  const int pairs = (group_size - 4 * fours) / 2;
  const int passes = fours + pairs + (group_size - 4 * fours - 2 * pairs);
  int g = 0, pass = 0;
  for (int i = 0; i < fours; ++i, g += 4)
    accumulate_group<kHint, 4, kFull>(acc + g * head_dim, probs + g * stride, stride, alpha + g,
                                      step, slots_of_pass(pass++, passes), head_dim, block_size);
  for (int i = 0; i < pairs; ++i, g += 2)
    accumulate_group<kHint, 2, kFull>(acc + g * head_dim, probs + g * stride, stride, alpha + g,
                                      step, slots_of_pass(pass++, passes), head_dim, block_size);
  if (g < group_size)
    accumulate_group<kHint, 1, kFull>(acc + g * head_dim, probs + g * stride, stride, alpha + g,
                                      step, slots_of_pass(pass++, passes), head_dim, block_size);
}

// A step of whole blocks of tokens, as every step is but a fragment's first and last, runs the
// block loop at a fixed count (4 or 8 blocks) with no per-slot range test.
template <int kHint, typename KV>
void accumulate_step(float* acc, const float* probs, int stride, const float* alpha,
                     const Step<KV>& step, int group_size, int head_dim, int block_size) {
  const bool whole = step.lo == 0 && step.hi == step.num_blocks * block_size;
  if (whole && step.num_blocks == 4)
    accumulate_step_as<kHint, 4>(acc, probs, stride, alpha, step, group_size, head_dim, block_size);
  else if (whole && step.num_blocks == 8)
    accumulate_step_as<kHint, 8>(acc, probs, stride, alpha, step, group_size, head_dim, block_size);
  else
    accumulate_step_as<kHint, 0>(acc, probs, stride, alpha, step, group_size, head_dim, block_size);
}

// Elements from the cache's base to the tile of block b of the walk: the fragment's blocks, then,
// past block_end, the first blocks of the next fragment this thread runs (a.next_*); -1 past both.
// Why the walk goes on: without it every fragment's first step found its scattered K tiles cold,
// nothing having fetched them ahead, and with many short sequences a thread runs many fragments
// a call.
inline int64_t walk_offset(const FragmentArgs& a, int64_t b) {
  if (b < a.block_end) return a.head_tile_offset + a.block_table[b] * a.block_stride;
  const int64_t next = a.next_block_begin + (b - a.block_end);
  if (a.next_block_table == nullptr || next >= a.next_block_end) return -1;
  return a.next_head_tile_offset + a.next_block_table[next] * a.block_stride;
}

// The step starting at block b: tile pointers and the token slots it holds (keys and values: the
// caches' bases).
template <typename KV>
Step<KV> make_step(const FragmentArgs& a, const KV* keys, const KV* values, int64_t b,
                   int blocks_per_step) {
  Step<KV> step;
  const int64_t left = a.block_end - b;
  step.num_blocks = left < blocks_per_step ? static_cast<int>(left) : blocks_per_step;
  for (int j = 0; j < step.num_blocks; ++j) {
    const int64_t offset = walk_offset(a, b + j);
    step.keys[j] = keys + offset;
    step.values[j] = values + offset;
    const int64_t next = walk_offset(a, b + j + step.num_blocks);
    step.next_keys[j] = next >= 0 ? keys + next : nullptr;
  }
  const int64_t first_token = b * a.block_size;
  const int64_t end_token = first_token + step.num_blocks * a.block_size;
  step.lo = a.token_lo > first_token ? static_cast<int>(a.token_lo - first_token) : 0;
  step.hi = static_cast<int>((a.token_hi < end_token ? a.token_hi : end_token) - first_token);
  return step;
}

// kHint: the locality hint of the prefetches that bring the next tiles (3: into L1, 2: into L2).
template <typename KV, int kHint>
void attend(const FragmentArgs& a, const FragmentState& st) {
  const int G = a.group_size, D = a.head_dim, B = a.block_size;
  const int blocks_per_step = B >= kSteps ? 1 : kSteps / B;
  const int max_stride = blocks_per_step * B;
  float* alpha = st.scratch + G * max_stride;  // [G]
  float* lane_sums = alpha + G;                // [G][kLanes]
  for (int i = 0; i < G * D; ++i) st.acc[i] = 0.0f;
  for (int g = 0; g < G; ++g) st.row_max[g] = kMinusInf;
  for (int i = 0; i < G * kLanes; ++i) lane_sums[i] = 0.0f;
  const KV* keys = static_cast<const KV*>(a.key_cache);
  const KV* values = static_cast<const KV*>(a.value_cache);
  for (int64_t b = a.block_begin; b < a.block_end; b += blocks_per_step) {
    const Step<KV> step = make_step(a, keys, values, b, blocks_per_step);
    const int stride = step.num_blocks * B;
    score_step<kHint>(a.q, step, G, D, B, st.scratch, stride);
    softmax_step(st.scratch, G, stride, step.lo, step.hi, st.row_max, lane_sums, alpha);
    accumulate_step<kHint>(st.acc, st.scratch, stride, alpha, step, G, D, B);
  }
  for (int g = 0; g < G; ++g) st.row_sum[g] = hsum(load(lane_sums + g * kLanes));
  if constexpr (sizeof(KV) == 2) interleave_pairs(st.acc, G, D);
}

// silu(g) * u = g * u / (1 + exp(-g)), a vector at a time over columns [col_begin, col_end) of
// each row; exp(-g) saturates to 2^128-ish for g < -88 (the quotient is then ~0, as it should be)
// and to ~0 for large g. A column's result does not depend on the range it is computed in (the
// scalar tail runs the vector exp's polynomial too).
void silu_and_mul(const float* x, float* out, int64_t rows, int64_t inter, int64_t col_begin,
                  int64_t col_end) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * 2 * inter;
    const float* up = gate + inter;
    float* o = out + r * inter;
    int64_t i = col_begin;
    for (; i + kLanes <= col_end; i += kLanes) {
      const VecF g = load(gate + i);
      store(o + i, g * load(up + i) / (1.0f + vexp(-g)));
    }
    for (; i < col_end; ++i) o[i] = gate[i] * up[i] / (1.0f + scalar_exp(-gate[i]));
  }
}

#include "linear_kernel.h"  // the projections' GEMM (inside this unnamed namespace too)

// FirstArgmaxFn: one vector pass for each lane's maximum and whether a NaN is there (a NaN never
// replaces a lane's maximum: x > m is false), then one for the first index that holds the
// maximum (or a NaN), a block of lanes at a time. -0 and +0 compare equal, so either's first
// index is the first maximal one, as numpy's `>` scan finds it.
int64_t first_argmax(const float* row, int64_t n) {
  VecF lane_max = VecF{} + row[0];
  VecI lane_nan = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const VecF x = load(row + i);
    lane_max = x > lane_max ? x : lane_max;
    lane_nan |= x != x;
  }
  float best = row[0];
  bool nan = false;
  for (int l = 0; l < kLanes; ++l) {
    best = lane_max[l] > best ? lane_max[l] : best;
    nan |= lane_nan[l] != 0;
  }
  for (; i < n; ++i) {
    best = row[i] > best ? row[i] : best;
    nan |= row[i] != row[i];
  }
  const VecF target = VecF{} + best;
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const VecF x = load(row + k);
    const VecI hit = nan ? x != x : x == target;
    int any = 0;
    for (int l = 0; l < kLanes; ++l) any |= hit[l];
    if (any) break;
  }
  for (; k < n; ++k)
    if (nan ? row[k] != row[k] : row[k] == best) return k;
  return 0;
}

}  // namespace

// The prefetches' locality hints by PrefetchTo: 3 (T0) into L1, 2 (T1) into L2.
const IsaKernels kernels = {PM_ISA_NAME,
                            kLanes,
                            {attend<float, 3>, attend<float, 2>},
                            {attend<uint16_t, 3>, attend<uint16_t, 2>},
                            silu_and_mul,
                            linear_panels,
                            kPanelWidth,
                            call_tile_panels,
                            round_bf16_pairs,
                            first_argmax};
