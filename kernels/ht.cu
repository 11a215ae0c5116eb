/*
 * ht.cu - high-throughput (HT) dispatch and combine on the NCCL 2.28 Device API (LSA over NVLink).
 *
 * Semantics: docs/SEMANTICS.md ("HT dispatch", "HT combine"). Launchers: epd_kernels.h.
 *
 * One HT dispatch is two stream-ordered kernels on each rank:
 *   route  (a warp per token)  validate top-k ids, pick each entry's replica, dest-rank mask per token;
 *   data   (G blocks)          every block reads all masks (counts per dest rank, its chunk's offset);
 *                              block 0 sends the per-dest counts (and input errors) to every rank, every
 *                              block reads every rank's message: the R x R count matrix gives the segment
 *                              bases, the receive total and the same status everywhere (bad input,
 *                              overflow past C). Then each block sends its contiguous chunk of tokens,
 *                              each once per dest rank, straight to its final row:
 *                                direct (peer arenas given): into the receiver's client arena
 *                                  (HT_RECV_*), a warp per token with 16-byte register copies (or,
 *                                  opt-in, BF16 rows with the bulk-copy engine: TMA global -> shared
 *                                  -> local and remote rows), FP8 rows quantised once by a warp;
 *                                  The sender counts its entries per (dest, local slot) with the
 *                                  metadata and adds them into the dest's slotc after its rows;
 *                                staging (no peer arenas): into the receiver's staging rows, which the
 *                                  receiver copies into its arena after the flags, counting the rows
 *                                  per local slot.
 *                              flags; the last block writes the per-slot counts and the record.
 * Combine is one kernel (G blocks):
 *   direct: every block tells the peers its arena's HT_Y is ready, then pulls, per token of its chunk,
 *           the partials of every rank that received the token and sums them in rank order in f32
 *           into OUT (a warp per token with register loads; or, opt-in, TMA loads of the rows' column
 *           chunks into a ring of shared-memory stages, one producer thread, consumer warps summing);
 *           flags say the peers are done reading.
 *   staging: each expert rank pushes HT_Y of every received remote row into the source's combine
 *           staging (cstg[expert rank][t]); flags; the source sums the partials in rank order.
 *
 * HT area of a rank's staging window, per bank (HTLayout, all offsets 256-byte aligned):
 *   --- written by peers ---
 *   cmsg  [R] 128 B       plan message of src: w[0] = seq << 32 | errbits << 24 | T, w[1+r] = count to r
 *   dflag [R][G] u64      dispatch data landed from (src, block): seq << 32
 *   cflag [R][G] u64      combine: partials landed (staging) / done reading my HT_Y (direct): seq << 32
 *   rflag [R][G] u64      combine (direct): HT_Y of (rank, block) ready to be read: seq << 32
 *   xflag [R] u64         dispatch: src's last block is done, its copy-engine rows (dense) landed here:
 *                         seq << 32 (| FLAG_BAD: it failed)
 *   --- private to this rank ---
 *   route [M] TokRoute    dest mask, per-k dest rank and slot of my token t
 *   tmask [M] u32         dest mask | error bits << 24 of my token t (compact copy for the counts)
 *   pos   [M][R] u32      row of my token t within my segment on dest rank r
 *   rsrc  [C] i32         EPD_SRC_PACK of each received row (for the staging combine; direct: by the sender)
 *   slotc [S] u32         (j, k) entries per local slot, accumulated by the dispatch (direct: by the
 *                         senders, which add into it only after reading this step's plan message)
 *   st    HTState         sequence numbers, tickets, plan results (bases, totals, status)
 *   --- staging written by peers (never zeroed by reset; used without peer arenas) ---
 *   xstg  [C][2H]         received token rows at their final index (BF16, or FP8 H bytes + scales)
 *   mstg  [C] RowMeta     their routing (src, local slot per k or -1, weight per k)
 *   cstg  [R][M][2H]      combine partial of my token t from expert rank r (BF16)
 *
 * Ordering: one system fence per block after a bar.sync (cumulativity, as in ll.cu) before the relaxed
 * flag stores; the reader's acquire loads pair with it; bulk (async-proxy) stores are waited for and
 * fenced to the generic proxy first. Sequence numbers live on the device (graph replay needs no host
 * counter; the copy-engine rows use a host counter, ce_seq). A step's rows are written only after every
 * rank published its plan message of that step (so the receiver launched this step: its client released
 * the bank), except the copy-engine rows of a dense BF16 dispatch, issued at launch: their caller launches
 * a step only when every rank's previous op on that bank completed (the daemon starts a step once every
 * rank submitted it, and a client submits after its previous op's DONE; the tests and epd-bench-ht
 * synchronise between ops: EPD_K_HT_COPY_CE in epd_kernels.h). A combine reads a peer's HT_Y only
 * after that peer's combine started, and completes only after every peer is done reading its HT_Y.
 * Every wait has a deadline: on expiry the op reports EPD_ERR_TIMEOUT and the rank waited for.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epd_dev.cuh"
#include "epd_kernels.h"

using namespace epd_dev;

namespace {

constexpr int KMAX = EPD_K_MAX_TOPK;
constexpr int NTHR = EPD_K_HT_THREADS;
constexpr int NWARP = NTHR / 32;
constexpr uint32_t TILE = NTHR;     /* tokens per tile of the data kernels (one per thread) */
constexpr uint32_t HIST_MAX = 4096; /* slots counted in shared memory (more: global atomics) */
constexpr uint32_t MAX_STAGES = 16;
#ifndef EPD_HT_FP8_V
/* FP8 dispatch: vectors per lane per step, two steps in flight. 4 since the quantiser lost its divisions
 * (no spills at 128 registers; 2x H100: 157.3-158.3 us against 165.2-165.7 for 2 and 171.6 for 6; with
 * the old quantiser 4 spilled and 2 was best) */
#define EPD_HT_FP8_V 4
#endif
static_assert(EPD_HT_FP8_V >= 1 && EPD_HT_FP8_V <= 8, "EPD_HT_FP8_V: 1..8 vectors per lane");
#ifndef EPD_HT_META_WARPS
#define EPD_HT_META_WARPS 4
#endif
constexpr uint32_t META_WARPS =
    EPD_HT_META_WARPS; /* warps writing the last tile's metadata during the rows */
constexpr int NO_TIMEOUT = 0x7fffffff;
constexpr int CNT_LD = 8;            /* token masks loaded together by a thread of the dispatch's counts */
constexpr uint32_t CE_SPLIT_MAX = 4; /* copy-engine streams per dest rank (engine.ht_ce_split) */

enum : uint32_t { ERRB_BAD_EXPERT = 1u, ERRB_TOO_MANY = 2u, ERRB_BAD_MAP = 4u };

struct __align__(16) TokRoute {
  uint32_t mask;      /* bits 0..7 dest ranks, bits 24..31 error bits of this token */
  uint8_t rank[KMAX]; /* 0xff: no expert */
  uint16_t slot[KMAX];
  float scale; /* the factor of its entries' weights: 1, or its renormalisation (EPD_K_RENORMALIZE) */
  uint32_t pad[2];
};
static_assert(sizeof(TokRoute) == 64, "TokRoute is 64 bytes");

struct __align__(16) RowMeta {
  int32_t src;
  int32_t pad0;
  int16_t slot[KMAX]; /* local slot or -1 */
  float w[KMAX];
  int32_t pad1[6];
};
static_assert(sizeof(RowMeta) == 128, "RowMeta is 128 bytes");

struct HTState {
  uint32_t dseq;                      /* dispatch sequence (written by the last data block) */
  uint32_t cseq[EPD_K_HT_MAX_BLOCKS]; /* combine sequence per block */
  uint32_t dticket, cticket;
  int32_t err[2], errpeer[2]; /* data-kernel errors of [dispatch, combine] */
  int32_t code, peer;         /* plan result of the last dispatch */
  int32_t derr;               /* final status of the last dispatch */
  uint32_t T;                 /* my tokens in the last dispatch */
  uint32_t N;                 /* rows I receive (may exceed C: overflow) */
  uint32_t map_version;
  uint32_t sendbase[EPD_K_MAX_RANKS];     /* first row of my segment on each dest rank */
  uint32_t recvbase[EPD_K_MAX_RANKS + 1]; /* first row of each src's segment here */
  uint32_t drdy[EPD_K_HT_MAX_BLOCKS];     /* dispatch: seq once the block's positions (pos) are written */
  uint32_t dcur[EPD_K_HT_MAX_BLOCKS];     /* dispatch: tokens of the block's chunk taken (0 between ops) */
  uint32_t ccur[EPD_K_HT_MAX_BLOCKS];     /* combine (direct): the same */
  uint64_t ce_done[EPD_K_MAX_RANKS]
                  [CE_SPLIT_MAX]; /* dense BF16 dispatch: part i of the copy-engine rows to
                                   * dest r landed (a stream memory operation writes ce_seq) */
};

struct HTLayout {
  uint64_t bank_bytes, ctrl_bytes;
  uint64_t cmsg, dflag, cflag, rflag, xflag, route, tmask, pos, rsrc, slotc, st, xstg, mstg, cstg;
};

/* Dynamic shared memory of a data kernel (byte offsets; 0 bytes where unused). */
struct SmemLayout {
  uint32_t bar, tj, tmask, tlist, clist, hist, fsc, stage, total;
};

struct HTParams {
  ncclWindow_t win;
  uint64_t win_off;
  char *local;
  HTLayout lay;
  uint32_t R, rank, E, H, K, M, S, C, G;
  uint32_t flags, T, bank;
  uint64_t timeout_ns;
  const uint32_t *map;
  uint64_t *slot_tokens;
  epd_comp_t *comp;
  epd_k_arena_t arena;
  uint64_t peer_arena[EPD_K_MAX_RANKS]; /* [rank]: arena base of that rank (own included) */
  uint32_t direct;                      /* rows to/from the peers' arenas (else staging) */
  uint32_t tma;                         /* BF16 rows with the bulk-copy engine */
  SmemLayout sm;
  uint32_t ns;      /* stages of the TMA ring */
  uint32_t lag;     /* dispatch: bulk-store groups left reading (1, 2 or 4) */
  uint32_t cw, nch; /* combine: bytes per column chunk, chunks per row */
  uint32_t ncw;     /* combine: consumer warps of the TMA ring (ns is a multiple) */
  uint32_t dense;   /* dispatch: EPD_DESC_HT_DENSE (every token to every rank) */
  uint32_t ce;      /* dense BF16 dispatch: rows to the other ranks by copy engines, in
                     * ce parts (streams) per dest */
  uint64_t ce_seq;  /* the value their completion writes into st->ce_done[dest] */
  uint32_t ce_any;  /* dense BF16 over peer arenas with EPD_K_HT_COPY_CE: peers may copy */
  uint64_t *trace;  /* epd_k_ht_op_t.trace */
};

/* Profiling stamps: block 0's, or the latest block's. */
#define TR(i)                                                                  \
  do {                                                                         \
    if (p.trace && blockIdx.x == 0 && threadIdx.x == 0) p.trace[i] = gtimer(); \
  } while (0)
#define TR_LATEST(i)                                                                         \
  do {                                                                                       \
    if (p.trace) atomicMax((unsigned long long *)&p.trace[i], (unsigned long long)gtimer()); \
  } while (0)
/* The earliest block's stamp, stored as its complement (the trace starts zeroed). */
#define TR_EARLIEST(i)                                                                        \
  do {                                                                                        \
    if (p.trace) atomicMax((unsigned long long *)&p.trace[i], ~(unsigned long long)gtimer()); \
  } while (0)

__device__ __forceinline__ char *peer_bank(const HTParams &p, int peer) {
  return (char *)ncclGetLsaPointer(p.win, p.win_off + p.bank * p.lay.bank_bytes, peer);
}
__device__ __forceinline__ char *local_bank(const HTParams &p) {
  return p.local + p.bank * p.lay.bank_bytes;
}
template <typename T>
__device__ __forceinline__ T *arena_buf(const HTParams &p, int kind) {
  return (T *)(uintptr_t)(p.arena.base + p.arena.off[p.bank][kind]);
}
/* Buffer `kind` of rank r's arena (direct mode, or r == me). */
template <typename T>
__device__ __forceinline__ T *rank_buf(const HTParams &p, uint32_t r, int kind) {
  return (T *)(uintptr_t)(p.peer_arena[r] + p.arena.off[p.bank][kind]);
}

__device__ __forceinline__ void grid_dep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void grid_dep_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

/* ---------------------------------------------------------------------------------------------------
 * route: a warp per token (lanes = top-k columns). Block 0 also zeroes the slot counters.
 * ------------------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(NTHR) ht_route_kernel(const HTParams p) {
  grid_dep_launch(); /* the data kernel may start its prologue; it waits for this grid's completion */
  TR(0);
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t t = blockIdx.x * NWARP + (threadIdx.x >> 5);
  if (blockIdx.x == 0) {
    uint32_t *slotc = (uint32_t *)(local_bank(p) + p.lay.slotc);
    for (uint32_t s = threadIdx.x; s < p.S; s += NTHR) slotc[s] = 0;
  }
  if (p.T > p.M || t >= p.T) return;
  const uint32_t K = p.K, R = p.R, S = p.S;
  const int64_t *topk = arena_buf<int64_t>(p, EPD_BUF_TOPK_IDX);
  const uint32_t map_E = p.map[1];
  const uint32_t *map_nrep = p.map + 4;
  const uint32_t *map_rep = p.map + 4 + map_E;
  int64_t e = -1;
  if (lane < K) e = __ldcg(topk + (uint64_t)t * K + lane);
  bool bad = lane < K && (e < -1 || e >= (int64_t)p.E);
  bool valid = lane < K && e >= 0 && e < (int64_t)p.E;
  for (uint32_t j = 0; j < K; j++) {
    int64_t ej = __shfl_sync(0xffffffffu, e, j);
    if (j < lane && ej == e) valid = false; /* a duplicate expert is ignored */
  }
  const bool counted = valid; /* the token's valid entries (renormalisation's whole) */
  bool lost = false;          /* an entry dropped: its expert has no live replica */
  uint32_t errb = 0, d = 0xff, s = 0;
  if (valid) {
    if (e >= (int64_t)map_E) {
      valid = false;
      bad = true;
    } else {
      uint32_t nrep = __ldg(map_nrep + e);
      if (nrep == 0) {
        valid = false; /* no live replica (a map without masked ranks): the entry is dropped */
        lost = true;
      } else if (nrep > EPD_K_MAX_REPLICAS) {
        valid = false;
        errb |= ERRB_BAD_MAP;
      } else {
        uint32_t i = (uint32_t)(((uint64_t)p.rank * p.M + t) % nrep);
        uint32_t rep = __ldg(map_rep + (uint64_t)e * EPD_K_MAX_REPLICAS + i);
        d = rep >> 16;
        s = rep & 0xffffu;
        if (d >= R || s >= S) {
          valid = false;
          d = 0xff;
          errb |= ERRB_BAD_MAP;
        }
      }
    }
  }
  if (!valid) d = 0xff;
  if (bad) errb |= ERRB_BAD_EXPERT;
  uint32_t mask = 0;
  for (uint32_t r = 0; r < R; r++)
    if (__ballot_sync(0xffffffffu, valid && d == r)) mask |= 1u << r;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) errb |= __shfl_xor_sync(0xffffffffu, errb, o);
  float scale = 1.0f;
  if ((p.flags & EPD_K_RENORMALIZE) && __any_sync(0xffffffffu, lost))
    scale = renorm_factor(
        counted, valid,
        lane < K ? __ldcg(arena_buf<float>(p, EPD_BUF_TOPK_WEIGHTS) + (uint64_t)t * K + lane) : 0.f);
  TokRoute *rt = (TokRoute *)(local_bank(p) + p.lay.route) + t;
  if (lane < KMAX) {
    rt->rank[lane] = (uint8_t)d;
    rt->slot[lane] = (uint16_t)s;
  }
  if (lane == 0) {
    rt->scale = scale;
    rt->mask = mask | (errb << 24); /* the ranks holding an entry of t: what the combine sums */
    /* the rows it gets: dense, every rank (the receivers' entries of other ranks are -1) */
    const uint32_t rows = p.dense ? (1u << R) - 1u : mask;
    ((uint32_t *)(local_bank(p) + p.lay.tmask))[t] = rows | (errb << 24);
  }
}

/* Wait until the sequence number in the upper half of *f is seq (acquire, system scope): true, with *v
 * the word read; false past the deadline. */
__device__ __forceinline__ bool wait_seq(const uint64_t *f, uint32_t seq, uint64_t deadline, uint64_t *v) {
  for (;;) {
    *v = ld_acquire_sys(f);
    if ((uint32_t)(*v >> 32) == seq) return true;
    if (gtimer() > deadline) return false;
  }
}

/* Wait (whole block) for flags[src][g] == seq of every src != me; lowest missing src or NO_TIMEOUT.
 * *bad: lowest src whose block signalled that it failed (its stores did not all happen: FLAG_BAD), or
 * NO_TIMEOUT. */
#define FLAG_BAD 1ull
__device__ int wait_peers(const HTParams &p, const uint64_t *flags, uint32_t seq, uint64_t deadline,
                          int *bad) {
  __shared__ int sh_to, sh_bad;
  if (threadIdx.x == 0) sh_to = sh_bad = NO_TIMEOUT;
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < p.R * p.G; i += blockDim.x) {
    uint32_t src = i / p.G;
    if (src == p.rank) continue;
    uint64_t v;
    const bool ok = wait_seq(flags + i, seq, deadline, &v);
    if (!ok)
      atomicMin(&sh_to, (int)src);
    else if (v & FLAG_BAD)
      atomicMin(&sh_bad, (int)src);
  }
  __syncthreads();
  *bad = sh_bad;
  return sh_to;
}

/* Signal every peer that this block's part of an op is done (one system fence after bar.sync); bad: it
 * failed, so its stores for the peers did not all happen (the peers then fail with EPD_ERR_PEER instead
 * of reading what is not there). */
__device__ void signal_peers(const HTParams &p, uint64_t off, uint32_t seq, int bad) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (uint32_t r = 0; r < p.R; r++)
      if (r != p.rank)
        st_relaxed_sys((uint64_t *)(peer_bank(p, (int)r) + off) + (uint64_t)p.rank * p.G + blockIdx.x,
                       ((uint64_t)seq << 32) | (bad ? FLAG_BAD : 0ull));
  }
}

/* Copy one row of `n16` 16-byte vectors with a warp, 8 loads in flight per lane. */
__device__ __forceinline__ void warp_copy_row(int4 *dst, const int4 *src, uint32_t n16, uint32_t lane) {
  for (uint32_t v0 = lane; v0 < n16; v0 += 32 * 8) {
    int4 b[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
      if (v0 + j * 32 < n16) b[j] = __ldcg(src + v0 + j * 32);
#pragma unroll
    for (int j = 0; j < 8; j++)
      if (v0 + j * 32 < n16) dst[v0 + j * 32] = b[j];
  }
}

/* Ranks whose rows' loads a warp issues together (RB), and vectors per lane and row (NV) of the direct
 * register combine: 2 x 7 in flight. 2x H200, 24 SMs, combine BF16: 201.4 us with a rank at a time x 8,
 * 195.5 with 2 x 7 (116 bytes of spills), 199.3 with 2 x 6, 204.4 with 2 x 5, 207.0 with 2 x 4
 * (bench/results/bench_ht_h200x2_20261126_a7f2fa2.md). */
#ifndef EPD_HT_COMBINE_RB
#define EPD_HT_COMBINE_RB 2
#endif
#ifndef EPD_HT_COMBINE_NV
#define EPD_HT_COMBINE_NV 7
#endif
/* Sum one output row of n16 16-byte vectors (BF16) over the rows given, f32 in rank order: the loads of
 * RB ranks' rows (NV vectors per lane each) in flight together, then their sums. */
template <int NV, int RB = EPD_HT_COMBINE_RB>
__device__ __forceinline__ void warp_reduce_rows(int4 *orow, const int4 *const *rows, uint32_t R,
                                                 uint32_t n16, uint32_t lane) {
  for (uint32_t v0 = lane; v0 < n16; v0 += 32 * NV) {
    float acc[NV][8];
#pragma unroll
    for (int i = 0; i < NV; i++)
#pragma unroll
      for (int q = 0; q < 8; q++) acc[i][q] = 0.f;
#pragma unroll
    for (int r0 = 0; r0 < EPD_K_MAX_RANKS; r0 += RB) {
      /* the loads of RB ranks' rows in flight together, then their sums in rank order */
      int4 b[RB][NV];
#pragma unroll
      for (int h = 0; h < RB; h++) {
        const int r = r0 + h;
        if (r >= (int)R || !rows[r]) continue;
#pragma unroll
        for (int i = 0; i < NV; i++)
          if (v0 + i * 32 < n16) b[h][i] = __ldcg(rows[r] + v0 + i * 32);
      }
#pragma unroll
      for (int h = 0; h < RB; h++) {
        const int r = r0 + h;
        if (r >= (int)R || !rows[r]) continue;
#pragma unroll
        for (int i = 0; i < NV; i++) {
          const uint32_t *u = (const uint32_t *)&b[h][i];
#pragma unroll
          for (int q = 0; q < 4; q++) {
            acc[i][2 * q] += bf16_to_f(u[q] & 0xffffu);
            acc[i][2 * q + 1] += bf16_to_f(u[q] >> 16);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NV; i++) {
      if (v0 + i * 32 >= n16) continue;
      int4 o;
      o.x = (int)pack_bf16x2(acc[i][0], acc[i][1]);
      o.y = (int)pack_bf16x2(acc[i][2], acc[i][3]);
      o.z = (int)pack_bf16x2(acc[i][4], acc[i][5]);
      o.w = (int)pack_bf16x2(acc[i][6], acc[i][7]);
      orow[v0 + i * 32] = o;
    }
  }
}

/* Where the rows of dest rank r go: row j at xb[r] + j * 2H (BF16 row, or FP8 bytes in its first H
 * bytes), its scales at sb[r] + j * ss[r] (floats). */
struct DestRows {
  char *xb[EPD_K_MAX_RANKS];
  float *sb[EPD_K_MAX_RANKS];
  uint32_t ss[EPD_K_MAX_RANKS];
};

/* Per-token part of the metadata of my token t (dest mask m, absolute rows jr[r]): its row on each
 * dest (pos, for the combine) and, for dests reached through staging, its RowMeta. The arena metadata
 * of the other dests is written per tile by meta_tile. */
__device__ void send_meta_token(const HTParams &p, uint32_t t, uint32_t m, const uint32_t *jr,
                                const uint32_t *sendbase) {
  const uint32_t K = p.K, R = p.R, me = p.rank;
  char *lb = local_bank(p);
  uint32_t *pos = (uint32_t *)(lb + p.lay.pos) + (uint64_t)t * R;
  for (uint32_t r = 0; r < R; r++) {
    if (!((m >> r) & 1u)) continue;
    pos[r] = jr[r] - sendbase[r];
    if (r == me || p.direct) continue;
    const TokRoute rt = ((const TokRoute *)(lb + p.lay.route))[t];
    const float *topw = arena_buf<float>(p, EPD_BUF_TOPK_WEIGHTS) + (uint64_t)t * K;
    RowMeta rm;
    rm.src = EPD_SRC_PACK(me, t);
    rm.pad0 = 0;
#pragma unroll
    for (int k = 0; k < KMAX; k++) {
      const bool mine = k < (int)K && rt.rank[k] == r;
      rm.slot[k] = mine ? (int16_t)rt.slot[k] : (int16_t)-1;
      rm.w[k] = mine ? __ldg(topw + k) * rt.scale : 0.f;
    }
#pragma unroll
    for (int q = 0; q < 6; q++) rm.pad1[q] = 0;
    int4 *d = (int4 *)(peer_bank(p, (int)r) + p.lay.mstg + (uint64_t)jr[r] * sizeof(RowMeta));
#pragma unroll
    for (int q = 0; q < 8; q++) d[q] = ((const int4 *)&rm)[q];
  }
}

/* Arena metadata (HT_RECV_TOPK_IDX, _WEIGHTS, _SRC) of one tile's tokens on every dest written directly
 * (own rank; every rank in direct mode), with each row's src in the dest's rsrc; counts the entries per
 * (dest, local slot) in hist[dest][slot] (or, without hist, straight into the dest's slotc), so that no
 * receiver has to read its rows' metadata back to count them. The tile's tokens for dest r hold the
 * consecutive rows j0[r] .. j0[r] + n[r] - 1 (cl[r * TILE + c]: tile index of the c-th), so consecutive
 * threads write consecutive elements: NVLink then carries a few full lines per token instead of 2K + 1
 * partial writes, whose packet rate held the rows back for about 10 us. Threads i0, i0 + stride, ... */
__device__ void meta_tile(const HTParams &p, uint32_t tb, const uint16_t *cl, const uint32_t *j0,
                          const uint32_t *n, uint32_t *hist, uint32_t i0, uint32_t stride) {
  const uint32_t K = p.K, R = p.R, S = p.S, me = p.rank;
  char *lb = local_bank(p);
  const TokRoute *route = (const TokRoute *)(lb + p.lay.route);
  const float *topw = arena_buf<float>(p, EPD_BUF_TOPK_WEIGHTS);
  for (uint32_t r = 0; r < R; r++) {
    if (r != me && !p.direct) continue;
    const uint32_t nr = n[r], jb = j0[r];
    const uint16_t *c_r = cl + r * TILE;
    char *rb = r == me ? lb : peer_bank(p, (int)r);
    uint32_t *cnt = hist ? hist + r * S : (uint32_t *)(rb + p.lay.slotc);
    int64_t *idx = rank_buf<int64_t>(p, r, EPD_BUF_HT_RECV_TOPK_IDX) + (uint64_t)jb * K;
    float *wd = rank_buf<float>(p, r, EPD_BUF_HT_RECV_TOPK_WEIGHTS) + (uint64_t)jb * K;
    for (uint32_t e = i0; e < nr * K; e += stride) {
      const uint32_t c = e / K, k = e - c * K, t = tb + c_r[c];
      const bool mine = route[t].rank[k] == r;
      const uint32_t sl = route[t].slot[k];
      idx[e] = mine ? (int64_t)sl : (int64_t)-1;
      wd[e] = mine ? __ldg(topw + (uint64_t)t * K + k) * route[t].scale : 0.f;
      if (mine) atomicAdd(&cnt[sl], 1u);
    }
    int32_t *srcd = rank_buf<int32_t>(p, r, EPD_BUF_HT_RECV_SRC) + jb;
    int32_t *rsrc = (int32_t *)(rb + p.lay.rsrc) + jb;
    for (uint32_t c = i0; c < nr; c += stride) {
      const int32_t src = EPD_SRC_PACK(me, tb + c_r[c]);
      srcd[c] = src;
      rsrc[c] = src;
    }
  }
}

/* FP8 rows of one token by a warp: quantised once (a half-warp per 128-channel group, 8 channels per
 * lane; the next EPD_HT_FP8_V loads per lane in flight while the current ones are quantised), written to
 * every dest of mask m at rows jr. The scales collect in the warp's scw[H / 128] and go out once per row with
 * consecutive lanes: one 4-byte NVLink write per group and dest would be 2 * H / 128 partial writes per
 * token. */
__device__ __forceinline__ void send_row_fp8(const HTParams &p, const char *xrow, uint32_t m,
                                             const uint32_t *jr, const DestRows &dr, float *scw,
                                             uint32_t lane) {
  const uint32_t H = p.H, R = p.R, nsc = H / 128;
  const uint64_t rowb = 2ull * H;
  char *xd[EPD_K_MAX_RANKS];
  float *sd[EPD_K_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
    const bool on = r < (int)R && ((m >> r) & 1u);
    xd[r] = on ? dr.xb[r] + (uint64_t)jr[r] * rowb : nullptr;
    sd[r] = on ? dr.sb[r] + (uint64_t)jr[r] * dr.ss[r] : nullptr;
  }
  /* FP8_V vectors per lane (2 * FP8_V scale groups) per step; the next step's loads are issued before
   * this step's quantisation, so a warp keeps loads of its row in flight while it computes */
  constexpr int FP8_V = EPD_HT_FP8_V;
  auto load = [&](int4(&v)[FP8_V], uint32_t g0) {
#pragma unroll
    for (int i = 0; i < FP8_V; i++) {
      const uint32_t g = g0 + 2 * i + (lane >> 4);
      if (g < nsc) v[i] = ld_nc_v4(xrow + g * 256 + (lane & 15) * 16);
    }
  };
  auto quant = [&](const int4(&v)[FP8_V], uint32_t g0) {
#pragma unroll
    for (int i = 0; i < FP8_V; i++) {
      const uint32_t g = g0 + 2 * i + (lane >> 4);
      const uint32_t *u = (const uint32_t *)&v[i];
      float f[8];
#pragma unroll
      for (int q = 0; q < 4; q++) {
        f[2 * q] = bf16_to_f(u[q] & 0xffffu);
        f[2 * q + 1] = bf16_to_f(u[q] >> 16);
      }
      float amax = 0.f;
#pragma unroll
      for (int q = 0; q < 8; q++) amax = fmaxf(amax, fabsf(f[q]));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (g >= nsc) continue;
      const float scale = fp8_scale(amax);
      const Fp8Div d = fp8_div(scale);
      const uint2 qv =
          make_uint2(fp8_quant4(f[0], f[1], f[2], f[3], d), fp8_quant4(f[4], f[5], f[6], f[7], d));
#pragma unroll
      for (int r = 0; r < EPD_K_MAX_RANKS; r++)
        if (xd[r]) *(uint2 *)(xd[r] + g * 128 + (lane & 15) * 8) = qv;
      if ((lane & 15) == 0) scw[g] = scale;
    }
  };
  constexpr uint32_t GS = 2 * FP8_V; /* scale groups per step */
  int4 va[FP8_V], vb[FP8_V];
  load(va, 0);
  for (uint32_t g0 = 0; g0 < nsc; g0 += 2 * GS) {
    if (g0 + GS < nsc) load(vb, g0 + GS);
    quant(va, g0);
    if (g0 + GS >= nsc) break;
    if (g0 + 2 * GS < nsc) load(va, g0 + 2 * GS);
    quant(vb, g0 + GS);
  }
  __syncwarp();
#pragma unroll
  for (int r = 0; r < EPD_K_MAX_RANKS; r++)
    if (sd[r])
      for (uint32_t g = lane; g < nsc; g += 32) sd[r][g] = scw[g];
  __syncwarp(); /* scw is free for the warp's next row */
}

/* BF16 row of one token by a warp with 16-byte register copies, to every dest of mask m. */
__device__ __forceinline__ void send_row_bf16(const HTParams &p, const char *xrow, uint32_t m,
                                              const uint32_t *jr, const DestRows &dr, uint32_t lane) {
  const uint32_t R = p.R, n16 = p.H / 8;
  const uint64_t rowb = 2ull * p.H;
  int4 *xd[EPD_K_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPD_K_MAX_RANKS; r++)
    xd[r] = r < (int)R && ((m >> r) & 1u) ? (int4 *)(dr.xb[r] + (uint64_t)jr[r] * rowb) : nullptr;
  const int4 *src = (const int4 *)xrow;
  for (uint32_t v0 = lane; v0 < n16; v0 += 32 * 8) {
    int4 b[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
      if (v0 + i * 32 < n16) b[i] = ld_nc_v4(src + v0 + i * 32);
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
      if (!xd[r]) continue;
#pragma unroll
      for (int i = 0; i < 8; i++)
        if (v0 + i * 32 < n16) xd[r][v0 + i * 32] = b[i];
    }
  }
}

/* Work stealing (whole warp): the block whose chunk of `per` tokens has the most tokens left untaken
 * (cur[b]: taken so far), among those with rdy[b] == seq where rdy is given; G when none has any. A
 * block's tokens are taken one at a time, by its own warps first, so the blocks finish together
 * instead of as their share of the link allows (about 10 us apart with fixed chunks). */
__device__ uint32_t pick_victim(const uint32_t *cur, const uint32_t *rdy, uint32_t seq, uint32_t per,
                                uint32_t T, uint32_t G, uint32_t lane) {
  uint32_t best = 0, bv = G;
  for (uint32_t v = lane; v < G; v += 32) {
    if (rdy && ld_acquire_gpu_u32(rdy + v) != seq) continue;
    const uint32_t len = min(v * per + per, T) - min(v * per, T), c = ld_relaxed_gpu_u32(cur + v);
    if (c < len && len - c > best) {
      best = len - c;
      bv = v;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t ob = __shfl_xor_sync(0xffffffffu, best, o), ov = __shfl_xor_sync(0xffffffffu, bv, o);
    if (ob > best || (ob == best && ov < bv)) {
      best = ob;
      bv = ov;
    }
  }
  __syncwarp(); /* the acquiring lane's view of the victim's positions becomes the warp's */
  return best ? bv : G;
}

/* The next token (absolute index) of block v's chunk for this warp, or T when v's chunk is taken:
 * lane 0's ticket from cur[v], broadcast. */
__device__ __forceinline__ uint32_t take_token(uint32_t *cur, uint32_t v, uint32_t per, uint32_t T,
                                               uint32_t lane) {
  uint32_t i = 0;
  if (lane == 0) i = atomicAdd(cur + v, 1u);
  i = __shfl_sync(0xffffffffu, i, 0);
  const uint32_t t = v * per + i;
  return i < per && t < T ? t : T;
}

/* ---------------------------------------------------------------------------------------------------
 * dispatch data: G blocks; block b owns a contiguous chunk of my tokens, in tiles of TILE tokens.
 * ------------------------------------------------------------------------------------------------- */
/* Instantiated for BF16 (FP8K 0) and FP8 (1) rows: each gets the registers of its own path (FP8's
 * quantisation with loads in flight would spill in a kernel that also holds the BF16 / TMA paths). */
template <int FP8K>
__global__ void __launch_bounds__(NTHR) ht_dispatch_kernel(const HTParams p) {
  extern __shared__ __align__(128) unsigned char dsm[];
  __shared__ uint32_t sh_w[NWARP][2 * EPD_K_MAX_RANKS + 1];
  __shared__ uint32_t sh_tot[EPD_K_MAX_RANKS], sh_before[EPD_K_MAX_RANKS], sh_run[EPD_K_MAX_RANKS];
  __shared__ uint32_t sh_tile0[EPD_K_MAX_RANKS], sh_tilen[EPD_K_MAX_RANKS]; /* the tile's rows per dest */
  __shared__ uint32_t sh_mat[EPD_K_MAX_RANKS][EPD_K_MAX_RANKS];             /* [src][dest] */
  __shared__ uint32_t sh_srcerr[EPD_K_MAX_RANKS];
  __shared__ uint32_t sh_sendbase[EPD_K_MAX_RANKS], sh_recvbase[EPD_K_MAX_RANKS + 1];
  __shared__ DestRows sh_dr;
  __shared__ uint32_t sh_err, sh_N, sh_n;
  __shared__ int sh_timeout, sh_code, sh_peer, sh_last, sh_abort;

  const uint32_t R = p.R, H = p.H, K = p.K, me = p.rank, G = p.G, S = p.S;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr bool fp8 = FP8K != 0;
  const bool use_tma = !fp8 && p.tma;
  char *lb = local_bank(p);
  HTState *st = (HTState *)(lb + p.lay.st);
  const uint64_t deadline = gtimer() + p.timeout_ns;
  const uint32_t seq = st->dseq + 1;
  const bool too_many = p.T > p.M;
  const uint32_t T = too_many ? 0 : p.T;
  const uint64_t rowb = 2ull * H;
  const uint32_t *tmask = (const uint32_t *)(lb + p.lay.tmask);
  uint32_t *slotc = (uint32_t *)(lb + p.lay.slotc);
  int32_t *rsrc = (int32_t *)(lb + p.lay.rsrc);
  uint32_t *hist = R * S <= HIST_MAX ? (uint32_t *)(dsm + p.sm.hist) : nullptr; /* [R][S] */
  uint64_t *full = (uint64_t *)(dsm + p.sm.bar);
  if (hist)
    for (uint32_t s = tid; s < R * S; s += NTHR) hist[s] = 0;
  if (tid == 0) {
    sh_err = too_many ? ERRB_TOO_MANY : 0u;
    sh_timeout = NO_TIMEOUT;
    sh_abort = 0;
    if (use_tma) {
      for (uint32_t s = 0; s < p.ns; s++) mbar_init(&full[s], 1);
      mbar_init_fence();
    }
  }
  if (tid < R) {
    const bool own = tid == me || p.direct;
    char *pb = own ? nullptr : peer_bank(p, (int)tid);
    sh_dr.xb[tid] = own ? rank_buf<char>(p, tid, EPD_BUF_HT_RECV_X) : pb + p.lay.xstg;
    sh_dr.sb[tid] = own ? rank_buf<float>(p, tid, EPD_BUF_HT_RECV_SCALES) : (float *)(pb + p.lay.xstg + H);
    sh_dr.ss[tid] = own ? H / 128 : (uint32_t)(rowb / 4);
  }
  grid_dep_wait(); /* the route kernel's results (the prologue above does not read them) */
  TR(1);
  /* ---- counts: per dest over all my tokens and over those before my chunk; input errors ---- */
  const uint32_t per = (T + G - 1) / G;
  const uint32_t t0 = min(blockIdx.x * per, T), t1 = min(t0 + per, T);
  {
    uint32_t ctot[EPD_K_MAX_RANKS], cbef[EPD_K_MAX_RANKS], errb = 0;
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) ctot[r] = cbef[r] = 0;
    /* CNT_LD masks in flight per thread: one L2 round trip per CNT_LD * NTHR tokens (a load at a time:
     * T / NTHR round trips, 2.6 us at 4096 tokens) */
    for (uint32_t tb = tid; tb < T; tb += CNT_LD * NTHR) {
      uint32_t mv[CNT_LD];
#pragma unroll
      for (int i = 0; i < CNT_LD; i++) {
        const uint32_t t = tb + i * NTHR;
        mv[i] = t < T ? __ldcg(tmask + t) : 0u;
      }
#pragma unroll
      for (int i = 0; i < CNT_LD; i++) {
        const uint32_t t = tb + i * NTHR, m = mv[i];
        errb |= m >> 24;
#pragma unroll
        for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
          const uint32_t b = (m >> r) & 1u;
          ctot[r] += b;
          cbef[r] += t < t0 ? b : 0u;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
      ctot[r] = __reduce_add_sync(0xffffffffu, ctot[r]);
      cbef[r] = __reduce_add_sync(0xffffffffu, cbef[r]);
    }
    errb = __reduce_or_sync(0xffffffffu, errb);
    __syncthreads(); /* sh_err initialised */
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
        sh_w[warp][r] = ctot[r];
        sh_w[warp][EPD_K_MAX_RANKS + r] = cbef[r];
      }
      if (errb) atomicOr(&sh_err, errb);
    }
    __syncthreads();
    if (tid < 2 * EPD_K_MAX_RANKS) {
      uint32_t a = 0;
      for (int w = 0; w < NWARP; w++) a += sh_w[w][tid];
      if (tid < EPD_K_MAX_RANKS)
        sh_tot[tid] = a;
      else
        sh_before[tid - EPD_K_MAX_RANKS] = a;
    }
    __syncthreads();
  }
  TR(2);
  /* ---- plan message (block 0) to every rank, self included; every block reads all of them ---- */
  if (blockIdx.x == 0 && tid < R) {
    uint64_t *msg = (uint64_t *)(peer_bank(p, (int)tid) + p.lay.cmsg + (uint64_t)me * 128);
    for (uint32_t r = 0; r < R; r++) msg[1 + r] = sh_tot[r];
    __threadfence_system();
    st_relaxed_sys(msg, ((uint64_t)seq << 32) | ((uint64_t)(sh_err & 0xffu) << 24) | (uint64_t)T);
  }
  /* ---- the scan of one tile of my chunk (tile tb): each token's row on each dest, jr (sh_run + its
   * index among the tile's tokens for that dest), the tile's lists (s_cl per dest, s_tl of tokens sent
   * anywhere, s_tm masks) and counts (sh_tile0, sh_tilen, sh_n); sh_run advances past the tile ---- */
  uint32_t *s_tj = (uint32_t *)(dsm + p.sm.tj);    /* [TILE][R] absolute row on each dest */
  uint32_t *s_tm = (uint32_t *)(dsm + p.sm.tmask); /* [TILE] dest mask */
  uint32_t *s_tl = (uint32_t *)(dsm + p.sm.tlist); /* tile indices of the tokens sent anywhere */
  uint16_t *s_cl = (uint16_t *)(dsm + p.sm.clist); /* [R][TILE] tile indices of the tokens sent to r */
  unsigned char *stage = dsm + p.sm.stage;
  const char *x = arena_buf<char>(p, EPD_BUF_X);
  const uint32_t lt = (1u << lane) - 1u;
  uint32_t gload = 0; /* TMA: loads issued so far (thread 0) */
  auto scan_tile = [&](uint32_t tb, uint32_t &m, uint32_t(&jr)[EPD_K_MAX_RANKS]) {
    const uint32_t t = tb + tid;
    m = t < t1 ? (__ldcg(tmask + t) & 0xffu) : 0u;
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
      const uint32_t bal = __ballot_sync(0xffffffffu, (m >> r) & 1u);
      jr[r] = __popc(bal & lt);
      if (lane == 0) sh_w[warp][r] = __popc(bal);
    }
    const uint32_t anyb = __ballot_sync(0xffffffffu, m != 0);
    uint32_t li = __popc(anyb & lt);
    if (lane == 0) sh_w[warp][2 * EPD_K_MAX_RANKS] = __popc(anyb);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
      if (r >= (int)R) break;
      for (uint32_t w = 0; w < warp; w++) jr[r] += sh_w[w][r];
      if ((m >> r) & 1u) s_cl[r * TILE + jr[r]] = (uint16_t)tid;
      jr[r] += sh_run[r];
      s_tj[tid * R + r] = jr[r];
    }
    for (uint32_t w = 0; w < warp; w++) li += sh_w[w][2 * EPD_K_MAX_RANKS];
    s_tm[tid] = m;
    if (m) s_tl[li] = tid;
    __syncthreads(); /* sh_w and sh_run read by everyone */
    if (tid < R) {
      uint32_t a = 0;
      for (int w = 0; w < NWARP; w++) a += sh_w[w][tid];
      sh_tile0[tid] = sh_run[tid];
      sh_tilen[tid] = a;
      sh_run[tid] += a;
    }
    if (tid == 0) {
      uint32_t a = 0;
      for (int w = 0; w < NWARP; w++) a += sh_w[w][2 * EPD_K_MAX_RANKS];
      sh_n = a;
    }
    __syncthreads(); /* s_tl, s_cl, sh_n, the tile's rows */
  };
  /* A chunk of one tile on the register path (direct) is scanned before the plan messages are read:
   * its positions within my segments (pos, sh_tile0: sh_run starts at the tokens before my chunk) do
   * not depend on the other ranks' counts, only the segment bases do. Published for work stealing. */
  const bool early = p.direct && !use_tma && t1 - t0 <= TILE;
  if (early) {
    if (tid < R) sh_run[tid] = sh_before[tid];
    __syncthreads();
    uint32_t m, jr[EPD_K_MAX_RANKS];
    scan_tile(t0, m, jr);
    uint32_t *pos = (uint32_t *)(lb + p.lay.pos) + (uint64_t)(t0 + tid) * R;
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++)
      if (r < (int)R && ((m >> r) & 1u)) pos[r] = jr[r];
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      st_release_gpu_u32(&st->drdy[blockIdx.x], seq);
    }
  }
  if (tid < R) {
    const uint64_t *msg = (const uint64_t *)(lb + p.lay.cmsg + (uint64_t)tid * 128);
    uint64_t v = 0;
    const bool ok = wait_seq(msg, seq, deadline, &v);
    if (!ok) {
      atomicMin(&sh_timeout, (int)tid);
      sh_srcerr[tid] = 0;
      for (uint32_t r = 0; r < R; r++) sh_mat[tid][r] = 0;
    } else {
      sh_srcerr[tid] = (uint32_t)(v >> 24) & 0xffu;
      for (uint32_t r = 0; r < R; r++)
        sh_mat[tid][r] = (uint32_t)__ldcg((const unsigned long long *)msg + 1 + r);
    }
  }
  __syncthreads();
  if (tid == 0) {
    int code = 0, peer = -1;
    for (uint32_t s = 0; s < R && !code; s++) {
      uint32_t eb = sh_srcerr[s];
      if (eb) {
        code = (eb & ERRB_TOO_MANY)     ? EPD_ERR_TOO_MANY_TOKENS
               : (eb & ERRB_BAD_EXPERT) ? EPD_ERR_BAD_EXPERT
                                        : EPD_ERR_INVALID;
        peer = (int)s;
      }
    }
    if (!code && sh_timeout != NO_TIMEOUT) {
      code = EPD_ERR_TIMEOUT;
      peer = sh_timeout;
    }
    uint32_t N = 0;
    for (uint32_t s = 0; s < R; s++) {
      sh_recvbase[s] = N;
      N += sh_mat[s][me];
    }
    sh_recvbase[R] = N;
    if (!code) {
      for (uint32_t r = 0; r < R && !code; r++) {
        uint32_t tr = 0;
        for (uint32_t s = 0; s < R; s++) tr += sh_mat[s][r];
        if (tr > p.C) {
          code = EPD_ERR_OVERFLOW;
          peer = (int)r;
        }
      }
    }
    for (uint32_t r = 0; r < R; r++) {
      uint32_t b = 0;
      for (uint32_t s = 0; s < me; s++) b += sh_mat[s][r];
      sh_sendbase[r] = b;
      sh_run[r] = b + sh_before[r];
    }
    sh_code = code;
    sh_peer = peer;
    sh_N = N;
    if (blockIdx.x == 0) {
      st->code = code;
      st->peer = peer;
      st->N = N;
      st->T = T;
      st->map_version = p.map[0];
      for (uint32_t r = 0; r < R; r++) st->sendbase[r] = sh_sendbase[r];
      for (uint32_t r = 0; r <= R; r++) st->recvbase[r] = sh_recvbase[r];
    }
  }
  __syncthreads();
  TR(3);
  int code = sh_code, peer = sh_peer;
  const uint32_t N = sh_N;

  if (code == 0) {
    /* ---- my chunk, tile by tile: rows on every dest (a scan of the tile's masks), metadata; with TMA
     * the tile's rows too, by thread 0 driving the ring, while warps 1.. write the metadata. Scanned
     * already (early): the tile's rows become absolute ---- */
    if (early && tid < R) sh_tile0[tid] += sh_sendbase[tid];
    for (uint32_t tb = early ? t1 : t0; tb < t1; tb += TILE) {
      __syncthreads(); /* the previous tile's arrays are consumed, sh_run is current */
      if (sh_abort) break;
      const uint32_t t = tb + tid;
      uint32_t m, jr[EPD_K_MAX_RANKS];
      scan_tile(tb, m, jr);
      const uint32_t n = sh_n;
      if (m) send_meta_token(p, t, m, jr, sh_sendbase);
      if (!use_tma) {
        /* the last tile's metadata goes out after the positions are published (below), so that the
         * fence there does not wait for its NVLink writes */
        if (tb + TILE < t1) meta_tile(p, tb, s_cl, sh_tile0, sh_tilen, hist, tid, NTHR);
        continue;
      }
      if (warp > 0) meta_tile(p, tb, s_cl, sh_tile0, sh_tilen, hist, tid - 32, NTHR - 32);
      if (tb == t0) TR(4);
      if (tid == 0) {
        /* one thread drives the ring: row loads run ns - lag ahead, `lag` rows of stores may still read */
        const uint32_t ns = p.ns, lag = p.lag, ahead = ns - lag;
        auto load = [&](uint32_t k) {
          const uint32_t g = gload + k, s = g % ns;
          mbar_expect_tx(&full[s], (uint32_t)rowb);
          tma_load(stage + (uint64_t)s * rowb, x + (uint64_t)(tb + s_tl[k]) * rowb, (uint32_t)rowb, &full[s]);
        };
        for (uint32_t k = 0; k < n && k < ahead; k++) load(k);
        for (uint32_t i = 0; i < n; i++) {
          const uint32_t g = gload + i, s = g % ns;
          if (!mbar_wait(&full[s], (g / ns) & 1u, deadline)) {
            sh_abort = 1;
            code = EPD_ERR_TIMEOUT;
            peer = (int)me;
            break;
          }
          const uint32_t ti = s_tl[i], mm = s_tm[ti];
          for (uint32_t r = 0; r < R; r++)
            if ((mm >> r) & 1u)
              tma_store(sh_dr.xb[r] + (uint64_t)s_tj[ti * R + r] * rowb, stage + (uint64_t)s * rowb,
                        (uint32_t)rowb);
          tma_commit();
          if (i + ahead < n) {
            tma_wait_read(lag);
            load(i + ahead);
          }
        }
        tma_wait_read_all(); /* the stages are free for the next tile */
        gload += n;
      }
    }
    if (!use_tma) {
      /* ---- rows by warps, a token at a time: my chunk's first, then those of blocks still sending
       * theirs (work stealing); a token's rows come from tmask and pos, published by its block ---- */
      __syncthreads(); /* pos of my chunk written */
      if (tid == 0 && !early) {
        __threadfence();
        st_release_gpu_u32(&st->drdy[blockIdx.x], seq);
      }
      /* the last tile's metadata: by the last META_WARPS warps while the others start the rows (they
       * join the rows after it; the shared hist is flushed after the rows), or by all before the rows */
      const uint32_t tl = t0 + (t1 - t0 - 1) / TILE * TILE;
      constexpr uint32_t MW = META_WARPS > 0 && META_WARPS < NWARP ? META_WARPS : NWARP;
      if (t0 < t1 && MW == NWARP) meta_tile(p, tl, s_cl, sh_tile0, sh_tilen, hist, tid, NTHR);
      TR(4);
      if (t0 < t1 && MW < NWARP && warp >= NWARP - MW)
        meta_tile(p, tl, s_cl, sh_tile0, sh_tilen, hist, tid - (NWARP - MW) * 32, MW * 32);
      const uint32_t *pos = (const uint32_t *)(lb + p.lay.pos);
      uint32_t v = blockIdx.x, t = take_token(st->dcur, v, per, T, lane);
      for (;;) {
        if (t >= T) {
          v = pick_victim(st->dcur, st->drdy, seq, per, T, G, lane);
          if (v >= G) break;
          t = take_token(st->dcur, v, per, T, lane);
          continue;
        }
        const uint32_t mm = __ldcg(tmask + t) & 0xffu;
        const uint32_t pl = lane < R && ((mm >> lane) & 1u) ? __ldcg(pos + (uint64_t)t * R + lane) : 0u;
        uint32_t jj[EPD_K_MAX_RANKS];
#pragma unroll
        for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
          const uint32_t pr = __shfl_sync(0xffffffffu, pl, r);
          jj[r] = r < (int)R ? sh_sendbase[r] + pr : 0u;
        }
        const char *xrow = x + (uint64_t)t * rowb;
        if (mm && fp8)
          send_row_fp8(p, xrow, mm, jj, sh_dr, (float *)(dsm + p.sm.fsc) + warp * (H / 128), lane);
        else if (const uint32_t ms = p.ce ? mm & (1u << me) : mm) /* the copy engines carry the others */
          send_row_bf16(p, xrow, ms, jj, sh_dr, lane);
        t = take_token(st->dcur, v, per, T, lane);
      }
    }
    __syncthreads();
    if (tid == 0) {
      TR_LATEST(5);
      TR_EARLIEST(10);
    }
    if (use_tma && tid == 0) tma_wait_all();
    if (tid == 0) TR_LATEST(6);
    if (hist && p.direct && !sh_abort) {
      /* the chunk's entries per (dest, slot) into the dests' slotc, before the flags. Here, after the
       * rows: issued before or among the rows, these NVLink reductions slowed the rows more (2x H100:
       * BF16 dispatch +1 us, FP8 +7 us) than the 1.5 us they add in front of the fence. */
      for (uint32_t i = tid; i < R * S; i += NTHR) {
        const uint32_t r = i / S, v = hist[i];
        if (v) atomicAdd((uint32_t *)((r == me ? lb : peer_bank(p, (int)r)) + p.lay.slotc) + (i - r * S), v);
      }
    }
  }
  signal_peers(p, p.lay.dflag, seq, code != 0 || sh_abort);
  {
    int bad;
    const int to = wait_peers(p, (const uint64_t *)(lb + p.lay.dflag), seq, deadline, &bad);
    if (to != NO_TIMEOUT && code == 0) {
      code = EPD_ERR_TIMEOUT;
      peer = to;
    } else if (bad != NO_TIMEOUT && code == 0) { /* a peer failed before all its rows were sent */
      code = EPD_ERR_PEER;
      peer = bad;
    }
  }
  TR(7);
  if (code == 0 && !sh_abort && !p.direct) {
    /* ---- receive (staging): copy the remote rows into the arena and count their entries per local
     * slot (direct: the senders counted them into slotc before their flags) ---- */
    const uint32_t own0 = sh_recvbase[me], own1 = sh_recvbase[me + 1];
    int64_t *recv_idx = arena_buf<int64_t>(p, EPD_BUF_HT_RECV_TOPK_IDX);
    int32_t *recv_src = arena_buf<int32_t>(p, EPD_BUF_HT_RECV_SRC);
    {
      /* staging: copy the remote rows into the arena */
      const bool f8 = fp8;
      const uint32_t nsc = H / 128;
      char *recv_x = arena_buf<char>(p, EPD_BUF_HT_RECV_X);
      float *recv_sc = arena_buf<float>(p, EPD_BUF_HT_RECV_SCALES);
      float *recv_w = arena_buf<float>(p, EPD_BUF_HT_RECV_TOPK_WEIGHTS);
      const RowMeta *mstg = (const RowMeta *)(lb + p.lay.mstg);
      const char *xstg = lb + p.lay.xstg;
      for (uint32_t j = blockIdx.x * NWARP + warp; j < N; j += G * NWARP) {
        if (j >= own0 && j < own1) continue;
        const char *srow = xstg + (uint64_t)j * rowb;
        if (f8) {
          warp_copy_row((int4 *)(recv_x + (uint64_t)j * rowb), (const int4 *)srow, H / 16, lane);
          for (uint32_t g = lane; g < nsc; g += 32)
            recv_sc[(uint64_t)j * nsc + g] = __ldcg((const float *)(srow + H) + g);
        } else {
          warp_copy_row((int4 *)(recv_x + (uint64_t)j * rowb), (const int4 *)srow, H / 8, lane);
        }
        const RowMeta *mr = mstg + j;
        if (lane < K) {
          const int16_t ls = __ldcg(&mr->slot[lane]);
          recv_idx[(uint64_t)j * K + lane] = ls;
          recv_w[(uint64_t)j * K + lane] = __ldcg(&mr->w[lane]);
          if (ls >= 0) {
            if (hist)
              atomicAdd(&hist[me * S + ls], 1u);
            else
              atomicAdd(&slotc[ls], 1u);
          }
        }
        if (lane == 0) {
          const int32_t s = __ldcg(&mr->src);
          recv_src[j] = s;
          rsrc[j] = s;
        }
      }
    }
    __syncthreads();
    if (hist)
      for (uint32_t s = tid; s < S; s += NTHR)
        if (hist[me * S + s]) atomicAdd(&slotc[s], hist[me * S + s]);
  }
  /* ---- completion: the last block writes counts and the record ---- */
  __syncthreads();
  TR(8);
  if (tid == 0) {
    if (code != 0 && atomicCAS(&st->err[0], 0, code) == 0) atomicExch(&st->errpeer[0], peer);
    __threadfence();
    sh_last = atomicAdd(&st->dticket, 1u) == G - 1;
  }
  __syncthreads();
  if (!sh_last) return;
  __threadfence();
  int c = atomicAdd(&st->err[0], 0);
  int pe = atomicAdd(&st->errpeer[0], 0);
  if (tid == 0) {
    /* The last block alone: my copy-engine rows landed on every dest (a stream memory operation after
     * each copy writes ce_done; it fences like __threadfence_system first; waited for on failures too,
     * so that nothing is in flight when the op completes), then every peer is told, and when this op
     * may move rows with the copy engines (p.ce_any: any rank might, whatever this one decided) every
     * peer's word is waited for: its rows landed here. The other blocks are gone long before (their SMs
     * are free). */
    int xto = NO_TIMEOUT, xbad = NO_TIMEOUT;
    for (uint32_t r = 0; r < R && p.ce; r++) {
      if (r == me) continue;
      bool ok = false;
      for (uint32_t i = 0;;) {
        if (ld_acquire_sys(&st->ce_done[r][i]) >= p.ce_seq && ++i == p.ce) {
          ok = true;
          break;
        }
        if (gtimer() > deadline) break;
      }
      if (!ok) xto = (int)me;
    }
    if (p.trace) p.trace[11] = gtimer();
    __threadfence_system();
    for (uint32_t r = 0; r < R; r++)
      if (r != me)
        st_relaxed_sys((uint64_t *)(peer_bank(p, (int)r) + p.lay.xflag) + me,
                       ((uint64_t)seq << 32) | (c != 0 || xto != NO_TIMEOUT ? FLAG_BAD : 0ull));
    for (uint32_t r = 0; r < R && p.ce_any; r++) {
      if (r == me) continue;
      uint64_t v = 0;
      const bool ok = wait_seq((const uint64_t *)(lb + p.lay.xflag) + r, seq, deadline, &v);
      if (!ok && xto == NO_TIMEOUT)
        xto = (int)r;
      else if (ok && (v & FLAG_BAD) && xbad == NO_TIMEOUT)
        xbad = (int)r;
    }
    if (c == 0 && xto != NO_TIMEOUT) {
      c = EPD_ERR_TIMEOUT;
      pe = xto;
    } else if (c == 0 && xbad != NO_TIMEOUT) {
      c = EPD_ERR_PEER;
      pe = xbad;
    }
    sh_code = c;
    sh_peer = pe;
  }
  __syncthreads();
  c = sh_code;
  pe = sh_peer;
  if (c == 0) {
    int32_t *cnt = arena_buf<int32_t>(p, EPD_BUF_HT_RECV_COUNT);
    for (uint32_t s = tid; s < S; s += NTHR) {
      uint32_t v = __ldcg(&slotc[s]);
      cnt[s] = (int32_t)v;
      if (p.slot_tokens) p.slot_tokens[s] += v;
    }
  }
  for (uint32_t b = tid; b < G; b += NTHR) st->dcur[b] = 0; /* every block is past its rows */
  __syncthreads();
  if (tid == 0) {
    st->dseq = seq;
    st->derr = c;
    st->err[0] = 0;
    st->errpeer[0] = -1;
    st->dticket = 0;
    volatile epd_comp_t *comp = p.comp;
    if (comp) {
      comp->status = c;
      comp->peer = c ? pe : -1;
      comp->num_recv = (c == 0 || c == EPD_ERR_OVERFLOW) ? N : 0u;
      comp->map_version = p.map[0];
    }
    if (p.trace) p.trace[9] = gtimer();
    __threadfence_system();
  }
}

/* ---------------------------------------------------------------------------------------------------
 * combine: G blocks.
 * ------------------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(NTHR) ht_combine_kernel(const HTParams p) {
  extern __shared__ __align__(128) unsigned char dsm[];
  __shared__ int sh_last, sh_to, sh_abort, sh_bad;
  __shared__ uint32_t sh_sb[EPD_K_MAX_RANKS]; /* st->sendbase */
  const uint32_t R = p.R, H = p.H, me = p.rank, G = p.G, M = p.M;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  char *lb = local_bank(p);
  HTState *st = (HTState *)(lb + p.lay.st);
  const uint64_t deadline = gtimer() + p.timeout_ns;
  const uint32_t seq = st->cseq[blockIdx.x] + 1;
  const int derr = st->derr;
  const uint32_t N = st->N, T = st->T;
  const uint64_t rowb = 2ull * H;
  const uint32_t n16 = H / 8;
  const char *y = arena_buf<char>(p, EPD_BUF_HT_Y);
  const TokRoute *route = (const TokRoute *)(lb + p.lay.route);
  const uint32_t *pos = (const uint32_t *)(lb + p.lay.pos);
  char *out = arena_buf<char>(p, EPD_BUF_OUT);
  int code = 0, peer = -1;
  TR(0);

  if (!p.direct) {
    /* ---- staging: each expert rank pushes every remote row's partial to its source ---- */
    const int32_t *rsrc = (const int32_t *)(lb + p.lay.rsrc);
    if (derr == 0) {
      for (uint32_t j = blockIdx.x * NWARP + warp; j < N; j += G * NWARP) {
        int32_t sp = __ldcg(rsrc + j);
        uint32_t src = (uint32_t)sp >> 24, t = (uint32_t)sp & 0xffffffu;
        if (src == me || src >= R) continue;
        char *drow = peer_bank(p, (int)src) + p.lay.cstg + ((uint64_t)me * M + t) * rowb;
        const int4 *srow = (const int4 *)(y + (uint64_t)j * rowb);
        for (uint32_t v0 = lane; v0 < n16; v0 += 32 * 8) {
          int4 b[8];
#pragma unroll
          for (int i = 0; i < 8; i++)
            if (v0 + i * 32 < n16) b[i] = ld_nc_v4(srow + v0 + i * 32);
#pragma unroll
          for (int i = 0; i < 8; i++)
            if (v0 + i * 32 < n16) ((int4 *)drow)[v0 + i * 32] = b[i];
        }
      }
    }
    signal_peers(p, p.lay.cflag, seq, derr != 0); /* a failed dispatch pushed no partials */
    int bad;
    int to = wait_peers(p, (const uint64_t *)(lb + p.lay.cflag), seq, deadline, &bad);
    if (to != NO_TIMEOUT) {
      code = EPD_ERR_TIMEOUT;
      peer = to;
    } else if (derr != 0) {
      code = EPD_ERR_STATE;
    } else if (bad != NO_TIMEOUT) {
      code = EPD_ERR_PEER;
      peer = bad;
    } else {
      /* ---- source side: OUT[t] = sum over dest ranks in rank order, f32 ---- */
      const char *cstg = lb + p.lay.cstg;
      const uint32_t own = st->sendbase[me];
      for (uint32_t t = blockIdx.x * NWARP + warp; t < T; t += G * NWARP) {
        const uint32_t mask = route[t].mask & 0xffu;
        const int4 *rows[EPD_K_MAX_RANKS];
#pragma unroll
        for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
          rows[r] = nullptr;
          if (r < (int)R && ((mask >> r) & 1u))
            rows[r] = (uint32_t)r == me
                          ? (const int4 *)(y + (uint64_t)(own + pos[(uint64_t)t * R + r]) * rowb)
                          : (const int4 *)(cstg + ((uint64_t)r * M + t) * rowb);
        }
        warp_reduce_rows<4>((int4 *)(out + (uint64_t)t * rowb), rows, R, n16, lane);
      }
    }
  } else {
    /* ---- direct: my HT_Y is ready for the peers; wait until theirs is ---- */
    if (tid == 0) {
      sh_to = sh_bad = NO_TIMEOUT;
      sh_abort = 0;
    }
    if (tid < R) sh_sb[tid] = st->sendbase[tid];
    __syncthreads();
    if (tid < R && tid != me) {
      __threadfence_system();
      /* FLAG_BAD: my dispatch failed, my HT_Y rows are not the peers' to read */
      st_relaxed_sys((uint64_t *)(peer_bank(p, (int)tid) + p.lay.rflag) + (uint64_t)me * G + blockIdx.x,
                     ((uint64_t)seq << 32) | (derr != 0 ? FLAG_BAD : 0ull));
      uint64_t v;
      const bool ok =
          wait_seq((const uint64_t *)(lb + p.lay.rflag) + (uint64_t)tid * G + blockIdx.x, seq, deadline, &v);
      if (!ok)
        atomicMin(&sh_to, (int)tid);
      else if (v & FLAG_BAD)
        atomicMin(&sh_bad, (int)tid);
    }
    uint64_t *full = (uint64_t *)(dsm + p.sm.bar), *empty = full + MAX_STAGES;
    if (tid == 0 && p.tma) {
      for (uint32_t s = 0; s < p.ns; s++) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], 1);
      }
      mbar_init_fence();
    }
    __syncthreads();
    TR(1);
    if (sh_to != NO_TIMEOUT) {
      code = EPD_ERR_TIMEOUT;
      peer = sh_to;
    } else if (derr != 0) {
      code = EPD_ERR_STATE;
    } else if (sh_bad != NO_TIMEOUT) {
      code = EPD_ERR_PEER;
      peer = sh_bad;
    } else {
      /* ---- pull: OUT[t] = sum over the ranks that received t, in rank order, f32 ---- */
      uint32_t *s_tj = (uint32_t *)(dsm + p.sm.tj);
      uint32_t *s_tm = (uint32_t *)(dsm + p.sm.tmask);
      unsigned char *stage = dsm + p.sm.stage;
      const uint32_t per = (T + G - 1) / G;
      const uint32_t t0 = min(blockIdx.x * per, T), t1 = min(t0 + per, T);
      if (!p.tma) {
        /* register loads, a warp per token: my chunk's first, then those of blocks with tokens left
         * (work stealing; the positions are the dispatch's, complete) */
        uint32_t v = blockIdx.x, t = take_token(st->ccur, v, per, T, lane);
        for (;;) {
          if (t >= T) {
            v = pick_victim(st->ccur, nullptr, 0, per, T, G, lane);
            if (v >= G) break;
            t = take_token(st->ccur, v, per, T, lane);
            continue;
          }
          const uint32_t m = route[t].mask & 0xffu;
          const uint32_t pl = lane < R && ((m >> lane) & 1u) ? __ldcg(pos + (uint64_t)t * R + lane) : 0u;
          const int4 *rows[EPD_K_MAX_RANKS];
#pragma unroll
          for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
            const uint32_t pr = __shfl_sync(0xffffffffu, pl, r);
            rows[r] =
                r < (int)R && ((m >> r) & 1u)
                    ? (const int4 *)(rank_buf<char>(p, r, EPD_BUF_HT_Y) + (uint64_t)(sh_sb[r] + pr) * rowb)
                    : nullptr;
          }
          warp_reduce_rows<EPD_HT_COMBINE_NV>((int4 *)(out + (uint64_t)t * rowb), rows, R, n16, lane);
          t = take_token(st->ccur, v, per, T, lane);
        }
      }
      /* bulk-copy engine (opt-in): tile by tile, thread 0 loads the rows' column chunks, warps 1..ncw sum */
      const uint32_t ns = p.ns, cw = p.cw, nch = p.nch;
      const uint64_t stb = (uint64_t)R * cw; /* bytes per stage: one column chunk of every rank's row */
      uint32_t gu = 0;                       /* units (token, chunk) of the earlier tiles */
      for (uint32_t tb = t0; p.tma && tb < t1; tb += TILE) {
        __syncthreads();
        if (sh_abort) break;
        const uint32_t nt = min(TILE, t1 - tb);
        if (tid < nt) {
          const uint32_t t = tb + tid;
          const uint32_t m = route[t].mask & 0xffu;
          s_tm[tid] = m;
          for (uint32_t r = 0; r < R; r++)
            if ((m >> r) & 1u) s_tj[tid * R + r] = st->sendbase[r] + pos[(uint64_t)t * R + r];
        }
        __syncthreads();
        {
          const uint32_t nu = nt * nch;
          if (tid == 0) {
            /* producer: the rows' chunks of unit u into stage u % ns (rank r's at r * cw) */
            for (uint32_t u = 0; u < nu; u++) {
              const uint32_t g = gu + u, s = g % ns;
              if (g >= ns && !mbar_wait(&empty[s], ((g / ns) - 1u) & 1u, deadline)) {
                sh_abort = 1;
                code = EPD_ERR_TIMEOUT;
                peer = (int)me;
                break;
              }
              const uint32_t i = u / nch, c = u % nch, m = s_tm[i];
              const uint32_t off = c * cw, bytes = min(cw, (uint32_t)rowb - off);
              mbar_expect_tx(&full[s], (uint32_t)__popc(m) * bytes);
              for (uint32_t r = 0; r < R; r++)
                if ((m >> r) & 1u)
                  tma_load(stage + s * stb + (uint64_t)r * cw,
                           rank_buf<char>(p, r, EPD_BUF_HT_Y) + (uint64_t)s_tj[i * R + r] * rowb + off, bytes,
                           &full[s]);
            }
          } else if (warp > 0 && warp <= p.ncw) {
            /* consumers: warp 1 + s % ncw sums every unit of stage s (ncw divides ns, see plan_kernel_smem),
             * round after round. A parity wait tells only consecutive phases apart: with units of one stage
             * on two warps, the warp of round q + 1 passed its wait on round q - 1's phase, read a stage
             * still in flight and arrived on `empty` early, and the producer then re-armed a `full` barrier
             * with bytes pending (a fault at its arrive.expect_tx; compute-sanitizer memcheck and
             * racecheck) */
            for (uint32_t u = (warp - 1 + p.ncw - gu % p.ncw) % p.ncw; u < nu; u += p.ncw) {
              const uint32_t g = gu + u, s = g % ns;
              /* every lane waits (each acquires the bulk copy's bytes); the warp gives up together, so that
               * no lane is left at the __syncwarp below when another's deadline passed */
              if (!__all_sync(0xffffffffu, mbar_wait(&full[s], (g / ns) & 1u, deadline))) {
                if (lane == 0) {
                  sh_abort = 1;
                  code = EPD_ERR_TIMEOUT;
                  peer = (int)me;
                }
                break;
              }
              const uint32_t i = u / nch, c = u % nch, m = s_tm[i];
              const uint32_t off = c * cw, bytes = min(cw, (uint32_t)rowb - off);
              const int4 *sb = (const int4 *)(stage + s * stb);
              int4 *orow = (int4 *)(out + (uint64_t)(tb + i) * rowb + off);
              const uint32_t v16 = bytes / 16, c16 = cw / 16;
              for (uint32_t v = lane; v < v16; v += 32) {
                float acc[8];
#pragma unroll
                for (int q = 0; q < 8; q++) acc[q] = 0.f;
#pragma unroll
                for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
                  if (r >= (int)R || !((m >> r) & 1u)) continue;
                  const int4 b = sb[r * c16 + v];
                  const uint32_t *w = (const uint32_t *)&b;
#pragma unroll
                  for (int q = 0; q < 4; q++) {
                    acc[2 * q] += bf16_to_f(w[q] & 0xffffu);
                    acc[2 * q + 1] += bf16_to_f(w[q] >> 16);
                  }
                }
                int4 o;
                o.x = (int)pack_bf16x2(acc[0], acc[1]);
                o.y = (int)pack_bf16x2(acc[2], acc[3]);
                o.z = (int)pack_bf16x2(acc[4], acc[5]);
                o.w = (int)pack_bf16x2(acc[6], acc[7]);
                orow[v] = o;
              }
              __syncwarp();
              if (lane == 0) mbar_arrive(&empty[s]);
            }
          }
          gu += nu;
        }
      }
    }
    __syncthreads();
    if (tid == 0) TR_LATEST(2);
    if (sh_abort && code == 0) { /* a consumer warp's wait expired */
      code = EPD_ERR_TIMEOUT;
      peer = (int)me;
    }
    /* done reading the peers' HT_Y; mine may be reused once every peer is */
    signal_peers(p, p.lay.cflag, seq, 0);
    int bad;
    int to = wait_peers(p, (const uint64_t *)(lb + p.lay.cflag), seq, deadline, &bad);
    if (to != NO_TIMEOUT && code == 0) {
      code = EPD_ERR_TIMEOUT;
      peer = to;
    }
    TR(3);
  }
  __syncthreads();
  if (tid == 0) {
    if (code != 0 && atomicCAS(&st->err[1], 0, code) == 0) atomicExch(&st->errpeer[1], peer);
    st->cseq[blockIdx.x] = seq;
    __threadfence();
    sh_last = atomicAdd(&st->cticket, 1u) == G - 1;
  }
  __syncthreads();
  if (!sh_last || tid != 0) return;
  __threadfence();
  const int c = atomicAdd(&st->err[1], 0);
  const int pe = atomicAdd(&st->errpeer[1], 0);
  st->err[1] = 0;
  st->errpeer[1] = -1;
  st->cticket = 0;
  for (uint32_t b = 0; b < G; b++) st->ccur[b] = 0; /* every block is past its rows */
  volatile epd_comp_t *comp = p.comp;
  if (comp) {
    comp->status = c;
    comp->peer = c ? pe : -1;
    comp->num_recv = N;
    comp->map_version = st->map_version;
  }
  if (p.trace) p.trace[4] = gtimer();
  __threadfence_system();
}

HTLayout make_layout(const epd_k_ht_geom_t *g, uint32_t G) {
  HTLayout l;
  uint64_t R = g->num_ranks, M = g->max_tokens, H = g->hidden, C = g->capacity, S = g->slots_per_rank, o = 0;
  auto take = [&](uint64_t bytes) {
    uint64_t at = o;
    o = align_up(o + bytes, 256);
    return at;
  };
  l.cmsg = take(R * 128);
  l.dflag = take(R * G * 8);
  l.cflag = take(R * G * 8);
  l.xflag = take(R * 8);
  l.rflag = take(R * G * 8);
  l.route = take(M * sizeof(TokRoute));
  l.tmask = take(M * 4);
  l.pos = take(M * R * 4);
  l.rsrc = take(C * 4);
  l.slotc = take(S * 4);
  l.st = take(sizeof(HTState));
  l.ctrl_bytes = o;
  l.xstg = take(C * 2 * H);
  l.mstg = take(C * sizeof(RowMeta));
  l.cstg = take(R * M * 2 * H);
  l.bank_bytes = align_up(o, 4096);
  return l;
}

/* Shared memory of the dispatch kernel: fsc_bytes of FP8 scales, TMA ring of ns row stages when ns > 0. */
SmemLayout dispatch_smem(uint32_t R, uint32_t S, uint32_t fsc_bytes, uint64_t stage_bytes, uint32_t ns) {
  SmemLayout m;
  uint32_t o = 0;
  m.bar = o;
  o += MAX_STAGES * 8 * 2;
  m.tj = o;
  o += TILE * R * 4;
  m.tmask = o;
  o += TILE * 4;
  m.tlist = o;
  o += TILE * 4;
  m.clist = o;
  o += TILE * R * 2;
  m.hist = o;
  o += R * S <= HIST_MAX ? R * S * 4 : 0;
  m.fsc = o;
  o += fsc_bytes;
  o = (uint32_t)align_up(o, 128);
  m.stage = o;
  o += (uint32_t)(stage_bytes * ns);
  m.total = o;
  return m;
}

/* The parameters of the data kernels that depend on the op: path, copy engine, shared memory. */
void plan_kernel_smem(HTParams &p, bool dispatch, bool fp8) {
  const uint64_t rowb = 2ull * p.H;
  p.ns = p.lag = p.cw = p.nch = p.ncw = 0;
  if (dispatch) {
    SmemLayout m0 = dispatch_smem(p.R, p.S, fp8 ? NWARP * (p.H / 128) * 4 : 0, 0, 0);
    if (p.tma && !fp8) {
      uint32_t ns = (uint32_t)((SMEM_MAX - m0.total) / rowb);
      if (ns > MAX_STAGES) ns = MAX_STAGES;
      if (ns >= 3) {
        p.ns = ns;
        p.lag = ns >= 8 ? 4 : ns >= 4 ? 2 : 1;
        p.sm = dispatch_smem(p.R, p.S, 0, rowb, ns);
        return;
      }
    }
    p.tma = 0;
    p.sm = m0;
    return;
  }
  /* combine (direct): stages of one column chunk of every rank's row, >= 8 of them where possible */
  SmemLayout m = dispatch_smem(p.R, 0, 0, 0, 0); /* barriers, tile rows and masks */
  p.sm = m;
  if (!p.direct || !p.tma) {
    p.tma = 0;
    return;
  }
  const uint64_t avail = SMEM_MAX - m.stage;
  uint32_t nch = 1, cw = 0;
  for (;; nch++) {
    cw = (uint32_t)align_up((rowb + nch - 1) / nch, 256);
    if ((uint64_t)p.R * cw * 8 <= avail || cw <= 256) break;
  }
  nch = (uint32_t)((rowb + cw - 1) / cw);
  uint32_t ns = (uint32_t)(avail / ((uint64_t)p.R * cw));
  if (ns > MAX_STAGES) ns = MAX_STAGES;
  if (ns < 2) {
    p.tma = 0;
    return;
  }
  /* one consumer warp per stage residue: ncw warps (1..NWARP-1) and a multiple of ncw stages */
  p.ncw = ns < (uint32_t)NWARP - 1 ? ns : (uint32_t)NWARP - 1;
  ns -= ns % p.ncw;
  p.ns = ns;
  p.cw = cw;
  p.nch = nch;
  p.sm.total = m.stage + (uint32_t)((uint64_t)ns * p.R * cw);
}

} /* namespace */

struct epd_k_ht {
  epd_k_ht_geom_t g;
  ncclComm_t comm;
  ncclDevComm_t dev;
  int have_dev;
  ncclWindow_t win;
  char *local;
  size_t win_off;
  HTLayout lay;
  /* EPD_K_HT_COPY_CE: ce_split streams per dest rank (made at the first such op), fork and join events */
  cudaStream_t ce_stream[EPD_K_MAX_RANKS][CE_SPLIT_MAX];
  cudaEvent_t ce_fork, ce_join[EPD_K_MAX_RANKS][CE_SPLIT_MAX];
  uint32_t ce_split;
  uint64_t ce_seq, ce_ops;
  uint32_t ce_delay_us; /* epd_k_ht_test_ce_delay (test builds): each copy stream first spins this long */
};

#ifdef EPD_TEST_HOOKS
/* epd_k_ht_test_ce_delay: spin on a copy stream before its copy (one thread; test builds only). */
static __global__ void ce_delay_kernel(uint64_t ns) {
  const uint64_t t0 = gtimer();
  while (gtimer() - t0 < ns) {
  }
}
#endif

typedef CUresult (*write_value64_fn)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

/* cuStreamWriteValue64 through the runtime's driver entry point (the kernels link only cudart). */
static write_value64_fn write_value64(void) {
  /* a function-local static: initialised once, thread-safe (the rank threads launch concurrently) */
  static const write_value64_fn fn = [] {
    void *f = NULL;
    cudaDriverEntryPointQueryResult q;
    return cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &f, 12000, cudaEnableDefault, &q) ==
                       cudaSuccess &&
                   q == cudaDriverEntryPointSuccess
               ? (write_value64_fn)f
               : (write_value64_fn)NULL;
  }();
  return fn;
}

static void ce_free(epd_k_ht_t *k) {
  for (int r = 0; r < EPD_K_MAX_RANKS; r++)
    for (uint32_t i = 0; i < CE_SPLIT_MAX; i++) {
      if (k->ce_stream[r][i]) cudaStreamDestroy(k->ce_stream[r][i]);
      if (k->ce_join[r][i]) cudaEventDestroy(k->ce_join[r][i]);
      k->ce_stream[r][i] = NULL;
      k->ce_join[r][i] = NULL;
    }
  if (k->ce_fork) cudaEventDestroy(k->ce_fork);
  k->ce_fork = NULL;
}

/* After a failed issue: wait for the copies already queued (nothing of the op may stay in flight). */
static void ce_drain(epd_k_ht_t *k, const HTParams &p) {
  for (uint32_t r = 0; r < p.R; r++)
    for (uint32_t i = 0; i < CE_SPLIT_MAX; i++)
      if (k->ce_stream[r][i]) cudaStreamSynchronize(k->ce_stream[r][i]);
}

/* The copy-engine rows of a dense BF16 dispatch (EPD_K_HT_COPY_CE): my T rows of x to rows base .. base +
 * T - 1 of each dest rank's HT_RECV_X (base: the tokens of the ranks before me, as the data kernel
 * computes sendbase), in p.ce parts of about T / p.ce rows, each a copy on its own stream followed by
 * st->ce_done[dest][part] = p.ce_seq. Forked from `s` here; joined by ce_join. */
static epd_result_t ce_rows(epd_k_ht_t *k, const HTParams &p, const uint32_t *rank_tokens, cudaStream_t s,
                            char *err, size_t errlen) {
  cudaError_t e = cudaSuccess;
  const write_value64_fn wv = write_value64(); /* found: the launcher checked */
  if (!k->ce_fork) {                           /* the streams and events, made at the first such op */
    e = cudaEventCreateWithFlags(&k->ce_fork, cudaEventDisableTiming);
    for (uint32_t r = 0; r < p.R && e == cudaSuccess; r++)
      for (uint32_t i = 0; i < CE_SPLIT_MAX && r != p.rank && e == cudaSuccess; i++) {
        e = cudaStreamCreateWithFlags(&k->ce_stream[r][i], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&k->ce_join[r][i], cudaEventDisableTiming);
      }
    if (e != cudaSuccess) {
      ce_free(k);
      if (err && errlen) snprintf(err, errlen, "HT copy-engine streams: %s", cudaGetErrorString(e));
      return EPD_ERR_CUDA;
    }
  }
  uint64_t base = 0;
  for (uint32_t q = 0; q < p.rank; q++) base += rank_tokens[q];
  const uint64_t rowb = 2ull * p.H;
  const char *x = (const char *)(uintptr_t)(p.arena.base + p.arena.off[p.bank][EPD_BUF_X]);
  const HTState *st = (const HTState *)(p.local + p.bank * p.lay.bank_bytes + p.lay.st);
  e = cudaEventRecord(k->ce_fork, s);
  for (uint32_t r = 0; r < p.R && e == cudaSuccess; r++)
    for (uint32_t i = 0; i < p.ce && r != p.rank && e == cudaSuccess; i++) {
      cudaStream_t cs = k->ce_stream[r][i];
      const uint64_t r0 = (uint64_t)p.T * i / p.ce, r1 = (uint64_t)p.T * (i + 1) / p.ce;
      e = cudaStreamWaitEvent(cs, k->ce_fork, 0);
#ifdef EPD_TEST_HOOKS
      if (e == cudaSuccess && k->ce_delay_us) {
        ce_delay_kernel<<<1, 1, 0, cs>>>((uint64_t)k->ce_delay_us * 1000u);
        e = cudaGetLastError();
      }
#endif
      char *dst =
          (char *)(uintptr_t)(p.peer_arena[r] + p.arena.off[p.bank][EPD_BUF_HT_RECV_X]) + (base + r0) * rowb;
      if (e == cudaSuccess && r1 > r0)
        e = cudaMemcpyAsync(dst, x + r0 * rowb, (r1 - r0) * rowb, cudaMemcpyDeviceToDevice, cs);
      if (e == cudaSuccess &&
          wv((CUstream)cs, (CUdeviceptr)(uintptr_t)&st->ce_done[r][i], p.ce_seq, 0) != CUDA_SUCCESS) {
        ce_drain(k, p);
        return set_err(err, errlen, EPD_ERR_CUDA, "%s: cuStreamWriteValue64 failed (dest %ld, part %ld)",
                       "HT copy engines", (long)r, (long)i);
      }
      if (e == cudaSuccess) e = cudaEventRecord(k->ce_join[r][i], cs);
    }
  if (e != cudaSuccess) {
    ce_drain(k, p);
    if (err && errlen) snprintf(err, errlen, "HT copy-engine rows: %s", cudaGetErrorString(e));
    return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

static uint32_t ht_blocks(const epd_k_ht_geom_t *g) {
  return g->blocks ? g->blocks : EPD_K_HT_BLOCKS;
}

static epd_result_t ht_check_geom(const epd_k_ht_geom_t *g, char *err, size_t errlen) {
  const char *f = "%s = %ld out of range (max %ld)";
  if (g->num_ranks < 1 || g->num_ranks > EPD_K_MAX_RANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "num_ranks", g->num_ranks, EPD_K_MAX_RANKS);
  if (g->rank >= g->num_ranks)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "rank", g->rank, g->num_ranks - 1);
  if (g->hidden == 0 || g->hidden % 128 || g->hidden > EPD_K_MAX_HIDDEN)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld must be a multiple of 128 up to %ld", "hidden",
                   g->hidden, EPD_K_MAX_HIDDEN);
  if (g->topk < 1 || g->topk > EPD_K_MAX_TOPK)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "topk", g->topk, EPD_K_MAX_TOPK);
  if (g->max_tokens < 1 || g->max_tokens > EPD_K_HT_MAX_TOKENS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "max_tokens", g->max_tokens, EPD_K_HT_MAX_TOKENS);
  if (g->capacity < 1 || g->capacity > EPD_K_HT_MAX_TOKENS * EPD_K_MAX_RANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "capacity", g->capacity,
                   EPD_K_HT_MAX_TOKENS * EPD_K_MAX_RANKS);
  if (g->num_experts < 1) return set_err(err, errlen, EPD_ERR_INVALID, f, "num_experts", 0, 1 << 30);
  if (g->slots_per_rank < 1 || g->slots_per_rank > 0x7fff)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "slots_per_rank", g->slots_per_rank, 0x7fff);
  if (ht_blocks(g) > EPD_K_HT_MAX_BLOCKS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "blocks", ht_blocks(g), EPD_K_HT_MAX_BLOCKS);
  return EPD_OK;
}

extern "C" {

size_t epd_k_ht_window_bytes(const epd_k_ht_geom_t *g) {
  return (size_t)(make_layout(g, ht_blocks(g)).bank_bytes * EPD_NUM_BANKS);
}

epd_result_t epd_k_ht_create(const epd_k_ht_geom_t *g, struct ncclComm *lsa_comm,
                             struct ncclWindow_vidmem *window, void *window_local, size_t window_offset,
                             epd_k_ht_t **out, char *err, size_t errlen) {
  epd_result_t r = ht_check_geom(g, err, errlen);
  if (r) return r;
  if (!lsa_comm || !window || !window_local || (window_offset % 4096))
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: NULL handle or unaligned offset %ld (%ld)",
                   "epd_k_ht_create", (long)window_offset, 4096);
  epd_k_ht_t *k = (epd_k_ht_t *)calloc(1, sizeof(*k));
  if (!k) return EPD_ERR_NOMEM;
  k->g = *g;
  k->g.blocks = ht_blocks(g);
  k->comm = lsa_comm;
  k->win = window;
  k->local = (char *)window_local + window_offset;
  k->win_off = window_offset;
  k->lay = make_layout(&k->g, k->g.blocks);
  /* copy-engine streams per dest rank of a dense BF16 dispatch (a tuning knob, 1..4) */
  k->ce_split = g->ce_split >= 1 && g->ce_split <= CE_SPLIT_MAX ? g->ce_split : EPD_K_HT_CE_SPLIT;
  /* The device communicator only checks that the LSA team is what the geometry says. */
  ncclDevCommRequirements_t req;
  dev_comm_requirements_init(&req);
  if ((r = dev_comm_create(lsa_comm, &req, &k->dev, err, errlen))) {
    free(k);
    return r;
  }
  k->have_dev = 1;
  if ((r = check_lsa_team(&k->dev, g->num_ranks, g->rank, err, errlen))) {
    ncclDevCommDestroy(lsa_comm, &k->dev);
    free(k);
    return r;
  }
#ifdef EPD_TEST_HOOKS
  cudaError_t ce = preload(ht_route_kernel, ce_delay_kernel); /* the others: loaded by the attributes set */
#else
  cudaError_t ce = preload(ht_route_kernel); /* the others: loaded by the attributes set */
#endif
  {
    /* a device-to-device copy now, for what the copy-engine path's first one would load */
    void *t = NULL;
    if (ce == cudaSuccess) ce = cudaMalloc(&t, 64);
    if (ce == cudaSuccess) ce = cudaMemcpy((char *)t + 32, t, 32, cudaMemcpyDeviceToDevice);
    if (t) cudaFree(t);
  }
  if (ce == cudaSuccess)
    ce = cudaFuncSetAttribute(ht_dispatch_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)SMEM_MAX);
  if (ce == cudaSuccess)
    ce = cudaFuncSetAttribute(ht_dispatch_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)SMEM_MAX);
  if (ce == cudaSuccess)
    ce = cudaFuncSetAttribute(ht_combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX);
  for (int b = 0; b < EPD_NUM_BANKS && ce == cudaSuccess; b++)
    ce = cudaMemset(k->local + b * k->lay.bank_bytes, 0, k->lay.ctrl_bytes);
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    if (err && errlen) snprintf(err, errlen, "setting up the HT area: %s", cudaGetErrorString(ce));
    ncclDevCommDestroy(lsa_comm, &k->dev);
    free(k);
    return EPD_ERR_CUDA;
  }
  {
    /* a data kernel's blocks wait for every peer block's flags: all G must be resident at once (with the
     * most shared memory an op may take, one block per SM). A query that answers nothing checks nothing. */
    int dev = 0, nsm;
    cudaGetDevice(&dev);
    const int per_d = resident_per_sm(ht_dispatch_kernel<0>, dev, NTHR, SMEM_MAX, &nsm);
    const int per_f = resident_per_sm(ht_dispatch_kernel<1>, dev, NTHR, SMEM_MAX, &nsm);
    const int per_c = resident_per_sm(ht_combine_kernel, dev, NTHR, SMEM_MAX, &nsm);
    cudaGetLastError();
    const int per = per_d < per_c ? (per_d < per_f ? per_d : per_f) : (per_c < per_f ? per_c : per_f);
    if (nsm > 0 && per > 0 && (long)nsm * per < (long)k->g.blocks) {
      if (err && errlen)
        snprintf(err, errlen,
                 "HT blocks (engine.ht_sms) = %u exceeds the %d x %d blocks this GPU keeps resident",
                 k->g.blocks, nsm, per);
      ncclDevCommDestroy(lsa_comm, &k->dev);
      free(k);
      return EPD_ERR_INVALID;
    }
  }
  *out = k;
  return EPD_OK;
}

void epd_k_ht_destroy(epd_k_ht_t *k) {
  if (!k) return;
  ce_free(k);
  if (k->have_dev) ncclDevCommDestroy(k->comm, &k->dev);
  free(k);
}

epd_result_t epd_k_ht_reset(epd_k_ht_t *k, void *stream) {
  for (int b = 0; b < EPD_NUM_BANKS; b++) {
    cudaError_t ce =
        cudaMemsetAsync(k->local + b * k->lay.bank_bytes, 0, k->lay.ctrl_bytes, (cudaStream_t)stream);
    if (ce != cudaSuccess) return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

const epd_k_ht_geom_t *epd_k_ht_geom(const epd_k_ht_t *k) {
  return &k->g;
}

uint64_t epd_k_ht_ce_ops(const epd_k_ht_t *k) {
  return k ? k->ce_ops : 0;
}

#ifdef EPD_TEST_HOOKS
void epd_k_ht_test_ce_delay(epd_k_ht_t *k, uint32_t us) {
  if (k) k->ce_delay_us = us < 60000000u ? us : 60000000u;
}
#endif

epd_result_t epd_k_ht_launch(epd_k_ht_t *k, const epd_k_arena_t *arena, const epd_k_ht_op_t *op, void *stream,
                             char *err, size_t errlen) {
  if (!k || !arena || !op)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: NULL argument (%ld %ld)", "epd_k_ht_launch", 0, 0);
  if (op->bank >= EPD_NUM_BANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld out of range (max %ld)", "bank", op->bank,
                   EPD_NUM_BANKS - 1);
  if (op->op != EPD_OP_HT_DISPATCH && op->op != EPD_OP_HT_COMBINE)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld is not an HT op (%ld)", "op", op->op, 0);
  if (op->op == EPD_OP_HT_DISPATCH && !op->map)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: no expert map (%ld %ld)", "dispatch", 0, 0);
  HTParams p;
  memset(&p, 0, sizeof(p));
  params_from_ctx(p, k);
  p.C = k->g.capacity;
  p.flags = op->flags;
  p.T = op->num_tokens > 0xffffffu ? 0xffffffu : op->num_tokens; /* > M: reported on every rank */
  p.bank = op->bank;
  p.timeout_ns = op->timeout_ns ? op->timeout_ns : EPD_K_DEFAULT_TIMEOUT_NS;
  p.map = (const uint32_t *)op->map;
  p.slot_tokens = op->slot_tokens;
  p.comp = op->comp;
  p.arena = *arena;
  p.direct = 1;
  for (uint32_t r = 0; r < p.R; r++) {
    p.peer_arena[r] = r == p.rank ? arena->base : op->peer_arena[r];
    if (!p.peer_arena[r]) p.direct = 0;
  }
  p.tma = op->copy == EPD_K_HT_COPY_TMA;
  p.trace = op->trace;
  cudaStream_t s = (cudaStream_t)stream;
  if (op->op == EPD_OP_HT_DISPATCH) {
    uint32_t T = p.T > p.M ? 0 : p.T;
    p.dense = (p.flags & EPD_DESC_HT_DENSE) != 0;
    p.ce_any = p.dense && p.direct && !(p.flags & EPD_DESC_FP8) && op->copy == EPD_K_HT_COPY_CE;
    if (p.ce_any && T == p.T && op->rank_tokens[p.rank] == T && write_value64()) {
      /* the copy engines, unless a rank's count is off (its kernel reports it) or the rows overflow */
      uint64_t tot = 0;
      bool ok = true;
      for (uint32_t q = 0; q < p.R; q++) {
        tot += op->rank_tokens[q];
        ok &= op->rank_tokens[q] <= p.M;
      }
      p.ce = ok && tot <= p.C ? k->ce_split : 0u;
    }
    if (p.ce) {
      p.tma = 0;
      p.ce_seq = ++k->ce_seq;
      epd_result_t rc = ce_rows(k, p, op->rank_tokens, s, err, errlen);
      if (rc) return rc;
      k->ce_ops++;
    }
    plan_kernel_smem(p, true, (p.flags & EPD_DESC_FP8) != 0);
    ht_route_kernel<<<T ? (T + NWARP - 1) / NWARP : 1, NTHR, 0, s>>>(p);
    /* programmatic dependent launch: the data kernel's launch overlaps the route kernel */
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3(p.G);
    cfg.blockDim = dim3(NTHR);
    cfg.dynamicSmemBytes = p.sm.total;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    void (*const kern)(const HTParams) =
        (p.flags & EPD_DESC_FP8) ? ht_dispatch_kernel<1> : ht_dispatch_kernel<0>;
    if (cudaLaunchKernelEx(&cfg, kern, p) != cudaSuccess) {
      cudaGetLastError();
      kern<<<p.G, NTHR, p.sm.total, s>>>(p);
    }
    /* stream completion implies the copies' (the kernel waited for their flags; this keeps the order
     * on the stream for whatever follows, even after a timeout) */
    for (uint32_t r = 0; r < p.R && p.ce; r++)
      for (uint32_t i = 0; i < p.ce && r != p.rank; i++)
        if (cudaStreamWaitEvent(s, k->ce_join[r][i], 0) != cudaSuccess) break; /* reported below */
  } else {
    plan_kernel_smem(p, false, false);
    ht_combine_kernel<<<p.G, NTHR, p.direct ? p.sm.total : 0, s>>>(p);
  }
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) {
    if (err && errlen) snprintf(err, errlen, "HT kernel launch: %s", cudaGetErrorString(ce));
    return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

} /* extern "C" */
