#include "thread_pool.h"

#include <algorithm>

namespace fastpo {

ThreadPool::ThreadPool(int num_threads) {
  for (int w = 1; w < num_threads; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run_chunks(int worker) {
  for (;;) {
    int64_t begin = next_.fetch_add(grain_);
    if (begin >= n_) return;
    try {
      (*job_)(worker, begin, std::min(begin + grain_, n_));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_);  // stop handing out chunks
      return;
    }
  }
}

void ThreadPool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunks(worker);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --active_;
    }
    done_cv_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const RangeFn& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  std::lock_guard<std::mutex> call_lock(call_mu_);
  if (threads_.empty() || n <= grain) {
    fn(0, 0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    n_ = n;
    grain_ = grain;
    next_.store(0);
    error_ = nullptr;
    active_ = static_cast<int>(threads_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  run_chunks(0);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return active_ == 0; });
    job_ = nullptr;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace fastpo
