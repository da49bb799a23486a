#include "sudoku.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "state_key.h"
#include "text_writer.h"

namespace fastpo {

namespace {

// UTF-8 of RAGEN's feedback marks.
constexpr const char* kCross = "\xE2\x9D\x8C";     // U+274C
constexpr const char* kCheck = "\xE2\x9C\x93";     // U+2713
constexpr const char* kWarn = "\xE2\x9A\xA0";      // U+26A0
constexpr const char* kParty = "\xF0\x9F\x8E\x89"; // U+1F389
constexpr const char* kBulb = "\xF0\x9F\x92\xA1";  // U+1F4A1

// A cell of the simple render by its number (0 empty), and of the detailed one by the initial puzzle's number
// there (0: not given) and its number now: " . " empty, "[N]" given, " N " placed. Numbers stop at 9 (grids are
// 4x4 or 9x9).
constexpr char kSimpleCell[10] = {'.', '1', '2', '3', '4', '5', '6', '7', '8', '9'};
struct DetailedCells {
  char c[10][10][3];
  DetailedCells() : c{} {
    for (int given = 0; given < 10; ++given)
      for (int v = 0; v < 10; ++v) {
        const char d = static_cast<char>('0' + v);
        const char cell[3] = {v == 0 ? ' ' : given ? '[' : ' ', v == 0 ? '.' : d, v == 0 ? ' ' : given ? ']' : ' '};
        std::memcpy(c[given][v], cell, 3);
      }
  }
};
const DetailedCells kDetailedCell;

// Python's str.isspace() on ASCII: \t \n \v \f \r, the separators 0x1C-0x1F, and space (also what \s matches).
inline bool py_space(unsigned char c) { return (c >= 9 && c <= 13) || (c >= 28 && c <= 32); }
inline bool digit(unsigned char c) { return c >= '0' && c <= '9'; }

// One element of a pattern: a literal, one-or-more / zero-or-more whitespace, or a captured run of digits.
struct Tok {
  enum Kind { kLit, kWsPlus, kWsStar, kNum } kind;
  const char* lit;
  size_t len;  // of lit, counted once here rather than at every match attempt
  Tok(Kind k, const char* l) : kind(k), lit(l), len(std::char_traits<char>::length(l)) {}
};

// Whether s[at..n) starts with the literal (a loop: the literals are 1 to 5 bytes, too short for memcmp's call).
inline bool starts_with(const char* s, size_t n, size_t at, const char* lit, size_t len) {
  if (at + len > n) return false;
  for (size_t k = 0; k < len; ++k)
    if (s[at + k] != lit[k]) return false;
  return true;
}

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

// Matches `pat` at s[start..n); fills up to 3 digit-run spans. Returns 1 on a match, 0 on none, -1 when a captured
// number has more than 18 digits (Python's int would still read it).
int match_at(const char* s, size_t n, size_t start, const std::vector<Tok>& pat, int64_t* nums) {
  size_t at = start;
  int captured = 0;
  for (const Tok& t : pat) {
    if (t.kind == Tok::kLit) {
      if (!starts_with(s, n, at, t.lit, t.len)) return 0;
      at += t.len;
    } else if (t.kind == Tok::kWsPlus || t.kind == Tok::kWsStar) {
      const size_t from = at;
      while (at < n && py_space(static_cast<unsigned char>(s[at]))) ++at;
      if (t.kind == Tok::kWsPlus && at == from) return 0;
    } else {
      const size_t from = at;
      while (at < n && digit(static_cast<unsigned char>(s[at]))) ++at;
      if (at == from) return 0;
      if (at - from > 18) return -1;
      int64_t v = 0;
      for (size_t k = from; k < at; ++k) v = v * 10 + (s[k] - '0');
      nums[captured++] = v;
    }
  }
  return 1;
}

bool contains(const char* s, size_t n, const char* word, size_t len) {
  for (size_t k = 0; k + len <= n; ++k)
    if (s[k] == word[0] && starts_with(s, n, k, word, len)) return true;
  return false;
}

}  // namespace

namespace {

// A match's numbers -> a placement, or RAGEN's out-of-range message (row, then column, then number).
void finish_action(int64_t row, int64_t col, int64_t num, int grid_size, SudokuAction& out) {
  const char* label = !(row >= 1 && row <= grid_size)   ? "Row "
                      : !(col >= 1 && col <= grid_size) ? "Column "
                      : !(num >= 1 && num <= grid_size) ? "Number "
                                                        : nullptr;
  if (label != nullptr) {
    const int64_t bad = label[0] == 'R' ? row : label[0] == 'C' ? col : num;
    out.kind = 2;
    out.error = label + std::to_string(bad) + " is out of range (1-" + std::to_string(grid_size) + ")";
    return;
  }
  out.kind = 1;
  out.row = static_cast<int>(row - 1);
  out.col = static_cast<int>(col - 1);
  out.num = static_cast<int>(num);
}

// RAGEN's two canonical forms with one-digit numbers, exactly as its prompt spells them: "R,C,N" and
// "place N at row R col C". For these the general search below finds the same match (the first form has no "place"
// or "at", no "(", so only the last pattern applies, at the start; the second is the first pattern, at the start),
// so they skip it: they are what a policy writes almost every time.
bool parse_canonical(const char* t, size_t len, int grid_size, SudokuAction& out) {
  auto d = [t](size_t k) { return static_cast<unsigned>(static_cast<unsigned char>(t[k])) - unsigned{'0'}; };
  if (len == 5 && t[1] == ',' && t[3] == ',' && d(0) <= 9 && d(2) <= 9 && d(4) <= 9) {
    finish_action(d(0), d(2), d(4), grid_size, out);  // row, col, num
    return true;
  }
  static constexpr char kPlace[] = "place _ at row _ col _";
  if (len == sizeof(kPlace) - 1 && d(6) <= 9 && d(15) <= 9 && d(21) <= 9) {
    for (size_t k = 0; k < len; ++k)
      if (kPlace[k] != '_' && t[k] != kPlace[k]) return false;
    finish_action(d(15), d(21), d(6), grid_size, out);
    return true;
  }
  return false;
}

}  // namespace

bool parse_sudoku_action(const char* text, size_t len, int grid_size, SudokuAction& out) {
  if (parse_canonical(text, len, grid_size, out)) return true;
  size_t b = 0, e = len;
  while (b < e && py_space(static_cast<unsigned char>(text[b]))) ++b;
  while (e > b && py_space(static_cast<unsigned char>(text[e - 1]))) --e;
  // The stripped, lowercased text: on the stack for the usual short action, on the heap otherwise.
  const size_t n = e - b;
  char stack[256];
  std::string heap;
  char* s = n <= sizeof(stack) ? stack : (heap.resize(n), &heap[0]);
  for (size_t k = 0; k < n; ++k) {
    const char c = text[b + k];
    s[k] = c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
  }
  // RAGEN: "place NUM at ..." when the text says place or at anywhere, else "ROW,COL,NUM". The first three patterns
  // need "place" and the fourth "at", so a text without them skips those.
  const bool has_place = contains(s, n, "place", 5), has_at = contains(s, n, "at", 2);
  const bool num_first = has_place || has_at;
  const auto& pats = patterns();
  for (size_t p = 0; p < pats.size(); ++p) {
    if ((p < 3 && !has_place) || (p == 3 && !has_at)) continue;
    for (size_t start = 0; start <= n; ++start) {
      int64_t nums[3] = {0, 0, 0};
      const int m = match_at(s, n, start, pats[p], nums);
      if (m < 0) return false;
      if (m == 0) continue;
      const int64_t num = num_first ? nums[0] : nums[2];
      const int64_t row = num_first ? nums[1] : nums[0];
      const int64_t col = num_first ? nums[2] : nums[1];
      finish_action(row, col, num, grid_size, out);
      return true;
    }
  }
  out.kind = 2;
  out.error = "Could not parse action: '" + std::string(s, n) +
              "'. Expected format: 'place 5 at row 2 col 3' or '2,3,5'";
  return true;
}

SudokuBatch::SudokuBatch(int num_envs, int grid_size, int cells_to_remove, int max_steps, SudokuRender render,
                         double correct_score, double invalid_score, double completion_bonus, int num_threads)
    : BatchCore(num_envs, max_steps, num_threads), g_(grid_size), box_(grid_size == 4 ? 2 : 3),
      cells_(grid_size * grid_size), remove_(cells_to_remove), render_(render), correct_score_(correct_score),
      invalid_score_(invalid_score), completion_bonus_(completion_bonus) {
  if (grid_size != 4 && grid_size != 9)
    throw std::invalid_argument("grid_size must be 4 or 9, got " + std::to_string(grid_size));
  if (cells_to_remove < 0 || cells_to_remove > cells_)
    throw std::invalid_argument("cells_to_remove must be in [0, " + std::to_string(cells_) + "], got " +
                                std::to_string(cells_to_remove));
  if (render.format < 0 || render.format > 2)
    throw std::invalid_argument("render format must be in [0, 2], got " + std::to_string(render.format));
  for (int k = 0; k < g_; ++k) box_start_[k] = static_cast<uint8_t>(k / box_ * box_);
  const size_t total = static_cast<size_t>(n_) * cells_;
  initial.assign(total, 0);
  current.assign(total, 0);
  solution.assign(total, 0);
  feedback.assign(n_, SudokuFeedback{});
  format_error.assign(n_, std::string());
  solved.assign(n_, 0);
}

uint32_t SudokuBatch::used_mask(const uint8_t* grid, int row, int col) const {
  uint32_t used = 0;
  for (int k = 0; k < g_; ++k) used |= (1u << grid[row * g_ + k]) | (1u << grid[k * g_ + col]);
  const int r0 = box_start_[row], c0 = box_start_[col];
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
  reset_masked(seeds, mask, 16, [&](int, int64_t i, int64_t seed) {
    generate(static_cast<int>(i), seed);
    const size_t at = static_cast<size_t>(i) * cells_;
    std::copy(&initial[at], &initial[at] + cells_, &current[at]);
    begin_episode(i);
    feedback[i] = SudokuFeedback{};
    solved[i] = 0;
  });
}

void SudokuBatch::set_puzzles(const uint8_t* initial_in, const uint8_t* solution_in) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t total = static_cast<size_t>(n_) * cells_;
  std::copy(initial_in, initial_in + total, initial.begin());
  std::copy(initial_in, initial_in + total, current.begin());
  std::copy(solution_in, solution_in + total, solution.begin());
  for (int i = 0; i < n_; ++i) {
    begin_episode(i);
    feedback[i] = SudokuFeedback{};
    solved[i] = 0;
  }
  set_all_ready();
}

void SudokuBatch::step(const SudokuAction* actions, float* reward, uint8_t* terminated_out, uint8_t* truncated_out,
                       uint8_t* success, uint8_t* valid, uint8_t* effective) {
  for_each_instance(1024, [&](int64_t i) {
    reward[i] = 0.0f;
    valid[i] = effective[i] = 0;
    const SudokuAction& a = actions[i];
    if (a.kind != 0 && !terminated[i] && !truncated[i]) {
      const int steps = ++num_steps[i];
      uint8_t* grid = &current[static_cast<size_t>(i) * cells_];
      SudokuFeedback& f = feedback[i];
      f = SudokuFeedback{};
      f.row = static_cast<uint8_t>(a.row);
      f.col = static_cast<uint8_t>(a.col);
      f.num = static_cast<uint8_t>(a.num);
      const uint32_t used = a.kind == 1 ? used_mask(grid, a.row, a.col) : 0;
      if (a.kind == 2) {
        f.kind = SudokuFeedback::kFormat;
        format_error[i] = a.error;
        reward[i] = static_cast<float>(invalid_score_);
      } else if (initial[static_cast<size_t>(i) * cells_ + a.row * g_ + a.col] != 0) {
        f.kind = SudokuFeedback::kInitialCell;
        reward[i] = static_cast<float>(invalid_score_);
      } else if (used & (1u << a.num)) {
        // Which of row, column and box already hold the number (the cell itself included, as RAGEN checks).
        f.kind = SudokuFeedback::kConflict;
        bool in_row = false, in_col = false, in_box = false;
        for (int k = 0; k < g_; ++k) {
          in_row |= grid[a.row * g_ + k] == a.num;
          in_col |= grid[k * g_ + a.col] == a.num;
        }
        const int r0 = box_start_[a.row], c0 = box_start_[a.col];
        for (int r = r0; r < r0 + box_; ++r)
          for (int c = c0; c < c0 + box_; ++c) in_box |= grid[r * g_ + c] == a.num;
        f.where = static_cast<uint8_t>(in_row | in_col << 1 | in_box << 2);
        // RAGEN lists the valid numbers only for an empty cell.
        if (grid[a.row * g_ + a.col] == 0) f.valid = static_cast<uint16_t>(~used & ((2u << g_) - 2));
        reward[i] = static_cast<float>(invalid_score_);
      } else {
        grid[a.row * g_ + a.col] = static_cast<uint8_t>(a.num);
        const bool correct = solution[static_cast<size_t>(i) * cells_ + a.row * g_ + a.col] == a.num;
        f.kind = correct ? SudokuFeedback::kCorrect : SudokuFeedback::kPlaced;
        double r = correct ? correct_score_ : correct_score_ * 0.5;
        // Placements never conflict (each is checked), so a full grid is a solved one.
        const bool full = std::find(grid, grid + cells_, 0) == grid + cells_;
        if (full) r += completion_bonus_;
        f.solved = full;
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
  });
}

namespace {

// The writers take and return the TextWriter by value: its pointer then stays in a register (a reference would
// let every char store alias it, a store-to-load round trip per character).

// The grid, RAGEN's format_grid_simple (cells "N " or ". ") or, detailed, format_grid_with_conflicts (cells " . ",
// "[N]" given, " N " placed); "| " between boxes, a dashed line between bands, each row's trailing spaces stripped.
// On a plain pointer, and box borders by counters, not r % box: a division, a branch on whether a cell is empty or
// a pointer kept in memory cost more per cell than the rest of the render.
char* write_grid(char* p, const uint8_t* grid, const uint8_t* ini, int g, int box, bool detailed) {
  const int width = detailed ? 3 : 2;
  for (int r = 0, rk = 0; r < g; ++r, ++rk) {
    if (r > 0) *p++ = '\n';
    if (rk == box) {
      std::memset(p, '-', static_cast<size_t>(g * width + box - 1));
      p += g * width + box - 1;
      *p++ = '\n';
      rk = 0;
    }
    for (int c = 0, ck = 0; c < g; ++c, ++ck) {
      if (ck == box) {
        *p++ = '|';
        *p++ = ' ';
        ck = 0;
      }
      const int k = r * g + c;
      if (detailed) {
        std::memcpy(p, kDetailedCell.c[ini[k]][grid[k]], 3);
      } else {
        p[0] = kSimpleCell[grid[k]];
        p[1] = ' ';
      }
      p += width;
    }
    if (p[-1] == ' ') --p;  // the row's trailing space; "]", "." or a digit stays
  }
  return p;
}

// "(r,c)" 1-based, as RAGEN names a cell.
TextWriter write_cell(TextWriter w, int row, int col) {
  w.ch('(');
  w.num(row + 1);
  w.ch(',');
  w.num(col + 1);
  w.ch(')');
  return w;
}

// "[a, b, c]": the numbers whose bit is set in `mask` (bit v = number v).
TextWriter write_numbers(TextWriter w, uint32_t mask, int g) {
  w.ch('[');
  bool first = true;
  for (int v = 1; v <= g; ++v) {
    if (!(mask & (1u << v))) continue;
    if (!first) w.lit(", ");
    w.num(v);
    first = false;
  }
  w.ch(']');
  return w;
}

}  // namespace

TextWriter SudokuBatch::write_feedback(int i, TextWriter w) const {
  const SudokuFeedback& f = feedback[i];
  switch (f.kind) {
    case SudokuFeedback::kFormat:
      w.put(kCross, 3);
      w.lit(" Invalid action format: ");
      w.str(format_error[i]);
      return w;
    case SudokuFeedback::kInitialCell:
      w.put(kCross, 3);
      w.lit(" Cannot modify initial cell at ");
      w = write_cell(w, f.row, f.col);
      return w;
    case SudokuFeedback::kConflict: {
      w.put(kCross, 3);
      w.lit(" Invalid placement: ");
      w.num(f.num);
      w.lit(" conflicts with ");
      bool first = true;
      auto sep = [&]() {
        if (!first) w.lit(", ");
        first = false;
      };
      if (f.where & 1) {
        sep();
        w.lit("row ");
        w.num(f.row + 1);
      }
      if (f.where & 2) {
        sep();
        w.lit("column ");
        w.num(f.col + 1);
      }
      if (f.where & 4) {
        sep();
        w.lit("box (");
        w.num(f.row / box_ + 1);
        w.ch(',');
        w.num(f.col / box_ + 1);
        w.ch(')');
      }
      if (f.valid != 0) {
        w.lit("\n   Valid numbers for ");
        w = write_cell(w, f.row, f.col);
        w.lit(": ");
        w = write_numbers(w, f.valid, g_);
      }
      return w;
    }
    case SudokuFeedback::kCorrect:
    case SudokuFeedback::kPlaced:
      if (f.kind == SudokuFeedback::kCorrect) {
        w.put(kCheck, 3);
        w.lit(" Correct! Placed ");
      } else {
        w.put(kWarn, 3);
        w.lit(" Placed ");
      }
      w.num(f.num);
      w.lit(" at ");
      w = write_cell(w, f.row, f.col);
      if (f.kind == SudokuFeedback::kPlaced) w.lit(" - Valid but not optimal");
      if (f.solved) {
        w.ch('\n');
        w.put(kParty, 4);
        w.lit(" Congratulations! Puzzle solved!");
      }
      return w;
    default:
      return w;
  }
}

void SudokuBatch::render_one(int i, TextBatch& out) const {
  // Locals, not members: a char store may alias any member, which would then be reloaded after every character.
  const int g = g_, box = box_, cells = cells_;
  const uint8_t* grid = &current[static_cast<size_t>(i) * cells];
  const uint8_t* ini = &initial[static_cast<size_t>(i) * cells];
  // A 9x9 "with_feedback" render is about 700 bytes and never more than 1500 plus the parse message it quotes.
  const bool with_error = feedback[i].kind == SudokuFeedback::kFormat;
  TextWriter w = out.begin(i, 1536 + (with_error ? format_error[i].size() : 0));
  if (render_.format == 0) {  // format_grid_simple
    w.p = write_grid(w.p, grid, ini, g, box, false);
    out.end(i, w);
    return;
  }
  w.fill('=', 50);
  w.lit("\nSUDOKU PUZZLE\n");
  w.fill('=', 50);
  w.ch('\n');
  w.p = write_grid(w.p, grid, ini, g, box, true);  // format_grid_with_conflicts (a grid never has conflicts here)
  w.lit("\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty");
  if (feedback[i].kind != SudokuFeedback::kNone) {
    w.lit("\n\n");
    w = write_feedback(i, w);
  }
  if (render_.format == 1) {
    out.end(i, w);
    return;
  }
  int filled = 0, given = 0;
  for (int c = 0; c < cells; ++c) {
    filled += grid[c] != 0;
    given += ini[c] != 0;
  }
  const int empty = cells - filled;
  if (render_.show_valid_numbers && empty > 0 && empty <= 10) {
    w.lit("\n\n");
    w.put(kBulb, 4);
    w.lit(" VALID NUMBERS FOR EMPTY CELLS:");
    for (int c = 0; c < cells; ++c) {
      if (grid[c] != 0) continue;
      const uint32_t allowed = ~used_mask(grid, c / g, c % g) & ((2u << g) - 2);
      if (allowed == 0) continue;
      w.lit("\n  - ");
      w = write_cell(w, c / g, c % g);
      w.lit(": ");
      w = write_numbers(w, allowed, g);
    }
  }
  w.lit("\n\nProgress: ");
  w.num(filled);
  w.ch('/');
  w.num(cells);
  w.lit(" cells filled (");
  w.num(given);
  w.lit(" initial, ");
  w.num(filled - given);
  w.lit(" placed)\nSteps: ");
  w.num(num_steps[i]);
  w.ch('/');
  w.num(max_steps_);
  out.end(i, w);
}

void SudokuBatch::render_texts(TextBatch& out) {
  for_range(out.first, out.first + out.count, 256, [&](int64_t i) { render_one(static_cast<int>(i), out); });
}

void SudokuBatch::state_keys(uint64_t* out) {
  keys_into(out, [this](int64_t i) {
    const size_t at = static_cast<size_t>(i) * cells_;
    return fnv1a64(&current[at], cells_, fnv1a64(&initial[at], cells_));
  });
}

}  // namespace fastpo
