/*
 * engine_cuda_net.h - the CUDA backend across nodes: the host-initiated inter-node stage ("nccl-p2p").
 *
 * With cluster.nodes > 1 the CUDA backend's rank thread 0 runs every step of this node through this
 * module instead of the single-node LL/HT kernels:
 *   1. collect: when every local rank has submitted the step, send every other node one control frame
 *      over the daemon links (engine_net.h): the local descriptors, the expert map's version and hash,
 *      and for a dispatch the local top-k ids and weights (copied from the GPU arenas, T x K x 12 bytes);
 *   2. decide: with every node's frame in, each node builds the same world routing plan (daemon/ref.c)
 *      and reaches the same verdict (mismatch, bad expert, HT overflow, ...) before any NCCL call, so an
 *      exchange is only started when every node will start it too;
 *   3. run: the step program of daemon/cnet_plan.c on each local GPU: pack kernel, one grouped
 *      ncclSend/ncclRecv per step with the rail peer (same local index) of every other node over the
 *      world communicator (any NCCL transport, sockets included), expansion / reduction kernels;
 *   4. complete the slots when the GPUs are done (an exchange that hangs past engine.step_timeout_ms
 *      aborts the world communicator and fails the engine).
 * Several groups: each collects and decides its steps on its own, but their exchanges share the world
 * communicator, whose NCCL calls must come in the same order on every node. So one exchange runs at a
 * time, and node 0 orders them: it runs the step that became ready first and sends every other node a
 * numbered GO frame (group, step); the other nodes run ready steps in GO order only.
 * Node 0 also decides which steps do not run: a node that has sent its part never gives the step up on
 * its own (node 0 might have ordered it, and its exchange would find no partner). Waiting past
 * engine.step_timeout_ms for a part or for the GO, it asks node 0 to give the step up (CTL_STEP_OFF)
 * and goes on waiting: node 0 either has ordered the step (the GO comes) or gives it up and tells every
 * node that no step of the group up to it runs; a step that fails on node 0 is told the same way. Only
 * a node 0 that answers nothing within another timeout leaves the step to fail on the asking node.
 */
#ifndef EPD_ENGINE_CUDA_NET_H
#define EPD_ENGINE_CUDA_NET_H

#include "cuda/cuda_comm.h"
#include "core/engine_internal.h"

typedef struct cnet cnet_t;

/* Provided by engine_cuda.c: pin a client's backend memory while a step uses it (it is freed only
 * after unhold), and the device address of its arena. */
void *eng_cuda_client_hold(eng_client_t *c);
void eng_cuda_client_unhold(void *h);
uint64_t eng_cuda_client_arena(void *h);

/* Set the stage up for the engine's local GPUs devices[0..L-1] (world communicators in cc): a stream
 * per GPU, peer access between them; probes what NCCL offers for GIN (collective: every node does it
 * here) and logs the transport with the probe's line. */
epd_result_t eng_cuda_net_create(epd_engine_t *eng, epd_cc_t *cc, const int *devices, cnet_t **out, char *err,
                                 size_t errlen);
/* The start-up GIN probe's line ("unavailable (...)", "available (...); not used: ...", "probe failed: ...").
 */
const char *eng_cuda_net_gin(const cnet_t *cn);
/* Answer every waiting slot with EPD_ERR_CLOSED and release everything (rank threads stopped). */
void eng_cuda_net_destroy(cnet_t *cn);
/* One pass of the step protocol (rank thread 0; takes eng->mu itself); 1 if something moved. */
int eng_cuda_net_poll(cnet_t *cn);
/* (mu) May a client of grp attach? EPD_ERR_INVALID (err says why) unless the group spans the world. */
epd_result_t eng_cuda_net_attach(cnet_t *cn, eng_group_t *grp, char *err, size_t errlen);
/* (mu) A client leaves: withdraw its submitted slot and fail the local peers of a step being collected. */
void eng_cuda_net_client_leave(cnet_t *cn, eng_client_t *c, int lost);
/* (mu) Make the world communicator again over id with the nodes in live (0: every node, a restarted node
 * joins; else the nodes left after a loss) once no exchange runs (a thread of its own; meanwhile no
 * exchange starts here). */
void eng_cuda_net_remake(cnet_t *cn, const uint8_t *id, uint64_t live);
/* (mu) Node `node`'s word on step `step` of group (epd_net_step_off: what, why): on the lead a request to
 * give it up, answered at the next poll, or a step of nodes (bit k: node k) it is out of, ready on that
 * node (ordered at the next poll); on another node the lead's answer; from any node, its world
 * communicator aborted or the lead lost (group ""). */
void eng_cuda_net_step_off(cnet_t *cn, const char *group, uint64_t step, uint32_t node, int what, int peer,
                           int code, uint64_t nodes, const char *why);

#endif /* EPD_ENGINE_CUDA_NET_H */
