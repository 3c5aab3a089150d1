/* The two parts of bench_cuda: bench_cuda.c (the device's spec sheet, the
 * GEMMs and memory-bound kernels, the clock, main) prints the JSON object
 * and calls bench_cuda_decode.c's decode_report for its "decode" member. */
#ifndef NL_BENCH_CUDA_H
#define NL_BENCH_CUDA_H

#include "base/status.h"
#include "core/model/config.h"
#include "kernels/backend.h"

/* Monotonic seconds. */
double now_s(void);

/* The decode split as the JSON object "decode" (after a comma): `tokens`
 * tokens after a 64-token prompt on a random model of config cf on be
 * (named device, made with the options o), the memory bound of its
 * tokens ("decode_bound"), then, where batch is nonzero, batched decode
 * ("batch_decode"). Returns 0, or -1 with err set. */
int decode_report(nl_backend *be, const char *device, const nl_backend_opts *o, const nl_config *cf,
                  long long tokens, int batch, nl_error *err);

#endif
