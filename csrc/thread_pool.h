// A small persistent thread pool for the batch envs: parallel_for over instance ranges.
// num_threads = 1 runs everything inline in the calling thread (no threads are created).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fastpo {

class ThreadPool {
 public:
  // fn(worker, begin, end): worker in [0, size()) identifies per-thread scratch space.
  using RangeFn = std::function<void(int, int64_t, int64_t)>;

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs fn over [0, n) in chunks of `grain` (dynamic scheduling: generation cost varies per level).
  // The caller works too. The first exception thrown by fn is rethrown here after all workers stop.
  void parallel_for(int64_t n, int64_t grain, const RangeFn& fn);

  // Same as parallel_for, but runs fn inline (no std::function, no pool lock) when one thread would do
  // all the work anyway: a single-thread pool or n <= grain. The caller's own lock guards its state.
  template <typename Fn>
  void run(int64_t n, int64_t grain, Fn&& fn) {
    if (n <= 0) return;
    if (threads_.empty() || n <= std::max<int64_t>(grain, 1)) {
      fn(0, int64_t{0}, n);
      return;
    }
    parallel_for(n, grain, RangeFn(fn));
  }

 private:
  void worker_loop(int worker);
  void run_chunks(int worker);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int active_ = 0;
  const RangeFn* job_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  std::mutex call_mu_;  // one parallel_for at a time
};

}  // namespace fastpo
