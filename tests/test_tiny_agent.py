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


def test_build_is_deterministic(tmp_path):
    a = build_tiny_agent(tmp_path / "a", QUICK, log=lambda _: None)
    b = build_tiny_agent(tmp_path / "b", QUICK, log=lambda _: None)
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not list(tmp_path.glob("*.tmp-*"))  # written under a temporary name, then renamed
    assert json.loads((a / "tiny_agent.json").read_text())["recipe"]["sft_steps"] == 2


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


@pytest.mark.slow
def test_shortened_default_run_end_to_end(tmp_path):
    """`make demo`'s command (torchrun, 2 ranks, --preset tiny) shortened to 4 iterations: it prints the
    before/after success table, writes a valid curves PNG and a loadable Hugging Face export."""
    run = tmp_path / "demo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastpo.train",
           "--preset", "tiny", "--trainer.run_dir", str(run), "--trainer.iterations", "4", "--trainer.val_every", "2",
           "--env.val_groups", "32", "--env.env_groups", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "validation success (32 fixed initial states)" in res.stdout
    line = next(x for x in res.stdout.splitlines() if x.startswith("FrozenLake "))
    assert "(step 0 -> 4)" in line and line.count("%") == 2
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
