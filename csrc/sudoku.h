// Sudoku (RAGEN-2's sudoku env): a batch of N puzzles with RAGEN's generator, move rules, feedback and renders.
// The pure-Python twin envs/py_sudoku.py is the specification. Grids are G * G bytes (0 empty), row-major.
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

// Placement attempts of the generator's backtracking fill before giving up (never reached for 4x4 and 9x9).
constexpr int64_t kSudokuMaxFillSteps = 2000000;

// One parsed action: kind 0 none (the instance is not stepped), 1 a placement (0-based row and col, num in range),
// 2 an action RAGEN refuses with `error` (its parse_action message).
struct SudokuAction {
  int kind = 0;
  int row = 0, col = 0, num = 0;
  std::string error;
};

// RAGEN's parse_action for ASCII text: returns false when the text needs Python's parser (a number of more than
// 18 digits), true with `out` filled otherwise.
bool parse_sudoku_action(const char* text, size_t len, int grid_size, SudokuAction& out);

// The feedback line of an instance's last step, kept as codes: the step stays free of string building, and the
// render writes RAGEN's words (SudokuBatch::write_feedback).
struct SudokuFeedback {
  enum Kind : uint8_t { kNone, kFormat, kInitialCell, kConflict, kCorrect, kPlaced };
  uint8_t kind = kNone;
  uint8_t row = 0, col = 0, num = 0;  // 0-based row and col
  uint8_t where = 0;                   // kConflict: bit 0 the row, 1 the column, 2 the box already holds num
  bool solved = false;                 // kCorrect / kPlaced: the placement filled the grid
  uint16_t valid = 0;                  // kConflict on an empty cell: bit v set when v is allowed there
};

struct SudokuRender {
  int format = 2;  // 0 simple, 1 detailed, 2 with_feedback
  bool show_conflicts = true;
  bool show_valid_numbers = true;
};

class SudokuBatch : public BatchCore {
 public:
  // cells_to_remove: blanks per puzzle (RAGEN: int(G * G * 0.4 / 0.5 / 0.6) for easy / medium / hard).
  SudokuBatch(int num_envs, int grid_size, int cells_to_remove, int max_steps, SudokuRender render,
              double correct_score, double invalid_score, double completion_bonus, int num_threads);

  // New puzzles for instances with mask[i] (mask may be null = all). Throws std::runtime_error naming the seed
  // if the fill needs more than kSudokuMaxFillSteps placements.
  void reset(const int64_t* seeds, const uint8_t* mask);
  // Sets every instance from puzzles and solutions (num_envs * G * G each); the caller validated them.
  void set_puzzles(const uint8_t* initial, const uint8_t* solution);
  // actions: num_envs parsed actions (kind 0 = not stepped).
  void step(const SudokuAction* actions, float* reward, uint8_t* terminated, uint8_t* truncated, uint8_t* success,
            uint8_t* valid, uint8_t* effective);
  void render_texts(TextBatch& out);  // RAGEN's render of the instances out.first .. + out.count - 1
  // FNV-1a 64 over the puzzle then the current grid (G * G bytes each); not the feedback or the step counter.
  void state_keys(uint64_t* out);

  int grid_size() const { return g_; }
  // Raw state (copied out by the bindings).
  std::vector<uint8_t> initial, current, solution;
  std::vector<SudokuFeedback> feedback;
  std::vector<std::string> format_error;  // per instance: RAGEN's parse message when feedback is kFormat
  std::vector<uint8_t> solved;

 private:
  void generate(int i, int64_t seed);
  uint32_t used_mask(const uint8_t* grid, int row, int col) const;  // bit v: v is in the row, column or box
  void render_one(int i, TextBatch& out) const;
  TextWriter write_feedback(int i, TextWriter w) const;  // RAGEN's feedback line of instance i

  int g_, box_, cells_, remove_;
  uint8_t box_start_[9] = {};  // first row (column) of the box holding row (column) k: no division per step
  SudokuRender render_;
  double correct_score_, invalid_score_, completion_bonus_;
};

}  // namespace fastpo
