// Chat turns in the model's own template (the manifest's "chat" entry: the text around each
// message, rendered and checked at export by composite/chat_template.py): the tokens one user turn
// adds to the conversation. composite/runtime/chat.py is the Python twin.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "manifest.h"
#include "tokenizer.h"

namespace composite {

// The tokens of a user turn, up to where the answer begins. The first turn opens the conversation
// (with the system message, if any: an empty one is none); a later one first closes the answer
// before it with the end-of-turn token.
std::vector<int64_t> chat_turn_tokens(const Tokenizer& tokenizer, const ChatTemplate& chat, bool first,
                                      const std::string& system, const std::string& user);

// Without leading and trailing whitespace, as Jinja's trim (Python's str.strip) removes it: ASCII
// whitespace, the separators \x1c-\x1f, and Unicode's spaces and line and paragraph separators.
std::string trimmed(const std::string& text);

}  // namespace composite
