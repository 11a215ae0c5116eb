/*
 * test_ht.c - HT dispatch/combine kernels of 2 ranks in one process, against the host reference
 * (daemon/ref.h): random and skewed routing with -1 and duplicate entries, empty ranks, 1 token, 4096 and
 * 8192 tokens, hidden 7168 and 4096, top-8, BF16 and FP8, poisoned outputs, overflow past the receive
 * capacity (nothing written), bad expert ids, too many tokens; rows straight into the peers' arenas (register
 * copies, or the opt-in bulk-copy engine) and through the staging windows; the dense layout
 * (EPD_DESC_HT_DENSE) with BF16 rows by the copy engines. A GPU per rank with two; with one both ranks
 * share it (harness_common.h: the peers' arenas are then on the same GPU, the copy engines copy within
 * it). Skips without a GPU.
 */
#if EPD_WITH_CUDA
#include <math.h>

#include "../test.h"
#include "ht_harness.h"
#include "core/ref.h"

#define CK(e)                                                                                  \
  do {                                                                                         \
    int r_ = (int)(e);                                                                         \
    if (r_ != 0) epd_test_fail(__FILE__, __LINE__, "%s returned %d: %s", #e, r_, T_.h.kh.err); \
  } while (0)
#define CUCK(e)                                                                                     \
  do {                                                                                              \
    cudaError_t c_ = (e);                                                                           \
    if (c_ != cudaSuccess) epd_test_fail(__FILE__, __LINE__, "%s: %s", #e, cudaGetErrorString(c_)); \
  } while (0)

typedef struct tctx {
  hth_t h;
  epd_ref_geom_t rg;
  epd_expert_map_t map;
  epd_ref_plan_t plan;
  uint16_t *x[2], *y[2], *out[2], *rout[2];
  int64_t *topk[2];
  float *w[2];
  epd_ref_out_t ro[2];
  uint8_t *gx;
  float *gsc;
  int64_t *gidx;
  float *gw;
  int32_t *gsrc;
  uint32_t ntok[2];
  void *mapimg;
} tctx_t;

static tctx_t T_;
static uint64_t rng = 0x9876;
static int g_specials; /* gen: special values in some scale groups (epd_ref_gen_specials) */

static void setup(uint32_t E, uint32_t H, uint32_t K, uint32_t M, uint32_t S, uint32_t C, uint32_t blocks) {
  char why[128];
  if (kh_unfit(2, why, sizeof why)) epd_test_skip("%s", why);
  epd_k_ht_geom_t g = {2, 0, E, H, K, M, S, C, blocks, 0};
  CK(hth_create(&T_.h, 2, &g));
  T_.rg = (epd_ref_geom_t){2, E, H, K, M, S, C};
  CK(epd_ref_map_default(&T_.map, E, 2, S));
  T_.mapimg = malloc(epd_k_map_bytes(E));
  CK(epd_k_map_pack(T_.mapimg, T_.map.version, E, T_.map.nrep, (const uint32_t *)T_.map.rep,
                    EPD_MAX_REPLICAS));
  CK(hth_set_map(&T_.h, T_.mapimg));
  CK(epd_ref_plan_init(&T_.plan, &T_.rg));
  size_t Cg = (size_t)C + HTH_GUARD_ROWS;
  for (int r = 0; r < 2; r++) {
    T_.x[r] = malloc((size_t)M * H * 2);
    T_.topk[r] = malloc((size_t)M * K * 8);
    T_.w[r] = malloc((size_t)M * K * 4);
    T_.y[r] = malloc(Cg * H * 2);
    T_.out[r] = malloc((size_t)M * H * 2);
    T_.rout[r] = malloc((size_t)M * H * 2);
    T_.ro[r].recv_x = malloc(Cg * H * 2);
    T_.ro[r].recv_scales = malloc(Cg * (H / 128) * 4);
    T_.ro[r].recv_count = malloc(S * 4);
    T_.ro[r].recv_src = malloc(Cg * 4);
    T_.ro[r].recv_topk_idx = malloc(Cg * K * 8);
    T_.ro[r].recv_topk_weights = malloc(Cg * K * 4);
    ASSERT(T_.x[r] && T_.y[r] && T_.ro[r].recv_x && T_.ro[r].recv_topk_weights);
  }
  T_.gx = malloc(Cg * H * 2);
  T_.gsc = malloc(Cg * (H / 128) * 4);
  T_.gidx = malloc(Cg * K * 8);
  T_.gw = malloc(Cg * K * 4);
  T_.gsrc = malloc(Cg * 4);
  ASSERT(T_.gx && T_.gsc && T_.gidx && T_.gw && T_.gsrc);
}

static void gen(uint64_t seed, uint64_t step, uint32_t t0, uint32_t t1, int skew) {
  uint32_t nt[2] = {t0, t1};
  for (int r = 0; r < 2; r++) {
    T_.ntok[r] = nt[r];
    uint32_t n = nt[r] > T_.rg.max_tokens ? T_.rg.max_tokens : nt[r];
    epd_ref_gen_input(seed, step, (uint32_t)r, &T_.rg, n, skew, T_.x[r], T_.topk[r], T_.w[r]);
    if (g_specials) epd_ref_gen_specials(seed, step, (uint32_t)r, n, T_.rg.hidden, T_.x[r]);
  }
}

/* Upload inputs of a bank and poison every output (guard rows included). */
static void upload(unsigned bank) {
  hth_t *h = &T_.h;
  uint32_t M = T_.rg.max_tokens, H = T_.rg.hidden, K = T_.rg.topk, S = T_.rg.slots_per_rank;
  size_t Cg = (size_t)T_.rg.ht_capacity + HTH_GUARD_ROWS;
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    uint32_t n = T_.ntok[r] > M ? M : T_.ntok[r];
    if (n) {
      CUCK(cudaMemcpy(hth_buf(h, r, bank, EPD_BUF_X), T_.x[r], (size_t)n * H * 2, cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(hth_buf(h, r, bank, EPD_BUF_TOPK_IDX), T_.topk[r], (size_t)n * K * 8,
                      cudaMemcpyHostToDevice));
      CUCK(cudaMemcpy(hth_buf(h, r, bank, EPD_BUF_TOPK_WEIGHTS), T_.w[r], (size_t)n * K * 4,
                      cudaMemcpyHostToDevice));
    }
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_HT_RECV_X), 0xff, Cg * H * 2));
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_HT_RECV_SCALES), 0xff, Cg * (H / 128) * 4));
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_HT_RECV_TOPK_IDX), 0x5a, Cg * K * 8));
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_HT_RECV_TOPK_WEIGHTS), 0xff, Cg * K * 4));
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_HT_RECV_SRC), 0xff, Cg * 4));
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_HT_RECV_COUNT), 0xff, S * 4));
    CUCK(cudaMemset(hth_buf(h, r, bank, EPD_BUF_OUT), 0x7f, (size_t)M * H * 2));
    CUCK(cudaStreamSynchronize(0));
  }
}

static uint32_t g_dflags; /* the dispatches' daemon flags (EPD_K_RENORMALIZE) */

static void exec(uint32_t opc, unsigned bank, int fp8) {
  const uint32_t flags = (fp8 ? EPD_DESC_FP8 : 0) | (opc == EPD_OP_HT_DISPATCH ? g_dflags : 0);
  CK(hth_launch(&T_.h, 3, opc, bank, T_.ntok, flags, 5000000000ull)); /* + h.dense */
  CK(hth_sync(&T_.h, 3));
}

/* Rows past `from` of every HT receive buffer of rank r are still poisoned. */
static void check_untouched(int r, unsigned bank, size_t from) {
  hth_t *h = &T_.h;
  uint32_t H = T_.rg.hidden;
  size_t Cg = (size_t)T_.rg.ht_capacity + HTH_GUARD_ROWS;
  if (from >= Cg) return;
  cudaSetDevice(epd_cc_device(h->kh.cc, r));
  size_t n = Cg - from;
  CUCK(cudaMemcpy(T_.gx, (char *)hth_buf(h, r, bank, EPD_BUF_HT_RECV_X) + from * H * 2, n * H * 2,
                  cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n * H * 2; i++)
    if (T_.gx[i] != 0xff)
      epd_test_fail(__FILE__, __LINE__, "rank %d: recv_x written at row %zu", r, from + i / (H * 2));
  CUCK(cudaMemcpy(T_.gsrc, (int32_t *)hth_buf(h, r, bank, EPD_BUF_HT_RECV_SRC) + from, n * 4,
                  cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i++)
    if (T_.gsrc[i] != -1)
      epd_test_fail(__FILE__, __LINE__, "rank %d: recv_src written at row %zu", r, from + i);
}

static void dispatch_check(unsigned bank, int fp8) {
  hth_t *h = &T_.h;
  uint32_t H = T_.rg.hidden, K = T_.rg.topk, S = T_.rg.slots_per_rank, nb = H / 128;
  uint64_t ce0[2] = {epd_k_ht_ce_ops(T_.h.k[0]), epd_k_ht_ce_ops(T_.h.k[1])};
  exec(EPD_OP_HT_DISPATCH, bank, fp8);
  /* the dense BF16 rows over peer arenas go by the copy engines (and nothing else does) */
  const uint64_t want_ce = T_.h.dense && T_.h.copy == EPD_K_HT_COPY_CE && !fp8 && !T_.h.staging;
  for (int r = 0; r < 2; r++) ASSERT_EQ(epd_k_ht_ce_ops(T_.h.k[r]) - ce0[r], want_ce);
  epd_ref_in_t in[2];
  for (int r = 0; r < 2; r++) in[r] = (epd_ref_in_t){T_.ntok[r], T_.x[r], T_.topk[r], T_.w[r]};
  int bad = -1;
  char err[256];
  T_.plan.renormalize = (g_dflags & EPD_K_RENORMALIZE) != 0;
  CK(epd_ref_plan_build(&T_.plan, &T_.map, in, &bad, err, sizeof err));
  if (T_.h.dense) epd_ref_ht_dense(&T_.plan);
  epd_ref_out_t *outs[2] = {&T_.ro[0], &T_.ro[1]};
  CK(epd_ref_ht_dispatch(&T_.plan, in, fp8, outs, &bad));
  for (int r = 0; r < 2; r++) {
    epd_comp_t c;
    CK(hth_comp(h, r, 0, &c));
    if (c.status != 0)
      epd_test_fail(__FILE__, __LINE__, "rank %d: dispatch status %d peer %d", r, c.status, c.peer);
    ASSERT_EQ(c.peer, -1);
    ASSERT_EQ(c.num_recv, T_.plan.ht_recv[r]);
    ASSERT_EQ(c.map_version, T_.map.version);
    size_t N = c.num_recv;
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    int32_t *cnt = malloc(S * 4);
    CUCK(cudaMemcpy(cnt, hth_buf(h, r, bank, EPD_BUF_HT_RECV_COUNT), S * 4, cudaMemcpyDeviceToHost));
    for (uint32_t s = 0; s < S; s++)
      if (cnt[s] != T_.ro[r].recv_count[s])
        epd_test_fail(__FILE__, __LINE__, "rank %d slot %u: count %d, expected %d", r, s, cnt[s],
                      T_.ro[r].recv_count[s]);
    free(cnt);
    if (N) {
      CUCK(cudaMemcpy(T_.gx, hth_buf(h, r, bank, EPD_BUF_HT_RECV_X), N * H * 2, cudaMemcpyDeviceToHost));
      CUCK(cudaMemcpy(T_.gidx, hth_buf(h, r, bank, EPD_BUF_HT_RECV_TOPK_IDX), N * K * 8,
                      cudaMemcpyDeviceToHost));
      CUCK(cudaMemcpy(T_.gw, hth_buf(h, r, bank, EPD_BUF_HT_RECV_TOPK_WEIGHTS), N * K * 4,
                      cudaMemcpyDeviceToHost));
      CUCK(cudaMemcpy(T_.gsrc, hth_buf(h, r, bank, EPD_BUF_HT_RECV_SRC), N * 4, cudaMemcpyDeviceToHost));
      if (fp8)
        CUCK(cudaMemcpy(T_.gsc, hth_buf(h, r, bank, EPD_BUF_HT_RECV_SCALES), N * nb * 4,
                        cudaMemcpyDeviceToHost));
    }
    for (size_t j = 0; j < N; j++) {
      if (T_.gsrc[j] != T_.ro[r].recv_src[j])
        epd_test_fail(__FILE__, __LINE__, "rank %d row %zu: src %x, expected %x", r, j, T_.gsrc[j],
                      T_.ro[r].recv_src[j]);
      for (uint32_t k = 0; k < K; k++) {
        if (T_.gidx[j * K + k] != T_.ro[r].recv_topk_idx[j * K + k])
          epd_test_fail(__FILE__, __LINE__, "rank %d row %zu k %u: idx %lld, expected %lld", r, j, k,
                        (long long)T_.gidx[j * K + k], (long long)T_.ro[r].recv_topk_idx[j * K + k]);
        if (memcmp(&T_.gw[j * K + k], &T_.ro[r].recv_topk_weights[j * K + k], 4))
          epd_test_fail(__FILE__, __LINE__, "rank %d row %zu k %u: weight %g, expected %g", r, j, k,
                        T_.gw[j * K + k], T_.ro[r].recv_topk_weights[j * K + k]);
      }
      const uint8_t *gr = T_.gx + j * H * 2, *rr = (const uint8_t *)T_.ro[r].recv_x + j * H * 2;
      if (!fp8) {
        if (memcmp(gr, rr, (size_t)H * 2))
          epd_test_fail(__FILE__, __LINE__, "rank %d row %zu: BF16 row differs", r, j);
      } else {
        /* the same bytes and scales as the reference (IEEE division, SEMANTICS.md) */
        for (uint32_t c2 = 0; c2 < H; c2++)
          if (gr[c2] != rr[c2])
            epd_test_fail(__FILE__, __LINE__, "rank %d row %zu ch %u: fp8 %02x vs %02x", r, j, c2, gr[c2],
                          rr[c2]);
        for (uint32_t b = 0; b < nb; b++) {
          float a = T_.gsc[j * nb + b], e = T_.ro[r].recv_scales[j * nb + b];
          if (memcmp(&a, &e, 4))
            epd_test_fail(__FILE__, __LINE__, "rank %d row %zu block %u: scale %a vs %a", r, j, b, a, e);
        }
      }
    }
    check_untouched(r, bank, N > T_.rg.ht_capacity ? T_.rg.ht_capacity : N);
  }
}

static void combine_check(unsigned bank) {
  hth_t *h = &T_.h;
  uint32_t H = T_.rg.hidden;
  for (int r = 0; r < 2; r++) {
    size_t N = T_.plan.ht_recv[r];
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    for (size_t i = 0; i < N * H; i++)
      T_.y[r][i] = epd_f32_to_bf16((float)((epd_ref_rand(&rng) >> 40) / 16777216.0 * 4.0 - 2.0));
    /* dense: the rows of tokens with no entry on this rank are not partials; NaN shows a sum that uses them
     */
    for (size_t j = 0; j < N && T_.h.dense; j++) {
      int local = 0;
      for (uint32_t k = 0; k < T_.rg.topk; k++) local |= T_.ro[r].recv_topk_idx[j * T_.rg.topk + k] >= 0;
      for (size_t i = 0; i < H && !local; i++) T_.y[r][j * H + i] = 0x7fc1;
    }
    if (N) CUCK(cudaMemcpy(hth_buf(h, r, bank, EPD_BUF_HT_Y), T_.y[r], N * H * 2, cudaMemcpyHostToDevice));
    CUCK(cudaStreamSynchronize(0));
  }
  exec(EPD_OP_HT_COMBINE, bank, 0);
  const uint16_t *ys[2] = {T_.y[0], T_.y[1]};
  uint16_t *outs[2] = {T_.rout[0], T_.rout[1]};
  CK(epd_ref_ht_combine(&T_.plan, ys, outs));
  for (int r = 0; r < 2; r++) {
    epd_comp_t c;
    CK(hth_comp(h, r, 1, &c));
    if (c.status != 0)
      epd_test_fail(__FILE__, __LINE__, "rank %d: combine status %d peer %d", r, c.status, c.peer);
    uint32_t n = T_.ntok[r];
    if (!n) continue;
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    CUCK(cudaMemcpy(T_.out[r], hth_buf(h, r, bank, EPD_BUF_OUT), (size_t)n * H * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < (size_t)n * H; i++)
      if (T_.out[r][i] != T_.rout[r][i])
        epd_test_fail(__FILE__, __LINE__, "rank %d token %zu ch %zu: out %04x, expected %04x", r, i / H,
                      i % H, T_.out[r][i], T_.rout[r][i]);
  }
}

static void step(uint64_t seed, uint64_t s, uint32_t t0, uint32_t t1, int skew, int fp8) {
  fprintf(stderr, "step seed %llu s %llu tokens %u/%u skew %d fp8 %d staging %d copy %u dense %u\n",
          (unsigned long long)seed, (unsigned long long)s, t0, t1, skew, fp8, T_.h.staging, T_.h.copy,
          T_.h.dense);
  gen(seed, s, t0, t1, skew);
  unsigned bank = (unsigned)s % 2;
  upload(bank);
  dispatch_check(bank, fp8);
  combine_check(bank);
}

EPD_TEST_T(gpu_ht_h7168_4096_bf16_fp8_skew_empty_one, 300) {
  setup(256, 7168, 8, 4096, 128, 8192, 0);
  step(1, 0, 4096, 4096, 0, 0);
  step(1, 1, 4096, 4096, 0, 1);
  step(2, 2, 4096, 3000, 1, 0);
  step(2, 3, 4096, 4096, 1, 1);
  step(3, 4, 4096, 0, 0, 0);
  step(3, 5, 0, 4096, 1, 1);
  step(4, 6, 1, 1, 0, 1);
  step(4, 7, 1, 0, 0, 0);
  step(5, 8, 0, 0, 0, 0);
  /* without peer arenas: rows through the staging windows, partials pushed back */
  T_.h.staging = 1;
  step(6, 9, 4096, 4000, 0, 0);
  step(6, 10, 3000, 4096, 1, 1);
  step(6, 11, 0, 7, 0, 1);
  T_.h.staging = 0;
  /* the bulk-copy engine (opt-in) */
  T_.h.copy = EPD_K_HT_COPY_TMA;
  step(7, 12, 4096, 4096, 0, 0);
  step(7, 13, 4096, 2000, 1, 1);
  T_.h.copy = EPD_K_HT_COPY_REG;
  step(8, 14, 4096, 4096, 1, 0);
  /* dense layout: BF16 rows by the copy engines (uneven and empty ranks), FP8 and register rows, staging */
  T_.h.dense = 1;
  T_.h.copy = EPD_K_HT_COPY_CE;
  step(9, 15, 4096, 4096, 0, 0);
  step(9, 16, 4096, 3000, 1, 0);
  step(9, 17, 0, 4096, 1, 0);
  step(9, 18, 1, 0, 0, 0);
  step(9, 19, 4096, 2500, 1, 1); /* FP8: kernel rows */
  step(9, 23, 0, 4096, 0, 1);
  step(9, 24, 1, 7, 1, 1);
  T_.h.copy = EPD_K_HT_COPY_REG;
  step(10, 20, 3000, 4096, 1, 0);
  T_.h.staging = 1;
  step(10, 21, 4096, 4000, 0, 0);
  T_.h.staging = 0;
  T_.h.dense = 0;
  step(8, 22, 4096, 4096, 1, 0);
  hth_destroy(&T_.h);
}

EPD_TEST_T(gpu_ht_h4096_8192_tokens, 300) {
  setup(256, 4096, 8, 8192, 128, 16384, 5); /* 5 blocks: several tiles of tokens per block */
  step(11, 0, 8192, 8192, 0, 0);
  step(11, 1, 8192, 8192, 1, 1);
  step(12, 2, 8192, 17, 0, 1);
  T_.h.staging = 1;
  step(13, 3, 8192, 8000, 1, 0);
  T_.h.staging = 0;
  /* the bulk-copy rings over several tiles per block (they faulted here once) */
  T_.h.copy = EPD_K_HT_COPY_TMA;
  step(17, 4, 8192, 8192, 0, 0);
  T_.h.copy = EPD_K_HT_COPY_REG;
  hth_destroy(&T_.h);
}

EPD_TEST_T(gpu_ht_h4096_8192_tokens_16_blocks, 300) {
  setup(256, 4096, 8, 8192, 128, 16384, 16); /* 512 tokens per block, one tile each */
  step(14, 0, 8192, 8192, 0, 0);
  step(14, 1, 8192, 6000, 1, 1);
  step(15, 2, 5000, 8192, 1, 0);
  /* the bulk-copy rings with full 512-row tiles: 8 KB rows give the combine 13 stages, fewer than its 15
   * summing warps, which once let a warp pass a stage's barrier a phase early (a fault) */
  T_.h.copy = EPD_K_HT_COPY_TMA;
  step(16, 3, 8192, 8192, 0, 0);
  step(16, 4, 8192, 6000, 1, 0);
  T_.h.copy = EPD_K_HT_COPY_REG;
  hth_destroy(&T_.h);
}

/* Top-k at its ends (16 and 1), and a hidden size with 5 FP8 scales per row (not a multiple of 4), through
 * peer arenas, staging and the bulk-copy engine. */
EPD_TEST_T(gpu_ht_topk16_topk1_hidden640, 240) {
  setup(64, 640, 16, 1024, 32, 2048, 8);
  step(21, 0, 1024, 1024, 0, 0);
  step(21, 1, 1024, 700, 1, 1);
  step(22, 2, 9, 1024, 0, 1);
  T_.h.staging = 1;
  step(23, 3, 1024, 1000, 1, 1);
  T_.h.staging = 0;
  T_.h.copy = EPD_K_HT_COPY_TMA;
  step(24, 4, 1024, 1024, 0, 0);
  T_.h.copy = EPD_K_HT_COPY_REG;
  hth_destroy(&T_.h);
  setup(64, 640, 1, 1024, 32, 2048, 8);
  step(25, 0, 1024, 1024, 0, 1);
  step(25, 1, 1024, 333, 1, 0);
  hth_destroy(&T_.h);
}

/* Special values in a third of the tokens (one scale group each: signed zeros, subnormals, infinities,
 * NaNs, an all-NaN group, the 1e-4 floor, 2^100, quotients in e4m3's subnormal range): FP8 bytes and
 * scales equal the reference's through peer arenas, staging, the bulk-copy engine and the dense layout,
 * and at hidden 640 (the quantiser's loop ends inside its last step). */
EPD_TEST_T(gpu_ht_fp8_special_values, 240) {
  g_specials = 1;
  setup(64, 7168, 8, 1024, 32, 2048, 0);
  step(31, 0, 1024, 1024, 0, 1);
  step(31, 1, 1024, 500, 1, 1);
  step(32, 2, 1, 1024, 0, 0);
  T_.h.staging = 1;
  step(33, 3, 1024, 1000, 1, 1);
  T_.h.staging = 0;
  T_.h.copy = EPD_K_HT_COPY_TMA;
  step(34, 4, 1024, 1024, 0, 1);
  T_.h.copy = EPD_K_HT_COPY_CE;
  T_.h.dense = 1;
  step(35, 5, 1024, 700, 1, 1);
  step(35, 6, 1024, 1024, 0, 0);
  T_.h.dense = 0;
  T_.h.copy = EPD_K_HT_COPY_REG;
  hth_destroy(&T_.h);
  setup(64, 640, 8, 1024, 32, 2048, 8);
  step(36, 0, 1024, 1024, 0, 1);
  step(36, 1, 300, 1024, 1, 1);
  hth_destroy(&T_.h);
  g_specials = 0;
}

/* A map without rank 1's replicas (ranks masked: epd_ref_map_mask): experts 0..7 have a second replica
 * on rank 1 and keep the one on rank 0, the entries of experts 8..15 (only on rank 1) are dropped; with
 * EPD_K_RENORMALIZE the weights each receiver gets (HT_RECV_TOPK_WEIGHTS, compared bit for bit) are
 * scaled to the sum of all the token's valid entries' weights. Rows straight into the peers' arenas, then
 * through staging, then dense. */
EPD_TEST_T(gpu_ht_masked_map_drops_and_renormalizes, 240) {
  setup(16, 256, 8, 64, 16, 256, 0);
  for (uint32_t e = 0; e < 8; e++) {
    T_.map.nrep[e] = 2;
    T_.map.rep[e][1].rank = 1;
    T_.map.rep[e][1].slot = 8 + e;
  }
  epd_expert_map_t m;
  CK(epd_ref_map_mask(&m, &T_.map, 1ull << 1));
  epd_expert_map_free(&T_.map);
  T_.map = m;
  for (uint32_t e = 0; e < 16; e++) ASSERT_EQ(T_.map.nrep[e], e < 8 ? 1u : 0u);
  CK(epd_k_map_pack(T_.mapimg, T_.map.version, 16, T_.map.nrep, (const uint32_t *)T_.map.rep,
                    EPD_MAX_REPLICAS));
  CK(hth_set_map(&T_.h, T_.mapimg));
  for (int mode = 0; mode < 3; mode++) {
    T_.h.staging = mode == 1;
    T_.h.dense = mode == 2;
    for (int rn = 0; rn < 2; rn++) {
      g_dflags = rn ? EPD_K_RENORMALIZE : 0;
      step(81 + (uint64_t)(mode * 2 + rn), (uint64_t)rn, 64, 40, rn, rn && mode != 2);
      ASSERT(T_.plan.dropped[0] + T_.plan.dropped[1] > 0);
    }
  }
  g_dflags = 0;
  T_.h.staging = T_.h.dense = 0;
  hth_destroy(&T_.h);
}

static void expect_fail(int code, int peer, unsigned bank, int check_recv) {
  for (int r = 0; r < 2; r++) {
    epd_comp_t c;
    CK(hth_comp(&T_.h, r, 0, &c));
    if (c.status != code || c.peer != peer)
      epd_test_fail(__FILE__, __LINE__, "rank %d: status %d peer %d, expected %d peer %d", r, c.status,
                    c.peer, code, peer);
    if (check_recv) ASSERT_EQ(c.num_recv, T_.plan.ht_recv[r]);
    check_untouched(r, bank, 0); /* a failed dispatch writes nothing */
    int32_t cnt;
    cudaSetDevice(epd_cc_device(T_.h.kh.cc, r));
    CUCK(cudaMemcpy(&cnt, hth_buf(&T_.h, r, bank, EPD_BUF_HT_RECV_COUNT), 4, cudaMemcpyDeviceToHost));
    ASSERT_EQ(cnt, -1);
  }
}

EPD_TEST_T(gpu_ht_overflow_bad_expert_too_many, 180) {
  setup(64, 1024, 8, 512, 32, 600, 8);
  /* skewed: rank 0 receives far more than 600 rows */
  gen(21, 0, 512, 512, 1);
  upload(0);
  exec(EPD_OP_HT_DISPATCH, 0, 0);
  {
    epd_ref_in_t in[2];
    for (int r = 0; r < 2; r++) in[r] = (epd_ref_in_t){T_.ntok[r], T_.x[r], T_.topk[r], T_.w[r]};
    int bad = -1;
    char err[256];
    CK(epd_ref_plan_build(&T_.plan, &T_.map, in, &bad, err, sizeof err));
    epd_ref_out_t *outs[2] = {&T_.ro[0], &T_.ro[1]};
    ASSERT_EQ(epd_ref_ht_dispatch(&T_.plan, in, 0, outs, &bad), EPD_ERR_OVERFLOW);
    expect_fail(EPD_ERR_OVERFLOW, bad, 0, 1);
  }
  /* a combine after a failed dispatch is refused */
  exec(EPD_OP_HT_COMBINE, 0, 0);
  for (int r = 0; r < 2; r++) {
    epd_comp_t c;
    CK(hth_comp(&T_.h, r, 1, &c));
    ASSERT_EQ(c.status, EPD_ERR_STATE);
  }
  /* the next steps work */
  step(22, 1, 250, 300, 0, 0);
  step(22, 2, 290, 10, 0, 1);
  /* bad expert id on rank 1 */
  gen(23, 0, 100, 100, 0);
  T_.topk[1][5 * 8 + 3] = 64;
  upload(0);
  exec(EPD_OP_HT_DISPATCH, 0, 0);
  expect_fail(EPD_ERR_BAD_EXPERT, 1, 0, 0);
  /* too many tokens on rank 0 */
  gen(24, 0, 100, 100, 0);
  T_.ntok[0] = 513;
  upload(0);
  exec(EPD_OP_HT_DISPATCH, 0, 0);
  expect_fail(EPD_ERR_TOO_MANY_TOKENS, 0, 0, 0);
  step(25, 1, 280, 280, 0, 0);
  /* dense, BF16 rows by the copy engines: 400 + 300 rows on every rank pass the capacity of 600 (compact
   * would fit): EPD_ERR_OVERFLOW naming rank 0, and nothing copied */
  T_.h.dense = 1;
  T_.h.copy = EPD_K_HT_COPY_CE;
  gen(26, 0, 400, 300, 0);
  upload(0);
  exec(EPD_OP_HT_DISPATCH, 0, 0);
  expect_fail(EPD_ERR_OVERFLOW, 0, 0, 0);
  /* a bad expert id: every rank fails; the copy engines may have written the rows (a failed dispatch's
   * receive rows are undefined), never a row past the sum of the tokens */
  gen(27, 0, 200, 250, 0);
  T_.topk[1][7 * 8 + 1] = 64;
  upload(0);
  exec(EPD_OP_HT_DISPATCH, 0, 0);
  for (int r = 0; r < 2; r++) {
    epd_comp_t c;
    CK(hth_comp(&T_.h, r, 0, &c));
    if (c.status != EPD_ERR_BAD_EXPERT || c.peer != 1)
      epd_test_fail(__FILE__, __LINE__, "rank %d: status %d peer %d, expected %d peer 1", r, c.status, c.peer,
                    EPD_ERR_BAD_EXPERT);
    check_untouched(r, 0, 450);
  }
  step(28, 1, 250, 300, 1, 0);
  step(28, 0, 300, 300, 0, 0);
  T_.h.dense = 0;
  T_.h.copy = EPD_K_HT_COPY_REG;
  step(29, 1, 280, 280, 0, 0);
  hth_destroy(&T_.h);
}

/* Rank 0's op with rank 1 absent ends with EPD_ERR_TIMEOUT naming rank 1 (dispatch, then a combine after
 * a good dispatch), on the direct and the staging path; after a reset of every rank the steps work. */
static void expect_timeout(uint32_t opc) {
  CK(hth_launch(&T_.h, 1, opc, 0, T_.ntok, 0, 50000000ull)); /* rank 0 only, 50 ms */
  CK(hth_sync(&T_.h, 1));
  epd_comp_t c;
  CK(hth_comp(&T_.h, 0, opc == EPD_OP_HT_DISPATCH ? 0 : 1, &c));
  if (c.status != EPD_ERR_TIMEOUT || c.peer != 1)
    epd_test_fail(__FILE__, __LINE__, "op %u staging %d: status %d peer %d, expected %d peer 1", opc,
                  T_.h.staging, c.status, c.peer, EPD_ERR_TIMEOUT);
  if (opc == EPD_OP_HT_DISPATCH) check_untouched(0, 0, 0); /* a timed-out dispatch writes no rows */
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(T_.h.kh.cc, r));
    CK(epd_k_ht_reset(T_.h.k[r], T_.h.kh.st[r]));
  }
  CK(hth_sync(&T_.h, 3));
}

EPD_TEST_T(gpu_ht_peer_timeout, 180) {
  setup(64, 1024, 8, 512, 32, 1200, 8);
  for (int staging = 0; staging < 2; staging++) {
    T_.h.staging = staging;
    gen(31 + staging, 0, 300, 300, 0);
    upload(0);
    expect_timeout(EPD_OP_HT_DISPATCH);
    step(32 + staging, 1, 300, 200, 0, staging);
    gen(33 + staging, 0, 256, 256, 1);
    upload(0);
    exec(EPD_OP_HT_DISPATCH, 0, 0);
    for (int r = 0; r < 2; r++) { /* a good dispatch: the combine's timeout is its own */
      epd_comp_t c;
      CK(hth_comp(&T_.h, r, 0, &c));
      if (c.status != 0)
        epd_test_fail(__FILE__, __LINE__, "rank %d: dispatch status %d peer %d", r, c.status, c.peer);
    }
    expect_timeout(EPD_OP_HT_COMBINE);
    step(34 + staging, 2, 512, 512, 1, 1 - staging);
  }
  T_.h.staging = 0;
  hth_destroy(&T_.h);
}

/* The copy engines' rows of a dense BF16 dispatch land late (epd_k_ht_test_ce_delay: a copy stream spins
 * first). Rank 1's copies 50 ms late, rank 0's on time: rank 0's op still waits for rank 1's rows (once
 * rank 0's stream is done, before rank 1's is waited for, rank 0 holds rank 1's rows, poisoned before, and
 * a good completion); whole checked steps with both ranks' copies late; copies later than the op's timeout
 * end it with EPD_ERR_TIMEOUT on every rank (its own copies did not land), and after a reset the steps
 * work. */
EPD_TEST_T(gpu_ht_dense_ce_late_copy, 180) {
  setup(64, 1024, 8, 512, 32, 1200, 8);
  const uint32_t H = T_.rg.hidden;
  T_.h.dense = 1;
  T_.h.copy = EPD_K_HT_COPY_CE;
  epd_k_ht_test_ce_delay(T_.h.k[1], 50000);
  gen(40, 0, 300, 400, 0);
  upload(0);
  CK(hth_launch(&T_.h, 3, EPD_OP_HT_DISPATCH, 0, T_.ntok, 0, 5000000000ull));
  CK(hth_sync(&T_.h, 1)); /* rank 0's stream only */
  {
    epd_comp_t c;
    CK(hth_comp(&T_.h, 0, 0, &c));
    if (c.status != 0) { /* which wait ran out: rank 0's own copies (peer 0) or rank 1's word (peer 1) */
      epd_comp_t c1;
      CK(hth_sync(&T_.h, 2));
      CK(hth_comp(&T_.h, 1, 0, &c1));
      epd_test_fail(__FILE__, __LINE__,
                    "rank 0: status %d peer %d; rank 1: status %d peer %d (ranks on GPUs %d, %d)", c.status,
                    c.peer, c1.status, c1.peer, epd_cc_device(T_.h.kh.cc, 0), epd_cc_device(T_.h.kh.cc, 1));
    }
    ASSERT_EQ(c.num_recv, 700u);
    /* dense: rank 1's token t is row 300 + t of rank 0, the BF16 row as rank 1 sent it */
    cudaSetDevice(epd_cc_device(T_.h.kh.cc, 0));
    const size_t n = (size_t)400 * H * 2;
    CUCK(cudaMemcpy(T_.gx, (char *)hth_buf(&T_.h, 0, 0, EPD_BUF_HT_RECV_X) + (size_t)300 * H * 2, n,
                    cudaMemcpyDeviceToHost));
    if (memcmp(T_.gx, T_.x[1], n))
      epd_test_fail(__FILE__, __LINE__, "rank 0 completed before rank 1's rows landed");
  }
  CK(hth_sync(&T_.h, 3));
  for (int r = 0; r < 2; r++) epd_k_ht_test_ce_delay(T_.h.k[r], 20000); /* 20 ms */
  step(41, 0, 512, 300, 0, 0);
  step(41, 1, 200, 512, 1, 0);
  step(41, 2, 0, 512, 0, 0);
  for (int r = 0; r < 2; r++) epd_k_ht_test_ce_delay(T_.h.k[r], 300000); /* 300 ms, past the op's 50 ms */
  gen(42, 0, 300, 300, 0);
  upload(0);
  uint64_t ce0[2] = {epd_k_ht_ce_ops(T_.h.k[0]), epd_k_ht_ce_ops(T_.h.k[1])};
  CK(hth_launch(&T_.h, 3, EPD_OP_HT_DISPATCH, 0, T_.ntok, 0, 50000000ull));
  CK(hth_sync(&T_.h, 3)); /* the op's stream waits for its copies (joined) */
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(epd_k_ht_ce_ops(T_.h.k[r]) - ce0[r], 1);
    epd_comp_t c;
    CK(hth_comp(&T_.h, r, 0, &c));
    if (c.status != EPD_ERR_TIMEOUT || c.peer != r)
      epd_test_fail(__FILE__, __LINE__, "rank %d: status %d peer %d, expected %d peer %d", r, c.status,
                    c.peer, EPD_ERR_TIMEOUT, r);
  }
  for (int r = 0; r < 2; r++) {
    cudaSetDevice(epd_cc_device(T_.h.kh.cc, r));
    CK(epd_k_ht_reset(T_.h.k[r], T_.h.kh.st[r]));
  }
  CK(hth_sync(&T_.h, 3));
  step(43, 1, 300, 290, 1, 0); /* late (300 ms) but within the steps' 5 s */
  step(43, 0, 300, 300, 0, 0);
  T_.h.dense = 0;
  T_.h.copy = EPD_K_HT_COPY_REG;
  step(44, 1, 280, 280, 0, 0);
  hth_destroy(&T_.h);
}

#else /* !EPD_WITH_CUDA */
#include "../test.h"
EPD_TEST(gpu_ht_without_cuda) {
  epd_test_skip("built without CUDA (WITH_CUDA=0)");
}
#endif
