/* Fuzz target for the authorized_keys and key-file parser (net/keys.c).
 * Property: every key it accepts is canonical Z85 that decodes back to
 * the same bytes, and the list is sorted without duplicates. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "net/keys.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_keylist kl = {0};
    nl_error err;
    nl_log_set_level(NL_LOG_OFF);
    char *text = malloc(size ? size : 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    if (nl_keylist_parse(&kl, text, size, "fuzz", &err) == NL_OK) {
        for (size_t i = 0; i < kl.n; i++) {
            char z85[NL_KEY_Z85_LEN + 1];
            uint8_t back[NL_KEY_BYTES];
            nl_key_encode(z85, kl.keys[i]);
            if (nl_key_decode(back, z85, &err) != NL_OK ||
                memcmp(back, kl.keys[i], NL_KEY_BYTES) != 0)
                abort();
            if (i > 0 && memcmp(kl.keys[i - 1], kl.keys[i], NL_KEY_BYTES) >= 0)
                abort();
            if (!nl_keylist_has(&kl, kl.keys[i]))
                abort();
        }
    }
    nl_keylist_free(&kl);
    free(text);
    return 0;
}
