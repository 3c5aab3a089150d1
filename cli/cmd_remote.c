/* neuroctl's cluster commands: forward, generate and status through a
 * coordinator (--coordinator ENDPOINT --key CLIENT.key --coordinator-key
 * COORD.pub, or --cluster DIR for a local cluster made by `cluster up`). */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "cli/remote.h"
#include "core/formats/safetensors.h"
#include "core/plan/planner.h"
#include "core/tokenizer/tokenizer.h"

#define ADAPTER_HELP                                                                               \
    "LoRA adapter file under the cluster's --checkpoint-root, shared with the nodes (e.g. the "    \
    "one neuroctl finetune --cluster joined there): every stage applies it to this job"

/* --adapter as an absolute path (the coordinator and the nodes resolve
 * it), into buf; NULL without the flag; 1 in *rc on a path that is not. */
static const char *adapter_flag(const nl_flag *flags, char *buf, int *rc)
{
    const char *ad = nl_args_get(flags, "adapter");
    *rc = 0;
    if (!ad)
        return NULL;
    if (!realpath(ad, buf)) {
        fprintf(stderr, "--adapter: %s: %s\n", ad, strerror(errno));
        *rc = 1;
        return NULL;
    }
    return buf;
}

/* ---------------------------------------------------------------- forward */

/* Where a forward job's result goes: the logits of the B x T ids sent. */
typedef struct forward_out {
    int B, T;
    int64_t shape[3];
    float *logits, aux;
} forward_out;

static nl_status take_logits(void *ctx, const nl_wire_msg *m, nl_error *err)
{
    forward_out *o = ctx;
    const nl_tensor *t = &m->frames[0].t;
    if (t->dtype != NL_DTYPE_F32 || t->ndim != 3 || t->shape[0] != o->B || t->shape[1] != o->T)
        return nl_error_set(err, NL_ERR_SHAPE, "result: logits of an unexpected shape");
    if (!(o->logits = malloc(m->frames[0].len + 1)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    memcpy(o->shape, t->shape, sizeof o->shape);
    memcpy(o->logits, t->data, m->frames[0].len);
    o->aux = (float)m->u.hop.aux;
    return NL_OK;
}

int nl_cmd_remote_forward(int argc, char **argv)
{
    nl_flag flags[] = {{"tokens", 1, "input: safetensors with 'tokens' I32/I64 [B, T]", NULL},
                       {"out", 1, "output: 'logits' F32 [B, T, vocab] and 'aux_loss' F32 []", NULL},
                       {"adapter", 1, ADAPTER_HELP, NULL},
                       NL_REMOTE_FLAGS,
                       {0}};
    const char *usage = "neuroctl forward (--cluster DIR | --coordinator EP --key K "
                        "--coordinator-key P) --tokens IN.safetensors --out OUT.safetensors "
                        "[--adapter A]";
    for (int i = 1; i < argc; i++)
        if (nl_remote_refuse_node_flag(argv[i]))
            return 2;
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *in = nl_args_get(flags, "tokens"), *out = nl_args_get(flags, "out");
    if ((rc = nl_cli_require("forward", usage, flags, "tokens", "out", (const char *)NULL)))
        return rc;
    char abs_adapter[PATH_MAX];
    const char *adapter = adapter_flag(flags, abs_adapter, &rc);
    if (rc)
        return rc;
    const nl_wire_param ap[1] = {
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = (char *)adapter}};
    nl_error err = {0};
    nl_remote r = {0};
    int32_t *ids = NULL;
    int B = 0, T = 0;
    forward_out fo = {0};
    nl_st_writer *w = NULL;
    rc = 1;
    if (nl_cli_read_ids_file(in, "tokens", &ids, &B, &T, &err) != NL_OK ||
        nl_remote_open(&r, flags, 60, &err) != NL_OK ||
        nl_remote_submit(&r, NL_JOB_FORWARD, adapter ? ap : NULL, adapter ? 1 : 0, ids, B, T,
                         &err) != NL_OK)
        goto out;
    fo.B = B;
    fo.T = T;
    if (nl_client_await_result(r.s, nl_mono_s() + r.timeout_ms / 1e3, take_logits, &fo, &err) !=
        NL_OK)
        goto out;
    int64_t scalar[1] = {0};
    if (!(w = nl_st_writer_new())) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_st_writer_add(w, "logits", NL_DTYPE_F32, 3, fo.shape, fo.logits, &err) != NL_OK ||
        nl_st_writer_add(w, "aux_loss", NL_DTYPE_F32, 0, scalar, &fo.aux, &err) != NL_OK ||
        nl_st_writer_write(w, out, &err) != NL_OK)
        goto out;
    rc = 0;
out:
    nl_st_writer_destroy(&w);
    nl_remote_close(&r);
    free(ids);
    free(fo.logits);
    if (rc)
        fprintf(stderr, "neuroctl forward: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}

/* ---------------------------------------------------------------- generate */

/* The cluster's tokenizer, from its status; a byte tokenizer for a
 * byte-level model; NULL (and NL_OK) when neither applies. */
static nl_status remote_tokenizer(nl_remote *r, nl_tokenizer **out, int64_t *vocab,
                                  int64_t *max_seq, nl_error *err)
{
    json_t *st = NULL;
    *out = NULL;
    nl_status s = nl_remote_status(r, &st, err);
    if (s != NL_OK)
        return s;
    json_t *tok = json_object_get(st, "tokenizer");
    json_t *cfg = json_object_get(st, "config");
    *vocab = json_integer_value(json_object_get(cfg, "vocab_size"));
    *max_seq = json_integer_value(json_object_get(cfg, "max_seq_len"));
    if (json_is_string(tok))
        s = nl_tokenizer_load_buffer(out, json_string_value(tok), json_string_length(tok), err);
    else if (*vocab > 0 && *vocab <= 256)
        s = nl_tokenizer_new_bytes(out, err);
    json_decref(st);
    return s;
}

static volatile sig_atomic_t gen_interrupted;

static void gen_on_sigint(int sig)
{
    (void)sig;
    gen_interrupted = 1;
}

/* Ctrl-C: cancel job (if the coordinator named it) and wait up to 2 s for
 * its end, so that the stages stop and the cancel is not lost unsent. */
static void gen_cancel(nl_remote *r, nl_rx *rx, uint64_t job)
{
    nl_error e = {0};
    fprintf(stderr, "\ninterrupted: cancelling job %llu\n", (unsigned long long)job);
    if (!job || nl_remote_cancel(r, job, &e) != NL_OK)
        return;
    const double by = nl_mono_s() + 2.0;
    while (nl_remote_recv(r, rx, by, &e) == NL_OK)
        if (rx->msg.type == NL_MSG_JOB_STATUS && rx->msg.u.job_status.job_id == job &&
            rx->msg.u.job_status.state != NL_JOB_RUNNING)
            return;
    fprintf(stderr, "neuroctl generate: no answer to the cancel of job %llu: %s\n",
            (unsigned long long)job, e.msg);
}

/* The flags of neuroctl generate on a cluster (a copy of which
 * nl_args_parse fills in). */
static const nl_flag gen_flags[] = {
    {"prompt-tokens", 1, "prompt as comma-separated token ids", NULL},
    {"prompt", 1, "prompt as text, through the cluster's tokenizer", NULL},
    {"max-new", 1, "tokens to generate (default 32)", NULL},
    {"temperature", 1, "sampling temperature; 0 is greedy (default 0.8)", NULL},
    {"top-p", 1, "nucleus sampling mass in (0, 1] (default 0.95)", NULL},
    {"seed", 1, "sampling seed (default 0)", NULL},
    {"adapter", 1, ADAPTER_HELP, NULL},
    NL_REMOTE_FLAGS,
    {0}};

/* The prompt's ids (*prompt, *P; the caller frees them): --prompt's text
 * through the cluster's tokenizer (echoed), or --prompt-tokens. 0, 1
 * (err says why) or 2 (a usage error, said). */
static int gen_prompt(nl_tokenizer *tok, const char *ptext, const char *ptoks, int32_t **prompt,
                      size_t *P, nl_error *err)
{
    if (ptext) {
        if (!tok) {
            nl_error_set(err, NL_ERR_NOTFOUND,
                         "the cluster's model has no tokenizer: use "
                         "--prompt-tokens");
            return 1;
        }
        if (nl_tokenizer_encode(tok, ptext, strlen(ptext), prompt, P, err) != NL_OK)
            return 1;
        fputs(ptext, stdout);
    } else {
        int n = nl_cli_parse_ids(ptoks, prompt);
        if (n < 0)
            return 2;
        *P = (size_t)n;
    }
    if (*P == 0) {
        nl_error_set(err, NL_ERR_INVALID, "empty prompt");
        return 1;
    }
    return 0;
}

/* The submitted job's tokens, printed as they come (as text when tok is
 * given, else as ids) into ids[*count..max_new), until the last, the
 * timeout without progress, or Ctrl-C (the job cancelled). 0, 1 (err
 * says why) or 130 (interrupted). */
/* Print token id (text with a tokenizer, else ids), the count-th. */
static void gen_print(nl_tokenizer *tok, int32_t id, int count)
{
    const uint8_t *p = NULL;
    size_t n = 0;
    if (!tok)
        printf("%s%d", count > 1 ? " " : "", id);
    else if (nl_tokenizer_token_bytes(tok, id, &p, &n) == NL_OK &&
             !nl_tokenizer_is_special(tok, id))
        fwrite(p, 1, n, stdout);
}

/* The generation was run again without a node convicted of computing
 * wrong (a JOB_STATUS `rerun` report: docs/security.md): the tokens from
 * `from` on are withdrawn, and the output starts a new line with the ones
 * kept, which the corrected ones follow. */
static void gen_rerun(const nl_rx *rx, nl_tokenizer *tok, const int32_t *ids, int *count)
{
    if (rx->msg.nframes != 1 || rx->msg.frames[0].t.dtype != NL_DTYPE_U8)
        return;
    json_t *o = json_loadb(rx->msg.frames[0].t.data, rx->msg.frames[0].len, 0, NULL);
    const char *ev = json_string_value(json_object_get(o, "event"));
    const json_int_t from = json_integer_value(json_object_get(o, "from")),
                     withdrawn = json_integer_value(json_object_get(o, "withdrawn"));
    if (ev && strcmp(ev, "rerun") == 0 && withdrawn > 0 && from >= 0 && from < *count) {
        *count = (int)from;
        printf("\n");
        for (int i = 0; i < *count; i++)
            gen_print(tok, ids[i], i + 1);
        fflush(stdout);
    }
    json_decref(o);
}

static int gen_receive(nl_remote *r, nl_rx *rx, nl_tokenizer *tok, int32_t *ids, long long max_new,
                       int *count, nl_gen_clock *clock, nl_error *err)
{
    uint64_t job = 0; /* once the coordinator names it */
    double deadline = nl_mono_s() + r->timeout_ms / 1e3;
    for (;;) {
        /* in slices, to see Ctrl-C */
        const double now = nl_mono_s(), slice = now + 0.2 < deadline ? now + 0.2 : deadline;
        nl_status st = gen_interrupted ? NL_OK : nl_remote_recv(r, rx, slice, err);
        if (gen_interrupted) {
            gen_cancel(r, rx, job);
            return 130;
        }
        if (st == NL_ERR_TIMEOUT && slice < deadline)
            continue;
        if (st != NL_OK || nl_client_job_failed(rx, err))
            return 1;
        if (rx->msg.type == NL_MSG_JOB_STATUS && rx->msg.u.job_status.state == NL_JOB_RUNNING) {
            if (job) /* news of a running job: e.g. it lost a stage and resumes */
                fprintf(stderr, "neuroctl generate: %s\n", rx->msg.u.job_status.message);
            gen_rerun(rx, tok, ids, count);
            job = rx->msg.u.job_status.job_id;
            deadline = nl_mono_s() + r->timeout_ms / 1e3;
        }
        if (rx->msg.type != NL_MSG_TOKEN)
            continue;
        job = rx->msg.u.token.job_id;
        deadline = nl_mono_s() + r->timeout_ms / 1e3; /* progress */
        for (uint32_t i = 0; i < rx->msg.u.token.ntokens && *count < max_new; i++) {
            const int32_t id = (int32_t)rx->msg.u.token.tokens[i];
            nl_gen_clock_tick(clock);
            ids[(*count)++] = id;
            gen_print(tok, id, *count);
            fflush(stdout);
        }
        if (rx->msg.u.token.done)
            return 0;
    }
}

int nl_cmd_remote_generate(int argc, char **argv)
{
    nl_flag flags[sizeof gen_flags / sizeof *gen_flags];
    memcpy(flags, gen_flags, sizeof flags);
    const char *usage = "neuroctl generate (--cluster DIR | --coordinator EP --key K "
                        "--coordinator-key P) (--prompt-tokens 1,2,3 | --prompt TEXT) "
                        "[--max-new N] [--adapter A] ...";
    for (int i = 1; i < argc; i++)
        if (nl_remote_refuse_node_flag(argv[i]))
            return 2;
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *ptoks = nl_args_get(flags, "prompt-tokens"), *ptext = nl_args_get(flags, "prompt");
    long long max_new = 32, seed = 0;
    double temp = 0.8, top_p = 0.95;
    if (!ptoks == !ptext) {
        fprintf(stderr, "neuroctl generate: give one of --prompt-tokens and --prompt\n\n");
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = nl_args_int(flags, "max-new", 1, 1 << 20, &max_new)) ||
        (rc = nl_args_int(flags, "seed", 0, INT64_MAX, &seed)) ||
        (rc = nl_args_double(flags, "temperature", 0.0, 100.0, &temp)) ||
        (rc = nl_args_double(flags, "top-p", 1e-6, 1.0, &top_p)))
        return rc;
    char abs_adapter[PATH_MAX];
    const char *adapter = adapter_flag(flags, abs_adapter, &rc);
    if (rc)
        return rc;
    nl_error err = {0};
    nl_remote r = {0};
    nl_rx rx;
    nl_rx_init(&rx);
    nl_tokenizer *tok = NULL;
    int32_t *prompt = NULL, *ids = NULL;
    size_t P = 0;
    struct sigaction old_sa;
    bool handler = false;
    int64_t vocab = 0, max_seq = 0;
    int count = 0;
    rc = 1;
    if (nl_remote_open(&r, flags, 60, &err) != NL_OK ||
        remote_tokenizer(&r, &tok, &vocab, &max_seq, &err) != NL_OK)
        goto out;
    if ((rc = gen_prompt(tok, ptext, ptoks, &prompt, &P, &err)))
        goto out;
    rc = 1;
    ids = malloc((size_t)max_new * sizeof *ids);
    nl_wire_param ps[5] = {
        {.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = max_new},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = temp},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = top_p},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = seed},
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = (char *)adapter},
    };
    nl_gen_clock clock;
    nl_gen_clock_start(&clock);
    struct sigaction sa = {.sa_handler = gen_on_sigint, .sa_flags = SA_RESETHAND};
    sigemptyset(&sa.sa_mask);
    gen_interrupted = 0;
    handler = sigaction(SIGINT, &sa, &old_sa) == 0;
    if (!ids || nl_remote_submit(&r, NL_JOB_GENERATE, ps, adapter ? 5 : 4, prompt, 1, (int)P,
                                 &err) != NL_OK)
        goto out;
    if ((rc = gen_receive(&r, &rx, ptext ? tok : NULL, ids, max_new, &count, &clock, &err)))
        goto out;
    printf("\n");
    fflush(stdout);
    if (count < max_new)
        fprintf(stderr,
                "generate: stopped after %d of --max-new %lld tokens: with the prompt's %zu they "
                "reach the model's max_seq_len %lld\n",
                count, max_new, P, (long long)max_seq);
    nl_gen_clock_report(&clock);
    char *text = NULL;
    size_t tlen = 0;
    if (!ptext && tok && nl_tokenizer_vocab_size(tok) >= vocab &&
        nl_tokenizer_decode(tok, ids, (size_t)count, &text, &tlen, &err) == NL_OK) {
        fwrite(text, 1, tlen, stdout);
        printf("\n");
    }
    free(text);
    rc = 0;
out:
    if (handler)
        sigaction(SIGINT, &old_sa, NULL);
    if (rc && count)
        printf("\n");
    nl_rx_free(&rx);
    nl_remote_close(&r);
    nl_tokenizer_destroy(&tok);
    free(prompt);
    free(ids);
    if (rc == 1)
        fprintf(stderr, "neuroctl generate: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}

/* ---------------------------------------------------------------- status */

/* The last growth of the model (issue 16), if it grew since the
 * coordinator started. */
static void print_growth(const json_t *g)
{
    if (!json_is_object(g))
        return;
    const json_t *from = json_object_get(g, "from"), *to = json_object_get(g, "to");
    const char *keys[] = {"vocab_size", "num_layers", "hidden_dim", "ffn_dim"};
    const char *names[] = {"vocab", "L", "d", "F"};
    printf("last growth: %s at step %lld:", json_string_value(json_object_get(g, "kind")),
           (long long)json_integer_value(json_object_get(g, "step")));
    int any = 0;
    for (int i = 0; i < 4; i++) {
        const json_int_t a = json_integer_value(json_object_get(from, keys[i]));
        const json_int_t b = json_integer_value(json_object_get(to, keys[i]));
        if (a != b)
            printf("%s %s %lld -> %lld", any++ ? "," : "", names[i], (long long)a, (long long)b);
    }
    printf("%s (%.2f s; %lld since the coordinator started)\n", any ? "" : " the tokenizer only",
           json_number_value(json_object_get(g, "seconds")),
           (long long)json_integer_value(json_object_get(g, "count")));
}

/* What each node did as a verifier of other stages' work (docs/security.md,
 * "Catching a node that computes wrong"): only when some node did any. */
static void print_verifiers(const json_t *nodes)
{
    size_t i;
    const json_t *n;
    int any = 0;
    json_array_foreach(nodes, i, n)
    {
        const json_int_t cases = json_integer_value(json_object_get(n, "verify_cases")),
                         bytes = json_integer_value(json_object_get(n, "verify_bytes"));
        if (!cases && !bytes)
            continue;
        if (!any++)
            printf("verifiers: %-4s %8s %10s %10s %10s\n", "node", "cases", "mismatches", "seconds",
                   "MB sent");
        printf("           %-4lld %8lld %10lld %10.2f %10.1f\n",
               json_integer_value(json_object_get(n, "id")), (long long)cases,
               json_integer_value(json_object_get(n, "verify_mismatches")),
               json_number_value(json_object_get(n, "verify_s")), (double)bytes / 1e6);
    }
}

/* The keys banned for computing wrong (docs/security.md), each with why. */
static void print_bans(const json_t *st)
{
    const json_t *bans = json_object_get(st, "banned"), *b;
    const json_int_t n = json_integer_value(json_object_get(st, "banned_keys"));
    size_t i;
    if (!n)
        return;
    printf("banned keys: %lld\n", (long long)n);
    json_array_foreach(bans, i, b)
    {
        char why[400];
        snprintf(why, sizeof why, "%s", json_string_value(json_object_get(b, "why")));
        for (char *p = why; *p; p++) /* the coordinator's text: nothing that drives a terminal */
            if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
                *p = '?';
        printf("  %s  %s\n", json_string_value(json_object_get(b, "key")), why);
    }
}

int nl_cmd_status(int argc, char **argv)
{
    nl_flag flags[] = {
        {"json", 0, "print the coordinator's JSON as it is", NULL}, NL_REMOTE_FLAGS, {0}};
    const char *usage =
        "neuroctl status (--cluster DIR | --coordinator EP --key K --coordinator-key P) [--json]\n"
        "  layers: [first,last) of the model's layers on the node; +e: it also holds the token\n"
        "  embedding, +h: the output head";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    nl_error err = {0};
    json_t *st = NULL;
    if (nl_remote_status_once(flags, &st, &err) != NL_OK) {
        fprintf(stderr, "neuroctl status: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    if (nl_args_get(flags, "json")) {
        json_object_del(st, "tokenizer");
        char *s = json_dumps(st, JSON_INDENT(2));
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(st);
        return 0;
    }
    printf("cluster: %s\n", json_string_value(json_object_get(st, "state")));
    json_t *cfg = json_object_get(st, "config");
    if (cfg)
        printf("model: d=%lld L=%lld H=%lld G=%lld F=%lld E=%lld vocab %lld\n",
               json_integer_value(json_object_get(cfg, "hidden_dim")),
               json_integer_value(json_object_get(cfg, "num_layers")),
               json_integer_value(json_object_get(cfg, "num_heads")),
               json_integer_value(json_object_get(cfg, "num_kv_heads")),
               json_integer_value(json_object_get(cfg, "ffn_dim")),
               json_integer_value(json_object_get(cfg, "num_experts")),
               json_integer_value(json_object_get(cfg, "vocab_size")));
    print_growth(json_object_get(st, "growth"));
    printf("%-4s %-8s %-10s %9s %9s %-11s %8s %10s %9s\n", "node", "state", "device", "memory",
           "planned", "layers", "GFLOP/s", "stage ms", "heartbeat");
    size_t i;
    json_t *n;
    json_array_foreach(json_object_get(st, "nodes"), i, n)
    {
        char layers[48] = "-", planned[32] = "-", pred[32] = "-";
        json_t *l = json_object_get(n, "layers");
        if (json_is_array(l))
            nl_plan_range_str(layers, sizeof layers, (int)json_integer_value(json_array_get(l, 0)),
                              (int)json_integer_value(json_array_get(l, 1)),
                              json_is_true(json_object_get(n, "embed")),
                              json_is_true(json_object_get(n, "head")));
        if (json_object_get(n, "replicas")) { /* one of the stage's replicas: r/R */
            const size_t used = strlen(layers);
            snprintf(layers + used, sizeof layers - used, " r%lld/%lld",
                     json_integer_value(json_object_get(n, "replica")),
                     json_integer_value(json_object_get(n, "replicas")));
        }
        if (json_object_get(n, "memory_planned"))
            snprintf(planned, sizeof planned, "%.0fM",
                     (double)json_integer_value(json_object_get(n, "memory_planned")) / (1 << 20));
        if (json_object_get(n, "predicted_s"))
            snprintf(pred, sizeof pred, "%.2f",
                     json_real_value(json_object_get(n, "predicted_s")) * 1e3);
        printf("%-4lld %-8s %-10s %8.0fM %9s %-11s %8.1f %10s %8.1fs\n",
               json_integer_value(json_object_get(n, "id")),
               json_string_value(json_object_get(n, "state")),
               json_string_value(json_object_get(n, "device")),
               (double)json_integer_value(json_object_get(n, "memory")) / (1 << 20), planned,
               layers, json_real_value(json_object_get(n, "gflops")), pred,
               json_real_value(json_object_get(n, "heartbeat_age_s")));
    }
    printf("(layers [a,b): the node holds layers a..b-1; +e the embedding, +h the output head)\n");
    json_t *reps = json_object_get(st, "replicas");
    if (reps) { /* DESIGN section 8: R_s, stage by stage */
        json_t *counts = json_object_get(reps, "stages");
        const long long r0 = json_integer_value(json_object_get(reps, "per_stage"));
        char list[256];
        snprintf(list, sizeof list, "%lld", r0); /* one number when every stage has as many */
        int uneven = 0;
        for (size_t k = 0; json_is_array(counts) && k < json_array_size(counts); k++)
            uneven |= json_integer_value(json_array_get(counts, k)) != r0;
        for (size_t k = 0, o = 0; uneven && k < json_array_size(counts) && o < sizeof list; k++) {
            const int w = snprintf(list + o, sizeof list - o, "%s%lld", k ? "," : "",
                                   json_integer_value(json_array_get(counts, k)));
            o += w > 0 ? (size_t)w : 0;
        }
        printf("replicas: %s per stage (r/R: replica r of the stage's R); %s\n", list,
               json_string_value(json_object_get(reps, "why")));
    }
    json_t *b = json_object_get(st, "bottleneck_s"),
           *tb = json_object_get(st, "train_bottleneck_s");
    if (b)
        printf("predicted bottleneck: %.2f ms per request (stage ms: the same, per stage)\n",
               json_real_value(b) * 1e3);
    if (tb) /* the plan was made during a training job, for its microbatches */
        printf("this plan was made for training: %.2f ms per training microbatch (forward and "
               "backward)\n",
               json_real_value(tb) * 1e3);
    print_verifiers(json_object_get(st, "nodes"));
    print_bans(st);
    json_decref(st);
    return 0;
}

/* ---------------------------------------------------------------- readiness */

int nl_remote_wait_ready(const char *dir, int timeout_s, char *state, size_t cap, int *nodes)
{
    const double deadline = nl_mono_s() + timeout_s;
    nl_flag flags[] = {{"cluster", 1, "", dir}, {"timeout", 1, "", "5"}, NL_REMOTE_FLAGS, {0}};
    if (nodes)
        *nodes = -1;
    while (nl_mono_s() < deadline) {
        json_t *st = NULL;
        nl_error err = {0};
        if (nl_remote_status_once(flags, &st, &err) == NL_OK) {
            snprintf(state, cap, "%s", json_string_value(json_object_get(st, "state")));
            if (nodes)
                *nodes = (int)json_array_size(json_object_get(st, "nodes"));
            int ready = json_is_true(json_object_get(st, "ready"));
            json_decref(st);
            if (ready)
                return 0;
        } else {
            snprintf(state, cap, "%s", err.msg);
        }
        struct timespec ts = {0, 200000000L};
        nanosleep(&ts, NULL);
    }
    return -1;
}
