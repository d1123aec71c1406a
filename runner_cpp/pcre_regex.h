// A compiled PCRE2 pattern (UTF, Unicode properties) and the pre-tokenizer splits built on it.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace composite {

class Regex {
 public:
  // `literal`: the pattern is a plain string. Throws RunnerError naming `what` if it does not compile.
  Regex(const std::string& pattern, bool literal, const std::string& what);
  // [begin, end) of every non-overlapping match in `text`, which must be valid UTF-8.
  std::vector<std::pair<size_t, size_t>> matches(const std::string& text) const;

 private:
  // Owned by these handles alone: a Regex can be moved but not copied.
  std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> code_{nullptr, pcre2_code_free};
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_{nullptr, pcre2_match_data_free};
};

// Splits `text` at the matches of `regex`: each match and each stretch between matches becomes a
// piece (Hugging Face's "Isolated" split), or only the stretches between matches ("Removed").
// Empty pieces are dropped.
std::vector<std::string> split_isolated(const Regex& regex, const std::string& text, bool keep_matches = true);

}  // namespace composite
