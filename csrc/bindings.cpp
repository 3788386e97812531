// Python bindings: a torch-free nanobind module taking DLPack tensors (torch tensors pass straight
// in, zero-copy). Shapes and dtypes are checked here so the kernel can trust its pointers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "decoder_layer.h"
#include "frame_copy.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "thread_pool.h"

namespace nb = nanobind;

namespace {

using AnyArray = nb::ndarray<nb::device::cpu, nb::c_contig>;
using Int32Array = nb::ndarray<const int32_t, nb::device::cpu, nb::c_contig>;
using Float32Array = nb::ndarray<float, nb::device::cpu, nb::c_contig>;

const nb::dlpack::dtype kBfloat16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};

template <typename Array>
void expect_shape(const char* name, const Array& a, std::vector<int64_t> shape) {
  bool ok = a.ndim() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(i) == static_cast<size_t>(shape[i]);
  if (ok) return;
  std::string want = "[", got = "[";
  for (int64_t n : shape) want += std::to_string(n) + ",";
  for (size_t i = 0; i < a.ndim(); ++i) got += std::to_string(a.shape(i)) + ",";
  throw std::invalid_argument(std::string(name) + " has shape " + got + "] but must be " + want +
                              "]");
}

template <typename Array>
bool is_bf16(const Array& a, const char* name) {
  if (a.dtype() == kBfloat16) return true;
  if (a.dtype() == nb::dtype<float>()) return false;
  throw std::invalid_argument(std::string(name) + " must be float32 or bfloat16");
}

// Reads the cache geometry and checks every tensor against it.
pm::DecodeProblem describe(const AnyArray& q, const AnyArray& key_cache,
                           const AnyArray& value_cache, const Int32Array& block_tables,
                           const Int32Array& context_lens) {
  if (q.ndim() != 3 || key_cache.ndim() != 4 || block_tables.ndim() != 2)
    throw std::invalid_argument("q must be 3-D, key_cache 4-D and block_tables 2-D");
  pm::DecodeProblem p{};
  p.num_seqs = q.shape(0), p.num_q_heads = q.shape(1), p.head_dim = q.shape(2);
  p.num_blocks = key_cache.shape(0), p.num_kv_heads = key_cache.shape(1);
  p.block_size = key_cache.shape(3), p.max_blocks = block_tables.shape(1);
  expect_shape("key_cache", key_cache, {p.num_blocks, p.num_kv_heads, p.head_dim, p.block_size});
  expect_shape("value_cache", value_cache,
               {p.num_blocks, p.num_kv_heads, p.block_size, p.head_dim});
  expect_shape("block_tables", block_tables, {p.num_seqs, p.max_blocks});
  expect_shape("context_lens", context_lens, {p.num_seqs});
  if (p.num_kv_heads == 0 || p.num_q_heads % p.num_kv_heads != 0)
    throw std::invalid_argument("num_q_heads must be a multiple of num_kv_heads");
  const bool kv_bf16 = is_bf16(key_cache, "key_cache");
  if (is_bf16(value_cache, "value_cache") != kv_bf16)
    throw std::invalid_argument("key_cache and value_cache must have the same dtype");
  p.q_is_bf16 = is_bf16(q, "q");
  p.kv_dtype = kv_bf16 ? pm::KvDtype::kBfloat16 : pm::KvDtype::kFloat32;
  p.q = q.data(), p.key_cache = key_cache.data(), p.value_cache = value_cache.data();
  p.block_tables = block_tables.data(), p.context_lens = context_lens.data();
  return p;
}

void decode(pm::Workspace& ws, const AnyArray& q, const AnyArray& key_cache,
            const AnyArray& value_cache, const Int32Array& block_tables,
            const Int32Array& context_lens, const std::optional<Int32Array>& token_starts,
            const Float32Array& out, const Float32Array& lse, float scale, int64_t kv_head_start,
            int64_t kv_head_end, int num_threads, const std::string& isa) {
  pm::DecodeProblem p = describe(q, key_cache, value_cache, block_tables, context_lens);
  expect_shape("out", out, {p.num_seqs, p.num_q_heads, p.head_dim});
  expect_shape("lse", lse, {p.num_seqs, p.num_q_heads});
  if (token_starts) {
    expect_shape("token_starts", *token_starts, {p.num_seqs});
    p.token_starts = token_starts->data();
  }
  if (kv_head_end < 0) kv_head_end = p.num_kv_heads;
  if (kv_head_start < 0 || kv_head_start > kv_head_end || kv_head_end > p.num_kv_heads)
    throw std::invalid_argument("need 0 <= kv_head_start <= kv_head_end <= num_kv_heads");
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  p.out = out.data(), p.lse = lse.data(), p.scale = scale;
  p.kv_head_start = kv_head_start, p.kv_head_end = kv_head_end;
  const pm::IsaKernels& kernels = pm::select_isa(isa, p.head_dim, p.block_size);
  nb::gil_scoped_release no_gil;  // long-running and touches no Python object
  std::lock_guard<std::mutex> lock(ws.mutex);
  pm::run_decode(p, kernels, num_threads, ws);
}

using RowsIn = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu, nb::c_contig>;
using RowsOut = nb::ndarray<float, nb::ndim<2>, nb::device::cpu, nb::c_contig>;
using VectorIn = nb::ndarray<const float, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

void expect_rows(const char* name, size_t rows, size_t cols, size_t want_rows, size_t want_cols) {
  if (rows != want_rows || cols != want_cols)
    throw std::invalid_argument(std::string(name) + " has shape [" + std::to_string(rows) + "," +
                                std::to_string(cols) + "] but must be [" +
                                std::to_string(want_rows) + "," + std::to_string(want_cols) + "]");
}

void rms_norm(const RowsIn& x, const VectorIn& weight, const RowsOut& out, float eps) {
  const size_t rows = x.shape(0), hidden = x.shape(1);
  expect_rows("weight", 1, weight.shape(0), 1, hidden);
  expect_rows("out", out.shape(0), out.shape(1), rows, hidden);
  pm::rms_norm(x.data(), weight.data(), out.data(), rows, hidden, eps);
}

void add_rms_norm(const RowsIn& x, const RowsIn& y, const VectorIn& weight, const RowsOut& sum,
                  const RowsOut& normed, float eps) {
  const size_t rows = x.shape(0), hidden = x.shape(1);
  expect_rows("y", y.shape(0), y.shape(1), rows, hidden);
  expect_rows("weight", 1, weight.shape(0), 1, hidden);
  expect_rows("sum", sum.shape(0), sum.shape(1), rows, hidden);
  expect_rows("normed", normed.shape(0), normed.shape(1), rows, hidden);
  pm::add_rms_norm(x.data(), y.data(), weight.data(), sum.data(), normed.data(), rows, hidden,
                   eps);
}

void rotary(const RowsOut& rows, int64_t num_heads, int64_t head_dim,
            const nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>& positions,
            const RowsIn& cos_table, const RowsIn& sin_table) {
  if (head_dim <= 0 || head_dim % 2 != 0 || num_heads < 0 ||
      num_heads * head_dim > static_cast<int64_t>(rows.shape(1)))
    throw std::invalid_argument("rotary: num_heads * head_dim must fit a row, head_dim even");
  expect_rows("positions", 1, positions.shape(0), 1, rows.shape(0));
  expect_rows("cos_table", cos_table.shape(0), cos_table.shape(1), cos_table.shape(0), head_dim);
  expect_rows("sin_table", sin_table.shape(0), sin_table.shape(1), cos_table.shape(0), head_dim);
  const int64_t max_pos = cos_table.shape(0);
  for (size_t r = 0; r < positions.shape(0); ++r)
    if (positions.data()[r] < 0 || positions.data()[r] >= max_pos)
      throw std::invalid_argument("rotary: position " + std::to_string(positions.data()[r]) +
                                  " outside the tables' " + std::to_string(max_pos) + " rows");
  pm::rotary_inplace(rows.data(), rows.shape(0), rows.shape(1), num_heads, head_dim,
                     positions.data(), cos_table.data(), sin_table.data());
}

void silu_and_mul(const RowsIn& x, const RowsOut& out) {
  const size_t rows = x.shape(0), inter = x.shape(1) / 2;
  if (x.shape(1) % 2 != 0) throw std::invalid_argument("silu_and_mul: x needs an even width");
  expect_rows("out", out.shape(0), out.shape(1), rows, inter);
  pm::best_isa().silu_and_mul(x.data(), out.data(), rows, inter, 0, inter);
}

// Panels of any weight dtype the GEMM takes (WeightDtype): checked by `weight_dtype_of`.
using Panels = nb::ndarray<nb::ndim<3>, nb::device::cpu, nb::c_contig>;
using Scales = nb::ndarray<const float, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

// The GEMM's kernels for `isa`: "auto" is the best this CPU runs (what the engine uses); the
// others, for tests and other CPUs, are checked as the attention kernel's are (the GEMM has no
// shape constraint, hence the zero head_dim and block_size).
const pm::IsaKernels& gemm_isa(const std::string& isa) {
  return isa == "auto" ? pm::best_isa() : pm::select_isa(isa, 0, 0);
}

pm::WeightDtype weight_dtype_of(const Panels& panels) {
  if (panels.dtype() == nb::dtype<float>()) return pm::WeightDtype::kFloat32;
  if (panels.dtype() == kBfloat16) return pm::WeightDtype::kBfloat16;
  if (panels.dtype() == nb::dtype<int8_t>()) return pm::WeightDtype::kInt8;
  throw std::invalid_argument("linear: panels must be float32, bfloat16 or int8");
}

// The panels' dtype and element pointer from panel `panel_start` on, and the int8 scales' pointer
// from that panel's first column: checks that int8 panels come with one scale per panel column
// and that no other dtype has scales.
using pm::WeightView;

WeightView weight_view(const Panels& panels, const std::optional<Scales>& scales,
                       int64_t panel_start) {
  const pm::WeightDtype dtype = weight_dtype_of(panels);
  const int64_t panel_elements = panels.shape(1) * panels.shape(2);
  const char* base = static_cast<const char*>(panels.data());
  const void* first = base + panel_start * panel_elements * (panels.dtype().bits / 8);
  if ((dtype == pm::WeightDtype::kInt8) != scales.has_value())
    throw std::invalid_argument("linear: int8 panels need scales, and only int8 panels take them");
  if (!scales) return {dtype, first, nullptr};
  expect_rows("scales", 1, scales->shape(0), 1, panels.shape(0) * panels.shape(2));
  return {dtype, first, scales->data() + panel_start * panels.shape(2)};
}

void linear(const RowsIn& x, const Panels& panels, const RowsOut& out,
            const std::optional<RowsIn>& residual, int64_t panel_start, int num_threads,
            const std::string& isa, const std::optional<Scales>& scales) {
  const int64_t rows = x.shape(0), in_features = x.shape(1), out_features = out.shape(1);
  const pm::IsaKernels& kernels = gemm_isa(isa);
  const int64_t width = kernels.linear_panel_width;
  if (panels.shape(1) != static_cast<size_t>(in_features) ||
      panels.shape(2) != static_cast<size_t>(width))
    throw std::invalid_argument("linear: panels must be [P, " + std::to_string(in_features) +
                                ", " + std::to_string(width) + "] for x of " +
                                std::to_string(in_features) + " columns");
  const int64_t num_panels = (out_features + width - 1) / width;
  if (panel_start < 0 || panel_start + num_panels > static_cast<int64_t>(panels.shape(0)))
    throw std::invalid_argument("linear: " + std::to_string(out_features) +
                                " output columns from panel " + std::to_string(panel_start) +
                                " overrun the weight's " + std::to_string(panels.shape(0)) +
                                " panels");
  expect_rows("out", out.shape(0), out_features, rows, out_features);
  if (residual) expect_rows("residual", residual->shape(0), residual->shape(1), rows, out_features);
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  const WeightView w = weight_view(panels, scales, panel_start);
  const float* res = residual ? residual->data() : nullptr;
  const pm::LinearArgs a{x.data(),   w.panels,     out.data(),   res,     rows,    in_features,
                         out_features, in_features, out_features, out_features, w.dtype, w.scales};
  nb::gil_scoped_release no_gil;
  pm::linear(a, kernels, num_panels, num_threads);
}

void linear_silu_and_mul(const RowsIn& x, const Panels& panels, const RowsOut& gate_up,
                         const RowsOut& act, int num_threads, const std::string& isa,
                         const std::optional<Scales>& scales) {
  const int64_t rows = x.shape(0), in_features = x.shape(1), inter = act.shape(1);
  const pm::IsaKernels& kernels = gemm_isa(isa);
  const int64_t width = kernels.linear_panel_width;
  if (inter % width != 0)
    throw std::invalid_argument("linear_silu_and_mul: the intermediate size " +
                                std::to_string(inter) + " is not a multiple of the panel width " +
                                std::to_string(width));
  if (panels.shape(0) != static_cast<size_t>(2 * inter / width) ||
      panels.shape(1) != static_cast<size_t>(in_features) ||
      panels.shape(2) != static_cast<size_t>(width))
    throw std::invalid_argument("linear_silu_and_mul: panels must be [" +
                                std::to_string(2 * inter / width) + ", " +
                                std::to_string(in_features) + ", " + std::to_string(width) + "]");
  expect_rows("gate_up", gate_up.shape(0), gate_up.shape(1), rows, 2 * inter);
  expect_rows("act", act.shape(0), act.shape(1), rows, inter);
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  const WeightView w = weight_view(panels, scales, 0);
  const pm::LinearArgs a{x.data(), w.panels,   gate_up.data(), nullptr, rows,    in_features,
                         2 * inter, in_features, 2 * inter,     0,       w.dtype, w.scales};
  nb::gil_scoped_release no_gil;
  pm::linear_silu_and_mul(a, act.data(), kernels, inter / width, num_threads);
}

// The post-attention weights as pm::post_attention reads them, every panel shape checked against
// x's `hidden` columns and attention rows of `attn_width` (`who` names the call in errors).
pm::PostAttentionWeights post_attention_weights(
    const char* who, int64_t hidden, int64_t attn_width, const Panels& o_panels,
    const std::optional<Scales>& o_scales, const VectorIn& norm_weight, float eps,
    const Panels& gate_up_panels, const std::optional<Scales>& gate_up_scales,
    const Panels& down_panels, const std::optional<Scales>& down_scales) {
  const int64_t width = pm::best_isa().linear_panel_width;
  const int64_t hidden_panels = (hidden + width - 1) / width;
  const int64_t inter = static_cast<int64_t>(down_panels.shape(1));
  const auto expect_panels = [width, who](const char* name, const Panels& p, int64_t count,
                                          int64_t in_features) {
    if (p.shape(0) != static_cast<size_t>(count) || p.shape(1) != static_cast<size_t>(in_features) ||
        p.shape(2) != static_cast<size_t>(width))
      throw std::invalid_argument(std::string(who) + ": " + name + " panels must be [" +
                                  std::to_string(count) + ", " + std::to_string(in_features) +
                                  ", " + std::to_string(width) + "]");
  };
  if (inter % width != 0)
    throw std::invalid_argument(std::string(who) + ": the intermediate size " +
                                std::to_string(inter) + " is not a multiple of the panel width");
  expect_panels("o", o_panels, hidden_panels, attn_width);
  expect_panels("gate_up", gate_up_panels, 2 * inter / width, hidden);
  expect_panels("down", down_panels, hidden_panels, inter);
  expect_rows("norm_weight", 1, norm_weight.shape(0), 1, hidden);
  return {weight_view(o_panels, o_scales, 0),
          norm_weight.data(),
          eps,
          weight_view(gate_up_panels, gate_up_scales, 0),
          weight_view(down_panels, down_scales, 0),
          hidden,
          attn_width,
          inter};
}

// The decoder layer after attention in one call (common/model/linear.py `post_attention`):
// o = attn @ Wo.T; sum = x + o; h = rms_norm(sum) * norm_weight; act = silu(h @ Wg.T) * (h @ Wu.T);
// out = sum + act @ Wd.T. Each step is the function its own call runs (linear, add_rms_norm,
// linear_silu_and_mul), in the same order, so the bits are those of the separate calls; what
// is saved is the Python between them. Intermediates live in the calling thread's scratch.
void post_attention(const RowsIn& x, const RowsIn& attn, const Panels& o_panels,
                    const std::optional<Scales>& o_scales, const VectorIn& norm_weight, float eps,
                    const Panels& gate_up_panels, const std::optional<Scales>& gate_up_scales,
                    const Panels& down_panels, const std::optional<Scales>& down_scales,
                    const RowsOut& out, int num_threads) {
  const int64_t rows = x.shape(0), hidden = x.shape(1), attn_width = attn.shape(1);
  const pm::PostAttentionWeights w = post_attention_weights(
      "post_attention", hidden, attn_width, o_panels, o_scales, norm_weight, eps, gate_up_panels,
      gate_up_scales, down_panels, down_scales);
  expect_rows("attn", attn.shape(0), attn_width, rows, attn_width);
  expect_rows("out", out.shape(0), out.shape(1), rows, hidden);
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  nb::gil_scoped_release no_gil;
  pm::post_attention(w, x.data(), attn.data(), out.data(), rows, pm::best_isa(), num_threads);
}

using CacheLayer = nb::ndarray<float, nb::ndim<4>, nb::device::cpu, nb::c_contig>;
// A fused layer's cache: float32 or bfloat16 (the pair one dtype).
using AnyCacheLayer = nb::ndarray<nb::ndim<4>, nb::device::cpu, nb::c_contig>;
using Int64Vector = nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

// Every position in [0, max_pos), the rows of the RoPE tables.
void check_positions(const char* who, const int64_t* positions, int64_t count, int64_t max_pos) {
  for (int64_t i = 0; i < count; ++i)
    if (positions[i] < 0 || positions[i] >= max_pos)
      throw std::invalid_argument(std::string(who) + ": position " + std::to_string(positions[i]) +
                                  " outside the tables' " + std::to_string(max_pos) + " rows");
}

// One decode step's inputs shared by every layer (pm::DecodeStepInputs), checked once per step;
// the arrays are held so that their memory outlives the step's layer calls.
struct DecodeStep {
  Int64Vector positions, slots;
  RowsIn cos_table, sin_table;
  nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig> block_tables;
  nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig> context_lens;
  pm::DecodeStepInputs in{};

  DecodeStep(Int64Vector positions_, RowsIn cos_, RowsIn sin_, Int64Vector slots_,
             decltype(block_tables) tables_, decltype(context_lens) lens_, float scale)
      : positions(positions_), slots(slots_), cos_table(cos_), sin_table(sin_),
        block_tables(tables_), context_lens(lens_) {
    const int64_t rows = positions.shape(0), max_pos = cos_table.shape(0);
    expect_rows("sin_table", sin_table.shape(0), sin_table.shape(1), max_pos, cos_table.shape(1));
    expect_rows("slots", 1, slots.shape(0), 1, rows);
    expect_rows("context_lens", 1, context_lens.shape(0), 1, rows);
    if (block_tables.shape(0) != static_cast<size_t>(rows))
      throw std::invalid_argument("DecodeStep: block_tables needs one row per position");
    check_positions("DecodeStep", positions.data(), rows, max_pos);
    in = {rows,         positions.data(),    cos_table.data(),
          sin_table.data(), slots.data(),    block_tables.data(),
          context_lens.data(), static_cast<int64_t>(block_tables.shape(1)), scale};
  }
};

// One decoder layer's weights and KV caches for `decoder_layer_decode`, checked once when built
// (common/model/fused_decode.py builds one per layer after packing); the arrays are held, so the
// tensors outlive the object.
struct FusedDecoderLayer {
  VectorIn input_norm, post_norm;
  Panels qkv_panels, o_panels, gate_up_panels, down_panels;
  std::optional<Scales> qkv_scales, o_scales, gate_up_scales, down_scales;
  AnyCacheLayer key_cache, value_cache;
  pm::PreAttentionWeights pre{};
  pm::PostAttentionWeights post{};
  pm::KvLayer kv{};
  const pm::IsaKernels* attention = nullptr;

  FusedDecoderLayer(VectorIn input_norm_, float input_eps, Panels qkv_, std::optional<Scales> qkv_s,
                    int64_t num_heads, int64_t num_kv_heads, Panels o_, std::optional<Scales> o_s,
                    VectorIn post_norm_, float post_eps, Panels gate_up_,
                    std::optional<Scales> gate_up_s, Panels down_, std::optional<Scales> down_s,
                    AnyCacheLayer key_, AnyCacheLayer value_, const std::string& isa)
      : input_norm(input_norm_), post_norm(post_norm_), qkv_panels(qkv_), o_panels(o_),
        gate_up_panels(gate_up_), down_panels(down_), qkv_scales(qkv_s), o_scales(o_s),
        gate_up_scales(gate_up_s), down_scales(down_s), key_cache(key_), value_cache(value_) {
    const int64_t hidden = input_norm.shape(0), head_dim = key_cache.shape(2);
    const int64_t width = pm::best_isa().linear_panel_width;
    if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 ||
        key_cache.shape(1) != static_cast<size_t>(num_kv_heads))
      throw std::invalid_argument(
          "FusedDecoderLayer: num_heads must be a multiple of num_kv_heads, the caches' heads");
    expect_shape("value_cache", value_cache,
                 {static_cast<int64_t>(key_cache.shape(0)), num_kv_heads,
                  static_cast<int64_t>(key_cache.shape(3)), head_dim});
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
    expect_shape("qkv_panels", qkv_panels, {(qkv_width + width - 1) / width, hidden, width});
    pre = {input_norm.data(), input_eps, weight_view(qkv_panels, qkv_scales, 0),
           hidden,            num_heads, num_kv_heads,
           head_dim};
    post = post_attention_weights("FusedDecoderLayer", hidden, num_heads * head_dim, o_panels,
                                  o_scales, post_norm, post_eps, gate_up_panels, gate_up_scales,
                                  down_panels, down_scales);
    const bool bf16 = is_bf16(key_cache, "key_cache");
    if (is_bf16(value_cache, "value_cache") != bf16)
      throw std::invalid_argument("FusedDecoderLayer: key_cache and value_cache differ in dtype");
    kv = {key_cache.data(), value_cache.data(), static_cast<int64_t>(key_cache.shape(0)),
          static_cast<int64_t>(key_cache.shape(3)),
          bf16 ? pm::KvDtype::kBfloat16 : pm::KvDtype::kFloat32};
    attention = &pm::select_isa(isa, head_dim, kv.block_size);
  }

  // What a step through this layer needs beyond x's and out's shapes (decode_layers checks them):
  // `in` with RoPE tables `cos_width` wide.
  void check(const pm::DecodeStepInputs& in, size_t cos_width, int num_threads,
             int attention_threads) const {
    if (cos_width != static_cast<size_t>(pre.head_dim))
      throw std::invalid_argument("decode: the RoPE tables' rows must be head_dim wide");
    if (num_threads < 1 || attention_threads < 1)
      throw std::invalid_argument("num_threads must be >= 1");
    const int64_t num_slots = kv.num_blocks * kv.block_size;
    for (int64_t r = 0; r < in.rows; ++r)
      if (in.slots[r] < 0 || in.slots[r] >= num_slots)
        throw std::invalid_argument("decode: slot " + std::to_string(in.slots[r]) +
                                    " outside the cache's " + std::to_string(num_slots) +
                                    " slots");
  }

  void run(pm::Workspace& ws, const pm::DecodeStepInputs& in, const float* x, float* out,
           int num_threads, int attention_threads) const {
    pm::decoder_layer_decode(pre, post, kv, in, x, out, pm::best_isa(), *attention, ws,
                             num_threads, attention_threads);
  }
};

// The final norm's weight and the LM head's packed weight for `pm::lm_head`, checked once when
// built (common/model/fused_decode.py); the arrays are held, so the tensors outlive the object.
struct FusedLmHead {
  VectorIn norm;
  Panels panels;
  std::optional<Scales> scales;
  pm::LmHeadWeights w{};

  FusedLmHead(VectorIn norm_, float eps, Panels panels_, std::optional<Scales> scales_,
              int64_t vocab)
      : norm(norm_), panels(panels_), scales(scales_) {
    const int64_t hidden = norm.shape(0), width = pm::best_isa().linear_panel_width;
    if (vocab < 1) throw std::invalid_argument("FusedLmHead: vocab must be >= 1");
    expect_shape("lm_head panels", panels, {(vocab + width - 1) / width, hidden, width});
    w = {norm.data(), eps, weight_view(panels, scales, 0), hidden, vocab};
  }
};

// A checked step: x through every layer into out (x may be out), then, with a head, its logits.
void run_step(pm::Workspace& ws, const pm::DecodeStepInputs& step,
              const std::vector<const FusedDecoderLayer*>& layers, const float* x, float* out,
              const FusedLmHead* head, float* logits, int num_threads, int attention_threads) {
  const float* in = x;
  for (const FusedDecoderLayer* layer : layers) {
    layer->run(ws, step, in, out, num_threads, attention_threads);
    in = out;
  }
  if (head) pm::lm_head(head->w, in, logits, step.rows, pm::best_isa(), num_threads);
}

// Every layer of a decode step in one call: x [T, hidden] through layers[0], layers[1], ... into
// out (x and out may be one tensor: a layer reads its input whole before it writes its output);
// with `head`, then logits [T, vocab] = the LM head on the final norm of out.
void decode_layers(pm::Workspace& ws, const DecodeStep& step,
                   const std::vector<const FusedDecoderLayer*>& layers, const RowsIn& x,
                   const RowsOut& out, int num_threads, int attention_threads,
                   const FusedLmHead* head, const std::optional<RowsOut>& logits) {
  for (const FusedDecoderLayer* layer : layers) {
    expect_rows("x", x.shape(0), x.shape(1), step.in.rows, layer->pre.hidden);
    expect_rows("out", out.shape(0), out.shape(1), step.in.rows, layer->pre.hidden);
    layer->check(step.in, step.cos_table.shape(1), num_threads, attention_threads);
  }
  if ((head == nullptr) != !logits)
    throw std::invalid_argument("decode_layers: a head needs logits, and logits a head");
  if (head) {
    expect_rows("x", x.shape(0), x.shape(1), step.in.rows, head->w.hidden);
    expect_rows("logits", logits->shape(0), logits->shape(1), step.in.rows, head->w.vocab);
  }
  nb::gil_scoped_release no_gil;
  run_step(ws, step.in, layers, x.data(), out.data(), head, head ? logits->data() : nullptr,
           num_threads, attention_threads);
}

using Int64Rows = nb::ndarray<const int64_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;
using Int32Rows = nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;

// `DecodeStep` for several decode steps of the same rows in a row (`decode_greedy`): step s's
// positions, slots and context lengths are row s of [steps, T] arrays; one block table per row
// holds every step's blocks (a step reads only its context's). Checked once, whole.
struct DecodeSteps {
  Int64Rows positions, slots;
  RowsIn cos_table, sin_table;
  Int32Rows block_tables, context_lens;
  std::vector<pm::DecodeStepInputs> in;

  DecodeSteps(Int64Rows positions_, RowsIn cos_, RowsIn sin_, Int64Rows slots_,
              Int32Rows tables_, Int32Rows lens_, float scale)
      : positions(positions_), slots(slots_), cos_table(cos_), sin_table(sin_),
        block_tables(tables_), context_lens(lens_) {
    const int64_t steps = positions.shape(0), rows = positions.shape(1);
    const int64_t max_pos = cos_table.shape(0);
    if (steps < 1) throw std::invalid_argument("DecodeSteps: at least one step");
    expect_rows("sin_table", sin_table.shape(0), sin_table.shape(1), max_pos, cos_table.shape(1));
    expect_rows("slots", slots.shape(0), slots.shape(1), steps, rows);
    expect_rows("context_lens", context_lens.shape(0), context_lens.shape(1), steps, rows);
    if (block_tables.shape(0) != static_cast<size_t>(rows))
      throw std::invalid_argument("DecodeSteps: block_tables needs one row per sequence");
    check_positions("DecodeSteps", positions.data(), steps * rows, max_pos);
    for (int64_t s = 0; s < steps; ++s)
      in.push_back({rows, positions.data() + s * rows, cos_table.data(), sin_table.data(),
                    slots.data() + s * rows, block_tables.data(), context_lens.data() + s * rows,
                    static_cast<int64_t>(block_tables.shape(1)), scale});
  }
};

using TokensOut = nb::ndarray<int64_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;

// Greedy decode steps in one call: for each step s, x = the embedding rows of the step's input
// tokens (token_ids, then step s - 1's), every layer, the LM head, and tokens[s] = each row's
// argmax. Each step is `decode_layers` with its head and the sampler's greedy argmax, so the
// tokens are theirs, step by step. Everything is checked before the first write.
void decode_greedy(pm::Workspace& ws, const DecodeSteps& steps,
                   const std::vector<const FusedDecoderLayer*>& layers, const FusedLmHead& head,
                   const RowsIn& embed, const Int64Vector& token_ids, const RowsOut& x,
                   const RowsOut& logits, const TokensOut& tokens, int num_threads,
                   int attention_threads) {
  const int64_t num_steps = static_cast<int64_t>(steps.in.size());
  const int64_t rows = steps.in[0].rows, hidden = head.w.hidden, vocab = head.w.vocab;
  expect_rows("embed", 1, embed.shape(1), 1, hidden);
  if (static_cast<int64_t>(embed.shape(0)) < vocab)
    throw std::invalid_argument("decode_greedy: the embedding has fewer rows than the head's "
                                "vocabulary");
  expect_rows("token_ids", 1, token_ids.shape(0), 1, rows);
  expect_rows("x", x.shape(0), x.shape(1), rows, hidden);
  expect_rows("logits", logits.shape(0), logits.shape(1), rows, vocab);
  expect_rows("tokens", tokens.shape(0), tokens.shape(1), num_steps, rows);
  for (int64_t r = 0; r < rows; ++r)
    if (token_ids.data()[r] < 0 || token_ids.data()[r] >= static_cast<int64_t>(embed.shape(0)))
      throw std::invalid_argument("decode_greedy: token id " + std::to_string(token_ids.data()[r]) +
                                  " outside the embedding's " + std::to_string(embed.shape(0)) +
                                  " rows");
  for (const FusedDecoderLayer* layer : layers) {
    if (layer->pre.hidden != hidden)
      throw std::invalid_argument("decode_greedy: a layer's hidden size is not the head's");
    for (const pm::DecodeStepInputs& in : steps.in)
      layer->check(in, steps.cos_table.shape(1), num_threads, attention_threads);
  }
  nb::gil_scoped_release no_gil;
  const int64_t* ids = token_ids.data();
  for (int64_t s = 0; s < num_steps; ++s) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(x.data() + r * hidden, embed.data() + ids[r] * hidden, hidden * sizeof(float));
    run_step(ws, steps.in[s], layers, x.data(), x.data(), &head, logits.data(), num_threads,
             attention_threads);
    int64_t* out = tokens.data() + s * rows;
    pm::parallel_units(rows, num_threads, [&](int64_t r, int) {
      out[r] = pm::best_isa().first_argmax(logits.data() + r * vocab, vocab);
    });
    ids = out;
  }
}

using StridedKv = nb::ndarray<const float, nb::ndim<3>, nb::device::cpu>;
void write_kv(const CacheLayer& key_cache, const CacheLayer& value_cache, const StridedKv& k,
              const StridedKv& v,
              const nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>& slots) {
  const int64_t num_blocks = key_cache.shape(0), heads = key_cache.shape(1);
  const int64_t dim = key_cache.shape(2), block_size = key_cache.shape(3);
  expect_shape("value_cache", value_cache, {num_blocks, heads, block_size, dim});
  const int64_t tokens = slots.shape(0);
  expect_shape("k", k, {tokens, heads, dim});
  expect_shape("v", v, {tokens, heads, dim});
  if (k.stride(2) != 1 || v.stride(2) != 1)
    throw std::invalid_argument("write_kv: k and v need contiguous head_dim");
  for (int64_t t = 0; t < tokens; ++t)
    if (slots.data()[t] < 0 || slots.data()[t] >= num_blocks * block_size)
      throw std::invalid_argument("write_kv: slot " + std::to_string(slots.data()[t]) +
                                  " outside the cache's " +
                                  std::to_string(num_blocks * block_size) + " slots");
  const pm::KvRowStrides strides{k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  pm::write_kv(key_cache.data(), value_cache.data(), k.data(), v.data(), slots.data(), tokens,
               heads, dim, block_size, strides);
}

// Any dtype, any strides: the tensors a message carries (frame_copy.h).
using StridedArray = nb::ndarray<nb::device::cpu>;

pm::StridedBytes strided_of(const StridedArray& a) {
  if (a.ndim() > static_cast<size_t>(pm::kMaxFrameDims))
    throw std::invalid_argument("a frame tensor has " + std::to_string(a.ndim()) +
                                " dimensions; at most " + std::to_string(pm::kMaxFrameDims));
  if (a.dtype().bits % 8 != 0 || a.dtype().lanes != 1)
    throw std::invalid_argument("frame tensors must have whole-byte elements");
  pm::StridedBytes t{};
  t.data = static_cast<char*>(a.data());
  t.itemsize = a.dtype().bits / 8;
  t.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.strides[d] = a.stride(d);
    if (t.strides[d] < 0) throw std::invalid_argument("frame tensors must not have negative strides");
  }
  return t;
}

// Checks that [offset, offset + bytes) of a buffer of `size` bytes exists, for every tensor.
std::vector<pm::StridedBytes> frames_in(size_t size, const std::vector<int64_t>& offsets,
                                        const std::vector<StridedArray>& tensors) {
  if (offsets.size() != tensors.size())
    throw std::invalid_argument("one offset per tensor: got " + std::to_string(offsets.size()) +
                                " offsets for " + std::to_string(tensors.size()) + " tensors");
  std::vector<pm::StridedBytes> frames;
  frames.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    frames.push_back(strided_of(tensors[i]));
    const int64_t end = offsets[i] + pm::dense_bytes(frames.back());
    if (offsets[i] < 0 || end > static_cast<int64_t>(size))
      throw std::invalid_argument("frame " + std::to_string(i) + " at [" +
                                  std::to_string(offsets[i]) + ", " + std::to_string(end) +
                                  ") is outside a buffer of " + std::to_string(size) + " bytes");
  }
  return frames;
}

void pack_frames(const nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>& buffer,
                 const std::vector<int64_t>& offsets, const std::vector<StridedArray>& tensors) {
  const std::vector<pm::StridedBytes> frames = frames_in(buffer.size(), offsets, tensors);
  for (size_t i = 0; i < frames.size(); ++i)
    pm::strided_to_dense(frames[i], reinterpret_cast<char*>(buffer.data()) + offsets[i]);
}

void unpack_frames(
    const nb::ndarray<const uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>& buffer,
    const std::vector<int64_t>& offsets, const std::vector<StridedArray>& tensors) {
  const std::vector<pm::StridedBytes> frames = frames_in(buffer.size(), offsets, tensors);
  for (size_t i = 0; i < frames.size(); ++i)
    pm::dense_to_strided(reinterpret_cast<const char*>(buffer.data()) + offsets[i], frames[i]);
}

}  // namespace

NB_MODULE(phasemesh_attention_kernel, m) {
  m.doc() = "CPU paged decode attention (see common/attention/cpu_kernel.py)";
  // NOTE: engines and benches keep kernels in module-level objects that Python may not collect
  // before nanobind's exit-time leak check runs; the report would be noise at every exit.
  nb::set_leak_warnings(false);
  nb::class_<pm::Workspace>(m, "PagedDecodeKernel",
                            "Decode attention with scratch kept across calls; thread-safe.")
      .def(nb::init<>())
      .def("decode", &decode, nb::arg("q").noconvert(), nb::arg("key_cache").noconvert(),
           nb::arg("value_cache").noconvert(), nb::arg("block_tables").noconvert(),
           nb::arg("context_lens").noconvert(), nb::arg("token_starts").noconvert().none(),
           nb::arg("out").noconvert(), nb::arg("lse").noconvert(), nb::arg("scale"),
           nb::arg("kv_head_start") = 0, nb::arg("kv_head_end") = -1,
           nb::arg("num_threads") = 1, nb::arg("isa") = "auto",
           "Writes out [S, Hq, D] and lse [S, Hq] (float32) for the query rows of KV heads "
           "[kv_head_start, kv_head_end); tokens [token_starts[i], context_lens[i]).");
  nb::class_<DecodeStep>(m, "DecodeStep",
                         "One decode step's positions, RoPE tables, KV slots, block tables and "
                         "context lengths, checked once and shared by every FusedDecoderLayer call.")
      .def(nb::init<Int64Vector, RowsIn, RowsIn, Int64Vector,
                    nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>,
                    nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>, float>(),
           nb::arg("positions").noconvert(), nb::arg("cos_table").noconvert(),
           nb::arg("sin_table").noconvert(), nb::arg("slots").noconvert(),
           nb::arg("block_tables").noconvert(), nb::arg("context_lens").noconvert(),
           nb::arg("scale"));
  nb::class_<FusedDecoderLayer>(
      m, "FusedDecoderLayer",
      "A decoder layer's packed weights and KV caches (float32, or bfloat16: each new k/v rounded "
      "as tensor.to(torch.bfloat16) rounds it), for a decode step's layer in one call "
      "(common/model/fused_decode.py).")
      .def(nb::init<VectorIn, float, Panels, std::optional<Scales>, int64_t, int64_t, Panels,
                    std::optional<Scales>, VectorIn, float, Panels, std::optional<Scales>, Panels,
                    std::optional<Scales>, AnyCacheLayer, AnyCacheLayer, const std::string&>(),
           nb::arg("input_norm").noconvert(), nb::arg("input_eps"),
           nb::arg("qkv_panels").noconvert(), nb::arg("qkv_scales").noconvert().none(),
           nb::arg("num_heads"), nb::arg("num_kv_heads"), nb::arg("o_panels").noconvert(),
           nb::arg("o_scales").noconvert().none(), nb::arg("post_norm").noconvert(),
           nb::arg("post_eps"), nb::arg("gate_up_panels").noconvert(),
           nb::arg("gate_up_scales").noconvert().none(), nb::arg("down_panels").noconvert(),
           nb::arg("down_scales").noconvert().none(), nb::arg("key_cache").noconvert(),
           nb::arg("value_cache").noconvert(), nb::arg("isa") = "auto");
  // What this build's FusedDecoderLayer takes besides float32 caches (fused_decode.py asks).
  m.attr("fused_bfloat16_kv") = true;
  nb::class_<FusedLmHead>(m, "FusedLmHead",
                          "The final RMSNorm and the LM head's packed weight, for decode_layers.")
      .def(nb::init<VectorIn, float, Panels, std::optional<Scales>, int64_t>(),
           nb::arg("norm").noconvert(), nb::arg("eps"), nb::arg("panels").noconvert(),
           nb::arg("scales").noconvert().none(), nb::arg("vocab"));
  m.def("decode_layers", &decode_layers, nb::arg("workspace"), nb::arg("step"), nb::arg("layers"),
        nb::arg("x").noconvert(), nb::arg("out").noconvert(), nb::arg("num_threads") = 1,
        nb::arg("attention_threads") = 1, nb::arg("head").none() = nb::none(),
        nb::arg("logits").noconvert().none() = nb::none(),
        "out = x through every FusedDecoderLayer of `layers` in turn, for one decode step (x and "
        "out may be one tensor); the bits of each layer's decode called in turn. With `head` "
        "(a FusedLmHead), logits [T, vocab] = the LM head on the final norm of out, the bits of "
        "rms_norm and linear called in turn.");
  nb::class_<DecodeSteps>(m, "DecodeSteps",
                          "DecodeStep for several steps of the same rows: positions, slots and "
                          "context lengths [steps, T], one block table per row for all of them.")
      .def(nb::init<Int64Rows, RowsIn, RowsIn, Int64Rows, Int32Rows, Int32Rows, float>(),
           nb::arg("positions").noconvert(), nb::arg("cos_table").noconvert(),
           nb::arg("sin_table").noconvert(), nb::arg("slots").noconvert(),
           nb::arg("block_tables").noconvert(), nb::arg("context_lens").noconvert(),
           nb::arg("scale"));
  m.def("decode_greedy", &decode_greedy, nb::arg("workspace"), nb::arg("steps"),
        nb::arg("layers"), nb::arg("head"), nb::arg("embed").noconvert(),
        nb::arg("token_ids").noconvert(), nb::arg("x").noconvert(), nb::arg("logits").noconvert(),
        nb::arg("tokens").noconvert(), nb::arg("num_threads") = 1,
        nb::arg("attention_threads") = 1,
        "Greedy decode steps in one call: tokens [steps, T] = each step's argmax of its logits, "
        "the embedding of token_ids [T] feeding the first step and each step's tokens the next; "
        "each step the bits of decode_layers with its head and numpy's argmax.");
  m.def(
      "read_sum",
      [](const nb::ndarray<const float, nb::device::cpu, nb::c_contig>& a, int num_threads) {
        nb::gil_scoped_release no_gil;
        return pm::read_sum(a.data(), static_cast<int64_t>(a.size()), num_threads);
      },
      nb::arg("data").noconvert(), nb::arg("num_threads") = 1,
      "Sum of a float32 array, read once at streaming speed (a bandwidth probe).");
  m.def(
      "copy",
      [](const nb::ndarray<float, nb::device::cpu, nb::c_contig>& dst,
         const nb::ndarray<const float, nb::device::cpu, nb::c_contig>& src, int num_threads) {
        if (dst.size() != src.size()) throw std::invalid_argument("copy: sizes differ");
        if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
        nb::gil_scoped_release no_gil;
        pm::copy_bytes(dst.data(), src.data(), static_cast<int64_t>(src.size()) * 4, num_threads);
      },
      nb::arg("dst").noconvert(), nb::arg("src").noconvert(), nb::arg("num_threads") = 1,
      "dst[:] = src (float32, same size) with streaming stores per thread (a copy-bandwidth probe).");
  m.def("rms_norm", &rms_norm, nb::arg("x").noconvert(), nb::arg("weight").noconvert(),
        nb::arg("out").noconvert(), nb::arg("eps"),
        "out = x / rms(x) * weight per row (float32 [T, H]).");
  m.def("add_rms_norm", &add_rms_norm, nb::arg("x").noconvert(), nb::arg("y").noconvert(),
        nb::arg("weight").noconvert(), nb::arg("sum").noconvert(), nb::arg("normed").noconvert(),
        nb::arg("eps"), "sum = x + y; normed = sum / rms(sum) * weight, in one pass.");
  m.def("rotary", &rotary, nb::arg("rows").noconvert(), nb::arg("num_heads"),
        nb::arg("head_dim"), nb::arg("positions").noconvert(), nb::arg("cos_table").noconvert(),
        nb::arg("sin_table").noconvert(),
        "Rotates the first num_heads heads of each row in place by its position (RoPE).");
  m.def("silu_and_mul", &silu_and_mul, nb::arg("x").noconvert(), nb::arg("out").noconvert(),
        "out = silu(x[:, :I]) * x[:, I:] (float32, x [T, 2I]).");
  m.def("linear", &linear, nb::arg("x").noconvert(), nb::arg("panels").noconvert(),
        nb::arg("out").noconvert(), nb::arg("residual").noconvert().none(),
        nb::arg("panel_start") = 0, nb::arg("num_threads") = 1, nb::arg("isa") = "auto",
        nb::arg("scales").noconvert() = nb::none(),
        "out = x @ w.T (+ residual), x and out float32, w packed as panels [P, in, "
        "linear_panel_width()] (common/model/linear.py) of float32, bfloat16 or int8 (then w = "
        "panels * scales, one float32 scale per panel column), from panel panel_start on; rows "
        "never depend on each other.");
  m.def("linear_silu_and_mul", &linear_silu_and_mul, nb::arg("x").noconvert(),
        nb::arg("panels").noconvert(), nb::arg("gate_up").noconvert(), nb::arg("act").noconvert(),
        nb::arg("num_threads") = 1, nb::arg("isa") = "auto",
        nb::arg("scales").noconvert() = nb::none(),
        "gate_up = x @ w.T and act = silu(gate_up[:, :I]) * gate_up[:, I:] in one pass, each "
        "thread activating the columns it computed; I (act's width) a multiple of the panel "
        "width; values equal linear() then silu_and_mul().");
  m.def("post_attention", &post_attention, nb::arg("x").noconvert(), nb::arg("attn").noconvert(),
        nb::arg("o_panels").noconvert(), nb::arg("o_scales").noconvert().none(),
        nb::arg("norm_weight").noconvert(), nb::arg("eps"),
        nb::arg("gate_up_panels").noconvert(), nb::arg("gate_up_scales").noconvert().none(),
        nb::arg("down_panels").noconvert(), nb::arg("down_scales").noconvert().none(),
        nb::arg("out").noconvert(), nb::arg("num_threads") = 1,
        "A decoder layer after attention: out = sum + mlp(rms_norm(sum)), sum = x + attn @ Wo.T, "
        "on packed panels (scales for int8 ones); the bits of linear, add_rms_norm, "
        "linear_silu_and_mul and linear called in turn.");
  m.def(
      "first_argmax",
      [](const RowsIn& logits, const std::string& isa) {
        if (logits.shape(1) == 0) throw std::invalid_argument("first_argmax: empty rows");
        const pm::IsaKernels& kernels = gemm_isa(isa);
        std::vector<int64_t> out(logits.shape(0));
        for (size_t r = 0; r < out.size(); ++r)
          out[r] = kernels.first_argmax(logits.data() + r * logits.shape(1),
                                        static_cast<int64_t>(logits.shape(1)));
        return out;
      },
      nb::arg("logits").noconvert(), nb::arg("isa") = "auto",
      "Each row's first index of its largest value, or of its first NaN (numpy's argmax): what "
      "decode_greedy takes for its tokens.");
  m.def(
      "linear_panel_width",
      [](const std::string& isa) { return gemm_isa(isa).linear_panel_width; },
      nb::arg("isa") = "auto", "Weight columns per panel of `linear` for an ISA (auto: the best).");
  m.def(
      "set_matmul_precision",
      [](const std::string& precision) {
        if (precision == "highest")
          pm::set_matmul_precision(pm::MatmulPrecision::kHighest);
        else if (precision == "medium")
          pm::set_matmul_precision(pm::MatmulPrecision::kMedium);
        else
          throw std::invalid_argument("matmul precision must be 'highest' or 'medium', not '" +
                                      precision + "'");
      },
      nb::arg("precision"),
      "How every later linear call multiplies bfloat16 weights, process-wide: 'highest' widens "
      "them to float32 with x float32 (the default); 'medium' rounds x to bfloat16 and multiplies "
      "in bfloat16 pairs (vdpbf16ps where the CPU has AVX512_BF16).");
  m.def("_set_bf16_products_as_fmas", &pm::set_bf16_products_as_fmas, nb::arg("as_fmas"),
        "For tests: matmul precision 'medium' as FMAs even where the CPU runs vdpbf16ps (the "
        "form CPUs without AVX512_BF16 run), to check that both give the same bits.");
  m.def(
      "matmul_precision",
      [] { return pm::matmul_precision() == pm::MatmulPrecision::kMedium ? "medium" : "highest"; },
      "The process's matmul precision for bfloat16 weights: 'highest' or 'medium'.");
  m.def(
      "linear_weight_dtypes",
      [] { return std::vector<std::string>{"float32", "bfloat16", "int8"}; },
      "The panel dtypes `linear` and `linear_silu_and_mul` take.");
  m.def("write_kv", &write_kv, nb::arg("key_cache").noconvert(),
        nb::arg("value_cache").noconvert(), nb::arg("k").noconvert(), nb::arg("v").noconvert(),
        nb::arg("slots").noconvert(),
        "Writes k/v [T, H, D] (float32) into one layer's paged caches at flat slots [T] (int64).");
  m.def("pack_frames", &pack_frames, nb::arg("buffer").noconvert(), nb::arg("offsets"),
        nb::arg("tensors"),
        "buffer[offsets[i]:] = tensors[i]'s bytes in C order (any dtype and strides; uint8 "
        "buffer); every frame checked to fit before anything is written.");
  m.def("unpack_frames", &unpack_frames, nb::arg("buffer").noconvert(), nb::arg("offsets"),
        nb::arg("tensors"),
        "tensors[i] (any dtype and strides, written in place) = buffer[offsets[i]:]'s bytes in "
        "C order; every frame checked to fit before anything is written.");
  m.def(
      "pool_spin_us",
      [](std::optional<int64_t> us) {
        if (us) pm::set_pool_spin_us(*us);
        return pm::pool_spin_us();
      },
      nb::arg("us") = nb::none(),
      "Microseconds the kernels' pool workers spin for the next call before they sleep (set it "
      "with `us`, negative: 0); returns the value in force.");
  m.def("pool_workers", &pm::pool_workers,
        "Worker threads the kernels' pool started in this process (the caller is not counted).");
  m.def("supported_isas", &pm::supported_isas,
        "Kernel ISAs this CPU can run, best first (the first is what 'auto' prefers).");
  m.def(
      "attention_prefetch_target",
      [] { return pm::attention_prefetch_target() == pm::PrefetchTo::kL2 ? "l2" : "l1"; },
      "The cache level ('l1' or 'l2') decode attention prefetches its next tiles into on this "
      "CPU.");
}
