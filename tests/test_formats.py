"""Tokenisation into Samples: masks (checked by decoding), truncation, pairs, prompts, errors."""

import pytest
import torch

from RL2.data.formats import (
    DataError, tokenize_pair, tokenize_prompt, tokenize_sft,
)
from RL2.tools.make_assets import build_tokenizer

SRC = "sft_train.jsonl"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def enc(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def trained_text(tok, sample):
    """Decode exactly the tokens the loss sees."""
    return tok.decode(sample["labels"][sample["action_mask"].bool()].tolist())


def check_shift(sample, tokens):
    assert sample["input_ids"].tolist() == tokens[:-1]
    assert sample["labels"].tolist() == tokens[1:]
    assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
    assert sample["action_mask"].dtype == torch.float32
    assert len(sample["action_mask"]) == len(tokens) - 1


def test_sft_raw_text(tok):
    row = {"prompt": "What is 2 plus 3?", "response": "The answer is 5."}
    s = tokenize_sft(row, tok, apply_chat_template=False)
    tokens = enc(tok, row["prompt"], True) + enc(tok, row["response"]) + [tok.eos_token_id]
    check_shift(s, tokens)
    assert trained_text(tok, s) == "The answer is 5.<|im_end|>"
    n_prompt = len(enc(tok, row["prompt"], True))
    assert s["action_mask"].tolist() == [0.0] * (n_prompt - 1) + [1.0] * (len(tokens) - n_prompt)


def test_sft_prompt_response_with_template(tok):
    row = {"prompt": "What is 2 plus 3?", "response": "The answer is 5."}
    s = tokenize_sft(row, tok)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}],
        tokenize=False)
    assert tok.decode(s["input_ids"].tolist() + s["labels"][-1:].tolist()) == rendered
    # The template's "\n" after <|im_end|> is formatting, not trained on.
    assert trained_text(tok, s) == "The answer is 5.<|im_end|>"
    assert s["action_mask"][-1] == 0


def test_sft_multi_turn_messages(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 plus 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "The answer is 6."},
        {"role": "user", "content": "a trailing user turn is not trained"},
    ]
    s = tokenize_sft({"messages": msgs}, tok)
    assert trained_text(tok, s) == "2<|im_end|>The answer is 6.<|im_end|>"
    mask = s["action_mask"].tolist()
    spans = sum(1 for a, b in zip([0.0] + mask, mask) if b == 1 and a == 0)
    assert spans == 2
    full = tok.decode(s["input_ids"].tolist() + s["labels"][-1:].tolist())
    assert full == tok.apply_chat_template(msgs[:5], tokenize=False)


def test_loss_on_all_trains_every_token(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 plus 1?"},
            {"role": "assistant", "content": "2"}]
    assistant = tokenize_sft({"messages": msgs}, tok)
    every = tokenize_sft({"messages": msgs}, tok, loss_on="all")
    assert torch.equal(every["input_ids"], assistant["input_ids"])
    assert torch.equal(every["labels"], assistant["labels"])
    assert every["action_mask"].tolist() == [1.0] * len(every["labels"])
    assert 0 < assistant["action_mask"].sum() < len(assistant["labels"])
    raw = tokenize_sft({"prompt": "q", "response": "a"}, tok, apply_chat_template=False, loss_on="all")
    assert raw["action_mask"].tolist() == [1.0] * len(raw["labels"])
    with pytest.raises(ValueError, match="loss_on='prompt'"):
        tokenize_sft({"messages": msgs}, tok, loss_on="prompt")


def test_prompt_messages_context_is_not_trained(tok):
    # Few-shot assistant turns inside the prompt are context; only the response is trained.
    prompt = [{"role": "user", "content": "1 plus 1?"}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "2 plus 2?"}]
    s = tokenize_sft({"prompt": prompt, "response": "4"}, tok)
    assert trained_text(tok, s) == "4<|im_end|>"
    c, r = tokenize_pair({"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
                          "rejected": "5"}, tok, for_reward_model=False)
    assert trained_text(tok, c) == "4<|im_end|>" and trained_text(tok, r) == "5<|im_end|>"


def test_sft_other_template(tok):
    # A non-ChatML, prefix-stable template: spans come from incremental rendering, not markup.
    tok2 = build_tokenizer()
    tok2.chat_template = (
        "{% for m in messages %}### {{ m['role'] | upper }}:\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<|im_end|>{% endif %}\n\n{% endfor %}"
        "{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]
    s = tokenize_sft({"messages": msgs}, tok2)
    assert trained_text(tok2, s) == "hello there<|im_end|>see you<|im_end|>"


def test_non_prefix_stable_template_is_an_error(tok):
    tok2 = build_tokenizer()
    tok2.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(DataError, match=r"f\.jsonl row 4: key 'messages'.*prefix-stable"):
        tokenize_sft({"messages": msgs}, tok2, row_index=4, source="f.jsonl")


def test_truncation_keeps_the_left(tok):
    row = {"prompt": "What is 2 plus 3?", "response": "The answer is 5 and that is all " * 4}
    full = tokenize_sft(row, tok)
    s = tokenize_sft(row, tok, max_length=24)  # the prompt is 21 tokens
    assert len(s["input_ids"]) == 23
    for k in full:
        assert torch.equal(s[k], full[k][:23])
    # A prompt that fills max_length leaves nothing to train on.
    with pytest.raises(DataError, match=r"row 3: no response tokens.*max_length=5"):
        tokenize_sft(row, tok, max_length=5, row_index=3, source=SRC)


@pytest.mark.parametrize("row,key", [
    ({"prompt": "q"}, "response"),
    ({"response": "a"}, "prompt"),
    ({"prompt": "q", "response": ""}, "response"),
    ({"prompt": "q", "response": "   "}, "response"),
    ({"prompt": "", "response": "a"}, "prompt"),
    ({"prompt": "q", "response": 5}, "response"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "messages"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "messages"),
    ({"messages": "not a list"}, "messages"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "messages"),
])
def test_sft_bad_rows(tok, row, key):
    for chat in (True, False):
        with pytest.raises(DataError) as e:
            tokenize_sft(row, tok, apply_chat_template=chat, row_index=7, source=SRC)
        assert f"{SRC} row 7" in str(e.value) and f"'{key}'" in str(e.value), str(e.value)


@pytest.mark.parametrize("role,hint", [("asistant", ""), ("human", "ShareGPT"), ("gpt", "ShareGPT")])
def test_unknown_chat_roles_are_errors(tok, role, hint):
    """Templates render any role verbatim: a typo'd assistant turn became untrained context in
    silence (found by a hostile-input probe). SFT, pairs and PPO prompts share the check."""
    msgs = [{"role": "user", "content": "q"}, {"role": role, "content": "a"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    calls = [lambda: tokenize_sft({"messages": msgs}, tok, row_index=3, source=SRC),
             lambda: tokenize_pair({"messages": msgs[:3], "chosen": "x", "rejected": "y"}, tok, for_reward_model=False,
                                   row_index=3, source=SRC),
             lambda: tokenize_prompt({"messages": msgs[:3]}, tok, row_index=3, source=SRC)]
    for call in calls:
        with pytest.raises(DataError, match=rf"{SRC} row 3: key 'messages' message 1 has role '{role}'.*{hint}"):
            call()
    for ok in ("system", "tool", "developer"):  # roles templates know still pass
        tokenize_prompt({"messages": [{"role": ok, "content": "s"}, {"role": "user", "content": "u"}]}, tok)


def test_pair_reward_model(tok):
    row = {"prompt": "What is 2 plus 3?", "chosen": "The answer is 5.", "rejected": "no idea 7"}
    c, r = tokenize_pair(row, tok, for_reward_model=True)
    for s, resp in ((c, row["chosen"]), (r, row["rejected"])):
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                        {"role": "assistant", "content": resp}], tokenize=False)
        assert tok.decode(s["input_ids"].tolist()) == text  # every token is input
        assert set(s) == {"input_ids", "eos_mask"}
        assert s["eos_mask"].tolist() == [0.0] * (len(s["input_ids"]) - 1) + [1.0]
    c2, r2 = tokenize_pair(row, tok, for_reward_model=True, apply_chat_template=False)
    assert c2["input_ids"].tolist() == (enc(tok, row["prompt"], True) + enc(tok, row["chosen"])
                                        + [tok.eos_token_id])
    # max_length applies to each side.
    m = min(len(c["input_ids"]), len(r["input_ids"])) - 2
    c3, r3 = tokenize_pair(row, tok, for_reward_model=True, max_length=m)
    assert len(c3["input_ids"]) == len(r3["input_ids"]) == m
    assert torch.equal(c3["input_ids"], c["input_ids"][:m]) and c3["eos_mask"][-1] == 1


def test_pair_dpo_with_messages(tok):
    row = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}],
           "chosen": [{"role": "assistant", "content": "The answer is 5."}],
           "rejected": "no idea 7"}
    c, r = tokenize_pair(row, tok, for_reward_model=False)
    assert trained_text(tok, c) == "The answer is 5.<|im_end|>"
    assert trained_text(tok, r) == "no idea 7<|im_end|>"
    assert torch.equal(c["input_ids"][:5], r["input_ids"][:5])  # shared prompt


@pytest.mark.parametrize("row,key", [
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "rejected"),
    ({"prompt": "q", "chosen": "a"}, "rejected"),
    ({"prompt": "q", "rejected": "a"}, "chosen"),
    ({"chosen": "a", "rejected": "b"}, "prompt"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "chosen"),
])
def test_pair_bad_rows(tok, row, key):
    for rm in (True, False):
        with pytest.raises(DataError) as e:
            tokenize_pair(row, tok, for_reward_model=rm, row_index=11, source="pref.jsonl")
        assert "pref.jsonl row 11" in str(e.value) and f"'{key}'" in str(e.value), str(e.value)


def test_pair_identical_after_truncation(tok):
    row = {"prompt": "What is 2 plus 3? " * 5, "chosen": "a", "rejected": "b"}
    with pytest.raises(DataError, match=r"row 2: keys 'chosen' and 'rejected' are identical after"):
        tokenize_pair(row, tok, for_reward_model=True, max_length=8, row_index=2)


def test_prompt(tok):
    row = {"prompt": "What is 2 plus 3?", "extra_info": {"answer": "5"}, "data_source": "arith"}
    p = tokenize_prompt(row, tok)
    assert p["prompt_text"] == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    assert p["prompt_ids"] == enc(tok, p["prompt_text"])
    assert p["extra_info"] == {"answer": "5"} and p["data_source"] == "arith"
    raw = tokenize_prompt(row, tok, apply_chat_template=False)
    assert raw["prompt_text"] == row["prompt"] and raw["prompt_ids"] == enc(tok, row["prompt"], True)
    msgs = tokenize_prompt({"messages": [{"role": "system", "content": "s"},
                                         {"role": "user", "content": "u"}]}, tok)
    assert msgs["prompt_text"].endswith("<|im_start|>assistant\n") and msgs["extra_info"] == {}
    with pytest.raises(DataError, match=r"p\.jsonl row 9: key 'prompt' has \d+ tokens > max_length=4"):
        tokenize_prompt(row, tok, max_length=4, row_index=9, source="p.jsonl")
    with pytest.raises(DataError, match=r"row 9: missing key 'prompt'"):
        tokenize_prompt({"extra_info": {}}, tok, row_index=9)
    with pytest.raises(DataError, match=r"row 9: key 'extra_info'"):
        tokenize_prompt({"prompt": "q", "extra_info": "x"}, tok, row_index=9)
    env_row = tokenize_prompt({"extra_info": {"env_id": "g"}}, tok, prompt_required=False)
    assert env_row["prompt_ids"] is None and env_row["extra_info"] == {"env_id": "g"}

