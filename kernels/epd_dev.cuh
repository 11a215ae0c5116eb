/*
 * epd_dev.cuh - small device helpers shared by the epd kernels (timers, system- and GPU-scope flag
 * accesses, BF16 packing), and the host-side pieces their launchers share (error text, device
 * communicator and LSA team checks, the geometry part of a kernel's parameters). Header-only: include
 * it from kernels/*.cu only.
 */
#ifndef EPD_DEV_CUH
#define EPD_DEV_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stdint.h>
#include <stdio.h>

#include "epd_kernels.h"

namespace epd_dev {

__host__ __device__ inline uint64_t align_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

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
/* GPU-scope flag accesses (writer and reader on the same GPU). */
__device__ __forceinline__ uint64_t ld_acquire_gpu_u64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_gpu_u32(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu_u32(uint32_t *p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
/* Streaming 16-byte load of read-only input (no L1 allocation). */
__device__ __forceinline__ int4 ld_nc_v4(const void *p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
/* ---- bulk-copy engine (TMA) and mbarrier helpers (sm_90) ---- */
constexpr uint32_t SMEM_MAX =
    223u * 1024u; /* dynamic shared memory per block (sm_90: 227 KiB with the static) */
__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, "
      "p;\n}"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
/* Wait for the phase of `parity` to complete, or the deadline (false). */
__device__ __forceinline__ bool mbar_wait(uint64_t *bar, uint32_t parity, uint64_t deadline) {
  while (!mbar_try_wait(bar, parity))
    if (gtimer() > deadline) return false;
  return true;
}
__device__ __forceinline__ void tma_load(void *sdst, const void *gsrc, uint32_t bytes, uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(sdst)),
      "l"(gsrc), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void tma_store(void *gdst, const void *ssrc, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst), "r"(smem_u32(ssrc)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
/* Wait until at most n (1, 2 or 4) bulk groups still read shared memory. */
__device__ __forceinline__ void tma_wait_read(uint32_t n) {
  if (n >= 4)
    asm volatile("cp.async.bulk.wait_group.read 4;" ::: "memory");
  else if (n >= 2)
    asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}
__device__ __forceinline__ void tma_wait_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
/* Every bulk store of this thread complete, and ordered before its later generic-proxy accesses. */
__device__ __forceinline__ void tma_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ float bf16_to_f(uint32_t v16) {
  return __uint_as_float(v16 << 16);
}
/* ---- FP8 e4m3 quantisation of a 128-channel group (SEMANTICS.md: scale = max(amax, 1e-4) / 448,
 * q = e4m3_satfinite_rne(x / scale), both divisions IEEE) without a division: the kernels' quantisers
 * are bound by their instructions (HT FP8 dispatch on 24 SMs). epd_k_fp8_check compares every result
 * with __fdiv_rn for every BF16 amax and every BF16 x of a group with that amax. ---- */

/* RN(max(amax, 1e-4) / 448): the product with c = RN(1/448) is within an ulp, one FMA with the exact
 * residual corrects it (Markstein); +inf stays +inf. */
__device__ __forceinline__ float fp8_scale(float amax) {
  const float a = fmaxf(amax, EPD_K_FP8_AMAX_MIN), c = 1.0f / EPD_K_FP8_MAX;
  const float q = __fmul_rn(a, c);
  const float s = __fmaf_rn(__fmaf_rn(-q, EPD_K_FP8_MAX, a), c, q);
  return a <= FLT_MAX ? s : a;
}
/* What a group's quotients need of its scale, computed once per group: its reciprocal (the hardware's
 * approximation, within an ulp by PTX's bound, and one Newton step: RN(1/scale) for every scale a BF16 amax
 * gives, as a CPU emulation from any start within 2 ulp shows, and the quotient's correction
 * would absorb an ulp anyway; 0 for an infinite scale), and the scale for the residual (0 for an
 * infinite scale, so that finite x / inf comes out as a zero of x's sign and inf / inf as NaN, as the
 * division gives). */
struct Fp8Div {
  float inv, res;
};
__device__ __forceinline__ Fp8Div fp8_div(float scale) {
  float r0;
  asm("rcp.approx.f32 %0, %1;" : "=f"(r0) : "f"(scale));
  const float r1 = __fmaf_rn(r0, __fmaf_rn(-scale, r0, 1.0f), r0);
  const bool fin = scale <= FLT_MAX;
  return {fin ? r1 : 0.f, fin ? scale : 0.f};
}
/* x / scale rounded to nearest even, as IEEE division, in three instructions: q0 = x * inv is close, the
 * FMA with the exact residual x - q0 * scale (computed negated, which keeps a zero's sign: -0 / scale is
 * -0) corrects it (Markstein); NaN stays NaN. Exact for the quantiser's inputs by exhaustion
 * (epd_k_fp8_check), not by a proof for every float. */
__device__ __forceinline__ float fp8_quot(float x, Fp8Div d) {
  const float q0 = __fmul_rn(x, d.inv);
  return __fmaf_rn(-__fmaf_rn(q0, d.res, -x), d.inv, q0);
}
/* The e4m3 bytes (satfinite) of v0..v3 / scale, in memory order. */
__device__ __forceinline__ uint32_t fp8_quant4(float v0, float v1, float v2, float v3, Fp8Div d) {
  const __nv_fp8x2_storage_t a =
      __nv_cvt_float2_to_fp8x2(make_float2(fp8_quot(v0, d), fp8_quot(v1, d)), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t b =
      __nv_cvt_float2_to_fp8x2(make_float2(fp8_quot(v2, d), fp8_quot(v3, d)), __NV_SATFINITE, __NV_E4M3);
  return (uint32_t)a | ((uint32_t)b << 16);
}
/* A 128-channel group quantised by one warp, 4 values per lane (the LL and scale-out kernels): the
 * group's amax over the 32 lanes, its scale (*scale, every lane) and this lane's 4 e4m3 bytes. */
__device__ __forceinline__ uint32_t fp8_group_warp(float v0, float v1, float v2, float v3, float *scale) {
  float amax = fmaxf(fmaxf(fabsf(v0), fabsf(v1)), fmaxf(fabsf(v2), fabsf(v3)));
#pragma unroll
  for (int sh = 16; sh > 0; sh >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, sh));
  *scale = fp8_scale(amax);
  return fp8_quant4(v0, v1, v2, v3, fp8_div(*scale));
}
__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *(uint32_t *)&h;
}

/* ---- host side of the launchers ---------------------------------------------------------------- */

/* err gets fmt formatted with (what, a, b) where the caller gave room for it; returns r. */
static inline epd_result_t set_err(char *err, size_t errlen, epd_result_t r, const char *fmt,
                                   const char *what, long a, long b) {
  if (err && errlen) snprintf(err, errlen, fmt, what, a, b);
  return r;
}

/* Blocks of `kernel` (threads each, smem bytes of dynamic shared memory) one SM of `device` keeps
 * resident at once, and the device's SMs in *nsm (0 where a query fails; the caller clears the error).
 * Kernels whose blocks wait for one another need all of theirs resident: *nsm x this. */
template <typename Kernel>
static inline int resident_per_sm(Kernel kernel, int device, int threads, size_t smem, int *nsm) {
  int per = 0;
  *nsm = 0;
  cudaDeviceGetAttribute(nsm, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, threads, smem);
  return per;
}

/* Requirements of a device communicator with nothing asked for: NCCL 2.29+ versions the struct (size,
 * magic and version first, from its initializer, whose default asks for GIN contexts: none here); 2.28
 * has no initializer and takes a zeroed struct. */
static inline void dev_comm_requirements_init(ncclDevCommRequirements_t *req) {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  const ncclDevCommRequirements_t init = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
  *req = init;
  req->ginContextCount = 0;
#else
  memset(req, 0, sizeof *req);
#endif
}

/* Load kernels now. Under CUDA's lazy loading (the default) a kernel's first launch loads it, and that
 * waits for the kernels running in its context: with ranks sharing a GPU (one context for all of them in
 * a process) a rank's first launch of a kernel would wait for another rank's kernel, which waits for it
 * until its timeout. */
template <typename... Kernel>
static inline cudaError_t preload(Kernel... kernel) {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  ((e = e != cudaSuccess ? e : cudaFuncGetAttributes(&a, kernel)), ...);
  return e;
}

/* ncclDevCommCreate of a kernel context; EPD_ERR_NCCL (err says why) when it fails. */
static inline epd_result_t dev_comm_create(ncclComm_t comm, const ncclDevCommRequirements_t *req,
                                           ncclDevComm_t *dev, char *err, size_t errlen) {
  ncclResult_t nr = ncclDevCommCreate(comm, req, dev);
  if (nr == ncclSuccess) return EPD_OK;
  if (err && errlen)
    snprintf(err, errlen, "ncclDevCommCreate failed: %s (the communicator may lack device API support)",
             ncclGetErrorString(nr));
  return EPD_ERR_NCCL;
}

/* EPD_OK if the LSA team of dev is the geometry's (num_ranks ranks, this one at rank), else
 * EPD_ERR_INVALID (err says both). */
static inline epd_result_t check_lsa_team(const ncclDevComm_t *dev, uint32_t num_ranks, uint32_t rank,
                                          char *err, size_t errlen) {
  if ((uint32_t)dev->lsaSize == num_ranks && (uint32_t)dev->lsaRank == rank) return EPD_OK;
  if (err && errlen)
    snprintf(err, errlen, "LSA team is %d ranks with this one at %d, geometry says %u ranks, rank %u",
             dev->lsaSize, dev->lsaRank, num_ranks, rank);
  return EPD_ERR_INVALID;
}

/* The parts of a kernel's parameters that come from its context: window, layout and geometry (LL and HT
 * alike; HT's capacity is its own). */
template <typename Params, typename Ctx>
static inline void params_from_ctx(Params &p, const Ctx *k) {
  p.win = k->win;
  p.win_off = k->win_off;
  p.local = k->local;
  p.lay = k->lay;
  p.R = k->g.num_ranks;
  p.rank = k->g.rank;
  p.E = k->g.num_experts;
  p.H = k->g.hidden;
  p.K = k->g.topk;
  p.M = k->g.max_tokens;
  p.S = k->g.slots_per_rank;
  p.G = k->g.blocks;
}

/* A token's renormalisation (EPD_K_RENORMALIZE), a warp per token, lanes = its top-k columns (w: the
 * lane's weight): the factor of the weights of the entries it keeps, the sum of its valid entries' weights
 * (counted) over the sum of those kept (valid); 1 where it kept nothing. Sums in double, as the reference
 * plan (epd_ref_plan_build). */
__device__ __forceinline__ float renorm_factor(bool counted, bool valid, float w) {
  double all = counted ? (double)w : 0.0, kept = valid ? (double)w : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    all += __shfl_xor_sync(0xffffffffu, all, o);
    kept += __shfl_xor_sync(0xffffffffu, kept, o);
  }
  return kept != 0.0 ? (float)(all / kept) : 1.0f;
}

} /* namespace epd_dev */

#endif
