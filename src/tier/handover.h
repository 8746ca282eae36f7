// Prefilled memory handed from gpusnap-tier-prefill to a copy's tier (tier/prefill.h,
// Tier::adopt) over a Unix SOCK_SEQPACKET socket, whose records keep their boundaries and carry
// descriptors: a header (magic, count), then one record per segment (its address and size in
// the copy) with the memory's descriptor as SCM_RIGHTS, then the copy's one-byte answer ('y':
// mapped, the sender may let go; 'n': not). Every record is fixed-size; a receiver bounds the
// count before it reads more.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <vector>

#include "common/fd.h"
#include "tier/tier_driver.h"

namespace gpusnap::tier {

struct OfferedSegment {
  DevicePtr va = 0;
  std::size_t size = 0;
  common::UniqueFd fd;
};

// The listening socket at `path` (a stale one there is replaced), mode 0600.
common::UniqueFd listen_for_handover(const std::filesystem::path& path);
// A connection to `path`, whose receives time out after `timeout`. Throws Error(kInternal).
common::UniqueFd connect_for_handover(const std::filesystem::path& path,
                                      std::chrono::milliseconds timeout);

// Sender: the header and one record per segment, `fds[i]` with `segments[i]`.
void send_offer(int sock, const std::vector<OfferedSegment>& segments);
// Receiver: the offer, at most `max_segments` records. Throws Error(kInternal) on anything
// else (a short or malformed record, a missing descriptor, a timeout, the sender gone).
std::vector<OfferedSegment> receive_offer(int sock, std::size_t max_segments);
void send_answer(int sock, bool mapped) noexcept;
// True for 'y'; false for 'n', the receiver gone, or a timeout.
bool receive_answer(int sock);

}  // namespace gpusnap::tier
