/*
 * cnet_off.c - steps given up across nodes on the CUDA backend (cnet_internal.h): the lead (node 0, or the
 * first node left after its loss) orders the exchanges, so it decides which steps do not run. Another
 * node that waited a step timeout asks it (EPD_NET_OFF_ASK); the lead answers that the step was ordered
 * (its GO comes) or gives it up and tells every node (EPD_NET_OFF_NO); a node whose exchange aborted, or
 * that lost the lead, tells every node (EPD_NET_OFF_WORLD).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cnet_internal.h"
#include "cuda/engine_cuda_net.h"
#include "net/engine_net.h"
#include "net/frame.h"
#include "core/log.h"

#if EPD_WITH_CUDA

/* (mu) The group of that name served here (a removed group's kept step too), or NULL. */
static cnet_grp_t *by_name(cnet_t *cn, const char *group) {
  cnet_grp_t *orphan = NULL;
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (!strcmp(cg->gname, group)) {
      if (cnet_grp_alive(cn, cg)) return cg;
      if (cg->orphan) orphan = cg;
    }
  return orphan;
}

cnet_away_t *cnet_away_of(cnet_t *cn, const char *group, int make) {
  cnet_away_t *pick = NULL;
  for (unsigned i = 0; i < CNET_AWAY; i++) {
    cnet_away_t *a = &cn->away[i];
    if (a->group[0] && !strcmp(a->group, group)) return a;
    if (a->pending) continue;
    /* a free entry first, else the one told of longest ago */
    if (!pick || (pick->group[0] && (!a->group[0] || a->ns < pick->ns))) pick = a;
  }
  if (!make || !pick) return NULL;
  memset(pick, 0, sizeof *pick);
  snprintf(pick->group, sizeof pick->group, "%s", group);
  return pick;
}

/* (mu) The lead: a step of group below `to` that waits for its order here is not ordered. */
static void away_off(cnet_t *cn, const char *group, uint64_t to) {
  cnet_away_t *a = cnet_leads(cn) ? cnet_away_of(cn, group, 0) : NULL;
  if (a && a->pending && a->step < to) a->pending = 0;
}

/* (mu) No step of the group below `to` runs (peer, why: the reason); the lead tells every other node of
 * its world but those out of the steps in mask (net_node_masked). */
void cnet_off_raise(cnet_t *cn, cnet_grp_t *cg, uint64_t to, int status, int peer, const char *why,
                    uint64_t mask) {
  if (to <= cg->off_to) return;
  away_off(cn, cg->gname, to);
  cg->off_to = to;
  cg->off_status = status ? status : EPD_ERR_TIMEOUT;
  cg->off_peer = peer;
  snprintf(cg->off_why, sizeof cg->off_why, "%s", why);
  for (uint32_t n = 0; cnet_leads(cn) && n < cn->nodes && n < 64; n++)
    if (n != cn->node && (cn->world_nodes >> n & 1) && !net_node_masked(cn->eng, mask, n))
      epd_net_step_no(cn->eng->o.net, n, cg->gname, to - 1, cg->off_status, peer, why);
}

/* (mu) A group not served here: no step of it below `to` runs when it is (cnet_unserved_take). */
static void unserved_put(cnet_t *cn, const char *group, uint64_t to, const char *why) {
  const uint64_t now = eng_now_ns();
  unsigned k = 0, i;
  for (i = 0; i < 8 && strcmp(cn->unserved[i].group, group); i++)
    if (cn->unserved[i].ns < cn->unserved[k].ns) k = i; /* else the oldest (or a free one) is replaced */
  if (i < 8 && cn->unserved[i].to >= to && now - cn->unserved[i].ns < CNET_UNSERVED_NS) return;
  if (i < 8) k = i;
  away_off(cn, group, to);
  snprintf(cn->unserved[k].group, sizeof cn->unserved[k].group, "%s", group);
  cn->unserved[k].to = to;
  cn->unserved[k].ns = now;
  snprintf(cn->unserved[k].why, sizeof cn->unserved[k].why, "%s", why);
}

/* (mu) A group served from now: what was given up of it while it was not (unserved_put). */
void cnet_unserved_take(cnet_t *cn, cnet_grp_t *cg) {
  for (unsigned i = 0; i < 8; i++)
    if (cn->unserved[i].group[0] && !strcmp(cn->unserved[i].group, cg->gname)) {
      if (eng_now_ns() - cn->unserved[i].ns < CNET_UNSERVED_NS) {
        cg->off_to = cn->unserved[i].to;
        cg->off_status = EPD_ERR_TIMEOUT;
        cg->off_peer = -1;
        snprintf(cg->off_why, sizeof cg->off_why, "%s", cn->unserved[i].why);
        EPD_LOGI(EPD_SUB_CUDA,
                 "group %s: steps below %llu were given up before it had a client here (%s): they fail at "
                 "once",
                 cg->gname, (unsigned long long)cg->off_to, cg->off_why);
      }
      memset(&cn->unserved[i], 0, sizeof cn->unserved[i]);
    }
}

/* (mu) The lead: a step of that name was ordered, that step or a later one (the asking node is at it). */
static int ordered(cnet_t *cn, const char *group, uint64_t step) {
  for (cnet_grp_t *cg = cn->groups; cg; cg = cg->next)
    if (!strcmp(cg->gname, group) && cg->go_valid && cg->go_step >= step) return 1;
  const cnet_away_t *a = cnet_away_of(cn, group, 0);
  return a && a->go_valid && a->go_step == step; /* steps of other nodes: numbered again if made again */
}

/* (mu) The lead: node `node`'s step of group, which the lead is out of, is ready there (nodes: the
 * step's; the first of them tells). It is ordered at the next poll, unless given up here: then the node
 * hears so. */
static void away_ready(cnet_t *cn, const char *group, uint64_t step, uint32_t node, uint64_t nodes) {
  const cnet_grp_t *cg = by_name(cn, group);
  uint64_t off = cg ? cg->off_to : 0;
  int peer = cg ? cg->off_peer : -1, code = cg ? cg->off_status : EPD_ERR_TIMEOUT;
  const char *why = cg ? cg->off_why : "";
  for (unsigned i = 0; !cg && i < 8; i++)
    if (!strcmp(cn->unserved[i].group, group) && eng_now_ns() - cn->unserved[i].ns < CNET_UNSERVED_NS) {
      off = cn->unserved[i].to;
      why = cn->unserved[i].why;
    }
  if (step < off) {
    epd_net_step_no(cn->eng->o.net, node, group, off - 1, code, peer, why);
    return;
  }
  cnet_away_t *a = cnet_away_of(cn, group, 1);
  if (!a || (a->pending && a->step == step)) return;
  if (a->go_valid && step <= a->go_step) a->go_valid = 0; /* the group was made again there */
  a->pending = 1;
  a->step = step;
  a->nodes = nodes;
  a->seq = ++cn->ready_ctr;
  a->ns = eng_now_ns();
}

void eng_cuda_net_step_off(cnet_t *cn, const char *group, uint64_t step, uint32_t node, int what, int peer,
                           int code, uint64_t nodes, const char *why) {
  if (what == EPD_NET_OFF_WORLD) { /* its exchanges with this node would find no partner */
    if (node >= 64 || node == cn->node || !(cn->world_nodes >> node & 1)) return; /* not of this world */
    cn->aborted |= 1ull << node;
    if (!cn->world_down)
      snprintf(cn->world_why, sizeof cn->world_why, "node %u aborted its world communicator: %s", node, why);
    cn->world_down = 1;
    return;
  }
  if (what == EPD_NET_OFF_ASK || what == EPD_NET_OFF_READY
          ? !cnet_leads(cn)
          : node != cn->lead) { /* sent before the lead changed */
    EPD_LOGW(EPD_SUB_CUDA,
             "node %u sent a step notice (%d) about group %s step %llu, but node %u orders the exchanges: "
             "ignored",
             node, what, group, (unsigned long long)step, cn->lead);
    return;
  }
  if (what == EPD_NET_OFF_READY) {
    away_ready(cn, group, step, node, nodes);
    return;
  }
  cnet_grp_t *cg = by_name(cn, group);
  char w[320];
  if (!cnet_leads(cn)) { /* the lead's answer */
    if (cg && what == EPD_NET_OFF_ORDERED && step + 1 > cg->ordered_to) cg->ordered_to = step + 1;
    if (cg && what == EPD_NET_OFF_NO) {
      snprintf(w, sizeof w, "node %u gave the step up: %s", node, why);
      /* a status from the wire: an error code, else the step timed out as far as this node knows */
      cnet_off_raise(cn, cg, step + 1, code < 0 && code > EPD_ERR_MIN ? code : EPD_ERR_TIMEOUT, peer, w, 0);
    }
    return;
  }
  if (ordered(cn, group, step)) { /* its GO is on the way there */
    epd_net_step_off(cn->eng->o.net, node, group, step, EPD_NET_OFF_ORDERED, -1, "");
    return;
  }
  if (!cg) { /* none of its steps is ordered here: the node goes on, and so will this one when served */
    snprintf(w, sizeof w, "node %u asked to give it up (the group had no client on node %u): %s", node,
             cn->node, why);
    unserved_put(cn, group, step + 1, w);
    epd_net_step_no(cn->eng->o.net, node, group, step, EPD_ERR_TIMEOUT, peer, w);
    return;
  }
  if (!cg->wd_pending || step > cg->wd_step) {
    cg->wd_step = step;
    cg->wd_node = node;
    cg->wd_peer = peer >= 0 ? peer : (int)(node * cn->L);
    snprintf(cg->wd_why, sizeof cg->wd_why, "%s", why);
  }
  cg->wd_pending = 1;
}

/* (mu) The lead: a node asked to give a step up. Ordered already: the GO is on its way there and the step
 * runs. Else no step of the group up to it runs: one waiting here fails (off_check) and every node hears
 * it (off_raise). */
int cnet_answer_off(cnet_t *cn, cnet_grp_t *cg) {
  if (!cg->wd_pending) return 0;
  cg->wd_pending = 0;
  if (ordered(cn, cg->gname, cg->wd_step)) {
    epd_net_step_off(cn->eng->o.net, cg->wd_node, cg->gname, cg->wd_step, EPD_NET_OFF_ORDERED, -1, "");
    return 0;
  }
  char why[320];
  snprintf(why, sizeof why, "node %u asked to give it up: %s", cg->wd_node, cg->wd_why);
  EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->wd_step, why);
  if (cg->wd_step < cg->off_to) /* given up before: that node hears it again */
    epd_net_step_no(cn->eng->o.net, cg->wd_node, cg->gname, cg->off_to - 1, cg->off_status, cg->off_peer,
                    cg->off_why);
  else
    cnet_off_raise(cn, cg, cg->wd_step + 1, EPD_ERR_TIMEOUT, cg->wd_peer, why, 0);
  return 1;
}

/* (mu) A step below off_to waiting for parts or its turn fails: 1 if so. */
int cnet_off_check(cnet_t *cn, cnet_grp_t *cg) {
  if (cg->step >= cg->off_to) return 0;
  cnet_complete(cn, cg, cg->off_status, cg->off_peer, cg->off_why);
  return 1;
}

/* (mu) Not the lead: the step waited past engine.step_timeout_ms since `since` for a part or for its GO
 * (what). It asks the lead once to give it up and goes on waiting for the lead's word or the GO; it fails
 * here only if the link to the lead is down or the lead answers nothing within another timeout (an
 * exchange the lead orders after that would find no partner here). 1 if it failed. */
int cnet_ask_off(cnet_t *cn, cnet_grp_t *cg, uint64_t since, uint64_t now, int peer, const char *what) {
  epd_engine_t *eng = cn->eng;
  const uint64_t to = (uint64_t)eng->o.step_timeout_ms * 1000000ull;
  char why[400];
  if (cnet_world_coming(cn) && now - since <= 3 * to) return 0; /* the new world's lead decides */
  if (!cg->wd_ns) {
    if (now <= since || now - since <= to) return 0;
    cg->wd_ns = now;
    if (!epd_net_step_off(eng->o.net, cn->lead, cg->gname, cg->step, EPD_NET_OFF_ASK, peer, what)) {
      EPD_LOGW(EPD_SUB_CUDA, "group %s step %llu: %s: asked node %u to give the step up", cg->gname,
               (unsigned long long)cg->step, what, cn->lead);
      return 0;
    }
    snprintf(why, sizeof why, "%s (the link to node %u is down)", what, cn->lead);
  } else {
    /* ordered (the lead said so, or its GO is held here): the step runs once its parts are in */
    if (now - cg->wd_ns <= to || cg->ordered_to > cg->step ||
        (cn->go_have && cn->go.step == cg->step && !strcmp(cn->go.group, cg->gname)))
      return 0;
    snprintf(why, sizeof why, "%s, and node %u did not answer within %u ms when asked to give the step up",
             what, cn->lead, eng->o.step_timeout_ms);
    EPD_LOGE(EPD_SUB_CUDA, "group %s step %llu: %s", cg->gname, (unsigned long long)cg->step, why);
  }
  cnet_complete(cn, cg, EPD_ERR_TIMEOUT, peer, why);
  return 1;
}

#endif /* EPD_WITH_CUDA */
