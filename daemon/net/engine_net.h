/*
 * engine_net.h - the scale-out data plane of the host backend ("host-tcp"): one TCP connection per
 * node pair, framed messages per (group, step), and the two-level step of docs/SEMANTICS.md across
 * nodes (README "Scale-out"). The connections are made at start-up by cluster.c; the engine uses them
 * through the eng_net_* hooks of engine_internal.h.
 *
 * Dispatch: when all local ranks of a group have submitted a step, the node sends every other node
 * ONE frame: its ranks' descriptors, their per-destination-rank HT counts, and each token that routes
 * to at least one rank of that node ONCE (x, top-k ids, weights), whatever the number of its ranks
 * there. Every node then runs the reference over the global view (its own tokens plus the tokens it
 * received) and writes its own ranks' outputs. Combine: every node sends back, per (token, source
 * node), one float32 partial sum (its ranks' weighted expert outputs); the source node adds the
 * partials in node order and rounds once to BF16.
 */
#ifndef EPD_ENGINE_NET_H
#define EPD_ENGINE_NET_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

#define EPD_NET_ADDR_MAX 128
#define EPD_NET_SECRET_BYTES 16

typedef struct epd_net epd_net_t;

/* Bind and listen on "host:port" (port 0: any); adv gets the "host:port" the other nodes must use. */
epd_result_t epd_net_listen(const char *addr, epd_net_t **out, char *adv, size_t advlen, char *err,
                            size_t errlen);
/* Connect the full mesh: accept from higher nodes, connect to lower ones, within timeout_ms; peers[n] is
 * node n's data address, secret authenticates the links. rejoin: the world already runs (this daemon
 * restarted): connect to every other node. Starts one receiver thread per peer, and a thread that takes
 * a new link from a node whose link is down (its daemon restarted and joined again). */
epd_result_t epd_net_connect(epd_net_t *net, uint32_t nodes, uint32_t node_rank,
                             const char (*peers)[EPD_NET_ADDR_MAX], const uint8_t *secret,
                             uint32_t timeout_ms, int rejoin, char *err, size_t errlen);
/* Close every connection, stop the threads, free queued frames. */
void epd_net_destroy(epd_net_t *net);
uint32_t epd_net_nodes(const epd_net_t *net);
uint32_t epd_net_node_rank(const epd_net_t *net);
/* Bytes and frames sent/received since start (metrics). */
void epd_net_counters(const epd_net_t *net, uint64_t *tx_bytes, uint64_t *rx_bytes, uint64_t *tx_frames,
                      uint64_t *rx_frames);

/* Frames of another backend's step protocol (engine_cuda_net.c) over the same links: send `payload` as
 * the frame of (group, step) to node (0, or -1: link down); take node's frame of (group, step), dropping
 * its older ones of the group (NULL while absent; *len its payload bytes; free() it). */
int epd_net_send_payload(epd_net_t *net, uint32_t node, const char *group, uint64_t step, const void *payload,
                         size_t len);
/* later (may be NULL): in the same pass, the smallest later step of node's parts of group received after
 * frame number `since` (0: none); with no part of `step` taken, node skipped `step` (one link, in order; a
 * node numbers its parts in order and skips only a step that failed there). */
uint8_t *epd_net_take_payload(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since,
                              uint64_t *later, size_t *len);
/* The smallest step after `step` of node's parts of group received after frame number `since` and still
 * queued (0: none), taking nothing: a node whose later part is here has left `step`. */
uint64_t epd_net_later_part(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since);
/* As `since`: take the step's frame only and drop none of the group's others (a step of a group removed
 * here: the name may live again here, and the sender's parts of its new life number from 0). */
#define EPD_NET_TAKE_ONLY UINT64_MAX
/* The count of step frames received so far: a group made now passes it as `since` (frames that came
 * before are an earlier life's of a group of that name). */
uint64_t epd_net_frame_seq(epd_net_t *net);
/* Node 0, a restarted node joining (backend cuda): every other node whose link is up but `except` (the
 * restarted one), and this node, make the world communicator again over id (EPD_NET_COMM_ID_BYTES). */
#define EPD_NET_COMM_ID_BYTES 128
/* How many times the link to node was made again (a restarted node joined). */
uint32_t epd_net_link_epoch(epd_net_t *net, uint32_t node);
void epd_net_world_remake(epd_net_t *net, uint32_t except, const uint8_t *id);
/* The first node left after a loss (backend cuda): the nodes in live (bit k: node k; this one the first
 * of them) make the world communicator again over id without the others, so that they exchange again
 * before the lost node restarts (its restart makes it again with every node: epd_net_world_remake). */
void epd_net_world_without(epd_net_t *net, uint64_t live, const uint8_t *id);
/* Word on a step across nodes (CTL_STEP_OFF to node, handled there by the backend's step_off op), what:
 *   EPD_NET_OFF_ASK      to the lead: the sender waited past engine.step_timeout_ms, give `step` up;
 *   EPD_NET_OFF_NO       from the lead: no step of the group up to `step` runs (epd_net_step_no: with
 *                        the status the step failed with there);
 *   EPD_NET_OFF_ORDERED  from the lead: `step` was ordered, its GO is on its way;
 *   EPD_NET_OFF_WORLD    from any node (group ""): its world communicator was aborted, or it lost the
 *                        lead (why);
 *   EPD_NET_OFF_READY    to the lead, out of the step: `step` is ready on the sender, whose nodes are in
 *                        the mask of epd_net_step_ready (the lead orders its exchange all the same).
 * The lead orders the exchanges: node 0, or the first node of a world made without the lost nodes.
 * peer: the world rank the step waited for (the completions name it), -1 if none. 0, or -1 where the
 * link is down. */
enum {
  EPD_NET_OFF_ASK = 0,
  EPD_NET_OFF_NO = 1,
  EPD_NET_OFF_ORDERED = 2,
  EPD_NET_OFF_WORLD = 3,
  EPD_NET_OFF_READY = 4
};
int epd_net_step_off(epd_net_t *net, uint32_t node, const char *group, uint64_t step, int what, int peer,
                     const char *why);
/* EPD_NET_OFF_NO to node: the steps of group up to `step` fail with code (naming peer; why). */
int epd_net_step_no(epd_net_t *net, uint32_t node, const char *group, uint64_t step, int code, int peer,
                    const char *why);
/* EPD_NET_OFF_READY to node (the lead): `step` of group is ready here; nodes: the step's (bit k: node k). */
int epd_net_step_ready(epd_net_t *net, uint32_t node, const char *group, uint64_t step, uint64_t nodes);
/* Node 0: 1 from epd_net_world_remake until this node's remake ended (epd_net_world_made): a node that
 * restarts meanwhile gets the same id (its ranks are part of that world). */
int epd_net_remake_pending(epd_net_t *net);
void epd_net_world_made(epd_net_t *net);
/* Count bytes another transport moved between the nodes (the NCCL exchange) in the link counters. */
void epd_net_add_bytes(epd_net_t *net, uint64_t tx, uint64_t rx);
/* 1 (why set) if the link to node is down. */
int epd_net_node_dead(epd_net_t *net, uint32_t node, char *why, size_t len);
/* (engine mu) The links to the other nodes for status: "node 0 up; node 2 down: <why>; node 3 up,
 * draining" in out; bit n of *down set where the link to node n is down. */
void epd_net_links(epd_net_t *net, char *out, size_t len, uint64_t *down);
/* Drop every queued frame of a group (it was removed). */
void epd_net_drop_group(epd_net_t *net, const char *group);
#ifdef EPD_TEST_HOOKS
/* Test builds: delay every send of expert weights to another node by this many ms (0: none), so that
 * steps run while the bytes are on their way. */
void epd_net_test_weights_delay(epd_net_t *net, uint32_t ms);
#endif
/* FNV-1a hash of an expert map (version and every replica): nodes compare maps by it. */
struct epd_expert_map;
uint64_t epd_net_map_hash(const struct epd_expert_map *m);

#endif /* EPD_ENGINE_NET_H */
