/*
 * epd_kconfig.h - every compile-time limit of the epd kernels, in one place (plain C, host and device).
 */
#ifndef EPD_KCONFIG_H
#define EPD_KCONFIG_H

#define EPD_K_MAX_RANKS 8      /* ranks of one LSA team (node) the LL kernels serve */
#define EPD_K_MAX_TOPK 16      /* top-k columns per token */
#define EPD_K_MAX_REPLICAS 8   /* replicas of one logical expert in the device expert map */
#define EPD_K_MAX_TOKENS 4096  /* max tokens per rank (EPD_SRC_PACK keeps 24 bits) */
#define EPD_K_MAX_HIDDEN 16384 /* hidden size; a multiple of 128 */
#define EPD_K_LL_THREADS 512   /* threads per block of the LL kernels */
#define EPD_K_LL_BLOCKS 128    /* default blocks per LL kernel (every rank of a team must use the same) */
#define EPD_K_LL_MAX_BLOCKS 256
#define EPD_K_FP8_BLOCK 128  /* channels per FP8 scale */
#define EPD_K_FP8_MAX 448.0f /* largest finite e4m3 value */
#define EPD_K_FP8_AMAX_MIN 1e-4f
#define EPD_K_HT_THREADS 512 /* threads per block of the HT data kernels */
#define EPD_K_HT_BLOCKS 24   /* default blocks (SMs) per HT data kernel (same on every rank) */
#define EPD_K_HT_MAX_BLOCKS 132
#define EPD_K_HT_MAX_TOKENS 16384               /* HT max tokens per rank */
#define EPD_K_DEFAULT_TIMEOUT_NS 10000000000ull /* 10 s */

#endif
