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
 * through the staging windows (the path without peer access), dense = the dense layout
 * (EPD_DESC_HT_DENSE: every token to every rank) with the BF16 rows by the GPU's copy engines
 * (EPD_K_HT_COPY_CE; FP8 rows by the kernel), dense-reg = the dense layout with register rows. Dense
 * figures count the same payload as the others (the rows a token needs), not the few extra rows the
 * dense layout sends to ranks where a token has no entry (printed). Baselines: the copy kernel pushing to
 * the peer (one direction, both; 256 MiB and the op's bytes) and pulling from it, the same through the
 * bulk-copy engine (TMA) and through the copy engines (cudaMemcpyAsync, and SM + copy-engine pipelines:
 * ce_bench). --trace 1 prints rank 0's phase stamps (epd_k_ht_op_t.trace).
 * With one GPU both ranks share it (NCCL's multi-rank mode; ht_harness.h): each rank's SMs are cut to half
 * the GPU's where --blocks asks for more, and one line says so. No NVLink then: the figures (and the
 * copy-kernel "ceiling" and target lines, copies within one GPU) are not comparable with 2-GPU records.
 *
 *   epd-bench-ht [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--iters 20] [--blocks 24,48]
 *                [--modes reg,dense,dense-reg,tma,staging] [--trace 1] [--baselines 0]
 */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cuda.h>
#include <nccl.h>
#pragma GCC diagnostic pop
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../tests/gpu/ht_harness.h"
#include "bench_kernels.h"
#include "core/ref.h"

#define CUCK(e)                                                                          \
  do {                                                                                   \
    cudaError_t c_ = (e);                                                                \
    if (c_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #e, cudaGetErrorString(c_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
#define CK(e)                                                                       \
  do {                                                                              \
    int r_ = (int)(e);                                                              \
    if (r_) {                                                                       \
      fprintf(stderr, "%s:%d %s = %d: %s\n", __FILE__, __LINE__, #e, r_, h.kh.err); \
      exit(1);                                                                      \
    }                                                                               \
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

/* ---- copy engines (CE): what the GPU's DMA engines move across NVLink, and an SM + CE pipeline ----
 * ce raw: cudaMemcpyAsync of the op's bytes (and 256 MiB) to the peer, both ranks at once, split over 1,
 * 2 or 4 streams. ce dispatch: `blocks` SMs gather the rows sent to the peer into a staging buffer in
 * token order (epd_k_pack_rows), a CE stream waits for each chunk's flag (cuStreamWaitValue32) and copies
 * it to the peer, where the rows land at their final index. ce combine: the expert rank's partials of my
 * tokens (contiguous, in token order) are copied by a CE stream chunk by chunk (push into my staging or
 * pull from the peer), each followed by a flag (cuStreamWriteValue32); `blocks` SMs sum them with my own
 * partials (epd_k_reduce2_rows). Routing is known on the host here (sizes of the copies): a bound for a
 * CE path, without the plan exchange. The last run of each pipeline is checked row by row. Each part is also
 * timed alone: the SM kernel with its flags already set; the CE copies with the dispatch's waits (on flags
 * already set) but without the combine's flag writes. */
typedef CUresult (*wait_value_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
typedef CUresult (*write_value_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

static void *driver_fn(const char *name) {
  void *p = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return NULL;
  return p;
}

#define CE_STREAMS 4
#define CE_TRY(ok, what)                                      \
  do {                                                        \
    if (!(ok)) {                                              \
      fprintf(stderr, "copy_engine rows: %s failed\n", what); \
      return 1;                                               \
    }                                                         \
  } while (0)
static int ce_bench(hth_t *h, timer_t_ *tm, uint16_t *const *x, const int32_t *ht_pos, uint32_t M, uint32_t T,
                    uint32_t H, const size_t *nbytes, void *const *cs, void *const *cd, uint32_t iters) {
  wait_value_fn wait_value = (wait_value_fn)driver_fn("cuStreamWaitValue32");
  write_value_fn write_value = (write_value_fn)driver_fn("cuStreamWriteValue32");
  if (!wait_value || !write_value) {
    fprintf(stderr, "ce: no stream memory operations\n");
    return 1;
  }
  const size_t rb = (size_t)H * 2, cb = (size_t)256 << 20;
  if ((size_t)T * rb > cb || (T + 255) / 256 > 4096) { /* cs/cd hold 256 MiB, flags 4096 chunks */
    printf("copy_engine rows skipped: %u rows of %zu bytes exceed their buffers\n", T, rb);
    return 0;
  }
  cudaStream_t ce[2][CE_STREAMS];
  cudaEvent_t ej[2][CE_STREAMS];
  int32_t *idx_h[2], *idx[2];
  uint32_t n[2] = {0, 0}, *cnt[2], *flags[2];
  void *stg[2], *yb[2];
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    for (int j = 0; j < CE_STREAMS; j++) {
      CUCK(cudaStreamCreateWithFlags(&ce[r][j], cudaStreamNonBlocking));
      CUCK(cudaEventCreateWithFlags(&ej[r][j], cudaEventDisableTiming));
    }
    idx_h[r] = malloc((size_t)T * 4);
    for (uint32_t t = 0; t < T; t++)
      if (ht_pos[((size_t)r * M + t) * 2 + (1 - r)] >= 0) idx_h[r][n[r]++] = (int32_t)t;
    CUCK(cudaMalloc((void **)&idx[r], (size_t)T * 4));
    CUCK(cudaMemcpy(idx[r], idx_h[r], (size_t)n[r] * 4, cudaMemcpyHostToDevice));
    CUCK(cudaMalloc((void **)&cnt[r], 4096 * 4));
    CUCK(cudaMalloc((void **)&flags[r], 4096 * 4));
    CUCK(cudaMemset(flags[r], 0, 4096 * 4));
    CUCK(cudaMalloc(&stg[r], (size_t)T * rb));
    CUCK(cudaMalloc(&yb[r], (size_t)T * rb));
    /* x rows in cs (the dispatch's source, the combine's own partials); the partials this rank made for
     * the peer's tokens in yb: row i = x[r] row T-1-i (not the rows they are summed with) */
    CUCK(cudaMemcpy(cs[r], x[r], (size_t)T * rb, cudaMemcpyHostToDevice));
    for (uint32_t i = 0; i < T; i++)
      CUCK(cudaMemcpy((char *)yb[r] + (size_t)i * rb, x[r] + (size_t)(T - 1 - i) * H, rb,
                      cudaMemcpyHostToDevice));
    CUCK(cudaDeviceSynchronize());
  }
  static uint32_t seq = 0;
/* Start every CE stream of both ranks after the gate; join them back before the end event. */
#define CE_FORK(r, ns)                                                                   \
  do {                                                                                   \
    CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));                                     \
    for (int j_ = 0; j_ < (ns); j_++) CUCK(cudaStreamWaitEvent(ce[r][j_], tm->a[r], 0)); \
  } while (0)
#define CE_JOIN(r, ns)                                      \
  do {                                                      \
    CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));        \
    for (int j_ = 0; j_ < (ns); j_++) {                     \
      CUCK(cudaEventRecord(ej[r][j_], ce[r][j_]));          \
      CUCK(cudaStreamWaitEvent(h->kh.st[r], ej[r][j_], 0)); \
    }                                                       \
  } while (0)
  /* raw copies */
  for (int big = 0; big < 2; big++)
    for (int pull = 0; pull < 2; pull++)
      for (int ns = 1; ns <= CE_STREAMS; ns *= 2) {
        double acc = 0;
        for (uint32_t it = 0; it < iters + 3; it++) {
          gate_start(h->kh.cc, h->kh.st, tm);
          for (int r = 0; r < 2; r++) {
            const size_t bytes = big ? cb : (pull ? nbytes[1 - r] : nbytes[r]),
                         part = (bytes / ns + 4095) / 4096 * 4096;
            CE_FORK(r, ns);
            for (int j = 0; j < ns; j++) {
              const size_t o = (size_t)j * part, l = o >= bytes ? 0 : (bytes - o < part ? bytes - o : part);
              if (!l) continue;
              if (pull)
                CUCK(cudaMemcpyAsync((char *)cd[r] + o, (const char *)cs[1 - r] + o, l,
                                     cudaMemcpyDeviceToDevice, ce[r][j]));
              else
                CUCK(cudaMemcpyAsync((char *)cd[1 - r] + o, (const char *)cs[r] + o, l,
                                     cudaMemcpyDeviceToDevice, ce[r][j]));
            }
            CE_JOIN(r, ns);
          }
          double us = gate_end(h->kh.cc, h->kh.st, tm, 3);
          if (it >= 3) acc += us;
        }
        const double us = acc / iters, bytes = big ? (double)cb : (nbytes[0] + nbytes[1]) / 2.0,
                     gbs = bytes / (us * 1e-6) / 1e9;
        printf("copy_engine %s both, %s, %d stream%s: %8.1f us  %6.1f GB/s per direction\n",
               pull ? "pull" : "push", big ? "256 MiB" : "op bytes", ns, ns > 1 ? "s" : "", us, gbs);
        printf("JSON {\"op\":\"ce_%s_both_%s\",\"streams\":%d,\"us\":%.1f,\"gbs\":%.1f}\n",
               pull ? "pull" : "push", big ? "256mib" : "opbytes", ns, us, gbs);
      }
  /* the SM + CE pipelines */
  static const uint32_t chs[2] = {256, 1024}, pbl[2] = {8, 24};
  uint32_t *ready[2]; /* flags that are always set: a part timed alone */
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    CUCK(cudaMalloc((void **)&ready[r], 4096 * 4));
    /* 0x7f7f7f7f: past every seq (the stream wait compares cyclically) */
    CUCK(cudaMemset(ready[r], 0x7f, 4096 * 4));
  }
  for (int op = 0; op < 3; op++) /* 0: dispatch (push), 1: combine push, 2: combine pull */
    for (int ci = 0; ci < 2; ci++)
      for (int bi = 0; bi < 2; bi++)
        for (int ns = 1; ns <= 2; ns++)
          /* part 0: the pipeline, 1: its SM kernel alone, 2: its CE copies alone */
          for (int part = 0; part < 3; part++) {
            if ((part == 1 && ns > 1) || (part == 2 && bi > 0)) continue;
            const uint32_t ch = chs[ci], blocks = pbl[bi];
            uint32_t *const fl[2] = {part ? ready[0] : flags[0], part ? ready[1] : flags[1]};
            double acc = 0;
            for (uint32_t it = 0; it < iters + 3; it++) {
              seq++;
              if (it == iters + 2)
                for (int r = 0; r < 2; r++) { /* the checked run: destinations poisoned first */
                  CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));
                  CUCK(cudaMemset(cd[r], 0xff, (size_t)T * rb));
                  CUCK(cudaMemset(stg[r], 0xff, (size_t)T * rb));
                  CUCK(cudaDeviceSynchronize());
                }
              for (int r = 0; r < 2; r++) {
                CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));
                CUCK(cudaMemsetAsync(cnt[r], 0, 4096 * 4, h->kh.st[r]));
              }
              gate_start(h->kh.cc, h->kh.st, tm);
              for (int r = 0; r < 2; r++) {
                const uint32_t nr = op == 1 ? n[1 - r] : n[r], nch = (nr + ch - 1) / ch;
                CE_FORK(r, ns);
                if (op == 0 && part != 2)
                  CE_TRY(epd_k_pack_rows(stg[r], cs[r], idx[r], n[r], (uint32_t)rb, ch, cnt[r], flags[r], seq,
                                         blocks, h->kh.st[r]) == EPD_OK,
                         "epd_k_pack_rows");
                for (uint32_t c = 0; c < nch && part != 1; c++) {
                  cudaStream_t s = ce[r][c % ns];
                  const size_t o = (size_t)c * ch * rb,
                               l = (size_t)(nr - c * ch < ch ? nr - c * ch : ch) * rb;
                  if (op == 0) {
                    CE_TRY(wait_value(s, (CUdeviceptr)(fl[r] + c), seq, CU_STREAM_WAIT_VALUE_GEQ) ==
                               CUDA_SUCCESS,
                           "cuStreamWaitValue32");
                    CUCK(cudaMemcpyAsync((char *)cd[1 - r] + o, (char *)stg[r] + o, l,
                                         cudaMemcpyDeviceToDevice, s));
                  } else if (op == 1) { /* push my partials of the peer's tokens, then its flag */
                    CUCK(cudaMemcpyAsync((char *)stg[1 - r] + o, (char *)yb[r] + o, l,
                                         cudaMemcpyDeviceToDevice, s));
                    if (part == 0)
                      CE_TRY(write_value(s, (CUdeviceptr)(flags[1 - r] + c), seq,
                                         CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS,
                             "cuStreamWriteValue32 (peer flag)");
                  } else { /* pull the peer's partials of my tokens, then my flag */
                    CUCK(cudaMemcpyAsync((char *)stg[r] + o, (char *)yb[1 - r] + o, l,
                                         cudaMemcpyDeviceToDevice, s));
                    if (part == 0)
                      CE_TRY(write_value(s, (CUdeviceptr)(flags[r] + c), seq,
                                         CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS,
                             "cuStreamWriteValue32");
                  }
                }
                if (op > 0 && part != 2)
                  CE_TRY(epd_k_reduce2_rows(cd[r], cs[r], stg[r], idx[r], n[r], H, ch, fl[r], seq, blocks,
                                            h->kh.st[r]) == EPD_OK,
                         "epd_k_reduce2_rows");
                CE_JOIN(r, ns);
              }
              double us = gate_end(h->kh.cc, h->kh.st, tm, 3);
              if (it >= 3) acc += us;
            }
            /* check the last run of a pipeline row by row */
            for (int r = 0; r < 2 && part == 0; r++) {
              uint16_t *got = malloc((size_t)T * rb);
              CE_TRY(got != NULL, "malloc");
              const int dst = op == 0 ? 1 - r : r; /* where rank r's result lies */
              CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, dst)));
              CUCK(cudaMemcpy(got, cd[dst], (size_t)T * rb, cudaMemcpyDeviceToHost));
              for (uint32_t i = 0; i < n[r]; i++) {
                const uint32_t t = (uint32_t)idx_h[r][i];
                const uint16_t *g = got + (size_t)(op == 0 ? i : t) * H, *a = x[r] + (size_t)t * H;
                const uint16_t *b = x[1 - r] + (size_t)(T - 1 - i) * H; /* row i of the peer's yb */
                for (uint32_t k = 0; k < H; k++) {
                  const uint16_t want =
                      op == 0 ? a[k] : epd_f32_to_bf16(epd_bf16_to_f32(a[k]) + epd_bf16_to_f32(b[k]));
                  if (g[k] != want) {
                    fprintf(stderr, "ce %s: rank %d row %u col %u: %04x, want %04x\n",
                            op ? "combine" : "dispatch", r, i, k, g[k], want);
                    return 1;
                  }
                }
              }
              free(got);
            }
            const double us = acc / iters, gbs = (n[0] + n[1]) / 2.0 * rb / (us * 1e-6) / 1e9;
            static const char *const on[3] = {"dispatch_bf16", "combine_push", "combine_pull"};
            static const char *const pn[3] = {"pipeline (checked)", "SM kernel alone", "CE copies alone"};
            printf(
                "ce_pipeline %-13s chunk %4u rows, SMs %2u, %d CE stream%s: %8.1f us  %6.1f GB/s per "
                "direction %s\n",
                on[op], ch, part == 2 ? 0 : blocks, part == 1 ? 0 : ns, ns > 1 ? "s" : " ", us, gbs,
                pn[part]);
            printf(
                "JSON {\"op\":\"ce_pipeline_%s\",\"part\":\"%s\",\"chunk_rows\":%u,\"sms\":%u,\"streams\":%d,"
                "\"us\":%.1f,\"gbs\":%.1f}\n",
                on[op], part == 0 ? "pipeline" : (part == 1 ? "sm" : "ce"), ch, part == 2 ? 0 : blocks,
                part == 1 ? 0 : ns, us, gbs);
          }
#undef CE_FORK
#undef CE_JOIN
#undef CE_TRY
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    CUCK(cudaDeviceSynchronize());
    for (int j = 0; j < CE_STREAMS; j++) {
      cudaStreamDestroy(ce[r][j]);
      cudaEventDestroy(ej[r][j]);
    }
    cudaFree(idx[r]);
    cudaFree(cnt[r]);
    cudaFree(flags[r]);
    cudaFree(ready[r]);
    cudaFree(stg[r]);
    cudaFree(yb[r]);
    free(idx_h[r]);
  }
  return 0;
}

int main(int argc, char **argv) {
  uint32_t T = 4096, H = 7168, K = 8, E = 256, iters = 20, blist[8] = {24, 48};
  int nb = 2, nmodes = 5, do_trace = 0, baselines = 1;
  /* dense: EPD_DESC_HT_DENSE with BF16 rows by the copy engines; dense-reg: the same layout, register rows */
  const char *modes[5] = {"reg", "dense", "dense-reg", "tma", "staging"};
  char modes_buf[64] = "";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--tokens"))
      T = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--hidden"))
      H = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--topk"))
      K = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--experts"))
      E = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters"))
      iters = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--blocks"))
      nb = parse_list(argv[i + 1], blist, 8);
    else if (!strcmp(argv[i], "--trace"))
      do_trace = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--baselines"))
      baselines = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--modes")) {
      snprintf(modes_buf, sizeof modes_buf, "%s", argv[i + 1]);
      nmodes = 0;
      for (char *tok = strtok(modes_buf, ","); tok && nmodes < 5; tok = strtok(NULL, ","))
        if (!strcmp(tok, "tma") || !strcmp(tok, "reg") || !strcmp(tok, "staging") || !strcmp(tok, "dense") ||
            !strcmp(tok, "dense-reg"))
          modes[nmodes++] = tok;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0); /* whole lines out even if a run is killed */
  char why[160];
  if (kh_unfit(2, why, sizeof why)) {
    printf("%s\n", why);
    return 77;
  }
  /* Both ranks on one GPU: the blocks of both ranks' kernels must be resident at once (they wait for each
   * other), so each rank gets at most half the GPU's SMs. */
  const int share = kh_share(2);
  for (int i = 0; i < nb; i++) {
    const uint32_t b = kh_ht_blocks(blist[i], share, 0);
    if (b != blist[i])
      printf("--blocks %u: %u (the ranks share a GPU, each gets its part of the SMs)\n", blist[i], b);
    blist[i] = b;
  }
  int v = 0;
  ncclGetVersion(&v);
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  printf(
      "HT bench: 2 ranks, %u tokens/rank, hidden %u, top-%u, %u experts; NCCL %d, CUDA runtime %d, driver "
      "API %d\n",
      T, H, K, E, v, rt, drv);
  if (share > 1)
    printf(
        "the 2 ranks share one GPU: no NVLink, figures not comparable with the records of a GPU per rank\n");
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
  printf("rows crossing NVLink per direction: %llu / %llu (of %u tokens; the dense layout sends all %u)\n",
         (unsigned long long)remote[0], (unsigned long long)remote[1], T, T);
  void *img = malloc(epd_k_map_bytes(E));
  epd_k_map_pack(img, map.version, E, map.nrep, (const uint32_t *)map.rep, EPD_MAX_REPLICAS);

  hth_t h;
  /* the target: each op at >= 95% of the copy-kernel ceiling (its best grid, both directions at
   * once, 256 MiB) on at most 24 SMs; kept here to be printed last */
  double reg_gbs[8][3] = {{0}}, dense_gbs[8][3] = {{0}}, ceil_gbs = 0;
  static const char *const opnames[3] = {"dispatch_bf16", "dispatch_fp8", "combine_bf16"};
  for (int bi = 0; bi < nb; bi++) {
    /* EPD_BENCH_CE_SPLIT: copies per dest rank of the copy-engine path (engine.ht_ce_split in the daemon) */
    const uint32_t ce_split = getenv("EPD_BENCH_CE_SPLIT") ? (uint32_t)atoi(getenv("EPD_BENCH_CE_SPLIT")) : 0;
    epd_k_ht_geom_t g = {2, 0, E, H, K, M, S, C, blist[bi], ce_split};
    CK(hth_create(&h, 2, &g));
    CK(hth_set_map(&h, img));
    for (int r = 0; r < 2; r++) {
      cudaSetDevice(epd_cc_device(h.kh.cc, r));
      CUCK(cudaMemcpy(hth_buf(&h, r, 0, EPD_BUF_X), x[r], (size_t)T * H * 2, cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(hth_buf(&h, r, 0, EPD_BUF_TOPK_IDX), topk[r], (size_t)T * K * 8,
                      cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(hth_buf(&h, r, 0, EPD_BUF_TOPK_WEIGHTS), w[r], (size_t)T * K * 4,
                      cudaMemcpyHostToDevice));
      CUCK(cudaMemset(hth_buf(&h, r, 0, EPD_BUF_HT_Y), 0x3c, (size_t)C * H * 2));
      CUCK(cudaDeviceSynchronize());
    }
    timer_t_ tm;
    timer_init(h.kh.cc, &tm);
    uint32_t ntok[2] = {T, T};
    for (int mi = 0; mi < nmodes; mi++) {
      h.staging = !strcmp(modes[mi], "staging");
      h.dense = !strncmp(modes[mi], "dense", 5);
      h.copy = !strcmp(modes[mi], "tma")     ? EPD_K_HT_COPY_TMA
               : !strcmp(modes[mi], "dense") ? EPD_K_HT_COPY_CE
                                             : EPD_K_HT_COPY_REG;
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
        if (c0.status || c1.status)
          printf("rank %d: status dispatch %d combine %d\n", r, c0.status, c1.status);
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
          const int nst = o < 2 ? 12 : 5;
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
            CK(hth_launch(&h, 3, o < 2 ? EPD_OP_HT_DISPATCH : EPD_OP_HT_COMBINE, 0, ntok,
                          o == 1 ? EPD_DESC_FP8 : 0, 2000000000ull));
            gate_end(h.kh.cc, h.kh.st, &tm, 3);
            uint64_t hv[16];
            cudaSetDevice(epd_cc_device(h.kh.cc, 0));
            CUCK(cudaMemcpy(hv, tr[0], 16 * 8, cudaMemcpyDeviceToHost));
            if (o < 2 && hv[10]) hv[10] = ~hv[10]; /* the earliest block's stamp, stored complemented */
            for (int i = 1; i < nst; i++) acc[i] += hv[i] ? (double)(hv[i] - hv[0]) / 1000.0 : -1.0;
          }
          printf("trace %-14s %-7s SMs %3u (us from %s):", opnames[o], modes[mi], blist[bi],
                 o < 2 ? "route start" : "start");
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
        printf("%-14s %-7s SMs %3u: %8.1f us  %6.1f GB/s per direction\n", opnames[o], modes[mi], blist[bi],
               us, gbs);
        if (!strcmp(modes[mi], "reg")) reg_gbs[bi][o] = gbs;
        if (!strcmp(modes[mi], "dense")) dense_gbs[bi][o] = gbs;
        printf(
            "JSON {\"op\":\"ht_%s\",\"mode\":\"%s\",\"sms\":%u,\"tokens\":%u,\"hidden\":%u,\"us\":%.1f,"
            "\"algbw_gbs\":%.1f}\n",
            opnames[o], modes[mi], blist[bi], T, H, us, gbs);
      }
    }
    /* baselines once, on the first context's communicators (--baselines 0: none) */
    if (bi == 0 && baselines) {
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
      printf("%-14s        : %8.1f us  %6.1f GB/s per direction (same bytes as the BF16 dispatch)\n",
             "nccl_sendrecv", us, gbs);
      printf("JSON {\"op\":\"nccl_sendrecv\",\"tokens\":%u,\"hidden\":%u,\"us\":%.1f,\"algbw_gbs\":%.1f}\n",
             T, H, us, gbs);
      /* plain copy kernel into the peer GPU */
      for (int r = 0; r < 2 && epd_cc_device(h.kh.cc, 0) != epd_cc_device(h.kh.cc, 1); r++) {
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
          printf("copy_kernel %-4s blocks %3u: %8.1f us  %6.1f GB/s per direction (256 MiB)\n",
                 both ? "both" : "one", cbl[ci], cu, cg);
          if (both && cg > ceil_gbs) ceil_gbs = cg;
          printf("JSON {\"op\":\"copy_%s\",\"blocks\":%u,\"bytes\":%zu,\"us\":%.1f,\"gbs\":%.1f}\n",
                 both ? "both" : "one", cbl[ci], cb, cu, cg);
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
          printf("copy_kernel %s both, op bytes, blocks %3u: %8.1f us  %6.1f GB/s per direction\n",
                 pull ? "pull" : "push", blist[bi2], cu, cg);
          printf("JSON {\"op\":\"copy_%s_both_opbytes\",\"blocks\":%u,\"us\":%.1f,\"gbs\":%.1f}\n",
                 pull ? "pull" : "push", blist[bi2], cu, cg);
        }
      /* the same bytes through the bulk-copy engine (TMA), both ways, 2 / 4 / 6 chunks in flight per SM,
       * pushing (what dispatch does) and pulling (what combine does): how close can this many SMs get to
       * the ceiling? */
      for (int bi2 = 0; bi2 < nb; bi2++)
        for (int tv = 0; tv < 12; tv++) {
          const int big = tv & 1, pull = tv >= 6;
          const uint32_t stages = 2 + 2 * (uint32_t)((tv % 6) / 2); /* 2, 4, 6 chunks of 32 KB in flight */
          double cs_us = 0;
          size_t nbt[2] = {big ? cb : nbytes[0] / 16 * 16, big ? cb : nbytes[1] / 16 * 16};
          /* rank r's copy moves rank src(r)'s bytes into rank 1 - src(r)'s memory */
#define TMA_SRC(r) (pull ? 1 - (r) : (r))
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
              const int sr = TMA_SRC(r);
              if (epd_k_copy_tma(cd[1 - sr], cs[sr], nbt[sr], blist[bi2], stages, h.kh.st[r]) != EPD_OK) {
                fprintf(stderr, "copy_tma launch failed\n");
                return 1;
              }
            }
            double u1 = gate_end(h.kh.cc, h.kh.st, &tm, 3);
            if (it >= 3) cs_us += u1;
          }
          /* the last copy landed whole: every source byte is 1 (memset), its destination was zeroed */
          for (int sr = 0; sr < 2; sr++) {
            unsigned char *chk = malloc(nbt[sr]);
            if (!chk) return 1;
            cudaSetDevice(epd_cc_device(h.kh.cc, 1 - sr));
            CUCK(cudaMemcpy(chk, cd[1 - sr], nbt[sr], cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < nbt[sr]; i++)
              if (chk[i] != 1) {
                fprintf(stderr, "copy_tma: byte %zu of %zu is %u, not 1\n", i, nbt[sr], chk[i]);
                return 1;
              }
            free(chk);
          }
#undef TMA_SRC
          double cu = cs_us / iters, cg = (double)(nbt[0] + nbt[1]) / 2 / (cu * 1e-6) / 1e9;
          printf(
              "copy_tma %s both, %s, blocks %3u, %u x 32 KB in flight: %8.1f us  %6.1f GB/s per direction\n",
              pull ? "pull" : "push", big ? "256 MiB" : "op bytes", blist[bi2], stages, cu, cg);
          printf(
              "JSON {\"op\":\"copy_tma_%s_both_%s\",\"blocks\":%u,\"stages\":%u,\"us\":%.1f,\"gbs\":%.1f}\n",
              pull ? "pull" : "push", big ? "256mib" : "opbytes", blist[bi2], stages, cu, cg);
        }
      if (ce_bench(&h, &tm, x, plan.ht_pos, M, T, H, nbytes, cs, cd, iters) != 0) return 1;
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
        printf("copy_kernel pull blocks %3u: %8.1f us  %6.1f GB/s per direction (256 MiB)\n", cbl[ci], cu,
               cg);
        printf("JSON {\"op\":\"copy_pull\",\"blocks\":%u,\"bytes\":%zu,\"us\":%.1f,\"gbs\":%.1f}\n", cbl[ci],
               cb, cu, cg);
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
  if (ceil_gbs > 0 && share > 1) {
    printf(
        "target: not evaluated (the ranks share a GPU: the copy-kernel ceiling is a copy within it, the "
        "target is about NVLink)\n");
  } else if (ceil_gbs > 0) {
    printf(
        "target: >= 95%% of the copy-kernel ceiling (best of 24/66/132 blocks, both directions at once: %.1f "
        "GB/s "
        "per direction; 95%% = %.1f) on at most 24 SMs\n",
        ceil_gbs, 0.95 * ceil_gbs);
    for (int dn = 0; dn < 2; dn++)
      for (int bi = 0; bi < nb; bi++)
        for (int o = 0; o < 3; o++) {
          const double g = dn ? dense_gbs[bi][o] : reg_gbs[bi][o];
          if (o == 1 || blist[bi] > 24 || g <= 0) continue; /* the target names BF16 dispatch and combine */
          const double pct = 100.0 * g / ceil_gbs;
          printf("target %-14s %-5s SMs %3u: %6.1f GB/s = %5.1f%% of the ceiling (%s)\n", opnames[o],
                 dn ? "dense" : "reg", blist[bi], g, pct, pct >= 95.0 ? "met" : "missed");
          printf(
              "JSON "
              "{\"op\":\"target_%s\",\"mode\":\"%s\",\"sms\":%u,\"gbs\":%.1f,\"ceiling_gbs\":%.1f,\"pct\":%."
              "1f}\n",
              opnames[o], dn ? "dense" : "reg", blist[bi], g, ceil_gbs, pct);
        }
  }
  return 0;
}
