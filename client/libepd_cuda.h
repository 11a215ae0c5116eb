/*
 * libepd_cuda.h - internal: the CUDA side of libepd (import of the daemon's cuMem fds, host registration
 * of the queue, stream-ordered submission with stream memory operations). Loaded lazily (dlopen of
 * libcuda.so.1) so that libepd works with the host backend on machines without CUDA.
 *
 * Where the queue lives: the queue stays a memfd in host memory on both backends. With the CUDA backend
 * the daemon registers it mapped (cudaHostRegister) and the client registers its own mmap with
 * epd_cuda_register_host(), so the client's stream memory operations and kernels (epd_device.h) write
 * the slot through a device address while the daemon's CPU thread (launch mode) or its persistent
 * kernel (MPS mode) sees the same bytes. The IO arena is GPU memory (epd_cuda_import); at its end the
 * daemon keeps the queue's device twin (include/epd/epd_abi.h), which the persistent kernels poll and which
 * libepd's submission kernels (epd_cuda_ksubmit) write besides the host copy.
 */
#ifndef EPD_LIBEPD_CUDA_H
#define EPD_LIBEPD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

typedef struct epd_cuda_map epd_cuda_map_t;
typedef struct epd_cuda_hostreg epd_cuda_hostreg_t;

/* Load libcuda.so.1 and resolve the driver entry points (once, thread-safe). EPD_ERR_UNSUPPORTED
 * with a message when there is no driver. */
epd_result_t epd_cuda_load(char *err, size_t errlen);
/* Import a POSIX-fd cuMem allocation of `bytes` on `device` and map it read/write in this process;
 * *addr gets the device address. The fd stays owned by the caller. */
epd_result_t epd_cuda_import(int fd, size_t bytes, int device, epd_cuda_map_t **out, void **addr, char *err,
                             size_t errlen);
/* Unmap and release an import. */
void epd_cuda_unimport(epd_cuda_map_t *m);
/* Page-lock and map host memory (the queue's mmap) for `device`; *dev_addr gets the address by which
 * stream memory operations and kernels reach it. */
epd_result_t epd_cuda_register_host(void *host, size_t bytes, int device, epd_cuda_hostreg_t **out,
                                    uint64_t *dev_addr, char *err, size_t errlen);
/* Undo epd_cuda_register_host (the memory must no longer be used by the GPU). */
void epd_cuda_unregister_host(epd_cuda_hostreg_t *r);
/* Enqueue on `stream` (a CUstream/cudaStream_t, NULL = legacy default stream): write desc into the
 * slot, set state SUBMITTED, wait for state DONE, set FREE, as one batch of stream memory operations
 * (capturable in a CUDA graph; every value is a constant of the slot, so replays are correct).
 * slot_dev is the device address of the epd_slot_t (from epd_cuda_register_host). */
epd_result_t epd_cuda_submit(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                             size_t errlen);
/* Enqueue only the submission half (desc, state = SUBMITTED) or only the completion half (wait DONE,
 * state = FREE) on a stream; epd_cuda_submit is the two in one batch. */
epd_result_t epd_cuda_submit_async(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                                   size_t errlen);
epd_result_t epd_cuda_wait_async(void *stream, uint64_t slot_dev, char *err, size_t errlen);
/* Kernel submission (client/submit.cu) for a slot's device twin `dslot` (include/epd/epd_abi.h): a one-warp
 * kernel on `stream` submits (EPD_KSUB_SUBMIT), waits up to timeout_ns for DONE and frees the slot
 * (EPD_KSUB_WAIT), or both (EPD_KSUB_RUN). Capturable in a CUDA graph (constant arguments). A wait that
 * times out leaves the host copy SUBMITTED, which the host side reports. epd_cuda_ksub_load loads the
 * kernels into the current (else `device`'s primary) context ahead of the first use. */
enum { EPD_KSUB_SUBMIT = 1, EPD_KSUB_WAIT = 2, EPD_KSUB_RUN = 3 };
epd_result_t epd_cuda_ksub_load(int device, char *err, size_t errlen);
epd_result_t epd_cuda_ksubmit(void *stream, uint64_t dslot, const epd_desc_t *desc, int what,
                              uint64_t timeout_ns, char *err, size_t errlen);
/* This process's ordinal of the GPU with the given UUID (the daemon's ordinal may differ: a worker with
 * CUDA_VISIBLE_DEVICES set numbers its GPUs from 0). EPD_ERR_INVALID, naming the GPU, when this process
 * does not see it. */
epd_result_t epd_cuda_find_device(const uint8_t uuid[16], int *ordinal, char *err, size_t errlen);
/* Make `device`'s primary context current (pushed) for libepd's own CUDA work, whatever context the
 * calling thread has; epd_cuda_ctx_leave pops it. */
epd_result_t epd_cuda_ctx_enter(int device, char *err, size_t errlen);
void epd_cuda_ctx_leave(void);
/* Write the n 64-bit words vals[i] to device addresses dst + i * stride, and wait until they have landed
 * (a private stream of the current context: the application's own queued work is not waited for). */
epd_result_t epd_cuda_write_words(uint64_t dst, size_t stride, const uint64_t *vals, unsigned n, char *err,
                                  size_t errlen);
/* A non-blocking stream of the current context; destroy; 1 when its work is done, 0 if not, <0 error. */
epd_result_t epd_cuda_stream_create(void **out, char *err, size_t errlen);
void epd_cuda_stream_destroy(void *stream);
int epd_cuda_stream_done(void *stream, char *err, size_t errlen);
/* Copy `bytes` from device address src to host dst (synchronous; for reading completion records). */
epd_result_t epd_cuda_read(void *dst, uint64_t src, size_t bytes, char *err, size_t errlen);
/* How stream memory operations are issued, decided on first use: "batch" (one cuStreamBatchMemOp),
 * "single" (one call per op), "single32" (64-bit writes split), or "unknown" before the first. */
const char *epd_cuda_memop_mode(void);
/* Synchronise a stream (NULL = legacy default stream). */
epd_result_t epd_cuda_stream_sync(void *stream, char *err, size_t errlen);

#endif
