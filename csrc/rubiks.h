// 2x2 Rubik's cube (RAGEN-2's rubikscube env): a batch of N cubes of 24 stickers (faces U L F R B D, 4 stickers
// each, colours 0..5). The pure-Python twin envs/py_rubiks.py is the specification.
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

class RubiksBatch : public BatchCore {
 public:
  RubiksBatch(int num_envs, int scramble_depth, int max_steps, int num_threads);

  // Solved cubes scrambled by scramble_depth random moves (ids 1..12), for instances with mask[i] (null = all).
  void reset(const int64_t* seeds, const uint8_t* mask);
  // Sets every cube from stickers (num_envs * 24 colours in 0..5; the caller checked them).
  void set_cubes(const uint8_t* stickers);
  // actions: 1 U, 2 U', 3 D, 4 D', 5 L, 6 L', 7 R, 8 R', 9 F, 10 F', 11 B, 12 B'; anything else is no action.
  void step(const int32_t* actions, float* reward, uint8_t* terminated, uint8_t* truncated, uint8_t* success,
            uint8_t* valid, uint8_t* effective);
  void render_texts(TextBatch& out);  // RAGEN's render of the cubes out.first .. + out.count - 1
  // FNV-1a 64 over the 24 stickers; not the step counter.
  void state_keys(uint64_t* out);

  std::vector<uint8_t> stickers;

 private:
  void turn(uint8_t* s, int action) const;
  static bool solved(const uint8_t* s);

  int scramble_depth_;
};

}  // namespace fastpo
