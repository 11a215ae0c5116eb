/*
 * refuse.c - the gRPC answer to a refused control connection (see refuse.h). Just enough HTTP/2
 * (RFC 9113) and HPACK (RFC 7541) to answer one request: the frames of the client are read only for
 * their headers (the HEADERS payload is never decoded), and the answer is a "trailers-only" response,
 * :status 200 with grpc-status and grpc-message, as any gRPC server sends an error, then GOAWAY.
 */
#define _GNU_SOURCE
#include "control/refuse.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { RS_PREFACE, RS_FRAMES, RS_DRAIN };

#define H2_HEADERS 0x1
#define H2_SETTINGS 0x4
#define H2_GOAWAY 0x7
#define H2_FLAG_ACK 0x1
#define H2_FLAG_END_STREAM 0x1
#define H2_FLAG_END_HEADERS 0x4
#define H2_FRAME_HDR 9
#define H2_PREFACE "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#define H2_PREFACE_LEN 24
/* Reads per connection and wake-up, so that a peer that keeps sending cannot hold the accept thread. */
#define MAX_READS 16

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void drop(epd_refuse_conn_t *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

/* The answer is a few hundred bytes into a fresh socket buffer: a short write means the peer is gone. */
static int send_all(epd_refuse_conn_t *c, const void *buf, size_t len) {
  ssize_t w = send(c->fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w == (ssize_t)len) return 0;
  drop(c);
  return -1;
}

static size_t frame_hdr(uint8_t *p, uint32_t len, uint8_t type, uint8_t flags, uint32_t sid) {
  p[0] = (uint8_t)(len >> 16);
  p[1] = (uint8_t)(len >> 8);
  p[2] = (uint8_t)len;
  p[3] = type;
  p[4] = flags;
  p[5] = (uint8_t)((sid >> 24) & 0x7f);
  p[6] = (uint8_t)(sid >> 16);
  p[7] = (uint8_t)(sid >> 8);
  p[8] = (uint8_t)sid;
  return H2_FRAME_HDR;
}

/* An HPACK integer with an nbits prefix after the pattern bits in first (RFC 7541 5.1). */
static size_t hpack_int(uint8_t *p, uint8_t first, int nbits, size_t v) {
  size_t max = ((size_t)1 << nbits) - 1, n = 0;
  if (v < max) {
    p[n++] = (uint8_t)(first | v);
    return n;
  }
  p[n++] = (uint8_t)(first | max);
  for (v -= max; v >= 128; v >>= 7) p[n++] = (uint8_t)((v & 127) | 128);
  p[n++] = (uint8_t)v;
  return n;
}

/* A string literal, not Huffman-coded (RFC 7541 5.2). */
static size_t hpack_str(uint8_t *p, const char *s) {
  size_t len = strlen(s), n = hpack_int(p, 0, 7, len);
  memcpy(p + n, s, len);
  return n + len;
}

/* A literal header field without indexing, with a new name (RFC 7541 6.2.2). */
static size_t hpack_field(uint8_t *p, const char *name, const char *value) {
  size_t n = 0;
  p[n++] = 0;
  n += hpack_str(p + n, name);
  n += hpack_str(p + n, value);
  return n;
}

/* grpc-message is percent-encoded: '%' and every byte outside 0x20..0x7e (gRPC over HTTP/2). */
static void pct_encode(const char *in, char *out, size_t len) {
  static const char hex[] = "0123456789ABCDEF";
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)in; *p && o + 4 <= len; p++) {
    if (*p >= 0x20 && *p <= 0x7e && *p != '%') {
      out[o++] = (char)*p;
    } else {
      out[o++] = '%';
      out[o++] = hex[*p >> 4];
      out[o++] = hex[*p & 15];
    }
  }
  out[o] = '\0';
}

/* The trailers-only response on stream sid, then GOAWAY naming sid as the last stream processed. */
static void answer(epd_refuse_conn_t *c, uint32_t sid) {
  uint8_t out[H2_FRAME_HDR * 2 + 64 + 3 * EPD_REFUSE_MSG_MAX + 8];
  char msg[3 * EPD_REFUSE_MSG_MAX + 1], code[16], ecode[16];
  pct_encode(c->msg, msg, sizeof msg);
  snprintf(code, sizeof code, "%d", c->grpc_code);
  snprintf(ecode, sizeof ecode, "%d", c->epd_code);
  size_t n = H2_FRAME_HDR;
  out[n++] = 0x88;                             /* :status 200, static table entry 8 */
  n += hpack_int(out + n, 0x00, 4, 31);        /* content-type, static table entry 31, */
  n += hpack_str(out + n, "application/grpc"); /* literal value without indexing */
  n += hpack_field(out + n, "grpc-status", code);
  n += hpack_field(out + n, "grpc-message", msg);
  n += hpack_field(out + n, "epd-code", ecode);
  frame_hdr(out, (uint32_t)(n - H2_FRAME_HDR), H2_HEADERS, H2_FLAG_END_STREAM | H2_FLAG_END_HEADERS, sid);
  n += frame_hdr(out + n, 8, H2_GOAWAY, 0, 0);
  out[n++] = (uint8_t)((sid >> 24) & 0x7f);
  out[n++] = (uint8_t)(sid >> 16);
  out[n++] = (uint8_t)(sid >> 8);
  out[n++] = (uint8_t)sid;
  memset(out + n, 0, 4); /* NO_ERROR */
  n += 4;
  if (send_all(c, out, n) != 0) return;
  /* Read on until the client hangs up (it does once its call is done), so that closing with its unread
   * bytes queued cannot turn into a reset it sees before the answer. */
  shutdown(c->fd, SHUT_WR);
  c->state = RS_DRAIN;
}

/* A peer that does not speak HTTP/2 (a probe, a person with socat) gets the reason as text. */
static void answer_text(epd_refuse_conn_t *c) {
  char line[EPD_REFUSE_MSG_MAX + 8];
  int n = snprintf(line, sizeof line, "epd: %s\n", c->msg);
  if (n > 0)
    send(c->fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  drop(c);
}

/* Walk the client's bytes: its preface, then frame headers (payloads skipped) up to the first HEADERS. */
static void feed(epd_refuse_conn_t *c, const uint8_t *p, size_t n) {
  while (n && c->fd >= 0 && c->state != RS_DRAIN) {
    if (c->state == RS_PREFACE) {
      size_t take = H2_PREFACE_LEN - c->have < n ? H2_PREFACE_LEN - c->have : n;
      memcpy(c->hdr + c->have, p, take);
      c->have += (uint32_t)take;
      p += take;
      n -= take;
      if (memcmp(c->hdr, H2_PREFACE, c->have) != 0) {
        answer_text(c);
        return;
      }
      if (c->have < H2_PREFACE_LEN) continue;
      uint8_t settings[H2_FRAME_HDR]; /* the server preface: an empty SETTINGS frame (defaults) */
      frame_hdr(settings, 0, H2_SETTINGS, 0, 0);
      if (send_all(c, settings, sizeof settings) != 0) return;
      c->have = 0;
      c->state = RS_FRAMES;
      continue;
    }
    if (c->skip) {
      size_t take = c->skip < n ? c->skip : n;
      c->skip -= (uint32_t)take;
      p += take;
      n -= take;
      continue;
    }
    size_t take = H2_FRAME_HDR - c->have < n ? H2_FRAME_HDR - c->have : n;
    memcpy(c->hdr + c->have, p, take);
    c->have += (uint32_t)take;
    p += take;
    n -= take;
    if (c->have < H2_FRAME_HDR) continue;
    c->have = 0;
    uint32_t len = (uint32_t)c->hdr[0] << 16 | (uint32_t)c->hdr[1] << 8 | c->hdr[2];
    uint8_t type = c->hdr[3], flags = c->hdr[4];
    uint32_t sid =
        ((uint32_t)c->hdr[5] << 24 | (uint32_t)c->hdr[6] << 16 | (uint32_t)c->hdr[7] << 8 | c->hdr[8]) &
        0x7fffffffu;
    if (type == H2_SETTINGS && !(flags & H2_FLAG_ACK)) {
      uint8_t ack[H2_FRAME_HDR];
      frame_hdr(ack, 0, H2_SETTINGS, H2_FLAG_ACK, 0);
      if (send_all(c, ack, sizeof ack) != 0) return;
    }
    if (type == H2_HEADERS && sid) {
      answer(c, sid);
      return;
    }
    c->skip = len;
  }
}

void epd_refuse_init(epd_refuse_set_t *s) {
  memset(s, 0, sizeof *s);
  for (int i = 0; i < EPD_REFUSE_MAX; i++) s->c[i].fd = -1;
}

int epd_refuse_add(epd_refuse_set_t *s, int fd, int grpc_code, int epd_code, const char *msg) {
  for (int i = 0; i < EPD_REFUSE_MAX; i++) {
    epd_refuse_conn_t *c = &s->c[i];
    if (c->fd >= 0) continue;
    memset(c, 0, sizeof *c);
    c->fd = fd;
    c->state = RS_PREFACE;
    c->deadline_ms = now_ms() + EPD_REFUSE_TIMEOUT_MS;
    c->grpc_code = grpc_code;
    c->epd_code = epd_code;
    snprintf(c->msg, sizeof c->msg, "%s", msg);
    return 0;
  }
  close(fd); /* a flood of refused peers gets the bare hang-up, and costs no more fds */
  return -1;
}

int epd_refuse_pollfds(const epd_refuse_set_t *s, struct pollfd *pf) {
  int n = 0;
  for (int i = 0; i < EPD_REFUSE_MAX; i++)
    if (s->c[i].fd >= 0) pf[n++] = (struct pollfd){.fd = s->c[i].fd, .events = POLLIN};
  return n;
}

int epd_refuse_timeout_ms(const epd_refuse_set_t *s) {
  uint64_t now = now_ms();
  int t = -1;
  for (int i = 0; i < EPD_REFUSE_MAX; i++) {
    if (s->c[i].fd < 0) continue;
    int left = s->c[i].deadline_ms > now ? (int)(s->c[i].deadline_ms - now) : 0;
    if (t < 0 || left < t) t = left;
  }
  return t;
}

void epd_refuse_service(epd_refuse_set_t *s, const struct pollfd *pf, int n) {
  for (int k = 0; k < n; k++) {
    if (!pf[k].revents) continue;
    epd_refuse_conn_t *c = NULL;
    for (int i = 0; i < EPD_REFUSE_MAX && !c; i++)
      if (s->c[i].fd == pf[k].fd) c = &s->c[i];
    for (int r = 0; c && c->fd >= 0 && r < MAX_READS; r++) {
      uint8_t buf[4096];
      ssize_t got = recv(c->fd, buf, sizeof buf, MSG_DONTWAIT);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (got <= 0) {
        drop(c);
        break;
      }
      if (c->state != RS_DRAIN) feed(c, buf, (size_t)got);
    }
  }
  uint64_t now = now_ms();
  for (int i = 0; i < EPD_REFUSE_MAX; i++) {
    epd_refuse_conn_t *c = &s->c[i];
    if (c->fd < 0 || now < c->deadline_ms) continue;
    if (c->state == RS_PREFACE)
      answer_text(c); /* silent for the whole time: not a gRPC client, which sends its preface at once */
    else
      drop(c);
  }
}

void epd_refuse_close_all(epd_refuse_set_t *s) {
  for (int i = 0; i < EPD_REFUSE_MAX; i++) drop(&s->c[i]);
}
