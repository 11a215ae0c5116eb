/*
 * nccl_load.cu - NCCL loaded when the CUDA backend starts, not when the program does: the daemon is not
 * linked with libnccl, so the host backend, and a tarball on a machine without NCCL, run anyway. Every
 * NCCL host function epd calls is defined here as a forwarder to the one of libnccl.so.2, opened with
 * dlopen at the first call (found like a linked library: the binary's run path, LD_LIBRARY_PATH, the
 * system's). Without it each forwarder fails with ncclSystemError and epd_k_nccl_load says why. A program
 * that links libnccl itself (the benchmarks) gets the same library: dlopen returns the loaded one.
 */
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "epd_kernels.h"

/* name, return type, parameters, arguments */
#define EPD_NCCL_FUNCS(X)                                                                                   \
  X(ncclGetVersion, ncclResult_t, (int *v), (v))                                                            \
  X(ncclGetUniqueId, ncclResult_t, (ncclUniqueId * id), (id))                                               \
  X(ncclCommInitRank, ncclResult_t, (ncclComm_t * c, int n, ncclUniqueId id, int r), (c, n, id, r))         \
  X(ncclCommInitRankConfig, ncclResult_t, (ncclComm_t * c, int n, ncclUniqueId id, int r, ncclConfig_t *f), \
    (c, n, id, r, f))                                                                                       \
  X(ncclCommSplit, ncclResult_t, (ncclComm_t c, int color, int key, ncclComm_t *nc, ncclConfig_t *f),       \
    (c, color, key, nc, f))                                                                                 \
  X(ncclCommFinalize, ncclResult_t, (ncclComm_t c), (c))                                                    \
  X(ncclCommDestroy, ncclResult_t, (ncclComm_t c), (c))                                                     \
  X(ncclCommAbort, ncclResult_t, (ncclComm_t c), (c))                                                       \
  X(ncclCommGetAsyncError, ncclResult_t, (ncclComm_t c, ncclResult_t * e), (c, e))                          \
  X(ncclMemAlloc, ncclResult_t, (void **p, size_t n), (p, n))                                               \
  X(ncclMemFree, ncclResult_t, (void *p), (p))                                                              \
  X(ncclGroupStart, ncclResult_t, (), ())                                                                   \
  X(ncclGroupEnd, ncclResult_t, (), ())                                                                     \
  X(ncclSend, ncclResult_t,                                                                                 \
    (const void *b, size_t n, ncclDataType_t t, int p, ncclComm_t c, cudaStream_t s), (b, n, t, p, c, s))   \
  X(ncclRecv, ncclResult_t, (void *b, size_t n, ncclDataType_t t, int p, ncclComm_t c, cudaStream_t s),     \
    (b, n, t, p, c, s))                                                                                     \
  X(ncclCommWindowRegister, ncclResult_t, (ncclComm_t c, void *b, size_t n, ncclWindow_t *w, int f),        \
    (c, b, n, w, f))                                                                                        \
  X(ncclCommWindowDeregister, ncclResult_t, (ncclComm_t c, ncclWindow_t w), (c, w))                         \
  X(ncclDevCommCreate, ncclResult_t, (ncclComm_t c, const ncclDevCommRequirements_t *r, ncclDevComm_t *d),  \
    (c, r, d))                                                                                              \
  X(ncclDevCommDestroy, ncclResult_t, (ncclComm_t c, const ncclDevComm_t *d), (c, d))

namespace {
struct loaded {
#define X(name, ret, params, args) ret(*name) params;
  EPD_NCCL_FUNCS(X)
#undef X
  const char *(*ncclGetErrorString)(ncclResult_t);
  const char *(*ncclGetLastError)(ncclComm_t);
  int ok;
  char why[384];
} L;
pthread_once_t once = PTHREAD_ONCE_INIT;

void load(void) {
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(L.why, sizeof L.why,
             "NCCL is not installed here (%s): install NCCL 2.29 or later (pip install nvidia-nccl-cu13, or "
             "NVIDIA's packages) and put its lib directory in LD_LIBRARY_PATH",
             dlerror());
    return;
  }
  int ok = 1;
#define X(name, ret, params, args)                                   \
  {                                                                  \
    void *p = dlsym(h, #name);                                       \
    memcpy(&L.name, &p, sizeof p);                                   \
    if (!p && ok) {                                                  \
      snprintf(L.why, sizeof L.why, "libnccl.so.2 lacks %s", #name); \
      ok = 0;                                                        \
    }                                                                \
  }
  EPD_NCCL_FUNCS(X)
  X(ncclGetErrorString, , , )
  X(ncclGetLastError, , , )
#undef X
  L.ok = ok;
}

int ready(void) {
  pthread_once(&once, load);
  return L.ok;
}
} /* namespace */

#define X(name, ret, params, args)                  \
  extern "C" ret name params {                      \
    return ready() ? L.name args : ncclSystemError; \
  }
EPD_NCCL_FUNCS(X)
#undef X

extern "C" const char *ncclGetErrorString(ncclResult_t r) {
  return ready() ? L.ncclGetErrorString(r) : "NCCL not loaded";
}
extern "C" const char *ncclGetLastError(ncclComm_t c) {
  return ready() ? L.ncclGetLastError(c) : L.why;
}

extern "C" epd_result_t epd_k_nccl_load(char *err, size_t errlen) {
  if (ready()) return EPD_OK;
  if (err && errlen) snprintf(err, errlen, "%s", L.why);
  return EPD_ERR_UNSUPPORTED;
}
