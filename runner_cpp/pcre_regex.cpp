#include "pcre_regex.h"

#include "error.h"

namespace composite {

Regex::Regex(const std::string& pattern, bool literal, const std::string& what) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                            PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0), &error_code, &error_offset,
                            nullptr));
  if (!code_) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof message);
    throw RunnerError(what + " has a pattern PCRE2 cannot compile at offset " + std::to_string(error_offset) + ": " +
                      reinterpret_cast<const char*>(message));
  }
  match_.reset(pcre2_match_data_create_from_pattern(code_.get(), nullptr));
}

std::vector<std::pair<size_t, size_t>> Regex::matches(const std::string& text) const {
  std::vector<std::pair<size_t, size_t>> spans;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE offset = 0;
  while (offset < text.size()) {
    const int rc = pcre2_match(code_.get(), subject, text.size(), offset, PCRE2_NO_UTF_CHECK, match_.get(), nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match_.get());
    if (span[1] == span[0]) {
      // An empty match: step over one whole character so the scan always moves on.
      offset = span[1] + 1;
      while (offset < text.size() && (static_cast<unsigned char>(text[offset]) & 0xC0) == 0x80) ++offset;
      continue;
    }
    spans.emplace_back(span[0], span[1]);
    offset = span[1];
  }
  return spans;
}

std::vector<std::string> split_isolated(const Regex& regex, const std::string& text, bool keep_matches) {
  std::vector<std::string> pieces;
  size_t at = 0;
  for (const auto& [begin, end] : regex.matches(text)) {
    if (begin > at) pieces.push_back(text.substr(at, begin - at));
    if (keep_matches) pieces.push_back(text.substr(begin, end - begin));
    at = end;
  }
  if (at < text.size()) pieces.push_back(text.substr(at));
  return pieces;
}

}  // namespace composite
