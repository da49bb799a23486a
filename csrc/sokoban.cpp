#include "sokoban.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "coords.h"
#include "state_key.h"

namespace fastpo {

namespace {

// Random-walk directions and the five 3x3 floor masks of room_topology_generation, in RAGEN's order.
constexpr int kWalkDirections[4][2] = {{1, 0}, {0, 1}, {-1, 0}, {0, -1}};
constexpr uint8_t kTopologyMasks[5][3][3] = {
    {{0, 0, 0}, {1, 1, 1}, {0, 0, 0}},
    {{0, 1, 0}, {0, 1, 0}, {0, 1, 0}},
    {{0, 0, 0}, {1, 1, 0}, {0, 1, 0}},
    {{0, 0, 0}, {1, 1, 0}, {1, 1, 0}},
    {{0, 0, 0}, {0, 1, 1}, {0, 1, 0}},
};
// gym-sokoban's CHANGE_COORDINATES: 0 up, 1 down, 2 left, 3 right.
constexpr int kChangeRow[4] = {-1, 1, 0, 0};
constexpr int kChangeCol[4] = {0, 0, -1, 1};

inline bool is_free(uint8_t code) { return code == kEmpty || code == kTarget; }
inline bool is_box(uint8_t code) { return code == kBoxOnTarget || code == kBox; }

// Reverse-play key code of a cell: only the movable content, the walls and targets are fixed per search.
inline uint64_t key_code(uint8_t code) {
  switch (code) {
    case kBox: return 1;
    case kBoxOnTarget: return 2;
    case kPlayer: return 3;
    default: return 0;
  }
}

}  // namespace

void SokobanParams::validate() const {
  if (rows < 4 || rows > 64 || cols < 4 || cols > 64)
    throw std::invalid_argument("dim_room must have rows and cols in [4, 64], got (" + std::to_string(rows) + ", " +
                                std::to_string(cols) + ")");
  const int max_boxes = (rows - 2) * (cols - 2) - 2;
  if (num_boxes < 1 || num_boxes > max_boxes)
    throw std::invalid_argument("num_boxes must be in [1, " + std::to_string(max_boxes) + "], got " +
                                std::to_string(num_boxes));
  if (search_depth < 2 || search_depth > 1000)
    throw std::invalid_argument("search_depth must be in [2, 1000], got " + std::to_string(search_depth));
  if (!(p_change_directions >= 0.0 && p_change_directions <= 1.0))
    throw std::invalid_argument("p_change_directions must be in [0, 1], got " + std::to_string(p_change_directions));
  if (num_gen_steps > 100000)
    throw std::invalid_argument("num_gen_steps must be in [1, 100000], got " + std::to_string(num_gen_steps));
}

// ------------------------------------------------------------------------------------------- KeySet

void KeySet::clear(int words) {
  if (words != words_ || stamps_.empty()) {
    words_ = words;
    const size_t capacity = 1024;
    stamps_.assign(capacity, 0);
    keys_.assign(capacity * words, 0);
    mask_ = capacity - 1;
    stamp_ = 0;
  }
  if (++stamp_ == 0) {  // wrapped: forget all stamps once every 2^32 clears
    std::fill(stamps_.begin(), stamps_.end(), 0);
    stamp_ = 1;
  }
  count_ = 0;
}

uint64_t KeySet::hash(const uint64_t* key) const {
  uint64_t h = 0x51ED270B27A4E9B1ULL;
  for (int w = 0; w < words_; ++w) h = mix64(h ^ key[w]);
  return h;
}

bool KeySet::insert(const uint64_t* key) {
  if (static_cast<uint64_t>(count_ + 1) * 2 > stamps_.size()) grow();
  const size_t bytes = sizeof(uint64_t) * words_;
  uint64_t slot = hash(key) & mask_;
  while (stamps_[slot] == stamp_) {
    if (std::memcmp(&keys_[slot * words_], key, bytes) == 0) return false;
    slot = (slot + 1) & mask_;
  }
  stamps_[slot] = stamp_;
  std::memcpy(&keys_[slot * words_], key, bytes);
  ++count_;
  return true;
}

void KeySet::grow() {
  std::vector<uint32_t> old_stamps(stamps_.size() * 2, 0);
  std::vector<uint64_t> old_keys(keys_.size() * 2, 0);
  old_stamps.swap(stamps_);
  old_keys.swap(keys_);
  mask_ = stamps_.size() - 1;
  const size_t bytes = sizeof(uint64_t) * words_;
  for (size_t i = 0; i < old_stamps.size(); ++i) {
    if (old_stamps[i] != stamp_) continue;
    uint64_t slot = hash(&old_keys[i * words_]) & mask_;
    while (stamps_[slot] == stamp_) slot = (slot + 1) & mask_;
    stamps_[slot] = stamp_;
    std::memcpy(&keys_[slot * words_], &old_keys[i * words_], bytes);
  }
}

// --------------------------------------------------------------------------------- SokobanGenerator

SokobanGenerator::SokobanGenerator(const SokobanParams& params)
    : p_(params), cells_(params.rows * params.cols), key_words_((2 * params.rows * params.cols + 63) / 64) {
  p_.validate();
  level_.resize(cells_);
  room_.resize(cells_);
  grid_.resize(cells_);
  best_grid_.resize(cells_);
  key_.resize(key_words_);
}

int SokobanGenerator::generate(uint64_t seed, uint8_t* room_fixed, uint8_t* room_state) {
  for (int attempt = 0; attempt < kSokobanMaxAttempts; ++attempt) {
    CounterRng rng(seed, kStreamSokobanGen, static_cast<uint64_t>(attempt));
    if (generate_room(rng, room_fixed, room_state)) return attempt;
  }
  throw std::runtime_error("could not generate a Sokoban level for seed " +
                           std::to_string(static_cast<int64_t>(seed)) + " in " +
                           std::to_string(kSokobanMaxAttempts) + " attempts (dim_room=(" + std::to_string(p_.rows) +
                           ", " + std::to_string(p_.cols) + "), num_boxes=" + std::to_string(p_.num_boxes) +
                           ", search_depth=" + std::to_string(p_.search_depth) + ")");
}

bool SokobanGenerator::generate_room(CounterRng& rng, uint8_t* room_fixed, uint8_t* room_state) {
  int64_t score = 0;
  for (int t = 0; t < kSokobanGenerationTries; ++t) {
    room_topology_generation(rng);
    if (!place_boxes_and_player(rng)) return false;  // RAGEN: RuntimeError escapes generate_room
    for (int c = 0; c < cells_; ++c) {
      room_fixed[c] = room_[c] == kPlayer ? kEmpty : room_[c];
      room_state[c] = room_[c] == kTarget ? kBox : room_[c];
    }
    reverse_play(room_fixed, room_state);
    score = displacement(best_box_cells_);
    if (score > 0) break;
  }
  if (score == 0) return false;  // RAGEN: RuntimeWarning('Generated Model with score == 0')
  add_random_player_movement(rng, room_fixed, room_state, score == 1 ? 0.8 : 0.5);
  return true;
}

void SokobanGenerator::room_topology_generation(CounterRng& rng) {
  const int rows = p_.rows, cols = p_.cols;
  std::fill(level_.begin(), level_.end(), 0);
  int direction = static_cast<int>(rng.randint(4));
  // random.randint(1, dim - 1) is inclusive: the walk may start on the border, clamped after one step.
  int r = 1 + static_cast<int>(rng.randint(rows - 1));
  int c = 1 + static_cast<int>(rng.randint(cols - 1));
  const int steps = p_.gen_steps();
  for (int s = 0; s < steps; ++s) {
    if (rng.uniform() < p_.p_change_directions) direction = static_cast<int>(rng.randint(4));
    r = std::max(std::min(r + kWalkDirections[direction][0], rows - 2), 1);
    c = std::max(std::min(c + kWalkDirections[direction][1], cols - 2), 1);
    const auto& mask = kTopologyMasks[rng.randint(5)];
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 3; ++j) level_[(r - 1 + i) * cols + (c - 1 + j)] += mask[i][j];
  }
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const bool border = i == 0 || j == 0 || i == rows - 1 || j == cols - 1;
      room_[i * cols + j] = (!border && level_[i * cols + j] > 0) ? kEmpty : kWall;
    }
}

bool SokobanGenerator::place_boxes_and_player(CounterRng& rng) {
  auto collect_floor = [this] {
    candidates_.clear();
    for (int c = 0; c < cells_; ++c)
      if (room_[c] == kEmpty) candidates_.push_back(c);
  };
  collect_floor();
  if (static_cast<int>(candidates_.size()) <= p_.num_boxes + 1) return false;
  room_[candidates_[rng.randint(candidates_.size())]] = kPlayer;
  for (int b = 0; b < p_.num_boxes; ++b) {
    collect_floor();
    room_[candidates_[rng.randint(candidates_.size())]] = kTarget;
  }
  return true;
}

void SokobanGenerator::set_cell(int cell, uint8_t code) {
  grid_[cell] = code;
  const int word = cell >> 5, shift = (cell & 31) * 2;
  key_[word] = (key_[word] & ~(uint64_t{3} << shift)) | (key_code(code) << shift);
}

int64_t SokobanGenerator::displacement(const std::vector<int>& box_cells) const {
  int64_t score = 0;
  for (size_t k = 0; k < targets_.size(); ++k) {
    score += std::abs(targets_[k] / p_.cols - box_cells[k] / p_.cols) +
             std::abs(targets_[k] % p_.cols - box_cells[k] % p_.cols);
  }
  return score;
}

void SokobanGenerator::reverse_play(const uint8_t* room_fixed, uint8_t* room_state) {
  fixed_ = room_fixed;
  std::fill(key_.begin(), key_.end(), 0);
  targets_.clear();
  for (int c = 0; c < cells_; ++c) {
    set_cell(c, room_state[c]);
    if (room_state[c] == kPlayer) player_ = c;
    if (room_fixed[c] == kTarget) targets_.push_back(c);
  }
  box_cells_ = targets_;
  best_box_cells_ = targets_;
  explored_.clear(key_words_);
  best_score_ = -1;
  depth_first_search(0, -1, p_.search_depth);
  // search_depth >= 2 always explores the root, so best_grid_ is set.
  for (int c = 0; c < cells_; ++c) room_state[c] = best_grid_[c] == kBoxOnTarget ? kBox : best_grid_[c];
}

void SokobanGenerator::depth_first_search(int64_t box_swaps, int last_pull, int ttl) {
  ttl -= 1;
  if (ttl <= 0 || explored_.size() >= kSokobanMaxExplored) return;
  if (!explored_.insert(key_.data())) return;
  int empty_targets = 0;
  for (int t : targets_) empty_targets += grid_[t] == kTarget;
  const int64_t score = empty_targets == static_cast<int>(targets_.size()) ? box_swaps * displacement(box_cells_) : 0;
  if (score > best_score_) {
    best_score_ = score;
    best_grid_ = grid_;
    best_box_cells_ = box_cells_;
  }
  // A child decrements ttl first: with ttl <= 1 every child returns at once, with no side effects.
  if (ttl <= 1) return;
  for (int action = 0; action < 4; ++action) {
    const int delta = kChangeRow[action] * p_.cols + kChangeCol[action];
    const int from = player_, to = from + delta, behind = from - delta;
    const uint8_t to_code = grid_[to];
    // No move: the child state equals this explored one, so RAGEN's recursive call returns at once.
    if (!is_free(to_code)) continue;
    const uint8_t from_code = grid_[from], behind_code = grid_[behind];
    set_cell(from, fixed_[from]);
    set_cell(to, kPlayer);
    player_ = to;
    int pulled = -1;
    if (is_box(behind_code)) {
      set_cell(from, kBoxOnTarget);  // RAGEN marks every pulled box 3, on a target or not
      set_cell(behind, fixed_[behind]);
      for (size_t k = 0; k < box_cells_.size(); ++k)
        if (box_cells_[k] == behind) {
          box_cells_[k] = from;
          pulled = static_cast<int>(k);
        }
    }
    const int next_last_pull = pulled >= 0 ? pulled : last_pull;
    depth_first_search(box_swaps + (next_last_pull != last_pull ? 1 : 0), next_last_pull, ttl);
    if (pulled >= 0) {
      box_cells_[pulled] = behind;
      set_cell(behind, behind_code);
    }
    set_cell(to, to_code);
    set_cell(from, from_code);
    player_ = from;
  }
}

void SokobanGenerator::add_random_player_movement(CounterRng& rng, const uint8_t* room_fixed, uint8_t* room_state,
                                                  double move_probability) {
  if (rng.uniform() > move_probability) return;
  int player = static_cast<int>(std::find(room_state, room_state + cells_, kPlayer) - room_state);
  int previous[4] = {player, -1, -1, -1};
  int valid[4];
  for (int steps = 0; steps < 3;) {
    int num_valid = 0;
    for (int action = 0; action < 4; ++action) {
      const int next = player + kChangeRow[action] * p_.cols + kChangeCol[action];
      if (is_free(room_state[next]) && std::find(previous, previous + steps + 1, next) == previous + steps + 1)
        valid[num_valid++] = next;
    }
    if (num_valid == 0) break;
    const int next = valid[rng.randint(num_valid)];
    room_state[player] = room_fixed[player];
    room_state[next] = kPlayer;
    player = next;
    previous[++steps] = player;
    if (steps >= 3 || rng.uniform() > 0.5) break;  // short-circuit: no draw after the third step
  }
}

static_assert(kBoxOnTarget + 1 == kBox, "step_range computes the box code as kBox - on_target");

// ------------------------------------------------------------------------------------- SokobanBatch

SokobanBatch::SokobanBatch(int num_envs, const SokobanParams& params, int max_steps, std::vector<std::string> symbols,
                           int num_threads, int obs_format)
    : BatchCore(num_envs, max_steps, num_threads), p_(params), cells_(params.rows * params.cols),
      symbols_(std::move(symbols)), obs_format_(obs_format) {
  p_.validate();
  check_obs_format(obs_format);
  if (symbols_.size() != 7)
    throw std::invalid_argument("symbols must hold 7 strings (codes 0..6), got " + std::to_string(symbols_.size()));
  room_fixed.assign(static_cast<size_t>(n_) * cells_, kWall);
  room_state.assign(static_cast<size_t>(n_) * cells_, kWall);
  boxes_on_target.assign(n_, 0);
  num_boxes.assign(n_, 0);
  player.assign(n_, 0);
  walled_.assign(n_, 0);
  for (int a = 0; a < 4; ++a) delta_[a] = kChangeRow[a] * p_.cols + kChangeCol[a];
  for (int sign = -1; sign <= 1; ++sign)
    for (int won = 0; won <= 1; ++won) {
      double r = -0.1;  // exactly step_one's double arithmetic
      if (sign > 0) {
        r += 1.0;
      } else if (sign < 0) {
        r += -1.0;
      }
      if (won) r += 10.0;
      reward_table_[(sign + 1) * 2 + won] = static_cast<float>(r);
    }
  for (int w = 0; w < pool_.size(); ++w) generators_.push_back(std::make_unique<SokobanGenerator>(p_));
}

void SokobanBatch::update_walled(int i) {
  const uint8_t* state = &room_state[static_cast<size_t>(i) * cells_];
  bool walls = true;
  for (int r = 0; r < p_.rows; ++r)
    for (int c = 0; c < p_.cols; ++c)
      if ((r == 0 || c == 0 || r == p_.rows - 1 || c == p_.cols - 1) && state[r * p_.cols + c] != kWall) walls = false;
  walled_[i] = walls;
}

void SokobanBatch::reset(const int64_t* seeds, const uint8_t* mask) {
  reset_masked(seeds, mask, 1, [&](int worker, int64_t i, int64_t seed) {
    uint8_t* fixed = &room_fixed[i * cells_];
    uint8_t* state = &room_state[i * cells_];
    generators_[worker]->generate(static_cast<uint64_t>(seed), fixed, state);
    player[i] = static_cast<int32_t>(std::find(state, state + cells_, kPlayer) - state);
    num_boxes[i] = p_.num_boxes;
    boxes_on_target[i] = 0;  // generated boxes never start on a target
    update_walled(static_cast<int>(i));
    begin_episode(i);
  });
}

void SokobanBatch::set_layouts(const uint8_t* fixed_in, const uint8_t* state_in) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < n_; ++i) {
    const uint8_t* state = state_in + static_cast<size_t>(i) * cells_;
    const uint8_t* fixed = fixed_in + static_cast<size_t>(i) * cells_;
    int players = 0, boxes = 0, on_target = 0;
    for (int c = 0; c < cells_; ++c) {
      if (state[c] > kPlayer || fixed[c] > kTarget)
        throw std::invalid_argument("layout of env " + std::to_string(i) + ": invalid cell code at cell " +
                                    std::to_string(c));
      players += state[c] == kPlayer;
      boxes += is_box(state[c]);
      on_target += state[c] == kBoxOnTarget;
    }
    if (players != 1)
      throw std::invalid_argument("layout of env " + std::to_string(i) + ": expected exactly one player, found " +
                                  std::to_string(players));
    std::copy(fixed, fixed + cells_, &room_fixed[static_cast<size_t>(i) * cells_]);
    std::copy(state, state + cells_, &room_state[static_cast<size_t>(i) * cells_]);
    player[i] = static_cast<int32_t>(std::find(state, state + cells_, kPlayer) - state);
    num_boxes[i] = boxes;
    boxes_on_target[i] = on_target;  // RAGEN starts at 0; the actual count keeps +1/-1 rewards right
    update_walled(i);
    begin_episode(i);
  }
  refresh_all_ready();
}

__attribute__((noinline)) void SokobanBatch::step_one(int i, int32_t action, float* reward, uint8_t* success, uint8_t* valid,
                            uint8_t* effective) {
  reward[i] = 0.0f;
  valid[i] = effective[i] = 0;
  if (terminated[i] || truncated[i] || action < 1 || action > 4) {
    success[i] = boxes_on_target[i] == num_boxes[i];
    return;
  }
  uint8_t* state = &room_state[static_cast<size_t>(i) * cells_];
  const uint8_t* fixed = &room_fixed[static_cast<size_t>(i) * cells_];
  ++num_steps[i];
  const int dr = kChangeRow[action - 1], dc = kChangeCol[action - 1];
  const int pr = player[i] / p_.cols, pc = player[i] % p_.cols;
  const int nr = pr + dr, nc = pc + dc, br = nr + dr, bc = nc + dc;
  auto in_grid = [this](int r, int c) { return r >= 0 && r < p_.rows && c >= 0 && c < p_.cols; };
  const int from = player[i], to = nr * p_.cols + nc, beyond = br * p_.cols + bc;
  const int old_on_target = boxes_on_target[i];
  bool moved = false;
  if (in_grid(br, bc) && is_box(state[to]) && is_free(state[beyond])) {  // gym-sokoban _push
    boxes_on_target[i] -= state[to] == kBoxOnTarget;
    state[beyond] = fixed[beyond] == kTarget ? kBoxOnTarget : kBox;
    boxes_on_target[i] += state[beyond] == kBoxOnTarget;
    moved = true;
  } else if (in_grid(nr, nc) && is_free(state[to])) {  // gym-sokoban _move
    moved = true;
  }
  if (moved) {
    state[from] = fixed[from];
    state[to] = kPlayer;
    player[i] = to;
  }
  double r = -0.1;  // gym-sokoban _calc_reward, in double as Python does
  if (boxes_on_target[i] > old_on_target) {
    r += 1.0;
  } else if (boxes_on_target[i] < old_on_target) {
    r += -1.0;
  }
  const bool won = boxes_on_target[i] == num_boxes[i];
  if (won) {
    r += 10.0;
    terminated[i] = 1;
  } else if (num_steps[i] >= max_steps_) {
    truncated[i] = 1;
  }
  reward[i] = static_cast<float>(r);
  success[i] = won;
  valid[i] = 1;
  effective[i] = moved;
}

// The hot loop. Flags that need no game logic are written by vectorizable passes (valid before, success and
// the terminated/truncated copies after), so the per-instance loop does only the move itself. Every active
// instance with a walled border (see walled_) takes a fast path (no division, no bounds checks, table
// reward); anything else goes through step_one, the reference rules.
void SokobanBatch::step_range(int64_t begin, int64_t end, const int32_t* actions, float* reward,
                              uint8_t* terminated_out, uint8_t* truncated_out, uint8_t* success, uint8_t* valid,
                              uint8_t* effective) {
  // Local copies: the uint8_t output stores may alias anything, so members would be reloaded every instance.
  uint8_t* const states = room_state.data();
  const uint8_t* const fixeds = room_fixed.data();
  int32_t* const steps = num_steps.data();
  int32_t* const on_target = boxes_on_target.data();
  const int32_t* const boxes = num_boxes.data();
  int32_t* const players = player.data();
  uint8_t* const term = terminated.data();
  uint8_t* const trunc = truncated.data();
  const uint8_t* const walled = walled_.data();
  const size_t cells = static_cast<size_t>(cells_);
  const int32_t max_steps = max_steps_;
  const int delta[4] = {delta_[0], delta_[1], delta_[2], delta_[3]};
  float table[6];
  std::copy(reward_table_, reward_table_ + 6, table);
  // valid[i] doubles as the fast-path test below: 2 = valid and walled, 1 = valid (step_one), 0 = no step.
  for (int64_t i = begin; i < end; ++i)
    valid[i] = static_cast<uint8_t>((term[i] | trunc[i]) == 0 && static_cast<uint32_t>(actions[i] - 1) <= 3u) *
               static_cast<uint8_t>(1 + walled[i]);
  for (int64_t i = begin; i < end; ++i) {
    const int32_t action = actions[i];
    if (valid[i] != 2) {
      step_one(static_cast<int>(i), action, reward, success, valid, effective);
      continue;
    }
    uint8_t* const state = states + static_cast<size_t>(i) * cells;
    const uint8_t* const fixed = fixeds + static_cast<size_t>(i) * cells;
    const int32_t num = steps[i] + 1;
    steps[i] = num;
    const int d = delta[action - 1];
    const int from = players[i], to = from + d;  // the player is inside the wall border: `to` is in the grid
    const uint8_t to_code = state[to];
    const bool box_ahead = static_cast<uint8_t>(to_code - kBoxOnTarget) < 2;
    const bool free_ahead = static_cast<uint8_t>(to_code - kEmpty) < 2;
    // A box is never on the border (a wall), so the cell beyond it is in the grid; otherwise look at `to`.
    const int beyond = box_ahead ? to + d : to;
    const uint8_t beyond_code = state[beyond];
    const bool push = box_ahead && static_cast<uint8_t>(beyond_code - kEmpty) < 2;
    const bool moved = push || free_ahead;
    const uint8_t box_code = fixed[beyond] == kTarget ? kBoxOnTarget : kBox;
    state[beyond] = push ? box_code : beyond_code;  // == to_code at `to` when there is no push
    const int32_t old_on = on_target[i];
    const int32_t on = old_on + (push ? static_cast<int32_t>(box_code == kBoxOnTarget) -
                                            static_cast<int32_t>(to_code == kBoxOnTarget)
                                      : 0);
    on_target[i] = on;
    const uint8_t from_code = state[from];
    state[from] = moved ? fixed[from] : from_code;
    state[to] = moved ? kPlayer : to_code;
    players[i] = moved ? to : from;
    const bool won = on == boxes[i];
    reward[i] = table[((on > old_on) - (on < old_on) + 1) * 2 + won];
    term[i] = won;
    trunc[i] = !won && num >= max_steps;
    effective[i] = moved;
  }
  for (int64_t i = begin; i < end; ++i) {
    success[i] = on_target[i] == boxes[i];  // what step_one writes too, for every instance
    valid[i] = valid[i] != 0;
    terminated_out[i] = term[i];
    truncated_out[i] = trunc[i];
  }
}

void SokobanBatch::step(const int32_t* actions, float* reward, uint8_t* terminated_out, uint8_t* truncated_out,
                        uint8_t* success, uint8_t* valid, uint8_t* effective) {
  std::lock_guard<std::mutex> lock(mu_);
  // Stepping is a few ns per instance: threads only pay off for very large batches.
  pool_.run(n_, 16384, [&](int, int64_t begin, int64_t end) {
    step_range(begin, end, actions, reward, terminated_out, truncated_out, success, valid, effective);
  });
}

void SokobanBatch::render_codes(uint8_t* out) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.run(n_, 4096, [&](int, int64_t begin, int64_t end) {
    const size_t lo = static_cast<size_t>(begin) * cells_, hi = static_cast<size_t>(end) * cells_;
    const uint8_t* state = room_state.data();
    const uint8_t* fixed = room_fixed.data();
    for (size_t c = lo; c < hi; ++c)
      out[c] = (state[c] == kPlayer && fixed[c] == kTarget) ? static_cast<uint8_t>(kPlayerOnTarget) : state[c];
  });
}

void SokobanBatch::state_keys(uint64_t* out) {
  keys_into(out, [this](int64_t i) {
    const size_t at = static_cast<size_t>(i) * cells_;
    return fnv1a64(&room_state[at], cells_, fnv1a64(&room_fixed[at], cells_));
  });
}

void SokobanBatch::coord_texts(std::string* out) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.run(n_, 1024, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const size_t at = static_cast<size_t>(i) * cells_;
      out[i].clear();
      append_sokoban_coords(&room_fixed[at], &room_state[at], p_.rows, p_.cols, out[i]);
    }
  });
}

}  // namespace fastpo
