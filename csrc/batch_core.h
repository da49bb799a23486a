// What every batch env (Sokoban, FrozenLake, 2048, Sudoku, the 2x2 cube) shares: its size and step budget, the
// worker pool, the lock that serialises its public calls (the bindings release the GIL inside them), the
// per-instance episode flags, and the "was every instance reset?" check. Each game keeps its own state beside it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace fastpo {

class BatchCore {
 public:
  int num_envs() const { return n_; }
  int num_threads() const { return pool_.size(); }
  // Whether every instance was reset (or set) at least once.
  bool all_ready() const {
    if (all_ready_.load(std::memory_order_relaxed)) return true;
    return std::all_of(ready.begin(), ready.end(), [](uint8_t r) { return r != 0; });
  }

  std::vector<int32_t> num_steps;
  std::vector<uint8_t> terminated, truncated, ready;

 protected:
  // Throws std::invalid_argument for num_envs < 1, max_steps < 1 or num_threads outside [1, 256].
  BatchCore(int num_envs, int max_steps, int num_threads)
      : n_(num_envs), max_steps_(max_steps), pool_(checked_threads(num_envs, max_steps, num_threads)) {
    num_steps.assign(n_, 0);
    terminated.assign(n_, 0);
    truncated.assign(n_, 0);
    ready.assign(n_, 0);
  }

  // A new episode of instance i: no steps taken, not ended, ready.
  void begin_episode(int64_t i) {
    num_steps[i] = 0;
    terminated[i] = truncated[i] = 0;
    ready[i] = 1;
  }
  // After a reset of some instances (ready flags only ever go 0 -> 1, so the answer is cached once true).
  void refresh_all_ready() {
    all_ready_.store(std::all_of(ready.begin(), ready.end(), [](uint8_t r) { return r != 0; }));
  }
  // After every instance was set.
  void set_all_ready() {
    std::fill(ready.begin(), ready.end(), 1);
    all_ready_.store(true);
  }
  // fn(i) for the instances first .. last - 1, over the pool in chunks of `grain`, under the lock: the body of
  // step (all instances) and render (a range of them).
  template <typename Fn>
  void for_range(int64_t first, int64_t last, int64_t grain, Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    pool_.run(last - first, grain, [&](int, int64_t begin, int64_t end) {
      for (int64_t i = first + begin; i < first + end; ++i) fn(i);
    });
  }
  template <typename Fn>
  void for_each_instance(int64_t grain, Fn fn) {
    for_range(0, n_, grain, fn);
  }
  // reset(): fn(worker, i, seed) for every instance with mask[i] (mask null: all), over the pool in chunks of
  // `grain` (worker indexes per-thread scratch), under the lock; then the ready cache.
  template <typename Fn>
  void reset_masked(const int64_t* seeds, const uint8_t* mask, int64_t grain, Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    pool_.run(n_, grain, [&](int worker, int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (mask == nullptr || mask[i]) fn(worker, i, seeds[i]);
    });
    refresh_all_ready();
  }
  // out[i] = key(i) for every instance: the exact state keys.
  template <typename KeyFn>
  void keys_into(uint64_t* out, KeyFn key) {
    for_each_instance(4096, [&](int64_t i) { out[i] = key(i); });
  }

  int n_;
  int max_steps_;
  ThreadPool pool_;
  std::mutex mu_;  // one public call at a time

 private:
  static int checked_threads(int num_envs, int max_steps, int num_threads) {
    if (num_envs < 1) throw std::invalid_argument("num_envs must be >= 1, got " + std::to_string(num_envs));
    if (max_steps < 1) throw std::invalid_argument("max_steps must be >= 1, got " + std::to_string(max_steps));
    if (num_threads < 1 || num_threads > 256)
      throw std::invalid_argument("num_threads must be in [1, 256], got " + std::to_string(num_threads));
    return num_threads;
  }

  std::atomic<bool> all_ready_{false};
};

}  // namespace fastpo
