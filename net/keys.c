/* CURVE key files, Z85 and authorized_keys parsing. */
#include "net/keys.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "base/log.h"
#include "core/formats/fileio.h"

#define KEYFILE_MAX 4096
/* the first line of every secret key file keygen writes */
#define SECRET_HEADER "neurollm CURVE secret key"

/* ---- Z85 ---- */

nl_status nl_key_decode(uint8_t out[NL_KEY_BYTES], const char *z85, nl_error *err)
{
    size_t n = z85 ? strnlen(z85, NL_KEY_Z85_LEN + 1) : 0;
    char back[NL_KEY_Z85_LEN + 1];
    if (!nl_wire_z85_key_ok(z85, n) || !zmq_z85_decode(out, z85))
        return nl_error_set(err, NL_ERR_FORMAT, "'%.48s' is not a 40-character Z85 key",
                            z85 ? z85 : "");
    nl_key_encode(back, out);
    if (strcmp(back, z85) != 0) /* a 5-char group above 2^32 - 1 */
        return nl_error_set(err, NL_ERR_FORMAT, "'%.48s' is not a canonical Z85 key", z85);
    return NL_OK;
}

void nl_key_encode(char out[NL_KEY_Z85_LEN + 1], const uint8_t key[NL_KEY_BYTES])
{
    zmq_z85_encode(out, key, NL_KEY_BYTES);
}

/* ---- line parsing shared by key files and authorized_keys ---- */

typedef struct lines {
    const char *p, *end;
    int lineno;
    const char *rest, *rest_end; /* the last key line after its key token, blanks skipped */
} lines;

/* The next line that is not blank and not a comment, as [*s, *s + *n):
 * the key token; *rest_ok says whether what follows it is blank or a
 * comment. A comment line that looks like a '#'-leading key is reported
 * through *looks_like_key (the line number) and skipped. */
static bool next_key_line(lines *L, const char **s, size_t *n, bool *rest_ok, int *looks_like_key)
{
    while (L->p < L->end) {
        const char *b = L->p, *e = memchr(b, '\n', (size_t)(L->end - b));
        if (!e)
            e = L->end;
        L->p = e < L->end ? e + 1 : e;
        L->lineno++;
        while (b < e && (*b == ' ' || *b == '\t'))
            b++;
        while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r'))
            e--;
        if (b == e)
            continue;
        if (*b == '#') {
            if (e - b == NL_KEY_Z85_LEN && nl_wire_z85_key_ok(b, NL_KEY_Z85_LEN))
                *looks_like_key = L->lineno;
            continue;
        }
        const char *t = b;
        while (t < e && *t != ' ' && *t != '\t')
            t++;
        const char *r = t;
        while (r < e && (*r == ' ' || *r == '\t'))
            r++;
        *s = b;
        *n = (size_t)(t - b);
        *rest_ok = r == e || *r == '#';
        L->rest = r;
        L->rest_end = e;
        return true;
    }
    return false;
}

static nl_status parse_key_token(uint8_t out[NL_KEY_BYTES], const char *s, size_t n, bool rest_ok,
                                 const char *origin, int lineno, nl_error *err)
{
    char tok[NL_KEY_Z85_LEN + 1];
    if (n != NL_KEY_Z85_LEN || !rest_ok)
        return nl_error_set(err, NL_ERR_FORMAT, "%s:%d: expected one 40-character Z85 key", origin,
                            lineno);
    memcpy(tok, s, n);
    tok[n] = '\0';
    if (nl_key_decode(out, tok, err) != NL_OK)
        return nl_error_prefix(err, "%s:%d", origin, lineno);
    return NL_OK;
}

/* ---- keylist ---- */

void nl_keylist_free(nl_keylist *kl)
{
    if (!kl)
        return;
    free(kl->keys);
    free(kl->roles);
    memset(kl, 0, sizeof *kl);
}

nl_status nl_keylist_add(nl_keylist *kl, const uint8_t key[NL_KEY_BYTES], nl_error *err)
{
    return nl_keylist_add_roles(kl, key, NL_KEY_ROLE_ALL, err);
}

nl_status nl_keylist_add_roles(nl_keylist *kl, const uint8_t key[NL_KEY_BYTES], int roles,
                               nl_error *err)
{
    if (kl->n >= NL_AUTHKEYS_MAX_KEYS)
        return nl_error_set(err, NL_ERR_LIMIT, "more than %d keys", NL_AUTHKEYS_MAX_KEYS);
    if (kl->n == kl->cap) {
        size_t cap = kl->cap ? kl->cap * 2 : 16;
        void *p = realloc(kl->keys, cap * NL_KEY_BYTES);
        if (p)
            kl->keys = p;
        uint8_t *r = p ? realloc(kl->roles, cap) : NULL;
        if (!r)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory for %zu keys", cap);
        kl->roles = r;
        kl->cap = cap;
    }
    kl->roles[kl->n] = (uint8_t)(roles & NL_KEY_ROLE_ALL);
    memcpy(kl->keys[kl->n++], key, NL_KEY_BYTES);
    kl->sorted = false;
    return NL_OK;
}

static int key_cmp(const void *a, const void *b)
{
    return memcmp(a, b, NL_KEY_BYTES);
}

/* A key and its roles, to sort them together. */
typedef struct keyrole {
    uint8_t key[NL_KEY_BYTES];
    uint8_t roles;
} keyrole;

void nl_keylist_sort(nl_keylist *kl)
{
    keyrole *t = kl->n > 1 ? malloc(kl->n * sizeof *t) : NULL;
    if (kl->n > 1 && !t) { /* no memory to sort: lookups stay linear, and correct */
        kl->sorted = false;
        return;
    }
    for (size_t i = 0; t && i < kl->n; i++) {
        memcpy(t[i].key, kl->keys[i], NL_KEY_BYTES);
        t[i].roles = kl->roles[i];
    }
    if (t)
        qsort(t, kl->n, sizeof *t, key_cmp);
    size_t w = 0;
    for (size_t i = 0; t && i < kl->n; i++) {
        if (w > 0 && memcmp(kl->keys[w - 1], t[i].key, NL_KEY_BYTES) == 0) {
            kl->roles[w - 1] |= t[i].roles; /* a key listed twice has the roles of both lines */
            continue;
        }
        memcpy(kl->keys[w], t[i].key, NL_KEY_BYTES);
        kl->roles[w++] = t[i].roles;
    }
    if (t)
        kl->n = w;
    free(t);
    kl->sorted = true;
}

int nl_keylist_roles(const nl_keylist *kl, const uint8_t key[NL_KEY_BYTES])
{
    if (!kl || kl->n == 0)
        return 0;
    if (kl->sorted) {
        const uint8_t(*k)[NL_KEY_BYTES] = bsearch(key, kl->keys, kl->n, NL_KEY_BYTES, key_cmp);
        return k ? kl->roles[k - kl->keys] : 0;
    }
    int roles = 0;
    for (size_t i = 0; i < kl->n; i++)
        if (memcmp(kl->keys[i], key, NL_KEY_BYTES) == 0)
            roles |= kl->roles[i];
    return roles;
}

bool nl_keylist_has(const nl_keylist *kl, const uint8_t key[NL_KEY_BYTES])
{
    return nl_keylist_roles(kl, key) != 0;
}

nl_status nl_keylist_copy(nl_keylist *dst, const nl_keylist *src, nl_error *err)
{
    nl_keylist tmp = {0};
    if (src->n) {
        tmp.keys = malloc(src->n * NL_KEY_BYTES);
        tmp.roles = malloc(src->n);
        if (!tmp.keys || !tmp.roles) {
            free(tmp.keys);
            free(tmp.roles);
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory for %zu keys", src->n);
        }
        memcpy(tmp.keys, src->keys, src->n * NL_KEY_BYTES);
        memcpy(tmp.roles, src->roles, src->n);
    }
    tmp.n = tmp.cap = src->n;
    tmp.sorted = src->sorted;
    nl_keylist_free(dst);
    *dst = tmp;
    return NL_OK;
}

int nl_key_role_parse(const char *word, size_t n)
{
    static const struct {
        const char *word;
        int roles;
    } words[] = {{"node", NL_KEY_ROLE_NODE},
                 {"client", NL_KEY_ROLE_CLIENT},
                 {"admin", NL_KEY_ROLE_ADMIN | NL_KEY_ROLE_CLIENT}};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
        if (strlen(words[i].word) == n && memcmp(words[i].word, word, n) == 0)
            return words[i].roles;
    return 0;
}

/* The role words after a key, up to a comment: blank- or comma-separated,
 * each node, client or admin; *roles is 0 when there is none. */
static nl_status parse_roles(const char *p, const char *e, int *roles, const char *origin,
                             int lineno, nl_error *err)
{
    *roles = 0;
    while (p < e && *p != '#') {
        const char *w = p;
        while (p < e && *p != ' ' && *p != '\t' && *p != ',' && *p != '#')
            p++;
        const int r = nl_key_role_parse(w, (size_t)(p - w));
        if (!r)
            return nl_error_set(err, NL_ERR_FORMAT,
                                "%s:%d: after the key, expected role words (node, client, admin) "
                                "or a '#' comment",
                                origin, lineno);
        *roles |= r;
        while (p < e && (*p == ' ' || *p == '\t' || *p == ','))
            p++;
    }
    return NL_OK;
}

nl_status nl_keylist_parse(nl_keylist *kl, const char *text, size_t len, const char *origin,
                           nl_error *err)
{
    lines L = {text, text + len, 0, NULL, NULL};
    const char *s;
    size_t n;
    bool rest_ok;
    int odd = 0, bare = 0, bare_line = 0;
    nl_status st = NL_OK;
    nl_keylist_free(kl);
    if (len > NL_AUTHKEYS_MAX_BYTES)
        return nl_error_set(err, NL_ERR_LIMIT, "%s: %zu bytes, limit %u", origin, len,
                            NL_AUTHKEYS_MAX_BYTES);
    if (memchr(text, '\0', len))
        return nl_error_set(err, NL_ERR_FORMAT, "%s: holds a NUL byte", origin);
    while (st == NL_OK && next_key_line(&L, &s, &n, &rest_ok, &odd)) {
        uint8_t key[NL_KEY_BYTES];
        int roles = 0;
        st = parse_key_token(key, s, n, true, origin, L.lineno, err);
        if (st == NL_OK)
            st = parse_roles(L.rest, L.rest_end, &roles, origin, L.lineno, err);
        if (st == NL_OK && !roles) { /* no role word: every role, as before roles */
            roles = NL_KEY_ROLE_ALL;
            bare++;
            bare_line = bare_line ? bare_line : L.lineno;
        }
        if (st == NL_OK)
            st = nl_keylist_add_roles(kl, key, roles, err);
    }
    if (st != NL_OK) {
        nl_keylist_free(kl);
        return st;
    }
    if (odd)
        NL_WARN("%s:%d: comment line looks like a key starting with '#'; it is ignored", origin,
                odd);
    if (bare)
        NL_WARN("%s:%d: %d key%s without a role word (node, client or admin) may act in every "
                "role, as before roles existed; give each key its role",
                origin, bare_line, bare, bare == 1 ? "" : "s");
    nl_keylist_sort(kl);
    return NL_OK;
}

nl_status nl_keys_check_trusted(const char *path, nl_error *err)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO, "%s: %s", path,
                            strerror(errno));
    if (sb.st_mode & 022)
        return nl_error_set(err, NL_ERR_AUTH,
                            "%s is writable by %s (mode %04o): anyone there could change whom "
                            "this process trusts; refusing it (chmod go-w %s)",
                            path, sb.st_mode & 02 ? "others" : "its group",
                            (unsigned)(sb.st_mode & 07777), path);
    if (sb.st_uid != geteuid() && sb.st_uid != 0)
        return nl_error_set(err, NL_ERR_AUTH,
                            "%s is owned by uid %u, neither this user (%u) nor root; refusing it",
                            path, (unsigned)sb.st_uid, (unsigned)geteuid());
    return NL_OK;
}

nl_status nl_keylist_load(nl_keylist *kl, const char *path, nl_error *err)
{
    char *text = NULL;
    size_t len = 0;
    nl_status st = nl_keys_check_trusted(path, err);
    if (st != NL_OK)
        return st;
    st = nl_file_read_all(path, NL_AUTHKEYS_MAX_BYTES, &text, &len, err);
    if (st == NL_OK)
        st = nl_keylist_parse(kl, text, len, path, err);
    free(text);
    return st;
}

/* ---- key files ---- */

/* Read a small file; *mode gets its permission bits. */
static nl_status read_small(const char *path, char *buf, size_t cap, size_t *len, mode_t *mode,
                            nl_error *err)
{
    struct stat sb;
    nl_status st = NL_OK;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO,
                            "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = nl_error_set(err, NL_ERR_IO, "%s: not a regular file", path);
        goto out;
    }
    if ((size_t)sb.st_size >= cap) {
        st = nl_error_set(err, NL_ERR_LIMIT, "%s: %lld bytes is too large for a key file", path,
                          (long long)sb.st_size);
        goto out;
    }
    ssize_t r;
    size_t got = 0;
    while ((r = read(fd, buf + got, cap - 1 - got)) > 0)
        got += (size_t)r;
    if (r < 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: read failed: %s", path, strerror(errno));
        goto out;
    }
    buf[got] = '\0';
    *len = got;
    *mode = sb.st_mode & 07777;
out:
    close(fd);
    return st;
}

/* Exactly one key in a key file. */
static nl_status parse_single_key(uint8_t out[NL_KEY_BYTES], const char *text, size_t len,
                                  const char *path, nl_error *err)
{
    lines L = {text, text + len, 0, NULL, NULL};
    const char *s;
    size_t n;
    bool rest_ok;
    int odd = 0;
    if (memchr(text, '\0', len))
        return nl_error_set(err, NL_ERR_FORMAT, "%s: holds a NUL byte", path);
    if (!next_key_line(&L, &s, &n, &rest_ok, &odd))
        return nl_error_set(err, NL_ERR_FORMAT, "%s: no key in the file", path);
    nl_status st = parse_key_token(out, s, n, rest_ok, path, L.lineno, err);
    if (st == NL_OK && next_key_line(&L, &s, &n, &rest_ok, &odd))
        st = nl_error_set(err, NL_ERR_FORMAT, "%s:%d: more than one key in the file", path,
                          L.lineno);
    return st;
}

nl_status nl_keys_load_secret(nl_keypair *kp, const char *path, nl_error *err)
{
    char buf[KEYFILE_MAX];
    size_t len = 0;
    mode_t mode = 0;
    uint8_t sec[NL_KEY_BYTES];
    memset(kp, 0, sizeof *kp);
    nl_status st = read_small(path, buf, sizeof buf, &len, &mode, err);
    if (st != NL_OK)
        return st;
    if ((mode & 077) && !strstr(buf, SECRET_HEADER)) { /* 0644 and no header: a .pub */
        st = nl_error_set(err, NL_ERR_AUTH,
                          "%s is a public key (no secret-key header, mode %04o): give the "
                          "secret key, the .key file that neuroctl keygen wrote beside it",
                          path, (unsigned)mode);
        goto out;
    }
    if (mode & 077) {
        st = nl_error_set(err, NL_ERR_AUTH,
                          "%s: permissions %04o let others read the secret key; run chmod 600",
                          path, (unsigned)mode);
        goto out;
    }
    st = parse_single_key(sec, buf, len, path, err);
    if (st != NL_OK)
        goto out;
    nl_key_encode(kp->secret_z85, sec);
    if (zmq_curve_public(kp->public_z85, kp->secret_z85) != 0)
        st = nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: libzmq cannot derive the public key: %s",
                          path, zmq_strerror(zmq_errno()));
out:
    sodium_memzero(buf, sizeof buf);
    sodium_memzero(sec, sizeof sec);
    if (st != NL_OK)
        nl_keys_wipe(kp);
    return st;
}

nl_status nl_keys_load_public(char out[NL_KEY_Z85_LEN + 1], const char *path, nl_error *err)
{
    char buf[KEYFILE_MAX];
    size_t len = 0;
    mode_t mode;
    uint8_t pub[NL_KEY_BYTES];
    out[0] = '\0';
    nl_status st = read_small(path, buf, sizeof buf, &len, &mode, err);
    if (st == NL_OK && strstr(buf, SECRET_HEADER))
        st = nl_error_set(err, NL_ERR_AUTH,
                          "%s holds a secret key where a public one is expected: give the .pub "
                          "file beside it (and keep the .key private)",
                          path);
    if (st == NL_OK)
        st = parse_single_key(pub, buf, len, path, err);
    sodium_memzero(buf, sizeof buf);
    if (st == NL_OK)
        nl_key_encode(out, pub);
    return st;
}

nl_status nl_keys_generate(nl_keypair *kp, nl_error *err)
{
    /* a public key starting with '#' would read as a comment line */
    for (int tries = 0; tries < 64; tries++) {
        if (zmq_curve_keypair(kp->public_z85, kp->secret_z85) != 0)
            return nl_error_set(err, NL_ERR_UNSUPPORTED, "libzmq cannot make CURVE keys: %s",
                                zmq_strerror(zmq_errno()));
        if (kp->public_z85[0] != '#')
            return NL_OK;
    }
    return nl_error_set(err, NL_ERR_INTERNAL, "key generation kept producing '#' keys");
}

void nl_keys_wipe(nl_keypair *kp)
{
    if (kp)
        sodium_memzero(kp->secret_z85, sizeof kp->secret_z85);
}

static nl_status fsync_parent(const char *path, nl_error *err)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash == path ? 1 : slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        nl_status st = nl_error_set(err, NL_ERR_IO, "%s: cannot sync: %s", dir, strerror(errno));
        if (fd >= 0)
            close(fd);
        return st;
    }
    close(fd);
    return NL_OK;
}

/* The secret goes to a 0600 temporary file, then link() (no overwrite) or
 * rename() (overwrite) puts it in place. */
static nl_status write_secret(const char *path, const char *secret, bool overwrite, nl_error *err)
{
    char tmp[4200], line[160];
    nl_status st = NL_OK;
    int n = snprintf(line, sizeof line, "# " SECRET_HEADER ": keep it private (mode 0600)\n%s\n",
                     secret);
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return nl_error_set(err, NL_ERR_INVALID, "%s: path too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return nl_error_set(err, NL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    if (fchmod(fd, 0600) != 0 || write(fd, line, (size_t)n) != n || fsync(fd) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot write: %s", tmp, strerror(errno));
        close(fd);
        goto out;
    }
    if (close(fd) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
        goto out;
    }
    if (overwrite ? rename(tmp, path) != 0 : link(tmp, path) != 0) {
        st = nl_error_set(err, errno == EEXIST ? NL_ERR_STATE : NL_ERR_IO, "%s: %s", path,
                          errno == EEXIST ? "already exists (not overwritten)" : strerror(errno));
        goto out;
    }
    st = fsync_parent(path, err);
out:
    unlink(tmp); /* after rename it is gone already; after link it is the extra name */
    sodium_memzero(line, sizeof line);
    return st;
}

nl_status nl_keys_save(const nl_keypair *kp, const char *prefix, bool overwrite, nl_error *err)
{
    char kpath[4096], ppath[4096], pub[64];
    if (snprintf(kpath, sizeof kpath, "%s.key", prefix) >= (int)sizeof kpath ||
        snprintf(ppath, sizeof ppath, "%s.pub", prefix) >= (int)sizeof ppath)
        return nl_error_set(err, NL_ERR_INVALID, "%s: path too long", prefix);
    nl_status st = write_secret(kpath, kp->secret_z85, overwrite, err);
    if (st != NL_OK)
        return st;
    /* the public half is meant to be copied around: 0644, as ssh-keygen's */
    int n = snprintf(pub, sizeof pub, "%s\n", kp->public_z85);
    nl_atomic_file *af = NULL;
    if ((st = nl_atomic_open_mode(&af, ppath, 0644, err)) != NL_OK)
        return st;
    if ((st = nl_atomic_write(af, pub, (size_t)n, err)) != NL_OK) {
        nl_atomic_abort(&af);
        return st;
    }
    return nl_atomic_commit(&af, err);
}

nl_status nl_keys_ensure(const char *state_dir, nl_keypair *kp, bool *created, nl_error *err)
{
    char prefix[4096], kpath[4200], ppath[4200], pub[NL_KEY_Z85_LEN + 1];
    struct stat sb;
    if (created)
        *created = false;
    snprintf(prefix, sizeof prefix, "%s/coordinator", state_dir);
    snprintf(kpath, sizeof kpath, "%s.key", prefix);
    snprintf(ppath, sizeof ppath, "%s.pub", prefix);
    if (mkdir(state_dir, 0700) != 0 && errno != EEXIST)
        return nl_error_set(err, NL_ERR_IO, "%s: cannot create: %s", state_dir, strerror(errno));
    nl_status trusted = nl_keys_check_trusted(state_dir, err);
    if (trusted != NL_OK)
        return nl_error_prefix(err, "state dir");
    bool have_key = stat(kpath, &sb) == 0, have_pub = stat(ppath, &sb) == 0;
    if (!have_key && have_pub)
        return nl_error_set(err, NL_ERR_STATE,
                            "%s exists without %s; restore the key, or remove the .pub to make "
                            "a new coordinator identity (nodes must then trust the new key)",
                            ppath, kpath);
    if (!have_key) {
        nl_status st = nl_keys_generate(kp, err);
        if (st == NL_OK)
            st = nl_keys_save(kp, prefix, false, err);
        if (st != NL_OK) {
            nl_keys_wipe(kp);
            return st;
        }
        NL_INFO("created coordinator key %s (public %s)", kpath, kp->public_z85);
        if (created)
            *created = true;
        return NL_OK;
    }
    nl_status st = nl_keys_load_secret(kp, kpath, err);
    if (st != NL_OK)
        return st;
    if (!have_pub) {
        char line[NL_KEY_Z85_LEN + 2];
        int n = snprintf(line, sizeof line, "%s\n", kp->public_z85);
        st = nl_file_write_atomic(ppath, line, (size_t)n, err);
    } else {
        st = nl_keys_load_public(pub, ppath, err);
        if (st == NL_OK && strcmp(pub, kp->public_z85) != 0)
            st = nl_error_set(err, NL_ERR_AUTH, "%s does not match %s", ppath, kpath);
    }
    if (st != NL_OK)
        nl_keys_wipe(kp);
    return st;
}
