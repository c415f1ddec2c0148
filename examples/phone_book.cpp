// phone_book: search by a (misspelt) name, get back a phone number. The key is not the value.
//
// Keys are vectors of a name's character bigrams and trigrams hashed into 256 buckets (so similar spellings
// are close under cosine); values encode the phone number, one 10-way one-hot per digit. A hard
// lookup returns the number of the closest name; a soft lookup blends numbers by name similarity,
// and the blend shows, digit by digit, how sure the store is.
#include <cctype>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

constexpr std::size_t kBuckets = 256;  // key dimension
constexpr std::size_t kDigits = 10;    // phone number length
constexpr std::size_t kValueDim = kDigits * 10;

// FNV-1a: a fixed, portable hash so every run builds the same keys.
std::uint32_t fnv1a(const std::string& s) {
  std::uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h;
}

// Counts of the name's character bigrams and trigrams (lower-cased, padded with spaces), hashed into
// buckets; bigrams keep a swapped pair of letters ("Jonh") close to the original.
std::vector<float> name_key(const std::string& name) {
  std::string padded = "  ";
  for (char c : name) padded += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  padded += "  ";
  std::vector<float> key(kBuckets, 0.0f);
  for (std::size_t n : {2u, 3u})
    for (std::size_t i = 0; i + n <= padded.size(); ++i) key[fnv1a(padded.substr(i, n)) % kBuckets] += 1.0f;
  return key;
}

// Digit j of the number sets element 10 * j + digit: a value the store can blend.
std::vector<float> number_value(const std::string& number) {
  std::vector<float> v(kValueDim, 0.0f);
  for (std::size_t j = 0; j < kDigits; ++j) v[10 * j + static_cast<std::size_t>(number[j] - '0')] = 1.0f;
  return v;
}

// The most likely digit at each position, and how much of the weight it holds.
std::string decode(const std::vector<float>& v, float* min_confidence) {
  std::string number;
  *min_confidence = 1.0f;
  for (std::size_t j = 0; j < kDigits; ++j) {
    std::size_t best = 0;
    for (std::size_t digit = 1; digit < 10; ++digit)
      if (v[10 * j + digit] > v[10 * j + best]) best = digit;
    number += static_cast<char>('0' + best);
    *min_confidence = std::min(*min_confidence, v[10 * j + best]);
  }
  return number;
}

struct Person {
  const char* name;
  const char* number;
};

const std::vector<Person> kBook = {
    {"John Smith", "2025550143"},    {"Jon Smythe", "2025550178"},   {"Joan Smith", "3125550101"},
    {"Jane Doe", "4155550199"},      {"Johann Schmidt", "4930555012"}, {"Ada Lovelace", "4420555018"},
    {"Alan Turing", "4420555099"},   {"Grace Hopper", "7035550142"}, {"Edsger Dijkstra", "3120555077"},
    {"Barbara Liskov", "6175550123"}, {"Donald Knuth", "6505550111"}, {"Ken Thompson", "9085550164"},
};

}  // namespace

int main() {
  // Cosine: a name's length does not matter, only which trigrams it shares.
  softkv::Collection book({.dim = kBuckets, .value_dim = kValueDim, .metric = softkv::Metric::cosine});
  for (const Person& p : kBook) book.add(name_key(p.name), number_value(p.number));
  std::printf("phone book: %zu names; key = hashed 2- and 3-grams of the name (d = %zu), value = the number (dv = %zu)\n\n",
              kBook.size(), kBuckets, kValueDim);

  // Cosine scores lie in [-1, 1]; a scale (Hopfield's beta) of 12 makes a 0.1 similarity gap worth e^1.2.
  const softkv::QueryOptions soft{.scale = 12.0f, .top_m = 4};
  for (const char* typed : {"Jhon Smith", "Jonh Smiht", "joan smith", "Grace Hoper", "Dijkstra", "Jon Smith"}) {
    const softkv::HardResult hard = book.query_hard(name_key(typed), soft);  // score on the same scale
    const softkv::SoftResult r = book.query_soft(name_key(typed), soft);
    float confidence = 0;
    const std::string blended = decode(r.value, &confidence);
    std::printf("query \"%s\"\n", typed);
    std::printf("  hard: %-16s -> %s (cosine %.2f)\n", kBook[hard.id].name, kBook[hard.id].number, hard.score / 12.0f);
    std::printf("  soft: weights ");
    for (const softkv::Contributor& c : r.top) std::printf(" %s %.0f%%,", kBook[c.id].name, 100 * c.weight);
    std::printf("\n        blended number %s, least certain digit holds %.0f%% of the weight\n\n", blended.c_str(),
                100 * confidence);
  }
  std::printf("Hard lookup always answers with one stored number, even for \"Jon Smith\", which is about as close\n"
              "to two people. The soft answer shows the doubt: its digits are mixtures, the least certain digit\n"
              "holds only part of the weight, and where the candidates' numbers differ the blend can even read\n"
              "as a number nobody has. Use hard retrieval to look up; use the soft weights to know how sure to be.\n");
  return 0;
}
