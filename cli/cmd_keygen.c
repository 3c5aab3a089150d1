/* neuroctl keygen: make a CURVE keypair for a node or a client.
 *   neuroctl keygen --out PREFIX [--role node|client|admin] [--force]
 * writes PREFIX.key (the secret, mode 0600) and PREFIX.pub (the Z85 public
 * key on one line), and prints the public key, followed by its role when
 * --role is given: that line goes into the coordinator's
 * <state-dir>/authorized_keys. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "net/keys.h"

static void keygen_usage(FILE *f)
{
    fprintf(f, "usage: neuroctl keygen --out PREFIX [--role node|client|admin] [--force]\n"
               "  writes PREFIX.key (secret, mode 0600) and PREFIX.pub (public key, Z85)\n"
               "  and prints the public key\n"
               "  --role   print the key with its role: the line for the coordinator's\n"
               "           authorized_keys (node, client or admin; docs/security.md)\n"
               "  --force  replace an existing PREFIX.key\n");
}

int nl_cmd_keygen(int argc, char **argv)
{
    const char *prefix = NULL, *role = NULL;
    bool force = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
            prefix = argv[++i];
        } else if (strcmp(argv[i], "--role") == 0 && i + 1 < argc) {
            role = argv[++i];
            if (!nl_key_role_parse(role, strlen(role))) {
                fprintf(stderr, "neuroctl keygen: --role '%s' is not node, client or admin\n",
                        role);
                return 2;
            }
        } else if (strcmp(argv[i], "--force") == 0) {
            force = true;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            keygen_usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "neuroctl keygen: unexpected argument '%s'\n", argv[i]);
            keygen_usage(stderr);
            return 2;
        }
    }
    if (!prefix || !prefix[0]) {
        keygen_usage(stderr);
        return 2;
    }
    nl_keypair kp;
    nl_error err;
    nl_status st = nl_keys_generate(&kp, &err);
    if (st == NL_OK)
        st = nl_keys_save(&kp, prefix, force, &err);
    if (st != NL_OK) {
        nl_keys_wipe(&kp);
        fprintf(stderr, "neuroctl keygen: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "wrote %s.key (secret, mode 0600) and %s.pub\n", prefix, prefix);
    if (role)
        printf("%s %s\n", kp.public_z85, role);
    else
        printf("%s\n", kp.public_z85);
    nl_keys_wipe(&kp);
    return 0;
}
