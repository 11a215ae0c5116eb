/*
 * test_ll.c - LL dispatch/combine kernels of 2 ranks in one process, against the host reference
 * (daemon/ref.h): random inputs, poisoned outputs, -1 and duplicate entries, skewed and all-to-one
 * routing, redundant replicas, FP8, many steps, bad expert ids, too many tokens, a peer that never comes.
 * A GPU per rank with two; with one both ranks share it (NCCL's multi-rank mode, half the blocks each:
 * harness_common.h). Skips (77) without a GPU.
 */
#if EPD_WITH_CUDA
#include <math.h>
#include <unistd.h>

#include "../test.h"
#include "ll_harness.h"
#include "core/ref.h"

#define CK(e)                                                                                 \
  do {                                                                                        \
    int r_ = (int)(e);                                                                        \
    if (r_ != 0) epd_test_fail(__FILE__, __LINE__, "%s returned %d: %s", #e, r_, C.h.kh.err); \
  } while (0)
#define CUCK(e)                                                                                     \
  do {                                                                                              \
    cudaError_t c_ = (e);                                                                           \
    if (c_ != cudaSuccess) epd_test_fail(__FILE__, __LINE__, "%s: %s", #e, cudaGetErrorString(c_)); \
  } while (0)

enum { ROUTE_RANDOM = 0, ROUTE_SKEW = 1, ROUTE_ALL_TO_ONE = 2 };

typedef struct ctx {
  llh_t h;
  epd_ref_geom_t rg;
  epd_expert_map_t map;
  epd_ref_plan_t plan;
  uint16_t *x[2];
  int64_t *topk[2];
  float *w[2];
  uint16_t *y[2];
  uint16_t *out[2];
  uint16_t *rout[2];
  epd_ref_out_t ref_out[2];
  uint8_t *gx[2]; /* GPU recv rows */
  uint32_t ntok[2];
  void *mapimg;
} ctx_t;

static ctx_t C;

/* Two ranks: a GPU each, or both on one (harness_common.h); skips only without a GPU. */
static void need_gpus(void) {
  char why[128];
  if (kh_unfit(2, why, sizeof why)) epd_test_skip("%s", why);
}

static void setup(uint32_t E, uint32_t H, uint32_t K, uint32_t M, uint32_t S, int replicas) {
  need_gpus();
  llh_t *h = &C.h;
  epd_k_ll_geom_t g = {2, 0, E, H, K, M, S, 0};
  CK(llh_create(h, 2, &g));
  C.rg = (epd_ref_geom_t){2, E, H, K, M, S, 2 * M};
  CK(epd_ref_map_default(&C.map, E, 2, S));
  if (replicas) { /* experts 0..7 get a second replica on the other rank, in the spare slots */
    uint32_t per = (E + 1) / 2;
    for (uint32_t e = 0; e < 8 && per + e < S; e++) {
      uint32_t home = e / per;
      C.map.nrep[e] = 2;
      C.map.rep[e][1].rank = 1 - home;
      C.map.rep[e][1].slot = per + e;
    }
    char err[256];
    CK(epd_ref_map_validate(&C.map, E, 2, S, err, sizeof err));
  }
  C.mapimg = malloc(epd_k_map_bytes(E));
  CK(epd_k_map_pack(C.mapimg, C.map.version, E, C.map.nrep, (const uint32_t *)C.map.rep, EPD_MAX_REPLICAS));
  CK(llh_set_map(h, C.mapimg));
  CK(epd_ref_plan_init(&C.plan, &C.rg));
  size_t RM = 2 * (size_t)M;
  for (int r = 0; r < 2; r++) {
    C.x[r] = malloc((size_t)M * H * 2);
    C.topk[r] = malloc((size_t)M * K * 8);
    C.w[r] = malloc((size_t)M * K * 4);
    C.y[r] = malloc((size_t)S * RM * H * 2);
    C.out[r] = malloc((size_t)M * H * 2);
    C.rout[r] = malloc((size_t)M * H * 2);
    C.gx[r] = malloc(RM * H * 2);
    C.ref_out[r].recv_x = malloc((size_t)S * RM * H * 2);
    C.ref_out[r].recv_scales = malloc((size_t)S * RM * (H / 128) * 4);
    C.ref_out[r].recv_count = malloc(S * 4);
    C.ref_out[r].recv_src = malloc((size_t)S * RM * 4);
    ASSERT(C.x[r] && C.y[r] && C.gx[r] && C.ref_out[r].recv_x);
  }
}

static uint64_t rng_state = 0x1234;
static int g_specials; /* gen: special values in some scale groups (epd_ref_gen_specials) */

/* Inputs of one step; route as above. */
static void gen(uint64_t seed, uint64_t step, const uint32_t ntok[2], int route) {
  for (int r = 0; r < 2; r++) {
    C.ntok[r] = ntok[r];
    epd_ref_gen_input(seed, step, (uint32_t)r, &C.rg, ntok[r] > C.rg.max_tokens ? C.rg.max_tokens : ntok[r],
                      route == ROUTE_SKEW, C.x[r], C.topk[r], C.w[r]);
    if (g_specials)
      epd_ref_gen_specials(seed, step, (uint32_t)r, ntok[r] > C.rg.max_tokens ? C.rg.max_tokens : ntok[r],
                           C.rg.hidden, C.x[r]);
    if (route == ROUTE_ALL_TO_ONE)
      for (uint32_t t = 0; t < ntok[r] && t < C.rg.max_tokens; t++)
        for (uint32_t k = 0; k < C.rg.topk; k++)
          C.topk[r][(size_t)t * C.rg.topk + k] = k % 3 == 2 ? -1 : (int64_t)k;
  }
}

/* Upload inputs of bank and poison its outputs. */
static void upload(unsigned bank) {
  llh_t *h = &C.h;
  uint32_t M = C.rg.max_tokens, H = C.rg.hidden, K = C.rg.topk, S = C.rg.slots_per_rank;
  size_t RM = 2 * (size_t)M;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    uint32_t T = C.ntok[r] > M ? M : C.ntok[r];
    if (T) {
      CUCK(cudaMemcpy(llh_buf(h, r, bank, EPD_BUF_X), C.x[r], (size_t)T * H * 2, cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(llh_buf(h, r, bank, EPD_BUF_TOPK_IDX), C.topk[r], (size_t)T * K * 8,
                      cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(llh_buf(h, r, bank, EPD_BUF_TOPK_WEIGHTS), C.w[r], (size_t)T * K * 4,
                      cudaMemcpyHostToDevice));
    }
    CUCK(cudaMemset(llh_buf(h, r, bank, EPD_BUF_LL_RECV_X), 0xff, (size_t)S * RM * H * 2));
    CUCK(cudaMemset(llh_buf(h, r, bank, EPD_BUF_LL_RECV_SCALES), 0xff, (size_t)S * RM * (H / 128) * 4));
    CUCK(cudaMemset(llh_buf(h, r, bank, EPD_BUF_LL_RECV_COUNT), 0xff, S * 4));
    CUCK(cudaMemset(llh_buf(h, r, bank, EPD_BUF_LL_RECV_SRC), 0xff, (size_t)S * RM * 4));
    CUCK(cudaMemset(llh_buf(h, r, bank, EPD_BUF_OUT), 0x7f, (size_t)M * H * 2));
    /* cudaMemset and pageable cudaMemcpy run on the legacy stream, which does not order against the
     * kernels' non-blocking streams: finish them before any launch */
    CUCK(cudaStreamSynchronize(0));
  }
}

/* Persistent mode: ops go through a device queue served by epd_k_ll_persistent_launch. */
static int g_persistent;
static epd_queue_t *g_q[2];
static uint32_t g_qpos;
static epd_comp_t g_comp[2][2];

static void exec_op(uint32_t opc, unsigned bank, const uint32_t *ntok, uint32_t flags) {
  llh_t *h = &C.h;
  if (!g_persistent) {
    CK(llh_launch(h, 3, opc, bank, ntok, flags, 5000000000ull));
    CK(llh_sync(h, 3));
    return;
  }
  uint32_t si = g_qpos++ % EPD_QUEUE_SLOTS;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    epd_desc_t d;
    memset(&d, 0, sizeof d);
    d.op = opc;
    d.flags = flags;
    d.num_tokens = ntok ? ntok[r] : 0;
    d.bank = bank;
    d.user_tag = 1000 + g_qpos;
    CUCK(cudaMemcpy(&g_q[r]->slot[si].desc, &d, sizeof d, cudaMemcpyHostToDevice));
    CUCK(cudaStreamSynchronize(0));
    uint32_t stv = EPD_SLOT_SUBMITTED;
    CUCK(cudaMemcpy(&g_q[r]->slot[si].state, &stv, 4, cudaMemcpyHostToDevice));
    CUCK(cudaStreamSynchronize(0));
  }
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    uint32_t stv = 0;
    for (int i = 0; i < 200000 && stv != EPD_SLOT_DONE; i++)
      CUCK(cudaMemcpy(&stv, &g_q[r]->slot[si].state, 4, cudaMemcpyDeviceToHost));
    if (stv != EPD_SLOT_DONE)
      epd_test_fail(__FILE__, __LINE__, "rank %d: slot %u never DONE (state %u)", r, si, stv);
    epd_comp_t c;
    CUCK(cudaMemcpy(&c, &g_q[r]->slot[si].comp, sizeof c, cudaMemcpyDeviceToHost));
    ASSERT_EQ(c.user_tag, 1000 + g_qpos);
    g_comp[r][opc == EPD_OP_LL_DISPATCH ? 0 : 1] = c;
    stv = EPD_SLOT_FREE;
    CUCK(cudaMemcpy(&g_q[r]->slot[si].state, &stv, 4, cudaMemcpyHostToDevice));
    CUCK(cudaStreamSynchronize(0));
  }
}

static int get_comp(int r, int which, epd_comp_t *c) {
  if (g_persistent) {
    *c = g_comp[r][which];
    return 0;
  }
  return llh_comp(&C.h, r, which, c);
}

static uint32_t g_dflags; /* the dispatches' daemon flags (EPD_K_RENORMALIZE) */

/* Dispatch on both ranks and compare with the reference. */
static void run_dispatch_check(unsigned bank, int fp8) {
  llh_t *h = &C.h;
  uint32_t M = C.rg.max_tokens, H = C.rg.hidden, S = C.rg.slots_per_rank;
  size_t RM = 2 * (size_t)M;
  exec_op(EPD_OP_LL_DISPATCH, bank, C.ntok, (fp8 ? EPD_DESC_FP8 : 0) | g_dflags);
  epd_ref_in_t in[2];
  for (int r = 0; r < 2; r++) in[r] = (epd_ref_in_t){C.ntok[r], C.x[r], C.topk[r], C.w[r]};
  int bad_rank = -1;
  char err[256];
  C.plan.renormalize = (g_dflags & EPD_K_RENORMALIZE) != 0;
  CK(epd_ref_plan_build(&C.plan, &C.map, in, &bad_rank, err, sizeof err));
  epd_ref_out_t *outs[2] = {&C.ref_out[0], &C.ref_out[1]};
  CK(epd_ref_ll_dispatch(&C.plan, in, fp8, outs));
  for (int r = 0; r < 2; r++) {
    epd_comp_t comp;
    CK(get_comp(r, 0, &comp));
    ASSERT_EQ(comp.status, 0);
    ASSERT_EQ(comp.peer, -1);
    ASSERT_EQ(comp.num_recv, C.plan.ll_recv[r]);
    ASSERT_EQ(comp.map_version, C.map.version);
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    int32_t *cnt = malloc(S * 4), *src = malloc(RM * 4);
    float *sc = malloc(RM * (H / 128) * 4);
    CUCK(cudaMemcpy(cnt, llh_buf(h, r, bank, EPD_BUF_LL_RECV_COUNT), S * 4, cudaMemcpyDeviceToHost));
    for (uint32_t s = 0; s < S; s++) {
      if (cnt[s] != C.ref_out[r].recv_count[s])
        epd_test_fail(__FILE__, __LINE__, "rank %d slot %u count %d, expected %d", r, s, cnt[s],
                      C.ref_out[r].recv_count[s]);
      int n = cnt[s];
      if (!n) continue;
      CUCK(cudaMemcpy(src, (int32_t *)llh_buf(h, r, bank, EPD_BUF_LL_RECV_SRC) + s * RM, (size_t)n * 4,
                      cudaMemcpyDeviceToHost));
      CUCK(cudaMemcpy(C.gx[r], (char *)llh_buf(h, r, bank, EPD_BUF_LL_RECV_X) + s * RM * H * 2,
                      (size_t)n * H * 2, cudaMemcpyDeviceToHost));
      if (fp8)
        CUCK(cudaMemcpy(sc, (float *)llh_buf(h, r, bank, EPD_BUF_LL_RECV_SCALES) + s * RM * (H / 128),
                        (size_t)n * (H / 128) * 4, cudaMemcpyDeviceToHost));
      for (int j = 0; j < n; j++) {
        if (src[j] != C.ref_out[r].recv_src[s * RM + j])
          epd_test_fail(__FILE__, __LINE__, "rank %d slot %u row %d src %x, expected %x", r, s, j, src[j],
                        C.ref_out[r].recv_src[s * RM + j]);
        const uint8_t *gr = C.gx[r] + (size_t)j * H * 2;
        const uint8_t *rr = (const uint8_t *)C.ref_out[r].recv_x + ((size_t)s * RM + j) * H * 2;
        if (!fp8) {
          if (memcmp(gr, rr, (size_t)H * 2))
            epd_test_fail(__FILE__, __LINE__, "rank %d slot %u row %d: BF16 row differs", r, s, j);
        } else {
          /* the same bytes and scales as the reference (IEEE division, SEMANTICS.md) */
          for (uint32_t c = 0; c < H; c++)
            if (gr[c] != rr[c])
              epd_test_fail(__FILE__, __LINE__, "rank %d slot %u row %d ch %u: fp8 %02x vs %02x", r, s, j, c,
                            gr[c], rr[c]);
          for (uint32_t b = 0; b < H / 128; b++) {
            float a = sc[(size_t)j * (H / 128) + b],
                  e = C.ref_out[r].recv_scales[((size_t)s * RM + j) * (H / 128) + b];
            if (memcmp(&a, &e, 4))
              epd_test_fail(__FILE__, __LINE__, "rank %d slot %u row %d block %u: scale %a vs %a", r, s, j, b,
                            a, e);
          }
        }
      }
    }
    free(cnt);
    free(src);
    free(sc);
  }
}

/* Random expert outputs for the received rows, combine, compare. */
static void run_combine_check(unsigned bank) {
  llh_t *h = &C.h;
  uint32_t M = C.rg.max_tokens, H = C.rg.hidden, S = C.rg.slots_per_rank, K = C.rg.topk;
  size_t RM = 2 * (size_t)M;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    for (uint32_t s = 0; s < S; s++) {
      int n = C.plan.ll_count[(size_t)r * S + s];
      if (!n) continue;
      uint16_t *yr = C.y[r] + (size_t)s * RM * H;
      for (size_t i = 0; i < (size_t)n * H; i++)
        yr[i] = epd_f32_to_bf16((float)((epd_ref_rand(&rng_state) >> 40) / 16777216.0 * 4.0 - 2.0));
      CUCK(cudaMemcpy((uint16_t *)llh_buf(h, r, bank, EPD_BUF_LL_Y) + s * RM * H, yr, (size_t)n * H * 2,
                      cudaMemcpyHostToDevice));
    }
    CUCK(cudaStreamSynchronize(0));
  }
  exec_op(EPD_OP_LL_COMBINE, bank, NULL, 0);
  const uint16_t *ys[2] = {C.y[0], C.y[1]};
  uint16_t *outs[2] = {C.rout[0], C.rout[1]};
  CK(epd_ref_ll_combine(&C.plan, ys, outs));
  for (int r = 0; r < 2; r++) {
    epd_comp_t comp;
    CK(get_comp(r, 1, &comp));
    ASSERT_EQ(comp.status, 0);
    uint32_t T = C.ntok[r];
    if (!T) continue;
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    CUCK(cudaMemcpy(C.out[r], llh_buf(h, r, bank, EPD_BUF_OUT), (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    for (uint32_t t = 0; t < T; t++) {
      /* bound: BF16 rounding of each per-rank partial and of the result */
      for (uint32_t c = 0; c < H; c++) {
        double part_abs = 0;
        for (uint32_t k = 0; k < K; k++) {
          size_t idx = (size_t)r * M * K + (size_t)t * K + k;
          int d = C.plan.dst_rank[idx];
          if (d < 0) continue;
          size_t row = (size_t)C.plan.dst_slot[idx] * RM + C.plan.dst_pos[idx];
          part_abs += fabs(C.plan.weight[idx] * epd_bf16_to_f32(C.y[d][row * H + c]));
        }
        float g = epd_bf16_to_f32(C.out[r][(size_t)t * H + c]),
              e = epd_bf16_to_f32(C.rout[r][(size_t)t * H + c]);
        double tol = (part_abs + fabs(e)) * (1.0 / 128) + 1e-6;
        if (!(fabs((double)g - e) <= tol))
          epd_test_fail(__FILE__, __LINE__, "rank %d token %u ch %u: out %g, expected %g (tol %g)", r, t, c,
                        g, e, tol);
      }
    }
  }
}

static void steps(uint64_t seed, int nsteps, uint32_t t0, uint32_t t1, int route, int fp8) {
  for (int s = 0; s < nsteps; s++) {
    uint32_t nt[2] = {t0, t1};
    gen(seed, (uint64_t)s, nt, route);
    unsigned bank = (unsigned)s % 2;
    upload(bank);
    run_dispatch_check(bank, fp8);
    run_combine_check(bank);
  }
}

/* The FP8 quantiser of every kernel (LL, HT, scale-out) against its definition, for every BF16 amax and
 * every BF16 x of a group with that amax: scale and e4m3 byte as IEEE division gives them. The pairs
 * compared: for each finite or infinite amax pattern a (0 .. 0x7f80), both signs of every magnitude up to
 * a and the 254 NaN patterns; for each of the 127 NaN amax patterns the 254 NaN x. */
EPD_TEST_T(gpu_fp8_quantiser_exhaustive, 60) {
  if (llh_gpus() < 1) epd_test_skip("needs a GPU");
  uint64_t bad = 0, cmp = 0, want = 127ull * 254;
  for (uint64_t a = 0; a <= 0x7f80; a++) want += 2 * (a + 1) + 254;
  uint32_t a = 0, x = 0;
  CUCK(cudaSetDevice(0));
  CK(epd_k_fp8_check(&bad, &cmp, &a, &x));
  if (bad)
    epd_test_fail(__FILE__, __LINE__, "%llu mismatches; first: amax 0x%04x, x 0x%05x (0x10000: the scale)",
                  (unsigned long long)bad, a, x);
  ASSERT_EQ(cmp, want);
}

/* Special values in a third of the tokens (one scale group each: signed zeros, subnormals, infinities,
 * NaNs, an all-NaN group, the 1e-4 floor, 2^100, quotients in e4m3's subnormal range): FP8 bytes and
 * scales equal the reference's, and BF16 rows arrive bit for bit. */
EPD_TEST_T(gpu_ll_fp8_special_values, 180) {
  setup(64, 7168, 8, 128, 32, 0);
  g_specials = 1;
  steps(71, 3, 128, 128, ROUTE_RANDOM, 1);
  steps(72, 1, 128, 7, ROUTE_SKEW, 0);
  steps(73, 2, 1, 128, ROUTE_ALL_TO_ONE, 1);
  g_specials = 0;
  llh_destroy(&C.h);
}

EPD_TEST_T(gpu_ll_bf16_h2048_k8, 120) {
  setup(64, 2048, 8, 128, 32, 0);
  steps(11, 3, 128, 128, ROUTE_RANDOM, 0);
  steps(12, 2, 7, 1, ROUTE_RANDOM, 0);
  llh_destroy(&C.h);
}

EPD_TEST_T(gpu_ll_fp8_h7168_k8_e256, 180) {
  setup(256, 7168, 8, 128, 128, 0);
  steps(21, 2, 128, 128, ROUTE_RANDOM, 1);
  steps(22, 1, 128, 128, ROUTE_RANDOM, 0);
  steps(23, 2, 1, 7, ROUTE_SKEW, 1);
  llh_destroy(&C.h);
}

EPD_TEST_T(gpu_ll_topk9_topk1_skew_all_to_one, 180) {
  setup(64, 2048, 9, 128, 32, 0);
  steps(31, 2, 128, 7, ROUTE_SKEW, 1);
  steps(32, 2, 128, 128, ROUTE_ALL_TO_ONE, 0);
  steps(33, 1, 1, 128, ROUTE_ALL_TO_ONE, 1);
  llh_destroy(&C.h);
  setup(64, 2048, 1, 128, 32, 0);
  steps(34, 2, 128, 128, ROUTE_RANDOM, 1);
  steps(35, 2, 7, 1, ROUTE_SKEW, 0);
  llh_destroy(&C.h);
}

/* More tokens per rank than blocks, and more received tokens than a block has threads: the receive scans
 * them in rounds of 512, a slot's rows accumulating across rounds (all-to-one: 1033 rows in slot 0). */
EPD_TEST_T(gpu_ll_700_tokens_multi_round_receive, 240) {
  setup(64, 1024, 8, 700, 32, 0);
  steps(41, 2, 700, 700, ROUTE_RANDOM, 1);
  steps(42, 1, 700, 333, ROUTE_ALL_TO_ONE, 0);
  steps(43, 1, 513, 1, ROUTE_SKEW, 1);
  llh_destroy(&C.h);
}

/* The hidden sizes at the ends: 640 (5 FP8 scales per row, not a multiple of 4: the receive copies them
 * one by one) and 16384 (the largest: every register of the send's row arrays in use). */
EPD_TEST_T(gpu_ll_hidden_640_and_16384, 240) {
  setup(64, 640, 8, 128, 32, 0);
  steps(51, 2, 128, 77, ROUTE_RANDOM, 1);
  steps(52, 1, 128, 128, ROUTE_SKEW, 0);
  llh_destroy(&C.h);
  setup(64, 16384, 8, 64, 32, 0);
  steps(53, 2, 64, 64, ROUTE_RANDOM, 1);
  steps(54, 1, 64, 9, ROUTE_RANDOM, 0);
  llh_destroy(&C.h);
}

/* The largest top-k (16 entries per token: every lane of the routing warp and every Meta entry). */
EPD_TEST_T(gpu_ll_topk16, 180) {
  setup(64, 2048, 16, 128, 32, 0);
  steps(55, 2, 128, 100, ROUTE_RANDOM, 1);
  steps(56, 1, 128, 128, ROUTE_SKEW, 0);
  steps(57, 1, 3, 128, ROUTE_ALL_TO_ONE, 1);
  llh_destroy(&C.h);
}

/* Every expert with the most replicas (8: 4 on each rank), so a token's replica choice,
 * (rank * max_tokens + t) % 8, takes every index of the device map's replica list. */
EPD_TEST_T(gpu_ll_8_replicas, 180) {
  setup(16, 1024, 8, 128, 64, 0);
  for (uint32_t e = 0; e < 16; e++) {
    C.map.nrep[e] = EPD_K_MAX_REPLICAS;
    for (uint32_t i = 0; i < EPD_K_MAX_REPLICAS; i++) {
      C.map.rep[e][i].rank = i % 2;
      C.map.rep[e][i].slot = e * 4 + i / 2;
    }
  }
  char err[256];
  CK(epd_ref_map_validate(&C.map, 16, 2, 64, err, sizeof err));
  C.map.version = 2;
  CK(epd_k_map_pack(C.mapimg, C.map.version, 16, C.map.nrep, (const uint32_t *)C.map.rep, EPD_MAX_REPLICAS));
  CK(llh_set_map(&C.h, C.mapimg));
  steps(61, 2, 128, 128, ROUTE_RANDOM, 1);
  steps(62, 1, 128, 50, ROUTE_SKEW, 0);
  steps(63, 1, 7, 128, ROUTE_ALL_TO_ONE, 1);
  llh_destroy(&C.h);
}

/* A map without rank 1's replicas (ranks masked: epd_ref_map_mask): experts 0..7 keep their replica on
 * rank 0, the entries of experts 8..15 (only on rank 1) are dropped, and with EPD_K_RENORMALIZE the
 * weights a token keeps are scaled to the sum of all its valid entries' weights. Both ranks still run the
 * kernels (the team), with tokens: the combine checks the weights each token used. */
EPD_TEST_T(gpu_ll_masked_map_drops_and_renormalizes, 180) {
  setup(16, 256, 8, 64, 16, 1);
  epd_expert_map_t m;
  CK(epd_ref_map_mask(&m, &C.map, 1ull << 1));
  epd_expert_map_free(&C.map);
  C.map = m;
  for (uint32_t e = 0; e < 16; e++) ASSERT_EQ(C.map.nrep[e], e < 8 ? 1u : 0u);
  CK(epd_k_map_pack(C.mapimg, C.map.version, 16, C.map.nrep, (const uint32_t *)C.map.rep, EPD_MAX_REPLICAS));
  CK(llh_set_map(&C.h, C.mapimg));
  for (int rn = 0; rn < 2; rn++) {
    g_dflags = rn ? EPD_K_RENORMALIZE : 0;
    steps(71 + (uint64_t)rn, 2, 64, 50, ROUTE_RANDOM, rn);
    steps(73 + (uint64_t)rn, 1, 33, 64, ROUTE_SKEW, 1 - rn);
    uint32_t lost = 0;
    for (int r = 0; r < 2; r++) lost += C.plan.dropped[r];
    ASSERT(lost > 0);
  }
  g_dflags = 0;
  llh_destroy(&C.h);
}

/* 120 consecutive steps: changing routing and token counts, both banks, both dtypes, redundant
 * replicas, and the map version changing every 10 steps. */
EPD_TEST_T(gpu_ll_120_steps_replicas, 300) {
  setup(64, 1024, 8, 64, 40, 1);
  for (int s = 0; s < 120; s++) {
    if (s % 10 == 0) {
      C.map.version = 1 + (uint32_t)s / 10;
      CK(epd_k_map_pack(C.mapimg, C.map.version, 64, C.map.nrep, (const uint32_t *)C.map.rep,
                        EPD_MAX_REPLICAS));
      CK(llh_set_map(&C.h, C.mapimg));
    }
    uint32_t nt[2] = {(uint32_t)(epd_ref_rand(&rng_state) % 65), (uint32_t)(epd_ref_rand(&rng_state) % 65)};
    gen(41, (uint64_t)s, nt, s % 3 == 1 ? ROUTE_SKEW : ROUTE_RANDOM);
    upload((unsigned)s % 2);
    run_dispatch_check((unsigned)s % 2, s % 2);
    run_combine_check((unsigned)s % 2);
  }
  llh_destroy(&C.h);
}

/* Dispatch of bank 1 between dispatch and combine of bank 0 (double buffering). */
EPD_TEST_T(gpu_ll_banks_interleaved, 120) {
  setup(64, 2048, 8, 128, 32, 0);
  uint32_t nt[2] = {128, 100};
  gen(51, 0, nt, ROUTE_RANDOM);
  upload(0);
  run_dispatch_check(0, 0);
  /* save bank 0's plan by re-running the reference later with the same inputs */
  uint32_t nt1[2] = {60, 128};
  gen(52, 0, nt1, ROUTE_SKEW);
  upload(1);
  run_dispatch_check(1, 1);
  run_combine_check(1);
  gen(51, 0, nt, ROUTE_RANDOM); /* the reference plan of bank 0 again */
  {
    epd_ref_in_t in[2];
    for (int r = 0; r < 2; r++) in[r] = (epd_ref_in_t){C.ntok[r], C.x[r], C.topk[r], C.w[r]};
    int bad = -1;
    char err[256];
    CK(epd_ref_plan_build(&C.plan, &C.map, in, &bad, err, sizeof err));
  }
  run_combine_check(0);
  llh_destroy(&C.h);
}

static void expect_fail(int code, int peer, unsigned ranks) {
  llh_t *h = &C.h;
  for (int r = 0; r < 2; r++) {
    if (!((ranks >> r) & 1)) continue;
    epd_comp_t comp;
    CK(llh_comp(h, r, 0, &comp));
    if (comp.status != code || comp.peer != peer)
      epd_test_fail(__FILE__, __LINE__, "rank %d: status %d peer %d, expected %d peer %d", r, comp.status,
                    comp.peer, code, peer);
    int32_t cnt;
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    CUCK(cudaMemcpy(&cnt, llh_buf(h, r, 0, EPD_BUF_LL_RECV_COUNT), 4, cudaMemcpyDeviceToHost));
    ASSERT_EQ(cnt, -1); /* outputs untouched */
  }
}

EPD_TEST_T(gpu_ll_bad_expert_and_too_many_tokens, 120) {
  setup(64, 2048, 8, 128, 32, 0);
  llh_t *h = &C.h;
  uint32_t nt[2] = {128, 128};
  gen(61, 0, nt, ROUTE_RANDOM);
  C.topk[1][5 * 8 + 3] = 64; /* E */
  upload(0);
  CK(llh_launch(h, 3, EPD_OP_LL_DISPATCH, 0, C.ntok, 0, 5000000000ull));
  CK(llh_sync(h, 3));
  expect_fail(EPD_ERR_BAD_EXPERT, 1, 3);
  gen(62, 0, nt, ROUTE_RANDOM);
  C.topk[0][100 * 8] = -2;
  upload(0);
  CK(llh_launch(h, 3, EPD_OP_LL_DISPATCH, 0, C.ntok, EPD_DESC_FP8, 5000000000ull));
  CK(llh_sync(h, 3));
  expect_fail(EPD_ERR_BAD_EXPERT, 0, 3);
  /* a combine after a failed dispatch is refused on every rank */
  CK(llh_launch(h, 3, EPD_OP_LL_COMBINE, 0, NULL, 0, 5000000000ull));
  CK(llh_sync(h, 3));
  for (int r = 0; r < 2; r++) {
    epd_comp_t comp;
    CK(llh_comp(h, r, 1, &comp));
    ASSERT_EQ(comp.status, EPD_ERR_STATE);
  }
  uint32_t nt2[2] = {128, 129};
  gen(63, 0, nt, ROUTE_RANDOM);
  C.ntok[1] = 129;
  upload(0);
  CK(llh_launch(h, 3, EPD_OP_LL_DISPATCH, 0, nt2, 0, 5000000000ull));
  CK(llh_sync(h, 3));
  expect_fail(EPD_ERR_TOO_MANY_TOKENS, 1, 3);
  /* the group goes on */
  steps(64, 2, 128, 128, ROUTE_RANDOM, 1);
  llh_destroy(&C.h);
}

EPD_TEST_T(gpu_ll_peer_timeout, 120) {
  setup(64, 2048, 8, 128, 32, 0);
  llh_t *h = &C.h;
  uint32_t nt[2] = {128, 128};
  gen(71, 0, nt, ROUTE_RANDOM);
  upload(0);
  CK(llh_launch(h, 1, EPD_OP_LL_DISPATCH, 0, C.ntok, 0, 50000000ull)); /* rank 0 only, 50 ms */
  CK(llh_sync(h, 1));
  expect_fail(EPD_ERR_TIMEOUT, 1, 1);
  /* recovery: quiesce, reset every rank, go on */
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    CK(epd_k_ll_reset(h->k[r], h->kh.st[r]));
  }
  CK(llh_sync(h, 3));
  steps(72, 2, 128, 128, ROUTE_RANDOM, 0);
  llh_destroy(&C.h);
}

/* Persistent mode: control and progress blocks (host-mapped) of each rank's kernel. */
static epd_k_pctl_t *g_ctl[2];
static epd_k_pprog_t *g_prog[2];
static uint64_t *g_dlim[2]; /* the stop word: host-mapped here (the daemon's is device memory) */

static void plaunch(cudaStream_t *ps, uint64_t index0, uint64_t step0) {
  llh_t *h = &C.h;
  for (int r = 0; r < 2; r++) {
    CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));
    uint32_t first = g_prog[r]->slot;
    memset(g_prog[r], 0, sizeof *g_prog[r]);
    g_ctl[r]->abort = 0;
    __atomic_store_n(g_dlim[r], UINT64_MAX, __ATOMIC_SEQ_CST);
    epd_k_persist_t a;
    memset(&a, 0, sizeof a);
    a.queue = g_q[r];
    a.dqueue = g_q[r]; /* one device queue is both copies: each state seen, each written, twice */
    CUCK(cudaHostGetDevicePointer((void **)&a.dlimit, g_dlim[r], 0));
    CUCK(cudaHostGetDevicePointer((void **)&a.ctl, g_ctl[r], 0));
    CUCK(cudaHostGetDevicePointer((void **)&a.prog, g_prog[r], 0));
    a.first_slot = first;
    a.index0 = index0;
    a.step0 = step0;
    a.timeout_ns = 5000000000ull;
    CK(epd_k_ll_persistent_launch(h->k[r], &h->kh.ar[r], h->kh.map_dev[r], &a, ps[r]));
  }
}

/* Wait (bounded) until both kernels returned. */
static void pwait_exit(cudaStream_t *ps) {
  llh_t *h = &C.h;
  for (int r = 0; r < 2; r++) {
    CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));
    cudaError_t e = cudaErrorNotReady;
    for (int i = 0; i < 20000 && e == cudaErrorNotReady; i++) {
      e = cudaStreamQuery(ps[r]);
      if (e == cudaErrorNotReady) usleep(1000);
    }
    if (e != cudaSuccess)
      epd_test_fail(__FILE__, __LINE__, "rank %d: persistent kernel did not stop (%s)", r,
                    cudaGetErrorString(e));
    ASSERT_EQ(g_prog[r]->exited, 1u);
  }
}

/* Submit a raw descriptor into ring slot si of rank r's device queue. */
static void psubmit(int r, uint32_t si, uint32_t op, uint32_t bank, uint32_t flags) {
  cudaSetDevice(epd_cc_device(C.h.kh.cc, r));
  epd_desc_t d;
  memset(&d, 0, sizeof d);
  d.op = op;
  d.flags = flags;
  d.bank = bank;
  d.num_tokens = 1;
  CUCK(cudaMemcpy(&g_q[r]->slot[si].desc, &d, sizeof d, cudaMemcpyHostToDevice));
  uint32_t stv = EPD_SLOT_SUBMITTED;
  CUCK(cudaMemcpy(&g_q[r]->slot[si].state, &stv, 4, cudaMemcpyHostToDevice));
}
static uint32_t pslot_state(int r, uint32_t si) {
  cudaSetDevice(epd_cc_device(C.h.kh.cc, r));
  uint32_t stv = 0;
  CUCK(cudaMemcpy(&stv, &g_q[r]->slot[si].state, 4, cudaMemcpyDeviceToHost));
  return stv;
}

/* Both kernels stopped at index `at` on mismatched ops of slot si, each naming the other, the slot left
 * SUBMITTED; then freed (the host ran it elsewhere). */
static void expect_mismatch_stop(uint32_t si, uint64_t at) {
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(g_prog[r]->reason, (uint32_t)EPD_K_PEXIT_MISMATCH);
    ASSERT_EQ(g_prog[r]->exit_peer, 1 - r);
    ASSERT_EQ(g_prog[r]->exit_index, at);
    ASSERT_EQ(g_prog[r]->ops, 0u);
    ASSERT_EQ(pslot_state(r, si), (uint32_t)EPD_SLOT_SUBMITTED);
    cudaSetDevice(epd_cc_device(C.h.kh.cc, r));
    uint32_t fr = EPD_SLOT_FREE;
    CUCK(cudaMemcpy(&g_q[r]->slot[si].state, &fr, 4, cudaMemcpyHostToDevice));
  }
}

/* The persistent kernel serving a device queue per rank: dispatch/combine steps, both banks and dtypes
 * (completion step numbers, progress records); an HT op, a mismatched pair, a dispatch with a flag it does
 * not know (a raw-queue client's) and an FP8 dispatch against a BF16 one stop BOTH kernels at the same
 * index with the slots left SUBMITTED (the launch mode answers them); relaunched with a fresh index they
 * go on; limit stops them. */
EPD_TEST_T(gpu_ll_persistent_queue, 120) {
  setup(64, 2048, 8, 128, 32, 0);
  llh_t *h = &C.h;
  cudaStream_t ps[2];
  for (int r = 0; r < 2; r++) {
    CUCK(cudaSetDevice(epd_cc_device(h->kh.cc, r)));
    CUCK(cudaMalloc((void **)&g_q[r], sizeof(epd_queue_t)));
    CUCK(cudaMemset(g_q[r], 0, sizeof(epd_queue_t)));
    CUCK(cudaDeviceSynchronize());
    CUCK(cudaStreamCreateWithFlags(&ps[r], cudaStreamNonBlocking));
    CUCK(
        cudaHostAlloc((void **)&g_ctl[r], sizeof(epd_k_pctl_t), cudaHostAllocMapped | cudaHostAllocPortable));
    CUCK(cudaHostAlloc((void **)&g_dlim[r], sizeof(uint64_t), cudaHostAllocMapped | cudaHostAllocPortable));
    CUCK(cudaHostAlloc((void **)&g_prog[r], sizeof(epd_k_pprog_t),
                       cudaHostAllocMapped | cudaHostAllocPortable));
    memset(g_prog[r], 0, sizeof *g_prog[r]);
  }
  g_qpos = 0;
  plaunch(ps, 1, 100);
  g_persistent = 1;
  for (int s = 0; s < 12; s++) {
    uint32_t nt[2] = {s % 3 ? 128u : 7u, s % 4 ? 128u : 1u};
    gen(81, (uint64_t)s, nt, s % 2 ? ROUTE_SKEW : ROUTE_RANDOM);
    upload((unsigned)s % 2);
    run_dispatch_check((unsigned)s % 2, s % 2);
    ASSERT_EQ(g_comp[0][0].step, 100u + 2 * s);
    ASSERT_EQ(g_comp[1][0].step, 100u + 2 * s);
    run_combine_check((unsigned)s % 2);
    ASSERT_EQ(g_comp[1][1].step, 100u + 2 * s + 1);
    ASSERT_EQ(g_comp[0][1].map_version, C.map.version);
  }
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(g_prog[r]->ops, 24u);
    ASSERT_EQ(g_prog[r]->rec[23 % EPD_K_PREC].op, (uint32_t)EPD_OP_LL_COMBINE);
    ASSERT_EQ(g_prog[r]->rec[22 % EPD_K_PREC].status, 0);
    ASSERT_EQ(g_prog[r]->rec[22 % EPD_K_PREC].num_recv, g_comp[r][0].num_recv);
    ASSERT_EQ(g_prog[r]->exited, 0u);
  }
  /* an HT op on both ranks: neither kernel runs it */
  uint32_t si = g_qpos % EPD_QUEUE_SLOTS;
  psubmit(0, si, EPD_OP_HT_DISPATCH, 0, 0);
  psubmit(1, si, EPD_OP_HT_DISPATCH, 0, 0);
  pwait_exit(ps);
  uint64_t ix = g_prog[0]->exit_index;
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(g_prog[r]->exit_index, ix);
    ASSERT_EQ(g_prog[r]->ops, 24u);
    ASSERT_EQ(pslot_state(r, si), (uint32_t)EPD_SLOT_SUBMITTED);
  }
  ASSERT_EQ(ix, 25u);
  ASSERT(g_prog[0]->reason == EPD_K_PEXIT_OP || g_prog[0]->reason == EPD_K_PEXIT_PEER);
  ASSERT(g_prog[0]->reason == EPD_K_PEXIT_OP || g_prog[1]->reason == EPD_K_PEXIT_OP);
  /* the host ran it elsewhere: free the slots, relaunch; a dispatch against a combine stops both */
  psubmit(0, si, EPD_OP_LL_DISPATCH, 0, 0);
  psubmit(1, si, EPD_OP_LL_COMBINE, 0, 0);
  plaunch(ps, ix + 1, 124);
  pwait_exit(ps);
  expect_mismatch_stop(si, ix + 1);
  /* a dispatch with an unknown flag on both ranks (with FP8 on one): neither kernel runs it, each stops on
   * its own slot before any agreement (the slots stay SUBMITTED; the next psubmit rewrites them) */
  psubmit(0, si, EPD_OP_LL_DISPATCH, 0, 0x80u);
  psubmit(1, si, EPD_OP_LL_DISPATCH, 0, 0x80u | EPD_DESC_FP8);
  plaunch(ps, ix + 2, 124);
  pwait_exit(ps);
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(g_prog[r]->reason, (uint32_t)EPD_K_PEXIT_OP);
    ASSERT_EQ(g_prog[r]->exit_peer, -1);
    ASSERT_EQ(g_prog[r]->exit_index, ix + 2);
    ASSERT_EQ(g_prog[r]->ops, 0u);
    ASSERT_EQ(pslot_state(r, si), (uint32_t)EPD_SLOT_SUBMITTED);
  }
  /* FP8 against BF16: both stop, each naming the other */
  psubmit(0, si, EPD_OP_LL_DISPATCH, 0, EPD_DESC_FP8);
  psubmit(1, si, EPD_OP_LL_DISPATCH, 0, 0);
  plaunch(ps, ix + 3, 124);
  pwait_exit(ps);
  expect_mismatch_stop(si, ix + 3);
  /* relaunched, the team's state is intact: two more checked steps, then limit stops both */
  plaunch(ps, ix + 4, 124);
  for (int s = 12; s < 14; s++) {
    uint32_t nt[2] = {100u, 128u};
    gen(81, (uint64_t)s, nt, ROUTE_RANDOM);
    upload((unsigned)s % 2);
    run_dispatch_check((unsigned)s % 2, 1);
    run_combine_check((unsigned)s % 2);
  }
  ASSERT_EQ(g_comp[0][1].step, 127u);
  for (int r = 0; r < 2; r++) __atomic_store_n(g_dlim[r], 0, __ATOMIC_SEQ_CST);
  pwait_exit(ps);
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(g_prog[r]->reason, (uint32_t)EPD_K_PEXIT_LIMIT);
    ASSERT_EQ(g_prog[r]->ops, 4u);
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    cudaStreamDestroy(ps[r]);
    cudaFree(g_q[r]);
    cudaFreeHost(g_ctl[r]);
    cudaFreeHost(g_dlim[r]);
    cudaFreeHost(g_prog[r]);
  }
  g_persistent = 0;
  llh_destroy(&C.h);
}

#else /* !EPD_WITH_CUDA */
#include "../test.h"
EPD_TEST(gpu_ll_without_cuda) {
  epd_test_skip("built without CUDA (WITH_CUDA=0)");
}
#endif
