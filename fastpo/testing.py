"""Tiny models and tokenizers built locally, for tests, benchmarks and the tiny CPU agent (no hub access).

    from fastpo.testing import build_tiny_tokenizer, build_tiny_model
    tok = build_tiny_tokenizer("/tmp/tiny")             # byte-level BPE + Qwen-style chat template, saved
    model = build_tiny_model("/tmp/tiny", tok)          # Qwen2ForCausalLM, tied embeddings, safetensors
    # both reload through the real from_pretrained path:
    fastpo.model.load_tokenizer("/tmp/tiny"); fastpo.model.load_policy("/tmp/tiny")

The tokenizer keeps every grid cell a token of its own (docs/TINY_AGENT.md section 1: a tokenizer that merges
neighbouring cells hides where the player is). Each grid symbol and each digit is isolated by the
pre-tokenizer, so BPE can never merge it with a neighbour, in a grid or anywhere else; the multi-byte "√"
and the think/answer tags are added tokens. The price is that capitalised words starting with a grid letter
split ("S" + "ok" + "oban"), which a tiny model does not mind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .envs.layouts import FROZENLAKE_GRID_VOCAB, SOKOBAN_ACTIONS
from .envs.layouts import SOKOBAN_SYMBOLS as _SOKOBAN_SYMBOL_SETS

#: Grid symbols of Sokoban (default and alternative vocab) and FrozenLake; each must stay one token.
SOKOBAN_SYMBOLS = _SOKOBAN_SYMBOL_SETS["default"]
SOKOBAN_ALT_SYMBOLS = _SOKOBAN_SYMBOL_SETS["different"]
FROZENLAKE_SYMBOLS = "".join(FROZENLAKE_GRID_VOCAB)
GRID_SYMBOLS = "".join(dict.fromkeys(SOKOBAN_SYMBOLS + SOKOBAN_ALT_SYMBOLS + FROZENLAKE_SYMBOLS))
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

#: Qwen2.5's chat template without the tool-calling branches; the default system text is shortened.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _random_grid(rng: np.random.Generator, symbols: str, rows: int, cols: int) -> str:
    """A rows x cols grid of `symbols` written as RAGEN renders it (cells adjacent, one row per line)."""
    cells = rng.choice(list(symbols), size=(rows, cols))
    return "\n".join("".join(row) for row in cells)


def env_like_texts(num_grids: int = 200, seed: int = 0) -> list[str]:
    """Training texts for the tiny tokenizer: Sokoban / FrozenLake grids, RAGEN's prompt text for both,
    think/answer responses and reward lines. Deterministic given `seed`."""
    from .prompts import SYSTEM_PROMPT, Turn, build_messages, prompt_spec

    rng = np.random.default_rng(seed)
    texts: list[str] = []
    actions = SOKOBAN_ACTIONS
    for i in range(num_grids):
        symbols = (SOKOBAN_SYMBOLS, SOKOBAN_ALT_SYMBOLS, FROZENLAKE_SYMBOLS)[i % 3]
        size = int(rng.integers(4, 9))
        texts.append(_random_grid(rng, symbols, size, size))
        picked = " || ".join(rng.choice(actions, size=int(rng.integers(1, 4))))
        first = picked.split(" || ")[0].lower()
        texts.append(f"<think> I should move {first} first. </think> <answer> {picked} </answer>")
        texts.append(f"Reward:\n{rng.choice([-0.1, 0.9, 1.0, 10.9, 0])}\n")
    for env in ("sokoban", "frozenlake", "countdown", "bandit"):
        spec = prompt_spec(env)
        grid = _random_grid(rng, FROZENLAKE_SYMBOLS if env == "frozenlake" else SOKOBAN_SYMBOLS, 6, 6)
        turns = [Turn(grid, actions_left=10, response="<think> go </think> <answer> Up </answer>", reward=-0.1)]
        turns.append(Turn(grid, actions_left=9))
        texts.extend(m["content"] for m in build_messages(spec, turns))
    texts.extend([SYSTEM_PROMPT, "system", "user", "assistant"])
    return texts


def build_tiny_tokenizer(path: str | os.PathLike, extra_texts: Iterable[str] = (), vocab_size: int = 1024) -> Any:
    """Train a byte-level BPE on env-like texts and save it (with a Qwen-style chat template) to `path`.

    Args:
        path: directory to write (created); ``AutoTokenizer.from_pretrained(path)`` loads it.
        extra_texts: more training text (e.g. an env's observations).
        vocab_size: BPE vocabulary size including the 256 byte symbols, special and added tokens.

    Returns:
        The transformers tokenizer as reloaded from `path` (a ``TokenizersBackend``), padding side left,
        pad ``<|endoftext|>``, eos ``<|im_end|>``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + special and added tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    ascii_symbols = "".join(c for c in GRID_SYMBOLS if c.isascii())
    isolate = Regex("[" + "".join("\\" + c if not c.isalnum() else c for c in ascii_symbols) + "]|\\p{N}")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(isolate, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(env_like_texts()) + list(extra_texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("√", *TAGS)])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(path).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), padding_side="left")


def build_tiny_model(
    path: str | os.PathLike,
    tokenizer: Any,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    intermediate: int | None = None,
    max_positions: int = 4096,
    initializer_range: float = 0.02,
    vocab_size: int | None = None,
) -> Any:
    """Build a randomly initialised Qwen2ForCausalLM (tied embeddings, fp32) and save it to `path` (safetensors).

    Deterministic given `seed` (the global RNG state is restored afterwards). The vocab is ``len(tokenizer)``,
    eos/pad/bos ids come from the tokenizer; the generation config stops on ``<|im_end|>`` and
    ``<|endoftext|>``. ``vocab_size`` (>= ``len(tokenizer)``) pads the vocab beyond the tokenizer's, as real
    checkpoints do (Qwen2.5: 151,936 rows for 151,665 tokens). Returns the model (eval mode).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size ({vocab_size}) must be >= len(tokenizer) ({len(tokenizer)})")
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, PAD_TOKEN)]
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.eval()
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


class ScriptedEngine:
    """An ``Engine`` (session API and stateless ``generate``) that returns fixed texts, for rollout tests.

    ``script[i][t]`` is instance i's answer at turn t: a str (tokenized with `tokenizer`, then the EOS id
    appended, finish "stop"), or ``("length", text)`` (the first ``max_new_tokens`` tokens, finish "length").
    The instance and turn are recovered from the request seed ``request_seeds[i] * SEED_MIX + turn`` that
    ``fastpo.rollout.run_rollout`` passes (``fastpo.rollout.mix_seed``), so call it with
    ``request_seeds = range(N)``. Every sampled token gets logprob ``logprob``. ``prompts`` records
    ``(instance, turn, context_ids)`` of each request. ``params.stop`` strings cut the answer at the token that
    first completes one (finish "stop", ``stop_string`` set), as the real engines do.
    """

    def __init__(self, tokenizer: Any, script: list[list[Any]], logprob: float = -1.0):
        self.tokenizer = tokenizer
        self.script = script
        self.logprob = logprob
        self.eos_token_ids = (tokenizer.convert_tokens_to_ids(EOS_TOKEN),)
        self.weight_version = 0
        self.sessions: dict[int, list[int]] = {}
        self.closed: list[int] = []
        self.prompts: list[tuple[int, int, list[int]]] = []
        self._next = 0
        self._stop_matchers: dict[tuple[str, ...], Any] = {}

    def _sample(self, seed: int, context: list[int], params: Any) -> Any:
        from .engine.base import GenerationResult, stop_matcher
        from .rollout import SEED_MIX

        instance, turn = divmod(int(seed), SEED_MIX)
        self.prompts.append((instance, turn, list(context)))
        entry = self.script[instance][turn]
        if isinstance(entry, tuple):
            ids = self.tokenizer.encode(entry[1], add_special_tokens=False)[: params.max_new_tokens]
            finish = "length"
        else:
            ids = self.tokenizer.encode(entry, add_special_tokens=False)[: params.max_new_tokens - 1]
            ids, finish = ids + [self.eos_token_ids[0]], "stop"
        hit = ""
        matcher = stop_matcher(self._stop_matchers, self.tokenizer, getattr(params, "stop", ()), len(self.tokenizer))
        if matcher is not None:
            k, hit = matcher.first_stop(ids)
            ids, finish = (ids[:k], "stop") if hit else (ids, finish)
        return GenerationResult(list(ids), [self.logprob] * len(ids), finish, stop_string=hit)

    def generate(self, prompts, params, seeds=None):
        return [self._sample(s, list(p), params) for p, s in zip(prompts, seeds, strict=True)]

    def open_sessions(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        self.sessions.update({i: [] for i in ids})
        return ids

    def extend(self, session_ids, new_token_ids) -> None:
        for sid, new in zip(session_ids, new_token_ids, strict=True):
            self.sessions[sid].extend(new)

    def generate_sessions(self, session_ids, params, seeds=None):
        results = [self._sample(s, self.sessions[sid], params) for sid, s in zip(session_ids, seeds, strict=True)]
        for sid, res in zip(session_ids, results, strict=True):
            self.sessions[sid].extend(res.token_ids)
        return results

    def close_sessions(self, session_ids) -> None:
        self.closed += list(session_ids)  # every close, in order: each session must be closed exactly once

    def session_token_ids(self, session_id: int) -> list[int]:
        return list(self.sessions[session_id])


def check_stop_strings(engine: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int = 24) -> int:
    """Check an engine's ``SamplingParams.stop`` handling against its own unstopped output; returns how many
    requests a stop string ended (callers assert it is > 0).

    Greedy decoding makes the stopped run a prefix of the free run. The stop string is 3 characters from the
    middle of request 0's free text (so it usually spans tokens). Every stopped request must end exactly at the
    token that first completes the string, with ``finish_reason == "stop"`` and ``stop_string`` set; every other
    request must equal its free run and never contain the string.
    """
    from fastpo.engine.base import SamplingParams

    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True))

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    first = text(free[0].token_ids)
    stop = first[len(first) // 2 : len(first) // 2 + 3]
    assert len(stop) == 3, f"request 0's free text is too short to pick a stop string: {first!r}"
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, stop=(stop, "\x00\x01"))
    stopped = engine.generate(prompts, params)
    hits = 0
    for i, (f, s) in enumerate(zip(free, stopped, strict=True)):
        k = len(s.token_ids)
        assert s.token_ids == f.token_ids[:k], f"request {i}: the stopped run is not a prefix of the free run"
        if s.stop_string:
            hits += 1
            assert s.stop_string == stop and s.finish_reason == "stop", (i, s.stop_string, s.finish_reason)
            assert stop in text(s.token_ids) and stop not in text(s.token_ids[:-1]), f"request {i} stopped late"
            assert s.logprobs == f.logprobs[:k] or np.allclose(s.logprobs, f.logprobs[:k], atol=1e-5)
        else:
            assert s.token_ids == f.token_ids and s.finish_reason == "length", f"request {i} stopped without a hit"
            assert stop not in text(f.token_ids), f"request {i} missed the stop string {stop!r}"
    return hits


def run_killable(cmd: list[str], cwd: Any, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run a command (e.g. torchrun) in its own process group; on timeout kill the WHOLE group (torchrun's workers
    too) and raise TimeoutError with the tail of its stderr. Returns (exit code, stdout, stderr)."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(f"{cmd[:6]} timed out after {timeout}s:\n{(out + err).decode()[-3000:]}") from None
    return proc.returncode, out.decode(), err.decode()


def clone_model(model: Any) -> Any:
    """A separate copy of a transformers model in eval mode (an engine that owns its weights, so a weight push into
    it leaves the original as it was)."""
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone
