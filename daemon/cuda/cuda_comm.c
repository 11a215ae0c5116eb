/*
 * cuda_comm.c - NCCL communicators and symmetric windows for one process driving every local GPU.
 */
#include "cuda/cuda_comm.h"

#include <stdio.h>
#include <string.h>

#if EPD_WITH_CUDA
#include <cuda_runtime.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "epd_kernels.h"
#include "epd_kernels_net.h"

struct epd_cc {
  int n;
  int world_n, base; /* world ranks, and the world rank of local rank 0 (scale-out: node * n) */
  /* Scale-out: the rank of each node's local rank 0 on the world communicators as they are (node * n,
   * or, made again without some nodes, their place among the others; -1: a node left out). */
  int peer0[EPD_CC_MAX_NODES];
  int dev[EPD_CC_MAX_RANKS];
  ncclComm_t world[EPD_CC_MAX_RANKS];
  ncclComm_t lsa[EPD_CC_MAX_RANKS];
  ncclUniqueId id;
  int own_lsa; /* the node-local communicators over lsa_id, not split from the world's */
  ncclUniqueId lsa_id;
};

typedef struct cc_job {
  epd_cc_t *cc;
  int rank;
  epd_cc_fn fn;
  void *arg;
  epd_result_t res;
} cc_job_t;

static void *cc_thread(void *p) {
  cc_job_t *j = p;
  if (cudaSetDevice(j->cc->dev[j->rank]) != cudaSuccess) {
    j->res = EPD_ERR_CUDA;
    return NULL;
  }
  j->res = j->fn(j->cc, j->rank, j->arg);
  return NULL;
}

epd_result_t epd_cc_each(epd_cc_t *cc, epd_cc_fn fn, void *arg) {
  cc_job_t jobs[EPD_CC_MAX_RANKS];
  pthread_t th[EPD_CC_MAX_RANKS];
  int started[EPD_CC_MAX_RANKS] = {0};
  for (int r = 0; r < cc->n; r++) {
    jobs[r] = (cc_job_t){cc, r, fn, arg, EPD_OK};
    started[r] = pthread_create(&th[r], NULL, cc_thread, &jobs[r]) == 0;
    if (!started[r]) jobs[r].res = EPD_ERR_SYSTEM;
  }
  epd_result_t res = EPD_OK;
  for (int r = 0; r < cc->n; r++) {
    if (started[r]) pthread_join(th[r], NULL);
    if (res == EPD_OK && jobs[r].res != EPD_OK) res = jobs[r].res;
  }
  return res;
}

typedef struct init_arg {
  char err[EPD_CC_MAX_RANKS][160];
} init_arg_t;

static epd_result_t cc_init_rank(epd_cc_t *cc, int r, void *argp) {
  init_arg_t *a = argp;
  ncclResult_t nr = ncclCommInitRank(&cc->world[r], cc->world_n, cc->id, cc->base + r);
  if (nr != ncclSuccess) {
    snprintf(a->err[r], sizeof a->err[r], "rank %d: ncclCommInitRank: %s", r, ncclGetErrorString(nr));
    return EPD_ERR_NCCL;
  }
  /* Every rank of this process is on this node (color: the node), keyed by local rank so that LSA
   * ranks equal local ranks. A node that joins a running world makes its own instead: the others' world
   * communicators are made again without a split (epd_cc_world_remake). */
  if (cc->own_lsa) {
    nr = ncclCommInitRank(&cc->lsa[r], cc->n, cc->lsa_id, r);
    if (nr != ncclSuccess) {
      snprintf(a->err[r], sizeof a->err[r], "rank %d: ncclCommInitRank (node-local): %s", r,
               ncclGetErrorString(nr));
      return EPD_ERR_NCCL;
    }
    return EPD_OK;
  }
  nr = ncclCommSplit(cc->world[r], cc->base / cc->n, r, &cc->lsa[r], NULL);
  if (nr != ncclSuccess) {
    snprintf(a->err[r], sizeof a->err[r], "rank %d: ncclCommSplit: %s", r, ncclGetErrorString(nr));
    return EPD_ERR_NCCL;
  }
  return EPD_OK;
}

/* Poll the non-blocking communicators c[0..n-1] until none is in progress: NULL, or why not (an error, past
 * limit_ms, or *cancel set). */
static const char *comms_wait(ncclComm_t *c, int n, uint32_t limit_ms, const int *cancel) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    int pending = 0;
    for (int r = 0; r < n; r++) {
      ncclResult_t st = ncclInProgress;
      if (!c[r] || ncclCommGetAsyncError(c[r], &st) != ncclSuccess) st = ncclInternalError;
      if (st == ncclInProgress)
        pending++;
      else if (st != ncclSuccess)
        return ncclGetErrorString(st);
    }
    if (!pending) return NULL;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (cancel && __atomic_load_n(cancel, __ATOMIC_ACQUIRE)) return "given up (stopping, or a newer id came)";
    if ((uint64_t)(t.tv_sec - t0.tv_sec) * 1000u + (uint64_t)((t.tv_nsec - t0.tv_nsec) / 1000000) > limit_ms)
      return "still in progress: the other ranks did not all come in time";
    usleep(1000);
  }
}

epd_result_t epd_cc_world_remake(epd_cc_t *cc, const uint8_t *world_id, uint64_t live, uint32_t limit_ms,
                                 const int *cancel, char *err, size_t errlen) {
  const int nodes = cc->world_n / cc->n, node = cc->base / cc->n;
  int peer0[EPD_CC_MAX_NODES], ranks = 0;
  for (int k = 0; k < EPD_CC_MAX_NODES; k++) {
    peer0[k] = k < nodes && (!live || (live >> k & 1)) ? ranks : -1;
    if (peer0[k] >= 0) ranks += cc->n;
  }
  if (node >= EPD_CC_MAX_NODES || peer0[node] < 0) {
    snprintf(err, errlen, "this node (%d) is not among the nodes of the world communicator to make", node);
    return EPD_ERR_INVALID;
  }
  memcpy(&cc->id, world_id, sizeof cc->id);
  for (int r = 0; r < cc->n; r++) /* a node of the old one is gone: abort, do not wait for it */
    if (cc->world[r]) {
      cudaSetDevice(cc->dev[r]);
      ncclCommAbort(cc->world[r]);
      cc->world[r] = NULL;
    }
  /* non-blocking, so that a wait for ranks that never come can be given up (and the comm aborted) */
  ncclComm_t c[EPD_CC_MAX_RANKS] = {0};
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t nr = ncclGroupStart();
  for (int r = 0; r < cc->n && (nr == ncclSuccess || nr == ncclInProgress); r++) {
    cudaSetDevice(cc->dev[r]);
    nr = ncclCommInitRankConfig(&c[r], ranks, cc->id, peer0[node] + r, &cfg);
  }
  ncclResult_t ne = ncclGroupEnd();
  const char *why = NULL;
  if (nr != ncclSuccess && nr != ncclInProgress) why = ncclGetErrorString(nr);
  if (!why && ne != ncclSuccess && ne != ncclInProgress) why = ncclGetErrorString(ne);
  if (!why) why = comms_wait(c, cc->n, limit_ms, cancel);
  if (why) {
    snprintf(err, errlen, "ncclCommInitRankConfig (world, %d ranks): %s", ranks, why);
    for (int r = 0; r < cc->n; r++)
      if (c[r]) ncclCommAbort(c[r]);
    return EPD_ERR_NCCL;
  }
  for (int r = 0; r < cc->n; r++) cc->world[r] = c[r];
  memcpy(cc->peer0, peer0, sizeof peer0);
  return EPD_OK;
}

const char *epd_cc_world_wait(epd_cc_t *cc, uint32_t limit_ms) {
  return comms_wait(cc->world, cc->n, limit_ms, NULL);
}

typedef struct gin_arg {
  int contexts[EPD_CC_MAX_RANKS], type[EPD_CC_MAX_RANKS];
  char err[EPD_CC_MAX_RANKS][160];
} gin_arg_t;

static epd_result_t cc_gin_rank(epd_cc_t *cc, int r, void *argp) {
  gin_arg_t *a = argp;
  return epd_k_gin_probe(cc->world[r], &a->contexts[r], &a->type[r], a->err[r], sizeof a->err[r]);
}

void epd_cc_gin_probe(epd_cc_t *cc, char *out, size_t outlen) {
  gin_arg_t a;
  memset(&a, 0, sizeof a);
  if (epd_cc_each(cc, cc_gin_rank, &a) != EPD_OK) {
    int r = 0;
    while (r < cc->n - 1 && !a.err[r][0]) r++;
    snprintf(out, outlen, "probe failed: %s", a.err[r][0] ? a.err[r] : "thread");
    return;
  }
  const char *errs[EPD_CC_MAX_RANKS];
  for (int r = 0; r < cc->n; r++) errs[r] = a.err[r];
  epd_gin_line(cc->n, a.contexts, a.type, errs, out, outlen);
}

epd_result_t epd_cc_unique_id(uint8_t *id, char *err, size_t errlen) {
  _Static_assert(sizeof(ncclUniqueId) == EPD_CC_UNIQUE_ID_BYTES, "ncclUniqueId size");
  ncclUniqueId u;
  ncclResult_t nr = ncclGetUniqueId(&u);
  if (nr != ncclSuccess) {
    snprintf(err, errlen, "ncclGetUniqueId: %s", ncclGetErrorString(nr));
    return EPD_ERR_NCCL;
  }
  memcpy(id, &u, sizeof u);
  return EPD_OK;
}

int epd_cc_devices_for(int n, int *devices) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
    cudaGetLastError();
    return -1;
  }
  for (int r = 0; r < n; r++) devices[r] = r % ndev;
  return (n + ndev - 1) / ndev;
}

int epd_cc_ranks_on(int n, const int *devices, int rank) {
  int k = 0;
  for (int r = 0; r < n; r++) k += (devices ? devices[r] : r) == (devices ? devices[rank] : rank);
  return k;
}

int epd_cc_share(int n, const int *devices) {
  int share = 1;
  for (int r = 0; r < n; r++) {
    const int k = epd_cc_ranks_on(n, devices, r);
    if (k > share) share = k;
  }
  return share;
}

epd_result_t epd_cc_check_devices(int n, const int *devices, char *err, size_t errlen) {
  int ndev = 0, share = 1;
  cudaError_t ce = cudaGetDeviceCount(&ndev);
  if (ce != cudaSuccess) {
    snprintf(err, errlen, "cudaGetDeviceCount: %s", cudaGetErrorString(ce));
    cudaGetLastError();
    return EPD_ERR_CUDA;
  }
  if (n < 1 || n > EPD_CC_MAX_RANKS) {
    snprintf(err, errlen, "num_ranks = %d out of range [1, %d]", n, EPD_CC_MAX_RANKS);
    return EPD_ERR_INVALID;
  }
  for (int r = 0; r < n; r++) {
    const int d = devices ? devices[r] : r;
    if (d < 0 || d >= ndev) {
      if (devices)
        snprintf(err, errlen, "rank %d on GPU %d, but %d GPU(s) are visible (engine.devices takes 0..%d)", r,
                 d, ndev, ndev - 1);
      else
        snprintf(err, errlen,
                 "%d ranks but %d GPU(s) are visible: set engine.devices to share GPUs among "
                 "ranks (e.g. engine.devices = %s for two ranks on GPU 0)",
                 n, ndev, "0,0");
      return EPD_ERR_INVALID;
    }
    const int k = epd_cc_ranks_on(n, devices, r);
    if (k > EPD_CC_MAX_RANKS_PER_GPU) {
      snprintf(err, errlen, "%d ranks on GPU %d: at most %d ranks may share a GPU", k, d,
               EPD_CC_MAX_RANKS_PER_GPU);
      return EPD_ERR_INVALID;
    }
    if (k > share) share = k;
  }
  if (share == 1) return EPD_OK;
  const int v = epd_k_nccl_version();
  if (v < 23000) {
    snprintf(err, errlen,
             "ranks sharing a GPU need NCCL 2.30 or later (its multi-rank mode); the NCCL runtime "
             "is %d.%d.%d: install a newer one (pip install nvidia-nccl-cu13) or give every rank its own GPU",
             v / 10000, (v / 100) % 100, v % 100);
    return EPD_ERR_UNSUPPORTED;
  }
  /* NCCL refuses two ranks of a communicator on one GPU unless asked; set before the first init. */
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  return EPD_OK;
}

#ifdef EPD_TEST_HOOKS
size_t epd_cc_test_free_bytes; /* test builds: nonzero is the free memory every GPU reports */
#endif

epd_result_t epd_cc_check_free(int n, const int *devices, int rank, size_t bytes, const char *what, char *err,
                               size_t errlen) {
  int prev = -1;
  cudaGetDevice(&prev);
  epd_result_t rc = EPD_OK;
  for (int r = 0; r < n && rc == EPD_OK; r++) {
    const int d = devices ? devices[r] : r;
    int first = 1; /* each GPU once: at its lowest rank */
    for (int q = 0; q < r; q++) first &= (devices ? devices[q] : q) != d;
    if (!first || (rank >= 0 && d != (devices ? devices[rank] : rank))) continue;
    const int k = rank >= 0 ? 1 : epd_cc_ranks_on(n, devices, r);
    size_t avail = 0, total = 0;
    cudaError_t ce = cudaSetDevice(d);
    if (ce == cudaSuccess) ce = cudaMemGetInfo(&avail, &total);
    if (ce != cudaSuccess) {
      cudaGetLastError();
      continue; /* the allocation itself will say what is wrong */
    }
#ifdef EPD_TEST_HOOKS
    if (epd_cc_test_free_bytes) avail = epd_cc_test_free_bytes;
#endif
    if ((double)bytes * k > (double)avail) {
      if (k > 1)
        snprintf(
            err, errlen,
            "%s needs %.1f MiB on GPU %d (%.1f MiB for each of the %d ranks sharing it), %.1f MiB are free",
            what, (double)bytes * k / 1048576.0, d, bytes / 1048576.0, k, avail / 1048576.0);
      else
        snprintf(err, errlen, "%s needs %.1f MiB on GPU %d, %.1f MiB are free", what, bytes / 1048576.0, d,
                 avail / 1048576.0);
      rc = EPD_ERR_NOMEM;
    }
  }
  if (prev >= 0) cudaSetDevice(prev);
  return rc;
}

epd_result_t epd_cc_create(int n, const int *devices, epd_cc_t **out, char *err, size_t errlen) {
  return epd_cc_create_world(n, devices, 1, 0, NULL, 0, out, err, errlen);
}

epd_result_t epd_cc_create_world(int n, const int *devices, uint32_t nodes, uint32_t node,
                                 const uint8_t *world_id, int own_lsa, epd_cc_t **out, char *err,
                                 size_t errlen) {
  *out = NULL;
  epd_result_t res = epd_k_check_nccl_version(err, errlen);
  if (res != EPD_OK) return res;
  if ((res = epd_cc_check_devices(n, devices, err, errlen)) != EPD_OK) return res;
  epd_cc_t *cc = calloc(1, sizeof(*cc));
  if (!cc) return EPD_ERR_NOMEM;
  cc->n = n;
  cc->world_n = n * (int)(nodes ? nodes : 1);
  cc->base = n * (int)node;
  for (uint32_t k = 0; k < EPD_CC_MAX_NODES; k++) cc->peer0[k] = k < (nodes ? nodes : 1) ? n * (int)k : -1;
  for (int r = 0; r < n; r++) cc->dev[r] = devices ? devices[r] : r;
  ncclResult_t nr = ncclSuccess;
  if (world_id)
    memcpy(&cc->id, world_id, sizeof cc->id);
  else
    nr = ncclGetUniqueId(&cc->id);
  cc->own_lsa = own_lsa && world_id;
  if (nr == ncclSuccess && cc->own_lsa) nr = ncclGetUniqueId(&cc->lsa_id);
  if (nr != ncclSuccess) {
    snprintf(err, errlen, "ncclGetUniqueId: %s", ncclGetErrorString(nr));
    free(cc);
    return EPD_ERR_NCCL;
  }
  init_arg_t *a = calloc(1, sizeof(*a));
  if (!a) {
    free(cc);
    return EPD_ERR_NOMEM;
  }
  res = epd_cc_each(cc, cc_init_rank, a);
  if (res != EPD_OK) {
    for (int r = 0; r < n; r++)
      if (a->err[r][0]) {
        snprintf(err, errlen, "%s", a->err[r]);
        break;
      }
    free(a);
    epd_cc_destroy(cc);
    return res;
  }
  free(a);
  *out = cc;
  return EPD_OK;
}

static epd_result_t cc_fini_rank(epd_cc_t *cc, int r, void *arg) {
  (void)arg;
  if (cc->lsa[r]) ncclCommDestroy(cc->lsa[r]);
  if (cc->world[r] && cc->world_n > cc->n) {
    /* Across nodes a peer may be gone: abort instead of a finalize that could wait for it. */
    ncclCommAbort(cc->world[r]);
  } else if (cc->world[r]) {
    ncclCommFinalize(cc->world[r]);
    ncclCommDestroy(cc->world[r]);
  }
  cc->lsa[r] = cc->world[r] = NULL;
  return EPD_OK;
}

void epd_cc_destroy(epd_cc_t *cc) {
  if (!cc) return;
  epd_cc_each(cc, cc_fini_rank, NULL);
  free(cc);
}

int epd_cc_num_ranks(const epd_cc_t *cc) {
  return cc->n;
}
int epd_cc_world_ranks(const epd_cc_t *cc) {
  return cc->world_n;
}
void epd_cc_abort(epd_cc_t *cc) {
  for (int r = 0; r < cc->n; r++)
    if (cc->world[r]) {
      ncclCommAbort(cc->world[r]);
      cc->world[r] = NULL;
    }
}
int epd_cc_device(const epd_cc_t *cc, int rank) {
  return cc->dev[rank];
}
int epd_cc_world_peer(const epd_cc_t *cc, uint32_t node, int rank) {
  return node < EPD_CC_MAX_NODES && cc->peer0[node] >= 0 ? cc->peer0[node] + rank : -1;
}
struct ncclComm *epd_cc_world(const epd_cc_t *cc, int rank) {
  return cc->world[rank];
}
struct ncclComm *epd_cc_lsa(const epd_cc_t *cc, int rank) {
  return cc->lsa[rank];
}

typedef struct win_arg {
  epd_cc_win_t *w;
  char err[EPD_CC_MAX_RANKS][160];
} win_arg_t;

static epd_result_t cc_win_rank(epd_cc_t *cc, int r, void *argp) {
  win_arg_t *a = argp;
  void *p = NULL;
  ncclResult_t nr = ncclMemAlloc(&p, a->w->bytes);
  if (nr != ncclSuccess) {
    snprintf(a->err[r], sizeof a->err[r], "rank %d: ncclMemAlloc(%zu): %s", r, a->w->bytes,
             ncclGetErrorString(nr));
    return EPD_ERR_NOMEM;
  }
  cudaError_t ce = cudaMemset(p, 0, a->w->bytes);
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    snprintf(a->err[r], sizeof a->err[r], "rank %d: cudaMemset: %s", r, cudaGetErrorString(ce));
    ncclMemFree(p);
    return EPD_ERR_CUDA;
  }
  ncclWindow_t win = NULL;
  nr = ncclCommWindowRegister(cc->lsa[r], p, a->w->bytes, &win, NCCL_WIN_COLL_SYMMETRIC);
  if (nr != ncclSuccess) {
    snprintf(a->err[r], sizeof a->err[r], "rank %d: ncclCommWindowRegister: %s", r, ncclGetErrorString(nr));
    ncclMemFree(p);
    return EPD_ERR_NCCL;
  }
  a->w->ptr[r] = p;
  a->w->win[r] = win;
  return EPD_OK;
}

epd_result_t epd_cc_window_alloc(epd_cc_t *cc, size_t bytes, epd_cc_win_t *out, char *err, size_t errlen) {
  memset(out, 0, sizeof(*out));
  out->bytes = (bytes + 4095) / 4096 * 4096;
  win_arg_t *a = calloc(1, sizeof(*a));
  if (!a) return EPD_ERR_NOMEM;
  a->w = out;
  epd_result_t res = epd_cc_each(cc, cc_win_rank, a);
  if (res != EPD_OK) {
    for (int r = 0; r < cc->n; r++)
      if (a->err[r][0]) {
        snprintf(err, errlen, "%s", a->err[r]);
        break;
      }
    epd_cc_window_free(cc, out);
  }
  free(a);
  return res;
}

static epd_result_t cc_winfree_rank(epd_cc_t *cc, int r, void *argp) {
  epd_cc_win_t *w = argp;
  if (w->win[r]) ncclCommWindowDeregister(cc->lsa[r], w->win[r]);
  if (w->ptr[r]) ncclMemFree(w->ptr[r]);
  w->win[r] = NULL;
  w->ptr[r] = NULL;
  return EPD_OK;
}

void epd_cc_window_free(epd_cc_t *cc, epd_cc_win_t *w) {
  if (!cc || !w) return;
  cudaDeviceSynchronize();
  epd_cc_each(cc, cc_winfree_rank, w);
}

#endif /* EPD_WITH_CUDA */

/* One local rank's GIN probe result: "available (2 contexts, GDAKI backend)", "unavailable (NCCL refused a
 * GIN context on the world communicator: '<NCCL's reason, trimmed>')" or "unavailable (NCCL gave the world
 * communicator no GIN context)". */
static void gin_rank_text(int contexts, int type, const char *err, char *out, size_t outlen) {
  if (type < 0) {
    size_t n = strlen(err ? err : "");
    while (n && (err[n - 1] == '\n' || err[n - 1] == '.' || err[n - 1] == ' ')) n--;
    snprintf(out, outlen, "unavailable (NCCL refused a GIN context on the world communicator: '%.*s')",
             (int)(n > 110 ? 110 : n), n ? err : "");
  } else if (contexts > 0) {
    const char *ty = type == 3 ? "GDAKI" : type == 2 ? "proxy" : "type ?";
    snprintf(out, outlen, "available (%d context%s, %s backend)", contexts, contexts == 1 ? "" : "s", ty);
  } else {
    snprintf(out, outlen, "unavailable (NCCL gave the world communicator no GIN context)");
  }
}

void epd_gin_line(int n, const int *contexts, const int *type, const char *const *err, char *out,
                  size_t outlen) {
  if (n < 1 || n > EPD_CC_MAX_RANKS) {
    snprintf(out, outlen, "probe failed: %d local ranks", n);
    return;
  }
  /* each rank's text once, and the first rank that got the same text (its group) */
  char txt[EPD_CC_MAX_RANKS][192];
  int grp[EPD_CC_MAX_RANKS], avail = 0, groups = 0;
  for (int r = 0; r < n; r++) {
    gin_rank_text(contexts[r], type[r], err[r], txt[r], sizeof txt[r]);
    grp[r] = r;
    for (int q = 0; q < r; q++)
      if (grp[q] == q && !strcmp(txt[q], txt[r])) {
        grp[r] = q;
        break;
      }
    if (grp[r] == r) groups++;
    if (type[r] >= 0 && contexts[r] > 0) avail++;
  }
  const char *tail =
      avail ? "; not used: this build has no GIN stage, the host stage (nccl-p2p) carries the data"
            : "; no device-initiated network transport, e.g. no InfiniBand/RoCE NIC";
  if (groups == 1) {
    snprintf(out, outlen, "%s%s", txt[0], tail);
    return;
  }
  /* the node's GPUs differ (a NIC per GPU, one missing or down): each distinct result once, with the ranks
   * that got it ("ranks 0,1,2 available (...); rank 3 unavailable (...)") */
  size_t at = (size_t)snprintf(out, outlen, "differs between local ranks (%d of %d available):", avail, n);
  for (int g = 0; g < n && at < outlen; g++) {
    if (grp[g] != g) continue;
    int cnt = 0;
    for (int q = g; q < n; q++) cnt += grp[q] == g;
    at += (size_t)snprintf(out + at, outlen - at, "%s rank%s", g ? ";" : "", cnt > 1 ? "s" : "");
    for (int q = g, k = 0; q < n && at < outlen; q++)
      if (grp[q] == g) at += (size_t)snprintf(out + at, outlen - at, "%s%d", k++ ? "," : " ", q);
    if (at < outlen) at += (size_t)snprintf(out + at, outlen - at, " %s", txt[g]);
  }
  if (at < outlen) snprintf(out + at, outlen - at, "%s", tail);
}
