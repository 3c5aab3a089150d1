/* Model checkpoints: round trip (weights, optimizer state, tokenizer
 * metadata) and a corrupt-checkpoint matrix, each case refused by
 * nl_checkpoint_load with a message that names the fault. */
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "tests/check.h"

#include <unistd.h>

static char dir[256];

static nl_config small(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 16;
    c.num_layers = 2;
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
    fwrite(buf, 1, n, f);
    fclose(f);
}

/* Rewrite the header with `from` replaced by `to` (first occurrence),
 * fixing the length; data bytes follow unchanged. */
static int edit_header(const char *src, const char *dst, const char *from, const char *to)
{
    size_t n = 0;
    char *buf = slurp(src, &n);
    uint64_t hl;
    memcpy(&hl, buf, 8);
    char *hdr = strndup(buf + 8, hl);
    char *at = strstr(hdr, from);
    if (!at) {
        free(hdr);
        free(buf);
        return -1;
    }
    size_t nl = hl - strlen(from) + strlen(to);
    char *out = malloc(8 + nl + (n - 8 - hl));
    uint64_t nl64 = nl;
    memcpy(out, &nl64, 8);
    size_t pre = (size_t)(at - hdr);
    memcpy(out + 8, hdr, pre);
    memcpy(out + 8 + pre, to, strlen(to));
    memcpy(out + 8 + pre + strlen(to), at + strlen(from), hl - pre - strlen(from));
    memcpy(out + 8 + nl, buf + 8 + hl, n - 8 - hl);
    spit(dst, out, 8 + nl + (n - 8 - hl));
    free(out);
    free(hdr);
    free(buf);
    return 0;
}

static void expect_refused(nl_backend *be, const char *path, nl_status want, const char *needle,
                           const char *what)
{
    nl_error err = {0};
    nl_model *m = NULL;
    nl_status st = nl_checkpoint_load(&m, be, path, 0, -1, 1, 1, NULL, &err);
    CHECK(st != NL_OK && (want == NL_OK || st == want) && strstr(err.msg, needle),
          "%s: got %s '%s', want %s naming '%s'", what, nl_status_str(st), err.msg,
          nl_status_str(want), needle);
    nl_model_destroy(&m);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL, *back = NULL;
    char good[512], bad[512];
    snprintf(dir, sizeof dir, "/tmp/nl_test_ckpt_%d", (int)getpid());
    snprintf(good, sizeof good, "%s.good", dir);
    snprintf(bad, sizeof bad, "%s.bad", dir);
    CHECK_OK(check_backend_new(&be, 1, &err), &err);
    nl_config c = small();
    CHECK_OK(nl_model_new(&m, be, &c, 0, 2, 1, 1, &err), &err);
    if (!m)
        return check_done("test_checkpoint");
    CHECK_OK(nl_model_init_random(m, 9, &err), &err);
    float *mom = be->alloc(be, m->n_params * sizeof(float));
    float *mom_h = malloc(m->n_params * sizeof(float));
    for (size_t i = 0; mom_h && i < m->n_params; i++)
        mom_h[i] = (float)i * 1e-3f;
    if (mom && mom_h)
        be->upload(be, mom, mom_h, m->n_params * sizeof(float));
    float *w = check_download(be, m->params, m->n_params);
    nl_ckpt_extra extra = {
        .m = mom, .v = mom, .adam_steps = 7, .tokenizer = "neurollm-bpe 1\n", .init_seed = "9"};
    CHECK_OK(nl_checkpoint_save(m, good, 12, &extra, &err), &err);

    /* round trip */
    int64_t step = 0, adam = 0;
    CHECK_OK(nl_checkpoint_load(&back, be, good, 0, -1, 1, 1, &step, &err), &err);
    if (back) {
        float *got = check_download(be, back->params, back->n_params);
        CHECK(step == 12 && back->n_params == m->n_params && got && w &&
                  memcmp(got, w, m->n_params * 4) == 0,
              "weights and step round-trip");
        free(got);
        float *mm = be->alloc(be, m->n_params * 4), *vv = be->alloc(be, m->n_params * 4);
        char *train = NULL;
        CHECK_OK(nl_checkpoint_load_optim(back, good, mm, vv, &adam, &train, &err), &err);
        float *mm_h = check_download(be, mm, m->n_params);
        float *vv_h = check_download(be, vv, m->n_params);
        CHECK(adam == 7 && mm_h && vv_h && memcmp(mm_h, mom_h, m->n_params * 4) == 0 &&
                  memcmp(vv_h, mom_h, m->n_params * 4) == 0,
              "moments round-trip");
        free(mm_h);
        free(vv_h);
        free(train);
        be->free(be, mm);
        be->free(be, vv);
        nl_model_destroy(&back);
    }
    char *meta = NULL;
    CHECK_OK(nl_checkpoint_meta(good, "init_seed", &meta, &err), &err);
    CHECK(meta && strcmp(meta, "9") == 0, "init_seed metadata");
    free(meta);
    meta = NULL;
    CHECK_OK(nl_checkpoint_init_seed(good, &meta, &err), &err);
    CHECK(meta && strcmp(meta, "9") == 0, "init_seed, checked");
    free(meta);
    /* a seed that is not one: refused where it is read for use (grow's
     * default seed, train's copy into its checkpoints), as a manifest's is */
    {
        nl_ckpt_extra odd = extra;
        odd.init_seed = "abc";
        meta = NULL;
        if (nl_checkpoint_save(m, bad, 12, &odd, &err) == NL_OK) {
            nl_status st = nl_checkpoint_init_seed(bad, &meta, &err);
            CHECK(st == NL_ERR_FORMAT && !meta &&
                      strstr(err.msg, "metadata 'init_seed': expected a decimal seed"),
                  "a bad init_seed: %s '%s'", nl_status_str(st), err.msg);
        }
        free(meta);
    }
    /* a stage slice loads only its tensors */
    CHECK_OK(nl_checkpoint_load(&back, be, good, 1, 2, 0, 1, NULL, &err), &err);
    CHECK(back && back->n_table == 7 + 3 * 2 + 2, "stage [1, 2) with the head");
    nl_model_destroy(&back);

    /* a weight that is not finite: refused, naming the tensor (a NaN would
     * make every output NaN); an infinite moment likewise */
    for (int i = 0; w && i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        if (strcmp(p->name, "layers.1.ffn_norm.weight") != 0)
            continue;
        float *w2 = malloc(m->n_params * sizeof *w2);
        memcpy(w2, w, m->n_params * sizeof *w2);
        w2[p->offset + 3] = NAN;
        be->upload(be, m->params, w2, m->n_params * sizeof *w2);
        CHECK_OK(nl_checkpoint_save(m, bad, 12, &extra, &err), &err);
        expect_refused(be, bad, NL_ERR_FORMAT,
                       "tensor layers.1.ffn_norm.weight: 1 of its 16 values are not finite "
                       "(the first at 3: nan)",
                       "a NaN weight");
        be->upload(be, m->params, w, m->n_params * sizeof *w2);
        w2[p->offset + 3] = INFINITY; /* as a moment */
        be->upload(be, mom, w2, m->n_params * sizeof *w2);
        CHECK_OK(nl_checkpoint_save(m, bad, 12, &extra, &err), &err);
        nl_model *b2 = NULL;
        CHECK_OK(nl_checkpoint_load(&b2, be, bad, 0, -1, 1, 1, NULL, &err), &err);
        float *mm = be->alloc(be, m->n_params * 4), *vv = be->alloc(be, m->n_params * 4);
        int64_t a2 = 0;
        nl_status st = b2 ? nl_checkpoint_load_optim(b2, bad, mm, vv, &a2, NULL, &err) : NL_OK;
        CHECK(st == NL_ERR_FORMAT && strstr(err.msg, "optim.m.layers.1.ffn_norm.weight") &&
                  strstr(err.msg, "inf"),
              "an infinite moment: %s '%s'", nl_status_str(st), err.msg);
        be->upload(be, mom, mom_h, m->n_params * sizeof *w2);
        be->free(be, mm);
        be->free(be, vv);
        nl_model_destroy(&b2);
        free(w2);
    }

    /* truncations */
    size_t n = 0;
    char *buf = slurp(good, &n);
    uint64_t hl;
    memcpy(&hl, buf, 8);
    size_t cuts[] = {0, 4, 9, 8 + hl / 2, 8 + hl, 8 + hl + 100, n - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        spit(bad, buf, cuts[i]);
        expect_refused(be, bad, NL_OK, "nl_test_ckpt", "truncated");
    }
    /* header length past the end */
    uint64_t huge = n * 2;
    memcpy(buf, &huge, 8);
    spit(bad, buf, n);
    expect_refused(be, bad, NL_OK, "header", "header length past the end");
    memcpy(buf, &hl, 8);
    /* bad JSON */
    CHECK(edit_header(good, bad, "{", "{{") == 0, "edit");
    expect_refused(be, bad, NL_ERR_FORMAT, "JSON", "bad JSON");
    /* an offset out of range */
    CHECK(edit_header(good, bad, "\"data_offsets\":[0,", "\"data_offsets\":[999999999,") == 0 ||
              edit_header(good, bad, "\"data_offsets\": [0,", "\"data_offsets\": [999999999,") == 0,
          "edit offsets");
    expect_refused(be, bad, NL_OK, "data_offsets", "offset out of range");
    /* an unknown dtype */
    CHECK(edit_header(good, bad, "\"F32\"", "\"Q7\"") == 0, "edit dtype");
    expect_refused(be, bad, NL_ERR_DTYPE, "Q7", "unknown dtype");
    /* a missing tensor: rename one so the name the config implies is absent */
    CHECK(edit_header(good, bad, "layers.1.ffn_norm.weight", "layers.1.ffn_norm.weighz") == 0,
          "edit name");
    expect_refused(be, bad, NL_ERR_NOTFOUND, "layers.1.ffn_norm.weight", "missing tensor");
    /* a wrong shape: the config says d = 16; a file whose config says 8 */
    CHECK(edit_header(good, bad, "\\\"num_layers\\\":2", "\\\"num_layers\\\":3") == 0,
          "edit config");
    expect_refused(be, bad, NL_OK, "layers", "config needs more layers than the file holds");
    /* and fewer: the file's second layer is not silently dropped */
    CHECK(edit_header(good, bad, "\\\"num_layers\\\":2", "\\\"num_layers\\\":1") == 0,
          "edit config");
    expect_refused(be, bad, NL_ERR_FORMAT, "is of layer 1, past its config's num_layers 1",
                   "a layer past the config's");
    CHECK(edit_header(good, bad, "\\\"ffn_dim\\\":8", "\\\"ffn_dim\\\":4") == 0, "edit ffn");
    expect_refused(be, bad, NL_ERR_SHAPE, "w_gate", "wrong shape");
    /* metadata faults */
    CHECK(edit_header(good, bad, "neurollm/1", "neurollm/9") == 0, "edit format");
    expect_refused(be, bad, NL_ERR_VERSION, "neurollm/9", "other format");
    CHECK(edit_header(good, bad, "\\\"num_kv_heads\\\":1", "\\\"num_kv_heads\\\":3") == 0,
          "edit kv heads");
    expect_refused(be, bad, NL_ERR_INVALID, "num_kv_heads", "bad config");
    CHECK(edit_header(good, bad, "\"step\":\"12\"", "\"step\":\"x2\"") == 0, "edit step");
    expect_refused(be, bad, NL_ERR_FORMAT, "step", "bad step");
    CHECK(edit_header(good, bad, "\"step\":\"12\"", "\"step\":\"1x\"") == 0, "edit step tail");
    expect_refused(be, bad, NL_ERR_FORMAT, "step", "a step with trailing junk");
    free(buf);
    unlink(good);
    unlink(bad);
    be->free(be, mom);
    free(mom_h);
    free(w);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return check_done("test_checkpoint");
}
