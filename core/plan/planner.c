/* The layer planner: cost model, feasibility DPs, the bisection on the
 * bottleneck, and the messages that say why nothing fits. The algorithm
 * and its guarantees are described in planner.h. */
#include "core/plan/planner.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------- cost model */

double nl_plan_layer_flops(const nl_config *c, int rows, int seq_len)
{
    const double d = c->hidden_dim, hd = nl_config_head_dim(c), H = c->num_heads;
    const double G = c->num_kv_heads, F = c->ffn_dim, E = c->num_experts, k = c->top_k;
    const double T = seq_len > 0 ? seq_len : 1;
    /* as nl_config_forward_flops: projections, router, top_k experts */
    const double per_token =
        2 * d * (H + 2 * G) * hd + 2 * H * hd * d + 2 * d * E + k * (2 * d * 2 * F + 2 * F * d);
    /* causal attention: each row sees (t + 1) keys; summed over a sequence
     * of T rows that is T (T + 1) / 2, i.e. (T + 1) / 2 per row */
    const double keys = (double)rows * (T + 1) / 2;
    return (double)rows * per_token + 4 * H * hd * keys;
}

double nl_plan_head_flops(const nl_config *c, int rows)
{
    return (double)rows * 2 * c->hidden_dim * (double)c->vocab_size;
}

double nl_plan_embed_flops(const nl_config *c, int rows)
{
    return (double)rows * c->hidden_dim;
}

static int opt_rows(const nl_plan_opts *o)
{
    return o->mem.micro_rows > 0 ? o->mem.micro_rows : 1;
}

static int opt_seq(const nl_config *c, const nl_plan_opts *o)
{
    const int rows = opt_rows(o);
    const int T = o->seq_len > 0 ? o->seq_len : c->max_seq_len;
    return T < rows ? T : rows;
}

/* Work per microbatch by part, with the training factors applied. */
typedef struct plan_cost {
    double layer, embed, head;
    int training;
} plan_cost;

static void cost_init(plan_cost *pc, const nl_config *c, const nl_plan_opts *o)
{
    const int rows = opt_rows(o), T = opt_seq(c, o);
    const double f = o->mem.training ? 3 : 1;
    const double fl = o->mem.training ? (o->mem.recompute ? 4 : 3) : 1;
    pc->layer = nl_plan_layer_flops(c, rows, T) * fl;
    pc->embed = nl_plan_embed_flops(c, rows) * f;
    pc->head = nl_plan_head_flops(c, rows) * f;
    pc->training = o->mem.training;
}

/* Where a stage sits: first (embedding), last (head, when r == 0), the
 * transfers it sends, and the microbatches 1F1B keeps there. r counts the
 * stages after it. */
typedef struct stage_pos {
    int embed, head, hops, in_flight;
} stage_pos;

static stage_pos pos_of(const nl_plan_opts *o, int first, int r)
{
    stage_pos p;
    const int M = o->mem.in_flight;
    p.embed = first;
    p.head = r == 0;
    p.hops = (r > 0) + (o->mem.training && !first);
    p.in_flight = !o->mem.training ? 1 : nl_mem_train_slots(r, M, o->mem.in_flight_extra);
    return p;
}

/* The one formula for a stage's time; every caller goes through it so
 * that the bisection and the reported times agree to the bit. */
static double seconds_of(const plan_cost *pc, const nl_plan_node *nd, int n, stage_pos p)
{
    double w = (double)n * pc->layer;
    if (p.embed)
        w += pc->embed;
    if (p.head)
        w += pc->head;
    return w / (nd->gflops * 1e9) + p.hops * nd->hop_seconds;
}

static uint64_t bytes_of(const nl_config *c, const nl_plan_opts *o, int n, int embed, int head,
                         int in_flight)
{
    nl_mem_opts m = o->mem;
    m.in_flight = in_flight;
    return nl_memory_estimate(c, n, embed, head, &m).total;
}

int nl_plan_stage_in_flight(const nl_plan_opts *o, int s, int S)
{
    return pos_of(o, s == 0, S - 1 - s).in_flight;
}

uint64_t nl_plan_stage_bytes(const nl_config *c, const nl_plan_opts *o, int n, int s, int S)
{
    const stage_pos p = pos_of(o, s == 0, S - 1 - s);
    return bytes_of(c, o, n, p.embed, p.head, p.in_flight);
}

double nl_plan_stage_seconds(const nl_config *c, const nl_plan_opts *o, const nl_plan_node *nd,
                             int n, int s, int S)
{
    plan_cost pc;
    cost_init(&pc, c, o);
    return seconds_of(&pc, nd, n, pos_of(o, s == 0, S - 1 - s));
}

/* ------------------------------------------------------------- context */

#define N_ORDERS 7
#define TIE_REL 1e-9
#define SWAP_BUDGET 4e7

typedef struct plan_ctx {
    const nl_config *cfg;
    const nl_plan_node *nodes;
    nl_plan_opts o;
    plan_cost pc;
    int n, L, smax, exact;
    int **caprow;          /* [4 (smax + 1)] by (embed | head << 1, in_flight): most
                              layers each node holds by memory, -1 none; on demand */
    uint64_t *bytes;       /* (L + 1) scratch */
    const int **cap_mid;   /* (smax) by r: the caprow of a stage with r after it */
    const int **cap_first; /* (smax) the same for the first stage */
    int cover;             /* most layers a (partial) plan covered: for messages */
    /* exact */
    int *best;           /* (2^n) most layers the nodes of a mask cover as the last stages */
    signed char *par;    /* (2^n) the mask's frontmost node in that */
    uint32_t found_mask; /* the last dp's plan: the later stages and the first node */
    int found_node;
    /* heuristic */
    int *order[N_ORDERS + 1]; /* node orders, each (n); the last one for the swap search */
    int *g;                   /* ((n + 1) smax) most layers covered, by (t, r) */
    unsigned char *took;      /* same shape: node t taken at (t, r) */
    int *term_t;              /* (smax) first node t that completed a plan of r + 1 stages */
} plan_ctx;

static void ctx_free(plan_ctx *x)
{
    if (x->caprow)
        for (int i = 0; i < 4 * (x->smax + 1); i++)
            free(x->caprow[i]);
    free(x->caprow);
    free(x->bytes);
    free(x->cap_mid);
    free(x->cap_first);
    free(x->best);
    free(x->par);
    for (int i = 0; i <= N_ORDERS; i++)
        free(x->order[i]);
    free(x->g);
    free(x->took);
    free(x->term_t);
}

/* Heuristic node orders, by key (throughput for even modes below 6,
 * memory for odd) and arrangement: 0-1 descending, 2-3 ascending, 4-5
 * "heavy ends" (descending values dealt alternately to the front and the
 * back: the largest first, the second last, ...), 6 input order. Ties by
 * input position. */
static int goes_before(const nl_plan_node *nodes, int mode, int a, int b)
{
    const nl_plan_node *x = &nodes[a], *y = &nodes[b];
    int r = 0;
    if (mode < 6 && mode % 2 == 0)
        r = (x->gflops > y->gflops) - (x->gflops < y->gflops);
    else if (mode < 6)
        r = (x->memory_bytes > y->memory_bytes) - (x->memory_bytes < y->memory_bytes);
    if (mode < 2 || mode == 4 || mode == 5)
        r = -r;
    return r ? r < 0 : a < b;
}

/* ord gets the order of mode; tmp is (n) scratch. */
static void sort_order(int *ord, int *tmp, int n, const nl_plan_node *nodes, int mode)
{
    for (int i = 0; i < n; i++) { /* insertion sort: n is at most a few thousand */
        int k = i;
        while (k > 0 && goes_before(nodes, mode, i, tmp[k - 1])) {
            tmp[k] = tmp[k - 1];
            k--;
        }
        tmp[k] = i;
    }
    for (int i = 0, front = 0, back = n - 1; i < n; i++) {
        if (mode == 4 || mode == 5)
            ord[i % 2 ? back-- : front++] = tmp[i];
        else
            ord[i] = tmp[i];
    }
}

/* Most layers each node holds by memory as a stage with these flags. */
static const int *cap_row(plan_ctx *x, int embed, int head, int in_flight)
{
    int **slot = &x->caprow[(embed | head << 1) * (x->smax + 1) + in_flight];
    if (*slot)
        return *slot;
    int *row = malloc((size_t)x->n * sizeof *row);
    if (!row)
        return NULL;
    for (int l = 0; l <= x->L; l++) /* non-decreasing in l */
        x->bytes[l] = bytes_of(x->cfg, &x->o, l, embed, head, in_flight);
    for (int j = 0; j < x->n; j++) {
        int lo = -1, hi = x->L; /* largest l with bytes[l] <= memory, -1 if none */
        const uint64_t mem = x->nodes[j].memory_bytes;
        while (lo < hi) {
            int mid = lo + (hi - lo + 1) / 2;
            if (x->bytes[mid] <= mem)
                lo = mid;
            else
                hi = mid - 1;
        }
        row[j] = lo;
    }
    return *slot = row;
}

static nl_status ctx_init(plan_ctx *x, const nl_config *cfg, const nl_plan_node *nodes, int n,
                          const nl_plan_opts *o, nl_error *err)
{
    memset(x, 0, sizeof *x);
    x->cfg = cfg;
    x->nodes = nodes;
    x->o = *o;
    x->n = n;
    x->L = cfg->num_layers;
    x->smax = n < x->L ? n : x->L;
    x->exact = n <= (o->max_exact_nodes > 0 ? o->max_exact_nodes : NL_PLAN_EXACT_MAX);
    cost_init(&x->pc, cfg, o);
    const size_t sm = (size_t)x->smax;
    x->caprow = calloc(4 * (sm + 1), sizeof *x->caprow);
    x->bytes = malloc(((size_t)x->L + 1) * sizeof *x->bytes);
    x->cap_mid = calloc(sm, sizeof *x->cap_mid);
    x->cap_first = calloc(sm, sizeof *x->cap_first);
    if (!x->caprow || !x->bytes || !x->cap_mid || !x->cap_first)
        goto nomem;
    for (int r = 0; r < x->smax; r++) {
        const stage_pos m = pos_of(o, 0, r), f = pos_of(o, 1, r);
        x->cap_mid[r] = cap_row(x, m.embed, m.head, m.in_flight);
        x->cap_first[r] = cap_row(x, f.embed, f.head, f.in_flight);
        if (!x->cap_mid[r] || !x->cap_first[r])
            goto nomem;
    }
    if (x->exact) {
        x->best = malloc(((size_t)1 << n) * sizeof *x->best);
        x->par = malloc((size_t)1 << n);
        if (!x->best || !x->par)
            goto nomem;
        return NL_OK;
    }
    const size_t cells = ((size_t)n + 1) * sm;
    x->g = malloc(cells * sizeof *x->g);
    x->took = malloc(cells);
    x->term_t = malloc(sm * sizeof *x->term_t);
    if (!x->g || !x->took || !x->term_t)
        goto nomem;
    int *tmp = malloc((size_t)n * sizeof(int));
    if (!tmp)
        goto nomem;
    for (int k = 0; k < N_ORDERS; k++) {
        if (!(x->order[k] = malloc((size_t)n * sizeof(int)))) {
            free(tmp);
            goto nomem;
        }
        sort_order(x->order[k], tmp, n, nodes, k);
    }
    free(tmp);
    if (!(x->order[N_ORDERS] = malloc((size_t)n * sizeof(int))))
        goto nomem;
    return NL_OK;
nomem:
    ctx_free(x);
    return nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory for %d nodes", n);
}

/* --------------------------------------------------------- feasibility */

/* Most layers (at most nmax) node nd runs at position p within B. */
static int time_limit(const plan_ctx *x, const nl_plan_node *nd, stage_pos p, double B, int nmax)
{
    if (seconds_of(&x->pc, nd, nmax, p) <= B)
        return nmax;
    const double fixed = seconds_of(&x->pc, nd, 0, p);
    const double per = x->pc.layer / (nd->gflops * 1e9);
    const double est = per > 0 ? (B - fixed) / per : 0;
    int n = !(est > 0) ? 0 : est >= nmax ? nmax : (int)est;
    /* the estimate is off by rounding at most; settle on the formula */
    while (n < nmax && seconds_of(&x->pc, nd, n + 1, p) <= B)
        n++;
    while (n > 0 && seconds_of(&x->pc, nd, n, p) > B)
        n--;
    return n;
}

/* Layers covered from the end after node j, as a stage that is not the
 * first with r stages after it, takes the most that its memory and B
 * allow while leaving one for the first stage; -1 if it takes none. */
static int take_back(const plan_ctx *x, int j, int r, double B, int covered)
{
    const int room = x->L - 1 - covered;
    int n = x->cap_mid[r][j] < room ? x->cap_mid[r][j] : room;
    if (n < 1)
        return -1;
    if (B < INFINITY)
        n = time_limit(x, &x->nodes[j], pos_of(&x->o, 0, r), B, n);
    return n < 1 ? -1 : covered + n;
}

/* Whether node j, as the first stage with r after it, holds the rest. */
static int first_fits(plan_ctx *x, int j, int r, double B, int covered)
{
    const int n = x->L - covered, cap = x->cap_first[r][j];
    if (cap >= 1 && covered + (cap < n ? cap : n) > x->cover)
        x->cover = covered + (cap < n ? cap : n);
    return cap >= n && seconds_of(&x->pc, &x->nodes[j], n, pos_of(&x->o, 1, r)) <= B;
}

/* Exact: over every ordered subset of nodes, by the number r of stages
 * after the first: best[mask] is the most layers the nodes of mask cover
 * as the last r stages in some order. Returns the fewest stages of a plan
 * within B (0: none), kept in found_mask and found_node. */
static int dp_subsets(plan_ctx *x, double B)
{
    const uint32_t full = (uint32_t)1 << x->n;
    for (uint32_t m = 0; m < full; m++)
        x->best[m] = -1;
    x->best[0] = 0;
    for (int r = 0; r < x->smax; r++) {
        /* masks of r bits in increasing order (Gosper's hack) */
        for (uint32_t m = ((uint32_t)1 << r) - 1; m < full;) {
            if (x->best[m] >= 0) {
                for (int j = 0; j < x->n; j++)
                    if (!(m >> j & 1) && first_fits(x, j, r, B, x->best[m])) {
                        x->found_mask = m;
                        x->found_node = j;
                        return r + 1;
                    }
                for (int j = 0; j < x->n; j++) {
                    const uint32_t b = (uint32_t)1 << j;
                    if (m & b)
                        continue;
                    const int c = take_back(x, j, r, B, x->best[m]);
                    if (c > x->best[m | b]) {
                        x->best[m | b] = c;
                        x->par[m | b] = (signed char)j;
                    }
                }
            }
            if (m == 0)
                break;
            const uint32_t low = m & -m, up = m + low;
            m = (((up ^ m) >> 2) / low) | up;
        }
    }
    return 0;
}

/* Heuristic: the same along one order of the nodes, walked from its end;
 * g[t][r] is the most layers r stages drawn in order from nodes t.. cover
 * as the last stages. Skipped nodes stay standby. */
static int dp_order(plan_ctx *x, const int *ord, double B)
{
    const int W = x->smax;
    int min_s = 0;
    for (int r = 0; r < W; r++) {
        x->g[x->n * W + r] = r == 0 ? 0 : -1;
        x->term_t[r] = -1;
    }
    for (int t = x->n - 1; t >= 0; t--) {
        const int j = ord[t];
        const int *nx = &x->g[(t + 1) * W];
        int *cur = &x->g[t * W];
        for (int r = 0; r < W; r++) {
            if (nx[r] >= 0 && x->term_t[r] < 0 && first_fits(x, j, r, B, nx[r])) {
                x->term_t[r] = t;
                min_s = min_s && min_s <= r + 1 ? min_s : r + 1;
            }
            const int c = r > 0 && nx[r - 1] >= 0 ? take_back(x, j, r - 1, B, nx[r - 1]) : -1;
            x->took[t * W + r] = c >= 0 && c >= nx[r];
            cur[r] = x->took[t * W + r] ? c : nx[r];
        }
    }
    return min_s;
}

/* Fewest stages of a plan within B along order ord (-1: exact), 0: none. */
static int dp_run(plan_ctx *x, int ord, double B)
{
    return ord < 0 ? dp_subsets(x, B) : dp_order(x, x->order[ord], B);
}

static uint64_t dbits(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static double bitsd(uint64_t u)
{
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Smallest double B <= hi at which a plan of at most s_ok stages exists
 * (hi has one). Non-negative doubles order like their bit patterns. */
static double bisect(plan_ctx *x, int ord, double hi, int s_ok)
{
    int s = dp_run(x, ord, 0.0);
    if (s && s <= s_ok)
        return 0.0;
    uint64_t lo_b = 0, hi_b = dbits(hi);
    while (hi_b - lo_b > 1) {
        const uint64_t mid = lo_b + (hi_b - lo_b) / 2;
        s = dp_run(x, ord, bitsd(mid));
        if (s && s <= s_ok)
            hi_b = mid;
        else
            lo_b = mid;
    }
    return bitsd(hi_b);
}

typedef struct plan_found {
    int S;   /* 0: none */
    int ord; /* -1: exact; else a heuristic order */
    double B;
} plan_found;

/* The best plan along one order: the smallest bottleneck B, then the
 * fewest stages among plans within B (1 + TIE_REL) and their smallest B. */
static plan_found search_order(plan_ctx *x, int ord)
{
    plan_found f = {0, ord, INFINITY};
    if (!dp_run(x, ord, INFINITY))
        return f;
    double b = bisect(x, ord, INFINITY, x->smax);
    const double tie = b * (1 + TIE_REL);
    const int s_tie = dp_run(x, ord, tie);
    if (s_tie < dp_run(x, ord, b))
        b = bisect(x, ord, tie, s_tie);
    f.S = s_tie;
    f.B = b;
    return f;
}

/* Heuristic only: from the best order, swap pairs of nodes while that
 * lowers the bottleneck by more than the tie margin, within a budget of
 * DP cells (about 0.2 s). */
static plan_found improve(plan_ctx *x, plan_found f)
{
    const int w = N_ORDERS;
    int *ord = x->order[w];
    memcpy(ord, x->order[f.ord], (size_t)x->n * sizeof *ord);
    f.ord = w;
    double budget = SWAP_BUDGET / ((double)x->n * x->smax);
    for (int better = 1; better && budget > 0;) {
        better = 0;
        for (int i = 0; i < x->n - 1 && budget > 0; i++)
            for (int j = i + 1; j < x->n && budget > 0; j++, budget--) {
                int t = ord[i];
                ord[i] = ord[j];
                ord[j] = t;
                if (dp_run(x, w, f.B * (1 - TIE_REL))) {
                    f = search_order(x, w);
                    budget -= 130; /* the bisections */
                    better = 1;
                } else {
                    ord[j] = ord[i];
                    ord[i] = t;
                }
            }
    }
    return f;
}

static plan_found search(plan_ctx *x, int timed)
{
    plan_found f = {0, -1, INFINITY};
    for (int k = 0; k < (x->exact ? 1 : N_ORDERS); k++) {
        const int ord = x->exact ? -1 : k;
        if (!timed) {
            if (dp_run(x, ord, INFINITY))
                return (plan_found){dp_run(x, ord, INFINITY), ord, INFINITY};
            continue;
        }
        const plan_found g = search_order(x, ord);
        if (g.S && (!f.S || g.B < f.B * (1 - TIE_REL) || (g.B <= f.B * (1 + TIE_REL) && g.S < f.S)))
            f = g;
    }
    return timed && !x->exact && f.S ? improve(x, f) : f;
}

/* ---------------------------------------------------------- validation */

static nl_status validate(const nl_config *cfg, const nl_plan_node *nodes, int n,
                          const nl_plan_opts *o, nl_error *err)
{
    if (!cfg || !o || (n > 0 && !nodes))
        return nl_error_set(err, NL_ERR_INVALID, "plan: missing config, nodes or options");
    nl_status st = nl_config_validate(cfg, 1, err);
    if (st)
        return nl_error_prefix(err, "plan: config");
    if (n < 1)
        return nl_error_set(err, NL_ERR_CAPACITY, "plan: no nodes to place the model on");
    if (n > NL_PLAN_MAX_NODES)
        return nl_error_set(err, NL_ERR_LIMIT, "plan: %d nodes is above the supported %d", n,
                            NL_PLAN_MAX_NODES);
    const nl_mem_opts *m = &o->mem;
    if (m->micro_rows < 0 || m->micro_rows > (1 << 26) || m->in_flight < 0 || m->kv_sessions < 0 ||
        m->kv_len < 0 || o->seq_len < 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "plan: options: micro_rows %d, in_flight %d, kv_sessions %d, kv_len "
                            "%d, seq_len %d must be >= 0 (micro_rows at most 2^26)",
                            m->micro_rows, m->in_flight, m->kv_sessions, m->kv_len, o->seq_len);
    if (o->max_exact_nodes < 0 || o->max_exact_nodes > NL_PLAN_EXACT_LIMIT)
        return nl_error_set(err, NL_ERR_INVALID, "plan: max_exact_nodes %d is outside 0..%d",
                            o->max_exact_nodes, NL_PLAN_EXACT_LIMIT);
    for (int i = 0; i < n; i++) {
        const nl_plan_node *a = &nodes[i];
        if (!(a->gflops > 0) || !isfinite(a->gflops))
            return nl_error_set(err, NL_ERR_INVALID, "plan: node %d: gflops %g must be > 0", a->id,
                                a->gflops);
        if (!(a->hop_seconds >= 0) || !isfinite(a->hop_seconds))
            return nl_error_set(err, NL_ERR_INVALID, "plan: node %d: hop_seconds %g must be >= 0",
                                a->id, a->hop_seconds);
        if (!(a->link_bytes_s >= 0) || !isfinite(a->link_bytes_s))
            return nl_error_set(err, NL_ERR_INVALID, "plan: node %d: link_bytes_s %g must be >= 0",
                                a->id, a->link_bytes_s);
        for (int j = 0; j < i; j++)
            if (nodes[j].id == a->id)
                return nl_error_set(err, NL_ERR_INVALID, "plan: node id %d appears twice", a->id);
    }
    return NL_OK;
}

/* ------------------------------------------------------------ messages */

/* Nothing fits: say why, and how many bytes more are needed. */
static nl_status explain(plan_ctx *x, nl_error *err)
{
    const nl_config *c = x->cfg;
    const nl_plan_opts *o = &x->o;
    const char *what = o->mem.training ? "training" : "inference";
    uint64_t total = 0, largest = 0;
    int big = x->nodes[0].id;
    for (int i = 0; i < x->n; i++) {
        const uint64_t m = x->nodes[i].memory_bytes;
        total = total + m < total ? UINT64_MAX : total + m;
        if (m > largest) {
            largest = m;
            big = x->nodes[i].id;
        }
    }
    /* one stage holding everything is the least any plan needs in all */
    const uint64_t whole = bytes_of(c, o, x->L, 1, 1, 1);
    if (whole > total)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "plan: needs %llu bytes more: %s of %d layers needs at least %llu "
                            "bytes and the %d nodes offer %llu",
                            (unsigned long long)(whole - total), what, x->L,
                            (unsigned long long)whole, x->n, (unsigned long long)total);
    static const struct {
        int embed, head;
        const char *name;
    } parts[] = {{0, 0, "a single layer"},
                 {1, 0, "the first stage (embedding and one layer)"},
                 {0, 1, "the last stage (one layer, final norm and head)"},
                 {1, 1, "the only stage (one layer, embedding and head)"}};
    /* with one layer there is one stage, holding both tables */
    for (int p = x->L == 1 ? 3 : 0; p < (x->L == 1 ? 4 : 3); p++) {
        const uint64_t need = bytes_of(c, o, 1, parts[p].embed, parts[p].head, 1);
        if (need > largest)
            return nl_error_set(err, NL_ERR_CAPACITY,
                                "plan: needs %llu bytes more on one node: %s needs %llu bytes "
                                "for %s and the largest node (%d) offers %llu",
                                (unsigned long long)(need - largest), parts[p].name,
                                (unsigned long long)need, what, big, (unsigned long long)largest);
    }
    const int missing = x->L - x->cover;
    const uint64_t per = bytes_of(c, o, 2, 0, 0, 1) - bytes_of(c, o, 1, 0, 0, 1);
    return nl_error_set(err, NL_ERR_CAPACITY,
                        "plan: needs about %llu bytes more: only %d of %d layers fit on the %d "
                        "nodes (%llu bytes in all; %llu bytes per layer for %s), the memory is "
                        "split into pieces too small for the stages",
                        (unsigned long long)((uint64_t)missing * per), x->cover, x->L, x->n,
                        (unsigned long long)total, (unsigned long long)per, what);
}

/* ------------------------------------------------------------ the plan */

/* The nodes of the plan found by the last dp_run at f->B, first to last. */
static nl_status plan_nodes(plan_ctx *x, const plan_found *f, int *seq, nl_error *err)
{
    const int S = f->S;
    if (dp_run(x, f->ord, f->B) != S)
        return nl_error_set(err, NL_ERR_INTERNAL, "plan: the chosen plan does not replay");
    if (f->ord < 0) {
        uint32_t m = x->found_mask;
        seq[0] = x->found_node;
        for (int s = 1; s < S; s++) { /* par is the frontmost of the mask */
            seq[s] = x->par[m];
            m ^= (uint32_t)1 << seq[s];
        }
        return NL_OK;
    }
    const int W = x->smax, *ord = x->order[f->ord];
    int t = x->term_t[S - 1], r = S - 1, s = 0;
    seq[s++] = ord[t++];
    for (; r > 0; t++) {
        if (t >= x->n)
            return nl_error_set(err, NL_ERR_INTERNAL, "plan: broken back-track");
        if (x->took[t * W + r]) {
            seq[s++] = ord[t];
            r--;
        }
    }
    return NL_OK;
}

static nl_status build(plan_ctx *x, const plan_found *f, nl_plan **out, nl_error *err)
{
    const int S = f->S;
    nl_status st = NL_OK;
    nl_plan *p = calloc(1, sizeof *p);
    int *seq = malloc((size_t)S * sizeof *seq), *cnt = malloc((size_t)S * sizeof *cnt);
    char *used = calloc((size_t)x->n, 1);
    if (!p || !seq || !cnt || !used)
        goto nomem;
    p->stages = calloc((size_t)S, sizeof *p->stages);
    p->standby = malloc((size_t)x->n * sizeof *p->standby);
    if (!p->stages || !p->standby)
        goto nomem;
    if ((st = plan_nodes(x, f, seq, err)))
        goto fail;
    /* replay the greedy takes from the last stage back; the first takes the rest */
    int covered = 0;
    for (int s = S - 1; s >= 1; s--) {
        const int next = take_back(x, seq[s], S - 1 - s, f->B, covered);
        cnt[s] = next - covered;
        covered = next;
    }
    cnt[0] = x->L - covered;
    for (int s = 0, l = 0; s < S; s++) {
        const int j = seq[s];
        nl_plan_stage *g = &p->stages[s];
        g->node_id = x->nodes[j].id;
        g->n_replicas = 1;
        g->replicas[0] = g->node_id;
        g->l0 = l;
        g->l1 = l += cnt[s];
        g->has_embed = s == 0;
        g->has_head = s == S - 1;
        g->in_flight = nl_plan_stage_in_flight(&x->o, s, S);
        g->bytes = nl_plan_stage_bytes(x->cfg, &x->o, cnt[s], s, S);
        g->seconds = seconds_of(&x->pc, &x->nodes[j], cnt[s], pos_of(&x->o, s == 0, S - 1 - s));
        if (cnt[s] < 1 || used[j] || g->bytes > x->nodes[j].memory_bytes || g->seconds > f->B) {
            st = nl_error_set(err, NL_ERR_INTERNAL, "plan: stage %d on node %d breaks a rule", s,
                              g->node_id);
            goto fail;
        }
        if (g->seconds > p->bottleneck)
            p->bottleneck = g->seconds;
        used[j] = 1;
    }
    p->n_stages = S;
    for (int j = 0; j < x->n; j++)
        if (!used[j])
            p->standby[p->n_standby++] = x->nodes[j].id;
    p->exact = f->ord < 0;
    free(seq);
    free(cnt);
    free(used);
    *out = p;
    return NL_OK;
nomem:
    st = nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
fail:
    free(seq);
    free(cnt);
    free(used);
    nl_plan_destroy(&p);
    return st;
}

nl_status nl_plan_layers(nl_plan **out, const nl_config *cfg, const nl_plan_node *nodes,
                         int n_nodes, const nl_plan_opts *opts, nl_error *err)
{
    if (!out)
        return nl_error_set(err, NL_ERR_INVALID, "plan: no output");
    *out = NULL;
    nl_status st = validate(cfg, nodes, n_nodes, opts, err);
    if (st)
        return st;
    plan_ctx x;
    if ((st = ctx_init(&x, cfg, nodes, n_nodes, opts, err)))
        return st;
    const plan_found f = search(&x, 1);
    st = f.S ? build(&x, &f, out, err) : explain(&x, err);
    ctx_free(&x);
    return st;
}

nl_status nl_plan_fits(const nl_config *cfg, const nl_plan_node *nodes, int n_nodes,
                       const nl_plan_opts *opts, int *fits, nl_error *err)
{
    *fits = 0;
    nl_status st = validate(cfg, nodes, n_nodes, opts, err);
    if (st == NL_ERR_CAPACITY)
        return NL_OK; /* no nodes: nothing fits */
    if (st)
        return st;
    /* one stage holding everything is the least any plan needs in all */
    uint64_t total = 0;
    for (int i = 0; i < n_nodes; i++)
        total = total + nodes[i].memory_bytes < total ? UINT64_MAX : total + nodes[i].memory_bytes;
    if (bytes_of(cfg, opts, cfg->num_layers, 1, 1, 1) > total)
        return NL_OK;
    plan_ctx x;
    if ((st = ctx_init(&x, cfg, nodes, n_nodes, opts, err)))
        return st;
    *fits = search(&x, 0).S > 0;
    ctx_free(&x);
    return NL_OK;
}

void nl_plan_destroy(nl_plan **pp)
{
    if (!pp || !*pp)
        return;
    free((*pp)->stages);
    free((*pp)->standby);
    free(*pp);
    *pp = NULL;
}

void nl_plan_range_str(char *out, size_t cap, int l0, int l1, int embed, int head)
{
    if (cap > 0)
        snprintf(out, cap, "[%d,%d)%s%s", l0, l1, embed ? "+e" : "", head ? "+h" : "");
}
