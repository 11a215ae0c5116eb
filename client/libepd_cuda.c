/*
 * libepd_cuda.c - CUDA side of libepd. This first version reports EPD_ERR_UNSUPPORTED for every call
 * (the host backend needs none of it); the CUDA data path replaces these bodies.
 */
#include <stdio.h>

#include "libepd_cuda.h"

epd_result_t epd_cuda_import(int fd, size_t bytes, int device, epd_cuda_map_t **out, void **addr,
                             char *err, size_t errlen) {
  snprintf(err, errlen, "CUDA memory import is not available in this build of libepd");
  return EPD_ERR_UNSUPPORTED;
}

void epd_cuda_unimport(epd_cuda_map_t *m) { (void)m; }

epd_result_t epd_cuda_submit(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                             size_t errlen) {
  snprintf(err, errlen, "stream-ordered submission is not available in this build of libepd");
  return EPD_ERR_UNSUPPORTED;
}

epd_result_t epd_cuda_read(void *dst, uint64_t src, size_t bytes, char *err, size_t errlen) {
  snprintf(err, errlen, "CUDA reads are not available in this build of libepd");
  return EPD_ERR_UNSUPPORTED;
}
