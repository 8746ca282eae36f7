#include "store/chunker.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "common/fd.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/worker_pool.h"
#include "gpusnap/error.h"
#include "store/byte_split.h"
#include "store/digest.h"
#include "tier/folder_format.h"
#include "tier/layout.h"

namespace gpusnap::store {

namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kZeroBlock = 64 << 10;

struct Task {
  size_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool compress = false;
};

common::UniqueFd open_read(const std::filesystem::path& path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw sys_error("open " + path.string(), errno);
  return fd;
}

void pread_full(int fd, char* buf, uint64_t length, uint64_t offset, const std::string& path) {
  for (uint64_t done = 0; done < length;) {
    ssize_t n = ::pread(fd, buf + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw sys_error("read " + path, errno);
    if (n == 0) {
      throw Error(ErrorKind::kBadArtifact, path + " is shorter than its manifest says",
                  "verify the artifact (`gpusnap verify`)");
    }
    done += static_cast<uint64_t>(n);
  }
}

bool all_zero(const char* p, uint64_t n) {
  // Word at a time: the buffers are 4 KiB-aligned allocations, sizes multiples of 8 but for
  // the tail.
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w != 0) return false;
  }
  for (; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// How a chunk is best stored, from three 16 KiB samples (its start, middle and end) compressed at
// the chunk's level, as they are and byte-split (store/byte_split.h): the encoding whose samples
// come out smaller (the split by a twentieth), or raw when neither saves 3 %. Memory that does not
// compress (encrypted, random, already compressed: most of a large pages image here) then costs a
// few small compressions instead of one of the whole chunk, which cost ~0.4 s of CPU per GiB
// pushed. A function of the chunk's bytes alone: the same chunk is always stored the same way.
Encoding choose_encoding(ZSTD_CCtx* cctx, char* out, size_t out_size, char* split,
                         std::string_view blob, int level) {
  constexpr size_t kSample = 16 << 10;
  if (blob.size() <= 8 * kSample) return Encoding::kZstd;
  size_t in = 0;
  size_t plain = 0;
  size_t halves = 0;
  for (size_t at : {size_t{0}, (blob.size() - kSample) / 2, blob.size() - kSample}) {
    // Even offsets stay even in the sample, so that its split pairs the bytes as the chunk's does.
    at &= ~size_t{1};
    const size_t z = ZSTD_compressCCtx(cctx, out, out_size, blob.data() + at, kSample, level);
    // The halves apart: in a whole chunk they fill blocks of their own (zstd's 128 KiB), each
    // with its own statistics, which one 16 KiB sample of both would mix.
    split_bytes(blob.data() + at, kSample, split);
    const size_t ze = ZSTD_compressCCtx(cctx, out, out_size, split, kSample / 2, level);
    const size_t zo =
        ZSTD_compressCCtx(cctx, out, out_size, split + kSample / 2, kSample / 2, level);
    if (ZSTD_isError(z) || ZSTD_isError(ze) || ZSTD_isError(zo)) return Encoding::kZstd;
    in += kSample;
    plain += z;
    halves += ze + zo;
  }
  if (std::min(plain, halves) > in - in * 3 / 100) return Encoding::kRaw;
  // Split only where it saves a twentieth more: its join is one more pass when decoding.
  return halves < plain - plain / 20 ? Encoding::kZstdSplit2 : Encoding::kZstd;
}

// Data ranges of a (sparse) file, from SEEK_DATA/SEEK_HOLE.
std::vector<std::pair<uint64_t, uint64_t>> data_ranges(int fd, uint64_t size) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (off_t pos = 0; static_cast<uint64_t>(pos) < size;) {
    off_t data = ::lseek(fd, pos, SEEK_DATA);
    if (data < 0) break;  // ENXIO: no data past pos
    off_t hole = ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0) hole = static_cast<off_t>(size);
    out.emplace_back(data, std::min<uint64_t>(hole, size));
    pos = hole;
  }
  return out;
}

// Fixed chunks from `first` on; chunks that lie wholly in holes are left out.
void plan_fixed(size_t file, int fd, uint64_t size, uint64_t first, uint64_t chunk,
                std::vector<Task>& tasks) {
  auto ranges = data_ranges(fd, size);
  size_t r = 0;
  auto add = [&](uint64_t off, uint64_t len) {
    while (r < ranges.size() && ranges[r].second <= off) ++r;
    if (r < ranges.size() && ranges[r].first < off + len) tasks.push_back({file, off, len, false});
  };
  if (first > 0) add(0, std::min(first, size));
  for (uint64_t off = first; off < size; off += chunk) add(off, std::min(chunk, size - off));
}

// Content-defined cuts on page boundaries (see the header).
void plan_cdc(size_t file, int fd, uint64_t size, const ChunkingOptions& o, const std::string& path,
              std::vector<Task>& tasks) {
  const uint64_t mask = (o.cdc_average / kPage) - 1;
  std::vector<char> buf(8 << 20);
  uint64_t start = 0;
  for (uint64_t base = 0; base < size;) {
    const uint64_t n = std::min<uint64_t>(buf.size(), size - base);
    pread_full(fd, buf.data(), n, base, path);
    for (uint64_t p = 0; p < n; p += kPage) {
      const uint64_t page_end = std::min(base + p + kPage, size);
      const uint64_t len = page_end - start;
      // The hash of the page's first 64 bytes: enough to place cuts by content, and cheap.
      const uint64_t h = XXH3_64bits(buf.data() + p, std::min<uint64_t>(64, n - p));
      if (len >= o.cdc_max || (len >= o.cdc_min && (h & mask) == 0)) {
        tasks.push_back({file, start, len, o.compress});
        start = page_end;
      }
    }
    base += n;
  }
  if (start < size) tasks.push_back({file, start, size - start, o.compress});
}

// The pieces of each drain file of the artifact's memory tier, by the file's path in the
// artifact, from the PID.layout beside it. A drain file whose layout is missing or does not read
// is absent: it is cut like any other file. The layout is only ever used to choose cuts; every
// chunk's digest is of the bytes read.
std::map<std::string, std::vector<Cut>> tier_pieces(const Artifact& artifact) {
  namespace folder = tier::folder;
  const std::string dir = std::string(folder::kDirName) + "/";
  std::map<std::string, std::vector<std::string>> drain_files;  // by PID
  std::map<std::string, std::string> layouts;                   // PID -> path
  for (const auto& f : artifact.manifest().files) {
    const folder::Entry e = folder::classify_in_artifact(f.path);
    if (e.kind == folder::EntryKind::kDrainFile) drain_files[e.pid].push_back(f.path);
    if (e.kind == folder::EntryKind::kLayout) layouts[e.pid] = f.path;
  }
  std::map<std::string, std::vector<Cut>> out;
  for (const auto& [pid, path] : layouts) {
    if (drain_files.count(pid) == 0) continue;
    tier::TierLayout layout;
    try {
      layout = tier::read_layout(artifact.root() / path);  // bounded; checks its own counts
    } catch (const Error&) {
      continue;
    }
    std::vector<std::vector<Cut>> by_file(layout.files);
    for (const auto& p : layout.pieces) by_file[p.file].push_back({p.offset, p.size});
    for (size_t k = 0; k < layout.files; ++k) {
      out[dir + folder::drain_file_name(pid, k)] = std::move(by_file[k]);
    }
  }
  return out;
}

// The cuts of drain file `path` from its layout's pieces; nothing when it has no layout, or its
// pieces do not fit it.
std::optional<std::vector<Cut>> tier_cuts(const std::map<std::string, std::vector<Cut>>& pieces,
                                          const std::string& path, uint64_t size,
                                          const ChunkingOptions& o) {
  const auto it = pieces.find(path);
  if (it == pieces.end()) return std::nullopt;
  return plan_tier_cuts(it->second, size, o);
}

// Per-thread scratch: the read buffer, the compression buffer and context.
struct Scratch {
  std::unique_ptr<char[]> in;
  std::unique_ptr<char[]> split;  // a chunk's byte split, for Encoding::kZstdSplit2
  std::unique_ptr<char[]> out;
  size_t out_size = 0;
  std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> cctx{nullptr, ZSTD_freeCCtx};
};

}  // namespace

std::optional<std::vector<Cut>> plan_tier_cuts(std::vector<Cut> pieces, uint64_t size,
                                               const ChunkingOptions& o) {
  std::sort(pieces.begin(), pieces.end(),
            [](const Cut& a, const Cut& b) { return a.offset < b.offset; });
  std::vector<Cut> cuts;
  // Fixed chunks from `offset`: the same bytes give the same chunks wherever they start.
  const auto fixed = [&](uint64_t offset, uint64_t length) {
    for (uint64_t done = 0; done < length; done += o.host_image_chunk) {
      cuts.push_back({offset + done, std::min(o.host_image_chunk, length - done)});
    }
  };
  std::optional<Cut> glued;
  const auto close_glued = [&] {
    if (glued) cuts.push_back(*glued);
    glued.reset();
  };
  uint64_t pos = 0;
  for (const Cut& p : pieces) {
    if (p.length == 0) continue;
    if (p.offset < pos || p.offset > size || p.length > size - p.offset) return std::nullopt;
    if (p.offset > pos) {
      close_glued();
      fixed(pos, p.offset - pos);
    }
    if (p.length >= o.tier_glue_below) {
      close_glued();
      fixed(p.offset, p.length);
    } else {
      if (glued && glued->length + p.length > o.cdc_max) close_glued();
      if (glued) {
        glued->length += p.length;
      } else {
        glued = p;
      }
      if (glued->length >= o.tier_glue_below) close_glued();
    }
    pos = p.offset + p.length;
  }
  close_glued();
  if (pos < size) fixed(pos, size - pos);
  return cuts;
}

Layout chunk_artifact(const Artifact& artifact, const ChunkingOptions& o, const ChunkSink& sink,
                      Reporter& reporter, std::string_view progress_name) {
  if (o.cdc_average < kPage || (o.cdc_average & (o.cdc_average - 1)) != 0 ||
      o.cdc_max > kMaxChunkBytes || o.host_image_chunk > kMaxChunkBytes ||
      o.host_image_chunk == 0 || o.cdc_min > o.cdc_max || o.tier_glue_below > o.cdc_max) {
    throw Error(ErrorKind::kUsage, "bad chunk sizes");
  }
  const Manifest& m = artifact.manifest();
  std::map<std::string, uint64_t> host_image_offset;
  for (const auto& h : m.host_images) host_image_offset[h.file] = h.file_offset;

  Layout layout;
  // The manifest as written, fields this version does not know included; read bounded in depth
  // like every artifact's (it is written out again into the layout).
  std::string why;
  std::optional<nlohmann::json> doc =
      json_text::parse(fs::read_file(artifact.root() / kManifestName), &why);
  if (!doc) {
    throw Error(ErrorKind::kBadArtifact,
                (artifact.root() / kManifestName).string() + " is not JSON: " + why);
  }
  layout.manifest = std::move(*doc);
  const std::map<std::string, std::vector<Cut>> pieces = tier_pieces(artifact);
  std::vector<common::UniqueFd> fds;
  std::vector<Task> tasks;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    layout.files.push_back({f.path, f.size, {}});
    const auto path = artifact.root() / f.path;
    fds.push_back(open_read(path));
    if (auto it = host_image_offset.find(f.path); it != host_image_offset.end()) {
      plan_fixed(i, fds.back().get(), f.size, it->second, o.host_image_chunk, tasks);
    } else if (auto cuts = tier_cuts(pieces, f.path, f.size, o)) {
      for (const Cut& c : *cuts) tasks.push_back({i, c.offset, c.length, o.compress});
    } else {
      plan_cdc(i, fds.back().get(), f.size, o, path.string(), tasks);
    }
  }

  uint64_t total = 0;
  for (const auto& t : tasks) total += t.length;
  std::vector<std::optional<Extent>> extents(tasks.size());
  std::atomic<uint64_t> done{0};
  std::mutex scratch_mu;
  std::vector<std::unique_ptr<Scratch>> free_scratch;
  const uint64_t max_len = std::max(o.cdc_max, o.host_image_chunk);

  common::for_each_index(
      tasks.size(), o.threads,
      [&](size_t i) {
        std::unique_ptr<Scratch> s;
        {
          std::lock_guard lock(scratch_mu);
          if (!free_scratch.empty()) {
            s = std::move(free_scratch.back());
            free_scratch.pop_back();
          }
        }
        if (!s) {
          s = std::make_unique<Scratch>();
          s->in.reset(new char[max_len]);
          s->split.reset(new char[max_len]);
          s->out_size = ZSTD_compressBound(max_len);
          s->out.reset(new char[s->out_size]);
          s->cctx.reset(ZSTD_createCCtx());
        }
        const Task& t = tasks[i];
        const auto& f = m.files[t.file];
        pread_full(fds[t.file].get(), s->in.get(), t.length, t.offset, f.path);
        // Trim all-zero 64 KiB blocks at both ends (the grid starts at the chunk's start).
        uint64_t lo = 0;
        uint64_t hi = t.length;
        while (lo < hi && all_zero(s->in.get() + lo, std::min(kZeroBlock, hi - lo))) {
          lo += std::min(kZeroBlock, hi - lo);
        }
        while (hi > lo) {
          uint64_t block_start = lo + ((hi - lo - 1) / kZeroBlock) * kZeroBlock;
          if (!all_zero(s->in.get() + block_start, hi - block_start)) break;
          hi = block_start;
        }
        if (lo < hi) {
          Extent e{t.offset + lo, hi - lo, {}, Encoding::kRaw, hi - lo};
          std::string_view blob(s->in.get() + lo, hi - lo);
          const Encoding encoding = t.compress
                                        ? choose_encoding(s->cctx.get(), s->out.get(), s->out_size,
                                                          s->split.get(), blob, o.zstd_level)
                                        : Encoding::kRaw;
          if (encoding != Encoding::kRaw) {
            const char* source = blob.data();
            if (encoding == Encoding::kZstdSplit2) {
              split_bytes(blob.data(), blob.size(), s->split.get());
              source = s->split.get();
            }
            size_t z = ZSTD_compressCCtx(s->cctx.get(), s->out.get(), s->out_size, source,
                                         blob.size(), o.zstd_level);
            // Kept only when it saves a tenth: below that the reader's decompression costs
            // more than the bytes save.
            if (!ZSTD_isError(z) && z <= blob.size() - blob.size() / 10) {
              blob = std::string_view(s->out.get(), z);
              e.encoding = encoding;
              e.stored = z;
            }
          }
          Sha256 h;
          h.update(blob.data(), blob.size());
          e.digest = h.finish();
          sink(Chunk{t.file, e, blob});
          extents[i] = std::move(e);
        }
        done += t.length;
        std::lock_guard lock(scratch_mu);
        free_scratch.push_back(std::move(s));
      },
      [&] { reporter.progress(progress_name, done.load(), total); });

  for (size_t i = 0; i < tasks.size(); ++i) {
    if (extents[i]) layout.files[tasks[i].file].extents.push_back(std::move(*extents[i]));
  }
  return layout;
}

}  // namespace gpusnap::store
