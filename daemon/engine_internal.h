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

#include "engine.h"
#include "ref.h"

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
 * staged the map (engine_net.c, CTL_WEIGHTS) and kept here, on the destination's node, until the switch
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
 * every step frame of the group (engine_net.c). */
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
  epd_expert_map_t map;                /* active */
  epd_expert_map_t staged;             /* valid if has_staged */
  int has_staged;
  uint32_t last_version;               /* highest version handed out */
  epd_ref_plan_t plan[EPD_NUM_BANKS];  /* routing of each bank's last dispatch (combine input) */
  int plan_valid[EPD_NUM_BANKS];
  uint64_t steps;                      /* steps finished; the number of the step being collected */
  uint64_t *expert_tokens;             /* [E] cumulative */
  uint64_t *slot_tokens;               /* [R*S] cumulative */
  /* Expert placement (engine.c): the weights region of every client, the weight copies the staged map
   * needs before it becomes active (done at the switch, the switch waits for them), counters. */
  uint64_t weight_bytes_per_slot;      /* 0: no EPD_BUF_EXPERT_WEIGHTS */
  epd_weight_copy_t *staged_copies;
  eng_copy_meta_t *staged_copy_meta; /* [nstaged_copies] */
  uint32_t nstaged_copies;
  eng_wblob_t *wblobs;   /* scale-out: weights received from other nodes for staged copies into this node */
  eng_wdefer_t *wdefer;  /* scale-out: reads of this node's source slots still to do */
  uint64_t map_switches, weight_bytes_copied;
  /* Arena layout of every client of the group. */
  uint32_t nbufs;
  epd_buffer_desc_t bufs[EPD_MAX_BUFFERS];
  uint64_t arena_bytes;
  /* Step being collected (host backend). */
  uint32_t narrived;
  int arrived[EPD_MAX_RANKS];
  epd_desc_t desc[EPD_MAX_RANKS];
  uint64_t arrive_ns[EPD_MAX_RANKS];
  uint64_t first_arrive_ns;
  void *net; /* scale-out state (engine_net.c), NULL on one node */
  /* Scale-out: node n drains (its notice, engine_net.c): it takes no dispatch of this group numbered >=
   * drain_from[n] (it still runs combines); UINT64_MAX: not draining. */
  uint64_t drain_from[EPD_MAX_RANKS];
  /* Scale-out: node n has no client of this group since its step gone_from[n] (its notice; the group was
   * removed there): a step numbered >= that whose part from node n is not in fails here at once with
   * EPD_ERR_PEER. UINT64_MAX: the group exists there (or nothing was heard). */
  uint64_t gone_from[EPD_MAX_RANKS];
  /* Scale-out: the client of world rank r (of another node) died there at that node's step lost_from[r]
   * (its notice) and the group stays there for a new attach of the rank: a step numbered >= that whose
   * part from that node is not in fails here at once with EPD_ERR_PEER naming r. UINT64_MAX: none. */
  uint64_t lost_from[EPD_MAX_RANKS];
  uint64_t frames_since; /* scale-out: the link frames received before this group was made (epd_net_take_payload's later) */
  /* Scale-out: made while the other nodes may step the group already (a worker restarted): its first
   * part waits for every other node's reply (bit n of join_wait: node n's is due), and it takes the
   * step the others are at (join_step; see eng_net_joining). */
  uint64_t join_wait, join_step, join_ns;
  uint32_t join_map_version; /* the map the node at join_step runs, and its hash */
  uint64_t join_map_hash;
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
  /* (mu) Optional: run the staged map's weight copies (grp->staged_copies) between the clients'
   * EPD_BUF_EXPERT_WEIGHTS regions and return when they are done; returns bytes copied. NULL: the
   * regions are CPU-visible (c->arena) and the core copies them with memmove. */
  uint64_t (*copy_weights)(epd_engine_t *eng, eng_group_t *grp);
  /* (mu) Optional: copy n bytes at offset off of client c's arena to host memory (write 0) or from it
   * (write 1), synchronously. NULL: c->arena is CPU-visible. */
  epd_result_t (*arena_io)(epd_engine_t *eng, eng_client_t *c, uint64_t off, void *host, uint64_t n, int write,
                           char *err, size_t errlen);
  /* (mu) Optional: what the next step of grp (NULL: of every group) must do changed - a map was staged
   * (it switches at the next executing dispatch), draining began (no new dispatch); return once no step
   * can execute without seeing it (a backend that runs steps without its threads stops doing so). */
  void (*sync_steps)(epd_engine_t *eng, eng_group_t *grp);
  /* Optional: across nodes, what the start-up probe found for GIN (NULL: not applicable). */
  const char *(*gin)(const epd_engine_t *eng);
  /* (mu) Optional: how grp's steps run now (NULL: the engine's mode). */
  const char *(*group_mode)(epd_engine_t *eng, eng_group_t *grp);
  /* (mu) Optional, across nodes: a restarted node joins the running world; make the world communicator
   * again over this id (EPD_CLUSTER_COMM_ID_BYTES) with every other node (NULL: the backend has none). */
  void (*world_remake)(epd_engine_t *eng, const uint8_t *id);
} eng_backend_ops_t;

struct epd_engine {
  epd_engine_opts_t o;
  const eng_backend_ops_t *ops;
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

extern const eng_backend_ops_t eng_host_ops;
/* Defined by engine_cuda.c when the CUDA backend is linked in (weak: absent otherwise). */
#if EPD_WITH_CUDA
/* Strong when CUDA is built: a weak reference would not pull engine_cuda.o out of the static engine
 * library, and the daemon would silently lack the CUDA backend. */
extern const eng_backend_ops_t eng_cuda_ops;
#else
extern const eng_backend_ops_t eng_cuda_ops __attribute__((weak));
#endif

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
int eng_apply_staged_version(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *m, uint32_t ncopies);
/* (mu) The group of that name, or NULL. */
eng_group_t *eng_find_group(epd_engine_t *eng, const char *name);
/* (mu) Validate map (and its copies if check) and stage it with `version` (0: the group's next one). */
epd_result_t eng_stage_map(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *map,
                           const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t version, int check,
                           uint32_t *version_out, char *errbuf, size_t errlen);
/* Scale-out weight copies (engine.c). A copy is local to a node where its rank is; a copy whose source is
 * on another node gets its bytes from that node (eng_wblob_t).
 * (mu) Read (write 0) or write (write 1) bytes off .. off + len of the weights of (rank, slot) of grp's
 * attached client on this node (a slot holds grp->weight_bytes_per_slot), into or from host memory. */
epd_result_t eng_slot_weights_io(epd_engine_t *eng, eng_group_t *grp, uint32_t rank, uint32_t slot, uint64_t off,
                                 uint64_t len, void *host, int write, char *err, size_t errlen);
/* 1 if world rank r is on this node. */
int eng_rank_local(const epd_engine_t *eng, uint32_t r);
/* (mu) Keep received weights (takes data; replaces a blob of the same copy and version). */
void eng_wblob_put(eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version, int status, const char *why,
                   uint8_t *data, uint64_t bytes);
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
void eng_record_op(epd_engine_t *eng, int rank, uint32_t op, int status, uint64_t bytes,
                   uint64_t latency_ns);
/* Name of a result code ("EPD_ERR_TIMEOUT"); the daemon does not link libepd's epd_strerror. */
const char *eng_result_name(int result);
/* Offset of buffer (kind, bank) in the arenas of grp's clients, UINT64_MAX if it has none. */
uint64_t eng_buf_offset(const eng_group_t *g, uint32_t kind, uint32_t bank);
/* Address of buffer (kind, bank) in a client's CPU-visible arena. */
void *eng_buf(const eng_client_t *c, uint32_t kind, uint32_t bank);

/* Queues and slots, shared by the backends. */
/* A memfd "epd-<what>-<client id>" of `bytes` for client c, mapped in *map; fd or -1 (err). */
int eng_client_memfd(const eng_client_t *c, const char *what, uint64_t bytes, void **map, char *err,
                     size_t errlen);
/* (mu) Write the header of c's fresh (zeroed: every slot FREE) queue q and start c's ring at slot 0. */
void eng_queue_init(eng_client_t *c, epd_queue_t *q);
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

/* Scale-out hooks of the host backend (engine_net.c), used when eng->o.nodes > 1. The outcome of a
 * step that ran (or failed) across nodes: */
typedef struct eng_net_result {
  int status, peer;
  uint32_t map_version;
  uint32_t num_recv[EPD_MAX_RANKS];
  uint64_t bytes[EPD_MAX_RANKS];
  char why[256];
} eng_net_result_t;
/* (mu) Once every local rank of grp has submitted: send this node's part of the step (once), and run
 * the step when every other node's part is in. 1 when *res holds the outcome, 0 while waiting. */
int eng_net_step(epd_engine_t *eng, eng_group_t *grp, eng_net_result_t *res);
/* (mu) The rank a timed-out step waits for (a local rank, or the first rank of a silent node); why
 * gets the timeout message. */
int eng_net_missing_rank(epd_engine_t *eng, const eng_group_t *grp, char *why, size_t len);
/* SetExpertMap across nodes (host backend; called without mu): node 0 stages the map with the next
 * version and sends it to every other node; another node asks node 0 to and waits for its answer. */
epd_result_t eng_net_set_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                             const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                             char *errbuf, size_t errlen);
/* Start / stop the thread that serves map messages from the other nodes (host backend, nodes > 1). */
epd_result_t eng_net_ctl_start(epd_engine_t *eng, char *err, size_t errlen);
void eng_net_ctl_stop(epd_engine_t *eng);
/* (mu) Across nodes: tell every other node, per group, the first step from which this node takes no
 * dispatch now that it drains (drain = 0: that it takes steps again); their dispatches from there on fail
 * with EPD_ERR_DRAINING at once instead of timing out, their combines still run. Nothing lifts a drain today (every caller of
 * epd_engine_set_draining passes 1): with the cuda backend a lift would have to reconcile the steps
 * the peers already refused, whose frames the node would otherwise wait for in its NCCL exchange. */
void eng_net_notify_drain(epd_engine_t *eng, int drain);
/* (mu) A group was just created on this node (its first attach succeeded): stage the newest map node 0
 * sent for it while it did not exist here, so that every node reports the same staged map. */
void eng_net_group_created(epd_engine_t *eng, eng_group_t *grp);
/* (mu) Free grp->net. */
void eng_net_group_free(eng_group_t *grp);
/* (mu) grp is about to be removed on this node (its last client left): tell the other nodes from which
 * step on no part of it comes from here (grp->steps: a part of that step already sent reaches them first,
 * one link in order); eng_net_group_created tells them when it exists again. */
void eng_net_group_removed(epd_engine_t *eng, eng_group_t *grp);
/* (mu) 1 while grp, just made here, waits for the other nodes' replies before its first part goes out
 * (both backends ask before sending a step's part); then it runs from the step they are at. */
int eng_net_joining(epd_engine_t *eng, eng_group_t *grp);
/* The verdict on node n's missing part of step `step` of grp: the world rank to name (why filled) if
 * node n said the group is gone there from that step on, or that the client of one of its ranks died
 * there by then; else -1. */
int eng_net_gone(const eng_group_t *grp, uint32_t n, uint32_t L, uint64_t step, char *why, size_t len);
/* The verdict on node n's part of `step`, missing while its part of a later step came: why filled, returned. */
const char *eng_net_skipped(const char *group, uint32_t n, uint32_t L, uint64_t step, uint64_t later, char *why,
                            size_t len);
/* (mu) The client of local rank `rank` died and grp stays here (other clients remain): tell the other
 * nodes that no part of grp comes from here from step `from` on (the first step whose part was not sent)
 * until the rank is attached again (eng_net_rank_back). */
void eng_net_rank_lost(epd_engine_t *eng, eng_group_t *grp, int rank, uint64_t from);
/* (mu) A new client attached to local rank `rank` after its client died: the other nodes forget the loss
 * and reply with the step they are at; the group here takes it if it is ahead (eng_net_joining). */
void eng_net_rank_back(epd_engine_t *eng, eng_group_t *grp, int rank);
/* (mu) Host backend: the first step of grp whose part this node has not sent. */
uint64_t eng_net_first_unsent(const eng_group_t *grp);
/* (mu) 1 if c is the only client of its group (the group goes with it). */
int eng_last_client(const eng_group_t *grp, const eng_client_t *c);

/* Expert-map switches across nodes (engine_net.c; both backends run this protocol over their step
 * frames): each node reports the map it has staged in its frame of every step; when the frames of a
 * step, from every node, all report the same staged map, every node switches to it at the next step if
 * that is a dispatch (every node sees the same frames, so every node decides the same). */
typedef struct eng_map_vote {
  epd_expert_map_t rep; /* the staged map this node reported in its last frame (version 0: none) */
  uint64_t rep_hash;
  uint32_t rep_copies; /* its staged weight copies */
  int agree;           /* switch to (agree_version, agree_hash) at step agree_step + 1 */
  uint64_t agree_step, agree_hash;
  uint32_t agree_version;
} eng_map_vote_t;
/* What another node's frame of the step says of its maps. */
typedef struct eng_map_peer {
  uint32_t staged_version, map_version;
  uint64_t staged_hash, map_hash;
} eng_map_peer_t;
/* (mu) Remember the staged map this node reports in its frame (a newer one staged later replaces it only
 * at the next frame, so the map every node reported is still at hand when they agree on it). */
void eng_vote_report(epd_engine_t *eng, eng_group_t *grp, eng_map_vote_t *v);
/* (mu) Decide from the other nodes' frames of step `step` (all in) what the next dispatch switches to:
 * the staged map every node reported, or, for a node left behind (a step that failed on it but not
 * elsewhere), the map another node already runs and this one still has staged. */
void eng_vote_agree(eng_map_vote_t *v, const eng_map_peer_t *peers, uint32_t npeers, uint64_t step);
/* (mu) At dispatch step `step`: switch to the map the frames of the step before agreed on. */
void eng_vote_switch(epd_engine_t *eng, eng_group_t *grp, eng_map_vote_t *v, uint64_t step);
/* Free the reported map and forget the vote. */
void eng_vote_reset(eng_map_vote_t *v);

#endif /* EPD_ENGINE_INTERNAL_H */
