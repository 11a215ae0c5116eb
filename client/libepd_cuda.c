/*
 * libepd_cuda.c - CUDA side of libepd. libepd links no CUDA library: the driver (libcuda.so.1) is
 * opened on first use and every entry point is resolved through cuGetProcAddress, so the host backend
 * keeps working on machines without CUDA and the CUDA calls fail with EPD_ERR_UNSUPPORTED there.
 * Only the driver's types come from cuda.h (a header, no link); a build without the CUDA headers
 * (EPD_WITH_CUDA=0) compiles the stubs at the end of this file.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epd_wire.h"
#include "libepd_cuda.h"

#if EPD_WITH_CUDA
#include <cuda.h>

/* The driver entry points we use, resolved by base name for the CUDA 12.0 ABI (which picks the _v2
 * variants of cuMemHostRegister, cuStreamBatchMemOp, ...). */
#define EPD_CU_FUNCS(X)                                                                                  \
  X(cuInit, (unsigned int))                                                                              \
  X(cuGetErrorString, (CUresult, const char **))                                                         \
  X(cuDeviceGet, (CUdevice *, int))                                                                      \
  X(cuDeviceGetCount, (int *))                                                                           \
  X(cuDeviceGetUuid, (CUuuid *, CUdevice))                                                               \
  X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                                                   \
  X(cuCtxGetCurrent, (CUcontext *))                                                                      \
  X(cuCtxSetCurrent, (CUcontext))                                                                        \
  X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType)) \
  X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *, CUmemGenericAllocationHandle))       \
  X(cuMemGetAllocationGranularity,                                                                       \
    (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                           \
  X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))               \
  X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))           \
  X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                              \
  X(cuMemUnmap, (CUdeviceptr, size_t))                                                                   \
  X(cuMemRelease, (CUmemGenericAllocationHandle))                                                        \
  X(cuMemAddressFree, (CUdeviceptr, size_t))                                                             \
  X(cuMemHostRegister, (void *, size_t, unsigned int))                                                   \
  X(cuMemHostUnregister, (void *))                                                                       \
  X(cuMemHostGetDevicePointer, (CUdeviceptr *, void *, unsigned int))                                    \
  X(cuStreamBatchMemOp, (CUstream, unsigned int, CUstreamBatchMemOpParams *, unsigned int))              \
  X(cuStreamSynchronize, (CUstream))                                                                     \
  X(cuStreamWriteValue32, (CUstream, CUdeviceptr, cuuint32_t, unsigned int))                             \
  X(cuStreamWriteValue64, (CUstream, CUdeviceptr, cuuint64_t, unsigned int))                             \
  X(cuStreamWaitValue32, (CUstream, CUdeviceptr, cuuint32_t, unsigned int))                              \
  X(cuMemcpyDtoH, (void *, CUdeviceptr, size_t))                                                         \
  X(cuMemcpyHtoD, (CUdeviceptr, const void *, size_t))                                                   \
  X(cuMemcpyHtoDAsync, (CUdeviceptr, const void *, size_t, CUstream))                                    \
  X(cuModuleLoadData, (CUmodule *, const void *))                                                        \
  X(cuModuleGetFunction, (CUfunction *, CUmodule, const char *))                                         \
  X(cuLaunchKernel, (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,   \
                     unsigned int, unsigned int, CUstream, void **, void **))                            \
  X(cuStreamCreate, (CUstream *, unsigned int))                                                          \
  X(cuStreamDestroy, (CUstream))                                                                         \
  X(cuStreamQuery, (CUstream))                                                                           \
  X(cuStreamGetCtx, (CUstream, CUcontext *))                                                             \
  X(cuCtxPushCurrent, (CUcontext))                                                                       \
  X(cuCtxPopCurrent, (CUcontext *))

typedef CUresult (*epd_cuGetProcAddress_fn)(const char *, void **, int, cuuint64_t,
                                            CUdriverProcAddressQueryResult *);

static struct {
#define X(name, args) CUresult(*name) args;
  EPD_CU_FUNCS(X)
#undef X
} cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static epd_result_t load_result = EPD_ERR_UNSUPPORTED;
static char load_error[256];
static void *libcuda;

static void load_driver(void) {
  libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!libcuda) {
    snprintf(load_error, sizeof load_error, "the CUDA driver (libcuda.so.1) is not available: %s", dlerror());
    return;
  }
  epd_cuGetProcAddress_fn gpa = (epd_cuGetProcAddress_fn)dlsym(libcuda, "cuGetProcAddress_v2");
  if (!gpa) {
    snprintf(load_error, sizeof load_error,
             "the CUDA driver is too old (no cuGetProcAddress_v2; CUDA 12 or newer is required)");
    return;
  }
#define X(name, args)                                                                    \
  {                                                                                      \
    CUdriverProcAddressQueryResult st;                                                   \
    void *p = NULL;                                                                      \
    if (gpa(#name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || !p) { \
      snprintf(load_error, sizeof load_error, "the CUDA driver lacks %s", #name);        \
      return;                                                                            \
    }                                                                                    \
    memcpy(&cu.name, &p, sizeof p);                                                      \
  }
  EPD_CU_FUNCS(X)
#undef X
  CUresult r = cu.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char *s = NULL;
    cu.cuGetErrorString(r, &s);
    snprintf(load_error, sizeof load_error, "cuInit failed: %s (%d)", s ? s : "?", (int)r);
    return;
  }
  load_result = EPD_OK;
}

epd_result_t epd_cuda_load(char *err, size_t errlen) {
  pthread_once(&load_once, load_driver);
  if (load_result != EPD_OK && err) snprintf(err, errlen, "%s", load_error);
  return load_result;
}

/* Convert a driver error once, where it enters: the message names the call. */
static epd_result_t cu_fail(CUresult r, const char *what, char *err, size_t errlen) {
  const char *s = NULL;
  if (cu.cuGetErrorString) cu.cuGetErrorString(r, &s);
  if (err) snprintf(err, errlen, "%s failed: %s (%d)", what, s ? s : "unknown CUDA error", (int)r);
  return r == CUDA_ERROR_OUT_OF_MEMORY ? EPD_ERR_NOMEM : EPD_ERR_CUDA;
}
#define CU_TRY(call, what)                                         \
  do {                                                             \
    CUresult r_ = (call);                                          \
    if (r_ != CUDA_SUCCESS) return cu_fail(r_, what, err, errlen); \
  } while (0)

/* The primary context of `device`, retained once per device and never released: it is the same context
 * the runtime uses, and releasing it under a running worker would tear it down. */
#define PRIMARY_DEVICES 64
static CUcontext primary[PRIMARY_DEVICES];
static pthread_mutex_t primary_mu = PTHREAD_MUTEX_INITIALIZER;

static epd_result_t primary_ctx(int device, CUcontext *out, char *err, size_t errlen) {
  if (device < 0 || device >= PRIMARY_DEVICES) {
    snprintf(err, errlen, "device %d: out of range [0, %d)", device, PRIMARY_DEVICES);
    return EPD_ERR_INVALID;
  }
  pthread_mutex_lock(&primary_mu);
  CUresult r = CUDA_SUCCESS;
  if (!primary[device]) {
    CUdevice dev;
    r = cu.cuDeviceGet(&dev, device);
    if (!r) r = cu.cuDevicePrimaryCtxRetain(&primary[device], dev);
  }
  *out = primary[device];
  pthread_mutex_unlock(&primary_mu);
  return r ? cu_fail(r, "cuDevicePrimaryCtxRetain", err, errlen) : EPD_OK;
}

/* Make sure the calling thread has a context: the caller's own if it has one (a worker using the
 * runtime has its device's primary context current), else the primary context of `device`. */
static epd_result_t ensure_ctx(int device, char *err, size_t errlen) {
  CUcontext cur = NULL;
  CU_TRY(cu.cuCtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (cur) return EPD_OK;
  if (device < 0) {
    snprintf(err, errlen, "no CUDA context is current on this thread");
    return EPD_ERR_STATE;
  }
  CUcontext ctx;
  epd_result_t rc = primary_ctx(device, &ctx, err, errlen);
  if (rc) return rc;
  CU_TRY(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return EPD_OK;
}

epd_result_t epd_cuda_find_device(const uint8_t uuid[16], int *ordinal, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  int n = 0;
  CU_TRY(cu.cuDeviceGetCount(&n), "cuDeviceGetCount");
  for (int i = 0; i < n; i++) {
    CUdevice dev;
    CUuuid u;
    CU_TRY(cu.cuDeviceGet(&dev, i), "cuDeviceGet");
    CU_TRY(cu.cuDeviceGetUuid(&u, dev), "cuDeviceGetUuid");
    if (!memcmp(u.bytes, uuid, 16)) {
      *ordinal = i;
      return EPD_OK;
    }
  }
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  char text[EPD_UUID_TEXT];
  epd_uuid_text(uuid, text);
  snprintf(err, errlen,
           "the rank's GPU %s is not among the %d this process sees (CUDA_VISIBLE_DEVICES=%s): run the "
           "worker where "
           "it can use that GPU",
           text, n, vis ? vis : "unset");
  return EPD_ERR_INVALID;
}

epd_result_t epd_cuda_ctx_enter(int device, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  CUcontext ctx;
  if ((rc = primary_ctx(device, &ctx, err, errlen))) return rc;
  CU_TRY(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
  return EPD_OK;
}

void epd_cuda_ctx_leave(void) {
  CUcontext c;
  cu.cuCtxPopCurrent(&c);
}

/* Make the context of `stream` current for a call (pushed: *pushed = 1, pop it after); the legacy and
 * per-thread default streams (and streams the driver cannot place) use the calling thread's context. */
static epd_result_t stream_ctx_push(CUstream stream, int *pushed, char *err, size_t errlen) {
  *pushed = 0;
  CUcontext ctx = NULL;
  if (stream && (uintptr_t)stream > 2 && cu.cuStreamGetCtx(stream, &ctx) == CUDA_SUCCESS && ctx) {
    CU_TRY(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
    *pushed = 1;
    return EPD_OK;
  }
  return ensure_ctx(-1, err, errlen);
}

struct epd_cuda_map {
  CUdeviceptr base;
  size_t size;
  CUmemGenericAllocationHandle handle;
};

epd_result_t epd_cuda_import(int fd, size_t bytes, int device, epd_cuda_map_t **out, void **addr, char *err,
                             size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if (fd < 0 || bytes == 0 || !out || !addr) {
    snprintf(err, errlen, "epd_cuda_import: fd %d / bytes %zu out of range", fd, bytes);
    return EPD_ERR_INVALID;
  }
  if ((rc = ensure_ctx(device, err, errlen))) return rc;
  epd_cuda_map_t *m = calloc(1, sizeof *m);
  if (!m) return EPD_ERR_NOMEM;
  CUresult r;
  const char *what;
  size_t gran = 0;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  r = cu.cuMemImportFromShareableHandle(&m->handle, (void *)(uintptr_t)fd,
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r) {
    what = "cuMemImportFromShareableHandle";
    goto fail_free;
  }
  r = cu.cuMemGetAllocationPropertiesFromHandle(&prop, m->handle);
  if (r) {
    what = "cuMemGetAllocationPropertiesFromHandle";
    goto fail_release;
  }
  r = cu.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r) {
    what = "cuMemGetAllocationGranularity";
    goto fail_release;
  }
  /* A mapping must cover whole granules: the daemon allocates rounded up, the size it reports may not. */
  m->size = gran ? (bytes + gran - 1) / gran * gran : bytes;
  r = cu.cuMemAddressReserve(&m->base, m->size, gran, 0, 0);
  if (r) {
    what = "cuMemAddressReserve";
    goto fail_release;
  }
  r = cu.cuMemMap(m->base, m->size, 0, m->handle, 0);
  if (r) {
    what = "cuMemMap";
    goto fail_free_va;
  }
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = device;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = cu.cuMemSetAccess(m->base, m->size, &acc, 1);
  if (r) {
    what = "cuMemSetAccess";
    goto fail_unmap;
  }
  *out = m;
  *addr = (void *)(uintptr_t)m->base;
  return EPD_OK;
fail_unmap:
  cu.cuMemUnmap(m->base, m->size);
fail_free_va:
  cu.cuMemAddressFree(m->base, m->size);
fail_release:
  cu.cuMemRelease(m->handle);
fail_free:
  free(m);
  return cu_fail(r, what, err, errlen);
}

void epd_cuda_unimport(epd_cuda_map_t *m) {
  if (!m) return;
  cu.cuMemUnmap(m->base, m->size);
  cu.cuMemAddressFree(m->base, m->size);
  cu.cuMemRelease(m->handle);
  free(m);
}

struct epd_cuda_hostreg {
  void *host;
};

epd_result_t epd_cuda_register_host(void *host, size_t bytes, int device, epd_cuda_hostreg_t **out,
                                    uint64_t *dev_addr, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if (!host || bytes == 0 || !out || !dev_addr) {
    snprintf(err, errlen, "epd_cuda_register_host: host %p / bytes %zu out of range", host, bytes);
    return EPD_ERR_INVALID;
  }
  if ((rc = ensure_ctx(device, err, errlen))) return rc;
  epd_cuda_hostreg_t *h = calloc(1, sizeof *h);
  if (!h) return EPD_ERR_NOMEM;
  /* PORTABLE: the worker may drive the queue from any context of the process. */
  CUresult r = cu.cuMemHostRegister(host, bytes, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
  if (r) {
    free(h);
    return cu_fail(r, "cuMemHostRegister", err, errlen);
  }
  CUdeviceptr d = 0;
  r = cu.cuMemHostGetDevicePointer(&d, host, 0);
  if (r) {
    cu.cuMemHostUnregister(host);
    free(h);
    return cu_fail(r, "cuMemHostGetDevicePointer", err, errlen);
  }
  h->host = host;
  *out = h;
  *dev_addr = (uint64_t)d;
  return EPD_OK;
}

void epd_cuda_unregister_host(epd_cuda_hostreg_t *h) {
  if (!h) return;
  cu.cuMemHostUnregister(h->host);
  free(h);
}

/* Fill ops with the submission half: 8 x 64-bit descriptor words, then state = SUBMITTED. The state
 * write keeps the default memory barrier, so the descriptor is visible before the state word. */
static unsigned put_submit(CUstreamBatchMemOpParams *ops, uint64_t slot_dev, const epd_desc_t *desc) {
  unsigned n = 0;
  uint64_t words[sizeof(epd_desc_t) / 8];
  memcpy(words, desc, sizeof words);
  for (unsigned i = 0; i < sizeof words / 8; i++, n++) {
    ops[n].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    ops[n].writeValue.address = (CUdeviceptr)(slot_dev + offsetof(epd_slot_t, desc) + 8 * i);
    ops[n].writeValue.value64 = words[i];
    ops[n].writeValue.flags =
        CU_STREAM_WRITE_VALUE_DEFAULT; /* NO_MEMORY_BARRIER is refused (CUDA 13 driver 580) */
  }
  ops[n].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[n].writeValue.address = (CUdeviceptr)(slot_dev + offsetof(epd_slot_t, state));
  ops[n].writeValue.value = EPD_SLOT_SUBMITTED;
  ops[n].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return n + 1;
}

/* Fill ops with the completion half: wait state == DONE, then state = FREE. */
static unsigned put_wait(CUstreamBatchMemOpParams *ops, uint64_t slot_dev) {
  ops[0].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  ops[0].waitValue.address = (CUdeviceptr)(slot_dev + offsetof(epd_slot_t, state));
  ops[0].waitValue.value = EPD_SLOT_DONE;
  ops[0].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
  ops[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[1].writeValue.address = (CUdeviceptr)(slot_dev + offsetof(epd_slot_t, state));
  ops[1].writeValue.value = EPD_SLOT_FREE;
  ops[1].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return 2;
}

/* How stream memory operations are issued: one batch (fewest API calls), else one call per op (some
 * drivers refuse a batch that the single-op calls accept), else 64-bit writes split in two 32-bit
 * writes. Chosen on first use and kept; all three are capturable in a CUDA graph. */
static atomic_int memop_mode = -1; /* -1 unknown, 0 batch, 1 single ops, 2 single 32-bit ops */

static CUresult single_ops(CUstream st, const CUstreamBatchMemOpParams *ops, unsigned n, int split64) {
  CUresult r = CUDA_SUCCESS;
  for (unsigned i = 0; i < n && r == CUDA_SUCCESS; i++) {
    switch (ops[i].operation) {
      case CU_STREAM_MEM_OP_WRITE_VALUE_64:
        if (!split64) {
          r = cu.cuStreamWriteValue64(st, ops[i].writeValue.address, ops[i].writeValue.value64,
                                      ops[i].writeValue.flags);
        } else {
          r = cu.cuStreamWriteValue32(st, ops[i].writeValue.address, (cuuint32_t)ops[i].writeValue.value64,
                                      ops[i].writeValue.flags);
          if (r == CUDA_SUCCESS)
            r = cu.cuStreamWriteValue32(st, ops[i].writeValue.address + 4,
                                        (cuuint32_t)(ops[i].writeValue.value64 >> 32),
                                        ops[i].writeValue.flags);
        }
        break;
      case CU_STREAM_MEM_OP_WRITE_VALUE_32:
        r = cu.cuStreamWriteValue32(st, ops[i].writeValue.address, ops[i].writeValue.value,
                                    ops[i].writeValue.flags);
        break;
      case CU_STREAM_MEM_OP_WAIT_VALUE_32:
        r = cu.cuStreamWaitValue32(st, ops[i].waitValue.address, ops[i].waitValue.value,
                                   ops[i].waitValue.flags);
        break;
      default:
        r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  return r;
}

static epd_result_t batch(void *stream, CUstreamBatchMemOpParams *ops, unsigned n, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if ((rc = ensure_ctx(-1, err, errlen))) return rc;
  CUstream st = (CUstream)stream;
  int mode = atomic_load(&memop_mode);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (mode <= 0) {
    r = cu.cuStreamBatchMemOp(st, n, ops, 0);
    if (r == CUDA_SUCCESS) {
      atomic_store(&memop_mode, 0);
      return EPD_OK;
    }
    /* Nothing was enqueued by a refused batch: fall back to single ops. */
    if (mode == 0 || (r != CUDA_ERROR_INVALID_VALUE && r != CUDA_ERROR_NOT_SUPPORTED))
      return cu_fail(r, "cuStreamBatchMemOp", err, errlen);
  }
  if (mode < 0 || mode == 1) {
    /* The first op decides: a refused first call enqueued nothing. */
    r = single_ops(st, ops, 1, 0);
    if (r == CUDA_SUCCESS) {
      atomic_store(&memop_mode, 1);
      r = single_ops(st, ops + 1, n - 1, 0);
      return r ? cu_fail(r, "cuStreamWriteValue/WaitValue", err, errlen) : EPD_OK;
    }
    if (mode == 1) return cu_fail(r, "cuStreamWriteValue/WaitValue", err, errlen);
  }
  r = single_ops(st, ops, n, 1);
  if (r) return cu_fail(r, "cuStreamWriteValue32/WaitValue32", err, errlen);
  atomic_store(&memop_mode, 2);
  return EPD_OK;
}

const char *epd_cuda_memop_mode(void) {
  switch (atomic_load(&memop_mode)) {
    case 0:
      return "batch";
    case 1:
      return "single";
    case 2:
      return "single32";
    default:
      return "unknown";
  }
}

epd_result_t epd_cuda_submit(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                             size_t errlen) {
  CUstreamBatchMemOpParams ops[16];
  memset(ops, 0, sizeof ops);
  if (!slot_dev || !desc) {
    snprintf(err, errlen, "epd_cuda_submit: slot address and descriptor are required");
    return EPD_ERR_INVALID;
  }
  unsigned n = put_submit(ops, slot_dev, desc);
  n += put_wait(ops + n, slot_dev);
  return batch(stream, ops, n, err, errlen);
}

epd_result_t epd_cuda_submit_async(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                                   size_t errlen) {
  CUstreamBatchMemOpParams ops[16];
  memset(ops, 0, sizeof ops);
  if (!slot_dev || !desc) {
    snprintf(err, errlen, "epd_cuda_submit_async: slot address and descriptor are required");
    return EPD_ERR_INVALID;
  }
  return batch(stream, ops, put_submit(ops, slot_dev, desc), err, errlen);
}

epd_result_t epd_cuda_wait_async(void *stream, uint64_t slot_dev, char *err, size_t errlen) {
  CUstreamBatchMemOpParams ops[2];
  memset(ops, 0, sizeof ops);
  if (!slot_dev) {
    snprintf(err, errlen, "epd_cuda_wait_async: slot address is required");
    return EPD_ERR_INVALID;
  }
  return batch(stream, ops, put_wait(ops, slot_dev), err, errlen);
}

/* ---- kernel submission (client/submit.cu, embedded as a fatbin) ---- */
extern const unsigned char epd_submit_fatbin[];

/* The submission kernels of each context that used them (a module belongs to one context). Loaded
 * before any of them runs: with lazy loading, the first launch of a kernel would wait for the kernels
 * running in the context, among them a spinning wait of an earlier op. */
#define KSUB_CTXS 32
static struct ksub {
  CUcontext ctx;
  CUfunction fsub, fwait, frun;
} ksubs[KSUB_CTXS];
static pthread_mutex_t ksub_mu = PTHREAD_MUTEX_INITIALIZER;

static epd_result_t ksub_get(struct ksub *out, char *err, size_t errlen) {
  CUcontext ctx = NULL;
  CU_TRY(cu.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  pthread_mutex_lock(&ksub_mu);
  epd_result_t rc = EPD_OK;
  int i = 0;
  while (i < KSUB_CTXS && ksubs[i].ctx && ksubs[i].ctx != ctx) i++;
  if (i == KSUB_CTXS) {
    snprintf(err, errlen, "more than %d CUDA contexts used libepd's submission kernels", KSUB_CTXS);
    rc = EPD_ERR_NOMEM;
  } else if (!ksubs[i].ctx) {
    CUmodule mod = NULL;
    struct ksub k = {ctx, NULL, NULL, NULL};
    CUresult r = cu.cuModuleLoadData(&mod, epd_submit_fatbin);
    if (!r) r = cu.cuModuleGetFunction(&k.fsub, mod, "epd_ksub_submit");
    if (!r) r = cu.cuModuleGetFunction(&k.fwait, mod, "epd_ksub_wait");
    if (!r) r = cu.cuModuleGetFunction(&k.frun, mod, "epd_ksub_run");
    if (r)
      rc = cu_fail(r, "loading libepd's submission kernels", err, errlen);
    else
      ksubs[i] = k; /* the module stays loaded for the life of the process */
  }
  if (!rc) *out = ksubs[i];
  pthread_mutex_unlock(&ksub_mu);
  return rc;
}

epd_result_t epd_cuda_ksub_load(int device, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if ((rc = ensure_ctx(device, err, errlen))) return rc;
  struct ksub k;
  return ksub_get(&k, err, errlen);
}

epd_result_t epd_cuda_ksubmit(void *stream, uint64_t dslot, const epd_desc_t *desc, int what,
                              uint64_t timeout_ns, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if (!dslot || (what != EPD_KSUB_WAIT && !desc)) {
    snprintf(err, errlen, "epd_cuda_ksubmit: slot address and descriptor are required");
    return EPD_ERR_INVALID;
  }
  /* the module of the stream's own context (the caller's current one may belong to another device) */
  int pushed = 0;
  if ((rc = stream_ctx_push((CUstream)stream, &pushed, err, errlen))) return rc;
  struct ksub k;
  rc = ksub_get(&k, err, errlen);
  if (rc) {
    if (pushed) epd_cuda_ctx_leave();
    return rc;
  }
  epd_slot_t *slot = (epd_slot_t *)(uintptr_t)dslot;
  epd_desc_t d;
  memset(&d, 0, sizeof d);
  if (desc) d = *desc;
  void *a_sub[] = {&slot, &d};
  void *a_wait[] = {&slot, &timeout_ns};
  void *a_run[] = {&slot, &d, &timeout_ns};
  CUfunction f = what == EPD_KSUB_SUBMIT ? k.fsub : what == EPD_KSUB_WAIT ? k.fwait : k.frun;
  void **args = what == EPD_KSUB_SUBMIT ? a_sub : what == EPD_KSUB_WAIT ? a_wait : a_run;
  CUresult r = cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, (CUstream)stream, args, NULL);
  if (pushed) epd_cuda_ctx_leave();
  return r ? cu_fail(r, "cuLaunchKernel (submission)", err, errlen) : EPD_OK;
}

epd_result_t epd_cuda_write_words(uint64_t dst, size_t stride, const uint64_t *vals, unsigned n, char *err,
                                  size_t errlen) {
  /* on a private stream, waited for once: from pageable memory a copy may return before its DMA has
   * landed (the daemon's kernels read these words), and a context-wide wait would also wait for whatever
   * the application has queued */
  void *sv = NULL;
  epd_result_t rc = epd_cuda_stream_create(&sv, err, errlen);
  if (rc) return rc;
  CUstream st = (CUstream)sv;
  CUresult r = CUDA_SUCCESS;
  for (unsigned i = 0; i < n && r == CUDA_SUCCESS; i++)
    r = cu.cuMemcpyHtoDAsync((CUdeviceptr)(dst + (uint64_t)i * stride), vals + i, sizeof *vals, st);
  /* also after a failed copy: the ones issued before it land before the caller gives up */
  CUresult rs = cu.cuStreamSynchronize(st);
  epd_cuda_stream_destroy(sv);
  if (r) return cu_fail(r, "cuMemcpyHtoDAsync", err, errlen);
  return rs ? cu_fail(rs, "cuStreamSynchronize", err, errlen) : EPD_OK;
}

epd_result_t epd_cuda_stream_create(void **out, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if ((rc = ensure_ctx(-1, err, errlen))) return rc;
  CUstream st = NULL;
  CU_TRY(cu.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  *out = st;
  return EPD_OK;
}

void epd_cuda_stream_destroy(void *stream) {
  if (stream) cu.cuStreamDestroy((CUstream)stream); /* a stream handle names its context */
}

int epd_cuda_stream_done(void *stream, char *err, size_t errlen) {
  int pushed = 0;
  epd_result_t rc = stream_ctx_push((CUstream)stream, &pushed, err, errlen);
  if (rc) return rc;
  CUresult r = cu.cuStreamQuery((CUstream)stream);
  if (pushed) epd_cuda_ctx_leave();
  if (r == CUDA_SUCCESS) return 1;
  if (r == CUDA_ERROR_NOT_READY) return 0;
  return cu_fail(r, "cuStreamQuery", err, errlen);
}

epd_result_t epd_cuda_read(void *dst, uint64_t src, size_t bytes, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  if ((rc = ensure_ctx(-1, err, errlen))) return rc;
  CU_TRY(cu.cuMemcpyDtoH(dst, (CUdeviceptr)src, bytes), "cuMemcpyDtoH");
  return EPD_OK;
}

epd_result_t epd_cuda_stream_sync(void *stream, char *err, size_t errlen) {
  epd_result_t rc = epd_cuda_load(err, errlen);
  if (rc) return rc;
  int pushed = 0;
  if ((rc = stream_ctx_push((CUstream)stream, &pushed, err, errlen))) return rc;
  CUresult r = cu.cuStreamSynchronize((CUstream)stream);
  if (pushed) epd_cuda_ctx_leave();
  return r ? cu_fail(r, "cuStreamSynchronize", err, errlen) : EPD_OK;
}

#else /* !EPD_WITH_CUDA: built without the CUDA headers */

static epd_result_t no_cuda(char *err, size_t errlen) {
  if (err) snprintf(err, errlen, "this libepd was built without CUDA support (WITH_CUDA=0)");
  return EPD_ERR_UNSUPPORTED;
}
epd_result_t epd_cuda_load(char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_import(int fd, size_t bytes, int device, epd_cuda_map_t **out, void **addr, char *err,
                             size_t errlen) {
  return no_cuda(err, errlen);
}
void epd_cuda_unimport(epd_cuda_map_t *m) {
  (void)m;
}
epd_result_t epd_cuda_register_host(void *host, size_t bytes, int device, epd_cuda_hostreg_t **out,
                                    uint64_t *dev_addr, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
void epd_cuda_unregister_host(epd_cuda_hostreg_t *r) {
  (void)r;
}
epd_result_t epd_cuda_ksub_load(int device, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_ctx_enter(int device, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_find_device(const uint8_t uuid[16], int *ordinal, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
void epd_cuda_ctx_leave(void) {}
epd_result_t epd_cuda_ksubmit(void *stream, uint64_t dslot, const epd_desc_t *desc, int what,
                              uint64_t timeout_ns, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_write_words(uint64_t dst, size_t stride, const uint64_t *vals, unsigned n, char *err,
                                  size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_stream_create(void **out, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
void epd_cuda_stream_destroy(void *stream) {
  (void)stream;
}
int epd_cuda_stream_done(void *stream, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_submit(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                             size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_submit_async(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                                   size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_wait_async(void *stream, uint64_t slot_dev, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_read(void *dst, uint64_t src, size_t bytes, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
epd_result_t epd_cuda_stream_sync(void *stream, char *err, size_t errlen) {
  return no_cuda(err, errlen);
}
const char *epd_cuda_memop_mode(void) {
  return "none";
}

#endif
