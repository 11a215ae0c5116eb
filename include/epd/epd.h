/*
 * epd.h - libepd, the client library of the epd expert-parallel communication daemon.
 *
 * A worker connects to the daemon's control socket, attaches to one rank of an EP group, gets its IO
 * arena mapped in place (zero copy), and submits dispatch/combine operations. With the host backend the
 * arena is host memory and operations are synchronous calls; with the CUDA backend the arena is GPU
 * memory and operations are enqueued on the caller's CUDA stream (capturable in a CUDA graph).
 *
 * Every call that can fail returns epd_result_t (0 or a negative code); epd_strerror() names the code
 * and epd_last_error() gives the per-handle text of the last failure.
 */
#ifndef EPD_H
#define EPD_H

#include <stddef.h>
#include <stdint.h>

#include "epd_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_API_VERSION 1u
#define EPD_PROTOCOL_VERSION 1u /* control RPC protocol version, checked by the daemon */
#define EPD_OPTS_MAGIC 0x4550444fu

typedef enum epd_result {
  EPD_OK = 0,
  EPD_ERR_INVALID = -1,          /* an argument is out of range; the message names it */
  EPD_ERR_NOMEM = -2,            /* out of host or device memory */
  EPD_ERR_SYSTEM = -3,           /* a system call failed (errno in the message) */
  EPD_ERR_RPC = -4,              /* the control RPC failed (transport or server error) */
  EPD_ERR_PROTOCOL = -5,         /* protocol or ABI version mismatch */
  EPD_ERR_NOT_FOUND = -6,        /* unknown group, client or resource */
  EPD_ERR_BUSY = -7,             /* rank already attached, or a limit reached */
  EPD_ERR_TIMEOUT = -8,          /* a wait ran out; the completion names the peer rank */
  EPD_ERR_PEER = -9,             /* a peer rank's client detached or failed mid-step */
  EPD_ERR_DRAINING = -10,        /* the daemon is draining: no new attach or dispatch (combines of
                                  * dispatches that ran still run; across nodes: the peer rank's node is) */
  EPD_ERR_CUDA = -11,            /* a CUDA call failed */
  EPD_ERR_NCCL = -12,            /* an NCCL call failed */
  EPD_ERR_UNSUPPORTED = -13,     /* not available in this build, backend or mode */
  EPD_ERR_BAD_EXPERT = -14,      /* a top-k entry is outside [-1, num_experts) */
  EPD_ERR_TOO_MANY_TOKENS = -15, /* num_tokens over the group's max_tokens */
  EPD_ERR_PERMISSION = -16,      /* the caller is not allowed to do this */
  EPD_ERR_OVERFLOW = -17,        /* HT receive capacity exceeded (nothing was written past it) */
  EPD_ERR_MISMATCH = -18,        /* ranks submitted different ops or banks for one step */
  EPD_ERR_CLOSED = -19,          /* no daemon listens at the socket, or the daemon connection dropped */
  EPD_ERR_STATE = -20,           /* call out of order (combine without dispatch, ...) */
  EPD_ERR_INTERNAL = -21,
  EPD_ERR_MIN = -22
} epd_result_t;

/* Name and one-line meaning of a result code; never NULL. */
const char *epd_strerror(int result);

typedef struct epd_conn epd_conn_t; /* a connection to the daemon's control socket */
typedef struct epd_ep epd_ep_t;     /* one attachment: a (group, rank) with its queue and arena */

typedef struct epd_connect_opts {
  uint32_t size, magic, version;
  const char *socket_path; /* control socket; NULL: $EPD_SOCKET, else the default path */
  int timeout_ms;          /* per RPC; 0: 10000 */
} epd_connect_opts_t;
#define EPD_CONNECT_OPTS_INITIALIZER \
  { sizeof(epd_connect_opts_t), EPD_OPTS_MAGIC, EPD_API_VERSION, NULL, 0 }

/* Open a control connection (checks the daemon is reachable and speaks our protocol). */
epd_result_t epd_connect(const epd_connect_opts_t *opts, epd_conn_t **out);
/* Close a connection; attachments made through it must be detached first. */
void epd_disconnect(epd_conn_t *conn);
/* Text of the last failure on this connection (empty if none). */
const char *epd_conn_last_error(const epd_conn_t *conn);

typedef struct epd_attach_opts {
  uint32_t size, magic, version;
  const char *group; /* EP group name; NULL: "default" */
  int rank;          /* rank in the group, 0..num_ranks-1 */
  /* Group geometry. The first attach of a group fixes it; later attaches pass 0 (take the group's)
   * or the same values. */
  uint32_t num_experts, hidden, topk, max_tokens;
  const char *client_name; /* shown by `epdctl clients`; NULL: "pid:<pid>" */
  /* Expert weights per local slot (bytes). The first attach of a group with a value > 0 gives every
   * client an EPD_BUF_EXPERT_WEIGHTS buffer [slots_per_rank, weight_bytes_per_slot] that maps with weight
   * copies migrate between ranks; later attaches pass 0 or the same. (Added after API version 1: an
   * older, shorter struct is accepted and means 0.) */
  uint64_t weight_bytes_per_slot;
  /* What the group does when a rank is lost (its client dies, hangs past engine.step_timeout_ms):
   * EPD_RANK_LOSS_FAIL fails every step until a worker attaches to the rank again; EPD_RANK_LOSS_MASK
   * goes on without it from the next step (docs/SEMANTICS.md "Masked ranks"); 0 takes the group's (FAIL
   * for a new group). renormalize (masked groups): 1 scales a token's remaining top-k weights to their
   * original sum when entries were dropped for lack of a live replica; 0 (default) leaves them. The first
   * attach fixes both; later attaches pass 0 or the same. (Added after API version 1, like the field
   * above.) */
  uint32_t on_rank_loss;
  uint32_t renormalize;
} epd_attach_opts_t;
#define EPD_RANK_LOSS_FAIL 1u
#define EPD_RANK_LOSS_MASK 2u
#define EPD_ATTACH_OPTS_INITIALIZER \
  { sizeof(epd_attach_opts_t), EPD_OPTS_MAGIC, EPD_API_VERSION, NULL, 0, 0, 0, 0, 0, NULL, 0, 0, 0 }

/* Attach to (group, rank): RPC Attach, then redeem the one-time token on the attach socket for the
 * queue and arena file descriptors, and map them. */
epd_result_t epd_attach(epd_conn_t *conn, const epd_attach_opts_t *opts, epd_ep_t **out);
/* Detach and unmap; in-flight operations of this attachment must have completed, and the streams that
 * carry its ops must be synchronised first (with kernel submission, a wait still spinning on a stream
 * gives up with EPD_ERR_CLOSED when detach abandons its slot, but the memory goes right after). */
epd_result_t epd_detach(epd_ep_t *ep);
/* Text of the last failure on this attachment (empty if none). */
const char *epd_last_error(const epd_ep_t *ep);

typedef enum epd_info {
  EPD_INFO_RANK,
  EPD_INFO_NUM_RANKS,
  EPD_INFO_NUM_EXPERTS,
  EPD_INFO_HIDDEN,
  EPD_INFO_TOPK,
  EPD_INFO_MAX_TOKENS,
  EPD_INFO_SLOTS_PER_RANK,
  EPD_INFO_HT_CAPACITY,
  EPD_INFO_ON_GPU,
  EPD_INFO_DEVICE, /* this process's CUDA ordinal of the rank's GPU (found by its UUID: with
                    * CUDA_VISIBLE_DEVICES set to that one GPU it is 0), -1 on the host backend */
  EPD_INFO_MAP_VERSION,
  EPD_INFO_CLIENT_ID,
  EPD_INFO_NEXT_SLOT, /* the queue slot libepd's next op will use (the daemon runs slots in ring order) */
  EPD_INFO_WEIGHT_BYTES_PER_SLOT, /* bytes per slot of EPD_BUF_EXPERT_WEIGHTS, 0 if the group has none */
  EPD_INFO_KERNEL_SUBMIT /* 1: ops are submitted through the queue's device twin with libepd's kernels
                          * (the daemon's persistent kernels serve it, or EPD_SUBMIT=kernel); 0: stream
                          * memory operations on the host copy */
} epd_info_t;
/* A property of the attachment (geometry, device); -1 for an unknown key. */
int64_t epd_info(const epd_ep_t *ep, epd_info_t key);

/* Address of an arena buffer (EPD_BUF_*) of a bank, in this process; its size in *bytes. Host memory
 * for the host backend, device memory for the CUDA backend. NULL if the kind is not in the arena. */
void *epd_buffer(const epd_ep_t *ep, int kind, unsigned bank, size_t *bytes);

/* LL or HT. */
typedef enum epd_mode { EPD_MODE_LL = 0, EPD_MODE_HT = 1 } epd_mode_t;

/* Dispatch num_tokens tokens of bank's x/topk buffers. stream == NULL: run and wait, return the op's
 * status. stream != NULL (CUDA backend, a cudaStream_t): enqueue on the stream, return EPD_OK; the
 * status is read with epd_op_status() after the stream is synchronised. flags: EPD_DESC_* (EPD_DESC_FP8;
 * EPD_DESC_HT_DENSE for an HT dispatch: every rank receives every token, docs/SEMANTICS.md). */
epd_result_t epd_dispatch(epd_ep_t *ep, epd_mode_t mode, uint32_t num_tokens, uint32_t flags, unsigned bank,
                          void *stream);
/* Combine the bank's expert outputs back into the bank's OUT buffer; same stream rules. */
epd_result_t epd_combine(epd_ep_t *ep, epd_mode_t mode, unsigned bank, void *stream);
/* Status of the last completed op (after the stream is synchronised) and its completion record. */
epd_result_t epd_op_status(epd_ep_t *ep, epd_comp_t *comp_out);

/* Completion record of queue slot `slot` as it stands (for ops replayed from CUDA graphs, or submitted
 * by a client kernel: read it after the stream is synchronised); returns its status. */
epd_result_t epd_slot_status(epd_ep_t *ep, unsigned slot, epd_comp_t *comp_out);

/* Device address of submission slot `slot` (0..EPD_QUEUE_SLOTS-1) of the attachment's queue, for a
 * client kernel that submits and waits with include/epd/epd_device.h (CUDA backend: the slot's device twin
 * in GPU memory, which also knows its host copy: include/epd/epd_abi.h; a daemon without twins gives the
 * host copy's device alias). NULL on the host backend or for a slot out of range.
 * The daemon runs SUBMITTED slots in ring order from the slot after the last one it ran; after attach
 * that is slot 0, after libepd's own ops it is epd_info(ep, EPD_INFO_NEXT_SLOT). A kernel that owns
 * slots must leave them FREE (completed and waited for, and that kernel finished or its stream
 * synchronized: its FREE of the twin is ordered before its FREE of the host copy for this GPU only)
 * before libepd submits on them again; libepd's ring position does not move with the kernel's ops. */
void *epd_slot_device_ptr(epd_ep_t *ep, unsigned slot);

/* Expert-map replica of a logical expert. */
typedef struct epd_replica {
  uint32_t rank, slot;
} epd_replica_t;

/* The group's active expert map, read from the table the daemon keeps in this attachment's queue
 * memory (no round trip; consistent snapshots). The map of a step is the version in its completion
 * (epd_comp_t.map_version); the table shows it from that step's dispatch until the next switch. */
/* Active map version (0 if the daemon publishes no table). */
uint32_t epd_map_version(const epd_ep_t *ep);
/* The group's world ranks masked now (bit r; on_rank_loss = EPD_RANK_LOSS_MASK), from the queue header
 * the daemon keeps; a step's own mask is in its completion (epd_comp_t.masked). */
uint64_t epd_masked_ranks(const epd_ep_t *ep);
/* Replicas of a logical expert: up to max of them in reps, their number in *nrep, the version read in
 * *version (either may be NULL). EPD_ERR_INVALID for an expert out of range, EPD_ERR_UNSUPPORTED without
 * a table. */
epd_result_t epd_expert_slots(const epd_ep_t *ep, uint32_t logical, epd_replica_t *reps, uint32_t max,
                              uint32_t *nrep, uint32_t *version);
/* The logical expert held by each of this rank's n physical slots (n <= slots_per_rank; -1 for a free
 * slot): which weights to run on each slot. *version gets the version read (may be NULL). */
epd_result_t epd_slot_experts(const epd_ep_t *ep, int32_t *logical, uint32_t n, uint32_t *version);

#ifdef __cplusplus
}
#endif
#endif /* EPD_H */
