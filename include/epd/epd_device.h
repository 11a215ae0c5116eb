/*
 * epd_device.h - device-side submission for client kernels: a CUDA kernel of the worker enqueues a
 * dispatch/combine on its queue slot and waits for the completion without leaving the GPU.
 *
 * The slot pointer is the device address of an epd_slot_t of the client's queue, from
 * epd_slot_device_ptr(ep, i) (include/epd/epd.h): the slot's device twin in GPU memory where the daemon made
 * one (include/epd/epd_abi.h "Device twin"; the functions here then also write the host copy, which the
 * daemon's CPU threads read), else the host copy itself (host memory registered mapped: loads and stores
 * travel over PCIe/C2C at system scope). Use slots in ring order starting at
 * epd_info(ep, EPD_INFO_NEXT_SLOT).
 * Without CUDA MPS a client kernel spinning here is time-sliced against the daemon's kernels (about
 * 2.4 ms per op measured on 2x H200, bench/results/bench_e2e_h200x2.md): use device-side enqueue under
 * MPS only. Call both functions from ONE thread (e.g.
 * threadIdx.x == 0 of block 0), then publish the result to the rest of the grid yourself.
 *
 * Protocol (include/epd/epd_abi.h): write desc; fence; state = SUBMITTED (release) ... state == DONE
 * (acquire); read comp; state = FREE. Every wait has a timeout: a dead daemon or peer returns
 * EPD_ERR_TIMEOUT instead of hanging the kernel (the slot is then left SUBMITTED: the host side must
 * recover the queue, e.g. by detaching).
 */
#ifndef EPD_DEVICE_H
#define EPD_DEVICE_H

#include <stdint.h>

#include "epd_abi.h"

#ifdef __CUDACC__

#ifndef EPD_DEV_ERR_TIMEOUT
/* == EPD_ERR_TIMEOUT of epd.h (kept here so kernels need not include it) */
#define EPD_DEV_ERR_TIMEOUT (-8)
#endif
#ifndef EPD_DEV_ERR_CLOSED
#define EPD_DEV_ERR_CLOSED (-19) /* == EPD_ERR_CLOSED: the client's CPU abandoned the op (detach) */
#endif

/* Nanoseconds from the GPU's global timer. */
static __device__ __forceinline__ uint64_t epd_dev_now_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

static __device__ __forceinline__ void epd_dev_st_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* The host copy of a device-twin slot (include/epd/epd_abi.h "Device twin"), or NULL when `slot` is the host
 * copy itself (a queue without a twin). */
static __device__ __forceinline__ epd_slot_t *epd_dev_host_twin(const epd_slot_t *slot) {
  return (epd_slot_t *)(uintptr_t)(*(volatile const uint64_t *)&slot->twin_host);
}

static __device__ __forceinline__ void epd_dev_put_desc(epd_slot_t *slot, const epd_desc_t *desc) {
  volatile uint64_t *dst = (volatile uint64_t *)&slot->desc;
  const uint64_t *src = (const uint64_t *)desc;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(epd_desc_t) / 8); i++) dst[i] = src[i];
}

/* Write the descriptor into the slot and mark it SUBMITTED. The slot must be FREE (the previous op on
 * it completed and was waited for). With a device twin: the twin first (the daemon's persistent kernel
 * on this GPU polls it), then the host copy (its CPU threads read that one). */
static __device__ __forceinline__ void epd_dev_submit(epd_slot_t *slot, const epd_desc_t *desc) {
  epd_slot_t *host = epd_dev_host_twin(slot);
  epd_dev_put_desc(slot, desc);
  if (host) {
    /* The descriptor and this kernel's earlier writes (the inputs in the arena) before SUBMITTED, for a
     * reader on this GPU. */
    __threadfence();
    *(volatile uint32_t *)&slot->state = EPD_SLOT_SUBMITTED;
    epd_dev_put_desc(host, desc);
  } else {
    host = slot;
  }
  /* ... and for the daemon's CPU (and the peers' kernels it launches) */
  __threadfence_system();
  *(volatile uint32_t *)&host->state = EPD_SLOT_SUBMITTED;
}

/* Wait up to timeout_ns for the slot's completion; on DONE copy the completion to *comp (if not NULL),
 * free the slot and return comp.status; on timeout return EPD_DEV_ERR_TIMEOUT (slot left as is).
 * With a device twin, DONE may come in either copy: the persistent kernels complete both (the twin is
 * polled first: a GPU load), the daemon's CPU only the host copy (polled every 4th time). The twin is
 * freed first, then the host copy (the persistent kernels rely on that order). A host copy found FREE
 * while waiting means libepd abandoned the op (epd_detach): EPD_DEV_ERR_CLOSED. */
static __device__ __forceinline__ int epd_dev_wait_stamped(epd_slot_t *slot, uint64_t timeout_ns,
                                                           epd_comp_t *comp, uint64_t *done_seen_ns);
static __device__ __forceinline__ int epd_dev_wait(epd_slot_t *slot, uint64_t timeout_ns, epd_comp_t *comp) {
  return epd_dev_wait_stamped(slot, timeout_ns, comp, (uint64_t *)0);
}

/* epd_dev_wait, and (diagnostics) the global timer when DONE was seen in *done_seen_ns if not NULL. */
static __device__ __forceinline__ int epd_dev_wait_stamped(epd_slot_t *slot, uint64_t timeout_ns,
                                                           epd_comp_t *comp, uint64_t *done_seen_ns) {
  epd_slot_t *host = epd_dev_host_twin(slot);
  const uint64_t t0 = epd_dev_now_ns();
  const epd_slot_t *src = slot;
  for (uint32_t n = 0;; n++) {
    if (*(volatile const uint32_t *)&slot->state == EPD_SLOT_DONE) break;
    if (host && (n & 3) == 3) {
      const uint32_t hs = *(volatile const uint32_t *)&host->state;
      if (hs == EPD_SLOT_DONE) {
        /* The persistent kernels write the twin's DONE one GPU-scope fence after the host copy's: wait a
         * little for it and read the record from GPU memory (from the host copy it is 8 PCIe reads);
         * the launch mode completes only the host copy, so not for long. */
        const uint64_t t1 = epd_dev_now_ns();
        while (*(volatile const uint32_t *)&slot->state != EPD_SLOT_DONE && epd_dev_now_ns() - t1 < 4000) {
        }
        if (*(volatile const uint32_t *)&slot->state != EPD_SLOT_DONE) src = host;
        break;
      }
      if (hs == EPD_SLOT_FREE) return EPD_DEV_ERR_CLOSED;
    }
    if (epd_dev_now_ns() - t0 > timeout_ns) return EPD_DEV_ERR_TIMEOUT;
  }
  if (done_seen_ns) *done_seen_ns = epd_dev_now_ns();
  /* acquire: the completion record after the state that announced it */
  if (src == slot && host)
    __threadfence();
  else
    __threadfence_system();
  const volatile uint64_t *rec = (const volatile uint64_t *)&src->comp;
  uint64_t c[sizeof(epd_comp_t) / 8];
#pragma unroll
  for (int i = 0; i < (int)(sizeof(epd_comp_t) / 8); i++) c[i] = rec[i];
  if (comp) {
#pragma unroll
    for (int i = 0; i < (int)(sizeof(epd_comp_t) / 8); i++) ((uint64_t *)comp)[i] = c[i];
  }
  const int status = ((const epd_comp_t *)c)->status;
  if (host) {
    /* The twin's FREE, then the host copy's, one GPU-scope fence apart: the readers that rely on that
     * order (the persistent kernels, checking a slot they have not taken yet) run on this GPU, and the
     * daemon's CPU never reads the twin. A system-scope release here cost 1.7 us per op from DONE seen
     * to the return (bench_ll EPD_BENCH_PERSIST, 2x H100). */
    *(volatile uint32_t *)&slot->state = EPD_SLOT_FREE;
    __threadfence();
    *(volatile uint32_t *)&host->state = EPD_SLOT_FREE;
  } else {
    epd_dev_st_release_sys(&slot->state, EPD_SLOT_FREE);
  }
  return status;
}

/* Submit and wait in one call (one thread). */
static __device__ __forceinline__ int epd_dev_run(epd_slot_t *slot, const epd_desc_t *desc,
                                                  uint64_t timeout_ns, epd_comp_t *comp) {
  epd_dev_submit(slot, desc);
  return epd_dev_wait(slot, timeout_ns, comp);
}

#endif /* __CUDACC__ */
#endif /* EPD_DEVICE_H */
