// test_plumb_dev.cu - client kernels for tests/gpu/test_plumb.c, using include/epd/epd_device.h.
// Compiled to PTX and embedded in test_plumb_dev_ptx.h by gen_plumb_ptx.sh (the Makefile builds only
// kernels/*.cu; the test loads the PTX with the driver API).
#include "epd_device.h"

// n ops in ring order over the queue's slots, one thread. status[i] gets each op's status, ns[0] the
// total time of the n round trips (globaltimer).
extern "C" __global__ void plumb_dev_ops(epd_queue_t *q, int n, uint32_t first, unsigned long long timeout_ns,
                                         int *status, unsigned long long *ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t t0 = epd_dev_now_ns();
  for (int i = 0; i < n; i++) {
    epd_slot_t *s = &q->slot[(first + i) % EPD_QUEUE_SLOTS];
    epd_desc_t d = {};
    d.op = EPD_OP_LL_DISPATCH;
    d.num_tokens = (uint32_t)i;
    d.user_tag = 0x5000ull + (uint64_t)i;
    epd_comp_t c;
    int st = epd_dev_run(s, &d, timeout_ns, &c);
    if (st == 0 && c.user_tag != d.user_tag) st = -1000;
    status[i] = st;
  }
  ns[0] = epd_dev_now_ns() - t0;
}
