"""The text-env protocol: register()/make(), batch semantics, error propagation, input checks, docs example."""

import math
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

import fastpo.envs
from fastpo.envs import _REGISTRY
from fastpo.envs.text import TextBatchEnv, TextEnv, TextEnvError


class Counter(TextEnv):
    """Counts up to a goal; "+" adds one, "fail" raises, anything else is invalid. Records its calls."""

    instruction = "Say + until you reach the goal."
    max_actions_per_turn = 3

    def __init__(self, goal: int = 2, fail_seed: int | None = None):
        self.goal, self.fail_seed = goal, fail_seed
        self.calls: list[str] = []

    def reset(self, seed: int) -> str:
        if seed == self.fail_seed:
            raise KeyError("bad seed")
        self.seed, self.count = seed, 0
        self.calls.append(f"reset {seed}")
        return f"seed {seed}: 0"

    def step(self, action_text: str):
        self.calls.append(f"step {action_text}")
        if action_text == "fail":
            raise ZeroDivisionError("boom")
        if action_text != "+":
            return f"seed {self.seed}: {self.count}", 0.0, False, {"action_is_valid": False, "note": "bad"}
        self.count += 1
        done = self.count >= self.goal
        return f"seed {self.seed}: {self.count}", 1.0, done, {"success": done}


@pytest.fixture(autouse=True)
def restore_registry():
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_register_and_make():
    fastpo.envs.register("Counter", Counter, max_steps=5)
    assert "counter" in fastpo.envs.available()
    env = fastpo.envs.make("COUNTER", 3, goal=3)
    assert isinstance(env, TextBatchEnv) and env.name == "counter" and env.max_steps == 5
    assert env.action_space == "text" and env.action_names == [] and env.action_vocabulary is None
    assert env.instruction() == Counter.instruction and env.max_actions_per_turn == 3
    assert [e.goal for e in env.envs] == [3, 3, 3] and len({id(e) for e in env.envs}) == 3
    assert env.reset(np.array([4, 5, 6])) == ["seed 4: 0", "seed 5: 0", "seed 6: 0"]
    obs, reward, terminated, truncated, info = env.step(["+", "x", "+"])
    assert obs == ["seed 4: 1", "seed 5: 0", "seed 6: 1"]
    assert reward.dtype == np.float32 and reward.tolist() == [1.0, 0.0, 1.0]
    assert not terminated.any() and not truncated.any()
    # flags default to success False, valid True, effective True; extra keys stay in last_infos
    assert info["action_is_valid"].tolist() == [True, False, True]
    assert info["action_is_effective"].tolist() == [True, True, True]
    assert env.last_infos[1] == {"action_is_valid": False, "note": "bad"}
    assert fastpo.envs.make("counter", 1, max_steps=None).max_steps is None


def test_register_rejects_bad_names_and_duplicates():
    for name in ("bandit", "Sokoban", "metamathqa", "", 3):
        with pytest.raises(ValueError):
            fastpo.envs.register(name, Counter)
    fastpo.envs.register("counter2", Counter)
    with pytest.raises(ValueError, match="already registered"):
        fastpo.envs.register("counter2", Counter)
    fastpo.envs.register("counter2", lambda **cfg: Counter(goal=9, **cfg), overwrite=True)
    assert fastpo.envs.make("counter2", 1).envs[0].goal == 9
    with pytest.raises(ValueError):
        fastpo.envs.register("counter3", "not callable")


def test_unknown_config_keys():
    fastpo.envs.register("counter", Counter)
    with pytest.raises(ValueError, match="does not fit"):
        fastpo.envs.make("counter", 2, goal=2, speed=3)
    with pytest.raises(ValueError, match="max_steps"):
        fastpo.envs.make("counter", 2, max_steps=0)


def test_done_then_noop_and_truncation():
    env = TextBatchEnv(3, lambda: Counter(goal=2), max_steps=2, name="counter")
    env.reset(np.arange(3))
    env.step(["+", "+", "x"])
    obs, reward, terminated, truncated, info = env.step(["+", "x", "x"])
    assert terminated.tolist() == [True, False, False] and truncated.tolist() == [False, True, True]
    assert info["success"].tolist() == [True, False, False]
    calls = [list(e.calls) for e in env.envs]
    obs2, reward, terminated2, truncated2, info = env.step(["+", "+", "+"])
    assert [e.calls for e in env.envs] == calls  # finished instances are not stepped
    assert obs2 == obs and not reward.any()
    assert terminated2.tolist() == terminated.tolist() and truncated2.tolist() == truncated.tolist()
    assert info["success"].tolist() == [True, False, False]
    assert not info["action_is_valid"].any() and not info["action_is_effective"].any()
    assert env.last_infos == [{}, {}, {}]


def test_done_on_the_last_budgeted_step_is_terminated_not_truncated():
    env = TextBatchEnv(1, lambda: Counter(goal=2), max_steps=2)
    env.reset(np.array([0]))
    env.step(["+"])
    _, _, terminated, truncated, _ = env.step(["+"])
    assert terminated[0] and not truncated[0]


def test_mask_reset():
    env = TextBatchEnv(3, lambda: Counter(goal=1))
    env.reset(np.array([1, 2, 3]))
    env.step(["+", "+", "+"])
    obs = env.reset(np.array([7, 8, 9]), mask=np.array([False, True, False]))
    assert obs == ["seed 1: 1", "seed 8: 0", "seed 3: 1"]
    assert [e.calls[-1] for e in env.envs] == ["step +", "reset 8", "step +"]
    _, reward, terminated, _, info = env.step(["+", "+", "+"])
    assert reward.tolist() == [0.0, 1.0, 0.0] and terminated.all()
    assert info["action_is_valid"].tolist() == [False, True, False]


def test_step_before_reset():
    env = TextBatchEnv(2, Counter)
    with pytest.raises(RuntimeError, match="never reset"):
        env.step(["+", "+"])
    env.reset(np.array([0, 1]), mask=np.array([False, True]))
    with pytest.raises(RuntimeError, match=r"\[0\]"):
        env.step(["+", "+"])


def test_user_errors_name_the_instance():
    env = TextBatchEnv(3, lambda: Counter(fail_seed=42), name="counter")
    with pytest.raises(TextEnvError, match=r"'counter' instance 2 \(seed 42\) failed in reset: KeyError") as err:
        env.reset(np.array([0, 1, 42]))
    assert err.value.index == 2 and err.value.phase == "reset" and err.value.seed == 42
    assert isinstance(err.value.__cause__, KeyError)
    env.reset(np.array([5, 6, 7]))
    with pytest.raises(TextEnvError, match=r"instance 1 \(seed 6\) failed in step: ZeroDivisionError: boom") as err:
        env.step(["+", "fail", "+"])
    assert err.value.index == 1 and isinstance(err.value.__cause__, ZeroDivisionError)

    made = []

    def factory():
        if len(made) == 2:
            raise OSError("no server")
        made.append(1)
        return Counter()

    with pytest.raises(TextEnvError, match="instance 2 failed in create: OSError: no server"):
        TextBatchEnv(4, factory)


class Broken(Counter):
    def __init__(self, result):
        super().__init__()
        self.result = result

    def step(self, action_text):
        return self.result


@pytest.mark.parametrize(
    "result, match",
    [
        (("obs", 1.0, False), r"\(obs, reward, done, info\)"),
        (["obs", 1.0, False, {}], r"\(obs, reward, done, info\)"),
        ((None, 1.0, False, {}), "obs must be a str"),
        (("obs", math.nan, False, {}), "finite"),
        (("obs", "1", False, {}), "finite real"),
        (("obs", True, False, {}), "finite real"),
        (("obs", 1.0, 1, {}), "done must be a bool"),
        (("obs", False, 1.0, {}), "finite real"),
        (("obs", 1.0, False, None), "info must be a dict"),
    ],
)
def test_protocol_violations(result, match):
    env = TextBatchEnv(2, lambda: Broken(result))
    env.reset(np.arange(2))
    with pytest.raises(TextEnvError, match=match) as err:
        env.step(["+", "+"])
    assert err.value.index == 0 and err.value.phase == "step"


def test_numpy_values_are_accepted():
    env = TextBatchEnv(1, lambda: Broken(("obs", np.float32(0.5), np.bool_(True), {"success": np.bool_(True)})))
    env.reset(np.array([0]))
    _, reward, terminated, _, info = env.step(["+"])
    assert reward[0] == 0.5 and terminated[0] and info["success"][0]


def test_bad_instances_and_settings():
    class NoStep:
        def reset(self, seed):
            return ""

    class NotStr(Counter):
        def reset(self, seed):
            return 5

    with pytest.raises(TextEnvError, match="no step"):
        TextBatchEnv(1, NoStep)
    env = TextBatchEnv(1, NotStr)
    with pytest.raises(TextEnvError, match="must return a str"):
        env.reset(np.array([0]))
    for kwargs in ({"max_steps": 0}, {"max_steps": 2.0}, {"max_steps": True}):
        with pytest.raises(ValueError):
            TextBatchEnv(1, Counter, **kwargs)
    for n in (0, -1, 1.0, True):
        with pytest.raises(ValueError):
            TextBatchEnv(n, Counter)
    with pytest.raises(ValueError):
        TextBatchEnv(1, Counter())
    for attrs in ({"instruction": None}, {"max_actions_per_turn": 0}, {"action_vocabulary": "Up"}):
        with pytest.raises(TextEnvError):
            TextBatchEnv(1, type("Bad", (Counter,), attrs))


@pytest.mark.parametrize(
    "actions", [["+"], ["+", "+", "+"], "++", ("+", 1), [None, "+"], np.array(["+", "+"]), {"a": "+", "b": "+"}]
)
def test_bad_actions(actions):
    env = TextBatchEnv(2, Counter)
    env.reset(np.arange(2))
    with pytest.raises(ValueError):
        env.step(actions)


def test_bad_seeds_and_mask():
    env = TextBatchEnv(2, Counter)
    for seeds in (np.array([0.0, 1.0]), [0], ["a", "b"], np.arange(4).reshape(2, 2)):
        with pytest.raises(ValueError):
            env.reset(seeds)
    for mask in (np.array([1, 0]), [True], np.array([True, False, True])):
        with pytest.raises(ValueError):
            env.reset(np.arange(2), mask=mask)


class Moves(TextEnv):
    action_vocabulary = ["Go North", "Go South"]

    def reset(self, seed):
        self.got = []
        return "start"

    def step(self, action_text):
        self.got.append(action_text)
        return action_text, 0.0, False, {}


def test_action_vocabulary():
    env = TextBatchEnv(3, Moves, max_steps=2)
    env.reset(np.arange(3))
    obs, _, _, truncated, info = env.step(["  go NORTH ", "Go West", "Go South"])
    assert obs == ["Go North", "start", "Go South"]
    assert info["action_is_valid"].tolist() == [True, False, True]
    assert info["action_is_effective"].tolist() == [True, False, True]
    _, _, _, truncated, _ = env.step(["go south", "go south", "up"])
    assert truncated.tolist() == [True, False, False]  # the invalid answer used no budget
    assert [e.got for e in env.envs] == [["Go North", "Go South"], ["Go South"], ["Go South"]]
    with pytest.raises(TextEnvError, match="same ignoring case"):
        TextBatchEnv(1, type("Dup", (Moves,), {"action_vocabulary": ["Up", "UP"]}))


def test_close_reaches_every_instance():
    env = TextBatchEnv(2, Counter)
    closed = []
    for i, e in enumerate(env.envs):
        e.close = lambda i=i: closed.append(i)
    env.close()
    assert closed == [0, 1]


def test_docs_example_runs():
    """docs/ENVS.md's user-env example, executed as written."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "ENVS.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "register(" in b)
    namespace: dict = {}
    exec(compile(example, "docs/ENVS.md", "exec"), namespace)  # our own documentation, not user input
    env, reward = namespace["env"], namespace["reward"]
    secrets = [e.secret for e in env.envs]
    assert all(1 <= s <= 10 for s in secrets) and env.max_steps == 7
    assert namespace["obs"][2] == "Answer with a number." and not namespace["info"]["action_is_valid"][2]
    for i, guess in ((0, 5), (1, 5), (3, 10)):
        s = secrets[i]
        assert namespace["obs"][i] == ("Correct!" if s == guess else "Higher." if guess < s else "Lower.")
    assert reward.tolist() == [float(o == "Correct!") for o in namespace["obs"]]


def test_inactive_instances_are_left_untouched():
    env = fastpo.envs.make("countdown", 3)
    env.reset(np.arange(3))
    before = env.render()
    obs, reward, terminated, truncated, info = env.step(["1 + 2", "x", "y"], active=np.array([False, True, False]))
    assert obs[0] == before[0] and obs[2] == before[2] and obs[1] != before[1]
    assert reward[0] == reward[2] == 0 and not terminated[0] and not terminated[2] and terminated[1]
    assert not info["action_is_valid"][0] and info["action_is_valid"][1]
    with pytest.raises(ValueError, match="mask"):
        env.step(["a", "b", "c"], active=np.array([1, 0, 1]))


# --------------------------------------------------- every call into the user's code fails as a TextEnvError
class Exits(Counter):
    """Calls sys.exit(0) in the method named ``where`` (the plug-in that ended a run with status 0)."""

    where = ""

    def __init__(self):
        super().__init__()
        if self.where == "create":
            raise SystemExit(0)

    def reset(self, seed):
        if self.where == "reset":
            raise SystemExit(0)
        return super().reset(seed)

    def step(self, action_text):
        if self.where == "step":
            raise SystemExit(0)
        return super().step(action_text)

    def expert_actions(self):
        if self.where == "expert_actions":
            raise SystemExit("bye")
        return ["+"]

    def close(self):
        if self.where == "close":
            raise SystemExit(0)


@pytest.mark.parametrize("where", ["create", "reset", "step", "expert_actions", "close"])
def test_sys_exit_in_user_code_is_an_env_error(where):
    """SystemExit is no Exception: it used to pass TextBatchEnv and end a training run with status 0."""
    cls = type("ExitsIn", (Exits,), {"where": where})
    with pytest.raises(TextEnvError, match=rf"'exits' instance 0 (\(seed 3\) )?failed in {where}: SystemExit") as err:
        env = TextBatchEnv(1, cls, name="exits")
        env.reset(np.array([3]))
        env.step(["+"])
        env.expert_actions()
        env.close()
    assert err.value.phase == where and isinstance(err.value.__cause__, SystemExit)
    assert "sys.exit" in str(err.value)


class Raises:
    """An info value whose truth value raises (bool() of it used to run the user's code unguarded)."""

    def __init__(self, message):
        self.message = message

    def __bool__(self):
        raise RuntimeError(self.message)


class WeirdInfo(Mapping):
    """An info Mapping (not a dict) whose reading fails."""

    def __getitem__(self, key):
        raise RuntimeError("scorer timed out")

    def __iter__(self):
        raise RuntimeError("scorer timed out")

    def __len__(self):
        return 1


@pytest.mark.parametrize("where", ["close", "attribute", "info_mapping", "info_value"])
def test_user_code_outside_reset_and_step_is_an_env_error(where):
    """close(), a prompt attribute (a property), a dict subclass as info or a flag's own __bool__ run the user's code
    too: each used to escape as a raw exception (a traceback, or a 'collective timed out' for 'timed out')."""
    attrs: dict = {}
    if where == "close":
        attrs["close"] = lambda self: (_ for _ in ()).throw(RuntimeError("server timed out"))
    elif where == "attribute":
        attrs["instruction"] = property(lambda self: (_ for _ in ()).throw(RuntimeError("no prompt")))
    elif where == "info_mapping":
        attrs["step"] = lambda self, a: ("obs", 0.0, True, WeirdInfo())
    else:
        attrs["step"] = lambda self, a: ("obs", 0.0, True, {"success": Raises("scorer timed out")})
    phase = {"attribute": "create", "info_mapping": "step", "info_value": "step"}.get(where, where)
    with pytest.raises(TextEnvError, match=f"failed in {phase}") as err:
        env = TextBatchEnv(1, type("Odd", (Counter,), attrs), name="odd")
        env.reset(np.array([7]))
        env.step(["+"])
        env.close()
    assert err.value.phase == phase


@pytest.mark.parametrize("value", ["no", "yes", "", None, 2, -1, 0.5, math.nan, [True], np.array([1, 0]),
                                   np.str_("True")])
@pytest.mark.parametrize("key", ["success", "action_is_valid", "action_is_effective"])
def test_info_flags_must_be_bool_or_0_1(key, value):
    """info["success"] = "no" was truthy, so it counted as a success: a flag must be a bool or the number 0 / 1."""
    env = TextBatchEnv(2, lambda: Broken(("obs", 1.0, True, {key: value})), name="flags")
    env.reset(np.array([4, 5]))
    with pytest.raises(TextEnvError) as err:
        env.step(["+", "+"])
    message = str(err.value)
    assert err.value.phase == "step" and err.value.seed == 4 and "'flags'" in message
    assert f"info[{key!r}]" in message and "bool" in message and "0 / 1" in message
    assert repr(value)[:20] in message


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (np.bool_(True), True), (1, True), (0, False),
                                            (1.0, True), (0.0, False), (np.int64(1), True), (np.float32(0), False)])
def test_info_flags_accept_bools_and_0_1(value, expected):
    env = TextBatchEnv(1, lambda: Broken(("obs", 1.0, True, {"success": value, "action_is_valid": value})))
    env.reset(np.array([0]))
    info = env.step(["+"])[4]
    assert info["success"][0] == expected and info["action_is_valid"][0] == expected
