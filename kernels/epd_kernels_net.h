/*
 * epd_kernels_net.h - the table-driven kernels of the CUDA inter-node stage (kernels/net.cu), plain C.
 *
 * The daemon (daemon/cnet_plan.c) turns a step's routing plan into three kinds of tables whose entries
 * are device addresses (any GPU of the daemon, reachable through UVA and peer access):
 *   rows  - copy a BF16 row, quantise it to FP8 with per-128-channel scales (SEMANTICS.md), or copy
 *           an FP8 row with its scales;
 *   wsum  - out row = sum of weighted BF16 or float32 rows, accumulated in float32 in table order
 *           (no FMA contraction: equal bit for bit to the host emulation), written as float32 or BF16;
 *   puts  - scattered 32-bit stores (receive counts, sources, HT top-k rows).
 * The host emulation of the same tables lives in daemon/cnet_plan.c (CPU tests).
 */
#ifndef EPD_KERNELS_NET_H
#define EPD_KERNELS_NET_H

#include <stdint.h>

#include "epd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epd_k_net_row {
  uint64_t src;        /* BF16 row of H values, or (src_scales != 0) H e4m3 bytes */
  uint64_t dst;        /* BF16 row, or (FP8) H e4m3 bytes */
  uint64_t scales;     /* FP8: the destination's H/128 floats; 0 with BF16 */
  uint64_t src_scales; /* an FP8 source's H/128 scales (copied as they are); 0: BF16 source */
} epd_k_net_row_t;

typedef struct epd_k_net_term {
  uint64_t src; /* BF16 or float32 row of H values */
  float w;
  uint32_t f32; /* 1: src is float32 */
} epd_k_net_term_t;

typedef struct epd_k_net_put {
  uint64_t dst;
  uint32_t value;
  uint32_t pad;
} epd_k_net_put_t;

/* Run n row entries (device table) on `stream`; hidden a multiple of 128; fp8: BF16 sources are
 * quantised (FP8 sources are always copied as FP8). */
epd_result_t epd_k_net_rows(const epd_k_net_row_t *rows, uint32_t n, uint32_t hidden, int fp8, void *stream);
/* Output row i (address out[i]) = sum of terms[off[i] .. off[i+1]) (device tables); no term: zeros. */
epd_result_t epd_k_net_wsum(const uint32_t *off, const epd_k_net_term_t *terms, const uint64_t *out,
                            uint32_t n, uint32_t hidden, int out_f32, void *stream);
/* n scattered 32-bit stores (device table). */
epd_result_t epd_k_net_put(const epd_k_net_put_t *puts, uint32_t n, void *stream);
/* Load the kernels above on the current device now (a first launch under lazy loading waits for the
 * kernels running in the context: those of the other ranks sharing the GPU). */
epd_result_t epd_k_net_preload(void);

struct ncclComm;
/* What NCCL offers for device-initiated network transfers (GIN) on a world communicator: a device
 * communicator asking for a GIN context (a hint, not forced) is created and destroyed. *contexts: the
 * GIN contexts NCCL gave it (0: none), *type: the first one's backend (NCCL_NET_DEVICE_GIN_PROXY 2,
 * _GDAKI 3), or -1 where NCCL refused the request as invalid usage (NCCL 2.28: "GIN not supported";
 * err gets NCCL's last error). Collective: every rank of the world calls it, each with its device
 * current, once: NCCL may leave the GIN connections up for the communicator's life. */
epd_result_t epd_k_gin_probe(struct ncclComm *world, int *contexts, int *type, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* EPD_KERNELS_NET_H */
