/*
 * engine_cuda_net.c - the CUDA backend across nodes (see engine_cuda_net.h): control frames over the
 * daemon links, the world plan, and the NCCL point-to-point exchange around the cnet_plan.c kernels.
 */
#define _GNU_SOURCE
#include "cuda/engine_cuda_net.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cnet_plan.h"
#include "net/engine_net.h"
#include "net/frame.h"
#include "net/scaleout.h"
#include "core/log.h"

#if EPD_WITH_CUDA
#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "epd_kernels_net.h"

enum { PH_COLLECT = 0, PH_WAIT = 1, PH_RUN = 2 };

/* A node's part of a step (net/frame.h): the step header, nlocal descriptors, then (dispatch, status 0)
 * for each local rank min(num_tokens, max_tokens) rows of top-k ids (int64) followed by as many rows of
 * weights: the world plan's inputs (the tokens themselves move over NCCL). */

/* One local GPU. */
typedef struct cnet_dev {
  int device;
  cudaStream_t stream;
  cudaEvent_t done, xdone;
  uint8_t *xsend, *xrecv; /* nodes x max_tokens rows of H floats (BF16 rows use the first half) */
  size_t xbytes;
  uint8_t *tab_dev, *tab_host; /* the step's tables (device copy, pinned staging) */
  size_t tab_cap;
  cudaStream_t tkstream; /* the local rank's top-k read for the dispatch frame (send_frame) */
  uint8_t *tk_host;      /* pinned: its top-k ids and weights */
  size_t tk_cap;
  size_t off[9]; /* offsets of the 9 tables in the staging buffer */
} cnet_dev_t;

enum { PH_READY = 3 }; /* every frame in, verdict OK: the exchange waits for its turn (schedule) */

/* One group served: the step it collects, decides or runs. */
typedef struct cnet_grp {
  struct cnet_grp *next;
  eng_group_t *grp;
  uint64_t grp_serial; /* grp->serial when taken up (see grp_alive) */
  char gname[EPD_GROUP_NAME_MAX];
  epd_ref_geom_t g;
  int phase;
  uint64_t step;
  int arrived[EPD_MAX_RANKS];
  void *hold[EPD_MAX_RANKS];
  eng_client_t *cl[EPD_MAX_RANKS];
  uint64_t cid[EPD_MAX_RANKS];
  epd_desc_t ldesc[EPD_MAX_RANKS]; /* local ranks' descriptors */
  uint32_t narrived;
  uint64_t first_ns, last_ns, run_ns;
  uint64_t ready_seq, ready_ns;   /* PH_READY: in which order (node 0 orders by it) and since when */
  uint8_t *frame[CNET_MAX_NODES]; /* every node's payload of the step (own included) */
  size_t flen[CNET_MAX_NODES];
  int plan_init;
  epd_ref_plan_t plan[EPD_NUM_BANKS];
  int plan_valid[EPD_NUM_BANKS];
  uint32_t op, bank, fp8, mode, op_version;
  /* Where a step's time goes (logged when the group goes away), per dispatch [0] / combine [1]: last
   * local arrival -> frame sent, -> every frame in, -> work issued (plan, tables, launches), -> GPUs
   * done. */
  uint64_t t_sent, t_in, t_issued;
  uint64_t prof_n[2], prof_ns[2][4];
  uint64_t behind; /* steps that found another group's exchange running or ready (logged with the profile) */
  eng_map_vote_t vote; /* expert-map switches, the protocol of both backends (engine_internal.h) */
  /* The group removed here (its last local client left) while its step was past collect: what the step
   * still needs of the group, kept so that it is decided and its exchange runs as on the other nodes
   * (whose NCCL calls would otherwise find no partner here). Valid if orphan. */
  int orphan;
  epd_expert_map_t omap;
  epd_buffer_desc_t obufs[EPD_MAX_BUFFERS];
  uint32_t onbufs;
} cnet_grp_t;

/* Node 0's word on the next exchange (a payload of group "" numbered by cnet.go_seq): every node runs the
 * groups' exchanges in this order, so the NCCL calls on the world communicator match. */
typedef struct cnet_go {
  char group[EPD_GROUP_NAME_MAX];
  uint64_t step;
} cnet_go_t;

struct cnet {
  epd_engine_t *eng;
  epd_cc_t *cc;
  uint32_t L, nodes, node, W;
  char gin[2048]; /* the start-up GIN probe's line (epd_cc_gin_probe): every local rank's result when they
                     differ */
  cnet_dev_t d[EPD_MAX_RANKS];
  cnet_grp_t *groups; /* the groups served (those with a client on this node) */
  cnet_grp_t *run;    /* the group whose step runs: one exchange at a time */
  uint64_t run_end_ns;
  uint64_t go_seq; /* node 0: exchanges ordered so far; other nodes: the number of the next GO */
  uint64_t ready_ctr;
  cnet_go_t go; /* other nodes: GO go_seq, taken, its step not yet ready here */
  int go_have;
  uint64_t go_ns; /* when go was taken */
  cnet_addr_t addr[EPD_MAX_RANKS];
  cnet_prog_t prog;
  /* A restarted node joins (eng_cuda_net_remake): the world communicator is made again over remake_id by
   * a thread of its own once no exchange runs; meanwhile no exchange starts here. */
  int remake_req, remaking, remake_started;
  int remake_cancel; /* (atomic) give the attempt up: stopping, or a newer id came */
  pthread_t remake_th;
  uint8_t remake_id[EPD_CC_UNIQUE_ID_BYTES];
};
#define REMAKE_LIMIT_MS 60000u /* the restarted node's ranks must join within this */

/* ---- create / destroy ----------------------------------------------------------------------------- */

epd_result_t eng_cuda_net_create(epd_engine_t *eng, epd_cc_t *cc, const int *devices, cnet_t **out, char *err,
                                 size_t errlen) {
  cnet_t *cn = calloc(1, sizeof *cn);
  if (!cn) return EPD_ERR_NOMEM;
  cn->eng = eng;
  cn->cc = cc;
  cn->L = (uint32_t)eng->o.num_ranks;
  cn->nodes = eng->o.nodes;
  cn->node = eng->o.node_rank;
  cn->W = cn->L * cn->nodes;
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_dev_t *d = &cn->d[l];
    d->device = devices[l];
    cudaSetDevice(d->device);
    cudaError_t e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
    if (!e) e = cudaStreamCreateWithFlags(&d->tkstream, cudaStreamNonBlocking);
    if (!e) e = cudaEventCreateWithFlags(&d->done, cudaEventDisableTiming);
    if (!e) e = cudaEventCreateWithFlags(&d->xdone, cudaEventDisableTiming);
    if (!e && epd_k_net_preload() != EPD_OK) e = cudaGetLastError();
    if (e) {
      snprintf(err, errlen, "cudaEventCreate: %s", cudaGetErrorString(e));
      eng_cuda_net_destroy(cn);
      return EPD_ERR_CUDA;
    }
    /* Expansion reads a sibling GPU's receive rows and arenas (peer access over NVLink). */
    for (uint32_t p = 0; p < cn->L; p++) {
      int ok = 0;
      if (p == l || cudaDeviceCanAccessPeer(&ok, devices[l], devices[p]) || !ok) continue;
      if (cudaDeviceEnablePeerAccess(devices[p], 0) != cudaSuccess) cudaGetLastError();
    }
  }
  if (eng->o.gin_probe && !eng->o.rejoined)
    epd_cc_gin_probe(cc, cn->gin, sizeof cn->gin);
  else
    snprintf(cn->gin, sizeof cn->gin, "not probed (%s)",
             eng->o.rejoined ? "this daemon joined a running world: the probe is collective"
                             : "cluster.gin_probe = 0");
  EPD_LOGI(EPD_SUB_CUDA,
           "scale-out: node %u of %u, world ranks %u..%u of %u; inter-node transport nccl-p2p (grouped "
           "ncclSend/ncclRecv on the world communicator, control over the daemon links); GIN: %s",
           cn->node, cn->nodes, cn->node * cn->L, cn->node * cn->L + cn->L - 1, cn->W, cn->gin);
  *out = cn;
  return EPD_OK;
}

static void dev_free(cnet_t *cn) {
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_dev_t *d = &cn->d[l];
    cudaSetDevice(d->device);
    if (d->xsend) cudaFree(d->xsend);
    if (d->xrecv) cudaFree(d->xrecv);
    d->xsend = d->xrecv = NULL;
    d->xbytes = 0;
  }
}

/* (mu) Answer the step's slots and start collecting the next one. */
static void complete_all(cnet_t *cn, cnet_grp_t *cg, int status, int peer, const char *why);

/* (mu) The group is still the one the stage took up: same address and serial (a group removed and
 * created again may get the freed memory back). */
static int grp_alive(cnet_t *cn, cnet_grp_t *cg) {
  for (eng_group_t *g = cn->eng->groups; g; g = g->next)
    if (g == cg->grp && g->serial == cg->grp_serial) return 1;
  return 0;
}

/* (mu) Forget a group (it was removed, or the daemon stops): plans, its queued frames; unlinked and freed.
 * The exchange buffers go with the last group. */
static void group_free(cnet_t *cn, cnet_grp_t *cg) {
  for (int o = 0; o < 2; o++)
    if (cg->prof_n[o]) {
      double n = (double)cg->prof_n[o] * 1000.0;
      EPD_LOGI(
          EPD_SUB_CUDA,
          "group %s: %llu %s steps, mean us: frame sent %.1f, frames in %.1f, plan+issue %.1f, GPU+NCCL %.1f",
          cg->gname, (unsigned long long)cg->prof_n[o], o ? "combine" : "dispatch", cg->prof_ns[o][0] / n,
          cg->prof_ns[o][1] / n, cg->prof_ns[o][2] / n, cg->prof_ns[o][3] / n);
    }
  if (cg->prof_n[0] + cg->prof_n[1])
    EPD_LOGI(EPD_SUB_CUDA, "group %s: %llu steps ready while another group's exchange ran or waited its turn",
             cg->gname, (unsigned long long)cg->behind);
  for (uint32_t l = 0; l < cn->L; l++)
    if (cg->arrived[l]) eng_cuda_client_unhold(cg->hold[l]);
  if (cg->plan_init)
    for (unsigned b = 0; b < EPD_NUM_BANKS; b++) epd_ref_plan_free(&cg->plan[b]);
  for (uint32_t n = 0; n < cn->nodes; n++) free(cg->frame[n]);
  if (cg->orphan) epd_expert_map_free(&cg->omap);
  /* its queued frames go with it, unless the group was made again here meanwhile (they may be the new
   * one's: it rejoined the other nodes at their step) */
  if (cg->gname[0] && !eng_find_group(cn->eng, cg->gname)) epd_net_drop_group(cn->eng->o.net, cg->gname);
  eng_vote_reset(&cg->vote);
  for (cnet_grp_t **pp = &cn->groups; *pp; pp = &(*pp)->next)
    if (*pp == cg) {
      *pp = cg->next;
      break;
    }
  if (cn->run == cg) cn->run = NULL;
  free(cg);
  if (!cn->groups) dev_free(cn);
}

const char *eng_cuda_net_gin(const cnet_t *cn) {
  return cn->gin;
}

void eng_cuda_net_remake(cnet_t *cn, const uint8_t *id) {
  memcpy(cn->remake_id, id, sizeof cn->remake_id);
  cn->remake_req = 1;
  if (cn->remaking) __atomic_store_n(&cn->remake_cancel, 1, __ATOMIC_RELEASE); /* a newer id: that one wins */
  EPD_LOGI(EPD_SUB_CUDA,
           "a restarted node joins the running world: the world communicator is made again once no "
           "exchange runs here");
}

static void *remake_main(void *arg) {
  cnet_t *cn = arg;
  epd_engine_t *eng = cn->eng;
  uint8_t id[EPD_CC_UNIQUE_ID_BYTES];
  pthread_mutex_lock(&eng->mu);
  memcpy(id, cn->remake_id, sizeof id);
  pthread_mutex_unlock(&eng->mu);
  char err[256] = "";
  const uint64_t t0 = eng_now_ns();
  epd_result_t rc = epd_cc_world_remake(cn->cc, id, REMAKE_LIMIT_MS, &cn->remake_cancel, err, sizeof err);
  pthread_mutex_lock(&eng->mu);
  cn->remaking = 0;
  if (!cn->remake_req) epd_net_world_made(eng->o.net);
  if (rc && cn->remake_req)
    EPD_LOGW(EPD_SUB_CUDA, "making the world communicator again: %s; a newer id follows", err);
  else if (rc && !__atomic_load_n(&cn->remake_cancel, __ATOMIC_ACQUIRE))
    eng_fail(eng, "making the world communicator again for a restarted node failed: %s (restart every node)",
             err);
  else if (!rc)
    EPD_LOGI(EPD_SUB_CUDA, "world communicator made again (%u ranks) in %.1f ms: exchanges run again", cn->W,
             (eng_now_ns() - t0) / 1e6);
  pthread_mutex_unlock(&eng->mu);
  return NULL;
}

/* (mu) No exchange runs: the GO order starts again at 0 on every node (none is in flight: every step
 * waited for the restarted node's part), and the thread makes the world communicator again. */
static int remake_start(cnet_t *cn) {
  if (cn->remake_started) pthread_join(cn->remake_th, NULL); /* the last attempt's thread, finished */
  cn->remake_started = 0;
  cn->remake_req = 0;
  cn->remaking = 1;
  __atomic_store_n(&cn->remake_cancel, 0, __ATOMIC_RELEASE);
  cn->go_seq = 0;
  cn->go_have = 0;
  epd_net_drop_group(cn->eng->o.net, "");
  if (pthread_create(&cn->remake_th, NULL, remake_main, cn)) {
    cn->remaking = 0;
    eng_fail(cn->eng, "pthread_create for making the world communicator again failed");
    return 1;
  }
  cn->remake_started = 1;
  return 1;
}

void eng_cuda_net_destroy(cnet_t *cn) {
  if (!cn) return;
  epd_engine_t *eng = cn->eng;
  /* a world communicator being made again: give it up (its comms aborted) and join its thread */
  __atomic_store_n(&cn->remake_cancel, 1, __ATOMIC_RELEASE);
  if (cn->remake_started) pthread_join(cn->remake_th, NULL);
  cn->remake_started = 0;
  /* A step still exchanging gets a short grace; a peer that never answers must not hang the exit. */
  uint64_t t0 = eng_now_ns();
  for (uint32_t l = 0; l < cn->L; l++) {
    if (!cn->d[l].stream) continue;
    cudaSetDevice(cn->d[l].device);
    while (cudaStreamQuery(cn->d[l].stream) == cudaErrorNotReady && eng_now_ns() - t0 < 2000000000ull)
      eng_sleep_ns(1000000);
    if (cudaStreamQuery(cn->d[l].stream) == cudaErrorNotReady) {
      EPD_LOGW(EPD_SUB_CUDA,
               "stopping with an inter-node exchange in flight: aborting the world communicator");
      epd_cc_abort(cn->cc);
    }
    cudaStreamSynchronize(cn->d[l].stream);
  }
  pthread_mutex_lock(&eng->mu);
  while (cn->groups) {
    cnet_grp_t *cg = cn->groups;
    if (cg->narrived) complete_all(cn, cg, EPD_ERR_CLOSED, -1, "the daemon is stopping");
    group_free(cn, cg);
  }
  pthread_mutex_unlock(&eng->mu);
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_dev_t *d = &cn->d[l];
    cudaSetDevice(d->device);
    if (d->stream) cudaStreamDestroy(d->stream);
    if (d->tkstream) cudaStreamDestroy(d->tkstream);
    if (d->tk_host) cudaFreeHost(d->tk_host);
    if (d->done) cudaEventDestroy(d->done);
    if (d->xdone) cudaEventDestroy(d->xdone);
    if (d->tab_dev) cudaFree(d->tab_dev);
    if (d->tab_host) cudaFreeHost(d->tab_host);
  }
  cnet_prog_free(&cn->prog);
  free(cn);
}

/* ---- attach / leave ------------------------------------------------------------------------------- */

epd_result_t eng_cuda_net_attach(cnet_t *cn, eng_group_t *grp, char *err, size_t errlen) {
  if (grp->g.num_ranks != cn->W) {
    snprintf(err, errlen, "group %s has %u ranks, the world %u", grp->name, grp->g.num_ranks, cn->W);
    return EPD_ERR_INVALID;
  }
  return EPD_OK;
}

void eng_cuda_net_client_leave(cnet_t *cn, eng_client_t *c, int lost) {
  cnet_grp_t *cg = cn->groups;
  while (cg && (cg->grp != c->grp || cg->grp_serial != c->grp->serial)) cg = cg->next;
  const int last = eng_last_client(c->grp, c);
  /* a group that stays here without this rank's client: the other nodes fail its steps at once from the
   * first one whose part was not sent (a step past its collection goes on: its part was sent) */
  if (lost && !last)
    eng_net_rank_lost(cn->eng, c->grp, c->rank, cg && cg->phase != PH_COLLECT ? cg->step + 1 : c->grp->steps);
  if (!cg) return;
  if (cg->phase != PH_COLLECT) { /* later phases: the step goes on (memory held) */
    if (last && cg != cn->run && !cg->orphan) {
      /* the group goes with this client: keep what its step needs */
      cg->orphan = epd_ref_map_copy(&cg->omap, &c->grp->map) == EPD_OK;
      cg->onbufs = c->grp->nbufs;
      memcpy(cg->obufs, c->grp->bufs, sizeof cg->obufs[0] * c->grp->nbufs);
      EPD_LOGW(EPD_SUB_CUDA,
               "group %s step %llu: its last client here left after the step's frame was sent: the step's "
               "exchange still runs with the other nodes (results dropped)%s",
               cg->gname, (unsigned long long)cg->step, cg->orphan ? "" : " - out of memory, it cannot");
    }
    return;
  }
  uint32_t l = (uint32_t)c->rank - cn->node * cn->L;
  if (l >= cn->L || !cg->arrived[l] || cg->cl[l] != c) return;
  cg->arrived[l] = 0;
  eng_cuda_client_unhold(cg->hold[l]);
  cg->narrived--;
  if (cg->narrived) {
    char why[160];
    snprintf(why, sizeof why, "client %llu of rank %d %s mid-step", (unsigned long long)c->id, c->rank,
             lost ? "died" : "detached");
    complete_all(cn, cg, EPD_ERR_PEER, c->rank, why);
  }
}

/* ---- completion ----------------------------------------------------------------------------------- */

static void complete_all(cnet_t *cn, cnet_grp_t *cg, int status, int peer, const char *why) {
  epd_engine_t *eng = cn->eng;
  int alive = grp_alive(cn, cg);
  eng_group_t *grp = alive ? cg->grp : NULL;
  uint64_t now = eng_now_ns();
  if (status && grp)
    eng_emit(eng, status == EPD_ERR_TIMEOUT ? "timeout" : "error", grp, peer, 0, 0, 0, cg->step,
             "group %s step %llu: %s", grp->name, (unsigned long long)cg->step, why ? why : "");
  for (uint32_t l = 0; l < cn->L; l++) {
    if (!cg->arrived[l]) continue;
    uint32_t r = cn->node * cn->L + l;
    eng_client_t *c = cg->cl[l];
    if (grp && grp->client[r] == c && c->id == cg->cid[l] && c->queue) {
      epd_slot_t *s = &c->queue->slot[c->next_slot];
      epd_comp_t comp;
      memset(&comp, 0, sizeof comp);
      comp.status = status;
      comp.peer = status ? peer : -1;
      comp.map_version = cg->op_version ? cg->op_version : grp->map.version;
      comp.num_recv = status ? 0 : cn->prog.side[l].num_recv;
      comp.step = cg->step;
      comp.user_tag = cg->ldesc[l].user_tag;
      comp.latency_ns = now > cg->last_ns ? now - cg->last_ns : 0;
      eng_slot_complete(c->queue, s, &comp, grp->map.version);
      c->next_slot = (c->next_slot + 1) % EPD_QUEUE_SLOTS;
      c->ops++;
      uint64_t bytes = 0;
      if (!status)
        for (uint32_t n = 0; n < cn->nodes; n++)
          bytes += (uint64_t)cn->prog.side[l].send_rows[n] * cn->prog.row_bytes;
      eng_record_op(eng, (int)r, cg->ldesc[l].op, status, bytes, comp.latency_ns);
    }
    eng_cuda_client_unhold(cg->hold[l]);
    cg->arrived[l] = 0;
  }
  if (grp) grp->steps++;
  cg->narrived = 0;
  cg->op_version = 0;
  cg->phase = PH_COLLECT;
  for (uint32_t n = 0; n < cn->nodes; n++) {
    free(cg->frame[n]);
    cg->frame[n] = NULL;
  }
  if (cn->run == cg) {
    cn->run = NULL;
    cn->run_end_ns = now;
  }
}

/* ---- collect -------------------------------------------------------------------------------------- */

/* (mu) Every local rank submitted: build this node's frame (own copy kept) and send it to every node. */
static void send_frame(cnet_t *cn, cnet_grp_t *cg) {
  epd_engine_t *eng = cn->eng;
  eng_group_t *grp = cg->grp;
  uint32_t L = cn->L, K = cg->g.topk, M = cg->g.max_tokens;
  const epd_desc_t *d0 = &cg->ldesc[0];
  int same = 1;
  for (uint32_t l = 0; l < L; l++) same &= cg->ldesc[l].op == d0->op && cg->ldesc[l].bank == d0->bank;
  int dispatch = same && eng_op_dispatch(d0->op) && d0->bank < EPD_NUM_BANKS;
  net_step_hdr_t h = {.bad_rank = -1,
                      .nlocal = L,
                      .world = cn->W,
                      .num_experts = cg->g.num_experts,
                      .hidden = cg->g.hidden,
                      .topk = K,
                      .max_tokens = M};
  if (epd_engine_failure(eng)) {
    h.status = EPD_ERR_INTERNAL;
    snprintf(h.why, sizeof h.why, "node %u: the engine failed: %s", cn->node, epd_engine_failure(eng));
  } else if (eng->draining && eng_op_dispatch(d0->op)) {
    h.status = EPD_ERR_DRAINING;
    snprintf(h.why, sizeof h.why, "node %u is draining", cn->node);
  }
  if (dispatch && !h.status) eng_vote_switch(eng, grp, &cg->vote, cg->step);
  eng_vote_report(eng, grp, &cg->vote);
  h.map_version = grp->map.version;
  h.map_hash = epd_net_map_hash(&grp->map);
  h.staged_version = cg->vote.rep.version;
  h.staged_hash = cg->vote.rep_hash;
  size_t len = sizeof h + L * sizeof(net_step_desc_t), rows[EPD_MAX_RANKS] = {0};
  if (dispatch && !h.status)
    for (uint32_t l = 0; l < L; l++) {
      rows[l] = cg->ldesc[l].num_tokens < M ? cg->ldesc[l].num_tokens : M;
      len += rows[l] * K * 12;
    }
  uint8_t *b = calloc(1, len);
  if (!b) {
    h.status = EPD_ERR_NOMEM;
    snprintf(h.why, sizeof h.why, "node %u: out of memory for the step's frame", cn->node);
    len = sizeof h + L * sizeof(net_step_desc_t);
    b = calloc(1, len);
    if (!b) return; /* the other nodes time out on this step */
    memset(rows, 0, sizeof rows);
  }
  net_step_desc_t *dd = (net_step_desc_t *)(b + sizeof h);
  uint8_t *p = (uint8_t *)(dd + L);
  /* Every local rank's top-k ids and weights: asynchronous reads into pinned memory on every GPU at once,
   * then one wait per GPU (two synchronous pageable reads per rank took ~40 us of the dispatch's frame). */
  cudaError_t te[EPD_MAX_RANKS] = {cudaSuccess};
  const uint64_t oi = eng_buf_offset(grp, EPD_BUF_TOPK_IDX, d0->bank),
                 ow = eng_buf_offset(grp, EPD_BUF_TOPK_WEIGHTS, d0->bank);
  for (uint32_t l = 0; l < L; l++) {
    cnet_dev_t *d = &cn->d[l];
    if (!rows[l]) continue;
    const size_t need = rows[l] * K * 12;
    uint64_t arena = eng_cuda_client_arena(cg->hold[l]);
    cudaSetDevice(d->device);
    if (oi == UINT64_MAX || ow == UINT64_MAX) {
      te[l] = cudaErrorInvalidValue;
      continue;
    }
    if (need > d->tk_cap) {
      if (d->tk_host) cudaFreeHost(d->tk_host);
      d->tk_cap = 0;
      if ((te[l] = cudaHostAlloc((void **)&d->tk_host, (size_t)M * K * 12, 0))) {
        d->tk_host = NULL;
        continue;
      }
      d->tk_cap = (size_t)M * K * 12;
    }
    te[l] = cudaMemcpyAsync(d->tk_host, (const void *)(uintptr_t)(arena + oi), rows[l] * K * 8,
                            cudaMemcpyDeviceToHost, d->tkstream);
    if (!te[l])
      te[l] = cudaMemcpyAsync(d->tk_host + rows[l] * K * 8, (const void *)(uintptr_t)(arena + ow),
                              rows[l] * K * 4, cudaMemcpyDeviceToHost, d->tkstream);
  }
  for (uint32_t l = 0; l < L; l++) {
    dd[l] =
        (net_step_desc_t){cg->ldesc[l].op, cg->ldesc[l].bank, cg->ldesc[l].flags, cg->ldesc[l].num_tokens};
    if (!rows[l]) continue;
    cudaError_t e = te[l];
    if (cn->d[l].tk_cap) { /* whatever was issued is waited for, even after an error */
      cudaSetDevice(cn->d[l].device);
      cudaError_t w = cudaStreamSynchronize(cn->d[l].tkstream);
      if (!e) e = w;
    }
    if (!e) memcpy(p, cn->d[l].tk_host, rows[l] * K * 12);
    if (e && !h.status) {
      h.status = EPD_ERR_CUDA;
      h.bad_rank = (int32_t)(cn->node * L + l);
      snprintf(h.why, sizeof h.why, "node %u rank %u: reading top-k from the arena: %s", cn->node,
               cn->node * L + l, cudaGetErrorString(e));
    }
    p += rows[l] * K * 12;
  }
  memcpy(b, &h, sizeof h);
  for (uint32_t n = 0; n < cn->nodes; n++)
    if (n != cn->node) epd_net_send_payload(eng->o.net, n, grp->name, cg->step, b, len);
  free(cg->frame[cn->node]);
  cg->frame[cn->node] = b;
  cg->flen[cn->node] = len;
}

/* (mu) Poll the local clients' slots; 1 if something moved. */
static int collect(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  eng_group_t *grp = cg->grp;
  int moved = 0;
  for (uint32_t l = 0; l < cn->L; l++) {
    uint32_t r = cn->node * cn->L + l;
    eng_client_t *c = grp->client[r];
    if (!c || cg->arrived[l] || !c->queue || !c->be) continue;
    uint32_t k = 0;
    while (k < EPD_QUEUE_SLOTS &&
           eng_slot_state(&c->queue->slot[(c->next_slot + k) % EPD_QUEUE_SLOTS]) != EPD_SLOT_SUBMITTED)
      k++;
    if (k > 0 && k < EPD_QUEUE_SLOTS) c->next_slot = (c->next_slot + k) % EPD_QUEUE_SLOTS;
    epd_slot_t *s = &c->queue->slot[c->next_slot];
    if (eng_slot_state(s) != EPD_SLOT_SUBMITTED) continue;
    if (!cg->narrived) cg->step = grp->steps;
    cg->ldesc[l] = s->desc;
    cg->arrived[l] = 1;
    cg->cl[l] = c;
    cg->cid[l] = c->id;
    cg->hold[l] = eng_cuda_client_hold(c);
    c->hung = 0;
    if (cg->narrived++ == 0) cg->first_ns = now;
    cg->last_ns = now;
    moved = 1;
  }
  if (cg->narrived == cn->L && !eng_net_joining(eng, grp)) {
    cg->step = grp->steps;
    send_frame(cn, cg);
    cg->t_sent = eng_now_ns();
    cg->phase = PH_WAIT;
    return 1;
  }
  if (!cg->narrived) return moved;
  char why[160];
  int lost = eng_lost_rank(grp, why, sizeof why);
  if (lost >= 0) {
    complete_all(cn, cg, EPD_ERR_PEER, lost, why);
    return 1;
  }
  if (now > cg->first_ns && now - cg->first_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    int missing = -1;
    for (uint32_t l = 0; l < cn->L && missing < 0; l++)
      if (!cg->arrived[l]) missing = (int)(cn->node * cn->L + l);
    snprintf(why, sizeof why, "waited %u ms for rank %d", eng->o.step_timeout_ms, missing);
    eng_mark_hung(grp, missing);
    if (missing >= 0) eng->rank[missing].timeouts++;
    complete_all(cn, cg, EPD_ERR_TIMEOUT, missing, why);
    return 1;
  }
  return moved;
}

/* ---- the verdict ---------------------------------------------------------------------------------- */

#define FAIL(st, pr, ...)           \
  do {                              \
    *peer = (pr);                   \
    snprintf(why, wl, __VA_ARGS__); \
    return (st);                    \
  } while (0)

/* (mu) Every node's frame is in: the same verdict on every node. EPD_OK: run the step. */
static int decide(cnet_t *cn, cnet_grp_t *cg, int *peer, char *why, size_t wl) {
  const epd_expert_map_t *map = grp_alive(cn, cg) ? &cg->grp->map : cg->orphan ? &cg->omap : NULL;
  uint32_t L = cn->L, W = cn->W, nodes = cn->nodes, M = cg->g.max_tokens, K = cg->g.topk;
  const net_step_hdr_t *h[CNET_MAX_NODES] = {0};
  epd_desc_t d[EPD_MAX_RANKS];
  int st;
  *peer = -1;
  for (uint32_t n = 0; n < nodes; n++) {
    h[n] = (const net_step_hdr_t *)cg->frame[n];
    if (!h[n]) /* this node could not build its own frame (out of memory) */
      FAIL(EPD_ERR_NOMEM, (int)(n * L), "node %u: out of memory for the step's control frame", n);
    if (cg->flen[n] < sizeof(net_step_hdr_t))
      FAIL(EPD_ERR_PEER, (int)(n * L), "node %u sent a malformed control frame", n);
  }
  net_vote_frames(&cg->vote, h, nodes, cn->node, cg->step);
  /* a node's failure to take part first: unlike the host backend's, these parts carry no routing errors
   * (the world plan below finds those, the same on every node) */
  if ((st = net_frames_status(h, nodes, cn->node, L, peer, why, wl))) return st;
  for (uint32_t n = 0; n < nodes; n++) {
    if ((st = net_frame_geom(h[n], cg->flen[n], 0, n, cn->node, L, W, &cg->g, cg->gname, peer, why, wl)))
      return st;
    net_frame_descs(h[n], n, L, d);
  }
  if ((st = net_check_descs(d, W, peer, why, wl))) return st;
  cg->op = d[0].op;
  cg->bank = d[0].bank;
  cg->fp8 = eng_op_dispatch(cg->op) && (d[0].flags & EPD_DESC_FP8);
  cg->mode = cg->op <= EPD_OP_LL_COMBINE ? EPD_MODE_LL : EPD_MODE_HT;
  const char *mn = cg->mode == EPD_MODE_LL ? "LL" : "HT";
  epd_ref_plan_t *plan = &cg->plan[cg->bank];
  if (!eng_op_dispatch(cg->op)) {
    if (!cg->plan_valid[cg->bank] || plan->mode != (int)cg->mode)
      FAIL(EPD_ERR_STATE, -1, "%s combine of bank %u without a successful %s dispatch of that bank", mn,
           cg->bank, mn);
    cg->op_version = plan->map_version;
    return EPD_OK;
  }
  if ((st = net_check_maps(h, nodes, cn->node, L, h[cn->node]->map_version, h[cn->node]->map_hash, peer, why,
                           wl)))
    return st;
  if (!map) FAIL(EPD_ERR_PEER, -1, "group %s was removed here mid-step", cg->gname);
  epd_ref_in_t in[EPD_MAX_RANKS];
  for (uint32_t n = 0; n < nodes; n++) {
    const uint8_t *p = (const uint8_t *)(net_step_descs(h[n]) + L), *end = cg->frame[n] + cg->flen[n];
    for (uint32_t i = 0; i < L; i++) {
      uint32_t r = n * L + i, rows = d[r].num_tokens < M ? d[r].num_tokens : M;
      if ((size_t)(end - p) < (size_t)rows * K * 12)
        FAIL(EPD_ERR_PEER, (int)r, "node %u sent a truncated dispatch frame", n);
      in[r] = (epd_ref_in_t){d[r].num_tokens, NULL, (const int64_t *)p,
                             (const float *)(p + (size_t)rows * K * 8)};
      p += (size_t)rows * K * 12;
    }
  }
  cg->plan_valid[cg->bank] = 0;
  int bad = -1;
  epd_result_t rc = epd_ref_plan_build(plan, map, in, &bad, why, wl);
  if (rc) {
    *peer = bad;
    return rc;
  }
  plan->mode = (int)cg->mode;
  if (cg->mode == EPD_MODE_HT)
    for (uint32_t r = 0; r < W; r++)
      if (plan->ht_recv[r] > cg->g.ht_capacity)
        FAIL(EPD_ERR_OVERFLOW, (int)r, "rank %u would receive %u tokens, HT capacity %u", r, plan->ht_recv[r],
             cg->g.ht_capacity);
  cg->op_version = plan->map_version;
  return EPD_OK;
}
#undef FAIL

/* ---- running -------------------------------------------------------------------------------------- */

/* (mu) Addresses of the step's buffers on every local rank; 0 or -1 (a buffer is missing). */
static int fill_addr(cnet_t *cn, cnet_grp_t *cg) {
  const int alive = grp_alive(cn, cg);
  const epd_buffer_desc_t *bufs = alive ? cg->grp->bufs : cg->obufs;
  const uint32_t nbufs = alive ? cg->grp->nbufs : cg->orphan ? cg->onbufs : 0;
  uint32_t M = cg->g.max_tokens, H = cg->g.hidden;
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_addr_t *a = &cn->addr[l];
    memset(a, 0, sizeof *a);
    uint64_t base = eng_cuda_client_arena(cg->hold[l]);
    for (uint32_t i = 0; i < nbufs; i++)
      if (bufs[i].bank == cg->bank && bufs[i].kind < EPD_BUF_KINDS)
        a->buf[bufs[i].kind] = base + bufs[i].offset;
    for (uint32_t n = 0; n < cn->nodes; n++) {
      uint64_t o = (uint64_t)n * M * H * 4;
      a->xsend[n] = a->psend[n] = (uint64_t)(uintptr_t)cn->d[l].xsend + o;
      a->xrecv[n] = a->precv[n] = (uint64_t)(uintptr_t)cn->d[l].xrecv + o;
    }
  }
  return 0;
}

/* (mu) Exchange buffers for the group's geometry. */
static epd_result_t dev_alloc(cnet_t *cn, cnet_grp_t *cg, char *err, size_t errlen) {
  size_t need = (size_t)cn->nodes * cg->g.max_tokens * cg->g.hidden * 4;
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_dev_t *d = &cn->d[l];
    if (d->xbytes >= need) continue;
    cudaSetDevice(d->device);
    if (d->xsend) cudaFree(d->xsend);
    if (d->xrecv) cudaFree(d->xrecv);
    d->xsend = d->xrecv = NULL;
    d->xbytes = 0;
    cudaError_t e = cudaMalloc((void **)&d->xsend, need);
    if (!e) e = cudaMalloc((void **)&d->xrecv, need);
    if (e) {
      snprintf(err, errlen, "cudaMalloc of %zu bytes of exchange buffers on GPU %d: %s", need, d->device,
               cudaGetErrorString(e));
      return EPD_ERR_NOMEM;
    }
    d->xbytes = need;
  }
  return EPD_OK;
}

/* Copy the side's 9 tables into the staging buffer and to the GPU (stream-ordered). */
static epd_result_t upload(cnet_dev_t *d, const cnet_side_t *s, char *err, size_t errlen) {
  const cnet_vec_t *v[9] = {&s->pre_rows, &s->post_rows, &s->puts,       &s->pre_off, &s->pre_terms,
                            &s->pre_out,  &s->post_off,  &s->post_terms, &s->post_out};
  size_t total = 0;
  for (int i = 0; i < 9; i++) {
    d->off[i] = total;
    total += (v[i]->len + 255) / 256 * 256;
  }
  if (!total) return EPD_OK;
  cudaError_t e;
  if (total > d->tab_cap) {
    size_t cap = total * 2;
    if (d->tab_dev) cudaFree(d->tab_dev);
    if (d->tab_host) cudaFreeHost(d->tab_host);
    d->tab_dev = d->tab_host = NULL;
    d->tab_cap = 0;
    if ((e = cudaMalloc((void **)&d->tab_dev, cap)) || (e = cudaHostAlloc((void **)&d->tab_host, cap, 0))) {
      snprintf(err, errlen, "allocating %zu bytes of step tables: %s", cap, cudaGetErrorString(e));
      return EPD_ERR_NOMEM;
    }
    d->tab_cap = cap;
  }
  for (int i = 0; i < 9; i++)
    if (v[i]->len) memcpy(d->tab_host + d->off[i], v[i]->p, v[i]->len);
  if ((e = cudaMemcpyAsync(d->tab_dev, d->tab_host, total, cudaMemcpyHostToDevice, d->stream))) {
    snprintf(err, errlen, "cudaMemcpyAsync (step tables): %s", cudaGetErrorString(e));
    return EPD_ERR_CUDA;
  }
  return EPD_OK;
}

#define TAB(d, i, type) ((const type *)((d)->tab_dev + (d)->off[i]))

/* Issue the step on every local GPU (no mu: the clients' memory is held, the program is ours). */
static epd_result_t issue(cnet_t *cn, cnet_grp_t *cg, char *err, size_t errlen) {
  cnet_prog_t *pg = &cn->prog;
  uint32_t L = cn->L, H = cg->g.hidden;
  int combine = pg->combine;
  epd_result_t rc;
  for (uint32_t l = 0; l < L; l++) {
    cnet_dev_t *d = &cn->d[l];
    const cnet_side_t *s = &pg->side[l];
    cudaSetDevice(d->device);
    if ((rc = upload(d, s, err, errlen))) return rc;
    rc = combine
             ? epd_k_net_wsum(TAB(d, 3, uint32_t), TAB(d, 4, epd_k_net_term_t), TAB(d, 5, uint64_t),
                              cnet_count(&s->pre_out, 8), H, 1, d->stream)
             : epd_k_net_rows(TAB(d, 0, epd_k_net_row_t), cnet_count(&s->pre_rows, sizeof(epd_k_net_row_t)),
                              H, (int)cg->fp8, d->stream);
    if (rc) {
      snprintf(err, errlen, "launching the %s kernel on GPU %d failed", combine ? "partial-sum" : "pack",
               d->device);
      return rc;
    }
  }
  /* The exchange: one grouped send/recv per rail peer of every other node. */
  ncclResult_t nr = ncclGroupStart();
  for (uint32_t l = 0; l < L && nr == ncclSuccess; l++) {
    cnet_dev_t *d = &cn->d[l];
    const cnet_side_t *s = &pg->side[l];
    ncclComm_t comm = epd_cc_world(cn->cc, (int)l);
    for (uint32_t n = 0; n < cn->nodes && nr == ncclSuccess; n++) {
      if (n == cn->node) continue;
      size_t o = (size_t)n * cg->g.max_tokens * H * 4;
      int peer = (int)(n * L + l);
      if (s->send_rows[n])
        nr = ncclSend(d->xsend + o, s->send_rows[n] * pg->row_bytes, ncclUint8, peer, comm, d->stream);
      if (nr == ncclSuccess && s->recv_rows[n])
        nr = ncclRecv(d->xrecv + o, s->recv_rows[n] * pg->row_bytes, ncclUint8, peer, comm, d->stream);
    }
  }
  ncclResult_t ne = ncclGroupEnd();
  if (nr == ncclSuccess) nr = ne;
  if (nr == ncclInProgress) { /* world communicators made again are non-blocking (epd_cc_world_remake) */
    const char *why = epd_cc_world_wait(cn->cc, cn->eng->o.step_timeout_ms);
    if (why) {
      snprintf(err, errlen, "ncclSend/ncclRecv: %s", why);
      return EPD_ERR_NCCL;
    }
    nr = ncclSuccess;
  }
  if (nr != ncclSuccess) {
    snprintf(err, errlen, "ncclSend/ncclRecv: %s (%s)", ncclGetErrorString(nr), ncclGetLastError(NULL));
    return EPD_ERR_NCCL;
  }
  /* Expansion reads the siblings' received rows: every GPU's exchange first. */
  if (!combine && L > 1) {
    for (uint32_t l = 0; l < L; l++) {
      cudaSetDevice(cn->d[l].device);
      cudaEventRecord(cn->d[l].xdone, cn->d[l].stream);
    }
    for (uint32_t l = 0; l < L; l++) {
      cudaSetDevice(cn->d[l].device);
      for (uint32_t p = 0; p < L; p++)
        if (p != l) cudaStreamWaitEvent(cn->d[l].stream, cn->d[p].xdone, 0);
    }
  }
  for (uint32_t l = 0; l < L; l++) {
    cnet_dev_t *d = &cn->d[l];
    const cnet_side_t *s = &pg->side[l];
    cudaSetDevice(d->device);
    if (combine) {
      rc = epd_k_net_wsum(TAB(d, 6, uint32_t), TAB(d, 7, epd_k_net_term_t), TAB(d, 8, uint64_t),
                          cnet_count(&s->post_out, 8), H, 0, d->stream);
    } else {
      rc = epd_k_net_rows(TAB(d, 1, epd_k_net_row_t), cnet_count(&s->post_rows, sizeof(epd_k_net_row_t)), H,
                          (int)cg->fp8, d->stream);
      if (!rc)
        rc = epd_k_net_put(TAB(d, 2, epd_k_net_put_t), cnet_count(&s->puts, sizeof(epd_k_net_put_t)),
                           d->stream);
    }
    if (rc) {
      snprintf(err, errlen, "launching the %s kernel on GPU %d failed", combine ? "combine" : "expand",
               d->device);
      return rc;
    }
    cudaError_t e = cudaEventRecord(d->done, d->stream);
    if (e) {
      snprintf(err, errlen, "cudaEventRecord: %s", cudaGetErrorString(e));
      return EPD_ERR_CUDA;
    }
  }
  return EPD_OK;
}

/* (mu) The step's turn (schedule): run it (mu released while issuing). */
static void start_run(cnet_t *cn, cnet_grp_t *cg) {
  epd_engine_t *eng = cn->eng;
  char err[256] = "";
  epd_result_t rc = dev_alloc(cn, cg, err, sizeof err);
  if (!rc) {
    fill_addr(cn, cg);
    const epd_ref_plan_t *plan = &cg->plan[cg->bank];
    rc = eng_op_dispatch(cg->op)
             ? cnet_build_dispatch(&cn->prog, plan, cn->nodes, cn->node, cn->L, (int)cg->mode, (int)cg->fp8,
                                   cn->addr)
             : cnet_build_combine(&cn->prog, plan, cn->nodes, cn->node, cn->L, (int)cg->mode, cn->addr);
    if (rc) snprintf(err, sizeof err, "building the step program failed (%d)", rc);
  }
  if (rc) {
    /* Every node decided to run: a node that cannot makes the others' exchange hang, so fail for good. */
    eng_fail(eng, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, err);
    complete_all(cn, cg, rc, -1, err);
    return;
  }
  cg->phase = PH_RUN;
  cg->run_ns = eng_now_ns();
  cn->run = cg;
  pthread_mutex_unlock(&eng->mu);
  rc = issue(cn, cg, err, sizeof err);
  cg->t_issued = eng_now_ns();
  pthread_mutex_lock(&eng->mu);
  if (rc) {
    EPD_LOGE(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, err);
    eng_fail(eng, "group %s step %llu: inter-node stage: %s", cg->gname, (unsigned long long)cg->step, err);
    epd_cc_abort(cn->cc);
    complete_all(cn, cg, rc, -1, err);
  }
}

/* (mu) The step's GPU work: done, failed, or past the timeout. */
static int poll_run(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  int ready = 1;
  for (uint32_t l = 0; l < cn->L; l++) {
    cudaSetDevice(cn->d[l].device);
    cudaError_t e = cudaEventQuery(cn->d[l].done);
    if (e == cudaErrorNotReady) {
      ready = 0;
      continue;
    }
    if (e != cudaSuccess) {
      EPD_LOGE(EPD_SUB_CUDA, "group %s step %llu: GPU %d failed: %s", cg->gname, (unsigned long long)cg->step,
               cn->d[l].device, cudaGetErrorString(e));
      eng_fail(eng, "GPU %d: inter-node stage failed: %s", cn->d[l].device, cudaGetErrorString(e));
      complete_all(cn, cg, EPD_ERR_CUDA, -1, cudaGetErrorString(e));
      return 1;
    }
  }
  if (ready) {
    eng_group_t *grp = grp_alive(cn, cg) ? cg->grp : NULL;
    if (grp && eng_op_dispatch(cg->op)) {
      /* Statistics count this node's ranks' tokens (as the host backend's scale-out does). */
      const epd_ref_plan_t *p = &cg->plan[cg->bank];
      uint32_t M = cg->g.max_tokens, K = cg->g.topk, S = cg->g.slots_per_rank;
      const uint8_t *f =
          (const uint8_t *)(net_step_descs((const net_step_hdr_t *)cg->frame[cn->node]) + cn->L);
      for (uint32_t l = 0; l < cn->L; l++) {
        uint32_t src = cn->node * cn->L + l;
        const int64_t *idx = (const int64_t *)f;
        f += (size_t)p->num_tokens[src] * K * 12;
        for (uint32_t t = 0; t < p->num_tokens[src]; t++)
          for (uint32_t k = 0; k < K; k++) {
            size_t row = ((size_t)src * M + t) * K + k;
            if (p->dst_rank[row] < 0) continue;
            int64_t e = idx[(size_t)t * K + k];
            if (e >= 0 && e < (int64_t)cg->g.num_experts) grp->expert_tokens[e]++;
            grp->slot_tokens[(size_t)p->dst_rank[row] * S + (size_t)p->dst_slot[row]]++;
          }
      }
      cg->plan_valid[cg->bank] = 1;
    }
    uint64_t tx = 0, rx = 0; /* the exchange's payload counts with the control frames (metrics) */
    for (uint32_t l = 0; l < cn->L; l++)
      for (uint32_t n = 0; n < cn->nodes; n++) {
        tx += (uint64_t)cn->prog.side[l].send_rows[n] * cn->prog.row_bytes;
        rx += (uint64_t)cn->prog.side[l].recv_rows[n] * cn->prog.row_bytes;
      }
    epd_net_add_bytes(eng->o.net, tx, rx);
    int o = !eng_op_dispatch(cg->op);
    uint64_t t_done = eng_now_ns();
    cg->prof_n[o]++;
    cg->prof_ns[o][0] += cg->t_sent - cg->last_ns;
    cg->prof_ns[o][1] += cg->t_in - cg->t_sent;
    cg->prof_ns[o][2] += cg->t_issued - cg->t_in;
    cg->prof_ns[o][3] += t_done - cg->t_issued;
    complete_all(cn, cg, EPD_OK, -1, NULL);
    return 1;
  }
  if (now > cg->run_ns && now - cg->run_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    char why[200];
    snprintf(why, sizeof why,
             "the inter-node exchange did not finish within %u ms (a node stopped mid-step?): world "
             "communicator aborted",
             eng->o.step_timeout_ms);
    EPD_LOGE(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
    epd_cc_abort(cn->cc);
    eng_fail(eng, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
    complete_all(cn, cg, EPD_ERR_TIMEOUT, -1, why);
    return 1;
  }
  return 0;
}

/* (mu) Wait for every node's frame of the step. */
static int wait_frames(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  epd_net_t *net = eng->o.net;
  uint32_t L = cn->L;
  const int alive = grp_alive(cn, cg); /* a removed group's kept step (orphan) has no notices to heed */
  for (uint32_t n = 0; n < cn->nodes; n++) {
    if (n == cn->node || cg->frame[n]) continue;
    uint64_t later; /* node n's part of a later step, came with none of this one's: it skipped this step */
    cg->frame[n] = epd_net_take_payload(net, cg->gname, cg->step, n,
                                        alive ? eng_net_frames_since(cg->grp) : 0, &later, &cg->flen[n]);
    if (cg->frame[n]) continue;
    char why[256];
    int peer = -1;
    const int st = net_part_missing(eng, alive ? cg->grp : NULL, cg->gname, n, cg->step,
                                    eng_op_dispatch(cg->ldesc[0].op), later, &peer, why, sizeof why);
    if (st) {
      EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
      complete_all(cn, cg, st, peer, why);
      return 1;
    }
    if (now > cg->first_ns && now - cg->first_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
      net_silent_why(n, L, eng->o.step_timeout_ms, why, sizeof why);
      EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
      eng->rank[n * L].timeouts++;
      complete_all(cn, cg, EPD_ERR_TIMEOUT, (int)(n * L), why);
      return 1;
    }
    return 0;
  }
  cg->t_in = eng_now_ns();
  char why[256] = "";
  int peer = -1;
  int st = decide(cn, cg, &peer, why, sizeof why);
  if (st) {
    complete_all(cn, cg, st, peer, why);
    return 1;
  }
  int behind = cn->run != NULL;
  for (cnet_grp_t *o = cn->groups; o && !behind; o = o->next) behind = o != cg && o->phase == PH_READY;
  cg->behind += (uint64_t)behind;
  cg->phase = PH_READY;
  cg->ready_seq = ++cn->ready_ctr;
  cg->ready_ns = cg->t_in;
  return 1;
}

/* (mu) The group served for grp (its current incarnation), or NULL. */
static cnet_grp_t *grp_of(cnet_t *cn, const eng_group_t *grp) {
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (cg->grp == grp && cg->grp_serial == grp->serial) return cg;
  return NULL;
}

/* (mu) No exchange runs: start the next one. Node 0 takes the step that became ready first and tells
 * every other node (GO, numbered); the others run steps in GO order only, so every node issues the
 * groups' NCCL calls on the world communicator in the same order. */
static int schedule(cnet_t *cn, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  epd_net_t *net = eng->o.net;

  if (epd_engine_failure(eng)) {
    /* After a failure nothing more is issued here (the world communicator may be aborted, its buffers
     * in use by the failed exchange): ready steps end with the reason, and node 0 orders nothing. */
    char why[256];
    snprintf(why, sizeof why, "node %u: the engine failed: %s", cn->node, epd_engine_failure(eng));
    int moved = 0;
    for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
      if (cg->phase == PH_READY) {
        complete_all(cn, cg, EPD_ERR_INTERNAL, -1, why);
        moved = 1;
      }
    return moved;
  }
  if (cn->remake_req || cn->remaking) return 0; /* the world communicator is being made again */
  if (cn->node == 0) {
    cnet_grp_t *next = NULL;
    for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
      if (cg->phase == PH_READY && (!next || cg->ready_seq < next->ready_seq)) next = cg;
    if (!next) return 0;
    cnet_go_t go;
    memset(&go, 0, sizeof go);
    snprintf(go.group, sizeof go.group, "%s", next->gname);
    go.step = next->step;
    for (uint32_t n = 1; n < cn->nodes; n++)
      if (epd_net_send_payload(net, n, "", cn->go_seq, &go,
                               sizeof go)) /* its link is down: it fails the step */
        EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: the exchange order not sent to node %u (link down)",
                 next->gname, (unsigned long long)next->step, n);
    cn->go_seq++;
    start_run(cn, next);
    return 1;
  }
  if (!cn->go_have) {
    size_t len = 0;
    uint8_t *b = epd_net_take_payload(net, "", cn->go_seq, 0, 0, NULL, &len);
    if (!b) return 0;
    if (len == sizeof cn->go) {
      memcpy(&cn->go, b, sizeof cn->go);
      cn->go.group[sizeof cn->go.group - 1] = 0;
      cn->go_have = 1;
      cn->go_ns = now;
    } else {
      EPD_LOGW(EPD_SUB_CUDA, "node 0 sent a malformed exchange order (%zu bytes): ignored", len);
      cn->go_seq++;
    }
    free(b);
    if (!cn->go_have) return 1;
  }
  /* the step the GO names (a removed group's orphaned step too), else the group's live copy */
  cnet_grp_t *cg = cn->groups;
  while (cg && (strcmp(cg->gname, cn->go.group) || cg->phase != PH_READY || cg->step != cn->go.step))
    cg = cg->next;
  if (!cg) {
    cg = cn->groups;
    while (cg && (strcmp(cg->gname, cn->go.group) || !grp_alive(cn, cg))) cg = cg->next;
  }
  if (cg && cg->phase == PH_READY && cg->step == cn->go.step) {
    cn->go_have = 0;
    cn->go_seq++;
    start_run(cn, cg);
    return 1;
  }
  /* A step this node already finished or failed (or of a group gone here): node 0's exchange has no
   * partner here (it fails by its timeout); the next order may be runnable. */
  const uint64_t cur = !cg                                        ? UINT64_MAX
                       : cg->phase == PH_COLLECT && !cg->narrived ? cg->grp->steps
                                                                  : cg->step;
  if (cur > cn->go.step) {
    EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: node 0 ordered its exchange, but %s here: ignored",
             cn->go.group, (unsigned long long)cn->go.step,
             cg ? "this node is past that step" : "the group is not served");
    cn->go_have = 0;
    cn->go_seq++;
    return 1;
  }
  /* Held past the step timeout and still not ready here (the group was created again here, and its
   * steps count from 0 while node 0's are on): never runnable, so it gives way to the next order. */
  if (now > cn->go_ns && now - cn->go_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    EPD_LOGW(EPD_SUB_CUDA,
             "group %s step %llu: node 0 ordered its exchange, but that step was not ready here within %u ms "
             "(at step %llu here): dropped",
             cn->go.group, (unsigned long long)cn->go.step, eng->o.step_timeout_ms, (unsigned long long)cur);
    cn->go_have = 0;
    cn->go_seq++;
    return 1;
  }
  return 0;
}

/* (mu) A step ready here waits for node 0's order at most the step timeout while no exchange runs (a
 * lost link to node 0 fails it at once). */
static int ready_expired(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  const uint64_t since = cg->ready_ns > cn->run_end_ns ? cg->ready_ns : cn->run_end_ns;
  char why[256], lw[160];
  if (cn->node != 0 && epd_net_node_dead(eng->o.net, 0, lw, sizeof lw)) {
    snprintf(why, sizeof why,
             "the data link to node 0 (ranks 0..%u), which orders the exchanges, is down: %s", cn->L - 1, lw);
    complete_all(cn, cg, EPD_ERR_PEER, 0, why);
    return 1;
  }
  if (cn->node == 0 || cn->run || now <= since ||
      now - since <= (uint64_t)eng->o.step_timeout_ms * 1000000ull)
    return 0;
  snprintf(why, sizeof why, "waited %u ms for node 0 (rank 0) to order the step's exchange",
           eng->o.step_timeout_ms);
  EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
  complete_all(cn, cg, EPD_ERR_TIMEOUT, 0, why);
  return 1;
}

int eng_cuda_net_poll(cnet_t *cn) {
  epd_engine_t *eng = cn->eng;
  int moved = 0;
  pthread_mutex_lock(&eng->mu);
  uint64_t now = eng_now_ns();
  if (cn->remake_req && !cn->run && !cn->remaking) moved |= remake_start(cn);
  /* groups removed (not while their exchange runs) */
  for (cnet_grp_t *cg = cn->groups, *next; cg; cg = next) {
    next = cg->next;
    if (cg != cn->run && !grp_alive(cn, cg) &&
        !(cg->orphan && (cg->phase == PH_WAIT || cg->phase == PH_READY)))
      group_free(cn, cg);
  }
  /* groups with a client here, taken up */
  for (eng_group_t *g = eng->groups; g; g = g->next) {
    if (g->g.num_ranks != cn->W || grp_of(cn, g)) continue;
    int here = 0;
    for (uint32_t l = 0; l < cn->L; l++) here |= g->client[cn->node * cn->L + l] != NULL;
    if (!here) continue;
    cnet_grp_t *cg = calloc(1, sizeof *cg);
    if (!cg) {
      eng_fail(eng, "out of memory for the scale-out state of group %s", g->name);
      break;
    }
    cg->grp = g;
    cg->grp_serial = g->serial;
    cg->g = g->g;
    snprintf(cg->gname, sizeof cg->gname, "%s", g->name);
    cg->phase = PH_COLLECT;
    int ok = 1;
    for (unsigned b = 0; b < EPD_NUM_BANKS; b++) ok &= epd_ref_plan_init(&cg->plan[b], &cg->g) == EPD_OK;
    cg->plan_init = 1;
    if (!ok) eng_fail(eng, "out of memory for the routing plans of group %s", g->name);
    cnet_grp_t **tail = &cn->groups;
    while (*tail) tail = &(*tail)->next;
    *tail = cg;
  }
  if (cn->run) moved |= poll_run(cn, cn->run, now);
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next) {
    if (cg->phase == PH_COLLECT && grp_alive(cn, cg)) moved |= collect(cn, cg, now);
    if (cg->phase == PH_WAIT) moved |= wait_frames(cn, cg, now);
  }
  if (!cn->run) moved |= schedule(cn, now);
  /* after schedule: an order that arrived in time is taken before a ready step is given up */
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (cg->phase == PH_READY) moved |= ready_expired(cn, cg, now);
  pthread_mutex_unlock(&eng->mu);
  return moved;
}

#endif /* EPD_WITH_CUDA */
