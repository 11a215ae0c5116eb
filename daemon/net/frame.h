/*
 * frame.h - a node's part of a step across nodes, as both backends send it: a step header, a descriptor
 * per local rank, then what the backend moves with them (the host backend: each rank's HT counts and the
 * tokens or partial sums themselves; the CUDA backend: the top-k rows its world plan needs, while the
 * tokens move over NCCL). The checks every node runs on the parts of a step (frame.c) are the same for
 * both backends; what differs says why where it is.
 */
#ifndef EPD_NET_FRAME_H
#define EPD_NET_FRAME_H

#include "net/scaleout.h"

typedef struct net_step_desc {
  uint32_t op, bank, flags, num_tokens;
} net_step_desc_t;

typedef struct net_step_hdr {
  int32_t status, bad_rank; /* the sender could not take part: why, and the rank it names (-1: none) */
  uint32_t nlocal, world;   /* ranks of the sender, of the world */
  uint32_t num_experts, hidden, topk, max_tokens;
  uint32_t map_version, staged_version; /* the map it runs, the staged one it reports (0: none) */
  uint64_t map_hash, staged_hash;
  uint64_t mask; /* the world ranks it routed without (groups that mask lost ranks) */
  char why[176];
} net_step_hdr_t;
_Static_assert(sizeof(net_step_hdr_t) == 240, "net_step_hdr_t changed size");

/* The descriptors after a step header. */
static inline const net_step_desc_t *net_step_descs(const net_step_hdr_t *h) {
  return (const net_step_desc_t *)(h + 1);
}

/* Each check below returns 0, or an EPD_ERR_* with *peer (the world rank it names) and why set. */

/* Node n's header against this node's geometry: the group's shape, then the ranks it sent for, then that
 * len bytes hold the header, its nlocal descriptors and tail bytes more (the backend's fixed part). */
int net_frame_geom(const net_step_hdr_t *h, size_t len, size_t tail, uint32_t n, uint32_t me, uint32_t L,
                   uint32_t W, const epd_ref_geom_t *g, const char *group, int *peer, char *why, size_t wl);
/* Node n's descriptors into d[n * L ... n * L + L - 1] (world rank order). */
void net_frame_descs(const net_step_hdr_t *h, uint32_t n, uint32_t L, epd_desc_t *d);
/* The world's descriptors: ops and banks in range, flags valid, and every rank the same op, bank and FP8
 * flag as rank 0. */
int net_check_descs(const epd_desc_t *d, uint32_t W, int *peer, char *why, size_t wl);
/* A dispatch: every node runs the expert map (version, hash) this node runs (h[n] NULL: node n is this
 * node or out of the step). */
int net_check_maps(const net_step_hdr_t *const *h, uint32_t nodes, uint32_t me, uint32_t L, uint32_t version,
                   uint64_t hash, int *peer, char *why, size_t wl);
/* The staged-map vote of the step (eng_vote_agree) over the other nodes' headers (NULL: none). */
void net_vote_frames(eng_map_vote_t *v, const net_step_hdr_t *const *h, uint32_t nodes, uint32_t me,
                     uint64_t step);
/* A node that could not take part (its header's status), the lowest node first; h[me] is this node's
 * own. A draining node's frame names its first rank on the other nodes and no peer on its own. */
int net_frames_status(const net_step_hdr_t *const *h, uint32_t nodes, uint32_t me, uint32_t L, int *peer,
                      char *why, size_t wl);
/* Node n's part of `step` of grp is not in: whether it will not come. 0 while it may; else the status the
 * step fails with (its link is down, it drains and the step is a dispatch, the group is removed there or
 * a rank's client died there, or its part of a later step came instead). grp NULL: a group removed here
 * whose step still runs (no notice applies). Groups that mask take the node out of their next steps. */
int net_part_missing(epd_engine_t *eng, eng_group_t *grp, const char *group, uint32_t n, uint64_t step,
                     int dispatch, uint64_t later, int *peer, char *why, size_t wl);
/* The other nodes' parts of a step, taken as they come (both backends' steps across nodes): frame[n] and
 * flen[n] node n's payload (its step header, descriptors and the backend's part; NULL while absent, and
 * for this node and a node out of the step, every rank of it in sent_mask: none is waited for and what it
 * sent is dropped). since: the group's first frame number (eng_net_frames_since), or EPD_NET_TAKE_ONLY
 * for a step of a group removed here (grp NULL: no notice applies). dispatch: the step's op is one. The
 * step fails (returned: its status, *peer and why) when the parts were routed with different masks
 * (net_frames_mask), when a missing part will not come (net_part_missing), or when timeout_from is not 0
 * and engine.step_timeout_ms passed since then with a part missing (EPD_ERR_TIMEOUT naming that node's
 * first rank). Else NET_PARTS_IN (every part in) or NET_PARTS_WAIT. */
enum { NET_PARTS_IN = 0, NET_PARTS_WAIT = -1 };
int net_parts_take(epd_engine_t *eng, eng_group_t *grp, const char *group, uint64_t step, uint64_t since,
                   uint64_t sent_mask, int dispatch, uint64_t timeout_from, uint8_t **frame, size_t *flen,
                   int *peer, char *why, size_t wl);
/* Groups that mask: every node must have routed with the same masked ranks. Each node masks its own
 * ranks and tells the others (CTL_MASK), and takes a node whose link is down, whose group is removed,
 * whose last live rank was lost or that drains (its first refused dispatch) out of the steps (net_node_out);
 * a step one node sent before such news came fails everywhere, at once (the first part that differs: no node
 * waits for a part that will not come), and the next step runs with each node's own ranks as it said (taken
 * here from the parts). h[n]: node n's header (NULL: none in, or this node), sent: the mask this node sent;
 * grp NULL: a group removed here whose step still runs (nothing to take). */
int net_frames_mask(epd_engine_t *eng, eng_group_t *grp, const net_step_hdr_t *const *h, uint64_t sent,
                    int *peer, char *why, size_t wl);
/* Every rank of node n is in mask (n is out of the steps routed with it: no part goes to it, none is
 * waited for). */
int net_node_masked(const epd_engine_t *eng, uint64_t mask, uint32_t n);
/* The message of a step timeout that waited for node n's part. */
void net_silent_why(uint32_t n, uint32_t L, uint32_t timeout_ms, char *why, size_t wl);

#endif
