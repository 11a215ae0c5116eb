/*
 * engine_internal.h - what the engine core (engine.c) shares with its backends (engine_host.c,
 * engine_cuda.c): the group and client structs and the backend vtable.
 *
 * Locking: one engine mutex (eng->mu) guards every group, client, map and counter. The core calls
 * every backend op with it held except create/destroy/start/stop; backend threads take it to look at
 * clients and groups. One lock keeps detach (which frees a client's memory) trivially safe against the
 * threads that execute steps on that memory; the host backend's steps are short enough for it.
 */
#ifndef EPD_ENGINE_INTERNAL_H
#define EPD_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>

#include "core/engine.h"
#include "core/ref.h"

typedef struct eng_group eng_group_t;
typedef struct eng_client eng_client_t;

struct eng_client {
  eng_client_t *next; /* engine's client list */
  uint64_t id;
  char name[EPD_CLIENT_NAME_MAX];
  eng_group_t *grp;
  int rank;
  uint32_t pid, uid, gid;
  uint64_t attached_ns; /* CLOCK_REALTIME */
  uint64_t ops;
  /* Memory, owned by the backend: fds handed to the client, and the daemon's own view of it (NULL
   * where the daemon cannot address it from the CPU). */
  int queue_fd, arena_fd;
  uint64_t queue_bytes, arena_bytes;
  epd_queue_t *queue;
  uint8_t *arena;
  void *be; /* backend private */
  /* Host backend progress: next ring slot to execute, and whether the client has joined the group's
   * step being collected. */
  uint32_t next_slot;
  int in_step;
  /* Its rank made a step time out and it has not submitted since (hung, or very slow): a new attach of
   * the same (group, rank) replaces it instead of failing with EPD_ERR_BUSY. */
  int hung;
};

/* Scale-out: the weights of a staged copy whose source rank is on another node, sent by that node when it
 * staged the map (net/weights.c, CTL_WEIGHTS) and kept here, on the destination's node, until the switch
 * writes them into the destination slot. */
typedef struct eng_wblob {
  struct eng_wblob *next;
  epd_weight_copy_t cp;
  uint32_t version; /* the map version whose copies carried it (the copy's staged_copy_meta version) */
  int status;       /* EPD_OK, or why the source node could not read them (then no bytes) */
  char why[160];
  uint64_t bytes;
  uint8_t *data;
} eng_wblob_t;

/* Per staged weight copy (parallel to eng_group.staged_copies). */
typedef struct eng_copy_meta {
  uint32_t version;   /* the map version that asked for it */
  uint64_t staged_ns; /* this node's first step frame after staging it (eng_now_ns), 0 before */
} eng_copy_meta_t;

/* Scale-out: a copy from one of this node's ranks into another node whose source slot could not be read
 * when the map was staged (its client not attached, or an older staged copy still fills it); retried at
 * every step frame of the group (net/maps.c). */
typedef struct eng_wdefer {
  struct eng_wdefer *next;
  epd_weight_copy_t cp;
  uint32_t version;
} eng_wdefer_t;

struct eng_group {
  eng_group_t *next;
  uint64_t serial; /* unique per engine: a re-created group is a different one even at the same address */
  char name[EPD_GROUP_NAME_MAX];
  epd_ref_geom_t g;
  eng_client_t *client[EPD_MAX_RANKS]; /* the attached client of each rank, or NULL */
  int lost[EPD_MAX_RANKS];             /* the rank's client died; steps fail until it re-attaches */
  /* Rank loss (docs/SEMANTICS.md "Masked ranks"): the policy (EPD_RANK_LOSS_*), the ranks masked now
   * (they take no part in steps, no token goes to them), the active map without their replicas (while
   * mask != 0), the banks whose dispatch ran and whose combine has not (a rank is unmasked only when
   * none is open), counters. */
  uint32_t on_rank_loss, renormalize;
  uint64_t mask;
  epd_expert_map_t mask_map;
  uint32_t open_banks;
  uint64_t entries_dropped, masks;
  uint32_t step_dropped[EPD_MAX_RANKS]; /* host: entries of each rank's tokens dropped in the step */
  uint64_t plan_mask[EPD_NUM_BANKS];    /* the mask each bank's dispatch ran with */
  epd_expert_map_t map;                 /* active */
  epd_expert_map_t staged;              /* valid if has_staged */
  int has_staged;
  uint32_t last_version;              /* highest version handed out */
  uint32_t rehome_version;            /* the last map eng_rehome staged (0: none) */
  epd_ref_plan_t plan[EPD_NUM_BANKS]; /* routing of each bank's last dispatch (combine input) */
  int plan_valid[EPD_NUM_BANKS];
  uint64_t steps;          /* steps finished; the number of the step being collected */
  uint64_t *expert_tokens; /* [E] cumulative */
  uint64_t *slot_tokens;   /* [R*S] cumulative */
  /* Expert placement (engine.c): the weights region of every client, the weight copies the staged map
   * needs before it becomes active (done at the switch, the switch waits for them), counters. */
  uint64_t weight_bytes_per_slot; /* 0: no EPD_BUF_EXPERT_WEIGHTS */
  epd_weight_copy_t *staged_copies;
  eng_copy_meta_t *staged_copy_meta; /* [nstaged_copies] */
  uint32_t nstaged_copies;
  eng_wblob_t *wblobs;  /* scale-out: weights received from other nodes for staged copies into this node */
  eng_wdefer_t *wdefer; /* scale-out: reads of this node's source slots still to do */
  uint64_t map_switches, weight_bytes_copied;
  /* Arena layout of every client of the group. */
  uint32_t nbufs;
  epd_buffer_desc_t bufs[EPD_MAX_BUFFERS];
  uint64_t arena_bytes;
  void *be;  /* the backend's state of the group (ops->group_free releases it), NULL: none */
  void *net; /* the scale-out layer's state of the group (eng_scaleout_t), NULL on one node */
};

typedef struct eng_rank_stats {
  uint64_t ops, bytes_sent, timeouts, errors;
  uint64_t wait_ns_by_peer[EPD_MAX_RANKS];
} eng_rank_stats_t;

/* A backend. Ops marked (mu) are called with eng->mu held. */
typedef struct eng_backend_ops {
  const char *name; /* "host", "cuda" */
  /* 1 if usable on this machine (auto selection); why gets the reason when not. */
  int (*available)(char *why, size_t whylen);
  /* Set eng->be up (devices, windows) and start the rank threads. */
  epd_result_t (*create)(epd_engine_t *eng, char *err, size_t errlen);
  /* Stop the threads, fail what is in flight, release eng->be (clients are freed by the core after). */
  void (*destroy)(epd_engine_t *eng);
  /* "host-threads", "persistent", "launch". */
  const char *(*mode)(const epd_engine_t *eng);
  /* Device ordinal of a rank, -1 for host memory. */
  int (*device)(const epd_engine_t *eng, int rank);
  /* The UUID of a rank's GPU (16 bytes, as cuDeviceGetUuid) into out: 1, or 0 where there is none
   * (NULL on the host backend). */
  int (*device_uuid)(const epd_engine_t *eng, int rank, uint8_t out[16]);
  /* Bytes of daemon-side buffers of a rank (windows), not counting client arenas. */
  uint64_t (*rank_bytes)(const epd_engine_t *eng, int rank);
  /* (mu) Allocate c->queue_bytes of queue and c->arena_bytes of arena; set the fds (and c->queue /
   * c->arena where CPU-visible) and write the queue header. */
  epd_result_t (*client_alloc)(epd_engine_t *eng, eng_client_t *c, char *err, size_t errlen);
  /* (mu) The client is leaving (lost: it died): stop using its queue, fail peers' pending steps. */
  void (*client_leave)(epd_engine_t *eng, eng_client_t *c, int lost);
  /* (mu) Release the client's memory and fds. */
  void (*client_free)(epd_engine_t *eng, eng_client_t *c);
  /* Optional: release grp->be (the group is freed). */
  void (*group_free)(eng_group_t *grp);
  /* (mu) Optional: run the staged map's weight copies (grp->staged_copies) between the clients'
   * EPD_BUF_EXPERT_WEIGHTS regions and return when they are done; returns bytes copied. NULL: the
   * regions are CPU-visible (c->arena) and the core copies them with memmove. */
  uint64_t (*copy_weights)(epd_engine_t *eng, eng_group_t *grp);
  /* (mu) Optional: copy n bytes at offset off of client c's arena to host memory (write 0) or from it
   * (write 1), synchronously. NULL: c->arena is CPU-visible. */
  epd_result_t (*arena_io)(epd_engine_t *eng, eng_client_t *c, uint64_t off, void *host, uint64_t n,
                           int write, char *err, size_t errlen);
  /* (mu) Optional: what the next step of grp (NULL: of every group) must do changed - a map was staged
   * (it switches at the next executing dispatch), draining began (no new dispatch); return once no step
   * can execute without seeing it (a backend that runs steps without its threads stops doing so). */
  void (*sync_steps)(epd_engine_t *eng, eng_group_t *grp);
  /* Optional: across nodes, what the start-up probe found for GIN (NULL: not applicable). */
  const char *(*gin)(const epd_engine_t *eng);
  /* (mu) Optional: how grp's steps run now (NULL: the engine's mode). */
  const char *(*group_mode)(epd_engine_t *eng, eng_group_t *grp);
  /* (mu) Optional, across nodes: make the world communicator again over this id
   * (EPD_CLUSTER_COMM_ID_BYTES) with the nodes in live (bit k: node k; 0: every node, a restarted node
   * joining the running world; else the nodes left after a node was lost mid-exchange). NULL: the
   * backend has none. */
  void (*world_remake)(epd_engine_t *eng, const uint8_t *id, uint64_t live);
  /* (mu) Optional, across nodes: node `node`'s word on step `step` of group (epd_net_step_off: what, why;
   * code: the status a step given up failed with, EPD_NET_OFF_NO; nodes: those of the step,
   * EPD_NET_OFF_READY).
   * NULL: the backend's steps need no such word (the host backend's exchanges are frames of the step). */
  void (*step_off)(epd_engine_t *eng, const char *group, uint64_t step, uint32_t node, int what, int peer,
                   int code, uint64_t nodes, const char *why);
  /* Optional: a new id for the world communicator of a scale-out rendezvous (EPD_CLUSTER_COMM_ID_BYTES);
   * -1 with why where the backend cannot start here. NULL: the backend needs none. */
  int (*world_id)(uint8_t *id, char *why, size_t whylen);
  /* (mu) Optional, across nodes: the first step of grp that a drain beginning now refuses (NULL: the
   * group's next step, grp->steps). */
  uint64_t (*drain_step)(const eng_group_t *grp);
  /* How steps cross nodes: "host-tcp", "nccl-p2p". */
  const char *inter_node_transport;
  /* Runs groups with on_rank_loss = EPD_RANK_LOSS_MASK: 1 on one node, 2 across nodes too; renormalizes:
   * also with renormalize = 1. */
  int masks, renormalizes;
} eng_backend_ops_t;

/* Scale-out as the core sees it: what it tells the layer that joins this node's engine to the other
 * nodes' (daemon/net/), and what it asks. A backend that runs across nodes installs the table in eng->so
 * at create; NULL on one node. Called with eng->mu held, except set_map. */
typedef struct eng_scaleout {
  /* A group was made here: set grp->net up (the layer's state of the group). */
  epd_result_t (*group_init)(epd_engine_t *eng, eng_group_t *grp);
  /* Its first attach succeeded (created), or a worker attached to a rank whose client was lost. */
  void (*group_created)(epd_engine_t *eng, eng_group_t *grp);
  void (*rank_back)(epd_engine_t *eng, eng_group_t *grp, int rank);
  /* A rank of this node was masked (masked = 1) or unmasked in a group that masks lost ranks. */
  void (*rank_masked)(epd_engine_t *eng, eng_group_t *grp, int rank, int masked);
  /* Its last client left: it is removed on this node. */
  void (*group_removed)(epd_engine_t *eng, eng_group_t *grp);
  /* Free grp->net (also on the way out of a failed group_init). */
  void (*group_free)(eng_group_t *grp);
  /* This node drains (drain = 1) or takes steps again. */
  void (*notify_drain)(epd_engine_t *eng, int drain);
  /* SetExpertMap across nodes: node 0 numbers, stages and sends every map (without mu). */
  /* (mu) Node 0: stage a map the daemon made itself (re-homing, eng_rehome) on every node, as SetExpertMap
   * does; the other nodes: EPD_ERR_UNSUPPORTED (node 0 decides). */
  epd_result_t (*stage_map)(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *map,
                            const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                            char *errbuf, size_t errlen);
  epd_result_t (*set_map)(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                          const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                          char *errbuf, size_t errlen);
  /* What the other nodes said about grp (drains, removals), "" when nothing: for its status. */
  void (*group_note)(const eng_group_t *grp, uint32_t nodes, char *out, size_t len);
  /* Links and traffic for the engine's status. */
  void (*links)(const epd_engine_t *eng, char *out, size_t len, uint64_t *down, uint64_t *tx_bytes,
                uint64_t *rx_bytes, uint64_t *tx_frames, uint64_t *rx_frames);
} eng_scaleout_t;

struct epd_engine {
  epd_engine_opts_t o;
  const eng_backend_ops_t *ops;
  const eng_scaleout_t *so; /* NULL on one node */
  void *be;
  epd_engine_event_fn on_event;
  void *event_arg;
  pthread_mutex_t mu;
  eng_group_t *groups;
  uint32_t ngroups;
  eng_client_t *clients;
  uint32_t nclients;
  uint64_t next_client_id;
  uint64_t next_group_serial;
  int draining;
  epd_op_snap_t opstat[EPD_OP_MAX];
  eng_rank_stats_t rank[EPD_MAX_RANKS];
  /* Set once by eng_fail when the backend can no longer run steps (a sticky CUDA error); read without
   * the lock by epd_engine_failure. */
  _Atomic int failed;
  char failed_msg[256];
};

/* The backends the engine is built with, in the order "auto" tries them (the last one is always usable),
 * NULL-terminated: the table is the daemon's (control/backends.c), the core knows no backend by name. */
extern const eng_backend_ops_t *const eng_backends[];

/* Core helpers for backends, all (mu). */
uint64_t eng_now_ns(void); /* CLOCK_MONOTONIC */
/* (mu) Mark the engine failed for good (first message wins); emits an "error" event and logs it. */
void eng_fail(epd_engine_t *eng, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* (mu) Mark the client of `rank` hung after a step timed out waiting for it (no-op for a remote or
 * unattached rank). */
void eng_mark_hung(eng_group_t *grp, int rank);
/* Emit an event to the engine's sink (message formatted). */
void eng_emit(epd_engine_t *eng, const char *kind, const eng_group_t *grp, int rank, uint64_t client_id,
              uint32_t old_version, uint32_t new_version, uint64_t step, const char *fmt, ...)
    __attribute__((format(printf, 9, 10)));
/* At a dispatch step boundary: do the staged map's weight copies, make it active, publish it in every
 * client's map table (emits map_switch). */
void eng_apply_staged_map(epd_engine_t *eng, eng_group_t *grp);
/* (mu) Scale-out: make the staged map of m's version active with the first ncopies staged weight
 * copies (those it carried), even if a newer map was staged since (it stays staged with the remaining
 * copies); -1 if no map of that version or newer is staged. */
int eng_apply_staged_version(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *m,
                             uint32_t ncopies);
/* (mu) The group of that name, or NULL. */
eng_group_t *eng_find_group(epd_engine_t *eng, const char *name);
/* (mu) engine.rehome_replicas, after grp masked a rank: stage a map that gives each masked replica of an
 * expert with a live one a free slot of a live rank, its weights copied from the live replica; an event
 * names the experts with none ("experts_lost"). Groups with expert weights; across nodes node 0 only
 * (through the layer's stage_map); no map staged but one of its own. */
void eng_rehome(epd_engine_t *eng, eng_group_t *grp);
/* (mu) Validate map (and its copies if check) and stage it with `version` (0: the group's next one). */
epd_result_t eng_stage_map(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *map,
                           const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t version, int check,
                           uint32_t *version_out, char *errbuf, size_t errlen);
/* Scale-out weight copies (engine.c). A copy is local to a node where its rank is; a copy whose source is
 * on another node gets its bytes from that node (eng_wblob_t).
 * (mu) Read (write 0) or write (write 1) bytes off .. off + len of the weights of (rank, slot) of grp's
 * attached client on this node (a slot holds grp->weight_bytes_per_slot), into or from host memory. */
epd_result_t eng_slot_weights_io(epd_engine_t *eng, eng_group_t *grp, uint32_t rank, uint32_t slot,
                                 uint64_t off, uint64_t len, void *host, int write, char *err, size_t errlen);
/* 1 if world rank r is on this node. */
int eng_rank_local(const epd_engine_t *eng, uint32_t r);
/* (mu) Keep received weights (takes data; replaces a blob of the same copy and version). */
void eng_wblob_put(eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version, int status,
                   const char *why, uint8_t *data, uint64_t bytes);
/* (mu) 1 if every staged copy into this node from another node has its bytes (or its source's error), or
 * has waited for them longer than eng_weights_wait_ms (the switch then skips it with an event). */
int eng_weights_ready(const epd_engine_t *eng, const eng_group_t *grp);
uint32_t eng_weights_wait_ms(const epd_engine_t *eng);
/* (mu) At a step frame of grp on this node: the staged copies' wait for bytes starts now if not yet (every
 * rank is attached then, so every source node can read its slots from here on). */
void eng_weights_clock(eng_group_t *grp);
/* (mu) 1 if (rank, slot) is the destination of a staged copy of a map older than version v (its contents
 * are not final until that copy ran here). */
int eng_slot_being_filled(const eng_group_t *grp, uint32_t rank, uint32_t slot, uint32_t v);
/* (mu) Staged copy i, into this node from another node: write the received bytes into its destination
 * slot (an event tells why not); returns bytes written. */
uint64_t eng_weights_from_node(epd_engine_t *eng, eng_group_t *grp, uint32_t i);
/* Account one finished op of one rank (status, bytes it sent, latency). */
void eng_record_op(epd_engine_t *eng, int rank, uint32_t op, int status, uint64_t bytes, uint64_t latency_ns);
/* Name of a result code ("EPD_ERR_TIMEOUT"); the daemon does not link libepd's epd_strerror. */
const char *eng_result_name(int result);
/* Offset of buffer (kind, bank) in the arenas of grp's clients, UINT64_MAX if it has none. */
uint64_t eng_buf_offset(const eng_group_t *g, uint32_t kind, uint32_t bank);
/* Address of buffer (kind, bank) in a client's CPU-visible arena. */
void *eng_buf(const eng_client_t *c, uint32_t kind, uint32_t bank);
/* (mu) The reference's view of client c's arena for a dispatch in `mode` (EPD_MODE_LL/HT) on `bank`: its
 * inputs (num_tokens tokens) and the receive buffers the dispatch writes. Both host steps (one node, and
 * across nodes) bind the arenas with it. */
void eng_ref_io(eng_client_t *c, int mode, uint32_t bank, uint32_t num_tokens, epd_ref_in_t *in,
                epd_ref_out_t *out);
/* Between the core's files (maps.c, engine.c): the bytes of a client's queue mapping (the queue, then the
 * map table), writing the group's active map into a client's map table, freeing a weight blob, and
 * (mu) publishing grp->mask (its masked map, every client's queue word). */
uint64_t eng_queue_bytes(const eng_group_t *grp);
void eng_map_table_write(eng_client_t *c);
void eng_wblob_free(eng_wblob_t *b);
void eng_mask_changed(epd_engine_t *eng, eng_group_t *grp);
/* The inputs alone (a node's own tokens routed across nodes), and the expert outputs a combine reads. */
epd_ref_in_t eng_ref_in(eng_client_t *c, uint32_t bank, uint32_t num_tokens);
const uint16_t *eng_ref_y(eng_client_t *c, int mode, uint32_t bank);

/* Queues and slots, shared by the backends. */
/* A memfd "epd-<what>-<client id>" of `bytes` for client c, mapped in *map; fd or -1 (err). */
int eng_client_memfd(const eng_client_t *c, const char *what, uint64_t bytes, void **map, char *err,
                     size_t errlen);
/* (mu) Write the header of c's fresh (zeroed: every slot FREE) queue q and start c's ring at slot 0. */
void eng_queue_init(eng_client_t *c, epd_queue_t *q);
/* An op a step can run (LL or HT, dispatch or combine). */
static inline int eng_op_ok(uint32_t op) {
  return op >= EPD_OP_LL_DISPATCH && op <= EPD_OP_HT_COMBINE;
}
/* A dispatch op (LL or HT). */
static inline int eng_op_dispatch(uint32_t op) {
  return op == EPD_OP_LL_DISPATCH || op == EPD_OP_HT_DISPATCH;
}

/* The descriptor flags a dispatch `op` may carry (EPD_DESC_HT_DENSE: HT only); any other bit is invalid. */
static inline uint32_t eng_dispatch_flags(uint32_t op) {
  return EPD_DESC_FP8 | (op == EPD_OP_HT_DISPATCH ? (uint32_t)EPD_DESC_HT_DENSE : 0u);
}
/* The flags of rank r's descriptor d (every backend checks them this way): EPD_OK for any op but a
 * dispatch; EPD_ERR_UNSUPPORTED for the dense HT layout across nodes (across_nodes); EPD_ERR_INVALID for a
 * flag the dispatch does not take. why (wl bytes) says which. */
static inline int eng_check_flags(const epd_desc_t *d, uint32_t r, int across_nodes, char *why, size_t wl) {
  if (!eng_op_dispatch(d->op)) return EPD_OK;
  if (across_nodes && d->op == EPD_OP_HT_DISPATCH && (d->flags & EPD_DESC_HT_DENSE)) {
    snprintf(why, wl, "rank %u: the dense HT layout (flags 0x%x) is not available across nodes", r, d->flags);
    return EPD_ERR_UNSUPPORTED;
  }
  if (d->flags & ~eng_dispatch_flags(d->op)) {
    snprintf(why, wl, "rank %u: unknown flags 0x%x", r, d->flags);
    return EPD_ERR_INVALID;
  }
  return EPD_OK;
}
/* A slot's state word (acquire: the descriptor written before SUBMITTED is visible after). */
static inline uint32_t eng_slot_state(epd_slot_t *s) {
  return atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire);
}
/* (mu) Write comp into slot s of queue q, account it in q's header (sticky error, map version, steps
 * done), then mark the slot DONE (release: the client sees all of it once it sees DONE). */
void eng_slot_complete(epd_queue_t *q, epd_slot_t *s, const epd_comp_t *comp, uint32_t map_version);

/* Step bookkeeping, shared by the backends. */
/* (mu) The first rank of grp whose client died and has not been replaced (why gets the message), or -1. */
int eng_lost_rank(const eng_group_t *grp, char *why, size_t len);
/* The first rank of num_ranks not in arrived[] (-1: none); why gets the step timeout message. */
int eng_timeout_rank(const epd_engine_t *eng, const int *arrived, uint32_t num_ranks, char *why, size_t len);

/* Rank threads. */
/* Name the calling thread "<prefix><rank>" and give it a small timer slack for short sleeps. */
void eng_rank_thread_init(const char *prefix, int rank);
/* Sleep ns nanoseconds (less than a second). */
void eng_sleep_ns(long ns);

/* (mu) Masked ranks (engine.c): mask a rank from the group's next step (why: the event's text), unmask
 * it (a worker attached to it again and its first dispatch joins), the map a dispatch routes with (the
 * active one, without the masked ranks' replicas while any is masked), and the number of ranks a step
 * waits for. */
void eng_mask_rank(epd_engine_t *eng, eng_group_t *grp, int rank, const char *why);
void eng_unmask_rank(epd_engine_t *eng, eng_group_t *grp, int rank);
/* Is world rank `rank` one of this node's? */
int eng_local_rank(const epd_engine_t *eng, int rank);
const epd_expert_map_t *eng_route_map(const eng_group_t *grp);
uint32_t eng_live_ranks(const eng_group_t *grp);
/* (mu) 1 if c is the only client of its group (the group goes with it). */
int eng_last_client(const eng_group_t *grp, const eng_client_t *c);

#endif /* EPD_ENGINE_INTERNAL_H */
