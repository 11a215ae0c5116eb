/*
 * test_engine.c - the engine in-process with the host backend: clients map their queue and arena from
 * the attach fds and drive the slot protocol from one thread per rank; results must equal the
 * reference. Also: mismatch, timeout naming the peer, a client leaving mid-step, map staging, limits,
 * and groups that mask lost ranks (failover to replicas, dropped entries, a rank's return).
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "core/engine.h"
#include "core/ref.h"
#include "test.h"

typedef struct tclient {
  epd_attach_info_t info;
  epd_queue_t *q;
  uint8_t *arena;
  uint32_t next;
} tclient_t;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static epd_engine_opts_t opts_default(int R) {
  epd_engine_opts_t o;
  memset(&o, 0, sizeof o);
  o.backend = "host";
  o.num_ranks = R;
  o.max_experts = 256;
  o.max_hidden = 4096;
  o.max_topk = 8;
  o.max_tokens = 256;
  o.slots_factor_pct = 100;
  o.max_groups = 4;
  o.max_clients_per_rank = 4;
  o.max_arena_bytes = 1ull << 30;
  o.step_timeout_ms = 5000;
  return o;
}

/* Events seen, for the map_switch and client_lost checks. */
static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static char ev_log[4096];
static void on_event(void *arg, const epd_engine_event_t *ev) {
  pthread_mutex_lock(&ev_mu);
  size_t n = strlen(ev_log);
  snprintf(ev_log + n, sizeof ev_log - n, "%s(%d,%u->%u);", ev->kind, ev->rank, ev->old_version,
           ev->new_version);
  pthread_mutex_unlock(&ev_mu);
}

static epd_engine_t *engine_up(const epd_engine_opts_t *o) {
  epd_engine_t *eng = NULL;
  char err[256] = "";
  epd_result_t rc = epd_engine_create(o, on_event, NULL, &eng, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "engine_create: %d %s", rc, err);
  return eng;
}

/* The rank-loss policy the next attaches ask for (0: the group's). */
static uint32_t attach_on_loss, attach_renorm;

static epd_result_t attach(epd_engine_t *eng, const char *group, int rank, uint32_t E, uint32_t H, uint32_t K,
                           uint32_t M, tclient_t *c, char *err, size_t errlen) {
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  req.on_rank_loss = attach_on_loss;
  req.renormalize = attach_renorm;
  snprintf(req.group, sizeof req.group, "%s", group);
  snprintf(req.name, sizeof req.name, "test-r%d", rank);
  req.rank = rank;
  req.num_experts = E;
  req.hidden = H;
  req.topk = K;
  req.max_tokens = M;
  req.pid = (uint32_t)getpid();
  memset(c, 0, sizeof *c);
  epd_result_t rc = epd_engine_attach(eng, &req, &c->info, err, errlen);
  if (rc) return rc;
  /* Map through the fds, as a client process does. */
  c->q = mmap(NULL, c->info.queue_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.queue_fd, 0);
  c->arena = mmap(NULL, c->info.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.arena_fd, 0);
  ASSERT(c->q != MAP_FAILED && c->arena != MAP_FAILED);
  ASSERT_EQ(c->q->magic, EPD_QUEUE_MAGIC);
  ASSERT_EQ(c->q->rank, (uint32_t)rank);
  return EPD_OK;
}

static void attach_ok(epd_engine_t *eng, const char *group, int rank, uint32_t E, uint32_t H, uint32_t K,
                      uint32_t M, tclient_t *c) {
  char err[256] = "";
  epd_result_t rc = attach(eng, group, rank, E, H, K, M, c, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "attach rank %d: %d %s", rank, rc, err);
}

static void unmap(tclient_t *c) {
  munmap(c->q, c->info.queue_bytes);
  munmap(c->arena, c->info.arena_bytes);
}

static void *buf(tclient_t *c, uint32_t kind, uint32_t bank) {
  for (uint32_t i = 0; i < c->info.nbuffers; i++)
    if (c->info.buffers[i].kind == kind && c->info.buffers[i].bank == bank) {
      ASSERT_EQ(c->info.buffers[i].offset % 64, 0);
      ASSERT_LE(c->info.buffers[i].offset + c->info.buffers[i].bytes, c->info.arena_bytes);
      return c->arena + c->info.buffers[i].offset;
    }
  epd_test_fail(__FILE__, __LINE__, "buffer kind %u bank %u missing", kind, bank);
}

/* The slot protocol, client side. */
static void submit(tclient_t *c, uint32_t op, uint32_t T, uint32_t flags, uint32_t bank, uint64_t tag) {
  epd_slot_t *s = &c->q->slot[c->next];
  ASSERT_EQ(atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire), EPD_SLOT_FREE);
  memset(&s->desc, 0, sizeof s->desc);
  s->desc.op = op;
  s->desc.num_tokens = T;
  s->desc.flags = flags;
  s->desc.bank = bank;
  s->desc.user_tag = tag;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_SUBMITTED, memory_order_release);
}

static epd_comp_t wait_done(tclient_t *c, int timeout_ms) {
  epd_slot_t *s = &c->q->slot[c->next];
  uint64_t end = now_ms() + (uint64_t)timeout_ms;
  while (atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire) != EPD_SLOT_DONE) {
    if (now_ms() > end)
      epd_test_fail(__FILE__, __LINE__, "slot %u not done after %d ms", c->next, timeout_ms);
    usleep(20);
  }
  epd_comp_t comp = s->comp;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_FREE, memory_order_release);
  c->next = (c->next + 1) % EPD_QUEUE_SLOTS;
  return comp;
}

static epd_comp_t run_op(tclient_t *c, uint32_t op, uint32_t T, uint32_t flags, uint32_t bank) {
  submit(c, op, T, flags, bank, 1000 + op);
  epd_comp_t comp = wait_done(c, 20000);
  ASSERT_EQ(comp.user_tag, 1000 + op);
  return comp;
}

/* ---- full data path against the reference -------------------------------------------------------- */

#define NR 2
typedef struct world {
  epd_engine_t *eng;
  tclient_t c[NR];
  epd_ref_geom_t g;
  pthread_barrier_t bar;
  uint64_t seed;
  int steps;
  int skew;
  int dense;            /* HT dispatches with EPD_DESC_HT_DENSE (every token to every rank) */
  epd_expert_map_t map; /* expected map */
} world_t;

typedef struct rank_arg {
  world_t *w;
  int rank;
} rank_arg_t;

static float expert_scale(uint32_t rank, uint32_t slot) {
  return 0.5f + 0.125f * (float)((rank * 7 + slot) % 8);
}

/* One rank: per step, write inputs, dispatch, check against the reference of all ranks, combine, check. */
static void *rank_main(void *arg) {
  rank_arg_t *ra = arg;
  world_t *w = ra->w;
  int me = ra->rank;
  tclient_t *c = &w->c[me];
  const epd_ref_geom_t *g = &w->g;
  uint32_t M = g->max_tokens, H = g->hidden, K = g->topk, S = g->slots_per_rank, R = g->num_ranks,
           C = g->ht_capacity;
  uint16_t *xs[NR];
  int64_t *is[NR];
  float *ws[NR];
  epd_ref_in_t in[NR];
  for (uint32_t r = 0; r < R; r++) {
    xs[r] = calloc((size_t)M * H, 2);
    is[r] = calloc((size_t)M * K, 8);
    ws[r] = calloc((size_t)M * K, 4);
  }
  size_t rows_ll = (size_t)S * R * M;
  epd_ref_out_t mine;
  memset(&mine, 0, sizeof mine);
  mine.recv_x = calloc(rows_ll > C ? rows_ll : C, (size_t)H * 2);
  mine.recv_scales = calloc(rows_ll > C ? rows_ll : C, epd_ref_scale_blocks(H) * 4);
  mine.recv_count = calloc(S, 4);
  mine.recv_src = calloc(rows_ll > C ? rows_ll : C, 4);
  mine.recv_topk_idx = calloc(C, (size_t)K * 8);
  mine.recv_topk_weights = calloc(C, (size_t)K * 4);
  epd_ref_plan_t plan;
  ASSERT_OK(epd_ref_plan_init(&plan, g));
  for (int step = 0; step < w->steps; step++) {
    int ht = step % 2, fp8 = (step / 2) % 2;
    uint32_t bank = (uint32_t)step % EPD_NUM_BANKS;
    uint32_t T[NR];
    for (uint32_t r = 0; r < R; r++) {
      T[r] = (uint32_t)((w->seed * 31 + (uint64_t)step * 7 + r * 13) % (M + 1));
      if (step == 0) T[r] = M; /* max tokens once */
      epd_ref_gen_input(w->seed, (uint64_t)step, r, g, T[r], w->skew, xs[r], is[r], ws[r]);
      in[r] = (epd_ref_in_t){T[r], xs[r], is[r], ws[r]};
    }
    memcpy(buf(c, EPD_BUF_X, bank), xs[me], (size_t)T[me] * H * 2);
    memcpy(buf(c, EPD_BUF_TOPK_IDX, bank), is[me], (size_t)T[me] * K * 8);
    memcpy(buf(c, EPD_BUF_TOPK_WEIGHTS, bank), ws[me], (size_t)T[me] * K * 4);
    /* Poison the outputs: stale data must not pass for results. */
    memset(buf(c, ht ? EPD_BUF_HT_RECV_X : EPD_BUF_LL_RECV_X, bank), 0x5a,
           ht ? (size_t)C * H * 2 : rows_ll * H * 2);
    memset(buf(c, EPD_BUF_OUT, bank), 0x5a, (size_t)M * H * 2);
    const uint32_t dflags = (fp8 ? EPD_DESC_FP8 : 0) | (ht && w->dense ? EPD_DESC_HT_DENSE : 0);
    epd_comp_t comp = run_op(c, ht ? EPD_OP_HT_DISPATCH : EPD_OP_LL_DISPATCH, T[me], dflags, bank);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.peer, -1);
    ASSERT_EQ(comp.step, (uint64_t)step * 2);
    ASSERT_EQ(comp.map_version, w->map.version);
    /* Expected, from the reference over every rank's input. */
    epd_ref_out_t *outs[NR] = {NULL};
    outs[me] = &mine;
    int bad = -1;
    ASSERT_OK(epd_ref_plan_build(&plan, &w->map, in, &bad, (char[128]){0}, 128));
    if (ht && w->dense) epd_ref_ht_dense(&plan);
    if (ht)
      ASSERT_OK(epd_ref_ht_dispatch(&plan, in, fp8, outs, &bad));
    else
      ASSERT_OK(epd_ref_ll_dispatch(&plan, in, fp8, outs));
    uint32_t nrecv = ht ? plan.ht_recv[me] : plan.ll_recv[me];
    ASSERT_EQ(comp.num_recv, nrecv);
    if (ht && w->dense) {
      uint32_t all = 0;
      for (uint32_t r = 0; r < R; r++) all += T[r];
      ASSERT_EQ(nrecv, all); /* every token of every rank */
    }
    int32_t *cnt = buf(c, ht ? EPD_BUF_HT_RECV_COUNT : EPD_BUF_LL_RECV_COUNT, bank);
    ASSERT(!memcmp(cnt, mine.recv_count, (size_t)S * 4));
    size_t rowb = (size_t)H * 2, nb = epd_ref_scale_blocks(H);
    uint8_t *rx = buf(c, ht ? EPD_BUF_HT_RECV_X : EPD_BUF_LL_RECV_X, bank);
    float *rs = buf(c, ht ? EPD_BUF_HT_RECV_SCALES : EPD_BUF_LL_RECV_SCALES, bank);
    int32_t *rsrc = buf(c, ht ? EPD_BUF_HT_RECV_SRC : EPD_BUF_LL_RECV_SRC, bank);
    uint16_t *y = buf(c, ht ? EPD_BUF_HT_Y : EPD_BUF_LL_Y, bank);
    size_t cmpb = fp8 ? H : rowb;
    if (ht) {
      int64_t *ti = buf(c, EPD_BUF_HT_RECV_TOPK_IDX, bank);
      float *tw = buf(c, EPD_BUF_HT_RECV_TOPK_WEIGHTS, bank);
      for (uint32_t j = 0; j < nrecv; j++) {
        ASSERT_EQ(rsrc[j], mine.recv_src[j]);
        ASSERT(!memcmp(rx + j * rowb, (uint8_t *)mine.recv_x + j * rowb, cmpb));
        if (fp8) ASSERT(!memcmp(rs + j * nb, mine.recv_scales + j * nb, nb * 4));
        ASSERT(!memcmp(ti + (size_t)j * K, mine.recv_topk_idx + (size_t)j * K, (size_t)K * 8));
        ASSERT(!memcmp(tw + (size_t)j * K, mine.recv_topk_weights + (size_t)j * K, (size_t)K * 4));
        /* Worker: y = sum over local k of w * scale(slot) * x, from the received (dequantised) row. */
        for (uint32_t h = 0; h < H; h++) {
          float xv = fp8 ? epd_e4m3_to_f32(rx[j * rowb + h]) * rs[j * nb + h / 128]
                         : epd_bf16_to_f32(((uint16_t *)rx)[j * H + h]);
          float acc = 0;
          int local = 0;
          for (uint32_t k = 0; k < K; k++)
            if (ti[(size_t)j * K + k] >= 0) {
              acc += tw[(size_t)j * K + k] * expert_scale((uint32_t)me, (uint32_t)ti[(size_t)j * K + k]);
              local = 1;
            }
          /* a dense row of a token with no entry here is not a partial: NaN shows a combine that sums it */
          y[(size_t)j * H + h] = local ? epd_f32_to_bf16(acc * xv) : 0x7fc1;
        }
      }
    } else {
      for (uint32_t s = 0; s < S; s++)
        for (int32_t j = 0; j < cnt[s]; j++) {
          size_t row = (size_t)s * R * M + (size_t)j;
          ASSERT_EQ(rsrc[row], mine.recv_src[row]);
          ASSERT(!memcmp(rx + row * rowb, (uint8_t *)mine.recv_x + row * rowb, cmpb));
          if (fp8) ASSERT(!memcmp(rs + row * nb, mine.recv_scales + row * nb, nb * 4));
          for (uint32_t h = 0; h < H; h++) {
            float xv = fp8 ? epd_e4m3_to_f32(rx[row * rowb + h]) * rs[row * nb + h / 128]
                           : epd_bf16_to_f32(((uint16_t *)rx)[row * H + h]);
            y[row * H + h] = epd_f32_to_bf16(expert_scale((uint32_t)me, s) * xv);
          }
        }
    }
    comp = run_op(c, ht ? EPD_OP_HT_COMBINE : EPD_OP_LL_COMBINE, 0, 0, bank);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.step, (uint64_t)step * 2 + 1);
    /* Expected OUT: sum over valid entries of w * scale(dest) * x (x dequantised for FP8). */
    uint16_t *out = buf(c, EPD_BUF_OUT, bank);
    for (uint32_t t = 0; t < T[me]; t++)
      for (uint32_t h = 0; h < H; h++) {
        float want = 0, xv = epd_bf16_to_f32(xs[me][(size_t)t * H + h]);
        for (uint32_t k = 0; k < K; k++) {
          int32_t d = plan.dst_rank[((size_t)me * M + t) * K + k];
          if (d < 0) continue;
          want += ws[me][(size_t)t * K + k] *
                  expert_scale((uint32_t)d, (uint32_t)plan.dst_slot[((size_t)me * M + t) * K + k]) * xv;
        }
        float got = epd_bf16_to_f32(out[(size_t)t * H + h]);
        float tol = (fp8 ? 0.08f : 0.02f) * (fabsf(want) + 1.0f);
        if (!(fabsf(got - want) <= tol))
          epd_test_fail(__FILE__, __LINE__, "rank %d step %d (%s%s) out[%u][%u] = %g, want %g", me, step,
                        ht ? "HT" : "LL", fp8 ? " fp8" : "", t, h, got, want);
      }
    pthread_barrier_wait(&w->bar);
  }
  epd_ref_plan_free(&plan);
  return NULL;
}

static void run_world(world_t *w) {
  pthread_t th[NR];
  rank_arg_t ra[NR];
  pthread_barrier_init(&w->bar, NULL, NR);
  for (int r = 0; r < NR; r++) {
    ra[r] = (rank_arg_t){w, r};
    pthread_create(&th[r], NULL, rank_main, &ra[r]);
  }
  for (int r = 0; r < NR; r++) pthread_join(th[r], NULL);
}

static void world_up(world_t *w, uint32_t E, uint32_t H, uint32_t K, uint32_t M, int pct) {
  memset(w, 0, sizeof *w);
  epd_engine_opts_t o = opts_default(NR);
  o.slots_factor_pct = (uint32_t)pct;
  w->eng = engine_up(&o);
  for (int r = 0; r < NR; r++)
    attach_ok(w->eng, "g", r, r == 0 ? E : 0, r == 0 ? H : 0, r == 0 ? K : 0, r == 0 ? M : 0, &w->c[r]);
  epd_attach_info_t *i = &w->c[0].info;
  w->g = (epd_ref_geom_t){i->num_ranks,  i->num_experts,    i->hidden,     i->topk,
                          i->max_tokens, i->slots_per_rank, i->ht_capacity};
  ASSERT_OK(epd_engine_get_map(w->eng, "g", &w->map));
}

EPD_TEST(engine_two_ranks_equal_ref) {
  world_t w;
  memset(&w, 0, sizeof w);
  epd_engine_opts_t o = opts_default(NR);
  w.eng = engine_up(&o);
  char err[256];
  /* The second rank passes 0 for the geometry: it takes the group's. */
  ASSERT_OK(attach(w.eng, "g", 0, 16, 256, 4, 24, &w.c[0], err, sizeof err));
  ASSERT_OK(attach(w.eng, "g", 1, 0, 0, 0, 0, &w.c[1], err, sizeof err));
  ASSERT_EQ(w.c[1].info.topk, 4u);
  ASSERT_EQ(w.c[1].info.slots_per_rank, 8u);
  ASSERT_EQ(w.c[1].info.nbuffers, EPD_BUF_KINDS * EPD_NUM_BANKS);
  epd_attach_info_t *i = &w.c[0].info;
  w.g = (epd_ref_geom_t){i->num_ranks,  i->num_experts,    i->hidden,     i->topk,
                         i->max_tokens, i->slots_per_rank, i->ht_capacity};
  ASSERT_OK(epd_engine_get_map(w.eng, "g", &w.map));
  ASSERT_EQ(w.map.version, 1u);
  w.seed = 1234;
  w.steps = 8; /* LL, HT, LL fp8, HT fp8, twice, alternating banks */
  run_world(&w);
  /* Counters: 16 ops per rank, expert tokens as the reference counts them. */
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(w.eng, &snap));
  ASSERT_EQ(snap.ngroups, 1u);
  ASSERT_EQ(snap.nclients, 2u);
  ASSERT_EQ(snap.groups[0].steps, 16u);
  ASSERT_EQ(snap.ranks[0].ops, 16u);
  ASSERT_EQ(snap.ops[EPD_OP_LL_DISPATCH].count, 8u);
  ASSERT_EQ(snap.ops[EPD_OP_HT_COMBINE].count, 8u);
  ASSERT_EQ(snap.ops[EPD_OP_LL_DISPATCH].errors, 0u);
  ASSERT_GT(snap.ops[EPD_OP_LL_DISPATCH].bytes, 0u);
  uint64_t lat = 0, tok = 0;
  for (int b = 0; b < EPD_LAT_BUCKETS; b++) lat += snap.ops[EPD_OP_LL_COMBINE].lat_bucket[b];
  ASSERT_EQ(lat, 8u);
  for (uint32_t e = 0; e < 16; e++) tok += snap.groups[0].expert_tokens[e];
  ASSERT_GT(tok, 100u);
  epd_engine_snapshot_free(&snap);
  ASSERT_EQ(w.c[0].q->steps_done, 16u);
  unmap(&w.c[0]);
  unmap(&w.c[1]);
  ASSERT_OK(epd_engine_detach(w.eng, w.c[0].info.client_id, 0));
  ASSERT_OK(epd_engine_detach(w.eng, w.c[1].info.client_id, 0));
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_ht_dense_layout) {
  world_t w;
  world_up(&w, 12, 256, 3, 20, 100);
  w.seed = 77;
  w.skew = 1;
  w.dense = 1;
  w.steps = 8; /* HT steps dense, BF16 and FP8; LL steps in between */
  run_world(&w);
  /* one rank dense and the other not: both fail with EPD_ERR_MISMATCH naming rank 1; an LL dispatch
   * with the flag: EPD_ERR_INVALID */
  submit(&w.c[0], EPD_OP_HT_DISPATCH, 4, EPD_DESC_HT_DENSE, 0, 1);
  submit(&w.c[1], EPD_OP_HT_DISPATCH, 4, 0, 0, 2);
  epd_comp_t a = wait_done(&w.c[0], 5000), b = wait_done(&w.c[1], 5000);
  ASSERT_EQ(a.status, EPD_ERR_MISMATCH);
  ASSERT_EQ(b.status, EPD_ERR_MISMATCH);
  ASSERT_EQ(a.peer, 1);
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 4, EPD_DESC_HT_DENSE, 1, 3);
  submit(&w.c[1], EPD_OP_LL_DISPATCH, 4, EPD_DESC_HT_DENSE, 1, 4);
  a = wait_done(&w.c[0], 5000);
  ASSERT_EQ(a.status, EPD_ERR_INVALID);
  ASSERT_EQ(a.peer, 0);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_INVALID);
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_skew_and_redundant_slots) {
  world_t w;
  world_up(&w, 10, 128, 3, 16, 150); /* slots = ceil(10/2 * 1.5) = 8 */
  ASSERT_EQ(w.g.slots_per_rank, 8u);
  w.seed = 99;
  w.skew = 1;
  w.steps = 4;
  run_world(&w);
  epd_engine_destroy(w.eng);
}

/* ---- failures ------------------------------------------------------------------------------------ */

EPD_TEST(engine_mismatch) {
  world_t w;
  world_up(&w, 8, 64, 2, 8, 100);
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 4, 0, 0, 1);
  submit(&w.c[1], EPD_OP_HT_DISPATCH, 4, 0, 0, 2);
  epd_comp_t a = wait_done(&w.c[0], 5000), b = wait_done(&w.c[1], 5000);
  ASSERT_EQ(a.status, EPD_ERR_MISMATCH);
  ASSERT_EQ(b.status, EPD_ERR_MISMATCH);
  ASSERT_EQ(a.peer, 1);
  ASSERT_EQ(a.step, b.step);
  ASSERT_EQ(w.c[0].q->sticky_error, EPD_ERR_MISMATCH);
  /* Same op, different banks. */
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 4, 0, 0, 1);
  submit(&w.c[1], EPD_OP_LL_DISPATCH, 4, 0, 1, 2);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_MISMATCH);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_MISMATCH);
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_bad_inputs_fail_every_rank) {
  world_t w;
  world_up(&w, 8, 64, 2, 8, 100);
  int64_t *idx = buf(&w.c[1], EPD_BUF_TOPK_IDX, 0);
  memset(buf(&w.c[0], EPD_BUF_TOPK_IDX, 0), 0xff, 8 * 2 * 8); /* all -1 */
  memset(idx, 0xff, 8 * 2 * 8);
  idx[3] = 8; /* token 1, k 1 */
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 4, 0, 0, 1);
  submit(&w.c[1], EPD_OP_LL_DISPATCH, 4, 0, 0, 2);
  epd_comp_t a = wait_done(&w.c[0], 5000), b = wait_done(&w.c[1], 5000);
  ASSERT_EQ(a.status, EPD_ERR_BAD_EXPERT);
  ASSERT_EQ(b.status, EPD_ERR_BAD_EXPERT);
  ASSERT_EQ(a.peer, 1);
  /* The failed dispatch leaves no routing: its combine fails with STATE. */
  submit(&w.c[0], EPD_OP_LL_COMBINE, 0, 0, 0, 1);
  submit(&w.c[1], EPD_OP_LL_COMBINE, 0, 0, 0, 2);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_STATE);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_STATE);
  /* Too many tokens on rank 0. */
  idx[3] = 1;
  submit(&w.c[0], EPD_OP_HT_DISPATCH, 9, 0, 0, 1);
  submit(&w.c[1], EPD_OP_HT_DISPATCH, 4, 0, 0, 2);
  a = wait_done(&w.c[0], 5000);
  ASSERT_EQ(a.status, EPD_ERR_TOO_MANY_TOKENS);
  ASSERT_EQ(a.peer, 0);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_TOO_MANY_TOKENS);
  /* Bad bank, bad op. */
  submit(&w.c[0], EPD_OP_HT_DISPATCH, 1, 0, 2, 1);
  submit(&w.c[1], EPD_OP_HT_DISPATCH, 1, 0, 2, 2);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_INVALID);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_INVALID);
  submit(&w.c[0], 77, 1, 0, 0, 1);
  submit(&w.c[1], 77, 1, 0, 0, 2);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_INVALID);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_INVALID);
  /* FP8 needs hidden % 128 == 0 (hidden is 64 here). */
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 1, EPD_DESC_FP8, 0, 1);
  submit(&w.c[1], EPD_OP_LL_DISPATCH, 1, EPD_DESC_FP8, 0, 2);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_INVALID);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_INVALID);
  /* After errors, a good step works: HT dispatch then combine. */
  submit(&w.c[0], EPD_OP_HT_DISPATCH, 4, 0, 1, 1);
  submit(&w.c[1], EPD_OP_HT_DISPATCH, 4, 0, 1, 2);
  a = wait_done(&w.c[0], 5000);
  ASSERT_EQ(a.status, EPD_OK);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_OK);
  submit(&w.c[0], EPD_OP_LL_COMBINE, 0, 0, 1, 1); /* wrong mode for this bank's routing */
  submit(&w.c[1], EPD_OP_LL_COMBINE, 0, 0, 1, 2);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_STATE);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_STATE);
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(w.eng, &snap));
  ASSERT_GE(snap.ranks[0].errors, 7u);
  epd_engine_snapshot_free(&snap);
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_ht_overflow) {
  epd_engine_opts_t o = opts_default(NR);
  o.ht_capacity_factor = 1; /* C = max_tokens */
  epd_engine_t *eng = engine_up(&o);
  tclient_t c[NR];
  for (int r = 0; r < NR; r++) attach_ok(eng, "g", r, 4, 16, 1, 8, &c[r]);
  ASSERT_EQ(c[0].info.ht_capacity, 8u);
  for (int r = 0; r < NR; r++) {
    int64_t *idx = buf(&c[r], EPD_BUF_TOPK_IDX, 0);
    for (int t = 0; t < 8; t++) idx[t] = 3; /* all to rank 1 */
    memset(buf(&c[r], EPD_BUF_HT_RECV_SRC, 0), 0x5a, 8 * 4);
  }
  submit(&c[0], EPD_OP_HT_DISPATCH, 8, 0, 0, 1);
  submit(&c[1], EPD_OP_HT_DISPATCH, 8, 0, 0, 2);
  epd_comp_t a = wait_done(&c[0], 5000), b = wait_done(&c[1], 5000);
  ASSERT_EQ(a.status, EPD_ERR_OVERFLOW);
  ASSERT_EQ(b.status, EPD_ERR_OVERFLOW);
  ASSERT_EQ(a.peer, 1);
  ASSERT_EQ(b.num_recv, 16u); /* the count needed */
  ASSERT_EQ(((uint8_t *)buf(&c[1], EPD_BUF_HT_RECV_SRC, 0))[0], 0x5a);
  /* dense: 5 + 4 rows on every rank pass C = 8 where compact fits (rank 1 gets 5 + 4 tokens of expert 3,
   * rank 0 none): EPD_ERR_OVERFLOW naming rank 0, nothing written; 4 + 4 fit */
  for (int r = 0; r < NR; r++)
    for (int t = 0; t < 8; t++) ((int64_t *)buf(&c[r], EPD_BUF_TOPK_IDX, 0))[t] = 3;
  submit(&c[0], EPD_OP_HT_DISPATCH, 5, EPD_DESC_HT_DENSE, 0, 3);
  submit(&c[1], EPD_OP_HT_DISPATCH, 4, EPD_DESC_HT_DENSE, 0, 4);
  a = wait_done(&c[0], 5000);
  b = wait_done(&c[1], 5000);
  ASSERT_EQ(a.status, EPD_ERR_OVERFLOW);
  ASSERT_EQ(b.status, EPD_ERR_OVERFLOW);
  ASSERT_EQ(a.peer, 0);
  ASSERT_EQ(a.num_recv, 9u);
  ASSERT_EQ(((uint8_t *)buf(&c[0], EPD_BUF_HT_RECV_SRC, 0))[0], 0x5a);
  submit(&c[0], EPD_OP_HT_DISPATCH, 4, EPD_DESC_HT_DENSE, 0, 5);
  submit(&c[1], EPD_OP_HT_DISPATCH, 4, EPD_DESC_HT_DENSE, 0, 6);
  a = wait_done(&c[0], 5000);
  ASSERT_EQ(a.status, EPD_OK);
  ASSERT_EQ(a.num_recv, 8u); /* every token, though none has an entry on rank 0 */
  ASSERT_EQ(wait_done(&c[1], 5000).num_recv, 8u);
  int32_t *src0 = buf(&c[0], EPD_BUF_HT_RECV_SRC, 0);
  int64_t *ti0 = buf(&c[0], EPD_BUF_HT_RECV_TOPK_IDX, 0);
  ASSERT_EQ(src0[5], EPD_SRC_PACK(1, 1));
  ASSERT_EQ(ti0[5], -1);
  epd_engine_destroy(eng);
}

EPD_TEST(engine_timeout_names_peer) {
  epd_engine_opts_t o = opts_default(3);
  o.step_timeout_ms = 300;
  epd_engine_t *eng = engine_up(&o);
  tclient_t c[3];
  for (int r = 0; r < 3; r++) attach_ok(eng, "g", r, 6, 16, 2, 4, &c[r]);
  uint64_t t0 = now_ms();
  submit(&c[0], EPD_OP_LL_DISPATCH, 0, 0, 0, 1);
  submit(&c[2], EPD_OP_LL_DISPATCH, 0, 0, 0, 1);
  epd_comp_t a = wait_done(&c[0], 5000), b = wait_done(&c[2], 5000);
  uint64_t dt = now_ms() - t0;
  ASSERT_EQ(a.status, EPD_ERR_TIMEOUT);
  ASSERT_EQ(b.status, EPD_ERR_TIMEOUT);
  ASSERT_EQ(a.peer, 1);
  ASSERT_GE(dt, 290u);
  ASSERT_LT(dt, 3000u);
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(eng, &snap));
  ASSERT_EQ(snap.ranks[0].timeouts, 1u);
  epd_engine_snapshot_free(&snap);
  pthread_mutex_lock(&ev_mu);
  ASSERT_STR_CONTAINS(ev_log, "timeout(1,");
  pthread_mutex_unlock(&ev_mu);
  epd_engine_destroy(eng);
}

EPD_TEST(engine_client_lost_mid_step_fails_peer) {
  epd_engine_opts_t o = opts_default(NR);
  o.step_timeout_ms = 20000; /* the failure must come from the loss, not the timeout */
  epd_engine_t *eng = engine_up(&o);
  tclient_t c[NR];
  for (int r = 0; r < NR; r++) attach_ok(eng, "g", r, 4, 16, 2, 4, &c[r]);
  submit(&c[0], EPD_OP_LL_DISPATCH, 0, 0, 0, 1);
  usleep(20000);
  uint64_t t0 = now_ms();
  ASSERT_OK(epd_engine_detach(eng, c[1].info.client_id, 1));
  epd_comp_t a = wait_done(&c[0], 3000);
  ASSERT_EQ(a.status, EPD_ERR_PEER);
  ASSERT_EQ(a.peer, 1);
  ASSERT_LT(now_ms() - t0, 1000u);
  /* Until rank 1 is replaced, steps fail at once naming it. */
  submit(&c[0], EPD_OP_LL_DISPATCH, 0, 0, 0, 1);
  a = wait_done(&c[0], 3000);
  ASSERT_EQ(a.status, EPD_ERR_PEER);
  ASSERT_EQ(a.peer, 1);
  pthread_mutex_lock(&ev_mu);
  ASSERT_STR_CONTAINS(ev_log, "client_lost(1,");
  pthread_mutex_unlock(&ev_mu);
  /* A new client of rank 1 attaches and steps work again. */
  tclient_t n;
  attach_ok(eng, "g", 1, 0, 0, 0, 0, &n);
  ASSERT_NE(n.info.client_id, c[1].info.client_id);
  submit(&c[0], EPD_OP_LL_DISPATCH, 2, 0, 0, 1);
  submit(&n, EPD_OP_LL_DISPATCH, 2, 0, 0, 1);
  ASSERT_EQ(wait_done(&c[0], 5000).status, EPD_OK);
  ASSERT_EQ(wait_done(&n, 5000).status, EPD_OK);
  /* A clean detach while the peer waits also fails the peer (not sticky). */
  submit(&c[0], EPD_OP_LL_COMBINE, 0, 0, 0, 1);
  usleep(20000);
  ASSERT_OK(epd_engine_detach(eng, n.info.client_id, 0));
  a = wait_done(&c[0], 3000);
  ASSERT_EQ(a.status, EPD_ERR_PEER);
  ASSERT_EQ(a.peer, 1);
  epd_engine_destroy(eng);
}

EPD_TEST(engine_map_switch_at_step_boundary) {
  world_t w;
  world_up(&w, 4, 16, 2, 8, 200); /* 4 slots per rank, 2 used by the default map */
  pthread_mutex_lock(&ev_mu);
  ev_log[0] = 0;
  pthread_mutex_unlock(&ev_mu);
  /* Dispatch on bank 0 with map 1. */
  for (int r = 0; r < NR; r++) {
    int64_t *idx = buf(&w.c[r], EPD_BUF_TOPK_IDX, 0);
    for (int i = 0; i < 16; i++) idx[i] = i % 2 ? 0 : -1; /* every token to expert 0 once */
    memcpy(buf(&w.c[r], EPD_BUF_TOPK_IDX, 1), idx, 16 * 8);
  }
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 8, 0, 0, 1);
  submit(&w.c[1], EPD_OP_LL_DISPATCH, 8, 0, 0, 1);
  ASSERT_EQ(wait_done(&w.c[0], 5000).map_version, 1u);
  ASSERT_EQ(wait_done(&w.c[1], 5000).map_version, 1u);
  ASSERT_EQ(((int32_t *)buf(&w.c[0], EPD_BUF_LL_RECV_COUNT, 0))[0], 16);
  /* Stage map 2: expert 0 moves to rank 1 slot 3 with a replica on rank 0 slot 2. */
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(w.eng, "g", &m));
  m.nrep[0] = 2;
  m.rep[0][0] = (epd_replica_t){1, 3};
  m.rep[0][1] = (epd_replica_t){0, 2};
  uint32_t v = 0;
  char err[256];
  ASSERT_OK(epd_engine_set_map(w.eng, "g", &m, &v, err, sizeof err));
  ASSERT_EQ(v, 2u);
  /* An invalid map is rejected whole with a precise message; the staged one stays. */
  m.rep[0][1] = (epd_replica_t){1, 3};
  ASSERT_EQ(epd_engine_set_map(w.eng, "g", &m, &v, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "expert 0 replica 1: (rank 1, slot 3) is already used by expert 0");
  ASSERT_EQ(epd_engine_set_map(w.eng, "nope", &m, &v, err, sizeof err), EPD_ERR_NOT_FOUND);
  /* The combine of the step dispatched under map 1 still uses map 1. */
  submit(&w.c[0], EPD_OP_LL_COMBINE, 0, 0, 0, 1);
  submit(&w.c[1], EPD_OP_LL_COMBINE, 0, 0, 0, 1);
  ASSERT_EQ(wait_done(&w.c[0], 5000).map_version, 1u);
  ASSERT_EQ(wait_done(&w.c[1], 5000).map_version, 1u);
  epd_expert_map_t cur;
  ASSERT_OK(epd_engine_get_map(w.eng, "g", &cur));
  ASSERT_EQ(cur.version, 1u);
  epd_expert_map_free(&cur);
  /* The next dispatch switches, on both ranks. */
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 8, 0, 1, 1);
  submit(&w.c[1], EPD_OP_LL_DISPATCH, 8, 0, 1, 1);
  ASSERT_EQ(wait_done(&w.c[0], 5000).map_version, 2u);
  ASSERT_EQ(wait_done(&w.c[1], 5000).map_version, 2u);
  ASSERT_EQ(((int32_t *)buf(&w.c[1], EPD_BUF_LL_RECV_COUNT, 1))[3], 8);
  ASSERT_EQ(((int32_t *)buf(&w.c[0], EPD_BUF_LL_RECV_COUNT, 1))[2], 8);
  ASSERT_EQ(((int32_t *)buf(&w.c[0], EPD_BUF_LL_RECV_COUNT, 1))[0], 0);
  ASSERT_EQ(w.c[0].q->map_version, 2u);
  pthread_mutex_lock(&ev_mu);
  ASSERT_STR_CONTAINS(ev_log, "map_switch(-1,1->2)");
  pthread_mutex_unlock(&ev_mu);
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(w.eng, &snap));
  ASSERT_EQ(snap.groups[0].map_version, 2u);
  ASSERT_EQ(snap.groups[0].expert_tokens[0], 32u);
  epd_engine_snapshot_free(&snap);
  epd_expert_map_free(&m);
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_limits) {
  epd_engine_opts_t o = opts_default(NR);
  o.max_groups = 2;
  o.max_clients_per_rank = 2;
  epd_engine_t *eng = engine_up(&o);
  tclient_t c, d;
  char err[256];
  ASSERT_EQ(attach(eng, "a", 0, 0, 16, 2, 8, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "must give num_experts");
  ASSERT_EQ(attach(eng, "a", 0, 300, 16, 2, 8, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "num_experts 300 out of range [1, 256]");
  ASSERT_EQ(attach(eng, "a", 0, 8, 8192, 2, 8, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "hidden 8192 out of range");
  ASSERT_EQ(attach(eng, "a", 0, 8, 20, 2, 8, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "multiple of 8");
  ASSERT_EQ(attach(eng, "a", 0, 8, 16, 9, 8, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "topk 9 out of range [1, 8]");
  ASSERT_EQ(attach(eng, "a", 0, 8, 16, 2, 257, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "max_tokens 257 out of range");
  ASSERT_EQ(attach(eng, "a", 2, 8, 16, 2, 8, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "rank 2 out of range [0, 2)");
  ASSERT_EQ(attach(eng, "a", 0, 256, 4096, 8, 256, &c, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "exceeds max_arena_bytes");
  attach_ok(eng, "a", 0, 8, 16, 2, 8, &c);
  ASSERT_EQ(attach(eng, "a", 0, 0, 0, 0, 0, &d, err, sizeof err), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(err, "already attached");
  ASSERT_EQ(attach(eng, "a", 1, 8, 32, 2, 8, &d, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "hidden 32 does not match");
  tclient_t e, f;
  attach_ok(eng, "b", 0, 4, 16, 1, 4, &e);
  ASSERT_EQ(attach(eng, "c", 1, 4, 16, 1, 4, &f, err, sizeof err), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(err, "max_groups 2");
  epd_engine_set_draining(eng, 1);
  ASSERT_EQ(attach(eng, "a", 1, 0, 0, 0, 0, &d, err, sizeof err), EPD_ERR_DRAINING);
  epd_engine_set_draining(eng, 0);
  ASSERT_OK(epd_engine_detach(eng, e.info.client_id, 0));
  ASSERT_EQ(epd_engine_detach(eng, e.info.client_id, 0), EPD_ERR_NOT_FOUND);
  /* Group b is gone with its last client: c can be created now. */
  attach_ok(eng, "c", 0, 4, 16, 1, 4, &f);
  tclient_t g2;
  ASSERT_EQ(attach(eng, "a", 0, 0, 0, 0, 0, &g2, err, sizeof err), EPD_ERR_BUSY);
  int qfd = -1, afd = -1;
  ASSERT_OK(epd_engine_client_fds(eng, c.info.client_id, &qfd, &afd));
  ASSERT_EQ(qfd, c.info.queue_fd);
  ASSERT_EQ(epd_engine_client_fds(eng, 999, &qfd, &afd), EPD_ERR_NOT_FOUND);
  ASSERT(!strcmp(epd_engine_backend(eng), "host"));
  ASSERT(!strcmp(epd_engine_mode(eng), "host-threads"));
  epd_engine_destroy(eng);
  /* Backends. */
  epd_engine_t *e2 = NULL;
  o.backend = "cuda";
  if (!EPD_WITH_CUDA) {
    ASSERT_EQ(epd_engine_create(&o, NULL, NULL, &e2, err, sizeof err), EPD_ERR_UNSUPPORTED);
    ASSERT_STR_CONTAINS(err, "cuda backend not built");
  }
  o.backend = "tpu";
  ASSERT_EQ(epd_engine_create(&o, NULL, NULL, &e2, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "backend \"tpu\" unknown");
  o.backend = "auto";
  o.num_ranks = 0;
  ASSERT_EQ(epd_engine_create(&o, NULL, NULL, &e2, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "num_ranks 0");
}

/* Both ranks submit op and must get status. */
static void both_ranks(world_t *w, uint32_t op, uint32_t T, uint64_t tag, int status) {
  for (int r = 0; r < 2; r++) submit(&w->c[r], op, T, 0, 0, tag);
  for (int r = 0; r < 2; r++) ASSERT_EQ(wait_done(&w->c[r], 5000).status, status);
}

/* Draining refuses new dispatches (LL and HT); the combine of a dispatch that ran still runs, the combine
 * of a refused one fails with EPD_ERR_STATE. */
EPD_TEST(engine_draining_refuses_dispatches_runs_combines) {
  world_t w;
  world_up(&w, 4, 16, 2, 8, 100);
  both_ranks(&w, EPD_OP_LL_DISPATCH, 1, 1, EPD_OK);
  epd_engine_set_draining(w.eng, 1);
  both_ranks(&w, EPD_OP_LL_COMBINE, 0, 2, EPD_OK);
  submit(&w.c[0], EPD_OP_LL_DISPATCH, 1, 0, 0, 3);
  ASSERT_EQ(wait_done(&w.c[0], 5000).status, EPD_ERR_DRAINING);
  submit(&w.c[1], EPD_OP_HT_DISPATCH, 1, 0, 0, 4);
  ASSERT_EQ(wait_done(&w.c[1], 5000).status, EPD_ERR_DRAINING);
  /* the combine of the refused dispatch fails: its bank has no routing (not the older step's) */
  both_ranks(&w, EPD_OP_LL_COMBINE, 0, 5, EPD_ERR_STATE);
  epd_engine_set_draining(w.eng, 0);
  both_ranks(&w, EPD_OP_LL_DISPATCH, 1, 6, EPD_OK);
  both_ranks(&w, EPD_OP_LL_COMBINE, 0, 7, EPD_OK);
  epd_engine_destroy(w.eng);
}

/* ---- masked ranks --------------------------------------------------------------------------------- */

/* 4 ranks, 8 experts, 4 slots per rank. Expert e lives on rank e / 2, slot e % 2; with replicas, also on
 * rank (e / 2 + 1) % 4, slot 2 + e % 2. An expert multiplies a token by scale(e), so the combined output
 * of a token does not depend on which replica served it. */
#define MR 4
#define ME 8
#define MH 16
#define MK 2
#define MM 8
typedef struct mworld {
  epd_engine_t *eng;
  tclient_t c[MR];
  int live[MR];
  epd_ref_geom_t g;
  int replicas;
  uint64_t step_seed;
  int joiner; /* a masked rank's new worker: its dispatch goes first, so that it joins this step (-1: none) */
} mworld_t;

static float mscale(uint32_t e) {
  return 0.25f + 0.25f * (float)(e % 5);
}

static int slot_expert(const mworld_t *w, uint32_t r, uint32_t s) {
  if (s < 2) return (int)(r * 2 + s);
  if (!w->replicas) return -1;
  return (int)(((r + MR - 1) % MR) * 2 + (s - 2));
}

static void mworld_up(mworld_t *w, int replicas, uint32_t renorm, uint32_t timeout_ms) {
  memset(w, 0, sizeof *w);
  w->joiner = -1;
  epd_engine_opts_t o = opts_default(MR);
  o.slots_factor_pct = 200;
  o.step_timeout_ms = timeout_ms;
  w->eng = engine_up(&o);
  w->replicas = replicas;
  attach_on_loss = EPD_RANK_LOSS_MASK;
  attach_renorm = renorm;
  for (int r = 0; r < MR; r++) {
    attach_ok(w->eng, "m", r, ME, MH, MK, MM, &w->c[r]);
    w->live[r] = 1;
  }
  attach_on_loss = attach_renorm = 0;
  w->g = (epd_ref_geom_t){MR, ME, MH, MK, MM, w->c[0].info.slots_per_rank, 0};
  ASSERT_EQ(w->g.slots_per_rank, 4u);
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(w->eng, "m", &m));
  for (uint32_t e = 0; e < ME; e++) {
    m.nrep[e] = replicas ? 2 : 1;
    m.rep[e][0] = (epd_replica_t){e / 2, e % 2};
    m.rep[e][1] = (epd_replica_t){(e / 2 + 1) % MR, 2 + e % 2};
  }
  uint32_t v = 0;
  char err[256];
  ASSERT_OK(epd_engine_set_map(w->eng, "m", &m, &v, err, sizeof err));
  epd_expert_map_free(&m);
}

/* One dispatch + combine on the live ranks with fresh random inputs (some -1 entries); checks every
 * live rank's output against the sum over its entries whose expert has a replica on a live rank (scaled
 * to the full weight sum when renorm), and that the completions report `mask` and the dropped entries.
 * Returns the entries dropped over all ranks. */
static uint32_t mstep(mworld_t *w, uint64_t mask, int renorm) {
  const uint32_t T = MM;
  uint16_t x[MR][MM * MH];
  int64_t idx[MR][MM * MK];
  float wt[MR][MM * MK];
  w->step_seed++;
  for (int r = 0; r < MR; r++) {
    if (!w->live[r]) continue;
    epd_ref_gen_input(77, w->step_seed, (uint32_t)r, &w->g, T, 0, x[r], idx[r], wt[r]);
    memcpy(buf(&w->c[r], EPD_BUF_X, 0), x[r], sizeof x[r]);
    memcpy(buf(&w->c[r], EPD_BUF_TOPK_IDX, 0), idx[r], sizeof idx[r]);
    memcpy(buf(&w->c[r], EPD_BUF_TOPK_WEIGHTS, 0), wt[r], sizeof wt[r]);
  }
  if (w->joiner >= 0) {
    submit(&w->c[w->joiner], EPD_OP_LL_DISPATCH, T, 0, 0, w->step_seed);
    usleep(50000); /* taken at the step boundary before the others arrive */
  }
  for (int r = 0; r < MR; r++)
    if (w->live[r] && r != w->joiner) submit(&w->c[r], EPD_OP_LL_DISPATCH, T, 0, 0, w->step_seed);
  w->joiner = -1;
  uint32_t dropped = 0, want_drop[MR] = {0};
  for (int r = 0; r < MR; r++) {
    if (!w->live[r]) continue;
    epd_comp_t c = wait_done(&w->c[r], 5000);
    ASSERT_EQ(c.status, EPD_OK);
    ASSERT_EQ(c.masked, mask);
    for (uint32_t i = 0; i < T * MK; i++) {
      const int64_t e = idx[r][i];
      int dup = e < 0;
      for (uint32_t k2 = 0; k2 < i % MK && !dup; k2++) dup = idx[r][i - i % MK + k2] == e;
      if (dup) continue;
      const uint32_t p = (uint32_t)e / 2, q = (p + 1) % MR;
      const int alive = !(mask >> p & 1) || (w->replicas && !(mask >> q & 1));
      want_drop[r] += !alive;
    }
    ASSERT_EQ(c.dropped, want_drop[r]);
    dropped += c.dropped;
  }
  /* every live rank's experts: y = scale(e) * x for each token it received */
  for (int r = 0; r < MR; r++) {
    if (!w->live[r]) continue;
    const int32_t *cnt = buf(&w->c[r], EPD_BUF_LL_RECV_COUNT, 0);
    const uint16_t *rx = buf(&w->c[r], EPD_BUF_LL_RECV_X, 0);
    uint16_t *y = buf(&w->c[r], EPD_BUF_LL_Y, 0);
    for (uint32_t s = 0; s < w->g.slots_per_rank; s++) {
      const int e = slot_expert(w, (uint32_t)r, s);
      ASSERT(cnt[s] == 0 || e >= 0);
      for (int32_t i = 0; i < cnt[s]; i++)
        for (uint32_t h = 0; h < MH; h++) {
          const size_t at = ((size_t)s * MR * MM + (size_t)i) * MH + h;
          y[at] = epd_f32_to_bf16(mscale((uint32_t)e) * epd_bf16_to_f32(rx[at]));
        }
    }
  }
  for (int r = 0; r < MR; r++)
    if (w->live[r]) submit(&w->c[r], EPD_OP_LL_COMBINE, 0, 0, 0, w->step_seed);
  for (int r = 0; r < MR; r++) {
    if (!w->live[r]) continue;
    epd_comp_t c = wait_done(&w->c[r], 5000);
    ASSERT_EQ(c.status, EPD_OK);
    ASSERT_EQ(c.masked, mask);
    ASSERT_EQ(c.dropped, want_drop[r]); /* the dispatch's (no rank masked in between) */
    const uint16_t *out = buf(&w->c[r], EPD_BUF_OUT, 0);
    for (uint32_t t = 0; t < T; t++) {
      float wk[MK];
      int keep[MK];
      double all = 0, kept = 0;
      for (uint32_t k = 0; k < MK; k++) {
        const int64_t e = idx[r][t * MK + k];
        int dup = e < 0;
        for (uint32_t k2 = 0; k2 < k && !dup; k2++) dup = idx[r][t * MK + k2] == e;
        const uint32_t p = (uint32_t)e / 2, q = (p + 1) % MR;
        keep[k] = !dup && (!(mask >> p & 1) || (w->replicas && !(mask >> q & 1)));
        wk[k] = wt[r][t * MK + k];
        if (!dup) all += wk[k];
        if (keep[k]) kept += wk[k];
      }
      if (renorm && kept > 0 && kept < all)
        for (uint32_t k = 0; k < MK; k++) wk[k] *= (float)(all / kept);
      for (uint32_t h = 0; h < MH; h++) {
        float acc = 0;
        for (uint32_t k = 0; k < MK; k++) {
          if (!keep[k]) continue;
          const float yv = epd_bf16_to_f32(
              epd_f32_to_bf16(mscale((uint32_t)idx[r][t * MK + k]) * epd_bf16_to_f32(x[r][t * MH + h])));
          acc += wk[k] * yv;
        }
        const uint16_t want = epd_f32_to_bf16(acc), got = out[t * MH + h];
        if (want != got)
          epd_test_fail(__FILE__, __LINE__, "rank %d token %u h %u: out 0x%04x, want 0x%04x (mask 0x%llx)", r,
                        t, h, got, want, (unsigned long long)mask);
      }
    }
  }
  return dropped;
}

static void group_status(epd_engine_t *eng, uint64_t *masked, uint64_t *masks, uint64_t *dropped) {
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(eng, &snap));
  ASSERT_EQ(snap.ngroups, 1u);
  ASSERT_EQ(snap.groups[0].on_rank_loss, EPD_RANK_LOSS_MASK);
  *masked = snap.groups[0].masked_ranks;
  *masks = snap.groups[0].masks;
  *dropped = snap.groups[0].entries_dropped;
  epd_engine_snapshot_free(&snap);
}

EPD_TEST(engine_mask_lost_ranks_failover_to_replicas_and_return) {
  mworld_t w;
  mworld_up(&w, 1, 0, 5000);
  for (int i = 0; i < 3; i++) ASSERT_EQ(mstep(&w, 0, 0), 0u);
  /* Rank 2's worker dies: the next steps run without it, its experts served by their replicas. */
  pthread_mutex_lock(&ev_mu);
  ev_log[0] = 0;
  pthread_mutex_unlock(&ev_mu);
  uint64_t t0 = now_ms();
  ASSERT_OK(epd_engine_detach(w.eng, w.c[2].info.client_id, 1));
  unmap(&w.c[2]);
  w.live[2] = 0;
  ASSERT_EQ(w.c[0].q->masked_ranks, 1ull << 2);
  ASSERT_EQ(mstep(&w, 1ull << 2, 0), 0u); /* zero entries dropped: every expert has a live replica */
  ASSERT_LT(now_ms() - t0, 1000u);
  for (int i = 0; i < 3; i++) ASSERT_EQ(mstep(&w, 1ull << 2, 0), 0u);
  pthread_mutex_lock(&ev_mu);
  ASSERT_STR_CONTAINS(ev_log, "rank_masked(2,");
  pthread_mutex_unlock(&ev_mu);
  /* Rank 3 dies too: experts 4 and 5 (rank 2, replicas on rank 3) have no live replica: dropped. */
  ASSERT_OK(epd_engine_detach(w.eng, w.c[3].info.client_id, 1));
  unmap(&w.c[3]);
  w.live[3] = 0;
  uint32_t d = 0;
  for (int i = 0; i < 4; i++) d += mstep(&w, 3ull << 2, 0);
  ASSERT_GT(d, 0u);
  uint64_t masked, masks, dropped;
  group_status(w.eng, &masked, &masks, &dropped);
  ASSERT_EQ(masked, 3ull << 2);
  ASSERT_EQ(masks, 2u);
  ASSERT_EQ(dropped, d);
  /* A new worker attaches to rank 2: it is unmasked when its first dispatch joins a step. */
  attach_ok(w.eng, "m", 2, 0, 0, 0, 0, &w.c[2]);
  ASSERT_EQ(w.c[2].q->masked_ranks, 3ull << 2);
  w.live[2] = 1;
  w.joiner = 2;
  ASSERT_EQ(mstep(&w, 1ull << 3, 0), 0u);
  ASSERT_EQ(w.c[0].q->masked_ranks, 1ull << 3);
  attach_ok(w.eng, "m", 3, 0, 0, 0, 0, &w.c[3]);
  w.live[3] = 1;
  w.joiner = 3;
  ASSERT_EQ(mstep(&w, 0, 0), 0u);
  pthread_mutex_lock(&ev_mu);
  ASSERT_STR_CONTAINS(ev_log, "rank_unmasked(2,");
  ASSERT_STR_CONTAINS(ev_log, "rank_unmasked(3,");
  pthread_mutex_unlock(&ev_mu);
  group_status(w.eng, &masked, &masks, &dropped);
  ASSERT_EQ(masked, 0u);
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_mask_without_replicas_drops_and_renormalizes) {
  for (uint32_t renorm = 0; renorm < 2; renorm++) {
    mworld_t w;
    mworld_up(&w, 0, renorm, 5000);
    ASSERT_EQ(mstep(&w, 0, (int)renorm), 0u);
    ASSERT_OK(epd_engine_detach(w.eng, w.c[1].info.client_id, 0)); /* a clean detach masks too */
    unmap(&w.c[1]);
    w.live[1] = 0;
    uint32_t d = 0;
    for (int i = 0; i < 4; i++) d += mstep(&w, 1ull << 1, (int)renorm);
    ASSERT_GT(d, 0u); /* experts 2 and 3 lived on rank 1 only */
    epd_engine_destroy(w.eng);
  }
}

EPD_TEST(engine_mask_hung_rank_after_timeout_and_its_return) {
  mworld_t w;
  mworld_up(&w, 1, 0, 300);
  ASSERT_EQ(mstep(&w, 0, 0), 0u);
  /* Rank 3 does not submit: the step fails with a timeout naming it, then the group goes on without it. */
  for (int r = 0; r < 3; r++) submit(&w.c[r], EPD_OP_LL_DISPATCH, 0, 0, 0, 9);
  for (int r = 0; r < 3; r++) {
    epd_comp_t c = wait_done(&w.c[r], 5000);
    ASSERT_EQ(c.status, EPD_ERR_TIMEOUT);
    ASSERT_EQ(c.peer, 3);
  }
  w.live[3] = 0;
  for (int i = 0; i < 2; i++) ASSERT_EQ(mstep(&w, 1ull << 3, 0), 0u);
  /* The hung worker wakes up mid-pair: its combine fails, naming itself masked; its next dispatch rejoins. */
  submit(&w.c[3], EPD_OP_LL_COMBINE, 0, 0, 0, 10);
  epd_comp_t c = wait_done(&w.c[3], 5000);
  ASSERT_EQ(c.status, EPD_ERR_PEER);
  ASSERT_EQ(c.masked, 1ull << 3);
  w.live[3] = 1;
  w.joiner = 3;
  ASSERT_EQ(mstep(&w, 0, 0), 0u);
  epd_engine_destroy(w.eng);
}

EPD_TEST(engine_mask_policy_fixed_by_the_first_attach) {
  epd_engine_opts_t o = opts_default(2);
  epd_engine_t *eng = engine_up(&o);
  tclient_t a, b;
  char err[256] = "";
  attach_on_loss = 3;
  ASSERT_EQ(attach(eng, "p", 0, 4, 16, 2, 4, &a, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "on_rank_loss 3");
  attach_on_loss = EPD_RANK_LOSS_MASK;
  attach_ok(eng, "p", 0, 4, 16, 2, 4, &a);
  attach_on_loss = EPD_RANK_LOSS_FAIL;
  ASSERT_EQ(attach(eng, "p", 1, 0, 0, 0, 0, &b, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "on_rank_loss fail does not match group \"p\" (mask)");
  attach_on_loss = 0;
  attach_renorm = 1;
  ASSERT_EQ(attach(eng, "p", 1, 0, 0, 0, 0, &b, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "renormalize 1 does not match");
  attach_renorm = 0;
  attach_ok(eng, "p", 1, 0, 0, 0, 0, &b); /* 0: the group's policy */
  unmap(&a);
  unmap(&b);
  epd_engine_destroy(eng);
}

EPD_TEST(engine_mask_rejoin_after_every_rank_of_an_open_dispatch_left) {
  mworld_t w;
  mworld_up(&w, 1, 0, 5000);
  ASSERT_EQ(mstep(&w, 0, 0), 0u);
  for (int r = 2; r < 4; r++) {
    ASSERT_OK(epd_engine_detach(w.eng, w.c[r].info.client_id, 1));
    unmap(&w.c[r]);
  }
  /* ranks 0 and 1 dispatch; both die before the combine */
  for (int r = 0; r < 2; r++) submit(&w.c[r], EPD_OP_LL_DISPATCH, 0, 0, 0, 5);
  for (int r = 0; r < 2; r++) ASSERT_EQ(wait_done(&w.c[r], 5000).status, EPD_OK);
  /* a new worker of rank 2 attaches, then ranks 0 and 1 die: no combine is due any more, and the new
   * worker's dispatch rejoins (it runs alone) */
  attach_ok(w.eng, "m", 2, 0, 0, 0, 0, &w.c[2]);
  for (int r = 0; r < 2; r++) {
    ASSERT_OK(epd_engine_detach(w.eng, w.c[r].info.client_id, 1));
    unmap(&w.c[r]);
  }
  submit(&w.c[2], EPD_OP_LL_DISPATCH, 0, 0, 0, 6);
  epd_comp_t c = wait_done(&w.c[2], 5000);
  ASSERT_EQ(c.status, EPD_OK);
  ASSERT_EQ(c.masked, 0xbull);
  unmap(&w.c[2]);
  epd_engine_destroy(w.eng);
}
