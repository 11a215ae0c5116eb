/*
 * epd_abi.h - the memory contract shared by libepd, the daemon and the kernels.
 *
 * A client's queue and IO arena are memory owned by the daemon and mapped by the client (a memfd for
 * the host backend, a cuMem allocation exported as a POSIX fd for the CUDA backend). This header
 * defines everything both sides read and write there: the submission slots (descriptor, completion,
 * state word) and the names of the arena buffers. It is plain C with fixed-width types so that C host
 * code, CUDA device code and Python ctypes agree byte for byte; every struct size is asserted.
 *
 * Protocol of one operation (one slot), identical on both backends:
 *   client: fill slot.desc; store slot.state = EPD_SLOT_SUBMITTED (release)
 *   daemon: see SUBMITTED (acquire); run the op; fill slot.comp; store slot.state = EPD_SLOT_DONE
 *   client: wait for state == EPD_SLOT_DONE (acquire); read slot.comp; store slot.state = EPD_SLOT_FREE
 * All values written are constants per slot, so the same sequence captured in a CUDA graph (stream
 * memory operations) replays correctly any number of times. The daemon executes SUBMITTED slots of one
 * queue in ring order starting after the last slot it executed.
 *
 * Device twin (CUDA backend, queue.dq_offset != 0): a second copy of the slots in GPU memory, inside the
 * client's IO arena at dq_offset (an epd_queue_t whose header is unused). The daemon's persistent kernels
 * poll it (a GPU load instead of a PCIe round trip) and complete in both copies; the daemon's CPU
 * threads read only the host copy. A client that submits through the twin (epd_device.h, libepd's
 * kernel submission) writes the twin first and then the host copy, the same descriptor and state, and
 * waits for DONE in either copy (the CPU completes the host copy only); then frees both, the twin first
 * (a GPU-scope fence between the two frees: the readers that rely on that order, the persistent kernels,
 * run on the queue's GPU; the daemon's CPU never reads the twin).
 * Where the daemon sets EPD_QF_TWIN (its persistent kernels may serve the queue), every submission must
 * go through the twin: one that writes only the host copy is seen by the launch mode only, i.e. after
 * the daemon's watchdog stops the kernels (a step timeout). Each twin slot's twin_host (in its pad) is
 * the device address, in the client's own process, of the host slot: written by libepd at attach.
 * A twin is waited on from the queue's own GPU only (the daemon grants the arena to that device): the
 * persistent kernels order a completion for such waiters with GPU-scope fences, not system ones.
 * ABI 2 changed epd_device.h accordingly: kernels built against ABI 1's header must be rebuilt.
 */
#ifndef EPD_ABI_H
#define EPD_ABI_H

#include <stddef.h>
#include <stdint.h>

#define EPD_ABI_VERSION 2u          /* 2: device twin of the queue (dq_offset, qflags) */
#define EPD_QUEUE_MAGIC 0x45504451u /* "EPDQ" */
#define EPD_QUEUE_SLOTS 8u
#define EPD_NUM_BANKS 2u /* LL/HT IO is double-buffered: step N+1 may dispatch while N combines */

/* Operation codes (epd_desc_t.op). */
enum {
  EPD_OP_NONE = 0,
  EPD_OP_LL_DISPATCH = 1,
  EPD_OP_LL_COMBINE = 2,
  EPD_OP_HT_DISPATCH = 3,
  EPD_OP_HT_COMBINE = 4,
  EPD_OP_MAX = 5
};

/* Descriptor flags. */
enum {
  EPD_DESC_FP8 = 1u << 0,      /* dispatch: send FP8 e4m3 with per-128-channel f32 scales (recv_x holds
                                * fp8 bytes, recv_scales the scales); x stays BF16 */
  EPD_DESC_HT_DENSE = 1u << 1, /* HT dispatch: dense layout, every rank receives every token of every rank
                                * (rows ordered by (src, t); entries of other ranks -1): the receive
                                * rows are known before routing, so BF16 rows move with the copy engines */
};

/* Queue flags (epd_queue_t.qflags). */
enum {
  EPD_QF_TWIN = 1u << 0, /* the daemon's persistent kernels may serve this queue, and they see only the
                          * device twin: every submission must go through it (libepd then submits with
                          * small kernels: epd_device.h) */
};

/* Slot states (epd_slot_t.state). */
enum { EPD_SLOT_FREE = 0, EPD_SLOT_SUBMITTED = 1, EPD_SLOT_DONE = 2 };

/* Arena buffer kinds. Offsets and sizes of each (kind, bank) come in the Attach reply, never computed
 * by the client, so the daemon may lay memory out as its backend needs. Shapes (M = group max_tokens,
 * H = hidden, K = topk, S = slots per rank, R = ranks, C = HT receive capacity):
 */
enum {
  EPD_BUF_X = 0,                     /* [M, H] bf16 dispatch input (always BF16; FP8 is cast on the fly) */
  EPD_BUF_X_SCALES = 1,              /* [M, H/128] f32, reserved for pre-quantized input */
  EPD_BUF_TOPK_IDX = 2,              /* [M, K] int64 logical expert ids, -1 = none */
  EPD_BUF_TOPK_WEIGHTS = 3,          /* [M, K] f32 */
  EPD_BUF_LL_RECV_X = 4,             /* [S, R*M, H] bf16 (or fp8) expert-major */
  EPD_BUF_LL_RECV_SCALES = 5,        /* [S, R*M, H/128] f32 */
  EPD_BUF_LL_RECV_COUNT = 6,         /* [S] int32 tokens received per local slot */
  EPD_BUF_LL_RECV_SRC = 7,           /* [S, R*M] int32 (src_rank << 24 | src_token), for inspection */
  EPD_BUF_LL_Y = 8,                  /* [S, R*M, H] bf16 expert outputs, combine input */
  EPD_BUF_OUT = 9,                   /* [M, H] bf16 combine output */
  EPD_BUF_HT_RECV_X = 10,            /* [C, H] bf16 (or fp8) flat, ordered by (src rank, src token) */
  EPD_BUF_HT_RECV_SCALES = 11,       /* [C, H/128] f32 */
  EPD_BUF_HT_RECV_TOPK_IDX = 12,     /* [C, K] int64 local slot ids, -1 if not local */
  EPD_BUF_HT_RECV_TOPK_WEIGHTS = 13, /* [C, K] f32 */
  EPD_BUF_HT_RECV_SRC = 14,          /* [C] int32 (src_rank << 24 | src_token) */
  EPD_BUF_HT_RECV_COUNT = 15,        /* [S] int32 tokens received per local slot */
  EPD_BUF_HT_Y = 16,                 /* [C, H] bf16 combine input (already reduced over local experts) */
  EPD_BUF_KINDS = 17,
  /* Not an IO kind and not per bank (bank 0 only): present when the group was created with
   * weight_bytes_per_slot > 0. [S, weight_bytes_per_slot] bytes: the expert weights of each local slot,
   * owned by the worker; the daemon copies slots between ranks when a map asks for it (migration). */
  EPD_BUF_EXPERT_WEIGHTS = 32
};
/* Most buffer descriptors an attach can carry: every IO kind of every bank, plus the weights. */
#define EPD_MAX_BUFFERS (EPD_BUF_KINDS * EPD_NUM_BANKS + 1)

/* What the client asks for. 64 bytes. */
typedef struct epd_desc {
  uint32_t op;         /* EPD_OP_* */
  uint32_t flags;      /* EPD_DESC_* */
  uint32_t num_tokens; /* dispatch: tokens in x (0..max_tokens); combine: ignored (from dispatch) */
  uint32_t bank;       /* 0..EPD_NUM_BANKS-1; a combine uses the bank of its dispatch */
  uint64_t user_tag;   /* echoed in the completion */
  uint32_t reserved[10];
} epd_desc_t;

/* What the daemon answers. 64 bytes. */
typedef struct epd_comp {
  int32_t status;       /* epd_result_t of the op */
  int32_t peer;         /* on timeout/peer errors: the rank waited for, else -1 */
  uint32_t map_version; /* expert map version the op's dispatch used */
  uint32_t num_recv;    /* HT dispatch: tokens received; LL dispatch: total received (all slots) */
  uint64_t step;        /* group step number the op ran as */
  uint64_t user_tag;    /* from the descriptor */
  uint64_t latency_ns;  /* from the last rank's submission to completion */
  /* Groups with on_rank_loss = EPD_RANK_LOSS_MASK (docs/SEMANTICS.md "Masked ranks"): the world ranks
   * masked in the step (bit r: rank r took no part and no token went to it; 0: none). */
  uint64_t masked;
  /* Top-k entries of this rank's tokens dropped in the step's dispatch because no replica of their expert
   * was on a live rank; a combine reports its dispatch's plus the entries routed to ranks masked since. */
  uint32_t dropped;
  uint32_t reserved[3];
} epd_comp_t;

/* One submission slot: 256 bytes; the state word has its own 128-byte line. */
typedef struct epd_slot {
  epd_desc_t desc;
  epd_comp_t comp;
  uint32_t state; /* EPD_SLOT_* */
  uint32_t pad0;
  uint64_t twin_host; /* device twin only: device address of the host copy of this slot (see above) */
  uint32_t pad[28];
} epd_slot_t;

/* A client's queue. The header is written by the daemon at attach; heartbeat by the client. */
typedef struct epd_queue {
  uint32_t magic;       /* EPD_QUEUE_MAGIC */
  uint32_t abi_version; /* EPD_ABI_VERSION */
  uint32_t nslots;      /* EPD_QUEUE_SLOTS */
  uint32_t rank;
  uint64_t client_id;
  uint64_t heartbeat;        /* client: bumped while alive (host-side liveness is the attach socket) */
  int32_t sticky_error;      /* daemon: first error of any op, cleared by epd_clear_error */
  uint32_t map_version;      /* daemon: active expert map version of the group */
  uint64_t steps_done;       /* daemon: ops completed on this queue */
  uint32_t map_table_offset; /* daemon: offset of the epd_map_table_t in the queue mapping, 0: none */
  uint32_t qflags;           /* daemon: EPD_QF_* */
  uint64_t dq_offset;        /* daemon: offset of the device twin in the IO arena, 0: none (host backend) */
  uint64_t masked_ranks;     /* daemon: the group's world ranks masked now (on_rank_loss = mask), bit r */
  uint32_t pad0[14];
  epd_slot_t slot[EPD_QUEUE_SLOTS];
} epd_queue_t;

#define EPD_ABI_ASSERT(c, m) _Static_assert(c, m)
#ifdef __cplusplus
#undef EPD_ABI_ASSERT
#define EPD_ABI_ASSERT(c, m) static_assert(c, m)
#endif
EPD_ABI_ASSERT(sizeof(epd_desc_t) == 64, "epd_desc_t is 64 bytes");
EPD_ABI_ASSERT(sizeof(epd_comp_t) == 64, "epd_comp_t is 64 bytes");
EPD_ABI_ASSERT(sizeof(epd_slot_t) == 256, "epd_slot_t is 256 bytes");
EPD_ABI_ASSERT(sizeof(epd_queue_t) == 128 + 256 * EPD_QUEUE_SLOTS, "epd_queue_t layout");
EPD_ABI_ASSERT(offsetof(epd_queue_t, dq_offset) == 56, "epd_queue_t.dq_offset at 56");
EPD_ABI_ASSERT(offsetof(epd_queue_t, masked_ranks) == 64, "epd_queue_t.masked_ranks at 64");
EPD_ABI_ASSERT(offsetof(epd_comp_t, masked) == 40, "epd_comp_t.masked at 40");
EPD_ABI_ASSERT(offsetof(epd_slot_t, twin_host) == 136, "epd_slot_t.twin_host at 136");

/* The active expert map, mapped read-only in meaning for the client: written by the daemon into the
 * queue memory (at queue.map_table_offset) at attach and at every map switch, before the first op that
 * runs on the new version completes. A seqlock: the daemon makes seq odd, writes, makes it even again;
 * a reader copies what it needs and retries while seq was odd or changed (libepd does this).
 * After the 64-byte header, in this order (E = num_experts, X = max_replicas, R, S = slots_per_rank):
 *   uint32_t nrep[E];            replicas of each logical expert
 *   uint32_t rep[E][X][2];       (rank, slot) of each replica
 *   int32_t  slot_expert[R][S];  logical expert held by each physical slot, -1 for a free slot */
#define EPD_MAP_TABLE_MAGIC 0x4550444du /* "EPDM" */
typedef struct epd_map_table {
  uint32_t magic;
  uint32_t seq;
  uint32_t version;
  uint32_t num_experts, num_ranks, slots_per_rank, max_replicas;
  uint32_t ranks_per_node;
  uint64_t step; /* group step at which this version became active */
  uint32_t pad[6];
} epd_map_table_t;
EPD_ABI_ASSERT(sizeof(epd_map_table_t) == 64, "epd_map_table_t is 64 bytes");
static inline uint64_t epd_map_table_bytes(uint32_t num_experts, uint32_t max_replicas, uint32_t num_ranks,
                                           uint32_t slots_per_rank) {
  return sizeof(epd_map_table_t) + 4ull * num_experts + 8ull * num_experts * max_replicas +
         4ull * num_ranks * slots_per_rank;
}

/* Packing of a source reference in *_RECV_SRC. */
#define EPD_SRC_PACK(rank, tok) ((int32_t)(((uint32_t)(rank) << 24) | ((uint32_t)(tok)&0xffffffu)))
#define EPD_SRC_RANK(v) ((int)(((uint32_t)(v)) >> 24))
#define EPD_SRC_TOKEN(v) ((int)(((uint32_t)(v)) & 0xffffffu))

#endif /* EPD_ABI_H */
