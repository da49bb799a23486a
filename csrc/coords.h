// RAGEN's coordinate observations ("coord", and the coordinate half of "grid_coord") for Sokoban and FrozenLake.
// The pure-Python twins are envs/layouts.py sokoban_coord_text / frozenlake_coord_text (the specification).
#pragma once

#include <cstdint>
#include <string>

namespace fastpo {

// Observation formats (RAGEN's observation_format): the symbol grid, the coordinate lists, or both.
enum ObsFormat : int { kObsGrid = 0, kObsCoord = 1, kObsGridCoord = 2 };

// Throws std::invalid_argument unless 0 <= format <= 2.
void check_obs_format(int format);

// Appends the coordinate text of one Sokoban room (gym-sokoban codes, rows * cols each) to out.
void append_sokoban_coords(const uint8_t* room_fixed, const uint8_t* room_state, int rows, int cols,
                           std::string& out);

// Appends the coordinate text of one FrozenLake map (size * size ASCII S F H G) with the player at `position`.
void append_frozenlake_coords(const uint8_t* desc, int size, int position, std::string& out);

// Joins the two halves of "grid_coord" as RAGEN does: "Coordinates: \n" + coords + "\nGrid Map: \n" + grid.
std::string join_grid_coord(const std::string& coords, const std::string& grid);

}  // namespace fastpo
