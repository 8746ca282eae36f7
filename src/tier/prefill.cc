#include "tier/prefill.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "common/fd.h"
#include "gpusnap/error.h"
#include "tier/handover.h"

namespace gpusnap::tier {

Prefill::Prefill(TierDriver& driver, TierSettings settings, TierLayout layout,
                 std::filesystem::path dir, std::vector<std::string> files, int device)
    : driver_(driver),
      settings_(settings),
      layout_(std::move(layout)),
      dir_(std::move(dir)),
      files_(std::move(files)),
      device_(device) {}

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

TransferReport Prefill::fill() {
  const auto t0 = std::chrono::steady_clock::now();
  TransferReport report;
  driver_.enter_device(device_);
  try {
    // One reservation for all: each segment at its offset, so that a piece's address here is
    // its address in the copy moved by one constant per segment.
    for (const auto& s : layout_.segments) reserved_ += s.size;
    base_ = driver_.reserve(reserved_, driver_.granularity(device_));
    DevicePtr at = base_;
    for (const auto& s : layout_.segments) {
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
    }
    report.map_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<FilePiece> pieces = layout_.pieces;
    for (auto& p : pieces) {
      // The segment holding the piece: read_layout sorted them and checked there is one.
      auto m = std::upper_bound(made_.begin(), made_.end(), p.va,
                                [](DevicePtr va, const Made& x) { return va < x.segment.va; });
      --m;
      p.va = m->here + (p.va - m->segment.va);
      p.device = device_;
      report.bytes += p.size;
    }
    report.buffer_seconds = fill_from_files(driver_, settings_, dir_, files_, pieces);
    driver_.synchronize(device_);
  } catch (...) {
    driver_.leave_device();
    release_all();
    throw;
  }
  driver_.leave_device();
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
