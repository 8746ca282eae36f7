#include "store/transfer.h"

#include <fcntl.h>
#include <sys/file.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "artifact/writer.h"
#include "common/fd.h"
#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/digest.h"
#include "store/materialise.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

// What `skopeo inspect --raw` shows and what a node checks first, from the typed manifest
// (Manifest::from_json has validated every field it reads).
json annotations(const Layout& layout, const Manifest& m) {
  std::string models;
  std::string driver = "none";
  if (m.gpu) {
    driver = m.gpu->driver_version;
    std::set<std::string> names;
    for (const GpuRecord& g : m.gpu->gpus) names.insert(g.name);
    for (const auto& n : names) models += (models.empty() ? "" : ",") + n;
  }
  uint64_t gpu_bytes = 0;
  for (const ProcessRecord& p : m.processes) gpu_bytes += p.gpu_bytes;
  return {{"org.opencontainers.image.created", m.created},
          {"org.gpusnap.artifact.id", m.id},
          {"org.gpusnap.version", m.gpusnap_version},
          {"org.gpusnap.gpu.model", models.empty() ? "none" : models},
          {"org.gpusnap.gpu.driver", driver},
          {"org.gpusnap.gpu.bytes", std::to_string(gpu_bytes)},
          {"org.gpusnap.host.arch", m.host.arch},
          {"org.gpusnap.bytes.apparent", std::to_string(layout.apparent_bytes())},
          {"org.gpusnap.bytes.data", std::to_string(layout.data_bytes())},
          {"org.gpusnap.bytes.stored", std::to_string(layout.stored_bytes())}};
}

// The OCI architecture name of a machine's (uname -m), for the image config.
std::string oci_architecture(const std::string& machine) {
  if (machine == "x86_64") return "amd64";
  if (machine == "aarch64") return "arm64";
  return machine;
}

// The image config of a snapshot's manifest (version 2): an ordinary OCI image config, so that
// plain `skopeo inspect` (which refuses any other config media type as "an artifact") shows
// the snapshot, its annotations as Labels. Nothing reads it back: the layout is layer 0.
std::string image_config(const Manifest& m, const json& labels) {
  json config = {{"architecture", oci_architecture(m.host.arch)},
                 {"os", "linux"},
                 {"config", {{"Labels", labels}}},
                 {"rootfs", {{"type", "layers"}, {"diff_ids", json::array()}}}};
  if (!m.created.empty()) config["created"] = m.created;
  return config.dump();
}

RemoteSnapshot read_remote_with(Registry& registry) {
  auto [body, digest] = registry.fetch_manifest();
  const std::string name = registry.ref().str();
  SnapshotManifest m = read_snapshot_manifest(body, name);
  Layout layout = read_snapshot_layout(registry.fetch_blob(m.layout_digest, m.layout_size), name);
  check_snapshot_layers(m, layout, name);
  return {registry.ref(), digest, std::move(m.doc), std::move(layout)};
}

// The staging directories that pulls of the same node copy left (killed, or failed with
// MaterialiseOptions::keep_partial), locked for as long as their chunks may be read: no sweep
// (ArtifactWriter::remove_stale_staging) removes a locked one. A staging directory a live
// writer holds is locked by it and skipped. Those of other snapshots that nobody holds are
// removed: what a node keeps of pulls that did not finish is the last one's (its owner's PID
// says nothing here: an agent restarted in its own PID namespace has the same one).
class Partials {
 public:
  explicit Partials(const std::filesystem::path& output) {
    std::error_code ec;
    const std::string name = output.filename().string();
    for (const auto& e : std::filesystem::directory_iterator(output.parent_path(), ec)) {
      const std::string entry = e.path().filename().string();
      if (!artifact::ArtifactWriter::is_staging(entry)) continue;
      common::UniqueFd fd(
          ::open(e.path().c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;
      if (artifact::ArtifactWriter::is_staging_of(entry, name)) {
        held_.emplace_back(e.path(), std::move(fd));
      } else {
        fs::remove_tree_noexcept(e.path());
      }
    }
  }
  std::vector<std::filesystem::path> dirs() const {
    std::vector<std::filesystem::path> out;
    for (const auto& [dir, fd] : held_) out.push_back(dir);
    return out;
  }
  // Once the copy is complete: what they held is in it.
  void remove() noexcept {
    for (auto& [dir, fd] : held_) fs::remove_tree_noexcept(dir);
    held_.clear();
  }

 private:
  std::vector<std::pair<std::filesystem::path, common::UniqueFd>> held_;
};

}  // namespace

SnapshotSizes SnapshotSizes::of(const Layout& layout) {
  return {layout.apparent_bytes(), layout.data_bytes(), layout.stored_bytes(),
          layout.blobs().size()};
}

PushResult push(const std::filesystem::path& path, const OciRef& ref, const TransferOptions& o,
                Reporter& reporter) {
  if (!ref.digest.empty()) {
    throw Error(ErrorKind::kUsage, "push names its target by a tag, not a digest: " + ref.str(),
                "write oci://HOST/REPOSITORY:TAG");
  }
  Phases phases(reporter);
  PushResult r;
  auto artifact = phases.run("open", [&] { return Artifact::open(path); });
  Registry registry(ref, o.registry);
  std::mutex mu;
  std::set<std::string> seen;
  std::atomic<uint64_t> uploaded{0};
  std::atomic<uint64_t> bytes_uploaded{0};
  Layout layout = phases.run("upload", [&] {
    ChunkingOptions co = o.chunking;
    co.threads = o.jobs;
    return chunk_artifact(
        artifact, co,
        [&](const Chunk& c) {
          {
            std::lock_guard lock(mu);
            if (!seen.insert(c.extent.digest).second) return;  // the same chunk, once
          }
          if (!registry.upload_blob_if_missing(c.extent.digest, c.blob)) return;
          ++uploaded;
          bytes_uploaded += c.blob.size();
        },
        reporter, "upload");
  });
  phases.run("manifest", [&] {
    // Version 2 (layout_descriptor): the layout as layer 0, an image config for OCI tools.
    const Manifest m = Manifest::from_json(layout.manifest);
    const json labels = annotations(layout, m);
    json layers = json::array();
    for (const std::string& blob : {layout.to_json().dump(), image_config(m, labels)}) {
      const std::string d = sha256_digest(blob);
      if (!registry.blob_exists(d)) registry.upload_blob(d, blob);
      layers.push_back({{"mediaType", kConfigMediaType}, {"digest", d}, {"size", blob.size()}});
    }
    const json config = {{"mediaType", kOciImageConfigMediaType},
                         {"digest", layers[1]["digest"]},
                         {"size", layers[1]["size"]}};
    layers.erase(1);
    for (const auto& b : layout.blobs()) {
      layers.push_back(
          {{"mediaType", b.encoding == Encoding::kZstd ? kChunkZstdMediaType : kChunkMediaType},
           {"digest", b.digest},
           {"size", b.size}});
    }
    const json manifest = {{"schemaVersion", 2},
                           {"mediaType", kOciManifestMediaType},
                           {"artifactType", kArtifactType},
                           {"config", config},
                           {"layers", layers},
                           {"annotations", labels}};
    r.digest = registry.put_manifest(manifest.dump(), kOciManifestMediaType);
  });
  r.reference = ref.by_digest(r.digest);
  r.sizes = SnapshotSizes::of(layout);
  r.chunks_uploaded = uploaded;
  r.bytes_uploaded = bytes_uploaded;
  r.phases = phases.timings();
  return r;
}

RemoteSnapshot read_remote(const OciRef& ref, const TransferOptions& options) {
  Registry registry(ref, options.registry);
  return read_remote_with(registry);
}

PullResult pull(const OciRef& ref, const PullOptions& o, Reporter& reporter) {
  Phases phases(reporter);
  Registry registry(ref, o.transfer.registry);
  RemoteSnapshot snap = phases.run("manifest", [&] {
    auto s = o.snapshot ? *o.snapshot : read_remote_with(registry);
    if (o.check) o.check(Manifest::from_json(s.layout.manifest));
    return s;
  });
  const std::string key = digest_hex(snap.digest);
  if (o.output_in_cache && (!o.output.is_absolute() || o.output.filename() != key)) {
    throw Error(ErrorKind::kInternal,
                "the node's copy of " + key + " would be " + o.output.string(),
                "pull a node's copy into an absolute PULLED/HEX, HEX its manifest's digest");
  }
  BlobStore cache(o.cache);
  PullResult r;
  // Where chunks already on this node lie besides blobs/: in the node copies there are, and,
  // for a node copy, in what an earlier pull of it that was killed or failed left.
  std::multimap<std::string, ChunkLocation> located = cache.chunks_in_copies();
  std::optional<Partials> partials;
  if (o.output_in_cache) {
    partials.emplace(o.output);
    for (const auto& dir : partials->dirs()) located.merge(chunk_locations(snap.layout, dir));
  }
  std::atomic<uint64_t> fetched{0}, bytes_fetched{0}, cached{0}, bytes_cached{0};
  phases.run("fetch", [&] {
    MaterialiseOptions mo;
    mo.threads = o.transfer.jobs;
    mo.progress_name = "fetch";
    mo.arrival = o.arrival;
    mo.keep_partial = o.output_in_cache;
    materialise(
        snap.layout, o.output,
        [&](const BlobInfo& b) {
          if (cache.has(b.digest)) {
            try {
              std::string data = cache.get(b.digest, b.size);
              ++cached;
              bytes_cached += data.size();
              return data;
            } catch (const Error&) {
              // Damaged in the cache (and removed there): fetched again below.
            }
          }
          for (auto [at, end] = located.equal_range(b.digest); at != end; ++at) {
            if (auto data = read_located(at->second, b.digest)) {
              ++cached;
              bytes_cached += data->size();
              if (!o.output_in_cache) cache.put(b.digest, *data);
              return std::move(*data);
            }
          }
          std::string data = registry.fetch_blob(b.digest, b.size);
          // Written once: an uncompressed chunk of a node copy is kept by the copy itself.
          if (!o.output_in_cache || b.encoding != Encoding::kRaw) cache.put(b.digest, data);
          ++fetched;
          bytes_fetched += data.size();
          return data;
        },
        mo, reporter);
  });
  if (partials) partials->remove();
  phases.run("cache", [&] {
    cache.record_snapshot(key, ref.by_digest(snap.digest), snap.layout,
                          o.output_in_cache ? o.output : std::filesystem::path());
    auto evicted = cache.evict(o.cache_budget, key);
    r.evicted = std::move(evicted.evicted);
    r.kept_in_use = std::move(evicted.in_use);
  });
  r.reference = ref.by_digest(snap.digest);
  r.digest = snap.digest;
  r.output = o.output;
  r.sizes = SnapshotSizes::of(snap.layout);
  r.chunks_fetched = fetched;
  r.bytes_fetched = bytes_fetched;
  r.chunks_from_cache = cached;
  r.bytes_from_cache = bytes_cached;
  r.phases = phases.timings();
  return r;
}

NodeCopy node_copy(const std::filesystem::path& cache, const std::filesystem::path& copies,
                   const OciRef& by_digest, const std::function<Layout()>& layout) {
  namespace sfs = std::filesystem;
  sfs::create_directories(copies);
  sfs::permissions(copies, sfs::perms::owner_all, sfs::perm_options::replace);
  const std::string key = digest_hex(by_digest.digest);
  NodeCopy c{sfs::absolute(copies).lexically_normal() / key, {}, false};
  // The cache's own lock is released on return, before the caller's pull: its eviction needs
  // the cache alone.
  BlobStore store(cache);
  c.use = store.use(key);
  if (!sfs::exists(c.path / kManifestName)) return c;  // complete only: it appears by rename
  if (!store.recorded(key)) {
    store.record_snapshot(key, by_digest.by_digest(by_digest.digest), layout(), c.path);
  }
  store.touch(key);
  c.found = true;
  return c;
}

ImportResult import_artifact(const std::filesystem::path& path, const std::filesystem::path& cache,
                             const ChunkingOptions& options, Reporter& reporter) {
  Phases phases(reporter);
  ImportResult r;
  auto artifact = phases.run("open", [&] { return Artifact::open(path); });
  BlobStore store(cache);
  std::mutex mu;
  std::set<std::string> seen;
  std::atomic<uint64_t> new_bytes{0}, new_chunks{0};
  Layout layout = phases.run("import", [&] {
    return chunk_artifact(
        artifact, options,
        [&](const Chunk& c) {
          {
            std::lock_guard lock(mu);
            if (!seen.insert(c.extent.digest).second) return;
          }
          if (store.has(c.extent.digest)) return;
          store.put(c.extent.digest, c.blob);
          ++new_chunks;
          new_bytes += c.blob.size();
        },
        reporter, "import");
  });
  r.key = digest_hex(sha256_digest(layout.to_json().dump()));
  phases.run("record", [&] {
    store.record_snapshot(r.key, std::filesystem::absolute(path).string(), layout);
  });
  r.sizes = SnapshotSizes::of(layout);
  r.new_bytes = new_bytes;
  r.new_chunks = new_chunks;
  r.phases = phases.timings();
  return r;
}

}  // namespace gpusnap::store
