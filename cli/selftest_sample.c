/* `neuroctl selftest`'s check of the sample_rows slot (optional: a target
 * without one gets a skip line): on the same logits, the target's ids
 * equal the reference's, for greedy sampling (with a tied maximum) and
 * for temperature sampling at several uniforms, over every token and in
 * a top-p 0.6 nucleus, over a short row, one
 * past a chunk's edge and a 50,000-id vocabulary (the rule is
 * kernels/elem.h's nl_elem_sample_row: equal ids, not a tolerance); the
 * eighteen rows of a vocabulary in one call, and the target's each alone
 * again: a row's id does not depend on the others beside it. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cli/selftest.h"

void nl_selftest_sample(nl_selftest *c)
{
    static const int vocabs[] = {7, 257, 50000};
    static const float temps[] = {0.0f, 0.7f, 1.3f};
    static const double us[] = {0.0, 0.3, 0.999};
    static const float top_ps[] = {1.0f, 0.6f};
    for (size_t v = 0; v < sizeof vocabs / sizeof *vocabs; v++) {
        const int V = vocabs[v];
        char shape[64];
        snprintf(shape, sizeof shape, "V=%d greedy, t=0.7, t=1.3, top-p", V);
        if (!c->be[0]->sample_rows || !c->be[1]->sample_rows) {
            printf("skip  %-22s  %-46s  (not on %s)\n", "sample", shape,
                   c->be[1]->sample_rows ? c->be[0]->name : c->be[1]->name);
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
        enum {
            NT = sizeof temps / sizeof *temps,
            NU = sizeof us / sizeof *us,
            NR = NT * NU * (sizeof top_ps / sizeof *top_ps)
        };
        nl_sample_row rows[2][NR];
        int32_t want[NR], got[NR], alone = -1;
        double differ = 0;
        for (int side = 0; !c->oom && side < 2; side++) {
            for (int i = 0; i < NR; i++)
                rows[side][i] = (nl_sample_row){.logits = x->d[side],
                                                .temperature = temps[i / NU % NT],
                                                .top_p = top_ps[i / (NT * NU)],
                                                .u = us[i % NU]};
            c->be[side]->sample_rows(c->be[side], side ? got : want, rows[side], NR, V);
        }
        for (int i = 0; !c->oom && i < NR; i++) {
            c->be[1]->sample_rows(c->be[1], &alone, &rows[1][i], 1, V);
            differ += (want[i] != got[i]) + (alone != got[i]);
        }
        nl_selftest_done(c, "sample", shape, c->oom ? 1.0 : differ, 0.0);
    }
}
