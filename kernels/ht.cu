/*
 * ht.cu - high-throughput (HT) dispatch and combine on the NCCL 2.28 Device API (LSA over NVLink).
 *
 * Semantics: docs/SEMANTICS.md ("HT dispatch", "HT combine"). Launchers: epd_kernels.h.
 *
 * One HT dispatch is three stream-ordered kernels on each rank:
 *   route  (a warp per token)  validate top-k ids, pick each entry's replica, dest-rank mask per token;
 *   plan   (one block)         prefix over tokens: the token's row in its segment on every dest rank;
 *                              exchange the per-dest counts (and input errors) with every rank, so each
 *                              rank knows the whole R x R count matrix: the segment bases, the receive
 *                              total, and the same status everywhere (bad input, overflow past C);
 *   data   (G blocks)          each token once per dest rank, straight to its final row: into the
 *                              receiver's staging rows over LSA (remote) or the own arena (local);
 *                              flags; then the receiver copies its staging rows into the client arena.
 * Combine is one kernel (G blocks): each expert rank pushes HT_Y of every received remote row into the
 * source's combine staging (cstg[expert rank][t]); flags; the source sums the partials of each token in
 * rank order in f32 (its own partial straight from its arena) and writes OUT.
 *
 * HT area of a rank's staging window, per bank (HTLayout, all offsets 256-byte aligned):
 *   --- written by peers ---
 *   cmsg  [R] 128 B       plan message of src: w[0] = seq << 32 | errbits << 24 | T, w[1+r] = count to r
 *   dflag [R][G] u64      dispatch data landed from (src, block): seq << 32
 *   cflag [R][G] u64      combine partials landed from (expert rank, block): seq << 32
 *   --- private to this rank ---
 *   route [M] TokRoute    dest mask, per-k dest rank and slot of my token t
 *   pos   [M][R] u32      row of my token t within my segment on dest rank r
 *   rsrc  [C] i32         EPD_SRC_PACK of each received row (for combine)
 *   slotc [S] u32         (j, k) entries per local slot, accumulated by the dispatch
 *   st    HTState         sequence numbers, tickets, plan results (bases, totals, status)
 *   --- staging written by peers (never zeroed by reset) ---
 *   xstg  [C][2H]         received token rows at their final index (BF16, or FP8 H bytes + scales)
 *   mstg  [C] RowMeta     their routing (src, local slot per k or -1, weight per k)
 *   cstg  [R][M][2H]      combine partial of my token t from expert rank r (BF16)
 *
 * Ordering: one system fence per block after a bar.sync (cumulativity, as in ll.cu) before the relaxed
 * flag stores; the reader's acquire loads pair with it. Sequence numbers live on the device (graph
 * replay needs no host counter). A step's staging is written only after every rank published its plan
 * message of that step, so no rank writes into staging that a rank still reads for an earlier step.
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
constexpr int NTHR = EPD_K_HT_THREADS;
constexpr int NWARP = NTHR / 32;
constexpr int PLAN_THREADS = 1024;

enum : uint32_t { ERRB_BAD_EXPERT = 1u, ERRB_TOO_MANY = 2u, ERRB_BAD_MAP = 4u };

struct __align__(16) TokRoute {
  uint32_t mask; /* bits 0..7 dest ranks, bits 24..31 error bits of this token */
  uint8_t rank[KMAX]; /* 0xff: no expert */
  uint16_t slot[KMAX];
  uint32_t pad[3];
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
  uint32_t dseq;                           /* dispatch sequence (plan kernel) */
  uint32_t cseq[EPD_K_HT_MAX_BLOCKS];      /* combine sequence per block */
  uint32_t dticket, cticket;
  int32_t err[2], errpeer[2];              /* data-kernel errors (timeouts) of [dispatch, combine] */
  int32_t code, peer;                      /* plan result of the last dispatch */
  int32_t derr;                            /* final status of the last dispatch */
  uint32_t T;                              /* my tokens in the last dispatch */
  uint32_t N;                              /* rows I receive (may exceed C: overflow) */
  uint32_t map_version;
  uint32_t sendbase[EPD_K_MAX_RANKS];      /* first row of my segment on each dest rank */
  uint32_t recvbase[EPD_K_MAX_RANKS + 1];  /* first row of each src's segment here */
};

struct HTLayout {
  uint64_t bank_bytes, ctrl_bytes;
  uint64_t cmsg, dflag, cflag, route, pos, rsrc, slotc, st, xstg, mstg, cstg;
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
};

__device__ __forceinline__ char *peer_bank(const HTParams &p, int peer) {
  return (char *)ncclGetLsaPointer(p.win, p.win_off + p.bank * p.lay.bank_bytes, peer);
}
__device__ __forceinline__ char *local_bank(const HTParams &p) { return p.local + p.bank * p.lay.bank_bytes; }
template <typename T>
__device__ __forceinline__ T *arena_buf(const HTParams &p, int kind) {
  return (T *)(uintptr_t)(p.arena.base + p.arena.off[p.bank][kind]);
}

/* ---------------------------------------------------------------------------------------------------
 * route: a warp per token (lanes = top-k columns).
 * ------------------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(NTHR) ht_route_kernel(const HTParams p) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t t = blockIdx.x * NWARP + (threadIdx.x >> 5);
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
  uint32_t errb = 0, d = 0xff, s = 0;
  if (valid) {
    if (e >= (int64_t)map_E) {
      valid = false;
      bad = true;
    } else {
      uint32_t nrep = __ldg(map_nrep + e);
      if (nrep == 0 || nrep > EPD_K_MAX_REPLICAS) {
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
  TokRoute *rt = (TokRoute *)(local_bank(p) + p.lay.route) + t;
  if (lane < KMAX) {
    rt->rank[lane] = (uint8_t)d;
    rt->slot[lane] = (uint16_t)s;
  }
  if (lane == 0) rt->mask = mask | (errb << 24);
}

/* ---------------------------------------------------------------------------------------------------
 * plan: one block. Segment rows of my tokens, count exchange, status.
 * ------------------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(PLAN_THREADS) ht_plan_kernel(const HTParams p) {
  __shared__ uint32_t sh_wsum[EPD_K_MAX_RANKS][PLAN_THREADS / 32];
  __shared__ uint32_t sh_err, sh_seq;
  __shared__ uint32_t sh_mat[EPD_K_MAX_RANKS][EPD_K_MAX_RANKS]; /* [src][dest] */
  __shared__ uint32_t sh_srcerr[EPD_K_MAX_RANKS];
  __shared__ int sh_timeout;

  const uint32_t R = p.R, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  char *lb = local_bank(p);
  HTState *st = (HTState *)(lb + p.lay.st);
  const uint64_t deadline = gtimer() + p.timeout_ns;
  uint32_t T = p.T;
  if (tid == 0) {
    sh_err = 0;
    sh_timeout = 0x7fffffff;
    sh_seq = st->dseq + 1;
    st->dseq = sh_seq;
  }
  uint32_t *slotc = (uint32_t *)(lb + p.lay.slotc);
  for (uint32_t s = tid; s < p.S; s += PLAN_THREADS) slotc[s] = 0;
  __syncthreads();
  if (T > p.M) {
    T = 0;
    if (tid == 0) sh_err |= ERRB_TOO_MANY;
  }
  const TokRoute *route = (const TokRoute *)(lb + p.lay.route);
  uint32_t *pos = (uint32_t *)(lb + p.lay.pos);
  const uint32_t per = (T + PLAN_THREADS - 1) / PLAN_THREADS;
  const uint32_t t0 = min(tid * per, T), t1 = min(t0 + per, T);
  uint32_t c[EPD_K_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPD_K_MAX_RANKS; r++) c[r] = 0;
  uint32_t errb = 0;
  for (uint32_t t = t0; t < t1; t++) {
    uint32_t m = route[t].mask;
    errb |= m >> 24;
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) c[r] += (m >> r) & 1u;
  }
  if (errb) atomicOr(&sh_err, errb);
  /* exclusive prefix of c[r] over threads: warp scan, then warp sums */
  uint32_t excl[EPD_K_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
    uint32_t v = c[r];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t u = __shfl_up_sync(0xffffffffu, v, o);
      if ((int)lane >= o) v += u;
    }
    excl[r] = v - c[r];
    if (lane == 31) sh_wsum[r][warp] = v;
  }
  __syncthreads();
  uint32_t tot[EPD_K_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
    uint32_t a = 0, all = 0;
    for (uint32_t w = 0; w < PLAN_THREADS / 32; w++) {
      if (w < warp) a += sh_wsum[r][w];
      all += sh_wsum[r][w];
    }
    excl[r] += a;
    tot[r] = all;
  }
  for (uint32_t t = t0; t < t1; t++) {
    uint32_t m = route[t].mask;
    for (uint32_t r = 0; r < R; r++) {
      if ((m >> r) & 1u) pos[(uint64_t)t * R + r] = excl[r]++;
    }
  }
  __syncthreads();
  /* plan message to every rank (self included) */
  const uint32_t seq = sh_seq;
  if (tid < R) {
    uint64_t *msg = (uint64_t *)(peer_bank(p, (int)tid) + p.lay.cmsg + (uint64_t)p.rank * 128);
    for (uint32_t r = 0; r < R; r++) msg[1 + r] = tot[r];
    __threadfence_system();
    st_relaxed_sys(msg, ((uint64_t)seq << 32) | ((uint64_t)(sh_err & 0xffu) << 24) | (uint64_t)T);
  }
  /* wait for every rank's message */
  if (tid < R) {
    const uint64_t *msg = (const uint64_t *)(lb + p.lay.cmsg + (uint64_t)tid * 128);
    uint64_t v = 0;
    bool ok = false;
    for (;;) {
      v = ld_acquire_sys(msg);
      if ((uint32_t)(v >> 32) == seq) { ok = true; break; }
      if (gtimer() > deadline) break;
    }
    if (!ok) {
      atomicMin(&sh_timeout, (int)tid);
      sh_srcerr[tid] = 0;
      for (uint32_t r = 0; r < R; r++) sh_mat[tid][r] = 0;
    } else {
      sh_srcerr[tid] = (uint32_t)(v >> 24) & 0xffu;
      for (uint32_t r = 0; r < R; r++) sh_mat[tid][r] = (uint32_t)__ldcg((const unsigned long long *)msg + 1 + r);
    }
  }
  __syncthreads();
  if (tid == 0) {
    int code = 0, peer = -1;
    for (uint32_t s = 0; s < R && !code; s++) {
      uint32_t eb = sh_srcerr[s];
      if (eb) {
        code = (eb & ERRB_TOO_MANY) ? EPD_ERR_TOO_MANY_TOKENS : (eb & ERRB_BAD_EXPERT) ? EPD_ERR_BAD_EXPERT
                                                                                      : EPD_ERR_INVALID;
        peer = (int)s;
      }
    }
    if (!code && sh_timeout != 0x7fffffff) {
      code = EPD_ERR_TIMEOUT;
      peer = sh_timeout;
    }
    uint32_t N = 0;
    for (uint32_t s = 0; s < R; s++) {
      st->recvbase[s] = N;
      N += sh_mat[s][p.rank];
    }
    st->recvbase[R] = N;
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
      for (uint32_t s = 0; s < p.rank; s++) b += sh_mat[s][r];
      st->sendbase[r] = b;
    }
    st->code = code;
    st->peer = peer;
    st->N = N;
    st->T = T;
    st->map_version = p.map[0];
    st->derr = code ? code : EPD_ERR_STATE; /* the data kernel sets the final status */
  }
}

/* Wait (whole block) for flags[src][g] == seq of every src != me; lowest missing src or INT_MAX. */
__device__ int wait_peers(const HTParams &p, const uint64_t *flags, uint32_t seq, uint64_t deadline) {
  __shared__ int sh_to;
  if (threadIdx.x == 0) sh_to = 0x7fffffff;
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < p.R * p.G; i += blockDim.x) {
    uint32_t src = i / p.G;
    if (src == p.rank) continue;
    bool ok = false;
    for (;;) {
      if ((uint32_t)(ld_acquire_sys(flags + i) >> 32) == seq) { ok = true; break; }
      if (gtimer() > deadline) break;
    }
    if (!ok) atomicMin(&sh_to, (int)src);
  }
  __syncthreads();
  return sh_to;
}

/* Signal every peer that this block's stores of an op landed (one system fence after bar.sync). */
__device__ void signal_peers(const HTParams &p, uint64_t off, uint32_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (uint32_t r = 0; r < p.R; r++)
      if (r != p.rank)
        st_relaxed_sys((uint64_t *)(peer_bank(p, (int)r) + off) + (uint64_t)p.rank * p.G + blockIdx.x,
                       (uint64_t)seq << 32);
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

/* ---------------------------------------------------------------------------------------------------
 * dispatch data: G blocks, a warp per (token) on the send side and per row on the receive side.
 * ------------------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(NTHR) ht_dispatch_kernel(const HTParams p) {
  __shared__ RowMeta sh_rm[NWARP];
  __shared__ int sh_last;
  const uint32_t R = p.R, H = p.H, K = p.K, me = p.rank, G = p.G;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool fp8 = (p.flags & EPD_DESC_FP8) != 0;
  char *lb = local_bank(p);
  HTState *st = (HTState *)(lb + p.lay.st);
  const uint64_t deadline = gtimer() + p.timeout_ns;
  const uint32_t seq = st->dseq;
  int code = st->code, peer = st->peer;
  const uint32_t T = st->T, N = st->N;
  const uint32_t nsc = H / 128;
  const uint64_t rowb = 2ull * H;
  uint32_t *slotc = (uint32_t *)(lb + p.lay.slotc);
  int32_t *rsrc = (int32_t *)(lb + p.lay.rsrc);
  char *recv_x = arena_buf<char>(p, EPD_BUF_HT_RECV_X);
  float *recv_sc = fp8 ? arena_buf<float>(p, EPD_BUF_HT_RECV_SCALES) : nullptr;
  int64_t *recv_idx = arena_buf<int64_t>(p, EPD_BUF_HT_RECV_TOPK_IDX);
  float *recv_w = arena_buf<float>(p, EPD_BUF_HT_RECV_TOPK_WEIGHTS);
  int32_t *recv_src = arena_buf<int32_t>(p, EPD_BUF_HT_RECV_SRC);

  if (code == 0) {
    /* ---- send: each token once per dest rank, to its final row ---- */
    const char *x = arena_buf<char>(p, EPD_BUF_X);
    const float *topw = arena_buf<float>(p, EPD_BUF_TOPK_WEIGHTS);
    const TokRoute *route = (const TokRoute *)(lb + p.lay.route);
    const uint32_t *pos = (const uint32_t *)(lb + p.lay.pos);
    uint32_t sendbase[EPD_K_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) sendbase[r] = r < (int)R ? st->sendbase[r] : 0;
    char *peer_base[EPD_K_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EPD_K_MAX_RANKS; r++) peer_base[r] = r < (int)R ? peer_bank(p, r) : nullptr;
    RowMeta *rm = &sh_rm[warp];
    for (uint32_t t = blockIdx.x * NWARP + warp; t < T; t += G * NWARP) {
      const TokRoute *rt = route + t;
      const uint32_t mask = rt->mask & 0xffu;
      uint32_t rk = 0xff, sl = 0;
      float w = 0.f;
      if (lane < K) {
        rk = rt->rank[lane];
        sl = rt->slot[lane];
        w = __ldg(topw + (uint64_t)t * K + lane);
      }
      const char *xrow = x + (uint64_t)t * H * 2;
      for (uint32_t r = 0; r < R; r++) {
        if (!((mask >> r) & 1u)) continue;
        const uint32_t j = sendbase[r] + pos[(uint64_t)t * R + r];
        const bool loc = r == me;
        const int16_t ls = rk == r ? (int16_t)sl : (int16_t)-1;
        const float lw = rk == r ? w : 0.f;
        char *drow = loc ? recv_x + (uint64_t)j * rowb /* FP8: the first H bytes */ : peer_base[r] + p.lay.xstg + (uint64_t)j * rowb;
        float *dsc = loc ? (fp8 ? recv_sc + (uint64_t)j * nsc : nullptr) : (float *)(drow + H);
        if (fp8) {
          /* a half-warp per 128-channel group: 8 channels per lane */
          for (uint32_t g0 = 0; g0 < nsc; g0 += 2 * 4) {
            int4 v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
              uint32_t g = g0 + 2 * i + (lane >> 4);
              if (g < nsc) v[i] = ld_nc_v4(xrow + g * 256 + (lane & 15) * 16);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
              uint32_t g = g0 + 2 * i + (lane >> 4);
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
              float scale = fmaxf(amax, EPD_K_FP8_AMAX_MIN) / EPD_K_FP8_MAX;
              uint32_t qw[2];
#pragma unroll
              for (int q = 0; q < 2; q++) {
                __nv_fp8x2_storage_t a = __nv_cvt_float2_to_fp8x2(
                    make_float2(__fdiv_rn(f[4 * q], scale), __fdiv_rn(f[4 * q + 1], scale)), __NV_SATFINITE, __NV_E4M3);
                __nv_fp8x2_storage_t b = __nv_cvt_float2_to_fp8x2(
                    make_float2(__fdiv_rn(f[4 * q + 2], scale), __fdiv_rn(f[4 * q + 3], scale)), __NV_SATFINITE, __NV_E4M3);
                qw[q] = (uint32_t)a | ((uint32_t)b << 16);
              }
              *(uint2 *)(drow + g * 128 + (lane & 15) * 8) = make_uint2(qw[0], qw[1]);
              if ((lane & 15) == 0) dsc[g] = scale;
            }
          }
        } else {
          const uint32_t n16 = H / 8;
          for (uint32_t v0 = lane; v0 < n16; v0 += 32 * 8) {
            int4 b[8];
#pragma unroll
            for (int i = 0; i < 8; i++)
              if (v0 + i * 32 < n16) b[i] = ld_nc_v4((const int4 *)xrow + v0 + i * 32);
#pragma unroll
            for (int i = 0; i < 8; i++)
              if (v0 + i * 32 < n16) ((int4 *)drow)[v0 + i * 32] = b[i];
          }
        }
        if (loc) {
          if (lane < K) {
            recv_idx[(uint64_t)j * K + lane] = ls;
            recv_w[(uint64_t)j * K + lane] = lw;
            if (ls >= 0) atomicAdd(&slotc[ls], 1u);
          }
          if (lane == 0) {
            recv_src[j] = EPD_SRC_PACK(me, t);
            rsrc[j] = EPD_SRC_PACK(me, t);
          }
        } else {
          if (lane < KMAX) {
            rm->slot[lane] = lane < K ? ls : (int16_t)-1;
            rm->w[lane] = lane < K ? lw : 0.f;
          }
          if (lane == 0) rm->src = EPD_SRC_PACK(me, t);
          __syncwarp();
          if (lane < 8) ((int4 *)(peer_base[r] + p.lay.mstg + (uint64_t)j * sizeof(RowMeta)))[lane] = ((const int4 *)rm)[lane];
          __syncwarp();
        }
      }
    }
    signal_peers(p, p.lay.dflag, seq);
    int to = wait_peers(p, (const uint64_t *)(lb + p.lay.dflag), seq, deadline);
    if (to != 0x7fffffff) {
      code = EPD_ERR_TIMEOUT;
      peer = to;
    } else {
      /* ---- receive: remote rows from staging into the arena ---- */
      const uint32_t own0 = st->recvbase[me], own1 = st->recvbase[me + 1];
      const RowMeta *mstg = (const RowMeta *)(lb + p.lay.mstg);
      const char *xstg = lb + p.lay.xstg;
      for (uint32_t j = blockIdx.x * NWARP + warp; j < N; j += G * NWARP) {
        if (j >= own0 && j < own1) continue;
        const char *srow = xstg + (uint64_t)j * rowb;
        if (fp8) {
          warp_copy_row((int4 *)(recv_x + (uint64_t)j * rowb), (const int4 *)srow, H / 16, lane);
          for (uint32_t g = lane; g < nsc; g += 32) recv_sc[(uint64_t)j * nsc + g] = __ldcg((const float *)(srow + H) + g);
        } else {
          warp_copy_row((int4 *)(recv_x + (uint64_t)j * rowb), (const int4 *)srow, H / 8, lane);
        }
        const RowMeta *m = mstg + j;
        if (lane < K) {
          int16_t ls = __ldcg(&m->slot[lane]);
          recv_idx[(uint64_t)j * K + lane] = ls;
          recv_w[(uint64_t)j * K + lane] = __ldcg(&m->w[lane]);
          if (ls >= 0) atomicAdd(&slotc[ls], 1u);
        }
        if (lane == 0) {
          int32_t s = __ldcg(&m->src);
          recv_src[j] = s;
          rsrc[j] = s;
        }
      }
    }
  }
  /* ---- completion: the last block writes counts and the record ---- */
  __syncthreads();
  if (tid == 0) {
    if (code != 0 && atomicCAS(&st->err[0], 0, code) == 0) atomicExch(&st->errpeer[0], peer);
    __threadfence();
    sh_last = atomicAdd(&st->dticket, 1u) == G - 1;
  }
  __syncthreads();
  if (!sh_last) return;
  __threadfence();
  const int c = atomicAdd(&st->err[0], 0);
  const int pe = atomicAdd(&st->errpeer[0], 0);
  if (c == 0) {
    int32_t *cnt = arena_buf<int32_t>(p, EPD_BUF_HT_RECV_COUNT);
    for (uint32_t s = tid; s < p.S; s += NTHR) {
      uint32_t v = __ldcg(&slotc[s]);
      cnt[s] = (int32_t)v;
      if (p.slot_tokens) p.slot_tokens[s] += v;
    }
  }
  __syncthreads();
  if (tid == 0) {
    st->derr = c;
    st->err[0] = 0;
    st->errpeer[0] = -1;
    st->dticket = 0;
    volatile epd_comp_t *comp = p.comp;
    if (comp) {
      comp->status = c;
      comp->peer = c ? pe : -1;
      comp->num_recv = (c == 0 || c == EPD_ERR_OVERFLOW) ? N : 0u;
      comp->map_version = st->map_version;
    }
    __threadfence_system();
  }
}

/* ---------------------------------------------------------------------------------------------------
 * combine: G blocks.
 * ------------------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(NTHR) ht_combine_kernel(const HTParams p) {
  __shared__ int sh_last;
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
  const int32_t *rsrc = (const int32_t *)(lb + p.lay.rsrc);
  int code = 0, peer = -1;

  if (derr == 0) {
    /* ---- expert side: push every remote row's partial to its source ---- */
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
  signal_peers(p, p.lay.cflag, seq);
  int to = wait_peers(p, (const uint64_t *)(lb + p.lay.cflag), seq, deadline);
  if (to != 0x7fffffff) {
    code = EPD_ERR_TIMEOUT;
    peer = to;
  } else if (derr != 0) {
    code = EPD_ERR_STATE;
  } else {
    /* ---- source side: OUT[t] = sum over dest ranks in rank order, f32 ---- */
    const TokRoute *route = (const TokRoute *)(lb + p.lay.route);
    const uint32_t *pos = (const uint32_t *)(lb + p.lay.pos);
    const char *cstg = lb + p.lay.cstg;
    const uint32_t own = st->sendbase[me];
    char *out = arena_buf<char>(p, EPD_BUF_OUT);
    for (uint32_t t = blockIdx.x * NWARP + warp; t < T; t += G * NWARP) {
      const uint32_t mask = route[t].mask & 0xffu;
      const int4 *rows[EPD_K_MAX_RANKS];
#pragma unroll
      for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
        rows[r] = nullptr;
        if (r < (int)R && ((mask >> r) & 1u))
          rows[r] = (uint32_t)r == me ? (const int4 *)(y + (uint64_t)(own + pos[(uint64_t)t * R + r]) * rowb)
                                      : (const int4 *)(cstg + ((uint64_t)r * M + t) * rowb);
      }
      int4 *orow = (int4 *)(out + (uint64_t)t * rowb);
      for (uint32_t v0 = lane; v0 < n16; v0 += 32 * 4) {
        float acc[4][8];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
          for (int q = 0; q < 8; q++) acc[i][q] = 0.f;
#pragma unroll
        for (int r = 0; r < EPD_K_MAX_RANKS; r++) {
          if (!rows[r]) continue;
          int4 b[4];
#pragma unroll
          for (int i = 0; i < 4; i++)
            if (v0 + i * 32 < n16) b[i] = __ldcg(rows[r] + v0 + i * 32);
#pragma unroll
          for (int i = 0; i < 4; i++) {
            const uint32_t *u = (const uint32_t *)&b[i];
#pragma unroll
            for (int q = 0; q < 4; q++) {
              acc[i][2 * q] += bf16_to_f(u[q] & 0xffffu);
              acc[i][2 * q + 1] += bf16_to_f(u[q] >> 16);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
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
  volatile epd_comp_t *comp = p.comp;
  if (comp) {
    comp->status = c;
    comp->peer = c ? pe : -1;
    comp->num_recv = N;
    comp->map_version = st->map_version;
  }
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
  l.route = take(M * sizeof(TokRoute));
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
};

static uint32_t ht_blocks(const epd_k_ht_geom_t *g) { return g->blocks ? g->blocks : EPD_K_HT_BLOCKS; }

static epd_result_t ht_check_geom(const epd_k_ht_geom_t *g, char *err, size_t errlen) {
  const char *f = "%s = %ld out of range (max %ld)";
  if (g->num_ranks < 1 || g->num_ranks > EPD_K_MAX_RANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "num_ranks", g->num_ranks, EPD_K_MAX_RANKS);
  if (g->rank >= g->num_ranks) return set_err(err, errlen, EPD_ERR_INVALID, f, "rank", g->rank, g->num_ranks - 1);
  if (g->hidden == 0 || g->hidden % 128 || g->hidden > EPD_K_MAX_HIDDEN)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld must be a multiple of 128 up to %ld", "hidden", g->hidden,
                   EPD_K_MAX_HIDDEN);
  if (g->topk < 1 || g->topk > EPD_K_MAX_TOPK)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "topk", g->topk, EPD_K_MAX_TOPK);
  if (g->max_tokens < 1 || g->max_tokens > EPD_K_HT_MAX_TOKENS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "max_tokens", g->max_tokens, EPD_K_HT_MAX_TOKENS);
  if (g->capacity < 1 || g->capacity > EPD_K_HT_MAX_TOKENS * EPD_K_MAX_RANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, f, "capacity", g->capacity, EPD_K_HT_MAX_TOKENS * EPD_K_MAX_RANKS);
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
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: NULL handle or unaligned offset %ld (%ld)", "epd_k_ht_create",
                   (long)window_offset, 4096);
  epd_k_ht_t *k = (epd_k_ht_t *)calloc(1, sizeof(*k));
  if (!k) return EPD_ERR_NOMEM;
  k->g = *g;
  k->g.blocks = ht_blocks(g);
  k->comm = lsa_comm;
  k->win = window;
  k->local = (char *)window_local + window_offset;
  k->win_off = window_offset;
  k->lay = make_layout(&k->g, k->g.blocks);
  /* The device communicator only checks that the LSA team is what the geometry says. */
  ncclDevCommRequirements_t req;
  memset(&req, 0, sizeof(req));
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
  cudaError_t ce = cudaSuccess;
  for (int b = 0; b < EPD_NUM_BANKS && ce == cudaSuccess; b++)
    ce = cudaMemset(k->local + b * k->lay.bank_bytes, 0, k->lay.ctrl_bytes);
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    if (err && errlen) snprintf(err, errlen, "zeroing the HT area: %s", cudaGetErrorString(ce));
    ncclDevCommDestroy(lsa_comm, &k->dev);
    free(k);
    return EPD_ERR_CUDA;
  }
  *out = k;
  return EPD_OK;
}

void epd_k_ht_destroy(epd_k_ht_t *k) {
  if (!k) return;
  if (k->have_dev) ncclDevCommDestroy(k->comm, &k->dev);
  free(k);
}

epd_result_t epd_k_ht_reset(epd_k_ht_t *k, void *stream) {
  for (int b = 0; b < EPD_NUM_BANKS; b++) {
    cudaError_t ce = cudaMemsetAsync(k->local + b * k->lay.bank_bytes, 0, k->lay.ctrl_bytes, (cudaStream_t)stream);
    if (ce != cudaSuccess) return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

const epd_k_ht_geom_t *epd_k_ht_geom(const epd_k_ht_t *k) { return &k->g; }

epd_result_t epd_k_ht_launch(epd_k_ht_t *k, const epd_k_arena_t *arena, const epd_k_ht_op_t *op, void *stream,
                             char *err, size_t errlen) {
  if (!k || !arena || !op)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s: NULL argument (%ld %ld)", "epd_k_ht_launch", 0, 0);
  if (op->bank >= EPD_NUM_BANKS)
    return set_err(err, errlen, EPD_ERR_INVALID, "%s = %ld out of range (max %ld)", "bank", op->bank, EPD_NUM_BANKS - 1);
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
  cudaStream_t s = (cudaStream_t)stream;
  if (op->op == EPD_OP_HT_DISPATCH) {
    uint32_t T = p.T > p.M ? 0 : p.T;
    ht_route_kernel<<<T ? (T + NWARP - 1) / NWARP : 1, NTHR, 0, s>>>(p);
    ht_plan_kernel<<<1, PLAN_THREADS, 0, s>>>(p);
    ht_dispatch_kernel<<<p.G, NTHR, 0, s>>>(p);
  } else {
    ht_combine_kernel<<<p.G, NTHR, 0, s>>>(p);
  }
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) {
    if (err && errlen) snprintf(err, errlen, "HT kernel launch: %s", cudaGetErrorString(ce));
    return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

} /* extern "C" */

/* ---- benchmark helper: plain copy kernel (16-byte vectors, 8 in flight per thread) ---- */
namespace {
__global__ void __launch_bounds__(512) copy_kernel(int4 *dst, const int4 *src, size_t n16) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < n16; i0 += stride * 8) {
    int4 b[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
      if (i0 + j * stride < n16) b[j] = ld_nc_v4(src + i0 + j * stride);
#pragma unroll
    for (int j = 0; j < 8; j++)
      if (i0 + j * stride < n16) dst[i0 + j * stride] = b[j];
  }
}
} /* namespace */

extern "C" epd_result_t epd_k_copy(void *dst, const void *src, size_t bytes, uint32_t blocks, void *stream) {
  if ((uintptr_t)dst % 16 || (uintptr_t)src % 16 || bytes % 16 || !blocks) return EPD_ERR_INVALID;
  copy_kernel<<<blocks, 512, 0, (cudaStream_t)stream>>>((int4 *)dst, (const int4 *)src, bytes / 16);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}
