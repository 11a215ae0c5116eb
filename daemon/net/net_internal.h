/*
 * net_internal.h - what the files of the scale-out layer (daemon/net/) share: the wire structs, the
 * links' state, a group's state across nodes, and the functions one file offers the others. Nothing
 * outside daemon/net/ includes it: the backends see engine_net.h (links) and scaleout.h (the layer).
 *
 *   link.c     TCP links between daemons, frame queues, restarted peers
 *   ctl.c      the control thread: control frames in arrival order, drain notices
 *   members.c  groups across nodes: creation, removal, joins, lost and masked ranks; the core's hook table
 *   maps.c     the expert-map vote of both backends and SetExpertMap across nodes
 *   weights.c  expert weights copied between nodes
 *   step.c     the host backend's step across nodes
 */
#ifndef EPD_NET_INTERNAL_H
#define EPD_NET_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "core/engine_internal.h"
#include "core/log.h"
#include "net/engine_net.h"
#include "net/frame.h"
#include "net/scaleout.h"

#define NET_MAGIC 0x4e445045u   /* "EPDN" */
#define HELLO_MAGIC 0x4f4c4845u /* "EHLO" */
#define CTL_MAGIC 0x4c435045u   /* "EPCL": a control frame (expert maps), not part of a step */
#define MAX_NODES EPD_MAX_RANKS
#define MAX_FRAME (1ull << 34)

typedef struct net_frame {
  struct net_frame *next;
  char group[EPD_GROUP_NAME_MAX];
  uint64_t step;
  uint32_t src_node;
  int local;    /* made by this daemon (a link's revival), not received */
  uint64_t seq; /* arrival order of the step frames (net->frame_seq) */
  uint8_t *buf; /* whole frame after the length */
  size_t len;
} net_frame_t;

typedef struct net_peer {
  int fd;
  pthread_t th;
  int started;
  atomic_int dead;
  char why[160];
  pthread_mutex_t send_mu;
  struct epd_net *net;
  uint32_t node;
  _Atomic uint32_t epoch; /* times the link was made again (revive) */
} net_peer_t;

/* A SetExpertMap on a node other than 0 waiting for node 0's answer. */
typedef struct ctl_wait {
  struct ctl_wait *next;
  uint64_t req_id;
  int done, status;
  uint32_t version;
  char why[320];
} ctl_wait_t;

struct epd_net {
  int lfd;
  uint32_t nodes, node_rank;
  net_peer_t peer[MAX_NODES];
  pthread_mutex_t mu;
  net_frame_t *frames;
  uint64_t frame_seq;        /* (mu) step frames received so far */
  atomic_int remake_pending; /* node 0: a world communicator id was sent and its remake has not ended here */
  atomic_int stop;
  _Atomic uint64_t tx_bytes, rx_bytes, tx_frames, rx_frames;
  /* Control frames (expert maps, drain notices), served in arrival order by one thread (ctl.c's
   * ctl_main) that may take the engine lock: the receivers never do, so they always drain the links. */
  pthread_cond_t ctl_cv, wait_cv;
  net_frame_t *ctl_head, *ctl_tail;
  int ctl_on, ctl_stop, ctl_started;
  pthread_t ctl_th;
  epd_engine_t *eng;
  ctl_wait_t *waits;
  uint64_t next_req;
  /* (engine mu) node n drains; a group made here later fails its dispatches at once (a draining node
   * takes no attach, so no step of a group created after its notice) */
  int peer_draining[MAX_NODES];
  /* (engine mu) maps node 0 sent for groups this node did not have yet: staged when one is created */
  struct pending_map *pending;
  /* (engine mu) groups removed here (the newest 64): made again, one waits for the other nodes' step */
  char removed[64][EPD_GROUP_NAME_MAX];
  uint32_t removed_next;
  _Atomic uint32_t weights_delay_ms; /* epd_net_test_weights_delay (test builds; 0 otherwise) */
  /* Restarted nodes: every node accepts a new link from a node whose link is down (accept_main); a node
   * that joined a running world (rejoined) makes every group as one made again (eng_net_group_created). */
  uint8_t secret[EPD_NET_SECRET_BYTES];
  pthread_t acc_th;
  int acc_started, rejoined;
  /* expert weights to send (net->mu): sent in order by the control thread, never under the engine lock */
  struct wq *wq_head, *wq_tail;
};

typedef struct pending_map {
  struct pending_map *next;
  char group[EPD_GROUP_NAME_MAX];
  epd_expert_map_t map; /* without weight copies: a map with copies is not kept */
} pending_map_t;

/* Every frame on a link: which group and step it belongs to (CTL_MAGIC: a control frame, not part of a
 * step), then for a part of a step its step header (frame.h; control frames leave it zero). */
typedef struct net_hdr {
  uint32_t magic, src_node;
  uint64_t step;
  char group[EPD_GROUP_NAME_MAX];
} net_hdr_t;
_Static_assert(sizeof(net_hdr_t) == 80, "net_hdr_t changed size");

/* Control frames: see "expert maps across nodes" below. */
struct epd_expert_map;
enum {
  CTL_MAP_REQ = 1,
  CTL_MAP_SET = 2,
  CTL_MAP_REP = 3,
  CTL_DRAIN = 4,
  CTL_WEIGHTS = 5,
  CTL_GONE = 6,
  CTL_JOIN = 7,
  CTL_LOST = 8, /* version: a world rank of the sender; req_id: its first step without the rank's client (MAX:
                   back) */
  CTL_LINK_UP = 9, /* local only (revive): the link to src_node is up again */
  CTL_WORLD = 10,  /* from the first node of mask (node 0 when 0; or local): make the world communicator again
                    * over the id in why with the nodes in mask (0: every node) */
  CTL_MASK = 11, /* version: a world rank of the sender, status: 1 masked there, 0 back (groups that mask) */
  CTL_LINK_DOWN = 12, /* local only (the link's receiver): the link to src_node is down */
  CTL_STEP_OFF = 13   /* req_id: a step of the group, status: what, version: peer + 1, code, mask: the step's
                         nodes (epd_net_step_off, _no, _ready) */
};
typedef struct ctl_msg {
  uint32_t kind, version;
  uint64_t req_id;
  int32_t status;
  uint32_t num_experts, ncopies;
  int32_t code; /* CTL_STEP_OFF, EPD_NET_OFF_NO: the status the step failed with */
  char why[320];
  uint64_t hash; /* CTL_JOIN: the hash of the sender's active map (its version in version) */
  uint64_t mask; /* CTL_JOIN: the world ranks the sender's group masks (groups that mask); CTL_WORLD,
                  * CTL_STEP_OFF (EPD_NET_OFF_READY): nodes (bit k: node k) */
} ctl_msg_t;

/* Per group (grp->net, made with the group on every engine of several nodes): what the other nodes
 * announced, and for the host backend's step what this node sent for the step being collected and the
 * remote ranks' inputs (allocated at its first step). */
typedef struct net_group {
  epd_net_t *net;
  /* Node n drains (its notice): it takes no dispatch of this group numbered >= drain_from[n] (it still
   * runs combines); UINT64_MAX: not draining. */
  uint64_t drain_from[EPD_MAX_RANKS];
  /* Node n has no client of this group since its step gone_from[n] (its notice; the group was removed
   * there): a step numbered >= that whose part from node n is not in fails here at once with
   * EPD_ERR_PEER. UINT64_MAX: the group exists there (or nothing was heard). */
  uint64_t gone_from[EPD_MAX_RANKS];
  /* The client of world rank r (of another node) died there at that node's step lost_from[r] (its
   * notice) and the group stays there for a new attach of the rank: a step numbered >= that whose part
   * from that node is not in fails here at once with EPD_ERR_PEER naming r. UINT64_MAX: none. */
  uint64_t lost_from[EPD_MAX_RANKS];
  uint64_t frames_since; /* the link frames received before this group was made (net_take's later) */
  /* Made while the other nodes may step the group already (a worker restarted): its first part waits
   * for every other node's reply (bit n of join_wait: node n's is due), and it takes the step the others
   * are at (join_step; see eng_net_joining). */
  uint64_t join_wait, join_step, join_ns;
  uint32_t join_map_version; /* the map the node at join_step runs, and its hash */
  uint64_t join_map_hash;
  /* The host backend's step (group_state): */
  int have_bufs;
  uint64_t sent_step; /* UINT64_MAX: nothing sent yet */
  uint64_t sent_mask; /* the masked ranks it was routed with */
  int lstatus, lbad;
  char lwhy[192];
  epd_ref_plan_t lplan;        /* routing of this node's tokens only (dedup, HT counts, statistics) */
  uint16_t *x[EPD_MAX_RANKS];  /* remote ranks' received tokens, [M, H] */
  int64_t *idx[EPD_MAX_RANKS]; /* [M, K], -1 where not received */
  float *w[EPD_MAX_RANKS];
  uint32_t *ht_local;        /* [W] this node's HT tokens per destination rank */
  uint8_t *frame[MAX_NODES]; /* the other nodes' parts of the step (net_parts_take) */
  size_t flen[MAX_NODES];
  eng_map_vote_t vote; /* map switches (eng_vote_*) */
} net_group_t;

#define NG(grp) ((net_group_t *)(grp)->net)

/* A map in a control frame: nrep[E], zero padding to 8 bytes, rep[E], copies[ncopies], so that rep and the
 * copies lie at aligned offsets of the frame (parse_map points into it). */
#define MAP_NREP_BYTES(E) (((size_t)(E) + 7u) & ~(size_t)7u)
_Static_assert((sizeof(net_hdr_t) + sizeof(ctl_msg_t)) % 8 == 0, "a map's arrays start at an 8-byte offset");

typedef struct wout {
  struct wout *next;
  uint32_t node;
  ctl_msg_t m;
  uint8_t *frame; /* net_hdr_t and ctl_msg_t (written when sent), then the bytes: read in place */
  uint64_t bytes;
  /* the source slot, read by the control thread (weights_read) from this group incarnation's client */
  epd_weight_copy_t cp;
  uint64_t gserial, client_id;
} wout_t;
#define WREAD_CHUNK (4ull << 20) /* bytes read under one hold of the engine lock */
#define WOUT_HDR (sizeof(net_hdr_t) + sizeof(ctl_msg_t))

/* A group's frames queued for the control thread. */
typedef struct wq {
  struct wq *next;
  char group[EPD_GROUP_NAME_MAX];
  wout_t *w;
} wq_t;

/* ---- between the layer's files ---- */

/* links (link.c): a frame to node (the length prefix added), the step frames queued for (group, step,
 * node), and dropping a group's queued frames (node -1: every node's) */
int net_send(epd_net_t *net, uint32_t node, const void *buf, size_t len);
net_frame_t *net_take(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since,
                      uint64_t *later);
int net_has(epd_net_t *net, const char *group, uint64_t step, uint32_t node);
void net_drop_queued(epd_net_t *net, const char *group, int node);
/* control frames (ctl.c): one to node, with a map and its weight copies where map is not NULL */
int net_send_ctl(epd_net_t *net, uint32_t node, const char *group, const ctl_msg_t *m,
                 const epd_expert_map_t *map, const epd_weight_copy_t *cp);
/* expert maps (maps.c) */
void net_pending_free(pending_map_t *p);
int net_parse_map(const net_frame_t *f, const ctl_msg_t *c, epd_expert_map_t *m,
                  const epd_weight_copy_t **cp);
epd_result_t net_stage_and_send(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                const epd_weight_copy_t *cp, uint32_t ncopies, uint32_t *version, wout_t **wo,
                                char *err, size_t errlen);
int net_pending_put(epd_engine_t *eng, epd_net_t *net, const char *group, const epd_expert_map_t *m,
                    uint32_t ncopies);
/* expert weights (weights.c) */
wout_t *net_weights_out(epd_engine_t *eng, eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t n,
                        uint32_t version, int status, const char *why);
wout_t *net_weights_retry(epd_engine_t *eng, eng_group_t *grp);
void net_wout_free(wout_t *w);
void net_weights_queue(epd_net_t *net, const char *group, wout_t *w);
void net_weights_send(epd_net_t *net, const char *group, wout_t *w);
void net_weights_in(epd_engine_t *eng, const net_frame_t *f, const ctl_msg_t *c, const char *group);
/* membership (members.c) */
void net_send_join(epd_net_t *net, uint32_t n, const char *group, uint64_t steps, uint32_t version,
                   uint64_t hash, uint64_t mask);
void net_join_reply(epd_engine_t *eng, eng_group_t *grp, uint32_t n, const ctl_msg_t *c);
/* (mu) The step node n, back in a group that masks, joins at: the first one this node sends with it in
 * (the one being collected, unless its part went out with the node out). */
uint64_t net_join_step(const epd_engine_t *eng, const eng_group_t *grp, uint32_t n);
/* (mu) This node knows node n gone from grp: its link is down, the group was removed there, or a rank's
 * client died there and was not replaced. */
int net_node_gone(epd_engine_t *eng, const eng_group_t *grp, uint32_t n);
void net_link_up(epd_engine_t *eng, uint32_t n);
/* (mu) Groups that mask lost ranks: node n takes no part in grp's steps any more (its link is down, the
 * group was removed there, its last live rank lost its client): its ranks are masked here from the next
 * step this node sends, and steps sent so no longer wait for its part. net_node_back: rank r of node n
 * (-1: every rank of it) takes part again. */
void net_node_out(epd_engine_t *eng, eng_group_t *grp, uint32_t n, const char *why);
void net_node_back(epd_engine_t *eng, eng_group_t *grp, uint32_t n, int r);

#endif
