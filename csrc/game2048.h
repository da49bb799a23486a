// 2048 (RAGEN-2's game_2048): a struct-of-arrays batch of N boards. The pure-Python twin envs/py_game2048.py is the
// specification. Tiles are stored as exponents (0 empty, k = the tile 2^k), row-major, size * size per board.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "rng.h"
#include "text_writer.h"
#include "batch_core.h"

namespace fastpo {

constexpr int kGame2048MaxSize = 6;  // 2^(36 + 1) still fits the int64 tiles and score

class Game2048Batch : public BatchCore {
 public:
  // two_prob: probability that a new tile is a 2 (else a 4). use_log_reward: RAGEN's 0.1 * log2(merged + 1) for a
  // move that merges, 0 otherwise; else the merged sum, and -0.1 for a move that moves nothing.
  Game2048Batch(int num_envs, int size, double two_prob, bool use_log_reward, int max_steps, int num_threads);

  // New boards for instances with mask[i] (mask may be null = all): empty, then two spawned tiles.
  void reset(const int64_t* seeds, const uint8_t* mask);
  // Sets every board from tiles (num_envs * size * size values: 0 or a power of two >= 2); seeds start the spawn
  // streams. Throws std::invalid_argument naming the env and cell of a bad value.
  void set_boards(const int64_t* tiles, const int64_t* seeds);
  // actions: 1 Up, 2 Right, 3 Down, 4 Left (RAGEN's 0..3 plus one); anything else is no action.
  void step(const int32_t* actions, float* reward, uint8_t* terminated, uint8_t* truncated, uint8_t* success,
            uint8_t* valid, uint8_t* effective);
  // RAGEN's text observation per instance.
  void render_texts(TextBatch& out);  // the instances out.first .. + out.count - 1
  // Exact state key per instance: FNV-1a 64 over the exponents (size * size bytes) then the score (int64
  // little-endian). The step counter and the spawn stream are not part of it.
  void state_keys(uint64_t* out);

  int size() const { return size_; }
  // Raw state (copied out by the bindings).
  std::vector<uint8_t> exps;
  std::vector<int64_t> score;
  std::vector<uint64_t> spawn_key, spawn_counter;

 private:
  void start(int i, int64_t seed);
  void spawn(int i);
  // Slides board `g` in RAGEN direction dir (0 Up, 1 Right, 2 Down, 3 Left) into `out`; returns the merged sum.
  int64_t slide(const uint8_t* g, int dir, uint8_t* out) const;
  bool moves(const uint8_t* g, int dir) const;
  bool won(int i) const;

  int size_;
  int cells_;
  double two_prob_;
  bool use_log_reward_;
  std::vector<int> lines_;  // lines_[(dir * size + line) * size + k]: cell k of a line, from the wall it slides to
};

}  // namespace fastpo
