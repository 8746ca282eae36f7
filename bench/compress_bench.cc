// Whether compressing an artifact pays: zstd at levels 1 and 3 on the artifact's kinds of data,
// host images and the memory tier's drain files (GPU memory) and CRIU's page images (CPU
// memory), and zstd -1 of each block's byte split (store/byte_split.h: how the store keeps
// chunks of 16-bit numbers), measured in 4 MiB blocks on one core; a split block's decompression
// includes joining its bytes again. Prints ratio and single-core compress/decompress throughput
// per kind; --json for a document. Reads at most --sample-mib MiB of each kind (default 2048),
// evenly spread.
//
//   gpusnap-compress-bench [--json] [--sample-mib N] ARTIFACT
#include <fcntl.h>
#include <unistd.h>
#include <zstd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "store/byte_split.h"

namespace {

constexpr size_t kBlock = 4u << 20;

struct Result {
  std::string kind;
  int level = 0;
  bool split = false;
  uint64_t bytes = 0;
  uint64_t compressed = 0;
  double compress_s = 0;
  double decompress_s = 0;
};

// A kind's files: its folder's *.img (images), or CRIU's pages-*.img.
std::vector<std::filesystem::path> files_of(const std::filesystem::path& dir, bool images) {
  std::vector<std::filesystem::path> out;
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    if (images ? name.ends_with(".img") : name.rfind("pages-", 0) == 0) out.push_back(e.path());
  }
  return out;
}

// Up to `budget` bytes from the files, blocks evenly spread over each.
std::vector<std::vector<char>> sample(const std::vector<std::filesystem::path>& files,
                                      uint64_t budget) {
  uint64_t total = 0;
  for (const auto& f : files) total += std::filesystem::file_size(f);
  std::vector<std::vector<char>> blocks;
  if (total == 0) return blocks;
  uint64_t stride = std::max<uint64_t>(kBlock, total / std::max<uint64_t>(1, budget / kBlock));
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    uint64_t size = std::filesystem::file_size(f);
    for (uint64_t off = 0; off + 1 < size && blocks.size() * kBlock < budget; off += stride) {
      std::vector<char> b(std::min<uint64_t>(kBlock, size - off));
      ssize_t n = ::pread(fd, b.data(), b.size(), static_cast<off_t>(off));
      if (n <= 0) break;
      b.resize(static_cast<size_t>(n));
      blocks.push_back(std::move(b));
    }
    ::close(fd);
  }
  return blocks;
}

Result measure(const std::string& kind, const std::vector<std::vector<char>>& blocks, int level,
               bool split) {
  Result r{kind, level, split};
  std::vector<char> out(ZSTD_compressBound(kBlock)), back(kBlock), halves(kBlock), joined(kBlock);
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  for (const auto& b : blocks) {
    auto t0 = std::chrono::steady_clock::now();
    const char* in = b.data();
    if (split) {
      gpusnap::store::split_bytes(b.data(), b.size(), halves.data());
      in = halves.data();
    }
    size_t c = ZSTD_compressCCtx(cctx, out.data(), out.size(), in, b.size(), level);
    auto t1 = std::chrono::steady_clock::now();
    size_t d = ZSTD_decompressDCtx(dctx, back.data(), back.size(), out.data(), c);
    const char* result = back.data();
    if (split && !ZSTD_isError(d)) {
      gpusnap::store::join_bytes(back.data(), d, joined.data());
      result = joined.data();
    }
    auto t2 = std::chrono::steady_clock::now();
    if (ZSTD_isError(c) || ZSTD_isError(d) || d != b.size() ||
        std::memcmp(result, b.data(), d) != 0) {
      std::fprintf(stderr, "zstd round trip failed\n");
      std::exit(1);
    }
    r.bytes += b.size();
    r.compressed += c;
    r.compress_s += std::chrono::duration<double>(t1 - t0).count();
    r.decompress_s += std::chrono::duration<double>(t2 - t1).count();
  }
  ZSTD_freeCCtx(cctx);
  ZSTD_freeDCtx(dctx);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  uint64_t budget = 2048ull << 20;
  std::filesystem::path artifact;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--sample-mib" && i + 1 < argc) {
      budget = std::stoull(argv[++i]) << 20;
    } else if (a == "--help" || a == "-h" || a.starts_with("-")) {
      std::fprintf(stderr, "usage: gpusnap-compress-bench [--json] [--sample-mib N] ARTIFACT\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    } else {
      artifact = a;
    }
  }
  if (artifact.empty()) {
    std::fprintf(stderr, "gpusnap-compress-bench: name an artifact directory\n");
    return 2;
  }
  std::vector<Result> results;
  for (const char* kind : {"host-images", "tier", "criu-pages"}) {
    const bool images = kind != std::string("criu-pages");
    auto blocks = sample(files_of(artifact / (images ? kind : "criu"), images), budget);
    if (blocks.empty()) continue;
    for (int level : {1, 3}) results.push_back(measure(kind, blocks, level, false));
    results.push_back(measure(kind, blocks, 1, true));
  }
  if (json) std::printf("[\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    double ratio =
        static_cast<double>(r.bytes) / static_cast<double>(std::max<uint64_t>(1, r.compressed));
    double cmbs = static_cast<double>(r.bytes) / 1e6 / r.compress_s;
    double dmbs = static_cast<double>(r.bytes) / 1e6 / r.decompress_s;
    if (json) {
      std::printf(
          "  {\"kind\": \"%s\", \"zstd_level\": %d, \"byte_split\": %s, \"sampled_bytes\": %llu, "
          "\"ratio\": %.3f, \"compress_mb_s_per_core\": %.0f, \"decompress_mb_s_per_core\": "
          "%.0f}%s\n",
          r.kind.c_str(), r.level, r.split ? "true" : "false",
          static_cast<unsigned long long>(r.bytes), ratio, cmbs, dmbs,
          i + 1 < results.size() ? "," : "");
    } else {
      std::printf("%-12s zstd -%d%s: %6.0f MiB sampled, ratio %.3f, compress %5.0f MB/s, "
                  "decompress %5.0f MB/s (one core)\n",
                  r.kind.c_str(), r.level, r.split ? " split" : "",
                  static_cast<double>(r.bytes) / (1 << 20), ratio, cmbs, dmbs);
    }
  }
  if (json) std::printf("]\n");
  return 0;
}
