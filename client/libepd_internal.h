/*
 * libepd_internal.h - libepd's handles. Not installed; the public API is epd.h.
 */
#ifndef EPD_LIBEPD_INTERNAL_H
#define EPD_LIBEPD_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"
#include "libepd_cuda.h"
#include "rpc_client.h"

#define EPD_ERRTEXT 512
#define EPD_SECRET_MAX 64
#define EPD_DEFAULT_RPC_TIMEOUT_MS 10000
/* How long a synchronous op waits for its completion: longer than any sane step_timeout_ms so that the
 * daemon's own timeout (which names the peer) is what the caller normally sees. $EPD_OP_TIMEOUT_MS. */
#define EPD_DEFAULT_OP_TIMEOUT_MS 120000

struct epd_conn {
  epd_rpc_t *rpc;
  int timeout_ms;
  unsigned nattached; /* attachments made through this connection and not detached */
  char err[EPD_ERRTEXT];
};

struct epd_ep {
  epd_conn_t *conn;
  uint64_t client_id;
  uint8_t secret[EPD_SECRET_MAX];
  size_t secret_len;
  int sock;   /* attach connection, open for the attachment's life; its hang-up means the daemon died */
  int closed; /* the daemon connection dropped */
  int stuck;  /* a synchronous op timed out: the ring is out of step */
  int on_gpu, device;
  uint32_t num_ranks, num_experts, hidden, topk, max_tokens, slots_per_rank, ht_capacity, map_version;
  uint64_t weight_bytes_per_slot;
  int rank;
  epd_queue_t *queue; /* host mapping (memfd) on both backends */
  size_t queue_bytes;
  uint8_t *arena; /* host mapping, or device address for memory "cuda" */
  size_t arena_bytes;
  epd_cuda_map_t *arena_map;     /* memory "cuda" */
  epd_cuda_hostreg_t *queue_reg; /* memory "cuda": the queue registered for stream memory operations */
  uint64_t queue_dev;
  uint64_t
      dq_dev;    /* memory "cuda": device address of the queue's device twin (include/epd/epd_abi.h), or 0 */
  int ksub;      /* submit with libepd's kernels through the twin (client/submit.cu) */
  void *kstream; /* ksub: the stream of the host path (stream = NULL) */
  uint32_t nbuffers;
  struct {
    uint32_t kind, bank;
    uint64_t offset, bytes;
  } buffers[EPD_MAX_BUFFERS];
  uint32_t next_slot;   /* ring position of the next op (the daemon executes in ring order) */
  int last_slot;        /* slot of the last op, -1 if none */
  int last_async;       /* the last op was enqueued on a stream */
  epd_comp_t last_comp; /* completion of the last synchronous op */
  int op_timeout_ms;
  char err[EPD_ERRTEXT];
};

#endif
