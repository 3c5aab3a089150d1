/* Greedy, temperature and top-p sampling. */
#include "core/model/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/elem.h"

nl_status nl_sampler_init(nl_sampler *s, int vocab, float temperature, float top_p, uint64_t seed,
                          nl_error *err)
{
    s->probs = NULL;
    if (!(temperature >= 0.0f) || !isfinite(temperature))
        return nl_error_set(err, NL_ERR_INVALID, "temperature: %g must be a finite number >= 0",
                            temperature);
    if (!(top_p > 0.0f && top_p <= 1.0f))
        return nl_error_set(err, NL_ERR_INVALID, "top-p: %g must be in (0, 1]", top_p);
    if (vocab < 1)
        return nl_error_set(err, NL_ERR_INVALID, "sampler: vocabulary %d", vocab);
    s->temperature = temperature;
    s->top_p = top_p;
    s->vocab = vocab;
    nl_rng_seed(&s->rng, seed, 0x5A3B1E);
    s->probs = malloc((size_t)vocab * sizeof *s->probs);
    if (!s->probs) {
        nl_sampler_free(s);
        return nl_error_set(err, NL_ERR_NOMEM, "sampler: out of memory");
    }
    return NL_OK;
}

void nl_sampler_free(nl_sampler *s)
{
    free(s->probs);
    s->probs = NULL;
}

int32_t nl_sampler_sample(nl_sampler *s, const float *logits)
{
    if (s->temperature == 0.0f)
        return nl_elem_sample_argmax(logits, s->vocab);
    const double u = nl_rng_uniform(&s->rng);
    return nl_elem_sample_row(logits, s->vocab, s->temperature, s->top_p, u, s->probs);
}

/* NL_HOST_SAMPLING=1: never the backend's sample_rows slot (for comparisons) */
static int host_sampling(void)
{
    const char *e = getenv("NL_HOST_SAMPLING");
    return e && strcmp(e, "1") == 0;
}

int nl_sampler_device(const nl_sampler *s, const nl_backend *be)
{
    return be->sample_rows && s->vocab <= NL_SAMPLE_MAX_VOCAB && !host_sampling();
}

nl_status nl_sampler_next_batch(nl_sampler *const *smp, const float *const *logits, int n,
                                nl_backend *be, nl_sample_row *rows, int32_t *ids, nl_error *err)
{
    int r = 0, V = 0;
    nl_status st = NL_OK;
    for (int i = 0; i < n; i++) {
        nl_sampler *s = smp[i];
        if (!s || !nl_sampler_device(s, be))
            continue;
        if (r > 0 && s->vocab != V) {
            st = nl_error_set(err, NL_ERR_SHAPE, "sampler: vocabularies %d and %d in one batch", V,
                              s->vocab);
            break;
        }
        V = s->vocab;
        /* the draw nl_sampler_sample makes: none when greedy */
        const double u = s->temperature == 0.0f ? 0.0 : nl_rng_uniform(&s->rng);
        rows[r++] = (nl_sample_row){
            .logits = logits[i], .temperature = s->temperature, .top_p = s->top_p, .u = u};
    }
    if (st == NL_OK && r > 0)
        be->sample_rows(be, ids, rows, r, V);
    if (st == NL_OK)
        st = nl_backend_check(be, err);
    /* spread the r ids (rows order) to their samplers, from the back: the
     * k-th row's id sits at ids[k] with k <= its sampler's index */
    for (int i = n - 1; i >= 0; i--)
        ids[i] = st == NL_OK && smp[i] && nl_sampler_device(smp[i], be) ? ids[--r] : -1;
    return st;
}

nl_status nl_sampler_next(nl_sampler *s, nl_backend *be, const float *logits, float *host,
                          int32_t *id, nl_error *err)
{
    if (nl_sampler_device(s, be)) {
        nl_sample_row row;
        return nl_sampler_next_batch(&s, &logits, 1, be, &row, id, err);
    }
    if (!host)
        return nl_error_set(err, NL_ERR_INTERNAL, "sampler: no host buffer for the logits");
    be->download(be, host, logits, (size_t)s->vocab * sizeof(float));
    nl_status st = nl_backend_check(be, err);
    if (st == NL_OK)
        *id = nl_sampler_sample(s, host);
    return st;
}

void nl_sampler_logprobs(const float *logits, int V, int32_t chosen, int k, float *chosen_lp,
                         int32_t *top_ids, float *top_lps)
{
    float mx = logits[0];
    for (int i = 1; i < V; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < V; i++)
        sum += exp((double)logits[i] - mx);
    const double lse = mx + log(sum);
    *chosen_lp = (float)(logits[chosen] - lse);
    /* top k by insertion: k is small (at most 20) */
    int n = 0;
    for (int i = 0; i < V; i++) {
        if (n == k && (k == 0 || logits[i] <= logits[top_ids[n - 1]]))
            continue;
        int at = n < k ? n++ : k - 1;
        while (at > 0 && logits[i] > logits[top_ids[at - 1]]) {
            top_ids[at] = top_ids[at - 1];
            at--;
        }
        top_ids[at] = i;
    }
    for (int j = 0; j < n; j++)
        top_lps[j] = (float)(logits[top_ids[j]] - lse);
}
