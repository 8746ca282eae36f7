#include "store/transfer.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "artifact/writer.h"
#include "common/chunk_memory.h"
#include "common/fd.h"
#include "common/fs.h"
#include "common/room.h"
#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/digest.h"
#include "store/materialise.h"
#include "store/mirrors.h"

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

// The layout blob `m` names, read; an encrypted one opened with the node's keys, its chunks'
// sealed blobs and keys to `sealed`.
Layout read_layout(PullRegistries& registry, const SnapshotManifest& m, const std::string& name,
                   const TransferOptions& options, std::shared_ptr<const SealedChunks>& sealed) {
  const std::string blob = registry.fetch_blob(m.layout_digest, m.layout_size);
  if (!m.encrypted) return read_snapshot_layout(blob, name);
  OpenedLayout opened = open_layout(blob, options.decryption.get(), name);
  sealed = std::make_shared<const SealedChunks>(std::move(opened.chunks));
  return std::move(opened.layout);
}

// Reads a snapshot's manifest (version 1 or 2), or its index and every manifest the index
// lists (version 3): the layout from the first, each one's layers checked against it, so
// that a pull finds out a copy that lost a part (`skopeo copy` without --all) before it
// fetches a chunk.
RemoteSnapshot read_remote_with(PullRegistries& registry, const TransferOptions& options) {
  auto [body, digest] = registry.fetch_manifest();
  // The digest of the manifest read, whatever the tag names or a mirror served: what a
  // signature must name. Checked before the layout, the first of the snapshot's blobs.
  if (options.policy) check_signature(*options.policy, registry.ref(), digest, options.registry);
  const std::string name = registry.ref().str();
  std::set<std::string> seen;
  if (!is_snapshot_index(body)) {
    SnapshotManifest m = read_snapshot_manifest(body, name);
    if (!m.part.empty()) {
      throw Error(ErrorKind::kBadArtifact,
                  name + " is part " + m.part + " of a snapshot split across an image index",
                  "pull the reference `gpusnap push` printed; copy such a snapshot with "
                  "`skopeo copy --all`, which copies the index and every part");
    }
    std::shared_ptr<const SealedChunks> sealed;
    Layout layout = read_layout(registry, m, name, options, sealed);
    check_snapshot_layers(m, layout, name, seen, sealed.get());
    return {registry.ref(), digest, std::move(m.doc), std::move(layout), std::move(sealed)};
  }
  nlohmann::json index;
  const std::vector<std::string> parts = read_snapshot_index(body, name, index);
  std::optional<Layout> layout;
  std::shared_ptr<const SealedChunks> sealed;
  std::string layout_digest;
  for (size_t i = 0; i < parts.size(); ++i) {
    // Through the same registries (their connections, tokens and mirrors), by digest.
    const std::string part_name = name + " (manifest " + parts[i] + ")";
    SnapshotManifest m = read_snapshot_manifest(registry.fetch_manifest(parts[i]).first, part_name);
    if (!layout) {
      layout = read_layout(registry, m, name, options, sealed);
      layout_digest = m.layout_digest;
      // Each part lists a chunk at least, so that an index cannot have a pull fetch more
      // manifests than the layout has chunks.
      if (parts.size() > layout->blobs().size()) {
        throw Error(ErrorKind::kBadArtifact,
                    name + " lists " + std::to_string(parts.size()) + " manifests for " +
                        std::to_string(layout->blobs().size()) + " chunks",
                    "give a reference that `gpusnap push` wrote");
      }
    } else if (m.layout_digest != layout_digest) {
      throw Error(ErrorKind::kBadArtifact,
                  part_name + " names layout " + m.layout_digest + " where the first names " +
                      layout_digest,
                  "give a reference that `gpusnap push` wrote");
    }
    const size_t before = seen.size();
    check_snapshot_layers(m, *layout, part_name, seen, sealed.get());
    if (seen.size() == before) {
      throw Error(ErrorKind::kBadArtifact, part_name + " lists no chunk",
                  "give a reference that `gpusnap push` wrote");
    }
  }
  return {registry.ref(), digest, std::move(index), std::move(*layout), std::move(sealed)};
}

// The staging directories that pulls of the same node copy left (killed, or failed with
// MaterialiseOptions::keep_partial), locked for as long as their chunks may be read: no sweep
// (ArtifactWriter::remove_stale_staging) removes a locked one. A staging directory a live
// writer holds is locked by it and skipped. Those of other snapshots that nobody holds are
// removed: what a node keeps of pulls that did not finish is the last one's (its owner's PID
// says nothing here: an agent restarted in its own PID namespace has the same one). The one
// holding most is resumed (take_resumed()): the pull writes into it, so that however often pulls
// of a snapshot are killed, one staging directory of it is left at most.
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
        held_.push_back({e.path(), std::move(fd)});
      } else {
        fs::remove_tree_noexcept(e.path());
      }
    }
    std::sort(held_.begin(), held_.end(), [](const auto& a, const auto& b) {
      return fs::allocated_bytes(a.dir) > fs::allocated_bytes(b.dir);
    });
  }
  // The one that holds most, lock included, for the pull to write into; empty when none.
  artifact::StagingDir take_resumed() {
    if (held_.empty()) return {};
    artifact::StagingDir d = std::move(held_.front());
    held_.erase(held_.begin());
    return d;
  }
  std::vector<std::filesystem::path> dirs() const {
    std::vector<std::filesystem::path> out;
    for (const auto& d : held_) out.push_back(d.dir);
    return out;
  }
  // Once the copy is complete: what they held is in it.
  void remove() noexcept {
    for (auto& d : held_) fs::remove_tree_noexcept(d.dir);
    held_.clear();
  }

 private:
  std::vector<artifact::StagingDir> held_;
};

// Refuses a pull whose bytes do not fit where they go (the checkpoint's room check for a
// capture, engine/preflight.h, is the same question asked of a capture).
void refuse_without_room(const std::string& reference, const PullOptions& o,
                         const RemoteSnapshot& snap, const BlobStore& cache,
                         const artifact::StagingDir& resumed) {
  using fs::human_bytes;
  const uint64_t held = resumed.dir.empty() ? 0 : fs::allocated_bytes(resumed.dir);
  const uint64_t data = snap.layout.data_bytes();
  const uint64_t files = data > held ? data - held : 0;
  uint64_t chunks = 0;
  for (const BlobInfo& b : snap.layout.blobs()) {
    // Kept by the cache: every chunk of a pull into a caller's directory, a node copy's
    // compressed ones (its uncompressed ones are in the copy).
    const bool kept = !o.output_in_cache || b.encoding != Encoding::kRaw;
    if (kept && !cache.has(b.digest)) chunks += b.size;
  }
  const auto out = o.output.parent_path();
  const auto out_room = fs::room_of(out);
  const auto cache_room = fs::room_of(cache.root());
  const bool shared = out_room.device == cache_room.device;
  const auto refuse = [&](const std::filesystem::path& where, uint64_t need, uint64_t free,
                          const std::string& parts) {
    throw Error(ErrorKind::kEnvironment,
                "pulling " + reference + " needs " + human_bytes(need) + " in " + where.string() +
                    " (" + parts + "), it has " + human_bytes(free) + " free",
                "free space there (`gpusnap recover` removes what killed pulls left), or pull "
                "elsewhere (-o DIR, --run-dir DIR, --cache DIR)");
  };
  const std::string files_part =
      human_bytes(files) + " of the snapshot's files" +
      (held > 0 ? " beside the " + human_bytes(held) + " an earlier pull left" : "");
  const std::string chunks_part = human_bytes(chunks) + " of chunks for the node cache";
  if (shared) {
    if (files + chunks > out_room.free) {
      refuse(out, files + chunks, out_room.free, files_part + " + " + chunks_part);
    }
    return;
  }
  if (files > out_room.free) refuse(out, files, out_room.free, files_part);
  if (chunks > cache_room.free) refuse(cache.root(), chunks, cache_room.free, chunks_part);
}

}  // namespace

int default_jobs() {
  const auto cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(2 * cores, 8, 32);
}

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
  common::keep_chunk_memory();
  Phases phases(reporter);
  PushResult r;
  std::optional<SigningKey> signer;
  if (!o.sign_key.empty()) signer.emplace(o.sign_key);  // a key it cannot use: refused first
  std::optional<ChunkSealer> sealer;
  if (!o.recipients.empty()) sealer.emplace(o.recipients, o.dedup_secret);  // so are these
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
          // Encrypted here, the one place chunks leave the node (store/encryption.h).
          const ChunkSealer::Sealed sealed =
              sealer ? sealer->seal(c.extent.digest, c.blob) : ChunkSealer::Sealed{};
          const std::string_view blob = sealer ? std::string_view{sealed.bytes} : c.blob;
          if (!registry.upload_blob_if_missing(sealer ? sealed.digest : c.extent.digest, blob)) {
            return;
          }
          ++uploaded;
          bytes_uploaded += blob.size();
          if (o.counters) {
            ++o.counters->chunks_uploaded;
            o.counters->bytes_uploaded += blob.size();
          }
        },
        reporter, "upload");
  });
  phases.run("manifest", [&] {
    // Version 2, or 3 beyond what one manifest holds (store/snapshot_manifest.h).
    const Manifest m = Manifest::from_json(layout.manifest);
    json labels = annotations(layout, m);
    if (sealer) labels[kRecipientsAnnotation] = sealer->fingerprints();
    Descriptor blobs[2];
    const std::string texts[2] = {sealer ? sealer->seal_layout(layout) : layout.to_json().dump(),
                                  image_config(m, labels)};
    if (texts[0].size() > kMaxLayoutBytes) {
      throw Error(ErrorKind::kUsage,
                  "the snapshot's layout is " + fs::human_bytes(texts[0].size()) +
                      ", more than the " + fs::human_bytes(kMaxLayoutBytes) + " a pull reads",
                  "push with larger chunks (fewer chunks name fewer extents)");
    }
    for (int i = 0; i < 2; ++i) {
      blobs[i] = {sha256_digest(texts[i]), texts[i].size()};
      if (!registry.blob_exists(blobs[i].digest)) registry.upload_blob(blobs[i].digest, texts[i]);
    }
    const SnapshotManifests out =
        snapshot_manifests(layout, blobs[0], blobs[1], labels, oci_architecture(m.host.arch),
                           sealer ? &sealer->chunks() : nullptr);
    if (out.index.empty()) {
      r.digest = registry.put_manifest(out.parts[0], kOciManifestMediaType);
      return;
    }
    // The parts first, by digest: a registry stores an index only once what it lists is there.
    for (const std::string& part : out.parts) {
      registry.put_manifest(part, kOciManifestMediaType, /*by_digest=*/true);
    }
    r.digest = registry.put_manifest(out.index, kOciImageIndexMediaType);
  });
  if (signer) phases.run("sign", [&] { r.signature = signer->sign(ref, r.digest, o.registry); });
  r.reference = ref.by_digest(r.digest);
  r.sizes = SnapshotSizes::of(layout);
  r.chunks_uploaded = uploaded;
  r.bytes_uploaded = bytes_uploaded;
  r.phases = phases.timings();
  return r;
}

RemoteSnapshot read_remote(const OciRef& ref, const TransferOptions& options) {
  PullRegistries registry(ref, options.registry);
  return read_remote_with(registry, options);
}

PullResult pull(const OciRef& ref, const PullOptions& o, Reporter& reporter) {
  common::keep_chunk_memory();
  Phases phases(reporter);
  PullRegistries registry(ref, o.transfer.registry);  // the node's mirrors, then the origin
  RemoteSnapshot snap = phases.run("manifest", [&] {
    auto s = o.snapshot ? *o.snapshot : read_remote_with(registry, o.transfer);
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
  artifact::StagingDir resumed;
  if (o.output_in_cache) {
    partials.emplace(o.output);
    resumed = partials->take_resumed();
    for (const auto& dir : partials->dirs()) located.merge(chunk_locations(snap.layout, dir));
  }
  // A statfs and the cache's index: quick, not a phase of its own.
  refuse_without_room(ref.by_digest(snap.digest), o, snap, cache, resumed);
  std::atomic<uint64_t> fetched{0}, bytes_fetched{0}, cached{0}, bytes_cached{0};
  MaterialiseResult written;
  phases.run("fetch", [&] {
    MaterialiseOptions mo;
    mo.threads = o.transfer.jobs;
    mo.progress_name = "fetch";
    mo.arrival = o.arrival;
    mo.keep_partial = o.output_in_cache;
    mo.resume = &resumed;
    mo.run_dir = o.run_dir;
    written = materialise(
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
          // An encrypted snapshot's chunk is opened here, the one place chunks reach the node,
          // and cached as the plain chunk it is (store/encryption.h).
          std::string data;
          if (snap.sealed) {
            const SealedChunk& s = snap.sealed->at(b.digest);
            data = open_chunk(b.digest, s, registry.fetch_blob(s.digest, s.size));
          } else {
            data = registry.fetch_blob(b.digest, b.size);
          }
          // Written once: an uncompressed chunk of a node copy is kept by the copy itself.
          if (!o.output_in_cache || b.encoding != Encoding::kRaw) cache.put(b.digest, data);
          ++fetched;
          bytes_fetched += data.size();
          if (o.transfer.counters) {
            ++o.transfer.counters->chunks_fetched;
            o.transfer.counters->bytes_fetched += data.size();
          }
          return data;
        },
        mo, reporter);
  });
  if (partials) partials->remove();
  for (const auto& line : registry.take_notes()) reporter.note(line);
  if (registry.bytes_from_mirrors() > 0) {
    reporter.note(std::to_string(registry.bytes_from_mirrors()) + " of the " +
                  std::to_string(bytes_fetched.load()) + " bytes fetched came from mirrors");
  }
  if (registry.bytes_from_peers() > 0) {
    reporter.note(std::to_string(registry.bytes_from_peers()) + " of the " +
                  std::to_string(bytes_fetched.load()) + " bytes fetched came from peers");
  }
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
  r.chunks_from_cache = cached + written.extents_kept;
  r.bytes_from_cache = bytes_cached + written.bytes_kept;
  r.cpu = written.cpu;
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

common::UniqueFd lock_node_copy(const std::filesystem::path& copies, const std::string& key,
                                Reporter& reporter) {
  const auto dir = copies.parent_path() / "locks";
  std::filesystem::create_directories(dir);
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace);
  const auto path = dir / ("pull-" + key);
  common::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd) throw sys_error("open " + path.string(), errno);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0) return fd;
  if (errno != EWOULDBLOCK) throw sys_error("flock " + path.string(), errno);
  reporter.note("waiting for another pull of sha256:" + key + " on this node to end");
  while (::flock(fd.get(), LOCK_EX) != 0) {
    if (errno != EINTR) throw sys_error("flock " + path.string(), errno);
  }
  return fd;
}

void set_aside_node_copy(const std::filesystem::path& copy) {
  const auto aside = artifact::ArtifactWriter::staging_path(copy);
  if (::renameat2(AT_FDCWD, copy.c_str(), AT_FDCWD, aside.c_str(), RENAME_NOREPLACE) != 0) {
    throw sys_error("rename " + copy.string() + " to " + aside.string(), errno);
  }
  fs::fsync_path(copy.parent_path());
}

std::vector<std::string> remove_dead_pulls(const std::filesystem::path& copies) noexcept {
  std::vector<std::string> log;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(copies, ec)) {
    if (!artifact::ArtifactWriter::is_staging(e.path().filename().string())) continue;
    common::UniqueFd fd(::open(e.path().c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    // Held: a pull at work in it, or reading what it holds.
    if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;
    const uint64_t bytes = fs::allocated_bytes(e.path());
    fs::remove_tree_noexcept(e.path());
    if (!std::filesystem::exists(std::filesystem::symlink_status(e.path(), ec))) {
      log.push_back("removed the staging directory " + e.path().string() + " (" +
                    fs::human_bytes(bytes) + ") of a pull that did not finish");
    }
  }
  return log;
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
