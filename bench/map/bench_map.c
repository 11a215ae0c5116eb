/*
 * bench_map.c - cost of changing the expert map while steps run (in-process engine, raw slot protocol
 * as a client process would drive it).
 *
 * Per backend (host always; cuda with --cuda when the backend is usable), 2 ranks stepping LL dispatch +
 * combine continuously, a map staged every 4th step from another thread:
 *   - SetExpertMap -> first completed dispatch on the new version (median, p99);
 *   - dispatch latency of steps that switch vs steps that do not (median, p99);
 * Weight migration of 64 MiB (8 slots x 8 MiB copied from rank 0 to rank 1 at the switch) on the host
 * backend and, with --cuda, on the CUDA backend (GPU to GPU over NVLink): bandwidth from the switching
 * dispatch's extra time over a normal one.
 * With --cuda, what users pay today instead: destroy and re-create the NCCL communicators of 2 GPUs and
 * the EP buffers (a symmetric window of --window-mib, registered), through daemon/cuda_comm.c; and
 * cudaMemcpyPeer bandwidth for 64 MiB (the reference for the CUDA backend's migration).
 *
 * With one GPU both ranks share it (engine devices 0,0: NCCL's multi-rank mode), said in one line and in the
 * results: the migrations and cudaMemcpyPeer are then copies within that GPU (no NVLink), not comparable
 * with the records of a GPU per rank.
 *
 * Usage: epd-bench-map [OUTDIR] [--cuda] [--window-mib N]; writes OUTDIR/map-<backend...>.json and .md.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "core/engine.h"
#include "core/ref.h"
#if EPD_WITH_CUDA
#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "cuda/cuda_comm.h"
#endif

#if EPD_WITH_CUDA
/* The GPU of each of the 2 ranks: rank r on GPU r, or both on GPU 0 where there is one (gpu_map). */
static int g_dev[2] = {0, 1};
#endif

/* Fill g_dev; the most ranks on one GPU (1: a GPU per rank), 0 without a GPU (or CUDA). */
static int gpu_map(void) {
#if EPD_WITH_CUDA
  const int share = epd_cc_devices_for(2, g_dev);
  return share < 0 ? 0 : share;
#else
  return 0;
#endif
}

/* The engine's devices for backend (cuda: g_dev; host: none). */
static const int *engine_devices(const char *backend) {
#if EPD_WITH_CUDA
  if (!strcmp(backend, "cuda")) return g_dev;
#endif
  (void)backend;
  return NULL;
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double pct(double *v, int n, double p) {
  if (n <= 0) return -1;
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  int i = (int)(p / 100.0 * (n - 1) + 0.5);
  return v[i];
}

typedef struct bclient {
  epd_attach_info_t info;
  epd_queue_t *q;
  uint8_t *arena; /* NULL for GPU arenas */
  uint32_t next;
} bclient_t;

static int battach(epd_engine_t *eng, const char *group, int rank, uint32_t E, uint32_t H, uint32_t K,
                   uint32_t M, uint64_t wb, bclient_t *c) {
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  snprintf(req.group, sizeof req.group, "%s", group);
  req.rank = rank;
  req.num_experts = E;
  req.hidden = H;
  req.topk = K;
  req.max_tokens = M;
  req.pid = (uint32_t)getpid();
  req.weight_bytes_per_slot = wb;
  char err[256] = "";
  memset(c, 0, sizeof *c);
  if (epd_engine_attach(eng, &req, &c->info, err, sizeof err)) {
    fprintf(stderr, "attach: %s\n", err);
    return -1;
  }
  c->q = mmap(NULL, c->info.queue_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.queue_fd, 0);
  if (!c->info.on_gpu)
    c->arena = mmap(NULL, c->info.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.arena_fd, 0);
  return c->q == MAP_FAILED || c->arena == MAP_FAILED ? -1 : 0;
}

static void *bbuf(bclient_t *c, uint32_t kind, uint32_t bank) {
  for (uint32_t i = 0; i < c->info.nbuffers; i++)
    if (c->info.buffers[i].kind == kind && c->info.buffers[i].bank == bank)
      return c->arena + c->info.buffers[i].offset;
  return NULL;
}

static int op(bclient_t *c, uint32_t opc, uint32_t T, uint32_t bank, epd_comp_t *out) {
  epd_slot_t *s = &c->q->slot[c->next];
  memset(&s->desc, 0, sizeof s->desc);
  s->desc.op = opc;
  s->desc.num_tokens = T;
  s->desc.bank = bank;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_SUBMITTED, memory_order_release);
  double end = now_us() + 20e6;
  while (atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire) != EPD_SLOT_DONE)
    if (now_us() > end) return -1;
  *out = s->comp;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_FREE, memory_order_release);
  c->next = (c->next + 1) % EPD_QUEUE_SLOTS;
  return out->status;
}

/* ---- switching while stepping -------------------------------------------------------------------- */

#define NSTEPS 2000
#define EVERY 4
typedef struct sw {
  epd_engine_t *eng;
  bclient_t c[2];
  uint32_t E, H, K, M, S, T;
  atomic_uint progress;
  atomic_int stop;
  double t_set[NSTEPS]; /* by version */
  double t_first[NSTEPS];
  double disp_us[NSTEPS];
  uint32_t ver[NSTEPS];
  int failed;
} sw_t;

typedef struct sw_arg {
  sw_t *w;
  int rank;
} sw_arg_t;

static void *sw_rank(void *arg) {
  sw_arg_t *a = arg;
  sw_t *w = a->w;
  bclient_t *c = &w->c[a->rank];
  epd_ref_geom_t g = {2, w->E, w->H, w->K, w->M, w->S, c->info.ht_capacity};
  if (c->arena)
    for (uint32_t b = 0; b < EPD_NUM_BANKS; b++) /* fixed inputs: routing work is what a real step has */
      epd_ref_gen_input(7, b, (uint32_t)a->rank, &g, w->T, 0, bbuf(c, EPD_BUF_X, b),
                        bbuf(c, EPD_BUF_TOPK_IDX, b), bbuf(c, EPD_BUF_TOPK_WEIGHTS, b));
  uint32_t last = 0;
  for (int step = 0; step < NSTEPS; step++) {
    uint32_t bank = (uint32_t)step % EPD_NUM_BANKS;
    epd_comp_t comp;
    double t0 = now_us();
    if (op(c, EPD_OP_LL_DISPATCH, w->T, bank, &comp)) {
      fprintf(stderr, "rank %d step %d: dispatch status %d\n", a->rank, step, comp.status);
      w->failed = 1;
      break;
    }
    double t1 = now_us();
    if (a->rank == 0) {
      w->disp_us[step] = t1 - t0;
      w->ver[step] = comp.map_version;
      if (comp.map_version != last && comp.map_version < NSTEPS) w->t_first[comp.map_version] = t1;
    }
    last = comp.map_version;
    if (op(c, EPD_OP_LL_COMBINE, 0, bank, &comp)) {
      w->failed = 1;
      break;
    }
    if (a->rank == 0) atomic_fetch_add(&w->progress, 1);
  }
  return NULL;
}

static void *sw_setter(void *arg) {
  sw_t *w = arg;
  epd_expert_map_t m;
  epd_engine_get_map(w->eng, "b", &m);
  uint64_t rs = 5;
  uint32_t seen = 0;
  while (!atomic_load(&w->stop)) {
    while (atomic_load(&w->progress) < seen + EVERY && !atomic_load(&w->stop)) usleep(2);
    seen = atomic_load(&w->progress);
    /* Move a random expert to a random free slot, keeping the map valid. */
    uint32_t e = (uint32_t)(epd_ref_rand(&rs) % w->E);
    for (int tries = 0; tries < 64; tries++) {
      epd_replica_t cand = {(uint32_t)(epd_ref_rand(&rs) % 2), (uint32_t)(epd_ref_rand(&rs) % w->S)};
      int used = 0;
      for (uint32_t x = 0; x < w->E && !used; x++)
        for (uint32_t i = 0; i < m.nrep[x]; i++)
          used |= m.rep[x][i].rank == cand.rank && m.rep[x][i].slot == cand.slot;
      if (!used) {
        m.rep[e][0] = cand;
        break;
      }
    }
    uint32_t v = 0;
    char err[256];
    double t = now_us();
    if (epd_engine_set_map(w->eng, "b", &m, &v, err, sizeof err)) {
      fprintf(stderr, "set_map: %s\n", err);
      w->failed = 1;
      break;
    }
    if (v < NSTEPS) w->t_set[v] = t;
  }
  epd_expert_map_free(&m);
  return NULL;
}

typedef struct sw_result {
  int ok;
  int switches;
  double lat_med, lat_p99, sw_med, sw_p99, norm_med, norm_p99;
} sw_result_t;

static sw_result_t run_switching(const char *backend, uint32_t T) {
  sw_result_t res;
  memset(&res, 0, sizeof res);
  static sw_t w;
  memset(&w, 0, sizeof w);
  epd_engine_opts_t o;
  memset(&o, 0, sizeof o);
  o.backend = backend;
  o.num_ranks = 2;
  o.devices = engine_devices(backend);
  o.slots_factor_pct = 200;
  o.max_arena_bytes = 8ull << 30;
  char err[256] = "";
  if (epd_engine_create(&o, NULL, NULL, &w.eng, err, sizeof err)) {
    fprintf(stderr, "engine (%s): %s\n", backend, err);
    return res;
  }
  w.E = 32, w.H = 2048, w.K = 8, w.M = 128, w.T = T;
  for (int r = 0; r < 2; r++)
    if (battach(w.eng, "b", r, w.E, w.H, w.K, w.M, 0, &w.c[r])) goto out;
  w.S = w.c[0].info.slots_per_rank;
  pthread_t th[2], st;
  sw_arg_t ra[2] = {{&w, 0}, {&w, 1}};
  pthread_create(&st, NULL, sw_setter, &w);
  for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, sw_rank, &ra[r]);
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  atomic_store(&w.stop, 1);
  pthread_join(st, NULL);
  if (w.failed) goto out;
  static double lat[NSTEPS], swd[NSTEPS], nod[NSTEPS];
  int nl = 0, ns = 0, nn = 0;
  for (uint32_t v = 2; v < NSTEPS; v++)
    if (w.t_set[v] > 0 && w.t_first[v] > 0) lat[nl++] = w.t_first[v] - w.t_set[v];
  for (int s = 100; s < NSTEPS; s++) { /* skip warm-up */
    if (w.ver[s] != w.ver[s - 1])
      swd[ns++] = w.disp_us[s];
    else
      nod[nn++] = w.disp_us[s];
  }
  res.ok = 1;
  res.switches = nl;
  res.lat_med = pct(lat, nl, 50), res.lat_p99 = pct(lat, nl, 99);
  res.sw_med = pct(swd, ns, 50), res.sw_p99 = pct(swd, ns, 99);
  res.norm_med = pct(nod, nn, 50), res.norm_p99 = pct(nod, nn, 99);
out:
  epd_engine_destroy(w.eng);
  return res;
}

/* ---- migration ----------------------------------------------------------------------------------- */

typedef struct mig_result {
  int ok;
  double copy_ms_med, gbps_med, normal_us;
} mig_result_t;

typedef struct mig_arg {
  bclient_t *c;
  int n;
  double *us;
  uint32_t *ver;
} mig_arg_t;

static void *mig_rank1(void *arg) {
  mig_arg_t *a = arg;
  epd_comp_t comp;
  for (int i = 0; i < a->n; i++) {
    op(a->c, EPD_OP_LL_DISPATCH, 0, 0, &comp);
    op(a->c, EPD_OP_LL_COMBINE, 0, 0, &comp);
  }
  return NULL;
}

static mig_result_t run_migration(const char *backend) {
  mig_result_t res;
  memset(&res, 0, sizeof res);
  const uint64_t WB = 8ull << 20; /* 8 slots x 8 MiB = 64 MiB per migration */
  epd_engine_opts_t o;
  memset(&o, 0, sizeof o);
  o.backend = backend;
  o.num_ranks = 2;
  o.devices = engine_devices(backend);
  o.slots_factor_pct = 400;
  o.max_arena_bytes = 8ull << 30;
  epd_engine_t *eng = NULL;
  char err[320] = "";
  if (epd_engine_create(&o, NULL, NULL, &eng, err, sizeof err)) return res;
  bclient_t c[2];
  uint32_t E = 16;
  for (int r = 0; r < 2; r++)
    if (battach(eng, "m", r, E, 128, 4, 16, WB, &c[r])) goto out;
  uint32_t S = c[0].info.slots_per_rank; /* 32: experts 0..7 on rank 0 slots 0..7 */
  for (int r = 0; r < 2; r++)            /* prefault (GPU arenas are backed at allocation) */
    if (c[r].arena) memset(bbuf(&c[r], EPD_BUF_EXPERT_WEIGHTS, 0), 0x11 * (r + 1), S * WB);
  enum { ROUNDS = 9, NORMAL = 8 };
  double copy_ms[ROUNDS], normal[ROUNDS * NORMAL];
  int nn = 0;
  epd_expert_map_t m;
  epd_engine_get_map(eng, "m", &m);
  for (int round = 0; round < ROUNDS; round++) {
    /* Rank 1 runs the same number of steps in its own thread. */
    mig_arg_t a = {&c[1], NORMAL + 1, NULL, NULL};
    pthread_t th;
    pthread_create(&th, NULL, mig_rank1, &a);
    epd_comp_t comp;
    for (int i = 0; i < NORMAL; i++) {
      double t0 = now_us();
      op(&c[0], EPD_OP_LL_DISPATCH, 0, 0, &comp);
      normal[nn++] = now_us() - t0;
      op(&c[0], EPD_OP_LL_COMBINE, 0, 0, &comp);
      if (i == NORMAL - 1) {
        /* Replicate experts 0..7 (rank 0 slots 0..7) onto rank 1 slots 16+round%2*8.., with copies. */
        epd_weight_copy_t cp[8];
        uint32_t base = 16 + (uint32_t)(round % 2) * 8;
        for (uint32_t e = 0; e < 8; e++) {
          m.nrep[e] = 2;
          m.rep[e][1] = (epd_replica_t){1, base + e};
          cp[e] = (epd_weight_copy_t){0, e, 1, base + e};
        }
        uint32_t v;
        if (epd_engine_set_map_copies(eng, "m", &m, cp, 8, &v, err, sizeof err)) {
          fprintf(stderr, "migration map: %s\n", err);
          pthread_join(th, NULL);
          goto out;
        }
      }
    }
    double t0 = now_us();
    op(&c[0], EPD_OP_LL_DISPATCH, 0, 0, &comp);
    copy_ms[round] = (now_us() - t0) / 1e3;
    op(&c[0], EPD_OP_LL_COMBINE, 0, 0, &comp);
    pthread_join(th, NULL);
  }
  epd_expert_map_free(&m);
  res.normal_us = pct(normal, nn, 50);
  res.copy_ms_med = pct(copy_ms, ROUNDS, 50) - res.normal_us / 1e3;
  res.gbps_med = (64.0 * (1 << 20)) / (res.copy_ms_med / 1e3) / 1e9;
  res.ok = 1;
out:
  epd_engine_destroy(eng);
  return res;
}

/* ---- what users pay today (GPU) ------------------------------------------------------------------ */

typedef struct gpu_result {
  int ok;
  double create_ms, window_ms, teardown_ms, total_ms, peer_gbps;
  char nccl[32], gpu[128];
} gpu_result_t;

static gpu_result_t run_recreate(size_t window_mib) {
  gpu_result_t g;
  memset(&g, 0, sizeof g);
#if EPD_WITH_CUDA
  if (gpu_map() < 1) {
    fprintf(stderr, "recreate: needs a GPU\n");
    return g;
  }
  const int d0 = g_dev[0], d1 = g_dev[1];
  struct cudaDeviceProp pr;
  cudaGetDeviceProperties(&pr, d0);
  snprintf(g.gpu, sizeof g.gpu, "%.120s", pr.name);
  int nv = 0;
  ncclGetVersion(&nv);
  snprintf(g.nccl, sizeof g.nccl, "%d.%d.%d", nv / 10000, (nv / 100) % 100, nv % 100);
  enum { ROUNDS = 3 };
  double cr[ROUNDS], wi[ROUNDS], td[ROUNDS], tot[ROUNDS];
  char err[256] = "";
  for (int i = 0; i < ROUNDS; i++) {
    epd_cc_t *cc = NULL;
    epd_cc_win_t w;
    double t0 = now_us();
    if (epd_cc_create(2, g_dev, &cc, err, sizeof err)) {
      fprintf(stderr, "epd_cc_create: %s\n", err);
      return g;
    }
    double t1 = now_us();
    if (epd_cc_window_alloc(cc, window_mib << 20, &w, err, sizeof err)) {
      fprintf(stderr, "window: %s\n", err);
      epd_cc_destroy(cc);
      return g;
    }
    double t2 = now_us();
    epd_cc_window_free(cc, &w);
    epd_cc_destroy(cc);
    double t3 = now_us();
    cr[i] = (t1 - t0) / 1e3, wi[i] = (t2 - t1) / 1e3, td[i] = (t3 - t2) / 1e3, tot[i] = (t3 - t0) / 1e3;
  }
  g.create_ms = pct(cr, ROUNDS, 50), g.window_ms = pct(wi, ROUNDS, 50), g.teardown_ms = pct(td, ROUNDS, 50);
  g.total_ms = pct(tot, ROUNDS, 50);
  /* cudaMemcpyPeer 64 MiB rank 0's GPU -> rank 1's: what a GPU migration could reach over NVLink (a copy
   * within the GPU where both ranks share one). */
  void *a = NULL, *b = NULL;
  size_t n = 64u << 20;
  cudaSetDevice(d0);
  cudaMalloc(&a, n);
  if (d1 != d0) cudaDeviceEnablePeerAccess(d1, 0);
  cudaSetDevice(d1);
  cudaMalloc(&b, n);
  if (d1 != d0) cudaDeviceEnablePeerAccess(d0, 0);
  cudaGetLastError(); /* peer access already enabled */
  cudaSetDevice(d0);
  cudaMemcpyPeer(b, d1, a, d0, n);
  cudaDeviceSynchronize();
  double best = 1e30;
  for (int i = 0; i < 10; i++) {
    double t0 = now_us();
    cudaMemcpyPeer(b, d1, a, d0, n);
    cudaDeviceSynchronize();
    double t = now_us() - t0;
    if (t < best) best = t;
  }
  g.peer_gbps = n / (best / 1e6) / 1e9;
  cudaFree(a);
  cudaSetDevice(d1);
  cudaFree(b);
  g.ok = 1;
#else
  (void)window_mib;
#endif
  return g;
}

int main(int argc, char **argv) {
  const char *outdir = ".";
  int cuda = 0;
  size_t window_mib = 1024;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--cuda"))
      cuda = 1;
    else if (!strcmp(argv[i], "--window-mib") && i + 1 < argc)
      window_mib = (size_t)atoi(argv[++i]);
    else
      outdir = argv[i];
  }
  sw_result_t hs = run_switching("host", 64);
  printf(
      "host: %d switches; SetExpertMap -> first step on it: median %.1f us, p99 %.1f us; dispatch: switching "
      "%.1f/%.1f us, normal %.1f/%.1f us (median/p99)\n",
      hs.switches, hs.lat_med, hs.lat_p99, hs.sw_med, hs.sw_p99, hs.norm_med, hs.norm_p99);
  mig_result_t mg = run_migration("host");
  printf("host migration of 64 MiB: %.2f ms (%.2f GB/s)\n", mg.copy_ms_med, mg.gbps_med);
  mig_result_t mc;
  memset(&mc, 0, sizeof mc);
  sw_result_t cs;
  memset(&cs, 0, sizeof cs);
  gpu_result_t gr;
  memset(&gr, 0, sizeof gr);
  const int share = cuda ? gpu_map() : 0;
  if (share > 1)
    printf(
        "the 2 ranks share one GPU: migrations and cudaMemcpyPeer are copies within it (no NVLink), figures "
        "not "
        "comparable with the records of a GPU per rank\n");
  if (cuda) {
    gr = run_recreate(window_mib);
    if (gr.ok)
      printf(
          "today: NCCL comm create %.1f ms + %zu MiB window register %.1f ms + teardown %.1f ms = %.1f ms; "
          "cudaMemcpyPeer 64 MiB %.1f GB/s\n",
          gr.create_ms, window_mib, gr.window_ms, gr.teardown_ms, gr.total_ms, gr.peer_gbps);
    mc = run_migration("cuda");
    if (mc.ok) printf("cuda migration of 64 MiB: %.3f ms (%.1f GB/s)\n", mc.copy_ms_med, mc.gbps_med);
    cs = run_switching("cuda", 0);
    if (cs.ok)
      printf(
          "cuda: %d switches; SetExpertMap -> first step: median %.1f us, p99 %.1f us; dispatch: switching "
          "%.1f/%.1f us, normal %.1f/%.1f us\n",
          cs.switches, cs.lat_med, cs.lat_p99, cs.sw_med, cs.sw_p99, cs.norm_med, cs.norm_p99);
  }
  struct utsname u;
  uname(&u);
  char date[64];
  time_t now = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  const char *cmd = getenv("EPD_BENCH_CMD") ? getenv("EPD_BENCH_CMD") : argv[0];
  char path[512];
  snprintf(path, sizeof path, "%s/map-%s.json", outdir, cuda ? "gpu" : "host");
  FILE *f = fopen(path, "w");
  if (!f) {
    perror(path);
    return 1;
  }
  fprintf(
      f,
      "{\n  \"bench\": \"map\",\n  \"date\": \"%s\",\n  \"host\": \"%s %s\",\n  \"epd_version\": \"%s\",\n",
      date, u.nodename, u.release, EPD_VERSION);
  fprintf(
      f,
      "  \"command\": \"%s\",\n  \"geometry\": \"2 ranks, 32 experts, hidden 2048, topk 8, max_tokens 128, "
      "slots 200%%, host T=64 tokens/rank, cuda T=0, a new map every %d steps, %d steps\",\n",
      cmd, EVERY, NSTEPS);
  fprintf(f,
          "  \"host\": {\"switches\": %d, \"set_to_first_step_us\": {\"median\": %.2f, \"p99\": %.2f}, "
          "\"dispatch_switching_us\": {\"median\": %.2f, \"p99\": %.2f}, \"dispatch_normal_us\": "
          "{\"median\": %.2f, "
          "\"p99\": %.2f}, \"migration_64mib_ms\": %.3f, \"migration_gbps\": %.2f},\n",
          hs.switches, hs.lat_med, hs.lat_p99, hs.sw_med, hs.sw_p99, hs.norm_med, hs.norm_p99, mg.copy_ms_med,
          mg.gbps_med);
  if (cuda) fprintf(f, "  \"ranks_per_gpu\": %d,\n", share);
  if (cuda)
    fprintf(
        f,
        "  \"gpu\": \"%s\", \"nccl\": \"%s\",\n  \"cuda\": {\"ok\": %d, \"switches\": %d, "
        "\"set_to_first_step_us\": "
        "{\"median\": %.2f, \"p99\": %.2f}, \"dispatch_switching_us\": {\"median\": %.2f, \"p99\": %.2f}, "
        "\"dispatch_normal_us\": {\"median\": %.2f, \"p99\": %.2f}},\n  \"today\": {\"ok\": %d, "
        "\"comm_create_ms\": "
        "%.2f, \"window_mib\": %zu, \"window_register_ms\": %.2f, \"teardown_ms\": %.2f, \"total_ms\": %.2f, "
        "\"memcpy_peer_64mib_gbps\": %.2f},\n  \"cuda_migration\": {\"ok\": %d, \"migration_64mib_ms\": "
        "%.3f, "
        "\"migration_gbps\": %.2f},\n",
        gr.gpu, gr.nccl, cs.ok, cs.switches, cs.lat_med, cs.lat_p99, cs.sw_med, cs.sw_p99, cs.norm_med,
        cs.norm_p99, gr.ok, gr.create_ms, window_mib, gr.window_ms, gr.teardown_ms, gr.total_ms, gr.peer_gbps,
        mc.ok, mc.copy_ms_med, mc.gbps_med);
  fprintf(f, "  \"ok\": %d\n}\n", hs.ok && mg.ok);
  fclose(f);
  snprintf(path, sizeof path, "%s/map-%s.md", outdir, cuda ? "gpu" : "host");
  f = fopen(path, "w");
  if (!f) return 1;
  fprintf(f, "# Expert map switch benchmark (%s)\n\n%s, host %s, epd %s. Command: `%s`.\n\n",
          cuda ? "GPU" : "host", date, u.nodename, EPD_VERSION, cmd);
  fprintf(f,
          "2 ranks, 32 experts, hidden 2048, topk 8, max_tokens 128, 200%% slots; ranks step LL dispatch + "
          "combine "
          "back to back, a new map (one expert moved) staged every %d steps; %d steps.\n\n",
          EVERY, NSTEPS);
  if (share > 1)
    fprintf(f,
            "The 2 ranks share one GPU (NCCL's multi-rank mode): the CUDA backend's migrations and "
            "cudaMemcpyPeer "
            "below are copies within it, no NVLink; not comparable with the records of a GPU per rank.\n\n");
  fprintf(
      f,
      "| backend | switches | SetExpertMap -> first step on it (median / p99) | switching dispatch (median / "
      "p99) | normal dispatch (median / p99) |\n|---|---|---|---|---|\n");
  fprintf(f, "| host (64 tokens/rank) | %d | %.1f / %.1f us | %.1f / %.1f us | %.1f / %.1f us |\n",
          hs.switches, hs.lat_med, hs.lat_p99, hs.sw_med, hs.sw_p99, hs.norm_med, hs.norm_p99);
  if (cuda && cs.ok)
    fprintf(f, "| cuda (0 tokens) | %d | %.1f / %.1f us | %.1f / %.1f us | %.1f / %.1f us |\n", cs.switches,
            cs.lat_med, cs.lat_p99, cs.sw_med, cs.sw_p99, cs.norm_med, cs.norm_p99);
  fprintf(
      f,
      "\nWeight migration, host backend (memcpy between the ranks' memfd arenas at the switch): 64 MiB "
      "(8 slots x 8 MiB) in %.2f ms = %.2f GB/s (median of 9, extra time of the switching dispatch over a "
      "normal one).\n",
      mg.copy_ms_med, mg.gbps_med);
  if (cuda && mc.ok)
    fprintf(f,
            "\nWeight migration, CUDA backend (device-to-device copies between the ranks' GPU arenas over "
            "NVLink at "
            "the switch, the switch waits for them): 64 MiB (8 slots x 8 MiB) in %.3f ms = %.1f GB/s (median "
            "of 9, "
            "same method).\n",
            mc.copy_ms_med, mc.gbps_med);
  if (cuda && gr.ok)
    fprintf(f,
            "\nWhat users pay today on %s x%d (NCCL %s): create the communicators %.1f ms + allocate and "
            "register a "
            "%zu MiB symmetric window %.1f ms + tear both down %.1f ms = %.1f ms per re-initialisation "
            "(median of 3, "
            "daemon/cuda_comm.c). For comparison, cudaMemcpyPeer of 64 MiB GPU0 -> GPU1 (the NVLink copy "
            "ceiling for the migration above): %.1f GB/s.\n",
            gr.gpu, share > 1 ? 1 : 2, gr.nccl, gr.create_ms, window_mib, gr.window_ms, gr.teardown_ms,
            gr.total_ms, gr.peer_gbps);
  fclose(f);
  return hs.ok && mg.ok && (!cuda || mc.ok) ? 0 : 1;
}
