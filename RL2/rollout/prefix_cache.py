"""Prefix cache of the embedded engine: the KV of finished samples (prompt + response), kept so
that a later prompt extending one of them (the next turn of a multi-turn agent) prefills only its
new tokens. LRU, bounded in bytes; the entries are opaque to this class (the runner's KV)."""
from collections import OrderedDict


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.clear()

    def clear(self) -> None:
        """Drop everything (the weights changed, or memory is released)."""
        self._entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self.nbytes = 0

    def lookup(self, prompt: list[int]) -> tuple[int, object | None]:
        """Longest stored sequence that is a proper prefix of `prompt`: (its length, its entry),
        or (0, None)."""
        best, best_key, prompt = 0, None, tuple(prompt)
        for key in self._entries:
            if best < len(key) < len(prompt) and prompt[:len(key)] == key:
                best, best_key = len(key), key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key][0]

    def wants(self, key: tuple, nbytes: int) -> bool:
        """Whether `store` would keep an entry of this size (checked before copying it out)."""
        return key not in self._entries and 0 < nbytes <= self.max_bytes

    def store(self, key: tuple, entry: object, nbytes: int) -> None:
        if not self.wants(key, nbytes):
            return
        self._entries[key] = (entry, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, (_, old_bytes) = self._entries.popitem(last=False)
            self.nbytes -= old_bytes
