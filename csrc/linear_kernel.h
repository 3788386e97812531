// NOTE: no include guard on purpose: fragment_kernel.h includes it inside each ISA's namespace,
// after its vector types (VecF, kLanes) and before the ISA's kernel table.
//
// The model's projections at decode shapes: out[r, c] = sum_k x[r, k] * w[c, k] (+ residual[r, c])
// on a weight packed once into column panels (common/model/linear.py packs; linear.cpp threads).
//
// NOTE: why a GEMM of our own. oneDNN through torch (`mkldnn._linear_pointwise` on a reordered
// weight) pays a fixed cost per call whatever the size, larger than its own exec at decode
// shapes: its primitive descriptor, attributes and scratchpad are made again on every call (perf:
// malloc, dnnl_primitive_attr_create, memory_desc_init). A tiny-model decode step makes 17 such
// calls. MKL's sgemm is cheap to call, but the rows of
// a call of 10 rows or fewer are not bitwise the rows of a larger call (it changes kernels), so a
// request's greedy tokens would depend on how many others share its step. Here every output is
// one FMA chain over k in order, whatever the row tiling, the thread split or the row count: a
// row's result depends on that row and the weight alone, by construction.
//
// Layout: panel p holds columns [p * W, p * W + W) (W = kPanelVecs * kLanes) as [K][W] weights
// (column c of the panel at offset k * W + c); the last panel is zero-padded. A tile of R rows
// keeps R x kPanelVecs accumulators in registers over the whole of K: each k loads the panel's
// W weights once and broadcasts one x value per row. Tiles walk a thread's panels row chunk by row
// chunk, so a chunk of x (64 rows) stays in L1/L2 while its panels stream by, and it prefetches
// the panel a few KiB ahead. A call of fewer rows than a full tile (decode at batch 1-3) reads
// several panels side by side (`tile_panels`): one row in one panel is only kPanelVecs FMA chains,
// and each k then waited on the last FMA's result whatever the weight's dtype, which held a
// one-row call from cache to about float32's time per k in bfloat16 and int8 too (half their
// bytes' rate; paired figures in docs/benchmarks/engine.md, `bench/linear_ab.py`).
//
// At decode shapes it is faster than oneDNN through torch and MKL's F.linear per call, at prefill
// sizes at oneDNN's rate (the inner loop is 12 broadcasts and 24 FMAs on zmm registers per k, no
// spills); the per-shape figures are in docs/benchmarks/kernels.md ("Kernel design experiments").
// bench/engine.py runs the engine on both side by side (`kernel_vs_onednn`).

// Low-precision weights (WeightDtype): the same panels, the same tiles and the same FMA chain
// over k, the weight widened to float32 on load (bfloat16: shift, exact; int8: sign-extend and
// convert, exact) and, for int8, each column's sum times its scale once at the end. bfloat16
// panels hold rows k and k + 1 in pairs (pack_panels): one load gives both rows' vectors by a
// shift and a mask, where a row alone costs a widening shuffle per vector on a port the FMAs
// share; at 32 rows, where the FMAs hold the tile, that is the difference (bench/linear_ab.py).
// Activations stay float32 by default: at decode row counts a projection is mostly held by the
// weight's bytes, so fewer bytes per weight is the gain, and no activation is rounded.
//
// Bfloat16 products (WeightDtype::kBfloat16Products, matmul precision "medium"): at 32 rows the
// tile is held by its FMAs, not by the weight's bytes, and bfloat16 panels cost float32's FMAs.
// There x is rounded to bfloat16 once per call (round_bf16_pairs), and a pair of k costs one
// vdpbf16ps per accumulator where it cost two FMAs and a widening: twice the products per
// instruction on a core that issues vdpbf16ps at the FMAs' rate. Each output is still its
// own chain over k in order, with x rounded per row, so a row's bits still depend on that row and
// the weight alone, at every row count. Where the CPU lacks AVX512_BF16 the same arithmetic runs
// as FMAs: a bfloat16 product is exact in float32, so an FMA of it rounds once as vdpbf16ps's add
// does, and each pair takes k + 1's product first, as vdpbf16ps does (its denormals flush to zero,
// the FMAs' do not: the only difference). NOTE: it is not the default: it rounds x, and on a
// core that issues vdpbf16ps on one port it ran slower than widening and FMAs on two
// (docs/benchmarks/kernels.md, "Kernel design experiments").

constexpr int kPanelVecs = 2;
constexpr int kPanelWidth = kPanelVecs * kLanes;
// Bytes of panel read ahead of use, 4 KiB: a weight streams from memory at decode sizes, and at 8
// or 32 rows a tile's FMAs between loads leave too few reads in flight without it (slower than
// oneDNN without it, well faster with it, against oneDNN in the same run).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kRowChunk = 64;

typedef int8_t VecB __attribute__((vector_size(PM_LANES)));

// The GEMM's element tag for bfloat16 panels times bfloat16-rounded x (kBfloat16Products): its
// panels are stored as the bfloat16 ones are (Elem<Bf16Products> is uint16_t).
struct Bf16Products {};
template <typename W>
struct PanelElem {
  using type = W;
};
template <>
struct PanelElem<Bf16Products> {
  using type = uint16_t;
};
template <typename W>
using Elem = typename PanelElem<W>::type;

inline float bits_to_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// x pair k / 2 of a row as two floats: element k (the low half) and k + 1.
inline void x_pair(uint32_t pair, float* even, float* odd) {
  *even = bits_to_float(pair << 16);
  *odd = bits_to_float(pair & 0xFFFF0000u);
}

// Rounds float32 bits to bfloat16 bits, to the nearest with ties to even; a NaN stays a (quiet)
// NaN, where the rounding's carry would turn some into infinity.
inline VecU bf16_bits(VecU u) {
  const VecU rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded;
}

void round_bf16_pairs(const float* x, int64_t rows, int64_t in, int64_t x_stride,
                      uint32_t* out) {
  const int64_t pairs = (in + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * x_stride;
    char* o = reinterpret_cast<char*>(out + r * pairs);  // bfloat16 k at byte 2 * k
    int64_t k = 0;
    for (; k + kLanes <= in; k += kLanes) {
      VecU u;
      __builtin_memcpy(&u, row + k, sizeof u);
      const VecH h = __builtin_convertvector(bf16_bits(u), VecH);
      __builtin_memcpy(o + 2 * k, &h, sizeof h);
    }
    for (; k < in; ++k) {
      uint32_t u;
      __builtin_memcpy(&u, row + k, sizeof u);
      const uint16_t h = static_cast<uint16_t>(bf16_bits(VecU{} + u)[0]);
      __builtin_memcpy(o + 2 * k, &h, sizeof h);
    }
    if (in % 2) __builtin_memset(o + 2 * in, 0, 2);
  }
}

inline VecF load_panel_vec(const float* p) { return load(p); }
inline VecF load_panel_vec(const uint16_t* p) { return load(p); }  // bfloat16
inline VecF load_panel_vec(const int8_t* p) {
#if PM_LANES == 16 && defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#elif PM_LANES == 8 && defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#elif PM_LANES == 4 && defined(__SSE2__)
  // SSE2 has no sign-extending load (the generic form, lowered a byte at a time, ran at 0.4x
  // this): each byte into the top of its 32-bit lane, then an arithmetic shift down.
  int32_t word;
  __builtin_memcpy(&word, p, sizeof word);
  __m128i b = _mm_cvtsi32_si128(word);
  b = _mm_unpacklo_epi8(b, b);
  b = _mm_unpacklo_epi16(b, b);
  return (VecF)_mm_cvtepi32_ps(_mm_srai_epi32(b, 24));
#else
  VecB b;
  __builtin_memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, VecF);
#endif
}

// An output vector from its accumulator: times the int8 scale, plus the residual, each case one
// expression. NOTE: why: under -ffp-contract=fast the compiler fuses y * scale + res into one FMA
// or not per code path, and a scalar loop over the partly filled last panel came out fused in one
// tile size and not in another (AVX2, int8 with a residual): a row's last-panel columns then
// differed in the last bit between a call of one row and a batch. One vector expression per case,
// and the partial panel through the same vectors, give every tile size the same operations.
inline VecF finish(VecF y, const float* scale, const float* res, int offset) {
  if (scale && res) return y * load(scale + offset) + load(res + offset);
  if (scale) return y * load(scale + offset);
  if (res) return y + load(res + offset);
  return y;
}

// Panels a tile of R rows reads side by side: R x panels x kPanelVecs FMA chains, enough of them
// (PM_TILE_CHAINS) that a chain's FMA latency does not hold the loop. One row alone has only
// kPanelVecs chains in one panel: a one-row call then waited on each FMA's result, which left the
// int8 and bfloat16 GEMV below the memory's rate (their weights arrive faster than the chains take
// them). Each output is still its own FMA chain over k in order, so the bits do not depend on it.
constexpr int kMaxTilePanels = 4;
constexpr int tile_panels(int64_t rows) {
  const int64_t p = PM_TILE_CHAINS / (rows * kPanelVecs);
  return p < 1 ? 1 : p > kMaxTilePanels ? kMaxTilePanels : static_cast<int>(p);
}

// Writes a tile's accumulators: R rows x P panels from column `col` on, the last panel's
// `last_cols` columns only (the weight's last panel may be partly filled).
template <int R, int P>
inline void store_tile(const LinearArgs& a, int64_t row, int64_t col, int last_cols,
                       VecF (&acc)[R][P][kPanelVecs]) {
  const float* scales = a.scales ? a.scales + col : nullptr;  // int8 only: padded to the panels
  for (int p = 0; p < P; ++p) {
    const int cols = p == P - 1 ? last_cols : kPanelWidth;
    const int64_t c0 = p * kPanelWidth;
    const float* scale = scales ? scales + c0 : nullptr;
    for (int r = 0; r < R; ++r) {
      float* out = a.out + (row + r) * a.out_stride + col + c0;
      const float* res = a.residual ? a.residual + (row + r) * a.res_stride + col + c0 : nullptr;
      if (cols == kPanelWidth) {
        for (int v = 0; v < kPanelVecs; ++v)
          store(out + v * kLanes, finish(acc[r][p][v], scale, res, v * kLanes));
      } else {  // the weight's last, partly filled panel: the same vector steps on padded copies
        float res_row[kPanelWidth] = {}, tmp[kPanelWidth];
        if (res) __builtin_memcpy(res_row, res, cols * sizeof(float));
        for (int v = 0; v < kPanelVecs; ++v)
          store(tmp + v * kLanes, finish(acc[r][p][v], scale, res ? res_row : nullptr, v * kLanes));
        __builtin_memcpy(out, tmp, cols * sizeof(float));
      }
    }
  }
}

// An odd K's last row, unpaired in bfloat16 panels: the plain [W] row the panel ends with, times
// x's last element (float32, or rounded to bfloat16 for Bf16Products).
template <typename W, int R, int P>
inline void odd_k_row(const LinearArgs& a, int64_t row, const Elem<W>* panel, int64_t k,
                      VecF (&acc)[R][P][kPanelVecs]) {
  const int64_t panel_stride = a.in_features * kPanelWidth;
  const int64_t pairs = (a.in_features + 1) / 2;
  for (int p = 0; p < P; ++p) {
    const Elem<W>* w_k = panel + p * panel_stride + k * kPanelWidth;
    for (int v = 0; v < kPanelVecs; ++v) {
      const VecF w = load_panel_vec(w_k + v * kLanes);
      for (int r = 0; r < R; ++r) {
        // The rounded x: the last pair's low half (its high half is the zero pad).
        const float xk = std::is_same_v<W, Bf16Products>
                             ? bits_to_float(a.x_pairs[(row + r) * pairs + k / 2] << 16)
                             : a.x[(row + r) * a.x_stride + k];
        acc[r][p][v] += w * xk;
      }
    }
  }
}

// R rows x P panels (panels `panel` + i * panel_stride) of outputs, from column `col` on; the
// last panel has `last_cols` columns (the weight's last panel may be partly filled).
template <typename W, int R, int P>
void linear_tile(const LinearArgs& a, int64_t row, const Elem<W>* panel, int64_t col,
                 int last_cols) {
  constexpr bool kProducts = std::is_same_v<W, Bf16Products>;
  // bfloat16 panels hold their rows in pairs (pack_panels): a step takes two k at once.
  constexpr int kStepK = sizeof(Elem<W>) == 2 ? 2 : 1;
  constexpr int64_t kStepBytes = kPanelWidth * sizeof(Elem<W>) * kStepK;
  // Steps per 64-byte line of a panel (int8: 2), so that each line is prefetched once.
  constexpr int kLineSteps = kStepBytes >= 64 ? 1 : static_cast<int>(64 / kStepBytes);
  constexpr int64_t kAhead = kPrefetchBytes / (kPanelWidth * sizeof(Elem<W>));  // in k
  const int64_t in = a.in_features, panel_stride = in * kPanelWidth, pairs = (in + 1) / 2;
  VecF acc[R][P][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] = VecF{};
  const float* x = a.x + row * a.x_stride;
  const uint32_t* xp = kProducts ? a.x_pairs + row * pairs : nullptr;
  // Each output's FMA chain takes k in order, one k a step or (bfloat16) k then k + 1; bfloat16
  // products take k + 1 then k, as vdpbf16ps adds them.
  const auto step = [&](int64_t k) {
    for (int p = 0; p < P; ++p) {
      const Elem<W>* w_k = panel + p * panel_stride + k * kPanelWidth;
      VecF w[kStepK][kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) {
        if constexpr (kStepK == 2) {
          load_pair(w_k + v * 2 * kLanes, &w[0][v], &w[1][v]);
        } else {
          w[0][v] = load_panel_vec(w_k + v * kLanes);
        }
      }
      if constexpr (kProducts) {
        for (int r = 0; r < R; ++r) {
          float x0, x1;
          x_pair(xp[r * pairs + k / 2], &x0, &x1);
          for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] += w[1][v] * x1;  // one FMA
          for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] += w[0][v] * x0;
        }
      } else {
        for (int s = 0; s < kStepK; ++s)
          for (int r = 0; r < R; ++r) {
            const float xv = x[r * a.x_stride + k + s];
            for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] += w[s][v] * xv;  // one FMA
          }
      }
    }
  };
  int64_t k = 0;
  for (; k + kLineSteps * kStepK <= in; k += kLineSteps * kStepK) {
    for (int p = 0; p < P; ++p) {
      const char* ahead = reinterpret_cast<const char*>(panel + p * panel_stride +
                                                        (k + kAhead) * kPanelWidth);
      for (int64_t line = 0; line < kStepBytes * kLineSteps; line += 64)  // one per 64-byte line
        __builtin_prefetch(ahead + line, 0, 3);
    }
    for (int s = 0; s < kLineSteps; ++s) step(k + s * kStepK);
  }
  for (; k + kStepK <= in; k += kStepK) step(k);
  if constexpr (kStepK == 2)
    if (k < in) odd_k_row<W, R, P>(a, row, panel, k, acc);
  store_tile<R, P>(a, row, col, last_cols, acc);
}

#if PM_LANES == 16 && defined(__AVX512F__)
// linear_tile for Bf16Products on a CPU with AVX512_BF16: one vdpbf16ps per accumulator and pair
// of k, x's pair broadcast from its 32 bits. No lambda here: a lambda's body would not carry the
// function's target attribute.
template <int R, int P>
__attribute__((target("avx512bf16"))) void linear_tile_dpbf16(const LinearArgs& a, int64_t row,
                                                              const uint16_t* panel, int64_t col,
                                                              int last_cols) {
  constexpr int64_t kStepBytes = kPanelWidth * sizeof(uint16_t) * 2;  // a pair of k: 2 lines
  constexpr int64_t kAhead = kPrefetchBytes / (kPanelWidth * sizeof(uint16_t));  // in k
  const int64_t in = a.in_features, panel_stride = in * kPanelWidth, pairs = (in + 1) / 2;
  VecF acc[R][P][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] = VecF{};
  const uint32_t* xp = a.x_pairs + row * pairs;
  int64_t k = 0;
  for (; k + 2 <= in; k += 2) {
    for (int p = 0; p < P; ++p) {
      const uint16_t* w_k = panel + p * panel_stride + k * kPanelWidth;
      const char* ahead = reinterpret_cast<const char*>(w_k + kAhead * kPanelWidth);
      for (int64_t line = 0; line < kStepBytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
      __m512bh w[kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v)
        w[v] = (__m512bh)_mm512_loadu_si512(w_k + v * 2 * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * pairs + k / 2]));
        for (int v = 0; v < kPanelVecs; ++v)
          acc[r][p][v] = (VecF)_mm512_dpbf16_ps((__m512)acc[r][p][v], w[v], xb);
      }
    }
  }
  if (k < in) odd_k_row<Bf16Products, R, P>(a, row, panel, k, acc);
  store_tile<R, P>(a, row, col, last_cols, acc);
}

// Whether this CPU runs vdpbf16ps (read once).
inline bool cpu_has_dpbf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

// The tile for W: Bf16Products through vdpbf16ps where the CPU has it.
template <typename W, int R, int P>
inline void run_tile(const LinearArgs& a, int64_t row, const Elem<W>* panel, int64_t col,
                     int last_cols) {
#if PM_LANES == 16 && defined(__AVX512F__)
  if constexpr (std::is_same_v<W, Bf16Products>)
    if (cpu_has_dpbf16() && !a.products_as_fmas)
      return linear_tile_dpbf16<R, P>(a, row, panel, col, last_cols);
#endif
  linear_tile<W, R, P>(a, row, panel, col, last_cols);
}

// Columns of `count` panels from `first` (whose columns start at `col`) for R rows at `row`: tiles
// of tile_panels(R) panels, then one of the panels left.
template <typename W, int R, int P = tile_panels(R)>
void linear_panel_run(const LinearArgs& a, int64_t row, const Elem<W>* first, int64_t col,
                      int64_t count) {
  const int64_t panel_stride = a.in_features * kPanelWidth;
  for (; count >= P; count -= P, first += P * panel_stride, col += P * kPanelWidth) {
    const int64_t last_col = col + (P - 1) * kPanelWidth;
    const int last_cols = static_cast<int>(
        a.out_features - last_col < kPanelWidth ? a.out_features - last_col : kPanelWidth);
    run_tile<W, R, P>(a, row, first, col, last_cols);
  }
  if constexpr (P > 1) {
    if (count > 0) linear_panel_run<W, R, P - 1>(a, row, first, col, count);
  }
}

// Tiles of fewer rows than the widest: the row count's tail.
template <typename W, int R>
void linear_tail(int rows, const LinearArgs& a, int64_t row, const Elem<W>* panel, int64_t col,
                 int64_t count) {
  if (rows == R) {
    linear_panel_run<W, R>(a, row, panel, col, count);
  } else if constexpr (R > 1) {
    linear_tail<W, R - 1>(rows, a, row, panel, col, count);
  }
}

// Row chunk by row chunk. A chunk of PM_LINEAR_ROWS rows or more walks its panels one at a time
// with every row tile of the chunk over each (the panel stays in cache between the tiles); a
// chunk of fewer rows is one tile, and walks them tile_panels(rows) at a time.
template <typename W>
void linear_panels_of(const LinearArgs& a, int64_t panel_begin, int64_t panel_end) {
  const Elem<W>* panels = static_cast<const Elem<W>*>(a.panels);
  const int64_t panel_stride = a.in_features * kPanelWidth;
  for (int64_t chunk = 0; chunk < a.rows; chunk += kRowChunk) {
    const int64_t chunk_end = chunk + kRowChunk < a.rows ? chunk + kRowChunk : a.rows;
    if (chunk_end - chunk < PM_LINEAR_ROWS) {
      linear_tail<W, PM_LINEAR_ROWS - 1>(static_cast<int>(chunk_end - chunk), a, chunk,
                                         panels + panel_begin * panel_stride,
                                         panel_begin * kPanelWidth, panel_end - panel_begin);
      continue;
    }
    for (int64_t p = panel_begin; p < panel_end; ++p) {
      const Elem<W>* panel = panels + p * panel_stride;
      const int64_t col = p * kPanelWidth;
      int64_t row = chunk;
      for (; row + PM_LINEAR_ROWS <= chunk_end; row += PM_LINEAR_ROWS)
        linear_panel_run<W, PM_LINEAR_ROWS, 1>(a, row, panel, col, 1);
      if (row < chunk_end)
        linear_tail<W, PM_LINEAR_ROWS - 1>(static_cast<int>(chunk_end - row), a, row, panel, col,
                                           1);
    }
  }
}

// Panels the tiles of a call of `rows` rows read side by side (linear_panels_of).
int call_tile_panels(int64_t rows) { return rows < PM_LINEAR_ROWS ? tile_panels(rows) : 1; }

// Columns of panels [panel_begin, panel_end) for every row, on the weight's element type.
void linear_panels(const LinearArgs& a, int64_t panel_begin, int64_t panel_end) {
  switch (a.weight_dtype) {
    case WeightDtype::kBfloat16:
      return linear_panels_of<uint16_t>(a, panel_begin, panel_end);
    case WeightDtype::kBfloat16Products:
      return linear_panels_of<Bf16Products>(a, panel_begin, panel_end);
    case WeightDtype::kInt8:
      return linear_panels_of<int8_t>(a, panel_begin, panel_end);
    case WeightDtype::kFloat32:
      break;
  }
  linear_panels_of<float>(a, panel_begin, panel_end);
}
