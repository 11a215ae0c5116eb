/*
 * bench_ht.c - HT dispatch/combine on 2 GPUs of one process: algorithm bandwidth (payload bytes that
 * cross NVLink per direction / op time) for BF16 and FP8 dispatch and BF16 combine, per number of SMs,
 * side by side in the same run with NCCL's grouped ncclSend/ncclRecv moving the same bytes and a plain
 * copy kernel between the two GPUs (one direction, both directions). Times: both ranks start together
 * (a gate kernel released from the host); an op's time is the slower rank's, averaged over iterations.
 * Prints a table and one JSON object per line (prefix "JSON ").
 *
 * Modes (--modes): reg = rows straight into/out of the peers' arenas with 16-byte register copies (the
 * default path), tma = the same with the bulk-copy engine (opt-in EPD_K_HT_COPY_TMA), staging = rows
 * through the staging windows (the path without peer access). Baselines: the copy kernel pushing to
 * the peer (one direction, both; 256 MiB and the op's bytes) and pulling from it. --trace 1 prints
 * rank 0's phase stamps (epd_k_ht_op_t.trace).
 *
 *   epd-bench-ht [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--iters 20] [--blocks 24,48]
 *                [--modes reg,tma,staging] [--trace 1]
 */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../tests/gpu/ht_harness.h"
#include "ref.h"

#define CUCK(e)                                                                                 \
  do {                                                                                          \
    cudaError_t c_ = (e);                                                                       \
    if (c_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #e, cudaGetErrorString(c_));        \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)
#define CK(e)                                                                                   \
  do {                                                                                          \
    int r_ = (int)(e);                                                                          \
    if (r_) {                                                                                   \
      fprintf(stderr, "%s:%d %s = %d: %s\n", __FILE__, __LINE__, #e, r_, h.kh.err);                \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static volatile uint32_t *g_flag;
static uint32_t *g_flag_dev;
static uint32_t g_gate;

typedef struct timer {
  cudaEvent_t a[2], b[2];
} timer_t_;

static void timer_init(epd_cc_t *cc, timer_t_ *t) {
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(cc, r));
    CUCK(cudaEventCreate(&t->a[r]));
    CUCK(cudaEventCreate(&t->b[r]));
  }
}

/* Gate both streams, record the start events. */
static void gate_start(epd_cc_t *cc, cudaStream_t *st, timer_t_ *t) {
  g_gate++;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(cc, r));
    epd_k_gate(g_flag_dev, g_gate, 2000000000ull, st[r]);
    CUCK(cudaEventRecord(t->a[r], st[r]));
  }
}
/* Record the end events, release the gate, wait; the slower rank's time in us. */
static double gate_end(epd_cc_t *cc, cudaStream_t *st, timer_t_ *t, unsigned mask) {
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(cc, r));
    CUCK(cudaEventRecord(t->b[r], st[r]));
  }
  __atomic_store_n(g_flag, g_gate, __ATOMIC_SEQ_CST);
  double worst = 0;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(cc, r));
    CUCK(cudaStreamSynchronize(st[r]));
    float ms = 0;
    CUCK(cudaEventElapsedTime(&ms, t->a[r], t->b[r]));
    if (((mask >> r) & 1) && ms * 1000.0 > worst) worst = ms * 1000.0;
  }
  return worst;
}

static int parse_list(const char *s, uint32_t *out, int max) {
  int n = 0;
  while (*s && n < max) {
    out[n++] = (uint32_t)strtoul(s, (char **)&s, 10);
    if (*s == ',') s++;
  }
  return n;
}

int main(int argc, char **argv) {
  uint32_t T = 4096, H = 7168, K = 8, E = 256, iters = 20, blist[8] = {24, 48};
  int nb = 2, nmodes = 3, do_trace = 0;
  const char *modes[3] = {"reg", "tma", "staging"};
  char modes_buf[64] = "";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--tokens")) T = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--hidden")) H = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--topk")) K = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--experts")) E = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters")) iters = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--blocks")) nb = parse_list(argv[i + 1], blist, 8);
    else if (!strcmp(argv[i], "--trace")) do_trace = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--modes")) {
      snprintf(modes_buf, sizeof modes_buf, "%s", argv[i + 1]);
      nmodes = 0;
      for (char *tok = strtok(modes_buf, ","); tok && nmodes < 3; tok = strtok(NULL, ","))
        if (!strcmp(tok, "tma") || !strcmp(tok, "reg") || !strcmp(tok, "staging")) modes[nmodes++] = tok;
    }
  }
  if (hth_gpus() < 2) {
    printf("needs 2 GPUs\n");
    return 77;
  }
  int v = 0;
  ncclGetVersion(&v);
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  printf("HT bench: 2 ranks, %u tokens/rank, hidden %u, top-%u, %u experts; NCCL %d, CUDA runtime %d, driver API %d\n",
         T, H, K, E, v, rt, drv);
  CUCK(cudaHostAlloc((void **)&g_flag, 4, cudaHostAllocMapped | cudaHostAllocPortable));
  *g_flag = 0;
  CUCK(cudaHostGetDevicePointer((void **)&g_flag_dev, (void *)g_flag, 0));

  uint32_t S = E / 2, M = T, C = 2 * T;
  epd_ref_geom_t rg = {2, E, H, K, M, S, C};
  epd_expert_map_t map;
  epd_ref_map_default(&map, E, 2, S);
  epd_ref_plan_t plan;
  epd_ref_plan_init(&plan, &rg);
  uint16_t *x[2];
  int64_t *topk[2];
  float *w[2];
  epd_ref_in_t in[2];
  for (int r = 0; r < 2; r++) {
    x[r] = malloc((size_t)M * H * 2);
    topk[r] = malloc((size_t)M * K * 8);
    w[r] = malloc((size_t)M * K * 4);
    epd_ref_gen_input(7, 0, (uint32_t)r, &rg, T, 0, x[r], topk[r], w[r]);
    in[r] = (epd_ref_in_t){T, x[r], topk[r], w[r]};
  }
  int bad;
  char err[256];
  if (epd_ref_plan_build(&plan, &map, in, &bad, err, sizeof err)) {
    fprintf(stderr, "plan: %s\n", err);
    return 1;
  }
  uint64_t remote[2] = {0, 0}; /* rows each rank sends to the other */
  for (uint32_t s = 0; s < 2; s++)
    for (uint32_t t = 0; t < T; t++) remote[s] += plan.ht_pos[((size_t)s * M + t) * 2 + (1 - s)] >= 0;
  double rows = (remote[0] + remote[1]) / 2.0;
  printf("rows crossing NVLink per direction: %llu / %llu (of %u tokens)\n", (unsigned long long)remote[0],
         (unsigned long long)remote[1], T);
  void *img = malloc(epd_k_map_bytes(E));
  epd_k_map_pack(img, map.version, E, map.nrep, (const uint32_t *)map.rep, EPD_MAX_REPLICAS);

  hth_t h;
  /* the target: each op at >= 95% of the copy-kernel ceiling (its best grid, both directions at
   * once, 256 MiB) on at most 24 SMs; kept here to be printed last */
  double reg_gbs[8][3] = {{0}}, ceil_gbs = 0;
  static const char *const opnames[3] = {"dispatch_bf16", "dispatch_fp8", "combine_bf16"};
  for (int bi = 0; bi < nb; bi++) {
    epd_k_ht_geom_t g = {2, 0, E, H, K, M, S, C, blist[bi]};
    CK(hth_create(&h, 2, &g));
    CK(hth_set_map(&h, img));
    for (int r = 0; r < 2; r++) {
      cudaSetDevice(epd_cc_device(h.kh.cc, r));
      CUCK(cudaMemcpy(hth_buf(&h, r, 0, EPD_BUF_X), x[r], (size_t)T * H * 2, cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(hth_buf(&h, r, 0, EPD_BUF_TOPK_IDX), topk[r], (size_t)T * K * 8, cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(hth_buf(&h, r, 0, EPD_BUF_TOPK_WEIGHTS), w[r], (size_t)T * K * 4, cudaMemcpyHostToDevice));
      CUCK(cudaMemset(hth_buf(&h, r, 0, EPD_BUF_HT_Y), 0x3c, (size_t)C * H * 2));
      CUCK(cudaDeviceSynchronize());
    }
    timer_t_ tm;
    timer_init(h.kh.cc, &tm);
    uint32_t ntok[2] = {T, T};
    for (int mi = 0; mi < nmodes; mi++) {
      h.staging = !strcmp(modes[mi], "staging");
      h.copy = !strcmp(modes[mi], "tma") ? EPD_K_HT_COPY_TMA : EPD_K_HT_COPY_REG;
      double sum[3] = {0, 0, 0};
      for (uint32_t it = 0; it < iters + 3; it++) {
        for (int fp8 = 0; fp8 < 2; fp8++) {
          gate_start(h.kh.cc, h.kh.st, &tm);
          CK(hth_launch(&h, 3, EPD_OP_HT_DISPATCH, 0, ntok, fp8 ? EPD_DESC_FP8 : 0, 2000000000ull));
          double us = gate_end(h.kh.cc, h.kh.st, &tm, 3);
          if (it >= 3) sum[fp8] += us;
        }
        gate_start(h.kh.cc, h.kh.st, &tm);
        CK(hth_launch(&h, 3, EPD_OP_HT_COMBINE, 0, ntok, 0, 2000000000ull));
        double us = gate_end(h.kh.cc, h.kh.st, &tm, 3);
        if (it >= 3) sum[2] += us;
      }
      for (int r = 0; r < 2; r++) {
        epd_comp_t c0, c1;
        hth_comp(&h, r, 0, &c0);
        hth_comp(&h, r, 1, &c1);
        if (c0.status || c1.status) printf("rank %d: status dispatch %d combine %d\n", r, c0.status, c1.status);
      }
      double rowb[3] = {2.0 * H, H + H / 128 * 4.0, 2.0 * H};
      if (do_trace) {
        /* where the time goes: rank 0's %globaltimer stamps, mean of 5 untimed runs */
        uint64_t *tr[2];
        for (int r = 0; r < 2; r++) {
          cudaSetDevice(epd_cc_device(h.kh.cc, r));
          CUCK(cudaMalloc((void **)&tr[r], 16 * 8));
          h.trace[r] = tr[r];
        }
        for (int o = 0; o < 3; o++) {
          double acc[16] = {0};
          const int nst = o < 2 ? 11 : 5;
          for (int it = 0; it < 5; it++) {
            if (o == 2) { /* a dispatch first (untraced), then the traced combine */
              h.trace[0] = h.trace[1] = NULL;
              CK(hth_launch(&h, 3, EPD_OP_HT_DISPATCH, 0, ntok, 0, 2000000000ull));
              CK(hth_sync(&h, 3));
              h.trace[0] = tr[0];
              h.trace[1] = tr[1];
            }
            for (int r = 0; r < 2; r++) {
              cudaSetDevice(epd_cc_device(h.kh.cc, r));
              CUCK(cudaMemset(tr[r], 0, 16 * 8));
              CUCK(cudaDeviceSynchronize());
            }
            gate_start(h.kh.cc, h.kh.st, &tm);
            CK(hth_launch(&h, 3, o < 2 ? EPD_OP_HT_DISPATCH : EPD_OP_HT_COMBINE, 0, ntok, o == 1 ? EPD_DESC_FP8 : 0,
                          2000000000ull));
            gate_end(h.kh.cc, h.kh.st, &tm, 3);
            uint64_t hv[16];
            cudaSetDevice(epd_cc_device(h.kh.cc, 0));
            CUCK(cudaMemcpy(hv, tr[0], 16 * 8, cudaMemcpyDeviceToHost));
            if (o < 2 && hv[10]) hv[10] = ~hv[10]; /* the earliest block's stamp, stored complemented */
            for (int i = 1; i < nst; i++) acc[i] += hv[i] ? (double)(hv[i] - hv[0]) / 1000.0 : -1.0;
          }
          printf("trace %-14s %-7s SMs %3u (us from %s):", opnames[o], modes[mi], blist[bi], o < 2 ? "route start" : "start");
          for (int i = 1; i < nst; i++) printf(" [%d] %.1f", i, acc[i] / 5);
          printf("\n");
        }
        for (int r = 0; r < 2; r++) {
          cudaSetDevice(epd_cc_device(h.kh.cc, r));
          cudaFree(tr[r]);
          h.trace[r] = NULL;
        }
      }
      for (int o = 0; o < 3; o++) {
        double us = sum[o] / iters, gbs = rows * rowb[o] / (us * 1e-6) / 1e9;
        printf("%-14s %-7s SMs %3u: %8.1f us  %6.1f GB/s per direction\n", opnames[o], modes[mi], blist[bi], us, gbs);
        if (!strcmp(modes[mi], "reg")) reg_gbs[bi][o] = gbs;
        printf("JSON {\"op\":\"ht_%s\",\"mode\":\"%s\",\"sms\":%u,\"tokens\":%u,\"hidden\":%u,\"us\":%.1f,"
               "\"algbw_gbs\":%.1f}\n",
               opnames[o], modes[mi], blist[bi], T, H, us, gbs);
      }
    }
    /* baselines once, on the first context's communicators */
    if (bi == 0) {
      /* NCCL grouped send/recv of the same payload */
      size_t nbytes[2] = {remote[0] * 2 * H, remote[1] * 2 * H};
      void *sb[2], *rb[2];
      for (int r = 0; r < 2; r++) {
        cudaSetDevice(epd_cc_device(h.kh.cc, r));
        CUCK(cudaMalloc(&sb[r], nbytes[r] + 16));
        CUCK(cudaMalloc(&rb[r], nbytes[1 - r] + 16));
      }
      double ns = 0;
      for (uint32_t it = 0; it < iters + 3; it++) {
        gate_start(h.kh.cc, h.kh.st, &tm);
        ncclGroupStart();
        for (int r = 0; r < 2; r++) {
          cudaSetDevice(epd_cc_device(h.kh.cc, r));
          ncclSend(sb[r], nbytes[r], ncclChar, 1 - r, epd_cc_world(h.kh.cc, r), h.kh.st[r]);
          ncclRecv(rb[r], nbytes[1 - r], ncclChar, 1 - r, epd_cc_world(h.kh.cc, r), h.kh.st[r]);
        }
        ncclResult_t nr = ncclGroupEnd();
        if (nr != ncclSuccess) {
          fprintf(stderr, "nccl: %s\n", ncclGetErrorString(nr));
          return 1;
        }
        double us = gate_end(h.kh.cc, h.kh.st, &tm, 3);
        if (it >= 3) ns += us;
      }
      double us = ns / iters, gbs = rows * 2.0 * H / (us * 1e-6) / 1e9;
      printf("%-14s        : %8.1f us  %6.1f GB/s per direction (same bytes as the BF16 dispatch)\n", "nccl_sendrecv", us, gbs);
      printf("JSON {\"op\":\"nccl_sendrecv\",\"tokens\":%u,\"hidden\":%u,\"us\":%.1f,\"algbw_gbs\":%.1f}\n", T, H, us, gbs);
      /* plain copy kernel into the peer GPU */
      for (int r = 0; r < 2; r++) {
        cudaSetDevice(epd_cc_device(h.kh.cc, r));
        cudaDeviceEnablePeerAccess(epd_cc_device(h.kh.cc, 1 - r), 0);
        cudaGetLastError();
      }
      size_t cb = (size_t)256 << 20;
      void *cs[2], *cd[2];
      for (int r = 0; r < 2; r++) {
        cudaSetDevice(epd_cc_device(h.kh.cc, r));
        CUCK(cudaMalloc(&cs[r], cb));
        CUCK(cudaMalloc(&cd[r], cb));
        CUCK(cudaMemset(cs[r], 1, cb));
      }
      uint32_t cbl[3] = {24, 66, 132};
      for (int ci = 0; ci < 3; ci++)
        for (int both = 0; both < 2; both++) {
          double cs_us = 0;
          for (uint32_t it = 0; it < 8; it++) {
            gate_start(h.kh.cc, h.kh.st, &tm);
            for (int r = 0; r < (both ? 2 : 1); r++) {
              cudaSetDevice(epd_cc_device(h.kh.cc, r));
              epd_k_copy(cd[1 - r], cs[r], cb, cbl[ci], h.kh.st[r]);
            }
            double u1 = gate_end(h.kh.cc, h.kh.st, &tm, both ? 3 : 1);
            if (it >= 2) cs_us += u1;
          }
          double cu = cs_us / 6, cg = cb / (cu * 1e-6) / 1e9;
          printf("copy_kernel %-4s blocks %3u: %8.1f us  %6.1f GB/s per direction (256 MiB)\n", both ? "both" : "one",
                 cbl[ci], cu, cg);
          if (both && cg > ceil_gbs) ceil_gbs = cg;
          printf("JSON {\"op\":\"copy_%s\",\"blocks\":%u,\"bytes\":%zu,\"us\":%.1f,\"gbs\":%.1f}\n", both ? "both" : "one",
                 cbl[ci], cb, cu, cg);
        }
      /* the copy kernel moving the op's bytes (rows crossing NVLink x 2H) both ways at once: push (what
       * dispatch does) and pull (what combine does), on the SM counts of the HT runs */
      for (int bi2 = 0; bi2 < nb; bi2++)
        for (int pull = 0; pull < 2; pull++) {
          double cs_us = 0;
          for (uint32_t it = 0; it < iters + 3; it++) {
            gate_start(h.kh.cc, h.kh.st, &tm);
            for (int r = 0; r < 2; r++) {
              cudaSetDevice(epd_cc_device(h.kh.cc, r));
              if (pull)
                epd_k_copy(cd[r], cs[1 - r], nbytes[1 - r] / 16 * 16, blist[bi2], h.kh.st[r]);
              else
                epd_k_copy(cd[1 - r], cs[r], nbytes[r] / 16 * 16, blist[bi2], h.kh.st[r]);
            }
            double u1 = gate_end(h.kh.cc, h.kh.st, &tm, 3);
            if (it >= 3) cs_us += u1;
          }
          double cu = cs_us / iters, cg = rows * 2.0 * H / (cu * 1e-6) / 1e9;
          printf("copy_kernel %s both, op bytes, blocks %3u: %8.1f us  %6.1f GB/s per direction\n", pull ? "pull" : "push",
                 blist[bi2], cu, cg);
          printf("JSON {\"op\":\"copy_%s_both_opbytes\",\"blocks\":%u,\"us\":%.1f,\"gbs\":%.1f}\n", pull ? "pull" : "push",
                 blist[bi2], cu, cg);
        }
      /* the same bytes through the bulk-copy engine (TMA), push both ways, 2 / 4 / 6 chunks in flight per SM:
       * how close can this many SMs get to the ceiling? */
      for (int bi2 = 0; bi2 < nb; bi2++)
        for (int tv = 0; tv < 6; tv++) {
          const int big = tv & 1;
          const uint32_t stages = 2 + 2 * (uint32_t)(tv / 2); /* 2, 4, 6 chunks of 32 KB in flight */
          double cs_us = 0;
          size_t nbt[2] = {big ? cb : nbytes[0] / 16 * 16, big ? cb : nbytes[1] / 16 * 16};
          for (uint32_t it = 0; it < iters + 3; it++) {
            if (it == iters + 2) /* the last copy is checked: its destination zeroed first */
              for (int r = 0; r < 2; r++) {
                cudaSetDevice(epd_cc_device(h.kh.cc, r));
                CUCK(cudaMemset(cd[r], 0, cb));
                CUCK(cudaDeviceSynchronize());
              }
            gate_start(h.kh.cc, h.kh.st, &tm);
            for (int r = 0; r < 2; r++) {
              cudaSetDevice(epd_cc_device(h.kh.cc, r));
              if (epd_k_copy_tma(cd[1 - r], cs[r], nbt[r], blist[bi2], stages, h.kh.st[r]) != EPD_OK) {
                fprintf(stderr, "copy_tma launch failed\n");
                return 1;
              }
            }
            double u1 = gate_end(h.kh.cc, h.kh.st, &tm, 3);
            if (it >= 3) cs_us += u1;
          }
          /* the last copy landed whole: every source byte is 1 (memset), its destination was zeroed */
          for (int r = 0; r < 2; r++) {
            unsigned char *chk = malloc(nbt[r]);
            if (!chk) return 1;
            cudaSetDevice(epd_cc_device(h.kh.cc, 1 - r));
            CUCK(cudaMemcpy(chk, cd[1 - r], nbt[r], cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < nbt[r]; i++)
              if (chk[i] != 1) {
                fprintf(stderr, "copy_tma: byte %zu of %zu is %u, not 1\n", i, nbt[r], chk[i]);
                return 1;
              }
            free(chk);
          }
          double cu = cs_us / iters, cg = (double)(nbt[0] + nbt[1]) / 2 / (cu * 1e-6) / 1e9;
          printf("copy_tma push both, %s, blocks %3u, %u x 32 KB in flight: %8.1f us  %6.1f GB/s per direction\n",
                 big ? "256 MiB" : "op bytes", blist[bi2], stages, cu, cg);
          printf("JSON {\"op\":\"copy_tma_push_both_%s\",\"blocks\":%u,\"stages\":%u,\"us\":%.1f,\"gbs\":%.1f}\n",
                 big ? "256mib" : "opbytes", blist[bi2], stages, cu, cg);
        }
      /* the copy kernel reading the peer's memory (what the combine's pull does), one direction */
      for (int ci = 0; ci < 3; ci++) {
        double cs_us = 0;
        for (uint32_t it = 0; it < 8; it++) {
          gate_start(h.kh.cc, h.kh.st, &tm);
          cudaSetDevice(epd_cc_device(h.kh.cc, 0));
          epd_k_copy(cd[0], cs[1], cb, cbl[ci], h.kh.st[0]);
          double u1 = gate_end(h.kh.cc, h.kh.st, &tm, 1);
          if (it >= 2) cs_us += u1;
        }
        double cu = cs_us / 6, cg = cb / (cu * 1e-6) / 1e9;
        printf("copy_kernel pull blocks %3u: %8.1f us  %6.1f GB/s per direction (256 MiB)\n", cbl[ci], cu, cg);
        printf("JSON {\"op\":\"copy_pull\",\"blocks\":%u,\"bytes\":%zu,\"us\":%.1f,\"gbs\":%.1f}\n", cbl[ci], cb, cu, cg);
      }
      for (int r = 0; r < 2; r++) {
        cudaSetDevice(epd_cc_device(h.kh.cc, r));
        cudaFree(cs[r]);
        cudaFree(cd[r]);
        cudaFree(sb[r]);
        cudaFree(rb[r]);
      }
    }
    hth_destroy(&h);
  }
  if (ceil_gbs > 0) {
    printf("target: >= 95%% of the copy-kernel ceiling (best of 24/66/132 blocks, both directions at once: %.1f GB/s "
           "per direction; 95%% = %.1f) on at most 24 SMs\n", ceil_gbs, 0.95 * ceil_gbs);
    for (int bi = 0; bi < nb; bi++)
      for (int o = 0; o < 3; o++) {
        if (o == 1 || blist[bi] > 24 || reg_gbs[bi][o] <= 0) continue; /* the target names BF16 dispatch and combine */
        const double pct = 100.0 * reg_gbs[bi][o] / ceil_gbs;
        printf("target %-14s SMs %3u: %6.1f GB/s = %5.1f%% of the ceiling (%s)\n", opnames[o], blist[bi], reg_gbs[bi][o],
               pct, pct >= 95.0 ? "met" : "missed");
        printf("JSON {\"op\":\"target_%s\",\"sms\":%u,\"gbs\":%.1f,\"ceiling_gbs\":%.1f,\"pct\":%.1f}\n", opnames[o],
               blist[bi], reg_gbs[bi][o], ceil_gbs, pct);
      }
  }
  return 0;
}
