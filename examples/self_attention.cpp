// self_attention: one sentence attends to itself through a softkv collection.
//
// Each word has a word vector of 8 readable features. Fixed projections turn it into a query
// ("what I look for"), a key ("what I offer") and a value ("what I pass on"). The keys and values
// go into the store; every word then queries it. The weights are a self-attention matrix, and
// because a word's query differs from its key, attention is not symmetric.
#include <cstdio>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

constexpr std::size_t kF = 8;  // features
const char* const kFeature[kF] = {"thing", "animal", "human", "name", "female", "state", "action", "modifier"};
enum Feature { thing, animal, human, name, female, state, action, modifier };

struct Word {
  const char* text;
  std::vector<float> x;  // word vector over the features above
};

const std::vector<Word> kSentence = {
    {"Evan's", {1, 0, 1, 1, 0, 0, 0, 0}}, {"dog", {1, 1, 0, 0, 0, 0, 0, 0}},     {"Riley", {1, 0, 0, 1, 1, 0, 0, 0}},
    {"is", {0, 0, 0, 0, 0, 0, 0.5f, 1}},  {"so", {0, 0, 0, 0, 0, 0, 0, 1}},       {"hyper,", {0, 0, 0, 0, 0, 1, 0, 0}},
    {"she", {1, 0, 0, 0, 1, 0, 0, 0.5f}}, {"never", {0, 0, 0, 0, 0, 0, 0, 1}},    {"stops", {0, 0, 0, 0, 0, 0, 1, 0}},
    {"moving", {0, 0, 0, 0, 0, 0, 1, 0}},
};

// W_q[f] = the features a word with feature f looks for (rows: what I am, columns: what I seek).
std::vector<std::vector<float>> query_projection() {
  std::vector<std::vector<float>> w(kF, std::vector<float>(kF, 0.0f));
  w[thing][state] = 0.5f, w[thing][action] = 0.5f;  // a thing looks for what it is like and what it does
  w[animal][name] = 1, w[animal][human] = 1;         // an animal looks for its name and its owner
  w[human][animal] = 1;                              // a person looks for their pet
  w[name][animal] = 3;                               // a name looks for what it names
  w[female][name] = 1, w[female][female] = 1;        // "she" looks for a female name
  w[state][thing] = 0.5f, w[state][animal] = 1;      // "hyper" looks for who is hyper
  w[action][thing] = 0.5f, w[action][female] = 1;    // a verb looks for its subject
  w[modifier][state] = 1, w[modifier][action] = 1;   // "so", "never" look for what they modify
  return w;
}

// x . W: the query of a word vector.
std::vector<float> project(const std::vector<float>& x, const std::vector<std::vector<float>>& w) {
  std::vector<float> out(kF, 0.0f);
  for (std::size_t i = 0; i < kF; ++i)
    for (std::size_t j = 0; j < kF; ++j) out[j] += x[i] * w[i][j];
  return out;
}

}  // namespace

int main() {
  const auto wq = query_projection();
  // Keys and values are the word vectors themselves (W_k = W_v = identity), so every number below
  // can be read as features; the asymmetry comes from W_q != W_k.
  softkv::Collection memory({.dim = kF, .value_dim = kF});
  for (std::size_t i = 0; i < kSentence.size(); ++i) memory.upsert(i, kSentence[i].x, kSentence[i].x);

  const softkv::QueryOptions options{.temperature = 0.25f, .top_m = kSentence.size()};
  const std::size_t n = kSentence.size();
  std::vector<std::vector<float>> attention(n, std::vector<float>(n, 0.0f));
  std::vector<std::vector<float>> output(n);
  for (std::size_t i = 0; i < n; ++i) {
    const softkv::SoftResult r = memory.query_soft(project(kSentence[i].x, wq), options);
    for (const softkv::Contributor& c : r.top) attention[i][c.id] = c.weight;
    output[i] = r.value;
  }

  std::printf("\"Evan's dog Riley is so hyper, she never stops moving\"\n");
  std::printf("attention weights (%%), row = the word asking (query), column = the word answering (key), T = 0.25\n\n%8s", "");
  for (const Word& w : kSentence) std::printf("%7.6s", w.text);
  std::printf("\n");
  for (std::size_t i = 0; i < n; ++i) {
    std::printf("%8s", kSentence[i].text);
    for (std::size_t j = 0; j < n; ++j) std::printf("%7.0f", 100 * attention[i][j]);
    std::printf("\n");
  }

  std::printf("\nwho attends to whom (besides itself):\n");
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t best = i == 0 ? 1 : 0;
    for (std::size_t j = 0; j < n; ++j)
      if (j != i && attention[i][j] > attention[i][best]) best = j;
    std::printf("  %-7s -> %-7s %3.0f%%\n", kSentence[i].text, kSentence[best].text, 100 * attention[i][best]);
  }

  const std::size_t dog = 1, riley = 2, she = 6;
  std::printf("\nattention is asymmetric: Riley -> dog %.0f%%, dog -> Riley %.0f%%\n", 100 * attention[riley][dog],
              100 * attention[dog][riley]);
  std::printf("  Riley is a name, and a name's query looks for what it names: the dog. The dog's query looks for\n"
              "  its owner first (Evan's) and its name second. The score of i -> j is q_i . k_j, of j -> i is\n"
              "  q_j . k_i, and they differ because the query projection differs from the key projection.\n");
  std::printf("\nwhat \"she\" passes on after attention (its output, a blend of values):\n ");
  for (std::size_t f = 0; f < kF; ++f) std::printf(" %s %.2f", kFeature[f], output[she][f]);
  std::printf("\n  -> \"she\" gives Riley %.0f%% of its attention, so its output now carries Riley's name and female features.\n",
              100 * attention[she][riley]);
  return 0;
}
