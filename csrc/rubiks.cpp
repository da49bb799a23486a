#include "rubiks.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "state_key.h"
#include "text_writer.h"

namespace fastpo {

namespace {

// RAGEN's quarter turns U, D, L, R, F, B (clockwise) as permutations: after the turn, sticker k holds the one
// that was at kTurn[face][k]. A prime turn is three quarter turns, as RAGEN applies it.
constexpr uint8_t kTurn[6][24] = {
    {2, 0, 3, 1, 8, 9, 6, 7, 12, 13, 10, 11, 16, 17, 14, 15, 4, 5, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 4, 5, 18, 19, 8, 9, 6, 7, 12, 13, 10, 11, 16, 17, 14, 15, 22, 20, 23, 21},
    {19, 1, 17, 3, 6, 4, 7, 5, 0, 9, 2, 11, 12, 13, 14, 15, 16, 22, 18, 20, 8, 21, 10, 23},
    {0, 9, 2, 11, 4, 5, 6, 7, 8, 21, 10, 23, 14, 12, 15, 13, 3, 17, 1, 19, 20, 18, 22, 16},
    {0, 1, 7, 5, 4, 20, 6, 21, 10, 8, 11, 9, 2, 13, 3, 15, 16, 17, 18, 19, 14, 12, 22, 23},
    {13, 15, 2, 3, 1, 5, 0, 7, 8, 9, 10, 11, 12, 22, 14, 23, 18, 16, 19, 17, 20, 21, 6, 4},
};
// The 12 moves (ids 1..12) as one permutation each: a prime turn (even id) is the quarter turn composed three
// times, so a step is one gather whatever the move.
struct MoveTable {
  uint8_t p[12][24];
  MoveTable() {
    for (int a = 0; a < 12; ++a)
      for (int k = 0; k < 24; ++k) {
        const uint8_t* q = kTurn[a / 2];
        p[a][k] = a % 2 == 0 ? q[k] : q[q[q[k]]];
      }
  }
};
const MoveTable kMoves;

constexpr char kColour[6] = {'W', 'O', 'G', 'R', 'B', 'Y'};
constexpr const char* kFaceLabel[6] = {"Up (U):    ", "Left (L):  ", "Front (F): ", "Right (R): ", "Back (B):  ",
                                       "Down (D):  "};

}  // namespace

RubiksBatch::RubiksBatch(int num_envs, int scramble_depth, int max_steps, int num_threads)
    : BatchCore(num_envs, max_steps, num_threads), scramble_depth_(scramble_depth) {
  if (scramble_depth < 0 || scramble_depth > 1000)
    throw std::invalid_argument("scramble_depth must be in [0, 1000], got " + std::to_string(scramble_depth));
  stickers.assign(static_cast<size_t>(n_) * 24, 0);
}

void RubiksBatch::turn(uint8_t* s, int action) const {
  const uint8_t* p = kMoves.p[action - 1];
  uint8_t tmp[24];
  std::memcpy(tmp, s, 24);
  for (int k = 0; k < 24; ++k) s[k] = tmp[p[k]];
}

bool RubiksBatch::solved(const uint8_t* s) {
  for (int f = 0; f < 6; ++f)
    for (int k = 1; k < 4; ++k)
      if (s[f * 4 + k] != s[f * 4]) return false;
  return true;
}

void RubiksBatch::reset(const int64_t* seeds, const uint8_t* mask) {
  reset_masked(seeds, mask, 1024, [&](int, int64_t i, int64_t seed) {
    uint8_t* s = &stickers[static_cast<size_t>(i) * 24];
    for (int k = 0; k < 24; ++k) s[k] = static_cast<uint8_t>(k / 4);
    CounterRng rng(static_cast<uint64_t>(seed), kStreamRubiks);
    for (int d = 0; d < scramble_depth_; ++d) turn(s, static_cast<int>(rng.randint(12)) + 1);
    begin_episode(i);
  });
}

void RubiksBatch::set_cubes(const uint8_t* in) {
  std::lock_guard<std::mutex> lock(mu_);
  std::copy(in, in + static_cast<size_t>(n_) * 24, stickers.begin());
  for (int i = 0; i < n_; ++i) begin_episode(i);
  set_all_ready();
}

void RubiksBatch::step(const int32_t* actions, float* reward, uint8_t* terminated_out, uint8_t* truncated_out,
                       uint8_t* success, uint8_t* valid, uint8_t* effective) {
  for_each_instance(4096, [&](int64_t i) {
    uint8_t* s = &stickers[static_cast<size_t>(i) * 24];
    reward[i] = 0.0f;
    valid[i] = effective[i] = 0;
    if (!terminated[i] && !truncated[i] && static_cast<uint32_t>(actions[i] - 1) <= 11u) {
      turn(s, actions[i]);
      const int steps = ++num_steps[i];
      const bool done = solved(s);
      reward[i] = done ? 1.0f : 0.0f;
      terminated[i] = done;
      truncated[i] = !done && steps >= max_steps_;
      valid[i] = effective[i] = 1;  // RAGEN: every turn is valid and effective
    }
    success[i] = terminated[i];
    terminated_out[i] = terminated[i];
    truncated_out[i] = truncated[i];
  });
}

void RubiksBatch::render_texts(TextBatch& out) {
  for_range(out.first, out.first + out.count, 1024, [&](int64_t i) {
    const uint8_t* s = &stickers[static_cast<size_t>(i) * 24];
    TextWriter w = out.begin(i, 384);  // the text is 300 bytes at most
    w.lit("=== Rubik's Cube 2x2 State ===\nStep: ");
    w.num(num_steps[i]);
    w.ch('/');
    w.num(max_steps_);
    w.ch('\n');
    for (int f = 0; f < 6; ++f) {
      const uint8_t* c = s + f * 4;
      w.ch('\n');
      w.put(kFaceLabel[f], 11);
      const char face[] = {'[', kColour[c[0]], ',', ' ', kColour[c[1]], ']', '\n', ' ', '[', kColour[c[2]], ',', ' ',
                           kColour[c[3]], ']'};
      w.put(face, sizeof(face));
    }
    w.lit("\n\nAvailable Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?");
    out.end(i, w);
  });
}

void RubiksBatch::state_keys(uint64_t* out) {
  keys_into(out, [this](int64_t i) { return fnv1a64(&stickers[static_cast<size_t>(i) * 24], 24); });
}

}  // namespace fastpo
