// Work partition, threading and the exact LSE combine of the paged decode-attention kernel.
//
// Work is measured in units of one (block, KV head) tile. Segments are (sequence, KV head) pairs,
// laid end to end; the unit line is cut into equal ranges (flash-decoding split, as in Neo's
// PACPU: every range reads the same number of tiles, so one long sequence still feeds every
// thread). A range's first and last fragments may cover only part of a segment: those write
// unnormalized partials, and after a barrier each split segment is merged exactly with its LSE.
//
// NOTE: threads are the kernels' pool (thread_pool.h), the projections' too: its workers stay
// awake across the calls of a decode step and sleep when the engine idles, and the caller never
// waits for a sleeping or descheduled worker (ranges are claimed, not assigned).
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "paged_attention.h"
#include "thread_pool.h"

namespace pm {
namespace {

constexpr int64_t kMinUnitsPerRange = 8;  // smaller ranges cost more in merging than they save
constexpr int64_t kRangesPerThread = 16;  // fine hand-out: a preempted thread holds up little

// The geometry of one call, shared read-only by all threads.
struct Plan {
  const DecodeProblem& p;
  const IsaKernels& isa;
  FragmentFn attend;       // the ISA's kernel for this cache's dtype and prefetch target
  int64_t num_heads;       // KV heads in [kv_head_start, kv_head_end)
  int64_t group_size;      // query heads per KV head
  const int64_t* prefix;   // [num_segments + 1] units before each segment
  int64_t num_segments, num_ranges;
  float* partials;
  int64_t partial_stride;  // acc [G*D], row_max [G], row_sum [G]
  float* thread_scratch;
  int64_t thread_stride;   // q [G*D], acc [G*D], row_max [G], row_sum [G], scores...

  int64_t total_units() const { return prefix[num_segments]; }
  int64_t range_start(int64_t r) const { return r * total_units() / num_ranges; }
  int64_t seq_of(int64_t seg) const { return seg / num_heads; }
  int64_t head_of(int64_t seg) const { return p.kv_head_start + seg % num_heads; }
  int64_t token_start(int64_t seq) const {
    return p.token_starts ? p.token_starts[seq] : 0;
  }
  // Row of q/out/lse for query head g of segment `seg`.
  int64_t query_row(int64_t seg, int64_t g) const {
    return seq_of(seg) * p.num_q_heads + head_of(seg) * group_size + g;
  }
};

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// The ISA's kernel for the cache's dtype, prefetching where this CPU's cores read fastest.
FragmentFn fragment_fn(const DecodeProblem& p, const IsaKernels& isa) {
  static const int to = static_cast<int>(attention_prefetch_target());
  return p.kv_dtype == KvDtype::kBfloat16 ? isa.attend_bf16[to] : isa.attend_f32[to];
}

// Blocks a sequence's token range touches; throws on lengths or block ids the caches can't hold.
int64_t count_blocks(const DecodeProblem& p, int64_t seq) {
  const int64_t start = p.token_starts ? p.token_starts[seq] : 0;
  const int64_t end = p.context_lens[seq];
  if (end < 0 || end > p.max_blocks * p.block_size || start < 0)
    throw std::invalid_argument("sequence " + std::to_string(seq) + ": token range [" +
                                std::to_string(start) + ", " + std::to_string(end) +
                                ") does not fit its block table");
  if (start >= end) return 0;
  const int64_t first = start / p.block_size, last = (end + p.block_size - 1) / p.block_size;
  const int32_t* row = p.block_tables + seq * p.max_blocks;
  for (int64_t b = first; b < last; ++b)
    if (row[b] < 0 || row[b] >= p.num_blocks)
      throw std::invalid_argument("sequence " + std::to_string(seq) + ": block id " +
                                  std::to_string(row[b]) + " is outside the cache");
  return last - first;
}

void fill_segment_prefix(const DecodeProblem& p, int64_t num_heads, std::vector<int64_t>& prefix) {
  prefix.resize(p.num_seqs * num_heads + 1);
  prefix[0] = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t blocks = count_blocks(p, s);
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t seg = s * num_heads + h;
      prefix[seg + 1] = prefix[seg] + blocks;
    }
  }
}

float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  __builtin_memcpy(&f, &wide, sizeof f);
  return f;
}

// The segment's query rows, in float32 and pre-multiplied by the softmax scale.
void load_scaled_q(const Plan& plan, int64_t seg, float* q) {
  const DecodeProblem& p = plan.p;
  const int64_t n = plan.group_size * p.head_dim, first = plan.query_row(seg, 0) * p.head_dim;
  if (p.q_is_bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(p.q) + first;
    for (int64_t i = 0; i < n; ++i) q[i] = bf16_to_float(src[i]) * p.scale;
  } else {
    const float* src = static_cast<const float*>(p.q) + first;
    for (int64_t i = 0; i < n; ++i) q[i] = src[i] * p.scale;
  }
}

// Units [unit_lo, unit_hi) of segment `seg`.
struct Fragment {
  int64_t seg, unit_lo, unit_hi;
};

// The fragment of a range ending at unit `end` that starts at unit u (u < end), in the first
// non-empty segment from `seg` on.
Fragment fragment_at(const Plan& plan, int64_t seg, int64_t u, int64_t end) {
  while (plan.prefix[seg + 1] <= u) ++seg;
  return {seg, u, std::min(end, plan.prefix[seg + 1])};
}

// The fragment's block table row, its KV head's tile offset and its blocks [begin, end).
struct FragmentBlocks {
  const int32_t* table;
  int64_t head_tile_offset, begin, end;
};

FragmentBlocks blocks_of(const Plan& plan, const Fragment& f) {
  const DecodeProblem& p = plan.p;
  const int64_t seq = plan.seq_of(f.seg);
  const int64_t first_block = plan.token_start(seq) / p.block_size + f.unit_lo - plan.prefix[f.seg];
  return {p.block_tables + seq * p.max_blocks, plan.head_of(f.seg) * p.head_dim * p.block_size,
          first_block, first_block + (f.unit_hi - f.unit_lo)};
}

// Attends the segment's query group to the fragment's units; the state lands in `st`. `next`:
// the fragment this thread runs after it (its first tiles are prefetched), or nullptr.
void run_fragment(const Plan& plan, const Fragment& frag, const Fragment* next, float* q,
                  const FragmentState& st) {
  const DecodeProblem& p = plan.p;
  const int64_t seq = plan.seq_of(frag.seg);
  load_scaled_q(plan, frag.seg, q);
  const FragmentBlocks blocks = blocks_of(plan, frag);
  FragmentArgs args;
  args.q = q;
  args.key_cache = p.key_cache;
  args.value_cache = p.value_cache;
  args.block_table = blocks.table;
  args.block_stride = p.num_kv_heads * p.head_dim * p.block_size;
  args.head_tile_offset = blocks.head_tile_offset;
  args.block_begin = blocks.begin;
  args.block_end = blocks.end;
  args.token_lo = plan.token_start(seq);
  args.token_hi = p.context_lens[seq];
  args.group_size = static_cast<int>(plan.group_size);
  args.head_dim = static_cast<int>(p.head_dim);
  args.block_size = static_cast<int>(p.block_size);
  if (next != nullptr) {
    const FragmentBlocks after = blocks_of(plan, *next);
    args.next_block_table = after.table;
    args.next_head_tile_offset = after.head_tile_offset;
    args.next_block_begin = after.begin;
    args.next_block_end = after.end;
  }
  plan.attend(args, st);
}

// Writes normalized rows: out = acc / sum, lse = max + log(sum).
void write_rows(const Plan& plan, int64_t seg, const float* acc, const float* row_max,
                const float* row_sum) {
  const int64_t D = plan.p.head_dim;
  for (int64_t g = 0; g < plan.group_size; ++g) {
    const int64_t row = plan.query_row(seg, g);
    const float inv = 1.0f / row_sum[g];
    for (int64_t d = 0; d < D; ++d) plan.p.out[row * D + d] = acc[g * D + d] * inv;
    plan.p.lse[row] = row_max[g] + std::log(row_sum[g]);
  }
}

void write_empty_rows(const Plan& plan, int64_t seg) {
  const int64_t D = plan.p.head_dim;
  for (int64_t g = 0; g < plan.group_size; ++g) {
    const int64_t row = plan.query_row(seg, g);
    std::fill(plan.p.out + row * D, plan.p.out + (row + 1) * D, 0.0f);
    plan.p.lse[row] = -std::numeric_limits<float>::infinity();
  }
}

FragmentState thread_state(const Plan& plan, int tid, float** q) {
  const int64_t GD = plan.group_size * plan.p.head_dim, G = plan.group_size;
  float* base = plan.thread_scratch + tid * plan.thread_stride;
  *q = base;
  return FragmentState{base + GD, base + 2 * GD, base + 2 * GD + G, base + 2 * GD + 2 * G};
}

// Processes one range of units: whole segments go straight to out/lse, cut ones to partials.
void process_range(const Plan& plan, int64_t r, int tid) {
  float* q = nullptr;
  const FragmentState st = thread_state(plan, tid, &q);
  const int64_t begin = plan.range_start(r), end = plan.range_start(r + 1);
  if (begin >= end) return;
  const int64_t first_seg =
      std::upper_bound(plan.prefix, plan.prefix + plan.num_segments + 1, begin) - plan.prefix - 1;
  // Each fragment is told the next one of the range, so that its last step prefetches the next
  // one's first tiles (the next range is claimed at run time, maybe by another thread).
  Fragment frag = fragment_at(plan, first_seg, begin, end);
  for (;;) {
    const bool last = frag.unit_hi == end;
    const Fragment next = last ? frag : fragment_at(plan, frag.seg + 1, frag.unit_hi, end);
    run_fragment(plan, frag, last ? nullptr : &next, q, st);
    const int64_t seg_lo = plan.prefix[frag.seg], seg_hi = plan.prefix[frag.seg + 1];
    if (frag.unit_lo == seg_lo && frag.unit_hi == seg_hi) {
      write_rows(plan, frag.seg, st.acc, st.row_max, st.row_sum);
    } else {
      // A range holds at most two cut fragments: its first (slot 0) and its last (slot 1).
      float* slot =
          plan.partials + (2 * r + (frag.unit_lo == begin ? 0 : 1)) * plan.partial_stride;
      const int64_t GD = plan.group_size * plan.p.head_dim, G = plan.group_size;
      std::copy(st.acc, st.acc + GD, slot);
      std::copy(st.row_max, st.row_max + G, slot + GD);
      std::copy(st.row_sum, st.row_sum + G, slot + GD + G);
    }
    if (last) return;
    frag = next;
  }
}

// Merges the cut fragments of one segment exactly (flash-decoding's log-sum-exp combine).
void merge_segment(const Plan& plan, int64_t seg, int64_t first_range, float* acc,
                   float* row_max, float* row_sum) {
  const int64_t D = plan.p.head_dim, G = plan.group_size, GD = G * D;
  const int64_t seg_lo = plan.prefix[seg], seg_hi = plan.prefix[seg + 1];
  std::fill(row_max, row_max + G, -std::numeric_limits<float>::infinity());
  for (int64_t r = first_range; r < plan.num_ranges && plan.range_start(r) < seg_hi; ++r) {
    const float* slot = plan.partials + (2 * r + (plan.range_start(r) >= seg_lo ? 0 : 1)) *
                                            plan.partial_stride;
    for (int64_t g = 0; g < G; ++g) row_max[g] = std::max(row_max[g], slot[GD + g]);
  }
  std::fill(acc, acc + GD, 0.0f);
  std::fill(row_sum, row_sum + G, 0.0f);
  for (int64_t r = first_range; r < plan.num_ranges && plan.range_start(r) < seg_hi; ++r) {
    const float* slot = plan.partials + (2 * r + (plan.range_start(r) >= seg_lo ? 0 : 1)) *
                                            plan.partial_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float w = std::exp(slot[GD + g] - row_max[g]);
      row_sum[g] += slot[GD + G + g] * w;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += slot[g * D + d] * w;
    }
  }
}

// After every range ran: empty segments get out 0 / lse -inf, cut segments get merged.
void finish_segment(const Plan& plan, int64_t seg, int tid) {
  const int64_t seg_lo = plan.prefix[seg], seg_hi = plan.prefix[seg + 1];
  if (seg_lo == seg_hi) return write_empty_rows(plan, seg);
  int64_t lo = 0, hi = plan.num_ranges - 1;  // the last range starting at or before seg_lo
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (plan.range_start(mid) <= seg_lo) lo = mid; else hi = mid - 1;
  }
  if (plan.range_start(lo + 1) >= seg_hi) return;  // one range held it whole: already written
  float* q = nullptr;
  const FragmentState st = thread_state(plan, tid, &q);
  merge_segment(plan, seg, lo, st.acc, st.row_max, st.row_sum);
  write_rows(plan, seg, st.acc, st.row_max, st.row_sum);
}

}  // namespace

void run_decode(const DecodeProblem& p, const IsaKernels& isa, int num_threads, Workspace& ws) {
  const int64_t num_heads = p.kv_head_end - p.kv_head_start;
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  fill_segment_prefix(p, num_heads, ws.segment_units);
  const int64_t num_segments = p.num_seqs * num_heads;
  const int64_t total = ws.segment_units[num_segments];
  const int64_t num_ranges = std::max<int64_t>(
      1, std::min<int64_t>(num_threads * kRangesPerThread, total / kMinUnitsPerRange));
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, num_ranges));
  const int64_t partial_stride = round_up(G * (p.head_dim + 2), 16);
  const int64_t step_slots = std::max<int64_t>(kStepSlots, p.block_size);
  const int64_t thread_stride =
      round_up(2 * G * p.head_dim + 2 * G + G * (step_slots + 1 + kMaxLanes), 16);
  if (ws.partials.size() < static_cast<size_t>(2 * num_ranges * partial_stride))
    ws.partials.resize(2 * num_ranges * partial_stride);
  if (ws.thread_scratch.size() < static_cast<size_t>(threads * thread_stride))
    ws.thread_scratch.resize(threads * thread_stride);
  const Plan plan{p, isa, fragment_fn(p, isa), num_heads, G, ws.segment_units.data(),
                  num_segments, num_ranges, ws.partials.data(), partial_stride,
                  ws.thread_scratch.data(), thread_stride};
  // Ranges first (claimed one at a time: a preempted thread holds up one range), then, once every
  // range ran, the segments' merges.
  parallel_units(num_ranges, threads,
                 [&](int64_t r, int participant) { process_range(plan, r, participant); });
  parallel_units(num_segments, threads,
                 [&](int64_t seg, int participant) { finish_segment(plan, seg, participant); });
}

}  // namespace pm
