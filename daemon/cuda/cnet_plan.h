/*
 * cnet_plan.h - the CUDA inter-node stage's step programs, built on the host from the world plan.
 *
 * Every node holds the routing of the whole world for a step (epd_ref_plan_t over world ranks: the
 * top-k ids and weights of every rank travel with the step's control frame), so each node derives the
 * same exchange sizes without a count exchange, and the GPU work is a few table-driven kernels
 * (kernels/epd_kernels_net.h) around one grouped ncclSend/ncclRecv per step. For local rank l of node
 * `me` (world rank me*L + l), whose rail peer on node n is world rank n*L + l:
 *
 * dispatch  pre:  rows - each own token that has an entry on node n, once, into xsend[n] (token order;
 *                 FP8 dispatch: quantised here, FP8 bytes + scales, about half the bytes of BF16);
 *           exchange: xsend[n] -> rail peer on n; xrecv[n] <- the rail peer's tokens that have an entry
 *                 on this node, once;
 *           post: rows - every (src, t, k) routed to this rank, from the own arena, a sibling's arena
 *                 or a sibling's xrecv (peer access), into LL_RECV_X (BF16, or FP8 + scales) / HT_RECV_X;
 *                 puts - receive counts, sources, HT top-k ids and weights.
 * combine   pre:  wsum - per token received from rail peer n: its float32 partial over this node's
 *                 entries (LL: weighted expert outputs, k order; HT: rows of this node's ranks, rank
 *                 order) into psend[n];
 *           exchange: psend[n] -> rail peer on n; precv[n] <- the partials of own tokens sent to n;
 *           post: wsum - OUT[t] = bf16(sum over nodes in node order: this node's entries of the token,
 *                 or the partial node n returned), float32.
 * Addresses are plain 64-bit numbers: device addresses on the GPU, host pointers in the CPU tests
 * (cnet_exec_* emulate the kernels).
 */
#ifndef EPD_CNET_PLAN_H
#define EPD_CNET_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "epd_kernels_net.h"
#include "core/ref.h"

#define CNET_MAX_NODES EPD_MAX_RANKS

/* The addresses one local rank's step uses. */
typedef struct cnet_addr {
  uint64_t buf[EPD_BUF_KINDS];    /* the op's bank buffers of the rank's client arena */
  uint64_t xsend[CNET_MAX_NODES]; /* per node: max_tokens BF16 rows out */
  uint64_t xrecv[CNET_MAX_NODES]; /* per node: max_tokens BF16 rows in */
  uint64_t psend[CNET_MAX_NODES]; /* per node: max_tokens float32 rows out */
  uint64_t precv[CNET_MAX_NODES]; /* per node: max_tokens float32 rows in */
} cnet_addr_t;

/* A growable array. */
typedef struct cnet_vec {
  uint8_t *p;
  size_t len, cap; /* bytes */
} cnet_vec_t;

/* One local rank's program for a step. */
typedef struct cnet_side {
  cnet_vec_t pre_rows, post_rows, puts;   /* epd_k_net_row_t, epd_k_net_row_t, epd_k_net_put_t */
  cnet_vec_t pre_off, pre_terms, pre_out; /* wsum tables (uint32_t n+1, epd_k_net_term_t, uint64_t n) */
  cnet_vec_t post_off, post_terms, post_out;
  uint32_t send_rows[CNET_MAX_NODES], recv_rows[CNET_MAX_NODES]; /* exchange with the rail peer of node n */
  uint32_t num_recv;                                             /* comp.num_recv of the op */
} cnet_side_t;

typedef struct cnet_prog {
  uint32_t nodes, node, L, H;
  int combine, fp8;
  size_t row_bytes; /* bytes of one exchanged row: H*2 (dispatch), cnet_fp8_row_bytes (FP8), H*4 (combine) */
  cnet_side_t side[EPD_MAX_RANKS];
  int32_t *sidx, *ridx; /* [L][nodes][M]: index of (own / rail peer's) token t in the exchange, -1 */
  size_t idx_cap;
} cnet_prog_t;

/* Build the program of a dispatch (mode EPD_MODE_LL/HT) of node `node` from the world plan p (built
 * by epd_ref_plan_build over nodes * L world ranks). HT capacity must have been checked (the caller
 * fails the step everywhere on overflow). EPD_ERR_NOMEM or EPD_ERR_INVALID (geometry). */
epd_result_t cnet_build_dispatch(cnet_prog_t *pg, const epd_ref_plan_t *p, uint32_t nodes, uint32_t node,
                                 uint32_t L, int mode, int fp8, const cnet_addr_t *addr);
/* The same for the combine that follows a dispatch with plan p. */
epd_result_t cnet_build_combine(cnet_prog_t *pg, const epd_ref_plan_t *p, uint32_t nodes, uint32_t node,
                                uint32_t L, int mode, const cnet_addr_t *addr);
void cnet_prog_free(cnet_prog_t *pg);
/* An FP8 dispatch row on the wire: H e4m3 bytes then H/128 float scales, 16-byte aligned. */
static inline size_t cnet_fp8_row_bytes(uint32_t hidden) {
  return ((size_t)hidden + epd_ref_scale_blocks(hidden) * 4 + 15) / 16 * 16;
}
/* Entries of a table. */
static inline uint32_t cnet_count(const cnet_vec_t *v, size_t esz) {
  return (uint32_t)(v->len / esz);
}

/* Host emulation of the kernels over host pointers (CPU tests). */
void cnet_exec_rows(const cnet_vec_t *rows, uint32_t hidden, int fp8);
void cnet_exec_wsum(const cnet_vec_t *off, const cnet_vec_t *terms, const cnet_vec_t *out, uint32_t hidden,
                    int out_f32);
void cnet_exec_puts(const cnet_vec_t *puts);

#endif /* EPD_CNET_PLAN_H */
