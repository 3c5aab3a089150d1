/* Fuzz target for the local link's record reader (net/locallink.c).
 *
 * Input: the bytes a peer writes on a local link (at most 64 KiB: a
 * socket's buffer takes them without a reader); it closes its end when
 * the reader has read them all.
 * The seed corpus (`test_locallink --write-corpus`) holds whole records of
 * sample messages, several in a row, a record cut short and records over
 * the limits.
 *
 * Property: the reader never crashes or reads out of bounds; it returns
 * whole messages (each decoded by the codec), reports a bad message and
 * goes on with the next record, says "no whole message yet" only when
 * nl_local_ready said so too, and, once the writer closes, ends with
 * NL_ERR_IO (the end, or a record over its limits, after which the link
 * stays broken) within a bounded number of calls. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "net/locallink.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_error e;
    nl_local_listener *l = NULL;
    nl_local *a = NULL, *b = NULL;
    char name[NL_LOCAL_NAME_MAX], token[NL_LOCAL_TOKEN_HEX + 1];
    /* tight limits: a frame of 1 MiB, a message of 2 MiB */
    nl_wire_limits lim = nl_wire_limits_default();
    lim.max_frame_bytes = 1u << 20;
    if (nl_local_listen(&l, name, token, &e) != NL_OK ||
        nl_local_connect(name, token, &lim, 1u << 20, 2u << 20, "writer", &b, &e) != NL_OK ||
        nl_local_accept(l, &lim, 1u << 20, 2u << 20, "reader", &a, &e) != NL_OK)
        abort();
    nl_local_listener_close(&l);
    if (size > 65536)
        size = 65536;
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(nl_local_fd(b), data + done, size - done);
        if (w <= 0)
            abort();
        done += (size_t)w;
    }
    nl_rx rx;
    nl_rx_init(&rx);
    nl_status st = NL_OK;
    int calls = 0;
    while (st != NL_ERR_IO && calls++ < 100000) {
        const bool ready = nl_local_ready(a);
        st = nl_local_recv(a, &rx, &e);
        if (st == NL_OK && !nl_wire_type_name(rx.msg.type))
            abort(); /* a message handed over is a decoded one */
        if (st != NL_OK && st != NL_ERR_IO && nl_local_broken(a) && /* for good */
            nl_local_recv(a, &rx, &e) != NL_ERR_IO)
            abort();
        if (st == NL_ERR_TIMEOUT) { /* every byte is read: the rest of a record is missing */
            if (ready || !b)
                abort();        /* "ready" promised a message; the end was already there */
            nl_local_close(&b); /* now the reader sees the end */
        }
    }
    if (st != NL_ERR_IO)
        abort();
    nl_rx_free(&rx);
    nl_local_close(&a);
    nl_local_close(&b);
    if (nl_net_parts_open() != 0)
        abort();
    return 0;
}
