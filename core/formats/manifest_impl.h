/* Private to core/formats/manifest*.c: what the three files of the manifest module
 * share (manifest.c parses, manifest_write.c writes and hashes,
 * manifest_load.c reads shards, loads stages and exports). */
#ifndef NL_CORE_MANIFEST_IMPL_H
#define NL_CORE_MANIFEST_IMPL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* json_dumps with the fewest digits that print every real of v so that it
 * parses back to itself (manifest.c); the caller frees the text. */
char *nl_manifest_json_dump(json_t *v, size_t flags);

/* libsodium initialised, once for the process (manifest_write.c); false if
 * it failed. */
bool nl_manifest_sodium_ready(void);

#endif
