/*
 * ll.cu - low-latency (LL) dispatch and combine on the NCCL 2.28 Device API (LSA over NVLink).
 *
 * Semantics: docs/SEMANTICS.md ("LL dispatch", "LL combine"). Launchers: epd_kernels.h.
 *
 * LL area of a rank's staging window, per bank (offsets in LLLayout, all 256-byte aligned):
 *   dflag [R][G] u64    dispatch arrival flag of (src rank, src block): seq << 32 | err << 24 | T_src
 *   cflag [R][G] u64    combine arrival flag of (expert rank, block): seq << 32
 *   meta  [R][M] Meta   routing of token (src, t) on this rank: n local entries (slot, weight), k order
 *   xstg  [R][M][2H]    token (src, t) as sent: BF16 row, or FP8 row (H bytes) + H/128 f32 scales
 *   cstg  [R][M][2H]    combine partial of my token t from expert rank d (BF16)
 *   --- private to this rank (never written by peers) ---
 *   cpos  [R][M][KMAX] i32  expert-major row of entry i of token (src, t) (for combine)
 *   rtok  [R] u32           tokens dispatched to the team by each src in this bank's last dispatch
 *   rmask [M] u64           ranks my token t was sent to in this bank's last dispatch
 *   st    BankState         per-block sequence numbers, completion ticket, error and totals
 *
 * Protocol of one op with G blocks on every rank: block b of every rank sends its share (tokens b,
 * b+G, ...), then stores its flag with release semantics into every rank; every block waits for the R*G
 * flags of the op (acquire, with a deadline from %globaltimer), then does its share of the receive work
 * (dispatch: expert slots b, b+G, ...; combine: tokens b, b+G, ...). The flag carries a per-block
 * sequence number kept in device memory, so no host counter is needed and graph replay works. The last
 * block to finish (a ticket counter) writes the completion record.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stdio.h>
#include <string.h>

#include "epd_dev.cuh"
#include "epd_kernels.h"

using namespace epd_dev;

namespace {

constexpr int KMAX = EPD_K_MAX_TOPK;
constexpr int NTHR = EPD_K_LL_THREADS;
constexpr int NWARP = NTHR / 32;

enum : uint32_t { ERRB_BAD_EXPERT = 1u, ERRB_TOO_MANY = 2u, ERRB_BAD_MAP = 4u };

struct __align__(16) Meta {
  int32_t n;
  int16_t slot[KMAX];
  float w[KMAX];
  int32_t pad[7];
};
static_assert(sizeof(Meta) == 128, "Meta is 128 bytes");

struct BankState {
  uint32_t seq[2][EPD_K_LL_MAX_BLOCKS]; /* [op: 0 dispatch, 1 combine][block] */
  uint32_t done[2];                     /* completion tickets */
  int32_t err[2], errpeer[2];
  uint32_t total; /* dispatch: rows received, summed over blocks */
  uint32_t ntok;  /* my tokens in the last dispatch */
  int32_t derr;   /* status of the last dispatch (combine refuses to run after a failed one) */
  uint32_t pad;
};

struct LLLayout {
  uint64_t bank_bytes;
  uint64_t dflag, cflag, meta, xstg, cstg, cpos, rtok, rmask, st;
  uint64_t ann;        /* after both banks: persistent-mode announcement word of each rank [R] u64 */
  uint64_t area_bytes; /* whole LL area: both banks and the announcement area */
};

/* Device scratch of a persistent kernel (zeroed before each launch). The controller releases op `index`
 * to the body blocks as a record of tagged words: word i = (uint32)(index + 1) << 32 | payload i, each an
 * 8-byte store, so a block that polls the record (a lane per word) and sees every tag equal knows every
 * payload word is this op's: one round trip instead of a flag and then the record. Payload words:
 * [0..15] the descriptor, [PR_SLOT] slot | run << 16 (run 0: stop), [PR_REPVER] map version the completion
 * reports, [PR_T0..+1] slot seen SUBMITTED, [PR_T1..+1] op released (%globaltimer, low/high). One record
 * suffices: the controller writes the next one only once the op's last block completed it. */
enum { PR_SLOT = 16, PR_REPVER = 17, PR_T0 = 18, PR_T1 = 20, PR_WORDS = 22 };
/* The tag of op `index`'s record words: never 0 (the zeroed record's) and never the previous index's. */
__device__ __forceinline__ uint32_t rec_tag(uint64_t index) {
  return ((uint32_t)(index + 1) & 0x7fffffffu) | 0x80000000u;
}
static_assert(sizeof(epd_desc_t) == 64, "the descriptor is words 0..15 of the release record");
static_assert(PR_WORDS + EPD_K_MAX_RANKS <= 32, "the controller's announcing lanes follow the record's");
struct PDev {
  uint64_t rec[32];    /* the release record (PR_WORDS used) */
  uint64_t agree;      /* (index + 1) << 1 | run: every rank announced the same op (or they stop) */
  uint64_t tagreed[2]; /* %globaltimer when every rank agreed on an even / odd op (the progress record's
                        * timeline: op n's last block reads it after op n + 1 may have been released) */
  uint64_t done_ops;   /* ops whose completion (slot DONE) is written */
  int32_t last_err;
  uint32_t pad0[9];
  uint64_t trace[2][8]; /* block 0's stamps of even / odd ops (LLParams.trace; as tagreed) */
};
static_assert(sizeof(PDev) <= 512, "PDev fits the scratch");

/* The host's abort word of a persistent kernel (epd_k_pctl_t.abort, host-mapped: a PCIe read, so callers
 * poll it only now and then); non-zero (1 + rank): stop. */
__device__ __forceinline__ uint32_t host_abort(const epd_k_pctl_t *ctl) {
  return *(volatile const uint32_t *)&ctl->abort;
}

struct LLParams {
  ncclWindow_t win;
  uint64_t win_off;            /* LL area offset in the window */
  char *local;                 /* LL area, local address */
  char *peer[EPD_K_MAX_RANKS]; /* LL area of each LSA rank (ncclGetLsaPointer, computed once at create:
                                * in the kernels it was a dependent load of the window before a store) */
  LLLayout lay;
  uint32_t R, rank, E, H, K, M, S, G;
  uint64_t timeout_ns;
  const uint32_t *map;
  uint64_t *slot_tokens;
  uint64_t *trace;
  epd_k_arena_t arena;
  /* persistent mode (pdev != NULL): constant for one launch */
  PDev *pdev;
  const epd_k_pctl_t *ctl; /* abort word of the flag waits */
  epd_k_pprog_t *prog;
  epd_queue_t *pq;
  uint64_t psteps0;
  uint32_t pguard_all; /* epd_k_persist_t.guard_all */
};

/* What changes from op to op (a kernel parameter of its own, or registers of the persistent kernel: the
 * constant part stays in the parameter space, which costs the op bodies no registers). */
struct LLOp {
  uint32_t flags, T, bank;
  uint32_t prepver; /* persistent: map version the completion reports */
  epd_comp_t *comp;
  uint32_t *done_state; /* persistent mode: the slot state word set to EPD_SLOT_DONE by the last block */
  epd_slot_t *dslot;    /* persistent mode: the slot's device twin, completed as well */
  uint64_t user_tag;
  uint64_t popn, pstep, pt0, pt1, psub; /* persistent: op number, group step, seen/released/submit times */
  uint64_t pidx;                        /* persistent: the op's agreement index */
  uint32_t pop;                         /* persistent: EPD_OP_LL_DISPATCH or EPD_OP_LL_COMBINE */
};

/* Stamp i of op o: the persistent kernel keeps two ops' stamps (PDev.trace), the standalone one op's. */
__device__ __forceinline__ uint32_t trace_at(const LLParams &p, const LLOp &o, uint32_t i) {
  return p.pdev ? (uint32_t)(o.popn & 1) * 8u + i : i;
}
#define TRACE(i)                                                                               \
  do {                                                                                         \
    if (p.trace && blockIdx.x == 0 && threadIdx.x == 0) p.trace[trace_at(p, o, i)] = gtimer(); \
  } while (0)

/* Extra stamps 8..15 of the standalone kernels, in profiling builds only (-DEPD_LL_FINE_TRACE: the bench's
 * trace buffer then holds 16 stamps per op). */
#ifdef EPD_LL_FINE_TRACE
#define FTRACE(i)                                                                         \
  do {                                                                                    \
    if (p.trace && !p.pdev && blockIdx.x == 0 && threadIdx.x == 0) p.trace[i] = gtimer(); \
  } while (0)
/* The latest block's stamp i (every block, atomicMax: the bench zeroes the trace once, and a later op's
 * times are larger): with block 0's own stamps it shows how far the slowest block lags. */
#define FTRACE_LATEST(i)                                                          \
  do {                                                                            \
    if (p.trace && !p.pdev && threadIdx.x == 0)                                   \
      atomicMax((unsigned long long *)&p.trace[i], (unsigned long long)gtimer()); \
  } while (0)
#else
#define FTRACE(i) \
  do {            \
  } while (0)
#define FTRACE_LATEST(i) \
  do {                   \
  } while (0)
#endif

/* Persistent mode: an op's body starts as soon as this rank's controller saw its slot, before every rank
 * agreed on it; the part before the first store into a peer (dispatch: the first token's loads and
 * routing; combine: the sums of this rank's own tokens) overlaps the agreement, and the body waits here
 * before that store. One thread polls the
 * controller's verdict: 1 run it, 0 stop (the body returns without a trace in any peer). The controller
 * gives a verdict within 4 x timeout_ns; the deadline here is a guard against a dead controller only. */
__device__ __forceinline__ int persist_verdict(const LLParams &p, const LLOp &o) {
  const uint64_t want = o.pidx + 1, deadline = gtimer() + 8 * p.timeout_ns + 1000000000ull;
  for (;;) {
    const uint64_t g = ld_acquire_gpu_u64(&p.pdev->agree);
    if ((g >> 1) == want) return (int)(g & 1);
    if (gtimer() > deadline) return 0;
    __nanosleep(32);
  }
}
/* A verdict word loaded ahead (its latency hidden behind the op's own loads) that already holds the
 * op's verdict: 1 run, 0 stop; -1: not yet. */
__device__ __forceinline__ int verdict_of(const LLOp &o, uint64_t pre) {
  return (pre >> 1) == o.pidx + 1 ? (int)(pre & 1) : -1;
}
/* Whole block: the verdict; `pre` is thread 0's early load of the verdict word. */
__device__ __forceinline__ bool persist_gate(const LLParams &p, const LLOp &o, uint64_t pre) {
  __shared__ int sh_verdict;
  if (threadIdx.x == 0) {
    const int v = verdict_of(o, pre);
    sh_verdict = v >= 0 ? v : persist_verdict(p, o);
  }
  __syncthreads();
  return sh_verdict != 0;
}

/* Base of bank b of rank `peer`'s LL area (peer == rank gives the local address). */
__device__ __forceinline__ char *peer_bank(const LLParams &p, const LLOp &o, int peer) {
  return p.peer[peer] + o.bank * p.lay.bank_bytes;
}
__device__ __forceinline__ char *local_bank(const LLParams &p, const LLOp &o) {
  return p.local + o.bank * p.lay.bank_bytes;
}
template <typename T>
__device__ __forceinline__ T *arena_buf(const LLParams &p, const LLOp &o, int kind) {
  return (T *)(uintptr_t)(p.arena.base + p.arena.off[o.bank][kind]);
}

/* Shared state of one block's wait. */
struct WaitResult {
  uint32_t T[EPD_K_MAX_RANKS];
  uint32_t errbits[EPD_K_MAX_RANKS];
  int timeout_src; /* lowest rank whose flag did not arrive, or INT_MAX */
  int abort_peer;  /* persistent mode: the host's abort word (1 + rank) seen while waiting, or 0 */
};

/* Wait (whole block) for the R*G flags `flags[src][g]` of sequence `seq`, until `deadline`. */
__device__ void wait_flags(const LLParams &p, const uint64_t *flags, uint32_t seq, uint64_t deadline,
                           WaitResult *wr) {
  if (threadIdx.x < EPD_K_MAX_RANKS) {
    wr->T[threadIdx.x] = 0;
    wr->errbits[threadIdx.x] = 0;
  }
  if (threadIdx.x == 0) {
    wr->timeout_src = 0x7fffffff;
    wr->abort_peer = 0;
  }
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < p.R * p.G; i += blockDim.x) {
    uint32_t src = i / p.G, g = i % p.G;
    uint64_t v;
    bool ok = false;
    for (uint32_t n = 1;; n++) {
      v = ld_acquire_sys(flags + i);
      if ((uint32_t)(v >> 32) == seq) {
        ok = true;
        break;
      }
      if (gtimer() > deadline) break;
      if (p.ctl && (n & 255) == 0) { /* host-mapped: a PCIe read, so only now and then */
        uint32_t ab = host_abort(p.ctl);
        if (ab) {
          atomicCAS(&wr->abort_peer, 0, (int)ab);
          break;
        }
      }
    }
    if (!ok) {
      atomicMin(&wr->timeout_src, (int)src);
    } else {
      if (g == 0) wr->T[src] = (uint32_t)(v & 0xffffffu);
      uint32_t eb = (uint32_t)(v >> 24) & 0xffu;
      if (eb) atomicOr(&wr->errbits[src], eb);
    }
  }
  __syncthreads();
}

/* Status of an op from a wait: (code, peer). Same on every rank for input errors. */
__device__ void wait_status(const LLParams &p, const WaitResult *wr, int *code, int *peer) {
  *code = 0;
  *peer = -1;
  for (uint32_t s = 0; s < p.R; s++) {
    uint32_t eb = wr->errbits[s];
    if (eb) {
      *code = (eb & ERRB_TOO_MANY)     ? EPD_ERR_TOO_MANY_TOKENS
              : (eb & ERRB_BAD_EXPERT) ? EPD_ERR_BAD_EXPERT
                                       : EPD_ERR_INVALID;
      *peer = (int)s;
      return;
    }
  }
  if (wr->abort_peer) {
    *code = EPD_ERR_PEER;
    *peer = wr->abort_peer - 1;
  } else if (wr->timeout_src != 0x7fffffff) {
    *code = EPD_ERR_TIMEOUT;
    *peer = wr->timeout_src;
  }
}

/* Block epilogue: record the block's outcome; the last block writes the completion record. */
__device__ void finish_block(const LLParams &p, const LLOp &o, BankState *st, int opi, uint32_t seq, int code,
                             int peer, uint32_t add_total, int is_dispatch) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (p.trace && blockIdx.x == 0) p.trace[trace_at(p, o, 6)] = gtimer();
  if (add_total) atomicAdd(&st->total, add_total);
  if (code != 0 && atomicCAS(&st->err[opi], 0, code) == 0) atomicExch(&st->errpeer[opi], peer);
  st->seq[opi][blockIdx.x] = seq;
  __threadfence();
  uint32_t ticket = atomicAdd(&st->done[opi], 1u);
  if (ticket != p.G - 1) return;
  __threadfence();
  /* persistent: the map version for the queue header, loaded with the atomics below (loaded where it is
   * stored, it delayed the completion by a round trip) */
  const uint32_t mapv_now = p.pdev ? __ldcg(p.map) : 0u;
  int c = atomicAdd(&st->err[opi], 0);
  int pe = atomicAdd(&st->errpeer[opi], 0);
  uint32_t total = atomicAdd(&st->total, 0u);
  if (is_dispatch) {
    st->derr = c;
    st->total = 0;
  }
  st->err[opi] = 0;
  st->errpeer[opi] = -1;
  st->done[opi] = 0;
  if (p.trace) p.trace[trace_at(p, o, 7)] = gtimer();
  volatile epd_comp_t *comp = o.comp;
  if (!p.pdev) {
    if (comp) {
      comp->status = c;
      comp->peer = c ? pe : -1;
      if (is_dispatch) comp->num_recv = c ? 0u : total;
      if (is_dispatch && p.map) comp->map_version = __ldcg(p.map);
    }
    __threadfence_system();
#ifdef EPD_LL_FINE_TRACE
    if (p.trace) p.trace[15] = gtimer();
#endif
    return;
  }
  /* persistent: the whole record in both copies of the slot (the client reads it from the copy whose
   * DONE it saw), the queue header, then the host copy's DONE and the twin's, each after a GPU-scope fence.
   * No system fence on this path: the two it had waited for the PCIe writes before them (1.5-2.5 us per op
   * as the client sees it, measured in-process with epd-bench EPD_BENCH_PERSIST, 2x H100). */
  epd_comp_t cv;
  memset(&cv, 0, sizeof cv);
  cv.status = c;
  cv.peer = c ? pe : -1;
  cv.map_version = o.prepver; /* a combine reports its bank's dispatch version */
  cv.num_recv = is_dispatch && !c ? total : 0u;
  cv.step = o.pstep;
  cv.user_tag = o.user_tag;
  cv.latency_ns = gtimer() - o.pt0;
  for (int i = 0; i < (int)(sizeof(epd_comp_t) / 8); i++) {
    const uint64_t w = ((const uint64_t *)&cv)[i];
    ((volatile uint64_t *)comp)[i] = w;
    if (o.dslot) ((volatile uint64_t *)&o.dslot->comp)[i] = w;
  }
  /* The client writes the host copy after the twin: DONE must not land before its SUBMITTED (the launch
   * mode would run the op again). Both are posted writes from this GPU, the client's issued before this
   * kernel saw the twin; under MPS (clients run beside this kernel, never time-sliced out between their
   * two writes) only an op completing within microseconds of that could overtake it, so only then is the
   * host copy read (a PCIe round trip: 1.2 us on block 0 when it was read for every op). Without MPS every
   * op checks it. */
  if (p.pguard_all || gtimer() - o.pt0 < 10000) {
    const uint64_t dl = gtimer() + 1000000;
    while (*(volatile const uint32_t *)o.done_state != EPD_SLOT_SUBMITTED && gtimer() < dl) {
    }
  }
  volatile epd_queue_t *q = p.pq;
  if (c && q->sticky_error == 0) q->sticky_error = c;
  q->map_version = mapv_now;
  q->steps_done = p.psteps0 + o.popn + 1;
  /* The record and header before the host copy's DONE (a waiter that sees that DONE first may read the
   * record from the host copy), and the host copy's DONE before the twin's (the launch requires a twin): a
   * waiter that saw the twin's frees the host copy, and that FREE must come after this DONE (else the slot
   * would stay DONE). Every waiter runs on this GPU (the arena and its twin are granted to this device only)
   * and acquires the DONE it saw (epd_device.h), so GPU-scope fences order these; the CPU reads the host
   * copy's record only after the waiter's kernel (or this one) has finished. */
  __threadfence();
  *(volatile uint32_t *)o.done_state = EPD_SLOT_DONE;
  __threadfence();
  *(volatile uint32_t *)&o.dslot->state = EPD_SLOT_DONE;
  *(volatile int32_t *)&p.pdev->last_err = c;
  st_release_gpu_u64(&p.pdev->done_ops, o.popn + 1);
  volatile epd_k_prec_t *rec = &p.prog->rec[o.popn % EPD_K_PREC];
  rec->op = is_dispatch ? EPD_OP_LL_DISPATCH : EPD_OP_LL_COMBINE;
  rec->status = c;
  rec->peer = c ? pe : -1;
  rec->num_recv = is_dispatch && !c ? total : 0u;
  const uint64_t tn = gtimer();
  rec->latency_ns = tn - o.pt0;
  rec->seq = o.popn + 1;
  rec->seen_ns = o.psub && o.psub < o.pt0 ? (uint32_t)(o.pt0 - o.psub) : 0u;
  const uint64_t tagreed = *(volatile const uint64_t *)&p.pdev->tagreed[o.pidx & 1];
  rec->agree_ns = tagreed > o.pt0 ? (uint32_t)(tagreed - o.pt0) : 0u;
  rec->run_ns = tn > tagreed ? (uint32_t)(tn - tagreed) : 0u;
  for (int i = 0; i < 8; i++) {
    const uint64_t t = *(volatile const uint64_t *)&p.trace[trace_at(p, o, i)];
    rec->phase_ns[i] = t > o.pt1 ? (uint32_t)(t - o.pt1) : 0u;
  }
  __threadfence_system();
  *(volatile uint64_t *)&p.prog->ops = o.popn + 1;
}

/* ---------------------------------------------------------------------------------------------------
 * Dispatch body (block `blockIdx.x` of G).
 * ------------------------------------------------------------------------------------------------- */
/* PERS: in the persistent kernel. Returns false (PERS only) when the ranks did not agree on the op:
 * nothing was sent. */
template <bool PERS>
__device__ bool ll_dispatch_body(const LLParams &p, const LLOp &o) {
  __shared__ Meta sh_meta[EPD_K_MAX_RANKS];
  __shared__ uint32_t sh_err;
  __shared__ WaitResult wr;
  __shared__ uint32_t sh_wc[NWARP];
  __shared__ int2 sh_list[NTHR];
  __shared__ uint32_t sh_tstart[EPD_K_MAX_RANKS + 1];
  __shared__ float sh_scale[EPD_K_MAX_HIDDEN / 128];

  FTRACE(8);
  const uint32_t R = p.R, H = p.H, K = p.K, M = p.M, S = p.S, G = p.G, rank = p.rank;
  const bool fp8 = (o.flags & EPD_DESC_FP8) != 0;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  char *lb = local_bank(p, o);
  BankState *st = (BankState *)(lb + p.lay.st);

  /* seq is a per-thread register: its load overlaps the send instead of delaying it */
  const uint32_t seq = __ldcg(&st->seq[0][blockIdx.x]) + 1;
  if (tid == 0) sh_err = 0;
  __syncthreads();
  TRACE(0);
  uint32_t T = o.T;
  if (T > M) {
    T = 0;
    if (tid == 0) sh_err |= ERRB_TOO_MANY;
  }

  const __nv_bfloat16 *x = arena_buf<__nv_bfloat16>(p, o, EPD_BUF_X);
  const int64_t *topk = arena_buf<int64_t>(p, o, EPD_BUF_TOPK_IDX);
  bool gated = !PERS; /* persistent: the verdict is awaited before the first remote store */
  uint64_t vpre = 0;  /* persistent: thread 0's early load of the verdict word */
  uint64_t tmask = 0; /* thread 0: the ranks the current token goes to */
  const float *topw = arena_buf<float>(p, o, EPD_BUF_TOPK_WEIGHTS);
  uint64_t *rmask = (uint64_t *)(lb + p.lay.rmask);
  const uint32_t map_E = p.map[1];
  const uint32_t *map_nrep = p.map + 4;
  const uint32_t *map_rep = p.map + 4 + map_E;
  const uint64_t rowbytes = 2ull * H;

  /* ---- send: each token once per destination rank ---- */
  constexpr int XV = (EPD_K_MAX_HIDDEN / 8 + NTHR - 1) / NTHR;     /* BF16 vectors per thread */
  constexpr int XG = (EPD_K_MAX_HIDDEN / 128 + NWARP - 1) / NWARP; /* FP8 groups per warp */
  static_assert(XG <= 2 * XV, "the FP8 groups fit the BF16 vectors' registers");
  for (uint32_t t = blockIdx.x; t < T; t += G) {
    /* the token's row is loaded first, so its latency overlaps the routing's dependent loads */
    /* one register array for both layouts (BF16: XV int4 vectors; FP8: XG uint2 halves of them): two
     * arrays were both live across the routing, 16 registers more */
    int4 xb[XV];
    if (fp8) {
#pragma unroll
      for (int j = 0; j < XG; j++) {
        uint32_t g = warp + j * NWARP;
        if (g < H / 128) {
          const uint2 v = __ldcg((const uint2 *)(x + (uint64_t)t * H + g * 128 + lane * 4));
          if (j & 1) {
            xb[j >> 1].z = (int)v.x;
            xb[j >> 1].w = (int)v.y;
          } else {
            xb[j >> 1].x = (int)v.x;
            xb[j >> 1].y = (int)v.y;
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < XV; j++) {
        uint32_t v = tid + j * NTHR;
        if (v < H / 8) xb[j] = __ldcg((const int4 *)(x + (uint64_t)t * H) + v);
      }
    }
    if (warp == 0) {
      int64_t e = -1;
      float w = 0.f;
      if (lane < K) {
        e = __ldcg(topk + (uint64_t)t * K + lane);
        w = __ldcg(topw + (uint64_t)t * K + lane);
      }
      bool bad = lane < K && (e < -1 || e >= (int64_t)p.E);
      FTRACE(9);
      bool valid = lane < K && e >= 0 && e < (int64_t)p.E;
      for (uint32_t j = 0; j < K; j++) {
        int64_t ej = __shfl_sync(0xffffffffu, e, j);
        if (j < lane && ej == e) valid = false; /* a duplicate expert is ignored */
      }
      const bool counted = valid; /* the token's valid entries (renormalisation's whole) */
      bool lost = false;          /* an entry dropped: its expert has no live replica */
      /* persistent: the verdict word loaded with the expert map (one round trip after the release, as
       * late as the routing allows: the ranks have mostly agreed by then) */
      if (PERS && !gated && lane == 0) vpre = *(volatile const uint64_t *)&p.pdev->agree;
      uint32_t d = 0xffffffffu, s = 0;
      if (valid) {
        if (e >= (int64_t)map_E) {
          valid = false;
          bad = true;
        } else {
          uint32_t nrep = __ldcg(map_nrep + e), reps[EPD_K_MAX_REPLICAS];
#pragma unroll
          for (int j = 0; j < EPD_K_MAX_REPLICAS; j++)
            reps[j] = __ldcg(map_rep + (uint64_t)e * EPD_K_MAX_REPLICAS + j);
          if (nrep == 0) {
            valid = false; /* no live replica (a map without masked ranks): the entry is dropped */
            lost = true;
          } else if (nrep > EPD_K_MAX_REPLICAS) {
            valid = false;
            atomicOr(&sh_err, ERRB_BAD_MAP);
          } else {
            uint32_t i = (uint32_t)(((uint64_t)rank * M + t) % nrep);
            uint32_t rep = reps[0];
#pragma unroll
            for (int j = 1; j < EPD_K_MAX_REPLICAS; j++)
              if ((uint32_t)j == i) rep = reps[j];
            d = rep >> 16;
            s = rep & 0xffffu;
            if (d >= R || s >= S) {
              valid = false;
              atomicOr(&sh_err, ERRB_BAD_MAP);
            }
          }
        }
      }
      if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(&sh_err, ERRB_BAD_EXPERT);
      if ((o.flags & EPD_K_RENORMALIZE) && __any_sync(0xffffffffu, lost))
        w *= renorm_factor(counted, valid, w);
      uint64_t mask = 0;
      for (uint32_t r = 0; r < R; r++) {
        uint32_t m = __ballot_sync(0xffffffffu, valid && d == r);
        if (valid && d == r) {
          uint32_t pos = __popc(m & ((1u << lane) - 1u));
          sh_meta[r].slot[pos] = (int16_t)s;
          sh_meta[r].w[pos] = w;
        }
        if (lane == 0) sh_meta[r].n = __popc(m);
        if (m) mask |= 1ull << r;
      }
      if (lane == 0) tmask = mask; /* stored after the gate: a dispatch that does not run leaves no trace */
      FTRACE(10);
    }
    __syncthreads();
    FTRACE(11);
    if (!gated) {
      if (!persist_gate(p, o, vpre)) return false;
      gated = true;
    }
    if (tid == 0) rmask[t] = tmask;
    /* token data to every destination rank that has an entry */
    const uint64_t row_off = p.lay.xstg + ((uint64_t)rank * M + t) * rowbytes;
    if (fp8) {
#pragma unroll
      for (int jg = 0; jg < XG; jg++) {
        uint32_t g = warp + jg * NWARP;
        if (g >= H / 128) break;
        const uint2 raw = (jg & 1) ? make_uint2((uint32_t)xb[jg >> 1].z, (uint32_t)xb[jg >> 1].w)
                                   : make_uint2((uint32_t)xb[jg >> 1].x, (uint32_t)xb[jg >> 1].y);
        float v0 = bf16_to_f(raw.x & 0xffff), v1 = bf16_to_f(raw.x >> 16);
        float v2 = bf16_to_f(raw.y & 0xffff), v3 = bf16_to_f(raw.y >> 16);
        float scale;
        const uint32_t q = fp8_group_warp(v0, v1, v2, v3, &scale);
        for (uint32_t r = 0; r < R; r++) {
          if (sh_meta[r].n == 0) continue;
          *(uint32_t *)(peer_bank(p, o, r) + row_off + g * 128 + lane * 4) = q;
        }
        /* the scales go out together below: one 4-byte NVLink write per group was a packet each */
        if (lane == 0) sh_scale[g] = scale;
      }
    } else {
#pragma unroll
      for (int j = 0; j < XV; j++) {
        uint32_t v = tid + j * NTHR;
        if (v >= H / 8) break;
        int4 val = xb[j];
        for (uint32_t r = 0; r < R; r++) {
          if (sh_meta[r].n == 0) continue;
          ((int4 *)(peer_bank(p, o, r) + row_off))[v] = val;
        }
      }
    }
    FTRACE(12);
    if (fp8) {
      __syncthreads();
      const uint32_t nsc = H / 128;
      for (uint32_t i = tid; i < R * nsc; i += NTHR) {
        const uint32_t r = i / nsc, g = i % nsc;
        if (sh_meta[r].n) *(float *)(peer_bank(p, o, r) + row_off + H + g * 4) = sh_scale[g];
      }
    }
    /* routing metadata to every rank (n == 0 where the token does not go) */
    if (tid < R * 8) {
      uint32_t r = tid / 8, part = tid % 8;
      int4 *dst = (int4 *)(peer_bank(p, o, r) + p.lay.meta + ((uint64_t)rank * M + t) * sizeof(Meta));
      dst[part] = ((const int4 *)&sh_meta[r])[part];
    }
    __syncthreads();
  }

  if (!gated && !persist_gate(p, o, vpre)) return false;
  /* ---- signal every rank: this block's share has landed ----
   * bar.sync orders every thread's stores before thread 0's system-scope fence (cumulativity), so one
   * fence per block suffices; a fence in every thread serialises per warp and cost ~15 us. */
  __syncthreads();
  TRACE(1);
  if (tid == 0) {
    __threadfence_system(); /* with the relaxed stores below: a release pattern of thread 0 */
    TRACE(2);
    uint64_t v = ((uint64_t)seq << 32) | ((uint64_t)(sh_err & 0xffu) << 24) | (uint64_t)T;
    for (uint32_t r = 0; r < R; r++)
      st_relaxed_sys((uint64_t *)(peer_bank(p, o, r) + p.lay.dflag) + (uint64_t)rank * G + blockIdx.x, v);
  }

  TRACE(3);
  /* ---- receive: wait for every block of every rank (the timeout counts from here: in persistent mode
   * the body starts before the ranks agree) ---- */
  wait_flags(p, (const uint64_t *)(lb + p.lay.dflag), seq, gtimer() + p.timeout_ns, &wr);
  TRACE(4);
  int code, peer;
  wait_status(p, &wr, &code, &peer);
  uint32_t block_total = 0;
  if (code == 0) {
    if (tid == 0) {
      uint32_t a = 0;
      for (uint32_t r = 0; r < R; r++) {
        sh_tstart[r] = a;
        a += wr.T[r];
      }
      sh_tstart[R] = a;
    }
    if (blockIdx.x == 0 && tid < R) ((uint32_t *)(lb + p.lay.rtok))[tid] = wr.T[tid];
    if (blockIdx.x == 0 && tid == 0) st->ntok = T;
    __syncthreads();
    const uint32_t N = sh_tstart[R];
    const uint64_t RM = (uint64_t)R * M;
    char *recv_x = arena_buf<char>(p, o, EPD_BUF_LL_RECV_X);
    float *recv_sc = fp8 ? arena_buf<float>(p, o, EPD_BUF_LL_RECV_SCALES) : nullptr;
    int32_t *recv_src = arena_buf<int32_t>(p, o, EPD_BUF_LL_RECV_SRC);
    int32_t *recv_cnt = arena_buf<int32_t>(p, o, EPD_BUF_LL_RECV_COUNT);
    int32_t *cpos = (int32_t *)(lb + p.lay.cpos);
    const Meta *meta = (const Meta *)(lb + p.lay.meta);
    const char *xstg = lb + p.lay.xstg;
    const uint32_t nsc = H / 128;
    for (uint32_t s = blockIdx.x; s < S; s += G) {
      uint32_t base = 0;
      for (uint32_t c0 = 0; c0 < N; c0 += NTHR) {
        uint32_t u = c0 + tid;
        int mi = -1;
        uint32_t src = 0, t = 0;
        if (u < N) {
          while (src + 1 < R && u >= sh_tstart[src + 1]) src++;
          t = u - sh_tstart[src];
          const Meta *m = meta + (uint64_t)src * M + t;
          /* n and the KMAX slots (int16 pairs in words 1..8 of the Meta), compared with constant indices
           * only: a register array indexed at run time lived in local memory (a 48-byte stack frame) */
          static_assert(KMAX == 16, "the scan reads n and 16 slots: words 0..8 of the Meta");
          const int4 h0 = __ldcg((const int4 *)m), h1 = __ldcg((const int4 *)m + 1);
          const int32_t h8 = __ldcg((const int32_t *)m + 8);
          const uint32_t sw[8] = {(uint32_t)h0.y, (uint32_t)h0.z, (uint32_t)h0.w, (uint32_t)h1.x,
                                  (uint32_t)h1.y, (uint32_t)h1.z, (uint32_t)h1.w, (uint32_t)h8};
          const int n = h0.x;
#pragma unroll
          for (int i = 0; i < KMAX; i++)
            if (i < n && ((sw[i >> 1] >> (16 * (i & 1))) & 0xffffu) == s) mi = i;
        }
        uint32_t bal = __ballot_sync(0xffffffffu, mi >= 0);
        if (lane == 0) sh_wc[warp] = __popc(bal);
        __syncthreads();
        uint32_t pre = 0, tot = 0;
        for (uint32_t w2 = 0; w2 < NWARP; w2++) {
          if (w2 < warp) pre += sh_wc[w2];
          tot += sh_wc[w2];
        }
        pre += __popc(bal & ((1u << lane) - 1u));
        if (mi >= 0) {
          uint32_t pos = base + pre;
          recv_src[(uint64_t)s * RM + pos] = EPD_SRC_PACK(src, t);
          cpos[((uint64_t)src * M + t) * KMAX + mi] = (int32_t)pos;
          sh_list[pre] = make_int2((int)(src * M + t), (int)pos);
        }
        __syncthreads();
        FTRACE(13);
        /* expand: the block's threads share the vectors of all `tot` rows (and their FP8 scales, which
         * follow the row in xstg), 8 loads in flight per thread before the stores: one round trip for
         * ~8 FP8 rows, where a warp per row took two plus one for the scales */
        {
          const uint32_t nvr = fp8 ? H / 16 : H / 8;
          const uint32_t nsv = fp8 && nsc % 4 == 0 ? nsc / 4 : 0u;
          const uint32_t per = nvr + nsv, nwork = tot * per;
          for (uint32_t w0 = tid; w0 < nwork; w0 += NTHR * 8) {
            int4 buf[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
              const uint32_t idx = w0 + j * NTHR;
              if (idx < nwork) {
                const uint32_t li = idx / per, v = idx - li * per;
                buf[j] = __ldcg((const int4 *)(xstg + (uint64_t)sh_list[li].x * 2 * H) + v);
              }
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
              const uint32_t idx = w0 + j * NTHR;
              if (idx < nwork) {
                const uint32_t li = idx / per, v = idx - li * per;
                const uint64_t row = (uint64_t)s * RM + sh_list[li].y;
                if (v < nvr)
                  ((int4 *)(recv_x + row * 2 * H))[v] = buf[j];
                else
                  ((int4 *)(recv_sc + row * nsc))[v - nvr] = buf[j];
              }
            }
          }
          if (fp8 && nsv == 0)
            for (uint32_t li = warp; li < tot; li += NWARP) {
              const int2 e = sh_list[li];
              for (uint32_t v = lane; v < nsc; v += 32)
                recv_sc[((uint64_t)s * RM + e.y) * nsc + v] =
                    __ldcg((const float *)(xstg + (uint64_t)e.x * 2 * H + H) + v);
            }
        }
        FTRACE(14);
        base += tot;
        __syncthreads();
      }
      if (tid == 0) {
        recv_cnt[s] = (int32_t)base;
        if (p.slot_tokens) p.slot_tokens[s] += base;
      }
      block_total += base;
    }
  }
  TRACE(5);
  finish_block(p, o, st, 0, seq, code, peer, block_total, 1);
  return true;
}

/* ---------------------------------------------------------------------------------------------------
 * Combine body.
 * ------------------------------------------------------------------------------------------------- */
/* NB: rows of y in flight per lane (two int4 each): 8 in the combine kernel; fewer in the persistent
 * kernel, whose loop leaves the body fewer registers (at 8 it spilled, ptxas -v). */
template <int NB, bool PERS, int HV = 2>
__device__ bool ll_combine_body(const LLParams &p, const LLOp &o) {
  __shared__ WaitResult wr;
  __shared__ uint32_t sh_tstart[EPD_K_MAX_RANKS + 1];

  FTRACE(8);
  const uint32_t R = p.R, H = p.H, M = p.M, G = p.G, rank = p.rank;
  const uint32_t tid = threadIdx.x;
  char *lb = local_bank(p, o);
  BankState *st = (BankState *)(lb + p.lay.st);
  const uint32_t seq = __ldcg(&st->seq[1][blockIdx.x]) + 1;
  const uint32_t lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    uint32_t a = 0;
    const uint32_t *rtok = (const uint32_t *)(lb + p.lay.rtok);
    for (uint32_t r = 0; r < R; r++) {
      sh_tstart[r] = a;
      a += __ldcg(rtok + r);
    }
    sh_tstart[R] = a;
  }
  __syncthreads();
  TRACE(0);
  /* persistent: thread 0's early load of the verdict word, used at the gate after the own tokens */
  const uint64_t vpre = PERS && tid == 0 ? *(volatile const uint64_t *)&p.pdev->agree : 0ull;
  const int derr = __ldcg(&st->derr);
  const uint64_t RM = (uint64_t)R * M;
  const uint32_t nv = H / 8;

  /* ---- expert side: one weighted f32 sum per received (src, t), sent back as BF16 once ---- */
  if (derr == 0) {
    const Meta *meta = (const Meta *)(lb + p.lay.meta);
    const int32_t *cpos = (const int32_t *)(lb + p.lay.cpos);
    const char *y = arena_buf<char>(p, o, EPD_BUF_LL_Y);
    const uint32_t N = sh_tstart[R];
    /* work items of (received token, 64-vector chunk of H), one per warp: a token's meta, rows and
     * weights are loaded by the lanes in parallel, then 2 x n rows of loads are in flight per lane.
     * This rank's own tokens first (phase 0: their sums stay on this GPU), then the peers' (phase 1): the
     * persistent kernel runs phase 0 while the ranks agree, and takes the verdict between the phases. */
    constexpr uint32_t CH = 32 * HV; /* HV vectors per lane */
    const uint32_t nchunk = (nv + CH - 1) / CH;
    const uint32_t own0 = sh_tstart[rank], nown = sh_tstart[rank + 1] - own0;
    for (int ph = 0; ph < 2; ph++) {
      if (PERS && ph == 1 && !persist_gate(p, o, vpre)) return false;
      const uint32_t nitems = (ph == 0 ? nown : N - nown) * nchunk;
      for (uint32_t item = blockIdx.x * NWARP + warp; item < nitems; item += G * NWARP) {
        const uint32_t v0 = item / nchunk, c = item % nchunk;
        const uint32_t u = ph == 0 ? own0 + v0 : (v0 < own0 ? v0 : v0 + nown);
        uint32_t src = 0;
        while (src + 1 < R && u >= sh_tstart[src + 1]) src++;
        uint32_t t = u - sh_tstart[src];
        const Meta *m = meta + (uint64_t)src * M + t;
        int n = __ldcg(&m->n);
        uint32_t s_l = lane < KMAX ? (uint32_t)(uint16_t)__ldcg((const short *)&m->slot[lane]) : 0u;
        float w_l = lane < KMAX ? __ldcg(&m->w[lane]) : 0.f;
        int32_t pos_l = lane < KMAX ? __ldcg(cpos + ((uint64_t)src * M + t) * KMAX + lane) : 0;
        n = min(n, KMAX);
        if (n <= 0) continue;
        const uint32_t vbeg = c * CH, vend = min(vbeg + CH, nv);
        float acc[HV][8];
#pragma unroll
        for (int h = 0; h < HV; h++)
#pragma unroll
          for (int j = 0; j < 8; j++) acc[h][j] = 0.f;
        for (int i0 = 0; i0 < n; i0 += NB) {
          int4 yv[NB][HV];
#pragma unroll
          for (int i = 0; i < NB; i++) {
            int ii = i0 + i;
            uint32_t s_i = __shfl_sync(0xffffffffu, s_l, ii & 31);
            int32_t p_i = __shfl_sync(0xffffffffu, pos_l, ii & 31);
#if EPD_LL_DIAG_COMB_Y == 1 /* diagnostic build: every row read is one hot row (timing only) */
            const int4 *row = (const int4 *)(y + (uint64_t)(s_i & 0) * 2 * H);
#elif EPD_LL_DIAG_COMB_Y == 2 /* diagnostic build: rows packed by (token, entry) (timing only) */
            const int4 *row = (const int4 *)(y + ((uint64_t)u * 8 + (ii & 7)) * 2 * H);
#elif EPD_LL_DIAG_COMB_Y == \
    3 /* diagnostic build: the expert-major layout with 32 rows per slot (timing only) */
            const int4 *row = (const int4 *)(y + ((uint64_t)s_i * 32 + (p_i & 31)) * 2 * H);
#else
            const int4 *row = (const int4 *)(y + ((uint64_t)s_i * RM + p_i) * 2 * H);
#endif
#pragma unroll
            for (int h = 0; h < HV; h++) {
              uint32_t v = vbeg + lane + h * 32;
#ifdef EPD_LL_DIAG_COMB_NOY /* diagnostic build: no y loads (wrong sums; timing only) */
              (void)row;
              if (ii < n && v < vend) yv[i][h] = make_int4((int)p_i, (int)s_i, (int)v, ii);
#else
              if (ii < n && v < vend) yv[i][h] = __ldcg(row + v);
#endif
            }
          }
#pragma unroll
          for (int i = 0; i < NB; i++) {
            int ii = i0 + i;
            float w = __shfl_sync(0xffffffffu, w_l, ii & 31);
            if (ii >= n) break;
#pragma unroll
            for (int h = 0; h < HV; h++) {
              const uint32_t *yw = (const uint32_t *)&yv[i][h];
#pragma unroll
              for (int j = 0; j < 4; j++) {
                acc[h][2 * j] += w * bf16_to_f(yw[j] & 0xffff);
                acc[h][2 * j + 1] += w * bf16_to_f(yw[j] >> 16);
              }
            }
          }
        }
#ifdef EPD_LL_DIAG_COMB_LOCAL /* diagnostic build: the partials stay in this GPU's bank (timing only) */
        int4 *dst = (int4 *)(lb + p.lay.cstg + ((uint64_t)rank * M + t) * 2 * H);
#else
        int4 *dst = (int4 *)(peer_bank(p, o, src) + p.lay.cstg + ((uint64_t)rank * M + t) * 2 * H);
#endif
#pragma unroll
        for (int h = 0; h < HV; h++) {
          uint32_t v = vbeg + lane + h * 32;
          if (v >= vend) continue;
          int4 o;
          o.x = (int)pack_bf16x2(acc[h][0], acc[h][1]);
          o.y = (int)pack_bf16x2(acc[h][2], acc[h][3]);
          o.z = (int)pack_bf16x2(acc[h][4], acc[h][5]);
          o.w = (int)pack_bf16x2(acc[h][6], acc[h][7]);
          dst[v] = o;
        }
      }
    }
  } else if (PERS && !persist_gate(p, o, vpre)) {
    return false;
  }

  __syncthreads();
  TRACE(1);
  FTRACE_LATEST(9); /* the slowest block's end of the expert side */
  if (tid == 0) {
    __threadfence_system();
    TRACE(2);
    FTRACE_LATEST(10); /* ... and of its fence: its flags leave after it */
    for (uint32_t r = 0; r < R; r++)
      st_relaxed_sys((uint64_t *)(peer_bank(p, o, r) + p.lay.cflag) + (uint64_t)rank * G + blockIdx.x,
                     (uint64_t)seq << 32);
  }

  TRACE(3);
  /* ---- source side: sum the partials of each of my tokens in f32 ---- */
  wait_flags(p, (const uint64_t *)(lb + p.lay.cflag), seq, gtimer() + p.timeout_ns, &wr);
  TRACE(4);
  FTRACE_LATEST(11); /* the slowest block's end of the wait (every rank's flags seen) */
  int code, peer;
  wait_status(p, &wr, &code, &peer);
  if (code == 0 && derr != 0) code = EPD_ERR_STATE;
  if (code == 0) {
    const uint64_t *rmask = (const uint64_t *)(lb + p.lay.rmask);
    const char *cstg = lb + p.lay.cstg;
    __nv_bfloat16 *out = arena_buf<__nv_bfloat16>(p, o, EPD_BUF_OUT);
    const uint32_t T = __ldcg(&st->ntok);
    for (uint32_t t = blockIdx.x; t < T; t += G) {
      uint64_t mask = __ldcg(rmask + t);
      int4 *orow = (int4 *)(out + (uint64_t)t * H);
      for (uint32_t v = tid; v < nv; v += NTHR) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        /* the partials of 4 ranks in flight at once (16 registers, not 8 ranks' 32), summed in rank order */
        constexpr uint32_t RB = 4;
        for (uint32_t d0 = 0; d0 < R; d0 += RB) {
          int4 pvs[RB];
#pragma unroll
          for (uint32_t i = 0; i < RB; i++) {
            const uint32_t d = d0 + i;
            if (d < R && ((mask >> d) & 1))
              pvs[i] = __ldcg((const int4 *)(cstg + ((uint64_t)d * M + t) * 2 * H) + v);
          }
#pragma unroll
          for (uint32_t i = 0; i < RB; i++) {
            const uint32_t d = d0 + i;
            if (d >= R || !((mask >> d) & 1)) continue;
            const uint32_t *pw = (const uint32_t *)&pvs[i];
#pragma unroll
            for (int j = 0; j < 4; j++) {
              acc[2 * j] += bf16_to_f(pw[j] & 0xffff);
              acc[2 * j + 1] += bf16_to_f(pw[j] >> 16);
            }
          }
        }
        int4 o;
        o.x = (int)pack_bf16x2(acc[0], acc[1]);
        o.y = (int)pack_bf16x2(acc[2], acc[3]);
        o.z = (int)pack_bf16x2(acc[4], acc[5]);
        o.w = (int)pack_bf16x2(acc[6], acc[7]);
        orow[v] = o;
      }
    }
  }
  TRACE(5);
  finish_block(p, o, st, 1, seq, code, peer, 0, 0);
  return true;
}

__global__ void __launch_bounds__(NTHR)
    ll_dispatch_kernel(const __grid_constant__ LLParams p, const __grid_constant__ LLOp o) {
  ll_dispatch_body<false>(p, o);
}

#ifndef EPD_LL_PERSIST_COMBINE_ROWS
#define EPD_LL_PERSIST_COMBINE_ROWS 3
#endif

/* Arguments of the persistent kernel besides the LL parameters. */
struct PArgs {
  epd_queue_t *q;         /* host copy of the queue (the daemon's CPU threads read it) */
  epd_queue_t *dq;        /* its device twin: the slots polled here */
  const uint64_t *dlimit; /* device word: no op with index >= *dlimit is taken */
  const epd_k_pctl_t *ctl;
  epd_k_pprog_t *prog;
  PDev *pd;
  uint32_t first_slot, bv0, bv1;
  uint64_t index0, step0;
};

/* This rank's announcement word in rank `peer`'s window. */
__device__ __forceinline__ uint64_t *ann_word(const LLParams &p, uint32_t peer, uint32_t src) {
  return (uint64_t *)(p.peer[peer] + p.lay.ann) + src;
}

/* The controller of the persistent kernel (warp 0 of block G, the extra block): takes each op from the
 * queue once the previous one completed, releases it to the G op blocks at once and announces it to every
 * rank, then agrees on it with the peers while the blocks run its local part, and publishes the verdict
 * (persist_gate). Lane 0 makes the record's and the verdict's release stores and nothing else that a
 * fence would wait for; lane 31 writes the host-mapped progress block (PCIe). Returns when the kernel
 * stops (the blocks got a stop: at release or as the verdict). */
__device__ __noinline__ void persist_controller(const LLParams &base, const PArgs &a) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t FULL = 0xffffffffu, PLANE = 31; /* PLANE: the progress block's writer */
  PDev *pd = a.pd;
  epd_queue_t *q = a.q, *dq = a.dq;
  volatile epd_k_pprog_t *pr = a.prog;
  /* slots whose twin state is not yet trusted (bit per slot): until this kernel takes a slot once, its
   * twin may still say SUBMITTED for an op the launch mode already completed in the host copy (the client
   * frees the twin first, then the host copy) */
  uint32_t unverified = (1u << EPD_QUEUE_SLOTS) - 1;
  uint32_t pos = a.first_slot % EPD_QUEUE_SLOTS, bv0 = a.bv0, bv1 = a.bv1;
  for (uint64_t opn = 0;; opn++) {
    const uint64_t idx = a.index0 + opn;
    const uint32_t mapver = __ldcg(base.map);
    /* the previous op's slot must be DONE before the ring is scanned again (acquire: its last_err too);
     * the host's abort word (a PCIe read now and then) ends the wait: the blocks' own waits see it too,
     * and they stop at the record released below */
    uint32_t aborted = 0;
    if (opn > 0) {
      if (lane == 0)
        for (uint32_t n = 1; ld_acquire_gpu_u64(&pd->done_ops) < opn; n++)
          if ((n & 1023) == 0 && host_abort(a.ctl)) {
            aborted = 1;
            break;
          }
      aborted = __shfl_sync(FULL, aborted, 0);
      __syncwarp(); /* lane 0's acquire of done_ops before every lane's read of last_err */
    }
    const int lasterr = opn && !aborted ? *(volatile int32_t *)&pd->last_err : 0;
    int run = 0, rpeer = -1;
    uint32_t reason = 0, s = pos, op = 0, bank = 0, fp8 = 0;
    uint64_t t0 = 0;
    uint32_t dw = 0; /* lane < 16: word `lane` of the descriptor */
    if (aborted) {
      reason = EPD_K_PEXIT_LIMIT;
    } else if (lasterr == EPD_ERR_TIMEOUT || lasterr == EPD_ERR_PEER) {
      reason = EPD_K_PEXIT_ERROR;
    } else {
      for (uint32_t n = 0;; n++) {
        /* relaxed polls of the device twin (an acquire per poll would fence every time), one fence once
         * one is seen; the stop word is device memory too (lane 0's value for the whole warp), the
         * host's abort word a PCIe read now and then. Polling faster made the ops slower: the slot
         * states loaded before the stop word's shuffle (one round trip per poll instead of two), or the
         * abort word read without waiting for it, each took ~1.2 us longer from the client's submit to
         * this loop seeing it (bench_ll EPD_BENCH_PERSIST, 2x H100); a
         * __nanosleep of 100 or 400 ns between polls changed nothing. */
        const uint64_t lim = __shfl_sync(FULL, lane == 0 ? *(volatile const uint64_t *)a.dlimit : 0ull, 0);
        uint32_t ab = 0;
        if (lane == 0 && (n & 63) == 0) ab = host_abort(a.ctl);
        ab = __shfl_sync(FULL, ab, 0);
        uint32_t stv = lane < EPD_QUEUE_SLOTS
                           ? *(volatile const uint32_t *)&dq->slot[(pos + lane) % EPD_QUEUE_SLOTS].state
                           : 0u;
        if (idx >= lim || ab) {
          reason = EPD_K_PEXIT_LIMIT;
          break;
        }
        uint32_t m = __ballot_sync(FULL, lane < EPD_QUEUE_SLOTS && stv == EPD_SLOT_SUBMITTED);
        if (m) __threadfence(); /* with the relaxed load that saw SUBMITTED: acquire (writer on this GPU) */
        while (m) {
          const uint32_t bit = (uint32_t)__ffs(m) - 1;
          s = (pos + bit) % EPD_QUEUE_SLOTS;
          if (!(unverified & (1u << s))) break;
          /* stale if the host copy is DONE (the launch mode ran it), or if the twin was freed since (the
           * client frees the twin before the host copy): then the next SUBMITTED one this turn */
          uint32_t ok = 0;
          if (lane == 0) {
            const uint32_t hs = *(volatile const uint32_t *)&q->slot[s].state;
            __threadfence_system();
            const uint32_t ds = *(volatile const uint32_t *)&dq->slot[s].state;
            ok = hs != EPD_SLOT_DONE && ds == EPD_SLOT_SUBMITTED;
          }
          if (__shfl_sync(FULL, ok, 0)) {
            unverified &= ~(1u << s);
            break;
          }
          m &= ~(1u << bit);
        }
        if (m) {
          __syncwarp(); /* ... ordered before every lane's descriptor load */
          dw = lane < 16 ? ((volatile const uint32_t *)&dq->slot[s].desc)[lane] : 0u;
          op = __shfl_sync(FULL, dw, 0);
          const uint32_t fl = __shfl_sync(FULL, dw, 1);
          bank = __shfl_sync(FULL, dw, 3);
          t0 = gtimer();
          /* a dispatch with a flag it does not know (any but FP8; the launch mode refuses it with the
           * reason) is an op it does not run; the ranks agree on FP8 with the op and bank below */
          if ((op == EPD_OP_LL_DISPATCH && !(fl & ~(uint32_t)EPD_DESC_FP8)) || op == EPD_OP_LL_COMBINE) {
            run = bank < EPD_NUM_BANKS;
            fp8 = op == EPD_OP_LL_DISPATCH && (fl & EPD_DESC_FP8);
          }
          if (!run) reason = EPD_K_PEXIT_OP;
          break;
        }
      }
    }
    /* Lanes 0..PR_WORDS-1 release the op (or the stop) to the body blocks as the tagged record; lanes
     * PR_WORDS.. announce it to every rank at the same time (this rank's word in each window). */
    const uint64_t word =
        ((idx + 1) << 16) | (fp8 ? 0x200u : 0u) | (run ? 0u : 0x100u) | ((op & 0xfu) << 4) | (bank & 0xfu);
    /* the map version the completion reports (a combine: its bank's dispatch version) */
    uint32_t repver = 0;
    if (run) {
      repver = op == EPD_OP_LL_DISPATCH ? mapver : (bank == 0 ? bv0 : bv1);
      if (!repver) repver = mapver;
    }
    {
      const uint64_t t1 = gtimer();
      uint32_t pw = dw;
      if (lane == PR_SLOT) pw = s | (uint32_t)run << 16;
      if (lane == PR_REPVER) pw = repver;
      if (lane == PR_T0) pw = (uint32_t)t0;
      if (lane == PR_T0 + 1) pw = (uint32_t)(t0 >> 32);
      if (lane == PR_T1) pw = (uint32_t)t1;
      if (lane == PR_T1 + 1) pw = (uint32_t)(t1 >> 32);
      const uint64_t rw = (uint64_t)rec_tag(idx) << 32 | pw;
      /* Relaxed stores, no fence on this path (a release store by lane 0 took the blocks' start from 1.5
       * to 2.1 us after the release, 2x H200): every lane ran a fence after the ballot that saw the slot
       * SUBMITTED and synced with the observing lane before these stores, the op blocks' lane 0
       * acquires word 0, and the client's inputs they then read (__ldcg, L2) were written before the
       * client's own fence and SUBMITTED. */
      if (lane < PR_WORDS) *(volatile uint64_t *)&pd->rec[lane] = rw;
      if (lane >= PR_WORDS && lane - PR_WORDS < base.R)
        st_relaxed_sys(ann_word(base, lane - PR_WORDS, base.rank), word);
    }
    /* `announced` > `taken` tells the host this rank waits for its peers */
    if (lane == PLANE) pr->announced = idx + 1;
    __syncwarp();
    if (run) {
      /* agree: every rank announced this index with the same op, bank and FP8 flag */
      const uint64_t tmo = base.timeout_ns * 4, deadline = gtimer() + tmo;
      uint64_t v = 0;
      if (lane < base.R) {
        const uint64_t *mine = (const uint64_t *)(base.local + base.lay.ann) + lane;
        for (uint32_t n = 1;; n++) {
          v = *(volatile const uint64_t *)mine; /* nothing is read on the strength of it: relaxed */
          if ((v >> 16) >= idx + 1) break;
          if (gtimer() > deadline || ((n & 255) == 0 && host_abort(a.ctl))) {
            v = 0;
            break;
          }
        }
      }
      const bool in = lane < base.R;
      const uint32_t bex = __ballot_sync(FULL, in && v && ((v & 0x100u) || (v >> 16) != idx + 1));
      const uint32_t bmm =
          __ballot_sync(FULL, in && v && (v & 0x2ffu) != (word & 0x2ffu)); /* op, bank, FP8 */
      const uint32_t bto = __ballot_sync(FULL, in && !v);
      if (bex) {
        run = 0;
        reason = EPD_K_PEXIT_PEER;
        rpeer = __ffs(bex) - 1;
      } else if (bmm) {
        run = 0;
        reason = EPD_K_PEXIT_MISMATCH;
        rpeer = __ffs(bmm) - 1;
      } else if (bto) {
        run = 0;
        reason = EPD_K_PEXIT_SYNC_TIMEOUT;
        rpeer = __ffs(bto) - 1;
      }
      if (lane == 0) {
        *(volatile uint64_t *)&pd->tagreed[idx & 1] = gtimer();
        st_release_gpu_u64(&pd->agree, ((idx + 1) << 1) | (uint64_t)run);
      }
    }
    /* the host-mapped progress block last: PCIe writes, off the op's path */
    if (run) {
      pos = (s + 1) % EPD_QUEUE_SLOTS;
      if (op == EPD_OP_LL_DISPATCH) {
        if (bank == 0)
          bv0 = repver;
        else
          bv1 = repver;
      }
    }
    if (lane == PLANE) {
      pr->bank_ver[0] = bv0;
      pr->bank_ver[1] = bv1;
      if (run) {
        pr->taken = idx + 1;
      } else {
        pr->exit_index = idx;
        pr->slot = pos;
        pr->reason = reason;
        pr->exit_peer = rpeer;
        __threadfence_system();
        pr->exited = 1;
      }
    }
    __syncwarp();
    if (!run) return;
  }
}

/* Persistent LL kernel (epd_kernels.h "Persistent mode"): G body blocks and a controller block (block G,
 * persist_controller). Each body block waits for the controller's release of an op, runs the op body (which
 * waits for the verdict before its first remote store); the op's last block completes the slot. */
__global__ void __launch_bounds__(NTHR)
    ll_persistent_kernel(const __grid_constant__ LLParams base, const __grid_constant__ PArgs a) {
  if (blockIdx.x == base.G) {
    if (threadIdx.x < 32) persist_controller(base, a);
    return;
  }
  __shared__ int sh_go;
  __shared__ LLOp sh_o; /* the op's parameters: shared memory costs the op bodies no registers */
  __shared__ __align__(16) uint32_t sh_pb[32];
  /* the op number lives in shared memory, not in registers held across the op bodies (the combine body
   * alone needs all 128) */
  __shared__ uint64_t sh_opn;
  const uint32_t tid = threadIdx.x;
  if (tid == 0) sh_opn = 0;
  __syncthreads();
  for (;;) {
    const uint64_t opn = sh_opn, idx = a.index0 + opn;
    PDev *pd = a.pd;
    if (tid < 32) {
      /* the warp polls the release record until every word carries this op's tag */
      const uint32_t tag = rec_tag(idx);
      uint64_t w;
      /* lane 0's load is an acquire (the controller fenced after seeing the slot SUBMITTED, before the
       * record): with the barriers below it orders the block's reads of the client's inputs after it.
       * No abort check here: every wait of the controller ends (deadline or the host's abort word) in a
       * release, a stop at worst (an abort read in this loop spilled 28 bytes more in the op bodies). A
       * stop the controller releases on the abort word while this block has not yet read the previous
       * op's record would replace that record and leave the block here: not reachable in practice (the
       * abort comes >= timeout + 1 s after the release, which a block reads in microseconds) */
      for (;;) {
        w = tid == 0         ? ld_acquire_gpu_u64(&pd->rec[0])
            : tid < PR_WORDS ? *(volatile const uint64_t *)&pd->rec[tid]
                             : (uint64_t)tag << 32;
        if (__all_sync(0xffffffffu, (uint32_t)(w >> 32) == tag)) break;
        __nanosleep(32);
      }
      sh_pb[tid] = (uint32_t)w;
      __syncwarp();
      const uint32_t run = sh_pb[PR_SLOT] >> 16;
      if (tid == 0) sh_go = (int)run;
      if (tid == 0 && run) {
        const epd_desc_t &d = *(const epd_desc_t *)sh_pb;
        const uint32_t slot = sh_pb[PR_SLOT] & 0xffffu;
        LLOp &o = sh_o;
        o.flags = d.flags;
        o.T = d.num_tokens > 0xffffffu ? 0xffffffu : d.num_tokens;
        o.bank = d.bank;
        o.prepver = sh_pb[PR_REPVER];
        o.comp = &a.q->slot[slot].comp;
        o.done_state = &a.q->slot[slot].state;
        o.dslot = &a.dq->slot[slot];
        o.user_tag = d.user_tag;
        o.popn = opn;
        o.pstep = a.step0 + opn;
        o.pt0 = (uint64_t)sh_pb[PR_T0 + 1] << 32 | sh_pb[PR_T0];
        o.pt1 = (uint64_t)sh_pb[PR_T1 + 1] << 32 | sh_pb[PR_T1];
        o.psub = ((uint64_t)d.reserved[1] << 32) | d.reserved[0];
        o.pidx = idx;
        o.pop = d.op;
      }
    }
    __syncthreads();
    if (!sh_go) return;
    const bool ran = sh_o.pop == EPD_OP_LL_DISPATCH
                         ? ll_dispatch_body<true>(base, sh_o)
                         : ll_combine_body<EPD_LL_PERSIST_COMBINE_ROWS, true>(base, sh_o);
    if (!ran) return; /* the ranks did not agree on it: the controller stopped */
    __syncthreads();
    if (tid == 0) sh_opn = sh_o.popn + 1;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(NTHR)
    ll_combine_kernel(const __grid_constant__ LLParams p, const __grid_constant__ LLOp o) {
#ifdef EPD_LL_COMBINE_HV /* experiment: vectors per lane of the expert-side items, rows in flight */
  ll_combine_body<EPD_LL_COMBINE_NB, false, EPD_LL_COMBINE_HV>(p, o);
#else
  ll_combine_body<8, false>(p, o);
#endif
}

LLLayout make_layout(const epd_k_ll_geom_t *g, uint32_t G) {
  LLLayout l;
  uint64_t R = g->num_ranks, M = g->max_tokens, H = g->hidden, o = 0;
  auto take = [&](uint64_t bytes) {
    uint64_t at = o;
    o = align_up(o + bytes, 256);
    return at;
  };
  l.dflag = take(R * G * 8);
  l.cflag = take(R * G * 8);
  l.meta = take(R * M * sizeof(Meta));
  l.xstg = take(R * M * 2 * H);
  l.cstg = take(R * M * 2 * H);
  l.cpos = take(R * M * KMAX * 4);
  l.rtok = take(R * 4);
  l.rmask = take(M * 8);
  l.st = take(sizeof(BankState));
  l.bank_bytes = align_up(o, 4096);
  l.ann = l.bank_bytes * EPD_NUM_BANKS;
  l.area_bytes = l.ann + align_up(R * 8, 4096);
  return l;
}

} /* namespace */

/* The LL area's address in every LSA rank's mapping of the window (host copy: epd_k_ll.peer). */
static __global__ void lsa_bases_kernel(ncclWindow_t win, size_t off, uint32_t R, char **out) {
  if (threadIdx.x < EPD_K_MAX_RANKS)
    out[threadIdx.x] = threadIdx.x < R ? (char *)ncclGetLsaPointer(win, off, threadIdx.x) : nullptr;
}

struct epd_k_ll {
  epd_k_ll_geom_t g;
  ncclComm_t comm;
  ncclDevComm_t dev;
  int have_dev;
  ncclWindow_t win;
  char *local;
  size_t win_off;
  LLLayout lay;
  int device;
  PDev *pdev;                  /* persistent-mode scratch */
  char *peer[EPD_K_MAX_RANKS]; /* LLParams.peer */
  long resident;               /* persistent kernel blocks resident at once on this GPU */
};

static uint32_t geom_blocks(const epd_k_ll_geom_t *g) {
  return g->blocks ? g->blocks : EPD_K_LL_BLOCKS;
}

static epd_result_t check_geom(const epd_k_ll_geom_t *g, char *err, size_t errlen) {
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
  if (g->max_tokens < 1 || g->max_tokens > EPD_K_MAX_TOKENS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "max_tokens", g->max_tokens, EPD_K_MAX_TOKENS);
  if (g->num_experts < 1) return set_err(err, errlen, EPD_ERR_INVALID, f, "num_experts", 0, 1 << 30);
  if (g->slots_per_rank < 1 || g->slots_per_rank > 0xffff)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "slots_per_rank", g->slots_per_rank, 0xffff);
  if (geom_blocks(g) > EPD_K_LL_MAX_BLOCKS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "blocks", geom_blocks(g), EPD_K_LL_MAX_BLOCKS);
  return EPD_OK;
}

extern "C" {

size_t epd_k_ll_window_bytes(const epd_k_ll_geom_t *g) {
  return (size_t)make_layout(g, geom_blocks(g)).area_bytes;
}

size_t epd_k_map_bytes(uint32_t num_experts) {
  return 16 + (size_t)num_experts * 4 * (1 + EPD_K_MAX_REPLICAS);
}

epd_result_t epd_k_map_pack(void *host_dst, uint32_t version, uint32_t num_experts, const uint8_t *nrep,
                            const uint32_t *rep, uint32_t rep_stride) {
  uint32_t *m = (uint32_t *)host_dst;
  memset(m, 0, epd_k_map_bytes(num_experts));
  m[0] = version;
  m[1] = num_experts;
  m[2] = EPD_K_MAX_REPLICAS;
  for (uint32_t e = 0; e < num_experts; e++) {
    if (nrep[e] > EPD_K_MAX_REPLICAS || nrep[e] > rep_stride) return EPD_ERR_INVALID;
    m[4 + e] = nrep[e];
    for (uint32_t i = 0; i < nrep[e]; i++) {
      uint32_t r = rep[((size_t)e * rep_stride + i) * 2], s = rep[((size_t)e * rep_stride + i) * 2 + 1];
      if (r > 0xffff || s > 0xffff) return EPD_ERR_INVALID;
      m[4 + num_experts + e * EPD_K_MAX_REPLICAS + i] = (r << 16) | s;
    }
  }
  return EPD_OK;
}

void epd_k_map_default(void *host_dst, uint32_t version, uint32_t num_experts, uint32_t num_ranks) {
  uint32_t *m = (uint32_t *)host_dst;
  memset(m, 0, epd_k_map_bytes(num_experts));
  uint32_t per = (num_experts + num_ranks - 1) / num_ranks;
  m[0] = version;
  m[1] = num_experts;
  m[2] = EPD_K_MAX_REPLICAS;
  for (uint32_t e = 0; e < num_experts; e++) {
    m[4 + e] = 1;
    m[4 + num_experts + e * EPD_K_MAX_REPLICAS] = ((e / per) << 16) | (e % per);
  }
}

/* The device API generation of a version code: 2.28 had unversioned structs; 2.29 and later version them,
 * so a runtime at least as new as the headers takes what these kernels were built with. */
static int nccl_dev_api_ok(int runtime, int built) {
  if (built < NCCL_VERSION(2, 29, 0)) return runtime / 100 == built / 100;
  return runtime >= NCCL_VERSION(2, 29, 0) && runtime / 100 >= built / 100;
}

int epd_k_nccl_version(void) {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

epd_result_t epd_k_check_nccl_version(char *err, size_t errlen) {
  if (epd_k_nccl_load(err, errlen)) return EPD_ERR_UNSUPPORTED;
  const int v = epd_k_nccl_version();
  if (!v) return set_err(err, errlen, EPD_ERR_NCCL, "%s failed (%ld %ld)", "ncclGetVersion", 0, 0);
  if (nccl_dev_api_ok(v, NCCL_VERSION_CODE)) return EPD_OK;
  if (err && errlen) {
    if (NCCL_VERSION_CODE < NCCL_VERSION(2, 29, 0))
      snprintf(err, errlen,
               "NCCL runtime %d.%d.%d does not match the device API the epd kernels are built with (NCCL "
               "2.28); install NCCL 2.28.x, or rebuild epd against NCCL 2.29 or later",
               v / 10000, (v / 100) % 100, v % 100);
    else
      snprintf(err, errlen,
               "NCCL runtime %d.%d.%d is older than the device API the epd kernels are built with (NCCL "
               "%d.%d); install NCCL %d.%d or later (pip install nvidia-nccl-cu13, or NVIDIA's packages)",
               v / 10000, (v / 100) % 100, v % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_MAJOR, NCCL_MINOR);
  }
  return EPD_ERR_UNSUPPORTED;
}

epd_result_t epd_k_ll_create(const epd_k_ll_geom_t *g, struct ncclComm *lsa_comm,
                             struct ncclWindow_vidmem *window, void *window_local, size_t window_offset,
                             epd_k_ll_t **out, char *err, size_t errlen) {
  epd_result_t r = check_geom(g, err, errlen);
  if (r) return r;
  if (!lsa_comm || !window || !window_local || (window_offset % 4096))
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: NULL handle or unaligned offset %ld (%ld)",
                   "epd_k_ll_create", (long)window_offset, 4096);
  epd_k_ll_t *k = (epd_k_ll_t *)calloc(1, sizeof(*k));
  if (!k) return EPD_ERR_NOMEM;
  k->g = *g;
  k->g.blocks = geom_blocks(g);
  k->comm = lsa_comm;
  k->win = window;
  k->local = (char *)window_local + window_offset;
  k->win_off = window_offset;
  k->lay = make_layout(&k->g, k->g.blocks);
  cudaGetDevice(&k->device);
  ncclDevCommRequirements_t req;
  dev_comm_requirements_init(&req);
  req.lsaBarrierCount = 1;
  if ((r = dev_comm_create(lsa_comm, &req, &k->dev, err, errlen))) {
    free(k);
    return r;
  }
  k->have_dev = 1;
  {
    /* every block waits for every other block's arrival: all of them must be resident at once */
    int nsm;
    const int per_sm = resident_per_sm(ll_persistent_kernel, k->device, NTHR, 0, &nsm);
    k->resident = (long)nsm * per_sm;
    if ((long)nsm * per_sm < (long)k->g.blocks) {
      if (err && errlen)
        snprintf(err, errlen, "blocks = %u exceeds the %d x %d blocks this GPU keeps resident", k->g.blocks,
                 nsm, per_sm);
      ncclDevCommDestroy(lsa_comm, &k->dev);
      free(k);
      return EPD_ERR_INVALID;
    }
  }
  if ((r = check_lsa_team(&k->dev, g->num_ranks, g->rank, err, errlen))) {
    ncclDevCommDestroy(lsa_comm, &k->dev);
    free(k);
    return r;
  }
  cudaError_t ce = preload(ll_dispatch_kernel, ll_combine_kernel, ll_persistent_kernel);
  if (ce == cudaSuccess) ce = cudaMalloc((void **)&k->pdev, 512);
  if (ce == cudaSuccess) {
    lsa_bases_kernel<<<1, 32>>>(k->win, k->win_off, g->num_ranks, (char **)k->pdev);
    ce = cudaMemcpy(k->peer, k->pdev, sizeof k->peer, cudaMemcpyDeviceToHost);
  }
  if (ce == cudaSuccess) ce = cudaMemset(k->local, 0, k->lay.area_bytes);
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    if (err && errlen) snprintf(err, errlen, "zeroing the LL area: %s", cudaGetErrorString(ce));
    if (k->pdev) cudaFree(k->pdev);
    ncclDevCommDestroy(lsa_comm, &k->dev);
    free(k);
    return EPD_ERR_CUDA;
  }
  *out = k;
  return EPD_OK;
}

void epd_k_ll_destroy(epd_k_ll_t *k) {
  if (!k) return;
  if (k->have_dev) ncclDevCommDestroy(k->comm, &k->dev);
  if (k->pdev) cudaFree(k->pdev);
  free(k);
}

epd_result_t epd_k_ll_reset(epd_k_ll_t *k, void *stream) {
  cudaError_t ce = cudaMemsetAsync(k->local, 0, k->lay.area_bytes, (cudaStream_t)stream);
  return ce == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

const epd_k_ll_geom_t *epd_k_ll_geom(const epd_k_ll_t *k) {
  return &k->g;
}

epd_result_t epd_k_ll_launch(epd_k_ll_t *k, const epd_k_arena_t *arena, const epd_k_ll_op_t *op, void *stream,
                             char *err, size_t errlen) {
  if (!k || !arena || !op)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: NULL argument (%ld %ld)", "epd_k_ll_launch", 0, 0);
  if (op->bank >= EPD_NUM_BANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld out of range (max %ld)", "bank", op->bank,
                   EPD_NUM_BANKS - 1);
  if (op->op != EPD_OP_LL_DISPATCH && op->op != EPD_OP_LL_COMBINE)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld is not an LL op (%ld)", "op", op->op, 0);
  if (op->op == EPD_OP_LL_DISPATCH && !op->map)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: no expert map (%ld %ld)", "dispatch", 0, 0);
  LLParams p;
  memset(&p, 0, sizeof(p));
  params_from_ctx(p, k);
  memcpy(p.peer, k->peer, sizeof p.peer);
  p.timeout_ns = op->timeout_ns ? op->timeout_ns : EPD_K_DEFAULT_TIMEOUT_NS;
  p.map = (const uint32_t *)op->map;
  p.slot_tokens = op->slot_tokens;
  p.trace = op->trace;
  p.arena = *arena;
  LLOp o;
  memset(&o, 0, sizeof(o));
  o.flags = op->flags;
  o.T = op->num_tokens > 0xffffffu ? 0xffffffu
                                   : op->num_tokens; /* > M is reported on every rank by the kernel */
  o.bank = op->bank;
  o.comp = op->comp;
  if (op->op == EPD_OP_LL_DISPATCH)
    ll_dispatch_kernel<<<p.G, NTHR, 0, (cudaStream_t)stream>>>(p, o);
  else
    ll_combine_kernel<<<p.G, NTHR, 0, (cudaStream_t)stream>>>(p, o);
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) {
    if (err && errlen) snprintf(err, errlen, "LL kernel launch: %s", cudaGetErrorString(ce));
    return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

epd_result_t epd_k_ll_persistent_launch(epd_k_ll_t *k, const epd_k_arena_t *arena, const void *map,
                                        const epd_k_persist_t *ps, void *stream) {
  if (!k || !arena || !map || !ps || !ps->queue || !ps->dqueue || !ps->dlimit || !ps->ctl || !ps->prog)
    return EPD_ERR_INVALID;
  LLParams p;
  memset(&p, 0, sizeof(p));
  params_from_ctx(p, k);
  memcpy(p.peer, k->peer, sizeof p.peer);
  p.timeout_ns = ps->timeout_ns ? ps->timeout_ns : EPD_K_DEFAULT_TIMEOUT_NS;
  p.map = (const uint32_t *)map;
  p.arena = *arena;
  p.pdev = k->pdev;
  p.trace =
      (uint64_t *)((char *)k->pdev + offsetof(PDev, trace)); /* the op timeline of the progress records */
  p.ctl = ps->ctl;
  p.prog = ps->prog;
  p.pq = ps->queue;
  p.psteps0 = ps->steps_done0;
  p.pguard_all = ps->guard_all;
  PArgs a;
  memset(&a, 0, sizeof(a));
  a.q = ps->queue;
  a.dq = ps->dqueue;
  a.dlimit = ps->dlimit;
  a.ctl = ps->ctl;
  a.prog = ps->prog;
  a.pd = k->pdev;
  a.first_slot = ps->first_slot;
  a.bv0 = ps->bank_ver[0];
  a.bv1 = ps->bank_ver[1];
  a.index0 = ps->index0;
  a.step0 = ps->step0;
  /* every block must be resident at once, the controller block included (the op blocks spin on it) */
  if ((long)p.G + 1 > k->resident) return EPD_ERR_INVALID;
  if (cudaMemsetAsync(k->pdev, 0, sizeof(PDev), (cudaStream_t)stream) != cudaSuccess) return EPD_ERR_CUDA;
  ll_persistent_kernel<<<p.G + 1, NTHR, 0, (cudaStream_t)stream>>>(p, a); /* + the controller block */
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

long epd_k_ll_resident_blocks(const epd_k_ll_t *k) {
  return k ? k->resident : 0;
}

epd_result_t epd_k_ll_dispatch(epd_k_ll_t *k, const epd_k_arena_t *arena, const void *map, uint32_t bank,
                               uint32_t num_tokens, uint32_t flags, epd_comp_t *comp, uint64_t timeout_ns,
                               void *stream) {
  epd_k_ll_op_t op;
  memset(&op, 0, sizeof(op));
  op.op = EPD_OP_LL_DISPATCH;
  op.flags = flags;
  op.num_tokens = num_tokens;
  op.bank = bank;
  op.timeout_ns = timeout_ns;
  op.map = map;
  op.comp = comp;
  return epd_k_ll_launch(k, arena, &op, stream, NULL, 0);
}

epd_result_t epd_k_ll_combine(epd_k_ll_t *k, const epd_k_arena_t *arena, uint32_t bank, epd_comp_t *comp,
                              uint64_t timeout_ns, void *stream) {
  epd_k_ll_op_t op;
  memset(&op, 0, sizeof(op));
  op.op = EPD_OP_LL_COMBINE;
  op.bank = bank;
  op.timeout_ns = timeout_ns;
  op.comp = comp;
  return epd_k_ll_launch(k, arena, &op, stream, NULL, 0);
}

} /* extern "C" */
