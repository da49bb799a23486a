"""envs.fl_planning: exact success probabilities of turn policies on slippery FrozenLake, checked by hand, against
the env's own episodes (Monte Carlo over slip streams), and against the SFT data generator's policy."""

import numpy as np
import pytest

from fastpo import envs
from fastpo.envs.fl_planning import TurnPlanner, move_distribution, success_probability
from fastpo.envs.py_frozenlake import PyFrozenLakeEnv
from fastpo.sft_core import generate_episodes


def _desc(rows):
    return np.array([[ord(c) for c in row] for row in rows], dtype=np.uint8)


def test_move_distribution_is_gyms_perpendicular_rule():
    desc = _desc(["FFF", "FSF", "FFF"])
    # Right (3) from the centre: Down, Right or Up, 1/3 each
    assert sorted(move_distribution(desc, 4, 3, True)) == sorted([(7, 1 / 3), (5, 1 / 3), (1, 1 / 3)])
    # Left (1) from the top-left corner: Up (off the map: stays), Left (stays), Down
    assert sorted(move_distribution(desc, 0, 1, True)) == sorted([(0, 1 / 3), (0, 1 / 3), (3, 1 / 3)])
    assert move_distribution(desc, 4, 2, False) == [(7, 1.0)]
    with pytest.raises(ValueError, match="action must be in 1..4"):
        move_distribution(desc, 4, 0, True)


def test_values_by_hand():
    # S G on one row: Right reaches the goal w.p. 1/3 (its perpendiculars hit the map's edge and stay)
    line = _desc(["SG"])
    assert success_probability(line, 0, 1, 1, 1) == pytest.approx(1 / 3)
    assert success_probability(line, 0, 1, 2, 2) == pytest.approx(1 / 3 + 2 / 3 * 1 / 3)
    assert success_probability(line, 0, 5, 2, 10) == pytest.approx(1 - (2 / 3) ** 10)
    assert success_probability(line, 0, 5, 2, 3) == pytest.approx(1 - (2 / 3) ** 3)  # the action budget binds
    assert success_probability(line, 0, 1, 1, 1, is_slippery=False) == 1.0
    # a row of holes under the path: Right risks falling (Down) where Up slides right without risk
    edge = _desc(["SFG", "HHH"])
    safe, risky = TurnPlanner(edge, 1, "optimal"), TurnPlanner(edge, 1, "shortest")
    # one action from the middle: Down, Right and Up each reach G w.p. 1/3; ties keep the first (Down)
    assert risky.turn(1, 1, 1) == (3,) and safe.turn(1, 1, 1) == (2,)
    # three actions: Up 1/3 + 1/3 * 4/9 (stayed) + 1/3 * 1/9 (slid back) = 14/27 beats Right's 13/27 (its Down dies)
    assert safe.turn(1, 3, 3) == (4,) and safe.value(1, 3, 3) == pytest.approx(14 / 27)
    assert risky.value(1, 3, 3) == pytest.approx(13 / 27)
    # two actions left at S: Up then Up reaches G w.p. 1/9; Right then Right 1/9 too but Right's Down dies
    assert safe.value(0, 2, 2) == pytest.approx(1 / 9)
    assert risky.value(0, 2, 2) == pytest.approx(1 / 9)
    # three actions: Up keeps the 2/3 "stayed" mass alive; Right loses 1/3 to the hole at every step
    assert safe.turn(0, 3, 3) == (4,)
    assert safe.value(0, 3, 3) == pytest.approx(safe_three_steps()) == pytest.approx(2 / 9)
    assert risky.value(0, 3, 3) == pytest.approx(5 / 27)


def safe_three_steps():
    # "Up" from the top row of ["SFG", "HHH"] moves Left / stays / moves Right w.p. 1/3 each; the goal at column 2
    p, total = {0: 1.0}, 0.0
    for _ in range(3):
        nxt = {}
        for col, w in p.items():
            for d in (-1, 0, 1):
                c = min(max(col + d, 0), 2)
                if c == 2:
                    total += w / 3
                else:
                    nxt[c] = nxt.get(c, 0.0) + w / 3
        p = nxt
    return total


def test_terminal_cells_and_bad_arguments():
    desc = _desc(["SH", "FG"])
    planner = TurnPlanner(desc, 2, "optimal")
    assert planner.value(3, 1, 1) == 1.0 and planner.turn(3, 1, 1) == ()
    assert planner.value(1, 3, 3) == 0.0 and planner.turn(1, 3, 3) == ()
    assert planner.value(0, 0, 5) == 0.0 and planner.value(0, 5, 0) == 0.0
    with pytest.raises(ValueError, match="policy must be"):
        TurnPlanner(desc, 2, "greedy")
    with pytest.raises(ValueError, match="actions_per_turn must be an int >= 1, got 0"):
        TurnPlanner(desc, 0)
    with pytest.raises(ValueError, match=r"cell must be in \[0, 4\), got 4"):
        planner.value(4, 1, 1)
    with pytest.raises(ValueError, match="turns must be an int >= 1"):
        success_probability(desc, 0, 0, 2, 10)


@pytest.mark.parametrize("policy", ["optimal", "shortest"])
def test_expected_value_matches_the_envs_episodes(policy):
    """One map played 3,000 times with different slip streams (the env's own rule and RNG): the success rate is
    the planner's value within 4 standard errors."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from fl_headroom import play

    layout = ["FFFF", "FSHF", "FFFH", "HFGF"]  # optimal 0.28, shortest path 0.19
    n = 3000
    env = PyFrozenLakeEnv(n, is_slippery=True, max_steps=10)
    env.reset_from_layouts([layout] * n, seeds=np.arange(n))
    planner = TurnPlanner(_desc(layout), 2, policy)
    rate = play(env, [planner] * n, 5, 10).mean()
    value = planner.value(5, 5, 10)  # S is cell 5
    assert 0.1 < value < 0.9
    assert abs(rate - value) < 4 * np.sqrt(value * (1 - value) / n), (rate, value)


def test_optimal_dominates_and_shortest_is_what_sft_plays():
    """On 200 random slippery levels: the optimal value is >= the shortest-path value on every level, and the
    shortest-path policy played in the env succeeds on exactly the episodes the SFT data generator
    (``--sft.turn_length max --sft.noise 0``) solves."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from fl_headroom import play

    seeds = np.arange(5000, 5200)
    env = envs.make("frozenlake", len(seeds))
    env.reset(seeds)
    state = env.get_state()
    optimal = [TurnPlanner(d, 2, "optimal") for d in state["desc"]]
    shortest = [TurnPlanner(d, 2, "shortest") for d in state["desc"]]
    for o, s, c in zip(optimal, shortest, state["position"], strict=True):
        assert o.value(int(c), 5, 10) >= s.value(int(c), 5, 10) - 1e-12
    played = play(env, shortest, 5, 10)
    episodes = generate_episodes("frozenlake", len(seeds), seed=5000, noise=0.0, max_actions_per_turn=2,
                                 max_turns=5, enable_think=False, env_kwargs={}, turn_length="max")
    by_seed = {e.seed: e.success for e in episodes}
    assert [bool(by_seed.get(int(s), False)) for s in seeds] == played.tolist()
    gap = np.mean([o.value(int(c), 5, 10) - s.value(int(c), 5, 10)
                   for o, s, c in zip(optimal, shortest, state["position"], strict=True)])
    assert gap > 0.05  # slippery ice: the shortest path is often not the safest
    env.close()
