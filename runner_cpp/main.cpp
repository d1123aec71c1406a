// composite_runner: generate text with an export's shards, chained token by token.
//
//   composite_runner --artifacts DIR (--prompt TEXT | --prompt_file F | --prompt_ids 1,2,3) [options]
//   composite_runner --artifacts DIR --chat [--system TEXT] [options] < user turns, one per line
//   (composite_runner --help lists the options and their defaults)
//
// Text streams to stdout; a one-line summary goes to stderr, and the full stats to --stats_json.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "chat.h"
#include "context_shift.h"
#include "cpu_backend.h"
#include "error.h"
#include "eval.h"
#include "generate.h"
#include "manifest.h"
#include "qnn_libraries.h"
#include "sampler.h"
#include "shard_chain.h"
#include "speculate.h"
#include "stderr_filter.h"
#include "tokenizer.h"

using namespace composite;

namespace {

// Both runners' defaults (composite/runtime/generate.py says the same).
constexpr int kDefaultMaxNewTokens = 128;

struct Options {
  std::string artifacts, prompt, prompt_file, prompt_ids, stats_json, system, chat_template;
  EvalOptions eval;
  bool has_prompt = false, chat = false, special_as_text = false;
  int seq_len = 0;  // total tokens, prompt included; 0 = max_seq_len
  int max_new_tokens = kDefaultMaxNewTokens;
  float temperature = 0.f, top_p = 1.f;
  uint64_t seed = 0;
  bool seed_given = false;
  bool verify = false, verbose = false, allow_qnn_mismatch = false;
  int threads = 0;  // 0 = the performant cores
  bool context_shift = true;
  int keep = -1, evict = -1;  // -1: the defaults (context_shift.h)
  int prompt_lookup = -1;     // -1: not asked for
  std::string lookahead;      // empty: not asked for
};

struct Flag {
  const char* name;
  const char* value;  // nullptr: a switch
  const char* help;
};

// Each flag may also be spelled with hyphens (--max-new-tokens), as composite.run's are.
const Flag kFlags[] = {
    {"--artifacts", "DIR", "export folder (holds manifest.json); required"},
    {"--prompt", "TEXT",
     "prompt text (BOS added per the manifest); one of --prompt, --prompt_file, --prompt_ids, --chat is required"},
    {"--prompt_file", "FILE", "prompt text from a file"},
    {"--prompt_ids", "1,2,3", "prompt token ids, used as given"},
    {"--chat", nullptr, "chat in the model's template: user turns from stdin, one per line, until EOF"},
    {"--system", "TEXT", "system message of the chat"},
    {"--chat_template", "FILE",
     "the chat's template as composite.chat_template writes it (JSON), instead of the export's"},
    {"--special_as_text", nullptr, "encode special-token strings in the prompt (<|eot_id|>, </s>) as text"},
    {"--eval_text", "FILE", "instead of generating: perplexity on this text (and KLD with --kld_base)"},
    {"--ctx", "N", "--eval_text: tokens per chunk (default: the export's max_seq_len)"},
    {"--limit_tokens", "N", "--eval_text: the text's first N tokens only"},
    {"--score", "MODE", "--eval_text: all (default) or second-half, llama.cpp's choice"},
    {"--kld_base", "FILE", "--eval_text: the reference's probabilities, from composite.eval --kld-base-out"},
    {"--stream", nullptr, "--eval_text: score every token through the shifting context, not in chunks"},
    {"--max_new_tokens", "N", "stop after N new tokens (default 128)"},
    {"--seq_len", "N",
     "stop at N tokens in all, prompt included (default: no limit; with --no_context_shift, max_seq_len)"},
    {"--keep", "N", "past the context, keep the first N tokens, the attention sinks (default 4)"},
    {"--evict", "N", "past the context, evict N tokens at a time (default: a quarter of the context)"},
    {"--no_context_shift", nullptr, "stop at the export's max_seq_len instead of evicting the oldest tokens"},
    {"--prompt_lookup", "N",
     "guess the next tokens from the text so far (its last N..1 tokens matched), checked several per call"},
    {"--lookahead", "[W,N,G]",
     "lookahead decoding: guesses from Jacobi iteration (window W, n-gram size N, G candidates), checked several "
     "per call (default 2,3,1)"},
    {"--temperature", "T", "0 = greedy (default 0)"},
    {"--top_p", "P", "nucleus sampling mass in (0, 1] (default 1)"},
    {"--seed", "S", "sampling seed, 0 .. 2^64-1 (default: a fresh one, printed when sampling)"},
    {"--threads", "N", "CPU threads for XNNPACK (default: the performant cores)"},
    {"--stats_json", "FILE", "write the run's stats (timings per shard, tokens, peak RSS) as JSON"},
    {"--verify", nullptr, "check every shard's sha256 before loading"},
    {"--allow_qnn_mismatch", nullptr,
     "run QNN shards under libraries of another QNN version than they were compiled with"},
    {"--verbose", nullptr, "also show the QNN libraries' routine log lines and ExecuTorch's info lines"},
    {"--help", nullptr, "this text"},
};

void print_help() {
  std::cout
      << "usage: composite_runner --artifacts DIR (--prompt TEXT | --prompt_file FILE | --prompt_ids 1,2,3 | "
         "--chat) [options]\n\nGenerates text with an export's shards chained token by token; text streams to stdout,\n"
         "a one-line summary goes to stderr.\n\n";
  for (const Flag& flag : kFlags) {
    const std::string left = std::string(flag.name) + (flag.value ? std::string(" ") + flag.value : "");
    std::cout << "  " << left << std::string(left.size() < 24 ? 24 - left.size() : 1, ' ') << flag.help << "\n";
  }
  std::cout << "\nFlags may also be spelled with hyphens (--max-new-tokens), as composite.run's are.\n";
}

// "--max-new-tokens" -> "--max_new_tokens"
std::string canonical_flag(std::string arg) {
  for (size_t i = 2; i < arg.size(); ++i) {
    if (arg[i] == '-') arg[i] = '_';
  }
  return arg;
}

const Flag* find_flag(const std::string& name) {
  for (const Flag& flag : kFlags) {
    if (name == flag.name) return &flag;
  }
  return nullptr;
}

std::string readable(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

// A number in [lo, hi], or (lo, hi] when lo_open.
double parse_number(const std::string& flag, const std::string& text, double lo, double hi, bool lo_open = false) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || value < lo || (lo_open && value == lo) || value > hi) {
    throw RunnerError(flag + " needs a number in " + (lo_open ? "(" : "[") + readable(lo) + ", " + readable(hi) +
                      "], got '" + text + "'");
  }
  return value;
}

uint64_t parse_seed(const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || *end != '\0' || errno == ERANGE) {
    throw RunnerError("--seed needs a whole number in 0 .. 18446744073709551615, got '" + text + "'");
  }
  return value;
}

// --eval_text and the flags that shape its scoring.
void parse_eval_options(std::map<std::string, std::string>& values, EvalOptions* eval) {
  eval->text_path = values["--eval_text"];
  if (values.count("--ctx")) eval->ctx = static_cast<int>(parse_number("--ctx", values["--ctx"], 2, 1e9));
  if (values.count("--limit_tokens"))
    eval->limit_tokens = static_cast<int>(parse_number("--limit_tokens", values["--limit_tokens"], 2, 1e12));
  if (values.count("--score")) eval->score = values["--score"];
  if (eval->score != "all" && eval->score != "second-half") {
    throw RunnerError("--score must be all or second-half, got '" + eval->score + "'");
  }
  if (values.count("--kld_base")) eval->kld_base_path = values["--kld_base"];
}

Options parse_options(int argc, char** argv) {
  Options o;
  std::map<std::string, std::string> values;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    const auto eq = arg.find('=');
    const bool inline_value = eq != std::string::npos && arg.rfind("--", 0) == 0;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "-h") arg = "--help";
    const std::string name = canonical_flag(arg);
    const Flag* flag = find_flag(name);
    if (flag == nullptr) throw RunnerError("unknown flag '" + arg + "' (see --help)");
    if (name == "--lookahead") {  // its value is optional
      if (!inline_value && i + 1 < argc && argv[i + 1][0] != '-') value = argv[++i];
      values[name] = value.empty() ? kDefaultLookahead : value;
      continue;
    }
    if (flag->value == nullptr) {
      if (name == "--help") {
        print_help();
        std::exit(0);
      }
      if (name == "--verify") o.verify = true;
      if (name == "--allow_qnn_mismatch") o.allow_qnn_mismatch = true;
      if (name == "--verbose") o.verbose = true;
      if (name == "--chat") o.chat = true;
      if (name == "--special_as_text") o.special_as_text = true;
      if (name == "--no_context_shift") o.context_shift = false;
      if (name == "--stream") o.eval.stream = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) throw RunnerError(name + " needs a value (" + flag->value + ")");
      value = argv[++i];
    }
    values[name] = value;
  }
  if (!values.count("--artifacts")) throw RunnerError("--artifacts DIR is required");
  o.artifacts = values["--artifacts"];
  const int prompts = values.count("--prompt") + values.count("--prompt_file") + values.count("--prompt_ids");
  const bool eval = values.count("--eval_text") > 0;
  for (const char* flag : {"--ctx", "--limit_tokens", "--score", "--kld_base"}) {
    if (values.count(flag) && !eval) throw RunnerError(std::string(flag) + " is for --eval_text");
  }
  if (o.eval.stream && !eval) throw RunnerError("--stream is for --eval_text");
  if (o.eval.stream && (values.count("--ctx") || values.count("--score") || values.count("--kld_base"))) {
    throw RunnerError("--stream scores every token through the export's context: drop --ctx, --score and --kld_base");
  }
  if (eval && (prompts || o.chat)) throw RunnerError("--eval_text scores a text: drop the prompt and --chat flags");
  if (o.chat && prompts) throw RunnerError("--chat reads the user's turns from stdin: drop the prompt flag");
  if (!o.chat && !eval && prompts != 1) {
    throw RunnerError("give exactly one of --prompt, --prompt_file, --prompt_ids, --chat, --eval_text");
  }
  if (eval) parse_eval_options(values, &o.eval);
  if (values.count("--system") && !o.chat) throw RunnerError("--system is for --chat");
  if (values.count("--system")) o.system = values["--system"];
  if (values.count("--chat_template") && !o.chat) throw RunnerError("--chat_template is for --chat");
  if (values.count("--chat_template")) o.chat_template = values["--chat_template"];
  if (values.count("--prompt")) o.prompt = values["--prompt"], o.has_prompt = true;
  if (values.count("--prompt_file")) o.prompt_file = values["--prompt_file"];
  if (values.count("--prompt_ids")) o.prompt_ids = values["--prompt_ids"];
  if (values.count("--seq_len")) o.seq_len = static_cast<int>(parse_number("--seq_len", values["--seq_len"], 1, 1e9));
  if (values.count("--max_new_tokens"))
    o.max_new_tokens = static_cast<int>(parse_number("--max_new_tokens", values["--max_new_tokens"], 1, 1e9));
  if (values.count("--temperature"))
    o.temperature = static_cast<float>(parse_number("--temperature", values["--temperature"], 0, 100));
  if (values.count("--top_p")) o.top_p = static_cast<float>(parse_number("--top_p", values["--top_p"], 0, 1, true));
  if (values.count("--seed")) o.seed = parse_seed(values["--seed"]), o.seed_given = true;
  if (values.count("--stats_json")) o.stats_json = values["--stats_json"];
  if (values.count("--keep")) o.keep = static_cast<int>(parse_number("--keep", values["--keep"], 0, 1e9));
  if (values.count("--evict")) o.evict = static_cast<int>(parse_number("--evict", values["--evict"], 0, 1e9));
  if (!o.context_shift && (o.keep >= 0 || o.evict >= 0)) {
    throw RunnerError("--keep and --evict shape the context shift: drop them or --no_context_shift");
  }
  if (values.count("--prompt_lookup"))
    o.prompt_lookup = static_cast<int>(parse_number("--prompt_lookup", values["--prompt_lookup"], 0, 1e6));
  if (values.count("--lookahead")) o.lookahead = values["--lookahead"];
  if ((o.prompt_lookup >= 0 || !o.lookahead.empty()) && eval) {
    throw RunnerError("--prompt_lookup and --lookahead are for generating: drop them or --eval_text");
  }
  if (values.count("--threads")) o.threads = static_cast<int>(parse_number("--threads", values["--threads"], 1, 256));
  return o;
}

std::vector<int64_t> prompt_tokens(const Options& o, const Manifest& m, const Tokenizer* tokenizer) {
  if (!o.prompt_ids.empty() || (!o.has_prompt && o.prompt_file.empty())) {
    std::vector<int64_t> ids;
    std::stringstream in(o.prompt_ids);
    std::string item;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      const long long id = std::strtoll(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0')
        throw RunnerError("--prompt_ids must be comma-separated integers, got '" + item + "'");
      if (id < 0 || id >= m.vocab_size) {
        throw RunnerError("--prompt_ids holds " + item + ", outside the vocabulary 0.." +
                          std::to_string(m.vocab_size - 1));
      }
      ids.push_back(id);
    }
    if (ids.empty()) throw RunnerError("the prompt is empty");
    return ids;
  }
  std::string text = o.prompt;
  if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file, std::ios::binary);
    if (!in) throw RunnerError("cannot read --prompt_file " + o.prompt_file);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  if (text.empty()) throw RunnerError("the prompt is empty");
  if (!valid_utf8(text)) throw RunnerError("the prompt is not valid UTF-8");
  if (tokenizer == nullptr) throw RunnerError("this export has no tokenizer: use --prompt_ids");
  std::vector<int64_t> ids;
  if (m.bos_id >= 0) ids.push_back(m.bos_id);
  const std::vector<int64_t> body = tokenizer->encode(text, !o.special_as_text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

// This process's own high-water mark. getrusage's ru_maxrss would do, except that Linux carries
// the parent's peak across fork+exec, so a runner started by a big Python process reports that.
double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;
  }
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // KiB on Linux
}

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "emb+L0-L2", "L3-L5+head": what each shard holds, for the stats and the report.
std::vector<std::string> shard_layer_labels(const Manifest& manifest) {
  std::vector<std::string> labels;
  for (const auto& s : manifest.shards) {
    std::vector<std::string> parts;
    if (s.has_embedding) parts.push_back("emb");
    if (s.has_layers()) parts.push_back("L" + std::to_string(s.layer_first) + "-L" + std::to_string(s.layer_end - 1));
    if (s.has_head) parts.push_back("head");
    std::string label;
    for (const auto& part : parts) label += (label.empty() ? "" : "+") + part;
    labels.push_back(label);
  }
  return labels;
}

// A context binary compiled by one QNN version is refused, or misbehaves, under another's
// libraries: say so before loading, naming both (allow: a warning instead).
void check_qnn_build(const Manifest& manifest, bool allow) {
  const std::string runtime_build_id = qnn_runtime_build_id();
  if (runtime_build_id == manifest.qnn_build_id) return;
  const std::string what = "the QNN shards were compiled with QNN " + manifest.qnn_build_id +
                           " but this process loads QNN " + runtime_build_id;
  if (!allow) {
    throw RunnerError(what + ": load the libraries of " + manifest.qnn_build_id +
                      " or export again with these (--allow_qnn_mismatch tries anyway)");
  }
  std::cerr << "warning: " << what << "; context binaries may be rejected or behave differently\n";
}

// Facts of the run that do not depend on the generation, for the stats.
void describe_shards(const Manifest& manifest, RunInfo* info) {
  info->peak_rss_mb = peak_rss_mb();
  for (const auto& s : manifest.shards) info->shard_backends.push_back(s.backends.empty() ? "portable" : s.backends[0]);
  info->shard_layers = shard_layer_labels(manifest);
  info->memory = memory_figures(manifest);
#if defined(__x86_64__)
  // QNN shards on an x86 host run on Qualcomm's HTP simulator, whose timings say nothing about a phone.
  info->qnn_simulator = !manifest.qnn_build_id.empty();
#endif
}

void write_stats(const std::string& path, const nlohmann::json& stats) {
  if (path.empty()) return;
  std::ofstream out(path);
  if (!out) throw RunnerError("cannot write --stats_json " + path);
  out << stats.dump(1) << "\n";
}

// Streams the text of generated tokens to stdout.
class TextPrinter {
 public:
  TextPrinter(const Tokenizer* tokenizer, int64_t previous) : tokenizer_(tokenizer), previous_(previous) {}
  void operator()(int64_t token) {
    if (tokenizer_) std::cout << stream_.push(tokenizer_->token_bytes(token, previous_)) << std::flush;
    previous_ = token;
  }
  void finish() {
    if (tokenizer_) std::cout << stream_.finish();
    std::cout << std::endl;
  }

 private:
  const Tokenizer* tokenizer_;
  int64_t previous_;
  Utf8Stream stream_;
};

// --chat_template FILE: a "chat" entry as composite.chat_template writes it (JSON); this runner
// renders no Jinja.
ChatTemplate read_chat_template(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RunnerError("cannot read --chat_template " + path);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception&) {
    throw RunnerError("--chat_template " + path +
                      " is not JSON: composite_runner renders no Jinja; turn a template into its JSON with "
                      "python -m composite.chat_template TEMPLATE --artifacts DIR --output chat.json");
  }
  try {
    return parse_chat(doc, "--chat_template " + path);
  } catch (const nlohmann::json::exception& e) {
    throw RunnerError("--chat_template " + path + " is malformed: " + e.what());
  }
}

// --chat: one user turn per stdin line. The cache keeps the conversation, so each turn prefills
// only its own tokens; an answer ends at the end of the assistant's turn (any stop id).
void chat(const Options& o, const Manifest& manifest, const ChatTemplate& format, const Tokenizer& tokenizer,
          TokenChain& chain, const Limits& limits, Sampler& sampler, ContextShift* shift, Guesser* guesser,
          RunInfo& info) {
  const int width = manifest.methods.count("prefill") ? manifest.methods.at("prefill") : 1;
  const bool interactive = isatty(STDIN_FILENO);
  auto is_stop = [&](int64_t t) { return std::count(limits.eos_ids.begin(), limits.eos_ids.end(), t) > 0; };
  int pos = 0;                   // tokens in the cache
  std::vector<int64_t> carried;  // an answer's last token when it was cut short: sampled, not yet run
  nlohmann::json turns = nlohmann::json::array();
  Generation last;
  std::string line;
  while (true) {
    if (interactive) std::cerr << "> " << std::flush;
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // the line's end is not the message's
    if (trimmed(line).empty()) continue;
    std::vector<int64_t> turn = carried;
    const std::vector<int64_t> user = chat_turn_tokens(tokenizer, format, turns.empty(), o.system, line);
    turn.insert(turn.end(), user.begin(), user.end());
    if (shift && !shift->fits(turn.size())) {
      std::cerr << shift->too_long("this turn", turn.size()) << ": the chat ends here\n";
      break;
    }
    if (limits.seq_len && pos + static_cast<int>(turn.size()) >= limits.seq_len) {
      std::cerr << "the context is full (" << pos << " of " << limits.seq_len << " tokens used, this turn needs "
                << turn.size() << " more): the chat ends here\n";
      break;
    }
    TextPrinter printer(&tokenizer, turn.back());
    last = generate(chain, turn, width, manifest.vocab_size, limits, sampler, std::ref(printer), pos, shift, guesser);
    printer.finish();
    turns.push_back({{"start_pos", pos},
                     {"prompt", turn},
                     {"prompt_tokens", turn.size()},
                     {"tokens", last.tokens},
                     {"stop_reason", last.stop_reason},
                     {"prefill_tokens_per_s", last.prefill_tokens_per_s()},
                     {"decode_tokens_per_s", last.decode_tokens_per_s()}});
    pos = last.in_cache;
    carried.clear();
    if (!is_stop(last.tokens.back())) carried.push_back(last.tokens.back());
    if (last.stop_reason == "max_seq_len" || last.stop_reason == "seq_len") {
      std::cerr << "the context is full (" << limits.seq_len << " tokens): the chat ends here\n";
      break;
    }
  }
  describe_shards(manifest, &info);
  std::fprintf(stderr,
               "chat: %zu turns, %d tokens in the context; last turn prefill %.1f tok/s, decode %.1f tok/s, "
               "peak RSS %.0f MB\n",
               turns.size(), pos, last.prefill_tokens_per_s(), last.decode_tokens_per_s(), info.peak_rss_mb);
  nlohmann::json stats = stats_json(last, info);
  stats["turns"] = turns;
  stats["chat_context_shifts"] = shift ? shift->shifts() : 0;  // the whole chat's
  write_stats(o.stats_json, stats);
}

int run(int argc, char** argv) {
  const Options o = parse_options(argc, argv);
  if (o.verbose) setenv("COMPOSITE_LOG", "info", 1);
  const auto load_start = std::chrono::steady_clock::now();
  const Manifest manifest = load_manifest(o.artifacts);
  const bool has_qnn = !manifest.qnn_build_id.empty();
  // The QNN backend and libraries print their routine lines on every load and teardown; declared
  // before the chain, the filter outlives it.
  std::optional<RoutineStderrFilter> quiet_qnn;
  if (has_qnn && !o.verbose) quiet_qnn.emplace();
  check_files(manifest, o.verify);
  check_loadable_here(manifest);
  std::unique_ptr<Tokenizer> tokenizer;
  if (!manifest.tokenizer_file.empty())
    tokenizer = load_tokenizer(manifest.path_of(manifest.tokenizer_file), manifest.tokenizer_type);
  std::optional<ContextShift> shift;
  // Scored in chunks, a text never passes the context; streamed, it does.
  if (o.context_shift && (o.eval.text_path.empty() || o.eval.stream)) shift.emplace(manifest, o.keep, o.evict);
  const int default_seq_len = shift ? 0 : manifest.max_seq_len;
  Limits limits{o.max_new_tokens, o.seq_len ? o.seq_len : default_seq_len, manifest.max_seq_len, manifest.eos_ids};
  ContextShift* shifting = shift ? &*shift : nullptr;
  std::vector<int64_t> prompt;
  ChatTemplate chat_format = manifest.chat;
  if (!o.eval.text_path.empty()) {
    if (!tokenizer) throw RunnerError("this export has no tokenizer, so it cannot read a text");
  } else if (o.chat) {
    if (!tokenizer) throw RunnerError("--chat needs a tokenizer, and this export has none");
    if (!o.chat_template.empty()) {
      chat_format = read_chat_template(o.chat_template);
      if (std::find(limits.eos_ids.begin(), limits.eos_ids.end(), chat_format.end_of_turn_id) == limits.eos_ids.end())
        limits.eos_ids.push_back(chat_format.end_of_turn_id);
    } else if (!manifest.has_chat) {
      throw RunnerError(
          "this export records no chat template (its tokenizer has none): export with --chat-template FILE");
    }
    if (!o.system.empty() && !chat_format.has_system) {
      throw RunnerError("this model's chat template has no system role: drop --system");
    }
    check_limits(1, limits, shifting);
  } else {
    prompt = prompt_tokens(o, manifest, tokenizer.get());
    check_limits(prompt.size(), limits, shifting);
  }
  const std::unique_ptr<Guesser> guesser =
      make_guesser(o.prompt_lookup, o.lookahead, manifest.methods.count("verify") ? manifest.methods.at("verify") : 0,
                   o.temperature);
  if (has_qnn) check_qnn_build(manifest, o.allow_qnn_mismatch);
  RunInfo info;
  info.threads = configure_cpu_backend(o.threads);
  ShardChain chain(manifest);
  info.load_ms = since(load_start) * 1e3;

  info.seed = o.seed_given ? o.seed : std::random_device{}() * 4294967296ULL + std::random_device{}();
  if (o.temperature > 0 && !o.seed_given) {
    std::cerr << "seed " << info.seed << " (--seed " << info.seed << " repeats this run)\n";
  }
  Sampler sampler(o.temperature, o.top_p, info.seed);
  if (!o.eval.text_path.empty()) {
    nlohmann::json result =
        evaluate(chain, manifest, *tokenizer, manifest.path_of(manifest.tokenizer_file), o.eval, shifting);
    result["runner"] = "composite_runner";
    result["load_ms"] = info.load_ms;
    result["peak_rss_mb"] = peak_rss_mb();
    write_stats(o.stats_json, result);
    return 0;
  }
  if (o.chat) {
    chat(o, manifest, chat_format, *tokenizer, chain, limits, sampler, shifting, guesser.get(), info);
    return 0;
  }
  TextPrinter printer(tokenizer.get(), prompt.back());
  const int width = manifest.methods.count("prefill") ? manifest.methods.at("prefill") : 1;
  const Generation g = generate(chain, prompt, width, manifest.vocab_size, limits, sampler, std::ref(printer), 0,
                                shifting, guesser.get());
  printer.finish();
  if (g.stop_reason == "max_seq_len") std::cerr << "stopped: reached max_seq_len " << manifest.max_seq_len << "\n";

  describe_shards(manifest, &info);
  std::fprintf(stderr,
               "prompt %d tokens, generated %zu (%s); load %.1f ms, first token %.1f ms, prefill %.1f tok/s, decode "
               "%.1f tok/s%s, peak RSS %.0f MB\n",
               g.prompt_tokens, g.tokens.size(), g.stop_reason.c_str(), info.load_ms, g.prefill_seconds * 1e3,
               g.prefill_tokens_per_s(), g.decode_tokens_per_s(),
               guesser ? (" (" + std::to_string(g.tokens_per_call()).substr(0, 4) + " tokens per call)").c_str() : "",
               info.peak_rss_mb);
  write_stats(o.stats_json, stats_json(g, info));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const RunnerError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
