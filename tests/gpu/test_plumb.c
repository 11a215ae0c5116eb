/*
 * test_plumb.c - GPU plumbing under the CUDA backend, without the daemon: cuMem fd export/import across
 * processes, the host-registered queue driven by stream memory operations (plain, pipelined, captured in
 * a CUDA graph and replayed), and client kernels using epd_device.h. A host thread plays the daemon.
 * The tests use GPUs 0 and 1 where there are two, else GPU 0 for both (gpu()); every test skips without a
 * GPU; every wait is time-limited.
 */
#if EPD_WITH_CUDA
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <stdarg.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "epd_abi.h"
#include "libepd_cuda.h"
#include "../test.h"
#include "test_plumb_dev_ptx.h"

#define CK(call)                                                                                       \
  do {                                                                                                 \
    cudaError_t e_ = (call);                                                                           \
    if (e_ != cudaSuccess) epd_test_fail(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)
#define CKD(call)                                                                        \
  do {                                                                                   \
    CUresult r_ = (call);                                                                \
    if (r_ != CUDA_SUCCESS) epd_test_fail(__FILE__, __LINE__, "%s: %d", #call, (int)r_); \
  } while (0)

/* Measurements: to stdout (the runner keeps it only on failure) and appended to $EPD_PLUMB_LOG. */
static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  const char *p = getenv("EPD_PLUMB_LOG");
  FILE *f = p && *p ? fopen(p, "a") : NULL;
  if (f) {
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fclose(f);
  }
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int ngpus(void) {
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess) have = 0;
  return have;
}

static void need_gpu(void) {
  if (ngpus() < 1) epd_test_skip("needs a GPU (found none)");
}

/* The GPU a test calls GPU i: i where there are that many, else i % (GPUs present). */
static int gpu(int i) {
  const int n = ngpus();
  return n > 0 ? i % n : i;
}

/* Driver entry points through the runtime (as the daemon does). */
static void *drv(const char *name) {
  void *p = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess || !p)
    epd_test_fail(__FILE__, __LINE__, "driver entry point %s not found", name);
  return p;
}

/* ---- fd passing ------------------------------------------------------------------------------- */

static void send_fd(int sock, int fd, uint64_t val) {
  char buf[CMSG_SPACE(sizeof(int))];
  memset(buf, 0, sizeof buf);
  struct iovec iov = {&val, sizeof val};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    m.msg_control = buf;
    m.msg_controllen = sizeof buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ASSERT_EQ(sendmsg(sock, &m, 0), (long)sizeof val);
}

static int recv_fd(int sock, uint64_t *val) {
  char buf[CMSG_SPACE(sizeof(int))];
  struct iovec iov = {val, sizeof *val};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof buf};
  if (recvmsg(sock, &m, 0) != (long)sizeof *val) return -2;
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  int fd = -1;
  if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

/* The parent exports a cuMem allocation of GPU 1 (GPU 0 where it is the only one) holding a pattern; a
 * child that has not touched CUDA before (CUDA is not fork-safe) imports it through libepd and reads the
 * pattern back, then writes its own, which the parent checks. */
EPD_TEST_T(plumb_fd_export_fork, 60) {
  int sv[2];
  ASSERT_OK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv));
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    close(sv[0]);
    uint64_t size = 0;
    int fd = recv_fd(sv[1], &size);
    if (fd == -2 || size == 0) _exit(77); /* parent skipped */
    char err[256] = "";
    epd_cuda_map_t *m = NULL;
    void *addr = NULL;
    int rc = epd_cuda_import(fd, size, gpu(1), &m, &addr, err, sizeof err);
    if (rc) {
      fprintf(stderr, "child: import: %s\n", err);
      _exit(2);
    }
    uint32_t *h = malloc(size);
    if ((rc = epd_cuda_read(h, (uint64_t)(uintptr_t)addr, size, err, sizeof err))) {
      fprintf(stderr, "child: read: %s\n", err);
      _exit(3);
    }
    for (size_t i = 0; i < size / 4; i++)
      if (h[i] != (uint32_t)(i * 2654435761u)) {
        fprintf(stderr, "child: word %zu is %08x\n", i, h[i]);
        _exit(4);
      }
    /* Write back through a CUDA stream memory op on our own mapping: the parent sees it. */
    void *ctx_stream = NULL;
    epd_desc_t d = {.op = 7, .user_tag = 0xfeedull};
    /* The slot protocol needs a DONE answer; here only the descriptor half is used. */
    if ((rc = epd_cuda_submit_async(ctx_stream, (uint64_t)(uintptr_t)addr, &d, err, sizeof err)) ||
        (rc = epd_cuda_stream_sync(ctx_stream, err, sizeof err))) {
      fprintf(stderr, "child: memop write: %s\n", err);
      _exit(5);
    }
    epd_cuda_unimport(m);
    uint64_t ok = 1;
    send_fd(sv[1], -1, ok);
    _exit(0);
  }
  close(sv[1]);
  if (ngpus() < 1) {
    send_fd(sv[0], -1, 0);
    waitpid(pid, NULL, 0);
    epd_test_skip("needs a GPU (found none)");
  }
  const int dev = gpu(1);
  CK(cudaSetDevice(dev));
  CK(cudaFree(0));
  CUresult (*pcuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                           unsigned long long) = drv("cuMemCreate");
  CUresult (*pcuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                             CUmemAllocationGranularity_flags) =
      drv("cuMemGetAllocationGranularity");
  CUresult (*pcuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                            unsigned long long) = drv("cuMemExportToShareableHandle");
  CUresult (*pcuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long) =
      drv("cuMemAddressReserve");
  CUresult (*pcuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) =
      drv("cuMemMap");
  CUresult (*pcuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t) = drv("cuMemSetAccess");
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  CKD(pcuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size_t size = gran;
  CUmemGenericAllocationHandle h;
  CKD(pcuMemCreate(&h, size, &prop, 0));
  CUdeviceptr d;
  CKD(pcuMemAddressReserve(&d, size, gran, 0, 0));
  CKD(pcuMemMap(d, size, 0, h, 0));
  CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CKD(pcuMemSetAccess(d, size, &acc, 1));
  uint32_t *pat = malloc(size);
  for (size_t i = 0; i < size / 4; i++) pat[i] = (uint32_t)(i * 2654435761u);
  CK(cudaMemcpy((void *)d, pat, size, cudaMemcpyHostToDevice));
  int fd = -1;
  CKD(pcuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_fd(sv[0], fd, size);
  uint64_t ok = 0;
  struct timeval tv = {30, 0};
  setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  recv_fd(sv[0], &ok);
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT(WIFEXITED(st));
  ASSERT_EQ(WEXITSTATUS(st), 0);
  ASSERT_EQ(ok, 1);
  /* The child's stream memory op wrote a descriptor at offset 0 of the shared allocation. */
  epd_desc_t back;
  CK(cudaMemcpy(&back, (void *)d, sizeof back, cudaMemcpyDeviceToHost));
  ASSERT_EQ(back.op, 7);
  ASSERT_EQ(back.user_tag, 0xfeedull);
}

/* ---- a host thread playing the daemon on one queue ------------------------------------------------ */

typedef struct fake_daemon {
  epd_queue_t *q;
  int expect;        /* ops to serve */
  uint64_t deadline; /* give up (monotonic ns) */
  atomic_int served;
  int bad;        /* first protocol error seen */
  int32_t status; /* status to answer */
  pthread_t th;
} fake_daemon_t;

static void *fake_daemon_main(void *arg) {
  fake_daemon_t *f = arg;
  uint32_t next = 0;
  while (atomic_load(&f->served) < f->expect && now_ns() < f->deadline) {
    epd_slot_t *s = &f->q->slot[next];
    if (atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire) != EPD_SLOT_SUBMITTED)
      continue;
    epd_desc_t d = s->desc;
    epd_comp_t c = {0};
    c.status = f->status;
    c.peer = -1;
    c.user_tag = d.user_tag;
    c.step = (uint64_t)atomic_load(&f->served);
    c.num_recv = d.num_tokens;
    s->comp = c;
    atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_DONE, memory_order_release);
    atomic_fetch_add(&f->served, 1);
    next = (next + 1) % EPD_QUEUE_SLOTS;
  }
  return NULL;
}

static void fake_start(fake_daemon_t *f, epd_queue_t *q, int expect, int timeout_s) {
  memset(f, 0, sizeof *f);
  f->q = q;
  f->expect = expect;
  f->deadline = now_ns() + (uint64_t)timeout_s * 1000000000ull;
  ASSERT_OK(pthread_create(&f->th, NULL, fake_daemon_main, f));
}

static int fake_join(fake_daemon_t *f) {
  pthread_join(f->th, NULL);
  return atomic_load(&f->served);
}

/* A queue in a memfd, mapped twice as the daemon and the client see it; the client's mapping is
 * registered with libepd. */
typedef struct qpair {
  int fd;
  epd_queue_t *daemon_view, *client_view;
  epd_cuda_hostreg_t *reg;
  uint64_t dev;
} qpair_t;

static void qpair_open(qpair_t *p, int device) {
  size_t bytes = (sizeof(epd_queue_t) + 4095) / 4096 * 4096;
  p->fd = memfd_create("plumb-queue", MFD_CLOEXEC);
  ASSERT(p->fd >= 0);
  ASSERT_OK(ftruncate(p->fd, (off_t)bytes));
  p->daemon_view = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
  p->client_view = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
  ASSERT(p->daemon_view != MAP_FAILED && p->client_view != MAP_FAILED);
  /* The daemon registers its own view too (the persistent kernel polls it). */
  CK(cudaHostRegister(p->daemon_view, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  char err[256] = "";
  int rc = epd_cuda_register_host(p->client_view, bytes, device, &p->reg, &p->dev, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "epd_cuda_register_host: %s", err);
}

static uint64_t slot_dev(const qpair_t *p, unsigned i) {
  return p->dev + offsetof(epd_queue_t, slot) + (uint64_t)i * sizeof(epd_slot_t);
}

static void submit(cudaStream_t s, const qpair_t *p, unsigned slot, uint64_t tag) {
  epd_desc_t d = {.op = EPD_OP_LL_DISPATCH, .num_tokens = slot, .user_tag = tag};
  char err[256] = "";
  int rc = epd_cuda_submit(s, slot_dev(p, slot), &d, err, sizeof err);
  if (rc) epd_test_fail(__FILE__, __LINE__, "epd_cuda_submit: %s", err);
}

/* Stream memops round trip: host-synced each, then pipelined (many ops queued, one sync). */
EPD_TEST_T(plumb_memops_roundtrip, 60) {
  need_gpu();
  CK(cudaSetDevice(gpu(0)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  qpair_t p;
  qpair_open(&p, gpu(0));
  const int N = 2000;
  fake_daemon_t f;
  fake_start(&f, p.daemon_view, 2 * N, 20);
  uint64_t t0 = now_ns();
  for (int i = 0; i < N; i++) {
    submit(s, &p, (unsigned)i % EPD_QUEUE_SLOTS, 0x1000u + (unsigned)i);
    CK(cudaStreamSynchronize(s));
    epd_slot_t *sl = &p.client_view->slot[i % EPD_QUEUE_SLOTS];
    ASSERT_EQ(sl->state, EPD_SLOT_FREE);
    ASSERT_EQ(sl->comp.user_tag, 0x1000u + (unsigned)i);
  }
  uint64_t t1 = now_ns();
  for (int i = 0; i < N; i++) submit(s, &p, (unsigned)i % EPD_QUEUE_SLOTS, 0x9000u + (unsigned)i);
  CK(cudaStreamSynchronize(s));
  uint64_t t2 = now_ns();
  ASSERT_EQ(fake_join(&f), 2 * N);
  report("memops round trip (%s): host-synced %.2f us/op, pipelined %.2f us/op\n", epd_cuda_memop_mode(),
         (t1 - t0) / 1e3 / N, (t2 - t1) / 1e3 / N);
}

/* The same submission captured in a CUDA graph (one op per slot) and replayed 100 times. */
EPD_TEST_T(plumb_graph_replay, 60) {
  need_gpu();
  CK(cudaSetDevice(gpu(1)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  qpair_t p;
  qpair_open(&p, gpu(1));
  const int R = 100;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (unsigned i = 0; i < EPD_QUEUE_SLOTS; i++) submit(s, &p, i, 0x7700u + i);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  fake_daemon_t f;
  fake_start(&f, p.daemon_view, R * (int)EPD_QUEUE_SLOTS, 20);
  CK(cudaGraphLaunch(ge, s)); /* warm up: 1 replay */
  CK(cudaStreamSynchronize(s));
  uint64_t t0 = now_ns();
  for (int r = 1; r < R; r++) CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  uint64_t t1 = now_ns();
  ASSERT_EQ(fake_join(&f), R * (int)EPD_QUEUE_SLOTS);
  for (unsigned i = 0; i < EPD_QUEUE_SLOTS; i++) {
    ASSERT_EQ(p.client_view->slot[i].state, EPD_SLOT_FREE);
    ASSERT_EQ(p.client_view->slot[i].comp.user_tag, 0x7700u + i);
  }
  report("graph replay: %.2f us/op over %d replays of %u ops\n",
         (t1 - t0) / 1e3 / ((R - 1) * EPD_QUEUE_SLOTS), R - 1, EPD_QUEUE_SLOTS);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
}

/* A client kernel submits and waits with epd_device.h (PTX loaded through the driver API). */
EPD_TEST_T(plumb_device_submit_wait, 60) {
  need_gpu();
  CK(cudaSetDevice(gpu(0)));
  CK(cudaFree(0));
  CUresult (*pcuModuleLoadData)(CUmodule *, const void *) = drv("cuModuleLoadData");
  CUresult (*pcuModuleGetFunction)(CUfunction *, CUmodule, const char *) = drv("cuModuleGetFunction");
  CUresult (*pcuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **) = drv("cuLaunchKernel");
  CUmodule mod;
  CUfunction fn;
  CKD(pcuModuleLoadData(&mod, plumb_dev_ptx));
  CKD(pcuModuleGetFunction(&fn, mod, "plumb_dev_ops"));
  qpair_t p;
  qpair_open(&p, gpu(0));
  const int N = 1000;
  int *status;
  unsigned long long *ns;
  CK(cudaHostAlloc((void **)&status, N * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostAlloc((void **)&ns, sizeof *ns, cudaHostAllocMapped | cudaHostAllocPortable));
  int *status_d;
  unsigned long long *ns_d;
  CK(cudaHostGetDevicePointer((void **)&status_d, status, 0));
  CK(cudaHostGetDevicePointer((void **)&ns_d, ns, 0));
  fake_daemon_t f;
  fake_start(&f, p.daemon_view, N, 20);
  epd_queue_t *qd = (epd_queue_t *)(uintptr_t)p.dev;
  int n = N;
  uint32_t first = 0;
  unsigned long long timeout = 5000000000ull;
  void *args[] = {&qd, &n, &first, &timeout, &status_d, &ns_d};
  CKD(pcuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL));
  CK(cudaDeviceSynchronize());
  ASSERT_EQ(fake_join(&f), N);
  for (int i = 0; i < N; i++) ASSERT_EQ(status[i], 0);
  for (unsigned i = 0; i < EPD_QUEUE_SLOTS; i++) ASSERT_EQ(p.client_view->slot[i].state, EPD_SLOT_FREE);
  report("device submit+wait round trip: %.2f us/op\n", ns[0] / 1e3 / N);
  /* Nobody answers: the wait times out with EPD_ERR_TIMEOUT instead of hanging. */
  n = 1;
  first = 3;
  timeout = 2000000ull; /* 2 ms */
  CKD(pcuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL));
  CK(cudaDeviceSynchronize());
  ASSERT_EQ(status[0], -8);
  ASSERT_EQ(p.client_view->slot[3].state, EPD_SLOT_SUBMITTED);
}

#else /* !EPD_WITH_CUDA */
#include "../test.h"
EPD_TEST(gpu_plumb_without_cuda) {
  epd_test_skip("built without CUDA (WITH_CUDA=0)");
}
#endif
