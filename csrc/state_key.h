// Exact 64-bit state keys (GiGPO's anchor states): FNV-1a over the bytes that define an instance's state. The
// pure-Python twins compute the same function (envs/base.py fnv1a64), so the keys of both backends are equal.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastpo {

constexpr uint64_t kFnvOffset = 0xCBF29CE484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001B3ULL;

// Continues the hash h over n bytes (start with kFnvOffset).
inline uint64_t fnv1a64(const uint8_t* data, size_t n, uint64_t h = kFnvOffset) {
  for (size_t k = 0; k < n; ++k) {
    h ^= data[k];
    h *= kFnvPrime;
  }
  return h;
}

}  // namespace fastpo
