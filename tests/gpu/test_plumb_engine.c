/*
 * test_plumb_engine.c - the engine with the CUDA backend, in-process: clients import their GPU arena
 * from the attach fd (libepd_cuda), map and register their queue, and submit from a CUDA stream per
 * rank with stream memory operations. LL dispatch/combine results must equal the reference (ref.c);
 * also a missing peer times out naming it, a lost client fails the step with EPD_ERR_PEER, and the
 * engine recovers. A GPU per rank with two; with one both ranks share it (engine devices 0,0: NCCL's
 * multi-rank mode, the engine splits the GPU's blocks). Skips without a GPU.
 */
#if EPD_WITH_CUDA
#define _GNU_SOURCE
#include <math.h>
#include <sys/mman.h>
#include <time.h>
#include <stdarg.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "../test.h"
#include "cuda/cuda_comm.h"
#include "core/engine.h"
#include "libepd_cuda.h"
#include "core/ref.h"

#define NR 2
#define CK(call)                                                                                       \
  do {                                                                                                 \
    cudaError_t e_ = (call);                                                                           \
    if (e_ != cudaSuccess) epd_test_fail(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)

typedef struct gclient {
  epd_attach_info_t info;
  epd_queue_t *q;
  epd_cuda_hostreg_t *reg;
  uint64_t qdev;
  epd_cuda_map_t *map;
  uint8_t *arena; /* device address */
  uint32_t next;
  cudaStream_t s;
} gclient_t;

/* Measurements: to stdout (the runner keeps it only on failure) and appended to $EPD_PLUMB_LOG. */
static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  const char *p = getenv("EPD_PLUMB_LOG");
  FILE *f = p && *p ? fopen(p, "a") : NULL;
  if (f) {
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fclose(f);
  }
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The GPU of each rank: rank r on GPU r, or r % (GPUs present) where there are fewer than NR. */
static int g_dev[NR];

static void need_gpus(void) {
  const int share = epd_cc_devices_for(NR, g_dev);
  if (share < 0) epd_test_skip("needs a GPU (found none)");
  if (share > EPD_CC_MAX_RANKS_PER_GPU)
    epd_test_skip("%d ranks would share one GPU (at most %d)", share, EPD_CC_MAX_RANKS_PER_GPU);
}

int epd_engine_cuda_linked(void); /* engine_cuda.c: pulls the CUDA backend out of the static library */

static epd_engine_t *engine_up(uint32_t timeout_ms) {
  ASSERT(epd_engine_cuda_linked());
  epd_engine_opts_t o;
  memset(&o, 0, sizeof o);
  o.backend = "cuda";
  o.num_ranks = NR;
  o.devices = g_dev; /* need_gpus filled it */
  o.max_experts = 512;
  o.max_hidden = 8192;
  o.max_topk = 16;
  o.max_tokens = 256;
  o.slots_factor_pct = 100;
  o.max_groups = 4;
  o.max_clients_per_rank = 4;
  o.max_arena_bytes = 8ull << 30;
  o.step_timeout_ms = timeout_ms;
  epd_engine_t *eng = NULL;
  char err[256] = "";
  epd_result_t rc = epd_engine_create(&o, NULL, NULL, &eng, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "engine_create(cuda): %d %s", rc, err);
  ASSERT_STR_CONTAINS(epd_engine_backend(eng), "cuda");
  return eng;
}

static uint32_t g_on_loss, g_renorm; /* attach: on_rank_loss and renormalize of the request */

static void attach(epd_engine_t *eng, const char *group, int rank, uint32_t E, uint32_t H, uint32_t K,
                   uint32_t M, gclient_t *c) {
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  req.on_rank_loss = g_on_loss;
  req.renormalize = g_renorm;
  snprintf(req.group, sizeof req.group, "%s", group);
  snprintf(req.name, sizeof req.name, "gpu-test-r%d", rank);
  req.rank = rank;
  req.num_experts = E;
  req.hidden = H;
  req.topk = K;
  req.max_tokens = M;
  req.pid = (uint32_t)getpid();
  memset(c, 0, sizeof *c);
  char err[256] = "";
  epd_result_t rc = epd_engine_attach(eng, &req, &c->info, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "attach rank %d: %d %s", rank, rc, err);
  ASSERT(c->info.on_gpu);
  ASSERT_EQ(c->info.device, g_dev[rank]);
  CK(cudaSetDevice(c->info.device));
  CK(cudaStreamCreateWithFlags(&c->s, cudaStreamNonBlocking));
  /* As libepd does: our own mappings of the fds. */
  c->q = mmap(NULL, c->info.queue_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.queue_fd, 0);
  ASSERT(c->q != MAP_FAILED);
  ASSERT_EQ(c->q->magic, EPD_QUEUE_MAGIC);
  if ((rc = epd_cuda_register_host(c->q, c->info.queue_bytes, c->info.device, &c->reg, &c->qdev, err,
                                   sizeof err)))
    epd_test_fail(__FILE__, __LINE__, "register queue: %s", err);
  void *a = NULL;
  if ((rc = epd_cuda_import(c->info.arena_fd, c->info.arena_bytes, c->info.device, &c->map, &a, err,
                            sizeof err)))
    epd_test_fail(__FILE__, __LINE__, "import arena: %s", err);
  c->arena = a;
}

static void detach(epd_engine_t *eng, gclient_t *c, int lost) {
  cudaSetDevice(c->info.device);
  cudaStreamSynchronize(c->s);
  epd_cuda_unregister_host(c->reg);
  epd_cuda_unimport(c->map);
  munmap(c->q, c->info.queue_bytes);
  cudaStreamDestroy(c->s);
  ASSERT_OK(epd_engine_detach(eng, c->info.client_id, lost));
}

static void *buf(const gclient_t *c, uint32_t kind, uint32_t bank, size_t *bytes) {
  for (uint32_t i = 0; i < c->info.nbuffers; i++)
    if (c->info.buffers[i].kind == kind && c->info.buffers[i].bank == bank) {
      if (bytes) *bytes = c->info.buffers[i].bytes;
      return c->arena + c->info.buffers[i].offset;
    }
  epd_test_fail(__FILE__, __LINE__, "buffer %u/%u not in the arena", kind, bank);
}

/* Enqueue an op on the client's stream: descriptor and SUBMITTED only. The completion is awaited on
 * the host (finish), not with a stream WAIT: in one process the client's stream and the engine's
 * kernel stream share the context, and a blocked stream memory wait can stall the engine's kernel
 * behind it on a shared hardware queue (a deadlock seen on the H200s; across processes, as with the
 * daemon, the contexts are separate). */
static void submit(gclient_t *c, uint32_t op, uint32_t bank, uint32_t T, uint32_t flags, uint64_t tag) {
  epd_desc_t d;
  memset(&d, 0, sizeof d);
  d.op = op;
  d.bank = bank;
  d.num_tokens = T;
  d.flags = flags;
  d.user_tag = tag;
  char err[256] = "";
  CK(cudaSetDevice(c->info.device));
  uint64_t slot = c->qdev + offsetof(epd_queue_t, slot) + (uint64_t)c->next * sizeof(epd_slot_t);
  int rc = epd_cuda_submit_async(c->s, slot, &d, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "epd_cuda_submit_async: %s", err);
}

/* Wait for the client's stream (time-limited) and return the completion of its last op. */
static epd_comp_t finish(gclient_t *c, int timeout_s) {
  CK(cudaSetDevice(c->info.device));
  uint64_t dl = now_ns() + (uint64_t)timeout_s * 1000000000ull;
  cudaError_t e;
  while ((e = cudaStreamQuery(c->s)) == cudaErrorNotReady)
    if (now_ns() > dl)
      epd_test_fail(__FILE__, __LINE__, "rank %d: submission not written in %d s", c->info.device, timeout_s);
  CK(e);
  epd_slot_t *sl = &c->q->slot[c->next];
  while (__atomic_load_n(&sl->state, __ATOMIC_ACQUIRE) != EPD_SLOT_DONE)
    if (now_ns() > dl)
      epd_test_fail(__FILE__, __LINE__, "rank %d: op did not complete in %d s (state %u)", c->info.device,
                    timeout_s, sl->state);
  epd_comp_t comp = sl->comp;
  __atomic_store_n(&sl->state, EPD_SLOT_FREE, __ATOMIC_RELEASE);
  c->next = (c->next + 1) % EPD_QUEUE_SLOTS;
  return comp;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)(rng >> 11);
}
static float frand(void) {
  return (float)(rnd() % 2000001) / 1e6f - 1.0f;
}

typedef struct geom {
  uint32_t E, H, K, M, S;
} geom_t;

/* Host copies of every rank's inputs and the reference outputs. */
typedef struct step_data {
  uint16_t *x[NR];
  int64_t *idx[NR];
  float *w[NR];
  uint32_t T[NR];
} step_data_t;

static void make_inputs(const geom_t *g, step_data_t *d, int skew) {
  for (int r = 0; r < NR; r++) {
    d->T[r] = skew == 2 ? g->M : 1 + rnd() % g->M;
    for (size_t i = 0; i < (size_t)g->M * g->H; i++) d->x[r][i] = epd_f32_to_bf16(frand());
    for (uint32_t t = 0; t < g->M; t++)
      for (uint32_t k = 0; k < g->K; k++) {
        int64_t e = (int64_t)(rnd() % (g->E + 1)) - 1; /* -1 = none, some duplicates */
        if (skew == 1) e = (int64_t)(rnd() % 3) - 1;   /* all-to-few */
        d->idx[r][t * g->K + k] = e;
        d->w[r][t * g->K + k] = frand();
      }
  }
}

/* Run LL dispatch (+ combine) steps on the GPUs and compare with the reference. */
static void run_ll(epd_engine_t *eng, const char *group, const geom_t *g, int steps, int fp8, int skew) {
  gclient_t c[NR];
  for (int r = 0; r < NR; r++) attach(eng, group, r, g->E, g->H, g->K, g->M, &c[r]);
  uint32_t S = c[0].info.slots_per_rank;
  epd_expert_map_t map;
  ASSERT_OK(epd_engine_get_map(eng, group, &map));
  epd_ref_geom_t rg = {NR, g->E, g->H, g->K, g->M, S, c[0].info.ht_capacity};
  epd_ref_plan_t plan;
  ASSERT_OK(epd_ref_plan_init(&plan, &rg));
  step_data_t d;
  size_t xs = (size_t)g->M * g->H, ks = (size_t)g->M * g->K, rows = (size_t)S * NR * g->M;
  for (int r = 0; r < NR; r++) {
    d.x[r] = malloc(xs * 2);
    d.idx[r] = malloc(ks * 8);
    d.w[r] = malloc(ks * 4);
  }
  uint16_t *rx[NR], *ry[NR], *rout[NR], *gx = malloc(rows * g->H * 2), *gout = malloc(xs * 2);
  float *rsc[NR];
  int32_t *rcount[NR], *rsrc[NR], *gcount = malloc(S * 4), *gsrc = malloc(rows * 4);
  for (int r = 0; r < NR; r++) {
    rx[r] = malloc(rows * g->H * 2);
    ry[r] = malloc(rows * g->H * 2);
    rout[r] = malloc(xs * 2);
    rsc[r] = malloc(rows * (g->H / 128) * 4);
    rcount[r] = malloc(S * 4);
    rsrc[r] = malloc(rows * 4);
  }
  double disp_us = 0, comb_us = 0;
  for (int step = 0; step < steps; step++) {
    uint32_t bank = (uint32_t)step % EPD_NUM_BANKS;
    make_inputs(g, &d, skew);
    epd_ref_in_t in[NR];
    epd_ref_out_t out[NR], *outp[NR];
    for (int r = 0; r < NR; r++) {
      in[r] = (epd_ref_in_t){d.T[r], d.x[r], d.idx[r], d.w[r]};
      memset(&out[r], 0, sizeof out[r]);
      out[r].recv_x = rx[r];
      out[r].recv_scales = rsc[r];
      out[r].recv_count = rcount[r];
      out[r].recv_src = rsrc[r];
      outp[r] = &out[r];
      CK(cudaSetDevice(c[r].info.device));
      CK(cudaMemcpy(buf(&c[r], EPD_BUF_X, bank, NULL), d.x[r], xs * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(buf(&c[r], EPD_BUF_TOPK_IDX, bank, NULL), d.idx[r], ks * 8, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(buf(&c[r], EPD_BUF_TOPK_WEIGHTS, bank, NULL), d.w[r], ks * 4, cudaMemcpyHostToDevice));
      /* Poison the outputs. */
      CK(cudaMemset(buf(&c[r], EPD_BUF_LL_RECV_X, bank, NULL), 0xff, rows * g->H * 2));
      CK(cudaMemset(buf(&c[r], EPD_BUF_LL_RECV_COUNT, bank, NULL), 0xff, S * 4));
      CK(cudaMemset(buf(&c[r], EPD_BUF_OUT, bank, NULL), 0xff, xs * 2));
    }
    int bad = -1;
    char err[256] = "";
    ASSERT_OK(epd_ref_plan_build(&plan, &map, in, &bad, err, sizeof err));
    ASSERT_OK(epd_ref_ll_dispatch(&plan, in, fp8, outp));
    uint64_t t0 = now_ns();
    for (int r = 0; r < NR; r++)
      submit(&c[r], EPD_OP_LL_DISPATCH, bank, d.T[r], fp8 ? EPD_DESC_FP8 : 0, 100 + (uint64_t)step);
    for (int r = 0; r < NR; r++) {
      epd_comp_t comp = finish(&c[r], 30);
      if (comp.status)
        epd_test_fail(__FILE__, __LINE__, "step %d rank %d dispatch: status %d peer %d", step, r, comp.status,
                      comp.peer);
      ASSERT_EQ(comp.user_tag, 100 + (uint64_t)step);
      ASSERT_EQ(comp.num_recv, plan.ll_recv[r]);
    }
    disp_us += (now_ns() - t0) / 1e3;
    for (int r = 0; r < NR; r++) {
      CK(cudaSetDevice(c[r].info.device));
      CK(cudaMemcpy(gcount, buf(&c[r], EPD_BUF_LL_RECV_COUNT, bank, NULL), S * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(gsrc, buf(&c[r], EPD_BUF_LL_RECV_SRC, bank, NULL), rows * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(gx, buf(&c[r], EPD_BUF_LL_RECV_X, bank, NULL), rows * g->H * 2, cudaMemcpyDeviceToHost));
      for (uint32_t s = 0; s < S; s++) {
        ASSERT_EQ(gcount[s], rcount[r][s]);
        for (int32_t j = 0; j < gcount[s]; j++) {
          size_t row = (size_t)s * NR * g->M + (size_t)j;
          ASSERT_EQ(gsrc[row], rsrc[r][row]);
          if (!fp8) {
            if (memcmp(gx + row * g->H, rx[r] + row * g->H, g->H * 2))
              epd_test_fail(__FILE__, __LINE__, "step %d rank %d slot %u row %d: recv_x differs", step, r, s,
                            j);
          } else {
            /* FP8 bytes in the first H bytes of the row: allow one e4m3 step of difference. */
            const uint8_t *a = (const uint8_t *)(gx + row * g->H), *b = (const uint8_t *)(rx[r] + row * g->H);
            for (uint32_t h = 0; h < g->H; h++)
              if (fabsf(epd_e4m3_to_f32(a[h]) - epd_e4m3_to_f32(b[h])) >
                  0.07f * fabsf(epd_e4m3_to_f32(b[h])) + 1e-3f)
                epd_test_fail(__FILE__, __LINE__, "step %d rank %d slot %u row %d ch %u: fp8 %02x vs %02x",
                              step, r, s, j, h, a[h], b[h]);
          }
        }
      }
    }
    /* Combine: random expert outputs on every received row. */
    for (int r = 0; r < NR; r++) {
      /* Only received rows are read by combine: fill those (the others keep malloc garbage). */
      for (uint32_t s = 0; s < S; s++)
        for (int32_t j = 0; j < rcount[r][s]; j++) {
          uint16_t *row = ry[r] + ((size_t)s * NR * g->M + (size_t)j) * g->H;
          for (uint32_t h = 0; h < g->H; h++) row[h] = epd_f32_to_bf16(frand());
        }
      CK(cudaSetDevice(c[r].info.device));
      CK(cudaMemcpy(buf(&c[r], EPD_BUF_LL_Y, bank, NULL), ry[r], rows * g->H * 2, cudaMemcpyHostToDevice));
    }
    const uint16_t *yc[NR] = {ry[0], ry[1]};
    uint16_t *oc[NR] = {rout[0], rout[1]};
    ASSERT_OK(epd_ref_ll_combine(&plan, yc, oc));
    t0 = now_ns();
    for (int r = 0; r < NR; r++) submit(&c[r], EPD_OP_LL_COMBINE, bank, 0, 0, 200 + (uint64_t)step);
    for (int r = 0; r < NR; r++) {
      epd_comp_t comp = finish(&c[r], 30);
      if (comp.status)
        epd_test_fail(__FILE__, __LINE__, "step %d rank %d combine: status %d peer %d", step, r, comp.status,
                      comp.peer);
    }
    comb_us += (now_ns() - t0) / 1e3;
    for (int r = 0; r < NR; r++) {
      CK(cudaSetDevice(c[r].info.device));
      CK(cudaMemcpy(gout, buf(&c[r], EPD_BUF_OUT, bank, NULL), xs * 2, cudaMemcpyDeviceToHost));
      for (uint32_t t = 0; t < d.T[r]; t++)
        for (uint32_t h = 0; h < g->H; h++) {
          float a = epd_bf16_to_f32(gout[t * g->H + h]), b = epd_bf16_to_f32(rout[r][t * g->H + h]);
          if (!(fabsf(a - b) <= 0.02f * fabsf(b) + 0.02f))
            epd_test_fail(__FILE__, __LINE__, "step %d rank %d token %u ch %u: out %g vs ref %g", step, r, t,
                          h, a, b);
        }
    }
  }
  report(
      "%s: E%u H%u K%u M%u %s: %d steps ok; dispatch %.1f us, combine %.1f us per step (host-synced, "
      "submit by stream memops, host-polled completion)\n",
      group, g->E, g->H, g->K, g->M, fp8 ? "fp8" : "bf16", steps, disp_us / steps, comb_us / steps);
  for (int r = 0; r < NR; r++) detach(eng, &c[r], 0);
  epd_ref_plan_free(&plan);
  epd_expert_map_free(&map);
}

EPD_TEST_T(plumb_engine_ll_equal_ref, 300) {
  need_gpus();
  epd_engine_t *eng = engine_up(10000);
  geom_t small = {16, 256, 4, 32, 0};
  run_ll(eng, "small", &small, 20, 0, 0);
  run_ll(eng, "skew", &small, 5, 0, 1);
  run_ll(eng, "full", &small, 5, 0, 2);
  run_ll(eng, "fp8", &small, 5, 1, 0);
  geom_t big = {256, 7168, 8, 128, 0};
  run_ll(eng, "big", &big, 4, 0, 2);
  run_ll(eng, "big-fp8", &big, 4, 1, 2);
  epd_engine_destroy(eng);
}

/* Only rank 0 submits: it gets EPD_ERR_TIMEOUT naming rank 1; a lost client gives EPD_ERR_PEER; then
 * the engine runs steps again. */
EPD_TEST_T(plumb_engine_timeout_and_peer_lost, 120) {
  need_gpus();
  epd_engine_t *eng = engine_up(300);
  geom_t g = {16, 256, 4, 32, 0};
  gclient_t c[NR];
  for (int r = 0; r < NR; r++) attach(eng, "t", r, g.E, g.H, g.K, g.M, &c[r]);
  CK(cudaSetDevice(c[0].info.device));
  CK(cudaMemset(buf(&c[0], EPD_BUF_TOPK_IDX, 0, NULL), 0xff, (size_t)g.M * g.K * 8)); /* all -1 */
  CK(cudaSetDevice(c[1].info.device));
  CK(cudaMemset(buf(&c[1], EPD_BUF_TOPK_IDX, 0, NULL), 0xff, (size_t)g.M * g.K * 8));
  uint64_t t0 = now_ns();
  submit(&c[0], EPD_OP_LL_DISPATCH, 0, 4, 0, 1);
  epd_comp_t comp = finish(&c[0], 10);
  ASSERT_EQ(comp.status, EPD_ERR_TIMEOUT);
  ASSERT_EQ(comp.peer, 1);
  report("timeout answered after %.0f ms (step_timeout 300 ms)\n", (now_ns() - t0) / 1e6);
  /* Both submit: works again. */
  for (int r = 0; r < NR; r++) submit(&c[r], EPD_OP_LL_DISPATCH, 0, 4, 0, 2);
  for (int r = 0; r < NR; r++) ASSERT_EQ(finish(&c[r], 10).status, 0);
  /* Rank 0 waits for rank 1, whose client dies: EPD_ERR_PEER naming rank 1. */
  submit(&c[0], EPD_OP_LL_COMBINE, 0, 0, 0, 3);
  usleep(50000);
  detach(eng, &c[1], 1);
  comp = finish(&c[0], 10);
  ASSERT_EQ(comp.status, EPD_ERR_PEER);
  ASSERT_EQ(comp.peer, 1);
  /* A new client on rank 1: steps run again. */
  attach(eng, "t", 1, 0, 0, 0, 0, &c[1]);
  CK(cudaSetDevice(c[1].info.device));
  CK(cudaMemset(buf(&c[1], EPD_BUF_TOPK_IDX, 0, NULL), 0xff, (size_t)g.M * g.K * 8));
  for (int r = 0; r < NR; r++) submit(&c[r], EPD_OP_LL_DISPATCH, 0, 4, 0, 4);
  for (int r = 0; r < NR; r++) ASSERT_EQ(finish(&c[r], 10).status, 0);
  for (int r = 0; r < NR; r++) detach(eng, &c[r], 0);
  epd_engine_destroy(eng);
}

/* A dispatch refused on the host (mismatched banks; draining) runs no kernel: the combine of its bank
 * must fail with EPD_ERR_STATE, not run on the bank's older dispatch. While draining, the combine of a
 * dispatch that ran still runs. */
EPD_TEST_T(plumb_engine_refused_dispatch_and_drain, 120) {
  need_gpus();
  epd_engine_t *eng = engine_up(2000);
  geom_t g = {16, 256, 4, 32, 0};
  gclient_t c[NR];
  for (int r = 0; r < NR; r++) {
    attach(eng, "rd", r, g.E, g.H, g.K, g.M, &c[r]);
    CK(cudaSetDevice(c[r].info.device));
    for (uint32_t b = 0; b < EPD_NUM_BANKS; b++)
      CK(cudaMemset(buf(&c[r], EPD_BUF_TOPK_IDX, b, NULL), 0xff, (size_t)g.M * g.K * 8)); /* all -1 */
  }
  uint64_t tag = 1;
  /* op on every rank (bank per rank), every completion's status */
  static const struct {
    uint32_t op, bank[NR];
    int draining, want;
  } seq[] = {
      {EPD_OP_LL_DISPATCH, {0, 0}, 0, EPD_OK},           {EPD_OP_LL_COMBINE, {0, 0}, 0, EPD_OK},
      {EPD_OP_LL_DISPATCH, {0, 1}, 0, EPD_ERR_MISMATCH}, {EPD_OP_LL_COMBINE, {0, 0}, 0, EPD_ERR_STATE},
      {EPD_OP_LL_DISPATCH, {0, 0}, 0, EPD_OK},           {EPD_OP_LL_COMBINE, {0, 0}, 1, EPD_OK},
      {EPD_OP_LL_DISPATCH, {1, 1}, 1, EPD_ERR_DRAINING}, {EPD_OP_LL_COMBINE, {1, 1}, 1, EPD_ERR_STATE},
      {EPD_OP_LL_DISPATCH, {1, 1}, 0, EPD_OK},           {EPD_OP_LL_COMBINE, {1, 1}, 0, EPD_OK},
  };
  for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) {
    epd_engine_set_draining(eng, seq[i].draining);
    for (int r = 0; r < NR; r++) submit(&c[r], seq[i].op, seq[i].bank[r], 4, 0, tag);
    for (int r = 0; r < NR; r++) {
      epd_comp_t comp = finish(&c[r], 10);
      if (comp.status != seq[i].want)
        epd_test_fail(__FILE__, __LINE__, "op %zu (op %u) rank %d: status %d, want %d", i, seq[i].op, r,
                      comp.status, seq[i].want);
      ASSERT_EQ(comp.user_tag, tag);
    }
    tag++;
  }
  for (int r = 0; r < NR; r++) detach(eng, &c[r], 0);
  epd_engine_destroy(eng);
}

extern size_t epd_cc_test_free_bytes; /* cuda_comm.c, test builds: the free memory every GPU reports */

/* A group whose windows do not fit the GPUs' free memory is refused at its first attach, naming the
 * GPU, the bytes and the ranks sharing it; an arena that does not fit likewise; with the memory back,
 * the same attach works. */
EPD_TEST_T(plumb_engine_refuses_what_does_not_fit, 120) {
  need_gpus();
  epd_engine_t *eng = engine_up(2000);
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  snprintf(req.group, sizeof req.group, "fit");
  snprintf(req.name, sizeof req.name, "fit-r0");
  req.num_experts = 16;
  req.hidden = 1024;
  req.topk = 4;
  req.max_tokens = 128;
  req.pid = (uint32_t)getpid();
  epd_attach_info_t info;
  char err[256] = "";
  epd_cc_test_free_bytes = 1 << 20;
  ASSERT_EQ(epd_engine_attach(eng, &req, &info, err, sizeof err), EPD_ERR_NOMEM);
  ASSERT_STR_CONTAINS(err, "windows needs");
  ASSERT_STR_CONTAINS(err, "1.0 MiB are free");
  if (g_dev[0] == g_dev[1]) ASSERT_STR_CONTAINS(err, "of the 2 ranks sharing it");
  /* the group is set up by rank 0's attach; then rank 1's arena does not fit */
  epd_cc_test_free_bytes = 0;
  gclient_t c0;
  attach(eng, "fit", 0, 16, 1024, 4, 128, &c0);
  epd_cc_test_free_bytes = 4096;
  req.rank = 1;
  snprintf(req.name, sizeof req.name, "fit-r1");
  err[0] = 0;
  ASSERT_EQ(epd_engine_attach(eng, &req, &info, err, sizeof err), EPD_ERR_NOMEM);
  ASSERT_STR_CONTAINS(err, "the client's arena needs");
  epd_cc_test_free_bytes = 0;
  gclient_t c1;
  attach(eng, "fit", 1, 0, 0, 0, 0, &c1);
  submit(&c0, EPD_OP_LL_DISPATCH, 0, 0, 0, 1);
  submit(&c1, EPD_OP_LL_DISPATCH, 0, 0, 0, 1);
  ASSERT_EQ(finish(&c0, 10).status, EPD_OK);
  ASSERT_EQ(finish(&c1, 10).status, EPD_OK);
  detach(eng, &c0, 0);
  detach(eng, &c1, 0);
  epd_engine_destroy(eng);
}

/* Top-k entries of T tokens whose expert lives on `rank` in the default map (E experts over NR ranks),
 * valid and first of their token only. */
static uint32_t entries_on(const int64_t *idx, uint32_t T, uint32_t K, uint32_t E, int rank) {
  const uint32_t per = (E + NR - 1) / NR;
  uint32_t n = 0;
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t k = 0; k < K; k++) {
      const int64_t e = idx[t * K + k];
      int dup = 0;
      for (uint32_t j = 0; j < k; j++) dup |= idx[t * K + j] == e;
      n += e >= 0 && !dup && (int)(e / per) == rank;
    }
  return n;
}

/* One dispatch + combine of the ranks in `live` (bank 0, T tokens of random top-k); checks each
 * completion's status, mask, dropped entries (those on the masked ranks' experts: the default map has
 * no replicas) and received rows. */
static void mask_step(gclient_t *c, int live, uint64_t mask, uint32_t E, uint32_t K, uint32_t T, uint64_t tag,
                      int joiner) {
  int64_t idx[NR][64 * 8];
  ASSERT(T * K <= 64 * 8);
  for (int r = 0; r < NR; r++) {
    if (!(live >> r & 1)) continue;
    for (uint32_t i = 0; i < T * K; i++) idx[r][i] = (int64_t)(rnd() % (E + 1)) - 1;
    CK(cudaSetDevice(c[r].info.device));
    CK(cudaMemcpy(buf(&c[r], EPD_BUF_TOPK_IDX, 0, NULL), idx[r], (size_t)T * K * 8, cudaMemcpyHostToDevice));
  }
  /* a masked rank's dispatch rejoins at the boundary: taken before the others arrive (else they would
   * run the step without it) */
  if (joiner >= 0) {
    submit(&c[joiner], EPD_OP_LL_DISPATCH, 0, T, 0, tag);
    CK(cudaStreamSynchronize(c[joiner].s));
    usleep(50000);
  }
  for (int r = 0; r < NR; r++)
    if ((live >> r & 1) && r != joiner) submit(&c[r], EPD_OP_LL_DISPATCH, 0, T, 0, tag);
  for (int r = 0; r < NR; r++) {
    if (!(live >> r & 1)) continue;
    epd_comp_t comp = finish(&c[r], 10);
    if (comp.status)
      epd_test_fail(__FILE__, __LINE__, "rank %d dispatch: status %d peer %d", r, comp.status, comp.peer);
    ASSERT_EQ(comp.masked, mask);
    uint32_t drop = 0, recv = 0;
    for (int q = 0; q < NR; q++)
      if (mask >> q & 1) drop += entries_on(idx[r], T, K, E, q);
    for (int q = 0; q < NR; q++)
      if (live >> q & 1) recv += entries_on(idx[q], T, K, E, r);
    ASSERT_EQ(comp.dropped, drop);
    ASSERT_EQ(comp.num_recv, recv);
  }
  for (int r = 0; r < NR; r++)
    if (live >> r & 1) submit(&c[r], EPD_OP_LL_COMBINE, 0, 0, 0, tag + 1);
  for (int r = 0; r < NR; r++)
    if (live >> r & 1) {
      epd_comp_t comp = finish(&c[r], 10);
      ASSERT_EQ(comp.status, EPD_OK);
      ASSERT_EQ(comp.masked, mask);
    }
}

/* on_rank_loss = mask on the CUDA backend: a rank whose client dies is masked (its part of each step runs
 * with no tokens on the memory it left) and rank 0 steps alone, its entries for rank 1's experts dropped;
 * a combine whose dispatch ran before the mask fails naming the rank; a hung rank is masked after the
 * step timeout, its combine fails, its next dispatch rejoins; a new client of a dead rank rejoins too;
 * a group that renormalises steps the same way. */
EPD_TEST_T(plumb_engine_masked_ranks, 120) {
  need_gpus();
  epd_engine_t *eng = engine_up(300);
  const uint32_t E = 16, H = 256, K = 4, T = 32;
  gclient_t c[NR];
  g_on_loss = EPD_RANK_LOSS_MASK;
  for (int r = 0; r < NR; r++) attach(eng, "mk", r, E, H, K, T, &c[r]);
  mask_step(c, 3, 0, E, K, T, 10, -1);
  /* both dispatch; rank 1 dies before the combine: rank 0's combine fails, naming it */
  for (int r = 0; r < NR; r++) submit(&c[r], EPD_OP_LL_DISPATCH, 0, 4, 0, 20);
  for (int r = 0; r < NR; r++) ASSERT_EQ(finish(&c[r], 10).status, EPD_OK);
  detach(eng, &c[1], 1);
  ASSERT_EQ(c[0].q->masked_ranks, 2u);
  submit(&c[0], EPD_OP_LL_COMBINE, 0, 0, 0, 21);
  epd_comp_t comp = finish(&c[0], 10);
  ASSERT_EQ(comp.status, EPD_ERR_PEER);
  ASSERT_EQ(comp.peer, 1);
  /* rank 0 alone, three steps */
  for (int i = 0; i < 3; i++) mask_step(c, 1, 2, E, K, T, 30 + 2 * (uint64_t)i, -1);
  /* a new client of rank 1 rejoins with its first dispatch */
  g_on_loss = 0;
  attach(eng, "mk", 1, 0, 0, 0, 0, &c[1]);
  ASSERT_EQ(c[1].q->masked_ranks, 2u);
  mask_step(c, 3, 0, E, K, T, 40, 1);
  /* rank 1 hangs: rank 0's dispatch times out naming it, then rank 0 steps alone */
  submit(&c[0], EPD_OP_LL_DISPATCH, 0, 4, 0, 50);
  comp = finish(&c[0], 10);
  ASSERT_EQ(comp.status, EPD_ERR_TIMEOUT);
  ASSERT_EQ(comp.peer, 1);
  mask_step(c, 1, 2, E, K, T, 51, -1);
  /* it wakes up with a combine: refused at once, naming itself; its dispatch rejoins */
  submit(&c[1], EPD_OP_LL_COMBINE, 0, 0, 0, 60);
  comp = finish(&c[1], 10);
  ASSERT_EQ(comp.status, EPD_ERR_PEER);
  ASSERT_EQ(comp.peer, 1);
  ASSERT_EQ(comp.masked, 2u);
  mask_step(c, 3, 0, E, K, T, 61, 1);
  for (int r = 0; r < NR; r++) detach(eng, &c[r], 0);
  /* renormalisation: rank 0 alone after rank 1 died, its dispatches with EPD_K_RENORMALIZE (the weights
   * themselves: gpu_ll_masked_map_drops_and_renormalizes, 171-renormalize-cuda) */
  g_on_loss = EPD_RANK_LOSS_MASK;
  g_renorm = 1;
  for (int r = 0; r < NR; r++) attach(eng, "rn", r, E, H, K, T, &c[r]);
  g_on_loss = g_renorm = 0;
  mask_step(c, 3, 0, E, K, T, 70, -1);
  detach(eng, &c[1], 1);
  for (int i = 0; i < 2; i++) mask_step(c, 1, 2, E, K, T, 80 + 2 * (uint64_t)i, -1);
  detach(eng, &c[0], 0);
  epd_engine_destroy(eng);
}

#else /* !EPD_WITH_CUDA */
#include "../test.h"
EPD_TEST(gpu_plumb_engine_without_cuda) {
  epd_test_skip("built without CUDA (WITH_CUDA=0)");
}
#endif
