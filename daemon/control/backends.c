/*
 * backends.c - the engine's backends, in the order engine.backend = auto tries them (the last one is
 * always usable). The daemon assembles its engine here: the core (core/engine.c) knows the backends only
 * through this table, and a build without CUDA simply lists fewer.
 */
#include <stddef.h>

#include "core/engine_internal.h"

extern const eng_backend_ops_t eng_host_ops; /* host/engine_host.c */
#if EPD_WITH_CUDA
extern const eng_backend_ops_t eng_cuda_ops; /* cuda/engine_cuda.c */
#endif

const eng_backend_ops_t *const eng_backends[] = {
#if EPD_WITH_CUDA
    &eng_cuda_ops,
#endif
    &eng_host_ops,
    NULL,
};
