"""Rows -> Samples (see docs/DEV_SPEC.md): tokenisation with loss masks for SFT, reward-model and
DPO pairs, and prompts for PPO rollouts.

Row layouts (keys configurable):
    {"prompt": str | messages, "response": str | messages}     raw text or chat, loss on the response
    {"messages": [{"role", "content"}, ...]}                    chat, loss on assistant turns only
    {"prompt" | "messages", "chosen", "rejected"}                preference pair (RM / DPO)
    {"prompt" | "messages", "extra_info": {...}, "data_source"} PPO prompt

Chat conversations are rendered with the tokenizer's own chat template. Assistant spans are found
by rendering the conversation incrementally (up to each assistant turn with the generation prompt,
then including the turn) and checking that every rendering extends the previous one, so any
prefix-stable template works (ChatML, Llama 3, ...). Each span is tokenised on its own, as a
rollout would produce it. Inside an assistant turn, text after the last eos token (e.g. ChatML's
"\\n" after <|im_end|>) is template formatting and is not trained on.

Truncation keeps the FIRST `max_length` tokens (drops the right side). Bad rows raise `DataError`
(a ValueError) whose message names the source, the row index and the offending key.
"""
import logging

import torch

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A row that cannot be turned into a sample (message names source, row index and key)."""


def _where(source, row_index) -> str:
    return f"{source or '<rows>'} row {'?' if row_index is None else row_index}"


def _get(row, key, where):
    value = row.get(key) if hasattr(row, "get") else None
    if value is None and hasattr(row, "keys") and key in row.keys():
        # A loaded dataset fills a key absent from this row (present in others) with null.
        raise DataError(f"{where}: missing key '{key}' (null or absent in this row)")
    if value is None:
        keys = sorted(row) if hasattr(row, "keys") else type(row).__name__
        raise DataError(f"{where}: missing key '{key}' (row has {keys})")
    return value


def _has(row, key) -> bool:
    return bool(key) and hasattr(row, "get") and row.get(key) is not None


# The roles chat templates render (HF's chat-template docs; "developer": gpt-oss / OpenAI,
# "ipython": Llama 3.1 tool output, "function": older OpenAI-style tools). Most templates print any
# other role verbatim, so a typo ("asistant") would become an untrained context turn in silence.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")


def _as_messages(value, role, key, where) -> list[dict]:
    """A str becomes one `role` message; a list must already be {role, content} messages."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: key '{key}' is empty")
        return [{"role": role, "content": value}]
    if isinstance(value, (list, tuple)) and value:
        for j, m in enumerate(value):
            ok = hasattr(m, "get") and all(isinstance(m.get(f), str) for f in ("role", "content"))
            if not ok:
                raise DataError(f"{where}: key '{key}' message {j} needs string 'role' and 'content'")
            if m["role"] not in CHAT_ROLES:
                hint = " (ShareGPT's human/gpt are user/assistant)" if m["role"] in ("human", "gpt") else ""
                raise DataError(f"{where}: key '{key}' message {j} has role {m['role']!r}: use one of "
                                f"{', '.join(CHAT_ROLES)}{hint}")
        return [dict(m) for m in value]
    raise DataError(f"{where}: key '{key}' must be a non-empty string or list of messages")


def _text(value, key, where) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: key '{key}' must be a string when apply_chat_template is false")
    if not value.strip():
        raise DataError(f"{where}: key '{key}' is empty")
    return value


def _render(tokenizer, messages, generation_prompt, where) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat messages need a tokenizer with a chat_template")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _encode(tokenizer, text, special=False) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"] if text else []


def chat_tokens(tokenizer, messages, where, key="messages", train_from=0):
    """(tokens, mask) of a chat conversation: mask 1 on the tokens of assistant messages with
    index >= `train_from` (earlier ones, e.g. few-shot turns inside a prompt, are context)."""
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= train_from]
    if not trained:
        raise DataError(f"{where}: key '{key}' has no assistant message to train on")
    segments, done = [], ""  # (text, trained); `done` = text rendered so far
    eos = tokenizer.eos_token
    for i in trained:
        m = messages[i]
        if i == 0:
            raise DataError(f"{where}: key '{key}' starts with an assistant message (no prompt)")
        if not m["content"].strip():
            raise DataError(f"{where}: key '{key}' message {i} (assistant) is empty")
        prompt = _render(tokenizer, messages[:i], True, where)
        full = _render(tokenizer, messages[: i + 1], False, where)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise DataError(
                f"{where}: key '{key}': the chat template is not prefix-stable at message {i} "
                "(rendering a longer conversation changed earlier text), so assistant spans "
                "cannot be located"
            )
        turn = full[len(prompt):]
        cut = turn.rfind(eos) + len(eos) if eos and eos in turn else len(turn)
        segments += [(prompt[len(done):], 0), (turn[:cut], 1), (turn[cut:], 0)]
        done = full
    tokens, mask = [], []
    for text, flag in segments:
        ids = _encode(tokenizer, text)
        tokens += ids
        mask += [flag] * len(ids)
    return tokens, mask


def raw_tokens(tokenizer, prompt: str, response: str, where) -> tuple[list[int], list[int]]:
    """prompt (with the tokenizer's special prefix, e.g. BOS) + response + eos; mask on response+eos."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: cannot end raw-text responses")
    p = _encode(tokenizer, prompt, special=True)
    r = _encode(tokenizer, response) + [tokenizer.eos_token_id]
    return p + r, [0] * len(p) + [1] * len(r)


def _response_tokens(tokenizer, context, context_key, response, response_key, apply_chat_template, where):
    """Tokens/mask of `context` (prompt text or messages) followed by `response` (text or messages)."""
    if apply_chat_template or not isinstance(context, str) or not isinstance(response, str):
        messages = _as_messages(context, "user", context_key, where)
        n_context = len(messages)
        messages += _as_messages(response, "assistant", response_key, where)
        return chat_tokens(tokenizer, messages, where, key=response_key, train_from=n_context)
    return raw_tokens(
        tokenizer, _text(context, context_key, where), _text(response, response_key, where), where
    )


def _context(row, prompt_key, messages_key, where):
    """(value, key) of the conversation so far: `messages_key` if present, else `prompt_key`."""
    if _has(row, messages_key):
        return row[messages_key], messages_key
    return _get(row, prompt_key, where), prompt_key


def sft_tokens(row, tokenizer, *, prompt_key="prompt", response_key="response",
               messages_key="messages", apply_chat_template=True, where="<rows> row ?"):
    """(tokens, mask) of one SFT row before truncation."""
    if _has(row, messages_key) and not _has(row, response_key):
        messages = _as_messages(row[messages_key], "user", messages_key, where)
        return chat_tokens(tokenizer, messages, where, key=messages_key)
    for key in (prompt_key, messages_key):
        if key and hasattr(row, "keys") and key in row.keys() and row[key] is None and not _has(row, messages_key):
            raise DataError(f"{where}: missing key '{key}' (null or absent in this row)")
    if not _has(row, prompt_key) and not _has(row, messages_key):
        raise DataError(
            f"{where}: missing key '{messages_key}' or '{prompt_key}' (row has {sorted(row)})"
        )
    context, ckey = _context(row, prompt_key, messages_key, where)
    response = _get(row, response_key, where)
    return _response_tokens(tokenizer, context, ckey, response, response_key, apply_chat_template, where)


def make_sample(tokens, mask, max_length, where) -> tuple[dict, bool]:
    """Shift into a Sample (input_ids=tok[:-1], labels=tok[1:]); keep the first max_length tokens."""
    truncated = max_length is not None and len(tokens) > max_length
    if truncated:
        tokens, mask = tokens[:max_length], mask[:max_length]
    if sum(mask[1:]) == 0:
        raise DataError(
            f"{where}: no response tokens left to train on"
            + (f" after truncation to max_length={max_length}" if truncated else "")
        )
    sample = {
        "input_ids": torch.tensor(tokens[:-1], dtype=torch.long),
        "labels": torch.tensor(tokens[1:], dtype=torch.long),
        "action_mask": torch.tensor(mask[1:], dtype=torch.float32),
    }
    return sample, truncated


LOSS_ON = ("assistant", "all")


def tokenize_sft(row, tokenizer, *, prompt_key="prompt", response_key="response",
                 messages_key="messages", apply_chat_template=True, max_length=None,
                 row_index=None, source=None, loss_on="assistant") -> dict:
    """One SFT row -> Sample with `action_mask` on response / assistant tokens (`loss_on=all`:
    on every token, prompts and template included).

    Uses `messages_key` (a chat) when the row has it and no response, otherwise
    `prompt_key` + `response_key` (each text or messages). With `apply_chat_template` the
    text prompt/response become a user and an assistant turn; without it the layout is
    prompt + response + eos. Raises DataError on a bad row.
    """
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on={loss_on!r}: use one of {LOSS_ON}")
    where = _where(source, row_index)
    tokens, mask = sft_tokens(row, tokenizer, prompt_key=prompt_key, response_key=response_key,
                              messages_key=messages_key, apply_chat_template=apply_chat_template,
                              where=where)
    if loss_on == "all":
        mask = [1] * len(tokens)
    return make_sample(tokens, mask, max_length, where)[0]


def pair_tokens(row, tokenizer, *, prompt_key="prompt", chosen_key="chosen",
                rejected_key="rejected", messages_key="messages", apply_chat_template=True,
                max_length=None, where="<rows> row ?"):
    """((chosen tokens, mask), (rejected tokens, mask), truncated) of one preference row."""
    context, ckey = _context(row, prompt_key, messages_key, where)
    chosen, rejected = _get(row, chosen_key, where), _get(row, rejected_key, where)
    if chosen == rejected:
        raise DataError(f"{where}: keys '{chosen_key}' and '{rejected_key}' are identical")
    sides = [
        _response_tokens(tokenizer, context, ckey, value, key, apply_chat_template, where)
        for value, key in ((chosen, chosen_key), (rejected, rejected_key))
    ]
    truncated = max_length is not None and any(len(t) > max_length for t, _ in sides)
    if max_length is not None:
        sides = [(t[:max_length], m[:max_length]) for t, m in sides]
    if sides[0][0] == sides[1][0]:
        raise DataError(
            f"{where}: keys '{chosen_key}' and '{rejected_key}' are identical after truncation "
            f"to max_length={max_length}"
        )
    return sides[0], sides[1], truncated


def reward_sample(tokens) -> dict:
    """Reward-model sample: every token is input; the reward is read where eos_mask == 1 (last)."""
    eos_mask = torch.zeros(len(tokens), dtype=torch.float32)
    eos_mask[-1] = 1.0
    return {"input_ids": torch.tensor(tokens, dtype=torch.long), "eos_mask": eos_mask}


def tokenize_pair(row, tokenizer, *, for_reward_model: bool, prompt_key="prompt",
                  chosen_key="chosen", rejected_key="rejected", messages_key="messages",
                  apply_chat_template=True, max_length=None, row_index=None,
                  source=None) -> tuple[dict, dict]:
    """One preference row -> (chosen, rejected) Samples; `max_length` applies to each side.

    Reward model: input_ids = all tokens, eos_mask = 1 at the last one. DPO: SFT-style samples
    (labels, action_mask on the response). chosen/rejected may be text or assistant messages.
    """
    where = _where(source, row_index)
    (ct, cm), (rt, rm), _ = pair_tokens(
        row, tokenizer, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key,
        messages_key=messages_key, apply_chat_template=apply_chat_template,
        max_length=max_length, where=where,
    )
    if for_reward_model:
        return reward_sample(ct), reward_sample(rt)
    return make_sample(ct, cm, None, where)[0], make_sample(rt, rm, None, where)[0]


def tokenize_prompt(row, tokenizer, *, prompt_key="prompt", messages_key="messages",
                    apply_chat_template=True, max_length=None, row_index=None, source=None,
                    prompt_required=True, rollout_length=None) -> dict:
    """One PPO row -> dict(prompt_ids, prompt_text, extra_info, data_source).

    With a chat template the prompt ends with the generation prompt (assistant header). A prompt
    longer than `max_length` tokens is an error (prompts are never truncated), and so is one that
    leaves no token to generate in `rollout_length` (actor.rollout.max_length: it would truncate
    every trajectory of its row at once, and a run of such rows trains on nothing). With
    `prompt_required=False` a row without prompt gives prompt_ids/prompt_text None (the
    environment's `reset` supplies the first state).
    """
    where = _where(source, row_index)
    if not (_has(row, messages_key) or _has(row, prompt_key)) and not prompt_required:
        ids, text = None, None
    else:
        value, key = _context(row, prompt_key, messages_key, where)
        if apply_chat_template or not isinstance(value, str):
            text = _render(tokenizer, _as_messages(value, "user", key, where), True, where)
            ids = _encode(tokenizer, text)
        else:
            text = _text(value, key, where)
            ids = _encode(tokenizer, text, special=True)
        if max_length is not None and len(ids) > max_length:
            raise DataError(f"{where}: key '{key}' has {len(ids)} tokens > max_length={max_length}")
        if rollout_length is not None and len(ids) >= rollout_length:
            raise DataError(f"{where}: the prompt has {len(ids)} tokens, leaving no room to generate "
                            f"in actor.rollout.max_length={rollout_length}")
    extra_info = row.get("extra_info") if hasattr(row, "get") else None
    if extra_info is not None and not hasattr(extra_info, "keys"):
        raise DataError(f"{where}: key 'extra_info' must be a dict, got {type(extra_info).__name__}")
    return {
        "prompt_ids": ids,
        "prompt_text": text,
        "extra_info": dict(extra_info or {}),
        "data_source": row.get("data_source") if hasattr(row, "get") else None,
    }
