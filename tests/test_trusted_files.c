/* Files the operator trusts (issue 15, finding 11): an authorized_keys
 * file or a state dir that group or others may write is refused (at load
 * and at reload, where the old list stays), as secret keys that others
 * may read already are. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "base/log.h"
#include "net/auth.h"
#include "net/keys.h"
#include "tests/check.h"

static char dir[256];

static void write_keys(const char *path, const char *key, mode_t mode)
{
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "%s  # a node\n", key);
        fclose(f);
    }
    CHECK(chmod(path, mode) == 0, "chmod %s", path);
}

static void test_authorized_keys(void)
{
    nl_error err = {0};
    nl_keylist kl = {0};
    nl_keypair a, b;
    char path[300];
    CHECK_OK(nl_keys_generate(&a, &err), &err);
    CHECK_OK(nl_keys_generate(&b, &err), &err);
    snprintf(path, sizeof path, "%s/authorized_keys", dir);
    write_keys(path, a.public_z85, 0664);
    nl_status st = nl_keylist_load(&kl, path, &err);
    CHECK(st == NL_ERR_AUTH && strstr(err.msg, "writable by its group") && kl.n == 0,
          "group-writable authorized_keys: %s '%s'", nl_status_str(st), err.msg);
    chmod(path, 0606);
    st = nl_keylist_load(&kl, path, &err);
    CHECK(st == NL_ERR_AUTH && strstr(err.msg, "writable by others"), "other-writable: %s '%s'",
          nl_status_str(st), err.msg);
    chmod(path, 0644); /* readable is fine: public keys */
    CHECK_OK(nl_keylist_load(&kl, path, &err), &err);
    CHECK(kl.n == 1, "one key");
    nl_keylist_free(&kl);
    /* the coordinator's watch: refused at reload too, keeping the old list */
    void *zctx = zmq_ctx_new();
    nl_auth *auth = NULL;
    CHECK_OK(nl_auth_new(&auth, zctx, NULL, &err), &err);
    if (auth) {
        CHECK_OK(nl_auth_watch_file(auth, "coord", path, &err), &err);
        CHECK(nl_auth_allowed(auth, "coord", a.public_z85), "a admitted");
        write_keys(path, b.public_z85, 0666); /* someone else could have written this */
        st = nl_auth_reload(auth, &err);
        CHECK(st == NL_ERR_AUTH && strstr(err.msg, "authorized_keys"), "reload: %s '%s'",
              nl_status_str(st), err.msg);
        CHECK(nl_auth_allowed(auth, "coord", a.public_z85) &&
                  !nl_auth_allowed(auth, "coord", b.public_z85),
              "the old list stays");
        nl_auth_destroy(&auth);
    }
    zmq_ctx_term(zctx);
}

static void test_state_dir(void)
{
    nl_error err = {0};
    nl_keypair kp;
    char state[300];
    snprintf(state, sizeof state, "%s/state", dir);
    CHECK(mkdir(state, 0700) == 0 && chmod(state, 0770) == 0, "mkdir");
    nl_status st = nl_keys_ensure(state, &kp, NULL, &err);
    CHECK(st == NL_ERR_AUTH && strstr(err.msg, "state dir") && strstr(err.msg, "go-w"),
          "group-writable state dir: %s '%s'", nl_status_str(st), err.msg);
    char key[400];
    snprintf(key, sizeof key, "%s/coordinator.key", state);
    CHECK(access(key, F_OK) != 0, "no key made in it");
    chmod(state, 0755);
    bool created = false;
    CHECK_OK(nl_keys_ensure(state, &kp, &created, &err), &err);
    CHECK(created, "key created");
    CHECK_OK(nl_keys_check_trusted(state, &err), &err);
    CHECK(nl_keys_check_trusted("/tmp", &err) == NL_ERR_AUTH, "/tmp (1777) is not trusted");
}

int main(void)
{
    nl_log_set_level(NL_LOG_ERROR);
    umask(0);
    snprintf(dir, sizeof dir, "/tmp/nl_test_trusted_%d", (int)getpid());
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    test_authorized_keys();
    test_state_dir();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return check_done("test_trusted_files");
}
