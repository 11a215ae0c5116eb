/*
 * net.cu - the table-driven kernels of the CUDA inter-node stage (epd_kernels_net.h). They move rows
 * between the client arenas and the exchange buffers that ncclSend/ncclRecv carry between nodes; all
 * routing is decided on the host (daemon/cnet_plan.c), so the kernels know addresses, not layouts.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "epd_dev.cuh"
#include "epd_kconfig.h"
#include "epd_kernels_net.h"

namespace {

constexpr int NET_THREADS = 256;
constexpr uint32_t NET_MAX_GRID = 4096;

__device__ __forceinline__ float bf(uint32_t v16) {
  return __uint_as_float(v16 << 16);
}

/* One block per row entry (grid-stride). BF16: 16-byte copies. FP8: one warp per 128-channel block,
 * each lane 4 channels; scale = max(amax, 1e-4) / 448, q = e4m3_satfinite(x / scale) (as ll.cu). */
__global__ void __launch_bounds__(NET_THREADS)
    rows_kernel(const epd_k_net_row_t *rows, uint32_t n, uint32_t H, int fp8) {
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
    const epd_k_net_row_t r = rows[i];
    if (r.src_scales) { /* FP8 row and scales, as they are */
      const int4 *s = (const int4 *)r.src;
      int4 *d = (int4 *)r.dst;
      for (uint32_t v = tid; v < H / 16; v += NET_THREADS) d[v] = s[v];
      for (uint32_t g = tid; g < H / EPD_K_FP8_BLOCK; g += NET_THREADS)
        ((float *)r.scales)[g] = ((const float *)r.src_scales)[g];
      continue;
    }
    if (!fp8) {
      const int4 *s = (const int4 *)r.src;
      int4 *d = (int4 *)r.dst;
      for (uint32_t v = tid; v < H / 8; v += NET_THREADS) d[v] = s[v];
      continue;
    }
    const uint2 *s = (const uint2 *)r.src;
    for (uint32_t g = warp; g < H / EPD_K_FP8_BLOCK; g += NET_THREADS / 32) {
      uint2 raw = s[g * 32 + lane];
      float v0 = bf(raw.x & 0xffff), v1 = bf(raw.x >> 16), v2 = bf(raw.y & 0xffff), v3 = bf(raw.y >> 16);
      float scale;
      *(uint32_t *)((char *)r.dst + g * EPD_K_FP8_BLOCK + lane * 4) =
          epd_dev::fp8_group_warp(v0, v1, v2, v3, &scale);
      if (lane == 0) ((float *)r.scales)[g] = scale;
    }
  }
}

/* One block per output row (grid-stride); each thread 4 channels per pass. */
__global__ void __launch_bounds__(NET_THREADS)
    wsum_kernel(const uint32_t *off, const epd_k_net_term_t *terms, const uint64_t *out, uint32_t n,
                uint32_t H, int out_f32) {
  for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
    const uint32_t t0 = off[i], t1 = off[i + 1];
    for (uint32_t h = threadIdx.x * 4; h < H; h += NET_THREADS * 4) {
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      for (uint32_t t = t0; t < t1; t++) {
        const epd_k_net_term_t tm = terms[t];
        float v0, v1, v2, v3;
        if (tm.f32) {
          float4 v = *(const float4 *)((const float *)tm.src + h);
          v0 = v.x, v1 = v.y, v2 = v.z, v3 = v.w;
        } else {
          uint2 v = *(const uint2 *)((const uint16_t *)tm.src + h);
          v0 = bf(v.x & 0xffff), v1 = bf(v.x >> 16), v2 = bf(v.y & 0xffff), v3 = bf(v.y >> 16);
        }
        a0 = __fadd_rn(a0, __fmul_rn(tm.w, v0));
        a1 = __fadd_rn(a1, __fmul_rn(tm.w, v1));
        a2 = __fadd_rn(a2, __fmul_rn(tm.w, v2));
        a3 = __fadd_rn(a3, __fmul_rn(tm.w, v3));
      }
      if (out_f32) {
        *(float4 *)((float *)out[i] + h) = make_float4(a0, a1, a2, a3);
      } else {
        __nv_bfloat162 lo = __floats2bfloat162_rn(a0, a1), hi = __floats2bfloat162_rn(a2, a3);
        uint2 v;
        v.x = *(uint32_t *)&lo;
        v.y = *(uint32_t *)&hi;
        *(uint2 *)((uint16_t *)out[i] + h) = v;
      }
    }
  }
}

__global__ void put_kernel(const epd_k_net_put_t *puts, uint32_t n) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    *(uint32_t *)puts[i].dst = puts[i].value;
}

uint32_t grid_for(uint32_t n) {
  return n < NET_MAX_GRID ? n : NET_MAX_GRID;
}

} /* namespace */

extern "C" epd_result_t epd_k_net_rows(const epd_k_net_row_t *rows, uint32_t n, uint32_t hidden, int fp8,
                                       void *stream) {
  if (!n) return EPD_OK;
  if (!rows || hidden % EPD_K_FP8_BLOCK) return EPD_ERR_INVALID;
  rows_kernel<<<grid_for(n), NET_THREADS, 0, (cudaStream_t)stream>>>(rows, n, hidden, fp8);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_net_wsum(const uint32_t *off, const epd_k_net_term_t *terms,
                                       const uint64_t *out, uint32_t n, uint32_t hidden, int out_f32,
                                       void *stream) {
  if (!n) return EPD_OK;
  if (!off || !out || hidden % 4) return EPD_ERR_INVALID;
  wsum_kernel<<<grid_for(n), NET_THREADS, 0, (cudaStream_t)stream>>>(off, terms, out, n, hidden, out_f32);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_net_put(const epd_k_net_put_t *puts, uint32_t n, void *stream) {
  if (!n) return EPD_OK;
  if (!puts) return EPD_ERR_INVALID;
  put_kernel<<<grid_for((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(puts, n);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_net_preload(void) {
  return epd_dev::preload(rows_kernel, wsum_kernel, put_kernel) == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_gin_probe(struct ncclComm *world, int *contexts, int *type, char *err,
                                        size_t errlen) {
  ncclDevCommRequirements_t req;
  epd_dev::dev_comm_requirements_init(&req);
  req.ginContextCount = 1;
  ncclDevComm_t dev;
  *contexts = *type = 0;
  const ncclResult_t nr = ncclDevCommCreate(world, &req, &dev);
  if (nr == ncclInvalidUsage) {
    /* NCCL 2.28 refuses the request where its network has no GIN ("GIN not supported"). No second try
     * without GIN: that is another collective call, and a rank NCCL let through would wait in the first */
    const char *le = ncclGetLastError(world);
    snprintf(err, errlen, "%s", le && *le ? le : "invalid usage");
    *type = -1;
    return EPD_OK;
  }
  if (nr != ncclSuccess) {
    snprintf(err, errlen, "ncclDevCommCreate with a GIN context: %s", ncclGetErrorString(nr));
    return EPD_ERR_NCCL;
  }
  *contexts = dev.ginContextCount;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  *type = dev.ginContextCount && dev.ginConnectionCount ? dev.ginNetDeviceTypes[0] : 0;
#else
  *type = dev.ginContextCount ? dev.ginTypes[0] : 0;
#endif
  ncclDevCommDestroy(world, &dev);
  return EPD_OK;
}
