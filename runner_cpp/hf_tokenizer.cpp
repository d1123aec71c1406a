// Reads tokenizer.json the way the `tokenizers` library applies it, for the parts a byte-level BPE
// uses: added tokens, pre-tokenizer (Split / Digits / ByteLevel / Sequence), BPE merges by rank, and the
// post-processor's BOS. composite/tokenizer.py refuses at export what this reader would refuse.
#include "hf_tokenizer.h"

#include <array>
#include <climits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <vector>

#include "error.h"
#include "pcre_regex.h"

namespace composite {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer, what ByteLevel(use_regex=true) splits with.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Byte-level BPE writes each byte as one character: printable Latin-1 bytes as themselves, the
// others as U+0100 onwards, in byte order. Code point -> byte, -1 for any other character.
std::unordered_map<uint32_t, int> character_bytes() {
  std::unordered_map<uint32_t, int> bytes;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    bytes[printable ? b : next++] = b;
  }
  return bytes;
}

// The bytes a vocabulary entry stands for; false if it holds a character that is not a byte's.
bool entry_bytes(const std::string& entry, const std::unordered_map<uint32_t, int>& table, std::string* out) {
  out->clear();
  for (size_t i = 0; i < entry.size();) {
    const auto lead = static_cast<unsigned char>(entry[i]);
    const int length = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    if (i + length > entry.size()) return false;
    uint32_t code = length == 1 ? lead : lead & (0xFF >> (length + 1));
    for (int j = 1; j < length; ++j) code = (code << 6) | (static_cast<unsigned char>(entry[i + j]) & 0x3F);
    const auto found = table.find(code);
    if (found == table.end()) return false;
    out->push_back(static_cast<char>(found->second));
    i += length;
  }
  return true;
}

struct PreTokenizerStep {
  std::unique_ptr<Regex> split;  // null: no split in this step
  bool keep_matches = true;      // Isolated (true) or Removed (false)
  bool add_prefix_space = false;
};

class HfJsonTokenizer : public Tokenizer {
 public:
  explicit HfJsonTokenizer(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw RunnerError("cannot read tokenizer " + path);
    const json doc = json::parse(in, nullptr, false);
    if (doc.is_discarded() || !doc.is_object()) throw fail("is not a JSON object");
    const json& model = doc.contains("model") ? doc["model"] : json();
    if (!model.is_object() || model.value("type", "BPE") != "BPE") {
      throw fail("has model type " + (model.is_object() ? model.value("type", "?") : std::string("none")) +
                 "; only byte-level BPE is supported");
    }
    if (doc.contains("normalizer") && !doc["normalizer"].is_null()) {
      throw fail("has a " + doc["normalizer"].value("type", "?") + " normalizer; byte-level BPE has none");
    }
    if (doc.contains("pre_tokenizer")) add_pre_tokenizer(doc["pre_tokenizer"]);
    if (!byte_level_) throw fail("has no ByteLevel pre-tokenizer: not a byte-level BPE");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
      if (model.contains(key) && !model[key].is_null() && model[key] != "") {
        throw fail(std::string("sets BPE ") + key + ", which byte-level BPE does not use");
      }
    }
    ignore_merges_ = model.value("ignore_merges", false);
    read_vocabulary(model);
    read_merges(model);
    read_added_tokens(doc);
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const auto found = vocab_.find(model["unk_token"].get<std::string>());
      if (found != vocab_.end()) unk_ = found->second;
    }
    if (doc.contains("post_processor")) read_post_processor(doc["post_processor"]);
  }

  std::string token_bytes(int64_t token, int64_t) const override {
    if (token < 0 || token >= static_cast<int64_t>(pieces_.size()) || special_[token]) return "";
    return pieces_[token];
  }
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int64_t bos_id() const override { return bos_; }

 private:
  RunnerError fail(const std::string& problem) const { return RunnerError("tokenizer " + path_ + " " + problem); }

  void add_pre_tokenizer(const json& p) {
    if (p.is_null()) return;
    if (!p.is_object()) throw fail("is malformed: a pre_tokenizer that is not an object");
    const std::string type = p.value("type", "");
    if (type == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
      for (const json& step : p["pretokenizers"]) add_pre_tokenizer(step);
    } else if (type == "Split") {
      const json& pattern = p.contains("pattern") ? p["pattern"] : json();
      const bool literal = pattern.is_object() && pattern.contains("String") && pattern["String"].is_string();
      const bool regex = pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string();
      const std::string behavior = p.value("behavior", "");
      if (!literal && !regex) throw fail("has a Split pre-tokenizer without a pattern");
      if ((behavior != "Isolated" && behavior != "Removed") || p.value("invert", false)) {
        throw fail("has a Split pre-tokenizer with behavior " + behavior +
                   (p.value("invert", false) ? " inverted" : "") + "; Isolated and Removed are supported");
      }
      PreTokenizerStep step;
      step.split = std::make_unique<Regex>(pattern[literal ? "String" : "Regex"].get<std::string>(), literal,
                                           "tokenizer " + path_ + " Split pre-tokenizer");
      step.keep_matches = behavior == "Isolated";
      steps_.push_back(std::move(step));
    } else if (type == "Digits") {
      // The tokenizers library's Digits isolates numeric characters (Rust's is_numeric: \p{N}),
      // each alone or in runs.
      PreTokenizerStep step;
      const bool individual = p.value("individual_digits", false);
      step.split = std::make_unique<Regex>(individual ? R"(\p{N})" : R"(\p{N}+)", false, "Digits pre-tokenizer");
      steps_.push_back(std::move(step));
    } else if (type == "ByteLevel") {
      PreTokenizerStep step;
      step.add_prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) step.split = std::make_unique<Regex>(kGpt2Pattern, false, "GPT-2 pattern");
      steps_.push_back(std::move(step));
      byte_level_ = true;
    } else {
      throw fail("has a " + (type.empty() ? std::string("malformed") : type) +
                 " pre-tokenizer; Split, Digits, ByteLevel and Sequence are supported");
    }
  }

  int64_t checked_id(const json& id, const std::string& what) const {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= INT_MAX) {
      throw fail("has " + what + " with an id that is not a non-negative integer");
    }
    return id.get<int64_t>();
  }

  void set_piece(int64_t id, const std::string& bytes, bool special) {
    if (id >= static_cast<int64_t>(pieces_.size())) {
      pieces_.resize(id + 1);
      special_.resize(id + 1, false);
    }
    pieces_[id] = bytes;
    special_[id] = special;
  }

  void read_vocabulary(const json& model) {
    if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty()) {
      throw fail("has no BPE vocabulary");
    }
    const auto table = character_bytes();
    const size_t count = model["vocab"].size();
    std::string bytes;
    for (const auto& [entry, id_json] : model["vocab"].items()) {
      const int64_t id = checked_id(id_json, "vocabulary entry '" + entry + "'");
      // Ids number the entries; one far past their count would make the id table arbitrarily large.
      if (static_cast<size_t>(id) >= 2 * count + 1024) {
        throw fail("gives '" + entry + "' id " + std::to_string(id) + " with only " + std::to_string(count) +
                   " entries");
      }
      // An entry that is not byte-level text can still be printed; it just never comes out of a merge.
      if (!entry_bytes(entry, table, &bytes)) bytes = entry;
      vocab_[bytes] = id;
      set_piece(id, bytes, false);
    }
    byte_ids_.fill(-1);
    for (int b = 0; b < 256; ++b) {
      const auto found = vocab_.find(std::string(1, static_cast<char>(b)));
      if (found != vocab_.end()) byte_ids_[b] = found->second;
    }
  }

  void read_merges(const json& model) {
    if (!model.contains("merges") || !model["merges"].is_array()) throw fail("has no BPE merges list");
    const auto table = character_bytes();
    int rank = 0;
    for (const json& merge : model["merges"]) {
      // Two spellings: "a b" (tokenizers < 0.20) and ["a", "b"].
      std::string left, right;
      if (merge.is_string()) {
        const std::string text = merge.get<std::string>();
        const auto space = text.find(' ');
        if (space == std::string::npos) throw fail("has merge '" + text + "' that is not two tokens");
        left = text.substr(0, space), right = text.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get<std::string>(), right = merge[1].get<std::string>();
      } else {
        throw fail("has merge " + std::to_string(rank) + " that is neither \"a b\" nor [\"a\", \"b\"]");
      }
      std::string left_bytes, right_bytes;
      if (!entry_bytes(left, table, &left_bytes)) left_bytes = left;
      if (!entry_bytes(right, table, &right_bytes)) right_bytes = right;
      const auto a = vocab_.find(left_bytes), b = vocab_.find(right_bytes);
      const auto merged = vocab_.find(left_bytes + right_bytes);
      if (a == vocab_.end() || b == vocab_.end() || merged == vocab_.end()) {
        throw fail("has merge '" + left + " " + right + "' whose tokens are not all in the vocabulary");
      }
      merges_[pair_key(a->second, b->second)] = {rank++, merged->second};
    }
  }

  void read_added_tokens(const json& doc) {
    if (!doc.contains("added_tokens") || doc["added_tokens"].is_null()) return;
    if (!doc["added_tokens"].is_array()) throw fail("has added_tokens that is not a list");
    std::vector<AddedToken> added;
    for (const json& token : doc["added_tokens"]) {
      if (!token.is_object() || !token.contains("content") || !token["content"].is_string() || !token.contains("id")) {
        throw fail("has an added token without content and id");
      }
      const std::string content = token["content"].get<std::string>();
      for (const char* option : {"single_word", "lstrip", "rstrip"}) {
        if (token.value(option, false))
          throw fail("has added token '" + content + "' with " + option + ", unsupported");
      }
      const int64_t id = checked_id(token["id"], "added token '" + content + "'");
      if (static_cast<size_t>(id) >= pieces_.size() + 1024 * 1024) {
        throw fail("gives added token '" + content + "' id " + std::to_string(id) + ", far past the vocabulary");
      }
      const bool special = token.value("special", false);
      set_piece(id, content, special);
      added.push_back({content, id, special});
    }
    set_added_tokens(std::move(added));
  }

  // BOS is the special token a TemplateProcessing puts before the text ($A).
  void read_post_processor(const json& p) {
    if (p.is_null() || !p.is_object()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence" && p.contains("processors") && p["processors"].is_array()) {
      for (const json& step : p["processors"]) read_post_processor(step);
    } else if (type == "TemplateProcessing" && p.contains("single") && p["single"].is_array()) {
      std::vector<int64_t> before;
      for (const json& item : p["single"]) {
        if (item.contains("Sequence")) break;
        if (!item.contains("SpecialToken")) continue;
        const std::string name = item["SpecialToken"].value("id", "");
        const json& specials = p.contains("special_tokens") ? p["special_tokens"] : json();
        if (!specials.is_object() || !specials.contains(name) || !specials[name].contains("ids") ||
            !specials[name]["ids"].is_array()) {
          throw fail("post-processor names special token '" + name + "' without its ids");
        }
        for (const json& id : specials[name]["ids"]) before.push_back(checked_id(id, "post-processor token"));
      }
      if (before.size() > 1)
        throw fail("post-processor puts " + std::to_string(before.size()) +
                   " tokens before the text; one BOS is supported");
      if (!before.empty()) bos_ = before[0];
    } else if (type != "ByteLevel") {
      throw fail("has a " + type + " post-processor; TemplateProcessing, ByteLevel and Sequence are supported");
    }
  }

  static uint64_t pair_key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b); }

  void encode_ordinary(const std::string& text, std::vector<int64_t>* out) const override {
    std::vector<std::string> pieces{text}, next;
    for (const PreTokenizerStep& step : steps_) {
      next.clear();
      for (std::string& piece : pieces) {
        if (step.add_prefix_space && !piece.empty() && piece[0] != ' ') piece.insert(0, " ");
        if (!step.split) {
          next.push_back(std::move(piece));
          continue;
        }
        for (std::string& part : split_isolated(*step.split, piece, step.keep_matches)) next.push_back(std::move(part));
      }
      pieces.swap(next);
    }
    for (const std::string& piece : pieces) byte_pair_encode(piece, out);
  }

  // Applies the lowest-ranked merge among adjacent symbols (the leftmost on a tie) until none applies.
  void byte_pair_encode(const std::string& piece, std::vector<int64_t>* out) const {
    if (ignore_merges_) {
      const auto whole = vocab_.find(piece);
      if (whole != vocab_.end()) {
        out->push_back(whole->second);
        return;
      }
    }
    std::vector<int64_t> symbols;
    for (char c : piece) {
      const int64_t id = byte_ids_[static_cast<unsigned char>(c)];
      if (id >= 0 || unk_ >= 0) symbols.push_back(id >= 0 ? id : unk_);  // without <unk>, the byte is dropped
    }
    while (symbols.size() > 1) {
      int best = INT_MAX;
      size_t at = 0;
      int64_t merged = -1;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto found = merges_.find(pair_key(symbols[i], symbols[i + 1]));
        if (found != merges_.end() && found->second.first < best) {
          best = found->second.first, at = i, merged = found->second.second;
        }
      }
      if (merged < 0) break;
      symbols[at] = merged;
      symbols.erase(symbols.begin() + at + 1);
    }
    out->insert(out->end(), symbols.begin(), symbols.end());
  }

  std::string path_;
  std::vector<PreTokenizerStep> steps_;
  bool byte_level_ = false, ignore_merges_ = false;
  std::unordered_map<std::string, int64_t> vocab_;                // raw bytes -> id
  std::unordered_map<uint64_t, std::pair<int, int64_t>> merges_;  // (left, right) -> (rank, merged id)
  std::array<int64_t, 256> byte_ids_{};
  std::vector<std::string> pieces_;  // id -> bytes (vocabulary) or content (added tokens)
  std::vector<bool> special_;
  int64_t unk_ = -1, bos_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_json_tokenizer(const std::string& path) {
  try {
    return std::make_unique<HfJsonTokenizer>(path);
  } catch (const json::exception& e) {  // a field of an unexpected JSON type
    throw RunnerError("tokenizer " + path + " is malformed: " + e.what());
  }
}

}  // namespace composite
