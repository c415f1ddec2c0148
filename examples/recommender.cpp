// recommender: "what would this user like next?" as masked, multi-head attention over watch histories.
//
// Every film has an embedding per aspect: genre (head 0) and era (head 1), 4 numbers each, so a key is
// [genre | era] (d = 8, heads = 2) and so is its value. Three users' histories live in ONE collection,
// each watch tagged with the user's id. A query is the film the user just watched: head 0 attends to
// past films of a similar genre, head 1 to films of a similar era, each with its own softmax. The mask
// tags_any = {user} makes the query attend to that user's history only (exclude_ids leaves out the
// watch being asked about); the blended value (a taste profile, per aspect) then ranks the catalogue.
// The unmasked query mixes in other users' tastes.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

enum Genre { scifi, comedy, drama, horror };
enum Era { fifties, seventies, nineties, twenties };

struct Film {
  const char* title;
  Genre genre;
  Era era;
};

const std::vector<Film> kCatalogue = {
    {"Forbidden Planet", scifi, fifties},     {"Alien", scifi, seventies},          {"The Matrix", scifi, nineties},
    {"Arrival", scifi, twenties},             {"Some Like It Hot", comedy, fifties}, {"Annie Hall", comedy, seventies},
    {"Groundhog Day", comedy, nineties},      {"The Menu", comedy, twenties},        {"12 Angry Men", drama, fifties},
    {"The Godfather", drama, seventies},      {"Fargo", drama, nineties},            {"Past Lives", drama, twenties},
    {"The Fly (1958)", horror, fifties},      {"Halloween", horror, seventies},      {"Scream", horror, nineties},
    {"Hereditary", horror, twenties},         {"Solaris (1972)", scifi, seventies},  {"Young Frankenstein", comedy, seventies},
    {"Gattaca", scifi, nineties},             {"Dune (2021)", scifi, twenties},      {"Them!", scifi, fifties},
};

const char* kGenres[] = {"sci-fi", "comedy", "drama", "horror"};
const char* kEras[] = {"1950s", "1970s", "1990s", "2020s"};

// [genre one-hot | era one-hot], slightly blurred so neighbouring eras are alike.
std::vector<float> embedding(const Film& f) {
  std::vector<float> e(8, 0.0f);
  e[f.genre] = 1.0f;
  for (int k = 0; k < 4; ++k) e[4 + k] = k == f.era ? 1.0f : (k == f.era - 1 || k == f.era + 1) ? 0.3f : 0.0f;
  return e;
}

std::size_t index_of(const char* title) {
  for (std::size_t i = 0; i < kCatalogue.size(); ++i)
    if (std::string(kCatalogue[i].title) == title) return i;
  return 0;
}

}  // namespace

int main() {
  softkv::CollectionConfig config{8, 8};
  config.heads = 2;  // head 0: genre slice, head 1: era slice
  config.scale = 4.0f;  // sharp enough that each head prefers close matches
  softkv::Collection histories(config);

  // Three users, one collection: every watch tagged with its user.
  struct User {
    std::uint64_t id;
    const char* name;
    std::vector<const char*> watched;
  };
  const std::vector<User> users = {
      {1, "Ada (sci-fi, any era)", {"Forbidden Planet", "Alien", "The Matrix", "Solaris (1972)", "Arrival"}},
      {2, "Bo (the 1970s)", {"Annie Hall", "The Godfather", "Halloween", "Young Frankenstein", "Alien"}},
      {3, "Cy (comedy and horror, recent)", {"The Menu", "Hereditary", "Scream", "Groundhog Day"}},
  };
  std::vector<std::size_t> film_of_entry;  // entry id -> catalogue index
  std::vector<std::uint64_t> last_entry;   // per user: the entry of the latest watch
  for (const User& u : users)
    for (const char* title : u.watched) {
      const std::size_t f = index_of(title);
      const std::vector<float> e = embedding(kCatalogue[f]);
      const std::uint64_t id = histories.add(e, e, u.id);
      if (film_of_entry.size() <= id) film_of_entry.resize(id + 1);
      film_of_entry[id] = f;
      if (title == u.watched.back()) last_entry.push_back(id);
    }
  // The catalogue, to rank films by a taste profile (single head: genre and era together).
  softkv::Collection catalogue(softkv::CollectionConfig{8, 1});
  for (const Film& f : kCatalogue) catalogue.add(embedding(f), std::vector<float>{0.0f});

  auto title = [&](std::uint64_t entry) { return kCatalogue[film_of_entry[entry]].title; };
  auto show_heads = [&](const softkv::SoftResult& r) {
    for (std::size_t j = 0; j < r.heads.size(); ++j) {
      std::printf("      head %zu (%s) attended to:", j, j == 0 ? "genre" : "era");
      for (const softkv::Contributor& c : r.heads[j].top) std::printf("  %s %.0f%%", title(c.id), 100.0 * c.weight);
      std::printf("\n");
    }
  };
  auto recommend = [&](const std::vector<float>& profile, const std::vector<const char*>& seen) {
    softkv::QueryOptions o;
    o.top_m = kCatalogue.size();
    o.scale = 4.0f;
    std::printf("      next:");
    int shown = 0;
    for (const softkv::Contributor& c : catalogue.query_soft(profile, o).top) {
      bool watched = false;
      for (const char* s : seen) watched = watched || std::string(s) == kCatalogue[c.id].title;
      if (watched || shown == 3) continue;
      std::printf("  %s (%s, %s)", kCatalogue[c.id].title, kGenres[kCatalogue[c.id].genre], kEras[kCatalogue[c.id].era]);
      ++shown;
    }
    std::printf("\n");
  };

  std::printf("One collection, %zu watches of %zu users, d = 8 split into 2 heads (genre | era).\n", histories.size(), users.size());
  for (std::size_t n = 0; n < users.size(); ++n) {
    const User& u = users[n];
    const Film& last = kCatalogue[index_of(u.watched.back())];
    const std::vector<float> q = embedding(last);
    std::printf("\n%s just watched %s (%s, %s):\n", u.name, last.title, kGenres[last.genre], kEras[last.era]);
    softkv::QueryOptions mine;
    mine.top_m = 2;
    mine.tags_any = {u.id};              // attend to this user's history only
    mine.exclude_ids = {last_entry[n]};  // ... before the film being asked about
    const softkv::SoftResult r = histories.query_soft(q, mine);
    std::printf("  masked to the user's %zu earlier watches:\n", r.candidates);
    show_heads(r);
    recommend(r.value, u.watched);
    softkv::QueryOptions everyone;
    everyone.top_m = 2;
    everyone.exclude_ids = {last_entry[n]};
    const softkv::SoftResult all = histories.query_soft(q, everyone);
    std::printf("  unmasked (%zu watches of every user):\n", all.candidates);
    show_heads(all);
    recommend(all.value, u.watched);
    const softkv::HardResult hard = histories.query_hard(q, mine);
    std::printf("  hard answer (one past film per head): genre -> %s, era -> %s\n", title(hard.head_ids[0]), title(hard.head_ids[1]));
  }
  std::printf("\nEach head keeps its own softmax: the genre head can follow a user's genre across eras while the\n"
              "era head follows the decade; the mask keeps other users' tastes out of the profile.\n");
  return 0;
}
