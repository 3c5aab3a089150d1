/* Growth of a cluster's model from neuroctl (issue 16): `neuroctl
 * tokenizer learn --cluster DIR --input FILE --add N` teaches the
 * cluster's tokenizer N more ids from a text file and grows the model's
 * tables when the vocabulary passes their capacity. The client sends one
 * JOB_SUBMIT (kind grow) and follows its JOB_STATUS messages; the
 * coordinator does the work (coordinator/coord_grow.c, docs/cluster.md,
 * "Growth"). */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "cli/remote.h"
#include "core/formats/fileio.h"

/* Print a growth event (the coordinator's JSON frame) in one line. */
static void print_growth(const nl_rx *rx)
{
    const nl_wire_frame *f = rx->msg.nframes == 1 ? &rx->msg.frames[0] : NULL;
    json_t *o = f && f->t.dtype == NL_DTYPE_U8
                    ? json_loadb((const char *)f->t.data, (size_t)f->len, 0, NULL)
                    : NULL;
    json_t *from = json_object_get(o, "from"), *to = json_object_get(o, "to");
    const char *keys[] = {"vocab_size", "num_layers", "hidden_dim", "ffn_dim"};
    const char *names[] = {"vocabulary", "layers", "hidden_dim", "ffn_dim"};
    if (from && to) {
        fprintf(stderr, "grew the model at step %lld:",
                (long long)json_integer_value(json_object_get(o, "step")));
        int any = 0;
        for (int i = 0; i < 4; i++) {
            const json_int_t x = json_integer_value(json_object_get(from, keys[i]));
            const json_int_t y = json_integer_value(json_object_get(to, keys[i]));
            if (x != y)
                fprintf(stderr, "%s %s %lld -> %lld", any++ ? "," : "", names[i], (long long)x,
                        (long long)y);
        }
        if (json_object_get(o, "tokenizer_to"))
            fprintf(stderr, " (tokenizer %lld -> %lld ids)",
                    (long long)json_integer_value(json_object_get(o, "tokenizer_from")),
                    (long long)json_integer_value(json_object_get(o, "tokenizer_to")));
        fprintf(stderr, " in %.2f s\n", json_number_value(json_object_get(o, "seconds")));
    }
    json_t *mf = json_object_get(o, "manifest");
    if (json_is_string(mf))
        fprintf(stderr, "the cluster's model is now %s\n", json_string_value(mf));
    json_decref(o);
}

/* Submit a grow job and follow it to its end. */
static nl_status run_grow(nl_remote *r, const nl_wire_param *ps, int np, nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    nl_status st = nl_remote_submit(r, NL_JOB_GROW, ps, np, NULL, 0, 0, err);
    const double deadline = nl_mono_s() + r->timeout_ms / 1e3;
    while (st == NL_OK && (st = nl_remote_recv(r, &rx, deadline, err)) == NL_OK) {
        if (nl_client_job_failed(&rx, err)) {
            st = err->status ? err->status : NL_ERR_STATE;
            break;
        }
        if (rx.msg.type != NL_MSG_JOB_STATUS)
            continue;
        if (rx.msg.nframes == 1 && rx.msg.u.job_status.state == NL_JOB_RUNNING)
            print_growth(&rx);
        if (rx.msg.u.job_status.state == NL_JOB_DONE)
            break;
    }
    nl_rx_free(&rx);
    return st;
}

/* --out: the cluster's tokenizer, as it is now, into a file. */
static nl_status save_tokenizer(nl_remote *r, const char *out, nl_error *err)
{
    json_t *st = NULL;
    nl_status s = nl_remote_status(r, &st, err);
    json_t *tok = json_object_get(st, "tokenizer");
    if (s == NL_OK && !json_is_string(tok))
        s = nl_error_set(err, NL_ERR_NOTFOUND, "the cluster reports no tokenizer");
    if (s == NL_OK)
        s = nl_file_write_atomic(out, json_string_value(tok), json_string_length(tok), err);
    json_decref(st);
    return s;
}

int nl_cmd_remote_tokenizer_learn(int argc, char **argv)
{
    nl_flag flags[] = {
        {"input", 1, "text to learn from, on a filesystem the coordinator shares", NULL},
        {"add", 1, "ids to learn (at most)", NULL},
        {"out", 1, "write the cluster's grown tokenizer to this file too", NULL},
        NL_REMOTE_FLAGS_TIMEOUT("seconds to wait for the growth and reload (default 600)"),
        {0}};
    const char *usage =
        "neuroctl tokenizer learn (--cluster DIR | --coordinator EP --key K --coordinator-key P)\n"
        "    --input FILE --add N [--out TOK]\n"
        "  the cluster's tokenizer learns up to N ids from FILE (a path the coordinator reads,\n"
        "  under its --data-root); when the vocabulary passes the tables' capacity, the\n"
        "  embedding and head grow by whole vocab_chunks (old ids keep their logits) and the\n"
        "  stages reload. Between jobs only, and only when the stages hold a checkpoint's\n"
        "  weights (docs/cluster.md, \"Growth\")";
    /* argv: tokenizer learn ... */
    int rc = nl_args_parse(argc - 1, argv + 1, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    if ((rc = nl_cli_require("tokenizer learn", usage, flags, "input", "add", (const char *)NULL)))
        return rc;
    char *end = NULL;
    errno = 0;
    const long long add = strtoll(nl_args_get(flags, "add"), &end, 10);
    if (errno || !*nl_args_get(flags, "add") || *end || add < 1 || add > (1 << 24)) {
        fprintf(stderr, "neuroctl tokenizer learn: --add: a count from 1 to %d\n", 1 << 24);
        return 2;
    }
    char *input = realpath(nl_args_get(flags, "input"), NULL);
    if (!input) {
        fprintf(stderr, "neuroctl tokenizer learn: --input %s: %s\n", nl_args_get(flags, "input"),
                strerror(errno));
        return 1;
    }
    const nl_wire_param ps[2] = {{.key = "input", .kind = NL_WIRE_PARAM_STR, .s = input},
                                 {.key = "add", .kind = NL_WIRE_PARAM_INT, .i = add}};
    nl_error err = {0};
    nl_remote r = {0};
    const char *out = nl_args_get(flags, "out");
    nl_status st = nl_remote_open(&r, flags, 600, &err);
    if (st == NL_OK)
        st = run_grow(&r, ps, 2, &err);
    if (st == NL_OK && out)
        st = save_tokenizer(&r, out, &err);
    nl_remote_close(&r);
    free(input);
    if (st != NL_OK) {
        fprintf(stderr, "neuroctl tokenizer learn: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    return 0;
}

int nl_cmd_remote_grow(int argc, char **argv)
{
    nl_flag flags[] = {
        {"layers", 1, "grow the depth to N layers (identity blocks appended)", NULL},
        {"hidden-dim", 1, "grow the width to D (whole heads of the same head_dim)", NULL},
        {"ffn-dim", 1, "grow the experts' hidden size to F", NULL},
        NL_REMOTE_FLAGS_TIMEOUT("seconds to wait for the growth and reload (default 600)"),
        {0}};
    const char *usage =
        "neuroctl grow (--cluster DIR | --coordinator EP --key K --coordinator-key P)\n"
        "    [--layers N] [--hidden-dim D [--ffn-dim F]]\n"
        "  the coordinator grows the manifest the stages hold (neuroctl grow's rules: logits\n"
        "  unchanged, new AdamW moments zero) and the stages reload it on a new plan. Between\n"
        "  jobs only, and only when the stages hold a checkpoint's weights (docs/cluster.md,\n"
        "  \"Growth\"). The vocabulary grows with neuroctl tokenizer learn --cluster";
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--model") == 0 || strcmp(argv[i], "--vocab-size") == 0 ||
            strcmp(argv[i], "--manifest") == 0) {
            fprintf(stderr,
                    "neuroctl grow: %s is for a local model; a cluster grows its own "
                    "(--layers, --hidden-dim, --ffn-dim; the vocabulary: neuroctl "
                    "tokenizer learn --cluster)\n",
                    argv[i]);
            return 2;
        }
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    long long v[3] = {0, 0, 0};
    const char *names[3] = {"layers", "hidden-dim", "ffn-dim"};
    const char *keys[3] = {"layers", "hidden_dim", "ffn_dim"};
    nl_wire_param ps[3];
    int n = 0;
    for (int i = 0; i < 3; i++) {
        if (!nl_args_get(flags, names[i]))
            continue;
        if ((rc = nl_args_int(flags, names[i], 1, 1 << 22, &v[i])))
            return rc;
        ps[n++] = (nl_wire_param){.key = keys[i], .kind = NL_WIRE_PARAM_INT, .i = v[i]};
    }
    if (n == 0) {
        fprintf(stderr, "neuroctl grow: give --layers, --hidden-dim or --ffn-dim\n");
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    nl_error err = {0};
    nl_remote r = {0};
    nl_status st = nl_remote_open(&r, flags, 600, &err);
    if (st == NL_OK)
        st = run_grow(&r, ps, n, &err);
    nl_remote_close(&r);
    if (st != NL_OK) {
        fprintf(stderr, "neuroctl grow: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    return 0;
}
