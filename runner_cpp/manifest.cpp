#include "manifest.h"

#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "error.h"

namespace composite {

using nlohmann::json;

constexpr int64_t kManifestVersion = 2;  // composite/manifest.py's VERSION

int64_t TensorDesc::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {
int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "int64") return 8;
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float16" || dtype == "uint16") return 2;
  return 1;  // uint8
}
}  // namespace

int64_t TensorDesc::bytes() const { return numel() * dtype_bytes(dtype); }

MemoryFigures memory_figures(const Manifest& manifest) {
  MemoryFigures figures;
  for (const ShardInfo& shard : manifest.shards) {
    int64_t cache = 0;  // each layer's cache in the dtype its shard takes it in
    for (const TensorDesc& t : shard.io.at("decode").inputs) {
      if (t.name.rfind("k_cache.", 0) == 0 || t.name.rfind("v_cache.", 0) == 0) cache += t.bytes();
    }
    figures.kv_cache_bytes_per_shard.push_back(cache);
    figures.kv_cache_bytes += cache;
    int64_t in = 0, out = 0;
    for (const TensorDesc& t : shard.io.at("decode").inputs) in += t.bytes();
    for (const TensorDesc& t : shard.io.at("decode").outputs) out += t.bytes();
    figures.decode_io_bytes_per_shard.emplace_back(in, out);
  }
  return figures;
}

namespace {

const json& require(const json& object, const char* key, const std::string& where) {
  if (!object.is_object() || !object.contains(key)) {
    throw RunnerError(where + " has no '" + key + "'");
  }
  return object.at(key);
}

// nlohmann converts a JSON float to an integer type with a plain cast, which is undefined when
// the value is out of range: integers are read only from JSON integers that fit.
template <typename T>
T integer(const json& value, const std::string& what) {
  if (!value.is_number_integer()) throw RunnerError(what + " must be an integer, got " + value.dump());
  const bool fits = value.is_number_unsigned()
                        ? value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                        : value.get<int64_t>() >= std::numeric_limits<T>::min() &&
                              value.get<int64_t>() <= std::numeric_limits<T>::max();
  if (!fits) throw RunnerError(what + " is out of range: " + value.dump());
  return static_cast<T>(value.is_number_unsigned() ? static_cast<int64_t>(value.get<uint64_t>())
                                                   : value.get<int64_t>());
}

template <typename T>
std::vector<T> integers(const json& value, const std::string& what) {
  if (!value.is_array()) throw RunnerError(what + " must be a list of integers");
  std::vector<T> out;
  for (const json& item : value) out.push_back(integer<T>(item, what));
  return out;
}

std::string as_text(const json& value, const std::string& what) {
  if (!value.is_string()) throw RunnerError(what + " must be a string, got " + value.dump());
  return value.get<std::string>();
}

bool as_boolean(const json& value, const std::string& what) {
  if (!value.is_boolean()) throw RunnerError(what + " must be true or false, got " + value.dump());
  return value.get<bool>();
}

std::string require_text(const json& object, const char* key, const std::string& where) {
  return as_text(require(object, key, where), where + " '" + key + "'");
}

int require_int(const json& object, const char* key, const std::string& where) {
  return integer<int>(require(object, key, where), where + " '" + key + "'");
}

// A uint8 / uint16 tensor carries its scale and zero point; no other tensor does.
void parse_quant(const json& tensor, TensorDesc& desc, const std::string& what) {
  if (!desc.quantized()) {
    if (tensor.contains("quant")) {
      throw RunnerError(what + " has 'quant' but is " + desc.dtype + "; only uint8 and uint16 tensors are quantized");
    }
    return;
  }
  if (!tensor.contains("quant")) {
    throw RunnerError(what + " is " + desc.dtype + " and needs 'quant' with its scale and zero_point");
  }
  const json& quant = tensor.at("quant");
  const json& scale = require(quant, "scale", what + " quant");
  if (!scale.is_number() || !(scale.get<double>() > 0) || scale.get<double>() > std::numeric_limits<float>::max()) {
    throw RunnerError(what + " quant 'scale' must be a positive number, got " + scale.dump());
  }
  const json& zero_point = require(quant, "zero_point", what + " quant");
  const int64_t top = desc.dtype == "uint8" ? 255 : 65535;
  const bool in_range =
      zero_point.is_number_integer() &&
      (zero_point.is_number_unsigned() ? zero_point.get<uint64_t>() <= static_cast<uint64_t>(top)
                                       : zero_point.get<int64_t>() >= 0 && zero_point.get<int64_t>() <= top);
  if (!in_range) {
    throw RunnerError(what + " quant 'zero_point' must be an integer from 0 to " + std::to_string(top) + ", got " +
                      zero_point.dump());
  }
  desc.scale = scale.get<double>();
  desc.zero_point = zero_point.get<int64_t>();
}

// The runners feed and read hidden states and caches as float32, float16, uint8 or uint16, and sample
// float32 logits.
void check_value_dtypes(const ShardInfo& shard, const std::string& where) {
  for (const auto& [method, io] : shard.io) {
    for (const auto* list : {&io.inputs, &io.outputs}) {
      const std::string side = list == &io.inputs ? "inputs" : "outputs";
      for (const TensorDesc& t : *list) {
        if (t.name == "logits" && t.dtype != "float32") {
          throw RunnerError(where + " " + method + " " + side + ": tensor logits must be float32, got " + t.dtype);
        }
        const bool value = t.name == "hidden" || t.name.rfind("k_cache.", 0) == 0 || t.name.rfind("v_cache.", 0) == 0 ||
                           t.name.rfind("k_new.", 0) == 0 || t.name.rfind("v_new.", 0) == 0;
        if (value && t.dtype != "float32" && t.dtype != "float16" && !t.quantized()) {
          throw RunnerError(where + " " + method + " " + side + ": tensor " + t.name +
                            " must be float32, float16, uint8 or uint16, got " + t.dtype);
        }
      }
    }
  }
}

// The runner copies a layer's new entries into its cache as they are: cache inputs and new-entry
// outputs of every method share one dtype and quantization.
void check_cache_encodings(const ShardInfo& shard, const std::string& where) {
  for (int layer = shard.layer_first; layer < shard.layer_end; ++layer) {
    for (const char* kind : {"k", "v"}) {
      const std::string cache = std::string(kind) + "_cache." + std::to_string(layer);
      const std::string fresh = std::string(kind) + "_new." + std::to_string(layer);
      const TensorDesc* first = nullptr;
      for (const auto& [method, io] : shard.io) {
        for (const auto* list : {&io.inputs, &io.outputs}) {
          for (const TensorDesc& t : *list) {
            if (t.name != (list == &io.inputs ? cache : fresh)) continue;
            if (first && !first->same_encoding(t)) {
              throw RunnerError(where + ": " + cache + " and " + fresh +
                                " must have one dtype and quantization in every method");
            }
            if (!first) first = &t;
          }
        }
      }
    }
  }
}

std::vector<TensorDesc> parse_tensors(const json& list, const std::string& where) {
  if (!list.is_array()) throw RunnerError(where + " is not a list");
  std::vector<TensorDesc> out;
  for (const json& t : list) {
    TensorDesc desc;
    desc.name = require_text(t, "name", where);
    desc.shape = integers<int64_t>(require(t, "shape", where), where + " shape");
    desc.dtype = require_text(t, "dtype", where);
    static const char* const known[] = {"float32", "float16", "int64", "int32", "uint8", "uint16"};
    if (std::find(std::begin(known), std::end(known), desc.dtype) == std::end(known)) {
      throw RunnerError(where + ": tensor " + desc.name + " has dtype " + json(desc.dtype).dump() +
                        ", not one of float32, float16, int64, int32, uint8, uint16");
    }
    for (int64_t d : desc.shape) {
      if (d <= 0) throw RunnerError(where + ": tensor " + desc.name + " has a non-positive dimension");
    }
    parse_quant(t, desc, where + ": tensor " + desc.name);
    out.push_back(std::move(desc));
  }
  return out;
}

}  // namespace

ChatTemplate parse_chat(const json& chat, const std::string& where) {
  ChatTemplate t;
  t.source = require_text(chat, "source", where);
  t.first_user_prefix = require_text(chat, "first_user_prefix", where);
  t.user_prefix = require_text(chat, "user_prefix", where);
  t.user_suffix = require_text(chat, "user_suffix", where);
  const json& system_prefix = require(chat, "system_prefix", where);
  const json& system_suffix = require(chat, "system_suffix", where);
  if (!system_prefix.is_null()) t.system_prefix = as_text(system_prefix, where + " 'system_prefix'");
  if (!system_suffix.is_null()) t.system_suffix = as_text(system_suffix, where + " 'system_suffix'");
  if (system_prefix.is_null() != system_suffix.is_null()) {
    throw RunnerError(where + ": system_prefix and system_suffix must both be text or both null");
  }
  t.has_system = !system_prefix.is_null();
  t.end_of_turn_id = integer<int64_t>(require(chat, "end_of_turn_id", where), where + " end_of_turn_id");
  const json& trim = require(chat, "trim", where);
  bool valid = trim.is_array();
  for (const json& role : valid ? trim : json::array()) {
    if (role == "system") {
      t.trim_system = true;
    } else if (role == "user") {
      t.trim_user = true;
    } else {
      valid = false;
    }
  }
  if (!valid) throw RunnerError(where + " 'trim' must be a list of roles (system, user), got " + trim.dump());
  return t;
}

namespace {

// One entry of 'shards': where = the manifest's name, i = its position of `count`, expected_layer
// = where the chain stands (the previous shard's layer end).
ShardInfo parse_shard(const json& s, size_t i, size_t count, int expected_layer, const Manifest& m,
                      const std::string& where) {
  const std::string sw = where + " shard " + std::to_string(i);
  ShardInfo info;
  info.index = require_int(s, "index", sw);
  if (info.index != static_cast<int>(i)) {
    throw RunnerError(sw + " says index " + std::to_string(info.index) + ": shards are out of order");
  }
  info.file = require_text(s, "file", sw);
  if (info.file.find('/') != std::string::npos) throw RunnerError(sw + ": file name must not contain '/'");
  info.sha256 = require_text(s, "sha256", sw);
  info.size = integer<int64_t>(require(s, "size", sw), sw + " size");
  if (s.contains("data")) {
    const json& data = s.at("data");
    if (!data.is_object()) throw RunnerError(sw + " 'data' must name a file with its size and sha256");
    info.data_file = require_text(data, "file", sw + " data");
    if (info.data_file.find('/') != std::string::npos) throw RunnerError(sw + ": data file name must not contain '/'");
    info.data_sha256 = require_text(data, "sha256", sw + " data");
    info.data_size = integer<int64_t>(require(data, "size", sw + " data"), sw + " data size");
  }
  auto layers = integers<int>(require(s, "layers", sw), sw + " layers");
  if (layers.size() != 2 || layers[0] != expected_layer || layers[1] < layers[0] || layers[1] > m.n_layers) {
    throw RunnerError(sw + ": layers do not continue the chain at layer " + std::to_string(expected_layer));
  }
  info.layer_first = layers[0];
  info.layer_end = layers[1];
  info.has_embedding = as_boolean(require(s, "has_embedding", sw), sw + " 'has_embedding'");
  info.has_head = as_boolean(require(s, "has_head", sw), sw + " 'has_head'");
  if (info.has_embedding != (i == 0) || info.has_head != (i + 1 == count)) {
    throw RunnerError(sw + ": the embedding must be in the first shard and the head in the last");
  }
  if (s.contains("backends")) {
    const json& backends = s.at("backends");
    if (!backends.is_array()) throw RunnerError(sw + " 'backends' must be a list of names");
    for (const json& b : backends) info.backends.push_back(as_text(b, sw + " 'backends'"));
  }
  if (s.contains("cpu_ops")) {
    const json& ops = s.at("cpu_ops");
    if (!ops.is_object()) throw RunnerError(sw + " 'cpu_ops' must map methods to lists of operator names");
    std::set<std::string> names;
    for (const auto& [method, list] : ops.items()) {
      if (!list.is_array()) throw RunnerError(sw + " 'cpu_ops' must map methods to lists of operator names");
      for (const json& op : list) names.insert(as_text(op, sw + " 'cpu_ops'"));
    }
    info.cpu_ops.assign(names.begin(), names.end());
  }
  if (s.contains("weight_sharing")) info.weight_sharing = as_boolean(s.at("weight_sharing"), sw + " 'weight_sharing'");
  const json& io = require(s, "io", sw);
  for (const auto& [name, width] : m.methods) {
    const json& method = require(io, name.c_str(), sw + " io");
    info.io[name] = MethodIO{parse_tensors(require(method, "inputs", sw), sw + " " + name + " inputs"),
                             parse_tensors(require(method, "outputs", sw), sw + " " + name + " outputs")};
  }
  check_value_dtypes(info, sw);
  check_cache_encodings(info, sw);
  return info;
}

}  // namespace

// The model's dimensions the runner reads, and its optional "rope" entry (composite/manifest.py's
// _model_dims checks the same).
static void parse_model(const json& j, const std::string& where, Manifest* m) {
  const json& model = require(j, "model", where);
  m->dim = require_int(model, "dim", where + " model");
  m->n_layers = require_int(model, "n_layers", where + " model");
  m->n_heads = require_int(model, "n_heads", where + " model");
  m->n_kv_heads = require_int(model, "n_kv_heads", where + " model");
  m->head_dim = require_int(model, "head_dim", where + " model");
  m->vocab_size = require_int(model, "vocab_size", where + " model");
  if (j.contains("rope") && !j["rope"].is_null()) {
    const json& rope = j["rope"];
    const json& freqs = require(rope, "inv_freq", where + " rope");
    if (rope.value("convention", json()) != "rotate-half" || !freqs.is_array() ||
        freqs.size() * 2 != static_cast<size_t>(m->head_dim)) {
      throw RunnerError(where + ": rope must be rotate-half with head_dim / 2 inv_freq numbers");
    }
    for (const json& f : freqs) {
      if (!f.is_number() || !std::isfinite(f.get<double>())) {
        throw RunnerError(where + ": rope inv_freq must hold finite numbers");
      }
      m->rope_inv_freq.push_back(f.get<float>());
    }
  }
}

Manifest parse_manifest(const std::string& text, const std::string& folder) {
  const std::string where = folder + "/manifest.json";
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    throw RunnerError(where + " is malformed JSON: " + e.what());
  }
  try {
    if (!j.is_object() || !j.contains("format") || j.at("format") != "composite-manifest") {
      throw RunnerError(where + " is not a composite manifest");
    }
    const json version = j.value("version", json());
    if (!version.is_number_integer() || version.get<int64_t>() != kManifestVersion) {
      throw RunnerError(where + ": manifest version " + version.dump() + " is not supported (this runner reads " +
                        std::to_string(kManifestVersion) + ")");
    }
    Manifest m;
    m.folder = folder;
    require(j, "export_id", where);  // the runner matches files by size and sha256, not by this id
    parse_model(j, where, &m);
    m.max_seq_len = require_int(j, "max_seq_len", where);
    if (m.max_seq_len < 2 || m.vocab_size < 1 || m.n_layers < 0) {
      throw RunnerError(where + ": max_seq_len, vocab_size or n_layers is out of range");
    }
    const json& methods = require(j, "methods", where);
    if (!methods.is_object()) throw RunnerError(where + ": 'methods' must map method names to widths");
    for (const auto& [name, width] : methods.items()) m.methods[name] = integer<int>(width, where + " method " + name);
    if (!m.methods.count("decode") || m.methods.at("decode") != 1) {
      throw RunnerError(where + ": needs a 'decode' method of 1 token per call");
    }
    for (const auto& [name, width] : m.methods) {
      if (width < 1 || width > m.max_seq_len) throw RunnerError(where + ": method " + name + " has an invalid width");
    }
    const json& kv = require(j, "kv_cache", where);
    if (require_text(kv, "dtype", where + " kv_cache") != "float32") {
      throw RunnerError(where + ": only float32 KV caches are supported by this runner");
    }
    m.k_shape = integers<int64_t>(require(kv, "k_shape", where + " kv_cache"), where + " kv_cache k_shape");
    m.v_shape = integers<int64_t>(require(kv, "v_shape", where + " kv_cache"), where + " kv_cache v_shape");
    const std::vector<int64_t> k_expected = {m.n_kv_heads, m.head_dim, m.max_seq_len};
    const std::vector<int64_t> v_expected = {m.n_kv_heads, m.max_seq_len, m.head_dim};
    if (m.k_shape != k_expected || m.v_shape != v_expected) {
      throw RunnerError(where + ": kv_cache shapes do not match the model and max_seq_len");
    }
    const json& hidden = require(require(j, "mask", where), "hidden", where + " mask");
    if (!hidden.is_number() || !(std::fabs(hidden.get<double>()) <= std::numeric_limits<float>::max())) {
      throw RunnerError(where + ": mask 'hidden' must be a finite float32 number");
    }
    m.mask_hidden = hidden.get<float>();
    const json& tok = require(j, "tokenizer", where);
    if (!tok.is_null()) {
      m.tokenizer_file = require_text(tok, "file", where + " tokenizer");
      m.tokenizer_type = require_text(tok, "type", where + " tokenizer");
    }
    const json& bos = require(j, "bos_id", where);
    m.bos_id = bos.is_null() ? -1 : integer<int64_t>(bos, where + " bos_id");
    m.eos_ids = integers<int64_t>(require(j, "eos_ids", where), where + " eos_ids");
    if (j.contains("chat") && !j["chat"].is_null()) {
      m.chat = parse_chat(j["chat"], where + " chat");
      m.has_chat = true;
      if (std::find(m.eos_ids.begin(), m.eos_ids.end(), m.chat.end_of_turn_id) == m.eos_ids.end()) {
        throw RunnerError(where + " chat: end_of_turn_id " + std::to_string(m.chat.end_of_turn_id) +
                          " is not one of eos_ids");
      }
    }
    const json& shards = require(j, "shards", where);
    if (!shards.is_array() || shards.empty()) throw RunnerError(where + ": 'shards' must be a non-empty list");
    int expected_layer = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      m.shards.push_back(parse_shard(shards[i], i, shards.size(), expected_layer, m, where));
      expected_layer = m.shards.back().layer_end;
    }
    if (expected_layer != m.n_layers) throw RunnerError(where + ": the shards do not cover all layers");
    if (j.contains("qnn") && !j.at("qnn").is_null()) {
      m.qnn_build_id = require_text(j.at("qnn"), "build_id", where + " qnn");
      integer<int64_t>(require(j.at("qnn"), "spill_fill_bytes", where + " qnn"),
                       where + " qnn spill_fill_bytes");  // checked; the size is compiled into the contexts
    }
    return m;
  } catch (const json::exception& e) {
    throw RunnerError(where + " has a field of the wrong type: " + e.what());
  }
}

Manifest load_manifest(const std::string& folder) {
  struct stat st {};
  if (stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw RunnerError("artifacts folder " + folder + " does not exist");
  }
  std::ifstream in(folder + "/manifest.json", std::ios::binary);
  if (!in) throw RunnerError(folder + "/manifest.json does not exist: is " + folder + " an export folder?");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_manifest(buffer.str(), folder);
}

namespace {

std::string hex_digest(EVP_MD_CTX* ctx) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx, digest, &length);
  std::string hex;
  char byte[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(byte, sizeof(byte), "%02x", digest[i]);
    hex += byte;
  }
  return hex;
}

}  // namespace

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RunnerError("cannot read " + path);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  std::vector<char> block(1 << 20);
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    EVP_DigestUpdate(ctx.get(), block.data(), static_cast<size_t>(in.gcount()));
  }
  return hex_digest(ctx.get());
}

std::string sha256_bytes(const std::string& data) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  EVP_DigestUpdate(ctx.get(), data.data(), data.size());
  return hex_digest(ctx.get());
}

namespace {

void check_file(const std::string& label, const std::string& path, const std::string& what, int64_t size,
                const std::string& sha256, bool verify_sha256) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw RunnerError(label + path + what + " is missing");
  if (st.st_size != size) {
    throw RunnerError(label + path + " is " + std::to_string(st.st_size) + " bytes but the manifest says " +
                      std::to_string(size) + " (truncated, or from another export)");
  }
  if (verify_sha256 && sha256_file(path) != sha256) {
    throw RunnerError(label + path + " does not match the manifest's sha256 (from another export?)");
  }
}

}  // namespace

void check_files(const Manifest& m, bool verify_sha256) {
  for (const ShardInfo& s : m.shards) {
    const std::string label = "shard " + std::to_string(s.index) + ": ";
    check_file(label, m.path_of(s.file), "", s.size, s.sha256, verify_sha256);
    if (!s.data_file.empty()) {
      check_file(label, m.path_of(s.data_file), ", whose weights it reads,", s.data_size, s.data_sha256, verify_sha256);
    }
  }
  if (!m.tokenizer_file.empty()) {
    struct stat st {};
    if (stat(m.path_of(m.tokenizer_file).c_str(), &st) != 0) {
      throw RunnerError("tokenizer " + m.path_of(m.tokenizer_file) + " named by the manifest is missing");
    }
  }
}

}  // namespace composite
