#include "store/blob_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "common/fs.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "store/digest.h"

namespace gpusnap::store {

namespace {

namespace sfs = std::filesystem;
using nlohmann::json;

// A snapshot record is a layout: bounded like one read from a registry.
constexpr uint64_t kMaxRecordBytes = 256ull << 20;

void make_private_dir(const sfs::path& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    throw Error(ErrorKind::kEnvironment, "cannot create " + dir.string() + ": " + errno_text(errno),
                "give --cache a directory root can write");
  }
  // An existing directory (another umask, an older version) is made root-only too.
  if (::chmod(dir.c_str(), 0700) != 0) throw sys_error("chmod " + dir.string(), errno);
}

void write_all(int fd, std::string_view data, const std::string& what) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw sys_error("write " + what, errno);
    data.remove_prefix(static_cast<size_t>(n));
  }
}

// Writes `data` to a file opened with O_DIRECT: whole blocks from an aligned buffer of this
// thread (kept between calls: a fresh one would be faulted in page by page), then the tail
// through the page cache (O_DIRECT cleared), which takes any length.
void write_direct(int fd, std::string_view data, const std::string& what) {
  constexpr size_t kAlign = 4096;
  constexpr size_t kBuffer = 4u << 20;
  struct Free {
    void operator()(char* p) const { std::free(p); }  // NOLINT(cppcoreguidelines-no-malloc)
  };
  thread_local std::unique_ptr<char, Free> buffer;
  if (!buffer) {
    void* p = nullptr;
    if (::posix_memalign(&p, kAlign, kBuffer) != 0) throw sys_error("allocate", ENOMEM);
    buffer.reset(static_cast<char*>(p));
  }
  const size_t whole = data.size() / kAlign * kAlign;
  for (size_t done = 0; done < whole;) {
    const size_t n = std::min(kBuffer, whole - done);
    std::memcpy(buffer.get(), data.data() + done, n);
    for (size_t w = 0; w < n;) {
      ssize_t r = ::write(fd, buffer.get() + w, n - w);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw sys_error("write " + what, errno);
      w += static_cast<size_t>(r);
    }
    done += n;
  }
  if (whole < data.size()) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) {
      throw sys_error("fcntl " + what, errno);
    }
    write_all(fd, data.substr(whole), what);
  }
}

int64_t mtime_ns(const sfs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return 0;
  return st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
}

// The blocks a tree's files occupy (a sparse host image counts what it holds, not its size).
uint64_t allocated_bytes(const sfs::path& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (sfs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      n += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  return n;
}

// A record's materialised copy, when it names one the cache may count and remove: an absolute
// path whose last component is the snapshot's key (what pull writes), nothing else.
sfs::path materialised_of(const json& doc, const std::string& key) {
  if (!doc.contains("materialised") || !doc["materialised"].is_string()) return {};
  sfs::path p = doc["materialised"].get<std::string>();
  if (!p.is_absolute() || p.filename() != key || p.lexically_normal() != p) return {};
  return p;
}

}  // namespace

std::multimap<std::string, ChunkLocation> chunk_locations(const Layout& layout,
                                                          const sfs::path& root) {
  std::multimap<std::string, ChunkLocation> out;
  for (const auto& f : layout.files) {
    for (const auto& e : f.extents) {
      if (e.encoding == Encoding::kRaw)
        out.emplace(e.digest, ChunkLocation{root / f.path, e.offset, e.length});
    }
  }
  return out;
}

std::optional<std::string> read_located(const ChunkLocation& where, std::string_view digest) {
  common::UniqueFd fd(::open(where.file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return std::nullopt;
  // A range with no data at all was never written (a killed pull's): no need to read it.
  const off_t data = ::lseek(fd.get(), static_cast<off_t>(where.offset), SEEK_DATA);
  if (data < 0 || static_cast<uint64_t>(data) >= where.offset + where.length) return std::nullopt;
  std::string bytes(where.length, '\0');
  for (size_t done = 0; done < bytes.size();) {
    ssize_t n = ::pread(fd.get(), bytes.data() + done, bytes.size() - done,
                        static_cast<off_t>(where.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    done += static_cast<size_t>(n);
  }
  if (sha256_digest(bytes) != digest) return std::nullopt;
  return bytes;
}

BlobStore::BlobStore(sfs::path root) : root_(std::move(root)) {
  if (root_.has_parent_path() && !sfs::is_directory(root_.parent_path())) {
    sfs::create_directories(root_.parent_path());
  }
  make_private_dir(root_);
  make_private_dir(root_ / "blobs");
  make_private_dir(root_ / "blobs" / "sha256");
  make_private_dir(root_ / "snapshots");
  make_private_dir(root_ / "uses");
  make_private_dir(root_ / "tmp");
  lock_.reset(::open((root_ / "lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!lock_) throw sys_error("open " + (root_ / "lock").string(), errno);
  while (::flock(lock_.get(), LOCK_SH) != 0) {
    if (errno != EINTR) throw sys_error("flock " + (root_ / "lock").string(), errno);
  }
}

sfs::path BlobStore::blob_path(std::string_view digest) const {
  return root_ / "blobs" / "sha256" / digest_hex(digest);
}

bool BlobStore::has(std::string_view digest) const {
  return ::access(blob_path(digest).c_str(), F_OK) == 0;
}

void BlobStore::put(std::string_view digest, std::string_view data) const {
  const auto final_path = blob_path(digest);
  if (::access(final_path.c_str(), F_OK) == 0) return;
  const auto tmp = root_ / "tmp" / (digest_hex(digest) + "." + fs::random_id());
  // O_DIRECT where the filesystem takes it (not tmpfs): a pull writes every chunk here and into
  // the artifact, and only the artifact is read soon (by the restore). Through the page cache
  // the copy here cost as much CPU as the artifact's (measured: ~1.1 s of 3.5 s per GiB
  // pulled on two cores); direct, the disk reads it from our buffer.
  bool direct = true;
  common::UniqueFd fd(
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600));
  if (!fd && errno == EINVAL) {
    direct = false;
    fd.reset(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  }
  if (!fd) throw sys_error("create " + tmp.string(), errno);
  try {
    if (direct) {
      write_direct(fd.get(), data, tmp.string());
    } else {
      write_all(fd.get(), data, tmp.string());
    }
    // No fsync per chunk: get() checks every chunk against its digest, so a chunk torn by a
    // power loss is found, removed and fetched again; a sync per 8 MiB would halve a pull.
    fd.reset();
    if (::rename(tmp.c_str(), final_path.c_str()) != 0)
      throw sys_error("rename " + tmp.string(), errno);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

std::string BlobStore::get(std::string_view digest, uint64_t max) const {
  const auto path = blob_path(digest);
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw sys_error("open " + path.string(), errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw sys_error("stat " + path.string(), errno);
  if (static_cast<uint64_t>(st.st_size) > max) {
    ::unlink(path.c_str());
    throw Error(
        ErrorKind::kBadArtifact,
        "chunk " + std::string(digest) + " in the node cache is larger than its layout says",
        "pull again: the damaged chunk was removed");
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  for (size_t done = 0; done < data.size();) {
    ssize_t n = ::read(fd.get(), data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw sys_error("read " + path.string(), n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
  if (sha256_digest(data) != digest) {
    ::unlink(path.c_str());
    throw Error(ErrorKind::kBadArtifact,
                "chunk " + std::string(digest) + " in the node cache does not match its digest",
                "pull again: the damaged chunk was removed");
  }
  return data;
}

uint64_t BlobStore::blob_bytes() const {
  uint64_t n = 0;
  for (const auto& e : sfs::directory_iterator(root_ / "blobs" / "sha256")) {
    std::error_code ec;
    auto size = e.file_size(ec);
    if (!ec) n += size;
  }
  return n;
}

void BlobStore::record_snapshot(const std::string& key, const std::string& reference,
                                const Layout& layout, const sfs::path& materialised) {
  digest_hex(std::string(kSha256Prefix) + key);  // the key names a file: 64 hex digits only
  const auto path = root_ / "snapshots" / (key + ".json");
  json doc{{"reference", reference}, {"layout", layout.to_json()}};
  if (!materialised.empty()) {
    doc["materialised"] = materialised.lexically_normal().string();
  } else if (std::string text; fs::try_read_file(path, &text) && text.size() <= kMaxRecordBytes) {
    // Pulled again to a directory of the caller's: the node's copy is still the node's.
    const json before = json::parse(text, nullptr, false);
    if (auto p = materialised_of(before, key); !p.empty()) doc["materialised"] = p.string();
  }
  fs::write_file_durable(path, doc.dump());
}

bool BlobStore::recorded(const std::string& key) const {
  digest_hex(std::string(kSha256Prefix) + key);
  return ::access((root_ / "snapshots" / (key + ".json")).c_str(), F_OK) == 0;
}

sfs::path BlobStore::use_path(const std::string& key) const {
  digest_hex(std::string(kSha256Prefix) + key);
  return root_ / "uses" / key;
}

SnapshotUse BlobStore::use(const std::string& key) const {
  const auto path = use_path(key);
  for (;;) {
    common::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!fd) throw sys_error("open " + path.string(), errno);
    while (::flock(fd.get(), LOCK_SH) != 0) {
      if (errno != EINTR) throw sys_error("flock " + path.string(), errno);
    }
    // An eviction that held the lock before us unlinked the file: a lock on it protects
    // nothing. Taken again on the file now at the path.
    struct stat held {};
    struct stat now {};
    if (::fstat(fd.get(), &held) != 0) throw sys_error("stat " + path.string(), errno);
    if (::stat(path.c_str(), &now) == 0 && now.st_ino == held.st_ino && now.st_dev == held.st_dev) {
      return SnapshotUse(std::move(fd));
    }
  }
}

common::UniqueFd BlobStore::lock_unused(const std::string& key) const {
  const auto path = use_path(key);
  common::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd) throw sys_error("open " + path.string(), errno);
  while (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return {};
    if (errno != EINTR) throw sys_error("flock " + path.string(), errno);
  }
  return fd;
}

bool BlobStore::in_use(const std::string& key) const { return !lock_unused(key); }

std::multimap<std::string, ChunkLocation> BlobStore::chunks_in_copies() const {
  std::multimap<std::string, ChunkLocation> out;
  for (const auto& s : list()) {
    if (s.materialised.empty() || ::access((s.materialised / kManifestName).c_str(), F_OK) != 0) {
      continue;
    }
    if (auto layout = snapshot(s.key)) out.merge(chunk_locations(*layout, s.materialised));
  }
  return out;
}

void BlobStore::remove_snapshot(const CachedSnapshot& s, common::UniqueFd lock) const {
  sfs::path hidden;
  if (!s.materialised.empty() && ::access(s.materialised.c_str(), F_OK) == 0) {
    // Out of sight first (a restore looks for PULLED/HEX/manifest.json), then removed: a
    // removal cut short leaves a hidden directory, never a half snapshot under its name.
    hidden = s.materialised.parent_path() / ("." + s.key + ".evicted-" + fs::random_id());
    if (::rename(s.materialised.c_str(), hidden.c_str()) != 0) {
      throw sys_error("rename " + s.materialised.string(), errno);
    }
  }
  std::error_code ec;
  sfs::remove(root_ / "snapshots" / (s.key + ".json"), ec);
  ::unlink(use_path(s.key).c_str());
  lock.reset();
  if (!hidden.empty()) fs::remove_tree_noexcept(hidden);
}

std::optional<Layout> BlobStore::snapshot(const std::string& key) const {
  digest_hex(std::string(kSha256Prefix) + key);
  std::string text;
  const auto path = root_ / "snapshots" / (key + ".json");
  if (!fs::try_read_file(path, &text)) return std::nullopt;
  if (text.size() > kMaxRecordBytes) return std::nullopt;
  try {
    return Layout::from_json(json::parse(text).at("layout"));
  } catch (const json::exception&) {
    return std::nullopt;  // a damaged record: as if not cached
  } catch (const Error&) {
    return std::nullopt;
  }
}

void BlobStore::touch(const std::string& key) const {
  const auto path = root_ / "snapshots" / (key + ".json");
  ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);
}

std::vector<CachedSnapshot> BlobStore::list() const {
  std::vector<CachedSnapshot> out;
  for (const auto& e : sfs::directory_iterator(root_ / "snapshots")) {
    const auto name = e.path().filename().string();
    if (e.path().extension() != ".json" || name.size() != 64 + 5) continue;
    std::string text;
    if (!fs::try_read_file(e.path(), &text) || text.size() > kMaxRecordBytes) continue;
    try {
      auto doc = json::parse(text);
      auto layout = Layout::from_json(doc.at("layout"));
      const int64_t used = mtime_ns(e.path());
      const std::string key = name.substr(0, 64);
      CachedSnapshot s{key,
                       doc.at("reference").get<std::string>(),
                       layout.apparent_bytes(),
                       layout.stored_bytes(),
                       used / 1000000000LL,
                       used,
                       materialised_of(doc, key),
                       0};
      if (!s.materialised.empty()) s.materialised_bytes = allocated_bytes(s.materialised);
      out.push_back(std::move(s));
    } catch (const std::exception&) {
      continue;  // a damaged record is not listed; evict() removes its blobs
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.last_used_ns != b.last_used_ns ? a.last_used_ns > b.last_used_ns : a.key < b.key;
  });
  return out;
}

EvictResult BlobStore::evict(uint64_t budget, const std::string& keep) {
  while (::flock(lock_.get(), LOCK_EX) != 0) {
    if (errno != EINTR) throw sys_error("flock " + (root_ / "lock").string(), errno);
  }
  EvictResult r;
  try {
    auto snaps = list();  // most recent first
    std::vector<std::vector<BlobInfo>> blobs_of(snaps.size());
    // The exclusive use lock of each snapshot nobody uses, held until it is kept or removed:
    // a restore that starts meanwhile waits, then finds the snapshot gone and pulls it again.
    std::vector<common::UniqueFd> unused(snaps.size());
    for (size_t i = 0; i < snaps.size(); ++i) {
      if (auto l = snapshot(snaps[i].key)) blobs_of[i] = l->blobs();
      if (snaps[i].key != keep) unused[i] = lock_unused(snaps[i].key);
    }
    // The blobs there are: a snapshot's uncompressed chunks may be in its copy alone.
    std::map<std::string, uint64_t> on_disk;
    for (const auto& e : sfs::directory_iterator(root_ / "blobs" / "sha256")) {
      std::error_code ec;
      const auto size = e.file_size(ec);
      if (!ec) on_disk[std::string(kSha256Prefix) + e.path().filename().string()] = size;
    }
    std::set<std::string> kept_blobs;
    uint64_t kept = 0;
    auto cost = [&](size_t i) {
      uint64_t extra = snaps[i].materialised_bytes;
      for (const auto& b : blobs_of[i]) {
        auto it = on_disk.find(b.digest);
        if (it != on_disk.end() && !kept_blobs.count(b.digest)) extra += it->second;
      }
      return extra;
    };
    auto keep_it = [&](size_t i) {
      kept += cost(i);
      for (const auto& b : blobs_of[i]) kept_blobs.insert(b.digest);
    };
    // What cannot leave is counted first; the others then stay, most recent first, while they
    // fit beside it.
    for (size_t i = 0; i < snaps.size(); ++i) {
      if (unused[i]) continue;
      keep_it(i);
      if (snaps[i].key != keep) r.in_use.push_back(snaps[i].key);
    }
    for (size_t i = 0; i < snaps.size(); ++i) {
      if (!unused[i]) continue;
      if (kept + cost(i) <= budget) {
        keep_it(i);
      } else {
        remove_snapshot(snaps[i], std::move(unused[i]));
        r.evicted.push_back(snaps[i].key);
      }
    }
    // Only the snapshots over the budget that are in use are worth naming.
    if (kept <= budget) r.in_use.clear();
    for (const auto& e : sfs::directory_iterator(root_ / "blobs" / "sha256")) {
      const std::string digest = std::string(kSha256Prefix) + e.path().filename().string();
      if (kept_blobs.count(digest)) continue;
      std::error_code ec;
      const auto size = e.file_size(ec);
      if (sfs::remove(e.path(), ec)) {
        ++r.blobs_removed;
        r.bytes_removed += ec ? 0 : size;
      }
    }
    // Chunks of writers that died (no pull runs now: the lock is exclusive).
    for (const auto& e : sfs::directory_iterator(root_ / "tmp")) {
      std::error_code ec;
      sfs::remove(e.path(), ec);
    }
    // Copies whose removal an eviction killed midway left under their hidden names.
    std::set<sfs::path> copies_dirs;
    for (const auto& snap : snaps) {
      if (!snap.materialised.empty()) copies_dirs.insert(snap.materialised.parent_path());
    }
    for (const auto& dir : copies_dirs) {
      std::error_code ec;
      for (const auto& e : sfs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name.starts_with(".") && name.find(".evicted-") != std::string::npos) {
          fs::remove_tree_noexcept(e.path());
        }
      }
    }
    // Use locks of snapshots no longer recorded (a pull that failed), unless held.
    for (const auto& e : sfs::directory_iterator(root_ / "uses")) {
      const std::string key = e.path().filename().string();
      if (!valid_digest(std::string(kSha256Prefix) + key) || recorded(key)) continue;
      if (auto lock = lock_unused(key)) ::unlink(e.path().c_str());
    }
    r.bytes_kept = kept;
  } catch (...) {
    ::flock(lock_.get(), LOCK_SH);
    throw;
  }
  ::flock(lock_.get(), LOCK_SH);
  return r;
}

}  // namespace gpusnap::store
