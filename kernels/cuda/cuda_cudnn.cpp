/* Flash attention through cuDNN's graph API (see cuda_cudnn.h): C++17 over
 * the header-only cuDNN frontend, inside the CUDA module only.
 *
 * A call: describe it (cudnn_sdpa_desc.h); if cuDNN is not given this case,
 * answer 0 and the backend runs its own kernel. Else find the graph of its
 * shape key in the cache (building it the first time), grow the scratch and
 * workspace if this graph needs more (only when a graph is built, so a
 * steady state allocates nothing), pack the FP32 inputs into bf16 on the
 * stream, execute, and unpack the bf16 outputs into the caller's FP32
 * tensors. Statistics stay FP32 and go straight to / come straight from the
 * caller's lse. A graph that fails to build (unsupported, cuDNN error) is
 * remembered as failed: its key falls back from then on, after one log line
 * naming cuDNN's message. An execute that fails answers 0 as well (the
 * packing kernels only wrote the scratch), so the caller's kernel runs.
 *
 * Graph key: direction, B, T, s_kv (T, or kv_cap with a cache), H, G, hd,
 * the band (causal / bidirectional, window), padding, and whether stats are
 * wanted; `past` is not in it (the padding mask's sequence lengths are
 * device values), so a decode reuses one graph. At most NL_CUDNN_MAX_GRAPHS
 * keys are kept: a full cache drops one entry (an arbitrary one) first.
 *
 * The handle, its stream and the workspace also serve the experts' grouped
 * GEMMs (NL_CUDA_EXPERTS=cudnn, cuda_cudnn_moe.cpp; cuda_cudnn_impl.h is
 * what the two share): with NL_CUDNN_ATTN=0 a handle is still made for
 * them, and attention declines every call. */
#include "kernels/cuda/cuda_cudnn.h"
#include "kernels/cuda/cudnn_sdpa_desc.h"

extern "C" {
#include "base/log.h"
}

#include <stdlib.h>
#include <string.h>

#if NL_HAVE_CUDNN

#include "kernels/cuda/cuda_cudnn_impl.h"

#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <memory>
#include <new>
#include <string>
#include <unordered_map>

namespace fe = cudnn_frontend;

/* The frontend is built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: it calls
 * cuDNN (and NVRTC, which one of its experimental engines uses) through
 * dlsym on this handle, which nl_cudnn_new fills. So the module never needs
 * libcudnn to load: a machine without cuDNN keeps the CUDA backend, with
 * attention on the module's kernels and one log line saying why. */
void *cudnn_frontend::cudnn_dlhandle = nullptr;

namespace
{

/* tensor uids: forward 1.., backward 101.. */
enum : int64_t {
    U_Q = 1,
    U_K,
    U_V,
    U_O,
    U_STATS,
    U_SEQ_Q,
    U_SEQ_KV,
    U_DQ = 101,
    U_DK,
    U_DV,
    U_DO,
};

struct key {
    int bwd, B, T, S, H, G, hd, bidir, window, padding, stats;
    bool operator==(const key &o) const { return memcmp(this, &o, sizeof o) == 0; }
};

struct key_hash {
    size_t operator()(const key &k) const
    {
        const int *p = &k.bwd;
        size_t h = 1469598103934665603ull;
        for (size_t i = 0; i < sizeof k / sizeof(int); i++)
            h = (h ^ (size_t)(unsigned)p[i]) * 1099511628211ull;
        return h;
    }
};

struct entry {
    std::shared_ptr<fe::graph::Graph> graph;  /* NULL: failed, fall back */
    std::unordered_map<int64_t, void *> pack; /* uid -> pointer, refilled per call */
    size_t workspace = 0;
};

} // namespace

/* the handle, stream and workspace (cuda_cudnn_impl.h), and attention's own */
struct nl_cudnn : nl_cudnn_shared {
    std::unordered_map<key, entry, key_hash> graphs;
    void *scratch = nullptr; /* packed bf16 tensors, seq lens, spare stats */
    size_t scratch_bytes = 0;
    bool force = false; /* NL_CUDNN_ATTN=force: every shape it can describe */
};

nl_cudnn_shared *nl_cudnn_shared_of(nl_cudnn *cd)
{
    return cd;
}

/* Grow a device buffer to at least `need` bytes (zeroed, so padded K/V rows
 * a graph may load are finite). The stream is drained first: queued work may
 * still read the old buffer. */
bool nl_cudnn_grow(nl_cudnn_shared *cd, void **p, size_t *have, size_t need)
{
    if (need <= *have)
        return true;
    cudaStreamSynchronize(cd->stream);
    if (*p)
        cudaFree(*p);
    *p = nullptr;
    *have = 0;
    if (cudaMalloc(p, need) != cudaSuccess ||
        cudaMemsetAsync(*p, 0, need, cd->stream) != cudaSuccess) {
        cudaGetLastError();
        if (*p)
            cudaFree(*p);
        *p = nullptr;
        return false;
    }
    *have = need;
    return true;
}

namespace
{

size_t align_up(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* Where each packed tensor sits in the scratch. */
struct layout {
    size_t q, k, v, o, dq, dk, dv, dout, seq, stats, total;
};

layout layout_of(const nl_sdpa_desc &d, bool bwd)
{
    layout l{};
    const size_t qb = align_up((size_t)(d.b * d.s_q * d.h_q * d.d) * 2);
    const size_t kb = align_up((size_t)(d.b * d.s_kv * d.h_kv * d.d) * 2);
    size_t at = 0;
    l.q = at, at += qb;
    l.k = at, at += kb;
    l.v = at, at += kb;
    l.o = at, at += qb;
    if (bwd) {
        l.dq = at, at += qb;
        l.dk = at, at += kb;
        l.dv = at, at += kb;
        l.dout = at, at += qb;
    }
    l.seq = at, at += align_up((size_t)d.b * 2 * sizeof(int32_t));
    l.stats = at, at += align_up((size_t)(d.b * d.h_q * d.s_q) * sizeof(float));
    l.total = at;
    return l;
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor_of(std::shared_ptr<fe::graph::Graph> &g,
                                                        const nl_sdpa_desc &d, int which,
                                                        int64_t uid, const char *name)
{
    return g->tensor(
        fe::graph::Tensor_attributes()
            .set_name(name)
            .set_uid(uid)
            .set_dim({d.dim[which][0], d.dim[which][1], d.dim[which][2], d.dim[which][3]})
            .set_stride(
                {d.stride[which][0], d.stride[which][1], d.stride[which][2], d.stride[which][3]}));
}

void set_out(std::shared_ptr<fe::graph::Tensor_attributes> &t, const nl_sdpa_desc &d, int which,
             int64_t uid)
{
    t->set_output(true).set_uid(uid).set_dim(
        {d.dim[which][0], d.dim[which][1], d.dim[which][2], d.dim[which][3]});
    t->set_stride({d.stride[which][0], d.stride[which][1], d.stride[which][2], d.stride[which][3]});
}

/* The band, alignment and padding of the descriptor on either attributes
 * class (SDPA_attributes, SDPA_backward_attributes share these setters). */
template <class A>
void set_mask(A &a, const nl_sdpa_desc &d, std::shared_ptr<fe::graph::Tensor_attributes> sq,
              std::shared_ptr<fe::graph::Tensor_attributes> skv)
{
    a.set_attn_scale(d.scale);
    a.set_diagonal_alignment(d.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                            : fe::DiagonalAlignment_t::TOP_LEFT);
    if (d.has_right)
        a.set_diagonal_band_right_bound(d.right_bound);
    if (d.has_left)
        a.set_diagonal_band_left_bound(d.left_bound);
    if (d.padding)
        a.set_padding_mask(true).set_seq_len_q(sq).set_seq_len_kv(skv);
}

/* Build the graph of a key; the error text in *why on failure. The
 * backward asks for cuDNN's deterministic algorithm (no atomics: two runs,
 * the same bits) when `deterministic`. */
std::shared_ptr<fe::graph::Graph> build(nl_cudnn *cd, const nl_sdpa_desc &d, bool bwd, bool stats,
                                        bool deterministic, std::string *why)
{
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto Q = tensor_of(g, d, NL_SDPA_Q, U_Q, "Q");
    auto K = tensor_of(g, d, NL_SDPA_K, U_K, "K");
    auto V = tensor_of(g, d, NL_SDPA_V, U_V, "V");
    std::shared_ptr<fe::graph::Tensor_attributes> sq, skv;
    if (d.padding) {
        sq = g->tensor(fe::graph::Tensor_attributes()
                           .set_name("seq_q")
                           .set_uid(U_SEQ_Q)
                           .set_dim({d.b, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
        skv = g->tensor(fe::graph::Tensor_attributes()
                            .set_name("seq_kv")
                            .set_uid(U_SEQ_KV)
                            .set_dim({d.b, 1, 1, 1})
                            .set_stride({1, 1, 1, 1})
                            .set_data_type(fe::DataType_t::INT32));
    }
    if (!bwd) {
        auto a = fe::graph::SDPA_attributes().set_name("nl_sdpa").set_generate_stats(stats);
        set_mask(a, d, sq, skv);
        auto [O, S] = g->sdpa(Q, K, V, a);
        set_out(O, d, NL_SDPA_O, U_O);
        if (stats) {
            set_out(S, d, NL_SDPA_STATS, U_STATS);
            S->set_data_type(fe::DataType_t::FLOAT);
        }
    } else {
        auto O = tensor_of(g, d, NL_SDPA_O, U_O, "O");
        auto dO = tensor_of(g, d, NL_SDPA_O, U_DO, "dO");
        auto S = tensor_of(g, d, NL_SDPA_STATS, U_STATS, "Stats");
        S->set_data_type(fe::DataType_t::FLOAT);
        auto a = fe::graph::SDPA_backward_attributes()
                     .set_name("nl_sdpa_backward")
                     .set_deterministic_algorithm(deterministic);
        set_mask(a, d, sq, skv);
        auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, S, a);
        set_out(dQ, d, NL_SDPA_Q, U_DQ);
        set_out(dK, d, NL_SDPA_K, U_DK);
        set_out(dV, d, NL_SDPA_V, U_DV);
    }
    auto e = g->build(cd->handle, {fe::HeurMode_t::A});
    if (!e.is_good()) {
        *why = e.get_message();
        return nullptr;
    }
    return g;
}

/* The cached entry of a key: built (and the buffers grown) the first time;
 * NULL when this key falls back. */
entry *lookup(nl_cudnn *cd, const nl_sdpa_desc &d, const key &k, bool bwd, size_t scratch)
{
    auto it = cd->graphs.find(k);
    if (it != cd->graphs.end())
        return it->second.graph ? &it->second : nullptr;
    if (cd->graphs.size() >= NL_CUDNN_MAX_GRAPHS)
        cd->graphs.erase(cd->graphs.begin());
    entry &en = cd->graphs[k];
    std::string why;
    en.graph = build(cd, d, bwd, k.stats != 0, true, &why);
    if (!en.graph && bwd) {
        /* no deterministic engine for this shape: take the fast one, say so */
        std::string why2;
        en.graph = build(cd, d, bwd, k.stats != 0, false, &why2);
        if (en.graph)
            nl_log_write(NL_LOG_WARN,
                         "cuda:%d: cuDNN attention backward (B %d T %d H %d G %d hd %d bidir %d "
                         "window %d): no deterministic engine (%s); using a nondeterministic one",
                         cd->device, k.B, k.T, k.H, k.G, k.hd, k.bidir, k.window, why.c_str());
    }
    int64_t ws = 0;
    if (en.graph && !en.graph->get_workspace_size(ws).is_good()) {
        en.graph = nullptr;
        why = "get_workspace_size failed";
    }
    if (en.graph && (!nl_cudnn_grow(cd, &cd->scratch, &cd->scratch_bytes, scratch) ||
                     !nl_cudnn_grow(cd, &cd->workspace, &cd->workspace_bytes, (size_t)ws))) {
        en.graph = nullptr;
        why = "out of device memory for the scratch or workspace";
    }
    if (!en.graph) {
        nl_log_write(NL_LOG_WARN,
                     "cuda:%d: cuDNN attention %s (B %d T %d S %d H %d G %d hd %d bidir %d "
                     "window %d): falling back to the module's kernels: %s",
                     cd->device, bwd ? "backward" : "forward", k.B, k.T, k.S, k.H, k.G, k.hd,
                     k.bidir, k.window, why.c_str());
        return nullptr;
    }
    en.workspace = (size_t)ws;
    /* every uid in the pack now, so a call only assigns (never allocates) */
    for (int64_t uid : {U_Q, U_K, U_V, U_O, U_STATS, U_SEQ_Q, U_SEQ_KV, U_DQ, U_DK, U_DV, U_DO})
        en.pack[uid] = nullptr;
    if (!k.stats)
        en.pack.erase(U_STATS);
    if (!k.padding) {
        en.pack.erase(U_SEQ_Q);
        en.pack.erase(U_SEQ_KV);
    }
    return &en;
}

key key_of(const nl_sdpa_desc &d, int bwd, const nl_attn_mask *m, int stats)
{
    key k;
    memset(&k, 0, sizeof k);
    k.bwd = bwd;
    k.B = (int)d.b;
    k.T = (int)d.s_q;
    k.S = (int)d.s_kv;
    k.H = (int)d.h_q;
    k.G = (int)d.h_kv;
    k.hd = (int)d.d;
    k.bidir = m ? m->bidir : 0;
    k.window = m ? m->window : 0;
    k.padding = d.padding;
    k.stats = stats;
    return k;
}

/* Execute with the entry's uid map; false (logged once per key) on error. */
bool run(nl_cudnn *cd, entry *en, const key &k)
{
    auto e = en->graph->execute(cd->handle, en->pack, cd->workspace);
    if (e.is_good())
        return true;
    nl_log_write(NL_LOG_WARN,
                 "cuda:%d: cuDNN attention %s (B %d T %d S %d H %d hd %d): execute failed, "
                 "falling back to the module's kernels from now on: %s",
                 cd->device, k.bwd ? "backward" : "forward", k.B, k.T, k.S, k.H, k.hd,
                 e.get_message().c_str());
    en->graph = nullptr; /* the key falls back from now on */
    return false;
}

/* FP32 tensor `which` of the caller into its packed bf16 scratch, and back
 * (cudnn_sdpa_desc.h's nl_sdpa_pack_of says where each row goes). */
int pack(nl_cudnn *cd, uint16_t *dst, const nl_sdpa_desc *d, int which, nl_attn_shape s,
         const float *src, int q_stride, int kv_stride)
{
    const nl_sdpa_pack p = nl_sdpa_pack_of(d, which, s, q_stride, kv_stride);
    return nl_cuda_pack_bf16(cd->stream, dst, p.dst_cap, p.dst_stride, src, p.src_cap, p.src_stride,
                             p.nseq, p.rows, p.width);
}

int unpack(nl_cudnn *cd, float *dst, const nl_sdpa_desc *d, int which, nl_attn_shape s,
           const uint16_t *src, int q_stride, int kv_stride)
{
    const nl_sdpa_pack p = nl_sdpa_pack_of(d, which, s, q_stride, kv_stride);
    return nl_cuda_unpack_bf16(cd->stream, dst, p.src_cap, p.src_stride, src, p.dst_cap,
                               p.dst_stride, p.nseq, p.rows, p.width);
}

/* libcudnn.so.9 where the loader finds it (LD_LIBRARY_PATH, the module's
 * run path), else in the folder CMake found it in. The handle is kept for
 * the process's life (the graphs of several backends share it). */
bool load_cudnn(int device, const char *users)
{
    if (fe::cudnn_dlhandle)
        return true;
    void *h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    std::string err = h ? "" : dlerror();
#ifdef NL_CUDNN_LIB_DIR
    if (!h) {
        h = dlopen(NL_CUDNN_LIB_DIR "/libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
        if (!h)
            err += std::string("; ") + dlerror();
    }
#endif
    if (!h) {
        nl_log_write(NL_LOG_WARN, "cuda:%d: cuDNN not found (%s): %s the module's kernels",
                     device, err.c_str(), users);
        return false;
    }
    fe::cudnn_dlhandle = h;
    return true;
}

/* users: who falls back to the module's kernels, for the log lines */
nl_cudnn *make(int device, void *stream, bool attn, bool experts, bool force, bool bf16,
               const char *users)
{
    if (!load_cudnn(device, users))
        return nullptr;
    cudnnHandle_t h = nullptr;
    cudnnStatus_t st = fe::detail::create_handle(&h);
    if (st == CUDNN_STATUS_SUCCESS)
        st = fe::detail::set_stream(h, (cudaStream_t)stream);
    if (st != CUDNN_STATUS_SUCCESS) {
        nl_log_write(NL_LOG_WARN, "cuda:%d: cuDNN unavailable (%s, library %zu): %s the module's kernels",
                     device, fe::detail::get_error_string(st), fe::detail::get_backend_version(),
                     users);
        if (h)
            fe::detail::destroy_handle(h);
        cudaGetLastError();
        return nullptr;
    }
    nl_cudnn *cd = new (std::nothrow) nl_cudnn;
    if (!cd) {
        fe::detail::destroy_handle(h);
        return nullptr;
    }
    cd->device = device;
    cd->stream = (cudaStream_t)stream;
    cd->handle = h;
    cd->attn = attn;
    cd->experts = experts;
    cd->force = force;
    nl_log_write(NL_LOG_INFO, "cuda:%d: %s through cuDNN %zu (frontend %d.%d.%d)%s", device,
                 attn && experts ? "attention and the experts' GEMMs"
                 : attn          ? "attention"
                                 : "the experts' GEMMs",
                 fe::detail::get_backend_version(), CUDNN_FRONTEND_MAJOR_VERSION,
                 CUDNN_FRONTEND_MINOR_VERSION, CUDNN_FRONTEND_PATCH_VERSION,
                 attn && force && !bf16 ? ", attention forced for an FP32 backend" : "");
    return cd;
}

} // namespace

extern "C" nl_cudnn *nl_cudnn_new(int device, void *stream, int bf16, int experts)
{
    const char *env = getenv("NL_CUDNN_ATTN");
    const bool off = env && strcmp(env, "0") == 0;
    const bool force = env && strcmp(env, "force") == 0;
    const bool attn = !off && (bf16 || force), ex = bf16 && experts;
    if (!attn && !ex)
        return nullptr;
    const char *users = attn && ex ? "attention and the experts' GEMMs use"
                        : attn     ? "attention uses"
                                   : "the experts' GEMMs use";
    try {
        return make(device, stream, attn, ex, force, bf16 != 0, users);
    } catch (const std::exception &x) { /* the shim throws when a symbol is missing */
        nl_log_write(NL_LOG_WARN, "cuda:%d: cuDNN unavailable (%s): %s the module's kernels",
                     device, x.what(), users);
    }
    return nullptr;
}

extern "C" void nl_cudnn_destroy(nl_cudnn **p)
{
    if (!p || !*p)
        return;
    nl_cudnn *cd = *p;
    nl_cudnn_moe_free(cd->moe);
    cd->moe = nullptr;
    cd->graphs.clear();
    if (cd->scratch)
        cudaFree(cd->scratch);
    if (cd->workspace)
        cudaFree(cd->workspace);
    fe::detail::destroy_handle(cd->handle);
    cudaGetLastError();
    delete cd;
    *p = nullptr;
}

namespace
{

int forward(nl_cudnn *cd, float *out, float *lse, const float *q, int q_stride, const float *k,
            const float *v, int kv_stride, nl_attn_shape s, const nl_attn_mask *mask)
{
    if (!cd || !cd->attn || !out || !q || !k || !v || (!cd->force && !nl_sdpa_worth_it(s)))
        return 0;
    nl_sdpa_desc d;
    nl_sdpa_describe(&d, s, mask ? mask->bidir : 0, mask ? mask->window : 0,
                     mask && mask->doc != nullptr, 0);
    if (d.fallback || q_stride < s.H * s.hd || kv_stride < s.G * s.hd)
        return 0;
    const key kk = key_of(d, 0, mask, lse != nullptr);
    const layout l = layout_of(d, false);
    entry *en = lookup(cd, d, kk, false, l.total);
    if (!en)
        return 0;
    char *sc = (char *)cd->scratch;
    uint16_t *qb = (uint16_t *)(sc + l.q), *kb = (uint16_t *)(sc + l.k);
    uint16_t *vb = (uint16_t *)(sc + l.v), *ob = (uint16_t *)(sc + l.o);
    int32_t *seq = (int32_t *)(sc + l.seq);
    int rc = pack(cd, qb, &d, NL_SDPA_Q, s, q, q_stride, kv_stride);
    if (!rc)
        rc = pack(cd, kb, &d, NL_SDPA_K, s, k, q_stride, kv_stride);
    if (!rc)
        rc = pack(cd, vb, &d, NL_SDPA_V, s, v, q_stride, kv_stride);
    if (!rc && d.padding) {
        rc = nl_cuda_fill_i32(cd->stream, seq, s.B, d.seq_len_q);
        if (!rc)
            rc = nl_cuda_fill_i32(cd->stream, seq + s.B, s.B, d.seq_len_kv);
    }
    if (rc)
        return 0; /* a launch error: the caller's kernel will meet and report it */
    en->pack[U_Q] = qb;
    en->pack[U_K] = kb;
    en->pack[U_V] = vb;
    en->pack[U_O] = ob;
    if (lse)
        en->pack[U_STATS] = lse;
    if (d.padding) {
        en->pack[U_SEQ_Q] = seq;
        en->pack[U_SEQ_KV] = seq + s.B;
    }
    if (!run(cd, en, kk))
        return 0;
    return unpack(cd, out, &d, NL_SDPA_O, s, ob, q_stride, kv_stride) == 0;
}

int backward(nl_cudnn *cd, float *dq, float *dk, float *dv, const float *dout, const float *q,
             int q_stride, const float *k, const float *v, int kv_stride, const float *out,
             const float *lse, nl_attn_shape s, const nl_attn_mask *mask)
{
    if (!cd || !cd->attn || !dq || !dk || !dv || !dout || !q || !k || !v || !out || !lse)
        return 0;
    nl_sdpa_desc d;
    nl_sdpa_describe(&d, s, mask ? mask->bidir : 0, mask ? mask->window : 0,
                     mask && mask->doc != nullptr, 1);
    if (d.fallback || q_stride < s.H * s.hd || kv_stride < s.G * s.hd)
        return 0;
    const key kk = key_of(d, 1, mask, 1);
    const layout l = layout_of(d, true);
    entry *en = lookup(cd, d, kk, true, l.total);
    if (!en)
        return 0;
    char *sc = (char *)cd->scratch;
    uint16_t *qb = (uint16_t *)(sc + l.q), *kb = (uint16_t *)(sc + l.k);
    uint16_t *vb = (uint16_t *)(sc + l.v), *ob = (uint16_t *)(sc + l.o);
    uint16_t *dqb = (uint16_t *)(sc + l.dq), *dkb = (uint16_t *)(sc + l.dk);
    uint16_t *dvb = (uint16_t *)(sc + l.dv), *dob = (uint16_t *)(sc + l.dout);
    int rc = pack(cd, qb, &d, NL_SDPA_Q, s, q, q_stride, kv_stride);
    if (!rc)
        rc = pack(cd, kb, &d, NL_SDPA_K, s, k, q_stride, kv_stride);
    if (!rc)
        rc = pack(cd, vb, &d, NL_SDPA_V, s, v, q_stride, kv_stride);
    if (!rc)
        rc = pack(cd, ob, &d, NL_SDPA_O, s, out, q_stride, kv_stride);
    if (!rc)
        rc = pack(cd, dob, &d, NL_SDPA_O, s, dout, q_stride, kv_stride);
    if (rc)
        return 0;
    en->pack[U_Q] = qb;
    en->pack[U_K] = kb;
    en->pack[U_V] = vb;
    en->pack[U_O] = ob;
    en->pack[U_DO] = dob;
    en->pack[U_STATS] = (void *)lse;
    en->pack[U_DQ] = dqb;
    en->pack[U_DK] = dkb;
    en->pack[U_DV] = dvb;
    if (!run(cd, en, kk))
        return 0;
    rc = unpack(cd, dq, &d, NL_SDPA_Q, s, dqb, q_stride, kv_stride);
    if (!rc)
        rc = unpack(cd, dk, &d, NL_SDPA_K, s, dkb, q_stride, kv_stride);
    if (!rc)
        rc = unpack(cd, dv, &d, NL_SDPA_V, s, dvb, q_stride, kv_stride);
    return rc == 0;
}

/* What the frontend may throw (std::bad_alloc and kin) never crosses into
 * C: a throw is one log line and a fallback. */
void thrown(nl_cudnn *cd, const char *what)
{
    nl_log_write(NL_LOG_WARN, "cuda:%d: cuDNN attention: %s; falling back to the module's kernels",
                 cd->device, what);
}

} // namespace

extern "C" int nl_cudnn_attention_forward(nl_cudnn *cd, float *out, float *lse, const float *q,
                                          int q_stride, const float *k, const float *v,
                                          int kv_stride, nl_attn_shape s, const nl_attn_mask *mask)
{
    try {
        return forward(cd, out, lse, q, q_stride, k, v, kv_stride, s, mask);
    } catch (const std::exception &x) {
        thrown(cd, x.what());
    } catch (...) {
        thrown(cd, "unknown exception");
    }
    return 0;
}

extern "C" int nl_cudnn_attention_backward(nl_cudnn *cd, float *dq, float *dk, float *dv,
                                           const float *dout, const float *q, int q_stride,
                                           const float *k, const float *v, int kv_stride,
                                           const float *out, const float *lse, nl_attn_shape s,
                                           const nl_attn_mask *mask)
{
    try {
        return backward(cd, dq, dk, dv, dout, q, q_stride, k, v, kv_stride, out, lse, s, mask);
    } catch (const std::exception &x) {
        thrown(cd, x.what());
    } catch (...) {
        thrown(cd, "unknown exception");
    }
    return 0;
}

#else /* built without the cuDNN frontend: every entry point declines */

extern "C" nl_cudnn *nl_cudnn_new(int device, void *stream, int bf16, int experts)
{
    const char *env = getenv("NL_CUDNN_ATTN");
    if (env && strcmp(env, "force") == 0)
        nl_log_write(NL_LOG_WARN,
                     "cuda:%d: NL_CUDNN_ATTN=force, but this module was built without cuDNN "
                     "(NL_CUDNN; scripts/install-deps.sh --cudnn-frontend)",
                     device);
    if (bf16 && experts)
        nl_log_write(NL_LOG_WARN,
                     "cuda:%d: NL_CUDA_EXPERTS=cudnn, but this module was built without cuDNN "
                     "(NL_CUDNN; scripts/install-deps.sh --cudnn-frontend): the experts' GEMMs "
                     "use the module's kernels",
                     device);
    return nullptr;
}

extern "C" void nl_cudnn_destroy(nl_cudnn **p)
{
    if (p)
        *p = nullptr;
}

extern "C" int nl_cudnn_attention_forward(nl_cudnn *, float *, float *, const float *, int,
                                          const float *, const float *, int, nl_attn_shape,
                                          const nl_attn_mask *)
{
    return 0;
}

extern "C" int nl_cudnn_attention_backward(nl_cudnn *, float *, float *, float *, const float *,
                                           const float *, int, const float *, const float *, int,
                                           const float *, const float *, nl_attn_shape,
                                           const nl_attn_mask *)
{
    return 0;
}

#endif
