#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "chat.h"
#include "error.h"
#include "tokenizer.h"

using composite::RunnerError;
using nlohmann::json;

namespace {

constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A byte-level BPE over printable ASCII, ' ' (written U+0120 "Ġ") and '\n' (U+010A "Ċ"): ids 0..95
// are the single characters, then "ab" (96) and " c" (97); four special tokens after them.
json small_tokenizer() {
  json vocab = json::object();
  for (int c = 33; c <= 126; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 33;
  vocab["\xC4\xA0"] = 94;  // U+0120: the byte ' '
  vocab["\xC4\x8A"] = 95;  // U+010A: the byte '\n'
  vocab["ab"] = 96;
  vocab
      ["\xC4\xA0"
       "c"] = 97;
  json added = json::array();
  const char* specials[] = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  for (int i = 0; i < 4; ++i) {
    added.push_back({{"id", 98 + i},
                     {"content", specials[i]},
                     {"special", true},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false}});
  }
  json doc;
  doc["added_tokens"] = added;
  doc["normalizer"] = nullptr;
  json split = {{"type", "Split"}, {"behavior", "Isolated"}, {"invert", false}};
  split["pattern"]["Regex"] = kLlama3Pattern;
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  doc["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({split, byte_level})}};
  json bos_item, text_item;
  bos_item["SpecialToken"]["id"] = "<|begin_of_text|>";
  text_item["Sequence"]["id"] = "A";
  json post = {{"type", "TemplateProcessing"}, {"single", json::array({bos_item, text_item})}};
  post["special_tokens"]["<|begin_of_text|>"] = {{"id", "<|begin_of_text|>"}, {"ids", json::array({98})}};
  doc["post_processor"] = post;
  doc["decoder"] = {{"type", "ByteLevel"}};
  doc["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"ignore_merges", false}};
  doc["model"]["merges"] = json::array({json::array({"a", "b"}), "\xC4\xA0 c"});  // both spellings
  return doc;
}

std::string write_json(const json& doc) {
  char name[] = "/tmp/composite_hf_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  std::ofstream(name) << doc.dump();
  return name;
}

class HfJson : public ::testing::Test {
 protected:
  void SetUp() override { path_ = write_json(small_tokenizer()); }
  void TearDown() override { std::remove(path_.c_str()); }
  std::string path_;
};

int64_t id_of(char c) { return c == ' ' ? 94 : c == '\n' ? 95 : c - 33; }

}  // namespace

TEST_F(HfJson, MergesByRankAndReadsBosFromThePostProcessor) {
  auto tokenizer = composite::load_tokenizer(path_, "hf_json");
  EXPECT_EQ(tokenizer->bos_id(), 98);
  EXPECT_EQ(tokenizer->vocab_size(), 102);
  // "abc c" -> words "abc", " c": "ab" merges, then "c"; " c" merges.
  EXPECT_EQ(tokenizer->encode("abc c"), (std::vector<int64_t>{96, id_of('c'), 97}));
  EXPECT_EQ(composite::decode(*tokenizer, {96, id_of('c'), 97, 95}), "abc c\n");
}

TEST_F(HfJson, ParsesSpecialTokensUnlessAskedForText) {
  auto tokenizer = composite::load_tokenizer(path_, "hf_json");
  EXPECT_EQ(tokenizer->encode("ab<|eot_id|> c"), (std::vector<int64_t>{96, 101, 97}));
  const auto as_text = tokenizer->encode("<|eot_id|>", false);
  EXPECT_EQ(as_text.size(), 10u);  // no merge applies: one id per character
  EXPECT_EQ(composite::decode(*tokenizer, as_text), "<|eot_id|>");
  EXPECT_EQ(composite::decode(*tokenizer, {101}), "");  // special tokens print nothing
}

TEST_F(HfJson, RefusesWhatItDoesNotSupportInOneMessage) {
  auto refused = [](json doc, const std::string& phrase) {
    const std::string path = write_json(doc);
    try {
      composite::load_tokenizer(path, "hf_json");
      ADD_FAILURE() << "accepted: " << phrase;
    } catch (const RunnerError& e) {
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
    std::remove(path.c_str());
  };
  json doc = small_tokenizer();
  doc["model"]["type"] = "WordPiece";
  refused(doc, "model type WordPiece");
  doc = small_tokenizer();
  doc["normalizer"] = {{"type", "NFC"}};
  refused(doc, "NFC normalizer");
  doc = small_tokenizer();
  doc["pre_tokenizer"] = {{"type", "Metaspace"}};
  refused(doc, "Metaspace pre-tokenizer");
  doc = small_tokenizer();
  doc["pre_tokenizer"]["pretokenizers"].erase(1);
  refused(doc, "no ByteLevel pre-tokenizer");
  doc = small_tokenizer();
  doc["model"]["merges"].push_back("x y");
  refused(doc, "not all in the vocabulary");
  doc = small_tokenizer();
  doc["model"]["vocab"]["ab"] = "ninety-six";
  refused(doc, "not a non-negative integer");
  doc = small_tokenizer();
  doc["added_tokens"][0]["lstrip"] = true;
  refused(doc, "lstrip");
  doc = small_tokenizer();
  doc["model"]["merges"] = 3;
  refused(doc, "merges");
  doc = small_tokenizer();
  doc["pre_tokenizer"]["pretokenizers"][0]["behavior"] = 7;  // the wrong JSON type
  refused(doc, "malformed");
  refused(json::array({1, 2}), "not a JSON object");
}

// Llama 3's template as the export renders it into pieces (composite/chat_template.py).
composite::ChatTemplate llama3_pieces() {
  composite::ChatTemplate chat;
  chat.has_system = true;
  chat.system_prefix = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n";
  chat.system_suffix = "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n";
  chat.first_user_prefix = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n";
  chat.user_prefix = "<|start_header_id|>user<|end_header_id|>\n\n";
  chat.user_suffix = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  chat.end_of_turn_id = 101;
  chat.trim_system = chat.trim_user = true;
  return chat;
}

TEST_F(HfJson, ChatTurnsAreTheTemplatesPiecesAroundEachMessage) {
  auto tokenizer = composite::load_tokenizer(path_, "hf_json");
  const composite::ChatTemplate chat = llama3_pieces();
  const auto header = [&](const std::string& role) {
    std::vector<int64_t> ids{99};
    for (int64_t id : tokenizer->encode(role)) ids.push_back(id);
    ids.push_back(100);
    ids.push_back(95);
    ids.push_back(95);
    return ids;
  };
  auto expected = std::vector<int64_t>{98};
  for (const auto& part : {header("system"), tokenizer->encode("ab"), std::vector<int64_t>{101}, header("user"),
                           tokenizer->encode("c"), std::vector<int64_t>{101}, header("assistant")}) {
    expected.insert(expected.end(), part.begin(), part.end());
  }
  EXPECT_EQ(composite::chat_turn_tokens(*tokenizer, chat, true, " ab\n", " c "), expected);
  // Without a system message the first turn opens with its own prefix.
  const auto alone = composite::chat_turn_tokens(*tokenizer, chat, true, "", "c");
  auto opening = std::vector<int64_t>{98};
  for (int64_t id : header("user")) opening.push_back(id);
  EXPECT_EQ(std::vector<int64_t>(alone.begin(), alone.begin() + opening.size()), opening);
  // A later turn closes the answer first, and has no BOS or system message.
  const auto later = composite::chat_turn_tokens(*tokenizer, chat, false, "ab", "c");
  EXPECT_EQ(later.front(), 101);
  EXPECT_EQ(std::vector<int64_t>(later.begin() + 1, later.begin() + 1 + header("user").size()), header("user"));
}

TEST_F(HfJson, ChatMessagesKeepTheirWhitespaceWhenTheTemplateDoes) {
  auto tokenizer = composite::load_tokenizer(path_, "hf_json");
  composite::ChatTemplate chat = llama3_pieces();
  chat.trim_user = false;
  const auto kept = composite::chat_turn_tokens(*tokenizer, chat, false, "", " c");
  EXPECT_EQ(composite::decode(*tokenizer, {kept.begin() + 1, kept.end()}),
            "user\n\n cassistant\n\n");  // special tokens are not decoded
}

TEST(Chat, TrimsWhatPythonsStripTrims) {
  EXPECT_EQ(composite::trimmed(" \t\n\r\x0b\x0c"
                               "ab c\x1c\x1d\x1e\x1f"),
            "ab c");
  // U+00A0, U+2003, U+3000 and U+2029 around the text; U+00E9 and U+4E2D are kept.
  EXPECT_EQ(composite::trimmed("\xC2\xA0\xE2\x80\x83"
                               "caf\xC3\xA9 \xE4\xB8\xAD\xE3\x80\x80\xE2\x80\xA9"),
            "caf\xC3\xA9 \xE4\xB8\xAD");
  EXPECT_EQ(composite::trimmed("\xC2\x85 \xE1\x9A\x80"), "");
  // U+200B (zero width space) is not whitespace to Python either.
  EXPECT_EQ(composite::trimmed("\xE2\x80\x8B"
                               "a"),
            "\xE2\x80\x8B"
            "a");
}

TEST_F(HfJson, DigitsPreTokenizerIsolatesEachDigit) {
  json doc = small_tokenizer();
  doc["model"]["vocab"]["12"] = 102;
  doc["model"]["merges"].push_back("1 2");
  doc["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Digits"}, {"individual_digits", true}};
  const std::string path = write_json(doc);
  auto tokenizer = composite::load_tokenizer(path, "hf_json");
  EXPECT_EQ(tokenizer->encode("12", false), (std::vector<int64_t>{16, 17}));
  doc["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = false;
  const std::string grouped = write_json(doc);
  EXPECT_EQ(composite::load_tokenizer(grouped, "hf_json")->encode("12", false), (std::vector<int64_t>{102}));
  std::remove(path.c_str());
  std::remove(grouped.c_str());
}
