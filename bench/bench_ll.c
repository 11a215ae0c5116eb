/*
 * bench_ll.c - LL dispatch/combine benchmark on the GPUs of one process (in-process engine path).
 *
 * Setting (defaults): 2 ranks (4 with -DEPD_BENCH_RANKS=4: epd-bench-r4), 128 tokens per rank, hidden 7168,
 * top-8, 256 experts, random routing (8 distinct experts per token), FP8 and BF16 dispatch, BF16 combine.
 * Reports, side by side: (a) kernel time of dispatch and combine: CUDA events around each kernel on every
 * rank, the ranks released together by a gate kernel; median (and p10/p90) over iterations after warm-up,
 * inputs alternating between the two banks (two input sets); (c) in-process end-to-end: host clock from
 * launching dispatch+combine on every rank to the end of the last stream synchronisation; (d) baselines in
 * the same run on the same communicators: NCCL grouped ncclSend/ncclRecv of each token once per destination
 * rank (dispatch) and of one partial per (token, rank) back (combine), packed buffers given for free; and
 * ncclAllGather (x) + ncclReduceScatter (out); (e) the byte floor at 450 GB/s per direction: the bytes the
 * busiest GPU must send to (or receive from) all its peers together over NVLink. Sweeps tokens 1..128. Writes
 * JSON and a Markdown table (bench_ll.*, 4 ranks: bench_ll_r4.*) to the directory of argv[1] (default ".").
 * With fewer GPUs than ranks the ranks share them (rank r on GPU r % count, NCCL's multi-rank mode, each rank
 * on its part of the blocks: ll_harness.h), said in one line and in the results: no NVLink then, the figures
 * are not comparable with those of a GPU per rank. Exits 77 without a GPU or with more than 4 ranks on one.
 * EPD_BENCH_QUICK=1: (a) at the main setting only, printed (A/B runs of kernel builds).
 */
#if EPD_WITH_CUDA
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "../tests/gpu/ll_harness.h"

#ifdef EPD_BENCH_RANKS /* epd-bench-r4: the same bench on 4 GPUs of one node */
#define NR EPD_BENCH_RANKS
#else
#define NR 2
#endif
#define ALL ((1u << NR) - 1) /* rank mask of every rank */
#define EPD_STR_(x) #x
#define EPD_STR(x) EPD_STR_(x)
#define E_ 256
#define H_ 7168
#define K_ 8
#define M_ 128
#define S_ 128
#define ITERS 300
#define WARM 30

static llh_t H;
static uint32_t *gate_host;
static uint32_t gate_val;

#define DIE(...)                               \
  do {                                         \
    fprintf(stderr, "bench_ll: " __VA_ARGS__); \
    fprintf(stderr, "\n");                     \
    exit(1);                                   \
  } while (0)
#define CU(e)                                                                                   \
  do {                                                                                          \
    cudaError_t c_ = (e);                                                                       \
    if (c_ != cudaSuccess) DIE("%s:%d %s: %s", __FILE__, __LINE__, #e, cudaGetErrorString(c_)); \
  } while (0)
#define NC(e)                                                                                   \
  do {                                                                                          \
    ncclResult_t n_ = (e);                                                                      \
    if (n_ != ncclSuccess) DIE("%s:%d %s: %s", __FILE__, __LINE__, #e, ncclGetErrorString(n_)); \
  } while (0)

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
  uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint16_t bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}
static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
typedef struct stat3 {
  double p50, p10, p90;
} stat3_t;
static stat3_t stats(double *v, int n) {
  qsort(v, n, sizeof *v, cmpd);
  stat3_t s = {v[n / 2], v[n / 10], v[(n * 9) / 10]};
  return s;
}

/* Per-rank routing of the current input set (host copy) for the baselines and byte floor. */
static int64_t topk_h[2][NR][M_ * K_];
static uint32_t per_dest[2][NR][NR]; /* [set][src][dst] tokens */

static void make_inputs(void) {
  uint32_t per = E_ / NR;
  uint16_t *x = malloc((size_t)M_ * H_ * 2);
  float *w = malloc(M_ * K_ * 4);
  for (int set = 0; set < 2; set++)
    for (int r = 0; r < NR; r++) {
      for (size_t i = 0; i < (size_t)M_ * H_; i++) x[i] = bf16((float)((rnd() >> 40) / 16777216.0 * 4 - 2));
      memset(per_dest[set][r], 0, sizeof per_dest[set][r]);
      for (int t = 0; t < M_; t++) {
        uint32_t mask = 0;
        for (int k = 0; k < K_; k++) {
          int64_t e;
          int dup;
          do {
            e = (int64_t)(rnd() % E_);
            dup = 0;
            for (int j = 0; j < k; j++) dup |= topk_h[set][r][t * K_ + j] == e;
          } while (dup);
          topk_h[set][r][t * K_ + k] = e;
          w[t * K_ + k] = (float)((rnd() >> 40) / 16777216.0 * 0.9 + 0.05);
          mask |= 1u << (e / per);
        }
        for (int d = 0; d < NR; d++)
          if ((mask >> d) & 1) per_dest[set][r][d]++;
      }
      CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
      CU(cudaMemcpy(llh_buf(&H, r, set, EPD_BUF_X), x, (size_t)M_ * H_ * 2, cudaMemcpyHostToDevice));
      CU(cudaMemcpy(llh_buf(&H, r, set, EPD_BUF_TOPK_IDX), topk_h[set][r], M_ * K_ * 8,
                    cudaMemcpyHostToDevice));
      CU(cudaMemcpy(llh_buf(&H, r, set, EPD_BUF_TOPK_WEIGHTS), w, M_ * K_ * 4, cudaMemcpyHostToDevice));
      /* expert outputs: random BF16 in the first 64 rows of every slot */
      size_t rowb = (size_t)H_ * 2, RM = (size_t)NR * M_;
      uint16_t *y = malloc(64 * rowb);
      for (size_t i = 0; i < 64 * (size_t)H_; i++) y[i] = bf16((float)((rnd() >> 40) / 16777216.0 * 4 - 2));
      for (int s = 0; s < S_; s++)
        CU(cudaMemcpy((char *)llh_buf(&H, r, set, EPD_BUF_LL_Y) + s * RM * rowb, y, 64 * rowb,
                      cudaMemcpyHostToDevice));
      free(y);
      CU(cudaDeviceSynchronize()); /* legacy-stream copies do not order against the non-blocking streams */
    }
  free(x);
  free(w);
}

static void gate_all(void) {
  gate_val++;
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    if (epd_k_gate(gate_host, gate_val, 2000000000ull, H.kh.st[r])) DIE("gate launch");
  }
}
static void gate_open(void) {
  __atomic_store_n(gate_host, gate_val, __ATOMIC_SEQ_CST);
}

static void check_comp(int which) {
  for (int r = 0; r < NR; r++) {
    epd_comp_t c;
    if (llh_comp(&H, r, which, &c)) DIE("comp read");
    if (c.status) DIE("rank %d op %d status %d peer %d", r, which, c.status, c.peer);
  }
}

/* Record event i of every rank on the rank's stream. */
static void record_all(cudaEvent_t ev[NR][4], int i) {
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaEventRecord(ev[r][i], H.kh.st[r]));
  }
}

/* The slowest rank's time from event 0 to 1 (*a) and from event b0 to b0 + 1 (*b), in microseconds. */
static void slowest_us(cudaEvent_t ev[NR][4], int b0, double *a, double *b) {
  *a = *b = 0;
  for (int r = 0; r < NR; r++) {
    float x, y;
    CU(cudaEventElapsedTime(&x, ev[r][0], ev[r][1]));
    CU(cudaEventElapsedTime(&y, ev[r][b0], ev[r][b0 + 1]));
    if (x * 1e3 > *a) *a = x * 1e3;
    if (y * 1e3 > *b) *b = y * 1e3;
  }
}

/* Two launches on every rank, each between two events, the ranks released together by the gate: medians
 * over ITERS of the slower rank's time of each (*s1, *s2). launch(which, iteration, arg) enqueues launch
 * `which` (0, 1) on every rank's stream; prep (NULL: none) enqueues untimed work before it, after the
 * gate for launch 0 and between the two timed spans for launch 1 (events: gate, prep 0, ev0, launch 0, ev1,
 * [prep 1, ev2,] launch 1, ev2 or ev3). */
typedef void (*launch_fn)(int which, int it, void *arg);
static void timed_pairs(launch_fn launch, launch_fn prep, void *arg, stat3_t *s1, stat3_t *s2) {
  static double v1[ITERS], v2[ITERS];
  cudaEvent_t ev[NR][4];
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    for (int i = 0; i < 4; i++) CU(cudaEventCreate(&ev[r][i]));
  }
  const int b0 = prep ? 2 : 1; /* the event that starts launch 1's span */
  for (int it = -WARM; it < ITERS; it++) {
    gate_all();
    if (prep) prep(0, it, arg);
    record_all(ev, 0);
    launch(0, it, arg);
    record_all(ev, 1);
    if (prep) {
      prep(1, it, arg);
      record_all(ev, 2);
    }
    launch(1, it, arg);
    record_all(ev, b0 + 1);
    gate_open();
    if (llh_sync(&H, ALL)) DIE("%s", H.kh.err);
    if (it < 0) continue;
    slowest_us(ev, b0, &v1[it], &v2[it]);
  }
  *s1 = stats(v1, ITERS);
  *s2 = stats(v2, ITERS);
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < 4; i++) cudaEventDestroy(ev[r][i]);
}

struct ll_pair {
  uint32_t flags, nt[NR];
};
static void launch_ll(int which, int it, void *arg) {
  const struct ll_pair *a = arg;
  const uint32_t bank = (uint32_t)(it + WARM) & 1;
  if (which == 0 && llh_launch(&H, ALL, EPD_OP_LL_DISPATCH, bank, a->nt, a->flags, 1000000000ull))
    DIE("%s", H.kh.err);
  if (which == 1 && llh_launch(&H, ALL, EPD_OP_LL_COMBINE, bank, NULL, 0, 1000000000ull)) DIE("%s", H.kh.err);
}

/* (a) kernel times for T tokens: medians of dispatch (*ds) and of the combine after it (*cs); with prep
 * (rewrite_inputs, below: (a')) untimed work before each. */
static void kernel_times(uint32_t T, uint32_t flags, launch_fn prep, stat3_t *ds, stat3_t *cs) {
  struct ll_pair a = {.flags = flags};
  for (int r = 0; r < NR; r++) a.nt[r] = T;
  timed_pairs(launch_ll, prep, &a, ds, cs);
  check_comp(0);
  check_comp(1);
}

/* (a') the untimed work before each op: its inputs rewritten as a producer would leave them, so that they
 * sit in L2 as fresh outputs (where (a) reads x and y written long before): before the dispatch the token
 * rows x (the layer before writes them), before the combine the received rows of y (the expert GEMM). */
static void rewrite_inputs(int which, int it, void *arg) {
  const struct ll_pair *a = arg;
  const uint32_t bank = (uint32_t)(it + WARM) & 1;
  const size_t rowb = (size_t)H_ * 2, RM = (size_t)NR * M_;
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    if (which == 0 && epd_k_rewrite_rows(llh_buf(&H, r, bank, EPD_BUF_X), NULL, a->nt[r], 1, rowb * a->nt[r],
                                         (uint32_t)rowb, a->nt[r], H.kh.st[r]))
      DIE("rewrite x");
    if (which == 1 && epd_k_rewrite_rows(llh_buf(&H, r, bank, EPD_BUF_LL_Y),
                                         (const int32_t *)llh_buf(&H, r, bank, EPD_BUF_LL_RECV_COUNT), 0, S_,
                                         RM * rowb, (uint32_t)rowb, (uint32_t)RM, H.kh.st[r]))
      DIE("rewrite y");
  }
}

static void launch_empty(int which, int it, void *arg) {
  (void)which;
  (void)it;
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    if (epd_k_empty(*(const uint32_t *)arg, H.kh.st[r])) DIE("empty kernel launch");
  }
}

/* (f) the launch floor: an empty kernel of the LL kernels' grid, timed like (a): what an op costs before
 * its body does anything. */
static stat3_t empty_times(void) {
  uint32_t blocks = epd_k_ll_geom(H.k[0])->blocks;
  stat3_t first, second;
  timed_pairs(launch_empty, NULL, &blocks, &first, &second);
  return first;
}

/* (c) in-process end to end: host launch of dispatch+combine on every rank to the last sync. */
static stat3_t e2e_times(uint32_t T, uint32_t flags) {
  static double v[ITERS];
  uint32_t nt[NR];
  for (int r = 0; r < NR; r++) nt[r] = T;
  for (int it = -WARM; it < ITERS; it++) {
    uint32_t bank = (uint32_t)(it + WARM) & 1;
    double t0 = now_us();
    if (llh_launch(&H, ALL, EPD_OP_LL_DISPATCH, bank, nt, flags, 1000000000ull)) DIE("%s", H.kh.err);
    if (llh_launch(&H, ALL, EPD_OP_LL_COMBINE, bank, NULL, 0, 1000000000ull)) DIE("%s", H.kh.err);
    if (llh_sync(&H, ALL)) DIE("%s", H.kh.err);
    if (it >= 0) v[it] = now_us() - t0;
  }
  return stats(v, ITERS);
}

/* (d) NCCL baselines on the world communicators. */
static void nccl_baselines(int set, size_t disp_row, stat3_t *sr_d, stat3_t *sr_c, stat3_t *ag,
                           stat3_t *rsc) {
  static double v1[ITERS], v2[ITERS], v3[ITERS], v4[ITERS];
  void *sbuf[NR], *rbuf[NR], *agbuf[NR], *rsbuf[NR];
  size_t comb_row = (size_t)H_ * 2;
  size_t maxrow = disp_row > comb_row ? disp_row : comb_row;
  cudaEvent_t ev[NR][4];
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaMalloc(&sbuf[r], (size_t)NR * M_ * maxrow));
    CU(cudaMalloc(&rbuf[r], (size_t)NR * M_ * maxrow));
    CU(cudaMalloc(&agbuf[r], (size_t)NR * M_ * H_ * 2));
    CU(cudaMalloc(&rsbuf[r], (size_t)NR * M_ * H_ * 2));
    CU(cudaMemset(sbuf[r], 0x3c, (size_t)NR * M_ * maxrow));
    CU(cudaMemset(agbuf[r], 0x3c, (size_t)NR * M_ * H_ * 2));
    CU(cudaMemset(rsbuf[r], 0x3c, (size_t)NR * M_ * H_ * 2));
    for (int i = 0; i < 3; i++) CU(cudaEventCreate(&ev[r][i]));
  }
  for (int pass = 0; pass < 2; pass++) {
    for (int it = -WARM; it < ITERS; it++) {
      gate_all();
      record_all(ev, 0);
      if (pass == 0) {
        /* dispatch: each token once per remote destination rank; combine: one partial back */
        for (int ph = 0; ph < 2; ph++) {
          size_t row = ph == 0 ? disp_row : comb_row;
          NC(ncclGroupStart());
          for (int r = 0; r < NR; r++)
            for (int d = 0; d < NR; d++) {
              if (d == r) continue;
              size_t ns = (ph == 0 ? per_dest[set][r][d] : per_dest[set][d][r]) * row;
              size_t nr = (ph == 0 ? per_dest[set][d][r] : per_dest[set][r][d]) * row;
              NC(ncclSend((char *)sbuf[r] + (size_t)d * M_ * maxrow, ns, ncclUint8, d,
                          epd_cc_world(H.kh.cc, r), H.kh.st[r]));
              NC(ncclRecv((char *)rbuf[r] + (size_t)d * M_ * maxrow, nr, ncclUint8, d,
                          epd_cc_world(H.kh.cc, r), H.kh.st[r]));
            }
          NC(ncclGroupEnd());
          record_all(ev, 1 + ph);
        }
      } else {
        NC(ncclGroupStart());
        for (int r = 0; r < NR; r++)
          NC(ncclAllGather((char *)agbuf[r] + (size_t)r * M_ * H_ * 2, agbuf[r], (size_t)M_ * H_,
                           ncclBfloat16, epd_cc_world(H.kh.cc, r), H.kh.st[r]));
        NC(ncclGroupEnd());
        record_all(ev, 1);
        NC(ncclGroupStart());
        for (int r = 0; r < NR; r++)
          NC(ncclReduceScatter(rsbuf[r], (char *)agbuf[r] + (size_t)r * M_ * H_ * 2, (size_t)M_ * H_,
                               ncclBfloat16, ncclSum, epd_cc_world(H.kh.cc, r), H.kh.st[r]));
        NC(ncclGroupEnd());
        record_all(ev, 2);
      }
      gate_open();
      if (llh_sync(&H, ALL)) DIE("%s", H.kh.err);
      if (it < 0) continue;
      double a, b;
      slowest_us(ev, 1, &a, &b);
      if (pass == 0) {
        v1[it] = a;
        v2[it] = b;
      } else {
        v3[it] = a;
        v4[it] = b;
      }
    }
  }
  *sr_d = stats(v1, ITERS);
  *sr_c = stats(v2, ITERS);
  *ag = stats(v3, ITERS);
  *rsc = stats(v4, ITERS);
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    cudaFree(sbuf[r]);
    cudaFree(rbuf[r]);
    cudaFree(agbuf[r]);
    cudaFree(rsbuf[r]);
  }
}

/* Phase profile from in-kernel %globaltimer stamps of block 0 (rank 0), medians over iterations. */
static void trace_run(uint32_t T, uint32_t flags, FILE *out) {
  enum { NI = 100 };
  static double ph[2][8][NI], fph[2][8][NI];
  uint64_t *tr[NR];
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaMalloc((void **)&tr[r], 2 * 16 * sizeof(uint64_t)));
    CU(cudaMemset(tr[r], 0, 2 * 16 * sizeof(uint64_t)));
  }
  for (int it = -10; it < NI; it++) {
    uint32_t bank = (uint32_t)(it + 10) & 1;
    gate_all();
    for (int opi = 0; opi < 2; opi++)
      for (int r = 0; r < NR; r++) {
        CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
        epd_k_ll_op_t op;
        memset(&op, 0, sizeof op);
        op.op = opi ? EPD_OP_LL_COMBINE : EPD_OP_LL_DISPATCH;
        op.flags = flags;
        op.num_tokens = T;
        op.bank = bank;
        op.timeout_ns = 1000000000ull;
        op.map = H.kh.map_dev[r];
        op.comp = H.kh.comp[r] + opi;
        op.trace = tr[r] + 16 * opi;
        if (epd_k_ll_launch(H.k[r], &H.kh.ar[r], &op, H.kh.st[r], H.kh.err, sizeof H.kh.err))
          DIE("%s", H.kh.err);
      }
    gate_open();
    if (llh_sync(&H, ALL)) DIE("%s", H.kh.err);
    if (it < 0) continue;
    uint64_t h[32];
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, 0)));
    CU(cudaMemcpy(h, tr[0], sizeof h, cudaMemcpyDeviceToHost));
    for (int opi = 0; opi < 2; opi++) {
      const uint64_t *hb = h + 16 * opi;
      for (int i = 1; i < 8; i++) ph[opi][i][it] = (double)(hb[i] - hb[i == 7 ? 0 : i - 1]) / 1e3;
      /* stamps 8..15 of a -DEPD_LL_FINE_TRACE build, relative to stamp 0 (0 where not written) */
      for (int i = 0; i < 8; i++)
        fph[opi][i][it] = hb[8 + i] ? ((double)hb[8 + i] - (double)hb[0]) / 1e3 : 0.0;
    }
  }
  static const char *nm[8] = {"", "send", "fence", "flag", "wait", "recv", "finish", "total(last blk)"};
  for (int opi = 0; opi < 2; opi++) {
    fprintf(out, "trace T=%u %s %s:", T, flags ? "fp8" : "bf16", opi ? "combine" : "dispatch");
    for (int i = 1; i < 8; i++) fprintf(out, " %s %.2f", nm[i], stats(ph[opi][i], NI).p50);
    fprintf(out, "\n");
    if (stats(fph[opi][7], NI).p50 != 0.0 || stats(fph[opi][0], NI).p50 != 0.0) {
      fprintf(out, "  fine stamps 8..15 from stamp 0:");
      for (int i = 0; i < 8; i++) fprintf(out, " %.2f", stats(fph[opi][i], NI).p50);
      fprintf(out, "\n");
    }
  }
  for (int r = 0; r < NR; r++) cudaFree(tr[r]);
}

/* (g) The persistent kernel in-process (EPD_BENCH_PERSIST=1, or =only for this section alone): the kernel
 * the daemon runs under MPS, here on this bench's arenas (plain device memory), no MPS. */

/* One persistent kernel per rank: host-mapped queue, control, progress and stop word; with `twin`, a
 * device twin queue (GPU memory, each slot's twin_host naming its host copy) is the one polled. */
typedef struct pers {
  epd_queue_t *q[NR], *dq[NR]; /* host copy (host pointer); twin (device pointer) or NULL */
  epd_k_pctl_t *ctl[NR];
  epd_k_pprog_t *prog[NR];
  uint64_t *dlim[NR];
  cudaStream_t ps[NR];
} pers_t;

static void pers_start(pers_t *P, int twin) {
  memset(P, 0, sizeof *P);
  epd_queue_t *img = calloc(1, sizeof *img);
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    if (epd_k_ll_reset(H.k[r], H.kh.st[r])) DIE("reset");
    CU(cudaStreamSynchronize(H.kh.st[r]));
    const unsigned fl = cudaHostAllocMapped | cudaHostAllocPortable;
    CU(cudaHostAlloc((void **)&P->q[r], sizeof *P->q[r], fl));
    CU(cudaHostAlloc((void **)&P->ctl[r], sizeof *P->ctl[r], fl));
    CU(cudaHostAlloc((void **)&P->prog[r], sizeof *P->prog[r], fl));
    CU(cudaHostAlloc((void **)&P->dlim[r], sizeof *P->dlim[r], fl));
    memset(P->q[r], 0, sizeof *P->q[r]);
    memset(P->ctl[r], 0, sizeof *P->ctl[r]);
    memset(P->prog[r], 0, sizeof *P->prog[r]);
    *P->dlim[r] = UINT64_MAX;
    CU(cudaStreamCreateWithFlags(&P->ps[r], cudaStreamNonBlocking));
    epd_k_persist_t a;
    memset(&a, 0, sizeof a);
    CU(cudaHostGetDevicePointer((void **)&a.queue, P->q[r], 0));
    a.dqueue = a.queue;
    if (twin) {
      for (uint32_t s = 0; s < EPD_QUEUE_SLOTS; s++)
        img->slot[s].twin_host = (uint64_t)(uintptr_t)&a.queue->slot[s];
      CU(cudaMalloc((void **)&P->dq[r], sizeof *P->dq[r]));
      CU(cudaMemcpy(P->dq[r], img, sizeof *img, cudaMemcpyHostToDevice));
      CU(cudaDeviceSynchronize()); /* a pageable copy may return before it lands; nothing runs here yet */
      a.dqueue = P->dq[r];
    }
    CU(cudaHostGetDevicePointer((void **)&a.dlimit, P->dlim[r], 0));
    CU(cudaHostGetDevicePointer((void **)&a.ctl, P->ctl[r], 0));
    CU(cudaHostGetDevicePointer((void **)&a.prog, P->prog[r], 0));
    a.index0 = 1;
    a.timeout_ns = 1000000000ull;
    if (epd_k_ll_persistent_launch(H.k[r], &H.kh.ar[r], H.kh.map_dev[r], &a, P->ps[r]))
      DIE("persistent launch");
  }
  free(img);
}

/* Stop the kernels (stop word 0), wait for them, free everything, reset the LL state. */
static void pers_stop(pers_t *P) {
  for (int r = 0; r < NR; r++) __atomic_store_n(P->dlim[r], 0, __ATOMIC_SEQ_CST);
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaStreamSynchronize(P->ps[r]));
  }
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaStreamDestroy(P->ps[r]));
    if (P->dq[r]) CU(cudaFree(P->dq[r]));
    CU(cudaFreeHost(P->q[r]));
    CU(cudaFreeHost(P->ctl[r]));
    CU(cudaFreeHost(P->prog[r]));
    CU(cudaFreeHost(P->dlim[r]));
    if (epd_k_ll_reset(H.k[r], H.kh.st[r])) DIE("reset");
    CU(cudaStreamSynchronize(H.kh.st[r]));
  }
}

/* Wait until rank r's persistent kernel has completed n ops since its launch (its progress block: an op's
 * record is written after its DONE), at most 5 s from t0. */
static void pers_wait_ops(pers_t *P, int r, uint64_t n, double t0) {
  while (__atomic_load_n(&P->prog[r]->ops, __ATOMIC_ACQUIRE) < n)
    if (now_us() - t0 > 5e6)
      DIE("persistent kernel of rank %d: %llu of %llu ops completed (exit reason %u)", r,
          (unsigned long long)P->prog[r]->ops, (unsigned long long)n, P->prog[r]->reason);
}

/* Host-submitted ops, one at a time on every rank at once (dispatch, combine, banks alternating): the
 * kernel's progress records give SUBMITTED seen -> completion (latency), seen -> every rank agreed, the
 * time from the completion stamp to the end of the completion writes, and block 0's stamps after the
 * release, printed in the phases of the standalone profile (EPD_BENCH_TRACE) to compare the two. */
static void persist_run(uint32_t T, uint32_t flags, int nops, FILE *out) {
  enum { PN = 400 };
  static double lat[2][PN], agr[2][PN], tail[2][PN], ph[2][8][PN];
  int n[2] = {0, 0};
  if (nops > 2 * PN) nops = 2 * PN;
  pers_t P;
  pers_start(&P, 0);
  for (int i = 0; i < nops; i++) {
    const int opi = i & 1;
    const uint32_t si = (uint32_t)i % EPD_QUEUE_SLOTS;
    for (int r = 0; r < NR; r++) {
      epd_desc_t d;
      memset(&d, 0, sizeof d);
      d.op = opi ? EPD_OP_LL_COMBINE : EPD_OP_LL_DISPATCH;
      d.flags = opi ? 0 : flags;
      d.num_tokens = T;
      d.bank = (uint32_t)(i / 2) & 1;
      memcpy((void *)&P.q[r]->slot[si].desc, &d, sizeof d);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int r = 0; r < NR; r++)
      __atomic_store_n(&P.q[r]->slot[si].state, EPD_SLOT_SUBMITTED, __ATOMIC_RELEASE);
    const double t0 = now_us();
    for (int r = 0; r < NR; r++) {
      pers_wait_ops(&P, r, (uint64_t)i + 1, t0);
      if (P.q[r]->slot[si].comp.status)
        DIE("persistent op %d: rank %d status %d", i, r, P.q[r]->slot[si].comp.status);
    }
    double l = 0;
    for (int r = 0; r < NR; r++) {
      const epd_k_prec_t *rc = (const epd_k_prec_t *)&P.prog[r]->rec[i % EPD_K_PREC];
      if (rc->latency_ns / 1e3 > l) l = rc->latency_ns / 1e3;
    }
    const epd_k_prec_t *r0 = (const epd_k_prec_t *)&P.prog[0]->rec[i % EPD_K_PREC];
    for (int r = 0; r < NR; r++) __atomic_store_n(&P.q[r]->slot[si].state, EPD_SLOT_FREE, __ATOMIC_RELEASE);
    if (i < 20) continue; /* warm-up */
    const int k = n[opi]++;
    lat[opi][k] = l;
    agr[opi][k] = r0->agree_ns / 1e3;
    tail[opi][k] = ((double)r0->latency_ns - (double)r0->phase_ns[7]) / 1e3;
    for (int j = 1; j < 8; j++)
      ph[opi][j][k] = ((double)r0->phase_ns[j] - (double)r0->phase_ns[j == 7 ? 0 : j - 1]) / 1e3;
    ph[opi][0][k] = r0->phase_ns[0] / 1e3;
  }
  pers_stop(&P);
  static const char *nm[8] = {"body start", "send", "fence",  "flag",
                              "wait",       "recv", "finish", "total(last blk)"};
  for (int opi = 0; opi < 2; opi++) {
    fprintf(out,
            "persistent T=%u %s %s: latency(slower rank) %.2f agreed %.2f release+completion writes %.2f |",
            T, flags ? "fp8" : "bf16", opi ? "combine" : "dispatch", stats(lat[opi], n[opi]).p50,
            stats(agr[opi], n[opi]).p50, stats(tail[opi], n[opi]).p50);
    for (int j = 0; j < 8; j++) fprintf(out, " %s %.2f", nm[j], stats(ph[opi][j], n[opi]).p50);
    fprintf(out, "\n");
  }
  fflush(out);
}

/* The client view: served the way the daemon serves a worker under MPS, through a device twin, a
 * one-thread client kernel per rank (bench/e2e/e2e_dev.cu, epd_device.h) submits dispatch/combine steps
 * back to back and stamps the GPU timer from its submit to the completion it sees. Compare with (a),
 * the standalone kernels' event-timed times. */
int e2e_dev_launch(void *slots, uint32_t first, uint32_t nsteps, uint32_t bank0, uint32_t ntok,
                   uint32_t flags, uint64_t timeout_ns, uint64_t *ts, int *status, void *stream);
int e2e_dev_launch_tx(void *slots, uint32_t first, uint32_t nsteps, uint32_t bank0, uint32_t ntok,
                      uint32_t flags, uint64_t timeout_ns, uint64_t *ts, int *status, uint64_t *tx,
                      void *stream);
int e2e_dev_load(void);
static void persist_dev_run(uint32_t T, uint32_t flags, uint32_t nsteps, FILE *out) {
  enum { WARMUP = 20, MAXN = 4096 };
  static double cl[2][MAXN], dl[2][MAXN];
  /* rank 0's handoff, the last EPD_K_PREC ops (their progress records), all from the client's stamp
   * before the submit call: [0] the submit call, [1] -> the kernel saw SUBMITTED (includes most of [0]),
   * [2] seen -> completion writes done, [3] -> the client saw DONE (negative: it saw DONE before the
   * kernel's last stamp), [4] DONE seen -> the wait returned (record read, slot freed); [1] + [2] + [3] +
   * [4] is the "submit -> DONE seen" time (which ends when the wait returns) */
  static double hs[2][5][EPD_K_PREC];
  int hn[2] = {0, 0};
  uint64_t *ts[NR], *tx[NR];
  int *dst[NR];
  cudaStream_t cs[NR];
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    if (e2e_dev_load()) DIE("loading the client kernel");
    CU(cudaMalloc((void **)&ts[r], (size_t)nsteps * 6 * sizeof(uint64_t)));
    CU(cudaMalloc((void **)&tx[r], (size_t)nsteps * 4 * sizeof(uint64_t)));
    CU(cudaMalloc((void **)&dst[r], sizeof(int)));
    CU(cudaStreamCreateWithFlags(&cs[r], cudaStreamNonBlocking));
  }
  pers_t P;
  pers_start(&P, 1);
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    if (e2e_dev_launch_tx(P.dq[r]->slot, 0, nsteps, 0, T, flags, 2000000000ull, ts[r], dst[r], tx[r], cs[r]))
      DIE("client kernel launch");
  }
  int n = 0;
  uint64_t *h = malloc((size_t)nsteps * 6 * sizeof(uint64_t));
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaStreamSynchronize(cs[r]));
    int st = -1;
    CU(cudaMemcpy(&st, dst[r], sizeof st, cudaMemcpyDeviceToHost));
    if (st) DIE("persistent, client kernel of rank %d: status %d", r, st);
    CU(cudaMemcpy(h, ts[r], (size_t)nsteps * 6 * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    n = 0;
    for (uint32_t i = WARMUP; i < nsteps && n < MAXN; i++, n++)
      for (int o = 0; o < 2; o++) {
        const double c = (double)(h[6 * i + 2 * o + 1] - h[6 * i + 2 * o]) / 1e3,
                     d = (double)h[6 * i + 4 + o] / 1e3;
        if (r == 0 || c > cl[o][n]) cl[o][n] = c; /* the slower rank of each op */
        if (r == 0 || d > dl[o][n]) dl[o][n] = d;
      }
    if (r == 0) {
      /* the kernel writes an op's progress record after its DONE: wait for the last one */
      pers_wait_ops(&P, r, 2ull * nsteps, now_us());
      uint64_t *x = malloc((size_t)nsteps * 4 * sizeof(uint64_t));
      CU(cudaMemcpy(x, tx[r], (size_t)nsteps * 4 * sizeof(uint64_t), cudaMemcpyDeviceToHost));
      const uint64_t nops = 2ull * nsteps;
      for (uint64_t op = nops > EPD_K_PREC ? nops - EPD_K_PREC : 0; op < nops; op++) {
        const epd_k_prec_t *rc = (const epd_k_prec_t *)&P.prog[r]->rec[op % EPD_K_PREC];
        if (rc->seq != op + 1) continue;
        const uint64_t i = op / 2, o = op % 2, t0 = h[6 * i + 2 * o], t1 = h[6 * i + 2 * o + 1];
        const uint64_t ta = x[4 * i + 2 * o], td = x[4 * i + 2 * o + 1];
        /* differences of 64-bit timer values first: a double of an absolute %globaltimer value keeps
         * only multiples of 256 ns */
        const int64_t done_lag = (int64_t)(td - t0) - (int64_t)rc->seen_ns - (int64_t)rc->latency_ns;
        const int k = hn[o]++;
        hs[o][0][k] = (double)(ta - t0) / 1e3;
        hs[o][1][k] = rc->seen_ns / 1e3;
        hs[o][2][k] = rc->latency_ns / 1e3;
        hs[o][3][k] = (double)done_lag / 1e3;
        hs[o][4][k] = (double)(t1 - td) / 1e3;
      }
      free(x);
    }
  }
  free(h);
  pers_stop(&P); /* before any cudaFree: it waits for the device, the persistent kernel included */
  for (int r = 0; r < NR; r++) {
    CU(cudaSetDevice(epd_cc_device(H.kh.cc, r)));
    CU(cudaStreamDestroy(cs[r]));
    CU(cudaFree(ts[r]));
    CU(cudaFree(tx[r]));
    CU(cudaFree(dst[r]));
  }
  for (int o = 0; o < 2; o++)
    if (hn[o] > 0)
      fprintf(out,
              "persistent client view T=%u %s %s, rank 0 handoff (p50 of the last %d): submit call %.2f | "
              "submit -> "
              "kernel saw it %.2f | seen -> completion written %.2f | -> client saw DONE %.2f | DONE seen -> "
              "wait returned %.2f\n",
              T, flags ? "fp8" : "bf16", o ? "combine" : "dispatch", hn[o], stats(hs[o][0], hn[o]).p50,
              stats(hs[o][1], hn[o]).p50, stats(hs[o][2], hn[o]).p50, stats(hs[o][3], hn[o]).p50,
              stats(hs[o][4], hn[o]).p50);
  for (int o = 0; o < 2; o++) {
    const stat3_t c = stats(cl[o], n), d = stats(dl[o], n);
    fprintf(out,
            "persistent client view T=%u %s %s: submit -> DONE seen %.2f (p10 %.2f, p90 %.2f); kernel's seen "
            "-> completion %.2f\n",
            T, flags ? "fp8" : "bf16", o ? "combine" : "dispatch", c.p50, c.p10, c.p90, d.p50);
  }
  fflush(out);
}

int main(int argc, char **argv) {
  const char *outdir = argc > 1 ? argv[1] : ".";
  char why[160];
  if (kh_unfit(NR, why, sizeof why)) {
    fprintf(stderr, "bench_ll: %s, skipping\n", why);
    return 77;
  }
  epd_k_ll_geom_t g = {NR, 0, E_, H_, K_, M_, S_, 0};
  if (getenv("EPD_BENCH_BLOCKS")) g.blocks = (uint32_t)atoi(getenv("EPD_BENCH_BLOCKS"));
  if (llh_create(&H, NR, &g)) DIE("set-up: %s", H.kh.err);
  const int share = H.kh.share, ngpu = kh_gpus() < NR ? kh_gpus() : NR;
  if (share > 1)
    printf(
        "bench_ll: %d ranks share %d GPU(s), %d on one, %u blocks each: no NVLink between them, figures not "
        "comparable with the records of a GPU per rank\n",
        NR, ngpu, share, epd_k_ll_geom(H.k[0])->blocks);
  void *img = malloc(epd_k_map_bytes(E_));
  epd_k_map_default(img, 1, E_, NR);
  if (llh_set_map(&H, img)) DIE("map");
  CU(cudaHostAlloc((void **)&gate_host, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  *gate_host = 0;
  make_inputs();

  struct cudaDeviceProp prop;
  CU(cudaGetDeviceProperties(&prop, 0));
  int nccl_v = 0, rt_v = 0, drv_v = 0;
  ncclGetVersion(&nccl_v);
  cudaRuntimeGetVersion(&rt_v);
  cudaDriverGetVersion(&drv_v);
  char date[64];
  time_t tnow = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&tnow));

  if (getenv("EPD_BENCH_TRACE")) {
    trace_run(1, EPD_DESC_FP8, stdout);
    trace_run(128, EPD_DESC_FP8, stdout);
    trace_run(128, 0, stdout);
    if (!strcmp(getenv("EPD_BENCH_TRACE"), "only")) { /* the phase profile alone, with (a) beside it */
      stat3_t d8t, c8t, d8w, c8w;
      kernel_times(M_, EPD_DESC_FP8, NULL, &d8t, &c8t);
      printf("standalone kernels, event-timed (a): dispatch FP8 %.2f combine %.2f\n", d8t.p50, c8t.p50);
      kernel_times(M_, EPD_DESC_FP8, rewrite_inputs, &d8w, &c8w);
      printf("standalone kernels, inputs just rewritten (a'): dispatch FP8 %.2f combine %.2f\n", d8w.p50,
             c8w.p50);
      return 0;
    }
  }
  if (getenv("EPD_BENCH_PERSIST")) {
    persist_run(1, EPD_DESC_FP8, 300, stdout);
    persist_run(128, EPD_DESC_FP8, 300, stdout);
    persist_run(128, 0, 300, stdout);
    persist_dev_run(128, EPD_DESC_FP8, 300, stdout);
    persist_dev_run(128, 0, 300, stdout);
    stat3_t d8a, c8a;
    kernel_times(M_, EPD_DESC_FP8, NULL, &d8a, &c8a);
    printf("standalone kernels, event-timed (a): dispatch FP8 %.2f combine %.2f\n", d8a.p50, c8a.p50);
    if (!strcmp(getenv("EPD_BENCH_PERSIST"), "only")) return 0;
  }
  if (getenv("EPD_BENCH_QUICK")) { /* (a) alone at the main setting: for A/B runs of kernel builds */
    stat3_t qd8, qc8, qd16, qc16;
    kernel_times(M_, EPD_DESC_FP8, NULL, &qd8, &qc8);
    kernel_times(M_, 0, NULL, &qd16, &qc16);
    printf("quick (a) p50 us: dispatch FP8 %.2f combine %.2f dispatch BF16 %.2f combine %.2f\n", qd8.p50,
           qc8.p50, qd16.p50, qc16.p50);
    return 0;
  }
  /* main setting */
  stat3_t d8, c8, d16, c16, e2e8, e2e16;
  kernel_times(M_, EPD_DESC_FP8, NULL, &d8, &c8);
  kernel_times(M_, 0, NULL, &d16, &c16);
  stat3_t d8w, c8w;
  kernel_times(M_, EPD_DESC_FP8, rewrite_inputs, &d8w, &c8w);
  e2e8 = e2e_times(M_, EPD_DESC_FP8);
  e2e16 = e2e_times(M_, 0);
  const stat3_t empty = empty_times();
  size_t fp8_row = H_ + H_ / 128 * 4;
  stat3_t sr_d8, sr_c, ag, rsc, sr_d16, sr_c2, ag2, rsc2;
  nccl_baselines(0, fp8_row, &sr_d8, &sr_c, &ag, &rsc);
  nccl_baselines(0, (size_t)H_ * 2, &sr_d16, &sr_c2, &ag2, &rsc2);
  /* byte floor: the busiest GPU's tokens crossing NVLink in one direction (sent to, or received from,
   * all its peers: each GPU has 450 GB/s per direction in all, one peer or several through NVSwitch) */
  double remote_tok = 0;
  for (int r = 0; r < NR; r++) {
    double out = 0, in = 0;
    for (int d = 0; d < NR; d++)
      if (d != r) {
        out += per_dest[0][r][d];
        in += per_dest[0][d][r];
      }
    if (out > remote_tok) remote_tok = out;
    if (in > remote_tok) remote_tok = in;
  }
  double bw = 450e3; /* bytes per us */
  double floor_d8 = remote_tok * (fp8_row + 128) / bw, floor_d16 = remote_tok * (H_ * 2 + 128) / bw;
  double floor_c = remote_tok * H_ * 2 / bw;

  /* sweep */
  static const uint32_t sweep[] = {1, 2, 4, 8, 16, 32, 64, 128};
  enum { NSW = sizeof sweep / sizeof sweep[0] };
  stat3_t sw_d8[NSW], sw_c8[NSW], sw_d16[NSW], sw_c16[NSW];
  for (int i = 0; i < NSW; i++) {
    kernel_times(sweep[i], EPD_DESC_FP8, NULL, &sw_d8[i], &sw_c8[i]);
    kernel_times(sweep[i], 0, NULL, &sw_d16[i], &sw_c16[i]);
  }

  char path[1024];
  snprintf(path, sizeof path, "%s/bench_ll%s.json", outdir, NR == 2 ? "" : "_r" EPD_STR(NR));
  FILE *f = fopen(path, "w");
  if (!f) DIE("cannot write %s", path);
  fprintf(f, "{\n  \"bench\": \"bench_ll\",\n  \"date\": \"%s\",\n  \"device\": \"%s\",\n  \"gpus\": %d,\n",
          date, prop.name, ngpu);
  fprintf(f, "  \"ranks_per_gpu\": %d,\n", share);
  fprintf(f, "  \"nccl_version\": %d,\n  \"cuda_runtime\": %d,\n  \"cuda_driver\": %d,\n", nccl_v, rt_v,
          drv_v);
  fprintf(f, "  \"command\": \"%s\",\n", getenv("EPD_BENCH_CMD") ? getenv("EPD_BENCH_CMD") : argv[0]);
  fprintf(f,
          "  \"setting\": {\"ranks\": %d, \"tokens\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, "
          "\"blocks\": %u, \"iters\": %d, \"warmup\": %d},\n",
          NR, M_, H_, K_, E_, epd_k_ll_geom(H.k[0])->blocks, ITERS, WARM);
  fprintf(f, "  \"remote_tokens_per_direction\": %.0f,\n", remote_tok);
#define J3(name, s) \
  fprintf(f, "  \"%s\": {\"p50_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f},\n", name, s.p50, s.p10, s.p90)
  J3("a_dispatch_fp8_kernel", d8);
  J3("a_combine_kernel_after_fp8", c8);
  J3("a_dispatch_bf16_kernel", d16);
  J3("a_combine_kernel_after_bf16", c16);
  J3("a_warm_dispatch_fp8_kernel", d8w);
  J3("a_warm_combine_kernel_after_fp8", c8w);
  J3("c_inprocess_e2e_fp8_dispatch_plus_combine", e2e8);
  J3("c_inprocess_e2e_bf16_dispatch_plus_combine", e2e16);
  J3("d_nccl_sendrecv_dispatch_fp8", sr_d8);
  J3("d_nccl_sendrecv_dispatch_bf16", sr_d16);
  J3("d_nccl_sendrecv_combine_bf16", sr_c);
  J3("d_nccl_allgather_bf16", ag);
  J3("d_nccl_reducescatter_bf16", rsc);
  J3("f_empty_kernel", empty);
  fprintf(f, "  \"e_floor_us\": {\"dispatch_fp8\": %.2f, \"dispatch_bf16\": %.2f, \"combine_bf16\": %.2f},\n",
          floor_d8, floor_d16, floor_c);
  fprintf(f, "  \"sweep\": [\n");
  for (int i = 0; i < NSW; i++)
    fprintf(f,
            "    {\"tokens\": %u, \"dispatch_fp8_us\": %.2f, \"combine_after_fp8_us\": %.2f, "
            "\"dispatch_bf16_us\": %.2f, \"combine_after_bf16_us\": %.2f}%s\n",
            sweep[i], sw_d8[i].p50, sw_c8[i].p50, sw_d16[i].p50, sw_c16[i].p50, i + 1 < NSW ? "," : "");
  fprintf(f, "  ]\n}\n");
  fclose(f);

  snprintf(path, sizeof path, "%s/bench_ll%s.md", outdir, NR == 2 ? "" : "_r" EPD_STR(NR));
  f = fopen(path, "w");
  if (!f) DIE("cannot write %s", path);
  if (share > 1)
    fprintf(f, "# LL dispatch/combine, %d ranks on %d x %s (%d ranks share a GPU)\n\n", NR, ngpu, prop.name,
            share);
  else
    fprintf(f, "# LL dispatch/combine, %d x %s\n\n", NR, prop.name);
  fprintf(f, "%s; NCCL %d, CUDA runtime %d, driver API %d; command `%s`.\n", date, nccl_v, rt_v, drv_v,
          getenv("EPD_BENCH_CMD") ? getenv("EPD_BENCH_CMD") : argv[0]);
  fprintf(f,
          "Setting: %d ranks, %d tokens per rank, hidden %d, top-%d, %d experts, random routing "
          "(%.0f tokens per direction cross NVLink), %u blocks x %d threads. Median (p10-p90) of %d "
          "iterations after %d warm-up, kernel times are the slower rank of each iteration (CUDA events,"
          " ranks released together by a gate kernel).\n\n",
          NR, M_, H_, K_, E_, remote_tok, epd_k_ll_geom(H.k[0])->blocks, EPD_K_LL_THREADS, ITERS, WARM);
  if (share > 1)
    fprintf(
        f,
        "Ranks share a GPU (%d on one, each on %u blocks): no NVLink between them, the byte floor (e) does "
        "not apply and the figures are not comparable with the records of a GPU per rank.\n\n",
        share, epd_k_ll_geom(H.k[0])->blocks);
  fprintf(f, "| what | µs (p50) | p10-p90 |\n| --- | --- | --- |\n");
#define M3(name, s) fprintf(f, "| %s | %.2f | %.2f-%.2f |\n", name, s.p50, s.p10, s.p90)
  M3("(a) epd dispatch FP8, kernel", d8);
  M3("(a) epd combine BF16 (after FP8 dispatch), kernel", c8);
  M3("(a) epd dispatch BF16, kernel", d16);
  M3("(a) epd combine BF16 (after BF16 dispatch), kernel", c16);
  M3("(a') epd dispatch FP8, kernel, x just rewritten (the layer before writes it)", d8w);
  M3("(a') epd combine BF16, kernel, y's received rows just rewritten (the expert GEMM writes them)", c8w);
  M3("(c) in-process end to end, FP8 dispatch + combine (host launch to sync)", e2e8);
  M3("(c) in-process end to end, BF16 dispatch + combine", e2e16);
  M3("(d) NCCL send/recv, dispatch FP8 (each token once per rank)", sr_d8);
  M3("(d) NCCL send/recv, dispatch BF16", sr_d16);
  M3("(d) NCCL send/recv, combine BF16 (one partial per token and rank)", sr_c);
  M3("(d) NCCL allgather BF16", ag);
  M3("(d) NCCL reduce-scatter BF16", rsc);
  fprintf(f, "| (e) byte floor 450 GB/s: dispatch FP8 / BF16 / combine | %.2f / %.2f / %.2f | |\n", floor_d8,
          floor_d16, floor_c);
  M3("(f) launch floor: an empty kernel of the same grid, timed as (a)", empty);
  fprintf(f, "\n");
  double ours = d8.p50 + c8.p50, sr = sr_d8.p50 + sr_c.p50, agrs = ag.p50 + rsc.p50;
  double best = sr < agrs ? sr : agrs;
  fprintf(f,
          "Dispatch FP8 + combine: epd %.2f µs; NCCL send/recv %.2f µs; allgather + reduce-scatter %.2f µs; "
          "speed-up over the faster baseline %.2fx.\n\n",
          ours, sr, agrs, best / ours);
  fprintf(f,
          "Token sweep (kernel time, µs p50):\n\n| tokens | dispatch FP8 | combine | dispatch BF16 | combine "
          "|\n| --- | --- | --- | --- | --- |\n");
  for (int i = 0; i < NSW; i++)
    fprintf(f, "| %u | %.2f | %.2f | %.2f | %.2f |\n", sweep[i], sw_d8[i].p50, sw_c8[i].p50, sw_d16[i].p50,
            sw_c16[i].p50);
  fclose(f);
  /* echo the table */
  f = fopen(path, "r");
  char line[512];
  while (f && fgets(line, sizeof line, f)) fputs(line, stdout);
  if (f) fclose(f);
  cudaFreeHost(gate_host);
  llh_destroy(&H);
  return 0;
}

#else /* !EPD_WITH_CUDA */
#include <stdio.h>
int main(void) {
  fprintf(stderr, "bench_ll: built without CUDA, skipping\n");
  return 77;
}
#endif
