"""Offline assets for tests and the demo: a byte-level BPE tokenizer trained on the fly, tiny HF
models built from a config, and small synthetic datasets. Nothing here touches the hub.

    python -m RL2.tools.make_assets --out assets/
"""
import argparse
import json
import os
import random

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "answer user assistant system question plus minus times equals target numbers reach"
).split()


def _corpus(n_lines: int = 3000, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n_lines):
        words = rng.choices(WORDS, k=rng.randint(3, 14))
        nums = [str(rng.randint(0, 999)) for _ in range(rng.randint(0, 3))]
        yield " ".join(words + nums) + rng.choice([".", "?", "!", ""]) + " +-*/=()<>:;,'\""


def build_tokenizer(out_dir: str | None = None, vocab_size: int = 512):
    """Train a small byte-level BPE with ChatML special tokens and template (cheap: built per run).

    Its pipeline is Qwen2's (NFC, Qwen2's split regex, byte-level): transformers rebuilds the
    tokenizer of any directory whose config says qwen2 with that pipeline, whatever
    tokenizer.json says, so only this one reloads identically from the model directories RL2
    writes (assets, checkpoints, final/)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
        bos_token=None, unk_token=None,
    )
    hf.chat_template = CHATML
    if out_dir:
        hf.save_pretrained(out_dir)
    return hf


ARCHS = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": None}),
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
}


def tiny_config(tokenizer, arch: str = "qwen2", hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, tie: bool = True, max_pos: int = 2048,
                **extra):
    import transformers

    cls_name, defaults = ARCHS[arch]
    kw = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        max_position_embeddings=max_pos, tie_word_embeddings=tie,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    kw.update({k: v for k, v in defaults.items() if v is not None})
    if arch == "qwen3":
        kw["head_dim"] = hidden // heads
    kw.update(extra)
    return getattr(transformers, cls_name)(**kw)


def build_tiny_model(out_dir: str | None, tokenizer, arch: str = "qwen2", seed: int = 0,
                     value_head: bool = False, **config_kw):
    """A randomly initialised tiny causal LM (or 1-label token-classification value model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = tiny_config(tokenizer, arch, **config_kw)
    torch.manual_seed(seed)
    if value_head:
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    if out_dir:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    return model


def _arith(rng):
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    return f"What is {a} plus {b}?", str(a + b)


def _biased_answer(a: int, rng) -> str:
    u = rng.random()
    if u < 0.3:
        return str(a)
    if u < 0.8:
        return str(a + 1)
    return str(rng.choice([x for x in range(10) if x not in (a, a + 1)]))


def write_datasets(out_dir: str, n_train: int = 1024, n_test: int = 64, seed: int = 0):
    """SFT (raw text + chat), preference pairs and PPO prompts as JSONL files."""
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    bias_rng = random.Random(seed + 1)  # its own stream: the other files stay as they were

    def dump(name, rows):
        with open(os.path.join(out_dir, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    for split, n in (("train", n_train), ("test", n_test)):
        qa = [_arith(rng) for _ in range(n)]
        dump(f"sft_{split}.jsonl", [{"prompt": q, "response": f"The answer is {a}."} for q, a in qa])
        # Half the answers are off by a little: SFT on this gives a policy that is right about
        # half the time, which RL then improves (the quick-start demo).
        dump(f"sft_noisy_{split}.jsonl", [
            {"prompt": q, "response": a if rng.random() < 0.5 else str((int(a) + rng.randint(1, 3)) % 10)}
            for q, a in qa])
        # A systematic mistake: "a + b + 1" is more frequent than the right answer, so SFT's greedy
        # answer is mostly wrong while sampling is right ~30% of the time; RL with the verifier
        # must move the mode (the quick-start demo: greedy test reward rises from step 0).
        dump(f"sft_biased_{split}.jsonl", [
            {"prompt": q, "response": _biased_answer(int(a), bias_rng)} for q, a in qa])
        dump(f"chat_{split}.jsonl", [{"messages": [
            {"role": "user", "content": q}, {"role": "assistant", "content": f"The answer is {a}."},
        ]} for q, a in qa])
        # Chosen answers are right and polite; rejected ones are wrong: learnable preference.
        dump(f"pref_{split}.jsonl", [{
            "prompt": q, "chosen": f"The answer is {a}.",
            "rejected": f"no idea {int(a) + rng.randint(1, 9)}",
        } for q, a in qa])
        dump(f"ppo_{split}.jsonl", [{
            "prompt": q, "extra_info": {"answer": a}, "data_source": "arith",
        } for q, a in qa])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="assets")
    parser.add_argument("--arch", default="qwen2", choices=sorted(ARCHS))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    tok = build_tokenizer(os.path.join(args.out, "tokenizer"))
    build_tiny_model(os.path.join(args.out, "model"), tok, args.arch,
                     hidden=args.hidden, layers=args.layers)
    build_tiny_model(os.path.join(args.out, "value_model"), tok, args.arch, value_head=True,
                     hidden=args.hidden, layers=args.layers)
    write_datasets(os.path.join(args.out, "data"))


if __name__ == "__main__":
    main()
