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
 * Execution ("launch" mode): one thread per GPU polls the state words of its rank's clients. A submitted
 * slot joins its group's step being collected (the k-th op of each rank is step k, as on the host
 * backend). When every rank has arrived the step is checked on the host (same op and bank on every rank,
 * num_tokens in range), numbered in a backend-wide run sequence, and each rank thread launches its LL
 * kernel on its own stream in run-sequence order (so two groups can never wait on each other across
 * GPUs). The rank thread then polls an event; when the kernel is done it completes the slot from the
 * kernel's epd_comp_t. A group's NCCL window and device communicator are created with its first client
 * (collective over the node-local communicator of cuda_comm.c, which runs a thread per GPU).
 *
 * "persistent" mode: persistent.c.
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

static epd_result_t cuda_err(cudaError_t e, const char *what, char *err, size_t errlen) {
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
static void grp_teardown(cuda_be_t *be, cuda_grp_t *cg) {
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
      grp_teardown(be, cg);
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
    grp_teardown(be, cg);
    return rc;
  }
  free(a);
  EPD_LOGI(EPD_SUB_CUDA, "group %s: LL window of %zu bytes per rank and device communicators up in %.1f ms",
           cg->name, cg->win.bytes, (eng_now_ns() - t0) / 1e6);
  return EPD_OK;
}

static void cuda_client_release(cuda_client_t *cc) {
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

/* ---- step protocol ------------------------------------------------------------------------------ */

/* (mu) Complete rank r's slot of the current step of cg and account it. */
static void complete_rank(epd_engine_t *eng, cuda_grp_t *cg, int r, const epd_comp_t *kc) {
  cuda_client_t *cc = cg->cc[r];
  uint64_t now = eng_now_ns();
  uint64_t lat = cg->last_arrive_ns && now > cg->last_arrive_ns ? now - cg->last_arrive_ns : 0;
  if (cc && !cc->dead && !cg->synth[r]) {
    epd_slot_t *s = &cc->queue->slot[cc->next_slot];
    epd_comp_t c;
    memset(&c, 0, sizeof c);
    c.status = kc ? kc->status : cg->status;
    c.peer = kc ? kc->peer : cg->peer;
    /* The kernel does not know the version: the host set it at the step's dispatch (combine: same). */
    c.map_version = cg->op_map_version      ? cg->op_map_version
                    : kc && kc->map_version ? kc->map_version
                                            : cg->map_version;
    c.num_recv = kc ? kc->num_recv : 0;
    c.step = cg->step;
    c.user_tag = cg->desc[r].user_tag;
    c.latency_ns = lat;
    c.masked = cg->step_mask;
    c.dropped = c.status == EPD_OK ? cg->rk[r].dropped : 0;
    eng_slot_complete(cc->queue, s, &c, cg->map_version);
    cc->next_slot = (cc->next_slot + 1) % EPD_QUEUE_SLOTS;
    if (cg->grp && cg->grp->client[r]) cg->grp->client[r]->ops++;
    eng_record_op(eng, r, cg->desc[r].op, c.status, 0, lat);
  }
  /* Its memory stays until the whole step is done: the peers' kernels may still read or write its
   * arena (HT writes rows into, and pulls partials from, the peers' arenas) after it finished. */
  cg->finished[r] = 1;
  cg->nfinished++;
  if (cg->nfinished < cg->narrived) return;
  /* Everyone who joined is done: the group collects its next step. */
  if (cg->grp) cg->grp->steps++;
  int reset = cg->need_reset;
  cg->phase = PH_COLLECT;
  cg->narrived = cg->nfinished = 0;
  cg->status = 0;
  cg->peer = -1;
  cg->first_arrive_ns = cg->last_arrive_ns = 0;
  for (int i = 0; i < EPD_MAX_RANKS; i++) {
    if (cg->cc[i]) cg->cc[i]->busy = 0;
    cg->arrived[i] = cg->launched[i] = cg->finished[i] = cg->reset_done[i] = cg->synth[i] = 0;
    cg->cc[i] = NULL;
    cg->rk[i].dropped = 0;
  }
  cg->step_mask = cg->grp ? cg->grp->mask : 0;
  cg->need_reset = reset;
}

/* (mu) Fail the step being collected (host verdict) on every rank that joined it. */
static void fail_collect(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int status, int peer,
                         const char *why) {
  cg->status = status;
  cg->peer = peer;
  snprintf(cg->why, sizeof cg->why, "%s", why);
  cg->step_mask = cg->grp ? cg->grp->mask : 0;
  if (cg->grp) {
    eng_emit(eng, status == EPD_ERR_TIMEOUT ? "timeout" : "error", cg->grp, peer, 0, 0, 0, cg->grp->steps,
             "group %s step %llu: %s", cg->name, (unsigned long long)cg->grp->steps, why);
    if (status == EPD_ERR_TIMEOUT && peer >= 0) eng->rank[peer].timeouts++;
  }
  cg->step = cg->grp ? cg->grp->steps : 0;
  cg->phase = PH_RUN;
  cg->run_seq = be->next_run_seq++;
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    const epd_desc_t *d = &cg->desc[r];
    if (cg->arrived[r] && eng_op_dispatch(d->op) && d->bank < EPD_NUM_BANKS)
      cg->disp_refused[d->op == EPD_OP_HT_DISPATCH][d->bank] = 1;
    if (cg->arrived[r] && d->bank < EPD_NUM_BANKS && cg->grp)
      cg->grp->open_banks &= ~(1u << d->bank); /* its combine fails, or failed */
  }
  uint32_t n = cg->narrived;
  for (int r = 0; r < (int)cg->g.num_ranks && n; r++)
    if (cg->arrived[r]) {
      n--;
      complete_rank(eng, cg, r, NULL);
    }
}

/* (mu) Build the host image of the group's active map if it is not current; 0 when it is. */
int map_img_update(cuda_grp_t *cg, eng_group_t *grp) {
  if (cg->map_img_gen && cg->map_img_version == grp->map.version && cg->map_img_mask == grp->mask) return 0;
  const epd_expert_map_t *m = eng_route_map(grp); /* without the masked ranks' replicas */
  void *img = realloc(cg->map_img, epd_k_map_bytes(m->num_experts));
  if (!img) return 1;
  cg->map_img = img;
  cg->map_img_gen++; /* a failed pack leaves no image: built again at the next dispatch */
  if (epd_k_map_pack(img, grp->map.version, m->num_experts, m->nrep, (const uint32_t *)m->rep,
                     EPD_MAX_REPLICAS) != EPD_OK) {
    cg->map_img_mask = UINT64_MAX; /* no image: no mask matches it (a step needs a live rank) */
    return 1;
  }
  cg->map_img_version = grp->map.version;
  cg->map_img_mask = grp->mask;
  return 0;
}

/* Entries of T tokens' top-k (K each) that the map image routes nowhere: experts without a live replica
 * (invalid and repeated entries are not entries; the kernels skip them). */
static uint32_t img_dropped(const void *img, const int64_t *idx, uint32_t T, uint32_t K) {
  const uint32_t *m = img, E = m[1];
  uint32_t n = 0;
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t k = 0; k < K; k++) {
      const int64_t e = idx[(size_t)t * K + k];
      int dup = 0;
      for (uint32_t j = 0; j < k; j++) dup |= idx[(size_t)t * K + j] == e;
      n += e >= 0 && e < (int64_t)E && !dup && m[4 + e] == 0;
    }
  return n;
}

/* (mu) The masked ranks' parts of a step the live ranks agreed on (d0): no tokens, on the memory the
 * rank's last client left or its hung client's (the kernels touch only its outputs). A combine whose
 * dispatch ran with a rank masked since fails: that rank's expert outputs are gone, and the kernels'
 * routing of the bank still counts on them. 1 when the step failed. */
static int masked_parts(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, const epd_desc_t *d0,
                        uint64_t mask) {
  eng_group_t *grp = cg->grp;
  char why[160];
  const uint64_t gone = mask & ~grp->plan_mask[d0->bank];
  if (!eng_op_dispatch(d0->op) && gone) {
    const int r = __builtin_ctzll(gone);
    snprintf(why, sizeof why, "rank %d was masked after the dispatch of bank %u: its expert outputs are gone",
             r, d0->bank);
    fail_collect(eng, be, cg, EPD_ERR_PEER, r, why);
    return 1;
  }
  cuda_client_t *mem[EPD_MAX_RANKS] = {0};
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    if (!(mask >> r & 1)) continue;
    mem[r] = cg->ghost[r] ? cg->ghost[r] : grp->client[r] ? grp->client[r]->be : NULL;
    if (!mem[r] || mem[r]->busy) {
      snprintf(why, sizeof why, "masked rank %u has no memory for its part of the step", r);
      fail_collect(eng, be, cg, EPD_ERR_PEER, (int)r, why);
      return 1;
    }
  }
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    if (!mem[r]) continue;
    cg->desc[r] = *d0;
    cg->desc[r].num_tokens = 0;
    cg->desc[r].user_tag = 0;
    cg->cc[r] = mem[r];
    mem[r]->busy = 1;
    cg->synth[r] = cg->arrived[r] = 1;
    cg->narrived++;
  }
  return 0;
}

/* (mu) All ranks arrived: check the step on the host and hand it to the rank threads. */
static void start_step(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg) {
  eng_group_t *grp = cg->grp;
  const uint64_t mask = grp ? grp->mask : 0;
  uint32_t first = 0; /* the lowest live rank: masked ranks submit nothing */
  while (first + 1 < cg->g.num_ranks && (mask >> first & 1)) first++;
  const epd_desc_t *d0 = &cg->desc[first];
  char why[160];
  /* After a sticky fault nothing more runs on this context: say why instead of launching. */
  if (epd_engine_failure(eng)) {
    snprintf(why, sizeof why, "the engine failed: %s", epd_engine_failure(eng));
    fail_collect(eng, be, cg, EPD_ERR_INTERNAL, -1, why);
    return;
  }
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    if (mask >> r & 1) continue;
    const epd_desc_t *d = &cg->desc[r];
    const int is_ht = d->op == EPD_OP_HT_DISPATCH || d->op == EPD_OP_HT_COMBINE;
    if ((d->op != EPD_OP_LL_DISPATCH && d->op != EPD_OP_LL_COMBINE && !is_ht) || (is_ht && !cg->have_hwin)) {
      snprintf(why, sizeof why, "rank %u: op %u is not available on the cuda backend%s", r, d->op,
               is_ht ? " for this geometry (HT limits: max_tokens, capacity)" : "");
      fail_collect(eng, be, cg, is_ht ? EPD_ERR_UNSUPPORTED : EPD_ERR_INVALID, (int)r, why);
      return;
    }
    const int is_disp = eng_op_dispatch(d->op);
    const int fl = eng_check_flags(d, r, 0, why, sizeof why);
    if (fl) {
      fail_collect(eng, be, cg, fl, (int)r, why);
      return;
    }
    if (d->op != d0->op || d->bank != d0->bank || (is_disp && d->flags != d0->flags)) {
      snprintf(why, sizeof why,
               "rank %u submitted op %u bank %u flags 0x%x, rank %u op %u bank %u flags 0x%x", r, d->op,
               d->bank, d->flags, first, d0->op, d0->bank, d0->flags);
      fail_collect(eng, be, cg, EPD_ERR_MISMATCH, (int)r, why);
      return;
    }
    if (d->bank >= EPD_NUM_BANKS) {
      snprintf(why, sizeof why, "rank %u: bank %u out of range [0, %u)", r, d->bank, EPD_NUM_BANKS);
      fail_collect(eng, be, cg, EPD_ERR_INVALID, (int)r, why);
      return;
    }
    if (is_disp && d->num_tokens > cg->g.max_tokens) {
      snprintf(why, sizeof why, "rank %u: num_tokens %u over max_tokens %u", r, d->num_tokens,
               cg->g.max_tokens);
      fail_collect(eng, be, cg, EPD_ERR_TOO_MANY_TOKENS, (int)r, why);
      return;
    }
  }
  const int ht = d0->op == EPD_OP_HT_DISPATCH || d0->op == EPD_OP_HT_COMBINE;
  if (eng->draining && eng_op_dispatch(d0->op)) {
    fail_collect(eng, be, cg, EPD_ERR_DRAINING, -1, "the daemon is draining");
    return;
  }
  if (!eng_op_dispatch(d0->op) && cg->disp_refused[ht][d0->bank]) {
    snprintf(why, sizeof why, "%s combine of bank %u after a refused %s dispatch of that bank",
             ht ? "HT" : "LL", d0->bank, ht ? "HT" : "LL");
    fail_collect(eng, be, cg, EPD_ERR_STATE, -1, why);
    return;
  }
  if (cg->setup_failed) {
    fail_collect(eng, be, cg, EPD_ERR_CUDA, -1, "the group's GPU resources could not be set up (see log)");
    return;
  }
  if (mask && masked_parts(eng, be, cg, d0, mask)) return;
  if (eng_op_dispatch(d0->op) && grp) {
    eng_apply_staged_map(eng, grp);
    if (map_img_update(cg, grp)) {
      fail_collect(eng, be, cg, EPD_ERR_INTERNAL, -1, "could not build the device expert map");
      return;
    }
    cg->map_version = grp->map.version;
  }
  if (eng_op_dispatch(d0->op)) cg->disp_refused[ht][d0->bank] = 0; /* its kernel records how it went */
  if (d0->op == EPD_OP_LL_DISPATCH) cg->bank_map_version[d0->bank % EPD_NUM_BANKS] = cg->map_version;
  if (grp && eng_op_dispatch(d0->op)) {
    grp->plan_mask[d0->bank] = mask;
    grp->open_banks |= 1u << d0->bank;
  } else if (grp) {
    grp->open_banks &= ~(1u << d0->bank);
    for (uint32_t r = 0; r < cg->g.num_ranks; r++) cg->rk[r].dropped = cg->bank_dropped[d0->bank][r];
  }
  cg->op_map_version = d0->op == EPD_OP_LL_COMBINE && cg->bank_map_version[d0->bank % EPD_NUM_BANKS]
                           ? cg->bank_map_version[d0->bank % EPD_NUM_BANKS]
                           : cg->map_version;
  cg->status = 0;
  cg->peer = -1;
  cg->step = grp ? grp->steps : 0;
  cg->step_mask = mask;
  cg->phase = PH_RUN;
  cg->run_seq = be->next_run_seq++;
}

/* (mu) Slot s of client c of masked rank r was submitted: a dispatch at a step boundary (no combine due,
 * no combine being collected) rejoins the group, which frees the memory its last client left (1: it
 * joins the step being collected); a combine fails at once (0); a dispatch before the boundary waits (0,
 * the slot stays submitted). */
static int rejoin(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, eng_client_t *c, int r, epd_slot_t *s) {
  eng_group_t *grp = cg->grp;
  cuda_client_t *cc = c->be;
  if (!eng_op_dispatch(s->desc.op)) {
    epd_comp_t comp;
    memset(&comp, 0, sizeof comp);
    comp.status = EPD_ERR_PEER;
    comp.peer = r;
    comp.map_version = cg->map_version;
    comp.step = grp->steps;
    comp.user_tag = s->desc.user_tag;
    comp.masked = grp->mask;
    eng_slot_complete(cc->queue, s, &comp, grp->map.version);
    cc->next_slot = (cc->next_slot + 1) % EPD_QUEUE_SLOTS;
    c->ops++;
    eng_record_op(eng, r, s->desc.op, EPD_ERR_PEER, 0, 0);
    EPD_LOGW(EPD_SUB_CUDA, "group %s rank %d is masked: its op %u fails; its next dispatch rejoins",
             grp->name, r, s->desc.op);
    return 0;
  }
  uint32_t first = 0;
  while (first < cg->g.num_ranks && !cg->arrived[first]) first++;
  if (grp->open_banks || (first < cg->g.num_ranks && !eng_op_dispatch(cg->desc[first].op))) return 0;
  eng_unmask_rank(eng, grp, r);
  cuda_client_t *g = cg->ghost[r];
  if (g) { /* released by its rank thread once no step uses it */
    cg->ghost[r] = NULL;
    g->next_dead = be->rank[r].dead;
    be->rank[r].dead = g;
  }
  return 1;
}

/* (mu) Poll rank r's client of group cg; returns 1 if something moved. */
static int collect(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int r, uint64_t now) {
  eng_group_t *grp = cg->grp;
  if (!grp || cg->phase != PH_COLLECT || cg->pstate != PS_OFF) return 0;
  eng_client_t *c = grp->client[r];
  cuda_client_t *cc = c ? c->be : NULL;
  if (cc && !cg->arrived[r]) {
    /* Ring order from the slot after the last one run; a CUDA graph that captured fewer ops than the
     * ring has slots replays the same slots again, so take the first SUBMITTED slot from there on
     * (one stream submits one op at a time: it waits for DONE before the next). */
    uint32_t k = 0;
    while (k < EPD_QUEUE_SLOTS &&
           eng_slot_state(&cc->queue->slot[(cc->next_slot + k) % EPD_QUEUE_SLOTS]) != EPD_SLOT_SUBMITTED)
      k++;
    if (k > 0 && k < EPD_QUEUE_SLOTS) cc->next_slot = (cc->next_slot + k) % EPD_QUEUE_SLOTS;
    epd_slot_t *s = &cc->queue->slot[cc->next_slot];
    int state = eng_slot_state(s);
    if (state == EPD_SLOT_SUBMITTED && (grp->mask >> r & 1) && !rejoin(eng, be, cg, c, r, s)) state = -1;
    if (state == EPD_SLOT_SUBMITTED) {
      cg->desc[r] = s->desc;
      cg->arrived[r] = 1;
      c->hung = 0;
      cg->cc[r] = cc;
      cc->busy = 1;
      if (cg->narrived++ == 0) {
        /* after a host-side step timeout in persistent mode, the wait goes on from when it began */
        cg->first_arrive_ns = cg->pcarry_ns && cg->pcarry_ns < now ? cg->pcarry_ns : now;
        cg->pcarry_ns = 0;
      }
      cg->last_arrive_ns = now;
      cg->arrive_ns[r] = now;
      if (cg->narrived == eng_live_ranks(grp)) {
        /* Time each rank waited for the last arrival (rank r, just now), charged to that peer. */
        for (uint32_t p = 0; p < cg->g.num_ranks; p++)
          if (cg->arrived[p]) eng->rank[p].wait_ns_by_peer[r] += now - cg->arrive_ns[p];
        start_step(eng, be, cg);
        return 1;
      }
    }
  }
  if (!cg->narrived || r != 0) return cg->arrived[r];
  /* Rank 0's thread watches the collection for lost peers and the timeout. */
  char why[128];
  int lost = eng_lost_rank(grp, why, sizeof why);
  if (lost >= 0) {
    fail_collect(eng, be, cg, EPD_ERR_PEER, lost, why);
    return 1;
  }
  /* now was read before mu: another rank thread may have stamped a later first arrival. */
  if (now > cg->first_arrive_ns &&
      now - cg->first_arrive_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    int present[EPD_MAX_RANKS]; /* a masked rank is not waited for */
    for (uint32_t p = 0; p < cg->g.num_ranks; p++) present[p] = cg->arrived[p] || (grp->mask >> p & 1);
    int missing = eng_timeout_rank(eng, present, cg->g.num_ranks, why, sizeof why);
    eng_mark_hung(grp, missing);
    fail_collect(eng, be, cg, EPD_ERR_TIMEOUT, missing, why);
    eng_mask_rank(eng, grp, missing, "hung past engine.step_timeout_ms"); /* groups that mask */
    return 1;
  }
  return 0;
}

/* Launch rank r's part of cg's step (called without mu; cg is pinned by launched[r] && !finished[r]). */
static epd_result_t launch(cuda_be_t *be, cuda_grp_t *cg, int r, char *err, size_t errlen) {
  cuda_rank_t *rk = &be->rank[r];
  cuda_grank_t *gr = &cg->rk[r];
  cuda_client_t *cc = cg->cc[r];
  const epd_desc_t *d = &cg->desc[r];
  cudaError_t e;
  epd_result_t rc;
  if (gr->map_gen != cg->map_img_gen && eng_op_dispatch(d->op)) {
    if ((e = cudaMemcpy(gr->map_dev, cg->map_img, epd_k_map_bytes(cg->g.num_experts),
                        cudaMemcpyHostToDevice)))
      return cuda_err(e, "cudaMemcpy (expert map)", err, errlen);
    gr->map_gen = cg->map_img_gen;
  }
  epd_k_arena_t a;
  a.base = (uint64_t)cc->arena_dev;
  memcpy(a.off, cg->off, sizeof a.off);
  memset(gr->comp_host, 0, sizeof *gr->comp_host);
  gr->comp_host->peer = -1;
  if (d->op == EPD_OP_HT_DISPATCH || d->op == EPD_OP_HT_COMBINE) {
    if (!gr->kh) {
      snprintf(err, errlen, "HT is not available for this group's geometry (max_tokens %u, capacity %u)",
               cg->g.max_tokens, cg->g.ht_capacity);
      return EPD_ERR_UNSUPPORTED;
    }
    epd_k_ht_op_t hop = {.op = d->op,
                         .flags = d->flags,
                         .num_tokens = d->num_tokens,
                         .bank = d->bank,
                         .timeout_ns = be->timeout_ns,
                         .map = gr->map_dev,
                         .slot_tokens = NULL,
                         .comp = gr->comp_dev};
    /* Rows straight into / out of the peers' arenas where every GPU may access every arena of the step;
     * else no rank gets any peer arena (every rank of the step decides the same: staging). */
    int direct = 1;
    for (uint32_t q = 0; q < cg->g.num_ranks && q < EPD_K_MAX_RANKS; q++)
      direct &= cg->cc[q] && cg->cc[q]->peer_access;
    for (uint32_t q = 0; q < cg->g.num_ranks && q < EPD_K_MAX_RANKS; q++) {
      hop.peer_arena[q] = direct ? (uint64_t)cg->cc[q]->arena_dev : 0;
      hop.rank_tokens[q] = cg->desc[q].num_tokens;
    }
    /* dense BF16 rows by the copy engines (the kernels fall back to register copies where they cannot) */
    if (d->op == EPD_OP_HT_DISPATCH && (d->flags & EPD_DESC_HT_DENSE)) hop.copy = EPD_K_HT_COPY_CE;
    if ((rc = epd_k_ht_launch(gr->kh, &a, &hop, rk->stream, err, errlen))) return rc;
  } else {
    epd_k_ll_op_t op = {.op = d->op,
                        .flags = d->flags,
                        .num_tokens = d->num_tokens,
                        .bank = d->bank,
                        .timeout_ns = be->timeout_ns,
                        .map = gr->map_dev,
                        .slot_tokens = NULL,
                        .comp = gr->comp_dev};
    if ((rc = epd_k_ll_launch(gr->k, &a, &op, rk->stream, err, errlen))) return rc;
  }
  /* with ranks masked, the entries this rank's dispatch dropped are counted on the host (rank_main) */
  if (cg->step_mask && eng_op_dispatch(d->op) && !cg->synth[r] && d->num_tokens) {
    const size_t kb = (size_t)cg->g.max_tokens * cg->g.topk * sizeof(int64_t);
    if (!gr->topk_host && (e = cudaMallocHost((void **)&gr->topk_host, kb)))
      return cuda_err(e, "cudaMallocHost (top-k copy)", err, errlen);
    if ((e = cudaMemcpyAsync(
             gr->topk_host, (const void *)(uintptr_t)(a.base + cg->off[d->bank][EPD_BUF_TOPK_IDX]),
             (size_t)d->num_tokens * cg->g.topk * sizeof(int64_t), cudaMemcpyDeviceToHost, rk->stream)))
      return cuda_err(e, "cudaMemcpyAsync (top-k copy)", err, errlen);
  }
  if ((e = cudaEventRecord(gr->ev, rk->stream))) return cuda_err(e, "cudaEventRecord", err, errlen);
  return EPD_OK;
}

/* (mu) The next step this rank should launch: the lowest run sequence among groups in RUN that this
 * rank joined and has not launched yet. */
static cuda_grp_t *next_to_launch(cuda_be_t *be, int r) {
  cuda_grp_t *best = NULL;
  for (uint32_t i = 0; i < be->ngrp; i++) {
    cuda_grp_t *cg = &be->grp[i];
    if (!cg->used || cg->phase != PH_RUN || !cg->arrived[r] || cg->launched[r] || cg->finished[r]) continue;
    if (!best || cg->run_seq < best->run_seq) best = cg;
  }
  return best;
}

/* (mu) Free the group entries nobody uses any more, and clients waiting for their step to end. */
static void reap(epd_engine_t *eng, cuda_be_t *be, cuda_rank_t *rk) {
  for (cuda_client_t **p = &rk->dead; *p;) {
    cuda_client_t *cc = *p;
    if (cc->busy) {
      p = &cc->next_dead;
      continue;
    }
    pers_quiesce_all(eng, be); /* cudaHostUnregister and cuMem releases may wait for the device */
    *p = cc->next_dead;
    cuda_client_release(cc);
  }
  /* A group whose last client left: release its device state once no rank runs anything on it. */
  for (uint32_t i = 0; i < be->ngrp; i++) {
    cuda_grp_t *cg = &be->grp[i];
    if (!cg->used || cg->grp || cg->phase != PH_COLLECT || cg->pstate != PS_OFF) continue;
    int running = 0;
    for (int r = 0; r < be->ndev; r++) running |= be->rank[r].inflight == cg;
    if (running) continue;
    pers_quiesce_all(eng, be);
    /* Windows are deregistered locally (no barrier): every rank is idle on this group. */
    grp_teardown(be, cg);
    for (uint32_t r = 0; r < cg->g.num_ranks; r++)
      if (cg->ghost[r]) cuda_client_release(cg->ghost[r]);
    free(cg->map_img);
    memset(cg, 0, sizeof *cg);
  }
  if (rk) cudaSetDevice(rk->device);
}

static void *rank_main(void *arg) {
  cuda_rank_t *rk = arg;
  epd_engine_t *eng = rk->eng;
  cuda_be_t *be = eng->be;
  int r = rk->rank;
  char err[256];
  eng_rank_thread_init("epd-gpu", r);
  cudaSetDevice(rk->device);
  unsigned idle_polls = 0;
  uint64_t idle_since = eng_now_ns();
  while (!atomic_load(&be->stop)) {
    int busy = 0;
    uint64_t now = eng_now_ns();
    if (be->net) { /* scale-out: engine_cuda_net.c runs every step, on rank thread 0 */
      int moved = r == 0 && eng_cuda_net_poll(be->net);
      pthread_mutex_lock(&eng->mu);
      reap(eng, be, rk);
      pthread_mutex_unlock(&eng->mu);
      if (moved) {
        idle_polls = 0;
        idle_since = now;
      } else if (++idle_polls >= SPIN_POLLS && now - idle_since >= be->spin_ns) {
        eng_sleep_ns(now - idle_since > IDLE_AFTER_NS ? LONG_SLEEP_NS : SHORT_SLEEP_NS);
      }
      continue;
    }
    pthread_mutex_lock(&eng->mu);
    /* 0. persistent mode: rank 0's thread drives every group's kernels and keeps their books */
    if (r == 0)
      for (uint32_t i = 0; i < be->ngrp; i++)
        if (be->grp[i].used) busy |= pers_poll(eng, be, &be->grp[i], rk->device, now);
    /* 1. collect arrivals */
    for (uint32_t i = 0; i < be->ngrp; i++)
      if (be->grp[i].used) busy |= collect(eng, be, &be->grp[i], r, now);
    /* 2. finish the op in flight */
    if (rk->inflight) {
      cuda_grp_t *cg = rk->inflight;
      cudaError_t e = cudaEventQuery(cg->rk[r].ev);
      if (e != cudaErrorNotReady) {
        epd_comp_t kc = *(volatile epd_comp_t *)cg->rk[r].comp_host;
        if (e != cudaSuccess) {
          EPD_LOGE(EPD_SUB_CUDA, "rank %d group %s step %llu: kernel failed: %s", r, cg->name,
                   (unsigned long long)cg->step, cudaGetErrorString(e));
          kc.status = EPD_ERR_CUDA;
          kc.peer = -1;
          eng->rank[r].errors++;
          /* A kernel fault is sticky: this GPU context runs nothing more. */
          eng_fail(eng, "rank %d: kernel failed: %s", r, cudaGetErrorString(e));
        }
        if (kc.status == EPD_ERR_TIMEOUT) {
          cg->need_reset = 1; /* the team's sequence numbers may disagree now */
          eng->rank[r].timeouts++;
          if (cg->grp)
            eng_emit(eng, "timeout", cg->grp, r, 0, 0, 0, cg->step,
                     "group %s step %llu: rank %d timed out "
                     "waiting for rank %d",
                     cg->name, (unsigned long long)cg->step, r, kc.peer);
        }
        rk->inflight = NULL;
        const epd_desc_t *d = &cg->desc[r];
        if (eng_op_dispatch(d->op) && d->bank < EPD_NUM_BANKS) {
          cuda_grank_t *gr = &cg->rk[r];
          gr->dropped = kc.status == EPD_OK && cg->step_mask && !cg->synth[r] && d->num_tokens
                            ? img_dropped(cg->map_img, gr->topk_host, d->num_tokens, cg->g.topk)
                            : 0;
          cg->bank_dropped[d->bank][r] = gr->dropped;
          if (cg->grp) cg->grp->entries_dropped += gr->dropped;
        }
        complete_rank(eng, cg, r, &kc);
        busy = 1;
      }
    }
    /* 3. launch the next step */
    cuda_grp_t *cg = rk->inflight ? NULL : next_to_launch(be, r);
    if (cg) {
      rk->last_launch_ns = now;
      rk->last_launch_grp = cg;
      /* no launched kernel runs next to a persistent one (pers_eligible): stop them, launch once they
       * returned (rank 0's thread takes their groups over) */
      int pers = rk->pblocks > 0;
      for (uint32_t i = 0; i < be->ngrp; i++)
        if (be->grp[i].used && be->grp[i].pstate != PS_OFF) {
          pers = 1;
          if (be->grp[i].pstate == PS_RUN)
            pers_stop(&be->grp[i], now, "another group's kernel is to be launched");
        }
      if (pers) {
        cg = NULL;
        busy = 1;
      }
    }
    int do_reset = 0;
    if (cg) {
      if (cg->need_reset && !cg->reset_done[r]) do_reset = 1;
      int all_reset = 1;
      for (uint32_t p = 0; p < cg->g.num_ranks; p++) all_reset &= cg->reset_done[p];
      if (cg->need_reset && cg->reset_done[r] && !all_reset) cg = NULL; /* wait for the others' reset */
    }
    if (cg && !do_reset) cg->launched[r] = 1;
    reap(eng, be, rk);
    pthread_mutex_unlock(&eng->mu);

    if (cg && do_reset) {
      epd_result_t rc = epd_k_ll_reset(cg->rk[r].k, rk->stream);
      if (rc == EPD_OK && cg->rk[r].kh) rc = epd_k_ht_reset(cg->rk[r].kh, rk->stream);
      cudaError_t e = cudaStreamSynchronize(rk->stream);
      if (rc || e) EPD_LOGE(EPD_SUB_CUDA, "rank %d group %s: LL reset failed", r, cg->name);
      pthread_mutex_lock(&eng->mu);
      cg->reset_done[r] = 1;
      int all = 1;
      for (uint32_t p = 0; p < cg->g.num_ranks; p++) all &= cg->reset_done[p];
      if (all) cg->need_reset = 0;
      pthread_mutex_unlock(&eng->mu);
      continue;
    }
    if (cg) {
      epd_result_t rc = launch(be, cg, r, err, sizeof err);
      pthread_mutex_lock(&eng->mu);
      if (rc) {
        EPD_LOGE(EPD_SUB_CUDA, "rank %d group %s step %llu: launch failed: %s", r, cg->name,
                 (unsigned long long)cg->step, err);
        eng->rank[r].errors++;
        /* Peers' kernels will time out waiting for this rank: reset the team before the next op. */
        cg->need_reset = 1;
        epd_comp_t kc = {.status = rc, .peer = -1, .map_version = cg->map_version};
        complete_rank(eng, cg, r, &kc);
      } else {
        rk->inflight = cg;
        rk->launch_ns = eng_now_ns();
      }
      pthread_mutex_unlock(&eng->mu);
      busy = 1;
    }
    if (busy || rk->inflight) {
      idle_polls = 0;
      idle_since = now;
      continue;
    }
    if (++idle_polls < SPIN_POLLS) continue;
    /* engine.idle_spin_ns: keep spinning (no sleep) this long after the last activity, so the next op
     * of a busy client is seen at once (a core per GPU while clients are active). */
    if (now - idle_since < be->spin_ns) continue;
    eng_sleep_ns(now - idle_since > IDLE_AFTER_NS ? LONG_SLEEP_NS : SHORT_SLEEP_NS);
  }
  return NULL;
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
    int pe = pthread_create(&rk->th, NULL, rank_main, rk);
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
        complete_rank(eng, cg, r, &kc);
      }
    grp_teardown(be, cg);
    free(cg->map_img);
    cg->used = 0;
  }
  for (int r = 0; r < be->ndev; r++) reap(eng, be, &be->rank[r]);
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
    grp_teardown(be, cg);
    memset(cg, 0, sizeof *cg);
  }
  return rc;
}

static void cuda_world_remake(epd_engine_t *eng, const uint8_t *id) {
  cuda_be_t *be = eng->be;
  if (be->net) eng_cuda_net_remake(be->net, id);
}

static void cuda_client_leave(epd_engine_t *eng, eng_client_t *c, int lost) {
  cuda_be_t *be = eng->be;
  eng_group_t *grp = c->grp;
  cuda_client_t *cc = c->be;
  int r = c->rank;
  if (lost && grp->on_rank_loss != EPD_RANK_LOSS_MASK) grp->lost[r] = 1;
  if (be->net) {
    eng_cuda_net_client_leave(be->net, c, lost);
    return;
  }
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
      fail_collect(eng, be, cg, EPD_ERR_PEER, r, why);
    }
  } else if (cg->phase == PH_COLLECT && cg->narrived && (lost || grp->on_rank_loss == EPD_RANK_LOSS_MASK) &&
             !(grp->mask >> r & 1)) {
    char why[160];
    snprintf(why, sizeof why, "client %llu of rank %d %s", (unsigned long long)c->id, r,
             lost ? "died" : "detached");
    fail_collect(eng, be, cg, EPD_ERR_PEER, r, why);
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
    if (cg && empty) cg->grp = NULL; /* reap() releases its device state once idle */
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
    .masks = 1,
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
    .client_free = cuda_client_free,
    .copy_weights = cuda_copy_weights,
    .arena_io = cuda_arena_io,
    .sync_steps = cuda_sync_steps,
    .group_mode = cuda_group_mode,
};

#endif /* EPD_WITH_CUDA */
