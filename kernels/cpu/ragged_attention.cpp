// splitfuse_cpu::store_and_attend_step: one layer's attention of a whole step, prompt chunks and
// decodes together, from tensors and numbers alone (no plan object: inductor's C++ wrapper calls
// it from a compiled graph). It first writes each token's K/V into its cache slot (slot -1: not
// stored); then row r's query tokens query_start[r] ..
// query_start[r + 1] - 1 attend through row r of the block tables: its i-th of q_len tokens sits
// at position context_lens[r] - q_len + i and sees positions 0 .. its own.
//
//   - decode rows (q_len 1): fixed_order_attention's kernel (fixed_order_attention.cpp), every
//     decode token of the step in one call, reading its context in place;
//   - prompt chunks (q_len >= 2): the row's context gathered into [1, num_kv_heads, context_len,
//     head_dim], then at::scaled_dot_product_attention under a mask causal relative to the
//     row's cached prefix (is_causal when nothing is cached). A chunk of at least 2 * kQueryChunk
//     tokens attends in query chunks of kQueryChunk, each over the context its last query sees,
//     as kernels/torch_attention.py does (QUERY_CHUNK there), but in one causal call where
//     nothing is cached and torch's flash kernel multiplies on AMX tiles (whole_causal); on
//     CPUs with AMX-BF16 or AVX-512 BF16, bfloat16 chunks with heads of 64 go to our own kernel
//     instead (prompt_attention.h: on the tiles, or in AVX-512), reading a bfloat16 cache in
//     place;
//   - rows of no query token: nothing.
//
//   block_size 4, a row with block_table [7, 2], context_len 6 and 3 query tokens (3 cached):
//   context slots [28, 29, 30, 31, 8, 9]; its tokens sit at positions 3, 4, 5 and see
//   [[1,1,1,1,0,0], [1,1,1,1,1,0], [1,1,1,1,1,1]]
//
// Every input is checked before the cache is written: a bad one raises and changes nothing. The
// result [num_tokens, num_heads, head_dim] is in the query's dtype, contiguous (prompt chunks
// read K/V converted to the query's dtype where the cache's differs).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "fixed_order_attention.h"
#include "prompt_attention.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr const char* kOp = "store_and_attend_step";

// Prompt chunks of at least twice this many tokens attend in query chunks of this many (causal
// attention then skips the keys past a chunk, which torch's CPU flash kernel does not).
constexpr int64_t kQueryChunk = 64;

// Whether a prompt chunk with nothing cached before it attends in one causal call whatever its
// length: where torch's flash kernel multiplies this dtype on packed tiles (AMX: its
// cpublas::could_pack), the keys past a query chunk cost less than the chunks' own calls (an
// Intel Xeon with AMX, bfloat16, 2 cores: prefill of 64 x 512 tokens ~5% faster in one call,
// medians of 10 alternating runs); elsewhere (AVX-512 BF16 without AMX: 1,740 -> 1,990 tok/s
// by query chunks) the chunks skip them.
bool whole_causal(at::ScalarType type) {
  if (type != at::kBFloat16 && type != at::kHalf) return false;
  static const bool bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool half = at::native::cpublas::could_pack(at::kHalf);
  return type == at::kBFloat16 ? bf16 : half;
}

bool is_attention_dtype(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// Checks everything the operator reads or writes, before anything is written.
void check_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const at::Tensor& key_cache, const at::Tensor& slots,
                const at::Tensor& block_tables, const at::Tensor& query_start,
                const at::Tensor& context_lens) {
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(key_cache.device().is_cpu() &&
                  (is_attention_dtype(key_cache.scalar_type()) ||
                   key_cache.scalar_type() == at::kFloat8_e4m3fn),
              kOp, ": kv_cache must be a float32, bfloat16, float16 or float8_e4m3fn CPU tensor");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  query.device().is_cpu() && is_attention_dtype(query.scalar_type()),
              kOp, ": query must be a float32, bfloat16 or float16 CPU tensor [num_tokens, "
              "num_heads, head_dim] with contiguous heads");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(query.size(2) == head_dim && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              kOp, ": query [", num_tokens, ", ", num_heads, ", ", query.size(2),
              "] does not match the cache's ", num_kv_heads, " KV heads of ", head_dim);
  splitfuse_fixed_order::check_store(kOp, key, value, key_cache, slots, num_tokens);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.scalar_type() == at::kInt && block_tables.device().is_cpu(),
              kOp, ": block_tables must be contiguous int32 [num_rows, max_blocks]");
  const int64_t num_rows = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(query_start.dim() == 1 && query_start.size(0) == num_rows + 1 &&
                  query_start.is_contiguous() && query_start.scalar_type() == at::kInt &&
                  query_start.device().is_cpu() && context_lens.dim() == 1 &&
                  context_lens.size(0) == num_rows && context_lens.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.device().is_cpu(),
              kOp, ": query_start must be int32 [num_rows + 1] and context_lens int32 "
              "[num_rows], for the ", num_rows, " rows of block_tables");
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* ctx_lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_rows] == num_tokens, kOp,
              ": query_start must run from 0 to num_tokens ", num_tokens, ", got ", starts[0],
              " .. ", starts[num_rows]);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t q_len = static_cast<int64_t>(starts[r + 1]) - starts[r];
    const int64_t ctx_len = ctx_lens[r];
    TORCH_CHECK(q_len >= 0, kOp, ": query_start decreases at row ", r, ": ", starts[r], " -> ",
                starts[r + 1]);
    if (q_len == 0) continue;
    TORCH_CHECK(q_len <= ctx_len && ctx_len <= max_blocks * block_size, kOp, ": row ", r,
                " of ", q_len, " query tokens has context_len ", ctx_len, " (must be in [",
                q_len, ", ", max_blocks * block_size, "])");
    const int32_t* table = tables + r * max_blocks;
    for (int64_t b = 0; b < (ctx_len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, kOp, ": row ", r, " reads block ",
                  table[b], " of ", num_blocks);
  }
}

// The cache slots of a row's context positions 0 .. context_len - 1, through its block table:
// int64 [context_len] (one for the row's keys and values).
at::Tensor context_slots(const int32_t* table, int64_t block_size, int64_t context_len) {
  at::Tensor slots = at::empty({context_len}, at::kLong);
  int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t p = 0; p < context_len; ++p)
    slot[p] = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  return slots;
}

// A row's context (its `slots`) gathered from a cache seen as [num_slots, num_kv_heads,
// head_dim]: [1, num_kv_heads, context_len, head_dim] (a permuted view of the gathered
// [context_len, num_kv_heads, head_dim]).
at::Tensor gather_context(const at::Tensor& slot_rows, const at::Tensor& slots) {
  return slot_rows.index_select(0, slots).permute({1, 0, 2}).unsqueeze(0);
}

// The 256 float8 e4m3fn values as T (float, at::BFloat16 or at::Half: each holds them exactly),
// NaN as NaN: torch's conversion, made once.
template <typename T>
const std::array<T, 256>& float8_values() {
  static const std::array<T, 256> values = [] {
    std::array<T, 256> out;
    for (int b = 0; b < 256; ++b) {
      c10::Float8_e4m3fn v;
      v.x = static_cast<uint8_t>(b);
      out[b] = static_cast<T>(static_cast<float>(v));
    }
    return out;
  }();
  return values;
}

template <typename T>
void widen_rows(const uint8_t* cache, const int64_t* slot, int64_t row_size, int64_t begin,
                int64_t end, T* out) {
  const std::array<T, 256>& values = float8_values<T>();
  for (int64_t p = begin; p < end; ++p) {
    const uint8_t* in = cache + slot[p] * row_size;
    T* row = out + p * row_size;
    for (int64_t i = 0; i < row_size; ++i) row[i] = values[in[i]];
  }
}

// gather_context from a float8 e4m3fn cache [num_slots, num_kv_heads, head_dim], widened to
// `dtype` on the way (by a table: torch's conversion of a float8 tensor takes ~2.4 ns a value
// on these CPUs, which a prompt chunk's context pays each layer)
at::Tensor gather_float8_context(const at::Tensor& slot_rows, const at::Tensor& slots,
                                 at::ScalarType dtype) {
  const int64_t num_kv_heads = slot_rows.size(1), head_dim = slot_rows.size(2);
  const int64_t row_size = num_kv_heads * head_dim, context_len = slots.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::Tensor out =
      at::empty({context_len, num_kv_heads, head_dim}, slot_rows.options().dtype(dtype));
  const auto* cache = reinterpret_cast<const uint8_t*>(slot_rows.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 32768 / row_size);
  at::parallel_for(0, context_len, grain, [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat)
      widen_rows(cache, slot, row_size, begin, end, out.data_ptr<float>());
    else if (dtype == at::kBFloat16)
      widen_rows(cache, slot, row_size, begin, end, out.data_ptr<at::BFloat16>());
    else
      widen_rows(cache, slot, row_size, begin, end, out.data_ptr<at::Half>());
  });
  return out.permute({1, 0, 2}).unsqueeze(0);
}

// Row tokens `first` .. `first + q_len - 1` of a prompt chunk over its gathered context, written
// into their rows of `out`.
void attend_prompt(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                   int64_t first, int64_t q_len, double scale, at::Tensor& out) {
  const int64_t context_len = keys.size(2);
  const bool gqa = query.size(1) != keys.size(1);
  // [1, num_heads, q_len, head_dim] and the rows of the result [q_len, num_heads, head_dim]
  const at::Tensor queries = query.narrow(0, first, q_len).permute({1, 0, 2}).unsqueeze(0);
  at::Tensor rows = out.narrow(0, first, q_len);
  const int64_t cached = context_len - q_len;
  if (cached == 0 && (q_len < 2 * kQueryChunk || whole_causal(query.scalar_type()))) {
    rows.copy_(at::scaled_dot_product_attention(queries, keys, values, std::nullopt, 0.0, true,
                                                scale, gqa)[0]
                   .transpose(0, 1));
    return;
  }
  // [1, 1, q_len, context_len]: query i (position cached + i) sees positions 0 .. cached + i
  const at::Tensor positions = at::arange(context_len, at::kInt);
  const at::Tensor last_seen = at::arange(q_len, at::kInt).add_(cached).unsqueeze(1);
  const at::Tensor mask = positions.unsqueeze(0).le(last_seen).view({1, 1, q_len, context_len});
  if (q_len < 2 * kQueryChunk) {
    rows.copy_(at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, false, scale,
                                                gqa)[0]
                   .transpose(0, 1));
    return;
  }
  for (int64_t begin = 0; begin < q_len; begin += kQueryChunk) {
    const int64_t end = std::min(begin + kQueryChunk, q_len);
    const int64_t seen = std::min(cached + end, context_len);  // what the chunk's last query sees
    const at::Tensor attended = at::scaled_dot_product_attention(
        queries.narrow(2, begin, end - begin), keys.narrow(2, 0, seen),
        values.narrow(2, 0, seen), mask.narrow(2, begin, end - begin).narrow(3, 0, seen), 0.0,
        false, scale, gqa);  // [1, num_heads, end - begin, head_dim]
    rows.narrow(0, begin, end - begin).copy_(attended[0].transpose(0, 1));
  }
}

// A prompt chunk's rows through our own kernel (prompt_attention.h): query [q_len, num_heads, 64]
// bfloat16 (rows query.stride(0) apart, heads contiguous), its context's K/V at `slots` (int64
// [context_len], the chunk the last q_len positions) of key_rows and value_rows [num_slots,
// num_kv_heads, 64], read in place from a bfloat16 cache and widened first from any other;
// the result into out_rows [q_len, num_heads, 64] bfloat16 (rows out_rows.stride(0) apart).
void attend_prompt_kernel(const at::Tensor& query, const at::Tensor& key_rows,
                         const at::Tensor& value_rows, const at::Tensor& slots, double scale,
                         at::Tensor& out_rows) {
  const int64_t context_len = slots.size(0), num_kv_heads = key_rows.size(1);
  const int64_t head_dim = key_rows.size(2);
  at::Tensor keys = key_rows, values = value_rows, positions = slots;
  if (key_rows.scalar_type() != at::kBFloat16) {  // widened first, then read in order
    if (key_rows.scalar_type() == at::kFloat8_e4m3fn) {
      keys = gather_float8_context(key_rows, slots, at::kBFloat16)[0].transpose(0, 1);
      values = gather_float8_context(value_rows, slots, at::kBFloat16)[0].transpose(0, 1);
    } else {
      keys = key_rows.index_select(0, slots).to(at::kBFloat16);
      values = value_rows.index_select(0, slots).to(at::kBFloat16);
    }
    keys = keys.contiguous();
    values = values.contiguous();
    positions = at::arange(context_len, at::kLong);
  }
  const auto bits = [](const at::Tensor& t) {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  };
  splitfuse_prompt::attend(bits(query), query.stride(0), bits(keys), bits(values),
                               positions.data_ptr<int64_t>(), num_kv_heads * head_dim,
                               query.size(0), context_len, query.size(1), num_kv_heads,
                               static_cast<float>(scale), bits(out_rows), out_rows.stride(0));
}

// splitfuse_cpu::prompt_attention: one prompt chunk's attention as store_and_attend_step makes
// it with our own kernel (attend_prompt_kernel), for the eager path (kernels/torch_attention.py) to
// give the same bits: query [q_len, num_heads, 64] bfloat16, key_rows and value_rows [num_slots,
// num_kv_heads, 64] (a layer's caches), slots int64 [context_len >= q_len].
at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& key_rows,
                            const at::Tensor& value_rows, const at::Tensor& slots,
                            double scale) {
  constexpr const char* op = "prompt_attention";
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && query.device().is_cpu() &&
                  query.stride(2) == 1 && query.stride(1) == query.size(2),
              op, ": query must be a bfloat16 CPU tensor [q_len, num_heads, head_dim] with "
              "contiguous heads");
  TORCH_CHECK(splitfuse_prompt::ready(query.size(2)), op,
              ": runs on CPUs with AMX-BF16 tiles or AVX-512 BF16, heads of 64 values "
              "(prompt_kernel())");
  TORCH_CHECK(key_rows.dim() == 3 && key_rows.is_contiguous() && key_rows.device().is_cpu() &&
                  value_rows.sizes() == key_rows.sizes() && value_rows.is_contiguous() &&
                  value_rows.scalar_type() == key_rows.scalar_type() &&
                  key_rows.size(2) == query.size(2) && key_rows.size(1) > 0 &&
                  query.size(1) % key_rows.size(1) == 0 &&
                  (is_attention_dtype(key_rows.scalar_type()) ||
                   key_rows.scalar_type() == at::kFloat8_e4m3fn),
              op, ": key_rows and value_rows must be contiguous CPU caches [num_slots, "
              "num_kv_heads, head_dim] of one dtype, their heads dividing the query's");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) >= query.size(0),
              op, ": slots must be contiguous int64 [context_len], context_len >= q_len");
  if (slots.numel() > 0) {
    const int64_t low = slots.min().item<int64_t>(), high = slots.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < key_rows.size(0), op, ": slots read [", low, ", ", high,
                "] of ", key_rows.size(0));
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  attend_prompt_kernel(query, key_rows, value_rows, slots, scale, out);
  return out;
}

at::Tensor store_and_attend_step(const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, at::Tensor& kv_cache, int64_t layer,
                                 const at::Tensor& slots, const at::Tensor& block_tables,
                                 const at::Tensor& query_start, const at::Tensor& context_lens,
                                 double scale) {
  auto [key_cache, value_cache] = splitfuse_fixed_order::layer_caches(kOp, kv_cache, layer);
  check_step(query, key, value, key_cache, slots, block_tables, query_start, context_lens);
  splitfuse_fixed_order::store_kv(key, value, key_cache, value_cache, slots);

  const int64_t num_tokens = query.size(0), num_rows = block_tables.size(0);
  const int64_t block_size = key_cache.size(1), max_blocks = block_tables.size(1);
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* ctx_lens = context_lens.data_ptr<int32_t>();
  // the decode tokens, each with its row and context length, as fixed_order_attention takes them
  std::vector<int64_t> decode_tokens;
  std::vector<int32_t> decode_rows, decode_lens;
  std::vector<int64_t> prompt_rows;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    if (q_len == 1) {
      decode_tokens.push_back(starts[r]);
      decode_rows.push_back(static_cast<int32_t>(r));
      decode_lens.push_back(ctx_lens[r]);
    } else if (q_len > 1) {
      prompt_rows.push_back(r);
    }
  }
  const int64_t num_decodes = static_cast<int64_t>(decode_tokens.size());
  const at::Tensor token_rows = at::tensor(decode_rows, at::kInt);
  const at::Tensor token_lens = at::tensor(decode_lens, at::kInt);
  if (num_decodes == num_tokens)  // a step of decodes alone: the kernel's result is the output
    return splitfuse_fixed_order::attend(query, key_cache, value_cache, block_tables, token_rows,
                                         token_lens, scale);

  at::Tensor out = at::empty({num_tokens, query.size(1), query.size(2)}, query.options());
  if (num_decodes > 0) {
    const at::Tensor tokens = at::tensor(decode_tokens, at::kLong);
    out.index_copy_(0, tokens,
                    splitfuse_fixed_order::attend(query.index_select(0, tokens), key_cache,
                                                  value_cache, block_tables, token_rows,
                                                  token_lens, scale));
  }
  // [num_slots, num_kv_heads, head_dim] views of the caches, in the query's dtype
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const at::Tensor key_rows = key_cache.view({-1, num_kv_heads, head_dim});
  const at::Tensor value_rows = value_cache.view({-1, num_kv_heads, head_dim});
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const bool float8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const at::ScalarType dtype = query.scalar_type();
  // bfloat16 prompt chunks through our own kernel where the CPU runs it (prompt_attention.h),
  // reading a bfloat16 cache in place
  const bool own_kernel = dtype == at::kBFloat16 && splitfuse_prompt::ready(head_dim);
  for (const int64_t r : prompt_rows) {
    const at::Tensor slots = context_slots(tables + r * max_blocks, block_size, ctx_lens[r]);
    if (own_kernel) {
      const int64_t first = starts[r], q_len = starts[r + 1] - first;
      at::Tensor rows = out.narrow(0, first, q_len);
      attend_prompt_kernel(query.narrow(0, first, q_len), key_rows, value_rows, slots, scale,
                          rows);
      continue;
    }
    at::Tensor keys, values;
    if (float8) {
      keys = gather_float8_context(key_rows, slots, dtype);
      values = gather_float8_context(value_rows, slots, dtype);
    } else {
      keys = gather_context(key_rows, slots).to(dtype);
      values = gather_context(value_rows, slots).to(dtype);
    }
    attend_prompt(query, keys, values, starts[r], starts[r + 1] - starts[r], scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) {
  m.def("store_and_attend_step(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "int layer, Tensor slots, Tensor block_tables, Tensor query_start, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("prompt_attention(Tensor query, Tensor key_rows, Tensor value_rows, Tensor slots, "
        "float scale) -> Tensor");
  // which kernel of our own bfloat16 prompt chunks of heads of head_dim values attend with
  // here: "amx", "avx512_bf16" or "" (SDPA)
  m.def("prompt_kernel(int head_dim) -> str",
        [](int64_t head_dim) { return std::string(splitfuse_prompt::kernel(head_dim)); });
  // whether a prompt chunk with nothing cached attends in one causal call here (whole_causal)
  m.def("attends_whole(ScalarType dtype) -> bool",
        [](c10::ScalarType dtype) { return whole_causal(dtype); });
}

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) {
  m.impl("store_and_attend_step", store_and_attend_step);
  m.impl("prompt_attention", prompt_attention);
}
