/* The cross-field checks of the messages that say how a stage reaches its
 * neighbours (wire_impl.h): ASSIGN (links, the relay, replicas and their
 * ring, neighbours with another replica count) and LOCAL_LINK (the local
 * link between stages on one host). */
#include "net/wire_impl.h"

#include <string.h>

int nl_wire_peer_list(const char *list, char items[][NL_WIRE_PEER_ITEM], int max)
{
    if (!list || !list[0])
        return 0;
    int n = 0;
    for (const char *p = list;; n++) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (n >= max || len == 0 || len >= NL_WIRE_PEER_ITEM)
            return -1;
        if (items) {
            memcpy(items[n], p, len);
            items[n][len] = '\0';
        }
        if (!end)
            return n + 1;
        p = end + 1;
    }
}

/* The neighbours' replicas (prev_keys, next_endpoints, next_keys): lists
 * of 1 to NL_REDUCE_MAX_REPLICAS items, keys Z85, as many endpoints as
 * keys, each with its single neighbour set, and only on links 0. */
static nl_status check_peers(const nl_msg_assign *a, const nl_wire_tdesc *td, nl_error *err)
{
    char items[NL_REDUCE_MAX_REPLICAS][NL_WIRE_PEER_ITEM];
    const char *lists[3] = {a->prev_keys, a->next_keys, a->next_endpoints};
    const char *names[3] = {"prev_keys", "next_keys", "next_endpoints"};
    int count[3];
    for (int k = 0; k < 3; k++) {
        count[k] = nl_wire_peer_list(lists[k], items, NL_REDUCE_MAX_REPLICAS);
        if (count[k] < 0)
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s.%s: not a list of 1 to %d comma-separated items", td->name,
                                names[k], NL_REDUCE_MAX_REPLICAS);
        for (int i = 0; k < 2 && i < count[k]; i++)
            if (!nl_wire_z85_key_ok(items[i], strlen(items[i])))
                return nl_error_set(err, NL_ERR_RANGE, "%s.%s: item %d is not a Z85 key", td->name,
                                    names[k], i);
    }
    if (count[1] != count[2])
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s: %d next_keys for %d next_endpoints (one of each a replica)",
                            td->name, count[1], count[2]);
    if ((count[0] && !a->prev_key[0]) || (count[1] && !a->next_key[0]))
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s: a neighbour's replicas need the neighbour (prev_key, next_key)",
                            td->name);
    if ((count[0] || count[1]) && a->links)
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s.links: 0x%x with a neighbour of another replica count (those "
                            "links are made the default way only)",
                            td->name, a->links);
    return NL_OK;
}

nl_status nl_wire_check_assign(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_assign *a = &m->u.assign;
    if (a->stage >= a->num_stages)
        return nl_error_set(err, NL_ERR_RANGE, "%s: stage %u is not below num_stages %u", td->name,
                            a->stage, a->num_stages);
    if (a->layer0 > a->layer1)
        return nl_error_set(err, NL_ERR_RANGE, "%s: layer range [%u, %u) is reversed", td->name,
                            a->layer0, a->layer1);
    if (a->has_embed && a->stage != 0)
        return nl_error_set(err, NL_ERR_RANGE, "%s: has_embed on stage %u", td->name, a->stage);
    if (a->has_head && a->stage + 1 != a->num_stages)
        return nl_error_set(err, NL_ERR_RANGE, "%s: has_head on stage %u of %u", td->name, a->stage,
                            a->num_stages);
    if (!a->prev_endpoint[0] != !a->prev_key[0] || !a->next_endpoint[0] != !a->next_key[0])
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s: a neighbour's endpoint and key must both be set or both empty",
                            td->name);
    const bool ring = a->ring_endpoint && a->ring_endpoint[0];
    if (a->replicas > NL_REDUCE_MAX_REPLICAS || a->replica >= (a->replicas ? a->replicas : 1))
        return nl_error_set(err, NL_ERR_RANGE, "%s: replica %u of %u (at most %d)", td->name,
                            a->replica, a->replicas, NL_REDUCE_MAX_REPLICAS);
    if (ring != (a->replicas > 1) || ring != (a->ring_key && a->ring_key[0]) ||
        ring != (a->ring_prev_key && a->ring_prev_key[0]))
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s: a stage of %u replicas needs the ring's endpoint and keys "
                            "exactly when it has more than one",
                            td->name, a->replicas);
    if (!nl_wire_precision_name((nl_wire_precision)a->wire))
        return nl_error_set(err, NL_ERR_RANGE, "%s: wire %u is not 0 (fp32) or 1 (bf16)", td->name,
                            a->wire);
    if (a->links & ~NL_LINKS_ALL)
        return nl_error_set(err, NL_ERR_RANGE, "%s.links: 0x%x has unknown bits (known: 0x%x)",
                            td->name, a->links, NL_LINKS_ALL);
    if (((a->links & NL_LINK_DIAL_PREV) && !a->prev_endpoint[0]) ||
        ((a->links & NL_LINK_NEXT_DIALS) && !a->next_endpoint[0]))
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s.links: 0x%x names a neighbour this stage does not have", td->name,
                            a->links);
    const uint32_t prev_links = a->links & (NL_LINK_DIAL_PREV | NL_LINK_RELAY_PREV),
                   next_links = a->links & (NL_LINK_NEXT_DIALS | NL_LINK_RELAY_NEXT);
    if ((prev_links & (prev_links - 1)) || (next_links & (next_links - 1)))
        return nl_error_set(err, NL_ERR_RANGE, "%s.links: 0x%x says two ways to one neighbour",
                            td->name, a->links);
    if (((a->links & NL_LINK_RELAY_PREV) && !a->prev_endpoint[0]) ||
        ((a->links & NL_LINK_RELAY_NEXT) && !a->next_endpoint[0]))
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s.links: 0x%x names a neighbour this stage does not have", td->name,
                            a->links);
    const bool relayed = (a->links & (NL_LINK_RELAY_PREV | NL_LINK_RELAY_NEXT)) != 0;
    if (relayed ? a->relay_port < 1 || a->relay_port > 65535 : a->relay_port != 0)
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s.relay_port: %u (a port with a RELAY link, else 0)", td->name,
                            a->relay_port);
    return check_peers(a, td, err);
}

/* LOCAL_LINK: an OFFER names the host, the abstract name and a token of
 * 64 hex digits, the other ops none of them; only a DECLINE gives a
 * reason. (The op's range is its field's.) */
nl_status nl_wire_check_local_link(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    static const char *const ops[] = {"?", "an OFFER", "a READY", "a SWITCH", "a DECLINE"};
    const nl_msg_local_link *l = &m->u.local_link;
    const bool offer = l->op == NL_LOCAL_OFFER;
    const char *op = l->op <= NL_LOCAL_DECLINE ? ops[l->op] : "?";
    if (!l->name || !l->name[0]) /* every op names the offer it is about */
        return nl_error_set(err, NL_ERR_PROTO, "%s.name: %s needs it (the offer's name)", td->name,
                            op);
    const struct {
        const char *field, *v;
    } s[] = {{"host", l->host}, {"token", l->token}};
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
        const bool set = s[i].v && s[i].v[0];
        if (offer && !set)
            return nl_error_set(err, NL_ERR_PROTO, "%s.%s: an OFFER needs it", td->name,
                                s[i].field);
        if (!offer && set)
            return nl_error_set(err, NL_ERR_PROTO, "%s.%s: set on %s (only an OFFER carries it)",
                                td->name, s[i].field, op);
    }
    const size_t t = l->token ? strlen(l->token) : 0;
    if (offer && t != 64)
        return nl_error_set(err, NL_ERR_RANGE, "%s.token: %zu hex digits, must be 64", td->name, t);
    if (l->reason && l->reason[0] && l->op != NL_LOCAL_DECLINE)
        return nl_error_set(err, NL_ERR_PROTO, "%s.reason: set on %s (only a DECLINE gives one)",
                            td->name, op);
    return NL_OK;
}
