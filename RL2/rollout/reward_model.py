"""A reward model as a PPO reward (`actor.rollout.reward_model=<dir>`).

The model (a `RL2.trainer.rm` output, or any HF checkpoint that loads with
AutoModelForTokenClassification(num_labels=1)) is sharded like the actor (same worker keys) and
frozen. It scores each trajectory's final sequence (every token, the value at the last one, as
the RM trainer reads it); `reward_model_coef * score` is added to the reward on the trajectory's
last action token and to `traj.reward`, so advantages, dynamic filtering and reward metrics see
the combined reward. The raw score is logged as rollout/reward/reward_model and the environment's
part as rollout/reward/env. It needs the actor's tokenizer (token ids are passed as they are).
"""
import logging

import torch
from omegaconf import OmegaConf

logger = logging.getLogger(__name__)


def check_same_tokenizer(path: str, tokenizer):
    """A reward model that ships a tokenizer must encode like the actor's."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return  # no tokenizer in the directory: the actor's is assumed
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise SystemExit(f"actor.rollout.reward_model={path} has a different tokenizer than the actor; "
                         f"the reward model reads the actor's token ids, so both need the same vocabulary")


def chat_suffix(tokenizer) -> list[int]:
    """Tokens the chat template puts after an assistant turn's eos (ChatML: "\\n"). The RM
    trainer renders pairs with the template, so a response that ends with eos gets them too:
    the reward is then read at the same token as in training."""
    if not getattr(tokenizer, "chat_template", None) or tokenizer.eos_token_id is None:
        return []
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                         tokenize=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    ends = [i for i, t in enumerate(ids) if t == tokenizer.eos_token_id]
    return ids[ends[-1] + 1:] if ends else []


def final_sample(traj, eos_id: int | None = None, suffix: list[int] = ()) -> dict | None:
    """The reward-model input of a trajectory: all tokens of its last sequence with an action
    (+ `suffix` after a final eos), the reward read at the last one."""
    for s in reversed(traj.samples):
        if s["action_mask"].sum() > 0:
            ids = torch.cat([s["input_ids"], s["labels"][-1:]])
            if suffix and eos_id is not None and ids[-1].item() == eos_id:
                ids = torch.cat([ids, torch.tensor(list(suffix), dtype=ids.dtype)])
            eos_mask = torch.zeros(len(ids))
            eos_mask[-1] = 1.0
            return {"input_ids": ids, "eos_mask": eos_mask}
    return None


def add_reward(traj, value: float):
    """Add `value` on the trajectory's last action token and to its total reward."""
    for s in reversed(traj.samples):
        on = s["action_mask"].nonzero()
        if len(on):
            s["rewards"][on[-1, 0]] += value
            traj.reward += value
            return


def weight_names(path: str) -> set[str] | None:
    """The tensor names of a local safetensors checkpoint (one file or an index), read from
    their headers; None when they cannot be listed (another format, a hub name)."""
    import json
    import os

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return set(f.keys())


def check_reward_head(path: str):
    """A checkpoint without a score head (a causal LM) loads as a token classifier with a
    freshly drawn head (transformers only prints a MISSING table): random rewards. The head is
    `score` in transformers' decoder token classifiers (and RL2.trainer.rm's output), `classifier`
    in encoder ones."""
    names = weight_names(path)
    if names is not None and not any(n.split(".")[-2:] in (["score", "weight"], ["classifier", "weight"])
                                     for n in names):
        raise SystemExit(f"actor.rollout.reward_model={path} has no score head (no score.weight among "
                         f"its {len(names)} tensors): it is not a reward model; train one with "
                         f"RL2.trainer.rm")


class RewardModel:
    def __init__(self, path: str, actor_cfg, coef: float, tokenizer, device: str, seed: int,
                 chat: bool = True):
        from RL2.workers.critic import Critic

        check_reward_head(path)
        check_same_tokenizer(path, tokenizer)
        self.eos_id, self.suffix = tokenizer.eos_token_id, chat_suffix(tokenizer) if chat else []
        cfg = OmegaConf.merge(actor_cfg, {"model_name": path, "tokenizer_name": None})
        self.coef = coef
        self.worker = Critic(cfg, device, train=False, seed=seed)
        logger.info(f"reward model {path} scores the final responses (coef {coef})")

    def __call__(self, groups: list[list]):
        """Score every trajectory of `groups` in place. A collective: every rank calls it with
        the same groups (the rollout gathers them on every rank first)."""
        trajs = [t for g in groups for t in g if not t.failed]
        pairs = [(t, final_sample(t, self.eos_id, self.suffix)) for t in trajs]
        pairs = [(t, s) for t, s in pairs if s is not None]
        if not pairs:
            return
        scores = self.worker.compute_rewards([s for _, s in pairs])
        for (t, _), score in zip(pairs, scores.tolist()):
            parts = dict(t.extra_info.get("reward_components") or {})
            parts.update(env=t.reward, reward_model=score)
            t.extra_info = {**t.extra_info, "reward_components": parts}
            add_reward(t, self.coef * score)
