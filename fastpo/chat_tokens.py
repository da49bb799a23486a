"""A chat as token ids for training: the sampled answers kept as sampled, the text around them encoded in pieces.

``chat_sequence`` turns an update-time chat (``prompts.build_messages(..., for_update=True)``) into ``(ids, mask,
logprobs, turn_last)``: the assistant answers as the token ids they were sampled as (or re-encoded in canonical
mode), the template text between them encoded, so the training sequence holds exactly the tokens the model was
given and produced. The rollout and SFT (``sft_core``) build their sequences with it.

``TextCache`` remembers, for one tokenizer and one batch, the generation prompts rendered and the texts encoded:
the pieces of a training sequence are mostly the turns' prompts, already rendered and encoded when they were
generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .parsing import generation_prefix
from .prompts import render_chat


@dataclass
class TextCache:
    """What one tokenizer already made of the texts of a batch, read and filled while it is built: a training
    sequence re-renders and re-encodes each episode's chat in pieces, and most pieces are the turns' prompts,
    rendered and encoded when they were generated (or by the group's other episodes: the same first prompt).
    On the tiny preset 81% of the encode calls repeat a text. The same input always gives the same output.

    The prompts of an episode grow with its turns, so what is kept is bounded: ``limit`` approximate bytes (a
    prompt's characters, 32 per token id); past it the cache starts over (a miss only costs the work again)."""

    limit: int = 64 << 20
    ids: dict[str, list[int]] = field(default_factory=dict)  # text -> token ids without special tokens
    prompts: dict[tuple, str] = field(default_factory=dict)  # messages -> generation prompt (``render_chat``)
    size: int = 0  # approximate bytes held

    def make_room(self, size: int) -> bool:
        """Room for ``size`` more bytes, starting over when they would pass the limit; False (nothing to keep)
        when they alone pass it."""
        if size > self.limit:
            return False
        if self.size + size > self.limit:
            self.ids.clear()
            self.prompts.clear()
            self.size = 0
        self.size += size
        return True


def encode(tokenizer: Any, text: str, cache: TextCache | None = None) -> list[int]:
    """`text`'s token ids without special tokens (a new list), through ``cache`` when given."""
    if not text:
        return []
    if cache is None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids = cache.ids.get(text)
    if ids is None:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if cache.make_room(32 * len(ids) + len(text)):
            cache.ids[text] = ids
    return list(ids)


def prompt_text(tokenizer: Any, messages: list[dict[str, str]], enable_think: bool,
                cache: TextCache | None = None) -> str:
    """``render_chat(tokenizer, messages, enable_think)``: the generation prompt, through ``cache`` when given."""
    if cache is None:
        return render_chat(tokenizer, messages, enable_think)
    key = (enable_think, *(tuple(sorted(m.items())) for m in messages))
    text = cache.prompts.get(key)
    if text is None:
        text = render_chat(tokenizer, messages, enable_think)
        if cache.make_room(len(text)):
            cache.prompts[key] = text
    return text


def chat_sequence(
    tokenizer: Any,
    messages: list[dict[str, str]],
    contents: list[tuple[list[int], list[float], str] | None],
    enable_think: bool,
    cache: TextCache | None = None,
) -> tuple[list[int], list[int], list[float], list[int]]:
    """Tokenize an update-time chat in chunks, keeping the assistant turns' token spans.

    Args:
        messages: ``build_messages(..., for_update=True)`` output.
        contents: one entry per assistant message: ``(sampled_ids, logprobs, stop_text)`` to use the sampled ids
            for the content after the generation prefix (the prefix itself is template text), or None to
            re-tokenize the content text (canonical mode; the template's end-of-turn token after it is trained).
        enable_think: which generation prefix the sampled contents start with.
        cache: what this tokenizer already rendered and encoded (:class:`TextCache`), or None.

    Returns:
        ``(ids [T], mask [T], logprobs [T], turn_last [n_assistant])``: mask 1 on assistant tokens, turn_last the
        index of each assistant turn's last token.
    """
    full = render_chat(tokenizer, messages, enable_think, for_update=True)
    eos_text = getattr(tokenizer, "eos_token", None) or ""
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    turn_last: list[int] = []
    pos = 0
    assistant = [m for m, msg in enumerate(messages) if msg["role"] == "assistant"]
    if len(assistant) != len(contents):
        raise ValueError(f"{len(contents)} contents for {len(assistant)} assistant messages")

    def add(new: list[int], trained: int, lp: list[float] | None = None) -> None:
        ids.extend(new)
        mask.extend([trained] * len(new))
        logps.extend(lp if lp is not None else [0.0] * len(new))

    prefix = generation_prefix(enable_think)
    for m, content in zip(assistant, contents, strict=True):
        # the chat up to the answer's header: the generation prompt of that turn without the generation prefix
        header = prompt_text(tokenizer, messages[:m], enable_think, cache)[: -len(prefix)]
        text = messages[m]["content"]
        if not full.startswith(header, 0) or full[len(header) : len(header) + len(text)] != text or pos > len(header):
            raise ValueError("the chat template does not render earlier messages verbatim; cannot locate turns")
        end = len(header) + len(text)
        if content is None:
            add(encode(tokenizer, full[pos : len(header)], cache), 0)
            closing = eos_text if eos_text and full.startswith(eos_text, end) else ""
            add(encode(tokenizer, text + closing, cache), 1)
            pos = end + len(closing)
        else:
            sampled, lp, stop_text = content
            if not text.startswith(prefix):
                raise ValueError(f"a sampled assistant content must start with {prefix!r}")
            add(encode(tokenizer, full[pos : len(header) + len(prefix)], cache), 0)
            add(list(sampled), 1, list(lp))
            pos = end + (len(stop_text) if stop_text and full.startswith(stop_text, end) else 0)
        turn_last.append(len(ids) - 1)
    add(encode(tokenizer, full[pos:], cache), 0)
    return ids, mask, logps, turn_last


def system_len(tokenizer: Any, messages: list[dict[str, str]], cache: TextCache | None = None) -> int:
    """Tokens of the rendered system message (where RAGEN's ``turn_indicators`` reaches 2)."""
    return len(encode(tokenizer, tokenizer.apply_chat_template(messages[:1], tokenize=False), cache))
