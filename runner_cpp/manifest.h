// manifest.json, as written by composite/manifest.py (the schema is documented there).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace composite {

struct TensorDesc {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // "float32", "int64", ...
  // uint8 / uint16 tensors: real value = (q - zero_point) * scale (manifest "quant").
  double scale = 0;
  int64_t zero_point = 0;
  bool quantized() const { return dtype == "uint8" || dtype == "uint16"; }
  bool same_encoding(const TensorDesc& other) const {
    return dtype == other.dtype && scale == other.scale && zero_point == other.zero_point;
  }
  int64_t numel() const;
  int64_t bytes() const;  // numel times the dtype's size
};

struct MethodIO {
  std::vector<TensorDesc> inputs;
  std::vector<TensorDesc> outputs;
};

struct ShardInfo {
  int index = 0;
  std::string file;
  std::string sha256;
  int64_t size = 0;
  // The .ptd the program reads weights from (the tied table shared by the first and last shard);
  // empty when it keeps all of them in its .pte.
  std::string data_file, data_sha256;
  int64_t data_size = 0;
  int layer_first = 0;
  int layer_end = 0;  // exclusive
  bool has_embedding = false;
  bool has_head = false;
  std::vector<std::string> backends;
  std::vector<std::string> cpu_ops;    // operators its methods run on ExecuTorch's CPU kernels, sorted
  bool weight_sharing = false;         // QNN: decode and prefill share one copy of the weights (device only)
  std::map<std::string, MethodIO> io;  // method name -> I/O
  bool has_layers() const { return layer_end > layer_first; }
};

// The model's chat template as text around each message (the manifest's "chat" entry, rendered
// from the template's Jinja at export by composite/chat_template.py).
struct ChatTemplate {
  std::string source;
  bool has_system = false;  // false: the template has no system role
  std::string system_prefix, system_suffix;
  std::string first_user_prefix;  // before the first user message when there is no system message
  std::string user_prefix;        // after the end of turn closing an answer, before the next user message
  std::string user_suffix;        // after a user message, up to where the answer begins
  int64_t end_of_turn_id = -1;
  bool trim_system = false, trim_user = false;
};

struct Manifest {
  std::string folder;
  int dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, vocab_size = 0;
  int max_seq_len = 0;
  std::map<std::string, int> methods;  // name -> tokens per call
  std::vector<int64_t> k_shape, v_shape;
  float mask_hidden = 0.f;
  std::vector<float> rope_inv_freq;            // the keys' rotary frequencies; empty in exports before context shift
  std::string tokenizer_file, tokenizer_type;  // empty when the export has no tokenizer
  int64_t bos_id = -1;
  std::vector<int64_t> eos_ids;  // every id that ends generation
  bool has_chat = false;         // false: the export records no chat template
  ChatTemplate chat;
  std::vector<ShardInfo> shards;
  std::string qnn_build_id;  // QNN libraries the QNN shards were compiled with; empty if none

  std::string path_of(const std::string& file) const { return folder + "/" + file; }
};

// Parses and checks structure; throws RunnerError naming the manifest and the problem.
Manifest load_manifest(const std::string& folder);
Manifest parse_manifest(const std::string& json_text, const std::string& folder);

// A "chat" entry: the manifest's, or a runner's --chat_template file.
ChatTemplate parse_chat(const nlohmann::json& chat, const std::string& where);

// Every shard file, and every data file a shard reads, exists with its recorded size; with
// verify_sha256, its hash matches too.
void check_files(const Manifest& manifest, bool verify_sha256);

std::string sha256_file(const std::string& path);
std::string sha256_bytes(const std::string& data);

// Bytes the runner holds and moves, from the manifest alone (composite/manifest.py's
// memory_figures computes the same): the KV cache in all and per shard, and what each shard takes
// in and gives out per decode step (the cache it reads included).
struct MemoryFigures {
  int64_t kv_cache_bytes = 0;
  std::vector<int64_t> kv_cache_bytes_per_shard;
  std::vector<std::pair<int64_t, int64_t>> decode_io_bytes_per_shard;  // (in, out)
};
MemoryFigures memory_figures(const Manifest& manifest);

}  // namespace composite
