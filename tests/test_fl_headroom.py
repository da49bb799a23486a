"""bench/fl_headroom.py: the best turn policy and shortest-path replanning valued on a run's validation states."""

from pathlib import Path

import numpy as np
import pytest

from fastpo import envs
from fastpo.envs.fl_planning import TurnPlanner

BENCH = Path(__file__).resolve().parents[1] / "bench"
ARGS = ["--env.names", "frozenlake", "--env.max_actions_per_turn", "2", "--env.val_groups", "24"]


@pytest.fixture
def fl_headroom(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import fl_headroom

    return fl_headroom


def test_main_prints_both_policies(fl_headroom, capsys):
    fl_headroom.main(ARGS + ["--env.kwargs", "{}"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("env | states")
    rows = {line.split(" | ")[3]: line.split(" | ") for line in lines[1:]}
    assert set(rows) == {"optimal", "shortest"}
    assert all(r[1] == "24" and r[2] == "5 x 2 (10)" for r in rows.values())
    expected = {k: float(r[4].rstrip("%")) for k, r in rows.items()}
    assert expected["optimal"] > expected["shortest"] > 0


def test_headroom_equals_the_planners_on_the_validation_seeds(fl_headroom):
    """The entry's seeds are val_seed + group, its budgets the config's; expected = the mean of the planners'
    values there, played = the env's episodes."""
    from fastpo import config
    from fastpo.env_mix import resolve_mix

    cfg = config.EnvConfig(names=("frozenlake",), kwargs={}, max_actions_per_turn=2, val_groups=24, val_seed=500)
    (entry,) = resolve_mix(cfg, "val")
    result = fl_headroom.headroom(entry, 500)
    seeds = np.arange(500, 524)
    env = envs.make("frozenlake", 24)
    env.reset(seeds)
    state = env.get_state()
    for policy in ("optimal", "shortest"):
        planners = [TurnPlanner(d, 2, policy) for d in state["desc"]]
        want = np.mean([p.value(int(c), 5, 10) for p, c in zip(planners, state["position"], strict=True)])
        assert result[policy]["expected"] == pytest.approx(want)
        env.reset(seeds)
        assert result[policy]["played"] == pytest.approx(fl_headroom.play(env, planners, 5, 10).mean())
    env.close()
    # non-slippery: both policies reach every goal within 10 actions
    flat = config.EnvConfig(names=("frozenlake",), kwargs={"is_slippery": False}, max_actions_per_turn=2,
                            val_groups=24)
    (entry,) = resolve_mix(flat, "val")
    assert fl_headroom.headroom(entry, 123) == {p: {"expected": 1.0, "played": 1.0} for p in ("optimal", "shortest")}


def test_other_envs_are_refused(fl_headroom):
    from fastpo import config
    from fastpo.env_mix import resolve_mix

    (entry,) = resolve_mix(config.EnvConfig(names=("sokoban",), val_groups=4), "val")
    with pytest.raises(ValueError, match="FrozenLake only, got env 'sokoban'"):
        fl_headroom.headroom(entry, 123)
