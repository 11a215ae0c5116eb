/*
 * doorbell.cu - how fast can a client and the daemon's persistent kernel signal each other on one GPU?
 * Measures the primitives of the queue protocol, in host-mapped memory (where the queue lives today)
 * and in device memory:
 *   pingpong   two resident kernels bounce a counter (one thread each): round trip
 *   memop      a stream's cuStreamWriteValue32 -> a resident kernel sees it and answers -> the stream's
 *              cuStreamWaitValue32 sees the answer: round trip (the stream-memop submission path)
 *   memop+desc the same with the 8 descriptor words written before the state word (what libepd does)
 *   poll32     pingpong where the poller reads 32 strided slot states per poll (the persistent kernel)
 * Usage: epd-bench-doorbell [iters]   (one GPU; prints one line per case, µs per round trip p50-style mean)
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
#define CU(x)                                                        \
  do {                                                               \
    CUresult r_ = (x);                                               \
    if (r_ != CUDA_SUCCESS) {                                        \
      const char *s_ = "?";                                          \
      cuGetErrorString(r_, &s_);                                     \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
      exit(1);                                                       \
    }                                                                \
  } while (0)

static __device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
static __device__ __forceinline__ uint32_t ld_acq_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
static __device__ __forceinline__ void st_rel_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Wait for *p == v (1 thread), with a 2 s timeout; returns 0 on timeout. */
static __device__ int wait_eq(const uint32_t *p, uint32_t v) {
  const uint64_t t0 = now_ns();
  while (ld_acq_sys(p) != v)
    if (now_ns() - t0 > 200000000ull) return 0;
  return 1;
}

/* side 0 starts: writes a=i, waits b==i. side 1 waits a==i, writes b=i. */
__global__ void pingpong(uint32_t *a, uint32_t *b, int side, int iters, int *ok, unsigned long long *ns) {
  if (threadIdx.x) return;
  const uint64_t t0 = now_ns();
  for (int i = 1; i <= iters; i++) {
    if (side == 0) {
      st_rel_sys(a, i);
      if (!wait_eq(b, i)) {
        *ok = 0;
        return;
      }
    } else {
      if (!wait_eq(a, i)) {
        *ok = 0;
        return;
      }
      st_rel_sys(b, i);
    }
  }
  if (side == 0 && ns) *ns = now_ns() - t0;
}

/* The poller of the memop cases: waits state==i, answers done=i. `stride` words apart, 32 lanes read
 * 32 slot states per poll like the persistent kernel when poll32 is set. */
__global__ void answerer(uint32_t *state, uint32_t *done, int iters, int poll32, int stride, int *ok) {
  const uint32_t lane = threadIdx.x;
  for (int i = 1; i <= iters; i++) {
    const uint64_t t0 = now_ns();
    for (;;) {
      uint32_t v = 0;
      if (poll32)
        v = *(volatile uint32_t *)(state + (size_t)lane * stride);
      else if (lane == 0)
        v = *(volatile uint32_t *)state;
      const uint32_t m = __ballot_sync(0xffffffffu, v == (uint32_t)i);
      if (m) break;
      if (now_ns() - t0 > 200000000ull) {
        if (lane == 0) *ok = 0;
        return;
      }
    }
    __threadfence_system();
    if (lane == 0) st_rel_sys(done, i);
    __syncwarp();
  }
}

/* kernel submission: a 1-warp kernel writes (desc and) state, and another (or the same) waits for done. */
__global__ void k_submit(uint32_t *state, uint64_t *desc, uint32_t i) {
  if (threadIdx.x < 8 && desc) desc[threadIdx.x] = ((uint64_t)i << 8) | threadIdx.x;
  __syncwarp();
  if (threadIdx.x == 0) {
    __threadfence_system();
    st_rel_sys(state, i);
  }
}
__global__ void k_wait(const uint32_t *done, uint32_t i, int *ok) {
  if (threadIdx.x == 0 && !wait_eq(done, i)) *ok = 0;
}
__global__ void k_both(uint32_t *state, uint64_t *desc, const uint32_t *done, uint32_t i, int *ok) {
  if (threadIdx.x < 8 && desc) desc[threadIdx.x] = ((uint64_t)i << 8) | threadIdx.x;
  __syncwarp();
  if (threadIdx.x == 0) {
    __threadfence_system();
    st_rel_sys(state, i);
    if (!wait_eq(done, i)) *ok = 0;
  }
}
__global__ void k_empty() {}

/* One timed case: two streams (s0 the client's, s1 the answerer's), an ok flag, events around s0's work. */
struct Case {
  cudaStream_t s0, s1;
  int *ok;
  cudaEvent_t e0, e1;
};
static void case_begin(Case &c, uint32_t *state, uint32_t *done) {
  CK(cudaStreamCreateWithFlags(&c.s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&c.s1, cudaStreamNonBlocking));
  CK(cudaMallocManaged(&c.ok, sizeof(int)));
  *c.ok = 1;
  CK(cudaMemset(state, 0, 4));
  CK(cudaMemset(done, 0, 4));
  CK(cudaDeviceSynchronize());
  CK(cudaEventCreate(&c.e0));
  CK(cudaEventCreate(&c.e1));
}
/* µs per iteration of s0's work between the events, -1 if a wait failed. */
static double case_end(Case &c, int iters) {
  CK(cudaEventRecord(c.e1, c.s0));
  CK(cudaDeviceSynchronize());
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, c.e0, c.e1));
  double r = *c.ok ? ms * 1000.0 / iters : -1;
  CK(cudaEventDestroy(c.e0));
  CK(cudaEventDestroy(c.e1));
  CK(cudaStreamDestroy(c.s0));
  CK(cudaStreamDestroy(c.s1));
  CK(cudaFree(c.ok));
  return r;
}

/* kernels instead of stream memops: mode 0 = submit kernel + wait kernel, 1 = one kernel, 2 = empty
 * kernels only (the launch gap), 3 = submit kernel + wait memop */
static double kern(uint32_t *state, uint32_t *done, uint64_t *desc, int iters, int mode) {
  Case c;
  case_begin(c, state, done);
  cudaStream_t s0 = c.s0;
  int *ok = c.ok;
  if (mode != 2) answerer<<<1, 32, 0, c.s1>>>(state, done, iters, 0, 32, ok);
  CK(cudaEventRecord(c.e0, s0));
  for (int i = 1; i <= iters; i++) {
    if (i % 256 == 0) { /* a failed wait costs its timeout each time: stop at the first */
      CK(cudaStreamSynchronize(s0));
      if (!*ok) break;
    }
    if (mode == 0) {
      k_submit<<<1, 32, 0, s0>>>(state, desc, i);
      k_wait<<<1, 32, 0, s0>>>(done, i, ok);
    } else if (mode == 1) {
      k_both<<<1, 32, 0, s0>>>(state, desc, done, i, ok);
    } else if (mode == 2) {
      k_empty<<<1, 32, 0, s0>>>();
      k_empty<<<1, 32, 0, s0>>>();
    } else {
      k_submit<<<1, 32, 0, s0>>>(state, desc, i);
      CU(cuStreamWaitValue32((CUstream)s0, (CUdeviceptr)done, i, CU_STREAM_WAIT_VALUE_EQ));
    }
  }
  return case_end(c, iters);
}

static double pp(uint32_t *a, uint32_t *b, int iters) {
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  int *ok;
  unsigned long long *ns;
  CK(cudaMallocManaged(&ok, sizeof(int)));
  CK(cudaMallocManaged(&ns, sizeof(*ns)));
  *ok = 1;
  *ns = 0;
  CK(cudaMemset(a, 0, 4));
  CK(cudaMemset(b, 0, 4));
  CK(cudaDeviceSynchronize());
  pingpong<<<1, 32, 0, s1>>>(a, b, 1, iters, ok, ns);
  pingpong<<<1, 32, 0, s0>>>(a, b, 0, iters, ok, ns);
  CK(cudaDeviceSynchronize());
  double r = *ok ? (double)*ns / iters / 1000.0 : -1;
  CK(cudaStreamDestroy(s0));
  CK(cudaStreamDestroy(s1));
  CK(cudaFree(ok));
  CK(cudaFree(ns));
  return r;
}

/* memop cases: a stream writes (desc words then) state=i, waits done==i; a resident kernel answers. */
static double memop(uint32_t *state, uint32_t *done, uint64_t *desc, int iters, int poll32, int stride) {
  Case c;
  case_begin(c, state, done);
  answerer<<<1, 32, 0, c.s1>>>(state, done, iters, poll32, stride, c.ok);
  CK(cudaEventRecord(c.e0, c.s0));
  for (int i = 1; i <= iters; i++) {
    CUstreamBatchMemOpParams ops[10];
    memset(ops, 0, sizeof ops);
    unsigned n = 0;
    if (desc)
      for (int w = 0; w < 8; w++, n++) {
        ops[n].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        ops[n].writeValue.address = (CUdeviceptr)(desc + w);
        ops[n].writeValue.value64 = ((uint64_t)i << 8) | w;
      }
    ops[n].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    ops[n].writeValue.address = (CUdeviceptr)state;
    ops[n].writeValue.value = i;
    n++;
    ops[n].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    ops[n].waitValue.address = (CUdeviceptr)done;
    ops[n].waitValue.value = i;
    ops[n].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
    n++;
    CU(cuStreamBatchMemOp((CUstream)c.s0, n, ops, 0));
  }
  return case_end(c, iters);
}

int main(int argc, char **argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 2000;
  setvbuf(stdout, NULL, _IOLBF, 0);
  CK(cudaSetDevice(0));
  CU(cuInit(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int stride = 32; /* 128-byte slots, as epd_slot_t */
  const size_t bytes = 4096 * 4;
  uint32_t *h = NULL, *hd = NULL, *d = NULL;
  CK(cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  memset(h, 0, bytes);
  CK(cudaHostGetDevicePointer(&hd, h, 0));
  CK(cudaMalloc(&d, bytes));
  CK(cudaMemset(d, 0, bytes));
  /* Load every kernel before any of them spins: with lazy loading, the first launch of a kernel waits
   * for the kernels running in the context, i.e. for the spinning answerer (a deadlock until timeout). */
  {
    int *ok;
    CK(cudaMallocManaged(&ok, sizeof(int)));
    CK(cudaMemset(d, 0, 16));
    k_submit<<<1, 32>>>(d, NULL, 1);
    k_wait<<<1, 32>>>(d, 1, ok);
    k_both<<<1, 32>>>(d + 1, NULL, d + 1, 1, ok);
    k_empty<<<1, 32>>>();
    answerer<<<1, 32>>>(d + 2, d + 3, 0, 0, 1, ok);
    pingpong<<<1, 32>>>(d + 2, d + 3, 0, 0, ok, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaFree(ok));
    CK(cudaMemset(d, 0, bytes));
  }
  printf("# device %s, iters %d\n", prop.name, iters);
  printf("case,memory,us_per_round_trip\n");
  const char *mem[2] = {"host-mapped", "device"};
  for (int m = 0; m < 2; m++) {
    uint32_t *base = m ? d : hd;
    printf("pingpong,%s,%.3f\n", mem[m], pp(base, base + 1024, iters));
    printf("memop,%s,%.3f\n", mem[m], memop(base, base + 1024, NULL, iters, 0, stride));
    printf("memop+desc,%s,%.3f\n", mem[m],
           memop(base, base + 1024, (uint64_t *)(base + 2048), iters, 0, stride));
    printf("memop+desc+poll32,%s,%.3f\n", mem[m],
           memop(base, base + 1024, (uint64_t *)(base + 2048), iters, 1, stride));
    uint64_t *dd = (uint64_t *)(base + 2048);
    printf("kernel submit+kernel wait,%s,%.3f\n", mem[m], kern(base, base + 1024, dd, iters, 0));
    printf("one kernel submit+wait,%s,%.3f\n", mem[m], kern(base, base + 1024, dd, iters, 1));
    printf("kernel submit+memop wait,%s,%.3f\n", mem[m], kern(base, base + 1024, dd, iters, 3));
  }
  printf("two empty kernels (launch gaps),-,%.3f\n", kern(d, d + 1024, NULL, iters, 2));
  /* mixed: the answer through device memory, the submission through host memory and back */
  printf("memop+desc,state host/done device,%.3f\n",
         memop(hd, d + 1024, (uint64_t *)(hd + 2048), iters, 0, stride));
  printf("memop+desc,state device/done host,%.3f\n",
         memop(d, hd + 1024, (uint64_t *)(d + 2048), iters, 0, stride));
  CK(cudaFreeHost(h));
  CK(cudaFree(d));
  return 0;
}
