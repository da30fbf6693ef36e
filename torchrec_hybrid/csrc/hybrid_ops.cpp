// Fused CPU kernels of the frequency-hybrid sharding's hot path (torch.library ops, namespace
// torchrec_hybrid). Each op does in one pass what torchrec_hybrid/sharding/composed.py composes from
// torch and FBGEMM ops (the reference, and the path on other devices); tests hold the two to identical
// results. See composed.py for what each output means.
//
//   split_pack        sample side, before the cold exchange: route, bucketize, pack the send rows
//   exchange_summary  after the exchange: every size the host needs, in one small tensor
//   unpack_cold       owner side: the lanes' TBE inputs and the output all-to-all's send plan
//   receive_plan      sample side: where each received unit of the output all-to-all adds in
//   check_ids         the sharded module's input check of ids and weights: a verdict, copies only where needed
//   hot_pool          sample side: the replica's SUM pooling of the hot lookups, the received partial sums added
//                     (and its backward): FBGEMM's dense TBE plus an index_add_, in one pass

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using at::Tensor;

int64_t total(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& v) {
  std::vector<int64_t> out(v.size());
  int64_t s = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = s;
    s += v[i];
  }
  return out;
}

template <typename T>
int64_t read_int(const Tensor& t, int64_t i) {
  return static_cast<int64_t>(t.data_ptr<T>()[i]);
}

// ---- split_pack ----------------------------------------------------------------------------------

template <typename V, typename L, typename M>
std::vector<Tensor> split_pack_impl(const Tensor& values, const Tensor& lengths, const c10::optional<Tensor>& weights,
                                    const c10::optional<Tensor>& route_map, const Tensor& feature_key_offset,
                                    int64_t W, const Tensor& report, const std::vector<int64_t>& rooms,
                                    const c10::optional<Tensor>& feature_units) {
  const int64_t F = feature_key_offset.numel();
  const int64_t B = F ? lengths.numel() / F : 0;
  const int64_t N = values.numel();
  const int64_t R = report.numel();
  const int64_t head = 2 * F + R + 1;
  const bool weighted = weights.has_value();
  const int64_t parts = weighted ? 3 : 2;
  const V* ids = values.data_ptr<V>();
  const L* len = lengths.data_ptr<L>();
  const int64_t* key_off = feature_key_offset.data_ptr<int64_t>();
  const M* map = route_map.has_value() ? route_map->data_ptr<M>() : nullptr;
  const float* wts = weighted ? weights->data_ptr<float>() : nullptr;
  const int64_t buckets = W + 1;
  const uint32_t ub = static_cast<uint32_t>(buckets);
  const int64_t map_size = route_map.has_value() ? route_map->numel() : 0;
  const auto id_opts = route_map.has_value() ? route_map->options() : values.options();
  const auto i32 = values.options().dtype(at::kInt);
  const auto i64 = values.options().dtype(at::kLong);

  // pass 1, per id: its bucket (an owner, or W: hot) and its row there; per (owner, feature) the non-empty
  // bags and the ids, per (feature, sample) the hot ids (the replica TBE's offsets)
  std::vector<int32_t> bucket_of(N);
  std::vector<M> row_of(N);
  std::vector<int64_t> bag_counts(W * F, 0), id_counts(W * F, 0), cnt(buckets, 0);
  Tensor hot_offsets = at::empty({F * B + 1}, id_opts);
  M* hoff = hot_offsets.data_ptr<M>();
  hoff[0] = 0;
  {
    int64_t i = 0;
    for (int64_t f = 0; f < F; ++f) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = static_cast<int64_t>(len[f * B + b]);
        TORCH_CHECK(n >= 0 && i + n <= N, "split_pack: bag lengths do not fit the ids (feature ", f, ")");
        int64_t hot = 0;
        for (int64_t k = i; k < i + n; ++k) {
          int64_t e = static_cast<int64_t>(ids[k]);
          if (map) {
            const int64_t key = key_off[f] + e;
            TORCH_CHECK(key >= 0 && key < map_size, "split_pack: id ", e, " of feature ", f, " outside its table");
            e = static_cast<int64_t>(map[key]);
          }
          int64_t q, d;
          if (e >= 0 && e <= 0xFFFFFFFFll) {  // 32-bit division where the id fits: a few times faster
            const uint32_t u = static_cast<uint32_t>(e);
            const uint32_t uq = u / ub;
            q = uq;
            d = u - uq * ub;
          } else {
            q = e / buckets;
            d = e - q * buckets;
          }
          bucket_of[k] = static_cast<int32_t>(d);
          row_of[k] = static_cast<M>(q);
          if (d == W) {
            ++hot;
          } else if (n == 1) {
            bag_counts[d * F + f] += 1;
            id_counts[d * F + f] += 1;
          } else {
            cnt[d] += 1;
          }
        }
        if (n > 1) {
          for (int64_t d = 0; d < W; ++d) {
            if (cnt[d]) {
              bag_counts[d * F + f] += 1;
              id_counts[d * F + f] += cnt[d];
              cnt[d] = 0;
            }
          }
        }
        hoff[f * B + b + 1] = static_cast<M>(hoff[f * B + b] + hot);
        i += n;
      }
    }
    TORCH_CHECK(i == N, "split_pack: bag lengths add up to ", i, " ids, got ", N);
  }
  std::vector<int64_t> words(W), units(W, 0), bags(W, 0), ids_to(W, 0);
  const int64_t* fu = feature_units.has_value() ? feature_units->data_ptr<int64_t>() : nullptr;
  bool over = false;
  int64_t sent_bags = 0;
  for (int64_t d = 0; d < W; ++d) {
    for (int64_t f = 0; f < F; ++f) {
      bags[d] += bag_counts[d * F + f];
      ids_to[d] += id_counts[d * F + f];
      units[d] += bag_counts[d * F + f] * (fu ? fu[f] : 1);
    }
    words[d] = bags[d] + (parts - 1) * ids_to[d];
    over = over || words[d] > rooms[d];
    sent_bags += bags[d];
  }
  // pass 2, bag by bag in (feature, sample) order: each destination's run is its bags' lengths, then their
  // ids, then their weights' bits, each in (feature, sample) order; the cells of the bags sent, destination
  // after destination; the hot rows, compact
  Tensor payload = at::empty({total(words)}, i32);
  Tensor sent_cells = at::empty({sent_bags}, i64);
  const int64_t hot_ids = static_cast<int64_t>(hoff[F * B]);
  Tensor hot_rows = at::empty({hot_ids}, id_opts);
  c10::optional<Tensor> hot_weights;
  if (weighted) hot_weights = at::empty({hot_ids}, weights->options());
  int32_t* pay = payload.data_ptr<int32_t>();
  int64_t* cells = sent_cells.data_ptr<int64_t>();
  M* hrows = hot_rows.data_ptr<M>();
  float* hw = weighted ? hot_weights->data_ptr<float>() : nullptr;
  const std::vector<int64_t> run_start = starts_of(words);
  std::vector<int64_t> at_len(W), at_id(W), at_w(W), at_cell(W);
  {
    int64_t c = 0;
    for (int64_t d = 0; d < W; ++d) {
      at_len[d] = run_start[d];
      at_id[d] = run_start[d] + bags[d];
      at_w[d] = at_id[d] + ids_to[d];
      at_cell[d] = c;
      c += bags[d];
    }
  }
  {
    int64_t i = 0, h = 0;
    for (int64_t f = 0; f < F; ++f) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = static_cast<int64_t>(len[f * B + b]);
        for (int64_t k = i; k < i + n; ++k) {
          const int64_t d = bucket_of[k];
          if (d == W) {
            hrows[h] = row_of[k];
            if (hw) hw[h] = wts[k];
            ++h;
          } else {
            pay[at_id[d]++] = static_cast<int32_t>(row_of[k]);
            if (wts) std::memcpy(&pay[at_w[d]++], &wts[k], sizeof(float));
            cnt[d] += 1;
          }
        }
        for (int64_t d = 0; d < W; ++d) {  // the bag's lengths per destination (W small counters)
          if (cnt[d]) {
            pay[at_len[d]++] = static_cast<int32_t>(cnt[d]);
            cells[at_cell[d]++] = b * F + f;
            cnt[d] = 0;
          }
        }
        i += n;
      }
    }
  }
  // send rows: per destination its header, then its room
  const int64_t total_rows = W * head + total(rooms);
  Tensor send_rows = at::empty({total_rows}, i32);
  int32_t* out = send_rows.data_ptr<int32_t>();
  const int32_t* rep = report.data_ptr<int32_t>();
  int64_t o = 0;
  for (int64_t d = 0; d < W; ++d) {
    for (int64_t f = 0; f < F; ++f) out[o + f] = static_cast<int32_t>(bag_counts[d * F + f]);
    for (int64_t f = 0; f < F; ++f) out[o + F + f] = static_cast<int32_t>(id_counts[d * F + f]);
    for (int64_t r = 0; r < R; ++r) out[o + 2 * F + r] = rep[r];
    out[o + head - 1] = over ? 1 : 0;
    o += head;
    const int64_t n = std::min(words[d], rooms[d]);
    if (n > 0) std::memcpy(out + o, pay + run_start[d], n * sizeof(int32_t));
    if (rooms[d] > n) std::memset(out + o + n, 0, (rooms[d] - n) * sizeof(int32_t));
    o += rooms[d];
  }
  Tensor stats = at::empty({3, W}, i64);
  int64_t* st = stats.data_ptr<int64_t>();
  for (int64_t d = 0; d < W; ++d) {
    st[d] = words[d];
    st[W + d] = units[d];
    st[2 * W + d] = bags[d];
  }
  Tensor counts = at::empty({W, F}, i64);
  std::memcpy(counts.data_ptr<int64_t>(), bag_counts.data(), W * F * sizeof(int64_t));
  return {send_rows, payload, stats, sent_cells, counts, hot_rows, hot_offsets,
          weighted ? *hot_weights : at::empty({0}, values.options().dtype(at::kFloat))};
}

std::vector<Tensor> split_pack(const Tensor& values, const Tensor& lengths, const c10::optional<Tensor>& weights,
                               const c10::optional<Tensor>& route_map, const Tensor& feature_key_offset, int64_t world,
                               const Tensor& report, at::IntArrayRef rooms,
                               const c10::optional<Tensor>& feature_units) {
  TORCH_CHECK(values.dim() == 1 && lengths.dim() == 1, "split_pack: values and lengths must be 1-D");
  TORCH_CHECK(values.is_contiguous() && lengths.is_contiguous(), "split_pack: contiguous inputs expected");
  TORCH_CHECK(feature_key_offset.scalar_type() == at::kLong, "split_pack: feature_key_offset must be int64");
  TORCH_CHECK(report.scalar_type() == at::kInt, "split_pack: report must be int32");
  TORCH_CHECK(static_cast<int64_t>(rooms.size()) == world, "split_pack: one room per destination expected");
  if (weights.has_value()) {
    TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->numel() == values.numel(),
                "split_pack: weights must be float32, one per id");
  }
  if (feature_units.has_value()) {
    TORCH_CHECK(feature_units->scalar_type() == at::kLong, "split_pack: feature_units must be int64");
  }
  const auto map_type = route_map.has_value() ? route_map->scalar_type() : values.scalar_type();
  const std::vector<int64_t> r(rooms.begin(), rooms.end());
  const Tensor fko = feature_key_offset.contiguous();
  const Tensor rep = report.contiguous();
#define HYBRID_SPLIT(V, L, M)                                                                                  \
  return split_pack_impl<V, L, M>(values, lengths, weights, route_map, fko, world, rep, r, feature_units);
#define HYBRID_SPLIT_M(V, L)                                 \
  if (map_type == at::kInt) {                                \
    HYBRID_SPLIT(V, L, int32_t)                              \
  } else {                                                   \
    TORCH_CHECK(map_type == at::kLong, "split_pack: ids int32 or int64"); \
    HYBRID_SPLIT(V, L, int64_t)                              \
  }
#define HYBRID_SPLIT_L(V)                                    \
  if (lengths.scalar_type() == at::kInt) {                   \
    HYBRID_SPLIT_M(V, int32_t)                               \
  } else {                                                   \
    TORCH_CHECK(lengths.scalar_type() == at::kLong, "split_pack: lengths int32 or int64"); \
    HYBRID_SPLIT_M(V, int64_t)                               \
  }
  if (values.scalar_type() == at::kInt) {
    HYBRID_SPLIT_L(int32_t)
  }
  TORCH_CHECK(values.scalar_type() == at::kLong, "split_pack: values must be int32 or int64");
  HYBRID_SPLIT_L(int64_t)
#undef HYBRID_SPLIT_L
#undef HYBRID_SPLIT_M
#undef HYBRID_SPLIT
}

// ---- exchange_summary ----------------------------------------------------------------------------

Tensor exchange_summary(const Tensor& rows_in, at::IntArrayRef recv_at, int64_t head, int64_t F,
                        const c10::optional<Tensor>& feature_units, const Tensor& stats) {
  TORCH_CHECK(rows_in.scalar_type() == at::kInt, "exchange_summary: int32 rows expected");
  const int64_t W = static_cast<int64_t>(recv_at.size());
  const int64_t R = head - 2 * F - 1;
  const int32_t* in = rows_in.data_ptr<int32_t>();
  const int64_t* fu = feature_units.has_value() ? feature_units->data_ptr<int64_t>() : nullptr;
  Tensor out = at::zeros({stats.numel() + 3 * W + 2 * F + 1 + W * R}, stats.options());
  int64_t* o = out.data_ptr<int64_t>();
  const Tensor st = stats.contiguous();
  std::memcpy(o, st.data_ptr<int64_t>(), st.numel() * sizeof(int64_t));
  int64_t* per_source = o + st.numel();
  int64_t* units_in = per_source + 2 * W;
  int64_t* per_feature = units_in + W;
  int64_t* over = per_feature + 2 * F;
  int64_t* reports = over + 1;
  for (int64_t q = 0; q < W; ++q) {
    const int32_t* h = in + recv_at[q];
    for (int64_t f = 0; f < F; ++f) {
      per_source[2 * q] += h[f];
      per_source[2 * q + 1] += h[F + f];
      units_in[q] += static_cast<int64_t>(h[f]) * (fu ? fu[f] : 1);
      per_feature[f] += h[f];
      per_feature[F + f] += h[F + f];
    }
    for (int64_t r = 0; r < R; ++r) reports[q * R + r] = h[2 * F + r];
    *over = std::max<int64_t>(*over, h[head - 1]);
  }
  return out;
}

// ---- unpack_cold ---------------------------------------------------------------------------------

std::vector<Tensor> unpack_cold(const Tensor& rows_in, const Tensor& rest_in, at::IntArrayRef recv_at,
                                at::IntArrayRef recv_rooms, int64_t head, at::IntArrayRef runs, int64_t F,
                                bool weighted, const Tensor& feature_table, const Tensor& lane_table,
                                at::IntArrayRef batches, const Tensor& extra_features, const Tensor& extra_rows,
                                at::IntArrayRef return_units) {
  TORCH_CHECK(rows_in.scalar_type() == at::kInt && rest_in.scalar_type() == at::kInt,
              "unpack_cold: int32 rows expected");
  TORCH_CHECK(extra_rows.scalar_type() == at::kInt && extra_features.scalar_type() == at::kLong,
              "unpack_cold: extra rows int32, features int64");
  const int64_t W = static_cast<int64_t>(recv_at.size());
  const int64_t G = lane_table.size(1);
  TORCH_CHECK(static_cast<int64_t>(batches.size()) == G, "unpack_cold: one batch per lane expected");
  const int32_t* in = rows_in.data_ptr<int32_t>();
  const int32_t* rest = rest_in.data_ptr<int32_t>();
  const Tensor ft = feature_table.contiguous(), lt = lane_table.contiguous();
  const int64_t* lane_of = ft.data_ptr<int64_t>();
  const int64_t* first_slot = lane_of + F;
  const int64_t* slots = first_slot + F;
  const int64_t* in_row = slots + F;
  const int64_t* units = in_row + F;
  const int64_t* lane_slots = lt.data_ptr<int64_t>();
  const int64_t* lane_units = lane_slots + G;
  const int64_t E = extra_rows.numel();
  const int64_t* ef = extra_features.data_ptr<int64_t>();
  const int32_t* er = extra_rows.data_ptr<int32_t>();

  // per (source, feature): bags and ids, from the headers
  std::vector<int64_t> cb(W * F), ci(W * F), bags_f(F, 0), ids_f(F, 0), extra_f(F, 0);
  for (int64_t q = 0; q < W; ++q) {
    for (int64_t f = 0; f < F; ++f) {
      cb[q * F + f] = in[recv_at[q] + f];
      ci[q * F + f] = in[recv_at[q] + F + f];
      bags_f[f] += cb[q * F + f];
      ids_f[f] += ci[q * F + f];
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(ef[e] >= 0 && ef[e] < F && lane_of[ef[e]] >= 0, "unpack_cold: an extra bag of feature ", ef[e],
                " in no lane");
    extra_f[ef[e]] += 1;
  }
  // lanes: where each lane's lengths and output start; per feature its first length slot and output start
  std::vector<int64_t> len_at(G), out_at(G);
  int64_t total_len = 0, total_units = 0;
  for (int64_t g = 0; g < G; ++g) {
    len_at[g] = total_len;
    out_at[g] = total_units;
    total_len += lane_slots[g] * batches[g];
    total_units += lane_units[g] * batches[g];
  }
  std::vector<int64_t> len_first(F, 0), id_first(F, 0);
  {
    // ids in lane order: lane after lane, its features by first slot (the order the lanes list them in)
    std::vector<std::vector<int64_t>> by_lane(G);
    for (int64_t f = 0; f < F; ++f) {
      if (lane_of[f] >= 0) by_lane[lane_of[f]].push_back(f);
    }
    int64_t id = 0;
    for (int64_t g = 0; g < G; ++g) {
      auto& fs = by_lane[g];
      std::sort(fs.begin(), fs.end(), [&](int64_t a, int64_t b) { return first_slot[a] < first_slot[b]; });
      for (int64_t f : fs) {
        len_first[f] = len_at[g] + first_slot[f] * batches[g];
        id_first[f] = id;
        id += ids_f[f] + extra_f[f];
      }
    }
  }
  auto position = [&](int64_t f, int64_t q) -> int64_t {
    const int64_t g = lane_of[f];
    const int64_t batch = batches[g];
    int64_t slot = 0, r = q;
    if (slots[f] > 1) {
      slot = q / batch;
      r = q - slot * batch;
    }
    return out_at[g] + in_row[f] + r * lane_units[g] + slot * units[f];
  };
  int64_t n_ids = 0;
  for (int64_t f = 0; f < F; ++f) n_ids += ids_f[f] + extra_f[f];
  const auto i32 = rows_in.options();
  const auto i64 = rows_in.options().dtype(at::kLong);
  Tensor lengths = at::zeros({total_len}, i32);
  Tensor ids = at::empty({n_ids}, i32);
  Tensor weights = at::empty({weighted ? n_ids : 0}, rows_in.options().dtype(at::kFloat));
  int32_t* lo = lengths.data_ptr<int32_t>();
  int32_t* io = ids.data_ptr<int32_t>();
  float* wo = weights.data_ptr<float>();
  int64_t row_units = 0;
  for (int64_t e = 0; e < E; ++e) row_units += units[ef[e]];
  const int64_t bag_units_total = total(std::vector<int64_t>(return_units.begin(), return_units.end()));
  Tensor index = at::empty({bag_units_total + W * row_units}, i64);
  Tensor source = at::zeros({total_units}, i64);
  Tensor row_pos = at::empty({row_units}, i64);
  Tensor row_dst = at::empty({W * row_units}, i64);
  int64_t* ix = index.data_ptr<int64_t>();
  int64_t* src = source.data_ptr<int64_t>();
  int64_t* rp = row_pos.data_ptr<int64_t>();
  int64_t* rd = row_dst.data_ptr<int64_t>();
  // the extra bags first (their positions go into every destination's block)
  {
    std::vector<int64_t> rank_in(F, 0);
    int64_t u = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t f = ef[e];
      const int64_t q = bags_f[f] + rank_in[f];
      lo[len_first[f] + q] = 1;
      io[id_first[f] + ids_f[f] + rank_in[f]] = er[e];
      if (weighted) wo[id_first[f] + ids_f[f] + rank_in[f]] = 1.0f;
      const int64_t p = position(f, q);
      for (int64_t k = 0; k < units[f]; ++k) rp[u++] = p + k;
      rank_in[f] += 1;
    }
  }
  // every source's run: its room's words in rows_in, the rest in rest_in
  std::vector<int64_t> bag_base(F, 0), id_base(F, 0);  // per feature, bags / ids of earlier sources
  int64_t rest_at = 0, send_at = 0;
  for (int64_t q = 0; q < W; ++q) {
    const int64_t cut = std::min<int64_t>(runs[q], recv_rooms[q]);
    const int32_t* room = in + recv_at[q] + head;
    const int32_t* more = rest + rest_at;
    auto word = [&](int64_t p) -> int32_t { return p < cut ? room[p] : more[p - cut]; };
    int64_t nb = 0, ni = 0;
    for (int64_t f = 0; f < F; ++f) {
      nb += cb[q * F + f];
      ni += ci[q * F + f];
    }
    int64_t lp = 0, ip = nb, wp = nb + ni;
    int64_t s = send_at;
    for (int64_t f = 0; f < F; ++f) {
      const int64_t n_bags = cb[q * F + f];
      const int64_t n_ids_f = ci[q * F + f];
      TORCH_CHECK(n_bags == 0 || lane_of[f] >= 0, "unpack_cold: bags of feature ", f, " in no lane");
      for (int64_t i = 0; i < n_bags; ++i) {
        const int64_t qq = bag_base[f] + i;
        lo[len_first[f] + qq] = word(lp++);
        const int64_t p = position(f, qq);
        for (int64_t k = 0; k < units[f]; ++k) {
          ix[s] = p + k;
          src[p + k] = s;
          ++s;
        }
      }
      const int64_t id_at = id_first[f] + id_base[f];
      for (int64_t k = 0; k < n_ids_f; ++k) io[id_at + k] = word(ip++);
      if (weighted) {
        for (int64_t k = 0; k < n_ids_f; ++k) {
          const int32_t bits = word(wp++);
          std::memcpy(&wo[id_at + k], &bits, sizeof(float));
        }
      }
      bag_base[f] += n_bags;
      id_base[f] += n_ids_f;
    }
    TORCH_CHECK(s - send_at == return_units[q], "unpack_cold: source ", q, " sent ", s - send_at,
                " units, the summary says ", return_units[q]);
    for (int64_t j = 0; j < row_units; ++j) {
      ix[s + j] = rp[j];
      rd[q * row_units + j] = s + j;
    }
    send_at = s + row_units;
    rest_at += runs[q] - cut;
  }
  return {lengths, ids, weights, index, source, row_pos, row_dst};
}

// ---- receive_plan --------------------------------------------------------------------------------

std::vector<Tensor> receive_plan(const Tensor& sent_cells, int64_t F, const Tensor& cell_table, int64_t row_units,
                                 at::IntArrayRef partial_units, at::IntArrayRef replica_units,
                                 const Tensor& replica_order, int64_t pooled_units, int64_t spread_max) {
  TORCH_CHECK(sent_cells.scalar_type() == at::kLong, "receive_plan: int64 cells expected");
  const int64_t W = static_cast<int64_t>(partial_units.size());
  const int64_t n_partial = total(std::vector<int64_t>(partial_units.begin(), partial_units.end()));
  const int64_t n_rows = total(std::vector<int64_t>(replica_units.begin(), replica_units.end()));
  const Tensor ct = cell_table.contiguous();
  const int64_t* in_row = ct.data_ptr<int64_t>();  // per feature, units before it in a pooled row
  const int64_t* units = in_row + F;  // per feature, units per bag
  const auto i64 = sent_cells.options();
  Tensor recv_pos = at::empty({n_partial + n_rows}, i64);
  Tensor row_src = at::empty({n_rows}, i64);
  int64_t* rp = recv_pos.data_ptr<int64_t>();
  int64_t* rs = row_src.data_ptr<int64_t>();
  const int64_t* cells = sent_cells.data_ptr<int64_t>();
  const int64_t spread = std::max<int64_t>(1, std::min(pooled_units, spread_max));
  int64_t at = 0, c = 0, r = 0;
  for (int64_t d = 0; d < W; ++d) {
    const int64_t end = at + partial_units[d];
    while (at < end) {
      const int64_t cell = cells[c++];
      const int64_t f = cell % F, sample = cell / F;
      const int64_t p = sample * row_units + in_row[f];
      for (int64_t k = 0; k < units[f]; ++k, ++at) rp[at] = p + k;
    }
    for (int64_t j = 0; j < replica_units[d]; ++j, ++at) {
      rp[at] = at % spread;
      rs[r++] = at;
    }
  }
  Tensor replica_src;
  if (n_rows > 0) {
    replica_src = row_src.index_select(0, replica_order);
  } else {
    replica_src = at::empty({0}, i64);
  }
  return {recv_pos, row_src, replica_src};
}

// ---- hot_pool / hot_pool_backward ----------------------------------------------------------------
// The replica TBE's SUM pooling of this rank's hot lookups (FBGEMM's dense TBE: rows of feature f's table at
// weights_offsets[f], width D_offsets[f + 1] - D_offsets[f], output columns from D_offsets[f]), with the output
// all-to-all's received units added in at their positions (units of `unit` elements of the pooled output).

// dst[0:n] (+)= scale * src[0:n]: the pooling's inner loop (restrict: no aliasing, so the compiler vectorises)
template <int64_t N>
inline void axpy_fixed(float* __restrict__ dst, const float* __restrict__ src, float scale) {
  for (int64_t d = 0; d < N; ++d) dst[d] += scale * src[d];
}

inline void axpy(float* __restrict__ dst, const float* __restrict__ src, int64_t n, float scale, bool first) {
  if (first) {
    for (int64_t d = 0; d < n; ++d) dst[d] = scale * src[d];
    return;
  }
  switch (n) {
    case 16: axpy_fixed<16>(dst, src, scale); return;
    case 32: axpy_fixed<32>(dst, src, scale); return;
    case 64: axpy_fixed<64>(dst, src, scale); return;
    case 128: axpy_fixed<128>(dst, src, scale); return;
    default:
      for (int64_t d = 0; d < n; ++d) dst[d] += scale * src[d];
  }
}

// the same for a width known at compile time: a fully unrolled, vectorised loop (64 and the other common widths)
template <int64_t N>
inline void add_fixed(float* __restrict__ dst, const float* __restrict__ src) {
  for (int64_t d = 0; d < N; ++d) dst[d] += src[d];
}

inline void add(float* __restrict__ dst, const float* __restrict__ src, int64_t n, bool first) {
  if (first) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  switch (n) {
    case 16: add_fixed<16>(dst, src); return;
    case 32: add_fixed<32>(dst, src); return;
    case 64: add_fixed<64>(dst, src); return;
    case 128: add_fixed<128>(dst, src); return;
    default:
      for (int64_t d = 0; d < n; ++d) dst[d] += src[d];
  }
}

template <typename I>
Tensor hot_pool_impl(const Tensor& replica, const Tensor& weights_offsets, const Tensor& D_offsets, const Tensor& rows,
                     const Tensor& offsets, const c10::optional<Tensor>& weights, const Tensor& recv,
                     const Tensor& recv_pos, int64_t unit, int64_t batch) {
  const int64_t F = weights_offsets.numel();
  const int64_t* wo = weights_offsets.data_ptr<int64_t>();
  const int32_t* Do = D_offsets.data_ptr<int32_t>();
  const int64_t total_D = Do[F];
  const I* r = rows.data_ptr<I>();
  const I* off = offsets.data_ptr<I>();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  const float* rep = replica.data_ptr<float>();
  Tensor out = at::empty({batch, total_D}, replica.options());
  float* o = out.data_ptr<float>();
  // sample after sample (the output's rows in order), each feature's block: its first row copied, the rest added
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t f = 0; f < F; ++f) {
      const int64_t D = Do[f + 1] - Do[f];
      const float* table = rep + wo[f];
      float* dst = o + b * total_D + Do[f];
      const I k0 = off[f * batch + b], k1 = off[f * batch + b + 1];
      if (k0 == k1) {
        std::memset(dst, 0, D * sizeof(float));
        continue;
      }
      for (I k = k0; k < k1; ++k) {
        const float* src = table + static_cast<int64_t>(r[k]) * D;
        if (w) {
          axpy(dst, src, D, w[k], k == k0);
        } else {
          add(dst, src, D, k == k0);
        }
      }
    }
  }
  const int64_t n = recv_pos.numel();
  const int64_t* pos = recv_pos.data_ptr<int64_t>();
  const float* in = recv.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) add(o + pos[i] * unit, in + i * unit, unit, false);
  return out;
}

Tensor hot_pool(const Tensor& replica, const Tensor& weights_offsets, const Tensor& D_offsets, const Tensor& rows,
                const Tensor& offsets, const c10::optional<Tensor>& weights, const Tensor& recv,
                const Tensor& recv_pos, int64_t unit, int64_t batch) {
  TORCH_CHECK(replica.scalar_type() == at::kFloat && replica.is_contiguous(), "hot_pool: contiguous float replica");
  TORCH_CHECK(recv.scalar_type() == at::kFloat && recv.is_contiguous(), "hot_pool: contiguous float units");
  TORCH_CHECK(recv.numel() == recv_pos.numel() * unit, "hot_pool: one position per received unit");
  TORCH_CHECK(rows.scalar_type() == offsets.scalar_type(), "hot_pool: rows and offsets of one dtype");
  TORCH_CHECK(offsets.numel() == weights_offsets.numel() * batch + 1, "hot_pool: offsets per (feature, sample)");
  if (rows.scalar_type() == at::kInt) {
    return hot_pool_impl<int32_t>(replica, weights_offsets, D_offsets, rows, offsets, weights, recv, recv_pos, unit,
                                  batch);
  }
  return hot_pool_impl<int64_t>(replica, weights_offsets, D_offsets, rows, offsets, weights, recv, recv_pos, unit,
                                batch);
}

template <typename I>
std::vector<Tensor> hot_pool_backward_impl(const Tensor& grad, int64_t replica_numel, const Tensor& weights_offsets,
                                           const Tensor& D_offsets, const Tensor& rows, const Tensor& offsets,
                                           const c10::optional<Tensor>& weights, const Tensor& recv_pos,
                                           int64_t unit) {
  const int64_t F = weights_offsets.numel();
  const int64_t* wo = weights_offsets.data_ptr<int64_t>();
  const int32_t* Do = D_offsets.data_ptr<int32_t>();
  const int64_t total_D = Do[F];
  const int64_t batch = total_D ? grad.numel() / total_D : 0;
  const I* r = rows.data_ptr<I>();
  const I* off = offsets.data_ptr<I>();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  const float* g = grad.data_ptr<float>();
  Tensor grad_replica = at::zeros({replica_numel}, grad.options());
  float* gr = grad_replica.data_ptr<float>();
  for (int64_t f = 0; f < F; ++f) {
    const int64_t D = Do[f + 1] - Do[f];
    float* table = gr + wo[f];
    for (int64_t b = 0; b < batch; ++b) {
      const float* src = g + b * total_D + Do[f];
      for (I k = off[f * batch + b]; k < off[f * batch + b + 1]; ++k) {
        float* dst = table + static_cast<int64_t>(r[k]) * D;
        if (w) {
          axpy(dst, src, D, w[k], false);
        } else {
          add(dst, src, D, false);
        }
      }
    }
  }
  const int64_t n = recv_pos.numel();
  const int64_t* pos = recv_pos.data_ptr<int64_t>();
  Tensor grad_recv = at::empty({n * unit}, grad.options());
  float* gv = grad_recv.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(gv + i * unit, g + pos[i] * unit, unit * sizeof(float));
  return {grad_replica, grad_recv};
}

std::vector<Tensor> hot_pool_backward(const Tensor& grad, int64_t replica_numel, const Tensor& weights_offsets,
                                      const Tensor& D_offsets, const Tensor& rows, const Tensor& offsets,
                                      const c10::optional<Tensor>& weights, const Tensor& recv_pos, int64_t unit) {
  const Tensor g = grad.contiguous();
  TORCH_CHECK(g.scalar_type() == at::kFloat, "hot_pool_backward: float gradient");
  if (rows.scalar_type() == at::kInt) {
    return hot_pool_backward_impl<int32_t>(g, replica_numel, weights_offsets, D_offsets, rows, offsets, weights,
                                           recv_pos, unit);
  }
  return hot_pool_backward_impl<int64_t>(g, replica_numel, weights_offsets, D_offsets, rows, offsets, weights,
                                         recv_pos, unit);
}

// ---- check_ids -----------------------------------------------------------------------------------
// The sharded module's per-step input check of ids and weights (sharded_ebc.py): whether some id of a key that
// is a feature lies outside [0, its limit], else whether some weight is NaN / infinite (codes 1, 2; 0: neither),
// and only where one does, a copy with such ids clamped into range and such weights zeroed (empty: none).

template <typename V>
std::vector<Tensor> check_ids_impl(const Tensor& values, const Tensor& limit_per_key, at::IntArrayRef counts,
                                   const Tensor& feature_of_key, const c10::optional<Tensor>& weights) {
  const int64_t K = static_cast<int64_t>(counts.size());
  const V* v = values.data_ptr<V>();
  const V* lim = limit_per_key.data_ptr<V>();
  const int64_t* fk = feature_of_key.data_ptr<int64_t>();
  bool bad_id = false, bad_weight = false;
  int64_t i = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t n = counts[k];
    if (fk[k] >= 0) {
      const V top = lim[k];
      for (int64_t j = i; j < i + n; ++j) bad_id |= (v[j] < 0) | (v[j] > top);
    }
    i += n;
  }
  TORCH_CHECK(i == values.numel(), "check_ids: ids per key add up to ", i, ", got ", values.numel());
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  if (w && !bad_id) {
    i = 0;
    for (int64_t k = 0; k < K; ++k) {
      if (fk[k] >= 0) {
        for (int64_t j = i; j < i + counts[k]; ++j) bad_weight |= !std::isfinite(w[j]);
      }
      i += counts[k];
    }
  }
  Tensor code = at::full({1}, bad_id ? 1 : (bad_weight ? 2 : 0), values.options().dtype(at::kLong));
  Tensor fixed_values = at::empty({0}, values.options());
  Tensor fixed_weights = at::empty({0}, values.options().dtype(at::kFloat));
  if (bad_id) {
    fixed_values = values.clone();
    V* out = fixed_values.data_ptr<V>();
    i = 0;
    for (int64_t k = 0; k < K; ++k) {
      if (fk[k] >= 0) {
        for (int64_t j = i; j < i + counts[k]; ++j) out[j] = std::min(std::max(out[j], V(0)), lim[k]);
      }
      i += counts[k];
    }
  }
  if (w) {  // bad weights are zeroed whenever there is one (the code reports a bad id first)
    bool any = bad_weight;
    if (bad_id) {
      i = 0;
      for (int64_t k = 0; k < K; ++k) {
        if (fk[k] >= 0) {
          for (int64_t j = i; j < i + counts[k]; ++j) any |= !std::isfinite(w[j]);
        }
        i += counts[k];
      }
    }
    if (any) {
      fixed_weights = weights->clone();
      float* out = fixed_weights.data_ptr<float>();
      i = 0;
      for (int64_t k = 0; k < K; ++k) {
        if (fk[k] >= 0) {
          for (int64_t j = i; j < i + counts[k]; ++j) {
            if (!std::isfinite(out[j])) out[j] = 0.0f;
          }
        }
        i += counts[k];
      }
    }
  }
  return {code, fixed_values, fixed_weights};
}

std::vector<Tensor> check_ids(const Tensor& values, const Tensor& limit_per_key, at::IntArrayRef counts,
                              const Tensor& feature_of_key, const c10::optional<Tensor>& weights) {
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous(), "check_ids: contiguous 1-D ids");
  TORCH_CHECK(limit_per_key.scalar_type() == values.scalar_type(), "check_ids: limits of the ids' dtype");
  if (weights.has_value()) {
    TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->numel() == values.numel() &&
                    weights->is_contiguous(),
                "check_ids: float32 weights, one per id");
  }
  if (values.scalar_type() == at::kInt) return check_ids_impl<int32_t>(values, limit_per_key, counts, feature_of_key,
                                                                        weights);
  TORCH_CHECK(values.scalar_type() == at::kLong, "check_ids: int32 or int64 ids");
  return check_ids_impl<int64_t>(values, limit_per_key, counts, feature_of_key, weights);
}

}  // namespace

TORCH_LIBRARY(torchrec_hybrid, m) {
  m.def(
      "split_pack(Tensor values, Tensor lengths, Tensor? weights, Tensor? route_map, Tensor feature_key_offset, "
      "int world, Tensor report, int[] rooms, Tensor? feature_units) -> Tensor[]");
  m.def(
      "exchange_summary(Tensor rows_in, int[] recv_at, int head, int num_features, Tensor? feature_units, "
      "Tensor stats) -> Tensor");
  m.def(
      "unpack_cold(Tensor rows_in, Tensor rest_in, int[] recv_at, int[] recv_rooms, int head, int[] runs, "
      "int num_features, bool weighted, Tensor feature_table, Tensor lane_table, int[] batches, "
      "Tensor extra_features, Tensor extra_rows, int[] return_units) -> Tensor[]");
  m.def(
      "receive_plan(Tensor sent_cells, int num_features, Tensor cell_table, int row_units, int[] partial_units, "
      "int[] replica_units, Tensor replica_order, int pooled_units, int spread_max) -> Tensor[]");
  m.def(
      "check_ids(Tensor values, Tensor limit_per_key, int[] counts, Tensor feature_of_key, Tensor? weights) "
      "-> Tensor[]");
  m.def(
      "hot_pool(Tensor replica, Tensor weights_offsets, Tensor D_offsets, Tensor rows, Tensor offsets, "
      "Tensor? weights, Tensor recv, Tensor recv_pos, int unit, int batch) -> Tensor");
  m.def(
      "hot_pool_backward(Tensor grad, int replica_numel, Tensor weights_offsets, Tensor D_offsets, Tensor rows, "
      "Tensor offsets, Tensor? weights, Tensor recv_pos, int unit) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(torchrec_hybrid, CPU, m) {
  m.impl("split_pack", &split_pack);
  m.impl("exchange_summary", &exchange_summary);
  m.impl("unpack_cold", &unpack_cold);
  m.impl("receive_plan", &receive_plan);
  m.impl("check_ids", &check_ids);
  m.impl("hot_pool", &hot_pool);
  m.impl("hot_pool_backward", &hot_pool_backward);
}
