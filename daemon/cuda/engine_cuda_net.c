/*
 * engine_cuda_net.c - the CUDA backend across nodes (see engine_cuda_net.h): control frames over the
 * daemon links, the verdict on every node's part, and the order of the exchanges (their running:
 * cnet_run.c; steps the lead gives up: cnet_off.c; the world communicator made again: cnet_world.c).
 */
#define _GNU_SOURCE
#include "cuda/engine_cuda_net.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cnet_internal.h"
#include "cuda/cnet_plan.h"
#include "net/engine_net.h"
#include "net/frame.h"
#include "net/scaleout.h"
#include "core/log.h"

#if EPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/cuda_topk.h"

#include "epd_kernels_net.h"

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
  cn->world_nodes = cn->nodes >= 64 ? ~0ull : (1ull << cn->nodes) - 1;
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

int cnet_grp_alive(cnet_t *cn, cnet_grp_t *cg) {
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
  if (!cn->groups) cnet_dev_free(cn);
}

const char *eng_cuda_net_gin(const cnet_t *cn) {
  return cn->gin;
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
    if (cg->narrived) cnet_complete(cn, cg, EPD_ERR_CLOSED, -1, "the daemon is stopping");
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

/* (mu) Client c leaves the step of its group here: withdrawn from a step being collected (the others'
 * slots fail), kept in one that goes on. */
static void leave_step(cnet_t *cn, cnet_grp_t *cg, eng_client_t *c, int lost, int last) {
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
  cg->hold[l] = NULL;
  cg->narrived--;
  if (cg->narrived) {
    char why[160];
    snprintf(why, sizeof why, "client %llu of rank %d %s mid-step", (unsigned long long)c->id, c->rank,
             lost ? "died" : "detached");
    cnet_complete(cn, cg, EPD_ERR_PEER, c->rank, why);
  }
}

void eng_cuda_net_client_leave(cnet_t *cn, eng_client_t *c, int lost) {
  eng_group_t *grp = c->grp;
  cnet_grp_t *cg = cn->groups;
  while (cg && (cg->grp != grp || cg->grp_serial != grp->serial)) cg = cg->next;
  const int last = eng_last_client(grp, c);
  /* Groups that mask go on without the rank from the next step (as the host backend's: a node's last live
   * rank is lost instead, eng_net_last_live_here). A group that stays here without a lost rank's client:
   * the other nodes fail its steps at once from the first one whose part was not sent (a step past its
   * collection goes on: its part was sent). */
  const int mask = grp->on_rank_loss == EPD_RANK_LOSS_MASK && !eng_net_last_live_here(cn->eng, grp, c->rank);
  const int gone = lost && !mask;
  if (gone) grp->lost[c->rank] = 1;
  if (gone && !last)
    eng_net_rank_lost(cn->eng, grp, c->rank, cg && cg->phase != PH_COLLECT ? cg->step + 1 : grp->steps);
  if (cg) leave_step(cn, cg, c, lost, last);
  if (!last && mask) eng_mask_rank(cn->eng, grp, c->rank, lost ? "its client died" : "its client detached");
}

/* ---- completion ----------------------------------------------------------------------------------- */

/* (mu) Answer client c's current slot (its op d) with comp; bytes for the statistics. */
static void answer(epd_engine_t *eng, eng_group_t *grp, eng_client_t *c, const epd_desc_t *d,
                   const epd_comp_t *comp, uint64_t bytes) {
  eng_slot_complete(c->queue, &c->queue->slot[c->next_slot], comp, grp->map.version);
  c->next_slot = (c->next_slot + 1) % EPD_QUEUE_SLOTS;
  c->ops++;
  eng_record_op(eng, c->rank, d->op, comp->status, bytes, comp->latency_ns);
}

void cnet_complete(cnet_t *cn, cnet_grp_t *cg, int status, int peer, const char *why) {
  epd_engine_t *eng = cn->eng;
  int alive = cnet_grp_alive(cn, cg);
  eng_group_t *grp = alive ? cg->grp : NULL;
  uint64_t now = eng_now_ns();
  /* the step's op, its mask and the bank it leaves open: a dispatch that ran waits for its combine (a
   * masked rank rejoins only when none does); one that failed has no combine to wait for */
  const epd_desc_t *op = NULL;
  for (uint32_t l = 0; l < cn->L && !op; l++)
    if (cg->arrived[l]) op = &cg->ldesc[l];
  const uint64_t mask = cg->phase == PH_COLLECT && grp ? grp->mask : cg->sent_mask;
  const int dispatch = op && eng_op_dispatch(op->op);
  if (grp && op && op->bank < EPD_NUM_BANKS) {
    if (!status && dispatch) {
      grp->plan_mask[op->bank] = mask;
      grp->open_banks |= 1u << op->bank;
    } else {
      grp->open_banks &= ~(1u << op->bank);
    }
  }
  const epd_ref_plan_t *plan = op && !status && cg->bank < EPD_NUM_BANKS ? &cg->plan[cg->bank] : NULL;
  if (status && grp)
    eng_emit(eng, status == EPD_ERR_TIMEOUT ? "timeout" : "error", grp, peer, 0, 0, 0, cg->step,
             "group %s step %llu: %s", grp->name, (unsigned long long)cg->step, why ? why : "");
  for (uint32_t l = 0; l < cn->L; l++) {
    if (!cg->arrived[l]) continue;
    uint32_t r = cn->node * cn->L + l;
    eng_client_t *c = cg->cl[l];
    if (grp && grp->client[r] == c && c->id == cg->cid[l] && c->queue) {
      epd_comp_t comp;
      memset(&comp, 0, sizeof comp);
      comp.status = status;
      comp.peer = status ? peer : -1;
      comp.map_version = cg->op_version ? cg->op_version : grp->map.version;
      comp.num_recv = status ? 0 : cn->prog.side[l].num_recv;
      comp.step = cg->step;
      comp.user_tag = cg->ldesc[l].user_tag;
      comp.latency_ns = now > cg->last_ns ? now - cg->last_ns : 0;
      comp.masked = mask;
      comp.dropped = plan && plan->dropped ? plan->dropped[r] : 0;
      if (plan && dispatch) grp->entries_dropped += comp.dropped;
      uint64_t bytes = 0;
      if (!status)
        for (uint32_t n = 0; n < cn->nodes; n++)
          bytes += (uint64_t)cn->prog.side[l].send_rows[n] * cn->prog.row_bytes;
      answer(eng, grp, c, &cg->ldesc[l], &comp, bytes);
    }
    eng_cuda_client_unhold(cg->hold[l]);
    cg->hold[l] = NULL;
    cg->arrived[l] = 0;
  }
  if (grp) grp->steps++;
  /* the lead decides which steps do not run: every other node hears of one that failed here */
  if (cnet_leads(cn) && status && cg->phase != PH_RUN)
    cnet_off_raise(cn, cg, cg->step + 1, status, peer,
                   why ? why : "failed on the node that orders the exchanges", mask);
  cg->wd_ns = 0;
  cg->ordered_to = 0;
  cg->ready_told = 0;
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
  /* Masked ranks of this node take no part: their descriptors are the first live rank's, with no tokens
   * (eng_net_last_live_here keeps one live). */
  const uint64_t mask = grp->mask;
  uint32_t first = 0;
  while (first + 1 < L && (mask >> (cn->node * L + first) & 1)) first++;
  for (uint32_t l = 0; l < L; l++)
    if (mask >> (cn->node * L + l) & 1) {
      cg->ldesc[l] = cg->ldesc[first];
      cg->ldesc[l].num_tokens = 0;
      cg->ldesc[l].user_tag = 0;
    }
  cg->sent_mask = mask;
  eng_net_sent(grp, cg->step, mask);
  const epd_desc_t *d0 = &cg->ldesc[first];
  int same = 1;
  for (uint32_t l = 0; l < L; l++) same &= cg->ldesc[l].op == d0->op && cg->ldesc[l].bank == d0->bank;
  int dispatch = same && eng_op_dispatch(d0->op) && d0->bank < EPD_NUM_BANKS;
  net_step_hdr_t h = {.bad_rank = -1,
                      .nlocal = L,
                      .world = cn->W,
                      .num_experts = cg->g.num_experts,
                      .hidden = cg->g.hidden,
                      .topk = K,
                      .max_tokens = M,
                      .mask = mask};
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
    uint64_t arena = eng_cuda_client_arena(cg->hold[l]);
    cudaSetDevice(d->device);
    if (oi == UINT64_MAX || ow == UINT64_MAX) {
      te[l] = cudaErrorInvalidValue;
      continue;
    }
    te[l] = cuda_topk_read((void **)&d->tk_host, &d->tk_cap, (size_t)M * K * 12, arena + oi, arena + ow,
                           rows[l], K, d->tkstream);
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
  for (uint32_t n = 0; n < cn->nodes; n++) /* a node out of the steps gets none */
    if (n != cn->node && !net_node_masked(eng, mask, n))
      epd_net_send_payload(eng->o.net, n, grp->name, cg->step, b, len);
  free(cg->frame[cn->node]);
  cg->frame[cn->node] = b;
  cg->flen[cn->node] = len;
}

/* (mu) Slot s of client c of masked rank r was submitted: a dispatch at a step boundary (no combine due,
 * none being collected) rejoins the group from this step (1); a combine fails at once (-1); a dispatch
 * before the boundary waits (0, the slot stays submitted). */
static int rejoin(cnet_t *cn, cnet_grp_t *cg, eng_client_t *c, int r, const epd_slot_t *s) {
  eng_group_t *grp = cg->grp;
  const epd_desc_t *d = &s->desc;
  if (!eng_op_dispatch(d->op)) {
    epd_comp_t comp = {.status = EPD_ERR_PEER,
                       .peer = r,
                       .map_version = grp->map.version,
                       .step = grp->steps,
                       .user_tag = d->user_tag,
                       .masked = grp->mask};
    answer(cn->eng, grp, c, d, &comp, 0);
    EPD_LOGW(EPD_SUB_CUDA, "group %s rank %d is masked: its op %u fails; its next dispatch rejoins",
             grp->name, r, d->op);
    return -1;
  }
  const epd_desc_t *other = NULL;
  for (uint32_t l = 0; l < cn->L && !other; l++)
    if (cg->arrived[l]) other = &cg->ldesc[l];
  if (grp->open_banks || (other && !eng_op_dispatch(other->op))) return 0;
  eng_unmask_rank(cn->eng, grp, r);
  return 1;
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
    if (grp->mask >> r & 1) {
      const int j = rejoin(cn, cg, c, (int)r, s);
      moved |= j != 0;
      if (j <= 0) continue;
    }
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
  uint32_t live = 0; /* masked ranks are not waited for */
  for (uint32_t l = 0; l < cn->L; l++) live += !(grp->mask >> (cn->node * cn->L + l) & 1);
  if (live && cg->narrived == live && !eng_net_joining(eng, grp)) {
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
    cnet_complete(cn, cg, EPD_ERR_PEER, lost, why);
    return 1;
  }
  if (now > cg->first_ns && now - cg->first_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    int missing = -1;
    for (uint32_t l = 0; l < cn->L && missing < 0; l++)
      if (!cg->arrived[l] && !(grp->mask >> (cn->node * cn->L + l) & 1))
        missing = (int)(cn->node * cn->L + l);
    snprintf(why, sizeof why, "waited %u ms for rank %d", eng->o.step_timeout_ms, missing);
    eng_mark_hung(grp, missing);
    if (missing >= 0) eng->rank[missing].timeouts++;
    cnet_complete(cn, cg, EPD_ERR_TIMEOUT, missing, why);
    /* groups that mask go on without it (not a node's last live rank: eng_net_last_live_here) */
    if (missing >= 0 && !eng_net_last_live_here(eng, grp, missing))
      eng_mask_rank(eng, grp, missing, "hung past engine.step_timeout_ms");
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
  const epd_expert_map_t *map = cnet_grp_alive(cn, cg) ? &cg->grp->map : cg->orphan ? &cg->omap : NULL;
  uint32_t L = cn->L, W = cn->W, nodes = cn->nodes, M = cg->g.max_tokens, K = cg->g.topk;
  const net_step_hdr_t *h[CNET_MAX_NODES] = {0};
  epd_desc_t d[EPD_MAX_RANKS];
  int st;
  *peer = -1;
  for (uint32_t n = 0; n < nodes; n++) {
    h[n] = (const net_step_hdr_t *)cg->frame[n];
    if (!h[n] && n == cn->node) /* this node could not build its own frame (out of memory) */
      FAIL(EPD_ERR_NOMEM, (int)(n * L), "node %u: out of memory for the step's control frame", n);
    if (!h[n]) continue; /* a node out of the step (wait_frames) */
    if (cg->flen[n] < sizeof(net_step_hdr_t))
      FAIL(EPD_ERR_PEER, (int)(n * L), "node %u sent a malformed control frame", n);
  }
  net_vote_frames(&cg->vote, h, nodes, cn->node, cg->step);
  /* a node's failure to take part first: unlike the host backend's, these parts carry no routing errors
   * (the world plan below finds those, the same on every node) */
  if ((st = net_frames_status(h, nodes, cn->node, L, peer, why, wl))) return st;
  for (uint32_t n = 0; n < nodes; n++) {
    if (!h[n]) { /* the ranks of a node out of the step take part as masked ranks do */
      for (uint32_t r = n * L; r < n * L + L; r++) {
        d[r] = cg->ldesc[0];
        d[r].num_tokens = 0;
        d[r].user_tag = 0;
      }
      continue;
    }
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
    /* as on one node (launch.c): the expert outputs of a rank masked since the dispatch are gone */
    const uint64_t gone = cg->sent_mask & ~cg->plan_mask[cg->bank];
    if (gone)
      FAIL(EPD_ERR_PEER, __builtin_ctzll(gone),
           "rank %d was masked after the dispatch of bank %u: its expert outputs are gone",
           __builtin_ctzll(gone), cg->bank);
    cg->op_version = plan->map_version;
    return EPD_OK;
  }
  if ((st = net_check_maps(h, nodes, cn->node, L, h[cn->node]->map_version, h[cn->node]->map_hash, peer, why,
                           wl)))
    return st;
  if (!map) FAIL(EPD_ERR_PEER, -1, "group %s was removed here mid-step", cg->gname);
  epd_ref_in_t in[EPD_MAX_RANKS];
  memset(in, 0, sizeof in);
  for (uint32_t n = 0; n < nodes; n++) {
    if (!h[n]) continue;
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
  /* route without the ranks every part was sent without (a notice may have changed the group's since) */
  const epd_expert_map_t *route = map;
  epd_expert_map_t masked;
  memset(&masked, 0, sizeof masked);
  if (cg->sent_mask && cnet_grp_alive(cn, cg) && cg->sent_mask == cg->grp->mask)
    route = eng_route_map(cg->grp);
  else if (cg->sent_mask && epd_ref_map_mask(&masked, map, cg->sent_mask))
    FAIL(EPD_ERR_NOMEM, -1, "out of memory for the step's masked map");
  else if (cg->sent_mask)
    route = &masked;
  int bad = -1;
  plan->renormalize = cg->renorm;
  epd_result_t rc = epd_ref_plan_build(plan, route, in, &bad, why, wl);
  epd_expert_map_free(&masked);
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

/* (mu) Wait for every node's frame of the step (net_parts_take, as the host backend's step). */
static int wait_frames(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  const int alive = cnet_grp_alive(cn, cg); /* a removed group's kept step (orphan) has no notices to heed */
  char why[256] = "";
  int peer = -1;
  if (cnet_off_check(cn, cg)) return 1;
  /* the lead times the parts out; the others ask it to (ask_off) */
  int st = net_parts_take(eng, alive ? cg->grp : NULL, cg->gname, cg->step,
                          alive ? eng_net_frames_since(cg->grp) : EPD_NET_TAKE_ONLY, cg->sent_mask,
                          eng_op_dispatch(cg->ldesc[0].op), cnet_leads(cn) ? cg->first_ns : 0, cg->frame,
                          cg->flen, &peer, why, sizeof why);
  if (st == NET_PARTS_WAIT && !cnet_leads(cn)) {
    uint32_t n = 0;
    while (n < cn->nodes && (n == cn->node || cg->frame[n] || net_node_masked(eng, cg->sent_mask, n))) n++;
    if (n == cn->nodes) return 0;
    net_silent_why(n, cn->L, eng->o.step_timeout_ms, why, sizeof why);
    return cnet_ask_off(cn, cg, cg->first_ns, now, (int)(n * cn->L), why);
  }
  if (st == NET_PARTS_WAIT) return 0; /* parts still to come */
  if (st != NET_PARTS_IN) {
    EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
    cnet_complete(cn, cg, st, peer, why);
    return 1;
  }
  cg->t_in = eng_now_ns();
  st = decide(cn, cg, &peer, why, sizeof why);
  /* The lead, before it orders: a node whose part of a later step is here has left this one (the lead gave
   * it up, maybe before the group had a client here), so the step fails (and every node hears it). On
   * another node such a part does not prove it: the step may have run without this node's rows. */
  for (uint32_t n = 0; !st && alive && cnet_leads(cn) && n < cn->nodes; n++) {
    uint64_t later;
    if (n == cn->node || !cg->frame[n] ||
        !(later = epd_net_later_part(eng->o.net, cg->gname, cg->step, n, eng_net_frames_since(cg->grp))))
      continue;
    st = EPD_ERR_PEER;
    peer = (int)(n * cn->L);
    snprintf(why, sizeof why,
             "node %u (ranks %u..%u) left this step (its part of step %llu came): it was given up there", n,
             n * cn->L, n * cn->L + cn->L - 1, (unsigned long long)later);
    EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
  }
  if (st) {
    cnet_complete(cn, cg, st, peer, why);
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

/* (mu) The step runs on this node alone (every other node out of it): no NCCL call crosses nodes, so it
 * takes no place in the lead's order (and runs while the lead is out). */
static int solo(const cnet_t *cn, const cnet_grp_t *cg) {
  for (uint32_t n = 0; n < cn->nodes; n++)
    if (n != cn->node && !net_node_masked(cn->eng, cg->sent_mask, n)) return 0;
  return 1;
}

/* (mu) The nodes of the step (bit k: node k): this one and those not out of it. */
static uint64_t step_nodes(const cnet_t *cn, const cnet_grp_t *cg) {
  uint64_t nodes = 0;
  for (uint32_t n = 0; n < cn->nodes && n < 64; n++)
    if (n == cn->node || !net_node_masked(cn->eng, cg->sent_mask, n)) nodes |= 1ull << n;
  return nodes;
}

/* (mu) The lead: the next order (GO go_seq) to every other node of its world whose link is up (a node
 * whose link is down fails the step there; one not among the step's nodes takes the next order). */
static void send_go(cnet_t *cn, const char *group, uint64_t step, uint64_t nodes) {
  epd_net_t *net = cn->eng->o.net;
  cnet_go_t go;
  char lw[160];
  memset(&go, 0, sizeof go);
  snprintf(go.group, sizeof go.group, "%s", group);
  go.step = step;
  go.nodes = nodes;
  for (uint32_t n = 0; n < cn->nodes && n < 64; n++)
    if (n != cn->node && (cn->world_nodes >> n & 1) && !epd_net_node_dead(net, n, lw, sizeof lw))
      epd_net_send_payload(net, n, "", cn->go_seq, &go, sizeof go);
  cn->go_seq++;
}

/* (mu) The lead: steps of other nodes that it is out of, ready there, are ordered in the order they were
 * told (among the lead's own steps: the order is one per world communicator, whichever node is in a
 * step). Not while the world communicator is down or made again. */
static int order_away(cnet_t *cn) {
  if (!cnet_leads(cn) || cn->world_down || cn->remake_req || cn->remaking || epd_engine_failure(cn->eng))
    return 0;
  int moved = 0;
  for (;;) {
    cnet_away_t *next = NULL;
    for (unsigned i = 0; i < CNET_AWAY; i++)
      if (cn->away[i].pending && (!next || cn->away[i].seq < next->seq)) next = &cn->away[i];
    if (!next) return moved;
    send_go(cn, next->group, next->step, next->nodes);
    next->pending = 0;
    next->go_valid = 1;
    next->go_step = next->step;
    moved = 1;
  }
}

/* (mu) The first node of a step the lead is out of tells the lead once that the step is ready (the other
 * nodes of the step are, or wait for the lead's order: order_away). */
static void tell_ready(cnet_t *cn, cnet_grp_t *cg) {
  if (cg->ready_told || cnet_leads(cn) || cn->world_down || cn->remake_req || cn->remaking || solo(cn, cg) ||
      !net_node_masked(cn->eng, cg->sent_mask, cn->lead))
    return;
  const uint64_t nodes = step_nodes(cn, cg);
  if (__builtin_ctzll(nodes) != (int)cn->node) return;
  cg->ready_told = 1;
  epd_net_step_ready(cn->eng->o.net, cn->lead, cg->gname, cg->step, nodes);
}

/* (mu) Every step ready here fails (status, why): none can run. 1 if one did. */
static int fail_ready(cnet_t *cn, int status, const char *why) {
  int moved = 0;
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (cg->phase == PH_READY) {
      cnet_complete(cn, cg, status, -1, why);
      moved = 1;
    }
  return moved;
}

/* (mu) No exchange runs: start the next one. The lead takes the step that became ready first and tells
 * every other node of its world (GO, numbered); the others run steps in GO order only, so every node
 * issues the groups' NCCL calls on the world communicator in the same order. */
static int schedule(cnet_t *cn, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  epd_net_t *net = eng->o.net;
  char why[480];

  if (epd_engine_failure(eng)) {
    /* After a failure nothing more is issued here (the world communicator may be aborted, its buffers
     * in use by the failed exchange): ready steps end with the reason, and the lead orders nothing. */
    snprintf(why, sizeof why, "node %u: the engine failed: %s", cn->node, epd_engine_failure(eng));
    return fail_ready(cn, EPD_ERR_INTERNAL, why);
  }
  if (cn->remake_req || cn->remaking) return 0; /* the world communicator is being made again */
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (cg->phase == PH_READY && solo(cn, cg)) {
      cnet_start_run(cn, cg);
      return 1;
    }
  /* A step ready here across the making of a world without the lost nodes: if a node of it is not in that
   * world, it fails (every node of the step decides so alike); else the new world's lead orders it. */
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next) {
    const uint64_t out = step_nodes(cn, cg) & ~cn->world_nodes;
    if (cg->phase != PH_READY || !out) continue;
    const uint32_t n = (uint32_t)__builtin_ctzll(out);
    snprintf(why, sizeof why,
             "node %u (ranks %u..%u) is in the step but not in the world communicator made without the lost "
             "nodes",
             n, n * cn->L, n * cn->L + cn->L - 1);
    cnet_complete(cn, cg, EPD_ERR_PEER, (int)(n * cn->L), why);
    return 1;
  }
  if (cn->world_down) { /* no exchange with another node until the world communicator is made again */
    if (cnet_world_coming(cn)) return 0; /* the new world's lead decides (ready_expired bounds the wait) */
    snprintf(why, sizeof why,
             "the world communicator is down (%s): steps with another node fail until it is made again "
             "(without the lost nodes, or with a restarted one)",
             cn->world_why);
    return fail_ready(cn, EPD_ERR_PEER, why);
  }
  if (cnet_leads(cn)) {
    cnet_grp_t *next = NULL;
    for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
      if (cg->phase == PH_READY && (!next || cg->ready_seq < next->ready_seq)) next = cg;
    if (!next) return 0;
    if (cnet_off_check(cn, next)) return 1;
    send_go(cn, next->gname, next->step, step_nodes(cn, next));
    next->go_valid = 1;
    next->go_step = next->step;
    cnet_start_run(cn, next);
    return 1;
  }
  if (!cn->go_have) {
    size_t len = 0;
    uint8_t *b = epd_net_take_payload(net, "", cn->go_seq, cn->lead, 0, NULL, &len);
    if (!b) return 0;
    if (len == sizeof cn->go) {
      memcpy(&cn->go, b, sizeof cn->go);
      cn->go.group[sizeof cn->go.group - 1] = 0;
      cn->go_have = 1;
      cn->go_ns = now;
    } else {
      EPD_LOGW(EPD_SUB_CUDA, "node %u sent a malformed exchange order (%zu bytes): ignored", cn->lead, len);
      cn->go_seq++;
    }
    free(b);
    if (!cn->go_have) return 1;
  }
  if (!(cn->go.nodes >> cn->node & 1)) { /* an exchange of other nodes: its place in the order only */
    cn->go_have = 0;
    cn->go_seq++;
    return 1;
  }
  /* the step the GO names (a removed group's orphaned step too), else the group's live copy */
  cnet_grp_t *cg = cn->groups;
  while (cg && (strcmp(cg->gname, cn->go.group) || cg->phase != PH_READY || cg->step != cn->go.step))
    cg = cg->next;
  if (!cg) {
    cg = cn->groups;
    while (cg && (strcmp(cg->gname, cn->go.group) || !cnet_grp_alive(cn, cg))) cg = cg->next;
  }
  if (cg && cg->phase == PH_READY && cg->step == cn->go.step) {
    cn->go_have = 0;
    cn->go_seq++;
    cnet_start_run(cn, cg);
    return 1;
  }
  /* A step this node already finished or failed (or of a group gone here): the lead's exchange has no
   * partner here (it fails by its timeout); the next order may be runnable. */
  const uint64_t cur = !cg                                        ? UINT64_MAX
                       : cg->phase == PH_COLLECT && !cg->narrived ? cg->grp->steps
                                                                  : cg->step;
  if (cur > cn->go.step) {
    EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: node %u ordered its exchange, but %s here: ignored",
             cn->go.group, (unsigned long long)cn->go.step, cn->lead,
             cg ? "this node is past that step" : "the group is not served");
    cn->go_have = 0;
    cn->go_seq++;
    return 1;
  }
  /* Held past the step timeout and still not ready here (the group was created again here, and its
   * steps count from 0 while the lead's are on): never runnable, so it gives way to the next order. Not
   * while this node waits for that step's parts: it runs once they are in, or fails (ask_off). */
  const int waiting = cg && cg->step == cn->go.step && (cg->phase == PH_WAIT || cg->narrived);
  if (!waiting && now > cn->go_ns && now - cn->go_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    EPD_LOGW(EPD_SUB_CUDA,
             "group %s step %llu: node %u ordered its exchange, but that step was not ready here within %u "
             "ms (at step %llu here): dropped",
             cn->go.group, (unsigned long long)cn->go.step, cn->lead, eng->o.step_timeout_ms,
             (unsigned long long)cur);
    cn->go_have = 0;
    cn->go_seq++;
    return 1;
  }
  return 0;
}

/* (mu) A step ready here that the lead gave up fails; on another node, one that waited the step timeout
 * for the lead's order while no exchange ran asks the lead to give it up (ask_off; a lost link to the
 * lead fails it at once). */
static int ready_expired(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
  epd_engine_t *eng = cn->eng;
  const uint64_t since = cg->ready_ns > cn->run_end_ns ? cg->ready_ns : cn->run_end_ns;
  char why[256], lw[160];
  if (cnet_off_check(cn, cg)) return 1;
  if (solo(cn, cg) || cnet_leads(cn)) return 0; /* no order to wait for */
  if (cnet_world_coming(cn) && now - since <= 3ull * eng->o.step_timeout_ms * 1000000ull) return 0;
  if (epd_net_node_dead(eng->o.net, cn->lead, lw, sizeof lw)) {
    snprintf(why, sizeof why,
             "the data link to node %u (ranks %u..%u), which orders the exchanges, is down: %s", cn->lead,
             cn->lead * cn->L, cn->lead * cn->L + cn->L - 1, lw);
    cnet_complete(cn, cg, EPD_ERR_PEER, (int)(cn->lead * cn->L), why);
    return 1;
  }
  if (cn->run) return 0;
  snprintf(why, sizeof why, "waited %u ms for node %u (rank %u) to order the step's exchange",
           eng->o.step_timeout_ms, cn->lead, cn->lead * cn->L);
  return cnet_ask_off(cn, cg, since, now, (int)(cn->lead * cn->L), why);
}

int eng_cuda_net_poll(cnet_t *cn) {
  epd_engine_t *eng = cn->eng;
  int moved = 0;
  pthread_mutex_lock(&eng->mu);
  uint64_t now = eng_now_ns();
  moved |= cnet_world_poll(cn);
  /* groups removed (not while their exchange runs) */
  for (cnet_grp_t *cg = cn->groups, *next; cg; cg = next) {
    next = cg->next;
    if (cg != cn->run && !cnet_grp_alive(cn, cg) &&
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
    cg->renorm = (int)g->renormalize;
    snprintf(cg->gname, sizeof cg->gname, "%s", g->name);
    cg->phase = PH_COLLECT;
    cnet_unserved_take(cn, cg);
    int ok = 1;
    for (unsigned b = 0; b < EPD_NUM_BANKS; b++) ok &= epd_ref_plan_init(&cg->plan[b], &cg->g) == EPD_OK;
    cg->plan_init = 1;
    if (!ok) eng_fail(eng, "out of memory for the routing plans of group %s", g->name);
    cnet_grp_t **tail = &cn->groups;
    while (*tail) tail = &(*tail)->next;
    *tail = cg;
  }
  if (cnet_leads(cn)) /* before any step is ordered */
    for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next) moved |= cnet_answer_off(cn, cg);
  if (cn->run) moved |= cnet_poll_run(cn, cn->run, now);
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next) {
    if (cg->phase == PH_COLLECT && cnet_grp_alive(cn, cg)) moved |= collect(cn, cg, now);
    if (cg->phase == PH_WAIT) moved |= wait_frames(cn, cg, now);
    if (cg->phase == PH_READY) tell_ready(cn, cg);
  }
  moved |= order_away(cn);
  if (!cn->run) moved |= schedule(cn, now);
  /* after schedule: an order that arrived in time is taken before a ready step is given up */
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (cg->phase == PH_READY) moved |= ready_expired(cn, cg, now);
  pthread_mutex_unlock(&eng->mu);
  return moved;
}

#endif /* EPD_WITH_CUDA */
