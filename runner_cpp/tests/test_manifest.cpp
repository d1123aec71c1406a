#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "error.h"
#include "manifest.h"

using composite::parse_manifest;
using composite::RunnerError;
using nlohmann::json;

namespace {

json tensor(const std::string& name, std::vector<int64_t> shape, const std::string& dtype = "float32") {
  return {{"name", name}, {"shape", shape}, {"dtype", dtype}};
}

// A valid two-shard manifest of a one-layer model: dim 8, 2 heads, 1 kv head, S 16.
json valid() {
  json io0 = {
      {"decode",
       {{"inputs",
         {tensor("tokens", {1, 1}, "int64"), tensor("input_pos", {1}, "int64"), tensor("mask", {1, 17}),
          tensor("k_cache.0", {1, 1, 4, 16}), tensor("v_cache.0", {1, 1, 16, 4})}},
        {"outputs", {tensor("hidden", {1, 1, 8}), tensor("k_new.0", {1, 1, 4, 1}), tensor("v_new.0", {1, 1, 1, 4})}}}}};
  json io1 = {{"decode", {{"inputs", {tensor("hidden", {1, 1, 8})}}, {"outputs", {tensor("logits", {1, 1, 10})}}}}};
  return {
      {"format", "composite-manifest"},
      {"version", 2},
      {"export_id", "x"},
      {"model", {{"dim", 8}, {"n_layers", 1}, {"n_heads", 2}, {"n_kv_heads", 1}, {"head_dim", 4}, {"vocab_size", 10}}},
      {"max_seq_len", 16},
      {"methods", {{"decode", 1}}},
      {"kv_cache", {{"dtype", "float32"}, {"k_shape", {1, 4, 16}}, {"v_shape", {1, 16, 4}}}},
      {"mask", {{"hidden", -30000.0}}},
      {"tokenizer", nullptr},
      {"bos_id", 1},
      {"eos_ids", {2}},
      {"shards",
       {{{"index", 0},
         {"file", "shard_00.pte"},
         {"sha256", "a"},
         {"size", 10},
         {"layers", {0, 1}},
         {"has_embedding", true},
         {"has_head", false},
         {"io", io0}},
        {{"index", 1},
         {"file", "shard_01.pte"},
         {"sha256", "b"},
         {"size", 10},
         {"layers", {1, 1}},
         {"has_embedding", false},
         {"has_head", true},
         {"io", io1}}}}};
}

std::string error_of(const json& j) {
  try {
    parse_manifest(j.dump(), "dir");
  } catch (const RunnerError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Manifest, ParsesAValidManifest) {
  const auto m = parse_manifest(valid().dump(), "dir");
  EXPECT_EQ(m.shards.size(), 2u);
  EXPECT_EQ(m.shards[0].io.at("decode").inputs[3].name, "k_cache.0");
  EXPECT_EQ(m.shards[0].io.at("decode").inputs[3].numel(), 64);
  EXPECT_TRUE(m.shards[0].has_layers());
  EXPECT_FALSE(m.shards[1].has_layers());
  EXPECT_EQ(m.path_of("shard_00.pte"), "dir/shard_00.pte");
  EXPECT_TRUE(m.tokenizer_file.empty());
}

TEST(Manifest, RejectsBrokenManifestsWithAMessage) {
  EXPECT_NE(error_of(json::parse("[1]")).find("not a composite manifest"), std::string::npos);
  try {
    parse_manifest("{\"format\": ", "dir");
    FAIL();
  } catch (const RunnerError& e) {
    EXPECT_NE(std::string(e.what()).find("malformed JSON"), std::string::npos);
  }
  json j = valid();
  j["version"] = 7;
  EXPECT_NE(error_of(j).find("version 7"), std::string::npos);
  j = valid();
  std::swap(j["shards"][0], j["shards"][1]);
  EXPECT_NE(error_of(j).find("out of order"), std::string::npos);
  j = valid();
  j["shards"][0].erase("io");
  EXPECT_NE(error_of(j).find("has no 'io'"), std::string::npos);
  j = valid();
  j["kv_cache"]["k_shape"] = {1, 16, 4};
  EXPECT_NE(error_of(j).find("kv_cache shapes"), std::string::npos);
  j = valid();
  j["max_seq_len"] = "long";
  EXPECT_NE(error_of(j).find("'max_seq_len' must be an integer"), std::string::npos);
  // Numbers that do not fit the field are refused, not cast (the fuzzer found a float version).
  j = valid();
  j["version"] = 1e81;
  EXPECT_NE(error_of(j).find("manifest version"), std::string::npos);
  j = valid();
  j["model"]["dim"] = 4294967296LL;
  EXPECT_NE(error_of(j).find("out of range"), std::string::npos);
  j = valid();
  j["max_seq_len"] = 64.5;
  EXPECT_NE(error_of(j).find("must be an integer"), std::string::npos);
  j = valid();
  j["mask"]["hidden"] = 1e300;
  EXPECT_NE(error_of(j).find("finite float32"), std::string::npos);
  j = valid();
  j["shards"][1]["layers"] = {0, 1};
  EXPECT_NE(error_of(j).find("continue the chain"), std::string::npos);
  j = valid();
  j["shards"][0]["file"] = "../etc/passwd";
  EXPECT_NE(error_of(j).find("must not contain"), std::string::npos);
}

// tests/manifests: the cases both readers must judge alike (tests/test_manifest_readers.py is the
// Python side).
TEST(Manifest, SharedFixtures) {
  const std::string folder = COMPOSITE_MANIFEST_FIXTURES;
  std::ifstream expected_file(folder + "/expected.json");
  ASSERT_TRUE(expected_file) << folder;
  const json expected = json::parse(expected_file);
  ASSERT_GE(expected.size(), 20u);
  for (const auto& [name, message] : expected.items()) {
    std::ifstream in(folder + "/" + name);
    ASSERT_TRUE(in) << name;
    std::stringstream text;
    text << in.rdbuf();
    std::string verdict;
    try {
      parse_manifest(text.str(), "fixture");
    } catch (const RunnerError& e) {
      verdict = e.what();
    }
    EXPECT_EQ(verdict, message.is_null() ? "" : message.get<std::string>()) << name;
  }
}
