"""KV cache of the embedded engine: per-layer preallocated buffers holding one batch of rows,
written in place, with rows evicted by moving a live row into their place (no per-step copies).

The engine owns these buffers outright (plain tensors, no transformers cache class), so a
transformers upgrade cannot change how they are laid out or updated.
"""
import math

import torch

# Buffers start this many elements into their storage, so the live window's storage offset is
# never 0 or 1: torch.compile specialises on those two values, and a window starting at column 0
# would compile the decode step a second time, mid-run (RL2/rollout/compiled_decode.py).
_LEAD = 16


def _buffer(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return like.new_zeros(_LEAD + math.prod(shape))[_LEAD:].view(shape)


class BatchKV:
    """KV cache of the running batch: per layer a [row_cap, kv_heads, len_cap, head_dim] buffer
    with live rows [0, rows) and live columns [start, end). Every row is right-aligned at `end`
    with no holes: row i holds its `lens[i]` tokens in columns [end - lens[i], end), so `lens` is
    also the position id of each row's next token. New rows are copied in at `end`; a finished
    row is overwritten by a live row from the end (one row copied, not the batch); decode steps
    write column `end` in place; buffers grow by doubling."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens = torch.zeros(0, dtype=torch.long)  # [rows] tokens held per row
        self.rows = self.start = self.end = 0
        self.reallocs = 0  # buffers replaced so far (CUDA graphs captured on old ones are stale)

    def _realloc(self, row_cap: int, len_cap: int, left: int) -> None:
        self.reallocs += 1
        width = self.end - self.start
        for bufs in (self.k, self.v):
            for li, old in enumerate(bufs):
                # zeros, not empty: masked slots must hold finite values (0 * NaN = NaN)
                new = _buffer(old, row_cap, old.shape[1], len_cap, old.shape[3])
                new[:self.rows, :, left:left + width] = old[:self.rows, :, self.start:self.end]
                bufs[li] = new
        self.start, self.end = left, left + width

    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], lens: torch.Tensor,
            room: int = 0) -> None:
        """Append rows given per layer as [r, heads, w, dim], each row's `lens[i]` tokens
        right-aligned (left padding). `room`: decode columns the batch will need after them
        (sized now, so decoding never reallocates)."""
        r, _, w, _ = keys[0].shape
        if not self.k:  # first use: shapes, dtype and device come from the model
            self.k = [k.new_zeros(0, k.shape[1], 0, k.shape[3]) for k in keys]
            self.v = [v.new_zeros(0, v.shape[1], 0, v.shape[3]) for v in values]
            self.lens = lens.new_zeros(0)
        row_cap, len_cap = self.k[0].shape[0], self.k[0].shape[2]
        width = self.end - self.start
        if self.rows + r > row_cap or self.end - w < 0 or self.end + room > len_cap:
            need_left = max(width, w)  # columns up to `end` (the new rows are right-aligned there)
            rows = row_cap if self.rows + r <= row_cap else max(self.rows + r, 2 * row_cap)
            if rows == row_cap and need_left + room + 16 <= len_cap - len_cap // 4:
                # only the window's place ran out (decode steps move `end` right): move it
                # within the buffers, a copy of the live window instead of new zeroed buffers
                self._move(need_left - width + (len_cap - need_left - room) // 4)
            else:
                # rows double, columns grow by half (never by a few: a multi-turn rollout's
                # contexts grow every turn), each only when it is what ran out
                if need_left + room + 16 > len_cap:
                    len_cap = max(need_left + room + 16, len_cap + len_cap // 2)
                # spare columns: a quarter on the left for later, longer prompts; the rest on the right
                self._realloc(rows, len_cap, need_left - width + (len_cap - need_left - room) // 4)
        for bufs, new in ((self.k, keys), (self.v, values)):
            for buf, x in zip(bufs, new):
                buf[self.rows:self.rows + r, :, self.end - w:self.end] = x
        self.start = min(self.start, self.end - w)
        self.lens = torch.cat([self.lens, lens.to(self.lens.device)])
        self.rows += r

    def reserve(self, q: int) -> None:
        """Make room for q more columns before a forward pass."""
        len_cap = self.k[0].shape[2]
        if self.end + q > len_cap:
            width = self.end - self.start
            if 2 * (width + q) + 16 <= len_cap:  # half the buffer is free: move the window
                self._move((len_cap - width - q) // 4)
                return
            len_cap = 2 * (width + q) + 16
            self._realloc(self.k[0].shape[0], len_cap, (len_cap - width - q) // 4)

    def _move(self, left: int) -> None:
        """Move the live window to start at column `left` of the same buffers. Columns it leaves
        keep old (finite) values, which the masks hide, as they hide an evicted row's."""
        width = self.end - self.start
        for buf in self.k + self.v:
            buf[:self.rows, :, left:left + width] = buf[:self.rows, :, self.start:self.end].clone()
        self.start, self.end = left, left + width

    def write(self, li: int, k: torch.Tensor, v: torch.Tensor):
        """Write one decode column ([rows, heads, dim]) of layer `li` at `end`; return the live
        window [rows, heads, end + 1 - start, dim] of keys and values including it."""
        self.k[li][:self.rows, :, self.end] = k
        self.v[li][:self.rows, :, self.end] = v
        live = self.live()
        return self.k[li][live], self.v[li][live]

    def live(self) -> tuple:
        """Index of the live window of a buffer, the decode column at `end` included."""
        return slice(0, self.rows), slice(None), slice(self.start, self.end + 1)

    def advance(self) -> None:
        """The decode column is written in every layer: it becomes part of each row."""
        self.end += 1
        self.lens = self.lens + 1

    def bias(self, extra: int = 1, dtype=torch.float32) -> torch.Tensor:
        """Additive attention mask [rows, 1, 1, width + extra]: 0 on each row's tokens (and the
        `extra` columns being written), -inf on its left padding."""
        width = self.end - self.start + extra
        cols = torch.arange(width, device=self.lens.device)
        pad = cols[None, :] < (self.end - self.start - self.lens)[:, None]
        return torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(
            pad, float("-inf"))[:, None, None, :]

    def full_bias(self, rows: int, dtype=torch.float32) -> torch.Tensor:
        """`bias` over the buffers' whole width [rows, 1, 1, len_cap] for a step of static shape
        (`llama_forward.decode_static`): 0 on each live row's tokens and on column `end`, -inf
        elsewhere. Rows past the live ones (a graph's padding) see column `end` only, so their
        attention stays finite; their outputs are dropped."""
        cols = torch.arange(self.k[0].shape[2], device=self.lens.device)
        lens = self.lens.new_zeros(rows)
        lens[:self.rows] = self.lens
        keep = (cols[None, :] >= (self.end - lens)[:, None]) & (cols[None, :] <= self.end)
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
            ~keep, float("-inf"))[:, None, None, :]

    def compact(self, keep: list[int]) -> list[int]:
        """Keep rows `keep` (ascending); return the old index of each new row. Leading columns
        no row uses any more are dropped from the live window."""
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
        self.lens = self.lens[torch.tensor(order, dtype=torch.long, device=self.lens.device)]
        if n == 0 and self.k:  # keep the buffers; center the empty window for the next prompts
            self.start = self.end = self.k[0].shape[2] // 2
        elif n:
            self.start = self.end - int(self.lens.max())
        return order

    def row(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [heads, lens[row], dim] of one row (copies)."""
        cols = slice(self.end - int(self.lens[row]), self.end)
        return [(k[row, :, cols].clone(), v[row, :, cols].clone()) for k, v in zip(self.k, self.v)]

    def token_bytes(self) -> int:
        """Bytes of KV one token takes over all layers."""
        return sum(2 * k.shape[1] * k.shape[3] * k.element_size() for k in self.k)
