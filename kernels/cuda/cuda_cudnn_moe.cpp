/* The experts' grouped GEMMs through cuDNN's MoE grouped matmul (see
 * cuda_cudnn.h): C++17 over the header-only cuDNN frontend, inside the CUDA
 * module only, sharing the attention's handle, stream and workspace
 * (cuda_cudnn_impl.h).
 *
 * The backend (cuda_gemm.cu, NL_CUDA_EXPERTS=cudnn) describes a bf16
 * gemm_grouped call (cudnn_moe_desc.h), asks nl_cudnn_moe_plan which graph
 * takes it, converts the activations to bf16 and calls nl_cudnn_moe_run;
 * cuDNN reads the expert offsets on the device, so the host never waits
 * for them. The graph is Graph::moe_grouped_matmul in mode NONE (the rows
 * already grouped by expert): bf16 Token and Weight, FP32 compute, an FP32
 * Output where cuDNN builds one, else bf16 (the backend then widens it into
 * C). Its backward node (moe_grouped_matmul_bwd, the weight gradient) needs
 * cuDNN 9.22 and is not used: the weight gradients keep the module's
 * kernels.
 *
 * Graph key: every number of the description (E, T, K, N, the strides, the
 * Output type). T, the dispatch's rows, is in it: a new batch size builds a
 * new graph (training repeats its T every step). At most
 * NL_CUDNN_MAX_GRAPHS keys are kept, a full cache dropping one entry (an
 * arbitrary one) first. A key cuDNN does not build is remembered and falls
 * back with one log line naming cuDNN's message; so does a key whose
 * execute fails. */
#include "kernels/cuda/cuda_cudnn.h"
#include "kernels/cuda/cudnn_moe_desc.h"

extern "C" {
#include "base/log.h"
}

#include <stdlib.h>
#include <string.h>

#if NL_HAVE_CUDNN

#include "kernels/cuda/cuda_cudnn_impl.h"

#include <cudnn_frontend.h>

#include <memory>
#include <new>
#include <string>
#include <unordered_map>

namespace fe = cudnn_frontend;

/* the first cuDNN whose MoE grouped matmul the frontend's own samples run
 * (they skip below it; the backend node exists since 9.15) */
#define NL_CUDNN_MOE_MIN_VERSION 91800

namespace
{

enum { KEY_LEN = 12 };

struct moe_key {
    int64_t v[KEY_LEN];
    bool operator==(const moe_key &o) const { return memcmp(v, o.v, sizeof v) == 0; }
};

struct moe_key_hash {
    size_t operator()(const moe_key &k) const
    {
        size_t h = 1469598103934665603ull;
        for (int i = 0; i < KEY_LEN; i++)
            h = (h ^ (size_t)k.v[i]) * 1099511628211ull;
        return h;
    }
};

struct moe_entry {
    std::shared_ptr<fe::graph::Graph> graph;  /* NULL: refused, fall back */
    std::unordered_map<int64_t, void *> pack; /* uid -> pointer, refilled per call */
};

moe_key key_of(const nl_moe_desc &d)
{
    const int64_t *ts = d.stride[NL_MOE_TOKEN], *ws = d.stride[NL_MOE_WEIGHT];
    const int64_t *os = d.stride[NL_MOE_OUT];
    moe_key k = {{d.experts, d.rows, d.k, d.n, d.out_bytes, ts[0], ts[1], ws[0], ws[1], ws[2],
                  os[0], os[1]}};
    return k;
}

} // namespace

struct nl_cudnn_moe {
    std::unordered_map<moe_key, moe_entry, moe_key_hash> graphs;
    bool checked = false; /* the library's version, once */
    bool too_old = false; /* older than NL_CUDNN_MOE_MIN_VERSION: every call falls back */
};

void nl_cudnn_moe_free(nl_cudnn_moe *m)
{
    delete m;
}

namespace
{

std::shared_ptr<fe::graph::Tensor_attributes> tensor_of(fe::graph::Graph &g, const nl_moe_desc &d,
                                                        int which, const char *name,
                                                        fe::DataType_t type)
{
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(d.uid[which])
                        .set_dim({d.dim[which][0], d.dim[which][1], d.dim[which][2]})
                        .set_stride({d.stride[which][0], d.stride[which][1], d.stride[which][2]})
                        .set_data_type(type));
}

/* The graph of a description; cuDNN's message in *why when it is not built. */
std::shared_ptr<fe::graph::Graph> build(nl_cudnn_shared *s, const nl_moe_desc &d, std::string *why)
{
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto token = tensor_of(*g, d, NL_MOE_TOKEN, "token", fe::DataType_t::BFLOAT16);
    auto weight = tensor_of(*g, d, NL_MOE_WEIGHT, "weight", fe::DataType_t::BFLOAT16);
    auto offset = tensor_of(*g, d, NL_MOE_OFFSET, "first_token_offset", fe::DataType_t::INT32);
    auto a = fe::graph::Moe_grouped_matmul_attributes()
                 .set_name("nl_experts")
                 .set_mode(fe::MoeGroupedMatmulMode_t::NONE)
                 .set_compute_data_type(fe::DataType_t::FLOAT);
    auto out = g->moe_grouped_matmul(token, weight, offset, nullptr, nullptr, a);
    const int64_t *od = d.dim[NL_MOE_OUT], *os = d.stride[NL_MOE_OUT];
    out->set_output(true)
        .set_uid(d.uid[NL_MOE_OUT])
        .set_dim({od[0], od[1], od[2]})
        .set_stride({os[0], os[1], os[2]})
        .set_data_type(d.out_bytes == 4 ? fe::DataType_t::FLOAT : fe::DataType_t::BFLOAT16);
    auto e = g->build(s->handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (!e.is_good()) {
        *why = e.get_message();
        return nullptr;
    }
    return g;
}

const char *layout_name(const nl_moe_desc &d)
{
    return d.stride[NL_MOE_WEIGHT][1] == 1 ? "weights (N, K): x W^T" : "weights (K, N): dY W";
}

/* The entry of d's key, built (and the workspace grown) the first time;
 * NULL when the key falls back. */
moe_entry *lookup(nl_cudnn_shared *s, nl_cudnn_moe *m, const nl_moe_desc &d)
{
    const moe_key k = key_of(d);
    auto it = m->graphs.find(k);
    if (it != m->graphs.end())
        return it->second.graph ? &it->second : nullptr;
    if (m->graphs.size() >= NL_CUDNN_MAX_GRAPHS)
        m->graphs.erase(m->graphs.begin());
    moe_entry &en = m->graphs[k];
    std::string why;
    en.graph = build(s, d, &why);
    int64_t ws = 0;
    if (en.graph && !en.graph->get_workspace_size(ws).is_good()) {
        en.graph = nullptr;
        why = "get_workspace_size failed";
    }
    if (en.graph && !nl_cudnn_grow(s, &s->workspace, &s->workspace_bytes, (size_t)ws)) {
        en.graph = nullptr;
        why = "out of device memory for the workspace";
    }
    const char *out = d.out_bytes == 4 ? "FP32" : "bf16";
    if (!en.graph) {
        nl_log_write(NL_LOG_WARN,
                     "cuda:%d: cuDNN MoE grouped matmul (E %lld T %lld K %lld N %lld, %s, %s "
                     "output) not built: %s",
                     s->device, (long long)d.experts, (long long)d.rows, (long long)d.k,
                     (long long)d.n, layout_name(d), out, why.c_str());
        return nullptr;
    }
    nl_log_write(NL_LOG_INFO,
                 "cuda:%d: cuDNN MoE grouped matmul (E %lld T %lld K %lld N %lld, %s, %s output) "
                 "built, workspace %lld bytes",
                 s->device, (long long)d.experts, (long long)d.rows, (long long)d.k,
                 (long long)d.n, layout_name(d), out, (long long)ws);
    for (int i = 0; i < NL_MOE_NTENSORS; i++) /* every uid now: a call only assigns */
        en.pack[d.uid[i]] = nullptr;
    return &en;
}

/* The experts' state, made on the first call with the library's version
 * checked; NULL when cuDNN is off for the experts or too old. */
nl_cudnn_moe *state_of(nl_cudnn *cd)
{
    nl_cudnn_shared *s = cd ? nl_cudnn_shared_of(cd) : nullptr;
    if (!s || !s->experts)
        return nullptr;
    if (!s->moe)
        s->moe = new nl_cudnn_moe;
    nl_cudnn_moe *m = s->moe;
    if (!m->checked) {
        m->checked = true;
        const size_t v = fe::detail::get_backend_version();
        m->too_old = v < NL_CUDNN_MOE_MIN_VERSION;
        if (m->too_old)
            nl_log_write(NL_LOG_WARN,
                         "cuda:%d: NL_CUDA_EXPERTS=cudnn: cuDNN %zu is older than %d, which the "
                         "MoE grouped matmul needs: the experts' GEMMs use the module's kernels",
                         s->device, v, NL_CUDNN_MOE_MIN_VERSION);
    }
    return m->too_old ? nullptr : m;
}

int plan(nl_cudnn *cd, const nl_moe_desc *f32, const nl_moe_desc *bf16)
{
    nl_cudnn_moe *m = state_of(cd);
    if (!m)
        return 0;
    nl_cudnn_shared *s = nl_cudnn_shared_of(cd);
    if (f32 && !f32->fallback && f32->out_bytes == 4 && lookup(s, m, *f32))
        return 4;
    if (bf16 && !bf16->fallback && bf16->out_bytes == NL_MOE_BF16_BYTES && lookup(s, m, *bf16))
        return NL_MOE_BF16_BYTES;
    return 0;
}

int run(nl_cudnn *cd, const nl_moe_desc *d, const uint16_t *token, const uint16_t *weight,
        const int32_t *offsets, void *out)
{
    nl_cudnn_moe *m = state_of(cd);
    if (!m || !d || d->fallback)
        return 0;
    auto it = m->graphs.find(key_of(*d));
    if (it == m->graphs.end() || !it->second.graph)
        return 0; /* not planned, or refused */
    moe_entry &en = it->second;
    nl_cudnn_shared *s = nl_cudnn_shared_of(cd);
    en.pack[d->uid[NL_MOE_TOKEN]] = (void *)token;
    en.pack[d->uid[NL_MOE_WEIGHT]] = (void *)weight;
    en.pack[d->uid[NL_MOE_OFFSET]] = (void *)offsets;
    en.pack[d->uid[NL_MOE_OUT]] = out;
    auto e = en.graph->execute(s->handle, en.pack, s->workspace);
    if (e.is_good())
        return 1;
    nl_log_write(NL_LOG_WARN,
                 "cuda:%d: cuDNN MoE grouped matmul (E %lld T %lld K %lld N %lld, %s): execute "
                 "failed, the module's kernels take this shape from now on: %s",
                 s->device, (long long)d->experts, (long long)d->rows, (long long)d->k,
                 (long long)d->n, layout_name(*d), e.get_message().c_str());
    en.graph = nullptr;
    return 0;
}

/* What the frontend may throw never crosses into C: one log line, a fallback. */
void thrown(nl_cudnn *cd, const char *what)
{
    nl_cudnn_shared *s = cd ? nl_cudnn_shared_of(cd) : nullptr;
    nl_log_write(NL_LOG_WARN,
                 "cuda:%d: cuDNN MoE grouped matmul: %s; the module's kernels take the call",
                 s ? s->device : -1, what);
}

} // namespace

extern "C" int nl_cudnn_moe_plan(nl_cudnn *cd, const struct nl_moe_desc *f32,
                                 const struct nl_moe_desc *bf16)
{
    try {
        return plan(cd, f32, bf16);
    } catch (const std::exception &x) {
        thrown(cd, x.what());
    } catch (...) {
        thrown(cd, "unknown exception");
    }
    return 0;
}

extern "C" int nl_cudnn_moe_run(nl_cudnn *cd, const struct nl_moe_desc *d, const uint16_t *token,
                                const uint16_t *weight, const int32_t *offsets, void *out)
{
    try {
        return run(cd, d, token, weight, offsets, out);
    } catch (const std::exception &x) {
        thrown(cd, x.what());
    } catch (...) {
        thrown(cd, "unknown exception");
    }
    return 0;
}

#else /* built without the cuDNN frontend: every call declines */

extern "C" int nl_cudnn_moe_plan(nl_cudnn *, const struct nl_moe_desc *,
                                 const struct nl_moe_desc *)
{
    return 0;
}

extern "C" int nl_cudnn_moe_run(nl_cudnn *, const struct nl_moe_desc *, const uint16_t *,
                                const uint16_t *, const int32_t *, void *)
{
    return 0;
}

#endif
