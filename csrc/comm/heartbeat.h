// The beat of one rank's heartbeat word (docs/faults.md, "Slow-but-alive peers"): a host
// thread of the process increments the word every period while the process lives; the
// kernels of its peers read it when a wait's bound expires. `abort()` marks the word
// kHeartbeatAborted (api.h): the rank left the protocol (a call raised before its launch, or
// the buffer closed), and its peers' waits fail at their next look instead of waiting up to
// max_wait_s for a live process. A kernel's failed wait sets the same bit from the device
// (ep_sync.h fail_wait), with a plain store: the beat is an atomic add, so neither the host's
// increments nor its own mark can undo the bit.
//
// Host only, framework-free (no CUDA call, no Python): EpContext (comm/ep_context.cpp) maps
// the word and owns one of these; tests/emu/ep_emu.cpp runs it on the
// emulated ranks' words.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "../api.h"

namespace petit {

class HeartbeatThread {
 public:
  HeartbeatThread() = default;
  HeartbeatThread(const HeartbeatThread&) = delete;
  HeartbeatThread& operator=(const HeartbeatThread&) = delete;
  ~HeartbeatThread() { stop(); }

  // Starts beating `word` every `period_s` seconds (one increment at once). One start per
  // object.
  void start(uint64_t* word, double period_s) {
    word_ = word;
    stop_ = false;
    const auto period = std::chrono::duration<double>(period_s);
    thread_ = std::thread([this, period] {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!stop_) {
        __atomic_fetch_add(word_, 1, __ATOMIC_RELEASE);
        cv_.wait_for(lock, period);
      }
    });
  }

  // Marks the word aborted (idempotent; the beat goes on in the low bits until stop()).
  void abort() {
    if (word_ != nullptr) __atomic_fetch_or(word_, kHeartbeatAborted, __ATOMIC_SEQ_CST);
  }

  bool aborted() const {
    return word_ != nullptr && (__atomic_load_n(word_, __ATOMIC_ACQUIRE) & kHeartbeatAborted);
  }

  bool running() const { return thread_.joinable(); }

  // Ends the beat and joins the thread; the word keeps its last value and is no longer
  // touched (the caller unmaps it afterwards; abort() first if peers must know). Idempotent.
  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    word_ = nullptr;  // the caller may unmap it now
  }

 private:
  uint64_t* word_ = nullptr;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace petit
