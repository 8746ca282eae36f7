// The agent's metrics in Prometheus' text format 0.0.4, compared line by line.
#include <gtest/gtest.h>

#include <chrono>
#include <sstream>
#include <string>
#include <vector>

#include "agent/metrics.h"

namespace gpusnap::agent {
namespace {

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool has_line(const std::string& text, const std::string& line) {
  for (const auto& l : lines(text)) {
    if (l == line) return true;
  }
  return false;
}

TEST(Metrics, EveryKindStartsAtZero) {
  Metrics m;
  const auto text = m.render();
  for (const char* line : {
           "# TYPE gpusnap_operations_total counter",
           "gpusnap_operations_total{kind=\"checkpoint\",result=\"failed\"} 0",
           "gpusnap_operations_total{kind=\"checkpoint\",result=\"succeeded\"} 0",
           "gpusnap_operations_total{kind=\"restore\",result=\"succeeded\"} 0",
           "# TYPE gpusnap_operations_in_flight gauge",
           "gpusnap_operations_in_flight{kind=\"restore\"} 0",
           "# TYPE gpusnap_operations_pending gauge",
           "gpusnap_operations_pending{lane=\"gpu\"} 0",
           "gpusnap_operations_pending{lane=\"prefetch\"} 0",
           "gpusnap_operations_total{kind=\"prefetch\",result=\"failed\"} 0",
           "gpusnap_artifact_bytes_total{kind=\"prefetch\"} 0",
           "# TYPE gpusnap_operation_duration_seconds histogram",
           "gpusnap_operation_duration_seconds_bucket{kind=\"checkpoint\",le=\"+Inf\"} 0",
           "gpusnap_operation_duration_seconds_count{kind=\"checkpoint\"} 0",
           "# TYPE gpusnap_phase_duration_seconds histogram",
           "gpusnap_artifact_bytes_total{kind=\"checkpoint\"} 0",
           "# TYPE gpusnap_operation_failures_total counter",
       }) {
    EXPECT_TRUE(has_line(text, line)) << line << "\nin:\n" << text;
  }
  EXPECT_EQ(text.back(), '\n');
}

TEST(Metrics, CountsOperationsPhasesBytesAndFailures) {
  Metrics m;
  m.started("checkpoint");
  EXPECT_TRUE(has_line(m.render(), "gpusnap_operations_in_flight{kind=\"checkpoint\"} 1"));
  m.pending("prefetch", 3);
  EXPECT_TRUE(has_line(m.render(), "gpusnap_operations_pending{lane=\"prefetch\"} 3"));
  m.phase("checkpoint", "dump", 0.3);
  m.phase("checkpoint", "dump", 2);
  m.finished("checkpoint", "succeeded", 3, "", 1000);
  m.started("restore");
  m.finished("restore", "failed", 0.2, "not-found", 0);
  m.failed_without_running("checkpoint", "internal");
  const auto text = m.render();
  for (const char* line : {
           "gpusnap_operations_total{kind=\"checkpoint\",result=\"succeeded\"} 1",
           "gpusnap_operations_total{kind=\"checkpoint\",result=\"failed\"} 1",
           "gpusnap_operations_total{kind=\"restore\",result=\"failed\"} 1",
           "gpusnap_operations_in_flight{kind=\"checkpoint\"} 0",
           "gpusnap_operation_duration_seconds_bucket{kind=\"checkpoint\",le=\"2.5\"} 0",
           "gpusnap_operation_duration_seconds_bucket{kind=\"checkpoint\",le=\"5\"} 1",
           "gpusnap_operation_duration_seconds_bucket{kind=\"checkpoint\",le=\"+Inf\"} 1",
           "gpusnap_operation_duration_seconds_sum{kind=\"checkpoint\"} 3",
           "gpusnap_operation_duration_seconds_count{kind=\"checkpoint\"} 1",
           "gpusnap_operation_duration_seconds_bucket{kind=\"restore\",le=\"0.1\"} 0",
           "gpusnap_operation_duration_seconds_bucket{kind=\"restore\",le=\"0.25\"} 1",
           "gpusnap_phase_duration_seconds_bucket{kind=\"checkpoint\",phase=\"dump\",le=\"0.25\"} "
           "0",
           "gpusnap_phase_duration_seconds_bucket{kind=\"checkpoint\",phase=\"dump\",le=\"0.5\"} 1",
           "gpusnap_phase_duration_seconds_bucket{kind=\"checkpoint\",phase=\"dump\",le=\"2.5\"} 2",
           "gpusnap_phase_duration_seconds_sum{kind=\"checkpoint\",phase=\"dump\"} 2.3",
           "gpusnap_phase_duration_seconds_count{kind=\"checkpoint\",phase=\"dump\"} 2",
           "gpusnap_artifact_bytes_total{kind=\"checkpoint\"} 1000",
           "gpusnap_operation_failures_total{kind=\"restore\",error_kind=\"not-found\"} 1",
           "gpusnap_operation_failures_total{kind=\"checkpoint\",error_kind=\"internal\"} 1",
       }) {
    EXPECT_TRUE(has_line(text, line)) << line << "\nin:\n" << text;
  }
}

TEST(Metrics, LastSuccessPerKindOnlyOnceOneSucceeded) {
  Metrics m;
  EXPECT_EQ(m.render().find("gpusnap_last_success_timestamp_seconds{"), std::string::npos);
  m.started("restore");
  m.finished("restore", "failed", 1, "not-found", 0);
  EXPECT_EQ(m.render().find("gpusnap_last_success_timestamp_seconds{"), std::string::npos);
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const double before = now();
  m.started("checkpoint");
  m.finished("checkpoint", "succeeded", 1, "", 0);
  const double after = now();
  const auto text = m.render();
  const std::string series = "gpusnap_last_success_timestamp_seconds{kind=\"checkpoint\"} ";
  const auto at = text.find(series);
  ASSERT_NE(at, std::string::npos) << text;
  const double value = std::stod(text.substr(at + series.size()));
  EXPECT_GE(value, before - 0.001);
  EXPECT_LE(value, after + 0.001);
  EXPECT_EQ(text.find("gpusnap_last_success_timestamp_seconds{kind=\"restore\"}"),
            std::string::npos);
}

TEST(Metrics, RegistryFamiliesOnlyWithRegistryStorage) {
  EXPECT_EQ(Metrics().render().find("gpusnap_registry_"), std::string::npos);
  EXPECT_EQ(Metrics().render().find("gpusnap_node_cache_"), std::string::npos);
  Metrics m(/*registry_storage=*/true);
  // At zero from the start, each direction: rate() sees the first push and the first pull.
  for (const char* line : {
           "# TYPE gpusnap_registry_bytes_total counter",
           "gpusnap_registry_bytes_total{direction=\"pull\"} 0",
           "gpusnap_registry_bytes_total{direction=\"push\"} 0",
           "# TYPE gpusnap_registry_chunks_total counter",
           "gpusnap_registry_chunks_total{direction=\"pull\"} 0",
           "gpusnap_registry_chunks_total{direction=\"push\"} 0",
           "# TYPE gpusnap_node_cache_hits_total counter",
           "gpusnap_node_cache_hits_total 0",
           "# TYPE gpusnap_node_cache_misses_total counter",
           "gpusnap_node_cache_misses_total 0",
           "gpusnap_node_cache_hit_bytes_total 0",
           "gpusnap_node_cache_evictions_total 0",
       }) {
    EXPECT_TRUE(has_line(m.render(), line)) << line << "\nin:\n" << m.render();
  }
}

// The registry families are what the transfers counted as they moved chunks (store::push and
// store::pull add to Metrics::transfers(); AgentsAndRegistry.* check that against real pulls);
// the node cache's hits add up over the pulls that ended.
TEST(Metrics, RegistryFamiliesAreWhatTransfersCountedAndHitsAddUp) {
  Metrics m(/*registry_storage=*/true);
  store::TransferCounters& moved = *m.transfers();
  moved.chunks_uploaded += 4;
  moved.bytes_uploaded += 3010;
  moved.chunks_fetched += 6;
  moved.bytes_fetched += 507;
  m.pulled({.chunks_found = 0, .bytes_found = 0});
  m.pulled({.chunks_found = 4, .bytes_found = 400, .evicted = 2});
  const auto text = m.render();
  for (const char* line : {
           "gpusnap_registry_bytes_total{direction=\"push\"} 3010",
           "gpusnap_registry_chunks_total{direction=\"push\"} 4",
           "gpusnap_registry_bytes_total{direction=\"pull\"} 507",
           "gpusnap_registry_chunks_total{direction=\"pull\"} 6",
           "gpusnap_node_cache_misses_total 6",
           "gpusnap_node_cache_hits_total 4",
           "gpusnap_node_cache_hit_bytes_total 400",
           "gpusnap_node_cache_evictions_total 2",
       }) {
    EXPECT_TRUE(has_line(text, line)) << line << "\nin:\n" << text;
  }
}

TEST(Metrics, EveryLineIsACommentOrASample) {
  Metrics m(/*registry_storage=*/true);
  m.phase("restore", "criu-restore", 1);
  for (const auto& l : lines(m.render())) {
    if (l.rfind("# HELP ", 0) == 0 || l.rfind("# TYPE ", 0) == 0) continue;
    // NAME{LABELS} VALUE, or NAME VALUE: exactly one space, before the value.
    ASSERT_EQ(std::count(l.begin(), l.end(), ' '), 1) << l;
    EXPECT_EQ(l.rfind("gpusnap_", 0), 0u) << l;
  }
}

TEST(Metrics, LabelValuesAreEscaped) {
  EXPECT_EQ(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(escape_label("dump"), "dump");
}

}  // namespace
}  // namespace gpusnap::agent
