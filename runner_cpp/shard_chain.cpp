#include "shard_chain.h"

#include <executorch/runtime/kernel/operator_registry.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include "error.h"

namespace composite {

using executorch::aten::ScalarType;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::Error;
using executorch::runtime::EValue;

namespace {

const char* dtype_name(ScalarType type) {
  switch (type) {
    case ScalarType::Float:
      return "float32";
    case ScalarType::Long:
      return "int64";
    case ScalarType::Half:
      return "float16";
    case ScalarType::Int:
      return "int32";
    case ScalarType::Byte:
      return "uint8";
    case ScalarType::UInt16:
      return "uint16";
    default:
      return "other";
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

TensorPtr wrap(void* data, const std::vector<int64_t>& shape, ScalarType type) {
  std::vector<executorch::aten::SizesType> sizes(shape.begin(), shape.end());
  return executorch::extension::from_blob(data, sizes, type);
}

ScalarType scalar_type(const Encoding& encoding) {
  switch (encoding.kind) {
    case Encoding::Kind::UInt8:
      return ScalarType::Byte;
    case Encoding::Kind::UInt16:
      return ScalarType::UInt16;
    case Encoding::Kind::Float16:
      return ScalarType::Half;
    default:
      return ScalarType::Float;
  }
}

// Per layer, the (k, v) encoding of its cache: as the shard holding the layer takes it in.
std::vector<std::pair<Encoding, Encoding>> cache_encodings(const Manifest& m) {
  std::vector<std::pair<Encoding, Encoding>> encodings;
  for (const ShardInfo& shard : m.shards) {
    const auto& inputs = shard.io.at("decode").inputs;
    for (int l = shard.layer_first; l < shard.layer_end; ++l) {
      Encoding k, v;
      for (const TensorDesc& t : inputs) {
        if (t.name == "k_cache." + std::to_string(l)) k = Encoding::of(t);
        if (t.name == "v_cache." + std::to_string(l)) v = Encoding::of(t);
      }
      encodings.emplace_back(k, v);
    }
  }
  return encodings;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void check_loadable_here(const Manifest& manifest) {
#if defined(__x86_64__)  // on x86 the QNN backend is the HTP simulator, which cannot load a weight-shared context
  std::vector<int> shared;
  for (const ShardInfo& shard : manifest.shards) {
    if (shard.weight_sharing) shared.push_back(shard.index);
  }
  if (!shared.empty()) {
    std::string which = shared.size() == 1 ? "shard " + std::to_string(shared[0]) + " of this export shares"
                                           : "shards " + std::to_string(shared[0]);
    if (shared.size() > 1) {
      for (size_t i = 1; i < shared.size(); ++i) which += ", " + std::to_string(shared[i]);
      which += " of this export share";
    }
    throw RunnerError(which +
                      " QNN weights between decode and prefill, which only a device loads (the x86 HTP simulator "
                      "cannot); re-export with --no-weight-sharing to run it on this host");
  }
#else
  (void)manifest;
#endif
}

ShardChain::ShardChain(Manifest manifest)
    : manifest_(std::move(manifest)),
      cache_(manifest_.n_kv_heads, manifest_.head_dim, manifest_.max_seq_len, cache_encodings(manifest_)),
      shard_seconds_(manifest_.shards.size(), 0.0) {
  const Manifest& m = manifest_;
  check_loadable_here(m);
  for (int layer = 0; layer < m.n_layers; ++layer) {
    k_tensors_.push_back(wrap(cache_.k(layer), m.k_shape, scalar_type(cache_.encoding(layer).first)));
    v_tensors_.push_back(wrap(cache_.v(layer), m.v_shape, scalar_type(cache_.encoding(layer).second)));
  }
  for (const auto& [name, width] : m.methods) {
    MethodBuffers& b = buffers_[name];
    b.width = width;
    b.tokens.assign(width, 0);
    b.positions.assign(width, 0);
    b.mask = std::make_unique<AttentionMask>(width, m.max_seq_len, m.mask_hidden);
    b.tokens_tensor = wrap(b.tokens.data(), {1, width}, ScalarType::Long);
    b.positions_tensor = wrap(b.positions.data(), {width}, ScalarType::Long);
    b.mask_tensor = wrap(b.mask->data(), {width, m.max_seq_len + width}, ScalarType::Float);
    b.logits_index_tensor = wrap(&b.logits_index, {1}, ScalarType::Long);
    // A hidden state crosses between two encodings only where a quantized shard meets a float one.
    b.conversions.resize(m.shards.size());
    for (size_t i = 1; i < m.shards.size(); ++i) {
      const TensorDesc& produced = m.shards[i - 1].io.at(name).outputs[0];
      const TensorDesc& wanted = m.shards[i].io.at(name).inputs[0];
      HiddenConversion& c = b.conversions[i];
      c.from = Encoding::of(produced);
      c.to = Encoding::of(wanted);
      if (c.from == c.to) continue;
      c.numel = static_cast<size_t>(wanted.numel());
      c.buffer.assign((c.numel * c.to.element_size() + 3) / 4, 0.f);
      c.tensor = wrap(c.buffer.data(), wanted.shape, scalar_type(c.to));
    }
  }
  std::set<std::string> registered;  // asked of the registry quietly: a lookup that fails logs an error
  for (const auto& kernel : executorch::runtime::get_registered_kernels()) registered.insert(kernel.name_);
  modules_.resize(m.shards.size());
  for (const ShardInfo& shard : m.shards) {
    for (const std::string& op : shard.cpu_ops) {
      if (!registered.count(op)) {
        throw RunnerError("shard " + std::to_string(shard.index) + " runs operator " + op +
                          ", which this runtime has no kernel for");
      }
    }
  }
  // While a shard's methods load, the file pages they read sit beside everything XNNPACK has packed
  // so far (docs/scale.md: a 1B's tied table, read last, topped the peak by its 263 MB): the
  // largest shards load first, while little is packed. They run in their own order.
  std::vector<const ShardInfo*> order;
  for (const ShardInfo& shard : m.shards) order.push_back(&shard);
  std::stable_sort(order.begin(), order.end(), [](const ShardInfo* a, const ShardInfo* b) {
    return a->size + a->data_size > b->size + b->data_size;
  });
  for (const ShardInfo* loading : order) {
    const ShardInfo& shard = *loading;
    // A shard that reads weights from a data file (the shared tied table) is given it as its data map.
    auto module = shard.data_file.empty() ? std::make_unique<Module>(m.path_of(shard.file), Module::LoadMode::Mmap)
                                          : std::make_unique<Module>(m.path_of(shard.file), m.path_of(shard.data_file),
                                                                     Module::LoadMode::Mmap);
    if (module->load() != Error::Ok) {
      throw RunnerError("shard " + std::to_string(shard.index) + ": ExecuTorch cannot load " + m.path_of(shard.file) +
                        " (corrupt, or built for backends this runner lacks)");
    }
    modules_[shard.index] = std::move(module);
    for (const auto& method : m.methods) check_method(shard, method.first);
  }
  inputs_.resize(m.shards.size());
}

void ShardChain::check_method(const ShardInfo& shard, const std::string& method) {
  Module& module = *modules_[shard.index];
  const std::string where = "shard " + std::to_string(shard.index) + " method " + method;
  if (module.load_method(method) != Error::Ok) {
    throw RunnerError(where + ": cannot load (missing from the program, or a backend this runner lacks: " +
                      (shard.backends.empty() ? std::string("none") : shard.backends[0]) + ")");
  }
  auto meta = module.method_meta(method);
  if (!meta.ok()) throw RunnerError(where + ": no method metadata");
  const MethodIO& io = shard.io.at(method);
  for (int pass = 0; pass < 2; ++pass) {
    const bool inputs = pass == 0;
    const auto& expected = inputs ? io.inputs : io.outputs;
    const size_t count = inputs ? meta->num_inputs() : meta->num_outputs();
    if (count != expected.size()) {
      throw RunnerError(where + " has " + std::to_string(count) + (inputs ? " inputs" : " outputs") +
                        " but the manifest lists " + std::to_string(expected.size()));
    }
    for (size_t i = 0; i < count; ++i) {
      auto info = inputs ? meta->input_tensor_meta(i) : meta->output_tensor_meta(i);
      if (!info.ok()) throw RunnerError(where + ": " + expected[i].name + " is not a tensor");
      std::vector<int64_t> sizes(info->sizes().begin(), info->sizes().end());
      const std::string dtype = dtype_name(info->scalar_type());
      if (sizes != expected[i].shape || dtype != expected[i].dtype) {
        throw RunnerError(where + " tensor " + expected[i].name + ": program has " + shape_text(sizes) + " " + dtype +
                          ", manifest says " + shape_text(expected[i].shape) + " " + expected[i].dtype);
      }
      if (inputs && info->is_memory_planned()) {
        throw RunnerError(where + " input " + expected[i].name +
                          " is memory-planned: export with composite, which leaves inputs to the runner");
      }
    }
  }
  // Names decide what the runner binds: check they are what this runner knows how to feed.
  const ShardInfo& s = shard;
  std::vector<std::string> names;
  names.push_back(s.has_embedding ? "tokens" : "hidden");
  if (s.has_layers()) {
    names.push_back("input_pos");
    names.push_back("mask");
    for (int l = s.layer_first; l < s.layer_end; ++l) {
      names.push_back("k_cache." + std::to_string(l));
      names.push_back("v_cache." + std::to_string(l));
    }
  }
  if (s.has_head && manifest_.methods.at(method) > 1 && method != "verify") names.push_back("logits_index");
  if (names.size() != io.inputs.size()) {
    throw RunnerError(where + " has " + std::to_string(io.inputs.size()) + " inputs, this runner feeds " +
                      std::to_string(names.size()));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (io.inputs[i].name != names[i]) {
      throw RunnerError(where + ": input " + std::to_string(i) + " is '" + io.inputs[i].name + "', expected '" +
                        names[i] + "'");
    }
  }
}

const float* ShardChain::forward(const std::string& method, const std::vector<int64_t>& tokens, int pos) {
  MethodBuffers& b = buffers_.at(method);
  const int count = static_cast<int>(tokens.size());
  if (count < 1 || count > b.width)
    throw RunnerError("internal: " + method + " called with " + std::to_string(count) + " tokens");
  if (pos + count > manifest_.max_seq_len) throw RunnerError("position beyond max_seq_len");
  for (int i = 0; i < b.width; ++i) {
    b.tokens[i] = i < count ? tokens[i] : 0;
    b.positions[i] = pos + i;
  }
  b.mask->at(pos);
  b.logits_index = count - 1;
  return run(method, b, pos, count);  // [1, 1, vocab]
}

const float* ShardChain::forward_tree(const Tree& tree, int pos) {
  auto found = buffers_.find("verify");
  if (found == buffers_.end()) throw RunnerError("internal: this export has no verify method");
  MethodBuffers& b = found->second;
  const int count = static_cast<int>(tree.tokens.size());
  if (count < 1 || count > b.width)
    throw RunnerError("internal: verify called with " + std::to_string(count) + " tokens");
  const std::vector<int> depths = tree.depths();
  if (pos + tree.max_depth() >= manifest_.max_seq_len) throw RunnerError("position beyond max_seq_len");
  for (int i = 0; i < b.width; ++i) {
    b.tokens[i] = i < count ? tree.tokens[i] : 0;
    b.positions[i] = pos + (i < count ? depths[i] : 0);
  }
  b.mask->tree(pos, tree.parents);
  return run("verify", b, pos, -1);  // [1, width, vocab]
}

void ShardChain::commit(const std::vector<int>& rows, int pos) {
  const auto start = std::chrono::steady_clock::now();
  const int width = buffers_.at("verify").width;
  for (const ShardInfo& shard : manifest_.shards) {
    const std::vector<EValue>& outputs = held_[shard.index];
    for (int l = shard.layer_first; l < shard.layer_end; ++l) {
      const size_t at = 1 + 2 * (l - shard.layer_first);
      cache_.write_rows(l, outputs[at].toTensor().const_data_ptr(), outputs[at + 1].toTensor().const_data_ptr(), width,
                        pos, rows);
    }
  }
  kv_write_seconds_ += seconds_since(start);
}

const float* ShardChain::run(const std::string& method, MethodBuffers& b, int pos, int count) {
  EValue hidden;
  held_.assign(count < 0 ? manifest_.shards.size() : 0, {});
  for (const ShardInfo& shard : manifest_.shards) {
    const auto start = std::chrono::steady_clock::now();  // a hidden-state conversion counts as the shard's
    std::vector<EValue>& in = inputs_[shard.index];
    in.clear();
    const HiddenConversion& conversion = b.conversions[shard.index];
    if (shard.has_embedding) {
      in.emplace_back(*b.tokens_tensor);
    } else if (conversion.tensor) {  // counted in this shard's time
      convert(hidden.toTensor().const_data_ptr(), conversion.from, conversion.tensor->mutable_data_ptr(), conversion.to,
              conversion.numel);
      in.emplace_back(*conversion.tensor);
    } else {
      in.emplace_back(hidden);
    }
    if (shard.has_layers()) {
      in.emplace_back(*b.positions_tensor);
      in.emplace_back(*b.mask_tensor);
      for (int l = shard.layer_first; l < shard.layer_end; ++l) {
        in.emplace_back(*k_tensors_[l]);
        in.emplace_back(*v_tensors_[l]);
      }
    }
    if (shard.has_head && b.width > 1 && method != "verify") in.emplace_back(*b.logits_index_tensor);
    auto outputs = modules_[shard.index]->execute(method, in);
    shard_seconds_[shard.index] += seconds_since(start);
    if (!outputs.ok()) {
      throw RunnerError("shard " + std::to_string(shard.index) + " " + method + " failed with ExecuTorch error " +
                        std::to_string(static_cast<int>(outputs.error())));
    }
    hidden = (*outputs)[0];
    if (count < 0) {  // the outputs live in the method's own memory until its next call
      held_[shard.index] = std::move(*outputs);
      continue;
    }
    const auto write_start = std::chrono::steady_clock::now();
    for (int l = shard.layer_first; l < shard.layer_end; ++l) {
      const size_t at = 1 + 2 * (l - shard.layer_first);
      cache_.write(l, (*outputs)[at].toTensor().const_data_ptr(), (*outputs)[at + 1].toTensor().const_data_ptr(),
                   b.width, pos, count);
    }
    kv_write_seconds_ += seconds_since(write_start);
  }
  return hidden.toTensor().const_data_ptr<float>();  // float32, as the readers check
}

void ShardChain::reset_stats() {
  std::fill(shard_seconds_.begin(), shard_seconds_.end(), 0.0);
  kv_write_seconds_ = 0;
}

}  // namespace composite
