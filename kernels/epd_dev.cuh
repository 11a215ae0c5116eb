/*
 * epd_dev.cuh - small device helpers shared by the epd kernels (timers, system-scope flag accesses,
 * BF16 packing). Header-only, internal linkage: include it from kernels/*.cu only.
 */
#ifndef EPD_DEV_CUH
#define EPD_DEV_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace epd_dev {

__host__ __device__ inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* Nanoseconds from the GPU's global timer (deadlines of spin-waits). */
__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/* Streaming 16-byte load of read-only input (no L1 allocation). */
__device__ __forceinline__ int4 ld_nc_v4(const void *p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float bf16_to_f(uint32_t v16) { return __uint_as_float(v16 << 16); }
__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *(uint32_t *)&h;
}

} /* namespace epd_dev */

#endif
