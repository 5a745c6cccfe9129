"""Guess-the-number (multi-turn): the model guesses, the environment answers "higher" or "lower".

A prompt row is `{"prompt": "Guess my number from 1 to N.", "extra_info": {"secret": s}}`. Each
action's last integer is a guess; a wrong guess gets a new user turn with the hint, appended to
`state + action`, so the rollout keeps ONE sequence per game (only the hint is tokenised). The
game ends when the guess is right, after `max_guesses` guesses (extra_info / env_args, default 8;
set actor.rollout.max_turns to the same value), or at once when an action holds no integer (the
player gave up).

Reward: 1 - turn_penalty * (guesses - 1) when found (turn_penalty from extra_info / env_args,
default 0.1), else 0; the score is 1 when found, else 0 (so mean@n of the score is the success rate).

    python envs/guess_number.py OUT_DIR [--n-max 9] [--max-guesses 6]

writes OUT_DIR/{prompts_train,prompts_test,sft_train}.jsonl: prompts with random secrets (test:
every secret once), and SFT games of a "cautious player" with a bad habit: in 30% of the games it
gives up at once ("I give up."); otherwise it starts at 1 (half the time; else anywhere) and
moves 1-3 toward the hint, mostly 1. This is the warm start that PPO then improves
(examples/guess_number.sh): never give up (more wins), start nearer the middle and take bigger
steps (fewer guesses per win). Binary search needs at most 4 guesses for 1-9.
"""
import argparse
import json
import os
import random
import re

_INT = re.compile(r"-?\d+")
DEFAULT_MAX_GUESSES = 8
DEFAULT_TURN_PENALTY = 0.1


def user_turn(text: str) -> str:
    """The hint as a ChatML user turn (the template of RL2.tools.make_assets and most chat models)."""
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompt(n_max: int) -> str:
    return f"Guess my number from 1 to {n_max}."


def hint(guess: int, secret: int) -> str:
    return "higher" if secret > guess else "lower"


async def step(state: str, action: str, extra_info: dict) -> dict:
    guesses = int(extra_info.get("guesses", 0)) + 1
    numbers = _INT.findall(action)
    guess = int(numbers[-1]) if numbers else None
    secret = int(extra_info["secret"])
    if guess == secret:
        penalty = float(extra_info.get("turn_penalty", DEFAULT_TURN_PENALTY))
        return {"next_state": None, "reward": max(0.0, 1.0 - penalty * (guesses - 1)), "score": 1.0,
                "done": True}
    if guess is None or guesses >= int(extra_info.get("max_guesses", DEFAULT_MAX_GUESSES)):
        return {"next_state": None, "reward": 0.0, "score": 0.0, "done": True}
    return {"next_state": state + action + user_turn(hint(guess, secret)), "reward": 0.0, "score": 0.0,
            "done": False, "extra_info": {**extra_info, "guesses": guesses}}


def cautious_game(secret: int, n_max: int, max_guesses: int, rng: random.Random,
                  give_up: float = 0.3) -> list[dict]:
    """Chat messages of one game of the cautious player."""
    messages = [{"role": "user", "content": prompt(n_max)}]
    if rng.random() < give_up:
        return messages + [{"role": "assistant", "content": "I give up."}]
    guess = 1 if rng.random() < 0.5 else rng.randint(1, n_max)
    for _ in range(max_guesses):
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            break
        messages.append({"role": "user", "content": hint(guess, secret)})
        move = rng.choices((1, 2, 3), (0.5, 0.3, 0.2))[0]
        guess = min(n_max, guess + move) if secret > guess else max(1, guess - move)
    if messages[-1]["role"] == "user":
        messages.pop()  # out of guesses: the last hint has no answer to learn
    return messages


def write_data(out_dir: str, n_max: int = 9, max_guesses: int = DEFAULT_MAX_GUESSES,
               n_train: int = 1024, n_sft: int = 2048, seed: int = 0):
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)

    def dump(name, rows):
        with open(os.path.join(out_dir, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def row(secret):
        return {"prompt": prompt(n_max), "data_source": "guess",
                "extra_info": {"secret": secret, "max_guesses": max_guesses}}

    dump("prompts_train.jsonl", [row(rng.randint(1, n_max)) for _ in range(n_train)])
    dump("prompts_test.jsonl", [row(s) for s in range(1, n_max + 1)])
    dump("sft_train.jsonl", [{"messages": cautious_game(rng.randint(1, n_max), n_max, max_guesses, rng)}
                             for _ in range(n_sft)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the guess-the-number prompts and SFT games.")
    parser.add_argument("out_dir")
    parser.add_argument("--n-max", type=int, default=9)
    parser.add_argument("--max-guesses", type=int, default=DEFAULT_MAX_GUESSES)
    args = parser.parse_args()
    write_data(args.out_dir, args.n_max, args.max_guesses)
