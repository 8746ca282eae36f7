#include "tier/prefill.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

#include "artifact/chunk_hash.h"
#include "common/fd.h"
#include "gpusnap/error.h"
#include "tier/handover.h"

namespace gpusnap::tier {

Prefill::Prefill(TierDriver& driver, TierSettings settings, TierLayout layout,
                 std::filesystem::path dir, std::vector<std::string> files, int device,
                 std::uint64_t chunk_bytes, ArrivingFiles* arriving)
    : driver_(driver),
      settings_(settings),
      layout_(std::move(layout)),
      dir_(std::move(dir)),
      files_(std::move(files)),
      device_(device),
      chunk_bytes_(chunk_bytes),
      arriving_(arriving) {}

Prefill::~Prefill() { release_all(); }

void Prefill::release_all() noexcept {
  for (auto& m : made_) {
    try {
      if (m.mapped) driver_.unmap(m.here, m.segment.size);
      driver_.release(m.handle);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the process ends; the driver frees the rest
    }
  }
  made_.clear();
  if (base_ != 0) driver_.address_free(base_, reserved_);
  base_ = 0;
}

namespace {

// How far the making of the memory has got, for the workers that copy into it: a piece is
// copied once the segment that holds it is mapped, so the copies start with the first segment
// instead of after the last (making and mapping 17 GB took 0.13-0.37 s on the H200, all of it
// before the first copy).
class MadeSoFar {
 public:
  void one_more() {
    {
      std::lock_guard lock(mu_);
      ++mapped_;
    }
    changed_.notify_all();
  }
  // The making stopped short (it failed, or the workers did): nobody waits for more.
  void stopped() {
    {
      std::lock_guard lock(mu_);
      stopped_ = true;
    }
    changed_.notify_all();
  }
  // Blocks until segment `index` (in the order they are made) is mapped. Throws when the making
  // stopped before it: the maker's own error is what the fill reports.
  void wait_for(std::size_t index) {
    std::unique_lock lock(mu_);
    changed_.wait(lock, [&] { return mapped_ > index || stopped_; });
    if (mapped_ <= index) {
      throw Error(ErrorKind::kGpu, "memory tier prefill: the memory was not made");
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::size_t mapped_ = 0;
  bool stopped_ = false;
};

// Checksums one file in the artifact's chunks from the pieces read out of it, which one worker
// gives it in the order of their offsets.
class FileHasher {
 public:
  FileHasher(FileSums& sums, std::uint64_t chunk_bytes) : sums_(sums), chunk_(chunk_bytes) {}
  void add(std::uint64_t offset, const void* data, std::size_t size) {
    if (offset != sums_.size) sums_.complete = false;  // a gap or an overlap: not the file's sums
    if (!sums_.complete) return;
    const auto* p = static_cast<const unsigned char*>(data);
    while (size > 0) {
      const std::uint64_t room = chunk_ - sums_.size % chunk_;
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(room, size));
      hash_.update(p, take);
      p += take;
      size -= take;
      sums_.size += take;
      if (sums_.size % chunk_ == 0) {
        sums_.chunks.push_back(hash_.hex());
        hash_.reset();
      }
    }
  }
  // The last chunk, when the file does not end on a chunk's boundary (an empty file has one).
  void finish() {
    if (sums_.size % chunk_ != 0 || sums_.size == 0) sums_.chunks.push_back(hash_.hex());
  }

 private:
  FileSums& sums_;
  std::uint64_t chunk_;
  artifact::ChunkHash hash_;
};

}  // namespace

void Prefill::make(const std::stop_token& stop, const std::function<void()>& mapped_one) {
  driver_.use_device(device_);  // a thread of its own: no context is current in it
  DevicePtr at = base_;
  for (const auto& s : layout_.segments) {
    if (stop.stop_requested()) return;
    Made m{s, at, 0, false};
    if (!driver_.create_shareable(device_, s.size, &m.handle)) {
      throw Error(ErrorKind::kGpu,
                  "memory tier prefill: out of GPU memory on device " + std::to_string(device_));
    }
    made_.push_back(m);
    driver_.map(at, s.size, m.handle);
    made_.back().mapped = true;
    driver_.set_access(at, s.size, device_);
    at += s.size;
    mapped_one();
  }
}

Prefill::PlacedPieces Prefill::place_pieces() const {
  PlacedPieces placed{layout_.pieces, std::vector<std::size_t>(layout_.pieces.size())};
  // In address order, the order the segments are made in, so that the first copies wait the
  // least; when checksummed, each file's in the order of its bytes (the drain wrote every file in
  // address order: the same order).
  std::sort(placed.pieces.begin(), placed.pieces.end(),
            [this](const FilePiece& a, const FilePiece& b) {
              if (chunk_bytes_ > 0) return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
              return a.va < b.va;
            });
  std::vector<DevicePtr> here(layout_.segments.size());
  for (std::size_t k = 0, at = 0; k < here.size(); at += layout_.segments[k].size, ++k) {
    here[k] = base_ + at;
  }
  for (std::size_t i = 0; i < placed.pieces.size(); ++i) {
    auto& p = placed.pieces[i];
    // The segment holding the piece: read_layout sorted them and checked there is one.
    const auto s = std::upper_bound(layout_.segments.begin(), layout_.segments.end(), p.va,
                                    [](DevicePtr va, const LayoutSegment& x) { return va < x.va; });
    const auto k = static_cast<std::size_t>(s - layout_.segments.begin()) - 1;
    placed.segment_of[i] = k;
    p.va = here[k] + (p.va - layout_.segments[k].va);
    p.device = device_;
  }
  return placed;
}

TransferReport Prefill::fill() {
  const auto t0 = std::chrono::steady_clock::now();
  TransferReport report;
  try {
    // Left (the previous context put back) before release_all() below runs.
    const EnteredDevice entered(driver_, device_);
    // One reservation for all: each segment at its offset, so that a piece's address here is
    // its address in the copy moved by one constant per segment.
    for (const auto& s : layout_.segments) reserved_ += s.size;
    base_ = driver_.reserve(reserved_, driver_.granularity(device_));
    const PlacedPieces placed = place_pieces();
    for (const auto& p : placed.pieces) report.bytes += p.size;
    // Each file is read by one worker, from its first byte to its last, and checksummed as it
    // is read: its bytes are read once, for the GPU and for gpusnap's check.
    FillHooks hooks;
    std::vector<FileHasher> hashers;
    if (chunk_bytes_ > 0) {
      sums_.assign(files_.size(), FileSums{});
      hashers.reserve(files_.size());
      for (std::size_t f = 0; f < files_.size(); ++f) {
        sums_[f].name = files_[f];
        hashers.emplace_back(sums_[f], chunk_bytes_);
      }
      hooks.one_worker_per_file = true;
      hooks.read = [&](std::size_t i, std::uint64_t offset, const void* data, std::size_t size) {
        hashers.at(placed.pieces[i].file).add(offset, data, size);
      };
    }
    if (arriving_ != nullptr) {
      hooks.before_read = [this](std::size_t file, std::uint64_t end) {
        arriving_->wait(file, end);
      };
    }
    // The memory is made on a thread of its own while the workers read the files and copy
    // each piece as soon as its segment is mapped.
    MadeSoFar made_so_far;
    hooks.before_copy = [&](std::size_t i) { made_so_far.wait_for(placed.segment_of[i]); };
    std::exception_ptr making_failed;
    double making_seconds = 0;
    std::jthread maker([&](const std::stop_token& stop) {
      try {
        make(stop, [&] { made_so_far.one_more(); });
        making_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } catch (...) {
        making_failed = std::current_exception();
      }
      made_so_far.stopped();
    });
    try {
      fill_from_files(driver_, settings_, dir_, files_, placed.pieces, report, hooks);
    } catch (...) {
      maker.request_stop();
      maker.join();
      if (making_failed) std::rethrow_exception(making_failed);
      throw;
    }
    maker.join();
    if (making_failed) std::rethrow_exception(making_failed);  // no piece waited for the rest
    for (auto& h : hashers) h.finish();
    report.map_seconds = making_seconds;
    driver_.synchronize(device_);
  } catch (...) {
    release_all();
    throw;
  }
  report.pieces = layout_.pieces.size();
  report.files = files_.size();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

bool Prefill::hand_over(int sock) {
  std::vector<OfferedSegment> offer;
  for (const auto& m : made_) {
    offer.push_back({m.segment.va, m.segment.size, common::UniqueFd(driver_.export_fd(m.handle))});
  }
  send_offer(sock, offer);
  return receive_answer(sock);
}

}  // namespace gpusnap::tier
