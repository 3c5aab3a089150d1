/* CURVE keys: generation, key files, Z85, and authorized_keys lists.
 *
 * Files (docs/security.md):
 *   PREFIX.key  the secret key in Z85 on one line (comment lines start
 *               with '#'); mode 0600, refused when group or others can
 *               read it.
 *   PREFIX.pub  the public key in Z85 on one line.
 *   authorized_keys  Z85 public keys, one per line, each followed by its
 *               role words (node, client, admin; blank- or comma-
 *               separated); a line whose first non-blank character is '#'
 *               is a comment, and "# ..." may follow a key and its roles.
 *               A key without a role word has every role (as before roles
 *               existed), with a warning at each load.
 * Z85 uses '#', so a key could start with it; keygen never makes such a
 * key, and the parser warns when a comment line looks like one. */
#ifndef NL_KEYS_H
#define NL_KEYS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "net/wire.h"

#define NL_KEY_BYTES 32
#define NL_AUTHKEYS_MAX_BYTES (4u << 20) /* authorized_keys file size limit */
#define NL_AUTHKEYS_MAX_KEYS 100000

typedef struct nl_keypair {
    char public_z85[NL_KEY_Z85_LEN + 1];
    char secret_z85[NL_KEY_Z85_LEN + 1];
} nl_keypair;

/* A new keypair (libsodium randomness through libzmq). */
nl_status nl_keys_generate(nl_keypair *kp, nl_error *err);
/* Write PREFIX.key (0600, created before any byte is written) and
 * PREFIX.pub. Refuses to replace an existing PREFIX.key unless overwrite. */
nl_status nl_keys_save(const nl_keypair *kp, const char *prefix, bool overwrite, nl_error *err);
/* Load a secret key file and derive its public key. */
nl_status nl_keys_load_secret(nl_keypair *kp, const char *path, nl_error *err);
/* Load a public key file (e.g. --coordinator-key FILE). */
nl_status nl_keys_load_public(char out[NL_KEY_Z85_LEN + 1], const char *path, nl_error *err);
/* The coordinator's identity: load <state_dir>/coordinator.key (and check
 * coordinator.pub), or create both on first start (state_dir is created
 * with mode 0700 if absent, and refused by nl_keys_check_trusted).
 * *created (may be NULL) says which. */
nl_status nl_keys_ensure(const char *state_dir, nl_keypair *kp, bool *created, nl_error *err);
/* A file or directory this process trusts (authorized_keys, a state
 * dir): NL_ERR_AUTH when group or others may write it, or when it belongs
 * to another user than this one or root; the message says which and how
 * to fix it. Links are followed (the object itself is judged).
 * nl_keylist_load and nl_keys_ensure apply it; a daemon applies it to any
 * other such path it reads. */
nl_status nl_keys_check_trusted(const char *path, nl_error *err);
/* Overwrite the secret in memory. */
void nl_keys_wipe(nl_keypair *kp);

/* Z85 <-> 32 bytes. Decoding checks the alphabet and that the text is
 * the canonical encoding of the bytes. */
nl_status nl_key_decode(uint8_t out[NL_KEY_BYTES], const char *z85, nl_error *err);
void nl_key_encode(char out[NL_KEY_Z85_LEN + 1], const uint8_t key[NL_KEY_BYTES]);

/* What a key may do on the coordinator (docs/security.md): a node joins
 * and computes; a client submits, queries and cancels its own jobs; an
 * admin is a client that also sees the cluster's nodes (keys, endpoints)
 * and may cancel any job. Bits of a mask. */
#define NL_KEY_ROLE_NODE 1
#define NL_KEY_ROLE_CLIENT 2
#define NL_KEY_ROLE_ADMIN 4
#define NL_KEY_ROLE_ALL 7

/* A role word's bits ("admin" is admin and client), 0 if it is none. */
int nl_key_role_parse(const char *word, size_t n);

/* A set of public keys (binary) with their roles, sorted after parsing
 * for lookups. */
typedef struct nl_keylist {
    size_t n, cap;
    uint8_t (*keys)[NL_KEY_BYTES];
    uint8_t *roles; /* per key, NL_KEY_ROLE_* bits */
    bool sorted;
} nl_keylist;

/* Parse authorized_keys text into kl (replacing its contents). origin
 * names the file in messages ("authorized_keys:12: ..."). Any bad line
 * fails the whole parse and leaves kl empty. */
nl_status nl_keylist_parse(nl_keylist *kl, const char *text, size_t len, const char *origin,
                           nl_error *err);
/* Read and parse an authorized_keys file, refused first when
 * nl_keys_check_trusted refuses it. */
nl_status nl_keylist_load(nl_keylist *kl, const char *path, nl_error *err);
/* Add a key with every role (an allow-list without roles) or with the
 * given roles. */
nl_status nl_keylist_add(nl_keylist *kl, const uint8_t key[NL_KEY_BYTES], nl_error *err);
nl_status nl_keylist_add_roles(nl_keylist *kl, const uint8_t key[NL_KEY_BYTES], int roles,
                               nl_error *err);
/* Sort and merge duplicates (parse does this). */
void nl_keylist_sort(nl_keylist *kl);
bool nl_keylist_has(const nl_keylist *kl, const uint8_t key[NL_KEY_BYTES]);
/* The key's roles (a key listed twice has both lines'), 0 if absent. */
int nl_keylist_roles(const nl_keylist *kl, const uint8_t key[NL_KEY_BYTES]);
/* Deep copy (dst's old contents are freed). */
nl_status nl_keylist_copy(nl_keylist *dst, const nl_keylist *src, nl_error *err);
void nl_keylist_free(nl_keylist *kl);

#endif
