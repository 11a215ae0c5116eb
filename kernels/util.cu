/*
 * util.cu - small helper kernels for benchmarks and tests (launchers in epd_kernels.h).
 */
#include <cuda_runtime.h>

#include "epd_dev.cuh"

namespace {
/* Hold a stream until *flag >= value (a host-mapped word), or until timeout_ns passed. */
__global__ void gate_kernel(const volatile uint32_t *flag, uint32_t value, uint64_t timeout_ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    if (*flag >= value) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > timeout_ns) return;
  }
}
/* Nothing: the launch floor of a grid of the LL kernels' shape (bench_ll.c (f)). */
__global__ void __launch_bounds__(EPD_K_LL_THREADS) empty_kernel() {}
/* Rewrite rows [0, n_s) of each slot s (gridDim.x slots, `stride` bytes apart; n_s = counts[s], or
 * `fixed` without counts) with their own contents, so that they sit in L2 as a producer's fresh output
 * would (bench_ll (a'): the layer before the dispatch, the expert GEMM before the combine). */
__global__ void __launch_bounds__(512) rewrite_rows_kernel(char *base, const int32_t *counts, uint32_t fixed,
                                                           uint64_t stride, uint32_t rowb, uint32_t maxrows) {
  const int32_t c = counts ? counts[blockIdx.x] : (int32_t)fixed;
  const uint32_t n = c < 0 ? 0u : ((uint32_t)c < maxrows ? (uint32_t)c : maxrows);
  int4 *rows = (int4 *)(base + blockIdx.x * stride);
  const uint64_t nv = (uint64_t)n * rowb / 16;
  for (uint64_t i = threadIdx.x; i < nv; i += blockDim.x) {
    __stcg(rows + i, __ldcg(rows + i)); /* intrinsics: a plain x = x could be dropped as a no-op */
  }
}
/* epd_k_fp8_check: one thread per non-negative BF16 amax pattern, every BF16 x pattern that can be in a
 * group of that amax (|x| <= amax, or NaN: a group of NaNs alone has amax 0 where the max starts from 0,
 * NaN where it starts from the first value, and both give the same scale) for each. The reference side is
 * IEEE division with the same e4m3 conversion instruction (a NaN quotient counted as 0x7f, as the CPU
 * reference's conversion says): what is checked is the division-free arithmetic. */
__global__ void fp8_check_kernel(unsigned long long *acc) {
  const uint32_t ab = blockIdx.x * blockDim.x + threadIdx.x;
  if (ab >= 0x8000u) return;
  const float amax = epd_dev::bf16_to_f(ab);
  const float want_s = __fdiv_rn(fmaxf(amax, EPD_K_FP8_AMAX_MIN), EPD_K_FP8_MAX);
  const float got_s = epd_dev::fp8_scale(amax);
  unsigned long long nbad = 0, ncmp = 0, at = ~0ull;
  if (__float_as_uint(got_s) != __float_as_uint(want_s)) {
    nbad++;
    at = (unsigned long long)ab << 32 | 0x10000u;
  }
  const epd_dev::Fp8Div d = epd_dev::fp8_div(want_s);
  for (uint32_t x0 = 0; x0 < 0x10000u; x0 += 4) {
    float v[4];
    uint32_t want = 0, care = 0;
    for (int i = 0; i < 4; i++) {
      v[i] = epd_dev::bf16_to_f(x0 + i);
      if (fabsf(v[i]) <= amax || isnan(v[i])) care |= 0xffu << (8 * i); /* x can be in a group of this amax */
      const float q = __fdiv_rn(v[i], want_s);
      const uint32_t b = isnan(q) ? 0x7fu : (uint32_t)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
      want |= b << (8 * i);
    }
    ncmp += (unsigned long long)(__popc(care) / 8);
    const uint32_t got = epd_dev::fp8_quant4(v[0], v[1], v[2], v[3], d);
    for (int i = 0; i < 4; i++)
      if ((((got ^ want) & care) >> (8 * i)) & 0xffu) {
        nbad++;
        if (at == ~0ull) at = (unsigned long long)ab << 32 | (x0 + i);
      }
  }
  atomicAdd(&acc[0], nbad);
  atomicAdd(&acc[2], ncmp);
  if (nbad) atomicMin(&acc[1], at);
}
} /* namespace */

extern "C" epd_result_t epd_k_gate(const uint32_t *flag, uint32_t value, uint64_t timeout_ns, void *stream) {
  gate_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((const volatile uint32_t *)flag, value, timeout_ns);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_empty(uint32_t blocks, void *stream) {
  empty_kernel<<<blocks, EPD_K_LL_THREADS, 0, (cudaStream_t)stream>>>();
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_rewrite_rows(void *base, const int32_t *counts, uint32_t fixed, uint32_t slots,
                                           uint64_t stride, uint32_t row_bytes, uint32_t max_rows,
                                           void *stream) {
  if (!base || !slots || row_bytes % 16 || stride % 16) return EPD_ERR_INVALID;
  rewrite_rows_kernel<<<slots, 512, 0, (cudaStream_t)stream>>>((char *)base, counts, fixed, stride, row_bytes,
                                                               max_rows);
  return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
}

extern "C" epd_result_t epd_k_fp8_check(uint64_t *mismatches, uint64_t *compared, uint32_t *first_amax,
                                        uint32_t *first_x) {
  unsigned long long *d = NULL, h[3] = {0, ~0ull, 0};
  if (cudaMalloc((void **)&d, sizeof h) != cudaSuccess) return EPD_ERR_CUDA;
  cudaError_t ce = cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
  if (ce == cudaSuccess) {
    fp8_check_kernel<<<0x8000 / 256, 256>>>(d);
    ce = cudaGetLastError();
  }
  if (ce == cudaSuccess) ce = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  cudaFree(d);
  if (ce != cudaSuccess) return EPD_ERR_CUDA;
  *mismatches = h[0];
  *compared = h[2];
  *first_amax = h[1] == ~0ull ? 0u : (uint32_t)(h[1] >> 32);
  *first_x = h[1] == ~0ull ? 0u : (uint32_t)h[1];
  return EPD_OK;
}
