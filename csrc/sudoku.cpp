#include "sudoku.h"

#include <algorithm>
#include <stdexcept>

#include "state_key.h"

namespace fastpo {

namespace {

// UTF-8 of RAGEN's feedback marks.
constexpr const char* kCross = "\xE2\x9D\x8C";     // U+274C
constexpr const char* kCheck = "\xE2\x9C\x93";     // U+2713
constexpr const char* kWarn = "\xE2\x9A\xA0";      // U+26A0
constexpr const char* kParty = "\xF0\x9F\x8E\x89"; // U+1F389
constexpr const char* kBulb = "\xF0\x9F\x92\xA1";  // U+1F4A1

// Python's str.isspace() on ASCII: \t \n \v \f \r, the separators 0x1C-0x1F, and space (also what \s matches).
inline bool py_space(unsigned char c) { return (c >= 9 && c <= 13) || (c >= 28 && c <= 32); }
inline bool digit(unsigned char c) { return c >= '0' && c <= '9'; }

// One element of a pattern: a literal, one-or-more / zero-or-more whitespace, or a captured run of digits.
struct Tok {
  enum Kind { kLit, kWsPlus, kWsStar, kNum } kind;
  const char* lit;
};

// RAGEN's six patterns, in its order. Every \s run and digit run is followed by a character it cannot match, so a
// greedy match from a fixed start is the regex's match.
const std::vector<std::vector<Tok>>& patterns() {
  using K = Tok;
  static const std::vector<std::vector<Tok>> p = {
      {{K::kLit, "place"}, {K::kWsPlus, ""}, {K::kNum, ""}, {K::kWsPlus, ""}, {K::kLit, "at"}, {K::kWsPlus, ""},
       {K::kLit, "row"}, {K::kWsPlus, ""}, {K::kNum, ""}, {K::kWsPlus, ""}, {K::kLit, "col"}, {K::kWsPlus, ""},
       {K::kNum, ""}},
      {{K::kLit, "place"}, {K::kWsPlus, ""}, {K::kNum, ""}, {K::kWsPlus, ""}, {K::kLit, "at"}, {K::kWsPlus, ""},
       {K::kLit, "("}, {K::kNum, ""}, {K::kLit, ","}, {K::kWsStar, ""}, {K::kNum, ""}, {K::kLit, ")"}},
      {{K::kLit, "place"}, {K::kWsPlus, ""}, {K::kNum, ""}, {K::kWsPlus, ""}, {K::kLit, "at"}, {K::kWsPlus, ""},
       {K::kNum, ""}, {K::kLit, ","}, {K::kWsStar, ""}, {K::kNum, ""}},
      {{K::kNum, ""}, {K::kWsPlus, ""}, {K::kLit, "at"}, {K::kWsPlus, ""}, {K::kNum, ""}, {K::kLit, ","},
       {K::kWsStar, ""}, {K::kNum, ""}},
      {{K::kLit, "("}, {K::kNum, ""}, {K::kLit, ","}, {K::kWsStar, ""}, {K::kNum, ""}, {K::kLit, ","},
       {K::kWsStar, ""}, {K::kNum, ""}, {K::kLit, ")"}},
      {{K::kNum, ""}, {K::kLit, ","}, {K::kWsStar, ""}, {K::kNum, ""}, {K::kLit, ","}, {K::kWsStar, ""},
       {K::kNum, ""}},
  };
  return p;
}

// Matches `pat` at s[start..); fills up to 3 digit-run spans. Returns 1 on a match, 0 on none, -1 when a captured
// number has more than 18 digits (Python's int would still read it).
int match_at(const std::string& s, size_t start, const std::vector<Tok>& pat, int64_t* nums) {
  size_t at = start;
  int captured = 0;
  for (const Tok& t : pat) {
    if (t.kind == Tok::kLit) {
      const size_t n = std::char_traits<char>::length(t.lit);
      if (s.compare(at, n, t.lit) != 0 || at + n > s.size()) return 0;
      at += n;
    } else if (t.kind == Tok::kWsPlus || t.kind == Tok::kWsStar) {
      const size_t from = at;
      while (at < s.size() && py_space(static_cast<unsigned char>(s[at]))) ++at;
      if (t.kind == Tok::kWsPlus && at == from) return 0;
    } else {
      const size_t from = at;
      while (at < s.size() && digit(static_cast<unsigned char>(s[at]))) ++at;
      if (at == from) return 0;
      if (at - from > 18) return -1;
      int64_t v = 0;
      for (size_t k = from; k < at; ++k) v = v * 10 + (s[k] - '0');
      nums[captured++] = v;
    }
  }
  return 1;
}

}  // namespace

bool parse_sudoku_action(const char* text, size_t len, int grid_size, SudokuAction& out) {
  size_t b = 0, e = len;
  while (b < e && py_space(static_cast<unsigned char>(text[b]))) ++b;
  while (e > b && py_space(static_cast<unsigned char>(text[e - 1]))) --e;
  std::string s(text + b, e - b);
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  for (const auto& pat : patterns()) {
    for (size_t start = 0; start <= s.size(); ++start) {
      int64_t nums[3] = {0, 0, 0};
      const int m = match_at(s, start, pat, nums);
      if (m < 0) return false;
      if (m == 0) continue;
      // RAGEN: "place NUM at ..." when the text says place or at anywhere, else "ROW,COL,NUM".
      const bool num_first = s.find("place") != std::string::npos || s.find("at") != std::string::npos;
      const int64_t num = num_first ? nums[0] : nums[2];
      const int64_t row = num_first ? nums[1] : nums[0];
      const int64_t col = num_first ? nums[2] : nums[1];
      const std::string range = " is out of range (1-" + std::to_string(grid_size) + ")";
      out.kind = 2;
      if (!(row >= 1 && row <= grid_size)) {
        out.error = "Row " + std::to_string(row) + range;
      } else if (!(col >= 1 && col <= grid_size)) {
        out.error = "Column " + std::to_string(col) + range;
      } else if (!(num >= 1 && num <= grid_size)) {
        out.error = "Number " + std::to_string(num) + range;
      } else {
        out.kind = 1;
        out.row = static_cast<int>(row - 1);
        out.col = static_cast<int>(col - 1);
        out.num = static_cast<int>(num);
      }
      return true;
    }
  }
  out.kind = 2;
  out.error = "Could not parse action: '" + s + "'. Expected format: 'place 5 at row 2 col 3' or '2,3,5'";
  return true;
}

SudokuBatch::SudokuBatch(int num_envs, int grid_size, int cells_to_remove, int max_steps, SudokuRender render,
                         double correct_score, double invalid_score, double completion_bonus, int num_threads)
    : n_(num_envs), g_(grid_size), box_(grid_size == 4 ? 2 : 3), cells_(grid_size * grid_size),
      remove_(cells_to_remove), max_steps_(max_steps), render_(render), correct_score_(correct_score),
      invalid_score_(invalid_score), completion_bonus_(completion_bonus),
      pool_(std::max(1, std::min(num_threads, 256))) {
  if (num_envs < 1) throw std::invalid_argument("num_envs must be >= 1, got " + std::to_string(num_envs));
  if (grid_size != 4 && grid_size != 9)
    throw std::invalid_argument("grid_size must be 4 or 9, got " + std::to_string(grid_size));
  if (cells_to_remove < 0 || cells_to_remove > cells_)
    throw std::invalid_argument("cells_to_remove must be in [0, " + std::to_string(cells_) + "], got " +
                                std::to_string(cells_to_remove));
  if (max_steps < 1) throw std::invalid_argument("max_steps must be >= 1, got " + std::to_string(max_steps));
  if (render.format < 0 || render.format > 2)
    throw std::invalid_argument("render format must be in [0, 2], got " + std::to_string(render.format));
  if (num_threads < 1 || num_threads > 256)
    throw std::invalid_argument("num_threads must be in [1, 256], got " + std::to_string(num_threads));
  const size_t total = static_cast<size_t>(n_) * cells_;
  initial.assign(total, 0);
  current.assign(total, 0);
  solution.assign(total, 0);
  num_steps.assign(n_, 0);
  feedback.assign(n_, std::string());
  terminated.assign(n_, 0);
  truncated.assign(n_, 0);
  solved.assign(n_, 0);
  ready.assign(n_, 0);
}

bool SudokuBatch::all_ready() const {
  if (all_ready_.load(std::memory_order_relaxed)) return true;
  return std::all_of(ready.begin(), ready.end(), [](uint8_t r) { return r != 0; });
}

uint32_t SudokuBatch::used_mask(const uint8_t* grid, int row, int col) const {
  uint32_t used = 0;
  for (int k = 0; k < g_; ++k) used |= (1u << grid[row * g_ + k]) | (1u << grid[k * g_ + col]);
  const int r0 = row / box_ * box_, c0 = col / box_ * box_;
  for (int r = r0; r < r0 + box_; ++r)
    for (int c = c0; c < c0 + box_; ++c) used |= 1u << grid[r * g_ + c];
  return used & ~1u;  // bit 0 is "empty"
}

void SudokuBatch::generate(int i, int64_t seed) {
  // RAGEN's generate_sudoku_puzzle: fill the first empty cell (row-major) with its numbers in shuffled order,
  // backtracking; then blank the first cells_to_remove cells of a shuffled row-major cell list.
  CounterRng rng(static_cast<uint64_t>(seed), kStreamSudoku);
  uint8_t* sol = &solution[static_cast<size_t>(i) * cells_];
  std::fill_n(sol, cells_, 0);
  // Shuffle (Python's random.shuffle with randbelow = randint): for k = n-1 .. 1, swap x[k] and x[randint(k+1)].
  auto shuffle = [&rng](uint8_t* x, int n) {
    for (int k = n - 1; k >= 1; --k) std::swap(x[k], x[rng.randint(static_cast<uint64_t>(k + 1))]);
  };
  std::vector<uint8_t> order(static_cast<size_t>(cells_) * g_);  // per depth: the shuffled numbers
  std::vector<int> next(cells_, 0);                               // per depth: the next index in order
  int64_t steps = 0;
  int depth = 0;  // the cells are filled in row-major order, so depth = cell
  auto enter = [&](int d) {
    for (int v = 0; v < g_; ++v) order[static_cast<size_t>(d) * g_ + v] = static_cast<uint8_t>(v + 1);
    shuffle(&order[static_cast<size_t>(d) * g_], g_);
    next[d] = 0;
  };
  enter(0);
  while (depth < cells_) {
    const int row = depth / g_, col = depth % g_;
    sol[depth] = 0;
    const uint32_t used = used_mask(sol, row, col);
    bool placed = false;
    while (next[depth] < g_) {
      const uint8_t v = order[static_cast<size_t>(depth) * g_ + next[depth]++];
      if (++steps > kSudokuMaxFillSteps)
        throw std::runtime_error("Sudoku fill for seed " + std::to_string(seed) + " took more than " +
                                 std::to_string(kSudokuMaxFillSteps) + " placements");
      if (used & (1u << v)) continue;
      sol[depth] = v;
      placed = true;
      break;
    }
    if (placed) {
      if (++depth < cells_) enter(depth);
    } else {
      if (depth == 0) throw std::runtime_error("Sudoku fill found no grid");  // unreachable for a valid size
      --depth;  // backtrack: the previous cell tries its next number
    }
  }
  std::vector<uint8_t> cells(cells_);
  for (int c = 0; c < cells_; ++c) cells[c] = static_cast<uint8_t>(c);
  shuffle(cells.data(), cells_);
  uint8_t* ini = &initial[static_cast<size_t>(i) * cells_];
  std::copy(sol, sol + cells_, ini);
  for (int k = 0; k < remove_; ++k) ini[cells[k]] = 0;
}

void SudokuBatch::reset(const int64_t* seeds, const uint8_t* mask) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.parallel_for(n_, 16, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (mask != nullptr && !mask[i]) continue;
      generate(static_cast<int>(i), seeds[i]);
      const size_t at = static_cast<size_t>(i) * cells_;
      std::copy(&initial[at], &initial[at] + cells_, &current[at]);
      num_steps[i] = 0;
      feedback[i].clear();
      terminated[i] = truncated[i] = solved[i] = 0;
      ready[i] = 1;
    }
  });
  all_ready_.store(std::all_of(ready.begin(), ready.end(), [](uint8_t r) { return r != 0; }));
}

void SudokuBatch::set_puzzles(const uint8_t* initial_in, const uint8_t* solution_in) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t total = static_cast<size_t>(n_) * cells_;
  std::copy(initial_in, initial_in + total, initial.begin());
  std::copy(initial_in, initial_in + total, current.begin());
  std::copy(solution_in, solution_in + total, solution.begin());
  for (int i = 0; i < n_; ++i) {
    num_steps[i] = 0;
    feedback[i].clear();
    terminated[i] = truncated[i] = solved[i] = 0;
    ready[i] = 1;
  }
  all_ready_.store(true);
}

void SudokuBatch::step(const SudokuAction* actions, float* reward, uint8_t* terminated_out, uint8_t* truncated_out,
                       uint8_t* success, uint8_t* valid, uint8_t* effective) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.run(n_, 1024, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      reward[i] = 0.0f;
      valid[i] = effective[i] = 0;
      const SudokuAction& a = actions[i];
      if (a.kind != 0 && !terminated[i] && !truncated[i]) {
        const int steps = ++num_steps[i];
        uint8_t* grid = &current[static_cast<size_t>(i) * cells_];
        const std::string at = "(" + std::to_string(a.row + 1) + "," + std::to_string(a.col + 1) + ")";
        if (a.kind == 2) {
          feedback[i] = std::string(kCross) + " Invalid action format: " + a.error;
          reward[i] = static_cast<float>(invalid_score_);
        } else if (initial[static_cast<size_t>(i) * cells_ + a.row * g_ + a.col] != 0) {
          feedback[i] = std::string(kCross) + " Cannot modify initial cell at " + at;
          reward[i] = static_cast<float>(invalid_score_);
        } else if (used_mask(grid, a.row, a.col) & (1u << a.num)) {
          // Which of row, column and box already hold the number (the cell itself included, as RAGEN checks).
          std::string where;
          auto add = [&where](const std::string& w) { where += (where.empty() ? "" : ", ") + w; };
          bool in_row = false, in_col = false, in_box = false;
          for (int k = 0; k < g_; ++k) {
            in_row |= grid[a.row * g_ + k] == a.num;
            in_col |= grid[k * g_ + a.col] == a.num;
          }
          const int r0 = a.row / box_ * box_, c0 = a.col / box_ * box_;
          for (int r = r0; r < r0 + box_; ++r)
            for (int c = c0; c < c0 + box_; ++c) in_box |= grid[r * g_ + c] == a.num;
          if (in_row) add("row " + std::to_string(a.row + 1));
          if (in_col) add("column " + std::to_string(a.col + 1));
          if (in_box) add("box (" + std::to_string(r0 / box_ + 1) + "," + std::to_string(c0 / box_ + 1) + ")");
          feedback[i] = std::string(kCross) + " Invalid placement: " + std::to_string(a.num) + " conflicts with " +
                        where;
          if (grid[a.row * g_ + a.col] == 0) {  // RAGEN lists valid numbers only for an empty cell
            const uint32_t used = used_mask(grid, a.row, a.col);
            std::string list;
            for (int v = 1; v <= g_; ++v)
              if (!(used & (1u << v))) list += (list.empty() ? "" : ", ") + std::to_string(v);
            if (!list.empty()) feedback[i] += "\n   Valid numbers for " + at + ": [" + list + "]";
          }
          reward[i] = static_cast<float>(invalid_score_);
        } else {
          grid[a.row * g_ + a.col] = static_cast<uint8_t>(a.num);
          const bool correct = solution[static_cast<size_t>(i) * cells_ + a.row * g_ + a.col] == a.num;
          double r;
          if (correct) {
            feedback[i] = std::string(kCheck) + " Correct! Placed " + std::to_string(a.num) + " at " + at;
            r = correct_score_;
          } else {
            feedback[i] = std::string(kWarn) + " Placed " + std::to_string(a.num) + " at " + at +
                          " - Valid but not optimal";
            r = correct_score_ * 0.5;
          }
          // Placements never conflict (each is checked), so a full grid is a solved one.
          const bool full = std::find(grid, grid + cells_, 0) == grid + cells_;
          if (full) {
            feedback[i] += std::string("\n") + kParty + " Congratulations! Puzzle solved!";
            r += completion_bonus_;
          }
          reward[i] = static_cast<float>(r);
          solved[i] = full;
          terminated[i] = full;
          truncated[i] = !full && steps >= max_steps_;
          valid[i] = effective[i] = 1;
        }
      }
      success[i] = solved[i];
      terminated_out[i] = terminated[i];
      truncated_out[i] = truncated[i];
    }
  });
}

void SudokuBatch::render_one(int i, std::string& s) const {
  const uint8_t* grid = &current[static_cast<size_t>(i) * cells_];
  const uint8_t* ini = &initial[static_cast<size_t>(i) * cells_];
  s.clear();
  s.reserve(1024);  // a 9x9 "with_feedback" render is about 700 bytes
  if (render_.format == 0) {  // format_grid_simple
    for (int r = 0; r < g_; ++r) {
      if (r > 0) s += '\n';
      if (r > 0 && r % box_ == 0) s += std::string(g_ * 2 + box_ - 1, '-') + "\n";
      std::string row;
      for (int c = 0; c < g_; ++c) {
        if (c > 0 && c % box_ == 0) row += "| ";
        row += (grid[r * g_ + c] ? std::to_string(grid[r * g_ + c]) : std::string(".")) + " ";
      }
      while (!row.empty() && row.back() == ' ') row.pop_back();
      s += row;
    }
    return;
  }
  const std::string bar(50, '=');
  s = bar + "\nSUDOKU PUZZLE\n" + bar + "\n";
  for (int r = 0; r < g_; ++r) {  // format_grid_with_conflicts (a grid here never has conflicts)
    if (r > 0) s += '\n';
    if (r > 0 && r % box_ == 0) s += std::string(g_ * 3 + box_ - 1, '-') + "\n";
    std::string row;
    for (int c = 0; c < g_; ++c) {
      if (c > 0 && c % box_ == 0) row += "| ";
      const uint8_t v = grid[r * g_ + c];
      if (v == 0) {
        row += " . ";
      } else if (ini[r * g_ + c] != 0) {
        row += "[" + std::to_string(v) + "]";
      } else {
        row += " " + std::to_string(v) + " ";
      }
    }
    while (!row.empty() && row.back() == ' ') row.pop_back();
    s += row;
  }
  s += "\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty";
  if (!feedback[i].empty()) s += "\n\n" + feedback[i];
  if (render_.format == 1) return;
  if (render_.show_valid_numbers) {
    int empty = 0;
    for (int c = 0; c < cells_; ++c) empty += grid[c] == 0;
    if (empty > 0 && empty <= 10) {
      s += std::string("\n\n") + kBulb + " VALID NUMBERS FOR EMPTY CELLS:";
      for (int c = 0; c < cells_; ++c) {
        if (grid[c] != 0) continue;
        const uint32_t used = used_mask(grid, c / g_, c % g_);
        std::string list;
        for (int v = 1; v <= g_; ++v)
          if (!(used & (1u << v))) list += (list.empty() ? "" : ", ") + std::to_string(v);
        if (!list.empty())
          s += "\n  - (" + std::to_string(c / g_ + 1) + "," + std::to_string(c % g_ + 1) + "): [" + list + "]";
      }
    }
  }
  int filled = 0, given = 0;
  for (int c = 0; c < cells_; ++c) {
    filled += grid[c] != 0;
    given += ini[c] != 0;
  }
  s += "\n\nProgress: " + std::to_string(filled) + "/" + std::to_string(cells_) + " cells filled (" +
       std::to_string(given) + " initial, " + std::to_string(filled - given) + " placed)\nSteps: " +
       std::to_string(num_steps[i]) + "/" + std::to_string(max_steps_);
}

void SudokuBatch::render_texts(std::string* out) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.run(n_, 256, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) render_one(static_cast<int>(i), out[i]);
  });
}

void SudokuBatch::state_keys(uint64_t* out) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.run(n_, 4096, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const size_t at = static_cast<size_t>(i) * cells_;
      out[i] = fnv1a64(&current[at], cells_, fnv1a64(&initial[at], cells_));
    }
  });
}

}  // namespace fastpo
