/* Sharded checkpoints (core/formats/manifest): a whole model cut into three stage
 * shards plus a manifest; load and verify; export equals a one-process
 * save byte for byte; stages re-cut across the shard boundaries equal the
 * original's slices (moments too); a flipped byte, a wrong size and a
 * missing shard are refused naming the shard; broken manifests are
 * refused with typed errors naming the field. */
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/manifest.h"
#include "core/formats/safetensors.h"
#include "tests/check.h"

#include <jansson.h>
#include <sys/stat.h>
#include <unistd.h>

#define STEP 12
#define ADAM 7
/* as neuroctl train prints it: jansson would print min_lr as 3e-5 */
#define TRAIN "{\"seed\":5,\"steps\":20,\"lr\":0.0003,\"min_lr\":3e-05,\"warmup\":2}"
#define TOKENIZER "neurollm-bpe 1\nmerges 0\n"

static char dir[256];

/* <dir>/<name> in one of 8 rotating buffers: long-lived paths are copied. */
static const char *at(const char *name)
{
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static nl_config small(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 16;
    c.num_layers = 3;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.ffn_dim = 8;
    c.num_experts = 2;
    c.top_k = 1;
    c.vocab_size = 20;
    c.vocab_chunk = 16;
    nl_config_fill_derived(&c);
    return c;
}

static char *slurp(const char *path, size_t *n)
{
    char *buf = NULL;
    nl_error err = {0};
    CHECK_OK(nl_file_read_all(path, 1 << 26, &buf, n, &err), &err);
    return buf;
}

static void spit(const char *path, const void *buf, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(buf, 1, n, f);
        fclose(f);
    }
}

/* The three stages of the plan under test. */
static const struct {
    int l0, l1, embed, head;
} cut[3] = {{0, 1, 1, 0}, {1, 2, 0, 0}, {2, 3, 0, 1}};

/* Write stage i's shard from the whole checkpoint, as a node would:
 * its tensors and moments, no tokenizer or seed. */
static void write_shard(nl_backend *be, const char *whole, int i, int64_t step, const char *file)
{
    nl_error err = {0};
    nl_model *s = NULL;
    int64_t adam = 0;
    CHECK_OK(nl_checkpoint_load(&s, be, whole, cut[i].l0, cut[i].l1, cut[i].embed, cut[i].head,
                                NULL, &err),
             &err);
    if (!s)
        return;
    float *mm = be->alloc(be, s->n_params * 4), *vv = be->alloc(be, s->n_params * 4);
    CHECK_OK(nl_checkpoint_load_optim(s, whole, mm, vv, &adam, NULL, &err), &err);
    nl_ckpt_extra extra = {.m = mm, .v = vv, .adam_steps = adam, .train_json = TRAIN};
    CHECK_OK(nl_checkpoint_save(s, at(file), step, &extra, &err), &err);
    be->free(be, mm);
    be->free(be, vv);
    nl_model_destroy(&s);
}

static void fill_manifest(nl_manifest *mf, nl_manifest_shard *sh, const nl_config *c)
{
    static char names[3][32], nodes[3][32];
    nl_error err = {0};
    memset(mf, 0, sizeof *mf);
    mf->step = STEP;
    mf->adam_steps = ADAM;
    mf->cfg = *c;
    mf->train_json = TRAIN;
    mf->tokenizer = TOKENIZER;
    mf->init_seed = "9";
    mf->n_shards = 3;
    mf->shards = sh;
    for (int i = 0; i < 3; i++) {
        snprintf(names[i], sizeof names[i], "stage-%d.safetensors", i);
        snprintf(nodes[i], sizeof nodes[i], "node %d", i + 1);
        sh[i] = (nl_manifest_shard){.stage = i,
                                    .l0 = cut[i].l0,
                                    .l1 = cut[i].l1,
                                    .has_embed = cut[i].embed,
                                    .has_head = cut[i].head,
                                    .file = names[i],
                                    .node = nodes[i]};
        CHECK_OK(nl_file_sha256(at(names[i]), sh[i].sha256, &sh[i].bytes, &err), &err);
    }
}

/* ---------------------------------------------------------------- hashes */

static void test_sha256(void)
{
    nl_error err = {0};
    char hex[65];
    uint64_t n = 1;
    spit(at("empty"), "", 0);
    CHECK_OK(nl_file_sha256(at("empty"), hex, &n, &err), &err);
    CHECK(n == 0 &&
              strcmp(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855") == 0,
          "sha256 of nothing: %s", hex);
    spit(at("abc"), "abc", 3);
    CHECK_OK(nl_file_sha256(at("abc"), hex, &n, &err), &err);
    CHECK(n == 3 &&
              strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0,
          "sha256 of abc: %s", hex);
    /* more than one read chunk: 3 MiB + 5 of 'a' */
    size_t big = (3u << 20) + 5;
    char *buf = malloc(big);
    memset(buf, 'a', big);
    spit(at("big"), buf, big);
    free(buf);
    CHECK_OK(nl_file_sha256(at("big"), hex, &n, &err), &err);
    CHECK(n == big && strlen(hex) == 64, "big file: %llu bytes", (unsigned long long)n);
    CHECK(nl_file_sha256(at("nope"), hex, &n, &err) == NL_ERR_NOTFOUND && strstr(err.msg, "nope"),
          "missing file: %s", err.msg);
    CHECK(nl_file_sha256(dir, hex, &n, &err) == NL_ERR_IO, "a directory: %s", err.msg);
}

/* ---------------------------------------------------------------- comparing */

/* Two checkpoint files hold the same tensors (bitwise) and metadata. */
static void same_checkpoint(const char *a, const char *b)
{
    nl_error err = {0};
    nl_st_file *fa = NULL, *fb = NULL;
    CHECK_OK(nl_st_open(&fa, a, &err), &err);
    CHECK_OK(nl_st_open(&fb, b, &err), &err);
    if (!fa || !fb)
        goto out;
    CHECK(nl_st_count(fa) == nl_st_count(fb), "tensor count %zu vs %zu", nl_st_count(fa),
          nl_st_count(fb));
    int bad = 0;
    for (size_t i = 0; i < nl_st_count(fa); i++) {
        const nl_st_entry *e = nl_st_entry_at(fa, i), *g = nl_st_find(fb, e->name);
        if (!g || g->nbytes != e->nbytes || g->ndim != e->ndim ||
            memcmp(g->shape, e->shape, sizeof e->shape) != 0 ||
            memcmp(nl_st_tensor_data(fa, e), nl_st_tensor_data(fb, g), e->nbytes) != 0) {
            if (bad++ < 5)
                CHECK(0, "tensor %s differs", e->name);
        }
    }
    CHECK(bad == 0, "%d tensors differ", bad);
    const char *keys[] = {"format",    "step",      "adam_steps", "config",
                          "tokenizer", "init_seed", "train"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
        const char *x = nl_st_metadata(fa, keys[k]), *y = nl_st_metadata(fb, keys[k]);
        CHECK(x && y && strcmp(x, y) == 0, "metadata %s: '%s' vs '%s'", keys[k], x ? x : "(none)",
              y ? y : "(none)");
    }
    CHECK(nl_st_header_meta_count(nl_st_file_header(fa)) ==
              nl_st_header_meta_count(nl_st_file_header(fb)),
          "metadata key count");
out:
    nl_st_close(&fa);
    nl_st_close(&fb);
}

/* 1 when n floats of device memory at a and b are bit-identical. */
static int same_dev(nl_backend *be, const float *a, const float *b, size_t n)
{
    float *x = check_download(be, a, n), *y = check_download(be, b, n);
    int same = x && y && memcmp(x, y, n * 4) == 0;
    free(x);
    free(y);
    return same;
}

/* A stage re-cut from the manifest equals the same slice of the whole
 * checkpoint, weights and moments. */
static void same_stage(nl_backend *be, const nl_manifest *mf, const char *whole, int l0, int l1,
                       int embed, int head, int moments)
{
    nl_error err = {0};
    nl_model *a = NULL, *b = NULL;
    float *am = NULL, *av = NULL, *bm = NULL, *bv = NULL;
    int64_t adam = 0;
    CHECK_OK(nl_checkpoint_load(&b, be, whole, l0, l1, embed, head, NULL, &err), &err);
    if (!b)
        return;
    const size_t n = b->n_params;
    if (moments) {
        am = be->alloc(be, n * 4);
        av = be->alloc(be, n * 4);
        bm = be->alloc(be, n * 4);
        bv = be->alloc(be, n * 4);
        CHECK_OK(nl_checkpoint_load_optim(b, whole, bm, bv, &adam, NULL, &err), &err);
    }
    CHECK_OK(nl_manifest_load_stage(&a, be, mf, l0, l1, embed, head, am, av, &err), &err);
    CHECK(a && a->n_params == n && same_dev(be, a->params, b->params, n),
          "stage [%d, %d) embed %d head %d: weights", l0, l1, embed, head);
    if (moments)
        CHECK(same_dev(be, am, bm, n) && same_dev(be, av, bv, n),
              "stage [%d, %d) embed %d head %d: moments", l0, l1, embed, head);
    be->free(be, am);
    be->free(be, av);
    be->free(be, bm);
    be->free(be, bv);
    nl_model_destroy(&a);
    nl_model_destroy(&b);
}

static void copy_file(const char *from, const char *to)
{
    size_t n = 0;
    char *buf = slurp(from, &n);
    if (buf)
        spit(to, buf, n);
    free(buf);
}

/* ---------------------------------------------------------------- integrity */

static void test_integrity(const nl_manifest *mf)
{
    nl_error err = {0};
    char s1[512], keep[512];
    snprintf(s1, sizeof s1, "%s", at("stage-1.safetensors"));
    snprintf(keep, sizeof keep, "%s", at("keep"));
    size_t n = 0;
    char *buf = slurp(s1, &n);
    if (!buf)
        return;
    copy_file(s1, keep);
    /* one flipped byte in the middle of shard 1 */
    buf[n / 2] ^= 0x01;
    spit(s1, buf, n);
    nl_status st = nl_manifest_verify(mf, &err);
    CHECK(st == NL_ERR_INTEGRITY && strstr(err.msg, "stage-1.safetensors") &&
              strstr(err.msg, "(stage 1)") && strstr(err.msg, "sha256 mismatch"),
          "flipped byte: %s '%s'", nl_status_str(st), err.msg);
    st = nl_manifest_export(mf, at("bad-export.safetensors"), &err);
    CHECK(st == NL_ERR_INTEGRITY && access(at("bad-export.safetensors"), F_OK) != 0,
          "export of a corrupt set: %s '%s'", nl_status_str(st), err.msg);
    /* one byte short */
    buf[n / 2] ^= 0x01;
    spit(s1, buf, n - 1);
    st = nl_manifest_verify(mf, &err);
    CHECK(st == NL_ERR_INTEGRITY && strstr(err.msg, "stage-1.safetensors") &&
              strstr(err.msg, "size mismatch"),
          "short shard: %s '%s'", nl_status_str(st), err.msg);
    copy_file(keep, s1);
    CHECK_OK(nl_manifest_verify(mf, &err), &err);
    /* a missing shard */
    CHECK(rename(at("stage-2.safetensors"), keep) == 0, "rename");
    st = nl_manifest_verify(mf, &err);
    CHECK(st == NL_ERR_NOTFOUND && strstr(err.msg, "stage-2.safetensors") &&
              strstr(err.msg, "(stage 2)"),
          "missing shard: %s '%s'", nl_status_str(st), err.msg);
    CHECK(rename(keep, at("stage-2.safetensors")) == 0, "rename back");
    CHECK_OK(nl_manifest_verify(mf, &err), &err);
    /* export must not replace a shard */
    st = nl_manifest_export(mf, at("stage-0.safetensors"), &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "stage-0.safetensors"), "export over a shard: %s",
          err.msg);
    free(buf);
}

/* Durability (issue 15, finding 12): a manifest names only shards that
 * are on disk as reported, is never replaced, and no checkpoint write
 * replaces a shard it names. */
static void test_durability(const nl_model *whole, const nl_manifest *m0)
{
    nl_error err = {0};
    char s0[512], mpath[512];
    snprintf(s0, sizeof s0, "%s", at("stage-0.safetensors"));
    snprintf(mpath, sizeof mpath, "%s", at(NL_MANIFEST_FILE));
    size_t n0 = 0, n1 = 0;
    char *before = slurp(s0, &n0);
    nl_status st = nl_checkpoint_save(whole, s0, STEP + 1, NULL, &err);
    CHECK(st == NL_ERR_STATE && strstr(err.msg, "stage-0.safetensors") &&
              strstr(err.msg, NL_MANIFEST_FILE),
          "save over a named shard: %s '%s'", nl_status_str(st), err.msg);
    char *after = slurp(s0, &n1);
    CHECK(before && after && n0 == n1 && memcmp(before, after, n0) == 0, "the shard is intact");
    free(before);
    free(after);
    struct stat ms;
    CHECK(stat(mpath, &ms) == 0 && (ms.st_mode & 0777) == 0600,
          "the manifest's mode %03o, not 0600 as its shards'", (unsigned)(ms.st_mode & 0777));
    st = nl_manifest_write(mpath, m0, &err);
    CHECK(st == NL_ERR_STATE && strstr(err.msg, "refusing to replace"),
          "a second manifest over the first: %s '%s'", nl_status_str(st), err.msg);
    /* a manifest whose shard is not (yet) what it says is not written */
    nl_manifest bad = *m0;
    nl_manifest_shard sh[3];
    memcpy(sh, m0->shards, sizeof sh);
    bad.shards = sh;
    sh[2].sha256[0] = sh[2].sha256[0] == 'a' ? 'b' : 'a';
    st = nl_manifest_write(at("unverified.json"), &bad, &err);
    CHECK(st == NL_ERR_INTEGRITY && strstr(err.msg, "stage-2.safetensors") &&
              access(at("unverified.json"), F_OK) != 0,
          "manifest of an unverified shard: %s '%s'", nl_status_str(st), err.msg);
    sh[2].sha256[0] = m0->shards[2].sha256[0];
    sh[2].file = "missing.safetensors";
    st = nl_manifest_write(at("unverified.json"), &bad, &err);
    CHECK(st == NL_ERR_NOTFOUND && access(at("unverified.json"), F_OK) != 0,
          "manifest of a missing shard: %s '%s'", nl_status_str(st), err.msg);
    /* a file of the same directory that no manifest names may be written */
    CHECK_OK(nl_checkpoint_save(whole, at("other.safetensors"), STEP, NULL, &err), &err);
}

/* What was verified is what is served (issue 15, finding 6): a shard
 * opened for serving is a copy of the bytes hashed, so truncating the
 * file afterwards neither changes nor faults (SIGBUS) what is read; a
 * later load refuses the truncated file. */
static void test_truncated_after_verify(nl_backend *be, const nl_manifest *mf)
{
    nl_error err = {0};
    nl_st_file *f = NULL, *files[3] = {NULL, NULL, NULL};
    char s1[512], keep[512];
    snprintf(s1, sizeof s1, "%s", at("stage-1.safetensors"));
    snprintf(keep, sizeof keep, "%s", at("keep-trunc"));
    copy_file(s1, keep);
    CHECK_OK(nl_manifest_open_shards(mf, files, &err), &err);
    CHECK_OK(nl_manifest_open_shard(mf, 1, &f, &err), &err);
    if (!f)
        return;
    CHECK(truncate(s1, 64) == 0, "truncate");
    nl_st_file *ref = NULL;
    CHECK_OK(nl_st_open(&ref, keep, &err), &err);
    size_t n = 0;
    for (size_t i = 0; ref && i < nl_st_count(f); i++) { /* every byte of every tensor */
        const nl_st_entry *e = nl_st_entry_at(f, i), *r = nl_st_find(ref, e->name);
        CHECK(r && r->nbytes == e->nbytes &&
                  memcmp(nl_st_tensor_data(f, e), nl_st_tensor_data(ref, r), e->nbytes) == 0,
              "tensor %s served as verified", e->name);
        n++;
    }
    CHECK(n > 0 && files[1] && nl_st_count(files[1]) == n, "%zu tensors read", n);
    nl_st_close(&ref);
    nl_st_close(&f);
    for (int i = 0; i < 3; i++)
        nl_st_close(&files[i]);
    nl_model *s = NULL;
    nl_status st = nl_manifest_load_stage(&s, be, mf, 0, 3, 1, 1, NULL, NULL, &err);
    CHECK(st == NL_ERR_INTEGRITY && !s && strstr(err.msg, "stage-1.safetensors") &&
              strstr(err.msg, "size mismatch"),
          "a truncated shard: %s '%s'", nl_status_str(st), err.msg);
    st = nl_manifest_open_shards(mf, files, &err);
    CHECK(st == NL_ERR_INTEGRITY && !files[0] && !files[1], "open_shards of a truncated set: %s",
          nl_status_str(st));
    nl_model_destroy(&s);
    copy_file(keep, s1);
    CHECK_OK(nl_manifest_verify(mf, &err), &err);
}

/* A shard with a correct hash that is not of the manifest's step, or has
 * no moments, is refused when read. */
static void test_shard_meta(nl_backend *be, const nl_manifest *mf, const char *whole)
{
    nl_error err = {0};
    nl_manifest copy = *mf;
    nl_manifest_shard sh[3];
    nl_model *s = NULL;
    memcpy(sh, mf->shards, sizeof sh);
    copy.shards = sh;
    write_shard(be, whole, 1, STEP - 1, "old-1.safetensors");
    char path[512];
    snprintf(path, sizeof path, "%s", at("old-1.safetensors"));
    sh[1].file = "old-1.safetensors";
    sh[1].path = path;
    CHECK_OK(nl_file_sha256(path, sh[1].sha256, &sh[1].bytes, &err), &err);
    CHECK_OK(nl_manifest_verify(&copy, &err), &err);
    nl_status st = nl_manifest_load_stage(&s, be, &copy, 0, 3, 1, 1, NULL, NULL, &err);
    CHECK(st == NL_ERR_FORMAT && strstr(err.msg, "old-1.safetensors") && strstr(err.msg, "step 11"),
          "shard of another step: %s '%s'", nl_status_str(st), err.msg);
    nl_model_destroy(&s);
    /* a shard without moments: fine for weights, NOTFOUND for moments */
    CHECK_OK(nl_checkpoint_load(&s, be, whole, 1, 2, 0, 0, NULL, &err), &err);
    if (s)
        CHECK_OK(nl_checkpoint_save(s, path, STEP, NULL, &err), &err);
    nl_model_destroy(&s);
    /* load_stage checks the hash of what it reads: first the old one */
    nl_status st2 = nl_manifest_load_stage(&s, be, &copy, 1, 2, 0, 0, NULL, NULL, &err);
    CHECK(st2 == NL_ERR_INTEGRITY && strstr(err.msg, "old-1.safetensors"),
          "a shard rewritten since the manifest: %s '%s'", nl_status_str(st2), err.msg);
    CHECK_OK(nl_file_sha256(path, sh[1].sha256, &sh[1].bytes, &err), &err);
    CHECK_OK(nl_manifest_load_stage(&s, be, &copy, 1, 2, 0, 0, NULL, NULL, &err), &err);
    nl_model_destroy(&s);
    float *mm = be->alloc(be, 1 << 20), *vv = be->alloc(be, 1 << 20);
    st = nl_manifest_load_stage(&s, be, &copy, 1, 2, 0, 0, mm, vv, &err);
    CHECK(st == NL_ERR_NOTFOUND && strstr(err.msg, "old-1.safetensors"),
          "shard without moments: %s '%s'", nl_status_str(st), err.msg);
    nl_model_destroy(&s);
    st = nl_manifest_load_stage(&s, be, mf, 0, 3, 1, 1, mm, NULL, &err);
    CHECK(st == NL_ERR_INVALID && !s, "one moment buffer: %s", nl_status_str(st));
    st = nl_manifest_load_stage(&s, be, mf, 2, 4, 0, 1, NULL, NULL, &err);
    CHECK(st == NL_ERR_RANGE && !s, "layers past the end: %s '%s'", nl_status_str(st), err.msg);
    be->free(be, mm);
    be->free(be, vv);
}

/* ---------------------------------------------------------------- parsing */

/* Parse `base` with obj.key set to val (stolen; NULL deletes the key);
 * obj is "" (top level), "config", "train" or "shards[i]". */
static void expect_edit(json_t *base, const char *obj, const char *key, json_t *val, nl_status want,
                        const char *needle)
{
    nl_error err = {0};
    nl_manifest *m = NULL;
    json_t *root = json_deep_copy(base), *o = root;
    int i;
    if (strncmp(obj, "shards[", 7) == 0 && sscanf(obj, "shards[%d]", &i) == 1)
        o = json_array_get(json_object_get(root, "shards"), (size_t)i);
    else if (obj[0])
        o = json_object_get(root, obj);
    if (val)
        json_object_set_new(o, key, val);
    else
        json_object_del(o, key);
    char *text = json_dumps(root, 0);
    nl_status st = nl_manifest_parse(&m, text, strlen(text), dir, &err);
    CHECK(st == want && (want == NL_OK || strstr(err.msg, needle)) && (st == NL_OK) == (m != NULL),
          "%s%s%s: got %s '%s', want %s naming '%s'", obj, obj[0] ? "." : "", key,
          nl_status_str(st), err.msg, nl_status_str(want), needle);
    nl_manifest_destroy(&m);
    free(text);
    json_decref(root);
}

static void expect_text(const char *text, nl_status want, const char *needle)
{
    nl_error err = {0};
    nl_manifest *m = NULL;
    nl_status st = nl_manifest_parse(&m, text, strlen(text), NULL, &err);
    CHECK(st == want && strstr(err.msg, needle) && !m, "'%.40s': got %s '%s', want %s naming '%s'",
          text, nl_status_str(st), err.msg, nl_status_str(want), needle);
    nl_manifest_destroy(&m);
}

static void test_parse_errors(const char *manifest_path)
{
    json_error_t je;
    json_t *b = json_load_file(manifest_path, 0, &je);
    CHECK(b != NULL, "manifest JSON: %s", je.text);
    if (!b)
        return;
    expect_edit(b, "", "unknown_key", json_integer(1), NL_OK, "");
    expect_edit(b, "shards[1]", "node", json_null(), NL_OK, "");
    expect_edit(b, "", "train", NULL, NL_OK, "");
    expect_edit(b, "", "format", json_string("neurollm-manifest/2"), NL_ERR_VERSION, "format");
    expect_edit(b, "", "format", NULL, NL_ERR_FORMAT, "format");
    expect_edit(b, "", "format", json_integer(1), NL_ERR_FORMAT, "format");
    expect_edit(b, "", "step", json_string("12"), NL_ERR_FORMAT, "step");
    expect_edit(b, "", "step", json_integer(-1), NL_ERR_RANGE, "step");
    expect_edit(b, "", "step", json_real(12.0), NL_ERR_FORMAT, "step");
    expect_edit(b, "", "adam_steps", NULL, NL_ERR_FORMAT, "adam_steps");
    expect_edit(b, "", "config", json_string("{}"), NL_ERR_FORMAT, "config");
    expect_edit(b, "config", "num_kv_heads", json_integer(3), NL_ERR_INVALID, "num_kv_heads");
    expect_edit(b, "config", "hidden_dim", json_string("16"), NL_ERR_INVALID, "hidden_dim");
    expect_edit(b, "config", "num_layers", json_integer(4), NL_ERR_FORMAT, "shards[2].layers");
    expect_edit(b, "", "train", json_pack("[i]", 1), NL_ERR_FORMAT, "train");
    expect_edit(b, "", "tokenizer", json_integer(5), NL_ERR_FORMAT, "tokenizer");
    /* text that is no tokenizer: refused as the checkpoint joined from the
     * shards would be when loaded, not carried into one */
    expect_edit(b, "", "tokenizer", json_string("garbage"), NL_ERR_FORMAT, "tokenizer: tokenizer");
    expect_edit(b, "", "init_seed", json_string("-9"), NL_ERR_FORMAT, "init_seed");
    expect_edit(b, "", "init_seed", json_string("99999999999999999999999"), NL_ERR_FORMAT,
                "init_seed");
    expect_edit(b, "", "shards", json_object(), NL_ERR_FORMAT, "shards");
    expect_edit(b, "", "shards", json_array(), NL_ERR_FORMAT, "shards");
    expect_edit(b, "", "shards", NULL, NL_ERR_FORMAT, "shards");
    expect_edit(b, "", "shards", json_pack("[i]", 1), NL_ERR_FORMAT, "shards[0]");
    /* the plan */
    expect_edit(b, "shards[1]", "layers", json_pack("[ii]", 2, 3), NL_ERR_FORMAT,
                "shards[1].layers");
    expect_edit(b, "shards[0]", "layers", json_pack("[ii]", 0, 2), NL_ERR_FORMAT,
                "shards[1].layers");
    expect_edit(b, "shards[1]", "layers", json_pack("[ii]", 1, 1), NL_ERR_RANGE,
                "shards[1].layers");
    expect_edit(b, "shards[2]", "layers", json_pack("[ii]", 2, 4), NL_ERR_RANGE,
                "shards[2].layers");
    expect_edit(b, "shards[1]", "layers", json_pack("[if]", 1, 2.0), NL_ERR_FORMAT,
                "shards[1].layers");
    expect_edit(b, "shards[1]", "layers", json_pack("[iii]", 1, 2, 3), NL_ERR_FORMAT,
                "shards[1].layers");
    expect_edit(b, "shards[1]", "head", json_true(), NL_ERR_FORMAT, "shards[1].head");
    expect_edit(b, "shards[2]", "head", json_false(), NL_ERR_FORMAT, "shards[2].head");
    expect_edit(b, "shards[1]", "embed", json_true(), NL_ERR_FORMAT, "shards[1].embed");
    expect_edit(b, "shards[0]", "embed", json_integer(1), NL_ERR_FORMAT, "shards[0].embed");
    expect_edit(b, "shards[2]", "stage", json_integer(1), NL_ERR_FORMAT, "shards[2].stage");
    expect_edit(b, "shards[2]", "stage", json_integer(-1), NL_ERR_RANGE, "shards[2].stage");
    /* files */
    expect_edit(b, "shards[1]", "file", json_string("../stage-1.safetensors"), NL_ERR_FORMAT,
                "shards[1].file");
    expect_edit(b, "shards[1]", "file", json_string("/etc/passwd"), NL_ERR_FORMAT,
                "shards[1].file");
    expect_edit(b, "shards[1]", "file", json_string(".."), NL_ERR_FORMAT, "shards[1].file");
    expect_edit(b, "shards[1]", "file", json_string("."), NL_ERR_FORMAT, "shards[1].file");
    expect_edit(b, "shards[1]", "file", json_string(""), NL_ERR_FORMAT, "shards[1].file");
    expect_edit(b, "shards[1]", "file", json_string("a\x1b[2Jb"), NL_ERR_FORMAT, "shards[1].file");
    expect_edit(b, "shards[1]", "file", json_integer(1), NL_ERR_FORMAT, "shards[1].file");
    expect_edit(b, "shards[2]", "file", json_string("stage-0.safetensors"), NL_ERR_FORMAT,
                "shards[2].file");
    /* hashes and sizes */
    expect_edit(b, "shards[1]", "sha256", json_string("g" /* not hex */), NL_ERR_FORMAT,
                "shards[1].sha256");
    char hex[65];
    memset(hex, 'A', 64);
    hex[64] = '\0';
    expect_edit(b, "shards[1]", "sha256", json_string(hex), NL_ERR_FORMAT, "shards[1].sha256");
    memset(hex, 'a', 64);
    hex[63] = 'x';
    expect_edit(b, "shards[1]", "sha256", json_string(hex), NL_ERR_FORMAT, "shards[1].sha256");
    expect_edit(b, "shards[1]", "sha256", NULL, NL_ERR_FORMAT, "shards[1].sha256");
    expect_edit(b, "shards[1]", "bytes", json_string("100"), NL_ERR_FORMAT, "shards[1].bytes");
    expect_edit(b, "shards[1]", "bytes", json_integer(-5), NL_ERR_RANGE, "shards[1].bytes");
    expect_edit(b, "shards[1]", "node", json_integer(5), NL_ERR_FORMAT, "shards[1].node");
    expect_edit(b, "shards[1]", "node", json_string("x\ny"), NL_ERR_FORMAT, "shards[1].node");
    /* not a manifest at all */
    expect_text("", NL_ERR_FORMAT, "line");
    expect_text("{", NL_ERR_FORMAT, "line");
    expect_text("[]", NL_ERR_FORMAT, "object");
    expect_text("{\"format\":\"neurollm-manifest/1\",\"format\":\"x\"}", NL_ERR_FORMAT,
                "duplicate");
    expect_text("{\"format\":\"neurollm/1\"}", NL_ERR_VERSION, "format");
    json_t *shards = json_object_get(b, "shards");
    json_t *many = json_array();
    for (int i = 0; i < NL_MANIFEST_MAX_SHARDS + 1; i++)
        json_array_append(many, json_array_get(shards, 0));
    expect_edit(b, "", "shards", many, NL_ERR_LIMIT, "shards");
    json_decref(b);
}

/* nl_manifest_write refuses what a reader would refuse, and leaves no
 * file behind. */
static void test_write_refuses(const nl_manifest *mf)
{
    nl_error err = {0};
    nl_manifest bad = *mf;
    nl_manifest_shard sh[3];
    memcpy(sh, mf->shards, sizeof sh);
    bad.shards = sh;
    sh[1].has_head = 1;
    nl_status st = nl_manifest_write(at("bad.json"), &bad, &err);
    CHECK(st == NL_ERR_FORMAT && strstr(err.msg, "shards[1].head") && access(at("bad.json"), F_OK),
          "write of a bad plan: %s '%s'", nl_status_str(st), err.msg);
    sh[1].has_head = 0;
    bad.train_json = "[1]";
    st = nl_manifest_write(at("bad.json"), &bad, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "train"), "write of a bad train: %s", err.msg);
    bad.train_json = NULL;
    bad.init_seed = "seed";
    st = nl_manifest_write(at("bad.json"), &bad, &err);
    CHECK(st == NL_ERR_FORMAT && strstr(err.msg, "init_seed"), "write of a bad seed: %s", err.msg);
    bad.init_seed = NULL;
    sh[2].file = NULL;
    st = nl_manifest_write(at("bad.json"), &bad, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "shards[2].file"), "write without a file: %s",
          err.msg);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *whole = NULL;
    nl_manifest *mf = NULL;
    snprintf(dir, sizeof dir, "/tmp/nl_test_manifest_%d", (int)getpid());
    CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    for (int s = 0; s < NL_STATUS_COUNT; s++)
        CHECK(strcmp(nl_status_str((nl_status)s), "NL_ERR_UNKNOWN") != 0, "status %d has a name",
              s);
    CHECK(strcmp(nl_status_str(NL_ERR_INTEGRITY), "NL_ERR_INTEGRITY") == 0, "NL_ERR_INTEGRITY");
    nl_manifest_destroy(NULL);
    nl_manifest_destroy(&mf);
    test_sha256();

    /* the whole model, and a one-process save of it */
    CHECK_OK(check_backend_new(&be, 1, &err), &err);
    nl_config c = small();
    CHECK_OK(nl_model_new(&whole, be, &c, 0, 3, 1, 1, &err), &err);
    if (!whole)
        return check_done("test_manifest");
    CHECK_OK(nl_model_init_random(whole, 9, &err), &err);
    const size_t n = whole->n_params;
    float *mm = be->alloc(be, n * 4), *vv = be->alloc(be, n * 4);
    float *mm_h = malloc(n * 4), *vv_h = malloc(n * 4);
    for (size_t i = 0; mm_h && vv_h && i < n; i++) {
        mm_h[i] = (float)i * 1e-3f - 0.5f;
        vv_h[i] = 1.0f + (float)i * 1e-4f;
    }
    if (mm && vv && mm_h && vv_h) {
        be->upload(be, mm, mm_h, n * 4);
        be->upload(be, vv, vv_h, n * 4);
    }
    free(mm_h);
    free(vv_h);
    nl_ckpt_extra extra = {.m = mm,
                           .v = vv,
                           .adam_steps = ADAM,
                           .train_json = TRAIN,
                           .tokenizer = TOKENIZER,
                           .init_seed = "9"};
    char ref[512];
    snprintf(ref, sizeof ref, "%s", at("whole.safetensors"));
    CHECK_OK(nl_checkpoint_save(whole, ref, STEP, &extra, &err), &err);

    /* three shards and their manifest, as the stages and the coordinator write them */
    for (int i = 0; i < 3; i++) {
        char name[32];
        snprintf(name, sizeof name, "stage-%d.safetensors", i);
        write_shard(be, ref, i, STEP, name);
    }
    nl_manifest m0;
    nl_manifest_shard sh[3];
    fill_manifest(&m0, sh, &c);
    CHECK_OK(nl_manifest_write(at(NL_MANIFEST_FILE), &m0, &err), &err);
    test_durability(whole, &m0);

    /* load (by directory and by file) and verify */
    CHECK(nl_manifest_load(&mf, at("none.json"), &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, "none.json"),
          "missing manifest: %s", err.msg);
    CHECK_OK(nl_manifest_load(&mf, at(NL_MANIFEST_FILE), &err), &err);
    nl_manifest_destroy(&mf);
    CHECK_OK(nl_manifest_load(&mf, dir, &err), &err);
    if (!mf)
        return check_done("test_manifest");
    CHECK(mf->step == STEP && mf->adam_steps == ADAM && mf->n_shards == 3, "step, adam, shards");
    CHECK(mf->cfg.num_layers == 3 && mf->cfg.hidden_dim == 16 && mf->cfg.vocab_size == 20 &&
              mf->cfg.norm_eps == c.norm_eps && mf->cfg.rope_base == c.rope_base,
          "config");
    json_t *ta = json_loads(TRAIN, 0, NULL),
           *tb = mf->train_json ? json_loads(mf->train_json, 0, NULL) : NULL;
    CHECK(ta && tb && json_equal(ta, tb), "train: %s", mf->train_json);
    json_decref(ta);
    json_decref(tb);
    CHECK(mf->tokenizer && strcmp(mf->tokenizer, TOKENIZER) == 0, "tokenizer");
    CHECK(mf->init_seed && strcmp(mf->init_seed, "9") == 0, "init_seed");
    for (int i = 0; i < 3; i++) {
        const nl_manifest_shard *s = &mf->shards[i];
        CHECK(s->stage == i && s->l0 == cut[i].l0 && s->l1 == cut[i].l1 &&
                  s->has_embed == cut[i].embed && s->has_head == cut[i].head &&
                  strcmp(s->file, sh[i].file) == 0 && strcmp(s->path, at(sh[i].file)) == 0 &&
                  strcmp(s->sha256, sh[i].sha256) == 0 && s->bytes == sh[i].bytes && s->node &&
                  strcmp(s->node, sh[i].node) == 0,
              "shard %d round-trips", i);
    }
    CHECK_OK(nl_manifest_verify(mf, &err), &err);

    /* export == a one-process save, byte for byte */
    nl_manifest_export_stats stats = {0};
    CHECK_OK(nl_manifest_export_ex(mf, at("joined.safetensors"), &stats, &err), &err);
    same_checkpoint(at("joined.safetensors"), ref);
    size_t na = 0, nb = 0;
    char *fa = slurp(at("joined.safetensors"), &na), *fb = slurp(ref, &nb);
    CHECK(fa && fb && na == nb && memcmp(fa, fb, na) == 0, "export is the one-process file");
    CHECK(stats.n_tensors == whole->n_table && stats.n_params == n && stats.bytes == na,
          "export stats: %d tensors, %zu params, %llu bytes", stats.n_tensors, stats.n_params,
          (unsigned long long)stats.bytes);
    free(fa);
    free(fb);
    /* a manifest whose train object says something else than the shards:
     * the manifest's wins */
    nl_manifest other = *mf;
    other.train_json = "{\"seed\":6}";
    char *train = NULL;
    CHECK_OK(nl_manifest_export(&other, at("joined2.safetensors"), &err), &err);
    CHECK_OK(nl_checkpoint_meta(at("joined2.safetensors"), "train", &train, &err), &err);
    CHECK(train && strcmp(train, "{\"seed\":6}") == 0, "the manifest's train: %s", train);
    free(train);

    /* re-cut stages, across the shard boundaries */
    same_stage(be, mf, ref, 0, 2, 1, 0, 1);
    same_stage(be, mf, ref, 2, 3, 0, 1, 1);
    same_stage(be, mf, ref, 1, 3, 0, 1, 1);
    same_stage(be, mf, ref, 0, 3, 1, 1, 0);
    same_stage(be, mf, ref, 1, 2, 0, 0, 1);
    /* a backend whose memory is not the host's: the loads stage through
     * host buffers and upload (the CPU backend's copy, told otherwise) */
    nl_backend device = *be;
    device.host_memory = 0;
    same_stage(&device, mf, ref, 1, 3, 0, 1, 1);
    same_stage(be, mf, ref, 0, 0, 1, 0, 1); /* the embedding alone */
    same_stage(be, mf, ref, 3, 3, 0, 1, 1); /* the head alone */

    test_integrity(mf);
    test_truncated_after_verify(be, mf);
    test_shard_meta(be, mf, ref);
    test_parse_errors(at(NL_MANIFEST_FILE));
    test_write_refuses(&m0);

    nl_manifest_destroy(&mf);
    nl_manifest_destroy(&mf);
    be->free(be, mm);
    be->free(be, vv);
    nl_model_destroy(&whole);
    nl_backend_destroy(&be);
    if (!check_fail_count) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", dir);
    }
    return check_done("test_manifest");
}
