/*
 * cluster.h - scale-out start-up: the rendezvous of the daemons of several nodes (cluster.* config) and
 * the data links between them (engine_net.h). Node 0 is the coordinator: it serves the
 * epd.v1.Cluster/Rendezvous RPC on cluster.listen (a TCP gRPC server of its own, never the control
 * socket) until every node has joined, then closes it. The other nodes call it, retrying until
 * cluster.timeout_ms. Everything happens before the daemon reports READY.
 */
#ifndef EPD_CLUSTER_H
#define EPD_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "control/conf.h"
#include "net/engine_net.h"

#define EPD_CLUSTER_COMM_ID_BYTES 128 /* sizeof(ncclUniqueId) */

/* Makes the id of the world's NCCL communicator (ncclGetUniqueId); 0, or -1 with a message in err. */
typedef int (*epd_cluster_comm_id_fn)(uint8_t *id, char *err, size_t errlen);

/* With conf->nodes > 1: validate the cluster keys, listen for data, rendezvous, connect the data links.
 * *net gets the links (NULL with one node). With engine.backend cuda the coordinator calls
 * make_comm_id once and every node receives the id in comm_id (EPD_CLUSTER_COMM_ID_BYTES); NULL
 * make_comm_id refuses backend cuda (built without CUDA). 0, or -1 with a message in err (a missing
 * node, keys that differ, a duplicate node rank, a bad address). */
int epd_cluster_init(const epd_conf_t *conf, epd_cluster_comm_id_fn make_comm_id, epd_net_t **net,
                     uint8_t *comm_id, char *err, size_t errlen);
/* 1 if this daemon joined a running world at epd_cluster_init (it restarted). */
int epd_cluster_rejoined(void);
/* Close the data links (after the engine is destroyed). */
void epd_cluster_fini(epd_net_t *net);
/* The keys that must agree across nodes as "key = value" lines, and their FNV-1a hash. */
size_t epd_cluster_agreed_config(const epd_conf_t *conf, char *buf, size_t len);
/* 1 when the rendezvous runs over mutual TLS (cluster.tls_ca, tls_cert and tls_key set, nodes > 1). */
int epd_cluster_tls(const epd_conf_t *conf);
/* The layout of the frames on the data links, one of the agreed keys: 2 since the map frames' arrays are
 * 8-byte aligned; a node of another layout is refused at the rendezvous. */
#define EPD_CLUSTER_LINK_FORMAT 2u
/* --check-config: with nodes > 1, cluster.tls_* all set or none, and the PEM files readable (0), else -1. */
int epd_cluster_check_tls(const epd_conf_t *conf, char *err, size_t errlen);
uint64_t epd_cluster_hash(const char *text);

#endif /* EPD_CLUSTER_H */
