"""The one seed rule: every derived seed (data order per epoch, refill prompts, mini-batch
shuffles, per-request and per-turn sampling) is `derive_seed(seed, *parts)`, a hash of the run
seed and named parts, so streams never collide and a resumed run repeats them."""
import hashlib
import random

import numpy as np
import torch


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed from (seed, parts...), e.g. (seed, "epoch", 3) or (seed, uid)."""
    key = ":".join(str(p) for p in (seed, *parts))
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
