/*
 * e2e_dev.cu - the client kernel of bench_e2e's device-side mode: one thread submits dispatch and
 * combine steps on the client's queue slots with include/epd/epd_device.h and waits for each completion
 * without leaving the GPU, stamping the GPU global timer around every op.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "epd_device.h"

namespace {
/* nsteps steps of (dispatch, combine) on slots first, first+1, ... (ring order), bank = step parity.
 * ts[6*i + 2*o] = submit time, ts[6*i + 2*o + 1] = completion seen (o = 0 dispatch, 1 combine),
 * ts[6*i + 4 + o] = the op's comp.latency_ns (daemon side); *status = first non-zero status (or 0).
 * tx (diagnostics, may be NULL): tx[4*i + 2*o] = the submit's return, tx[4*i + 2*o + 1] = DONE seen (before
 * the completion record is read and the slot freed). */
__global__ void e2e_dev_loop(epd_slot_t *slots, uint32_t first, uint32_t nsteps, uint32_t bank0,
                             uint32_t ntok, uint32_t flags, uint64_t timeout_ns, uint64_t *ts, int *status,
                             uint64_t *tx) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  uint32_t s = first;
  for (uint32_t i = 0; i < nsteps; i++) {
    for (int o = 0; o < 2; o++) {
      epd_desc_t d;
      uint64_t *w = (uint64_t *)&d;
#pragma unroll
      for (int j = 0; j < (int)(sizeof d / 8); j++) w[j] = 0;
      d.op = o ? EPD_OP_LL_COMBINE : EPD_OP_LL_DISPATCH;
      d.flags = o ? 0u : flags;
      d.num_tokens = ntok;
      d.bank = (bank0 + i) & 1u;
      d.user_tag = i;
      const uint64_t t0 = epd_dev_now_ns();
      /* diagnostics: the submit time, read by the persistent kernel (submit -> seen), ignored otherwise */
      d.reserved[0] = (uint32_t)t0;
      d.reserved[1] = (uint32_t)(t0 >> 32);
      epd_comp_t comp;
      epd_dev_submit(&slots[s], &d);
      const uint64_t ta = epd_dev_now_ns();
      uint64_t tdone = 0;
      const int st = epd_dev_wait_stamped(&slots[s], timeout_ns, &comp, tx ? &tdone : (uint64_t *)0);
      const uint64_t t1 = epd_dev_now_ns();
      if (tx) {
        tx[4 * i + 2 * o] = ta;
        tx[4 * i + 2 * o + 1] = tdone;
      }
      ts[6 * i + 2 * o] = t0;
      ts[6 * i + 2 * o + 1] = t1;
      ts[6 * i + 4 + o] = comp.latency_ns;
      s = (s + 1) % EPD_QUEUE_SLOTS;
      if (st) {
        *status = st;
        return;
      }
    }
  }
  *status = 0;
}
} /* namespace */

/* With the diagnostic stamps tx (4 per step, see e2e_dev_loop; NULL: none). */
extern "C" int e2e_dev_launch_tx(void *slots, uint32_t first, uint32_t nsteps, uint32_t bank0, uint32_t ntok,
                                 uint32_t flags, uint64_t timeout_ns, uint64_t *ts, int *status, uint64_t *tx,
                                 void *stream) {
  e2e_dev_loop<<<1, 1, 0, (cudaStream_t)stream>>>((epd_slot_t *)slots, first, nsteps, bank0, ntok, flags,
                                                  timeout_ns, ts, status, tx);
  return (int)cudaGetLastError();
}
extern "C" int e2e_dev_launch(void *slots, uint32_t first, uint32_t nsteps, uint32_t bank0, uint32_t ntok,
                              uint32_t flags, uint64_t timeout_ns, uint64_t *ts, int *status, void *stream) {
  return e2e_dev_launch_tx(slots, first, nsteps, bank0, ntok, flags, timeout_ns, ts, status, (uint64_t *)0,
                           stream);
}
/* Load the client kernel now: with lazy module loading its first launch would wait for the kernels
 * running in the context, a persistent kernel that waits for this one's submissions among them. */
extern "C" int e2e_dev_load(void) {
  cudaFuncAttributes a;
  return (int)cudaFuncGetAttributes(&a, e2e_dev_loop);
}
