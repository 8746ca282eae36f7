// The store's parts on their own: references, the layout's checks, and an artifact with a
// sparse host image cut into chunks and written back exactly (same bytes, same holes).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <zstd.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "criu/criu.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "store/blob_store.h"
#include "store/byte_split.h"
#include "store/chunker.h"
#include "store/digest.h"
#include "store/layout.h"
#include "store/materialise.h"
#include "store/plain_artifact.h"
#include "store/reach.h"
#include "store/registry.h"
#include "store/snapshot_manifest.h"
#include "testing/unit.h"
#include "tier/layout.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
using store::OciRef;
namespace sfs = std::filesystem;

std::string usage_message(const std::string& text) {
  try {
    OciRef::parse(text);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    return e.what();
  }
  return "accepted";
}

TEST(OciRef, ParsesHostPortRepositoryTagAndDigest) {
  auto r = OciRef::parse("oci://127.0.0.1:5000/team/llama-8b:v1");
  EXPECT_EQ(r.host, "127.0.0.1:5000");
  EXPECT_EQ(r.repository, "team/llama-8b");
  EXPECT_EQ(r.tag, "v1");
  EXPECT_EQ(r.reference(), "v1");
  const std::string d = "sha256:" + std::string(64, 'a');
  auto by_digest = OciRef::parse("oci://registry.local/snap@" + d);
  EXPECT_EQ(by_digest.tag, "");
  EXPECT_EQ(by_digest.reference(), d);
  EXPECT_EQ(OciRef::parse("oci://h/r").tag, "latest");
  EXPECT_EQ(by_digest.str(), "oci://registry.local/snap@" + d);
}

TEST(OciRef, RefusesWhatIsNotAReference) {
  EXPECT_EQ(usage_message("docker://h/r"),
            "bad reference 'docker://h/r': it does not start with oci://");
  EXPECT_EQ(usage_message("oci://host"),
            "bad reference 'oci://host': no repository after the host");
  EXPECT_EQ(usage_message("oci://h/Upper"),
            "bad reference 'oci://h/Upper': the repository is not lower-case letters, digits and "
            ". _ - / as OCI allows");
  EXPECT_EQ(usage_message("oci://h/r@sha256:abc"),
            "bad reference 'oci://h/r@sha256:abc': the digest is not sha256: and 64 lower-case "
            "hex digits");
  EXPECT_EQ(usage_message("oci://h/../r"),
            "bad reference 'oci://h/../r': the repository is not lower-case letters, digits and "
            ". _ - / as OCI allows");
}

TEST(Credentials, ReadsAuthJsonAsSkopeoWritesIt) {
  TempDir dir;
  fs::write_file(dir / "auth.json",
                 R"({"auths":{"reg:5000":{"auth":"dXNlcjpwYXNzOndpdGg6Y29sb25z"}}})");
  auto c = store::find_credentials("reg:5000", "repo", (dir / "auth.json").string());
  EXPECT_EQ(c.username, "user");
  EXPECT_EQ(c.password, "pass:with:colons");
  EXPECT_EQ(store::find_credentials("other:5000", "repo", (dir / "auth.json").string()).username,
            "");
  fs::write_file(dir / "bad.json", "{not json");
  EXPECT_THROW(store::find_credentials("reg:5000", "repo", (dir / "bad.json").string()), Error);
}

TEST(RedirectLocation, ResolvesAbsoluteAndRelativeAndRefusesWhatIsNoAddress) {
  store::Origin from{"https", "reg", 5000, "reg:5000"};
  auto t = store::resolve_location("/v2/r/blobs/x?a=1", from);
  EXPECT_EQ(t.origin, from);
  EXPECT_EQ(t.path, "/v2/r/blobs/x?a=1");
  t = store::resolve_location("HTTPS://cdn.example.com/data?sig=1#frag", from);
  EXPECT_EQ(t.origin.str(), "https://cdn.example.com");
  EXPECT_EQ(t.origin.port, 443);
  EXPECT_EQ(t.path, "/data?sig=1");
  t = store::resolve_location("http://10.0.0.1:9000", from);
  EXPECT_EQ(t.origin.port, 9000);
  EXPECT_EQ(t.path, "/");
  for (const char* bad :
       {"", "ftp://h/x", "relative/path", "//h/x", "http://h:99999999999/x", "http://h:0/x",
        "http://h:-1/x", "http://h:80a/x", "http://u:p@h/x", "http:///x", "http://h\x01/x"}) {
    try {
      store::resolve_location(bad, from);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kEnvironment) << bad;
      EXPECT_NE(std::string(e.what()).find("reg:5000 redirected"), std::string::npos) << e.what();
    }
  }
}

// A small artifact: a CRIU-like pages file and a sparse host image whose data starts at
// `file_offset` (as a region that did not start on a 2 MiB boundary).
sfs::path make_artifact(const sfs::path& root, uint64_t file_offset, uint32_t seed) {
  sfs::create_directories(root / "criu");
  sfs::create_directories(root / "host-images");
  std::mt19937_64 rng(seed);
  std::string pages(3 << 20, '\0');
  for (size_t i = 0; i < pages.size() / 2; i += 8) {  // the second half stays zeros
    uint64_t v = rng();
    std::memcpy(pages.data() + i, &v, 8);
  }
  fs::write_file(root / "criu" / "pages-1.img", pages);
  // The region: 4 MiB of data, 8 MiB of zeros (a hole), 100 KiB of data, 7.9 MiB of zeros.
  const uint64_t region = 20ull << 20;
  std::mt19937_64 gpu(1234);  // the same GPU contents whatever the seed
  std::string a(4 << 20, '\0');
  for (size_t i = 0; i < a.size(); i += 8) {
    uint64_t v = gpu();
    std::memcpy(a.data() + i, &v, 8);
  }
  std::string b(100 << 10, 'x');
  const auto image = root / "host-images" / "1-7f0000000000.img";
  common::UniqueFd fd(::open(image.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  EXPECT_EQ(::pwrite(fd.get(), a.data(), a.size(), static_cast<off_t>(file_offset)),
            static_cast<ssize_t>(a.size()));
  EXPECT_EQ(::pwrite(fd.get(), b.data(), b.size(), static_cast<off_t>(file_offset + (12 << 20))),
            static_cast<ssize_t>(b.size()));
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(file_offset + region)), 0);
  fd.reset();

  Manifest m;
  m.id = fs::random_id();
  m.created = "2026-12-01T00:00:00Z";
  m.gpusnap_version = "test";
  m.host.page_size = 4096;
  HostImageRecord h;
  h.pid = 1;
  h.start = 0x7f0000000000ull + file_offset;
  h.end = h.start + region;
  h.file = "host-images/1-7f0000000000.img";
  h.file_offset = file_offset;
  h.criu_key = "file[1:2]";
  h.stored_bytes = a.size() + b.size();
  m.host_images.push_back(h);
  m.files = checksum_tree(root, m.chunk_bytes);
  fs::write_file(root / kManifestName, m.to_json().dump(2));
  return root;
}

// [data start, data end) ranges of a file, from SEEK_DATA/SEEK_HOLE.
std::vector<std::pair<off_t, off_t>> data_map(const sfs::path& p) {
  common::UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
  std::vector<std::pair<off_t, off_t>> out;
  const off_t size = ::lseek(fd.get(), 0, SEEK_END);
  for (off_t pos = 0; pos < size;) {
    off_t d = ::lseek(fd.get(), pos, SEEK_DATA);
    if (d < 0) break;
    off_t h = ::lseek(fd.get(), d, SEEK_HOLE);
    out.emplace_back(d, h);
    pos = h;
  }
  return out;
}

struct Stored {
  store::Layout layout;
  std::set<std::string> host_image_digests;
};

Stored chunk_into(const sfs::path& artifact, store::BlobStore& blobs) {
  Reporter quiet;
  Stored s;
  s.layout = store::chunk_artifact(
      Artifact::open(artifact), {},
      [&](const store::Chunk& c) { blobs.put(c.extent.digest, c.blob); }, quiet);
  for (const auto& f : s.layout.files) {
    if (f.path.starts_with("host-images/")) {
      for (const auto& e : f.extents) s.host_image_digests.insert(e.digest);
    }
  }
  return s;
}

TEST(Store, MaterialisesAnArtifactExactlyWithItsHoles) {
  TempDir dir;
  const uint64_t offset = 1 << 20;  // a region 1 MiB into its 2 MiB page
  auto src = make_artifact(dir / "src", offset, 1);
  store::BlobStore blobs(dir / "store");
  auto stored = chunk_into(src, blobs);
  // Zeros are not stored: the pages file's zero half, the image's holes and zero tails.
  // (Trimmed to 64 KiB blocks: at most one partial block more per extent.)
  const uint64_t nonzero = (3ull << 19) + (4ull << 20) + (100ull << 10);
  EXPECT_GE(stored.layout.data_bytes(), nonzero);
  EXPECT_LE(stored.layout.data_bytes(), nonzero + 64 * 1024 * 4);

  // Through JSON, as a registry would carry it.
  auto layout = store::Layout::from_json(json::parse(stored.layout.to_json().dump()));
  Reporter quiet;
  store::materialise(
      layout, dir / "out", [&](const store::BlobInfo& b) { return blobs.get(b.digest, b.size); },
      {}, quiet);
  auto out = Artifact::open(dir / "out");
  EXPECT_TRUE(out.verify().empty());
  for (const char* f : {"criu/pages-1.img", "host-images/1-7f0000000000.img"}) {
    EXPECT_EQ(fs::read_file(dir / "out" / f), fs::read_file(src / f)) << f;
  }
  // The image's holes are where the capture left them: the first MiB (file_offset) too.
  const auto image = "host-images/1-7f0000000000.img";
  EXPECT_EQ(data_map(dir / "out" / image), data_map(src / image));
  EXPECT_EQ(data_map(dir / "out" / image).at(0).first, static_cast<off_t>(offset));
}

// The order a restore overlapping its pull needs (store/stream.h): CRIU's images and the tier's
// small files first, host images next, the tier's drain files last and by offset across the
// files (the tier's fill reads them all at once, a worker each); and every file's written prefix
// reported as it grows, holes included, up to the file's size, never past what is written.
TEST(Store, MaterialiseWritesTheGpuMemoryLastAndReportsEachFilesWrittenPrefix) {
  TempDir dir;
  const auto src = make_artifact(dir / "src", 1 << 20, 1);
  sfs::create_directories(src / "tier");
  std::mt19937_64 rng(5);
  auto random_bytes = [&](size_t n) {
    std::string b(n, '\0');
    for (size_t i = 0; i + 8 <= n; i += 8) {
      const uint64_t v = rng();
      std::memcpy(b.data() + i, &v, 8);
    }
    return b;
  };
  // Drain file 0 starts with a 2 MiB hole; both hold 24 MiB of data in several chunks.
  fs::write_file(src / "tier" / "7-w0.img", std::string(2 << 20, '\0') + random_bytes(24 << 20));
  fs::write_file(src / "tier" / "7-w1.img", random_bytes(24 << 20));
  fs::write_file(src / "tier" / "7.json", "{}");
  fs::write_file(src / "tier" / "7.layout", "not a layout: cut like any file");
  Manifest m = Artifact::open(src).manifest();
  sfs::remove(src / kManifestName);  // not a file the manifest lists
  m.files = checksum_tree(src, m.chunk_bytes);
  fs::write_file(src / kManifestName, m.to_json().dump(2));
  store::BlobStore blobs(dir / "store");
  const auto layout = chunk_into(src, blobs).layout;

  std::mutex mu;
  std::vector<std::string> fetched;  // the files, in the order their chunks were asked for
  std::map<std::string, uint64_t> prefix;
  std::map<std::string, uint64_t> sizes;
  for (const auto& f : layout.files) sizes[f.path] = f.size;
  store::MaterialiseOptions o;
  o.threads = 1;
  o.arrival.prefix_written = [&](const std::string& path, uint64_t bytes) {
    std::lock_guard lock(mu);
    EXPECT_GT(bytes, prefix[path]) << path << ": a prefix only grows";
    EXPECT_LE(bytes, sizes[path]) << path;
    prefix[path] = bytes;
  };
  std::map<std::string, std::string> file_of;  // digest -> path
  for (const auto& f : layout.files)
    for (const auto& e : f.extents) file_of[e.digest] = f.path;
  Reporter quiet;
  store::materialise(
      layout, dir / "out",
      [&](const store::BlobInfo& b) {
        std::lock_guard lock(mu);
        fetched.push_back(file_of.at(b.digest));
        return blobs.get(b.digest, b.size);
      },
      o, quiet);
  EXPECT_TRUE(Artifact::open(dir / "out").verify().empty());
  for (const auto& [path, size] : sizes) EXPECT_EQ(prefix[path], size) << path;
  // Drain file 0's hole is there before any of its chunks.
  ASSERT_FALSE(fetched.empty());
  auto first = [&](const std::string& path) {
    return std::find(fetched.begin(), fetched.end(), path) - fetched.begin();
  };
  auto last = [&](const std::string& path) {
    return fetched.rend() - std::find(fetched.rbegin(), fetched.rend(), path) - 1;
  };
  const std::string image = "host-images/1-7f0000000000.img";
  EXPECT_LT(last("criu/pages-1.img"), first(image));
  EXPECT_LT(last("tier/7.layout"), first(image));
  EXPECT_LT(last(image), first("tier/7-w0.img"));
  EXPECT_LT(last(image), first("tier/7-w1.img"));
  // Interleaved: each drain file's first chunk comes before the other's last.
  EXPECT_LT(first("tier/7-w0.img"), last("tier/7-w1.img"));
  EXPECT_LT(first("tier/7-w1.img"), last("tier/7-w0.img"));
}

// A pull killed or failed leaves its staging directory (keep_partial); the next one writes into
// it (renamed to its own name), keeps every uncompressed extent intact there without asking the
// source, and clears what the layout does not hold (a byte written into a hole).
TEST(Store, MaterialiseResumesAStagingDirectoryKeepingWhatIsIntactThere) {
  TempDir dir;
  const auto src = make_artifact(dir / "src", 1 << 20, 1);
  store::BlobStore blobs(dir / "store");
  const auto layout = chunk_into(src, blobs).layout;
  size_t extents = 0;
  for (const auto& f : layout.files) extents += f.extents.size();
  Reporter quiet;
  const auto out = dir / "out";
  store::MaterialiseOptions first;
  first.threads = 1;
  first.keep_partial = true;
  int given = 0;
  EXPECT_THROW(store::materialise(
                   layout, out,
                   [&](const store::BlobInfo& b) {
                     if (given++ == 2) throw Error(ErrorKind::kEnvironment, "registry gone");
                     return blobs.get(b.digest, b.size);
                   },
                   first, quiet),
               Error);
  std::vector<sfs::path> staged;
  for (const auto& e : sfs::directory_iterator(dir.path())) {
    if (e.path().filename().string().starts_with(".out.staging-")) staged.push_back(e.path());
  }
  ASSERT_EQ(staged.size(), 1u);
  const std::string image = "host-images/1-7f0000000000.img";
  {
    ::chmod((staged[0] / image).c_str(), 0600);
    common::UniqueFd fd(::open((staged[0] / image).c_str(), O_WRONLY | O_CLOEXEC));
    ASSERT_EQ(::pwrite(fd.get(), "x", 1, 100), 1);  // the first MiB is a hole
  }

  artifact::StagingDir earlier{
      staged[0], common::UniqueFd(::open(staged[0].c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC))};
  ASSERT_EQ(::flock(earlier.lock.get(), LOCK_EX | LOCK_NB), 0);
  store::MaterialiseOptions again;
  again.resume = &earlier;
  std::atomic<size_t> asked{0};
  const auto r = store::materialise(
      layout, out,
      [&](const store::BlobInfo& b) {
        ++asked;
        return blobs.get(b.digest, b.size);
      },
      again, quiet);
  EXPECT_GE(r.extents_kept, 1u);
  EXPECT_EQ(r.extents_kept + asked, extents);
  EXPECT_TRUE(Artifact::open(out).verify().empty());
  for (const char* f : {"criu/pages-1.img", "host-images/1-7f0000000000.img"}) {
    EXPECT_EQ(fs::read_file(out / f), fs::read_file(src / f)) << f;
  }
  EXPECT_EQ(data_map(out / image), data_map(src / image));
  EXPECT_FALSE(sfs::exists(staged[0]));
}

TEST(Store, TheSameGpuMemoryAtAnotherAddressGivesTheSameChunks) {
  TempDir dir;
  store::BlobStore blobs(dir / "store");
  auto a = chunk_into(make_artifact(dir / "a", 1 << 20, 1), blobs);
  auto b = chunk_into(make_artifact(dir / "b", 384 << 10, 2), blobs);
  EXPECT_FALSE(a.host_image_digests.empty());
  EXPECT_EQ(a.host_image_digests, b.host_image_digests);
}

TEST(Store, LayoutRefusesPathsOutsideTheArtifactAndOverlaps) {
  TempDir dir;
  auto src = make_artifact(dir / "src", 0, 1);
  store::BlobStore blobs(dir / "store");
  auto doc = chunk_into(src, blobs).layout.to_json();
  auto message = [](const json& d) -> std::string {
    try {
      store::Layout::from_json(d);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(message(doc), "accepted");
  auto escape = doc;
  escape["files"][0]["path"] = "../../etc/cron.d/x";
  EXPECT_EQ(message(escape),
            "bad snapshot layout: file '../../etc/cron.d/x': not a plain relative path inside the "
            "artifact");
  auto overlap = doc;
  auto& ex = overlap["files"][0]["extents"];
  ASSERT_GE(ex.size(), 2u);
  ex[1][0] = ex[0][0].get<uint64_t>() + 1;
  EXPECT_NE(message(overlap).find("bad snapshot layout: file '" +
                                  overlap["files"][0]["path"].get<std::string>() + "' at offset"),
            std::string::npos)
      << message(overlap);
  EXPECT_NE(message(overlap).find("extent overlaps another or ends past the file"),
            std::string::npos);
  auto bad_digest = doc;
  bad_digest["files"][0]["extents"][0][2] = "sha256:xyz";
  EXPECT_NE(message(bad_digest).find("not a sha256 digest"), std::string::npos);
}

// ---- The memory tier's drain files, cut at their pieces -------------------------------------

// A model's memory as the drain's pieces: large pieces of whole tensors (4 MiB, the drain's piece
// size, a tensor's last 1.5 MiB, one larger than a chunk) and many small ones (norms, biases),
// each of its own bytes.
std::vector<std::string> model_pieces() {
  std::vector<std::string> out;
  std::mt19937_64 rng(7);
  auto piece = [&](uint64_t size) {
    std::string s(size, '\0');
    for (size_t i = 0; i + 8 <= s.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(s.data() + i, &v, 8);
    }
    out.push_back(std::move(s));
  };
  for (int i = 0; i < 12; ++i) piece(4 << 20);
  for (int i = 0; i < 4; ++i) piece(3 << 19);
  piece(10 << 20);
  for (int i = 0; i < 60; ++i) piece(512 * (1 + rng() % 64));  // 512 B to 32 KiB
  return out;
}

// The pieces as a drain with `files` workers racing for them might leave them: taken in an order
// of `seed`, each appended to one of the files, chosen by `seed` too. Returns each chunk the cuts
// make (its digest and size) and how many bytes the small pieces are.
struct DrainCut {
  std::map<std::string, uint64_t> chunks;
  uint64_t small_bytes = 0;
};
DrainCut drain_and_cut(const std::vector<std::string>& pieces, size_t files, uint32_t seed) {
  const store::ChunkingOptions o;
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::string> data(files);
  std::vector<std::vector<store::Cut>> where(files);
  DrainCut out;
  for (size_t i : order) {
    const size_t k = rng() % files;
    where[k].push_back({data[k].size(), pieces[i].size()});
    data[k] += pieces[i];
    if (pieces[i].size() < o.tier_glue_below) out.small_bytes += pieces[i].size();
  }
  for (size_t k = 0; k < files; ++k) {
    const auto cuts = store::plan_tier_cuts(where[k], data[k].size(), o);
    EXPECT_TRUE(cuts.has_value());
    if (!cuts) continue;
    uint64_t pos = 0;
    for (const store::Cut& c : *cuts) {
      EXPECT_EQ(c.offset, pos) << "the cuts cover the file in order";
      EXPECT_LE(c.length, std::max(o.host_image_chunk, o.cdc_max));
      pos = c.offset + c.length;
      out.chunks[store::sha256_digest(std::string_view(data[k]).substr(c.offset, c.length))] =
          c.length;
    }
    EXPECT_EQ(pos, data[k].size());
  }
  return out;
}

TEST(StoreTierCuts, TheSamePiecesInOtherFilesAndOrdersGiveTheSameChunks) {
  const auto pieces = model_pieces();
  const DrainCut a = drain_and_cut(pieces, 3, 1);
  const DrainCut b = drain_and_cut(pieces, 5, 2);
  uint64_t total = 0;
  uint64_t only_in_b = 0;
  for (const auto& [digest, size] : b.chunks) {
    total += size;
    if (a.chunks.count(digest) == 0) only_in_b += size;
  }
  for (const auto& p : pieces) {
    if (p.size() < store::ChunkingOptions{}.tier_glue_below) continue;
    // A large piece's chunks are its own, from its start: in both drains, whatever file and
    // offset each put it at.
    for (size_t at = 0; at < p.size(); at += store::ChunkingOptions{}.host_image_chunk) {
      const auto d = store::sha256_digest(
          std::string_view(p).substr(at, store::ChunkingOptions{}.host_image_chunk));
      EXPECT_EQ(a.chunks.count(d), 1u);
      EXPECT_EQ(b.chunks.count(d), 1u);
    }
  }
  // What the second drain adds is at most its glued small pieces, whose neighbours changed.
  EXPECT_LE(only_in_b, b.small_bytes);
  EXPECT_LT(only_in_b * 20, total) << only_in_b << " of " << total << " bytes new";
  // Glued: far fewer chunks than small pieces.
  EXPECT_LT(b.chunks.size(), pieces.size() - 30);
}

TEST(StoreTierCuts, PiecesThatDoNotFitTheFileGiveNoCutsAndUnnamedBytesAreCutToo) {
  const store::ChunkingOptions o;
  const uint64_t mib = 1 << 20;
  EXPECT_FALSE(store::plan_tier_cuts({{0, 2 * mib}, {mib, 2 * mib}}, 4 * mib, o))
      << "overlapping pieces";
  EXPECT_FALSE(store::plan_tier_cuts({{3 * mib, 2 * mib}}, 4 * mib, o)) << "past the end";
  EXPECT_FALSE(store::plan_tier_cuts({{~uint64_t{0}, 2}}, 4 * mib, o)) << "an offset that wraps";
  // A gap and a tail no piece names; a piece larger than a chunk; two small pieces glued.
  const auto cuts = store::plan_tier_cuts(
      {{20 * mib, 4096}, {mib, 10 * mib}, {20 * mib + 4096, 8192}}, 24 * mib, o);
  ASSERT_TRUE(cuts);
  EXPECT_EQ(*cuts, (std::vector<store::Cut>{{0, mib},
                                            {mib, 8 * mib},
                                            {9 * mib, 2 * mib},
                                            {11 * mib, 8 * mib},
                                            {19 * mib, mib},
                                            {20 * mib, 12288},
                                            {20 * mib + 12288, 4 * mib - 12288}}));
}

// An artifact of one drain: two drain files and the layout of their pieces (`layout_text`
// instead, when given: a layout that does not read).
sfs::path make_tier_artifact(const sfs::path& root, const std::string& layout_text = "") {
  sfs::create_directories(root / "tier");
  const auto pieces = model_pieces();
  tier::TierLayout layout;
  layout.files = 2;
  std::string data[2];
  tier::DevicePtr va = 0x7f0000000000;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const size_t k = i % 2;
    layout.segments.push_back({va, pieces[i].size(), 0});
    layout.pieces.push_back({va, pieces[i].size(), 0, k, data[k].size()});
    data[k] += pieces[i];
    va += 64 << 20;
  }
  fs::write_file(root / "tier" / "42-w0.img", data[0]);
  fs::write_file(root / "tier" / "42-w1.img", data[1]);
  if (layout_text.empty()) {
    tier::write_layout(root / "tier" / "42.layout", layout);
  } else {
    fs::write_file(root / "tier" / "42.layout", layout_text);
  }
  write_plain_manifest(root);
  return root;
}

TEST(StoreTierCuts, ADrainIsCutAtItsPiecesAndComesBackWholeWithOrWithoutItsLayout) {
  TempDir dir;
  for (const std::string bad : {"", "not a layout"}) {
    SCOPED_TRACE(bad.empty() ? "with its layout" : "with a layout that does not read");
    const auto src = make_tier_artifact(dir / ("src" + std::to_string(bad.size())), bad);
    store::BlobStore blobs(dir / "store");
    const auto stored = chunk_into(src, blobs);
    // With the layout, every chunk of the first file starts at a piece (pieces alternate
    // between the two files); without, the cuts are content-defined and fall anywhere.
    std::set<uint64_t> piece_starts;
    uint64_t at = 0;
    const auto pieces = model_pieces();
    for (size_t i = 0; i < pieces.size(); i += 2) {
      piece_starts.insert(at);
      at += pieces[i].size();
    }
    bool all_at_pieces = true;
    for (const auto& f : stored.layout.files) {
      if (f.path != "tier/42-w0.img") continue;
      for (const auto& e : f.extents) {
        if (piece_starts.count(e.offset) == 0 && piece_starts.count(e.offset - (8 << 20)) == 0)
          all_at_pieces = false;
      }
    }
    EXPECT_EQ(all_at_pieces, bad.empty());
    // Either way the snapshot is the artifact, byte for byte.
    const auto out = dir / ("out" + std::to_string(bad.size()));
    Reporter quiet;
    store::materialise(
        store::Layout::from_json(json::parse(stored.layout.to_json().dump())), out,
        [&](const store::BlobInfo& b) { return blobs.get(b.digest, b.size); }, {}, quiet);
    for (const char* f : {"tier/42-w0.img", "tier/42-w1.img", "tier/42.layout"}) {
      EXPECT_TRUE(fs::read_file(out / f) == fs::read_file(src / f)) << f;
    }
  }
}

// What `read` throws: an Error of kind kBadArtifact, its message; "accepted" when it returns.
template <typename Read>
std::string refusal(Read read) {
  try {
    read();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    return e.what();
  }
  return "accepted";
}

// What a registry serves is read from bytes, bounded, and refused with the reason: each refusal
// below is an exact message, and nothing nested deeper than 64 levels reaches a caller.
TEST(SnapshotManifest, ReadsBothVersionsAndRefusesWhatIsNotASnapshotsManifest) {
  const std::string digest = "sha256:" + std::string(64, 'a');
  const json layout_layer = {
      {"mediaType", store::kConfigMediaType}, {"digest", digest}, {"size", 1234}};
  const json v2 = {{"schemaVersion", 2},
                   {"mediaType", store::kOciManifestMediaType},
                   {"artifactType", store::kArtifactType},
                   {"config",
                    {{"mediaType", store::kOciImageConfigMediaType},
                     {"digest", "sha256:" + std::string(64, 'b')},
                     {"size", 10}}},
                   {"layers", json::array({layout_layer})}};
  const json v1 = {{"schemaVersion", 2}, {"config", layout_layer}, {"layers", json::array()}};
  for (const json& m : {v2, v1}) {
    const auto read = store::read_snapshot_manifest(m.dump(), "r/s:v1");
    EXPECT_EQ(read.layout_digest, digest);
    EXPECT_EQ(read.layout_size, 1234u);
    EXPECT_EQ(read.doc, m);
  }
  auto message = [](const std::string& body) {
    return refusal([&] { store::read_snapshot_manifest(body, "r/s:v1"); });
  };
  const std::string prefix = "r/s:v1 is not a gpusnap snapshot: ";
  EXPECT_EQ(message(std::string(100000, '[') + std::string(100000, ']')),
            prefix + "its manifest is not JSON: nested deeper than 64 levels");
  EXPECT_EQ(message("[1, 2]"), prefix + "its manifest has no config");
  json image = v2;
  image["config"]["mediaType"] = "application/vnd.docker.container.image.v1+json";
  EXPECT_EQ(message(image.dump()),
            prefix + "its config is 'application/vnd.docker.container.image.v1+json'");
  json other = v2;
  other["layers"] = json::array();
  EXPECT_EQ(message(other.dump()), prefix + "an image whose first layer is not a gpusnap layout");
  for (const json& bad_layer :
       {json{{"mediaType", store::kConfigMediaType}, {"digest", "sha256:xyz"}, {"size", 1}},
        json{{"mediaType", store::kConfigMediaType}, {"digest", digest}, {"size", -1}},
        json{{"mediaType", store::kConfigMediaType},
             {"digest", digest},
             {"size", store::kMaxLayoutBytes + 1}}}) {
    json m = v2;
    m["layers"][0] = bad_layer;
    EXPECT_EQ(message(m.dump()), prefix + "its layout descriptor is malformed") << bad_layer;
  }
}

TEST(SnapshotManifest, LayersAreDescriptorsOfTheLayoutsChunksAndCountsAreCapped) {
  TempDir dir;
  store::BlobStore blobs(dir / "store");
  const auto layout = chunk_into(make_artifact(dir / "src", 0, 3), blobs).layout;
  json layers = json::array({{{"mediaType", store::kConfigMediaType},
                              {"digest", "sha256:" + std::string(64, 'a')},
                              {"size", 10}}});
  for (const auto& b : layout.blobs()) {
    layers.push_back(
        {{"mediaType", store::kChunkMediaType}, {"digest", b.digest}, {"size", b.size}});
  }
  const json v2 = {{"schemaVersion", 2},
                   {"artifactType", store::kArtifactType},
                   {"config",
                    {{"mediaType", store::kOciImageConfigMediaType},
                     {"digest", "sha256:" + std::string(64, 'b')},
                     {"size", 10}}},
                   {"layers", layers}};
  auto check = [&](const json& m) {
    return refusal([&] {
      std::set<std::string> seen;
      store::check_snapshot_layers(store::read_snapshot_manifest(m.dump(), "r/s:1"), layout,
                                   "r/s:1", seen);
    });
  };
  EXPECT_EQ(check(v2), "accepted");
  const std::string prefix = "r/s:1 is not a gpusnap snapshot: ";
  json empty = v2;
  empty["layers"][1] = json::object();
  EXPECT_EQ(check(empty), prefix + "layer 1 is not a descriptor with a sha256 digest and a size");
  json foreign = v2;
  foreign["layers"][1]["digest"] = "sha256:" + std::string(64, 'c');
  EXPECT_EQ(check(foreign),
            prefix + "layer 1 (sha256:" + std::string(64, 'c') + ") is no chunk of its layout");
  json resized = v2;
  resized["layers"][1]["size"] = 7;
  EXPECT_NE(check(resized).find("layer 1 says size 7 where the layout's chunk"), std::string::npos);
  json more = v2;
  more["layers"].push_back(more["layers"][1]);
  EXPECT_NE(check(more).find(" layers for a layout of "), std::string::npos);
  // 4 MiB of empty layers is refused before it is built in memory.
  std::string flood = R"({"config":{},"layers":[)";
  for (int i = 0; i < 1300000; ++i) flood += "{},";
  flood += "{}]}";
  EXPECT_EQ(refusal([&] { store::read_snapshot_manifest(flood, "r/s:1"); }),
            prefix + "its manifest holds more than 300000 JSON values");
}

TEST(SnapshotManifest, ALayoutNestedTooDeepOrNotALayoutIsRefused) {
  auto message = [](const std::string& body) {
    return refusal([&] { store::read_snapshot_layout(body, "r/s:v1"); });
  };
  EXPECT_EQ(message(R"({"format":"gpusnap-layout","manifest":{"note":)" + std::string(70, '[') +
                    std::string(70, ']') + "}}"),
            "r/s:v1 is not a gpusnap snapshot: its layout is not JSON: nested deeper than 64 "
            "levels");
  EXPECT_EQ(message("{]"), "r/s:v1 is not a gpusnap snapshot: its layout is not JSON: "
                           "[json.exception.parse_error.101] parse error at line 1, column 2: "
                           "syntax error while parsing object key - unexpected ']'; expected "
                           "string literal");
  EXPECT_EQ(message("{}").rfind("bad snapshot layout: ", 0), 0u) << message("{}");
}

// A layout of `chunks` distinct chunks of 4 KiB in one file, as the manifest writer sees it.
store::Layout layout_of_chunks(size_t chunks) {
  store::Layout layout;
  store::FileLayout f{"checkpoint/pages-1.img", chunks * 4096, {}};
  for (size_t i = 0; i < chunks; ++i) {
    f.extents.push_back(
        {i * 4096, 4096, store::sha256_digest(std::to_string(i)), store::Encoding::kZstd, 1000});
  }
  layout.files.push_back(std::move(f));
  return layout;
}

TEST(SnapshotManifest, ChunksBeyondOneManifestAreSplitAcrossAnIndex) {
  const store::Descriptor layout_blob{"sha256:" + std::string(64, 'a'), 100};
  const store::Descriptor config{"sha256:" + std::string(64, 'b'), 10};
  const json labels = {{"org.gpusnap.artifact.id", "x"}};

  // Few chunks: one manifest (version 2), every layer titled with what it stores.
  const auto few =
      store::snapshot_manifests(layout_of_chunks(3), layout_blob, config, labels, "amd64");
  ASSERT_EQ(few.parts.size(), 1u);
  EXPECT_TRUE(few.index.empty());
  const json one = json::parse(few.parts[0]);
  EXPECT_EQ(one.at("layers").size(), 4u);
  EXPECT_EQ(one.at("layers")[0].at("annotations").at(store::kTitleAnnotation), "layout.json");
  EXPECT_EQ(one.at("layers")[2].at("annotations").at(store::kTitleAnnotation),
            "checkpoint/pages-1.img@4096");
  EXPECT_FALSE(one.at("annotations").contains(store::kPartAnnotation));
  EXPECT_FALSE(store::is_snapshot_index(few.parts[0]));

  // 40,000 chunks (about 9 MiB of layers): parts under docker-registry's 4 MiB, an index of
  // them, each chunk in exactly one part, read back as pull reads them.
  const store::Layout big = layout_of_chunks(40000);
  const auto split = store::snapshot_manifests(big, layout_blob, config, labels, "amd64");
  ASSERT_GE(split.parts.size(), 3u);
  ASSERT_TRUE(store::is_snapshot_index(split.index));
  json index;
  const auto digests = store::read_snapshot_index(split.index, "r/s:1", index);
  ASSERT_EQ(digests.size(), split.parts.size());
  EXPECT_EQ(index.at("annotations"), labels);
  std::set<std::string> seen;
  for (size_t i = 0; i < split.parts.size(); ++i) {
    EXPECT_LE(split.parts[i].size(), store::kMaxManifestBytes);
    EXPECT_EQ(digests[i], store::sha256_digest(split.parts[i]));
    const auto m = store::read_snapshot_manifest(split.parts[i], "r/s:1");
    EXPECT_EQ(m.layout_digest, layout_blob.digest);
    EXPECT_EQ(m.part, std::to_string(i + 1) + "/" + std::to_string(split.parts.size()));
    store::check_snapshot_layers(m, big, "r/s:1", seen);
  }
  EXPECT_EQ(seen.size(), 40000u);

  // An index that is not one gpusnap writes is refused for what it is.
  const std::string prefix = "r/s:1 is not a gpusnap snapshot: ";
  auto refused = [&](const json& doc) {
    return refusal([&] {
      json out;
      store::read_snapshot_index(doc.dump(), "r/s:1", out);
    });
  };
  json twice = index;
  twice["manifests"][1] = twice["manifests"][0];
  EXPECT_EQ(refused(twice), prefix + "its index's manifest 1 is not a descriptor of an image "
                                     "manifest of at most 4 MiB listed once");
  json nested = index;
  nested["manifests"][0]["mediaType"] = store::kOciImageIndexMediaType;
  EXPECT_EQ(refused(nested), prefix + "its index's manifest 0 is not a descriptor of an image "
                                      "manifest of at most 4 MiB listed once");
  json many = index;
  many["manifests"] = json::array();
  for (size_t i = 0; i <= store::kMaxManifestParts; ++i) many["manifests"].push_back(1);
  EXPECT_EQ(refused(many), prefix + "its index lists 4097 manifests, more than the 4096 of a "
                                    "snapshot");
  json foreign = index;
  foreign.erase("artifactType");
  EXPECT_EQ(refused(foreign), prefix + "its index lists no snapshot manifests");
}

// The cache writes chunks with O_DIRECT where the filesystem takes it (whole blocks through an
// aligned buffer, the tail after) and through the page cache where it does not: every length
// comes back whole and root-only, on the disk's filesystem and on tmpfs.
TEST(StoreEncoding, AByteSplitComesBackWholeAtEveryLength) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{64}, size_t{4097}}) {
    std::string in(n, '\0');
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<char>(i * 7 + 3);
    std::string split(n, '\0');
    std::string joined(n, '\0');
    store::split_bytes(in.data(), n, split.data());
    // The bytes at even offsets first.
    for (size_t i = 0; i < (n + 1) / 2; ++i) ASSERT_EQ(split[i], in[2 * i]) << n;
    store::join_bytes(split.data(), n, joined.data());
    EXPECT_EQ(joined, in) << n;
  }
}

// Each chunk is stored the way its bytes compress best: 16-bit numbers as a model's weights hold
// them (a narrow sign-and-exponent byte beside a noisy one) byte-split, text as it is, noise raw;
// and every one comes back exact.
TEST(StoreEncoding, WeightsAreStoredByteSplitTextAsItIsNoiseRawAndAllComeBackExact) {
  TempDir dir;
  const auto src = dir / "src";
  sfs::create_directories(src / "criu");
  std::mt19937_64 rng(7);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  std::string pages;
  for (size_t i = 0; i < (4u << 20) / 2; ++i) {  // bf16: the top half of a float's bits
    const float w = weight(rng);
    uint32_t bits = 0;
    std::memcpy(&bits, &w, 4);
    pages.push_back(static_cast<char>((bits >> 16) & 0xff));
    pages.push_back(static_cast<char>(bits >> 24));
  }
  for (size_t i = 0; pages.size() < (8u << 20); ++i) {
    pages += "line " + std::to_string(i % 977) + " of a log that repeats itself\n";
  }
  pages.resize(8u << 20);
  for (size_t i = 0; i < (4u << 20); i += 8) {
    const uint64_t v = rng();
    pages.append(reinterpret_cast<const char*>(&v), 8);
  }
  fs::write_file(src / "criu" / "pages-1.img", pages);
  write_plain_manifest(src);

  store::BlobStore blobs(dir / "store");
  const auto stored = chunk_into(src, blobs);
  std::map<store::Encoding, uint64_t> length_by;
  for (const auto& f : stored.layout.files) {
    for (const auto& e : f.extents) {
      length_by[e.encoding] += e.length;
      if (e.encoding != store::Encoding::kZstdSplit2) continue;
      // Split, it is smaller than zstd makes the same bytes as they are.
      const std::string bytes = fs::read_file(src / f.path).substr(e.offset, e.length);
      std::string out(ZSTD_compressBound(bytes.size()), '\0');
      const size_t plain = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 1);
      ASSERT_FALSE(ZSTD_isError(plain));
      EXPECT_LT(e.stored, plain) << "at " << e.offset;
    }
  }
  // Chunks are cut by content: those that straddle two kinds take the encoding that suits most.
  EXPECT_GE(length_by[store::Encoding::kZstdSplit2], 2u << 20);
  EXPECT_GE(length_by[store::Encoding::kZstd], 2u << 20);
  EXPECT_GE(length_by[store::Encoding::kRaw], 2u << 20);

  // Through JSON, as a registry would carry it, and back.
  auto layout = store::Layout::from_json(json::parse(stored.layout.to_json().dump()));
  Reporter quiet;
  const auto result = store::materialise(
      layout, dir / "out", [&](const store::BlobInfo& b) { return blobs.get(b.digest, b.size); },
      {}, quiet);
  EXPECT_TRUE(Artifact::open(dir / "out").verify().empty());
  EXPECT_EQ(fs::read_file(dir / "out" / "criu" / "pages-1.img"), pages);
  EXPECT_GT(result.cpu.decode, 0.0);
}

TEST(Store, ChunksOfAnyLengthComeBackWholeOnDiskAndOnTmpfs) {
  TempDir disk;
  std::vector<std::filesystem::path> roots = {disk / "store"};
  // A folder on tmpfs, removed at the end whatever happens.
  struct ShmDir {
    std::filesystem::path path;
    ~ShmDir() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
  } shm;
  std::string tmpl = "/dev/shm/gpusnap-test-XXXXXX";
  if (::mkdtemp(tmpl.data()) != nullptr) {
    shm.path = tmpl;
    roots.push_back(shm.path / "store");
  }
  for (const auto& root : roots) {
    SCOPED_TRACE(root.string());
    store::BlobStore blobs(root);
    for (size_t size : {size_t{1}, size_t{4096}, size_t{3 * 4096 + 17}, size_t{(9u << 20) + 123}}) {
      std::string data(size, '\0');
      for (size_t i = 0; i < size; ++i) data[i] = static_cast<char>((i * 131 + size) % 251);
      const auto digest = store::sha256_digest(data);
      blobs.put(digest, data);
      EXPECT_EQ(blobs.get(digest, size), data) << size;
      struct stat st {};
      ASSERT_EQ(::stat((root / "blobs" / "sha256" / store::digest_hex(digest)).c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0600u);
    }
  }
  EXPECT_EQ(roots.size(), 2u) << "no tmpfs at /dev/shm: only the disk was tried";
}

TEST(Store, ADamagedChunkInTheCacheIsRemovedAndReported) {
  TempDir dir;
  store::BlobStore blobs(dir / "store");
  const std::string data = "chunk bytes";
  const auto digest = store::sha256_digest(data);
  blobs.put(digest, data);
  EXPECT_EQ(blobs.get(digest, 100), data);
  fs::write_file(dir / "store" / "blobs" / "sha256" / store::digest_hex(digest), "chunk bytez");
  try {
    blobs.get(digest, 100);
    FAIL() << "a damaged chunk was returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(std::string(e.what()),
              "chunk " + digest + " in the node cache does not match its digest");
  }
  EXPECT_FALSE(blobs.has(digest));
}

// Node copies (RUN_DIR/pulled/KEY) count in the cache's budget and leave with their snapshot,
// least recently used first; a snapshot in use stays whatever the budget, and a record never
// makes eviction remove a directory that is not named by its key.
TEST(Store, EvictionTakesTheNodesCopyWithItsSnapshotAndLeavesOneInUse) {
  TempDir dir;
  auto src = make_artifact(dir / "src", 1 << 20, 1);
  store::BlobStore cache(dir / "cache");
  auto stored = chunk_into(src, cache);
  const auto pulled = dir / "run" / "pulled";
  sfs::create_directories(pulled);
  // Three snapshots of the same bytes (their chunks shared, counted once), each with its copy.
  std::vector<std::string> keys;
  for (char c : {'a', 'b', 'c'}) {
    keys.emplace_back(64, c);
    sfs::copy(src, pulled / keys.back(), sfs::copy_options::recursive);
    cache.record_snapshot(keys.back(), "oci://r/s:" + std::string(1, c), stored.layout,
                          pulled / keys.back());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // distinct last uses
  }
  auto listed = cache.list();
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0].key, keys[2]);
  const uint64_t copy = listed[0].materialised_bytes;
  EXPECT_GT(copy, 4ull << 20);
  const uint64_t chunks = cache.blob_bytes();
  // Room for the chunks and two copies. With 'a' (the oldest) in use, 'b' leaves instead.
  const uint64_t budget = chunks + 2 * copy + copy / 2;
  {
    auto in_use = cache.use(keys[0]);
    EXPECT_TRUE(cache.in_use(keys[0]));
    auto r = cache.evict(budget, keys[2]);
    EXPECT_EQ(r.evicted, std::vector<std::string>{keys[1]});
    EXPECT_LE(r.bytes_kept, budget);
    EXPECT_FALSE(sfs::exists(pulled / keys[1]));
    EXPECT_TRUE(sfs::exists(pulled / keys[0] / kManifestName));
    // A budget that holds one copy: 'a' stays in use beyond it, named so.
    r = cache.evict(chunks + copy, keys[2]);
    EXPECT_EQ(r.evicted, std::vector<std::string>{});
    EXPECT_EQ(r.in_use, std::vector<std::string>{keys[0]});
  }
  EXPECT_FALSE(cache.in_use(keys[0]));
  // What an eviction killed while it removed a copy left under a hidden name goes too.
  sfs::create_directories(pulled / ("." + keys[1] + ".evicted-0123") / "criu");
  auto r = cache.evict(chunks + copy, keys[2]);
  EXPECT_EQ(r.evicted, std::vector<std::string>{keys[0]});
  EXPECT_FALSE(sfs::exists(pulled / keys[0]));
  EXPECT_EQ(cache.blob_bytes(), chunks) << "chunks 'c' still uses left";
  // Nothing hidden is left where the copies were, nor use locks of snapshots gone.
  EXPECT_EQ(std::distance(sfs::directory_iterator(pulled), sfs::directory_iterator()), 1);
  EXPECT_FALSE(sfs::exists(dir / "cache" / "uses" / keys[0]));
  EXPECT_FALSE(sfs::exists(dir / "cache" / "uses" / keys[1]));

  // A record naming a directory not named by its key (damaged, or written by hand): the
  // snapshot leaves, the directory stays.
  const std::string other(64, 'd');
  sfs::create_directories(dir / "elsewhere");
  cache.record_snapshot(other, "oci://r/s:d", stored.layout, dir / "elsewhere");
  cache.touch(keys[2]);
  r = cache.evict(0, keys[2]);
  EXPECT_EQ(r.evicted, std::vector<std::string>{other});
  EXPECT_TRUE(sfs::exists(dir / "elsewhere"));
}

// A local artifact is reached as it is: checked once against this host (the restore is then
// told so, and does not probe the host again), refused before anything when it was taken
// elsewhere, unchecked only with any_host (`pull --any-host`).
TEST(StoreReach, ALocalArtifactIsCheckedOnceAndHandedToTheRestoreChecked) {
  // The host's facts name its CRIU: found, not run as root (the unit tests need no root).
  std::optional<criu::Binary> criu_binary;
  try {
    criu_binary = criu::locate();
  } catch (const Error& e) {
    GTEST_SKIP() << "skipped: no CRIU: " << e.what();
  }
  TempDir dir;
  const auto path = make_artifact(dir / "snap", 0, 1);
  const auto set_host = [&](const HostFacts& host) {
    auto m = Artifact::open(path).manifest();
    m.host = host;
    fs::write_file(path / kManifestName, m.to_json().dump(2));
  };
  const HostFacts here = HostFacts::probe(criu_binary->version);
  set_host(here);
  Reporter quiet;
  store::ReachOptions options;
  {
    store::SnapshotSource source(path.string(), options, store::Arrival::kWhileRestoring, quiet);
    RestoreOptions ro;
    source.prepare(ro);
    EXPECT_EQ(ro.artifact, path);
    EXPECT_EQ(ro.arriving, nullptr);
    EXPECT_TRUE(ro.host_checked);
    EXPECT_FALSE(source.remote());
    EXPECT_FALSE(source.pulls());
    EXPECT_EQ(source.pulled(), nullptr);
    EXPECT_EQ(source.summary(), "");
  }
  HostFacts elsewhere = here;
  elsewhere.arch = "riscv64";
  set_host(elsewhere);
  try {
    store::SnapshotSource source(path.string(), options, store::Arrival::kWhileRestoring, quiet);
    ADD_FAILURE() << "an artifact taken on riscv64 was reached";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIncompatible);
    EXPECT_EQ(std::string(e.what()), "artifact was taken on riscv64, this host is " + here.arch);
  }
  options.any_host = true;
  store::SnapshotSource unchecked(path.string(), options, store::Arrival::kWhileRestoring, quiet);
  RestoreOptions ro;
  unchecked.prepare(ro);
  EXPECT_FALSE(ro.host_checked);  // the restore checks it on open, and refuses it there
}

}  // namespace
}  // namespace gpusnap::testing
