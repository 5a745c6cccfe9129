"""KV cache of the embedded engine: per-layer preallocated buffers holding one left-padded batch,
written in place, with rows evicted by moving a live row into their place (no per-step copies)."""
import torch
from transformers.cache_utils import DynamicLayer


class BufferLayer(DynamicLayer):
    """HF cache layer over the engine's preallocated buffers: `update` writes the new columns in
    place (HF's DynamicLayer concatenates, copying the whole cache every decode step)."""

    def __init__(self, kv: "BatchKV", idx: int):
        super().__init__()
        self.kv, self.idx, self.is_initialized = kv, idx, True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.kv.write(self.idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.kv.end - self.kv.start


class BatchKV:
    """KV cache of the running batch: per layer a [row_cap, kv_heads, len_cap, head_dim] buffer
    with live rows [0, rows) and live columns [start, end). New rows are copied in right-aligned
    at `end` (left padding); a finished row is overwritten by a live row from the end (one row
    copied, not the batch); decode steps write column `end` in place; buffers grow by doubling."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = self.start = self.end = 0

    def _realloc(self, row_cap: int, len_cap: int, left: int) -> None:
        width = self.end - self.start
        for bufs in (self.k, self.v):
            for li, old in enumerate(bufs):
                # zeros, not empty: masked slots must hold finite values (0 * NaN = NaN)
                new = old.new_zeros(row_cap, old.shape[1], len_cap, old.shape[3])
                new[:self.rows, :, left:left + width] = old[:self.rows, :, self.start:self.end]
                bufs[li] = new
        self.start, self.end = left, left + width

    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], room: int = 0) -> None:
        """Append rows given per layer as [r, heads, w, dim] (left-padded to w). `room`: decode
        columns the batch will need after them (sized now, so decoding never reallocates)."""
        r, _, w, _ = keys[0].shape
        if not self.k:  # first use: shapes, dtype and device come from the model
            self.k = [k.new_zeros(0, k.shape[1], 0, k.shape[3]) for k in keys]
            self.v = [v.new_zeros(0, v.shape[1], 0, v.shape[3]) for v in values]
        row_cap, len_cap = self.k[0].shape[0], self.k[0].shape[2]
        width = self.end - self.start
        if self.rows + r > row_cap or self.end - w < 0 or self.end + room > len_cap:
            need_left = max(width, w)  # columns up to `end` (the new rows are right-aligned there)
            len_cap = max(len_cap, need_left + room + 16)
            # spare columns: a quarter on the left for later, longer prompts; the rest on the right
            left = need_left - width + (len_cap - need_left - room) // 4
            # rows grow by doubling, and only when they are what ran out
            rows = row_cap if self.rows + r <= row_cap else max(self.rows + r, 2 * row_cap)
            self._realloc(rows, len_cap, left)
        for bufs, new in ((self.k, keys), (self.v, values)):
            for buf, x in zip(bufs, new):
                buf[self.rows:self.rows + r, :, self.end - w:self.end] = x
        self.start = min(self.start, self.end - w)
        self.rows += r

    def reserve(self, q: int) -> None:
        """Make room for q more columns before a forward pass."""
        if self.end + q > self.k[0].shape[2]:
            width = self.end - self.start
            len_cap = 2 * (width + q) + 16
            self._realloc(self.k[0].shape[0], len_cap, (len_cap - width - q) // 4)

    def write(self, li: int, k: torch.Tensor, v: torch.Tensor):
        q = k.shape[2]
        self.k[li][:self.rows, :, self.end:self.end + q] = k
        self.v[li][:self.rows, :, self.end:self.end + q] = v
        live = (slice(0, self.rows), slice(None), slice(self.start, self.end + q))
        return self.k[li][live], self.v[li][live]

    def advance(self, q: int) -> None:
        self.end += q

    def cache(self):
        from transformers import DynamicCache
        cache = DynamicCache()
        cache.layers = [BufferLayer(self, li) for li in range(len(self.k))]
        return cache

    def compact(self, keep: list[int]) -> list[int]:
        """Keep rows `keep` (ascending); return the old index of each new row."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [j for j in keep if j >= n]
        if holes:
            dst = torch.tensor(holes, device=self.k[0].device)
            src = torch.tensor(movers, device=self.k[0].device)
            for buf in self.k + self.v:
                buf[dst, :, self.start:self.end] = buf[src, :, self.start:self.end]
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        self.rows = n
        if n == 0 and self.k:  # keep the buffers; center the empty window for the next prompts
            self.start = self.end = self.k[0].shape[2] // 2
        return order

    def row(self, li: int, row: int, cols: torch.Tensor):
        """(keys, values) [heads, len(cols), dim] of one row at live columns `cols`."""
        window = slice(self.start, self.end)
        return (self.k[li][row, :, window].index_select(1, cols),
                self.v[li][row, :, window].index_select(1, cols))
