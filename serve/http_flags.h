/* The flags of an HTTP front that neuroctl serve and neurocoord --http
 * share, as rows of a typed flag table (base/args.h) filling an
 * nl_http_opts: the bearer tokens, the per-address connections, the
 * deadline of a non-streaming completion and the Host names allowed.
 * Each command has its own --http row (its own default address). */
#ifndef NL_SERVE_HTTP_FLAGS_H
#define NL_SERVE_HTTP_FLAGS_H

#include "base/args.h"
#include "serve/http.h"

/* clang-format off */
#define NL_HTTP_FLAG_ROWS(ho)                                                                      \
    NL_OPT_STR("http-tokens", &(ho)->tokens_path,                                                  \
               "file of bearer tokens for --http, one a line (required off loopback)"),            \
    NL_OPT_INT("http-per-ip", &(ho)->per_ip, 1, 65536, "32",                                       \
               "connections one client address may hold at once"),                                 \
    NL_OPT_INT("http-deadline", &(ho)->deadline_s, 1, 86400 * 7, "600",                            \
               "seconds a non-streaming completion may take: then it is cancelled and "            \
               "answered 504"),                                                                    \
    NL_OPT_STR("http-allow-host", &(ho)->allow_hosts,                                              \
               "NAME[,NAME...]: without tokens, Host names a request may carry besides "           \
               "localhost and IP addresses (others are refused 403: a web page cannot reach "      \
               "the API by DNS rebinding)")
/* clang-format on */

#endif
