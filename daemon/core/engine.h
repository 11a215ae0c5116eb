/*
 * engine.h - the epd engine: ranks, EP groups, client queues and arenas, expert maps, and the
 * execution of dispatch/combine. Two backends sit behind one interface:
 *   host - every rank is a thread over shared memory (memfd arenas); the reference implementation;
 *   cuda - every rank is a GPU driven through NCCL (Device API windows and kernels).
 * The daemon is a host around the engine; the same engine can be driven in-process (bench, library).
 * All functions are thread-safe unless noted.
 */
#ifndef EPD_ENGINE_H
#define EPD_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

#define EPD_GROUP_NAME_MAX 64
#define EPD_CLIENT_NAME_MAX 64
#define EPD_MAX_RANKS 64
#define EPD_MAX_REPLICAS 8

typedef struct epd_engine epd_engine_t;

typedef struct epd_engine_opts {
  const char *backend; /* "host", "cuda" or "auto" (cuda when GPUs and NCCL are usable) */
  int num_ranks;       /* ranks of the node (host: threads; cuda: GPUs, see devices) */
  const int *devices; /* cuda: the GPU of each local rank (num_ranks entries; ranks may share one); NULL: r */
  uint32_t max_experts; /* limits a group's geometry may not exceed */
  uint32_t max_hidden;
  uint32_t max_topk;
  uint32_t max_tokens;
  uint32_t slots_factor_pct;   /* slots per rank = ceil(num_experts/num_ranks * pct/100) (redundancy) */
  uint32_t ht_capacity_factor; /* HT receive capacity = max_tokens * num_ranks (if 0) or this * max_tokens */
  uint32_t ht_sms;             /* cuda: blocks (one per SM) of each HT data kernel; 0: the kernels' default */
  uint32_t ht_ce_split;        /* cuda: copies per dest rank of a copy-engine HT dispatch; 0: the default */
  const char *cuda_mode;       /* cuda: "launch", "persistent" or "auto"/NULL (persistent under MPS) */
  uint32_t ll_blocks;          /* cuda: blocks of each LL kernel per rank; 0: the mode's default / sharing */
  uint64_t idle_spin_ns;       /* cuda: rank threads spin this long after activity before sleeping */
  uint32_t max_groups;
  uint32_t max_clients_per_rank;
  uint64_t max_arena_bytes; /* per client */
  uint32_t step_timeout_ms; /* a rank waiting longer for its peers fails the step with EPD_ERR_TIMEOUT */
  /* groups that mask, with expert weights: a masked rank's replicas of experts that still have a live one
   * are copied to free slots of live ranks (a staged map; node 0's across nodes); SEMANTICS.md */
  uint32_t rehome_replicas;
  uint32_t ranks_per_node; /* node of a rank = rank / ranks_per_node (replica choice); 0: one node */
  uint64_t max_weight_bytes_per_slot; /* limit of an attach's weight_bytes_per_slot; 0: 1 GiB */
  /* Scale-out (engine_net.h): nodes > 1 makes every group span nodes * num_ranks world ranks, this
   * node owning world ranks node_rank * num_ranks ..; needs connected links (and comm_id for cuda). */
  uint32_t nodes, node_rank;
  uint32_t gin_probe;      /* cuda across nodes: probe what NCCL offers for GIN at start-up (collective) */
  uint32_t rendezvous_tls; /* reported only: the rendezvous ran over mutual TLS (cluster.tls_*) */
  struct epd_net *net;
  /* backend cuda across nodes: the world communicator's ncclUniqueId (128 bytes, from the rendezvous) */
  const uint8_t *comm_id;
  /* across nodes: this daemon restarted and joined a running world (cuda: its node-local communicators
   * are its own, no GIN probe: the others do not take part in one) */
  uint32_t rejoined;
} epd_engine_opts_t;

/* Event sink: called from engine threads; must not call back into the engine. */
typedef struct epd_engine_event {
  const char *kind; /* "map_switch", "timeout", "client_lost", "error" */
  const char *group;
  int rank;
  uint64_t client_id;
  uint32_t old_version, new_version;
  uint64_t step;
  const char *message;
} epd_engine_event_t;
typedef void (*epd_engine_event_fn)(void *arg, const epd_engine_event_t *ev);

/* Create the engine and start its rank threads; errbuf receives a message on failure. */
epd_result_t epd_engine_create(const epd_engine_opts_t *opts, epd_engine_event_fn on_event, void *event_arg,
                               epd_engine_t **out, char *errbuf, size_t errlen);
/* A new id for the world communicator of a scale-out rendezvous, made by the named backend ("cuda":
 * ncclGetUniqueId; EPD_CLUSTER_COMM_ID_BYTES). EPD_ERR_UNSUPPORTED with err where that backend is not
 * built, needs no such id, or cannot start on this machine. */
epd_result_t epd_engine_world_id(const char *backend, uint8_t *id, char *err, size_t errlen);
/* Stop the rank threads, fail in-flight steps, free every client and buffer. */
void epd_engine_destroy(epd_engine_t *eng);
/* "host" or "cuda". */
const char *epd_engine_backend(const epd_engine_t *eng);
/* "host-threads", "persistent" or "launch". */
const char *epd_engine_mode(const epd_engine_t *eng);
int epd_engine_num_ranks(const epd_engine_t *eng);
/* Ranks of every group: num_ranks times the nodes of the scale-out world (num_ranks on one node). */
int epd_engine_world_ranks(const epd_engine_t *eng);

/* What an attach asks for; zero geometry fields take the group's. */
typedef struct epd_attach_req {
  char group[EPD_GROUP_NAME_MAX];
  char name[EPD_CLIENT_NAME_MAX];
  int rank;
  uint32_t num_experts, hidden, topk, max_tokens;
  uint32_t pid, uid, gid;
  uint64_t weight_bytes_per_slot; /* 0: no EPD_BUF_EXPERT_WEIGHTS (the first attach fixes it) */
  uint32_t on_rank_loss;          /* EPD_RANK_LOSS_FAIL / _MASK; 0: the group's (FAIL for a new group) */
  uint32_t renormalize;           /* masked groups: renormalise the weights of tokens with dropped entries */
} epd_attach_req_t;

typedef struct epd_buffer_desc {
  uint32_t kind, bank;
  uint64_t offset, bytes;
} epd_buffer_desc_t;

/* What an attach gives: the client's memory and geometry. The fds stay owned by the engine. */
typedef struct epd_attach_info {
  uint64_t client_id;
  int queue_fd, arena_fd;
  uint64_t queue_bytes, arena_bytes;
  int on_gpu, device;
  int has_uuid; /* device_uuid holds the rank's GPU */
  uint8_t device_uuid[16];
  uint32_t num_ranks, num_experts, hidden, topk, max_tokens, slots_per_rank, ht_capacity, map_version;
  uint32_t nbuffers;
  epd_buffer_desc_t buffers[EPD_MAX_BUFFERS];
  uint64_t weight_bytes_per_slot;
} epd_attach_info_t;

/* Attach a client to (group, rank), creating the group on first attach. */
epd_result_t epd_engine_attach(epd_engine_t *eng, const epd_attach_req_t *req, epd_attach_info_t *info,
                               char *errbuf, size_t errlen);
/* Detach a client: quiesce its queue, fail peers' steps that wait for it, free its memory. lost != 0
 * when the client died rather than asked (reported as a client_lost event). */
epd_result_t epd_engine_detach(epd_engine_t *eng, uint64_t client_id, int lost);
/* The queue and arena fds of an attached client (owned by the engine: the caller must not close them;
 * the attach socket sends them with SCM_RIGHTS). EPD_ERR_NOT_FOUND for an unknown client. */
epd_result_t epd_engine_client_fds(epd_engine_t *eng, uint64_t client_id, int *queue_fd, int *arena_fd);
/* NULL while the engine can run steps; else why it cannot (a failed GPU context): the daemon reports
 * state "failed" and health NOT_SERVING, and every new step fails. */
const char *epd_engine_failure(const epd_engine_t *eng);
/* Stop (drain != 0) or resume accepting new steps; in-flight steps finish. */
void epd_engine_set_draining(epd_engine_t *eng, int drain);

/* Expert map of a group: logical expert e has nrep[e] replicas (rank[e][i], slot[e][i]). */
typedef struct epd_expert_map {
  uint32_t version;
  uint32_t num_experts, num_ranks, slots_per_rank;
  uint32_t ranks_per_node;                /* replica choice prefers the source's node; 0: one node */
  uint8_t *nrep;                          /* [num_experts] */
  epd_replica_t (*rep)[EPD_MAX_REPLICAS]; /* [num_experts][EPD_MAX_REPLICAS] */
} epd_expert_map_t;

/* Validate and stage a new map for a group (switched on every rank at the next step boundary);
 * *version_out gets the staged version. Invalid maps are rejected whole with a precise message. */
epd_result_t epd_engine_set_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                uint32_t *version_out, char *errbuf, size_t errlen);
/* A weight copy of a migration: the EPD_BUF_EXPERT_WEIGHTS slot (src_rank, src_slot) is copied to
 * (dst_rank, dst_slot) before the map that carries it becomes active. */
typedef struct epd_weight_copy {
  uint32_t src_rank, src_slot, dst_rank, dst_slot;
} epd_weight_copy_t;
/* epd_engine_set_map with weight copies (ncopies may be 0). Copies need the group's weights region
 * (EPD_ERR_INVALID otherwise); across nodes the source's node sends the bytes (net/weights.c). A map that
 * places a different expert on, or copies from or into, a slot that a staged map's copies still have to fill
 * is rejected with EPD_ERR_BUSY. */
epd_result_t epd_engine_set_map_copies(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                       const epd_weight_copy_t *copies, uint32_t ncopies,
                                       uint32_t *version_out, char *errbuf, size_t errlen);
/* Copy a group's active map (arrays allocated with malloc; free with epd_expert_map_free). */
epd_result_t epd_engine_get_map(epd_engine_t *eng, const char *group, epd_expert_map_t *out);
/* Install map, keeping its version, as the active map of a group that has run no step and staged no
 * map (restore after a restart); EPD_ERR_STATE otherwise, validation errors as epd_engine_set_map. */
epd_result_t epd_engine_restore_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                    char *errbuf, size_t errlen);
void epd_expert_map_free(epd_expert_map_t *map);

/* A snapshot for status and metrics (see metrics.h); arrays malloc'ed, free with ..._free. */
typedef struct epd_group_snap {
  char name[EPD_GROUP_NAME_MAX];
  uint32_t num_experts, hidden, topk, max_tokens, slots_per_rank, attached_ranks, map_version;
  uint64_t steps;
  uint64_t *expert_tokens; /* [num_experts] tokens routed to each logical expert, cumulative */
  uint32_t num_ranks;
  uint64_t *slot_tokens; /* [num_ranks * slots_per_rank] tokens routed to each physical slot (replica) */
  uint64_t map_switches, weight_bytes_copied;
  char mode[16]; /* how its steps run now ("persistent": in the CUDA backend's persistent kernels) */
  /* Across nodes: the other nodes that removed the group or drain ("node 1 removed it at step 7; node 2
   * drains from step 12"); empty when none (or one node). */
  char nodes[160];
  uint32_t on_rank_loss, renormalize; /* EPD_RANK_LOSS_* */
  uint64_t masked_ranks;              /* bit r: world rank r masked now */
  uint64_t entries_dropped, masks;    /* cumulative: top-k entries dropped, ranks masked */
} epd_group_snap_t;
typedef struct epd_client_snap {
  uint64_t client_id;
  char name[EPD_CLIENT_NAME_MAX], group[EPD_GROUP_NAME_MAX];
  int rank;
  uint32_t pid, uid;
  uint64_t ops, attached_ns, arena_bytes;
} epd_client_snap_t;
typedef struct epd_rank_snap {
  int rank, device;
  int has_uuid;
  uint8_t device_uuid[16];
  uint64_t buffer_bytes, ops, bytes_sent;
  uint32_t clients;
  uint32_t gpu_ranks; /* local ranks on this rank's GPU (1: its own; more: they share it); 0: no GPU */
  uint64_t timeouts, errors;
  uint64_t wait_ns_by_peer[EPD_MAX_RANKS]; /* time this rank waited for each peer */
} epd_rank_snap_t;
#define EPD_LAT_BUCKETS 16 /* histogram upper bounds: 1us * 2^i, last is +Inf */
typedef struct epd_op_snap {
  uint64_t count, errors, bytes;
  uint64_t lat_bucket[EPD_LAT_BUCKETS];
  double lat_sum_s;
} epd_op_snap_t;
typedef struct epd_engine_snap {
  const char *backend, *mode;
  uint32_t num_ranks, ngroups, nclients;
  epd_group_snap_t *groups;
  epd_client_snap_t *clients;
  epd_rank_snap_t *ranks;
  epd_op_snap_t ops[EPD_OP_MAX]; /* indexed by EPD_OP_* */
  int draining;
  /* Scale-out: ranks[] above are this node's, numbered by world rank. */
  uint32_t nodes, node_rank, world_ranks;
  const char *inter_node_transport; /* "none" (one node), "host-tcp" */
  const char *gin;                  /* cuda across nodes: the start-up GIN probe's line; NULL otherwise */
  const char *rendezvous;           /* across nodes: "mutual-tls" or "plaintext"; "" on one node */
  char links[512];     /* across nodes: "node 0 up; node 2 down: <why>" (epd_net_links); "" on one node */
  uint64_t links_down; /* bit n: the link to node n is down */
  uint64_t net_tx_bytes, net_rx_bytes, net_tx_frames, net_rx_frames;
} epd_engine_snap_t;
epd_result_t epd_engine_snapshot(epd_engine_t *eng, epd_engine_snap_t *out);
void epd_engine_snapshot_free(epd_engine_snap_t *snap);

#endif /* EPD_ENGINE_H */
