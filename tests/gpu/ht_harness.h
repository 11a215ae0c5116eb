/*
 * ht_harness.h - in-process HT set-up shared by the GPU tests and the HT benchmark: R GPUs of one process
 * (daemon/cuda_comm), an HT staging window, one IO arena per rank (plain device memory), the device
 * expert map, completion records and a stream per rank. Static functions: included by
 * tests/gpu/test_ht.c and bench/bench_ht.c.
 */
#ifndef EPD_HT_HARNESS_H
#define EPD_HT_HARNESS_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_comm.h"
#include "epd_kernels.h"

typedef struct hth {
  int R;
  epd_cc_t *cc;
  epd_k_ht_geom_t g; /* rank field unused here */
  epd_cc_win_t win;
  epd_k_ht_t *k[EPD_K_MAX_RANKS];
  char *arena[EPD_K_MAX_RANKS];
  size_t arena_bytes;
  epd_k_arena_t ar[EPD_K_MAX_RANKS];
  void *map_dev[EPD_K_MAX_RANKS];
  epd_comp_t *comp[EPD_K_MAX_RANKS]; /* device, [2]: dispatch, combine */
  cudaStream_t st[EPD_K_MAX_RANKS];
  char err[512];
} hth_t;

#define HTH_GUARD_ROWS 4 /* poisoned rows after the C rows of each HT receive buffer */

static int hth_gpus(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

/* Arena layout of every (bank, kind) the HT kernels use, with guard rows past C. */
static size_t hth_layout(const epd_k_ht_geom_t *g, epd_k_arena_t *a) {
  uint64_t M = g->max_tokens, H = g->hidden, K = g->topk, S = g->slots_per_rank, C = g->capacity + HTH_GUARD_ROWS;
  uint64_t o = 0;
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
    for (unsigned kd = 0; kd < EPD_BUF_KINDS; kd++) a->off[b][kd] = EPD_K_OFF_NONE;
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++) {
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
    for (unsigned kd = 0; kd < EPD_BUF_KINDS; kd++) {
      if (!sz[kd]) continue;
      a->off[b][kd] = o;
      o = (o + sz[kd] + 255) / 256 * 256;
    }
  }
  return (size_t)o;
}

typedef struct hth_create_arg {
  hth_t *h;
  char err[EPD_K_MAX_RANKS][256];
} hth_create_arg_t;

static epd_result_t hth_rank_init(epd_cc_t *cc, int r, void *argp) {
  hth_create_arg_t *a = argp;
  hth_t *h = a->h;
  (void)cc;
  epd_k_ht_geom_t g = h->g;
  g.rank = (uint32_t)r;
  epd_result_t res = epd_k_ht_create(&g, epd_cc_lsa(h->cc, r), h->win.win[r], h->win.ptr[r], 0, &h->k[r],
                                     a->err[r], sizeof a->err[r]);
  if (res) return res;
  if (cudaMalloc((void **)&h->arena[r], h->arena_bytes) != cudaSuccess) return EPD_ERR_NOMEM;
  if (cudaMalloc((void **)&h->comp[r], 2 * sizeof(epd_comp_t)) != cudaSuccess) return EPD_ERR_NOMEM;
  if (cudaMalloc(&h->map_dev[r], epd_k_map_bytes(h->g.num_experts)) != cudaSuccess) return EPD_ERR_NOMEM;
  if (cudaStreamCreateWithFlags(&h->st[r], cudaStreamNonBlocking) != cudaSuccess) return EPD_ERR_CUDA;
  h->ar[r].base = (uint64_t)(uintptr_t)h->arena[r];
  return EPD_OK;
}

/* Set up R ranks with geometry g (cc: reuse communicators, or NULL to create them). */
static int hth_create(hth_t *h, int R, const epd_k_ht_geom_t *g) {
  memset(h, 0, sizeof(*h));
  h->R = R;
  h->g = *g;
  h->g.num_ranks = (uint32_t)R;
  epd_result_t r = epd_cc_create(R, NULL, &h->cc, h->err, sizeof h->err);
  if (r) return r;
  r = epd_cc_window_alloc(h->cc, epd_k_ht_window_bytes(&h->g), &h->win, h->err, sizeof h->err);
  if (r) return r;
  epd_k_arena_t a;
  h->arena_bytes = hth_layout(&h->g, &a);
  for (int i = 0; i < R; i++) h->ar[i] = a;
  hth_create_arg_t *arg = calloc(1, sizeof(*arg));
  arg->h = h;
  r = epd_cc_each(h->cc, hth_rank_init, arg);
  if (r) {
    for (int i = 0; i < R; i++)
      if (arg->err[i][0]) snprintf(h->err, sizeof h->err, "%s", arg->err[i]);
  }
  free(arg);
  return r;
}

static void hth_destroy(hth_t *h) {
  if (!h->cc) return;
  for (int r = 0; r < h->R; r++) {
    cudaSetDevice(epd_cc_device(h->cc, r));
    cudaDeviceSynchronize();
    if (h->st[r]) cudaStreamDestroy(h->st[r]);
    cudaFree(h->arena[r]);
    cudaFree(h->comp[r]);
    cudaFree(h->map_dev[r]);
    epd_k_ht_destroy(h->k[r]);
  }
  epd_cc_window_free(h->cc, &h->win);
  epd_cc_destroy(h->cc);
  h->cc = NULL;
}

static void *hth_buf(hth_t *h, int r, unsigned bank, int kind) { return h->arena[r] + h->ar[r].off[bank][kind]; }

static int hth_set_map(hth_t *h, const void *img) {
  for (int r = 0; r < h->R; r++) {
    cudaSetDevice(epd_cc_device(h->cc, r));
    if (cudaMemcpy(h->map_dev[r], img, epd_k_map_bytes(h->g.num_experts), cudaMemcpyHostToDevice) != cudaSuccess)
      return EPD_ERR_CUDA;
    if (cudaDeviceSynchronize() != cudaSuccess) return EPD_ERR_CUDA;
  }
  return 0;
}

/* Launch op on the ranks in rank_mask, without waiting. */
static int hth_launch(hth_t *h, unsigned rank_mask, uint32_t opc, uint32_t bank, const uint32_t *ntok,
                      uint32_t flags, uint64_t timeout_ns) {
  for (int r = 0; r < h->R; r++) {
    if (!((rank_mask >> r) & 1)) continue;
    cudaSetDevice(epd_cc_device(h->cc, r));
    epd_k_ht_op_t op;
    memset(&op, 0, sizeof op);
    op.op = opc;
    op.flags = flags;
    op.num_tokens = ntok ? ntok[r] : 0;
    op.bank = bank;
    op.timeout_ns = timeout_ns;
    op.map = h->map_dev[r];
    op.comp = h->comp[r] + (opc == EPD_OP_HT_DISPATCH ? 0 : 1);
    int res = epd_k_ht_launch(h->k[r], &h->ar[r], &op, h->st[r], h->err, sizeof h->err);
    if (res) return res;
  }
  return 0;
}

__attribute__((unused)) static int hth_sync(hth_t *h, unsigned rank_mask) {
  for (int r = 0; r < h->R; r++) {
    if (!((rank_mask >> r) & 1)) continue;
    cudaSetDevice(epd_cc_device(h->cc, r));
    cudaError_t ce = cudaStreamSynchronize(h->st[r]);
    if (ce != cudaSuccess) {
      snprintf(h->err, sizeof h->err, "rank %d: %s", r, cudaGetErrorString(ce));
      return EPD_ERR_CUDA;
    }
  }
  return 0;
}

static int hth_comp(hth_t *h, int r, int which, epd_comp_t *out) {
  cudaSetDevice(epd_cc_device(h->cc, r));
  return cudaMemcpy(out, h->comp[r] + which, sizeof *out, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : EPD_ERR_CUDA;
}

#endif
