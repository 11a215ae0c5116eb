/*
 * cnet_run.c - running a step across nodes on the CUDA backend (cnet_internal.h): the step program of
 * cnet_plan.c on each local GPU around one grouped ncclSend/ncclRecv with the rail peers of the other
 * nodes, and its completion.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/cnet_internal.h"
#include "cuda/cnet_plan.h"
#include "net/engine_net.h"
#include "net/frame.h"
#include "core/log.h"

#if EPD_WITH_CUDA
#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "epd_kernels_net.h"

void cnet_dev_free(cnet_t *cn) {
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_dev_t *d = &cn->d[l];
    cudaSetDevice(d->device);
    if (d->xsend) cudaFree(d->xsend);
    if (d->xrecv) cudaFree(d->xrecv);
    d->xsend = d->xrecv = NULL;
    d->xbytes = 0;
  }
}

/* (mu) Addresses of the step's buffers on every local rank; 0 or -1 (a buffer is missing). */
static int fill_addr(cnet_t *cn, cnet_grp_t *cg) {
  const int alive = cnet_grp_alive(cn, cg);
  const epd_buffer_desc_t *bufs = alive ? cg->grp->bufs : cg->obufs;
  const uint32_t nbufs = alive ? cg->grp->nbufs : cg->orphan ? cg->onbufs : 0;
  uint32_t M = cg->g.max_tokens, H = cg->g.hidden;
  for (uint32_t l = 0; l < cn->L; l++) {
    cnet_addr_t *a = &cn->addr[l];
    memset(a, 0, sizeof *a);
    /* a masked rank takes no part: no memory (its hold is a past step's, released) */
    uint64_t base = cg->arrived[l] ? eng_cuda_client_arena(cg->hold[l]) : 0;
    for (uint32_t i = 0; i < nbufs && base; i++)
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
  /* A node left out of the world communicator (made again without it) is masked: no rows for it. */
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t n = 0; n < cn->nodes; n++)
      if (n != cn->node && epd_cc_world_peer(cn->cc, n, (int)l) < 0 &&
          (pg->side[l].send_rows[n] || pg->side[l].recv_rows[n])) {
        snprintf(err, errlen, "rows for node %u, which is not on the world communicator", n);
        return EPD_ERR_INTERNAL;
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
      const int peer = epd_cc_world_peer(cn->cc, n, (int)l);
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

/* (mu) Node `lost` of the running exchange, or the lead, is gone (its link is down; why): the world
 * communicator is aborted so that the exchange's kernels stop, and the step fails. The engine goes on:
 * steps of this node alone run at once (the lost node is out of them), steps with another node once the
 * world communicator is made again (remake_main: without the lost nodes, or with a restarted one).
 * Kernels that do not stop fail the engine. */
static int world_lost(cnet_t *cn, cnet_grp_t *cg, uint32_t lost, const char *why) {
  epd_engine_t *eng = cn->eng;
  int stuck = 0;
  pthread_mutex_unlock(&eng->mu); /* the run is ours (cn->run) */
  const uint64_t t0 = eng_now_ns();
  epd_cc_abort(cn->cc);
  const uint64_t t1 = eng_now_ns();
  for (uint32_t l = 0; l < cn->L; l++) {
    cudaSetDevice(cn->d[l].device);
    while (cudaStreamQuery(cn->d[l].stream) == cudaErrorNotReady && eng_now_ns() - t1 < 2000000000ull)
      eng_sleep_ns(1000000);
    stuck |= cudaStreamQuery(cn->d[l].stream) == cudaErrorNotReady;
  }
  const uint64_t t2 = eng_now_ns();
  pthread_mutex_lock(&eng->mu);
  if (stuck) {
    eng_fail(eng,
             "group %s step %llu: %s; the exchange did not stop within 2 s of the world communicator's "
             "abort",
             cg->gname, (unsigned long long)cg->step, why);
    cnet_complete(cn, cg, EPD_ERR_NCCL, (int)(lost * cn->L), why);
    return 1;
  }
  if (!cn->world_down) snprintf(cn->world_why, sizeof cn->world_why, "%s", why);
  cn->world_down = 1;
  for (uint32_t n = 0; n < cn->nodes; n++) /* their exchanges with this node would find no partner */
    if (n != cn->node) epd_net_step_off(eng->o.net, n, "", 0, EPD_NET_OFF_WORLD, -1, why);
  EPD_LOGE(EPD_SUB_CUDA,
           "group %s step %llu: %s: world communicator aborted (%.1f ms, streams drained in %.1f ms); steps "
           "of this node alone go on, steps with another node fail until it is made again",
           cg->gname, (unsigned long long)cg->step, why, (double)(t1 - t0) / 1e6, (double)(t2 - t1) / 1e6);
  cnet_complete(cn, cg, EPD_ERR_PEER, (int)(lost * cn->L), why);
  return 1;
}

/* (mu) A node of the step whose link is down, or the lead if its link is (its last order may not have
 * reached every node of the step), or -1; why gets it. */
static int dead_node(cnet_t *cn, cnet_grp_t *cg, char *why, size_t wl) {
  char lw[160];
  for (uint32_t n = 0; n < cn->nodes; n++)
    if (n != cn->node && !net_node_masked(cn->eng, cg->sent_mask, n) &&
        epd_net_node_dead(cn->eng->o.net, n, lw, sizeof lw)) {
      snprintf(why, wl, "node %u (ranks %u..%u) was lost mid-exchange: %s", n, n * cn->L,
               n * cn->L + cn->L - 1, lw);
      return (int)n;
    }
  for (uint32_t n = 0; n < cn->nodes && n < 64; n++)
    if (n != cn->node && (cn->aborted >> n & 1) && !net_node_masked(cn->eng, cg->sent_mask, n)) {
      snprintf(why, wl, "node %u (ranks %u..%u) aborted its world communicator mid-exchange", n, n * cn->L,
               n * cn->L + cn->L - 1);
      return (int)n;
    }
  int others = 0; /* a step of this node alone needs no order */
  for (uint32_t n = 0; n < cn->nodes; n++)
    others |= n != cn->node && !net_node_masked(cn->eng, cg->sent_mask, n);
  if (others && !cnet_leads(cn) && epd_net_node_dead(cn->eng->o.net, cn->lead, lw, sizeof lw)) {
    snprintf(why, wl, "node %u (ranks %u..%u), which ordered the exchanges, was lost mid-exchange: %s",
             cn->lead, cn->lead * cn->L, cn->lead * cn->L + cn->L - 1, lw);
    return (int)cn->lead;
  }
  return -1;
}

/* A node lost while this node issued the exchange (its sockets closed) can make NCCL fail the issue
 * before the link to that node is seen down here: wait a moment for it (mu not held). -1: none. */
static int lost_while_issuing(cnet_t *cn, cnet_grp_t *cg, char *why, size_t wl) {
  epd_engine_t *eng = cn->eng;
  const uint64_t t0 = eng_now_ns();
  for (;;) {
    pthread_mutex_lock(&eng->mu);
    const int lost = dead_node(cn, cg, why, wl);
    pthread_mutex_unlock(&eng->mu);
    if (lost >= 0 || eng_now_ns() - t0 > 1000000000ull) return lost;
    eng_sleep_ns(5000000);
  }
}

#ifdef EPD_TEST_HOOKS
/* Test builds only (epd-faults; GPU test 174): once the file $EPD_TEST_DIE_IN_EXCHANGE exists, this daemon
 * is SIGKILLed 100 ms into the next exchange it starts, before its own sends and receives: the other nodes
 * are then waiting in that exchange (a node lost mid-exchange, which a kill from outside hits by chance). */
static void die_in_exchange(void) {
  const char *f = getenv("EPD_TEST_DIE_IN_EXCHANGE");
  if (f && access(f, F_OK) == 0) {
    EPD_LOGW(EPD_SUB_CUDA, "test hook: dying in this exchange ($EPD_TEST_DIE_IN_EXCHANGE)");
    usleep(100000);
    raise(SIGKILL);
  }
}
#else
static void die_in_exchange(void) {}
#endif

/* (mu) The step's turn (schedule): run it (mu released while issuing). */
void cnet_start_run(cnet_t *cn, cnet_grp_t *cg) {
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
    cnet_complete(cn, cg, rc, -1, err);
    return;
  }
  cg->phase = PH_RUN;
  cg->run_ns = eng_now_ns();
  cn->run = cg;
  pthread_mutex_unlock(&eng->mu);
  die_in_exchange();
  rc = issue(cn, cg, err, sizeof err);
  cg->t_issued = eng_now_ns();
  char why[320];
  const int lost = rc == EPD_ERR_NCCL ? lost_while_issuing(cn, cg, why, sizeof why) : -1;
  pthread_mutex_lock(&eng->mu);
  if (lost >= 0) {
    EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, err);
    world_lost(cn, cg, (uint32_t)lost, why);
  } else if (rc) {
    EPD_LOGE(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, err);
    eng_fail(eng, "group %s step %llu: inter-node stage: %s", cg->gname, (unsigned long long)cg->step, err);
    epd_cc_abort(cn->cc);
    cnet_complete(cn, cg, rc, -1, err);
  }
}

/* (mu) The step's GPU work: done, failed, or past the timeout. */
int cnet_poll_run(cnet_t *cn, cnet_grp_t *cg, uint64_t now) {
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
      cnet_complete(cn, cg, EPD_ERR_CUDA, -1, cudaGetErrorString(e));
      return 1;
    }
  }
  if (ready) {
    eng_group_t *grp = cnet_grp_alive(cn, cg) ? cg->grp : NULL;
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
      cg->plan_mask[cg->bank] = cg->sent_mask;
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
    cnet_complete(cn, cg, EPD_OK, -1, NULL);
    return 1;
  }
  char why[320];
  const int lost = dead_node(cn, cg, why, sizeof why);
  if (lost >= 0) return world_lost(cn, cg, (uint32_t)lost, why);
  if (now > cg->run_ns && now - cg->run_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    snprintf(why, sizeof why,
             "the inter-node exchange did not finish within %u ms (a node stopped mid-step?): world "
             "communicator aborted",
             eng->o.step_timeout_ms);
    EPD_LOGE(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
    epd_cc_abort(cn->cc);
    eng_fail(eng, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
    cnet_complete(cn, cg, EPD_ERR_TIMEOUT, -1, why);
    return 1;
  }
  return 0;
}

#endif /* EPD_WITH_CUDA */
