// Chat turns in the template of the model's family (the manifest's "chat" entry): the tokens one
// user turn adds to the conversation. composite/runtime/chat.py is the Python twin.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer.h"

namespace composite {

struct ChatFormat {
  std::string family;  // "llama3" or "llama2"; empty: the export cannot chat
  int64_t bos_id = -1;
  int64_t end_of_turn_id = -1;  // closes an assistant turn: <|eot_id|> (Llama 3), </s> (Llama 2)
};

// The tokens of a user turn and the assistant header after it. The first turn opens the
// conversation (BOS, the system message); a later one first closes the assistant turn before it.
std::vector<int64_t> chat_turn_tokens(const Tokenizer& tokenizer, const ChatFormat& format, bool first,
                                      const std::string& system, const std::string& user);

// Without leading and trailing whitespace, as the chat templates apply to every message.
std::string trimmed(const std::string& text);

}  // namespace composite
