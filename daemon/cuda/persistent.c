/*
 * persistent.c - the CUDA backend's persistent mode.
 *
 * "persistent" mode (under CUDA MPS, or engine.cuda_mode = persistent; launch turns it off):
 * a group whose every rank has a live client and that is in steady state runs its LL ops in persistent
 * kernels, one per (group, rank) on a stream of its own, each serving that rank's client queue
 * (epd_k_ll_persistent_launch): the kernels take SUBMITTED slots, agree on each op across ranks, run it
 * and complete the slot themselves. The rank threads only keep the books (ops, per-op metrics, steps,
 * events) from the kernels' host-mapped progress blocks. Everything else runs in launch mode: the kernels
 * are stopped (a stop word in GPU memory: 0), stop together at one slot boundary leaving the
 * slot SUBMITTED, and the group is taken over by the launch-mode collection at the kernels' ring
 * positions - for an HT op or any op the kernel does not run (it stops by itself), mismatched ops, the
 * step that switches to a staged map, draining, a client leaving/dying/hung, a rank without a client, a
 * failed op (the launch mode resets the team), a host-side step timeout (a rank's client does not
 * submit), another group's launch-mode work (a launched kernel did not start next to a persistent one on
 * H200 under MPS: one group at a time has persistent kernels, and nothing else runs on the GPUs then),
 * and before any CUDA call that may synchronise the device (attach, detach, group set-up/tear-down,
 * weight copies). The group resumes persistent kernels when it is back in steady state.
 */
#define _GNU_SOURCE
#include "core/engine_internal.h"

#if EPD_WITH_CUDA
#include <stdio.h>
#include <string.h>

#include "core/log.h"
#include "cuda/cuda_be.h"

/* ---- persistent mode ---------------------------------------------------------------------------- */

static const char *const pexit_name[] = {
    "running",        "stop asked",  "an op it does not run", "a peer stopped",
    "mismatched ops", "a failed op", "a peer never announced"};

static uint32_t grp_blocks(const cuda_grp_t *cg) {
  const epd_k_ll_geom_t *kg = cg->rk[0].k ? epd_k_ll_geom(cg->rk[0].k) : NULL;
  return kg ? kg->blocks : EPD_K_LL_BLOCKS;
}

/* The first SUBMITTED slot of cc's ring from its position (launch-mode order), or NULL. */
static epd_slot_t *head_slot(cuda_client_t *cc) {
  for (uint32_t k = 0; k < EPD_QUEUE_SLOTS; k++) {
    epd_slot_t *sl = &cc->queue->slot[(cc->next_slot + k) % EPD_QUEUE_SLOTS];
    if (eng_slot_state(sl) == EPD_SLOT_SUBMITTED) return sl;
  }
  return NULL;
}

/* (mu) Whether grp can run in persistent kernels now: every rank has a live client, nothing of the
 * launch mode is pending on it, no map is staged, and its kernels fit next to the others. */
int pers_eligible(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg) {
  eng_group_t *grp = cg->grp;
  if (be->mode != MODE_PERSISTENT || cg->pfail || !grp || cg->setup_failed || !cg->have_win) return 0;
  /* a carried first arrival is used by the next collection; it lapses if nobody arrives */
  uint64_t t = eng_now_ns();
  if (cg->pcarry_ns && t > cg->pcarry_ns && t - cg->pcarry_ns > 2 * be->timeout_ns) cg->pcarry_ns = 0;
  if (cg->phase != PH_COLLECT || cg->narrived || cg->need_reset || cg->pcarry_ns) return 0;
  if (eng->draining || epd_engine_failure(eng) || grp->has_staged || grp->steps < cg->presume_step) return 0;
  /* Groups that mask lost ranks step in launch mode: their masked ranks' parts are launched with no tokens,
   * and persistent kernels next to a client killed mid-step faulted under chaos (not understood yet). */
  if (grp->on_rank_loss == EPD_RANK_LOSS_MASK) return 0;
  /* a bank whose last LL dispatch was refused: its combine must be refused too, which the kernels cannot
   * tell (their record of the bank is an older dispatch's); launch mode until a dispatch of it runs */
  for (uint32_t b = 0; b < EPD_NUM_BANKS; b++)
    if (cg->disp_refused[0][b]) return 0;
  for (int r = 0; r < be->ndev; r++)
    if (be->rank[r].inflight == cg) return 0;
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    eng_client_t *c = grp->client[r];
    cuda_client_t *cc = c ? c->be : NULL;
    if (!cc || cc->dead || cc->busy || c->hung || grp->lost[r] || !cg->rk[r].ready || !cg->rk[r].pctl)
      return 0;
    /* an op the kernel would not run is the launch mode's */
    epd_slot_t *sl = head_slot(cc);
    if (sl && ((sl->desc.op != EPD_OP_LL_DISPATCH && sl->desc.op != EPD_OP_LL_COMBINE) ||
               sl->desc.bank >= EPD_NUM_BANKS))
      return 0;
  }
  if (map_img_update(cg, grp)) return 0;
  /* A persistent kernel has its GPUs to itself: on 2x H200 under MPS, an LL kernel launched on another
   * stream of the daemon did not start until the persistent kernel of another group returned (measured).
   * So one group at a time runs persistent kernels; launch-mode work of another group stops them before
   * it launches (rank_main), and they resume once the others were quiet for LAUNCH_QUIET_NS. */
  uint32_t G = grp_blocks(cg);
  for (uint32_t i = 0; i < be->ngrp; i++) {
    const cuda_grp_t *o = &be->grp[i];
    if (!o->used || o == cg) continue;
    if (o->pstate != PS_OFF || o->narrived || o->phase == PH_RUN) return 0;
  }
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    const cuda_rank_t *rk = &be->rank[r];
    if (rk->last_launch_grp && rk->last_launch_grp != cg && t > rk->last_launch_ns &&
        t - rk->last_launch_ns < LAUNCH_QUIET_NS)
      return 0;
    if ((long)G + 1 > rk->president) { /* the op blocks and the controller block */
      if (!cg->pnofit_logged++)
        EPD_LOGW(EPD_SUB_CUDA,
                 "group %s stays in launch mode: its persistent kernel (%u blocks + 1) would not be "
                 "resident on GPU %d (%ld blocks at once; engine.ll_blocks sets the blocks)",
                 cg->name, G, rk->device, rk->president);
      return 0;
    }
  }
  return 1;
}

/* (mu) Tell grp's kernels to stop at their next slot boundary: a stream memory operation writes the
 * device stop word (it runs beside the kernel; nothing here waits for the device). */
void pers_stop(cuda_grp_t *cg, uint64_t now, const char *why) {
  if (cg->pstate != PS_RUN) return;
  int dev = -1;
  cudaGetDevice(&dev);
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    cuda_grank_t *gr = &cg->rk[r];
    if (!gr->dlimit) continue;
    cudaSetDevice(gr->device);
    CUresult e = cu.cuStreamWriteValue64((CUstream)gr->cstream, (CUdeviceptr)(uintptr_t)gr->dlimit, 0, 0);
    if (e) EPD_LOGE(EPD_SUB_CUDA, "group %s rank %u: writing the stop word failed (%d)", cg->name, r, (int)e);
  }
  if (dev >= 0) cudaSetDevice(dev);
  cg->pstate = PS_STOP;
  cg->pstop_ns = now;
  EPD_LOGD(EPD_SUB_CUDA, "group %s: stopping the persistent kernels (%s)", cg->name, why);
}

/* (mu) Launch grp's persistent kernel on every rank. */
static int pers_start(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int self_dev, uint64_t now) {
  eng_group_t *grp = cg->grp;
  uint32_t G = grp_blocks(cg);
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    cuda_grank_t *gr = &cg->rk[r];
    cuda_client_t *cc = grp->client[r]->be;
    cudaSetDevice(be->rank[r].device);
    cudaError_t e = cudaSuccess;
    epd_result_t rc = EPD_OK;
    if (gr->map_gen != cg->map_img_gen) {
      /* on the kernel's stream, before it (nothing here may wait for the device) */
      e = cudaMemcpyAsync(gr->map_dev, cg->map_img, epd_k_map_bytes(cg->g.num_experts),
                          cudaMemcpyHostToDevice, gr->pstream);
      if (!e) gr->map_gen = cg->map_img_gen;
    }
    memset(gr->pprog, 0, sizeof *gr->pprog);
    gr->pctl->abort = 0;
    /* no stop yet: written on the stop writes' stream (so a stop asked right after the launch lands after
     * it), and the kernel's stream waits for it */
    if (!e &&
        cu.cuStreamWriteValue64((CUstream)gr->cstream, (CUdeviceptr)(uintptr_t)gr->dlimit, UINT64_MAX, 0))
      e = cudaErrorUnknown;
    if (!e) e = cudaEventRecord(gr->cev, gr->cstream);
    if (!e) e = cudaStreamWaitEvent(gr->pstream, gr->cev, 0);
    if (!e) {
      epd_k_arena_t a;
      a.base = (uint64_t)cc->arena_dev;
      memcpy(a.off, cg->off, sizeof a.off);
      epd_k_persist_t ps;
      memset(&ps, 0, sizeof ps);
      ps.queue = (epd_queue_t *)(uintptr_t)cc->queue_dev;
      ps.dqueue = (epd_queue_t *)(uintptr_t)(cc->arena_dev + cc->dq_offset);
      ps.dlimit = gr->dlimit;
      ps.ctl = gr->pctl_dev;
      ps.prog = gr->pprog_dev;
      ps.first_slot = cc->next_slot;
      for (unsigned b = 0; b < EPD_NUM_BANKS; b++) ps.bank_ver[b] = cg->bank_map_version[b];
      ps.index0 = cg->pidx + 1;
      ps.step0 = grp->steps;
      ps.steps_done0 = cc->queue->steps_done;
      ps.timeout_ns = be->timeout_ns;
      ps.guard_all = !be->mps;
      rc = epd_k_ll_persistent_launch(gr->k, &a, gr->map_dev, &ps, gr->pstream);
      if (!rc) e = cudaEventRecord(gr->pev, gr->pstream);
    }
    if (e || rc) {
      EPD_LOGE(EPD_SUB_CUDA,
               "group %s rank %u: persistent kernel launch failed (%s): the group stays in launch mode",
               cg->name, r, e ? cudaGetErrorString(e) : "launch");
      cudaGetLastError();
      cg->pfail = 1;
      cg->pstate = PS_RUN; /* stop what did start */
      pers_stop(cg, now, "launch failed");
      cudaSetDevice(self_dev);
      return 1;
    }
    gr->prun = 1;
    gr->pcc = cc;
    gr->pacct = 0;
    gr->pwatch_ann = 0;
    gr->pwatch_ns = now;
    cc->busy = 1; /* its memory stays while the kernel may touch it */
    be->rank[r].pblocks += G;
  }
  cudaSetDevice(self_dev);
  cg->pstep0 = grp->steps;
  cg->pstate = PS_RUN;
  cg->pabort = 0;
  cg->pwait_ann = cg->pwait_ns = 0;
  if (cg->plaunches++ == 0)
    EPD_LOGI(
        EPD_SUB_CUDA,
        "group %s: LL steps run in persistent kernels (%u blocks + a controller block per GPU, %ld resident)",
        cg->name, G, be->rank[0].president);
  else
    EPD_LOGD(EPD_SUB_CUDA, "group %s: persistent kernels resumed at step %llu", cg->name,
             (unsigned long long)grp->steps);
  (void)eng;
  return 1;
}

/* (mu) Account the ops rank r's kernel completed since the last look; 1 if there were any. */
static int pers_account(epd_engine_t *eng, cuda_grp_t *cg, int r) {
  cuda_grank_t *gr = &cg->rk[r];
  volatile epd_k_pprog_t *pr = gr->pprog;
  uint64_t ops = pr->ops;
  if (ops <= gr->pacct) return 0;
  eng_group_t *grp = cg->grp;
  eng_client_t *c = grp ? grp->client[r] : NULL;
  int mine = c && c->be == gr->pcc;
  for (; gr->pacct < ops; gr->pacct++) {
    uint64_t n = gr->pacct;
    epd_k_prec_t rec;
    memcpy(&rec, (const void *)&pr->rec[n % EPD_K_PREC], sizeof rec);
    if (ops - n > EPD_K_PREC || rec.seq != n + 1) {
      /* overwritten before we looked (more than EPD_K_PREC ops in one poll): count it, no details */
      eng_record_op(eng, r, EPD_OP_MAX, 0, 0, 0);
    } else {
      eng_record_op(eng, r, rec.op, rec.status, 0, rec.latency_ns);
      cg->pst_n++;
      cg->pst_agree += rec.agree_ns;
      cg->pst_run += rec.run_ns;
      cg->pst_lat += rec.latency_ns;
      const int kind = rec.op == EPD_OP_LL_COMBINE;
      cg->pst_opn[kind]++;
      for (int i = 0; i < 8; i++) cg->pst_phase[kind][i] += rec.phase_ns[i];
      if (rec.seen_ns && rec.seen_ns < 1000000000u) {
        cg->pst_nseen++;
        cg->pst_seen += rec.seen_ns;
      }
      if (rec.status == EPD_ERR_TIMEOUT || rec.status == EPD_ERR_PEER) {
        if (grp)
          eng_emit(eng, rec.status == EPD_ERR_TIMEOUT ? "timeout" : "error", grp, r, 0, 0, 0, cg->pstep0 + n,
                   "group %s step %llu: rank %d %s rank %d", cg->name, (unsigned long long)(cg->pstep0 + n),
                   r, rec.status == EPD_ERR_TIMEOUT ? "timed out waiting for" : "gave up waiting for",
                   rec.peer);
      }
    }
    if (mine) c->ops++;
  }
  return 1;
}

/* (mu) Every kernel of grp returned: books, ring positions, reset after a failure; launch mode owns it. */
static void pers_takeover(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int self_dev) {
  (void)be;
  (void)self_dev;
  uint64_t maxidx = cg->pidx, maxops = 0, minops = UINT64_MAX;
  int reset = 0;
  const char *why = NULL;
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    cuda_grank_t *gr = &cg->rk[r];
    volatile epd_k_pprog_t *pr = gr->pprog;
    pers_account(eng, cg, r);
    uint64_t ix = pr->exited ? pr->exit_index : 0;
    if (pr->announced > ix) ix = pr->announced;
    if (ix > maxidx) maxidx = ix;
    if (!pr->exited || pr->reason == EPD_K_PEXIT_ERROR || pr->reason == EPD_K_PEXIT_SYNC_TIMEOUT) reset = 1;
    if (pr->exited && pr->reason < sizeof pexit_name / sizeof *pexit_name && pr->reason != EPD_K_PEXIT_PEER &&
        (!why || pr->reason != EPD_K_PEXIT_LIMIT))
      why = pexit_name[pr->reason];
    if (gr->pacct > maxops) maxops = gr->pacct;
    if (gr->pacct < minops) minops = gr->pacct;
    if (gr->pcc) {
      if (pr->exited) gr->pcc->next_slot = pr->slot % EPD_QUEUE_SLOTS;
      gr->pcc->busy = 0;
      gr->pcc = NULL;
    }
    for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
      if (pr->bank_ver[b]) cg->bank_map_version[b] = pr->bank_ver[b];
  }
  if (minops != maxops) reset = 1; /* ranks disagree on what ran: start the team over */
  /* The abort word cut waits short: an op may have ended half done on some rank, whatever reason the
   * kernels gave (a controller that saw the abort first reports LIMIT) */
  if (cg->pabort) reset = 1;
  if (cg->pst_n >= 64) {
    EPD_LOGI(EPD_SUB_CUDA,
             "group %s: %llu ops in persistent kernels, mean per op and rank: seen -> all ranks agreed "
             "%.2f us, agreed -> completion %.2f us (latency_ns %.2f us)",
             cg->name, (unsigned long long)cg->pst_n, cg->pst_agree / 1e3 / cg->pst_n,
             cg->pst_run / 1e3 / cg->pst_n, cg->pst_lat / 1e3 / cg->pst_n);
    if (cg->pst_nseen)
      EPD_LOGI(EPD_SUB_CUDA, "group %s: %llu ops stamped by the client: submit -> seen by the kernel %.2f us",
               cg->name, (unsigned long long)cg->pst_nseen, cg->pst_seen / 1e3 / cg->pst_nseen);
    for (int k = 0; k < 2; k++) {
      if (!cg->pst_opn[k]) continue;
      double m[8];
      for (int i = 0; i < 8; i++) m[i] = cg->pst_phase[k][i] / 1e3 / cg->pst_opn[k];
      EPD_LOGI(
          EPD_SUB_CUDA,
          "group %s: %s timeline, us after the op's release to the blocks (block 0; 0: not stamped): body "
          "start %.2f, sent %.2f, fenced %.2f, flagged %.2f, peers' flags %.2f, received %.2f, block 0 done "
          "%.2f, "
          "completion %.2f",
          cg->name, k ? "combine" : "dispatch", m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]);
    }
    cg->pst_n = cg->pst_nseen = cg->pst_seen = cg->pst_agree = cg->pst_run = cg->pst_lat = 0;
    memset(cg->pst_opn, 0, sizeof cg->pst_opn);
    memset(cg->pst_phase, 0, sizeof cg->pst_phase);
  }
  cg->pidx = maxidx;
  if (cg->grp) cg->grp->steps = cg->pstep0 + maxops;
  if (maxops == 0 && why == pexit_name[EPD_K_PEXIT_OP]) {
    if (cg->pzero < 8) cg->pzero++;
    cg->presume_step = (cg->grp ? cg->grp->steps : 0) + (1u << cg->pzero);
  } else if (maxops) {
    cg->pzero = 0;
    cg->presume_step = 0;
  }
  if (reset) {
    /* the launch mode resets the team before its next step (rank threads, no lock held) */
    cg->need_reset = 1;
    for (int r = 0; r < EPD_MAX_RANKS; r++) cg->reset_done[r] = 0;
    EPD_LOGI(EPD_SUB_CUDA,
             "group %s: persistent kernels stopped after %s at step %llu; the team is reset before "
             "its next step",
             cg->name, why ? why : "a failure", (unsigned long long)(cg->grp ? cg->grp->steps : 0));
  } else {
    EPD_LOGD(EPD_SUB_CUDA, "group %s: persistent kernels stopped (%s) at step %llu", cg->name,
             why ? why : "stop asked", (unsigned long long)(cg->grp ? cg->grp->steps : 0));
  }
  cg->pstate = PS_OFF;
}

/* (mu) Whether a running group must leave persistent mode (the reason), or NULL. */
static const char *pers_stop_reason(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, uint64_t now) {
  eng_group_t *grp = cg->grp;
  if (!grp) return "the group is gone";
  if (eng->draining) return "draining";
  if (epd_engine_failure(eng)) return "engine failure";
  if (grp->has_staged) return "a map is staged";
  uint64_t wait_ann = 0;
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    cuda_grank_t *gr = &cg->rk[r];
    eng_client_t *c = grp->client[r];
    if (!c || c->be != gr->pcc || grp->lost[r] || c->hung) return "a client left";
    volatile epd_k_pprog_t *pr = gr->pprog;
    if (pr->exited) return "a kernel stopped";
    uint64_t ann = pr->announced;
    if (ann > pr->taken && ann > wait_ann) wait_ann = ann;
  }
  /* a rank announced an op and waits for a peer whose client does not submit: the launch mode's step
   * timeout applies (from when the wait began) */
  if (!wait_ann) {
    cg->pwait_ann = 0;
  } else if (cg->pwait_ann != wait_ann) {
    cg->pwait_ann = wait_ann;
    cg->pwait_ns = now;
  } else if (now > cg->pwait_ns && now - cg->pwait_ns > be->timeout_ns) {
    cg->pcarry_ns = cg->pwait_ns;
    return "a peer's client does not submit";
  }
  /* watchdog: a SUBMITTED slot no kernel announced for a step timeout (the kernel is not running) */
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    cuda_grank_t *gr = &cg->rk[r];
    volatile epd_k_pprog_t *pr = gr->pprog;
    uint64_t ann = pr->announced;
    if (!gr->pcc || ann != pr->taken || ann != gr->pwatch_ann || !head_slot(gr->pcc)) {
      gr->pwatch_ann = ann;
      gr->pwatch_ns = now;
    } else if (now > gr->pwatch_ns && now - gr->pwatch_ns > be->timeout_ns) {
      EPD_LOGW(EPD_SUB_CUDA,
               "group %s rank %u: a submitted slot was not taken by its persistent kernel for %u ms",
               cg->name, r, eng->o.step_timeout_ms);
      return "a kernel does not take its slot";
    }
  }
  return NULL;
}

/* (mu) Drive grp's persistent state; 1 if something moved. */
int pers_poll(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int self_dev, uint64_t now) {
  if (be->mode != MODE_PERSISTENT) return 0;
  if (cg->pstate == PS_OFF) return pers_eligible(eng, be, cg) ? pers_start(eng, be, cg, self_dev, now) : 0;
  int busy = 0;
  uint64_t minops = UINT64_MAX;
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    busy |= pers_account(eng, cg, (int)r);
    if (cg->rk[r].pacct < minops) minops = cg->rk[r].pacct;
  }
  if (cg->grp && minops != UINT64_MAX) cg->grp->steps = cg->pstep0 + minops;
  if (cg->pstate == PS_RUN) {
    const char *why = pers_stop_reason(eng, be, cg, now);
    if (why) {
      pers_stop(cg, now, why);
      busy = 1;
    }
  }
  if (cg->pstate != PS_STOP) return busy;
  int all = 1;
  for (uint32_t r = 0; r < cg->g.num_ranks; r++) {
    cuda_grank_t *gr = &cg->rk[r];
    if (!gr->prun) continue;
    cudaError_t e = cudaEventQuery(gr->pev);
    if (e == cudaErrorNotReady) {
      all = 0;
      continue;
    }
    gr->prun = 0;
    be->rank[r].pblocks -= grp_blocks(cg);
    if (e != cudaSuccess) {
      EPD_LOGE(EPD_SUB_CUDA, "rank %u group %s: persistent kernel failed: %s", r, cg->name,
               cudaGetErrorString(e));
      eng->rank[r].errors++;
      eng_fail(eng, "rank %u: persistent kernel failed: %s", r, cudaGetErrorString(e));
    }
  }
  if (all) {
    pers_takeover(eng, be, cg, self_dev);
    return 1;
  }
  /* Every wait of the kernels is bounded; past the step timeout, make the flag waits give up. */
  /* (now was read before the lock: another thread may have stamped the stop later) */
  uint64_t since = now > cg->pstop_ns ? now - cg->pstop_ns : 0;
  if (!cg->pabort && since > be->timeout_ns + 1000000000ull) {
    EPD_LOGW(EPD_SUB_CUDA,
             "group %s: persistent kernels still running %.1f s after the stop: aborting their waits",
             cg->name, since / 1e9);
    for (uint32_t r = 0; r < cg->g.num_ranks; r++)
      if (cg->rk[r].pctl) __atomic_store_n(&cg->rk[r].pctl->abort, r + 1, __ATOMIC_SEQ_CST);
    cg->pabort = 1;
  } else if (cg->pabort == 1 && since > 5 * be->timeout_ns + 5000000000ull) {
    eng_fail(eng, "group %s: persistent kernels do not stop", cg->name);
    cg->pabort = 2;
  }
  return busy;
}

/* (mu) Stop the persistent kernels of `only` (NULL: every group) and wait until they returned (bounded):
 * before CUDA calls that may synchronise a device (allocation, registration, release), which would
 * otherwise wait for them, and when a map is staged. */
void pers_quiesce(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *only) {
  if (be->mode != MODE_PERSISTENT) return;
  int dev = 0;
  cudaGetDevice(&dev);
  uint64_t t0 = eng_now_ns();
  for (;;) {
    int left = 0;
    uint64_t now = eng_now_ns();
    for (uint32_t i = 0; i < be->ngrp; i++) {
      cuda_grp_t *cg = &be->grp[i];
      if (!cg->used || cg->pstate == PS_OFF || (only && cg != only)) continue;
      if (cg->pstate == PS_RUN)
        pers_stop(cg, now, only ? "a map is staged" : eng->draining ? "draining" : "device-wide CUDA call");
      pers_poll(eng, be, cg, dev, now);
      left |= cg->pstate != PS_OFF;
    }
    if (!left) break;
    if (now - t0 > 6 * be->timeout_ns + 6000000000ull) {
      eng_fail(eng, "persistent kernels do not stop");
      break;
    }
    eng_sleep_ns(20000);
  }
  cudaSetDevice(dev);
}
void pers_quiesce_all(epd_engine_t *eng, cuda_be_t *be) {
  pers_quiesce(eng, be, NULL);
}

#endif /* EPD_WITH_CUDA */
