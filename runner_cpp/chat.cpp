#include "chat.h"

#include "error.h"

namespace composite {

std::string trimmed(const std::string& text) {
  const char* space = " \t\n\r\f\v";
  const size_t first = text.find_first_not_of(space);
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(space) - first + 1);
}

namespace {

std::string llama3_header(const std::string& role) { return "<|start_header_id|>" + role + "<|end_header_id|>\n\n"; }

}  // namespace

std::vector<int64_t> chat_turn_tokens(const Tokenizer& tokenizer, const ChatFormat& format, bool first,
                                      const std::string& system, const std::string& user) {
  std::vector<int64_t> ids;
  if (!first) ids.push_back(format.end_of_turn_id);
  std::string text;
  if (format.family == "llama3") {
    if (first && format.bos_id >= 0) ids.push_back(format.bos_id);
    if (first && !trimmed(system).empty()) text += llama3_header("system") + trimmed(system) + "<|eot_id|>";
    text += llama3_header("user") + trimmed(user) + "<|eot_id|>" + llama3_header("assistant");
  } else if (format.family == "llama2") {
    // Every user turn opens with BOS; the system message goes inside the first one.
    if (format.bos_id >= 0) ids.push_back(format.bos_id);
    std::string content = user;
    if (first && !trimmed(system).empty()) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + user;
    text = "[INST] " + trimmed(content) + " [/INST]";
  } else {
    throw RunnerError("this export records no chat template (model family unknown at export): --chat needs one");
  }
  const std::vector<int64_t> body = tokenizer.encode(text, true);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

}  // namespace composite
