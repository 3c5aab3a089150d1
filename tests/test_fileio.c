/* core/formats/fileio: atomic writes that never follow a planted link, the modes
 * of what they create, writes that never replace, and directories
 * confined to a root (issue 15, finding 4). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/formats/fileio.h"
#include "tests/check.h"

static char dir[256];

static const char *at(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static void spit(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* The file's text (at most 255 bytes), "" when unreadable. */
static const char *slurp(const char *path)
{
    static char buf[256];
    buf[0] = '\0';
    FILE *f = fopen(path, "rb");
    if (f) {
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        buf[n] = '\0';
        fclose(f);
    }
    return buf;
}

static unsigned mode_of(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0 ? (unsigned)(sb.st_mode & 07777) : 0xffffu;
}

static void test_planted_links(void)
{
    nl_error err = {0};
    char tmp[600];
    char target[512], victim[512];
    snprintf(target, sizeof target, "%s", at("shard.safetensors"));
    snprintf(victim, sizeof victim, "%s", at("victim"));
    spit(victim, "precious");
    /* links at the temporary names, the old one (<path>.tmp.<pid>) and the first new one */
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", target, (long)getpid());
    CHECK(symlink(victim, tmp) == 0, "symlink %s", tmp);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld.0", target, (long)getpid());
    CHECK(symlink(victim, tmp) == 0, "symlink %s", tmp);
    CHECK_OK(nl_file_write_atomic(target, "weights", 7, &err), &err);
    CHECK(strcmp(slurp(victim), "precious") == 0,
          "the victim was written through a planted link: "
          "'%s'",
          slurp(victim));
    CHECK(strcmp(slurp(target), "weights") == 0, "the file: '%s'", slurp(target));
    CHECK(mode_of(target) == 0600, "mode %o, expected 600", mode_of(target));
    /* a link at the final name is replaced, not followed */
    const char *named = at("named");
    CHECK(symlink(victim, named) == 0, "symlink");
    CHECK_OK(nl_file_write_atomic(named, "new", 3, &err), &err);
    struct stat sb;
    CHECK(lstat(named, &sb) == 0 && S_ISREG(sb.st_mode), "the link at the final name is replaced");
    CHECK(strcmp(slurp(victim), "precious") == 0, "victim written through the final name");
    /* every temporary name taken: a clean refusal */
    const char *busy = at("busy");
    for (int k = 0; k < 64; k++) {
        snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%d", busy, (long)getpid(), k);
        CHECK(symlink(victim, tmp) == 0, "symlink %d", k);
    }
    nl_status st = nl_file_write_atomic(busy, "x", 1, &err);
    CHECK(st == NL_ERR_IO && strstr(err.msg, "cannot create"), "all names taken: %s '%s'",
          nl_status_str(st), err.msg);
    CHECK(strcmp(slurp(victim), "precious") == 0, "victim");
    /* another mode on request */
    nl_atomic_file *af = NULL;
    CHECK_OK(nl_atomic_open_mode(&af, at("public"), 0644, &err), &err);
    CHECK_OK(nl_atomic_commit(&af, &err), &err);
    CHECK(mode_of(at("public")) == 0644, "mode %o", mode_of(at("public")));
}

static void test_no_replace(void)
{
    nl_error err = {0};
    nl_atomic_file *af = NULL;
    const char *p = at("manifest.json");
    CHECK_OK(nl_atomic_open(&af, p, &err), &err);
    CHECK_OK(nl_atomic_write(af, "one", 3, &err), &err);
    CHECK_OK(nl_atomic_commit_new(&af, &err), &err);
    CHECK(af == NULL && strcmp(slurp(p), "one") == 0, "first commit");
    CHECK_OK(nl_atomic_open(&af, p, &err), &err);
    CHECK_OK(nl_atomic_write(af, "two", 3, &err), &err);
    nl_status st = nl_atomic_commit_new(&af, &err);
    CHECK(st == NL_ERR_STATE && strstr(err.msg, "refusing to replace") && af == NULL,
          "second commit: %s '%s'", nl_status_str(st), err.msg);
    CHECK(strcmp(slurp(p), "one") == 0, "kept: '%s'", slurp(p));
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld.0", p, (long)getpid());
    CHECK(access(tmp, F_OK) != 0, "no temporary left behind");
}

static void test_confine(void)
{
    nl_error err = {0};
    char *out = NULL, want[PATH_MAX + 16], rroot[PATH_MAX];
    char root[512], outside[512];
    snprintf(root, sizeof root, "%s", at("root"));
    snprintf(outside, sizeof outside, "%s", at("outside"));
    CHECK_OK(nl_file_mkdirs(at("root/a"), &err), &err);
    CHECK(mode_of(root) == 0700 && mode_of(at("root/a")) == 0700, "mkdirs: modes %o %o",
          mode_of(root), mode_of(at("root/a")));
    CHECK(mkdir(outside, 0700) == 0, "mkdir outside");
    CHECK(realpath(root, rroot) != NULL, "realpath");
    /* a directory under the root, partly missing: made and resolved */
    CHECK_OK(nl_path_confine(root, at("root/a/b/c"), &out, &err), &err);
    snprintf(want, sizeof want, "%s/a/b/c", rroot);
    CHECK(out && strcmp(out, want) == 0, "resolved: %s, expected %s", out ? out : "-", want);
    CHECK(mode_of(at("root/a/b/c")) == 0700, "made 0700: %o", mode_of(at("root/a/b/c")));
    free(out);
    out = NULL;
    /* a link inside the root that leads outside */
    CHECK(symlink(outside, at("root/escape")) == 0, "symlink");
    nl_status st = nl_path_confine(root, at("root/escape/step-000001"), &out, &err);
    CHECK(st == NL_ERR_AUTH && out == NULL && strstr(err.msg, "outside the root"),
          "escape by link: %s '%s'", nl_status_str(st), err.msg);
    CHECK(!strstr(err.msg, outside), "the refusal says where the link leads: '%s'", err.msg);
    CHECK(access(at("outside/step-000001"), F_OK) != 0, "nothing made outside the root");
    st = nl_path_confine(root, at("root/escape"), &out, &err);
    CHECK(st == NL_ERR_AUTH, "the link itself: %s '%s'", nl_status_str(st), err.msg);
    /* text checks: relative, "..", "." */
    st = nl_path_confine(root, "relative/dir", &out, &err);
    CHECK(st == NL_ERR_INVALID, "relative: %s", err.msg);
    char dd[600];
    snprintf(dd, sizeof dd, "%s/a/../../outside", root);
    st = nl_path_confine(root, dd, &out, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, ".."), "dotdot: %s", err.msg);
    snprintf(dd, sizeof dd, "%s/./a", root);
    st = nl_path_confine(root, dd, &out, &err);
    CHECK(st == NL_ERR_INVALID, "dot: %s", err.msg);
    /* a sibling whose name starts with the root's is not under it */
    CHECK(mkdir(at("rootx"), 0700) == 0, "mkdir rootx");
    st = nl_path_confine(root, at("rootx"), &out, &err);
    CHECK(st == NL_ERR_AUTH, "prefix sibling: %s '%s'", nl_status_str(st), err.msg);
    /* the root given through a link is resolved first */
    CHECK(symlink(root, at("rootlink")) == 0, "symlink root");
    CHECK_OK(nl_path_confine(at("rootlink"), at("root/a"), &out, &err), &err);
    free(out);
    out = NULL;
    /* a root that does not exist */
    st = nl_path_confine(at("none"), at("root/a"), &out, &err);
    CHECK(st == NL_ERR_NOTFOUND, "missing root: %s '%s'", nl_status_str(st), err.msg);
    /* "/" admits every directory */
    CHECK_OK(nl_path_confine("/", at("outside"), &out, &err), &err);
    free(out);
}

/* Run locks (issue 34, item 4): a second taker is refused with the
 * holder's pid while the first holds the lock; after the release (or the
 * holder's death) the path is free again and no lock file is left. */
static void test_run_lock(void)
{
    nl_error err = {0};
    nl_file_lock *a = NULL, *b = NULL;
    const char *lp = at("ck.lock");
    CHECK(nl_file_lock_take(&a, lp, "--checkpoint-dir ck", &err) == NL_OK, "take: %s", err.msg);
    /* flock conflicts between two opens even in one process: the second
     * take stands for a second run */
    nl_status st = nl_file_lock_take(&b, lp, "--checkpoint-dir ck", &err);
    char pid[32];
    snprintf(pid, sizeof pid, "(pid %ld)", (long)getpid());
    CHECK(st == NL_ERR_STATE && !b, "the second take is refused (%s)", nl_status_str(st));
    CHECK(strstr(err.msg, pid) && strstr(err.msg, "--checkpoint-dir ck"),
          "the refusal names the path and the holder's pid: %s", err.msg);
    nl_file_lock_release(&a);
    CHECK(!a && access(lp, F_OK) != 0, "released: the lock file is gone");
    nl_file_lock_release(&a); /* safe twice */
    CHECK(nl_file_lock_take(&b, lp, "x", &err) == NL_OK, "free again: %s", err.msg);
    nl_file_lock_release(&b);
    /* a holder that dies holds nothing (the child exits with the lock) */
    pid_t child = fork();
    if (child == 0) {
        nl_file_lock *c = NULL;
        _exit(nl_file_lock_take(&c, lp, "x", &err) == NL_OK ? 0 : 1);
    }
    int ws = 0;
    waitpid(child, &ws, 0);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the child took the lock");
    CHECK(nl_file_lock_take(&b, lp, "x", &err) == NL_OK, "a dead holder's lock: %s", err.msg);
    nl_file_lock_release(&b);
    /* a planted link at the lock's name is not followed */
    CHECK(symlink(at("elsewhere"), lp) == 0, "symlink");
    CHECK(nl_file_lock_take(&b, lp, "x", &err) == NL_ERR_IO && access(at("elsewhere"), F_OK) != 0,
          "a link at the lock's name is refused, nothing made where it points");
    unlink(lp);
}

/* Issue 31: the trusted-file reader opens regular files only: a FIFO
 * (which `import --hf` waited on for ever, as config.json) and a
 * directory are refused at once, naming the path; a regular file is read.
 * alarm() turns a wait for ever into a failure. */
static void test_read_regular_only(void)
{
    char fifo[300], sub[300], reg[300];
    snprintf(fifo, sizeof fifo, "%s/config.json", dir);
    snprintf(sub, sizeof sub, "%s/adir", dir);
    snprintf(reg, sizeof reg, "%s/plain.json", dir);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    CHECK(mkdir(sub, 0700) == 0, "mkdir %s", sub);
    nl_error err = {0};
    char *text = NULL;
    size_t len = 0;
    alarm(20);
    nl_status st = nl_file_read_all(fifo, 1 << 20, &text, &len, &err);
    CHECK(st == NL_ERR_IO && strstr(err.msg, "not a regular file") && strstr(err.msg, fifo),
          "a FIFO: %s", err.msg);
    st = nl_file_read_all(sub, 1 << 20, &text, &len, &err);
    CHECK(st == NL_ERR_IO && strstr(err.msg, "not a regular file"), "a directory: %s", err.msg);
    alarm(0);
    CHECK_OK(nl_file_write_atomic(reg, "{}", 2, &err), &err);
    CHECK_OK(nl_file_read_all(reg, 1 << 20, &text, &len, &err), &err);
    CHECK(text && len == 2 && strcmp(text, "{}") == 0, "the regular file's bytes");
    free(text);
}

int main(void)
{
    umask(022);
    snprintf(dir, sizeof dir, "/tmp/nl_test_fileio_%d", (int)getpid());
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    test_planted_links();
    test_no_replace();
    test_confine();
    test_run_lock();
    test_read_regular_only();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return check_done("test_fileio");
}
