/*
 * conf.h - the daemon's configuration: one typed table (name, type, bounds, default, reloadable, doc)
 * from which parsing (libinih), validation, dumping (`epdctl config`) and SIGHUP reload all derive.
 * Keys are "section.name" in the table and [section] name = value in the file (config/epd.conf).
 */
#ifndef EPD_CONF_H
#define EPD_CONF_H

#include <stddef.h>
#include <stdint.h>

#define EPD_PATH_MAX 256

typedef struct epd_conf {
  /* [daemon] */
  char control_socket[EPD_PATH_MAX];  /* "" -> default under /run/epd (root) or the user runtime dir */
  char attach_socket[EPD_PATH_MAX];   /* "" -> beside the control socket, "attach.sock" */
  uint32_t socket_mode;               /* octal file mode of both sockets */
  char socket_group[64];              /* group owning the sockets ("" = the daemon's) */
  char state_dir[EPD_PATH_MAX];       /* where state that survives a restart is kept ("" = none) */
  uint32_t token_ttl_ms;              /* one-time attach token lifetime */
  uint32_t drain_timeout_ms;          /* SIGTERM: wait this long for clients before exiting */
  uint32_t max_message_bytes;         /* gRPC receive limit */
  uint32_t max_pending_tokens;        /* issued, unredeemed attach tokens at once */
  uint32_t max_watches;               /* server-streaming calls (Watch, Health.Watch) open at once */
  uint32_t max_unredeemed_conns;      /* attach connections without a token yet, at once (all uids) */
  uint32_t max_unredeemed_per_uid;    /* the same, per uid */
  uint32_t max_control_conns;         /* control (gRPC) connections open at once, all uids */
  uint32_t max_control_conns_per_uid; /* the same, per uid */
  char allow_uids[256];               /* comma list of users (ids or names) who may connect; "" = anyone */
  char allow_gids[256];               /* comma list of groups (primary or supplementary); "" = anyone */
  char admin_uids[256];               /* users allowed SetExpertMap/Drain (with root and the daemon's uid) */
  char admin_gid[256];                /* group(s) allowed SetExpertMap/Drain; both "" = anyone */
  /* [log] */
  int log_level;           /* EPD_LOG_* */
  uint32_t log_subsystems; /* EPD_SUB_* mask */
  /* [engine] */
  char backend[16];   /* "auto", "host", "cuda" */
  uint32_t num_ranks; /* ranks (GPUs) of this node */
  char devices[256];  /* cuda: comma list, the GPU of each local rank ("" = rank r on GPU r) */
  uint32_t max_experts, max_hidden, max_topk, max_tokens;
  uint32_t slots_factor_pct;   /* redundant-expert slots: 100 = none */
  uint32_t ht_capacity_factor; /* HT receive capacity in units of max_tokens (0 = num_ranks) */
  uint32_t ht_sms;             /* blocks (one per SM) of each HT data kernel (cuda) */
  uint32_t ht_ce_split;        /* copies per dest rank of a copy-engine HT dispatch (cuda) */
  char cuda_mode[16];          /* "auto", "launch", "persistent" (cuda) */
  uint32_t ll_blocks;          /* blocks of each LL kernel, per rank (cuda; 0: the mode's default) */
  uint32_t idle_spin_ns;       /* rank threads spin this long after activity before sleeping (cuda) */
  uint32_t step_timeout_ms;
  uint32_t rehome_replicas;
  uint32_t exit_on_failure; /* 1: drain and exit 1 after an engine failure (restart by systemd) */
  uint32_t max_groups, max_clients_per_rank;
  uint64_t max_arena_bytes;
  /* [cluster] scale-out across nodes (daemon/cluster.h) */
  uint32_t nodes;                /* daemons (nodes) forming the EP world; 1: single node */
  uint32_t node_rank;            /* this node, 0 = coordinator */
  char cluster_listen[128];      /* coordinator's rendezvous listener "host:port"; "" = off */
  char cluster_coordinator[128]; /* "host:port" the other nodes contact */
  char cluster_data_listen[128]; /* this node's data-plane listener "host:port" (port 0: any) */
  uint32_t cluster_timeout_ms;   /* rendezvous and data connection set-up */
  uint32_t gin_probe;            /* cuda: ask NCCL at start-up whether it offers GIN (same on every node) */
  char cluster_tls_ca[256];      /* PEM files of mutual TLS on the rendezvous: the CA both sides trust, */
  char cluster_tls_cert[256];    /* this node's certificate and */
  char cluster_tls_key[256];     /* its private key; all three or none ("" = plaintext) */
  char cluster_tls_server_name[128]; /* joiners: name the coordinator's certificate must carry ("": its host)
                                      */
  /* [metrics] */
  char prometheus_listen[64]; /* "" = off, else "host:port" */
} epd_conf_t;

/* Fill with defaults. */
void epd_conf_defaults(epd_conf_t *c);
/* Load a file over the defaults; on error returns -1 with a message naming the key (and line) and
 * the allowed range in err. A missing file is an error unless optional != 0. */
int epd_conf_load(epd_conf_t *c, const char *path, int optional, char *err, size_t errlen);
/* Parse configuration text (the file format) over c; same error rules as epd_conf_load. */
int epd_conf_load_text(epd_conf_t *c, const char *text, size_t len, char *err, size_t errlen);
/* Set one key from text ("section.name", value); same error rules. */
int epd_conf_set(epd_conf_t *c, const char *key, const char *value, char *err, size_t errlen);
/* Write every key with its effective value as "section.name = value\n" into buf; returns length. */
size_t epd_conf_dump(const epd_conf_t *c, char *buf, size_t len);
/* Copy the keys that can change at runtime (reloadable) from src into dst; returns how many changed. */
int epd_conf_apply_reloadable(epd_conf_t *dst, const epd_conf_t *src);

/* Describe, one "key: old -> new (applied|needs restart)" line each, the keys that differ between
 * cur and next; returns how many differ (the text is truncated to len). */
int epd_conf_diff(const epd_conf_t *cur, const epd_conf_t *next, char *buf, size_t len);
/* Resolve the control socket path: conf->control_socket, else /run/epd/control.sock for root, else
 * $XDG_RUNTIME_DIR/epd/control.sock, else /tmp/epd-<uid>/control.sock. Returns 0, or -1 if too long. */
int epd_conf_control_socket_path(const epd_conf_t *c, char *buf, size_t len);
/* Resolve the attach socket path: conf->attach_socket, else "attach.sock" beside the control socket. */
int epd_conf_attach_socket_path(const epd_conf_t *c, char *buf, size_t len);
/* Parse a comma list of numeric ids or names (users, or groups when groups != 0) into out (at most
 * max); returns the count, or -1 with a message naming the bad entry in err. */
int epd_conf_parse_ids(const char *text, int groups, uint32_t *out, size_t max, char *err, size_t errlen);
#define EPD_CONF_MAX_IDS 64
/* Parse a comma list of integers in [0, max_value] into out (at most max); returns the count (0 for an
 * empty text), or -1 with a message naming the bad entry in err. */
int epd_conf_parse_list(const char *text, uint32_t max_value, int *out, size_t max, char *err, size_t errlen);
#define EPD_CONF_MAX_LIST 64
/* Print the documented table (key, type, default, range, reloadable, doc) for `epd --help-config`. */
size_t epd_conf_describe(char *buf, size_t len);

#endif
