/*
 * cnet_world.c - the world communicator of the CUDA backend across nodes (cnet_internal.h): made again
 * for a restarted node (every node) or without the nodes lost (the nodes left), on a thread of its own
 * once no exchange runs; and the lead, the first node of the world in use, which orders the exchanges.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cnet_internal.h"
#include "cuda/engine_cuda_net.h"
#include "net/engine_net.h"
#include "net/frame.h"
#include "core/log.h"

#if EPD_WITH_CUDA

#define REMAKE_LIMIT_MS 60000u /* the restarted node's ranks must join within this */

/* "0, 1" of the nodes in live */
static void node_list(uint64_t live, uint32_t nodes, char *out, size_t len) {
  size_t n = 0;
  out[0] = 0;
  for (uint32_t k = 0; k < nodes && k < 64 && n < len; k++)
    if (live >> k & 1) n += (size_t)snprintf(out + n, len - n, "%s%u", n ? ", " : "", k);
}

void eng_cuda_net_remake(cnet_t *cn, const uint8_t *id, uint64_t live) {
  char nl[256];
  if (live && !(live >> cn->node & 1)) {
    node_list(live, cn->nodes, nl, sizeof nl);
    EPD_LOGW(EPD_SUB_CUDA, "node %u asked for a world communicator of nodes %s, without this one: ignored",
             __builtin_ctzll(live), nl);
    return;
  }
  memcpy(cn->remake_id, id, sizeof cn->remake_id);
  cn->remake_live = live;
  cn->remake_req = 1;
  if (cn->remaking) __atomic_store_n(&cn->remake_cancel, 1, __ATOMIC_RELEASE); /* a newer id: that one wins */
  if (live) {
    node_list(live, cn->nodes, nl, sizeof nl);
    EPD_LOGI(EPD_SUB_CUDA,
             "a node was lost: the world communicator is made again with the nodes left (%s) once no "
             "exchange runs here",
             nl);
  } else {
    EPD_LOGI(EPD_SUB_CUDA,
             "a restarted node joins the running world: the world communicator is made again once no "
             "exchange runs here");
  }
}

/* (mu) The world communicator in use is the one of these nodes: its first node orders the exchanges. A
 * new lead knows of no step ordered or asked about before (no exchange ran meanwhile). */
static void lead_from(cnet_t *cn, uint64_t nodes) {
  const uint32_t lead = (uint32_t)__builtin_ctzll(nodes);
  cn->world_nodes = nodes;
  if (lead == cn->lead) return;
  cn->lead = lead;
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next) {
    cg->go_valid = 0;
    cg->wd_pending = 0;
    cg->wd_ns = 0;
    cg->ordered_to = 0;
  }
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next) cg->ready_told = 0;
  memset(cn->unserved, 0, sizeof cn->unserved);
  memset(cn->away, 0, sizeof cn->away);
  EPD_LOGI(EPD_SUB_CUDA, "node %u orders the exchanges from now%s", lead,
           lead == cn->node ? " (this node)" : "");
}

static void *remake_main(void *arg) {
  cnet_t *cn = arg;
  epd_engine_t *eng = cn->eng;
  uint8_t id[EPD_CC_UNIQUE_ID_BYTES];
  pthread_mutex_lock(&eng->mu);
  memcpy(id, cn->remake_id, sizeof id);
  const uint64_t live = cn->remake_live;
  pthread_mutex_unlock(&eng->mu);
  char err[256] = "";
  const uint64_t t0 = eng_now_ns();
  epd_result_t rc =
      epd_cc_world_remake(cn->cc, id, live, REMAKE_LIMIT_MS, &cn->remake_cancel, err, sizeof err);
  pthread_mutex_lock(&eng->mu);
  cn->remaking = 0;
  if (!cn->remake_req) epd_net_world_made(eng->o.net);
  if (rc && cn->remake_req) {
    EPD_LOGW(EPD_SUB_CUDA, "making the world communicator again: %s; a newer id follows", err);
  } else if (rc && live) { /* the first node left tries again with the nodes left then */
    cn->world_down = 1;
    cn->without_sent = 0;
    EPD_LOGW(EPD_SUB_CUDA,
             "making the world communicator without the lost nodes failed: %s; steps with another node fail "
             "until it is made (tried again with the nodes left) or a restarted node joins",
             err);
  } else if (rc && !__atomic_load_n(&cn->remake_cancel, __ATOMIC_ACQUIRE)) {
    eng_fail(eng, "making the world communicator again for a restarted node failed: %s (restart every node)",
             err);
  } else if (!rc) {
    cn->world_down = 0;
    cn->aborted = 0;
    cn->without_sent = 0;
    lead_from(cn, live ? live : (cn->nodes >= 64 ? ~0ull : (1ull << cn->nodes) - 1));
    if (live) {
      char nl[256];
      node_list(live, cn->nodes, nl, sizeof nl);
      EPD_LOGI(EPD_SUB_CUDA,
               "world communicator made again without the lost nodes (nodes %s, %d ranks) in %.1f ms: "
               "exchanges among them run again",
               nl, __builtin_popcountll(live) * (int)cn->L, (eng_now_ns() - t0) / 1e6);
    } else {
      EPD_LOGI(EPD_SUB_CUDA, "world communicator made again (%u ranks) in %.1f ms: exchanges run again",
               cn->W, (eng_now_ns() - t0) / 1e6);
    }
  }
  pthread_mutex_unlock(&eng->mu);
  return NULL;
}

/* (mu) No exchange runs: the GO order starts again at 0 on every node (none is in flight: every step
 * waited for the restarted node's part; after a loss no exchange is ordered while the world communicator
 * is down), and the thread makes the world communicator again. */
static int remake_start(cnet_t *cn) {
  if (cn->remake_started) pthread_join(cn->remake_th, NULL); /* the last attempt's thread, finished */
  cn->remake_started = 0;
  cn->remake_req = 0;
  cn->remaking = 1;
  __atomic_store_n(&cn->remake_cancel, 0, __ATOMIC_RELEASE);
  cn->go_seq = 0;
  cn->go_have = 0;
  epd_net_drop_group(cn->eng->o.net, "");
  if (pthread_create(&cn->remake_th, NULL, remake_main, cn)) {
    cn->remaking = 0;
    eng_fail(cn->eng, "pthread_create for making the world communicator again failed");
    return 1;
  }
  cn->remake_started = 1;
  return 1;
}

/* (mu) The lead is lost (its link is down here) while no exchange runs here (one that runs aborts:
 * cnet_poll_run): its last order may have reached some nodes and not others, so no exchange starts on
 * the world communicator any more. Every node is told (as after an abort: one whose exchange runs aborts
 * it), and the first node left hands out one without the lost nodes (without_lost). */
static int lead_lost(cnet_t *cn) {
  epd_net_t *net = cn->eng->o.net;
  char lw[160];
  if (cnet_leads(cn) || cn->world_down || cn->run || cn->remake_req || cn->remaking ||
      !epd_net_node_dead(net, cn->lead, lw, sizeof lw))
    return 0;
  snprintf(cn->world_why, sizeof cn->world_why,
           "node %u (ranks %u..%u), which ordered the exchanges, was lost: %s", cn->lead, cn->lead * cn->L,
           cn->lead * cn->L + cn->L - 1, lw);
  cn->world_down = 1;
  for (uint32_t n = 0; n < cn->nodes; n++)
    if (n != cn->node && n != cn->lead) epd_net_step_off(net, n, "", 0, EPD_NET_OFF_WORLD, -1, cn->world_why);
  EPD_LOGE(EPD_SUB_CUDA,
           "%s: steps of this node alone go on, steps with another node fail until the nodes left make a "
           "world communicator without it",
           cn->world_why);
  return 1;
}

/* (mu) The world communicator is down for a lost node and no restarted node is making it again: where two
 * nodes or more are left, the first of them (node 0, unless it is the one lost) hands them the id of one
 * without the lost nodes (epd_net_world_without), so that their steps exchange again before the lost node
 * returns. The nodes of that world are those of the world in use whose link is up here. */
static int without_lost(cnet_t *cn) {
  epd_net_t *net = cn->eng->o.net;
  if (!cn->world_down || cn->without_sent || cn->remake_req || cn->remaking || cn->run ||
      epd_net_remake_pending(net))
    return 0;
  uint64_t live = 0;
  char why[160];
  for (uint32_t n = 0; n < cn->nodes && n < 64; n++)
    if ((cn->world_nodes >> n & 1) && (n == cn->node || !epd_net_node_dead(net, n, why, sizeof why)))
      live |= 1ull << n;
  if (__builtin_ctzll(live) != (int)cn->node) return 0; /* the first node left hands it out */
  /* no one to exchange with, or no node lost (yet: another node's notice came first) */
  if (__builtin_popcountll(live) < 2 || live == cn->world_nodes) return 0;
  uint8_t id[EPD_CC_UNIQUE_ID_BYTES];
  char err[256] = "";
  cn->without_sent = 1;
  if (epd_cc_unique_id(id, err, sizeof err)) {
    EPD_LOGW(EPD_SUB_CUDA, "no world communicator without the lost nodes: %s", err);
    return 0;
  }
  epd_net_world_without(net, live, id);
  return 1;
}

int cnet_world_coming(cnet_t *cn) {
  if (cn->remake_req || cn->remaking) return 1;
  if (!cn->world_down || cnet_leads(cn)) return 0;
  char lw[160];
  int left = 0;
  for (uint32_t n = 0; n < cn->nodes && n < 64; n++)
    left +=
        (cn->world_nodes >> n & 1) && (n == cn->node || !epd_net_node_dead(cn->eng->o.net, n, lw, sizeof lw));
  return left >= 2;
}

/* (mu) A node of the world being made without the lost nodes is lost too: that attempt cannot end well,
 * so it is given up at once (remake_main), and the first node left hands out another. */
static void remake_lost(cnet_t *cn) {
  char lw[160];
  if (!cn->remaking || !cn->remake_live || __atomic_load_n(&cn->remake_cancel, __ATOMIC_ACQUIRE)) return;
  for (uint32_t n = 0; n < cn->nodes && n < 64; n++)
    if (n != cn->node && (cn->remake_live >> n & 1) && epd_net_node_dead(cn->eng->o.net, n, lw, sizeof lw)) {
      EPD_LOGW(EPD_SUB_CUDA,
               "node %u, of the world being made without the lost nodes, was lost too (%s): "
               "that attempt is given up",
               n, lw);
      __atomic_store_n(&cn->remake_cancel, 1, __ATOMIC_RELEASE);
      return;
    }
}

int cnet_world_poll(cnet_t *cn) {
  remake_lost(cn);
  int moved = lead_lost(cn);
  moved |= without_lost(cn);
  if (cn->remake_req && !cn->run && !cn->remaking) moved |= remake_start(cn);
  return moved;
}

#endif /* EPD_WITH_CUDA */
