/*
 * launch.c - the CUDA backend's step protocol in "launch" mode: one thread per GPU polls the state words
 * of its rank's clients. A submitted slot joins its group's step being collected (the k-th op of each
 * rank is step k, as on the host backend). When every rank has arrived the step is checked on the host
 * (same op and bank on every rank, num_tokens in range), numbered in a backend-wide run sequence, and
 * each rank thread launches its kernel on its own stream in run-sequence order (so two groups can never
 * wait on each other across GPUs). The rank thread then polls an event; when the kernel is done it
 * completes the slot from the kernel's epd_comp_t. A group's NCCL window and device communicator are
 * created with its first client (engine_cuda.c, collective over the node-local communicator of
 * cuda_comm.c, which runs a thread per GPU).
 */
#define _GNU_SOURCE
#include "core/engine_internal.h"

#if EPD_WITH_CUDA
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "core/log.h"
#include "cuda/cuda_be.h"
#include "cuda/cuda_comm.h"
#include "cuda/cuda_topk.h"
#include "epd_kernels.h"

/* ---- step protocol ------------------------------------------------------------------------------ */

/* (mu) Complete rank r's slot of the current step of cg and account it. */
void cuda_complete_rank(epd_engine_t *eng, cuda_grp_t *cg, int r, const epd_comp_t *kc) {
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
void cuda_fail_collect(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int status, int peer,
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
      cuda_complete_rank(eng, cg, r, NULL);
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
    cuda_fail_collect(eng, be, cg, EPD_ERR_PEER, r, why);
    return 1;
  }
  cuda_client_t *mem[EPD_MAX_RANKS] = {0};
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    if (!(mask >> r & 1)) continue;
    mem[r] = cg->ghost[r] ? cg->ghost[r] : grp->client[r] ? grp->client[r]->be : NULL;
    if (!mem[r] || mem[r]->busy) {
      snprintf(why, sizeof why, "masked rank %u has no memory for its part of the step", r);
      cuda_fail_collect(eng, be, cg, EPD_ERR_PEER, (int)r, why);
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
    cuda_fail_collect(eng, be, cg, EPD_ERR_INTERNAL, -1, why);
    return;
  }
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    if (mask >> r & 1) continue;
    const epd_desc_t *d = &cg->desc[r];
    const int is_ht = d->op == EPD_OP_HT_DISPATCH || d->op == EPD_OP_HT_COMBINE;
    if ((d->op != EPD_OP_LL_DISPATCH && d->op != EPD_OP_LL_COMBINE && !is_ht) || (is_ht && !cg->have_hwin)) {
      snprintf(why, sizeof why, "rank %u: op %u is not available on the cuda backend%s", r, d->op,
               is_ht ? " for this geometry (HT limits: max_tokens, capacity)" : "");
      cuda_fail_collect(eng, be, cg, is_ht ? EPD_ERR_UNSUPPORTED : EPD_ERR_INVALID, (int)r, why);
      return;
    }
    const int is_disp = eng_op_dispatch(d->op);
    const int fl = eng_check_flags(d, r, 0, why, sizeof why);
    if (fl) {
      cuda_fail_collect(eng, be, cg, fl, (int)r, why);
      return;
    }
    if (d->op != d0->op || d->bank != d0->bank || (is_disp && d->flags != d0->flags)) {
      snprintf(why, sizeof why,
               "rank %u submitted op %u bank %u flags 0x%x, rank %u op %u bank %u flags 0x%x", r, d->op,
               d->bank, d->flags, first, d0->op, d0->bank, d0->flags);
      cuda_fail_collect(eng, be, cg, EPD_ERR_MISMATCH, (int)r, why);
      return;
    }
    if (d->bank >= EPD_NUM_BANKS) {
      snprintf(why, sizeof why, "rank %u: bank %u out of range [0, %u)", r, d->bank, EPD_NUM_BANKS);
      cuda_fail_collect(eng, be, cg, EPD_ERR_INVALID, (int)r, why);
      return;
    }
    if (is_disp && d->num_tokens > cg->g.max_tokens) {
      snprintf(why, sizeof why, "rank %u: num_tokens %u over max_tokens %u", r, d->num_tokens,
               cg->g.max_tokens);
      cuda_fail_collect(eng, be, cg, EPD_ERR_TOO_MANY_TOKENS, (int)r, why);
      return;
    }
  }
  const int ht = d0->op == EPD_OP_HT_DISPATCH || d0->op == EPD_OP_HT_COMBINE;
  if (eng->draining && eng_op_dispatch(d0->op)) {
    cuda_fail_collect(eng, be, cg, EPD_ERR_DRAINING, -1, "the daemon is draining");
    return;
  }
  if (!eng_op_dispatch(d0->op) && cg->disp_refused[ht][d0->bank]) {
    snprintf(why, sizeof why, "%s combine of bank %u after a refused %s dispatch of that bank",
             ht ? "HT" : "LL", d0->bank, ht ? "HT" : "LL");
    cuda_fail_collect(eng, be, cg, EPD_ERR_STATE, -1, why);
    return;
  }
  if (cg->setup_failed) {
    cuda_fail_collect(eng, be, cg, EPD_ERR_CUDA, -1,
                      "the group's GPU resources could not be set up (see log)");
    return;
  }
  if (mask && masked_parts(eng, be, cg, d0, mask)) return;
  if (eng_op_dispatch(d0->op) && grp) {
    eng_apply_staged_map(eng, grp);
    if (map_img_update(cg, grp)) {
      cuda_fail_collect(eng, be, cg, EPD_ERR_INTERNAL, -1, "could not build the device expert map");
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
    cuda_fail_collect(eng, be, cg, EPD_ERR_PEER, lost, why);
    return 1;
  }
  /* now was read before mu: another rank thread may have stamped a later first arrival. */
  if (now > cg->first_arrive_ns &&
      now - cg->first_arrive_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
    int present[EPD_MAX_RANKS]; /* a masked rank is not waited for */
    for (uint32_t p = 0; p < cg->g.num_ranks; p++) present[p] = cg->arrived[p] || (grp->mask >> p & 1);
    int missing = eng_timeout_rank(eng, present, cg->g.num_ranks, why, sizeof why);
    eng_mark_hung(grp, missing);
    cuda_fail_collect(eng, be, cg, EPD_ERR_TIMEOUT, missing, why);
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
  /* with ranks masked, a token that lost entries has its other weights renormalised (a group option) */
  const uint32_t flags =
      d->flags | (cg->renorm && cg->step_mask && eng_op_dispatch(d->op) ? EPD_K_RENORMALIZE : 0);
  if (d->op == EPD_OP_HT_DISPATCH || d->op == EPD_OP_HT_COMBINE) {
    if (!gr->kh) {
      snprintf(err, errlen, "HT is not available for this group's geometry (max_tokens %u, capacity %u)",
               cg->g.max_tokens, cg->g.ht_capacity);
      return EPD_ERR_UNSUPPORTED;
    }
    epd_k_ht_op_t hop = {.op = d->op,
                         .flags = flags,
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
                        .flags = flags,
                        .num_tokens = d->num_tokens,
                        .bank = d->bank,
                        .timeout_ns = be->timeout_ns,
                        .map = gr->map_dev,
                        .slot_tokens = NULL,
                        .comp = gr->comp_dev};
    if ((rc = epd_k_ll_launch(gr->k, &a, &op, rk->stream, err, errlen))) return rc;
  }
  /* with ranks masked, the entries this rank's dispatch dropped are counted on the host (cuda_rank_main) */
  if (cg->step_mask && eng_op_dispatch(d->op) && !cg->synth[r] && d->num_tokens) {
    const size_t kb = (size_t)cg->g.max_tokens * cg->g.topk * sizeof(int64_t);
    if ((e = cuda_topk_read((void **)&gr->topk_host, &gr->topk_cap, kb,
                            a.base + cg->off[d->bank][EPD_BUF_TOPK_IDX], 0, d->num_tokens, cg->g.topk,
                            rk->stream)))
      return cuda_err(e, "top-k copy", err, errlen);
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
void cuda_reap(epd_engine_t *eng, cuda_be_t *be, cuda_rank_t *rk) {
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
    cuda_grp_teardown(be, cg);
    for (uint32_t r = 0; r < cg->g.num_ranks; r++)
      if (cg->ghost[r]) cuda_client_release(cg->ghost[r]);
    free(cg->map_img);
    memset(cg, 0, sizeof *cg);
  }
  if (rk) cudaSetDevice(rk->device);
}

void *cuda_rank_main(void *arg) {
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
      cuda_reap(eng, be, rk);
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
        cuda_complete_rank(eng, cg, r, &kc);
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
    cuda_reap(eng, be, rk);
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
        cuda_complete_rank(eng, cg, r, &kc);
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

#endif /* EPD_WITH_CUDA */
