// Decode attention over kv-int8 pages, read in place on the flash-decoding skeleton of flash_decode.h.
//
// A page (bytes; the views' strides carry the layout, the page stride is free):
//   kv    [T, 2, KVH, D] int8        K or V of token t, kv head g: kv + t * tok + (0 | v_off) + g * D
//   scale [T, 2, KVH]    float32     one per token, K or V, and head: x ~= q * s (cache/quant.py)
// K and V rows are widened to float32 in registers (W int8 lanes -> W floats) and never written:
//   score = s_k * (q . k8)        acc += (p * s_v) * v8
// so a token costs the float kernel's multiply-adds plus one conversion per W elements, over half
// the bytes of bf16 K/V (a quarter of float32's). Rows stay in natural order (no bf16 split).

#include "flash_decode.h"
#include "work_queue.h"

namespace {
using namespace apt_simd;

template <int NQ>
inline float score_row_i8(const vf* q, const int8_t* k) {
  vf a = vzero(), b = vzero();
  for (int c = 0; c < NQ; c += 2) {
    a = vfma(q[c], vload_i8(k + c * W), a);
    if (c + 1 < NQ) b = vfma(q[c + 1], vload_i8(k + (c + 1) * W), b);
  }
  return vsum(vadd(a, b));
}

inline float dot_i8(const float* q, const int8_t* k, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

struct Int8Page {
  const int8_t* kv;  // the page's K rows; V rows at + v_off
  const float* scale;  // the page's K scales; V scales at + sv_off
  int64_t tok, v_off, s_tok, sv_off;
};

// One page, all query heads (NQ = dim / W vectors per row in registers; 0: the scalar path).
// ahead != 0: bytes from this page to the next, whose rows are prefetched as this page's are read.
template <int NQ>
void attend_page_i8(const Int8Page& pg, int64_t n, int64_t heads, int64_t group, int64_t dim, const float* qf,
                    float* s, int64_t s_stride, Partial& st, int64_t ahead) {
  for (int64_t h = 0; h < heads; ++h) {
    const int8_t* k = pg.kv + (h / group) * dim;
    const float* ks = pg.scale + h / group;
    float* sh = s + h * s_stride;
    if constexpr (NQ > 0) {
      vf q[NQ];
      for (int c = 0; c < NQ; ++c) q[c] = vload(qf + h * dim + c * W);
      for (int64_t t = 0; t < n; ++t) {
        const int8_t* kt = k + t * pg.tok;
        if (ahead != 0 && h % group == 0)
          for (int64_t off = 0; off < dim; off += 64) prefetch(kt + ahead + off);
        sh[t] = ks[t * pg.s_tok] * score_row_i8<NQ>(q, kt);
      }
    } else {
      for (int64_t t = 0; t < n; ++t) sh[t] = ks[t * pg.s_tok] * dot_i8(qf + h * dim, k + t * pg.tok, dim);
    }
  }
  st.absorb_scores(s, s_stride, n);
  for (int64_t h = 0; h < heads; ++h) {
    const int8_t* v = pg.kv + pg.v_off + (h / group) * dim;
    const float* vs = pg.scale + pg.sv_off + h / group;
    const float* sh = s + h * s_stride;
    float* acc = st.acc.data() + h * dim;
    if constexpr (NQ > 0) {
      vf a[NQ];
      for (int c = 0; c < NQ; ++c) a[c] = vload(acc + c * W);
      for (int64_t t = 0; t < n; ++t) {
        const int8_t* vt = v + t * pg.tok;
        if (ahead != 0 && h % group == 0)
          for (int64_t off = 0; off < dim; off += 64) prefetch(vt + ahead + off);
        const vf p = vset1(sh[t] * vs[t * pg.s_tok]);
        for (int c = 0; c < NQ; ++c) a[c] = vfma(p, vload_i8(vt + c * W), a[c]);
      }
      for (int c = 0; c < NQ; ++c) vstore(acc + c * W, a[c]);
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const float p = sh[t] * vs[t * pg.s_tok];
        const int8_t* vt = v + t * pg.tok;
        for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(vt[d]);
      }
    }
  }
}

using PageFn = void (*)(const Int8Page&, int64_t, int64_t, int64_t, int64_t, const float*, float*, int64_t, Partial&,
                        int64_t);

PageFn page_fn_i8(int64_t dim) {
  if (dim % W == 0) switch (dim / W) {
      case 1: return attend_page_i8<1>;
      case 2: return attend_page_i8<2>;
      case 4: return attend_page_i8<4>;
      case 8: return attend_page_i8<8>;
      case 16: return attend_page_i8<16>;
      default: break;
    }
  return attend_page_i8<0>;
}

template <typename T>
void kv_int8_decode_impl(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& kv_scale,
                         const torch::Tensor& table, const torch::Tensor& lens, double scale, int64_t part_tokens,
                         torch::Tensor& out, float* lse = nullptr) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t tpp = kv.size(1), group = heads / kv.size(3);
  const int8_t* kv_base = kv.data_ptr<int8_t>();
  const float* s_base = kv_scale.data_ptr<float>();
  const T* q_base = q.data_ptr<T>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t max_pages = table.size(1);
  const int64_t scale_bytes = tpp * kv_scale.stride(1) * int64_t(sizeof(float));
  const auto items = make_items(lens.data_ptr<int32_t>(), batch, tpp, part_tokens);
  const int64_t row = 2 + dim;
  std::vector<float> partials(items.size() * heads * row);
  const PageFn fn = page_fn_i8(dim);
  apt_work::WorkQueue work(static_cast<int64_t>(items.size()));
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(heads * dim), tmp(dim), s(heads * tpp);
    Partial st(heads, dim);
    for (int64_t i; work.take(i);) {
      const Item& it = items[i];
      load_query(q_base + it.b * heads * dim, heads, dim, float(scale), false, qf.data(), tmp.data());
      st.init();
      for (int64_t t0 = it.start; t0 < it.end; t0 += tpp) {
        const int64_t page = tab[it.b * max_pages + t0 / tpp];
        const Int8Page pg{kv_base + page * kv.stride(0), s_base + page * kv_scale.stride(0), kv.stride(1),
                          kv.stride(2), kv_scale.stride(1), kv_scale.stride(2)};
        int64_t ahead = 0;
        if (t0 + tpp < it.end) {
          const int64_t next = tab[it.b * max_pages + t0 / tpp + 1];
          ahead = (next - page) * kv.stride(0);
          const char* ns = reinterpret_cast<const char*>(s_base + next * kv_scale.stride(0));
          for (int64_t off = 0; off < scale_bytes; off += 64) prefetch(ns + off);
        }
        fn(pg, std::min(tpp, it.end - t0), heads, group, dim, qf.data(), s.data(), tpp, st, ahead);
      }
      st.write(partials.data() + i * heads * row, false);
    }
  });
  merge(items, partials.data(), heads, dim, batch, out.data_ptr<T>(), nullptr, lse);
}

torch::Tensor kv_int8_decode_into(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& kv_scale,
                                  const torch::Tensor& table, const torch::Tensor& lens, double scale,
                                  int64_t part_tokens, torch::Tensor lse) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: expected a contiguous [B, H, D] tensor");
  TORCH_CHECK(kv.scalar_type() == torch::kChar && kv.dim() == 5 && kv.size(2) == 2 && kv.size(4) == q.size(2) &&
                  kv.stride(4) == 1 && kv.stride(3) == kv.size(4),
              "kv: expected int8 pages [P, T, 2, KVH, D] with contiguous head rows");
  TORCH_CHECK(kv_scale.scalar_type() == torch::kFloat && kv_scale.dim() == 4 &&
                  kv_scale.sizes() == kv.sizes().slice(0, 4) && kv_scale.stride(3) == 1,
              "kv_scale: expected float32 scales [P, T, 2, KVH] beside the int8 pages");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "q: query heads must be a multiple of the KV heads");
  check_table(table, lens, q.size(0));
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  float* lse_ptr = lse.defined() ? lse.data_ptr<float>() : nullptr;
  if (q.scalar_type() == torch::kFloat) {
    kv_int8_decode_impl<float>(q, kv, kv_scale, table, lens, scale, part_tokens, out, lse_ptr);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "q: float32 or bfloat16 only");
    kv_int8_decode_impl<bf16>(q, kv, kv_scale, table, lens, scale, part_tokens, out, lse_ptr);
  }
  return out;
}

torch::Tensor kv_int8_decode(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& kv_scale,
                             const torch::Tensor& table, const torch::Tensor& lens, double scale,
                             int64_t part_tokens) {
  return kv_int8_decode_into(q, kv, kv_scale, table, lens, scale, part_tokens, torch::Tensor());
}

std::tuple<torch::Tensor, torch::Tensor> kv_int8_decode_lse(const torch::Tensor& q, const torch::Tensor& kv,
                                                            const torch::Tensor& kv_scale, const torch::Tensor& table,
                                                            const torch::Tensor& lens, double scale,
                                                            int64_t part_tokens) {
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options().dtype(torch::kFloat));
  auto out = kv_int8_decode_into(q, kv, kv_scale, table, lens, scale, part_tokens, lse);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("kv_int8_decode(Tensor q, Tensor kv, Tensor kv_scale, Tensor block_table, Tensor ctx_lens, float scale, "
        "int part_tokens) -> Tensor");
  m.def("kv_int8_decode_lse(Tensor q, Tensor kv, Tensor kv_scale, Tensor block_table, Tensor ctx_lens, "
        "float scale, int part_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("kv_int8_decode", &kv_int8_decode);
  m.impl("kv_int8_decode_lse", &kv_int8_decode_lse);
}
