/*
 * rpc_client.h - internal: a blocking unary/streaming client of the epd control RPC over gRPC C core,
 * shared by libepd and epdctl. Messages are protobuf-c.
 */
#ifndef EPD_RPC_CLIENT_H
#define EPD_RPC_CLIENT_H

#include <stddef.h>
#include <protobuf-c/protobuf-c.h>

#include "epd.h"

typedef struct epd_rpc epd_rpc_t;

/* Default control socket path: $EPD_SOCKET, else /run/epd/control.sock when root, else
 * $XDG_RUNTIME_DIR/epd/control.sock, else /tmp/epd-<uid>/control.sock. */
const char *epd_default_socket_path(char *buf, size_t len);
/* Open a channel to the Unix socket path (no "unix:" prefix needed). */
epd_result_t epd_rpc_open(const char *socket_path, int timeout_ms, epd_rpc_t **out, char *err, size_t errlen);
/* Open a channel to a gRPC target of another kind (e.g. "ipv4:10.0.0.1:7070" or "host:port" over TCP),
 * with a private subchannel pool so that a peer starting later is found quickly. */
epd_result_t epd_rpc_open_target(const char *target, int timeout_ms, epd_rpc_t **out, char *err,
                                 size_t errlen);
/* TLS of a channel to a target (PEM text, NUL-terminated): the server is verified against ca; cert and key
 * (both or neither) are this side's certificate for a server that requires one (mutual TLS); server_name,
 * when not NULL or empty, is the name the server's certificate must carry instead of the target's host. */
typedef struct epd_rpc_tls {
  const char *ca, *cert, *key, *server_name;
} epd_rpc_tls_t;
/* epd_rpc_open_target over TLS (tls NULL: plaintext, as epd_rpc_open_target). */
epd_result_t epd_rpc_open_target_tls(const char *target, int timeout_ms, const epd_rpc_tls_t *tls,
                                     epd_rpc_t **out, char *err, size_t errlen);
void epd_rpc_close(epd_rpc_t *rpc);
/* Unary call of method (e.g. "/epd.v1.Control/Attach"). On success *reply is a message of reply_desc
 * (free with protobuf_c_message_free_unpacked). gRPC errors map to epd codes; err gets the details. */
epd_result_t epd_rpc_call(epd_rpc_t *rpc, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply, char *err,
                          size_t errlen);
/* Send raw request bytes (for tests of malformed input); same reply rules. */
epd_result_t epd_rpc_call_raw(epd_rpc_t *rpc, const char *method, const void *req, size_t len,
                              const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                              char *err, size_t errlen);
/* Server-streaming call: on_msg is called for each reply message until it returns non-zero, the
 * stream ends, or timeout_ms passes (0: no timeout). */
typedef int (*epd_rpc_stream_fn)(void *arg, ProtobufCMessage *msg);
epd_result_t epd_rpc_stream(epd_rpc_t *rpc, const char *method, const ProtobufCMessage *req,
                            const ProtobufCMessageDescriptor *reply_desc, epd_rpc_stream_fn on_msg, void *arg,
                            int timeout_ms, char *err, size_t errlen);

#endif
