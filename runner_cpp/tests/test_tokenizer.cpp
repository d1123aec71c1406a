#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "error.h"
#include "tokenizer.h"

using composite::Utf8Stream;

TEST(Utf8Stream, HoldsBackACharacterSplitAcrossTokens) {
  Utf8Stream stream;
  const std::string smile = "\xF0\x9F\x99\x82";  // U+1F642
  EXPECT_EQ(stream.push("a" + smile.substr(0, 1)), "a");
  EXPECT_EQ(stream.push(smile.substr(1, 2)), "");
  EXPECT_EQ(stream.push(smile.substr(3) + "b"), smile + "b");
  EXPECT_EQ(stream.finish(), "");
}

TEST(Utf8, AcceptsWellFormedTextOnly) {
  for (const std::string good : {"", "plain", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x99\x82", "\xF4\x8F\xBF\xBF"}) {
    EXPECT_TRUE(composite::valid_utf8(good)) << good;
  }
  // beyond U+10FFFF (a fuzzer's find: PCRE2 matched it unchecked), surrogate, overlong forms,
  // bytes no lead can be, and a character cut short
  for (const std::string bad : {"On \xF4\xA9\x98\x80", "\xED\xA0\x80", "\xC0\xAF", "\xE0\x80\xAF", "\xF0\x8F\xBF\xBF",
                                "\xF5\x80\x80\x80", "\xFF", "\x80", "\xE2\x82"}) {
    EXPECT_FALSE(composite::valid_utf8(bad)) << bad;
  }
}

TEST(Utf8Stream, ReplacesInvalidBytes) {
  Utf8Stream stream;
  EXPECT_EQ(stream.push("\xFF"
                        "a"),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(stream.push("\xC3"), "");
  EXPECT_EQ(stream.push("x"),
            "\xEF\xBF\xBD"
            "x");  // a lead byte followed by a non-continuation
  EXPECT_EQ(stream.push("\xE2\x82"), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
}

namespace {

std::string write_temp(const std::string& contents) {
  char name[] = "/tmp/composite_tok_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  std::ofstream(name, std::ios::binary) << contents;
  return name;
}

}  // namespace

TEST(Tiktoken, MergesByRankAndRoundTrips) {
  // Ranks: every byte of "ab c" alone, then "ab", then " c".
  // base64: a=YQ==, b=Yg==, ' '=IA==, c=Yw==, ab=YWI=, ' c'=IGM=
  const std::string path = write_temp("YQ== 0\nYg== 1\nIA== 2\nYw== 3\nYWI= 4\nIGM= 5\n");
  auto tokenizer = composite::load_tokenizer(path, "tiktoken");
  EXPECT_EQ(tokenizer->vocab_size(), 6 + 256);
  EXPECT_EQ(tokenizer->bos_id(), 6);
  EXPECT_EQ(tokenizer->encode("ab c"), (std::vector<int64_t>{4, 5}));
  // Special tokens in the text: their ids by default, plain text on request.
  EXPECT_EQ(tokenizer->encode("<|begin_of_text|>ab<|eot_id|> c"), (std::vector<int64_t>{6, 4, 6 + 9, 5}));
  // As text, "<" is just a byte, and these ranks have no token for it.
  EXPECT_THROW(tokenizer->encode("<|eot_id|>", false), composite::RunnerError);
  EXPECT_EQ(composite::decode(*tokenizer, {4, 5}), "ab c");
  EXPECT_THROW(tokenizer->encode("a\xFF"), composite::RunnerError);
  std::remove(path.c_str());
}

TEST(Tiktoken, RejectsAFileThatIsNotRanks) {
  const std::string path = write_temp("hello world\n");
  EXPECT_THROW(composite::load_tokenizer(path, "tiktoken"), composite::RunnerError);
  EXPECT_THROW(composite::load_tokenizer(path, "sentencepiece"), composite::RunnerError);
  EXPECT_THROW(composite::load_tokenizer(path, "bpe"), composite::RunnerError);
  EXPECT_THROW(composite::load_tokenizer("/nonexistent/tokenizer.model", "sentencepiece"), composite::RunnerError);
  std::remove(path.c_str());
}
