/*
 * metrics.c - the status/metrics builder (see metrics.h): Prometheus text and StatusReply from one
 * engine snapshot, so that GetStatus, GetMetrics and the crash log can never disagree.
 */
#define _GNU_SOURCE
#include "control/metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epd.h"
#include "epd_wire.h"

/* A growing text buffer; on allocation failure it stays failed and the builder reports NOMEM once. */
typedef struct sbuf {
  char *p;
  size_t len, cap;
  int failed;
} sbuf_t;

static void sb_printf(sbuf_t *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf_t *sb, const char *fmt, ...) {
  if (sb->failed) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(sb->p ? sb->p + sb->len : NULL, sb->p ? sb->cap - sb->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      sb->failed = 1;
      return;
    }
    if (sb->p && sb->len + (size_t)n < sb->cap) {
      sb->len += (size_t)n;
      return;
    }
    size_t ncap = sb->cap ? sb->cap * 2 : 8192;
    while (ncap < sb->len + (size_t)n + 1) ncap *= 2;
    char *np = realloc(sb->p, ncap);
    if (!np) {
      sb->failed = 1;
      return;
    }
    sb->p = np;
    sb->cap = ncap;
  }
}

/* Label values escape backslash, double quote and newline (text format 0.0.4). */
static void sb_label(sbuf_t *sb, const char *v) {
  for (; v && *v; v++) {
    if (*v == '\\')
      sb_printf(sb, "\\\\");
    else if (*v == '"')
      sb_printf(sb, "\\\"");
    else if (*v == '\n')
      sb_printf(sb, "\\n");
    else
      sb_printf(sb, "%c", *v);
  }
}

static void sb_head(sbuf_t *sb, const char *name, const char *type, const char *help) {
  sb_printf(sb, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

const char *epd_metrics_op_name(int op) {
  switch (op) {
    case EPD_OP_LL_DISPATCH:
      return "ll_dispatch";
    case EPD_OP_LL_COMBINE:
      return "ll_combine";
    case EPD_OP_HT_DISPATCH:
      return "ht_dispatch";
    case EPD_OP_HT_COMBINE:
      return "ht_combine";
    default:
      return "none";
  }
}

static const char *op_mode(int op) {
  return op == EPD_OP_HT_DISPATCH || op == EPD_OP_HT_COMBINE ? "ht" : "ll";
}

epd_result_t epd_metrics_text(const epd_engine_snap_t *snap, const epd_daemon_info_t *info, char **out,
                              size_t *len) {
  sbuf_t sb = {0};
  const char *version = info && info->version ? info->version : "";
  const char *state = info && info->state ? info->state : "";

  sb_head(&sb, "epd_info", "gauge",
          "Daemon build and engine: backend, engine mode, version (value is always 1).");
  sb_printf(&sb, "epd_info{backend=\"");
  sb_label(&sb, snap->backend);
  sb_printf(&sb, "\",mode=\"");
  sb_label(&sb, snap->mode);
  sb_printf(&sb, "\",version=\"");
  sb_label(&sb, version);
  sb_printf(&sb, "\"} 1\n");
  /* The state is a label of its own series so that epd_info keeps one series for the daemon's life. */
  sb_head(&sb, "epd_state", "gauge",
          "Daemon state (starting, ready, draining, failed): 1 for the current one.");
  static const char *const states[] = {"starting", "ready", "draining", "failed"};
  for (size_t i = 0; i < sizeof states / sizeof states[0]; i++)
    sb_printf(&sb, "epd_state{state=\"%s\"} %d\n", states[i], !strcmp(state, states[i]));
  sb_head(&sb, "epd_uptime_seconds", "gauge", "Seconds since the daemon started.");
  sb_printf(&sb, "epd_uptime_seconds %.3f\n", info ? (double)info->uptime_ms / 1e3 : 0.0);
  sb_head(&sb, "epd_draining", "gauge", "1 while the daemon refuses new attaches and dispatches.");
  sb_printf(&sb, "epd_draining %d\n", snap->draining ? 1 : 0);
  sb_head(&sb, "epd_ranks", "gauge", "Ranks (GPUs or host threads) owned by this daemon.");
  sb_printf(&sb, "epd_ranks %u\n", snap->num_ranks);
  sb_head(&sb, "epd_cluster_nodes", "gauge", "Nodes (daemons) of the EP world (cluster.nodes).");
  sb_printf(&sb, "epd_cluster_nodes %u\n", snap->nodes ? snap->nodes : 1);
  sb_head(&sb, "epd_cluster_node_rank", "gauge", "This daemon's node rank (cluster.node_rank).");
  sb_printf(&sb, "epd_cluster_node_rank %u\n", snap->node_rank);
  sb_head(&sb, "epd_cluster_world_ranks", "gauge", "Ranks of every group across all nodes.");
  sb_printf(&sb, "epd_cluster_world_ranks %u\n", snap->world_ranks ? snap->world_ranks : snap->num_ranks);
  sb_head(&sb, "epd_cluster_info", "gauge", "Inter-node transport (value is always 1).");
  sb_printf(&sb, "epd_cluster_info{transport=\"");
  sb_label(&sb, snap->inter_node_transport ? snap->inter_node_transport : "none");
  sb_printf(&sb, "\"} 1\n");
  if (snap->nodes > 1) {
    sb_head(&sb, "epd_cluster_link_up", "gauge", "The data link to another node is up (1) or down (0).");
    for (uint32_t n = 0; n < snap->nodes && n < 64; n++)
      if (n != snap->node_rank)
        sb_printf(&sb, "epd_cluster_link_up{node=\"%u\"} %d\n", n, (snap->links_down >> n) & 1 ? 0 : 1);
  }
  sb_head(&sb, "epd_cluster_bytes_total", "counter",
          "Data-plane bytes to and from the other nodes (cuda: the NCCL exchange plus the control frames).");
  sb_printf(&sb, "epd_cluster_bytes_total{direction=\"tx\"} %llu\n", (unsigned long long)snap->net_tx_bytes);
  sb_printf(&sb, "epd_cluster_bytes_total{direction=\"rx\"} %llu\n", (unsigned long long)snap->net_rx_bytes);
  sb_head(&sb, "epd_cluster_frames_total", "counter",
          "Data-plane frames (one per group, step and node pair).");
  sb_printf(&sb, "epd_cluster_frames_total{direction=\"tx\"} %llu\n",
            (unsigned long long)snap->net_tx_frames);
  sb_printf(&sb, "epd_cluster_frames_total{direction=\"rx\"} %llu\n",
            (unsigned long long)snap->net_rx_frames);
  sb_head(&sb, "epd_clients", "gauge", "Attached clients.");
  sb_printf(&sb, "epd_clients %u\n", snap->nclients);
  sb_head(&sb, "epd_attach_connections", "gauge", "Open attach-socket connections.");
  sb_printf(&sb, "epd_attach_connections %u\n", info ? info->attach_connections : 0);
  sb_head(&sb, "epd_attach_unredeemed_connections", "gauge",
          "Open attach-socket connections that have not sent their token yet.");
  sb_printf(&sb, "epd_attach_unredeemed_connections %u\n", info ? info->attach.unredeemed : 0);
  sb_head(&sb, "epd_attach_refused_total", "counter",
          "Attach-socket connections closed at accept: cap (daemon.max_unredeemed_conns), uid "
          "(daemon.max_unredeemed_per_uid), peer (not allowed, or no credentials).");
  static const char *const reasons[EPD_ATTACH_REFUSED_MAX] = {"cap", "uid", "peer"};
  for (int i = 0; i < EPD_ATTACH_REFUSED_MAX; i++)
    sb_printf(&sb, "epd_attach_refused_total{reason=\"%s\"} %llu\n", reasons[i],
              (unsigned long long)(info ? info->attach.refused[i] : 0));
  sb_head(&sb, "epd_attach_accept_errors_total", "counter",
          "Failed accepts on the attach socket (out of fds or memory); the listener pauses after each.");
  sb_printf(&sb, "epd_attach_accept_errors_total %llu\n",
            (unsigned long long)(info ? info->attach.accept_errors : 0));
  sb_head(&sb, "epd_control_connections", "gauge",
          "Open control (gRPC) connections, as counted at the last accept.");
  sb_printf(&sb, "epd_control_connections %u\n", info ? info->control_connections : 0);
  sb_head(&sb, "epd_control_refused_total", "counter",
          "Control connections refused at accept: cap (daemon.max_control_conns), uid "
          "(daemon.max_control_conns_per_uid).");
  static const char *const creasons[2] = {"cap", "uid"};
  for (int i = 0; i < 2; i++)
    sb_printf(&sb, "epd_control_refused_total{reason=\"%s\"} %llu\n", creasons[i],
              (unsigned long long)(info ? info->control_refused[i] : 0));
  sb_head(&sb, "epd_groups", "gauge", "EP groups.");
  sb_printf(&sb, "epd_groups %u\n", snap->ngroups);

  sb_head(&sb, "epd_ops_total", "counter", "Operations completed, by op.");
  for (int op = 1; op < EPD_OP_MAX; op++)
    sb_printf(&sb, "epd_ops_total{op=\"%s\",mode=\"%s\"} %llu\n", epd_metrics_op_name(op), op_mode(op),
              (unsigned long long)snap->ops[op].count);
  sb_head(&sb, "epd_op_errors_total", "counter", "Operations that completed with an error, by op.");
  for (int op = 1; op < EPD_OP_MAX; op++)
    sb_printf(&sb, "epd_op_errors_total{op=\"%s\",mode=\"%s\"} %llu\n", epd_metrics_op_name(op), op_mode(op),
              (unsigned long long)snap->ops[op].errors);
  sb_head(&sb, "epd_bytes_total", "counter", "Payload bytes moved between ranks, by op.");
  for (int op = 1; op < EPD_OP_MAX; op++)
    sb_printf(&sb, "epd_bytes_total{op=\"%s\",mode=\"%s\"} %llu\n", epd_metrics_op_name(op), op_mode(op),
              (unsigned long long)snap->ops[op].bytes);

  sb_head(&sb, "epd_op_latency_seconds", "histogram",
          "Operation latency from the last rank's submission to completion, by op.");
  for (int op = 1; op < EPD_OP_MAX; op++) {
    const epd_op_snap_t *o = &snap->ops[op];
    uint64_t cum = 0;
    for (int i = 0; i < EPD_LAT_BUCKETS; i++) {
      cum += o->lat_bucket[i];
      sb_printf(&sb, "epd_op_latency_seconds_bucket{op=\"%s\",mode=\"%s\",le=\"", epd_metrics_op_name(op),
                op_mode(op));
      if (i == EPD_LAT_BUCKETS - 1)
        sb_printf(&sb, "+Inf");
      else
        sb_printf(&sb, "%g", 1e-6 * (double)(1ull << i));
      sb_printf(&sb, "\"} %llu\n", (unsigned long long)cum);
    }
    /* _count is the +Inf bucket, which the format requires to be equal. */
    sb_printf(&sb, "epd_op_latency_seconds_sum{op=\"%s\",mode=\"%s\"} %.9f\n", epd_metrics_op_name(op),
              op_mode(op), o->lat_sum_s);
    sb_printf(&sb, "epd_op_latency_seconds_count{op=\"%s\",mode=\"%s\"} %llu\n", epd_metrics_op_name(op),
              op_mode(op), (unsigned long long)cum);
  }

  sb_head(&sb, "epd_rank_buffer_bytes", "gauge", "Daemon-side buffers of a rank (windows, queues, arenas).");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    sb_printf(&sb, "epd_rank_buffer_bytes{rank=\"%d\",device=\"%d\"} %llu\n", snap->ranks[i].rank,
              snap->ranks[i].device, (unsigned long long)snap->ranks[i].buffer_bytes);
  sb_head(&sb, "epd_rank_clients", "gauge", "Clients attached to a rank.");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    sb_printf(&sb, "epd_rank_clients{rank=\"%d\"} %u\n", snap->ranks[i].rank, snap->ranks[i].clients);
  sb_head(&sb, "epd_rank_ops_total", "counter", "Operations executed by a rank.");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    sb_printf(&sb, "epd_rank_ops_total{rank=\"%d\"} %llu\n", snap->ranks[i].rank,
              (unsigned long long)snap->ranks[i].ops);
  sb_head(&sb, "epd_rank_bytes_sent_total", "counter", "Bytes a rank sent to its peers.");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    sb_printf(&sb, "epd_rank_bytes_sent_total{rank=\"%d\"} %llu\n", snap->ranks[i].rank,
              (unsigned long long)snap->ranks[i].bytes_sent);
  sb_head(&sb, "epd_timeouts_total", "counter", "Steps a rank failed because a peer did not arrive in time.");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    sb_printf(&sb, "epd_timeouts_total{rank=\"%d\"} %llu\n", snap->ranks[i].rank,
              (unsigned long long)snap->ranks[i].timeouts);
  sb_head(&sb, "epd_rank_errors_total", "counter", "Operations a rank failed.");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    sb_printf(&sb, "epd_rank_errors_total{rank=\"%d\"} %llu\n", snap->ranks[i].rank,
              (unsigned long long)snap->ranks[i].errors);
  sb_head(&sb, "epd_peer_wait_seconds_total", "counter", "Time a rank spent waiting for each peer.");
  for (uint32_t i = 0; i < snap->num_ranks; i++)
    for (uint32_t p = 0; p < snap->num_ranks && p < EPD_MAX_RANKS; p++)
      sb_printf(&sb, "epd_peer_wait_seconds_total{rank=\"%d\",peer=\"%u\"} %.9f\n", snap->ranks[i].rank, p,
                (double)snap->ranks[i].wait_ns_by_peer[p] / 1e9);

  sb_head(&sb, "epd_group_steps_total", "counter", "Steps completed by an EP group.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_group_steps_total{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %llu\n", (unsigned long long)snap->groups[g].steps);
  }
  sb_head(&sb, "epd_group_map_version", "gauge", "Active expert map version of an EP group.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_group_map_version{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %u\n", snap->groups[g].map_version);
  }
  sb_head(&sb, "epd_group_attached_ranks", "gauge", "Ranks of an EP group with at least one client.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_group_attached_ranks{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %u\n", snap->groups[g].attached_ranks);
  }
  sb_head(&sb, "epd_expert_tokens_total", "counter", "Tokens routed to each logical expert (feeds EPLB).");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    const epd_group_snap_t *gr = &snap->groups[g];
    for (uint32_t e = 0; gr->expert_tokens && e < gr->num_experts; e++) {
      sb_printf(&sb, "epd_expert_tokens_total{group=\"");
      sb_label(&sb, gr->name);
      sb_printf(&sb, "\",expert=\"%u\"} %llu\n", e, (unsigned long long)gr->expert_tokens[e]);
    }
  }
  sb_head(&sb, "epd_slot_tokens_total", "counter",
          "Tokens routed to each physical (rank, slot) replica (the load of each replica).");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    const epd_group_snap_t *gr = &snap->groups[g];
    for (uint32_t i = 0; gr->slot_tokens && i < gr->num_ranks * gr->slots_per_rank; i++) {
      sb_printf(&sb, "epd_slot_tokens_total{group=\"");
      sb_label(&sb, gr->name);
      sb_printf(&sb, "\",rank=\"%u\",slot=\"%u\"} %llu\n", i / gr->slots_per_rank, i % gr->slots_per_rank,
                (unsigned long long)gr->slot_tokens[i]);
    }
  }
  sb_head(&sb, "epd_map_switches_total", "counter", "Expert map switches of an EP group.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_map_switches_total{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %llu\n", (unsigned long long)snap->groups[g].map_switches);
  }
  sb_head(&sb, "epd_group_masked_ranks", "gauge",
          "Ranks of an EP group masked now (on_rank_loss = mask): no token goes to them.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_group_masked_ranks{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %d\n", __builtin_popcountll(snap->groups[g].masked_ranks));
  }
  sb_head(&sb, "epd_group_rank_masks_total", "counter", "Ranks of an EP group masked after a loss.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_group_rank_masks_total{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %llu\n", (unsigned long long)snap->groups[g].masks);
  }
  sb_head(&sb, "epd_group_entries_dropped_total", "counter",
          "Top-k entries of an EP group dropped because no replica of their expert was on a live rank.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_group_entries_dropped_total{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %llu\n", (unsigned long long)snap->groups[g].entries_dropped);
  }
  sb_head(&sb, "epd_weight_bytes_copied_total", "counter", "Expert weight bytes copied by migrations.");
  for (uint32_t g = 0; g < snap->ngroups; g++) {
    sb_printf(&sb, "epd_weight_bytes_copied_total{group=\"");
    sb_label(&sb, snap->groups[g].name);
    sb_printf(&sb, "\"} %llu\n", (unsigned long long)snap->groups[g].weight_bytes_copied);
  }

  if (sb.failed) {
    free(sb.p);
    *out = NULL;
    return EPD_ERR_NOMEM;
  }
  if (!sb.p) sb_printf(&sb, "%s", "");
  *out = sb.p;
  if (len) *len = sb.len;
  return EPD_OK;
}

static char *dup_str(const char *s, int *failed) {
  char *d = strdup(s ? s : "");
  if (!d) *failed = 1;
  return d;
}

epd_result_t epd_metrics_status(const epd_engine_snap_t *snap, const epd_daemon_info_t *info,
                                Epd__V1__StatusReply **out) {
  int failed = 0;
  Epd__V1__StatusReply *st = calloc(1, sizeof *st);
  if (!st) return EPD_ERR_NOMEM;
  epd__v1__status_reply__init(st);
  st->version = dup_str(info ? info->version : "", &failed);
  st->backend = dup_str(snap->backend, &failed);
  st->engine_mode = dup_str(snap->mode, &failed);
  st->state = dup_str(info ? info->state : "", &failed);
  st->config = dup_str(info ? info->config : "", &failed);
  st->num_ranks = snap->num_ranks;
  st->uptime_ms = info ? info->uptime_ms : 0;
  st->draining = snap->draining ? 1 : 0;
  st->protocol_version = EPD_PROTOCOL_VERSION;
  st->nodes = snap->nodes ? snap->nodes : 1;
  st->node_rank = snap->node_rank;
  st->world_ranks = snap->world_ranks ? snap->world_ranks : snap->num_ranks;
  st->inter_node_transport =
      dup_str(snap->inter_node_transport ? snap->inter_node_transport : "none", &failed);
  st->gin = dup_str(snap->gin ? snap->gin : "", &failed);
  st->rendezvous = dup_str(snap->rendezvous ? snap->rendezvous : "", &failed);
  st->links = dup_str(snap->links, &failed);

  if (snap->ngroups) {
    st->groups = calloc(snap->ngroups, sizeof *st->groups);
    if (!st->groups) failed = 1;
  }
  for (uint32_t i = 0; st->groups && i < snap->ngroups; i++) {
    Epd__V1__GroupStatus *g = calloc(1, sizeof *g);
    if (!g) {
      failed = 1;
      break;
    }
    epd__v1__group_status__init(g);
    st->groups[st->n_groups++] = g;
    const epd_group_snap_t *s = &snap->groups[i];
    g->name = dup_str(s->name, &failed);
    g->num_experts = s->num_experts;
    g->hidden = s->hidden;
    g->topk = s->topk;
    g->max_tokens = s->max_tokens;
    g->attached_ranks = s->attached_ranks;
    g->steps = s->steps;
    g->map_version = s->map_version;
    g->mode = dup_str(s->mode, &failed);
    g->nodes = dup_str(s->nodes, &failed);
    g->on_rank_loss = dup_str(s->on_rank_loss == EPD_RANK_LOSS_MASK ? "mask" : "fail", &failed);
    g->masked_ranks = s->masked_ranks;
    g->entries_dropped = s->entries_dropped;
    g->masks = s->masks;
    g->renormalize = s->renormalize != 0;
  }
  if (snap->nclients) {
    st->clients = calloc(snap->nclients, sizeof *st->clients);
    if (!st->clients) failed = 1;
  }
  for (uint32_t i = 0; st->clients && i < snap->nclients; i++) {
    Epd__V1__ClientStatus *c = calloc(1, sizeof *c);
    if (!c) {
      failed = 1;
      break;
    }
    epd__v1__client_status__init(c);
    st->clients[st->n_clients++] = c;
    const epd_client_snap_t *s = &snap->clients[i];
    c->client_id = s->client_id;
    c->name = dup_str(s->name, &failed);
    c->group = dup_str(s->group, &failed);
    c->rank = s->rank;
    c->pid = s->pid;
    c->uid = s->uid;
    c->ops = s->ops;
    c->attached_ns = s->attached_ns;
    c->arena_bytes = s->arena_bytes;
  }
  if (snap->num_ranks) {
    st->ranks = calloc(snap->num_ranks, sizeof *st->ranks);
    if (!st->ranks) failed = 1;
  }
  for (uint32_t i = 0; st->ranks && i < snap->num_ranks; i++) {
    /* the UUID's text lives in the same allocation as its message (freed with it) */
    struct rank_status_mem {
      Epd__V1__RankStatus r;
      char uuid[EPD_UUID_TEXT];
    } *m = calloc(1, sizeof *m);
    if (!m) {
      failed = 1;
      break;
    }
    Epd__V1__RankStatus *r = &m->r;
    epd__v1__rank_status__init(r);
    st->ranks[st->n_ranks++] = r;
    const epd_rank_snap_t *s = &snap->ranks[i];
    r->rank = s->rank;
    r->device = s->device;
    if (s->has_uuid) {
      epd_uuid_text(s->device_uuid, m->uuid);
      r->device_uuid = m->uuid;
    }
    r->buffer_bytes = s->buffer_bytes;
    r->clients = s->clients;
    r->ops = s->ops;
    r->gpu_ranks = s->gpu_ranks;
  }
  if (failed) {
    epd_metrics_status_free(st);
    *out = NULL;
    return EPD_ERR_NOMEM;
  }
  *out = st;
  return EPD_OK;
}

void epd_metrics_status_free(Epd__V1__StatusReply *st) {
  if (!st) return;
  for (size_t i = 0; i < st->n_groups; i++) {
    free(st->groups[i]->name);
    free(st->groups[i]->mode);
    free(st->groups[i]->nodes);
    free(st->groups[i]->on_rank_loss);
    free(st->groups[i]);
  }
  for (size_t i = 0; i < st->n_clients; i++) {
    free(st->clients[i]->name);
    free(st->clients[i]->group);
    free(st->clients[i]);
  }
  for (size_t i = 0; i < st->n_ranks; i++) free(st->ranks[i]);
  free(st->groups);
  free(st->clients);
  free(st->ranks);
  free(st->version);
  free(st->backend);
  free(st->engine_mode);
  free(st->inter_node_transport);
  free(st->gin);
  free(st->rendezvous);
  free(st->links);
  free(st->state);
  free(st->config);
  free(st);
}
