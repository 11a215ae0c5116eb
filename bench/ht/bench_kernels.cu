/*
 * bench_kernels.cu - kernels that only the HT benchmark (bench_ht.c) runs: a plain and a bulk-copy (TMA)
 * copy kernel, the bounds it compares the HT kernels with, and the row gather and reduction of its
 * copy-engine pipeline model. Not part of the daemon.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "bench_kernels.h"
#include "epd_dev.cuh"

using namespace epd_dev;

/* ---- benchmark helper: plain copy kernel (16-byte vectors, 8 in flight per thread) ---- */
namespace {
__global__ void __launch_bounds__(512) copy_kernel(int4 *dst, const int4 *src, size_t n16) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < n16; i0 += stride * 8) {
    int4 b[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
      if (i0 + j * stride < n16) b[j] = ld_nc_v4(src + i0 + j * stride);
#pragma unroll
    for (int j = 0; j < 8; j++)
      if (i0 + j * stride < n16) dst[i0 + j * stride] = b[j];
  }
}
} /* namespace */

/* ---- benchmark helper: the same copy through the bulk-copy engine: one thread per block streams
 * CPY_CH-byte chunks global -> shared (TMA load) -> destination (TMA store), `nst` chunks in flight ---- */
namespace {
constexpr uint32_t CPY_CH = 32768, CPY_MAXST = 6;
__global__ void __launch_bounds__(32)
    copy_tma_kernel(char *dst, const char *src, size_t bytes, uint32_t nst) {
  extern __shared__ __align__(128) char cbuf[];
  __shared__ __align__(8) uint64_t cbar[CPY_MAXST];
  if (threadIdx.x != 0) return;
  for (uint32_t i = 0; i < nst; i++) mbar_init(&cbar[i], 1);
  mbar_init_fence();
  const size_t nch = (bytes + CPY_CH - 1) / CPY_CH, G = gridDim.x;
  const uint64_t deadline = gtimer() + 2000000000ull;
  auto load = [&](uint64_t k) { /* this block's k-th chunk into stage k % nst */
                                const size_t c = blockIdx.x + k * G;
                                if (c >= nch) return;
                                const uint32_t len = (uint32_t)min((size_t)CPY_CH, bytes - c * CPY_CH),
                                               st = (uint32_t)(k % nst);
                                mbar_expect_tx(&cbar[st], len);
                                tma_load(cbuf + (size_t)st * CPY_CH, src + c * CPY_CH, len, &cbar[st]);
  };
  for (uint64_t k = 0; k < nst; k++) load(k);
  for (uint64_t k = 0; blockIdx.x + k * G < nch; k++) {
    const size_t c = blockIdx.x + k * G;
    const uint32_t len = (uint32_t)min((size_t)CPY_CH, bytes - c * CPY_CH), st = (uint32_t)(k % nst);
    if (!mbar_wait(&cbar[st], (uint32_t)(k / nst) & 1u, deadline)) __trap(); /* a bench helper: fail loudly */
    tma_store(dst + c * CPY_CH, cbuf + (size_t)st * CPY_CH, len);
    tma_commit();
    /* the previous chunk's store has read its stage: refill that stage */
    if (k > 0) {
      tma_wait_read(1);
      load(k - 1 + nst);
    }
  }
  tma_wait_all();
}
} /* namespace */

extern "C" epd_result_t epd_k_copy_tma(void *dst, const void *src, size_t bytes, uint32_t blocks,
                                       uint32_t stages, void *stream) {
  if ((uintptr_t)dst % 16 || (uintptr_t)src % 16 || bytes % 16 || !blocks || stages < 2 || stages > CPY_MAXST)
    return EPD_ERR_INVALID;
  const size_t smem = (size_t)CPY_CH * stages;
  if (cudaFuncSetAttribute(copy_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return EPD_ERR_CUDA;
  copy_tma_kernel<<<blocks, 32, smem, (cudaStream_t)stream>>>((char *)dst, (const char *)src, bytes, stages);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_copy(void *dst, const void *src, size_t bytes, uint32_t blocks, void *stream) {
  if ((uintptr_t)dst % 16 || (uintptr_t)src % 16 || bytes % 16 || !blocks) return EPD_ERR_INVALID;
  copy_kernel<<<blocks, 512, 0, (cudaStream_t)stream>>>((int4 *)dst, (const int4 *)src, bytes / 16);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

/* ---- benchmark helpers for a copy-engine (CE) pipeline (bench_ht "ce" rows): SMs gather or reduce the
 * rows, the GPU's copy engines move them across NVLink, chunk by chunk, ordered by flags ---- */
namespace {
/* One thread per block moves its rows (i = block, block + G, ...) with the bulk-copy engine: a TMA load
 * of the whole row into one of `nst` shared-memory stages, a TMA store to its packed index. A block adds
 * its rows of a chunk to the chunk's count once their stores completed (PACK_LAG stores may still be in
 * flight behind them); the block that completes the chunk raises its flag. */
constexpr uint32_t PACK_LAG = 8, PACK_IDX = 2048;
__global__ void __launch_bounds__(32)
    pack_rows_kernel(char *dst, const char *src, const int32_t *idx, uint32_t n, uint32_t rowb, uint32_t ch,
                     uint32_t *cnt, uint32_t *flags, uint32_t seq, uint32_t nst) {
  extern __shared__ __align__(128) char pbuf[];
  __shared__ __align__(8) uint64_t pbar[32];
  __shared__ int32_t sidx[PACK_IDX];
  const uint32_t G = gridDim.x, mine = n > blockIdx.x ? (n - blockIdx.x + G - 1) / G : 0;
  for (uint32_t k = threadIdx.x; k < mine && k < PACK_IDX; k += blockDim.x) sidx[k] = idx[blockIdx.x + k * G];
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (uint32_t i = 0; i < nst; i++) mbar_init(&pbar[i], 1);
  mbar_init_fence();
  const uint64_t deadline = gtimer() + 2000000000ull;
  auto row = [&](uint32_t k) { return blockIdx.x + k * G; };
  auto load = [&](uint32_t k) {
    if (k >= mine) return;
    const uint32_t st = k % nst, t = k < PACK_IDX ? (uint32_t)sidx[k] : (uint32_t)idx[row(k)];
    mbar_expect_tx(&pbar[st], rowb);
    tma_load(pbuf + (size_t)st * rowb, src + (size_t)t * rowb, rowb, &pbar[st]);
  };
  uint32_t pend = 0;
  /* row(k)'s store completed: add the block's rows of its chunk at the last of them */
  auto count = [&](uint32_t k) {
    const uint32_t c = row(k) / ch;
    pend++;
    if (k + 1 < mine && row(k + 1) / ch == c) return;
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __threadfence_system(); /* the rows before the count: the copy engine reads them after the flag */
    if (atomicAdd(&cnt[c], pend) + pend == min(ch, n - c * ch)) {
      __threadfence_system();
      *(volatile uint32_t *)&flags[c] = seq;
    }
    pend = 0;
  };
  for (uint32_t k = 0; k < nst; k++) load(k);
  for (uint32_t k = 0; k < mine; k++) {
    const uint32_t st = k % nst;
    if (!mbar_wait(&pbar[st], (k / nst) & 1u, deadline)) __trap(); /* a bench helper: fail loudly */
    tma_store(dst + (size_t)row(k) * rowb, pbuf + (size_t)st * rowb, rowb);
    tma_commit();
    if (k > 0) { /* the previous row's store has read its stage: refill it */
      tma_wait_read(1);
      load(k - 1 + nst);
    }
    if (k >= PACK_LAG) {
      asm volatile("cp.async.bulk.wait_group 8;" ::: "memory");
      count(k - PACK_LAG);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  for (uint32_t j = mine > PACK_LAG ? mine - PACK_LAG : 0; j < mine; j++) count(j);
}

__global__ void __launch_bounds__(512)
    reduce2_rows_kernel(__nv_bfloat16 *out, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                        const int32_t *idx, uint32_t n, uint32_t H, uint32_t ch, const uint32_t *flags,
                        uint32_t seq) {
  const uint32_t nw = gridDim.x * (blockDim.x / 32), w0 = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const uint32_t lane = threadIdx.x & 31, n16 = H / 8;
  const uint64_t deadline = gtimer() + 2000000000ull;
  uint32_t seen = 0xffffffffu;
  for (uint32_t i = w0; i < n; i += nw) {
    const uint32_t c = i / ch;
    if (c != seen) { /* the chunk's rows landed (the copy engine's stream wrote its flag after the copy) */
      if (lane == 0) {
        while (*(volatile const uint32_t *)&flags[c] < seq)
          if (gtimer() > deadline) __trap();
        __threadfence(); /* acquire: the rows after the flag */
      }
      __syncwarp();
      seen = c;
    }
    const int4 *pa = (const int4 *)(a + (size_t)idx[i] * H), *pb = (const int4 *)(b + (size_t)i * H);
    int4 *po = (int4 *)(out + (size_t)idx[i] * H);
    for (uint32_t v0 = lane; v0 < n16; v0 += 32 * 4) {
      int4 x[4], y[4];
#pragma unroll
      for (int u = 0; u < 4; u++)
        if (v0 + u * 32 < n16) {
          x[u] = ld_nc_v4(pa + v0 + u * 32);
          y[u] = __ldcv(pb + v0 + u * 32);
        }
#pragma unroll
      for (int u = 0; u < 4; u++) {
        if (v0 + u * 32 >= n16) continue;
        const __nv_bfloat162 *x2 = (const __nv_bfloat162 *)&x[u], *y2 = (const __nv_bfloat162 *)&y[u];
        int4 o;
        __nv_bfloat162 *o2 = (__nv_bfloat162 *)&o;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const float2 fx = __bfloat1622float2(x2[j]), fy = __bfloat1622float2(y2[j]);
          o2[j] = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
        }
        po[v0 + u * 32] = o;
      }
    }
  }
}
} /* namespace */

extern "C" epd_result_t epd_k_pack_rows(void *dst, const void *src, const int32_t *idx, uint32_t n,
                                        uint32_t row_bytes, uint32_t chunk_rows, uint32_t *cnt,
                                        uint32_t *flags, uint32_t seq, uint32_t blocks, void *stream) {
  if (!dst || !src || !idx || !cnt || !flags || row_bytes % 16 || !row_bytes || !chunk_rows || !blocks ||
      (uintptr_t)dst % 16 || (uintptr_t)src % 16)
    return EPD_ERR_INVALID;
  const uint32_t nst = min(32u, (SMEM_MAX - (uint32_t)sizeof(int32_t) * PACK_IDX) / row_bytes);
  if (nst < 2) return EPD_ERR_INVALID;
  const size_t smem = (size_t)nst * row_bytes;
  if (cudaFuncSetAttribute(pack_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return EPD_ERR_CUDA;
  pack_rows_kernel<<<blocks, 32, smem, (cudaStream_t)stream>>>((char *)dst, (const char *)src, idx, n,
                                                               row_bytes, chunk_rows, cnt, flags, seq, nst);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_reduce2_rows(void *out, const void *a, const void *b, const int32_t *idx,
                                           uint32_t n, uint32_t hidden, uint32_t chunk_rows,
                                           const uint32_t *flags, uint32_t seq, uint32_t blocks,
                                           void *stream) {
  if (!out || !a || !b || !idx || !flags || hidden % 8 || !chunk_rows || !blocks || (uintptr_t)out % 16 ||
      (uintptr_t)a % 16 || (uintptr_t)b % 16)
    return EPD_ERR_INVALID;
  reduce2_rows_kernel<<<blocks, 512, 0, (cudaStream_t)stream>>>(
      (__nv_bfloat16 *)out, (const __nv_bfloat16 *)a, (const __nv_bfloat16 *)b, idx, n, hidden, chunk_rows,
      flags, seq);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}
