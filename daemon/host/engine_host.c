/*
 * engine_host.c - the host backend: every rank is a thread, every client's queue and arena is a memfd
 * shared with the client, and a step is executed by the reference (ref.c) directly on the mapped arenas.
 *
 * Matching: a rank thread polls the queues of its rank's clients in ring order. A submitted slot joins
 * the step its group is collecting (the k-th op of each rank is step k). The rank thread whose client
 * completes the set executes the step for all ranks and completes every rank's slot with the same
 * status, step and map version. A step that waits longer than step_timeout_ms fails with
 * EPD_ERR_TIMEOUT naming the first missing rank; a client that leaves mid-step fails it with
 * EPD_ERR_PEER naming its rank.
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
#include "net/scaleout.h"

/* Polling: spin a little, then sleep longer the longer the rank has been idle, so that steps in a busy
 * loop see microseconds of latency and an idle daemon uses almost no CPU (the first op after a second
 * of idleness pays up to a millisecond). */
#define SPIN_POLLS 256        /* busy polls before the first sleep */
#define SHORT_SLEEP_NS 5000   /* idle less than WARM_NS */
#define MID_SLEEP_NS 100000   /* idle less than COLD_NS */
#define LONG_SLEEP_NS 1000000 /* idle longer (a rank without clients blocks instead) */
#define WARM_NS 100000000ull
#define COLD_NS 1000000000ull

typedef struct host_rank {
  epd_engine_t *eng;
  int rank;
  pthread_t th;
  int started;
} host_rank_t;

/* A group's step being collected (grp->be, made at its first client's allocation). */
typedef struct host_grp {
  uint32_t narrived;
  int arrived[EPD_MAX_RANKS];
  epd_desc_t desc[EPD_MAX_RANKS];
  uint64_t arrive_ns[EPD_MAX_RANKS];
  uint64_t first_arrive_ns;
} host_grp_t;
#define HG(grp) ((host_grp_t *)(grp)->be)

typedef struct host_be {
  atomic_int stop;
  pthread_cond_t attached; /* signalled (under eng->mu) when a client attaches: wakes client-less ranks */
  host_rank_t rank[EPD_MAX_RANKS];
} host_be_t;

static int host_available(char *why, size_t whylen) {
  return 1;
}
static const char *host_mode(const epd_engine_t *eng) {
  return "host-threads";
}
static int host_device(const epd_engine_t *eng, int rank) {
  return -1;
}
static uint64_t host_rank_bytes(const epd_engine_t *eng, int rank) {
  return 0;
}

/* ---- step completion ---------------------------------------------------------------------------- */

/* Complete the slot a client submitted for the current step. */
static void complete_slot(epd_engine_t *eng, eng_client_t *c, const epd_desc_t *d, int status, int peer,
                          uint32_t map_version, uint32_t num_recv, uint64_t step, uint64_t latency_ns,
                          uint64_t bytes, uint64_t masked) {
  epd_queue_t *q = c->queue;
  epd_slot_t *s = &q->slot[c->next_slot];
  epd_comp_t comp;
  memset(&comp, 0, sizeof comp);
  comp.status = status;
  comp.peer = peer;
  comp.map_version = map_version;
  comp.num_recv = num_recv;
  comp.step = step;
  comp.user_tag = d->user_tag;
  comp.latency_ns = latency_ns;
  comp.masked = masked;
  comp.dropped = c->grp->step_dropped[c->rank];
  c->ops++;
  c->next_slot = (c->next_slot + 1) % EPD_QUEUE_SLOTS;
  c->in_step = 0;
  eng_slot_complete(q, s, &comp, c->grp->map.version);
  eng_record_op(eng, c->rank, d->op, status, bytes, latency_ns);
}

/* Finish the step being collected for every arrived rank, then start collecting the next. */
/* masked: the ranks the step ran without (across nodes, those it was routed without: a notice may have
 * changed grp->mask since). */
static void finish_step(epd_engine_t *eng, eng_group_t *grp, int status, int peer, uint32_t map_version,
                        const uint32_t *num_recv, const uint64_t *bytes, uint64_t masked) {
  uint64_t now = eng_now_ns(), last = 0;
  uint32_t R = grp->g.num_ranks;
  int last_rank = -1;
  for (uint32_t r = 0; r < R; r++)
    if (HG(grp)->arrived[r] && HG(grp)->arrive_ns[r] >= last) {
      last = HG(grp)->arrive_ns[r];
      last_rank = (int)r;
    }
  /* Time each rank waited for the last arrival, charged to that peer. */
  if (status == EPD_OK && last_rank >= 0)
    for (uint32_t r = 0; r < R; r++)
      if (HG(grp)->arrived[r]) eng->rank[r].wait_ns_by_peer[last_rank] += last - HG(grp)->arrive_ns[r];
  for (uint32_t r = 0; r < R; r++) {
    if (!HG(grp)->arrived[r]) continue;
    eng_client_t *c = grp->client[r];
    if (c && c->in_step)
      complete_slot(eng, c, &HG(grp)->desc[r], status, peer, map_version, num_recv ? num_recv[r] : 0,
                    grp->steps, now - last, bytes ? bytes[r] : 0, masked);
    HG(grp)->arrived[r] = 0;
  }
  memset(grp->step_dropped, 0, sizeof grp->step_dropped);
  HG(grp)->narrived = 0;
  grp->steps++;
}

static void fail_step(epd_engine_t *eng, eng_group_t *grp, int status, int peer, const char *why) {
  uint32_t op = 0;
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (HG(grp)->arrived[r]) op = HG(grp)->desc[r].op;
  /* A failed dispatch leaves its bank without routing: a combine of it must fail, not reuse old state. */
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (HG(grp)->arrived[r] && HG(grp)->desc[r].bank < EPD_NUM_BANKS) {
      if (eng_op_dispatch(HG(grp)->desc[r].op)) grp->plan_valid[HG(grp)->desc[r].bank] = 0;
      grp->open_banks &= ~(1u << HG(grp)->desc[r].bank); /* its combine fails, or failed */
    }
  const char *kind = status == EPD_ERR_TIMEOUT ? "timeout" : "error";
  eng_emit(eng, kind, grp, peer, 0, 0, 0, grp->steps, "group %s step %llu (op %u) failed: %s: %s", grp->name,
           (unsigned long long)grp->steps, op, eng_result_name(status), why);
  finish_step(eng, grp, status, peer, grp->map.version, NULL, NULL, grp->mask);
}

#ifdef EPD_TEST_HOOKS
/* Test builds only (the epd-faults daemon of the health/failure tests): $EPD_TEST_FAIL_AT_STEP makes the
 * engine fail at that step of any group. */
static void inject_fault(epd_engine_t *eng, const eng_group_t *grp) {
  const char *at = getenv("EPD_TEST_FAIL_AT_STEP");
  const uint64_t n = at ? strtoull(at, NULL, 10) : 0;
  if (n && grp->steps + 1 >= n)
    eng_fail(eng, "fault injected at step %llu of group %s ($EPD_TEST_FAIL_AT_STEP)",
             (unsigned long long)grp->steps, grp->name);
}
#else
static void inject_fault(epd_engine_t *eng, const eng_group_t *grp) {}
#endif

/* Execute a step all ranks have submitted. */
static void execute_step(epd_engine_t *eng, eng_group_t *grp) {
  const epd_ref_geom_t *g = &grp->g;
  uint32_t R = g->num_ranks;
  char why[256] = "";
  inject_fault(eng, grp);
  if (epd_engine_failure(eng)) {
    snprintf(why, sizeof why, "the engine failed: %s", epd_engine_failure(eng));
    return fail_step(eng, grp, EPD_ERR_INTERNAL, -1, why);
  }
  /* Descriptor checks, in the order of the contract: bad op or bank, then agreement. Masked ranks take
   * no part. */
  const uint64_t mask = grp->mask;
#define LIVE(r) (!(mask >> (r)&1))
  uint32_t first = 0;
  while (first < R && !LIVE(first)) first++;
  for (uint32_t r = 0; r < R; r++) {
    if (!LIVE(r)) continue;
    const epd_desc_t *d = &HG(grp)->desc[r];
    if (!eng_op_ok(d->op)) {
      snprintf(why, sizeof why, "rank %u: op %u out of range [1, %u]", r, d->op, EPD_OP_MAX - 1);
      return fail_step(eng, grp, EPD_ERR_INVALID, (int)r, why);
    }
    if (d->bank >= EPD_NUM_BANKS) {
      snprintf(why, sizeof why, "rank %u: bank %u out of range [0, %u)", r, d->bank, EPD_NUM_BANKS);
      return fail_step(eng, grp, EPD_ERR_INVALID, (int)r, why);
    }
    const int fl = eng_check_flags(d, r, 0, why, sizeof why);
    if (fl) return fail_step(eng, grp, fl, (int)r, why);
  }
  const epd_desc_t *d0 = &HG(grp)->desc[first];
  for (uint32_t r = first + 1; r < R; r++) {
    const epd_desc_t *d = &HG(grp)->desc[r];
    if (!LIVE(r)) continue;
    if (d->op != d0->op || d->bank != d0->bank || (eng_op_dispatch(d->op) && d->flags != d0->flags)) {
      snprintf(why, sizeof why,
               "rank %u submitted op %u bank %u flags 0x%x, rank %u op %u bank %u flags 0x%x", r, d->op,
               d->bank, d->flags, first, d0->op, d0->bank, d0->flags);
      return fail_step(eng, grp, EPD_ERR_MISMATCH, (int)r, why);
    }
  }
  uint32_t op = d0->op, bank = d0->bank;
  int fp8 = (d0->flags & EPD_DESC_FP8) != 0;
  int mode = (op == EPD_OP_LL_DISPATCH || op == EPD_OP_LL_COMBINE) ? EPD_MODE_LL : EPD_MODE_HT;
  epd_ref_plan_t *plan = &grp->plan[bank];
  uint32_t num_recv[EPD_MAX_RANKS] = {0};
  uint64_t bytes[EPD_MAX_RANKS] = {0};
  epd_result_t rc;
  int bad = -1;
  if (eng_op_dispatch(op)) {
    if (fp8 && g->hidden % 128) {
      snprintf(why, sizeof why, "FP8 dispatch needs hidden a multiple of 128 (hidden %u)", g->hidden);
      return fail_step(eng, grp, EPD_ERR_INVALID, -1, why);
    }
    eng_apply_staged_map(eng, grp);
    epd_ref_in_t in[EPD_MAX_RANKS];
    epd_ref_out_t outs[EPD_MAX_RANKS], *out[EPD_MAX_RANKS];
    for (uint32_t r = 0; r < R; r++) {
      eng_client_t *c = grp->client[r];
      if (!LIVE(r)) { /* no tokens from it, none to it (the masked map has no replica there) */
        memset(&in[r], 0, sizeof in[r]);
        out[r] = NULL;
        continue;
      }
      eng_ref_io(c, mode, bank, HG(grp)->desc[r].num_tokens, &in[r], &outs[r]);
      out[r] = &outs[r];
    }
    grp->plan_valid[bank] = 0;
    plan->renormalize = grp->renormalize;
    rc = epd_ref_plan_build(plan, eng_route_map(grp), in, &bad, why, sizeof why);
    if (rc) return fail_step(eng, grp, rc, bad, why);
    if (mode == EPD_MODE_LL) {
      rc = epd_ref_ll_dispatch(plan, in, fp8, out);
      for (uint32_t r = 0; r < R; r++) num_recv[r] = plan->ll_recv[r];
    } else {
      if (d0->flags & EPD_DESC_HT_DENSE) epd_ref_ht_dense(plan);
      rc = epd_ref_ht_dispatch(plan, in, fp8, out, &bad);
      for (uint32_t r = 0; r < R; r++) num_recv[r] = plan->ht_recv[r];
    }
    if (rc) {
      if (rc == EPD_ERR_OVERFLOW)
        snprintf(why, sizeof why, "rank %d would receive %u tokens, HT capacity %u", bad, plan->ht_recv[bad],
                 g->ht_capacity);
      else
        snprintf(why, sizeof why, "dispatch failed");
      eng_emit(eng, "error", grp, bad, 0, 0, 0, grp->steps, "group %s step %llu: %s: %s", grp->name,
               (unsigned long long)grp->steps, eng_result_name(rc), why);
      return finish_step(eng, grp, rc, bad, plan->map_version, num_recv, NULL, mask);
    }
    grp->plan_valid[bank] = 1;
    uint64_t row = (uint64_t)g->hidden * (fp8 ? 1 : 2) + (fp8 ? epd_ref_scale_blocks(g->hidden) * 4 : 0);
    for (uint32_t src = 0; src < R; src++) {
      uint64_t rows = 0;
      for (uint32_t t = 0; t < plan->num_tokens[src]; t++) {
        if (mode == EPD_MODE_LL) {
          for (uint32_t k = 0; k < g->topk; k++)
            rows += plan->dst_rank[((size_t)src * g->max_tokens + t) * g->topk + k] >= 0;
        } else {
          for (uint32_t r = 0; r < R; r++)
            rows += plan->ht_pos[((size_t)src * g->max_tokens + t) * R + r] >= 0;
        }
      }
      bytes[src] = rows * row;
    }
    for (uint32_t r = 0; r < R; r++) {
      grp->step_dropped[r] = plan->dropped[r];
      grp->entries_dropped += plan->dropped[r];
    }
    grp->plan_mask[bank] = mask;
    grp->open_banks |= 1u << bank;
    for (uint32_t e = 0; e < g->num_experts; e++) grp->expert_tokens[e] += plan->expert_tokens[e];
    for (size_t i = 0; i < (size_t)R * g->slots_per_rank; i++) grp->slot_tokens[i] += plan->slot_tokens[i];
    return finish_step(eng, grp, EPD_OK, -1, plan->map_version, num_recv, bytes, mask);
  }
  /* Combine: the routing of this bank's dispatch. */
  if (!grp->plan_valid[bank] || plan->mode != mode) {
    snprintf(why, sizeof why, "%s combine of bank %u without a successful %s dispatch of that bank",
             mode == EPD_MODE_LL ? "LL" : "HT", bank, mode == EPD_MODE_LL ? "LL" : "HT");
    return fail_step(eng, grp, EPD_ERR_STATE, -1, why);
  }
  const uint16_t *y[EPD_MAX_RANKS];
  uint16_t *o[EPD_MAX_RANKS];
  /* Ranks masked since the dispatch: their expert outputs are gone, their entries dropped. */
  const uint64_t gone = mask & ~grp->plan_mask[bank];
  grp->open_banks &= ~(1u << bank);
  for (uint32_t r = 0; r < R; r++) {
    if (!LIVE(r)) {
      y[r] = NULL;
      o[r] = NULL;
      continue;
    }
    grp->step_dropped[r] = plan->dropped[r]; /* its dispatch's, and those of the ranks gone since */
    if (gone) {
      const uint32_t n = epd_ref_plan_routed_to(plan, r, gone);
      grp->step_dropped[r] += n;
      grp->entries_dropped += n;
    }
    y[r] = eng_ref_y(grp->client[r], mode, bank);
    o[r] = eng_buf(grp->client[r], EPD_BUF_OUT, bank);
    bytes[r] = (uint64_t)(mode == EPD_MODE_LL ? plan->ll_recv[r] : plan->ht_recv[r]) * g->hidden * 2;
    num_recv[r] = mode == EPD_MODE_LL ? plan->ll_recv[r] : plan->ht_recv[r];
  }
  rc = mode == EPD_MODE_LL ? epd_ref_ll_combine(plan, y, o) : epd_ref_ht_combine(plan, y, o);
  if (rc) return fail_step(eng, grp, rc, -1, "combine failed");
  finish_step(eng, grp, EPD_OK, -1, plan->map_version, num_recv, bytes, mask);
#undef LIVE
}

/* ---- polling ------------------------------------------------------------------------------------ */

/* Scale-out (net/step.c): run the step once the local ranks and the other nodes' parts are in. */
static int net_progress(epd_engine_t *eng, eng_group_t *grp) {
  eng_net_result_t res;
  if (!eng_net_step(eng, grp, HG(grp)->arrived, HG(grp)->desc, &res)) return 0;
  if (res.status == EPD_OK)
    finish_step(eng, grp, EPD_OK, -1, res.map_version, res.num_recv, res.bytes, res.mask);
  else
    fail_step(eng, grp, res.status, res.peer, res.why);
  return 1;
}

static uint32_t first_arrived(const eng_group_t *grp) {
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (HG(grp)->arrived[r]) return r;
  return 0;
}

/* Look at one client of this rank; returns 1 if it did something. */
static int progress(epd_engine_t *eng, eng_client_t *c, uint64_t now) {
  eng_group_t *grp = c->grp;
  if (c->in_step) {
    if (eng->o.nodes > 1 && net_progress(eng, grp)) return 1;
    if (now - HG(grp)->first_arrive_ns <= (uint64_t)eng->o.step_timeout_ms * 1000000ull) return 0;
    char why[256];
    int present[EPD_MAX_RANKS]; /* a masked rank is not waited for */
    for (uint32_t r = 0; r < grp->g.num_ranks; r++) present[r] = HG(grp)->arrived[r] || (grp->mask >> r & 1);
    int missing = eng_timeout_rank(eng, present, grp->g.num_ranks, why, sizeof why);
    if (eng->o.nodes > 1) missing = eng_net_missing_rank(eng, grp, HG(grp)->arrived, why, sizeof why);
    eng_mark_hung(grp, missing);
    fail_step(eng, grp, EPD_ERR_TIMEOUT, missing, why);
    /* groups that mask: a rank of this node (another node masks its own ranks) */
    if (eng_local_rank(eng, missing) && !eng_net_last_live_here(eng, grp, missing))
      eng_mask_rank(eng, grp, missing, "hung past engine.step_timeout_ms");
    return 1;
  }
  epd_slot_t *s = &c->queue->slot[c->next_slot];
  if (eng_slot_state(s) != EPD_SLOT_SUBMITTED) return 0;
  epd_desc_t d = s->desc;
  if (HG(grp)->narrived == 0 && eng->draining && eng_op_dispatch(d.op)) {
    /* draining: no new dispatch; the combines of dispatches that ran still run, and a combine of this
     * refused one fails (EPD_ERR_STATE), not on the bank's older routing */
    if (d.bank < EPD_NUM_BANKS) grp->plan_valid[d.bank] = 0;
    c->in_step = 1;
    complete_slot(eng, c, &d, EPD_ERR_DRAINING, -1, grp->map.version, 0, grp->steps, 0, 0, grp->mask);
    return 1;
  }
  int r = c->rank;
  if (grp->mask >> r & 1) { /* masked: its next dispatch rejoins the group, at a step boundary */
    /* across nodes also before this node sent its part of the step (it was routed without the rank) */
    const int boundary = !grp->open_banks && eng_op_dispatch(d.op) &&
                         (HG(grp)->narrived == 0 || eng_op_dispatch(HG(grp)->desc[first_arrived(grp)].op)) &&
                         (eng->o.nodes <= 1 || eng_net_first_unsent(grp) == grp->steps);
    if (!eng_op_dispatch(d.op)) {
      c->in_step = 1;
      complete_slot(eng, c, &d, EPD_ERR_PEER, r, grp->map.version, 0, grp->steps, 0, 0, grp->mask);
      EPD_LOGW(EPD_SUB_ENGINE, "group %s rank %d is masked: its op %u fails; its next dispatch rejoins",
               grp->name, r, d.op);
      return 1;
    }
    if (!boundary) return 0; /* wait for the combines of the dispatches that ran without it */
    eng_unmask_rank(eng, grp, r);
  }
  c->hung = 0;
  HG(grp)->arrived[r] = 1;
  HG(grp)->desc[r] = d;
  HG(grp)->arrive_ns[r] = now;
  if (HG(grp)->narrived++ == 0) HG(grp)->first_arrive_ns = now;
  c->in_step = 1;
  char why[128];
  int lost = eng_lost_rank(grp, why, sizeof why);
  if (lost >= 0) {
    fail_step(eng, grp, EPD_ERR_PEER, lost, why);
    return 1;
  }
  if (eng->o.nodes > 1)
    net_progress(eng, grp);
  else if (HG(grp)->narrived == eng_live_ranks(grp))
    execute_step(eng, grp);
  return 1;
}

static void *rank_main(void *arg) {
  host_rank_t *hr = arg;
  epd_engine_t *eng = hr->eng;
  host_be_t *be = eng->be;
  eng_rank_thread_init("epd-rank", hr->rank);
  unsigned idle_polls = 0;
  uint64_t idle_since = eng_now_ns();
  while (!atomic_load(&be->stop)) {
    int busy = 0, nclients = 0;
    uint64_t now = eng_now_ns();
    pthread_mutex_lock(&eng->mu);
    for (eng_client_t *c = eng->clients; c; c = c->next)
      if (c->rank == hr->rank && c->queue) {
        nclients++;
        busy |= progress(eng, c, now);
      }
    if (!nclients) {
      /* Nothing to poll: block until an attach (or a periodic look at the stop flag). */
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 100000000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&be->attached, &eng->mu, &ts);
      pthread_mutex_unlock(&eng->mu);
      idle_polls = 0;
      idle_since = eng_now_ns();
      continue;
    }
    pthread_mutex_unlock(&eng->mu);
    if (busy) {
      idle_polls = 0;
      idle_since = now;
      continue;
    }
    if (++idle_polls < SPIN_POLLS) continue;
    uint64_t idle = now - idle_since;
    eng_sleep_ns(idle > COLD_NS ? LONG_SLEEP_NS : idle > WARM_NS ? MID_SLEEP_NS : SHORT_SLEEP_NS);
  }
  return NULL;
}

/* ---- backend ops -------------------------------------------------------------------------------- */

static void host_destroy(epd_engine_t *eng);

static epd_result_t host_create(epd_engine_t *eng, char *err, size_t errlen) {
  host_be_t *be = calloc(1, sizeof *be);
  if (!be) return EPD_ERR_NOMEM;
  eng->be = be;
  pthread_cond_init(&be->attached, NULL);
  for (int r = 0; r < eng->o.num_ranks; r++) {
    host_rank_t *hr = &be->rank[r];
    hr->eng = eng;
    hr->rank = (int)eng->o.node_rank * eng->o.num_ranks + r; /* world rank (scale-out) */
    int e = pthread_create(&hr->th, NULL, rank_main, hr);
    if (e) {
      snprintf(err, errlen, "pthread_create for rank %d: %s", r, strerror(e));
      host_destroy(eng);
      return EPD_ERR_SYSTEM;
    }
    hr->started = 1;
  }
  /* Scale-out: the core's hooks, and expert maps from the other nodes (daemon/net/). */
  if (eng->o.nodes > 1) eng->so = &eng_net_scaleout;
  epd_result_t rc = eng->o.nodes > 1 ? eng_net_ctl_start(eng, err, errlen) : EPD_OK;
  if (rc) host_destroy(eng);
  return rc;
}

static void host_destroy(epd_engine_t *eng) {
  host_be_t *be = eng->be;
  if (!be) return;
  if (eng->o.nodes > 1) eng_net_ctl_stop(eng);
  atomic_store(&be->stop, 1);
  for (int r = 0; r < EPD_MAX_RANKS; r++)
    if (be->rank[r].started) pthread_join(be->rank[r].th, NULL);
  /* Fail what is in flight so that a client still polling sees an answer. */
  pthread_mutex_lock(&eng->mu);
  for (eng_group_t *g = eng->groups; g; g = g->next)
    if (HG(g) && HG(g)->narrived)
      finish_step(eng, g, EPD_ERR_CLOSED, -1, g->map.version, NULL, NULL, g->mask);
  pthread_mutex_unlock(&eng->mu);
  pthread_cond_destroy(&be->attached);
  free(be);
  eng->be = NULL;
}

static epd_result_t host_client_alloc(epd_engine_t *eng, eng_client_t *c, char *err, size_t errlen) {
  void *q = NULL, *a = NULL;
  if (!c->grp->be && !(c->grp->be = calloc(1, sizeof(host_grp_t)))) {
    snprintf(err, errlen, "out of memory for the group's step state");
    return EPD_ERR_NOMEM;
  }
  c->queue_fd = eng_client_memfd(c, "queue", c->queue_bytes, &q, err, errlen);
  if (c->queue_fd < 0) return EPD_ERR_SYSTEM;
  c->arena_fd = eng_client_memfd(c, "arena", c->arena_bytes, &a, err, errlen);
  if (c->arena_fd < 0) {
    munmap(q, c->queue_bytes);
    close(c->queue_fd);
    c->queue_fd = -1;
    return EPD_ERR_SYSTEM;
  }
  c->queue = q;
  c->arena = a;
  eng_queue_init(c, q); /* fresh memfd pages are zero: every slot FREE */
  pthread_cond_broadcast(&((host_be_t *)eng->be)->attached);
  return EPD_OK;
}

static void host_client_leave(epd_engine_t *eng, eng_client_t *c, int lost) {
  eng_group_t *grp = c->grp;
  int r = c->rank;
  /* across nodes, a group that stays here without this rank's client: the other nodes fail its steps at
   * once from the first one whose part was not sent (not after their step timeout) */
  const int mask = grp->on_rank_loss == EPD_RANK_LOSS_MASK && !eng_net_last_live_here(eng, grp, r);
  /* (a last live rank that detaches is not told: in a group that masks, telling it made two nodes whose
   * last workers ended their steps each take the other out and step alone) */
  const int gone = lost && !mask;
  if (gone && eng->o.nodes > 1 && !eng_last_client(grp, c))
    eng_net_rank_lost(eng, grp, r, eng_net_first_unsent(grp));
  if (c->in_step) {
    /* Its slot is going away: withdraw it from the step, never write there again. */
    HG(grp)->arrived[r] = 0;
    HG(grp)->narrived--;
    c->in_step = 0;
  }
  if (gone) grp->lost[r] = 1;
  if (HG(grp)->narrived) {
    char why[160];
    snprintf(why, sizeof why, "client %llu of rank %d %s mid-step", (unsigned long long)c->id, r,
             lost ? "died" : "detached");
    fail_step(eng, grp, EPD_ERR_PEER, r, why);
  }
  /* Groups that mask go on without the rank from the next step (the one in flight failed above); the
   * last client's leave removes the group anyway. */
  if (!eng_last_client(grp, c) && mask)
    eng_mask_rank(eng, grp, r, lost ? "its client died" : "its client detached");
}

static void host_client_free(epd_engine_t *eng, eng_client_t *c) {
  if (c->queue) munmap(c->queue, c->queue_bytes);
  if (c->arena) munmap(c->arena, c->arena_bytes);
  if (c->queue_fd >= 0) close(c->queue_fd);
  if (c->arena_fd >= 0) close(c->arena_fd);
  c->queue = NULL;
  c->arena = NULL;
  c->queue_fd = c->arena_fd = -1;
}

static void host_group_free(eng_group_t *grp) {
  free(grp->be);
  grp->be = NULL;
}

/* A drain refuses a step from its first arrival on: a step some local rank already joined still runs. */
static uint64_t host_drain_step(const eng_group_t *grp) {
  return grp->steps + (HG(grp) && HG(grp)->narrived > 0 ? 1u : 0u);
}

const eng_backend_ops_t eng_host_ops = {
    .name = "host",
    .drain_step = host_drain_step,
    .inter_node_transport = "host-tcp",
    .masks = 2,
    .renormalizes = 1,
    .available = host_available,
    .create = host_create,
    .destroy = host_destroy,
    .mode = host_mode,
    .device = host_device,
    .rank_bytes = host_rank_bytes,
    .client_alloc = host_client_alloc,
    .client_leave = host_client_leave,
    .client_free = host_client_free,
    .group_free = host_group_free,
};
