#include "store/peers.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>

#include <httplib.h>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/digest.h"
#include "store/mirrors.h"

namespace gpusnap::store {

namespace {

using Clock = std::chrono::steady_clock;

Error bad_peers(const std::string& why) {
  return Error(ErrorKind::kUsage, why,
               "name peers as ADDR:PORT, separated by commas (--peers) or one a line "
               "(--peers-file), with --peer-token-file");
}

// ADDR:PORT with ADDR an IPv4 address or host name, or [IPv6]:PORT.
bool valid_peer(const std::string& p) {
  if (p.size() > 300) return false;
  const size_t colon = p.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == p.size()) return false;
  const std::string port = p.substr(colon + 1);
  if (port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit)) return false;
  const int n = std::stoi(port);
  if (n < 1 || n > 65535) return false;
  const std::string host = p.substr(0, colon);
  if (host.front() == '[') {
    return host.back() == ']' && host.size() > 2 &&
           std::all_of(host.begin() + 1, host.end() - 1, [](char c) {
             return std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.';
           });
  }
  return std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-';
  });
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

}  // namespace

std::string peer_name(const std::string& address, int port) {
  const bool v6 = address.find(':') != std::string::npos;
  return (v6 ? "[" + address + "]" : address) + ":" + std::to_string(port);
}

std::vector<std::string> parse_peer_list(std::string_view text, const std::string& where) {
  std::vector<std::string> out;
  size_t line_no = 0;
  while (!text.empty()) {
    const size_t end = text.find_first_of(",\n");
    std::string_view item = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    ++line_no;
    if (const size_t hash = item.find('#'); hash != std::string_view::npos) {
      item = item.substr(0, hash);
    }
    const std::string peer = trimmed(item);
    if (peer.empty()) continue;
    if (!valid_peer(peer)) {
      throw bad_peers(where + ": '" + peer.substr(0, 100) + "' (item " + std::to_string(line_no) +
                      ") is not ADDR:PORT");
    }
    if (std::find(out.begin(), out.end(), peer) != out.end()) continue;
    if (out.size() == kMaxPeers) throw bad_peers(where + ": more than 4,096 peers");
    out.push_back(peer);
  }
  return out;
}

std::shared_ptr<Peers> read_peers(const std::string& list, const std::string& file,
                                  const std::string& dns, const std::string& token_file) {
  if (list.empty() && file.empty() && dns.empty()) {
    if (!token_file.empty()) throw bad_peers("--peer-token-file needs --peers or --peers-file");
    return nullptr;
  }
  std::vector<std::string> peers = parse_peer_list(list, "--peers");
  if (!file.empty()) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(file, ec);
    if (ec) throw bad_peers("cannot read peers file " + file + ": " + ec.message());
    if (size > (1u << 20)) throw bad_peers("peers file " + file + " is larger than 1 MiB");
    for (auto& p : parse_peer_list(fs::read_file(file), file)) {
      if (std::find(peers.begin(), peers.end(), p) == peers.end()) peers.push_back(std::move(p));
    }
  }
  std::vector<std::string> names = parse_peer_list(dns, "--peers-dns");
  if (peers.empty() && names.empty()) throw bad_peers("the peers list names no peer");
  if (token_file.empty()) throw bad_peers("peers need the agents' token (--peer-token-file)");
  return std::make_shared<Peers>(
      std::move(peers), fs::read_token_file(token_file, "--peer-token-file"), std::move(names));
}

// One fetch of one digest, which every ask for it waits on.
struct PeerChunks::Flight {
  bool done = false;
  std::shared_ptr<const std::string> data;
  std::exception_ptr error;
  std::condition_variable ended;
};

PeerChunks::PeerChunks(PeerServing serving) : serving_(std::move(serving)) {
  serving_.registry.peers = nullptr;  // an owner fetches from its registries, never its peers
}

PeerChunks::~PeerChunks() = default;

std::shared_ptr<PullRegistries> PeerChunks::registries_for(const PeerRequest& r) {
  // With mu_ held. Connections, tokens and the mirrors' state kept per repository for a while.
  // A blob is named by its digest: the reference's digest only picks the mirrors as a pull by
  // digest does.
  Registries& slot = registries_[r.repository];
  if (!slot.registries || Clock::now() - slot.made > kRegistriesFor) {
    OciRef ref = OciRef::parse(std::string(kOciScheme) + r.repository + "@" + r.digest);
    // Refuses a registry the configuration blocks (Error kUsage).
    slot = {std::make_shared<PullRegistries>(ref, serving_.registry), Clock::now()};
  }
  return slot.registries;
}

std::string PeerChunks::get(const PeerRequest& r) {
  const auto& allowed = serving_.repositories;
  if (std::find(allowed.begin(), allowed.end(), r.repository) == allowed.end()) {
    throw Error(ErrorKind::kUsage, "this agent fetches no chunks of " + r.repository,
                "ask for chunks of the repository the agents' registry storage names");
  }
  std::optional<std::string> cached = from_cache(r);
  std::string data = cached ? std::move(*cached) : fetch(r);
  served_ += data.size();
  return data;
}

std::optional<std::string> PeerChunks::from_cache(const PeerRequest& r) const {
  BlobStore cache(serving_.cache);
  if (!cache.has(r.digest)) return std::nullopt;
  try {
    std::string data = cache.get(r.digest, r.size);
    if (data.size() == r.size) return data;
  } catch (const Error&) {  // NOLINT(bugprone-empty-catch): damaged and removed there: fetched
  }
  return std::nullopt;
}

std::string PeerChunks::fetch(const PeerRequest& r) {
  std::unique_lock lock(mu_);
  auto& slot = flights_[r.digest];
  if (slot) {
    // Another ask fetches it: wait for that fetch, whatever it brings.
    std::shared_ptr<Flight> flight = slot;
    flight->ended.wait(lock, [&] { return flight->done; });
    if (flight->error) std::rethrow_exception(flight->error);
    if (flight->data->size() != r.size) {
      throw Error(ErrorKind::kNotFound,
                  "chunk " + r.digest + " is not " + std::to_string(r.size) + " bytes long");
    }
    return *flight->data;
  }
  auto flight = std::make_shared<Flight>();
  slot = flight;
  slot_free_.wait(lock, [&] { return fetching_ < serving_.max_fetches; });
  ++fetching_;
  std::shared_ptr<const std::string> data;
  std::exception_ptr error;
  std::shared_ptr<PullRegistries> registries;
  try {
    registries = registries_for(r);
    lock.unlock();
    // A fetch of it may have ended between the caller's look at the cache and this one's start.
    if (std::optional<std::string> cached = from_cache(r)) {
      data = std::make_shared<const std::string>(std::move(*cached));
    } else {
      auto got = std::make_shared<std::string>(registries->fetch_blob(r.digest, r.size));
      BlobStore(serving_.cache).put(r.digest, *got);  // checked against its digest by the fetch
      fetched_ += got->size();
      data = std::move(got);
    }
  } catch (...) {
    error = std::current_exception();
  }
  // Notes are for one pull's report, and this fetcher lives as long as the agent.
  if (registries) (void)registries->take_notes();
  if (!lock.owns_lock()) lock.lock();
  --fetching_;
  slot_free_.notify_one();
  flight->done = true;
  flight->data = data;
  flight->error = error;
  flights_.erase(r.digest);
  flight->ended.notify_all();
  if (error) std::rethrow_exception(error);
  return *data;
}

struct Peers::Answer {
  std::optional<std::string> data;
  bool unreachable = false;  // failed to connect: the next peer in rank is asked
  std::string why;
};

Peers::Peers(std::vector<std::string> peers, std::string token, std::vector<std::string> dns)
    : peers_(std::move(peers)), token_(std::move(token)), dns_(std::move(dns)) {}

std::vector<std::string> Peers::members() {
  std::unique_lock lock(mu_);
  if (dns_.empty()) return peers_;
  if (resolved_ != Clock::time_point{} && Clock::now() - resolved_ < kResolveEvery) {
    return members_;
  }
  resolved_ = Clock::now();  // one thread resolves; the others use the last list meanwhile
  const std::vector<std::string> names = dns_;
  lock.unlock();
  std::vector<std::string> found = peers_;
  for (const std::string& entry : names) {
    const size_t colon = entry.rfind(':');
    const std::string name = entry.substr(0, colon);
    const std::string port = entry.substr(colon + 1);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    if (::getaddrinfo(name.c_str(), port.c_str(), &hints, &list) != 0) continue;
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(list, ::freeaddrinfo);
    for (const addrinfo* a = list; a != nullptr && found.size() < kMaxPeers; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      if (a->ai_family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, text,
                    sizeof text);
        found.push_back(std::string(text) + ":" + port);
      } else if (a->ai_family == AF_INET6) {
        ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                    sizeof text);
        found.push_back("[" + std::string(text) + "]:" + port);
      }
    }
  }
  std::sort(found.begin(), found.end());
  found.erase(std::unique(found.begin(), found.end()), found.end());
  lock.lock();
  members_ = found;
  return found;
}

void Peers::serve_self(const std::string& self, std::shared_ptr<PeerChunks> local) {
  self_ = self;
  local_ = std::move(local);
}

bool Peers::down(const std::string& peer) {
  std::lock_guard lock(mu_);
  auto it = down_until_.find(peer);
  if (it == down_until_.end()) return false;
  if (Clock::now() < it->second) return true;
  down_until_.erase(it);
  return false;
}

Peers::Answer Peers::ask(const std::string& peer, const PeerRequest& r) const {
  const size_t colon = peer.rfind(':');
  std::string host = peer.substr(0, colon);
  if (host.front() == '[') host = host.substr(1, host.size() - 2);
  httplib::Client client(host, std::stoi(peer.substr(colon + 1)));
  client.set_connection_timeout(std::chrono::seconds(3));
  client.set_read_timeout(kReadTimeout);
  client.set_keep_alive(false);
  Answer a;
  std::string body;
  int status = 0;
  bool too_large = false;
  const auto result = client.Get(
      r.target(), {{"Authorization", "Bearer " + token_}},
      [&](const httplib::Response& res) {
        status = res.status;
        return status == 200;  // an error's body is not read
      },
      [&](const char* data, size_t n) {
        // No more than the manifest says: a peer cannot make a node hold more.
        if (body.size() + n > r.size) return !(too_large = true);
        body.append(data, n);
        return true;
      });
  if (!result && result.error() == httplib::Error::Connection) {
    a.unreachable = true;
    a.why = "cannot connect";
    return a;
  }
  if (status != 0 && status != 200) {
    a.why = "answered HTTP " + std::to_string(status);
    return a;
  }
  if (too_large) {
    a.why = "sent more bytes than the chunk has";
    return a;
  }
  if (!result) {
    a.why = httplib::to_string(result.error());
    return a;
  }
  if (body.size() != r.size || sha256_digest(body) != r.digest) {
    a.why = "sent a chunk that does not match its digest (refused)";
    return a;
  }
  a.data = std::move(body);
  return a;
}

std::optional<std::string> Peers::fetch(const OciRef& ref, const std::string& digest, uint64_t size,
                                        const std::function<void(const std::string&)>& note) {
  if (size == 0 || size > kMaxPeerBlobBytes) return std::nullopt;  // no peer serves it
  PeerRequest r{digest, size, ref.host + "/" + ref.repository};
  for (const std::string& peer : rank_peers(members(), digest)) {
    if (down(peer)) continue;
    if (peer == self_ && local_) {
      try {
        return local_->get(r);  // checked against its digest by the registry's fetch
      } catch (const Error& e) {
        note("this node's own agent could not fetch a chunk (" + std::string(e.what()) +
             "); fetched from the registries");
        return std::nullopt;
      }
    }
    Answer a = ask(peer, r);
    if (a.data) return std::move(a.data);
    note("peer " + peer + " " + a.why + (a.unreachable ? ": left out for 30 s" : "") +
         "; its chunks fetched " + (a.unreachable ? "from the next peer" : "from the registries"));
    if (!a.unreachable) return std::nullopt;
    std::lock_guard lock(mu_);
    down_until_[peer] = Clock::now() + kDownFor;
  }
  return std::nullopt;
}

}  // namespace gpusnap::store
