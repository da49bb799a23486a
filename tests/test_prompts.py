"""fastpo.prompts: golden texts written from RAGEN's ctx_manager.py and config/envs.yaml (hard-coded here on
purpose, not built from the module's constants), context-window trimming, rewards, chat rendering."""

import numpy as np
import pytest

from fastpo.prompts import (
    SOKOBAN_ALT_GRID_VOCAB,
    EnvPromptSpec,
    Turn,
    build_messages,
    format_reward,
    prompt_spec,
    render_chat,
    turn_reward,
)

SYSTEM = "You're a helpful assistant. "
RULES_THINK = (
    " actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra"
    " text. Strictly follow this format. Max response length: 100 words (tokens).\n"
)
RULES_NO_THINK = (
    " actions left. Always output: <answer> [your answer] </answer> with no extra text. Strictly follow this format."
    " Max response length: 100 words (tokens).\n"
)
SOKOBAN_PREFIX = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are right next to a box, you can push it by moving in the same direction. "
    "You cannot push a box through a wall, and you cannot pull a box. "
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>\n"
    "The meaning of each symbol in the state is:\n"
    "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target\n"
    "Your available actions are:\n"
    "Up, Down, Left, Right\n"
    'You can make up to 10 actions, separated by the action separator " || "\n'
)
GRID_1 = "######\n#_P__#\n#_X__#\n#_O__#\n#____#\n######"
GRID_2 = "######\n#____#\n#_P__#\n#_√__#\n#____#\n######"
GRID_3 = "######\n#____#\n#____#\n#_S__#\n#____#\n######"
RESPONSE_1 = "<think>The box is below me and the target below it.</think><answer>Down || Down</answer>"
RESPONSE_2 = "<think>Done?</think><answer>Down</answer>"


def sokoban_turns():
    return [
        Turn(GRID_1, 10, RESPONSE_1, turn_reward([-0.1, -0.1])),
        Turn(GRID_2, 8),
    ]


def test_sokoban_two_turns_golden():
    messages = build_messages(prompt_spec("sokoban"), sokoban_turns())
    assert messages == [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": SOKOBAN_PREFIX + "\nTurn 1:\nState:\n" + GRID_1 + "\nYou have 10" + RULES_THINK},
        {"role": "assistant", "content": RESPONSE_1},
        {"role": "user", "content": "Reward:\n-0.2\n\nTurn 2:\nState:\n" + GRID_2 + "\nYou have 8" + RULES_THINK},
    ]


def test_sokoban_first_user_message_verbatim():
    # The same first message as one literal, to catch a typo shared by the constants above.
    content = build_messages(prompt_spec("SimpleSokoban"), [Turn("#P#", 10)])[1]["content"]
    assert content == (
        "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. When you "
        "are right next to a box, you can push it by moving in the same direction. You cannot push a box through a "
        "wall, and you cannot pull a box. The answer should be a sequence of actions, like <answer>Right || Right || "
        "Up</answer>\nThe meaning of each symbol in the state is:\n#: wall, _: empty, O: target, √: box on target, "
        "X: box, P: player, S: player on target\nYour available actions are:\nUp, Down, Left, Right\nYou can make up "
        'to 10 actions, separated by the action separator " || "\n\nTurn 1:\nState:\n#P#\nYou have 10 actions left. '
        "Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra text. "
        "Strictly follow this format. Max response length: 100 words (tokens).\n"
    )


def test_sokoban_for_update_drops_final_state_and_reward():
    turns = sokoban_turns()
    turns[1].response, turns[1].reward = RESPONSE_2, turn_reward([10.9])
    turns.append(Turn(GRID_3, 7))
    messages = build_messages(prompt_spec("sokoban"), turns, for_update=True)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[3]["content"] == "Reward:\n-0.2\n\nTurn 2:\nState:\n" + GRID_2 + "\nYou have 8" + RULES_THINK
    assert messages[4]["content"] == RESPONSE_2
    assert GRID_3 not in str(messages) and "10.9" not in str(messages)
    # For generation, the same history shows the last reward and the final state.
    gen = build_messages(prompt_spec("sokoban"), turns)
    assert gen[-1]["content"] == "Reward:\n10.9\n\nTurn 3:\nState:\n" + GRID_3 + "\nYou have 7" + RULES_THINK


def test_frozenlake_golden():
    grid1, grid2 = "_P__\n_O__\n___G\nO___", "____\n_O__\n_P_G\nO___"
    turns = [Turn(grid1, 10, "<think>down</think><answer>Down</answer>", turn_reward([0.0])), Turn(grid2, 9)]
    messages = build_messages(prompt_spec("frozen_lake"), turns)
    prefix = (
        "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
        "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and go to "
        "the target, I should go left then go up.</think><answer>Left || Up</answer>\n"
        "The meaning of each symbol in the state is:\n"
        "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal\n"
        "Your available actions are:\n"
        "Left, Down, Right, Up\n"
        'You can make up to 10 actions, separated by the action separator " || "\n'
    )
    assert messages[1]["content"] == prefix + "\nTurn 1:\nState:\n" + grid1 + "\nYou have 10" + RULES_THINK
    assert messages[3]["content"] == "Reward:\n0.0\n\nTurn 2:\nState:\n" + grid2 + "\nYou have 9" + RULES_THINK


BANDIT_STATE = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named Dragon and Phoenix\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher rewards "
    "on average? Choose between Dragon and Phoenix, and output like <answer> Dragon </answer> or <answer> Phoenix "
    "</answer>.\n"
)


@pytest.mark.parametrize("think", [True, False])
def test_bandit_golden(think):
    # Empty instruction, no legend, no action list: the rules are the observation (RAGEN's INIT_PROMPT).
    messages = build_messages(prompt_spec("bandit", enable_think=think), [Turn(BANDIT_STATE, 1)])
    rules = RULES_THINK if think else RULES_NO_THINK
    assert messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "\nTurn 1:\nState:\n" + BANDIT_STATE + "\nYou have 1" + rules},
    ]


def test_countdown_golden():
    state = "Target: 98, nums: [44, 19, 35]"
    messages = build_messages(prompt_spec("countdown"), [Turn(state, 1)])
    assert messages[1]["content"] == (
        "You are solving the Countdown puzzle. You should use the num list to create an equation that equals the "
        "target. Example answer format: <think> To find an equation using [3, 5, 2] to get 4. Let's check 2 + 5 = 7, "
        "7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>"
        "\nTurn 1:\nState:\nTarget: 98, nums: [44, 19, 35]\nYou have 1" + RULES_THINK
    )


def test_metamathqa_golden():
    messages = build_messages(prompt_spec("qa"), [Turn("What is 2 + 3?", 1)])
    assert messages[1]["content"] == (
        "You are solving Math problems. \nTurn 1:\nState:\nWhat is 2 + 3?\nYou have 1" + RULES_THINK
    )
    assert prompt_spec("metamathqa") == prompt_spec("MetamathQA")


def test_no_think_variant():
    messages = build_messages(prompt_spec("sokoban", enable_think=False), [Turn(GRID_1, 10)])
    assert messages[1]["content"].endswith("\nTurn 1:\nState:\n" + GRID_1 + "\nYou have 10" + RULES_NO_THINK)


def test_presets_and_overrides():
    assert prompt_spec("larger_sokoban").prefix() == prompt_spec("sokoban").prefix() == SOKOBAN_PREFIX
    # RAGEN's SokobanDifferentGridVocab prompt keeps the default legend (its nested grid_vocab never reaches
    # the prefix); the override gives a legend that matches the W . G C B A @ grid.
    assert prompt_spec("sokoban_different_grid_vocab").prefix() == SOKOBAN_PREFIX
    alt = prompt_spec("SokobanDifferentGridVocab", grid_vocab=SOKOBAN_ALT_GRID_VOCAB).prefix()
    assert "state is:\nW: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target\n" in alt
    assert prompt_spec("bandit").prefix() == "" and prompt_spec("BanditTest").prefix() == ""
    spec = prompt_spec("frozenlake", max_tokens=200, max_actions_per_traj=6, action_sep="|")
    assert 'You can make up to 6 actions, separated by the action separator " | "\n' in spec.prefix()
    assert "Max response length: 200 words (tokens).\n" in spec.turn_block("x", 6)


def test_preset_errors():
    with pytest.raises(ValueError, match="no prompt preset for env 'chess'.*sokoban"):
        prompt_spec("chess")
    with pytest.raises(ValueError, match="unknown EnvPromptSpec field.*max_token"):
        prompt_spec("sokoban", max_token=5)
    with pytest.raises(ValueError, match="max_tokens"):
        EnvPromptSpec("x", max_tokens=0)


def test_custom_spec_empty_vocab_and_actions_are_omitted():
    spec = EnvPromptSpec("Do it.", grid_vocab={}, action_lookup=[], max_actions_per_traj=3)
    assert spec.prefix() == "Do it."
    spec = EnvPromptSpec("Do it.", action_lookup=["Go"], max_actions_per_traj=3)
    assert spec.prefix() == (
        "Do it.\nYour available actions are:\nGo\n"
        'You can make up to 3 actions, separated by the action separator " || "\n'
    )


# ---------------------------------------------------------------- context window


def four_turns():
    return [Turn(f"S{i}", 10 - i, f"R{i}", turn_reward([-0.1])) for i in range(1, 4)] + [Turn("S4", 6)]


def test_full_history_default():
    messages = build_messages(prompt_spec("sokoban"), four_turns())
    assert len(messages) == 2 + 2 * 3 and messages[-1]["content"].startswith("Reward:\n-0.1\n\nTurn 4:\nState:\nS4\n")
    assert build_messages(prompt_spec("sokoban"), four_turns(), max_context_window=0) == messages
    assert all(m["role"] == "assistant" for m in messages[2::2])  # RAGEN's loss-mask assumption


def test_context_window_keeps_last_k_and_renumbers():
    spec = prompt_spec("sokoban")
    messages = build_messages(spec, four_turns(), max_context_window=2)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"] == SOKOBAN_PREFIX + "\nTurn 1:\nState:\nS3\nYou have 7" + RULES_THINK
    assert messages[2]["content"] == "R3"
    assert messages[3]["content"] == "Reward:\n-0.1\n\nTurn 2:\nState:\nS4\nYou have 6" + RULES_THINK
    assert "S1" not in str(messages) and "S2" not in str(messages)
    # k = 1 while generating: only the current observation.
    messages = build_messages(spec, four_turns(), max_context_window=1)
    assert len(messages) == 2 and messages[1]["content"].endswith("\nTurn 1:\nState:\nS4\nYou have 6" + RULES_THINK)


def test_context_window_for_update_trims_after_dropping_final_state():
    messages = build_messages(prompt_spec("sokoban"), four_turns(), max_context_window=2, for_update=True)
    assert [m["content"] for m in messages[2:]] == [
        "R2",
        "Reward:\n-0.1\n\nTurn 2:\nState:\nS3\nYou have 7" + RULES_THINK,
        "R3",
    ]
    assert "S2" in messages[1]["content"]


def test_build_messages_rejects_gaps():
    with pytest.raises(ValueError, match=r"turns\[0\] has no response"):
        build_messages(prompt_spec("sokoban"), [Turn("a", 10), Turn("b", 9)])
    with pytest.raises(ValueError, match="reward but no response"):
        build_messages(prompt_spec("sokoban"), [Turn("a", 10, reward=1.0)])
    with pytest.raises(ValueError, match="max_context_window"):
        build_messages(prompt_spec("sokoban"), [Turn("a", 10)], max_context_window=1.5)


# ---------------------------------------------------------------- rewards


def test_turn_reward_matches_python_float_sums():
    assert turn_reward([]) == 0 and isinstance(turn_reward([]), int) and format_reward(turn_reward([])) == "0"
    assert format_reward(turn_reward([-0.1])) == "-0.1"
    assert format_reward(turn_reward([-0.1] * 3)) == "-0.30000000000000004"  # RAGEN's 0 + -0.1 + -0.1 + -0.1
    assert format_reward(turn_reward(np.full(3, -0.1, dtype=np.float32))) == "-0.30000000000000004"
    assert format_reward(turn_reward([float(np.float32(-0.1))])) == "-0.1"
    assert format_reward(turn_reward(np.array([-0.1, 0.9, 10.9], dtype=np.float32))) == str(0 + -0.1 + 0.9 + 10.9)
    assert format_reward(turn_reward([0.0, 0.0])) == "0.0"  # FrozenLake
    assert format_reward(turn_reward([np.float32(1.0)])) == "1.0"


def test_format_reward():
    assert format_reward("custom") == "custom"
    assert format_reward(np.float64(0.1) + np.float64(0.2)) == "0.30000000000000004"
    assert format_reward(np.float32(0.1)) == str(float(np.float32(0.1)))
    assert format_reward(3) == "3"
    with pytest.raises(ValueError, match="reward"):
        format_reward(True)
    with pytest.raises(ValueError, match="reward"):
        format_reward(None)


# ---------------------------------------------------------------- chat rendering

# Qwen2.5-Instruct's template without the tool branches.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class FakeTokenizer:
    """The slice of a transformers 5.x tokenizer that render_chat uses."""

    name_or_path = "fake/qwen"

    def __init__(self, chat_template=QWEN_TEMPLATE):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        jinja2 = pytest.importorskip("jinja2")
        assert tokenize is False
        template = jinja2.Environment().from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_render_chat_qwen_two_turns():
    text = render_chat(FakeTokenizer(), build_messages(prompt_spec("sokoban"), sokoban_turns()))
    assert text == (
        "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n"
        "<|im_start|>user\n" + SOKOBAN_PREFIX + "\nTurn 1:\nState:\n" + GRID_1 + "\nYou have 10" + RULES_THINK
        + "<|im_end|>\n"
        "<|im_start|>assistant\n" + RESPONSE_1 + "<|im_end|>\n"
        "<|im_start|>user\nReward:\n-0.2\n\nTurn 2:\nState:\n" + GRID_2 + "\nYou have 8" + RULES_THINK
        + "<|im_end|>\n"
        "<|im_start|>assistant\n<think>"
    )  # fmt: skip


def test_render_chat_no_think_and_for_update():
    spec = prompt_spec("bandit", enable_think=False)
    text = render_chat(FakeTokenizer(), build_messages(spec, [Turn(BANDIT_STATE, 1)]), enable_think=False)
    assert text.endswith("Max response length: 100 words (tokens).\n<|im_end|>\n<|im_start|>assistant\n<answer>")
    turns = [Turn(BANDIT_STATE, 1, "<answer>Dragon</answer>", turn_reward([1.0])), Turn("Dragon: 1.0 points", 0)]
    text = render_chat(FakeTokenizer(), build_messages(spec, turns, for_update=True), False, for_update=True)
    assert text.endswith("<|im_start|>assistant\n<answer>Dragon</answer><|im_end|>\n")


def test_render_chat_errors():
    messages = build_messages(prompt_spec("bandit"), [Turn("x", 1)])
    with pytest.raises(ValueError, match="has no chat template.*Qwen2.5-0.5B-Instruct.*chat_template"):
        render_chat(FakeTokenizer(chat_template=None), messages)
    with pytest.raises(ValueError, match="apply_chat_template"):
        render_chat(object(), messages)

    class DictTokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, **kwargs):
            return {"input_ids": [1]}

    with pytest.raises(TypeError, match="expected str"):
        render_chat(DictTokenizer(), messages)
