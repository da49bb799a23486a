// Counter-based random numbers: the exact C++ twin of envs/rng.py (read its docstring for the formulas).
// Draw k of a stream is a pure function of (seed, stream, attempt, k), so results never depend on batch
// size, position in the batch or thread count.
#pragma once

#include <cstdint>

namespace fastpo {

// Stream ids; keep in sync with envs/rng.py.
constexpr uint64_t kStreamSokobanGen = 1;
constexpr uint64_t kStreamFrozenLakeGen = 2;
constexpr uint64_t kStreamFrozenLakeSlip = 3;
constexpr uint64_t kStreamGame2048 = 7;
constexpr uint64_t kStreamSudoku = 8;
constexpr uint64_t kStreamRubiks = 9;

// splitmix64 finaliser (all arithmetic mod 2^64).
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint64_t rng_key(uint64_t seed, uint64_t stream, uint64_t attempt) {
  return mix64(mix64(seed) ^ mix64((stream << 32) | attempt));
}

struct CounterRng {
  uint64_t key;
  uint64_t counter;

  // `seed` is the Python int mod 2^64 (an int64 seed cast to uint64 is exactly that).
  CounterRng(uint64_t seed, uint64_t stream, uint64_t attempt = 0, uint64_t counter_ = 0)
      : key(rng_key(seed, stream, attempt)), counter(counter_) {}

  // Continues a stream whose key and counter were stored (e.g. a FrozenLake slip stream per instance).
  static CounterRng resume(uint64_t key, uint64_t counter) {
    CounterRng rng(0, 0);
    rng.key = key;
    rng.counter = counter;
    return rng;
  }

  uint64_t next_u64() { return mix64(key ^ mix64(++counter)); }

  // Float in [0, 1) with 53 random bits; (u >> 11) * 2^-53 is exact, as in Python.
  double uniform() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

  // Integer in [0, n); n >= 1 (callers guarantee it).
  uint64_t randint(uint64_t n) { return next_u64() % n; }
};

}  // namespace fastpo
