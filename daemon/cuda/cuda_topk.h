/*
 * cuda_topk.h - a rank's top-k rows read from its arena into pinned host memory, for the host's part of a
 * step: the entries a dispatch dropped (launch.c, ranks masked) and the world plan's inputs
 * (engine_cuda_net.c's step frame).
 */
#ifndef EPD_CUDA_TOPK_H
#define EPD_CUDA_TOPK_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

/* rows rows of top-k ids (K int64 each, device address idx) and, where w is not 0, as many rows of weights
 * (K floats, at w) after them, into *host: pinned memory of *cap bytes, made (alloc bytes) when they do not
 * fit. Asynchronous on s; 0, or the CUDA error (*cap 0 where the memory could not be made). */
static inline cudaError_t cuda_topk_read(void **host, size_t *cap, size_t alloc, uint64_t idx, uint64_t w,
                                         size_t rows, uint32_t K, cudaStream_t s) {
  const size_t ib = rows * K * sizeof(int64_t), need = ib + (w ? rows * K * sizeof(float) : 0);
  if (need > *cap) {
    const size_t bytes = alloc > need ? alloc : need;
    if (*host) cudaFreeHost(*host);
    *host = NULL;
    *cap = 0;
    cudaError_t e = cudaHostAlloc(host, bytes, 0);
    if (e) {
      *host = NULL;
      return e;
    }
    *cap = bytes;
  }
  cudaError_t e = cudaMemcpyAsync(*host, (const void *)(uintptr_t)idx, ib, cudaMemcpyDeviceToHost, s);
  if (!e && w)
    e = cudaMemcpyAsync((uint8_t *)*host + ib, (const void *)(uintptr_t)w, rows * K * sizeof(float),
                        cudaMemcpyDeviceToHost, s);
  return e;
}

#endif
