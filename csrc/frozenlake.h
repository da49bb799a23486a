// FrozenLake: RAGEN's generate_random_map and gymnasium's step rules for a struct-of-arrays batch of N
// instances, with gym's uniform slip or RAGEN-2's success_rate slip. The pure-Python twin envs/py_frozenlake.py is the specification. Maps are stored as ASCII
// codes of 'S' 'F' 'H' 'G'; the player cell is row * size + col.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "rng.h"
#include "batch_core.h"

namespace fastpo {

constexpr int64_t kFrozenLakeMaxMapTries = 1000000;

// Scratch space of the reachability check (one per thread).
struct FrozenLakeScratch {
  std::vector<int> stack;
  std::vector<uint8_t> seen;
};

// Writes the map of `seed` (size * size ASCII codes) into desc; returns the start cell.
// Throws std::runtime_error after kFrozenLakeMaxMapTries draws.
int generate_frozenlake(uint64_t seed, int size, double p, uint8_t* desc, FrozenLakeScratch& scratch);

// N FrozenLake instances, struct of arrays. All methods are safe to call without the GIL.
class FrozenLakeBatch : public BatchCore {
 public:
  // success_rate < 0: gym's slip (the intended and each perpendicular direction w.p. 1/3, one randint(3) draw);
  // in [0, 1]: the intended direction w.p. success_rate, each perpendicular one w.p. (1 - success_rate) / 2
  // (one uniform draw, in gym's categorical order). obs_format: an ObsFormat (coords.h).
  FrozenLakeBatch(int num_envs, int size, double p, bool is_slippery, int max_steps, int num_threads,
                  double success_rate = -1.0, int obs_format = 0);

  // Regenerates instances with mask[i] (mask may be null = all) from seeds[i]; restarts their slip streams.
  void reset(const int64_t* seeds, const uint8_t* mask);
  // Sets every instance from desc (num_envs * size * size ASCII) and start cells; seeds seed the slip streams.
  void set_layouts(const uint8_t* desc_in, const int32_t* start, const int64_t* seeds);
  void step(const int32_t* actions, float* reward, uint8_t* terminated, uint8_t* truncated, uint8_t* success,
            uint8_t* valid, uint8_t* effective);
  // Render codes num_envs * size * size: 0 _, 1 O (hole), 2 G, 3 P, 4 X (player in hole),
  // 5 U+221A (player on goal); the bindings map them to text.
  void render_codes(uint8_t* out);
  // Exact state key per instance (num_envs): FNV-1a 64 over the map (size * size ASCII) then the player cell as
  // 4 little-endian bytes. Step counter and slip stream are not part of it.
  void state_keys(uint64_t* out);
  // RAGEN's coordinate text per instance (num_envs strings; see coords.h).
  void coord_texts(std::string* out);

  int size() const { return size_; }
  int obs_format() const { return obs_format_; }
  // Raw state (copied out by the bindings).
  std::vector<uint8_t> desc;
  std::vector<int32_t> position;
  std::vector<uint64_t> slip_key, slip_counter;

 private:
  void start_episode(int i, int start, int64_t seed);

  int size_;
  double p_;
  bool is_slippery_;
  double success_rate_;
  int obs_format_;
  std::vector<FrozenLakeScratch> scratch_;  // one per worker
  std::vector<int32_t> move_;  // move_[cell * 4 + gym_action]: the cell reached (clamped to the map)
};

}  // namespace fastpo
