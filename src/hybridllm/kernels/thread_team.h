// The kernels' own persistent thread team (no OpenMP runtime: -fopenmp-simd only).
//
// Self-contained. Every *_team function of the other headers runs on each thread of a team with
// the same arguments; `team` says which thread it is. Work is split by static ranges that depend
// on the sizes and the team size only, or claimed item by item (Team::claim); no row's arithmetic
// depends on which thread computes it.
//
// The wait policy is ours: a thread that waits (at a barrier, or for the next step) spins for
// `spins` pauses, then sleeps on a futex. Spinning alone starves a thread whose core is busy
// elsewhere (2-thread decode fell to 1.5% of its speed with one core taken); sleeping frees the
// core, so the kernel scheduler can run the late thread there. hl_set_spin_wait sets `spins`.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hl {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  (void)word;
  (void)expected;
  std::this_thread::yield();
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>& word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// A word threads wait on until it changes: spin, then sleep; the writer wakes sleepers only.
struct WaitWord {
  std::atomic<uint32_t> value{0};
  std::atomic<int32_t> sleepers{0};

  void wait_change(uint32_t seen, int32_t spins) {
    for (int32_t i = 0; i < spins; ++i) {
      if (value.load(std::memory_order_acquire) != seen) return;
      cpu_relax();
    }
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    while (value.load(std::memory_order_seq_cst) == seen) futex_wait(value, seen);
    sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
  void publish(uint32_t next) {
    value.store(next, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(value);
  }
};

// A reusable barrier for n threads (the last to arrive opens the next phase), and a work counter
// per phase (two, alternating: the one of the next phase is reset by the last arrival).
struct Barrier {
  alignas(64) std::atomic<int32_t> arrived{0};
  alignas(64) WaitWord phase;
  alignas(64) std::atomic<int64_t> claimed[2] = {};

  void wait(int32_t n, int32_t spins) {
    if (n == 1) {  // a team of one stays in its phase: its count starts over
      claimed[phase.value.load(std::memory_order_relaxed) % 2].store(0, std::memory_order_relaxed);
      return;
    }
    const uint32_t current = phase.value.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived.store(0, std::memory_order_relaxed);
      claimed[(current + 1) % 2].store(0, std::memory_order_relaxed);
      phase.publish(current + 1);
    } else {
      phase.wait_change(current, spins);
    }
  }

  // The next unclaimed item of this phase (every thread of the team draws from the same count).
  int64_t claim() { return claimed[phase.value.load(std::memory_order_acquire) % 2].fetch_add(1); }
};

struct Team {
  int thread;
  int size;
  Barrier* sync;
  int32_t spins;
  void barrier() const { sync->wait(size, spins); }
  // Items shared out as the threads come for them (a late or descheduled thread takes fewer):
  // call until it returns >= the item count, then meet at a barrier. What an item computes must
  // not depend on the thread that takes it.
  int64_t claim() const { return sync->claim(); }
};

using TeamJob = void (*)(void* context, const Team& team);

// The persistent workers: worker i runs thread i + 1 of every team of more than i + 1 threads
// (the caller is thread 0). One team runs at a time.
class ThreadPool {
 public:
  void run(int32_t n_threads, TeamJob job, void* context) {
    std::lock_guard<std::mutex> one_team(run_mutex_);
    const int32_t n = std::max<int32_t>(1, n_threads);
    while (static_cast<int32_t>(workers_.size()) < n - 1) start_worker();
    const int32_t spins = spins_.load(std::memory_order_relaxed);
    job_ = job;
    context_ = context;
    size_ = n;
    for (int32_t i = 0; i < n - 1; ++i) workers_[i]->go.publish(workers_[i]->go.value.load() + 1);
    const Team team{0, n, &barrier_, spins};
    job(context, team);
    barrier_.wait(n, spins);  // every thread has finished the job
  }
  void set_spins(int32_t spins) { spins_.store(std::max<int32_t>(0, spins), std::memory_order_relaxed); }
  int32_t spins() const { return spins_.load(std::memory_order_relaxed); }
  // After fork() the child has none of the workers: forget them (they are not ours to join).
  void forget_workers() {
    workers_.clear();
    new (&run_mutex_) std::mutex();
    new (&barrier_) Barrier();
  }

 private:
  struct Worker {
    alignas(64) WaitWord go;
  };

  void start_worker() {
    const int32_t index = static_cast<int32_t>(workers_.size());
    workers_.push_back(new Worker());  // never freed: a worker lives as long as the process
    Worker* worker = workers_.back();
    std::thread([this, worker, index] {
      uint32_t seen = 0;
      for (;;) {
        worker->go.wait_change(seen, spins_.load(std::memory_order_relaxed));
        seen = worker->go.value.load(std::memory_order_acquire);
        const int32_t spins = spins_.load(std::memory_order_relaxed);
        const Team team{index + 1, size_, &barrier_, spins};
        job_(context_, team);
        barrier_.wait(team.size, spins);
      }
    }).detach();
  }

  std::mutex run_mutex_;
  std::vector<Worker*> workers_;
  std::atomic<int32_t> spins_{4000};
  Barrier barrier_;
  TeamJob job_ = nullptr;
  void* context_ = nullptr;
  int32_t size_ = 1;
};

inline ThreadPool& pool() {
  static ThreadPool* const instance = [] {
    auto* created = new ThreadPool();  // never destroyed: workers may outlive static destructors
    pthread_atfork(nullptr, nullptr, [] { pool().forget_workers(); });
    return created;
  }();
  return *instance;
}

// Run body(team) on every thread of a team of n_threads (the caller is thread 0).
template <typename Body>
void run_team(int32_t n_threads, Body&& body) {
  using Callable = std::remove_reference_t<Body>;
  pool().run(n_threads, [](void* context, const Team& team) { (*static_cast<Callable*>(context))(team); },
             const_cast<void*>(static_cast<const void*>(&body)));
}

// This thread's contiguous share [first, last) of n items.
struct Share {
  int64_t first, last;
  Share(int64_t n, const Team& team) {
    const int64_t per = (n + team.size - 1) / team.size;
    first = std::min(n, team.thread * per);
    last = std::min(n, first + per);
  }
};

}  // namespace hl
