/* The ZAP handler thread, allow-lists per domain, and the strike table. */
#include "net/auth.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/log.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define MAX_DOMAINS 256
#define ZAP_MAX_PARTS 8

typedef struct domain {
    char name[NL_ZAP_DOMAIN_MAX];
    nl_keylist keys;
    char *path;        /* watched authorized_keys file, or NULL */
    nl_keylist pinned; /* admitted whatever the file says (nl_auth_pin_key) */
    bool plaintext;
    int role_mask; /* only keys with one of these roles (nl_auth_set_domain_roles); 0: any */
} domain;

typedef struct strike {
    char id[NL_PEER_ID_MAX];
    uint32_t count;
    int64_t window_start, last, banned_until; /* monotonic ms */
} strike;

struct nl_auth {
    void *zctx;
    void *zap;                   /* REP on ZAP_ENDPOINT: the thread's */
    void *ctl_main, *ctl_thread; /* PAIR: stop command */
    pthread_t thread;
    bool running;
    pthread_mutex_t mu;
    nl_auth_policy pol;
    domain doms[MAX_DOMAINS];
    int ndoms;
    strike *strikes;
    int nstrikes;
    nl_auth_stats stats;
    int64_t deny_log_at;
    uint64_t deny_quiet;
};

nl_auth_policy nl_auth_policy_default(void)
{
    nl_auth_policy p = {
        .strike_limit = 5, .strike_window_ms = 60000, .ban_ms = 300000, .max_peers = 1024};
    return p;
}

/* ---- domains (callers hold mu) ---- */

static domain *find_domain(nl_auth *a, const char *name)
{
    for (int i = 0; i < a->ndoms; i++)
        if (strcmp(a->doms[i].name, name) == 0)
            return &a->doms[i];
    return NULL;
}

static nl_status get_domain(nl_auth *a, const char *name, domain **out, nl_error *err)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n >= NL_ZAP_DOMAIN_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "ZAP domain '%.80s' must be 1-%d bytes",
                            name ? name : "", NL_ZAP_DOMAIN_MAX - 1);
    *out = find_domain(a, name);
    if (*out)
        return NL_OK;
    if (a->ndoms == MAX_DOMAINS)
        return nl_error_set(err, NL_ERR_LIMIT, "more than %d ZAP domains", MAX_DOMAINS);
    domain *d = &a->doms[a->ndoms++];
    memset(d, 0, sizeof *d);
    memcpy(d->name, name, n + 1);
    *out = d;
    return NL_OK;
}

/* ---- strikes (callers hold mu) ---- */

static strike *find_strike(nl_auth *a, const char *peer)
{
    for (int i = 0; i < a->nstrikes; i++)
        if (strcmp(a->strikes[i].id, peer) == 0)
            return &a->strikes[i];
    return NULL;
}

static bool banned_locked(nl_auth *a, const char *peer, int64_t now)
{
    strike *s = find_strike(a, peer);
    return s && s->banned_until > now;
}

/* A slot for a new peer: a free one, else the least recently struck peer
 * that is not banned, else the ban that ends first. */
static strike *new_strike(nl_auth *a, const char *peer, int64_t now)
{
    strike *s = &a->strikes[0];
    if (a->nstrikes < a->pol.max_peers) {
        s = &a->strikes[a->nstrikes++];
    } else {
        for (int i = 1; i < a->nstrikes; i++) {
            strike *c = &a->strikes[i];
            bool cb = c->banned_until > now, sb = s->banned_until > now;
            if ((sb && !cb) ||
                (sb == cb && (cb ? c->banned_until < s->banned_until : c->last < s->last)))
                s = c;
        }
    }
    memset(s, 0, sizeof *s);
    snprintf(s->id, sizeof s->id, "%s", peer);
    s->window_start = now;
    return s;
}

bool nl_auth_strike(nl_auth *a, const char *peer, const char *why)
{
    if (!a || !peer || !peer[0])
        return false;
    bool banned = false;
    int64_t now = nl_mono_ms();
    pthread_mutex_lock(&a->mu);
    strike *s = find_strike(a, peer);
    if (!s)
        s = new_strike(a, peer, now);
    a->stats.strikes++;
    if (s->banned_until > now) {
        banned = true;
        goto out;
    }
    if (now - s->window_start > a->pol.strike_window_ms) {
        s->window_start = now;
        s->count = 0;
    }
    s->last = now;
    if (++s->count >= (uint32_t)a->pol.strike_limit) {
        s->banned_until = now + a->pol.ban_ms;
        s->count = 0;
        a->stats.bans++;
        banned = true;
        NL_WARN("auth: banning peer %.48s for %d ms after %d bad messages (last: %s)", peer,
                a->pol.ban_ms, a->pol.strike_limit, why ? why : "?");
    }
out:
    pthread_mutex_unlock(&a->mu);
    return banned;
}

bool nl_auth_banned(nl_auth *a, const char *peer)
{
    pthread_mutex_lock(&a->mu);
    bool b = banned_locked(a, peer, nl_mono_ms());
    pthread_mutex_unlock(&a->mu);
    return b;
}

int nl_auth_tracked_peers(nl_auth *a)
{
    pthread_mutex_lock(&a->mu);
    int n = a->nstrikes;
    pthread_mutex_unlock(&a->mu);
    return n;
}

void nl_auth_note_drop(nl_auth *a)
{
    pthread_mutex_lock(&a->mu);
    a->stats.dropped++;
    pthread_mutex_unlock(&a->mu);
}

void nl_auth_get_stats(nl_auth *a, nl_auth_stats *out)
{
    pthread_mutex_lock(&a->mu);
    *out = a->stats;
    pthread_mutex_unlock(&a->mu);
}

/* ---- decisions ---- */

/* The roles peer has on domain d now, within the domain's mask; 0: it is
 * not admitted (unlisted, banned, or none of the roles the domain takes). */
static int roles_locked(nl_auth *a, const domain *d, const char *peer)
{
    if (!d || !peer || banned_locked(a, peer, nl_mono_ms()))
        return 0;
    int roles = 0;
    uint8_t key[NL_KEY_BYTES];
    if (strncmp(peer, "plain:", 6) == 0)
        roles = d->plaintext ? NL_KEY_ROLE_ALL : 0; /* INSECURE: no keys, so no roles either */
    else if (nl_key_decode(key, peer, NULL) == NL_OK)
        roles = nl_keylist_roles(&d->keys, key);
    return d->role_mask ? roles & d->role_mask : roles;
}

static bool allowed_locked(nl_auth *a, const char *domain_name, const char *peer)
{
    return roles_locked(a, find_domain(a, domain_name), peer) != 0;
}

int nl_auth_roles(nl_auth *a, const char *domain_name, const char *peer)
{
    pthread_mutex_lock(&a->mu);
    const int roles = roles_locked(a, find_domain(a, domain_name), peer);
    pthread_mutex_unlock(&a->mu);
    return roles;
}

nl_status nl_auth_set_domain_roles(nl_auth *a, const char *domain_name, int roles, nl_error *err)
{
    if (roles & ~NL_KEY_ROLE_ALL)
        return nl_error_set(err, NL_ERR_INVALID, "ZAP domain %.80s: role bits 0x%x unknown",
                            domain_name ? domain_name : "", roles & ~NL_KEY_ROLE_ALL);
    pthread_mutex_lock(&a->mu);
    domain *d;
    nl_status st = get_domain(a, domain_name, &d, err);
    if (st == NL_OK)
        d->role_mask = roles;
    pthread_mutex_unlock(&a->mu);
    return st;
}

bool nl_auth_allowed(nl_auth *a, const char *domain_name, const char *peer)
{
    pthread_mutex_lock(&a->mu);
    bool ok = allowed_locked(a, domain_name, peer);
    pthread_mutex_unlock(&a->mu);
    return ok;
}

/* Under mu: d's list becomes kl (taken) plus its pinned keys. */
static void install_keys(domain *d, nl_keylist *kl)
{
    nl_error e;
    for (size_t i = 0; i < d->pinned.n; i++)
        if (!nl_keylist_has(kl, d->pinned.keys[i]) &&
            nl_keylist_add_roles(kl, d->pinned.keys[i], d->pinned.roles[i], &e) != NL_OK)
            NL_WARN("auth: domain %s: a pinned key is left out: %s", d->name, e.msg);
    nl_keylist_sort(kl);
    nl_keylist_free(&d->keys);
    d->keys = *kl;
    *kl = (nl_keylist){0};
}

nl_status nl_auth_set_keys(nl_auth *a, const char *domain_name, const nl_keylist *keys,
                           nl_error *err)
{
    nl_keylist copy = {0};
    nl_status st = nl_keylist_copy(&copy, keys, err);
    if (st != NL_OK)
        return st;
    nl_keylist_sort(&copy);
    pthread_mutex_lock(&a->mu);
    domain *d;
    st = get_domain(a, domain_name, &d, err);
    if (st == NL_OK)
        install_keys(d, &copy);
    pthread_mutex_unlock(&a->mu);
    nl_keylist_free(&copy);
    return st;
}

nl_status nl_auth_set_keys_z85(nl_auth *a, const char *domain_name, const char *const *keys,
                               size_t n, nl_error *err)
{
    nl_keylist kl = {0};
    nl_status st = NL_OK;
    for (size_t i = 0; i < n && st == NL_OK; i++) {
        uint8_t k[NL_KEY_BYTES];
        st = nl_key_decode(k, keys[i], err);
        if (st == NL_OK)
            st = nl_keylist_add(&kl, k, err);
    }
    if (st == NL_OK)
        st = nl_auth_set_keys(a, domain_name, &kl, err);
    nl_keylist_free(&kl);
    return st;
}

nl_status nl_auth_watch_file(nl_auth *a, const char *domain_name, const char *path, nl_error *err)
{
    nl_keylist kl = {0};
    char *p = strdup(path);
    if (!p)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    nl_status st = nl_keylist_load(&kl, path, err);
    if (st == NL_OK) {
        pthread_mutex_lock(&a->mu);
        domain *d;
        st = get_domain(a, domain_name, &d, err);
        if (st == NL_OK) {
            install_keys(d, &kl);
            free(d->path);
            d->path = p;
            p = NULL;
            NL_INFO("auth: domain %s admits %zu keys from %s", d->name, d->keys.n, path);
        }
        pthread_mutex_unlock(&a->mu);
    }
    nl_keylist_free(&kl);
    free(p);
    return st;
}

nl_status nl_auth_reload(nl_auth *a, nl_error *err)
{
    nl_status first = NL_OK;
    char path[4096], name[NL_ZAP_DOMAIN_MAX];
    /* file reads happen outside the lock; a domain is found again by name */
    for (int i = 0;; i++) {
        pthread_mutex_lock(&a->mu);
        bool more = i < a->ndoms;
        bool watched = more && a->doms[i].path;
        if (watched) {
            snprintf(path, sizeof path, "%s", a->doms[i].path);
            snprintf(name, sizeof name, "%s", a->doms[i].name);
        }
        pthread_mutex_unlock(&a->mu);
        if (!more)
            break;
        if (!watched)
            continue;
        nl_keylist kl = {0};
        nl_error e;
        nl_status st = nl_keylist_load(&kl, path, &e);
        if (st != NL_OK) {
            NL_WARN("auth: reload of %s failed, keeping the old list: %s", path, e.msg);
            if (first == NL_OK)
                first = nl_error_set(err, st, "%s", e.msg);
            continue;
        }
        pthread_mutex_lock(&a->mu);
        domain *d = find_domain(a, name);
        if (d) {
            install_keys(d, &kl);
            NL_INFO("auth: reloaded %s: domain %s admits %zu keys", path, name, d->keys.n);
        }
        pthread_mutex_unlock(&a->mu);
        nl_keylist_free(&kl);
    }
    return first;
}

nl_status nl_auth_pin_key(nl_auth *a, const char *domain_name, const char *z85, int roles,
                          nl_error *err)
{
    uint8_t k[NL_KEY_BYTES];
    nl_status st = nl_key_decode(k, z85, err);
    if (st != NL_OK)
        return st;
    if (!(roles & NL_KEY_ROLE_ALL) || (roles & ~NL_KEY_ROLE_ALL))
        return nl_error_set(err, NL_ERR_INVALID, "pinned key: role bits 0x%x", roles);
    pthread_mutex_lock(&a->mu);
    domain *d;
    st = get_domain(a, domain_name, &d, err);
    if (st == NL_OK && !nl_keylist_has(&d->pinned, k))
        st = nl_keylist_add_roles(&d->pinned, k, roles, err);
    if (st == NL_OK && !nl_keylist_has(&d->keys, k) &&
        (st = nl_keylist_add_roles(&d->keys, k, roles, err)) == NL_OK)
        nl_keylist_sort(&d->keys);
    pthread_mutex_unlock(&a->mu);
    return st;
}

nl_status nl_auth_allow_plaintext(nl_auth *a, const char *domain_name, nl_error *err)
{
    pthread_mutex_lock(&a->mu);
    domain *d;
    nl_status st = get_domain(a, domain_name, &d, err);
    if (st == NL_OK)
        d->plaintext = true;
    pthread_mutex_unlock(&a->mu);
    if (st == NL_OK)
        NL_WARN("auth: INSECURE: domain %s admits plaintext peers without authentication",
                domain_name);
    return st;
}

void nl_auth_drop_domain(nl_auth *a, const char *domain_name)
{
    if (!a || !domain_name)
        return;
    pthread_mutex_lock(&a->mu);
    domain *d = find_domain(a, domain_name);
    if (d) {
        nl_keylist_free(&d->keys);
        nl_keylist_free(&d->pinned);
        free(d->path);
        *d = a->doms[--a->ndoms];
    }
    pthread_mutex_unlock(&a->mu);
}

/* ---- the ZAP thread ---- */

static size_t part_str(zmq_msg_t *m, char *out, size_t cap)
{
    size_t n = zmq_msg_size(m);
    if (n >= cap)
        n = cap - 1;
    memcpy(out, zmq_msg_data(m), n);
    out[n] = '\0';
    return n;
}

/* Decide one request. Frames (RFC 27): version, request id, domain,
 * address, routing id, mechanism, credentials... */
static bool zap_decide(nl_auth *a, zmq_msg_t *p, int n, char *user, const char **why)
{
    char ver[8], dom[NL_ZAP_DOMAIN_MAX], addr[NL_PEER_ID_MAX - 6], mech[16];
    *why = "malformed request";
    if (n < 6)
        return false;
    part_str(&p[0], ver, sizeof ver);
    part_str(&p[2], dom, sizeof dom);
    part_str(&p[3], addr, sizeof addr);
    part_str(&p[5], mech, sizeof mech);
    if (strcmp(ver, "1.0") != 0)
        return false;
    if (strcmp(mech, "CURVE") == 0 && n == 7 && zmq_msg_size(&p[6]) == NL_KEY_BYTES) {
        nl_key_encode(user, zmq_msg_data(&p[6]));
        *why = "key not authorised";
    } else if (strcmp(mech, "NULL") == 0 && n == 6) {
        snprintf(user, NL_PEER_ID_MAX, "plain:%s", addr);
        *why = "plaintext not allowed";
    } else {
        *why = "mechanism not allowed";
        return false;
    }
    pthread_mutex_lock(&a->mu);
    bool ok = allowed_locked(a, dom, user);
    if (!ok && banned_locked(a, user, nl_mono_ms()))
        *why = "peer banned";
    pthread_mutex_unlock(&a->mu);
    return ok;
}

static void zap_log_denial(nl_auth *a, const char *user, const char *why)
{
    int64_t now = nl_mono_ms();
    if (now - a->deny_log_at < 1000) { /* at most one line a second */
        a->deny_quiet++;
        return;
    }
    NL_WARN("auth: refused %.48s: %s (%llu more refusals not logged)", user[0] ? user : "peer", why,
            (unsigned long long)a->deny_quiet);
    a->deny_log_at = now;
    a->deny_quiet = 0;
}

static void zap_handle(nl_auth *a)
{
    zmq_msg_t p[ZAP_MAX_PARTS], extra;
    int n = 0;
    bool more = true, overflow = false;
    while (more) {
        zmq_msg_t *m = n < ZAP_MAX_PARTS ? &p[n] : &extra;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, a->zap, 0) < 0) {
            zmq_msg_close(m);
            break;
        }
        more = zmq_msg_more(m);
        if (m == &extra) {
            overflow = true;
            zmq_msg_close(m);
        } else {
            n++;
        }
    }
    char user[NL_PEER_ID_MAX] = "";
    const char *why = "too many frames";
    bool ok = !overflow && zap_decide(a, p, n, user, &why);
    pthread_mutex_lock(&a->mu);
    if (ok)
        a->stats.allowed++;
    else
        a->stats.denied++;
    if (!ok)
        zap_log_denial(a, user, why);
    pthread_mutex_unlock(&a->mu);
    /* REP must answer every request */
    zmq_send(a->zap, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(a->zap, n >= 2 ? zmq_msg_data(&p[1]) : "", n >= 2 ? zmq_msg_size(&p[1]) : 0,
             ZMQ_SNDMORE);
    zmq_send(a->zap, ok ? "200" : "400", 3, ZMQ_SNDMORE);
    zmq_send(a->zap, ok ? "OK" : why, strlen(ok ? "OK" : why), ZMQ_SNDMORE);
    zmq_send(a->zap, user, ok ? strlen(user) : 0, ZMQ_SNDMORE);
    zmq_send(a->zap, "", 0, 0);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&p[i]);
}

static void *zap_thread(void *arg)
{
    nl_auth *a = arg;
    zmq_pollitem_t items[2] = {{a->zap, 0, ZMQ_POLLIN, 0}, {a->ctl_thread, 0, ZMQ_POLLIN, 0}};
    for (;;) {
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            break; /* ETERM */
        }
        if (items[1].revents & ZMQ_POLLIN)
            break;
        if (items[0].revents & ZMQ_POLLIN)
            zap_handle(a);
    }
    return NULL;
}

nl_status nl_auth_new(nl_auth **out, void *zctx, const nl_auth_policy *policy, nl_error *err)
{
    *out = NULL;
    nl_status st = NL_OK;
    char ctl[64];
    int zero = 0;
    nl_auth *a = calloc(1, sizeof *a);
    if (!a)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    a->zctx = zctx;
    a->pol = policy ? *policy : nl_auth_policy_default();
    if (a->pol.max_peers < 1 || a->pol.strike_limit < 1 || a->pol.ban_ms < 0 ||
        a->pol.strike_window_ms < 0) {
        free(a);
        return nl_error_set(err, NL_ERR_INVALID, "auth policy: limits must be positive");
    }
    pthread_mutex_init(&a->mu, NULL);
    a->strikes = calloc((size_t)a->pol.max_peers, sizeof *a->strikes);
    a->zap = zmq_socket(zctx, ZMQ_REP);
    a->ctl_main = zmq_socket(zctx, ZMQ_PAIR);
    a->ctl_thread = zmq_socket(zctx, ZMQ_PAIR);
    if (!a->strikes || !a->zap || !a->ctl_main || !a->ctl_thread) {
        st = nl_error_set(err, NL_ERR_NOMEM, "auth: cannot create sockets: %s",
                          zmq_strerror(zmq_errno()));
        goto fail;
    }
    zmq_setsockopt(a->zap, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(a->ctl_main, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(a->ctl_thread, ZMQ_LINGER, &zero, sizeof zero);
    snprintf(ctl, sizeof ctl, "inproc://nl-auth-ctl-%p", (void *)a);
    if (zmq_bind(a->zap, ZAP_ENDPOINT) != 0) {
        st = nl_error_set(err, NL_ERR_STATE, "auth: cannot bind %s: %s", ZAP_ENDPOINT,
                          zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_bind(a->ctl_thread, ctl) != 0 || zmq_connect(a->ctl_main, ctl) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "auth: control pipe: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (pthread_create(&a->thread, NULL, zap_thread, a) != 0) {
        st = nl_error_set(err, NL_ERR_NOMEM, "auth: cannot start the ZAP thread");
        goto fail;
    }
    a->running = true;
    *out = a;
    return NL_OK;
fail:
    nl_auth_destroy(&a);
    return st;
}

void nl_auth_destroy(nl_auth **ap)
{
    if (!ap || !*ap)
        return;
    nl_auth *a = *ap;
    if (a->running) {
        zmq_send(a->ctl_main, "", 0, 0);
        pthread_join(a->thread, NULL);
    }
    if (a->zap)
        zmq_close(a->zap);
    if (a->ctl_main)
        zmq_close(a->ctl_main);
    if (a->ctl_thread)
        zmq_close(a->ctl_thread);
    for (int i = 0; i < a->ndoms; i++) {
        nl_keylist_free(&a->doms[i].keys);
        nl_keylist_free(&a->doms[i].pinned);
        free(a->doms[i].path);
    }
    free(a->strikes);
    pthread_mutex_destroy(&a->mu);
    free(a);
    *ap = NULL;
}

/* ---- SIGHUP ---- */

static volatile sig_atomic_t hup_flag;

static void on_hup(int sig)
{
    (void)sig;
    hup_flag = 1;
}

nl_status nl_auth_hup_install(nl_error *err)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_hup;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGHUP, &sa, NULL) != 0)
        return nl_error_set(err, NL_ERR_IO, "cannot install the SIGHUP handler");
    return NL_OK;
}

bool nl_auth_hup_take(void)
{
    if (!hup_flag)
        return false;
    hup_flag = 0;
    return true;
}
