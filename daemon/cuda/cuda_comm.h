/*
 * cuda_comm.h - NCCL set-up for the CUDA backend: one process drives every GPU of the node.
 *
 * For N local GPUs: a thread per GPU runs ncclCommInitRank (ranks numbered node-contiguously, so the
 * LSA team is the node), splits a node-local communicator (it carries the LSA device communicator, so a
 * multi-node world never blocks LSA), and registers symmetric windows (ncclMemAlloc +
 * ncclCommWindowRegister, same size and order on every rank). The NCCL runtime must take the device
 * API the kernels are built with (epd_k_check_nccl_version); others are refused with a message. Up to
 * four ranks may share a GPU (NCCL 2.30+ multi-rank mode).
 * Only built with EPD_WITH_CUDA=1, but for epd_gin_line (plain C).
 */
#ifndef EPD_CUDA_COMM_H
#define EPD_CUDA_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

#define EPD_CC_MAX_RANKS 64
#define EPD_CC_MAX_NODES 64 /* nodes of a world (epd_cc_world_peer) */

struct ncclComm;
struct ncclWindow_vidmem;
typedef struct epd_cc epd_cc_t;

/* One symmetric window on every rank. */
typedef struct epd_cc_win {
  size_t bytes;
  void *ptr[EPD_CC_MAX_RANKS];                     /* local device address on each rank */
  struct ncclWindow_vidmem *win[EPD_CC_MAX_RANKS]; /* ncclWindow_t of each rank */
} epd_cc_win_t;

#define EPD_CC_UNIQUE_ID_BYTES 128

#define EPD_CC_MAX_RANKS_PER_GPU 4 /* NCCL's multi-rank mode: 8 ranks on one H200 hung in its init */

/* Ranks that share a GPU: devices[r] = r % (visible GPUs) for n ranks; returns how many ranks the
 * busiest GPU holds (1: a GPU per rank), or -1 when no GPU is visible. For tests and benchmarks. */
int epd_cc_devices_for(int n, int *devices);
/* How many of the n ranks are on the GPU of `rank` (devices NULL: rank r on GPU r). */
int epd_cc_ranks_on(int n, const int *devices, int rank);
/* The most ranks any one GPU holds (1: a GPU per rank). */
int epd_cc_share(int n, const int *devices);
/* Check a rank-to-GPU map (NULL: rank r on GPU r): every GPU visible, at most EPD_CC_MAX_RANKS_PER_GPU
 * ranks on one, and where ranks share a GPU an NCCL of 2.30 or later (its multi-rank mode, which this
 * turns on: NCCL_MULTI_RANK_GPU_ENABLE=1). EPD_OK, or the reason in err. */
epd_result_t epd_cc_check_devices(int n, const int *devices, char *err, size_t errlen);
/* Is there room for `bytes` on the GPUs? rank < 0: bytes for every rank, on every GPU (ranks sharing a
 * GPU each need theirs); else bytes on rank's GPU. EPD_ERR_NOMEM with what, the GPU, the bytes needed
 * and free in err when not. */
epd_result_t epd_cc_check_free(int n, const int *devices, int rank, size_t bytes, const char *what, char *err,
                               size_t errlen);
/* Create communicators for GPUs devices[0..n-1] (NULL: 0..n-1), rank i on devices[i] (checked as
 * epd_cc_check_devices does). */
epd_result_t epd_cc_create(int n, const int *devices, epd_cc_t **out, char *err, size_t errlen);
/* Scale-out: the same as one node of `nodes`: world ranks node*n + i over the id world_id (made by one
 * node with epd_cc_unique_id and handed to all); the node-local split keeps the LSA team to this node
 * (own_lsa: a node-local communicator of its own instead, for a node that joins a running world: the
 * other nodes make their world communicator again without a split). Blocks until every node's ranks
 * joined (NCCL's bootstrap). */
epd_result_t epd_cc_create_world(int n, const int *devices, uint32_t nodes, uint32_t node,
                                 const uint8_t *world_id, int own_lsa, epd_cc_t **out, char *err,
                                 size_t errlen);
/* Scale-out: abort the world communicators (a node is gone) and make them again over world_id with the
 * ranks of the nodes in `live` (bit k: node k; 0: every node, each rank as at the start: a restarted node
 * joins with own_lsa; without some nodes, the others' ranks in node order: epd_cc_world_peer); the
 * node-local ones stay. Returns once every rank joined, or fails (the new ones aborted) after limit_ms or
 * once *cancel is set. The new world communicators are non-blocking: a grouped call may return
 * ncclInProgress (epd_cc_world_wait). */
epd_result_t epd_cc_world_remake(epd_cc_t *cc, const uint8_t *world_id, uint64_t live, uint32_t limit_ms,
                                 const int *cancel, char *err, size_t errlen);
/* The rank of node `node`'s local rank `rank` on the world communicators as they are; -1 if that node is
 * not on them (made again without it). */
int epd_cc_world_peer(const epd_cc_t *cc, uint32_t node, int rank);
/* After a grouped call on world communicators made again (non-blocking) returned ncclInProgress: wait
 * until they are done with it; NULL, or why not (an error, or still in progress after limit_ms). */
const char *epd_cc_world_wait(epd_cc_t *cc, uint32_t limit_ms);
/* A fresh ncclUniqueId (EPD_CC_UNIQUE_ID_BYTES) for epd_cc_create_world. */
epd_result_t epd_cc_unique_id(uint8_t *id, char *err, size_t errlen);
int epd_cc_world_ranks(const epd_cc_t *cc);
/* Scale-out: what NCCL offers for device-initiated network transfers (GIN) on the world communicators
 * (epd_k_gin_probe on every local rank; collective, so every node calls it at start-up), as a line for
 * status and the log: "unavailable (...)", "available (...)" or "probe failed: ...". */
void epd_cc_gin_probe(epd_cc_t *cc, char *out, size_t outlen);
/* The status line of the n local ranks' probe results (contexts, type: 3 GDAKI, 2 proxy, < 0 refused with
 * err[r]): one text when every rank got the same, else every rank's. Plain C (any build). */
void epd_gin_line(int n, const int *contexts, const int *type, const char *const *err, char *out,
                  size_t outlen);
/* Abort the world communicators (a peer node hangs an exchange); they are unusable after. */
void epd_cc_abort(epd_cc_t *cc);
/* Destroy communicators (windows must have been freed). */
void epd_cc_destroy(epd_cc_t *cc);
int epd_cc_num_ranks(const epd_cc_t *cc);
int epd_cc_device(const epd_cc_t *cc, int rank);
struct ncclComm *epd_cc_world(const epd_cc_t *cc, int rank);
/* The node-local communicator of a rank (its LSA team is the node). */
struct ncclComm *epd_cc_lsa(const epd_cc_t *cc, int rank);

/* Run fn(cc, rank, arg) on a thread per rank with the rank's device current (for collective set-up
 * calls such as ncclDevCommCreate); returns the first non-OK result (by rank order). */
typedef epd_result_t (*epd_cc_fn)(epd_cc_t *cc, int rank, void *arg);
epd_result_t epd_cc_each(epd_cc_t *cc, epd_cc_fn fn, void *arg);

/* Allocate and register a window of `bytes` (rounded up to 4096) on every rank of the node-local
 * communicator, zeroed. Collective (it runs a thread per rank). */
epd_result_t epd_cc_window_alloc(epd_cc_t *cc, size_t bytes, epd_cc_win_t *out, char *err, size_t errlen);
/* Deregister and free a window on every rank (every rank must be quiescent). */
void epd_cc_window_free(epd_cc_t *cc, epd_cc_win_t *w);

#endif
