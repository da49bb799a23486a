#include "frozenlake.h"

#include <algorithm>
#include <stdexcept>

#include "coords.h"
#include "state_key.h"

namespace fastpo {

namespace {

// gym action -> (row change, col change): 0 Left, 1 Down, 2 Right, 3 Up.
constexpr int kMoveRow[4] = {0, 1, 0, -1};
constexpr int kMoveCol[4] = {-1, 0, 1, 0};

// RAGEN's is_valid: depth-first from S through non-holes until a neighbour is G.
bool goal_reachable(const uint8_t* desc, int size, int start, std::vector<int>& stack, std::vector<uint8_t>& seen) {
  seen.assign(static_cast<size_t>(size) * size, 0);
  stack.clear();
  stack.push_back(start);
  constexpr int dr[4] = {1, 0, -1, 0}, dc[4] = {0, 1, 0, -1};
  while (!stack.empty()) {
    const int cell = stack.back();
    stack.pop_back();
    if (seen[cell]) continue;
    seen[cell] = 1;
    const int r = cell / size, c = cell % size;
    for (int d = 0; d < 4; ++d) {
      const int rn = r + dr[d], cn = c + dc[d];
      if (rn < 0 || rn >= size || cn < 0 || cn >= size) continue;
      const uint8_t letter = desc[rn * size + cn];
      if (letter == 'G') return true;
      if (letter != 'H') stack.push_back(rn * size + cn);
    }
  }
  return false;
}

}  // namespace

int generate_frozenlake(uint64_t seed, int size, double p, uint8_t* desc, FrozenLakeScratch& scratch) {
  CounterRng rng(seed, kStreamFrozenLakeGen);
  for (int64_t t = 0; t < kFrozenLakeMaxMapTries; ++t) {
    for (int c = 0; c < size * size; ++c) desc[c] = rng.uniform() < p ? 'F' : 'H';
    const int start_r = static_cast<int>(rng.randint(size)), start_c = static_cast<int>(rng.randint(size));
    const int goal_r = static_cast<int>(rng.randint(size)), goal_c = static_cast<int>(rng.randint(size));
    if (start_r == goal_r && start_c == goal_c) continue;
    const int start = start_r * size + start_c;
    desc[start] = 'S';
    desc[goal_r * size + goal_c] = 'G';
    if (goal_reachable(desc, size, start, scratch.stack, scratch.seen)) return start;
  }
  throw std::runtime_error("no FrozenLake map with a reachable goal for seed " +
                           std::to_string(static_cast<int64_t>(seed)) + " (size=" + std::to_string(size) +
                           ", p=" + std::to_string(p) + ")");
}

FrozenLakeBatch::FrozenLakeBatch(int num_envs, int size, double p, bool is_slippery, int max_steps, int num_threads,
                                 double success_rate, int obs_format)
    : BatchCore(num_envs, max_steps, num_threads), size_(size), p_(p), is_slippery_(is_slippery),
      success_rate_(success_rate), obs_format_(obs_format) {
  if (size < 2 || size > 64) throw std::invalid_argument("size must be in [2, 64], got " + std::to_string(size));
  if (!(p > 0.0 && p <= 1.0)) throw std::invalid_argument("p must be in (0, 1], got " + std::to_string(p));
  if (!(success_rate < 0.0 || success_rate <= 1.0))  // negative: gym's slip; NaN is refused
    throw std::invalid_argument("success_rate must be in [0, 1] (or negative for gym's 1/3 slip), got " +
                                std::to_string(success_rate));
  check_obs_format(obs_format);
  desc.assign(static_cast<size_t>(n_) * size_ * size_, 'F');
  position.assign(n_, 0);
  slip_key.assign(n_, 0);
  slip_counter.assign(n_, 0);
  scratch_.resize(pool_.size());
  move_.resize(static_cast<size_t>(size_) * size_ * 4);
  for (int cell = 0; cell < size_ * size_; ++cell)
    for (int a = 0; a < 4; ++a) {
      const int r = std::min(std::max(cell / size_ + kMoveRow[a], 0), size_ - 1);
      const int c = std::min(std::max(cell % size_ + kMoveCol[a], 0), size_ - 1);
      move_[cell * 4 + a] = r * size_ + c;
    }
}

void FrozenLakeBatch::start_episode(int i, int start, int64_t seed) {
  position[i] = start;
  slip_key[i] = rng_key(static_cast<uint64_t>(seed), kStreamFrozenLakeSlip, 0);
  slip_counter[i] = 0;
  begin_episode(i);
}

void FrozenLakeBatch::reset(const int64_t* seeds, const uint8_t* mask) {
  const int cells = size_ * size_;
  reset_masked(seeds, mask, 64, [&](int worker, int64_t i, int64_t seed) {
    const int start = generate_frozenlake(static_cast<uint64_t>(seed), size_, p_, &desc[i * cells],
                                          scratch_[worker]);
    start_episode(static_cast<int>(i), start, seed);
  });
}

void FrozenLakeBatch::set_layouts(const uint8_t* desc_in, const int32_t* start, const int64_t* seeds) {
  std::lock_guard<std::mutex> lock(mu_);
  const int cells = size_ * size_;
  for (int i = 0; i < n_; ++i) {
    for (int c = 0; c < cells; ++c) {
      const uint8_t letter = desc_in[static_cast<size_t>(i) * cells + c];
      if (letter != 'S' && letter != 'F' && letter != 'H' && letter != 'G')
        throw std::invalid_argument("layout of env " + std::to_string(i) + ": invalid letter at cell " +
                                    std::to_string(c));
    }
    if (start[i] < 0 || start[i] >= cells)
      throw std::invalid_argument("start of env " + std::to_string(i) + " out of range: " + std::to_string(start[i]));
  }
  std::copy(desc_in, desc_in + static_cast<size_t>(n_) * cells, desc.begin());
  for (int i = 0; i < n_; ++i) start_episode(i, start[i], seeds[i]);
  set_all_ready();
}

void FrozenLakeBatch::step(const int32_t* actions, float* reward, uint8_t* terminated_out, uint8_t* truncated_out,
                           uint8_t* success, uint8_t* valid, uint8_t* effective) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t cells = static_cast<size_t>(size_) * size_;
  pool_.run(n_, 16384, [&](int, int64_t begin, int64_t end) {
    // Local copies: the uint8_t output stores may alias anything, so members would be reloaded every instance.
    const uint8_t* const maps = desc.data();
    int32_t* const positions = position.data();
    int32_t* const steps = num_steps.data();
    const uint64_t* const keys = slip_key.data();
    uint64_t* const counters = slip_counter.data();
    uint8_t* const term = terminated.data();
    uint8_t* const trunc = truncated.data();
    const int32_t* const moves = move_.data();
    const bool slippery = is_slippery_;
    const bool uniform_slip = success_rate_ < 0.0;
    const double fail_rate = (1.0 - success_rate_) / 2.0;  // as gym computes it
    const double stay_below = fail_rate + success_rate_;    // gym's cumulative sum [fail, fail + sr, 1]
    const int32_t max_steps = max_steps_;
    // Flags that need no game logic come from vectorizable passes: valid before, the copies after.
    for (int64_t i = begin; i < end; ++i)
      valid[i] = (term[i] | trunc[i]) == 0 && static_cast<uint32_t>(actions[i] - 1) <= 3u;
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* const map = maps + static_cast<size_t>(i) * cells;
      int32_t pos = positions[i];
      if (valid[i]) {
        const int32_t num = steps[i] + 1;
        steps[i] = num;
        int gym_action = actions[i] - 1;
        if (slippery) {
          // [(a - 1) % 4, a, (a + 1) % 4][k], one draw of the episode's slip stream: k = randint(3) for gym's
          // slip; for success_rate, k is gym's categorical_sample over [fail, success_rate, fail].
          CounterRng slip = CounterRng::resume(keys[i], counters[i]);
          int k;
          if (uniform_slip) {
            k = static_cast<int>(slip.randint(3));
          } else {
            const double u = slip.uniform();
            k = u < fail_rate ? 0 : u < stay_below ? 1 : 2;
          }
          gym_action = (gym_action + 3 + k) & 3;
          counters[i] = slip.counter;
        }
        const int32_t old = pos;
        pos = moves[pos * 4 + gym_action];
        positions[i] = pos;
        const uint8_t letter = map[pos];
        const bool goal = letter == 'G';
        const bool done = goal || letter == 'H';
        reward[i] = goal ? 1.0f : 0.0f;
        term[i] = done;
        trunc[i] = !done && num >= max_steps;
        effective[i] = pos != old;
        success[i] = goal;
      } else {
        reward[i] = 0.0f;
        effective[i] = 0;
        success[i] = map[pos] == 'G';
      }
    }
    for (int64_t i = begin; i < end; ++i) {
      terminated_out[i] = term[i];
      truncated_out[i] = trunc[i];
    }
  });
}

void FrozenLakeBatch::render_codes(uint8_t* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const int cells = size_ * size_;
  pool_.run(n_, 4096, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* map = &desc[i * cells];
      uint8_t* o = &out[i * cells];
      for (int cell = 0; cell < cells; ++cell) {
        const uint8_t letter = map[cell];
        o[cell] = letter == 'H' ? 1 : letter == 'G' ? 2 : 0;
      }
      const uint8_t letter = map[position[i]];
      o[position[i]] = letter == 'H' ? 4 : letter == 'G' ? 5 : 3;
    }
  });
}

void FrozenLakeBatch::state_keys(uint64_t* out) {
  const int cells = size_ * size_;
  keys_into(out, [this, cells](int64_t i) {
    const uint32_t cell = static_cast<uint32_t>(position[i]);
    const uint8_t le[4] = {static_cast<uint8_t>(cell), static_cast<uint8_t>(cell >> 8),
                           static_cast<uint8_t>(cell >> 16), static_cast<uint8_t>(cell >> 24)};
    return fnv1a64(le, 4, fnv1a64(&desc[static_cast<size_t>(i) * cells], cells));
  });
}

void FrozenLakeBatch::coord_texts(std::string* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const int cells = size_ * size_;
  pool_.run(n_, 1024, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i].clear();
      append_frozenlake_coords(&desc[static_cast<size_t>(i) * cells], size_, position[i], out[i]);
    }
  });
}

}  // namespace fastpo
