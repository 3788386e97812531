// The kernels' worker pool (thread_pool.h says why it is not OpenMP's).
//
// One job at a time: the caller writes the job (fn, ctx), resets the done count and publishes one
// 64-bit word, [generation:16][threads:8][num_units:20][next:20]. Every participant claims a unit
// by compare-and-swap of that word (next + 1); a claim that succeeds is of the job the word
// describes, and that job cannot finish before its unit is done, so the claimer reads fn/ctx after
// the claim without a race. The caller runs units until none is left, then waits only for units
// that workers claimed and are still running.
//
// Faults: a worker that cannot be started leaves the job to fewer threads; a second caller while
// a job runs (another Python thread) runs its job on its own thread; after fork() the child gets
// a fresh pool (the parent's workers do not exist there) and the old one is left unfreed.
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PM_CPU_RELAX() _mm_pause()
#else
#define PM_CPU_RELAX() ((void)0)
#endif

namespace pm {
namespace {

constexpr int kNextBits = 20, kUnitsBits = 20, kThreadsBits = 8;
constexpr uint64_t kNextMask = (uint64_t{1} << kNextBits) - 1;
constexpr uint64_t kUnitsMask = (uint64_t{1} << kUnitsBits) - 1;
constexpr uint64_t kThreadsMask = (uint64_t{1} << kThreadsBits) - 1;
constexpr int kUnitsShift = kNextBits, kThreadsShift = kNextBits + kUnitsBits;
constexpr int kGenerationShift = kThreadsShift + kThreadsBits;
constexpr int64_t kMaxUnits = static_cast<int64_t>(kUnitsMask);
constexpr int kMaxThreads = static_cast<int>(kThreadsMask);
// Where a default spin comes from: long enough to span the Python between two kernel calls of a
// decode step (norms, RoPE, the KV write, the step's bookkeeping), short against a step.
constexpr int64_t kDefaultSpinUs = 200;
constexpr int kRelaxesPerCheck = 64;  // pause instructions between clock reads and yields

struct Word {
  uint64_t bits;
  int64_t next() const { return static_cast<int64_t>(bits & kNextMask); }
  int64_t units() const { return static_cast<int64_t>((bits >> kUnitsShift) & kUnitsMask); }
  int threads() const { return static_cast<int>((bits >> kThreadsShift) & kThreadsMask); }
  uint64_t generation() const { return bits >> kGenerationShift; }
};

using Clock = std::chrono::steady_clock;

struct Pool {
  std::atomic<uint64_t> state{0};
  std::atomic<int64_t> done{0};  // units the workers finished, of the current job
  UnitFn fn = nullptr;           // the current job's; read by a claimer after its claim
  void* ctx = nullptr;
  uint64_t generation = 0;  // the caller's, under run_mutex
  std::mutex run_mutex;     // one job at a time
  std::mutex sleep_mutex;
  std::condition_variable wake;
  std::atomic<int> sleepers{0};
  std::atomic<int> workers{0};
};

std::atomic<int64_t> g_spin_us{kDefaultSpinUs};
std::atomic<Pool*> g_pool{nullptr};

// Claims the next unit of the job `word` holds (reloaded on contention, possibly a newer job's)
// for `participant`: false once none is left or the job has no place for it.
bool claim(Pool& pool, uint64_t& word, int participant, int64_t& unit) {
  while (true) {
    const Word w{word};
    if (participant >= w.threads() || w.next() >= w.units()) return false;
    if (pool.state.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire)) {
      unit = w.next();
      return true;
    }
  }
}

void worker_main(Pool* pool, int participant) {
  uint64_t seen = Word{pool->state.load(std::memory_order_acquire)}.generation();
  auto idle_since = Clock::now();
  while (true) {
    uint64_t word = pool->state.load(std::memory_order_acquire);
    if (Word{word}.generation() != seen) {
      int64_t unit;
      while (claim(*pool, word, participant, unit)) {
        pool->fn(pool->ctx, unit, participant);
        pool->done.fetch_add(1, std::memory_order_release);
      }
      seen = Word{word}.generation();
      idle_since = Clock::now();
      continue;
    }
    const auto spin = std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
    if (Clock::now() - idle_since < spin) {
      for (int i = 0; i < kRelaxesPerCheck; ++i) PM_CPU_RELAX();
      // NOTE: a yield per check: on a shared machine a process waiting for this core runs now
      // rather than after the spin; the next job does not wait for this worker either way.
      sched_yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(pool->sleep_mutex);
    pool->sleepers.fetch_add(1, std::memory_order_seq_cst);
    pool->wake.wait(lock, [&] {
      return Word{pool->state.load(std::memory_order_seq_cst)}.generation() != seen;
    });
    pool->sleepers.fetch_sub(1, std::memory_order_relaxed);
    idle_since = Clock::now();
  }
}

// Starts workers up to `wanted` (workers are never stopped: they sleep when idle); returns how
// many there are.
int ensure_workers(Pool& pool, int wanted) {
  int have = pool.workers.load(std::memory_order_relaxed);
  for (; have < wanted; ++have) {
    try {
      std::thread(worker_main, &pool, have + 1).detach();
    } catch (const std::system_error&) {
      break;  // no more threads here: fewer participants
    }
    pool.workers.store(have + 1, std::memory_order_relaxed);
  }
  return have;
}

void forget_pool_in_child() { g_pool.store(nullptr, std::memory_order_relaxed); }

Pool& instance() {
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  Pool* pool = g_pool.load(std::memory_order_acquire);
  if (pool) return *pool;
  Pool* fresh = new Pool;  // never freed: detached workers hold it for the process's life
  if (g_pool.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *pool;
}

void run_inline(int64_t num_units, UnitFn fn, void* ctx) {
  for (int64_t unit = 0; unit < num_units; ++unit) fn(ctx, unit, 0);
}

}  // namespace

void run_units(int64_t num_units, int num_threads, UnitFn fn, void* ctx) {
  if (num_threads <= 1 || num_units <= 1 || num_units > kMaxUnits)
    return run_inline(num_units, fn, ctx);
  Pool& pool = instance();
  std::unique_lock<std::mutex> job(pool.run_mutex, std::try_to_lock);
  if (!job.owns_lock()) return run_inline(num_units, fn, ctx);
  int threads = static_cast<int>(std::min<int64_t>({num_threads, kMaxThreads, num_units}));
  threads = std::min(threads, ensure_workers(pool, threads - 1) + 1);
  if (threads <= 1) return run_inline(num_units, fn, ctx);

  pool.fn = fn, pool.ctx = ctx;
  pool.done.store(0, std::memory_order_relaxed);
  pool.generation = (pool.generation + 1) & 0xffff;
  uint64_t word = (pool.generation << kGenerationShift) |
                  (static_cast<uint64_t>(threads) << kThreadsShift) |
                  (static_cast<uint64_t>(num_units) << kUnitsShift);
  pool.state.store(word, std::memory_order_seq_cst);  // publishes fn, ctx and done
  if (pool.sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(pool.sleep_mutex);
    pool.wake.notify_all();
  }
  int64_t unit, mine = 0;
  while (claim(pool, word, 0, unit)) {
    fn(ctx, unit, 0);
    ++mine;
  }
  // Only units a worker claimed are left: wait for those (a worker is mid-unit).
  for (int checks = 0; pool.done.load(std::memory_order_acquire) + mine < num_units; ++checks) {
    for (int i = 0; i < kRelaxesPerCheck; ++i) PM_CPU_RELAX();
    if (checks > kRelaxesPerCheck) sched_yield();  // that worker may have lost its core
  }
}

int64_t pool_spin_us() { return g_spin_us.load(std::memory_order_relaxed); }

void set_pool_spin_us(int64_t us) { g_spin_us.store(us < 0 ? 0 : us, std::memory_order_relaxed); }

int pool_workers() {
  Pool* pool = g_pool.load(std::memory_order_acquire);
  return pool ? pool->workers.load(std::memory_order_relaxed) : 0;
}

}  // namespace pm
