"""Test doubles shared by the rollout tests (no model involved)."""
from RL2.rollout.engine import Engine, GenerationOutput


class ScriptedEngine(Engine):
    """Returns the tokenisation of scripted texts, one per generate call; the logprob of token i
    of call k is -(k+1) - 0.01*i, so tests can tell which call and position each came from.
    `calls` records (prompt_ids, params) of every call."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.calls = tokenizer, list(texts), []

    async def generate(self, prompt_ids, params):
        k = len(self.calls)
        self.calls.append((list(prompt_ids), params))
        ids = self.tokenizer.encode(self.texts[k], add_special_tokens=False)
        return [GenerationOutput(ids, [-(k + 1) - 0.01 * i for i in range(len(ids))], "stop")]

    def update_weights(self, named_tensors):
        pass

    def release_memory(self, tags=None):
        pass

    def resume_memory(self, tags=None):
        pass

    def shutdown(self):
        pass
