"""envs/guess_number.py: the game's rules, and SFT games rendered exactly as a rollout builds them."""
import asyncio
import importlib.util
import json
import random
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "envs" / "guess_number.py"
spec = importlib.util.spec_from_file_location("guess_number", PATH)
game = importlib.util.module_from_spec(spec)
spec.loader.exec_module(game)


def play(actions, secret, **info):
    """Run actions through step() as the rollout does; returns the list of step results."""
    state, extra, out = "<prompt>", {"secret": secret, **info}, []
    for a in actions:
        res = asyncio.run(game.step(state, a, extra))
        out.append(res)
        if res["done"]:
            break
        assert res["next_state"].startswith(state + a)  # one growing sequence
        state, extra = res["next_state"], res["extra_info"]
    return out


def test_hints_rewards_and_limits():
    out = play(["5<|im_end|>", "I say 7<|im_end|>", "6<|im_end|>"], secret=6)
    assert [r["done"] for r in out] == [False, False, True]
    assert out[0]["next_state"].endswith(game.user_turn("higher"))
    assert out[1]["next_state"].endswith(game.user_turn("lower"))
    assert out[2]["reward"] == pytest.approx(1 - 0.1 * 2) and out[2]["score"] == 1.0
    assert play(["3"], secret=3, turn_penalty=0.3)[0]["reward"] == 1.0
    # Out of guesses, or no number (gave up): over, reward 0, score 0.
    lost = {"next_state": None, "reward": 0.0, "score": 0.0, "done": True}
    out = play(["1", "2", "3"], secret=9, max_guesses=3)
    assert [r["done"] for r in out] == [False, False, True] and out[-1] == lost
    out = play(["1", "I give up.", "2"], secret=9)
    assert len(out) == 2 and out[-1] == lost


def test_sft_games_follow_the_hints_and_match_the_rollout_text(assets, tmp_path):
    from transformers import AutoTokenizer

    from RL2.data.formats import tokenize_prompt, tokenize_sft

    game.write_data(str(tmp_path), n_max=9, max_guesses=8, n_train=8, n_sft=200)
    tok = AutoTokenizer.from_pretrained(assets["model"])
    rows = [json.loads(line) for line in open(tmp_path / "sft_train.jsonl")]
    assert [json.loads(line)["extra_info"]["secret"] for line in open(tmp_path / "prompts_test.jsonl")] == list(range(1, 10))
    for row in rows:
        msgs = row["messages"]
        if msgs[1]["content"] == "I give up.":
            assert len(msgs) == 2
            continue
        guesses = [int(m["content"]) for m in msgs[1::2]]
        hints = [m["content"] for m in msgs[2::2]]
        assert 1 <= len(guesses) <= 8 and all(1 <= g <= 9 for g in guesses)
        for g, h, nxt in zip(guesses, hints, guesses[1:]):
            assert (nxt > g) if h == "higher" else (nxt < g)
        # The SFT text is the rollout's sequence: chat prompt + each action + the env's hint turn.
        prompt = tokenize_prompt({"prompt": msgs[0]["content"]}, tok)["prompt_text"]
        text = prompt + "".join(str(g) + "<|im_end|>" + (game.user_turn(h) if h else "")
                                for g, h in zip(guesses, hints + [None]))
        assert tok.decode(tokenize_sft(row, tok, max_length=None)["input_ids"]) == text


def test_cautious_player_habits():
    rng = random.Random(0)
    firsts = [game.cautious_game(5, 9, 8, rng)[1]["content"] for _ in range(4000)]
    assert 0.27 < firsts.count("I give up.") / len(firsts) < 0.33
    assert 0.5 < firsts.count("1") / (len(firsts) - firsts.count("I give up.")) < 0.6  # 0.5 + 0.5 / 9
