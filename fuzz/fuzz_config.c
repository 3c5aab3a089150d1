/* Fuzz target for configs: the input as YAML, then as JSON. A config
 * that parses must survive the JSON round trip unchanged. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void round_trip(const nl_config *c)
{
    nl_config back;
    nl_error err;
    char *json = nl_config_to_json(c);
    if (!json)
        abort();
    if (nl_config_from_json(&back, json, &err) != NL_OK)
        abort();
    if (memcmp(&back, c, sizeof back) != 0)
        abort();
    free(json);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_config c;
    nl_error err;
    if (nl_config_parse_yaml(&c, (const char *)data, size, &err) == NL_OK)
        round_trip(&c);
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    if (nl_config_from_json(&c, text, &err) == NL_OK)
        round_trip(&c);
    free(text);
    return 0;
}
