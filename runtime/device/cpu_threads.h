// Helper threads for the CPU kernels (cpu_matmul.cc, cpu_attention.cc): a product is cut into
// chunks that the calling thread and up to `threads - 1` helpers claim one at a time.
//
// Why not XLA's intra-op pool (the FFI's ThreadPool): while a program runs, one of its threads
// runs the program and another is often blocked waiting for it, so a task scheduled there
// started on average ~300 µs later (measured in the decode step of Gemma 3 270M on 2 cores),
// after most products (20-150 µs) were over. These helpers sleep on a condition variable
// (woken in ~5 µs) and never spin, so they take a core only while there is work. The caller
// always works too and claims chunks until none is left: a late (or busy) helper only means
// fewer chunks for it, never a wrong or missing result.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxinfer_cpu {

// Chunks 0..n-1 of one call; run(c) computes chunk c.
struct Chunks {
  std::function<void(int64_t)> run;
  int64_t n = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;

  void work() {
    for (;;) {
      const int64_t c = next.fetch_add(1);
      if (c >= n) return;
      run(c);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

class Helpers {
 public:
  // Runs chunks 0..n-1 of `run` on the calling thread and up to `threads - 1` helpers; returns
  // when every chunk is done.
  void parallel(int64_t n, int64_t threads, std::function<void(int64_t)> run) {
    auto job = std::make_shared<Chunks>();
    job->run = std::move(run);
    job->n = n;
    const int64_t helpers = std::min<int64_t>(threads, n) - 1;
    if (helpers > 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (static_cast<int64_t>(count_) < helpers) {
          std::thread(&Helpers::loop, this).detach();  // never joined: lives with the process
          ++count_;
        }
        job_ = job;
        want_ = helpers;
        ++generation_;
      }
      cv_.notify_all();
    }
    job->work();
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->done.load() == job->n; });
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Chunks> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen && want_ > 0; });
        seen = generation_;
        --want_;
        job = job_;
      }
      job->work();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Chunks> job_;
  uint64_t generation_ = 0;
  int64_t want_ = 0;
  size_t count_ = 0;
};

inline Helpers& helpers() {
  static Helpers* h = new Helpers();  // never destroyed: helper threads outlive static teardown
  return *h;
}

}  // namespace jaxinfer_cpu
