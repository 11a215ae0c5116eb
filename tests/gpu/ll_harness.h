/*
 * ll_harness.h - in-process LL set-up shared by the GPU tests and the benchmark: R ranks of one process
 * on the visible GPUs (daemon/cuda_comm; harness_common.h: ranks may share a GPU), an LL staging window,
 * one IO arena per rank (plain device memory: the kernels only touch the local arena), the device expert
 * map, a completion record and a stream per rank.
 * Static functions: included by tests/gpu/test_ll.c and bench/bench_ll.c.
 */
#ifndef EPD_LL_HARNESS_H
#define EPD_LL_HARNESS_H

#include "harness_common.h"

typedef struct llh {
  kh_t kh;           /* communicators, window, arenas, maps, completions, streams */
  epd_k_ll_geom_t g; /* rank field unused here */
  epd_k_ll_t *k[EPD_K_MAX_RANKS];
} llh_t;

__attribute__((unused)) static int llh_gpus(void) {
  return kh_gpus();
}

/* Arena layout: every (bank, kind) the LL kernels use, 256-byte aligned. */
static size_t llh_layout(const epd_k_ll_geom_t *g, epd_k_arena_t *a) {
  uint64_t M = g->max_tokens, H = g->hidden, K = g->topk, S = g->slots_per_rank,
           RM = (uint64_t)g->num_ranks * M;
  uint64_t sz[EPD_BUF_KINDS] = {0};
  sz[EPD_BUF_X] = M * H * 2;
  sz[EPD_BUF_TOPK_IDX] = M * K * 8;
  sz[EPD_BUF_TOPK_WEIGHTS] = M * K * 4;
  sz[EPD_BUF_LL_RECV_X] = S * RM * H * 2;
  sz[EPD_BUF_LL_RECV_SCALES] = S * RM * (H / 128) * 4;
  sz[EPD_BUF_LL_RECV_COUNT] = S * 4;
  sz[EPD_BUF_LL_RECV_SRC] = S * RM * 4;
  sz[EPD_BUF_LL_Y] = S * RM * H * 2;
  sz[EPD_BUF_OUT] = M * H * 2;
  return kh_layout(sz, a);
}

static epd_result_t llh_kctx(epd_cc_t *cc, int r, void *arg, char *err, size_t errlen) {
  llh_t *h = arg;
  (void)cc;
  epd_k_ll_geom_t g = h->g;
  g.rank = (uint32_t)r;
  return epd_k_ll_create(&g, epd_cc_lsa(h->kh.cc, r), h->kh.win.win[r], h->kh.win.ptr[r], 0, &h->k[r], err,
                         errlen);
}

static void llh_kctx_free(int r, void *arg) {
  epd_k_ll_destroy(((llh_t *)arg)->k[r]);
}

/* Set up R ranks with geometry g (where ranks share a GPU, g.blocks is cut to their part of it:
 * kh_ll_blocks; h->g holds what the kernels run with); 0 or an error code with h->kh.err. */
static int llh_create(llh_t *h, int R, const epd_k_ll_geom_t *g) {
  memset(h, 0, sizeof(*h));
  h->g = *g;
  h->g.num_ranks = (uint32_t)R;
  h->g.blocks = kh_ll_blocks(h->g.blocks, kh_share(R));
  epd_k_arena_t a;
  size_t arena_bytes = llh_layout(&h->g, &a);
  return kh_create(&h->kh, R, h->g.num_experts, epd_k_ll_window_bytes(&h->g), &a, arena_bytes, llh_kctx, h);
}

static void llh_destroy(llh_t *h) {
  kh_destroy(&h->kh, llh_kctx_free, h);
}

static void *llh_buf(llh_t *h, int r, unsigned bank, int kind) {
  return kh_buf(&h->kh, r, bank, kind);
}

/* Copy a host map image to every rank. */
static int llh_set_map(llh_t *h, const void *img) {
  return kh_set_map(&h->kh, img);
}

/* Launch op on the ranks in rank_mask (bit r), without waiting. */
static int llh_launch(llh_t *h, unsigned rank_mask, uint32_t opc, uint32_t bank, const uint32_t *ntok,
                      uint32_t flags, uint64_t timeout_ns) {
  for (int r = 0; r < h->kh.R; r++) {
    if (!((rank_mask >> r) & 1)) continue;
    cudaSetDevice(epd_cc_device(h->kh.cc, r));
    epd_k_ll_op_t op;
    memset(&op, 0, sizeof op);
    op.op = opc;
    op.flags = flags;
    op.num_tokens = ntok ? ntok[r] : 0;
    op.bank = bank;
    op.timeout_ns = timeout_ns;
    op.map = h->kh.map_dev[r];
    op.comp = h->kh.comp[r] + (opc == EPD_OP_LL_DISPATCH ? 0 : 1);
    int res = epd_k_ll_launch(h->k[r], &h->kh.ar[r], &op, h->kh.st[r], h->kh.err, sizeof h->kh.err);
    if (res) return res;
  }
  return 0;
}

static int llh_sync(llh_t *h, unsigned rank_mask) {
  return kh_sync(&h->kh, rank_mask);
}

static int llh_comp(llh_t *h, int r, int which, epd_comp_t *out) {
  return kh_comp(&h->kh, r, which, out);
}

#endif
