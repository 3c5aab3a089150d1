/* `neuroctl selftest`'s check of the sample slot (optional: a target
 * without one gets a skip line): on the same logits, the target's id
 * equals the reference's, for greedy sampling (with a tied maximum) and
 * for temperature sampling at several uniforms, over a short row, one
 * past a chunk's edge and a 50,000-id vocabulary (the rule is
 * kernels/elem.h's nl_elem_sample_row: equal ids, not a tolerance). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cli/selftest.h"

void nl_selftest_sample(nl_selftest *c)
{
    static const int vocabs[] = {7, 257, 50000};
    static const float temps[] = {0.0f, 0.7f, 1.3f};
    static const double us[] = {0.0, 0.3, 0.999};
    for (size_t v = 0; v < sizeof vocabs / sizeof *vocabs; v++) {
        const int V = vocabs[v];
        char shape[64];
        snprintf(shape, sizeof shape, "V=%d greedy, t=0.7, t=1.3", V);
        if (!c->be[0]->sample || !c->be[1]->sample) {
            printf("skip  %-22s  %-46s  (not on %s)\n", "sample", shape,
                   c->be[1]->sample ? c->be[0]->name : c->be[1]->name);
            continue;
        }
        /* its own stream: the other checks' inputs stay as they were */
        float *in = nl_selftest_hbuf(c, (size_t)V * sizeof(float));
        uint32_t r = 2654435761u + (uint32_t)V;
        for (int i = 0; in && i < V; i++) {
            r = r * 1664525u + 1013904223u;
            in[i] = 12.0f * ((float)(r >> 8) / 16777216.0f - 0.5f);
        }
        if (in && V > 3)
            in[1] = in[V - 2] = 9.0f; /* a tied maximum: the lower id */
        pair *x = nl_selftest_dev(c, in, (size_t)V * sizeof(float));
        double differ = 0;
        for (size_t t = 0; !c->oom && t < sizeof temps / sizeof *temps; t++)
            for (size_t u = 0; u < sizeof us / sizeof *us; u++) {
                const int32_t want = c->be[0]->sample(c->be[0], x->d[0], V, temps[t], us[u]);
                const int32_t g = c->be[1]->sample(c->be[1], x->d[1], V, temps[t], us[u]);
                differ += want != g;
            }
        nl_selftest_done(c, "sample", shape, c->oom ? 1.0 : differ, 0.0);
    }
}
