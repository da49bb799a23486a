#include "coords.h"

#include <stdexcept>
#include <vector>

namespace fastpo {

namespace {

void append_board_size(int rows, int cols, std::string& out) {
  out += "Board size: " + std::to_string(rows) + " rows x " + std::to_string(cols) + " cols (zero-indexed).";
}

// "\n{label}: (r, c), (r, c)" for the cells (row-major indices) in `cells`; nothing when there are none.
void append_list(const char* label, const std::vector<int>& cells, int cols, std::string& out) {
  if (cells.empty()) return;
  out += '\n';
  out += label;
  out += ": ";
  for (size_t k = 0; k < cells.size(); ++k) {
    if (k > 0) out += ", ";
    out += '(' + std::to_string(cells[k] / cols) + ", " + std::to_string(cells[k] % cols) + ')';
  }
}

}  // namespace

void check_obs_format(int format) {
  if (format < kObsGrid || format > kObsGridCoord)
    throw std::invalid_argument("observation_format code must be in [0, 2] (grid, coord, grid_coord), got " +
                                std::to_string(format));
}

void append_sokoban_coords(const uint8_t* room_fixed, const uint8_t* room_state, int rows, int cols,
                           std::string& out) {
  // Codes: fixed 2 = target; state 3 box on target, 4 box, 5 player (on a target when fixed is 2).
  std::vector<int> targets, boxes, on_target, player, player_on_target;
  for (int c = 0; c < rows * cols; ++c) {
    if (room_fixed[c] == 2) targets.push_back(c);
    if (room_state[c] == 3) on_target.push_back(c);
    if (room_state[c] == 4) boxes.push_back(c);
    if (room_state[c] == 5) (room_fixed[c] == 2 ? player_on_target : player).push_back(c);
  }
  append_board_size(rows, cols, out);
  append_list("Targets", targets, cols, out);  // RAGEN leaves walls out ("too heavy")
  append_list("Boxes", boxes, cols, out);
  append_list("Boxes on target", on_target, cols, out);
  append_list("Player", player, cols, out);
  append_list("Player on target", player_on_target, cols, out);
}

void append_frozenlake_coords(const uint8_t* desc, int size, int position, std::string& out) {
  std::vector<int> start, goal, holes;
  for (int c = 0; c < size * size; ++c) {
    if (desc[c] == 'S') start.push_back(c);
    if (desc[c] == 'G') goal.push_back(c);
    if (desc[c] == 'H') holes.push_back(c);  // the player's hole too
  }
  const std::vector<int> here{position};
  const std::vector<int> none;
  const uint8_t tile = desc[position];
  append_board_size(size, size, out);
  append_list("Start", start, size, out);
  append_list("Goal", goal, size, out);
  append_list("Player", tile != 'G' && tile != 'H' ? here : none, size, out);
  append_list("Player on goal", tile == 'G' ? here : none, size, out);
  append_list("Player in hole", tile == 'H' ? here : none, size, out);
  append_list("Holes", holes, size, out);
}

std::string join_grid_coord(const std::string& coords, const std::string& grid) {
  return "Coordinates: \n" + coords + "\nGrid Map: \n" + grid;
}

}  // namespace fastpo
