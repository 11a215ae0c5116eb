/*
 * bench_e2e.c - end-to-end LL benchmark through the daemon: one process per rank (start one per rank,
 * e.g. bench/e2e/run_gpu.sh), each attached to a daemon with engine.backend=cuda, timing dispatch and
 * combine as the client sees them:
 *   memop  - epd_dispatch/epd_combine on a CUDA stream (stream memory operations):
 *            sync: per step, both ranks released by a host barrier, host clock from the first enqueue to
 *                  the end of cudaStreamSynchronize (the definition of bench_ll's in-process (c));
 *            pipe: `iters` steps enqueued back to back, CUDA events between ops (per-op time on the
 *                  stream) and the step period (total / iters); also the host cost of one enqueue call;
 *   graph  - 4 steps (8 ops, one ring of slots) captured in a CUDA graph, replayed: sync (one replay per
 *            barrier, per step = replay / 4) and pipe (replays back to back);
 *   device - a client kernel (bench/e2e/e2e_dev.cu, include/epd/epd_device.h) submits and waits on the GPU:
 *            pipe: one kernel runs `dev_iters` steps, GPU global timer around every op;
 *            sync: one kernel of one step per barrier, host clock.
 * Setting: 128 tokens per rank, hidden 7168, top-8, 256 experts, random routing (8 distinct experts per
 * token), FP8 and BF16 dispatch, BF16 combine. Each rank writes raw per-iteration times to OUT.rankR.json;
 * bench/e2e/report.py merges the ranks (per iteration the slower rank) and writes the tables.
 *
 * Usage: epd-bench-e2e -s SOCKET -r RANK [-g GROUP] [--iters N] [--dev-iters N] [--out PREFIX]
 *        [--no-device] [--no-graph]
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <getopt.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "epd.h"

#define E_ 256u
#define H_ 7168u
#define K_ 8u
#define M_ 128u
#define MAXI 4096

int e2e_dev_launch(void *slots, uint32_t first, uint32_t nsteps, uint32_t bank0, uint32_t ntok,
                   uint32_t flags, uint64_t timeout_ns, uint64_t *ts, int *status, void *stream);

#define DIE(...)                                  \
  do {                                            \
    fprintf(stderr, "bench_e2e rank %d: ", rank); \
    fprintf(stderr, __VA_ARGS__);                 \
    fprintf(stderr, "\n");                        \
    exit(1);                                      \
  } while (0)
#define CU(e)                                                                                   \
  do {                                                                                          \
    cudaError_t c_ = (e);                                                                       \
    if (c_ != cudaSuccess) DIE("%s:%d %s: %s", __FILE__, __LINE__, #e, cudaGetErrorString(c_)); \
  } while (0)
#define EP(e)                                                                                 \
  do {                                                                                        \
    epd_result_t r_ = (e);                                                                    \
    if (r_ != EPD_OK)                                                                         \
      DIE("%s:%d %s: %s (%s)", __FILE__, __LINE__, #e, epd_strerror(r_), epd_last_error(ep)); \
  } while (0)

static int rank = -1;
static epd_ep_t *ep;
static cudaStream_t st;

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static uint64_t rs;
static uint64_t rnd(void) {
  uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint16_t bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* ---- a two-process barrier in shared memory ----------------------------------------------------- */

typedef struct shm_bar {
  _Atomic uint64_t arrived;
} shm_bar_t;
static shm_bar_t *bar;
static uint64_t bar_gen;

static void bar_open(const char *group) {
  char name[128];
  snprintf(name, sizeof name, "/epd-bench-e2e-%s", group);
  int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, 4096) < 0) DIE("shm_open %s failed", name);
  bar = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (bar == MAP_FAILED) DIE("mmap shm failed");
  close(fd);
}

static void barrier(void) {
  bar_gen++;
  atomic_fetch_add(&bar->arrived, 1);
  const double t0 = now_us();
  while (atomic_load(&bar->arrived) < 2 * bar_gen)
    if (now_us() - t0 > 30e6)
      DIE("barrier %llu: the other rank did not arrive in 30 s", (unsigned long long)bar_gen);
}

/* ---- output ------------------------------------------------------------------------------------- */

static FILE *out;
static int first_key = 1;

static void put_arr(const char *name, const double *v, int n) {
  fprintf(out, "%s\n  \"%s\": [", first_key ? "" : ",", name);
  first_key = 0;
  for (int i = 0; i < n; i++) fprintf(out, "%s%.3f", i ? "," : "", v[i]);
  fprintf(out, "]");
}
static void put_num(const char *name, double v) {
  fprintf(out, "%s\n  \"%s\": %.4f", first_key ? "" : ",", name, v);
  first_key = 0;
}

/* ---- modes -------------------------------------------------------------------------------------- */

static double *A, *B, *C; /* scratch of MAXI */

static void step_enqueue(uint32_t flags, unsigned bank) {
  EP(epd_dispatch(ep, EPD_MODE_LL, M_, flags, bank, st));
  EP(epd_combine(ep, EPD_MODE_LL, bank, st));
}

static void check_status(const char *what) {
  epd_comp_t c;
  epd_result_t r = epd_op_status(ep, &c);
  if (r) DIE("%s: op status %s (%s)", what, epd_strerror(r), epd_last_error(ep));
}

static void mode_memop(const char *tag, uint32_t flags, int iters) {
  char key[96];
  /* sync: per step, host clock only (no events on the stream: without MPS an event record between the
   * memops costs a context switch), and the daemon's own latency of the combine (comp.latency_ns: from
   * the last rank's submission seen to the completion written) */
  for (int i = 0; i < iters; i++) {
    barrier();
    const double t0 = now_us();
    EP(epd_dispatch(ep, EPD_MODE_LL, M_, flags, i & 1, st));
    EP(epd_combine(ep, EPD_MODE_LL, i & 1, st));
    CU(cudaStreamSynchronize(st));
    A[i] = now_us() - t0;
    epd_comp_t cp;
    if (epd_op_status(ep, &cp)) DIE("%s: op status %s", tag, epd_last_error(ep));
    B[i] = cp.latency_ns / 1e3;
  }
  snprintf(key, sizeof key, "%s.memop.sync.step_host_us", tag);
  put_arr(key, A, iters);
  snprintf(key, sizeof key, "%s.memop.sync.combine_daemon_latency_us", tag);
  put_arr(key, B, iters);
  /* pipe without events: the step period and the host cost of one call */
  barrier();
  {
    const double t0 = now_us();
    double enq = 0;
    for (int i = 0; i < iters; i++) {
      const double a = now_us();
      step_enqueue(flags, i & 1);
      enq += now_us() - a;
    }
    CU(cudaStreamSynchronize(st));
    snprintf(key, sizeof key, "%s.memop.pipe.period_host_us", tag);
    put_num(key, (now_us() - t0) / iters);
    snprintf(key, sizeof key, "%s.memop.enqueue_call_host_us", tag);
    put_num(key, enq / (2.0 * iters));
    check_status(tag);
  }

  /* pipe with CUDA events between every op: per-op time on the stream (perturbs without MPS) */
  cudaEvent_t *pe = calloc(2 * (size_t)iters + 1, sizeof *pe);
  for (int i = 0; i < 2 * iters + 1; i++) CU(cudaEventCreate(&pe[i]));
  barrier();
  const double t0 = now_us();
  CU(cudaEventRecord(pe[0], st));
  for (int i = 0; i < iters; i++) {
    EP(epd_dispatch(ep, EPD_MODE_LL, M_, flags, i & 1, st));
    CU(cudaEventRecord(pe[2 * i + 1], st));
    EP(epd_combine(ep, EPD_MODE_LL, i & 1, st));
    CU(cudaEventRecord(pe[2 * i + 2], st));
  }
  CU(cudaStreamSynchronize(st));
  const double total = now_us() - t0;
  check_status(tag);
  for (int i = 0; i < iters; i++) {
    float ms;
    CU(cudaEventElapsedTime(&ms, pe[2 * i], pe[2 * i + 1]));
    B[i] = ms * 1e3;
    CU(cudaEventElapsedTime(&ms, pe[2 * i + 1], pe[2 * i + 2]));
    C[i] = ms * 1e3;
    A[i] = B[i] + C[i];
  }
  for (int i = 0; i < 2 * iters + 1; i++) CU(cudaEventDestroy(pe[i]));
  free(pe);
  snprintf(key, sizeof key, "%s.memop.events.dispatch_stream_us", tag);
  put_arr(key, B, iters);
  snprintf(key, sizeof key, "%s.memop.events.combine_stream_us", tag);
  put_arr(key, C, iters);
  snprintf(key, sizeof key, "%s.memop.events.period_host_us", tag);
  put_num(key, total / iters);
}

static void mode_graph(const char *tag, uint32_t flags, int replays) {
  char key[96];
  /* Capture one full ring of slots (4 steps = 8 ops) so every replay starts where the daemon expects. */
  int guard = 0;
  while (epd_info(ep, EPD_INFO_NEXT_SLOT) != 0) {
    step_enqueue(flags, 0);
    if (++guard > (int)EPD_QUEUE_SLOTS) DIE("could not align the slot ring");
  }
  CU(cudaStreamSynchronize(st));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 4; i++) step_enqueue(flags, i & 1);
  CU(cudaStreamEndCapture(st, &g));
  CU(cudaGraphInstantiate(&ge, g, 0));
  CU(cudaGraphLaunch(ge, st)); /* warm-up */
  CU(cudaStreamSynchronize(st));
  check_status(tag);
  for (int i = 0; i < replays; i++) {
    barrier();
    const double t0 = now_us();
    CU(cudaGraphLaunch(ge, st));
    CU(cudaStreamSynchronize(st));
    A[i] = (now_us() - t0) / 4;
  }
  snprintf(key, sizeof key, "%s.graph.sync.step_host_us", tag);
  put_arr(key, A, replays);
  barrier();
  const double t0 = now_us();
  for (int i = 0; i < replays; i++) CU(cudaGraphLaunch(ge, st));
  CU(cudaStreamSynchronize(st));
  snprintf(key, sizeof key, "%s.graph.pipe.period_host_us", tag);
  put_num(key, (now_us() - t0) / (4.0 * replays));
  check_status(tag);
  CU(cudaGraphExecDestroy(ge));
  CU(cudaGraphDestroy(g));
}

static uint32_t dev_slot; /* ring position of the device-side ops (libepd's is not used after them) */

static void mode_device(const char *tag, uint32_t flags, int iters, uint64_t timeout_ns) {
  char key[96];
  void *slots = epd_slot_device_ptr(ep, 0);
  if (!slots) DIE("epd_slot_device_ptr: %s", epd_last_error(ep));
  uint64_t *ts_d, *ts_h = calloc(6 * (size_t)iters, sizeof *ts_h);
  int *status_d, status = -1;
  double *L = calloc((size_t)iters, sizeof *L);
  CU(cudaMalloc((void **)&ts_d, 6 * (size_t)iters * sizeof *ts_d));
  CU(cudaMalloc((void **)&status_d, sizeof(int)));
  /* pipe: one kernel, iters steps */
  barrier();
  const double t0 = now_us();
  CU((cudaError_t)e2e_dev_launch(slots, dev_slot, (uint32_t)iters, 0, M_, flags, timeout_ns, ts_d, status_d,
                                 st));
  CU(cudaStreamSynchronize(st));
  const double total = now_us() - t0;
  dev_slot = (dev_slot + 2 * (uint32_t)iters) % EPD_QUEUE_SLOTS;
  CU(cudaMemcpy(&status, status_d, sizeof status, cudaMemcpyDeviceToHost));
  if (status) DIE("%s device pipe: status %d (%s)", tag, status, epd_strerror(status));
  CU(cudaMemcpy(ts_h, ts_d, 6 * (size_t)iters * sizeof *ts_h, cudaMemcpyDeviceToHost));
  for (int i = 0; i < iters; i++) {
    B[i] = (ts_h[6 * i + 1] - ts_h[6 * i]) / 1e3;
    C[i] = (ts_h[6 * i + 3] - ts_h[6 * i + 2]) / 1e3;
    A[i] = i ? (ts_h[6 * i + 3] - ts_h[6 * i - 3]) / 1e3 : B[i] + C[i];
    L[i] = ts_h[6 * i + 5] / 1e3;
  }
  snprintf(key, sizeof key, "%s.device.pipe.combine_daemon_latency_us", tag);
  put_arr(key, L, iters);
  snprintf(key, sizeof key, "%s.device.pipe.dispatch_gpu_us", tag);
  put_arr(key, B, iters);
  snprintf(key, sizeof key, "%s.device.pipe.combine_gpu_us", tag);
  put_arr(key, C, iters);
  snprintf(key, sizeof key, "%s.device.pipe.step_gpu_us", tag);
  put_arr(key, A, iters);
  snprintf(key, sizeof key, "%s.device.pipe.period_host_us", tag);
  put_num(key, total / iters);
  /* sync: one kernel of one step per barrier */
  for (int i = 0; i < iters; i++) {
    barrier();
    const double a = now_us();
    CU((cudaError_t)e2e_dev_launch(slots, dev_slot, 1, (uint32_t)i & 1, M_, flags, timeout_ns, ts_d, status_d,
                                   st));
    CU(cudaStreamSynchronize(st));
    A[i] = now_us() - a;
    dev_slot = (dev_slot + 2) % EPD_QUEUE_SLOTS;
    CU(cudaMemcpy(&status, status_d, sizeof status, cudaMemcpyDeviceToHost));
    if (status) DIE("%s device sync: status %d", tag, status);
  }
  snprintf(key, sizeof key, "%s.device.sync.step_host_us", tag);
  put_arr(key, A, iters);
  CU(cudaFree(ts_d));
  CU(cudaFree(status_d));
  free(ts_h);
  free(L);
}

/* ---- main --------------------------------------------------------------------------------------- */

static void fill_inputs(void) {
  const size_t xn = (size_t)M_ * H_, kn = (size_t)M_ * K_;
  uint16_t *x = malloc(xn * 2);
  int64_t *idx = malloc(kn * 8);
  float *w = malloc(kn * 4);
  for (unsigned bank = 0; bank < EPD_NUM_BANKS; bank++) {
    rs = 0x1234567ull + 7919ull * (uint64_t)rank + 104729ull * bank;
    for (size_t i = 0; i < xn; i++) x[i] = bf16((float)((int)(rnd() % 2001) - 1000) / 500.0f);
    for (unsigned t = 0; t < M_; t++)
      for (unsigned k = 0; k < K_; k++) {
        int64_t e;
        int dup;
        do {
          e = (int64_t)(rnd() % E_);
          dup = 0;
          for (unsigned j = 0; j < k; j++) dup |= idx[t * K_ + j] == e;
        } while (dup);
        idx[t * K_ + k] = e;
        w[t * K_ + k] = 1.0f / K_;
      }
    size_t bytes;
    void *p = epd_buffer(ep, EPD_BUF_X, bank, &bytes);
    if (!p || bytes < xn * 2) DIE("buffer X");
    CU(cudaMemcpy(p, x, xn * 2, cudaMemcpyHostToDevice));
    p = epd_buffer(ep, EPD_BUF_TOPK_IDX, bank, &bytes);
    if (!p || bytes < kn * 8) DIE("buffer TOPK_IDX");
    CU(cudaMemcpy(p, idx, kn * 8, cudaMemcpyHostToDevice));
    p = epd_buffer(ep, EPD_BUF_TOPK_WEIGHTS, bank, &bytes);
    if (!p || bytes < kn * 4) DIE("buffer TOPK_WEIGHTS");
    CU(cudaMemcpy(p, w, kn * 4, cudaMemcpyHostToDevice));
    p = epd_buffer(ep, EPD_BUF_LL_Y, bank, &bytes);
    if (!p) DIE("buffer LL_Y");
    CU(cudaMemset(p, 0x3c, bytes)); /* bf16 0x3c3c ~ 0.0115 in every expert output */
  }
  free(x);
  free(idx);
  free(w);
}

int main(int argc, char **argv) {
  const char *sock = NULL, *group = "bench-e2e", *prefix = "bench_e2e";
  int iters = 300, dev_iters = -1, no_device = 0, no_graph = 0;
  static const struct option lo[] = {{"iters", 1, 0, 'i'},     {"dev-iters", 1, 0, 'd'}, {"out", 1, 0, 'o'},
                                     {"no-device", 0, 0, 'D'}, {"no-graph", 0, 0, 'G'},  {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "s:r:g:", lo, NULL)) != -1) {
    switch (c) {
      case 's':
        sock = optarg;
        break;
      case 'r':
        rank = atoi(optarg);
        break;
      case 'g':
        group = optarg;
        break;
      case 'i':
        iters = atoi(optarg);
        break;
      case 'd':
        dev_iters = atoi(optarg);
        break;
      case 'o':
        prefix = optarg;
        break;
      case 'D':
        no_device = 1;
        break;
      case 'G':
        no_graph = 1;
        break;
      default:
        fprintf(stderr, "usage: %s -s SOCKET -r RANK [-g GROUP] [--iters N] [--dev-iters N] [--out PREFIX]\n",
                argv[0]);
        return 2;
    }
  }
  if (!sock || rank < 0 || iters < 1 || iters > MAXI) {
    fprintf(stderr, "bench_e2e: -s SOCKET and -r RANK are required (iters 1..%d)\n", MAXI);
    return 2;
  }
  if (dev_iters < 0) dev_iters = iters;
  if (dev_iters > MAXI) dev_iters = MAXI;
  A = calloc(MAXI, sizeof *A);
  B = calloc(MAXI, sizeof *B);
  C = calloc(MAXI, sizeof *C);
  /* The rank's GPU as the daemon places it: rank r on GPU r, or r % count where the ranks share fewer
   * (bench/e2e/run_gpu.sh gives the daemon engine.devices so). */
  int ndev = 0;
  CU(cudaGetDeviceCount(&ndev));
  const int dev = ndev > 0 ? rank % ndev : rank;
  CU(cudaSetDevice(dev));
  CU(cudaFree(0)); /* the primary context is current: libepd maps the arena into it */
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  bar_open(group);
  epd_conn_t *conn;
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  co.socket_path = sock;
  if (epd_connect(&co, &conn)) DIE("connect: %s", epd_conn_last_error(NULL));
  epd_attach_opts_t ao = EPD_ATTACH_OPTS_INITIALIZER;
  ao.group = group;
  ao.rank = rank;
  ao.num_experts = E_;
  ao.hidden = H_;
  ao.topk = K_;
  ao.max_tokens = M_;
  if (epd_attach(conn, &ao, &ep)) DIE("attach: %s", epd_conn_last_error(conn));
  if (epd_info(ep, EPD_INFO_DEVICE) != dev)
    DIE("attached to device %lld, expected %d", (long long)epd_info(ep, EPD_INFO_DEVICE), dev);
  fill_inputs();
  char path[512];
  snprintf(path, sizeof path, "%s.rank%d.json", prefix, rank);
  out = fopen(path, "w");
  if (!out) DIE("cannot write %s", path);
  fprintf(out, "{");
  put_num("rank", rank);
  put_num("iters", iters);
  put_num("dev_iters", dev_iters);
  put_num("kernel_submit", (double)epd_info(ep, EPD_INFO_KERNEL_SUBMIT));
  static const struct {
    const char *tag;
    uint32_t flags;
  } dt[2] = {{"fp8", EPD_DESC_FP8}, {"bf16", 0}};
  for (int d = 0; d < 2; d++) {
    barrier();
    for (int i = 0; i < 20; i++) step_enqueue(dt[d].flags, i & 1); /* warm-up */
    CU(cudaStreamSynchronize(st));
    check_status("warm-up");
    mode_memop(dt[d].tag, dt[d].flags, iters);
    if (!no_graph) mode_graph(dt[d].tag, dt[d].flags, iters);
    fprintf(stderr, "rank %d: %s memop/graph done\n", rank, dt[d].tag);
  }
  if (!no_device) {
    /* Device-side ops last: from here on libepd's ring position is not the daemon's. */
    dev_slot = (uint32_t)epd_info(ep, EPD_INFO_NEXT_SLOT);
    for (int d = 0; d < 2; d++) {
      mode_device(dt[d].tag, dt[d].flags, dev_iters, 5000000000ull);
      fprintf(stderr, "rank %d: %s device done\n", rank, dt[d].tag);
    }
  }
  fprintf(out, "\n}\n");
  fclose(out);
  barrier();
  epd_detach(ep);
  epd_disconnect(conn);
  return 0;
}
