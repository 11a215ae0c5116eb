/*
 * submit.cu - libepd's submission kernels, for queues with a device twin (include/epd/epd_abi.h): one warp
 * writes the descriptor and SUBMITTED into the twin and the host copy, or waits for DONE and frees the
 * slot, with the same code a worker's own kernel uses (epd_device.h). Built into a fatbin embedded in
 * libepd (which links no CUDA library) and launched through the driver API on the caller's stream, so
 * an op costs two small kernels instead of eleven stream memory operations, and a CUDA graph captures
 * them like any kernel. Used where the daemon's persistent kernels serve the queue (they poll only the
 * twin), i.e. under CUDA MPS, where these kernels run beside the daemon's.
 */
#include "epd_device.h"

extern "C" __global__ void epd_ksub_submit(epd_slot_t *slot, epd_desc_t desc) {
  if (threadIdx.x == 0) epd_dev_submit(slot, &desc);
}

extern "C" __global__ void epd_ksub_wait(epd_slot_t *slot, uint64_t timeout_ns) {
  if (threadIdx.x == 0) (void)epd_dev_wait(slot, timeout_ns, NULL);
}

extern "C" __global__ void epd_ksub_run(epd_slot_t *slot, epd_desc_t desc, uint64_t timeout_ns) {
  if (threadIdx.x == 0) {
    epd_dev_submit(slot, &desc);
    (void)epd_dev_wait(slot, timeout_ns, NULL);
  }
}
