#include "speculate.h"

#include <algorithm>
#include <sstream>

#include "error.h"

namespace composite {

std::vector<int> Tree::depths() const {
  std::vector<int> depths;
  for (int parent : parents) depths.push_back(parent < 0 ? 0 : depths[parent] + 1);
  return depths;
}

int Tree::max_depth() const {
  const std::vector<int> d = depths();
  return d.empty() ? 0 : *std::max_element(d.begin(), d.end());
}

Tree Tree::cut(int max_depth) const {
  const std::vector<int> d = depths();
  std::vector<int> new_index(tokens.size(), -1);
  Tree kept;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (d[i] > max_depth) continue;
    new_index[i] = static_cast<int>(kept.tokens.size());
    kept.tokens.push_back(tokens[i]);
    kept.parents.push_back(parents[i] < 0 ? -1 : new_index[parents[i]]);
  }
  return kept;
}

void accepted_path(const Tree& tree, const std::vector<int64_t>& choices, std::vector<int>* path,
                   std::vector<int64_t>* ahead) {
  path->assign(1, 0);
  ahead->clear();
  int row = 0;
  while (true) {
    int next = -1;
    for (size_t child = row + 1; child < tree.tokens.size(); ++child) {  // the first such child, as in Python
      if (tree.parents[child] == row && tree.tokens[child] == choices[row]) {
        next = static_cast<int>(child);
        break;
      }
    }
    if (next < 0) break;
    path->push_back(next);
    ahead->push_back(tree.tokens[next]);
    row = next;
  }
  ahead->push_back(choices[row]);
}

std::vector<int64_t>& Guesser::begin(const std::vector<int64_t>& prompt, int start_pos) {
  if (start_pos == 0) history_.clear();
  history_.insert(history_.end(), prompt.begin(), prompt.end());
  return history_;
}

bool PromptLookup::tree(const std::vector<int64_t>& history, Tree* out) {
  const int end = static_cast<int>(history.size());
  for (int n = std::min(ngram_, end - 1); n >= 1; --n) {
    for (int start = end - n - 1; start >= 0; --start) {  // most recent first; the tail itself excluded
      if (!std::equal(history.begin() + start, history.begin() + start + n, history.end() - n)) continue;
      const int stop = std::min(end, start + n + width_ - 1);
      out->tokens.assign(1, history.back());
      out->parents.assign(1, -1);
      for (int i = start + n; i < stop; ++i) {
        out->parents.push_back(static_cast<int>(out->tokens.size()) - 1);
        out->tokens.push_back(history[i]);
      }
      return true;
    }
  }
  return false;
}

std::vector<int64_t>& Lookahead::begin(const std::vector<int64_t>& prompt, int start_pos) {
  if (start_pos == 0) {
    pool_.clear();
    pooled_ = 0;
  }
  std::vector<int64_t>& history = Guesser::begin(prompt, start_pos);
  const size_t count = static_cast<size_t>(ngram_ - 1) * window_;
  std::vector<int64_t> source;
  for (size_t i = 0; i < count; ++i) {
    source.push_back(history.size() >= count ? history[history.size() - count + i] : history[i % history.size()]);
  }
  levels_.clear();
  for (int l = 0; l < ngram_ - 1; ++l)
    levels_.emplace_back(source.begin() + l * window_, source.begin() + (l + 1) * window_);
  return history;
}

void Lookahead::pool(const std::vector<int64_t>& gram) {
  std::vector<std::vector<int64_t>>& known = pool_[gram[0]];
  const std::vector<int64_t> continuation(gram.begin() + 1, gram.end());
  known.erase(std::remove(known.begin(), known.end(), continuation), known.end());
  known.push_back(continuation);  // most recent last
  const size_t cap = std::max(1, candidates_);
  if (known.size() > cap) known.erase(known.begin(), known.end() - cap);
}

bool Lookahead::tree(const std::vector<int64_t>& history, Tree* out) {
  for (size_t end = std::max(pooled_, static_cast<size_t>(ngram_)); end <= history.size(); ++end) {
    pool(std::vector<int64_t>(history.begin() + (end - ngram_), history.begin() + end));  // the text's own n-grams
  }
  pooled_ = history.size() + 1;
  out->tokens.assign(1, history.back());
  out->parents.assign(1, -1);
  std::vector<int> below(window_, 0);  // the row under each column so far
  for (size_t l = 0; l < levels_.size(); ++l) {
    for (int j = 0; j < window_; ++j) {
      const int row = static_cast<int>(out->tokens.size());
      out->parents.push_back(l == 0 ? (j == 0 ? 0 : row - 1) : below[j]);
      out->tokens.push_back(levels_[l][j]);
      below[j] = row;
    }
  }
  auto found = pool_.find(history.back());
  if (found != pool_.end() && candidates_ > 0) {
    const auto& known = found->second;
    const size_t first = known.size() > static_cast<size_t>(candidates_) ? known.size() - candidates_ : 0;
    for (size_t c = known.size(); c-- > first;) {  // the most recent first
      int parent = 0;
      for (int64_t token : known[c]) {
        out->parents.push_back(parent);
        parent = static_cast<int>(out->tokens.size());
        out->tokens.push_back(token);
      }
    }
  }
  return true;
}

void Lookahead::learn(const Tree& tree, const std::vector<int64_t>& choices) {
  if (tree.tokens.size() < static_cast<size_t>(1 + (ngram_ - 1) * window_)) return;  // the window was cut
  const size_t top = 1 + static_cast<size_t>(ngram_ - 2) * window_;                  // the top level's first row
  const std::vector<int64_t> predicted(choices.begin() + top, choices.begin() + top + window_);
  for (int j = 0; j < window_; ++j) {
    std::vector<int64_t> gram;
    for (const auto& level : levels_) gram.push_back(level[j]);
    gram.push_back(predicted[j]);
    pool(gram);
  }
  levels_.erase(levels_.begin());
  levels_.push_back(predicted);
}

std::unique_ptr<Guesser> make_guesser(int prompt_lookup, const std::string& lookahead, int verify_width,
                                      float temperature) {
  if (prompt_lookup < 0 && lookahead.empty()) return nullptr;
  const std::string flag = prompt_lookup >= 0 ? "--prompt_lookup" : "--lookahead";
  if (prompt_lookup >= 0 && !lookahead.empty())
    throw RunnerError("--prompt_lookup and --lookahead are two ways of guessing: give one");
  if (verify_width == 0) {
    throw RunnerError(flag +
                      " needs an export with a verify method (this one has none): re-export with --verify-len 8");
  }
  if (temperature > 0)
    throw RunnerError(flag + " decodes greedily (the same tokens as plain greedy decode): drop --temperature");
  if (prompt_lookup >= 0) {
    if (prompt_lookup < 1)
      throw RunnerError("--prompt_lookup takes the longest n-gram to match, >= 1, got " +
                        std::to_string(prompt_lookup));
    return std::make_unique<PromptLookup>(prompt_lookup, verify_width);
  }
  int sizes[3];
  std::stringstream in(lookahead);
  std::string item;
  int count = 0;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || count == 3 || value < -1000000 || value > 1000000) {
      count = -1;
      break;
    }
    sizes[count++] = static_cast<int>(value);
  }
  if (count != 3) throw RunnerError("--lookahead takes WINDOW,NGRAM,CANDIDATES (e.g. 2,3,1), got '" + lookahead + "'");
  const int window = sizes[0], ngram = sizes[1], candidates = sizes[2];
  if (window < 1 || ngram < 2 || candidates < 0) {
    throw RunnerError("--lookahead WINDOW,NGRAM,CANDIDATES needs WINDOW >= 1, NGRAM >= 2 and CANDIDATES >= 0, got " +
                      lookahead);
  }
  auto guesser = std::make_unique<Lookahead>(window, ngram, candidates);
  if (guesser->rows() > verify_width) {
    throw RunnerError("--lookahead " + lookahead + " needs " + std::to_string(guesser->rows()) +
                      " rows per call (1 + (NGRAM-1) x (WINDOW+CANDIDATES)) but this export's verify method takes " +
                      std::to_string(verify_width));
  }
  return guesser;
}

}  // namespace composite
