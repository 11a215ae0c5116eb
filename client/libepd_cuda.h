/*
 * libepd_cuda.h - internal: the CUDA side of libepd (import of the daemon's cuMem fds, stream-ordered
 * submission with stream memory operations). Loaded lazily (dlopen of libcuda.so.1) so that libepd
 * works with the host backend on machines without CUDA.
 */
#ifndef EPD_LIBEPD_CUDA_H
#define EPD_LIBEPD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

typedef struct epd_cuda_map epd_cuda_map_t;

/* Import a POSIX-fd cuMem allocation of `bytes` on `device` and map it read/write in this process;
 * *addr gets the device address. */
epd_result_t epd_cuda_import(int fd, size_t bytes, int device, epd_cuda_map_t **out, void **addr,
                             char *err, size_t errlen);
/* Unmap and release an import. */
void epd_cuda_unimport(epd_cuda_map_t *m);
/* Enqueue on `stream` (a CUstream): write desc into the device slot, set state SUBMITTED, wait for
 * state DONE, set FREE (stream memory operations; capturable in a CUDA graph). slot_dev is the device
 * address of the epd_slot_t. */
epd_result_t epd_cuda_submit(void *stream, uint64_t slot_dev, const epd_desc_t *desc, char *err,
                             size_t errlen);
/* Copy `bytes` from device address src to host dst (synchronous; for reading completion records). */
epd_result_t epd_cuda_read(void *dst, uint64_t src, size_t bytes, char *err, size_t errlen);

#endif
