/*
 * test_experts.c - dynamic expert placement on the host backend, in-process: ranks step continuously
 * while maps (with redundant replicas) change every few hundred microseconds from two threads; every
 * step's routing must equal the reference computed with the map version its completion carries, the
 * worker picks each slot's weights from the mapped map table, and the combine must equal the reference
 * (so no token is lost or doubled). Also: node-preferring replica choice, per-slot counters, weight
 * migration (exact bytes, the switch waits for it), maps that touch a slot being migrated, concurrent
 * SetExpertMap ordering, invalid maps.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/engine.h"
#include "epd.pb-c.h"
#include "control/metrics.h"
#include "core/ref.h"
#include "rpc_client.h"
#include "test.h"

typedef struct xclient {
  epd_attach_info_t info;
  epd_queue_t *q;
  uint8_t *arena;
  uint32_t next;
} xclient_t;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* engine_new: engine.rehome_replicas; xattach: on_rank_loss; the events seen (kinds, ';'-separated). */
static uint32_t x_rehome, x_on_loss;
static pthread_mutex_t x_ev_mu = PTHREAD_MUTEX_INITIALIZER;
static char x_events[2048];
static void x_on_event(void *arg, const epd_engine_event_t *ev) {
  (void)arg;
  pthread_mutex_lock(&x_ev_mu);
  size_t n = strlen(x_events);
  snprintf(x_events + n, sizeof x_events - n, "%s;", ev->kind);
  pthread_mutex_unlock(&x_ev_mu);
}

static epd_engine_t *engine_new(int R, uint32_t rpn) {
  epd_engine_opts_t o;
  memset(&o, 0, sizeof o);
  o.backend = "host";
  o.num_ranks = R;
  o.max_experts = 256;
  o.max_hidden = 4096;
  o.max_topk = 8;
  o.max_tokens = 256;
  o.slots_factor_pct = 200; /* room for redundant replicas */
  o.max_groups = 4;
  o.max_clients_per_rank = 4;
  o.max_arena_bytes = 1ull << 30;
  o.step_timeout_ms = 10000;
  o.ranks_per_node = rpn;
  o.rehome_replicas = x_rehome;
  epd_engine_t *eng = NULL;
  char err[256] = "";
  epd_result_t rc = epd_engine_create(&o, x_on_event, NULL, &eng, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "engine_create: %d %s", rc, err);
  return eng;
}

static void xattach(epd_engine_t *eng, const char *group, int rank, uint32_t E, uint32_t H, uint32_t K,
                    uint32_t M, uint64_t wbytes, xclient_t *c) {
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  snprintf(req.group, sizeof req.group, "%s", group);
  snprintf(req.name, sizeof req.name, "x-r%d", rank);
  req.rank = rank;
  req.num_experts = E;
  req.hidden = H;
  req.topk = K;
  req.max_tokens = M;
  req.pid = (uint32_t)getpid();
  req.weight_bytes_per_slot = wbytes;
  req.on_rank_loss = x_on_loss;
  memset(c, 0, sizeof *c);
  char err[256] = "";
  epd_result_t rc = epd_engine_attach(eng, &req, &c->info, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "attach rank %d: %d %s", rank, rc, err);
  c->q = mmap(NULL, c->info.queue_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.queue_fd, 0);
  c->arena = mmap(NULL, c->info.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.arena_fd, 0);
  ASSERT(c->q != MAP_FAILED && c->arena != MAP_FAILED);
}

static void *xbuf(xclient_t *c, uint32_t kind, uint32_t bank) {
  for (uint32_t i = 0; i < c->info.nbuffers; i++)
    if (c->info.buffers[i].kind == kind && c->info.buffers[i].bank == bank) {
      ASSERT_LE(c->info.buffers[i].offset + c->info.buffers[i].bytes, c->info.arena_bytes);
      return c->arena + c->info.buffers[i].offset;
    }
  epd_test_fail(__FILE__, __LINE__, "buffer kind %u bank %u missing", kind, bank);
}

static void xsubmit(xclient_t *c, uint32_t op, uint32_t T, uint32_t bank) {
  epd_slot_t *s = &c->q->slot[c->next];
  ASSERT_EQ(atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire), EPD_SLOT_FREE);
  memset(&s->desc, 0, sizeof s->desc);
  s->desc.op = op;
  s->desc.num_tokens = T;
  s->desc.bank = bank;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_SUBMITTED, memory_order_release);
}

static epd_comp_t xwait(xclient_t *c) {
  epd_slot_t *s = &c->q->slot[c->next];
  uint64_t end = now_ms() + 20000;
  while (atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire) != EPD_SLOT_DONE) {
    if (now_ms() > end) epd_test_fail(__FILE__, __LINE__, "slot %u not done after 20 s", c->next);
    usleep(5);
  }
  epd_comp_t comp = s->comp;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_FREE, memory_order_release);
  c->next = (c->next + 1) % EPD_QUEUE_SLOTS;
  return comp;
}

/* The map table of a client's queue (epd_abi.h), read like libepd: a seqlock snapshot of this rank's
 * slot -> logical expert row and the version. */
static uint32_t table_slot_experts(xclient_t *c, int rank, int32_t *out, uint32_t S) {
  ASSERT_NE(c->q->map_table_offset, 0);
  const epd_map_table_t *t = (const epd_map_table_t *)((uint8_t *)c->q + c->q->map_table_offset);
  ASSERT_EQ(t->magic, EPD_MAP_TABLE_MAGIC);
  ASSERT_EQ(t->slots_per_rank, S);
  const int32_t *se = (const int32_t *)((const uint32_t *)(t + 1) + t->num_experts +
                                        (size_t)t->num_experts * t->max_replicas * 2);
  for (int tries = 0; tries < 1000000; tries++) {
    uint32_t s1 = atomic_load_explicit((_Atomic uint32_t *)&t->seq, memory_order_acquire);
    if (s1 & 1) continue;
    uint32_t v = t->version;
    memcpy(out, se + (size_t)rank * S, S * 4);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit((_Atomic uint32_t *)&t->seq, memory_order_relaxed) == s1) return v;
  }
  epd_test_fail(__FILE__, __LINE__, "map table never settled");
}

/* A random valid map: every expert once on a random free slot, then extra replicas on free slots. */
static void random_map(epd_expert_map_t *m, uint32_t E, uint32_t R, uint32_t S, uint64_t *rs) {
  uint32_t n = R * S, perm[1024];
  for (uint32_t i = 0; i < n; i++) perm[i] = i;
  for (uint32_t i = n - 1; i > 0; i--) {
    uint32_t j = (uint32_t)(epd_ref_rand(rs) % (i + 1)), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  uint32_t used = 0;
  for (uint32_t e = 0; e < E; e++) {
    m->nrep[e] = 1;
    m->rep[e][0] = (epd_replica_t){perm[used] / S, perm[used] % S};
    used++;
  }
  uint32_t extra = (uint32_t)(epd_ref_rand(rs) % (n - E + 1));
  for (uint32_t i = 0; i < extra; i++) {
    uint32_t e = (uint32_t)(epd_ref_rand(rs) % E);
    if (m->nrep[e] >= EPD_MAX_REPLICAS) continue;
    m->rep[e][m->nrep[e]++] = (epd_replica_t){perm[used] / S, perm[used] % S};
    used++;
  }
}

static float expert_factor(int32_t e) {
  return 0.5f + 0.125f * (float)(e % 8);
}

/* ---- continuous steps while maps change --------------------------------------------------------- */

#define XR 4
#define MAXV 8192
typedef struct xworld {
  epd_engine_t *eng;
  xclient_t c[XR];
  epd_ref_geom_t g;
  uint32_t rpn;
  int steps;
  atomic_int done;
  pthread_mutex_t mu;
  epd_expert_map_t *byver[MAXV]; /* every staged map, by version */
  atomic_uint setters_calls;
  atomic_uint progress; /* steps rank 0 finished: the setters pace themselves on it */
} xworld_t;

typedef struct xarg {
  xworld_t *w;
  int id;
} xarg_t;

static epd_expert_map_t *map_of(xworld_t *w, uint32_t v) {
  ASSERT_LT(v, MAXV);
  uint64_t end = now_ms() + 5000;
  for (;;) {
    pthread_mutex_lock(&w->mu);
    epd_expert_map_t *m = w->byver[v];
    pthread_mutex_unlock(&w->mu);
    if (m) return m;
    /* The setter records a version right after SetExpertMap returns: it may lag the switch a little. */
    if (now_ms() > end) epd_test_fail(__FILE__, __LINE__, "map version %u was never staged", v);
    usleep(10);
  }
}

static void *setter_main(void *arg) {
  xarg_t *a = arg;
  xworld_t *w = a->w;
  uint64_t rs = 1234 + (uint64_t)a->id;
  const epd_ref_geom_t *g = &w->g;
  uint32_t seen = 0;
  while (!atomic_load(&w->done)) {
    /* A new map every 1..3 steps from each setter, at random points of a step. */
    uint32_t wait_for = seen + 1 + (uint32_t)(epd_ref_rand(&rs) % 3);
    while (atomic_load(&w->progress) < wait_for && !atomic_load(&w->done)) usleep(20);
    seen = atomic_load(&w->progress);
    usleep((unsigned)(epd_ref_rand(&rs) % 100));
    epd_expert_map_t *m = calloc(1, sizeof *m);
    m->num_experts = g->num_experts;
    m->num_ranks = g->num_ranks;
    m->slots_per_rank = g->slots_per_rank;
    m->ranks_per_node = w->rpn;
    m->nrep = calloc(g->num_experts, 1);
    m->rep = calloc(g->num_experts, sizeof *m->rep);
    random_map(m, g->num_experts, g->num_ranks, g->slots_per_rank, &rs);
    /* Now and then an invalid map: rejected whole, never half-applied (a later step would show it). */
    int bad = epd_ref_rand(&rs) % 16 == 0;
    if (bad) m->rep[0][0] = m->rep[1][0];
    uint32_t v = 0;
    char err[256] = "";
    pthread_mutex_lock(&w->mu); /* so that map_of never sees a version before its map */
    epd_result_t rc = epd_engine_set_map(w->eng, "x", m, &v, err, sizeof err);
    if (rc == EPD_OK) {
      ASSERT_LT(v, MAXV);
      ASSERT(w->byver[v] == NULL); /* concurrent calls get distinct versions */
      m->version = v;
      w->byver[v] = m;
    }
    pthread_mutex_unlock(&w->mu);
    if (bad) {
      ASSERT_EQ(rc, EPD_ERR_INVALID);
      ASSERT_STR_CONTAINS(err, "is already used by expert 0");
      epd_expert_map_free(m);
      free(m);
    } else {
      ASSERT_OK(rc);
    }
    atomic_fetch_add(&w->setters_calls, 1);
  }
  return NULL;
}

static void *xrank_main(void *arg) {
  xarg_t *a = arg;
  xworld_t *w = a->w;
  int me = a->id;
  xclient_t *c = &w->c[me];
  const epd_ref_geom_t *g = &w->g;
  uint32_t M = g->max_tokens, H = g->hidden, K = g->topk, S = g->slots_per_rank, R = g->num_ranks;
  uint16_t *xs[XR];
  int64_t *is[XR];
  float *ws[XR];
  epd_ref_in_t in[XR];
  for (uint32_t r = 0; r < R; r++) {
    xs[r] = calloc((size_t)M * H, 2);
    is[r] = calloc((size_t)M * K, 8);
    ws[r] = calloc((size_t)M * K, 4);
  }
  size_t rows = (size_t)S * R * M;
  epd_ref_out_t mine;
  memset(&mine, 0, sizeof mine);
  mine.recv_x = calloc(rows, (size_t)H * 2);
  mine.recv_count = calloc(S, 4);
  mine.recv_src = calloc(rows, 4);
  epd_ref_plan_t plan;
  ASSERT_OK(epd_ref_plan_init(&plan, g));
  int32_t slot_expert[64];
  uint32_t last_version = 0;
  for (int step = 0; step < w->steps; step++) {
    uint32_t bank = (uint32_t)step % EPD_NUM_BANKS;
    for (uint32_t r = 0; r < R; r++) {
      uint32_t T = (uint32_t)((uint64_t)step * 7 + r * 13) % (M + 1);
      epd_ref_gen_input(99, (uint64_t)step, r, g, T, step % 3 == 0, xs[r], is[r], ws[r]);
      in[r] = (epd_ref_in_t){T, xs[r], is[r], ws[r]};
    }
    uint32_t T = in[me].num_tokens;
    memcpy(xbuf(c, EPD_BUF_X, bank), xs[me], (size_t)T * H * 2);
    memcpy(xbuf(c, EPD_BUF_TOPK_IDX, bank), is[me], (size_t)T * K * 8);
    memcpy(xbuf(c, EPD_BUF_TOPK_WEIGHTS, bank), ws[me], (size_t)T * K * 4);
    memset(xbuf(c, EPD_BUF_LL_RECV_X, bank), 0x5a, rows * H * 2);
    memset(xbuf(c, EPD_BUF_OUT, bank), 0x5a, (size_t)M * H * 2);
    xsubmit(c, EPD_OP_LL_DISPATCH, T, bank);
    epd_comp_t comp = xwait(c);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_GE(comp.map_version, last_version); /* versions only move forward */
    last_version = comp.map_version;
    /* The mapped table shows the version this step ran with (no switch before our next dispatch). */
    ASSERT_EQ(table_slot_experts(c, me, slot_expert, S), comp.map_version);
    const epd_expert_map_t *m = map_of(w, comp.map_version);
    for (uint32_t s = 0; s < S; s++) {
      int32_t want = -1;
      for (uint32_t e = 0; e < m->num_experts; e++)
        for (uint32_t i = 0; i < m->nrep[e]; i++)
          if (m->rep[e][i].rank == (uint32_t)me && m->rep[e][i].slot == s) want = (int32_t)e;
      ASSERT_EQ(slot_expert[s], want);
    }
    /* Routing equals the reference with that version's map. */
    epd_ref_out_t *outs[XR] = {NULL};
    outs[me] = &mine;
    int bad = -1;
    char why[128];
    ASSERT_OK(epd_ref_plan_build(&plan, m, in, &bad, why, sizeof why));
    ASSERT_OK(epd_ref_ll_dispatch(&plan, in, 0, outs));
    ASSERT_EQ(comp.num_recv, plan.ll_recv[me]);
    int32_t *cnt = xbuf(c, EPD_BUF_LL_RECV_COUNT, bank);
    int32_t *src = xbuf(c, EPD_BUF_LL_RECV_SRC, bank);
    uint16_t *rx = xbuf(c, EPD_BUF_LL_RECV_X, bank), *y = xbuf(c, EPD_BUF_LL_Y, bank);
    for (uint32_t s = 0; s < S; s++) {
      ASSERT_EQ(cnt[s], mine.recv_count[s]);
      size_t base = (size_t)s * R * M;
      ASSERT(!memcmp(src + base, mine.recv_src + base, (size_t)cnt[s] * 4));
      ASSERT(!memcmp(rx + base * H, (uint16_t *)mine.recv_x + base * H, (size_t)cnt[s] * H * 2));
      /* Worker: run the weights of the slot's logical expert, as the table says. */
      ASSERT(cnt[s] == 0 || slot_expert[s] >= 0);
      float f = slot_expert[s] >= 0 ? expert_factor(slot_expert[s]) : 0.f;
      for (size_t j = 0; j < (size_t)cnt[s] * H; j++)
        y[base * H + j] = epd_f32_to_bf16(epd_bf16_to_f32(rx[base * H + j]) * f);
    }
    xsubmit(c, EPD_OP_LL_COMBINE, 0, bank);
    comp = xwait(c);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.map_version, last_version); /* the combine uses its dispatch's map */
    /* OUT[t] = sum over valid distinct k of w * bf16(x * factor(expert)): independent of placement. */
    uint16_t *out = xbuf(c, EPD_BUF_OUT, bank);
    for (uint32_t t = 0; t < T; t++)
      for (uint32_t h = 0; h < H; h++) {
        float acc = 0.f;
        for (uint32_t k = 0; k < K; k++) {
          size_t i = ((size_t)me * M + t) * K + k;
          if (plan.dst_rank[i] < 0) continue;
          int64_t e = is[me][(size_t)t * K + k];
          acc += ws[me][(size_t)t * K + k] *
                 epd_bf16_to_f32(
                     epd_f32_to_bf16(epd_bf16_to_f32(xs[me][(size_t)t * H + h]) * expert_factor((int32_t)e)));
        }
        float got = epd_bf16_to_f32(out[(size_t)t * H + h]);
        if (fabsf(got - acc) > fabsf(acc) / 64 + 1e-3f)
          epd_test_fail(__FILE__, __LINE__, "rank %d step %d token %u h %u: out %g, expected %g (map %u)", me,
                        step, t, h, got, acc, comp.map_version);
      }
    if (me == 0) atomic_fetch_add(&w->progress, 1);
  }
  epd_ref_plan_free(&plan);
  for (uint32_t r = 0; r < R; r++) {
    free(xs[r]);
    free(is[r]);
    free(ws[r]);
  }
  free(mine.recv_x);
  free(mine.recv_count);
  free(mine.recv_src);
  return NULL;
}

static void run_switching(uint32_t rpn, int steps) {
  static xworld_t w; /* big: the version table */
  memset(&w, 0, sizeof w);
  pthread_mutex_init(&w.mu, NULL);
  w.eng = engine_new(XR, rpn);
  w.rpn = rpn;
  w.steps = steps;
  uint32_t E = 10, H = 32, K = 3, M = 12;
  for (int r = 0; r < XR; r++) xattach(w.eng, "x", r, E, H, K, M, 0, &w.c[r]);
  w.g = (epd_ref_geom_t){XR, E, H, K, M, w.c[0].info.slots_per_rank, w.c[0].info.ht_capacity};
  ASSERT_EQ(w.g.slots_per_rank, 5u); /* ceil(10/4 * 2) */
  epd_expert_map_t *v1 = calloc(1, sizeof *v1);
  ASSERT_OK(epd_engine_get_map(w.eng, "x", v1));
  ASSERT_EQ(v1->ranks_per_node, rpn);
  w.byver[1] = v1;
  pthread_t th[XR], st[2];
  xarg_t ra[XR], sa[2];
  for (int i = 0; i < 2; i++) {
    sa[i] = (xarg_t){&w, i};
    pthread_create(&st[i], NULL, setter_main, &sa[i]);
  }
  for (int r = 0; r < XR; r++) {
    ra[r] = (xarg_t){&w, r};
    pthread_create(&th[r], NULL, xrank_main, &ra[r]);
  }
  for (int r = 0; r < XR; r++) pthread_join(th[r], NULL);
  atomic_store(&w.done, 1);
  for (int i = 0; i < 2; i++) pthread_join(st[i], NULL);
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(w.eng, &snap));
  ASSERT_EQ(snap.ngroups, 1u);
  const epd_group_snap_t *gs = &snap.groups[0];
  /* Hundreds of switches happened while stepping; counters add up per expert and per replica. */
  ASSERT_GE(gs->map_switches, (uint64_t)steps / 6);
  uint64_t se = 0, ss = 0;
  for (uint32_t e = 0; e < E; e++) se += gs->expert_tokens[e];
  for (uint32_t i = 0; i < XR * gs->slots_per_rank; i++) ss += gs->slot_tokens[i];
  ASSERT_EQ(se, ss);
  ASSERT_GT(se, 0u);
  char *text = NULL;
  epd_daemon_info_t di;
  memset(&di, 0, sizeof di);
  size_t tlen = 0;
  ASSERT_OK(epd_metrics_text(&snap, &di, &text, &tlen));
  ASSERT_STR_CONTAINS(text, "epd_slot_tokens_total{group=\"x\",rank=\"3\",slot=\"4\"}");
  ASSERT_STR_CONTAINS(text, "epd_map_switches_total{group=\"x\"}");
  free(text);
  fprintf(stderr, "%llu switches over %d steps, %u SetExpertMap calls\n",
          (unsigned long long)gs->map_switches, steps, atomic_load(&w.setters_calls));
  epd_engine_snapshot_free(&snap);
  epd_engine_destroy(w.eng);
  for (int v = 0; v < MAXV; v++)
    if (w.byver[v]) {
      epd_expert_map_free(w.byver[v]);
      free(w.byver[v]);
    }
}

EPD_TEST_T(experts_maps_change_while_stepping, 60) {
  run_switching(0, 1500);
}

/* Two nodes of two ranks: the replica choice prefers the source's node; still equal to the reference. */
EPD_TEST_T(experts_maps_change_two_nodes, 60) {
  run_switching(2, 600);
}

/* ---- replica choice ----------------------------------------------------------------------------- */

EPD_TEST(experts_replica_choice_prefers_node) {
  epd_expert_map_t m;
  ASSERT_OK(epd_ref_map_default(&m, 4, 4, 2));
  m.nrep[0] = 3;
  m.rep[0][0] = (epd_replica_t){0, 1};
  m.rep[0][1] = (epd_replica_t){2, 1};
  m.rep[0][2] = (epd_replica_t){3, 1};
  uint32_t M = 16, cnt[4] = {0};
  /* One node (ranks_per_node 0 or 4): (src * M + t) % nrep over every replica, as before. */
  for (uint32_t rpn = 0; rpn <= 4; rpn += 4) {
    m.ranks_per_node = rpn;
    for (uint32_t src = 0; src < 4; src++)
      for (uint32_t t = 0; t < M; t++) {
        epd_replica_t d = epd_ref_map_dest(&m, M, src, t, 0);
        epd_replica_t want = m.rep[0][(src * M + t) % 3];
        ASSERT_EQ(d.rank, want.rank);
        ASSERT_EQ(d.slot, want.slot);
      }
  }
  /* Two nodes {0,1} {2,3}: node 0 has one replica (rank 0), node 1 two (ranks 2, 3) spread evenly. */
  m.ranks_per_node = 2;
  for (uint32_t src = 0; src < 4; src++)
    for (uint32_t t = 0; t < M; t++) {
      epd_replica_t d = epd_ref_map_dest(&m, M, src, t, 0);
      ASSERT_EQ(d.rank / 2, src / 2);
      cnt[d.rank]++;
    }
  ASSERT_EQ(cnt[0], 2 * M);
  ASSERT_EQ(cnt[1], 0u);
  ASSERT_EQ(cnt[2], M);
  ASSERT_EQ(cnt[3], M);
  /* No replica on the source's node: every replica qualifies. */
  m.nrep[0] = 2;
  m.rep[0][0] = (epd_replica_t){2, 1};
  m.rep[0][1] = (epd_replica_t){3, 1};
  memset(cnt, 0, sizeof cnt);
  for (uint32_t t = 0; t < M; t++) cnt[epd_ref_map_dest(&m, M, 0, t, 0).rank]++;
  ASSERT_EQ(cnt[2], M / 2);
  ASSERT_EQ(cnt[3], M / 2);
  epd_expert_map_free(&m);
}

/* ---- ordering of concurrent SetExpertMap --------------------------------------------------------- */

typedef struct cset_arg {
  epd_engine_t *eng;
  const epd_expert_map_t *m;
  uint32_t versions[50];
} cset_arg_t;

static void *cset_main(void *arg) {
  cset_arg_t *a = arg;
  for (int i = 0; i < 50; i++) {
    char err[256];
    ASSERT_OK(epd_engine_set_map(a->eng, "c", a->m, &a->versions[i], err, sizeof err));
    if (i) ASSERT_GT(a->versions[i], a->versions[i - 1]);
  }
  return NULL;
}

EPD_TEST(experts_concurrent_set_map_serialised) {
  epd_engine_t *eng = engine_new(2, 0);
  xclient_t c[2];
  for (int r = 0; r < 2; r++) xattach(eng, "c", r, 4, 16, 2, 8, 0, &c[r]);
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(eng, "c", &m));
  pthread_t th[4];
  cset_arg_t a[4];
  for (int i = 0; i < 4; i++) {
    a[i].eng = eng;
    a[i].m = &m;
    pthread_create(&th[i], NULL, cset_main, &a[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  /* 200 calls, 200 distinct versions 2..201. */
  uint8_t seen[202] = {0};
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 50; j++) {
      ASSERT(a[i].versions[j] >= 2 && a[i].versions[j] <= 201);
      ASSERT_EQ(seen[a[i].versions[j]]++, 0);
    }
  /* The last staged before the boundary is the one that becomes active. */
  for (int r = 0; r < 2; r++) xsubmit(&c[r], EPD_OP_LL_DISPATCH, 0, 0);
  for (int r = 0; r < 2; r++) ASSERT_EQ(xwait(&c[r]).map_version, 201u);
  /* A map staged while rank 0 already waits in a step applies to that step: the boundary is when the
   * step executes, with every rank's submission in. */
  uint32_t v = 0;
  char err[256];
  xsubmit(&c[0], EPD_OP_LL_DISPATCH, 0, 1);
  usleep(2000);
  ASSERT_OK(epd_engine_set_map(eng, "c", &m, &v, err, sizeof err));
  ASSERT_EQ(v, 202u);
  xsubmit(&c[1], EPD_OP_LL_DISPATCH, 0, 1);
  for (int r = 0; r < 2; r++) ASSERT_EQ(xwait(&c[r]).map_version, 202u);
  /* A combine never switches: a map staged between dispatch and combine waits for the next dispatch. */
  ASSERT_OK(epd_engine_set_map(eng, "c", &m, &v, err, sizeof err));
  for (int r = 0; r < 2; r++) xsubmit(&c[r], EPD_OP_LL_COMBINE, 0, 1);
  for (int r = 0; r < 2; r++) ASSERT_EQ(xwait(&c[r]).map_version, 202u);
  int32_t se[8];
  ASSERT_EQ(table_slot_experts(&c[0], 0, se, c[0].info.slots_per_rank), 202u);
  for (int r = 0; r < 2; r++) xsubmit(&c[r], EPD_OP_LL_DISPATCH, 0, 0);
  for (int r = 0; r < 2; r++) ASSERT_EQ(xwait(&c[r]).map_version, 203u);
  ASSERT_EQ(table_slot_experts(&c[1], 1, se, c[1].info.slots_per_rank), 203u);
  epd_expert_map_free(&m);
  epd_engine_destroy(eng);
}

/* ---- weight migration --------------------------------------------------------------------------- */

static uint8_t pattern(uint32_t rank, uint32_t slot, size_t i) {
  return (uint8_t)(rank * 37 + slot * 11 + i * 7 + (i >> 8));
}

/* engine.rehome_replicas: a masking group of 3 ranks with expert weights; rank 1 dies. Expert 2, on rank 1
 * and on rank 0, gets a new replica on a free slot of rank 2 (the live rank without one), its weights
 * copied byte for byte from rank 0's; expert 3, on rank 1 only, has nothing to copy from: an
 * "experts_lost" event names it. The map switches at the next step of ranks 0 and 2, which then route
 * expert 2 to both its live replicas. Off (the default), nothing is staged. */
EPD_TEST(experts_rehome_masked_replicas) {
  for (int on = 0; on < 2; on++) {
    x_rehome = (uint32_t)on;
    x_on_loss = EPD_RANK_LOSS_MASK;
    epd_engine_t *eng = engine_new(3, 0);
    const uint64_t WB = 2 * 4096 + 40;
    xclient_t c[3];
    for (int r = 0; r < 3; r++) xattach(eng, "rh", r, 6, 16, 2, 8, WB, &c[r]);
    x_on_loss = 0;
    const uint32_t S = c[0].info.slots_per_rank;
    ASSERT_EQ(S, 4u); /* experts 0,1 on rank 0 (slots 0,1), 2,3 on rank 1, 4,5 on rank 2 */
    uint8_t *wt[3];
    for (int r = 0; r < 3; r++) {
      wt[r] = xbuf(&c[r], EPD_BUF_EXPERT_WEIGHTS, 0);
      for (uint32_t s = 0; s < S; s++)
        for (size_t i = 0; i < WB; i++) wt[r][s * WB + i] = pattern((uint32_t)r, s, i);
    }
    /* a second replica of expert 2 on rank 0 slot 2, its weights copied there at the switch */
    epd_expert_map_t m;
    ASSERT_OK(epd_engine_get_map(eng, "rh", &m));
    m.nrep[2] = 2;
    m.rep[2][1] = (epd_replica_t){0, 2};
    epd_weight_copy_t cp = {1, 0, 0, 2};
    uint32_t v = 0;
    char err[320] = "";
    ASSERT_OK(epd_engine_set_map_copies(eng, "rh", &m, &cp, 1, &v, err, sizeof err));
    epd_expert_map_free(&m);
    for (int r = 0; r < 3; r++) xsubmit(&c[r], EPD_OP_LL_DISPATCH, 0, 0);
    for (int r = 0; r < 3; r++) ASSERT_EQ(xwait(&c[r]).map_version, v);
    pthread_mutex_lock(&x_ev_mu);
    x_events[0] = 0;
    pthread_mutex_unlock(&x_ev_mu);
    ASSERT_OK(epd_engine_detach(eng, c[1].info.client_id, 1));
    /* ranks 0 and 2 step on; with re-homing the map switches there */
    for (int r = 0; r < 3; r += 2) xsubmit(&c[r], EPD_OP_LL_DISPATCH, 0, 0);
    uint32_t after = 0;
    for (int r = 0; r < 3; r += 2) {
      epd_comp_t comp = xwait(&c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      ASSERT_EQ(comp.masked, 2u);
      after = comp.map_version;
    }
    ASSERT_OK(epd_engine_get_map(eng, "rh", &m));
    pthread_mutex_lock(&x_ev_mu);
    const int lost_event = strstr(x_events, "experts_lost;") != NULL;
    pthread_mutex_unlock(&x_ev_mu);
    if (!on) {
      ASSERT_EQ(after, v);
      ASSERT_EQ(m.nrep[2], 2u);
      ASSERT(!lost_event);
    } else {
      ASSERT_EQ(after, v + 1);
      ASSERT_EQ(m.nrep[2], 3u);
      ASSERT_EQ(m.rep[2][2].rank, 2u);
      ASSERT_EQ(m.rep[2][2].slot, 2u);
      ASSERT_EQ(m.nrep[3], 1u); /* nothing to copy expert 3 from */
      for (size_t i = 0; i < WB; i++)
        if (wt[2][2 * WB + i] != pattern(1, 0, i))
          epd_test_fail(__FILE__, __LINE__, "byte %zu of (2,2) differs from expert 2's weights", i);
      ASSERT(lost_event);
    }
    for (uint32_t s = 0; s < S && on; s++) /* the other slots of rank 2 untouched */
      if (s != 2) ASSERT_EQ(wt[2][s * WB + 7], pattern(2, s, 7));
    epd_expert_map_free(&m);
    epd_engine_destroy(eng);
  }
  x_rehome = 0;
}

EPD_TEST(experts_migration_copies_exact) {
  epd_engine_t *eng = engine_new(2, 0);
  const uint64_t WB = 3 * 4096 + 24; /* not a power of two */
  xclient_t c[2];
  for (int r = 0; r < 2; r++) xattach(eng, "w", r, 4, 16, 2, 8, WB, &c[r]);
  uint32_t S = c[0].info.slots_per_rank;
  ASSERT_EQ(S, 4u);
  ASSERT_EQ(c[0].info.weight_bytes_per_slot, WB);
  uint8_t *wt[2];
  for (int r = 0; r < 2; r++) {
    wt[r] = xbuf(&c[r], EPD_BUF_EXPERT_WEIGHTS, 0);
    ASSERT_EQ((uintptr_t)wt[r] % 4096, 0u);
    for (uint32_t s = 0; s < S; s++)
      for (size_t i = 0; i < WB; i++) wt[r][s * WB + i] = pattern((uint32_t)r, s, i);
  }
  /* Default map: experts 0,1 on rank 0 slots 0,1; experts 2,3 on rank 1 slots 0,1. Move expert 0 to
   * rank 1 slot 2 and add a replica of expert 3 on rank 0 slot 3. */
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(eng, "w", &m));
  m.rep[0][0] = (epd_replica_t){1, 2};
  m.nrep[3] = 2;
  m.rep[3][1] = (epd_replica_t){0, 3};
  epd_weight_copy_t cp[2] = {{0, 0, 1, 2}, {1, 1, 0, 3}};
  uint32_t v = 0;
  char err[320] = "";
  /* Invalid copies are rejected whole. */
  epd_weight_copy_t badc[2] = {{0, 0, 1, 4}, {0, 0, 0, 0}};
  ASSERT_EQ(epd_engine_set_map_copies(eng, "w", &m, &badc[0], 1, &v, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "copies[0]: (rank 0, slot 0) -> (rank 1, slot 4)");
  ASSERT_EQ(epd_engine_set_map_copies(eng, "w", &m, &badc[1], 1, &v, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "source and destination are the same slot");
  epd_weight_copy_t wrong = {0, 1, 1, 2}; /* expert 1's weights where the map puts expert 0 */
  ASSERT_EQ(epd_engine_set_map_copies(eng, "w", &m, &wrong, 1, &v, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "holds expert 1 in the active map version 1, but the map places expert 0");
  ASSERT_OK(epd_engine_set_map_copies(eng, "w", &m, cp, 2, &v, err, sizeof err));
  ASSERT_EQ(v, 2u);
  /* Nothing is copied before the switch. */
  ASSERT_EQ(wt[1][2 * WB + 5], pattern(1, 2, 5));
  /* A map that moves a slot being migrated is rejected; one that keeps it replaces the staged map and
   * inherits its copies. */
  epd_expert_map_t m2;
  ASSERT_OK(epd_ref_map_copy(&m2, &m));
  m2.rep[0][0] = (epd_replica_t){0, 2}; /* expert 0 elsewhere: (1,2) would be filled for nothing */
  ASSERT_EQ(epd_engine_set_map(eng, "w", &m2, &v, err, sizeof err), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(err, "(rank 1, slot 2) is being migrated for staged map version 2");
  epd_expert_map_free(&m2);
  ASSERT_OK(epd_ref_map_copy(&m2, &m));
  epd_weight_copy_t touch = {1, 2, 0, 2}; /* copies from the slot being filled */
  m2.rep[0][0] = (epd_replica_t){1, 2};
  ASSERT_EQ(epd_engine_set_map_copies(eng, "w", &m2, &touch, 1, &v, err, sizeof err), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(err, "touches a slot being migrated");
  m2.nrep[2] = 2;
  m2.rep[2][1] = (epd_replica_t){0, 2}; /* an unrelated change */
  ASSERT_OK(epd_engine_set_map(eng, "w", &m2, &v, err, sizeof err));
  ASSERT_EQ(v, 3u);
  /* The cuda backend cannot migrate (not exercised here), a group without weights cannot either. */
  xclient_t n0, n1;
  xattach(eng, "nw", 0, 4, 16, 2, 8, 0, &n0);
  xattach(eng, "nw", 1, 4, 16, 2, 8, 0, &n1);
  ASSERT_EQ(epd_engine_set_map_copies(eng, "nw", &m, cp, 2, &v, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "has no expert-weights region");
  /* The switch (next dispatch) copies first: every byte exact, then the map is active. */
  for (int r = 0; r < 2; r++) xsubmit(&c[r], EPD_OP_LL_DISPATCH, 0, 0);
  for (int r = 0; r < 2; r++) ASSERT_EQ(xwait(&c[r]).map_version, 3u);
  for (size_t i = 0; i < WB; i++) {
    if (wt[1][2 * WB + i] != pattern(0, 0, i))
      epd_test_fail(__FILE__, __LINE__, "byte %zu of (1,2) differs", i);
    if (wt[0][3 * WB + i] != pattern(1, 1, i))
      epd_test_fail(__FILE__, __LINE__, "byte %zu of (0,3) differs", i);
    ASSERT_EQ(wt[0][0 * WB + i], pattern(0, 0, i)); /* sources and others untouched */
    ASSERT_EQ(wt[1][1 * WB + i], pattern(1, 1, i));
    ASSERT_EQ(wt[0][2 * WB + i], pattern(0, 2, i));
  }
  int32_t se[4];
  ASSERT_EQ(table_slot_experts(&c[1], 1, se, S), 3u);
  ASSERT_EQ(se[2], 0);
  ASSERT_EQ(table_slot_experts(&c[0], 0, se, S), 3u);
  ASSERT_EQ(se[3], 3);
  ASSERT_EQ(se[2], 2);
  ASSERT_EQ(se[0], -1);
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(eng, &snap));
  for (uint32_t i = 0; i < snap.ngroups; i++)
    if (!strcmp(snap.groups[i].name, "w")) {
      ASSERT_EQ(snap.groups[i].weight_bytes_copied, 2 * WB);
      ASSERT_EQ(snap.groups[i].map_switches, 1u);
    }
  epd_engine_snapshot_free(&snap);
  /* After the switch the slot is no longer being migrated. */
  m2.rep[0][0] = (epd_replica_t){0, 0};
  epd_weight_copy_t back = {1, 2, 0, 0};
  ASSERT_OK(epd_engine_set_map_copies(eng, "w", &m2, &back, 1, &v, err, sizeof err));
  /* A later attach must agree on the weights geometry. */
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  snprintf(req.group, sizeof req.group, "w");
  req.rank = 0;
  req.weight_bytes_per_slot = 7;
  epd_attach_info_t info;
  ASSERT_EQ(epd_engine_attach(eng, &req, &info, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "weight_bytes_per_slot 7 does not match");
  epd_expert_map_free(&m);
  epd_expert_map_free(&m2);
  epd_engine_destroy(eng);
}

/* ---- through the daemon: libepd's map table, the weights buffer, SetExpertMap copies over the RPC --- */

static char xsock[300];

static double xnow_s(void) {
  return now_ms() / 1e3;
}

static pid_t xdaemon_up(void) {
  char epd[300], attach[300], logp[300];
  snprintf(epd, sizeof epd, "%s/bin/epd", epd_test_build_dir());
  if (access(epd, X_OK)) epd_test_skip("%s is not built", epd);
  snprintf(xsock, sizeof xsock, "%s/control.sock", epd_test_tmpdir());
  snprintf(attach, sizeof attach, "daemon.attach_socket=%s/attach.sock", epd_test_tmpdir());
  snprintf(logp, sizeof logp, "%s/epd.log", epd_test_tmpdir());
  pid_t pid = fork();
  if (pid == 0) {
    if (!freopen(logp, "w", stderr)) _exit(126);
    execl(epd, epd, "-f", "-s", xsock, "-o", "engine.backend=host", "-o", "engine.num_ranks=2", "-o",
          "engine.slots_factor_pct=200", "-o", "engine.step_timeout_ms=3000", "-o", attach, (char *)NULL);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  char ap[300];
  snprintf(ap, sizeof ap, "%s/attach.sock", epd_test_tmpdir());
  double end = xnow_s() + 15;
  while (access(xsock, F_OK) || access(ap, F_OK)) {
    if (xnow_s() > end) epd_test_fail(__FILE__, __LINE__, "daemon sockets not there after 15 s");
    if (waitpid(pid, NULL, WNOHANG) == pid) epd_test_fail(__FILE__, __LINE__, "daemon exited at start");
    usleep(20000);
  }
  return pid;
}

/* SetExpertMap over the RPC: map = default of (E=8, R=2) with expert 0 moved to (1, 5), plus copies. */
static epd_result_t rpc_set_map(uint32_t e0_rank, uint32_t e0_slot, const epd_weight_copy_t *cp, size_t ncp,
                                uint32_t *version, char *err, size_t errlen) {
  epd_rpc_t *rpc = NULL;
  epd_result_t rc = epd_rpc_open(xsock, 5000, &rpc, err, errlen);
  if (rc) return rc;
  Epd__V1__ExpertPlacement pl[8], *plp[8];
  Epd__V1__Replica rp[8], *rpp[8];
  for (uint32_t e = 0; e < 8; e++) {
    epd__v1__expert_placement__init(&pl[e]);
    epd__v1__replica__init(&rp[e]);
    pl[e].expert = e;
    rp[e].rank = e == 0 ? e0_rank : e / 4;
    rp[e].slot = e == 0 ? e0_slot : e % 4;
    rpp[e] = &rp[e];
    pl[e].replicas = &rpp[e];
    pl[e].n_replicas = 1;
    plp[e] = &pl[e];
  }
  Epd__V1__ExpertMap m = EPD__V1__EXPERT_MAP__INIT;
  m.group = "lw";
  m.n_experts = 8;
  m.experts = plp;
  Epd__V1__WeightCopy wc[4], *wcp[4];
  for (size_t i = 0; i < ncp && i < 4; i++) {
    epd__v1__weight_copy__init(&wc[i]);
    wc[i].src_rank = cp[i].src_rank;
    wc[i].src_slot = cp[i].src_slot;
    wc[i].dst_rank = cp[i].dst_rank;
    wc[i].dst_slot = cp[i].dst_slot;
    wcp[i] = &wc[i];
  }
  Epd__V1__SetExpertMapRequest q = EPD__V1__SET_EXPERT_MAP_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  q.map = &m;
  q.n_copies = ncp;
  q.copies = wcp;
  ProtobufCMessage *rep = NULL;
  rc = epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &q.base, &epd__v1__set_expert_map_reply__descriptor,
                    &rep, err, errlen);
  if (rc == EPD_OK) *version = ((Epd__V1__SetExpertMapReply *)rep)->version;
  if (rep) protobuf_c_message_free_unpacked(rep, NULL);
  epd_rpc_close(rpc);
  return rc;
}

static void *lw_dispatch(void *arg) {
  epd_ep_t *ep = arg;
  ASSERT_OK(epd_dispatch(ep, EPD_MODE_LL, 0, 0, 0, NULL));
  return NULL;
}

EPD_TEST(experts_libepd_table_weights_and_rpc_copies) {
  pid_t pid = xdaemon_up();
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  co.socket_path = xsock;
  epd_conn_t *conn = NULL;
  ASSERT_OK(epd_connect(&co, &conn));
  const uint64_t WB = 4096 + 64;
  epd_ep_t *ep[2];
  for (int r = 0; r < 2; r++) {
    epd_attach_opts_t ao = EPD_ATTACH_OPTS_INITIALIZER;
    ao.group = "lw";
    ao.rank = r;
    ao.num_experts = 8;
    ao.hidden = 16;
    ao.topk = 2;
    ao.max_tokens = 8;
    ao.weight_bytes_per_slot = WB;
    epd_result_t rc = epd_attach(conn, &ao, &ep[r]);
    if (rc) epd_test_fail(__FILE__, __LINE__, "attach: %d %s", rc, epd_conn_last_error(conn));
  }
  uint32_t S = (uint32_t)epd_info(ep[0], EPD_INFO_SLOTS_PER_RANK);
  ASSERT_EQ(S, 8u);
  ASSERT_EQ(epd_info(ep[1], EPD_INFO_WEIGHT_BYTES_PER_SLOT), (int64_t)WB);
  uint8_t *w[2];
  for (int r = 0; r < 2; r++) {
    size_t bytes = 0;
    w[r] = epd_buffer(ep[r], EPD_BUF_EXPERT_WEIGHTS, 0, &bytes);
    ASSERT(w[r] != NULL);
    ASSERT_EQ(bytes, S * WB);
    ASSERT(epd_buffer(ep[r], EPD_BUF_EXPERT_WEIGHTS, 1, NULL) == NULL); /* bank 0 only */
    for (size_t i = 0; i < S * WB; i++) w[r][i] = pattern((uint32_t)r, (uint32_t)(i / WB), i % WB);
  }
  /* The table before any switch: the default map. */
  ASSERT_EQ(epd_map_version(ep[0]), 1u);
  epd_replica_t reps[8];
  uint32_t n = 0, v = 0;
  ASSERT_OK(epd_expert_slots(ep[0], 5, reps, 8, &n, &v));
  ASSERT_EQ(n, 1u);
  ASSERT_EQ(v, 1u);
  ASSERT_EQ(reps[0].rank, 1u);
  ASSERT_EQ(reps[0].slot, 1u);
  ASSERT_EQ(epd_expert_slots(ep[0], 8, reps, 8, &n, &v), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_last_error(ep[0]), "logical 8: out of range [0, 8)");
  int32_t se[8];
  ASSERT_OK(epd_slot_experts(ep[1], se, S, &v));
  ASSERT_EQ(se[0], 4);
  ASSERT_EQ(se[3], 7);
  ASSERT_EQ(se[5], -1);
  ASSERT_EQ(epd_slot_experts(ep[1], se, S + 1, &v), EPD_ERR_INVALID);
  /* SetExpertMap with a copy over the RPC; an invalid copy and a map moving the migrating slot fail. */
  char err[512] = "";
  epd_weight_copy_t bad = {0, 9, 1, 5};
  ASSERT_NE(rpc_set_map(1, 5, &bad, 1, &v, err, sizeof err), EPD_OK);
  ASSERT_STR_CONTAINS(err, "copies[0]: (rank 0, slot 9) -> (rank 1, slot 5)");
  epd_weight_copy_t cp = {0, 0, 1, 5};
  ASSERT_OK(rpc_set_map(1, 5, &cp, 1, &v, err, sizeof err));
  ASSERT_EQ(v, 2u); /* the rejected call used no version */
  ASSERT_NE(rpc_set_map(1, 6, NULL, 0, &v, err, sizeof err), EPD_OK);
  ASSERT_STR_CONTAINS(err, "(rank 1, slot 5) is being migrated for staged map version 2");
  /* Nothing moves before the step boundary; then the copy, the switch and the table, in that order. */
  ASSERT_EQ(w[1][5 * WB + 3], pattern(1, 5, 3));
  ASSERT_EQ(epd_map_version(ep[1]), 1u);
  pthread_t th[2];
  for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, lw_dispatch, ep[r]);
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  epd_comp_t comp;
  ASSERT_OK(epd_op_status(ep[1], &comp));
  ASSERT_EQ(comp.map_version, 2u);
  for (size_t i = 0; i < WB; i++)
    if (w[1][5 * WB + i] != pattern(0, 0, i))
      epd_test_fail(__FILE__, __LINE__, "weight byte %zu not copied", i);
  ASSERT_EQ(epd_map_version(ep[0]), 2u);
  ASSERT_OK(epd_expert_slots(ep[0], 0, reps, 8, &n, &v));
  ASSERT_EQ(v, 2u);
  ASSERT_EQ(reps[0].rank, 1u);
  ASSERT_EQ(reps[0].slot, 5u);
  ASSERT_OK(epd_slot_experts(ep[1], se, S, &v));
  ASSERT_EQ(se[5], 0);
  ASSERT_OK(epd_slot_experts(ep[0], se, S, &v));
  ASSERT_EQ(se[0], -1);
  for (int r = 0; r < 2; r++) ASSERT_OK(epd_detach(ep[r]));
  epd_disconnect(conn);
  kill(pid, SIGTERM);
  waitpid(pid, NULL, 0);
}
