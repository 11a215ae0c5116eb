/*
 * ht_harness.h - in-process HT set-up shared by the GPU tests and the HT benchmark: R ranks of one
 * process on the visible GPUs (daemon/cuda_comm; harness_common.h: ranks may share a GPU), an HT staging
 * window, one IO arena per rank (plain device memory), the device expert map, completion records and a
 * stream per rank. Static functions: included by
 * tests/gpu/test_ht.c and bench/bench_ht.c.
 */
#ifndef EPD_HT_HARNESS_H
#define EPD_HT_HARNESS_H

#include "harness_common.h"

typedef struct hth {
  kh_t kh;           /* communicators, window, arenas, maps, completions, streams */
  epd_k_ht_geom_t g; /* rank field unused here */
  epd_k_ht_t *k[EPD_K_MAX_RANKS];
  int staging;                      /* 1: no peer arenas in the ops (rows through the staging windows) */
  uint32_t copy;                    /* epd_k_ht_op_t.copy */
  uint32_t dense;                   /* dispatches with EPD_DESC_HT_DENSE */
  uint64_t *trace[EPD_K_MAX_RANKS]; /* epd_k_ht_op_t.trace of each rank (device, optional) */
} hth_t;

#define HTH_GUARD_ROWS 4 /* poisoned rows after the C rows of each HT receive buffer */

__attribute__((unused)) static int hth_gpus(void) {
  return kh_gpus();
}

/* Arena layout of every (bank, kind) the HT kernels use, with guard rows past C. */
static size_t hth_layout(const epd_k_ht_geom_t *g, epd_k_arena_t *a) {
  uint64_t M = g->max_tokens, H = g->hidden, K = g->topk, S = g->slots_per_rank,
           C = g->capacity + HTH_GUARD_ROWS;
  uint64_t sz[EPD_BUF_KINDS] = {0};
  sz[EPD_BUF_X] = M * H * 2;
  sz[EPD_BUF_TOPK_IDX] = M * K * 8;
  sz[EPD_BUF_TOPK_WEIGHTS] = M * K * 4;
  sz[EPD_BUF_HT_RECV_X] = C * H * 2;
  sz[EPD_BUF_HT_RECV_SCALES] = C * (H / 128) * 4;
  sz[EPD_BUF_HT_RECV_TOPK_IDX] = C * K * 8;
  sz[EPD_BUF_HT_RECV_TOPK_WEIGHTS] = C * K * 4;
  sz[EPD_BUF_HT_RECV_SRC] = C * 4;
  sz[EPD_BUF_HT_RECV_COUNT] = S * 4;
  sz[EPD_BUF_HT_Y] = C * H * 2;
  sz[EPD_BUF_OUT] = M * H * 2;
  return kh_layout(sz, a);
}

static epd_result_t hth_kctx(epd_cc_t *cc, int r, void *arg, char *err, size_t errlen) {
  hth_t *h = arg;
  (void)cc;
  epd_k_ht_geom_t g = h->g;
  g.rank = (uint32_t)r;
  return epd_k_ht_create(&g, epd_cc_lsa(h->kh.cc, r), h->kh.win.win[r], h->kh.win.ptr[r], 0, &h->k[r], err,
                         errlen);
}

static void hth_kctx_free(int r, void *arg) {
  epd_k_ht_destroy(((hth_t *)arg)->k[r]);
}

/* Set up R ranks with geometry g (where ranks share a GPU, g.blocks is cut to their part of its SMs:
 * kh_ht_blocks; h->g holds what the kernels run with); 0 or an error code with h->kh.err. */
static int hth_create(hth_t *h, int R, const epd_k_ht_geom_t *g) {
  memset(h, 0, sizeof(*h));
  h->g = *g;
  h->g.num_ranks = (uint32_t)R;
  h->g.blocks = kh_ht_blocks(h->g.blocks, kh_share(R), 0);
  epd_k_arena_t a;
  size_t arena_bytes = hth_layout(&h->g, &a);
  return kh_create(&h->kh, R, h->g.num_experts, epd_k_ht_window_bytes(&h->g), &a, arena_bytes, hth_kctx, h);
}

static void hth_destroy(hth_t *h) {
  kh_destroy(&h->kh, hth_kctx_free, h);
}

static void *hth_buf(hth_t *h, int r, unsigned bank, int kind) {
  return kh_buf(&h->kh, r, bank, kind);
}

/* Copy a host map image to every rank. */
static int hth_set_map(hth_t *h, const void *img) {
  return kh_set_map(&h->kh, img);
}

/* Launch op on the ranks in rank_mask, without waiting. */
static int hth_launch(hth_t *h, unsigned rank_mask, uint32_t opc, uint32_t bank, const uint32_t *ntok,
                      uint32_t flags, uint64_t timeout_ns) {
  for (int r = 0; r < h->kh.R; r++) {
    if (!((rank_mask >> r) & 1)) continue;
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    epd_k_ht_op_t op;
    memset(&op, 0, sizeof op);
    op.op = opc;
    op.flags = flags | (h->dense && opc == EPD_OP_HT_DISPATCH ? EPD_DESC_HT_DENSE : 0u);
    op.num_tokens = ntok ? ntok[r] : 0;
    op.bank = bank;
    op.timeout_ns = timeout_ns;
    op.map = h->kh.map_dev[r];
    op.comp = h->kh.comp[r] + (opc == EPD_OP_HT_DISPATCH ? 0 : 1);
    for (int q = 0; q < h->kh.R && !h->staging; q++) op.peer_arena[q] = (uint64_t)(uintptr_t)h->kh.arena[q];
    for (int q = 0; q < h->kh.R && ntok; q++) op.rank_tokens[q] = ntok[q];
    op.copy = h->copy;
    op.trace = h->trace[r];
    int res = epd_k_ht_launch(h->k[r], &h->kh.ar[r], &op, h->kh.st[r], h->kh.err, sizeof h->kh.err);
    if (res) return res;
  }
  return 0;
}

__attribute__((unused)) static int hth_sync(hth_t *h, unsigned rank_mask) {
  return kh_sync(&h->kh, rank_mask);
}

static int hth_comp(hth_t *h, int r, int which, epd_comp_t *out) {
  return kh_comp(&h->kh, r, which, out);
}

#endif
