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
// Activations stay float32: at decode row counts a projection is mostly held by the weight's
// bytes, so fewer bytes per weight is the gain, and no activation is rounded. NOTE: vdpbf16ps
// would round x to bfloat16 to halve the FMAs; on a core that issues it on one port only
// (Emerald Rapids) it ran slower than widening and FMAs on two, so it would not pay even there.

constexpr int kPanelVecs = 2;
constexpr int kPanelWidth = kPanelVecs * kLanes;
// Bytes of panel read ahead of use, 4 KiB: a weight streams from memory at decode sizes, and at 8
// or 32 rows a tile's FMAs between loads leave too few reads in flight without it (slower than
// oneDNN without it, well faster with it, against oneDNN in the same run).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kRowChunk = 64;

typedef int8_t VecB __attribute__((vector_size(PM_LANES)));

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

// R rows x P panels (panels `panel` + i * panel_stride) of outputs, from column `col` on; the
// last panel has `last_cols` columns (the weight's last panel may be partly filled).
template <typename W, int R, int P>
void linear_tile(const LinearArgs& a, int64_t row, const W* panel, int64_t col, int last_cols) {
  // bfloat16 panels hold their rows in pairs (pack_panels): a step takes two k at once.
  constexpr int kStepK = std::is_same_v<W, uint16_t> ? 2 : 1;
  constexpr int64_t kStepBytes = kPanelWidth * sizeof(W) * kStepK;
  // Steps per 64-byte line of a panel (int8: 2), so that each line is prefetched once.
  constexpr int kLineSteps = kStepBytes >= 64 ? 1 : static_cast<int>(64 / kStepBytes);
  constexpr int64_t kAhead = kPrefetchBytes / (kPanelWidth * sizeof(W));  // in k
  const int64_t in = a.in_features, panel_stride = in * kPanelWidth;
  VecF acc[R][P][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] = VecF{};
  const float* x = a.x + row * a.x_stride;
  // Each output's FMA chain takes k in order, one k a step or (bfloat16) k then k + 1.
  const auto step = [&](int64_t k) {
    for (int p = 0; p < P; ++p) {
      const W* w_k = panel + p * panel_stride + k * kPanelWidth;
      VecF w[kStepK][kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) {
        if constexpr (kStepK == 2) {
          load_pair(w_k + v * 2 * kLanes, &w[0][v], &w[1][v]);
        } else {
          w[0][v] = load_panel_vec(w_k + v * kLanes);
        }
      }
      for (int s = 0; s < kStepK; ++s)
        for (int r = 0; r < R; ++r) {
          const float xv = x[r * a.x_stride + k + s];
          for (int v = 0; v < kPanelVecs; ++v) acc[r][p][v] += w[s][v] * xv;  // one FMA
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
  if constexpr (kStepK == 2) {
    if (k < in) {  // an odd K's last row, unpaired: the plain [W] row the panel ends with
      for (int p = 0; p < P; ++p) {
        const W* w_k = panel + p * panel_stride + k * kPanelWidth;
        for (int v = 0; v < kPanelVecs; ++v) {
          const VecF w = load_panel_vec(w_k + v * kLanes);
          for (int r = 0; r < R; ++r) acc[r][p][v] += w * x[r * a.x_stride + k];
        }
      }
    }
  }
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

// Columns of `count` panels from `first` (whose columns start at `col`) for R rows at `row`: tiles
// of tile_panels(R) panels, then one of the panels left.
template <typename W, int R, int P = tile_panels(R)>
void linear_panel_run(const LinearArgs& a, int64_t row, const W* first, int64_t col,
                      int64_t count) {
  const int64_t panel_stride = a.in_features * kPanelWidth;
  for (; count >= P; count -= P, first += P * panel_stride, col += P * kPanelWidth) {
    const int64_t last_col = col + (P - 1) * kPanelWidth;
    const int last_cols = static_cast<int>(
        a.out_features - last_col < kPanelWidth ? a.out_features - last_col : kPanelWidth);
    linear_tile<W, R, P>(a, row, first, col, last_cols);
  }
  if constexpr (P > 1) {
    if (count > 0) linear_panel_run<W, R, P - 1>(a, row, first, col, count);
  }
}

// Tiles of fewer rows than the widest: the row count's tail.
template <typename W, int R>
void linear_tail(int rows, const LinearArgs& a, int64_t row, const W* panel, int64_t col,
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
  const W* panels = static_cast<const W*>(a.panels);
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
      const W* panel = panels + p * panel_stride;
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
    case WeightDtype::kInt8:
      return linear_panels_of<int8_t>(a, panel_begin, panel_end);
    case WeightDtype::kFloat32:
      break;
  }
  linear_panels_of<float>(a, panel_begin, panel_end);
}
