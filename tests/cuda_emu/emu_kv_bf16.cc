/* int nl_emu_kv_bf16_checks(void); -- call from test_cuda_emu's main.
 *
 * The bf16 KV cache on the CUDA kernels under the emulator, against the
 * CPU backend: the cache write (kernels/cuda/cuda_ops.cu's kv_store_bf16,
 * at device positions and at host-known ones after `past`) and attention
 * over a cache of bf16 bits (kernels/cuda/cuda_attention.cu with
 * s.kv_bf16, the decode and the prefill kernels, each head-dim bucket).
 * One translation unit with its own CHECK counters (like emu_fused.cc):
 * returns how many of its checks failed.
 *
 * Tolerances: the write is exact (the bits of nl_elem_to_bf16, as the
 * CPU's); rows not written keep their NaN bits. Attention: 1e-5 of the
 * output's max-norm, as the FP32 cache's (the widened keys and values are
 * exact, so only the order of the FP32 sums differs), and the CPU's bf16
 * cache gives the bits of its FP32 cache holding the widened values. */
#include "tests/cuda_emu/cuda_runtime.h"

#include "tests/check.h"

extern "C" {
#include "kernels/backend.h"
#include "kernels/elem.h"
}
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_ops.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <vector>

namespace
{

uint64_t kb_rng = 0x7f4a7c159e3779b9ull;

float kb_frand(void) /* uniform in [-1, 1) */
{
    kb_rng = kb_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((kb_rng >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

constexpr uint16_t NAN16 = 0x7fc5; /* a quiet bf16 NaN: rows nobody wrote */

/* The cache write, device positions (out of order) and host-known ones. */
void check_store(nl_backend *cpu)
{
    /* B, T, cap, kv_dim, stride (k at column 3, v after the keys), past */
    const int shapes[][6] = {{1, 1, 4, 8, 20, 2}, {3, 1, 9, 33, 80, 8}, {2, 3, 7, 16, 40, 4}};
    for (auto &sh : shapes) {
        const int B = sh[0], T = sh[1], cap = sh[2], kvd = sh[3], stride = sh[4], past = sh[5];
        const int k_col = 3, v_col = 3 + kvd;
        std::vector<int32_t> pos((size_t)B * T);
        for (size_t i = 0; i < pos.size(); i++)
            pos[i] = (int32_t)((5 * i + 2) % (size_t)cap);
        std::vector<float> qkv((size_t)B * T * stride);
        for (float &x : qkv)
            x = 3.0f * kb_frand();
        const size_t n = (size_t)B * cap * kvd;
        for (int host = 0; host < 2; host++) {
            const int32_t *p = host ? nullptr : pos.data();
            const int at = host ? past : 0;
            std::vector<uint16_t> ka(n, NAN16), va(ka), kc(ka), vc(ka);
            char what[96];
            snprintf(what, sizeof what, "kv_store_bf16 B %d T %d cap %d kv_dim %d %s", B, T, cap,
                     kvd, host ? "after past" : "at pos");
            CHECK(nl_cuda_kv_store_bf16(nullptr, ka.data(), va.data(), qkv.data(), stride, k_col,
                                        v_col, p, at, B, T, cap, kvd) == 0,
                  "%s: launch", what);
            cpu->kv_store_bf16(cpu, kc.data(), vc.data(), qkv.data(), stride, k_col, v_col, p, at,
                               B, T, cap, kvd);
            CHECK(ka == kc && va == vc, "%s: other bits than the CPU's", what);
            /* the CPU's: row n's keys rounded at its position, the rest untouched */
            size_t written = 0, bad = 0;
            for (int r = 0; r < B * T; r++) {
                const int slot = host ? past + r % T : pos[(size_t)r];
                const size_t dst = ((size_t)(r / T) * cap + (size_t)slot) * kvd;
                for (int j = 0; j < kvd; j++) {
                    const float *src = &qkv[(size_t)r * stride];
                    bad += kc[dst + j] != nl_elem_to_bf16(src[k_col + j]);
                    bad += vc[dst + j] != nl_elem_to_bf16(src[v_col + j]);
                }
                written += (size_t)kvd;
            }
            size_t nan = 0;
            for (size_t i = 0; i < n; i++)
                nan += kc[i] == NAN16;
            CHECK(bad == 0 && nan + written == n, "%s: %zu values not rounded to nearest even, "
                  "%zu of %zu rows untouched", what, bad, nan, n - written);
        }
    }
    CHECK(nl_cuda_kv_store_bf16(nullptr, nullptr, nullptr, nullptr, 8, 0, 4, nullptr, 6, 1, 3, 8,
                                4) == (int)cudaErrorInvalidValue,
          "kv_store_bf16: rows past cap refused");
}

struct kv_case {
    int B, T, past, H, G, hd, kvpad;
};

/* Attention over a bf16 cache (NaN bits in the padding and past past + T):
 * the CUDA kernels against the CPU, and the CPU against its own FP32 path
 * on the widened values. */
void check_attention(nl_backend *cpu, const kv_case &c)
{
    nl_attn_shape s = {};
    s.B = c.B;
    s.T = c.T;
    s.past = c.past;
    s.kv_cap = c.past + c.T + 1;
    s.H = c.H;
    s.G = c.G;
    s.hd = c.hd;
    const int qs = c.H * c.hd, ks = c.G * c.hd + c.kvpad;
    const size_t nq = (size_t)c.B * c.T * qs, nk = (size_t)c.B * s.kv_cap * ks;
    const size_t no = (size_t)c.B * c.T * c.H * c.hd;
    std::vector<float> q(nq), kw(nk), vw(nk); /* kw, vw: the widened cache */
    std::vector<uint16_t> k16(nk), v16(nk);
    for (float &x : q)
        x = 2.0f * kb_frand();
    for (size_t i = 0; i < nk; i++) {
        const bool live = (int)(i / ks % s.kv_cap) < c.past + c.T && (int)(i % ks) < c.G * c.hd;
        k16[i] = live ? nl_elem_to_bf16(2.0f * kb_frand()) : NAN16;
        v16[i] = live ? nl_elem_to_bf16(kb_frand()) : NAN16;
        kw[i] = nl_elem_from_bf16(k16[i]);
        vw[i] = nl_elem_from_bf16(v16[i]);
    }
    std::vector<float> ref(no, NAN), cpu16(no, NAN), gpu(no, NAN);
    char what[128];
    snprintf(what, sizeof what, "bf16 cache attention B %d T %d past %d H %d G %d hd %d", c.B, c.T,
             c.past, c.H, c.G, c.hd);
    cpu->attention_forward(cpu, ref.data(), nullptr, q.data(), qs, kw.data(), vw.data(), ks, s);
    nl_attn_shape s16 = s;
    s16.kv_bf16 = 1;
    const float *kf = reinterpret_cast<const float *>(k16.data());
    const float *vf = reinterpret_cast<const float *>(v16.data());
    cpu->attention_forward(cpu, cpu16.data(), nullptr, q.data(), qs, kf, vf, ks, s16);
    CHECK(memcmp(ref.data(), cpu16.data(), no * sizeof(float)) == 0,
          "%s: the CPU's bf16 cache is not its FP32 one on the widened values", what);
    CHECK(nl_cuda_attention_forward(nullptr, gpu.data(), nullptr, q.data(), qs, kf, vf, ks, s16) ==
              0,
          "%s: launch", what);
    double omax = 0, emax = 0;
    for (size_t i = 0; i < no; i++)
        omax = fmax(omax, fabs((double)ref[i]));
    size_t bad = 0;
    for (size_t i = 0; i < no; i++) {
        const double e = fabs((double)gpu[i] - ref[i]);
        bad += !(e <= 1e-5 * omax);
        emax = e > emax ? e : emax;
    }
    CHECK(bad == 0 && omax > 0, "%s: %zu of %zu outputs off, max error %.3g of max |out| %.3g",
          what, bad, no, emax, omax);
    /* each sequence's bf16 cache its own (s.kseq / s.vseq), in reverse
     * order in memory, the shared one NaN: the same bits as the shared
     * cache's call, on the device and on the CPU */
    const size_t per = (size_t)s.kv_cap * ks;
    std::vector<std::vector<uint16_t>> kown(c.B), vown(c.B);
    std::vector<const void *> kseq(c.B), vseq(c.B);
    for (int b = 0; b < c.B; b++) {
        kown[c.B - 1 - b].assign(k16.begin() + b * per, k16.begin() + (b + 1) * per);
        vown[c.B - 1 - b].assign(v16.begin() + b * per, v16.begin() + (b + 1) * per);
    }
    for (int b = 0; b < c.B; b++) {
        kseq[b] = kown[c.B - 1 - b].data();
        vseq[b] = vown[c.B - 1 - b].data();
    }
    std::vector<uint16_t> nan16(per, NAN16);
    const float *nf = reinterpret_cast<const float *>(nan16.data());
    nl_attn_shape so = s16;
    so.kseq = kseq.data();
    so.vseq = vseq.data();
    std::vector<float> gpu_own(no, NAN), cpu_own(no, NAN);
    CHECK(nl_cuda_attention_forward(nullptr, gpu_own.data(), nullptr, q.data(), qs, nf, nf, ks,
                                    so) == 0,
          "%s: launch (own caches)", what);
    cpu->attention_forward(cpu, cpu_own.data(), nullptr, q.data(), qs, nf, nf, ks, so);
    CHECK(memcmp(gpu_own.data(), gpu.data(), no * sizeof(float)) == 0,
          "%s: the sequences' own caches give other outputs on the device", what);
    CHECK(memcmp(cpu_own.data(), cpu16.data(), no * sizeof(float)) == 0,
          "%s: the sequences' own caches give other outputs on the CPU", what);
}

} // namespace

int nl_emu_kv_bf16_checks(void)
{
    nl_error err = {};
    nl_backend *cpu = nullptr;
    nl_backend_opts opts = {};
    opts.threads = 1;
    if (nl_backend_new(&cpu, "cpu", &opts, &err) != NL_OK) {
        fprintf(stderr, "emu_kv_bf16: no CPU backend: %s\n", err.msg);
        return 1;
    }
    check_store(cpu);
    const kv_case cases[] = {
        /* B  T  past H  G  hd  kvpad */
        {1, 1, 0, 1, 1, 64, 0},    /* one key */
        {2, 1, 70, 4, 1, 64, 2},   /* decode, H/G 4, padded rows */
        {1, 3, 300, 2, 2, 128, 0}, /* decode T 3 over several chunks */
        {1, 1, 255, 2, 1, 37, 1},  /* odd hd, every decode warp busy */
        {1, 2, 40, 4, 2, 256, 4},  /* the 256 bucket */
        {2, 17, 0, 4, 1, 64, 3},   /* prefill, one past a query tile */
        {1, 33, 45, 2, 1, 100, 0}, /* prefill over a past, the 128 bucket */
        {1, 9, 31, 4, 2, 256, 0},  /* prefill in the 256 bucket */
    };
    for (const kv_case &c : cases)
        check_attention(cpu, c);
    nl_backend_destroy(&cpu);
    return check_fail_count;
}
