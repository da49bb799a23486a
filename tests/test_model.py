"""fastpo.testing (tiny tokenizer / model builders) and fastpo.model (loading policy, critic, tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from fastpo import testing
from fastpo.model import load_critic, load_policy, load_tokenizer, policy_hidden_states, resolve_dtype
from fastpo.prompts import Turn, build_messages, prompt_spec, render_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tok = testing.build_tiny_tokenizer(path)
    model = testing.build_tiny_model(path, tok, seed=0)
    return path, tok, model


def _single_tokens(tok, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok(text, add_special_tokens=False)["input_ids"]]


def test_grid_symbols_and_tags_are_single_tokens(tiny):
    path, tok, _ = tiny
    for sym in testing.GRID_SYMBOLS:
        assert len(tok(sym, add_special_tokens=False)["input_ids"]) == 1, sym
    for text in (*testing.TAGS, *testing.SPECIAL_TOKENS):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == 1, text


def test_grid_one_token_per_cell_and_round_trip(tiny):
    _, tok, _ = tiny
    rng = np.random.default_rng(1)
    for symbols in (testing.SOKOBAN_SYMBOLS, testing.SOKOBAN_ALT_SYMBOLS, testing.FROZENLAKE_SYMBOLS):
        grid = testing._random_grid(rng, symbols, 6, 7)
        pieces = _single_tokens(tok, grid)
        assert pieces == list(grid)  # every cell (and every newline) its own token
        text = f"Turn 1:\nState:\n{grid}\nYou have 10 actions left."  # in context too
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert "".join(_single_tokens(tok, text)) == text
        assert all(len(p) == 1 for p in _single_tokens(tok, text) if set(p) <= set(symbols))


def test_real_env_observations_one_token_per_cell(tiny):
    envs = pytest.importorskip("fastpo.envs")
    _, tok, _ = tiny
    for name in ("sokoban", "frozenlake"):
        obs = envs.make(name, 2, backend="python").reset(np.arange(2))
        for grid in obs:
            assert _single_tokens(tok, grid) == list(grid)


def test_chat_template_renders_prompts(tiny):
    path, tok, _ = tiny
    spec = prompt_spec("sokoban")
    messages = build_messages(spec, [Turn("#P_O\n#X_#", actions_left=10)])
    text = render_chat(tok, messages)
    assert text.startswith("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    encoded = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = encoded["input_ids"]  # transformers 5: a dict
    assert tok.decode(ids) + "<think>" == text
    reloaded = load_tokenizer(path)
    assert reloaded.padding_side == "left" and reloaded.pad_token == "<|endoftext|>"
    assert reloaded.eos_token == "<|im_end|>"
    assert load_tokenizer(path, padding_side="right").padding_side == "right"


def test_model_save_load_round_trip_and_determinism(tiny, tmp_path):
    path, tok, model = tiny
    assert (path / "model.safetensors").exists()
    loaded = load_policy(path)
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, len(tok), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    again = testing.build_tiny_model(tmp_path / "same", tok, seed=0)
    other = testing.build_tiny_model(tmp_path / "other", tok, seed=1)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    assert load_policy(path, dtype="bfloat16").dtype == torch.bfloat16
    assert load_policy(path, gradient_checkpointing=True).is_gradient_checkpointing


def test_critic_values_shape_dtype_and_save_load(tiny, tmp_path):
    path, tok, _ = tiny
    ids = torch.randint(0, len(tok), (3, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 5, dtype=torch.long)
    for dtype in (torch.float32, torch.bfloat16):
        critic = load_critic(path, dtype=dtype)
        values = critic(ids, attention_mask=mask)
        assert values.shape == (3, 5) and values.dtype == torch.float32
        assert critic.value_head.weight.dtype == torch.float32
    values.sum().backward()
    assert critic.value_head.weight.grad is not None
    assert next(critic.backbone.parameters()).grad is not None
    critic = load_critic(path)
    with torch.no_grad():
        critic.value_head.bias.fill_(0.25)
        expected = critic(ids)
    critic.save_pretrained(tmp_path / "critic")
    with torch.no_grad():
        torch.testing.assert_close(load_critic(tmp_path / "critic")(ids), expected, rtol=0, atol=0)


def test_policy_hidden_states_reproduce_logits(tiny):
    path, tok, _ = tiny
    policy = load_policy(path)
    ids = torch.randint(0, len(tok), (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    hidden, weight, bias = policy_hidden_states(policy, ids, mask, positions)
    assert hidden.shape == (2, 8, policy.config.hidden_size) and weight.shape == (len(tok), policy.config.hidden_size)
    assert bias is None and weight is policy.lm_head.weight
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(hidden @ weight.T, logits, rtol=1e-5, atol=1e-5)


def _one_line_value_error(call, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_missing_chat_template_is_a_one_line_error(tiny, tmp_path):
    path, _, _ = tiny
    bare = tmp_path / "no_template"
    shutil.copytree(path, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config_file = bare / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    _one_line_value_error(lambda: load_tokenizer(bare), "chat template", "pass")
    assert load_tokenizer(bare, require_chat_template=False).pad_token is not None


def test_missing_paths_and_offline_hub_ids_fail_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _one_line_value_error(lambda: load_policy(tmp_path / "nope"), "does not exist", "pass")
    _one_line_value_error(lambda: load_tokenizer("./not/here"), "does not exist", "pass")
    os.makedirs(tmp_path / "empty")
    _one_line_value_error(lambda: load_policy(tmp_path / "empty"), "config.json", "pass")
    start = time.perf_counter()
    _one_line_value_error(lambda: load_policy("fastpo-test/not-a-model"), "HF_HUB_OFFLINE", "pass a local directory")
    _one_line_value_error(lambda: load_tokenizer("fastpo-test/not-a-model"), "not in the Hugging Face cache")
    assert time.perf_counter() - start < 2.0
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")


def _online(monkeypatch, repo_info):
    """HF_HUB_OFFLINE off (the test session sets it) and the hub's repo lookup replaced: no network is touched."""
    import huggingface_hub
    from huggingface_hub import constants

    from fastpo import model_path

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", repo_info)
    model_path._hub_problem.cache_clear()


def test_unknown_or_unreachable_hub_id_fails_fast_in_one_line(monkeypatch):
    """Online, an id that is neither a folder nor cached used to reach transformers, which retried for ~50 s (no
    network) and raised a multi-line OSError; the hub is now asked once, briefly."""
    from huggingface_hub.errors import RepositoryNotFoundError

    def unreachable(self, repo_id, **kw):
        raise ConnectionError("[Errno -2] Name or service not known")

    _online(monkeypatch, unreachable)
    start = time.perf_counter()
    for load in (load_policy, load_tokenizer):
        _one_line_value_error(lambda load=load: load("fastpo-test/not-a-model"), "'fastpo-test/not-a-model'",
                              "cannot be reached", "accepted: a local model folder, a fastpo run folder, 'tiny'",
                              "HF_HUB_OFFLINE=1")
    assert time.perf_counter() - start < 10.0  # transformers' retries took ~50 s (the first call imports it)

    def missing(self, repo_id, **kw):
        raise RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response

    _online(monkeypatch, missing)
    _one_line_value_error(lambda: load_tokenizer("fastpo-test/not-a-model"), "was not found on the Hugging Face hub",
                          "'fastpo-test/not-a-model'", "'tiny'")


def test_sft_tiny_is_the_tiny_agent_and_a_bad_hub_id_is_one_line(monkeypatch, capsys):
    """``python -m fastpo.sft --model.path tiny`` loads the tiny agent (it used to go to the hub for "tiny")."""
    from fastpo import model, sft
    from fastpo.tiny_agent import tiny_agent_path

    asked = []

    def no_hub(self, repo_id, **kw):
        asked.append(repo_id)
        raise ConnectionError("no network in this test")

    _online(monkeypatch, no_hub)
    loaded = []

    def fake_load_tokenizer(path, **kw):
        loaded.append(path)
        raise ValueError("stop here")

    monkeypatch.setattr(model, "load_tokenizer", fake_load_tokenizer)
    assert sft.main(["--model.path", "tiny", "--sft.steps", "1", "--sft.out", "unused"]) == 2
    assert loaded == [str(tiny_agent_path())] and not asked
    capsys.readouterr()
    monkeypatch.undo()
    _online(monkeypatch, no_hub)
    assert sft.main(["--model.path", "nobody/no-such-model", "--sft.steps", "1", "--sft.out", "unused"]) == 2
    err = capsys.readouterr().err
    assert asked == ["nobody/no-such-model"] and err.count("\n") == 1 and "cannot be reached" in err, err


def test_lora_without_peft_is_a_clear_error(tiny):
    try:
        import peft  # noqa: F401

        pytest.skip("peft is installed")
    except ImportError:
        pass
    path, _, _ = tiny
    with pytest.raises(ImportError, match="pip install peft"):
        load_policy(path, lora_rank=8)
