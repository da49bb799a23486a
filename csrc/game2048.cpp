#include "game2048.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "state_key.h"

namespace fastpo {

Game2048Batch::Game2048Batch(int num_envs, int size, double two_prob, bool use_log_reward, int max_steps,
                             int num_threads)
    : BatchCore(num_envs, max_steps, num_threads), size_(size), cells_(size * size), two_prob_(two_prob),
      use_log_reward_(use_log_reward) {
  if (size < 2 || size > kGame2048MaxSize)
    throw std::invalid_argument("size must be in [2, " + std::to_string(kGame2048MaxSize) + "], got " +
                                std::to_string(size));
  if (!(two_prob >= 0.0 && two_prob <= 1.0))
    throw std::invalid_argument("two_prob must be in [0, 1], got " + std::to_string(two_prob));
  exps.assign(static_cast<size_t>(n_) * cells_, 0);
  score.assign(n_, 0);
  spawn_key.assign(n_, 0);
  spawn_counter.assign(n_, 0);
  // RAGEN's _move_sim: Up = columns top-down, Right = rows right-left, Down = columns bottom-up, Left = rows.
  lines_.resize(static_cast<size_t>(4) * size_ * size_);
  for (int line = 0; line < size_; ++line)
    for (int k = 0; k < size_; ++k) {
      lines_[(0 * size_ + line) * size_ + k] = k * size_ + line;
      lines_[(1 * size_ + line) * size_ + k] = line * size_ + (size_ - 1 - k);
      lines_[(2 * size_ + line) * size_ + k] = (size_ - 1 - k) * size_ + line;
      lines_[(3 * size_ + line) * size_ + k] = line * size_ + k;
    }
}

void Game2048Batch::spawn(int i) {
  // RAGEN's _spawn_tile: a uniformly chosen empty cell (row-major order), a 2 w.p. two_prob else a 4.
  uint8_t* g = &exps[static_cast<size_t>(i) * cells_];
  int empty[kGame2048MaxSize * kGame2048MaxSize];
  int count = 0;
  for (int c = 0; c < cells_; ++c)
    if (g[c] == 0) empty[count++] = c;
  if (count == 0) return;
  CounterRng rng = CounterRng::resume(spawn_key[i], spawn_counter[i]);
  const int cell = empty[rng.randint(static_cast<uint64_t>(count))];
  g[cell] = rng.uniform() < two_prob_ ? 1 : 2;
  spawn_counter[i] = rng.counter;
}

void Game2048Batch::start(int i, int64_t seed) {
  std::fill_n(&exps[static_cast<size_t>(i) * cells_], cells_, 0);
  score[i] = 0;
  spawn_key[i] = rng_key(static_cast<uint64_t>(seed), kStreamGame2048, 0);
  spawn_counter[i] = 0;
  begin_episode(i);
}

void Game2048Batch::reset(const int64_t* seeds, const uint8_t* mask) {
  reset_masked(seeds, mask, 1024, [&](int, int64_t i, int64_t seed) {
    start(static_cast<int>(i), seed);
    spawn(static_cast<int>(i));
    spawn(static_cast<int>(i));
  });
}

void Game2048Batch::set_boards(const int64_t* tiles, const int64_t* seeds) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t total = static_cast<size_t>(n_) * cells_;
  for (size_t c = 0; c < total; ++c) {
    const int64_t v = tiles[c];
    if (v != 0 && (v < 2 || (v & (v - 1)) != 0 || v > (int64_t{1} << 40)))
      throw std::invalid_argument("board of env " + std::to_string(c / cells_) + ": cell " +
                                  std::to_string(c % cells_) + " holds " + std::to_string(v) +
                                  "; tiles are 0 (empty) or a power of two in [2, 2^40]");
  }
  for (int i = 0; i < n_; ++i) {
    start(i, seeds[i]);
    for (int c = 0; c < cells_; ++c) {
      const int64_t v = tiles[static_cast<size_t>(i) * cells_ + c];
      uint8_t e = 0;
      while (v != 0 && (int64_t{1} << e) != v) ++e;
      exps[static_cast<size_t>(i) * cells_ + c] = e;
    }
  }
  set_all_ready();
}

int64_t Game2048Batch::slide(const uint8_t* g, int dir, uint8_t* out) const {
  // RAGEN's _compress_and_merge on each line: drop the empties, merge equal neighbours left to right (a merged
  // tile does not merge again), pad with empties.
  int64_t merged_sum = 0;
  for (int line = 0; line < size_; ++line) {
    const int* cells = &lines_[(static_cast<size_t>(dir) * size_ + line) * size_];
    uint8_t vals[kGame2048MaxSize];
    int m = 0;
    for (int k = 0; k < size_; ++k)
      if (g[cells[k]] != 0) vals[m++] = g[cells[k]];
    int w = 0;
    for (int k = 0; k < m; ++k) {
      if (k + 1 < m && vals[k] == vals[k + 1]) {
        const uint8_t e = static_cast<uint8_t>(vals[k] + 1);
        merged_sum += int64_t{1} << e;
        out[cells[w++]] = e;
        ++k;
      } else {
        out[cells[w++]] = vals[k];
      }
    }
    for (; w < size_; ++w) out[cells[w]] = 0;
  }
  return merged_sum;
}

bool Game2048Batch::moves(const uint8_t* g, int dir) const {
  // A line moves when an empty cell precedes a tile (in slide order) or two tiles merge.
  for (int line = 0; line < size_; ++line) {
    const int* cells = &lines_[(static_cast<size_t>(dir) * size_ + line) * size_];
    uint8_t prev = 0;
    bool gap = false;
    for (int k = 0; k < size_; ++k) {
      const uint8_t v = g[cells[k]];
      if (v == 0) {
        gap = true;
        continue;
      }
      if (gap || v == prev) return true;
      prev = v;
    }
  }
  return false;
}

bool Game2048Batch::won(int i) const {
  const uint8_t* g = &exps[static_cast<size_t>(i) * cells_];
  return terminated[i] && *std::max_element(g, g + cells_) >= 11;  // a 2048 tile when the game ended
}

void Game2048Batch::step(const int32_t* actions, float* reward, uint8_t* terminated_out, uint8_t* truncated_out,
                         uint8_t* success, uint8_t* valid, uint8_t* effective) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.run(n_, 4096, [&](int, int64_t begin, int64_t end) {
    uint8_t next[kGame2048MaxSize * kGame2048MaxSize];
    for (int64_t i = begin; i < end; ++i) {
      const int idx = static_cast<int>(i);
      uint8_t* g = &exps[static_cast<size_t>(i) * cells_];
      reward[i] = 0.0f;
      valid[i] = effective[i] = 0;
      if (!terminated[i] && !truncated[i] && static_cast<uint32_t>(actions[i] - 1) <= 3u) {
        const int steps = ++num_steps[i];
        const int64_t merged = slide(g, actions[i] - 1, next);
        const bool moved = !std::equal(next, next + cells_, g);
        if (moved) {
          std::copy(next, next + cells_, g);
          spawn(idx);
          score[i] += merged;
          valid[i] = effective[i] = 1;
          bool stuck = true;  // RAGEN's _is_terminal: no empty cell and no direction moves
          for (int c = 0; c < cells_ && stuck; ++c) stuck = g[c] != 0;
          for (int dir = 0; dir < 4 && stuck; ++dir) stuck = !moves(g, dir);
          terminated[i] = stuck;
        }
        // RAGEN: raw = merged sum (or -0.1 when nothing moved); the log reward is 0.1 * log2(raw + 1) if raw > 0.
        const double raw = moved ? static_cast<double>(merged) : -0.1;
        const double r = use_log_reward_ ? (raw > 0.0 ? std::log2(raw + 1.0) * 0.1 : 0.0) : raw;
        reward[i] = static_cast<float>(r);
        truncated[i] = !terminated[i] && steps >= max_steps_;
      }
      success[i] = won(idx);
      terminated_out[i] = terminated[i];
      truncated_out[i] = truncated[i];
    }
  });
}

void Game2048Batch::render_texts(TextBatch& out) {
  std::lock_guard<std::mutex> lock(mu_);
  static const char* const kNames[4] = {"0(Up)", "1(Right)", "2(Down)", "3(Left)"};
  pool_.run(out.count, 256, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = out.first + begin; i < out.first + end; ++i) {
      const uint8_t* g = &exps[static_cast<size_t>(i) * cells_];
      std::string s = "Current 2048 Grid:";
      for (int r = 0; r < size_; ++r) {
        s += "\nRow " + std::to_string(r + 1) + ": [";
        for (int c = 0; c < size_; ++c) {
          if (c > 0) s += ", ";
          const uint8_t e = g[r * size_ + c];
          s += e == 0 ? std::string("0") : std::to_string(int64_t{1} << e);
        }
        s += ']';
      }
      s += "\n\nValid Actions: ";
      bool any = false;
      for (int dir = 0; dir < 4; ++dir)
        if (moves(g, dir)) {
          if (any) s += ", ";
          s += kNames[dir];
          any = true;
        }
      if (!any) s += "None";
      s += ".\nGoal: Merge same numbers to reach 2048.\nCurrent Score: " + std::to_string(score[i]) +
           "\nWhat is your next move?";
      out.set(i, s);
    }
  });
}

void Game2048Batch::state_keys(uint64_t* out) {
  keys_into(out, [this](int64_t i) {
    uint8_t le[8];
    const uint64_t s = static_cast<uint64_t>(score[i]);
    for (int k = 0; k < 8; ++k) le[k] = static_cast<uint8_t>(s >> (8 * k));
    return fnv1a64(le, 8, fnv1a64(&exps[static_cast<size_t>(i) * cells_], cells_));
  });
}

}  // namespace fastpo
