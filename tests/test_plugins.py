"""Plug-in envs end to end: --env.plugins on the train, eval and SFT command lines (and none imported because a
config file names it), the fastpo.envs entry-point group, the prompt a registered env supplies, and one clear error
for a plug-in that breaks the protocol."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastpo import envs
from fastpo.prompts import Turn, build_messages, env_prompt_spec, prompt_spec

REPO = Path(__file__).resolve().parents[1]

# The GuessNumber example of docs/ENVS.md (kept equal to it by test_docs_example_is_this_module).
GUESS_MODULE = '''
import fastpo.envs
from fastpo.envs.rng import CounterRng
from fastpo.envs.text import TextEnv


class GuessNumber(TextEnv):
    instruction = "Guess the secret integer. Answer with one number; I will say higher or lower."
    max_response_words = 20

    def __init__(self, hi: int = 100):
        self.hi = hi

    def reset(self, seed: int) -> str:
        self.secret = CounterRng(seed, stream=1000).randint(self.hi) + 1
        self.low, self.high = 1, self.hi
        return f"I picked a number between 1 and {self.hi}."

    def step(self, action_text: str):
        guess = action_text.strip()
        if not guess.isdecimal():
            return "Answer with a number.", 0.0, False, {"action_is_valid": False, "action_is_effective": False}
        if int(guess) == self.secret:
            return "Correct!", 1.0, True, {"success": True}
        if int(guess) < self.secret:
            self.low = max(self.low, int(guess) + 1)
            return "Higher.", 0.0, False, {}
        self.high = min(self.high, int(guess) - 1)
        return "Lower.", 0.0, False, {}

    def expert_actions(self) -> list[str]:
        return [str((self.low + self.high) // 2)]


fastpo.envs.register("guess", GuessNumber, max_steps=7)
'''

SMALL = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "8", "--env.val_groups", "2",
         "--env.env_groups", "2", "--env.group_size", "4", "--optim.mini_batch_size", "4",
         "--optim.micro_batch_tokens", "700", "--rollout.max_model_len", "700", "--trainer.iterations", "2",
         "--trainer.val_every", "2", "--trainer.val_before_train", "false", "--trainer.save_every", "0"]


def _env(plugin_dir: Path) -> dict[str, str]:
    path = os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1"}


def _run(module: str, args: list[str], plugin_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    # cwd is not the repo root: there transformers' probe for the HF `kernels` package would import ./kernels
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(plugin_dir), capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plugins")
    (d / "guess_envs.py").write_text(GUESS_MODULE)
    return d


@pytest.fixture()
def guess_registered(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    sys.modules.pop("guess_envs", None)
    envs._REGISTRY.pop("guess", None)
    envs.load_plugins("guess_envs")
    yield
    envs._REGISTRY.pop("guess", None)
    sys.modules.pop("guess_envs", None)


def test_docs_example_is_this_module():
    """docs/ENVS.md shows the GuessNumber module this file trains (same class body and registration)."""
    doc = (REPO / "docs" / "ENVS.md").read_text()
    for line in GUESS_MODULE.strip().splitlines():
        assert line in doc, line


def test_registered_env_supplies_its_prompt(guess_registered):
    env = envs.make("guess", 2, hi=10)
    spec = env_prompt_spec("guess", env, enable_think=False)
    assert (spec.env_instruction, spec.grid_vocab, spec.action_lookup) == (
        "Guess the secret integer. Answer with one number; I will say higher or lower.", None, None)
    assert spec.max_actions_per_traj == 7 and spec.max_tokens == 20  # max_steps; max_response_words
    obs = env.reset(np.array([5, 6]))
    text = build_messages(spec, [Turn(obs[0], actions_left=7)])[1]["content"]
    assert text.startswith(spec.env_instruction + "\nTurn 1:\nState:\nI picked a number between 1 and 10.\n")
    assert "You have 7 actions left." in text and "Max response length: 20 words (tokens)." in text
    assert env.expert_actions() == [["5"], ["5"]]
    # built-in names keep RAGEN's presets whatever env object is passed
    assert env_prompt_spec("sokoban", env) == prompt_spec("sokoban")


def test_vocabulary_and_legend_reach_the_prompt(monkeypatch):
    from fastpo.envs.text import TextEnv

    class Lamp(TextEnv):
        instruction = "Switch the lamp on."
        action_vocabulary = ["On", "Off"]
        legend = {"*": "lamp on", ".": "lamp off"}
        max_actions_per_traj = 3

        def reset(self, seed):
            return "."

        def step(self, action_text):
            return ("*" if action_text == "On" else "."), float(action_text == "On"), action_text == "On", {}

    monkeypatch.setitem(envs._REGISTRY, "lamp", {})
    envs.register("lamp", Lamp, overwrite=True)
    spec = env_prompt_spec("lamp", envs.make("lamp", 1))
    assert spec.prefix() == ("Switch the lamp on.\nThe meaning of each symbol in the state is:\n*: lamp on, .: lamp off"
                             "\nYour available actions are:\nOn, Off\nYou can make up to 3 actions, separated by the"
                             ' action separator " || "\n')

    class Bad(Lamp):
        max_response_words = 0

    envs.register("lamp", Bad, overwrite=True)
    with pytest.raises(envs.text.TextEnvError, match="'lamp' instance 0 failed in create: max_response_words"):
        envs.make("lamp", 1)


def test_entry_point_group_is_loaded_on_first_use(tmp_path, monkeypatch):
    """An installed package's ``fastpo.envs`` entry point is imported (and its function called) by available()."""
    (tmp_path / "ep_envs.py").write_text(GUESS_MODULE.replace('register("guess"', 'register("ep_guess"')
                                         + "\nCALLED = []\n\ndef setup():\n    CALLED.append(1)\n")
    dist = tmp_path / "ep_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fastpo.envs]\nguess = ep_envs:setup\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(envs, "_entry_points_loaded", False)
    try:
        assert "ep_guess" in envs.available()
        assert sys.modules["ep_envs"].CALLED == [1]
        assert not envs.is_builtin("ep_guess") and envs.is_builtin("larger_sokoban")
    finally:
        envs._REGISTRY.pop("ep_guess", None)
        sys.modules.pop("ep_envs", None)


def test_bad_plugin_module_is_one_config_error(tmp_path):
    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate

    with pytest.raises(ConfigError, match="env.plugins: env plug-in module 'no_such_envs' could not be imported"):
        validate(parse_args(["--env.plugins", "no_such_envs", "--env.names", "guess"]))


def test_a_plugin_module_calling_sys_exit_is_one_config_error(tmp_path, monkeypatch):
    """sys.exit(0) while the module is imported used to end `fastpo.train` with status 0 before anything ran."""
    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate

    (tmp_path / "quits_envs.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"env.plugins: env plug-in module 'quits_envs' could not be imported: "
                                          r"SystemExit: the module called sys.exit\(0\)"):
        validate(parse_args(["--env.plugins", "quits_envs", "--env.names", "guess"]))
    sys.modules.pop("quits_envs", None)


@pytest.mark.slow
def test_guess_number_trains_evaluates_and_sfts_from_the_command_line(plugin_dir, tmp_path):
    run = tmp_path / "run"
    train = _run("fastpo.train", [*SMALL, "--env.plugins", "guess_envs", "--env.names", "guess", "--env.kwargs",
                                  '{"hi": 10}', "--env.max_actions_per_traj", "7", "--trainer.run_dir", str(run)],
                 plugin_dir, tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert 0.0 <= rows[-1]["env/Guess/success"] <= 1.0 and "val-env/Guess/success" in rows[-1]
    # the run folder: its hf/ export, evaluated with the run's own settings (env, kwargs, budgets); the plug-in its
    # config.json names is imported because the command line names it too
    ev = _run("fastpo.eval", ["--model.path", str(run), "--env.plugins", "guess_envs", "--env.val_groups", "4",
                              "--rollout.response_length", "8"], plugin_dir, tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert ev.stdout.splitlines()[0].startswith(f"eval: defaults from {run / 'config.json'}")
    assert ev.stdout.splitlines()[3].startswith("Guess | 4 ")
    out = tmp_path / "sft"
    sft = _run("fastpo.sft", ["--model.path", str(run / "hf"), "--env.plugins", "guess_envs", "--env.names", "guess",
                              "--env.kwargs", '{"hi": 10}', "--sft.episodes", "8", "--sft.noise", "0", "--sft.steps",
                              "2", "--sft.batch_size", "2", "--rollout.enable_think", "false", "--sft.out", str(out)],
               plugin_dir, tmp_path)
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert "data: 8 episodes of guess" in sft.stdout and "success 1.000" in sft.stdout  # bisection within 7 guesses
    assert len((out / "sft_log.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_a_protocol_breaking_plugin_gets_one_error(plugin_dir, tmp_path):
    (plugin_dir / "broken_envs.py").write_text(GUESS_MODULE.replace(
        'return f"I picked a number between 1 and {self.hi}."', "return self.hi").replace(
        'register("guess"', 'register("broken_guess"'))
    from fastpo.tiny_agent import tiny_agent_path

    res = _run("fastpo.eval", ["--model.path", str(tiny_agent_path()), "--env.plugins", "broken_envs", "--env.names",
                               "broken_guess", "--env.kwargs", '{"hi": 10}', "--env.val_groups", "2",
                               "--rollout.response_length", "4", "--rollout.enable_think", "false", "--env.max_turns",
                               "3"], plugin_dir, tmp_path)
    lines = [x for x in res.stderr.splitlines() if "error" in x.lower()]  # (progress bars aside)
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0] == ("error: text env 'broken_guess' instance 0 (seed 123) failed in reset: reset must return a "
                        "str observation, got int")


HELD_OUT = '''
"""Written from docs/ENVS.md only: a word-reversal env with a vocabulary-free answer."""
import fastpo.envs
from fastpo.envs.rng import CounterRng
from fastpo.envs.text import TextEnv

WORDS = ["cat", "dog", "sun", "map", "pen"]


class ReverseWord(TextEnv):
    instruction = "Write the given word backwards."
    max_actions_per_traj = 2

    def reset(self, seed):
        self.word = WORDS[CounterRng(seed, stream=1001).randint(len(WORDS))]
        return f"Word: {self.word}"

    def step(self, action_text):
        ok = action_text.strip() == self.word[::-1]
        return ("Right." if ok else "Wrong."), float(ok), ok, {"success": ok}


fastpo.envs.register("reverse_word", ReverseWord, max_steps=2)
'''


@pytest.mark.slow
def test_held_out_env_trains_from_the_command_line_with_its_label(tmp_path):
    """Acceptance: an env module on PYTHONPATH, mixed with FrozenLake through --env.train, trains 2 iterations and
    its metrics appear in metrics.jsonl under its label."""
    (tmp_path / "held_out_envs.py").write_text(HELD_OUT)
    run = tmp_path / "run"
    mix = [{"name": "reverse_word", "label": "Reverse", "groups": 1, "max_turns": 1},
           {"name": "frozenlake", "groups": 1, "kwargs": {"is_slippery": False}, "max_actions_per_traj": 12}]
    res = _run("fastpo.train", [*SMALL, "--env.plugins", "held_out_envs", "--env.train", json.dumps(mix),
                                "--trainer.run_dir", str(run)], tmp_path, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for key in ("env/Reverse/success", "env/FrozenLake/success", "val-env/Reverse/success"):
        assert key in rows[-1], sorted(rows[-1])
    assert rows[-1]["env/Reverse/num_actions"] <= 1.0  # one turn of at most one action


# ------------------------------------------------------------------ trust: plug-ins named by a config file
EVIL = "import fastpo.envs  # a config file must not get this module imported\nIMPORTED = True\n"


@pytest.fixture()
def evil_dir(tmp_path, monkeypatch):
    """A folder on sys.path holding ``evil_envs.py`` (importable, so a refusal is the only thing keeping it out)."""
    (tmp_path / "evil_envs.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("evil_envs", None)
    yield tmp_path
    sys.modules.pop("evil_envs", None)


def _run_folder(tmp_path: Path) -> Path:
    """A run folder whose config.json (the trainer's full config) names the plug-in ``evil_envs``."""
    from fastpo.config import to_json
    from fastpo.presets import get_preset

    cfg = get_preset("tiny")
    cfg.env.plugins = ("evil_envs",)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(to_json(cfg))
    return run


def _assert_refusal(message: str, config_path: Path) -> None:
    assert "\n" not in message.strip(), message
    for words in ("'evil_envs'", str(config_path), "env.plugins", "--env.plugins evil_envs", "--trust_plugins"):
        assert words in message, (words, message)
    assert "evil_envs" not in sys.modules


def test_a_config_file_cannot_import_a_plugin(evil_dir):
    """--config FILE naming env.plugins: refused in one line naming the module, the file and the two ways to allow
    it, and nothing imported; --trust_plugins or naming the module with --env.plugins allows it."""
    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate

    path = _run_folder(evil_dir) / "config.json"
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    _assert_refusal(str(err.value), path)
    for allow in (["--trust_plugins"], ["--trust_plugins", "true"], ["--env.plugins", "evil_envs"]):
        assert parse_args(["--config", str(path), *allow]).env.plugins == ("evil_envs",), allow
    with pytest.raises(ConfigError):  # an explicit false is no trust
        parse_args(["--config", str(path), "--trust_plugins", "false"])
    assert parse_args(["--config", str(path), "--env.plugins", ""]).env.plugins == ()  # the command line wins
    assert "evil_envs" not in sys.modules
    validate(parse_args(["--config", str(path), "--trust_plugins", "--trainer.run_dir", str(evil_dir / "r")]))
    assert sys.modules["evil_envs"].IMPORTED  # trusted: imported by validate, as --env.plugins would be


def test_train_eval_and_sft_refuse_a_run_folders_plugin(evil_dir, capsys):
    """The three command lines: `fastpo.eval --model.path RUN` (the run's config.json read implicitly), `fastpo.train
    --config RUN/config.json` (what the config-hash refusal recommends) and `fastpo.sft --config ...`: exit 2 with one
    line, before anything is imported or loaded."""
    import fastpo.eval
    import fastpo.sft
    import fastpo.train

    run = _run_folder(evil_dir)
    path = run / "config.json"
    calls = [(fastpo.eval.main, ["--model.path", str(run)], "error: "),
             (fastpo.train.main, ["--config", str(path), "--trainer.run_dir", str(evil_dir / "r2")], "config error: "),
             (fastpo.sft.main, ["--config", str(path), "--model.path", "tiny", "--sft.out", str(evil_dir / "s")],
              "error: ")]
    for main, argv, prefix in calls:
        assert main(argv) == 2, main
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and err[0].startswith(prefix), err
        _assert_refusal(err[0], path)
    assert not (evil_dir / "r2").exists() and not (evil_dir / "s").exists()


# ------------------------------------------------------------------ a plug-in that fails in the middle of a run
MIDRUN = '''
import sys
from collections.abc import Mapping

import fastpo.envs
from fastpo.envs.text import TextEnv


class Info(Mapping):  # an info whose reading fails, as a remote scorer that timed out
    def __getitem__(self, key):
        raise RuntimeError("scorer timed out")

    def __iter__(self):
        raise RuntimeError("scorer timed out")

    def __len__(self):
        return 1


class Flaky(TextEnv):
    instruction = "Say anything."
    max_response_words = 5

    def reset(self, seed):
        return "go"

    def step(self, action_text):
        STEP


fastpo.envs.register("NAME", Flaky, max_steps=2)
'''
# (case, the body of step, what the one env error line says after "failed in step: ")
MIDRUN_CASES = [
    ("timed_out", 'return "ok", 0.0, True, Info()', "its result could not be read: RuntimeError: scorer timed out"),
    ("exits", "sys.exit(0)", "SystemExit: the env called sys.exit(0)"),
    ("says_no", 'return "ok", 0.0, True, {"success": "no"}',
     "info['success'] must be a bool or the number 0 / 1, got 'no'"),
]


def _midrun_plugin(tmp_path: Path, monkeypatch, case: str, step: str) -> tuple[str, str]:
    module, name = f"midrun_{case}_envs", f"midrun_{case}"
    (tmp_path / f"{module}.py").write_text(MIDRUN.replace("STEP", step).replace("NAME", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    return module, name


def _error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if "error" in x.lower() or "Traceback" in x or "stopped" in x]


@pytest.mark.slow
@pytest.mark.parametrize("case,step,says", MIDRUN_CASES, ids=[c[0] for c in MIDRUN_CASES])
def test_a_plugin_failing_mid_run_is_one_env_error_line(case, step, says, tmp_path, monkeypatch, capsys):
    """Past the preflight (which only builds and resets), the first step fails: one `env error:` line naming the env,
    the method and the seed, exit 1, nothing exported. Before: a 'timed out' in the message was reported as a
    stalled rank (one process), sys.exit(0) ended the run with status 0, and "no" counted as a success."""
    from fastpo.train import main

    module, name = _midrun_plugin(tmp_path, monkeypatch, case, step)
    run = tmp_path / "run"
    rc = main(["--preset", "tiny", "--env.env_groups", "4", "--env.group_size", "4", "--env.val_groups", "8",
               "--trainer.val_every", "0", "--trainer.val_before_train", "false", "--optim.mini_batch_size", "8",
               "--trainer.iterations", "1", "--rollout.response_length", "8", "--env.plugins", module, "--env.names",
               name, "--env.kwargs", "{}", "--env.max_actions_per_traj", "2", "--trainer.run_dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 1 and _error_lines(err) == [
        f"env error: text env {name!r} instance 0 (seed 10000) failed in step: {says}"], err[-3000:]
    assert not (run / "hf").exists()


def test_a_plugin_calling_sys_exit_mid_evaluation_is_one_error_line(tmp_path, monkeypatch, capsys):
    """sys.exit(0) in a step used to end `fastpo.eval` with status 0 and no table; now one `error:` line, exit 2."""
    import fastpo.eval
    from fastpo.tiny_agent import tiny_agent_path

    module, name = _midrun_plugin(tmp_path, monkeypatch, "eval_exits", "sys.exit(0)")
    out = tmp_path / "results.json"
    rc = fastpo.eval.main(["--model.path", str(tiny_agent_path()), "--env.plugins", module, "--env.names", name,
                           "--env.val_groups", "2", "--rollout.response_length", "4", "--rollout.enable_think",
                           "false", "--env.max_turns", "2", "--env.max_actions_per_traj", "2", "--eval.out", str(out)])
    lines = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1, lines
    assert re.fullmatch(rf"error: text env '{name}' instance \d+ \(seed 12\d\) failed in step: SystemExit: the env "
                        r"called sys.exit\(0\)", lines[0]), lines
    assert not out.exists()


# ------------------------------------------------------------------ a plug-in that blocks in the preflight
BLOCKING = '''
import threading

import fastpo.envs
from fastpo.envs.text import TextEnv

RELEASE = threading.Event()  # the test sets it, which ends the call left running in the background


class Stuck(TextEnv):
    instruction = "Say anything."

    def __init__(self):
        if WHERE == "create":
            RELEASE.wait()

    def reset(self, seed):
        if WHERE == "reset":
            RELEASE.wait()
        return "go"

    def step(self, action_text):
        return "ok", 0.0, True, {}


fastpo.envs.register("NAME", Stuck, max_steps=2)
'''


def _blocking_plugin(tmp_path: Path, monkeypatch, where: str, tag: str = "") -> tuple[str, str]:
    module, name = f"stuck_{where}{tag}_envs", f"stuck_{where}{tag}"  # a module of its own per test (RELEASE)
    (tmp_path / f"{module}.py").write_text(BLOCKING.replace("WHERE", repr(where)).replace("NAME", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    return module, name


@pytest.mark.parametrize("where,method,mix", [("create", "create", False), ("reset", "reset (seed 10000)", False),
                                             ("create", "create", True)])
def test_a_blocking_plugin_is_stopped_by_the_preflight_time_limit(where, method, mix, tmp_path, monkeypatch):
    """A plug-in whose constructor or reset never returns used to hang the preflight with no limit: now the check
    gives up after env.preflight_timeout_s with one line naming the env and the method (exit 2). An env.train
    entry is built by the mix's own checks first: limited the same way."""
    import time

    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate

    module, name = _blocking_plugin(tmp_path, monkeypatch, where, "_mix" if mix else "")
    envs_args = (["--env.train", json.dumps([{"name": name, "max_actions_per_traj": 2}])] if mix else
                 ["--env.names", name, "--env.kwargs", "{}", "--env.max_actions_per_traj", "2"])
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError) as err:
            validate(parse_args(["--preset", "tiny", "--env.plugins", module, *envs_args, "--env.preflight_timeout_s",
                                 "0.5", "--trainer.run_dir", str(tmp_path / "run")]))
    finally:
        sys.modules[module].RELEASE.set()
    lines = str(err.value).splitlines()[1:]
    assert lines == [f"  {'env.train[0]: ' if mix else ''}env {name!r}: {method} did not return within "
                     f"env.preflight_timeout_s (0.5 s); fix the env, or raise env.preflight_timeout_s if it needs "
                     f"longer (inf = no limit)"], str(err.value)
    assert time.monotonic() - t0 < 30


def test_a_blocking_plugin_stops_the_evaluations_prompt_check(tmp_path, monkeypatch, capsys):
    """fastpo.eval builds and resets each env to measure its first prompt before the model loads: limited too."""
    import fastpo.eval
    from fastpo.tiny_agent import tiny_agent_path

    module, name = _blocking_plugin(tmp_path, monkeypatch, "reset", "_eval")
    try:
        rc = fastpo.eval.main(["--model.path", str(tiny_agent_path()), "--env.plugins", module, "--env.names", name,
                               "--env.val_groups", "2", "--env.preflight_timeout_s", "0.5"])
    finally:
        sys.modules[module].RELEASE.set()
    lines = _error_lines(capsys.readouterr().err)
    assert rc == 2 and lines == [f"error: env {name!r}: reset (seed 123) did not return within "
                                 f"env.preflight_timeout_s (0.5 s); fix the env, or raise env.preflight_timeout_s if "
                                 f"it needs longer (inf = no limit)"], lines


@pytest.mark.parametrize("value,says", [("0", "must be > 0 seconds (inf = no limit), got 0.0"),
                                        ("-1", "must be > 0 seconds (inf = no limit), got -1.0"),
                                        ("nan", "must be a finite number or inf, got nan")])
def test_preflight_timeout_is_checked(value, says, tmp_path):
    import fastpo.eval
    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate

    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--preset", "tiny", "--env.preflight_timeout_s", value]))
    assert str(err.value).splitlines()[1:] == [f"  env.preflight_timeout_s {says}"]
    if value != "nan":  # eval: the same range, its own one-line check
        with pytest.raises(ConfigError, match=rf"^env.preflight_timeout_s {re.escape(says)}$"):
            fastpo.eval.parse_args(["--model.path", str(tmp_path), "--env.preflight_timeout_s", value])


CLOSING = '''
import fastpo.envs
from fastpo.envs.text import TextEnv


class Closing(TextEnv):
    def reset(self, seed):
        if RESET_FAILS:
            raise KeyError("no level")
        return "go"

    def step(self, action_text):
        return "ok", 0.0, True, {}

    def close(self):
        raise RuntimeError("server timed out")


fastpo.envs.register("NAME", Closing, max_steps=2)
'''


@pytest.mark.parametrize("reset_fails", [False, True])
def test_a_plugin_failing_in_close_during_the_checks_is_one_config_line(reset_fails, tmp_path, monkeypatch):
    """close() failing after the checks' reset used to escape them (a traceback, or 'a collective timed out' for its
    words); after a failed reset it replaced that first error. Now: one config error line naming the first failure."""
    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.envs.text import TextEnvError
    from fastpo.preflight import first_prompt_len, validate

    module, name = f"closing_{reset_fails}_envs".lower(), f"closing_{reset_fails}".lower()
    (tmp_path / f"{module}.py").write_text(CLOSING.replace("RESET_FAILS", str(reset_fails)).replace("NAME", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--preset", "tiny", "--env.plugins", module, "--env.names", name, "--env.kwargs", "{}",
                             "--env.max_actions_per_traj", "2", "--trainer.run_dir", str(tmp_path / "run")]))
    # close() comes after the last reset: the validation seed 123
    failure = ("(seed 10000) failed in reset: KeyError: 'no level'" if reset_fails else
               "(seed 123) failed in close: RuntimeError: server timed out")
    assert str(err.value).splitlines()[1:] == [
        f"  env.kwargs {{}}: env {name!r} (env.backend default) refuses them: text env {name!r} instance 0 {failure}"]
    with pytest.raises(TextEnvError) as err:  # the prompt check (train's start-up, eval) reports the first failure
        first_prompt_len(None, name, 7)
    assert err.value.phase == ("reset" if reset_fails else "close")
