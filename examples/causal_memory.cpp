// causal_memory: a weather diary queried with a causal mask, the tag range [0, t - 1] over time stamps.
//
// Each day is stored once: key = that day's (pressure, humidity, wind), value = the rain that fell
// the next day, tag = the day number (1, 2, ...). Keys are compared by cosine. To forecast day t + 1 we ask "which past days looked like
// today?" and blend what followed them. Without a mask the query also sees day t itself and later
// days, whose values are the future: it "forecasts" by reading the answer (the leak a decoder's
// triangular attention mask prevents). With tag_range = [1, t - 1] it sees only the past.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

constexpr int kDays = 40;

// A deterministic weather: a slow pressure cycle; humidity and wind follow it with their own wobble.
// Rain the next day is high after low pressure and high humidity.
struct Day {
  std::vector<float> features;  // pressure, humidity, wind (roughly unit scale)
  float rain_next_day;          // mm
};

std::vector<Day> make_diary() {
  std::vector<Day> days;
  for (int t = 0; t < kDays; ++t) {
    const float pressure = std::cos(0.45f * static_cast<float>(t));
    const float humidity = -0.8f * pressure + 0.3f * std::sin(1.7f * static_cast<float>(t));
    const float wind = 0.5f * std::sin(0.9f * static_cast<float>(t) + 1.0f);
    const float next_pressure = std::cos(0.45f * static_cast<float>(t + 1));
    const float rain = std::max(0.0f, 6.0f * (0.2f - next_pressure) + 3.0f * humidity);
    days.push_back({{pressure, humidity, wind}, rain});
  }
  return days;
}

}  // namespace

int main() {
  const std::vector<Day> diary = make_diary();
  softkv::Collection memory({.dim = 3, .value_dim = 1, .metric = softkv::Metric::cosine});
  for (int t = 1; t <= kDays; ++t)  // entry id = tag = day number
    memory.upsert(static_cast<std::uint64_t>(t), diary[t - 1].features, std::vector<float>{diary[t - 1].rain_next_day},
                  /*tag=*/static_cast<std::uint64_t>(t));

  std::printf("softkv %s: a %d-day weather diary; key = (pressure, humidity, wind), value = rain the next day (mm),\n",
              softkv::kVersion, kDays);
  std::printf("tag = day number (1..%d). Forecast for day t+1: a soft query with day t's features (cosine, T = 0.05).\n\n", kDays);
  std::printf("%4s %8s | %-34s | %-34s\n", "day", "actual", "causal mask tag_range [1, t-1]", "no mask (sees the future)");
  std::printf("%4s %8s | %9s %24s | %9s %24s\n", "t", "rain", "forecast", "most attended day", "forecast", "most attended day");

  softkv::QueryOptions causal;
  causal.temperature = 0.05f;
  causal.top_m = 1;
  softkv::QueryOptions open = causal;
  double causal_error = 0, open_error = 0;
  int forecasts = 0;
  for (int t = 1; t <= kDays; ++t) {
    const Day& today = diary[t - 1];
    const softkv::SoftResult peek = memory.query_soft(today.features, open);
    causal.tag_range = softkv::TagRange{0, static_cast<std::uint64_t>(t) - 1};  // tags 1 .. t-1 (no day has tag 0)
    if (t == 1) {
      // Day 1 has no past: the mask keeps nothing, and the store says so with a typed error.
      try {
        (void)memory.query_soft(today.features, causal);
      } catch (const softkv::Error& e) {
        if (e.code() != softkv::ErrorCode::empty_collection) throw;
        std::printf("%4d %8.2f | %-34s | %9.2f %16s (w %.2f)\n", t, today.rain_next_day, "no past yet: empty_collection",
                    peek.value[0], ("day " + std::to_string(peek.top[0].id)).c_str(), peek.top[0].weight);
      }
      continue;
    }
    const softkv::SoftResult past = memory.query_soft(today.features, causal);
    causal_error += std::fabs(past.value[0] - today.rain_next_day);
    open_error += std::fabs(peek.value[0] - today.rain_next_day);
    ++forecasts;
    if (t % 3 == 2 || t == kDays)
      std::printf("%4d %8.2f | %9.2f %16s (w %.2f) | %9.2f %16s (w %.2f)\n", t, today.rain_next_day, past.value[0],
                  ("day " + std::to_string(past.top[0].id)).c_str(), past.top[0].weight, peek.value[0],
                  ("day " + std::to_string(peek.top[0].id)).c_str(), peek.top[0].weight);
  }
  std::printf("\nmean absolute error over days 2..%d: causal %.2f mm, unmasked %.2f mm\n", kDays, causal_error / forecasts,
              open_error / forecasts);
  std::printf("The unmasked query looks better only because it attends to day t itself, whose value is the\n"
              "rain that already fell on day t+1 (the 'no mask' column mostly names day t). The causal\n"
              "mask gives the honest forecast: only days before t take part in the softmax.\n");
  return 0;
}
