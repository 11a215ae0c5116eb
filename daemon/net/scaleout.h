/*
 * scaleout.h - the scale-out layer as the backends see it (daemon/net/): the table the core calls
 * (eng_net_scaleout, an eng_scaleout_t), the host backend's step across nodes, the state of every group
 * across nodes (drains, removals, lost ranks and joins the other nodes announced) and the expert-map
 * vote both backends run over their step frames. Functions marked (mu) run with eng->mu held.
 */
#ifndef EPD_SCALEOUT_H
#define EPD_SCALEOUT_H

#include "core/engine_internal.h"

/* The hooks the core calls when a group spans nodes; a backend installs them in eng->so at create. */
extern const eng_scaleout_t eng_net_scaleout;

/* What another node announced for grp: the first step from which node n takes no dispatch of it (a
 * drain; UINT64_MAX: none), and the link frames received before the group was made here (those are
 * an earlier incarnation's). */
uint64_t eng_net_drain_from(const eng_group_t *grp, uint32_t n);
uint64_t eng_net_frames_since(const eng_group_t *grp);

/* The host backend's step across nodes (eng->o.nodes > 1). The outcome of a step that ran (or failed)
 * across nodes: */
typedef struct eng_net_result {
  int status, peer;
  uint32_t map_version;
  uint64_t mask; /* the world ranks the step was routed without (groups that mask lost ranks) */
  uint32_t num_recv[EPD_MAX_RANKS];
  uint64_t bytes[EPD_MAX_RANKS];
  char why[256];
} eng_net_result_t;
/* (mu) Once every local rank of grp has submitted (arrived[r], its op desc[r]; the host backend's step
 * being collected): send this node's part of the step (once; masked ranks' desc[r] are set to the
 * first live rank's with no tokens), and run the step when every other node's part is in. 1 when *res
 * holds the outcome, 0 while waiting. */
int eng_net_step(epd_engine_t *eng, eng_group_t *grp, const int *arrived, epd_desc_t *desc,
                 eng_net_result_t *res);
/* (mu) The rank a timed-out step waits for (a local rank, or the first rank of a silent node); why
 * gets the timeout message. */
int eng_net_missing_rank(epd_engine_t *eng, const eng_group_t *grp, const int *arrived, char *why,
                         size_t len);
/* (mu) Node 0: stage a map this daemon made (re-homing) and send it with its weight copies to every
 * node, as a SetExpertMap on node 0 does; the other nodes: EPD_ERR_UNSUPPORTED. */
epd_result_t eng_net_stage_map(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *map,
                               const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                               char *errbuf, size_t errlen);
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
 * with EPD_ERR_DRAINING at once instead of timing out, their combines still run. Nothing lifts a drain today
 * (every caller of epd_engine_set_draining passes 1): with the cuda backend a lift would have to reconcile
 * the steps the peers already refused, whose frames the node would otherwise wait for in its NCCL exchange.
 */
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
/* The verdict on node n's part of `step`, missing while its part of a later step came: why filled, returned.
 */
const char *eng_net_skipped(const char *group, uint32_t n, uint32_t L, uint64_t step, uint64_t later,
                            char *why, size_t len);
/* (mu) The client of local rank `rank` died and grp stays here (other clients remain): tell the other
 * nodes that no part of grp comes from here from step `from` on (the first step whose part was not sent)
 * until the rank is attached again (eng_net_rank_back). */
void eng_net_rank_lost(epd_engine_t *eng, eng_group_t *grp, int rank, uint64_t from);
/* (mu) A new client attached to local rank `rank` after its client died: the other nodes forget the loss
 * and reply with the step they are at; the group here takes it if it is ahead (eng_net_joining). */
void eng_net_rank_back(epd_engine_t *eng, eng_group_t *grp, int rank);
/* (mu) Host backend: the first step of grp whose part this node has not sent. */
uint64_t eng_net_first_unsent(const eng_group_t *grp);
/* This node sent its part of step `step` of grp, routed without the ranks of `mask` (the CUDA backend's
 * step; the host backend's records it itself): eng_net_first_unsent and the answers to a node's return
 * count from it. */
void eng_net_sent(eng_group_t *grp, uint64_t step, uint64_t mask);
/* Groups that mask, across nodes: rank (of this node) is the last one of its node not masked. A node whose
 * ranks were all masked would send no part of its steps, and the others could not tell a node that
 * rejoins from one that lags: that rank is not masked but lost (its steps fail until a worker attaches to
 * it again), and the other nodes take the node out of their steps (CTL_LOST). */
int eng_net_last_live_here(const epd_engine_t *eng, const eng_group_t *grp, int rank);

/* Expert-map switches across nodes (maps.c; both backends run this protocol over their step
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

#endif /* EPD_SCALEOUT_H */
