"""A NumPy reference of docs/SEMANTICS.md over all ranks of a group (for tests and examples).

BF16 values are uint16 bit patterns, as in the arena. Inputs per rank: (x [T, H] uint16, topk_idx
[T, K] int, topk_weights [T, K] float32). Nothing here talks to the daemon.
"""

import collections

import numpy as np

from . import errors, formats

Geom = collections.namedtuple("Geom", "num_ranks num_experts hidden topk max_tokens slots_per_rank ht_capacity")


def geom_of(ep):
    """The reference geometry of an Endpoint."""
    g = ep.geometry
    return Geom(g.num_ranks, g.num_experts, g.hidden, g.topk, g.max_tokens, g.slots_per_rank, g.ht_capacity)


def default_placement(num_experts, num_ranks):
    """Version 1 map: expert e on rank e // ceil(E/R), slot e % ceil(E/R)."""
    per = -(-num_experts // num_ranks)
    return [[(e // per, e % per)] for e in range(num_experts)]


class Plan:
    """Routing of one step (validated), as SEMANTICS.md defines it."""

    def __init__(self, g, inputs, placement=None, dense=False):
        """dense: the HT rows of the dense layout (EPD_DESC_HT_DENSE): every rank receives every token."""
        self.g = g
        R, E, M, K, S = g.num_ranks, g.num_experts, g.max_tokens, g.topk, g.slots_per_rank
        placement = placement or default_placement(E, R)
        self.inputs = inputs
        for src, (x, idx, w) in enumerate(inputs):
            if len(x) > M:
                raise errors.TooManyTokens(-15, "rank %d: %d tokens > max_tokens %d" % (src, len(x), M),
                                           peer=src)
            bad = (idx < -1) | (idx >= E)
            if bad.any():
                raise errors.BadExpert(-14, "rank %d: expert id out of [-1, %d)" % (src, E), peer=src)
        # dest[src] = list over (t, k) of (rank, slot, pos) or None
        self.dest = []
        lists = collections.defaultdict(list)  # (rank, slot) -> [(src, t, k)]
        for src, (x, idx, w) in enumerate(inputs):
            T = len(x)
            d = [[None] * K for _ in range(T)]
            for t in range(T):
                seen = set()
                for k in range(K):
                    e = int(idx[t, k])
                    if e < 0 or e in seen:
                        continue
                    seen.add(e)
                    reps = placement[e]
                    r, s = reps[(src * M + t) % len(reps)]
                    d[t][k] = (r, s)
            self.dest.append(d)
        for src in range(R):
            for t, row in enumerate(self.dest[src]):
                for k, rs in enumerate(row):
                    if rs is not None:
                        lists[rs].append((src, t, k))
        self.ll_lists = lists
        self.pos = {}
        for rs, lst in lists.items():
            for j, key in enumerate(lst):
                self.pos[key] = j
        self.ll_count = np.zeros((R, S), np.int32)
        for (r, s), lst in lists.items():
            self.ll_count[r, s] = len(lst)
        # HT: rank r receives (src, t) once if any valid k goes to r (dense: every token), ordered by
        # (src, t).
        self.ht_rows = [[] for _ in range(R)]
        self.ht_pos = {}
        for src in range(R):
            for t, row in enumerate(self.dest[src]):
                for r in (range(R) if dense else sorted({rs[0] for rs in row if rs is not None})):
                    self.ht_pos[(src, t, r)] = len(self.ht_rows[r])
                    self.ht_rows[r].append((src, t))
        self.expert_tokens = np.zeros(E, np.int64)
        for src, (x, idx, w) in enumerate(inputs):
            for t, row in enumerate(self.dest[src]):
                for k, rs in enumerate(row):
                    if rs is not None:
                        self.expert_tokens[int(idx[t, k])] += 1

    # -- LL
    def ll_dispatch(self, rank, fp8=False):
        """dict(count [S], src {(s, j): packed}, x {(s, j): bf16 row} or q/scales for fp8)."""
        g = self.g
        out = {"count": self.ll_count[rank].copy(), "rows": {}}
        for (r, s), lst in self.ll_lists.items():
            if r != rank:
                continue
            for j, (src, t, k) in enumerate(lst):
                x = self.inputs[src][0][t]
                row = {"src": pack_src(src, t), "x": x}
                if fp8:
                    q, sc = formats.quantize_fp8(x[None, :])
                    row["q"], row["scales"] = q[0], sc[0]
                out["rows"][(s, j)] = row
        return out

    def ll_combine(self, rank, ys):
        """OUT of `rank` (float32 [T, H], before BF16 rounding) from every rank's LL_Y (ys[r] [S, R*M, H]
        uint16)."""
        x, idx, w = self.inputs[rank]
        T, H = len(x), self.g.hidden
        out = np.zeros((T, H), np.float32)
        for t, row in enumerate(self.dest[rank]):
            for k, rs in enumerate(row):
                if rs is None:
                    continue
                r, s = rs
                j = self.pos[(rank, t, k)]
                out[t] += np.float32(w[t, k]) * formats.bf16_to_f32(ys[r][s, j])
        return out

    # -- HT
    def ht_recv(self, rank):
        """Number of tokens `rank` receives in HT mode."""
        return len(self.ht_rows[rank])

    def ht_dispatch(self, rank):
        """dict(x [n, H] uint16, topk_idx [n, K] int64, topk_weights [n, K] f32, src [n], count [S])."""
        g = self.g
        rows = self.ht_rows[rank]
        n = len(rows)
        x = np.zeros((n, g.hidden), np.uint16)
        ti = np.full((n, g.topk), -1, np.int64)
        tw = np.zeros((n, g.topk), np.float32)
        src_arr = np.zeros(n, np.int32)
        count = np.zeros(g.slots_per_rank, np.int32)
        for j, (src, t) in enumerate(rows):
            x[j] = self.inputs[src][0][t]
            src_arr[j] = pack_src(src, t)
            for k, rs in enumerate(self.dest[src][t]):
                if rs is not None and rs[0] == rank:
                    ti[j, k] = rs[1]
                    tw[j, k] = self.inputs[src][2][t, k]
                    count[rs[1]] += 1
        return {"x": x, "topk_idx": ti, "topk_weights": tw, "src": src_arr, "count": count}

    def ht_combine(self, rank, ys):
        """OUT of `rank` (float32 [T, H]) from every rank's HT_Y (ys[r] [C, H] uint16), in rank order."""
        T = len(self.inputs[rank][0])
        out = np.zeros((T, self.g.hidden), np.float32)
        for t in range(T):
            holders = {rs[0] for rs in self.dest[rank][t] if rs is not None}  # a dense row elsewhere is no partial
            for r in range(self.g.num_ranks):
                j = self.ht_pos.get((rank, t, r))
                if j is not None and r in holders:
                    out[t] += formats.bf16_to_f32(ys[r][j])
        return out


def pack_src(rank, tok):
    """EPD_SRC_PACK as a signed int32."""
    v = ((rank & 0xFF) << 24) | (tok & 0xFFFFFF)
    return v - (1 << 32) if v >= (1 << 31) else v
