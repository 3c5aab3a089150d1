/* The memory model's precision terms (core/model/memory.h):
 *
 *  - FP32 is what it was: precision 0 adds nothing;
 *  - bf16 on a device (CUDA) adds exactly the weights' bf16 copies, 2
 *    bytes per parameter, and nothing else: its conversion scratch and
 *    cuBLASLt workspace are the backend's runtime_bytes, outside the offer;
 *  - bf16 on the CPU adds the copies and the two operand buffers, 2 bytes
 *    per element of the widest activation operands, recomputed here from
 *    the config;
 *  - nl_mem_precision maps a backend to its term;
 *  - measured: on a bf16 backend (the CPU where it has AVX512-BF16, or the
 *    device NL_TEST_DEVICE names), a model and its trainer allocate what
 *    the model predicts within 5% (the copies included), and after two
 *    training steps the peak (the CPU's grown operand buffers included)
 *    stays within the prediction plus 5%. Skipped where no bf16 backend
 *    can be made. */
#include "core/model/memory.h"
#include "core/train/train.h"
#include "tests/check.h"

#include <math.h>

static nl_config small_config(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 48;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 40;
    c.num_experts = 4;
    c.vocab_size = 40;
    c.vocab_chunk = 32;
    c.max_seq_len = 64;
    nl_config_fill_derived(&c);
    return c;
}

static void test_terms(void)
{
    nl_config c = small_config();
    const int rows = 3 * 17;
    for (int training = 0; training < 2; training++)
        for (int head = 0; head < 2; head++) {
            nl_mem_opts o = {.training = training, .micro_rows = rows, .in_flight = 2};
            const nl_mem_estimate f = nl_memory_estimate(&c, c.num_layers, 1, head, &o);
            o.precision = NL_MEM_BF16_DEVICE;
            const nl_mem_estimate dv = nl_memory_estimate(&c, c.num_layers, 1, head, &o);
            o.precision = NL_MEM_BF16;
            const nl_mem_estimate h = nl_memory_estimate(&c, c.num_layers, 1, head, &o);
            const uint64_t P = (uint64_t)nl_stage_param_count(&c, c.num_layers, 1, head);
            CHECK(f.bf16_copies == 0 && f.total == f.weights + f.grads + f.moments + f.activations +
                                                       f.kv_cache + f.workspace + f.runtime,
                  "fp32 (training %d head %d): no bf16 term", training, head);
            CHECK(dv.bf16_copies == 2 * P && dv.total == f.total + 2 * P &&
                      dv.workspace == f.workspace && dv.runtime == f.runtime,
                  "bf16 device (training %d head %d): +2P only (%llu vs %llu + %llu)", training,
                  head, (unsigned long long)dv.total, (unsigned long long)f.total,
                  (unsigned long long)(2 * P));
            /* widths: d 48, q 48, qkv 96, F 40, 2F 80, V 40 */
            const uint64_t wa = training ? 96 : 48, wb = training ? 48 : 0;
            const uint64_t scratch = 2ull * rows * (wa + wb);
            CHECK(h.bf16_copies == 2 * P && h.workspace == f.workspace + scratch &&
                      h.total == f.total + 2 * P + scratch,
                  "bf16 host (training %d head %d): +2P + %llu", training, head,
                  (unsigned long long)scratch);
        }
    /* a head wider than every projection: its logits' gradient is the widest A */
    c.vocab_size = 1000;
    nl_config_fill_derived(&c);
    nl_mem_opts o = {.training = 1, .micro_rows = 10, .in_flight = 1};
    const nl_mem_estimate f = nl_memory_estimate(&c, c.num_layers, 1, 1, &o);
    o.precision = NL_MEM_BF16;
    const nl_mem_estimate h = nl_memory_estimate(&c, c.num_layers, 1, 1, &o);
    CHECK(h.workspace - f.workspace == 2ull * 10 * (1000 + 48), "head scratch: %llu",
          (unsigned long long)(h.workspace - f.workspace));

    nl_backend fake = {0};
    CHECK(nl_mem_precision(NULL) == NL_MEM_FP32 && nl_mem_precision(&fake) == NL_MEM_FP32,
          "fp32 backends");
    fake.bf16 = 1;
    fake.host_memory = 1;
    CHECK(nl_mem_precision(&fake) == NL_MEM_BF16, "bf16 on host memory");
    fake.host_memory = 0;
    CHECK(nl_mem_precision(&fake) == NL_MEM_BF16_DEVICE, "bf16 on a device");
}

/* A training stage's microbatches in flight: 1F1B's, the extra on every
 * stage but the last, the step's cap. */
static void test_train_slots(void)
{
    static const int cases[][4] = {
        /* after, M, extra, slots */
        {0, 8, 0, 1}, {0, 8, 5, 1}, {1, 8, 0, 2}, {3, 8, 0, 4}, {1, 8, 2, 4},
        {3, 8, 2, 6}, {3, 5, 2, 5}, {1, 0, 6, 8}, {2, 1, 4, 1}, {1, 8, -3, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int *k = cases[i];
        const int got = nl_mem_train_slots(k[0], k[1], k[2]);
        CHECK(got == k[3], "after %d, M %d, extra %d: %d in flight, want %d", k[0], k[1], k[2], got,
              k[3]);
    }
}

static void test_measured(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_backend_opts bo;
    memset(&bo, 0, sizeof bo);
    bo.threads = 2;
    bo.bf16 = 1;
    if (nl_backend_new(&be, check_device(), &bo, &err) != NL_OK) {
        printf("test_memory: measured part skipped: %s\n", err.msg);
        return;
    }
    nl_config c = small_config();
    enum { B = 3, T = 17 };
    size_t before = 0, after = 0, peak = 0;
    be->mem_stats(be, &before, NULL);
    nl_model *m = NULL;
    nl_trainer *t = NULL;
    CHECK_OK(nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err), &err);
    CHECK_OK(nl_trainer_new(&t, m, B * T, 2, 0, &err), &err);
    be->mem_stats(be, &after, NULL);
    nl_mem_opts o = {
        .training = 1, .micro_rows = B * T, .in_flight = 2, .precision = nl_mem_precision(be)};
    const nl_mem_estimate e = nl_memory_estimate(&c, c.num_layers, 1, 1, &o);
    nl_mem_opts of = o;
    of.precision = NL_MEM_FP32;
    const nl_mem_estimate e32 = nl_memory_estimate(&c, c.num_layers, 1, 1, &of);
    /* before any GEMM: the FP32 terms and the copies (scratch grows later) */
    const double pred = (double)(e32.total - e32.runtime + e.bf16_copies);
    const double got = (double)(after - before);
    CHECK(fabs(pred - got) / got < 0.05, "bf16 model and trainer: predicted %.0f, allocated %.0f",
          pred, got);
    int32_t tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) {
        tok[i] = (i * 7 + 3) % c.vocab_size;
        tgt[i] = (i * 5 + 1) % c.vocab_size;
    }
    for (int s = 0; s < 2 && t; s++) {
        nl_step_result res;
        CHECK_OK(nl_trainer_step_local(t, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &res,
                                       &err),
                 &err);
    }
    be->mem_stats(be, NULL, &peak);
    const double full = (double)(e.total - e.runtime);
    CHECK((double)(peak - before) <= full * 1.05,
          "bf16 training peak %.0f bytes above the prediction %.0f", (double)(peak - before), full);
    printf("test_memory: %s bf16: predicted %.0f bytes (copies %llu), allocated %.0f, peak %.0f\n",
           be->name, full, (unsigned long long)e.bf16_copies, got, (double)(peak - before));
    nl_trainer_destroy(&t);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
}

int main(void)
{
    test_terms();
    test_train_slots();
    test_measured();
    return check_done("test_memory");
}
