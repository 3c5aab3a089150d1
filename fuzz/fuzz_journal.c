/* Fuzz target for the coordinator's journal (coordinator/coord_journal.c:
 * <state-dir>/journal.json, read when a coordinator starts; a file a disk,
 * a crash or a hand may have left in any state).
 *
 * Each input is the journal: written to a fresh state directory with a
 * tiny model's config and a data file, then a coordinator starts there
 * (plaintext, min_nodes 1, no nodes), turns its loop a few times (a
 * recovered job's preparation runs on its workers) and stops.
 *
 * Property: no crash and no sanitizer report; the coordinator starts
 * whatever the journal holds; job ids go on from the journal's "next_job"
 * where it is an integer in 1..2^53-1, and none past 2^53 is taken; a journal the coordinator
 * rewrote is JSON with "next_job" and "train". */
#define _XOPEN_SOURCE 700 /* nftw */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/formats/fileio.h"
#include "fuzz/coord_state.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const cfg_yaml =
    "hidden_dim: 16\nnum_layers: 2\nnum_heads: 2\nnum_kv_heads: 1\nffn_dim: 16\n"
    "num_experts: 2\nvocab_size: 256\nvocab_chunk: 64\nmax_seq_len: 32\n";

static char state_dir[256];

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_journal: %s\n", what);
    abort();
}

static void remove_state_dir(void)
{
    coord_state_remove(state_dir);
}

/* For each input, a state dir of its own: the config and a data file in
 * its data root, nothing an earlier coordinator left; removed at exit. */
static void fresh_state(void)
{
    if (!state_dir[0]) {
        snprintf(state_dir, sizeof state_dir, "/tmp/nl_fuzz_journal_XXXXXX");
        if (!mkdtemp(state_dir))
            fail("no state directory");
        atexit(remove_state_dir);
        nl_log_set_level(getenv("NL_FUZZ_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_ERROR);
    } else {
        remove_state_dir();
        if (mkdir(state_dir, 0700) != 0)
            fail("no state directory");
    }
    if (coord_state_fill(state_dir, cfg_yaml) != 0)
        fail("no config or data file");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fresh_state();
    char path[400], cfg[400];
    snprintf(path, sizeof path, "%s/journal.json", state_dir);
    snprintf(cfg, sizeof cfg, "%s/cfg.yaml", state_dir);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        fail("cannot write the journal");
    /* what the journal says of job ids, read as the coordinator should */
    json_error_t je;
    json_t *given = json_loadb((const char *)data, size, 0, &je);
    const json_t *nj = json_object_get(given, "next_job");
    const json_int_t next = json_is_integer(nj) ? json_integer_value(nj) : 0;
    json_decref(given);

    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.client_listen = "tcp://127.0.0.1:*";
    o.state_dir = state_dir;
    o.config = cfg;
    o.plaintext = 1;
    o.min_nodes = 1;
    o.job_timeout_ms = 100000;
    o.node_timeout_ms = 100000;
    nl_error err = {0};
    nl_coord *c = NULL;
    if (nl_coord_new(&c, &o, &err) != NL_OK)
        fail("the coordinator did not start");
    if (next > 0 && next < (json_int_t)1 << 53 && c->next_job < (uint64_t)next)
        fail("job ids do not go on from the journal's");
    if (c->next_job > (uint64_t)1 << 53)
        fail("a job id past 2^53 taken from the journal");
    for (int i = 0; i < 4; i++)
        nl_coord_step(c, 1);
    nl_coord_destroy(&c);

    /* the journal now: the input untouched, or one the coordinator wrote */
    char *text = NULL;
    size_t len = 0;
    if (nl_file_read_all(path, 1 << 20, &text, &len, &err) != NL_OK)
        fail("the journal is gone");
    if (len != size || memcmp(text, data, size) != 0) {
        json_t *now = json_loadb(text, len, 0, &je);
        const json_t *nj2 = json_object_get(now, "next_job");
        if (!json_is_integer(nj2) || json_integer_value(nj2) < 0 || !json_object_get(now, "train"))
            fail("the coordinator wrote a journal it would not read");
        json_decref(now);
    }
    free(text);
    return 0;
}
