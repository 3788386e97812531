// The kernels' own worker threads (thread_pool.cpp): the projections' GEMM (linear.cpp) and the
// paged decode attention (decode.cpp) split their work into units that the calling thread and
// the pool's workers claim one at a time.
//
// NOTE: why not OpenMP's pool. A batch-1 decode step makes ~60 kernel calls of tens of
// microseconds each; every `omp parallel` is a fork and a join, and with passive threads (the
// setting a shared machine needs: spinning libgomp threads starve other processes) each one
// wakes a sleeping thread and waits for it, tens of microseconds a call, so that the step costs
// more on two threads than on one. Here:
// - a worker spins for a short while after its last unit (`pool_spin_us`), so the calls of one
//   step find it awake, and sleeps once the engine goes quiet: an idle engine costs nothing;
// - the caller never waits for a worker to wake: it claims units from the same counter at once,
//   so a sleeping, waking or descheduled worker costs the call only the units it has claimed
//   (none, if it is not running), not a barrier;
// - each unit is computed whole by whoever claims it, so outputs do not depend on who ran what.
#pragma once

#include <cstdint>

namespace pm {

// fn(ctx, unit, participant) for every unit in [0, num_units), each exactly once; participant 0
// is the calling thread, 1 .. num_threads - 1 the workers (a participant's scratch index). On
// the calling thread alone for one thread or one unit, when another call holds the pool (two
// callers never wait for each other), or when no worker could be started.
using UnitFn = void (*)(void* ctx, int64_t unit, int participant);
void run_units(int64_t num_units, int num_threads, UnitFn fn, void* ctx);

// run_units over a callable work(unit, participant).
template <typename Work>
void parallel_units(int64_t num_units, int num_threads, const Work& work) {
  run_units(
      num_units, num_threads,
      [](void* ctx, int64_t unit, int participant) {
        (*static_cast<const Work*>(ctx))(unit, participant);
      },
      const_cast<Work*>(&work));
}

// How long a worker spins for the next unit after its last one before it sleeps (microseconds;
// 0: sleep at once). A sleeping worker is woken by the next call, which does not wait for it.
int64_t pool_spin_us();
void set_pool_spin_us(int64_t us);
// Workers started in this process so far (a forked child starts its own).
int pool_workers();

}  // namespace pm
