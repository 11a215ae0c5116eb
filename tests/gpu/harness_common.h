/*
 * harness_common.h - the part of the in-process kernel harnesses (ll_harness.h, ht_harness.h) that does
 * not depend on the kernel family: R ranks of one process on the visible GPUs (daemon/cuda_comm), a
 * staging window, one IO arena per rank (plain device memory), the device expert map, completion records
 * and a stream per rank. The family's harness embeds a kh_t and adds its geometry and kernel contexts.
 * Rank r is on GPU r, or on GPU r % n with fewer GPUs than ranks (epd_cc_devices_for): up to
 * EPD_CC_MAX_RANKS_PER_GPU ranks then share a GPU (NCCL's multi-rank mode), each with its part of the
 * GPU's blocks (kh_ll_blocks, kh_ht_blocks: the blocks of every rank's kernel must be resident at once,
 * as they wait for each other).
 */
#ifndef EPD_HARNESS_COMMON_H
#define EPD_HARNESS_COMMON_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_comm.h"
#include "epd_kernels.h"

typedef struct kh {
  int R;
  int dev[EPD_K_MAX_RANKS]; /* each rank's GPU */
  int share;                /* the most ranks on one GPU (1: a GPU per rank) */
  epd_cc_t *cc;
  epd_cc_win_t win;
  char *arena[EPD_K_MAX_RANKS];
  size_t arena_bytes;
  epd_k_arena_t ar[EPD_K_MAX_RANKS];
  void *map_dev[EPD_K_MAX_RANKS];
  epd_comp_t *comp[EPD_K_MAX_RANKS]; /* device, [2]: dispatch, combine */
  cudaStream_t st[EPD_K_MAX_RANKS];
  uint32_t num_experts; /* size of the device map */
  char err[512];
} kh_t;

/* Create rank r's kernel context (the family's part of a rank's set-up); err gets why it failed. */
typedef epd_result_t (*kh_kctx_fn)(epd_cc_t *cc, int r, void *arg, char *err, size_t errlen);
/* Destroy rank r's kernel context. */
typedef void (*kh_kctx_free_fn)(int r, void *arg);

/* Number of usable GPUs (0 without a driver). */
static inline int kh_gpus(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

/* Why R ranks of one process cannot run on the visible GPUs (none, or more than EPD_CC_MAX_RANKS_PER_GPU
 * on one), as a test's skip reason in why; NULL when they can. */
static inline const char *kh_unfit(int R, char *why, size_t len) {
  int dev[EPD_K_MAX_RANKS];
  if (R < 1 || R > EPD_K_MAX_RANKS) {
    snprintf(why, len, "%d ranks: out of range [1, %d]", R, EPD_K_MAX_RANKS);
    return why;
  }
  const int share = epd_cc_devices_for(R, dev);
  if (share < 0)
    snprintf(why, len, "needs a GPU (found none)");
  else if (share > EPD_CC_MAX_RANKS_PER_GPU)
    snprintf(why, len, "%d ranks on %d GPU(s): %d would share one (at most %d)", R, kh_gpus(), share,
             EPD_CC_MAX_RANKS_PER_GPU);
  else
    return NULL;
  return why;
}

/* Ranks per GPU when R ranks of one process share the visible GPUs (0 without a GPU). */
static inline int kh_share(int R) {
  int dev[EPD_K_MAX_RANKS];
  const int share = R >= 1 && R <= EPD_K_MAX_RANKS ? epd_cc_devices_for(R, dev) : 0;
  return share < 0 ? 0 : share;
}

/* LL blocks per kernel (0: EPD_K_LL_BLOCKS) of each of `share` ranks on one GPU: at most
 * EPD_K_LL_BLOCKS / share, as the daemon gives them, so that the persistent kernels' controller blocks fit
 * too. Unchanged with a GPU per rank. */
static inline uint32_t kh_ll_blocks(uint32_t blocks, int share) {
  if (share <= 1) return blocks;
  const uint32_t cap = EPD_K_LL_BLOCKS / (uint32_t)share, b = blocks ? blocks : EPD_K_LL_BLOCKS;
  return b < cap ? b : cap;
}

/* HT data-kernel blocks (SMs; 0: EPD_K_HT_BLOCKS) of each of `share` ranks on GPU `device`: at most its
 * SMs / share, as the daemon gives them. Unchanged with a GPU per rank. */
static inline uint32_t kh_ht_blocks(uint32_t blocks, int share, int device) {
  int nsm = 0;
  if (share <= 1 || cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      nsm < 1)
    return blocks;
  const uint32_t cap = (uint32_t)nsm / (uint32_t)share, b = blocks ? blocks : EPD_K_HT_BLOCKS;
  return b < cap ? b : cap;
}

/* Arena layout of every bank with the byte sizes sz[kind] (0: kind unused), 256-byte aligned. */
static inline size_t kh_layout(const uint64_t sz[EPD_BUF_KINDS], epd_k_arena_t *a) {
  uint64_t o = 0;
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
    for (unsigned kd = 0; kd < EPD_BUF_KINDS; kd++) a->off[b][kd] = EPD_K_OFF_NONE;
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
    for (unsigned kd = 0; kd < EPD_BUF_KINDS; kd++) {
      if (!sz[kd]) continue;
      a->off[b][kd] = o;
      o = (o + sz[kd] + 255) / 256 * 256;
    }
  return (size_t)o;
}

typedef struct kh_create_arg {
  kh_t *h;
  kh_kctx_fn kctx;
  void *kctx_arg;
  char err[EPD_K_MAX_RANKS][256];
} kh_create_arg_t;

static inline epd_result_t kh_rank_init(epd_cc_t *cc, int r, void *argp) {
  kh_create_arg_t *a = argp;
  kh_t *h = a->h;
  epd_result_t res = a->kctx(cc, r, a->kctx_arg, a->err[r], sizeof a->err[r]);
  if (res) return res;
  if (cudaMalloc((void **)&h->arena[r], h->arena_bytes) != cudaSuccess) return EPD_ERR_NOMEM;
  if (cudaMalloc((void **)&h->comp[r], 2 * sizeof(epd_comp_t)) != cudaSuccess) return EPD_ERR_NOMEM;
  if (cudaMalloc(&h->map_dev[r], epd_k_map_bytes(h->num_experts)) != cudaSuccess) return EPD_ERR_NOMEM;
  if (cudaStreamCreateWithFlags(&h->st[r], cudaStreamNonBlocking) != cudaSuccess) return EPD_ERR_CUDA;
  h->ar[r].base = (uint64_t)(uintptr_t)h->arena[r];
  return EPD_OK;
}

/* Set up R ranks (h zeroed by the caller): communicators, a window of window_bytes, and on every rank
 * its kernel context (kctx), an arena of layout a (arena_bytes), completions, map and stream; 0 or an
 * error code with h->err. */
static inline int kh_create(kh_t *h, int R, uint32_t num_experts, size_t window_bytes, const epd_k_arena_t *a,
                            size_t arena_bytes, kh_kctx_fn kctx, void *kctx_arg) {
  h->R = R;
  h->num_experts = num_experts;
  if (R < 1 || R > EPD_K_MAX_RANKS || (h->share = epd_cc_devices_for(R, h->dev)) < 0) {
    snprintf(h->err, sizeof h->err, "%d ranks: no GPU visible", R);
    return EPD_ERR_UNSUPPORTED;
  }
  epd_result_t r = epd_cc_create(R, h->dev, &h->cc, h->err, sizeof h->err);
  if (r) return r;
  r = epd_cc_window_alloc(h->cc, window_bytes, &h->win, h->err, sizeof h->err);
  if (r) return r;
  /* Peer access between every pair of GPUs: the HT kernels write to and read from the peers' arenas
   * (plain cudaMalloc memory) as the daemon's kernels do with its clients' arenas. Ranks on one GPU
   * reach each other's arenas without it. */
  for (int i = 0; i < R; i++) {
    const int di = epd_cc_device(h->cc, i);
    cudaSetDevice(di);
    for (int j = 0; j < R; j++) {
      const int dj = epd_cc_device(h->cc, j);
      int ok = 0;
      if (dj == di || cudaDeviceCanAccessPeer(&ok, di, dj) || !ok) continue;
      cudaError_t ce = cudaDeviceEnablePeerAccess(dj, 0);
      if (ce != cudaSuccess && ce != cudaErrorPeerAccessAlreadyEnabled) {
        snprintf(h->err, sizeof h->err, "cudaDeviceEnablePeerAccess(%d -> %d): %s", i, j,
                 cudaGetErrorString(ce));
        return EPD_ERR_CUDA;
      }
      cudaGetLastError();
    }
  }
  h->arena_bytes = arena_bytes;
  for (int i = 0; i < R; i++) h->ar[i] = *a;
  kh_create_arg_t *arg = calloc(1, sizeof(*arg));
  arg->h = h;
  arg->kctx = kctx;
  arg->kctx_arg = kctx_arg;
  r = epd_cc_each(h->cc, kh_rank_init, arg);
  if (r) {
    for (int i = 0; i < R; i++)
      if (arg->err[i][0]) snprintf(h->err, sizeof h->err, "%s", arg->err[i]);
  }
  free(arg);
  return r;
}

/* Tear down what kh_create set up (kctx_free destroys each rank's kernel context). */
static inline void kh_destroy(kh_t *h, kh_kctx_free_fn kctx_free, void *kctx_arg) {
  if (!h->cc) return;
  for (int r = 0; r < h->R; r++) {
    cudaSetDevice(epd_cc_device(h->cc, r));
    cudaDeviceSynchronize();
    if (h->st[r]) cudaStreamDestroy(h->st[r]);
    cudaFree(h->arena[r]);
    cudaFree(h->comp[r]);
    cudaFree(h->map_dev[r]);
    kctx_free(r, kctx_arg);
  }
  epd_cc_window_free(h->cc, &h->win);
  epd_cc_destroy(h->cc);
  h->cc = NULL;
}

/* Device address of buffer (bank, kind) in rank r's arena. */
static inline void *kh_buf(kh_t *h, int r, unsigned bank, int kind) {
  return h->arena[r] + h->ar[r].off[bank][kind];
}

/* Copy a host map image to every rank. */
static inline int kh_set_map(kh_t *h, const void *img) {
  for (int r = 0; r < h->R; r++) {
    cudaSetDevice(epd_cc_device(h->cc, r));
    if (cudaMemcpy(h->map_dev[r], img, epd_k_map_bytes(h->num_experts), cudaMemcpyHostToDevice) !=
        cudaSuccess)
      return EPD_ERR_CUDA;
    if (cudaDeviceSynchronize() != cudaSuccess) return EPD_ERR_CUDA; /* legacy-stream copy vs our streams */
  }
  return 0;
}

/* Wait for the streams of the ranks in rank_mask (bit r); h->err names the first that failed. */
static inline int kh_sync(kh_t *h, unsigned rank_mask) {
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

/* Rank r's completion record `which` (0: dispatch, 1: combine). */
static inline int kh_comp(kh_t *h, int r, int which, epd_comp_t *out) {
  cudaSetDevice(epd_cc_device(h->cc, r));
  return cudaMemcpy(out, h->comp[r] + which, sizeof *out, cudaMemcpyDeviceToHost) == cudaSuccess
             ? 0
             : EPD_ERR_CUDA;
}

#endif
