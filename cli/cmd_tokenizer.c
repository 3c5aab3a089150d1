/* neuroctl tokenizer: train, learn, encode, decode and inspect BPE
 * tokenizer files (core/tokenizer/tokenizer.h, docs/tokenizer.md). */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/args.h"
#include "cli/commands.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/tokenizer/tokenizer.h"

/* Each input file (or stdin) is read whole, up to this size. */
#define MAX_INPUT_BYTES ((size_t)1 << 30)
/* Encoding works through the input in pieces of about this many bytes,
 * cut where the pre-tokenizer would cut anyway. */
#define ENCODE_CHUNK ((size_t)16 << 20)
/* Decoding turns this many ids into bytes at a time. */
#define DECODE_CHUNK 65536
#define IDS_PER_LINE 32

static const char *const usage_text =
    "usage: neuroctl tokenizer COMMAND [options]\n"
    "\n"
    "  train  --input FILE... --vocab-size N --out TOK [--min-count K] [--quiet] [--force]\n"
    "         learn a new tokenizer of up to N ids (N >= 259) from the files\n"
    "  learn  --tokenizer TOK --input FILE... --add N [--out OUT [--force]] [--min-count K]\n"
    "         [--quiet]: add up to N merges learned from the files; rewrites TOK (or\n"
    "         writes OUT)\n"
    "  learn  (--cluster DIR | --coordinator EP ...) --input FILE --add N [--out TOK]\n"
    "         the cluster's tokenizer learns N more ids and its model's tables grow\n"
    "         with it (docs/cluster.md, \"Growth\")\n"
    "  encode --tokenizer TOK [--input FILE] [--output FILE]\n"
    "         bytes in, token ids out as whitespace-separated decimal text\n"
    "  decode --tokenizer TOK [--input FILE] [--output FILE] [--strict]\n"
    "         ids (decimal, whitespace-separated) in, bytes out; --strict refuses\n"
    "         the special ids (256..258; an imported tokenizer's added tokens), which\n"
    "         otherwise decode to their names\n"
    "  info   --tokenizer TOK\n"
    "         vocabulary size, merges, longest token, the split's classes (unicode,\n"
    "         or bytes: a version 1 file) and the id layout (native, or imported)\n"
    "\n"
    "TOK is a tokenizer file, or a checkpoint (.safetensors) that carries one (read\n"
    "only: learn writes a file). Input and output default to stdin and stdout ('-'\n"
    "names them too). Each input\n"
    "is read whole, up to 1 GiB. Output files are written atomically. --min-count K\n"
    "stops learning when the most frequent pair occurs fewer than K times\n"
    "(default 2). An existing --out is replaced only with --force. Progress goes to\n"
    "stderr. Exit status: 0 ok, 1 failure, 2 usage.\n";

typedef struct opts {
    const char *sub;
    const char **inputs;
    int n_inputs;
    const char *tokenizer, *out, *output;
    long long vocab_size, add, min_count;
    int quiet, strict, help, force;
} opts;

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "neuroctl tokenizer: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see neuroctl tokenizer --help)\n");
    return 2;
}

static int parse_count(const char *s, long long lo, long long hi, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* Parse the options after the subcommand. Returns 0, or the exit code 2. */
static int parse_opts(int argc, char **argv, opts *o)
{
    o->vocab_size = o->add = -1;
    o->min_count = 2;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            o->help = 1;
        } else if (strcmp(a, "--force") == 0) {
            o->force = 1;
        } else if (strcmp(a, "--quiet") == 0) {
            o->quiet = 1;
        } else if (strcmp(a, "--strict") == 0) {
            o->strict = 1;
        } else if (strcmp(a, "--input") == 0) {
            o->inputs = (const char **)argv + i + 1;
            o->n_inputs = 0;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                o->n_inputs++;
                i++;
            }
            if (o->n_inputs == 0)
                return usage_error("%s needs at least one file", a);
        } else if (!has_val && (strcmp(a, "--tokenizer") == 0 || strcmp(a, "--out") == 0 ||
                                strcmp(a, "--output") == 0 || strcmp(a, "--vocab-size") == 0 ||
                                strcmp(a, "--add") == 0 || strcmp(a, "--min-count") == 0)) {
            return usage_error("%s needs a value", a);
        } else if (strcmp(a, "--tokenizer") == 0) {
            o->tokenizer = argv[++i];
        } else if (strcmp(a, "--out") == 0) {
            o->out = argv[++i];
        } else if (strcmp(a, "--output") == 0) {
            o->output = argv[++i];
        } else if (strcmp(a, "--vocab-size") == 0) {
            if (parse_count(argv[++i], NL_TOKEN_FIRST_MERGE, NL_TOKENIZER_MAX_IDS,
                            &o->vocab_size) != 0)
                return usage_error("--vocab-size '%s' is not a number in 259..2147483647", argv[i]);
        } else if (strcmp(a, "--add") == 0) {
            if (parse_count(argv[++i], 0, NL_TOKENIZER_MAX_IDS, &o->add) != 0)
                return usage_error("--add '%s' is not a number in 0..2147483647", argv[i]);
        } else if (strcmp(a, "--min-count") == 0) {
            if (parse_count(argv[++i], 1, LLONG_MAX, &o->min_count) != 0)
                return usage_error("--min-count '%s' is not a positive number", argv[i]);
        } else {
            /* the options above, for a suggestion (base/args) */
            static const nl_flag known[] = {
                {"help", 0, NULL, NULL},       {"force", 0, NULL, NULL},
                {"quiet", 0, NULL, NULL},      {"strict", 0, NULL, NULL},
                {"input", 1, NULL, NULL},      {"tokenizer", 1, NULL, NULL},
                {"out", 1, NULL, NULL},        {"output", 1, NULL, NULL},
                {"vocab-size", 1, NULL, NULL}, {"add", 1, NULL, NULL},
                {"min-count", 1, NULL, NULL},  {0}};
            const char *near = strncmp(a, "--", 2) == 0 ? nl_args_suggest(known, a + 2) : NULL;
            if (near)
                return usage_error("unknown option '%s': did you mean --%s?", a, near);
            return usage_error("unknown option '%s'", a);
        }
    }
    return 0;
}

/* ---- input and output ---- */

/* Read a whole file ("-" or NULL: stdin), at most MAX_INPUT_BYTES. Works
 * on pipes too, so it does not trust the file's size. */
static nl_status read_input(const char *path, char **out, size_t *len, nl_error *err)
{
    int is_stdin = !path || strcmp(path, "-") == 0;
    const char *name = is_stdin ? "stdin" : path;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    char *buf = NULL;
    size_t n = 0, cap = 0;
    nl_status st = NL_OK;
    *out = NULL;
    *len = 0;
    if (!f)
        return nl_error_set(err, NL_ERR_IO, "%s: cannot open: %s", name, strerror(errno));
    for (;;) {
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 1 << 16;
            if (ncap > MAX_INPUT_BYTES + 1)
                ncap = MAX_INPUT_BYTES + 1;
            char *b = ncap > cap ? realloc(buf, ncap + 1) : NULL;
            if (!b) {
                st = ncap > cap
                         ? nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", name)
                         : nl_error_set(err, NL_ERR_LIMIT, "%s: larger than the limit of %zu bytes",
                                        name, MAX_INPUT_BYTES);
                break;
            }
            buf = b;
            cap = ncap;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n > MAX_INPUT_BYTES) {
            st = nl_error_set(err, NL_ERR_LIMIT, "%s: larger than the limit of %zu bytes", name,
                              MAX_INPUT_BYTES);
            break;
        }
        if (r == 0) {
            if (ferror(f))
                st = nl_error_set(err, NL_ERR_IO, "%s: read failed: %s", name, strerror(errno));
            break;
        }
    }
    if (!is_stdin)
        fclose(f);
    if (st != NL_OK) {
        free(buf);
        return st;
    }
    if (!buf && !(buf = malloc(1)))
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", name);
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return NL_OK;
}

/* Output to stdout or, atomically, to a file, through a buffer. */
typedef struct writer {
    nl_atomic_file *af;
    const char *name;
    char buf[1 << 16];
    size_t n;
} writer;

static nl_status writer_open(writer *w, const char *path, nl_error *err)
{
    w->n = 0;
    w->af = NULL;
    w->name = "stdout";
    if (!path || strcmp(path, "-") == 0)
        return NL_OK;
    w->name = path;
    return nl_atomic_open(&w->af, path, err);
}

static nl_status writer_flush(writer *w, nl_error *err)
{
    nl_status st = NL_OK;
    if (w->af)
        st = nl_atomic_write(w->af, w->buf, w->n, err);
    else if (w->n && fwrite(w->buf, 1, w->n, stdout) != w->n)
        st = nl_error_set(err, NL_ERR_IO, "stdout: write failed: %s", strerror(errno));
    w->n = 0;
    return st;
}

static nl_status writer_put(writer *w, const void *p, size_t n, nl_error *err)
{
    const char *s = p;
    while (n > 0) {
        if (w->n == sizeof w->buf) {
            nl_status st = writer_flush(w, err);
            if (st != NL_OK)
                return st;
        }
        size_t k = sizeof w->buf - w->n < n ? sizeof w->buf - w->n : n;
        memcpy(w->buf + w->n, s, k);
        w->n += k;
        s += k;
        n -= k;
    }
    return NL_OK;
}

/* Flush and commit (or, on failure, drop the temporary file). */
static nl_status writer_close(writer *w, nl_status st, nl_error *err)
{
    if (st == NL_OK)
        st = writer_flush(w, err);
    if (!w->af) {
        if (st == NL_OK && fflush(stdout) != 0)
            st = nl_error_set(err, NL_ERR_IO, "stdout: write failed: %s", strerror(errno));
        return st;
    }
    if (st != NL_OK) {
        nl_atomic_abort(&w->af);
        return st;
    }
    return nl_atomic_commit(&w->af, err);
}

/* ---- train and learn ---- */

typedef struct progress {
    struct timespec t0;
    double last;
    int quiet;
} progress;

static double seconds_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + 1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}

static void on_progress(void *ctx, int32_t done, int32_t target)
{
    progress *p = ctx;
    double s = seconds_since(&p->t0);
    if (p->quiet || s - p->last < 1.0)
        return;
    p->last = s;
    fprintf(stderr, "tokenizer: %d/%d merges, %.0f merges/s\n", done, target,
            s > 0 ? done / s : 0.0);
}

/* Count the words of every input file. */
static nl_status read_corpus(const opts *o, nl_tokenizer_split mode, nl_bpe_corpus **out,
                             nl_error *err)
{
    nl_status st = nl_bpe_corpus_new(out, mode, err);
    for (int i = 0; i < o->n_inputs && st == NL_OK; i++) {
        char *buf = NULL;
        size_t len = 0;
        st = read_input(o->inputs[i], &buf, &len, err);
        if (st == NL_OK)
            st = nl_bpe_corpus_add(*out, buf, len, err);
        free(buf);
        if (st == NL_OK && !o->quiet)
            fprintf(stderr, "tokenizer: read %s (%zu bytes), %zu unique words so far\n",
                    o->inputs[i], len, nl_bpe_corpus_unique_words(*out));
    }
    if (st != NL_OK)
        nl_bpe_corpus_destroy(out);
    return st;
}

/* --tokenizer: a tokenizer file, or a checkpoint (.safetensors) that
 * carries one (e.g. one `neuroctl import --hf` wrote). */
static nl_status load_tokenizer(const char *path, nl_tokenizer **t, nl_error *err)
{
    size_t n = strlen(path);
    if (n < 12 || strcmp(path + n - 12, ".safetensors") != 0)
        return nl_tokenizer_load(t, path, err);
    nl_status st = nl_checkpoint_tokenizer(path, t, err);
    if (st == NL_OK && !*t)
        st = nl_error_set(err, NL_ERR_NOTFOUND, "%s: the checkpoint carries no tokenizer", path);
    return st;
}

static nl_status learn_and_save(const opts *o, nl_tokenizer *t, int32_t add, const char *path,
                                nl_error *err)
{
    nl_bpe_corpus *c = NULL;
    progress p = {.quiet = o->quiet};
    nl_tokenizer_train_opts to = nl_tokenizer_train_opts_default();
    to.min_count = o->min_count;
    to.progress = on_progress;
    to.progress_ctx = &p;
    int32_t before = nl_tokenizer_vocab_size(t);
    nl_status st = read_corpus(o, nl_tokenizer_split_mode(t), &c, err);
    if (st != NL_OK)
        return st;
    clock_gettime(CLOCK_MONOTONIC, &p.t0);
    st = nl_tokenizer_learn_corpus(t, c, add, &to, err);
    nl_bpe_corpus_destroy(&c);
    if (st != NL_OK)
        return st;
    double s = seconds_since(&p.t0);
    int32_t added = nl_tokenizer_vocab_size(t) - before;
    if (!o->quiet)
        fprintf(stderr, "tokenizer: %d merges added in %.2f s (%d asked), vocabulary %d\n", added,
                s, add, nl_tokenizer_vocab_size(t));
    return nl_tokenizer_save(t, path, err);
}

/* --out names an existing file and --force is not given: say so. */
static int out_exists(const opts *o)
{
    struct stat sb;
    if (o->force || lstat(o->out, &sb) != 0)
        return 0;
    fprintf(stderr, "neuroctl tokenizer: --out %s: the file exists (give --force to replace it)\n",
            o->out);
    return 1;
}

static int cmd_train(const opts *o, nl_error *err)
{
    if (o->n_inputs == 0 || o->vocab_size < 0 || !o->out)
        return usage_error("%s needs --input, --vocab-size and --out", "train");
    if (out_exists(o))
        return 1;
    nl_tokenizer *t = NULL;
    nl_status st = nl_tokenizer_new_bytes(&t, err);
    if (st == NL_OK)
        st = learn_and_save(o, t, (int32_t)(o->vocab_size - NL_TOKEN_FIRST_MERGE), o->out, err);
    nl_tokenizer_destroy(&t);
    return st == NL_OK ? 0 : 1;
}

static int cmd_learn(const opts *o, nl_error *err)
{
    if (o->n_inputs == 0 || o->add < 0 || !o->tokenizer)
        return usage_error("%s needs --tokenizer, --input and --add", "learn");
    if (o->out && out_exists(o))
        return 1;
    nl_tokenizer *t = NULL;
    nl_status st = load_tokenizer(o->tokenizer, &t, err);
    if (st == NL_OK)
        st = learn_and_save(o, t, (int32_t)o->add, o->out ? o->out : o->tokenizer, err);
    nl_tokenizer_destroy(&t);
    return st == NL_OK ? 0 : 1;
}

/* ---- encode and decode ---- */

static nl_status write_ids(writer *w, const int32_t *ids, size_t n, size_t *col, nl_error *err)
{
    nl_status st = NL_OK;
    char num[16];
    for (size_t i = 0; i < n && st == NL_OK; i++) {
        int k = snprintf(num, sizeof num, "%d%c", ids[i], ++*col % IDS_PER_LINE ? ' ' : '\n');
        st = writer_put(w, num, (size_t)k, err);
    }
    return st;
}

static nl_status encode_text(nl_tokenizer *t, const char *s, size_t len, writer *w, nl_error *err)
{
    int32_t *ids = NULL;
    size_t cap = 0, col = 0;
    nl_status st = NL_OK;
    for (size_t off = 0; off < len && st == NL_OK;) {
        size_t max = ENCODE_CHUNK, p;
        while ((p = nl_tokenizer_safe_split(nl_tokenizer_split_mode(t), s + off, len - off, max)) ==
               0)
            max *= 2; /* one word longer than a chunk */
        if (p > cap) {
            free(ids);
            cap = p;
            if (!(ids = malloc(cap * sizeof *ids))) {
                st = nl_error_set(err, NL_ERR_NOMEM, "out of memory for %zu ids", cap);
                break;
            }
        }
        size_t n = 0;
        st = nl_tokenizer_encode_into(t, s + off, p, ids, cap, &n, err);
        if (st == NL_OK)
            st = write_ids(w, ids, n, &col, err);
        off += p;
    }
    if (st == NL_OK && col % IDS_PER_LINE)
        st = writer_put(w, "\n", 1, err);
    free(ids);
    return st;
}

static int is_space(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* Parse decimal ids separated by whitespace, decoding every DECODE_CHUNK. */
static nl_status decode_text(const nl_tokenizer *t, const opts *o, const char *s, size_t len,
                             writer *w, nl_error *err)
{
    const char *name = o->n_inputs ? o->inputs[0] : "stdin";
    int32_t vocab = nl_tokenizer_vocab_size(t);
    int32_t *ids = malloc(DECODE_CHUNK * sizeof *ids);
    size_t n = 0, line = 1, pos = 0;
    unsigned flags = o->strict ? NL_TOKENIZER_DECODE_STRICT : 0;
    nl_status st = ids ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    while (st == NL_OK) {
        while (pos < len && is_space(s[pos]))
            line += s[pos++] == '\n';
        if (n == DECODE_CHUNK || (pos == len && n > 0)) {
            char *bytes = NULL;
            size_t bl = 0;
            st = nl_tokenizer_decode_flags(t, ids, n, flags, &bytes, &bl, err);
            if (st == NL_OK)
                st = writer_put(w, bytes, bl, err);
            free(bytes);
            n = 0;
            continue;
        }
        if (pos == len)
            break;
        size_t start = pos;
        long long v = 0;
        for (; pos < len && s[pos] >= '0' && s[pos] <= '9'; pos++)
            v = v > NL_TOKENIZER_MAX_IDS ? v : v * 10 + (s[pos] - '0');
        if (pos == start || (pos < len && !is_space(s[pos]))) {
            unsigned char c = (unsigned char)s[pos];
            char what[16];
            snprintf(what, sizeof what, c > 0x20 && c < 0x7F ? "'%c'" : "byte 0x%02x", c);
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "%s line %zu, offset %zu: expected a token id, found %s", name, line,
                              pos, what);
        } else if (v >= vocab) {
            st = nl_error_set(err, NL_ERR_RANGE,
                              "%s line %zu, offset %zu: id %.*s%s is not in the vocabulary "
                              "(ids 0..%d)",
                              name, line, start, (int)(pos - start > 20 ? 20 : pos - start),
                              s + start, pos - start > 20 ? "..." : "", vocab - 1);
        } else if (o->strict && nl_tokenizer_is_special(t, (int32_t)v)) {
            st = nl_error_set(err, NL_ERR_RANGE,
                              "%s line %zu, offset %zu: special id %lld refused (--strict)", name,
                              line, start, v);
        } else {
            ids[n++] = (int32_t)v;
        }
    }
    free(ids);
    return st;
}

static int cmd_code(const opts *o, int encode, nl_error *err)
{
    if (!o->tokenizer)
        return usage_error("%s needs --tokenizer", encode ? "encode" : "decode");
    if (o->n_inputs > 1)
        return usage_error("%s reads one --input", encode ? "encode" : "decode");
    nl_tokenizer *t = NULL;
    char *text = NULL;
    size_t len = 0;
    writer *w = malloc(sizeof *w);
    nl_status st = w ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st == NL_OK)
        st = load_tokenizer(o->tokenizer, &t, err);
    if (st == NL_OK)
        st = read_input(o->n_inputs ? o->inputs[0] : NULL, &text, &len, err);
    if (st == NL_OK && (st = writer_open(w, o->output, err)) == NL_OK) {
        if (encode)
            st = encode_text(t, text, len, w, err);
        else
            st = decode_text(t, o, text, len, w, err);
        st = writer_close(w, st, err);
    }
    free(text);
    free(w);
    nl_tokenizer_destroy(&t);
    return st == NL_OK ? 0 : 1;
}

static int cmd_info(const opts *o, nl_error *err)
{
    if (!o->tokenizer)
        return usage_error("%s needs --tokenizer", "info");
    nl_tokenizer *t = NULL;
    if (load_tokenizer(o->tokenizer, &t, err) != NL_OK)
        return 1;
    size_t longest = 0;
    int32_t longest_id = 0;
    for (int32_t id = 0; id < nl_tokenizer_vocab_size(t); id++) {
        const uint8_t *p;
        size_t l;
        nl_tokenizer_token_bytes(t, id, &p, &l);
        if (!nl_tokenizer_is_special(t, id) && l > longest) {
            longest = l;
            longest_id = id;
        }
    }
    printf("vocab_size %d\nmerges %d\nlongest_token %zu (id %d)\nsplit %s\nids %s\n",
           nl_tokenizer_vocab_size(t), nl_tokenizer_num_merges(t), longest, longest_id,
           nl_tokenizer_split_mode(t) == NL_TOKENIZER_SPLIT_BYTES ? "bytes" : "unicode",
           nl_tokenizer_is_native(t) ? "native" : "explicit (imported)");
    nl_tokenizer_destroy(&t);
    return 0;
}

int nl_cmd_tokenizer(int argc, char **argv)
{
    opts o = {0};
    nl_error err = {0};
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fputs(usage_text, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    o.sub = argv[1];
    int rc = parse_opts(argc, argv, &o);
    if (rc != 0)
        return rc;
    if (o.help) {
        fputs(usage_text, stdout);
        return 0;
    }
    if (strcmp(o.sub, "train") == 0)
        rc = cmd_train(&o, &err);
    else if (strcmp(o.sub, "learn") == 0)
        rc = cmd_learn(&o, &err);
    else if (strcmp(o.sub, "encode") == 0)
        rc = cmd_code(&o, 1, &err);
    else if (strcmp(o.sub, "decode") == 0)
        rc = cmd_code(&o, 0, &err);
    else if (strcmp(o.sub, "info") == 0)
        rc = cmd_info(&o, &err);
    else
        return usage_error("unknown command '%s'", o.sub);
    if (rc == 1 && err.status != NL_OK) /* else the refusal was said already (out_exists) */
        fprintf(stderr, "neuroctl tokenizer %s: %s (%s)\n", o.sub, err.msg,
                nl_status_str(err.status));
    return rc;
}
