/*
 * engine_cuda.c - the CUDA backend: every rank is a GPU of this node, driven from one daemon process.
 *
 * Memory handed to a client:
 *   queue - a memfd in host memory (as on the host backend), registered mapped with cudaHostRegister so
 *           the client's stream memory operations and kernels (epd_device.h) and a persistent kernel
 *           can reach the slots; the daemon's rank thread reads it from the CPU.
 *   arena - a cuMem allocation on the rank's GPU (cuMemCreate with the POSIX fd handle type), mapped
 *           read/write in the daemon and exported as an fd that libepd imports (zero copy).
 * Driver-API calls (cuMem*) come through cudaGetDriverEntryPointByVersion: the daemon links only the
 * static runtime and NCCL, so it starts (and falls back to the host backend) on machines without a GPU.
 *
 * Execution: launch.c ("launch" mode, the default) and persistent.c ("persistent" mode).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "core/engine_internal.h"
#include "core/log.h"
#include "cuda/cuda_comm.h"
#include "cuda/engine_cuda_net.h"
#include "net/scaleout.h"

#if EPD_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda/cuda_be.h"
#include "epd_kernels.h"

cuda_driver_t cu;

/* Index of a world rank among this node's GPUs (the rank itself on one node). */
static int local_rank(const epd_engine_t *eng, int rank) {
  return rank - (int)(eng->o.node_rank * (uint32_t)eng->o.num_ranks);
}

/* ---- helpers ------------------------------------------------------------------------------------ */

epd_result_t cuda_err(cudaError_t e, const char *what, char *err, size_t errlen) {
  snprintf(err, errlen, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  return e == cudaErrorMemoryAllocation ? EPD_ERR_NOMEM : EPD_ERR_CUDA;
}
static epd_result_t cu_err(CUresult r, const char *what, char *err, size_t errlen) {
  const char *s = NULL;
  if (cu.cuGetErrorString) cu.cuGetErrorString(r, &s);
  snprintf(err, errlen, "%s: %s (%d)", what, s ? s : "CUDA driver error", (int)r);
  return r == CUDA_ERROR_OUT_OF_MEMORY ? EPD_ERR_NOMEM : EPD_ERR_CUDA;
}

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_loaded;
static void cu_load(void) {
  int ok = 1;
#define X(name, args)                                                                                   \
  {                                                                                                     \
    void *p = NULL;                                                                                     \
    enum cudaDriverEntryPointQueryResult q;                                                             \
    if (cudaGetDriverEntryPointByVersion(#name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess || !p) \
      ok = 0;                                                                                           \
    memcpy(&cu.name, &p, sizeof p);                                                                     \
  }
  CU_FUNCS(X)
#undef X
  cu_loaded = ok;
}

/* ---- availability and mode ---------------------------------------------------------------------- */

static int cuda_available(char *why, size_t whylen) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 1) {
    snprintf(why, whylen, "no usable CUDA device (%s)", e ? cudaGetErrorString(e) : "0 devices");
    cudaGetLastError();
    return 0;
  }
  char err[160];
  if (epd_k_check_nccl_version(err, sizeof err)) {
    snprintf(why, whylen, "%s", err);
    return 0;
  }
  return 1;
}

/* MPS: the device attribute says whether contexts on it are shared through an MPS server. */
static int detect_mps(int device) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMpsEnabled, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return v;
}

static const char *cuda_mode(const epd_engine_t *eng) {
  const cuda_be_t *be = eng->be;
  return be && be->mode == MODE_PERSISTENT ? "persistent" : "launch";
}
static int cuda_device(const epd_engine_t *eng, int rank) {
  const cuda_be_t *be = eng->be;
  int l = local_rank(eng, rank); /* a world rank across nodes */
  if (l < 0 || l >= eng->o.num_ranks) l = rank;
  return be ? be->rank[l].device : l;
}
static int cuda_device_uuid(const epd_engine_t *eng, int rank, uint8_t out[16]) {
  const cuda_be_t *be = eng->be;
  int l = local_rank(eng, rank);
  if (!be || l < 0 || l >= eng->o.num_ranks || !be->rank[l].has_uuid) return 0;
  memcpy(out, be->rank[l].uuid, 16);
  return 1;
}
static const char *cuda_gin(const epd_engine_t *eng) {
  const cuda_be_t *be = eng->be;
  return be && be->net ? eng_cuda_net_gin(be->net) : NULL;
}
static uint64_t cuda_rank_bytes(const epd_engine_t *eng, int rank) {
  const cuda_be_t *be = eng->be;
  int l = local_rank(eng, rank);
  return be && l >= 0 && l < eng->o.num_ranks ? be->rank[l].bytes : 0;
}

/* ---- group state -------------------------------------------------------------------------------- */

/* (mu) The backend state of a group, created on first use. */
static cuda_grp_t *cuda_grp_find(cuda_be_t *be, eng_group_t *grp, int create) {
  cuda_grp_t *fr = NULL;
  for (uint32_t i = 0; i < be->ngrp; i++) {
    if (be->grp[i].used && be->grp[i].grp == grp) return &be->grp[i];
    if (!be->grp[i].used && !fr) fr = &be->grp[i];
  }
  if (!create || !fr) return NULL;
  memset(fr, 0, sizeof *fr);
  fr->used = 1;
  fr->grp = grp;
  fr->g = grp->g;
  fr->renorm = grp->renormalize;
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
    for (unsigned k = 0; k < EPD_BUF_KINDS; k++) fr->off[b][k] = EPD_K_OFF_NONE;
  for (uint32_t i = 0; i < grp->nbufs; i++) /* the kernels see IO kinds only (not the expert weights) */
    if (grp->bufs[i].kind < EPD_BUF_KINDS)
      fr->off[grp->bufs[i].bank][grp->bufs[i].kind] = grp->bufs[i].offset;
  snprintf(fr->name, sizeof fr->name, "%s", grp->name);
  return fr;
}

/* Per-rank device state of a group: kernel context (ncclDevCommCreate: collective, so it runs on a
 * thread per rank through epd_cc_each), map table, completion record, event. */
typedef struct grp_setup_arg {
  cuda_be_t *be;
  cuda_grp_t *cg;
  char err[EPD_MAX_RANKS][200];
} grp_setup_arg_t;

static epd_result_t grank_setup(epd_cc_t *cc, int rank, void *argp) {
  grp_setup_arg_t *a = argp;
  cuda_grp_t *cg = a->cg;
  cuda_grank_t *gr = &cg->rk[rank];
  char *err = a->err[rank];
  size_t errlen = sizeof a->err[rank];
  epd_k_ll_geom_t kg = {.num_ranks = cg->g.num_ranks,
                        .rank = (uint32_t)rank,
                        .num_experts = cg->g.num_experts,
                        .hidden = cg->g.hidden,
                        .topk = cg->g.topk,
                        .max_tokens = cg->g.max_tokens,
                        .slots_per_rank = cg->g.slots_per_rank,
                        .blocks = a->be->ll_blocks};
  cudaError_t e;
  epd_result_t rc;
  if ((rc = epd_k_ll_create(&kg, epd_cc_lsa(cc, rank), cg->win.win[rank], cg->win.ptr[rank], 0, &gr->k, err,
                            errlen)))
    return rc;
  if (cg->have_hwin) {
    epd_k_ht_geom_t hg = {.num_ranks = cg->g.num_ranks,
                          .rank = (uint32_t)rank,
                          .num_experts = cg->g.num_experts,
                          .hidden = cg->g.hidden,
                          .topk = cg->g.topk,
                          .max_tokens = cg->g.max_tokens,
                          .slots_per_rank = cg->g.slots_per_rank,
                          .capacity = cg->g.ht_capacity,
                          .blocks = a->be->ht_sms,
                          .ce_split = a->be->ht_ce_split};
    if ((rc = epd_k_ht_create(&hg, epd_cc_lsa(cc, rank), cg->hwin.win[rank], cg->hwin.ptr[rank], 0, &gr->kh,
                              err, errlen)))
      return rc;
  }
  if ((e = cudaMalloc(&gr->map_dev, epd_k_map_bytes(cg->g.num_experts))))
    return cuda_err(e, "cudaMalloc (expert map)", err, errlen);
  if ((e = cudaHostAlloc((void **)&gr->comp_host, sizeof(epd_comp_t),
                         cudaHostAllocMapped | cudaHostAllocPortable)))
    return cuda_err(e, "cudaHostAlloc (completion)", err, errlen);
  if ((e = cudaHostGetDevicePointer((void **)&gr->comp_dev, gr->comp_host, 0)))
    return cuda_err(e, "cudaHostGetDevicePointer (completion)", err, errlen);
  if ((e = cudaEventCreateWithFlags(&gr->ev, cudaEventDisableTiming)))
    return cuda_err(e, "cudaEventCreate", err, errlen);
  if (a->be->mode == MODE_PERSISTENT) {
    unsigned fl = cudaHostAllocMapped | cudaHostAllocPortable;
    if ((e = cudaHostAlloc((void **)&gr->pctl, sizeof *gr->pctl, fl)) ||
        (e = cudaHostAlloc((void **)&gr->pprog, sizeof *gr->pprog, fl)))
      return cuda_err(e, "cudaHostAlloc (persistent control)", err, errlen);
    memset(gr->pctl, 0, sizeof *gr->pctl);
    memset(gr->pprog, 0, sizeof *gr->pprog);
    if ((e = cudaHostGetDevicePointer((void **)&gr->pctl_dev, gr->pctl, 0)) ||
        (e = cudaHostGetDevicePointer((void **)&gr->pprog_dev, gr->pprog, 0)))
      return cuda_err(e, "cudaHostGetDevicePointer (persistent control)", err, errlen);
    if ((e = cudaStreamCreateWithFlags(&gr->pstream, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&gr->cstream, cudaStreamNonBlocking)) ||
        (e = cudaEventCreateWithFlags(&gr->cev, cudaEventDisableTiming)) ||
        (e = cudaEventCreateWithFlags(&gr->pev, cudaEventDisableTiming)))
      return cuda_err(e, "persistent stream", err, errlen);
    if ((e = cudaMalloc((void **)&gr->dlimit, sizeof *gr->dlimit)) ||
        (e = cudaMemset(gr->dlimit, 0, sizeof *gr->dlimit)))
      return cuda_err(e, "cudaMalloc (persistent stop word)", err, errlen);
    gr->device = a->be->rank[rank].device;
    if (!a->be->rank[rank].president) a->be->rank[rank].president = epd_k_ll_resident_blocks(gr->k);
  }
  gr->ready = 1;
  return EPD_OK;
}

static epd_result_t grank_teardown(epd_cc_t *cc, int rank, void *argp) {
  grp_setup_arg_t *a = argp;
  cuda_grank_t *gr = &a->cg->rk[rank];
  if (gr->k) epd_k_ll_destroy(gr->k);
  if (gr->kh && epd_k_ht_ce_ops(gr->kh))
    EPD_LOGI(EPD_SUB_CUDA,
             "group %s rank %d: %llu dense HT dispatches moved their BF16 rows with the copy engines",
             a->cg->name, rank, (unsigned long long)epd_k_ht_ce_ops(gr->kh));
  if (gr->kh) epd_k_ht_destroy(gr->kh);
  if (gr->map_dev) cudaFree(gr->map_dev);
  if (gr->comp_host) cudaFreeHost(gr->comp_host);
  if (gr->topk_host) cudaFreeHost(gr->topk_host);
  if (gr->ev) cudaEventDestroy(gr->ev);
  if (gr->pctl) cudaFreeHost(gr->pctl);
  if (gr->pprog) cudaFreeHost(gr->pprog);
  if (gr->pev) cudaEventDestroy(gr->pev);
  if (gr->pstream) cudaStreamDestroy(gr->pstream);
  if (gr->cstream) cudaStreamDestroy(gr->cstream);
  if (gr->cev) cudaEventDestroy(gr->cev);
  if (gr->dlimit) cudaFree(gr->dlimit);
  memset(gr, 0, sizeof *gr);
  return EPD_OK;
}

/* Release a group's device state on every rank (nothing may run on it). */
void cuda_grp_teardown(cuda_be_t *be, cuda_grp_t *cg) {
  grp_setup_arg_t *a = calloc(1, sizeof *a);
  if (!a) return; /* leak rather than crash: only under memory exhaustion */
  a->be = be;
  a->cg = cg;
  for (int r = 0; r < be->ndev; r++) {
    cudaSetDevice(be->rank[r].device);
    cudaStreamSynchronize(be->rank[r].stream);
  }
  epd_cc_each(be->cc, grank_teardown, a);
  if (cg->have_win) {
    for (int r = 0; r < be->ndev; r++) be->rank[r].bytes -= cg->win.bytes;
    epd_cc_window_free(be->cc, &cg->win);
  }
  cg->have_win = 0;
  if (cg->have_hwin) {
    for (int r = 0; r < be->ndev; r++) be->rank[r].bytes -= cg->hwin.bytes;
    epd_cc_window_free(be->cc, &cg->hwin);
  }
  cg->have_hwin = 0;
  free(a);
}

/* Create a group's window and kernel contexts on every rank (first client of the group). */
static epd_result_t grp_setup(cuda_be_t *be, cuda_grp_t *cg, char *err, size_t errlen) {
  epd_k_ll_geom_t kg = {.num_ranks = cg->g.num_ranks,
                        .rank = 0,
                        .num_experts = cg->g.num_experts,
                        .hidden = cg->g.hidden,
                        .topk = cg->g.topk,
                        .max_tokens = cg->g.max_tokens,
                        .slots_per_rank = cg->g.slots_per_rank,
                        .blocks = be->ll_blocks};
  uint64_t t0 = eng_now_ns();
  /* HT: a staging window of ht_capacity rows per bank, where the geometry is within the HT limits. */
  const int ht = cg->g.max_tokens <= EPD_K_HT_MAX_TOKENS && cg->g.ht_capacity >= 1 &&
                 cg->g.ht_capacity <= (uint32_t)EPD_K_HT_MAX_TOKENS * EPD_K_MAX_RANKS;
  epd_k_ht_geom_t hg = {.num_ranks = cg->g.num_ranks,
                        .num_experts = cg->g.num_experts,
                        .hidden = cg->g.hidden,
                        .topk = cg->g.topk,
                        .max_tokens = cg->g.max_tokens,
                        .slots_per_rank = cg->g.slots_per_rank,
                        .capacity = cg->g.ht_capacity,
                        .blocks = be->ht_sms}; /* the window's flag arrays are per block */
  const size_t wbytes = epd_k_ll_window_bytes(&kg), hbytes = ht ? epd_k_ht_window_bytes(&hg) : 0;
  /* Ranks sharing a GPU each take a window: say so before NCCL runs out of memory half-way. */
  epd_result_t rc = epd_cc_check_free(be->ndev, be->rank[0].eng->o.devices, -1, wbytes + hbytes,
                                      "the group's LL and HT windows", err, errlen);
  if (rc) return rc;
  if ((rc = epd_cc_window_alloc(be->cc, wbytes, &cg->win, err, errlen))) return rc;
  cg->have_win = 1;
  for (int r = 0; r < be->ndev; r++) be->rank[r].bytes += cg->win.bytes;
  if (ht) {
    if ((rc = epd_cc_window_alloc(be->cc, hbytes, &cg->hwin, err, errlen))) {
      cuda_grp_teardown(be, cg);
      return rc;
    }
    cg->have_hwin = 1;
    for (int r = 0; r < be->ndev; r++) be->rank[r].bytes += cg->hwin.bytes;
  }
  grp_setup_arg_t *a = calloc(1, sizeof *a);
  if (!a) return EPD_ERR_NOMEM;
  a->be = be;
  a->cg = cg;
  rc = epd_cc_each(be->cc, grank_setup, a);
  if (rc) {
    for (int r = 0; r < be->ndev; r++)
      if (a->err[r][0]) {
        snprintf(err, errlen, "rank %d: %s", r, a->err[r]);
        break;
      }
    free(a);
    cuda_grp_teardown(be, cg);
    return rc;
  }
  free(a);
  EPD_LOGI(EPD_SUB_CUDA, "group %s: LL window of %zu bytes per rank and device communicators up in %.1f ms",
           cg->name, cg->win.bytes, (eng_now_ns() - t0) / 1e6);
  return EPD_OK;
}

void cuda_client_release(cuda_client_t *cc) {
  if (cc->queue_registered) cudaHostUnregister(cc->queue);
  if (cc->queue) munmap(cc->queue, cc->queue_bytes);
  if (cc->arena_dev) {
    cu.cuMemUnmap(cc->arena_dev, cc->arena_size);
    cu.cuMemAddressFree(cc->arena_dev, cc->arena_size);
  }
  if (cc->arena_h) cu.cuMemRelease(cc->arena_h);
  if (cc->queue_fd >= 0) close(cc->queue_fd);
  if (cc->arena_fd >= 0) close(cc->arena_fd);
  free(cc);
}

/* ---- backend ops -------------------------------------------------------------------------------- */

static void cuda_destroy(epd_engine_t *eng);

static epd_result_t cuda_create(epd_engine_t *eng, char *err, size_t errlen) {
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev < 1) {
    snprintf(err, errlen, "backend cuda: no usable CUDA device (%s); use backend=host or auto",
             e ? cudaGetErrorString(e) : "0 devices");
    return EPD_ERR_UNSUPPORTED;
  }
  epd_result_t vrc = epd_k_check_nccl_version(err, errlen);
  if (vrc) return vrc;
  char why[300];
  if ((vrc = epd_cc_check_devices(eng->o.num_ranks, eng->o.devices, why, sizeof why))) {
    snprintf(err, errlen, "backend cuda: %s", why);
    return vrc;
  }
  pthread_once(&cu_once, cu_load);
  if (!cu_loaded) {
    snprintf(err, errlen, "backend cuda: the CUDA driver lacks the cuMem entry points (driver too old?)");
    return EPD_ERR_UNSUPPORTED;
  }
  cuda_be_t *be = calloc(1, sizeof *be);
  if (!be) return EPD_ERR_NOMEM;
  be->ngrp = eng->o.max_groups * 2;
  be->grp = calloc(be->ngrp, sizeof *be->grp);
  if (!be->grp) {
    free(be);
    return EPD_ERR_NOMEM;
  }
  eng->be = be;
  be->ndev = eng->o.num_ranks;
  be->timeout_ns = (uint64_t)eng->o.step_timeout_ms * 1000000ull;
  be->mps = detect_mps(0);
  be->spin_ns = eng->o.idle_spin_ns;
  be->ll_blocks = eng->o.ll_blocks;
  const char *m = eng->o.cuda_mode && *eng->o.cuda_mode ? eng->o.cuda_mode : "auto";
  if (strcmp(m, "auto") && strcmp(m, "launch") && strcmp(m, "persistent")) {
    snprintf(err, errlen, "engine.cuda_mode \"%s\" unknown; allowed: auto, launch, persistent", m);
    cuda_destroy(eng);
    return EPD_ERR_INVALID;
  }
  /* Persistent kernels under MPS: without it, the clients' own kernels (other processes, other
   * contexts) would only run in time slices next to kernels that never end. */
  be->mode = be->mps ? MODE_PERSISTENT : MODE_LAUNCH;
  if (!strcmp(m, "launch")) be->mode = MODE_LAUNCH;
  if (!strcmp(m, "persistent")) {
    be->mode = MODE_PERSISTENT;
    if (!be->mps)
      EPD_LOGW(EPD_SUB_CUDA,
               "engine.cuda_mode = persistent without CUDA MPS: client kernels share the GPU with "
               "never-ending kernels only by time slicing");
  }
  if (be->mode == MODE_PERSISTENT && eng->o.nodes > 1) { /* the inter-node stage launches per step */
    EPD_LOGW(EPD_SUB_CUDA, "persistent mode is not used across nodes: launching per step");
    be->mode = MODE_LAUNCH;
  }
  be->ht_sms = eng->o.ht_sms;
  be->ht_ce_split = eng->o.ht_ce_split;
  /* Ranks that share a GPU share its SMs: the blocks of one rank's kernel wait for the other ranks'
   * blocks, so every rank's kernels must be resident at once. Each rank gets its share (the same on
   * every rank of the node: the LL kernels need equal grids). engine.ll_blocks, when set, is already a
   * rank's share. */
  be->share = epd_cc_share(be->ndev, eng->o.devices);
  /* A persistent kernel keeps its SMs (one block per SM): by default it takes half of the launch mode's
   * blocks, so a persistent group and a launched kernel fit together and the clients keep SMs. */
  if (!be->ll_blocks)
    be->ll_blocks =
        (be->mode == MODE_PERSISTENT ? EPD_CUDA_PERSIST_BLOCKS : EPD_K_LL_BLOCKS) / (uint32_t)be->share;
  if (be->share > 1) {
    int nsm = 0;
    cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, eng->o.devices[0]);
    const uint32_t sms = be->ht_sms ? be->ht_sms : EPD_K_HT_BLOCKS;
    if (nsm > 0 && sms * (uint32_t)be->share > (uint32_t)nsm)
      be->ht_sms = (uint32_t)nsm / (uint32_t)be->share;
  }
  for (int r = 0; r < be->ndev; r++) {
    be->rank[r].device = eng->o.devices ? eng->o.devices[r] : r;
    be->rank[r].rank = r;
    be->rank[r].eng = eng;
    /* A client finds its ordinal of this GPU by the UUID: a worker that sees only its own GPU
     * (CUDA_VISIBLE_DEVICES) numbers it 0, whatever the daemon's ordinal. */
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, be->rank[r].device) == cudaSuccess) {
      memcpy(be->rank[r].uuid, prop.uuid.bytes, 16);
      be->rank[r].has_uuid = 1;
    } else {
      cudaGetLastError(); /* not sticky: clear it (clients then get the ordinal only) */
    }
  }
  uint64_t t0 = eng_now_ns();
  epd_result_t rc = eng->o.nodes > 1
                        ? epd_cc_create_world(be->ndev, eng->o.devices, eng->o.nodes, eng->o.node_rank,
                                              eng->o.comm_id, (int)eng->o.rejoined, &be->cc, err, errlen)
                        : epd_cc_create(be->ndev, eng->o.devices, &be->cc, err, errlen);
  if (rc) {
    cuda_destroy(eng);
    return rc;
  }
  if (eng->o.nodes > 1) { /* scale-out: the inter-node stage (engine_cuda_net.c) */
    int devs[EPD_MAX_RANKS];
    for (int r = 0; r < be->ndev; r++) devs[r] = be->rank[r].device;
    if ((rc = eng_cuda_net_create(eng, be->cc, devs, &be->net, err, errlen))) {
      cuda_destroy(eng);
      return rc;
    }
    /* expert maps from the other nodes (net/maps.c) */
    eng->so = &eng_net_scaleout; /* the core's hooks (net/members.c) */
    if ((rc = eng_net_ctl_start(eng, err, errlen))) {
      cuda_destroy(eng);
      return rc;
    }
  }
  EPD_LOGI(EPD_SUB_CUDA,
           "NCCL communicators of %d ranks up in %.1f ms (%s); MPS %s, mode %s, idle spin %llu ns, "
           "LL blocks %u, HT SMs %u",
           be->ndev, (eng_now_ns() - t0) / 1e6,
           be->share > 1 ? "ranks share GPUs: NCCL multi-rank mode" : "a GPU per rank",
           be->mps ? "on" : "off", cuda_mode(eng), (unsigned long long)be->spin_ns, be->ll_blocks,
           be->ht_sms ? be->ht_sms : EPD_K_HT_BLOCKS);
  for (int r = 0; r < be->ndev; r++) {
    cuda_rank_t *rk = &be->rank[r];
    cudaSetDevice(rk->device);
    if ((e = cudaStreamCreateWithFlags(&rk->stream, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&rk->copy_stream, cudaStreamNonBlocking))) {
      cuda_err(e, "cudaStreamCreate", err, errlen);
      cuda_destroy(eng);
      return EPD_ERR_CUDA;
    }
    int pe = pthread_create(&rk->th, NULL, cuda_rank_main, rk);
    if (pe) {
      snprintf(err, errlen, "pthread_create for rank %d: %s", r, strerror(pe));
      cuda_destroy(eng);
      return EPD_ERR_SYSTEM;
    }
    rk->started = 1;
  }
  return EPD_OK;
}

static void cuda_destroy(epd_engine_t *eng) {
  cuda_be_t *be = eng->be;
  if (!be) return;
  atomic_store(&be->stop, 1);
  for (int r = 0; r < EPD_MAX_RANKS; r++)
    if (be->rank[r].started) pthread_join(be->rank[r].th, NULL);
  pthread_mutex_lock(&eng->mu);
  pers_quiesce_all(eng, be);
  pthread_mutex_unlock(&eng->mu);
  if (be->net) eng_net_ctl_stop(eng);
  eng_cuda_net_destroy(be->net);
  be->net = NULL;
  for (int r = 0; r < be->ndev; r++)
    if (be->rank[r].stream) {
      cudaSetDevice(be->rank[r].device);
      cudaStreamSynchronize(be->rank[r].stream);
    }
  pthread_mutex_lock(&eng->mu);
  /* Answer what is still waiting so that a client polling its slot sees an error, not a hang. */
  for (uint32_t i = 0; i < be->ngrp; i++) {
    cuda_grp_t *cg = &be->grp[i];
    if (!cg->used) continue;
    for (int r = 0; r < (int)cg->g.num_ranks; r++)
      if (cg->arrived[r] && !cg->finished[r]) {
        epd_comp_t kc = {.status = EPD_ERR_CLOSED, .peer = -1, .map_version = cg->map_version};
        cuda_complete_rank(eng, cg, r, &kc);
      }
    cuda_grp_teardown(be, cg);
    free(cg->map_img);
    cg->used = 0;
  }
  for (int r = 0; r < be->ndev; r++) cuda_reap(eng, be, &be->rank[r]);
  pthread_mutex_unlock(&eng->mu);
  for (int r = 0; r < be->ndev; r++) {
    if (be->rank[r].stream) {
      cudaSetDevice(be->rank[r].device);
      cudaStreamDestroy(be->rank[r].stream);
      if (be->rank[r].copy_stream) cudaStreamDestroy(be->rank[r].copy_stream);
    }
  }
  epd_cc_destroy(be->cc);
  free(be->grp);
  free(be);
  eng->be = NULL;
}

/* (mu) Allocate the arena on the rank's GPU, map it here, export it as an fd. */
static epd_result_t arena_alloc(cuda_be_t *be, cuda_client_t *cc, uint64_t bytes, int device, char *err,
                                size_t errlen) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  CUresult r;
  if ((r = cu.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
    return cu_err(r, "cuMemGetAllocationGranularity", err, errlen);
  cc->arena_size = (bytes + gran - 1) / gran * gran;
  if ((r = cu.cuMemCreate(&cc->arena_h, cc->arena_size, &prop, 0))) {
    cc->arena_h = 0;
    return cu_err(r, "cuMemCreate (client arena)", err, errlen);
  }
  if ((r = cu.cuMemAddressReserve(&cc->arena_dev, cc->arena_size, gran, 0, 0))) {
    cc->arena_dev = 0;
    return cu_err(r, "cuMemAddressReserve", err, errlen);
  }
  if ((r = cu.cuMemMap(cc->arena_dev, cc->arena_size, 0, cc->arena_h, 0))) {
    cu.cuMemAddressFree(cc->arena_dev, cc->arena_size);
    cc->arena_dev = 0;
    return cu_err(r, "cuMemMap", err, errlen);
  }
  /* Every GPU of the daemon may read and write the arena (weight migration copies slots between
   * ranks' arenas over NVLink); where peer access is missing, only the owning GPU. */
  CUmemAccessDesc acc[EPD_MAX_RANKS];
  memset(acc, 0, sizeof acc);
  int nacc = 0;
  acc[nacc].location = prop.location;
  acc[nacc++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  int reach = 0; /* ranks whose GPU may access it (ranks sharing a GPU count each) */
  for (int d = 0; d < be->ndev; d++) {
    int ok = 0, seen = 0;
    for (int i = 0; i < nacc; i++) seen |= acc[i].location.id == be->rank[d].device;
    if (seen) {
      reach++;
      continue;
    }
    if (cudaDeviceCanAccessPeer(&ok, be->rank[d].device, device) || !ok) continue;
    acc[nacc].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc[nacc].location.id = be->rank[d].device;
    acc[nacc++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    reach++;
  }
  cc->peer_access = reach == be->ndev;
  if (nacc > 1 && cu.cuMemSetAccess(cc->arena_dev, cc->arena_size, acc, (size_t)nacc)) {
    nacc = 1;
    cc->peer_access = be->share == be->ndev; /* every rank on this one GPU */
  }
  if (nacc == 1 && (r = cu.cuMemSetAccess(cc->arena_dev, cc->arena_size, acc, 1)))
    return cu_err(r, "cuMemSetAccess", err, errlen);
  int fd = -1;
  if ((r = cu.cuMemExportToShareableHandle(&fd, cc->arena_h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
    return cu_err(r, "cuMemExportToShareableHandle", err, errlen);
  cc->arena_fd = fd;
  return EPD_OK;
}

static epd_result_t cuda_client_alloc(epd_engine_t *eng, eng_client_t *c, char *err, size_t errlen) {
  cuda_be_t *be = eng->be;
  if (c->grp->g.hidden % 128) {
    snprintf(err, errlen, "hidden %u: the cuda backend needs a multiple of 128", c->grp->g.hidden);
    return EPD_ERR_INVALID;
  }
  /* Registration, cuMem allocation and a group's set-up may synchronise a device: no persistent
   * kernel may run meanwhile (they resume once the group is in steady state again). */
  pers_quiesce_all(eng, be);
  if (be->net) { /* scale-out: no LSA window or kernels (engine_cuda_net.c runs the steps) */
    epd_result_t nrc = eng_cuda_net_attach(be->net, c->grp, err, errlen);
    if (nrc) return nrc;
  }
  cuda_grp_t *cg = be->net ? NULL : cuda_grp_find(be, c->grp, 0);
  int new_grp = !cg && !be->net;
  if (new_grp) {
    if (!(cg = cuda_grp_find(be, c->grp, 1))) {
      snprintf(err, errlen, "too many groups on the cuda backend (max_groups %u)", eng->o.max_groups);
      return EPD_ERR_BUSY;
    }
    epd_result_t src = grp_setup(be, cg, err, errlen);
    if (src) {
      memset(cg, 0, sizeof *cg);
      return src;
    }
  }
  epd_result_t rc;
  cuda_client_t *cc = calloc(1, sizeof *cc);
  if (!cc) {
    rc = EPD_ERR_NOMEM;
    goto fail;
  }
  cc->queue_fd = cc->arena_fd = -1;
  cc->device = be->rank[local_rank(eng, c->rank)].device;
  cc->queue_bytes = c->queue_bytes;
  void *q = NULL;
  cc->queue_fd = eng_client_memfd(c, "queue", c->queue_bytes, &q, err, errlen);
  if (cc->queue_fd < 0) {
    rc = EPD_ERR_SYSTEM;
    goto fail;
  }
  cc->queue = q;
  cudaSetDevice(cc->device);
  cudaError_t e = cudaHostRegister(q, c->queue_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e) {
    rc = cuda_err(e, "cudaHostRegister (queue)", err, errlen);
    goto fail;
  }
  cc->queue_registered = 1;
  void *qd = NULL;
  if ((e = cudaHostGetDevicePointer(&qd, q, 0))) {
    rc = cuda_err(e, "cudaHostGetDevicePointer (queue)", err, errlen);
    goto fail;
  }
  cc->queue_dev = (uint64_t)(uintptr_t)qd;
  /* the IO buffers, then the queue's device twin (zeroed: every slot FREE) */
  cc->dq_offset = (c->arena_bytes + 255) / 256 * 256;
  if ((rc = epd_cc_check_free(be->ndev, eng->o.devices, local_rank(eng, c->rank),
                              cc->dq_offset + sizeof(epd_queue_t), "the client's arena", err, errlen)) ||
      (rc = arena_alloc(be, cc, cc->dq_offset + sizeof(epd_queue_t), cc->device, err, errlen)))
    goto fail;
  cudaStream_t zs = be->rank[local_rank(eng, c->rank)].copy_stream;
  if ((e = cudaMemsetAsync((void *)(uintptr_t)(cc->arena_dev + cc->dq_offset), 0, sizeof(epd_queue_t), zs)) ||
      (e = cudaStreamSynchronize(zs))) {
    rc = cuda_err(e, "cudaMemset (queue twin)", err, errlen);
    goto fail;
  }
  eng_queue_init(c, q); /* fresh memfd pages are zero: every slot FREE */
  cc->queue->dq_offset = cc->dq_offset;
  cc->queue->qflags = be->mode == MODE_PERSISTENT ? EPD_QF_TWIN : 0;
  c->be = cc;
  c->queue = q;
  c->arena = NULL; /* GPU memory: not CPU-visible */
  c->queue_fd = cc->queue_fd;
  c->arena_fd = cc->arena_fd;
  c->arena_bytes = cc->arena_size;
  EPD_LOGD(EPD_SUB_CUDA, "client %llu: queue %llu bytes (host, mapped), arena %zu bytes on GPU %d",
           (unsigned long long)c->id, (unsigned long long)c->queue_bytes, cc->arena_size, cc->device);
  return EPD_OK;
fail:
  if (cc) cuda_client_release(cc);
  if (new_grp) {
    /* The core drops a group its failed first attach created. */
    cuda_grp_teardown(be, cg);
    memset(cg, 0, sizeof *cg);
  }
  return rc;
}

static void cuda_world_remake(epd_engine_t *eng, const uint8_t *id, uint64_t live) {
  cuda_be_t *be = eng->be;
  if (be->net) eng_cuda_net_remake(be->net, id, live);
}

static void cuda_step_off(epd_engine_t *eng, const char *group, uint64_t step, uint32_t node, int what,
                          int peer, int code, uint64_t nodes, const char *why) {
  cuda_be_t *be = eng->be;
  if (be->net) eng_cuda_net_step_off(be->net, group, step, node, what, peer, code, nodes, why);
}

static void cuda_client_leave(epd_engine_t *eng, eng_client_t *c, int lost) {
  cuda_be_t *be = eng->be;
  eng_group_t *grp = c->grp;
  cuda_client_t *cc = c->be;
  int r = c->rank;
  if (be->net) { /* (it marks a lost rank) */
    eng_cuda_net_client_leave(be->net, c, lost);
    return;
  }
  if (lost && grp->on_rank_loss != EPD_RANK_LOSS_MASK) grp->lost[r] = 1;
  cuda_grp_t *cg = cuda_grp_find(be, grp, 0);
  if (!cg || !cc) return;
  if (cg->pstate == PS_RUN) pers_stop(cg, eng_now_ns(), lost ? "a client died" : "a client detached");
  if (cg->phase == PH_COLLECT && cg->arrived[r]) {
    /* Withdraw its slot from the step being collected and fail the peers that wait for it. */
    cg->arrived[r] = 0;
    cg->cc[r] = NULL;
    cg->narrived--;
    cc->busy = 0;
    if (cg->narrived) {
      char why[160];
      snprintf(why, sizeof why, "client %llu of rank %d %s mid-step", (unsigned long long)c->id, r,
               lost ? "died" : "detached");
      cuda_fail_collect(eng, be, cg, EPD_ERR_PEER, r, why);
    }
  } else if (cg->phase == PH_COLLECT && cg->narrived && (lost || grp->on_rank_loss == EPD_RANK_LOSS_MASK) &&
             !(grp->mask >> r & 1)) {
    char why[160];
    snprintf(why, sizeof why, "client %llu of rank %d %s", (unsigned long long)c->id, r,
             lost ? "died" : "detached");
    cuda_fail_collect(eng, be, cg, EPD_ERR_PEER, r, why);
  }
  /* In RUN the step goes on: the daemon still owns the arena, and the peers' kernels need this rank's.
   * Groups that mask go on without the rank from the next step; its arena stays for its parts of them
   * (cuda_client_free). */
  if (!eng_last_client(grp, c)) eng_mask_rank(eng, grp, r, lost ? "its client died" : "its client detached");
}

static void cuda_client_free(epd_engine_t *eng, eng_client_t *c) {
  cuda_be_t *be = eng->be;
  cuda_client_t *cc = c->be;
  eng_group_t *grp = c->grp;
  c->be = NULL;
  c->queue = NULL;
  c->queue_fd = c->arena_fd = -1;
  if (be) {
    /* The group goes away with its last client: its device state follows once nothing runs on it. */
    int empty = 1;
    for (uint32_t r = 0; r < grp->g.num_ranks; r++)
      if (grp->client[r] && grp->client[r] != c) empty = 0;
    cuda_grp_t *cg = cuda_grp_find(be, grp, 0);
    if (cg && empty) cg->grp = NULL; /* cuda_reap() releases its device state once idle */
  }
  if (!cc) return;
  cuda_grp_t *cg = be && !be->net ? cuda_grp_find(be, grp, 0) : NULL;
  if (cg && cg->grp && (grp->mask >> c->rank & 1)) {
    /* a masked rank's parts of the steps run on the memory its last client left (until it rejoins) */
    cuda_client_t *old = cg->ghost[c->rank];
    cc->dead = 1;
    cg->ghost[c->rank] = cc;
    if (!old) return;
    cc = old; /* the older one goes */
  }
  if (cc->busy && be) {
    cc->dead = 1;
    cc->next_dead = be->rank[local_rank(eng, c->rank)].dead;
    be->rank[local_rank(eng, c->rank)].dead = cc;
    return;
  }
  if (be) pers_quiesce_all(eng, be);
  cuda_client_release(cc);
}

/* (mu) The staged map's weight copies: device-to-device between the clients' arenas (peer access over
 * NVLink), issued on the destination rank's copy stream; returns once every copy is done, so the step
 * that switches to the map starts after its weights moved. A copy that cannot run is reported as an
 * event and skipped (as on the host backend). */
static uint64_t cuda_copy_weights(epd_engine_t *eng, eng_group_t *grp) {
  cuda_be_t *be = eng->be;
  uint64_t wb = grp->weight_bytes_per_slot, woff = eng_buf_offset(grp, EPD_BUF_EXPERT_WEIGHTS, 0), bytes = 0;
  int used[EPD_MAX_RANKS] = {0}, dev0 = 0;
  if (grp->nstaged_copies) pers_quiesce_all(eng, be); /* the copies must not wait behind persistent kernels */
  cudaGetDevice(&dev0);                               /* a rank thread calls this: give it its device back */
  for (uint32_t i = 0; i < grp->nstaged_copies && woff != UINT64_MAX; i++) {
    const epd_weight_copy_t *cp = &grp->staged_copies[i];
    /* Scale-out: this node fills its own ranks' slots; a source on another node sent its bytes */
    if (!eng_rank_local(eng, cp->dst_rank)) continue;
    if (!eng_rank_local(eng, cp->src_rank)) {
      bytes += eng_weights_from_node(eng, grp, i);
      continue;
    }
    const int ld = local_rank(eng, (int)cp->dst_rank);
    eng_client_t *src = grp->client[cp->src_rank], *dst = grp->client[cp->dst_rank];
    cuda_client_t *sc = src ? src->be : NULL, *dc = dst ? dst->be : NULL;
    const char *why = !sc || !dc ? "has no attached client"
                      : cp->src_rank != cp->dst_rank && (!sc->peer_access || !dc->peer_access)
                          ? "has no peer access to the other GPU"
                          : NULL;
    cudaError_t e = cudaSuccess;
    if (!why) {
      cudaSetDevice(dc->device);
      e = cudaMemcpyAsync((void *)(uintptr_t)(dc->arena_dev + woff + cp->dst_slot * wb),
                          (const void *)(uintptr_t)(sc->arena_dev + woff + cp->src_slot * wb), wb,
                          cudaMemcpyDeviceToDevice, be->rank[ld].copy_stream);
      if (e) why = cudaGetErrorString(e);
    }
    if (why) {
      eng_emit(eng, "error", grp, (int)cp->dst_rank, 0, 0, 0, grp->steps,
               "group %s: weight copy (%u,%u) -> (%u,%u) skipped: rank %u %s", grp->name, cp->src_rank,
               cp->src_slot, cp->dst_rank, cp->dst_slot, sc ? cp->dst_rank : cp->src_rank, why);
      continue;
    }
    used[ld] = 1;
    bytes += wb;
  }
  for (int r = 0; r < be->ndev; r++) {
    if (!used[r]) continue;
    cudaSetDevice(be->rank[r].device);
    cudaError_t e = cudaStreamSynchronize(be->rank[r].copy_stream);
    if (e) eng_fail(eng, "rank %d: expert-weight copy failed: %s", r, cudaGetErrorString(e));
  }
  cudaSetDevice(dev0);
  return bytes;
}

/* (mu) Weights of a slot to or from host memory (eng_slot_weights_io: scale-out copies between nodes). */
static epd_result_t cuda_arena_io(epd_engine_t *eng, eng_client_t *c, uint64_t off, void *host, uint64_t n,
                                  int write, char *err, size_t errlen) {
  (void)eng;
  cuda_client_t *cc = c->be;
  if (!cc || off + n > cc->arena_size) {
    snprintf(err, errlen, "rank %d: %llu bytes at %llu are outside its arena", c->rank, (unsigned long long)n,
             (unsigned long long)off);
    return EPD_ERR_INVALID;
  }
  int dev0 = 0;
  cudaGetDevice(&dev0);
  cudaSetDevice(cc->device);
  void *d = (void *)(uintptr_t)(cc->arena_dev + off);
  /* waited for on this thread's stream: a pageable host-to-device cudaMemcpy may return before the bytes
   * reach the GPU, and the ops after the switch run on other (non-blocking) streams */
  cudaError_t e =
      cudaMemcpyAsync(write ? d : host, write ? host : d, n,
                      write ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, cudaStreamPerThread);
  cudaError_t w = cudaStreamSynchronize(cudaStreamPerThread);
  if (!e) e = w;
  cudaSetDevice(dev0);
  if (e) {
    snprintf(err, errlen, "rank %d: copying weights %s its arena: %s", c->rank, write ? "into" : "out of",
             cudaGetErrorString(e));
    return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

/* (mu) A map was staged (grp) or draining began (NULL): the kernels stop before the call returns, so
 * the first dispatch that executes after it runs in launch mode (switches the map, or is refused). */
static void cuda_sync_steps(epd_engine_t *eng, eng_group_t *grp) {
  cuda_be_t *be = eng->be;
  if (!be) return;
  if (!grp) {
    pers_quiesce(eng, be, NULL);
    return;
  }
  cuda_grp_t *cg = cuda_grp_find(be, grp, 0);
  if (cg && cg->pstate != PS_OFF) pers_quiesce(eng, be, cg);
}

/* (mu) How grp's steps run now: "persistent" while its kernels serve the queues, else "launch". */
static const char *cuda_group_mode(epd_engine_t *eng, eng_group_t *grp) {
  cuda_be_t *be = eng->be;
  cuda_grp_t *cg = be ? cuda_grp_find(be, grp, 0) : NULL;
  return cg && cg->pstate == PS_RUN ? "persistent" : "launch";
}

/* 1: the CUDA backend is in the program (a test of the static engine library calls it). */
int epd_engine_cuda_linked(void);
int epd_engine_cuda_linked(void) {
  return 1;
}

/* ---- for engine_cuda_net.c (scale-out) ------------------------------------------------------------ */

void *eng_cuda_client_hold(eng_client_t *c) {
  cuda_client_t *cc = c->be;
  if (cc) cc->busy = 1;
  return cc;
}
void eng_cuda_client_unhold(void *h) {
  if (h) ((cuda_client_t *)h)->busy = 0;
}
uint64_t eng_cuda_client_arena(void *h) {
  return h ? (uint64_t)((cuda_client_t *)h)->arena_dev : 0;
}

/* The world communicator's id for the coordinator of a rendezvous, where the backend can start here. */
static int cuda_world_id(uint8_t *id, char *why, size_t whylen) {
  if (!cuda_available(why, whylen)) return -1;
  return epd_cc_unique_id(id, why, whylen) == EPD_OK ? 0 : -1;
}

const eng_backend_ops_t eng_cuda_ops = {
    .name = "cuda",
    .world_id = cuda_world_id,
    .inter_node_transport = "nccl-p2p",
    .masks = 2,
    .renormalizes = 1,
    .available = cuda_available,
    .create = cuda_create,
    .destroy = cuda_destroy,
    .mode = cuda_mode,
    .device = cuda_device,
    .device_uuid = cuda_device_uuid,
    .gin = cuda_gin,
    .rank_bytes = cuda_rank_bytes,
    .client_alloc = cuda_client_alloc,
    .client_leave = cuda_client_leave,
    .world_remake = cuda_world_remake,
    .step_off = cuda_step_off,
    .client_free = cuda_client_free,
    .copy_weights = cuda_copy_weights,
    .arena_io = cuda_arena_io,
    .sync_steps = cuda_sync_steps,
    .group_mode = cuda_group_mode,
};

#endif /* EPD_WITH_CUDA */
