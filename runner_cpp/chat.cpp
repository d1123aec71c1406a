#include "chat.h"

namespace composite {

namespace {

// Length of the whitespace character (as Python's str.isspace) starting at text[at], or 0.
size_t whitespace_at(const std::string& text, size_t at) {
  const auto byte = [&](size_t i) { return i < text.size() ? static_cast<unsigned char>(text[i]) : 0u; };
  const unsigned b0 = byte(at);
  if ((b0 >= 0x09 && b0 <= 0x0d) || (b0 >= 0x1c && b0 <= 0x20)) return 1;
  if (b0 == 0xc2 && (byte(at + 1) == 0x85 || byte(at + 1) == 0xa0)) return 2;  // U+0085, U+00A0
  if (b0 == 0xe1 && byte(at + 1) == 0x9a && byte(at + 2) == 0x80) return 3;    // U+1680
  if (b0 == 0xe2 && byte(at + 1) == 0x80) {
    const unsigned b2 = byte(at + 2);
    if ((b2 >= 0x80 && b2 <= 0x8a) || b2 == 0xa8 || b2 == 0xa9 || b2 == 0xaf)
      return 3;  // U+2000-200A, 2028, 2029, 202F
  }
  if (b0 == 0xe2 && byte(at + 1) == 0x81 && byte(at + 2) == 0x9f) return 3;  // U+205F
  if (b0 == 0xe3 && byte(at + 1) == 0x80 && byte(at + 2) == 0x80) return 3;  // U+3000
  return 0;
}

}  // namespace

std::string trimmed(const std::string& text) {
  size_t first = 0;
  while (size_t n = whitespace_at(text, first)) first += n;
  size_t end = first;
  for (size_t at = first; at < text.size();) {
    const size_t n = whitespace_at(text, at);
    at += n ? n : 1;
    if (!n) end = at;  // past the last byte that is not whitespace (continuation bytes included)
  }
  return text.substr(first, end - first);
}

std::vector<int64_t> chat_turn_tokens(const Tokenizer& tokenizer, const ChatTemplate& chat, bool first,
                                      const std::string& system, const std::string& user) {
  std::vector<int64_t> ids;
  std::string text;
  if (first && !system.empty()) {
    text = chat.system_prefix + (chat.trim_system ? trimmed(system) : system) + chat.system_suffix;
  } else {
    text = first ? chat.first_user_prefix : chat.user_prefix;
    if (!first) ids.push_back(chat.end_of_turn_id);
  }
  text += (chat.trim_user ? trimmed(user) : user) + chat.user_suffix;
  const std::vector<int64_t> body = tokenizer.encode(text, true);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

}  // namespace composite
