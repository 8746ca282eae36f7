#include "agent/metrics.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace gpusnap::agent {

namespace {

// Whole operations: a small CPU workload takes a fraction of a second, an 18 GB GPU workload
// tens of seconds (docs/benchmarks.md).
const std::vector<double> kOperationBounds = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
// Phases range from microseconds (locate) to the long copies (dump, gpu-checkpoint).
const std::vector<double> kPhaseBounds = {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1,
                                          2.5,   5,    10,   30,  60,   300};
const char* const kKinds[] = {"checkpoint", "restore", "prefetch"};
const char* const kResults[] = {"succeeded", "failed"};
const char* const kLanes[] = {"gpu", "prefetch"};

// Shortest text that reads back as the same double; Prometheus' spellings of the infinities.
std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // %.17g prints 0.1 as 0.10000000000000001: try the shorter forms first.
  for (int precision = 1; precision < 17; ++precision) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", precision, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

std::string label(const std::string& name, const std::string& value) {
  return name + "=\"" + escape_label(value) + "\"";
}

// One sample of a counter or gauge: NAME{LABELS} VALUE.
void sample(std::string& out, const char* name, const std::string& labels, int64_t value) {
  out += std::string(name) + "{" + labels + "} " + std::to_string(value) + "\n";
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

}  // namespace

std::string escape_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  const std::string prefix = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    out.append(name).append("_bucket{").append(prefix).append("le=\"").append(le).append("\"} ");
    out.append(std::to_string(cumulative)).append("\n");
  }
  const std::string braces = labels.empty() ? "" : "{" + labels + "}";
  out += name + "_sum" + braces + " " + number(sum_) + "\n";
  out += name + "_count" + braces + " " + std::to_string(count_) + "\n";
}

Metrics::Metrics(bool registry_storage) : registry_storage_(registry_storage) {
  // Every kind's series exist from the start, at zero: a rate() over a series that appears
  // only with its first event misses that event.
  for (const char* kind : kKinds) {
    for (const char* result : kResults) operations_[{kind, result}] = 0;
    in_flight_[kind] = 0;
    duration_.emplace(kind, Histogram(kOperationBounds));
    bytes_[kind] = 0;
  }
  for (const char* lane : kLanes) pending_[lane] = 0;
}

void Metrics::started(const std::string& kind) {
  std::lock_guard lock(mu_);
  ++in_flight_[kind];
}

void Metrics::finished(const std::string& kind, const std::string& result, double seconds,
                       const std::string& error_kind, uint64_t artifact_bytes) {
  std::lock_guard lock(mu_);
  --in_flight_[kind];
  ++operations_[{kind, result}];
  duration_.try_emplace(kind, kOperationBounds).first->second.observe(seconds);
  bytes_[kind] += artifact_bytes;
  if (!error_kind.empty()) ++failures_[{kind, error_kind}];
  if (result == "succeeded") {
    last_success_[kind] =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
}

void Metrics::failed_without_running(const std::string& kind, const std::string& error_kind) {
  std::lock_guard lock(mu_);
  ++operations_[{kind, "failed"}];
  ++failures_[{kind, error_kind}];
}

void Metrics::phase(const std::string& kind, const std::string& phase, double seconds) {
  std::lock_guard lock(mu_);
  phases_.try_emplace({kind, phase}, kPhaseBounds).first->second.observe(seconds);
}

void Metrics::pending(const std::string& lane, int64_t count) {
  std::lock_guard lock(mu_);
  pending_[lane] = count;
}

void Metrics::pulled(const Pull& pull) {
  std::lock_guard lock(mu_);
  cache_.chunks_found += pull.chunks_found;
  cache_.bytes_found += pull.bytes_found;
  cache_.evicted += pull.evicted;
}

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  header(out, "gpusnap_operations_total", "counter",
         "Checkpoints and restores that ended, by result.");
  for (const auto& [key, n] : operations_) {
    sample(out, "gpusnap_operations_total",
           label("kind", key.first) + "," + label("result", key.second), static_cast<int64_t>(n));
  }
  header(out, "gpusnap_operations_in_flight", "gauge",
         "Operations running now (pending ones excluded).");
  for (const auto& [kind, n] : in_flight_)
    sample(out, "gpusnap_operations_in_flight", label("kind", kind), n);
  header(out, "gpusnap_operations_pending", "gauge",
         "Operations accepted and waiting to run, by lane (gpu: checkpoints and restores).");
  for (const auto& [lane, n] : pending_)
    sample(out, "gpusnap_operations_pending", label("lane", lane), n);
  header(out, "gpusnap_operation_duration_seconds", "histogram",
         "Time from an operation's start to its end.");
  for (const auto& [kind, h] : duration_) {
    h.render(out, "gpusnap_operation_duration_seconds", label("kind", kind));
  }
  header(out, "gpusnap_phase_duration_seconds", "histogram",
         "Time of each named phase of the engine.");
  for (const auto& [key, h] : phases_) {
    h.render(out, "gpusnap_phase_duration_seconds",
             label("kind", key.first) + "," + label("phase", key.second));
  }
  header(out, "gpusnap_artifact_bytes_total", "counter",
         "Artifact bytes written by checkpoints and read by restores.");
  for (const auto& [kind, n] : bytes_) {
    sample(out, "gpusnap_artifact_bytes_total", label("kind", kind), static_cast<int64_t>(n));
  }
  header(out, "gpusnap_operation_failures_total", "counter",
         "Failed operations by error kind (the kinds are gpusnap's exit codes).");
  for (const auto& [key, n] : failures_) {
    sample(out, "gpusnap_operation_failures_total",
           label("kind", key.first) + "," + label("error_kind", key.second),
           static_cast<int64_t>(n));
  }
  header(out, "gpusnap_last_success_timestamp_seconds", "gauge",
         "When the newest successful operation of each kind ended, in seconds since the epoch.");
  for (const auto& [kind, at] : last_success_) {
    char text[64];
    std::snprintf(text, sizeof text, "%.3f", at);
    out += "gpusnap_last_success_timestamp_seconds{" + label("kind", kind) + "} " + text + "\n";
  }
  if (registry_storage_) render_registry(out);
  return out;
}

void Metrics::render_registry(std::string& out) const {
  const store::TransferCounters& moved = *transfers_;
  // One family per measure, its samples by direction in label order.
  const auto by_direction = [&out](const char* name, const char* help, uint64_t pull,
                                   uint64_t push) {
    header(out, name, "counter", help);
    sample(out, name, label("direction", "pull"), static_cast<int64_t>(pull));
    sample(out, name, label("direction", "push"), static_cast<int64_t>(push));
  };
  by_direction("gpusnap_registry_bytes_total",
               "Chunk bytes uploaded to the registry by pushes and fetched from it by pulls, as "
               "stored (compressed).",
               moved.bytes_fetched.load(), moved.bytes_uploaded.load());
  by_direction("gpusnap_registry_chunks_total",
               "Chunks uploaded to the registry by pushes (those it held already excluded) and "
               "fetched from it by pulls.",
               moved.chunks_fetched.load(), moved.chunks_uploaded.load());
  // Hits and misses as two counters: the hit ratio is rate(hits) / (rate(hits) + rate(misses)).
  header(out, "gpusnap_node_cache_hits_total", "counter",
         "Chunks pulls found on the node (the node cache, its copies, a dead pull's staging) "
         "instead of fetching them.");
  out += "gpusnap_node_cache_hits_total " + std::to_string(cache_.chunks_found) + "\n";
  header(out, "gpusnap_node_cache_misses_total", "counter",
         "Chunks pulls fetched from the registry because the node did not hold them.");
  out += "gpusnap_node_cache_misses_total " + std::to_string(moved.chunks_fetched.load()) + "\n";
  header(out, "gpusnap_node_cache_hit_bytes_total", "counter",
         "Bytes of the chunks pulls found on the node: what they did not fetch.");
  out += "gpusnap_node_cache_hit_bytes_total " + std::to_string(cache_.bytes_found) + "\n";
  header(out, "gpusnap_node_cache_evictions_total", "counter",
         "Snapshots the node cache evicted, with their copies, to keep within its budget.");
  out += "gpusnap_node_cache_evictions_total " + std::to_string(cache_.evicted) + "\n";
}

}  // namespace gpusnap::agent
