/*
 * cuda_be.h - the CUDA backend's own state, shared by its set-up and clients (engine_cuda.c), its launch mode
 * (launch.c) and its persistent mode (persistent.c): clients, groups and ranks as the backend sees them. Not
 * for other layers. Functions marked (mu) run with the engine mutex held.
 */
#ifndef EPD_CUDA_BE_H
#define EPD_CUDA_BE_H

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>

#include "core/engine_internal.h"
#include "cuda/cuda_comm.h"
#include "cuda/engine_cuda_net.h"
#include "epd_kernels.h"

#define SPIN_POLLS 256
#define SHORT_SLEEP_NS 2000
#define LONG_SLEEP_NS 200000
#define IDLE_AFTER_NS 100000000ull
#define LAUNCH_QUIET_NS 20000000ull /* 20 ms */
/* LL blocks per group in persistent mode (engine.ll_blocks overrides) */
#define EPD_CUDA_PERSIST_BLOCKS 64u

enum { MODE_LAUNCH = 0, MODE_PERSISTENT = 1 };
enum { PH_COLLECT = 0, PH_RUN = 1 };
/* Persistent state of a group: launch mode owns it, its kernels run, or they were told to stop. */
enum { PS_OFF = 0, PS_RUN = 1, PS_STOP = 2 };

/* Driver entry points (resolved through the runtime, no libcuda link). */
#define CU_FUNCS(X)                                                                                         \
  X(cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
  X(cuMemGetAllocationGranularity,                                                                          \
    (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                              \
  X(cuMemExportToShareableHandle,                                                                           \
    (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long))                  \
  X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                  \
  X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))              \
  X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                                 \
  X(cuMemUnmap, (CUdeviceptr, size_t))                                                                      \
  X(cuMemRelease, (CUmemGenericAllocationHandle))                                                           \
  X(cuMemAddressFree, (CUdeviceptr, size_t))                                                                \
  X(cuStreamWriteValue64, (CUstream, CUdeviceptr, cuuint64_t, unsigned int))                                \
  X(cuGetErrorString, (CUresult, const char **))

typedef struct cuda_driver {
#define X(name, args) CUresult(*name) args;
  CU_FUNCS(X)
#undef X
} cuda_driver_t;
extern cuda_driver_t cu; /* engine_cuda.c: resolved once at the first create */

/* A client's memory and progress, owned by the backend. Outlives its eng_client_t while a step it
 * joined is still running on the GPU (then the rank thread frees it). */
typedef struct cuda_client {
  epd_queue_t *queue; /* host mapping of the queue memfd */
  uint64_t queue_bytes;
  int queue_registered;
  uint64_t queue_dev;
  int device;
  CUmemGenericAllocationHandle arena_h;
  CUdeviceptr arena_dev;
  size_t arena_size; /* rounded to the allocation granularity */
  int queue_fd, arena_fd;
  uint32_t next_slot;
  int peer_access;    /* every GPU of the daemon may access the arena (weight copies) */
  uint64_t dq_offset; /* the queue's device twin in the arena (include/epd/epd_abi.h) */
  int busy;           /* joined a step that has not finished on this rank */
  int dead;           /* its eng_client_t is gone: free when no longer busy */
  struct cuda_client *next_dead;
} cuda_client_t;

/* Per (group, rank) device state: staging window, kernel context, expert map table. */
typedef struct cuda_grank {
  int ready;
  epd_k_ll_t *k;
  epd_k_ht_t *kh; /* HT kernels (NULL where the geometry exceeds the HT limits) */
  void *map_dev;
  uint64_t map_gen; /* the map image uploaded (cuda_grp_t.map_img_gen) */
  /* masked ranks: this rank's top-k of a dispatch, copied after the kernel to count the dropped entries */
  int64_t *topk_host;
  size_t topk_cap;
  uint32_t dropped;
  epd_comp_t *comp_host; /* pinned, mapped: the kernel writes it */
  epd_comp_t *comp_dev;
  cudaEvent_t ev;
  /* persistent mode */
  epd_k_pctl_t *pctl, *pctl_dev; /* host-mapped control block (host writes) */
  uint64_t *dlimit;              /* device word: the kernel's stop index (stream memory operations) */
  cudaStream_t cstream;          /* carries every write of dlimit, in order (never behind the kernel) */
  cudaEvent_t cev;               /* the kernel's launch waits for its start value on cstream */
  int device;
  epd_k_pprog_t *pprog, *pprog_dev; /* host-mapped progress block (kernel writes) */
  cudaStream_t pstream;
  cudaEvent_t pev;                /* recorded after the persistent kernel */
  int prun;                       /* launched, not yet seen returned */
  struct cuda_client *pcc;        /* the client its kernel serves (kept busy) */
  uint64_t pacct;                 /* its ops accounted */
  uint64_t pwatch_ann, pwatch_ns; /* watchdog: announcements seen, since when a slot waits untaken */
} cuda_grank_t;

/* Backend state of one group (eng_group_t has no backend pointer: see cuda_grp_find). */
typedef struct cuda_grp {
  eng_group_t *grp; /* NULL once the group is gone (then freed when every rank let go) */
  int used;
  char name[EPD_GROUP_NAME_MAX];
  epd_ref_geom_t g;
  uint64_t off[EPD_NUM_BANKS][EPD_BUF_KINDS]; /* arena layout (fixed per group) */
  int renorm; /* the group's renormalize: its dispatches with ranks masked say EPD_K_RENORMALIZE */
  int phase;
  uint64_t run_seq;
  uint64_t step;
  int status, peer; /* host-side verdict of the step (0: launch) */
  char why[160];
  epd_desc_t desc[EPD_MAX_RANKS];
  cuda_client_t *cc[EPD_MAX_RANKS];
  int arrived[EPD_MAX_RANKS], launched[EPD_MAX_RANKS], finished[EPD_MAX_RANKS];
  int reset_done[EPD_MAX_RANKS];
  uint32_t narrived, nfinished;
  int need_reset, setup_failed;
  int have_win;
  epd_cc_win_t win; /* the group's LL staging window on every rank */
  int have_hwin;
  epd_cc_win_t hwin; /* the group's HT staging window (capacity rows per bank) */
  uint64_t first_arrive_ns, last_arrive_ns;
  uint64_t arrive_ns[EPD_MAX_RANKS]; /* per rank, for the per-peer wait metric */
  uint32_t map_version;
  void *map_img; /* host image of the route map (epd_k_map_pack): the active map without masked ranks */
  uint32_t map_img_version;
  uint64_t map_img_mask, map_img_gen; /* the mask it was built with; bumped at every build */
  /* Masked ranks (docs/SEMANTICS.md): the kernels of a step need every rank of the team, so a masked
   * rank's part runs with no tokens (synth[r]: no client slot to complete) on the memory its last client
   * left (ghost[r], kept until the rank rejoins) or its hung client's; step_mask is the mask the step runs
   * with; bank_dropped the entries each rank's dispatch of a bank dropped (its combine reports them). */
  cuda_client_t *ghost[EPD_MAX_RANKS];
  int synth[EPD_MAX_RANKS];
  uint64_t step_mask;
  uint32_t bank_dropped[EPD_NUM_BANKS][EPD_MAX_RANKS];
  /* Map version of each bank's last LL dispatch, and the version the current op reports: a combine
   * reports its bank's dispatch version even when a later dispatch (other bank) switched the map. */
  uint32_t bank_map_version[EPD_NUM_BANKS], op_map_version;
  /* [LL/HT][bank]: the bank's last dispatch was refused on the host (no kernel ran, so the kernels' own
   * record of the bank's dispatch is an older one): its combine fails with EPD_ERR_STATE */
  uint8_t disp_refused[2][EPD_NUM_BANKS];
  /* persistent mode */
  int pstate; /* PS_* */
  int pfail;  /* a persistent launch failed: launch mode for good */
  int pnofit_logged;
  uint64_t pidx;                /* highest agreement index used (a launch starts above it) */
  uint64_t pstep0;              /* grp->steps at the launch */
  uint64_t pstop_ns;            /* when the stop was asked */
  int pabort;                   /* the abort word was set (the stop took too long) */
  uint64_t pwait_ann, pwait_ns; /* a rank announced index pwait_ann - 1 and waits for peers since pwait_ns */
  uint64_t pcarry_ns; /* first arrival carried into the launch-mode collection (host step timeout) */
  uint64_t plaunches;
  /* back-off: kernels that stopped before running any op (an HT-only group) are retried only after
   * 2^pzero launch-mode steps */
  uint32_t pzero;
  uint64_t presume_step;
  /* timeline of the ops run in persistent kernels since the last report (diagnostics, logged at stop) */
  uint64_t pst_n, pst_nseen, pst_seen, pst_agree, pst_run, pst_lat;
  uint64_t pst_opn[2], pst_phase[2][8]; /* per op kind (dispatch, combine): block 0's body timeline */
  cuda_grank_t rk[EPD_MAX_RANKS];
} cuda_grp_t;

typedef struct cuda_rank {
  epd_engine_t *eng;
  int rank, device;
  pthread_t th;
  int started;
  cudaStream_t stream;
  cudaStream_t copy_stream; /* expert-weight copies into this rank's arenas */
  /* The op in flight on this rank (one at a time: run order is what prevents cross-GPU deadlock). */
  cuda_grp_t *inflight;
  uint64_t launch_ns;
  cuda_client_t *dead; /* clients to free once idle */
  uint64_t bytes;      /* windows of this rank */
  void *scratch;
  long president; /* persistent kernel blocks this GPU keeps resident */
  int has_uuid;   /* uuid: the GPU's, told to clients (their ordinal for it may differ) */
  uint8_t uuid[16];
  long pblocks; /* blocks of the persistent kernels running on it */
  /* Launch-mode work of a group on this GPU: when it last wanted to launch (a persistent group of
   * another group resumes only after LAUNCH_QUIET_NS without it). */
  uint64_t last_launch_ns;
  const void *last_launch_grp;
} cuda_rank_t;

typedef struct cuda_be {
  atomic_int stop;
  int mode;
  int mps;
  int ndev;
  epd_cc_t *cc;
  uint64_t timeout_ns; /* per kernel wait: the engine's step timeout */
  uint64_t spin_ns;    /* rank threads spin without sleeping this long after activity (engine.idle_spin_ns) */
  uint32_t ll_blocks;  /* LL kernel blocks of every group (engine.ll_blocks or the mode's default) */
  uint32_t
      ht_ce_split; /* copies per dest rank of a copy-engine HT dispatch (engine.ht_ce_split; 0: default) */
  uint32_t ht_sms; /* HT data kernel blocks of every group (engine.ht_sms; 0: the kernels' default) */
  int share;       /* the most ranks one GPU holds (1: a GPU per rank; up to 4 share one) */
  cuda_rank_t rank[EPD_MAX_RANKS];
  uint64_t next_run_seq;
  uint32_t ngrp;
  cuda_grp_t *grp; /* [max_groups * 2]: a gone group's entry may linger while kernels finish */
  cnet_t *net;     /* scale-out (engine_cuda_net.c): it runs every step; NULL on one node */
} cuda_be_t;

/* ---- launch mode (launch.c) ---- */
/* (mu) Build the host image of the group's active map if it is not current; 0 when it is. */
int map_img_update(cuda_grp_t *cg, eng_group_t *grp);
/* (mu) Complete rank r's slot of the current step of cg from the kernel's completion and account it. */
void cuda_complete_rank(epd_engine_t *eng, cuda_grp_t *cg, int r, const epd_comp_t *kc);
/* (mu) Fail the step cg collects (status, the peer rank it names, why). */
void cuda_fail_collect(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int status, int peer,
                       const char *why);
/* (mu) Free what no step uses any more: dead clients, gone groups (rank thread rk). */
void cuda_reap(epd_engine_t *eng, cuda_be_t *be, cuda_rank_t *rk);
/* The thread of one GPU (a cuda_rank_t). */
void *cuda_rank_main(void *arg);

/* ---- the backend (engine_cuda.c) for launch.c ---- */
epd_result_t cuda_err(cudaError_t e, const char *what, char *err, size_t errlen);
void cuda_client_release(cuda_client_t *cc);
void cuda_grp_teardown(cuda_be_t *be, cuda_grp_t *cg);

/* ---- persistent mode (persistent.c) ---- */
/* (mu) 1 when cg may run its LL ops in persistent kernels now (every rank has a live client, steady
 * state, nothing else runs on the GPUs). */
int pers_eligible(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg);
/* (mu) Ask cg's persistent kernels to stop at the next slot boundary (why: logged). */
void pers_stop(cuda_grp_t *cg, uint64_t now, const char *why);
/* (mu) Rank thread of self_dev: keep the books of cg's persistent kernels, start or stop them; 1 when
 * something happened. */
int pers_poll(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *cg, int self_dev, uint64_t now);
/* (mu) Stop the persistent kernels of `only` (NULL: of every group) and wait until they returned. */
void pers_quiesce(epd_engine_t *eng, cuda_be_t *be, cuda_grp_t *only);
void pers_quiesce_all(epd_engine_t *eng, cuda_be_t *be);

#endif /* EPD_CUDA_BE_H */
