"""RAGEN-2's prompt text for the env tags it added (mll-lab-nu/RAGEN config/envs.yaml at commit 20daedc, April
2026), as ``fastpo.prompts.EnvPromptSpec`` fields; ``fastpo.prompts`` merges ``PROMPT_PRESETS`` into its presets.

Each ``env_instruction`` is the tag's YAML text as YAML reads it (trailing spaces and the final newline
included). The legend and action list follow RAGEN's prefix rules: the env type's default config decides them,
because RAGEN reads ``observation_format`` from the tag's top level, where the Coord tags do not set it; so the
Coord tags keep the symbol legend although their observations carry coordinates.
"""

from __future__ import annotations

from typing import Any

from .layouts import FROZENLAKE_ACTIONS, FROZENLAKE_GRID_VOCAB, SOKOBAN_ACTIONS, sokoban_grid_vocab

COORD_SOKOBAN_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\n"
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each "
    "target. \n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). \n"
    "When you are exactly next to a box, you can push it by moving in the same direction. \n"
    "You cannot push a box through a wall, and you cannot pull a box.\n"
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)
COORD_FROZENLAKE_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed "
    "coordinates for the start, goal, player, and any holes.\n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).\n"
    "Beware that the ice is slippery, so the agent might slide and end up in an unintended tile.\n"
    "Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n"
)

GAME2048_INSTRUCTION = (
    "You are playing the 2048 game on a 4x4 grid. Merge equal tiles by sliding Up, Right, Down, or Left.\n"
    "If a move is invalid (no tiles move), a small penalty is applied. Respond with a single action.\n"
    "Example: <answer>Up</answer>\n"
)
#: RAGEN's action_lookup {0: Up, 1: Right, 2: Down, 3: Left}; fastpo's ids are these + 1.
GAME2048_ACTIONS = ["Up", "Right", "Down", "Left"]

SUDOKU_INSTRUCTION = (
    "You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and 3x3 box contains the numbers "
    "1-9 without repetition.\n"
    "Initial cells are shown in [brackets] and cannot be modified. Empty cells are shown as dots (.).\n"
    "Place numbers one at a time using the format: <answer>place 5 at row 2 col 3</answer> or "
    "<answer>2,3,5</answer>\n"
    "The environment will provide feedback on valid/invalid moves and show conflicts if any occur.\n"
)

RUBIKS_INSTRUCTION = (
    "You are solving a 2x2 Rubik's Cube (Pocket Cube). The goal is to restore the cube so that each of the faces "
    "consists of a single, unique color.\n"
    "Available actions use standard Singmaster notation for face rotations: U, U', D, D', L, L', R, R', F, F', B, "
    "B'.\n"
    "- Faces: U (Up), D (Down), L (Left), R (Right), F (Front), B (Back).\n"
    "- Modifiers: A letter alone means 90\u00b0 clockwise (e.g., 'R'). A letter with prime (') means 90\u00b0 "
    "counter-clockwise (e.g., \"R'\").\n"
    "Respond with a sequence of actions separated by \"||\".\n"
    "Example: <answer>U</answer>\n"
)
#: RAGEN's action_lookup {1: U, 2: U', ..., 12: B'} (fastpo's ids are RAGEN's).
RUBIKS_ACTIONS = ["U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'"]

#: fastpo preset name -> EnvPromptSpec fields (RAGEN tag in the comment).
PROMPT_PRESETS: dict[str, dict[str, Any]] = {
    "coord_sokoban": dict(  # CoordSokoban
        env_instruction=COORD_SOKOBAN_INSTRUCTION, grid_vocab=sokoban_grid_vocab("default"),
        action_lookup=SOKOBAN_ACTIONS, max_actions_per_traj=10, max_tokens=120,
    ),
    "coord_frozenlake": dict(  # CoordFrozenLake
        env_instruction=COORD_FROZENLAKE_INSTRUCTION, grid_vocab=FROZENLAKE_GRID_VOCAB,
        action_lookup=FROZENLAKE_ACTIONS, max_actions_per_traj=10, max_tokens=120,
    ),
    # game_2048: no legend (its config has no grid_vocab); RAGEN's budget is 700 actions and "8192 words".
    "game_2048": dict(
        env_instruction=GAME2048_INSTRUCTION, action_lookup=GAME2048_ACTIONS, max_actions_per_traj=700,
        max_tokens=8192,
    ),
    # SimpleSudoku / MediumSudoku: text actions, so no legend and no action list; 150 words.
    "simple_sudoku": dict(env_instruction=SUDOKU_INSTRUCTION, max_actions_per_traj=20, max_tokens=150),
    "medium_sudoku": dict(env_instruction=SUDOKU_INSTRUCTION, max_actions_per_traj=30, max_tokens=150),
    "rubikscube": dict(  # rubikscube
        env_instruction=RUBIKS_INSTRUCTION, action_lookup=RUBIKS_ACTIONS, max_actions_per_traj=20, max_tokens=96,
    ),
}
#: RAGEN's tag spellings (lowercased) -> preset name.
PROMPT_ALIASES = {"coordsokoban": "coord_sokoban", "coordfrozenlake": "coord_frozenlake", "game2048": "game_2048",
                  "2048": "game_2048", "simplesudoku": "simple_sudoku", "sudoku": "simple_sudoku",
                  "mediumsudoku": "medium_sudoku"}
