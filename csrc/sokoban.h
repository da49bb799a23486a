// Sokoban: RAGEN's level generator (gym-sokoban's generate_room + RAGEN's player displacement) and a
// struct-of-arrays batch of N instances with gym-sokoban's step rules. The pure-Python twin
// envs/py_sokoban.py is the specification; every draw comes from CounterRng(seed, kStreamSokobanGen, attempt).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rng.h"
#include "batch_core.h"

namespace fastpo {

// Cell codes (gym-sokoban): 6 = player on target exists only in renders.
constexpr uint8_t kWall = 0;
constexpr uint8_t kEmpty = 1;
constexpr uint8_t kTarget = 2;
constexpr uint8_t kBoxOnTarget = 3;
constexpr uint8_t kBox = 4;
constexpr uint8_t kPlayer = 5;
constexpr uint8_t kPlayerOnTarget = 6;

struct SokobanParams {
  int rows = 6;
  int cols = 6;
  int num_boxes = 1;
  int search_depth = 300;
  double p_change_directions = 0.35;
  int num_gen_steps = -1;  // < 0: int(1.7 * (rows + cols))

  void validate() const;  // throws std::invalid_argument
  int gen_steps() const { return num_gen_steps >= 0 ? num_gen_steps : static_cast<int>(1.7 * (rows + cols)); }
};

constexpr int kSokobanMaxAttempts = 1000;
constexpr int kSokobanGenerationTries = 4;
constexpr int64_t kSokobanMaxExplored = 300000;

// Exact set of fixed-width keys (W uint64 words each): open addressing with linear probing.
// clear() is O(1): a slot is live only if its stamp equals the current one.
class KeySet {
 public:
  void clear(int words);
  bool insert(const uint64_t* key);  // false if already present
  int64_t size() const { return count_; }

 private:
  void grow();
  uint64_t hash(const uint64_t* key) const;

  int words_ = 0;
  uint64_t mask_ = 0;
  int64_t count_ = 0;
  uint32_t stamp_ = 0;
  std::vector<uint32_t> stamps_;
  std::vector<uint64_t> keys_;
};

// Generates levels; holds the scratch space of one thread (reuse it across seeds).
class SokobanGenerator {
 public:
  explicit SokobanGenerator(const SokobanParams& params);

  // Writes the level of `seed` into room_fixed / room_state (rows * cols each, row-major).
  // Returns the attempt that succeeded; throws std::runtime_error after kSokobanMaxAttempts.
  int generate(uint64_t seed, uint8_t* room_fixed, uint8_t* room_state);

 private:
  bool generate_room(CounterRng& rng, uint8_t* room_fixed, uint8_t* room_state);
  void room_topology_generation(CounterRng& rng);
  bool place_boxes_and_player(CounterRng& rng);
  void add_random_player_movement(CounterRng& rng, const uint8_t* room_fixed, uint8_t* room_state,
                                  double move_probability);
  void reverse_play(const uint8_t* room_fixed, uint8_t* room_state);
  void depth_first_search(int64_t box_swaps, int last_pull, int ttl);
  void set_cell(int cell, uint8_t code);
  int64_t displacement(const std::vector<int>& box_cells) const;

  SokobanParams p_;
  int cells_;
  int key_words_;
  std::vector<int> level_;        // topology counts
  std::vector<uint8_t> room_;     // topology + player + targets
  std::vector<int> candidates_;   // floor cells, row-major
  // Reverse-play state (the DFS mutates these in place and undoes each move).
  const uint8_t* fixed_ = nullptr;
  std::vector<uint8_t> grid_;
  std::vector<uint64_t> key_;     // 2 bits per cell: 0 nothing, 1 box (4), 2 pulled box (3), 3 player
  std::vector<int> targets_;      // target cells, row-major (RAGEN's box_mapping key order)
  std::vector<int> box_cells_;    // box_cells_[k]: where the box that started on targets_[k] is now
  int player_ = 0;
  KeySet explored_;
  int64_t best_score_ = -1;
  std::vector<uint8_t> best_grid_;
  std::vector<int> best_box_cells_;
};

// N Sokoban instances, struct of arrays. All methods are safe to call without the GIL.
class SokobanBatch : public BatchCore {
 public:
  // obs_format: an ObsFormat (coords.h): the symbol grid, RAGEN's coordinate lists, or both.
  SokobanBatch(int num_envs, const SokobanParams& params, int max_steps, std::vector<std::string> symbols,
               int num_threads, int obs_format = 0);

  // Regenerates instances with mask[i] (mask may be null = all) from seeds[i]; in parallel.
  void reset(const int64_t* seeds, const uint8_t* mask);
  // Sets every instance from room_fixed / room_state (num_envs * rows * cols); one player each.
  void set_layouts(const uint8_t* room_fixed, const uint8_t* room_state);
  void step(const int32_t* actions, float* reward, uint8_t* terminated, uint8_t* truncated, uint8_t* success,
            uint8_t* valid, uint8_t* effective);
  // Render cell codes 0..6 (6 = player on target), num_envs * rows * cols; the bindings map them to symbols().
  void render_codes(uint8_t* out);
  // Exact state key per instance (num_envs): FNV-1a 64 over room_fixed then room_state (walls, targets, boxes,
  // player); the step counter is not part of it, so a state reached at different turns has one key.
  void state_keys(uint64_t* out);
  // RAGEN's coordinate text per instance (num_envs strings; see coords.h).
  void coord_texts(std::string* out);

  int obs_format() const { return obs_format_; }
  const SokobanParams& params() const { return p_; }
  const std::vector<std::string>& symbols() const { return symbols_; }
  // Raw state (copied out by the bindings).
  std::vector<uint8_t> room_fixed, room_state;
  std::vector<int32_t> boxes_on_target, num_boxes, player;

 private:
  void step_one(int i, int32_t action, float* reward, uint8_t* success, uint8_t* valid, uint8_t* effective);
  void step_range(int64_t begin, int64_t end, const int32_t* actions, float* reward, uint8_t* terminated_out,
                  uint8_t* truncated_out, uint8_t* success, uint8_t* valid, uint8_t* effective);
  void update_walled(int i);

  SokobanParams p_;
  int cells_;
  std::vector<std::string> symbols_;
  int obs_format_;
  std::vector<std::unique_ptr<SokobanGenerator>> generators_;  // one per worker
  // Fast step path: walled[i] = 1 when every border cell of room_state[i] is a wall (always so for generated
  // levels; walls never move), so the player is always inside and no grid-bounds check is needed.
  std::vector<uint8_t> walled_;
  int delta_[4] = {};            // cell offset per action 1..4 (up, down, left, right)
  float reward_table_[6] = {};   // [(sign of box-on-target change + 1) * 2 + won], as step_one computes it
};

}  // namespace fastpo
