/*
 * epd_wire.h - the attach socket protocol (a plain Unix stream socket beside the control socket).
 * The client sends one epd_redeem_req_t with the one-time token from the Attach RPC; the daemon answers
 * one epd_redeem_rep_t carrying, on success, two file descriptors in an SCM_RIGHTS message:
 * [0] the queue, [1] the arena. The connection then stays open for the attachment's lifetime: the
 * daemon treats its hang-up as the client's death (detach with lost=1).
 */
#ifndef EPD_WIRE_H
#define EPD_WIRE_H

#include <stdint.h>
#include <stdio.h>

#define EPD_WIRE_MAGIC 0x45504457u /* "EPDW" */
#define EPD_WIRE_VERSION 1u
#define EPD_TOKEN_BYTES 32

typedef struct epd_redeem_req {
  uint32_t magic, version;
  uint64_t client_id;
  uint8_t token[EPD_TOKEN_BYTES];
} epd_redeem_req_t;

typedef struct epd_redeem_rep {
  uint32_t magic, version;
  int32_t status; /* epd_result_t */
  uint32_t nfds;  /* 2 on success */
  char message[240];
} epd_redeem_rep_t;

_Static_assert(sizeof(epd_redeem_req_t) == 48, "redeem request layout");
_Static_assert(sizeof(epd_redeem_rep_t) == 256, "redeem reply layout");

/* A GPU's UUID (the AttachReply's device_uuid, 16 bytes) as nvidia-smi -L prints it:
 * "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (EPD_UUID_TEXT bytes with the NUL). */
#define EPD_UUID_TEXT 41
static inline void epd_uuid_text(const uint8_t u[16], char out[EPD_UUID_TEXT]) {
  snprintf(out, EPD_UUID_TEXT, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
           u[15]);
}

#endif
