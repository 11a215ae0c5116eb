/*
 * bench_kernels.h - the HT benchmark's own kernels (bench_kernels.cu): copy bounds and the copy-engine
 * pipeline model of bench_ht.c. Return EPD_ERR_INVALID on bad arguments, EPD_ERR_CUDA on launch failures.
 */
#ifndef EPD_BENCH_KERNELS_H
#define EPD_BENCH_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "epd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Benchmark helper: copy `bytes` (16-byte aligned) with a plain vector copy kernel on `blocks` blocks
 * (dst may be a peer GPU's memory with peer access enabled). */
epd_result_t epd_k_copy(void *dst, const void *src, size_t bytes, uint32_t blocks, void *stream);
/* The same through the bulk-copy engine (TMA, sm_90): one thread per block streams 32 KB chunks through
 * shared memory, `stages` (2..6) of them in flight. */
epd_result_t epd_k_copy_tma(void *dst, const void *src, size_t bytes, uint32_t blocks, uint32_t stages,
                            void *stream);
/* Benchmark helpers of a copy-engine pipeline: gather rows idx[0..n) of src (row_bytes each) into dst in
 * order; when all rows of chunk c (chunk_rows rows) are written, flags[c] = seq (cnt[]: zeroed per run).
 * reduce2: out[idx[i]] = a[idx[i]] + b[i] (BF16 rows of `hidden`, f32 sum), rows of chunk c of b read
 * once flags[c] >= seq. */
epd_result_t epd_k_pack_rows(void *dst, const void *src, const int32_t *idx, uint32_t n, uint32_t row_bytes,
                             uint32_t chunk_rows, uint32_t *cnt, uint32_t *flags, uint32_t seq,
                             uint32_t blocks, void *stream);
epd_result_t epd_k_reduce2_rows(void *out, const void *a, const void *b, const int32_t *idx, uint32_t n,
                                uint32_t hidden, uint32_t chunk_rows, const uint32_t *flags, uint32_t seq,
                                uint32_t blocks, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* EPD_BENCH_KERNELS_H */
