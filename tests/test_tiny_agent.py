"""fastpo.tiny_agent: the shipped agent loads through from_pretrained; a build is deterministic; the default path
falls back to a cached build; and the shortened default run (`make demo`'s command) works end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpo import tiny_agent
from fastpo.tiny_agent import SHIPPED_DIR, TinyAgentRecipe, build_tiny_agent, tiny_agent_path

REPO = Path(__file__).resolve().parents[1]
QUICK = TinyAgentRecipe(read_episodes=16, read_steps=2, episodes=16, sft_steps=2, batch_size=4)


def test_shipped_agent_loads_through_from_pretrained():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert tiny_agent_path(build_if_missing=False) == SHIPPED_DIR
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR)
    tok = AutoTokenizer.from_pretrained(SHIPPED_DIR)
    assert model.config.model_type == "qwen2" and model.config.hidden_size // model.config.num_attention_heads >= 32
    assert sum(p.numel() for p in model.parameters()) < 5_000_000  # "a few million parameters at most"
    assert sum(f.stat().st_size for f in SHIPPED_DIR.iterdir()) < 20 * 2**20
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    # every grid cell stays one token (docs/TINY_AGENT.md section 1)
    assert [tok.decode([i]) for i in tok.encode("_P_G\nOO__", add_special_tokens=False)] == list("_P_G\nOO__")
    meta = json.loads((SHIPPED_DIR / "tiny_agent.json").read_text())
    assert meta["recipe"]["env"] == "frozenlake" and meta["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_build_is_deterministic(tmp_path):
    a = build_tiny_agent(tmp_path / "a", QUICK, log=lambda _: None)
    b = build_tiny_agent(tmp_path / "b", QUICK, log=lambda _: None)
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not list(tmp_path.glob("*.tmp-*"))  # written under a temporary name, then renamed
    assert json.loads((a / "tiny_agent.json").read_text())["recipe"]["sft_steps"] == 2


@pytest.mark.slow
def test_missing_shipped_agent_falls_back_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_agent, "SHIPPED_DIR", tmp_path / "absent")
    monkeypatch.setenv("FASTPO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="python -m fastpo.tiny_agent --out"):
        tiny_agent_path(build_if_missing=False)
    built = []
    monkeypatch.setattr(tiny_agent, "build_tiny_agent", lambda out: built.append(out) or build_tiny_agent(out, QUICK))
    path = tiny_agent_path()
    assert path == tmp_path / "cache" / "tiny-agent" and built == [path]
    assert tiny_agent_path() == path and len(built) == 1  # the second call finds the cached build


def test_cli_rejects_bad_values(capsys):
    assert tiny_agent.main(["--out", "x", "--recipe.noise", "1.5"]) == 2
    assert "recipe.noise must lie in [0, 1], got 1.5" in capsys.readouterr().err


BAD_RECIPES = [  # (flags, words of the one line); each used to fail after data generation, or to exit 0
    (["--recipe.lr", "inf"], "recipe.lr must be a finite number > 0, got inf"),
    (["--recipe.layers", "0"], "recipe.layers must be >= 1, got 0"),
    (["--recipe.hidden", "100"], "recipe.hidden (100) / recipe.heads (4) = 25"),
    (["--recipe.heads", "3", "--recipe.kv_heads", "1"], "recipe.hidden (128) must be divisible by recipe.heads (3)"),
    (["--recipe.kv_heads", "3"], "recipe.heads (4) must be divisible by recipe.kv_heads (3)"),
    (["--recipe.env", "countdown", "--recipe.env_kwargs", "{}"], "recipe.env 'countdown' has no solver"),
    (["--recipe.env", "nope"], "recipe.env: unknown env 'nope'"),
    (["--recipe.env_kwargs", "{size: -1}"], "recipe.env_kwargs {'size': -1}"),
    (["--recipe.batch_size", "0"], "recipe.batch_size must be >= 1, got 0"),
    (["--recipe.max_turns", "0"], "recipe.max_turns must be >= 1, got 0"),
    (["--recipe.max_actions_per_turn", "0"], "recipe.max_actions_per_turn must be >= 1, got 0"),
    (["--recipe.read_episodes", "0"], "recipe.read_episodes must be >= 1"),
    (["--recipe.data_seed", "-1"], "recipe.data_seed must lie in [0, "),
    (["--recipe.read_loss_target", "nan"], "recipe.read_loss_target must be a finite number"),
]


@pytest.mark.parametrize("flags,words", BAD_RECIPES, ids=[" ".join(f) for f, _ in BAD_RECIPES])
def test_bad_recipes_are_refused_before_any_work(flags, words, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tiny_agent, "build_tiny_agent", lambda *a, **k: pytest.fail("work started"))
    assert tiny_agent.main(["--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and err.startswith("error: "), err
    from fastpo.cli import parse

    recipe = parse(tiny_agent.TinyAgentArgs, flags, prog="test").recipe
    monkeypatch.undo()
    with pytest.raises(ValueError) as info:  # the library function refuses the same, before any work
        build_tiny_agent(tmp_path / "lib", recipe, log=lambda _: pytest.fail("work started"))
    assert words in str(info.value) and not (tmp_path / "lib").exists()


def test_every_bad_field_is_listed_one_line_each(tmp_path, capsys):
    assert tiny_agent.main(["--out", str(tmp_path / "o"), "--recipe.layers", "0", "--recipe.lr", "-1"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "recipe.layers" in lines[0] + lines[1] and "recipe.lr" in lines[0] + lines[1]


def test_out_folder_with_other_files_is_not_deleted(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    built = []
    monkeypatch.setattr(tiny_agent, "build_tiny_agent", lambda out, r, overwrite=False: built.append(out))
    assert tiny_agent.main(["--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert str(mine) in err and "--overwrite true" in err and err.count("\n") == 1, err
    assert (mine / "thesis.tex").read_text() == "precious" and not built
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not a tiny agent"):  # the library function too, before any work
        build_tiny_agent(mine, QUICK, log=lambda _: pytest.fail("work started"))
    monkeypatch.setattr(tiny_agent, "build_tiny_agent", lambda out, r, overwrite=False: built.append(out))
    (tmp_path / "afile").write_text("x")
    assert tiny_agent.main(["--out", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err
    previous = tmp_path / "previous"  # a previous tiny-agent output, or an empty folder: replaced as before
    previous.mkdir()
    (previous / "tiny_agent.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for out in (previous, tmp_path / "empty", tmp_path / "new"):
        assert tiny_agent.main(["--out", str(out)]) == 0
    assert tiny_agent.main(["--out", str(mine), "--overwrite", "true"]) == 0
    assert len(built) == 4


@pytest.mark.slow  # trains the tiny agent (~5 CPU-s)
def test_diverged_training_is_an_error_and_saves_nothing(tmp_path):
    out = tmp_path / "agent"
    with pytest.raises(FloatingPointError, match="not finite"):
        build_tiny_agent(out, TinyAgentRecipe(read_episodes=16, read_steps=2, episodes=16, sft_steps=2, batch_size=4,
                                              lr=1e30), log=lambda _: None)
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_shortened_default_run_end_to_end(tmp_path):
    """`make demo`'s command (torchrun, 2 ranks, --preset tiny) shortened to 2 iterations (validation before and
    after): it prints the before/after success table, writes a valid curves PNG and a loadable Hugging Face export."""
    run = tmp_path / "demo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastpo.train",
           "--preset", "tiny", "--trainer.run_dir", str(run), "--trainer.iterations", "2", "--trainer.val_every", "2",
           "--env.val_groups", "32", "--env.env_groups", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "validation success (32 fixed initial states)" in res.stdout
    line = next(x for x in res.stdout.splitlines() if x.startswith("FrozenLake "))
    assert "(step 0 -> 2)" in line and line.count("%") == 2
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[1] > 1000 and img.std() > 0.01
    assert f"Hugging Face export: {run / 'hf'}" in res.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run / "hf")
    assert AutoTokenizer.from_pretrained(run / "hf").chat_template
    assert (run / "report.txt").read_text().strip() in res.stdout
