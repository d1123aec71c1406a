// Several tokens per call, greedy and lossless: guesses checked by the verify method.
// composite/runtime/speculate.py explains the scheme; this is its twin, building the same trees,
// so both runners make the same calls.
//
// A verify call holds a tree: row 0 is the token to decode (the root), every other row a guess
// at the position after its parent, seeing only its ancestors and the cache. A guess is accepted
// while it is the greedy choice of its parent's row; the last accepted row's choice is one more
// token. Only the accepted path's cache entries are kept.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace composite {

struct Tree {
  std::vector<int64_t> tokens;
  std::vector<int> parents;  // parents[i] < i; -1 for the root

  std::vector<int> depths() const;
  int max_depth() const;
  // The rows no deeper than max_depth.
  Tree cut(int max_depth) const;
};

// choices[i]: row i's greedy token. Fills the accepted path's rows (root first) and the tokens it
// yields (each accepted guess, then the last row's choice).
void accepted_path(const Tree& tree, const std::vector<int64_t>& choices, std::vector<int>* path,
                   std::vector<int64_t>* ahead);

class Guesser {
 public:
  virtual ~Guesser() = default;
  // A generation's start: its prompt, after what the cache holds (start_pos > 0 continues the
  // same text, a chat's later turn). Returns the history the runner appends generated tokens to.
  virtual std::vector<int64_t>& begin(const std::vector<int64_t>& prompt, int start_pos);
  // The next call's tree, its root the history's last token; false when there is nothing to guess.
  virtual bool tree(const std::vector<int64_t>& history, Tree* out) = 0;
  // What the call's choices teach (lookahead's window).
  virtual void learn(const Tree& tree, const std::vector<int64_t>& choices) { (void)tree, (void)choices; }

 protected:
  std::vector<int64_t> history_;
};

// The tokens after the most recent earlier occurrence of the history's last n tokens
// (n = ngram .. 1), up to width - 1 of them.
class PromptLookup : public Guesser {
 public:
  PromptLookup(int ngram, int width) : ngram_(ngram), width_(width) {}
  bool tree(const std::vector<int64_t>& history, Tree* out) override;

 private:
  int ngram_, width_;
};

// Jacobi lookahead: ngram-1 levels of `window` guesses, each call's top-level predictions
// finishing n-grams for the pool (with the text's own n-grams); up to `candidates` pooled
// continuations of the root, the most recent first, checked in the same call.
class Lookahead : public Guesser {
 public:
  Lookahead(int window, int ngram, int candidates) : window_(window), ngram_(ngram), candidates_(candidates) {}
  int rows() const { return 1 + (ngram_ - 1) * (window_ + candidates_); }
  std::vector<int64_t>& begin(const std::vector<int64_t>& prompt, int start_pos) override;
  bool tree(const std::vector<int64_t>& history, Tree* out) override;
  void learn(const Tree& tree, const std::vector<int64_t>& choices) override;

 private:
  void pool(const std::vector<int64_t>& gram);
  int window_, ngram_, candidates_;
  std::vector<std::vector<int64_t>> levels_;
  std::map<int64_t, std::vector<std::vector<int64_t>>> pool_;  // first token -> continuations, most recent last
  size_t pooled_ = 0;
};

// The guesser --prompt_lookup N or --lookahead W,N,G asks for (prompt_lookup -1 and lookahead
// empty: none, plain decode).
// Throws RunnerError, naming the problem, where the export (verify_width 0: no verify method) or
// the other flags cannot give one.
std::unique_ptr<Guesser> make_guesser(int prompt_lookup, const std::string& lookahead, int verify_width,
                                      float temperature);

// The default --lookahead: window, n-gram size, candidates (7 rows, within the default verify width 8).
constexpr const char* kDefaultLookahead = "2,3,1";

}  // namespace composite
