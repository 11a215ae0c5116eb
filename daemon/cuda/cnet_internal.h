/*
 * cnet_internal.h - the state of the CUDA backend across nodes, shared by its files: engine_cuda_net.c
 * (collect, verdict, order of the exchanges), cnet_run.c (running an exchange), cnet_off.c (steps the
 * lead gives up) and cnet_world.c (the world communicator made again, the lead).
 */
#ifndef EPD_CNET_INTERNAL_H
#define EPD_CNET_INTERNAL_H

#include "cuda/cnet_plan.h"
#include "cuda/engine_cuda_net.h"
#include "net/scaleout.h"

#if EPD_WITH_CUDA
#include <cuda_runtime_api.h>

enum { PH_COLLECT = 0, PH_WAIT = 1, PH_RUN = 2 };

/* A node's part of a step (net/frame.h): the step header, nlocal descriptors, then (dispatch, status 0)
 * for each local rank min(num_tokens, max_tokens) rows of top-k ids (int64) followed by as many rows of
 * weights: the world plan's inputs (the tokens themselves move over NCCL). */

/* One local GPU. */
typedef struct cnet_dev {
  int device;
  cudaStream_t stream;
  cudaEvent_t done, xdone;
  uint8_t *xsend, *xrecv; /* nodes x max_tokens rows of H floats (BF16 rows use the first half) */
  size_t xbytes;
  uint8_t *tab_dev, *tab_host; /* the step's tables (device copy, pinned staging) */
  size_t tab_cap;
  cudaStream_t tkstream; /* the local rank's top-k read for the dispatch frame (send_frame) */
  uint8_t *tk_host;      /* pinned: its top-k ids and weights */
  size_t tk_cap;
  size_t off[9]; /* offsets of the 9 tables in the staging buffer */
} cnet_dev_t;

enum { PH_READY = 3 }; /* every frame in, verdict OK: the exchange waits for its turn (schedule) */

/* One group served: the step it collects, decides or runs. */
typedef struct cnet_grp {
  struct cnet_grp *next;
  eng_group_t *grp;
  uint64_t grp_serial; /* grp->serial when taken up (see grp_alive) */
  char gname[EPD_GROUP_NAME_MAX];
  epd_ref_geom_t g;
  int renorm; /* the group's renormalize (the world plan's) */
  int phase;
  uint64_t step;
  int arrived[EPD_MAX_RANKS];
  void *hold[EPD_MAX_RANKS];
  eng_client_t *cl[EPD_MAX_RANKS];
  uint64_t cid[EPD_MAX_RANKS];
  epd_desc_t ldesc[EPD_MAX_RANKS]; /* local ranks' descriptors */
  uint32_t narrived;
  uint64_t first_ns, last_ns, run_ns;
  uint64_t ready_seq, ready_ns;   /* PH_READY: in which order (the lead orders by it) and since when */
  uint8_t *frame[CNET_MAX_NODES]; /* every node's payload of the step (own included) */
  size_t flen[CNET_MAX_NODES];
  int plan_init;
  epd_ref_plan_t plan[EPD_NUM_BANKS];
  int plan_valid[EPD_NUM_BANKS];
  uint64_t plan_mask[EPD_NUM_BANKS]; /* the mask each bank's dispatch ran with */
  /* Groups that mask lost ranks: the world ranks the step was routed without, as this node sent it (every
   * part must say the same: net_frames_mask). Masked ranks of this node take no part: no slot, no tokens. */
  uint64_t sent_mask;
  uint32_t op, bank, fp8, mode, op_version;
  /* Where a step's time goes (logged when the group goes away), per dispatch [0] / combine [1]: last
   * local arrival -> frame sent, -> every frame in, -> work issued (plan, tables, launches), -> GPUs
   * done. */
  uint64_t t_sent, t_in, t_issued;
  uint64_t prof_n[2], prof_ns[2][4];
  uint64_t behind; /* steps that found another group's exchange running or ready (logged with the profile) */
  eng_map_vote_t vote; /* expert-map switches, the protocol of both backends (engine_internal.h) */
  /* The group removed here (its last local client left) while its step was past collect: what the step
   * still needs of the group, kept so that it is decided and its exchange runs as on the other nodes
   * (whose NCCL calls would otherwise find no partner here). Valid if orphan. */
  int orphan;
  epd_expert_map_t omap;
  epd_buffer_desc_t obufs[EPD_MAX_BUFFERS];
  uint32_t onbufs;
  /* Steps given up across nodes (epd_net_step_off): the lead decides whether a step runs, since it orders
   * the exchanges. No step below off_to runs: on the lead, a node asked to give one up or a step failed
   * here; on the others, the lead's word (off_why, off_peer: the reason). The lead: the last step it
   * ordered (go_step, if go_valid) and a node's request not yet answered (wd_pending: its step wd_step,
   * node wd_node, the rank it waited for wd_peer, reason wd_why). Another node: when it asked the lead to
   * give the step up (wd_ns, 0: not), and the lead's answer that steps below ordered_to were ordered (their
   * GO comes). */
  uint64_t off_to, go_step, wd_step, wd_ns, ordered_to;
  int off_peer, off_status, go_valid, wd_pending, wd_peer;
  int ready_told; /* not the lead, out of the step: the lead was told the step is ready here */
  uint32_t wd_node;
  char off_why[256], wd_why[256];
} cnet_grp_t;

/* The lead's word on the next exchange (a payload of group "" numbered by cnet.go_seq): every node runs
 * the groups' exchanges in this order, so the NCCL calls on the world communicator match. */
typedef struct cnet_go {
  char group[EPD_GROUP_NAME_MAX];
  uint64_t step;
  uint64_t nodes; /* the step's (bit k: node k): another node takes the next order */
} cnet_go_t;

/* The lead: a group's steps on other nodes that the lead is out of (its ranks masked there, or no client
 * of the group here). A node of such a step tells the lead when it is ready (EPD_NET_OFF_READY), and the
 * lead orders its exchange among its own (the order is one for the world communicator). */
typedef struct cnet_away {
  char group[EPD_GROUP_NAME_MAX];
  uint64_t step, nodes, seq, ns; /* the step ready (if pending): its nodes, its place (ready_ctr), when */
  uint64_t go_step;              /* the last step ordered (if go_valid) */
  int pending, go_valid;
} cnet_away_t;
#define CNET_AWAY 32

struct cnet {
  epd_engine_t *eng;
  epd_cc_t *cc;
  uint32_t L, nodes, node, W;
  char gin[2048]; /* the start-up GIN probe's line (epd_cc_gin_probe): every local rank's result when they
                     differ */
  cnet_dev_t d[EPD_MAX_RANKS];
  cnet_grp_t *groups; /* the groups served (those with a client on this node) */
  cnet_grp_t *run;    /* the group whose step runs: one exchange at a time */
  uint64_t run_end_ns;
  uint64_t go_seq; /* the lead: exchanges ordered so far; other nodes: the number of the next GO */
  uint64_t ready_ctr;
  cnet_go_t go; /* other nodes: GO go_seq, taken, its step not yet ready here */
  int go_have;
  uint64_t go_ns; /* when go was taken */
  cnet_addr_t addr[EPD_MAX_RANKS];
  cnet_prog_t prog;
  /* A restarted node joins (eng_cuda_net_remake): the world communicator is made again over remake_id by
   * a thread of its own once no exchange runs; meanwhile no exchange starts here. */
  int remake_req, remaking, remake_started;
  /* The nodes of the world communicator being made (bit k: node k; 0: every node) and of the one in use
   * (world_nodes); the lead, the first node of world_nodes, orders the exchanges and decides which steps
   * do not run (node 0 until it is lost). After a loss the first node left sent the others an id without
   * the lost ones (without_sent: once a loss). */
  uint64_t remake_live, world_nodes;
  uint32_t lead;
  int without_sent;
  /* A node was lost mid-exchange (cnet_poll_run), here or on another node (its EPD_NET_OFF_WORLD: the
   * nodes in aborted), or the lead was lost: the world communicator is aborted or its order broken, so
   * only steps of this node alone run until it is made again (without the lost nodes, or with a
   * restarted one); world_why: the loss. */
  int world_down;
  uint64_t aborted;
  char world_why[320];
  int remake_cancel; /* (atomic) give the attempt up: stopping, or a newer id came */
  pthread_t remake_th;
  uint8_t remake_id[EPD_CC_UNIQUE_ID_BYTES];
  /* The lead: steps another node asked to give up (epd_net_step_off) of groups not served here yet, taken
   * as off_to by the group when it is (its first client here comes later than the other nodes' steps;
   * kept CNET_UNSERVED_NS). */
  struct {
    char group[EPD_GROUP_NAME_MAX];
    uint64_t to, ns;
    char why[320];
  } unserved[8];
  cnet_away_t away[CNET_AWAY];
};
#define CNET_UNSERVED_NS 60000000000ull

/* (mu) The group is still the one the stage took up: same address and serial (a group removed and
 * created again may get the freed memory back). */
int cnet_grp_alive(cnet_t *cn, cnet_grp_t *cg);
/* (mu) Answer the step's slots and start collecting the next one. */
void cnet_complete(cnet_t *cn, cnet_grp_t *cg, int status, int peer, const char *why);
/* The exchange buffers of every local GPU, freed (with the last group). */
void cnet_dev_free(cnet_t *cn);
/* (mu) The step's turn: run it (mu released while issuing). */
void cnet_start_run(cnet_t *cn, cnet_grp_t *cg);
/* (mu) The step's GPU work: done, failed, or past the timeout; 1 if it ended. */
int cnet_poll_run(cnet_t *cn, cnet_grp_t *cg, uint64_t now);

/* (mu) This node orders the exchanges. */
static inline int cnet_leads(const cnet_t *cn) {
  return cn->node == cn->lead;
}

/* (mu) The world communicator (cnet_world.c): the lead lost, the nodes left handed a world without the
 * lost nodes, a remake started once no exchange runs. 1 if something moved. */
int cnet_world_poll(cnet_t *cn);
/* (mu) Not the lead, or the lead lost: a world communicator of the nodes left is being made or handed out
 * (the world is down and two nodes or more of it are left): its lead will order the steps ready here or
 * give them up, so they wait for its word rather than fail here. */
int cnet_world_coming(cnet_t *cn);

/* Steps given up across nodes (cnet_off.c; the lead decides). (mu) No step of the group below `to` runs:
 * they fail with status (0: EPD_ERR_TIMEOUT) naming peer (why: the reason); the lead tells every other
 * node of its world but those out of the steps in mask. */
void cnet_off_raise(cnet_t *cn, cnet_grp_t *cg, uint64_t to, int status, int peer, const char *why,
                    uint64_t mask);
/* (mu) A group served from now: what was given up of it while it was not. */
void cnet_unserved_take(cnet_t *cn, cnet_grp_t *cg);
/* (mu) The lead: the away entry of group (made if `make`, else NULL when none). */
cnet_away_t *cnet_away_of(cnet_t *cn, const char *group, int make);
/* (mu) The lead: answer a node's request to give a step up (ordered: the step runs; else it is given up
 * everywhere); 1 if given up. */
int cnet_answer_off(cnet_t *cn, cnet_grp_t *cg);
/* (mu) A step below off_to waiting for parts or its turn fails: 1 if so. */
int cnet_off_check(cnet_t *cn, cnet_grp_t *cg);
/* (mu) Not the lead: the step waited past the step timeout since `since` for a part or its GO (what): ask
 * the lead once to give it up; fail only without its word. 1 if it failed. */
int cnet_ask_off(cnet_t *cn, cnet_grp_t *cg, uint64_t since, uint64_t now, int peer, const char *what);

#endif /* EPD_WITH_CUDA */
#endif
