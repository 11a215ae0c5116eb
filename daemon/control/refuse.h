/*
 * refuse.h - answer a control connection that access control refused at accept with one gRPC error
 * status the client can read (PERMISSION_DENIED naming its uid), instead of a hang-up that every gRPC
 * client reports as UNAVAILABLE, as if no daemon were there. The answer is spoken in minimal HTTP/2 by the
 * accept thread itself (server preface, a trailers-only response to the first request, GOAWAY), so a
 * refused peer never reaches gRPC; a client that does not speak HTTP/2 gets the reason as one text line.
 * At most EPD_REFUSE_MAX refused connections are answered at once, each for EPD_REFUSE_TIMEOUT_MS; more
 * are closed at once. One thread only (the set is not locked).
 */
#ifndef EPD_REFUSE_H
#define EPD_REFUSE_H

#include <poll.h>
#include <stdint.h>

#define EPD_REFUSE_MAX 16
#define EPD_REFUSE_TIMEOUT_MS 2000
#define EPD_REFUSE_MSG_MAX 200

typedef struct epd_refuse_conn {
  int fd;    /* -1: free */
  int state; /* reading the client preface, its frames, or draining after the answer */
  uint64_t deadline_ms;
  uint8_t hdr[24]; /* the preface, then one frame header, as it arrives */
  uint32_t have;   /* bytes in hdr */
  uint32_t skip;   /* payload bytes of the current frame still to skip */
  int grpc_code;   /* grpc_status_code of the answer */
  int epd_code;    /* epd_result_t, sent as the "epd-code" trailer that libepd reads */
  char msg[EPD_REFUSE_MSG_MAX];
} epd_refuse_conn_t;

typedef struct epd_refuse_set {
  epd_refuse_conn_t c[EPD_REFUSE_MAX];
} epd_refuse_set_t;

/* Empty a set (every slot free). */
void epd_refuse_init(epd_refuse_set_t *s);
/* Take ownership of the connected, non-blocking fd and answer its first request with grpc_code and msg
 * (epd_code travels as "epd-code"); returns 0, or -1 when the set is full (fd closed then). */
int epd_refuse_add(epd_refuse_set_t *s, int fd, int grpc_code, int epd_code, const char *msg);
/* Fill pf (room for EPD_REFUSE_MAX) with the set's fds; returns how many. */
int epd_refuse_pollfds(const epd_refuse_set_t *s, struct pollfd *pf);
/* Milliseconds until the nearest deadline (-1: no connection). */
int epd_refuse_timeout_ms(const epd_refuse_set_t *s);
/* Serve the n entries of pf that epd_refuse_pollfds filled (after poll), then close expired connections. */
void epd_refuse_service(epd_refuse_set_t *s, const struct pollfd *pf, int n);
/* Close every connection of the set. */
void epd_refuse_close_all(epd_refuse_set_t *s);

#endif
