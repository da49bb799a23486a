"""The BatchEnv API of Sokoban and FrozenLake on both backends: types, shapes, and bad-input errors."""

import numpy as np
import pytest

import fastpo.envs as envs
from fastpo import _C

ENVS = [(name, backend) for name in ("sokoban", "frozenlake") for backend in ("cpp", "python")]


@pytest.mark.parametrize("name,backend", ENVS)
def test_outputs_have_the_documented_types(name, backend):
    env = envs.make(name, 5, backend=backend)
    obs = env.reset(np.arange(5))
    assert isinstance(obs, list) and len(obs) == 5 and all(isinstance(o, str) for o in obs)
    assert env.render() == obs
    obs, reward, terminated, truncated, info = env.step(np.array([1, 2, 3, 4, 0], dtype=np.int32))
    assert len(obs) == 5 and reward.dtype == np.float32 and reward.shape == (5,)
    assert terminated.dtype == truncated.dtype == np.bool_ and terminated.shape == truncated.shape == (5,)
    assert sorted(info) == sorted(envs.INFO_KEYS)
    assert all(v.dtype == np.bool_ and v.shape == (5,) for v in info.values())
    assert info["action_is_valid"].tolist() == [True, True, True, True, False]
    # Plain Python ints and other integer dtypes are accepted.
    env.step([1, 1, 1, 1, 1])
    env.step(np.ones(5, dtype=np.int64))
    env.step(np.ones(5, dtype=np.uint8))
    assert len(env.action_names) == 4 and env.name == name
    assert "The meaning of each symbol in the state is:" in env.instruction()
    keys = env.state_keys()
    assert keys.dtype == np.uint64 and keys.shape == (5,)


@pytest.mark.parametrize("name,backend", ENVS)
def test_step_without_render_matches_step_with_render(name, backend):
    rendered, silent = envs.make(name, 6, backend=backend), envs.make(name, 6, backend=backend)
    rendered.reset(np.arange(6))
    silent.reset(np.arange(6))
    rng = np.random.default_rng(1)
    for _ in range(8):
        actions = rng.integers(0, 5, size=6, dtype=np.int32)
        obs, *rest = rendered.step(actions)
        none, *rest_silent = silent.step(actions, render=False)
        assert none is None
        for a, b in zip(rest[:3], rest_silent[:3], strict=True):
            np.testing.assert_array_equal(a, b)
        assert all((rest[3][k] == rest_silent[3][k]).all() for k in envs.INFO_KEYS)
        assert silent.render() == obs


def test_action_names_and_aliases():
    assert envs.make("sokoban", 1).action_names == ["Up", "Down", "Left", "Right"]
    assert envs.make("frozenlake", 1).action_names == ["Left", "Down", "Right", "Up"]
    larger = envs.make("larger_sokoban", 2)
    assert larger.config.dim_room == (8, 8) and larger.config.num_boxes == 2 and larger.config.search_depth == 10
    assert all(len(o.split("\n")) == 8 for o in larger.reset([0, 1]))
    different = envs.make("sokoban_different_grid_vocab", 1)
    assert set(different.reset([3])[0]) <= set("W.GCBA@\n") and "W: wall" in different.instruction()
    assert isinstance(envs.make("sokoban", 1), envs.BatchEnv) and type(envs.make("sokoban", 1)).__name__ == "SokobanEnv"


@pytest.mark.parametrize("name,backend", ENVS)
def test_step_before_reset_raises(name, backend):
    env = envs.make(name, 2, backend=backend)
    with pytest.raises(RuntimeError, match="never reset"):
        env.step(np.ones(2, dtype=np.int32))
    with pytest.raises(RuntimeError, match="never reset"):  # reset returns all observations
        env.reset(np.arange(2), mask=np.array([True, False]))
    with pytest.raises(RuntimeError, match="never reset"):
        env.render()
    with pytest.raises(RuntimeError, match="never reset"):
        env.state_keys()
    assert len(env.reset(np.arange(2))) == 2


@pytest.mark.parametrize("name,backend", ENVS)
@pytest.mark.parametrize(
    "actions,message",
    [
        (np.ones(3, dtype=np.float32), "dtype float32"),
        (np.ones(3, dtype=bool), "dtype bool"),
        ([True, False, True], "bool"),
        (np.ones((3, 1), dtype=np.int32), r"shape \(3,\)"),
        (np.ones(4, dtype=np.int32), r"shape \(3,\), got \(4,\)"),
        (np.array([1, 2, 2**40]), "int32"),
        (["Up", "Down", "Left"], "integer"),
    ],
)
def test_bad_actions(name, backend, actions, message):
    env = envs.make(name, 3, backend=backend)
    env.reset(np.arange(3))
    with pytest.raises(ValueError, match=message):
        env.step(actions)


@pytest.mark.parametrize("name,backend", ENVS)
def test_bad_seeds_and_masks(name, backend):
    env = envs.make(name, 3, backend=backend)
    with pytest.raises(ValueError, match="dtype float64"):
        env.reset(np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"shape \(3,\), got \(2,\)"):
        env.reset(np.arange(2))
    with pytest.raises(ValueError, match=r"shape \(3,\), got \(\)"):
        env.reset(7)
    with pytest.raises(ValueError, match="mask must be a bool array"):
        env.reset(np.arange(3), mask=np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError, match="fit in int64"):
        env.reset(np.array([2**63, 0, 0], dtype=np.uint64))


def test_bindings_are_strict_without_the_python_checks():
    batch = _C.SokobanBatch(2, 6, 6, 1, 300, 10, list("#_O√XPS"))
    with pytest.raises(ValueError, match="seeds must have dtype int64"):
        batch.reset(np.arange(2, dtype=np.int32))
    with pytest.raises(ValueError, match="seeds must have shape"):
        batch.reset(np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="C-contiguous"):
        batch.reset(np.arange(4, dtype=np.int64)[::2])
    batch.reset(np.arange(2, dtype=np.int64))
    with pytest.raises(ValueError, match="actions must have dtype int32"):
        batch.step(np.ones(2, dtype=np.int64))
    with pytest.raises(ValueError, match="actions must be a numpy array"):
        batch.step([1, 2])
    with pytest.raises(ValueError, match="num_boxes must be in"):
        _C.SokobanBatch(2, 6, 6, 0, 300, 10, list("#_O√XPS"))
    with pytest.raises(ValueError, match="size must be in"):
        _C.FrozenLakeBatch(2, 1, 0.8, True, 10)


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize(
    "name,cfg,message",
    [
        ("sokoban", {"dim_rooms": (6, 6)}, r"unknown config key\(s\) \['dim_rooms'\]"),
        ("sokoban", {"dim_room": (3, 6)}, r"dim_room must be .* \[4, 64\], got \(3, 6\)"),
        ("sokoban", {"dim_room": 6}, r"dim_room .* got 6"),
        ("sokoban", {"num_boxes": 0}, r"num_boxes must be an int in \[1, 14\], got 0"),
        ("sokoban", {"num_boxes": 15}, r"num_boxes must be an int in \[1, 14\], got 15"),
        ("sokoban", {"search_depth": 1}, r"search_depth must be an int in \[2, 1000\], got 1"),
        ("sokoban", {"max_steps": 0}, r"max_steps must be an int in \[1, .*\], got 0"),
        ("sokoban", {"num_threads": 0}, r"num_threads must be an int in \[1, 256\], got 0"),
        ("sokoban", {"symbols": "fancy"}, r"symbols must be one of \['default', 'different'\], got 'fancy'"),
        ("sokoban", {"p_change_directions": 1.5}, r"p_change_directions must be in \[0.0, 1.0\], got 1.5"),
        ("sokoban", {"num_gen_steps": 0}, r"num_gen_steps must be an int in \[1, 100000\], got 0"),
        ("sokoban", {"max_steps": 2.5}, r"max_steps must be an int .* got 2.5"),
        ("frozenlake", {"map_seed": 3}, r"unknown config key\(s\) \['map_seed'\]"),
        ("frozenlake", {"size": 1}, r"size must be an int in \[2, 64\], got 1"),
        ("frozenlake", {"p": 0.0}, r"p must be in \(0, 1\], got 0.0"),
        ("frozenlake", {"p": 1.2}, r"p must be in \[0.0, 1.0\], got 1.2"),
        ("frozenlake", {"is_slippery": "yes"}, r"is_slippery must be a bool, got 'yes'"),
    ],
)
def test_bad_config(backend, name, cfg, message):
    with pytest.raises(ValueError, match=message):
        envs.make(name, 2, backend=backend, **cfg)


SOKOBAN_BAD_LAYOUTS = [
    ("######\n#P_O_#\n#_Z__#\n#_X__#\n######", r"env 1: unknown symbol 'Z' at row 2, column 2"),
    ("######\n#P_O_#\n#_X__#\n#___#\n######", r"env 1: ragged rows, row 3 ends at column 5"),
    ("######\n#P_O_#\n#_X__#\n######", r"env 1: size 4x6 .* env's 5x6"),
    ("######\n#__O_#\n#_X__#\n#____#\n######", r"env 1: expected exactly one player \(P or S\), found 0"),
    ("######\n#P_O_#\n#_X__#\n#__S_#\n######", r"env 1: expected exactly one player .* found 2 \(at row 3, column 3\)"),
    ("######\n#P_O_#\n#_XX_#\n#____#\n######", r"env 1: boxes .* found 2 boxes and 1 targets"),
    ("######\n#P___#\n#____#\n#____#\n######", r"env 1: boxes .* found 0 boxes and 0 targets"),
    (42, r"layout of env 1 must be a string or a list of row strings, got 42"),
]


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("layout,message", SOKOBAN_BAD_LAYOUTS)
def test_bad_sokoban_layouts(backend, layout, message):
    env = envs.make("sokoban", 2, backend=backend, dim_room=(5, 6))
    good = "######\n#P_O_#\n#_X__#\n#____#\n######"
    with pytest.raises(ValueError, match=message):
        env.reset_from_layouts([good, layout])
    with pytest.raises(ValueError, match="layouts must have length 2, got 1"):
        env.reset_from_layouts([good])
    with pytest.raises(ValueError, match="layouts must be a list of 2 layouts, got str"):
        env.reset_from_layouts(good)
    assert env.reset_from_layouts([good, good.split("\n")]) == [good, good]


FROZENLAKE_BAD_LAYOUTS = [
    (["SFFF", "FHFH", "FFXH", "HFFG"], r"env 1: unknown symbol 'X' at row 2, column 2; accepted: S F H G"),
    (["SFFF", "FHF", "FFFH", "HFFG"], r"env 1: ragged rows, row 1 ends at column 3"),
    (["SFF", "FHF", "FFG"], r"env 1: size 3x3 .* env's 4x4"),
    (["FFFF", "FHFH", "FFFH", "HFFG"], r"env 1: expected exactly one 'S', found 0"),
    (["SFFF", "FHFH", "FFSH", "HFFG"], r"env 1: expected exactly one 'S', found 2 \(second at row 2, column 2\)"),
    (["SFFF", "FHFH", "FFFH", "HFFF"], r"env 1: expected exactly one 'G', found 0"),
    ("SFFG\nFHFH\nFFFH\nHFFG", r"env 1: expected exactly one 'G', found 2 \(second at row 3, column 3\)"),
]


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("layout,message", FROZENLAKE_BAD_LAYOUTS)
def test_bad_frozenlake_layouts(backend, layout, message):
    env = envs.make("frozenlake", 2, backend=backend)
    good = ["SFFF", "FHFH", "FFFH", "HFFG"]
    with pytest.raises(ValueError, match=message):
        env.reset_from_layouts([good, layout])
    assert env.reset_from_layouts([good, "\n".join(good)])[1] == "P___\n_O_O\n___O\nO__G"


def test_state_keys_are_fnv1a_of_the_state_and_text_envs_hash_the_observation():
    from fastpo.envs.base import fnv1a64, text_state_keys

    assert fnv1a64(b"") == 0xCBF29CE484222325 and fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # FNV-1a 64 test vectors
    sok = envs.make("sokoban", 3)
    sok.reset(np.arange(3))
    state = sok.get_state()
    want = [fnv1a64(state["room_state"][i].tobytes(), fnv1a64(state["room_fixed"][i].tobytes())) for i in range(3)]
    assert sok.state_keys().tolist() == want
    lake = envs.make("frozenlake", 2)
    lake.reset(np.arange(2))
    state = lake.get_state()
    want = [fnv1a64(int(state["position"][i]).to_bytes(4, "little"), fnv1a64(state["desc"][i].tobytes()))
            for i in range(2)]
    assert lake.state_keys().tolist() == want
    text = envs.make("countdown", 3)
    obs = text.reset(np.array([5, 5, 6]))
    keys = text.state_keys()
    assert keys.dtype == np.uint64 and keys.tolist() == text_state_keys(obs).tolist()
    assert (keys[0] == keys[1]) == (obs[0] == obs[1]) and keys[0] != keys[2]
