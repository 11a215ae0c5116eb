/*
 * fuzz_refuse.c - libFuzzer target: the accept thread's answer to refused control connections
 * (daemon/refuse.c), which reads bytes from a peer that access control refused: a hostile client by
 * definition. The input, after its first byte, is what the peer sends, written in chunks of 1 + first
 * byte % 64 bytes with a service pass after each (frames split across reads); the peer then hangs up.
 * Everything the daemon sends back is read and dropped. ASan finds what goes wrong.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control/refuse.h"

static void serve(epd_refuse_set_t *s) {
  struct pollfd pf[EPD_REFUSE_MAX];
  int n = epd_refuse_pollfds(s, pf);
  if (n && poll(pf, (nfds_t)n, 0) >= 0) epd_refuse_service(s, pf, n);
}

static void drain(int fd) {
  char buf[4096];
  while (recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 65536) return 0;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) abort();
  epd_refuse_set_t s;
  epd_refuse_init(&s);
  if (epd_refuse_add(&s, sv[0], 7, -16, "uid 1000 gid 1000 is not allowed on this daemon") != 0) abort();
  const size_t chunk = 1 + data[0] % 64;
  for (size_t off = 1; off < size; off += chunk) {
    const size_t n = size - off < chunk ? size - off : chunk;
    if (send(sv[1], data + off, n, MSG_NOSIGNAL) < 0) break; /* the daemon side closed: done */
    serve(&s);
    drain(sv[1]);
  }
  shutdown(sv[1], SHUT_WR);
  serve(&s);
  drain(sv[1]);
  close(sv[1]);
  serve(&s); /* sees the hang-up */
  epd_refuse_close_all(&s);
  return 0;
}
