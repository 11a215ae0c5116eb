/*
 * epd_kernels.h - the launchers of the epd CUDA kernels: the ONE plain-C header host code includes.
 *
 * No C++ or NCCL device type crosses this header: NCCL handles are passed as their C pointer types
 * (struct ncclComm *, struct ncclWindow_vidmem *, both from nccl.h), streams as void * (cudaStream_t).
 *
 * LL (low-latency) data path, per rank of a node-local (LSA) team of R ranks:
 *   - an LL staging window (epd_k_ll_window_bytes), registered with ncclCommWindowRegister on every
 *     rank (same size, same order). Peers write tokens, routing metadata, combine partials and
 *     arrival flags into it through NVLink (ncclGetLsaPointer); it also holds this rank's private state.
 *   - the client IO arena: plain device memory of this rank (it need NOT be a window: the kernels only
 *     read inputs from and write outputs to the local arena). Its layout is given as byte offsets per
 *     (bank, EPD_BUF_* kind), see epd_k_arena_t.
 *   - the expert map: a device table (epd_k_map_bytes / epd_k_map_pack) passed by pointer to every
 *     dispatch, so the map can change between steps without rebuilding anything.
 *
 * Dispatch sends each token once per destination rank (with its routing metadata) into the staging of
 * that rank and expands it into the expert-major layout at the receiver; combine reduces a token's
 * local-expert partials (weighted, f32) at the expert rank and sends ONE BF16 partial per (token, expert
 * rank) back, summed in f32 at the source. Results follow docs/SEMANTICS.md.
 *
 * Synchronisation: every op on a bank exchanges per-block arrival flags carrying a per-block sequence
 * number kept on the device (so launches are graph-replayable and need no host step counter). Every wait
 * has a timeout: on expiry the op writes EPD_ERR_TIMEOUT and the rank waited for into the completion and
 * returns (never traps). After a failed op (timeout) the team's sequence numbers may disagree: quiesce
 * every rank and call epd_k_ll_reset on each before the next op.
 *
 * Completion: each op writes status, peer (or -1), num_recv and map_version of a device epd_comp_t
 * (other fields are left to the caller). All ranks of a team get the same status for a bad expert id.
 */
#ifndef EPD_KERNELS_H
#define EPD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"
#include "epd_abi.h"
#include "epd_kconfig.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ncclComm;          /* ncclComm_t */
struct ncclWindow_vidmem; /* ncclWindow_t */

/* Geometry of one LL group on one rank. Every rank of the team passes the same values except rank. */
typedef struct epd_k_ll_geom {
  uint32_t num_ranks;      /* R: ranks of the team (= LSA team), 1..EPD_K_MAX_RANKS */
  uint32_t rank;           /* this rank's index in the team (= its LSA rank) */
  uint32_t num_experts;    /* E: logical experts */
  uint32_t hidden;         /* H: a multiple of 128, <= EPD_K_MAX_HIDDEN */
  uint32_t topk;           /* K: 1..EPD_K_MAX_TOPK */
  uint32_t max_tokens;     /* M: tokens per rank per step, <= EPD_K_MAX_TOKENS */
  uint32_t slots_per_rank; /* S: physical expert slots per rank */
  uint32_t blocks;         /* CUDA blocks per LL kernel; 0: EPD_K_LL_BLOCKS (same on every rank) */
} epd_k_ll_geom_t;

#define EPD_K_OFF_NONE UINT64_MAX
/* A client IO arena: device base address and byte offset of each (bank, EPD_BUF_*) buffer. Kinds the LL
 * kernels use: X, TOPK_IDX, TOPK_WEIGHTS, LL_RECV_X, LL_RECV_SCALES (FP8 only), LL_RECV_COUNT,
 * LL_RECV_SRC, LL_Y, OUT. Shapes are those of include/epd/epd_abi.h with the geometry above. */
typedef struct epd_k_arena {
  uint64_t base;
  uint64_t off[EPD_NUM_BANKS][EPD_BUF_KINDS];
} epd_k_arena_t;

/* Bytes of the LL staging window for this geometry (both banks), a multiple of 4096. */
size_t epd_k_ll_window_bytes(const epd_k_ll_geom_t *g);

/* Device expert-map table: bytes for num_experts experts. */
size_t epd_k_map_bytes(uint32_t num_experts);
/* Fill a host image of the table (then copy it to the device). rep is [num_experts][rep_stride] pairs
 * of uint32 (rank, slot) (the layout of epd_replica_t rows); nrep[e] in 0..EPD_K_MAX_REPLICAS (0: no live
 * replica, the kernels drop the expert's entries). */
epd_result_t epd_k_map_pack(void *host_dst, uint32_t version, uint32_t num_experts, const uint8_t *nrep,
                            const uint32_t *rep, uint32_t rep_stride);
/* Fill a host image with the default map of SEMANTICS.md (expert e on rank e/ceil(E/R), slot
 * e%ceil(E/R)). */
void epd_k_map_default(void *host_dst, uint32_t version, uint32_t num_experts, uint32_t num_ranks);

/* Check the NCCL runtime takes the device API the kernels were built with (built with 2.28: 2.28.x;
 * with 2.29 or later: that version or newer); EPD_ERR_UNSUPPORTED with the version to install if not. */
epd_result_t epd_k_check_nccl_version(char *err, size_t errlen);
/* Open libnccl.so.2 (nccl_load.cu: the daemon is not linked with it): EPD_OK, or EPD_ERR_UNSUPPORTED with
 * err saying why and what to install. Every NCCL call loads it first anyway. */
epd_result_t epd_k_nccl_load(char *err, size_t errlen);
/* The NCCL runtime's version code (ncclGetVersion: 23203 for 2.32.3), 0 if it cannot say. */
int epd_k_nccl_version(void);

typedef struct epd_k_ll epd_k_ll_t;

/* Bind the LL kernels of one rank to its staging window. The calling thread's current device must be
 * the rank's GPU. lsa_comm: the node-local communicator; collective over it (ncclDevCommCreate): every
 * rank must call it at the same time (a thread per GPU). window: the registered staging window,
 * window_local: its local device address, window_offset: where the LL area starts in it (4096-aligned).
 * Zeroes the LL state (synchronously). */
epd_result_t epd_k_ll_create(const epd_k_ll_geom_t *g, struct ncclComm *lsa_comm,
                             struct ncclWindow_vidmem *window, void *window_local, size_t window_offset,
                             epd_k_ll_t **out, char *err, size_t errlen);
/* Release the device communicator (local). The window stays owned by the caller. */
void epd_k_ll_destroy(epd_k_ll_t *k);
/* Zero this rank's flags and sequence numbers, stream-ordered. Only when every rank is quiescent,
 * and on every rank before the next op (recovery after a timeout). */
epd_result_t epd_k_ll_reset(epd_k_ll_t *k, void *stream);

/* A dispatch flag of the daemon's own (not an EPD_DESC_* of the caller): a token that lost entries (their
 * expert has no replica in the map: masked ranks) has the weights of the entries it keeps scaled by the
 * sum of all its valid entries' weights over the sum of those it keeps (a group's renormalize; as
 * epd_ref_plan_build). LL and HT dispatch, launch mode. */
#define EPD_K_RENORMALIZE (1u << 31)

/* Parameters of one LL op. */
typedef struct epd_k_ll_op {
  uint32_t op;         /* EPD_OP_LL_DISPATCH or EPD_OP_LL_COMBINE */
  uint32_t flags;      /* EPD_DESC_* (dispatch: EPD_DESC_FP8), EPD_K_RENORMALIZE */
  uint32_t num_tokens; /* dispatch: tokens of x (<= max_tokens, else EPD_ERR_TOO_MANY_TOKENS on all ranks) */
  uint32_t bank;       /* 0..EPD_NUM_BANKS-1; a combine uses its dispatch's bank */
  uint64_t timeout_ns; /* per wait; 0: EPD_K_DEFAULT_TIMEOUT_NS */
  const void *map;     /* dispatch: device expert-map table (epd_k_map_pack) */
  uint64_t *slot_tokens; /* dispatch, optional (NULL): per local slot [S], += tokens received on success */
  epd_comp_t *comp; /* device completion record written by the op (status, peer, num_recv, map_version) */
  uint64_t *trace;  /* optional (NULL): 8 %globaltimer stamps of block 0 (start, sent, fenced, flagged,
                     * arrived, received, done) and [7] the last block's completion (profiling) */
} epd_k_ll_op_t;

/* Launch one LL op on `stream` for this rank. Host-side checks (bank, op, num_tokens range, NULL
 * pointers) return EPD_ERR_INVALID without launching; a launch failure returns EPD_ERR_CUDA. Device-side
 * outcomes (bad expert id, timeout) land in op->comp. */
epd_result_t epd_k_ll_launch(epd_k_ll_t *k, const epd_k_arena_t *arena, const epd_k_ll_op_t *op, void *stream,
                             char *err, size_t errlen);
/* ---- Persistent mode (the daemon's CUDA backend under MPS) ----
 * A kernel of the context's `blocks` blocks plus one controller block (blocks + 1 must be resident at
 * once, else EPD_ERR_INVALID) serves ONE client queue of one rank; every rank of the team runs one at the
 * same time (one per (group, rank)). The controller's first warp polls the ring from first_slot for a
 * SUBMITTED slot in the queue's device twin (include/epd/epd_abi.h; the first one in ring order from its
 * position, as the launch mode: a CUDA graph replays the same slots), releases it to the op blocks at
 * once and announces it to every rank through an announcement word per (index, rank) in the window; then
 * all ranks agree on the op: every rank runs it only if every rank announced the same LL op, bank and
 * FP8 flag for that index. The op blocks run the op's local part while the ranks agree (dispatch: the first
 * token's loads and routing; combine: the sums of this rank's own tokens, which stay on this GPU) and wait
 * for the verdict before their first store into a peer, so an op the ranks do not agree on leaves no trace in
 * any peer (each rank's agreement has its own deadline: when one rank times out waiting for an announcement
 * that another rank then sees, that rank runs the op and fails on its flag wait; the host resets the team
 * after a SYNC_TIMEOUT exit or when the ranks' op counts differ). Otherwise (a rank was told to stop, a slot
 * holds an op it does not run - HT, a bad bank, an unknown op, a dispatch flag other than FP8 - or the ops or
 * FP8 flags differ) EVERY rank stops at the same boundary and leaves its slot SUBMITTED for the host (which
 * runs it in launch mode and later relaunches the kernels with a fresh index). A rank also stops after an op
 * that failed with EPD_ERR_TIMEOUT or EPD_ERR_PEER (the team needs epd_k_ll_reset). An op's last block writes
 * the completion (status, peer, num_recv, map_version, step, user_tag, latency_ns = SUBMITTED seen on this
 * rank -> completion) in both copies of the slot, the queue header (sticky_error, map_version, steps_done)
 * and a progress record, then sets the slot DONE in the host copy and then in the twin (each after a
 * GPU-scope fence). The stop word
 * (`dlimit`) is device memory
 * (the host writes it with a stream memory operation: polled on every turn); the abort word and the
 * progress block are host-mapped memory (device addresses passed here). */
typedef struct epd_k_pctl {
  uint32_t abort; /* host: non-zero (1 + rank): flag waits give up at once with EPD_ERR_PEER naming rank */
  uint32_t pad[15];
} epd_k_pctl_t;

/* Why a persistent kernel stopped (epd_k_pprog_t.reason). */
enum {
  EPD_K_PEXIT_NONE = 0,
  EPD_K_PEXIT_LIMIT = 1, /* *dlimit reached, or ctl.abort set */
  EPD_K_PEXIT_OP =
      2, /* its slot holds an op the kernel does not run (HT, bad bank, unknown op or dispatch flag) */
  EPD_K_PEXIT_PEER = 3,        /* a peer (exit_peer) stopped at this index */
  EPD_K_PEXIT_MISMATCH = 4,    /* peer exit_peer announced another op, bank or FP8 flag */
  EPD_K_PEXIT_ERROR = 5,       /* its last op failed with EPD_ERR_TIMEOUT/EPD_ERR_PEER */
  EPD_K_PEXIT_SYNC_TIMEOUT = 6 /* peer exit_peer announced nothing for 4 x timeout_ns */
};

#define EPD_K_PREC 64 /* progress records kept (ring) */
typedef struct epd_k_prec {
  uint32_t op;
  int32_t status, peer;
  uint32_t num_recv;
  uint64_t latency_ns; /* SUBMITTED seen -> completion */
  uint64_t seq;        /* op number since the launch, + 1 */
  /* timeline (diagnostics): submit stamp -> seen (only when the client put its %globaltimer submit
   * time in desc.reserved[0..1], as bench_e2e's device-side client does; else 0), seen -> every rank
   * agreed, agreed -> completion (the op blocks start at the release, before the agreement) */
  uint32_t seen_ns, agree_ns, run_ns, pad;
  /* block 0's stamps of the op body, ns after the op's release to the blocks (0: not stamped): [0] body
   * start, [1] sent, [2] fenced, [3] flagged, [4] peers' flags seen, [5] received/reduced, [6] block 0 done,
   * [7] the last block writes the completion */
  uint32_t phase_ns[8];
} epd_k_prec_t;

typedef struct epd_k_pprog {
  uint64_t ops;            /* ops completed (slot DONE) since the launch */
  uint64_t announced;      /* index + 1 of the last announcement (written when the rank starts waiting for its
                            * peers' announcements: announced > taken while it does) */
  uint64_t taken;          /* index + 1 of the last op taken */
  uint64_t exit_index;     /* at exit: the index it stopped at (not taken) */
  uint32_t exited, reason; /* at exit: 1, EPD_K_PEXIT_* */
  int32_t exit_peer;
  uint32_t slot;                    /* at exit: ring position to go on from */
  uint32_t bank_ver[EPD_NUM_BANKS]; /* map version of each bank's last dispatch */
  uint32_t pad[6];
  epd_k_prec_t rec[EPD_K_PREC]; /* rec[n % EPD_K_PREC]: op n since the launch */
} epd_k_pprog_t;

typedef struct epd_k_persist {
  epd_queue_t *queue;  /* device address of the client queue (e.g. host memory, registered mapped) */
  epd_queue_t *dqueue; /* device address of its device twin (polled) */
  uint64_t *dlimit;    /* device word: no op with index >= *dlimit is taken (stops at that boundary) */
  epd_k_pctl_t *ctl;   /* device address of the control block */
  epd_k_pprog_t *prog; /* device address of the progress block (zeroed by the caller before the launch) */
  uint32_t first_slot; /* ring position to start from */
  uint32_t bank_ver[EPD_NUM_BANKS]; /* map version of each bank's last dispatch (0: the map's) */
  uint32_t guard_all;   /* check every op that the client's host copy says SUBMITTED before writing DONE
                         * (without MPS, where a submitter can be time-sliced between its two copies) */
  uint64_t index0;      /* agreement index of the first op: the same on every rank, larger than any
                         * index of an earlier launch since the last epd_k_ll_reset/create */
  uint64_t step0;       /* group step number of the first op (completion step = step0 + n) */
  uint64_t steps_done0; /* queue header steps_done before the first op */
  uint64_t timeout_ns;  /* per wait; 0: EPD_K_DEFAULT_TIMEOUT_NS */
} epd_k_persist_t;

/* Launch the persistent kernel on `stream` (its own stream: it runs until told to stop). map: device
 * expert map (not changed while it runs). Returns EPD_ERR_INVALID on NULL arguments, EPD_ERR_CUDA when
 * the launch fails. */
epd_result_t epd_k_ll_persistent_launch(epd_k_ll_t *k, const epd_k_arena_t *arena, const void *map,
                                        const epd_k_persist_t *ps, void *stream);
/* Blocks of the persistent kernel this GPU keeps resident at once (SMs x blocks per SM); every block of a
 * persistent kernel must be resident, and the kernels of the other groups need theirs too. */
long epd_k_ll_resident_blocks(const epd_k_ll_t *k);

/* Conveniences around epd_k_ll_launch. */
epd_result_t epd_k_ll_dispatch(epd_k_ll_t *k, const epd_k_arena_t *arena, const void *map, uint32_t bank,
                               uint32_t num_tokens, uint32_t flags, epd_comp_t *comp, uint64_t timeout_ns,
                               void *stream);
epd_result_t epd_k_ll_combine(epd_k_ll_t *k, const epd_k_arena_t *arena, uint32_t bank, epd_comp_t *comp,
                              uint64_t timeout_ns, void *stream);

/* Benchmark/test helper: hold `stream` until *flag >= value (flag: device address of host-mapped
 * memory), or until timeout_ns passed. Lets several GPUs start an op at the same moment. */
epd_result_t epd_k_gate(const uint32_t *flag, uint32_t value, uint64_t timeout_ns, void *stream);
/* An empty kernel of `blocks` x EPD_K_LL_THREADS threads (benchmarks: the launch floor). */
epd_result_t epd_k_empty(uint32_t blocks, void *stream);
/* Benchmark helper: rewrite rows [0, n_s) of `slots` slots (`stride` bytes apart, rows of `row_bytes`) with
 * their own contents, n_s = counts[s] (device int32 array) or `fixed` where counts is NULL, at most
 * `max_rows`: the rows then sit in L2 as a producer's fresh output would. */
epd_result_t epd_k_rewrite_rows(void *base, const int32_t *counts, uint32_t fixed, uint32_t slots,
                                uint64_t stride, uint32_t row_bytes, uint32_t max_rows, void *stream);

/* The geometry a context was created with. */
const epd_k_ll_geom_t *epd_k_ll_geom(const epd_k_ll_t *k);

/* Test helper: the kernels' FP8 quantiser (LL, HT and scale-out) against IEEE division (docs/SEMANTICS.md):
 * the scale of every non-negative BF16 amax (NaN patterns too: a group of NaNs), and for each the e4m3 byte
 * of every BF16 x with |x| <= amax or NaN, converted by the same instruction on both sides. *mismatches
 * counts the differences, *compared the bytes compared (1073790594 when every pair ran); the first
 * difference's amax and x bit patterns (x = 0x10000: the scale itself). Synchronous, current device. */
epd_result_t epd_k_fp8_check(uint64_t *mismatches, uint64_t *compared, uint32_t *first_amax,
                             uint32_t *first_x);

/* ---- HT (high-throughput) data path: docs/SEMANTICS.md "HT dispatch"/"HT combine" ----
 * Per rank of a node-local (LSA) team: an HT staging window (epd_k_ht_window_bytes: capacity rows of
 * incoming tokens per bank, plus max_tokens combine rows per peer) registered like the LL one; the
 * client arena as for LL (kinds X, TOPK_IDX, TOPK_WEIGHTS, HT_RECV_*, HT_Y, OUT). A dispatch is two
 * stream-ordered kernels (route; then count exchange and data on `blocks` SMs); a combine one. With the
 * peers' arenas (epd_k_ht_op_t.peer_arena) rows go straight to their final place in the receiver's arena
 * and combine pulls the partials; without, they pass through the staging window.
 * Timeouts, sequence numbers and recovery (epd_k_ht_reset on every quiescent rank) are as for LL. */
typedef struct epd_k_ht_geom {
  uint32_t num_ranks;      /* R: ranks of the team (= LSA team), 1..EPD_K_MAX_RANKS */
  uint32_t rank;           /* this rank's index in the team */
  uint32_t num_experts;    /* E */
  uint32_t hidden;         /* H: a multiple of 128, <= EPD_K_MAX_HIDDEN */
  uint32_t topk;           /* K: 1..EPD_K_MAX_TOPK */
  uint32_t max_tokens;     /* M: tokens per rank per step, <= EPD_K_HT_MAX_TOKENS */
  uint32_t slots_per_rank; /* S */
  uint32_t capacity;       /* C: receive rows per rank (overflow: EPD_ERR_OVERFLOW on every rank) */
  uint32_t blocks;         /* CUDA blocks (SMs) of the data kernels; 0: EPD_K_HT_BLOCKS */
  uint32_t ce_split; /* copies (streams) per dest rank of EPD_K_HT_COPY_CE, 1..4; 0: EPD_K_HT_CE_SPLIT */
} epd_k_ht_geom_t;

typedef struct epd_k_ht epd_k_ht_t;

/* Bytes of the HT staging window for this geometry (both banks), a multiple of 4096. */
size_t epd_k_ht_window_bytes(const epd_k_ht_geom_t *g);
/* Bind the HT kernels of one rank to its staging window (collective over lsa_comm, like
 * epd_k_ll_create). Zeroes the HT control state (synchronously). */
epd_result_t epd_k_ht_create(const epd_k_ht_geom_t *g, struct ncclComm *lsa_comm,
                             struct ncclWindow_vidmem *window, void *window_local, size_t window_offset,
                             epd_k_ht_t **out, char *err, size_t errlen);
void epd_k_ht_destroy(epd_k_ht_t *k);
/* Zero flags and sequence numbers, stream-ordered (every rank quiescent, then every rank). */
epd_result_t epd_k_ht_reset(epd_k_ht_t *k, void *stream);
const epd_k_ht_geom_t *epd_k_ht_geom(const epd_k_ht_t *k);

/* Parameters of one HT op (fields as epd_k_ll_op_t). comp->num_recv: rows received (on overflow: the
 * rows this rank would need). */
typedef struct epd_k_ht_op {
  uint32_t op;           /* EPD_OP_HT_DISPATCH or EPD_OP_HT_COMBINE */
  uint32_t flags;        /* dispatch: EPD_DESC_FP8 */
  uint32_t num_tokens;   /* dispatch */
  uint32_t bank;         /* a combine uses its dispatch's bank */
  uint64_t timeout_ns;   /* per wait; 0: EPD_K_DEFAULT_TIMEOUT_NS */
  const void *map;       /* dispatch: device expert-map table */
  uint64_t *slot_tokens; /* dispatch, optional: per local slot [S], += (j, k) entries received */
  epd_comp_t *comp;      /* device completion record */
  /* Optional: the UVA base of every rank's client arena of this step (same offsets as `arena`; the entry
   * of this rank is ignored), each readable and writable from this GPU. All non-zero: dispatch writes
   * rows straight into the receivers' arenas and combine reads the partials from them (no staging copy).
   * Any zero: rows pass through the peers' staging windows (the path without peer access). */
  uint64_t peer_arena[EPD_K_MAX_RANKS];
  uint32_t copy; /* EPD_K_HT_COPY_REG (0, default), EPD_K_HT_COPY_TMA or EPD_K_HT_COPY_CE */
  /* EPD_K_HT_COPY_CE: every rank's num_tokens of this op (the copies' sizes and receive rows). */
  uint32_t rank_tokens[EPD_K_MAX_RANKS];
  uint64_t *trace; /* optional (NULL), zeroed by the caller: %globaltimer stamps (profiling). Dispatch:
                    * [0] route start, [1] data kernel start, [2] counts, [3] plan messages read, [4] rows
                    * start (block 0: its metadata written), [5] rows issued and [6] rows complete (latest
                    * block), [7] peers' flags, [8] receive pass, [9] completion, [10] rows issued by the
                    * earliest block (stored complemented: ~stamp), [11] the last block saw its copy-engine
                    * rows landed (EPD_K_HT_COPY_CE). Combine: [0] start, [1] peers' HT_Y ready,
                    * [2] pulled and reduced (latest block), [3] peers done, [4] completion. */
} epd_k_ht_op_t;
#define EPD_K_HT_COPY_REG 0u /* 16-byte register loads and stores (the default) */
/* Opt-in: BF16 dispatch rows and combine partials move with cp.async.bulk (TMA) through shared memory
 * (FP8 dispatch uses register copies). Tested with hidden 640 / 4096 / 7168, one or several tiles of 512
 * tokens per block; slower than register copies at these sizes (bench/results/bench_ht_h200x2.md,
 * and the sanitizer record, which also has the combine fault this fixed). */
#define EPD_K_HT_COPY_TMA 1u
/* A dense (EPD_DESC_HT_DENSE) BF16 dispatch with peer arenas: each rank's x goes to every other rank's
 * receive rows in one cudaMemcpyAsync per dest (the GPU's copy engines, no SM), on a stream of its own
 * forked from and joined to the op's stream; a stream memory operation after each copy tells the data
 * kernel, which writes the metadata and its own rows meanwhile. Needs rank_tokens, and every rank's
 * previous op on the bank complete before the launch (the copies are issued at once, before this step's
 * plan exchange; the daemon and the tests guarantee it). Any other op, a dense dispatch past the capacity
 * (EPD_ERR_OVERFLOW, nothing copied), or a driver without stream memory operations runs as
 * EPD_K_HT_COPY_REG. */
#define EPD_K_HT_COPY_CE 2u
/* Copies (streams) per dest rank of EPD_K_HT_COPY_CE by default (epd_k_ht_geom_t.ce_split sets it). */
#define EPD_K_HT_CE_SPLIT 1
/* Dispatches that moved their rows with the copy engines so far. */
uint64_t epd_k_ht_ce_ops(const epd_k_ht_t *k);
#ifdef EPD_TEST_HOOKS
/* Test builds only: from now on each copy-engine stream of k spins `us` microseconds (at most 60 s) before
 * its copy (0: none), so that its rows land late. */
void epd_k_ht_test_ce_delay(epd_k_ht_t *k, uint32_t us);
#endif

/* Launch one HT op on `stream`: host checks return EPD_ERR_INVALID, launch failures EPD_ERR_CUDA;
 * device outcomes land in op->comp. */
epd_result_t epd_k_ht_launch(epd_k_ht_t *k, const epd_k_arena_t *arena, const epd_k_ht_op_t *op, void *stream,
                             char *err, size_t errlen);
#ifdef __cplusplus
}
#endif
#endif /* EPD_KERNELS_H */
